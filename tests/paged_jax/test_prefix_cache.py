"""Prefix caching: the allocator's register / lookup / attach, eviction order, forced hash
collisions, and the engine serving with the cache on (outputs equal to the cache off)."""

from __future__ import annotations

import dataclasses
import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from paged_jax import allocator as A
from paged_jax.engine import SamplingParams
# The tiny model, its engine options and helpers, shared with the reliability tests.
from tests.reliability.conftest import VOCAB, config, make_llm, model, tokens_of as ids

NB = A.NO_BLOCK
_append = jax.jit(A.append)
_release = jax.jit(A.release)
_register = jax.jit(A.register, static_argnames=("hash_fn",))
_lookup = jax.jit(A.lookup, static_argnames=("hash_fn",))
_attach = jax.jit(A.attach)


def i32(*xs):
  return jnp.asarray(xs, jnp.int32)


def constant_hash(tokens_SPZ, salt_S):
  """Every block of every sequence collides."""
  del salt_S
  return jnp.zeros(tokens_SPZ.shape[:2], jnp.uint32)


def depth_hash(tokens_SPZ, salt_S):
  """Every block collides with every other block at the same depth."""
  del salt_S
  s, p, _ = tokens_SPZ.shape
  return jnp.broadcast_to(jnp.arange(p, dtype=jnp.uint32), (s, p))


def pool():
  # N=8 blocks of Z=4 tokens, S=4 sequences of at most P=4 blocks (16 tokens).
  return A.init(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4)


def token_rows(*rows):
  """i32[4, 16]: the given rows (padded with 0), then zero rows."""
  out = np.zeros((4, 16), np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def fields(state, *names):
  return {n: np.asarray(getattr(state, n)).tolist() for n in names}


# ----------------------------------------------------------------------------- hashing


def _python_chain(tokens, salt, p, z):
  """The documented chain, one block after the other: h_j = R * h_{j-1} + c_j."""
  m = 2**32

  def fmix(h):
    h ^= h >> 16
    h = h * 0x85EBCA6B % m
    h ^= h >> 13
    h = h * 0xC2B2AE35 % m
    return h ^ (h >> 16)

  h, keys = fmix((salt ^ 0x5BD1E995) % m), []
  for j in range(p):
    c = fmix(sum(fmix((int(tokens[j * z + i]) * 0x9E3779B9 + (i + 1) * 0x632BE5AB) % m)
                 for i in range(z)) % m)
    h = (0x2545F491 * h + c) % m
    keys.append(fmix(h))
  return keys


def test_chain_hashes_match_the_sequential_chain():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50_000, (3, 5 * 3)).astype(np.int32)  # S=3, P=5, Z=3
  salt = np.asarray([0, 7, 2**31 - 1], np.int32)
  got = np.asarray(A.chain_hashes(jnp.asarray(tokens).reshape(3, 5, 3), jnp.asarray(salt)))
  assert got.dtype == np.uint32
  for s in range(3):
    assert got[s].tolist() == _python_chain(tokens[s], int(salt[s]), 5, 3)


def test_chain_hashes_cover_the_parent_and_the_salt():
  rng = np.random.default_rng(1)
  base = rng.integers(0, 1000, 16).astype(np.int32)
  other = base.copy()
  other[5] += 1  # block 1 differs (Z=4): blocks 1, 2, 3 must all hash differently
  rows = jnp.asarray(np.stack([base, other, base]).reshape(3, 4, 4))
  keys = np.asarray(A.chain_hashes(rows, i32(0, 0, 1)))
  assert keys[0, 0] == keys[1, 0]
  assert np.all(keys[0, 1:] != keys[1, 1:])
  assert np.all(keys[0] != keys[2])  # another salt: another chain from block 0


# ----------------------------------------------------------------------------- by hand


def test_register_lookup_attach_by_hand():
  a = np.arange(10, 26)  # 16 tokens
  b = a.copy()
  b[10:] = 99  # shares a's first 10 tokens: blocks 0 and 1 (tokens 0..7) fully
  tokens = token_rows(a, b)
  s, _ = _append(pool(), i32(10, 0, 0, 0))  # seq 0: blocks 0, 1 full, block 2 partial
  s = _register(s, tokens)
  A.validate(s)
  assert fields(s, "depth_N", "parent_N")["depth_N"] == [0, 1, -1, -1, -1, -1, -1, -1]
  assert int(s.parent_N[0]) == NB and int(s.parent_N[1]) == 0
  np.testing.assert_array_equal(s.block_tokens_NZ[1], a[4:8])
  # seq 0: 10 // 4 = 2 blocks; seq 1: its block 2 differs and is not registered -> 2;
  # seq 2: other tokens -> 0; seq 3: num_tokens 3 < Z -> 0 (no full block to match).
  blocks, hit = _lookup(s, tokens, i32(10, 16, 16, 3))
  assert np.asarray(hit).tolist() == [2, 2, 0, 0]
  assert np.asarray(blocks).tolist()[1] == [0, 1, NB, NB]
  s, ok = _attach(s, blocks, i32(0, 2, 0, 0))
  A.validate(s)
  assert np.asarray(ok).tolist() == [True] * 4
  assert np.asarray(s.block_tables).tolist()[1] == [0, 1, NB, NB]
  assert int(s.seq_lens[1]) == 8
  # Blocks 0, 1 are now held by seqs 0 and 1; block 2 by seq 0; nothing revived.
  assert np.asarray(s.ref_counts).tolist()[:3] == [2, 2, 1] and int(s.num_free) == 5
  # Released, the full blocks stay cached (free but registered) and revive on a hit.
  s = _release(s, jnp.asarray([True, True, False, False]))
  A.validate(s)
  assert int(s.num_free) == 8 and int(A.num_cached(s)) == 2
  blocks, hit = _lookup(s, tokens, i32(0, 0, 16, 0))
  assert np.asarray(hit).tolist() == [0, 0, 0, 0]  # seq 2's row holds other tokens
  blocks, hit = _lookup(s, token_rows(a, a, a), i32(0, 0, 9, 0))
  s, ok = _attach(s, blocks, hit)
  A.validate(s)
  assert bool(ok[2]) and int(s.num_free) == 6 and int(A.num_cached(s)) == 0


def test_lookup_respects_the_salt():
  a = np.arange(1, 17)
  s, _ = _append(pool(), i32(8, 0, 0, 0))
  s = _register(s, token_rows(a), salt=i32(5, 0, 0, 0))
  rows = token_rows(a, a, a, a)
  _, hit = _lookup(s, rows, i32(8, 8, 8, 8), salt=i32(5, 5, 0, 6))
  assert np.asarray(hit).tolist() == [2, 2, 0, 0]


def test_in_call_duplicates_register_once_and_chain_off_the_first():
  a = np.arange(40, 56)
  tokens = token_rows(a, a)
  s, _ = _append(pool(), i32(8, 8, 0, 0))  # seq 0: blocks 0, 1; seq 1: blocks 2, 3
  s = _register(s, tokens)
  A.validate(s)
  # Only seq 0 (first in slot order) registers the shared content.
  assert np.asarray(s.depth_N).tolist()[:4] == [0, 1, -1, -1]
  # seq 1 grows into block 4 (tokens 8..11): it registers it after the matched prefix,
  # whose registered copy is seq 0's block 1 (not seq 1's own block 3).
  s, _ = _append(s, i32(0, 4, 0, 0))
  s = _register(s, tokens)
  A.validate(s)
  assert int(s.depth_N[4]) == 2 and int(s.parent_N[4]) == 1
  blocks, hit = _lookup(s, token_rows(a, a, a), i32(0, 0, 16, 0))
  assert int(hit[2]) == 3 and np.asarray(blocks).tolist()[2] == [0, 1, 4, NB]


def _entries(s, depth):
  """The registered blocks at ``depth``."""
  return np.flatnonzero(np.asarray(s.depth_N) == depth).tolist()


def test_a_fully_cached_prompt_does_not_register_its_last_block_twice():
  # The engine's admission: lookup with len - 1 tokens leaves a prompt of 8 = 2 * Z cached
  # tokens one block short (hit 1), so it recomputes block 1 into a fresh block. Register
  # must see that the cache holds that prefix already: one entry per prefix, so a longer
  # prompt extending a chain off the original entry still hits whole.
  a = np.arange(60, 76)
  s, _ = _append(pool(), i32(12, 0, 0, 0))  # request A: a[:12], blocks 0, 1, 2 registered
  s = _register(s, token_rows(a))
  s = _release(s, jnp.asarray([True, False, False, False]))
  rows = token_rows(a[:8], a[:8])
  blocks, hit = _lookup(s, rows, i32(7, 0, 0, 0))  # request B: a[:8], 7 tokens matchable
  assert int(hit[0]) == 1
  s, _ = _attach(s, blocks, hit)
  s, _ = _append(s, i32(4, 0, 0, 0))  # recomputes a[4:8] into a fresh block
  fresh = int(s.block_tables[0, 1])
  assert fresh not in (0, 1, 2)
  s = _register(s, rows)
  A.validate(s)
  assert _entries(s, 1) == [1] and int(s.depth_N[fresh]) == -1
  s = _release(s, jnp.asarray([True, False, False, False]))
  blocks, hit = _lookup(s, token_rows(a), i32(16, 0, 0, 0))
  assert int(hit[0]) == 3 and np.asarray(blocks).tolist()[0] == [0, 1, 2, NB]


def test_forks_filling_the_same_block_in_turn_keep_one_entry():
  # A fork's two sequences fill the same next block in different calls: the second finds
  # the first's entry and registers nothing; its later block chains off that entry, so
  # the whole prefix stays one chain.
  a = np.arange(80, 96)
  rows = token_rows(a, a)
  s, _ = _append(pool(), i32(4, 0, 0, 0))
  s = _register(s, rows)
  s, ok, _, _ = jax.jit(A.fork)(s, i32(0), i32(1))
  assert bool(ok[0])
  s, _ = _append(s, i32(0, 4, 0, 0))  # seq 1 fills level 1 first
  s = _register(s, rows)
  s, _ = _append(s, i32(4, 0, 0, 0))  # then seq 0 fills the same level 1
  s = _register(s, rows)
  A.validate(s)
  assert len(_entries(s, 1)) == 1
  s, _ = _append(s, i32(4, 0, 0, 0))  # seq 0 goes on to level 2, off the one entry
  s = _register(s, rows)
  A.validate(s)
  (level1,), (level2,) = _entries(s, 1), _entries(s, 2)
  assert int(s.parent_N[level2]) == level1
  s = _release(s, jnp.asarray([True, True, False, False]))
  _, hit = _lookup(s, token_rows(a), i32(16, 0, 0, 0))
  assert int(hit[0]) == 3


def test_in_call_duplicates_register_their_own_tails_in_the_same_call():
  # Two sequences with the same first block and different second ones register in one
  # call: the second's first block is the first's (one entry), and its own second block is
  # registered in the same call (a second round), so it is cached even if it is released
  # before any later register.
  a, b = np.arange(1, 9), np.concatenate([np.arange(1, 5), np.arange(50, 54)])
  s, _ = _append(pool(), i32(8, 8, 0, 0))  # seq 0: blocks 0, 1; seq 1: blocks 2, 3
  s = _register(s, token_rows(a, b))
  A.validate(s)
  assert _entries(s, 0) == [0] and sorted(_entries(s, 1)) == [1, 3]
  assert int(s.parent_N[3]) == 0
  s = _release(s, jnp.asarray([True, True, False, False]))
  _, hit = _lookup(s, token_rows(a, b), i32(8, 8, 0, 0))
  assert np.asarray(hit).tolist()[:2] == [2, 2]


def test_attach_refuses_bad_requests_and_changes_nothing():
  a = np.arange(1, 17)
  s, _ = _append(pool(), i32(12, 0, 0, 0))  # blocks 0, 1, 2 registered, seq 0 holds them
  s = _register(s, token_rows(a))
  s, _ = _append(s, i32(0, 0, 0, 2))  # seq 3 not empty (block 3, unregistered)
  before = s
  bad = np.full((4, 4), NB, np.int32)
  bad[0] = [0, 1, NB, NB]  # seq 0 is not empty
  bad[1] = [1, 0, NB, NB]  # depths out of order
  bad[2] = [3, NB, NB, NB]  # block 3 is not registered
  bad[3] = [0, NB, NB, NB]  # seq 3 is not empty
  s, ok = _attach(s, jnp.asarray(bad), i32(2, 2, 1, 1))
  assert np.asarray(ok).tolist() == [False] * 4
  for name in ("block_tables", "seq_lens", "ref_counts", "num_free"):
    np.testing.assert_array_equal(getattr(s, name), getattr(before, name), err_msg=name)
  # Out-of-range ids and a chain that skips a link are refused too; k == 0 is always ok.
  bad = np.full((4, 4), NB, np.int32)
  bad[1] = [0, 2, NB, NB]  # block 2 is depth 2, not 1
  bad[2] = [8, NB, NB, NB]
  s, ok = _attach(s, jnp.asarray(bad), i32(0, 2, 1, 0))
  assert np.asarray(ok).tolist() == [True, False, False, True]
  A.validate(s)


def test_attach_with_tokens_refuses_a_stale_lookup():
  # A lookup kept while another sequence evicts its second block and registers other tokens
  # there, under the same parent: the stale result is still a chain, so attach without
  # tokens grants it (documented); with the prompt's tokens it is refused, state unchanged.
  z, rows = 4, lambda d: jnp.asarray(
      [d.get(i, []) + [0] * (16 - len(d.get(i, []))) for i in range(4)], jnp.int32)
  p0, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
  s = A.init(3, z, 4, 4)
  s, _ = A.append(s, i32(8, 0, 0, 0))
  s = A.register(s, rows({0: p0 + x}))
  s = A.release(s, jnp.asarray([True, False, False, False]))
  s, _ = A.append(s, i32(0, 0, 0, 1))  # the third block, held
  prompt = rows({1: p0 + x + [0]})
  stale, hit = A.lookup(s, prompt, i32(0, 8, 0, 0))
  assert np.asarray(hit).tolist() == [0, 2, 0, 0]
  other, hit2 = A.lookup(s, rows({2: p0 + y + [0]}), i32(0, 0, 8, 0))
  s, _ = A.attach(s, other, hit2)  # p0's block
  s, ok = A.append(s, i32(0, 0, 4, 0))  # evicts x's block for y
  assert bool(ok[2])
  s = A.register(s, rows({2: p0 + y}))
  s = A.release(s, jnp.asarray([False, False, True, False]))
  assert np.asarray(A.lookup(s, prompt, i32(0, 8, 0, 0))[1]).tolist() == [0, 1, 0, 0]
  before = s
  refused, ok = A.attach(s, stale, hit, tokens=prompt)
  assert np.asarray(ok).tolist() == [True, False, True, True]
  for name in ("block_tables", "seq_lens", "ref_counts", "num_free"):
    np.testing.assert_array_equal(getattr(refused, name), getattr(before, name), err_msg=name)
  granted, ok = A.attach(s, stale, hit)  # what the docstring warns of
  assert bool(ok[1]) and np.asarray(granted.block_tokens_NZ)[
      np.asarray(granted.block_tables)[1, 1]].tolist() == y
  fresh, fresh_hit = A.lookup(s, prompt, i32(0, 8, 0, 0))
  attached, ok = A.attach(s, fresh, fresh_hit, tokens=prompt)  # a current result passes
  assert bool(ok[1]) and int(attached.seq_lens[1]) == 4
  A.validate(attached)
  # The chain's salt must be the caller's too (lookup's default, 0, here).
  _, ok = A.attach(s, fresh, fresh_hit, tokens=prompt, salt=i32(0, 5, 0, 0))
  assert not bool(ok[1])
  with pytest.raises(ValueError, match="salt= checks a lookup's result with tokens="):
    A.attach(s, fresh, fresh_hit, salt=i32(0, 5, 0, 0))


# ----------------------------------------------------------------------------- eviction


def test_eviction_is_lru_and_chains_shrink_from_the_tail():
  a, b = np.arange(100, 116), np.arange(200, 216)
  s, _ = _append(pool(), i32(12, 8, 0, 0))  # a: blocks 0, 1, 2; b: blocks 3, 4
  s = _register(s, token_rows(a, b))
  s = _release(s, jnp.asarray([True, False, False, False]))  # a freed first (older)
  s = _release(s, jnp.asarray([False, True, False, False]))
  A.validate(s)
  assert int(A.num_cached(s)) == 5 and int(s.num_free) == 8
  # 4 blocks wanted: the 3 never-cached ones (5, 6, 7) first, then the LRU chain's deepest
  # block, a's block 2.
  s, ok = _append(s, i32(0, 0, 16, 0))
  assert bool(ok[2]) and np.asarray(s.block_tables).tolist()[2] == [5, 6, 7, 2]
  A.validate(s)
  _, hit = _lookup(s, token_rows(a, b), i32(16, 16, 0, 0))
  assert np.asarray(hit).tolist()[:2] == [2, 2]
  # A hit refreshes a's blocks: attached and released now, a is the most recent; the next
  # 4 blocks wanted are the 4 freed by seq 2 (uncached), then b's 2 (deepest first).
  blocks, hit = _lookup(s, token_rows(a), i32(16, 0, 0, 0))
  s, _ = _attach(s, blocks, hit)
  s = _release(s, jnp.asarray([True, False, True, False]))
  s, ok = _append(s, i32(16, 8, 0, 0))
  assert np.asarray(ok).tolist() == [True] * 4
  assert np.asarray(s.block_tables).tolist()[:2] == [[2, 5, 6, 7], [4, 3, NB, NB]]
  A.validate(s)
  _, hit = _lookup(s, token_rows(a, b, a, b), i32(0, 0, 16, 16))
  assert np.asarray(hit).tolist() == [0, 0, 2, 0]


# ----------------------------------------------------------------------------- collisions


def test_constant_hash_never_reuses_another_prefix():
  x, y = np.arange(1, 17), np.arange(101, 117)
  s, _ = _append(pool(), i32(16, 0, 0, 0))
  s = _register(s, token_rows(x), hash_fn=constant_hash)
  A.validate(s)
  rows = token_rows(x, y, np.concatenate([x[:4], y[4:]]))
  blocks, hit = _lookup(s, rows, i32(16, 16, 16, 0), hash_fn=constant_hash)
  # Every hash proposes block 0 (first in the table); only true matches are accepted:
  # x's block 0 at depth 0. Deeper levels get block 0 again (depth 0 != j): a miss.
  assert np.asarray(hit).tolist() == [1, 0, 1, 0]
  assert np.asarray(blocks).tolist()[1] == [NB] * 4


def test_evicted_parent_reused_for_other_tokens_breaks_the_chain():
  # With a hash that collides on every block of a depth, a stale child (its parent evicted
  # and re-registered with other tokens) would be proposed and its own tokens match: the
  # parent's generation, bumped when it was handed out again, is what refuses it.
  x, y, x2 = np.arange(1, 5), np.arange(11, 15), np.arange(21, 25)
  s, _ = _append(pool(), i32(8, 0, 0, 0))  # blocks 0 (x), 1 (y)
  s = _register(s, token_rows(np.concatenate([x, y])), hash_fn=depth_hash)
  s = _release(s, jnp.asarray([True, False, False, False]))
  # Make block 1 the more recently used one, so that block 0 is evicted first.
  s = dataclasses.replace(s, last_used=s.last_used.at[1].add(1))
  s, _ = _append(s, i32(0, 16, 8, 0))  # the 6 uncached blocks
  s, _ = _append(s, i32(0, 0, 0, 4))  # takes block 0: evicted, generation + 1
  assert np.asarray(s.block_tables).tolist()[3] == [0, NB, NB, NB]
  s = _register(s, token_rows([], [], [], x2), hash_fn=depth_hash)
  A.validate(s)
  assert int(s.depth_N[0]) == 0 and int(s.depth_N[1]) == 1  # both registered
  _, hit = _lookup(s, token_rows(np.concatenate([x2, y])), i32(8, 0, 0, 0),
                   hash_fn=depth_hash)
  assert int(hit[0]) == 1  # block 0 (x2) only; block 1 was computed after x, not x2


def test_a_stale_entry_does_not_hide_the_live_one_with_the_same_key():
  # y's block stays registered after its parent x is evicted (stale); x and y computed again
  # register a live y' under the same chained key. A lookup of x + y must reach y', not stop
  # at the stale entry (a table proposing one block per key, the lowest id, did).
  x, y = np.arange(1, 5), np.arange(11, 15)
  s, _ = _append(pool(), i32(8, 0, 0, 0))  # blocks 0 (x), 1 (y)
  s = _register(s, token_rows(np.concatenate([x, y])))
  s = _release(s, jnp.asarray([True, False, False, False]))
  s = dataclasses.replace(s, last_used=s.last_used.at[1].add(1))  # evict block 0 first
  s, _ = _append(s, i32(0, 16, 8, 0))  # the 6 uncached blocks
  s, _ = _append(s, i32(0, 0, 0, 4))  # takes block 0: x's entry evicted, y's left stale
  s = _register(s, token_rows([], [], [], x))
  s = _release(s, jnp.asarray([False, False, True, False]))  # blocks 6, 7 free again
  s, _ = _append(s, i32(0, 0, 0, 4))  # block 6
  s = _register(s, token_rows([], [], [], np.concatenate([x, y])))
  A.validate(s)
  assert np.asarray(s.block_tables).tolist()[3][:2] == [0, 6]
  assert int(s.depth_N[1]) == 1 and int(s.block_hash_N[1]) == int(s.block_hash_N[6])
  blocks, hit = _lookup(s, token_rows(np.concatenate([x, y])), i32(8, 0, 0, 0))
  assert int(hit[0]) == 2 and np.asarray(blocks).tolist()[0][:2] == [0, 6]


def test_a_stale_chain_two_levels_deep_does_not_hide_the_live_one():
  # One block per token (Z = 1), every prompt 7 7 7 7. A chain a0 -> a1 -> b2 -> b3 loses
  # its root (a0, a1 evicted and reused): b2 is stale, and b3 hangs off b2, which holds the
  # right tokens. A live chain c0 -> c1 -> c2 -> c3 of the same prompt is registered after.
  # The lookup took b3 at level 3 (its parent b2 holds; that b2's own parent is stale went
  # unchecked), the walk found b3 off c2 broken, and stopped at 3 levels; a sequence then
  # computing the 4th token registered a second entry for the prefix (found by a model of
  # the allocator fuzzed against it).
  num_seqs, width = 4, 6
  st = A.init(10, 1, num_seqs, width)
  tokens = jnp.full((num_seqs, width), 7, jnp.int32)
  grow = lambda st, *n: _append(st, i32(*n))[0]
  only = lambda i: jnp.arange(num_seqs) == i
  st = _register(grow(st, 2, 0, 0, 0), tokens)   # seq 0: a0 = 0 -> a1 = 1
  st = _register(grow(st, 0, 3, 0, 0), tokens)   # seq 1: b2 = 4 off a1
  st = _release(st, only(0))                     # a0, a1 cached
  st = _release(grow(st, 0, 0, 6, 0), only(2))   # seq 2 evicts a0, a1: b2 stale
  st = grow(st, 0, 0, 5, 0)                      # holds 0, 1, 5, 6, 7: b3 gets 8
  st = _register(grow(st, 0, 1, 0, 0), tokens)   # seq 1: b3 = 8 off b2
  st = _release(st, only(2))
  st = _register(grow(st, 0, 0, 0, 4), tokens)   # seq 3: the live chain c0..c3
  A.validate(st)
  live = np.asarray(st.block_tables)[3, :4].tolist()
  blocks, hit = _lookup(st, tokens, i32(4, 4, 4, 4))
  assert np.asarray(hit).tolist() == [4] * 4
  assert np.asarray(blocks)[0, :4].tolist() == live
  # A sequence attaching the hit and growing registers nothing twice: one entry a level.
  st, ok = A.attach(st, blocks, i32(4, 0, 0, 0))
  st = _register(grow(st, 1, 0, 0, 0), tokens)
  A.validate(st)
  depth, parent = np.asarray(st.depth_N), np.asarray(st.parent_N)
  for level in range(1, 5):
    up = live[level - 1]
    assert np.count_nonzero((depth == level) & (parent == up)) == 1, (level, depth, parent)


def test_a_live_entry_between_two_stale_ones_of_its_key_is_found():
  # One block per token (Z = 1). Twice, a root [a] is registered, a second sequence hangs
  # its [a, b] block off it, and the root is evicted while that block is held: two stale
  # depth-1 entries of the key of [a, b]. A live chain [a, b] registered after gets the id
  # between theirs (blocks 2 < 3 < 6), so a bucket keeping its highest and lowest id held
  # only the stale two: the lookup stopped at 1 level, and a sequence computing [a, b]
  # registered it a second time (found by a model of the allocator; README's check).
  n, s, p = 12, 10, 4
  a, b = 7, 9
  grow = lambda st, seq, k: _append(st, jnp.zeros(s, jnp.int32).at[seq].set(k))[0]
  rows = lambda seq, t: jnp.zeros((s, p), jnp.int32).at[seq, :len(t)].set(jnp.asarray(t))
  only = lambda *seqs: jnp.zeros(s, jnp.bool_).at[jnp.asarray(seqs)].set(True)

  def churn(st):  # hand every free block out and back: cached entries evicted
    grown = []
    for seq in (6, 7, 8):
      k = min(p, int(st.num_free))
      if k:
        st, grown = grow(st, seq, k), grown + [seq]
    return _release(st, only(*grown))

  st = A.init(n, 1, s, p)
  for r in range(2):
    x, y = 2 * r, 2 * r + 1
    st = _register(grow(st, x, 1), rows(x, [a]))     # x: root [a]
    st = _register(grow(st, y, 2), rows(y, [a, b]))  # y: [a, b] off x's root
    st = churn(_release(st, only(x)))                # the root evicted: y's entry stale
    if r == 0:
      st = grow(st, 9, 2)  # holds two blocks, so the next stale entry gets a higher id
  st = churn(_release(st, only(9)))
  st = _register(grow(st, 4, 2), rows(4, [a, b]))    # the live chain [a, b]
  A.validate(st)
  live = np.asarray(st.block_tables)[4, :2].tolist()
  depth_1 = np.flatnonzero(np.asarray(st.depth_N) == 1).tolist()
  assert len(depth_1) == 3 and depth_1[0] < live[1] < depth_1[-1], (depth_1, live)
  assert len({int(st.block_hash_N[i]) for i in depth_1}) == 1
  blocks, hit = _lookup(st, jnp.zeros((s, p), jnp.int32).at[:, :2].set(jnp.asarray([a, b])),
                        jnp.full(s, 2, jnp.int32))
  assert np.asarray(hit).tolist() == [2] * s
  assert np.asarray(blocks)[:, :2].tolist() == [live] * s
  # A sequence that computes [a, b] itself registers nothing: the prefix keeps one entry.
  st = _register(grow(st, 5, 2), rows(5, [a, b]))
  depth, parent = np.asarray(st.depth_N), np.asarray(st.parent_N)
  off_root = (parent == live[0]) & (np.asarray(st.parent_gen_N) == int(st.generation_N[live[0]]))
  assert np.flatnonzero((depth == 1) & off_root).tolist() == [live[1]]
  assert np.flatnonzero((depth == 0) & (np.asarray(st.block_hash_N)
                                        == int(st.block_hash_N[live[0]]))).tolist() == [live[0]]


def _sort_lengths(jaxpr) -> list[int]:
  """The lengths of every sort in ``jaxpr`` and the jaxprs inside it (cond, while, ...)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sort":
      found.append(eqn.invars[0].aval.shape[eqn.params["dimension"]])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _sort_lengths(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _sort_lengths(sub)
  return found


@pytest.mark.parametrize("fn", [A.lookup, A.register])
def test_lookup_and_register_never_sort_the_pool(fn):
  # The cache's table is built by scattering into hash buckets: no O(N log N) sort of the
  # pool at admission or registration (a 5-key lexsort cost 10 ms at 32k blocks on CPU).
  # register may sort its S rows (its in-call duplicates), never the N blocks.
  s = A.init(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4)
  args = (s, token_rows(np.arange(1, 9)))
  args += (i32(8, 0, 0, 0),) if fn is A.lookup else ()
  jaxpr = jax.make_jaxpr(fn)(*args)
  assert "scatter" in str(jaxpr)
  assert all(length != s.num_blocks for length in _sort_lengths(jaxpr.jaxpr))
  assert fn is A.lookup or _sort_lengths(jaxpr.jaxpr), "the test must see register's sort"


def test_register_costs_max_seqs_not_its_square():
  # Its in-call duplicates were found by an [S, S] comparison: 35 MB of temporaries at
  # S = 4096 (a max_seqs of 100000 asked for 31 GB). Now one sort of the S rows: 2 MB.
  s = A.init(num_blocks=64, block_size=16, max_seqs=4096, max_blocks_per_seq=2)
  tokens = jnp.zeros((4096, 32), jnp.int32)
  compiled = jax.jit(A.register).lower(s, tokens).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 8 * 2**20, temp  # 4096 * 4096 bools alone would be 16 MiB


# ----------------------------------------------------------------------------- checks


def test_validate_catches_broken_cache_entries():
  a = np.arange(1, 17)
  s, _ = _append(pool(), i32(6, 0, 0, 0))  # block 0 full, block 1 partial
  s = _register(s, token_rows(a))
  A.validate(s)

  def bad(pattern, **changes):
    with pytest.raises(ValueError, match=pattern):
      A.validate(dataclasses.replace(s, **changes))

  bad(r"registered block 1 .* must be full", depth_N=s.depth_N.at[1].set(1),
      parent_N=s.parent_N.at[1].set(0))
  bad(r"registered block 0 \(depth_N=2\)", depth_N=s.depth_N.at[0].set(2),
      parent_N=s.parent_N.at[0].set(3))
  bad(r"parent_N\[0\]=3 with depth_N\[0\]=0", parent_N=s.parent_N.at[0].set(3))
  bad(r"depth_N\[2\]=9 must be -1", depth_N=s.depth_N.at[2].set(9))


def test_cache_ops_trace_once_without_host_transfer():
  rng = np.random.default_rng(0)
  ops = {"lookup": jax.jit(chex.assert_max_traces(A.lookup, n=1)),
         "register": jax.jit(chex.assert_max_traces(A.register, n=1)),
         "attach": jax.jit(chex.assert_max_traces(A.attach, n=1))}
  s, _ = _append(pool(), i32(9, 5, 0, 0))
  for _ in range(3):
    tokens = jnp.asarray(rng.integers(0, 3, (4, 16)), jnp.int32)  # few values: hits
    num_tokens = jnp.asarray(rng.integers(0, 17, 4), jnp.int32)
    with jax.transfer_guard("disallow"):
      s = ops["register"](s, tokens)
      blocks, hit = ops["lookup"](s, tokens, num_tokens)
      s, _ = ops["attach"](s, blocks, hit)
    A.validate(s)


def test_cache_ops_reject_bad_shapes():
  s = pool()
  with pytest.raises(ValueError, match=r"tokens.shape=\(3, 16\) must be \[S, J\]"):
    A.lookup(s, jnp.zeros((3, 16), jnp.int32), i32(0, 0, 0, 0))
  with pytest.raises(ValueError, match=r"tokens.dtype=float32"):
    A.register(s, jnp.zeros((4, 16), jnp.float32))
  with pytest.raises(ValueError, match=r"salt.shape=\(2,\) must be \(4,\)"):
    A.register(s, jnp.zeros((4, 16), jnp.int32), salt=i32(0, 0))
  with pytest.raises(ValueError, match=r"blocks.shape=\(4, 3\) must be \[S, P\]"):
    A.attach(s, jnp.zeros((4, 3), jnp.int32), i32(0, 0, 0, 0))
  with pytest.raises(ValueError, match=r"hash_fn returned shape"):
    A.lookup(s, jnp.zeros((4, 16), jnp.int32), i32(0, 0, 0, 0),
             hash_fn=lambda t, salt: jnp.zeros(4, jnp.uint32))


# ----------------------------------------------------------------------------- engine

def rand_tokens(rng, n):
  return [int(t) for t in rng.integers(3, VOCAB, int(n))]


def shared_prefix_workloads(seed=0):
  """Two batches: a 21-token system prompt (longer than T = 16: chunked) before short user
  turns, and few-shot prompts that share their first 1-3 examples."""
  rng = np.random.default_rng(seed)
  system = rand_tokens(rng, 21)
  chat = [system + rand_tokens(rng, k) for k in rng.integers(1, 12, 7)]
  shots = [rand_tokens(rng, 9) for _ in range(3)]
  few_shot = [sum(shots[:k], []) + rand_tokens(rng, q)
              for k, q in zip(rng.integers(1, 4, 6), rng.integers(2, 6, 6))]
  return chat, few_shot


def test_engine_outputs_equal_with_cache_on_and_off(model, config):
  chat, few_shot = shared_prefix_workloads()
  greedy = [SamplingParams(max_tokens=6, ignore_eos=True)] * len(chat)
  greedy[2] = SamplingParams(max_tokens=6, ignore_eos=True, n=2)  # forks share blocks too
  on, off = make_llm(model, config), make_llm(model, config, enable_prefix_caching=False)
  for batch, params in ((chat, greedy), (few_shot, SamplingParams(max_tokens=5)),
                        (chat, greedy)):  # the same chats again: long hits
    assert ids(on.generate(batch, params)) == ids(off.generate(batch, params))
    A.validate(on.allocator_state)
  assert off.stats["prefix_hit_rate"] == 0.0
  assert on.stats["prefix_hit_rate"] > 0.4, on.stats
  assert on.stats["cached_blocks"] > 0 and on.stats["num_free_blocks"] == 64
  # cached_blocks is the pool now (free blocks still holding a prefix), not a counter:
  # a reset of the counters leaves it, as it leaves num_free_blocks.
  cached = on.stats["cached_blocks"]
  assert cached == int(A.num_cached(on.allocator_state))
  on.reset_stats()
  assert (on.stats["cached_blocks"], on.stats["prefix_hit_rate"]) == (cached, 0.0)


def test_engine_hit_rate_by_hand(model, config):
  llm = make_llm(model, config)
  prompt = rand_tokens(np.random.default_rng(3), 21)
  params = SamplingParams(max_tokens=3, ignore_eos=True)
  first = llm.generate([prompt], params)
  assert (llm.stats["prompt_tokens"], llm.stats["cached_prompt_tokens"]) == (21, 0)
  second = llm.generate([prompt], params)
  # All but the last prompt token may come from the cache: (21 - 1) // 4 = 5 blocks, 20
  # tokens; the rate over both calls is 20 / (21 + 21).
  assert (llm.stats["prompt_tokens"], llm.stats["cached_prompt_tokens"]) == (42, 20)
  assert llm.stats["prefix_hit_rate"] == pytest.approx(20 / 42)
  assert ids(first) == ids(second)


def test_prompts_arriving_together_share_their_prefix(model, config):
  # Three prompts with a 26-token system prompt, given at once (T = 16: the first is
  # chunked). Blocks are registered after the forward that fills them, so a prompt admitted
  # beside the one filling them would compute its own copies; instead it waits a step and
  # attaches them. Each later prompt hits all 6 full system blocks (24 tokens), where
  # running beside the first, the second hit 4.
  rng = np.random.default_rng(7)
  system = rand_tokens(rng, 26)
  prompts = [system + rand_tokens(rng, k) for k in (1, 2, 1)]
  params = SamplingParams(max_tokens=4, ignore_eos=True)
  on, off = make_llm(model, config), make_llm(model, config, enable_prefix_caching=False)
  assert ids(on.generate(prompts, params)) == ids(off.generate(prompts, params))
  assert (on.stats["prompt_tokens"], on.stats["cached_prompt_tokens"]) == (82, 48)
  assert on.stats["peak_blocks_in_use"] < off.stats["peak_blocks_in_use"]
  A.validate(on.allocator_state)


def test_cache_salt_keeps_tenants_apart(model, config):
  llm = make_llm(model, config)
  prompt = rand_tokens(np.random.default_rng(4), 17)
  params = SamplingParams(max_tokens=2, ignore_eos=True)
  out_a = llm.generate([prompt], params, cache_salt="tenant-a")
  out_b = llm.generate([prompt], params, cache_salt="tenant-b")
  assert llm.stats["cached_prompt_tokens"] == 0  # b never sees a's blocks
  out_none = llm.generate([prompt], params)  # no salt is a tenant of its own too
  assert llm.stats["cached_prompt_tokens"] == 0
  out_a2 = list(llm.generate_stream([prompt, prompt], params,
                                    cache_salt=["tenant-a", "tenant-c"]))
  assert llm.stats["cached_prompt_tokens"] == 16  # a's blocks, for a only
  assert ids(out_a) == ids(out_b) == ids(out_none)
  assert [e.token_id for e in out_a2 if e.prompt_index == 0 and e.token_id is not None] == [
      *out_a[0].token_ids]
  for bad, pattern in ((5, r"cache_salt=5 must be None, a str"),
                       (["a"], r"one str \(or None\) per prompt \(2\)"),
                       (["a", 3], r"cache_salt\[1\]=3 must be a str or None")):
    with pytest.raises(ValueError, match=pattern):
      llm.generate([prompt, prompt], params, cache_salt=bad)


def test_the_salt_table_keeps_only_live_salts_and_never_mixes_tenants(model, config):
  # A server salting per user or per request interned every salt it ever saw (156 B each,
  # for the life of the engine; check_requests interned too). Past its limit the table
  # keeps the salts a slot or a cached block holds; a dropped salt seen again gets a new
  # id, so it misses its old blocks and never finds another's.
  llm = make_llm(model, config)
  table = llm._scheduler.salts
  table._slack = table._limit = 3  # compact after 3 new salts (default: 4096)
  prompt = rand_tokens(np.random.default_rng(7), 17)
  params = SamplingParams(max_tokens=2, ignore_eos=True)
  first = llm.generate([prompt], params, cache_salt="kept")
  hits = llm.stats["cached_prompt_tokens"]
  for i in range(12):  # 3 tokens each, no full block: nothing cached, not live after
    llm.generate([rand_tokens(np.random.default_rng(100 + i), 2)],
                 SamplingParams(max_tokens=1), cache_salt=f"user-{i}")
    assert len(table) <= 2 * 1 + 3  # "kept" (its blocks cached) and the new ones
  before = dict(table._id_of)
  llm.check_requests([prompt] * 3, params, cache_salt=["x", "y", "z"])  # interns nothing
  assert table._id_of == before
  assert "kept" in table._id_of and len(table) < 8 and "user-0" not in table._id_of
  ids_before = dict(table._id_of)
  again = llm.generate([prompt, prompt], params, cache_salt=["kept", "user-0"])
  assert llm.stats["cached_prompt_tokens"] == hits + 16  # "kept" hits its own blocks
  assert [o.token_ids for o in again] == [first[0].token_ids] * 2
  assert table._id_of["user-0"] not in ids_before.values()  # a new id, no one else's
  assert len(set(table._id_of.values())) == len(table._id_of)
  # A stream made before many other salts are served, iterated only after: its salt gets
  # its id when admitted (it had one from the call, dropped while it waited, so the same
  # tenant's next request missed the blocks the stream had cached).
  other = rand_tokens(np.random.default_rng(9), 17)
  pending = llm.generate_stream([other], params, cache_salt="late")
  for i in range(8):
    llm.generate([rand_tokens(np.random.default_rng(200 + i), 2)],
                 SamplingParams(max_tokens=1), cache_salt=f"other-{i}")
  list(pending)
  hits = llm.stats["cached_prompt_tokens"]
  llm.generate([other], params, cache_salt="late")
  assert llm.stats["cached_prompt_tokens"] == hits + 16


def test_salt_ids_are_unique_while_held_through_compaction_and_wrap_around():
  # Ids are given as slots are admitted: held by "the device" or by the admission under
  # way (``held``), never given to a second salt while held.
  from paged_jax.engine import salts
  device = set()  # the ids "the device" holds
  table = salts.SaltIds(lambda: set(device), slack=2)
  held = set()
  a, b = table.intern("a", held), table.intern("b", held)
  assert table.intern(None, held) == 0 and 0 not in (a, b) and a != b and held == {a, b}
  assert table.intern("a", held) == a
  device.update(held)
  held = set()
  batch = [table.intern(f"s{i}", held) for i in range(10)]  # compacts mid-admission
  assert len(set(batch)) == 10 and not set(batch) & {a, b} and held == set(batch)
  assert table.intern("a", set()) == a and table.intern("b", set()) == b  # live: kept
  device.clear()
  for i in range(20):
    table.intern(f"t{i}", set())
  assert len(table) <= 2 * 20 + 2
  # Out of ids: the count starts over and skips every id held.
  device.add(table.intern("old", set()))
  table._next = salts._LAST_ID - 1
  held = set()
  wrapped = [table.intern(f"w{i}", held) for i in range(4)]
  assert len(set(wrapped)) == 4 and max(wrapped) <= salts._LAST_ID
  assert table.intern("old", set()) not in wrapped and 0 not in wrapped
  with pytest.raises(ValueError, match=r"cache_salt\[1\]=3 must be a str or None"):
    table.check(["a", 3], 2)
  # A salt of this admission seen again after a compaction within it keeps its id.
  table, held = salts.SaltIds(lambda: set(device), slack=2), set()
  first = table.intern("first", held)
  for i in range(6):
    table.intern(f"u{i}", held)
  assert table.intern("first", held) == first
  # The last id before the wrap: kept through the wrap's compaction (a fork of the same
  # request asks again), and an id the device holds is skipped after it.
  device.clear()
  table = salts.SaltIds(lambda: set(device))
  device.add(table.intern("old", set()))
  table._next, held = salts._LAST_ID, set()
  last = table.intern("w", held)
  assert last == salts._LAST_ID and table.intern("w", held) == last
  assert table.intern("next", set()) not in device | {last, 0}


def test_the_live_salt_ids_are_busy_slots_and_cached_blocks():
  from paged_jax import KVCacheSpec
  from paged_jax.engine import salts
  from paged_jax.engine import state as state_lib
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=8,
                     dtype=jnp.float32)
  st = state_lib.init_state(spec, 3, 16)
  st = dataclasses.replace(
      st, salt_S=jnp.asarray([7, 8, 9], jnp.int32),
      status_S=jnp.asarray([state_lib.RUNNING, state_lib.FREE, state_lib.FORK_WAIT]),
      alloc=dataclasses.replace(st.alloc, salt_N=jnp.arange(8, dtype=jnp.int32) + 20,
                                depth_N=jnp.asarray([-1, 0, -1, 2, -1, -1, -1, -1])))
  assert salts.live_salt_ids(st) == {7, 9, 21, 23}


def test_an_engine_is_freed_when_its_last_reference_goes(model, config):
  # The salt table's reader of the device state held the engine: an LLM (its pool, its
  # parameters) outlived `del llm` until Python's cycle collector ran.
  import gc
  import weakref
  gc.collect()
  gc.disable()
  try:
    llm = make_llm(model, config)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), cache_salt="t")
    ref = weakref.ref(llm)
    del llm
    assert ref() is None
  finally:
    gc.enable()


def test_a_refused_generate_draws_no_seed_and_interns_no_salt(model, config):
  # A call refused for its second prompt drew the first one's seed (and interned its
  # salt) before the refusal: the next unseeded request sampled other tokens than on an
  # engine that never saw the refused call.
  prompt = rand_tokens(np.random.default_rng(8), 6)
  params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
  refused, fresh = make_llm(model, config), make_llm(model, config)
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    refused.generate([prompt, [VOCAB + 5]], params, cache_salt=["new", "other"])
  with pytest.raises(ValueError, match=r"params\[0\]\.n=9"):
    refused.generate([prompt], SamplingParams(n=9))
  assert len(refused._scheduler.salts) == 0
  # Nor one refused because a stream is open (it drew its seeds, then was refused).
  stream = refused.generate_stream([prompt], SamplingParams(max_tokens=2, seed=1))
  next(stream)
  rng = refused._scheduler._rng.bit_generator.state
  with pytest.raises(RuntimeError, match="still open"):
    refused.generate([prompt], params, cache_salt="late")
  assert refused._scheduler._rng.bit_generator.state == rng
  stream.close()
  assert ids(refused.generate([prompt], params)) == ids(fresh.generate([prompt], params))


def _poison_cache_entries(st):
  """NaN in every free block that is a prefix-cache entry."""
  m = A.cached_N(st.alloc)[None, None, :, None, None]
  cache = type(st.cache)(k_pages=jnp.where(m, jnp.nan, st.cache.k_pages),
                         v_pages=jnp.where(m, jnp.nan, st.cache.v_pages))
  return dataclasses.replace(st, cache=cache)


def test_cache_entries_are_read_only_by_confirmed_hits(model, config):
  # Fill the cache under one salt, poison every entry with NaN, then serve the same prompts
  # under another salt and new prompts: nothing poisoned is read. The control (same salt)
  # reads the poison, so the clean run is evidence, not luck.
  chat, few_shot = shared_prefix_workloads(seed=5)
  params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True)
  llm, fresh = make_llm(model, config), make_llm(model, config)
  llm.generate(chat, params, cache_salt="a")
  assert llm.stats["cached_blocks"] > 10
  llm._state = _poison_cache_entries(llm._state)
  for batch, salt in ((chat, "b"), (few_shot, "a")):
    got = llm.generate(batch, params, cache_salt=salt)
    assert ids(got) == ids(fresh.generate(batch, params, cache_salt=salt))
    assert all(np.all(np.isfinite(o.logprobs)) for o in got)
  hits = llm.stats["cached_prompt_tokens"]
  control = llm.generate(chat[:1], params, cache_salt="a")
  assert llm.stats["cached_prompt_tokens"] > hits
  assert not np.all(np.isfinite(control[0].logprobs)) or ids(control) != ids(
      fresh.generate(chat[:1], params, cache_salt="a"))


@pytest.mark.parametrize("hash_fn", [constant_hash, depth_hash])
def test_engine_with_colliding_hashes_gives_the_same_outputs(model, config, hash_fn):
  chat, few_shot = shared_prefix_workloads(seed=6)
  params = SamplingParams(max_tokens=5, ignore_eos=True)
  bad = make_llm(model, config, prefix_hash_fn=hash_fn)
  off = make_llm(model, config, enable_prefix_caching=False)
  for batch in (chat, few_shot, chat):
    assert ids(bad.generate(batch, params)) == ids(off.generate(batch, params))
    A.validate(bad.allocator_state)
  assert bad.stats["prefix_hit_rate"] > 0  # some true matches still hit


def test_engine_eviction_under_pressure_is_lru(model, config):
  # 12 blocks of 4 tokens, one sequence at a time, prompts of 17 tokens and 3 new tokens:
  # each run holds 5 blocks and leaves 4 full blocks cached (positions 0..15; the K/V of
  # positions 16..18 sit in a partial block, freed uncached).
  # Run A: blocks 0-3 cached, 4 free. Run B: takes never-used 5-9 -> B = 5-8 cached.
  # Run C: takes the uncached 10, 11, 4, 9, then evicts the LRU chain's tail: A's block 3.
  # So A again hits 3 blocks (12 tokens); it takes block 3 back and evicts B's tail
  # (B is now the LRU); B again hits 12; that run evicts C's tail; C again hits 12.
  rng = np.random.default_rng(8)
  runs = {name: rand_tokens(rng, 17) for name in "ABC"}
  params = SamplingParams(max_tokens=3, ignore_eos=True)
  opts = dict(num_blocks=12, max_seqs=1)
  llm, off = make_llm(model, config, **opts), make_llm(model, config, **opts,
                                                        enable_prefix_caching=False)
  hits = []
  for name in "ABCABC":
    before = llm.stats["cached_prompt_tokens"]
    assert ids(llm.generate([runs[name]], params)) == ids(off.generate([runs[name]], params))
    hits.append(llm.stats["cached_prompt_tokens"] - before)
    A.validate(llm.allocator_state)
  assert hits == [0, 0, 0, 12, 12, 12]


# ----------------------------------------------------------------------------- stateful


def mod3_hash(tokens_SPZ, salt_S):
  """Only three hash values: frequent collisions between different prefixes."""
  return A.chain_hashes(tokens_SPZ, salt_S) % jnp.uint32(3)


def _longest_live_chain(host, tokens, num_tokens, salt):
  """How many leading blocks of ``tokens`` (full ones among the first ``num_tokens``) a
  chain of cache entries holds, every entry hanging off the one above as it is now (parent
  id and generation), the first a root: the exact hit, by brute force over the pool."""
  z, n = host.block_size, host.num_blocks
  reached = {NB}
  for j in range(min(num_tokens // z, host.max_blocks_per_seq)):
    want = list(tokens[j * z:(j + 1) * z])
    reached = {b for b in range(n)
               if host.depth_N[b] == j and host.salt_N[b] == salt
               and host.block_tokens_NZ[b].tolist() == want
               and (host.parent_N[b] == NB if j == 0 else
                    host.parent_N[b] in reached
                    and host.parent_gen_N[b] == host.generation_N[host.parent_N[b]])}
    if not reached:
      return j
  return min(num_tokens // z, host.max_blocks_per_seq)


MN, MZ, MS, MP = 10, 3, 4, 4  # the machine's pool: Z=3, 4 sequences of at most 12 tokens
HASHES = (A.chain_hashes, constant_hash, depth_hash, mod3_hash)
_m_register = {h: jax.jit(functools.partial(A.register, hash_fn=h)) for h in HASHES}
_m_lookup = {h: jax.jit(functools.partial(A.lookup, hash_fn=h)) for h in HASHES}
_m_fork = jax.jit(A.fork)
_m_preempt = jax.jit(A.preempt)
tiny_tokens = st.lists(st.integers(1, 2), min_size=0, max_size=MP * MZ)


class PrefixCacheMachine(RuleBasedStateMachine):
  """Random append / register / lookup+attach / release / fork / preempt over tokens from a
  two-letter alphabet (so prefixes collide often), under good and colliding hashes.

  The host shadows what each physical block holds: the token prefix (from position 0) that
  its writer had when it wrote the block. Safety: every block a sequence holds always holds
  that sequence's own prefix, so a hit never attaches K/V computed after other tokens or
  under another salt, whatever the hash proposes.
  """

  @initialize(hash_index=st.integers(0, len(HASHES) - 1),
              salts=st.lists(st.integers(0, 3).map(lambda x: int(x == 3)), min_size=MS,
                             max_size=MS))
  def setup(self, hash_index, salts):
    self.hash_fn = HASHES[hash_index]
    self.salt = np.asarray(salts, np.int32)
    self.state = A.init(MN, MZ, MS, MP)
    self.toks = [[] for _ in range(MS)]  # each sequence's tokens (== its seq_len)
    self.content = {}  # block -> (prefix tuple its writer wrote, salt)
    self.seen = []  # token lists of sequences at register time (lookups draw from them)

  def _token_array(self, rows):
    out = np.zeros((MS, MP * MZ), np.int32)
    for s, row in enumerate(rows):
      out[s, :len(row)] = row
    return jnp.asarray(out)

  def _record_writes(self, s, old_len):
    table = np.asarray(self.state.block_tables)[s]
    new_len = len(self.toks[s])
    for j in range(old_len // MZ, -(-new_len // MZ)):
      self.content[int(table[j])] = (tuple(self.toks[s][:min(new_len, (j + 1) * MZ)]),
                                     int(self.salt[s]))

  @rule(data=st.data(), then_register=st.booleans())
  def append(self, data, then_register):
    new = [data.draw(st.lists(st.integers(1, 2), max_size=7)) for _ in range(MS)]
    self.state, ok = _append(self.state, i32(*[len(t) for t in new]))
    for s, (t, good) in enumerate(zip(new, np.asarray(ok).tolist())):
      if good and t:
        old = len(self.toks[s])
        self.toks[s] = self.toks[s] + t
        self._record_writes(s, old)
    if then_register:  # as the engine does after every forward
      self.register()

  @rule()
  def register(self):
    self.seen.extend(list(t) for t in self.toks if len(t) >= MZ)
    self.state = _m_register[self.hash_fn](self.state, self._token_array(self.toks),
                                           jnp.asarray(self.salt))

  @rule(data=st.data(), restart=st.lists(st.booleans(), min_size=MS, max_size=MS))
  def lookup_and_attach(self, data, restart):
    # Sequences in ``restart`` are released first (a new request in their slot). Prompts:
    # mostly tokens a sequence had when blocks were registered (a prefix that may be
    # cached) with a random tail; sometimes fresh tokens.
    self.release(restart)
    seen = st.sampled_from(self.seen) if self.seen else tiny_tokens
    prompts = [data.draw(st.one_of(seen, seen, tiny_tokens).flatmap(
        lambda t: tiny_tokens.map(lambda tail: (t + tail)[:MP * MZ]))) for _ in range(MS)]
    empty = [len(t) == 0 for t in self.toks]
    num = i32(*[len(p) if e else 0 for p, e in zip(prompts, empty)])
    blocks, hit = _m_lookup[self.hash_fn](self.state, self._token_array(prompts), num,
                                          jnp.asarray(self.salt))
    if self.hash_fn is A.chain_hashes:  # no bucket lost in a pool this small: exact
      host = jax.device_get(self.state)
      want = [_longest_live_chain(host, p, n, salt)
              for p, n, salt in zip(prompts, np.asarray(num).tolist(), self.salt.tolist())]
      assert np.asarray(hit).tolist() == want, (np.asarray(hit).tolist(), want, prompts)
    self.state, ok = _attach(self.state, blocks, hit)
    blocks, hit = np.asarray(blocks), np.asarray(hit)
    for s in range(MS):
      if not empty[s] or not hit[s]:
        continue
      assert bool(ok[s])
      k = int(hit[s])
      for j in range(k):  # the safety property: this prefix, this salt
        assert self.content[int(blocks[s, j])] == (tuple(prompts[s][:(j + 1) * MZ]),
                                                   int(self.salt[s]))
      self.toks[s] = list(prompts[s][:k * MZ])
    hypothesis.event("lookup hit", str(bool(hit.any())))
    hypothesis.event("hit blocks", str(int(hit.max())))

  @rule(mask=st.lists(st.booleans(), min_size=MS, max_size=MS))
  def release(self, mask):
    self.state = _release(self.state, jnp.asarray(mask))
    for s, m in enumerate(mask):
      if m:
        self.toks[s] = []

  @rule(src=st.integers(0, MS - 1), dst=st.integers(0, MS - 1))
  def fork(self, src, dst):
    self.state, ok, csrc, cdst = _m_fork(self.state, i32(src), i32(dst))
    if bool(ok[0]):  # dst becomes a copy of src, its salt included (one request's samples)
      self.toks[dst] = list(self.toks[src])
      self.salt[dst] = self.salt[src]
      if int(cdst[0]) >= 0:  # KVCache.copy_blocks copies the tail block's content
        self.content[int(cdst[0])] = self.content[int(csrc[0])]

  @rule(prio=st.lists(st.integers(0, 2), min_size=MS, max_size=MS),
        needed=st.integers(0, MN))
  def preempt(self, prio, needed):
    self.state, pre = _m_preempt(self.state, i32(*prio), jnp.int32(needed))
    for s, p in enumerate(np.asarray(pre).tolist()):
      if p:
        self.toks[s] = []

  @invariant()
  def blocks_hold_their_owners_prefix(self):
    if not hasattr(self, "state"):
      return
    host = jax.device_get(self.state)
    A.validate(host)
    assert host.seq_lens.tolist() == [len(t) for t in self.toks]
    for s in range(MS):
      for j in range(-(-len(self.toks[s]) // MZ)):
        b = int(host.block_tables[s, j])
        want = tuple(self.toks[s][:min(len(self.toks[s]), (j + 1) * MZ)])
        assert self.content[b] == (want, int(self.salt[s])), (s, j, b)
    for b in np.flatnonzero(host.depth_N >= 0):  # cache entries: full, stored tokens right
      prefix, salt = self.content[int(b)]
      assert len(prefix) == (int(host.depth_N[b]) + 1) * MZ and salt == host.salt_N[b]
      assert host.block_tokens_NZ[b].tolist() == list(prefix[-MZ:])
    if self.hash_fn is A.chain_hashes:  # a good hash loses no bucket in a pool this small
      # One entry per prefix: no two live entries with one parent (as it is now), salt
      # and tokens (a child of an evicted parent is stale, not a duplicate).
      keys = [(int(host.depth_N[b]), int(host.parent_N[b]), int(host.salt_N[b]),
               tuple(host.block_tokens_NZ[b].tolist()))
              for b in np.flatnonzero(host.depth_N >= 0)
              if host.parent_N[b] < 0
              or host.parent_gen_N[b] == host.generation_N[host.parent_N[b]]]
      assert len(keys) == len(set(keys)), keys


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = hypothesis.settings(
    max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck))


@pytest.mark.slow
def test_prefix_cache_machine_long():
  run_state_machine_as_test(
      PrefixCacheMachine,
      settings=hypothesis.settings(max_examples=120, stateful_step_count=60, deadline=None,
                                   suppress_health_check=list(hypothesis.HealthCheck)))


def _same_chain_hash(tokens_SPZ, salt_S):
  """chain_hashes under another name: lookup and register then walk the whole rows."""
  return A.chain_hashes(tokens_SPZ, salt_S)


@pytest.mark.parametrize("windows,window", [
    ((None,), 2), pytest.param((None,), 3, marks=pytest.mark.slow),
    pytest.param((None, 4), 2, marks=pytest.mark.slow), ((3, None), 3)])
def test_register_in_a_window_and_short_lookups_equal_the_whole_rows(monkeypatch, windows,
                                                                     window):
  # register(window=w) walks only the w levels past each sequence's last registered block,
  # continuing the chain hash from that block's key, when every pending sequence fits
  # (else the whole rows): on random appends, releases, hits and forks over three shared
  # prompts (many cached prefixes, forks registering the same block), both register the
  # same blocks with the same keys, links and tokens, and the window is taken often.
  s_, z, p, n = 4, 2, 10, 28
  monkeypatch.setattr(A, "_NARROW_WALK_FROM", 0)  # P = 10 walks narrowly too
  fork = jax.jit(A.fork)
  register_window = jax.jit(lambda *args: A.register(*args, window=window))
  lookup = jax.jit(lambda *args: A.lookup(*args))  # traced here, with the constant patched
  names = ("block_hash_N", "depth_N", "parent_N", "parent_gen_N", "salt_N",
           "block_tokens_NZ", "group_N", "beside_gN", "clock", "ref_counts", "block_tables")
  anchor = list(windows).index(None)
  in_window = narrow = 0
  for seed in range(3):
    rng = np.random.default_rng(seed)
    state = A.init(n, z, s_, p, windows=windows)
    prompts = [rng.integers(1, 3, p * z) for _ in range(3)]
    tokens = np.stack([prompts[rng.integers(3)] for _ in range(s_)]).astype(np.int32)
    salt = jnp.asarray(rng.integers(0, 2, s_), jnp.int32)
    for _ in range(40):
      r = rng.random()
      if r < 0.5:
        state, _ = _append(state, jnp.asarray(rng.integers(0, 5, s_), jnp.int32))
        t = np.asarray(state.block_tables)
        t = t if t.ndim == 2 else t[anchor]
        full = np.asarray(state.seq_lens) // z
        own = ((t >= 0) & (np.asarray(state.depth_N)[np.clip(t, 0, n - 1)] >= 0)
               & (np.arange(p) < full[:, None]))
        after = np.max(np.where(own, np.arange(p) + 1, 0), axis=1)
        in_window += bool(np.any(full > after) and np.all(full - after <= window))
        whole = _register(state, tokens, salt)
        state = register_window(state, tokens, salt)
        for name in names:
          np.testing.assert_array_equal(getattr(state, name), getattr(whole, name), name)
      elif r < 0.65:
        gone = rng.random(s_) < 0.4
        state = _release(state, jnp.asarray(gone))
        for i in np.flatnonzero(gone):
          tokens[i] = prompts[rng.integers(3)]
          tokens[i, rng.integers(p * z):] = rng.integers(1, 3)
      elif r < 0.8:
        limit = jnp.asarray(rng.integers(0, p * z, s_) // rng.choice([1, 3]), jnp.int32)
        hit, k = lookup(state, tokens, limit, salt)
        # lookup walks the first max(8, P // 16) levels only when no row may match further:
        # the same hit as the whole rows' walk (an equal hash that is not chain_hashes).
        whole_hit, whole_k = _lookup(state, tokens, limit, salt, hash_fn=_same_chain_hash)
        np.testing.assert_array_equal(hit, whole_hit)
        np.testing.assert_array_equal(k, whole_k)
        narrow += int(np.max(np.asarray(limit) // z) <= 8)
        state, _ = _attach(state, hit, k)
      else:
        src, dst = (int(x) for x in rng.integers(0, s_, 2))
        state, ok, _, _ = fork(state, i32(src), i32(dst))
        if bool(ok[0]):
          tokens[dst], salt = tokens[src], salt.at[dst].set(salt[src])
  assert in_window >= 20 and narrow >= 5, (in_window, narrow)
