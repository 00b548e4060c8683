"""Check and time the Pallas TPU ragged paged attention kernel on one Cloud TPU chip.

Written for a Cloud TPU VM (v4 / v5e / v5p / v6e) with this repository checked out and a
TPU jax installed (``pip install -e ".[tpu]"``); nothing here needs the network.

1. Checks ``pallas_kernels.tpu.ragged_paged_attention`` against the jnp reference (matmuls
   at HIGHEST precision) on a few realistic shapes: a mixed ragged bfloat16 batch, a long
   float32 decode, MQA; unused pages and the tail slots of each last page hold NaN.
2. Times it, compiled and warmed up, as the median of many samples, against
   - JAX's decode kernel ``jax.experimental.pallas.ops.tpu.paged_attention`` (decode only;
     one layer's ``[K, N, Z, D]`` pages; no softmax scale, so q is scaled inside the timed
     function),
   - JAX's ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (its own
     ``[N, Z, 2K, D]`` pool, K and V interleaved along heads, built outside the timing),
   - the project's XLA path ``pallas_kernels.xla.ragged_paged_attention``,
   - dense XLA attention over a contiguous ``[B, C, K, D]`` cache (decode only),
   at decode batches 8 / 32 / 128 x context 1k / 8k and on a mixed prefill + decode batch,
   Llama-3-8B-like: 32 query heads, 8 KV heads, head dim 128, bfloat16, 16-token pages.
   Achieved HBM bandwidth = bytes of the K/V pages the batch owns / median time, beside the
   measured device-to-device copy bandwidth (read + write). Every timed output is also
   compared with ours (max abs difference), which catches a wrong layout adaptation.
3. Quantised pools (``--kv-dtypes``, default int8 and float8_e4m3fn): the same pages
   quantised with one float32 scale per token and KV head (``layout.quantize``; NaN slots
   keep NaN scales), checked against the reference on the same pool and timed for ours and
   the XLA path (JAX's kernels take no per-token scales) at decode B=32 x 1k / 8k and on the
   mixed batch; KV bytes then count the one-byte pages and their scales.

Every case runs in its own try/except (the error is printed and recorded); a time budget
skips what is left once spent. Writes ``results.json`` and ``results.md`` under $OUT
(default ./out).

On the TPU VM, from the repository root:

    PYTHONPATH=. python benchmarks/tpu/run.py                  # everything (minutes)
    PYTHONPATH=. python benchmarks/tpu/run.py --quick          # two small decode cases
    PYTHONPATH=. python benchmarks/tpu/run.py --out /tmp/tpu --budget-s 1200

Without a TPU (the test suite runs this, so the script cannot rot):

    PYTHONPATH=. python benchmarks/tpu/run.py --dry-run        # CPU, TPU interpret mode,
                                                               # one tiny case; not timings
    PYTHONPATH=. python benchmarks/tpu/run.py --dry-run --kv-dtypes int8   # + an int8 pool
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (8, 32, 128)
DECODE_CONTEXTS = (1024, 8192)
# Mixed batch: two full prefills of 512, a chunk of 256 onto 1792 cached tokens, 32 decodes.
MIXED_SEQS = [(512, 512)] * 2 + [(256, 2048)] + [(1, 2048)] * 32

OURS = "pallas_tpu (ours)"
XLA = "xla (ours)"
JAX_DECODE = "jax paged_attention"
JAX_RAGGED = "jax ragged_paged_attention"
DENSE = "dense xla"


@dataclasses.dataclass(frozen=True)
class Mode:
  """How to run: real TPU, or the CPU dry run (TPU interpret mode, tiny shapes)."""
  interpret: bool = False
  num_q_heads: int = NUM_Q_HEADS
  num_kv_heads: int = NUM_KV_HEADS
  head_dim: int = HEAD_DIM
  block_size: int = BLOCK_SIZE
  warmup: int = 3
  samples: int = 30
  min_sample_s: float = 0.002   # calls per sample are raised until a sample lasts this long
  jax_pages_per_compute_block: int = 8
  # JAX's ragged kernel: None picks its tuned block sizes (which ask the TPU's version).
  jax_ragged_blocks: tuple[int, int] | None = None  # (kv pages, queries) per block

  @property
  def compile_options(self):
    # XLA:CPU spends most of an interpret-mode run optimising the interpreter's program.
    return {"xla_backend_optimization_level": 0} if self.interpret else None

  @property
  def sm_scale(self) -> float:
    return self.head_dim ** -0.5

  def jax_interpret(self):
    """Context for tracing JAX's kernels, which take no ``interpret`` argument."""
    if not self.interpret:
      return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.force_tpu_interpret_mode()


DRY_RUN = Mode(interpret=True, num_q_heads=8, num_kv_heads=2, warmup=0, samples=1,
               min_sample_s=0.0, jax_pages_per_compute_block=2, jax_ragged_blocks=(2, 8))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description="Check and time the Pallas TPU ragged paged attention kernel on one TPU "
                  "chip against JAX's TPU kernels, our XLA path and dense XLA attention.")
  parser.add_argument("--out", default=os.environ.get("OUT", "./out"),
                      help="folder for results.json / results.md (default $OUT or ./out)")
  parser.add_argument("--budget-s", type=float, default=1800.0,
                      help="stop starting new timings after this many seconds (default 1800)")
  parser.add_argument("--quick", action="store_true",
                      help="only decode batch 8 and 32 at context 1k (a smoke test on a TPU)")
  parser.add_argument("--samples", type=int, default=30,
                      help="timed samples per implementation; the median is reported")
  parser.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
  parser.add_argument("--kv-dtypes", default=None,
                      help="comma-separated quantised pool dtypes to check and time besides "
                           "bfloat16 (int8, float8_e4m3fn, float8_e5m2; 'none' for none; "
                           "default int8,float8_e4m3fn, and none in a dry run)")
  parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                      help="no TPU: one tiny case on CPU, Pallas kernels in TPU interpret "
                           "mode (checks the plumbing; its times mean nothing)")
  return parser.parse_args(argv)


class Budget:

  def __init__(self, seconds: float):
    self.start, self.seconds = time.perf_counter(), seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> bool:
    return self.elapsed() < self.seconds


# --- Inputs. ---

_MAX_DIRECT_ELEMENTS = 1 << 27


def random_normal(key, shape, dtype):
  """Standard normal of ``shape``; past 2**27 elements one random slab repeated along axis 1
  (timings need the bytes, not fresh randomness, and a direct draw needs float32 temps)."""
  if math.prod(shape) <= _MAX_DIRECT_ELEMENTS:
    return jax.random.normal(key, shape, dtype)
  per_index = math.prod(shape) // shape[1]
  slab = max(1, _MAX_DIRECT_ELEMENTS // per_index)

  @jax.jit
  def make(key):
    base = jax.random.normal(key, (shape[0], slab) + tuple(shape[2:]), dtype)
    reps = -(-shape[1] // slab)
    return jnp.tile(base, (1, reps) + (1,) * (len(shape) - 2))[:, :shape[1]]
  return make(key)


@dataclasses.dataclass
class Batch:
  """One ragged batch over a ``[K, N, Z, D]`` pool (one layer; ours gets ``[None]``). A
  quantised pool (``kv_dtype`` int8 / float8) holds storage bits with ``[K, N, Z]`` float32
  scales; ``args()`` then ends with the two scale arrays."""
  q_THD: jax.Array
  k_pages_KNZD: jax.Array
  v_pages_KNZD: jax.Array
  kv_lens_S: jax.Array
  block_tables_SP: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  kv_dtype: jnp.dtype | None = None
  k_scales_KNZ: jax.Array | None = None
  v_scales_KNZ: jax.Array | None = None

  def args(self):
    scales = () if self.kv_dtype is None else (self.k_scales_KNZ, self.v_scales_KNZ)
    return (self.q_THD, self.k_pages_KNZD, self.v_pages_KNZD, self.kv_lens_S,
            self.block_tables_SP, self.cu_q_lens, self.num_seqs) + scales

  @property
  def is_decode(self) -> bool:
    return all(q == 1 for q in self.q_lens)


def make_batch(key, seqs, dtype, mode: Mode, *, nan_unused: bool = False,
               pad_rows: int = 0, table_multiple: int = 1) -> Batch:
  """q and pages for ``seqs`` = [(q_len, kv_len), ...]: shuffled disjoint block tables whose
  unused entries name other sequences' blocks, and 4 spare blocks; with ``nan_unused``, the
  spare blocks and the tail slots of each sequence's last block are NaN (never to be
  read)."""
  z = mode.block_size
  q_lens = tuple(int(q) for q, _ in seqs)
  kv_lens = tuple(int(k) for _, k in seqs)
  pages = [-(-k // z) for k in kv_lens]
  used = sum(pages)
  width = -(-max(pages) // table_multiple) * table_multiple
  num_blocks = used + 4  # spare blocks nobody owns
  k_perm, k_q, k_k, k_v = jax.random.split(key, 4)
  ids = np.asarray(jax.random.permutation(k_perm, used)).astype(np.int32)
  tables = np.zeros((len(seqs), width), np.int32)
  tail_NZ = np.zeros((num_blocks, z), bool)
  tail_NZ[used:] = True
  start = 0
  for i, n in enumerate(pages):
    tables[i, :n] = ids[start:start + n]
    tables[i, n:] = ids[(start + n) % used]
    if n and kv_lens[i] % z:
      tail_NZ[ids[start + n - 1], kv_lens[i] % z:] = True
    start += n
  shape = (mode.num_kv_heads, num_blocks, z, mode.head_dim)
  k_pages, v_pages = random_normal(k_k, shape, dtype), random_normal(k_v, shape, dtype)
  if nan_unused:
    tail = jnp.asarray(tail_NZ)[None, :, :, None]
    k_pages = jnp.where(tail, jnp.nan, k_pages).astype(dtype)
    v_pages = jnp.where(tail, jnp.nan, v_pages).astype(dtype)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jax.random.normal(k_q, (int(cu[-1]) + pad_rows, mode.num_q_heads, mode.head_dim), dtype)
  return Batch(q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables),
               jnp.asarray(cu), jnp.int32(len(seqs)), q_lens, kv_lens)


def quantize_batch(batch: Batch, kv_dtype) -> Batch:
  """``batch`` over a quantised pool: its pages as ``kv_dtype`` storage bits with one float32
  scale per token and KV head (``layout.quantize``); NaN slots keep a NaN scale."""
  from paged_jax.pallas_kernels import layout

  @jax.jit
  def quantize(pages_KNZD):
    bits, scales = layout.quantize(pages_KNZD.astype(jnp.float32), kv_dtype)
    return bits, jnp.where(jnp.isnan(pages_KNZD).any(axis=-1), jnp.nan, scales)

  (k_bits, k_scales), (v_bits, v_scales) = (
      jax.block_until_ready(quantize(p)) for p in (batch.k_pages_KNZD, batch.v_pages_KNZD))
  return dataclasses.replace(batch, k_pages_KNZD=k_bits, v_pages_KNZD=v_bits,
                             kv_dtype=jnp.dtype(kv_dtype), k_scales_KNZ=k_scales,
                             v_scales_KNZ=v_scales)


def kv_bytes(batch: Batch) -> int:
  """Bytes of the K and V pages the batch's sequences own (what a kernel must read), their
  scales included for a quantised pool."""
  k = batch.k_pages_KNZD
  _, _, z, d = k.shape
  pages = sum(-(-n // z) for n in batch.kv_lens)
  per_token = d * k.dtype.itemsize + (0 if batch.kv_dtype is None else 4)
  return 2 * pages * k.shape[0] * z * per_token


def _pool_kwargs(kv_dtype, scales):
  """The kernels' keywords for a one-layer quantised pool (scales [K, N, Z] each)."""
  if kv_dtype is None:
    return {}
  k_scales, v_scales = scales
  return dict(kv_dtype=kv_dtype, k_scales=k_scales[None], v_scales=v_scales[None])


# --- Implementations; each builder returns (fn, args) for fn(*args) -> [T, H, D]. ---

def ours_fn(mode: Mode, kv_dtype=None):
  from paged_jax.pallas_kernels import tpu

  def f(q, k, v, kv_lens, tables, cu, num_seqs, *scales):
    return tpu.ragged_paged_attention(q, k[None], v[None], 0, kv_lens, tables, cu, num_seqs,
                                      sm_scale=mode.sm_scale, interpret=mode.interpret,
                                      **_pool_kwargs(kv_dtype, scales))
  return f


def xla_fn(mode: Mode, kv_dtype=None):
  from paged_jax.pallas_kernels import xla

  def f(q, k, v, kv_lens, tables, cu, num_seqs, *scales):
    return xla.ragged_paged_attention(q, k[None], v[None], 0, kv_lens, tables, cu, num_seqs,
                                      sm_scale=mode.sm_scale, **_pool_kwargs(kv_dtype, scales))
  return f


def reference_fn(mode: Mode, kv_dtype=None):
  from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference

  def f(q, k, v, kv_lens, tables, cu, num_seqs, *scales):
    with jax.default_matmul_precision("highest"):
      return ragged_paged_attention_reference(q, k[None], v[None], 0, kv_lens, tables, cu,
                                              num_seqs, sm_scale=mode.sm_scale,
                                              **_pool_kwargs(kv_dtype, scales))
  return f


def jax_decode_fn(mode: Mode, blocks_per_seq: int):
  """JAX's decode kernel: q [B, H, D]; it has no softmax scale, so q is scaled here."""
  from jax.experimental.pallas.ops.tpu import paged_attention as jax_decode
  pages_per_compute_block = math.gcd(mode.jax_pages_per_compute_block, blocks_per_seq)

  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    del cu, num_seqs
    q = (q.astype(jnp.float32) * mode.sm_scale).astype(q.dtype)
    return jax_decode.paged_attention(q, k, v, kv_lens, tables,
                                      pages_per_compute_block=pages_per_compute_block)
  return f


def combined_kv_pages(k_pages_KNZD, v_pages_KNZD):
  """[N, Z, 2K, D], K at even and V at odd head slots: JAX's ragged kernel's pool."""
  kv_stacked = jnp.stack([k_pages_KNZD, v_pages_KNZD], axis=3)  # [K, N, Z, 2, D]
  num_kv_heads, num_blocks, block_size, _, head_dim = kv_stacked.shape
  return kv_stacked.transpose(1, 2, 0, 3, 4).reshape(num_blocks, block_size, 2 * num_kv_heads,
                                                    head_dim)


def jax_ragged_fn(mode: Mode):
  """JAX's ragged kernel on its own pool, block sizes from its tuned table."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_ragged

  pages, queries = mode.jax_ragged_blocks or (None, None)

  def f(q, kv_pages, kv_lens, tables, cu, num_seqs):
    return jax_ragged.ragged_paged_attention(q, kv_pages, kv_lens, tables, cu,
                                             num_seqs.reshape(1), sm_scale=mode.sm_scale,
                                             num_kv_pages_per_block=pages,
                                             num_queries_per_block=queries)
  return f


def dense_fn(mode: Mode):
  """Decode over a contiguous cache: q [B, H, D], k and v [B, C, K, D], a length mask."""
  group = mode.num_q_heads // mode.num_kv_heads

  def f(q_BHD, k_BJKD, v_BJKD, kv_lens_B):
    batch, ctx = k_BJKD.shape[:2]
    q_BKGD = q_BHD.reshape(batch, mode.num_kv_heads, group, mode.head_dim)
    s_BKGJ = jnp.einsum("bkgd,bjkd->bkgj", q_BKGD, k_BJKD,
                        preferred_element_type=jnp.float32) * mode.sm_scale
    visible_BJ = jnp.arange(ctx)[None, :] < kv_lens_B[:, None]
    s_BKGJ = jnp.where(visible_BJ[:, None, None, :], s_BKGJ, -jnp.inf)
    p_BKGJ = jax.nn.softmax(s_BKGJ, axis=-1)
    o_BKGD = jnp.einsum("bkgj,bjkd->bkgd", p_BKGJ.astype(v_BJKD.dtype), v_BJKD,
                        preferred_element_type=jnp.float32)
    return o_BKGD.reshape(q_BHD.shape).astype(q_BHD.dtype)
  return f


def builders(batch: Batch, mode: Mode):
  """(name, build) pairs; build() makes the implementation's inputs only when it runs, so
  at most one extra copy of the KV cache (JAX's pool or the dense cache) lives at a time."""
  out = [(OURS, lambda: (ours_fn(mode, batch.kv_dtype), batch.args(), mode.interpret)),
         (XLA, lambda: (xla_fn(mode, batch.kv_dtype), batch.args(), False))]
  if batch.kv_dtype is not None:  # JAX's kernels and dense XLA take no per-token scales
    return out
  if batch.is_decode:
    out.append((JAX_DECODE, lambda: (jax_decode_fn(mode, batch.block_tables_SP.shape[1]),
                                     batch.args(), mode.interpret)))

  def ragged():
    kv_pages = jax.block_until_ready(
        jax.jit(combined_kv_pages)(batch.k_pages_KNZD, batch.v_pages_KNZD))
    return jax_ragged_fn(mode), (batch.q_THD, kv_pages, batch.kv_lens_S,
                                 batch.block_tables_SP, batch.cu_q_lens,
                                 batch.num_seqs), mode.interpret
  out.append((JAX_RAGGED, ragged))

  if batch.is_decode:
    def dense():
      k, v = jax.block_until_ready(jax.jit(contiguous_cache)(
          batch.k_pages_KNZD, batch.v_pages_KNZD, batch.block_tables_SP))
      return dense_fn(mode), (batch.q_THD, k, v, batch.kv_lens_S), False
    out.append((DENSE, dense))
  return out


def contiguous_cache(k_pages_KNZD, v_pages_KNZD, block_tables_SP):
  """The batch's K and V gathered into contiguous [S, P * Z, K, D] caches (same values)."""
  def gather(pages_KNZD):
    num_kv_heads, _, block_size, head_dim = pages_KNZD.shape
    num_seqs, blocks_per_seq = block_tables_SP.shape
    pages_KSPZD = pages_KNZD[:, block_tables_SP]
    return pages_KSPZD.transpose(1, 2, 3, 0, 4).reshape(
        num_seqs, blocks_per_seq * block_size, num_kv_heads, head_dim)
  return gather(k_pages_KNZD), gather(v_pages_KNZD)


# --- Timing. ---

def compile_fn(fn, args, mode: Mode, *, jax_kernel: bool, cache=None, name=None):
  """AOT-compiled ``fn``; JAX's kernels are traced under TPU interpret mode in a dry run.
  With ``cache`` (a dict), executables are kept under (name, mode, argument shapes)."""
  key = (name, mode, tuple((a.shape, a.dtype) for a in args))
  if cache is not None and key in cache:
    return cache[key]
  context = mode.jax_interpret() if jax_kernel else contextlib.nullcontext()
  with context:
    lowered = jax.jit(fn).lower(*args)
  compiled = lowered.compile(mode.compile_options)
  if cache is not None:
    cache[key] = compiled
  return compiled


def time_compiled(compiled, args, mode: Mode):
  """Median seconds per call over ``mode.samples`` samples, after warm-up; a sample runs
  ``reps`` back-to-back calls, ``reps`` doubled until a sample lasts ``min_sample_s``."""
  for _ in range(mode.warmup):
    jax.block_until_ready(compiled(*args))
  reps = 1
  while mode.min_sample_s > 0:
    t0 = time.perf_counter()
    jax.block_until_ready([compiled(*args) for _ in range(reps)])
    if time.perf_counter() - t0 >= mode.min_sample_s or reps >= 1024:
      break
    reps *= 2
  samples = []
  for _ in range(mode.samples):
    t0 = time.perf_counter()
    jax.block_until_ready([compiled(*args) for _ in range(reps)])
    samples.append((time.perf_counter() - t0) / reps)
  return statistics.median(samples), len(samples), reps


def copy_bandwidth(mode: Mode, num_elements: int) -> float:
  """Device-to-device copy bandwidth, bytes read + written per second."""
  x = jnp.arange(num_elements, dtype=jnp.int32).astype(jnp.bfloat16)
  compiled = jax.jit(lambda x: x + jnp.bfloat16(1)).lower(x).compile(mode.compile_options)
  sec, _, _ = time_compiled(compiled, (x,), mode)
  return 2 * x.nbytes / sec


# --- Correctness. ---

_MIXED_CHECK_SEQS = [(1, 1000), (1, 2999), (1, 16), (64, 1500), (200, 200), (0, 77),
                     (1, 4096), (7, 300)]
CHECKS = [
    # (name, dtype, seqs, num_q_heads, atol = rtol, padding query rows)
    ("llama3_8b_mixed_bf16", jnp.bfloat16, _MIXED_CHECK_SEQS, NUM_Q_HEADS, 2e-2, 3),
    ("long_decode_f32", jnp.float32, [(1, 8192), (1, 5000), (1, 33)], NUM_Q_HEADS, 1e-4, 3),
    ("mqa_bf16", jnp.bfloat16, [(1, 700), (33, 512), (1, 2048)], NUM_KV_HEADS, 2e-2, 3),
]
# Quantised pools, per kv dtype: the reference reads the same bits and scales. A float32 q
# is computed in float32 (tight); a bfloat16 q's output is rounded to bfloat16.
QUANT_CHECKS = [
    ("llama3_8b_mixed_{}", jnp.bfloat16, _MIXED_CHECK_SEQS, NUM_Q_HEADS, 2e-2, 3),
    ("long_decode_f32q_{}", jnp.float32, [(1, 8192), (1, 5000), (1, 33)], NUM_Q_HEADS, 1e-4,
     3),
]
# The dry run's one timing case.
DRY_RUN_SEQS = [(1, 64), (1, 37)]
# Its shapes, so that the check's executable of our kernel serves the timing too.
DRY_RUN_CHECKS = [("dry_run_decode_bf16", jnp.bfloat16, DRY_RUN_SEQS, DRY_RUN.num_q_heads,
                   2e-2, 0)]
DRY_RUN_QUANT_CHECKS = [("dry_run_decode_{}", jnp.bfloat16, DRY_RUN_SEQS,
                         DRY_RUN.num_q_heads, 2e-2, 0)]


def run_checks(results, checks, mode: Mode, executables, kv_dtype=None):
  """``checks`` on bfloat16 / float32 pools, or (``kv_dtype``) on quantised ones."""
  for name, dtype, seqs, num_q_heads, tol, pad_rows in checks:
    if kv_dtype is not None:
      name = name.format(jnp.dtype(kv_dtype).name)
    row = dict(name=name, dtype=jnp.dtype(dtype).name, tolerance=tol,
               kv_dtype=jnp.dtype(kv_dtype or dtype).name)
    try:
      heads = dataclasses.replace(mode, num_q_heads=num_q_heads,
                                  num_kv_heads=min(mode.num_kv_heads, num_q_heads))
      if num_q_heads == mode.num_kv_heads:  # MQA: one KV head
        heads = dataclasses.replace(heads, num_kv_heads=1)
      batch = make_batch(jax.random.key(1), seqs, dtype, heads, nan_unused=True,
                         pad_rows=pad_rows, table_multiple=heads.jax_pages_per_compute_block)
      if kv_dtype is not None:
        batch = quantize_batch(batch, kv_dtype)
      ours = compile_fn(ours_fn(heads, batch.kv_dtype), batch.args(), heads, jax_kernel=False,
                        cache=executables, name=OURS)
      ref = compile_fn(reference_fn(heads, batch.kv_dtype), batch.args(), heads,
                       jax_kernel=False)
      out = np.asarray(ours(*batch.args()).astype(jnp.float32))
      expected = np.asarray(ref(*batch.args()).astype(jnp.float32))
      diff = np.abs(out - expected)
      finite = bool(np.all(np.isfinite(out)))
      row.update(max_abs_err=float(np.nanmax(diff)), finite=finite,
                 ok=finite and bool(np.all(diff <= tol * (1.0 + np.abs(expected)))))
    except Exception as e:  # noqa: BLE001 - every case is isolated
      traceback.print_exc()
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    print(f"check {name}: {row}", flush=True)
    results["checks"].append(row)


# --- Timing cases. ---

def _error_text(e: Exception) -> str:
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]


def time_case(name, seqs, dtype, mode: Mode, *, budget, copy_bw, results, executables,
              kv_dtype=None):
  """Times every implementation on one batch (``kv_dtype``: over a quantised pool of the
  same values, ours and XLA only); outputs are compared with ours."""
  key = jax.random.key(zlib.crc32(name.encode()))
  batch = make_batch(key, seqs, dtype, mode, table_multiple=mode.jax_pages_per_compute_block)
  if kv_dtype is not None:
    batch = quantize_batch(batch, kv_dtype)
    name = f"{name} {jnp.dtype(kv_dtype).name} pool"
  nbytes = kv_bytes(batch)
  live = int(sum(batch.q_lens))
  ours_out = None
  for impl, build in builders(batch, mode):
    row = dict(case=name, impl=impl, dtype=jnp.dtype(dtype).name,
               kv_dtype=jnp.dtype(kv_dtype or dtype).name, num_seqs=len(seqs),
               q_rows=live, kv_tokens=int(sum(batch.kv_lens)), kv_bytes=nbytes)
    if not budget.left():
      row["error"] = "skipped: time budget spent"
    else:
      try:
        fn, args, interpreted = build()
        t0 = time.perf_counter()
        compiled = compile_fn(fn, args, mode, jax_kernel=impl in (JAX_DECODE, JAX_RAGGED),
                              cache=executables, name=impl)
        row["compile_s"] = time.perf_counter() - t0
        out = jax.block_until_ready(compiled(*args))
        if impl == OURS:
          ours_out = out
        elif ours_out is not None:
          diff = jnp.abs(out[:live].astype(jnp.float32) - ours_out[:live].astype(jnp.float32))
          row["max_abs_diff_vs_ours"] = float(jnp.max(diff))
        sec, n, reps = time_compiled(compiled, args, mode)
        row.update(us=sec * 1e6, samples=n, reps=reps, gb_s=nbytes / sec / 1e9,
                   frac_copy_bw=nbytes / sec / copy_bw, interpreted=interpreted)
        del fn, args, compiled, out
      except Exception as e:  # noqa: BLE001 - a kernel that cannot run is a table entry
        traceback.print_exc()
        row["error"] = _error_text(e)
        if mode.interpret:
          from jax.experimental.pallas import tpu as pltpu
          pltpu.reset_tpu_interpret_mode_state()
    print(f"{row}", flush=True)
    results["timings"].append(row)


def kv_dtypes(args) -> list:
  """The quantised pool dtypes to check and time (``--kv-dtypes``)."""
  text = args.kv_dtypes
  if text is None:
    text = "none" if args.dry_run else "int8,float8_e4m3fn"
  if text.strip().lower() == "none":
    return []
  names = [n.strip() for n in text.split(",") if n.strip()]
  allowed = ("int8", "float8_e4m3fn", "float8_e5m2")
  for n in names:
    if n not in allowed:
      raise SystemExit(f"--kv-dtypes: {n!r} must be one of {allowed} or 'none'")
  return [jnp.dtype(n) for n in names]


def plan(args):
  """``[(name, seqs, kv_dtype)]``: bfloat16 pools (kv_dtype None), then quantised ones."""
  quantised = kv_dtypes(args)
  if args.dry_run:
    case = ("dry-run decode B=2 ctx=64", DRY_RUN_SEQS)
    return [case + (None,)] + [case + (d,) for d in quantised]
  decode = [(f"decode B={b} ctx={c}", [(1, c)] * b)
            for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
  if args.quick:
    return [c + (None,) for c in decode[:2]] + [decode[1] + (d,) for d in quantised]
  mixed = (f"mixed: {sum(q for q, _ in MIXED_SEQS)} q rows, {len(MIXED_SEQS)} seqs",
           MIXED_SEQS)
  # The mixed batch before the 8k contexts, so a short budget cuts the largest cases first;
  # the quantised pools (decode B=32 at 1k and 8k, and the mixed batch) after.
  plain = decode[:len(DECODE_BATCHES)] + [mixed] + decode[len(DECODE_BATCHES):]
  quantised_cases = [decode[1], mixed, decode[len(DECODE_BATCHES) + 1]]
  return ([c + (None,) for c in plain]
          + [c + (d,) for c in quantised_cases for d in quantised])


def _fmt(x, spec):
  return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def to_markdown(results) -> str:
  lines = [f"Device: {results['device']}, jax {results['jax']}; copy bandwidth "
           f"{_fmt(results['copy_gb_s'], '.0f')} GB/s (read + write)."
           + (" DRY RUN on CPU in TPU interpret mode: the times mean nothing."
              if results["dry_run"] else ""), "",
           "| check | q dtype | pool | max abs err vs reference | tolerance (atol = rtol) "
           "| ok |",
           "|---|---|---|---|---|---|"]
  for c in results["checks"]:
    lines.append(f"| {c['name']} | {c['dtype']} | {c.get('kv_dtype', c['dtype'])} | "
                 f"{_fmt(c.get('max_abs_err'), '.2e')} | "
                 f"{c['tolerance']} | {c['ok']}{' ' + c['error'] if 'error' in c else ''} |")
  lines += ["", "| case | impl | us (median) | KV GB/s | of copy BW | max abs diff vs ours |",
            "|---|---|---|---|---|---|"]
  for t in results["timings"]:
    if "error" in t:
      lines.append(f"| {t['case']} | {t['impl']} | error: {t['error'][:160]} | | | |")
    else:
      lines.append(f"| {t['case']} | {t['impl']} | {t['us']:.1f} | {t['gb_s']:.0f} | "
                   f"{_fmt(t['frac_copy_bw'], '.0%')} | "
                   f"{_fmt(t.get('max_abs_diff_vs_ours'), '.1e')} |")
  lines += ["", f"Total script time {results['elapsed_s']:.0f} s. KV GB/s = bytes of the K and "
            "V pages the sequences own (and their scales, for a quantised pool: 4 bytes per "
            "token and KV head each) / median time (q and out not counted). The dense "
            "baseline reads the same values gathered into a contiguous cache (its table "
            "width x block size per sequence)."]
  return "\n".join(lines) + "\n"


def _json_safe(x):
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_json_safe(v) for v in x]
  return x


def main(argv=None) -> dict:
  """Runs the checks and timings; returns the results (also written under ``--out``)."""
  args = parse_args(argv)
  mode = DRY_RUN if args.dry_run else dataclasses.replace(Mode(), samples=args.samples)
  if not args.dry_run and jax.default_backend() != "tpu":
    print(f"warning: backend is {jax.default_backend()!r}, not 'tpu'; the Pallas TPU "
          "kernels will fail (use --dry-run on CPU)", file=sys.stderr)
  budget = Budget(args.budget_s)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  results = dict(device=f"{device.device_kind} ({device})", jax=jax.__version__,
                 dry_run=args.dry_run,
                 checks=[], timings=[], copy_gb_s=math.nan)
  print(results["device"], results["jax"], flush=True)
  try:
    copy_bw = copy_bandwidth(mode, (1 << 16) if args.dry_run else (1 << 30))
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    copy_bw = math.nan
  results["copy_gb_s"] = copy_bw / 1e9
  executables = {}  # (impl, mode, shapes) -> compiled, shared by the checks and timings
  print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
  if not args.skip_check:
    run_checks(results, DRY_RUN_CHECKS if args.dry_run else CHECKS, mode, executables)
    for kv_dtype in kv_dtypes(args):
      run_checks(results, DRY_RUN_QUANT_CHECKS if args.dry_run else QUANT_CHECKS, mode,
                 executables, kv_dtype=kv_dtype)
  for name, seqs, kv_dtype in plan(args):
    try:
      time_case(name, seqs, jnp.bfloat16, mode, budget=budget, copy_bw=copy_bw,
                results=results, executables=executables, kv_dtype=kv_dtype)
      executables.clear()  # one case's executables are not needed by the next
    except Exception as e:  # noqa: BLE001 - building the inputs may fail (memory)
      traceback.print_exc()
      results["timings"].append(dict(case=name, impl="all", error=_error_text(e)))
  results["elapsed_s"] = budget.elapsed()
  (out_dir / "results.json").write_text(json.dumps(_json_safe(results), indent=2))
  markdown = to_markdown(results)
  (out_dir / "results.md").write_text(markdown)
  print(markdown)
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
