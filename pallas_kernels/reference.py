"""Ragged paged attention in plain jnp: the oracle every kernel is tested against.

Simple and obviously right rather than fast: every query row gathers all the pages its
sequence owns and runs an ordinary masked softmax in float32, the attention variants
(sliding window, logit soft cap, sinks) applied as the contract writes them. A quantised
pool (int8 / float8 bits with one scale per token and KV head) is dequantised to float32
right after the gather (the gathered pages and their scale rows only), then the same
float32 softmax runs on the values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import metadata
from paged_jax.pallas_kernels import validation


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "kv_dtype"))
def ragged_paged_attention_reference(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                     block_tables_SP, cu_q_lens, num_seqs, *,
                                     sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None, sinks=None,
                                     kv_dtype=None, k_scales=None, v_scales=None):
  """Causal attention of a ragged batch of queries over a paged KV cache.

  Args:
    q_THD: [T, H, D] queries; sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (see ``pallas_kernels.layout``).
    layer: scalar int, which layer's pages to read.
    kv_lens_S: i32[S] tokens in each sequence's cache, the new ones included.
    block_tables_SP: i32[S, P] physical block of each logical block.
    cu_q_lens: i32[S + 1] cumulative query lengths.
    num_seqs: i32[] live sequences; rows past it are padding.
    sm_scale: softmax scale.
    sliding_window: W (static) or None: the query at position p sees keys at positions k
      with ``p - W < k <= p``.
    soft_cap: c (static) or None: scores ``s = c * tanh(s / c)`` before the mask and softmax.
    sinks: f32[H] or None: one extra logit per query head in the softmax denominator, with
      no value.
    kv_dtype: the logical K/V dtype when the pages hold its storage bits
      (``layout.storage_dtype``); None when they hold K/V as they are.
    k_scales, v_scales: f32[L, K, N, Z] for a quantised ``kv_dtype`` (int8, float8): one
      scale per token and KV head, value = stored * scale; None otherwise.

  Returns:
    [T, H, D] in q's dtype; padding rows are zero.
  """
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    k_scales=k_scales, v_scales=v_scales)
  validation.static_validate_variants(q_THD.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  num_tokens, num_q_heads, head_dim = q_THD.shape
  _, num_kv_heads, num_blocks, block_size, _ = k_pages_LKNZD.shape
  blocks_per_seq = block_tables_SP.shape[1]
  group = num_q_heads // num_kv_heads

  seq_T, live_T = metadata.token_sequence_ids(cu_q_lens, num_seqs, num_tokens)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  qpos_T = metadata.query_positions(t, seq_T, kv_lens_S, cu_q_lens)
  kv_len_T = kv_lens_S[seq_T]

  # Only the blocks a sequence owns are read; every other entry becomes the out-of-range id
  # N, which the "fill" gather turns into zeros without touching memory.
  owned_TP = (jnp.arange(blocks_per_seq)[None, :] * block_size < kv_len_T[:, None])
  owned_TP &= live_T[:, None]
  ids_TP = block_tables_SP[seq_T]
  # An id outside [0, N) must not wrap (jnp normalises negative indices before "fill").
  owned_TP &= (ids_TP >= 0) & (ids_TP < num_blocks)
  block_ids_TP = jnp.where(owned_TP, ids_TP, num_blocks)
  # A traced layer outside [0, L) reads nothing (zeros, as every impl), not a wrapped layer.
  num_layers = k_pages_LKNZD.shape[0]
  layer = jnp.asarray(layer, jnp.int32)
  layer = jnp.where((layer >= 0) & (layer < num_layers), layer, num_layers)
  k_TPKZD = k_pages_LKNZD.at[layer, :, block_ids_TP].get(mode="fill", fill_value=0)
  v_TPKZD = v_pages_LKNZD.at[layer, :, block_ids_TP].get(mode="fill", fill_value=0)
  # What was gathered (never the whole pool) back from storage bits to the logical dtype;
  # a quantised pool's gathered pages times their gathered scale rows, in float32.
  k_scales_TPKZ = v_scales_TPKZ = None
  if k_scales is not None:
    k_scales_TPKZ = k_scales.at[layer, :, block_ids_TP].get(mode="fill", fill_value=0)
    v_scales_TPKZ = v_scales.at[layer, :, block_ids_TP].get(mode="fill", fill_value=0)
  k_TPKZD = layout.dequantize(k_TPKZD, k_scales_TPKZ, kv_dtype)
  v_TPKZD = layout.dequantize(v_TPKZD, v_scales_TPKZ, kv_dtype)
  # Advanced indices split by a slice go first: [T, P, K, Z, D] -> [T, K, P * Z, D].
  k_TKJD = k_TPKZD.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_kv_heads, -1, head_dim)
  v_TKJD = v_TPKZD.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_kv_heads, -1, head_dim)

  kv_pos_J = jnp.arange(blocks_per_seq * block_size)
  visible_TJ = (kv_pos_J[None, :] <= qpos_T[:, None]) & (kv_pos_J[None, :] < kv_len_T[:, None])
  if sliding_window is not None:
    visible_TJ &= kv_pos_J[None, :] > qpos_T[:, None] - sliding_window
  visible_TJ &= live_T[:, None]

  q_TKGD = q_THD.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
  k_TKJD = jnp.where(visible_TJ[:, None, :, None], k_TKJD.astype(jnp.float32), 0.0)
  v_TKJD = jnp.where(visible_TJ[:, None, :, None], v_TKJD.astype(jnp.float32), 0.0)
  scores_TKGJ = jnp.einsum("tkgd,tkjd->tkgj", q_TKGD, k_TKJD,
                           precision=lax.Precision.HIGHEST) * sm_scale
  if soft_cap is not None:
    scores_TKGJ = soft_cap * jnp.tanh(scores_TKGJ / soft_cap)
  scores_TKGJ = jnp.where(visible_TJ[:, None, None, :], scores_TKGJ, -jnp.inf)
  row_max_TKG = jnp.max(scores_TKGJ, axis=-1, keepdims=True)
  if sinks is not None:  # query head h = kv_head * G + g has the extra logit sinks[h]
    sinks_TKG = jnp.broadcast_to(
        jnp.asarray(sinks, jnp.float32).reshape(1, num_kv_heads, group, 1),
        row_max_TKG.shape)
    row_max_TKG = jnp.maximum(row_max_TKG, sinks_TKG)
  row_max_TKG = jnp.where(jnp.isfinite(row_max_TKG), row_max_TKG, 0.0)
  probs_TKGJ = jnp.exp(scores_TKGJ - row_max_TKG)  # exp(-inf) = 0 for hidden keys
  denom_TKG = jnp.sum(probs_TKGJ, axis=-1, keepdims=True)
  if sinks is not None:  # the sink's term: in the denominator, with no value
    denom_TKG = denom_TKG + jnp.exp(sinks_TKG - row_max_TKG)
  out_TKGD = jnp.einsum("tkgj,tkjd->tkgd", probs_TKGJ, v_TKJD, precision=lax.Precision.HIGHEST)
  out_TKGD = out_TKGD / jnp.where(denom_TKG > 0, denom_TKG, 1.0)
  out_THD = out_TKGD.reshape(num_tokens, num_q_heads, head_dim)
  return jnp.where(live_T[:, None, None], out_THD, 0.0).astype(q_THD.dtype)
