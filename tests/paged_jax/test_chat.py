"""``paged_jax.engine.chat``: chat templates read from a checkpoint and rendered as
transformers' ``apply_chat_template`` renders them (compared where transformers is
installed), without an engine; ``LLM.chat`` itself is in test_engine_hf.py."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from paged_jax import ChatTemplate
from paged_jax.engine.chat import chat_prompts, load_chat_template

# In the manner of Llama 3.1's: the BOS text, a trimmed system turn, tools as JSON when
# given, tool calls, a refusal, the model's turn opened.
LLAMA_STYLE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = "
    "messages[0]['content'] | trim %}{%- set messages = messages[1:] %}{%- else %}{%- set "
    "system = 'You help.' %}{%- endif %}<|header|>system<|end_header|>\n\n{{ system }}"
    "{%- if tools is not none %}\nTools: {{ tools | tojson(indent=2) }}{%- endif %}<|eot|>"
    "{%- for m in messages %}{%- if m['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + m['role']) }}{%- endif %}<|header|>{{ m['role'] }}"
    "<|end_header|>\n\n{%- if m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}"
    "{%- else %}{{ m['content'] | trim }}{%- endif %}<|eot|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|header|>assistant<|end_header|>\n\n{%- endif %}")

CONVERSATION = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Weather in Paris?", "tool_calls": None},
    {"role": "assistant", "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": "sunny, 21°C"},
]


def _their_tokenizer():
  """A transformers tokenizer with BOS "<s>" and EOS "</s>", to render templates with
  (the test skips without transformers)."""
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="</s>", unk_token="<unk>")


def test_rendering_follows_transformers():
  # Text equal to transformers' for the template with and without tools and the generation
  # prompt; a None value is left out (as transformers does), tools and documents are None
  # unless given.
  theirs = _their_tokenizer()
  theirs.chat_template = LLAMA_STYLE
  ours = ChatTemplate(LLAMA_STYLE, bos_token="<s>", eos_token="</s>")
  tools = [{"name": "weather", "parameters": {"city": "string"}}]
  for kwargs in (dict(), dict(tools=tools)):
    for add in (True, False):
      want = theirs.apply_chat_template(CONVERSATION, tokenize=False,
                                        add_generation_prompt=add, **kwargs)
      assert ours.render(CONVERSATION, add_generation_prompt=add, **kwargs) == want
  assert "Tools" not in ours.render(CONVERSATION) and '"°' not in ours.render(CONVERSATION)


def test_continue_final_message_follows_transformers():
  # The last message's turn left open after its content: with a template that trims the
  # content (LLAMA_STYLE) and one that writes it as given, content as a str or as parts.
  theirs = _their_tokenizer()
  plain = ("{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}"
           "{{ m['content'] }}{% else %}{{ m['content'][-1]['text'] }}{% endif %}</s>"
           "{% endfor %}")
  begun = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "It is sunny, "}]
  parts = begun[:1] + [{"role": "assistant", "content": [{"type": "text", "text": "Warm "}]}]
  for template, conversation in ((LLAMA_STYLE, begun), (plain, begun), (plain, parts)):
    theirs.chat_template = template
    want = theirs.apply_chat_template(conversation, tokenize=False,
                                      add_generation_prompt=False,
                                      continue_final_message=True)
    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>")
    got = ours.render(conversation, add_generation_prompt=False, continue_final_message=True)
    assert got == want
    assert got.endswith(("It is sunny,", "It is sunny, ", "Warm "))
  assert parts[1]["content"] == [{"type": "text", "text": "Warm "}]  # the caller's, as given
  ours = ChatTemplate(plain)
  with pytest.raises(ValueError, match="pass add_generation_prompt=False with it"):
    ours.render(begun, continue_final_message=True)
  for dropped_rewritten_repeated in ("{{ messages[-1]['content'][:3] }}",
                                     "{{ messages[-1]['content'] | lower }}",
                                     "{{ messages[-1]['content'] }}|{{ messages[-1]['content'] }}"):
    with pytest.raises(ValueError, match="does not write the last message's content once, "
                                         "as given"):
      ChatTemplate(dropped_rewritten_repeated).render(
          begun, add_generation_prompt=False, continue_final_message=True)
  with pytest.raises(ValueError, match="continue_final_message='content' must be a bool"):
    ours.render(begun, add_generation_prompt=False, continue_final_message="content")
  with pytest.raises(ValueError, match=r"chat_template_kwargs names \['continue_final_message'\]"):
    chat_prompts(None, plain, begun, variables=dict(continue_final_message=True))
  for no_text in ([{"type": "image"}], [{"type": "text", "text": None}]):
    with pytest.raises(ValueError, match="no text to continue"):
      ours.render(begun[:1] + [{"role": "assistant", "content": no_text}],
                  add_generation_prompt=False, continue_final_message=True)
  with pytest.raises(ValueError, match="needs a conversation to continue"):
    ours.render([], add_generation_prompt=False, continue_final_message=True)


def test_template_features_errors_and_copies():
  t = ChatTemplate("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
                   "|{{ tools is none }}|{{ documents is none }}|{{ pad_token }}|{{ x }}",
                   other_tokens=[("pad_token", "<pad>")])
  assert t.render([{"role": "user", "content": "hi"}], x=3) == "hi|True|True|<pad>|3"
  assert pickle.loads(pickle.dumps(t)) == t == copy.deepcopy(t) and hash(t) == hash(
      ChatTemplate(t.source, other_tokens=(("pad_token", "<pad>"),)))
  with pytest.raises(ValueError, match="the chat template refused the conversation: no"):
    ChatTemplate("{{ raise_exception('no') }}").render([{"role": "user"}])
  with pytest.raises(ValueError, match=r"failed on the conversation \(TypeError: "):
    ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "a"}])
  with pytest.raises(ValueError, match="is not a template Jinja reads"):
    ChatTemplate("{% for %}")
  with pytest.raises(ValueError, match="chat_template='' must be a non-empty Jinja template"):
    ChatTemplate("")

  class Bare:  # an encode without add_special_tokens
    def encode(self, text):
      return [1]

  with pytest.raises(ValueError, match=r"encode\(text, add_special_tokens=False\) .* which "
                                       "Bare refused"):
    chat_prompts(Bare(), "{{ messages[0]['content'] }}", [{"role": "user", "content": "a"}])


def test_loading_a_checkpoints_template(tmp_path):
  # chat_template.jinja before tokenizer_config.json's; named templates ("default"; none of
  # that name: a warning); a template Jinja cannot read: a warning, not a failed load (token
  # ids and text serve without it); special-token texts as str or {"content": ...}.
  assert load_chat_template(str(tmp_path)) is None
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps(dict(chat_template="A", bos_token={"content": "<s>"},
                                    eos_token="</s>", pad_token="<pad>", model_max_length=9)))
  got = load_chat_template(str(tmp_path))
  assert (got.source, got.bos_token, got.eos_token, got.other_tokens) == (
      "A", "<s>", "</s>", (("pad_token", "<pad>"),))
  (tmp_path / "chat_template.jinja").write_text("B")
  assert load_chat_template(str(tmp_path)).source == "B"
  (tmp_path / "chat_template.jinja").unlink()
  config.write_text(json.dumps(dict(chat_template=[dict(name="tool_use", template="T"),
                                                   dict(name="default", template="D")])))
  assert load_chat_template(str(tmp_path)).source == "D"
  config.write_text(json.dumps(dict(chat_template=[dict(name="tool_use", template="T")])))
  with pytest.warns(UserWarning, match=r"named chat templates \['tool_use'\] and none named "
                                       "'default'"):
    assert load_chat_template(str(tmp_path)) is None
  config.write_text(json.dumps(dict(chat_template="{% for %}")))
  with pytest.warns(UserWarning, match="is not a template Jinja reads.*chat needs "
                                       "chat_template="):
    assert load_chat_template(str(tmp_path)) is None
