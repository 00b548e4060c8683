"""Accuracy of our Pallas GPU kernel beside JAX's own Pallas GPU paged attention.

Both run in interpret mode on CPU on the same decode batch (JAX's kernel is decode-only)
and are compared with a float64 numpy oracle computed from the same (rounded) inputs.
JAX's kernel takes one layer's pages as [K, N, Z, D] and a block table whose width is a
multiple of its ``k_splits``; our kernel reads the [L, K, N, Z, D] pool at ``layer``.
Unused pages hold finite garbage: JAX's kernel turns NaN there (or in the tail slots of a
sequence's last page) into NaN outputs, as it multiplies masked probabilities with
whatever its compute block loaded.

Run:  python benchmarks/gpu_accuracy.py [--quick]
Writes the markdown table to benchmarks/gpu/RESULTS_gpu_section.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from paged_jax.pallas_kernels import gpu

RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "gpu" / "RESULTS_gpu_section.md"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  blocks_per_seq: int
  num_layers: int = 2
  layer: int = 1
  k_splits: int = 2          # JAX kernel: must divide blocks_per_seq
  pages_per_compute_block: int = 4


QUICK = Shape(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
              blocks_per_seq=8)
FULL = Shape(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
             blocks_per_seq=32, k_splits=4, pages_per_compute_block=8)


def make_decode_inputs(shape: Shape, dtype, seed: int):
  """A decode batch: one query per sequence, random lengths, shuffled block tables."""
  rng = np.random.default_rng(seed)
  s = shape
  capacity = s.blocks_per_seq * s.block_size
  kv_lens = rng.integers(1, capacity + 1, size=s.batch).astype(np.int32)
  kv_lens[0] = capacity                      # one full table
  kv_lens[-1] = max(1, capacity // 3 + 1)    # not a multiple of the block size
  num_blocks = s.batch * s.blocks_per_seq + 4
  tables = rng.permutation(num_blocks)[: s.batch * s.blocks_per_seq]
  tables = tables.reshape(s.batch, s.blocks_per_seq).astype(np.int32)
  pages_shape = (s.num_layers, s.num_kv_heads, num_blocks, s.block_size, s.head_dim)
  k_pages = rng.standard_normal(pages_shape).astype(np.float32)
  v_pages = rng.standard_normal(pages_shape).astype(np.float32)
  q = rng.standard_normal((s.batch, s.num_q_heads, s.head_dim)).astype(np.float32)
  cast = lambda x: jnp.asarray(x, dtype)
  return dict(q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages),
              kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables))


def oracle_f64(inputs, shape: Shape, sm_scale: float) -> np.ndarray:
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  q, k_pages, v_pages = f64(inputs["q"]), f64(inputs["k_pages"]), f64(inputs["v_pages"])
  kv_lens, tables = np.asarray(inputs["kv_lens"]), np.asarray(inputs["block_tables"])
  group = shape.num_q_heads // shape.num_kv_heads
  out = np.zeros_like(q)
  for b in range(shape.batch):
    n = int(kv_lens[b])
    pages = tables[b, : -(-n // shape.block_size)]
    k = k_pages[shape.layer][:, pages].reshape(shape.num_kv_heads, -1, shape.head_dim)[:, :n]
    v = v_pages[shape.layer][:, pages].reshape(shape.num_kv_heads, -1, shape.head_dim)[:, :n]
    q_KGD = q[b].reshape(shape.num_kv_heads, group, shape.head_dim)
    scores = np.einsum("kgd,knd->kgn", q_KGD, k) * sm_scale
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[b] = np.einsum("kgn,knd->kgd", probs, v).reshape(shape.num_q_heads, shape.head_dim)
  return out


def run_ours(inputs, shape: Shape, sm_scale: float):
  batch = shape.batch
  return gpu.ragged_paged_attention(
      inputs["q"], inputs["k_pages"], inputs["v_pages"], jnp.int32(shape.layer),
      inputs["kv_lens"], inputs["block_tables"], jnp.arange(batch + 1, dtype=jnp.int32),
      jnp.int32(batch), sm_scale=sm_scale, interpret=True)


def run_jax(inputs, shape: Shape, sm_scale: float):
  # JAX's kernel applies no softmax scale: fold it into q (exact for a power of two; for
  # D = 64 / 128 the scale 1/8 and 2**-3.5 differ, so the fold is done in float32).
  q = (inputs["q"].astype(jnp.float32) * sm_scale).astype(inputs["q"].dtype)
  return jax_paged.paged_attention(
      q, inputs["k_pages"][shape.layer], inputs["v_pages"][shape.layer],
      inputs["block_tables"], inputs["kv_lens"], k_splits=shape.k_splits,
      pages_per_compute_block=shape.pages_per_compute_block, interpret=True)


def errors(out, expected):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
  abs_err = np.abs(out - expected)
  return float(abs_err.max()), float(abs_err.max() / np.abs(expected).max())


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny shape, bfloat16 only unless --dtypes: finishes in seconds")
  parser.add_argument("--dtypes", nargs="+", choices=[jnp.dtype(d).name for d in DTYPES],
                      help="dtypes to compare (default: all three; bfloat16 with --quick)")
  parser.add_argument("--no-write", action="store_true",
                      help=f"print only; do not write {RESULTS_PATH.name}")
  args = parser.parse_args(argv)
  shape = QUICK if args.quick else FULL
  sm_scale = shape.head_dim ** -0.5
  names = args.dtypes or (["bfloat16"] if args.quick else [jnp.dtype(d).name for d in DTYPES])
  rows = []
  for i, dtype in enumerate(DTYPES):
    if jnp.dtype(dtype).name not in names:
      continue
    inputs = make_decode_inputs(shape, dtype, seed=i)
    expected = oracle_f64(inputs, shape, sm_scale)
    # JAX's kernel sees q pre-scaled in q's dtype: give it its own oracle from that q.
    q_scaled = (inputs["q"].astype(jnp.float32) * sm_scale).astype(dtype)
    expected_jax = oracle_f64(dict(inputs, q=q_scaled), shape, 1.0)
    start = time.perf_counter()
    ours = errors(run_ours(inputs, shape, sm_scale), expected)
    t_ours = time.perf_counter() - start
    start = time.perf_counter()
    theirs = errors(run_jax(inputs, shape, sm_scale), expected_jax)
    t_jax = time.perf_counter() - start
    rows.append((jnp.dtype(dtype).name, *ours, *theirs))
    print(f"{jnp.dtype(dtype).name}: ours {t_ours:.1f}s, jax {t_jax:.1f}s", file=sys.stderr)

  command = "python benchmarks/gpu_accuracy.py" + (" --quick" if args.quick else "")
  if args.dtypes:
    command += " --dtypes " + " ".join(args.dtypes)
  s = shape
  header = (f"Decode batch of {s.batch} sequences, H={s.num_q_heads}, K={s.num_kv_heads}, "
            f"D={s.head_dim}, Z={s.block_size}, up to {s.blocks_per_seq * s.block_size} "
            f"positions (layer {s.layer} of {s.num_layers}); both kernels in interpret mode "
            f"on CPU (jax {jax.__version__}), each against a float64 numpy oracle of its own "
            "inputs. rel = max abs error / max |oracle|.")
  table = ["| dtype | ours max abs | ours rel | JAX paged_attention max abs | JAX rel |",
           "|---|---|---|---|---|"]
  table += [f"| {name} | {a:.2e} | {r:.2e} | {ja:.2e} | {jr:.2e} |"
            for name, a, r, ja, jr in rows]
  text = "\n".join([header, "", *table, ""])
  print(text)
  if not args.no_write:
    section = "\n".join([
        "## Pallas GPU kernel (`impl=\"pallas_gpu\"`)", "",
        "### Accuracy beside JAX's Pallas GPU paged attention", "",
        f"Command: `{command}`", "", text,
        "JAX's kernel applies no softmax scale, so its q is pre-scaled in q's dtype (its "
        "oracle uses that same q). Unused pages and the tail slots of each sequence's "
        "last page hold finite garbage here: with NaN there, JAX's kernel returns NaN "
        "(checked in interpret mode; it multiplies masked probabilities by whatever it "
        "loaded), whereas ours masks those loads (its tests fill them with NaN).", "",
        "### Timings on an H200", "",
        "Not measured yet: no GPU has been available to the project. "
        "`benchmarks/gpu/run.py` is the prepared script (checks the kernel against the "
        "reference on the GPU, then times it against JAX's Pallas GPU paged attention, "
        "our XLA path and dense XLA attention); its table goes here once run.", ""])
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(section)
    print(f"wrote {RESULTS_PATH}", file=sys.stderr)
  return [dict(dtype=name, ours_abs=a, ours_rel=r, jax_abs=ja, jax_rel=jr)
          for name, a, r, ja, jr in rows]


if __name__ == "__main__":
  main()
