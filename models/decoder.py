"""The top-level decoder: the only module that reads ``ModelConfig``.

Two forwards share the same layers:
- ``paged_forward(tokens_T, positions_T, cache, metadata)``: a ragged batch of new tokens
  (prefill, chunked prefill and decode together) whose K/V are written into the paged
  ``KVCache`` and whose queries attend through ``paged_jax.paged_attention``.
- ``__call__(tokens_BT)``: a dense batch with no cache, causal, positions ``0..T-1``.

The L layers live stacked (every parameter has a leading L axis) and run under one
``jax.lax.scan`` whose xs are the layer parameters, the layer index and the layer's
attention kind; the cache rides in the carry and is indexed by that (traced) index, so no
layer's pool is sliced or copied and compile time does not grow with depth.

Attention kinds (A, ``ModelConfig.attention_kinds``): the distinct layer types of the
model ("full_attention", "sliding_attention"), each with its own sliding window and RoPE.
The window must reach ``paged_attention`` as a static argument, so the scan body holds one
``paged_attention`` call per distinct window under ``jax.lax.switch`` on the layer's kind
(no switch when every layer attends alike); the RoPE tables of every kind are computed
before the scan (``[A, T, D]``) and the body indexes its kind's. The program stays one
layer body (with at most a few attention branches) whatever the depth. The dense forward
masks with the kind's window read from an array instead (it needs nothing static).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from paged_jax import attention
from paged_jax._promotion import standard_promotion
from paged_jax.kv_cache import KVCache
from paged_jax.models import layers, moe
from paged_jax.models.config import ModelConfig
from paged_jax.spec import KVCacheSpec
from paged_jax.step import AttentionMetadata


def _mlp(config: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module | None:
  """One layer's MLP when it is not the default gated MLP (``DecoderLayer``'s ``mlp`` slot):
  a family whose MLP differs (a mixture of experts) builds its module here; None keeps
  ``layers.GatedMLP`` with ``config.hidden_act``."""
  c = config
  if c.num_experts:  # gpt-oss
    return moe.MoEMLP(embed_dim=c.embed_dim, mlp_dim=c.mlp_dim, num_experts=c.num_experts,
                      experts_per_token=c.experts_per_token, swiglu_alpha=c.swiglu_alpha,
                      swiglu_limit=c.swiglu_limit, dtype=dtype, rngs=rngs)
  return None


def _stacked_layers(config: ModelConfig, dtype, rngs: nnx.Rngs) -> layers.DecoderLayer:
  """L ``DecoderLayer``s as one module whose parameters have a leading L axis."""
  c = config

  @nnx.split_rngs(splits=c.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> layers.DecoderLayer:
    return layers.DecoderLayer(
        embed_dim=c.embed_dim, mlp_dim=c.mlp_dim, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        qkv_bias=c.qkv_bias, o_bias=c.o_bias, dtype=dtype, rngs=rngs, qk_norm=c.qk_norm,
        norm_unit_offset=c.gemma_norms, sandwich_norms=c.sandwich_norms,
        sinks=c.attention_sinks, activation=c.hidden_act, mlp=_mlp(c, dtype, rngs))

  return make(rngs)


class Decoder(nnx.Module):
  """Decoder-only transformer of every supported family (``config.model_type``).

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
    self.final_norm = layers.RMSNorm(config.embed_dim, eps=config.rms_norm_eps, dtype=dtype,
                                     unit_offset=config.gemma_norms)
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
    x = jnp.take(self.embed_VE[...], tokens, axis=0, mode="clip")
    if self.config.scale_embeddings:  # sqrt(E) rounded to the model dtype, as in transformers
      x = x * jnp.asarray(self.config.embed_dim ** 0.5, x.dtype)
    return x

  def _logits(self, x_TE) -> jax.Array:
    x_TE = self.final_norm(x_TE)
    if self.lm_head_EV is None:
      logits_TV = jnp.einsum("TE,VE->TV", x_TE, self.embed_VE[...])
    else:
      logits_TV = jnp.einsum("TE,EV->TV", x_TE, self.lm_head_EV[...])
    return layers.cap_logits(logits_TV, self.config.final_soft_cap)

  def _windows(self) -> tuple[int | None, ...]:
    """The sliding window of each attention kind (A)."""
    kinds, _ = self.config.attention_kinds()
    return tuple(self.config.window_of(kind) for kind in kinds)

  def _run_layers(self, x_TE, positions_T, attend, carry):
    """Scan the stacked layers; ``attend(q, k, v, sinks_H, layer, kind, carry) ->
    (out_THD, carry)`` with ``kind`` the layer's index into the attention kinds."""
    c = self.config
    kinds, kind_of_layer = c.attention_kinds()
    rope_A = [layers.rope_cos_sin(positions_T, c.rope_inv_frequencies(kind), x_TE.dtype,
                                  scale=c.rope_attention_factor(kind)) for kind in kinds]
    cos_ATD = jnp.stack([cos for cos, _ in rope_A])
    sin_ATD = jnp.stack([sin for _, sin in rope_A])
    graphdef, stacked = nnx.split(self.layers)

    def body(state, xs):
      x_TE, carry = state
      params, layer, kind = xs
      block = nnx.merge(graphdef, params)
      x_TE, carry = block(x_TE, cos_ATD[kind], sin_ATD[kind],
                          lambda q, k, v, sinks: attend(q, k, v, sinks, layer, kind, carry),
                          model_axis=self.model_axis)
      return (x_TE, carry), None

    layer_L = jnp.arange(c.num_layers, dtype=jnp.int32)
    kind_L = jnp.asarray(kind_of_layer, jnp.int32)
    (x_TE, carry), _ = jax.lax.scan(body, (x_TE, carry), (stacked, layer_L, kind_L),
                                    unroll=self.scan_unroll)
    return x_TE, carry

  # --- forwards ---

  @standard_promotion
  def paged_forward(self, tokens_T: jax.Array, positions_T: jax.Array, cache: KVCache,
                    metadata: AttentionMetadata, *, logits_indices: jax.Array | None = None,
                    impl: str | None = None) -> tuple[jax.Array, KVCache]:
    """Run a ragged batch of new tokens against the paged cache.

    Args:
      tokens_T: i32[T] token ids (padding rows: any id). Called eagerly, an id of a live
        row outside ``[0, vocab_size)`` is a ``ValueError``; under ``jit`` it cannot be
        checked and reads the nearest id's embedding.
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
    # With KV groups the cache holds each group's M layers (metadata.for_layer).
    cache_layers = c.num_layers if metadata.group_L is None else cache.num_layers
    if metadata.group_L is not None and metadata.group_L.shape != (c.num_layers,):
      raise ValueError(f"metadata.group_L.shape={tuple(metadata.group_L.shape)} must be "
                       f"[L]=[{c.num_layers}]")
    expected = (cache_layers, kv_heads, c.head_dim)
    got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if got != expected:
      raise ValueError(f"cache (L, K, D)={got} must match the model's {expected}")
    if metadata.slots_T.shape != tokens_T.shape:
      raise ValueError(f"metadata.slots_T.shape={tuple(metadata.slots_T.shape)} must be "
                       f"[T]=[{tokens_T.shape[0]}]")
    if not any(isinstance(x, jax.core.Tracer)
               for x in (tokens_T, metadata.cu_q_lens, metadata.num_seqs)):
      # An eager call: the live rows' ids are checked (padding rows may hold any id).
      cu = np.asarray(metadata.cu_q_lens)
      live = int(cu[int(np.clip(int(metadata.num_seqs), 0, cu.shape[0] - 1))])
      _check_token_ids(tokens_T[:max(live, 0)], c.vocab_size)
    impl = self.impl if impl is None else impl
    m = metadata
    # One paged_attention call per distinct window (static), chosen by the layer's kind.
    windows = self._windows()
    distinct = tuple(dict.fromkeys(windows))
    branch_A = jnp.asarray([distinct.index(w) for w in windows], jnp.int32)

    def attend(q_THD, k_TKD, v_TKD, sinks_H, layer, kind, cache):
      # The layer's own cache layer, slots and block tables (its KV group's; without
      # groups: layer, m.slots_T, m.block_tables_SP).
      cache_layer, slots_T, block_tables_SP = m.for_layer(layer)
      cache = cache.write(cache_layer, k_TKD, v_TKD, slots_T)

      def attention_with(window):
        return lambda q_THD, cache, sinks_H: attention.paged_attention(
            q_THD, cache, cache_layer, m.kv_lens_S, block_tables_SP, m.cu_q_lens, m.num_seqs,
            sm_scale=c.sm_scale, sliding_window=window, soft_cap=c.attn_soft_cap,
            sinks=sinks_H, impl=impl, interpret=self.interpret)

      if len(distinct) == 1:
        return attention_with(distinct[0])(q_THD, cache, sinks_H), cache
      out_THD = jax.lax.switch(branch_A[kind], [attention_with(w) for w in distinct],
                               q_THD, cache, sinks_H)
      return out_THD, cache

    x_TE = self._embed(tokens_T)
    x_TE, cache = self._run_layers(x_TE, positions_T, attend, cache)
    if logits_indices is not None:
      x_TE = jnp.take(x_TE, logits_indices, axis=0, mode="clip")
    return self._logits(x_TE), cache

  @standard_promotion
  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    """Causal logits ``[B, T, V]`` of a dense batch (positions ``0..T-1``, no cache).

    Token ids outside ``[0, V)`` are a ``ValueError`` when ``tokens_BT`` is concrete (an
    eager call); under ``jit`` they cannot be checked and read the nearest id's embedding.
    """
    if tokens_BT.ndim != 2:
      raise ValueError(f"tokens.shape={tuple(tokens_BT.shape)} must be [B, T]")
    if not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
      raise ValueError(f"tokens.dtype={tokens_BT.dtype} must be an integer dtype")
    b, t = tokens_BT.shape
    c = self.config
    _check_token_ids(tokens_BT, c.vocab_size)
    positions_T = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
    windows = self._windows()
    # The window as data: a full-attention kind's t covers the whole sequence.
    window_A = (None if all(w is None for w in windows)
                else jnp.asarray([t if w is None else w for w in windows], jnp.int32))

    def attend(q_THD, k_TKD, v_TKD, sinks_H, layer, kind, carry):
      del layer
      out_BTHD = layers.dense_causal_attention(
          q_THD.reshape(b, t, c.num_heads, c.head_dim),
          k_TKD.reshape(b, t, c.num_kv_heads, c.head_dim),
          v_TKD.reshape(b, t, c.num_kv_heads, c.head_dim), sm_scale=c.sm_scale,
          sliding_window=None if window_A is None else window_A[kind],
          soft_cap=c.attn_soft_cap, sinks_H=sinks_H)
      return out_BTHD.reshape(b * t, c.num_heads, c.head_dim), carry

    x_TE = self._embed(tokens_BT.reshape(-1))
    x_TE, _ = self._run_layers(x_TE, positions_T, attend, ())
    return self._logits(x_TE).reshape(b, t, -1)


# Input axes (after the L axis of stacked layers) of each weight, for its fan-in: (first,
# end); the experts' weights have their O axis first.
_FAN_IN_AXES = {"q_EHD": (0, 1), "k_EKD": (0, 1), "v_EKD": (0, 1), "o_HDE": (0, 2),
                "gate_EI": (0, 1), "up_EI": (0, 1), "down_IE": (0, 1), "lm_head_EV": (0, 1),
                "router_EO": (0, 1), "gate_OEI": (1, 2), "up_OEI": (1, 2),
                "down_OIE": (1, 2)}


def _check_token_ids(tokens, vocab_size: int) -> None:
  """Concrete token ids outside ``[0, vocab_size)`` are a ``ValueError`` (an embedding
  lookup would clamp them to the nearest id); traced ones cannot be checked."""
  if isinstance(tokens, jax.core.Tracer) or not tokens.size:
    return
  ids = np.asarray(tokens)
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f"tokens hold id {int(bad[0])}, outside the vocabulary "
                     f"[0, vocab_size={vocab_size})")


def init_random(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32, impl: str = "auto",
                interpret: bool = False) -> Decoder:
  """A randomly initialised ``Decoder`` drawn on the host with numpy (no compilation).

  ``Decoder(config, rngs=...)`` draws with ``jax.random``, whose per-shape compilation
  costs seconds on CPU; this builds the model abstractly and fills it from
  ``np.random.default_rng(seed)``: weights N(0, 1 / fan_in), embedding N(0, 1), norm
  scales 1 + N(0, 0.1^2) (Gemma norms, which add the 1 themselves: N(0, 0.1^2)), biases
  N(0, 0.1^2), attention sinks N(0, 1). For tests, benchmarks and demos.
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
    if name.startswith("scale_"):
      value = (0.0 if config.gemma_norms else 1.0) + 0.1 * draw
    elif name == "sinks_H":
      value = draw
    elif "bias" in name:
      value = 0.1 * draw
    elif name == "embed_VE":
      value = draw
    else:
      lead = 1 if path[0] == "layers" else 0
      first, end = _FAN_IN_AXES[name]
      fan_in = int(np.prod(shape[lead + first:lead + end]))
      value = draw * fan_in ** -0.5
    filled.append((path, variable.replace(value=jnp.asarray(value.astype(host_dtype)))))
  return nnx.merge(graphdef, nnx.from_flat_state(filled))
