"""Cost of the repetition / presence / frequency penalties, ``min_tokens``, top logprobs, a
logit bias and allowed token ids: serving tokens/s of one engine with and without them.

The penalties are computed inside the jitted step from the token history the device keeps:
per step, two scatters of every slot's history (S x max_model_len ids), into [S, V] counts
and a mask of the ids seen, and a few passes over the [S, V] logits, in the branch of the
draw taken only when some row asks for a penalty; the ``min_tokens`` bar (of the stop
ids) is one small scatter and a pass, in the branch taken when some row is barred
(``paged_jax.sampling.sample``). Top logprobs (``top_logprobs`` = 20) rank the [S, V]
log-probs (``lax.top_k``) in a ``cond`` taken when some drawing row asks. A logit bias
(``logit_bias``, 300 ids) is a scatter of S x 300 biases into an [S, V] array and a pass,
in the bars' branch; allowed ids (``allowed_token_ids``, 300 ids) are the same scatter into
an array of -inf where a row allows only its ids.

The workload: ``--requests`` prompts of random length in [32, 256), 32 generated tokens
each, greedy, ignore_eos, on a random Llama of 2 layers (H = 4, K = 2, D = 16) of the
table's width E and vocabulary V, impl "xla", block size 16, max_seqs 16, max_model_len
1024, 256 tokens per step. E = 64 makes the [S, V] work large beside the model's; E = 576
with V = 49152 is SmolLM2-135M's head. One engine serves six variants of the same
requests (one compiled step): none; every request penalised (repetition 1.1, presence 0.5,
frequency 0.5); every request with stop id 2 and ``min_tokens`` = 32 (barred all along, no
penalty); every request with ``logprobs`` and ``top_logprobs`` = 20; every request with a
logit bias of -100 on 300 ids (3 .. 302, none of them drawn); every request allowed only
300 ids (V - 300 .. V - 1, nothing else drawn). Each figure is the median
tokens/s of ``--repeats`` timed ``generate`` calls after a warm-up (the compile), the
variants alternated so load from other jobs hits each alike.

    python benchmarks/penalty_cost.py          # four (E, V); writes
                                               # penalty_RESULTS_section.md
    python benchmarks/penalty_cost.py --quick  # V = 128, few requests; never writes
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 1024
VARIANTS = {
    "none": dict(),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "min_tokens": dict(min_tokens=32, stop_token_ids=(2,)),
    "top_logprobs": dict(logprobs=True, top_logprobs=20),
    "logit_bias": dict(),  # set per vocabulary: _banned
    "allowed": dict(),  # set per vocabulary: _allowed
}


def _banned(vocab: int) -> range:
  """The ids the "logit_bias" variant bans: 3 .. 302 (fewer in a vocabulary of < 606)."""
  return range(3, min(303, vocab // 2))


def _allowed(vocab: int) -> range:
  """The ids the "allowed" variant allows: the last 300 (the upper half in a small one)."""
  return range(max(vocab - 300, vocab // 2), vocab)


def measure(width: int, vocab: int, requests: int, repeats: int, seed: int = 0) -> dict:
  config = ModelConfig(model_type="llama", vocab_size=vocab, embed_dim=width, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=MAX_MODEL_LEN, eos_token_ids=(2,))
  model = init_random(config, seed=seed, impl="xla")
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(3, vocab, int(n))]
             for n in rng.integers(32, 256, requests)]
  llm = LLM(model, config, block_size=16, num_blocks=16 * MAX_MODEL_LEN // 16, max_seqs=16,
            max_tokens_per_step=256, steps_per_call=16)
  variants = dict(VARIANTS, logit_bias=dict(logit_bias={t: -100.0 for t in _banned(vocab)}),
                  allowed=dict(allowed_token_ids=_allowed(vocab)))
  params = {name: SamplingParams(max_tokens=32, ignore_eos=True, **kwargs)
            for name, kwargs in variants.items()}
  outs = {name: [o.token_ids for o in llm.generate(prompts, p)]  # warm-up: compile
          for name, p in params.items()}
  assert all(len(t) == 32 and 2 not in t for t in outs["min_tokens"]), "id 2 not barred"
  assert outs["top_logprobs"] == outs["none"], "top logprobs changed the tokens"
  assert not set(_banned(vocab)) & set(sum(outs["logit_bias"], [])), "an id of bias -100 drawn"
  assert set(sum(outs["allowed"], [])) <= set(_allowed(vocab)), "an id not allowed drawn"
  changed = sum(a != b for none, pen in zip(outs["none"], outs["penalties"])
                for a, b in zip(none, pen))
  rates = {name: [] for name in params}
  for _ in range(repeats):
    for name, p in params.items():
      llm.reset_stats()
      llm.generate(prompts, p)
      rates[name].append(llm.stats["tokens_per_s"])
  row = {name: statistics.median(r) for name, r in rates.items()}
  return dict(width=width, vocab=vocab, changed=changed / (32 * requests), **row)


def table(rows) -> str:
  lines = ["| E | V | tokens/s, none | tokens/s, penalties | cost | tokens/s, min_tokens | "
           "cost | tokens/s, top 20 logprobs | cost | tokens/s, logit bias | cost | "
           "tokens/s, allowed ids | cost | tokens the penalties changed |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cost = lambda name: f"{100 * (1 - r[name] / r['none']):+.1f}%"
    lines.append(f"| {r['width']} | {r['vocab']} | {r['none']:.0f} | {r['penalties']:.0f} | "
                 f"{cost('penalties')} | {r['min_tokens']:.0f} | {cost('min_tokens')} | "
                 f"{r['top_logprobs']:.0f} | {cost('top_logprobs')} | "
                 f"{r['logit_bias']:.0f} | {cost('logit_bias')} | "
                 f"{r['allowed']:.0f} | {cost('allowed')} | "
                 f"{100 * r['changed']:.0f}% |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  shapes = ((64, 128),) if args.quick else ((64, 128), (64, 32768), (64, 131072), (576, 49152))
  repeats = 1 if args.quick else args.repeats
  requests = 6 if args.quick else args.requests
  rows = [measure(e, v, requests, repeats) for e, v in shapes]
  text = table(rows)
  print(text)
  if not args.quick:
    where = (f"{jax.default_backend()} ({platform.processor() or platform.machine()}), "
             f"jax {jax.__version__}")
    section = (
        "## Penalties, min_tokens, top logprobs, logit bias and allowed ids "
        "(`benchmarks/penalty_cost.py`)\n\n"
        f"`python benchmarks/penalty_cost.py` on {where}: {requests} requests (prompts of "
        "32-255 tokens, 32 generated, greedy, ignore_eos), random Llama (2 layers) of width "
        f"E and vocabulary V, max_seqs 16, max_model_len {MAX_MODEL_LEN}, T = 256, one "
        f"engine, median of {repeats} timed runs per variant. \"penalties\": repetition "
        "1.1, presence 0.5, frequency 0.5 on every request; \"min_tokens\": stop id 2 "
        "and min_tokens 32 on every request (id 2 barred all along); \"top 20 logprobs\": "
        "logprobs and top_logprobs 20 on every request; \"logit bias\": -100 on ids 3-302 "
        "on every request; \"allowed ids\": allowed_token_ids of the last 300 ids on "
        "every request. The last "
        "column: generated tokens (by position) that differ from \"none\"'s.\n\n"
        + text + "\n")
    out = pathlib.Path(__file__).with_name("penalty_RESULTS_section.md")
    out.write_text(section)
    print(f"wrote {out}")
  return rows


if __name__ == "__main__":
  main()
