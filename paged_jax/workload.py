"""A synthetic serving workload: a long-tailed mix of prompt and output lengths.

Prompt and output lengths are drawn independently from log-normal distributions,
``round(median * exp(sigma * N(0, 1)))`` clipped to ``[1, max]``, so most requests are short
and a few are long (sigma 0.8 puts the 95th percentile near 3.7x the median). Prompt tokens
are uniform over ``[first_token_id, vocab_size)`` (ids below ``first_token_id`` are left to
special tokens such as BOS/EOS). Every request decodes greedily with ``ignore_eos=True`` so
its output length is exactly the drawn one. Requests arrive all at once, or as a Poisson
process at ``request_rate`` per second (``arrival_times``: exponential gaps, the first at
0, drawn apart from the lengths so a rate changes no length). Everything follows from
``seed``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # imported in make_requests: the CLI builds its parser without JAX
  from paged_jax.sampling import SamplingParams

__all__ = ["Waits", "Workload", "arrival_times", "make_requests", "serve_arrivals"]


@dataclasses.dataclass(frozen=True)
class Workload:
  """Parameters of the synthetic workload (module docstring).

  Attributes:
    num_requests: how many requests.
    prompt_median, prompt_sigma, max_prompt_len: log-normal prompt lengths.
    output_median, output_sigma, max_output_len: log-normal output lengths (max_tokens).
    vocab_size: prompt ids are drawn below it.
    first_token_id: prompt ids are drawn at or above it.
    seed: the numpy seed of every draw.
    request_rate: mean arrivals per second (a Poisson process), or None: all at once.
  """

  num_requests: int = 64
  prompt_median: int = 24
  prompt_sigma: float = 0.8
  max_prompt_len: int = 192
  output_median: int = 16
  output_sigma: float = 0.8
  max_output_len: int = 96
  vocab_size: int = 256
  first_token_id: int = 3
  seed: int = 0
  request_rate: float | None = None

  def __post_init__(self):
    for name in ("num_requests", "prompt_median", "max_prompt_len", "output_median",
                 "max_output_len", "vocab_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    for name in ("prompt_sigma", "output_sigma"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
    rate = self.request_rate
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, numbers.Real)
                             or not (math.isfinite(rate) and rate > 0)):
      raise ValueError(f"request_rate={rate!r} must be a finite number > 0 (requests per "
                       "second), or None (all at once)")
    if not 0 <= self.first_token_id < self.vocab_size:
      raise ValueError(f"first_token_id={self.first_token_id} must be in [0, vocab_size="
                       f"{self.vocab_size})")


def _lognormal_lengths(rng, n, median, sigma, max_len) -> np.ndarray:
  draw = median * np.exp(sigma * rng.standard_normal(n))
  return np.clip(np.round(draw), 1, max_len).astype(np.int64)


def make_requests(workload: Workload) -> tuple[list[list[int]], list[SamplingParams]]:
  """``(prompts, params)`` of the workload, ready for ``LLM.generate``."""
  from paged_jax.sampling import SamplingParams
  w = workload
  rng = np.random.default_rng(w.seed)
  prompt_lens = _lognormal_lengths(rng, w.num_requests, w.prompt_median, w.prompt_sigma,
                                   w.max_prompt_len)
  output_lens = _lognormal_lengths(rng, w.num_requests, w.output_median, w.output_sigma,
                                   w.max_output_len)
  prompts = [[int(t) for t in rng.integers(w.first_token_id, w.vocab_size, n)]
             for n in prompt_lens]
  params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in output_lens]
  return prompts, params


def arrival_times(workload: Workload) -> np.ndarray:
  """Seconds from the start at which each request arrives, non-decreasing, the first at 0:
  all 0 without a ``request_rate``, else a Poisson process's (exponential gaps)."""
  w = workload
  if w.request_rate is None:
    return np.zeros(w.num_requests)
  gaps = np.random.default_rng([w.seed, 1]).exponential(1.0 / w.request_rate, w.num_requests)
  return np.concatenate([[0.0], np.cumsum(gaps[1:])])


class Waits:
  """Per-request timings of one serving run, from its events: ``record(i, event, now)``
  with ``now`` in seconds from the run's start, then ``result(arrivals_s)``."""

  def __init__(self, params):
    n = len(params)
    self.first, self.last, self.ends = [None] * n, [None] * n, [0] * n
    self.token_ids = [{} for _ in range(n)]  # per request: completion -> its ids
    self._n = [p.n for p in params]
    self.done = self.tokens = 0  # requests whose every completion ended; tokens

  def record(self, i: int, event, now: float) -> None:
    if self.first[i] is None:
      self.first[i] = now
    if event.token_id is None:
      self.last[i], self.ends[i] = now, self.ends[i] + 1
      self.done += self.ends[i] == self._n[i]
    else:
      self.tokens += 1
      self.token_ids[i].setdefault(event.sample_index, []).append(event.token_id)

  def result(self, arrivals_s) -> dict:
    """``ttft_s``: seconds from each request's arrival to its first token (to its end, for
    one that generated none), ``latency_s``: to its end, ``token_ids``: what it generated
    (its completions' in turn, n > 1); ``span_s``: the run's start to its last event."""
    return dict(ttft_s=[f - a for f, a in zip(self.first, arrivals_s)],
                latency_s=[t - a for t, a in zip(self.last, arrivals_s)],
                token_ids=[[t for f in sorted(ids) for t in ids[f]] for ids in self.token_ids],
                span_s=max(self.last, default=0.0))


def serve_arrivals(llm, prompts, params, arrivals_s,
                   progress: Callable[[int, int], None] | None = None, *,
                   max_steps: int | None = None) -> dict:
  """Serve ``prompts`` on ``llm`` (an ``LLM``), each added to one session (``LLM.session``)
  once the wall clock passes its arrival (``arrivals_s``, seconds from the call,
  non-decreasing), so it joins the batch already running. ``progress(requests done, tokens
  so far)`` after each device call; a request is done when its n completions are. Every
  request is checked first (``LLM.check_requests``: a ``ValueError`` naming it).
  ``max_steps``: each device call's cap (``Session.step``; None: ``steps_per_call``). Returns
  ``Waits.result``: per request in order, the seconds to its first token and to its end
  from its arrival and what it generated; the run's span."""
  arrivals_s = np.asarray(arrivals_s, np.float64)
  n = len(prompts)
  if arrivals_s.shape != (n,) or np.any(np.diff(arrivals_s) < 0):
    raise ValueError(f"arrivals_s (shape {arrivals_s.shape}) must be {n} non-decreasing "
                     "times, one per prompt")
  llm.check_requests(prompts, params)
  waits, added = Waits(params), 0
  t0 = time.perf_counter()
  with llm.session() as session:
    while added < n or session.num_unfinished:
      now = time.perf_counter() - t0
      if not session.num_unfinished and arrivals_s[added] > now:  # idle until the next one
        time.sleep(arrivals_s[added] - now)
        now = time.perf_counter() - t0
      end = max(int(np.searchsorted(arrivals_s, now, side="right")), added)
      if end > added:
        session.add(prompts[added:end], params[added:end])
        added = end
      events = session.step(max_steps)
      now = time.perf_counter() - t0
      for ev in events:
        waits.record(ev.prompt_index, ev, now)
      if progress is not None:
        progress(waits.done, waits.tokens)
  return waits.result(arrivals_s)
