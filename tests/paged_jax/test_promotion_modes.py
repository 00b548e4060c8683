"""The library under a caller's strict JAX promotion modes.

``jax_numpy_rank_promotion="raise"`` (common in large code bases) failed every allocator
operation, the built-in decoders' dense forward (RMSNorm's ``scale * x``), the step API and
``LLM.generate``; ``jax_numpy_dtype_promotion="strict"`` failed every ``generate``
(``allocator.utilization`` divided an int32 by a float32). The entry points now trace
under the default rules (``paged_jax._promotion``); results equal the default mode's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, LLM, SamplingParams, allocator, protocol, step
from paged_jax.models import ModelConfig, init_random

MODES = {"rank raise": lambda: jax.numpy_rank_promotion("raise"),
         "dtype strict": lambda: jax.numpy_dtype_promotion("strict")}


def _allocator_ops():
  st = allocator.init(16, 4, 3, 6, windows=(4, None))
  st, ok_append = jax.jit(allocator.append)(st, jnp.array([9, 3, 0], jnp.int32))
  st, ok_fork, src, dst = jax.jit(allocator.fork)(st, jnp.array([0], jnp.int32),
                                                 jnp.array([2], jnp.int32))
  slots = allocator.slots(st, jnp.array([0, 1, 2], jnp.int32), jnp.array([3, 2, 8], jnp.int32))
  util = allocator.utilization(st)
  st, preempted = allocator.preempt(st, jnp.array([3, 1, 2], jnp.int32), jnp.int32(16))
  st = allocator.release(st, ~preempted)
  return [np.asarray(x) for x in (ok_append, ok_fork, src, dst, slots, util, preempted,
                                  st.num_free, st.block_tables)]


def _prefix_ops():
  st = allocator.init(16, 4, 2, 4)
  tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % 7
  st, _ = allocator.append(st, jnp.array([9, 0], jnp.int32))
  st = allocator.register(st, tokens)
  st = allocator.release(st, jnp.array([True, False]))
  found = allocator.lookup(st, tokens, jnp.array([0, 9], jnp.int32))
  return [np.asarray(x) for x in jax.tree.leaves(found)] + [np.asarray(allocator.num_cached(st))]


@pytest.mark.parametrize("mode", MODES)
def test_allocator_operations_under_strict_modes(mode):
  want = _allocator_ops() + _prefix_ops()
  with MODES[mode]():
    got = _allocator_ops() + _prefix_ops()
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


GEMMA_LIKE = dict(model_type="gemma2", vocab_size=64, embed_dim=32, mlp_dim=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=64,
                  layer_types=("sliding_attention", "full_attention"), sliding_window=4,
                  attn_soft_cap=50.0, final_soft_cap=30.0, gemma_norms=True,
                  sandwich_norms=True, hidden_act="gelu_pytorch_tanh", scale_embeddings=True)


@pytest.fixture(scope="module")
def gemma_like():
  config = ModelConfig(**GEMMA_LIKE)
  return init_random(config, seed=0, impl="xla"), config


@pytest.mark.parametrize("mode", MODES)
def test_decoder_and_step_api_under_strict_modes(mode, gemma_like):
  model, config = gemma_like
  tokens_BT = jnp.arange(1, 8, dtype=jnp.int32)[None]
  spec = protocol.kv_cache_spec(config, block_size=4, num_blocks=8, dtype=jnp.float32)
  want = [np.asarray(model(tokens_BT))] + _two_steps(model, spec)
  with MODES[mode]():
    got = [np.asarray(model(tokens_BT))] + _two_steps(model, spec)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _two_steps(model, spec):
  """A prefill of 4 and 3 tokens, then one decode step of each sequence's greedy token."""
  alloc = allocator.init(spec.num_blocks, spec.block_size, 2, 4)
  cache = KVCache.create(spec)
  prompt_T = jnp.array([3, 4, 5, 6, 7, 8, 9], jnp.int32)
  logits, alloc, cache, ok = step.forward_step(model, alloc, cache, prompt_T,
                                               jnp.array([4, 3], jnp.int32))
  next_S = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits2, alloc, cache, ok2 = step.decode_step(model, alloc, cache, next_S,
                                                jnp.array([True, True]))
  return [np.asarray(x) for x in (logits, ok, logits2, ok2)]


@pytest.mark.parametrize("mode", MODES)
def test_engine_serves_the_same_tokens_under_strict_modes(mode, gemma_like):
  model, config = gemma_like
  llm = LLM(model, config, block_size=4, num_blocks=24, max_seqs=2, max_tokens_per_step=16,
            steps_per_call=4, compilation_cache=False)
  prompts = [[3, 14, 15, 9, 2, 6] * 2, [5, 3, 5]]
  params = [SamplingParams(max_tokens=5, logprobs=True),
            SamplingParams(max_tokens=4, n=2, temperature=0.8, top_k=5, top_p=0.9, seed=1)]
  want = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
  with MODES[mode]():
    got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
  assert [t for t, _ in got] == [t for t, _ in want]
  for (_, a), (_, b) in zip(got, want):
    if a is not None:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
