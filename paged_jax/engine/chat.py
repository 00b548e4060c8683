"""Chat conversations to prompts: a checkpoint's chat template (``LLM.chat``).

A chat model is trained on conversations laid out by its template (a Jinja template in the
checkpoint's ``chat_template.jinja`` or ``tokenizer_config.json``): the roles' markers, the
BOS, the turn that asks the model to answer. ``ChatTemplate.render`` lays a conversation
out in a sandboxed Jinja environment set up as transformers' ``apply_chat_template`` sets
its own (blocks trimmed, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``,
the ``generation`` block, ``tools`` and ``documents`` None unless given, messages' None
values left out; not its newer rewrites of messages, such as ``thinking`` into
``reasoning_content``, nor its choice of a ``tool_use`` template), and
``chat_prompts`` turns conversations into token ids without the tokenizer adding its
special tokens again (the template wrote them).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import warnings
from collections import abc

from paged_jax._json import read_json_object
from paged_jax.engine.text import encode_text

__all__ = ["ChatTemplate", "chat_prompts", "load_chat_template"]


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template and the special-token texts it may name.

  Attributes:
    source: the Jinja template (``messages``, ``add_generation_prompt``, ``tools`` and
      ``documents`` (None unless given), the special-token texts and any further variables
      given to ``render``).
    bos_token, eos_token: the texts of the tokenizer's BOS and EOS ("" when none).
    other_tokens: more ``(name, text)`` pairs the template may name (``pad_token``,
      ``unk_token``, ... as tokenizer_config.json gives them).
  """

  source: str
  bos_token: str = ""
  eos_token: str = ""
  other_tokens: tuple[tuple[str, str], ...] = ()

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source.strip():
      raise ValueError(f"chat_template={self.source!r} must be a non-empty Jinja template "
                       "(a str)")
    for name in ("bos_token", "eos_token"):
      if not isinstance(getattr(self, name), str):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a str")
    object.__setattr__(self, "other_tokens", tuple(sorted(
        (str(k), str(v)) for k, v in dict(self.other_tokens).items())))
    _compiled(self.source)  # a template Jinja cannot read: refused now

  def render(self, messages, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, **variables) -> str:
    """The text of one conversation (``messages``: dicts with a "role", as ``LLM.chat``
    takes them; keys whose value is None are left out, as transformers does), ending with
    the model's turn opened when ``add_generation_prompt``, or, ``continue_final_message``
    (with ``add_generation_prompt`` False), right after the last message's content, its
    turn left open for the model to continue (a reply begun for it: "Sure, here"), as
    transformers' ``apply_chat_template`` cuts it (a template that drops, rewrites or
    repeats that content is refused); ``variables``: more template variables
    (``tools``, ...)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if not isinstance(continue_final_message, bool):
      raise ValueError(f"continue_final_message={continue_final_message!r} must be a bool "
                       "(it continues the last message's content)")
    if continue_final_message:
      if add_generation_prompt:
        raise ValueError("continue_final_message=True continues the last message; "
                         "add_generation_prompt=True opens a new turn: pass "
                         "add_generation_prompt=False with it")
      messages, final_text = _mark_final(messages)
    context = dict(dict(self.other_tokens), bos_token=self.bos_token,
                   eos_token=self.eos_token, tools=None, documents=None)
    context.update(variables, messages=messages,
                   add_generation_prompt=bool(add_generation_prompt))
    try:
      text = _compiled(self.source).render(**context)
    except _Refused as e:
      raise ValueError(f"the chat template refused the conversation: {e}") from None
    except Exception as e:  # a template error, or a Python one inside the sandbox
      raise ValueError(f"the chat template failed on the conversation "
                       f"({type(e).__name__}: {e})") from None
    return _cut_at_mark(text, final_text) if continue_final_message else text


class _Refused(Exception):
  """``raise_exception`` in a template."""


_MARK = "PAGED_JAX_CONTINUES_HERE "
"""Appended to the last message's text (``continue_final_message``): the rendered text
ends where it is found. Capitals and "_" only, which escaping and ``upper`` keep; its
trailing space tells a template that trims the content."""


def _mark_final(messages: list[dict]) -> tuple[list[dict], str]:
  """``messages`` with ``_MARK`` after the last one's text (its "content": a str, or the
  last part with a "text" of a list of parts), and that text."""
  if not messages:
    raise ValueError("continue_final_message=True needs a conversation to continue: it is "
                     "empty")
  final = dict(messages[-1])
  content = final.get("content")
  if isinstance(content, (list, tuple)):
    texts = [i for i, part in enumerate(content) if isinstance(part, dict) and "text" in part]
    if not texts or not isinstance(content[texts[-1]]["text"], str):
      raise ValueError("continue_final_message=True: the last message has no text to "
                       "continue (none of its content parts has a str \"text\")")
    parts = list(content)
    text = parts[texts[-1]]["text"]
    parts[texts[-1]] = dict(parts[texts[-1]], text=text + _MARK)
    final["content"] = parts
  elif isinstance(content, str):
    text, final["content"] = content, content + _MARK
  else:
    raise ValueError(f"continue_final_message=True: the last message's 'content' must be "
                     f"a str or a list of parts with text to continue, not {content!r}")
  return messages[:-1] + [final], text


def _cut_at_mark(rendered: str, text: str) -> str:
  """``rendered`` up to ``_MARK`` (where a template trimmed the content, less the spaces
  before it), which must end with the last message's ``text`` (stripped); a
  ``ValueError`` where the template dropped, rewrote or repeated it."""
  at = rendered.rfind(_MARK.strip())
  cut = rendered[:at] if rendered.startswith(_MARK, at) else rendered[:at].rstrip()
  if at < 0 or rendered.count(_MARK.strip()) > 1 or text.strip() not in cut[-len(text) - 1:]:
    raise ValueError("continue_final_message=True, but the chat template does not write the "
                     "last message's content once, as given, at the end of what it writes "
                     "of the conversation (it dropped, rewrote or repeated it), so the reply "
                     "cannot continue it")
  return cut


def _raise(message):
  raise _Refused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _generation_tag():
  """The ``{% generation %} ... {% endgeneration %}`` block of templates written for
  transformers' assistant masks: its body, rendered as is."""
  from jinja2.ext import Extension

  class Generation(Extension):
    tags = {"generation"}

    def parse(self, parser):
      next(parser.stream)
      return parser.parse_statements(("name:endgeneration",), drop_needle=True)

  return Generation


@functools.lru_cache(maxsize=64)
def _compiled(source: str):
  """The compiled template of ``source`` (pure: cached by source, shared by threads)."""
  from jinja2 import TemplateError  # lazily: only chat needs Jinja
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols",
                                                  _generation_tag()])
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
    config = read_json_object(config_path, "tokenizer config")
  source = config.get("chat_template")
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      source = f.read()
  if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    if "default" not in named:
      warnings.warn(f"{directory}: named chat templates {sorted(map(str, named))} and none "
                    "named 'default': chat needs chat_template= (one of them)", stacklevel=3)
    source = named.get("default")
  if not isinstance(source, str) or not source.strip():
    return None
  others = {k: _token_text(v) for k, v in config.items()
            if k.endswith("_token") and k not in ("bos_token", "eos_token")
            and _token_text(v)}
  try:
    return ChatTemplate(source, _token_text(config.get("bos_token")),
                        _token_text(config.get("eos_token")), tuple(others.items()))
  except ValueError as e:  # serving token ids and text needs no template: only chat does
    warnings.warn(f"{directory}: {e}; chat needs chat_template=", stacklevel=3)
    return None


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
      if not isinstance(message, abc.Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where}[{j}]={message!r} must be a dict with a 'role' (str) and "
                         "its 'content' (or, a tool call's turn, its 'tool_calls')")
  return out


def chat_prompts(tokenizer, template: ChatTemplate | str | None, messages, *,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 variables=None) -> list[list[int]]:
  """The token ids of each conversation of ``messages`` laid out by ``template`` (a
  ``ChatTemplate`` or its source; ``variables``: a dict of more template variables;
  ``add_generation_prompt``, ``continue_final_message``: ``ChatTemplate.render``'s),
  encoded without the tokenizer's added special tokens."""
  if variables is None:
    variables = {}
  if not isinstance(variables, abc.Mapping) or not all(isinstance(k, str) for k in variables):
    raise ValueError(f"chat_template_kwargs={variables!r} must be a dict of template "
                     "variables by name")
  reserved = sorted({"messages", "add_generation_prompt", "continue_final_message"}
                    & set(variables))
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
                           continue_final_message=continue_final_message, **dict(variables))
    try:
      out.append(encode_text(tokenizer, text, add_special_tokens=False))
    except TypeError as e:
      raise ValueError(f"chat encodes the laid-out conversation with the engine's tokenizer "
                       f"as encode(text, add_special_tokens=False) (the template wrote the "
                       f"special tokens), which {type(tokenizer).__name__} refused: {e}"
                       ) from None
  return out
