"""The engine's host side: requests, slots, token buckets, reading each call's report.

Between device calls the host only admits waiting requests into free slots (one jitted
merge, host -> device) and reads one small report (status, lengths, the tokens of this call,
counters): one device -> host transfer per call, counted in ``stats["host_syncs"]``.
Requests are admitted first come, first served; the slots of one request (its n
completions) lie in one data shard. Each call runs at the smallest token bucket holding
the tokens its sequences want (``pick_bucket``) and ends early when enough slots come free
for the waiting requests (``slots_wanted``). While a request that asks for prompt log-probs
is prefilling, calls are scoring ones (``paged_jax.engine.scoring``).

Outputs. ``generate`` returns one ``Output`` per completion in prompt order; a request with
``n > 1`` contributes n consecutive Outputs (``sample_index`` 0 .. n-1).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import abc
from typing import Sequence

import numpy as np

from paged_jax.engine.results import Output, StreamEvent
from paged_jax.engine.salts import SaltIds
from paged_jax.engine.scoring import read_scores
from paged_jax.engine.state import (DONE, FORK_WAIT, MAX_STOP_IDS, REASONS, RUNNING,
                                    add_counters)
from paged_jax.engine.text import CompletionText, encode_prompt
from paged_jax.sampling import SamplingParams
from paged_jax.sharding import pick_slots

ARRIVAL_LIMIT = 2 ** 31 - 1  # arrival_S is int32

__all__ = ["Output", "Request", "Scheduler", "StreamEvent", "default_token_buckets"]


@dataclasses.dataclass
class Request:
  """Host bookkeeping of one prompt (its n completions)."""

  index: int
  prompt: tuple[int, ...]
  params: SamplingParams
  seed: int | None  # None until drawn (once the call's requests are all valid)
  stop: tuple[int, ...]
  salt: str | None = None  # cache_salt (interned when admitted)
  arrival: int = -1
  tokens: list = dataclasses.field(default_factory=list)  # per completion
  texts: list = dataclasses.field(default_factory=list)  # CompletionText (None: no tokenizer)
  # SamplingParams.prompt_logprobs: each prompt token's log-prob and likeliest tokens, as
  # scoring calls report them (None until then; position 0 stays None).
  prompt_logprobs: list | None = None
  prompt_top_logprobs: list | None = None
  prompt_unscored: int = 0  # positions still to be scored (the variant runs while > 0)
  prompt_sent: set = dataclasses.field(default_factory=set)  # completions told them

  def prompt_fields(self, f: int) -> dict:
    """``StreamEvent``'s prompt log-prob fields for completion ``f``'s next event: set on
    its first only."""
    if self.prompt_logprobs is None or f in self.prompt_sent:
      return {}
    self.prompt_sent.add(f)
    return dict(prompt_logprobs=list(self.prompt_logprobs),
                prompt_top_logprobs=None if self.prompt_top_logprobs is None
                else list(self.prompt_top_logprobs))

  def __post_init__(self):
    k = self.params.prompt_logprobs
    if k is not None:
      self.prompt_logprobs = [None] * len(self.prompt)
      self.prompt_top_logprobs = [None] * len(self.prompt) if k else None
      self.prompt_unscored = len(self.prompt) - 1


def default_token_buckets(max_tokens_per_step: int, max_seqs: int) -> tuple[int, ...]:
  """Token budgets the engine compiles a device call for: the smallest holds a decode row of
  every slot (at least 32), each next is 4x larger, the last is ``max_tokens_per_step``."""
  sizes, size = [], max(32, max_seqs)
  while size < max_tokens_per_step:
    sizes.append(size)
    size *= 4
  return tuple(sizes) + (max_tokens_per_step,)


def progress_key(report: dict) -> tuple:
  """What a device call that makes progress changes: tokens, KV, slots, free blocks."""
  return tuple(np.asarray(report[k]).tobytes()
               for k in ("status_S", "len_S", "want_S", "num_free"))


class Scheduler:
  """Host-side scheduling of one engine (module docstring).

  Args:
    max_seqs: S slots in all; ``slots_per_shard`` of them per data shard.
    max_model_len: M, longest sequence.
    token_buckets: the compiled step budgets, increasing.
    vocab_size, eos: the model config's vocabulary size and EOS ids.
    limit_note: what bounds ``max_model_len`` (for error messages).
    live_salts: the salt ids the device state holds (``salts.engine_live_salts``).
    tokenizer: optional ``tokenizers.Tokenizer`` for string prompts.
    seed: seeds the draw of seeds for requests without one.
  """

  def __init__(self, *, max_seqs: int, slots_per_shard: int, max_model_len: int,
               token_buckets: tuple[int, ...], vocab_size: int, eos: tuple[int, ...],
               limit_note: str, live_salts=lambda: (), tokenizer=None, seed: int = 0):
    self.max_seqs, self.slots_per_shard = max_seqs, slots_per_shard
    self.max_model_len, self.token_buckets = max_model_len, token_buckets
    self.vocab_size, self.eos, self.limit_note = vocab_size, eos, limit_note
    self.tokenizer, self._rng = tokenizer, np.random.default_rng(seed)
    self._arrivals, self.salts = 0, SaltIds(live_salts)
    self.serving = False  # a session (or stream) is open: it holds the slots (``claim``)
    self._claim_lock = threading.Lock()
    self.unclean = False  # a session's last abort did not finish: slots may still be taken
    self.reset_counters()

  def check_idle(self) -> None:
    """Refuses to start serving while an earlier stream or session is open: its sequences
    still hold slots and blocks on the device, which a second one would hand out again
    (wrong tokens, or a stall). A stream is open from its first event until it is
    exhausted or closed; a session from ``LLM.session()`` until its ``close()``."""
    if self.serving:
      raise RuntimeError(
          "an earlier generate_stream or session of this engine is still open (a stream "
          "iterated but neither exhausted nor closed, or a session not closed), and its "
          "sequences hold the engine's slots: call its .close() (which drops its unfinished "
          "requests) or iterate the stream to the end first; one generate / "
          "generate_stream / session at a time per engine (a generate running in another "
          "thread is refused too: threads sharing an engine need a lock, or one session)")

  def claim(self) -> None:
    """``check_idle``, then the engine is the caller's until ``serving`` is cleared: one
    check-and-set, so two threads never both get it."""
    with self._claim_lock:
      self.check_idle()
      self.serving = True

  def draw_seed(self) -> int:
    """A seed for a request without one, from the engine's ``seed``."""
    return int(self._rng.integers(0, 2 ** 32))

  def reset_counters(self) -> None:
    self.counters = dict(host_syncs=0, device_calls=0, wall_s=0.0, tokens=0, requests=0)
    self.device_counters: dict = {}  # the device's counters summed over calls (stats)

  # --- requests ---

  def check(self, prompts, params, cache_salt=None) -> None:
    """``requests``' checks alone: no seed is drawn for unseeded requests (a later
    ``generate`` samples as if this had not run)."""
    self.requests(prompts, params, cache_salt)

  def requests(self, prompts, params, cache_salt=None, *,
               text_per_token: bool = True) -> list[Request]:
    """Validate a ``generate`` call's arguments (``ValueError`` naming the request). Draws
    nothing: unseeded requests get their seeds when queued in a session (a stream's at its
    first event), salts their ids when admitted, so a refused call, or a stream never
    iterated, changes nothing.
    ``text_per_token``: each token event carries its text (else only the last event)."""
    if getattr(prompts, "ndim", None) == 2:  # a [B, T] array (NumPy or JAX): B prompts
      prompts = list(np.asarray(prompts))
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
      raise ValueError(f"prompts={type(prompts).__name__}{getattr(prompts, 'shape', '')} must "
                       "be a list of prompts or a [B, T] array of B prompts (one prompt: put it "
                       "in a list)")
    salts = self.salts.check(cache_salt, len(prompts))
    if params is None:
      params = SamplingParams()
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if isinstance(params, (str, bytes, abc.Mapping)) or not isinstance(params, abc.Iterable):
      raise ValueError(f"params={type(params).__name__} must be a SamplingParams or a list "
                       "of them, one per prompt")
    params = list(params)
    if len(params) != len(prompts):
      raise ValueError(f"len(params)={len(params)} must equal len(prompts)={len(prompts)}")
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      if not isinstance(p, SamplingParams):
        raise ValueError(f"params[{i}]={p!r} must be a SamplingParams")
      ids = encode_prompt(i, prompt, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                          max_model_len=self.max_model_len, limit_note=self.limit_note,
                          keep_last=p.truncate_prompt_tokens)
      if p.n > self.slots_per_shard:  # a request's slots are in one data shard
        shards = self.max_seqs // self.slots_per_shard
        per_shard = "" if shards == 1 else f" / {shards} data shards"
        raise ValueError(f"params[{i}].n={p.n} must be <= max_seqs={self.max_seqs}"
                         f"{per_shard}")
      outside = [t for t in p.stop_token_ids if t >= self.vocab_size]
      if outside:  # could never be generated, so never stop anything: a mistake
        raise ValueError(f"params[{i}].stop_token_ids={p.stop_token_ids} holds {outside}, "
                         f"outside the vocabulary [0, vocab_size={self.vocab_size})")
      biased_outside = [t for t, _ in p.logit_bias if t >= self.vocab_size]
      if biased_outside:
        raise ValueError(f"params[{i}].logit_bias biases {biased_outside}, outside the "
                         f"vocabulary [0, vocab_size={self.vocab_size})")
      allowed = p.allowed_token_ids or ()
      if allowed and allowed[-1] >= self.vocab_size:
        raise ValueError(f"params[{i}].allowed_token_ids holds "
                         f"{[t for t in allowed if t >= self.vocab_size]}, outside the "
                         f"vocabulary [0, vocab_size={self.vocab_size})")
      for name in ("top_logprobs", "prompt_logprobs"):
        if (getattr(p, name) or 0) > self.vocab_size:
          raise ValueError(f"params[{i}].{name}={getattr(p, name)} must be <= vocab_size="
                           f"{self.vocab_size}")
      if p.stop and self.tokenizer is None:
        raise ValueError(f"params[{i}].stop={p.stop} needs the engine's tokenizer to read "
                         "the text, and it has none (pass LLM(..., tokenizer=...))")
      stop = tuple(dict.fromkeys(p.stop_token_ids + (() if p.ignore_eos else self.eos)))
      if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"params[{i}].stop_token_ids: {len(stop)} stop ids (EOS included) "
                         f"must be <= {MAX_STOP_IDS}")
      if allowed and p.min_tokens and set(allowed) <= set(stop):
        raise ValueError(f"params[{i}].allowed_token_ids={allowed} are all stop ids (EOS "
                         f"included), which min_tokens={p.min_tokens} bars: no token could "
                         "be drawn")
      out.append(Request(index=i, prompt=ids, params=p, seed=p.seed, stop=stop,
                         salt=salts[i], tokens=[[] for _ in range(p.n)], texts=[
                             None if self.tokenizer is None else CompletionText(
                                 self.tokenizer, p.stop, p.include_stop_str_in_output,
                                 per_token=text_per_token, min_tokens=p.min_tokens,
                                 skip_special_tokens=p.skip_special_tokens)
                             for _ in range(p.n)]))
    return out

  # --- one serving loop ---

  def fill_slots(self, waiting: list[Request], slot_owner, want_S: np.ndarray):
    """Admit waiting requests (FCFS) into free slots. Returns the admitted slots' rows,
    ``(slot, values)`` pairs for ``admit`` (``state.row_chunks``); empty when nobody was
    admitted. ``want_S`` (the host's view of the tokens each slot still needs) gets the
    admitted prompts."""
    free = [s for s, o in enumerate(slot_owner) if o is None]
    # Arrivals rank the sequences in slots only: with none (a new session among them) they
    # count from 0 again.
    if len(free) == len(slot_owner):
      self._arrivals = 0
    entries, held = [], set()  # held: the salt ids given out here, not on the device yet
    # Slots of one request lie in one data shard, the emptiest (one shard: the first n).
    # A session never idle for 2**31 admissions admits no more until its slots empty.
    while waiting and self._arrivals < ARRIVAL_LIMIT and (slots := pick_slots(
        free, waiting[0].params.n, self.slots_per_shard)) is not None:
      req = waiting.pop(0)
      req.arrival, self._arrivals = self._arrivals, self._arrivals + 1
      p, n_prompt = req.params, len(req.prompt)
      free = [s for s in free if s not in slots]
      for f, s in enumerate(slots):
        slot_owner[s] = (req, f)
        entries.append((s, dict(
            tokens_SJ=req.prompt, len_S=n_prompt if f == 0 else 0, prompt_len_S=n_prompt,
            max_len_S=min(n_prompt + p.max_tokens, self.max_model_len),
            status_S=RUNNING if f == 0 else FORK_WAIT, arrival_S=req.arrival,
            parent_S=slots[0] % self.slots_per_shard,  # slot within its shard
            fork_S=f, seed_S=req.seed, temperature_S=p.temperature, top_k_S=p.top_k,
            top_p_S=p.top_p, min_p_S=p.min_p, repetition_penalty_S=p.repetition_penalty,
            presence_penalty_S=p.presence_penalty, frequency_penalty_S=p.frequency_penalty,
            min_tokens_S=p.min_tokens, top_n_S=p.top_logprobs,
            prompt_k_S=-1 if p.prompt_logprobs is None else p.prompt_logprobs,
            stop_Si=req.stop,
            **bias_rows(p),
            salt_S=self.salts.intern(req.salt, held),
            fresh_S=f == 0)))
        want_S[s] = n_prompt if f == 0 else 0
    return entries

  def read_report(self, report: dict, slot_owner) -> tuple[list[StreamEvent], np.ndarray,
                                                           np.ndarray]:
    """The events of one call's report, the slots whose completion finished, and those of
    them whose text reached a stop string (still running on the device: to abort)."""
    for counter in ("host_syncs", "device_calls"):
      self.counters[counter] += 1
    add_counters(self.device_counters, report)
    if "prompt_slot_T" in report:
      read_scores(report, slot_owner, self.max_seqs // self.slots_per_shard,
                  self.slots_per_shard)
    clear, stopped = np.zeros(self.max_seqs, bool), np.zeros(self.max_seqs, bool)
    events = []
    for s, owner in enumerate(slot_owner):
      if owner is None:
        continue
      req, f = owner
      text = req.texts[f]
      start = int(report["start_S"][s])
      have = len(req.prompt) + len(req.tokens[f])
      end = int(report["len_S"][s])
      for j in range(have, end):
        tok = int(report["tokens_SK"][s, j - start])
        lp = float(report["logprobs_SK"][s, j - start])
        top = None
        if req.params.top_logprobs:
          k = req.params.top_logprobs
          top = dict(zip(report["top_ids_SKv"][s, j - start, :k].tolist(),
                         report["top_logprobs_SKv"][s, j - start, :k].tolist()))
        req.tokens[f].append(tok)
        self.counters["tokens"] += 1
        events.append(StreamEvent(req.index, f, tok, lp if req.params.logprobs else None,
                                  text=None if text is None else text.add(tok),
                                  top_logprobs=top, **req.prompt_fields(f)))
        if text is not None and text.stopped:  # the tokens after it are dropped
          stopped[s] = True
          break
      if stopped[s] or report["status_S"][s] == DONE:
        reason = "stop" if stopped[s] else REASONS[int(report["reason_S"][s])]
        stop_id, p = int(report["stop_id_S"][s]), req.params
        eos = stop_id in self.eos and not p.ignore_eos  # vLLM: EOS first, then stop ids
        why = (text.stop_string if stopped[s] else stop_id if reason == "stop"
               and stop_id in p.stop_token_ids and not eos else None)
        events.append(StreamEvent(req.index, f, None, None, reason,
                                  None if text is None else text.finish(), why,
                                  **req.prompt_fields(f)))
        if not stopped[s]:  # a stopped one is the slot's until its abort (serve)
          slot_owner[s] = None
        clear[s] = True
    return events, clear, stopped

  def slots_wanted(self, waiting: list[Request]) -> int:
    """Free slots (in one data shard) that end a device call early for waiting requests:
    the first one's n, or more, up to a quarter of a shard's slots while enough requests
    wait, so that the host is not called back each time a single slot frees."""
    if not waiting:
      return 0
    batch = max(1, self.slots_per_shard // 4)
    total = 0
    for req in waiting:
      total += req.params.n
      if total >= batch:
        break
    return min(max(waiting[0].params.n, min(total, batch)), self.slots_per_shard)

  def pick_bucket(self, want_S: np.ndarray) -> int:
    """The smallest token bucket holding the tokens one data shard's sequences want."""
    need = int(want_S.reshape(-1, self.slots_per_shard).sum(axis=1).max())
    return next((b for b in self.token_buckets if b >= need), self.token_buckets[-1])


def bias_rows(p: SamplingParams) -> dict:
  """The bias rows of a request's slots: its logit bias, or its allowed ids with the bias
  of each (a biased id it does not allow would be -inf whatever its bias)."""
  if p.allowed_token_ids is None:
    return dict(bias_ids_Sb=[t for t, _ in p.logit_bias], bias_Sb=[b for _, b in p.logit_bias])
  bias = dict(p.logit_bias)
  return dict(bias_ids_Sb=list(p.allowed_token_ids),
              bias_Sb=[bias.get(t, 0.0) for t in p.allowed_token_ids], allowed_only_S=True)
