"""The synthetic workload: deterministic, bounded, long-tailed; its arrivals."""

from __future__ import annotations

import time

import numpy as np
import pytest

from paged_jax.engine.scheduler import StreamEvent
from paged_jax.sampling import SamplingParams
from paged_jax.workload import Workload, arrival_times, make_requests, serve_arrivals


def test_deterministic_bounded_and_long_tailed():
  w = Workload(num_requests=400, seed=3)
  prompts, params = make_requests(w)
  again, params2 = make_requests(w)
  assert prompts == again and params == params2
  assert make_requests(Workload(num_requests=400, seed=4))[0] != prompts
  p_len = np.array([len(p) for p in prompts])
  o_len = np.array([sp.max_tokens for sp in params])
  assert p_len.min() >= 1 and p_len.max() <= w.max_prompt_len
  assert o_len.min() >= 1 and o_len.max() <= w.max_output_len
  assert all(w.first_token_id <= t < w.vocab_size for p in prompts for t in p)
  assert all(sp.ignore_eos and sp.temperature == 0 for sp in params)
  # log-normal: median near the parameter, a tail well above it.
  assert abs(np.median(p_len) - w.prompt_median) <= 4
  assert abs(np.median(o_len) - w.output_median) <= 3
  assert np.percentile(p_len, 95) > 2.5 * w.prompt_median


@pytest.mark.parametrize("kwargs, field", [(dict(num_requests=0), "num_requests"),
                                           (dict(prompt_sigma=-1.0), "prompt_sigma"),
                                           (dict(first_token_id=300), "first_token_id")])
def test_validation(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Workload(**kwargs)


def test_arrivals_are_a_seeded_poisson_process_that_changes_no_length():
  w = Workload(num_requests=4000, seed=5, request_rate=20.0)
  times = arrival_times(w)
  assert times[0] == 0 and np.all(np.diff(times) >= 0) and len(times) == 4000
  assert np.array_equal(times, arrival_times(w))
  assert not np.array_equal(times, arrival_times(Workload(num_requests=4000, seed=6,
                                                          request_rate=20.0)))
  gaps = np.diff(times)
  assert 0.95 / 20 < gaps.mean() < 1.05 / 20  # the rate
  assert 0.9 < gaps.std() / gaps.mean() < 1.1  # exponential: its std is its mean
  assert make_requests(w) == make_requests(Workload(num_requests=4000, seed=5))
  assert not arrival_times(Workload(num_requests=3)).any()  # no rate: all at once


@pytest.mark.parametrize("rate", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_request_rate_must_be_a_positive_finite_number(rate):
  with pytest.raises(ValueError, match="request_rate=.* must be a finite number > 0"):
    Workload(request_rate=rate)


class _FakeSession:
  """A session that ends each request one step after it was added, with one token."""

  def __init__(self, clock):
    self.clock, self.added, self.live, self.caps = clock, [], [], []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass

  @property
  def num_unfinished(self):
    return len(self.live)

  def add(self, prompts, params):
    ids = list(range(len(self.added), len(self.added) + len(prompts)))
    self.added += [(i, self.clock()) for i in ids]
    self.live += ids
    return ids

  def step(self, max_steps=None):
    self.caps.append(max_steps)
    # Request 3 has two completions, their tokens interleaved as a batch delivers them.
    events = []
    for i in self.live:
      forks = (0, 1) if i == 3 else (0,)
      events += [StreamEvent(i, f, 7 + f) for f in forks] + [StreamEvent(i, f, 9 + f)
                                                            for f in forks]
      events += [StreamEvent(i, f, None) for f in forks]
    self.live = []
    return events


def test_serve_arrivals_adds_each_request_once_it_has_arrived():
  # Requests join no earlier than their arrival; the wait is counted from the arrival.
  t0 = time.perf_counter()
  session = _FakeSession(lambda: time.perf_counter() - t0)
  checked = []
  llm = type("FakeLLM", (), {"session": lambda self: session,
                             "check_requests": lambda self, *a: checked.append(a)})()
  arrivals = [0.0, 0.0, 0.05, 0.12]
  progress = []
  params = [SamplingParams(max_tokens=2)] * 3 + [SamplingParams(max_tokens=2, n=2)]
  with pytest.raises(ValueError, match="must be 4 non-decreasing times"):
    serve_arrivals(llm, [[1]] * 4, params, [0.0, 0.1, 0.05, 0.2])
  with pytest.raises(ValueError, match="must be 4 non-decreasing times"):
    serve_arrivals(llm, [[1]] * 4, params, [0.0, 0.1])
  waits = serve_arrivals(llm, [[1]] * 4, params, arrivals,
                         progress=lambda done, tokens: progress.append((done, tokens)))
  assert len(checked) == 1  # every request checked before serving
  assert [i for i, _ in session.added] == [0, 1, 2, 3]
  assert all(t >= a for (_, t), a in zip(session.added, arrivals))
  assert all(0 <= f <= last < 0.05 for f, last in zip(waits["ttft_s"], waits["latency_s"]))
  assert progress[-1] == (4, 10)
  assert waits["token_ids"] == [[7, 9]] * 3 + [[7, 9, 8, 10]]  # completion 0's, then 1's
  assert waits["span_s"] >= arrivals[-1]
  assert set(session.caps) == {None}
  session = _FakeSession(lambda: time.perf_counter() - t0)  # ids from 0 again
  serve_arrivals(llm, [[1]] * 4, params, [0.0] * 4, max_steps=3)  # each step's cap
  assert session.caps and set(session.caps) == {3}
