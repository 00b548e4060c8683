"""Building blocks of a decoder layer: RMSNorm, RoPE, GQA attention, gated MLPs.

None of these read the model config; the top-level ``Decoder`` passes plain numbers. A
``DecoderLayer`` holds ONE layer's parameters; the decoder builds L of them stacked along
a leading axis (``nnx.vmap``) and scans over that axis, so the layer is traced and compiled
once whatever the depth. How attention reads and writes K/V (paged cache or dense) is the
caller's ``attend`` function, so the same layer serves the paged and the dense forward.

What the families need, each as a plain option: q/k norms per head (Qwen3, Gemma 3),
Gemma's ``1 + weight`` norms and sandwich norms (Gemma 2 / 3), GeGLU (Gemma), learned
attention sinks and biases on q/k/v/o (gpt-oss). The MLP is a slot: ``DecoderLayer`` takes
any module ``mlp(x_TE, *, model_axis=None) -> out_TE`` (a mixture of experts, say) in place
of its default ``GatedMLP``.
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
  """RMS normalisation over the last axis, normalised in float32 (as transformers does).

  Llama style (default): ``scale * (x / rms(x)).astype(dtype)``. Gemma style
  (``unit_offset``): ``(x / rms(x) * (1 + scale)).astype(dtype)``, all in float32, the
  parameter holding the checkpoint's ``weight`` (so 0 is the identity).

  Args:
    dim: size of the normalised axis.
    eps: added to the mean square.
    axis: the glossary letter of that axis, naming the parameter ``scale_<axis>`` (E for the
      model width, D for a per-head q/k norm).
    unit_offset: Gemma style.
  """

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, axis: str = "E",
               unit_offset: bool = False):
    self.eps = eps
    self.unit_offset = unit_offset
    self.scale_name = f"scale_{axis}"
    setattr(self, self.scale_name,
            nnx.Param(jnp.zeros((dim,), dtype) if unit_offset else jnp.ones((dim,), dtype)))

  def __call__(self, x: jax.Array) -> jax.Array:
    scale = getattr(self, self.scale_name)[...]
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.unit_offset:
      return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * normed.astype(x.dtype)


def rope_cos_sin(positions_T: jax.Array, inv_freq: Any, dtype, *, scale: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
  """cos, sin ``[T, D]`` of each position: angle ``pos * inv_freq`` repeated for both halves,
  both times ``scale`` (YaRN's attention factor; 1 for other RoPE types)."""
  freqs_T2 = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None]
  angles_TD = jnp.concatenate([freqs_T2, freqs_T2], axis=-1)
  return (jnp.cos(angles_TD) * scale).astype(dtype), (jnp.sin(angles_TD) * scale).astype(dtype)


def apply_rope(x_THD: jax.Array, cos_TD: jax.Array, sin_TD: jax.Array) -> jax.Array:
  """Rotary embedding, transformers' ``rotate_half`` convention (halves, not interleaved)."""
  half = x_THD.shape[-1] // 2
  rotated_THD = jnp.concatenate([-x_THD[..., half:], x_THD[..., :half]], axis=-1)
  return x_THD * cos_TD[:, None, :] + rotated_THD * sin_TD[:, None, :]


class Attention(nnx.Module):
  """GQA projections around an ``attend`` function; optional q/k norms, then RoPE on q, k.

  Args:
    qkv_bias, o_bias: biases on the q/k/v projections, on the output projection.
    qk_norm: an RMSNorm (``scale_D``) over each head of q and of k, before RoPE.
    norm_unit_offset: those norms are Gemma style (``RMSNorm``'s ``unit_offset``).
    rms_norm_eps: their epsilon.
    sinks: learn one sink logit per query head (``sinks_H``), handed to ``attend``.
  """

  def __init__(self, *, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
               qkv_bias: bool, o_bias: bool, dtype, rngs: nnx.Rngs, qk_norm: bool = False,
               norm_unit_offset: bool = False, rms_norm_eps: float = 1e-6,
               sinks: bool = False):
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
    norm = lambda: RMSNorm(d, eps=rms_norm_eps, dtype=dtype, axis="D",
                           unit_offset=norm_unit_offset)
    self.q_norm = norm() if qk_norm else None
    self.k_norm = norm() if qk_norm else None
    self.sinks_H = nnx.Param(jnp.zeros((h,), dtype)) if sinks else None

  def __call__(self, x_TE, cos_TD, sin_TD, attend: Callable, *,
               model_axis: str | None = None):
    """``attend(q_THD, k_TKD, v_TKD, sinks_H) -> (out_THD, aux)``; ``sinks_H`` is None or
    f32[H].

    ``model_axis``: inside a ``shard_map`` whose mesh axis of that name splits the heads
    (this module then holds its device's heads), the output projection's partial sums are
    ``psum``-ed over it, and the output bias is added once, after the sum."""
    q_THD = jnp.einsum("TE,EHD->THD", x_TE, self.q_EHD[...])
    k_TKD = jnp.einsum("TE,EKD->TKD", x_TE, self.k_EKD[...])
    v_TKD = jnp.einsum("TE,EKD->TKD", x_TE, self.v_EKD[...])
    if self.q_bias_HD is not None:
      q_THD = q_THD + self.q_bias_HD[...]
      k_TKD = k_TKD + self.k_bias_KD[...]
      v_TKD = v_TKD + self.v_bias_KD[...]
    if self.q_norm is not None:
      q_THD, k_TKD = self.q_norm(q_THD), self.k_norm(k_TKD)
    q_THD = apply_rope(q_THD, cos_TD, sin_TD)
    k_TKD = apply_rope(k_TKD, cos_TD, sin_TD)
    sinks_H = None if self.sinks_H is None else self.sinks_H[...].astype(jnp.float32)
    out_THD, aux = attend(q_THD, k_TKD, v_TKD, sinks_H)
    out_TE = jnp.einsum("THD,HDE->TE", out_THD.astype(x_TE.dtype), self.o_HDE[...])
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    if self.o_bias_E is not None:
      out_TE = out_TE + self.o_bias_E[...]
    return out_TE, aux


ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""The gated MLP's activations by their Hugging Face names (SwiGLU's, GeGLU's)."""


class GatedMLP(nnx.Module):
  """``down(act(gate(x)) * up(x))``: SwiGLU (``activation="silu"``) or GeGLU
  (``"gelu_pytorch_tanh"``, GELU with the tanh approximation)."""

  def __init__(self, *, embed_dim: int, mlp_dim: int, dtype, rngs: nnx.Rngs,
               activation: str = "silu"):
    if activation not in ACTIVATIONS:
      raise ValueError(f"{activation=} must be one of {tuple(ACTIVATIONS)}")
    self.activation = activation
    self.gate_EI = nnx.Param(_normal(rngs, (embed_dim, mlp_dim), embed_dim, dtype))
    self.up_EI = nnx.Param(_normal(rngs, (embed_dim, mlp_dim), embed_dim, dtype))
    self.down_IE = nnx.Param(_normal(rngs, (mlp_dim, embed_dim), mlp_dim, dtype))

  def __call__(self, x_TE, *, model_axis: str | None = None):
    """``model_axis``: as ``Attention``; this module holds its device's columns of I and
    the down projection's partial sums are ``psum``-ed over that axis."""
    gate_TI = jnp.einsum("TE,EI->TI", x_TE, self.gate_EI[...])
    up_TI = jnp.einsum("TE,EI->TI", x_TE, self.up_EI[...])
    hidden_TI = ACTIVATIONS[self.activation](gate_TI) * up_TI
    out_TE = jnp.einsum("TI,IE->TE", hidden_TI, self.down_IE[...])
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    return out_TE


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

  With ``sandwich_norms`` (Gemma 2 / 3) each branch's output is normalised too before the
  residual add: ``x + post_attn_norm(attn(attn_norm(x)))``, and the same for the MLP.

  Args (besides the sizes):
    qk_norm, sinks, qkv_bias, o_bias: passed to ``Attention``.
    norm_unit_offset: every norm of the layer is Gemma style (``RMSNorm``).
    activation: the default MLP's activation (``GatedMLP``).
    mlp: None (a ``GatedMLP``) or a module to use as the MLP, called as
      ``mlp(x_TE, *, model_axis=None) -> out_TE`` (e.g. a mixture of experts).
  """

  def __init__(self, *, embed_dim: int, mlp_dim: int, num_heads: int, num_kv_heads: int,
               head_dim: int, rms_norm_eps: float, qkv_bias: bool, o_bias: bool, dtype,
               rngs: nnx.Rngs, qk_norm: bool = False, norm_unit_offset: bool = False,
               sandwich_norms: bool = False, sinks: bool = False, activation: str = "silu",
               mlp: nnx.Module | None = None):
    norm = lambda: RMSNorm(embed_dim, eps=rms_norm_eps, dtype=dtype,
                           unit_offset=norm_unit_offset)
    self.attn_norm = norm()
    self.attn = Attention(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype,
                          rngs=rngs, qk_norm=qk_norm, norm_unit_offset=norm_unit_offset,
                          rms_norm_eps=rms_norm_eps, sinks=sinks)
    self.post_attn_norm = norm() if sandwich_norms else None
    self.mlp_norm = norm()
    self.mlp = mlp if mlp is not None else GatedMLP(
        embed_dim=embed_dim, mlp_dim=mlp_dim, dtype=dtype, rngs=rngs, activation=activation)
    self.post_mlp_norm = norm() if sandwich_norms else None

  def __call__(self, x_TE, cos_TD, sin_TD, attend: Callable, *,
               model_axis: str | None = None):
    """Returns ``(x_TE, aux)``: ``attend(q_THD, k_TKD, v_TKD, sinks_H) -> (out_THD, aux)``.

    ``model_axis``: None, or the ``shard_map`` mesh axis splitting heads and MLP columns
    (Megatron-style tensor parallelism: one ``psum`` after attention, one after the MLP).
    """
    attn_TE, aux = self.attn(self.attn_norm(x_TE), cos_TD, sin_TD, attend,
                             model_axis=model_axis)
    if self.post_attn_norm is not None:
      attn_TE = self.post_attn_norm(attn_TE)
    x_TE = x_TE + attn_TE
    mlp_TE = self.mlp(self.mlp_norm(x_TE), model_axis=model_axis)
    if self.post_mlp_norm is not None:
      mlp_TE = self.post_mlp_norm(mlp_TE)
    return x_TE + mlp_TE, aux


def cap_logits(x: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(x / cap)`` (a soft cap), or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def dense_causal_attention(q_BTHD, k_BTKD, v_BTKD, *, sm_scale: float,
                           sliding_window: int | jax.Array | None = None,
                           soft_cap: float | None = None, sinks_H: jax.Array | None = None
                           ) -> jax.Array:
  """Plain causal GQA attention over a dense batch (softmax in float32); ``[B, T, H, D]``.

  The variants mean what ``paged_attention``'s do: query t sees keys j with
  ``t - sliding_window < j <= t`` (the window may be a traced int: the dense forward picks
  each layer's from an array); scores ``sm_scale * q.k`` are capped to
  ``soft_cap * tanh(s / soft_cap)`` before the mask; ``sinks_H`` adds ``exp(sinks_H[h])``
  to each head's softmax denominator. J indexes key positions (the whole sequence is one
  KV chunk).
  """
  b, t, h, d = q_BTHD.shape
  k = k_BTKD.shape[2]
  g = h // k
  q_BTKGD = q_BTHD.astype(jnp.float32).reshape(b, t, k, g, d)
  scores_BKGTJ = jnp.einsum("BTKGD,BJKD->BKGTJ", q_BTKGD, k_BTKD.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * sm_scale
  scores_BKGTJ = cap_logits(scores_BKGTJ, soft_cap)
  query_T1, key_1J = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  visible_TJ = query_T1 >= key_1J
  if sliding_window is not None:
    visible_TJ &= query_T1 - key_1J < sliding_window
  scores_BKGTJ = jnp.where(visible_TJ, scores_BKGTJ, -jnp.inf)
  if sinks_H is None:
    probs_BKGTJ = jax.nn.softmax(scores_BKGTJ, axis=-1)
  else:
    sink_KG11 = sinks_H.astype(jnp.float32).reshape(k, g, 1, 1)
    top_BKGT1 = jnp.maximum(jnp.max(scores_BKGTJ, axis=-1, keepdims=True), sink_KG11)
    exp_BKGTJ = jnp.exp(scores_BKGTJ - top_BKGT1)
    denominator_BKGT1 = (jnp.exp(sink_KG11 - top_BKGT1)
                         + jnp.sum(exp_BKGTJ, axis=-1, keepdims=True))
    probs_BKGTJ = exp_BKGTJ / denominator_BKGT1
  out_BTKGD = jnp.einsum("BKGTJ,BJKD->BTKGD", probs_BKGTJ, v_BTKD.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return out_BTKGD.reshape(b, t, h, d).astype(q_BTHD.dtype)
