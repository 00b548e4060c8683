"""Serving as requests come and go: ``LLM.session()``'s ``Session``, and ``generate_stream``'s
loop built on it.

A session holds the engine (its slots, its pool) from ``LLM.session()`` until ``close()``.
``add`` validates requests and queues them; ``abort`` marks requests to drop; ``step`` makes
one device call with what is queued (admitting waiting requests into free slots as they
free, continuous batching) and returns its events. ``add``, ``abort``, ``num_unfinished``
and ``close`` may be called from any thread (a lock guards the queues; ``close`` waits for
a step under way), ``step`` from one at a time (a second is refused); ``LLM.stats`` too
(it waits for the device call under way). Every device call is made by ``step`` or
``close``.

A request's id is the ``prompt_index`` of its events: 0, 1, ... in the order ``add`` took
them over the session's life. A session keeps no finished request: its memory is that of
the requests still unfinished.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from paged_jax.engine.scheduler import Output, Request, Scheduler, StreamEvent, progress_key

__all__ = ["Session", "outputs", "serve"]


class Session:
  """Requests added and aborted while the engine serves (``LLM.session()``; module
  docstring). Use it in a ``with`` block, or ``close()`` it: until then the engine serves
  nothing else (``generate`` is a ``RuntimeError``)."""

  def __init__(self, scheduler: Scheduler, *,
               run: Callable[[int, int, int | None, bool], dict],
               admit: Callable[[list], Any], abort: Callable[[np.ndarray], Any]):
    scheduler.claim()  # the engine is this session's until close()
    self._s, self._run, self._admit, self._abort = scheduler, run, admit, abort
    self._lock = threading.Lock()
    self._stepping = threading.Lock()  # held by the step under way
    self._incoming: list[Request] = []  # added, not yet seen by step
    self._aborting: list[int] = []  # ids to drop at the next step
    self._unfinished: dict[int, Request] = {}  # by id: incoming, waiting or in a slot
    self._next_id = 0
    self._waiting: list[Request] = []  # in arrival order, waiting for slots
    self._owner: list = [None] * scheduler.max_seqs  # (request, completion) per slot
    self._want_S = np.zeros(scheduler.max_seqs, np.int64)
    self._last, self._stalled, self._closed = None, 0, False
    # Kept: at interpreter exit module globals (sys, numpy, JAX) may be gone when it is needed.
    self._finalizing = sys.is_finalizing
    if scheduler.unclean:  # an interrupt (a second Ctrl-C) cut the last abort short
      try:
        abort(np.ones(scheduler.max_seqs, np.bool_))
      except BaseException:
        self._closed, scheduler.serving = True, False
        raise
      scheduler.unclean = False

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    if not getattr(self, "_closed", True) and not self._finalizing():
      self.close()

  @property
  def num_unfinished(self) -> int:
    """Requests added and neither finished nor aborted (a loop runs ``step`` while any)."""
    with self._lock:
      return len(self._unfinished)

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this session is closed (its unfinished requests were dropped); "
                         "open a new one with llm.session()")

  def add(self, prompts, params=None, *, cache_salt=None) -> list[int]:
    """Queue ``prompts`` (as ``generate`` takes them: a list, one ``SamplingParams`` or one
    per prompt, ``cache_salt`` as there) and return their ids, the ``prompt_index`` of
    their events. All are validated first (a ``ValueError`` naming the bad one, nothing
    queued); unseeded requests draw their seeds now. They are admitted at the next
    ``step``, first come, first served, as slots free."""
    self._check_open()
    requests = self._s.requests(prompts, params, cache_salt)
    with self._lock:
      self._check_open()
      return self._queue(requests)

  def _queue(self, requests: list[Request]) -> list[int]:
    first = self._next_id
    for req in requests:
      req.index += first
      if req.seed is None:
        req.seed = self._s.draw_seed()
      self._unfinished[req.index] = req
    self._incoming.extend(requests)
    self._next_id += len(requests)
    return list(range(first, self._next_id))

  def abort(self, request_ids) -> None:
    """Drop requests (an id, or a list of them, as ``add`` returned): at the next ``step``,
    which frees their slots and blocks and returns, for each completion not yet finished,
    an event with ``finish_reason`` "abort". An id already finished or aborted is ignored;
    one ``add`` never returned is a ``ValueError``."""
    self._check_open()
    if isinstance(request_ids, np.ndarray):  # 0-d: one id
      request_ids = request_ids.tolist()
    ids = [request_ids] if isinstance(request_ids, (int, np.integer)) else request_ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
      raise ValueError(f"request_ids={request_ids!r} must be an id or a list of ids")
    ids = list(ids)
    for i in ids:
      if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) \
          or not 0 <= i < self._next_id:
        given = f"ints 0 .. {self._next_id - 1}" if self._next_id else "none yet"
        raise ValueError(f"request_ids holds {i!r}, not an id this session's add returned "
                         f"({given})")
    with self._lock:
      self._check_open()
      self._aborting.extend(int(i) for i in ids)

  def step(self, max_steps: int | None = None) -> list[StreamEvent]:
    """Admit what waits into free slots, make one device call (up to ``steps_per_call``
    engine steps; it ends early as any call does: nothing left running, enough slots free
    for the waiting requests, a token bucket that fits better, or 4 steps that scored prompt
    tokens for ``SamplingParams.prompt_logprobs``) and return its events,
    as ``generate_stream`` yields them; the aborted requests' "abort" events come first.
    With nothing unfinished it returns [] at once. An error here closes the session (its
    requests are dropped) and propagates. One thread at a time: a second is refused.

    ``max_steps``: at most that many engine steps in this call (an int >= 1; None, or
    more than ``steps_per_call``: ``steps_per_call``), no recompilation: a server that
    expects requests soon trades host syncs for their wait (a request added during a call
    is admitted at the next one), a loop that must yield often bounds the call's time."""
    if max_steps is not None and (isinstance(max_steps, (bool, np.bool_)) or not isinstance(
        max_steps, (int, np.integer)) or max_steps < 1):
      raise ValueError(f"max_steps={max_steps!r} must be None or an int >= 1")
    self._check_open()
    if not self._stepping.acquire(blocking=False):
      raise RuntimeError("a step of this session is running in another thread: one thread "
                         "steps a session (others may add and abort)")
    t0 = time.perf_counter()
    try:
      with self._lock:
        incoming, self._incoming = self._incoming, []
        aborting, self._aborting = self._aborting, []
      self._waiting.extend(incoming)
      dropped = self._drop(aborting)
      events = self._call(max_steps) if self._waiting or any(self._owner) else []
      # A request is done once none of its completions holds a slot (each holds one from
      # its admission to its end).
      owned = {o[0].index for o in self._owner if o is not None}
      finished = {ev.prompt_index for ev in events if ev.token_id is None} - owned
      self._s.counters["requests"] += len(finished)
      with self._lock:
        for i in finished | {ev.prompt_index for ev in dropped}:
          del self._unfinished[i]
      return dropped + events
    except BaseException:
      self._close()
      raise
    finally:
      self._s.counters["wall_s"] += time.perf_counter() - t0
      self._stepping.release()

  def _drop(self, ids: list[int]) -> list[StreamEvent]:
    """Drop the requests ``ids`` (``abort``): their events, their slots freed."""
    events, mask_S = [], np.zeros(self._s.max_seqs, np.bool_)
    for i in dict.fromkeys(ids):
      req = self._unfinished.get(i)
      if req is None:  # finished or dropped already
        continue
      if any(w is req for w in self._waiting):
        self._waiting = [w for w in self._waiting if w is not req]
        forks = range(req.params.n)
      else:
        slots = [s for s, o in enumerate(self._owner) if o is not None and o[0] is req]
        forks = [self._owner[s][1] for s in slots]
        mask_S[slots] = True
      for f in forks:
        text = req.texts[f]
        events.append(StreamEvent(req.index, f, None, None, "abort",
                                  None if text is None else text.finish(),
                                  **req.prompt_fields(f)))
    if mask_S.any():
      self._aborted(mask_S)
    return events

  def _aborted(self, mask_S: np.ndarray) -> None:
    """Drop the sequences of ``mask_S`` on the device; their slots free."""
    self._s.unclean = True  # left set if cut short: the next session drops every slot
    self._abort(mask_S)
    self._s.unclean = False
    for s in np.flatnonzero(mask_S):
      self._owner[s] = None
    self._want_S[mask_S] = 0

  def _call(self, max_steps: int | None = None) -> list[StreamEvent]:
    """One device call (of at most ``max_steps`` steps): admissions, the call, its report
    read."""
    s = self._s
    admitted = s.fill_slots(self._waiting, self._owner, self._want_S)
    if admitted:
      self._admit(admitted)
    # While a request that asks for prompt log-probs is prefilling its prompt, the call
    # scores every row (``device_call``'s ``scoring``).
    scoring = any(o is not None and o[0].prompt_unscored > 0 for o in self._owner)
    report = self._run(s.pick_bucket(self._want_S), s.slots_wanted(self._waiting),
                       max_steps, scoring)
    events, clear, stopped = s.read_report(report, self._owner)
    self._want_S = np.array(report["want_S"], np.int64)
    if stopped.any():  # at a stop string: the sequence still runs on the device
      self._aborted(stopped)
    if clear.any():  # finished slots back to a free slot's rows
      self._admit([(slot, {}) for slot in np.flatnonzero(clear)])
    # A device call that changed nothing, with nothing admitted before it, leaves the next
    # call the same state: it would loop for ever. Never expected; a loud error (the
    # session's close frees the slots) instead of a silent hang.
    now = progress_key(report)
    self._stalled, self._last = (self._stalled + 1 if not admitted and now == self._last
                                 else 0), now
    if self._stalled >= 2:
      raise RuntimeError(
          "paged_jax engine: three device calls in a row made no progress (no token, no "
          f"prefill, no admission; tokens wanted per slot {self._want_S.tolist()}, requests "
          f"waiting {len(self._waiting)}, free blocks {int(report['num_free'])}): a "
          "scheduling bug, please report it with the engine's options and the prompts' "
          "lengths")
    return events

  def close(self) -> None:
    """Drop every unfinished request (their slots and blocks freed) and give the engine
    back, once a step under way in another thread has ended. A second close does nothing."""
    with self._stepping:
      self._close()

  def _close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._incoming, self._aborting = [], []
      self._unfinished.clear()
    s = self._s
    try:
      # At interpreter exit (a stream never closed) the modules, JAX among them, may be torn
      # down already: nothing to free then. Else drop what is left in slots; should that
      # fail too, the next session drops every slot first (admit rewrites a slot's rows,
      # not its blocks: a new request would read what the old one left there as its own).
      if self._finalizing():
        return
      self._waiting = []
      held_S = np.array([o is not None for o in self._owner]) | s.unclean
      s.unclean = True
      self._abort(held_S)  # no-op when none are left
      s.unclean = False
      self._owner = [None] * s.max_seqs
    finally:  # the engine is free for the next user once its slots are
      s.serving = False


def serve(scheduler: Scheduler, requests: list[Request], *,
          run: Callable[[int, int, int | None, bool], dict],
          admit: Callable[[list], Any],
          abort: Callable[[np.ndarray], Any]) -> Iterator[StreamEvent]:
  """``generate_stream``'s events: ``requests`` (validated, ids 0 .. n-1) served by a
  session that ends with them, or when the generator is closed (their slots freed).

  ``run(bucket, slots_wanted, max_steps, scoring) -> report`` makes one device call (the
  report on the host; ``max_steps`` None: ``steps_per_call``; ``scoring``: the prompt
  log-probs variant);
  ``admit(entries)`` writes slots' host rows (``Scheduler.fill_slots``) into the device
  state; ``abort(mask_S)`` drops sequences (at a stop string; what is left at the end).
  """
  session = Session(scheduler, run=run, admit=admit, abort=abort)
  try:
    with session._lock:
      session._queue(requests)  # unseeded requests draw here: a stream never read draws none
    while session.num_unfinished:
      yield from session.step()
  finally:
    session.close()


def outputs(requests: list[Request], events, *, with_text: bool) -> list[Output]:
  """``generate``'s result: one ``Output`` per completion of ``requests`` in order, from
  their ``events`` (all of them, to each completion's last)."""
  tokens, logprobs, tops, texts, finish = {}, {}, {}, {}, {}
  for ev in events:
    key = (ev.prompt_index, ev.sample_index)
    texts.setdefault(key, []).append(ev.text or "")  # all at the end unless stop strings
    if ev.token_id is not None:
      tokens.setdefault(key, []).append(ev.token_id)
      logprobs.setdefault(key, []).append(ev.logprob)
      tops.setdefault(key, []).append(ev.top_logprobs)
    else:
      finish[key] = ev
  out = []
  for req in requests:
    p = req.params
    for f in range(p.n):
      key = (req.index, f)
      text = "".join(texts[key]) if with_text else None
      lps, end = logprobs.get(key, []) if p.logprobs else None, finish[key]
      top = tops.get(key, []) if p.top_logprobs else None
      out.append(Output(req.index, f, list(req.prompt), tokens.get(key, []), text,
                        end.finish_reason, lps, end.stop_reason, top,
                        None if req.prompt_logprobs is None else list(req.prompt_logprobs),
                        None if req.prompt_top_logprobs is None
                        else list(req.prompt_top_logprobs)))
  return out
