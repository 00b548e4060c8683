"""Sliding window: pages the Pallas GPU kernel loads per query tile, against context.

With ``sliding_window=W`` an item (one query tile of one sequence) starts at the page
holding its first query's window start, so the pages it loads stay flat once the context
passes the window, where without a window they grow with the context. The counts come
from inside the kernel (``pallas_kernels.gpu.loaded_pages``: the same kernel and loop
bounds as ``ragged_paged_attention``, plus a counter of the pages whose slots it loads),
run in interpret mode on CPU; pages are per (item, KV head), summed over split-K pieces.

Two workloads per context C: a decode row (one query at position C - 1, Q = 1) and the
last 64-row chunk of a prefill (queries at C - 64 .. C - 1, in tiles of Q = 16 rows, the
mean and max over its 4 tiles). Z = 16, W = 256, 8 query heads on 1 KV head, D = 64,
the default tiling (split-K on).

Run:  python benchmarks/gpu_window_pages.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import gpu
from paged_jax.pallas_kernels.gpu import GpuTiling

CONTEXTS = (512, 1024, 2048, 4096, 8192)
QUICK_CONTEXTS = (512, 1024)
WINDOW = 256
BLOCK_SIZE = 16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 1, 64
PREFILL_ROWS, PREFILL_TILE = 64, 16


def one_sequence(context: int, q_len: int, seed: int = 0):
  """Positional kernel arguments: one sequence of ``context`` tokens whose last ``q_len``
  are queries, its pages shuffled in a pool with a few spare ones."""
  rng = np.random.default_rng(seed)
  pages = -(-context // BLOCK_SIZE)
  num_blocks = pages + 4
  shape = (1, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
  k = jnp.asarray(rng.standard_normal(shape, np.float32))
  v = jnp.asarray(rng.standard_normal(shape, np.float32))
  q = jnp.asarray(rng.standard_normal((q_len, NUM_Q_HEADS, HEAD_DIM), np.float32))
  table = rng.permutation(num_blocks)[:pages].astype(np.int32)[None, :]
  return (q, k, v, 0, jnp.array([context], jnp.int32), jnp.asarray(table),
          jnp.array([0, q_len], jnp.int32), jnp.int32(1))


def pages_per_tile(context: int, q_len: int, window: int | None, q_tile: int | None):
  """(mean, max, number of tiles) of the pages each live item loads (KV head 0)."""
  args = one_sequence(context, q_len)
  tiling = None
  if q_tile is not None:
    default = gpu.default_tiling_for(args[0], args[1], args[5], sliding_window=window)
    tiling = GpuTiling(q_tile=q_tile, pages_per_chunk=default.pages_per_chunk,
                       num_splits=default.num_splits, num_warps=default.num_warps,
                       num_stages=default.num_stages)
  pages_WK, _, live_W = gpu.loaded_pages(*args, sm_scale=HEAD_DIM ** -0.5,
                                         sliding_window=window, tiling=tiling)
  counts = np.asarray(pages_WK)[np.asarray(live_W), 0]
  return float(counts.mean()), int(counts.max()), int(counts.size)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="contexts 512 and 1k only")
  args = parser.parse_args(argv)
  contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
  rows = []
  for context in contexts:
    start = time.perf_counter()
    row = dict(context=context, context_pages=-(-context // BLOCK_SIZE))
    row["decode_window"] = pages_per_tile(context, 1, WINDOW, None)[1]
    row["decode_full"] = pages_per_tile(context, 1, None, None)[1]
    mean, peak, tiles = pages_per_tile(context, PREFILL_ROWS, WINDOW, PREFILL_TILE)
    row.update(prefill_window_mean=mean, prefill_window_max=peak, prefill_tiles=tiles)
    mean, peak, _ = pages_per_tile(context, PREFILL_ROWS, None, PREFILL_TILE)
    row.update(prefill_full_mean=mean, prefill_full_max=peak)
    row["seconds"] = time.perf_counter() - start
    rows.append(row)
    print(f"context {context}: {row}", file=sys.stderr)
  print(f"Pages loaded per (query tile, KV head); Z = {BLOCK_SIZE}, W = {WINDOW}, "
        f"H = {NUM_Q_HEADS}, K = {NUM_KV_HEADS}, D = {HEAD_DIM}, default tiling.\n")
  print("| context | pages in context | decode, W=256 | decode, no window | "
        f"prefill tile (Q={PREFILL_TILE}), W=256: mean / max | prefill tile, no window: "
        "mean / max |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['context']} | {r['context_pages']} | {r['decode_window']} | "
          f"{r['decode_full']} | {r['prefill_window_mean']:.2f} / {r['prefill_window_max']} | "
          f"{r['prefill_full_mean']:.2f} / {r['prefill_full_max']} |")
  return rows


if __name__ == "__main__":
  main()
