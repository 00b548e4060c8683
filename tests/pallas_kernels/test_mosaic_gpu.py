"""Mosaic GPU ragged paged attention: the Mosaic GPU interpret mode on CPU, CUDA lowering.

What runs where (see ``pallas_kernels/mosaic_gpu/kernel.py``): in interpret mode the whole
kernel runs (TMA copies through the block table, per-page barriers and their phases, the
ring of chunk buffers, staging of storage bits / float32 pieces, masks, online softmax,
sinks, split-K and the epilogue) except the two tensor-core dots and layout casts, which
``_Primitives`` swaps for ``jnp.dot`` of the same shared-memory operands. The Hopper
primitives (``wgmma`` with a transposed operand, accumulator ``run_state``, layout
casts, register layouts) are covered by lowering for CUDA, which runs Mosaic GPU's own
lowering and its shared-memory check, but nothing here executes them: that needs a GPU.

Interpreted kernels are slow on CPU (each shared-memory access is a host callback), so
shapes are small, one ragged batch per case packs decode, chunked prefill, full prefill,
an empty sequence and padding together, and the interpreter's host program is compiled
with XLA's cheaper CPU settings (``_interpret_run``); the product grid is marked slow.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import mosaic_gpu
from paged_jax.pallas_kernels.mosaic_gpu import MosaicTiling
from paged_jax.pallas_kernels.mosaic_gpu import compat
from paged_jax.pallas_kernels.mosaic_gpu import items as items_lib
from paged_jax.pallas_kernels.mosaic_gpu import kernel as kernel_lib
from paged_jax.pallas_kernels.mosaic_gpu import tiling as tiling_lib
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from tests import attention_cases

pytestmark = pytest.mark.skipif(not mosaic_gpu.available(),
                                reason="this JAX has no Mosaic GPU Pallas backend")
needs_interpret = pytest.mark.skipif(not mosaic_gpu.interpret_available(),
                                     reason="this JAX has no Mosaic GPU interpret mode")

TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-2}

# The interpreter's host program is large (a callback per shared-memory access); XLA's
# default CPU pipeline spends seconds optimising code that runs once. These settings
# halve its compile time and change nothing it computes.
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}
_COMPILED = attention_cases.CompiledCache(keep=4)  # the last few compiled interpreters


@pytest.fixture(autouse=True)
def _reset_interpreter_after_failure(request):
  """An exception inside an interpreted kernel leaves the interpreter's global state
  behind, and every later interpreted kernel would fail on it."""
  yield
  if compat.interpret_available():
    compat.reset_interpret_state()


def _interpret_run(args, *, count_pages=False, **statics):
  """``ragged_paged_attention(*args, interpret=True, **statics)``, compiled once per
  (shapes, dtypes, statics) and shared between tests. ``count_pages``: run
  ``copied_pages`` instead (returns ``(out, CopiedPages)``)."""
  arrays = [a for a in args if a is not None]
  key = (count_pages, tuple((jnp.shape(a), jnp.result_type(a)) for a in arrays),
         tuple((k, v if not isinstance(v, jax.Array) else "array") for k, v in
               sorted(statics.items(), key=lambda kv: kv[0])))
  traced = {k: v for k, v in statics.items() if isinstance(v, jax.Array)}
  static = {k: v for k, v in statics.items() if not isinstance(v, jax.Array)}

  def compile_fn():
    run = mosaic_gpu.copied_pages if count_pages else mosaic_gpu.ragged_paged_attention
    fn = jax.jit(lambda traced_kw, *a: run(*a, interpret=True, **static, **traced_kw))
    return fn.trace(traced, *args).lower().compile(_FAST_CPU_COMPILE)

  return _COMPILED.get(key, compile_fn)(traced, *args)


def _case(seed, *, dtype, group, head_dim, block_size, num_kv_heads=1, q_lens=None,
          kv_lens=None):
  if q_lens is None:
    q_lens, kv_lens = attention_cases.mixed_lengths(block_size)
  return attention_cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens, group=group,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   block_size=block_size, dtype=dtype)


def _kwargs(variant):
  kwargs = dict(variant)
  if kwargs.get("sinks") is not None:
    kwargs["sinks"] = jnp.asarray(kwargs["sinks"])
  return kwargs


def _check(case, variant=(), *, storage=False, tiling=None, q_dtype=None):
  """The kernel (interpret mode) against the jnp reference and the float64 oracle;
  padding rows must be exactly zero. ``storage``: the pages go in as the pool's storage
  bits with ``kv_dtype``."""
  variant = dict(variant)
  kv_dtype = case.kv_dtype if storage else None
  args = list(case.jax_args(storage=storage))
  if q_dtype is not None:
    args[0] = args[0].astype(q_dtype)
  sm_scale = case.q_THD.shape[-1] ** -0.5
  out = _interpret_run(args, sm_scale=sm_scale, kv_dtype=kv_dtype, tiling=tiling,
                       **_kwargs(variant))
  assert out.dtype == args[0].dtype and out.shape == case.q_THD.shape
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  tol = TOLERANCE[jnp.dtype(args[0].dtype).name if q_dtype is not None else case.kv_dtype.name]
  ref = ragged_paged_attention_reference(*args, sm_scale=sm_scale, kv_dtype=kv_dtype,
                                         **_kwargs(variant))
  np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
  oracle = attention_cases.oracle(case, sm_scale, **variant)
  np.testing.assert_allclose(out, oracle, rtol=tol, atol=tol)
  live_rows = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_array_equal(out[live_rows:], 0.0)
  return out


def _named_variant(case, name):
  context = int(max(case.kv_lens_S[:case.num_seqs]))
  return dict(attention_cases.variant_grid(context, case.num_q_heads))[name]


# --- A hand-computed case. ---

def test_hand_computed_sink_takes_half_the_mass_across_splits():
  # 65 keys, all k = 0 (score 0), all v = 2 e0; two query heads on one KV head (G = 2),
  # one decode query at position 64. Head 0's sink is ln 65: denominator
  # e^(ln 65) + 65 * e^0 = 130, out = 65 * 2 / 130 = 1, half of the sinkless 2. Head 1's
  # sink is 0: out = 130 / (1 + 65) = 1.9697. J = 64, so the keys span 2 chunks, one per
  # split: a sink counted in both splits would give head 0 130 / 195 = 0.667.
  head_dim, block_size, kv_len = 64, 16, 65
  num_blocks = -(-kv_len // block_size)
  k_JD = np.full((num_blocks * block_size, head_dim), np.nan, np.float32)  # NaN tail
  v_JD = np.full_like(k_JD, np.nan)
  k_JD[:kv_len] = 0.0
  v_JD[:kv_len] = 0.0
  v_JD[:kv_len, 0] = 2.0
  # Logical page p lives in block N - 1 - p: the pool holds the pages in reverse.
  pages = lambda x: jnp.asarray(x.reshape(1, 1, num_blocks, block_size, head_dim)[:, :, ::-1])
  tables = jnp.arange(num_blocks, dtype=jnp.int32)[None, ::-1]
  q = np.ones((2, 2, head_dim), np.float32)  # row 1 is padding
  args = (jnp.asarray(q), pages(k_JD), pages(v_JD), jnp.int32(0),
          jnp.array([kv_len], jnp.int32), tables, jnp.array([0, 1], jnp.int32),
          jnp.int32(1))
  sinks = jnp.array([np.log(65.0), 0.0], jnp.float32)
  tiling = MosaicTiling(q_tile=1, chunk_size=64, num_splits=2, num_stages=1)
  out = np.asarray(_interpret_run(args, sm_scale=1.0, sinks=sinks, tiling=tiling))
  np.testing.assert_allclose(out[0, :, 0], [1.0, 130.0 / 66.0], rtol=1e-6)
  np.testing.assert_array_equal(out[0, :, 1:], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)  # padding row


# --- Parity with the reference, interpret mode. ---

# A covering default subset: the staged path (bf16 storage bits, with every variant and a
# split ring), the float32 path (three bf16 pieces per operand) and the direct path (bf16
# pages read by the dots where they land), GQA 1/4/8, head dims 64/128/256; float32 at
# D = 256 (its default chunk is J = 16, staged through transposed tiles) and the small
# chunks at other shapes: J = 16 over pages of 8 (two copies a chunk) in a ring of 3, J =
# 32 as part of a page of 64 over storage bits.
FAST_CASES = (
    # (dtype, storage, G, D, Z, variant, tiling)
    ("bfloat16", True, 4, 64, 16, "all",
     MosaicTiling(q_tile=4, chunk_size=64, num_splits=2, num_stages=2)),
    ("float32", False, 1, 128, 32, "window_sinks", None),
    ("bfloat16", False, 8, 256, 64, None, None),
    ("float32", False, 2, 256, 16, "all", None),
    ("float32", False, 1, 64, 8, "window_sinks",
     MosaicTiling(q_tile=1, chunk_size=16, num_splits=2, num_stages=3)),
    pytest.param(("bfloat16", True, 4, 128, 64, "all",
                  MosaicTiling(q_tile=8, chunk_size=32, num_splits=1, num_stages=2)),
                 marks=pytest.mark.slow),
    ("bfloat16", True, 4, 96, 16, "all", None),  # Phi-3's D = 96: 64-byte swizzles
)


def _fast_id(params):
  dtype, storage, group, head_dim, block_size, variant, tiling = params
  split = "" if tiling is None else (f"-Q{tiling.q_tile}X{tiling.num_splits}"
                                     f"J{tiling.chunk_size}")
  bits = "-bits" if storage else ""
  return f"{dtype}{bits}-G{group}-D{head_dim}-Z{block_size}-{variant}{split}"


@needs_interpret
@pytest.mark.parametrize("params", FAST_CASES, ids=_fast_id)
def test_matches_reference(params):
  dtype, storage, group, head_dim, block_size, variant, tiling = params
  case = _case(zlib.crc32(_fast_id(params).encode()), dtype=jnp.dtype(dtype), group=group,
               head_dim=head_dim, block_size=block_size)
  variant = {} if variant is None else _named_variant(case, variant)
  _check(case, variant, storage=storage, tiling=tiling)


@needs_interpret
def test_no_live_rows_is_zero():
  # The first fast case's shapes and statics (its compiled interpreter is reused): with
  # num_seqs = 0 every item is empty, every program writes zeros and lse = -inf.
  dtype, storage, group, head_dim, block_size, variant, tiling = FAST_CASES[0]
  case = _case(zlib.crc32(_fast_id(FAST_CASES[0]).encode()), dtype=jnp.dtype(dtype),
               group=group, head_dim=head_dim, block_size=block_size)
  args = list(case.jax_args(storage=storage))
  args[7] = jnp.int32(0)
  out = _interpret_run(args, sm_scale=head_dim ** -0.5, kv_dtype=case.kv_dtype,
                       tiling=tiling, **_kwargs(_named_variant(case, variant)))
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), 0.0)


# dtype / storage x GQA x head dim, half of it (i + j + k even), the block size cycling:
# 18 cases cover every (dtype, G), (dtype, D) and (G, D) pair, each dtype with two or
# three block sizes (float32 at D = 256 takes chunks of J = 16, see below).
FULL_GRID = tuple(
    (dtype, storage, group, head_dim, (8, 16, 64)[(i + j + k) % 3])
    for k, (dtype, storage) in enumerate((("float32", False), ("bfloat16", True),
                                          ("bfloat16", False), ("float16", True)))
    for i, group in enumerate((1, 4, 8)) for j, head_dim in enumerate((64, 128, 256))
    if (i + j + k) % 2 == 0)


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("params", FULL_GRID, ids=lambda p: "-".join(map(str, p)))
def test_matches_reference_full_grid(params):
  dtype, storage, group, head_dim, block_size = params
  case = _case(7 + group + head_dim, dtype=jnp.dtype(dtype), group=group,
               head_dim=head_dim, block_size=block_size, num_kv_heads=2)
  _check(case, storage=storage)


# Head dims that are multiples of 16 but not of 64 (two-byte rows of 32 or 64 bytes: the
# smaller swizzles), and D = 192 in float32 (chunks of 32, its tiles transposed).
BETWEEN_DIMS = (("float32", False, 16, 8), ("bfloat16", True, 48, 16),
                ("float32", False, 80, 32), ("bfloat16", False, 112, 16),
                ("float16", True, 160, 64), ("float32", False, 192, 16))


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("params", BETWEEN_DIMS, ids=lambda p: "-".join(map(str, p)))
def test_head_dims_between_the_powers(params):
  dtype, storage, head_dim, block_size = params
  case = _case(11 + head_dim, dtype=jnp.dtype(dtype), group=2, head_dim=head_dim,
               block_size=block_size)
  _check(case, _named_variant(case, "all"), storage=storage)


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_float32_queries_over_bf16_pages(block_size):
  # Mixed dtypes compute in float32 (three pieces), the bf16 pages as storage bits.
  case = _case(31, dtype=jnp.bfloat16, group=2, head_dim=64, block_size=block_size)
  case.q_THD = case.q_THD.astype(np.float32)
  _check(case, storage=True)


VARIANT_SHAPES = (("float32", False, 1, 64, 8), ("float32", False, 4, 128, 16),
                  ("bfloat16", True, 8, 256, 16), ("bfloat16", True, 4, 64, 32),
                  ("bfloat16", False, 2, 128, 8))
VARIANT_NAMES = tuple(name for name, _ in attention_cases.variant_grid(10, 1))
# Each variant with one float32 shape and one bf16 shape (cycling through them): every
# variant meets both compute paths, every shape 4 to 5 variants (the whole product, 50
# interpreted kernels, took a sixth of the slow run for little the pairs do not cover).
VARIANT_CASES = tuple((VARIANT_SHAPES[k], name) for i, name in enumerate(VARIANT_NAMES)
                      for k in (i % 2, 2 + i % 3))


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("shape, variant", VARIANT_CASES,
                         ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x)))
def test_variants_full_grid(shape, variant):
  dtype, storage, group, head_dim, block_size = shape
  case = _case(len(variant) + head_dim + group, dtype=jnp.dtype(dtype), group=group,
               head_dim=head_dim, block_size=block_size)
  _check(case, _named_variant(case, variant), storage=storage)


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("variant", ("window_sinks", "all"))  # "all": window, cap, sinks
@pytest.mark.parametrize("num_splits, num_stages", [(1, 1), (3, 2), (4, 4)])
def test_split_k_long_sequences(variant, num_splits, num_stages):
  # Long decode and chunked prefill rows: 300 positions are 5 chunks of J = 64, so the
  # ring of 1, 2 or 4 stages wraps, and splits get 1 to 5 chunks (some none).
  case = _case(21, dtype=jnp.bfloat16, group=4, head_dim=64, block_size=16,
               q_lens=[1, 9, 1], kv_lens=[300, 250, 7])
  variant = {} if variant == "none" else _named_variant(case, variant)
  _check(case, variant, storage=True,
         tiling=MosaicTiling(q_tile=4, chunk_size=64, num_splits=num_splits,
                             num_stages=num_stages))


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("dtype, storage", [("bfloat16", True), ("float32", False)])
def test_128_packed_rows(dtype, storage):
  # Q = 32 rows of G = 4 heads: M = 128 packed rows (two 64-row wgmma blocks), tiles
  # crossing sequence boundaries, a long prefill chunk over several chunks.
  case = _case(27, dtype=jnp.dtype(dtype), group=4, head_dim=64, block_size=16,
               q_lens=[40, 1, 70], kv_lens=[90, 33, 200])
  _check(case, _named_variant(case, "window_sinks"), storage=storage,
         tiling=MosaicTiling(q_tile=32, chunk_size=64, num_splits=2, num_stages=2))


@needs_interpret
def test_pages_before_the_window_are_never_read():
  # Poison with NaN every page lying wholly before a sequence's first window (its first
  # query's position - W + 1): a page the kernel copied would carry its NaN V rows into
  # the P V dot (only rows past the horizon and skipped pages are zeroed), and the
  # interpreter reads exactly what the TMA copies bring.
  window = 20
  case = _case(23, dtype=jnp.bfloat16, group=4, head_dim=64, block_size=8,
               q_lens=[1, 3], kv_lens=[150, 100])
  z = case.k_pages_LKNZD.shape[3]
  case.k_pages_LKNZD = case.k_pages_LKNZD.copy()
  case.v_pages_LKNZD = case.v_pages_LKNZD.copy()
  poisoned = 0
  for i in range(case.num_seqs):
    q_len = int(case.cu_q_lens[i + 1] - case.cu_q_lens[i])
    first = int(case.kv_lens_S[i]) - q_len
    for p in range(max(0, first - window + 1) // z):  # pages wholly before the window
      block = case.block_tables_SP[i, p]
      case.k_pages_LKNZD[:, :, block] = np.nan
      case.v_pages_LKNZD[:, :, block] = np.nan
      poisoned += 1
  assert poisoned >= 20
  _check(case, dict(sliding_window=window), storage=True,
         tiling=MosaicTiling(q_tile=2, chunk_size=64, num_splits=2, num_stages=2))


def _poison_pages_before_first_windows(case, window):
  """NaN in every page lying wholly before its sequence's first query's window (all of
  its positions <= first position - W); returns how many pages."""
  z = case.k_pages_LKNZD.shape[3]
  case.k_pages_LKNZD = case.k_pages_LKNZD.copy()
  case.v_pages_LKNZD = case.v_pages_LKNZD.copy()
  poisoned = 0
  for i in range(case.num_seqs):
    first = int(case.kv_lens_S[i]) - int(case.cu_q_lens[i + 1] - case.cu_q_lens[i])
    for p in range(max(0, first - window + 1) // z):
      block = case.block_tables_SP[i, p]
      case.k_pages_LKNZD[:, :, block] = np.nan
      case.v_pages_LKNZD[:, :, block] = np.nan
      poisoned += 1
  return poisoned


def _window_copies(case, *, q_tile, window, chunk):
  """What the kernel must copy, from the case alone (not from ``items``): for each
  (query tile, sequence) pair with live rows, at positions first..last, the pages holding
  a key some row sees (positions max(first - W + 1, 0) .. last), each with its copy units
  of min(Z, J) positions up to the last query's (a page that overlaps the window is
  copied from its first slot). Sorted ``[(seq, ((entry, units), ...))]``."""
  z = case.k_pages_LKNZD.shape[3]
  unit = min(z, chunk)
  cu = [int(x) for x in case.cu_q_lens]
  expected = []
  for start in range(0, case.q_THD.shape[0], q_tile):
    for i in range(case.num_seqs):
      lo_row, hi_row = max(start, cu[i]), min(start + q_tile, cu[i + 1])
      if lo_row >= hi_row:
        continue
      pos0 = int(case.kv_lens_S[i]) - (cu[i + 1] - cu[i]) - cu[i]
      first, last = pos0 + lo_row, pos0 + hi_row - 1
      low = 0 if window is None else max(first - window + 1, 0)
      expected.append((i, tuple(
          (p, sum(1 for u in range(z // unit) if p * z + u * unit <= last))
          for p in range(low // z, last // z + 1))))
  return sorted(expected)


def _counted_copies(copied):
  """``CopiedPages`` as ``_window_copies`` writes it (KV head 0), after checking that every
  KV head copied the same and that items past the last copy nothing."""
  copies_WKP = np.asarray(copied.copies_WKP)
  live_W, seq_W = np.asarray(copied.live_W), np.asarray(copied.seq_W)
  assert np.all(copies_WKP == copies_WKP[:, :1])
  assert np.all(copies_WKP[~live_W] == 0)
  return sorted((int(seq_W[w]), tuple((int(p), int(copies_WKP[w, 0, p]))
                                      for p in np.flatnonzero(copies_WKP[w, 0])))
                for w in np.flatnonzero(live_W))


def _check_counted_output(case, args, out, variant):
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  ref = ragged_paged_attention_reference(*args, sm_scale=case.q_THD.shape[-1] ** -0.5,
                                         **variant)
  tol = TOLERANCE[case.kv_dtype.name]
  np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)


@needs_interpret
@pytest.mark.parametrize("window, block_size, kv_lens", [
    (20, 8, (200, 120, 77)),
    pytest.param(1, 8, (200, 120, 77), marks=pytest.mark.slow),
    pytest.param(None, 8, (200, 120, 77), marks=pytest.mark.slow),
    pytest.param(150, 128, (1200, 500, 77), marks=pytest.mark.slow),  # Z > J: 2 units a page
], ids=["w20-z8", "w1-z8", "nowindow-z8", "w150-z128"])
def test_copies_are_the_pages_overlapping_each_window(window, block_size, kv_lens):
  # Decode rows and a 13-row chunked prefill, tiles of Q = 4 rows (the prefill spans four
  # tiles, two of them shared with the decode rows), two KV heads, J = 64, 2 splits and a
  # 2-deep ring. The kernel's own counter (``copied_pages``: +1 where each TMA copy is
  # issued, under its condition) must list, per (tile, sequence) item, exactly the pages
  # overlapping the item's rows' windows, each copy unit once over all splits; and the
  # counted run's output must match the reference with every page before the first
  # windows NaN.
  case = _case(27, dtype=jnp.bfloat16, group=2, num_kv_heads=2, head_dim=64,
               block_size=block_size, q_lens=[1, 13, 1], kv_lens=list(kv_lens))
  if window is not None:
    assert _poison_pages_before_first_windows(case, window) >= 10
  tiling = MosaicTiling(q_tile=4, chunk_size=64, num_splits=2, num_stages=2)
  args = case.jax_args()
  out, copied = _interpret_run(args, count_pages=True, sm_scale=0.125,
                               sliding_window=window, tiling=tiling)
  assert copied.tiling == tiling
  counted = _counted_copies(copied)
  assert counted == _window_copies(case, q_tile=4, window=window, chunk=64)
  if window == 20 and block_size == 8:  # a decode row's window spans at most 4 pages
    assert max(len(entries) for seq, entries in counted if seq != 1) <= 4
  if window is None:  # the 200-token sequence's decode row copies all its 25 pages
    assert max(len(entries) for _, entries in counted) == 25
  _check_counted_output(case, args, out, dict(sliding_window=window))


@needs_interpret
def test_window_keeps_decode_copies_flat_from_512_to_8k():
  # Five decode rows at contexts 512 .. 8192 in one batch, W = 256, Z = 16, the default
  # tiling: each row's item copies the pages holding positions C - 256 .. C - 1, at most
  # ceil(W / Z) + 1 = 17 of them and here exactly 16 (C is a multiple of Z) at every
  # context, where the context holds 32 .. 512 pages. Everything before the windows is
  # NaN, and the counted run's output matches the reference.
  contexts, window, z = (512, 1024, 2048, 4096, 8192), 256, 16
  case = attention_cases.make_case(28, q_lens=[1] * len(contexts), kv_lens=list(contexts),
                                   num_kv_heads=1, group=4, head_dim=64, block_size=z,
                                   dtype=jnp.bfloat16, num_layers=1, layer=0)
  assert _poison_pages_before_first_windows(case, window) == sum(contexts) // z - 5 * 16
  args = case.jax_args()
  out, copied = _interpret_run(args, count_pages=True, sm_scale=0.125,
                               sliding_window=window)
  counted = _counted_copies(copied)
  pages = [len(entries) for _, entries in counted]
  assert [seq for seq, _ in counted] == list(range(len(contexts)))
  assert pages == [16] * len(contexts) and max(pages) <= -(-window // z) + 1
  for (seq, entries), context in zip(counted, contexts):
    assert [p for p, _ in entries] == list(range((context - window) // z, context // z))
    assert all(units == 1 for _, units in entries)  # Z <= J: one copy a page
  _check_counted_output(case, args, out, dict(sliding_window=window))


def test_copied_pages_needs_interpret_mode():
  case = _case(30, dtype=jnp.bfloat16, group=1, head_dim=64, block_size=16, q_lens=[1],
               kv_lens=[40])
  with pytest.raises(ValueError, match="count_pages=True needs interpret=True"):
    jax.jit(lambda *a: mosaic_gpu.copied_pages(*a, sm_scale=0.125, interpret=False)).trace(
        *case.jax_args()).lower(lowering_platforms=("cuda",))


@needs_interpret
@pytest.mark.slow
def test_invalid_block_ids_read_nothing():
  # A live sequence whose table names blocks outside [0, N) (invalid input) must neither
  # hang nor read out of bounds: those pages are skipped (not copied, not waited for) and
  # their positions do not count. The other sequences are unaffected.
  case = _case(24, dtype=jnp.bfloat16, group=2, head_dim=64, block_size=16,
               q_lens=[1, 3], kv_lens=[40, 50])
  args = list(case.jax_args(storage=True))
  tables = np.asarray(args[5]).copy()
  tables[0, 1] = case.k_pages_LKNZD.shape[2] + 5
  args[5] = jnp.asarray(tables)
  out = _interpret_run(args, sm_scale=0.125, kv_dtype=case.kv_dtype)
  assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
  ref = ragged_paged_attention_reference(*case.jax_args(storage=True), sm_scale=0.125,
                                         kv_dtype=case.kv_dtype)
  np.testing.assert_allclose(np.asarray(out[1:4].astype(jnp.float32)),
                             np.asarray(ref[1:4].astype(jnp.float32)), rtol=2e-2, atol=2e-2)


# --- Quantised pools (int8, float8_e4m3fn, float8_e5m2 with per-token float32 scales). ---

def _check_quantized(case, kv_dtype, variant=(), *, q_dtype, tiling=None, per_tensor=False):
  """The kernel on ``case``'s K/V quantised to ``kv_dtype`` (``quantized_args``: storage
  bits, one float32 scale per token and KV head, NaN scales in unused memory) against the
  reference on the same quantised cache and the float64 oracle of the dequantised one,
  within q's dtype's tolerance (float32: the kernel computes in float32). Returns the
  output as float64."""
  variant = dict(variant)
  args, quant = attention_cases.quantized_args(case, kv_dtype, per_tensor=per_tensor)
  args = [args[0].astype(q_dtype), *args[1:]]
  assert args[1].dtype == layout.storage_dtype(kv_dtype)
  sm_scale = case.q_THD.shape[-1] ** -0.5
  out = _interpret_run(args, sm_scale=sm_scale, tiling=tiling, **quant, **_kwargs(variant))
  assert out.dtype == args[0].dtype
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  tol = TOLERANCE[jnp.dtype(q_dtype).name]
  ref = ragged_paged_attention_reference(*args, sm_scale=sm_scale, **quant, **_kwargs(variant))
  np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
  seen = dataclasses.replace(attention_cases.dequantized_case(case, kv_dtype,
                                                               per_tensor=per_tensor),
                             q_THD=np.asarray(args[0].astype(jnp.float32)))
  np.testing.assert_allclose(out, attention_cases.oracle(seen, sm_scale, **variant),
                             rtol=tol, atol=tol)
  live_rows = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_array_equal(out[live_rows:], 0.0)
  return out


@needs_interpret
def test_quantized_window_cap_sinks_split_k():
  # int8 pages, bf16 queries, every variant at once; each 64-position chunk is four page
  # copies of Z = 16 with their scale rows, the item's range split in two.
  case = _case(41, dtype=jnp.float32, group=4, head_dim=64, block_size=16)
  _check_quantized(case, jnp.int8, _named_variant(case, "all"), q_dtype=jnp.bfloat16,
                   tiling=MosaicTiling(q_tile=4, chunk_size=64, num_splits=2, num_stages=2))


@needs_interpret
def test_quantized_small_chunks():
  # float8 pages with float32 queries in chunks of J = 16 over pages of 32 (each chunk a
  # part of one page with its scales), window, cap and sinks on: the small-chunk staging
  # (transposed tiles) with scales, in one run.
  case = _case(42, dtype=jnp.float32, group=2, head_dim=64, block_size=32)
  _check_quantized(case, jnp.float8_e4m3fn, _named_variant(case, "all"), q_dtype=jnp.float32,
                   tiling=MosaicTiling(q_tile=8, chunk_size=16, num_splits=2, num_stages=3))


@needs_interpret
def test_quantized_rows_not_a_whole_swizzle():
  # int8 at Phi-2's D = 80: 80-byte rows are no whole number of 32-byte swizzle groups, so
  # the pages land in an unswizzled ring, read in the wgmma layout; every variant on.
  case = _case(44, dtype=jnp.float32, group=2, head_dim=80, block_size=16)
  _check_quantized(case, jnp.int8, _named_variant(case, "all"), q_dtype=jnp.bfloat16)


_ACCURACY_CASE = attention_cases.quant_accuracy_case()
# Issue 20's bounds: max abs error / max abs output against the unquantised float32 K/V.
_ACCURACY_BOUND = {"int8": 1.5e-2, "float8_e4m3fn": 6e-2}


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", tuple(_ACCURACY_BOUND))
def test_quantized_accuracy_against_float32_kv(kv_dtype):
  # Issue 20's batch (heads 1x .. 10x apart, outlier tokens, NaN unused memory) with
  # float32 queries: the kernel equals the reference on the same quantised cache within
  # float32 tolerance (inside _check_quantized), and stays within the bound against the
  # unquantised K/V. For int8, one scale per tensor on the same data (same compiled
  # kernel, other scales) is the negative control: over the bound.
  case, bound = _ACCURACY_CASE, _ACCURACY_BOUND[kv_dtype]
  exact = attention_cases.oracle(case, 128 ** -0.5)
  out = _check_quantized(case, jnp.dtype(kv_dtype), q_dtype=jnp.float32)
  per_token = attention_cases.relative_error(out, exact, case)
  assert per_token <= bound, per_token
  if kv_dtype == "int8":
    out = _check_quantized(case, jnp.dtype(kv_dtype), q_dtype=jnp.float32, per_tensor=True)
    per_tensor = attention_cases.relative_error(out, exact, case)
    assert per_tensor > bound and per_tensor > 2 * per_token, (per_token, per_tensor)


# Every quantised dtype with bf16 queries (bf16 compute) and float32 queries (float32
# compute: three pieces of q against one of K/V) at four shapes; float16 queries (float32
# compute too) at one; D = 256 (the slowest to interpret, near a minute) once.
QUANTIZED_GRID = tuple(
    (kv_dtype, q_dtype, group, head_dim, block_size)
    for kv_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    for q_dtype in ("bfloat16", "float32", "float16")
    for group, head_dim, block_size in ((1, 64, 8), (4, 128, 32), (8, 256, 128), (2, 64, 64))
    if (q_dtype != "float16" or head_dim == 128)
    # pages of 64 (a chunk of one page) with bf16 queries only
    and (block_size != 64 or q_dtype == "bfloat16")
    # D=256: bfloat16 q over an int8 pool; the other pairings at D=256 are covered by the
    # CUDA lowering tests (the dequantisation is per dtype, the same at every D)
    and (head_dim != 256 or (q_dtype == "bfloat16" and kv_dtype == "int8")))


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("params", QUANTIZED_GRID, ids=lambda p: "-".join(map(str, p)))
def test_quantized_full_grid(params):
  kv_dtype, q_dtype, group, head_dim, block_size = params
  case = _case(43 + group + block_size, dtype=jnp.float32, group=group, head_dim=head_dim,
               block_size=block_size, num_kv_heads=2)
  _check_quantized(case, jnp.dtype(kv_dtype), q_dtype=jnp.dtype(q_dtype))


@needs_interpret
@pytest.mark.slow
@pytest.mark.parametrize("variant", ("all", "window1_sinks", "window_small"))
@pytest.mark.parametrize("kv_dtype", ("int8", "float8_e4m3fn", "float8_e5m2"))
def test_quantized_variants_split_k(kv_dtype, variant):
  case = _case(47, dtype=jnp.float32, group=4, head_dim=64, block_size=16,
               q_lens=[1, 9, 1], kv_lens=[300, 250, 7])
  _check_quantized(case, jnp.dtype(kv_dtype), _named_variant(case, variant),
                   q_dtype=jnp.bfloat16,
                   tiling=MosaicTiling(q_tile=4, chunk_size=64, num_splits=3, num_stages=2))


@needs_interpret
@pytest.mark.slow
def test_quantized_pages_before_the_window_are_never_read():
  # Pages (and their scale rows) wholly before every window hold NaN: the kernel never
  # copies them, so the output stays finite and equal to the reference's.
  case = attention_cases.poison_before_window(
      _case(49, dtype=jnp.float32, group=4, head_dim=64, block_size=8, q_lens=[1, 3],
            kv_lens=[150, 100]), 20)
  _check_quantized(case, jnp.float8_e4m3fn, dict(sliding_window=20), q_dtype=jnp.bfloat16,
                   tiling=MosaicTiling(q_tile=2, chunk_size=64, num_splits=2, num_stages=2))


def _int8_args():
  args = list(_small_args(dtype=jnp.float32))
  bits = jnp.zeros(args[1].shape, jnp.int8)
  scales_shape = args[1].shape[:4]
  return [args[0], bits, bits, *args[3:]], scales_shape


@pytest.mark.parametrize("which", ["k_scales missing", "v_scales missing", "k_scales shape",
                                   "v_scales dtype", "k_scales for bf16"])
def test_bad_scales_are_refused_naming_the_argument(which):
  args, shape = _int8_args()
  ones = jnp.ones(shape, jnp.float32)
  kwargs = dict(kv_dtype=jnp.int8, k_scales=ones, v_scales=ones)
  name = which.split()[0]
  if which.endswith("missing"):
    kwargs[name] = None
  elif which.endswith("shape"):
    kwargs[name] = jnp.ones((*shape[:3], shape[3] + 8), jnp.float32)
  elif which.endswith("dtype"):
    kwargs[name] = ones.astype(jnp.bfloat16)
  else:  # scales with an unquantised pool
    args = list(_small_args())
    kwargs.pop("kv_dtype")
  with pytest.raises(ValueError, match=name):
    mosaic_gpu.ragged_paged_attention(*args, sm_scale=0.1, **kwargs)


# --- Work items, the merge, float32 pieces (jnp, no kernel). ---

def test_items_cover_each_live_row_once():
  q_lens, kv_lens = attention_cases.mixed_lengths(8)
  case = _case(19, dtype=jnp.float32, group=1, head_dim=64, block_size=8, q_lens=q_lens,
               kv_lens=kv_lens)
  num_tokens = case.q_THD.shape[0]
  build = jax.jit(items_lib.build_items, static_argnames=(
      "num_tokens", "q_tile", "num_items", "block_size", "blocks_per_seq", "sliding_window"))
  for q_tile in (1, 3, 16):
    num_items = tiling_lib.num_work_items(num_tokens, case.kv_lens_S.shape[0], q_tile)
    items = build(
        jnp.asarray(case.kv_lens_S), jnp.asarray(case.cu_q_lens), jnp.int32(case.num_seqs),
        num_tokens=num_tokens, q_tile=q_tile, num_items=num_items, block_size=8,
        blocks_per_seq=case.block_tables_SP.shape[1], sliding_window=None)
    rows = np.asarray(items.row_WQ)[np.asarray(items.row_live_WQ)]
    live_rows = int(case.cu_q_lens[case.num_seqs])
    np.testing.assert_array_equal(np.sort(rows), np.arange(live_rows))
    # Live slots are [lo, hi) at positions qbase + slot; the horizon is the last one + 1.
    live = np.asarray(items.row_live_WQ)
    lo, hi = np.asarray(items.lo_W), np.asarray(items.hi_W)
    slots = np.arange(q_tile)[None, :]
    np.testing.assert_array_equal(live, (slots >= lo[:, None]) & (slots < hi[:, None]))
    horizon = np.asarray(items.horizon_W)
    has_rows = hi > lo
    np.testing.assert_array_equal(horizon[has_rows],
                                  (np.asarray(items.qbase_W) + hi)[has_rows])
    assert np.all(horizon[~has_rows] == 0)


def test_window_begin_and_pages_read():
  # One sequence of kv_len 42 whose last two tokens are queries (positions 40, 41), one
  # tile: W = 10, the first query's window starts at 31, so with Z = 8 the item starts at
  # page 3 (position 24) and reads pages 3, 4, 5 (to position 41).
  build = jax.jit(lambda kv, cu: items_lib.pages_read(items_lib.build_items(
      kv, cu, jnp.int32(1), num_tokens=2, q_tile=2, num_items=2, block_size=8,
      blocks_per_seq=8, sliding_window=10), block_size=8))
  np.testing.assert_array_equal(
      np.asarray(build(jnp.array([42], jnp.int32), jnp.array([0, 2], jnp.int32))), [3, 0])
  begin = jax.jit(lambda kv, cu: items_lib.build_items(
      kv, cu, jnp.int32(1), num_tokens=2, q_tile=2, num_items=2, block_size=8,
      blocks_per_seq=8, sliding_window=10).begin_W)
  np.testing.assert_array_equal(
      np.asarray(begin(jnp.array([42], jnp.int32), jnp.array([0, 2], jnp.int32))), [24, 0])


def test_combine_splits_by_log_sum_exp():
  # Piece 0 saw total weight 1 (lse 0) with mean a, piece 1 weight 3 (lse ln 3) with mean
  # b: the merge is (1 * a + 3 * b) / 4. A row neither piece saw (lse -inf) stays zero.
  a, b = np.full(4, 2.0, np.float32), np.full(4, 6.0, np.float32)
  out = np.stack([np.stack([a, np.zeros(4, np.float32)]),
                  np.stack([b, np.zeros(4, np.float32)])])[:, None, None]  # [X, W, K, M, D]
  lse = np.array([[0.0, -np.inf], [np.log(3.0), -np.inf]], np.float32)[:, None, None]
  merged = items_lib.combine_splits(jnp.asarray(out), jnp.asarray(lse))
  np.testing.assert_allclose(np.asarray(merged)[0, 0], [[5.0] * 4, [0.0] * 4], rtol=1e-6)


def test_float32_pieces_are_exact_to_float32():
  # hi + mid + lo holds 24 mantissa bits: the sum is the float32 value (up to the last
  # bit), and the six kept piece products of a dot match the float64 dot to ~1e-7.
  x = np.random.default_rng(0).normal(size=(64, 128)).astype(np.float32) * 3.0
  pieces = kernel_lib.split_pieces(jnp.asarray(x), 3, jnp.bfloat16)
  assert all(p.dtype == jnp.bfloat16 for p in pieces)
  total = sum(np.asarray(p, np.float64) for p in pieces)
  np.testing.assert_allclose(total, x, rtol=2 ** -22, atol=0)
  y = np.random.default_rng(1).normal(size=(128, 64)).astype(np.float32)
  y_pieces = kernel_lib.split_pieces(jnp.asarray(y), 3, jnp.bfloat16)
  dot = sum(np.asarray(pieces[i], np.float64) @ np.asarray(y_pieces[j], np.float64)
            for i, j in kernel_lib.piece_pairs(3, 3))
  exact = x.astype(np.float64) @ y.astype(np.float64)
  np.testing.assert_allclose(dot, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
  hi_only = np.asarray(pieces[0], np.float64) @ np.asarray(y_pieces[0], np.float64)
  assert np.abs(hi_only - exact).max() > 1e-3 * np.abs(exact).max()  # bf16 alone is not


def test_query_pieces_are_rounded_by_an_op_xla_keeps():
  # The float32 query split runs in XLA, outside the kernel. XLA on GPU drops a float32 ->
  # bfloat16 -> float32 round trip (excess precision allowed), which zeroed the mid and lo
  # pieces on an H200: 1.8e-3 off where float32 gives 2e-7. reduce_precision is kept;
  # the pieces it gives equal the round-trip ones wherever the round trip is kept (CPU).
  x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 64)).astype(np.float32))
  for cast, rounded in zip(kernel_lib.split_pieces(x, 3, jnp.bfloat16),
                           kernel_lib.split_pieces(x, 3, jnp.bfloat16,
                                                   explicit_rounding=True)):
    np.testing.assert_array_equal(np.asarray(cast, np.float32), np.asarray(rounded, np.float32))
  text = _lower("llama", 8, 2, 64, 16, T=4, S=2, pages_dtype=jnp.float32,
                q_dtype=jnp.float32)
  assert text.count("stablehlo.reduce_precision") >= 2  # hi and mid (lo is the remainder)


# --- Validation, tiling, availability (no kernel runs). ---

def _small_args(*, head_dim=64, block_size=16, dtype=jnp.bfloat16, num_q_heads=2):
  case = _case(25, dtype=dtype, group=num_q_heads, head_dim=head_dim,
               block_size=block_size, q_lens=[1, 2], kv_lens=[5, 9])
  return case.jax_args()


@pytest.mark.parametrize("kwargs, name", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
    (dict(sinks=jnp.zeros((3,), jnp.float32)), "sinks"),
    (dict(kv_dtype=jnp.int32), "kv_dtype"),
    (dict(tiling="big"), "tiling"),
    (dict(tiling=MosaicTiling(q_tile=1, chunk_size=256, num_splits=1, num_stages=4)),
     "num_stages"),  # 4 stages * 16 pages of Z = 16 in flight: over 32 barriers
])
def test_arguments_are_validated(kwargs, name):
  with pytest.raises(ValueError, match=name):
    mosaic_gpu.ragged_paged_attention(*_small_args(), sm_scale=0.1, **kwargs)


@pytest.mark.parametrize("head_dim, block_size, match", [
    (40, 16, "head_dim D=40"), (320, 16, "head_dim D=320"), (64, 12, "block_size Z=12"),
    (64, 256, "block_size Z=256")])
def test_shapes_outside_the_kernel_are_refused(head_dim, block_size, match):
  with pytest.raises(ValueError, match=match):
    mosaic_gpu.ragged_paged_attention(*_small_args(head_dim=head_dim,
                                                   block_size=block_size), sm_scale=0.1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(q_tile=0, chunk_size=64, num_splits=1), "q_tile"),
    (dict(q_tile=True, chunk_size=64, num_splits=1), "q_tile"),
    (dict(q_tile=1, chunk_size=64, num_splits=1.5), "num_splits"),
    (dict(q_tile=1, chunk_size=64, num_splits=1, num_stages=9), "num_stages"),
    (dict(q_tile=1, chunk_size=96, num_splits=1), "chunk_size"),
])
def test_tiling_rejects_bad_fields(kwargs, field):
  with pytest.raises(ValueError, match=field):
    MosaicTiling(**kwargs)


def test_float32_at_head_dim_256_takes_small_chunks():
  # Three bf16 pieces of Q (3 * 64 * 256 * 2 = 96 KiB) and one float32 ring stage of K and
  # V at J = 64 (2 * 64 * 256 * 4 = 128 KiB) leave no room for the staged pieces: refused,
  # naming the budget. J = 32 with one stage: 96 + 64 + 2 * 3 * 32 * 256 * 2 (96) = 256 KiB,
  # still over. J = 16: 96 + 2 stages * 32 + 48 = 208 KiB (+ 4 of slack) fits: the default.
  plan = mosaic_gpu.operand_plan(jnp.float32, jnp.float32)
  assert plan.pieces == 3 and plan.staged
  shapes = dict(group=1, block_size=16, head_dim=256, plan=plan)
  for chunk in (64, 32):
    with pytest.raises(ValueError, match="shared memory"):
      MosaicTiling(q_tile=1, chunk_size=chunk, num_splits=1, num_stages=1).check_shapes(
          **shapes)
  tiling = tiling_lib.default_tiling(num_tokens=8, num_seq_rows=8, num_kv_heads=4,
                                     blocks_per_seq=64, **shapes)
  assert (tiling.chunk_size, tiling.num_stages) == (16, 2)
  assert tiling.shared_memory_bytes(**shapes) == (96 + 64 + 48 + 4) * 1024
  tiling.check_shapes(**shapes)
  # A page of 8 positions (two copies a chunk) and a page of 128 (a 16-position part):
  # the same J.
  for block_size in (8, 128):
    shapes["block_size"] = block_size
    assert tiling_lib.default_tiling(num_tokens=8, num_seq_rows=8, num_kv_heads=4,
                                     blocks_per_seq=64, **shapes).chunk_size == 16


def test_small_chunks_need_staged_operands():
  # J < 64 only where K/V go through registers (the dots read a direct page at J = 64
  # granularity), and only 16 or 32.
  direct = mosaic_gpu.operand_plan(jnp.bfloat16, jnp.bfloat16)
  assert not direct.staged
  with pytest.raises(ValueError, match="chunk_size J=32 below 64 needs staged"):
    MosaicTiling(q_tile=1, chunk_size=32, num_splits=1).check_shapes(
        group=4, block_size=16, head_dim=128, plan=direct)
  # bf16 defaults stay at J = 64 at every head dim.
  for head_dim in (64, 128, 256):
    assert tiling_lib.default_tiling(
        num_tokens=1, num_seq_rows=1, num_kv_heads=8, group=4, block_size=16,
        head_dim=head_dim, blocks_per_seq=64, plan=direct).chunk_size == 64
  for chunk in (8, 48, 96):
    with pytest.raises(ValueError, match=f"chunk_size={chunk} must be a multiple of 64"):
      MosaicTiling(q_tile=1, chunk_size=chunk, num_splits=1)


def test_operand_plans():
  plan = mosaic_gpu.operand_plan
  assert plan(jnp.bfloat16, jnp.bfloat16) == tiling_lib.OperandPlan(2, "bfloat16", 1, False)
  assert plan(jnp.bfloat16, jnp.uint16, kv_dtype=jnp.bfloat16).staged
  assert plan(jnp.float16, jnp.float16).mma_dtype_name == "float16"
  assert plan(jnp.float32, jnp.bfloat16) == tiling_lib.OperandPlan(2, "bfloat16", 3, True)
  assert plan(jnp.bfloat16, jnp.float16).pieces == 3  # promotes to float32
  # Quantised pools: the stored values as one bf16 piece, scaled after the dots.
  assert plan(jnp.bfloat16, jnp.int8, kv_dtype=jnp.int8) == tiling_lib.OperandPlan(
      1, "bfloat16", 1, True, True)
  for q_dtype in (jnp.float32, jnp.float16):  # float32 compute: three pieces of q, one of K/V
    e5m2 = plan(q_dtype, jnp.uint8, kv_dtype=jnp.float8_e5m2)
    assert (e5m2.mma_dtype_name, e5m2.pieces, e5m2.kv_pieces, e5m2.scaled) == (
        "bfloat16", 3, 1, True)
  assert kernel_lib.piece_pairs(3, 1) == ((2, 0), (1, 0), (0, 0))
  assert kernel_lib.piece_pairs(1, 1) == ((0, 0),)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.uint16, jnp.float32])
@pytest.mark.parametrize("num_tokens, num_seq_rows, group, block_size, head_dim, blocks", [
    (1, 1, 4, 16, 128, 2048), (256, 256, 4, 16, 128, 64), (2048, 4, 8, 8, 64, 256),
    (64, 64, 16, 32, 256, 16), (5, 3, 1, 64, 128, 2), (96, 8, 2, 128, 256, 16),
    (1, 1, 64, 16, 64, 128)])
def test_default_tiling_is_valid_and_fits(num_tokens, num_seq_rows, group, block_size,
                                          head_dim, blocks, dtype):
  q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
  kv_dtype = jnp.bfloat16 if dtype == jnp.uint16 else None
  plan = mosaic_gpu.operand_plan(q_dtype, dtype, kv_dtype=kv_dtype)
  tiling = tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=8, group=group,
      block_size=block_size, head_dim=head_dim, blocks_per_seq=blocks, plan=plan)
  tiling.check_shapes(group=group, block_size=block_size, head_dim=head_dim, plan=plan)
  assert 1 <= tiling.num_splits <= tiling_lib.MAX_SPLITS
  if num_tokens == 1 and blocks >= 128:  # one long decode row: split-K fills the GPU
    assert tiling.num_splits >= 8


def test_window_caps_the_default_splits():
  # One decode row at up to 32k positions: splits by the context without a window; with
  # W = 100 an item reads at most cdiv(100 + 16, 64) = 2 chunks: 1 split.
  plan = mosaic_gpu.operand_plan(jnp.bfloat16, jnp.bfloat16)
  kwargs = dict(num_tokens=1, num_seq_rows=1, num_kv_heads=8, group=4, block_size=16,
                head_dim=128, blocks_per_seq=2048, plan=plan)
  assert tiling_lib.default_tiling(**kwargs).num_splits == tiling_lib.MAX_SPLITS
  assert tiling_lib.default_tiling(**kwargs, sliding_window=100).num_splits == 1


def test_unsupported_reason_names_what_does_not_fit():
  s = jax.ShapeDtypeStruct
  tables = s((4, 8), jnp.int32)
  ok = mosaic_gpu.unsupported_reason(s((4, 32, 128), jnp.bfloat16),
                                     s((2, 8, 64, 16, 128), jnp.uint16), tables,
                                     kv_dtype=jnp.bfloat16)
  assert ok is None
  assert mosaic_gpu.unsupported_reason(
      s((4, 8, 96), jnp.bfloat16), s((2, 8, 64, 16, 96), jnp.bfloat16), tables) is None
  assert "head_dim D=72 (q.shape[2]) must be a multiple of 16" in mosaic_gpu.unsupported_reason(
      s((4, 8, 72), jnp.bfloat16), s((2, 8, 64, 16, 72), jnp.bfloat16), tables)
  assert mosaic_gpu.unsupported_reason(  # 80-byte rows: an unswizzled ring
      s((4, 8, 80), jnp.bfloat16), s((2, 8, 64, 16, 80), jnp.int8), tables,
      kv_dtype=jnp.int8) is None
  # float32 between 128 and 256 but not a multiple of 64: no chunk of 64 fits, and the
  # small chunks' transposed tiles need D rows in multiples of 64.
  assert "no tiling fits" in mosaic_gpu.unsupported_reason(
      s((4, 8, 160), jnp.float32), s((2, 8, 64, 16, 160), jnp.float32), tables)
  # float32 at D = 256 fits in chunks of J = 16 (test_float32_at_head_dim_256_takes_...).
  assert mosaic_gpu.unsupported_reason(
      s((4, 8, 256), jnp.float32), s((2, 8, 64, 16, 256), jnp.float32), tables) is None
  assert "block_size Z=12" in mosaic_gpu.unsupported_reason(
      s((4, 8, 64), jnp.bfloat16), s((2, 8, 64, 12, 64), jnp.bfloat16), tables)
  for kv_dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    pages = s((2, 8, 64, 16, 256), layout.storage_dtype(kv_dtype))
    for q_dtype in (jnp.bfloat16, jnp.float32):
      # float32 q at D = 256 fits with one-byte pages: one bf16 piece of K and of V.
      assert mosaic_gpu.unsupported_reason(s((4, 32, 256), q_dtype), pages, tables,
                                           kv_dtype=kv_dtype) is None


def test_availability_and_the_error_without_mosaic_gpu(monkeypatch):
  assert compat.available() and compat.missing_names() == ()
  monkeypatch.delattr(compat.plgpu, "wgmma")
  assert not compat.available()
  with pytest.raises(NotImplementedError, match=f"jax {jax.__version__}.*wgmma"):
    compat.require()


def test_interpret_mode_missing_is_named(monkeypatch):
  monkeypatch.setattr(compat, "INTERPRET_MODULES", ("jax._src.pallas.no_such_interpreter",
                                                    *compat.INTERPRET_MODULES[1:]))
  assert not mosaic_gpu.interpret_available()
  with pytest.raises(NotImplementedError, match=f"interpret mode.*jax {jax.__version__}"):
    mosaic_gpu.ragged_paged_attention(*_small_args(), sm_scale=0.1, interpret=True)


def test_the_package_imports_and_lowers_without_triton():
  # JAX will drop Pallas's Triton backend: with jax.experimental.pallas.triton hidden,
  # this package still imports, says it is available, and lowers for CUDA.
  code = (
      "import sys\n"
      "sys.modules['jax.experimental.pallas.triton'] = None\n"
      "sys.modules['jax._src.pallas.triton'] = None\n"
      "import jax, jax.numpy as jnp\n"
      "from paged_jax.pallas_kernels import mosaic_gpu\n"
      "assert mosaic_gpu.available()\n"
      "s = lambda *sh, dt=jnp.int32: jax.ShapeDtypeStruct(sh, dt)\n"
      "f = lambda *a: mosaic_gpu.ragged_paged_attention(*a, sm_scale=0.1)\n"
      "args = (s(4, 8, 64, dt=jnp.bfloat16), s(1, 2, 16, 16, 64, dt=jnp.bfloat16),\n"
      "        s(1, 2, 16, 16, 64, dt=jnp.bfloat16), s(), s(4), s(4, 8), s(5), s())\n"
      "text = jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',)).as_text()\n"
      "assert 'mosaic_gpu' in text and 'triton' not in text\n"
      "assert sys.modules['jax.experimental.pallas.triton'] is None\n"
      "assert 'paged_jax.pallas_kernels.gpu' not in sys.modules\n"
      "print('ok')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# --- Lowering for CUDA on CPU: a Mosaic GPU kernel, no Triton. ---

MODEL_SHAPES = [
    # (name, H, K, D, Z)
    ("llama3_8b", 32, 8, 128, 16),
    ("gemma3", 8, 4, 256, 16),
    ("gpt_oss", 64, 8, 64, 16),
]
LOWERING_VARIANTS = {
    "plain": {},
    "all": dict(sliding_window=128, soft_cap=50.0, sinks=True),
}


def _lower(name, H, K, D, Z, *, T, S, pages_dtype=jnp.uint16, q_dtype=jnp.bfloat16,
           variant=(), tiling=None):
  traced = _trace(name, H, K, D, Z, T=T, S=S, pages_dtype=pages_dtype, q_dtype=q_dtype,
                  variant=variant, tiling=tiling)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


def _trace(name, H, K, D, Z, *, T, S, pages_dtype=jnp.uint16, q_dtype=jnp.bfloat16,
           variant=(), tiling=None):
  num_blocks, blocks_per_seq, num_layers = 256, 64, 2
  kwargs = dict(variant)
  kv_dtype = jnp.bfloat16 if pages_dtype == jnp.uint16 else None
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((T, H, D), q_dtype),
          jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), pages_dtype),
          jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), pages_dtype),
          i32(), i32(S), i32(S, blocks_per_seq), i32(S + 1), i32()]
  if kwargs.pop("sinks", False):
    args.append(jax.ShapeDtypeStruct((H,), jnp.float32))
    f = lambda *a: mosaic_gpu.ragged_paged_attention(
        *a[:8], sinks=a[8], sm_scale=D ** -0.5, kv_dtype=kv_dtype, tiling=tiling, **kwargs)
  else:
    f = lambda *a: mosaic_gpu.ragged_paged_attention(
        *a, sm_scale=D ** -0.5, kv_dtype=kv_dtype, tiling=tiling, **kwargs)
  return jax.jit(f).trace(*args)


def _all_eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs inside its equations (the kernel body,
  its loops and scopes), depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    yield from _all_eqns_of(eqn)


def _all_eqns_of(eqn):
  """Every equation of the jaxprs inside ``eqn`` (a loop's body, a cond's branches), depth
  first."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(sub, jax.extend.core.ClosedJaxpr):
        yield from _all_eqns(sub.jaxpr)
      elif isinstance(sub, jax.extend.core.Jaxpr):
        yield from _all_eqns(sub)


@pytest.mark.parametrize("pages_dtype, q_dtype", [(jnp.uint16, jnp.bfloat16),
                                                  (jnp.float32, jnp.float32)])
def test_kernel_selects_no_vector_on_a_scalar_predicate(pages_dtype, q_dtype):
  # jax 0.11.2's Mosaic GPU lowering refuses select_n with a scalar predicate over vector
  # cases ("Implicit broadcast not implemented with warpgroup semantics"); the sink's
  # start on split 0 was one, and every call with sinks failed on an H200 although it
  # lowered with jax 0.10.2 here. Checked on the traced kernel, all variants on.
  traced = _trace("llama", 8, 2, 64, 16, T=8, S=2, pages_dtype=pages_dtype,
                  q_dtype=q_dtype, variant=LOWERING_VARIANTS["all"])
  selects = [e for e in _all_eqns(traced.jaxpr.jaxpr) if e.primitive.name == "select_n"]
  assert selects  # the walk reached the kernel body
  bad = [e for e in selects if e.invars[0].aval.shape == ()
         and any(v.aval.shape != () for v in e.invars[1:])]
  assert not bad, bad


def _assert_one_mosaic_kernel(text, pages_dtype, Z, D):
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  mosaic = [line for line in calls if "@mosaic_gpu" in line]
  assert len(mosaic) == 1, calls
  assert not any("triton" in line for line in calls)
  # The pools go to the kernel whole and as stored (no convert, no slice of a layer).
  dtype = {jnp.dtype(jnp.uint16): "ui16", jnp.dtype(jnp.bfloat16): "bf16",
           jnp.dtype(jnp.float32): "f32"}[jnp.dtype(pages_dtype)]
  assert mosaic[0].count(f"x{Z}x{D}x{dtype}>") >= 2
  # The work items around the kernel are computed without a loop (a searchsorted's default
  # is a while loop, which XLA on a GPU runs as kernels step by step, at every call).
  assert "stablehlo.while" not in text


@pytest.mark.parametrize("variant", tuple(LOWERING_VARIANTS))
@pytest.mark.parametrize("model", MODEL_SHAPES, ids=[row[0] for row in MODEL_SHAPES])
def test_lowers_for_cuda_at_model_shapes(model, variant):
  # A mixed batch (96 query rows over 8 sequences) with bf16 pools as storage bits.
  if variant == "plain" and model[0] != "llama3_8b":
    pytest.skip("plain lowering: one model in the default run, all in the slow run")
  text = _lower(*model, T=96, S=8, variant=LOWERING_VARIANTS[variant])
  _assert_one_mosaic_kernel(text, jnp.uint16, model[4], model[3])


def test_lowers_for_cuda_at_phi3_head_dim():
  # Phi-3-mini: 32 heads of D = 96 (64-byte swizzles), bf16 storage bits, every variant.
  text = _lower("phi3_mini", 32, 32, 96, 16, T=96, S=8, variant=LOWERING_VARIANTS["all"])
  _assert_one_mosaic_kernel(text, jnp.uint16, 16, 96)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_lowers_for_cuda_at_phi2_head_dim(kv_dtype):
  # Phi-2: D = 80, one-byte pages (80-byte rows: the unswizzled ring), a mixed batch.
  kv_dtype = jnp.dtype(kv_dtype)
  pages = jax.ShapeDtypeStruct((2, 32, 256, 16, 80), layout.storage_dtype(kv_dtype))
  scales = jax.ShapeDtypeStruct(layout.scales_shape(2, 32, 256, 16), jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((96, 32, 80), jnp.bfloat16), pages, pages, i32(), i32(8),
          i32(8, 64), i32(9), i32(), scales, scales]
  f = lambda *a: mosaic_gpu.ragged_paged_attention(
      *a[:8], k_scales=a[8], v_scales=a[9], sm_scale=80 ** -0.5, kv_dtype=kv_dtype)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("@mosaic_gpu") == 1 and "triton" not in text


@pytest.mark.parametrize("pages_dtype", [jnp.float32, jnp.uint16], ids=["f32", "bits"])
def test_float32_at_head_dim_256_lowers_for_cuda(pages_dtype):
  # Gemma-3's D = 256 with float32 queries, over float32 pages and over bf16 storage bits:
  # the default chunk is J = 16 (the staged tiles go through registers transposed, the V
  # operand swizzled by 32 bytes), every variant on; Mosaic GPU's lowering checks the
  # layouts, the wgmma shapes and the shared memory.
  name, H, K, D, Z = MODEL_SHAPES[1]
  s = jax.ShapeDtypeStruct
  pages = s((2, K, 256, Z, D), pages_dtype)
  kv_dtype = jnp.bfloat16 if pages_dtype == jnp.uint16 else None
  tiling = mosaic_gpu.default_tiling_for(s((96, H, D), jnp.float32), pages,
                                         s((8, 64), jnp.int32), kv_dtype=kv_dtype)
  assert tiling.chunk_size == 16
  assert mosaic_gpu.operand_plan(jnp.float32, pages_dtype, kv_dtype=kv_dtype).pieces == 3
  text = _lower(name, H, K, D, Z, T=96, S=8, pages_dtype=pages_dtype, q_dtype=jnp.float32,
                variant=LOWERING_VARIANTS["all"])
  _assert_one_mosaic_kernel(text, pages_dtype, Z, D)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("model", [
    MODEL_SHAPES[0], *(pytest.param(m, marks=pytest.mark.slow) for m in MODEL_SHAPES[1:])],
    ids=[row[0] for row in MODEL_SHAPES])
def test_quantized_lowers_for_cuda(model, kv_dtype):
  # A mixed batch with a window and a soft cap, bf16 queries; the pools go to the one
  # Mosaic GPU kernel as stored (int8 / uint8 bits) with their float32 scales.
  name, H, K, D, Z = model
  kv_dtype = jnp.dtype(kv_dtype)
  T, S, num_blocks, num_layers = 96, 8, 256, 2
  storage = layout.storage_dtype(kv_dtype)
  pages = jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), storage)
  scales = jax.ShapeDtypeStruct(layout.scales_shape(num_layers, K, num_blocks, Z), jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), pages, pages, i32(), i32(S),
          i32(S, 64), i32(S + 1), i32(), scales, scales]
  f = lambda *a: mosaic_gpu.ragged_paged_attention(
      *a[:8], k_scales=a[8], v_scales=a[9], sm_scale=D ** -0.5, kv_dtype=kv_dtype,
      sliding_window=128, soft_cap=50.0)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  mosaic = [line for line in calls if "@mosaic_gpu" in line]
  assert len(mosaic) == 1 and not any("triton" in line for line in calls)
  suffix = {jnp.dtype(jnp.int8): "i8", jnp.dtype(jnp.uint8): "ui8"}[jnp.dtype(storage)]
  assert mosaic[0].count(f"x{Z}x{D}x{suffix}>") >= 2  # the quantised pools, as stored
  assert mosaic[0].count(f"x{Z}xf32>") >= 2          # and their scales


@pytest.mark.slow
@pytest.mark.parametrize("q_dtype", ["float32", "float16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_quantized_lowers_for_cuda_float32_compute(kv_dtype, q_dtype):
  # float32 / float16 queries over quantised pools: three bf16 pieces of q and of the
  # weights against one of K/V, at Gemma-3's D = 256, one long decode row (split-K).
  name, H, K, D, Z = MODEL_SHAPES[1]
  kv_dtype = jnp.dtype(kv_dtype)
  pages = jax.ShapeDtypeStruct((2, K, 256, Z, D), layout.storage_dtype(kv_dtype))
  scales = jax.ShapeDtypeStruct(layout.scales_shape(2, K, 256, Z), jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((1, H, D), jnp.dtype(q_dtype)), pages, pages, i32(), i32(1),
          i32(1, 64), i32(2), i32(), scales, scales]
  f = lambda *a: mosaic_gpu.ragged_paged_attention(
      *a[:8], k_scales=a[8], v_scales=a[9], sm_scale=D ** -0.5, kv_dtype=kv_dtype)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("@mosaic_gpu") == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    # (T, S, pages dtype, q dtype, Z): decode, prefill, direct bf16, float32, big pages
    (32, 32, jnp.uint16, jnp.bfloat16, 16), (512, 2, jnp.uint16, jnp.bfloat16, 16),
    (8, 8, jnp.bfloat16, jnp.bfloat16, 8), (8, 8, jnp.float32, jnp.float32, 32),
    (64, 4, jnp.uint16, jnp.bfloat16, 128), (1, 1, jnp.uint16, jnp.bfloat16, 64)],
    ids=["decode", "prefill", "direct_z8", "float32", "z128", "one_long_decode"])
@pytest.mark.parametrize("model", MODEL_SHAPES, ids=[row[0] for row in MODEL_SHAPES])
def test_lowers_for_cuda_full(model, case):
  T, S, pages_dtype, q_dtype, Z = case
  name, H, K, D, _ = model
  for variant in LOWERING_VARIANTS.values():
    text = _lower(name, H, K, D, Z, T=T, S=S, pages_dtype=pages_dtype, q_dtype=q_dtype,
                  variant=variant)
    _assert_one_mosaic_kernel(text, pages_dtype, Z, D)


# --- The loop's table reads, the tilings run.py sweeps, the profiler build. ---


def test_table_entries_are_read_a_ring_ahead():
  # A block-table entry is a global-memory load (hundreds of cycles): the loop body reads
  # the entries of chunk c + S at its start, before it waits for chunk c's pages, and
  # carries chunk c's (read S iterations earlier) in its loop state; no table read sits
  # after the waits, nor inside a refill (where it would stall the copy it feeds).
  traced = _trace("llama", 8, 2, 64, 16, T=8, S=8, pages_dtype=jnp.bfloat16)
  loops = [e for e in _all_eqns(traced.jaxpr.jaxpr) if e.primitive.name == "while"]
  assert len(loops) == 1
  body = loops[0].params["body_jaxpr"].jaxpr

  def table_reads(eqns):
    return [i for i, e in enumerate(eqns) if e.primitive.name == "get"
            and e.invars[0].aval.dtype == jnp.int32 and len(e.invars[0].aval.shape) == 2]

  def waits(eqn):
    return any(sub.primitive.name == "barrier_wait" for sub in _all_eqns_of(eqn))

  reads = table_reads(body.eqns)
  first_wait = min(i for i, e in enumerate(body.eqns) if waits(e))
  copies_per_chunk = 64 // 16
  assert len(reads) == copies_per_chunk and max(reads) < first_wait
  nested = [e for e in body.eqns if e.primitive.name == "cond"
            and table_reads(list(_all_eqns_of(e)))]
  assert not nested


def _run_script_constant(name):
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location(
      "gpu_run", os.path.join(root, "benchmarks", "gpu", "run.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return getattr(module, name)


def test_the_tilings_run_py_sweeps_lower_for_cuda():
  # benchmarks/gpu/run.py times these (J, S) beside the default on an H200, on bf16 pools
  # (the direct path): a tiling that failed to build there would cost device minutes.
  # Llama-3-8B decode, 8 sequences.
  default = mosaic_gpu.default_tiling_for(
      jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16),
      jax.ShapeDtypeStruct((1, 8, 256, 16, 128), jnp.bfloat16),
      jax.ShapeDtypeStruct((8, 64), jnp.int32))
  for chunk, stages in _run_script_constant("MOSAIC_SWEEP"):
    tiling = dataclasses.replace(default, chunk_size=chunk, num_stages=stages)
    text = _lower("llama3_8b", 32, 8, 128, 16, T=8, S=8, pages_dtype=jnp.bfloat16,
                  tiling=tiling)
    _assert_one_mosaic_kernel(text, jnp.bfloat16, 16, 128)


def test_profiled_kernel_lowers_for_cuda(tmp_path, monkeypatch):
  # The Mosaic GPU profiler build (run.py's last stage): the kernel with its named
  # regions recorded into a trace buffer. The host callback that writes the trace cannot
  # lower for CUDA on a CPU-only JAX: it is stubbed, the kernel's lowering is what runs.
  monkeypatch.setattr(jax.debug, "callback", lambda *args, **kwargs: None)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 8, 256, 16, 128), jnp.uint16),
          jax.ShapeDtypeStruct((1, 8, 256, 16, 128), jnp.uint16),
          i32(), i32(8), i32(8, 64), i32(9), i32())
  f = lambda *a: mosaic_gpu.profiled_attention(
      *a, sm_scale=0.1, kv_dtype=jnp.bfloat16, profile_dir=str(tmp_path), profile_space=64)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  kernels = [line for line in text.splitlines() if "@mosaic_gpu" in line]
  # One kernel, whose last result is the profiler's trace buffer (u32).
  assert len(kernels) == 1 and kernels[0].rstrip().endswith("xui32>)")


@pytest.mark.parametrize("interpret, space", [(True, 64), (False, 0)])
def test_profiling_needs_a_gpu_and_space(interpret, space, tmp_path):
  case = _case(31, dtype=jnp.bfloat16, group=1, head_dim=64, block_size=16, q_lens=[1],
               kv_lens=[40])
  with pytest.raises(ValueError, match="profile_dir=.* needs a GPU"):
    jax.jit(lambda *a: mosaic_gpu.profiled_attention(
        *a, sm_scale=0.125, profile_dir=str(tmp_path), profile_space=space,
        interpret=interpret)).trace(*case.jax_args()).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("batch, context, expected", [
    (8, 8192, 2),     # 64 programs a split: X = 2 is one wave of 64 chunks
    (32, 32768, 1),   # 256: X = 1 fills two waves; X = 2 would make four of half the work
    (1, 8192, 16),    # 8: 128 programs, one wave of 8 chunks
    (256, 8192, 1)])
def test_wave_balanced_splits(batch, context, expected):
  # Llama-3-8B decode (K = 8), J = 64: the model's choice, and it is the cheapest X of all
  # by the model's own cost, the fewest among equals.
  programs, chunks = batch * 8, context // 64
  splits = tiling_lib.wave_balanced_splits(programs, chunks)
  assert splits == expected
  cost = lambda x: -(-programs * x // tiling_lib.NUM_SMS) * (
      -(-chunks // x) + tiling_lib.PROGRAM_OVERHEAD_CHUNKS)
  others = range(1, tiling_lib.MAX_SPLITS + 1)
  assert all(cost(splits) < cost(x) or (cost(splits) == cost(x) and splits <= x)
             for x in others)


def test_kernel_keeps_mosaic_gpus_automatic_barriers():
  # The kernel zeroes V rows in place and refills ring slots that other warps have just
  # read, relying on the warpgroup barrier Mosaic GPU puts around shared-memory stores and
  # before each TMA (CompilerParams.unsafe_no_auto_barriers=False). With that flag set a
  # GPU could race where nothing here shows it: the interpreter copies eagerly, so even a
  # kernel whose page waits never run passes every interpret test (tried), and its race
  # detector (InterpretGPUParams(detect_races=True)) did not flag that kernel either.
  traced = _trace("llama", 8, 2, 64, 16, T=8, S=2, variant=LOWERING_VARIANTS["all"])
  # The kernel's call (mpmd_map in jax 0.10.2) is the one equation with compiler params.
  calls = [e for e in _all_eqns(traced.jaxpr.jaxpr) if "compiler_params" in e.params]
  assert len(calls) == 1, [e.primitive.name for e in calls]
  params = calls[0].params["compiler_params"]
  params = params.get("mosaic_gpu", params) if isinstance(params, dict) else params
  assert params.unsafe_no_auto_barriers is False, params  # renamed in a JAX: look again
