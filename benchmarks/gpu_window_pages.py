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

``--kernel mosaic``: the same for the Mosaic GPU kernel (``impl="pallas_mosaic_gpu"``),
counted by ``pallas_kernels.mosaic_gpu.copied_pages``: the same kernel and copy loop as
``ragged_paged_attention`` with a counter beside each TMA page copy it issues, run in the
Mosaic GPU interpret mode on CPU. bfloat16 queries and pages (the kernel's direct path),
the table and pool sized for 8k tokens at every context (one compile per column, the
default tiling of those shapes), J = 64; pages are per (item, KV head), summed over
split-K pieces, and each run's output is compared with the jnp reference.

Run:  python benchmarks/gpu_window_pages.py [--quick] [--kernel {triton,mosaic}]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import gpu
from paged_jax.pallas_kernels import mosaic_gpu
from paged_jax.pallas_kernels.gpu import GpuTiling
from paged_jax.pallas_kernels.mosaic_gpu import MosaicTiling
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference

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


def mosaic_sequence(context: int, q_len: int, seed: int = 0):
  """Like ``one_sequence`` in bfloat16, with the pool and table sized for the largest
  context whatever ``context`` is (same shapes, so one compile serves every context)."""
  rng = np.random.default_rng(seed)
  capacity = max(CONTEXTS) // BLOCK_SIZE
  num_blocks = capacity + 4
  shape = (1, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
  k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((q_len, NUM_Q_HEADS, HEAD_DIM), np.float32),
                  jnp.bfloat16)
  table = rng.permutation(num_blocks)[:capacity].astype(np.int32)[None, :]
  return (q, k, v, 0, jnp.array([context], jnp.int32), jnp.asarray(table),
          jnp.array([0, q_len], jnp.int32), jnp.int32(1))


def mosaic_pages_per_tile(context: int, q_len: int, window: int | None,
                          q_tile: int | None):
  """(mean, max, number of tiles, max abs error vs the reference) of the pages each live
  item of the Mosaic GPU kernel copies (KV head 0)."""
  args = mosaic_sequence(context, q_len)
  tiling = None
  if q_tile is not None:
    default = mosaic_gpu.default_tiling_for(args[0], args[1], args[5], sliding_window=window)
    tiling = MosaicTiling(q_tile=q_tile, chunk_size=default.chunk_size,
                          num_splits=default.num_splits, num_stages=default.num_stages)
  sm_scale = HEAD_DIM ** -0.5
  out, copied = mosaic_gpu.copied_pages(*args, sm_scale=sm_scale, sliding_window=window,
                                        tiling=tiling)
  counts = np.asarray(copied.pages_WK)[np.asarray(copied.live_W), 0]
  ref = ragged_paged_attention_reference(*args, sm_scale=sm_scale, sliding_window=window)
  error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  return float(counts.mean()), int(counts.max()), int(counts.size), error


def mosaic_main(contexts) -> list[dict]:
  rows = []
  for context in contexts:
    start = time.perf_counter()
    row = dict(context=context, context_pages=-(-context // BLOCK_SIZE))
    errors = []
    for name, q_len, window, q_tile in (("window", 1, WINDOW, None),
                                        ("full", 1, None, None),
                                        ("window", PREFILL_ROWS, WINDOW, PREFILL_TILE),
                                        ("full", PREFILL_ROWS, None, PREFILL_TILE)):
      mean, peak, tiles, error = mosaic_pages_per_tile(context, q_len, window, q_tile)
      errors.append(error)
      if q_tile is None:
        row[f"decode_{name}"] = peak
      else:
        row.update({f"prefill_{name}_mean": mean, f"prefill_{name}_max": peak,
                    "prefill_tiles": tiles})
    row["max_error"] = max(errors)
    row["seconds"] = time.perf_counter() - start
    rows.append(row)
    print(f"context {context}: {row}", file=sys.stderr)
  print(f"Pages copied (TMA) per (query tile, KV head); Z = {BLOCK_SIZE}, W = {WINDOW}, "
        f"H = {NUM_Q_HEADS}, K = {NUM_KV_HEADS}, D = {HEAD_DIM}, bfloat16, default tiling.\n")
  print("| context | pages in context | decode, W=256 | decode, no window | "
        f"prefill tile (Q={PREFILL_TILE}), W=256: mean / max | prefill tile, no window: "
        "mean / max | max abs error vs reference |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['context']} | {r['context_pages']} | {r['decode_window']} | "
          f"{r['decode_full']} | {r['prefill_window_mean']:.2f} / {r['prefill_window_max']} | "
          f"{r['prefill_full_mean']:.2f} / {r['prefill_full_max']} | {r['max_error']:.1e} |")
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="contexts 512 and 1k only")
  parser.add_argument("--kernel", choices=("triton", "mosaic"), default="triton",
                      help="the Pallas GPU kernel (Triton) or the Mosaic GPU kernel")
  args = parser.parse_args(argv)
  contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
  if args.kernel == "mosaic":
    return mosaic_main(contexts)
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
