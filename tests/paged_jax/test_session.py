"""``LLM.session()``: requests added and aborted while the engine serves (a server's loop).

Outputs are compared with ``generate`` of the same prompts and parameters on the same
engine (itself checked against a dense oracle in test_engine.py): a request's tokens depend
on its prompt, its seed and its own position only, never on who shares the batch or when it
came. Every test ends with the pool free and valid.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from paged_jax import LLM, ModelConfig, SamplingParams, Session, allocator, init_random
from paged_jax.engine import scheduler as scheduler_lib

EOS = 2


@pytest.fixture(scope="module")
def llm():
  config = ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=128, eos_token_ids=(EOS,))
  model = init_random(config, seed=0, impl="xla")
  # 3 slots for more requests than that: a request added later waits for a slot.
  return LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16,
             steps_per_call=4)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 128, n)] for n in lengths]


def _check_all_free(llm):
  allocator.validate(llm.allocator_state)
  assert llm.stats["num_free_blocks"] == llm.stats["num_blocks"]


def _collect(events, into):
  """Fold events into ``into[(id, f)] = [tokens, finish_reason]``."""
  for ev in events:
    entry = into.setdefault((ev.prompt_index, ev.sample_index), [[], None])
    assert entry[1] is None, f"an event after the end of {ev.prompt_index, ev.sample_index}"
    if ev.token_id is None:
      entry[1] = ev.finish_reason
    else:
      entry[0].append(ev.token_id)
  return into


def _expected(llm, prompts, params):
  outs = llm.generate(prompts, params)
  return {(o.prompt_index, o.sample_index): [o.token_ids, o.finish_reason] for o in outs}


PARAMS = [SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2),
          SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=11),
          SamplingParams(max_tokens=7),
          SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)]


def test_requests_added_while_others_run_get_generates_outputs(llm):
  # Two requests first; three more added one step apart while those run (the later ones
  # wait for a slot). Each request's events equal generate's for it, and a request added
  # after the first step gets tokens before the first requests end: it joined the batch.
  prompts = _prompts((5, 17, 9, 30, 3), seed=1)
  expected = _expected(llm, prompts, PARAMS)
  got, running_when_added = {}, None
  with llm.session() as session:
    assert session.add(prompts[:2], PARAMS[:2]) == [0, 1]
    _collect(session.step(), got)
    for i in (2, 3, 4):
      assert session.add([prompts[i]], PARAMS[i]) == [i]
      if i == 2:
        running_when_added = {k for k, (_, end) in got.items() if end is None}
      _collect(session.step(), got)
    steps = 0
    while session.num_unfinished:
      _collect(session.step(), got)
      steps += 1
      assert steps < 100
    assert session.step() == []  # nothing left: no call
  assert got == expected
  assert running_when_added, "the first requests ended before the next was added"
  _check_all_free(llm)


def test_abort_drops_waiting_and_running_requests_and_frees_their_blocks(llm):
  prompts = _prompts((12, 20, 7, 9), seed=2)
  params = [SamplingParams(max_tokens=30, ignore_eos=True),
            SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=1, n=2),
            SamplingParams(max_tokens=8, ignore_eos=True),
            SamplingParams(max_tokens=6, ignore_eos=True)]
  expected = _expected(llm, [prompts[0], prompts[2]], [params[0], params[2]])
  got = {}
  with llm.session() as session:
    ids = session.add(prompts, params)  # 0 and 1 take the 3 slots; 2 and 3 wait
    _collect(session.step(), got)
    assert got[(1, 0)][0] and got[(1, 0)][1] is None  # running
    before = llm.stats["device_calls"]
    session.abort([ids[1], ids[3]])
    session.abort(ids[1])  # twice: ignored
    events = session.step()
    ends = [(ev.prompt_index, ev.sample_index, ev.finish_reason) for ev in events[:3]]
    assert sorted(ends) == [(1, 0, "abort"), (1, 1, "abort"), (3, 0, "abort")]
    assert all(ev.token_id is not None or ev.prompt_index not in (1, 3) for ev in events[3:])
    assert llm.stats["device_calls"] == before + 1
    _collect(events, got)
    assert session.num_unfinished == 2
    while session.num_unfinished:
      _collect(session.step(), got)
    session.abort(0)  # finished: ignored
    assert session.step() == []
    with pytest.raises(ValueError, match=r"request_ids holds 4, not an id"):
      session.abort(4)
    with pytest.raises(ValueError, match="request_ids holds True"):
      session.abort([True])
    with pytest.raises(ValueError, match="request_ids='1' must be an id or a list"):
      session.abort("1")
    session.abort(np.array(0))  # a 0-d array is one id (finished: ignored)
  assert {k: v for k, v in got.items() if k[0] in (0, 2)} == {
      (0, 0): expected[(0, 0)], (2, 0): expected[(1, 0)]}
  assert got[(3, 0)] == [[], "abort"]  # never admitted
  _check_all_free(llm)


def test_a_session_holds_the_engine_until_closed(llm):
  prompt = _prompts((6,), seed=3)
  params = SamplingParams(max_tokens=4, ignore_eos=True)
  expected = llm.generate(prompt, params)
  session = llm.session()
  assert isinstance(session, Session)
  session.add(prompt, params)
  session.step()
  with pytest.raises(RuntimeError, match="session of this engine is still open"):
    llm.generate(prompt, params)
  with pytest.raises(RuntimeError, match="still open"):
    llm.session()
  session.close()
  session.close()  # a second close does nothing
  with pytest.raises(RuntimeError, match="this session is closed"):
    session.add(prompt, params)
  with pytest.raises(RuntimeError, match="this session is closed"):
    session.step()
  _check_all_free(llm)  # the unfinished request's blocks are back
  assert llm.generate(prompt, params) == expected
  # A session dropped unclosed gives the engine back when collected.
  session = llm.session()
  session.add(prompt, params)
  session.step()
  del session
  assert llm.generate(prompt, params) == expected
  _check_all_free(llm)


def test_bad_requests_are_refused_whole_and_the_ids_do_not_move(llm):
  with llm.session() as session:
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
      session.add([[5, 6], []], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="one prompt: put it in a list"):
      session.add("hello")
    assert session.num_unfinished == 0
    assert session.add([[5, 6]], SamplingParams(max_tokens=2)) == [0]


def test_requests_added_from_another_thread_are_served(llm):
  # A server's shape: its handlers add requests (from their own thread) while one loop
  # steps. Each added request is served exactly as generate serves it.
  prompts = _prompts((4, 9, 13, 6, 8, 11), seed=4)
  params = [SamplingParams(max_tokens=5 + i, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(len(prompts))]
  expected = _expected(llm, prompts, params)
  got, ids, added = {}, [], threading.Event()
  with llm.session() as session:
    def handler():
      for p, sp in zip(prompts, params):
        ids.extend(session.add([p], sp))
      added.set()

    thread = threading.Thread(target=handler)
    thread.start()
    while not added.is_set() or session.num_unfinished:
      _collect(session.step(), got)
    thread.join()
  assert ids == list(range(len(prompts)))
  assert got == expected
  _check_all_free(llm)


def test_an_error_in_a_step_closes_the_session_and_the_engine_serves_on(llm, monkeypatch):
  prompt = _prompts((6,), seed=5)
  params = SamplingParams(max_tokens=4, ignore_eos=True)
  expected = llm.generate(prompt, params)
  real_run = llm._run

  def failing_run(*args):
    real_run(*args)
    raise KeyboardInterrupt

  monkeypatch.setattr(llm, "_run", failing_run)
  session = llm.session()
  session.add(prompt, params)
  with pytest.raises(KeyboardInterrupt):
    session.step()
  monkeypatch.setattr(llm, "_run", real_run)
  with pytest.raises(RuntimeError, match="this session is closed"):
    session.step()
  _check_all_free(llm)
  assert llm.generate(prompt, params) == expected


def test_stats_count_finished_requests_not_aborted_ones(llm):
  llm.reset_stats()
  with llm.session() as session:
    session.add(_prompts((5, 7), seed=6), SamplingParams(max_tokens=40, ignore_eos=True))
    session.step()
    session.abort(1)
    while session.num_unfinished:
      session.step()
  stats = llm.stats
  assert stats["requests"] == 1 and stats["generated_tokens"] >= 40
  assert stats["wall_s"] > 0


def test_a_session_never_idle_stops_admitting_before_arrivals_overflow(llm, monkeypatch):
  # Arrivals (int32 on the device) rank the sequences in slots. A session counts them from
  # 0 whenever its slots are all free; one never idle that reaches the limit admits no more
  # until its slots empty, then counts from 0 again. Outputs unchanged; no arrival given
  # reaches the limit (here 4 instead of 2**31 - 1).
  monkeypatch.setattr(scheduler_lib, "ARRIVAL_LIMIT", 4)
  sched = llm._scheduler
  arrivals, held, real_fill = [], [], sched.fill_slots

  def fill_slots(waiting, owner, want_S):
    free = sum(o is None for o in owner)
    at_limit = sched._arrivals >= 4 and waiting and 0 < free < len(owner)
    entries = real_fill(waiting, owner, want_S)
    arrivals.extend(values["arrival_S"] for _, values in entries)
    if at_limit:  # a slot free, a request waiting, some slot taken
      held.append(len(entries))
    return entries

  monkeypatch.setattr(sched, "fill_slots", fill_slots)
  prompts = _prompts((5, 9, 4, 12, 6, 8, 3, 10), seed=7)
  # Request 0 runs all along (the slots are never all free); the others are short.
  params = [SamplingParams(max_tokens=40 if i == 0 else 3 + i % 3, ignore_eos=True)
            for i in range(len(prompts))]
  got = {}
  with llm.session() as session:
    session.add(prompts[:3], params[:3])
    for i in range(3, len(prompts)):  # one more each step
      _collect(session.step(), got)
      session.add([prompts[i]], params[i])
    while session.num_unfinished:
      _collect(session.step(), got)
  assert len(arrivals) == len(prompts) and max(arrivals) == 3
  assert held and set(held) == {0}  # the limit held admissions back, slots free
  assert arrivals.count(0) >= 2  # counted from 0 again
  monkeypatch.undo()
  assert got == _expected(llm, prompts, params)
  _check_all_free(llm)


def test_stats_read_from_another_thread_while_a_session_steps(llm):
  # A server's /stats handler reads llm.stats while its loop steps. The read took the
  # state a device call had just been handed (donated) for a lost one and rebuilt it
  # empty: every running request was dropped. It now waits for the call under way.
  prompts = _prompts((6, 11, 4, 9, 14, 7), seed=8)
  params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=1)
  expected = _expected(llm, prompts, params)
  got, stop, errors = {}, threading.Event(), []

  def monitor():
    while not stop.is_set():
      try:
        stats = llm.stats
        assert 0 <= stats["num_free_blocks"] <= stats["num_blocks"]
      except Exception as e:  # noqa: BLE001 - reported below
        errors.append(e)
        return

  old_interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-5)  # switch threads often: the race showed in most runs
  thread = threading.Thread(target=monitor)
  try:
    thread.start()
    with llm.session() as session:
      session.add(prompts, params)
      while session.num_unfinished:
        _collect(session.step(), got)
  finally:
    stop.set()
    thread.join()
    sys.setswitchinterval(old_interval)
  assert not errors, errors
  assert got == expected
  _check_all_free(llm)


def test_two_threads_opening_sessions_at_once_get_one(llm, monkeypatch):
  # The check that no session is open and the claim were two steps: two threads could
  # both pass the check. A slow check shows it: exactly one thread gets the engine.
  sched = llm._scheduler
  real_check = sched.check_idle

  def slow_check():
    real_check()
    time.sleep(0.05)

  monkeypatch.setattr(sched, "check_idle", slow_check)
  opened, refused = [], []

  def open_one():
    try:
      opened.append(llm.session())
    except RuntimeError as e:
      refused.append(str(e))

  threads = [threading.Thread(target=open_one) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(opened) == 1 and len(refused) == 1 and "still open" in refused[0]
  opened[0].close()
  monkeypatch.undo()
  _check_all_free(llm)


def test_the_engine_is_free_again_only_once_a_close_has_freed_the_slots(llm, monkeypatch):
  # close() gave the engine back before dropping its sequences: a session opened by
  # another thread meanwhile shared the device state with that drop.
  in_abort, release = threading.Event(), threading.Event()
  real_abort = llm._abort

  def slow_abort(mask_S):
    if mask_S.any():
      in_abort.set()
      release.wait(10)
    real_abort(mask_S)

  monkeypatch.setattr(llm, "_abort", slow_abort)
  session = llm.session()
  session.add(_prompts((9,), seed=9), SamplingParams(max_tokens=30, ignore_eos=True))
  session.step()
  closer = threading.Thread(target=session.close)
  closer.start()
  assert in_abort.wait(10)
  with pytest.raises(RuntimeError, match="still open"):
    llm.session()
  release.set()
  closer.join()
  monkeypatch.undo()
  llm.session().close()  # free now
  _check_all_free(llm)


def test_one_thread_steps_and_close_from_another_waits_for_its_step(llm, monkeypatch):
  real_run, entered, release = llm._run, threading.Event(), threading.Event()

  def slow_run(*args):
    entered.set()
    release.wait(10)
    return real_run(*args)

  monkeypatch.setattr(llm, "_run", slow_run)
  session = llm.session()
  session.add(_prompts((7,), seed=10), SamplingParams(max_tokens=30, ignore_eos=True))
  stepper = threading.Thread(target=session.step)
  stepper.start()
  assert entered.wait(10)
  with pytest.raises(RuntimeError, match="running in another thread"):
    session.step()
  closer = threading.Thread(target=session.close)
  closer.start()
  time.sleep(0.05)
  assert closer.is_alive()  # waits for the step under way
  release.set()
  stepper.join()
  closer.join()
  with pytest.raises(RuntimeError, match="this session is closed"):
    session.abort(0)
  monkeypatch.undo()
  _check_all_free(llm)


def test_a_request_is_unfinished_until_its_last_completion_ends(llm):
  # n = 2 with stop ids: completion 0 stops after 1 token, completion 1 after 26 (seed 7):
  # their ends come many steps apart. The request stays unfinished (num_unfinished, its
  # later events delivered) until the second, and stats count it once, then.
  prompt = [int(t) for t in np.random.default_rng(11).integers(3, 128, 8)]
  params = SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=7,
                          stop_token_ids=tuple(range(3, 13)))
  expected = _expected(llm, [prompt], params)
  assert [len(t) for t, _ in expected.values()] == [1, 26]  # the premise
  llm.reset_stats()
  got, ends_at = {}, {}
  with llm.session() as session:
    session.add([prompt], params)
    step = 0
    while session.num_unfinished:
      for ev in session.step():
        if ev.token_id is None:
          ends_at[ev.sample_index] = step
        _collect([ev], got)
      step += 1
      if 0 in ends_at and 1 not in ends_at:
        assert session.num_unfinished == 1 and llm.stats["requests"] == 0
  assert got == expected and ends_at[0] < ends_at[1]
  assert llm.stats["requests"] == 1
  _check_all_free(llm)


def test_max_steps_caps_the_engine_steps_of_one_call(llm):
  # step(max_steps=1) makes one engine step a call, the same compiled loop: the requests'
  # events equal generate's. A cap past steps_per_call (4) is steps_per_call. A bad cap is
  # refused before anything runs.
  prompts = _prompts((5, 9, 20), seed=7)
  params = SamplingParams(max_tokens=6, ignore_eos=True)
  expected = _expected(llm, prompts, params)
  for cap, most in ((1, 1), (100, 4)):
    llm.reset_stats()
    got, per_call = {}, []
    with llm.session() as session:
      session.add(prompts, params)
      while session.num_unfinished:
        before = llm.stats["steps"]
        _collect(session.step(max_steps=cap), got)
        per_call.append(llm.stats["steps"] - before)
      for bad in (0, -2, True, 1.5, "3"):
        with pytest.raises(ValueError, match=f"max_steps={bad!r} must be None or an int >= 1"):
          session.step(max_steps=bad)
    assert got == expected
    assert max(per_call) == most and len(per_call) >= (6 if cap == 1 else 2), per_call
  _check_all_free(llm)
