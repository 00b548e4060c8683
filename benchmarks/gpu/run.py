"""One prepared run on a single GPU (written for an H200, jax 0.11.x, no network).

1. Checks ``pallas_kernels.mosaic_gpu.ragged_paged_attention`` (Mosaic GPU) and
   ``pallas_kernels.gpu.ragged_paged_attention`` (Triton) against the jnp reference on a
   few realistic shapes (mixed ragged batch, long split-K decode, MQA), and the Mosaic
   kernel with each tiling the timings sweep on a batch of decodes.
2. Times them against JAX's built-in Pallas GPU (Triton) paged attention (decode only),
   the project's XLA path and a dense XLA attention over a contiguous cache, for decode at
   batch 8/32/256/1 x context 8k/32k/1k (Llama-3-8B-like: 32 query heads, 8 KV heads,
   D = 128, bf16, 16-token blocks) and for a mixed prefill + decode batch. A sample queues
   one or two dispatches of one jitted function that makes several calls (``repeat_plan``:
   up to 8, ~1 GiB of K/V a dispatch, each call its own q; input sets rotate so a small
   case does not run from L2), so a call of a few microseconds times the kernel, not the
   host's dispatch and wait; medians over samples after a warm-up.
   Achieved bandwidth = unique K/V (+ q, out) bytes / time, against the measured
   device-to-device copy bandwidth; each row also gives JAX's Triton paged attention time
   over its own (the issue's goals: the Mosaic kernel >= 85% of copy bandwidth at 8k-32k
   decode and >= 1.2x JAX's Triton kernel; a "Goals" table lists those cases). The Mosaic
   GPU kernel is timed on bf16 pools (its direct path: the tensor cores read the pages
   where TMA put them), at the goal contexts also with the tilings of ``MOSAIC_SWEEP``
   (chunk size J and chunks in flight S) and with wave-balanced split-K (and our XLA path
   with ``XLA_UNITS`` work units a loop step), and on the same pools as uint16 storage bits
   with ``kv_dtype=bfloat16`` (what ``KVCache`` holds: its staged path converts each chunk
   through registers). Our Triton kernel is timed on both pools too.
3. Profiles the Mosaic GPU kernel (``PROFILE_CASES``; ``--skip-profile`` skips it): one
   call of ``mosaic_gpu.profiled_attention`` per case, whose Mosaic GPU profiler trace
   (under $OUT/profile/) ``mosaic_profile.summarise`` turns into cycles and shares per
   kernel region (page waits, scores, softmax, update, refills, ...), cycles per chunk and
   programs side by side on one SM.

Built for a blind, time-limited run:
- each impl of each case is built and timed in its own try/except (a JAX without Triton
  loses only the Triton cells); errors are printed and recorded;
- the goal cases (8k and 32k contexts) come first, then the mixed batch, then 1k;
- the time budget is checked before each case builds its inputs and before each timing;
  past it the rest is recorded as skipped;
- ``results.json`` and ``results.md`` under $OUT (default ./out) are rewritten after every
  row, so a run cut by its time limit keeps what it measured;
- a watchdog ends the process (results written, exit 3) when one check or timing runs
  past ``--hang-s`` (a hung kernel would otherwise hold the device until the limit).

Time: the default grid is 12 decode cases x 7 impls + 6 goal cases x 6 variants (5 Mosaic
tilings, a wider XLA step) + 3 mixed = 123 timings, each a compile (~1-10 s), a warm-up
and ``--sample-s`` 0.5 s of samples (the largest case, batch 256 x 32k, reads 34 GB per
call: ~8 ms), plus 11 checks and 4 profiles: ~6-7 min; the budget (``--budget-s 400``,
counted from the start of ``main``) stops starting new work and one timing at most
finishes after it, so the whole run stays within ~8 minutes.

  PYTHONPATH=. python benchmarks/gpu/run.py [--budget-s 400] [--sample-s 0.5] [--quick]
  PYTHONPATH=. python benchmarks/gpu/run.py --smoke-cpu   # plumbing test on CPU, ~100 s
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mosaic_profile  # noqa: E402 - beside this script

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (8, 32, 256, 1)
DECODE_CONTEXTS = (8192, 32768, 1024)
GOAL_CONTEXTS = (8192, 32768)   # the goals are for decode at 8k-32k contexts
GOAL_COPY_FRACTION, GOAL_SPEEDUP = 0.85, 1.2
MOSAIC, MOSAIC_BITS = "pallas_mosaic_gpu (ours)", "pallas_mosaic_gpu, storage bits (ours)"
TRITON_BITS = "pallas_gpu, storage bits (ours)"
JAX_TRITON = "jax pallas paged_attention"
L2_DEFEAT_BYTES = 256 << 20   # rotate input sets until one round reads this much
MAX_SETS = 16
DISPATCH_BYTES = 1 << 30      # batch calls into one dispatch until it reads this much
MAX_CALLS = 8                 # (or the rotating sets, when more: up to 16)
# Mosaic GPU tilings timed beside the default at the goal contexts, (J, S): chunk size and
# chunks in flight. J = 64, S <= 2 and J = 128, S = 1 fit two or more programs per SM
# (each under half of the 227 KiB of shared memory); J = 128, S = 3 one, with half the
# chunks (and table reads, barrier waits) per token. Also timed there: the default with
# the split-K factor of ``tiling.wave_balanced_splits`` (MOSAIC_WAVES).
MOSAIC_SWEEP = ((64, 1), (64, 2), (128, 1), (128, 3))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description="Check and time the Pallas GPU ragged paged attention kernel on one GPU.")
  parser.add_argument("--out", default=os.environ.get("OUT", "./out"),
                      help="output folder for results.json / results.md (default $OUT or ./out)")
  parser.add_argument("--budget-s", type=float, default=400.0,
                      help="stop starting new cases and timings this many seconds after the "
                           "start (default 400: the whole run within ~8 minutes)")
  parser.add_argument("--hang-s", type=float, default=120.0,
                      help="end the run (results written, exit 3) when one check or timing "
                           "takes longer than this (default 120)")
  parser.add_argument("--quick", action="store_true",
                      help="only the smallest decode cases (a smoke test of the script)")
  parser.add_argument("--sample-s", type=float, default=0.5,
                      help="seconds of samples per timing (default 0.5; at least 5 samples)")
  parser.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
  parser.add_argument("--skip-profile", action="store_true",
                      help="skip the last stage: profiles of the Mosaic GPU kernel's regions")
  parser.add_argument("--impls", default="",
                      help="time only the impls whose name contains one of these comma-"
                           "separated words (e.g. 'mosaic,jax,dense'); default all")
  parser.add_argument("--smoke-cpu", action="store_true",
                      help="plumbing test without a GPU: tiny shapes, kernels in interpret mode")
  return parser.parse_args(argv)


class Budget:

  def __init__(self, seconds: float):
    self.start, self.seconds = time.perf_counter(), seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> bool:
    return self.elapsed() < self.seconds


SKIPPED = "skipped: time budget spent"


class Recorder:
  """The results, rewritten to ``results.json`` / ``results.md`` after every row."""

  def __init__(self, results: dict, out_dir: pathlib.Path, budget: Budget):
    self.results, self.out_dir, self.budget = results, out_dir, budget
    self.lock = threading.Lock()

  def check(self, row: dict) -> None:
    print(f"check {row['name']}: {row}", flush=True)
    self._add("checks", row)

  def timing(self, row: dict) -> None:
    print(f"{row}", flush=True)
    self._add("timings", row)

  def profile(self, row: dict) -> None:
    print(f"profile {row.get('label')}: "
          f"{ {k: v for k, v in row.items() if k != 'regions'} }", flush=True)
    self._add("profiles", row)

  def _add(self, kind: str, row: dict) -> None:
    with self.lock:
      self.results[kind].append(row)
    self.save()

  def save(self, lock_timeout_s: float = -1) -> str:
    """Writes both files (each whole, through a rename: a kill never leaves half of one);
    returns the markdown."""
    if not self.lock.acquire(timeout=lock_timeout_s):
      return ""
    try:
      self.results["elapsed_s"] = self.budget.elapsed()
      annotate(self.results)
      markdown = to_markdown(self.results)
      for name, text in (("results.json", json.dumps(self.results, indent=2)),
                         ("results.md", markdown)):
        tmp = self.out_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.out_dir / name)
    finally:
      self.lock.release()
    return markdown


class Watchdog:
  """Ends the process when one piece of work (a check, a timing) runs past ``hang_s``:
  a kernel that never finishes would hold the device for the rest of the run's limit."""

  def __init__(self, recorder: Recorder, hang_s: float):
    self.recorder, self.hang_s = recorder, hang_s
    self.label, self.started = None, 0.0
    threading.Thread(target=self._watch, daemon=True).start()

  def start(self, label: str) -> None:
    self.label, self.started = label, time.perf_counter()

  def done(self) -> None:
    self.label = None

  def _watch(self) -> None:
    while True:
      time.sleep(1.0)
      label = self.label
      if label is not None and time.perf_counter() - self.started > self.hang_s:
        self.recorder.results["hung"] = f"{label}: no result after {self.hang_s:.0f} s"
        print(f"watchdog: {self.recorder.results['hung']}; writing results and exiting",
              flush=True)
        try:
          self.recorder.save(lock_timeout_s=10.0)
        finally:
          os._exit(3)


WATCHDOG: Watchdog | None = None


class watched:
  """``with watched(label):`` the watchdog times the block (no-op without a watchdog)."""

  def __init__(self, label: str):
    self.label = label

  def __enter__(self):
    if WATCHDOG is not None:
      WATCHDOG.start(self.label)

  def __exit__(self, *exc):
    if WATCHDOG is not None:
      WATCHDOG.done()
    return False


# --- Inputs. ---

_DIRECT_RANDOM_ELEMENTS = 1 << 28


def big_normal(key, shape, dtype):
  """Standard normal of ``shape``; past 2**28 elements a random slab tiled along axis 1
  (the timing only needs the bytes, and a direct draw would need a temporary of 4 bytes
  per element)."""
  if math.prod(shape) <= _DIRECT_RANDOM_ELEMENTS:
    return jax.random.normal(key, shape, dtype)
  per_row = math.prod(shape) // shape[1]
  slab = max(1, _DIRECT_RANDOM_ELEMENTS // per_row)
  reps = -(-shape[1] // slab)

  @jax.jit
  def make(key):
    base = jax.random.normal(key, (shape[0], slab, *shape[2:]), dtype)
    return jnp.tile(base, (1, reps) + (1,) * (len(shape) - 2))[:, : shape[1]]
  return make(key)


def random_pool(key, num_blocks, dtype, *, nan_from=None):
  """[K, N, Z, D] pages; blocks at or past ``nan_from`` are NaN (never to be read)."""
  shape = (NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
  pool = big_normal(key, shape, dtype)
  if nan_from is not None:
    unused = (jnp.arange(num_blocks) >= nan_from)[None, :, None, None]
    pool = jnp.where(unused, jnp.nan, pool).astype(dtype)
  return pool


def ragged_batch(key, seqs, dtype, *, num_heads=NUM_Q_HEADS, pad_rows=0, nan_unused=True,
                 block_offset=0, num_blocks=None):
  """Metadata and q for ``seqs`` = [(q_len, kv_len), ...]; shuffled disjoint tables."""
  q_lens = np.array([q for q, _ in seqs], np.int32)
  kv_lens = np.array([kv for _, kv in seqs], np.int32)
  pages = -(-kv_lens // BLOCK_SIZE)
  width = int(pages.max())
  used = int(pages.sum())
  k_perm, k_q = jax.random.split(key)
  ids = np.asarray(jax.random.permutation(k_perm, used)) + block_offset
  tables = np.zeros((len(seqs), width), np.int32)
  start = 0
  for i, n in enumerate(pages):
    tables[i, :n] = ids[start:start + n]
    # Unused entries point at another sequence's blocks: they must not be read.
    tables[i, n:] = ids[(start + n) % used]
    start += n
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = int(cu[-1]) + pad_rows
  q = jax.random.normal(k_q, (num_tokens, num_heads, HEAD_DIM), dtype)
  return dict(q=q, kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables),
              cu_q_lens=jnp.asarray(cu), num_seqs=jnp.int32(len(seqs)), used_blocks=used)


# --- Implementations under test (all take [K, N, Z, D] pools; L = 1 is a free reshape). ---

INTERPRET = False  # set by --smoke-cpu only
IMPL_FILTER: tuple[str, ...] = ()  # set by --impls


def wanted(impl: str) -> bool:
  return not IMPL_FILTER or any(word in impl for word in IMPL_FILTER)


def ours_fn(sm_scale, *, kv_dtype=None):
  """Our Triton kernel; with ``kv_dtype`` the pools hold its storage bits."""
  from paged_jax.pallas_kernels import gpu

  @jax.jit
  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    return gpu.ragged_paged_attention(q, k[None], v[None], 0, kv_lens, tables, cu, num_seqs,
                                      sm_scale=sm_scale, kv_dtype=kv_dtype,
                                      interpret=INTERPRET)
  return f


def mosaic_fn(sm_scale, *, kv_dtype=None, chunk_stages=None, wave_splits=False):
  """The Mosaic GPU kernel; with ``kv_dtype`` the pools hold its storage bits. With
  ``chunk_stages=(J, S)`` the default tiling's chunk size and stages are replaced (its
  query tile and split-K factor kept); with ``wave_splits`` its split-K factor is
  ``tiling.wave_balanced_splits`` (a decode batch: one item per sequence)."""
  from paged_jax.pallas_kernels import mosaic_gpu

  @jax.jit
  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    tiling = None  # the wrapper's own default
    if chunk_stages is not None or wave_splits:
      tiling = variant_tiling(q, k, tables, kv_dtype=kv_dtype, chunk_stages=chunk_stages,
                              wave_splits=wave_splits)
    return mosaic_gpu.ragged_paged_attention(q, k[None], v[None], 0, kv_lens, tables, cu,
                                             num_seqs, sm_scale=sm_scale,
                                             kv_dtype=kv_dtype, tiling=tiling,
                                             interpret=INTERPRET)
  return f


def variant_tiling(q, k_KNZD, tables, *, kv_dtype=None, chunk_stages=None,
                   wave_splits=False):
  """The Mosaic kernel's default tiling for a decode batch (one item per query row) with
  ``chunk_stages=(J, S)`` replacing its chunk size and stages, and with ``wave_splits``
  its split-K factor by ``tiling.wave_balanced_splits``. Reads shapes only."""
  import dataclasses

  from paged_jax.pallas_kernels import mosaic_gpu
  from paged_jax.pallas_kernels.mosaic_gpu import tiling as mosaic_tiling
  tiling = mosaic_gpu.default_tiling_for(q, k_KNZD[None], tables, kv_dtype=kv_dtype)
  if chunk_stages is not None:
    chunk, stages = chunk_stages
    tiling = dataclasses.replace(tiling, chunk_size=chunk, num_stages=stages)
  if wave_splits:
    max_chunks = -(-tables.shape[1] * k_KNZD.shape[2] // tiling.chunk_size)
    tiling = dataclasses.replace(tiling, num_splits=mosaic_tiling.wave_balanced_splits(
        q.shape[0] * k_KNZD.shape[0], max_chunks))
  return tiling


def sweep_name(chunk: int, stages: int) -> str:
  return f"pallas_mosaic_gpu J={chunk} S={stages} (ours)"


MOSAIC_WAVES = "pallas_mosaic_gpu X=waves (ours)"


def mosaic_variants(sm_scale):
  """``[(name, build)]``: the Mosaic kernel's variants timed (and checked) beside its
  default, each ``build()`` returning the jitted function: the tilings of
  ``MOSAIC_SWEEP`` and the wave-balanced splits."""
  variants = [(sweep_name(*js), functools.partial(mosaic_fn, sm_scale, chunk_stages=js))
              for js in MOSAIC_SWEEP]
  return variants + [(MOSAIC_WAVES, functools.partial(mosaic_fn, sm_scale, wave_splits=True))]


def storage_bits_sets(sets):
  """The argument sets with the (shared) pools as their storage bits, converted once."""
  from paged_jax.pallas_kernels import layout
  converted = {}

  def bits(pool):
    if id(pool) not in converted:
      converted[id(pool)] = jax.block_until_ready(layout.to_storage(pool, pool.dtype))
    return converted[id(pool)]
  return [(q, bits(k), bits(v), *rest) for q, k, v, *rest in sets]


def xla_fn(sm_scale, *, units_per_step=None):
  """Our XLA path; ``units_per_step`` replaces its default U (sized for a CPU's caches:
  2^16 scores a step, so a GPU steps through hundreds of tiny loop steps)."""
  import dataclasses

  from paged_jax.pallas_kernels import xla
  from paged_jax.pallas_kernels.xla import ragged as xla_ragged

  @jax.jit
  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    tiling = None
    if units_per_step is not None:
      tiling = xla_ragged.default_tiling(q.shape[0], tables.shape[0], k.shape[2],
                                         tables.shape[1], num_kv_heads=k.shape[0],
                                         group=q.shape[1] // k.shape[0])
      # No more than the units a decode batch has (one item per row).
      units = q.shape[0] * -(-tables.shape[1] // tiling.pages_per_chunk)
      tiling = dataclasses.replace(tiling, units_per_step=min(units_per_step, units))
    return xla.ragged_paged_attention(q, k[None], v[None], 0, kv_lens, tables, cu, num_seqs,
                                      sm_scale=sm_scale, tiling=tiling)
  return f


XLA_UNITS = 2048   # U timed beside the XLA path's default at the goal contexts
XLA_WIDE = f"xla U={XLA_UNITS} (ours)"


def reference_fn(sm_scale):
  from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference

  @jax.jit
  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    return ragged_paged_attention_reference(q, k[None], v[None], 0, kv_lens, tables, cu,
                                            num_seqs, sm_scale=sm_scale)
  return f


def jax_pallas_fn(sm_scale, blocks_per_seq):
  """JAX's decode kernel; it has no softmax scale, so q is scaled first (in the timing)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
  k_splits = math.gcd(16, blocks_per_seq)
  pages_per_compute_block = math.gcd(8, blocks_per_seq // k_splits)

  @jax.jit
  def f(q, k, v, kv_lens, tables, cu, num_seqs):
    del cu, num_seqs
    q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    return jax_paged.paged_attention(q, k, v, tables, kv_lens, k_splits=k_splits,
                                     pages_per_compute_block=pages_per_compute_block,
                                     interpret=INTERPRET)
  return f


def dense_fn(sm_scale):
  """Decode attention over a contiguous cache [B, C, K, D] with a length mask."""

  @jax.jit
  def f(q_BHD, k_BCKD, v_BCKD, kv_lens_B):
    batch, ctx = k_BCKD.shape[:2]
    q_BKGD = q_BHD.reshape(batch, NUM_KV_HEADS, -1, HEAD_DIM)
    s = jnp.einsum("bkgd,bckd->bkgc", q_BKGD, k_BCKD,
                   preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(jnp.arange(ctx)[None, None, None, :] < kv_lens_B[:, None, None, None], s,
                  -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgc,bckd->bkgd", p.astype(v_BCKD.dtype), v_BCKD,
                   preferred_element_type=jnp.float32)
    return o.reshape(q_BHD.shape).astype(q_BHD.dtype)
  return f


# --- Timing. ---

def call_args(arg_sets, calls: int):
  """``calls`` argument tuples cycling through ``arg_sets``, each call with its own queries
  (past the sets, q scaled by 1 + i / 64: distinct in bfloat16), so XLA cannot merge two
  calls of one dispatch into one."""
  out = []
  for i in range(max(calls, len(arg_sets))):
    q, *rest = arg_sets[i % len(arg_sets)]
    if i >= len(arg_sets):
      q = (q.astype(jnp.float32) * (1 + i / 64)).astype(q.dtype)
    out.append((q, *rest))
  return out


def repeat_plan(call_bytes: int, num_sets: int) -> tuple[int, int]:
  """``(calls, dispatches)``: calls of the timed function per jitted dispatch, and dispatches
  queued per sample before waiting. A small call (batch 1, 1k tokens: microseconds on the
  GPU) would otherwise time the host's dispatch and the wait, not the kernel: calls are
  batched into one dispatch until it reads ~1 GiB (at most 8, or every rotating set), and
  two dispatches are queued while that stays under 4 GiB (more would hold the XLA path's
  gathered copies of several calls at once)."""
  if INTERPRET:
    return num_sets, 1
  calls = max(num_sets, min(MAX_CALLS, -(-DISPATCH_BYTES // max(1, call_bytes))))
  dispatches = 2 if calls * call_bytes <= 4 * DISPATCH_BYTES else 1
  return calls, dispatches


def time_fn(fn, arg_sets, sample_s: float, *, calls: int = 1, dispatches: int = 1):
  """Median seconds per call. Each sample queues ``dispatches`` dispatches of one jitted
  function running ``calls`` calls of ``fn`` (``call_args``: the rotating sets, each call
  its own q), waits, and divides; after a compile and a warm-up round."""
  arg_list = call_args(arg_sets, calls)
  many = jax.jit(lambda arg_list: [fn(*args) for args in arg_list])
  jax.block_until_ready(many(arg_list))  # compile
  # Interpreted (--smoke-cpu) a call takes seconds and its time means nothing: one sample
  # shows the plumbing works; on a GPU a warm-up round and at least 5 samples.
  min_samples = 1 if INTERPRET else 5
  if not INTERPRET:
    jax.block_until_ready(many(arg_list))
  samples = []
  start = time.perf_counter()
  while len(samples) < min_samples or (time.perf_counter() - start < sample_s
                                       and len(samples) < 200):
    t0 = time.perf_counter()
    outs = [many(arg_list) for _ in range(dispatches)]
    jax.block_until_ready(outs)
    samples.append((time.perf_counter() - t0) / (len(arg_list) * dispatches))
  return statistics.median(samples), len(samples)


def copy_bandwidth(sample_s: float, *, num_elements: int = 1 << 30) -> float:
  """Device-to-device copy bandwidth (bytes read + written per second), 2 GiB by default."""
  x = jnp.zeros((num_elements,), jnp.bfloat16)
  f = jax.jit(lambda x: jnp.copy(x))
  sec, _ = time_fn(f, [(x,)], sample_s)
  return 2 * x.nbytes / sec


# --- Correctness. ---

CHECKS = [
    # (name, dtype, seqs, num_q_heads, tolerance)
    ("llama3_8b_mixed_bf16", jnp.bfloat16,
     [(1, 1000), (1, 2999), (1, 16), (64, 1500), (200, 200), (0, 77), (1, 4096), (7, 300)],
     NUM_Q_HEADS, 2e-2),
    ("long_decode_split_k_f32", jnp.float32, [(1, 8192), (1, 5000), (1, 33)], NUM_Q_HEADS,
     1e-4),
    ("mqa_f16", jnp.float16, [(1, 700), (33, 512), (1, 2048)], NUM_KV_HEADS * 4, 2e-2),
]


SMOKE_CHECKS = [("smoke_mixed_bf16", jnp.bfloat16, [(1, 40), (9, 9), (0, 3), (4, 70)],
                 NUM_Q_HEADS, 2e-2)]
# The Mosaic tilings the timings sweep, checked too: a faster tiling is worth adopting only
# if it is right on the hardware (long split-K decodes, a short one, NaN past the used pages).
SWEEP_CHECK = ("sweep_decode_bf16", jnp.bfloat16, [(1, 8192), (1, 5000), (1, 1024), (1, 33)],
               NUM_Q_HEADS, 2e-2)
SMOKE_SWEEP_CHECK = ("smoke_sweep_bf16", jnp.bfloat16, [(1, 300), (1, 33)], NUM_Q_HEADS,
                     2e-2)


def run_checks(recorder: Recorder, checks, budget: Budget, sweep_check=None):
  """Each check against the reference with both kernels; ``sweep_check`` with each Mosaic
  tiling the timings sweep (``MOSAIC_SWEEP`` and the wave-balanced splits)."""
  sm_scale = HEAD_DIM ** -0.5
  ref = reference_fn(sm_scale)
  # Built inside each check's try: a JAX without one backend loses only that impl's rows.
  impls = (("pallas_mosaic_gpu", lambda: mosaic_fn(sm_scale)),
           ("pallas_gpu", lambda: ours_fn(sm_scale)))
  pairs = [(check, impl) for check in checks for impl in impls]
  if sweep_check is not None:
    pairs += [(sweep_check, impl) for impl in mosaic_variants(sm_scale)]
  built = {}
  for (name, dtype, seqs, num_heads, tol), (impl, build) in pairs:
    row = dict(name=f"{name} [{impl}]", dtype=jnp.dtype(dtype).name)
    if not budget.left():
      row.update(ok=False, error=SKIPPED)
      recorder.check(row)
      continue
    try:
      with watched(f"check {row['name']}"):
        if impl not in built:
          built[impl] = build()
        ours = built[impl]
        batch = ragged_batch(jax.random.key(1), seqs, dtype, num_heads=num_heads, pad_rows=3)
        used = batch["used_blocks"]
        k = random_pool(jax.random.key(2), used + 8, dtype, nan_from=used)
        v = random_pool(jax.random.key(3), used + 8, dtype, nan_from=used)
        args = (batch["q"], k, v, batch["kv_lens"], batch["block_tables"],
                batch["cu_q_lens"], batch["num_seqs"])
        out = np.asarray(ours(*args).astype(jnp.float32))
        expected = np.asarray(ref(*args).astype(jnp.float32))
      err = float(np.max(np.abs(out - expected)))
      close = bool(np.all(np.abs(out - expected) <= tol * (1.0 + np.abs(expected))))
      row.update(max_abs_err=err, finite=bool(np.all(np.isfinite(out))),
                 ok=close and bool(np.all(np.isfinite(out))), tolerance=tol)
    except Exception as e:  # noqa: BLE001 - every case is isolated
      traceback.print_exc()
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    recorder.check(row)


def timed_row(row: dict, build, *, budget: Budget, sample_s: float, moved_bytes: int,
              copy_bw: float) -> dict:
  """Fills ``row`` with the timing of ``build()``'s (fn, arg_sets), or with why not:
  the budget spent, or the error of building (a missing backend) or running it."""
  if not budget.left():
    row["error"] = SKIPPED
    return row
  try:
    with watched(f"{row['case']} [{row['impl']}]"):
      fn, arg_sets = build()
      calls, dispatches = repeat_plan(moved_bytes, len(arg_sets))
      sec, n = time_fn(fn, arg_sets, sample_s, calls=calls, dispatches=dispatches)
      row.update(calls=calls, dispatches=dispatches)
    bw = moved_bytes / sec
    row.update(us=sec * 1e6, samples=n, gb_s=bw / 1e9, frac_copy_bw=bw / copy_bw)
  except Exception as e:  # noqa: BLE001 - every impl of every case is isolated
    traceback.print_exc()
    row["error"] = f"{type(e).__name__}: {e}"[:500]
  return row


# --- Timing cases. ---

def decode_case(batch, ctx, dtype, *, budget, sample_s, copy_bw, recorder):
  sm_scale = HEAD_DIM ** -0.5
  kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * jnp.dtype(dtype).itemsize
  qo_bytes = 2 * batch * NUM_Q_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
  num_sets = int(max(1, min(MAX_SETS, -(-L2_DEFEAT_BYTES // kv_bytes))))
  if INTERPRET:
    num_sets = 1  # plumbing only: an interpreted Mosaic GPU call takes seconds
  blocks_per_seq = ctx // BLOCK_SIZE
  blocks_per_set = batch * blocks_per_seq
  key = jax.random.key(batch * 100003 + ctx)
  with watched(f"decode B={batch} ctx={ctx} inputs"):
    k_pool = random_pool(jax.random.fold_in(key, 1), blocks_per_set * num_sets, dtype)
    v_pool = random_pool(jax.random.fold_in(key, 2), blocks_per_set * num_sets, dtype)
    sets = []
    for s in range(num_sets):
      b = ragged_batch(jax.random.fold_in(key, 10 + s), [(1, ctx)] * batch, dtype,
                       block_offset=s * blocks_per_set)
      sets.append((b["q"], k_pool, v_pool, b["kv_lens"], b["block_tables"], b["cu_q_lens"],
                   b["num_seqs"]))
    jax.block_until_ready(sets)
  mosaic_bits = lambda: (mosaic_fn(sm_scale, kv_dtype=dtype), storage_bits_sets(sets))
  triton_bits = lambda: (ours_fn(sm_scale, kv_dtype=dtype), storage_bits_sets(sets))
  # The goal pair first (Mosaic and JAX's Triton kernel), then the rest.
  impls = [(MOSAIC, lambda: (mosaic_fn(sm_scale), sets)),
           (JAX_TRITON, lambda: (jax_pallas_fn(sm_scale, blocks_per_seq), sets))]
  if ctx in GOAL_CONTEXTS or (INTERPRET and batch == 1):  # the smoke test's first case
    impls += [(name, lambda build=build: (build(), sets))
              for name, build in mosaic_variants(sm_scale)]
    impls += [(XLA_WIDE, lambda: (xla_fn(sm_scale, units_per_step=XLA_UNITS), sets))]
  impls += [(MOSAIC_BITS, mosaic_bits),
           ("pallas_gpu (ours)", lambda: (ours_fn(sm_scale), sets)),
           (TRITON_BITS, triton_bits),
           ("xla (ours)", lambda: (xla_fn(sm_scale), sets)),
           ("dense xla", lambda: dense_inputs(sets, batch, ctx, dtype, sm_scale))]
  for impl, build in [(name, build) for name, build in impls if wanted(name)]:
    row = dict(case=f"decode B={batch} ctx={ctx}", impl=impl, batch=batch, ctx=ctx,
               dtype=jnp.dtype(dtype).name, sets=num_sets)
    recorder.timing(timed_row(row, build, budget=budget, sample_s=sample_s,
                              moved_bytes=kv_bytes + qo_bytes, copy_bw=copy_bw))


def dense_inputs(sets, batch, ctx, dtype, sm_scale):
  """Contiguous [B, C, K, D] caches, one per rotating set (only when they are small)."""
  num_sets = len(sets)
  dense_sets = []
  for s, (q, *_rest, kv_lens, _tables, _cu, _n) in enumerate(sets):
    key = jax.random.key(7 + s)
    k = big_normal(key, (batch, ctx, NUM_KV_HEADS, HEAD_DIM), dtype)
    v = big_normal(jax.random.fold_in(key, 1), k.shape, dtype)
    dense_sets.append((q, k, v, kv_lens))
    del _rest
  assert len(dense_sets) == num_sets
  return dense_fn(sm_scale), dense_sets


MIXED_SEQS = [(1024, 1024)] * 4 + [(512, 2560)] + [(1, 4096)] * 64
SMOKE_MIXED_SEQS = [(20, 20), (8, 40), (1, 64), (1, 33)]


def mixed_case(dtype, seqs, *, budget, sample_s, copy_bw, recorder):
  """Full prefills, a chunked prefill and decodes in one call (default: 4 prefills of
  1024, a chunk of 512 onto 2048 cached tokens, 64 decodes at 4096)."""
  sm_scale = HEAD_DIM ** -0.5
  kv_tokens = sum(kv for _, kv in seqs)
  q_rows = sum(q for q, _ in seqs)
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = kv_tokens * NUM_KV_HEADS * HEAD_DIM * 2 * itemsize
  qo_bytes = 2 * q_rows * NUM_Q_HEADS * HEAD_DIM * itemsize
  key = jax.random.key(99)
  with watched("mixed inputs"):
    batch = ragged_batch(key, seqs, dtype)
    used = batch["used_blocks"]
    k = jax.block_until_ready(random_pool(jax.random.fold_in(key, 1), used, dtype))
    v = jax.block_until_ready(random_pool(jax.random.fold_in(key, 2), used, dtype))
  args = [(batch["q"], k, v, batch["kv_lens"], batch["block_tables"], batch["cu_q_lens"],
           batch["num_seqs"])]
  impls = ((MOSAIC, lambda: (mosaic_fn(sm_scale), args)),
           ("pallas_gpu (ours)", lambda: (ours_fn(sm_scale), args)),
           ("xla (ours)", lambda: (xla_fn(sm_scale), args)))
  for impl, build in impls:
    if not wanted(impl):
      continue
    row = dict(case=f"mixed: {q_rows} q rows, {len(seqs)} seqs", impl=impl,
               dtype=jnp.dtype(dtype).name, sets=1)
    recorder.timing(timed_row(row, build, budget=budget, sample_s=sample_s,
                              moved_bytes=kv_bytes + qo_bytes, copy_bw=copy_bw))


# --- Profiles of the Mosaic GPU kernel (the Mosaic GPU profiler; a GPU only). ---

# (batch, context, (J, S) or None for the default tiling, pools as storage bits)
PROFILE_CASES = ((8, 8192, None, False), (8, 8192, (64, 2), False),
                 (8, 8192, (128, 3), False), (8, 8192, None, True))


def profile_label(batch, ctx, chunk_stages, bits) -> str:
  tiling = "default tiling" if chunk_stages is None else "J={} S={}".format(*chunk_stages)
  return f"decode B={batch} ctx={ctx}, {tiling}{', storage bits' if bits else ''}"


def profile_case(batch, ctx, chunk_stages, bits, *, out_dir: pathlib.Path) -> dict:
  """One call of ``mosaic_gpu.profiled_attention`` (after a warm-up call) on a decode
  batch, and the summary of the trace it wrote (``mosaic_profile.summarise``)."""
  import dataclasses

  from paged_jax.pallas_kernels import layout, mosaic_gpu
  dtype = jnp.bfloat16
  key = jax.random.key(batch * 7 + ctx)
  b = ragged_batch(key, [(1, ctx)] * batch, dtype)
  k = random_pool(jax.random.fold_in(key, 1), b["used_blocks"], dtype)
  v = random_pool(jax.random.fold_in(key, 2), b["used_blocks"], dtype)
  kv_dtype = None
  if bits:
    k, v, kv_dtype = layout.to_storage(k, dtype), layout.to_storage(v, dtype), dtype
  args = (b["q"], k[None], v[None], 0, b["kv_lens"], b["block_tables"], b["cu_q_lens"],
          b["num_seqs"])
  tiling = variant_tiling(b["q"], k, b["block_tables"], kv_dtype=kv_dtype,
                          chunk_stages=chunk_stages)
  # Regions a program records: 7 per chunk (pages, wait, stage, scores, softmax, update,
  # refill) plus prologue and epilogue; a margin on top.
  chunks = math.ceil(math.ceil(ctx / tiling.chunk_size) / tiling.num_splits)
  name = (f"b{batch}_c{ctx}_" + ("default" if chunk_stages is None
                                  else "j{}_s{}".format(*chunk_stages)) + ("_bits" * bits))
  folder = pathlib.Path(tempfile.mkdtemp(prefix=f"profile_{name}_"))
  fn = jax.jit(functools.partial(
      mosaic_gpu.profiled_attention, sm_scale=HEAD_DIM ** -0.5, kv_dtype=kv_dtype,
      tiling=tiling, profile_dir=str(folder), profile_space=8 * chunks + 8))
  for _ in range(2):  # the second call's trace: a warm kernel
    jax.block_until_ready(fn(*args))
    jax.effects_barrier()  # the trace is written by a host callback
  trace_path = mosaic_profile.newest_trace(folder)
  summary = mosaic_profile.summarise(mosaic_profile.load_trace(trace_path))
  # The raw trace (chrome://tracing, Perfetto) comes back compressed: ~10x smaller.
  (out_dir / "profile").mkdir(parents=True, exist_ok=True)
  with open(trace_path, "rb") as src, gzip.open(out_dir / "profile" / f"{name}.json.gz",
                                                "wb") as dst:
    shutil.copyfileobj(src, dst)
  shutil.rmtree(folder, ignore_errors=True)
  return dict(label=profile_label(batch, ctx, chunk_stages, bits),
              tiling=dataclasses.asdict(tiling), **summary)


def run_profiles(recorder: Recorder, budget: Budget, out_dir: pathlib.Path) -> None:
  for case in PROFILE_CASES:
    label = profile_label(*case)
    if INTERPRET:
      recorder.profile(dict(label=label, error="skipped: the profiler needs a GPU"))
      continue
    if not budget.left():
      recorder.profile(dict(label=label, error=SKIPPED))
      continue
    try:
      with watched(f"profile {label}"):
        recorder.profile(profile_case(*case, out_dir=out_dir))
    except Exception as e:  # noqa: BLE001 - diagnostics only
      traceback.print_exc()
      recorder.profile(dict(label=label, error=f"{type(e).__name__}: {e}"[:500]))


def annotate(results) -> None:
  """Each timed row's ``speedup_vs_jax_triton``: JAX's Triton paged attention time on the
  same case over the row's own (absent where either is missing)."""
  jax_us = {t["case"]: t["us"] for t in results["timings"]
            if t.get("impl") == JAX_TRITON and "us" in t}
  for t in results["timings"]:
    if "us" in t and t.get("case") in jax_us and t.get("impl") != JAX_TRITON:
      t["speedup_vs_jax_triton"] = jax_us[t["case"]] / t["us"]


def _cell(value, fmt: str) -> str:
  return "" if value is None else format(value, fmt)


def to_markdown(results) -> str:
  copy_gb_s = results.get("copy_gb_s", float("nan"))
  lines = [f"Device: {results['device']}, jax {results['jax']}; copy bandwidth "
           f"{copy_gb_s:.0f} GB/s (read + write); impl='auto' here: "
           f"{results.get('auto', '?')}.", ""]
  if "hung" in results:
    lines += [f"**Run ended by the watchdog**: {results['hung']}.", ""]
  lines += ["| check | dtype | max abs err | tolerance (atol = rtol) | ok |",
            "|---|---|---|---|---|"]
  for c in results["checks"]:
    lines.append(f"| {c['name']} | {c['dtype']} | {c.get('max_abs_err', float('nan')):.2e} | "
                 f"{c.get('tolerance', '')} | {c['ok']}{' ' + c['error'] if 'error' in c else ''} |")
  lines += ["", "| case | impl | us (median) | GB/s | of copy BW | JAX Triton time / this | "
            "calls x dispatches |", "|---|---|---|---|---|---|---|"]
  for t in results["timings"]:
    if "error" in t:
      lines.append(f"| {t['case']} | {t['impl']} | error: {t['error'][:120]} | | | | |")
    else:
      lines.append(f"| {t['case']} | {t['impl']} | {t['us']:.1f} | {t['gb_s']:.0f} | "
                   f"{t['frac_copy_bw']:.0%} | {_cell(t.get('speedup_vs_jax_triton'), '.2f')}"
                   f"{'x' if 'speedup_vs_jax_triton' in t else ''} | "
                   f"{t.get('calls', '?')} x {t.get('dispatches', '?')} |")
  goals = [t for t in results["timings"] if t.get("impl", "").startswith("pallas_mosaic_gpu")
           and t.get("ctx") in GOAL_CONTEXTS and "us" in t]
  if goals:
    lines += ["", f"Goals (decode at 8k-32k): >= {GOAL_COPY_FRACTION:.0%} of copy bandwidth, "
              f">= {GOAL_SPEEDUP}x JAX's Triton paged attention.", "",
              "| case | impl | of copy BW | met | JAX Triton time / this | met |",
              "|---|---|---|---|---|---|"]
    for t in goals:
      speedup = t.get("speedup_vs_jax_triton")
      lines.append(
          f"| {t['case']} | {t['impl']} | {t['frac_copy_bw']:.0%} | "
          f"{'yes' if t['frac_copy_bw'] >= GOAL_COPY_FRACTION else 'no'} | "
          f"{'' if speedup is None else f'{speedup:.2f}x'} | "
          f"{'?' if speedup is None else ('yes' if speedup >= GOAL_SPEEDUP else 'no')} |")
  for p in results.get("profiles", []):
    if "error" in p:
      lines += ["", f"Profile {p['label']}: {p['error'][:300]}"]
    else:
      lines += ["", mosaic_profile.to_markdown(p["label"], p).rstrip("\n")]
  lines += ["", f"Script time so far {results.get('elapsed_s', float('nan')):.0f} s. GB/s "
            "counts each K/V byte a sequence owns once, plus q and out."]
  return "\n".join(lines) + "\n"


def device_info() -> str:
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  return f"{device} ({getattr(device, 'device_kind', '?')}" + (
      f", compute capability {capability})" if capability is not None else ")")


def auto_impl() -> str:
  try:
    from paged_jax.attention import resolve_impl
    return resolve_impl("auto")
  except Exception as e:  # noqa: BLE001 - informative only
    return f"({type(e).__name__}: {e})"


def run_plan(args) -> list:
  """The cases in the order they run: the goal contexts (8k, 32k) first, each batch at
  both before the next batch, then the mixed batch, then the 1k contexts."""
  if args.smoke_cpu:
    return [("decode", 1, 64), ("decode", 2, 128), ("mixed", SMOKE_MIXED_SEQS, None)]
  if args.quick:
    return [("decode", 8, 1024), ("decode", 32, 1024)]
  plan = [("decode", b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS
          if c in GOAL_CONTEXTS]
  plan += [("mixed", MIXED_SEQS, None)]
  plan += [("decode", b, c) for c in DECODE_CONTEXTS if c not in GOAL_CONTEXTS
           for b in DECODE_BATCHES]
  return plan


def main(argv=None) -> int:
  global INTERPRET, IMPL_FILTER, WATCHDOG
  args = parse_args(argv)
  INTERPRET = args.smoke_cpu
  IMPL_FILTER = tuple(word for word in args.impls.split(",") if word)
  budget = Budget(args.budget_s)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = dict(device=device_info(), jax=jax.__version__, auto=auto_impl(), checks=[],
                 timings=[], profiles=[], copy_gb_s=float("nan"), budget_s=args.budget_s,
                 sample_s=args.sample_s)
  recorder = Recorder(results, out_dir, budget)
  # Interpreted kernels on CPU take tens of seconds a call: a longer leash there.
  WATCHDOG = Watchdog(recorder, args.hang_s * (5 if args.smoke_cpu else 1))
  print(results["device"], results["jax"], f"auto={results['auto']}", flush=True)
  recorder.save()
  try:
    with watched("copy bandwidth"):
      copy_bw = copy_bandwidth(args.sample_s,
                               num_elements=(1 << 20) if args.smoke_cpu else (1 << 30))
  except Exception:  # noqa: BLE001
    traceback.print_exc()
    copy_bw = float("nan")
  results["copy_gb_s"] = copy_bw / 1e9
  print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
  recorder.save()
  if not args.skip_check:
    run_checks(recorder, SMOKE_CHECKS if args.smoke_cpu else CHECKS, budget,
               SMOKE_SWEEP_CHECK if args.smoke_cpu else SWEEP_CHECK)
  dtype = jnp.bfloat16
  for kind, a, b in run_plan(args):
    label = f"decode B={a} ctx={b}" if kind == "decode" else f"mixed {len(a)} seqs"
    if not budget.left():  # before building the case's inputs
      recorder.timing(dict(case=label, impl="all", error=SKIPPED))
      continue
    try:
      if kind == "decode":
        decode_case(a, b, dtype, budget=budget, sample_s=args.sample_s, copy_bw=copy_bw,
                    recorder=recorder)
      else:
        mixed_case(dtype, a, budget=budget, sample_s=args.sample_s, copy_bw=copy_bw,
                   recorder=recorder)
    except Exception as e:  # noqa: BLE001 - input building may fail (memory)
      traceback.print_exc()
      recorder.timing(dict(case=label, impl="all", error=f"{type(e).__name__}: {e}"[:500]))
  if not args.skip_profile:
    run_profiles(recorder, budget, out_dir)
  WATCHDOG.done()
  print(recorder.save())
  return 0


if __name__ == "__main__":
  sys.exit(main())
