"""Ragged paged attention in XLA: one flat list of KV chunks, an online softmax per item.

The work is cut into items, one per (query tile, sequence) pair that share a token: a tile
of Q consecutive query rows that spans a sequence boundary yields one item per sequence it
touches. An item needs the KV positions below its causal horizon (its last live row's
position + 1), read in chunks of R pages (J = R * Z positions). The (item, chunk) pairs of
all items form one flat list of work units, item after item, and a ``while_loop`` takes U
of them per step: its trip count follows the KV the batch actually holds. A long-tailed
batch (one long sequence among short ones) costs its total length, not the longest length
times the number of items, and padding items cost nothing. Each step scores its U chunks
against their items' query rows and folds the partial softmax sums into the items' running
ones (a scatter-max, then scatter-adds): flash attention's online softmax, over units.
Memory is bounded by U chunks at any context length.

Long query runs take prefill tiles instead (``prefill.py``): in a call of at least 256 rows,
every sequence with at least ``min_rows`` query rows (a prompt or a long chunk of one) is
cut into tiles of up to 256 rows, each run against chunks of ~256 KV positions with one
batched matmul per product and its softmax state carried in the loop, over the causal
triangle only. The units then skip those sequences (``tile_sequence_items``' ``skip_S``),
so decode rows and short chunks keep the unit loop, and a call without a long sequence
skips the tiles with one ``cond``. Smaller calls compile the units alone, as before.

Pages a unit does not own (past its item's causal horizon or its sequence's length, or a
block id outside ``[0, N)``) are replaced by an out-of-range row that the gather fills with
zeros: they are never read.

Attention variants. With a sliding window W, an item's chunks start at the page holding
the first position its FIRST query row sees (``p_first - W + 1``): pages wholly before it
never become units, so the loop's trip count and the gathers follow min(context, W + Q)
rather than the context. A soft cap squashes the scaled scores before the mask; sinks
start each row's running max at its head's sink logit and its running sum at 1 (the sink's
own exp(sink - max)), and take no value. With ``kv_dtype``, the pages hold storage bits and
each gathered chunk is bitcast back (``layout.from_storage``), never the whole pool.

Quantised pools (int8 / float8 bits, ``k_scales`` / ``v_scales`` [L, K, N, Z]): each unit
gathers the ``[Z]`` scale rows of exactly the pages it gathers (same rows, same
out-of-range fill) and dequantises the chunk to float32 before the dot; the softmax and
both products stay float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import metadata
from paged_jax.pallas_kernels import validation
from paged_jax.pallas_kernels.xla import prefill
from paged_jax.pallas_kernels.xla.prefill import PrefillTiling

_NEG_INF = float("-inf")
_SCORES_PER_STEP = 1 << 16
"""Most scores (per KV head) one loop step computes by default: U * M * J."""
_MIN_UNITS_PER_STEP = 16
"""Default U is at least this (or every unit there can be): a batch of a few long
sequences (small W) would otherwise pay one loop step per few chunks."""
_ELEMENTWISE_ROWS = 8
"""With at most this many packed query rows (M) per item, e.g. decode, the two products
are a multiply and a sum, which XLA on CPU runs faster than a batch of tiny matmuls; larger
tiles (prefill) use ``einsum``."""


@dataclasses.dataclass(frozen=True)
class XlaTiling:
  """Static tiling of the XLA path.

  Attributes:
    q_tile: Q, query rows per work item. 1 suits decode (one item per token); larger tiles
      amortise the KV gather over many prefill rows of one sequence.
    pages_per_chunk: R, pages in one work unit (J = R * Z KV positions).
    units_per_step: U, work units each loop step processes; None picks one from the
      shapes (``default_units_per_step``).
    prefill: the prefill tiles (``prefill.PrefillTiling``) that sequences with many query
      rows in the call take instead of the units; None: every row takes the units.
  """

  q_tile: int
  pages_per_chunk: int
  units_per_step: int | None = None
  prefill: PrefillTiling | None = None

  def __post_init__(self):
    for name in ("q_tile", "pages_per_chunk", "units_per_step"):
      value = getattr(self, name)
      if value is None and name == "units_per_step":
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    if self.prefill is not None and not isinstance(self.prefill, PrefillTiling):
      raise ValueError(f"prefill={self.prefill!r} must be a PrefillTiling or None")


def default_tiling(num_tokens: int, num_seq_rows: int, block_size: int,
                   blocks_per_seq: int, *, num_kv_heads: int = 1, group: int = 1
                   ) -> XlaTiling:
  """Units: Q near the mean rows per sequence (a power of two, at most 64); J near 64
  positions (short chunks waste little past each item's horizon; the flat loop makes many
  cheap). Prefill tiles from ``prefill.default_prefill_tiling`` (K and G size them)."""
  rows_per_seq = max(1, num_tokens // max(1, num_seq_rows))
  q_tile = min(64, 1 << (rows_per_seq.bit_length() - 1))
  pages_per_chunk = max(1, min(blocks_per_seq, 64 // block_size))
  return XlaTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk,
                   prefill=prefill.default_prefill_tiling(num_tokens, block_size,
                                                          blocks_per_seq, num_kv_heads, group))


def default_units_per_step(num_items: int, rows: int, chunk_len: int,
                           max_units: int) -> int:
  """U: one unit per item (W), at least ``_MIN_UNITS_PER_STEP``, at most every unit
  (``max_units``) and at most ``_SCORES_PER_STEP`` scores per KV head (large prefill tiles);
  never below 1."""
  budget = _SCORES_PER_STEP // (rows * chunk_len)
  return max(1, min(max(num_items, _MIN_UNITS_PER_STEP), max_units, budget))


def active_prefill_tiling(tiling: XlaTiling, num_tokens: int) -> PrefillTiling | None:
  """The prefill tiles this call can use: none when T rows cannot hold a long sequence."""
  if tiling.prefill is None or num_tokens < tiling.prefill.min_rows:
    return None
  return tiling.prefill


def num_work_items(num_tokens: int, num_seq_rows: int, q_tile: int) -> int:
  """Upper bound W on (tile, sequence) items.

  Consecutive sequences share at most one tile, so the items are at most the tiles plus
  one per extra non-empty sequence; and never more than T, since each holds a row.
  """
  num_tiles = -(-num_tokens // q_tile)
  return max(1, min(num_tokens, num_tiles + min(num_seq_rows, num_tokens) - 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkPlan:
  """The work items and units of one call (all arrays traced; see ``plan_work``).

  Item w covers query rows ``row_WQ[w]`` (``row_live_WQ``: rows of its sequence) at
  positions ``qpos_WQ`` (-1 for dead rows) and reads pages ``[first_page_W, end_page_W)``
  of its sequence's block table, in ``units_W`` chunks of R pages starting at
  ``first_page_W``; ``units_end_W`` is their running total. ``horizon_W``: one past the
  last position it sees.
  """

  item_seq_W: jax.Array
  row_WQ: jax.Array
  row_live_WQ: jax.Array
  qpos_WQ: jax.Array
  horizon_W: jax.Array
  first_page_W: jax.Array
  end_page_W: jax.Array
  units_W: jax.Array
  units_end_W: jax.Array

  @property
  def num_units(self):
    return self.units_end_W[-1]

  @property
  def pages_W(self):
    """Pages item w reads (the table entries it gathers; a bad block id is not read)."""
    return self.end_page_W - self.first_page_W


def plan_work(kv_lens_S, cu_q_lens, num_seqs, *, num_tokens: int, block_size: int,
              blocks_per_seq: int, tiling: XlaTiling, sliding_window: int | None = None
              ) -> WorkPlan:
  """Items (query tile, sequence) and their KV page ranges, as the kernel runs them.

  An item reads from the page holding the first position its first live row sees (0
  without a window; ``p_first - W + 1`` with one) up to its causal horizon (its last live
  row's position + 1, at most its sequence's length and the table's capacity).
  """
  q_tile = tiling.q_tile
  num_seq_rows = kv_lens_S.shape[0]
  num_items = num_work_items(num_tokens, num_seq_rows, q_tile)
  prefill_tiling = active_prefill_tiling(tiling, num_tokens)
  long_S = (None if prefill_tiling is None else prefill.long_sequences(
      cu_q_lens, num_seqs, num_tokens=num_tokens, tiling=prefill_tiling))
  item_seq_W, item_tile_W, item_live_W, q_start_S, q_end_S = metadata.tile_sequence_items(
      cu_q_lens, num_seqs, num_tokens=num_tokens, q_tile=q_tile, num_items=num_items,
      skip_S=long_S)
  row_WQ = item_tile_W[:, None] * q_tile + jnp.arange(q_tile)[None, :]
  seq_WQ = jnp.broadcast_to(item_seq_W[:, None], row_WQ.shape)
  row_live_WQ = (item_live_W[:, None] & (row_WQ >= q_start_S[seq_WQ])
                 & (row_WQ < q_end_S[seq_WQ]))
  qpos_WQ = metadata.query_positions(row_WQ, seq_WQ, kv_lens_S, cu_q_lens)
  qpos_WQ = jnp.where(row_live_WQ, qpos_WQ, -1)  # a dead row sees no key
  # KV positions each item needs (no more than its table holds, as the reference reads).
  horizon_W = jnp.clip(jnp.minimum(jnp.max(qpos_WQ, axis=1) + 1, kv_lens_S[item_seq_W]), 0,
                       blocks_per_seq * block_size)
  end_page_W = (horizon_W + block_size - 1) // block_size
  if sliding_window is None:
    first_page_W = jnp.zeros_like(end_page_W)
  else:
    # The first live row is the one at the smallest position; what it cannot see (at or
    # before p_first - W), no later row of the item sees either.
    first_pos_W = jnp.min(jnp.where(row_live_WQ, qpos_WQ, jnp.iinfo(jnp.int32).max),
                          axis=1) - sliding_window + 1
    first_page_W = jnp.clip(first_pos_W, 0, None) // block_size
    first_page_W = jnp.minimum(first_page_W, end_page_W)
  units_W = (end_page_W - first_page_W + tiling.pages_per_chunk - 1) // tiling.pages_per_chunk
  return WorkPlan(item_seq_W=item_seq_W, row_WQ=row_WQ, row_live_WQ=row_live_WQ,
                  qpos_WQ=qpos_WQ, horizon_W=horizon_W, first_page_W=first_page_W,
                  end_page_W=end_page_W, units_W=units_W, units_end_W=jnp.cumsum(units_W))


@functools.partial(jax.jit, static_argnames=("sm_scale", "tiling", "sliding_window",
                                             "soft_cap", "kv_dtype"))
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, k_scales=None, v_scales=None,
                           tiling: XlaTiling | None = None):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``."""
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    k_scales=k_scales, v_scales=v_scales)
  validation.static_validate_variants(q_THD.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  num_tokens, num_q_heads, head_dim = q_THD.shape
  num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages_LKNZD.shape
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  group = num_q_heads // num_kv_heads
  if num_tokens == 0:
    return jnp.zeros_like(q_THD)
  if tiling is None:
    tiling = default_tiling(num_tokens, num_seq_rows, block_size, blocks_per_seq,
                            num_kv_heads=num_kv_heads, group=group)
  q_tile, pages_per_chunk = tiling.q_tile, tiling.pages_per_chunk
  chunk_len = pages_per_chunk * block_size
  num_items = num_work_items(num_tokens, num_seq_rows, q_tile)
  rows = q_tile * group
  units_per_step = tiling.units_per_step or default_units_per_step(
      num_items, rows, chunk_len, num_items * -(-blocks_per_seq // pages_per_chunk))
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  layer = jnp.asarray(layer, jnp.int32)
  # The pages as rows of one [Z, D] page each: row (l * K + k) * N + n.
  num_page_rows = num_layers * num_kv_heads * num_blocks

  # --- Work items and units: (tile, sequence) pairs, then (item, chunk) pairs. ---
  plan = plan_work(kv_lens_S, cu_q_lens, num_seqs, num_tokens=num_tokens,
                   block_size=block_size, blocks_per_seq=blocks_per_seq, tiling=tiling,
                   sliding_window=sliding_window)
  item_seq_W, row_WQ, row_live_WQ, qpos_WQ = (plan.item_seq_W, plan.row_WQ,
                                              plan.row_live_WQ, plan.qpos_WQ)
  units_W, units_end_W = plan.units_W, plan.units_end_W
  num_units = plan.num_units
  num_steps = (num_units + units_per_step - 1) // units_per_step

  q_WQHD = q_THD.at[row_WQ].get(mode="fill", fill_value=0).astype(jnp.float32)
  # Rows (q, g) of one KV head are packed together: [K, W, M = Q * G, D].
  q_WQKGD = q_WQHD.reshape(num_items, q_tile, num_kv_heads, group, head_dim)
  q_KWMD = q_WQKGD.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_items, rows, head_dim)
  qpos_WM = jnp.repeat(qpos_WQ, group, axis=1)
  tables_WP = block_tables_SP[item_seq_W]
  layer_ok = (layer >= 0) & (layer < num_layers)

  def unit_step(step, carry):
    row_max_KWM, denom_KWM, acc_KWMD = carry
    unit_U = step * units_per_step + jnp.arange(units_per_step, dtype=jnp.int32)
    live_U = unit_U < num_units
    item_U = jnp.minimum(metadata.search_right(units_end_W, unit_U), num_items - 1)
    chunk_U = unit_U - (units_end_W - units_W)[item_U]
    end_page_U = jnp.where(live_U, plan.end_page_W[item_U], 0)
    first_page_U = plan.first_page_W[item_U] + chunk_U * pages_per_chunk
    page_UR = first_page_U[:, None] + jnp.arange(pages_per_chunk)[None, :]
    owned_UR = (page_UR < end_page_U[:, None]) & (page_UR < blocks_per_seq)
    ids_UR = tables_WP.at[item_U[:, None], page_UR].get(mode="fill", fill_value=num_blocks)
    # An id outside [0, N) must not wrap (jnp normalises negative indices before "fill").
    owned_UR &= (ids_UR >= 0) & (ids_UR < num_blocks) & layer_ok
    page_row_KUR = ((layer * num_kv_heads + jnp.arange(num_kv_heads)[:, None, None])
                    * num_blocks + ids_UR[None])
    page_row_KUR = jnp.where(owned_UR[None], page_row_KUR, num_page_rows)

    def gather(pages, scales):  # [K, U, R] rows of Z * D (scales: Z) -> [K, U, J, D]
      chunk = jnp.take(pages.reshape(num_page_rows, block_size * head_dim), page_row_KUR,
                       axis=0, mode="fill", fill_value=0)
      chunk = chunk.reshape(num_kv_heads, units_per_step, chunk_len, head_dim)
      if scales is not None:  # the same page rows' scales: [K, U, R, Z] -> [K, U, J]
        scales = jnp.take(scales.reshape(num_page_rows, block_size), page_row_KUR, axis=0,
                          mode="fill", fill_value=0)
        scales = scales.reshape(num_kv_heads, units_per_step, chunk_len)
      # The gathered chunk only: bits back to values (times their scales), float32.
      return layout.dequantize(chunk, scales, kv_dtype).astype(jnp.float32)

    k_KUJD = gather(k_pages_LKNZD, k_scales)
    v_KUJD = gather(v_pages_LKNZD, v_scales)
    kv_pos_UJ = first_page_U[:, None] * block_size + jnp.arange(chunk_len)[None, :]
    horizon_U = jnp.where(live_U, plan.horizon_W[item_U], 0)
    visible_UJ = kv_pos_UJ < horizon_U[:, None]
    qpos_UMJ = qpos_WM[item_U][:, :, None]
    visible_UMJ = visible_UJ[:, None, :] & (kv_pos_UJ[:, None, :] <= qpos_UMJ)
    if sliding_window is not None:
      visible_UMJ &= kv_pos_UJ[:, None, :] > qpos_UMJ - sliding_window
    # Pages a sequence owns may hold garbage (NaN) past its length: zero them, not multiply.
    v_KUJD = jnp.where(visible_UJ[None, :, :, None], v_KUJD, 0.0)
    q_KUMD = q_KWMD[:, item_U]
    if rows <= _ELEMENTWISE_ROWS:
      scores_KUMJ = jnp.sum(q_KUMD[:, :, :, None, :] * k_KUJD[:, :, None], axis=-1)
    else:
      scores_KUMJ = jnp.einsum("kumd,kujd->kumj", q_KUMD, k_KUJD,
                               precision=lax.Precision.HIGHEST)
    scores_KUMJ = scores_KUMJ * sm_scale
    if soft_cap is not None:
      scores_KUMJ = soft_cap * jnp.tanh(scores_KUMJ / soft_cap)
    scores_KUMJ = jnp.where(visible_UMJ[None], scores_KUMJ, _NEG_INF)
    unit_max_KUM = jnp.max(scores_KUMJ, axis=-1)
    safe_unit_max_KUM = jnp.where(jnp.isfinite(unit_max_KUM), unit_max_KUM, 0.0)
    probs_KUMJ = jnp.exp(scores_KUMJ - safe_unit_max_KUM[..., None])
    unit_denom_KUM = jnp.sum(probs_KUMJ, axis=-1)
    if rows <= _ELEMENTWISE_ROWS:
      unit_acc_KUMD = jnp.sum(probs_KUMJ[..., None] * v_KUJD[:, :, None], axis=-2)
    else:
      unit_acc_KUMD = jnp.einsum("kumj,kujd->kumd", probs_KUMJ, v_KUJD,
                                 precision=lax.Precision.HIGHEST)
    # Fold the units into their items; dead units go to an out-of-range item (dropped).
    dest_U = jnp.where(live_U, item_U, num_items)
    new_max_KWM = row_max_KWM.at[:, dest_U].max(unit_max_KUM, mode="drop")
    safe_max_KWM = jnp.where(jnp.isfinite(new_max_KWM), new_max_KWM, 0.0)
    rescale_KWM = jnp.exp(row_max_KWM - safe_max_KWM)
    weight_KUM = jnp.exp(unit_max_KUM - safe_max_KWM[:, item_U])
    denom_KWM = (denom_KWM * rescale_KWM).at[:, dest_U].add(unit_denom_KUM * weight_KUM,
                                                            mode="drop")
    acc_KWMD = (acc_KWMD * rescale_KWM[..., None]).at[:, dest_U].add(
        unit_acc_KUMD * weight_KUM[..., None], mode="drop")
    return new_max_KWM, denom_KWM, acc_KWMD

  if sinks is None:
    init_max_KWM = jnp.full((num_kv_heads, num_items, rows), _NEG_INF, jnp.float32)
    init_denom_KWM = jnp.zeros((num_kv_heads, num_items, rows), jnp.float32)
  else:
    # Packed row m = q * G + g of KV head k is query head k * G + g: its sink is the start
    # of the running max, and exp(sink - sink) = 1 the start of the running sum.
    sinks_KM = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group),
                        (1, q_tile))
    init_max_KWM = jnp.broadcast_to(sinks_KM[:, None, :], (num_kv_heads, num_items, rows))
    init_denom_KWM = jnp.ones((num_kv_heads, num_items, rows), jnp.float32)
  init = (init_max_KWM, init_denom_KWM,
          jnp.zeros((num_kv_heads, num_items, rows, head_dim), jnp.float32))
  _, denom_KWM, acc_KWMD = lax.fori_loop(0, num_steps, unit_step, init)
  out_KWMD = acc_KWMD / jnp.where(denom_KWM > 0, denom_KWM, 1.0)[..., None]
  out_KWQGD = out_KWMD.reshape(num_kv_heads, num_items, q_tile, group, head_dim)
  out_WQHD = out_KWQGD.transpose(1, 2, 0, 3, 4).reshape(num_items, q_tile, num_q_heads,
                                                       head_dim)
  # Each live row belongs to exactly one item; dead rows go to an out-of-range index.
  dest_WQ = jnp.where(row_live_WQ, row_WQ, num_tokens)
  out_THD = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
  out_THD = out_THD.at[dest_WQ].set(out_WQHD, mode="drop")
  prefill_tiling = active_prefill_tiling(tiling, num_tokens)
  if prefill_tiling is not None:  # the long sequences' rows (skipped by the units above)
    out_THD = prefill.prefill_attention(
        q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP, cu_q_lens,
        num_seqs, out_THD, sm_scale=sm_scale, tiling=prefill_tiling,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype,
        k_scales=k_scales, v_scales=v_scales)
  return out_THD.astype(q_THD.dtype)
