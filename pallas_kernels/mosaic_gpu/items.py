"""Work items of the Mosaic GPU kernel, computed in jnp inside the jitted wrapper.

A work item is one (query tile, sequence) pair: Q consecutive query rows of one sequence
(a tile crossing a sequence boundary yields one item per sequence it touches, from
``metadata.tile_sequence_items``). The live rows of an item are consecutive slots
``[lo, hi)`` of its tile at consecutive positions, so the kernel needs four scalars per
item for its masks, not a vector: slot q sits at position ``qbase + q``.

For KV head k, the (slot q, head g) pairs of an item are packed row-major into rows
``m = q * G + g`` of an M-row operand (M = Q * G padded to 64).

This module depends on nothing but jnp and ``pallas_kernels.metadata``: it must import
where JAX's Triton backend no longer exists.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.pallas_kernels import metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Items:
  """Per-item metadata (int32 / bool arrays).

  Attributes:
    seq_W: the sequence (block-table row) of each item.
    begin_W: first KV position the item reads, a multiple of Z: 0, or with a sliding
      window the page holding its first live query's window start.
    horizon_W: end of the item's KV range, ``min(last query position + 1, kv_len)``;
      0 for an empty item, which reads nothing.
    qbase_W: position of slot 0 of the item's tile (slot q sits at ``qbase + q``).
    lo_W, hi_W: the live slots ``[lo, hi)`` of the tile (``lo == hi`` for an empty item).
    row_WQ: query row (token) of each slot; row_live_WQ: whether that slot is live.
  """

  seq_W: jax.Array
  begin_W: jax.Array
  horizon_W: jax.Array
  qbase_W: jax.Array
  lo_W: jax.Array
  hi_W: jax.Array
  row_WQ: jax.Array
  row_live_WQ: jax.Array


def build_items(kv_lens_S, cu_q_lens, num_seqs, *, num_tokens: int, q_tile: int,
                num_items: int, block_size: int, blocks_per_seq: int,
                sliding_window: int | None) -> Items:
  """The (tile, sequence) items in token order; items past the last one are empty."""
  seq_W, tile_W, item_live_W, q_start_S, q_end_S = metadata.tile_sequence_items(
      cu_q_lens, num_seqs, num_tokens=num_tokens, q_tile=q_tile, num_items=num_items)
  slot_Q = jnp.arange(q_tile, dtype=jnp.int32)
  row_WQ = tile_W[:, None] * q_tile + slot_Q[None, :]
  seq_WQ = jnp.broadcast_to(seq_W[:, None], row_WQ.shape)
  row_live_WQ = (item_live_W[:, None] & (row_WQ >= q_start_S[seq_WQ])
                 & (row_WQ < q_end_S[seq_WQ]))
  qpos_WQ = metadata.query_positions(row_WQ, seq_WQ, kv_lens_S, cu_q_lens)

  any_live_W = jnp.any(row_live_WQ, axis=1)
  lo_W = jnp.where(any_live_W, jnp.argmax(row_live_WQ, axis=1), 0).astype(jnp.int32)
  hi_W = jnp.where(any_live_W, q_tile - jnp.argmax(row_live_WQ[:, ::-1], axis=1),
                   0).astype(jnp.int32)
  first_qpos_W = jnp.take_along_axis(qpos_WQ, lo_W[:, None], axis=1)[:, 0]
  qbase_W = jnp.where(any_live_W, first_qpos_W - lo_W, 0).astype(jnp.int32)
  last_qpos_W = qbase_W + hi_W - 1
  # A horizon past the table (an invalid kv_len) is cut, so no read leaves the table.
  horizon_W = jnp.minimum(last_qpos_W + 1, kv_lens_S[seq_W])
  horizon_W = jnp.clip(horizon_W, 0, blocks_per_seq * block_size)
  horizon_W = jnp.where(any_live_W, horizon_W, 0).astype(jnp.int32)
  if sliding_window is None:
    begin_W = jnp.zeros_like(horizon_W)
  else:
    # The first live query at p sees nothing at or before p - W, and later queries of
    # the item see no further back: start at the page holding max(p - W + 1, 0).
    start_W = jnp.maximum(first_qpos_W - (sliding_window - 1), 0)
    begin_W = jnp.where(horizon_W > 0, start_W // block_size * block_size, 0)
  return Items(seq_W=seq_W.astype(jnp.int32), begin_W=begin_W.astype(jnp.int32),
               horizon_W=horizon_W, qbase_W=qbase_W, lo_W=lo_W, hi_W=hi_W,
               row_WQ=row_WQ.astype(jnp.int32), row_live_WQ=row_live_WQ)


def pages_read(items: Items, *, block_size: int):
  """i32[W]: pages (table entries) an item's programs load together, every KV head alike:
  ``[begin / Z, cdiv(horizon, Z))``."""
  pages_W = -(-items.horizon_W // block_size) - items.begin_W // block_size
  return jnp.where(items.horizon_W > items.begin_W, pages_W, 0).astype(jnp.int32)


def pack_queries(q_THD, items: Items, *, num_kv_heads: int, rows: int, dtype):
  """``q_WKMD`` [W, K, M, D]: each item's queries, row ``q * G + g`` of KV head k holding
  slot q's head ``k * G + g``; dead slots and padding rows are zero."""
  _, num_q_heads, head_dim = q_THD.shape
  num_items, q_tile = items.row_WQ.shape
  group = num_q_heads // num_kv_heads
  q_WQHD = q_THD.at[items.row_WQ].get(mode="fill", fill_value=0)
  q_WQHD = jnp.where(items.row_live_WQ[..., None, None], q_WQHD, 0).astype(dtype)
  q_WQKGD = q_WQHD.reshape(num_items, q_tile, num_kv_heads, group, head_dim)
  q_WKMD = q_WQKGD.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads,
                                                    q_tile * group, head_dim)
  return jnp.pad(q_WKMD, ((0, 0), (0, 0), (0, rows - q_tile * group), (0, 0)))


def combine_splits(out_XWKMD, lse_XWKM):
  """Merge split-K partials, each normalised over its own piece: weights
  ``exp(lse - max lse)``, divided by their sum. A row no piece saw (every lse -inf) comes
  out zero. A sink lives in exactly one piece's lse (split 0's), where it weighs as a
  piece with a zero output, so the merged denominator counts it once."""
  if out_XWKMD.shape[0] == 1:
    return out_XWKMD[0]
  lse_max_WKM = jnp.max(lse_XWKM, axis=0)
  lse_max_WKM = jnp.where(jnp.isfinite(lse_max_WKM), lse_max_WKM, 0.0)
  weight_XWKM = jnp.exp(lse_XWKM - lse_max_WKM[None])
  total_WKM = jnp.sum(weight_XWKM, axis=0)
  out_WKMD = jnp.einsum("xwkm,xwkmd->wkmd", weight_XWKM, out_XWKMD,
                        precision=jax.lax.Precision.HIGHEST)
  return out_WKMD / jnp.where(total_WKM > 0, total_WKM, 1.0)[..., None]


def unpack_outputs(out_WKMD, items: Items, *, num_tokens: int, num_q_heads: int):
  """[W, K, M, D] -> [T, H, D] float32: live slots scattered to their rows, others 0."""
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
