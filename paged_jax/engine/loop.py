"""The engine's device call: ``lax.while_loop`` over scheduling steps
(``paged_jax.engine.device``, whose docstring tells what a step does), and the report the
host reads after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax import allocator
from paged_jax import protocol
from paged_jax._promotion import standard_promotion
from paged_jax.engine.device import schedule_step
from paged_jax.engine.scoring import SCORED_STEPS, no_scores
from paged_jax.engine.state import (DONE, FORK_WAIT, FREE, RUNNING, EngineState,
                                    restart_counters, want_S)

__all__ = ["device_call"]


@standard_promotion
def device_call(graphdef, params, st: EngineState, slots_wanted, step_limit, *,
                steps_per_call: int,
                num_tokens: int, scrub_on_release: bool = False, prefix_caching: bool = False,
                hash_fn=allocator.chain_hashes, downshift_at: int = 0, upshift: bool = False,
                kv_groups=None, vocab_size: int = 0, scoring: bool = False):
  """Up to ``steps_per_call`` steps in one ``while_loop``; returns the state and a report.

  The loop stops after ``step_limit`` (i32[], a caller's cap below ``steps_per_call``: one
  compiled loop serves every cap) steps, early when no sequence is left running, or when
  enough slots have come
  free for the host's waiting requests (``slots_wanted`` i32[], 0 if none wait). Token
  buckets: ``num_tokens`` is this call's step budget, one of the engine's compiled sizes;
  the loop also stops once the tokens the running sequences still want (their history not
  in the cache) fit the next smaller size (``downshift_at``, 0: none) or, ``upshift``,
  exceed this one, so the host picks the size that fits. The pool never passes through a
  ``switch`` (XLA would copy it each step).

  ``scoring``: the variant the host calls while a request that asks for prompt log-probs
  is prefilling its prompt: every row's logits are computed, and the report carries the
  ``prompt_scores`` of the steps that scored a prompt token (of a sequence that asks), up
  to ``scoring.SCORED_STEPS`` of them: the loop stops after that many.
  """
  st = restart_counters(st)  # the report counts this call; the host sums them
  start_S = jnp.where(st.status_S == RUNNING, st.len_S, st.prompt_len_S)
  max_len = st.tokens_SJ.shape[1]
  # A slot gains a token a step at most, and never past max_len: min(steps, max_len) wide.
  width = min(steps_per_call, max_len)

  def cond(c):
    _, i, stop, _, _ = c
    return (i < steps_per_call) & (i < step_limit) & ~stop

  def body(c):
    st, i, _, top, scores = c
    len_before_S = st.len_S
    # The model is built inside the loop's trace: a model that runs Flax transforms of its
    # own (``nnx.scan`` over layers) refuses graph nodes made at another trace level.
    model = protocol.merge(graphdef, params)
    st = schedule_step(model, st, num_tokens=num_tokens, scrub_on_release=scrub_on_release,
                       prefix_caching=prefix_caching, hash_fn=hash_fn, kv_groups=kv_groups,
                       vocab_size=vocab_size, scoring=scoring)
    if scoring:  # this step's scores into the report's next row while it has one
      st, step_scores = st
      rows, n = scores
      rows = {k: r.at[n].set(step_scores[k]) for k, r in rows.items()}
      n += jnp.any(step_scores["prompt_slot_T"] >= 0).astype(jnp.int32)
      scores = rows, n  # n < scored_steps, or the loop stops here
    active = jnp.any((st.status_S == RUNNING) | (st.status_S == FORK_WAIT))
    free = jnp.sum((st.status_S == FREE) | (st.status_S == DONE))
    stop = ~active | ((slots_wanted > 0) & (free >= slots_wanted))
    if scoring:  # the report holds scored_steps steps' scores
      stop |= n >= scored_steps
    pending = jnp.sum(want_S(st))
    if downshift_at:
      stop |= pending <= downshift_at
    if upshift:
      stop |= pending > num_tokens
    # The likeliest tokens of each token the step appended, at the token's report column.
    slot_S = jnp.arange(st.len_S.shape[0])
    # (A fork's child starts at its parent's length: a stop drawn there appends nothing.)
    col_S = st.len_S - 1 - start_S
    col_S = jnp.where((st.len_S > len_before_S) & (col_S >= 0), col_S, width)
    top = (top[0].at[slot_S, col_S].set(st.top_ids_Sv, mode="drop"),
           top[1].at[slot_S, col_S].set(st.top_logprobs_Sv, mode="drop"))
    return st, i + 1, stop, top, scores

  num_slots, v = st.top_ids_Sv.shape
  top = (jnp.full((num_slots, width, v), -1, jnp.int32),
         jnp.full((num_slots, width, v), -jnp.inf, jnp.float32))
  scores, scored_steps = (), min(SCORED_STEPS, steps_per_call)
  if scoring:
    scores = ({k: jnp.broadcast_to(x, (scored_steps,) + x.shape)
               for k, x in no_scores(num_tokens, v).items()}, jnp.int32(0))
  st, _, _, top, scores = jax.lax.while_loop(
      cond, body, (st, jnp.int32(0), jnp.bool_(False), top, scores))
  # The scored steps' rows one after another: [scored_steps * T, ...].
  scores = {k: r.reshape((-1,) + r.shape[2:]) for k, r in scores[0].items()} if scoring else {}
  idx_SK = jnp.clip(start_S[:, None] + jnp.arange(width)[None, :], 0, max_len - 1)
  report = dict(
      status_S=st.status_S, len_S=st.len_S, reason_S=st.reason_S, start_S=start_S,
      stop_id_S=st.stop_id_S, want_S=want_S(st),
      tokens_SK=jnp.take_along_axis(st.tokens_SJ, idx_SK, axis=1),
      logprobs_SK=jnp.take_along_axis(st.logprobs_SJ, idx_SK, axis=1),
      top_ids_SKv=top[0], top_logprobs_SKv=top[1],
      steps=st.steps, preemptions=st.preemptions, generated=st.generated,
      blocks_in_use_sum=st.blocks_in_use_sum, peak_blocks_in_use=st.peak_blocks_in_use,
      utilization_sum=st.utilization_sum, busy_steps=st.busy_steps,
      num_free=st.alloc.num_free, prompt_tokens=st.prompt_tokens,
      cached_prompt_tokens=st.cached_prompt_tokens, **scores)
  return st, report


