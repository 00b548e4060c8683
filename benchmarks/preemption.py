"""Serving under block pressure: preemptions, recomputed tokens and time.

A pool too small for the requests in flight makes the engine preempt (by recompute). This
measures what that costs: the tokens the forward ran (``computed``, counted by a callback
around ``paged_jax.step.forward_step`` in a run of its own, not the timed ones), the useful
ones (each prompt once, less its first prefix hit, and each generated token but the last),
the preemptions, steps and the median wall time of fresh engines (compiled beforehand).

Workloads (``paged_jax.workload``, greedy, ``ignore_eos``): "long mix", 24 requests of
median prompt 120 (at most 400) and output 60 (at most 200), seed 1, on 40 blocks of 16,
8 slots, 128 tokens a step; "main job", ``paged-jax run``'s 64 requests (here with
``ignore_eos``) on 28 blocks of 16, ``LLM``'s defaults otherwise.
The embedded tiny Llama of ``paged-jax run``. To compare two commits, run this file with
``PYTHONPATH`` set to each tree in turn (it uses only the public API and the step API).

    python benchmarks/preemption.py            # 3 timed runs per row
    python benchmarks/preemption.py --quick    # one workload, one run
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
import zlib

import jax
import jax.numpy as jnp

WORKLOADS = {  # name: (Workload kwargs, engine kwargs)
    "long mix": (dict(num_requests=24, prompt_median=120, max_prompt_len=400,
                      output_median=60, max_output_len=200, seed=1),
                 dict(num_blocks=40, block_size=16, max_seqs=8, max_tokens_per_step=128,
                      token_buckets=(128,), steps_per_call=64)),
    "main job": (dict(), dict(num_blocks=28)),
}


def _requests(workload: dict):
  from paged_jax import SamplingParams
  from paged_jax.workload import Workload, make_requests
  prompts, params = make_requests(Workload(**workload))
  return prompts, [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params]


def _engine(engine: dict, caching: bool):
  from paged_jax import LLM
  from paged_jax.cli_run import TINY_LLAMA
  from paged_jax.models import ModelConfig, init_random
  config = ModelConfig(**TINY_LLAMA)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # max_model_len capped by the small pool: intended
    return LLM(init_random(config, seed=0), config, enable_prefix_caching=caching, **engine)


def _computed_tokens(workload: dict, engine: dict, caching: bool) -> int:
  """Tokens the forward ran over a whole serve (prefill chunks and decode rows)."""
  from paged_jax import step as step_api
  total = [0]
  inner = step_api.forward_step

  def counted(model, alloc, cache, tokens_T, num_new_S, **kwargs):
    jax.debug.callback(lambda n: total.__setitem__(0, total[0] + int(n)), jnp.sum(num_new_S))
    return inner(model, alloc, cache, tokens_T, num_new_S, **kwargs)

  step_api.forward_step = counted
  jax.clear_caches()  # traced again, with the callback (and without it after)
  try:
    llm = _engine(engine, caching)
    llm.generate(*_requests(workload))
  finally:
    step_api.forward_step = inner
    jax.clear_caches()
  return total[0]


def measure(name: str, caching: bool, repeats: int) -> dict:
  workload, engine = WORKLOADS[name]
  prompts, params = _requests(workload)
  walls, outs, llm = [], None, None
  for _ in range(repeats):
    llm = _engine(engine, caching)
    llm.precompile()
    start = time.perf_counter()
    got = [o.token_ids for o in llm.generate(prompts, params)]
    walls.append(time.perf_counter() - start)
    assert outs is None or got == outs, "outputs changed between runs"
    outs = got
  s = llm.stats
  useful = s["prompt_tokens"] - s["cached_prompt_tokens"] + s["generated_tokens"] - len(outs)
  return dict(workload=name, caching=caching, preemptions=s["preemptions"], steps=s["steps"],
              computed=_computed_tokens(workload, engine, caching), useful=useful,
              wall=statistics.median(walls), outputs=zlib.crc32(str(outs).encode()))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="one workload, one run")
  args = parser.parse_args(argv)
  rows = [measure(name, caching, 1 if args.quick else 3)
          for name in (["long mix"] if args.quick else WORKLOADS)
          for caching in ((True,) if args.quick else (True, False))]
  print("| workload | prefix cache | preemptions | steps | tokens computed | useful "
        "| recomputed | wall s (median) | outputs hash |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---|")
  for r in rows:
    print(f"| {r['workload']} | {'on' if r['caching'] else 'off'} | {r['preemptions']} | "
          f"{r['steps']} | {r['computed']} | {r['useful']} | {r['computed'] - r['useful']} | "
          f"{r['wall']:.3f} | {r['outputs'] & 0xFFFF:04x} |")
  return rows


if __name__ == "__main__":
  main()
