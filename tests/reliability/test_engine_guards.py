"""Engine guards: exhaustion, no retracing, no host transfer, donation, determinism."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import engine as engine_mod
from paged_jax.engine import SamplingParams
from tests.reliability.conftest import (check_all_free, make_llm, prompts, tokens_of,
                                        wrap_call)


# --- exhaustion -----------------------------------------------------------------------------


def test_pool_far_too_small_keeps_serving_with_outputs_unchanged(model, config):
  # 8 blocks of 4 tokens (32 token slots) against 9 requests of up to ~40 tokens, 3 at once.
  rng = np.random.default_rng(3)
  ps = prompts(rng.integers(4, 20, 9), seed=4)
  params = [SamplingParams(max_tokens=int(m), n=int(n), ignore_eos=True)
            for m, n in zip(rng.integers(4, 14, 9), rng.integers(1, 3, 9))]
  tiny = make_llm(model, config, num_blocks=8)
  big = make_llm(model, config, num_blocks=64, max_model_len=tiny.max_model_len)
  got = tiny.generate(ps, params)
  assert tokens_of(got) == tokens_of(big.generate(ps, params))
  assert tiny.stats["preemptions"] >= 3
  check_all_free(tiny)


def test_request_that_can_never_fit_is_refused_and_others_proceed(model, config):
  # Behaviour now: requests are validated before any is served, so a request that can never
  # fit (prompt >= max_model_len <= the pool's tokens) refuses the whole call with a
  # ValueError naming it, touching nothing; the engine then serves the others unchanged.
  llm = make_llm(model, config, num_blocks=8)  # 32-token pool
  good = prompts((6, 11))
  params = SamplingParams(max_tokens=5, ignore_eos=True)
  with pytest.raises(ValueError, match=r"prompts\[1\] has 40 tokens.*KV pool 8 blocks x 4 tokens"):
    llm.generate([good[0], [5] * 40, good[1]], params)
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    llm.generate_stream([good[0], [5] * 40], params)  # refused before the first event
  check_all_free(llm)
  fresh = make_llm(model, config, num_blocks=8)
  assert tokens_of(llm.generate(good, params)) == tokens_of(fresh.generate(good, params))
  # A request that fits only alone (max_tokens past the pool) is served, capped at
  # max_model_len with "length", while others share the pool with it.
  outs = llm.generate([good[0], [7] * 20, good[1]],
                      [params, SamplingParams(max_tokens=100, ignore_eos=True), params])
  assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 32 - 20
  assert [o.token_ids for o in (outs[0], outs[2])] == [
      o.token_ids for o in fresh.generate(good, params)]
  check_all_free(llm)


def test_forks_that_each_need_the_whole_pool_do_not_hang(model, config):
  llm = make_llm(model, config, num_blocks=8, steps_per_call=4)
  out = llm.generate([prompts((14,))[0]], SamplingParams(max_tokens=50, n=3, ignore_eos=True))
  assert [o.finish_reason for o in out] == ["length"] * 3
  assert all(len(o.token_ids) == 32 - 14 for o in out)
  assert len({tuple(o.token_ids) for o in out}) == 1  # greedy: the three forks agree
  check_all_free(llm)


# --- no retracing, no host transfer ---------------------------------------------------------


def test_step_traces_once_over_hundreds_of_steps_without_host_transfers(model, config):
  llm = make_llm(model, config, num_blocks=16, steps_per_call=1, max_traces=1)
  calls = []

  def guarded_call(inner):
    def call(params, st, wanted, limit):
      with jax.transfer_guard("disallow"):  # no implicit host <-> device copy in the loop
        out = inner(params, st, wanted, limit)
      calls.append(1)
      return out
    return call

  llm._call = guarded_call(llm._call)
  rng = np.random.default_rng(0)
  for i in range(12):
    k = int(rng.integers(1, 6))
    ps = prompts(rng.integers(1, 30, k), seed=i)
    params = [SamplingParams(max_tokens=int(rng.integers(1, 20)), n=int(rng.integers(1, 3)),
                             temperature=float(rng.choice([0.0, 0.7])), seed=i)
              for _ in range(k)]
    llm.generate(ps, params)
  assert llm.stats["steps"] >= 200 and len(calls) >= 200  # one trace (max_traces=1)
  check_all_free(llm)


def _primitives(jaxpr, acc):
  for eqn in jaxpr.eqns:
    acc.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _primitives(sub, acc)
  return acc


def test_device_loop_jaxpr_has_no_callbacks(model, config):
  llm = make_llm(model, config)
  fn = lambda params, st, wanted: engine_mod._device_call(
      llm._graphdef, params, st, wanted, jnp.int32(8), steps_per_call=8, num_tokens=16)
  jaxpr = jax.make_jaxpr(fn)(llm._params, llm._state, jnp.int32(0))
  prims = _primitives(jaxpr.jaxpr, set())
  assert "while" in prims
  assert not [p for p in prims if "callback" in p or p in ("outfeed", "infeed")], prims


# --- donation -------------------------------------------------------------------------------


def test_kv_cache_is_donated_and_device_memory_does_not_grow(model, config):
  llm = make_llm(model, config, num_blocks=64, steps_per_call=2)
  pool_bytes = llm._state.cache.nbytes()
  seen = []

  def after(old, new):
    # The donated input pool is deleted: XLA reused its buffer instead of copying.
    assert old.cache.k_pages.is_deleted() and old.cache.v_pages.is_deleted()
    assert old.alloc.block_tables.is_deleted()
    seen.append(sum(x.nbytes for x in jax.live_arrays()))

  wrap_call(llm, after=after)
  ps = prompts((9, 21, 5, 14), seed=2)
  params = SamplingParams(max_tokens=12, ignore_eos=True)
  llm.generate(ps, params)  # compile and warm up
  seen.clear()
  for _ in range(2):
    llm.generate(ps, params)
  assert len(seen) > 10
  # Live memory (taken while the old state and the new one are both referenced, the old
  # one deleted) stays flat: no per-step copy of the pool.
  assert max(seen) - min(seen) < pool_bytes // 4, (min(seen), max(seen), pool_bytes)


# --- determinism ----------------------------------------------------------------------------


def test_seeds_give_same_tokens_regardless_of_batch_and_preemption(model, config):
  # Extends test_engine.py::test_seeds_reproducible_across_batch_composition with
  # preemptions (a tiny pool) and forks: each sampled request alone in a big pool equals
  # itself inside a crowded tiny-pool batch.
  targets = prompts((9, 15), seed=31)
  hot = [SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=77, ignore_eos=True),
         SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=5, n=2,
                        ignore_eos=True)]
  big = make_llm(model, config, num_blocks=64, max_model_len=32)
  alone = [big.generate([p], sp) for p, sp in zip(targets, hot)]
  tiny = make_llm(model, config, num_blocks=8)
  crowd = prompts((12, 17, 6), seed=32)
  crowd_params = [SamplingParams(max_tokens=9, temperature=1.0, seed=i) for i in range(3)]
  mixed = tiny.generate(crowd[:1] + targets[:1] + crowd[1:] + targets[1:],
                        crowd_params[:1] + hot[:1] + crowd_params[1:] + hot[1:])
  assert tiny.stats["preemptions"] > 0
  by_prompt = {}
  for o in mixed:
    by_prompt.setdefault(o.prompt_index, []).append(o.token_ids)
  assert by_prompt[1] == [o.token_ids for o in alone[0]]
  assert by_prompt[4] == [o.token_ids for o in alone[1]]
  check_all_free(tiny)
