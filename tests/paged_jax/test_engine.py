"""The serving engine against a dense greedy oracle, on a tiny random Llama (float32, xla)."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.models import ModelConfig, init_random
from paged_jax import allocator
from paged_jax.engine import LLM, SamplingParams

EOS = 2
ORACLE_LEN = 96  # dense oracle pads every sequence to this length (one compilation)


@pytest.fixture(scope="module")
def config():
  return ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=128,
                     eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def model(config):
  return init_random(config, seed=0, impl="xla")


@pytest.fixture(scope="module")
def dense_greedy(model):
  """Naive greedy loop: re-run the dense model on the growing sequence, argmax.

  The model is causal, so the logits at position len-1 of a zero-padded [1, ORACLE_LEN]
  batch are those of the unpadded sequence; one compilation serves every length.
  Returns (tokens, log_softmax logprobs of each chosen token).
  """
  fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t)[0].astype(jnp.float32), axis=-1))

  def run(prompt, max_tokens, stop=()):
    seq, out, lps = list(prompt), [], []
    for _ in range(max_tokens):
      arr = np.zeros((1, ORACLE_LEN), np.int32)
      arr[0, :len(seq)] = seq
      logp = np.asarray(fwd(jnp.asarray(arr))[len(seq) - 1])
      nxt = int(np.argmax(logp))
      if nxt in stop:
        break
      out.append(nxt)
      lps.append(float(logp[nxt]))
      seq.append(nxt)
    return out, lps

  return run


@pytest.fixture(scope="module")
def llm(model, config):
  # T = 16 < the longer prompts: chunked prefill; max_seqs 3 < requests: continuous batching.
  return LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16,
             steps_per_call=8)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 128, n)] for n in lengths]


def _check_all_free(llm):
  allocator.validate(llm.allocator_state)
  assert llm.stats["num_free_blocks"] == llm.stats["num_blocks"]
  assert int(llm.allocator_state.num_free) == llm.spec.num_blocks


LENGTHS = (5, 17, 9, 30, 3, 1)


def test_greedy_matches_dense_oracle_with_batching_and_chunked_prefill(llm, dense_greedy):
  prompts = _prompts(LENGTHS)
  assert max(LENGTHS) > llm.max_tokens_per_step  # a prompt is prefilled in chunks
  assert len(prompts) > llm.max_seqs  # requests wait for slots
  params = SamplingParams(max_tokens=12, ignore_eos=True)
  start = time.perf_counter()
  outs = llm.generate(prompts, params)  # the engine's first: it compiles what it uses
  elapsed = time.perf_counter() - start
  assert [o.prompt_index for o in outs] == list(range(len(prompts)))
  for p, o in zip(prompts, outs):
    expect, _ = dense_greedy(p, 12)
    assert o.token_ids == expect  # lists, as a user compares them (tuples never equal)
    assert o.finish_reason == "length" and o.prompt_token_ids == list(p) and o.text is None
    assert o.logprobs is None
  _check_all_free(llm)
  s = llm.stats
  assert 0 < s["host_syncs_per_token"] < 1  # several steps per device call
  assert s["preemptions"] == 0 and s["prefix_hit_rate"] == 0.0
  for key in ("kv_utilization", "tokens_per_s", "peak_blocks_in_use", "mean_blocks_in_use",
              "steps", "host_syncs"):
    assert key in s
  # Compilations on first use are timed apart: the throughput is the serving's.
  assert {"step T=16", "admit"} <= set(llm.compile_seconds) and s["compile_s"] > 0
  assert s["compile_s"] == pytest.approx(sum(llm.compile_seconds.values()))
  assert 0 < s["wall_s"] <= elapsed - s["compile_s"] + 1e-3
  assert s["tokens_per_s"] == pytest.approx(s["generated_tokens"] / s["wall_s"])


def test_batch_after_batch_equals_fresh_engine(llm, model, config):
  first = llm.generate(_prompts((7, 12), seed=5), SamplingParams(max_tokens=6, ignore_eos=True))
  del first
  prompts = _prompts((4, 22, 11), seed=6)
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  again = llm.generate(prompts, params)
  fresh = LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16,
              steps_per_call=8).generate(prompts, params)
  assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


def test_eos_stop_ids_and_max_tokens(llm, dense_greedy):
  prompt = _prompts((6,), seed=1)[0]
  free_run, _ = dense_greedy(prompt, 10)
  stop = free_run[3]
  first = free_run.index(stop)
  out, = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True,
                                               stop_token_ids=(stop, 127)))
  assert out.finish_reason == "stop" and list(out.token_ids) == free_run[:first]
  assert out.stop_reason == stop and type(out.stop_reason) is int  # which stop id
  # The stream's last event says it too.
  *_, last = llm.generate_stream([prompt], SamplingParams(max_tokens=10, ignore_eos=True,
                                                          stop_token_ids=(127, stop)))
  assert (last.token_id, last.finish_reason, last.stop_reason) == (None, "stop", stop)
  out, = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
  assert out.finish_reason == "length" and list(out.token_ids) == free_run[:4]
  assert out.stop_reason is None
  # EOS: a prompt whose greedy continuation hits EOS (id 2) stops there unless ignore_eos.
  for seed in range(200):
    prompt = _prompts((4,), seed=100 + seed)[0]
    run, _ = dense_greedy(prompt, 12)
    if EOS in run:
      break
  else:
    pytest.skip("no greedy continuation reaches EOS")
  out, ignored = llm.generate([prompt, prompt], [SamplingParams(max_tokens=12),
                                                 SamplingParams(max_tokens=12, ignore_eos=True)])
  assert out.finish_reason == "stop" and list(out.token_ids) == run[:run.index(EOS)]
  assert out.stop_reason is None  # EOS, not one of the request's stop ids (as vLLM)
  assert ignored.finish_reason == "length" and list(ignored.token_ids) == run
  # EOS listed in stop_token_ids too: EOS first (vLLM's rule), unless ignore_eos.
  out, = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(EOS,)))
  assert (out.finish_reason, out.stop_reason) == ("stop", None)
  out, = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(EOS,),
                                               ignore_eos=True))
  assert (out.finish_reason, out.stop_reason) == ("stop", EOS)
  _check_all_free(llm)


def test_logprobs_match_dense_log_softmax(llm, dense_greedy):
  prompts = _prompts((8, 19), seed=2)
  outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True))
  for p, o in zip(prompts, outs):
    expect, lps = dense_greedy(p, 6)
    assert list(o.token_ids) == expect
    assert isinstance(o.logprobs, list) and all(isinstance(x, float) for x in o.logprobs)
    got = np.asarray(o.logprobs)
    assert np.all(np.isfinite(got)) and np.all(got <= 0)
    np.testing.assert_allclose(got, lps, rtol=1e-4, atol=1e-4)


def test_top_logprobs_are_the_dense_models_likeliest_tokens(llm, model):
  # Greedy and sampled (n = 2) requests beside one without them, 4 completions in 3 slots
  # and up to 12 tokens at 8 steps a call: each token's dict is read from its own column.
  fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t)[0].astype(jnp.float32), axis=-1))
  prompts = _prompts((7, 18, 4), seed=21)
  params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=5),
            SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=20,
                           temperature=1.0, seed=8, n=2),
            SamplingParams(max_tokens=9, ignore_eos=True, logprobs=True)]
  outs = llm.generate(prompts, params)
  streamed = {}
  for ev in llm.generate_stream(prompts, params):
    if ev.token_id is not None:
      streamed.setdefault((ev.prompt_index, ev.sample_index), []).append(ev.top_logprobs)
  assert [o.top_logprobs or [None] * len(o.token_ids) for o in outs] == [
      streamed[o.prompt_index, o.sample_index] for o in outs]
  assert outs[1].token_ids != outs[2].token_ids  # the two sampled completions differ
  for o in outs:
    k = params[o.prompt_index].top_logprobs
    if not k:
      assert o.top_logprobs is None and streamed[o.prompt_index, 0] == [None] * 9
      continue
    assert len(o.top_logprobs) == len(o.token_ids) == params[o.prompt_index].max_tokens
    seq = list(o.prompt_token_ids) + list(o.token_ids)
    arr = np.zeros((1, ORACLE_LEN), np.int32)
    arr[0, :len(seq)] = seq
    logp_JV = np.asarray(fwd(jnp.asarray(arr)))
    for j, (tok, lp, top) in enumerate(zip(o.token_ids, o.logprobs, o.top_logprobs)):
      want_V = logp_JV[len(o.prompt_token_ids) + j - 1]
      ids, values = list(top), np.asarray(list(top.values()))
      assert len(ids) == k and all(type(i) is int for i in ids)
      assert all(type(x) is float for x in top.values()) and np.all(np.diff(values) <= 0)
      np.testing.assert_allclose(values, want_V[ids], rtol=1e-4, atol=1e-4)
      # the k likeliest: none left out is likelier than the least likely kept
      assert np.max(np.delete(want_V, ids)) <= values[-1] + 1e-4
      if tok in top:
        assert top[tok] == lp  # the very value: a user may look one up in the other
      else:
        assert lp <= values[-1] + 1e-4
    if params[o.prompt_index].temperature == 0:  # greedy: the chosen token first
      assert [next(iter(t)) for t in o.top_logprobs] == list(o.token_ids)


def test_seeds_reproducible_across_batch_composition(llm):
  target = _prompts((9,), seed=3)[0]
  hot = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
  alone, = llm.generate([target], hot)
  others = _prompts((14, 3, 25), seed=4)
  mixed = llm.generate(others[:2] + [target] + others[2:],
                       [SamplingParams(max_tokens=7, temperature=1.0, seed=5)] * 2 + [hot]
                       + [SamplingParams(max_tokens=9)])
  assert mixed[2].token_ids == alone.token_ids
  again, = llm.generate([target], hot)
  assert again.token_ids == alone.token_ids
  other_seed, = llm.generate([target], SamplingParams(max_tokens=10, temperature=0.9,
                                                      top_p=0.95, seed=99, ignore_eos=True))
  assert other_seed.token_ids != alone.token_ids


def test_top_k_one_equals_greedy(llm):
  prompts = _prompts((5, 13), seed=7)
  greedy = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
  top1 = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.5,
                                              top_k=1, seed=3))
  assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


@pytest.fixture(scope="module")
def dense_adjusted(model):
  """Greedy over the dense model's raw logits adjusted as ``SamplingParams`` says: the ids
  not allowed at -inf and the logit bias, then the repetition penalty (transformers':
  logits of prompt and generated ids divided where positive, multiplied where not), then
  the presence and frequency penalties over the generated ids (OpenAI's), and the stop ids
  barred before ``min_tokens``; in float64."""
  fwd = jax.jit(lambda t: model(t)[0].astype(jnp.float32))

  def run(prompt, max_tokens, *, repetition=1.0, presence=0.0, frequency=0.0, min_tokens=0,
          stop=(), bias=None, allowed=None):
    seq, out = list(prompt), []
    for _ in range(max_tokens):
      arr = np.zeros((1, ORACLE_LEN), np.int32)
      arr[0, :len(seq)] = seq
      logits = np.asarray(fwd(jnp.asarray(arr))[len(seq) - 1], np.float64)
      if allowed is not None:
        logits[np.setdiff1d(np.arange(len(logits)), allowed)] = -np.inf
      for t, b in (bias or {}).items():  # the logit bias first (vLLM's order)
        logits[t] += b
      for t in set(seq):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
      for t in set(out):
        logits[t] -= presence + frequency * out.count(t)
      if len(out) < min_tokens:
        logits[list(stop)] = -np.inf
      nxt = int(np.argmax(logits))
      if nxt in stop:
        break
      out.append(nxt)
      seq.append(nxt)
    return out

  return run


def test_penalties_and_min_tokens_match_a_dense_oracle(llm, dense_greedy, dense_adjusted):
  # Greedy decoding of a tiny random model repeats itself within a few tokens: each penalty
  # changes the run, and every request is served in one batch beside plain ones (rows that
  # ask for nothing are as without the others), with chunked prefill and a preemption-free
  # pool. A prompt of repeated ids gives the repetition penalty prompt ids to act on.
  prompts = _prompts((5, 17, 9, 3), seed=21)
  prompts[3] = prompts[3] * 4
  cases = [dict(), dict(repetition=1.8), dict(presence=1.5), dict(frequency=0.7),
           dict(repetition=0.6, presence=-0.5, frequency=1.1)]
  params = {(): SamplingParams(max_tokens=14, ignore_eos=True)}
  for case in cases[1:]:
    params[tuple(case.items())] = SamplingParams(
        max_tokens=14, ignore_eos=True, repetition_penalty=case.get("repetition", 1.0),
        presence_penalty=case.get("presence", 0.0), frequency_penalty=case.get("frequency", 0.0))
  batch = [(p, case) for p in prompts for case in cases]
  outs = llm.generate([p for p, _ in batch], [params[tuple(c.items())] for _, c in batch])
  runs = {}
  for (p, case), o in zip(batch, outs):
    expect = dense_adjusted(p, 14, **case)
    assert o.token_ids == expect, case
    runs.setdefault(tuple(p), set()).add(tuple(expect))
  plain = [dense_greedy(p, 14)[0] for p in prompts]
  assert all(outs[i * len(cases)].token_ids == plain[i] for i in range(len(prompts)))
  assert all(len(r) >= 3 for r in runs.values())  # the penalties changed the runs
  _check_all_free(llm)


def test_logit_bias_and_allowed_ids_match_a_dense_oracle(llm, model, dense_greedy,
                                                         dense_adjusted):
  # Greedy requests with a bias beside a plain one in one batch: a ban of the plain run's
  # first token, a small bias on a few tokens, a bias on the prompt's tokens with a
  # repetition penalty (the bias is added first: the oracle's order and vLLM's); each
  # changes its run, the reported log-probs stay the model's own (unbiased). Requests that
  # allow only a few ids (the plain run's first not among them; one with a bias on an
  # allowed id and one on an id it does not allow, one with a repetition penalty) too.
  # Sampled completions (forks) with +100 on one token draw nothing else, and those that
  # allow two ids draw only those.
  fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t)[0].astype(jnp.float32), axis=-1))
  prompt = _prompts((9,), seed=33)[0]
  plain = dense_greedy(prompt, 10)[0]
  allowed = sorted({*prompt[:4], 3, 50, 77} - {plain[0]})
  cases = [dict(), dict(bias={plain[0]: -100.0}), dict(bias={3: 2.5, 50: 2.0, 77: 3.0}),
           dict(bias={t: 4.0 for t in prompt[:5]}, repetition=1.8), dict(allowed=allowed),
           dict(allowed=allowed, bias={allowed[1]: 3.0, plain[0]: 100.0}),
           dict(allowed=allowed, repetition=1.8)]
  params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True,
                           logit_bias=case.get("bias"), allowed_token_ids=case.get("allowed"),
                           repetition_penalty=case.get("repetition", 1.0)) for case in cases]
  outs = llm.generate([prompt] * len(cases), params)
  for o, case in zip(outs, cases):
    expect = dense_adjusted(prompt, 10, **case)
    assert o.token_ids == expect, case
    assert (expect == plain) == (not case), case
    seq = list(prompt) + list(expect)
    arr = np.zeros((1, ORACLE_LEN), np.int32)
    arr[0, :len(seq)] = seq
    raw = np.asarray(fwd(jnp.asarray(arr)))
    np.testing.assert_allclose(o.logprobs, [raw[len(prompt) - 1 + j, t]
                                            for j, t in enumerate(expect)], atol=1e-4)
  forced = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2,
                                                 ignore_eos=True, logit_bias={42: 100}))
  assert [o.token_ids for o in forced] == [[42] * 6] * 2
  two = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2,
                                              ignore_eos=True, allowed_token_ids=[7, 42]))
  assert {t for o in two for t in o.token_ids} == {7, 42}
  _check_all_free(llm)


def test_min_tokens_bars_eos_and_stop_ids_until_then(llm, dense_greedy, dense_adjusted):
  # A prompt whose greedy run ends at EOS early: min_tokens keeps EOS (and an extra stop id)
  # from being drawn until that many tokens are out; then the request may stop.
  for seed in range(300):
    prompt = _prompts((4,), seed=500 + seed)[0]
    run, _ = dense_greedy(prompt, 12)
    if EOS in run[:5]:
      break
  else:
    pytest.skip("no prompt of these seeds reaches EOS early")
  first_eos = run.index(EOS)
  stop_id = 127
  for min_tokens in (first_eos + 1, first_eos + 4, 12):
    params = SamplingParams(max_tokens=12, min_tokens=min_tokens, stop_token_ids=(stop_id,))
    out, = llm.generate([prompt], params)
    expect = dense_adjusted(prompt, 12, min_tokens=min_tokens, stop=(EOS, stop_id))
    assert out.token_ids == expect and len(expect) >= min_tokens
    assert out.finish_reason == ("length" if len(expect) == 12 else "stop")
  out, = llm.generate([prompt], SamplingParams(max_tokens=12))
  assert out.token_ids == run[:first_eos] and out.finish_reason == "stop"
  # Sampled completions (forks of one prompt, a low temperature that follows the greedy run
  # to EOS) are barred alike: each runs past min_tokens, where unbarred ones stop at EOS.
  hot = dict(max_tokens=12, temperature=0.3, seed=7, n=3)
  early = llm.generate([prompt], SamplingParams(**hot))
  assert any(len(o.token_ids) < first_eos + 3 for o in early)
  outs = llm.generate([prompt], SamplingParams(**hot, min_tokens=first_eos + 3))
  assert all(len(o.token_ids) >= first_eos + 3 for o in outs)


def test_n_completions_through_fork(llm, dense_greedy):
  prompt = _prompts((10,), seed=8)[0]  # 10 tokens, Z=4: a partial tail block is copied
  outs = llm.generate([prompt], SamplingParams(max_tokens=6, n=3, ignore_eos=True))
  expect, _ = dense_greedy(prompt, 6)
  assert [o.sample_index for o in outs] == [0, 1, 2]
  assert all(list(o.token_ids) == expect for o in outs)
  hot = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=11, ignore_eos=True)
  a = llm.generate([prompt, _prompts((4,), seed=9)[0]], [hot, SamplingParams(max_tokens=3)])
  b = llm.generate([prompt], hot)
  assert len(a) == 4 and [o.prompt_index for o in a] == [0, 0, 0, 1]
  assert [o.token_ids for o in a[:3]] == [o.token_ids for o in b]
  assert len({tuple(o.token_ids) for o in b}) > 1
  _check_all_free(llm)


def test_streaming_yields_the_generated_tokens(llm):
  prompts = _prompts((6, 18, 3, 11), seed=10)
  params = SamplingParams(max_tokens=9, ignore_eos=True)
  outs = llm.generate(prompts, params)
  got, finished = {}, {}
  for ev in llm.generate_stream(prompts, params):
    if ev.token_id is None:
      finished[ev.prompt_index] = ev.finish_reason
    else:
      assert ev.prompt_index not in finished
      got.setdefault(ev.prompt_index, []).append(ev.token_id)
  assert [list(got[i]) for i in range(len(prompts))] == [o.token_ids for o in outs]
  assert finished == {i: "length" for i in range(len(prompts))}


def test_abandoned_stream_releases_its_blocks(llm, dense_greedy):
  llm.reset_stats()
  stream = llm.generate_stream(_prompts((6, 18, 3, 11), seed=15),
                               SamplingParams(max_tokens=20, ignore_eos=True))
  next(stream)
  time.sleep(0.5)  # the consumer holds the event: not the engine's serving time
  stream.close()
  _check_all_free(llm)
  # Before: wall_s counted the consumer's 0.5 s and all 4 requests counted as served.
  assert llm.stats["wall_s"] < 0.5 and llm.stats["requests"] == 0
  good = _prompts((7,), seed=16)[0]
  out, = llm.generate([good], SamplingParams(max_tokens=6, ignore_eos=True))
  assert list(out.token_ids) == dense_greedy(good, 6)[0]


def test_stats_counters_do_not_wrap_on_a_long_lived_engine(llm):
  # The device kept the stats counters since the last reset in int32 / float32: 2**31
  # prompt tokens read negative (hit rate -1.0), a float32 sum of 2**24 busy steps stopped
  # growing. Each call now counts from 0 and the host sums in Python numbers.
  llm.reset_stats()
  long_ago = 2**31 - 50
  llm._state = dataclasses.replace(llm._state, prompt_tokens=jnp.int32(long_ago),
                                   utilization_sum=jnp.float32(2.0**24))
  llm._scheduler.device_counters.update(prompt_tokens=long_ago, utilization_sum=2.0**24,
                                        busy_steps=2**24)
  prompts = _prompts((30, 30, 20))
  llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
  stats = llm.stats
  assert stats["prompt_tokens"] == long_ago + 80 and 0 <= stats["prefix_hit_rate"] <= 1
  busy = stats["steps"]  # every step of this call ran a batch
  assert llm._scheduler.device_counters["busy_steps"] == 2**24 + busy
  assert llm._scheduler.device_counters["utilization_sum"] > 2.0**24 + 0.5 * busy
  llm.reset_stats()
  assert llm.stats["prompt_tokens"] == 0 and llm.stats["steps"] == 0


def test_an_engine_that_admitted_2_31_requests_keeps_serving(llm, dense_greedy):
  # The host's arrival counter grew with every request the engine ever admitted, and the
  # int32 arrival_S row refused request 2**31 (OverflowError). Arrivals rank the sequences
  # of one serve only, so each serve counts from 0.
  llm._scheduler._arrivals = 2**31 - 1
  prompts = _prompts((5, 9))
  outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
  assert [list(o.token_ids) for o in outs] == [dense_greedy(p, 4)[0] for p in prompts]


def test_row_chunks_and_admit_write_exactly_the_given_slots():
  # admit writes the rows of the slots given (a chunk of r = ADMIT_ROWS slots per data
  # shard, padded), nothing else: checked against a plain numpy merge of whole rows, on
  # one shard and on two (vmapped per shard, as a mesh runs it), over several chunks.
  from paged_jax import KVCacheSpec
  from paged_jax.engine import state as state_lib
  rng = np.random.default_rng(3)
  max_len, r = 12, state_lib.ADMIT_ROWS
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=8,
                     dtype=jnp.float32)
  for shards, per_shard in ((1, 2 * r + 3), (2, r + 3)):
    num_slots = shards * per_shard
    before = {}  # every row non-default, so an unwanted write shows
    for name in state_lib.ROW_FIELDS:
      fill = state_lib.host_rows(num_slots, max_len)[name]
      before[name] = rng.integers(1, 9, fill.shape).astype(fill.dtype)
    slots = rng.permutation(num_slots)[:num_slots - 2]  # all shards, > r in one
    entries = []
    for s in slots:
      values = dict(len_S=int(rng.integers(1, 9)), top_p_S=0.5, fresh_S=True)
      if s % 3:  # a prompt and stop ids (a prefix of their rows); else a cleared slot
        values.update(tokens_SJ=list(rng.integers(1, 99, rng.integers(1, max_len))),
                      stop_Si=[7, 8])
      entries.append((int(s), values))
    expect = {k: v.copy() for k, v in before.items()}
    empty = state_lib.host_rows(1, max_len)
    for s, values in entries:
      for name in state_lib.ROW_FIELDS:
        expect[name][s] = empty[name][0]
        value = values.get(name, ())
        if expect[name].ndim == 2:
          expect[name][s, :len(value)] = value
        elif name in values:
          expect[name][s] = value
    st = state_lib.init_state(spec, per_shard, max_len)
    if shards > 1:
      st = jax.tree.map(lambda x: jnp.stack([x] * shards), st)
    shaped = lambda x: jnp.asarray(x).reshape(st.status_S.shape + x.shape[1:])
    st = dataclasses.replace(st, **{k: shaped(v) for k, v in before.items()})
    admit = state_lib.admit if shards == 1 else jax.vmap(state_lib.admit)
    chunks = list(state_lib.row_chunks(entries, max_model_len=max_len, shards=shards,
                                       slots_per_shard=per_shard))
    most = np.bincount(slots // per_shard).max()  # the fullest shard's slots
    assert len(chunks) == -(-most // r) >= 2 and all(c[0].shape == (shards * r,)
                                                      for c in chunks)
    for slot_r, rows in chunks:
      assert all(v.shape[0] == shards * r for v in rows.values())
      split = lambda x: jnp.asarray(x).reshape((shards, r) + x.shape[1:]) if shards > 1 \
          else jnp.asarray(x)
      st = admit(st, split(slot_r), jax.tree.map(split, rows))
    for name in state_lib.ROW_FIELDS:
      got = np.asarray(getattr(st, name)).reshape(expect[name].shape)
      np.testing.assert_array_equal(got, expect[name], err_msg=f"{name}, {shards} shards")


def test_admitting_uploads_the_admitted_slots_rows_not_every_slots(model, config,
                                                                     dense_greedy):
  # Each admit wrote all max_seqs rows of max_model_len tokens (and log-probs): 64 MiB per
  # admission at 256 slots x 32k. Now a chunk of ADMIT_ROWS slots at a time; more slots
  # than that admitted at once take several chunks, and the outputs are unchanged.
  from paged_jax.engine.state import ADMIT_ROWS
  engine = LLM(model, config, block_size=4, num_blocks=64, max_seqs=ADMIT_ROWS + 4,
               max_tokens_per_step=32, steps_per_call=8)
  real, shapes = engine._device.admit, []

  def spy(st, slot_r, rows):
    shapes.append((slot_r.shape, rows["tokens_SJ"].shape))
    return real(st, slot_r, rows)

  spy.lower = real.lower
  engine._device.admit = spy
  prompts = _prompts([3 + i % 7 for i in range(ADMIT_ROWS + 4)], seed=11)
  outs = engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
  assert [list(o.token_ids) for o in outs] == [dense_greedy(p, 3)[0] for p in prompts]
  one_chunk = ((ADMIT_ROWS,), (ADMIT_ROWS, engine.max_model_len))
  assert len(shapes) >= 3 and set(shapes) == {one_chunk}  # two to admit, then clears
  _check_all_free(engine)


def test_stats_and_array_prompts_compile_nothing(model, config):
  # stats counted the cached blocks with an eager jnp reduction: the first read after
  # precompile compiled five small programs (0.4-0.5 s on a metrics poll). A JAX array
  # prompt was unstacked by a program compiled for each new length, then read back one
  # token at a time.
  engine = LLM(model, config, block_size=4, num_blocks=16, max_seqs=2,
               max_tokens_per_step=8, steps_per_call=2)
  prompt = jnp.arange(3, 3 + 37, dtype=jnp.int32)
  compiled = []
  with jax.log_compiles(True):
    handler = logging.Handler()
    handler.emit = lambda record: compiled.append(record.getMessage())
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
      stats = engine.stats
      encoded = engine._scheduler.requests([prompt], None)[0].prompt
    finally:
      logger.removeHandler(handler)
  assert stats["cached_blocks"] == 0 and stats["num_free_blocks"] == 16
  assert encoded == tuple(range(3, 40))
  assert not [m for m in compiled if "ompil" in m], compiled


def test_generate_makes_no_implicit_transfer(llm):
  # A caller's jax.transfer_guard("disallow") around generate failed at once: the host
  # rows, masks and the slots wanted went up with jnp.asarray (implicit), and the failed
  # cleanup raised a second error over the first. Now every transfer is explicit.
  prompts = _prompts((6, 18, 3), seed=21)
  params = SamplingParams(max_tokens=6, ignore_eos=True)

  def serve():
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    stream = llm.generate_stream(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()  # the abort call
    return outs, llm.stats["num_free_blocks"]

  want = serve()  # compiles what it needs outside the guard
  with jax.transfer_guard("disallow"):
    got = serve()
  assert got == want and got[1] == llm.spec.num_blocks


def test_a_stream_left_open_refuses_a_second_one_until_closed(llm, dense_greedy):
  # A stream kept in a variable and left after a few events still holds its slots and
  # blocks; a second generate used to hand those slots out again and read the first
  # stream's K/V (wrong tokens, no error). Now it is refused until the first is closed.
  prompts = _prompts((6, 18, 3, 11), seed=17)
  params = SamplingParams(max_tokens=10, ignore_eos=True)
  expected = [dense_greedy(p, 10)[0] for p in prompts]
  good = _prompts((7,), seed=18)[0]
  stream = llm.generate_stream(prompts, params)
  late = llm.generate_stream([good], params)  # made before either runs
  events = [next(stream)]
  for call in (lambda: llm.generate([good], params),
               lambda: llm.generate_stream([good], params)):
    with pytest.raises(RuntimeError, match=r"still open .* call its \.close\(\)"):
      call()
  # Two streams made before either ran: the second is refused at its first event.
  with pytest.raises(RuntimeError, match="still open"):
    next(late)
  # The refusals changed nothing: the first stream finishes as if alone.
  events += list(stream)
  got = {}
  for ev in events:
    if ev.token_id is not None:
      got.setdefault(ev.prompt_index, []).append(ev.token_id)
  assert [got[i] for i in range(len(prompts))] == expected
  _check_all_free(llm)
  # Exhausted, it is closed: the engine serves again; and so after an explicit close.
  out, = llm.generate([good], params)
  assert list(out.token_ids) == dense_greedy(good, 10)[0]
  stream = llm.generate_stream(prompts, params)
  next(stream)
  stream.close()
  out, = llm.generate([good], params)
  assert list(out.token_ids) == dense_greedy(good, 10)[0]
  _check_all_free(llm)
  # The stream refused at its first event is not spent: it serves its request now (a
  # generator that raised was finished, and yielded nothing, its request dropped unsaid).
  tokens = [ev.token_id for ev in late if ev.token_id is not None]
  assert tokens == dense_greedy(good, 10)[0]
  assert list(late) == []  # exhausted now
  _check_all_free(llm)


def test_unseeded_sampling_is_as_on_a_fresh_engine_after_an_unused_stream(model, config):
  # A stream never iterated, closed unstarted, or refused at its first event draws no
  # seeds: the unseeded requests after it sample as on a fresh engine (the seeds were
  # drawn when the stream was made).
  def make():
    return LLM(model, config, block_size=4, num_blocks=48, max_seqs=4, seed=3)

  prompts, params = _prompts((5, 9), seed=4), SamplingParams(max_tokens=6, temperature=1.0)
  want = [o.token_ids for o in make().generate(prompts, params)]
  llm = make()
  unused = llm.generate_stream(prompts, params)
  closed = llm.generate_stream(prompts, params)
  closed.close()
  assert list(closed) == []
  first = llm.generate_stream(prompts[:1], SamplingParams(max_tokens=2, seed=0))
  refused = llm.generate_stream(prompts, params)
  next(first)
  with pytest.raises(RuntimeError, match="still open"):
    next(refused)
  first.close()
  del unused, refused
  assert [o.token_ids for o in llm.generate(prompts, params)] == want
  with pytest.raises(ValueError):  # throw() into an unstarted stream: raised, then closed
    llm.generate_stream(prompts, params).throw(ValueError("x"))


def test_a_stream_never_closed_exits_quietly():
  # A stream left open at interpreter exit is finalised after the modules are torn down:
  # its cleanup used numpy (None by then) and printed "Exception ignored ... TypeError".
  script = (
      "from paged_jax import LLM, ModelConfig, SamplingParams\n"
      "from paged_jax.models import init_random\n"
      "c = ModelConfig(model_type='llama', vocab_size=64, embed_dim=32, mlp_dim=48, "
      "num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=32)\n"
      "llm = LLM(init_random(c, seed=0, impl='xla'), c, num_blocks=8, max_seqs=2, "
      "compilation_cache=False)\n"
      "stream = llm.generate_stream([[1, 2, 3]], SamplingParams(max_tokens=9))\n"
      "print('event', next(stream).token_id is not None)\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "event True" in proc.stdout, proc.stderr[-2000:]
  assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(llm, dense_greedy):
  # Its last 9 tokens of a prompt of 40 (generated as from those alone); -1: the last 127
  # of a prompt of 200, past max_model_len = 128, leaving room for one token; a prompt
  # shorter than k served whole. Without it, the long prompt is refused with the way out.
  long = _prompts((40, 200), seed=8)
  base = dict(max_tokens=5, ignore_eos=True)
  outs = llm.generate(long + [long[0][:5]], [
      SamplingParams(**base, truncate_prompt_tokens=9),
      SamplingParams(**base, truncate_prompt_tokens=-1),
      SamplingParams(**base, truncate_prompt_tokens=9)])
  assert outs[0].prompt_token_ids == long[0][-9:]
  assert outs[0].token_ids == dense_greedy(long[0][-9:], 5)[0]
  assert outs[1].prompt_token_ids == long[1][-127:] and len(outs[1].token_ids) == 1
  assert outs[1].finish_reason == "length"
  assert outs[2].prompt_token_ids == long[0][:5]
  assert outs[2].token_ids == dense_greedy(long[0][:5], 5)[0]
  with pytest.raises(ValueError, match=r"prompts\[0\] has 200 tokens; must be < max_model_len"
                                       r"=128 .* SamplingParams\(truncate_prompt_tokens=-1\) "
                                       r"serves its last 127"):
    llm.check_requests([long[1]])
  with pytest.raises(ValueError, match=r"prompts\[0\]: truncate_prompt_tokens=130 keeps 130 "
                                       r"tokens; must be < max_model_len=128 .* \(-1 keeps"):
    llm.check_requests(long[::-1], SamplingParams(truncate_prompt_tokens=130))
  _check_all_free(llm)


def test_a_prompt_over_the_callers_max_model_len_names_it_as_theirs(model, config):
  # The refusal named the model's context and the pool as what bounds max_model_len, though
  # the caller had set a smaller one; now it says so, and what the model and pool allow.
  capped = LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_model_len=20)
  with pytest.raises(ValueError, match=r"has 25 tokens; must be < max_model_len=20 \(as "
                     r"passed to LLM; the model and the pool allow up to 128: model context"):
    capped.check_requests([[3] * 25])


@pytest.mark.parametrize("where", ["_call", "admit", "admit_last"])
def test_an_interrupt_between_a_donating_call_and_its_result_leaves_the_engine_serving(
    model, config, where):
  # Ctrl-C landing after a device call took the donated state but before its result was
  # assigned left the engine on deleted buffers: the cleanup's abort raised "Buffer has been
  # deleted or donated" in place of the KeyboardInterrupt, and every later generate failed.
  llm = LLM(model, config, block_size=4, num_blocks=64, max_seqs=3)
  prompts, params = _prompts((5, 17, 9, 30), seed=21), SamplingParams(max_tokens=6)
  want = [o.token_ids for o in llm.generate(prompts, params)]
  owner, name = (llm, "_call") if where == "_call" else (llm._device, "admit")
  real, calls, last = getattr(owner, name), [], [None]

  def interrupted(*args):
    out = real(*args)  # the state's buffers are donated, the result is dropped
    calls.append(1)
    # "admit_last": the generate's last admission, which clears finished slots after every
    # sequence ended (no slot left for the cleanup to drop: the state was left lost).
    if where != "admit_last" or len(calls) == last[0]:
      raise KeyboardInterrupt
    return out

  if where == "admit_last":  # count a generate's admissions first
    setattr(owner, name, interrupted)
    llm.generate(prompts, params)
    last[0], calls[:] = len(calls), []

  setattr(owner, name, interrupted)
  with pytest.raises(KeyboardInterrupt):
    llm.generate(prompts, params)
  if name == "_call":
    del llm._call  # the instance's stand-in: the method again
  else:
    setattr(owner, name, real)
  _check_all_free(llm)  # stats and the allocator state readable at once
  assert [o.token_ids for o in llm.generate(prompts, params)] == want
  _check_all_free(llm)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_second_interrupt_in_the_cleanup_leaves_no_sequence_behind(model, config, when):
  # Ctrl-C during a serve, then another during its cleanup's abort (before its device call,
  # or after it, its result lost): the sequences stayed in their slots, the engine said it
  # was idle, and the next generate's requests took those slots as their own KV: wrong
  # tokens, no error (or a "no progress" error when the new prompts were shorter).
  llm = LLM(model, config, block_size=4, num_blocks=48, max_seqs=4)
  runs, real_run, real_abort = [], llm._run, llm._device.abort

  def run(*args):
    runs.append(1)
    if len(runs) == 3:
      raise KeyboardInterrupt("the first")
    return real_run(*args)

  class Abort:  # the jitted abort (``lower`` and all), interrupted ``raises`` times
    raises = 1

    def __getattr__(self, name):
      return getattr(real_abort, name)

    def __call__(self, *args):
      if self.raises <= 0:
        return real_abort(*args)
      self.raises -= 1
      if when == "after":
        real_abort(*args)  # the state's buffers are donated, the result is dropped
      raise KeyboardInterrupt("the second")

  abort = Abort()
  llm._run, llm._device.abort = run, abort
  with pytest.raises(KeyboardInterrupt, match="the second"):
    llm.generate(_prompts((3, 3, 3, 3), seed=5), SamplingParams(max_tokens=40, ignore_eos=True))
  del llm._run
  if when == "before":  # (after: the state was lost, and is rebuilt with no device call)
    # The next serve's first act, dropping every slot, interrupted too (its own cleanup
    # then ran with no slot of its own taken, and the engine was taken for clean).
    abort.raises = 1
    with pytest.raises(KeyboardInterrupt, match="the second"):
      llm.generate(_prompts((3,), seed=7), SamplingParams(max_tokens=4))
  llm._device.abort = real_abort
  # The pool is readable at once (a lost state is rebuilt): the blocks the dropped
  # sequences hold count as taken until the next serve drops them.
  allocator.validate(llm.allocator_state)
  assert 0 < llm.stats["num_free_blocks"] <= 48
  prompts, params = _prompts((20, 22, 24, 26), seed=6), SamplingParams(max_tokens=8)
  fresh = LLM(model, config, block_size=4, num_blocks=48, max_seqs=4)
  want = [(o.token_ids, o.logprobs) for o in fresh.generate(prompts, params)]
  assert [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)] == want
  _check_all_free(llm)


def test_outputs_hash_with_their_lists():
  from paged_jax.engine import Output
  a, b = (Output(0, 0, [1, 2], [3], None, "length", [-0.5]) for _ in range(2))
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert hash(a) != hash(Output(0, 0, [1, 2], [4], None, "length", [-0.5]))
  # with top logprobs, a dict per token
  c, d = (Output(0, 0, [1], [3], None, "length", [-0.5], None, [{3: -0.5, 7: -1.0}])
          for _ in range(2))
  assert c == d and hash(c) == hash(d) and len({a, c, d}) == 2
  assert hash(c) != hash(Output(0, 0, [1], [3], None, "length", [-0.5], None, [{3: -0.5}]))
  e = Output(0, 0, [1], [3], None, "length", [-0.5], None, [{7: -1.0, 3: -0.5}])
  assert c == e and hash(c) == hash(e)  # dicts are equal whatever their order


def test_stats_before_anything_ran_report_no_utilisation(model, config):
  # kv_utilization read 1.0 (full) for an engine that had stored nothing.
  llm = LLM(model, config, block_size=4, num_blocks=64, max_seqs=2)
  assert llm.stats["kv_utilization"] == 0.0 and llm.stats["generated_tokens"] == 0
  llm.generate(_prompts((6,)), SamplingParams(max_tokens=3))
  assert 0.0 < llm.stats["kv_utilization"] <= 1.0
  llm.reset_stats()
  assert llm.stats["kv_utilization"] == 0.0


def test_a_pool_that_caps_max_model_len_says_so(model, config):
  # A pool too small for the model's context capped max_model_len in silence: generations
  # ended with "length" early, read as a wrong-token bug. Now a UserWarning names both; a
  # max_model_len of the caller's own, or a pool that holds the context, says nothing.
  with pytest.warns(UserWarning, match=r"max_model_len=32, below the model's context 128: "
                    r"no sequence longer fits the KV pool alone \(model context 128, KV pool "
                    r"8 blocks x 4 tokens = 32 tokens\)") as caught:
    capped = LLM(model, config, block_size=4, num_blocks=8, max_seqs=2)
  assert capped.max_model_len == 32 and [w.filename for w in caught] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    LLM(model, config, block_size=4, num_blocks=8, max_seqs=2, max_model_len=30)
    LLM(model, config, block_size=4, num_blocks=32, max_seqs=2)


def test_an_eos_id_outside_the_vocabulary_is_warned_of(model, config):
  # A config whose EOS id the model can never emit (vocab_size 128, EOS 128: a checkpoint's
  # EOS past a truncated vocabulary) served in silence, every request ending at max_tokens.
  # Now a UserWarning at the user's line names the id; the other EOS ids still stop.
  bad = dataclasses.replace(config, eos_token_ids=(EOS, config.vocab_size))
  with pytest.warns(UserWarning, match=r"config.eos_token_ids=\(2, 128\) holds \[128\], "
                    r"outside the vocabulary \(vocab_size=128\): the model never emits it") as w:
    llm = LLM(model, bad, block_size=4, num_blocks=64, max_seqs=2)
  assert [x.filename for x in w] == [__file__] and llm._scheduler.eos == (EOS, 128)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    LLM(model, config, block_size=4, num_blocks=64, max_seqs=2)


def test_a_two_dimensional_array_is_a_batch_of_prompts(llm, dense_greedy):
  # A [B, T] array (a tokenizer's batch output) was refused as "not a list of prompts"; it
  # is B prompts of T tokens, NumPy or JAX. One prompt as a 1-D array stays refused (one
  # prompt, or T prompts of one token?), with a message saying how to pass it.
  rows = np.array(_prompts((6, 6), seed=21))
  want = [dense_greedy([int(t) for t in r], 3, stop=(EOS,))[0] for r in rows]
  for batch in (rows, jnp.asarray(rows, jnp.int32)):
    assert [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=3))] == want
  with pytest.raises(ValueError, match=r"prompts=ndarray\(6,\) must be a list of prompts or "
                     r"a \[B, T\] array of B prompts \(one prompt: put it in a list\)"):
    llm.generate(rows[0], SamplingParams(max_tokens=3))
  with pytest.raises(ValueError, match=r"prompts=ndarray\(2, 1, 6\) must be a list of"):
    llm.generate(rows[:, None], SamplingParams(max_tokens=3))  # the message named no shape
  _check_all_free(llm)


def test_bad_requests_are_refused_and_engine_keeps_serving(llm, dense_greedy):
  good = _prompts((5,), seed=12)[0]
  for bad, match in (([], "empty"), ([1, 500], "vocabulary"), ([3] * 200, "max_model_len"),
                     ("text", "tokenizer"), ([4, 2.0, 5], r"prompts\[1\]\[1\]=2.0 is a float"),
                     (np.array([4.5, 6.0]), "prompts\\[1\\] has dtype float64"),
                     ([4, True], r"prompts\[1\]\[1\]=True is a bool; token ids must be "
                      r"ints$"),
                     (np.array([[4, 5]]), r"prompts\[1\] has shape \(1, 2\); a prompt is "
                      "one sequence")):
    with pytest.raises(ValueError, match=match):
      llm.generate([good, bad], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=match):  # the same, with nothing served
      llm.check_requests([good, bad], SamplingParams(max_tokens=4))
  # The bound is named with the pool's own size (it printed 64 x 4 = 128, the context).
  with pytest.raises(ValueError, match=r"must be < max_model_len=128 \(model context 128, KV "
                                       r"pool 64 blocks x 4 tokens = 256 tokens\)"):
    llm.check_requests([[3] * 128])
  # check_requests draws no seeds: unseeded sampling afterwards is as if it had not run.
  rng = llm._scheduler._rng
  before = rng.bit_generator.state
  assert llm.check_requests([good, good], SamplingParams(temperature=1.0)) is None
  assert rng.bit_generator.state == before
  with pytest.raises(ValueError, match="n="):
    llm.generate([good], SamplingParams(n=4))  # max_seqs is 3
  with pytest.raises(ValueError, match="len"):
    llm.generate([good, good], [SamplingParams()])
  # A dict of SamplingParams fields was iterated as a list ("params[0]='max_tokens' ...").
  for params in (dict(max_tokens=3), 3):
    with pytest.raises(ValueError, match=f"params={type(params).__name__} must be a "
                                         "SamplingParams or a list of them, one per prompt"):
      llm.generate([good], params)
  # Stop strings are read in the text: an engine without a tokenizer has none.
  with pytest.raises(ValueError, match=r"params\[1\].stop=\('\\n',\) needs the engine's "
                                       "tokenizer"):
    llm.check_requests([good, good], [SamplingParams(), SamplingParams(stop="\n")])
  with pytest.raises(ValueError, match=r"params\[1\].stop_token_ids=\(7, 128\) holds \[128\], "
                     r"outside the vocabulary \[0, vocab_size=128\)"):
    llm.generate([good, good], [SamplingParams(), SamplingParams(stop_token_ids=(7, 128))])
  out, = llm.generate([good], SamplingParams(max_tokens=5, ignore_eos=True))
  assert list(out.token_ids) == dense_greedy(good, 5)[0]
  # Integer arrays (numpy, JAX) and their scalars are token ids as they are.
  for ids in (np.array(good, np.int64), jnp.array(good), list(jnp.array(good))):
    out, = llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))
    assert list(out.token_ids) == dense_greedy(good, 2)[0]
  _check_all_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_k=-1), "top_k"),
    (dict(temperature=1e300), r"temperature=1e\+300 must be a finite number >= 0 \(at most"),
    (dict(top_k=2**31), r"top_k=2147483648 must be an int in \[0, 2\*\*31\)"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=-3), "seed"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(n=0), "n"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop=("a", "")), r"stop=\('a', ''\) must be a non-empty str, a sequence of "),
    (dict(stop=[7]), r"stop=\[7\] must be"), (dict(stop=b"\n"), r"stop=b'\\n' must be"),
    (dict(stop={"a"}), "stop="), (dict(stop=""), "stop='' must be a non-empty str"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output=1 must be a bool"),
    (dict(skip_special_tokens="no"), "skip_special_tokens='no' must be a bool"),
    (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens=0 must be None, an int >= 1 "
                                     r"\(the prompt's last that many tokens\) or -1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens=-2 must be"),
    (dict(truncate_prompt_tokens=4.0), "truncate_prompt_tokens=4.0 must be"),
    (dict(min_p=1.5), r"min_p=1.5 must be a number in \[0, 1\]"), (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0.0 must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty=inf"),
    (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty=-3 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (dict(min_tokens=17), r"min_tokens=17 must be an int in \[0, max_tokens=16\]"),
    (dict(min_tokens=-1), "min_tokens=-1"), (dict(min_tokens=1.0), "min_tokens=1.0"),
    (dict(logprobs=True, top_logprobs=21), r"top_logprobs=21 must be an int in \[0, 20\]"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs=-1"),
    (dict(logprobs=True, top_logprobs=2.0), "top_logprobs=2.0"),
    (dict(logprobs=True, top_logprobs=True), "top_logprobs=True"),
    (dict(top_logprobs=3), "top_logprobs=3 needs logprobs=True"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\]=101 must be a number in \[-100, 100\]"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\]=nan must be a number"),
    (dict(logit_bias={-1: 1.0}), "logit_bias key -1 must be a token id, an int >= 0"),
    (dict(logit_bias={"5": 1.0}), r"logit_bias key '5' must be a token id, an int >= 0 "
                                  r"\(JSON's keys are strings: make them ints\)"),
    (dict(logit_bias={True: 1.0}), "logit_bias key True must be a token id"),
    (dict(logit_bias={5: True}), r"logit_bias\[5\]=True must be a number"),
    (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "names a token id twice"),
    (dict(logit_bias=[(5, 1.0, 2)]), r"\(5, 1.0, 2\) is no \(id, bias\) pair"),
    (dict(logit_bias=[{5: 1, 6: 2}]), r": \{5: 1, 6: 2\} is no \(id, bias\) pair"),
    (dict(logit_bias=[b"\x05\x01"]), r": b'\\x05\\x01' is no \(id, bias\) pair"),
    (dict(logit_bias=5), "logit_bias=5 must be a mapping of token ids"),
    (dict(logit_bias="ab"), "logit_bias='ab' must be a mapping of token ids"),
    (dict(logit_bias={t: 1.0 for t in range(301)}),
     "logit_bias biases 301 tokens, must be a mapping .* at most 300 of them"),
    (dict(allowed_token_ids=[]), r"allowed_token_ids=\[\] is empty: it must be None or a "
                                 r"non-empty sequence .* \(None allows every token\)"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids holds -1: it must be None or a"),
    (dict(allowed_token_ids=["3"]), "allowed_token_ids holds '3'"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids holds True"),
    (dict(allowed_token_ids=5), "allowed_token_ids=5 must be None or a non-empty sequence"),
    (dict(allowed_token_ids="ab"), "allowed_token_ids='ab' must be"),
    (dict(allowed_token_ids={1: 2}), r"allowed_token_ids=\{1: 2\} must be"),
    (dict(allowed_token_ids=np.ones((2, 2), int)), "allowed_token_ids=array"),
    (dict(allowed_token_ids=range(301)),
     "allowed_token_ids holds 301 distinct ids: it .* at most 300 distinct ones"),
])
def test_sampling_params_validation(kwargs, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs)


def test_sampling_params_take_any_real_number():
  # A Fraction is a real number NumPy's isfinite refused with a TypeError.
  from fractions import Fraction
  assert SamplingParams(temperature=Fraction(1, 4), top_p=Fraction(1, 2)).temperature == 0.25
  with pytest.raises(ValueError, match="temperature=Fraction"):
    SamplingParams(temperature=Fraction(10**400, 3))


def test_sampling_params_defaults_and_frozen():
  p = SamplingParams()
  assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop_token_ids, p.n) == (
      16, 0.0, 0, 1.0, None, (), 1)
  with pytest.raises(Exception):
    p.max_tokens = 3  # frozen
  assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
  # One stop string or several (a list as a tuple, repeats once); "" would stop at once.
  assert SamplingParams(stop="\n").stop == ("\n",) and p.stop == ()
  assert SamplingParams(stop=["a", "bc", "a"]).stop == ("a", "bc")
  assert SamplingParams(stop=None).stop == () and SamplingParams(stop=np.array(["x"])).stop == (
      "x",) and type(SamplingParams(stop=np.array(["x"])).stop[0]) is str
  assert p.include_stop_str_in_output is False
  # The penalties, min-p and min_tokens default to changing nothing; ints become floats.
  assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
          p.min_tokens) == (0.0, 1.0, 0.0, 0.0, 0)
  q = SamplingParams(min_p=1, repetition_penalty=2, presence_penalty=-2, frequency_penalty=2,
                     min_tokens=np.int64(16))
  assert (q.min_p, q.repetition_penalty, q.presence_penalty, q.frequency_penalty) == (
      1.0, 2.0, -2.0, 2.0) and type(q.min_p) is float and type(q.min_tokens) is int


def test_engine_options_validation(model, config):
  with pytest.raises(ValueError, match="mesh=object must be a jax.sharding.Mesh"):
    LLM(model, config, num_blocks=8, mesh=object())
  with pytest.raises(ValueError, match="num_blocks"):
    LLM(model, config, num_blocks=8, kv_budget_bytes=1 << 20)
  with pytest.raises(ValueError, match="max_seqs"):
    LLM(model, config, num_blocks=8, max_seqs=0)
  with pytest.raises(ValueError, match=r"could serve is 1 token\(s\) \(model context 128, KV "
                                       r"pool 1 blocks x 1 tokens = 1 tokens\); it must be >= 2"):
    LLM(model, config, block_size=1, num_blocks=1)  # nothing could ever be served
  spec_llm = LLM(model, config, block_size=4, kv_budget_bytes=64 * 2 * 2 * 4 * 2 * 16 * 4,
                 max_seqs=2)
  assert spec_llm.spec.num_blocks == 64
  # Each refused by the engine's own option name (they were numpy's TypeErrors, a message
  # naming KVCacheSpec.from_budget's budget_bytes, or accepted and failing later).
  # One block: 2 layers x (K + V) x 4 tokens x 2 heads x 16 dims x 4 bytes = 2048 bytes.
  for kwargs, match in ((dict(kv_budget_bytes=2047), r"kv_budget_bytes=2047 must be an int "
                         r"number of bytes >= one KV block \(2048 bytes: K and V x 2 layers "
                         r"x 2 KV heads x head_dim 16 x block_size 4 of float32\)"),
                        (dict(kv_budget_bytes=4096.0), "kv_budget_bytes=4096.0"),
                        (dict(dtype="garbage"), "dtype='garbage' is not a dtype"),
                        (dict(kv_cache_dtype="fp8"), r"jnp\.float8_e4m3fn"),
                        (dict(kv_cache_dtype=jnp.float64), "kv_cache_dtype=float64 needs "
                         "jax_enable_x64"),
                        (dict(seed=-1), "seed=-1"), (dict(seed=1.5), "seed=1.5"),
                        (dict(seed=None), "seed=None"), (dict(tokenizer=1), "tokenizer=int"),
                        (dict(max_traces=0), "max_traces=0"),
                        # int32 on the device: accepted before, then an OverflowError at
                        # the first call (2**31 - 1 steps a call hung building its report).
                        (dict(steps_per_call=2**31), r"steps_per_call=2147483648 must be "
                         r"< 2\*\*31"),
                        (dict(max_tokens_per_step=2**31, token_buckets=(32, 2**31)),
                         r"max_tokens_per_step=2147483648 must be < 2\*\*31")):
    budget = "kv_budget_bytes" in kwargs
    with pytest.raises(ValueError, match=match):
      LLM(model, config, block_size=4, num_blocks=None if budget else 8, **kwargs)
  # A config whose cache fields disagree with the model's own (model.config): more layers
  # were accepted (KV memory no layer writes), fewer failed only inside the first step.
  for field, value in (("num_layers", 3), ("num_layers", 1), ("num_kv_heads", 4),
                       ("head_dim", 8)):
    with pytest.raises(ValueError, match=rf"config.{field}={value} disagrees with the model's "
                                         rf"own Decoder.config.{field}="):
      LLM(model, dataclasses.replace(config, **{field: value}), num_blocks=8)
  # Fields that do not shape the cache may differ (a shorter context, other stop ids).
  LLM(model, dataclasses.replace(config, max_seq_len=64, eos_token_ids=()), num_blocks=8)


def test_tiny_pool_forces_preemption_and_outputs_unchanged(model, config, dense_greedy,
                                                           dense_adjusted):
  # 12 blocks of 4 tokens: three sequences of ~26 tokens cannot all stay resident.
  llm = LLM(model, config, block_size=4, num_blocks=12, max_seqs=3, max_tokens_per_step=16,
            steps_per_call=8)
  prompts = _prompts((10, 14, 8, 12, 6), seed=13)
  outs = llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True, logprobs=True,
                                              top_logprobs=3))
  assert llm.stats["preemptions"] > 0
  for p, o in zip(prompts, outs):
    tokens, lps = dense_greedy(p, 14)
    assert list(o.token_ids) == tokens  # and a preempted one's top logprobs are its own
    assert [list(t)[0] for t in o.top_logprobs] == tokens
    assert all(len(t) == 3 for t in o.top_logprobs)
    np.testing.assert_allclose([list(t.values())[0] for t in o.top_logprobs], lps, atol=1e-4)
  _check_all_free(llm)
  # A random mix with forks (n = 2) under the same pressure: forks, preemptions of forks,
  # recompute of forks that got no block, all equal the oracle.
  rng = np.random.default_rng(17)
  prompts = _prompts(rng.integers(1, 24, 6), seed=18)
  params = [SamplingParams(max_tokens=int(m), n=int(n), ignore_eos=True)
            for m, n in zip(rng.integers(1, 16, 6), rng.integers(1, 3, 6))]
  before = llm.stats["preemptions"]
  outs = iter(llm.generate(prompts, params))
  for p, sp in zip(prompts, params):
    expect = dense_greedy(p, sp.max_tokens)[0][:llm.max_model_len - len(p)]
    for f in range(sp.n):
      o = next(outs)
      assert (o.sample_index, list(o.token_ids)) == (f, expect)
  assert llm.stats["preemptions"] > before
  _check_all_free(llm)
  # Penalties read the history a preempted sequence keeps (recomputed, not re-sampled) and
  # a fork's (the prompt): the same mix penalised equals the penalised oracle.
  penalised = [dataclasses.replace(sp, repetition_penalty=1.6, frequency_penalty=0.4,
                                   presence_penalty=0.3 * i) for i, sp in enumerate(params)]
  before = llm.stats["preemptions"]
  outs = iter(llm.generate(prompts, penalised))
  for p, sp in zip(prompts, penalised):
    expect = dense_adjusted(p, min(sp.max_tokens, llm.max_model_len - len(p)), repetition=1.6,
                            frequency=0.4, presence=sp.presence_penalty)
    for f in range(sp.n):
      o = next(outs)
      assert (o.sample_index, list(o.token_ids)) == (f, expect)
  assert llm.stats["preemptions"] > before
  _check_all_free(llm)
  # A request longer than the whole pool (48 tokens) is refused; others still served.
  with pytest.raises(ValueError, match="KV pool"):
    llm.generate([prompts[0], [5] * 60], SamplingParams(max_tokens=2))
  out, = llm.generate([prompts[1]], SamplingParams(max_tokens=3, ignore_eos=True))
  assert list(out.token_ids) == dense_greedy(prompts[1], 3)[0]
  # max_model_len caps generation: 40-token prompt + up to 8 more tokens in a 48-token pool.
  long = _prompts((40,), seed=14)[0]
  out, = llm.generate([long], SamplingParams(max_tokens=30, ignore_eos=True))
  assert out.finish_reason == "length" and len(out.token_ids) == 48 - 40
  _check_all_free(llm)


@pytest.mark.slow
def test_engine_step_traces_once(model, config):
  # max_traces=1 wraps the jitted device call in chex.assert_max_traces(n=1), per engine
  # and token bucket: chex counted every bucket, and every engine built at one line, as
  # one function, so two buckets or a second engine failed with nothing retraced.
  for _ in range(2):
    llm = LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16,
              steps_per_call=8, max_traces=1, token_buckets=(8, 16))
    for lengths, n in (((3,), 1), ((12, 5, 30, 2), 1), ((7,), 3), ((4, 9), 2)):
      llm.generate(_prompts(lengths, seed=len(lengths)),
                   SamplingParams(max_tokens=5, n=n, temperature=0.5, seed=1))
    assert sorted(llm._calls) == [8, 16]
    _check_all_free(llm)


def _run_args(*argv):
  import argparse
  from paged_jax import cli_run
  parser = argparse.ArgumentParser()
  cli_run.add_run_parser(parser.add_subparsers())
  return parser.parse_args(["run", *argv])


def test_cli_run_prints_report(capsys, monkeypatch):
  # A pool of 16 blocks (256 tokens) shrinks the default workload (prompts up to 192
  # tokens): the report says so. The sampling options apply to the synthetic requests.
  from paged_jax import Session
  seen = []
  add = Session.add

  def recording(self, prompts, params=None, **kwargs):
    seen.extend(params)
    return add(self, prompts, params, **kwargs)

  monkeypatch.setattr(Session, "add", recording)
  args = _run_args("--num-requests", "6", "--seed", "1", "--max-seqs", "4",
                   "--steps-per-call", "8", "--num-blocks", "16", "--temperature", "0.7",
                   "--top-p", "0.9", "--output-median", "200", "--min-p", "0.05",
                   "--repetition-penalty", "1.1", "--frequency-penalty", "0.5")
  with warnings.catch_warnings(record=True) as caught:  # the report's note, no warning
    warnings.simplefilter("always")
    assert args.func(args) == 0
  assert not [w for w in caught if "max_model_len=" in str(w.message)]
  captured = capsys.readouterr()
  for key in ("tokens/s", "requests/s", "peak blocks in use", "mean blocks in use",
              "KV utilisation", "preemptions", "host syncs per token", "6 synthetic requests",
              "workload caps lowered to fit max_model_len=256 (what one sequence can hold "
              "in the KV pool): prompts <= 128 tokens (default 192)\n",  # outputs: not cut
              "--output-median 200 is above the cap of 96 tokens"):
    assert key in captured.out
  assert "served 6/6 requests" in captured.err  # the progress line
  # Not a terminal (captured, as a log file or a pipe): each progress update its own line.
  # Carriage returns put every update of a log on one line.
  assert "\r" not in captured.err and re.search(r"served 6/6 requests, .* s\n", captured.err)
  assert "device                cpu, attention xla (auto)" in captured.out  # where it ran
  assert "on cpu, attention xla (auto)" in captured.err
  assert len(seen) == 6 and all(
      (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
       p.frequency_penalty) == (0.7, 0.9, 0.05, 1.1, 0.0, 0.5) for p in seen)
  assert [p.seed for p in seen] == [1, 2, 3, 4, 5, 6]  # one stream per request


@pytest.mark.parametrize("argv,match", [
    (("--seed", "-1"), r"--seed=-1 must be an int in \[0, 2\*\*32\)"),
    (("--seed", str(2**40)), r"--seed=1099511627776 must be an int in"),
    (("--top-p", "1.5"), r"--top-p=1.5 must be in \(0, 1\]"),
    (("--top-p", "0"), r"--top-p=0.0 must be in"),
    (("--temperature", "-1"), r"--temperature=-1.0 must be a finite number >= 0"),
    (("--temperature", "nan"), r"--temperature=nan must be"),
    (("--temperature", "1e39"), r"--temperature=1e\+39 must be a finite number >= 0 \(at most"),
    (("--top-k", "-1"), r"--top-k=-1 must be >= 0"),
    (("--min-p", "1.5"), r"--min-p=1.5 must be in \[0, 1\]"),
    (("--min-p", "nan"), r"--min-p=nan must be"),
    (("--repetition-penalty", "0"), r"--repetition-penalty=0.0 must be a finite number > 0"),
    (("--repetition-penalty", "inf"), r"--repetition-penalty=inf must be"),
    (("--presence-penalty", "3"), r"--presence-penalty=3.0 must be in \[-2, 2\]"),
    (("--frequency-penalty", "nan"), r"--frequency-penalty=nan must be in"),
    (("--sigma", "-1"), r"--sigma=-1.0 must be a finite number >= 0"),
    (("--num-blocks", "0"), r"--num-blocks=0 must be >= 1"),
    (("--prompt", "hi", "--max-tokens", "0"), r"--max-tokens=0 must be >= 1"),
])
def test_cli_run_refuses_bad_options_before_building_anything(monkeypatch, argv, match):
  # Named as the option, and before JAX builds or compiles anything (a cold compile of a
  # checkpoint takes half a minute here).
  from paged_jax import cli_run
  monkeypatch.setattr(cli_run, "_engine", lambda args: pytest.fail("engine built"))
  args = _run_args(*argv)
  with pytest.raises(ValueError, match=match):
    args.func(args)


def test_cli_run_names_the_option_of_a_budget_under_one_block():
  # The engine's message named its argument, kv_budget_bytes=1024, not the flag.
  from paged_jax import cli_run
  with pytest.raises(ValueError, match=r"^--kv-budget=1KiB \(1024 bytes\) must be an int "
                     r"number of bytes >= one KV block \(16384 bytes: K and V x 2 layers"):
    cli_run._engine(_run_args("--kv-budget", "1KiB"))


def test_cli_run_names_the_options_when_the_pool_outgrows_the_device(monkeypatch):
  from paged_jax import cli_run

  def out_of_memory(args):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 21.5GiB.\n"
                       "more detail")

  monkeypatch.setattr(cli_run, "_engine", out_of_memory)
  args = _run_args("--kv-budget", "20GiB")
  # The sequences' state is named too (--max-seqs 1e9 was blamed on the pool alone).
  with pytest.raises(ValueError, match=r"the model, its KV pool and the state of "
                     r"--max-seqs=16 sequences do not fit the device's memory "
                     r"\(RESOURCE_EXHAUSTED: Out of memory while trying to allocate 21.5GiB.\); "
                     r"lower --kv-budget or --num-blocks, or --max-seqs"):
    args.func(args)
  monkeypatch.setattr(cli_run, "_engine", lambda args: 1 / 0)  # other errors pass through
  with pytest.raises(ZeroDivisionError):
    args.func(args)


def test_cli_run_prompt_needs_a_tokenizer():
  args = _run_args("--prompt", "hello")
  with pytest.raises(ValueError, match="tokenizer"):
    args.func(args)


def test_describe_device_names_the_kernel_auto_resolves_to(monkeypatch):
  import types
  from paged_jax import attention
  from paged_jax.cli_run import describe_device
  assert describe_device(types.SimpleNamespace(impl="reference")) == "cpu, attention reference"
  assert describe_device(object()) == "cpu, attention xla (auto)"  # your own model: no impl
  device = types.SimpleNamespace(device_kind="NVIDIA H200", platform="gpu",
                                 compute_capability="9.0")
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(attention, "_default_device", lambda: device)
  assert describe_device(types.SimpleNamespace(impl="auto")) == (
      "NVIDIA H200 (gpu), attention pallas_gpu (auto)")


def test_a_prefill_under_way_is_not_starved_by_a_new_sequence_that_cannot_fit(model, config,
                                                                            dense_greedy):
  # Found by a fuzz: 21 blocks of 2 tokens, prefix caching on. A preempted request (27-token
  # prompt, 6 generated) comes back hitting 7 cached blocks and wants 19 more tokens; it
  # arrived before a request that holds 7 blocks (14 tokens) and wants its last 3 prompt
  # tokens. The new one took the whole 16-token budget, then could not get 8 + 7 blocks of
  # the 14 free, so the step ran nobody, and so did every step after it (the engine looped
  # for ever). Prefills under way now go before new sequences; and three device calls in a
  # row without progress are a RuntimeError, never a hang (on the old order, this case).
  llm = LLM(model, config, block_size=2, num_blocks=21, max_seqs=4, max_tokens_per_step=16,
            steps_per_call=16, enable_prefix_caching=True)
  prompts = _prompts((4, 27, 17, 19), seed=5)
  params = [SamplingParams(max_tokens=m, n=n, ignore_eos=True)
            for m, n in ((10, 1), (10, 1), (2, 2), (10, 2))]
  outs = iter(llm.generate(prompts, params))
  for p, sp in zip(prompts, params):
    expect = dense_greedy(p, sp.max_tokens)[0][:llm.max_model_len - len(p)]
    for _ in range(sp.n):
      assert list(next(outs).token_ids) == expect
  assert llm.stats["preemptions"] > 0 and llm.stats["device_calls"] < 20
  _check_all_free(llm)


def test_device_calls_that_make_no_progress_raise_instead_of_hanging():
  # The host's guard on its own: a device whose every call leaves the same state (nothing
  # generated, prefilled or admitted) gets three calls, then a RuntimeError naming what
  # each slot wants, and the stream's cleanup aborts the slots it had filled.
  from paged_jax.engine.scheduler import Scheduler
  from paged_jax.engine.session import serve
  from paged_jax.engine.state import RUNNING
  sched = Scheduler(max_seqs=2, slots_per_shard=2, max_model_len=32, token_buckets=(8,),
                    vocab_size=128, eos=(), limit_note="")
  requests = sched.requests([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=4)] * 2)
  stuck = dict(status_S=np.full(2, RUNNING), len_S=np.array([3, 2]), start_S=np.array([3, 2]),
               want_S=np.array([3, 2]), reason_S=np.zeros(2, np.int32),
               tokens_SK=np.zeros((2, 4), np.int32), logprobs_SK=np.zeros((2, 4)),
               num_free=np.int32(5))
  calls, admitted, aborted = [], [], []
  stream = serve(sched, requests, run=lambda bucket, *_: calls.append(bucket) or stuck,
                 admit=lambda entries: admitted.append([s for s, _ in entries]),
                 abort=lambda mask: aborted.append(mask.copy()))
  with pytest.raises(RuntimeError, match=r"no progress .*tokens wanted per slot \[3, 2\]"):
    list(stream)
  assert len(calls) == 3 and admitted == [[0, 1]]
  assert [m.tolist() for m in aborted] == [[True, True]]


def test_the_kth_sampled_token_is_drawn_with_the_request_key_of_index_k(llm, model):
  # request_keys(seed, fork, k) for the k-th generated token (k = 0 first), as the engine
  # documents: the draws replay outside the engine from the dense logits. Nothing pinned
  # the index (an absolute position in its place passed every engine test).
  from paged_jax.sampling import request_keys, sample
  prompt = _prompts((7,), seed=12)[0]
  out, = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=77,
                                               ignore_eos=True))
  fwd = jax.jit(lambda t: model(t)[0].astype(jnp.float32))
  seq = list(prompt)
  for k, token in enumerate(out.token_ids):
    padded = np.zeros((1, ORACLE_LEN), np.int32)
    padded[0, :len(seq)] = seq
    logits_V = fwd(jnp.asarray(padded))[len(seq) - 1]
    key = request_keys(jnp.asarray([77], jnp.uint32), jnp.zeros(1, jnp.int32),
                       jnp.asarray([k], jnp.int32))
    want, _ = sample(logits_V[None], jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), key)
    assert token == int(want[0]), (k, out.token_ids)
    seq.append(token)


def test_a_call_reports_at_most_max_model_len_tokens_a_slot(model, config, dense_greedy):
  # The report carried [S, steps_per_call] tokens and log-probs: a generous steps_per_call
  # (1e8) made every call slow, and 2**31 - 1 never finished building it. A slot gains at
  # most one token a step and never passes max_model_len, so that is the report's width.
  llm = LLM(model, config, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=32,
            steps_per_call=10**6)
  report = llm._call_for(32).lower(llm._params, llm._state, jnp.int32(0),
                                   jnp.int32(10**6)).out_info[1]
  assert report["tokens_SK"].shape == report["logprobs_SK"].shape == (3, llm.max_model_len)
  prompts = _prompts((5, 9, 30))
  outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
  assert [list(o.token_ids) for o in outs] == [dense_greedy(p, 12)[0] for p in prompts]


def test_logit_bias_normalised_and_past_the_vocabulary_refused():
  from paged_jax.engine.scheduler import Scheduler
  # A mapping or pairs, held as (id, float bias) pairs in increasing id: hashable, equal.
  params = SamplingParams(logit_bias={9: -100, 2: np.float32(0.5), np.int64(4): 3})
  assert params.logit_bias == ((2, 0.5), (4, 3.0), (9, -100.0))
  assert params == SamplingParams(logit_bias=[(4, 3.0), (9, -100), (2, 0.5)])
  assert hash(params) == hash(SamplingParams(logit_bias=dict(params.logit_bias)))
  assert SamplingParams(logit_bias=None).logit_bias == SamplingParams().logit_bias == ()
  assert len(SamplingParams(logit_bias={t: 1.0 for t in range(300)}).logit_bias) == 300
  sched = Scheduler(max_seqs=2, slots_per_shard=2, max_model_len=32, token_buckets=(8,),
                    vocab_size=16, eos=(), limit_note="")
  assert len(sched.requests([[1]], SamplingParams(logit_bias={15: 1.0}))) == 1
  with pytest.raises(ValueError, match=r"params\[1\]\.logit_bias biases \[16, 40\], outside "
                                       r"the vocabulary \[0, vocab_size=16\)"):
    sched.requests([[1], [2]], [params, SamplingParams(logit_bias={16: 1, 3: 2, 40: 1})])


def test_allowed_ids_normalised_and_refused_past_the_vocabulary_or_all_barred():
  from paged_jax.engine.scheduler import Scheduler, bias_rows
  params = SamplingParams(allowed_token_ids=[9, np.int64(2), 9, 4], logit_bias={4: 1, 5: 2})
  assert params.allowed_token_ids == (2, 4, 9) and SamplingParams().allowed_token_ids is None
  assert params == SamplingParams(allowed_token_ids=np.array([4, 2, 9]), logit_bias=[
      (5, 2), (4, 1)])
  assert hash(params) == hash(SamplingParams(allowed_token_ids=(2, 4, 9),
                                             logit_bias={4: 1, 5: 2}))
  assert len(SamplingParams(allowed_token_ids=[*range(300), 0]).allowed_token_ids) == 300
  # Its slots' rows: the allowed ids, each with its bias (5, not allowed, stays -inf).
  assert bias_rows(params) == dict(bias_ids_Sb=[2, 4, 9], bias_Sb=[0.0, 1.0, 0.0],
                                   allowed_only_S=True)
  assert bias_rows(SamplingParams(logit_bias={5: 2})) == dict(bias_ids_Sb=[5], bias_Sb=[2.0])
  sched = Scheduler(max_seqs=2, slots_per_shard=2, max_model_len=32, token_buckets=(8,),
                    vocab_size=16, eos=(15,), limit_note="")
  assert len(sched.requests([[1]], SamplingParams(allowed_token_ids=[15, 0]))) == 1
  with pytest.raises(ValueError, match=r"params\[1\]\.allowed_token_ids holds \[16, 40\], "
                                       r"outside the vocabulary \[0, vocab_size=16\)"):
    sched.requests([[1], [2]], [params, SamplingParams(allowed_token_ids=[16, 3, 40])])
  # Only stop ids (EOS included) while min_tokens bars them: nothing could be drawn.
  only_stops = SamplingParams(allowed_token_ids=[15, 7], stop_token_ids=[7], min_tokens=2)
  with pytest.raises(ValueError, match=r"params\[0\]\.allowed_token_ids=\(7, 15\) are all "
                                       r"stop ids \(EOS included\), which min_tokens=2 bars"):
    sched.requests([[1]], only_stops)
  for fine in (dataclasses.replace(only_stops, min_tokens=0),
               dataclasses.replace(only_stops, ignore_eos=True),
               dataclasses.replace(only_stops, allowed_token_ids=(15, 7, 3))):
    assert len(sched.requests([[1]], fine)) == 1


def test_top_logprobs_past_the_vocabulary_are_refused():
  from paged_jax.engine.scheduler import Scheduler
  sched = Scheduler(max_seqs=2, slots_per_shard=2, max_model_len=32, token_buckets=(8,),
                    vocab_size=16, eos=(), limit_note="")
  ok = SamplingParams(logprobs=True, top_logprobs=16)
  assert len(sched.requests([[1]], ok)) == 1
  with pytest.raises(ValueError, match=r"params\[1\]\.top_logprobs=17 must be <= vocab_size=16"):
    sched.requests([[1], [2]], [ok, SamplingParams(logprobs=True, top_logprobs=17)])
