"""Accuracy of the Mosaic GPU kernel (``impl="pallas_mosaic_gpu"``) per K/V dtype.

One ragged batch (long decodes, a chunked prefill, a short decode; Llama-3-8B heads: H=32,
K=8, D=128, Z=16) against a float64 numpy oracle computed from exactly what the kernel
sees (the rounded q, the pages as stored, dequantised for int8 / float8). Unused pages and
the tail slots of each sequence's last page are NaN (quantised pools hold whatever NaN
quantises to). On CPU the kernel runs in the Mosaic GPU interpret mode (its two dots as
``jnp.dot`` of the same operands); on a GPU it runs for real.

Run:  python benchmarks/mosaic_gpu_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import mosaic_gpu

SEQS = ((1, 512), (1, 300), (17, 200), (1, 45))     # (q_len, kv_len)
QUICK_SEQS = ((1, 130), (9, 70), (1, 17))
# (name, pages' logical dtype, q dtype)
CASES = (("float32", jnp.float32, jnp.float32), ("bfloat16", jnp.bfloat16, jnp.bfloat16),
         ("float16", jnp.float16, jnp.float16), ("int8", jnp.int8, jnp.bfloat16),
         ("float8_e4m3fn", jnp.float8_e4m3fn, jnp.bfloat16),
         ("float8_e5m2", jnp.float8_e5m2, jnp.bfloat16), ("int8", jnp.int8, jnp.float32),
         ("float8_e4m3fn", jnp.float8_e4m3fn, jnp.float32))


def make_batch(seqs, *, num_q_heads, num_kv_heads, head_dim, block_size, seed=0):
  """float32 inputs: pages [L=2, K, N, Z, D] (layer 1 used) with NaN where unused."""
  rng = np.random.default_rng(seed)
  pages_per_seq = [-(-kv // block_size) for _, kv in seqs]
  width = max(pages_per_seq) + 1
  num_blocks = sum(pages_per_seq) + 4
  ids = rng.permutation(num_blocks)
  shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
  k = np.full(shape, np.nan, np.float32)
  v = np.full(shape, np.nan, np.float32)
  tables = np.zeros((len(seqs), width), np.int32)
  start = 0
  for i, ((_, kv_len), n) in enumerate(zip(seqs, pages_per_seq)):
    tables[i, :n] = ids[start:start + n]
    tables[i, n:] = ids[(start + n) % len(ids)]   # garbage entries: never read
    for p in range(n):
      filled = min(block_size, kv_len - p * block_size)
      k[:, :, tables[i, p], :filled] = rng.normal(size=(2, num_kv_heads, filled, head_dim))
      v[:, :, tables[i, p], :filled] = rng.normal(size=(2, num_kv_heads, filled, head_dim))
    start += n
  q_lens = np.array([q for q, _ in seqs], np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.normal(size=(int(cu[-1]) + 2, num_q_heads, head_dim)).astype(np.float32)
  kv_lens = np.array([kv for _, kv in seqs], np.int32)
  return q, k, v, kv_lens, tables, cu


def oracle(q, k, v, kv_lens, tables, cu, *, sm_scale, layer=1):
  """float64 causal attention, one query row and head at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  num_q_heads = q.shape[1]
  group = num_q_heads // k.shape[1]
  block_size = k.shape[3]
  out = np.zeros_like(q)
  for i, kv_len in enumerate(kv_lens):
    pos = np.arange(kv_len)
    keys = k[layer][:, tables[i, pos // block_size], pos % block_size]   # [K, kv, D]
    vals = v[layer][:, tables[i, pos // block_size], pos % block_size]
    q_len = cu[i + 1] - cu[i]
    for j in range(q_len):
      qpos = kv_len - q_len + j
      for h in range(num_q_heads):
        s = keys[h // group, :qpos + 1] @ q[cu[i] + j, h] * sm_scale
        p = np.exp(s - s.max())
        out[cu[i] + j, h] = p @ vals[h // group, :qpos + 1] / p.sum()
  return out


def run(seqs, *, interpret: bool):
  dims = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
  q32, k32, v32, kv_lens, tables, cu = make_batch(seqs, **dims)
  sm_scale = dims["head_dim"] ** -0.5
  rows = []
  for name, kv_dtype, q_dtype in CASES:
    q = jnp.asarray(q32, q_dtype)
    extra = {}
    if layout.is_quantized(kv_dtype):
      k_bits, k_scales = layout.quantize(jnp.asarray(k32), kv_dtype)
      v_bits, v_scales = layout.quantize(jnp.asarray(v32), kv_dtype)
      k_seen = layout.dequantize(k_bits, k_scales, kv_dtype)
      v_seen = layout.dequantize(v_bits, v_scales, kv_dtype)
      extra = dict(kv_dtype=kv_dtype, k_scales=k_scales, v_scales=v_scales)
    else:
      k_bits = layout.to_storage(jnp.asarray(k32), kv_dtype)
      v_bits = layout.to_storage(jnp.asarray(v32), kv_dtype)
      k_seen, v_seen = jnp.asarray(k32, kv_dtype), jnp.asarray(v32, kv_dtype)
      if k_bits.dtype != jnp.dtype(kv_dtype):
        extra = dict(kv_dtype=kv_dtype)
    start = time.perf_counter()
    out = mosaic_gpu.ragged_paged_attention(
        q, k_bits, v_bits, 1, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
        jnp.int32(len(seqs)), sm_scale=sm_scale, interpret=interpret, **extra)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    seconds = time.perf_counter() - start
    expected = oracle(np.asarray(q.astype(jnp.float32)), np.asarray(k_seen, np.float32),
                      np.asarray(v_seen, np.float32), kv_lens, tables, cu, sm_scale=sm_scale)
    live = int(cu[-1])
    err = np.abs(out[:live] - expected[:live])
    rows.append(dict(name=name, q_dtype=jnp.dtype(q_dtype).name, max_abs=float(err.max()),
                     rel=float(err.max() / np.abs(expected[:live]).max()),
                     finite=bool(np.isfinite(out).all()),
                     padding_zero=bool((out[live:] == 0).all()), seconds=seconds))
    print(rows[-1], flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smaller batch")
  args = parser.parse_args(argv)
  interpret = jax.default_backend() != "gpu"
  seqs = QUICK_SEQS if args.quick else SEQS
  rows = run(seqs, interpret=interpret)
  mode = "interpret mode on CPU" if interpret else f"on {jax.devices()[0].device_kind}"
  print(f"\nMosaic GPU kernel, {mode} (jax {jax.__version__}); batch (q_len, kv_len) = "
        f"{list(seqs)}, H=32 K=8 D=128 Z=16. rel = max abs error / max |oracle|.\n")
  print("| pages | q | max abs | rel | finite | padding rows 0 |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['name']} | {r['q_dtype']} | {r['max_abs']:.2e} | {r['rel']:.2e} | "
          f"{r['finite']} | {r['padding_zero']} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
