"""Building blocks of a Llama-family decoder layer: RMSNorm, RoPE, GQA attention, SwiGLU.

None of these read the model config; the top-level ``Decoder`` passes plain numbers. A
``DecoderLayer`` holds ONE layer's parameters; the decoder builds L of them stacked along
a leading axis (``nnx.vmap``) and scans over that axis, so the layer is traced and compiled
once whatever the depth. How attention reads and writes K/V (paged cache or dense) is the
caller's ``attend`` function, so the same layer serves the paged and the dense forward.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
  """N(0, 1 / fan_in): keeps activations O(1) in a randomly initialised model."""
  return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(dtype)


class RMSNorm(nnx.Module):
  """``scale * x / sqrt(mean(x^2) + eps)``, normalised in float32 (as transformers does)."""

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
    self.eps = eps
    self.scale_E = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x_TE: jax.Array) -> jax.Array:
    x32_TE = x_TE.astype(jnp.float32)
    variance_T1 = jnp.mean(x32_TE * x32_TE, axis=-1, keepdims=True)
    normed_TE = (x32_TE * jax.lax.rsqrt(variance_T1 + self.eps)).astype(x_TE.dtype)
    return self.scale_E[...] * normed_TE


def rope_cos_sin(positions_T: jax.Array, inv_freq: Any, dtype) -> tuple[jax.Array, jax.Array]:
  """cos, sin ``[T, D]`` of each position: angle ``pos * inv_freq`` repeated for both halves."""
  freqs_T2 = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None]
  angles_TD = jnp.concatenate([freqs_T2, freqs_T2], axis=-1)
  return jnp.cos(angles_TD).astype(dtype), jnp.sin(angles_TD).astype(dtype)


def apply_rope(x_THD: jax.Array, cos_TD: jax.Array, sin_TD: jax.Array) -> jax.Array:
  """Rotary embedding, transformers' ``rotate_half`` convention (halves, not interleaved)."""
  half = x_THD.shape[-1] // 2
  rotated_THD = jnp.concatenate([-x_THD[..., half:], x_THD[..., :half]], axis=-1)
  return x_THD * cos_TD[:, None, :] + rotated_THD * sin_TD[:, None, :]


class Attention(nnx.Module):
  """GQA projections around an ``attend`` function; RoPE on q and k."""

  def __init__(self, *, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
               qkv_bias: bool, o_bias: bool, dtype, rngs: nnx.Rngs):
    e, h, k, d = embed_dim, num_heads, num_kv_heads, head_dim
    self.q_EHD = nnx.Param(_normal(rngs, (e, h, d), e, dtype))
    self.k_EKD = nnx.Param(_normal(rngs, (e, k, d), e, dtype))
    self.v_EKD = nnx.Param(_normal(rngs, (e, k, d), e, dtype))
    self.o_HDE = nnx.Param(_normal(rngs, (h, d, e), h * d, dtype))
    bias = lambda shape: nnx.Param(_normal(rngs, shape, 1, dtype) * 0.1)
    self.q_bias_HD = bias((h, d)) if qkv_bias else None
    self.k_bias_KD = bias((k, d)) if qkv_bias else None
    self.v_bias_KD = bias((k, d)) if qkv_bias else None
    self.o_bias_E = bias((e,)) if o_bias else None

  def __call__(self, x_TE, cos_TD, sin_TD, attend: Callable, *,
               model_axis: str | None = None):
    """``model_axis``: inside a ``shard_map`` whose mesh axis of that name splits the heads
    (this module then holds its device's heads), the output projection's partial sums are
    ``psum``-ed over it, and the output bias is added once, after the sum."""
    q_THD = jnp.einsum("TE,EHD->THD", x_TE, self.q_EHD[...])
    k_TKD = jnp.einsum("TE,EKD->TKD", x_TE, self.k_EKD[...])
    v_TKD = jnp.einsum("TE,EKD->TKD", x_TE, self.v_EKD[...])
    if self.q_bias_HD is not None:
      q_THD = q_THD + self.q_bias_HD[...]
      k_TKD = k_TKD + self.k_bias_KD[...]
      v_TKD = v_TKD + self.v_bias_KD[...]
    q_THD = apply_rope(q_THD, cos_TD, sin_TD)
    k_TKD = apply_rope(k_TKD, cos_TD, sin_TD)
    out_THD, aux = attend(q_THD, k_TKD, v_TKD)
    out_TE = jnp.einsum("THD,HDE->TE", out_THD.astype(x_TE.dtype), self.o_HDE[...])
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    if self.o_bias_E is not None:
      out_TE = out_TE + self.o_bias_E[...]
    return out_TE, aux


class SwiGLU(nnx.Module):
  """``down(silu(gate(x)) * up(x))``."""

  def __init__(self, *, embed_dim: int, mlp_dim: int, dtype, rngs: nnx.Rngs):
    self.gate_EI = nnx.Param(_normal(rngs, (embed_dim, mlp_dim), embed_dim, dtype))
    self.up_EI = nnx.Param(_normal(rngs, (embed_dim, mlp_dim), embed_dim, dtype))
    self.down_IE = nnx.Param(_normal(rngs, (mlp_dim, embed_dim), mlp_dim, dtype))

  def __call__(self, x_TE, *, model_axis: str | None = None):
    """``model_axis``: as ``Attention``; this module holds its device's columns of I and
    the down projection's partial sums are ``psum``-ed over that axis."""
    gate_TI = jnp.einsum("TE,EI->TI", x_TE, self.gate_EI[...])
    up_TI = jnp.einsum("TE,EI->TI", x_TE, self.up_EI[...])
    out_TE = jnp.einsum("TI,IE->TE", jax.nn.silu(gate_TI) * up_TI, self.down_IE[...])
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    return out_TE


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, *, embed_dim: int, mlp_dim: int, num_heads: int, num_kv_heads: int,
               head_dim: int, rms_norm_eps: float, qkv_bias: bool, o_bias: bool, dtype,
               rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(embed_dim, eps=rms_norm_eps, dtype=dtype)
    self.attn = Attention(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype,
                          rngs=rngs)
    self.mlp_norm = RMSNorm(embed_dim, eps=rms_norm_eps, dtype=dtype)
    self.mlp = SwiGLU(embed_dim=embed_dim, mlp_dim=mlp_dim, dtype=dtype, rngs=rngs)

  def __call__(self, x_TE, cos_TD, sin_TD, attend: Callable, *,
               model_axis: str | None = None):
    """Returns ``(x_TE, aux)``: ``attend(q_THD, k_TKD, v_TKD) -> (out_THD, aux)``.

    ``model_axis``: None, or the ``shard_map`` mesh axis splitting heads and MLP columns
    (Megatron-style tensor parallelism: one ``psum`` after attention, one after the MLP).
    """
    attn_TE, aux = self.attn(self.attn_norm(x_TE), cos_TD, sin_TD, attend,
                             model_axis=model_axis)
    x_TE = x_TE + attn_TE
    return x_TE + self.mlp(self.mlp_norm(x_TE), model_axis=model_axis), aux


def dense_causal_attention(q_BTHD, k_BTKD, v_BTKD, *, sm_scale: float) -> jax.Array:
  """Plain causal GQA attention over a dense batch (softmax in float32); ``[B, T, H, D]``.

  J indexes key positions (the whole sequence is one KV chunk).
  """
  b, t, h, d = q_BTHD.shape
  k = k_BTKD.shape[2]
  q_BTKGD = q_BTHD.astype(jnp.float32).reshape(b, t, k, h // k, d)
  scores_BKGTJ = jnp.einsum("BTKGD,BJKD->BKGTJ", q_BTKGD, k_BTKD.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * sm_scale
  causal_TJ = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  scores_BKGTJ = jnp.where(causal_TJ, scores_BKGTJ, -jnp.inf)
  probs_BKGTJ = jax.nn.softmax(scores_BKGTJ, axis=-1)
  out_BTKGD = jnp.einsum("BKGTJ,BJKD->BTKGD", probs_BKGTJ, v_BTKD.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return out_BTKGD.reshape(b, t, h, d).astype(q_BTHD.dtype)
