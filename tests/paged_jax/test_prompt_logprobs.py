"""SamplingParams.prompt_logprobs: each prompt token's log-prob (and the likeliest tokens)
given the ones before it, against the dense model, through chunked prefill, the prefix
cache, preemption, forks and streams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.engine.scoring import prompt_scores
from paged_jax.models import ModelConfig, init_random
from paged_jax.step import EveryRow

VOCAB = 128


@pytest.fixture(scope="module")
def tiny():
  config = ModelConfig(model_type="llama", vocab_size=VOCAB, embed_dim=64, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=128, eos_token_ids=(2,))
  return init_random(config, seed=0, impl="xla"), config


@pytest.fixture(scope="module")
def llm(tiny):
  # One bucket of 16 rows: prompts longer than 16 are prefilled in chunks.
  return LLM(*tiny, block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16)


def dense_logprobs(model, prompt) -> np.ndarray:
  """[len, V]: log_softmax of the dense model's logits at each prompt position."""
  logits = model(jnp.asarray([prompt], jnp.int32))[0].astype(jnp.float32)
  return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def check_against_dense(model, out, k):
  prompt = out.prompt_token_ids
  dense = dense_logprobs(model, prompt)
  assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
  want = [dense[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
  np.testing.assert_allclose(out.prompt_logprobs[1:], want, rtol=0, atol=2e-5)
  if not k:
    assert out.prompt_top_logprobs is None
    return
  assert len(out.prompt_top_logprobs) == len(prompt) and out.prompt_top_logprobs[0] is None
  for i, top in enumerate(out.prompt_top_logprobs[1:]):
    ids = np.argsort(-dense[i], kind="stable")[:k]
    assert list(top) == ids.tolist()  # most likely first
    np.testing.assert_allclose(list(top.values()), dense[i, ids], rtol=0, atol=2e-5)
    if prompt[i + 1] in top:  # listed, its value is its prompt_logprobs entry exactly
      assert top[prompt[i + 1]] == out.prompt_logprobs[i + 1]


def test_prompt_logprobs_are_the_dense_models(tiny, llm):
  model, _ = tiny
  rng = np.random.default_rng(0)
  lengths = (1, 2, 5, 16, 17, 40, 9)  # 17 and 40: chunked prefill over T = 16
  prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in lengths]
  ks = (0, 3, 0, 20, 1, 5, None)
  params = [SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in ks]
  outs = llm.generate(prompts, params)
  for out, k in zip(outs, ks):
    if k is None:
      assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
    else:
      check_against_dense(model, out, k)
  assert "step T=16 scoring" in llm.compile_seconds
  # Scoring changes no generated token.
  plain = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
  assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_prompt_logprobs_are_whole_with_the_prompt_cached(tiny, llm):
  model, _ = tiny
  rng = np.random.default_rng(1)
  prompt = [int(t) for t in rng.integers(3, VOCAB, 23)]
  llm.generate([prompt], SamplingParams(max_tokens=2))  # its blocks now cached
  llm.reset_stats()
  out, = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))
  check_against_dense(model, out, 2)  # every position scored: no hit skipped one
  assert llm.stats["prefix_hit_rate"] == 0
  # Others still share the cached prompt.
  llm.reset_stats()
  llm.generate([prompt + [7, 8]], SamplingParams(max_tokens=2))
  assert llm.stats["prefix_hit_rate"] > 0
  # And the blocks a scored prompt fills: a plain request finds them.
  scored = [int(t) for t in rng.integers(3, VOCAB, 21)]
  llm.generate([scored], SamplingParams(max_tokens=2, prompt_logprobs=0))
  llm.reset_stats()
  llm.generate([scored + [9]], SamplingParams(max_tokens=2))
  assert llm.stats["prefix_hit_rate"] > 0


def test_prompt_logprobs_through_preemption(tiny):
  model, config = tiny
  # 14 blocks of 4 tokens for three sequences of up to 30 + 24 tokens: some are
  # preempted (maybe mid-prefill) and recomputed.
  small = LLM(model, config, block_size=4, num_blocks=14, max_seqs=3, max_tokens_per_step=16,
              max_model_len=56)
  rng = np.random.default_rng(2)
  prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (30, 21, 26)]
  params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=1)
  outs = small.generate(prompts, params)
  assert small.stats["preemptions"] > 0
  for out in outs:
    check_against_dense(model, out, 1)
  plain = small.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
  assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_prompt_logprobs_with_forks_and_streams(tiny, llm):
  model, _ = tiny
  prompt = [int(t) for t in np.random.default_rng(3).integers(3, VOCAB, 19)]
  params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=2, prompt_logprobs=4)
  events = list(llm.generate_stream([prompt], params))
  outs = llm.generate([prompt], params)
  assert outs[0].prompt_logprobs == outs[1].prompt_logprobs
  assert outs[0].prompt_top_logprobs == outs[1].prompt_top_logprobs
  check_against_dense(model, outs[0], 4)
  for f in range(2):  # each completion's first event carries them, no later one
    mine = [ev for ev in events if ev.sample_index == f]
    assert mine[0].prompt_logprobs == outs[f].prompt_logprobs
    assert mine[0].prompt_top_logprobs == outs[f].prompt_top_logprobs
    assert all(ev.prompt_logprobs is None for ev in mine[1:])
  plain = list(llm.generate_stream([prompt], SamplingParams(max_tokens=2)))
  assert all(ev.prompt_logprobs is None for ev in plain)


def test_precompile_compiles_the_scoring_steps_only_when_asked(llm):
  assert not any(what.endswith("scoring") for what in llm.precompile())
  assert "step T=16 scoring" in llm.precompile(prompt_logprobs=True)
  with pytest.raises(ValueError, match="prompt_logprobs=0 must be a bool"):
    llm.precompile(prompt_logprobs=0)


def test_an_abort_event_carries_what_was_scored(tiny, llm):
  model, _ = tiny
  prompt = [int(t) for t in np.random.default_rng(4).integers(3, VOCAB, 40)]
  session = llm.session()
  try:
    ids = session.add([prompt], SamplingParams(max_tokens=3, prompt_logprobs=0))
    assert session.step(max_steps=1) == []  # one step: 16 of the 40 prompt tokens
    session.abort(ids)
    end, = session.step()
  finally:
    session.close()
  assert end.finish_reason == "abort"
  dense = dense_logprobs(model, prompt)
  scored = end.prompt_logprobs[1:17]  # rows at positions 0-15 score tokens 1-16
  np.testing.assert_allclose(scored, [dense[i, prompt[i + 1]] for i in range(16)], atol=2e-5)
  assert end.prompt_logprobs[0] is None and end.prompt_logprobs[17:] == [None] * 23


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "1"])
def test_bad_prompt_logprobs_raise(value):
  with pytest.raises(ValueError, match=r"prompt_logprobs=.* must be None or an int in \[0, 20\]"):
    SamplingParams(prompt_logprobs=value)


def test_prompt_scores_by_hand():
  # Three sequences: s0 has prompt [5, 1, 2] and rows at positions 0, 1, 2; s1 (prompt of
  # 4) a row at position 3, its last prompt token: it scores nothing; row 4 is padding;
  # s2 does not ask (prompt_k -1): its row 5 scores nothing.
  tokens_SJ = jnp.array([[5, 1, 2, 0], [3, 3, 3, 3], [4, 4, 4, 4]], jnp.int32)
  # Row 0's logits over V = 3: [0, ln 2, ln 3] -> softmax [1/6, 2/6, 3/6]; it scores token 1
  # (position 1): log(2/6). Row 1 (all zeros): token 2 gets log(1/3). Row 2 scores
  # position 3, past the prompt of 3: nothing.
  logits_TV = jnp.array([[0.0, np.log(2), np.log(3)], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                         [0, 0, 0], [0, 0, 0]], jnp.float32)
  rows = EveryRow(logits_TV=logits_TV, seq_T=jnp.array([0, 0, 0, 1, 1, 2]),
                  positions_T=jnp.array([0, 1, 2, 3, 0, 0]),
                  live_T=jnp.array([True, True, True, True, False, True]))
  out = prompt_scores(rows, tokens_SJ, jnp.array([3, 4, 4]), jnp.array([2, 0, -1]), width=2)
  assert out["prompt_slot_T"].tolist() == [0, 0, -1, -1, -1, -1]
  assert out["prompt_pos_T"].tolist()[:2] == [1, 2]
  np.testing.assert_allclose(out["prompt_logprob_T"][:2], [np.log(2 / 6), np.log(1 / 3)],
                             rtol=1e-6)
  assert out["prompt_top_ids_Tv"][0].tolist() == [2, 1]
  np.testing.assert_allclose(out["prompt_top_logprobs_Tv"][0], np.log([3 / 6, 2 / 6]),
                             rtol=1e-6)
  # Only s1, which scores nothing here, asks for k > 0: nothing is ranked.
  out = prompt_scores(rows, tokens_SJ, jnp.array([3, 4, 4]), jnp.array([0, 3, 0]), width=2)
  assert out["prompt_slot_T"].tolist() == [0, 0, -1, -1, -1, 2]
  assert out["prompt_top_ids_Tv"].tolist() == [[-1, -1]] * 6
