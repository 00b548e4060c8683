"""Sliding-window cost on the XLA path (CPU): attention time against context, window vs none.

With ``sliding_window=W`` the XLA path's work items start at the page holding their first
query row's window, so their page ranges, the loop's trip count and the gathers follow
``W + Q`` rather than the context. This prints, for each context, the best time (of the
repeats; the machine is shared, and the minimum is the least disturbed) of the XLA path
with a window of 256 and without one, and the pages each query tile (work item)
gathers, read from the kernel's own unit list (``xla.ragged.plan_work``).

    python benchmarks/window.py            # contexts 512 .. 8k
    python benchmarks/window.py --quick    # tiny, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels.xla import ragged as xla_ragged

WINDOW = 256


@dataclasses.dataclass(frozen=True)
class Shape:
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 128
  block_size: int = 16


WORKLOADS = {  # name -> q_lens for every sequence at context C (kv_len = C for each)
    "decode 4 x 1": (1, 1, 1, 1),
    "chunked prefill 1 x 128": (128,),
}


def build(q_lens, context: int, shape: Shape, seed: int = 0):
  rng = np.random.default_rng(seed)
  z = shape.block_size
  num_seqs = len(q_lens)
  pages = -(-context // z)
  num_blocks = num_seqs * pages
  k_pages = rng.normal(size=(1, shape.num_kv_heads, num_blocks, z, shape.head_dim))
  v_pages = rng.normal(size=k_pages.shape)
  tables = rng.permutation(num_blocks).reshape(num_seqs, pages).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.normal(size=(int(cu[-1]), shape.num_q_heads, shape.head_dim))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return (f32(q), f32(k_pages), f32(v_pages), jnp.int32(0),
          jnp.full((num_seqs,), context, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
          jnp.int32(num_seqs))


def pages_per_tile(args, window):
  """(mean, max) pages each live work item gathers, and the loop's trip count, from the
  XLA path's own plan with its default tiling."""
  q, k_pages, _, _, kv_lens, tables, cu, num_seqs = args
  num_tokens = q.shape[0]
  num_seq_rows, blocks_per_seq = tables.shape
  group = q.shape[1] // k_pages.shape[1]
  tiling = xla_ragged.default_tiling(num_tokens, num_seq_rows, k_pages.shape[3],
                                     blocks_per_seq)
  plan = xla_ragged.plan_work(kv_lens, cu, num_seqs, num_tokens=num_tokens,
                              block_size=k_pages.shape[3], blocks_per_seq=blocks_per_seq,
                              tiling=tiling, sliding_window=window)
  live = np.asarray(plan.units_W) > 0
  pages = np.asarray(plan.pages_W)[live]
  num_items = xla_ragged.num_work_items(num_tokens, num_seq_rows, tiling.q_tile)
  units_per_step = xla_ragged.default_units_per_step(
      num_items, tiling.q_tile * group, tiling.pages_per_chunk * k_pages.shape[3],
      num_items * -(-blocks_per_seq // tiling.pages_per_chunk))
  steps = -(-int(plan.num_units) // units_per_step)
  return float(pages.mean()), int(pages.max()), steps


def time_it(args, window, sm_scale, repeats: int) -> float:
  fn = jax.jit(lambda *a: xla_ragged.ragged_paged_attention(*a, sm_scale=sm_scale,
                                                            sliding_window=window))
  jax.block_until_ready(fn(*args))  # compile
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return min(samples)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny contexts, a few seconds")
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  contexts = (64, 256) if args.quick else (512, 1024, 2048, 4096, 8192)
  window = 32 if args.quick else WINDOW
  repeats = args.repeats or (2 if args.quick else 10)
  shape = Shape()
  sm_scale = shape.head_dim ** -0.5
  rows = []
  print(f"| workload | context | no window ms | window {window} ms | pages/tile no window "
        f"(mean, max) | pages/tile window (mean, max) | loop steps no window | "
        f"loop steps window |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for name, q_lens in WORKLOADS.items():
    for context in contexts:
      if max(q_lens) > context:
        continue
      case = build(q_lens, context, shape)
      full_s = time_it(case, None, sm_scale, repeats)
      win_s = time_it(case, window, sm_scale, repeats)
      full_mean, full_max, full_steps = pages_per_tile(case, None)
      win_mean, win_max, win_steps = pages_per_tile(case, window)
      row = dict(workload=name, context=context, full_ms=1e3 * full_s, window_ms=1e3 * win_s,
                 full_pages_mean=full_mean, full_pages_max=full_max, window_pages_mean=win_mean,
                 window_pages_max=win_max, full_steps=full_steps, window_steps=win_steps)
      rows.append(row)
      print(f"| {name} | {context} | {row['full_ms']:.2f} | {row['window_ms']:.2f} | "
            f"{full_mean:.1f}, {full_max} | {win_mean:.1f}, {win_max} | {full_steps} | "
            f"{win_steps} |", flush=True)
  print(f"\njax {jax.__version__}, backend {jax.default_backend()}, float32, "
        f"H={shape.num_q_heads} K={shape.num_kv_heads} D={shape.head_dim} "
        f"Z={shape.block_size}, window {window}, best of {repeats}")
  return rows


if __name__ == "__main__":
  main()
