"""Cost of taking blocks from a pool that has cycled with the prefix cache on.

With the prefix cache on (the default), a full block stays registered after its sequence
ends: free but *cached*, ordered behind the unregistered free blocks by the stamp it was
freed at, then its chain depth. Once the pool has cycled, nearly every free block is
cached, freed under its own stamp, so the oldest unregistered free blocks (``_take``'s
prefix-sum path) never suffice and every step that takes a block used to sort the whole
pool. Stop 41 finds the taken set in O(N) passes and sorts only it (``_select``) unless a
call takes more than ``_SELECT_MAX`` blocks (a pool of at most ``_SORT_SMALL_POOL`` blocks
is still sorted: it costs little, and compiles faster).

Two tables, each measured side by side in one run:
- ``allocator.append`` taking k blocks (one token for each of k empty sequences): on a
  fresh pool (prefix sums), on a cycled pool (every block cached: chains of 16 blocks,
  each freed under its own stamp, in a random place of the pool) with the whole-pool sort
  forced (``_SELECT_MAX = 1``, the old cost) and as ``_take`` runs it now; the two cycled
  results are checked equal.
- ``LLM.generate`` tokens/s on a tiny random Llama (2 layers, E=64, K=1, D=32, blocks of
  16) for 64 staggered decodes (prompts of 8-71 tokens, 64 new tokens each; new prompts
  each round) on a fresh engine and on one whose pool was first cycled by prompts of 2000
  tokens (every block cached), best of ``--repeats``; the outputs are checked equal.

    python benchmarks/cycled_pool.py            # N = 4096, 32768; engine at N = 32768
    python benchmarks/cycled_pool.py --quick    # N = 2048; engine at N = 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import allocator  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402
from benchmarks.pool_size import _median_ms  # noqa: E402

BLOCK, SEQS, CHAIN = 16, 64, 16


def cycled_state(num_blocks: int, max_blocks_per_seq: int, seed: int = 0):
  """Every block free and cached: chains of CHAIN blocks (depths 0..15), each chain freed
  under its own stamp, its blocks in random places of the pool."""
  state = allocator.init(num_blocks, BLOCK, SEQS, max_blocks_per_seq)
  place_N = np.random.default_rng(seed).permutation(num_blocks)
  depth_N, stamp_N = np.empty(num_blocks, np.int32), np.empty(num_blocks, np.int32)
  depth_N[place_N] = np.arange(num_blocks) % CHAIN
  stamp_N[place_N] = 1 + np.arange(num_blocks) // CHAIN
  return dataclasses.replace(state, depth_N=jnp.asarray(depth_N),
                             last_used=jnp.asarray(stamp_N), clock=jnp.int32(num_blocks))


def append_rows(sizes, takes, rounds: int) -> list[dict]:
  keep = allocator._SELECT_MAX
  rows = []
  for num_blocks in sizes:
    fresh, cycled = allocator.init(num_blocks, BLOCK, SEQS, 64), cycled_state(num_blocks, 64)
    now = jax.jit(allocator.append)
    allocator._SELECT_MAX = 1
    try:
      sort = jax.jit(lambda s, n: allocator.append(s, n)).lower(
          cycled, jnp.zeros(SEQS, jnp.int32)).compile()
    finally:
      allocator._SELECT_MAX = keep
    for k in takes:
      need = jnp.zeros(SEQS, jnp.int32).at[:k].set(1)
      a, b = sort(cycled, need)[0], now(cycled, need)[0]
      assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
      cases = {"fresh": lambda: now(fresh, need), "sort": lambda: sort(cycled, need),
               "select": lambda: now(cycled, need)}
      for fn in cases.values():
        jax.block_until_ready(fn())
      ms = {name: [] for name in cases}
      for _ in range(rounds):  # interleaved: the machine's noise hits every case alike
        for name, fn in cases.items():
          ms[name].append(_median_ms(fn, 3))
      row = dict(N=num_blocks, k=k, **{name: statistics.median(v) for name, v in ms.items()})
      rows.append(row)
      print(f"| {num_blocks:>6} | {k:>3} | {row['fresh']:.2f} | {row['sort']:.2f} | "
            f"{row['select']:.2f} | {row['sort'] / row['select']:.1f}x |", flush=True)
  return rows


def engine_rows(num_blocks: int, repeats: int) -> list[dict]:
  config = ModelConfig(model_type="llama", vocab_size=256, embed_dim=64, mlp_dim=128,
                       num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                       max_seq_len=4096, eos_token_ids=(2,))
  model = init_random(config, seed=0)
  options = dict(block_size=BLOCK, num_blocks=num_blocks, max_seqs=SEQS,
                 max_tokens_per_step=2048, token_buckets=(SEQS, 2048), max_model_len=2048)
  rng = np.random.default_rng(3)
  decodes = lambda: [[int(t) for t in rng.integers(3, 256, 8 + i)] for i in range(SEQS)]
  params = SamplingParams(max_tokens=64, ignore_eos=True)
  fresh, cycled = LLM(model, config, **options), LLM(model, config, **options)
  prompts = num_blocks * BLOCK // 2000 + SEQS // 2  # more tokens than the pool holds
  for i in range(0, prompts, SEQS):
    cycled.generate([[int(t) for t in rng.integers(3, 256, 2000)]
                     for _ in range(min(SEQS, prompts - i))],
                    SamplingParams(max_tokens=1, ignore_eos=True))
  cached = int(cycled.stats["cached_blocks"])
  for llm in (fresh, cycled):  # compiles; the cycled pool's blocks stay cached (new prompts)
    llm.generate(decodes(), params)
  best = {"fresh": float("inf"), "cycled": float("inf")}
  for _ in range(repeats):
    # New prompts each round, as a server sees: a repeated batch would find its own blocks
    # cached, register none, and leave unregistered free blocks behind (the cheap path).
    batch, outputs = decodes(), {}
    for name, llm in (("fresh", fresh), ("cycled", cycled)):
      t0 = time.perf_counter()
      outputs[name] = [o.token_ids for o in llm.generate(batch, params)]
      best[name] = min(best[name], time.perf_counter() - t0)
    assert outputs["fresh"] == outputs["cycled"]
  tokens = SEQS * 64
  row = dict(N=num_blocks, cached=cached, fresh=tokens / best["fresh"],
             cycled=tokens / best["cycled"])
  print(f"| {num_blocks:>6} | {cached:>6} | {row['fresh']:.0f} | {row['cycled']:.0f} | "
        f"{row['cycled'] / row['fresh']:.2f} |", flush=True)
  return [row]


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small pools, few rounds")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  sizes, engine_blocks = ((2048,), 2048) if args.quick else ((4096, 32768), 32768)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; _SELECT_MAX = "
        f"{allocator._SELECT_MAX}; medians of {args.repeats} interleaved rounds")
  print("| N | k | fresh pool, ms | cycled, whole-pool sort, ms | cycled, now, ms | "
        "speed-up |")
  print("|---:|---:|---:|---:|---:|---:|")
  rows = append_rows(sizes, (4, 64), args.repeats)
  print(f"\n| N | cached blocks | fresh engine, tokens/s | cycled engine, tokens/s | "
        f"cycled / fresh |")
  print("|---:|---:|---:|---:|---:|")
  return rows + engine_rows(engine_blocks, args.repeats)


if __name__ == "__main__":
  main()
