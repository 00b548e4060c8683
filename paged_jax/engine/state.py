"""The engine's device-side state: one pytree, ``EngineState``, and the small jit-able edits
the host makes to it between device calls (admit rows, abort sequences).

One row per sequence slot (S = ``max_seqs``; allocator slot s is engine slot s): the token
history ``tokens_SJ`` (prompt + generated, J = ``max_model_len``), its length ``len_S``, the
tokens already in the KV cache (the allocator's ``seq_lens``), the slot status (free /
running / done / waiting for its fork), arrival order, per-request sampling parameters and
stop ids; then the counters ``stats`` reads.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import allocator
from paged_jax._promotion import standard_promotion
from paged_jax.kv_cache import KVCache
from paged_jax.pallas_kernels import layout
from paged_jax.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from paged_jax.spec import KVCacheSpec

__all__ = ["EngineState", "FREE", "RUNNING", "DONE", "FORK_WAIT", "REASONS", "MAX_STOP_IDS",
           "ROW_FIELDS", "ADMIT_ROWS", "admit", "abort", "host_rows", "row_chunks",
           "fill_row", "init_state", "want_S", "scrub_freed", "zero_blocks", "COUNTERS",
           "restart_counters", "add_counters"]

FREE, RUNNING, DONE, FORK_WAIT = 0, 1, 2, 3
"""Slot status values of ``EngineState.status_S``."""
REASONS = {1: "stop", 2: "length"}
MAX_STOP_IDS = 16
"""Stop ids per request (EOS ids included), the static width i of ``stop_Si``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
  """All device-side engine state (module docstring); S slots, J = max_model_len, i = stop
  ids (MAX_STOP_IDS), b = biased ids (``sampling.MAX_LOGIT_BIAS``)."""

  alloc: allocator.AllocatorState
  cache: KVCache
  tokens_SJ: jax.Array  # i32[S, J] token history: prompt, then generated
  logprobs_SJ: jax.Array  # f32[S, J] log-prob of each generated token at its position
  len_S: jax.Array  # i32[S] history length
  prompt_len_S: jax.Array  # i32[S] original prompt length
  max_len_S: jax.Array  # i32[S] finish with "length" when len reaches it
  status_S: jax.Array  # i32[S] FREE / RUNNING / DONE / FORK_WAIT
  reason_S: jax.Array  # i32[S] 0 none, 1 stop, 2 length
  stop_id_S: jax.Array  # i32[S] the stop id that finished it (reason 1), else -1
  arrival_S: jax.Array  # i32[S] arrival order (smaller = earlier = higher priority)
  parent_S: jax.Array  # i32[S] slot to fork from (FORK_WAIT slots)
  fork_S: jax.Array  # i32[S] completion index
  seed_S: jax.Array  # u32[S]
  temperature_S: jax.Array  # f32[S]
  top_k_S: jax.Array  # i32[S]
  top_p_S: jax.Array  # f32[S]
  min_p_S: jax.Array  # f32[S]
  repetition_penalty_S: jax.Array  # f32[S]
  presence_penalty_S: jax.Array  # f32[S]
  frequency_penalty_S: jax.Array  # f32[S]
  min_tokens_S: jax.Array  # i32[S]
  top_n_S: jax.Array  # i32[S] top log-probs asked for (SamplingParams.top_logprobs)
  prompt_k_S: jax.Array  # i32[S] SamplingParams.prompt_logprobs (-1: None)
  stop_Si: jax.Array  # i32[S, i] stop ids, -1 padding
  bias_ids_Sb: jax.Array  # i32[S, b] ids of logit_bias (or allowed_token_ids), -1 padding
  bias_Sb: jax.Array  # f32[S, b] their biases
  allowed_only_S: jax.Array  # bool[S] bias_ids_Sb are SamplingParams.allowed_token_ids
  salt_S: jax.Array  # i32[S] prefix-cache salt (interned ``cache_salt``; 0 = none)
  fresh_S: jax.Array  # bool[S] prompt not admitted yet (counted once in the hit rate)
  waited_S: jax.Array  # bool[S] has sat out a step for a block another was filling
  # The likeliest tokens of each slot's last draw and their log-probs, v = MAX_TOP_LOGPROBS
  # (-1 and -inf past the vocabulary); set only in steps where some slot asks for them.
  top_ids_Sv: jax.Array  # i32[S, v]
  top_logprobs_Sv: jax.Array  # f32[S, v]
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


# Each row field's (dtype, fill value, trailing shape: "J" = max_model_len, "i" = stop ids,
# "b" = biased ids).
_ROW_LAYOUT = dict(
    tokens_SJ=(np.int32, 0, "J"), logprobs_SJ=(np.float32, 0, "J"), len_S=(np.int32, 0, ""),
    prompt_len_S=(np.int32, 0, ""), max_len_S=(np.int32, 0, ""), status_S=(np.int32, FREE, ""),
    reason_S=(np.int32, 0, ""), stop_id_S=(np.int32, -1, ""), arrival_S=(np.int32, 0, ""),
    parent_S=(np.int32, 0, ""), fork_S=(np.int32, 0, ""), seed_S=(np.uint32, 0, ""),
    temperature_S=(np.float32, 0, ""), top_k_S=(np.int32, 0, ""), top_p_S=(np.float32, 1, ""),
    min_p_S=(np.float32, 0, ""), repetition_penalty_S=(np.float32, 1, ""),
    presence_penalty_S=(np.float32, 0, ""), frequency_penalty_S=(np.float32, 0, ""),
    min_tokens_S=(np.int32, 0, ""), top_n_S=(np.int32, 0, ""), prompt_k_S=(np.int32, -1, ""),
    stop_Si=(np.int32, -1, "i"),
    bias_ids_Sb=(np.int32, -1, "b"), bias_Sb=(np.float32, 0, "b"),
    allowed_only_S=(np.bool_, False, ""),
    salt_S=(np.int32, 0, ""), fresh_S=(np.bool_, False, ""), waited_S=(np.bool_, False, ""))
ROW_FIELDS = tuple(_ROW_LAYOUT)
"""The per-slot fields the host writes when it admits (or clears) a slot."""


def _empty_rows(xp, max_seqs: int, max_model_len: int) -> dict:
  sizes = {"J": (max_model_len,), "i": (MAX_STOP_IDS,), "b": (MAX_LOGIT_BIAS,), "": ()}
  return {name: xp.full((max_seqs,) + sizes[tail], fill, dtype)
          for name, (dtype, fill, tail) in _ROW_LAYOUT.items()}


def host_rows(max_seqs: int, max_model_len: int) -> dict[str, np.ndarray]:
  """Empty per-slot rows on the host (numpy), as a free slot holds them."""
  return _empty_rows(np, max_seqs, max_model_len)


ADMIT_ROWS = 16
"""Slots one ``admit`` writes per data shard (r, at most the shard's slots): admitting
costs the rows it writes (8 bytes x ``max_model_len`` each, and 2.4 KB of logit bias), not
every slot's."""


def row_chunks(entries, *, max_model_len: int, shards: int, slots_per_shard: int):
  """The host rows of ``entries`` in the chunks ``admit`` takes: ``(slot_r, rows)`` pairs.

  ``entries``: ``(slot, values)`` pairs, ``slot`` a global slot id (shard ``slot //
  slots_per_shard``), ``values`` a dict of row fields; a field left out keeps a free slot's
  fill, a ``J`` / ``i`` / ``b`` field (a list) fills its row from position 0. Each chunk has
  ``shards * r`` rows, ``r = min(ADMIT_ROWS, slots_per_shard)``: shard k's in rows ``[k * r,
  (k + 1) * r)``, their slot ids within the shard, the unused ones ``slots_per_shard``
  (past the end: ``admit`` writes nothing there). Shapes are fixed, so nothing recompiles.
  """
  r = min(ADMIT_ROWS, slots_per_shard)
  by_shard = [[] for _ in range(shards)]
  for slot, values in entries:
    by_shard[slot // slots_per_shard].append((slot % slots_per_shard, values))
  for start in range(0, max(map(len, by_shard)), r):
    slot_r = np.full(shards * r, slots_per_shard, np.int32)
    rows = host_rows(shards * r, max_model_len)
    for k, shard_entries in enumerate(by_shard):
      for i, (slot, values) in enumerate(shard_entries[start:start + r], start=k * r):
        slot_r[i] = slot
        fill_row(rows, i, values)
    yield slot_r, rows


def fill_row(rows: dict[str, np.ndarray], i: int, values: dict) -> None:
  """Write ``values`` (row fields; a ``J`` / ``i`` / ``b`` field a list, from position 0)
  into row ``i`` of the host ``rows``; the other fields keep what they hold."""
  for name, value in values.items():
    if rows[name].ndim == 2:
      rows[name][i, :len(value)] = value
    else:
      rows[name][i] = value


def _zero_counters() -> dict:
  zf = lambda: jnp.zeros((), jnp.float32)
  return dict(steps=jnp.int32(0), preemptions=jnp.int32(0), generated=jnp.int32(0),
              blocks_in_use_sum=zf(), peak_blocks_in_use=jnp.int32(0), utilization_sum=zf(),
              busy_steps=jnp.int32(0), prompt_tokens=jnp.int32(0),
              cached_prompt_tokens=jnp.int32(0))


@standard_promotion
def init_state(spec: KVCacheSpec, max_seqs: int, max_model_len: int, *,
               windows=None) -> EngineState:
  """An empty engine: every slot free, every block free, counters 0. ``windows``: the KV
  groups' windows (``KVGroups.windows``; default one full group); ``spec.num_layers`` is
  then the layers of one group (the cache's layers)."""
  p = math.ceil(max_model_len / spec.block_size)
  rows = _empty_rows(jnp, max_seqs, max_model_len)
  return EngineState(alloc=allocator.init(spec.num_blocks, spec.block_size, max_seqs, p,
                                          windows=windows),
                     cache=KVCache.create(spec), **rows,
                     top_ids_Sv=jnp.full((max_seqs, MAX_TOP_LOGPROBS), -1, jnp.int32),
                     top_logprobs_Sv=jnp.full((max_seqs, MAX_TOP_LOGPROBS), -jnp.inf,
                                              jnp.float32),
                     **_zero_counters())


COUNTERS = tuple(_zero_counters())
"""The counter fields: each device call counts from 0 (``restart_counters``) and the host
adds its report to unbounded totals (``add_counters``), so no int32 wraps and no float32
sum stops growing on a long-lived engine (2**31 prompt tokens, 2**24 busy steps)."""


def lost(st: EngineState) -> bool:
  """Whether ``st``'s buffers were given to a donating device call whose result never came
  back (an interrupt, e.g. Ctrl-C, between the call and the assignment of its result)."""
  return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(st))


def restart_counters(st: EngineState) -> EngineState:
  """``st``'s counters at 0, their shapes (and shardings) kept: the start of a call."""
  return dataclasses.replace(st, **{k: jnp.zeros_like(getattr(st, k)) for k in COUNTERS})


def add_counters(totals: dict, report: dict) -> None:
  """Add one call's counters (its report, on the host) to ``totals`` (Python numbers; the
  peak is a maximum)."""
  for key in (k for k in COUNTERS if k in report):  # (a test's hand-made report has none)
    value = np.asarray(report[key])
    value = value.max() if key == "peak_blocks_in_use" else value.sum()
    value = float(value) if value.dtype.kind == "f" else int(value)
    totals[key] = (max(totals.get(key, 0), value) if key == "peak_blocks_in_use"
                   else totals.get(key, 0) + value)


def want_S(st: EngineState) -> jax.Array:
  """i32[S]: tokens each running sequence still needs K/V for (its uncached history)."""
  return jnp.where(st.status_S == RUNNING, st.len_S - st.alloc.seq_lens, 0)


def zero_blocks(cache: KVCache, mask_N: jax.Array) -> KVCache:
  """Zero the blocks with ``mask_N`` True in every layer; a ``lax.cond`` skips the pass over
  the pool when there are none."""

  n_axis = layout.PAGES_AXES.index("N")  # the same axis in the pages and their scales

  def scrub(cache):
    def zero(x):  # storage bits (zero bits are the value 0) and a quantised pool's scales
      m = mask_N.reshape([-1 if a == n_axis else 1 for a in range(x.ndim)])
      return jnp.where(m, jnp.zeros((), x.dtype), x)
    return jax.tree.map(zero, cache)

  return jax.lax.cond(jnp.any(mask_N), scrub, lambda cache: cache, cache)


def _unowned_N(alloc: allocator.AllocatorState) -> jax.Array:
  """bool[N]: blocks whose K/V nobody may read: free and not a prefix-cache entry."""
  return (alloc.ref_counts == 0) & (alloc.depth_N < 0)


def scrub_freed(cache: KVCache, before: allocator.AllocatorState,
                after: allocator.AllocatorState) -> KVCache:
  """Zero every block that nobody may read in ``after`` but could in ``before`` (scrub on
  release). A freed block that stays in the prefix cache keeps its K/V until evicted."""
  return zero_blocks(cache, _unowned_N(after) & ~_unowned_N(before))


@standard_promotion
def admit(st: EngineState, slot_r, rows: dict) -> EngineState:
  """Overwrite the rows of slots ``slot_r`` (i32[r]) by ``rows`` (each field's ``[r, ...]``,
  host -> device; ``row_chunks``). A slot id past the last slot (padding) writes nothing."""
  updates = {}
  for name in ROW_FIELDS:
    old = getattr(st, name)
    updates[name] = old.at[slot_r].set(rows[name].astype(old.dtype), mode="drop")
  return dataclasses.replace(st, **updates)


@standard_promotion
def abort(st: EngineState, mask_S, *, scrub_on_release: bool = False) -> EngineState:
  """Drop the sequences of ``mask_S`` (an abandoned stream): release their blocks, free slots."""
  alloc = allocator.release(st.alloc, mask_S)
  cache = scrub_freed(st.cache, st.alloc, alloc) if scrub_on_release else st.cache
  return dataclasses.replace(st, alloc=alloc, cache=cache,
                             status_S=jnp.where(mask_S, FREE, st.status_S))
