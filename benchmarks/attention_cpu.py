"""Ragged paged attention on this machine: reference vs XLA path vs dense contiguous.

For each workload, one run times every implementation side by side (median of repeats
after a warm-up compile) and reads XLA's compiled temporary memory, so the table is of
ratios measured together. The dense baseline is plain attention over a contiguous
[S, ctx, K, D] cache holding the same live tokens, with the queries padded per sequence
to [S, max q_len] as a static batch would: for decode-only and single-sequence workloads
it does exactly the paged work, so xla / dense is the price of paging there.

    python benchmarks/attention_cpu.py            # full table
    python benchmarks/attention_cpu.py --quick    # seconds; used by the test suite
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.xla import ragged_paged_attention as xla_paged_attention


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 16


FULL = (
    Workload("decode 16 x 1024", (1,) * 16, (1024,) * 16),
    Workload("decode 4 x 8192", (1,) * 4, (8192,) * 4),
    Workload("prefill 1 x 512", (512,), (512,)),
    Workload("mixed: 1 prefill 256 + 15 decodes 1024", (256,) + (1,) * 15,
             (256,) + (1024,) * 15),
)
QUICK = (
    Workload("decode 4 x 128", (1,) * 4, (128,) * 4),
    Workload("mixed: prefill 32 + 3 decodes", (32, 1, 1, 1), (32, 100, 60, 7)),
)


def build(w: Workload, seed: int = 0):
  rng = np.random.default_rng(seed)
  z = w.block_size
  num_seqs = len(w.q_lens)
  blocks = [-(-k // z) for k in w.kv_lens]
  num_blocks, width = sum(blocks), max(blocks)
  k_pages = rng.normal(size=(1, w.num_kv_heads, num_blocks, z, w.head_dim)).astype(np.float32)
  v_pages = rng.normal(size=k_pages.shape).astype(np.float32)
  perm = rng.permutation(num_blocks)
  tables = np.zeros((num_seqs, width), np.int32)
  used = 0
  for i, b in enumerate(blocks):
    tables[i, :b] = perm[used:used + b]
    used += b
  cu = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
  q = rng.normal(size=(int(cu[-1]), w.num_q_heads, w.head_dim)).astype(np.float32)
  # The same tokens, contiguous: [S, ctx, K, D].
  ctx = width * z
  k_dense = k_pages[0][:, tables].transpose(1, 2, 3, 0, 4).reshape(num_seqs, ctx,
                                                                    w.num_kv_heads, w.head_dim)
  v_dense = v_pages[0][:, tables].transpose(1, 2, 3, 0, 4).reshape(num_seqs, ctx,
                                                                    w.num_kv_heads, w.head_dim)
  paged = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.int32(0),
           jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
           jnp.int32(num_seqs))
  max_q = max(w.q_lens)
  q_padded = np.zeros((num_seqs, max_q, w.num_q_heads, w.head_dim), np.float32)
  for i, q_len in enumerate(w.q_lens):
    q_padded[i, :q_len] = q[cu[i]:cu[i + 1]]
  dense = (jnp.asarray(q_padded), jnp.asarray(k_dense), jnp.asarray(v_dense),
           jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(w.q_lens, jnp.int32))
  return paged, dense


@jax.jit
def dense_attention(q_SQHD, k_SCKD, v_SCKD, kv_lens_S, q_lens_S):
  """Causal attention over a contiguous cache, queries padded per sequence to [S, Q]."""
  num_seqs, max_q, num_q_heads, head_dim = q_SQHD.shape
  num_kv_heads = k_SCKD.shape[2]
  q_SQKGD = q_SQHD.reshape(num_seqs, max_q, num_kv_heads, -1, head_dim)
  scores = jnp.einsum("sqkgd,sckd->skgqc", q_SQKGD, k_SCKD) * head_dim ** -0.5
  qpos_SQ = kv_lens_S[:, None] - q_lens_S[:, None] + jnp.arange(max_q)[None, :]
  visible = jnp.arange(k_SCKD.shape[1])[None, None, :] <= qpos_SQ[:, :, None]
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("skgqc,sckd->sqkgd", probs, v_SCKD)
  return out.reshape(num_seqs, max_q, num_q_heads, head_dim)


def time_it(fn, args, repeats: int) -> tuple[float, int, jax.Array]:
  compiled = jax.jit(fn).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  out = jax.block_until_ready(compiled(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples), temp, out


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny workloads, a few seconds")
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  workloads = QUICK if args.quick else FULL
  repeats = args.repeats or (3 if args.quick else 10)
  sm_scale = None
  rows = []
  print("| workload | reference ms | xla ms | dense ms | xla / dense | reference temp MiB "
        "| xla temp MiB | dense temp MiB | max abs(xla - ref) |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for w in workloads:
    paged, dense = build(w)
    sm_scale = w.head_dim ** -0.5
    ref_s, ref_mem, ref_out = time_it(
        lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale), paged, repeats)
    xla_s, xla_mem, xla_out = time_it(lambda *a: xla_paged_attention(*a, sm_scale=sm_scale), paged,
                             repeats)
    dense_s, dense_mem, _ = time_it(dense_attention, dense, repeats)
    max_err = float(jnp.max(jnp.abs(xla_out - ref_out)))
    row = dict(workload=w.name, reference_ms=1e3 * ref_s, xla_ms=1e3 * xla_s,
               dense_ms=1e3 * dense_s, xla_over_dense=xla_s / dense_s,
               reference_temp_mib=ref_mem / 2**20, xla_temp_mib=xla_mem / 2**20,
               dense_temp_mib=dense_mem / 2**20, xla_max_abs_err=max_err)
    rows.append(row)
    print(f"| {w.name} | {row['reference_ms']:.2f} | {row['xla_ms']:.2f} | "
          f"{row['dense_ms']:.2f} | {row['xla_over_dense']:.2f} | "
          f"{row['reference_temp_mib']:.1f} | {row['xla_temp_mib']:.1f} | "
          f"{row['dense_temp_mib']:.1f} | {max_err:.1e} |")
  print(f"\njax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s), float32, H=8 K=2 D=64 Z=16")
  return rows


if __name__ == "__main__":
  main()
