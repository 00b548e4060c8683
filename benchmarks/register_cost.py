"""The cost of ``allocator.register`` in a serving step: every sequence extends its own
registered chain by one full block (the common case), and a step that fills no block.

S = 64 sequences of 40 registered blocks each (Z = 16, P = 64) in a pool of N blocks; the
jitted ``register`` after an ``append`` of Z tokens each (one new full block per
sequence), and after an ``append`` of 1 token each (no new full block). Median of
``--repeats`` calls, compiled beforehand.

    python benchmarks/register_cost.py            # N = 4096 and 32768
    python benchmarks/register_cost.py --quick    # N = 256, S = 4: seconds
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _median_ms(fn, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def measure(num_blocks: int, num_seqs: int, repeats: int) -> dict:
  import jax
  import jax.numpy as jnp

  from paged_jax import allocator

  z, p, levels = 16, 64, 40
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 30000, (num_seqs, p * z)),
                       jnp.int32)
  state = allocator.init(num_blocks, z, num_seqs, p)
  state, ok = allocator.append(state, jnp.full(num_seqs, levels * z, jnp.int32))
  assert bool(ok.all()), "the pool must hold every sequence's chain"
  register, append = jax.jit(allocator.register), jax.jit(allocator.append)
  state = register(state, tokens)
  filled, ok = append(state, jnp.full(num_seqs, z, jnp.int32))
  assert bool(ok.all())
  decoding, _ = append(state, jnp.full(num_seqs, 1, jnp.int32))
  new_ms = _median_ms(lambda: register(filled, tokens), repeats)
  none_ms = _median_ms(lambda: register(decoding, tokens), repeats)
  after = register(filled, tokens)
  grown = int(jnp.sum(after.depth_N >= 0) - jnp.sum(state.depth_N >= 0))
  assert grown == num_seqs, grown  # one new entry per sequence, none twice
  return dict(num_blocks=num_blocks, num_seqs=num_seqs, new_block_ms=new_ms,
              no_block_ms=none_ms)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  import jax
  cases = [(256, 4)] if args.quick else [(4096, 64), (32768, 64)]
  rows = [measure(n, s, args.repeats) for n, s in cases]
  print("| N blocks | sequences | register, one new block each (ms) | register, none (ms) |")
  print("|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['num_blocks']} | {r['num_seqs']} | {r['new_block_ms']:.2f} | "
          f"{r['no_block_ms']:.2f} |")
  print(f"(Z = 16, P = 64, 40 registered blocks per sequence; median of {args.repeats}; "
        f"jax {jax.__version__}, {jax.default_backend()})")
  return rows


if __name__ == "__main__":
  main()
