"""Text in and out of the engine: prompts to token ids, completions to text.

``encode_prompt`` checks one prompt (a string through the tokenizer, or token ids) and gives
its ids. ``CompletionText`` follows one completion as its tokens arrive: the text each token
adds, and where the text reaches one of the request's stop strings
(``SamplingParams.stop``).

A token's text is read from a short window of the tokens before it: decoded alone, a
token can lose the space it starts with (SentencePiece) or be part of a character whose
UTF-8 bytes span several tokens (byte-level BPE, whose partial characters decode as
U+FFFD). Text ending in U+FFFD waits for the next token (the complete characters before it
are read for stop strings at once). While stop strings are asked for, the last characters
that could begin one are held back too, so that a stream never shows a part of the stop
string it is about to end at. Everything held back comes with the completion's last event,
and the completion's text is the text of its events joined.
"""

from __future__ import annotations

from collections import abc

import numpy as np

__all__ = ["CompletionText", "encode_prompt", "encode_text"]

_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 character decodes to


def encode_prompt(i: int, prompt, *, tokenizer, vocab_size: int, max_model_len: int,
                  limit_note: str, keep_last: int | None = None) -> tuple[int, ...]:
  """The token ids of ``prompts[i]`` (a str needs ``tokenizer``), or a ``ValueError``
  naming it: no order of tokens, a non-integer id, an id outside ``[0, vocab_size)``, empty,
  or ``max_model_len`` tokens or more (``limit_note`` says what bounds it). ``keep_last``:
  only the last that many ids (``SamplingParams.truncate_prompt_tokens``; -1:
  ``max_model_len - 1``), the whole prompt checked first; of a text, the special tokens the
  tokenizer adds around every text (a BOS) stay and count among them, as a tokenizer's own
  left truncation keeps them."""
  added = (0, 0)  # special ids the tokenizer put before and after a text's own
  if isinstance(prompt, str):
    if tokenizer is None:
      raise ValueError(f"prompts[{i}] is a string but the engine has no tokenizer (the "
                       "checkpoint has no tokenizer.json): pass token ids")
    prompt = encode_text(tokenizer, prompt)
    if keep_last is not None:
      added = _added_around(tokenizer, prompt)
  if isinstance(prompt, (abc.Set, abc.Mapping, bytes, bytearray, memoryview)):
    raise ValueError(f"prompts[{i}] is a {type(prompt).__name__}, which has no order of "
                     "tokens or holds no ids: a prompt is a str or a sequence of token ids")
  prompt = np.asarray(prompt) if hasattr(prompt, "__array__") else prompt  # one transfer
  dtype = getattr(prompt, "dtype", None)  # a numpy / JAX array: its dtype decides
  try:
    items = list(prompt)
  except TypeError:
    raise ValueError(f"prompts[{i}]={prompt!r} must be a string or a sequence of token "
                     "ids") from None
  if dtype is not None:
    if getattr(prompt, "ndim", 1) != 1:
      raise ValueError(f"prompts[{i}] has shape {tuple(prompt.shape)}; a prompt is one "
                       "sequence of token ids (1-D)")
    if not np.issubdtype(np.dtype(dtype), np.integer):
      raise ValueError(f"prompts[{i}] has dtype {np.dtype(dtype)}; token ids must be "
                       "integers")
  else:
    for j, t in enumerate(items):
      scalar_int = (getattr(t, "shape", None) == ()
                    and np.issubdtype(np.dtype(getattr(t, "dtype", object)), np.integer))
      if isinstance(t, bool) or not (isinstance(t, (int, np.integer)) or scalar_int):
        why = " (a float id is refused, not truncated)" * isinstance(t, (float, np.floating))
        raise ValueError(f"prompts[{i}][{j}]={t!r} is a {type(t).__name__}; token ids "
                         f"must be ints{why}")
  ids = [int(t) for t in items]
  if len(ids) == 0:
    raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary "
                     f"[0, vocab_size={vocab_size})")
  if keep_last is not None:
    keep = max_model_len - 1 if keep_last == -1 else keep_last
    if len(ids) > keep:
      head, tail = added
      if keep <= head + tail:
        raise ValueError(f"prompts[{i}]: truncate_prompt_tokens={keep_last} keeps no token "
                         f"of the text beside the {head + tail} special tokens the tokenizer "
                         "adds to it")
      whole = len(ids)
      ids = ids[:head] + ids[whole - tail - (keep - head - tail):]
  if len(ids) >= max_model_len:
    if keep_last is None:
      raise ValueError(f"prompts[{i}] has {len(ids)} tokens; must be < max_model_len="
                       f"{max_model_len} ({limit_note}) to generate anything; "
                       "SamplingParams(truncate_prompt_tokens=-1) serves its last "
                       f"{max_model_len - 1}")
    raise ValueError(f"prompts[{i}]: truncate_prompt_tokens={keep_last} keeps {len(ids)} "
                     f"tokens; must be < max_model_len={max_model_len} ({limit_note}) to "
                     "generate anything (-1 keeps the most that fit)")
  return tuple(ids)


def encode_text(tokenizer, text: str, **kwargs) -> list[int]:
  """The ids of ``text`` by ``tokenizer.encode(text, **kwargs)``, as ints."""
  encoded = tokenizer.encode(text, **kwargs)
  # tokenizers.Tokenizer gives an Encoding (.ids); a transformers tokenizer a list.
  return [int(t) for t in getattr(encoded, "ids", encoded)]


def _added_around(tokenizer, ids) -> tuple[int, int]:
  """How many special ids the tokenizer added before and after a text's own in ``ids``
  (a BOS, an EOS): those it adds around a probe text, where ``ids`` begins and ends with
  them. A tokenizer whose ``encode`` takes no ``add_special_tokens``: those it gives an
  empty text, at the start."""
  try:
    plain = encode_text(tokenizer, "a", add_special_tokens=False) or None  # [] would match
    full = encode_text(tokenizer, "a")                                       # anywhere
    at = next(i for i in range(len(full) - len(plain) + 1)
              if full[i:i + len(plain)] == plain)
    head, tail = full[:at], full[at + len(plain):]
  except (TypeError, StopIteration):  # (len(None) is a TypeError too)
    head, tail = encode_text(tokenizer, ""), []
  if (len(ids) >= len(head) + len(tail) and ids[:len(head)] == head
      and ids[len(ids) - len(tail):] == tail):
    return len(head), len(tail)
  return 0, 0


class CompletionText:
  """The text of one completion, token by token (module docstring).

  Args:
    tokenizer: what the engine decodes with (``decode(ids, skip_special_tokens=...)``).
    stop: the request's stop strings (``SamplingParams.stop``).
    include_stop: keep the stop string at the end of the text
      (``SamplingParams.include_stop_str_in_output``).
    per_token: give each token's text as it comes (a stream); False (``generate``): only
      what stop strings need, and the whole text at the end (two decodes a token saved).
    min_tokens: a stop string ends the text only where a token after the first
      ``min_tokens`` completes it (``SamplingParams.min_tokens``; a stop id is not drawn
      before then either).
    skip_special_tokens: leave the tokenizer's special tokens out of the text
      (``SamplingParams.skip_special_tokens``).
  """

  def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False,
               per_token: bool = True, min_tokens: int = 0, skip_special_tokens: bool = True):
    self._tokenizer, self._stop, self._include_stop = tokenizer, stop, include_stop
    self._skip_special = skip_special_tokens
    self._min_tokens = min_tokens
    self._per_token = per_token or bool(stop)
    self._ids: list[int] = []
    self._window = self._read = 0  # ids[window:read] decoded give the text's last part
    self._text = ""  # the text of ids[:read]
    self._shown = 0  # characters of it given out
    self.stopped = False  # the text reached a stop string: nothing more is taken
    self.stop_string: str | None = None  # which one

  def _decode(self, ids) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

  def add(self, token_id: int) -> str:
    """Take the next token; returns the text that can be shown now (maybe "")."""
    if self.stopped:
      raise RuntimeError("CompletionText.add after its stop string")
    self._ids.append(token_id)
    if not self._per_token:
      return ""
    before = self._decode(self._ids[self._window:self._read])
    after = self._decode(self._ids[self._window:])
    new = after[len(before):] if len(after) > len(before) else ""
    whole = new.rstrip(_REPLACEMENT)
    start = len(self._text)
    if new and whole == new:  # every character of it complete: the window moves on
      self._text += new
      self._window, self._read = self._read, len(self._ids)
      text = self._text
    else:  # an unfinished character last: the complete ones before it count for stops
      text = self._text + whole
    if self._stop and len(self._ids) > self._min_tokens:
      end = self._stop_end(text, start)
      if end is not None:
        self.stopped = True  # (self.stop_string is set)
        self._text = text[:end]
        return self._take(len(self._text))
    return self._take(len(self._text) - self._held(self._text))

  def _stop_end(self, text: str, start: int) -> int | None:
    """Where ``text`` ends at the stop string it reaches first past ``start`` (the text
    before held none): the one ending first, of those the one starting first (whatever
    their order in ``stop``); before it, or after it with ``include_stop``; None if none."""
    found = []
    for s in self._stop:
      at = text.find(s, max(start - len(s) + 1, 0))
      if at >= 0:
        found.append((at + len(s), at, s))
    if not found:
      return None
    end, at, self.stop_string = min(found)
    return end if self._include_stop else at

  def _held(self, text: str) -> int:
    """How many of ``text``'s last characters could begin a stop string (not shown yet: the
    text may end before them); none with ``include_stop``, where they are kept anyway."""
    if self._include_stop:
      return 0
    for k in range(min(len(text), max(map(len, self._stop), default=1) - 1), 0, -1):
      if any(s.startswith(text[-k:]) for s in self._stop):
        return k
    return 0

  def _take(self, upto: int) -> str:
    piece = self._text[self._shown:max(upto, self._shown)]
    self._shown += len(piece)
    return piece

  def finish(self) -> str:
    """The completion ended: the text not shown yet. Without a stop string, the text is
    the decode of every id when that continues what was shown: it does for valid UTF-8;
    invalid bytes through a byte-fallback tokenizer can decode otherwise in a window than
    in the whole, and a stream then keeps the window's text (``generate``, which decodes
    the whole, can differ there)."""
    if not self.stopped:
      whole = self._decode(self._ids)
      if whole.startswith(self._text[:self._shown]):
        self._text = whole
      elif self._read < len(self._ids):  # a partial character at the end: shown as U+FFFD
        self._text += self._decode(self._ids[self._window:])[
            len(self._decode(self._ids[self._window:self._read])):]
    return self._take(len(self._text))
