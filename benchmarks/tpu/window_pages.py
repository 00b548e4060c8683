"""Pages the Pallas TPU kernel copies per query tile under a sliding window (interpret mode).

Cost follows the window: with ``sliding_window=W`` a work item never DMAs a page lying
entirely before its earliest query row's window, so the pages copied per query tile stop
growing with the context once the context passes W. This script counts them: it runs the
kernel in TPU interpret mode on CPU through ``ragged_paged_attention_page_log``, which logs
every page copy the kernel starts, at contexts 512 .. 8k with W = 256 and without a window.

Two batches, each at every context C (Z = 16, chunks of R = 16 pages):
- decode: 4 sequences of context C, one query row each, query tiles of 1 row;
- chunked prefill: one sequence whose last 128 tokens are the queries, tiles of 32 rows.

"pages in windows" is the least a kernel can read: the pages holding a key some row of the
tile sees. Page counts do not depend on the head counts or head dim, so the runs use one KV
head, one query head and D = 64 to keep the interpreter quick; each output is also checked
against the jnp reference.

    PYTHONPATH=. python -m benchmarks.tpu.window_pages            # contexts 512 .. 8192
    PYTHONPATH=. python -m benchmarks.tpu.window_pages --quick    # 512 and 1024, window only
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.tpu import ragged as tpu_ragged

BLOCK_SIZE, HEAD_DIM, PAGES_PER_CHUNK = 16, 64, 16
WINDOW = 256
CONTEXTS = (512, 1024, 2048, 4096, 8192)
MAX_CONTEXT = 8192
# name: (query rows per sequence, sequences, query tile)
BATCHES = {"decode": (1, 4, 1), "chunked prefill": (128, 1, 32)}


def _batch(context: int, q_len: int, num_seqs: int, seed: int):
  """Kernel arguments (fixed shapes for every context: one compile per batch and window)."""
  rng = np.random.default_rng(seed)
  blocks_per_seq = MAX_CONTEXT // BLOCK_SIZE
  pages_per_seq = context // BLOCK_SIZE
  num_blocks = num_seqs * blocks_per_seq
  shape = (1, 1, num_blocks, BLOCK_SIZE, HEAD_DIM)
  k_pages = rng.normal(size=shape).astype(np.float32)
  v_pages = rng.normal(size=shape).astype(np.float32)
  tables = rng.permutation(num_blocks).reshape(num_seqs, blocks_per_seq).astype(np.int32)
  tables[:, pages_per_seq:] = -1  # entries past the context: never read
  q = rng.normal(size=(num_seqs * q_len, 1, HEAD_DIM)).astype(np.float32)
  kv_lens = np.full((num_seqs,), context, np.int32)
  cu_q_lens = np.arange(num_seqs + 1, dtype=np.int32) * q_len
  return (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.int32(0),
          jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu_q_lens),
          jnp.int32(num_seqs))


def pages_in_windows(context: int, q_len: int, q_tile: int, window: int | None) -> list[int]:
  """For each query tile of one sequence: the pages holding a key one of its rows sees."""
  counts = []
  for start in range(0, q_len, q_tile):
    pages = set()
    for row in range(start, min(start + q_tile, q_len)):
      pos = context - q_len + row
      first = 0 if window is None else max(0, pos - window + 1)
      pages.update(range(first // BLOCK_SIZE, pos // BLOCK_SIZE + 1))
    counts.append(len(pages))
  return counts


def measure(batch: str, context: int, window: int | None, seed: int = 0) -> dict:
  q_len, num_seqs, q_tile = BATCHES[batch]
  args = _batch(context, q_len, num_seqs, seed)
  tiling = tpu_ragged.TpuTiling(q_tile=q_tile, pages_per_chunk=PAGES_PER_CHUNK)
  start = time.perf_counter()
  out, log_KWP, items_FW = _page_log(window, tiling)(*args)
  out = np.asarray(out)
  seconds = time.perf_counter() - start
  log_KWP, items_FW = np.asarray(log_KWP), np.asarray(items_FW)
  live_W = items_FW[tpu_ragged._ROW_HI] > items_FW[tpu_ragged._ROW_LO]
  copies_W = log_KWP[0].sum(axis=1)
  num_tiles = len(set(items_FW[tpu_ragged._TILE][live_W].tolist()))
  expected = ragged_paged_attention_reference(*args, sm_scale=HEAD_DIM ** -0.5,
                                              sliding_window=window)
  error = float(np.abs(out - np.asarray(expected)).max())
  lower = pages_in_windows(context, q_len, q_tile, window) * num_seqs
  return dict(batch=batch, context=context, window=window, tiles=num_tiles,
              pages_per_tile=float(copies_W[live_W].sum()) / num_tiles,
              max_pages_per_tile=int(copies_W[live_W].max()),
              pages_in_windows_per_tile=sum(lower) / len(lower),
              max_copies_of_a_page=int(log_KWP.max()), max_abs_error=error,
              seconds=seconds)


@functools.lru_cache(maxsize=None)
def _page_log(window, tiling):
  return jax.jit(functools.partial(tpu_ragged.ragged_paged_attention_page_log,
                                   sm_scale=HEAD_DIM ** -0.5, sliding_window=window,
                                   tiling=tiling, interpret=True))


def table(rows: list[dict]) -> str:
  lines = ["| batch | context | window | query tiles | pages copied per tile (max) | "
           "pages in windows per tile | max abs error vs reference |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    window = "none" if r["window"] is None else r["window"]
    lines.append(f"| {r['batch']} | {r['context']} | {window} | {r['tiles']} | "
                 f"{r['pages_per_tile']:.1f} ({r['max_pages_per_tile']}) | "
                 f"{r['pages_in_windows_per_tile']:.1f} | {r['max_abs_error']:.1e} |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="contexts 512 and 1024, window only (what the tests run)")
  opts = parser.parse_args(argv)
  contexts = CONTEXTS[:2] if opts.quick else CONTEXTS
  windows = (WINDOW,) if opts.quick else (WINDOW, None)
  rows = []
  for batch in BATCHES:
    for window in windows:
      for context in contexts:
        rows.append(measure(batch, context, window))
        print(f"# {batch} context {context} window {window}: "
              f"{rows[-1]['seconds']:.1f}s", file=sys.stderr, flush=True)
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
