"""Cost of ``LLM(..., scrub_on_release=True)``: serving tokens/s with and without scrubbing.

Scrub on release zeroes every KV block inside the step that frees it (a finished request, a
preempted one), one masked pass over the pool (``jnp.where``, in place under donation)
behind a ``lax.cond`` so steps that free nothing skip it. The workload: ``--requests``
prompts of random length in [8, 64), ``max_tokens`` in [8, 32), greedy, ignore_eos, on a tiny
random Llama (2 layers, E=64, H=4, K=2, D=16, impl "xla"), block size 16, ``--num-blocks``
blocks, max_seqs 8, 128 tokens per step. Both engines serve the identical workload (the
outputs are checked equal); each figure is the median tokens/s of ``--repeats`` timed
``generate`` calls after one warm-up call (the compile), alternating the two engines so
load from other jobs hits both alike. The pool size sets the scrub's cost: it touches the
whole pool in every step that frees a block.

    python benchmarks/scrub_cost.py            # pools of 256, 2048, 8192 blocks; writes
                                               # scrub_RESULTS_section.md
    python benchmarks/scrub_cost.py --quick    # one small pool, few repeats; never writes
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

TINY = dict(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=128, eos_token_ids=(2,))


def workload(num_requests: int, seed: int):
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(3, 128, int(n))]
             for n in rng.integers(8, 64, num_requests)]
  params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
            for m in rng.integers(8, 32, num_requests)]
  return prompts, params


def measure(num_blocks: int, requests: int, repeats: int, seed: int = 0) -> dict:
  config = ModelConfig(**TINY)
  model = init_random(config, seed=seed, impl="xla")
  prompts, params = workload(requests, seed)
  engines = {scrub: LLM(model, config, block_size=16, num_blocks=num_blocks, max_seqs=8,
                        max_tokens_per_step=128, steps_per_call=16, scrub_on_release=scrub)
             for scrub in (False, True)}
  outs = {scrub: [o.token_ids for o in llm.generate(prompts, params)]  # warm-up: compile
          for scrub, llm in engines.items()}
  assert outs[False] == outs[True], "scrubbing changed the outputs"
  rates = {False: [], True: []}
  for _ in range(repeats):
    for scrub, llm in engines.items():
      llm.reset_stats()
      llm.generate(prompts, params)
      rates[scrub].append(llm.stats["tokens_per_s"])
  off, on = statistics.median(rates[False]), statistics.median(rates[True])
  pool_mib = engines[True].spec.total_bytes / 2 ** 20
  return dict(num_blocks=num_blocks, pool_mib=pool_mib, off=off, on=on,
              cost=1.0 - on / off)


def table(rows) -> str:
  lines = ["| blocks | pool (MiB) | tokens/s, no scrub | tokens/s, scrub | cost |",
           "|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['num_blocks']} | {r['pool_mib']:.2f} | {r['off']:.0f} | {r['on']:.0f} "
                 f"| {100 * r['cost']:+.1f}% |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  pools = (128,) if args.quick else (256, 2048, 8192)
  repeats = 2 if args.quick else args.repeats
  requests = 12 if args.quick else args.requests
  rows = [measure(n, requests, repeats) for n in pools]
  text = table(rows)
  print(text)
  if not args.quick:
    where = (f"{jax.default_backend()} ({platform.processor() or platform.machine()}), "
             f"jax {jax.__version__}")
    section = (
        "## Scrub on release\n\n"
        f"`python benchmarks/scrub_cost.py` on {where}: {requests} requests (prompts of "
        "8-63 tokens, 8-31 generated, greedy), tiny random Llama, block size 16, max_seqs 8, "
        f"T = 128, median of {repeats} timed runs per engine. Scrubbing zeroes each freed "
        "block in the step that frees it (one masked pass over the pool, skipped when no "
        "block is freed); outputs are identical.\n\n" + text + "\n")
    out = pathlib.Path(__file__).with_name("scrub_RESULTS_section.md")
    out.write_text(section)
    print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
