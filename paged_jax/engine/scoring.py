"""Prompt log-probs (``SamplingParams.prompt_logprobs``): what a scoring call computes on
the device, and what the host keeps of it.

While a request that asks for them is prefilling its prompt, the host makes scoring calls
(``device_call(..., scoring=True)``): the forward computes every row's logits, not one row
per sequence, and row t (sequence s, position p) scores token p + 1 of s where that is a
prompt token and s asks (``prompt_scores``). Such a call ends after ``SCORED_STEPS`` steps
that scored anything; its report holds their rows, which the host keeps (``read_scores``).
Their prompts take no prefix-cache hits (``device.schedule_step``): a cached token's
logits are never computed; the blocks they fill are registered as any other's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling import top_logprobs
from paged_jax.step import EveryRow

__all__ = ["SCORED_STEPS", "no_scores", "prompt_scores", "read_scores"]

SCORED_STEPS = 4
"""Steps that scored a prompt whose rows one scoring call reports (at most): the call ends
after that many, so a long prompt costs a host round trip per 4 steps of its prefill."""


def prompt_scores(rows: EveryRow, tokens_SJ, prompt_len_S, prompt_k_S, width: int) -> dict:
  """What a step's rows say of the prompt tokens after them, for the sequences that ask
  (``prompt_k_S`` >= 0: ``SamplingParams.prompt_logprobs``): a dict of ``[T]`` / ``[T, v]``
  arrays (v = ``width``): ``prompt_slot_T`` (the row's sequence s, or -1 where it scores
  nothing: padding, p + 1 past s's prompt, or s does not ask), ``prompt_pos_T`` (p + 1),
  ``prompt_logprob_T`` (that token's log-prob under the row's logits), and the row's
  ``width`` likeliest tokens, ``prompt_top_ids_Tv`` / ``prompt_top_logprobs_Tv``
  (``sampling.top_logprobs``, ranked only in a step where a scored row's sequence asks for
  k > 0; a listed token's log-prob is its ``prompt_logprob_T`` exactly: both are its logit
  less the row's logsumexp)."""
  logits_TV = rows.logits_TV.astype(jnp.float32)
  next_T = rows.positions_T + 1
  k_T = prompt_k_S[rows.seq_T]
  scored_T = rows.live_T & (next_T < prompt_len_S[rows.seq_T]) & (k_T >= 0)
  token_T = tokens_SJ[rows.seq_T, jnp.clip(next_T, 0, tokens_SJ.shape[1] - 1)]
  lse_T = jax.nn.logsumexp(logits_TV, axis=-1)
  logprob_T = jnp.take_along_axis(logits_TV, token_T[:, None], axis=-1)[:, 0] - lse_T
  nothing = no_scores(logits_TV.shape[0], width)
  top_ids_Tv, top_logprobs_Tv = jax.lax.cond(
      jnp.any(scored_T & (k_T > 0)), lambda: top_logprobs(logits_TV, width),
      lambda: (nothing["prompt_top_ids_Tv"], nothing["prompt_top_logprobs_Tv"]))
  return dict(prompt_slot_T=jnp.where(scored_T, rows.seq_T, -1), prompt_pos_T=next_T,
              prompt_logprob_T=logprob_T, prompt_top_ids_Tv=top_ids_Tv,
              prompt_top_logprobs_Tv=top_logprobs_Tv)


def no_scores(num_tokens: int, width: int) -> dict:
  """``prompt_scores``' arrays for a step that scored nothing."""
  return dict(prompt_slot_T=jnp.full(num_tokens, -1, jnp.int32),
              prompt_pos_T=jnp.zeros(num_tokens, jnp.int32),
              prompt_logprob_T=jnp.zeros(num_tokens, jnp.float32),
              prompt_top_ids_Tv=jnp.full((num_tokens, width), -1, jnp.int32),
              prompt_top_logprobs_Tv=jnp.full((num_tokens, width), -jnp.inf, jnp.float32))


def read_scores(report: dict, slot_owner, num_shards: int, slots_per_shard: int) -> None:
  """Keep the prompt log-probs a scoring call's ``report`` holds in the ``Request``s that
  asked (``slot_owner[s]``: ``(request, completion)`` or None): rows of data shard k come
  k-th (``SCORED_STEPS`` x T each), their slots the shard's. A position is kept once: a
  prompt recomputed (after a preemption) may differ in the last bits, and every event
  tells the first."""
  slot_T = np.asarray(report["prompt_slot_T"])
  num_rows = slot_T.shape[0] // num_shards
  for t in np.flatnonzero(slot_T >= 0):
    owner = slot_owner[(t // num_rows) * slots_per_shard + int(slot_T[t])]
    req = None if owner is None else owner[0]
    pos = int(report["prompt_pos_T"][t])
    if (req is None or req.prompt_logprobs is None or not 0 < pos < len(req.prompt)
        or req.prompt_logprobs[pos] is not None):
      continue
    req.prompt_unscored -= 1
    req.prompt_logprobs[pos] = float(report["prompt_logprob_T"][t])
    if req.prompt_top_logprobs is not None:
      k = req.params.prompt_logprobs
      req.prompt_top_logprobs[pos] = dict(zip(report["prompt_top_ids_Tv"][t, :k].tolist(),
                                              report["prompt_top_logprobs_Tv"][t, :k].tolist()))
