"""Accuracy of our Pallas TPU kernel beside JAX's two Pallas TPU paged attention kernels.

All three run in TPU interpret mode on CPU, on the same random inputs, and are compared with
the float64 numpy oracle of ``tests/attention_cases.py`` (a per-sequence dense causal softmax
computed from the same rounded inputs):

- decode batches (q_len 1 per sequence): ours, JAX's decode kernel
  ``jax.experimental.pallas.ops.tpu.paged_attention`` and JAX's
  ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``;
- a mixed ragged batch (decode, chunked prefill, full prefill, q_len 0): ours and JAX's
  ragged kernel (the decode kernel cannot take it).

Each at float32 and bfloat16 (q, K and V in that dtype). Layouts are adapted from our
``[L, K, N, Z, D]`` pool: the decode kernel takes one layer as ``[K, N, Z, D]``, lengths
``[S]``, page indices ``[S, P]`` with P a multiple of its pages per compute block, and no
softmax scale (q is pre-scaled in q's dtype, and that kernel is compared with an oracle of
the pre-scaled q); the ragged kernel takes ``[N, Z, 2K, D]`` with K and V interleaved along
the head axis and ``num_seqs`` as ``i32[1]``. A kernel that fails to run gets its error in
the table instead of numbers.

Unused pages and the tail slots of each sequence's last page hold finite random garbage
here (the project's tests use NaN there; JAX's kernels are not asked to mask it).

    python -m benchmarks.tpu_accuracy            # Llama-3-8B-like heads, longer contexts
    python -m benchmarks.tpu_accuracy --quick    # seconds; used by the test suite

Writes the markdown table, with the command, to benchmarks/tpu/RESULTS_tpu_section.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import pathlib
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import paged_attention as jax_decode
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_ragged

from paged_jax.pallas_kernels import tpu as tpu_kernel
from tests import attention_cases as cases

RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "tpu" / "RESULTS_tpu_section.md"
DTYPES = (jnp.float32, jnp.bfloat16)
OURS = "ours (pallas_tpu)"
JAX_DECODE = "jax paged_attention"
JAX_RAGGED = "jax ragged_paged_attention"
# The error floor of any kernel: the exact result rounded once to the output dtype.
ROUNDED_ORACLE = "(oracle rounded to dtype)"
# JAX's pure-jnp reference of its ragged kernel, on the adapted inputs: checks the adaptation
# to its layout even where its kernel cannot run.
JAX_RAGGED_REF = "(jax ref_ragged_paged_attention, jnp)"
# XLA:CPU spends most of an interpret-mode run optimising the interpreter's program.
_CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Setup:
  num_kv_heads: int
  group: int
  head_dim: int
  block_size: int
  decode_kv_lens: tuple[int, ...]
  mixed_q_lens: tuple[int, ...]    # decode, chunked prefill, full prefill, q_len 0
  mixed_kv_lens: tuple[int, ...]
  pages_per_compute_block: int  # JAX's kernels: pages per compute block
  tiling: tpu_kernel.TpuTiling | None = None  # ours; None: default_tiling


QUICK = Setup(num_kv_heads=2, group=4, head_dim=128, block_size=16,
              decode_kv_lens=(77, 16, 128), mixed_q_lens=(1, 5, 0, 16),
              mixed_kv_lens=(19, 21, 7, 16), pages_per_compute_block=4,
              tiling=tpu_kernel.TpuTiling(q_tile=4, pages_per_chunk=2))
FULL = Setup(num_kv_heads=8, group=4, head_dim=128, block_size=16,
             decode_kv_lens=(1024, 1000, 513, 17, 256, 1, 700, 999),
             mixed_q_lens=(1, 0, 5, 32, 1, 18, 3, 200, 1),
             mixed_kv_lens=(19, 7, 32, 32, 1, 49, 3, 200, 1024),
             pages_per_compute_block=8)


def decode_case(setup: Setup, dtype, seed: int) -> cases.Case:
  n = len(setup.decode_kv_lens)
  case = cases.make_case(seed, q_lens=[1] * n, kv_lens=setup.decode_kv_lens,
                         num_kv_heads=setup.num_kv_heads, group=setup.group,
                         head_dim=setup.head_dim, block_size=setup.block_size, dtype=dtype,
                         padding_seqs=0, padding_tokens=0)
  return _finite_garbage(_pad_table(case, setup.pages_per_compute_block), seed)


def mixed_case(setup: Setup, dtype, seed: int) -> cases.Case:
  case = cases.make_case(seed, q_lens=setup.mixed_q_lens, kv_lens=setup.mixed_kv_lens,
                         num_kv_heads=setup.num_kv_heads, group=setup.group,
                         head_dim=setup.head_dim, block_size=setup.block_size, dtype=dtype)
  return _finite_garbage(_pad_table(case, setup.pages_per_compute_block), seed)


def _pad_table(case: cases.Case, multiple: int) -> cases.Case:
  """Widens the block table to a multiple of ``multiple`` with in-range (unread) blocks."""
  tables = case.block_tables_SP
  width = -(-tables.shape[1] // multiple) * multiple
  padded = np.zeros((tables.shape[0], width), np.int32)
  padded[:, :tables.shape[1]] = tables
  return dataclasses.replace(case, block_tables_SP=padded)


def _finite_garbage(case: cases.Case, seed: int) -> cases.Case:
  """Replaces the NaN of unused memory (and garbage query rows) with finite noise."""
  rng = np.random.default_rng(seed + 1000)

  def fill(x):
    noise = np.asarray(jnp.asarray(rng.normal(size=x.shape).astype(np.float32), x.dtype))
    return np.where(np.isnan(x.astype(np.float32)), noise, x)

  return dataclasses.replace(case, q_THD=fill(case.q_THD),
                             k_pages_LKNZD=fill(case.k_pages_LKNZD),
                             v_pages_LKNZD=fill(case.v_pages_LKNZD))


def _run_compiled(fn, *args, tpu_interpret: bool = False):
  """``fn(*args)`` compiled at XLA:CPU optimisation level 0, traced in TPU interpret mode
  when ``tpu_interpret`` (JAX's kernels have no ``interpret`` argument)."""
  if tpu_interpret:
    with pltpu.force_tpu_interpret_mode():
      lowered = jax.jit(fn).lower(*args)
  else:
    lowered = jax.jit(fn).lower(*args)
  return np.asarray(jax.block_until_ready(lowered.compile(_CPU_COMPILE_OPTIONS)(*args)))


def run_ours(case: cases.Case, setup: Setup, sm_scale: float):
  def attend(*args):
    return tpu_kernel.ragged_paged_attention(*args, sm_scale=sm_scale, tiling=setup.tiling,
                                             interpret=True)
  args = case.jax_args()
  return _run_compiled(attend, *args[:3], jnp.int32(args[3]), *args[4:])


def _prescaled_q(case: cases.Case, sm_scale: float) -> np.ndarray:
  q = jnp.asarray(case.q_THD)
  return np.asarray((q.astype(jnp.float32) * sm_scale).astype(q.dtype))


def run_jax_decode(case: cases.Case, setup: Setup, sm_scale: float):
  """JAX's decode kernel on one layer's ``[K, N, Z, D]`` pages, with q pre-scaled."""
  def attend(q, k_pages_KNZD, v_pages_KNZD, lengths, page_indices):
    return jax_decode.paged_attention(q, k_pages_KNZD, v_pages_KNZD, lengths, page_indices,
                                      pages_per_compute_block=setup.pages_per_compute_block)
  layer = case.layer
  return _run_compiled(attend, jnp.asarray(_prescaled_q(case, sm_scale)),
                       jnp.asarray(case.k_pages_LKNZD[layer]),
                       jnp.asarray(case.v_pages_LKNZD[layer]), jnp.asarray(case.kv_lens_S),
                       jnp.asarray(case.block_tables_SP), tpu_interpret=True)


def combined_kv_pages(k_pages_KNZD, v_pages_KNZD):
  """[N, Z, 2K, D] with K at even and V at odd head slots (JAX's ragged kernel layout)."""
  kv_stacked = np.stack([k_pages_KNZD, v_pages_KNZD], axis=3)  # [K, N, Z, 2, D]
  num_kv_heads, num_blocks, block_size, _, head_dim = kv_stacked.shape
  return kv_stacked.transpose(1, 2, 0, 3, 4).reshape(num_blocks, block_size, 2 * num_kv_heads,
                                                    head_dim)


def run_jax_ragged(case: cases.Case, setup: Setup, sm_scale: float):
  def attend(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    return jax_ragged.ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        num_kv_pages_per_block=setup.pages_per_compute_block, num_queries_per_block=8)
  layer = case.layer
  kv_pages = combined_kv_pages(case.k_pages_LKNZD[layer], case.v_pages_LKNZD[layer])
  return _run_compiled(attend, jnp.asarray(case.q_THD), jnp.asarray(kv_pages),
                       jnp.asarray(case.kv_lens_S), jnp.asarray(case.block_tables_SP),
                       jnp.asarray(case.cu_q_lens), jnp.array([case.num_seqs], jnp.int32),
                       tpu_interpret=True)


def run_jax_ragged_ref(case: cases.Case, setup: Setup, sm_scale: float):
  del setup
  layer = case.layer
  kv_pages = combined_kv_pages(case.k_pages_LKNZD[layer], case.v_pages_LKNZD[layer])
  with jax.default_matmul_precision("highest"):
    out = jax_ragged.ref_ragged_paged_attention(
        jnp.asarray(case.q_THD), jnp.asarray(kv_pages), jnp.asarray(case.kv_lens_S),
        jnp.asarray(case.block_tables_SP), jnp.asarray(case.cu_q_lens),
        jnp.array([case.num_seqs], jnp.int32), sm_scale=sm_scale)
  return np.asarray(out)


def _error_text(e: Exception) -> str:
  """The root cause: a failure inside the interpreter's callback arrives wrapped in a
  runtime error whose message ends with the original exception."""
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  last = lines[-1] if lines else ""
  if type(e).__name__ == "JaxRuntimeError" and len(lines) > 1:
    return f"JaxRuntimeError from the interpreter callback: {last}"
  return f"{type(e).__name__}: {last}"


def measure(impl: str, run, case: cases.Case, expected: np.ndarray) -> dict:
  """Errors of ``run()`` on the live query rows, or the error it raised."""
  live = int(case.cu_q_lens[case.num_seqs])
  start = time.perf_counter()
  callback_log = logging.getLogger("jax._src.callback")
  level = callback_log.level
  callback_log.setLevel(logging.CRITICAL)  # the failure is recorded below, not logged
  try:
    out = run()
  except Exception as e:  # noqa: BLE001 - a kernel that cannot run is a table entry
    pltpu.reset_tpu_interpret_mode_state()
    return dict(impl=impl, max_abs=math.nan, max_rel=math.nan, error=_error_text(e),
                seconds=time.perf_counter() - start)
  finally:
    callback_log.setLevel(level)
  out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)[:live]
  abs_err = np.abs(out - expected[:live])
  max_abs = float(abs_err.max()) if abs_err.size else 0.0
  scale = float(np.abs(expected[:live]).max()) if abs_err.size else 1.0
  return dict(impl=impl, max_abs=max_abs, max_rel=max_abs / scale, error=None,
              seconds=time.perf_counter() - start)


def compare(batch: str, case: cases.Case, setup: Setup, impls) -> list[dict]:
  sm_scale = setup.head_dim ** -0.5
  expected = cases.oracle(case, sm_scale)
  # The decode kernel sees q pre-scaled in q's dtype: its oracle uses that same q.
  expected_prescaled = cases.oracle(
      dataclasses.replace(case, q_THD=_prescaled_q(case, sm_scale)), 1.0)
  runners = {OURS: (run_ours, expected), JAX_DECODE: (run_jax_decode, expected_prescaled),
             JAX_RAGGED: (run_jax_ragged, expected),
             JAX_RAGGED_REF: (run_jax_ragged_ref, expected)}
  dtype = case.q_THD.dtype
  rounded = lambda: np.asarray(jnp.asarray(expected, jnp.float32).astype(dtype))
  runners[ROUNDED_ORACLE] = (lambda *_: rounded(), expected)
  rows = []
  for impl in (ROUNDED_ORACLE, *impls):
    run, oracle_out = runners[impl]
    row = measure(impl, lambda: run(case, setup, sm_scale), case, oracle_out)
    row.update(batch=batch, dtype=jnp.dtype(case.q_THD.dtype).name)
    if impl not in (ROUNDED_ORACLE, JAX_RAGGED_REF):
      print(f"{batch} {row['dtype']} {impl}: {row['seconds']:.1f}s", file=sys.stderr)
    rows.append(row)
  return rows


def to_markdown(rows, setup: Setup, num_decode: int) -> str:
  s = setup
  header = (f"H={s.num_kv_heads * s.group}, K={s.num_kv_heads}, D={s.head_dim}, "
            f"Z={s.block_size}; decode batch: {num_decode} sequences of q_len 1, kv_lens "
            f"{list(s.decode_kv_lens)}; mixed batch: q_lens {list(s.mixed_q_lens)}, kv_lens "
            f"{list(s.mixed_kv_lens)}. All kernels in TPU interpret mode "
            f"on CPU (jax {jax.__version__}), q, K and V in the listed dtype, each against a "
            "float64 oracle of its own inputs. rel = max abs error / max |oracle| over the "
            "live query rows.")
  lines = ["| batch | dtype | kernel | max abs error | max rel error |", "|---|---|---|---|---|"]
  for r in rows:
    if r["error"] is None:
      lines.append(f"| {r['batch']} | {r['dtype']} | {r['impl']} | {r['max_abs']:.2e} | "
                   f"{r['max_rel']:.2e} |")
    else:
      lines.append(f"| {r['batch']} | {r['dtype']} | {r['impl']} | did not run: "
                   f"`{r['error']}` | - |")
  return "\n".join([header, "", *lines, "", *summary(rows), ""])


def summary(rows) -> list[str]:
  """One line per (batch, dtype): ours against each JAX kernel that ran."""
  out = []
  for r in rows:
    if r["impl"] != OURS or r["error"] is not None:
      continue
    for other in rows:
      if ((other["batch"], other["dtype"]) == (r["batch"], r["dtype"])
          and other["impl"] in (JAX_DECODE, JAX_RAGGED) and other["error"] is None):
        ratio = r["max_rel"] / other["max_rel"] if other["max_rel"] > 0 else math.inf
        verdict = "no worse than" if ratio <= 1.0 else "worse than"
        out.append(f"- {r['batch']} {r['dtype']}: ours is {verdict} {other['impl']} "
                   f"(rel error ratio ours / theirs = {ratio:.3g}).")
  return out


def plan(quick: bool):
  """(batch, dtype, kernels) to compare. Every interpret-mode run compiles for seconds, so
  --quick leaves out the bfloat16 mixed batch, tries JAX's ragged kernel only on the
  float32 mixed batch and skips JAX's jnp reference (seconds of op-by-op dispatch)."""
  full = [("decode", d, (OURS, JAX_DECODE, JAX_RAGGED, JAX_RAGGED_REF)) for d in DTYPES]
  full += [("mixed", d, (OURS, JAX_RAGGED, JAX_RAGGED_REF)) for d in DTYPES]
  if not quick:
    return full
  return [("decode", jnp.float32, (OURS, JAX_DECODE)),
          ("decode", jnp.bfloat16, (OURS, JAX_DECODE)),
          ("mixed", jnp.float32, (OURS, JAX_RAGGED))]


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="few heads and short contexts: finishes in seconds")
  parser.add_argument("--dtypes", nargs="+", choices=[jnp.dtype(d).name for d in DTYPES],
                      help="dtypes to compare (default: float32 and bfloat16)")
  parser.add_argument("--no-write", action="store_true",
                      help=f"print only; do not write {RESULTS_PATH.name}")
  args = parser.parse_args(argv)
  setup = QUICK if args.quick else FULL
  names = args.dtypes or [jnp.dtype(d).name for d in DTYPES]
  rows = []
  for batch, dtype, impls in plan(args.quick):
    if jnp.dtype(dtype).name not in names:
      continue
    seed = (10 if batch == "decode" else 20) + DTYPES.index(dtype)
    build = decode_case if batch == "decode" else mixed_case
    rows += compare(batch, build(setup, dtype, seed), setup, impls)

  command = "python -m benchmarks.tpu_accuracy" + (" --quick" if args.quick else "")
  if args.dtypes:
    command += " --dtypes " + " ".join(args.dtypes)
  text = to_markdown(rows, setup, len(setup.decode_kv_lens))
  print(text)
  if not args.no_write:
    section = "\n".join([
        "## Pallas TPU kernel (`impl=\"pallas_tpu\"`)", "",
        "### Accuracy beside JAX's Pallas TPU kernels (interpret mode)", "",
        f"Command: `{command}`", "", text,
        "JAX's decode kernel applies no softmax scale, so its q is pre-scaled in q's dtype "
        "(its oracle uses that same q); it computes float32 KV in bfloat16, which its "
        "float32 row shows. At bfloat16 it upcasts the loaded K/V and keeps the "
        "probabilities in float32 for the product with V (in the CPU interpreter an exact "
        "float32 product), whereas ours feeds bfloat16 probabilities to the matmul with "
        "float32 accumulation, the MXU's native bfloat16 path: that is the small bfloat16 "
        "gap, if any, in the ratios above. The first row of each batch is the float64 "
        "oracle rounded once to the output dtype: the floor no kernel can beat. The last "
        "row of a batch, in "
        "parentheses (not in --quick), is JAX's pure-jnp reference of its ragged kernel on the "
        "same adapted inputs: it shows that the adaptation to its [N, Z, 2K, D] layout is "
        "right, though the kernel itself cannot run here. Unused pages hold finite "
        "garbage in this comparison; the project's own tests fill them with NaN.", ""])
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(section)
    print(f"wrote {RESULTS_PATH}", file=sys.stderr)
  return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


if __name__ == "__main__":
  main()
