"""The XLA path's prefill tiles: long query runs against long KV chunks, at matmul size.

A sequence with at least ``min_rows`` query rows in the call (a prompt, or a long chunk of
one) is cut into tiles of Q consecutive rows, aligned to its LAST row (so only its first
tile may be partial, and that one sees the least KV). Each tile is one work item; a
``while_loop`` over the live items runs, per item, a ``while_loop`` over its KV chunks of
R pages (J = R * Z positions), from the page holding the first position its first row sees
(0, or ``p_first - W + 1`` with a sliding window) to its causal horizon (last row's
position + 1). Chunks wholly above the diagonal or wholly before the window are never
visited, so the work follows the causal triangle (the band with a window) to within one
chunk per tile.

Per chunk: the R pages of each KV head are gathered once (one row of ``[Z, D]`` per page;
a bad block id or one past the table reads as zeros, as in the unit path), the scores are
one ``[K, Q * G, D] x [K, J, D]`` batched matmul, the online softmax folds the chunk into
the item's running max / sum / accumulator carried in the loop (no scatter: one item at a
time), and the values are a second matmul. Only chunks that reach past the first row's
position, or before the last row's window, build a mask; the others (most of a long
prompt's) are used as they are.

The item's output rows go back into the ``[K, T, G, D]`` output by a dynamic update of Q
rows (rows of the tile outside its sequence keep what was there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import metadata

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class PrefillTiling:
  """Static tiling of the prefill tiles.

  Attributes:
    q_tile: Q, query rows per tile.
    pages_per_chunk: R, pages per KV chunk (J = R * Z positions).
    min_rows: sequences with at least this many query rows in the call take this path.
  """

  q_tile: int
  pages_per_chunk: int
  min_rows: int

  def __post_init__(self):
    for name in ("q_tile", "pages_per_chunk", "min_rows"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")


_SCORES_PER_CHUNK = 1 << 20
"""Most scores one chunk step computes (K * Q * G * J, 4 MiB of float32): the scores and
probabilities stay near the cache; measured best on this 2-core CPU at both head shapes of
``benchmarks/attention_cpu.py`` (9/3 heads D=64, 32/8 heads D=128)."""
_CHUNK_POSITIONS = 256
"""J: KV positions per chunk (rounded to whole pages)."""
_MAX_Q_TILE = 256
_MIN_TOKENS = 256
"""Calls of fewer query rows T keep the units alone: the tiles would save them little time
and cost ~1.5 s more XLA compilation (measured at T = 110 on this CPU: 3.0 s -> 4.4 s)."""


def default_prefill_tiling(num_tokens: int, block_size: int, blocks_per_seq: int,
                           num_kv_heads: int, group: int) -> PrefillTiling | None:
  """J near 256 positions (whole pages, at most the table); Q the largest power of two with
  K * Q * G * J <= 2^20 scores, at most 256 and at most T; min_rows Q / 2 (a tile is never
  more than half padding). None when T < 256 (``_MIN_TOKENS``) or Q would be under 32."""
  pages_per_chunk = max(1, min(blocks_per_seq, _CHUNK_POSITIONS // block_size))
  chunk_len = pages_per_chunk * block_size
  q_tile = min(_MAX_Q_TILE, max(1, _SCORES_PER_CHUNK // (num_kv_heads * group * chunk_len)))
  q_tile = 1 << (min(q_tile, max(1, num_tokens)).bit_length() - 1)
  if num_tokens < _MIN_TOKENS or q_tile < 32:
    return None
  return PrefillTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk, min_rows=q_tile // 2)


def long_sequences(cu_q_lens, num_seqs, *, num_tokens: int, tiling: PrefillTiling):
  """bool[S]: the live sequences with at least ``min_rows`` query rows (this path's)."""
  num_seq_rows = cu_q_lens.shape[0] - 1
  q_len_S = jnp.clip(cu_q_lens[1:], 0, num_tokens) - jnp.clip(cu_q_lens[:-1], 0, num_tokens)
  return (jnp.arange(num_seq_rows) < num_seqs) & (q_len_S >= tiling.min_rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """The prefill tiles of one call (arrays over W = ``num_prefill_items`` slots; the first
  ``num_items`` are live). Tile w holds query rows ``[row0_W, row0_W + Q)`` of sequence
  ``seq_W`` (the first ``first_live_W`` of them belong to an earlier sequence or precede row
  0), row 0 at position ``pos0_W``; it reads pages ``[first_page_W, end_page_W)`` of its
  table in ``chunks_W`` chunks; ``horizon_W`` is one past the last position it sees."""

  num_items: jax.Array
  seq_W: jax.Array
  row0_W: jax.Array
  first_live_W: jax.Array
  pos0_W: jax.Array
  horizon_W: jax.Array
  first_page_W: jax.Array
  end_page_W: jax.Array
  chunks_W: jax.Array


def num_prefill_items(num_tokens: int, num_seq_rows: int, tiling: PrefillTiling) -> int:
  """Upper bound W on tiles: a long sequence of n rows has ceil(n / Q) <= n / Q + 1 tiles and
  holds at least ``min_rows`` of the T rows."""
  long_seqs = min(num_seq_rows, num_tokens // tiling.min_rows)
  return max(1, num_tokens // tiling.q_tile + long_seqs)


def plan_prefill(kv_lens_S, cu_q_lens, num_seqs, *, num_tokens: int, block_size: int,
                 blocks_per_seq: int, tiling: PrefillTiling,
                 sliding_window: int | None = None) -> PrefillPlan:
  """Tiles of the long sequences and their KV page ranges, as ``prefill_attention`` runs
  them. Tiles are aligned to each sequence's last row; a tile reads from the page holding
  the first position its first live row sees (0, or ``p_first - W + 1``) up to its horizon
  (its last row's position + 1, at most the sequence's length and the table's capacity)."""
  q_tile = tiling.q_tile
  num_seq_rows = kv_lens_S.shape[0]
  q_start_S = jnp.clip(cu_q_lens[:-1], 0, num_tokens)
  q_end_S = jnp.clip(cu_q_lens[1:], 0, num_tokens)
  long_S = long_sequences(cu_q_lens, num_seqs, num_tokens=num_tokens, tiling=tiling)
  tiles_S = jnp.where(long_S, (q_end_S - q_start_S + q_tile - 1) // q_tile, 0)
  tiles_end_S = jnp.cumsum(tiles_S)
  w = jnp.arange(num_prefill_items(num_tokens, num_seq_rows, tiling), dtype=jnp.int32)
  seq_W = jnp.minimum(metadata.search_right(tiles_end_S, w), num_seq_rows - 1)
  tiles_W = tiles_S[seq_W]
  tile_W = w - (tiles_end_S[seq_W] - tiles_W)
  q_end_W = q_end_S[seq_W]
  row0_W = q_end_W - (tiles_W - tile_W) * q_tile  # may precede q_start (first tile only)
  pos0_W = kv_lens_S[seq_W] - q_end_W + row0_W
  first_live_W = jnp.maximum(q_start_S[seq_W] - row0_W, 0)
  horizon_W = jnp.clip(jnp.minimum(pos0_W + q_tile, kv_lens_S[seq_W]), 0,
                       blocks_per_seq * block_size)
  end_page_W = (horizon_W + block_size - 1) // block_size
  if sliding_window is None:
    first_page_W = jnp.zeros_like(end_page_W)
  else:
    first_pos_W = pos0_W + first_live_W - sliding_window + 1
    first_page_W = jnp.minimum(jnp.clip(first_pos_W, 0, None) // block_size, end_page_W)
  chunks_W = (end_page_W - first_page_W + tiling.pages_per_chunk - 1) // tiling.pages_per_chunk
  return PrefillPlan(num_items=tiles_end_S[-1], seq_W=seq_W, row0_W=row0_W,
                     first_live_W=first_live_W, pos0_W=pos0_W, horizon_W=horizon_W,
                     first_page_W=first_page_W, end_page_W=end_page_W,
                     chunks_W=jnp.where(w < tiles_end_S[-1], chunks_W, 0))


def prefill_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                      cu_q_lens, num_seqs, out_THD, *, sm_scale: float,
                      tiling: PrefillTiling, sliding_window: int | None = None,
                      soft_cap: float | None = None, sinks=None, kv_dtype=None,
                      k_scales=None, v_scales=None):
  """Attention of the long sequences' rows (``long_sequences``) written into ``out_THD``
  (float32), whose other rows are kept. A call without a long sequence does nothing (one
  ``cond``), so decode-only batches pay no layout copies for it."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages_LKNZD.shape
  blocks_per_seq = block_tables_SP.shape[1]
  group = num_q_heads // num_kv_heads
  q_tile, pages_per_chunk = tiling.q_tile, tiling.pages_per_chunk
  chunk_len = pages_per_chunk * block_size
  rows = q_tile * group
  num_page_rows = num_layers * num_kv_heads * num_blocks
  layer = jnp.asarray(layer, jnp.int32)
  layer_ok = (layer >= 0) & (layer < num_layers)
  plan = plan_prefill(kv_lens_S, cu_q_lens, num_seqs, num_tokens=num_tokens,
                      block_size=block_size, blocks_per_seq=blocks_per_seq, tiling=tiling,
                      sliding_window=sliding_window)

  if sinks is None:
    init_max_KM = jnp.full((num_kv_heads, rows), _NEG_INF, jnp.float32)
    init_denom_KM = jnp.zeros((num_kv_heads, rows), jnp.float32)
  else:
    # Packed row m = q * G + g of KV head k is query head k * G + g.
    init_max_KM = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group),
                           (1, q_tile))
    init_denom_KM = jnp.ones((num_kv_heads, rows), jnp.float32)
  flat_k = k_pages_LKNZD.reshape(num_page_rows, block_size * head_dim)
  flat_v = v_pages_LKNZD.reshape(num_page_rows, block_size * head_dim)
  flat_ks = None if k_scales is None else k_scales.reshape(num_page_rows, block_size)
  flat_vs = None if v_scales is None else v_scales.reshape(num_page_rows, block_size)
  row_in_tile_M = jnp.arange(rows, dtype=jnp.int32) // group  # packed row -> tile row
  kv_in_chunk_J = jnp.arange(chunk_len, dtype=jnp.int32)

  def gather(flat, flat_scales, page_row_KR):  # [K, R] page rows -> [K, J, D] float32
    chunk = jnp.take(flat, page_row_KR, axis=0, mode="fill", fill_value=0)
    chunk = chunk.reshape(num_kv_heads, chunk_len, head_dim)
    scales = None
    if flat_scales is not None:  # the same rows' scales: [K, J]
      scales = jnp.take(flat_scales, page_row_KR, axis=0, mode="fill", fill_value=0)
      scales = scales.reshape(num_kv_heads, chunk_len)
    # The gathered chunk only: bits back to values (times their scales), float32.
    return layout.dequantize(chunk, scales, kv_dtype).astype(jnp.float32)

  def item_body(w, out_KTGD, q_KTGD):
    row0, first_live, pos0 = plan.row0_W[w], plan.first_live_W[w], plan.pos0_W[w]
    horizon, first_page, end_page = plan.horizon_W[w], plan.first_page_W[w], plan.end_page_W[w]
    p_first, p_last = pos0 + first_live, pos0 + q_tile - 1
    table_P = block_tables_SP[plan.seq_W[w]]
    q_KMD = lax.dynamic_slice_in_dim(q_KTGD, row0 + q_tile, q_tile, axis=1).reshape(
        num_kv_heads, rows, head_dim)
    qpos_M = pos0 + row_in_tile_M

    def chunk_body(c, carry):
      row_max_KM, denom_KM, acc_KMD = carry
      page0 = first_page + c * pages_per_chunk
      page_R = page0 + jnp.arange(pages_per_chunk, dtype=jnp.int32)
      ids_R = table_P.at[page_R].get(mode="fill", fill_value=num_blocks)
      # An id outside [0, N) must not wrap (jnp normalises negative indices before "fill").
      owned_R = ((page_R < end_page) & (page_R < blocks_per_seq) & (ids_R >= 0)
                 & (ids_R < num_blocks) & layer_ok)
      page_row_KR = ((layer * num_kv_heads + jnp.arange(num_kv_heads)[:, None]) * num_blocks
                     + ids_R[None])
      page_row_KR = jnp.where(owned_R[None], page_row_KR, num_page_rows)
      k_KJD = gather(flat_k, flat_ks, page_row_KR)
      v_KJD = gather(flat_v, flat_vs, page_row_KR)
      scores_KMJ = jnp.einsum("kmd,kjd->kmj", q_KMD, k_KJD, precision=lax.Precision.HIGHEST)
      if soft_cap is not None:
        scores_KMJ = soft_cap * jnp.tanh(scores_KMJ / soft_cap)
      kv_pos_J = page0 * block_size + kv_in_chunk_J

      def masked(scores_KMJ, v_KJD):
        # Past the horizon (pages a sequence owns may hold NaN past its length) never
        # counts: zero V there (not multiply), -inf its scores.
        in_range_J = kv_pos_J < horizon
        visible_MJ = in_range_J[None, :] & (kv_pos_J[None, :] <= qpos_M[:, None])
        if sliding_window is not None:
          visible_MJ &= kv_pos_J[None, :] > qpos_M[:, None] - sliding_window
        return (jnp.where(visible_MJ[None], scores_KMJ, _NEG_INF),
                jnp.where(in_range_J[None, :, None], v_KJD, 0.0))

      # A chunk wholly at or before the first live row's position (and inside the last
      # row's window) is seen whole by every live row: no mask.
      chunk_end = page0 * block_size + chunk_len
      clean = (chunk_end <= p_first + 1) & (chunk_end <= horizon)
      if sliding_window is not None:
        clean &= page0 * block_size > p_last - sliding_window
      scores_KMJ, v_KJD = lax.cond(clean, lambda s, v: (s, v), masked, scores_KMJ, v_KJD)
      new_max_KM = jnp.maximum(row_max_KM, jnp.max(scores_KMJ, axis=-1))
      safe_max_KM = jnp.where(jnp.isfinite(new_max_KM), new_max_KM, 0.0)
      probs_KMJ = jnp.exp(scores_KMJ - safe_max_KM[..., None])
      rescale_KM = jnp.exp(row_max_KM - safe_max_KM)
      denom_KM = denom_KM * rescale_KM + jnp.sum(probs_KMJ, axis=-1)
      acc_KMD = acc_KMD * rescale_KM[..., None] + jnp.einsum(
          "kmj,kjd->kmd", probs_KMJ, v_KJD, precision=lax.Precision.HIGHEST)
      return new_max_KM, denom_KM, acc_KMD

    init = (init_max_KM, init_denom_KM, jnp.zeros((num_kv_heads, rows, head_dim),
                                                  jnp.float32))
    _, denom_KM, acc_KMD = lax.fori_loop(0, plan.chunks_W[w], chunk_body, init)
    res_KMD = acc_KMD / jnp.where(denom_KM > 0, denom_KM, 1.0)[..., None]
    res_KQGD = res_KMD.reshape(num_kv_heads, q_tile, group, head_dim)
    # Rows of the tile before its sequence's first keep what the other path wrote.
    old_KQGD = lax.dynamic_slice_in_dim(out_KTGD, row0 + q_tile, q_tile, axis=1)
    live_Q = jnp.arange(q_tile) >= first_live
    new_KQGD = jnp.where(live_Q[None, :, None, None], res_KQGD, old_KQGD)
    return lax.dynamic_update_slice_in_dim(out_KTGD, new_KQGD, row0 + q_tile, axis=1)

  def run(out_THD):
    # Queries [K, Q + T, G, D], scaled, with Q rows of padding in front (a sequence's first
    # tile may start before row 0); the output likewise.
    q_KTGD = (q_THD.astype(jnp.float32) * sm_scale).reshape(
        num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_KTGD = jnp.pad(q_KTGD, ((0, 0), (q_tile, 0), (0, 0), (0, 0)))
    out_KTGD = out_THD.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    out_KTGD = jnp.pad(out_KTGD, ((0, 0), (q_tile, 0), (0, 0), (0, 0)))
    out_KTGD = lax.fori_loop(0, plan.num_items, lambda w, out: item_body(w, out, q_KTGD),
                             out_KTGD)
    return out_KTGD[:, q_tile:].transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads,
                                                              head_dim)

  return lax.cond(plan.num_items > 0, run, lambda out: out, out_THD.astype(jnp.float32))
