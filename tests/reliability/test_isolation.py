"""Isolation: a sequence never reads KV it does not own.

Between device calls every free block (freed or never used) and every slot past a
sequence's length in the blocks it holds is overwritten with NaN or a huge value; random
schedules of arrivals, finishes, forks (n > 1) and preemptions (a tiny pool) then run
through one long-lived engine, and every output must be finite and equal a fresh engine's.
With the prefix cache on, a free block that is a cache entry (registered, full, reachable
only by a confirmed hit of the same salt) keeps its K/V: the cache owns it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import allocator
from paged_jax.engine import SamplingParams
from paged_jax.models import init_random
from paged_jax.models.config import FULL, SLIDING
from tests.reliability.conftest import (check_all_free, make_llm, prompts, tokens_of,
                                        wrap_call)

POISONS = (float("nan"), 3.0e38, -3.0e38)
SCHEDULES = 6  # random schedules per pool size (README figure)
CALLS_PER_SCHEDULE = 3  # generate calls per schedule, all on one poisoned engine


@functools.partial(jax.jit, donate_argnums=(0,))
def _poison(st, value):
  """Fill every KV slot no live sequence has written and no prefix-cache entry holds with
  ``value``."""
  alloc = st.alloc
  n, z = alloc.num_blocks, alloc.block_size
  s, p = alloc.block_tables.shape[-2:]
  pos_SJ = jnp.broadcast_to(jnp.arange(p * z, dtype=jnp.int32)[None, :], (s, p * z))
  seq_SJ = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, p * z))
  live_SJ = pos_SJ < alloc.seq_lens[:, None]
  # With KV groups: every group's slots (a sliding group's behind its window are padding).
  slot_SJ = allocator.slots(alloc, seq_SJ, pos_SJ)
  slot_SJ = jnp.where(live_SJ & (slot_SJ >= 0), slot_SJ, n * z)
  written = jnp.zeros(n * z, jnp.bool_).at[slot_SJ.reshape(-1)].set(True, mode="drop")
  cached_NZ = jnp.broadcast_to((alloc.depth_N >= 0)[:, None], (n, z))
  keep_NZ = (written.reshape(n, z) | cached_NZ).reshape(1, 1, n, z, 1)
  value = value.astype(st.cache.dtype)
  cache = type(st.cache)(k_pages=jnp.where(keep_NZ, st.cache.k_pages, value),
                         v_pages=jnp.where(keep_NZ, st.cache.v_pages, -value))
  return st.__class__(**{**{f: getattr(st, f) for f in st.__dataclass_fields__},
                         "cache": cache})


class Poisoner:
  """Poisons the engine's cache before each device call; counts what it poisoned."""

  def __init__(self, llm):
    self.calls = 0
    self.free_blocks = 0
    wrap_call(llm, before=self)

  def __call__(self, st):
    self.free_blocks += int(st.alloc.num_free - allocator.num_cached(st.alloc))
    value = jnp.float32(POISONS[self.calls % len(POISONS)])
    self.calls += 1
    return _poison(st, value)


def _schedule(rng, max_seqs):
  """One generate call: random arrivals (more prompts than slots), lengths, max_tokens,
  forks, sampling with seeds, stop ids; about half the prompts start with one shared
  prefix (prefix-cache hits, in full blocks and not)."""
  k = int(rng.integers(2, 7))
  ps = prompts(rng.integers(1, 26, k), seed=int(rng.integers(1 << 30)))
  shared = prompts((int(rng.integers(4, 14)),), seed=int(rng.integers(1 << 30)))[0]
  ps = [shared + p if rng.random() < 0.5 else p for p in ps]
  params = []
  for _ in range(k):
    hot = rng.random() < 0.5
    params.append(SamplingParams(
        max_tokens=int(rng.integers(1, 14)), n=int(rng.integers(1, max_seqs + 1)),
        temperature=0.8 if hot else 0.0, top_p=0.9 if hot else 1.0,
        seed=int(rng.integers(1 << 31)), ignore_eos=bool(rng.random() < 0.7),
        stop_token_ids=tuple(int(t) for t in rng.integers(3, 128, int(rng.integers(0, 3)))),
        logprobs=True))
  return ps, params


def _serve_schedules(llm, fresh_engine, rng) -> int:
  """SCHEDULES x CALLS_PER_SCHEDULE random ``generate`` calls on the long-lived (poisoned)
  ``llm``, each equal to a ``fresh_engine()``'s (tokens; log-probs finite and within 1e-5),
  every block free after each; returns the prompt tokens ``llm`` found cached."""
  cached = 0
  for _ in range(SCHEDULES):
    for _ in range(CALLS_PER_SCHEDULE):
      ps, params = _schedule(rng, llm.max_seqs)
      got = llm.generate(ps, params)
      cached += llm.stats["cached_prompt_tokens"]
      want = fresh_engine().generate(ps, params)
      assert tokens_of(got) == tokens_of(want)
      for g, w in zip(got, want):
        assert np.all(np.isfinite(g.logprobs))
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
      check_all_free(llm)
  return cached


@pytest.mark.parametrize("num_blocks,prefix_caching",  # 12 blocks of 4 tokens: preemptions
                         [(12, True), (64, True), (12, False)])
def test_poisoned_free_and_stale_pages_never_read(model, config, num_blocks, prefix_caching):
  opts = dict(num_blocks=num_blocks, steps_per_call=2, enable_prefix_caching=prefix_caching)
  llm = make_llm(model, config, **opts)
  poison = Poisoner(llm)
  _serve_schedules(llm, lambda: make_llm(model, config, **opts),
                   np.random.default_rng(num_blocks + prefix_caching))
  print(f"\npool {num_blocks}, prefix caching {prefix_caching}: {poison.calls} device calls "
        f"poisoned, {poison.free_blocks} free blocks poisoned, preemptions "
        f"{llm.stats['preemptions']}, prefix hit rate {llm.stats['prefix_hit_rate']:.2f}")
  assert poison.calls > 50 and poison.free_blocks > 0
  if num_blocks == 12:
    assert llm.stats["preemptions"] > 0


def test_poisoned_pool_with_kv_groups_and_prefix_hits(model, config):
  # A sliding layer (window 6) and a full one: two KV groups in one pool of 20 blocks of 4
  # tokens, the sliding group giving blocks back behind its window; prefix hits take the
  # full group's chain and the sliding group's blocks of the window at the hit's end.
  # Blocks a window left behind are poisoned unless cached; a hit on a wrong, stale or
  # poisoned block shows in the log-probs.
  hybrid = dataclasses.replace(config, layer_types=(SLIDING, FULL), sliding_window=6)
  hybrid_model = init_random(hybrid, seed=0, impl="xla")
  opts = dict(num_blocks=20, steps_per_call=2, free_outside_window=True)
  llm = make_llm(hybrid_model, hybrid, **opts)
  assert llm.kv_groups.windows == (6, None) and llm.stats["prefix_caching"]
  poison = Poisoner(llm)
  cached = _serve_schedules(
      llm, lambda: make_llm(hybrid_model, hybrid, enable_prefix_caching=False, **opts),
      np.random.default_rng(7))
  print(f"\nKV groups (6, None), 20 blocks: {poison.calls} device calls poisoned, "
        f"{poison.free_blocks} free blocks poisoned, preemptions {llm.stats['preemptions']}, "
        f"{cached} prompt tokens found cached")
  assert poison.calls > 50 and poison.free_blocks > 0 and cached > 0
  assert llm.stats["preemptions"] > 0


def _pool_is_zero_where_free(st):
  free_N = np.asarray(st.alloc.ref_counts) == 0
  for pages in (st.cache.k_pages, st.cache.v_pages):
    assert not np.any(np.asarray(pages)[:, :, free_N]), "a free block kept K/V"


def test_scrub_on_release_zeroes_every_freed_block(model, config):
  opts = dict(num_blocks=12, steps_per_call=2, enable_prefix_caching=False)
  scrub = make_llm(model, config, scrub_on_release=True, **opts)
  plain = make_llm(model, config, **opts)
  wrap_call(scrub, after=lambda old, new: _pool_is_zero_where_free(new[0]))
  rng = np.random.default_rng(5)
  for _ in range(3):
    ps, params = _schedule(rng, scrub.max_seqs)
    assert tokens_of(scrub.generate(ps, params)) == tokens_of(plain.generate(ps, params))
  assert scrub.stats["preemptions"] > 0  # preempted blocks are scrubbed too
  check_all_free(scrub)
  for pages in (scrub._state.cache.k_pages, scrub._state.cache.v_pages):
    assert not np.any(np.asarray(pages))  # the whole pool is zero again
  assert np.any(np.asarray(plain._state.cache.k_pages))  # without scrub, stale K/V stays
  # An abandoned stream's blocks are scrubbed as well.
  stream = scrub.generate_stream(prompts((9, 13)), SamplingParams(max_tokens=20))
  next(stream)
  stream.close()
  check_all_free(scrub)
  assert not np.any(np.asarray(scrub._state.cache.k_pages))


def _unowned_slots_are_zero(st):
  """Every KV slot that neither a live sequence's tokens nor a cache entry holds is zero."""
  alloc = jax.device_get(st.alloc)
  n, z = alloc.num_blocks, alloc.block_size
  owned_NZ = np.zeros((n, z), bool)
  owned_NZ[alloc.depth_N >= 0] = True  # registered blocks are full cache entries
  for row, length in zip(alloc.block_tables, alloc.seq_lens):
    for j, b in enumerate(row[:-(-int(length) // z)]):
      owned_NZ[b, :min(z, int(length) - j * z)] = True
  for pages in (st.cache.k_pages, st.cache.v_pages):
    stale = np.any(np.asarray(pages) != 0, axis=(0, 1, 4))  # [N, Z]
    assert not np.any(stale & ~owned_NZ), "an unowned KV slot kept K/V"


def test_scrub_with_prefix_cache_keeps_only_cache_entries(model, config):
  # With the prefix cache, a freed full block stays a cache entry (its K/V kept for hits of
  # the same salt); everything else is zeroed, and an evicted entry is zeroed before its new
  # owner writes, so no slot a sequence reads past its own tokens ever held someone else's.
  opts = dict(num_blocks=12, steps_per_call=2)
  scrub = make_llm(model, config, scrub_on_release=True, **opts)
  plain = make_llm(model, config, enable_prefix_caching=False, **opts)
  wrap_call(scrub, after=lambda old, new: _unowned_slots_are_zero(new[0]))
  rng = np.random.default_rng(7)
  for _ in range(3):
    ps, params = _schedule(rng, scrub.max_seqs)
    assert tokens_of(scrub.generate(ps, params)) == tokens_of(plain.generate(ps, params))
  assert scrub.stats["preemptions"] > 0 and scrub.stats["prefix_hit_rate"] > 0
  check_all_free(scrub)


def test_scrub_on_release_must_be_bool(model, config):
  with pytest.raises(ValueError, match="scrub_on_release"):
    make_llm(model, config, scrub_on_release="yes")


def test_control_poisoning_owned_slots_is_seen(model, config):
  # Negative control: the same poison written over slots a sequence DOES own shows up, so
  # the clean outputs above are evidence of isolation, not of a poison that does nothing.
  llm = make_llm(model, config, steps_per_call=2)
  clean, = llm.generate(prompts((10,)), SamplingParams(max_tokens=6, logprobs=True))
  def poison_all(st):
    cache = type(st.cache)(k_pages=jnp.full_like(st.cache.k_pages, jnp.nan),
                           v_pages=jnp.full_like(st.cache.v_pages, jnp.nan))
    return st.__class__(**{**{f: getattr(st, f) for f in st.__dataclass_fields__},
                           "cache": cache})
  wrap_call(llm, before=poison_all)
  bad, = llm.generate(prompts((10,)), SamplingParams(max_tokens=6, logprobs=True))
  assert bad.token_ids != clean.token_ids or not np.all(np.isfinite(bad.logprobs))
