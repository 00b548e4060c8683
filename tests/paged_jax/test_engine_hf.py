"""Engine greedy outputs equal Hugging Face ``generate`` on a tiny random checkpoint, and the
engine serves text prompts through the checkpoint's ``tokenizer.json``."""

from __future__ import annotations

import json
from collections import abc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from paged_jax import allocator  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from tests.models import helpers  # noqa: E402


def _save_checkpoint(path, seed: int = 0):
  """A tiny random HF Llama (weights at O(1) scale) + a word-level tokenizer.json."""
  hf_dict = helpers.hf_config_dict("llama")
  del hf_dict["model_type"]
  torch.manual_seed(seed)
  config = transformers.AutoConfig.for_model("llama", **hf_dict)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32)
  helpers.randomize_torch_model(model, seed)
  model.eval()
  model.save_pretrained(path)
  vocab = {f"w{i}": i for i in range(helpers.VOCAB)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(str(path / "tokenizer.json"))
  return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_llama")
  return path, _save_checkpoint(path)


def test_greedy_equals_hf_generate_and_text_prompts(checkpoint):
  path, hf_model = checkpoint
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8)
  assert llm.tokenizer is not None
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, helpers.VOCAB, n)] for n in (5, 21, 12)]
  max_tokens = 10
  outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  for p, o in zip(prompts, outs):
    with torch.no_grad():
      ids = hf_model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0,
                              min_new_tokens=max_tokens)[0, len(p):].tolist()
    assert list(o.token_ids) == ids
    assert o.text == " ".join(f"w{t}" for t in ids)
  # Text prompts go through tokenizer.json; the output is decoded.
  text = " ".join(f"w{t}" for t in prompts[1])
  out, = llm.generate([text], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  assert out.prompt_token_ids == list(prompts[1])
  assert out.token_ids == outs[1].token_ids and out.text == outs[1].text
  allocator.validate(llm.allocator_state)
  assert llm.stats["num_free_blocks"] == 48
  # The checkpoint named by its config.json: the tokenizer beside it comes too.
  by_config = LLM.from_pretrained(path / "config.json", dtype="float32", impl="xla",
                                  block_size=4, num_blocks=48, max_seqs=2)
  assert by_config.tokenizer is not None


def test_repetition_penalty_and_min_tokens_equal_hf_generate(checkpoint):
  # transformers' repetition_penalty (over prompt and generated ids, greedy too) and
  # min_new_tokens (its end id barred until then), served in one batch beside a plain
  # request; the end id is a token each greedy run reaches early, so min_tokens moves it.
  path, hf_model = checkpoint
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=4, max_tokens_per_step=16, steps_per_call=8,
                            max_model_len=192)
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in rng.integers(3, helpers.VOCAB, n)] for n in (6, 13, 4)]
  prompts[2] = prompts[2] * 3  # repeated prompt ids for the penalty to act on

  def hf(prompt, **kwargs):
    with torch.no_grad():
      return hf_model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0,
                               **kwargs)[0, len(prompt):].tolist()

  greedy = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
  for penalty in (1.7, 0.8):
    params = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
    outs = llm.generate(prompts + [prompts[0]], [params] * len(prompts) + [
        SamplingParams(max_tokens=12, ignore_eos=True)])
    assert outs[-1].token_ids == greedy[0].token_ids
    for p, o in zip(prompts, outs):
      want = hf(p, max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                repetition_penalty=penalty)
      assert o.token_ids == want, penalty
    assert [o.token_ids for o in outs[:3]] != [o.token_ids for o in greedy]
  for p, g in zip(prompts, greedy):
    end = g.token_ids[1]  # the second greedy token as the end id
    for min_tokens in (0, 2, 5):
      o, = llm.generate([p], SamplingParams(max_tokens=10, ignore_eos=True,
                                            stop_token_ids=(end,), min_tokens=min_tokens))
      want = hf(p, max_new_tokens=10, min_new_tokens=min_tokens, eos_token_id=end)
      stopped = end in want
      assert o.token_ids == (want[:want.index(end)] if stopped else want), min_tokens
      assert o.finish_reason == ("stop" if stopped else "length")
      assert len(o.token_ids) >= min_tokens
  # A stop string the first token completes ends the text at once, but not under
  # min_tokens=1 (as the stop id of that token could not end it there either).
  first = greedy[0].text.split(" ")[0]
  base = dict(max_tokens=6, ignore_eos=True, stop=first)
  at_once, held = llm.generate([prompts[0]] * 2, [SamplingParams(**base),
                                                  SamplingParams(**base, min_tokens=1)])
  assert (at_once.token_ids, at_once.text, at_once.stop_reason) == (
      greedy[0].token_ids[:1], "", first)
  assert len(held.token_ids) > 1 and held.text.startswith(first)
  allocator.validate(llm.allocator_state)


def test_a_transformers_tokenizer_serves_text_prompts(checkpoint):
  # Its encode gives a list (tokenizers' an Encoding with .ids): the same ids either way.
  path, _ = checkpoint
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8,
                            tokenizer=tok)
  ids = [7, 3, 11, 5]
  params = SamplingParams(max_tokens=4, ignore_eos=True)
  by_text, = llm.generate([" ".join(f"w{t}" for t in ids)], params)
  by_ids, = llm.generate([ids], params)
  assert by_text.prompt_token_ids == list(ids) and by_text.token_ids == by_ids.token_ids
  assert by_text.text == " ".join(f"w{t}" for t in by_ids.token_ids)
  # A set or a dict has no order of tokens: refused, not served in its iteration order;
  # bytes are not token ids (b"ab" was served as the ids 97, 98).
  for prompt in ({9, 3, 7}, {7: 100, 3: 200}, {7: 1}.keys(), b"ab", bytearray(b"ab"),
                 memoryview(b"ab")):
    with pytest.raises(ValueError, match=r"prompts\[0\] is a .*which has no order"):
      llm.generate([prompt], params)
  with pytest.raises(ValueError, match=r"cache_salt=b'ab' must be None, a str, or one str"):
    llm.generate([ids], params, cache_salt=b"ab")
  assert llm.stats["num_free_blocks"] == 48


def test_special_tokens_stay_in_the_text_when_asked(checkpoint):
  # The checkpoint's tokenizer with "w7" made special: requests drawing only ids 7 and 9
  # (sampled, one seed: the same ids whatever else is asked) show it in their text only
  # with skip_special_tokens=False, streamed alike; a stop string naming it ends only that
  # text.
  path, _ = checkpoint
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.add_special_tokens(["w7"])
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8,
                            max_model_len=192, tokenizer=tok)
  base = dict(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3,
              allowed_token_ids=[7, 9])
  params = [SamplingParams(**base), SamplingParams(**base, skip_special_tokens=False)]
  skipped, kept = llm.generate([[5, 6, 8]] * 2, params)
  ids = kept.token_ids
  assert skipped.token_ids == ids and set(ids) == {7, 9}
  assert kept.text == " ".join(f"w{t}" for t in ids)
  assert skipped.text == " ".join(f"w{t}" for t in ids if t != 7)
  events = list(llm.generate_stream([[5, 6, 8]] * 2, params))
  for i, out in enumerate((skipped, kept)):
    assert "".join(e.text for e in events if e.prompt_index == i) == out.text
  stop = [SamplingParams(**base, stop="w7"), SamplingParams(**base, stop="w7",
                                                            skip_special_tokens=False)]
  skipped, kept = llm.generate([[5, 6, 8]] * 2, stop)
  assert (skipped.token_ids, skipped.finish_reason) == (ids, "length")
  assert (kept.token_ids, kept.finish_reason) == (ids[:ids.index(7) + 1], "stop")
  with pytest.raises(ValueError, match="skip_special_tokens=1 must be a bool"):
    SamplingParams(skip_special_tokens=1)
  assert llm.stats["num_free_blocks"] == 48


def test_a_text_prompt_truncated_keeps_the_tokenizers_bos(checkpoint):
  # A tokenizer that puts "w1" (a BOS) before every text: truncate_prompt_tokens keeps it
  # and the text's last tokens, k in all (a tokenizer's own left truncation, vLLM's), and
  # generates as from those ids; token-id prompts are cut as given. k of the BOS alone
  # leaves none of the text: refused.
  path, _ = checkpoint
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="w1 $A", special_tokens=[("w1", 1)])
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8,
                            max_model_len=192, tokenizer=tok)
  text = " ".join(f"w{t}" for t in range(5, 25))
  assert tok.encode(text).ids == [1, *range(5, 25)]
  base = dict(max_tokens=4, ignore_eos=True)
  by_text, by_ids, whole = llm.generate([text, [1, *range(5, 25)], [1, 22, 23, 24]], [
      SamplingParams(**base, truncate_prompt_tokens=4),
      SamplingParams(**base, truncate_prompt_tokens=4), SamplingParams(**base)])
  assert by_text.prompt_token_ids == [1, 22, 23, 24] and by_ids.prompt_token_ids == [21, 22,
                                                                                     23, 24]
  assert by_text.token_ids == whole.token_ids
  with pytest.raises(ValueError, match=r"prompts\[0\]: truncate_prompt_tokens=1 keeps no "
                                       r"token of the text beside the 1 special tokens"):
    llm.check_requests([text], SamplingParams(truncate_prompt_tokens=1))
  assert llm.stats["num_free_blocks"] == 48


# A chat template in the manner of real ones: the BOS text, a system turn by default, a
# refusal of an unknown role, a variable given by the caller, the model's turn opened.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}w3 {{ system | default('w9') }} "
    "{% endif %}{% for m in messages %}{% if m['role'] not in ('system', 'user', "
    "'assistant') %}{{ raise_exception('no role ' + m['role']) }}{% endif %}"
    "{{ {'system': 'w3', 'user': 'w4', 'assistant': 'w5'}[m['role']] }} {{ m['content'] }} "
    "{% if not loop.last %}w6 {% endif %}{% endfor %}{% if add_generation_prompt %}w5 "
    "{% endif %}")


def _chat_checkpoint(path, dest):
  """The checkpoint at ``path`` copied to ``dest`` with a tokenizer that adds "w1" (BOS) to
  every text and a tokenizer_config.json holding CHAT_TEMPLATE, bos_token "w1"; returns
  the tokenizer."""
  import os
  import shutil
  for name in os.listdir(path):
    shutil.copy(path / name, dest / name)
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.add_special_tokens(["w1"])  # as a real tokenizer.json lists its BOS
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="w1 $A", special_tokens=[("w1", 1)])
  tok.save(str(dest / "tokenizer.json"))
  (dest / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=CHAT_TEMPLATE, bos_token={"content": "w1"}, eos_token="w2")))
  return tok


def test_chat_lays_conversations_out_as_transformers_and_serves_them(checkpoint, tmp_path):
  # from_pretrained reads the checkpoint's chat template; chat gives the ids transformers'
  # apply_chat_template gives (one BOS, not two) and serves them as generate does. (Words
  # w10-w29 would split at the special "w1" and "w2".)
  path, _ = checkpoint
  tok = _chat_checkpoint(path, tmp_path)
  llm = LLM.from_pretrained(tmp_path, dtype="float32", impl="xla", block_size=4,
                            num_blocks=48, max_seqs=2, max_tokens_per_step=16,
                            steps_per_call=8, max_model_len=192)
  assert llm.chat_template.source == CHAT_TEMPLATE and llm.chat_template.bos_token == "w1"
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1",
                                                eos_token="w2")
  theirs.chat_template = CHAT_TEMPLATE
  conversations = [[{"role": "user", "content": "w7 w8"}],
                   [{"role": "system", "content": "w30"}, {"role": "user", "content": "w31"},
                    {"role": "assistant", "content": "w32 w33"},
                    {"role": "user", "content": "w34"}]]
  params = SamplingParams(max_tokens=5, ignore_eos=True)
  outs = llm.chat(conversations, params)
  for conversation, out in zip(conversations, outs):
    ids = theirs.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, abc.Mapping) else ids)
    assert out.prompt_token_ids == ids and ids.count(1) == 1
    assert out.token_ids == llm.generate([ids], params)[0].token_ids
  assert outs[0].prompt_token_ids == [1, 3, 9, 4, 7, 8, 5]
  # One conversation alone; a caller's variable; no generation prompt; a template given.
  one, = llm.chat(conversations[0], params, chat_template_kwargs=dict(system="w35"),
                  add_generation_prompt=False)
  assert one.prompt_token_ids == [1, 3, 35, 4, 7, 8]
  given, = llm.chat(conversations[0], params,
                    chat_template="{{ bos_token }} {{ messages[0]['content'] }}")
  assert given.prompt_token_ids == [1, 7, 8]  # the checkpoint's BOS text
  # A reply begun for the model: its turn left open after "w36 w37", as transformers' is.
  begun = conversations[0] + [{"role": "assistant", "content": "w36 w37"}]
  cont, = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)
  want = theirs.apply_chat_template(begun, add_generation_prompt=False, tokenize=True,
                                    continue_final_message=True)
  want = list(want["input_ids"] if isinstance(want, abc.Mapping) else want)
  assert cont.prompt_token_ids == want and want[-2:] == [36, 37]
  for bad, message in (
      ([{"role": "tool", "content": "w3"}], "the chat template refused the conversation: no "
                                            "role tool"),
      ([{"content": "w3"}], r"messages\[0\]=\{'content': 'w3'\} must be a dict with a "
                            r"'role' \(str\) and its 'content'"),
      ([conversations[0], []], r"messages\[1\] must be a non-empty list"),
      ("w3 w4", "messages=str must be a conversation"),
      ([], "messages=list must be a conversation")):
    with pytest.raises(ValueError, match=message):
      llm.chat(bad, params)
  with pytest.raises(ValueError, match=r"chat_template_kwargs names \['messages'\]"):
    llm.chat(conversations[0], params, chat_template_kwargs=dict(messages=[]))
  with pytest.raises(ValueError, match="is not a template Jinja reads"):
    llm.chat(conversations[0], params, chat_template="{% for %}")
  llm.chat_template = None
  with pytest.raises(ValueError, match="the engine has no chat template .* pass chat_template="):
    llm.chat(conversations[0], params)
  assert llm.stats["num_free_blocks"] == 48


def _stopped(ids, text, stop, include):
  """A word-level completion ``ids`` / ``text`` cut at its first stop string: the first
  prefix of words holding one ends there (words are joined by spaces)."""
  words = text.split(" ")
  for k in range(1, len(ids) + 1):
    prefix = " ".join(words[:k])
    hits = [(prefix.find(s) + len(s), prefix.find(s), s) for s in stop if s in prefix]
    if hits:
      end, at, s = min(hits)
      return ids[:k], prefix[:end if include else at], "stop", s
  return None


def test_stop_strings_end_the_text_stream_it_and_free_the_blocks(checkpoint):
  path, _ = checkpoint
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8,
                            max_model_len=192)
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(3, helpers.VOCAB, n)] for n in (5, 9, 7)]
  base = dict(max_tokens=12, ignore_eos=True)
  runs = [dict(base), dict(base, temperature=1.0, seed=5, n=2)]
  greedy = llm.generate(prompts, SamplingParams(**base))
  for kwargs in runs:
    free = llm.generate(prompts, SamplingParams(**kwargs))
    for include in (False, True):
      # Per prompt: two words of the free text (a stop mid-call, held back across
      # tokens), its first word (a stop at the first token), one never generated.
      stops = [(" ".join(free[kwargs.get("n", 1) * i].text.split(" ")[k:k + 2]),)
               for i, k in enumerate((4, 6, 9))]
      stops[1] = (free[kwargs.get("n", 1)].text.split(" ")[0], "x")
      stops[2] += ("w9999",)
      params = [SamplingParams(**kwargs, stop=s, include_stop_str_in_output=include)
                for s in stops]
      events = list(llm.generate_stream(prompts, params))
      outs = llm.generate(prompts, params)
      for o, f in zip(outs, free):
        want = _stopped(f.token_ids, f.text, params[o.prompt_index].stop, include)
        want = want or (f.token_ids, f.text, f.finish_reason, None)
        assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == want
        mine = [e for e in events if (e.prompt_index, e.sample_index) ==
                (o.prompt_index, o.sample_index)]
        assert [e.token_id for e in mine] == o.token_ids + [None]
        assert (mine[-1].finish_reason, mine[-1].stop_reason) == (o.finish_reason,
                                                                  o.stop_reason)
        # The stream shows the text as it grows, never a part of a stop string it then
        # ends before.
        pieces = [e.text for e in mine]
        assert "".join(pieces) == o.text
        assert all(o.text.startswith("".join(pieces[:i])) for i in range(len(pieces)))
      assert any(o.finish_reason == "stop" for o in outs)
      assert llm.stats["num_free_blocks"] == 48
      allocator.validate(llm.allocator_state)
  # Nothing of the stopped sequences is left behind: the same requests serve as before.
  assert llm.generate(prompts, SamplingParams(**base)) == greedy
  with pytest.raises(ValueError, match=r"stop=\('', 'x'\) must be a non-empty str, a "
                                       "sequence of them, or None"):
    SamplingParams(stop=("", "x"))


def test_an_error_after_a_stop_in_the_same_report_leaves_no_sequence_behind(checkpoint):
  # Slot 0 reached its stop string; decoding slot 1's next token then raised (a tokenizer
  # error, or Ctrl-C, in the host's busiest loop): slot 0 was no longer counted as held,
  # so its sequence kept its blocks and the next generate stalled ("no progress").
  path, _ = checkpoint
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))

  class Failing:  # fails to decode any text holding ``bad``
    bad = None
    encode = tok.encode

    def decode(self, ids, **kwargs):
      if self.bad in ids:
        raise RuntimeError("decode failed")
      return tok.decode(ids, **kwargs)

  failing = Failing()
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=48,
                            max_seqs=2, max_tokens_per_step=16, steps_per_call=8,
                            max_model_len=192, tokenizer=failing)
  # Past steps_per_call tokens: slot 0 is still running when its stop is read.
  params = SamplingParams(max_tokens=20, ignore_eos=True)
  prompts = [[5, 9, 13], [7, 21, 4, 8]]
  free = llm.generate(prompts, params)
  assert free[0].token_ids[0] != free[1].token_ids[0]
  stops = [SamplingParams(max_tokens=20, ignore_eos=True, stop=s)
           for s in (free[0].text.split(" ")[0], "w9999")]
  failing.bad = free[1].token_ids[0]
  with pytest.raises(RuntimeError, match="decode failed"):
    llm.generate(prompts, stops)
  assert llm.stats["num_free_blocks"] == 48
  allocator.validate(llm.allocator_state)
  failing.bad = None
  assert llm.generate(prompts, params) == free


@pytest.mark.slow
def test_cli_prompt_stops_at_a_stop_string(checkpoint, capsys, monkeypatch, tmp_path):
  from paged_jax import LLM, cli
  path, _ = checkpoint
  argv = ["run", "--model", str(path), "--prompt", "w3 w4 w5", "--max-tokens", "6",
          "--max-seqs", "2", "--num-blocks", "48", "--block-size", "4", "--no-progress",
          "--compilation-cache", "off"]
  # The completion is printed as it streams: as each event is handed out, stdout already
  # holds every earlier event's text.
  printed, texts = [], []
  stream = LLM.generate_stream

  def recording(self, *args, **kwargs):
    for ev in stream(self, *args, **kwargs):
      printed.append(capsys.readouterr().out)
      assert "".join(printed).endswith("completion: " + "".join(texts))
      texts.append(ev.text)
      yield ev

  monkeypatch.setattr(LLM, "generate_stream", recording)
  assert cli.main(argv) == 0
  out = "".join(printed) + capsys.readouterr().out
  assert len(texts) == 7  # six tokens and the finish
  monkeypatch.undo()
  words = out.split("completion: ", 1)[1].splitlines()[0].split(" ")
  assert len(words) == 6 and "finish_reason length" in out
  assert cli.main(argv + ["--stop", f" {words[2]} ", "--stop", "w9999"]) == 0
  out = capsys.readouterr().out
  assert f"completion: {' '.join(words[:2])}\n" in out
  assert f"finish_reason stop (at ' {words[2]} ')" in out  # which stop string
  # --chat sends the prompt as a user's message laid out by the checkpoint's template.
  _chat_checkpoint(path, tmp_path)
  prompts = []
  monkeypatch.setattr(LLM, "generate_stream", lambda self, p, *a, **k: prompts.append(p) or
                      stream(self, p, *a, **k))
  argv[2] = str(tmp_path)
  assert cli.main(argv[:4] + ["w7 w8", "--chat"] + argv[5:]) == 0
  assert prompts == [[[1, 3, 9, 4, 7, 8, 5]]] and "finish_reason length" in capsys.readouterr().out


def test_cli_prompt_on_a_checkpoint_without_a_tokenizer_names_it(tmp_path, checkpoint,
                                                                 capsys):
  import shutil

  from paged_jax import cli
  path, _ = checkpoint
  bare = tmp_path / "bare"
  shutil.copytree(path, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
  with pytest.raises(SystemExit):
    cli.main(["run", "--model", str(bare), "--prompt", "w3 w4", "--no-progress"])
  assert f"--model={str(bare)!r} has no tokenizer.json" in capsys.readouterr().err


def test_an_unreadable_tokenizer_json_is_named(tmp_path, checkpoint, capsys):
  # A git-lfs pointer (or any file the tokenizers library cannot read) in place of
  # tokenizer.json: a traceback ending in a bare "Exception: expected value at line 1
  # column 1" before; now one error line naming the file, from the API and the CLI.
  import shutil

  from paged_jax import cli
  path, _ = checkpoint
  broken = tmp_path / "broken"
  shutil.copytree(path, broken)
  (broken / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")
  with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer the tokenizers "
                                       r"library reads \(.*\); replace it, or remove it"):
    LLM.from_pretrained(broken, num_blocks=8, max_seqs=2)
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["run", "--model", str(broken), "--no-progress"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"{broken / 'tokenizer.json'} is not a tokenizer" in err and "Traceback" not in err


def test_a_checkpoint_under_the_home_directory_brings_its_tokenizer(checkpoint, monkeypatch):
  # "~/ckpt" loaded the weights (the loader expands ~) but not tokenizer.json beside them,
  # in silence; the planner did not expand it either.
  from paged_jax import planner
  path, _ = checkpoint
  monkeypatch.setenv("HOME", str(path.parent))
  home_path = "~/" + path.name
  llm = LLM.from_pretrained(home_path, dtype="float32", impl="xla", block_size=4,
                            num_blocks=16, max_seqs=2, max_model_len=64)
  assert llm.tokenizer is not None
  assert planner.model_shape_from_config(home_path) == planner.model_shape_from_config(path)


@pytest.mark.slow
def test_cli_prompt_answered_at_once_by_eos_says_why_it_may_be(checkpoint, monkeypatch,
                                                               capsys):
  # An instruct model given raw text (SmolLM2-Instruct: "What is the capital of France?")
  # ends at EOS at once: the report showed an empty completion and nothing else.
  from paged_jax import cli, engine
  path, _ = checkpoint

  def generate_stream(self, prompts, params=None, **kwargs):
    return iter([engine.StreamEvent(0, 0, None, finish_reason="stop", text="")])
  monkeypatch.setattr(engine.LLM, "generate_stream", generate_stream)
  assert cli.main(["run", "--model", str(path), "--prompt", "w3 w4", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "completion: \n            (none: the model's first token was its end of " in out
  assert "may expect its chat template" in out


def test_cli_prompt_is_checked_before_compiling(checkpoint, monkeypatch, capsys):
  # An empty prompt, or one too long for the model, was refused only after every device
  # call had compiled (tens of seconds on a real checkpoint).
  from paged_jax import cli, cli_run
  path, _ = checkpoint
  monkeypatch.setattr(cli_run, "_precompile", lambda *a: pytest.fail("compiled"))
  # Named as the option the user typed (not the list of prompts the engine checks).
  long = " ".join(["w3"] * 300)
  for args, message in (
      (["--prompt", ""], "--prompt is empty"),
      (["--prompt", long], "--prompt has 300 tokens; must be < max_model_len="),
      (["--prompt", long], "to generate anything; --truncate-prompt-tokens -1 serves its last"),
      (["--prompt", long, "--truncate-prompt-tokens", "400"],
       "--prompt: --truncate-prompt-tokens=400 keeps 300 tokens; must be < max_model_len="),
      (["--prompt", long, "--truncate-prompt-tokens", "0"],
       "--truncate-prompt-tokens=0 must be >= 1 (the prompt's last that many tokens) or -1"),
      (["--truncate-prompt-tokens", "5"], "--truncate-prompt-tokens=5 applies to --prompt "
                                          "only"),
      (["--chat"], "--chat applies to --prompt only"),
      (["--prompt", "w3", "--chat", "--truncate-prompt-tokens", "4"],
       "--truncate-prompt-tokens=4 with --chat would cut the laid-out conversation's start"),
      (["--prompt", "w3", "--chat"], "--chat: the engine has no chat template (its checkpoint "
                                     "has no chat_template.jinja nor a chat_template in "
                                     "tokenizer_config.json): drop --chat")):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["run", "--model", str(path), *args, "--no-progress"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_capped_max_model_len_is_reported_at_the_users_call(checkpoint):
  # The warning points at the line that built the engine (here), not into the library.
  path, _ = checkpoint
  with pytest.warns(UserWarning, match=r"max_model_len=16, below the model's context") as w:
    LLM.from_pretrained(path, block_size=4, num_blocks=4, max_seqs=2)
  assert [r.filename for r in w] == [__file__]


def test_from_pretrained_shows_and_checks_the_engine_options(tmp_path):
  # Its options were hidden in **kwargs (help() and editors showed none), and a misspelt
  # one surfaced only after the whole checkpoint was read: now the signature lists them,
  # and an unknown keyword is a TypeError before anything is read (here: no checkpoint).
  import inspect
  params = inspect.signature(LLM.from_pretrained).parameters
  assert list(params)[:3] == ["path", "dtype", "impl"]
  for name in ("block_size", "num_blocks", "kv_budget_bytes", "max_seqs", "mesh",
               "max_tokens_per_step", "enable_prefix_caching", "kv_cache_dtype"):
    assert params[name].default == inspect.signature(LLM).parameters[name].default, name
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'blocksize'; the "
                                      r"engine's options: block_size, "):
    LLM.from_pretrained(tmp_path / "nowhere", blocksize=8)

  class Mine(LLM):  # a subclass taking **kwargs: its own call judges them
    def __init__(self, model, config, **kwargs):
      super().__init__(model, config, **kwargs)

  with pytest.raises(ValueError, match="checkpoint directory does not exist"):
    Mine.from_pretrained(tmp_path / "nowhere", num_blocks=8)
