"""Ragged paged attention in XLA, blocked over the block table with an online softmax.

The work is cut into items, one per (query tile, sequence) pair that share a token: a tile
of Q consecutive query rows that spans a sequence boundary yields one item per sequence it
touches. All items advance together through their sequences' pages, R pages (J = R * Z KV
positions) per step of a ``while_loop`` whose trip count is the longest item's, so memory
is bounded by one chunk per item at any context length and short batches stop early.
Pages an item does not own (past its causal horizon or its sequence's length) are replaced
by an out-of-range id that the gather fills with zeros: they are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import metadata

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class XlaTiling:
  """Static tiling of the XLA path.

  Attributes:
    q_tile: Q, query rows per work item. 1 suits decode (one item per token); larger tiles
      amortise the KV gather over many prefill rows of one sequence.
    pages_per_chunk: R, pages each item reads per loop step.
  """

  q_tile: int
  pages_per_chunk: int

  def __post_init__(self):
    for name in ("q_tile", "pages_per_chunk"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")


def default_tiling(num_tokens: int, num_seq_rows: int, block_size: int,
                   blocks_per_seq: int) -> XlaTiling:
  """Q near the mean rows per sequence (a power of two, at most 64); J near 256 positions."""
  rows_per_seq = max(1, num_tokens // max(1, num_seq_rows))
  q_tile = min(64, 1 << (rows_per_seq.bit_length() - 1))
  pages_per_chunk = max(1, min(blocks_per_seq, 256 // block_size))
  return XlaTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk)


def num_work_items(num_tokens: int, num_seq_rows: int, q_tile: int) -> int:
  """Upper bound W on (tile, sequence) items.

  Consecutive sequences share at most one tile, so the items are at most the tiles plus
  one per extra non-empty sequence; and never more than T, since each holds a row.
  """
  num_tiles = -(-num_tokens // q_tile)
  return max(1, min(num_tokens, num_tiles + min(num_seq_rows, num_tokens) - 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "tiling"))
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, sm_scale: float,
                           tiling: XlaTiling | None = None):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  _, num_kv_heads, num_blocks, block_size, _ = k_pages_LKNZD.shape
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  group = num_q_heads // num_kv_heads
  if num_tokens == 0:
    return jnp.zeros_like(q_THD)
  if tiling is None:
    tiling = default_tiling(num_tokens, num_seq_rows, block_size, blocks_per_seq)
  q_tile, pages_per_chunk = tiling.q_tile, tiling.pages_per_chunk
  chunk_len = pages_per_chunk * block_size
  num_items = num_work_items(num_tokens, num_seq_rows, q_tile)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  layer = jnp.asarray(layer, jnp.int32)

  # --- Work items: which (tile, sequence) pairs exist, in token order. ---
  item_seq_W, item_tile_W, item_live_W, q_start_S, q_end_S = metadata.tile_sequence_items(
      cu_q_lens, num_seqs, num_tokens=num_tokens, q_tile=q_tile, num_items=num_items)

  # --- Rows of each item: token ids, liveness and query positions. ---
  row_WQ = item_tile_W[:, None] * q_tile + jnp.arange(q_tile)[None, :]
  seq_WQ = jnp.broadcast_to(item_seq_W[:, None], row_WQ.shape)
  row_live_WQ = (item_live_W[:, None] & (row_WQ >= q_start_S[seq_WQ])
                 & (row_WQ < q_end_S[seq_WQ]))
  qpos_WQ = metadata.query_positions(row_WQ, seq_WQ, kv_lens_S, cu_q_lens)
  qpos_WQ = jnp.where(row_live_WQ, qpos_WQ, -1)  # a dead row sees no key
  kv_len_W = kv_lens_S[item_seq_W]
  horizon_W = jnp.minimum(jnp.max(qpos_WQ, axis=1) + 1, kv_len_W)  # KV positions needed
  num_chunks = jnp.max(jnp.maximum(horizon_W, 0) + chunk_len - 1) // chunk_len

  q_WQHD = q_THD.at[row_WQ].get(mode="fill", fill_value=0).astype(jnp.float32)
  # Rows (q, g) of one KV head are packed together: [W, K, Q * G, D].
  q_WKMD = q_WQHD.reshape(num_items, q_tile, num_kv_heads, group, head_dim)
  q_WKMD = q_WKMD.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, -1, head_dim)
  qpos_WM = jnp.repeat(qpos_WQ, group, axis=1)
  tables_WP = block_tables_SP[item_seq_W]

  def chunk_step(chunk, carry):
    row_max_WKM, denom_WKM, acc_WKMD = carry
    page_R = chunk * pages_per_chunk + jnp.arange(pages_per_chunk)
    owned_WR = (page_R[None, :] * block_size < horizon_W[:, None]) & (page_R < blocks_per_seq)
    ids_WR = tables_WP.at[:, page_R].get(mode="fill", fill_value=num_blocks)
    # An id outside [0, N) must not wrap (jnp normalises negative indices before "fill").
    owned_WR &= (ids_WR >= 0) & (ids_WR < num_blocks)
    block_ids_WR = jnp.where(owned_WR, ids_WR, num_blocks)
    # [W, R, K, Z, D] (advanced indices first) -> [W, K, J, D].
    def gather(pages):
      chunk_WRKZD = pages.at[layer, :, block_ids_WR].get(mode="fill", fill_value=0)
      chunk_WKJD = chunk_WRKZD.transpose(0, 2, 1, 3, 4)
      return chunk_WKJD.reshape(num_items, num_kv_heads, chunk_len, head_dim).astype(
          jnp.float32)
    k_WKJD, v_WKJD = gather(k_pages_LKNZD), gather(v_pages_LKNZD)
    kv_pos_J = chunk * chunk_len + jnp.arange(chunk_len)
    visible_WJ = kv_pos_J[None, :] < horizon_W[:, None]
    visible_WMJ = visible_WJ[:, None, :] & (kv_pos_J[None, None, :] <= qpos_WM[:, :, None])
    # Pages a sequence owns may hold garbage (NaN) past its length: zero them, not multiply.
    v_WKJD = jnp.where(visible_WJ[:, None, :, None], v_WKJD, 0.0)
    scores_WKMJ = jnp.einsum("wkmd,wkjd->wkmj", q_WKMD, k_WKJD,
                             precision=lax.Precision.HIGHEST) * sm_scale
    scores_WKMJ = jnp.where(visible_WMJ[:, None], scores_WKMJ, _NEG_INF)
    new_max_WKM = jnp.maximum(row_max_WKM, jnp.max(scores_WKMJ, axis=-1))
    safe_max_WKM = jnp.where(jnp.isfinite(new_max_WKM), new_max_WKM, 0.0)
    probs_WKMJ = jnp.exp(scores_WKMJ - safe_max_WKM[..., None])
    rescale_WKM = jnp.exp(row_max_WKM - safe_max_WKM)
    denom_WKM = denom_WKM * rescale_WKM + jnp.sum(probs_WKMJ, axis=-1)
    acc_WKMD = acc_WKMD * rescale_WKM[..., None] + jnp.einsum(
        "wkmj,wkjd->wkmd", probs_WKMJ, v_WKJD, precision=lax.Precision.HIGHEST)
    return new_max_WKM, denom_WKM, acc_WKMD

  rows = q_tile * group
  init = (jnp.full((num_items, num_kv_heads, rows), _NEG_INF, jnp.float32),
          jnp.zeros((num_items, num_kv_heads, rows), jnp.float32),
          jnp.zeros((num_items, num_kv_heads, rows, head_dim), jnp.float32))
  _, denom_WKM, acc_WKMD = lax.fori_loop(0, num_chunks, chunk_step, init)
  out_WKMD = acc_WKMD / jnp.where(denom_WKM > 0, denom_WKM, 1.0)[..., None]
  out_WQHD = out_WKMD.reshape(num_items, num_kv_heads, q_tile, group, head_dim)
  out_WQHD = out_WQHD.transpose(0, 2, 1, 3, 4).reshape(num_items, q_tile, num_q_heads, head_dim)
  # Each live row belongs to exactly one item; dead rows go to an out-of-range index.
  dest_WQ = jnp.where(row_live_WQ, row_WQ, num_tokens)
  out_THD = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
  out_THD = out_THD.at[dest_WQ].set(out_WQHD, mode="drop")
  return out_THD.astype(q_THD.dtype)
