"""Prefix caching on and off on shared-prefix workloads: throughput and hit rate.

Workloads (``WORKLOADS`` below; ``--quick`` is smaller): every request's prompt is one shared
prefix (few-shot examples, a system prompt) followed by its own suffix, as in the vLLM
paper's translation workload with a one-shot (80-token) and a five-shot (341-token) prefix.
Suffix and output lengths are log-normal, ``round(median * exp(sigma * N(0, 1)))`` clipped
to ``[1, max]`` (``paged_jax.workload``'s distribution); token ids are uniform in
``[3, vocab)``; numpy seed 0. All requests are queued at once and decoded greedily with
``ignore_eos`` (outputs have exactly the drawn length).

Engine: the embedded tiny Llama of ``paged-jax run`` (2 layers, width 128, vocab 256,
float32, seeded random weights), block size 16, 512 blocks, 16 sequences at once, 512
tokens a step, 32 steps a device call, impl "auto". Each timed run gets a fresh engine (an
empty cache; the step is compiled once beforehand and shared), the cache on and off
alternate, and the median of the repeats is reported. Speedup = requests/s with the cache on
over off, measured side by side in one run.

``--hybrid``: the same workloads on a hybrid model with KV groups: the tiny Llama at 6
layers in Gemma 3's pattern (5 sliding layers of window 64 to 1 full), its pool sized by
``kv_budget_bytes`` to 512 blocks of all 6 layers, so the sliding layers give blocks back
(``free_outside_window``) and a hit needs each sliding group's blocks of the window at
its end.

    python benchmarks/prefix_cache.py            # full; writes prefix_cache_RESULTS_section.md
    python benchmarks/prefix_cache.py --hybrid   # the hybrid model; prints, never writes
    python benchmarks/prefix_cache.py --together # 16 prompts admitted at once; prints
    python benchmarks/prefix_cache.py --quick    # seconds; never writes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np

HERE = pathlib.Path(__file__).parent
RESULTS_PATH = HERE / "prefix_cache_RESULTS_section.md"


@dataclasses.dataclass(frozen=True)
class PrefixWorkload:
  name: str
  shared_len: int  # tokens of the prefix every prompt starts with
  num_requests: int
  suffix_median: int
  suffix_sigma: float
  suffix_max: int
  output_median: int
  output_sigma: float
  output_max: int
  seed: int = 0


WORKLOADS = (
    PrefixWorkload("one-shot (80-token prefix)", 80, 48, 24, 0.6, 64, 16, 0.6, 48),
    PrefixWorkload("five-shot (341-token prefix)", 341, 48, 24, 0.6, 64, 16, 0.6, 48),
)
QUICK_WORKLOADS = (PrefixWorkload("quick (40-token prefix)", 40, 6, 8, 0.5, 16, 4, 0.5, 8),)
# --together: every prompt admitted in the first step (a budget of 2048 tokens).
TOGETHER_WORKLOADS = (
    PrefixWorkload("16 at once (100-token prefix)", 100, 16, 10, 0.0, 10, 4, 0.0, 4),)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  block_size: int = 16
  num_blocks: int | None = 512
  kv_budget_bytes: int | None = None
  max_seqs: int = 16
  max_tokens_per_step: int = 512
  steps_per_call: int = 32


QUICK_ENGINE = EngineOptions(num_blocks=64, max_seqs=4, max_tokens_per_step=32,
                             steps_per_call=8)


def make_requests(w: PrefixWorkload, vocab_size: int):
  from paged_jax.sampling import SamplingParams
  rng = np.random.default_rng(w.seed)

  def lengths(median, sigma, max_len):
    draw = median * np.exp(sigma * rng.standard_normal(w.num_requests))
    return np.clip(np.round(draw), 1, max_len).astype(np.int64)

  suffix_R = lengths(w.suffix_median, w.suffix_sigma, w.suffix_max)
  output_R = lengths(w.output_median, w.output_sigma, w.output_max)
  shared = [int(t) for t in rng.integers(3, vocab_size, w.shared_len)]
  prompts = [shared + [int(t) for t in rng.integers(3, vocab_size, n)] for n in suffix_R]
  params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in output_R]
  return prompts, params


def serve_once(model, config, opts: EngineOptions, prompts, params, *, caching: bool):
  """One timed run on a fresh engine: (requests/s, generated tokens/s, hit rate, outputs)."""
  from paged_jax import LLM
  llm = LLM(model, config, enable_prefix_caching=caching, **dataclasses.asdict(opts))
  if opts.kv_budget_bytes is not None:  # --hybrid: the sliding groups give blocks back
    assert llm.kv_groups.slides and llm.stats["prefix_caching"] == caching
  start = time.perf_counter()
  outs = llm.generate(prompts, params)
  wall = time.perf_counter() - start
  tokens = sum(len(o.token_ids) for o in outs)
  return (len(prompts) / wall, tokens / wall, llm.stats["prefix_hit_rate"],
          [o.token_ids for o in outs], llm.stats["peak_blocks_in_use"])


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small workload, seconds; no files")
  parser.add_argument("--repeats", type=int, default=None, help="timed runs per mode")
  parser.add_argument("--hybrid", action="store_true",
                      help="a 6-layer model of 5 sliding layers (window 64) to 1 full, KV groups")
  parser.add_argument("--together", action="store_true",
                      help="16 prompts admitted in one step (256 blocks, 2048 tokens a step)")
  args = parser.parse_args(argv)
  from paged_jax.models import ModelConfig, init_random
  from paged_jax.models.config import FULL, SLIDING
  from paged_jax.cli_run import TINY_LLAMA
  workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
  opts = QUICK_ENGINE if args.quick else EngineOptions()
  if args.together:
    workloads = TOGETHER_WORKLOADS
    opts = EngineOptions(num_blocks=256, max_tokens_per_step=2048)
  if args.hybrid:
    config = ModelConfig(**{**TINY_LLAMA, "num_layers": 6, "sliding_window": 64,
                            "layer_types": (SLIDING,) * 5 + (FULL,)})
    token_layer_bytes = 2 * config.num_kv_heads * config.head_dim * 4  # K and V, float32
    opts = dataclasses.replace(
        opts, num_blocks=None,
        kv_budget_bytes=opts.num_blocks * opts.block_size * config.num_layers * token_layer_bytes)
  else:
    config = ModelConfig(**TINY_LLAMA)
  model = init_random(config, seed=0)
  repeats = args.repeats or (1 if args.quick else 3)
  rows = []
  for w in workloads:
    prompts, params = make_requests(w, config.vocab_size)
    warm = len(prompts) if args.together else 2  # every bucket it will use
    for caching in (False, True):  # compile both steps outside the timing
      serve_once(model, config, opts, prompts[:warm], params[:warm], caching=caching)
    runs = {False: [], True: []}
    for _ in range(repeats):
      for caching in (False, True):
        runs[caching].append(serve_once(model, config, opts, prompts, params,
                                        caching=caching))
    same = all(r[3] == runs[False][0][3] for r in runs[False] + runs[True])
    med = {c: [statistics.median(r[i] for r in runs[c]) for i in range(3)] for c in runs}
    prompt_tokens = sum(len(p) for p in prompts)
    rows.append(dict(workload=w.name, requests=w.num_requests,
                     mean_prompt=prompt_tokens / len(prompts),
                     generated=sum(p.max_tokens for p in params),
                     off_req_s=med[False][0], on_req_s=med[True][0],
                     off_tok_s=med[False][1], on_tok_s=med[True][1],
                     hit_rate=med[True][2], speedup=med[True][0] / med[False][0],
                     outputs_equal=same, peak_off=runs[False][0][4], peak_on=runs[True][0][4]))
  lines = ["| workload | requests | mean prompt | generated tokens | req/s off | req/s on "
           "| tokens/s off | tokens/s on | prefix hit rate | speedup (on / off) "
           "| outputs equal | peak blocks off | peak blocks on |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['workload']} | {r['requests']} | {r['mean_prompt']:.0f} | "
                 f"{r['generated']} | {r['off_req_s']:.2f} | {r['on_req_s']:.2f} | "
                 f"{r['off_tok_s']:.0f} | {r['on_tok_s']:.0f} | {100 * r['hit_rate']:.1f}% | "
                 f"{r['speedup']:.2f}x | {'yes' if r['outputs_equal'] else 'NO'} | "
                 f"{r['peak_off']} | {r['peak_on']} |")
  table = "\n".join(lines)
  print(table)
  if not (args.quick or args.hybrid or args.together):
    machine = (f"{platform.machine()} CPU, {os.cpu_count()} cores visible (shared), jax "
               f"{jax.__version__}, backend {jax.default_backend()}")
    RESULTS_PATH.write_text(
        "## Prefix caching on and off (`benchmarks/prefix_cache.py`)\n\n"
        f"Command: `python benchmarks/prefix_cache.py`\n\nMachine: {machine}. Median of "
        f"{repeats} runs per mode, alternating, each on a fresh engine.\n\n{table}\n")
  return rows


if __name__ == "__main__":
  sys.exit(0 if all(r["outputs_equal"] for r in main()) else 1)
