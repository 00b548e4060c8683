"""Work-item metadata of the GPU kernel, computed in jnp inside the jitted wrapper.

A work item is one (query tile, sequence) pair that shares a row: a tile of Q consecutive
query rows that spans a sequence boundary yields one item per sequence it touches. For KV
head k, the Q * G (row, head) pairs of an item are packed, row-major, into the first
Q * G of M dot rows; the rest are padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.pallas_kernels import metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
  """Per-item metadata (all int32 / bool arrays).

  Attributes:
    seq_W: the sequence (block-table row) of each item.
    horizon_W: KV positions the item needs, ``min(max query position + 1, kv_len)``; 0 for
      an empty item, which then reads nothing.
    row_WQ: the query row (token) of each tile slot.
    row_live_WQ: whether that slot is a live query row of the item's sequence.
    qpos_WQ: position of each slot's query in its sequence; -1 for dead slots.
  """

  seq_W: jax.Array
  horizon_W: jax.Array
  row_WQ: jax.Array
  row_live_WQ: jax.Array
  qpos_WQ: jax.Array


def build_work_items(kv_lens_S, cu_q_lens, num_seqs, *, num_tokens: int, q_tile: int,
                     num_items: int) -> WorkItems:
  """The (tile, sequence) items in token order; items past the last one are empty."""
  seq_W, tile_W, item_live_W, q_start_S, q_end_S = metadata.tile_sequence_items(
      cu_q_lens, num_seqs, num_tokens=num_tokens, q_tile=q_tile, num_items=num_items)

  row_WQ = tile_W[:, None] * q_tile + jnp.arange(q_tile, dtype=jnp.int32)[None, :]
  seq_WQ = jnp.broadcast_to(seq_W[:, None], row_WQ.shape)
  row_live_WQ = (item_live_W[:, None] & (row_WQ >= q_start_S[seq_WQ])
                 & (row_WQ < q_end_S[seq_WQ]))
  qpos_WQ = metadata.query_positions(row_WQ, seq_WQ, kv_lens_S, cu_q_lens)
  qpos_WQ = jnp.where(row_live_WQ, qpos_WQ, -1).astype(jnp.int32)
  horizon_W = jnp.minimum(jnp.max(qpos_WQ, axis=1) + 1, kv_lens_S[seq_W])
  horizon_W = jnp.maximum(horizon_W, 0).astype(jnp.int32)
  return WorkItems(seq_W=seq_W, horizon_W=horizon_W, row_WQ=row_WQ.astype(jnp.int32),
                   row_live_WQ=row_live_WQ, qpos_WQ=qpos_WQ)


def kv_begin(items: WorkItems, *, sliding_window: int | None, block_size: int):
  """i32[W]: the first KV position each item reads, a multiple of Z.

  0 without a window. With window W, the item's earliest live query at position p sees
  nothing at or before ``p - W``, and no later query of the item sees more: the item
  starts at the page holding position ``max(p - W + 1, 0)``, and every page lying wholly
  before that window is skipped. 0 for an empty item (it reads nothing anyway).
  """
  num_items = items.horizon_W.shape[0]
  if sliding_window is None:
    return jnp.zeros((num_items,), jnp.int32)
  big = jnp.iinfo(jnp.int32).max
  first_qpos_W = jnp.min(jnp.where(items.row_live_WQ, items.qpos_WQ, big), axis=1)
  start_W = jnp.maximum(first_qpos_W - (sliding_window - 1), 0)
  start_W = jnp.where(items.horizon_W > 0, start_W, 0)
  return (start_W // block_size * block_size).astype(jnp.int32)


def pages_read(begin_W, horizon_W, *, block_size: int):
  """i32[W]: pages an item's programs load together, ``[begin / Z, cdiv(horizon, Z))``.

  Every KV head reads the same pages. Counts table entries, not distinct blocks.
  """
  pages_W = -(-horizon_W // block_size) - begin_W // block_size
  return jnp.where(horizon_W > begin_W, pages_W, 0).astype(jnp.int32)


def pack_sinks(sinks_H, *, num_kv_heads: int, q_tile: int, rows: int):
  """f32[K, M]: the sink logit of each packed row (row ``q * G + g`` of KV head k holds
  head ``k * G + g``); padding rows get -inf (no sink)."""
  sinks_KG = sinks_H.astype(jnp.float32).reshape(num_kv_heads, -1)
  sinks_KM = jnp.tile(sinks_KG, (1, q_tile))
  pad = rows - sinks_KM.shape[1]
  return jnp.pad(sinks_KM, ((0, 0), (0, pad)), constant_values=-jnp.inf)


def pack_queries(q_THD, items: WorkItems, *, num_kv_heads: int, rows: int, dtype):
  """``q_WKMD`` [W, K, M, D] and ``qpos_WM`` [W, M]: each item's queries, heads packed.

  Row ``q * G + g`` of KV head k holds query row slot q, head ``k * G + g``.
  """
  num_tokens, num_q_heads, head_dim = q_THD.shape
  num_items, q_tile = items.row_WQ.shape
  group = num_q_heads // num_kv_heads
  q_WQHD = q_THD.at[items.row_WQ].get(mode="fill", fill_value=0)
  q_WQHD = jnp.where(items.row_live_WQ[..., None, None], q_WQHD, 0).astype(dtype)
  q_WKMD = q_WQHD.reshape(num_items, q_tile, num_kv_heads, group, head_dim)
  q_WKMD = q_WKMD.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, -1, head_dim)
  pad = rows - q_tile * group
  q_WKMD = jnp.pad(q_WKMD, ((0, 0), (0, 0), (0, pad), (0, 0)))
  qpos_WM = jnp.repeat(items.qpos_WQ, group, axis=1)
  qpos_WM = jnp.pad(qpos_WM, ((0, 0), (0, pad)), constant_values=-1)
  return q_WKMD, qpos_WM


def combine_splits(out_XWKMD, lse_XWKM):
  """Merge split-K partials: X pieces, each normalised, weighted by ``exp(lse - max)``.

  A row no piece saw (all ``lse = -inf``) comes out zero. A sink logit lives in exactly
  one piece's lse (the kernel's split 0), where it weighs as a piece with a zero output:
  the merge then divides by the sink's weight plus every piece's, as the softmax does.
  """
  if out_XWKMD.shape[0] == 1:
    return out_XWKMD[0]
  lse_max_WKM = jnp.max(lse_XWKM, axis=0)
  lse_max_WKM = jnp.where(jnp.isfinite(lse_max_WKM), lse_max_WKM, 0.0)
  weight_XWKM = jnp.exp(lse_XWKM - lse_max_WKM[None])
  denom_WKM = jnp.sum(weight_XWKM, axis=0)
  out_WKMD = jnp.einsum("xwkm,xwkmd->wkmd", weight_XWKM, out_XWKMD,
                        precision=jax.lax.Precision.HIGHEST)
  return out_WKMD / jnp.where(denom_WKM > 0, denom_WKM, 1.0)[..., None]


def unpack_outputs(out_WKMD, items: WorkItems, *, num_tokens: int, num_q_heads: int):
  """[W, K, M, D] -> [T, H, D] (float32): live slots scattered to their rows, others 0."""
  num_items, num_kv_heads, _, head_dim = out_WKMD.shape
  q_tile = items.row_WQ.shape[1]
  group = num_q_heads // num_kv_heads
  out_WKQGD = out_WKMD[:, :, : q_tile * group].reshape(
      num_items, num_kv_heads, q_tile, group, head_dim)
  out_WQHD = out_WKQGD.transpose(0, 2, 1, 3, 4).reshape(
      num_items, q_tile, num_q_heads, head_dim)
  # Each live row belongs to exactly one item; dead slots go to an out-of-range row.
  dest_WQ = jnp.where(items.row_live_WQ, items.row_WQ, num_tokens)
  out_THD = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
  return out_THD.at[dest_WQ].set(out_WQHD.astype(jnp.float32), mode="drop")
