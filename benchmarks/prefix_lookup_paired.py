"""``allocator.lookup`` of two versions of the allocator, timed paired in one process: each
module loaded side by side on the same states, calls alternating, so a loaded machine
slows both alike (``prefix_lookup.py`` times one tree per run).

    git show 55f959a~1:paged_jax/allocator.py > /tmp/before.py
    python benchmarks/prefix_lookup_paired.py /tmp/before.py [--after PATH] [--calls 30]

Layouts as ``prefix_lookup.py``'s first three (N = 32768 blocks of Z = 16, S = 64, P = 512,
2000 tokens a sequence, every sequence looking its own tokens up); prints the median ms of
each and the ratio after / before.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = (("plain (1 full group)", (None,), False),
           ("plain, pool full of cached blocks", (None,), True),
           ("Gemma 3 pattern (5 sliding + 1 full)", (1024,) * 5 + (None,), False))
N, Z, S, P, SEQ_LEN = 32768, 16, 64, 512, 2000


def _load(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def _setup(alloc, windows, full_pool):
  per_seq = len(windows) * -(-SEQ_LEN // Z)
  n = S * per_seq if full_pool else N
  state = alloc.init(n, Z, S, P, windows=windows)
  live = min(S, n // per_seq)
  state, _ = jax.jit(alloc.append)(
      state, jnp.where(jnp.arange(S) < live, SEQ_LEN, 0).astype(jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 32000, (S, P * Z)), jnp.int32)
  state = jax.jit(alloc.register)(state, tokens)
  lookup, num_tokens = jax.jit(alloc.lookup), jnp.full(S, SEQ_LEN - 1, jnp.int32)
  jax.block_until_ready(lookup(state, tokens, num_tokens))  # compile
  return lambda: jax.block_until_ready(lookup(state, tokens, num_tokens))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("before", help="an allocator.py to compare")
  parser.add_argument("--after", default=os.path.join(ROOT, "paged_jax", "allocator.py"))
  parser.add_argument("--calls", type=int, default=30)
  args = parser.parse_args(argv)
  mods = {"before": _load("_alloc_before", args.before), "after": _load("_alloc_after", args.after)}
  print("| layout | before (ms) | after (ms) | after / before |\n|---|---:|---:|---:|")
  for name, windows, full_pool in LAYOUTS:
    calls = {k: _setup(m, windows, full_pool) for k, m in mods.items()}
    times = {k: [] for k in calls}
    for r in range(args.calls):
      for k in (("before", "after") if r % 2 == 0 else ("after", "before")):
        t0 = time.perf_counter()
        calls[k]()
        times[k].append(time.perf_counter() - t0)
    b, a = (statistics.median(times[k]) * 1e3 for k in ("before", "after"))
    print(f"| {name} | {b:.2f} | {a:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
  main()
