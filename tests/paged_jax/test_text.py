"""``CompletionText``: a completion's text token by token, and its stop strings, against a
brute-force reading of the decoded prefixes, on tokenizers whose tokens do not decode alone
(byte-level BPE splitting UTF-8 characters; SentencePiece's leading spaces)."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from paged_jax.engine.text import CompletionText, encode_prompt


def _byte_level() -> tokenizers.Tokenizer:
  """Byte-level BPE without merges: token id b is byte b (GPT-2's byte-to-char table)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  chars = {b: chr(b) for b in printable}
  chars.update({b: chr(256 + i) for i, b in
                enumerate(b for b in range(256) if b not in chars)})
  tok = tokenizers.Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok


class _ByteChunks:
  """A byte-level tokenizer whose tokens are any byte strings, as BPE merges make them:
  one token can end a character and start the next ("a" + a lead byte)."""

  def __init__(self):
    self.chunks: list[bytes] = []

  def ids(self, chunks) -> list[int]:
    self.chunks += chunks
    return list(range(len(self.chunks) - len(chunks), len(self.chunks)))

  def decode(self, ids, skip_special_tokens=True) -> str:
    return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


_WORDS = ["▁the", "▁cat", "s", "▁sat", "▁on", "at", "▁mat", ".", "▁é", "t", "é"]


def _metaspace() -> tokenizers.Tokenizer:
  """Word pieces with SentencePiece's "▁" for a space: a piece decoded alone at the start
  of a text loses its space."""
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)},
                                              unk_token="."))
  tok.decoder = decoders.Metaspace()
  return tok


def _reference(tok, ids, stop, include, min_tokens=0):
  """What a completion of ``ids`` gives: the first prefix whose decode holds a stop string
  ends it at the occurrence that ends first (of those, the one starting first), else every
  id and its whole decode. With ``min_tokens``, only prefixes longer than that, and only
  occurrences ending past the whole characters of the first ``min_tokens`` ids' text."""
  before = tok.decode(ids[:min_tokens], skip_special_tokens=True)
  base = len(before.rstrip("\ufffd"))
  for k in range(min_tokens + 1, len(ids) + 1):
    text = tok.decode(ids[:k], skip_special_tokens=True)
    found = {s: text.find(s, max(base - len(s) + 1, 0)) for s in stop}
    hits = [(at + len(s), at, s) for s, at in found.items() if at >= 0]
    if hits:
      end, at, s = min(hits)
      return ids[:k], text[:end if include else at], s
  return ids, tok.decode(ids, skip_special_tokens=True), None


def _run(tok, ids, stop, include, min_tokens=0):
  """Feed ``ids`` until a stop; checks that what is shown is only ever a prefix of the
  final text (never the start of a stop string that then ends it)."""
  text = CompletionText(tok, stop, include, min_tokens=min_tokens)
  taken, pieces = [], []
  for t in ids:
    taken.append(t)
    pieces.append(text.add(t))
    if text.stopped:
      break
  pieces.append(text.finish())
  final = "".join(pieces)
  for i in range(len(pieces)):
    assert final.startswith("".join(pieces[:i]))
  return taken, final, text.stop_string


@pytest.mark.parametrize("include", [False, True])
def test_byte_level_text_and_stop_strings_match_the_decoded_prefixes(include):
  tok = _byte_level()
  rng = np.random.default_rng(0)
  alphabet = list("ab ,.\n") + ["é", "中", "文", "🙂", "ß"]
  for trial in range(150):
    words = "".join(rng.choice(alphabet, rng.integers(1, 30)))
    ids = list(words.encode())
    assert tok.decode(ids) == words
    # Stop strings cut from the text (multi-byte ones included) and one that never appears.
    stop = ["zz"]
    for _ in range(rng.integers(0, 3)):
      a = int(rng.integers(0, len(words)))
      stop.append(words[a:a + int(rng.integers(1, 4))])
    stop = tuple(dict.fromkeys(s for s in stop if s))
    assert _run(tok, ids, stop, include) == _reference(tok, ids, stop, include), (
        words, stop)
    # min_tokens: a stop string counts only where an id after the first min_tokens
    # completes it.
    m = int(rng.integers(1, len(ids) + 2))
    assert _run(tok, ids, stop, include, m) == _reference(tok, ids, stop, include, m), (
        words, stop, m)
  # No stop string: the text is the decode of every id, each character once it is whole.
  text = CompletionText(tok)
  assert [text.add(t) for t in "é🙂".encode()] == ["", "é", "", "", "", "🙂"]
  assert text.finish() == ""
  # For generate (no stream): nothing decoded a token, the whole text at the end, unless
  # stop strings need the text as it grows.
  text = CompletionText(tok, per_token=False)
  assert [text.add(t) for t in "é🙂".encode()] == [""] * 6 and text.finish() == "é🙂"
  text = CompletionText(tok, ("🙂",), per_token=False)
  assert "".join(text.add(t) for t in "é🙂a".encode()[:6]) == "é" and text.stopped
  # A completion that ends inside a character shows it as decode does (U+FFFD).
  text = CompletionText(tok)
  assert [text.add(t) for t in "a🙂".encode()[:3]] == ["a", "", ""]
  assert "a" + text.finish() == tok.decode(list("a🙂".encode()[:3])) == "a\ufffd"


def test_a_stop_string_is_seen_at_the_token_that_completes_it_mid_character():
  # A token holding the stop string's last character and the first byte of the next
  # (" \xe2"): the window then ends in U+FFFD; the stop was seen only tokens later (its
  # token_ids ran past it), or never when the completion ended there.
  tok = _ByteChunks()
  rng = np.random.default_rng(2)
  alphabet = list("ab ,.") + ["é", "中", "🙂", "€"]
  for trial in range(300):
    data = "".join(rng.choice(alphabet, rng.integers(1, 20))).encode()
    cuts = sorted(set(rng.integers(1, len(data), rng.integers(0, len(data))).tolist()))
    ids = tok.ids([data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])])
    text = tok.decode(ids)
    stop = tuple(dict.fromkeys(text[a:a + int(rng.integers(1, 3))]
                               for a in rng.integers(0, len(text), 2))) or ("zz",)
    for order in (stop, stop[::-1]):  # which is reached first, not which is listed first
      for include in (False, True):
        assert _run(tok, ids, order, include) == _reference(tok, ids, order, include), (
            data, ids, order)
  # Reached in one token: "c" ends before "abcd" and "bc" with it; "bc" starts first.
  ids = tok.ids([b"abcd"])
  for include, want in ((False, "a"), (True, "abc")):
    assert _run(tok, ids, ("abcd", "c", "bc"), include) == (ids, want, "bc")
  ids = tok.ids([b"w1", b"03 \xe2", b"\x82\xac"])  # "w103 €" with the stop "03 "
  assert _run(tok, ids[:2], ("03 ",), False) == (ids[:2], "w1", "03 ")
  assert _run(tok, ids, ("03 ",), True) == (ids[:2], "w103 ", "03 ")


def test_metaspace_text_keeps_its_spaces_and_stops():
  tok = _metaspace()
  rng = np.random.default_rng(1)
  for trial in range(150):
    ids = [int(t) for t in rng.integers(0, len(_WORDS), rng.integers(1, 12))]
    whole = tok.decode(ids)
    assert _run(tok, ids, (), False) == (ids, whole, None)
    for stop in ((" cat", "t."), ("at",), ("s s", " mat"), (" ",)):
      for include in (False, True):
        assert _run(tok, ids, stop, include) == _reference(tok, ids, stop, include), (
            ids, stop)
        m = trial % 5
        assert _run(tok, ids, stop, include, m) == _reference(tok, ids, stop, include, m), (
            ids, stop, m)
  # The first piece decodes without its space, the next ones with theirs.
  text = CompletionText(tok)
  assert [text.add(_WORDS.index(w)) for w in ("▁the", "▁cat", "s")] == ["the", " cat", "s"]
  # Held back while it could begin the stop string ("cat" of "cat."), no longer.
  text = CompletionText(tok, ("cat.", "xyz"))
  assert [text.add(_WORDS.index(w)) for w in ("▁the", "▁cat", "s")] == ["the", " ", "cats"]
  assert text.finish() == ""
  text = CompletionText(tok, ("cat.",))
  assert [text.add(_WORDS.index(w)) for w in ("▁the", "▁cat")] == ["the", " "]
  assert text.finish() == "cat"  # the completion ended: what was held back comes last
  # min_tokens 3: "the" (token 1), " cat" (token 2) and "cats" (token 3: a stop id could
  # not end it there either) are too early; the second "cat" (token 4) ends it.
  text = CompletionText(tok, ("the", "cat", "s"), min_tokens=3)
  words = ("▁the", "▁cat", "s", "▁cat", "▁sat")
  pieces = [text.add(_WORDS.index(w)) for w in words[:4]]
  assert "".join(pieces) == "the cats " and (text.stopped, text.stop_string) == (True, "cat")
  with pytest.raises(RuntimeError, match="after its stop string"):
    text = CompletionText(tok, ("the",))
    text.add(0)
    assert text.stopped
    text.add(1)


def test_special_tokens_are_left_out_of_the_text_unless_asked_to_stay():
  # A byte-level tokenizer with two special tokens (ids 256, 257): skipped, the text is the
  # ordinary bytes' and a stop string naming a special token never matches; kept (a chat
  # format's markers), they are in the text, streamed, and a stop string can end there.
  tok = _byte_level()
  tok.add_special_tokens(["<|end|>", "<|channel|>"])
  special = tok.token_to_id("<|channel|>"), tok.token_to_id("<|end|>")
  assert special == (257, 256)
  ids = [special[0], *b"hi ", special[1], *b"ok"]
  for skip, want in ((True, "hi ok"), (False, "<|channel|>hi <|end|>ok")):
    assert want == tok.decode(ids, skip_special_tokens=skip)
    text = CompletionText(tok, skip_special_tokens=skip)
    pieces = [text.add(t) for t in ids] + [text.finish()]
    assert "".join(pieces) == want and pieces[0] == ("" if skip else "<|channel|>")
    text, shown = CompletionText(tok, ("<|end|>",), skip_special_tokens=skip), ""
    for taken, t in enumerate(ids, 1):
      shown += text.add(t)
      if text.stopped:
        break
    shown += text.finish()
    assert (shown, taken) == (("hi ok", 7) if skip else ("<|channel|>hi ", 5))


def test_a_truncated_text_keeps_the_special_tokens_around_it():
  # BOS and EOS around every text (ids 1 and 2): the last k - 2 of the text's own between
  # them; token ids are cut as given; a text short enough is whole.
  from tokenizers import processors
  tok = _metaspace()
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<s>", "</s>"])
  bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
  text = "▁the ▁cat ▁sat ▁on ▁the ▁mat ."
  ids = tok.encode(text).ids
  assert ids[0] == bos and ids[-1] == eos and len(ids) == 9
  encode = lambda prompt, k: list(encode_prompt(0, prompt, tokenizer=tok, vocab_size=64,
                                                max_model_len=32, limit_note="",
                                                keep_last=k))
  assert encode(text, 5) == [bos, *ids[-4:-1], eos]
  assert encode(text, 9) == encode(text, 20) == encode(text, None) == ids
  assert encode(ids, 5) == ids[-5:]
  with pytest.raises(ValueError, match=r"truncate_prompt_tokens=2 keeps no token of the text "
                                       r"beside the 2 special tokens"):
    encode(text, 2)
  # A text whose own first token is the EOS: the BOS before it and the EOS after it are
  # the added ones (an empty text's [BOS, EOS] would match at the start).
  ids = tok.encode("</s> ▁the ▁cat").ids
  assert ids == [bos, eos, 0, 1, eos]
  assert encode("</s> ▁the ▁cat", 4) == [bos, 0, 1, eos]
