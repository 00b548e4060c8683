"""gpt-oss's mixture-of-experts MLP: top-k routing and a grouped matmul over the experts.

Per token ``x`` (width E), with O experts of which each token chooses k:

1. Router: ``logits_O = x @ router_EO + router_bias_O``; keep the k largest logits and take
   a softmax over those k only (transformers' ``GptOssTopKRouter``: ``topk`` then
   ``softmax`` of the kept values), giving the weights ``w_1..w_k``.
2. Each chosen expert ``o`` runs a clamped SwiGLU:
   ``gate = min(x @ gate_OEI[o] + gate_bias_OI[o], limit)``,
   ``up = clip(x @ up_OEI[o] + up_bias_OI[o], -limit, limit)``,
   ``h = (up + 1) * gate * sigmoid(alpha * gate)`` (alpha 1.702, limit 7.0 in gpt-oss),
   ``y = h @ down_OIE[o] + down_bias_OE[o]``.
3. ``out = sum_j w_j * y_j``.

The experts run as a grouped matmul: the Y = T * k routed rows (one per (token, chosen
expert) pair) are sorted by expert, so each expert's rows are contiguous, and
``jax.lax.ragged_dot`` multiplies each contiguous group by its own expert's matrix. Every
expert's weights are read once per call and each row meets only its own expert: no dense
loop over experts, no expert computed for a token that did not choose it. Shapes are
static under ``jit`` (Y = T * k rows whatever the routing); an expert no token chose is a
group of size 0. On TPU and GPU ``ragged_dot`` lowers to XLA's grouped GEMM
(``chlo.ragged_dot``); JAX 0.10.2 on CPU has no such instruction and emulates it with a
masked dense product over every expert (O times the routed FLOPs), which is fine for the
CPU tests and tiny models but not how the accelerators run it.

Letters (GLOSSARY.md): O experts, Y routed rows (T * k; in token-major order, row
``t * k + j`` is token t's j-th choice, unless the name says ``sorted``).

Checkpoint layout (transformers' ``GptOssExperts``): ``experts.gate_up_proj`` is
``[O, E, 2I]`` (input-major, unlike ``nn.Linear``) with gate and up INTERLEAVED along the
last axis (column ``2i`` is gate unit i, column ``2i + 1`` up unit i), and
``gate_up_proj_bias`` ``[O, 2I]`` likewise; ``down_proj`` is ``[O, I, E]`` with
``down_proj_bias`` ``[O, E]``; ``router.weight`` is ``[O, E]`` (``nn.Linear``) with
``router.bias`` ``[O]``. ``from_hf_gate_up`` splits the interleaved form into our separate
``gate_OEI`` / ``up_OEI`` (kept apart so that a tensor-parallel split of I slices both the
same way, by name, like ``layers.GatedMLP``'s).

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
  """(weights ``[Y]``, expert ids i32``[Y]``), token-major (row ``t * k + j``): each token's
  k largest logits, and a softmax over those k alone (the other experts get no weight, not
  a renormalised one). Exact ties go to the lower expert id (``jax.lax.top_k``)."""
  t, k = logits_TO.shape[0], experts_per_token
  top_logits, top_experts = jax.lax.top_k(logits_TO, k)  # [T, k] each
  weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1).astype(logits_TO.dtype)
  return weights.reshape(t * k), top_experts.astype(jnp.int32).reshape(t * k)


class MoEMLP(nnx.Module):
  """gpt-oss's mixture-of-experts MLP (module docstring: routing, clamped SwiGLU, layout).

  Args:
    embed_dim: E.
    mlp_dim: I, each expert's intermediate width.
    num_experts: O.
    experts_per_token: k (top-k), ``1 <= k <= O``.
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
    """(weights ``[Y]``, expert ids i32``[Y]``) of each token's choices (``route``)."""
    logits_TO = jnp.einsum("TE,EO->TO", x_TE, self.router_EO[...]) + self.router_bias_O[...]
    return route(logits_TO, self.experts_per_token)

  def __call__(self, x_TE: jax.Array, *, model_axis: str | None = None) -> jax.Array:
    """``[T, E]`` -> ``[T, E]``.

    ``model_axis``: as ``layers``' gated MLP: inside a ``shard_map`` whose mesh axis of that
    name splits every expert's I columns (``gate_OEI``, ``up_OEI``, their biases, and the
    rows of ``down_OIE``; the router and ``down_bias_OE`` whole, as the names' letters tell
    ``paged_jax.sharding``), each device computes its partial down projection, the weighted
    partial sums are ``psum``-ed over the axis, and the experts' output biases are added
    once, after the sum. (Expert parallelism, experts split over devices with an all-to-all
    of the rows, is not done.)
    """
    t, k = x_TE.shape[0], self.experts_per_token
    num_experts = self.router_bias_O.shape[0]
    weights_Y, experts_Y = self.router(x_TE)

    # Group the rows by expert: a stable sort keeps each expert's rows in token order;
    # group_sizes_O counts each expert's rows (0 for one no token chose).
    order_Y = jnp.argsort(experts_Y, stable=True)
    sorted_experts_Y = experts_Y[order_Y]
    group_sizes_O = jnp.bincount(experts_Y, length=num_experts).astype(jnp.int32)
    sorted_x_YE = jnp.take(x_TE, order_Y // k, axis=0)

    gate_YI = (jax.lax.ragged_dot(sorted_x_YE, self.gate_OEI[...], group_sizes_O)
               + jnp.take(self.gate_bias_OI[...], sorted_experts_Y, axis=0))
    up_YI = (jax.lax.ragged_dot(sorted_x_YE, self.up_OEI[...], group_sizes_O)
             + jnp.take(self.up_bias_OI[...], sorted_experts_Y, axis=0))
    gate_YI = jnp.minimum(gate_YI, self.swiglu_limit)
    up_YI = jnp.clip(up_YI, -self.swiglu_limit, self.swiglu_limit)
    hidden_YI = (up_YI + 1) * (gate_YI * jax.nn.sigmoid(gate_YI * self.swiglu_alpha))
    sorted_down_YE = jax.lax.ragged_dot(hidden_YI, self.down_OIE[...], group_sizes_O)

    # Back to token-major order (a gather through the inverse permutation), then each
    # token's k rows, weighted, summed.
    inverse_Y = jnp.zeros_like(order_Y).at[order_Y].set(jnp.arange(t * k, dtype=order_Y.dtype))
    down_YE = jnp.take(sorted_down_YE, inverse_Y, axis=0)

    def per_token(rows_YE):
      weighted_YE = rows_YE * weights_Y[:, None].astype(rows_YE.dtype)
      return weighted_YE.reshape(t, k, -1).sum(axis=1)

    out_TE = per_token(down_YE)
    if model_axis is not None:
      out_TE = jax.lax.psum(out_TE, model_axis)
    return out_TE + per_token(jnp.take(self.down_bias_OE[...], experts_Y, axis=0))
