"""Static tiling of the Mosaic GPU ragged kernel: a validated frozen dataclass, the shared
memory it needs, and defaults derived from shapes.

Shapes the Hopper primitives impose (checked in ``check_shapes``):
- M, the packed query rows of one KV head (Q query rows times G heads), is padded to a
  multiple of 64: one warpgroup-wide ``wgmma`` covers 64 rows.
- J, the KV positions of one chunk, is a multiple of 64: J is the N of the score
  ``wgmma``, the K of the probability ``wgmma``, and the rows of a tile loaded into
  registers in the wgmma layout (64 rows a warpgroup). Staged plans (``OperandPlan``) also
  take J = 16 or 32 (``SMALL_CHUNKS``), the one way float32 K/V at D = 256 fits a
  program's shared memory: the kernel then converts each [J, D] tile as its transpose
  [D, J] (D rows) and gives the V operand a J * 2-byte swizzle (a wgmma's K comes in
  swizzle-wide groups).
- D is a multiple of 16 up to 256 (a row of a bfloat16 operand is a whole number of
  32-byte swizzle groups, the smallest Mosaic GPU swizzle; the dots take K = D in groups of
  the swizzle's width). One-byte pages whose rows are not a whole number of 32-byte groups
  (D = 48, 80, 112) land in an unswizzled ring and are loaded from it in the wgmma layout
  (only the staging reads the ring of a quantised pool).
- Z is a multiple of 8 (a copy lands on whole 8-row tiles of shared memory) up to 128 that
  divides J or that J divides. A chunk is copied in units of min(Z, J) positions: J / Z
  whole pages, or (Z > J) part of one page.
"""

from __future__ import annotations

import dataclasses

ROW_TILE = 64         # rows of one warpgroup wgmma (M granularity) and of a register tile
CHUNK_TILE = 64       # granularity of J
SMALL_CHUNKS = (16, 32)  # J below CHUNK_TILE, for staged plans (see the module docstring)
OUT_ROW_TILE = 8      # rows of the partial outputs written back (a shared-memory tile)
LSE_TILE = 32         # entries of the log-sum-exp rows written back (128 bytes of f32)
MAX_HEAD_DIM = 256
# Granularity of D: 16 two-byte elements fill the smallest swizzle (32 bytes).
HEAD_DIM_TILE = 16
MAX_STAGES = 4
# One barrier per (stage, page) for K+V; Mosaic GPU tracks the phases of one barrier
# array in a 32-bit mask.
MAX_BARRIERS = 32
# Shared memory one block may opt into on H100/H200 (and what Mosaic GPU assumes when it
# lowers without a device): 227 KiB.
SHARED_MEMORY_BUDGET = 227 * 1024
# Allocation slack: barriers, and 1 KiB alignment of each swizzled buffer.
_SLACK = 4 * 1024
# SMs of an H100 / H200: the programs of one wave when each SM holds one.
NUM_SMS = 132
# Programs (CTAs) worth launching before split-K stops paying off: two waves of an
# H100/H200, one CTA per SM. A constant: the kernel reads no device.
TARGET_PROGRAMS = 2 * NUM_SMS
MAX_SPLITS = 32
# Each split should walk at least this many chunks, or the partial-output traffic of
# split-K outweighs the parallelism it buys.
MIN_CHUNKS_PER_SPLIT = 2


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def packed_rows(q_tile: int, group: int) -> int:
  """M: the Q * G packed (query row, head) pairs of one KV head, padded to 64."""
  return round_up(q_tile * group, ROW_TILE)


def out_rows(q_tile: int, group: int) -> int:
  """Rows of the partial outputs the kernel writes back: Q * G padded to 8 (not to M, so a
  decode item with G = 4 writes 8 rows, not 64)."""
  return round_up(q_tile * group, OUT_ROW_TILE)


def lse_rows(q_tile: int, group: int) -> int:
  return round_up(q_tile * group, LSE_TILE)


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  """How K/V tiles reach the tensor cores (derived from dtypes, static).

  Attributes:
    storage_itemsize: bytes per element of the pages as stored (the TMA copies these).
    mma_dtype_name: the 16-bit dtype the wgmma operands hold ("bfloat16" or "float16").
    pieces: 1, or 3 for float32 compute: each float32 operand is split into three
      bfloat16 pieces (hi + mid + lo) and each product summed over the six piece pairs
      whose orders add up to at most 2, float32 accuracy from bfloat16 tensor cores.
    staged: tiles are converted through registers (storage bits -> logical dtype, the
      piece split) into separate operand buffers; otherwise the wgmma reads the TMA
      destination directly.
    scaled: quantised pools (int8 / float8 with per-token scales). The K and V operands
      are the stored values themselves, one piece in the mma dtype (every int8, float8
      e4m3fn and e5m2 value is exact in bfloat16), and each token's scale multiplies its
      column of the scores (``s_j = (q . k_j) * k_scale_j``) and of the probabilities
      before the update (``sum_j (p_j * v_scale_j) v_j``): exact rewrites of the dequantised
      product, so the dots see no rounding of the dequantised values.
  """

  storage_itemsize: int
  mma_dtype_name: str
  pieces: int
  staged: bool
  scaled: bool = False

  @property
  def kv_pieces(self) -> int:
    """Pieces of each K and V operand: one for quantised values, else ``pieces``."""
    return 1 if self.scaled else self.pieces


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
  """Static tiling of ``pallas_kernels.mosaic_gpu.ragged_paged_attention``.

  Attributes:
    q_tile: Q, query rows per work item; the Q * G (row, head) pairs of one KV head are
      the M rows of the dots, padded to a multiple of 64.
    chunk_size: J, KV positions per pipeline step, a multiple of 64 (J / Z pages when
      Z <= J, a J-position part of a page when Z > J).
    num_splits: X, split-K factor: each item's KV range is cut into X contiguous pieces
      handled by separate programs and merged by log-sum-exp (flash-decoding).
    num_stages: chunks whose pages are in flight (TMA) at once, the depth of the ring of
      shared-memory buffers.
  """

  q_tile: int
  chunk_size: int
  num_splits: int
  num_stages: int = 2

  def __post_init__(self):
    for name in ("q_tile", "chunk_size", "num_splits", "num_stages"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    if self.num_stages > MAX_STAGES:
      raise ValueError(f"num_stages={self.num_stages} must be <= {MAX_STAGES}")
    if self.chunk_size % CHUNK_TILE and self.chunk_size not in SMALL_CHUNKS:
      raise ValueError(f"chunk_size={self.chunk_size} must be a multiple of {CHUNK_TILE} "
                       f"(or one of {SMALL_CHUNKS} when K/V are staged)")

  def copies_per_chunk(self, block_size: int) -> int:
    """Page copies (TMA) of K, and of V, per chunk: J / min(Z, J)."""
    return self.chunk_size // min(block_size, self.chunk_size)

  def shared_memory_bytes(self, *, group: int, block_size: int, head_dim: int,
                          plan: OperandPlan) -> int:
    """Shared memory one program allocates (an estimate that errs high).

    The main loop holds: the packed queries (``pieces`` bfloat16/float16 copies, M x D),
    the ring of ``num_stages`` K and V chunks as stored (J x D each), and when ``staged``
    one K and one V operand chunk per K/V piece (``kv_pieces``). The epilogue reuses that
    memory for the float32 partial output (M x D) and its log-sum-exp. Slack covers
    barriers and the 1 KiB alignment of swizzled buffers.
    """
    rows = packed_rows(self.q_tile, group)
    chunk = self.chunk_size
    q_bytes = plan.pieces * rows * head_dim * 2
    ring = self.num_stages * 2 * chunk * head_dim * plan.storage_itemsize
    staged = 2 * plan.kv_pieces * chunk * head_dim * 2 if plan.staged else 0
    loop = q_bytes + ring + staged
    epilogue = rows * head_dim * 4 + lse_rows(self.q_tile, group) * 4
    return max(loop, epilogue) + _SLACK

  def check_shapes(self, *, group: int, block_size: int, head_dim: int,
                   plan: OperandPlan) -> None:
    """Shape-dependent checks; raises ``ValueError`` naming the field or dimension."""
    if head_dim % HEAD_DIM_TILE or head_dim > MAX_HEAD_DIM:
      raise ValueError(f"head_dim D={head_dim} (q.shape[2]) must be a multiple of "
                       f"{HEAD_DIM_TILE} up to {MAX_HEAD_DIM} for the Mosaic GPU kernel")
    if block_size % 8 or block_size > 128:
      raise ValueError(f"block_size Z={block_size} (k_pages.shape[3]) must be a multiple "
                       "of 8 up to 128 for the Mosaic GPU kernel")
    chunk = self.chunk_size
    if chunk < CHUNK_TILE and not plan.staged:
      raise ValueError(f"chunk_size J={chunk} below {CHUNK_TILE} needs staged K/V "
                       f"(float32, storage bits or quantised pages); these pages "
                       f"({plan.storage_itemsize}-byte, read by the dots as they land) "
                       f"need a multiple of {CHUNK_TILE}")
    if chunk < CHUNK_TILE and head_dim % ROW_TILE:
      raise ValueError(f"chunk_size J={chunk} below {CHUNK_TILE} stages each [J, D] tile as "
                       f"its transpose, whose D={head_dim} rows must be a multiple of "
                       f"{ROW_TILE}")
    if chunk % block_size and block_size % chunk:
      raise ValueError(f"block_size Z={block_size} (k_pages.shape[3]) and the Mosaic GPU "
                       f"kernel's chunk of {chunk} KV positions (its tiling's chunk_size) "
                       f"must divide one another (pages of 8, 16, 32, 64 or 128 tokens always "
                       f"do)")
    rows = packed_rows(self.q_tile, group)
    if rows * head_dim > 128 * 128:
      raise ValueError(f"q_tile={self.q_tile} packs M={rows} rows (Q * G, G={group}) of "
                       f"head dim {head_dim}: the float32 accumulator of M * D = "
                       f"{rows * head_dim} must stay within {128 * 128} (registers of one "
                       "warpgroup)")
    if chunk * head_dim > 128 * 128 or rows * chunk > 128 * 128:
      raise ValueError(f"chunk_size J={chunk}: J * D = "
                       f"{chunk * head_dim} and M * J = {rows * chunk} must stay within "
                       f"{128 * 128} (registers of one warpgroup)")
    copies = self.copies_per_chunk(block_size)
    if self.num_stages * copies > MAX_BARRIERS:
      raise ValueError(f"num_stages={self.num_stages} * {copies} pages per chunk "
                       f"(chunk_size={chunk}, block_size {block_size}) in flight must be <= "
                       f"{MAX_BARRIERS}")
    needed = self.shared_memory_bytes(group=group, block_size=block_size,
                                      head_dim=head_dim, plan=plan)
    if needed > SHARED_MEMORY_BUDGET:
      hint = (f"lower num_stages={self.num_stages}, chunk_size={self.chunk_size} or "
              f"q_tile={self.q_tile}")
      if self.num_stages == 1 and chunk == CHUNK_TILE and head_dim % ROW_TILE:
        hint = (f"no tiling fits (chunks below {CHUNK_TILE} positions need D a multiple "
                f"of {ROW_TILE}); use bfloat16 / float16 K/V or another impl")
      raise ValueError(
          f"tiling needs ~{needed // 1024} KiB of shared memory per program (head dim "
          f"{head_dim}, {plan.storage_itemsize}-byte pages, {plan.pieces} operand "
          f"piece(s)), over the {SHARED_MEMORY_BUDGET // 1024} KiB budget: {hint}")


def num_work_items(num_tokens: int, num_seq_rows: int, q_tile: int) -> int:
  """An upper bound on the (query tile, sequence) items of any batch of these shapes: each
  tile, plus one more item for every sequence boundary that can fall inside a tile (none
  when tiles are single rows)."""
  if q_tile == 1:
    return max(1, num_tokens)
  return max(1, -(-num_tokens // q_tile) + min(num_seq_rows, num_tokens))


def default_tiling(*, num_tokens: int, num_seq_rows: int, num_kv_heads: int, group: int,
                   block_size: int, head_dim: int, blocks_per_seq: int, plan: OperandPlan,
                   sliding_window: int | None = None) -> MosaicTiling:
  """Defaults derived from shapes.

  Q: 1 for a decode batch (one row per sequence); otherwise enough rows to fill M = 64
  (64 // G, at least 1).
  J and num_stages: 64 positions in the deepest ring (up to 4) that fits the
  shared-memory budget; when no ring of 64 fits (float32 K/V at D = 192 or 256), the
  largest staged J of ``SMALL_CHUNKS`` that does, again with its deepest ring (D a
  multiple of 64: ``check_shapes``).
  num_splits: enough programs for two waves of an H100/H200 when the batch is small,
  never more than half the chunks one item can have (the longest sequence's, or with a
  sliding window the window's plus one page).
  """
  rows_per_seq = max(1, num_tokens // max(1, num_seq_rows))
  q_tile = 1 if rows_per_seq == 1 else max(1, ROW_TILE // group)
  small = plan.staged and head_dim % ROW_TILE == 0
  chunks = (CHUNK_TILE, *sorted(SMALL_CHUNKS, reverse=True)) if small else (CHUNK_TILE,)
  tiling = None
  for chunk in chunks:
    if chunk % block_size and block_size % chunk:
      continue
    for stages in range(MAX_STAGES, 0, -1):
      candidate = MosaicTiling(q_tile=q_tile, chunk_size=chunk, num_splits=1,
                               num_stages=stages)
      if (stages * candidate.copies_per_chunk(block_size) <= MAX_BARRIERS
          and candidate.shared_memory_bytes(group=group, block_size=block_size,
                                            head_dim=head_dim, plan=plan)
          <= SHARED_MEMORY_BUDGET):
        tiling = candidate
        break
    if tiling is not None:
      break
  if tiling is None:  # nothing fits: check_shapes names the budget
    tiling = MosaicTiling(q_tile=q_tile, chunk_size=CHUNK_TILE, num_splits=1, num_stages=1)
  chunk = tiling.chunk_size
  reach = blocks_per_seq * block_size
  if sliding_window is not None:
    reach = min(reach, sliding_window + block_size)
  max_chunks = max(1, -(-reach // chunk))
  items = num_work_items(num_tokens, num_seq_rows, q_tile)
  wanted = max(1, -(-TARGET_PROGRAMS // (items * num_kv_heads)))
  splits = min(wanted, MAX_SPLITS, max(1, max_chunks // MIN_CHUNKS_PER_SPLIT))
  return dataclasses.replace(tiling, num_splits=max(1, splits))


# A program's fixed cost (launch, query copy, first pages' latency, epilogue), in chunk
# steps: an estimate for ``wave_balanced_splits`` (not yet measured on a GPU).
PROGRAM_OVERHEAD_CHUNKS = 2


def wave_balanced_splits(num_programs_per_split: int, max_chunks: int, *,
                         slots: int = NUM_SMS,
                         overhead_chunks: int = PROGRAM_OVERHEAD_CHUNKS) -> int:
  """The split-K factor X that minimises a decode's modelled time: waves of programs
  (``ceil(P * X / slots)``, P = items x KV heads) times one program's steps
  (``ceil(n / X)`` chunks plus a fixed overhead), the fewest splits among equals.

  The default (``default_tiling``) aims at two waves of programs whatever their
  rounding: 8 sequences x 8 KV heads at 8k take X = 5, 320 programs, three waves of 26
  chunks where this model picks X = 2, one wave of 64 (and 4 waves of 64 at 32
  sequences, X = 2, where X = 1 fills two waves of 128). An alternative the GPU benchmark
  times beside the default (``benchmarks/gpu/run.py``); not the default until measured.
  """
  best, best_cost = 1, None
  for splits in range(1, max(1, min(MAX_SPLITS, max_chunks)) + 1):
    waves = -(-(num_programs_per_split * splits) // slots)
    cost = waves * (-(-max_chunks // splits) + overhead_chunks)
    if best_cost is None or cost < best_cost:
      best, best_cost = splits, cost
  return best
