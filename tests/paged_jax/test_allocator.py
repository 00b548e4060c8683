"""paged_jax.allocator: hand-computed cases, jit/trace/transfer checks, and a stateful
hypothesis test against a plain-Python model allocator."""

from __future__ import annotations

import dataclasses
import re

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

NB = A.NO_BLOCK
# Jitted once per shape and shared by every test (setup steps and the state machine).
_append = jax.jit(A.append)
_release = jax.jit(A.release)
_fork = jax.jit(A.fork)
_preempt = jax.jit(A.preempt)
_slots = jax.jit(A.slots)
_utilization = jax.jit(A.utilization)


def i32(*xs):
  return jnp.asarray(xs, jnp.int32)


def bools(*xs):
  return jnp.asarray(xs, jnp.bool_)


def tables(state) -> list[list[int]]:
  return np.asarray(state.block_tables).tolist()


def assert_same_state(a: A.AllocatorState, b: A.AllocatorState) -> None:
  """Equal allocation state (the clock may differ: every op ticks it)."""
  for name in ("block_tables", "seq_lens", "ref_counts", "num_free"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# ----------------------------------------------------------------------------- init


@pytest.mark.parametrize("arg", ["num_blocks", "block_size", "max_seqs", "max_blocks_per_seq"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_init_rejects_bad_sizes(arg, bad):
  kwargs = dict(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=4)
  kwargs[arg] = bad
  with pytest.raises(ValueError, match=rf"^{arg}={re.escape(repr(bad))} must be an int > 0"):
    A.init(**kwargs)


def test_init_rejects_int32_overflow():
  with pytest.raises(ValueError, match="num_blocks \\* block_size"):
    A.init(num_blocks=2**20, block_size=2**12, max_seqs=1, max_blocks_per_seq=1)
  with pytest.raises(ValueError, match="max_blocks_per_seq \\* block_size"):
    A.init(num_blocks=1, block_size=2**12, max_seqs=1, max_blocks_per_seq=2**20)


def test_init_is_empty_and_valid():
  s = A.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=4)
  A.validate(s)
  assert s.block_size == 4 and s.num_blocks == 8 and s.max_seqs == 3
  assert s.max_blocks_per_seq == 4 and int(s.num_free) == 8
  assert tables(s) == [[NB] * 4] * 3
  # A pytree of 15 arrays (6 for allocation, 9 for the prefix cache); block_size is static
  # metadata, not a leaf.
  assert len(jax.tree_util.tree_leaves(s)) == 15
  assert int(A.num_cached(s)) == 0 and np.all(np.asarray(s.depth_N) == -1)
  assert jax.tree_util.tree_map(lambda x: x, s).block_size == 4


# ----------------------------------------------------------------------------- ops, by hand
# Two pools only, so the jitted ops compile once per shape for the whole file:
# big() = 8 blocks, small() = 4 blocks; both Z=4, S=4, P=4 (at most 16 tokens a sequence).


def big():
  return A.init(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4)


def small():
  return A.init(num_blocks=4, block_size=4, max_seqs=4, max_blocks_per_seq=4)


class EagerAndJitTest(chex.TestCase):
  """The same hand cases with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_append_assigns_blocks_in_free_order(self):
    append = self.variant(A.append)
    s = big()
    # seq 0: ceil(5/4)=2 blocks -> free-order ranks [0, 2) = blocks 0, 1;
    # seq 1: ceil(3/4)=1 block  -> rank 2 = block 2; seqs 2, 3: no block. 8-3=5 free.
    s, ok = append(s, i32(5, 3, 0, 0))
    A.validate(s)
    np.testing.assert_array_equal(ok, [True] * 4)
    assert tables(s) == [[0, 1, NB, NB], [2, NB, NB, NB], [NB] * 4, [NB] * 4]
    np.testing.assert_array_equal(s.seq_lens, [5, 3, 0, 0])
    np.testing.assert_array_equal(s.ref_counts, [1, 1, 1, 0, 0, 0, 0, 0])
    assert int(s.num_free) == 5
    # seq 0: 5+3=8 tokens still fit 2 blocks (0 new); seq 1: 3+2=5 -> 2 blocks (1 new: 3);
    # seq 2: 9 tokens -> 3 blocks (4, 5, 6). 5-4=1 free.
    s, ok = append(s, i32(3, 2, 9, 0))
    A.validate(s)
    np.testing.assert_array_equal(ok, [True] * 4)
    assert tables(s) == [[0, 1, NB, NB], [2, 3, NB, NB], [4, 5, 6, NB], [NB] * 4]
    assert int(s.num_free) == 1

  @chex.variants(with_jit=True)
  def test_slots_and_padding(self):
    slots = self.variant(A.slots)
    s = big()
    s, _ = _append(s, i32(2, 3, 0, 0))  # seq 0 -> block 0, seq 1 -> block 1
    s, _ = _append(s, i32(4, 0, 0, 0))  # seq 0: 6 tokens -> blocks 0, 2
    assert tables(s)[0] == [0, 2, NB, NB]
    # seq 0 pos 5: block 2, offset 1 -> 2*4+1 = 9; seq 1 pos 2: 1*4+2 = 6; seq 0 pos 0 -> 0.
    got = slots(s, i32(0, 1, 0), i32(5, 2, 0))
    np.testing.assert_array_equal(got, [9, 6, 0])
    # Padding: pos 6 >= seq_len 6 (inside block 2 but not live), pos -1, empty seq 2,
    # seq ids -1 and 4 (out of range), pos 16 beyond the table. None clamps to a real slot.
    got = slots(s, i32(0, 0, 2, -1, 4, 0), i32(6, -1, 0, 0, 0, 16))
    assert np.all(np.asarray(got) < 0)
    # Broadcasting: one sequence, a [2, 3] grid of positions.
    got = slots(s, jnp.int32(0), jnp.arange(6, dtype=jnp.int32).reshape(2, 3))
    np.testing.assert_array_equal(got, [[0, 1, 2], [3, 8, 9]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_release_returns_blocks_least_recently_used_first(self):
    release = self.variant(A.release)
    s = small()
    s, _ = _append(s, i32(1, 1, 1, 0))  # clock 0: blocks 0, 1, 2 (block 3 keeps stamp 0)
    s = release(s, bools(False, True, False, False))  # clock 1: block 1 freed, stamp 1
    A.validate(s)
    assert tables(s)[1] == [NB] * 4 and int(s.seq_lens[1]) == 0
    s = release(s, bools(True, False, False, False))  # clock 2: block 0 freed, stamp 2
    A.validate(s)
    np.testing.assert_array_equal(s.ref_counts, [0, 0, 1, 0])
    assert int(s.num_free) == 3
    # Free order by (last_used, id): block 3 (0), block 1 (1), block 0 (2).
    s, ok = _append(s, i32(12, 0, 0, 0))
    assert bool(ok[0]) and tables(s)[0] == [3, 1, 0, NB]
    s = release(s, bools(True, True, True, True))
    A.validate(s)
    assert int(s.num_free) == 4 and not np.any(np.asarray(s.ref_counts))


def test_append_all_or_nothing_when_out_of_blocks():
  s = small()
  # Demand in blocks: [2, 3, 0, 1] with 4 free. Running sum 2 <= 4 ok; 2+3=5 > 4 fails;
  # seq 2 needs none: ok; seq 3 runs to 6 > 4: fails (the documented slot-order prefix rule,
  # though 1 block would still fit).
  before = s
  s, ok = _append(s, i32(5, 12, 0, 1))
  A.validate(s)
  np.testing.assert_array_equal(ok, [True, False, True, False])
  np.testing.assert_array_equal(s.seq_lens, [5, 0, 0, 0])
  assert tables(s)[1:] == tables(before)[1:]
  assert int(s.num_free) == 2
  # 2 free, seq 1 asks for 3 -> refused, nothing changes.
  s2, ok = _append(s, i32(0, 12, 0, 0))
  A.validate(s2)
  np.testing.assert_array_equal(ok, [True, False, True, True])
  assert_same_state(s, s2)
  # When the total demand fits (1 + 1 = 2 free), everyone gets blocks.
  s3, ok = _append(s, i32(0, 4, 0, 3))
  A.validate(s3)
  np.testing.assert_array_equal(ok, [True] * 4)
  assert int(s3.num_free) == 0


def test_zero_and_in_block_requests_always_ok():
  s = small()
  s, ok = _append(s, i32(9, 4, 0, 0))  # 3 + 1 = 4 blocks: the pool is full
  np.testing.assert_array_equal(ok, [True] * 4)
  assert int(s.num_free) == 0
  # No free block: 0 tokens are ok; seq 0 holds 9 tokens in 3 blocks (3 spare slots): +3 ok.
  # seq 3 needs a block for its first token: refused.
  s, ok = _append(s, i32(3, 0, 0, 1))
  A.validate(s)
  np.testing.assert_array_equal(ok, [True, True, True, False])
  np.testing.assert_array_equal(s.seq_lens, [12, 4, 0, 0])
  s, ok = _append(s, i32(0, 0, 0, 0))
  np.testing.assert_array_equal(ok, [True] * 4)


@pytest.mark.parametrize("call", [
    lambda st: A.validate(st), lambda st: A.append(st, jnp.zeros(2, jnp.int32)),
    lambda st: A.release(st, jnp.zeros(2, bool)), lambda st: A.utilization(st),
    lambda st: A.register(st, jnp.zeros((2, 16), jnp.int32))])
@pytest.mark.parametrize("bad", [{}, None, "state"])
def test_an_operation_on_something_else_than_a_state_names_it(call, bad):
  # A dict or None was an AttributeError from deep inside ("'dict' object has no
  # attribute 'block_tables'").
  with pytest.raises(ValueError, match=f"state={type(bad).__name__} must be a paged_jax."
                                       "allocator.AllocatorState"):
    call(bad)


def test_append_refuses_negative_and_too_long():
  s = big()
  s, _ = _append(s, i32(3, 3, 0, 0))
  before = s
  # P * Z = 16 tokens max: 3+14=17 too long; -1 negative; int32 max must not overflow;
  # 5 -> 2 blocks ok.
  s, ok = _append(s, i32(14, -1, 2**31 - 1, 5))
  A.validate(s)
  np.testing.assert_array_equal(ok, [False, False, False, True])
  np.testing.assert_array_equal(s.seq_lens, [3, 3, 0, 5])
  assert tables(s)[:3] == tables(before)[:3]
  # Exactly P * Z = 16 tokens is allowed: seq 0 takes 3 more blocks of the 4 free; seq 2
  # would need 4 more (3 + 4 = 7 > 4): refused.
  s, ok = _append(s, i32(13, 0, 16, 0))
  np.testing.assert_array_equal(ok, [True, True, False, True])
  np.testing.assert_array_equal(s.seq_lens, [16, 3, 0, 5])


def test_fork_shares_full_blocks_and_copies_partial():
  s = big()
  s, _ = _append(s, i32(6, 0, 0, 0))  # seq 0: 6 tokens = full block 0 + partial block 1
  # Two forks of seq 0 (n=2 sampling): block 0 shared by 3 holders; the partial block 1 is
  # copied into free blocks 2 and 3.
  s, ok, csrc, cdst = _fork(s, i32(0, 0), i32(1, 3))
  A.validate(s)
  np.testing.assert_array_equal(ok, [True, True])
  np.testing.assert_array_equal(csrc, [1, 1])
  np.testing.assert_array_equal(cdst, [2, 3])
  assert tables(s) == [[0, 1, NB, NB], [0, 2, NB, NB], [NB] * 4, [0, 3, NB, NB]]
  np.testing.assert_array_equal(s.seq_lens, [6, 6, 0, 6])
  np.testing.assert_array_equal(s.ref_counts, [3, 1, 1, 1, 0, 0, 0, 0])
  assert int(s.num_free) == 4
  # Appending to the source writes into its own tail (block 1), never a shared one.
  s, ok = _append(s, i32(2, 0, 0, 0))
  assert bool(ok[0]) and tables(s)[0] == [0, 1, NB, NB]
  A.validate(s)
  # Forking a sequence of full blocks only (8 tokens) copies nothing.
  s, ok, csrc, cdst = _fork(s, i32(0, 0), i32(2, 2 + 4))  # the second dst is out of range
  A.validate(s)
  np.testing.assert_array_equal(ok, [True, False])
  np.testing.assert_array_equal(csrc, [NB, NB])
  np.testing.assert_array_equal(cdst, [NB, NB])
  assert tables(s)[2] == [0, 1, NB, NB]
  np.testing.assert_array_equal(s.ref_counts[:2], [4, 2])


def test_fork_fails_cleanly():
  s = small()
  s, _ = _append(s, i32(6, 8, 0, 0))  # seq 0: blocks 0, 1 (partial); seq 1: 2, 3 (full)
  assert int(s.num_free) == 0
  before = s
  # Out of blocks: seq 0's partial tail cannot be copied. Seq 1 (full blocks) forks fine.
  s, ok, csrc, cdst = _fork(s, i32(0, 1), i32(2, 3))
  A.validate(s)
  np.testing.assert_array_equal(ok, [False, True])
  np.testing.assert_array_equal(csrc, [NB, NB])
  np.testing.assert_array_equal(cdst, [NB, NB])
  assert tables(s)[2] == [NB] * 4 and int(s.seq_lens[2]) == 0
  assert tables(s)[3] == [2, 3, NB, NB]
  # Invalid pairs: (dst not empty, src == dst), (src out of range, dst out of range),
  # (src negative, dst negative), (duplicate dst: both fail).
  for src_F, dst_F in [((1, 1), (0, 1)), ((4, 1), (2, 7)), ((-1, 1), (2, -2)), ((1, 1), (3, 3))]:
    s, ok, csrc, cdst = _fork(before, i32(*src_F), i32(*dst_F))
    np.testing.assert_array_equal(ok, [False, False])
    np.testing.assert_array_equal(csrc, [NB, NB])
    assert_same_state(s, before)
  # Empty batch.
  s, ok, csrc, cdst = _fork(before, jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32))
  assert ok.shape == csrc.shape == cdst.shape == (0,)
  assert_same_state(s, before)


def test_fork_batch_reads_state_before_the_call():
  s = big()
  s, _ = _append(s, i32(5, 0, 0, 0))  # seq 0: blocks 0, 1 (1 token in block 1)
  # Fork 0 -> 1 and 1 -> 2 in one batch: seq 1 is empty before the call, so seq 2 becomes
  # an (empty) copy of an empty sequence. Only the first fork copies a block (1 -> 2).
  s, ok, csrc, cdst = _fork(s, i32(0, 1), i32(1, 2))
  A.validate(s)
  np.testing.assert_array_equal(ok, [True, True])
  np.testing.assert_array_equal(csrc, [1, NB])
  np.testing.assert_array_equal(cdst, [2, NB])
  np.testing.assert_array_equal(s.seq_lens, [5, 5, 0, 0])


def test_preempt_by_priority_stops_when_enough():
  s = big()
  s, _ = _append(s, i32(8, 4, 12, 0))  # seq 0: 2 blocks, seq 1: 1, seq 2: 3 -> 2 free
  # Priorities: seq 1 (0) goes first, then seq 2 (1), then seq 0 (5); seq 3 holds nothing.
  prio = i32(5, 0, 1, -9)
  s2, pre = _preempt(s, prio, jnp.int32(3))  # 2 free + 1 from seq 1 = 3: stop there
  A.validate(s2)
  np.testing.assert_array_equal(pre, [False, True, False, False])
  assert int(s2.num_free) == 3
  s2, pre = _preempt(s, prio, jnp.int32(4))  # 3 is not enough; + seq 2's 3 = 6
  np.testing.assert_array_equal(pre, [False, True, True, False])
  assert int(s2.num_free) == 6
  s2, pre = _preempt(s, prio, jnp.int32(2))  # already enough free: nothing released
  np.testing.assert_array_equal(pre, [False] * 4)
  assert_same_state(s, s2)
  s2, pre = _preempt(s, prio, jnp.int32(100))  # never enough: every sequence with blocks
  A.validate(s2)
  np.testing.assert_array_equal(pre, [True, True, True, False])
  assert int(s2.num_free) == 8


def test_preempt_ties_go_higher_slot_first():
  s = small()
  s, _ = _append(s, i32(1, 1, 1, 0))  # blocks 0, 1, 2; 1 free
  s2, pre = _preempt(s, i32(0, 0, 0, 0), jnp.int32(2))  # one more block: the highest slot
  np.testing.assert_array_equal(pre, [False, False, True, False])
  s2, pre = _preempt(s, i32(0, 0, 0, 0), jnp.int32(3))
  np.testing.assert_array_equal(pre, [False, True, True, False])


def test_preempt_counts_shared_blocks_once_freed():
  s = big()
  s, _ = _append(s, i32(9, 0, 0, 0))  # seq 0: full 0, 1 + partial 2
  s, ok, _, _ = _fork(s, i32(0), i32(1))  # seq 1: 0, 1 shared + copy 3
  s, _ = _append(s, i32(0, 0, 4, 0))  # seq 2: block 4; 3 free
  assert tables(s)[:3] == [[0, 1, 2, NB], [0, 1, 3, NB], [4, NB, NB, NB]]
  # Order: seq 0 (prio 0), seq 1 (1), seq 2 (2). Releasing seq 0 frees only block 2
  # (0 and 1 are still held by seq 1): 3 + 1 = 4 free. Adding seq 1 frees 3, 0, 1: 7.
  prio = i32(0, 1, 2, 3)
  s2, pre = _preempt(s, prio, jnp.int32(4))
  np.testing.assert_array_equal(pre, [True, False, False, False])
  assert int(s2.num_free) == 4
  np.testing.assert_array_equal(s2.ref_counts[:2], [1, 1])
  s2, pre = _preempt(s, prio, jnp.int32(5))  # 4 is not enough; with seq 1: 7 >= 5
  A.validate(s2)
  np.testing.assert_array_equal(pre, [True, True, False, False])
  assert int(s2.num_free) == 7


def test_utilization():
  s = big()
  assert float(_utilization(s)) == 1.0  # nothing in use: defined as 1.0
  s, _ = _append(s, i32(5, 4, 1, 0))  # 2 + 1 + 1 = 4 blocks = 16 slots, 5 + 4 + 1 = 10 tokens
  np.testing.assert_allclose(_utilization(s), 10 / 16)
  s = _release(s, bools(False, False, True, False))  # 3 blocks = 12 slots, 9 tokens
  np.testing.assert_allclose(_utilization(s), 9 / 12)
  # Seq 2 forks seq 1 and shares its full block: still 3 distinct blocks and 9 stored tokens.
  s, ok, _, _ = _fork(s, i32(1), i32(2))
  assert bool(ok[0]) and int(s.num_free) == 5
  np.testing.assert_allclose(_utilization(s), 9 / 12)
  # Bound: waste <= (Z - 1) per sequence. 4 sequences of 1 token: 4 tokens in 4 blocks.
  s, _ = _append(big(), i32(1, 1, 1, 1))
  np.testing.assert_allclose(_utilization(s), 4 / 16)
  assert float(_utilization(s)) >= 1 - 4 * (4 - 1) / (4 * 4)


# ----------------------------------------------------------------------------- validate


def test_validate_catches_corruption():
  s, _ = _append(small(), i32(5, 4, 0, 0))  # seq 0: 0, 1; seq 1: 2
  A.validate(s)
  t = np.asarray(s.block_tables)
  rc = np.asarray(s.ref_counts)

  def bad(match, **fields):
    fields = {k: jnp.asarray(v) for k, v in fields.items()}
    with pytest.raises(ValueError, match=match):
      A.validate(dataclasses.replace(s, **fields))

  t2 = t.copy(); t2[0, 1] = 4
  bad(r"block_tables\[0, 1\]=4 must be NO_BLOCK=-1 or in \[0, num_blocks=4\)", block_tables=t2)
  t2 = t.copy(); t2[0, 1] = -2
  bad(r"block_tables\[0, 1\]=-2 must be NO_BLOCK", block_tables=t2)
  t2 = t.copy(); t2[0, 2] = 3
  bad(r"row 0 with seq_lens\[0\]=5 must hold exactly ceil\(5 / 4\)=2", block_tables=t2)
  bad(r"seq_lens\[1\]=17 must be in \[0, P \* Z=16\]", seq_lens=i32(5, 17, 0, 0))
  t2 = t.copy(); t2[0, 1] = 0
  bad(r"names a block twice", block_tables=t2)
  rc2 = rc.copy(); rc2[3] = 1
  bad(r"ref_counts\[3\]=1 but 0 block-table entries name block 3", ref_counts=rc2)
  bad(r"num_free=2 \+ blocks in use=3 must equal num_blocks=4", num_free=jnp.int32(2))
  t2 = t.copy(); t2[1, 0] = 1  # seq 1 now shares seq 0's partial block 1
  rc2 = rc.copy(); rc2[1], rc2[2] = 2, 0
  bad(r"partial last block 1 of sequence 0 has ref_counts\[1\]=2",
      block_tables=t2, ref_counts=rc2, num_free=jnp.int32(2))
  bad(r"last_used\[0\]=7 must be in \[0, clock=1\]", last_used=i32(7, 0, 0, 0))
  bad(r"last_used.shape=\(3,\) must be \(4,\)", last_used=i32(0, 0, 0))


def test_static_shape_errors():
  s = small()
  with pytest.raises(ValueError, match=r"num_new_tokens.shape=\(3,\) must be \(4,\)"):
    A.append(s, i32(1, 2, 3))
  with pytest.raises(ValueError, match="num_new_tokens.dtype=float32"):
    A.append(s, jnp.ones(4, jnp.float32))
  with pytest.raises(ValueError, match="mask.dtype=int32 must be bool"):
    A.release(s, i32(1, 0, 0, 0))
  with pytest.raises(ValueError, match=r"dst.shape=\(2,\) must be \(1,\)"):
    A.fork(s, i32(0), i32(0, 1))
  with pytest.raises(ValueError, match=r"src.shape=\(1, 1\) must be rank 1"):
    A.fork(s, jnp.zeros((1, 1), jnp.int32), i32(0))
  with pytest.raises(ValueError, match="priority.shape"):
    A.preempt(s, i32(0), 1)
  with pytest.raises(ValueError, match="needed"):
    A.preempt(s, i32(0, 1, 2, 3), i32(1, 2))
  with pytest.raises(ValueError, match="positions.dtype"):
    A.slots(s, i32(0), jnp.zeros(1))
  with pytest.raises(ValueError, match=r"seq_ids.shape=\(2,\) and positions.shape=\(3,\)"):
    A.slots(s, i32(0, 1), i32(0, 1, 2))


@pytest.mark.parametrize("call", [
    lambda s, big: A.append(s, np.array([big, 0, 0, 0], np.int64)),
    lambda s, big: A.preempt(s, i32(0, 1, 2, 3), np.int64(big)),
    lambda s, big: A.fork(s, np.array([big], np.int64), i32(1)),
    lambda s, big: A.slots(s, np.array([0], np.int64), np.array([big], np.int64)),
])
def test_host_integers_beyond_int32_are_refused_not_wrapped(call):
  # Without x64, jnp.asarray would wrap 2**32 + 1 to 1: a request of one token, a fork of
  # sequence 1. Host values that do not fit int32 are a ValueError naming the argument.
  with pytest.raises(ValueError, match=r"holds 4294967297, which does not fit int32"):
    call(small(), 2**32 + 1)
  with pytest.raises(ValueError, match=r"holds -4294967297"):
    call(small(), -(2**32 + 1))


@pytest.mark.parametrize("call", [
    lambda s, big: A.append(s, [big, 0, 0, 0]),
    lambda s, big: A.preempt(s, i32(0, 1, 2, 3), big),
    lambda s, big: A.fork(s, [big], i32(1)),
])
def test_python_ints_beyond_int64_are_refused_by_name(call):
  # NumPy keeps a Python int past int64 as an object: the range check passed it over, and
  # JAX's conversion failed with "OverflowError: Python int too large to convert to C long".
  for big in (2**70, -(2**70)):
    with pytest.raises(ValueError, match=rf"holds {big}, which does not fit int32"):
      call(small(), big)


def test_clock_is_rebased_before_it_can_wrap():
  # A state whose clock is about to reach 2**30 (a server running for months): append
  # shifts the clock and every stamp down together, the recent stamps keep their order
  # (older ones tie at 0) and the state stays valid, so LRU eviction never inverts.
  s, _ = _append(small(), i32(1, 1, 1, 0))  # blocks 0, 1, 2 held
  s = dataclasses.replace(s, clock=jnp.int32(2**30 - 1),
                          last_used=i32(5, 2**30 - 4, 2**30 - 2, 2**30 - 3))
  s = _release(s, bools(False, True, True, False))  # clock 2**30 - 1: blocks 1, 2 freed
  A.validate(s)
  assert int(s.clock) == 2**30
  s, ok = _append(s, i32(0, 0, 0, 4))  # rebases first: stamps shift by 2**30 - 2**20
  A.validate(s)
  assert bool(ok[3]) and 0 < int(s.clock) <= 2**20 + 1
  shift = 2**30 - 2**20
  # Block 3 (stamp 2**30 - 3 - shift) was the least recently freed: it is taken first.
  assert tables(s)[3] == [3, NB, NB, NB]
  assert np.asarray(s.last_used).tolist()[:3] == [0, 2**30 - 1 - shift, 2**30 - 1 - shift]


# ----------------------------------------------------------------------------- jit hygiene


def _ops():
  return {
      "append": (A.append, lambda s, r: (s, jnp.asarray(r.integers(-1, 9, 4), jnp.int32))),
      "release": (A.release, lambda s, r: (s, jnp.asarray(r.random(4) < 0.3))),
      "fork": (A.fork, lambda s, r: (s, jnp.asarray(r.integers(0, 4, 2), jnp.int32),
                                     jnp.asarray(r.integers(0, 4, 2), jnp.int32))),
      "preempt": (A.preempt, lambda s, r: (s, jnp.asarray(r.integers(0, 3, 4), jnp.int32),
                                           jnp.int32(r.integers(0, 10)))),
      "slots": (A.slots, lambda s, r: (s, jnp.asarray(r.integers(-1, 5, 6), jnp.int32),
                                       jnp.asarray(r.integers(-1, 10, 6), jnp.int32))),
      "utilization": (A.utilization, lambda s, r: (s,)),
  }


@pytest.mark.parametrize("name", list(_ops()))
def test_ops_trace_once_and_make_no_host_transfer(name):
  fn, make_args = _ops()[name]
  jitted = jax.jit(chex.assert_max_traces(fn, n=1))
  rng = np.random.default_rng(0)
  state, _ = _append(big(), i32(3, 2, 0, 5))
  for _ in range(4):  # changing values, fixed shapes: one trace
    args = make_args(state, rng)
    with jax.transfer_guard("disallow"):
      out = jitted(*args)
    if isinstance(out, tuple) and isinstance(out[0], A.AllocatorState):
      state = out[0]
      A.validate(state)


@pytest.mark.parametrize("name", ["append", "release", "fork", "preempt", "slots"])
def test_no_loops_in_jaxpr(name):
  fn, make_args = _ops()[name]
  state = big()
  text = str(jax.make_jaxpr(fn)(*make_args(state, np.random.default_rng(0))))
  # No op loops. fork may branch once: the selection of the blocks taken runs only when
  # the oldest free blocks do not suffice (``_take``; in a pool of more than _SELECT_MAX
  # blocks, once more to sort it for more than that); append branches twice more: the pass
  # over the pool runs only when some block is taken, the clock's rebase only past 2**30.
  for prim in ("while", "scan"):
    assert not re.search(rf"\b{prim}\[", text), f"{name} has a {prim} loop:\n{text}"
  max_conds = {"append": 3, "fork": 1}.get(name, 0)
  assert len(re.findall(r"\bcond\[", text)) <= max_conds, text


# ----------------------------------------------------------------------------- model


class ModelAllocator:
  """The allocator's documented semantics, sequential and in plain Python lists."""

  def __init__(self, num_blocks, block_size, max_seqs, max_blocks_per_seq):
    self.n, self.z, self.s, self.p = num_blocks, block_size, max_seqs, max_blocks_per_seq
    self.tables = [[] for _ in range(max_seqs)]
    self.lens = [0] * max_seqs
    self.rc = [0] * num_blocks
    self.last = [0] * num_blocks
    self.clock = 0

  def num_free(self):
    return sum(r == 0 for r in self.rc)

  def free_order(self):
    return sorted((b for b in range(self.n) if self.rc[b] == 0), key=lambda b: (self.last[b], b))

  def _blocks(self, length):
    return -(-length // self.z)

  def append(self, n_S):
    free, taken, blocked, ok = self.free_order(), 0, False, []
    for s, n in enumerate(n_S):
      if n < 0 or self.lens[s] + n > self.p * self.z:
        ok.append(False)
        continue
      need = self._blocks(self.lens[s] + n) - self._blocks(self.lens[s])
      if need and (blocked or taken + need > len(free)):
        blocked = True
        ok.append(False)
        continue
      for b in free[taken:taken + need]:
        self.tables[s].append(b)
        self.rc[b], self.last[b] = 1, self.clock
      taken += need
      self.lens[s] += n
      ok.append(True)
    self.clock += 1
    return ok

  def _drop(self, s):
    for b in self.tables[s]:
      self.rc[b] -= 1
      if self.rc[b] == 0:
        self.last[b] = self.clock
    self.tables[s], self.lens[s] = [], 0

  def release(self, mask_S):
    for s, m in enumerate(mask_S):
      if m:
        self._drop(s)
    self.clock += 1

  def fork(self, src_F, dst_F):
    pre_tables, pre_lens = [list(t) for t in self.tables], list(self.lens)
    free, taken, blocked = self.free_order(), 0, False
    uses = [sum(d == x for x in dst_F) for d in range(self.s)]
    results = []  # (ok, copy_src, copy_dst) per fork
    for src, dst in zip(src_F, dst_F):
      valid = (0 <= src < self.s and 0 <= dst < self.s and src != dst and pre_lens[dst] == 0
               and not pre_tables[dst] and uses[dst] == 1)
      length = pre_lens[src] if valid else 0
      full, partial = length // self.z, length % self.z != 0
      if valid and partial and (blocked or taken >= len(free)):
        blocked, valid = True, False
      if not valid:
        results.append((False, NB, NB))
        continue
      row = pre_tables[src][:full]
      for b in row:
        self.rc[b] += 1
      if partial:
        new = free[taken]
        taken += 1
        self.rc[new], self.last[new] = 1, self.clock
        results.append((True, pre_tables[src][full], new))
        row = row + [new]
      else:
        results.append((True, NB, NB))
      self.tables[dst], self.lens[dst] = row, length
    self.clock += 1
    return tuple(list(column) for column in zip(*results))

  def preempt(self, prio_S, needed):
    order = sorted((s for s in range(self.s) if self.tables[s]), key=lambda s: (prio_S[s], -s))
    pre = [False] * self.s
    for s in order:
      if self.num_free() >= needed:
        break
      self._drop(s)
      pre[s] = True
    self.clock += 1
    return pre

  def slot(self, s, pos):
    if not (0 <= s < self.s and 0 <= pos < self.lens[s]):
      return None
    return self.tables[s][pos // self.z] * self.z + pos % self.z

  def utilization(self):
    stored = {}
    for row, length in zip(self.tables, self.lens):
      for j, b in enumerate(row):
        stored[b] = min(self.z, length - j * self.z)
    return sum(stored.values()) / (len(stored) * self.z) if stored else 1.0


# The machine's pool: Z=3 (not a power of two), demand up to S * P = 24 blocks > N = 16, so
# appends and forks regularly run out of blocks; F=3 forks per call.
N, Z, S, P, F = 16, 3, 6, 4, 3

requests = st.lists(st.one_of(st.just(0), st.integers(0, 4), st.integers(-2, P * Z + 1)),
                    min_size=S, max_size=S)
seq_ids = st.integers(-1, S)


class AllocatorMachine(RuleBasedStateMachine):
  """Random append/release/fork/preempt/slots under jit, checked against ModelAllocator."""

  def __init__(self):
    super().__init__()
    self.state = A.init(N, Z, S, P)
    self.model = ModelAllocator(N, Z, S, P)

  @initialize(n_S=st.lists(st.just(0) | st.integers(1, 2 * Z + 1), min_size=S, max_size=S))
  def prefill(self, n_S):
    self.append(n_S)

  @rule(n_S=st.lists(st.integers(0, 2), min_size=S, max_size=S))
  def decode(self, n_S):  # the common engine step: a few tokens each
    self.append(n_S)

  @rule(n_S=requests)
  def append(self, n_S):
    self.state, ok = _append(self.state, np.asarray(n_S, np.int32))
    ok = np.asarray(ok).tolist()
    assert ok == self.model.append(n_S)
    hypothesis.event("append refused some", str(not all(ok)))

  @rule(mask_S=st.lists(st.integers(0, 3).map(lambda x: x == 0), min_size=S, max_size=S))
  def release(self, mask_S):
    self.state = _release(self.state, np.asarray(mask_S))
    self.model.release(mask_S)

  @rule(data=st.data())
  def fork(self, data):
    # Steer towards forks that can succeed (live src, distinct empty dst); invalid ids, taken
    # or duplicate dst are still drawn.
    live = [s for s in range(S) if self.model.lens[s]]
    empty = [s for s in range(S) if not self.model.lens[s]]
    src_pick = (st.sampled_from(live) | st.sampled_from(live) | seq_ids) if live else seq_ids
    src_F = data.draw(st.lists(src_pick, min_size=F, max_size=F), label="src")
    dst_F = data.draw(st.permutations(empty), label="empty dst")[:data.draw(st.integers(0, F))]
    dst_F += data.draw(st.lists(seq_ids, min_size=F - len(dst_F), max_size=F - len(dst_F)),
                       label="other dst")
    self.state, ok, csrc, cdst = _fork(self.state, np.asarray(src_F, np.int32),
                                       np.asarray(dst_F, np.int32))
    expected = self.model.fork(src_F, dst_F)
    got = tuple(np.asarray(x).tolist() for x in (ok, csrc, cdst))
    assert got == expected
    hypothesis.event("forks ok", str(sum(got[0])))
    hypothesis.event("blocks copied", str(sum(b >= 0 for b in got[2])))

  @rule(prio_S=st.lists(st.integers(-2, 2), min_size=S, max_size=S), data=st.data())
  def preempt(self, prio_S, data):
    free = self.model.num_free()  # mostly a need just above what is free
    needed = data.draw(st.integers(free + 1, free + 4) | st.integers(0, N + 2), label="needed")
    self.state, pre = _preempt(self.state, np.asarray(prio_S, np.int32), np.int32(needed))
    pre = np.asarray(pre).tolist()
    assert pre == self.model.preempt(prio_S, needed)
    hypothesis.event("preempted", str(sum(pre)))

  @rule(ids=st.lists(st.tuples(seq_ids, st.integers(-1, P * Z)), min_size=4, max_size=4))
  def slots(self, ids):
    got = _slots(self.state, np.asarray([i for i, _ in ids], np.int32),
                 np.asarray([p for _, p in ids], np.int32))
    for g, (s, pos) in zip(np.asarray(got).tolist(), ids):
      want = self.model.slot(s, pos)
      assert g < 0 if want is None else g == want

  @invariant()
  def matches_model(self):
    host = jax.device_get(self.state)  # one transfer, then numpy only
    A.validate(host)
    m = self.model
    want_tables = [row + [NB] * (P - len(row)) for row in m.tables]
    assert tables(host) == want_tables
    assert host.seq_lens.tolist() == m.lens
    assert host.ref_counts.tolist() == m.rc
    assert int(host.num_free) == m.num_free()
    assert host.last_used.tolist() == m.last
    util = float(_utilization(self.state))
    np.testing.assert_allclose(util, m.utilization(), rtol=1e-6)
    # Internal fragmentation: at most one partial block per live sequence.
    used = N - m.num_free()
    live = sum(length > 0 for length in m.lens)
    if used:
      assert util >= 1 - live * (Z - 1) / (used * Z) - 1e-6
    hypothesis.event("shared blocks", str(sum(r > 1 for r in m.rc) > 0))

  def teardown(self):
    self.state = _release(self.state, jnp.ones(S, jnp.bool_))
    A.validate(self.state)
    assert int(self.state.num_free) == N  # no leaked block
    assert not np.any(np.asarray(self.state.ref_counts))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = hypothesis.settings(
    max_examples=40, stateful_step_count=50, deadline=None, derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck))


@pytest.mark.slow
def test_allocator_machine_long():
  run_state_machine_as_test(
      AllocatorMachine,
      settings=hypothesis.settings(max_examples=150, stateful_step_count=100, deadline=None,
                                   suppress_health_check=list(hypothesis.HealthCheck)))


def _random_free_pool(rng, num_blocks, max_blocks_per_seq):
  """A state whose free blocks mix unregistered and cached ones (random chain depths) freed
  under a few stamps, ties included, as a pool that has cycled holds them."""
  s = A.init(num_blocks=num_blocks, block_size=2, max_seqs=2,
             max_blocks_per_seq=max_blocks_per_seq)
  in_use = rng.random(num_blocks) < 0.3
  stamps = rng.integers(0, int(rng.integers(1, 6)), num_blocks) * int(rng.choice([1, 2**28]))
  cached = rng.random(num_blocks) < rng.random()
  depth = np.where(cached, rng.integers(0, max_blocks_per_seq, num_blocks), -1)
  return dataclasses.replace(s, ref_counts=jnp.asarray(in_use, jnp.int32),
                             last_used=jnp.asarray(stamps, jnp.int32),
                             depth_N=jnp.asarray(depth, jnp.int32))


@pytest.mark.parametrize("select_max", [pytest.param(A._SELECT_MAX, marks=pytest.mark.slow), 3])
def test_take_equals_the_sorted_free_order_on_every_path(monkeypatch, select_max):
  # _take ranks the oldest unregistered free blocks with prefix sums, else selects the taken
  # set in O(N) passes and sorts only it (_select), and sorts the whole pool only for more
  # than _SELECT_MAX blocks (or any from a pool of at most _SORT_SMALL_POOL, 0 here): every
  # path gives the sorted free order's prefix.
  monkeypatch.setattr(A, "_SELECT_MAX", select_max)
  monkeypatch.setattr(A, "_SORT_SMALL_POOL", 0)
  rng = np.random.default_rng(5)
  take = jax.jit(lambda s, count, ranks: A._take(s, count, ranks))
  order = jax.jit(A._free_order_N)
  paths = set()
  for trial in range(16):
    # Two pool sizes (each compiles _take anew, 3-6 s): a small one and one well over
    # select_max = 3; the pools' contents, not their shapes, vary between trials.
    n = (4, 23)[trial % 2]
    s = _random_free_pool(rng, n, 6)
    want = np.asarray(order(s))
    in_use, depth = np.asarray(s.ref_counts) > 0, np.asarray(s.depth_N)
    fresh = ~in_use & (depth < 0)
    stamps = sorted(set(np.asarray(s.last_used)[fresh].tolist()))
    two = int(np.sum(fresh & np.isin(np.asarray(s.last_used), stamps[:2])))
    for count in range(int(np.sum(~in_use)) + 1):
      blocks, taken = take(s, jnp.int32(count), jnp.arange(n, dtype=jnp.int32))
      np.testing.assert_array_equal(np.asarray(blocks)[:count], want[:count])
      assert sorted(np.flatnonzero(np.asarray(taken)).tolist()) == sorted(want[:count].tolist())
      paths.add("prefix sums" if count <= two else
                "select" if count <= select_max or n <= select_max else "sort")
  assert paths == ({"prefix sums", "select", "sort"} if select_max == 3
                   else {"prefix sums", "select"})


def test_a_cycled_pool_is_not_sorted_to_take_a_few_blocks(monkeypatch):
  # Once the pool has cycled with the prefix cache on, nearly every free block is cached,
  # freed under its own stamp: the oldest unregistered blocks never suffice, and _take
  # sorted the whole pool on every step that took a block (26 ms at 32k blocks on CPU, an
  # engine 2.8x slower). With the sort made wrong, the blocks taken must not change.
  n = 2 * A._SELECT_MAX
  rng = np.random.default_rng(2)
  s = A.init(num_blocks=n, block_size=2, max_seqs=64, max_blocks_per_seq=16)
  s = dataclasses.replace(s, depth_N=jnp.asarray(rng.integers(0, 16, n), jnp.int32),
                          last_used=jnp.asarray(rng.integers(1, 300, n), jnp.int32))
  want = np.asarray(A._free_order_N(s))
  monkeypatch.setattr(A, "_free_order_N", lambda state: jnp.arange(state.num_blocks)[::-1])
  new_state, ok = jax.jit(lambda s, n: A.append(s, n))(s, jnp.ones(64, jnp.int32))
  assert bool(jnp.all(ok))
  np.testing.assert_array_equal(np.asarray(new_state.block_tables[:, 0]), want[:64])
