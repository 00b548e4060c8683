"""Static tiling of the GPU ragged kernel: a validated frozen dataclass and its defaults."""

from __future__ import annotations

import dataclasses

# The smallest M, N and K of a tensor-core dot the Triton backend accepts.
MIN_DOT_SIZE = 16
# Programs worth launching before split-K stops paying off (a few waves of an H100/H200's
# 132 SMs). A constant, not a device query: the kernel reads no environment.
TARGET_PROGRAMS = 512
MAX_SPLITS = 64
MAX_HEAD_DIM = 256
# Shared memory one program may use on an H100/H200: 228 KiB per SM, of which one block can
# opt into 227 KiB. A constant, checked against an estimate (``shared_memory_bytes``).
SHARED_MEMORY_BUDGET = 227 * 1024


def _is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def tile_head_dim(head_dim: int) -> int:
  """D', the head dim of the kernel's tiles: D rounded up to a power of two >= 16 (Triton
  block shapes are powers of two; the lanes past D are masked off, Phi-3's D = 96 runs in
  tiles of 128)."""
  return max(MIN_DOT_SIZE, next_pow2(head_dim))


def packed_rows(q_tile: int, group: int) -> int:
  """M, the rows of one dot: Q query rows times G heads, padded to a power of two >= 16."""
  return max(MIN_DOT_SIZE, next_pow2(q_tile * group))


@dataclasses.dataclass(frozen=True)
class GpuTiling:
  """Static tiling of ``pallas_kernels.gpu.ragged_paged_attention``.

  Attributes:
    q_tile: Q, query rows per work item. The Q * G (query row, head) pairs of one KV head
      form the M rows of one dot, padded to a power of two >= 16.
    pages_per_chunk: R, pages loaded per inner-loop step (J = R * Z KV positions); a power
      of two with J >= 16.
    page_split: 1, or with R = 1 the parts a page is read in, one per step (J = Z /
      page_split, a power of two >= 16): for a page whose K and V alone exceed the shared
      memory of one step (float32 at D = 256 with Z = 128).
    num_splits: split-K factor: each work item's KV range is cut into this many contiguous
      pieces handled by separate programs and merged by log-sum-exp.
    num_warps: Triton warps per program (a power of two, at most 32).
    num_stages: Triton software-pipelining stages of the inner loop.
  """

  q_tile: int
  pages_per_chunk: int
  num_splits: int
  num_warps: int = 4
  num_stages: int = 2
  page_split: int = 1

  def __post_init__(self):
    for name in ("q_tile", "pages_per_chunk", "num_splits", "num_warps", "num_stages",
                 "page_split"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not _is_pow2(self.pages_per_chunk):
      raise ValueError(f"pages_per_chunk={self.pages_per_chunk} must be a power of two")
    if not _is_pow2(self.num_warps) or self.num_warps > 32:
      raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 32")
    if not _is_pow2(self.page_split):
      raise ValueError(f"page_split={self.page_split} must be a power of two")
    if self.page_split > 1 and self.pages_per_chunk > 1:
      raise ValueError(f"page_split={self.page_split} reads a page in parts: "
                       f"pages_per_chunk={self.pages_per_chunk} must be 1")

  def chunk_size(self, block_size: int) -> int:
    """J, the KV positions of one inner-loop step: R * Z, or Z / page_split."""
    return self.pages_per_chunk * block_size // self.page_split

  def shared_memory_bytes(self, *, group: int, block_size: int, head_dim: int,
                          itemsize: int) -> int:
    """An upper estimate of the shared memory one program of the kernel needs.

    The Triton backend stages dot operands in shared memory. Counted, all live at once:
    the K and V tiles of the inner loop, ``num_stages`` buffers each (software pipelining
    keeps up to that many chunks in flight); the Q operand of the first dot and the
    probability operand of the second (M x J); and one float32 M x D scratch for the
    layout conversion of the accumulator. ``itemsize`` is the compute dtype's (q and the
    loaded K/V are cast to it). Reduction scratch (a few floats per row) is left out.
    The estimate is not measured on a device; it errs high (the pipeliner can need fewer
    buffers, the scratch can reuse the loop's buffers after it).
    """
    rows = packed_rows(self.q_tile, group)
    chunk = self.chunk_size(block_size)
    head_dim = tile_head_dim(head_dim)
    kv_tiles = self.num_stages * 2 * chunk * head_dim * itemsize
    operands = rows * head_dim * itemsize + rows * chunk * itemsize
    scratch = rows * head_dim * 4
    return kv_tiles + operands + scratch

  def check_shapes(self, *, group: int, block_size: int, head_dim: int,
                   itemsize: int = 4) -> None:
    """Shape-dependent checks; raises ``ValueError`` naming the field or dimension.

    ``itemsize``: bytes per element of the compute dtype (the shared-memory estimate).
    """
    _check_block_size(block_size)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
      raise ValueError(f"head_dim D={head_dim} (q.shape[2]) must be in [1, {MAX_HEAD_DIM}] "
                       "for the Triton backend")
    chunk = self.chunk_size(block_size)
    if chunk < MIN_DOT_SIZE or self.page_split > block_size:
      raise ValueError(f"pages_per_chunk={self.pages_per_chunk}, page_split="
                       f"{self.page_split} give J = {chunk} KV positions per step; must be "
                       f">= {MIN_DOT_SIZE} (block_size {block_size})")
    rows = packed_rows(self.q_tile, group)
    if rows * tile_head_dim(head_dim) > 256 * 256:
      raise ValueError(f"q_tile={self.q_tile} packs M={rows} rows (Q * G, G={group}) of "
                       f"head dim {head_dim} (tiles of {tile_head_dim(head_dim)}); M * D "
                       f"must be <= {256 * 256}")
    needed = self.shared_memory_bytes(group=group, block_size=block_size, head_dim=head_dim,
                                      itemsize=itemsize)
    if needed > SHARED_MEMORY_BUDGET:
      budget = SHARED_MEMORY_BUDGET // 1024
      raise ValueError(
          f"tiling needs ~{needed // 1024} KiB of shared memory per program (head dim "
          f"{head_dim}, {itemsize}-byte compute dtype), over the {budget} KiB budget: "
          f"lower pages_per_chunk={self.pages_per_chunk} or raise page_split="
          f"{self.page_split} (J = {chunk} positions), lower num_stages={self.num_stages} "
          f"or q_tile={self.q_tile} (M = {rows} rows)")


def _check_block_size(block_size: int) -> None:
  if not _is_pow2(block_size):
    raise ValueError(f"block_size Z={block_size} (k_pages.shape[3]) must be a power of "
                     "two for the Triton backend")


def default_tiling(*, num_tokens: int, num_seq_rows: int, num_kv_heads: int, group: int,
                   block_size: int, head_dim: int, blocks_per_seq: int, itemsize: int = 4,
                   sliding_window: int | None = None) -> GpuTiling:
  """Defaults derived from shapes.

  Q: 1 for a decode batch (one row per sequence: an item per row, M padded to 16). With
  more rows per sequence on average, at least 16 // G (rows are free up to the minimum dot
  size), growing towards M = 64 packed rows for prefill.
  R: J = R * Z near 64 KV positions (32 for D = 256, to bound registers).
  num_splits: enough programs to fill the GPU when the batch is small (one long sequence),
  never more than the chunks one item can have: the longest sequence's, or with a sliding
  window the window's plus the tile's.
  The result fits ``SHARED_MEMORY_BUDGET`` for the compute dtype's ``itemsize``: if the
  first choice does not, Q, then R, then the pipeline stages shrink until it does, and
  last a page is read in parts (``page_split``; J down to 16).
  """
  _check_block_size(block_size)  # before any tiling is built from it
  rows_per_seq = max(1, num_tokens // max(1, num_seq_rows))
  if rows_per_seq == 1:
    q_tile = 1  # decode: one item per row, M padded to 16 anyway, no empty items
  else:
    q_min = max(1, MIN_DOT_SIZE // group)
    q_max = max(q_min, 64 // group)
    q_tile = min(q_max, max(q_min, 1 << (rows_per_seq.bit_length() - 1)))
  target_chunk = 64 if tile_head_dim(head_dim) <= 128 else 32
  min_pages = next_pow2(-(-MIN_DOT_SIZE // block_size))  # J >= 16
  pages_per_chunk = max(min_pages, target_chunk // block_size)
  pages_per_chunk = max(min_pages, min(pages_per_chunk, next_pow2(blocks_per_seq)))
  tiling = GpuTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk, num_splits=1,
                     num_stages=2)
  fits = lambda t: t.shared_memory_bytes(group=group, block_size=block_size,
                                         head_dim=head_dim, itemsize=itemsize) \
      <= SHARED_MEMORY_BUDGET
  while not fits(tiling):
    if packed_rows(tiling.q_tile, group) > MIN_DOT_SIZE and tiling.q_tile > 1:
      tiling = dataclasses.replace(tiling, q_tile=tiling.q_tile // 2)
    elif tiling.pages_per_chunk > min_pages:
      tiling = dataclasses.replace(tiling, pages_per_chunk=tiling.pages_per_chunk // 2)
    elif tiling.num_stages > 1:
      tiling = dataclasses.replace(tiling, num_stages=tiling.num_stages - 1)
    elif tiling.chunk_size(block_size) >= 2 * MIN_DOT_SIZE:
      tiling = dataclasses.replace(tiling, page_split=tiling.page_split * 2)
    else:
      break  # the smallest tiling; check_shapes reports it
  rows = packed_rows(tiling.q_tile, group)
  num_warps = 8 if rows * tile_head_dim(head_dim) >= 64 * 128 else 4
  chunk = tiling.chunk_size(block_size)
  max_chunks = -(-blocks_per_seq * block_size // chunk)
  if sliding_window is not None:
    # An item reads from the page holding its first query's window start to its last
    # query: at most window + Q - 1 positions, starting anywhere in a page.
    reach = sliding_window + tiling.q_tile - 1 + block_size - 1
    max_chunks = min(max_chunks, -(-reach // chunk))
  items = num_work_items(num_tokens, num_seq_rows, tiling.q_tile)
  num_splits = -(-TARGET_PROGRAMS // (items * num_kv_heads))
  num_splits = max(1, min(num_splits, max_chunks, MAX_SPLITS))
  return dataclasses.replace(tiling, num_splits=num_splits, num_warps=num_warps)


def num_work_items(num_tokens: int, num_seq_rows: int, q_tile: int) -> int:
  """Upper bound W on (query tile, sequence) work items.

  Consecutive sequences share at most one tile, so there are at most the tiles plus one per
  extra non-empty sequence, and never more than T, since each item holds a row.
  """
  num_tiles = -(-num_tokens // q_tile)
  return max(1, min(num_tokens, num_tiles + min(num_seq_rows, num_tokens) - 1))
