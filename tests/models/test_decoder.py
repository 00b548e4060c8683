"""The decoder's paged forward (the contract's ``[T, V]`` form) and its scan over layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import models
from paged_jax import KVCache
from tests.models import helpers


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# Every option of the layers at once (no family has them all): alternating sliding (W=3)
# and full layers with two RoPE bases, both soft caps, learned sinks, q/k norms, Gemma
# norms, sandwich norms, GeGLU, scaled embeddings, q/k/v/o biases, a query scale.
ALL_VARIANTS = dataclasses.replace(
    helpers.tiny_config("gemma2", num_hidden_layers=3, sliding_window=3, head_dim=16,
                        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                        query_pre_attn_scalar=24, attention_bias=True),
    qk_norm=True, attention_sinks=True, local_rope_theta=100.0)


@pytest.mark.parametrize("config", [helpers.tiny_config("qwen2"), ALL_VARIANTS],
                         ids=["qwen2", "all_variants"])
def test_paged_forward_ragged_with_padding_equals_dense(config):
  """Two sequences (6 and 3 tokens) + 3 padding rows, one padding metadata row (S=3,
  num_seqs=2), shuffled blocks, NaN in every page nobody wrote."""
  model = models.init_random(config, seed=1, impl="xla")
  block_size, num_blocks = 4, 8
  spec = model.kv_cache_spec(block_size=block_size, num_blocks=num_blocks)
  nan = jnp.full(KVCache.create(spec).k_pages.shape, jnp.nan, jnp.float32)
  cache = KVCache(k_pages=nan, v_pages=nan)
  seqs = ([9, 8, 7, 6, 5, 4], [100, 50, 25])
  tables = np.array([[5, 2, -1], [7, -1, -1], [-1, -1, -1]], np.int32)
  # Token j of sequence i goes to slot tables[i, j // 4] * 4 + j % 4.
  slots = [int(tables[i, j // block_size]) * block_size + j % block_size
           for i, s in enumerate(seqs) for j in range(len(s))]
  tokens_T = jnp.asarray(seqs[0] + seqs[1] + [0, 0, 0], jnp.int32)
  positions_T = jnp.asarray(list(range(6)) + list(range(3)) + [0, 0, 0], jnp.int32)
  metadata = models.AttentionMetadata(
      slots_T=jnp.asarray(slots + [-1, -1, -1], jnp.int32),
      kv_lens_S=jnp.asarray([6, 3, 0], jnp.int32), block_tables_SP=jnp.asarray(tables),
      cu_q_lens=jnp.asarray([0, 6, 9, 9], jnp.int32), num_seqs=jnp.int32(2))
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, *a: nnx.merge(graphdef, params).paged_forward(*a))
  logits_TV, cache = forward(params, tokens_T, positions_T, cache, metadata)
  assert logits_TV.shape == (12, helpers.VOCAB)
  dense_BTV = model(jnp.asarray([seqs[0], seqs[1] + [0, 0, 0]], jnp.int32))
  assert _rel(logits_TV[:6], dense_BTV[0]) < 1e-5
  assert _rel(logits_TV[6:9], dense_BTV[1, :3]) < 1e-5
  assert np.isfinite(np.asarray(logits_TV)).all()
  # Written slots hold finite K/V; every other slot is still NaN.
  k_flat = np.asarray(cache.k_pages).reshape(config.num_layers, 2, num_blocks * block_size, 16)
  written = np.zeros(num_blocks * block_size, bool)
  written[slots] = True
  assert np.isfinite(k_flat[:, :, written]).all()
  assert np.isnan(k_flat[:, :, ~written]).all()


@pytest.mark.parametrize("impl", ["reference"])
def test_impl_is_a_model_option(impl):
  model = models.init_random(helpers.tiny_config(), impl=impl)
  assert model.impl == impl
  with pytest.raises(ValueError, match="impl='triton'"):
    models.init_random(helpers.tiny_config(), impl="triton")


def test_dense_forward_refuses_ids_outside_the_vocabulary_when_eager():
  model = models.init_random(helpers.tiny_config(), seed=0, impl="xla")
  v = helpers.VOCAB
  for bad in (v, -1):
    with pytest.raises(ValueError, match=rf"tokens hold id {bad}, outside the vocabulary "
                                         rf"\[0, vocab_size={v}\)"):
      model(jnp.asarray([[1, bad, 2]], jnp.int32))
  with pytest.raises(ValueError, match=r"tokens\.dtype=float32 must be an integer dtype"):
    model(jnp.asarray([[1.0, 2.0]], jnp.float32))
  # Under jit the ids are not known; a good batch gives the eager logits.
  graphdef, params = nnx.split(model)
  dense = jax.jit(lambda params, t: nnx.merge(graphdef, params)(t))
  tokens = jnp.asarray([[1, v - 1, 0]], jnp.int32)
  np.testing.assert_allclose(dense(params, tokens), model(tokens), rtol=1e-5, atol=1e-6)


def _decode_jaxpr_size(num_layers: int, model_type: str = "llama") -> tuple[int, int]:
  """(equations, scans) in the jaxpr of a decode-shaped paged forward at ``num_layers``."""
  config = helpers.tiny_config(model_type, num_hidden_layers=num_layers, sliding_window=4)
  abstract = nnx.eval_shape(lambda: models.Decoder(config, impl="xla", rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  spec = abstract.kv_cache_spec(block_size=4, num_blocks=8)
  cache = jax.eval_shape(lambda: KVCache.create(spec))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  metadata = models.AttentionMetadata(i32(2), i32(2), i32(2, 4), i32(3), i32())

  def forward(params, tokens, positions, cache, metadata):
    return nnx.merge(graphdef, params).paged_forward(tokens, positions, cache, metadata)

  jaxpr = jax.make_jaxpr(forward)(params, i32(2), i32(2), cache, metadata).jaxpr
  scans = sum(e.primitive.name == "scan" for e in jaxpr.eqns)
  return len(jaxpr.eqns), scans


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_layers_are_scanned_not_unrolled(model_type):
  """Also with two attention kinds (Gemma 2's sliding and global layers: one switch)."""
  eqns_2, scans_2 = _decode_jaxpr_size(2, model_type)
  eqns_8, scans_8 = _decode_jaxpr_size(8, model_type)
  assert scans_2 == scans_8 == 1
  assert eqns_2 == eqns_8  # the program does not grow with depth


def test_decoder_layer_takes_any_mlp_module():
  """The MLP slot (a mixture of experts fills it): any module ``mlp(x_TE, *, model_axis)``."""
  from paged_jax.models import layers

  class Doubler(nnx.Module):
    def __call__(self, x_TE, *, model_axis=None):
      return 2 * x_TE

  seen = {}

  def attend(q_THD, k_TKD, v_TKD, sinks_H):  # attention contributes nothing here
    seen["sinks"] = sinks_H
    return jnp.zeros_like(q_THD), None

  @jax.jit  # one compile, the layer's random init included
  def run(x_TE):
    layer = layers.DecoderLayer(embed_dim=8, mlp_dim=16, num_heads=2, num_kv_heads=1,
                                head_dim=4, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False,
                                dtype=jnp.float32, rngs=nnx.Rngs(0), sinks=True,
                                mlp=Doubler())
    seen["mlp"] = layer.mlp
    cos_TD, sin_TD = layers.rope_cos_sin(jnp.arange(3), np.ones(2, np.float32), jnp.float32)
    return layer(x_TE, cos_TD, sin_TD, attend)[0], x_TE + 2 * layer.mlp_norm(x_TE)

  out_TE, want_TE = run(jax.random.normal(jax.random.key(0), (3, 8)))
  assert isinstance(seen["mlp"], Doubler)
  assert seen["sinks"].shape == (2,) and seen["sinks"].dtype == jnp.float32
  np.testing.assert_allclose(out_TE, want_TE, rtol=1e-6)


def test_testing_helper_checks_a_built_in_hybrid_decoder_in_kv_groups():
  # testing.assert_paged_matches_dense read only config.layer_windows, which the built-in
  # configs do not have: a Gemma 2 style decoder was checked in one pool of every layer
  # while LLM(kv_budget_bytes=...) serves it in KV groups. It now reads the windows as the
  # engine does, and the decoder passes in the groups layout (sliding W = 3, full).
  from paged_jax import testing
  model = models.init_random(ALL_VARIANTS, seed=2, impl="xla")
  sequences = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 50, 25]]
  report = testing.assert_paged_matches_dense(model, ALL_VARIANTS, sequences, seed=2)
  assert set(report["kv_groups"]) == {3, None}, report  # two sliding layers, one full
  plain = testing.assert_paged_matches_dense(model, ALL_VARIANTS, sequences, seed=2,
                                             free_outside_window=False)
  assert plain["kv_groups"] is None


def test_testing_helper_bounds_a_16_bit_model_by_its_logits_dtype():
  # The default bound came from the pool's dtype alone: a correct bf16 model checked with
  # a float32 pool failed at float32's 2e-5 (7.3e-3), and float16 got bfloat16's 2e-2.
  # It is now the looser of the pool's and the dense logits' (float16: 1e-2).
  from paged_jax import testing
  config = helpers.tiny_config("llama")
  sequences = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 50, 25]]
  for dtype, cache_dtype, rtol in ((jnp.bfloat16, jnp.float32, 2e-2),
                                   (jnp.float16, None, 1e-2), (jnp.float32, None, 2e-5)):
    model = models.init_random(config, seed=2, dtype=dtype, impl="xla")
    report = testing.assert_paged_matches_dense(model, config, sequences, seed=2,
                                                cache_dtype=cache_dtype)
    assert report["rtol"] == rtol and report["max_rel_error"] < rtol, (dtype, report)
