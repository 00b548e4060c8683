"""The engine's scheduling step (``engine.device.schedule_step``) on hand-built states.

The end-to-end tests pin what a serve produces; these pin the policy the module docstring
states, step by step: the token budget goes to decodes, then prefills under way, then new
sequences, each by arrival (not by slot); under block pressure the latest arrival holding
blocks is preempted. Arrivals are given in an order unlike the slots', so a policy that
followed slots (or reversed a priority) gives other lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import KVCacheSpec
from paged_jax.engine import state as state_lib
from paged_jax.engine.device import schedule_step

VOCAB, NEXT = 16, 5  # the stub model always predicts token NEXT
MAX_LEN = 64


class _Stub(nnx.Module):
  """A model of the protocol whose logits pick NEXT (the policy is under test, not
  attention); it writes each token's id as its K and V, as a model writes its K/V."""

  def paged_forward(self, tokens_T, positions_T, cache, metadata, *, logits_indices=None):
    kv_TKD = jnp.broadcast_to(tokens_T[:, None, None].astype(jnp.float32),
                              tokens_T.shape + (1, 8))
    cache = cache.write(0, kv_TKD, kv_TKD, metadata.slots_T)
    logits_TV = jnp.broadcast_to(jax.nn.one_hot(NEXT, VOCAB), tokens_T.shape + (VOCAB,))
    return logits_TV[logits_indices], cache


def _state(num_blocks, requests, *, block_size=4, max_seqs=4, st=None):
  """An engine state with ``requests`` admitted: ``{slot: (arrival, prompt, max_tokens)}``,
  ``prompt`` a list of token ids or a length (that many tokens 1), ``max_tokens`` with an
  optional salt after it. Into ``st`` if given (its other slots kept), else a fresh state."""
  if st is None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=block_size,
                       num_blocks=num_blocks, dtype=jnp.float32)
    st = state_lib.init_state(spec, max_seqs, MAX_LEN)
  entries = []
  for slot, (arrival, prompt, m, *salt) in requests.items():
    prompt = [1] * prompt if isinstance(prompt, int) else list(prompt)
    n = len(prompt)
    entries.append((slot, dict(tokens_SJ=prompt, len_S=n, prompt_len_S=n, max_len_S=n + m,
                               status_S=state_lib.RUNNING, arrival_S=arrival, fresh_S=True,
                               salt_S=salt[0] if salt else 0)))
  for slot_r, rows in state_lib.row_chunks(entries, max_model_len=MAX_LEN, shards=1,
                                           slots_per_shard=st.len_S.shape[0]):
    st = state_lib.admit(st, jnp.asarray(slot_r), jax.tree.map(jnp.asarray, rows))
  return st


_steps = {}


def _step(st, num_tokens, prefix_caching=False):
  key = num_tokens, prefix_caching
  if key not in _steps:
    model = _Stub()
    _steps[key] = jax.jit(lambda s: schedule_step(model, s, num_tokens=num_tokens,
                                                  prefix_caching=prefix_caching))
  return _steps[key](st)


def _simulate(requests, num_tokens, steps):
  """The docstring's budget policy in plain Python, with blocks to spare: the cached
  lengths of every slot after each step."""
  seqs = {s: dict(arrival=a, len=n, max_len=n + m, cached=0, done=False)
          for s, (a, n, m) in requests.items()}
  out = []
  for _ in range(steps):
    live = [(s, q) for s, q in seqs.items() if not q["done"] and q["len"] > q["cached"]]
    kind = lambda s, q: 0 if q["cached"] and q["len"] - q["cached"] == 1 else (
        1 if q["cached"] else 2)
    budget = num_tokens
    for s, q in sorted(live, key=lambda sq: (kind(*sq), sq[1]["arrival"], sq[0])):
      take = min(q["len"] - q["cached"], budget)
      budget -= take
      q["cached"] += take
      if take and q["cached"] == q["len"]:  # its whole history is in: a token is drawn
        q["len"] += 1
        if q["len"] >= q["max_len"]:
          q.update(done=True, cached=0)
    out.append([seqs[s]["cached"] if s in seqs else 0 for s in range(4)])
  return out


def test_the_token_budget_goes_to_decodes_then_prefills_under_way_then_new_by_arrival():
  rng = np.random.default_rng(0)
  for trial in range(4):
    slots = rng.permutation(4)[:3 + trial % 2]
    arrivals = rng.permutation(len(slots)) * 3  # unlike the slots' order
    requests = {int(s): (int(a), int(rng.integers(3, 14)), int(rng.integers(2, 6)))
                for s, a in zip(slots, arrivals)}
    num_tokens = int(rng.choice([4, 8]))
    st = _state(64, requests)
    want = _simulate(requests, num_tokens, 12)
    for i, expect in enumerate(want):
      st = _step(st, num_tokens)
      got = np.asarray(st.alloc.seq_lens).tolist()
      assert got == expect, f"trial {trial} ({requests}, T={num_tokens}), step {i + 1}"
    assert int(st.preemptions) == 0


def test_a_decode_goes_before_an_earlier_arrivals_prefill_under_way():
  # Slot 0 (arrival 5) is decoding; slot 1 (arrival 0, earlier) is mid-prefill. With a
  # budget of 2 the decode takes its 1 token first, though it arrived later.
  st = _state(64, {0: (5, 3, 4), 1: (0, 12, 4)})
  st = dataclasses.replace(st, arrival_S=jnp.asarray([0, 5, 0, 0], jnp.int32))
  st = _step(st, 4)  # slot 0 (then earliest) prefills its 3 tokens and draws; slot 1 gets 1
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [3, 1]
  st = dataclasses.replace(st, arrival_S=jnp.asarray([5, 0, 0, 0], jnp.int32))
  st = _step(st, 2)
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [4, 2]


def test_block_pressure_preempts_the_latest_arrival_not_the_highest_slot():
  # Two prompts of 8 tokens (2 blocks of 4 each) fill a pool of 4 blocks. Their first
  # decodes need a third block each, and none is free: the later arrival, which sits in the
  # lower slot, holds its decode back, and as the earlier is still short, is preempted (its
  # blocks freed, its history kept); the earlier decodes.
  st = _state(4, {0: (1, 8, 4), 1: (0, 8, 4)})
  st = _step(st, 16)
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [8, 8]
  assert np.asarray(st.len_S).tolist()[:2] == [9, 9]
  st = _step(st, 16)
  assert int(st.preemptions) == 1
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [0, 9]  # slot 0 waits (3 blocks)
  assert np.asarray(st.len_S).tolist()[:2] == [9, 10]  # its history kept
  assert int(st.alloc.num_free) == 1 and st.status_S[0] == state_lib.RUNNING
  # Once slot 1 finishes and gives its blocks back, slot 0 is re-prefilled from its history
  # (prompt + the token it had drawn) and goes on to its 4 tokens.
  for _ in range(8):
    st = _step(st, 16)
  assert np.asarray(st.status_S).tolist()[:2] == [state_lib.DONE] * 2
  assert np.asarray(st.len_S).tolist()[:2] == [12, 12]
  assert np.asarray(st.tokens_SJ)[0, :12].tolist() == [1] * 8 + [NEXT] * 4
  assert int(st.alloc.num_free) == 4


def test_a_preempted_sequence_comes_back_once_its_whole_history_fits():
  # As above, then with a budget of 5 tokens: slot 0's first chunk (4 tokens, 1 block)
  # would fit the free block, but not the rest of its 9-token history. Let back in, it
  # was preempted again when slot 1 grew, and again after. It waits for its 3 blocks.
  st = _step(_step(_state(4, {0: (1, 8, 4), 1: (0, 8, 4)}), 16), 16)
  assert int(st.preemptions) == 1 and int(st.alloc.num_free) == 1
  st = _step(st, 5)
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [0, 10]
  for _ in range(8):
    st = _step(st, 5)
  assert np.asarray(st.status_S).tolist()[:2] == [state_lib.DONE] * 2
  assert int(st.preemptions) == 1 and int(st.alloc.num_free) == 4


def test_a_sequence_short_of_blocks_itself_waits_with_its_kv():
  # As above with one block free: the earlier arrival's decode takes it, and the later one
  # holds its decode back, keeping its KV (preempting it for its own block only had it
  # prefilled again). It goes on from its KV once the earlier one is done.
  st = _step(_state(5, {0: (1, 8, 4), 1: (0, 8, 4)}), 16)
  st = _step(st, 16)
  assert np.asarray(st.alloc.seq_lens).tolist()[:2] == [8, 9] and int(st.preemptions) == 0
  st = _step(_step(st, 16), 16)  # slot 1 draws its last token and gives its blocks back
  assert np.asarray(st.status_S).tolist()[:2] == [state_lib.RUNNING, state_lib.DONE]
  for _ in range(3):
    st = _step(st, 16)
  assert np.asarray(st.status_S).tolist()[:2] == [state_lib.DONE] * 2
  assert int(st.preemptions) == 0 and int(st.alloc.num_free) == 5


def test_a_prefill_short_of_blocks_runs_what_fits_and_no_later_arrival_takes_them():
  # Slot 1 (arrival 0) decodes; slot 2 (arrival 1) is mid-prefill of a 24-token prompt,
  # 8 tokens in; slot 0 (arrival 2) waits with a 4-token prompt. Of the 2 free blocks the
  # decode takes 1; slot 2 wanted 4 for its next 16 tokens: it runs the 4 tokens that fit
  # (it used to preempt itself, to be re-admitted and preempted again) and slot 0, a later
  # arrival, is not admitted into the blocks slot 2 waits for.
  st = _step(_state(6, {1: (0, 7, 20)}), 16)  # 2 blocks; its next decode needs no block
  st = _step(_state(6, {2: (1, 24, 4)}, st=st), 9)  # slot 2 gets 8 tokens (2 blocks)
  assert np.asarray(st.alloc.seq_lens).tolist()[:3] == [0, 8, 8]
  st = _step(_state(6, {0: (2, 4, 4)}, st=st), 17)
  assert np.asarray(st.alloc.seq_lens).tolist()[:3] == [0, 9, 12]
  assert int(st.preemptions) == 0 and int(st.alloc.num_free) == 0


def test_no_later_arrival_is_admitted_into_the_blocks_of_one_just_preempted():
  # Slot 1 (arrival 0) and slot 2 (arrival 1, mid-prefill) fill the pool of 4 blocks; slot
  # 1's decode needs a block, so slot 2 is preempted. Slot 0 (arrival 2) would fit in what
  # is left, but it came after slot 2, whose blocks those are: it is not admitted.
  st = _step(_state(4, {1: (0, 4, 8), 2: (1, 16, 4)}), 16)
  assert np.asarray(st.alloc.seq_lens).tolist()[:3] == [0, 4, 12]
  st = _step(_state(4, {0: (2, 3, 4)}, st=st), 16)
  assert int(st.preemptions) == 1
  assert np.asarray(st.alloc.seq_lens).tolist()[:3] == [0, 5, 0]


# ---------------------------------------------------------------- prefix cache: waiting

P9 = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # two full blocks of Z = 4 before its last token


def _lens(st):
  return np.asarray(st.alloc.seq_lens).tolist()


def _blocks(st, slot, levels):
  return np.asarray(st.alloc.block_tables)[slot, :levels].tolist()


def test_a_new_prompt_waits_while_an_earlier_one_fills_the_same_block():
  # Blocks are registered after the forward: had slot 0 (the later arrival) run beside
  # slot 1 in this step, it would compute and hold a copy of each shared block. It sits
  # the step out, then attaches both blocks and computes its last token only.
  st = _state(64, {0: (1, P9, 4), 1: (0, P9, 4)})
  st = _step(st, 32, prefix_caching=True)
  assert _lens(st)[:2] == [0, 9]
  st = _step(st, 32, prefix_caching=True)
  assert _lens(st)[:2] == [9, 10]
  assert _blocks(st, 0, 2) == _blocks(st, 1, 2)
  assert int(st.cached_prompt_tokens) == 8 and int(st.prompt_tokens) == 18


def test_no_wait_when_nothing_can_be_shared():
  # Nothing in common at level 0 (other tokens, or another salt), or the shared block is
  # the one holding the later prompt's last token (never a hit): both run at once.
  other = [99] + P9[1:]
  for requests in ({0: (1, other, 4), 1: (0, P9, 4)},
                   {0: (1, P9, 4, 7), 1: (0, P9, 4, 0)},
                   {0: (1, P9[:4], 4), 1: (0, P9, 4)}):
    st = _step(_state(64, requests), 32, prefix_caching=True)
    assert _lens(st)[:2] == [len(requests[0][1]), 9], requests


def test_the_wait_follows_the_chain_past_level_zero():
  # Slot 1 is mid-prefill (its first block registered); slot 0 arrives with the same 12
  # tokens and hits that block. Slot 1 fills level 1 this step, so slot 0 waits again,
  # then hits both levels. A prompt that parts from slot 1's at level 1 does not wait.
  p12 = P9 + [12, 13, 14]
  for second, waits in ((p12, True), (p12[:4] + [50] + p12[5:], False)):
    st = _step(_state(64, {1: (0, p12, 4)}), 4, prefix_caching=True)
    assert _lens(st)[:2] == [0, 4]
    st = _state(64, {0: (1, second, 4)}, st=st)
    st = _step(st, 32, prefix_caching=True)
    assert _lens(st)[:2] == ([0, 12] if waits else [12, 12]), second
    if waits:
      st = _step(st, 32, prefix_caching=True)
      assert _lens(st)[:2] == [12, 13]
      assert _blocks(st, 0, 2) == _blocks(st, 1, 2)
    assert _blocks(st, 0, 1) == _blocks(st, 1, 1)  # level 0 was a hit either way


def test_the_same_tokens_after_another_block_are_no_reason_to_wait():
  # Slot 0's hit (level 0, a block slot 2 registered) is not what slot 1 holds there
  # (nothing yet): their level-1 tokens agree, their prefixes do not. Slot 0 runs at once.
  st = _step(_state(64, {2: (0, [20, 21, 22, 23, 30], 4)}), 4, prefix_caching=True)
  st = _state(64, {1: (1, P9 + [12, 13, 14], 4), 0: (2, [20, 21, 22, 23] + P9[4:8] + [40], 4)},
              st=st)
  st = _step(st, 32, prefix_caching=True)
  assert _lens(st)[:3] == [9, 12, 5]
  assert _blocks(st, 0, 1) == _blocks(st, 2, 1)  # the hit


def _constant_hash(tokens_SPZ, salt_S):
  del salt_S
  return jnp.zeros(tokens_SPZ.shape[:2], jnp.uint32)


def test_a_block_the_cache_missed_is_no_reason_to_wait():
  # Every hash collides here, so the lookup misses blocks that slot 1 has computed (level 1
  # below). Slot 1 holds them already and will fill nothing slot 0 could attach next step:
  # waiting for it would last until it finished. Slot 0 runs once budget is left for it.
  p12 = P9 + [12, 13, 14]
  step = jax.jit(lambda s: schedule_step(_Stub(), s, num_tokens=8, prefix_caching=True,
                                         hash_fn=_constant_hash))
  st = step(_state(64, {1: (0, p12 + [15] * 8, 8)}))
  st = step(_state(64, {0: (1, p12, 4)}, st=st))
  assert _lens(st)[:2] == [0, 16]  # slot 1's prefill under way takes the budget
  st = step(st)
  assert _lens(st)[:2] == [8, 20]  # a hit of level 0, then 4 tokens
  assert int(st.cached_prompt_tokens) == 4 and _blocks(st, 0, 1) == _blocks(st, 1, 1)


def test_tokens_past_the_history_are_no_reason_to_wait():
  # Slot 1's history (9 prompt tokens, then NEXT) ends inside level 2, where its row holds
  # zeros: no block it will fill soon. Slot 0's level 2 happens to read the same, [11,
  # NEXT, 0, 0]; slot 0 waits out step 1 (levels 0-1 are shared), never for level 2.
  st = _state(64, {1: (0, P9, 4), 0: (1, P9[:8] + [11, NEXT, 0, 0, 7], 4)})
  st = _step(st, 32, prefix_caching=True)
  assert _lens(st)[:2] == [0, 9]
  st = _step(st, 32, prefix_caching=True)
  assert _lens(st)[:2] == [13, 10]
  assert int(st.cached_prompt_tokens) == 8


def test_prompts_that_extend_each_other_wait_once_at_most():
  # Each prompt is the one before's blocks and one more (turns of a conversation). Slot 1
  # and 2 wait out step 1 for level 0; in step 2 slot 1 fills level 1, which slot 2 would
  # wait for too: had it, such prompts would run one a step. It has waited once: it runs.
  x0, x1, x2 = [3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]
  st = _state(64, {0: (0, x0 + [20], 4), 1: (1, x0 + x1 + [21], 4),
                   2: (2, x0 + x1 + x2 + [22], 4)})
  st = _step(st, 64, prefix_caching=True)
  assert _lens(st)[:3] == [5, 0, 0]
  st = _step(st, 64, prefix_caching=True)
  assert _lens(st)[:3] == [6, 9, 13]
  assert _blocks(st, 1, 1) == _blocks(st, 2, 1) == _blocks(st, 0, 1)
