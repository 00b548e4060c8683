"""Every GPU impl against the reference on one GPU, through the public API, variants included.

``benchmarks/gpu/run.py`` checks the two Pallas GPU kernels on plain attention over pools
of a 16-bit dtype. This script checks what a user's model really calls: ``paged_attention``
over a ``KVCache`` (pools of storage bits, int8 / float8 pools with their per-token scales,
unused pages and the tail of each last page NaN, block tables shuffled), for every impl the
GPU offers ("xla", "pallas_gpu", "pallas_mosaic_gpu" and what "auto" picks), with sliding
window, logit soft cap and sinks alone and together, against ``impl="reference"`` on the
same cache. One ragged batch: long decodes (split-K), a chunked prefill, a full prefill, a
short decode and padding rows.

Tolerances (``|got - want| <= tol * (1 + |want|)``): 2e-5 for float32 pools and queries
(what the CPU tests hold), 2e-2 otherwise (bfloat16 output rounding; the quantised pools
are compared with the reference on the same quantised values, so the quantisation error is
not counted here: ``benchmarks/kv_quant_accuracy.py`` measures that).

Each impl of each case runs in its own try (an impl that refuses a case is recorded as
refused, not failed); rows are printed as they come and the table is written to
``$OUT/parity.md`` after each case.

  PYTHONPATH=. python benchmarks/gpu/parity.py [--quick] [--budget-s 150]
  PYTHONPATH=. python benchmarks/gpu/parity.py --smoke-cpu   # plumbing, interpret mode
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import KVCacheSpec, paged_attention
from paged_jax import testing as pj_testing
from paged_jax.attention import resolve_impl

BLOCK_SIZE = 16
# (q_len, kv_len): two long decodes (split-K), a chunked prefill onto cached tokens, a
# full prefill, a short decode; three padding rows follow.
SEQS = ((1, 5000), (1, 2100), (40, 700), (64, 64), (1, 17))
SMOKE_SEQS = ((1, 70), (9, 40), (1, 5))
PAD_ROWS = 3
# (name, pool dtype, q dtype, num_q_heads, num_kv_heads, head_dim, variant keywords)
ALL = dict(sliding_window=300, soft_cap=30.0, sinks=True)
CASES = (
    ("f32", jnp.float32, jnp.float32, 32, 8, 128, {}),
    ("f32 all", jnp.float32, jnp.float32, 32, 8, 128, ALL),
    ("bf16", jnp.bfloat16, jnp.bfloat16, 32, 8, 128, {}),
    ("bf16 window", jnp.bfloat16, jnp.bfloat16, 32, 8, 128, dict(sliding_window=300)),
    ("bf16 cap", jnp.bfloat16, jnp.bfloat16, 32, 8, 128, dict(soft_cap=30.0)),
    ("bf16 sinks", jnp.bfloat16, jnp.bfloat16, 32, 8, 128, dict(sinks=True)),
    ("bf16 all", jnp.bfloat16, jnp.bfloat16, 32, 8, 128, ALL),
    ("bf16 all D256 G2", jnp.bfloat16, jnp.bfloat16, 8, 4, 256, ALL),
    ("f32 all D256 G2", jnp.float32, jnp.float32, 8, 4, 256, ALL),
    ("bf16 all D96", jnp.bfloat16, jnp.bfloat16, 16, 8, 96, ALL),
    ("f32 D80", jnp.float32, jnp.float32, 16, 8, 80, {}),
    ("bf16 all D64 MQA", jnp.bfloat16, jnp.bfloat16, 8, 1, 64, ALL),
    ("f16", jnp.float16, jnp.float16, 32, 8, 128, {}),
    ("int8", jnp.int8, jnp.bfloat16, 32, 8, 128, {}),
    ("int8 all", jnp.int8, jnp.bfloat16, 32, 8, 128, ALL),
    ("fp8", jnp.float8_e4m3fn, jnp.bfloat16, 32, 8, 128, {}),
    ("fp8 all", jnp.float8_e4m3fn, jnp.bfloat16, 32, 8, 128, ALL),
    ("int8 f32q", jnp.int8, jnp.float32, 32, 8, 128, {}),
)
QUICK_CASES = ("f32", "bf16 all", "int8 all", "fp8")
IMPLS = ("xla", "pallas_gpu", "pallas_mosaic_gpu", "auto")


def build_case(dtype, q_dtype, num_q_heads, num_kv_heads, head_dim, variant, seqs, seed):
  """``(q, cache, metadata, static, sinks)``: K/V written through ``KVCache.write`` into a
  NaN cache at shuffled blocks, layer 1 of 2 holding them (layer 0 stays NaN); ``static``
  the variant's window / cap keywords, ``sinks`` f32[H] or None."""
  rng = np.random.default_rng(seed)
  pages = [-(-kv // BLOCK_SIZE) for _, kv in seqs]
  width = max(pages) + 1
  num_blocks = sum(pages) + 8
  spec = KVCacheSpec(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=BLOCK_SIZE, num_blocks=num_blocks, dtype=dtype)
  cache = pj_testing.nan_cache(spec)
  order = rng.permutation(num_blocks)
  tables = np.zeros((len(seqs), width), np.int32)
  slots, start = [], 0
  for i, ((_, kv), n) in enumerate(zip(seqs, pages)):
    tables[i, :n] = order[start:start + n]
    tables[i, n:] = order[(start + n) % num_blocks]  # another sequence's block: never read
    start += n
    pos = np.arange(kv)
    slots.append(tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
  slots = np.concatenate(slots).astype(np.int32)
  # Head-wise scales 10x apart and a few outlier tokens: the structure real K/V have.
  head_scale = np.geomspace(0.3, 3.0, num_kv_heads)[None, :, None]
  k = rng.normal(size=(len(slots), num_kv_heads, head_dim)) * head_scale
  v = rng.normal(size=(len(slots), num_kv_heads, head_dim)) * head_scale
  k[rng.choice(len(slots), 4, replace=False)] *= 8.0
  cache = cache.write(1, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                      jnp.asarray(slots))
  q_lens = np.array([q for q, _ in seqs], np.int32)
  num_tokens = int(q_lens.sum()) + PAD_ROWS
  q = jnp.asarray(rng.normal(size=(num_tokens, num_q_heads, head_dim)), q_dtype)
  metadata = (jnp.asarray([kv for _, kv in seqs], jnp.int32), jnp.asarray(tables),
              jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
              jnp.int32(len(seqs)))
  static = {key: value for key, value in variant.items() if key != "sinks"}
  sinks = None
  if variant.get("sinks"):
    sinks = jnp.asarray(rng.normal(size=num_q_heads) * 2.0, jnp.float32)
  return q, cache, metadata, static, sinks


def attention_fn(impl, static, interpret):
  @jax.jit
  def f(q, cache, kv_lens, tables, cu, num_seqs, sinks):
    return paged_attention(q, cache, 1, kv_lens, tables, cu, num_seqs, sinks=sinks,
                           impl=impl, interpret=interpret and impl != "xla", **static)
  return f


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "./out"))
  parser.add_argument("--budget-s", type=float, default=150.0,
                      help="start no new case after this many seconds (default 150)")
  parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_CASES)}")
  parser.add_argument("--cases", default="",
                      help="comma-separated case names to run (default: all)")
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help=f"comma-separated impls to check (default: {','.join(IMPLS)})")
  parser.add_argument("--smoke-cpu", action="store_true",
                      help="plumbing test on CPU: small batch, Pallas kernels interpreted")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  seqs = SMOKE_SEQS if args.smoke_cpu else SEQS
  cases = [c for c in CASES if not (args.quick or args.smoke_cpu) or c[0] in QUICK_CASES]
  if args.cases:
    names = args.cases.split(",")
    unknown = sorted(set(names) - {c[0] for c in CASES})
    if unknown:
      parser.error(f"--cases: unknown {unknown}; known: {[c[0] for c in CASES]}")
    cases = [c for c in CASES if c[0] in names]
  impls = tuple(args.impls.split(","))
  if not set(impls) <= set(IMPLS):
    parser.error(f"--impls must name some of {IMPLS}, got {impls}")
  auto = resolve_impl("auto")
  header = (f"Device: {jax.devices()[0].device_kind}, jax {jax.__version__}; "
            f"impl='auto' resolves to {auto} (per call it may pass over a kernel that "
            "refuses the shapes). Max abs error against impl='reference' on the same cache.")
  lines = [header, "", "| case | tol | " + " | ".join(impls) + " |",
           "|---|---|" + "---|" * len(impls)]
  print(header, flush=True)
  failures = 0
  for name, dtype, q_dtype, h, kh, d, variant in cases:
    if time.perf_counter() - start > args.budget_s:
      lines.append(f"| {name} | | skipped: budget spent |" + " |" * (len(impls) - 1))
      continue
    exact = jnp.dtype(dtype) == jnp.float32 and jnp.dtype(q_dtype) == jnp.float32
    tol = 2e-5 if exact else 2e-2
    cells = []
    try:
      q, cache, meta, static, sinks = build_case(dtype, q_dtype, h, kh, d, variant, seqs,
                                                 seed=len(name))
      want = np.asarray(attention_fn("reference", static, False)(q, cache, *meta, sinks),
                        np.float32)
    except Exception as e:  # noqa: BLE001 - one case's failure stays in its row
      traceback.print_exc()
      lines.append(f"| {name} | {tol:g} | reference failed: {type(e).__name__} |"
                   + " |" * (len(impls) - 1))
      failures += 1
      continue
    live = int(np.asarray(meta[2])[-1])
    for impl in impls:
      try:
        got = np.asarray(attention_fn(impl, static, args.smoke_cpu)(q, cache, *meta, sinks),
                         np.float32)
        err = float(np.max(np.abs(got[:live] - want[:live])))
        ok = bool(np.all(np.abs(got[:live] - want[:live]) <= tol * (1 + np.abs(want[:live]))))
        ok = ok and bool(np.all(np.isfinite(got)))
        failures += not ok
        cells.append(f"{err:.1e}{'' if ok else ' FAIL'}")
      except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
        refused = isinstance(e, ValueError) and "impl=" in message
        if not refused:
          traceback.print_exc()
          failures += 1
        cells.append(("refused" if refused else "error") + f": {message[:80]}")
      print(f"{name} [{impl}]: {cells[-1]}", flush=True)
    lines.append(f"| {name} | {tol:g} | " + " | ".join(cells) + " |")
    (out_dir / "parity.md").write_text("\n".join(lines) + "\n")
  lines += ["", f"{failures} failing cell(s); {time.perf_counter() - start:.0f} s."]
  text = "\n".join(lines) + "\n"
  (out_dir / "parity.md").write_text(text)
  print(text, flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
