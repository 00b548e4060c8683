"""Ragged paged attention as a Mosaic TPU Pallas kernel: decode and prefill in one launch.

Work decomposition (as in ``pallas_kernels.xla.ragged``): the T query rows are cut into
tiles of Q consecutive rows, and a work item is a (tile, sequence) pair sharing a row; a
tile that spans a sequence boundary yields one item per sequence it touches. Tiles that no
live sequence touches (padding rows) get one dead item each, so that every output block is
written. The item list is computed in jnp in the jitted wrapper and reaches the kernel by
scalar prefetch, together with the layer index and the block tables.

Grid: ``(K, W)``: KV heads (parallel, so megacore chips may split them) by work items (in
order). One grid step computes the G query heads of one KV head for the Q rows of one item,
packed as the ``M = Q * G`` rows (padded to the sublane tile) of one matmul, against its
sequence's pages up to the item's causal horizon, R pages (``J = R * Z`` KV positions) per
chunk. The chunk loop has a dynamic trip count: chunks past the horizon, and dead items,
cost nothing.

Buffering: pages stay in HBM (``pl.ANY``); each page of one KV head, ``pages[layer, k, n]``,
is one contiguous ``[Z, D]`` tile DMA'd into rows ``r * Z : (r + 1) * Z`` of a
double-buffered ``[2, J, D]`` VMEM scratch (one per K and V, one DMA semaphore per buffer
and slot). Before the math of chunk c, the copies of chunk c + 1 are started into the other
slot; during an item's last chunk the next item's first chunk is started, so the pipeline
does not drain between items of one KV head. Slots are assigned statically (the parity of a
running chunk count, precomputed), not carried in scratch. Pages past an item's horizon
(those a sequence does not own, and the unused tail of its table) are never copied: each
page copy sits under ``pl.when``; rows of a buffer that this chunk did not fill, and rows
past the horizon, are masked with ``where`` (never multiplied), so NaN garbage cannot leak.

Attention variants (design.md, "Contract, second wave"):
- ``sliding_window=W``: a row at position p sees keys in ``(p - W, p]``. Cost follows the
  window: an item's pages start at ``_FIRST_PAGE = max(0, p0 - W + 1) // Z`` for its first
  (earliest) row's position p0, so a page lying entirely before every window of the item is
  never copied; chunks count R pages from there. Decode at 8k context with W = 256 copies
  the same 16-17 pages per KV head as at 512 (``benchmarks/tpu/window_pages.py``).
- ``soft_cap=c``: scores ``c * tanh(s / c)`` in float32, before the mask.
- ``sinks`` (f32[H], traced): a small ``[K, M, 1]`` VMEM input, one logit per packed row
  (its query head); the running max starts at it and the denominator at 1.
- ``kv_dtype``: the pages hold storage bits (``layout.storage_dtype``); the VMEM buffers
  keep those bits and each loaded tile is bitcast back as a value (``layout.from_storage``).
- Head dims that are multiples of 8, up to 256; ``TpuTiling.check`` holds the tiling to
  the VMEM budget (counting each array's last dim in whole 128-lane tiles), and the
  default tiling fits it at D = 256 for block sizes 8 to 128, bfloat16 and float32, and
  one-byte quantised K/V with their scale buffers.

Quantised pools (``kv_dtype`` int8 / float8, ``k_scales`` / ``v_scales`` f32[L, K, N, Z]):
each page copy also copies that page's ``[Z]`` scale row (``scales[layer, k, n]``, one
float32 per token) into row r of a double-buffered ``[2, R, Z]`` VMEM scratch, under the
same ``pl.when`` and semaphore as its page, so pages that are not copied have no scales
read either. The loaded tile (storage bits) is converted to float32 as a value (a bitcast of
equal width for float8, then a convert) and the scales are applied after the dots, which is
exact because a scale belongs to one key row and one value row: ``s_j = (q . k_bits_j) *
k_scale_j`` and ``out = sum_j (p_j * v_scale_j) v_bits_j``. The ``[R, Z]`` scales become
the ``[1, J]`` row along the chunk's keys through a small 0/1 matmul (no value or ref
reshape); scales of rows not copied or past the horizon are zeroed first, so NaN scales of
unused slots cannot leak through it. Both products and the softmax stay float32 (with a
bfloat16 q, q . k_bits runs on bfloat16 operands: int8 and float8 values are exact in
bfloat16, and the MXU accumulates in float32).

Precision: float32 KV is computed in float32 (``Precision.HIGHEST``); bfloat16 q and KV
feed the MXU in bfloat16 with float32 accumulation; quantised KV as above. The online
softmax state (row max, denominator, accumulator) lives in float32 VMEM scratch.

No ref reshapes or bitcasts happen in the kernel (the TPU interpreter on CPU cannot run
them): q and the output are laid out ``[K, tiles, M, D]`` by the wrapper.

``ragged_paged_attention_page_log`` runs the same kernel with an SMEM log of every page
copy it starts, per (KV head, work item, table entry): the tests check it against the exact
page set the windows need, and the benchmark counts pages per query tile with it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from paged_jax.pallas_kernels import layout, metadata, validation

_NEG_INF = float("-inf")
# VMEM the tiling may use; the smallest default scoped limit among TPU generations.
_VMEM_BUDGET_BYTES = 16 * 1024 * 1024

# Fields of the flat work-item table ``items[field * W + w]`` (one i32[W] row per field).
_SEQ = 0         # the item's sequence
_TILE = 1        # the item's query tile
_ROW_LO = 2      # first tile-local row the item owns
_ROW_HI = 3      # one past the last tile-local row it owns (lo == hi: a dead item)
_FIRST = 4       # 1 when it is the first item of its tile (it zeroes the rows it does not own)
_Q_OFFSET = 5    # query position of tile-local row i is i + q_offset
_HORIZON = 6     # KV positions the item reads end at horizon (exclusive)
_FIRST_PAGE = 7  # first page (table index) it reads: 0, or the first in its rows' windows
_CHUNKS = 8      # chunks of R pages it reads, from _FIRST_PAGE to ceil(horizon / Z)
_CHUNK_BASE = 9  # chunks read by the items before it (the slot parity of its first chunk)
_NUM_FIELDS = 10


@dataclasses.dataclass(frozen=True)
class TpuTiling:
  """Static tiling of the TPU kernel.

  Attributes:
    q_tile: Q, query rows per work item. The packed matmul has ``M = Q * G`` rows (G query
      heads per KV head), padded up to the sublane tile. 1 suits decode; larger tiles
      amortise each page read over many prefill rows of one sequence.
    pages_per_chunk: R, pages brought in per DMA round and per compute step
      (``J = R * Z`` KV positions).
  """

  q_tile: int
  pages_per_chunk: int

  def __post_init__(self):
    for name in ("q_tile", "pages_per_chunk"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")

  def vmem_bytes(self, *, group: int, block_size: int, head_dim: int, q_itemsize: int,
                 kv_itemsize: int, quantized: bool = False) -> int:
    """Approximate VMEM footprint of one kernel instance (every variant on: the sink input
    and the soft cap's temporaries are counted; ``quantized``: the scale buffers too)."""
    rows = _padded_rows(self.q_tile * group, q_itemsize)
    chunk_len = self.pages_per_chunk * block_size
    lanes = 128  # an [M, 1] array occupies M rows of full 128-lane tiles
    # The last dim of a VMEM array fills whole 128-lane tiles (D = 64, 80 or 96 takes 128
    # lanes, as does a chunk of 64 positions), its rows whole sublane tiles.
    width = _round_up(head_dim, lanes)
    chunk_lanes = _round_up(chunk_len, lanes)
    kv_rows = _padded_rows(chunk_len, kv_itemsize)
    kv_buffers = 2 * 2 * kv_rows * width * kv_itemsize            # K and V, two slots
    q_out_blocks = 2 * 2 * rows * width * q_itemsize              # pipelined in and out
    row_inputs = 2 * 2 * rows * lanes * 4                         # row ids, sinks: [M, 1]
    state = rows * width * 4 + 2 * rows * lanes * 4               # acc, max, denom
    # Scores, capped scores, probabilities and mask [M, J]; the K and V tiles as loaded
    # and converted, [J, D] each.
    temporaries = 4 * rows * chunk_lanes * 4 + 2 * kv_rows * width * (4 + kv_itemsize)
    scales = 0
    if quantized:
      # K and V scale rows, two slots of [R, Z] float32 each (tiles of 8 x 128); per chunk
      # the 0/1 expander [Z, J], the page mask and products [R, J], the two [1, J] rows.
      padded_chunk = _round_up(chunk_len, lanes)
      scale_buffers = 2 * 2 * _round_up(self.pages_per_chunk, 8) * _round_up(
          block_size, lanes) * 4
      scale_temporaries = (_round_up(block_size, 8) + 3 * _round_up(self.pages_per_chunk, 8)
                           + 2 * 8) * padded_chunk * 4
      scales = scale_buffers + scale_temporaries
    return kv_buffers + q_out_blocks + row_inputs + state + temporaries + scales

  def check(self, *, group: int, block_size: int, head_dim: int, q_itemsize: int,
            kv_itemsize: int, quantized: bool = False) -> None:
    """Raises ``ValueError`` naming the field when the tiling overflows the VMEM budget."""
    rows = self.q_tile * group
    if rows > 4096:
      raise ValueError(f"q_tile={self.q_tile} gives q_tile * G={rows} packed rows; must be "
                       "<= 4096")
    sizes = dict(group=group, block_size=block_size, head_dim=head_dim,
                 q_itemsize=q_itemsize, kv_itemsize=kv_itemsize, quantized=quantized)
    used = self.vmem_bytes(**sizes)
    if used > _VMEM_BUDGET_BYTES:
      # Blame q_tile when even one page per chunk would not fit, else pages_per_chunk.
      one_page = dataclasses.replace(self, pages_per_chunk=1).vmem_bytes(**sizes)
      name = "q_tile" if one_page > _VMEM_BUDGET_BYTES else "pages_per_chunk"
      raise ValueError(f"{name}={getattr(self, name)} needs ~{used} bytes of VMEM "
                       f"(q_tile={self.q_tile}, pages_per_chunk={self.pages_per_chunk}, "
                       f"G={group}, Z={block_size}, D={head_dim}); must fit in "
                       f"{_VMEM_BUDGET_BYTES}")


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _pow2_floor(x: int) -> int:
  return 1 << (max(1, x).bit_length() - 1)


def _padded_rows(rows: int, itemsize: int) -> int:
  """Rows padded to the sublane tile of the dtype: 8 for 32-bit, 16 for 16-bit, 32 for
  8-bit."""
  sublanes = 8 * max(1, 4 // itemsize)
  return -(-rows // sublanes) * sublanes


def default_tiling(num_tokens: int, num_seq_rows: int, num_q_heads: int, num_kv_heads: int,
                   block_size: int, blocks_per_seq: int) -> TpuTiling:
  """Q near the mean rows per sequence (a power of two, ``Q * G`` at most 256, Q at most
  64); R so that a chunk holds 256 positions (at most the table width)."""
  group = num_q_heads // num_kv_heads
  rows_per_seq = max(1, num_tokens // max(1, num_seq_rows))
  q_tile = max(1, min(_pow2_floor(rows_per_seq), 64, _pow2_floor(max(1, 256 // group))))
  pages_per_chunk = max(1, min(blocks_per_seq, 256 // block_size))
  return TpuTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk)


def num_work_items(num_tokens: int, num_seq_rows: int, q_tile: int) -> int:
  """W, an upper bound on (tile, sequence) items plus one dead item per untouched tile.

  Sequences are consecutive row ranges, so neighbours share at most one tile: the items
  number at most the tiles plus one per further non-empty sequence; and a tile holds at
  most ``min(Q, S)`` items.
  """
  num_tiles = -(-num_tokens // q_tile)
  nonempty = min(num_seq_rows, num_tokens)
  return max(1, min(num_tiles + nonempty - 1, num_tiles * min(q_tile, num_seq_rows)))


def _work_items(kv_lens_S, cu_q_lens, num_seqs, *, num_tokens: int, q_tile: int,
                block_size: int, pages_per_chunk: int, blocks_per_seq: int,
                sliding_window: int | None = None):
  """The flat i32[_NUM_FIELDS * W] work-item table (fields above), in jnp.

  An item reads the pages from ``_FIRST_PAGE`` up to its causal horizon. Without a window
  the first is page 0; with a window W, the item's earliest query row (position p) sees
  keys from ``p - W + 1`` on, and every later row's window starts later, so a page lying
  entirely at or before ``p - W`` is needed by no row of the item and is never copied.
  """
  num_seq_rows = kv_lens_S.shape[0]
  num_tiles = -(-num_tokens // q_tile)
  num_items = num_work_items(num_tokens, num_seq_rows, q_tile)

  seq_W, live_tile_W, live_W, q_start_S, q_end_S = metadata.tile_sequence_items(
      cu_q_lens, num_seqs, num_tokens=num_tokens, q_tile=q_tile, num_items=num_items)
  num_live = jnp.sum(live_W.astype(jnp.int32))
  w = jnp.arange(num_items, dtype=jnp.int32)

  # Tiles no live item touches (padding rows only) get the dead items, in order, after the
  # live ones; the remaining dead items repeat the last tile, so each tile's items stay
  # consecutive and its output block is written back once.
  touched = jnp.zeros((num_tiles,), jnp.bool_).at[
      jnp.where(live_W, live_tile_W, num_tiles)].set(True, mode="drop")
  num_untouched = num_tiles - jnp.sum(touched.astype(jnp.int32))
  untouched = jnp.nonzero(~touched, size=num_tiles, fill_value=num_tiles - 1)[0]
  last_live_tile = live_tile_W[jnp.maximum(num_live - 1, 0)]
  dead_index = jnp.clip(w - num_live, 0, jnp.maximum(num_untouched - 1, 0))
  dead_tile_W = jnp.where(num_untouched > 0, untouched[dead_index], last_live_tile)
  tile_W = jnp.where(live_W, live_tile_W, dead_tile_W).astype(jnp.int32)

  tile_start_W = tile_W * q_tile
  row_lo_W = jnp.where(live_W, jnp.maximum(q_start_S[seq_W] - tile_start_W, 0), 0)
  row_hi_W = jnp.where(live_W, jnp.minimum(q_end_S[seq_W] - tile_start_W, q_tile), 0)
  prev_tile_W = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile_W[:-1]])
  first_W = (tile_W != prev_tile_W).astype(jnp.int32)
  # Row t of sequence i sits at kv_lens[i] - cu_q_lens[i + 1] + t (see metadata).
  q_offset_W = tile_start_W + kv_lens_S[seq_W] - cu_q_lens[seq_W + 1]
  kv_capacity = blocks_per_seq * block_size
  horizon_W = jnp.minimum(row_hi_W + q_offset_W, kv_lens_S[seq_W])
  horizon_W = jnp.where(live_W, jnp.clip(horizon_W, 0, kv_capacity), 0)
  pages_needed_W = (horizon_W + block_size - 1) // block_size
  if sliding_window is None:
    first_page_W = jnp.zeros_like(pages_needed_W)
  else:
    window_start_W = jnp.maximum(row_lo_W + q_offset_W - sliding_window + 1, 0)
    first_page_W = jnp.minimum(window_start_W // block_size, pages_needed_W)
  chunks_W = (pages_needed_W - first_page_W + pages_per_chunk - 1) // pages_per_chunk
  chunk_base_W = jnp.cumsum(chunks_W) - chunks_W

  fields = [None] * _NUM_FIELDS
  fields[_SEQ], fields[_TILE] = seq_W, tile_W
  fields[_ROW_LO], fields[_ROW_HI], fields[_FIRST] = row_lo_W, row_hi_W, first_W
  fields[_Q_OFFSET], fields[_HORIZON], fields[_FIRST_PAGE] = q_offset_W, horizon_W, first_page_W
  fields[_CHUNKS], fields[_CHUNK_BASE] = chunks_W, chunk_base_W
  return jnp.concatenate([f.astype(jnp.int32) for f in fields]), num_items


def _parity(x):
  """``x % 2`` for non-negative int scalars (a bit mask: floor ``%`` lowers through sign,
  which Mosaic cannot lower without a TPU attached)."""
  return jnp.bitwise_and(x, 1)


def _ragged_kernel(
    *refs,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    log_pages: bool,
    kv_dtype,
    quantized: bool,
    block_size: int,
    pages_per_chunk: int,
    blocks_per_seq: int,
    num_items: int,
    compute_dtype,
):
  # Prefetch
  #   layer_ref            i32[1]
  #   block_tables_ref     i32[S * P], flat
  #   items_ref            i32[_NUM_FIELDS * W], flat work-item table
  layer_ref, block_tables_ref, items_ref, *refs = refs
  # Input
  #   row_M1_ref           i32[M, 1] tile-local query row of each packed row (Q: padding)
  #   sink_M1_ref          f32[M, 1] sink logit of each packed row's query head (if sinks)
  #   q_MD_ref             [M, D] packed queries of one (KV head, tile)
  #   k/v_pages_hbm_ref    [L, K, N, Z, D] in HBM (storage dtype)
  #   k/v_scales_hbm_ref   f32[L, K, N, Z] in HBM (quantised pools only)
  row_M1_ref, *refs = refs
  sink_M1_ref = refs.pop(0) if has_sinks else None
  q_MD_ref, k_pages_hbm_ref, v_pages_hbm_ref, *refs = refs
  k_scales_hbm_ref = v_scales_hbm_ref = None
  if quantized:
    k_scales_hbm_ref, v_scales_hbm_ref, *refs = refs
  # Output
  #   out_MD_ref           [M, D]
  #   page_log_ref         i32[K * W * P] in SMEM (log_pages only): copies started per
  #                        (KV head, item, table index), for tests and benchmarks
  out_MD_ref, *refs = refs
  page_log_ref = refs.pop(0) if log_pages else None
  # Scratch
  #   k_buf_ref, v_buf_ref [2, J, D] double-buffered K and V chunks (storage dtype)
  #   k/v_scale_buf_ref    f32[2, R, Z] their pages' scale rows (quantised pools only)
  #   sems_ref             DMA semaphores [2 (K, V), 2 (slot)]; a page's scale row
  #                        signals its page's semaphore
  #   row_max_ref, denom_ref  f32[M, 1]; acc_ref f32[M, D]
  k_buf_ref, v_buf_ref, *refs = refs
  k_scale_buf_ref = v_scale_buf_ref = None
  if quantized:
    k_scale_buf_ref, v_scale_buf_ref, *refs = refs
  sems_ref, row_max_ref, denom_ref, acc_ref = refs

  kv_head = pl.program_id(0)
  w = pl.program_id(1)
  layer = layer_ref[0]
  chunk_len = pages_per_chunk * block_size
  num_blocks = k_pages_hbm_ref.shape[2]
  precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

  def item(field, index):
    return items_ref[field * num_items + index]

  def table_entry(index, page):
    return block_tables_ref[item(_SEQ, index) * blocks_per_seq
                            + jnp.minimum(page, blocks_per_seq - 1)]

  def for_each_page(index, chunk, slot, action, when=True):
    """Applies ``action`` ("start" or "wait") to the K and V copies of chunk ``chunk`` of
    item ``index`` into ``slot``, if ``when``, for the pages the item reads and no others."""
    # An int32 divisor: a Python int is int64 under jax_enable_x64, and lax.div refuses
    # mixed dtypes.
    pages_needed = lax.div(item(_HORIZON, index) + (block_size - 1), jnp.int32(block_size))
    first_page = item(_FIRST_PAGE, index) + chunk * pages_per_chunk
    for r in range(pages_per_chunk):
      page = first_page + r
      block = table_entry(index, page)
      # An id outside [0, N) (invalid input) is never copied: that page reads as zeros.
      needed = when & (page < pages_needed) & (block >= 0) & (block < num_blocks)
      block = jnp.where(needed, block, 0)
      rows = pl.ds(r * block_size, block_size)
      copies = (
          pltpu.make_async_copy(k_pages_hbm_ref.at[layer, kv_head, block],
                                k_buf_ref.at[slot, rows], sems_ref.at[0, slot]),
          pltpu.make_async_copy(v_pages_hbm_ref.at[layer, kv_head, block],
                                v_buf_ref.at[slot, rows], sems_ref.at[1, slot]),
      )
      if quantized:  # the page's [Z] scale row, as a [1, Z] window, into row r
        copies += (
            pltpu.make_async_copy(k_scales_hbm_ref.at[layer, kv_head, pl.ds(block, 1)],
                                  k_scale_buf_ref.at[slot, pl.ds(r, 1)], sems_ref.at[0, slot]),
            pltpu.make_async_copy(v_scales_hbm_ref.at[layer, kv_head, pl.ds(block, 1)],
                                  v_scale_buf_ref.at[slot, pl.ds(r, 1)], sems_ref.at[1, slot]),
        )

      @pl.when(needed)
      def _():
        for copy in copies:
          getattr(copy, action)()
        if page_log_ref is not None and action == "start":
          at = (kv_head * num_items + index) * blocks_per_seq + page
          page_log_ref[at] = page_log_ref[at] + 1

  if page_log_ref is not None:
    # One buffer for the whole grid, cleared once: every step also counts copies of the
    # item after it (it starts that item's first chunk).
    @pl.when((kv_head == 0) & (w == 0))
    def _():
      def clear(i, carry):
        page_log_ref[i] = 0
        return carry
      lax.fori_loop(0, page_log_ref.shape[0], clear, 0)

  num_chunks = item(_CHUNKS, w)
  chunk_base = item(_CHUNK_BASE, w)
  next_w = jnp.minimum(w + 1, num_items - 1)
  next_has_chunks = (w + 1 < num_items) & (item(_CHUNKS, next_w) > 0)

  # Copies chain along the items of one KV head: an item's first chunk is started by the
  # item before it (during that item's last chunk, or here when it has none); only the
  # first item of each KV head starts its own.
  start_own = (w == 0) & (num_chunks > 0)
  first_target = jnp.where(start_own, w, next_w)
  for_each_page(first_target, 0, _parity(item(_CHUNK_BASE, first_target)), "start",
                when=start_own | ((num_chunks == 0) & next_has_chunks))

  # Online softmax state. A sink is one more logit with no value: the running max starts
  # at it and the denominator at exp(sink - max) = 1.
  if sink_M1_ref is None:
    row_max_ref[...] = jnp.full(row_max_ref.shape, _NEG_INF, jnp.float32)
    denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
  else:
    row_max_ref[...] = sink_M1_ref[...]
    denom_ref[...] = jnp.ones(denom_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  # Quantised pools: q . k_bits on bfloat16 operands when q is bfloat16 (exact: int8 and
  # float8 values are bfloat16 values), else float32.
  qk_dtype = q_MD_ref.dtype if quantized and q_MD_ref.dtype == jnp.bfloat16 else compute_dtype
  qk_precision = None if qk_dtype == jnp.bfloat16 else precision
  q_MD = q_MD_ref[...].astype(qk_dtype)
  qpos_M1 = row_M1_ref[...] + item(_Q_OFFSET, w)
  horizon = item(_HORIZON, w)
  item_first_page = item(_FIRST_PAGE, w)

  def load(buf_ref, slot, dtype=compute_dtype):
    # Storage bits -> logical dtype on the loaded value (a bitcast of equal width), never
    # on the ref (the TPU interpreter cannot run ref bitcasts). Quantised values are
    # converted to float32 first (int8 / float8 -> bfloat16 goes through it; exact).
    values = layout.from_storage(buf_ref[slot], kv_dtype)
    if quantized:
      values = values.astype(jnp.float32)
    return values.astype(dtype)

  if quantized:
    # Key j of a chunk is token z = j mod Z of its page r = j div Z. Computed in float32
    # (exact for these small integers; floor((j + 1/2) / Z) stays clear of rounding), once
    # per grid step: page_RJ[r, j] = (r == j div Z), expand_ZJ[z, j] = (z == j mod Z).
    j_1J = lax.broadcasted_iota(jnp.int32, (1, chunk_len), 1).astype(jnp.float32)
    page_of_1J = jnp.floor((j_1J + 0.5) * (1.0 / block_size))
    token_of_1J = j_1J - page_of_1J * block_size
    r_R1 = lax.broadcasted_iota(jnp.int32, (pages_per_chunk, 1), 0)
    page_RJ = r_R1.astype(jnp.float32) == page_of_1J
    z_Z1 = lax.broadcasted_iota(jnp.int32, (block_size, 1), 0).astype(jnp.float32)
    expand_ZJ = (z_Z1 == token_of_1J).astype(jnp.float32)
    token_RZ = (lax.broadcasted_iota(jnp.int32, (pages_per_chunk, block_size), 0) * block_size
                + lax.broadcasted_iota(jnp.int32, (pages_per_chunk, block_size), 1))

  def scale_row(scale_buf_ref, slot, valid_RZ):
    """The chunk's scales [R, Z] as the row [1, J] along its keys (zero where not valid):
    row[j] = scales[j div Z, j mod Z] = sum_r page[r, j] * (scales @ expand)[r, j]."""
    scales_RZ = jnp.where(valid_RZ, scale_buf_ref[slot], 0.0)  # never NaN * 0 in the dot
    spread_RJ = lax.dot_general(scales_RZ, expand_ZJ, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32,
                                precision=lax.Precision.HIGHEST)
    return jnp.sum(jnp.where(page_RJ, spread_RJ, 0.0), axis=0, keepdims=True)

  def chunk_step(chunk, carry):
    slot = _parity(chunk_base + chunk)
    # Before this chunk's math: start the next chunk of this item, or after its last
    # chunk the next item's first, into the other slot.
    last = chunk + 1 == num_chunks
    for_each_page(jnp.where(last, next_w, w), jnp.where(last, 0, chunk + 1), 1 - slot,
                  "start", when=jnp.logical_not(last) | next_has_chunks)
    for_each_page(w, chunk, slot, "wait")
    chunk_first_page = item_first_page + chunk * pages_per_chunk
    # Rows of a page whose id is outside [0, N) were not copied: they read as zeros (as in
    # the reference), never as a stale or clamped block.
    row_J1 = lax.broadcasted_iota(jnp.int32, (chunk_len, 1), 0)
    copied_J1 = jnp.zeros((chunk_len, 1), jnp.bool_)
    copied_R1 = jnp.zeros((pages_per_chunk, 1), jnp.bool_)
    for r in range(pages_per_chunk):
      block = table_entry(w, chunk_first_page + r)
      page_ok = (block >= 0) & (block < num_blocks)
      in_page_J1 = (row_J1 >= r * block_size) & (row_J1 < (r + 1) * block_size)
      copied_J1 |= in_page_J1 & page_ok
      if quantized:
        copied_R1 |= (r_R1 == r) & page_ok
    k_JD = load(k_buf_ref, slot, qk_dtype)
    k_JD = jnp.where(copied_J1, k_JD, jnp.zeros_like(k_JD))
    v_JD = load(v_buf_ref, slot)

    chunk_pos = chunk_first_page * block_size
    if quantized:
      # Scales of rows this chunk copied and the sequence holds (others: stale, or NaN).
      valid_RZ = copied_R1 & (chunk_pos + token_RZ < horizon)
      k_scale_1J = scale_row(k_scale_buf_ref, slot, valid_RZ)
      v_scale_1J = scale_row(v_scale_buf_ref, slot, valid_RZ)
    kv_pos_1J = chunk_pos + lax.broadcasted_iota(jnp.int32, (1, chunk_len), 1)
    visible_MJ = (kv_pos_1J <= qpos_M1) & (kv_pos_1J < horizon)
    if sliding_window is not None:
      visible_MJ &= kv_pos_1J > qpos_M1 - sliding_window
    scores_MJ = lax.dot_general(q_MD, k_JD, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=qk_precision)
    if quantized:  # s_j = (q . k_bits_j) * k_scale_j
      scores_MJ = scores_MJ * k_scale_1J
    scores_MJ = scores_MJ * sm_scale
    if soft_cap is not None:  # before the mask, as the contract says
      scores_MJ = soft_cap * jnp.tanh(scores_MJ * (1.0 / soft_cap))
    scores_MJ = jnp.where(visible_MJ, scores_MJ, _NEG_INF)
    row_max_M1 = row_max_ref[...]
    new_max_M1 = jnp.maximum(row_max_M1, jnp.max(scores_MJ, axis=1, keepdims=True))
    safe_max_M1 = jnp.where(new_max_M1 == _NEG_INF, 0.0, new_max_M1)
    probs_MJ = jnp.exp(scores_MJ - safe_max_M1)  # hidden keys: exp(-inf) = 0
    rescale_M1 = jnp.exp(row_max_M1 - safe_max_M1)
    denom_ref[...] = rescale_M1 * denom_ref[...] + jnp.sum(probs_MJ, axis=1, keepdims=True)
    # Rows this chunk did not fill (stale or uninitialised) and rows past the sequence's
    # length may hold anything, NaN included: select zeros, never multiply by zero.
    kv_pos_J1 = chunk_pos + row_J1
    v_JD = jnp.where((kv_pos_J1 < horizon) & copied_J1, v_JD, jnp.zeros_like(v_JD))
    weights_MJ = probs_MJ * v_scale_1J if quantized else probs_MJ  # (p_j * v_scale_j)
    pv_MD = lax.dot_general(weights_MJ.astype(compute_dtype), v_JD, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=precision)
    acc_ref[...] = rescale_M1 * acc_ref[...] + pv_MD
    row_max_ref[...] = new_max_M1
    return carry

  lax.fori_loop(0, num_chunks, chunk_step, 0)

  row_M1 = row_M1_ref[...]
  owned_M1 = (row_M1 >= item(_ROW_LO, w)) & (row_M1 < item(_ROW_HI, w))
  denom_M1 = denom_ref[...]
  out_MD = acc_ref[...] / jnp.where(denom_M1 > 0, denom_M1, 1.0)
  # The first item of a tile zeroes the rows it does not own (padding, or rows the next
  # items fill); later items keep what the earlier ones wrote.
  kept_MD = jnp.where(item(_FIRST, w) == 1, 0.0, out_MD_ref[...].astype(jnp.float32))
  out_MD_ref[...] = jnp.where(owned_M1, out_MD, kept_MD).astype(out_MD_ref.dtype)


def _check_head_dim_and_block_size(head_dim: int, block_size: int) -> None:
  if head_dim % 8 != 0 or head_dim > 256:
    raise ValueError(f"head_dim={head_dim} (q.shape[2]) must be a multiple of 8 up to 256 "
                     "(a page row is one full-width block: 64, 80, 96, 128 and 256 all fit)")
  if block_size % 8 != 0:
    raise ValueError(f"block_size={block_size} (k_pages.shape[3]) must be a multiple of 8 "
                     "(the sublane tile)")


def static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, tiling: TpuTiling,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, k_scales=None, v_scales=None) -> None:
  """The shared shape and variant checks plus this kernel's own; raises ``ValueError``."""
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    k_scales=k_scales, v_scales=v_scales)
  _, num_q_heads, head_dim = q_THD.shape
  _, num_kv_heads, _, block_size, _ = k_pages_LKNZD.shape
  validation.static_validate_variants(num_q_heads, sliding_window=sliding_window,
                                     soft_cap=soft_cap, sinks=sinks)
  _check_head_dim_and_block_size(head_dim, block_size)
  if not isinstance(tiling, TpuTiling):
    raise ValueError(f"tiling={tiling!r} must be a TpuTiling or None")
  tiling.check(group=num_q_heads // num_kv_heads, block_size=block_size, head_dim=head_dim,
               q_itemsize=jnp.dtype(q_THD.dtype).itemsize,
               kv_itemsize=jnp.dtype(k_pages_LKNZD.dtype).itemsize,
               quantized=layout.is_quantized(kv_dtype))


def unsupported_reason(q_THD, k_pages_LKNZD, block_tables_SP, *, kv_dtype=None,
                       sliding_window: int | None = None) -> str | None:
  """Why this kernel cannot take arguments of these shapes and dtypes, or None if it can
  (with its default tiling): what an "auto" choice asks before picking it. Static: only
  shapes and dtypes are read."""
  del sliding_window  # the default tiling does not depend on it
  num_tokens, num_q_heads, head_dim = q_THD.shape
  _, num_kv_heads, _, block_size, _ = k_pages_LKNZD.shape
  num_seq_rows, blocks_per_seq = block_tables_SP.shape

  def check_shapes(**shape):
    _check_head_dim_and_block_size(head_dim, block_size)
    tiling = default_tiling(num_tokens, num_seq_rows, num_q_heads, num_kv_heads, block_size,
                            blocks_per_seq)
    tiling.check(**shape, q_itemsize=jnp.dtype(q_THD.dtype).itemsize,
                 kv_itemsize=jnp.dtype(k_pages_LKNZD.dtype).itemsize,
                 quantized=layout.is_quantized(kv_dtype))

  return validation.refusal_reason(q_THD, k_pages_LKNZD, check_shapes)


def _interpret_params(interpret):
  if interpret is True:
    return pltpu.InterpretParams()
  if interpret is False or interpret is None:
    return None
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  raise ValueError(f"interpret={interpret!r} must be a bool or a pltpu.InterpretParams")


def _ragged_call(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                 cu_q_lens, num_seqs, sinks, k_scales, v_scales, *, sm_scale, sliding_window,
                 soft_cap, kv_dtype, tiling, interpret, log_pages):
  """The kernel launch: ``(out_THD, page_log_KWP or None, items_FW)``."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  _, num_kv_heads, num_blocks, block_size, _ = k_pages_LKNZD.shape
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  if tiling is None:
    tiling = default_tiling(num_tokens, num_seq_rows, num_q_heads, num_kv_heads, block_size,
                            blocks_per_seq)
  static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                         block_tables_SP, cu_q_lens, num_seqs, tiling=tiling,
                         sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                         kv_dtype=kv_dtype, k_scales=k_scales, v_scales=v_scales)
  interpret_params = _interpret_params(interpret)
  if sm_scale is None:
    sm_scale = float(head_dim) ** -0.5
  sliding_window, soft_cap = validation.canonical_variants(sliding_window, soft_cap)
  storage = jnp.dtype(k_pages_LKNZD.dtype)
  kv_dtype = storage if kv_dtype is None else jnp.dtype(kv_dtype)
  quantized = layout.is_quantized(kv_dtype)
  if num_tokens == 0:
    return jnp.zeros_like(q_THD), None, None
  group = num_q_heads // num_kv_heads
  q_tile, pages_per_chunk = tiling.q_tile, tiling.pages_per_chunk
  chunk_len = pages_per_chunk * block_size
  q_itemsize = jnp.dtype(q_THD.dtype).itemsize
  both_bf16 = q_THD.dtype == jnp.bfloat16 and kv_dtype == jnp.bfloat16
  compute_dtype = jnp.bfloat16 if both_bf16 else jnp.float32
  num_tiles = -(-num_tokens // q_tile)
  rows = q_tile * group
  rows_padded = _padded_rows(rows, q_itemsize)

  items, num_items = _work_items(
      kv_lens_S, cu_q_lens, jnp.asarray(num_seqs, jnp.int32), num_tokens=num_tokens,
      q_tile=q_tile, block_size=block_size, pages_per_chunk=pages_per_chunk,
      blocks_per_seq=blocks_per_seq, sliding_window=sliding_window)
  layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
  block_tables_flat = block_tables_SP.reshape(-1)

  # [T, H, D] -> [K, tiles, M, D], packed rows (q, g) of one KV head; M padded with zeros.
  q_pad_THD = jnp.pad(q_THD, ((0, num_tiles * q_tile - num_tokens), (0, 0), (0, 0)))
  q_KTGD = q_pad_THD.reshape(-1, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  q_KXMD = q_KTGD.reshape(num_kv_heads, num_tiles, rows, head_dim)
  q_KXMD = jnp.pad(q_KXMD, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
  row_M1 = jnp.concatenate([jnp.repeat(jnp.arange(q_tile, dtype=jnp.int32), group),
                            jnp.full((rows_padded - rows,), q_tile, jnp.int32)])[:, None]

  def tile_map(kv_head, w, layer_ref, block_tables_ref, items_ref):
    del layer_ref, block_tables_ref
    return kv_head, items_ref[_TILE * num_items + w], 0, 0

  qo_spec = pl.BlockSpec((None, None, rows_padded, head_dim), tile_map)
  in_specs = [pl.BlockSpec((rows_padded, 1), lambda kv_head, w, *_: (0, 0))]
  inputs = [row_M1]
  if sinks is not None:
    # Packed row (q, g) of KV head k is query head k * G + g; padding rows get sink 0.
    sink_KGM = jnp.broadcast_to(sinks.reshape(num_kv_heads, 1, group),
                                (num_kv_heads, q_tile, group))
    sink_KM1 = jnp.pad(sink_KGM.reshape(num_kv_heads, rows),
                       ((0, 0), (0, rows_padded - rows)))[:, :, None]
    in_specs.append(pl.BlockSpec((None, rows_padded, 1), lambda kv_head, w, *_: (kv_head, 0, 0)))
    inputs.append(sink_KM1.astype(jnp.float32))
  in_specs += [qo_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
  inputs += [q_KXMD, k_pages_LKNZD, v_pages_LKNZD]
  scale_scratch = []
  if quantized:  # stay in HBM: the kernel copies the rows of the pages it copies
    in_specs += [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    inputs += [k_scales, v_scales]
    scale_scratch = [pltpu.VMEM((2, pages_per_chunk, block_size), jnp.float32)] * 2
  out_specs = [qo_spec]
  out_shape = [jax.ShapeDtypeStruct(q_KXMD.shape, q_THD.dtype)]
  if log_pages:
    log_size = num_kv_heads * num_items * blocks_per_seq
    out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    out_shape.append(jax.ShapeDtypeStruct((log_size,), jnp.int32))

  kernel = functools.partial(
      _ragged_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
      soft_cap=soft_cap, has_sinks=sinks is not None, log_pages=log_pages, kv_dtype=kv_dtype,
      quantized=quantized,
      block_size=block_size, pages_per_chunk=pages_per_chunk, blocks_per_seq=blocks_per_seq,
      num_items=num_items, compute_dtype=compute_dtype)

  # Keys one row attends at most: the table's reach, or its window plus its tile's rows.
  kv_reach = blocks_per_seq * block_size
  if sliding_window is not None:
    kv_reach = min(kv_reach, sliding_window + q_tile + block_size)
  q_bytes = q_THD.size * q_itemsize
  kv_blocks = min(num_blocks, num_seq_rows * blocks_per_seq)
  kv_bytes = (2 * num_kv_heads * min(kv_blocks * block_size, num_tiles * kv_reach)
              * (head_dim * storage.itemsize + (4 if quantized else 0)))
  cost = pl.CostEstimate(
      flops=int(4 * num_tokens * num_q_heads * head_dim * kv_reach),
      transcendentals=int(num_tokens * num_q_heads * kv_reach * (2 if soft_cap else 1)),
      bytes_accessed=int(2 * q_bytes + kv_bytes))

  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(num_kv_heads, num_items),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[
              pltpu.VMEM((2, chunk_len, head_dim), storage),
              pltpu.VMEM((2, chunk_len, head_dim), storage),
              *scale_scratch,
              pltpu.SemaphoreType.DMA((2, 2)),
              pltpu.VMEM((rows_padded, 1), jnp.float32),
              pltpu.VMEM((rows_padded, 1), jnp.float32),
              pltpu.VMEM((rows_padded, head_dim), jnp.float32),
          ],
      ),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          # The page log is one buffer every step writes: no core split then.
          dimension_semantics=("arbitrary" if log_pages else "parallel", "arbitrary")),
      cost_estimate=cost,
      interpret=interpret_params,
      name="ragged_paged_attention",
  )(layer_1, block_tables_flat, items, *inputs)

  out_KTGD = outs[0][:, :, :rows].reshape(num_kv_heads, -1, group, head_dim)
  out_THD = out_KTGD.transpose(1, 0, 2, 3).reshape(-1, num_q_heads, head_dim)[:num_tokens]
  page_log = outs[1].reshape(num_kv_heads, num_items, blocks_per_seq) if log_pages else None
  return out_THD, page_log, items.reshape(_NUM_FIELDS, num_items)


_STATICS = ("sm_scale", "sliding_window", "soft_cap", "kv_dtype", "tiling", "interpret")


@functools.partial(jax.jit, static_argnames=_STATICS)
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *,
                           sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, sinks=None, kv_dtype=None,
                           k_scales=None, v_scales=None, tiling: TpuTiling | None = None,
                           interpret: bool | pltpu.InterpretParams = False):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``.

  Args:
    q_THD: [T, H, D] queries; sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (see ``pallas_kernels.layout``).
    layer: int or traced int scalar, which layer's pages to read (inside the kernel).
    kv_lens_S: i32[S]; block_tables_SP: i32[S, P]; cu_q_lens: i32[S + 1]; num_seqs: i32[].
    sm_scale: softmax scale, default ``D ** -0.5``.
    sliding_window: W, a query at position p sees keys in ``(p - W, p]``; pages lying
      entirely before a work item's earliest window are never copied. None: no window.
    soft_cap: c, scores become ``c * tanh(s / c)`` before the mask. None: no cap.
    sinks: f32[H] or None, one extra logit per query head in the softmax denominator.
    kv_dtype: the logical K/V dtype when the pages hold its storage bits
      (``layout.storage_dtype``); each loaded page tile is bitcast back. None: the pages
      hold K/V as they are.
    k_scales, v_scales: f32[L, K, N, Z], exactly when ``kv_dtype`` is quantised (int8,
      float8): one scale per token and KV head, value = stored * scale. Each copied page's
      scale row is copied with it and applied inside the kernel; float32 accumulation.
    tiling: a ``TpuTiling``; default from the shapes (``default_tiling``).
    interpret: True (or a ``pltpu.InterpretParams``) runs the kernel in TPU interpret mode
      on CPU.

  Returns:
    [T, H, D] in q's dtype; padding rows are zero.
  """
  out, _, _ = _ragged_call(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, sinks, k_scales, v_scales,
                           sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, kv_dtype=kv_dtype, tiling=tiling,
                           interpret=interpret, log_pages=False)
  return out


@functools.partial(jax.jit, static_argnames=_STATICS)
def ragged_paged_attention_page_log(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, *,
                                    sm_scale: float | None = None,
                                    sliding_window: int | None = None,
                                    soft_cap: float | None = None, sinks=None, kv_dtype=None,
                                    k_scales=None, v_scales=None,
                                    tiling: TpuTiling | None = None,
                                    interpret: bool | pltpu.InterpretParams = True):
  """``ragged_paged_attention`` that also counts the page copies it starts (an instrument
  for tests and benchmarks, meant for interpret mode: the log lives in SMEM).

  Returns ``(out_THD, page_log_KWP, items_FW)``: ``page_log_KWP[k, w, p]`` is how many
  times the kernel started the K and V copies of table entry p of work item w's sequence
  for KV head k; ``items_FW`` is the work-item table (fields ``_SEQ``, ``_TILE``, ... as
  rows). Zero tokens return ``(zeros, None, None)``.
  """
  return _ragged_call(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                      block_tables_SP, cu_q_lens, num_seqs, sinks, k_scales, v_scales,
                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                      kv_dtype=kv_dtype, tiling=tiling, interpret=interpret, log_pages=True)
