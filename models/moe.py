"""gpt-oss's mixture-of-experts MLP: top-k routing and a grouped matmul over the experts.

Per token ``x`` (width E), with O experts and Y experts per token:

1. Router: ``logits_O = x @ router_EO + router_bias_O``; keep the Y largest logits and take a
   softmax over those Y only (transformers' ``GptOssTopKRouter``: ``topk`` then ``softmax``
   of the kept values), giving the weights ``w_Y``.
2. Each chosen expert ``o`` runs a clamped SwiGLU:
   ``gate = min(x @ gate_OEI[o] + gate_bias_OI[o], limit)``,
   ``up = clip(x @ up_OEI[o] + up_bias_OI[o], -limit, limit)``,
   ``h = (up + 1) * gate * sigmoid(alpha * gate)`` (alpha 1.702, limit 7.0 in gpt-oss),
   ``y = h @ down_OIE[o] + down_bias_OE[o]``.
3. ``out = sum_y w_y * y_y``.

The experts run as a grouped matmul: the T * Y (token, expert) assignments, flattened to A
rows, are sorted by expert, so each expert's rows are contiguous, and
``jax.lax.ragged_dot`` multiplies each contiguous group by its own expert's matrix. Every
expert's weights are read once per call and each row meets only its own expert: no dense
loop over experts, no expert computed for a token that did not choose it. Shapes are
static under ``jit`` (A = T * Y rows whatever the routing); an expert no token chose is a
group of size 0.

Letters: O experts, Y experts chosen per token (top-k), A assignments (T * Y rows, sorted
by expert); see GLOSSARY.md.

Checkpoint layout (transformers' ``GptOssExperts``): ``experts.gate_up_proj`` is
``[O, E, 2I]`` (input-major, unlike ``nn.Linear``) with gate and up INTERLEAVED along the
last axis (column ``2i`` is gate unit i, column ``2i + 1`` up unit i), and
``gate_up_proj_bias`` ``[O, 2I]`` likewise; ``down_proj`` is ``[O, I, E]`` with
``down_proj_bias`` ``[O, E]``; ``router.weight`` is ``[O, E]`` (``nn.Linear``) with
``router.bias`` ``[O]``. ``from_hf_gate_up`` splits the interleaved form into our separate
``gate_OEI`` / ``up_OEI`` (kept apart so that a tensor-parallel split of I slices both the
same way, by name, like ``layers.SwiGLU``'s).

MXFP4 checkpoints: OpenAI's released gpt-oss weights store the experts' matrices in MXFP4,
as ``experts.gate_up_proj_blocks`` (uint8 ``[O, 2I, E / 32, 16]``: output-major, each
byte two 4-bit E2M1 values, low nibble first, 32 values per block along the input axis)
and ``experts.gate_up_proj_scales`` (uint8 ``[O, 2I, E / 32]``: one power-of-two E8M0
exponent per block, biased by 127), and the same pair for ``down_proj``; biases, router,
attention and embeddings are bfloat16. Serving them needs either a dequantisation at load
(each nibble through the 16-entry E2M1 table {0, 0.5, 1, 1.5, 2, 3, 4, 6} with its sign
bit, times ``2 ** (scale - 127)``, the blocks flattened back to ``[O, 2I, E]``, transposed
to the input-major layout above, then de-interleaved by ``from_hf_gate_up``; gpt-oss-20b's
19.1e9 expert parameters take ~9.5 GiB in MXFP4, 4.25 bits each with the scales, and
~35.6 GiB in bfloat16), or an MXFP4 grouped-matmul kernel that dequantises tiles
as it loads them. Neither is done here: we load the bfloat16 (or float32) form, which is what
``GptOssForCausalLM.save_pretrained`` writes for a model built from a config (and the form
transformers holds after loading the released checkpoint with
``Mxfp4Config(dequantize=True)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.models import layers

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def from_hf_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(gate, up) of transformers' interleaved ``gate_up_proj`` ``[..., 2I]`` (or its bias):
  gate is every even column, up every odd one."""
  return gate_up[..., 0::2], gate_up[..., 1::2]


def route(logits_TO: jax.Array, experts_per_token: int) -> tuple[jax.Array, jax.Array]:
  """(weights ``[T, Y]``, expert ids i32``[T, Y]``): the Y largest logits of each token, and
  a softmax over those Y alone (the other experts get no weight, not a renormalised one).
  Exact ties go to the lower expert id (``jax.lax.top_k``)."""
  top_TY, experts_TY = jax.lax.top_k(logits_TO, experts_per_token)
  weights_TY = jax.nn.softmax(top_TY.astype(jnp.float32), axis=-1).astype(logits_TO.dtype)
  return weights_TY, experts_TY.astype(jnp.int32)


class MoEMLP(nnx.Module):
  """gpt-oss's mixture-of-experts MLP (module docstring: routing, clamped SwiGLU, layout).

  Args:
    embed_dim: E.
    mlp_dim: I, each expert's intermediate width.
    num_experts: O.
    experts_per_token: Y (top-k), ``1 <= Y <= O``.
    swiglu_alpha: the sigmoid gain of the gate (gpt-oss: 1.702).
    swiglu_limit: clamp of the gate (from above) and of up (both sides) (gpt-oss: 7.0).
    dtype: parameter dtype.
    rngs: initialisation randomness (weights N(0, 1 / fan_in), biases N(0, 0.1^2)).
  """

  def __init__(self, *, embed_dim: int, mlp_dim: int, num_experts: int,
               experts_per_token: int, swiglu_alpha: float = SWIGLU_ALPHA,
               swiglu_limit: float = SWIGLU_LIMIT, dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in (("embed_dim", embed_dim), ("mlp_dim", mlp_dim),
                        ("num_experts", num_experts), ("experts_per_token", experts_per_token)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if experts_per_token > num_experts:
      raise ValueError(f"{experts_per_token=} must be <= {num_experts=}")
    if not swiglu_limit > 0:
      raise ValueError(f"{swiglu_limit=} must be > 0")
    e, i, o = embed_dim, mlp_dim, num_experts
    self.experts_per_token = int(experts_per_token)
    self.swiglu_alpha = float(swiglu_alpha)
    self.swiglu_limit = float(swiglu_limit)
    bias = lambda shape: nnx.Param(layers._normal(rngs, shape, 1, dtype) * 0.1)
    self.router_EO = nnx.Param(layers._normal(rngs, (e, o), e, dtype))
    self.router_bias_O = bias((o,))
    self.gate_OEI = nnx.Param(layers._normal(rngs, (o, e, i), e, dtype))
    self.up_OEI = nnx.Param(layers._normal(rngs, (o, e, i), e, dtype))
    self.gate_bias_OI = bias((o, i))
    self.up_bias_OI = bias((o, i))
    self.down_OIE = nnx.Param(layers._normal(rngs, (o, i, e), i, dtype))
    self.down_bias_OE = bias((o, e))

  def router(self, x_TE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights ``[T, Y]``, expert ids i32``[T, Y]``) of each token (``route``)."""
    logits_TO = jnp.einsum("TE,EO->TO", x_TE, self.router_EO[...]) + self.router_bias_O[...]
    return route(logits_TO, self.experts_per_token)

  def __call__(self, x_TE: jax.Array, *, model_axis: str | None = None) -> jax.Array:
    """``[T, E]`` -> ``[T, E]``.

    ``model_axis``: as ``layers.SwiGLU``: inside a ``shard_map`` whose mesh axis of that
    name splits every expert's I columns (``gate_OEI``, ``up_OEI``, their biases, and the
    rows of ``down_OIE``; the router and ``down_bias_OE`` whole), each device computes its
    partial down projection, the weighted partial sums are ``psum``-ed over the axis, and
    the experts' output biases are added once, after the sum. (Expert parallelism, experts
    split over devices with an all-to-all of the rows, is not done.)
    """
    t, _ = x_TE.shape
    y = self.experts_per_token
    weights_TY, experts_TY = self.router(x_TE)

    # Group the A = T * Y assignments by expert: a stable sort keeps each expert's rows in
    # token order; group_sizes_O counts the rows of each expert (0 for an unchosen one).
    experts_A = experts_TY.reshape(t * y)
    order_A = jnp.argsort(experts_A, stable=True)
    sorted_experts_A = experts_A[order_A]
    num_experts = self.router_bias_O.shape[0]
    group_sizes_O = jnp.bincount(experts_A, length=num_experts).astype(jnp.int32)
    x_AE = jnp.take(x_TE, order_A // y, axis=0)

    gate_AI = (jax.lax.ragged_dot(x_AE, self.gate_OEI[...], group_sizes_O)
               + jnp.take(self.gate_bias_OI[...], sorted_experts_A, axis=0))
    up_AI = (jax.lax.ragged_dot(x_AE, self.up_OEI[...], group_sizes_O)
             + jnp.take(self.up_bias_OI[...], sorted_experts_A, axis=0))
    gate_AI = jnp.minimum(gate_AI, self.swiglu_limit)
    up_AI = jnp.clip(up_AI, -self.swiglu_limit, self.swiglu_limit)
    hidden_AI = (up_AI + 1) * (gate_AI * jax.nn.sigmoid(gate_AI * self.swiglu_alpha))
    down_AE = jax.lax.ragged_dot(hidden_AI, self.down_OIE[...], group_sizes_O)

    # Back to (token, choice) order, then the weighted sum over each token's Y experts.
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(t * y, dtype=order_A.dtype))
    down_TYE = jnp.take(down_AE, inverse_A, axis=0).reshape(t, y, -1)
    out_TE = jnp.einsum("TYE,TY->TE", down_TYE, weights_TY.astype(down_TYE.dtype))
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    bias_TYE = jnp.take(self.down_bias_OE[...], experts_TY, axis=0)
    return out_TE + jnp.einsum("TYE,TY->TE", bias_TYE, weights_TY.astype(bias_TYE.dtype))
