"""Attention accuracy with a quantised KV cache: int8 and float8_e4m3fn, one scale per token
and KV head (the cache's layout) against one scale per tensor, on the reference and the
XLA path.

Data (``tests/attention_cases.py::quant_accuracy_case``): a ragged batch (decodes at 9, 130
and 200 tokens, prefill chunks of 24 and 3 rows), four KV heads whose K and V are 1x, 2.2x,
4.6x and 10x apart (q divided by the same factor: logits of std ~1), GQA 2, D = 128, Z = 16,
unused memory NaN, and three outlier tokens whose V is 8x their head's (K 1x). Each seed
draws new data. The error is against the float64 oracle of the unquantised float32 K/V:

- "all heads": max |err| / max |out| over every live row and head (the issue's metric);
- "worst head": that ratio per query head, each against its own max |out|, the largest.

A second table sweeps the outlier tokens' K gain (their logits grow with it) on the
reference, per token and head: what 8-bit K costs when a few tokens' keys are much larger.

    python benchmarks/kv_quant_accuracy.py            # 10 seeds (about 2 minutes on CPU)
    python benchmarks/kv_quant_accuracy.py --quick    # 1 seed
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

from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.xla import ragged_paged_attention as xla_attention
from tests import attention_cases as cases

KERNELS = {"reference": ragged_paged_attention_reference, "xla": xla_attention}
DTYPES = (jnp.int8, jnp.float8_e4m3fn)
BOUND = {"int8": 1.5e-2, "float8_e4m3fn": 6e-2}
SM_SCALE = 128 ** -0.5
K_GAINS = (1.0, 2.0, 4.0, 8.0)


def errors(case: cases.Case, expected, impl: str, dtype, per_tensor: bool) -> tuple[float, float]:
  """(all heads, worst head) relative errors of ``impl`` on ``case`` quantised to ``dtype``."""
  args, kwargs = cases.quantized_args(case, dtype, per_tensor=per_tensor)
  out = KERNELS[impl](*args, sm_scale=SM_SCALE, **kwargs)
  if not np.all(np.isfinite(np.asarray(out))):
    raise RuntimeError(f"{impl} read NaN memory")
  return (cases.relative_error(out, expected, case),
          cases.relative_error(out, expected, case, per_head=True))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="one seed")
  parser.add_argument("--seeds", type=int, default=10)
  args = parser.parse_args(argv)
  seeds = range(20, 20 + (1 if args.quick else args.seeds))
  start = time.perf_counter()

  results = {}  # (dtype, scales, impl) -> [(all, worst head)] over seeds
  sweep = {}  # (dtype, k gain) -> [(all, worst head)]
  for seed in seeds:
    case = cases.quant_accuracy_case(seed)
    expected = cases.oracle(case, SM_SCALE)
    for dtype in DTYPES:
      name = jnp.dtype(dtype).name
      for scales, per_tensor in (("per token and head", False), ("per tensor", True)):
        for impl in KERNELS:
          results.setdefault((name, scales, impl), []).append(
              errors(case, expected, impl, dtype, per_tensor))
    for gain in K_GAINS:
      stressed = cases.quant_accuracy_case(seed, outlier_k_gain=gain)
      expected = cases.oracle(stressed, SM_SCALE)
      for dtype in DTYPES:
        sweep.setdefault((jnp.dtype(dtype).name, gain), []).append(
            errors(stressed, expected, "reference", dtype, False))

  n = len(seeds)
  lines = ["| K/V dtype | scales | impl | all heads: mean | all heads: max | worst head: mean "
           "| worst head: max | bound (all heads) | seeds within it |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for (name, scales, impl), errs in results.items():
    e = np.asarray(errs)
    within = int((e[:, 0] <= BOUND[name]).sum())
    lines.append(f"| {name} | {scales} | {impl} | {e[:, 0].mean():.2e} | {e[:, 0].max():.2e} | "
                 f"{e[:, 1].mean():.2e} | {e[:, 1].max():.2e} | {BOUND[name]:.1e} | "
                 f"{within}/{len(e)} |")
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
  print(f"\n{n} seed(s) ({seeds.start}..{seeds.stop - 1}); {machine}; "
        f"{time.perf_counter() - start:.1f} s")
  return dict(results=results, sweep=sweep)


if __name__ == "__main__":
  main()
  sys.exit(0)
