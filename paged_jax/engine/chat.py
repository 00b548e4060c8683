"""Chat conversations to prompts: a checkpoint's chat template (``LLM.chat``).

A chat model is trained on conversations laid out by its template (a Jinja template in the
checkpoint's ``chat_template.jinja`` or ``tokenizer_config.json``): the roles' markers, the
BOS, the turn that asks the model to answer. ``ChatTemplate.render`` lays a conversation
out as that template does in transformers' ``apply_chat_template`` (a sandboxed Jinja
environment, blocks trimmed, ``tojson``, ``raise_exception`` and ``strftime_now``), and
``chat_prompts`` turns conversations into token ids without the tokenizer adding its
special tokens again (the template wrote them).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections import abc
from typing import Any

__all__ = ["ChatTemplate", "chat_prompts", "load_chat_template"]


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template and the special-token texts it may name.

  Attributes:
    source: the Jinja template (``messages``, ``add_generation_prompt``, ``bos_token``,
      ``eos_token`` and any further variables given to ``render``).
    bos_token, eos_token: the texts of the tokenizer's BOS and EOS ("" when none).
  """

  source: str
  bos_token: str = ""
  eos_token: str = ""
  _jinja: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source.strip():
      raise ValueError(f"chat_template={self.source!r} must be a non-empty Jinja template "
                       "(a str)")
    for name in ("bos_token", "eos_token"):
      if not isinstance(getattr(self, name), str):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a str")
    object.__setattr__(self, "_jinja", _compiled(self.source))  # a bad template: now

  def render(self, messages, *, add_generation_prompt: bool = True, **variables) -> str:
    """The text of one conversation (``messages``: dicts with "role" and "content", as
    ``LLM.chat`` takes them), ending with the model's turn opened when
    ``add_generation_prompt``; ``variables``: more template variables (``tools``, ...)."""
    from jinja2 import TemplateError
    context = dict(dict(bos_token=self.bos_token, eos_token=self.eos_token), **variables,
                   messages=messages, add_generation_prompt=bool(add_generation_prompt))
    try:
      return self._jinja.render(**context)
    except TemplateError as e:
      raise ValueError(f"the chat template failed on the conversation: {e}") from None


def _raise(message):
  raise ValueError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _compiled(source: str):
  from jinja2 import TemplateError  # lazily: only chat needs Jinja
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except TemplateError as e:
    raise ValueError(f"the chat template is not a template Jinja reads: {e}") from None


def load_chat_template(directory: str) -> ChatTemplate | None:
  """The chat template of a checkpoint directory: ``chat_template.jinja`` if present, else
  ``tokenizer_config.json``'s ``chat_template`` (a str, or named templates: "default"),
  with that file's ``bos_token`` / ``eos_token`` texts; None when it has none."""
  config: dict = {}
  config_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(config_path):
    from paged_jax._json import read_json_object
    config = read_json_object(config_path, "tokenizer config")
  source = config.get("chat_template")
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      source = f.read()
  if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default")
  if not isinstance(source, str) or not source.strip():
    return None
  return ChatTemplate(source, _token_text(config.get("bos_token")),
                      _token_text(config.get("eos_token")))


def _token_text(token) -> str:
  """A special token as tokenizer_config.json writes it: a str, or {"content": str}."""
  if isinstance(token, dict):
    token = token.get("content")
  return token if isinstance(token, str) else ""


def conversations(messages) -> list[list[dict]]:
  """``LLM.chat``'s ``messages``, one conversation or a list of them, as a list of
  conversations; a ``ValueError`` naming what is malformed."""
  if (isinstance(messages, (str, bytes, abc.Mapping))
      or not isinstance(messages, abc.Sequence) or not messages):
    raise ValueError(f"messages={type(messages).__name__} must be a conversation (a "
                     "non-empty list of {'role': ..., 'content': ...} dicts) or a list of them")
  single = isinstance(messages[0], abc.Mapping)
  out = [list(messages)] if single else [list(c) if isinstance(c, abc.Sequence)
                                         and not isinstance(c, (str, bytes)) else c
                                         for c in messages]
  for i, conversation in enumerate(out):
    where = "messages" if single else f"messages[{i}]"
    if not isinstance(conversation, list) or not conversation:
      raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} "
                       "dicts")
    for j, message in enumerate(conversation):
      if (not isinstance(message, abc.Mapping) or not isinstance(message.get("role"), str)
          or "content" not in message):
        raise ValueError(f"{where}[{j}]={message!r} must be a dict with a 'role' (str) and "
                         "a 'content'")
  return out


def chat_prompts(tokenizer, template: ChatTemplate | str | None, messages, *,
                 add_generation_prompt: bool = True, variables=None) -> list[list[int]]:
  """The token ids of each conversation of ``messages`` laid out by ``template`` (a
  ``ChatTemplate`` or its source; ``variables``: a dict of more template variables),
  encoded without the tokenizer's added special tokens."""
  if variables is None:
    variables = {}
  if not isinstance(variables, abc.Mapping) or not all(isinstance(k, str) for k in variables):
    raise ValueError(f"chat_template_kwargs={variables!r} must be a dict of template "
                     "variables by name")
  reserved = sorted({"messages", "add_generation_prompt"} & set(variables))
  if reserved:
    raise ValueError(f"chat_template_kwargs names {reserved}, which chat sets itself")
  if tokenizer is None:
    raise ValueError("chat needs the engine's tokenizer to encode the conversation, and it "
                     "has none (pass LLM(..., tokenizer=...))")
  if template is None:
    raise ValueError("the engine has no chat template (its checkpoint has no "
                     "chat_template.jinja nor a chat_template in tokenizer_config.json): "
                     "pass chat_template=")
  if isinstance(template, str):
    template = ChatTemplate(template)
  elif not isinstance(template, ChatTemplate):
    raise ValueError(f"chat_template={template!r} must be a Jinja template (a str) or a "
                     "ChatTemplate")
  out = []
  for conversation in conversations(messages):
    text = template.render(conversation, add_generation_prompt=add_generation_prompt,
                           **dict(variables))
    encoded = tokenizer.encode(text, add_special_tokens=False)
    out.append(list(getattr(encoded, "ids", encoded)))  # an Encoding, or a list
  return out
