"""The serving engine: continuous batching inside ``jit``, preemption by recompute.

Host API: ``LLM`` (``LLM.from_pretrained``), ``generate``, ``generate_stream``, ``stats``;
``SamplingParams`` lives in ``paged_jax.sampling``.

Scheduling state. Everything the scheduler needs lives in one pytree, ``EngineState``, next
to the allocator state and the KV cache, with one row per sequence slot (S = ``max_seqs``;
allocator slot s is engine slot s): the token history ``tokens_SM`` (prompt + generated,
M = ``max_model_len``), its length ``len_S``, the tokens already in the KV cache (the
allocator's ``seq_lens``), the slot status (free / running / done / waiting for its fork),
arrival order, per-request sampling parameters and stop ids.

One device call = ``lax.while_loop`` of up to ``steps_per_call`` steps, stopping early when
nothing is left to run, or when enough slots came free for the host's next waiting request.
The call is jitted once (the state is donated) and traces once whatever the batch holds.
Each step (``_step``), all inside ``jit``:

0. Prefix cache (``enable_prefix_caching``). Every running sequence with no KV yet looks up
   the longest cached prefix of its history (``allocator.lookup``: full blocks only, and
   never the last token, so its logits are computed); when admitted it attaches those
   blocks (``allocator.attach``) and prefills only the rest. After the forward, the blocks
   it filled are registered (``allocator.register``). Lookups are confined to the request's
   ``cache_salt``. A preempted sequence re-admitted later hits its own cached blocks, so
   recompute is cheap while they survive.
1. Token budget (``max_tokens_per_step`` = T): every running sequence wants its uncached
   tokens (``len - seq_len``: 1 for a decode, the rest of the prompt for a prefill). Decode
   rows come first, then prefills by arrival; each gets ``min(want, budget left)``, so a
   long prompt is prefilled in chunks over several steps (chunked prefill).
2. Blocks. Sequences that already hold KV (decodes, chunked prefills under way) must get
   their blocks: while their demand exceeds the free blocks, the latest-arrived sequence
   holding blocks is preempted (``allocator.preempt`` with priority ``-arrival``); its KV is
   released, its token history kept, so it is re-prefilled later from ``prompt + generated``
   (recompute; nothing is lost, greedy outputs are unchanged). New sequences (nothing
   cached yet, preempted ones included) are admitted in arrival order while their first
   chunk's blocks (and the cached free blocks their hits revive) fit, without preempting
   anyone. Fresh blocks come from the allocator's free order: never-cached blocks first,
   then cached ones least recently used first (evicting them).
3. ONE ragged forward (``models.steps.prefill_step``: ``allocator.append``, slots,
   ``Decoder.paged_forward`` with ``cu_q_lens``) for prefill chunks and decode rows together.
4. Forks: a request with ``n > 1`` holds n slots; once its prompt is prefilled the parent is
   forked (``allocator.fork`` + ``KVCache.copy_blocks``) into the n - 1 waiting slots.
5. Sampling for every sequence whose whole history is now cached (``paged_jax.sampling``;
   key = ``fold_in(fold_in(key(seed), fork index), token index)``), stop checks (EOS unless
   ``ignore_eos``, ``stop_token_ids``: the stop token is not kept; ``max_tokens`` and
   ``max_model_len``: "length"), and ``allocator.release`` of finished sequences.

Between device calls the host only admits waiting requests into free slots (one jitted
merge, host -> device) and reads one small report (status, lengths, the tokens of this call,
counters): one device -> host transfer per call, counted in ``stats["host_syncs"]``.

Outputs. ``generate`` returns one ``Output`` per completion in prompt order; a request with
``n > 1`` contributes n consecutive Outputs (``sample_index`` 0 .. n-1).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import time
from typing import Any, Iterator, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import allocator
from paged_jax import sharding as mesh_sharding
from paged_jax.kv_cache import KVCache
from paged_jax.sampling import SamplingParams, request_keys, sample
from paged_jax.spec import KVCacheSpec

__all__ = ["LLM", "Output", "SamplingParams", "StreamEvent", "EngineState",
           "default_token_buckets"]

FREE, RUNNING, DONE, FORK_WAIT = 0, 1, 2, 3
"""Slot status values of ``EngineState.status_S``."""
REASONS = {1: "stop", 2: "length"}
MAX_STOP_IDS = 16
"""Stop ids per request (EOS ids included), the static width X of ``stop_SX``."""


@dataclasses.dataclass(frozen=True)
class Output:
  """One completion.

  Attributes:
    prompt_index: index of the prompt in the ``generate`` call.
    sample_index: completion index within the prompt (0 .. n-1).
    prompt_token_ids: the prompt's token ids.
    token_ids: generated ids (the stop / EOS token not included).
    text: ``token_ids`` decoded when the engine has a tokenizer, else None.
    finish_reason: "stop" (EOS or a stop id) or "length" (max_tokens or max_model_len).
    logprobs: log-probability of each generated id (``SamplingParams.logprobs``), else None.
  """

  prompt_index: int
  sample_index: int
  prompt_token_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  text: str | None
  finish_reason: str
  logprobs: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """One event of ``generate_stream``: a token (``token_id`` set) or the end of a completion
  (``token_id`` None, ``finish_reason`` set)."""

  prompt_index: int
  sample_index: int
  token_id: int | None
  logprob: float | None = None
  finish_reason: str | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
  """All device-side engine state (module docstring); S slots, M = max_model_len."""

  alloc: allocator.AllocatorState
  cache: KVCache
  tokens_SM: jax.Array  # i32[S, M] token history: prompt, then generated
  logprobs_SM: jax.Array  # f32[S, M] log-prob of each generated token at its position
  len_S: jax.Array  # i32[S] history length
  prompt_len_S: jax.Array  # i32[S] original prompt length
  max_len_S: jax.Array  # i32[S] finish with "length" when len reaches it
  status_S: jax.Array  # i32[S] FREE / RUNNING / DONE / FORK_WAIT
  reason_S: jax.Array  # i32[S] 0 none, 1 stop, 2 length
  arrival_S: jax.Array  # i32[S] arrival order (smaller = earlier = higher priority)
  parent_S: jax.Array  # i32[S] slot to fork from (FORK_WAIT slots)
  fork_S: jax.Array  # i32[S] completion index
  seed_S: jax.Array  # u32[S]
  temperature_S: jax.Array  # f32[S]
  top_k_S: jax.Array  # i32[S]
  top_p_S: jax.Array  # f32[S]
  stop_SX: jax.Array  # i32[S, X] stop ids, -1 padding
  salt_S: jax.Array  # i32[S] prefix-cache salt (interned ``cache_salt``; 0 = none)
  fresh_S: jax.Array  # bool[S] prompt not admitted yet (counted once in the hit rate)
  # Counters.
  steps: jax.Array  # i32[]
  preemptions: jax.Array  # i32[]
  generated: jax.Array  # i32[] tokens sampled (stop tokens included)
  blocks_in_use_sum: jax.Array  # f32[]
  peak_blocks_in_use: jax.Array  # i32[]
  utilization_sum: jax.Array  # f32[] sum over busy steps of allocator.utilization
  busy_steps: jax.Array  # i32[]
  prompt_tokens: jax.Array  # i32[] prompt tokens of first admissions
  cached_prompt_tokens: jax.Array  # i32[] of those, found in the prefix cache


_ROW_FIELDS = ("tokens_SM", "logprobs_SM", "len_S", "prompt_len_S", "max_len_S", "status_S",
               "reason_S", "arrival_S", "parent_S", "fork_S", "seed_S", "temperature_S",
               "top_k_S", "top_p_S", "stop_SX", "salt_S", "fresh_S")


def _blocks_for(len_S, z):
  return (len_S + z - 1) // z


def _zero_blocks(cache: KVCache, mask_N: jax.Array) -> KVCache:
  """Zero the blocks with ``mask_N`` True in every layer; a ``lax.cond`` skips the pass over
  the pool when there are none."""

  def scrub(cache):
    m = mask_N[None, None, :, None, None]
    return KVCache(k_pages=jnp.where(m, jnp.zeros((), cache.dtype), cache.k_pages),
                   v_pages=jnp.where(m, jnp.zeros((), cache.dtype), cache.v_pages))

  return jax.lax.cond(jnp.any(mask_N), scrub, lambda cache: cache, cache)


def _unowned_N(alloc: allocator.AllocatorState) -> jax.Array:
  """bool[N]: blocks whose K/V nobody may read: free and not a prefix-cache entry."""
  return (alloc.ref_counts == 0) & (alloc.depth_N < 0)


def _scrub_freed(cache: KVCache, before: allocator.AllocatorState,
                 after: allocator.AllocatorState) -> KVCache:
  """Zero every block that nobody may read in ``after`` but could in ``before`` (scrub on
  release). A freed block that stays in the prefix cache keeps its K/V until evicted."""
  return _zero_blocks(cache, _unowned_N(after) & ~_unowned_N(before))


def default_token_buckets(max_tokens_per_step: int, max_seqs: int) -> tuple[int, ...]:
  """Token budgets the engine compiles a device call for: the smallest holds a decode row of
  every slot (at least 32), each next is 4x larger, the last is ``max_tokens_per_step``."""
  sizes, size = [], max(32, max_seqs)
  while size < max_tokens_per_step:
    sizes.append(size)
    size *= 4
  return tuple(sizes) + (max_tokens_per_step,)


def _step(model, st: EngineState, *, num_tokens: int, impl, scrub_on_release: bool = False,
          prefix_caching: bool = False, hash_fn=allocator.chain_hashes) -> EngineState:
  """One scheduling step: prefix hits, budget, blocks (preempting), ragged forward, prefix
  registration, fork, sample, stop."""
  # Imported here: models imports paged_jax, and paged_jax must import without models.
  from paged_jax.models import steps as model_steps

  alloc = st.alloc
  num_slots, max_len = st.tokens_SM.shape
  z = alloc.block_size
  slot_S = jnp.arange(num_slots, dtype=jnp.int32)
  running_S = st.status_S == RUNNING

  # 0. Prefix cache: the longest cached prefix of each running sequence with no KV yet,
  #    all but its last token at most (that one is computed, so its logits exist).
  cached_S = alloc.seq_lens
  if prefix_caching:
    empty_S = running_S & (cached_S == 0)
    hit_SP, hit_S = jax.lax.cond(  # most steps admit nobody: skip the table sort then
        jnp.any(empty_S),
        lambda: allocator.lookup(alloc, st.tokens_SM, jnp.where(empty_S, st.len_S - 1, 0),
                                 st.salt_S, hash_fn=hash_fn),
        lambda: (jnp.full(alloc.block_tables.shape, allocator.NO_BLOCK, jnp.int32),
                 jnp.zeros(num_slots, jnp.int32)))
  else:
    hit_S = jnp.zeros(num_slots, jnp.int32)
  base_S = cached_S + hit_S * z  # tokens with K/V once the hits are attached

  # 1. Token budget: decodes first, then by arrival.
  want_S = jnp.where(running_S, st.len_S - base_S, 0)
  decode_S = (cached_S > 0) & (want_S == 1)
  group_S = jnp.where(want_S > 0, jnp.where(decode_S, 0, 1), 2)
  order_S = jnp.lexsort((slot_S, st.arrival_S, group_S))
  want_o = want_S[order_S]
  q_o = jnp.clip(num_tokens - (jnp.cumsum(want_o) - want_o), 0, want_o)
  q_S = jnp.zeros(num_slots, jnp.int32).at[order_S].set(q_o)

  # 2. Blocks: sequences holding KV preempt the latest arrivals; new ones wait for room.
  demand_S = _blocks_for(base_S + q_S, z) - _blocks_for(base_S, z)
  must_S = (cached_S > 0) & (q_S > 0)

  def short(c):
    alloc, pre_S = c
    live_demand = jnp.sum(jnp.where(must_S & ~pre_S, demand_S, 0))
    holders = jnp.any(alloc.block_tables[:, 0] != allocator.NO_BLOCK)
    return (live_demand > alloc.num_free) & holders

  def preempt_one(c):
    alloc, pre_S = c
    alloc, new_S = allocator.preempt(alloc, -st.arrival_S, alloc.num_free + 1)
    return alloc, pre_S | new_S

  alloc, pre_S = jax.lax.while_loop(short, preempt_one,
                                    (alloc, jnp.zeros(num_slots, jnp.bool_)))
  cache = st.cache
  if scrub_on_release:  # before anything is appended: a preempted block may be reused now
    cache = _scrub_freed(cache, st.alloc, alloc)
  must_S &= ~pre_S
  free_left = alloc.num_free - jnp.sum(jnp.where(must_S, demand_S, 0))
  new_S = (cached_S == 0) & (q_S > 0)
  if prefix_caching:  # reviving a cached free block takes it from the free count as well
    revive_S = jnp.sum((hit_SP >= 0) & (alloc.ref_counts[jnp.maximum(hit_SP, 0)] == 0),
                       axis=1, dtype=jnp.int32)
    demand_S = demand_S + jnp.where(new_S, revive_S, 0)
  new_demand_o = jnp.where(new_S, demand_S, 0)[order_S]
  admit_o = new_S[order_S] & (jnp.cumsum(new_demand_o) <= free_left)
  admit_S = jnp.zeros(num_slots, jnp.bool_).at[order_S].set(admit_o)
  q_S = jnp.where(must_S | admit_S, q_S, 0)
  first_S = admit_S & st.fresh_S
  if prefix_caching:
    alloc, _ = allocator.attach(alloc, hit_SP, jnp.where(admit_S, hit_S, 0))
    if scrub_on_release:  # cached blocks this step's append evicts: zero them before reuse
      taken, _ = allocator.append(alloc, q_S)
      cache = _zero_blocks(cache, allocator.cached_N(alloc) & (taken.ref_counts > 0))

  # 3. One ragged forward over prefill chunks and decode rows.
  cached_S = alloc.seq_lens
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_S)])
  t_T = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = jnp.clip(jnp.searchsorted(cu, t_T, side="right") - 1, 0, num_slots - 1)
  pos_T = cached_S[seq_T] + t_T - cu[seq_T]
  tokens_T = jnp.where(t_T < cu[-1], st.tokens_SM[seq_T, jnp.clip(pos_T, 0, max_len - 1)], 0)
  logits_SV, alloc, cache, ok_S = model_steps.prefill_step(model, alloc, cache, tokens_T,
                                                           q_S, impl=impl)
  if prefix_caching:  # the blocks this forward filled become reusable (most steps fill none)
    filled = jnp.any(alloc.seq_lens // z > cached_S // z)
    alloc = jax.lax.cond(
        filled, lambda a: allocator.register(a, st.tokens_SM, st.salt_S, hash_fn=hash_fn),
        lambda a: a, alloc)
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

  # Most steps fork nobody: skip the free-order sort and the block copy then.
  alloc, cache = jax.lax.cond(jnp.any(child_S), fork_children, lambda a, c: (a, c), alloc,
                              cache)
  # A fork that got no block simply recomputes the prompt later (its KV is empty).
  tokens_SM = jnp.where(child_S[:, None], st.tokens_SM[parent_S], st.tokens_SM)
  logprobs_SM = jnp.where(child_S[:, None], st.logprobs_SM[parent_S], st.logprobs_SM)
  len_S = jnp.where(child_S, st.len_S[parent_S], st.len_S)

  # 5. Sample, stop, release.
  draw_S = done_prefill_S | child_S
  row_S = jnp.where(child_S, parent_S, slot_S)
  keys_S = request_keys(st.seed_S, st.fork_S, len_S - st.prompt_len_S)
  tok_S, lp_S = sample(logits_SV[row_S], st.temperature_S, st.top_k_S, st.top_p_S, keys_S)
  stop_S = draw_S & jnp.any(st.stop_SX == tok_S[:, None], axis=-1)
  keep_S = draw_S & ~stop_S
  col_S = jnp.where(keep_S, len_S, max_len)
  tokens_SM = tokens_SM.at[slot_S, col_S].set(tok_S, mode="drop")
  logprobs_SM = logprobs_SM.at[slot_S, col_S].set(lp_S, mode="drop")
  len_S = len_S + keep_S.astype(jnp.int32)
  length_S = keep_S & (len_S >= st.max_len_S)
  finished_S = stop_S | length_S
  before_release = alloc
  alloc = allocator.release(alloc, finished_S)
  if scrub_on_release:
    cache = _scrub_freed(cache, before_release, alloc)
  status_S = jnp.where(finished_S, DONE, jnp.where(child_S, RUNNING, st.status_S))
  reason_S = jnp.where(stop_S, 1, jnp.where(length_S, 2, st.reason_S))

  busy = jnp.any(q_S > 0)
  return dataclasses.replace(
      st, alloc=alloc, cache=cache, tokens_SM=tokens_SM, logprobs_SM=logprobs_SM, len_S=len_S,
      status_S=status_S, reason_S=reason_S, fresh_S=st.fresh_S & ~admit_S,
      steps=st.steps + 1,
      preemptions=st.preemptions + jnp.sum(pre_S, dtype=jnp.int32),
      generated=st.generated + jnp.sum(draw_S, dtype=jnp.int32),
      blocks_in_use_sum=st.blocks_in_use_sum + blocks_in_use.astype(jnp.float32),
      peak_blocks_in_use=jnp.maximum(st.peak_blocks_in_use, blocks_in_use),
      utilization_sum=st.utilization_sum + jnp.where(busy, utilization, 0.0),
      busy_steps=st.busy_steps + busy.astype(jnp.int32),
      prompt_tokens=st.prompt_tokens + jnp.sum(jnp.where(first_S, st.len_S, 0)),
      cached_prompt_tokens=st.cached_prompt_tokens + jnp.sum(jnp.where(first_S, hit_S * z, 0)),
  )


def _want_S(st: EngineState) -> jax.Array:
  """i32[S]: tokens each running sequence still needs K/V for (its uncached history)."""
  return jnp.where(st.status_S == RUNNING, st.len_S - st.alloc.seq_lens, 0)


def _device_call(graphdef, params, st: EngineState, slots_wanted, *, steps_per_call: int,
                 num_tokens: int, impl, scrub_on_release: bool = False,
                 prefix_caching: bool = False, hash_fn=allocator.chain_hashes,
                 downshift_at: int = 0, upshift: bool = False):
  """Up to ``steps_per_call`` steps in one ``while_loop``; returns the state and a report.

  The loop stops early when no sequence is left running, or when enough slots have come
  free for the host's waiting requests (``slots_wanted`` i32[], 0 if none wait). Token
  buckets: ``num_tokens`` is this call's step budget, one of the engine's compiled sizes;
  the loop also stops once the tokens the running sequences still want (their history not
  in the cache) fit the next smaller size (``downshift_at``, 0: none) or, ``upshift``,
  exceed this one, so the host picks the size that fits. The pool never passes through a
  ``switch`` (XLA would copy it each step).
  """
  model = nnx.merge(graphdef, params)
  start_S = jnp.where(st.status_S == RUNNING, st.len_S, st.prompt_len_S)

  def cond(c):
    _, i, stop = c
    return (i < steps_per_call) & ~stop

  def body(c):
    st, i, _ = c
    st = _step(model, st, num_tokens=num_tokens, impl=impl, scrub_on_release=scrub_on_release,
               prefix_caching=prefix_caching, hash_fn=hash_fn)
    active = jnp.any((st.status_S == RUNNING) | (st.status_S == FORK_WAIT))
    free = jnp.sum((st.status_S == FREE) | (st.status_S == DONE))
    stop = ~active | ((slots_wanted > 0) & (free >= slots_wanted))
    pending = jnp.sum(_want_S(st))
    if downshift_at:
      stop |= pending <= downshift_at
    if upshift:
      stop |= pending > num_tokens
    return st, i + 1, stop

  st, _, _ = jax.lax.while_loop(cond, body, (st, jnp.int32(0), jnp.bool_(False)))
  max_len = st.tokens_SM.shape[1]
  idx_SK = jnp.clip(start_S[:, None] + jnp.arange(steps_per_call)[None, :], 0, max_len - 1)
  report = dict(
      status_S=st.status_S, len_S=st.len_S, reason_S=st.reason_S, start_S=start_S,
      want_S=_want_S(st),
      tokens_SK=jnp.take_along_axis(st.tokens_SM, idx_SK, axis=1),
      logprobs_SK=jnp.take_along_axis(st.logprobs_SM, idx_SK, axis=1),
      steps=st.steps, preemptions=st.preemptions, generated=st.generated,
      blocks_in_use_sum=st.blocks_in_use_sum, peak_blocks_in_use=st.peak_blocks_in_use,
      utilization_sum=st.utilization_sum, busy_steps=st.busy_steps,
      num_free=st.alloc.num_free, prompt_tokens=st.prompt_tokens,
      cached_prompt_tokens=st.cached_prompt_tokens,
      cached_blocks=allocator.num_cached(st.alloc))
  return st, report


_device_call_jit = jax.jit(_device_call,
                           static_argnames=("graphdef", "steps_per_call", "num_tokens", "impl",
                                            "scrub_on_release", "prefix_caching", "hash_fn",
                                            "downshift_at", "upshift"),
                           donate_argnames=("st",))


def _admit(st: EngineState, mask_S, rows: dict) -> EngineState:
  """Overwrite the rows of the slots with ``mask_S`` True by ``rows`` (host -> device)."""
  updates = {}
  for name in _ROW_FIELDS:
    old, new = getattr(st, name), rows[name]
    m = mask_S.reshape((-1,) + (1,) * (old.ndim - 1))
    updates[name] = jnp.where(m, new.astype(old.dtype), old)
  return dataclasses.replace(st, **updates)


_admit_jit = jax.jit(_admit, donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("scrub_on_release",))
def _abort_jit(st: EngineState, mask_S, *, scrub_on_release: bool = False) -> EngineState:
  """Drop the sequences of ``mask_S`` (an abandoned stream): release their blocks, free slots."""
  alloc = allocator.release(st.alloc, mask_S)
  cache = _scrub_freed(st.cache, st.alloc, alloc) if scrub_on_release else st.cache
  return dataclasses.replace(st, alloc=alloc, cache=cache,
                             status_S=jnp.where(mask_S, FREE, st.status_S))


@dataclasses.dataclass
class _Request:
  """Host bookkeeping of one prompt (its n completions)."""

  index: int
  prompt: tuple[int, ...]
  params: SamplingParams
  seed: int
  stop: tuple[int, ...]
  salt: int = 0  # interned cache_salt, 0 for none
  arrival: int = -1
  tokens: list = dataclasses.field(default_factory=list)  # per completion
  logprobs: list = dataclasses.field(default_factory=list)


class LLM:
  """The serving engine over a ``models.Decoder``.

  Args:
    model: a ``models.Decoder``.
    config: its ``models.ModelConfig`` (EOS ids, vocabulary, context length).
    dtype: KV cache dtype (default: the model's dtype).
    block_size: Z, tokens per KV block.
    num_blocks: N, blocks in the pool. Default: from ``kv_budget_bytes`` when given, else
      enough for ``max_seqs`` sequences of ``min(config.max_seq_len, 2048)`` tokens.
    kv_budget_bytes: size the pool by memory (``KVCacheSpec.from_budget``); exclusive with
      ``num_blocks``.
    max_seqs: S, sequences running at once (slots; a request with ``n`` completions uses n).
    max_tokens_per_step: T, the token budget of one step (prefill chunks + decode rows).
    token_buckets: increasing step budgets ending at T, one compiled device call each;
      the host runs each call at the smallest that holds the tokens its sequences want, and
      a call ends early when they would fit a smaller one or need a larger one, so decode
      steps cost about S rows, not T. Default ``default_token_buckets(T, max_seqs)``;
      ``(T,)`` compiles one.
    max_model_len: longest sequence (prompt + generated); default
      ``min(config.max_seq_len, N * Z)`` so that any admitted sequence fits the pool alone.
    steps_per_call: most scheduling steps per device call.
    enable_prefix_caching: share the K/V of full blocks whose token prefix matches (module
      docstring, "Prefix cache"): a request whose prompt starts with cached blocks skips
      their prefill; ``stats["prefix_hit_rate"]`` counts the prompt tokens found cached.
      ``generate(..., cache_salt=...)`` keeps tenants apart.
    prefix_hash_fn: the block hash of the prefix cache (default
      ``allocator.chain_hashes``); any function of that signature, e.g. a degenerate one in a
      test: a hit is confirmed by the stored tokens, so a bad hash costs hits, not outputs.
    mesh: None (one device), or a ``jax.sharding.Mesh`` with axes ("data", "model")
      (``paged_jax.sharding``): weights and KV heads split over "model", sequences over
      "data", each data shard with its own slots and block pool; ``max_seqs`` and
      ``num_blocks`` are totals over the data shards and must be multiples of their
      number (a ``kv_budget_bytes`` pool is rounded down to one), ``n`` at most the slots
      of one shard, and ``allocator_state`` carries a leading data axis.
    tokenizer: optional ``tokenizers.Tokenizer`` (``from_pretrained`` loads tokenizer.json).
    seed: seeds the engine's draw of seeds for requests whose ``SamplingParams.seed`` is None.
    max_traces: when set, the jitted device call is wrapped in ``chex.assert_max_traces``
      with this many traces (tests).
    scrub_on_release: zero every KV block inside the step that frees it (finish, preemption,
      abandoned stream), so no freed page keeps another request's K/V. Reads never depend on
      it (attention masks every position a sequence does not own); it is defence in depth,
      at the cost of one masked pass over the pool in each step that frees a block.
  """

  def __init__(self, model, config, *, dtype=None, block_size: int = 16,
               num_blocks: int | None = None, kv_budget_bytes: int | None = None,
               max_seqs: int = 16, max_tokens_per_step: int = 256,
               max_model_len: int | None = None, steps_per_call: int = 16,
               enable_prefix_caching: bool = True, mesh=None, tokenizer=None, seed: int = 0,
               max_traces: int | None = None, scrub_on_release: bool = False,
               prefix_hash_fn=None, token_buckets: Sequence[int] | None = None):
    from paged_jax.models import Decoder, ModelConfig
    if not isinstance(model, Decoder):
      raise ValueError(f"model={type(model).__name__} must be a models.Decoder")
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config={type(config).__name__} must be a models.ModelConfig")
    self._plan = None if mesh is None else mesh_sharding.ShardingPlan.create(
        mesh, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        mlp_dim=config.mlp_dim)
    shards = 1 if self._plan is None else self._plan.data_size
    for name, value in (("block_size", block_size), ("max_seqs", max_seqs),
                        ("max_tokens_per_step", max_tokens_per_step),
                        ("steps_per_call", steps_per_call)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    if num_blocks is not None and kv_budget_bytes is not None:
      raise ValueError(f"{num_blocks=} and {kv_budget_bytes=}: give at most one")
    self.model, self.config = model, config
    self.tokenizer = tokenizer
    for name, value in (("enable_prefix_caching", enable_prefix_caching),
                        ("scrub_on_release", scrub_on_release)):
      if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be a bool")
    if prefix_hash_fn is not None and not callable(prefix_hash_fn):
      raise ValueError(f"{prefix_hash_fn=} must be None or a function like "
                       "allocator.chain_hashes")
    self.enable_prefix_caching = bool(enable_prefix_caching)
    self._salt_ids: dict[str, int] = {}
    kv_dtype = model.dtype if dtype is None else jnp.dtype(dtype)
    if kv_budget_bytes is not None:
      spec = KVCacheSpec.from_budget(kv_budget_bytes, config.num_layers, config.num_kv_heads,
                                     config.head_dim, block_size, kv_dtype)
    else:
      if num_blocks is None:
        num_blocks = max_seqs * math.ceil(min(config.max_seq_len, 2048) / block_size)
      spec = model.kv_cache_spec(block_size=block_size, num_blocks=num_blocks, dtype=kv_dtype)
    # With a mesh each data shard owns max_seqs / d slots and num_blocks / d blocks.
    if shards > 1 and kv_budget_bytes is not None and spec.num_blocks >= shards:
      spec = dataclasses.replace(spec, num_blocks=spec.num_blocks - spec.num_blocks % shards)
    for name, value in (("max_seqs", max_seqs), ("num_blocks", spec.num_blocks)):
      if value % shards:
        raise ValueError(f"{name}={value} must be a multiple of mesh.shape['data']={shards} "
                         f"(each data shard owns {name} / {shards})")
    self.spec = spec
    pool_tokens = spec.num_blocks // shards * spec.block_size
    per_shard = "" if shards == 1 else f" / {shards} data shards"
    if max_model_len is None:
      max_model_len = min(config.max_seq_len, pool_tokens)
    if (isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer))
        or not 2 <= max_model_len <= min(config.max_seq_len, pool_tokens)):
      raise ValueError(f"{max_model_len=} must be an int in [2, min(config.max_seq_len="
                       f"{config.max_seq_len}, num_blocks * block_size{per_shard}="
                       f"{pool_tokens})]")
    self.max_model_len = int(max_model_len)
    self.max_seqs = int(max_seqs)
    self.max_tokens_per_step = int(max_tokens_per_step)
    self.steps_per_call = int(steps_per_call)
    if token_buckets is None:
      token_buckets = default_token_buckets(self.max_tokens_per_step, self.max_seqs)
    if (isinstance(token_buckets, (str, bytes)) or not isinstance(token_buckets, Sequence)
        or not token_buckets
        or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1
               for b in token_buckets)
        or list(token_buckets) != sorted(set(token_buckets))
        or token_buckets[-1] != self.max_tokens_per_step):
      raise ValueError(f"token_buckets={token_buckets!r} must be increasing ints >= 1 ending "
                       f"at max_tokens_per_step={self.max_tokens_per_step}")
    self.token_buckets = tuple(int(b) for b in token_buckets)
    self.scrub_on_release = bool(scrub_on_release)
    self._rng = np.random.default_rng(seed)
    self._arrivals = 0
    self._graphdef, self._params = (nnx.split(model) if self._plan is None
                                    else self._plan.shard_model(model))

    self._static = dict(graphdef=self._graphdef, steps_per_call=self.steps_per_call,
                        impl=model.impl, scrub_on_release=self.scrub_on_release,
                        prefix_caching=self.enable_prefix_caching,
                        hash_fn=prefix_hash_fn or allocator.chain_hashes)
    self._max_traces = max_traces
    self._calls: dict[int, Any] = {}
    self._bucket = self.token_buckets[-1]  # the step budget of the next device call
    self._admit = _admit_jit
    self._abort = functools.partial(_abort_jit, scrub_on_release=self.scrub_on_release)
    self._slots_per_shard = self.max_seqs // shards
    if self._plan is not None:  # admit / abort per data shard
      self._admit = self._plan.per_shard(_admit)
      self._abort = self._plan.per_shard(self._abort)
    self._state = self._init_state() if self._plan is None else self._init_shards()
    self._host = dict(host_syncs=0, device_calls=0, wall_s=0.0, tokens=0, requests=0)
    self._last = None

  def _call_for(self, bucket: int):
    """The jitted device call whose step budget is ``bucket`` (one of ``token_buckets``),
    built on first use: ``call(params, state, slots_wanted) -> (state, report)``, the state
    donated. With a mesh it runs under the plan's ``shard_map``; with ``max_traces`` it is
    wrapped in ``chex.assert_max_traces`` (per bucket)."""
    if bucket not in self._calls:
      i = self.token_buckets.index(bucket)
      static = dict(self._static, num_tokens=bucket,
                    downshift_at=self.token_buckets[i - 1] if i else 0,
                    upshift=i + 1 < len(self.token_buckets))
      if self._plan is None and self._max_traces is None:
        # Shared across engines: same model structure and sizes -> one compilation.
        call = lambda params, st, wanted: _device_call_jit(params=params, st=st,
                                                           slots_wanted=wanted, **static)
      else:
        def call(params, st, slots_wanted):
          return _device_call(params=params, st=st, slots_wanted=slots_wanted, **static)
        if self._plan is not None:  # one shard_map over the mesh; state with a data axis
          call = self._plan.device_call(call)
        if self._max_traces is not None:
          call = chex.assert_max_traces(call, n=self._max_traces)
        call = jax.jit(call, donate_argnums=(1,))
      self._calls[bucket] = call
    return self._calls[bucket]

  def _call(self, params, st, slots_wanted):
    """One device call at the step budget ``self._bucket`` (set by ``_serve``)."""
    return self._call_for(self._bucket)(params, st, slots_wanted)

  @classmethod
  def from_pretrained(cls, path, *, dtype=None, impl: str = "auto", **kwargs) -> "LLM":
    """An engine over a Hugging Face checkpoint directory (``models.load_pretrained``);
    ``tokenizer.json`` is loaded when present and the ``tokenizers`` package is installed.
    ``dtype`` is the model's (and the KV cache's) dtype; other options as ``LLM``."""
    from paged_jax.models import load_pretrained
    mesh = kwargs.get("mesh")  # with a mesh each tensor is loaded onto its model slice
    model, config = load_pretrained(path, dtype=dtype, impl=impl, sharding=None if mesh is None
                                    else mesh_sharding.load_placement(mesh))
    tokenizer = kwargs.pop("tokenizer", None)
    tok_path = os.path.join(os.fspath(path), "tokenizer.json")
    if tokenizer is None and os.path.isfile(tok_path):
      try:
        import tokenizers
      except ImportError:  # optional dependency
        tokenizers = None
      if tokenizers is not None:
        tokenizer = tokenizers.Tokenizer.from_file(tok_path)
    return cls(model, config, tokenizer=tokenizer, **kwargs)

  # --- state ---

  def _init_state(self) -> EngineState:
    s, m, sp = self.max_seqs, self.max_model_len, self.spec
    p = math.ceil(m / sp.block_size)
    zi = lambda: jnp.zeros(s, jnp.int32)
    zf = lambda: jnp.zeros((), jnp.float32)
    return EngineState(
        alloc=allocator.init(sp.num_blocks, sp.block_size, s, p),
        cache=KVCache.create(sp),
        tokens_SM=jnp.zeros((s, m), jnp.int32), logprobs_SM=jnp.zeros((s, m), jnp.float32),
        len_S=zi(), prompt_len_S=zi(), max_len_S=zi(), status_S=zi(), reason_S=zi(),
        arrival_S=zi(), parent_S=zi(), fork_S=zi(), seed_S=jnp.zeros(s, jnp.uint32),
        temperature_S=jnp.zeros(s, jnp.float32), top_k_S=zi(),
        top_p_S=jnp.ones(s, jnp.float32), stop_SX=jnp.full((s, MAX_STOP_IDS), -1, jnp.int32),
        salt_S=zi(), fresh_S=jnp.zeros(s, jnp.bool_),
        steps=jnp.int32(0), preemptions=jnp.int32(0), generated=jnp.int32(0),
        blocks_in_use_sum=zf(), peak_blocks_in_use=jnp.int32(0), utilization_sum=zf(),
        busy_steps=jnp.int32(0), prompt_tokens=jnp.int32(0), cached_prompt_tokens=jnp.int32(0))

  def _init_shards(self) -> EngineState:
    """The state of every data shard, built in place on the mesh: ``_init_state`` of a
    shallow copy of this engine sized as one shard (S/d slots, N/d blocks), so whatever
    it reads from the engine, it reads one shard's sizes."""
    shard = copy.copy(self)
    shard.max_seqs = self._slots_per_shard
    shard.spec = dataclasses.replace(
        self.spec, num_blocks=self.spec.num_blocks // self._plan.data_size)
    return self._plan.init_state(shard._init_state)

  def reset_stats(self) -> None:
    """Zero every counter of ``stats`` (e.g. after a warm-up call that compiled the step)."""
    zf = lambda: jnp.zeros((), jnp.float32)
    old = self._state
    self._state = dataclasses.replace(
        self._state, steps=jnp.int32(0), preemptions=jnp.int32(0), generated=jnp.int32(0),
        blocks_in_use_sum=zf(), peak_blocks_in_use=jnp.int32(0), utilization_sum=zf(),
        busy_steps=jnp.int32(0), prompt_tokens=jnp.int32(0), cached_prompt_tokens=jnp.int32(0))
    if self._plan is not None:  # counters per data shard
      self._state = self._plan.match_state(self._state, old)
    self._host = dict(host_syncs=0, device_calls=0, wall_s=0.0, tokens=0, requests=0)
    self._last = None

  @property
  def allocator_state(self) -> allocator.AllocatorState:
    """The allocator state now (for ``allocator.validate``); with a mesh, every leaf has
    a leading data-shard axis (validate ``tree_map(lambda x: x[i], ...)`` per shard)."""
    return self._state.alloc

  # --- requests ---

  def _encode(self, i: int, prompt) -> tuple[int, ...]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError(f"prompts[{i}] is a string but the engine has no tokenizer (the "
                         "checkpoint has no tokenizer.json): pass token ids")
      ids = self.tokenizer.encode(prompt).ids
    else:
      try:
        ids = [int(t) for t in prompt]
      except (TypeError, ValueError):
        raise ValueError(f"prompts[{i}]={prompt!r} must be a string or a sequence of token "
                         "ids") from None
    if len(ids) == 0:
      raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
    v = self.config.vocab_size
    bad = [t for t in ids if not 0 <= t < v]
    if bad:
      raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary "
                       f"[0, vocab_size={v})")
    if len(ids) >= self.max_model_len:
      raise ValueError(
          f"prompts[{i}] has {len(ids)} tokens; must be < max_model_len={self.max_model_len} "
          f"(model context {self.config.max_seq_len}, KV pool "
          f"{self.spec.num_blocks * self.spec.block_size} tokens) to generate anything")
    return tuple(ids)

  def _salts(self, cache_salt, num_prompts: int) -> list[int]:
    """One interned salt id per prompt (0: no salt). Ids are this engine's own and unique
    per string, so two different salts can never share a cache entry."""
    if cache_salt is None or isinstance(cache_salt, str):
      cache_salt = [cache_salt] * num_prompts
    elif not isinstance(cache_salt, Sequence) or len(cache_salt) != num_prompts:
      raise ValueError(f"cache_salt={cache_salt!r} must be None, a str, or one str (or None) "
                       f"per prompt ({num_prompts})")
    ids = []
    for i, salt in enumerate(cache_salt):
      if salt is None:
        ids.append(0)
      elif isinstance(salt, str):
        ids.append(self._salt_ids.setdefault(salt, len(self._salt_ids) + 1))
      else:
        raise ValueError(f"cache_salt[{i}]={salt!r} must be a str or None")
    return ids

  def _requests(self, prompts, params, cache_salt=None) -> list[_Request]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
      raise ValueError(f"prompts={type(prompts).__name__} must be a list of prompts")
    salts = self._salts(cache_salt, len(prompts))
    if params is None:
      params = SamplingParams()
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
      raise ValueError(f"len(params)={len(params)} must equal len(prompts)={len(prompts)}")
    eos = tuple(self.config.eos_token_ids)
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      if not isinstance(p, SamplingParams):
        raise ValueError(f"params[{i}]={p!r} must be a SamplingParams")
      ids = self._encode(i, prompt)
      if p.n > self._slots_per_shard:  # a request's slots are in one data shard
        per_shard = "" if self._plan is None else f" / {self._plan.data_size} data shards"
        raise ValueError(f"params[{i}].n={p.n} must be <= max_seqs={self.max_seqs}"
                         f"{per_shard}")
      stop = tuple(dict.fromkeys(p.stop_token_ids + (() if p.ignore_eos else eos)))
      if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"params[{i}].stop_token_ids: {len(stop)} stop ids (EOS included) "
                         f"must be <= {MAX_STOP_IDS}")
      seed = p.seed if p.seed is not None else int(self._rng.integers(0, 2 ** 32))
      out.append(_Request(index=i, prompt=ids, params=p, seed=seed, stop=stop, salt=salts[i],
                          tokens=[[] for _ in range(p.n)], logprobs=[[] for _ in range(p.n)]))
    return out

  def _rows(self):
    s, m = self.max_seqs, self.max_model_len
    return dict(
        tokens_SM=np.zeros((s, m), np.int32), logprobs_SM=np.zeros((s, m), np.float32),
        len_S=np.zeros(s, np.int32), prompt_len_S=np.zeros(s, np.int32),
        max_len_S=np.zeros(s, np.int32), status_S=np.zeros(s, np.int32),
        reason_S=np.zeros(s, np.int32), arrival_S=np.zeros(s, np.int32),
        parent_S=np.zeros(s, np.int32), fork_S=np.zeros(s, np.int32),
        seed_S=np.zeros(s, np.uint32), temperature_S=np.zeros(s, np.float32),
        top_k_S=np.zeros(s, np.int32), top_p_S=np.ones(s, np.float32),
        stop_SX=np.full((s, MAX_STOP_IDS), -1, np.int32), salt_S=np.zeros(s, np.int32),
        fresh_S=np.zeros(s, bool))

  # --- serving ---

  def generate_stream(self, prompts, params=None, *,
                      cache_salt=None) -> Iterator[StreamEvent]:
    """Serve ``prompts`` and yield ``StreamEvent``s as tokens are decided (after each device
    call): one per generated token, then one with ``finish_reason`` per completion. All
    requests are validated (``ValueError`` naming the request) before this returns. Closing
    the generator early drops the unfinished requests (their blocks are released). One
    ``generate`` / ``generate_stream`` at a time per engine. ``cache_salt`` as for
    ``generate``."""
    return self._serve(self._requests(prompts, params, cache_salt))

  def _fill_slots(self, waiting: list[_Request], slot_owner, want_S: np.ndarray) -> None:
    """Admit waiting requests (FCFS) into free slots; one jitted merge when any. ``want_S``
    (the host's view of the tokens each slot still needs) gets the admitted prompts."""
    free = [s for s, o in enumerate(slot_owner) if o is None]
    mask = np.zeros(self.max_seqs, bool)
    rows = None
    # Slots of one request lie in one data shard, the emptiest (one shard: the first n).
    while waiting and (slots := mesh_sharding.pick_slots(
        free, waiting[0].params.n, self._slots_per_shard)) is not None:
      req = waiting.pop(0)
      req.arrival = self._arrivals
      self._arrivals += 1
      rows = self._rows() if rows is None else rows
      p, n_prompt = req.params, len(req.prompt)
      free = [s for s in free if s not in slots]
      for f, s in enumerate(slots):
        mask[s] = True
        slot_owner[s] = (req, f)
        rows["tokens_SM"][s, :n_prompt] = req.prompt
        rows["len_S"][s] = n_prompt if f == 0 else 0
        rows["prompt_len_S"][s] = n_prompt
        rows["max_len_S"][s] = min(n_prompt + p.max_tokens, self.max_model_len)
        rows["status_S"][s] = RUNNING if f == 0 else FORK_WAIT
        rows["arrival_S"][s] = req.arrival
        rows["parent_S"][s] = slots[0] % self._slots_per_shard  # slot within its shard
        rows["fork_S"][s] = f
        rows["seed_S"][s] = req.seed
        rows["temperature_S"][s] = p.temperature
        rows["top_k_S"][s] = p.top_k
        rows["top_p_S"][s] = p.top_p
        rows["stop_SX"][s, :len(req.stop)] = req.stop
        rows["salt_S"][s] = req.salt
        rows["fresh_S"][s] = f == 0
        want_S[s] = n_prompt if f == 0 else 0
    if rows is not None:
      self._state = self._admit(self._state, jnp.asarray(mask),
                                {k: jnp.asarray(v) for k, v in rows.items()})

  def _run_call(self, slots_wanted: int, slot_owner) -> Iterator[StreamEvent]:
    self._state, report = self._call(self._params, self._state, jnp.int32(slots_wanted))
    report = jax.device_get(report)  # the one device -> host transfer of this call
    self._host["host_syncs"] += 1
    self._host["device_calls"] += 1
    self._last = report
    clear = np.zeros(self.max_seqs, bool)
    events = []
    for s, owner in enumerate(slot_owner):
      if owner is None:
        continue
      req, f = owner
      start = int(report["start_S"][s])
      have = len(req.prompt) + len(req.tokens[f])
      end = int(report["len_S"][s])
      for j in range(have, end):
        tok = int(report["tokens_SK"][s, j - start])
        lp = float(report["logprobs_SK"][s, j - start])
        req.tokens[f].append(tok)
        req.logprobs[f].append(lp)
        self._host["tokens"] += 1
        events.append(StreamEvent(req.index, f, tok, lp if req.params.logprobs else None))
      if report["status_S"][s] == DONE:
        reason = REASONS[int(report["reason_S"][s])]
        events.append(StreamEvent(req.index, f, None, None, reason))
        slot_owner[s] = None
        clear[s] = True
    if clear.any():
      self._state = self._admit(self._state, jnp.asarray(clear),
                                {k: jnp.asarray(v) for k, v in self._rows().items()})
    yield from events

  def generate(self, prompts, params=None, *, cache_salt=None) -> list[Output]:
    """Serve ``prompts`` (token-id lists, or strings with a tokenizer) with ``params`` (one
    ``SamplingParams`` or one per prompt). Returns one ``Output`` per completion in prompt
    order, n consecutive ones for a prompt with ``n > 1``.

    ``cache_salt``: None, one str for every prompt, or one str (or None) per prompt. Prefix
    cache entries are shared only between requests with the same salt (none counts as one
    salt), so tenants that must not share pass different salts."""
    requests = self._requests(prompts, params, cache_salt)
    tokens = {}
    logprobs = {}
    finish = {}
    for ev in self._serve(requests):
      key = (ev.prompt_index, ev.sample_index)
      if ev.token_id is not None:
        tokens.setdefault(key, []).append(ev.token_id)
        logprobs.setdefault(key, []).append(ev.logprob)
      else:
        finish[key] = ev.finish_reason
    outputs = []
    for req in requests:
      for f in range(req.params.n):
        ids = tuple(tokens.get((req.index, f), ()))
        text = None
        if self.tokenizer is not None:
          text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        lps = tuple(logprobs.get((req.index, f), ())) if req.params.logprobs else None
        outputs.append(Output(req.index, f, req.prompt, ids, text, finish[(req.index, f)],
                              lps))
    return outputs

  def _slots_wanted(self, waiting: list[_Request]) -> int:
    """Free slots (in one data shard) that end a device call early for waiting requests:
    the first one's n, or more, up to a quarter of a shard's slots while enough requests
    wait, so that the host is not called back each time a single slot frees."""
    if not waiting:
      return 0
    batch = max(1, self._slots_per_shard // 4)
    total = 0
    for req in waiting:
      total += req.params.n
      if total >= batch:
        break
    return min(max(waiting[0].params.n, min(total, batch)), self._slots_per_shard)

  def _pick_bucket(self, want_S: np.ndarray) -> int:
    """The smallest token bucket holding the tokens one data shard's sequences want."""
    need = int(want_S.reshape(-1, self._slots_per_shard).sum(axis=1).max())
    return next((b for b in self.token_buckets if b >= need), self.token_buckets[-1])

  def _serve(self, requests: list[_Request]) -> Iterator[StreamEvent]:
    waiting = list(requests)
    slot_owner: list = [None] * self.max_seqs
    want_S = np.zeros(self.max_seqs, np.int64)
    t0 = time.perf_counter()
    try:
      while waiting or any(o is not None for o in slot_owner):
        self._fill_slots(waiting, slot_owner, want_S)
        self._bucket = self._pick_bucket(want_S)
        yield from self._run_call(self._slots_wanted(waiting), slot_owner)
        want_S = np.array(self._last["want_S"], np.int64)
    finally:
      # A stream abandoned (closed) mid-way leaves sequences in slots: drop them.
      left = np.array([o is not None for o in slot_owner])
      if left.any():
        self._state = self._abort(self._state, jnp.asarray(left))
      self._host["wall_s"] += time.perf_counter() - t0
      self._host["requests"] += len(requests)

  @property
  def stats(self) -> dict[str, Any]:
    """Counters since the engine was built or ``reset_stats`` (tokens_per_s and requests_per_s
    over the wall time spent inside generate / generate_stream). ``kv_utilization``: tokens
    stored / token slots of the blocks in use, mean over the steps that ran a batch."""
    r, h = self._last, self._host
    num_blocks = self.spec.num_blocks
    if r is None:
      steps = busy = preempt = peak = 0
      mean_blocks, util = 0.0, 1.0
    else:
      steps, busy = int(r["steps"]), int(r["busy_steps"])
      preempt, peak = int(r["preemptions"]), int(r["peak_blocks_in_use"])
      mean_blocks = float(r["blocks_in_use_sum"]) / max(steps, 1)
      util = float(r["utilization_sum"]) / busy if busy else 1.0
    tokens = h["tokens"]
    free = self._state.alloc.num_free  # read on demand, outside the serving loop
    free = int(free if self._plan is None else self._plan.fetch(free).sum())
    prompt_tokens = 0 if r is None else int(np.sum(r["prompt_tokens"]))
    cached_tokens = 0 if r is None else int(np.sum(r["cached_prompt_tokens"]))
    return dict(
        preemptions=preempt, kv_utilization=util,
        prefix_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        prompt_tokens=prompt_tokens, cached_prompt_tokens=cached_tokens,
        cached_blocks=0 if r is None else int(np.sum(r["cached_blocks"])),
        tokens_per_s=tokens / h["wall_s"] if h["wall_s"] > 0 else 0.0,
        requests_per_s=h["requests"] / h["wall_s"] if h["wall_s"] > 0 else 0.0,
        num_blocks=num_blocks, num_free_blocks=free, host_syncs=h["host_syncs"],
        host_syncs_per_token=h["host_syncs"] / tokens if tokens else 0.0,
        peak_blocks_in_use=peak, mean_blocks_in_use=mean_blocks, steps=steps,
        device_calls=h["device_calls"], generated_tokens=tokens, requests=h["requests"],
        wall_s=h["wall_s"])
