"""The engine's device side: one scheduling step (the device call looping over it is
``paged_jax.engine.loop.device_call``).

One device call = ``lax.while_loop`` of up to ``steps_per_call`` steps, stopping early when
nothing is left to run, or when enough slots came free for the host's next waiting request.
The call is jitted once per token bucket (the state is donated; and once more per bucket
used for prompt log-probs, ``loop.device_call``'s ``scoring``) and traces once whatever
the batch holds. Each step (``schedule_step``), all inside ``jit``:

0. Prefix cache (``enable_prefix_caching``). Every running sequence with no KV yet looks up
   the longest cached prefix of its history (``allocator.lookup``: full blocks only, and
   never the last token, so its logits are computed; with KV groups, only as far as every
   group holds the blocks its layers read there); when admitted it attaches those
   blocks (``allocator.attach``) and prefills only the rest. After the forward, the blocks
   it filled are registered (``allocator.register``). Lookups are confined to the request's
   ``cache_salt``. A preempted sequence re-admitted later hits its own cached blocks, so
   recompute is cheap while they survive. A new sequence whose next block one ahead of it
   in step 1's order is about to fill (same tokens after the same blocks) waits a step and
   attaches it then, rather than computing a copy (``prefix_wait.waits_for_fill``); once
   at most.
1. Token budget (the bucket's T): every running sequence wants its uncached tokens
   (``len - seq_len``: 1 for a decode, the rest of the prompt for a prefill). Decode rows
   come first, then prefills under way (sequences holding KV), then new sequences, each by
   arrival; each gets ``min(want, budget left)``, so a long prompt is prefilled in chunks
   over several steps (chunked prefill). Sequences holding KV go before new ones so that
   every step in which one wants tokens runs it: had an earlier new sequence taken the
   budget and then found no room for its blocks (below), the step would run nobody, and
   every step after it the same (a livelock).
2. Blocks. Sequences that already hold KV (decodes, chunked prefills under way) must get
   their blocks: while their demand exceeds the free blocks, the latest-arrived sequence
   holding blocks gives way. If it is short itself, it first holds its own chunk back and
   keeps its KV; if the others are still short, it is preempted (``allocator.preempt``
   with priority ``-arrival``): its KV is released, its token history kept, so it is
   re-prefilled later from ``prompt + generated`` (recompute; nothing is lost, greedy
   outputs are unchanged). The one holding back runs what fits in the blocks the others
   leave (maybe nothing). New sequences (nothing cached yet, preempted ones included) are
   admitted in arrival order, without preempting anyone, while their first chunk's blocks
   (and the cached free blocks their hits revive) fit; none that arrived after a sequence
   this step preempted or held back (it would take the blocks that one waits for); and
   without the prefix cache, a preempted one only once the rest of its history fits too
   (full-attention groups' blocks; with the cache that history comes back mostly as hits,
   and the wait cost steps): else one admitted for a chunk is the next victim, again and
   again. Fresh blocks come from the allocator's free order: never-cached blocks first,
   then cached ones least recently used first (evicting them).
3. ONE ragged forward of the model (``paged_jax.step.forward_step``: ``allocator.append``,
   slots, ``paged_forward`` with ``cu_q_lens``) for prefill chunks and decode rows together;
   in a scoring call (a request asks for prompt log-probs) with every row's logits, which
   score the prompt token after each row (``prompt_scores``).
4. Forks: a request with ``n > 1`` holds n slots; once its prompt is prefilled the parent is
   forked (``allocator.fork`` + ``KVCache.copy_blocks``) into the n - 1 waiting slots.
5. Sampling for every sequence whose whole history is now cached (``paged_jax.sampling``:
   the logit bias, penalties and ``min_tokens`` from the history, then the draw with key =
   ``fold_in(fold_in(key(seed), fork index), token index)``), stop checks (EOS unless
   ``ignore_eos``, ``stop_token_ids``: the stop token is not kept; ``max_tokens`` and
   ``max_model_len``: "length"), and ``allocator.release`` of finished sequences.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax import allocator
from paged_jax import protocol
from paged_jax import step as step_api
from paged_jax.engine.prefix_wait import waits_for_fill
from paged_jax.engine.scoring import prompt_scores
from paged_jax.engine.state import (DONE, FORK_WAIT, RUNNING, EngineState, scrub_freed,
                                    zero_blocks)
from paged_jax.sampling import Adjustments, request_keys, sample, top_logprobs

__all__ = ["schedule_step"]


def _blocks_for(len_S, z):
  return (len_S + z - 1) // z


def schedule_step(model, st: EngineState, *, num_tokens: int, scrub_on_release: bool = False,
                  prefix_caching: bool = False, hash_fn=allocator.chain_hashes,
                  kv_groups=None, vocab_size: int = 0, scoring: bool = False):
  """One scheduling step (module docstring): prefix hits, budget, blocks (preempting),
  ragged forward, prefix registration, fork, sample, stop. ``model``: any model of the
  protocol (``paged_jax.protocol``). ``kv_groups``: the model's ``KVGroups`` when the
  allocator has several groups. ``vocab_size``: the config's, which the logits' width must
  equal (0: unchecked). Returns the new ``EngineState``; ``scoring`` (prompt log-probs:
  the forward computes every row's logits), ``(state, scores)``, ``scores`` the
  ``prompt_scores`` of the step's rows."""
  # KV groups: sliding groups first give back what no query still to come can read, so
  # that admission and preemption below count only the blocks the groups really hold.
  if st.alloc.slides:
    alloc = allocator.slide(st.alloc)
    cache = scrub_freed(st.cache, st.alloc, alloc) if scrub_on_release else st.cache
    st = dataclasses.replace(st, alloc=alloc, cache=cache)
  alloc = st.alloc
  num_groups = alloc.num_groups
  num_slots, max_len = st.tokens_SJ.shape
  z = alloc.block_size
  slot_S = jnp.arange(num_slots, dtype=jnp.int32)
  running_S = st.status_S == RUNNING

  # 0. Prefix cache: the longest cached prefix of each running sequence with no KV yet,
  #    all but its last token at most (that one is computed, so its logits exist).
  cached_S = alloc.seq_lens
  if prefix_caching:
    # A prompt whose log-probs are asked for (``prompt_k_S``) is computed whole, the hits'
    # tokens would have no logits, until it has generated (its prompt scored by then).
    empty_S = running_S & (cached_S == 0) & ((st.prompt_k_S < 0) | (st.len_S > st.prompt_len_S))
    hit_SP, hit_S = jax.lax.cond(  # most steps admit nobody: skip the table build then
        jnp.any(empty_S),
        lambda: allocator.lookup(alloc, st.tokens_SJ, jnp.where(empty_S, st.len_S - 1, 0),
                                 st.salt_S, hash_fn=hash_fn),
        lambda: (jnp.full(alloc.block_tables.shape, allocator.NO_BLOCK, jnp.int32),
                 jnp.zeros(num_slots, jnp.int32)))
  else:
    hit_S = jnp.zeros(num_slots, jnp.int32)
  base_S = cached_S + hit_S * z  # tokens with K/V once the hits are attached

  # 1. Token budget: decodes, then prefills under way, then new sequences; each by arrival.
  want_S = jnp.where(running_S, st.len_S - base_S, 0)
  decode_S = (cached_S > 0) & (want_S == 1)
  group_S = jnp.where(want_S > 0, jnp.where(decode_S, 0, jnp.where(cached_S > 0, 1, 2)), 3)
  order_S = jnp.lexsort((slot_S, st.arrival_S, group_S))
  lost_S = jnp.zeros(num_slots, jnp.bool_)
  if prefix_caching:  # a new sequence whose next block one ahead of it is filling waits
    rank_S = jnp.zeros(num_slots, jnp.int32).at[order_S].set(slot_S)
    wait_S = jax.lax.cond(
        jnp.any(empty_S),
        lambda: waits_for_fill(alloc, st.tokens_SJ, st.salt_S, hit_SP, hit_S, base_S,
                               st.len_S, empty_S, rank_S),
        lambda: jnp.zeros(num_slots, jnp.bool_))
    # Once at most (counted when it cost the sequence budget): prompts that each extend
    # the one before (turns of a conversation) would otherwise run one a step, each
    # waiting for the next block of the last.
    wait_S &= ~st.waited_S
    lost_S = wait_S & (_budget_S(want_S, order_S, num_tokens) > 0)
    want_S = jnp.where(wait_S, 0, want_S)
  q_S = _budget_S(want_S, order_S, num_tokens)

  # 2. Blocks: sequences holding KV preempt the latest arrivals; new ones wait for room.
  # One block per new logical block in every group.
  demand_S = num_groups * (_blocks_for(base_S + q_S, z) - _blocks_for(base_S, z))
  must_S = (cached_S > 0) & (q_S > 0)

  def short(c):
    alloc, pre_S, held_S = c
    live_demand = jnp.sum(jnp.where(must_S & ~pre_S & ~held_S, demand_S, 0))
    holders = jnp.any(alloc.block_tables != allocator.NO_BLOCK)
    return (live_demand > alloc.num_free) & holders

  def make_room(c):
    # The victim is the latest arrival holding blocks (``allocator.preempt``'s order). If
    # it is short itself, it first holds its chunk back and keeps its KV: preempting it for
    # its own chunk only had it re-admitted and preempted again, step after step.
    alloc, pre_S, held_S = c
    t = alloc.block_tables
    holds_S = jnp.any((t != allocator.NO_BLOCK).reshape((-1,) + t.shape[-2:]), axis=(0, 2))
    v = jnp.lexsort((-slot_S, -st.arrival_S, ~holds_S))[0]
    hold_back = must_S[v] & ~held_S[v] & (demand_S[v] > 0)

    def preempt():
      a, new_S = allocator.preempt(alloc, -st.arrival_S, alloc.num_free + 1)
      return a, pre_S | new_S, held_S

    return jax.lax.cond(hold_back, lambda: (alloc, pre_S, held_S.at[v].set(True)), preempt)

  none_S = jnp.zeros(num_slots, jnp.bool_)
  alloc, pre_S, held_S = jax.lax.while_loop(short, make_room, (alloc, none_S, none_S))
  cache = st.cache
  if scrub_on_release:  # before anything is appended: a preempted block may be reused now
    cache = scrub_freed(cache, st.alloc, alloc)
  must_S &= ~pre_S
  # At most one sequence holds back and keeps its KV (were the rest still short, it would
  # be the next victim): it runs what fits in the blocks the others leave, maybe nothing.
  held_S &= ~pre_S
  room = alloc.num_free - jnp.sum(jnp.where(must_S & ~held_S, demand_S, 0))
  fit_S = jnp.clip(_blocks_for(base_S, z) * z + room // num_groups * z - base_S, 0, q_S)
  cut_S = held_S & (fit_S < q_S)
  q_S = jnp.where(held_S, fit_S, q_S)
  must_S &= q_S > 0
  demand_S = num_groups * (_blocks_for(base_S + q_S, z) - _blocks_for(base_S, z))
  free_left = alloc.num_free - jnp.sum(jnp.where(must_S, demand_S, 0))
  # New sequences are admitted by arrival, and none that arrived after a sequence this step
  # preempted or held back: it would take the blocks that sequence waits for.
  first_out = jnp.min(jnp.where(pre_S | cut_S, st.arrival_S, jnp.iinfo(jnp.int32).max))
  new_S = (cached_S == 0) & (q_S > 0) & (st.arrival_S < first_out)
  if prefix_caching:  # reviving a cached free block takes it from the free count as well
    hit_gSP = hit_SP.reshape((-1,) + hit_SP.shape[-2:])  # every group's blocks of the hit
    revive_S = jnp.sum((hit_gSP >= 0) & (alloc.ref_counts[jnp.maximum(hit_gSP, 0)] == 0),
                       axis=(0, 2), dtype=jnp.int32)
    demand_S = demand_S + jnp.where(new_S, revive_S, 0)
  need_S = demand_S
  if not prefix_caching:
    # A preempted sequence comes back only once the rest of its history fits as well (full
    # groups' blocks): back for one chunk, it was the next victim when an earlier one grew,
    # and recomputed its history again and again. The blocks stay counted for those after
    # it. (With the prefix cache its history comes back mostly as hits: this cost steps.)
    full_groups = sum(w is None for w in alloc.windows)
    rest_S = full_groups * (_blocks_for(st.len_S, z) - _blocks_for(base_S + q_S, z))
    need_S = demand_S + jnp.where(new_S & ~st.fresh_S, rest_S, 0)
  new_need_o = jnp.where(new_S, need_S, 0)[order_S]
  admit_o = new_S[order_S] & (jnp.cumsum(new_need_o) <= free_left)
  admit_S = jnp.zeros(num_slots, jnp.bool_).at[order_S].set(admit_o)
  q_S = jnp.where(must_S | admit_S, q_S, 0)
  first_S = admit_S & st.fresh_S
  if prefix_caching:
    alloc, _ = allocator.attach(alloc, hit_SP, jnp.where(admit_S, hit_S, 0))
    if scrub_on_release:  # cached blocks this step's append evicts: zero them before reuse
      taken, _ = allocator.append(alloc, q_S)
      cache = zero_blocks(cache, allocator.cached_N(alloc) & (taken.ref_counts > 0))

  # 3. One ragged forward over prefill chunks and decode rows.
  cached_S = alloc.seq_lens
  tokens_T = step_api.tokens_from_history(st.tokens_SJ, cached_S, q_S, num_tokens)
  logits_SV, alloc, cache, ok_S, *rows = step_api.forward_step(
      model, alloc, cache, tokens_T, q_S, kv_groups=kv_groups, every_row=scoring)
  protocol.check_logits(model, rows[0].logits_TV if scoring else logits_SV, vocab_size)
  after_register = True
  if prefix_caching:  # the blocks this forward filled become reusable (most steps fill none)
    filled = jnp.any(alloc.seq_lens // z > cached_S // z)
    # A step fills at most num_tokens // Z + 1 blocks of a sequence: register walks only
    # those levels when nothing older waits (its ``window``), not the whole [S, J] rows.
    alloc = jax.lax.cond(
        filled, lambda a: allocator.register(a, st.tokens_SJ, st.salt_S, hash_fn=hash_fn,
                                             window=num_tokens // z + 2),
        lambda a: a, alloc)
    # The history written below is register's operand: the write must follow its read, or
    # XLA copies [S, J] twice a step to run it first. ``clock`` is what register computes
    # (the other branch passes it on), and ``(x | 1) != 0`` is True without being foldable.
    after_register = (alloc.clock | 1) != 0
  done_prefill_S = ok_S & (q_S > 0) & (alloc.seq_lens == st.len_S)
  blocks_in_use = alloc.num_blocks - alloc.num_free
  utilization = allocator.utilization(alloc)

  # 4. Fork the n - 1 waiting slots of a request whose prompt was just prefilled.
  parent_S = jnp.clip(st.parent_S, 0, num_slots - 1)
  child_S = (st.status_S == FORK_WAIT) & done_prefill_S[parent_S]

  def fork_children(alloc, cache):
    alloc, _, copy_src, copy_dst = allocator.fork(alloc, jnp.where(child_S, parent_S, -1),
                                                  slot_S)
    return alloc, cache.copy_blocks(copy_src, copy_dst)

  # Most steps fork nobody: skip the free-order sort and the block copy then. The fork
  # writes the pool that the forward's attention reads; nothing orders the two when the
  # model's last attention is no step of a loop that hands the pool on (a 1-layer or
  # unrolled decoder), and XLA then copied the pool, K and V, three times a step to let
  # it run the fork first. A predicate computed from the logits orders it after them.
  fork = jnp.any(child_S) & _computed_after(logits_SV)
  alloc, cache = jax.lax.cond(fork, fork_children, lambda a, c: (a, c), alloc, cache)
  # A fork that got no block simply recomputes the prompt later (its KV is empty). Its
  # history needs no copy: the host wrote the prompt into every slot of the request, and
  # the parent has generated nothing yet (children fork at its first prefill's end), so
  # the rows agree up to the parent's length (a [S, J] copy here cost every step O(S J)).
  tokens_SJ, logprobs_SJ = st.tokens_SJ, st.logprobs_SJ
  len_S = jnp.where(child_S, st.len_S[parent_S], st.len_S)

  # 5. Sample, stop, release.
  draw_S = done_prefill_S | child_S
  row_S = jnp.where(child_S, parent_S, slot_S)
  keys_S = request_keys(st.seed_S, st.fork_S, len_S - st.prompt_len_S)
  tok_S, lp_S = sample(logits_SV[row_S], st.temperature_S, st.top_k_S, st.top_p_S, keys_S,
                       min_p_S=st.min_p_S, adjustments=Adjustments(  # bias, penalties, bar
                           tokens_SJ, len_S, st.prompt_len_S, st.repetition_penalty_S,
                           st.presence_penalty_S, st.frequency_penalty_S, st.stop_Si,
                           draw_S & (len_S - st.prompt_len_S < st.min_tokens_S), draw_S,
                           st.bias_ids_Sb, st.bias_Sb, st.allowed_only_S))
  # The likeliest tokens too, in the steps where a slot that draws asks for them; such a
  # slot's chosen token, when among them, reports the very value listed there.
  top_S = draw_S & (st.top_n_S > 0)
  top_ids_Sv, top_logprobs_Sv = jax.lax.cond(
      jnp.any(top_S), lambda: top_logprobs(logits_SV[row_S], st.top_ids_Sv.shape[-1]),
      lambda: (st.top_ids_Sv, st.top_logprobs_Sv))
  chosen_Sv = top_S[:, None] & (top_ids_Sv == tok_S[:, None])
  lp_S = jnp.where(jnp.any(chosen_Sv, axis=-1),
                   jnp.max(jnp.where(chosen_Sv, top_logprobs_Sv, -jnp.inf), axis=-1), lp_S)
  stop_S = draw_S & jnp.any(st.stop_Si == tok_S[:, None], axis=-1)
  keep_S = draw_S & ~stop_S
  col_S = jnp.where(keep_S & after_register, len_S, max_len)
  tokens_SJ = tokens_SJ.at[slot_S, col_S].set(tok_S, mode="drop")
  logprobs_SJ = logprobs_SJ.at[slot_S, col_S].set(lp_S, mode="drop")
  len_S = len_S + keep_S.astype(jnp.int32)
  length_S = keep_S & (len_S >= st.max_len_S)
  finished_S = stop_S | length_S
  before_release = alloc
  alloc = allocator.release(alloc, finished_S)
  if scrub_on_release:
    cache = scrub_freed(cache, before_release, alloc)
  status_S = jnp.where(finished_S, DONE, jnp.where(child_S, RUNNING, st.status_S))
  reason_S = jnp.where(stop_S, 1, jnp.where(length_S, 2, st.reason_S))

  busy = jnp.any(q_S > 0)
  st = dataclasses.replace(
      st, alloc=alloc, cache=cache, tokens_SJ=tokens_SJ, logprobs_SJ=logprobs_SJ, len_S=len_S,
      top_ids_Sv=top_ids_Sv, top_logprobs_Sv=top_logprobs_Sv,
      status_S=status_S, reason_S=reason_S, stop_id_S=jnp.where(stop_S, tok_S, st.stop_id_S),
      fresh_S=st.fresh_S & ~admit_S, waited_S=st.waited_S | lost_S,
      steps=st.steps + 1,
      preemptions=st.preemptions + jnp.sum(pre_S, dtype=jnp.int32),
      generated=st.generated + jnp.sum(draw_S, dtype=jnp.int32),
      blocks_in_use_sum=st.blocks_in_use_sum + blocks_in_use.astype(jnp.float32),
      peak_blocks_in_use=jnp.maximum(st.peak_blocks_in_use, blocks_in_use),
      utilization_sum=st.utilization_sum + jnp.where(busy, utilization, 0.0),
      busy_steps=st.busy_steps + busy.astype(jnp.int32),
      prompt_tokens=st.prompt_tokens + jnp.sum(jnp.where(first_S, st.len_S, 0),
                                               dtype=jnp.int32),
      cached_prompt_tokens=st.cached_prompt_tokens + jnp.sum(
          jnp.where(first_S, hit_S * z, 0), dtype=jnp.int32),
  )
  if scoring:
    return st, prompt_scores(rows[0], st.tokens_SJ, st.prompt_len_S, st.prompt_k_S,
                             st.top_ids_Sv.shape[-1])
  return st


def _budget_S(want_S, order_S, num_tokens: int):
  """i32[S]: each sequence's share of the step's ``num_tokens``, given in ``order_S``."""
  want_o = want_S[order_S]
  q_o = jnp.clip(num_tokens - (jnp.cumsum(want_o) - want_o), 0, want_o)
  return jnp.zeros_like(want_S).at[order_S].set(q_o)


def _computed_after(x_SV: jax.Array) -> jax.Array:
  """True, as a value XLA computes from ``x_SV`` and cannot fold to a constant (a NaN is
  unequal to itself, so ``x == x`` is data): what it gates runs after ``x_SV``.
  ``lax.optimization_barrier`` orders nothing here: XLA drops it before placing copies."""
  x = x_SV[0, 0]
  return (x == x) | jnp.isnan(x)
