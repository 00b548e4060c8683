"""The engine over quantised KV pools (``LLM(kv_cache_dtype=jnp.int8)``): the same
scheduling (prefix caching, forks, preemption, scrub) with scales kept beside the pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import allocator
from paged_jax.engine import LLM, SamplingParams
from paged_jax.engine import state as state_lib
from paged_jax.models import ModelConfig, init_random

CONFIG = ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=128,
                     eos_token_ids=(2,))
# One token bucket: one compiled step loop per engine.
OPTS = dict(block_size=4, max_seqs=3, max_tokens_per_step=16, steps_per_call=8,
            token_buckets=(16,), compilation_cache=False)


@pytest.fixture(scope="module")
def model():
  return init_random(CONFIG, seed=0, impl="xla")


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 128, n)] for n in lengths]


def _tokens(outs):
  return [(o.prompt_index, o.sample_index, tuple(o.token_ids)) for o in outs]


@pytest.fixture(scope="module")
def roomy(model):
  """``roomy(kv_dtype)``: an engine with room for every sequence, built once per dtype."""
  engines = {}

  def get(kv_dtype):
    name = jnp.dtype(kv_dtype).name
    if name not in engines:
      engines[name] = LLM(model, CONFIG, num_blocks=64, kv_cache_dtype=kv_dtype, **OPTS)
    return engines[name]

  return get


@pytest.fixture(scope="module")
def roomy_int8(roomy):
  return roomy(jnp.int8)


def test_int8_pool_stats_and_greedy_agreement_with_float32(model, roomy_int8):
  llm = roomy_int8
  assert llm.spec.quantized and llm.spec.dtype == jnp.int8
  s = llm.stats
  assert s["kv_cache_dtype"] == "int8" and s["kv_pool_bytes"] == llm.spec.total_bytes
  # one byte per value plus 4 bytes of scale per token, KV head and K/V
  assert llm.spec.block_bytes == 2 * 2 * 4 * 2 * (16 * 1 + 4)
  prompts = _prompts((5, 17, 9, 30, 3, 12), seed=0)
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  quant = llm.generate(prompts, params)
  exact = LLM(model, CONFIG, num_blocks=64, kv_cache_dtype=jnp.float32, **OPTS).generate(
      prompts, params)
  first = [q.token_ids[0] == e.token_ids[0] for q, e in zip(quant, exact)]
  same = np.mean([a == b for q, e in zip(quant, exact)
                  for a, b in zip(q.token_ids, e.token_ids)])
  assert all(first) and same >= 0.75, (first, same)


@pytest.mark.parametrize("kv_dtype", [
    jnp.int8, pytest.param(jnp.float8_e4m3fn, marks=pytest.mark.slow)],
    ids=lambda d: jnp.dtype(d).name)
def test_one_byte_pool_preemption_forks_prefix_cache_and_scrub_unchanged(model, roomy, kv_dtype):
  # 12 blocks of 4 tokens: the sequences cannot all stay resident (preemption by
  # recompute), forks share blocks, and freed blocks are scrubbed (bits and scales). The
  # same for float8 pools (uint8 bits and scales): the tokens equal a roomy engine's of
  # the same dtype.
  tight = LLM(model, CONFIG, num_blocks=12, kv_cache_dtype=kv_dtype, scrub_on_release=True,
              **OPTS)
  shared = _prompts((8,), seed=3)[0]
  prompts = [shared + p for p in _prompts((6, 2, 4, 5), seed=4)] + _prompts((10,), seed=5)
  params = [SamplingParams(max_tokens=m, n=n, ignore_eos=True)
            for m, n in ((20, 1), (12, 2), (18, 1), (8, 2), (20, 1))]
  expect = _tokens(roomy(kv_dtype).generate(prompts, params))
  assert _tokens(tight.generate(prompts, params)) == expect
  s = tight.stats
  assert s["preemptions"] > 0 and s["num_free_blocks"] == s["num_blocks"]
  assert s["prefix_hit_rate"] > 0
  allocator.validate(tight.allocator_state)
  # Every block nobody may read (not a prefix-cache entry) holds zero bits and zero scales.
  alloc, cache = tight.allocator_state, tight._state.cache
  unowned = np.asarray(state_lib._unowned_N(alloc))
  assert unowned.any()
  for name in ("k_bits", "v_bits", "k_scales", "v_scales"):
    x = np.asarray(getattr(cache, name))
    assert not x[:, :, unowned].any(), name
  # Served again, the prefix cache hits and the tokens stay the same.
  assert _tokens(tight.generate(prompts, params)) == expect


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(kv_cache_dtype=jnp.int32), "kv_cache_dtype"),
    (dict(kv_cache_dtype=jnp.int8, dtype=jnp.float32), "give one"),
    (dict(compilation_cache=3), "compilation_cache"),
])
def test_bad_pool_options_are_refused(model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    LLM(model, CONFIG, num_blocks=8, block_size=4, **kwargs)
