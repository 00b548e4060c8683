"""The engine's sampler: greedy, temperature, top-k, top-p, min-p, penalties, logprobs,
per-request keys."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.sampling import (Adjustments, adjust, min_p_filter, request_keys, sample,
                                top_logprobs, truncate)

ROWS = 4000


def _draw(logits_V, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rows=ROWS, seed=0):
  logits_SV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (rows, len(logits_V)))
  keys = request_keys(jnp.full(rows, seed, jnp.uint32), jnp.zeros(rows, jnp.int32),
                      jnp.arange(rows, dtype=jnp.int32))
  full = lambda v, dt: jnp.full(rows, v, dt)
  tokens, lps = jax.jit(sample)(logits_SV, full(temperature, jnp.float32),
                                full(top_k, jnp.int32), full(top_p, jnp.float32), keys,
                                min_p_S=full(min_p, jnp.float32))
  return np.asarray(tokens), np.asarray(lps)


# probabilities 0.5, 0.3, 0.15, 0.05 (log of them as logits)
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS)


def _freq(tokens, vocab):
  return np.bincount(tokens, minlength=vocab) / len(tokens)


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
  tokens, lps = _draw(LOGITS, temperature=0.0, top_k=2, top_p=0.1)
  assert np.all(tokens == 0)
  np.testing.assert_allclose(lps, np.log(0.5), rtol=1e-6)


def test_top_logprobs_are_the_likeliest_in_order_ties_by_smaller_id_padded_past_the_vocab():
  logits_SV = jnp.asarray([[0.0, 2.0, -1.0, 2.0, 1.0], [3.0, -jnp.inf, 0.5, 0.5, 0.5]],
                          jnp.bfloat16)
  ids_Sv, logprobs_Sv = top_logprobs(logits_SV, width=7)
  assert ids_Sv.dtype == jnp.int32 and logprobs_Sv.dtype == jnp.float32
  np.testing.assert_array_equal(ids_Sv, [[1, 3, 4, 0, 2, -1, -1], [0, 2, 3, 4, 1, -1, -1]])
  want_SV = np.asarray(jax.nn.log_softmax(logits_SV.astype(jnp.float32), axis=-1))
  want_Sv = np.take_along_axis(want_SV, np.asarray(ids_Sv) % 5, axis=-1)
  want_Sv[:, 5:] = -np.inf
  np.testing.assert_allclose(logprobs_Sv, want_Sv, rtol=1e-6)
  ids_Sv, _ = top_logprobs(logits_SV, width=2)
  np.testing.assert_array_equal(ids_Sv, [[1, 3], [0, 2]])


def test_temperature_one_matches_the_distribution():
  tokens, lps = _draw(LOGITS)
  np.testing.assert_allclose(_freq(tokens, 4), PROBS, atol=0.03)
  np.testing.assert_allclose(lps, np.log(PROBS)[tokens], rtol=1e-5)  # raw, not tempered


def test_temperature_flattens():
  # T = 2: p ~ sqrt(PROBS), renormalised.
  want = np.sqrt(PROBS) / np.sqrt(PROBS).sum()
  tokens, _ = _draw(LOGITS, temperature=2.0)
  np.testing.assert_allclose(_freq(tokens, 4), want, atol=0.03)


def test_a_tiny_temperature_is_the_greedy_limit():
  # 100 / 1e-37 overflows float32: divided first, logits 50 and 100 both became +inf and
  # the draw took the first (token 1). Shifted by the row's maximum first, only token 2
  # stays finite. With top-k too, and a row holding -inf (a masked token) is unharmed.
  for logits in ([1.0, 50.0, 100.0], [-np.inf, 50.0, 100.0]):
    for top_k in (0, 2):
      tokens, lps = _draw(logits, temperature=1e-37, top_k=top_k, rows=64)
      assert np.all(tokens == 2), (logits, top_k, np.bincount(tokens))
      assert np.all(np.isfinite(lps))


def test_top_k_keeps_the_k_largest():
  # k = 2: {0, 1} renormalised -> 0.625, 0.375.
  tokens, _ = _draw(LOGITS, top_k=2)
  np.testing.assert_allclose(_freq(tokens, 4), [0.625, 0.375, 0, 0], atol=0.03)
  tokens, _ = _draw(LOGITS, top_k=1)
  assert np.all(tokens == 0)


def test_top_p_keeps_the_smallest_nucleus():
  # top_p 0.7: cumulative before each token 0, 0.5, 0.8, ... -> keep {0, 1}.
  tokens, _ = _draw(LOGITS, top_p=0.7)
  np.testing.assert_allclose(_freq(tokens, 4), [0.625, 0.375, 0, 0], atol=0.03)
  # top_p 0.9: before = 0, 0.5, 0.8, 0.95 -> keep {0, 1, 2}: 0.5/0.95, 0.3/0.95, 0.15/0.95.
  tokens, _ = _draw(LOGITS, top_p=0.9)
  np.testing.assert_allclose(_freq(tokens, 4), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                             atol=0.03)


def test_top_k_then_top_p():
  # k = 3 renormalises to 0.526, 0.316, 0.158; top_p 0.6 keeps {0, 1} (before: 0, 0.526).
  tokens, _ = _draw(LOGITS, top_k=3, top_p=0.6)
  assert set(np.unique(tokens)) == {0, 1}


def test_keys_depend_only_on_seed_fork_and_index():
  a = request_keys(jnp.array([7, 7, 8], jnp.uint32), jnp.array([0, 1, 0]), jnp.array([3, 3, 3]))
  b = request_keys(jnp.array([8, 7], jnp.uint32), jnp.array([0, 0]), jnp.array([3, 3]))
  data = lambda k: np.asarray(jax.random.key_data(k))
  assert np.array_equal(data(a)[0], data(b)[1]) and np.array_equal(data(a)[2], data(b)[0])
  assert not np.array_equal(data(a)[0], data(a)[1])


def test_shape_validation():
  keys = request_keys(jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="top_k"):
    sample(jnp.zeros((2, 4)), jnp.zeros(2), jnp.zeros(3, jnp.int32), jnp.ones(2), keys)
  with pytest.raises(ValueError, match="logits"):
    sample(jnp.zeros(4), jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), keys)
  with pytest.raises(ValueError, match="logits.dtype=int32 must be a floating dtype"):
    sample(jnp.zeros((2, 4), jnp.int32), jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2),
           keys)


def test_truncation_touches_only_the_rows_that_ask_for_it():
  # Token 0 holds all but ~1e-8 of the mass: the cumulative mass before token 1 rounds to
  # 1.0 in float32, so "before < top_p" with top_p = 1 dropped every other token. Row 0
  # (top-k 3, top-p 1) keeps its top 3; row 1 (neither) keeps every token although row 0
  # makes the batch truncate; row 2 (top-p 0.5) keeps token 0 alone.
  tail = jnp.asarray([0.0, -18.5, -19.0, -19.5, -20.0])
  scaled_SV = jnp.stack([tail, tail, tail])
  got = truncate(scaled_SV, jnp.asarray([3, 0, 0]), jnp.asarray([1.0, 1.0, 0.5]),
                 jnp.asarray([True, False, True]))
  inf = -jnp.inf
  np.testing.assert_array_equal(np.asarray(got), [
      [0.0, -18.5, -19.0, inf, inf], [0.0, -18.5, -19.0, -19.5, -20.0],
      [0.0, inf, inf, inf, inf]])


def test_logprobs_are_the_raw_distributions_at_any_temperature_and_truncation():
  # Temperature, top-k and top-p change which token is drawn, never the log-probability
  # reported for it: log_softmax of the raw logits (as greedy's). Checked only at
  # temperatures 0 and 1 before, where tempered and raw coincide.
  for kwargs in (dict(temperature=2.0), dict(temperature=0.5, top_k=2),
                 dict(temperature=1.5, top_p=0.7)):
    tokens, lps = _draw(LOGITS, **kwargs)
    assert len(set(tokens.tolist())) > 1, kwargs  # sampled, not one token
    np.testing.assert_allclose(lps, np.log(PROBS)[tokens], rtol=1e-5, err_msg=str(kwargs))


def test_top_p_keeps_no_token_whose_preceding_mass_reaches_it():
  # Probabilities 0.5, 0.25, 0.25: the mass before token 1 is exactly 0.5 in float32, so
  # top_p = 0.5 keeps token 0 alone (the smallest set whose mass reaches top_p); "<=" kept
  # all three.
  tokens, _ = _draw(np.log([0.5, 0.25, 0.25]), top_p=0.5)
  assert np.all(tokens == 0)


def test_each_row_of_a_mixed_batch_draws_by_its_own_parameters():
  # One [S, V] call: greedy rows, rows sampling the whole distribution and rows truncated
  # to their top token, interleaved. A batch-wide switch (truncate or draw only when
  # every row asks) sampled the truncated rows freely or made the sampled rows greedy.
  rows = 3000
  kind = np.arange(rows) % 3  # 0: greedy, 1: temperature 1, 2: temperature 1 and top-k 1
  logits_SV = jnp.broadcast_to(jnp.asarray(LOGITS[::-1].copy(), jnp.float32), (rows, 4))
  keys = request_keys(jnp.full(rows, 5, jnp.uint32), jnp.zeros(rows, jnp.int32),
                      jnp.arange(rows, dtype=jnp.int32))
  tokens, _ = jax.jit(sample)(logits_SV, jnp.asarray(np.where(kind == 0, 0.0, 1.0),
                                                     jnp.float32),
                              jnp.asarray(np.where(kind == 2, 1, 0), jnp.int32),
                              jnp.ones(rows, jnp.float32), keys)
  tokens = np.asarray(tokens)
  assert np.all(tokens[kind != 1] == 3)  # the argmax of the reversed distribution
  np.testing.assert_allclose(_freq(tokens[kind == 1], 4), PROBS[::-1], atol=0.04)


# --- SamplingParams.from_generation_config ---

def _params_from(tmp_path, settings, **overrides):
  import json
  from paged_jax import SamplingParams
  (tmp_path / "generation_config.json").write_text(json.dumps(settings))
  return SamplingParams.from_generation_config(tmp_path, **overrides)


@pytest.mark.parametrize("settings, expect", [
    # Qwen3's, Llama 3.1's and Gemma 3's files; SmolLM2's names EOS ids only.
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
     dict(temperature=0.6, top_k=20, top_p=0.95)),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, dict(temperature=0.6, top_k=50,
                                                               top_p=0.9)),
    ({"cache_implementation": "hybrid", "do_sample": True, "top_k": 64, "top_p": 0.95},
     dict(temperature=1.0, top_k=64, top_p=0.95)),
    ({"bos_token_id": 1, "eos_token_id": 2}, dict(temperature=0.0, top_k=0, top_p=1.0)),
    # Sampling settings without do_sample are greedy, as in transformers' generate.
    ({"temperature": 0.7, "top_k": 5}, dict(temperature=0.0, top_k=0, top_p=1.0)),
    ({"do_sample": True, "top_k": None, "top_p": None, "temperature": None},
     dict(temperature=1.0, top_k=50, top_p=1.0)),
    ({"do_sample": True, "top_k": 0}, dict(temperature=1.0, top_k=0, top_p=1.0)),
    ({"do_sample": False, "max_new_tokens": 7, "num_return_sequences": 3, "max_length": 99},
     dict(temperature=0.0, max_tokens=7, n=3)),
    # Qwen2.5-Instruct's: the repetition penalty applies; min-p and min_new_tokens too.
    ({"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
      "top_k": 20}, dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)),
    ({"do_sample": True, "min_p": 0.1, "min_new_tokens": 3, "max_new_tokens": 9},
     dict(temperature=1.0, top_k=50, min_p=0.1, min_tokens=3, max_tokens=9)),
    # Greedy: min-p means nothing (not applied, not warned of); the repetition penalty does.
    ({"min_p": 0.1, "repetition_penalty": 1.2}, dict(repetition_penalty=1.2)),
])
def test_sampling_params_from_a_generation_config_as_transformers_resolves_it(
    tmp_path, settings, expect):
  from paged_jax import SamplingParams
  got = _params_from(tmp_path, settings)
  want = dataclasses.replace(SamplingParams(), **expect)
  assert got == want
  # The file's path, the mapping, and overrides (which win).
  assert SamplingParams.from_generation_config(tmp_path / "generation_config.json") == want
  assert SamplingParams.from_generation_config(settings) == want
  with warnings.catch_warnings(record=True) as caught:  # min_tokens never past max_tokens
    warnings.simplefilter("always")
    assert _params_from(tmp_path, settings, temperature=0.0, seed=3, max_tokens=2) == \
        dataclasses.replace(want, temperature=0.0, seed=3, max_tokens=2,
                            min_tokens=min(want.min_tokens, 2))
  assert len(caught) == (want.min_tokens > 2)


def test_transformers_defaults_are_the_ones_from_generation_config_assumes():
  transformers = pytest.importorskip("transformers")
  defaults = transformers.GenerationConfig._get_default_generation_params()  # 5.x
  assert (defaults["do_sample"], defaults["temperature"], defaults["top_k"],
          defaults["top_p"]) == (False, 1.0, 50, 1.0)


def test_from_generation_config_refuses_what_it_cannot_read_and_names_what_it_ignores(
    tmp_path):
  from paged_jax import SamplingParams
  # A checkpoint directory without the file: transformers' defaults (greedy).
  assert SamplingParams.from_generation_config(tmp_path) == SamplingParams()
  with pytest.raises(ValueError, match="no such directory or file"):
    SamplingParams.from_generation_config(tmp_path / "missing")
  with pytest.raises(ValueError, match="source=3 must be"):
    SamplingParams.from_generation_config(3)
  with pytest.raises(ValueError, match="generation_config.json: top_p=0 must be"):
    _params_from(tmp_path, {"do_sample": True, "top_p": 0})
  assert _params_from(tmp_path, {"do_sample": True, "top_p": 0}, top_p=0.5).top_p == 0.5
  with pytest.raises(ValueError, match="do_sample='yes' must be true or false"):
    _params_from(tmp_path, {"do_sample": "yes"})
  with pytest.raises(ValueError, match=r"overrides \['temprature'\] are not"):
    _params_from(tmp_path, {}, temprature=0.5)
  with pytest.raises(ValueError, match="top_k=-1 must be"):  # a bad override: its own name
    _params_from(tmp_path, {}, top_k=-1)
  (tmp_path / "generation_config.json").write_text("[1]")
  with pytest.raises(ValueError, match="must hold a JSON object"):
    SamplingParams.from_generation_config(tmp_path)
  (tmp_path / "generation_config.json").write_text("{")
  with pytest.raises(ValueError, match="not valid JSON"):
    SamplingParams.from_generation_config(tmp_path)
  with pytest.warns(UserWarning, match=r"asks for num_beams=4, no_repeat_ngram_size=3, "
                   "which"):
    got = _params_from(tmp_path, {"do_sample": True, "repetition_penalty": 1.1,
                                  "num_beams": 4, "no_repeat_ngram_size": 3,
                                  "bad_words_ids": None, "suppress_tokens": []})
  assert got.temperature == 1.0 and got.repetition_penalty == 1.1
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # neutral values warn of nothing, nor sampling's greedy
    _params_from(tmp_path, {"repetition_penalty": 1.0, "num_beams": 1, "typical_p": 1.0,
                            "penalty_alpha": 0.0, "min_p": 0.05, "epsilon_cutoff": 3e-4})
  with pytest.warns(UserWarning, match=r"asks for typical_p=0\.9, which"):
    got = _params_from(tmp_path, {"do_sample": True, "stop_strings": ["###"],
                                  "typical_p": 0.9, "min_length": 0})
  assert got.stop == ("###",)  # stop strings are applied now (the text reaching one)
  # min_new_tokens past max_tokens: the request ends at max_tokens (transformers' generate
  # too), said in a warning; a min_tokens given past it is refused.
  with pytest.warns(UserWarning, match=r"min_new_tokens=20 is above max_tokens=16, where "
                    r"the request ends \(min_tokens=16\)"):
    assert _params_from(tmp_path, {"min_new_tokens": 20}).min_tokens == 16
  with pytest.warns(UserWarning, match="min_new_tokens=20 is above max_tokens=8"):
    assert _params_from(tmp_path, {"min_new_tokens": 20, "max_new_tokens": 8}).min_tokens == 8
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _params_from(tmp_path, {"min_new_tokens": 20}, max_tokens=32).min_tokens == 20
    # A max_tokens refused anyway: its error alone, no warning of a cut never made.
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
      _params_from(tmp_path, {"max_new_tokens": 0, "min_new_tokens": 5})
    with pytest.raises(ValueError, match="^max_tokens=0 must be an int >= 1"):
      _params_from(tmp_path, {"min_new_tokens": 50}, max_tokens=0)
    # A bad override is its own; the file's min_new_tokens, clipped as served, is not blamed.
    with pytest.raises(ValueError, match="^top_k=-1 must be"):
      _params_from(tmp_path, {"min_new_tokens": 20}, max_tokens=32, top_k=-1)
  # The file's values are named by the file's keys.
  with pytest.raises(ValueError, match=r"generation_config.json: min_new_tokens=-1 must be "
                     r"an int in \[0, max_tokens=16\]"):
    _params_from(tmp_path, {"min_new_tokens": -1})
  with pytest.raises(ValueError, match=r"generation_config.json: num_return_sequences=0 must"):
    _params_from(tmp_path, {"num_return_sequences": 0})
  with pytest.raises(ValueError, match=r"generation_config.json: repetition_penalty=0 must"):
    _params_from(tmp_path, {"repetition_penalty": 0})
  with pytest.raises(ValueError, match=r"min_tokens=20 must be an int in \[0, max_tokens=16\]"):
    _params_from(tmp_path, {}, min_tokens=20)
  assert _params_from(tmp_path, {"stop_strings": "</s>"}).stop == ("</s>",)


# --- min-p ---

def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
  # PROBS 0.5, 0.3, 0.15, 0.05. min_p 0.5: p >= 0.25 keeps tokens 0 and 1; 0.31: p >= 0.155
  # still drops 0.15; 0.3: p >= 0.15 keeps token 2 too; 0.05 (0.025) keeps all four; with
  # top-k 1 only token 0 is left; a row that does not truncate keeps everything.
  rows = 6
  scaled_SV = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (rows, 4))
  filters_S = jnp.asarray([True] * 5 + [False])
  got = min_p_filter(truncate(scaled_SV, jnp.asarray([0, 0, 0, 0, 1, 0]), jnp.ones(rows),
                              filters_S),
                     jnp.asarray([0.5, 0.31, 0.3 - 1e-6, 0.05, 0.05, 0.9], jnp.float32),
                     filters_S)
  kept = np.isfinite(np.asarray(got))
  np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                       [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(np.asarray(got)[kept], np.asarray(scaled_SV)[kept])
  # Drawn: the kept tokens in proportion to their probabilities (0.5 : 0.3 : 0.15).
  tokens, lps = _draw(LOGITS, min_p=0.3 - 1e-6)
  np.testing.assert_allclose(_freq(tokens, 4), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                             atol=0.03)
  np.testing.assert_allclose(lps, LOGITS[tokens], rtol=1e-5)  # the raw log-probs
  # The temperature comes first: at 0.5 the ratios square (0.6^2 = 0.36 >= 0.3 keeps token
  # 1, 0.3^2 = 0.09 drops token 2).
  tokens, _ = _draw(LOGITS, temperature=0.5, min_p=0.3 - 1e-6)
  assert set(tokens.tolist()) == {0, 1}
  tokens, _ = _draw(LOGITS, temperature=0.0, min_p=1.0)  # greedy ignores min-p
  assert set(tokens.tolist()) == {0}


# --- adjust: penalties and min_tokens ---

def _adjust_oracle(logits_SV, tokens_SJ, len_S, prompt_len_S, repetition_S, presence_S,
                   frequency_S, barred_Si, bar_S, bias_ids_Sb=None, bias_Sb=None,
                   allowed_only_S=None):
  """The ids a row does not allow at -inf and the logit bias, then transformers' repetition
  penalty over prompt + generated, then OpenAI's presence and frequency penalties over the
  generated tokens, then the barred ids, in float64."""
  out = np.array(logits_SV, np.float64)
  for s in range(len(out)):
    if allowed_only_S is not None and allowed_only_S[s]:
      out[s, np.setdiff1d(np.arange(out.shape[1]), bias_ids_Sb[s])] = -np.inf
    for t, b in zip(*(() if bias_ids_Sb is None else (bias_ids_Sb[s], bias_Sb[s]))):
      if t >= 0:
        out[s, t] += b
    history, generated = tokens_SJ[s, :len_S[s]], tokens_SJ[s, prompt_len_S[s]:len_S[s]]
    for t in set(history.tolist()):
      out[s, t] = out[s, t] / repetition_S[s] if out[s, t] > 0 else out[s, t] * repetition_S[s]
    for t in set(generated.tolist()):
      out[s, t] -= presence_S[s] + frequency_S[s] * np.count_nonzero(generated == t)
    if bar_S[s]:
      out[s, [t for t in barred_Si[s] if t >= 0]] = -np.inf
  return out


def test_adjust_applies_each_rows_penalties_to_its_own_history_only():
  rng = np.random.default_rng(7)
  rows, J, V = 7, 24, 16
  logits_SV = (rng.normal(size=(rows, V)) * 3).astype(np.float32)
  logits_SV[:, 0] = 0.0  # a zero logit: divided or multiplied, still 0
  tokens_SJ = rng.integers(0, V, (rows, J)).astype(np.int32)  # past len: must not count
  len_S = np.array([0, 5, 24, 10, 12, 7, 9], np.int32)
  prompt_len_S = np.array([0, 5, 10, 3, 12, 2, 4], np.int32)
  repetition_S = np.array([1.0, 1.5, 0.7, 2.0, 1.0, 1.3, 1.0], np.float32)
  presence_S = np.array([0, 0.5, -1, 2, 0, 0, 0], np.float32)
  frequency_S = np.array([0, 0.25, 1.5, -0.5, 0, 2, 0], np.float32)
  barred_Si = np.full((rows, 3), -1, np.int32)
  barred_Si[1], barred_Si[4], barred_Si[6] = [2, 5, -1], [0, 1, 2], [3, 3, 9]
  bar_S = np.array([False, True, False, True, False, True, True])
  fields = (tokens_SJ, len_S, prompt_len_S, repetition_S, presence_S, frequency_S, barred_Si,
            bar_S)
  adjustments = Adjustments(*map(jnp.asarray, fields))
  got = np.asarray(jax.jit(adjust)(logits_SV, adjustments))
  np.testing.assert_allclose(got, _adjust_oracle(logits_SV, *fields), rtol=1e-6, atol=1e-6)
  # Rows at the neutral values (0: empty history; 4: only a prompt, its bar off) untouched;
  # row 6 (no penalty, barred ids 3 and 9) changes only there.
  np.testing.assert_array_equal(got[[0, 4]], logits_SV[[0, 4]])
  changed = np.flatnonzero(got[6] != logits_SV[6])
  np.testing.assert_array_equal(changed, [3, 9])
  assert np.all(np.isneginf(got[6, changed]))
  # penalize=False: the bars alone (no counts built).
  bars_only = _adjust_oracle(logits_SV, tokens_SJ, len_S, prompt_len_S, np.ones(rows),
                             np.zeros(rows), np.zeros(rows), barred_Si, bar_S)
  np.testing.assert_array_equal(np.asarray(adjust(logits_SV, adjustments, penalize=False)),
                                bars_only.astype(np.float32))


def test_adjust_adds_each_rows_logit_bias_before_its_penalties():
  rng = np.random.default_rng(11)
  rows, J, V = 5, 12, 10
  logits_SV = (rng.normal(size=(rows, V)) * 3).astype(np.float32)
  tokens_SJ = rng.integers(0, V, (rows, J)).astype(np.int32)
  len_S, prompt_len_S = np.array([6, 12, 3, 0, 9], np.int32), np.array([2, 4, 3, 0, 9], np.int32)
  repetition_S = np.array([1.0, 1.7, 0.5, 1.0, 2.0], np.float32)
  presence_S = np.array([0, 0.5, 0, 0, 0], np.float32)
  frequency_S = np.array([0, 1.0, 0, 0, 0], np.float32)
  barred_Si = np.array([[-1], [4], [1], [2], [-1]], np.int32)
  bar_S = np.array([False, True, True, False, False])
  # Row 0 only biased; row 1 all of it (a biased id barred too); row 2 a bias on a barred
  # id; row 3 nothing (its padding -1 and a bias of 0); row 4 a bias on prompt ids.
  bias_ids_Sb = np.array([[0, 7, -1], [4, 1, 2], [1, -1, -1], [-1, 5, -1], [*tokens_SJ[4, :2], 9]],
                         np.int32)
  bias_Sb = np.array([[100, -3.5, 9], [2, -100, 0.25], [50, 0, 0], [0, 0, 7], [4, -2, 1]],
                     np.float32)
  fields = (tokens_SJ, len_S, prompt_len_S, repetition_S, presence_S, frequency_S, barred_Si,
            bar_S, None, bias_ids_Sb, bias_Sb)
  adjustments = Adjustments(*(None if f is None else jnp.asarray(f) for f in fields))
  got = np.asarray(jax.jit(adjust)(logits_SV, adjustments))
  expect = _adjust_oracle(logits_SV, *fields[:8], bias_ids_Sb, bias_Sb)
  np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-5)
  np.testing.assert_array_equal(got[3], logits_SV[3])  # a bias of 0 is none
  assert got[0, 0] == np.float32(logits_SV[0, 0]) + 100 and np.isneginf(got[2, 1])
  # Bias after the repetition penalty would differ in row 4 (ids in its prompt):
  late = _adjust_oracle(logits_SV, *fields[:8])
  late[4, bias_ids_Sb[4]] += bias_Sb[4]
  assert not np.allclose(late[4], expect[4], atol=1e-3)
  # penalize=False: the bias and the bars only.
  bias_and_bars = _adjust_oracle(logits_SV, tokens_SJ, len_S, prompt_len_S, np.ones(rows),
                                 np.zeros(rows), np.zeros(rows), barred_Si, bar_S,
                                 bias_ids_Sb, bias_Sb)
  np.testing.assert_allclose(np.asarray(adjust(logits_SV, adjustments, penalize=False)),
                             bias_and_bars, rtol=1e-6, atol=1e-5)
  # Drawn: +100 forces a token greedy or sampled in rows that draw, -100 all but bans the
  # likeliest; a row that does not ask draws as without the bias.
  n = 400
  raw_SV = jnp.broadcast_to(jnp.log(jnp.asarray([0.7, 0.2, 0.05, 0.05])), (n, 4))
  bias_ids_Sb = jnp.asarray(np.tile([[3], [0], [-1], [-1]], (n // 4, 1)), jnp.int32)
  bias_Sb = jnp.asarray(np.tile([[100.0], [-100.0], [0.0], [0.0]], (n // 4, 1)), jnp.float32)
  keys = request_keys(jnp.full(n, 2, jnp.uint32), jnp.zeros(n, jnp.int32),
                      jnp.arange(n, dtype=jnp.int32))
  for temperature in (0.0, 1.0):
    biased = dataclasses.replace(_adjustments(n, history=[1]), bias_ids_Sb=bias_ids_Sb,
                                 bias_Sb=bias_Sb)
    tokens, lps = sample(raw_SV, jnp.full(n, temperature), jnp.zeros(n, jnp.int32),
                         jnp.ones(n), keys, adjustments=biased)
    tokens = np.asarray(tokens).reshape(-1, 4)
    assert set(tokens[:, 0]) == {3} and 0 not in tokens[:, 1]
    plain, _ = sample(raw_SV, jnp.full(n, temperature), jnp.zeros(n, jnp.int32), jnp.ones(n),
                      keys)
    np.testing.assert_array_equal(tokens[:, 2:], np.asarray(plain).reshape(-1, 4)[:, 2:])
    assert (len(set(tokens[:, 1])) > 1) == (temperature > 0)
    np.testing.assert_allclose(np.asarray(lps), np.log([0.7, 0.2, 0.05, 0.05])[
        tokens.reshape(-1)], rtol=1e-5)  # the raw log-probs


def test_adjust_leaves_a_row_only_its_allowed_ids():
  # Rows 0 and 2 allow only their listed ids (row 0 with a bias on one, row 2 with a
  # repetition penalty and a barred id among them); row 1 lists ids as a plain logit bias;
  # row 3 asks nothing. Greedy and sampled draws of the allowing rows stay in their ids.
  rng = np.random.default_rng(5)
  rows, J, V = 4, 6, 12
  logits_SV = (rng.normal(size=(rows, V)) * 3).astype(np.float32)
  tokens_SJ = rng.integers(0, V, (rows, J)).astype(np.int32)
  len_S, prompt_len_S = np.full(rows, 6, np.int32), np.full(rows, 2, np.int32)
  repetition_S = np.array([1.0, 1.0, 1.6, 1.0], np.float32)
  zeros = np.zeros(rows, np.float32)
  barred_Si = np.array([[-1], [-1], [int(tokens_SJ[2, 0])], [-1]], np.int32)
  bar_S = np.array([False, False, True, False])
  bias_ids_Sb = np.array([[3, 8, -1], [3, 8, -1], [*tokens_SJ[2, :2], 11], [-1, -1, -1]],
                         np.int32)
  bias_Sb = np.array([[0, 2.5, 0], [0, 2.5, 0], [0, 0, 0], [0, 0, 0]], np.float32)
  allowed_only_S = np.array([True, False, True, False])
  fields = (tokens_SJ, len_S, prompt_len_S, repetition_S, zeros, zeros, barred_Si, bar_S,
            None, bias_ids_Sb, bias_Sb, allowed_only_S)
  adjustments = Adjustments(*(None if f is None else jnp.asarray(f) for f in fields))
  got = np.asarray(jax.jit(adjust)(logits_SV, adjustments))
  expect = _adjust_oracle(logits_SV, *fields[:8], bias_ids_Sb, bias_Sb, allowed_only_S)
  np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-5)
  assert set(np.flatnonzero(np.isfinite(got[0]))) == {3, 8}
  assert np.isfinite(got[1]).all() and got[1, 8] == np.float32(logits_SV[1, 8]) + 2.5
  np.testing.assert_array_equal(got[3], logits_SV[3])
  np.testing.assert_allclose(np.asarray(adjust(logits_SV, adjustments, penalize=False)),
                             _adjust_oracle(logits_SV, tokens_SJ, len_S, prompt_len_S,
                                            np.ones(rows), zeros, zeros, barred_Si, bar_S,
                                            bias_ids_Sb, bias_Sb, allowed_only_S),
                             rtol=1e-6, atol=1e-5)
  with pytest.raises(ValueError, match="allowed_only_S needs bias_ids_Sb"):
    adjust(logits_SV, dataclasses.replace(adjustments, bias_ids_Sb=None, bias_Sb=None))
  n = 200
  raw_SV = jnp.broadcast_to(jnp.log(jnp.asarray([0.6, 0.3, 0.06, 0.04])), (n, 4))
  keys = request_keys(jnp.full(n, 3, jnp.uint32), jnp.zeros(n, jnp.int32),
                      jnp.arange(n, dtype=jnp.int32))
  allowed = dataclasses.replace(
      _adjustments(n, history=[1]), bias_ids_Sb=jnp.tile(jnp.asarray([[2, 3]]), (n, 1)),
      bias_Sb=jnp.zeros((n, 2)), allowed_only_S=jnp.arange(n) % 2 == 0)
  for temperature in (0.0, 1.0):
    tokens, lps = sample(raw_SV, jnp.full(n, temperature), jnp.zeros(n, jnp.int32),
                         jnp.ones(n), keys, adjustments=allowed)
    tokens = np.asarray(tokens).reshape(-1, 2)
    assert set(tokens[:, 0]) == ({2} if temperature == 0 else {2, 3})
    assert set(tokens[:, 1]) == ({0} if temperature == 0 else {0, 1, 2, 3})
    np.testing.assert_allclose(np.asarray(lps), np.log([0.6, 0.3, 0.06, 0.04])[
        tokens.reshape(-1)], rtol=1e-5)  # the raw log-probs


def _adjustments(rows, *, history, repetition=1.0, barred=(), bar=False, rows_S=None):
  """Every row with the same history (all of it generated) and settings."""
  tokens_SJ = jnp.broadcast_to(jnp.asarray(history, jnp.int32), (rows, len(history)))
  full = lambda v, dt=jnp.float32: jnp.full(rows, v, dt)
  barred_Si = jnp.broadcast_to(jnp.asarray(list(barred) or [-1], jnp.int32),
                               (rows, max(len(barred), 1)))
  return Adjustments(tokens_SJ, full(len(history), jnp.int32), full(0, jnp.int32),
                     full(repetition), full(0.0), full(0.0), barred_Si, full(bar, jnp.bool_),
                     rows_S)


def test_sampled_rows_draw_from_the_adjusted_logits_and_report_the_raw_log_probs():
  # The raw distribution puts 0.9 on token 0; the adjustments bar it (as min_tokens bars a
  # stop id) or penalise it far below the rest (it is in every row's history): greedy and
  # at temperature 1 (with top-k, top-p or min-p too, which truncate the adjusted
  # distribution) it is never drawn, while the log-probs reported stay the raw ones.
  raw_V = np.log(np.array([0.9, 0.05, 0.03, 0.02]))
  rows = 2000
  raw_SV = jnp.broadcast_to(jnp.asarray(raw_V, jnp.float32), (rows, 4))
  keys = request_keys(jnp.full(rows, 3, jnp.uint32), jnp.zeros(rows, jnp.int32),
                      jnp.arange(rows, dtype=jnp.int32))
  full = lambda v, dt=jnp.float32: jnp.full(rows, v, dt)
  for adjustments in (_adjustments(rows, history=[0, 2], barred=[0], bar=True),
                      _adjustments(rows, history=[0], repetition=1e4)):
    for temperature, top_k, top_p, min_p in ((0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0),
                                             (1.0, 2, 1.0, 0.0), (1.0, 0, 0.6, 0.0),
                                             (1.0, 0, 1.0, 0.5)):
      tokens, lps = jax.jit(sample)(raw_SV, full(temperature), full(top_k, jnp.int32),
                                    full(top_p), keys, min_p_S=full(min_p),
                                    adjustments=adjustments)
      tokens = np.asarray(tokens)
      assert 0 not in tokens, (temperature, top_k, top_p, min_p)
      assert (len(set(tokens.tolist())) > 1) == (temperature > 0)
      np.testing.assert_allclose(np.asarray(lps), raw_V[tokens], rtol=1e-5)
  # A penalty in rows that are not drawing (rows_S) builds nothing and changes nothing.
  tokens, _ = sample(raw_SV, full(0.0), full(0, jnp.int32), full(1.0), keys,
                     adjustments=_adjustments(rows, history=[0], repetition=1e4,
                                              rows_S=jnp.zeros(rows, bool)))
  assert set(np.asarray(tokens).tolist()) == {0}


def test_adjust_keeps_finite_logits_finite():
  # A repetition penalty of float32's smallest normal divides 100 past float32's range:
  # clipped to its largest finite value, not +inf (inf - inf made NaN draws); -inf stays.
  logits_SV = jnp.asarray([[100.0, -1.0, -jnp.inf, 0.5], [2.0, -1.0, -jnp.inf, 0.5]])
  tiny = np.finfo(np.float32).tiny
  adjustments = Adjustments(
      jnp.asarray([[0, 1, 2, 3], [0, 1, 2, 3]], jnp.int32), jnp.asarray([4, 4]),
      jnp.asarray([4, 4]), jnp.asarray([tiny, 2.0], jnp.float32), jnp.zeros(2),
      jnp.zeros(2), jnp.full((2, 1), -1, jnp.int32), jnp.zeros(2, bool))
  got = np.asarray(adjust(logits_SV, adjustments))
  np.testing.assert_array_equal(got[0], [np.finfo(np.float32).max, -tiny, -np.inf,
                                         np.float32(0.5) / np.float32(tiny)])
  np.testing.assert_array_equal(got[1], [1.0, -2.0, -np.inf, 0.25])
