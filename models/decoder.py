"""The top-level Llama-family decoder: the only module that reads ``ModelConfig``.

Two forwards share the same layers:
- ``paged_forward(tokens_T, positions_T, cache, metadata)``: a ragged batch of new tokens
  (prefill, chunked prefill and decode together) whose K/V are written into the paged
  ``KVCache`` and whose queries attend through ``paged_jax.paged_attention``.
- ``__call__(tokens_BT)``: a dense batch with no cache, causal, positions ``0..T-1``.

The L layers live stacked (every parameter has a leading L axis) and run under one
``jax.lax.scan`` whose xs are the layer parameters and the layer index; the cache rides in
the carry and is indexed by that (traced) index, so no layer's pool is sliced or copied and
compile time does not grow with depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from paged_jax import attention
from paged_jax.kv_cache import KVCache
from paged_jax.models import layers
from paged_jax.models.config import ModelConfig
from paged_jax.spec import KVCacheSpec
from paged_jax.step import AttentionMetadata


def _stacked_layers(config: ModelConfig, dtype, rngs: nnx.Rngs) -> layers.DecoderLayer:
  """L ``DecoderLayer``s as one module whose parameters have a leading L axis."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> layers.DecoderLayer:
    return layers.DecoderLayer(
        embed_dim=config.embed_dim, mlp_dim=config.mlp_dim, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=config.qkv_bias, o_bias=config.o_bias,
        dtype=dtype, rngs=rngs)

  return make(rngs)


class Decoder(nnx.Module):
  """Llama / Mistral / Qwen2 decoder-only transformer.

  Args:
    config: the model config (the only place it is read).
    dtype: parameter and activation dtype (norms, RoPE angles and softmax run in float32).
    impl: default ``paged_attention`` implementation ("auto", "xla", "reference",
      "pallas_tpu", "pallas_gpu"); each paged call may override it.
    interpret: run a Pallas impl in interpret mode (CPU tests).
    scan_unroll: ``jax.lax.scan``'s ``unroll`` over layers: 1 (default) compiles one layer
      body whatever the depth; ``True`` unrolls every layer (a baseline for
      ``benchmarks/compile_time.py``).
    rngs: initialisation randomness (``load_pretrained`` builds the model abstractly and
      fills in checkpoint weights instead).

  Attribute ``model_axis`` (static, default None): the mesh axis name over which this
  model's heads and MLP columns are split when its paged forward runs inside a
  ``jax.shard_map`` (``with_model_axis``; ``paged_jax.sharding`` builds such a copy with
  each device's slice of the weights and of the KV cache).
  """

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, impl: str = "auto",
               interpret: bool = False, scan_unroll: int | bool = 1, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config={type(config).__name__} must be a models.ModelConfig")
    if impl not in attention.IMPLS:
      raise ValueError(f"impl={impl!r} must be one of {attention.IMPLS}")
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.impl = impl
    self.interpret = interpret
    self.scan_unroll = scan_unroll
    self.model_axis = None
    self.embed_VE = nnx.Param(
        jax.random.normal(rngs.params(), (config.vocab_size, config.embed_dim)).astype(dtype))
    self.layers = _stacked_layers(config, dtype, rngs)
    self.final_norm = layers.RMSNorm(config.embed_dim, eps=config.rms_norm_eps, dtype=dtype)
    self.lm_head_EV = None if config.tie_word_embeddings else nnx.Param(
        layers._normal(rngs, (config.embed_dim, config.vocab_size), config.embed_dim, dtype))

  # --- helpers ---

  def with_model_axis(self, model_axis: str | None) -> "Decoder":
    """A copy sharing these parameters whose layers reduce over ``model_axis``.

    Inside a ``jax.shard_map`` over a mesh with that axis, each device runs the copy with
    its slice of the heads (q/k/v/o, biases), of the MLP columns (gate/up/down) and of the
    KV cache's heads; the attention output projection and the MLP down projection are
    then ``psum``-ed over the axis (Megatron-style). Embedding, norms and LM head stay
    whole. Outside such a ``shard_map`` the copy's forwards fail (unbound axis name).
    """
    if model_axis is not None and not isinstance(model_axis, str):
      raise ValueError(f"{model_axis=} must be None or a mesh axis name (str)")
    graphdef, state = nnx.split(self)
    copy = nnx.merge(graphdef, state)
    copy.model_axis = model_axis
    return copy

  def kv_cache_spec(self, *, block_size: int, num_blocks: int, dtype=None) -> KVCacheSpec:
    """The ``KVCacheSpec`` this model's paged forward needs (dtype defaults to the model's)."""
    c = self.config
    return KVCacheSpec(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, block_size=block_size, num_blocks=num_blocks,
                       dtype=self.dtype if dtype is None else dtype)

  def _embed(self, tokens) -> jax.Array:
    return jnp.take(self.embed_VE[...], tokens, axis=0, mode="clip")

  def _logits(self, x_TE) -> jax.Array:
    x_TE = self.final_norm(x_TE)
    if self.lm_head_EV is None:
      return jnp.einsum("TE,VE->TV", x_TE, self.embed_VE[...])
    return jnp.einsum("TE,EV->TV", x_TE, self.lm_head_EV[...])

  def _run_layers(self, x_TE, positions_T, attend, carry):
    """Scan the stacked layers; ``attend(q, k, v, layer, carry) -> (out_THD, carry)``."""
    cos_TD, sin_TD = layers.rope_cos_sin(positions_T, self.config.rope_inv_frequencies(),
                                         x_TE.dtype)
    graphdef, stacked = nnx.split(self.layers)

    def body(state, xs):
      x_TE, carry = state
      params, layer = xs
      block = nnx.merge(graphdef, params)
      x_TE, carry = block(x_TE, cos_TD, sin_TD,
                          lambda q, k, v: attend(q, k, v, layer, carry),
                          model_axis=self.model_axis)
      return (x_TE, carry), None

    layer_L = jnp.arange(self.config.num_layers, dtype=jnp.int32)
    (x_TE, carry), _ = jax.lax.scan(body, (x_TE, carry), (stacked, layer_L),
                                    unroll=self.scan_unroll)
    return x_TE, carry

  # --- forwards ---

  def paged_forward(self, tokens_T: jax.Array, positions_T: jax.Array, cache: KVCache,
                    metadata: AttentionMetadata, *, logits_indices: jax.Array | None = None,
                    impl: str | None = None) -> tuple[jax.Array, KVCache]:
    """Run a ragged batch of new tokens against the paged cache.

    Args:
      tokens_T: i32[T] token ids (padding rows: any id).
      positions_T: i32[T] position of each token in its sequence.
      cache: the ``KVCache`` (``kv_cache_spec``); donate it under jit.
      metadata: ``AttentionMetadata`` of this batch.
      logits_indices: optional int array: compute logits only for these token rows (e.g.
        each sequence's last one), ``[len(logits_indices), V]``.
      impl: ``paged_attention`` implementation, default the model's.

    Returns:
      (logits ``[T, V]`` (or one row per ``logits_indices``), the new cache holding the
      batch's K/V).
    """
    c = self.config
    if tokens_T.ndim != 1 or positions_T.shape != tokens_T.shape:
      raise ValueError(f"tokens.shape={tuple(tokens_T.shape)} and positions.shape="
                       f"{tuple(positions_T.shape)} must both be [T]")
    if not isinstance(cache, KVCache):
      raise ValueError(f"cache={type(cache).__name__} must be a paged_jax.KVCache")
    # Under a model axis the cache holds this device's KV heads, as the k weights do.
    kv_heads = (c.num_kv_heads if self.model_axis is None
                else self.layers.attn.k_EKD[...].shape[-2])
    expected = (c.num_layers, kv_heads, c.head_dim)
    got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if got != expected:
      raise ValueError(f"cache (L, K, D)={got} must match the model's {expected}")
    if metadata.slots_T.shape != tokens_T.shape:
      raise ValueError(f"metadata.slots_T.shape={tuple(metadata.slots_T.shape)} must be "
                       f"[T]=[{tokens_T.shape[0]}]")
    impl = self.impl if impl is None else impl
    sm_scale = c.head_dim ** -0.5
    m = metadata

    def attend(q_THD, k_TKD, v_TKD, layer, cache):
      cache = cache.write(layer, k_TKD, v_TKD, m.slots_T)
      out_THD = attention.paged_attention(
          q_THD, cache, layer, m.kv_lens_S, m.block_tables_SP, m.cu_q_lens, m.num_seqs,
          sm_scale=sm_scale, impl=impl, interpret=self.interpret)
      return out_THD, cache

    x_TE = self._embed(tokens_T)
    x_TE, cache = self._run_layers(x_TE, positions_T, attend, cache)
    if logits_indices is not None:
      x_TE = jnp.take(x_TE, logits_indices, axis=0, mode="clip")
    return self._logits(x_TE), cache

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    """Causal logits ``[B, T, V]`` of a dense batch (positions ``0..T-1``, no cache)."""
    if tokens_BT.ndim != 2:
      raise ValueError(f"tokens.shape={tuple(tokens_BT.shape)} must be [B, T]")
    b, t = tokens_BT.shape
    c = self.config
    sm_scale = c.head_dim ** -0.5
    positions_T = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)

    def attend(q_THD, k_TKD, v_TKD, layer, carry):
      del layer
      out_BTHD = layers.dense_causal_attention(
          q_THD.reshape(b, t, c.num_heads, c.head_dim),
          k_TKD.reshape(b, t, c.num_kv_heads, c.head_dim),
          v_TKD.reshape(b, t, c.num_kv_heads, c.head_dim), sm_scale=sm_scale)
      return out_BTHD.reshape(b * t, c.num_heads, c.head_dim), carry

    x_TE = self._embed(tokens_BT.reshape(-1))
    x_TE, _ = self._run_layers(x_TE, positions_T, attend, ())
    return self._logits(x_TE).reshape(b, t, -1)


# Input axes (after the L axis of stacked layers) of each weight, for its fan-in.
_FAN_IN_AXES = {"q_EHD": 1, "k_EKD": 1, "v_EKD": 1, "o_HDE": 2, "gate_EI": 1, "up_EI": 1,
                "down_IE": 1, "lm_head_EV": 1}


def init_random(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32, impl: str = "auto",
                interpret: bool = False) -> Decoder:
  """A randomly initialised ``Decoder`` drawn on the host with numpy (no compilation).

  ``Decoder(config, rngs=...)`` draws with ``jax.random``, whose per-shape compilation
  costs seconds on CPU; this builds the model abstractly and fills it from
  ``np.random.default_rng(seed)``: weights N(0, 1 / fan_in), embedding N(0, 1), norm
  scales 1 + N(0, 0.1^2), biases N(0, 0.1^2). For tests, benchmarks and demos.
  """
  abstract = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, impl=impl,
                                            interpret=interpret, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)
  host_dtype = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)
  filled = []
  for path, variable in nnx.to_flat_state(state):
    shape, name = variable.get_value().shape, path[-1]
    draw = rng.standard_normal(shape, dtype=np.float32)
    if name == "scale_E":
      value = 1 + 0.1 * draw
    elif "bias" in name:
      value = 0.1 * draw
    elif name == "embed_VE":
      value = draw
    else:
      first = 1 if path[0] == "layers" else 0
      fan_in = int(np.prod(shape[first:first + _FAN_IN_AXES[name]]))
      value = draw * fan_in ** -0.5
    filled.append((path, variable.replace(value=jnp.asarray(value.astype(host_dtype)))))
  return nnx.merge(graphdef, nnx.from_flat_state(filled))
