"""Attention accuracy with a quantised KV cache: int8 and float8_e4m3fn, one scale per token
and KV head (the cache's layout) against one scale per tensor, on every impl: the
reference, the XLA path, and the Pallas kernels in their CPU interpret modes (Mosaic TPU,
Pallas GPU / Triton, and Mosaic GPU where this JAX has its interpret mode).

Data (``tests/attention_cases.py::quant_accuracy_case``): a ragged batch (decodes at 9, 130
and 200 tokens, prefill chunks of 24 and 3 rows), four KV heads whose K and V are 1x, 2.2x,
4.6x and 10x apart (q divided by the same factor: logits of std ~1), GQA 2, D = 128, Z = 16,
unused memory NaN, and three outlier tokens whose V is 8x their head's (K 1x). Each seed
draws new data. The error is against the float64 oracle of the unquantised float32 K/V:

- "all heads": max |err| / max |out| over every live row and head (the issue's metric);
- "worst head": that ratio per query head, each against its own max |out|, the largest;
- "vs reference": the all-heads ratio against the reference's output on the SAME quantised
  cache (what the kernel adds to the quantisation's error: float32 rounding).

A second table sweeps the outlier tokens' K gain (their logits grow with it) on the
reference, per token and head: what 8-bit K costs when a few tokens' keys are much larger.

Each Pallas kernel is compiled once per K/V dtype (the scales are traced, so per tensor
and every seed reuse the executable; the interpreters' host programs are compiled at XLA's
cheapest CPU settings, which change nothing they compute).

    python benchmarks/kv_quant_accuracy.py                 # 10 seeds, every impl (~10 min)
    python benchmarks/kv_quant_accuracy.py --no-pallas     # reference and XLA (~10 s)
    python benchmarks/kv_quant_accuracy.py --quick         # 1 seed
    python benchmarks/kv_quant_accuracy.py --pallas-seeds 3  # the Pallas rows on 3 seeds
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import gpu as gpu_kernel
from paged_jax.pallas_kernels import mosaic_gpu as mosaic_gpu_kernel
from paged_jax.pallas_kernels import tpu as tpu_kernel
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.xla import ragged_paged_attention as xla_attention
from tests import attention_cases as cases

KERNELS = {"reference": ragged_paged_attention_reference, "xla": xla_attention}
# The Pallas kernels, each in its CPU interpret mode (the row names say so).
INTERPRETED = {"pallas_tpu (interpret)": tpu_kernel.ragged_paged_attention,
               "pallas_gpu (interpret)": gpu_kernel.ragged_paged_attention}
if mosaic_gpu_kernel.interpret_available():
  INTERPRETED["pallas_mosaic_gpu (interpret)"] = mosaic_gpu_kernel.ragged_paged_attention
# XLA:CPU would spend most of an interpreted kernel's time optimising the interpreter's
# host program, which runs once per call: compile it at the cheapest settings.
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}
_EXECUTABLES = {}
DTYPES = (jnp.int8, jnp.float8_e4m3fn)
BOUND = {"int8": 1.5e-2, "float8_e4m3fn": 6e-2}
SM_SCALE = 128 ** -0.5
K_GAINS = (1.0, 2.0, 4.0, 8.0)


def run(case: cases.Case, impl: str, dtype, per_tensor: bool):
  """``impl``'s output on ``case`` quantised to ``dtype`` (NaN-free, or it raises)."""
  args, kwargs = cases.quantized_args(case, dtype, per_tensor=per_tensor)
  if impl in INTERPRETED:
    out = _interpreted(impl, args, **kwargs)
  else:
    out = KERNELS[impl](*args, sm_scale=SM_SCALE, **kwargs)
  if not np.all(np.isfinite(np.asarray(out))):
    raise RuntimeError(f"{impl} read NaN memory")
  return out


def errors(case: cases.Case, expected, out) -> tuple[float, float]:
  """(all heads, worst head) relative errors of ``out`` against ``expected``."""
  return (cases.relative_error(out, expected, case),
          cases.relative_error(out, expected, case, per_head=True))


def _interpreted(impl: str, args, *, kv_dtype, k_scales, v_scales):
  """``impl(*args, interpret=True)``, compiled once per (impl, shapes, K/V dtype): the
  layer, the scales and every array are traced."""
  args = args[:3] + (jnp.int32(args[3]),) + args[4:]
  key = (impl, jnp.dtype(kv_dtype).name,
         tuple((jnp.shape(a), jnp.result_type(a)) for a in args))
  if key not in _EXECUTABLES:
    kernel = INTERPRETED[impl]

    def run(k_scales, v_scales, *a):
      return kernel(*a, sm_scale=SM_SCALE, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, interpret=True)

    lowered = jax.jit(run).lower(k_scales, v_scales, *args)
    _EXECUTABLES[key] = lowered.compile(_FAST_CPU_COMPILE)
  return _EXECUTABLES[key](k_scales, v_scales, *args)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="one seed")
  parser.add_argument("--seeds", type=int, default=10)
  parser.add_argument("--pallas-seeds", type=int, default=None,
                      help="run the interpreted Pallas kernels on the first N seeds only "
                           "(default: all)")
  parser.add_argument("--no-pallas", action="store_true",
                      help="the reference and the XLA path only")
  args = parser.parse_args(argv)
  seeds = range(20, 20 + (1 if args.quick else args.seeds))
  pallas_seeds = 0 if args.no_pallas else (
      len(seeds) if args.pallas_seeds is None else min(args.pallas_seeds, len(seeds)))
  impl_times = {}  # impl -> seconds (compiles included)
  start = time.perf_counter()

  results = {}  # (dtype, scales, impl) -> [(all, worst head)] over seeds
  vs_reference = {}  # (dtype, scales, impl) -> [all heads error against the reference]
  sweep = {}  # (dtype, k gain) -> [(all, worst head)]
  for seed in seeds:
    case = cases.quant_accuracy_case(seed)
    expected = cases.oracle(case, SM_SCALE)
    for dtype in DTYPES:
      name = jnp.dtype(dtype).name
      for scales, per_tensor in (("per token and head", False), ("per tensor", True)):
        impls = list(KERNELS) + (list(INTERPRETED) if seed < seeds.start + pallas_seeds
                                 else [])
        reference = None
        for impl in impls:
          t0 = time.perf_counter()
          out = run(case, impl, dtype, per_tensor)
          impl_times[impl] = impl_times.get(impl, 0.0) + time.perf_counter() - t0
          reference = out if reference is None else reference  # KERNELS' first
          results.setdefault((name, scales, impl), []).append(errors(case, expected, out))
          vs_reference.setdefault((name, scales, impl), []).append(
              cases.relative_error(out, np.asarray(reference, np.float64), case))
    for gain in K_GAINS:
      stressed = cases.quant_accuracy_case(seed, outlier_k_gain=gain)
      expected = cases.oracle(stressed, SM_SCALE)
      for dtype in DTYPES:
        sweep.setdefault((jnp.dtype(dtype).name, gain), []).append(
            errors(stressed, expected, run(stressed, "reference", dtype, False)))

  n = len(seeds)
  lines = ["| K/V dtype | scales | impl | all heads: mean | all heads: max | worst head: mean "
           "| worst head: max | bound (all heads) | seeds within it | vs reference: max |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for (name, scales, impl), errs in results.items():
    e = np.asarray(errs)
    within = int((e[:, 0] <= BOUND[name]).sum())
    same = "-" if impl == "reference" else f"{max(vs_reference[name, scales, impl]):.1e}"
    lines.append(f"| {name} | {scales} | {impl} | {e[:, 0].mean():.2e} | {e[:, 0].max():.2e} | "
                 f"{e[:, 1].mean():.2e} | {e[:, 1].max():.2e} | {BOUND[name]:.1e} | "
                 f"{within}/{len(e)} | {same} |")
  table = "\n".join(lines)
  lines = ["| K/V dtype | outlier K gain | all heads: mean | all heads: max | worst head: mean "
           "| worst head: max |", "|---|---:|---:|---:|---:|---:|"]
  for (name, gain), errs in sweep.items():
    e = np.asarray(errs)
    lines.append(f"| {name} | {gain:g}x | {e[:, 0].mean():.2e} | {e[:, 0].max():.2e} | "
                 f"{e[:, 1].mean():.2e} | {e[:, 1].max():.2e} |")
  sweep_table = "\n".join(lines)
  machine = (f"{platform.machine()} CPU, jax {jax.__version__}, backend "
             f"{jax.default_backend()}")
  print(table)
  print(f"\nOutlier tokens' K gain (reference, scales per token and head):\n\n{sweep_table}")
  times = ", ".join(f"{impl} {t:.1f} s" for impl, t in impl_times.items())
  print(f"\n{n} seed(s) ({seeds.start}..{seeds.stop - 1}), the interpreted Pallas kernels "
        f"on {pallas_seeds}; {machine}; {time.perf_counter() - start:.1f} s ({times})")
  return dict(results=results, sweep=sweep, times=impl_times)


if __name__ == "__main__":
  main()
  sys.exit(0)
