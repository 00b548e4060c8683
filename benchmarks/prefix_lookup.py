"""Prefix-cache ops with KV groups: the cost of ``allocator.lookup`` / ``register`` and
whether every hit comes back whole, as the number of groups grows.

One state per layout, N = 32768 blocks of Z = 16 tokens, S = 64 sequence slots, P = 512
blocks per sequence: one full group (a plain model), in that pool and in a pool exactly
full of the registered blocks (N = 8000: the hash table's heaviest load); Gemma 3's 5:1
pattern as six one-layer groups (five sliding, window 1024, one full); Gemma 3 27B's 62
layers (52 sliding, 10 full) as 31 groups of 2 layers (26 sliding, 5 full). As many
sequences as the pool holds (8 to 64) get 2000 random tokens each (125 full blocks in
every group) and register them;
then every sequence looks its own tokens up with ``num_tokens = 1999``: a whole hit is
124 levels (the last block is left to compute). Reported: the jitted ``register`` of the
whole prefill (one call), the median of ``--repeats`` jitted ``lookup`` calls (after a
compiling one), and the shortest hit.

    python benchmarks/prefix_lookup.py
    python benchmarks/prefix_lookup.py --quick    # N = 4096, seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paged_jax import allocator  # noqa: E402

LAYOUTS = (("plain (1 full group)", (None,), False),
           ("plain, pool full of cached blocks", (None,), True),
           ("Gemma 3 pattern (5 sliding + 1 full)", (1024,) * 5 + (None,), False),
           ("Gemma 3 27B (26 sliding + 5 full)", (1024,) * 26 + (None,) * 5, False))


def run(name, windows, *, num_blocks, block_size, max_seqs, blocks_per_seq, seq_len,
        repeats, full_pool=False):
  g = len(windows)
  per_seq = g * -(-seq_len // block_size)
  if full_pool:
    num_blocks = max_seqs * per_seq
  state = allocator.init(num_blocks, block_size, max_seqs, blocks_per_seq, windows=windows)
  live = min(max_seqs, num_blocks // per_seq)
  grow = jnp.where(jnp.arange(max_seqs) < live, seq_len, 0).astype(jnp.int32)
  state, ok = jax.jit(allocator.append)(state, grow)
  assert int(ok.sum()) == max_seqs, "the pool must hold every live sequence"
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 32000, (max_seqs, blocks_per_seq * block_size)),
                       jnp.int32)
  register, lookup = jax.jit(allocator.register), jax.jit(allocator.lookup)
  register(state, tokens)  # compile
  t0 = time.perf_counter()
  state = jax.block_until_ready(register(state, tokens))
  register_s = time.perf_counter() - t0
  num_tokens = jnp.where(jnp.arange(max_seqs) < live, seq_len - 1, 0).astype(jnp.int32)
  _, hits = jax.block_until_ready(lookup(state, tokens, num_tokens))  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _, hits = jax.block_until_ready(lookup(state, tokens, num_tokens))
    times.append(time.perf_counter() - t0)
  allocator.validate(state)
  whole = (seq_len - 1) // block_size
  return dict(layout=name, groups=g, blocks=num_blocks, sequences=live,
              register_ms=1e3 * register_s,
              lookup_ms=1e3 * statistics.median(times),
              shortest_hit=int(np.asarray(hits)[:live].min()), whole=whole)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a small pool; seconds")
  parser.add_argument("--repeats", type=int, default=5, help="lookup calls timed (default 5)")
  args = parser.parse_args(argv)
  sizes = dict(num_blocks=32768, block_size=16, max_seqs=64, blocks_per_seq=512, seq_len=2000)
  if args.quick:
    sizes = dict(num_blocks=4096, block_size=16, max_seqs=16, blocks_per_seq=64, seq_len=500)
  rows = [run(name, windows, repeats=args.repeats, full_pool=full, **sizes)
          for name, windows, full in LAYOUTS]
  print(f"N={sizes['num_blocks']} (unless full), Z={sizes['block_size']}, S={sizes['max_seqs']}, "
        f"P={sizes['blocks_per_seq']}, {sizes['seq_len']} tokens per sequence; jax "
        f"{jax.__version__} ({jax.default_backend()}), {platform.machine()}, "
        f"{os.cpu_count()} cores")
  print("| layout | groups | blocks | sequences | register (ms) | lookup (ms) "
        "| shortest hit / whole |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['layout']} | {r['groups']} | {r['blocks']} | {r['sequences']} | "
          f"{r['register_ms']:.0f} | "
          f"{r['lookup_ms']:.1f} | {r['shortest_hit']} / {r['whole']} |")
  return rows


if __name__ == "__main__":
  sys.exit(0 if all(r["shortest_hit"] == r["whole"] for r in main()) else 1)
