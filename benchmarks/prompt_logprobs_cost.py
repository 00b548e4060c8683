"""Cost of ``SamplingParams.prompt_logprobs``: prompt tokens scored per second, with and
without it, on one engine.

While a request that asks for prompt log-probs is prefilling, the engine runs the scoring
variant of its step: the forward computes the logits of every row (T x V, not one row per
sequence), a log-softmax and (when a request asks for k > 0) a top-k over them, and the
device call ends after 4 steps that scored a prompt token (its report holds their rows,
``scoring.SCORED_STEPS``), so such a prefill costs a host round trip per 4 steps. This
measures a scoring workload (every request asks, one token generated each: perplexity or
ranking) against the same requests without prompt log-probs: ``--requests`` prompts of
random length in [32, 256), greedy, on a random Llama of 2 layers (H = 4, K = 2, D = 16)
of the table's width E and vocabulary V, impl "xla",
block size 16, max_seqs 16, max_model_len 1024, 256 tokens per step, prefix caching on,
each ``generate`` under a ``cache_salt`` of its own (no run finds an earlier one's
blocks: every prompt is computed whole, as the scored ones are anyway). Each
figure is the median of ``--repeats`` timed ``generate`` calls after a warm-up (the
compile), the variants alternated so load from other jobs hits each alike. A last row
serves a quarter of the requests on SmolLM2-135M's shape (30 layers), where the head is
a smaller share of the prefill than in the 2-layer rows.

    python benchmarks/prompt_logprobs_cost.py          # four models; writes
                                                       # prompt_logprobs_RESULTS_section.md
    python benchmarks/prompt_logprobs_cost.py --quick  # V = 128, few requests; never writes
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 1024
VARIANTS = {"none": None, "prompt_logprobs=0": 0, "prompt_logprobs=20": 20}


SMOLLM2 = dict(num_layers=30, mlp_dim=1536, num_heads=9, num_kv_heads=3, head_dim=64)
"""SmolLM2-135M's decoder shape (with E = 576, V = 49152): the head's share of a real
model's prefill."""


def measure(width: int, vocab: int, requests: int, repeats: int, seed: int = 0,
            **shape) -> dict:
  shape = dict(dict(num_layers=2, mlp_dim=96, num_heads=4, num_kv_heads=2, head_dim=16),
               **shape)
  config = ModelConfig(model_type="llama", vocab_size=vocab, embed_dim=width,
                       max_seq_len=MAX_MODEL_LEN, eos_token_ids=(2,), **shape)
  model = init_random(config, seed=seed, impl="xla")
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(3, vocab, int(n))]
             for n in rng.integers(32, 256, requests)]
  llm = LLM(model, config, block_size=16, num_blocks=16 * MAX_MODEL_LEN // 16, max_seqs=16,
            max_tokens_per_step=256, steps_per_call=16)
  params = {name: SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=k)
            for name, k in VARIANTS.items()}
  runs = iter(range(1 << 30))  # each generate's own cache salt
  serve = lambda p: llm.generate(prompts, p, cache_salt=f"run {next(runs)}")
  outs = {name: serve(p) for name, p in params.items()}  # warm-up: compile
  assert all(o.prompt_logprobs is None for o in outs["none"])
  for name in ("prompt_logprobs=0", "prompt_logprobs=20"):
    assert all(len(o.prompt_logprobs) == len(p) and None not in o.prompt_logprobs[1:]
               for o, p in zip(outs[name], prompts)), f"{name}: a prompt token unscored"
    assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["none"]]
  scored = sum(len(p) - 1 for p in prompts)
  rates, calls = {name: [] for name in params}, {}
  for _ in range(repeats):
    for name, p in params.items():
      llm.reset_stats()
      t0 = time.perf_counter()
      serve(p)
      rates[name].append(scored / (time.perf_counter() - t0))
      calls[name] = llm.stats["device_calls"]
      assert llm.stats["prefix_hit_rate"] == 0, f"{name}: a prompt found cached blocks"
  row = {name: statistics.median(r) for name, r in rates.items()}
  return dict(width=width, vocab=vocab, layers=shape["num_layers"], calls=calls, **row)


def table(rows) -> str:
  lines = ["| layers | E | V | prompt tokens/s, none | prompt_logprobs=0 | cost | "
           "prompt_logprobs=20 | cost | device calls (none / 0 / 20) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    cost = lambda name: f"{100 * (1 - r[name] / r['none']):+.1f}%"
    c = r["calls"]
    lines.append(f"| {r['layers']} | {r['width']} | {r['vocab']} | {r['none']:.0f} | "
                 f"{r['prompt_logprobs=0']:.0f} | {cost('prompt_logprobs=0')} | "
                 f"{r['prompt_logprobs=20']:.0f} | {cost('prompt_logprobs=20')} | "
                 f"{c['none']} / {c['prompt_logprobs=0']} / {c['prompt_logprobs=20']} |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  shapes = ((64, 128),) if args.quick else ((64, 128), (64, 32768), (576, 49152))
  repeats = 1 if args.quick else args.repeats
  requests = 6 if args.quick else args.requests
  rows = [measure(e, v, requests, repeats) for e, v in shapes]
  if not args.quick:  # fewer requests: 30 layers of E = 576 on CPU
    rows.append(measure(576, 49152, max(1, requests // 4), max(1, repeats // 2), **SMOLLM2))
  text = table(rows)
  print(text)
  if not args.quick:
    where = (f"{jax.default_backend()} ({platform.processor() or platform.machine()}), "
             f"jax {jax.__version__}")
    section = (
        "## Prompt log-probs (`benchmarks/prompt_logprobs_cost.py`)\n\n"
        f"`python benchmarks/prompt_logprobs_cost.py` on {where}: {requests} requests "
        "(prompts of 32-255 tokens, 1 generated, greedy), random Llama (2 layers) of width "
        f"E and vocabulary V, max_seqs 16, max_model_len {MAX_MODEL_LEN}, T = 256, one "
        f"engine, median of {repeats} timed runs per variant; the last row SmolLM2-135M's "
        f"shape (30 layers, random weights), {max(1, requests // 4)} requests, median of "
        f"{max(1, repeats // 2)}: prompt tokens scored per "
        "second (wall time of `generate`). \"none\": the same requests without "
        "prompt_logprobs (the same prefill, one logits row per sequence); "
        "\"prompt_logprobs=k\": every request asks (every row's logits, a log-softmax "
        "and a top-k over them, at most 4 scoring steps per device call).\n\n"
        + text + "\n")
    out = pathlib.Path(__file__).with_name("prompt_logprobs_RESULTS_section.md")
    out.write_text(section)
    print(f"wrote {out}")
  return rows


if __name__ == "__main__":
  main()
