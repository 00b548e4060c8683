"""The Mosaic TPU ragged paged attention kernel, run in TPU interpret mode on CPU.

Every interpret-mode case compiles once per (shapes, tiling, interpret params), which costs
seconds here; the default run therefore covers the dtype x block size x GQA x head dim grid
with a Latin-square subset (every block size meets every GQA ratio, every dtype meets every
head dim), and the full product is marked slow. Lowering for real TPUs is checked with
``jax.export`` for a grid of production-like shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

import paged_jax
from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import tpu as tpu_kernel
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.tpu import ragged as tpu_ragged
from tests import attention_cases as cases

_TILING = tpu_kernel.TpuTiling(q_tile=4, pages_per_chunk=2)  # tiles span sequences; >1 chunk
_OUT_OF_RANGE = 1_000_000  # a block id far outside every pool


def _with_out_of_range_entries(case: cases.Case, seed: int) -> cases.Case:
  """Points half of the table entries no live sequence reads at nonexistent blocks: an
  out-of-bounds DMA of them would raise in the interpreter."""
  rng = np.random.default_rng(seed)
  block_size = case.k_pages_LKNZD.shape[3]
  tables = case.block_tables_SP.copy()
  for i in range(tables.shape[0]):
    first_unused = -(-int(case.kv_lens_S[i]) // block_size) if i < case.num_seqs else 0
    for p in range(first_unused, tables.shape[1]):
      if rng.random() < 0.5:
        tables[i, p] = _OUT_OF_RANGE + p
  case.block_tables_SP = tables
  return case


def _mixed_lengths(z: int):
  """(q_lens, kv_lens) with few rows at any block size z (interpret mode is slow): decode
  (q_len 1, long history or none), q_len 0, chunked prefill (q_len < kv_len) and full
  prefill (q_len == kv_len), lengths multiple of z and not."""
  q_lens = [1, 0, 5, 9, 1, 6, 3]
  kv_lens = [z + 3, 7, 2 * z, 9, 1, 3 * z + 1, 3]
  return q_lens, kv_lens


def _mixed_case(seed, *, dtype, block_size, group, head_dim, num_kv_heads=None, **kwargs):
  if num_kv_heads is None:
    num_kv_heads = 1 if group >= 8 else 2  # group 8 with one KV head: MQA
  q_lens, kv_lens = _mixed_lengths(block_size)
  case = cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens, num_kv_heads=num_kv_heads,
                         group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                         **kwargs)
  return _with_out_of_range_entries(case, seed + 1)


# XLA:CPU spends most of an interpret-mode case optimising the interpreter's program; the
# tests compile it at optimisation level 0 (3x faster) and keep the last few executables.
_CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}
_EXECUTABLES = cases.CompiledCache(keep=8)


def _call_fast(key, fn, *args):
  """``fn(*args)`` through a cached, quickly compiled executable (``key``: fn's statics)."""
  avals = tuple((jnp.shape(a), jnp.result_type(a)) for a in args)
  compiled = _EXECUTABLES.get(
      (key, avals), lambda: jax.jit(fn).lower(*args).compile(_CPU_COMPILE_OPTIONS))
  return compiled(*args)


def _run(case: cases.Case, *, tiling=_TILING, interpret=True, sm_scale=None, storage=False,
         sliding_window=None, soft_cap=None, sinks=None, quantized=None, per_tensor=False):
  """The kernel on ``case`` (``storage=True``: the pages as storage bits with ``kv_dtype``;
  ``quantized``: int8 / float8, the pages quantised by ``cases.quantized_args``, one scale
  per token and KV head or ``per_tensor``); the variants' statics key the compiled
  executable, ``sinks`` and the scales are traced."""
  head_dim = case.q_THD.shape[-1]
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  kv_dtype = case.kv_dtype if storage else None
  args = case.jax_args(storage=storage)
  args = args[:3] + (jnp.int32(args[3]),) + args[4:]
  traced = {}  # keyword arrays, passed as traced arguments after the positional ones
  if sinks is not None:
    traced["sinks"] = jnp.asarray(sinks, jnp.float32)
  if quantized is not None:
    pool, pool_kwargs = cases.quantized_args(case, quantized, per_tensor=per_tensor)
    args = (args[0], pool[1], pool[2]) + args[3:]
    traced["k_scales"], traced["v_scales"] = pool_kwargs["k_scales"], pool_kwargs["v_scales"]
    kv_dtype = pool_kwargs["kv_dtype"]
  statics = dict(sm_scale=scale, tiling=tiling, interpret=interpret, kv_dtype=kv_dtype,
                 sliding_window=sliding_window, soft_cap=soft_cap)
  names = tuple(traced)

  def kernel(*a):
    split = len(a) - len(names)
    return tpu_kernel.ragged_paged_attention(*a[:split], **dict(zip(names, a[split:])),
                                             **statics)

  key = ("kernel", names) + tuple(sorted(statics.items(), key=lambda kv: kv[0]))
  out = _call_fast(key, kernel, *args, *traced.values())
  return out, scale


def _check(case: cases.Case, out, scale, *, with_reference=False, **variants):
  """Against the float64 oracle (and the jnp reference); padding rows exactly zero."""
  dtype = case.q_THD.dtype
  assert out.dtype == dtype and out.shape == case.q_THD.shape
  out = np.asarray(out.astype(jnp.float32))
  assert np.all(np.isfinite(out))
  expected = cases.oracle(case, scale, **variants)
  assert np.abs(expected).max() > 0.1  # the comparison below is not vacuous
  np.testing.assert_allclose(out, expected, **cases.tolerance(dtype))
  if with_reference:
    if variants.get("sinks") is not None:
      variants = dict(variants, sinks=jnp.asarray(variants["sinks"]))
    reference = ragged_paged_attention_reference(*case.jax_args(), sm_scale=scale, **variants)
    np.testing.assert_allclose(out, np.asarray(reference.astype(jnp.float32)),
                               **cases.tolerance(dtype))
  live_rows = int(case.cu_q_lens[case.num_seqs])
  assert np.all(out[live_rows:] == 0.0)


# (dtype, block size Z, GQA ratio G, head dim D): every (Z, G) pair once, dtype x D balanced.
_QUICK_GRID = [
    (jnp.float32, 8, 1, 64), (jnp.bfloat16, 8, 4, 128), (jnp.float32, 8, 8, 128),
    (jnp.bfloat16, 16, 1, 128), (jnp.float32, 16, 4, 64), (jnp.bfloat16, 16, 8, 64),
    (jnp.float32, 32, 1, 128), (jnp.bfloat16, 32, 4, 64), (jnp.float32, 32, 8, 64),
    (jnp.bfloat16, 16, 2, 96), (jnp.float32, 8, 1, 80),  # Phi-3's and Phi-2's head dims
]
_FULL_GRID = [c for c in itertools.product((jnp.float32, jnp.bfloat16), (8, 16, 32), (1, 4, 8),
                                           (64, 128)) if c not in _QUICK_GRID]


def _seed(params) -> int:
  return sum(ord(c) for c in _grid_id(params))


def _grid_id(params):
  dtype, block_size, group, head_dim = params
  return f"{jnp.dtype(dtype).name}-Z{block_size}-G{group}-D{head_dim}"


@pytest.mark.parametrize("params", _QUICK_GRID, ids=_grid_id)
def test_matches_oracle_on_mixed_batch(params):
  dtype, block_size, group, head_dim = params
  case = _mixed_case(_seed(params), dtype=dtype, block_size=block_size, group=group,
                     head_dim=head_dim)
  _check(case, *_run(case))


@pytest.mark.slow
@pytest.mark.parametrize("params", _FULL_GRID, ids=_grid_id)
def test_matches_oracle_on_mixed_batch_full_grid(params):
  dtype, block_size, group, head_dim = params
  case = _mixed_case(_seed(params), dtype=dtype, block_size=block_size, group=group,
                     head_dim=head_dim)
  _check(case, *_run(case))


def test_float32_is_not_computed_in_bfloat16():
  # A bf16 cast of q or K/V costs ~1e-3 relative; exact float32 stays near 1e-7.
  case = _mixed_case(7, dtype=jnp.float32, block_size=8, group=1, head_dim=64)
  out, scale = _run(case)
  expected = cases.oracle(case, scale)
  rel = np.abs(np.asarray(out) - expected).max() / np.abs(expected).max()
  assert rel < 2e-6, rel


def test_hand_computed_two_keys():
  # One sequence, kv_len 2, one query row (position 1, sees both keys). K is all zeros, so
  # every score is 0 and the weights are 1/2, 1/2: out = (v0 + v1) / 2 = (1 + 3) / 2 = 2.
  # Slots 2.. of the page and the second page hold NaN and must not matter.
  block_size, head_dim = 8, 64
  k_pages = np.full((1, 1, 2, block_size, head_dim), np.nan, np.float32)
  v_pages = np.full((1, 1, 2, block_size, head_dim), np.nan, np.float32)
  k_pages[0, 0, 1, :2] = 0.0
  v_pages[0, 0, 1, 0] = 1.0
  v_pages[0, 0, 1, 1] = 3.0
  q = np.ones((2, 1, head_dim), np.float32)  # row 1 is padding
  kernel = functools.partial(tpu_kernel.ragged_paged_attention, sm_scale=1.0, interpret=True)
  out = _call_fast("hand", kernel, jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                   jnp.int32(0), jnp.array([2], jnp.int32), jnp.array([[1, 0]], jnp.int32),
                   jnp.array([0, 1], jnp.int32), jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(out[0]), 2.0)
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


def test_random_ragged_batches_one_shape():
  # Fixed shapes, random lengths: one compile serves every batch.
  block_size, blocks_per_seq, num_rows, num_tokens = 8, 5, 5, 24
  tiling = tpu_kernel.TpuTiling(q_tile=4, pages_per_chunk=3)  # 3 does not divide P
  for seed in range(2):
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, num_rows + 1))
    while True:
      kv_lens = rng.integers(1, blocks_per_seq * block_size + 1, num_seqs)
      q_lens = [int(rng.integers(0, k + 1)) for k in kv_lens]
      q_lens = [q if rng.random() < 0.6 else min(q, 1) for q in q_lens]  # decode rows
      if sum(q_lens) <= num_tokens - 1:
        break
    case = cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens, num_kv_heads=2, group=4,
                           block_size=block_size, head_dim=64,
                           padding_seqs=num_rows - num_seqs,
                           padding_tokens=num_tokens - sum(q_lens), spare_pages=0,
                           extra_blocks=num_rows * blocks_per_seq - sum(
                               -(-int(k) // block_size) for k in kv_lens))
    # make_case sizes P from the longest sequence: pad the table to a fixed width.
    tables = np.full((num_rows, blocks_per_seq), _OUT_OF_RANGE, np.int32)
    tables[:, :case.block_tables_SP.shape[1]] = case.block_tables_SP
    case.block_tables_SP = tables
    _check(case, *_run(case, tiling=tiling), with_reference=True)


def test_default_tiling_and_traced_layer_in_scan():
  case = _mixed_case(11, dtype=jnp.float32, block_size=16, group=4, head_dim=128)
  q, k_pages, v_pages, _, kv_lens, tables, cu_q_lens, num_seqs = case.jax_args()
  scale = 128 ** -0.5

  def all_layers(q, k_pages, v_pages):
    def step(carry, layer):  # layer is a traced scalar: indexed inside the kernel
      out = tpu_kernel.ragged_paged_attention(q, k_pages, v_pages, layer, kv_lens, tables,
                                              cu_q_lens, num_seqs, sm_scale=scale,
                                              interpret=True)
      return carry, out
    return lax.scan(step, 0, jnp.arange(k_pages.shape[0], dtype=jnp.int32))[1]

  outs = _call_fast("scan", all_layers, q, k_pages, v_pages)
  for layer in range(k_pages.shape[0]):
    case.layer = layer
    _check(case, outs[layer], scale)


def _small_case(seed):
  # Decode, chunked prefill (two chunks), q_len 0, full prefill: few grid steps, since the
  # race detector is slow.
  case = cases.make_case(seed, q_lens=[1, 5, 0, 3], kv_lens=[11, 21, 7, 3], num_kv_heads=2,
                         group=4, head_dim=64, block_size=8)
  return _with_out_of_range_entries(case, seed + 1)


def test_no_races_and_no_out_of_bounds_reads():
  case = _small_case(3)
  params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                 uninitialized_memory="nan", num_cores_or_threads=2)
  out, scale = _run(case, interpret=params)
  out.block_until_ready()
  assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
  _check(case, out, scale)


@pytest.mark.parametrize("bad_id", [_OUT_OF_RANGE, -1, -2])
def test_out_of_range_block_that_is_read_is_never_copied(bad_id):
  # An id outside [0, N) that a sequence DOES read (invalid input: validate_attention_inputs
  # and the checkify debug mode reject it) is never DMA'd, neither out of bounds nor clamped
  # or wrapped into a real block: the page reads as zeros, exactly as in the reference.
  case = _small_case(3)
  case.block_tables_SP[1, 2] = bad_id
  params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                 uninitialized_memory="nan", num_cores_or_threads=2)
  try:
    out, scale = _run(case, interpret=params)
    out = np.asarray(jax.block_until_ready(out))
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  reference = ragged_paged_attention_reference(*case.jax_args(), sm_scale=scale)
  np.testing.assert_allclose(out, np.asarray(reference), rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(out))
  # Sequence 1 reads the bad page: its rows differ from reading a real block (block 0).
  clamped = case.block_tables_SP.copy()
  clamped[1, 2] = 0
  case.block_tables_SP = clamped
  wrong = ragged_paged_attention_reference(*case.jax_args(), sm_scale=scale)
  rows = slice(int(case.cu_q_lens[1]), int(case.cu_q_lens[2]))
  assert np.abs(out[rows] - np.asarray(wrong)[rows]).max() > 1e-3


def test_padding_only_batch_is_zero():
  case = _mixed_case(5, dtype=jnp.float32, block_size=8, group=1, head_dim=64)
  case.num_seqs = 0
  out, _ = _run(case)
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_zero_tokens():
  case = _mixed_case(5, dtype=jnp.float32, block_size=8, group=1, head_dim=64)
  q, *rest = case.jax_args()
  out = tpu_kernel.ragged_paged_attention(q[:0], *rest, sm_scale=0.125, interpret=True)
  assert out.shape == (0,) + q.shape[1:]


def test_public_entry_point():
  # paged_attention(impl="pallas_tpu") hands every variant to the kernel (window, cap and a
  # traced sinks array); the plain path also runs in tests/sharding.
  case = _mixed_case(9, dtype=jnp.float32, block_size=8, group=2, head_dim=64)
  q, k_pages, v_pages, layer, kv_lens, tables, cu_q_lens, num_seqs = case.jax_args()
  variants = _variant(case, "all", 9)

  def attend(q, k_pages, v_pages, layer, kv_lens, tables, cu_q_lens, num_seqs, sinks):
    cache = paged_jax.KVCache(k_pages=k_pages, v_pages=v_pages)
    return paged_jax.paged_attention(q, cache, layer, kv_lens, tables, cu_q_lens, num_seqs,
                                     sliding_window=variants["sliding_window"],
                                     soft_cap=variants["soft_cap"], sinks=sinks,
                                     impl="pallas_tpu", interpret=True)

  out = _call_fast("public", attend, q, k_pages, v_pages, jnp.int32(layer), kv_lens, tables,
                   cu_q_lens, num_seqs, jnp.asarray(variants["sinks"]))
  _check(case, out, 64 ** -0.5, with_reference=True, **variants)


# --- Attention variants: sliding window, soft cap, sinks; K/V given as storage bits. ---

def _variant(case: cases.Case, name: str, seed: int) -> dict:
  """The kwargs of ``name`` in the shared variants grid, sized to the case's context."""
  context = int(case.kv_lens_S[:case.num_seqs].max())
  return dict(cases.variant_grid(context, case.num_q_heads, seed))[name]


def _variant_id(params):
  name, dtype, block_size, group, head_dim, storage = params
  bits = "-bits" if storage else ""
  return f"{name}-{jnp.dtype(dtype).name}{bits}-Z{block_size}-G{group}-D{head_dim}"


# (variant, dtype, Z, G, D, pages as storage bits). The default run: window 1 and a smaller
# window with the cap and with sinks, head dims 128 and 256, bf16 K/V given as uint16 bits
# with kv_dtype=bfloat16 (test_public_entry_point adds every variant at once in float32).
_VARIANT_QUICK = [
    ("window1_sinks", jnp.bfloat16, 16, 1, 128, True),
    ("window_cap", jnp.bfloat16, 8, 8, 256, True),
]
_VARIANT_SHAPES = [
    (jnp.float32, 8, 1, 64, False), (jnp.bfloat16, 16, 4, 128, True),
    (jnp.float32, 8, 8, 256, False), (jnp.bfloat16, 32, 1, 256, True),
    (jnp.float32, 16, 4, 128, False), (jnp.bfloat16, 8, 8, 64, False),
]
_VARIANT_NAMES = [name for name, _ in cases.variant_grid(10, 1)]
# Half the product: the shapes come in (float32, bf16) pairs, and each variant meets one or
# two whole pairs (alternating), so every variant runs on both dtypes and every shape
# meets half the variants (the whole product took 4 minutes of the slow run's CPU).
_VARIANT_FULL = [p for p in ((name,) + shape for k, shape in enumerate(_VARIANT_SHAPES)
                             for i, name in enumerate(_VARIANT_NAMES)
                             if (k // 2 + i) % 2 == 0) if p not in _VARIANT_QUICK]


def _check_variant(params):
  name, dtype, block_size, group, head_dim, storage = params
  seed = sum(ord(c) for c in _variant_id(params))
  case = _mixed_case(seed, dtype=dtype, block_size=block_size, group=group,
                     head_dim=head_dim)
  variants = _variant(case, name, seed)
  out, scale = _run(case, storage=storage, **variants)
  _check(case, out, scale, with_reference=True, **variants)
  # The variant changed the answer: the comparison above tells it apart from plain causal.
  plain = cases.oracle(case, scale)
  if name != "window_large" and name != "window_eq":
    assert np.abs(np.asarray(out.astype(jnp.float32)) - plain).max() > 0.05


@pytest.mark.parametrize("params", _VARIANT_QUICK, ids=_variant_id)
def test_variants_match_oracle(params):
  _check_variant(params)


@pytest.mark.slow
@pytest.mark.parametrize("params", _VARIANT_FULL, ids=_variant_id)
def test_variants_match_oracle_full_grid(params):
  _check_variant(params)


def _hand_case(k_rows_JD, v_rows_JD, q_HD, *, sm_scale=1.0, **variants):
  """One sequence holding len(k_rows) keys in physical block 1 (block 0 and the page's other
  slots NaN), one query row at its last position, one padding row; one KV head."""
  kv_len, head_dim = np.shape(k_rows_JD)
  block_size = 8
  k_pages = np.full((1, 1, 2, block_size, head_dim), np.nan, np.float32)
  v_pages = np.full((1, 1, 2, block_size, head_dim), np.nan, np.float32)
  k_pages[0, 0, 1, :kv_len] = k_rows_JD
  v_pages[0, 0, 1, :kv_len] = v_rows_JD
  q_THD = np.zeros((2,) + np.shape(q_HD), np.float32)
  q_THD[0] = q_HD
  sinks = variants.pop("sinks", None)
  statics = dict(sm_scale=sm_scale, interpret=True, **variants)
  args = (jnp.asarray(q_THD), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.int32(0),
          jnp.array([kv_len], jnp.int32), jnp.array([[1, 0]], jnp.int32),
          jnp.array([0, 1], jnp.int32), jnp.int32(1))
  if sinks is None:
    kernel = functools.partial(tpu_kernel.ragged_paged_attention, **statics)
  else:
    def kernel(*a):
      return tpu_kernel.ragged_paged_attention(*a[:-1], sinks=a[-1], **statics)
    args += (jnp.asarray(sinks, jnp.float32),)
  out = np.asarray(_call_fast(("hand",) + tuple(sorted(statics.items())), kernel, *args))
  np.testing.assert_array_equal(out[1], 0.0)
  return out[0]


def test_hand_computed_window_hides_one_key():
  # Three keys at positions 0, 1, 2, all zero: every score is 0. The query sits at
  # position 2; sliding_window=2 lets it see positions 1 and 2 (2 - 2 < k <= 2) and hides
  # exactly key 0. Weights 1/2, 1/2: out = (v1 + v2) / 2 = (3 + 5) / 2 = 4, where the
  # plain causal answer is (1 + 3 + 5) / 3 = 3.
  head_dim = 64
  k = np.zeros((3, head_dim))
  v = np.array([1.0, 3.0, 5.0])[:, None] * np.ones((3, head_dim))
  out = _hand_case(k, v, np.ones((1, head_dim)), sliding_window=2)
  np.testing.assert_allclose(out, 4.0, rtol=1e-6)


def test_hand_computed_cap_changes_the_argmax():
  # sm_scale 1, q = e0; k0 = 10 e0, k1 = 0: scores 10 and 0. v0 = e0, v1 = 3 e1.
  # Uncapped: w1 = 1 / (1 + e^10) = 4.5e-5, out = (0.99995, 1.4e-4): argmax dimension 0.
  # soft_cap=1: scores tanh(10) = 0.99999999 and tanh(0) = 0, w0 = 1 / (1 + e^-tanh(10))
  # = 0.7311, w1 = 0.2689, out = (0.7311, 3 * 0.2689 = 0.8068): argmax dimension 1.
  head_dim = 64
  e = np.eye(head_dim)
  w0 = 1.0 / (1.0 + math.exp(-math.tanh(10.0)))
  out = _hand_case(np.stack([10 * e[0], 0 * e[0]]), np.stack([e[0], 3 * e[1]]), e[:1],
                   soft_cap=1.0)
  expected = np.zeros(head_dim)
  expected[0], expected[1] = w0, 3 * (1 - w0)
  np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
  assert int(np.argmax(out[0])) == 1


def test_hand_computed_sink_takes_half_the_mass():
  # Two keys, both scores 0 (k = 0): sum_k exp(s_k) = 2. Query head 0 has sink log 2:
  # exp(sink) = 2 takes 2 / (2 + 2) = half the mass, each key 1/4, out = (1 + 3) / 4 = 1
  # (no sink: 2). Query head 1 (same KV head, G = 2) has sink log 6: each key 1/8,
  # out = 4 / 8 = 0.5, so each head uses its own sinks[h].
  head_dim = 64
  k = np.zeros((2, head_dim))
  v = np.array([1.0, 3.0])[:, None] * np.ones((2, head_dim))
  out = _hand_case(k, v, np.ones((2, head_dim)), sinks=np.log([2.0, 6.0]))
  np.testing.assert_allclose(out[0], 1.0, rtol=1e-6)
  np.testing.assert_allclose(out[1], 0.5, rtol=1e-6)


# --- Cost follows the window: the pages the kernel copies, counted in interpret mode. ---

def _pages_in_windows(case: cases.Case, items_FW, *, q_tile, window):
  """``{(item, page)}`` each item needs, from its rows one by one: the pages holding some
  position k with p - W < k <= p (k >= 0) for a row at position p (no window: k <= p)."""
  block_size = case.k_pages_LKNZD.shape[3]
  needed = set()
  for w in range(items_FW.shape[1]):
    seq, tile, lo, hi = (int(items_FW[f, w]) for f in (
        tpu_ragged._SEQ, tpu_ragged._TILE, tpu_ragged._ROW_LO, tpu_ragged._ROW_HI))
    q_len = int(case.cu_q_lens[seq + 1] - case.cu_q_lens[seq])
    for row in range(tile * q_tile + lo, tile * q_tile + hi):
      pos = int(case.kv_lens_S[seq]) - q_len + row - int(case.cu_q_lens[seq])
      first = 0 if window is None else max(0, pos - window + 1)
      needed |= {(w, k // block_size) for k in range(first, pos + 1)}
  return needed


def _window_case(seed):
  # Decode at position 69 of 70 (a window of 10 needs pages 7, 8 of 9), a chunk at
  # positions 44..49 (pages 4..6), q_len 0, a full prefill of 12 and a decode at 32.
  case = cases.make_case(seed, q_lens=[1, 6, 0, 12, 1], kv_lens=[70, 50, 7, 12, 33],
                         num_kv_heads=2, group=2, head_dim=64, block_size=8)
  return _with_out_of_range_entries(case, seed + 1)


@pytest.mark.parametrize("window", [10, pytest.param(None, marks=pytest.mark.slow)])
def test_copies_exactly_the_pages_in_the_windows(window):
  case = _window_case(21)
  tiling = _TILING
  statics = dict(sm_scale=0.125, sliding_window=window, tiling=tiling, interpret=True)
  out, log_KWP, items_FW = _call_fast(
      ("page_log",) + tuple(sorted(statics.items())),
      functools.partial(tpu_ragged.ragged_paged_attention_page_log, **statics),
      *case.jax_args())
  _check(case, out, 0.125, sliding_window=window)
  log_KWP, items_FW = np.asarray(log_KWP), np.asarray(items_FW)
  needed = _pages_in_windows(case, items_FW, q_tile=tiling.q_tile, window=window)
  # Every KV head copies each needed page of each item exactly once, and nothing else.
  expected_WP = np.zeros(log_KWP.shape[1:], np.int32)
  for w, page in needed:
    expected_WP[w, page] = 1
  for kv_head in range(log_KWP.shape[0]):
    np.testing.assert_array_equal(log_KWP[kv_head], expected_WP)
  if window is not None:  # the decode at position 69 reads 2 of its 9 pages
    seq_W = items_FW[tpu_ragged._SEQ]
    live_W = items_FW[tpu_ragged._ROW_HI] > items_FW[tpu_ragged._ROW_LO]
    decode_w = int(np.flatnonzero((seq_W == 0) & live_W)[0])
    assert np.flatnonzero(log_KWP[0, decode_w]).tolist() == [7, 8]


@pytest.mark.slow
def test_window_no_races_and_no_out_of_bounds_reads():
  # The chained prefetch with items starting at their window's first page: no DMA races,
  # no out-of-bounds read, uninitialised VMEM as NaN; every variant on.
  case = _window_case(23)
  params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                 uninitialized_memory="nan", num_cores_or_threads=2)
  variants = dict(sliding_window=10, soft_cap=3.0, sinks=cases.make_sinks(23, 4))
  try:
    out, scale = _run(case, interpret=params, **variants)
    out.block_until_ready()
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  _check(case, out, scale, **variants)


def test_work_items_start_at_the_first_window_page():
  # Pure metadata: the first page of an item is (p - W + 1) // Z for its first row's
  # position p, clipped at 0; chunks count pages from there.
  block_size, pages_per_chunk, window = 16, 4, 256
  kv_lens, cu_q_lens = np.array([8192, 300, 1000], np.int32), np.array([0, 1, 33, 33])
  work_items = jax.jit(functools.partial(
      tpu_ragged._work_items, num_tokens=33, q_tile=8, block_size=block_size,
      pages_per_chunk=pages_per_chunk, blocks_per_seq=512, sliding_window=window))
  items = work_items(jnp.asarray(kv_lens), jnp.asarray(cu_q_lens, jnp.int32), jnp.int32(3))
  f = np.asarray(items[0]).reshape(tpu_ragged._NUM_FIELDS, -1)
  # Item 0: the decode at 8191 -> first page (8191 - 255) // 16 = 496, horizon 8192 -> 512
  # pages, 16 pages = 4 chunks. Item 1: rows 1..7 of sequence 1 (positions 268..274):
  # first page (268 - 255) // 16 = 0, horizon 275 -> 18 pages = 5 chunks.
  assert f[tpu_ragged._FIRST_PAGE, 0] == 496 and f[tpu_ragged._CHUNKS, 0] == 4
  assert f[tpu_ragged._FIRST_PAGE, 1] == 0 and f[tpu_ragged._CHUNKS, 1] == 5
  # Item 4 (tile 3, rows 24..31 of sequence 1, positions 291..298): (291 - 255) // 16 = 2,
  # horizon 299 -> 19 pages: 17 pages = 5 chunks.
  assert f[tpu_ragged._TILE, 4] == 3 and f[tpu_ragged._FIRST_PAGE, 4] == 2
  assert f[tpu_ragged._CHUNKS, 4] == 5


# --- Variant validation (trace time, no compile). ---

def _tiny_args(kv_dtype=None, pages_dtype=jnp.float32):
  q = jnp.zeros((4, 2, 64), jnp.float32)
  pages = jnp.zeros((1, 2, 4, 8, 64), pages_dtype)
  return (q, pages, pages, 0, jnp.ones((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32),
          jnp.array([0, 1, 2], jnp.int32), jnp.int32(2))


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=0), "sliding_window"), (dict(sliding_window=-3), "sliding_window"),
    (dict(sliding_window=2.0), "sliding_window"), (dict(sliding_window=True), "sliding_window"),
    (dict(soft_cap=0.0), "soft_cap"), (dict(soft_cap=-1.0), "soft_cap"),
    (dict(soft_cap=float("inf")), "soft_cap"), (dict(soft_cap=float("nan")), "soft_cap"),
    (dict(sinks=jnp.zeros((3,), jnp.float32)), "sinks"),
    (dict(sinks=jnp.zeros((2,), jnp.bfloat16)), "sinks"),
    (dict(kv_dtype=jnp.int8), "kv_dtype"),
    (dict(kv_dtype=jnp.bfloat16), "k_pages"),  # float32 pages are not bf16 storage bits
])
def test_rejects_bad_variants(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tpu_kernel.ragged_paged_attention(*_tiny_args(), sm_scale=1.0, interpret=True, **kwargs)


def test_rejects_storage_bits_without_kv_dtype():
  with pytest.raises(ValueError, match="k_pages"):
    tpu_kernel.ragged_paged_attention(*_tiny_args(pages_dtype=jnp.uint16), sm_scale=1.0,
                                      interpret=True)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_default_tiling_fits_vmem_at_every_head_dim(head_dim):
  # Every block size 8..128, bf16 and f32, GQA 1..16, decode to long prefill: the default
  # tiling passes the VMEM check (the estimate counts every variant's buffers).
  for block_size in (8, 16, 32, 64, 128):
    for group in (1, 2, 4, 8, 16):
      for num_tokens, num_seq_rows in ((1, 1), (128, 128), (512, 4), (8192, 1)):
        tiling = tpu_kernel.default_tiling(num_tokens, num_seq_rows, 8 * group, 8,
                                           block_size, 8192 // block_size)
        # (q itemsize, K/V itemsize, quantised): bf16, f32, and one-byte K/V with scales.
        for q_itemsize, kv_itemsize, quantized in ((2, 2, False), (4, 4, False),
                                                   (2, 1, True), (4, 1, True)):
          sizes = dict(group=group, block_size=block_size, head_dim=head_dim,
                       q_itemsize=q_itemsize, kv_itemsize=kv_itemsize, quantized=quantized)
          tiling.check(**sizes)
          assert tiling.vmem_bytes(**sizes) <= tpu_ragged._VMEM_BUDGET_BYTES // 2


# --- Lowering for real TPUs with the variants on (no TPU needed). ---

_MODEL_SHAPES = {  # (H, K, D)
    "llama3_8b": (32, 8, 128), "gemma3": (8, 4, 256), "gpt_oss": (64, 8, 64)}
_VARIANTS_ON = {
    "window": dict(sliding_window=128), "cap": dict(soft_cap=30.0),
    "sinks": dict(sinks=True), "all": dict(sliding_window=128, soft_cap=30.0, sinks=True)}


# The default run lowers every model with all variants on; one at a time is slow.
_EXPORT_VARIANTS = [
    (model, variant) if variant == "all" else pytest.param(model, variant,
                                                           marks=pytest.mark.slow)
    for model in _MODEL_SHAPES for variant in _VARIANTS_ON]


@pytest.mark.parametrize("model,variant", _EXPORT_VARIANTS)
def test_lowers_for_tpu_with_variants(model, variant):
  # bf16 pools given as uint16 storage bits with kv_dtype=bfloat16; a mixed batch of 64
  # rows over 8 sequences, 16-token pages.
  num_q_heads, num_kv_heads, head_dim = _MODEL_SHAPES[model]
  num_tokens, num_seq_rows, block_size, blocks_per_seq = 64, 8, 16, 64
  spec = jax.ShapeDtypeStruct
  pages = spec((2, num_kv_heads, 512, block_size, head_dim), jnp.uint16)
  args = (spec((num_tokens, num_q_heads, head_dim), jnp.bfloat16), pages, pages,
          spec((), jnp.int32), spec((num_seq_rows,), jnp.int32),
          spec((num_seq_rows, blocks_per_seq), jnp.int32),
          spec((num_seq_rows + 1,), jnp.int32), spec((), jnp.int32),
          spec((num_q_heads,), jnp.float32))
  variants = dict(_VARIANTS_ON[variant])
  with_sinks = variants.pop("sinks", False)

  def attend(*a):
    return tpu_kernel.ragged_paged_attention(*a[:-1], sinks=a[-1] if with_sinks else None,
                                             sm_scale=head_dim ** -0.5,
                                             kv_dtype=jnp.bfloat16, **variants)

  exported = export.export(jax.jit(attend), platforms=["tpu"])(*args)
  assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].shape == (num_tokens, num_q_heads, head_dim)
  assert exported.out_avals[0].dtype == jnp.bfloat16


# --- Quantised pools: int8 / float8 bits with one float32 scale per token and KV head. ---

def _check_quantized(case: cases.Case, kv_dtype, out, scale, **variants):
  """Against the jnp reference on the SAME quantised pool (``cases.quantized_args``: bits,
  scales, NaN scales on unused memory) and the float64 oracle of its dequantised values;
  finite, padding rows zero. Returns the output as float32 numpy."""
  dtype = case.q_THD.dtype
  assert out.dtype == dtype and out.shape == case.q_THD.shape
  out = np.asarray(out.astype(jnp.float32))
  assert np.all(np.isfinite(out))
  traced = dict(variants)
  if traced.get("sinks") is not None:
    traced["sinks"] = jnp.asarray(traced["sinks"])
  args, pool_kwargs = cases.quantized_args(case, kv_dtype)
  reference = ragged_paged_attention_reference(*args, sm_scale=scale, **pool_kwargs, **traced)
  reference = np.asarray(reference.astype(jnp.float32))
  assert np.abs(reference).max() > 0.1  # the comparisons are not vacuous
  np.testing.assert_allclose(out, reference, **cases.tolerance(dtype))
  expected = cases.oracle(cases.dequantized_case(case, kv_dtype), scale, **variants)
  np.testing.assert_allclose(out, expected, **cases.tolerance(dtype))
  assert np.all(out[int(case.cu_q_lens[case.num_seqs]):] == 0.0)
  return out


def _quant_id(params):
  name, kv_dtype, q_dtype, block_size, group, head_dim = params
  return (f"{jnp.dtype(kv_dtype).name}-{name}-q{jnp.dtype(q_dtype).name}-Z{block_size}"
          f"-G{group}-D{head_dim}")


# (variant, K/V dtype, q dtype, Z, G, D). Default run: each quantised dtype once with a
# float32 q (float32 tolerance: the kernel computes in float32) and a variant on; the slow
# grid adds bfloat16 q, float8_e5m2, head dim 256 and every variant family.
_QUANT_QUICK = [
    ("window_sinks", jnp.int8, jnp.float32, 8, 4, 64),
    ("window_cap", jnp.float8_e4m3fn, jnp.float32, 16, 2, 128),
]
_QUANT_FULL = [
    ("all", jnp.int8, jnp.bfloat16, 16, 4, 128),
    ("window1_sinks", jnp.int8, jnp.float32, 32, 1, 64),
    ("cap", jnp.int8, jnp.float32, 8, 8, 256),
    ("all", jnp.float8_e4m3fn, jnp.bfloat16, 8, 8, 256),
    ("sinks", jnp.float8_e4m3fn, jnp.float32, 32, 4, 64),
    ("window_small", jnp.float8_e4m3fn, jnp.bfloat16, 16, 1, 128),
    ("all", jnp.float8_e5m2, jnp.float32, 8, 4, 128),
    ("window_sinks", jnp.float8_e5m2, jnp.bfloat16, 16, 2, 64),
]


def _check_quantized_variant(params):
  name, kv_dtype, q_dtype, block_size, group, head_dim = params
  seed = sum(ord(c) for c in _quant_id(params))
  case = _mixed_case(seed, dtype=q_dtype, block_size=block_size, group=group,
                     head_dim=head_dim)
  variants = _variant(case, name, seed)
  out, scale = _run(case, quantized=kv_dtype, **variants)
  if variants.get("sliding_window"):
    # Pages (and so scale rows) wholly before every window of a sequence as NaN: never
    # copied, so the output is bit for bit the same (same executable).
    poisoned = cases.poison_before_window(case, variants["sliding_window"])
    poisoned_out, _ = _run(poisoned, quantized=kv_dtype, **variants)
    np.testing.assert_array_equal(np.asarray(poisoned_out), np.asarray(out))
  out = _check_quantized(case, kv_dtype, out, scale, **variants)
  # Quantisation changed the answer a little (so the pool, not float K/V, was read), and
  # the variant changed it a lot.
  exact = cases.oracle(case, scale, **variants)
  assert 1e-5 < cases.relative_error(out, exact, case) < 0.1
  plain = cases.oracle(cases.dequantized_case(case, kv_dtype), scale)
  if name not in ("window_large", "window_eq"):
    assert np.abs(out - plain).max() > 0.05


@pytest.mark.parametrize("params", _QUANT_QUICK, ids=_quant_id)
def test_quantized_matches_reference(params):
  _check_quantized_variant(params)


@pytest.mark.slow
@pytest.mark.parametrize("params", _QUANT_FULL, ids=_quant_id)
def test_quantized_matches_reference_full_grid(params):
  _check_quantized_variant(params)


# Issue 20's accuracy batch, shared with every impl's test and
# benchmarks/kv_quant_accuracy.py: four KV heads 1x..10x apart, three outlier tokens.
_ACCURACY_CASE = cases.quant_accuracy_case()


@pytest.mark.parametrize("kv_dtype,bound", [(jnp.int8, 1.5e-2), (jnp.float8_e4m3fn, 6e-2)],
                         ids=["int8", "float8_e4m3fn"])
def test_quantized_accuracy_against_float32_kv(kv_dtype, bound):
  # Issue 20's bound: max abs error / max abs output against the same attention over the
  # unquantised float32 K/V (float64 oracle). For int8, one scale per tensor on the same
  # data (same executable, only the scales differ) is the negative control: over the bound.
  case, scale = _ACCURACY_CASE, 128 ** -0.5
  exact = cases.oracle(case, scale)
  out, _ = _run(case, quantized=kv_dtype)
  per_token = cases.relative_error(out, exact, case)
  assert per_token <= bound, per_token
  if kv_dtype == jnp.int8:
    out_tensor, _ = _run(case, quantized=kv_dtype, per_tensor=True)
    per_tensor = cases.relative_error(out_tensor, exact, case)
    assert per_tensor > bound and per_tensor > 2 * per_token, (per_token, per_tensor)


def test_quantized_no_races_and_no_out_of_bounds_reads():
  # The scale rows ride on their pages' semaphores: no DMA races, no out-of-bounds scale
  # read (unused table entries point far outside the pool), uninitialised VMEM (scale
  # buffers included) as NaN; a window, so items start past page 0.
  case = _small_case(4)
  params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                 uninitialized_memory="nan", num_cores_or_threads=2)
  try:
    out, scale = _run(case, interpret=params, quantized=jnp.int8, sliding_window=9)
    out.block_until_ready()
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
  finally:
    pltpu.reset_tpu_interpret_mode_state()
  _check_quantized(case, jnp.int8, out, scale, sliding_window=9)


def test_quantized_public_entry_point():
  # paged_attention(impl="pallas_tpu") on a KVCache(dtype=float8_e4m3fn) built from float
  # pages (it quantises them): the kernel gets the bits, kv_dtype and both scale arrays.
  case = _mixed_case(10, dtype=jnp.float32, block_size=8, group=2, head_dim=64)
  q, k_pages, v_pages, layer, kv_lens, tables, cu_q_lens, num_seqs = case.jax_args()

  def attend(q, k_pages, v_pages, layer, kv_lens, tables, cu_q_lens, num_seqs):
    cache = paged_jax.KVCache(k_pages, v_pages, dtype=jnp.float8_e4m3fn)
    return paged_jax.paged_attention(q, cache, layer, kv_lens, tables, cu_q_lens, num_seqs,
                                     soft_cap=3.0, impl="pallas_tpu", interpret=True)

  out = _call_fast("public_quantized", attend, q, k_pages, v_pages, jnp.int32(layer), kv_lens,
                   tables, cu_q_lens, num_seqs)
  _check_quantized(case, jnp.float8_e4m3fn, out, 64 ** -0.5, soft_cap=3.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype=jnp.int8), "k_scales"),  # scales missing
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "v_scales"),
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 16), jnp.float32),
          v_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "k_scales"),  # wrong Z
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 8), jnp.bfloat16),
          v_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "k_scales"),  # not float32
])
def test_rejects_bad_scales(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tpu_kernel.ragged_paged_attention(*_tiny_args(pages_dtype=jnp.int8), sm_scale=1.0,
                                      interpret=True, **kwargs)


def test_rejects_scales_for_unquantized_pool():
  scales = jnp.ones((1, 2, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match="k_scales"):
    tpu_kernel.ragged_paged_attention(*_tiny_args(), sm_scale=1.0, interpret=True,
                                      k_scales=scales, v_scales=scales)


def test_vmem_estimate_counts_whole_lane_tiles():
  # A [J, 64] or [M, 80] array fills 128 lanes, as a [J, 128] one does: D = 64, 80, 96 and
  # 128 cost the same VMEM; 136 takes two lane tiles. A chunk of 64 positions (the [M, J]
  # scores) takes 128 lanes, as one of 128 does.
  tiling = tpu_kernel.TpuTiling(q_tile=4, pages_per_chunk=4)
  sizes = dict(group=4, block_size=16, q_itemsize=2, kv_itemsize=2)
  at = lambda d, t=tiling: t.vmem_bytes(head_dim=d, **sizes)
  assert at(64) == at(80) == at(96) == at(128) < at(136) == at(256)
  half = dataclasses.replace(tiling, pages_per_chunk=8)  # J = 128
  assert at(128) < at(128, half)
  state_and_q = 4 * 16 * 128 * 2 + 16 * 128 * 4  # [M, D] q / out blocks and accumulator
  kv_and_tiles = 4 * 64 * 128 * 2 + 2 * 64 * 128 * 6  # [J, D] buffers and loaded tiles
  assert at(136) - at(128) == state_and_q + kv_and_tiles


def test_vmem_estimate_counts_scale_buffers():
  # Two slots of [R, Z] float32 scale rows for K and for V, at least: each pads to whole
  # (8, 128) tiles, 4 * 16 * 128 * 4 bytes at R = 16, Z = 16.
  tiling = tpu_kernel.TpuTiling(q_tile=1, pages_per_chunk=16)
  sizes = dict(group=4, block_size=16, head_dim=128, q_itemsize=2, kv_itemsize=1)
  extra = tiling.vmem_bytes(**sizes, quantized=True) - tiling.vmem_bytes(**sizes)
  assert extra >= 4 * 16 * 128 * 4


_QUANT_EXPORTS = [(model, dtype) for model in ("llama3_8b", "gemma3")
                  for dtype in (jnp.int8, jnp.float8_e4m3fn)]


@pytest.mark.parametrize("model,kv_dtype", _QUANT_EXPORTS,
                         ids=[f"{m}-{jnp.dtype(d).name}" for m, d in _QUANT_EXPORTS])
def test_lowers_for_tpu_quantized(model, kv_dtype):
  # One-byte pools (int8, or float8 as uint8 bits) with f32[L, K, N, Z] scales, bfloat16 q,
  # every variant on; a mixed batch of 64 rows over 8 sequences, 16-token pages.
  num_q_heads, num_kv_heads, head_dim = _MODEL_SHAPES[model]
  num_tokens, num_seq_rows, block_size, blocks_per_seq, num_blocks = 64, 8, 16, 64, 512
  spec = jax.ShapeDtypeStruct
  pages = spec((2, num_kv_heads, num_blocks, block_size, head_dim),
               layout.storage_dtype(kv_dtype))
  scales = spec(layout.scales_shape(2, num_kv_heads, num_blocks, block_size), jnp.float32)
  args = (spec((num_tokens, num_q_heads, head_dim), jnp.bfloat16), pages, pages,
          spec((), jnp.int32), spec((num_seq_rows,), jnp.int32),
          spec((num_seq_rows, blocks_per_seq), jnp.int32),
          spec((num_seq_rows + 1,), jnp.int32), spec((), jnp.int32),
          spec((num_q_heads,), jnp.float32), scales, scales)

  def attend(*a):
    return tpu_kernel.ragged_paged_attention(*a[:-3], sinks=a[-3], k_scales=a[-2],
                                             v_scales=a[-1], sm_scale=head_dim ** -0.5,
                                             sliding_window=128, soft_cap=30.0,
                                             kv_dtype=kv_dtype)

  exported = export.export(jax.jit(attend), platforms=["tpu"])(*args)
  assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].shape == (num_tokens, num_q_heads, head_dim)
  assert exported.out_avals[0].dtype == jnp.bfloat16


# --- Work items (jnp metadata, no kernel). ---

@pytest.mark.parametrize("q_tile", [1, 3, 4, 8])
def test_work_items_cover_every_row_once(q_tile):
  num_tokens, num_rows = 23, 6
  work_items = jax.jit(functools.partial(tpu_ragged._work_items, num_tokens=num_tokens,
                                         q_tile=q_tile, block_size=8, pages_per_chunk=2,
                                         blocks_per_seq=1_250))
  for seed in range(10):
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(0, num_rows + 1))
    q_lens = rng.integers(0, 7, num_rows) * (rng.random(num_rows) < 0.8)
    q_lens[num_seqs:] = 0
    q_lens = np.minimum(q_lens, np.maximum(0, num_tokens - np.cumsum(q_lens) + q_lens))
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = (q_lens + rng.integers(0, 20, num_rows)).astype(np.int32)
    items, _ = work_items(jnp.asarray(kv_lens), jnp.asarray(cu_q_lens), jnp.int32(num_seqs))
    num_items = items.size // tpu_ragged._NUM_FIELDS
    f = np.asarray(items).reshape(tpu_ragged._NUM_FIELDS, num_items)
    tile, lo, hi, first = (f[tpu_ragged._TILE], f[tpu_ragged._ROW_LO],
                           f[tpu_ragged._ROW_HI], f[tpu_ragged._FIRST])
    owner = np.full(-(-num_tokens // q_tile) * q_tile, -1)
    for w in range(num_items):
      for row in range(tile[w] * q_tile + lo[w], tile[w] * q_tile + hi[w]):
        assert owner[row] == -1, "row owned twice"
        owner[row] = f[tpu_ragged._SEQ, w]
        qpos = row + f[tpu_ragged._Q_OFFSET, w] - tile[w] * q_tile
        seq = f[tpu_ragged._SEQ, w]
        assert qpos == kv_lens[seq] - q_lens[seq] + row - cu_q_lens[seq]
    live = cu_q_lens[num_seqs]
    expected_owner = np.searchsorted(cu_q_lens, np.arange(live), side="right") - 1
    np.testing.assert_array_equal(owner[:live], expected_owner)
    assert np.all(owner[live:] == -1)
    # Every tile is visited, its items consecutive, the first one flagged.
    assert set(tile.tolist()) == set(range(-(-num_tokens // q_tile)))
    changes = np.flatnonzero(np.diff(tile) != 0) + 1
    assert len(set(tile[np.concatenate([[0], changes])].tolist())) == len(changes) + 1
    np.testing.assert_array_equal(np.flatnonzero(first), np.concatenate([[0], changes]))
    chunks = f[tpu_ragged._CHUNKS]
    np.testing.assert_array_equal(f[tpu_ragged._CHUNK_BASE], np.cumsum(chunks) - chunks)
    assert np.all(chunks[hi == lo] == 0)  # dead items read nothing


# --- Validation. ---

@pytest.mark.parametrize("field,value", [("q_tile", 0), ("pages_per_chunk", -1),
                                         ("q_tile", 2.0), ("pages_per_chunk", True)])
def test_tiling_rejects_bad_values(field, value):
  kwargs = dict(q_tile=4, pages_per_chunk=2)
  kwargs[field] = value
  with pytest.raises(ValueError, match=field):
    tpu_kernel.TpuTiling(**kwargs)


def test_tiling_rejects_vmem_overflow():
  case = _mixed_case(5, dtype=jnp.float32, block_size=32, group=1, head_dim=256)
  with pytest.raises(ValueError, match="pages_per_chunk"):
    _run(case, tiling=tpu_kernel.TpuTiling(q_tile=4, pages_per_chunk=4096))


@pytest.mark.parametrize("head_dim,block_size,match", [(100, 8, "head_dim"),
                                                       (320, 8, "head_dim"),
                                                       (64, 12, "block_size")])
def test_rejects_unsupported_shapes(head_dim, block_size, match):
  q = jnp.zeros((4, 2, head_dim), jnp.float32)
  pages = jnp.zeros((1, 2, 4, block_size, head_dim), jnp.float32)
  with pytest.raises(ValueError, match=match):
    tpu_kernel.ragged_paged_attention(q, pages, pages, 0, jnp.ones((2,), jnp.int32),
                                      jnp.zeros((2, 2), jnp.int32),
                                      jnp.array([0, 1, 2], jnp.int32), jnp.int32(2),
                                      sm_scale=1.0, interpret=True)


def test_default_tiling_fits_shapes():
  decode = tpu_kernel.default_tiling(64, 64, 32, 8, 16, 128)
  assert decode.q_tile == 1 and decode.pages_per_chunk * 16 == 256
  prefill = tpu_kernel.default_tiling(2048, 4, 32, 1, 32, 64)  # MQA: G = 32
  assert prefill.q_tile * 32 <= 256


# --- Lowering for real TPUs (no TPU needed). ---

_EXPORT_GRID = [
    # (T, S, H, K, D, Z, dtype): Llama-3-8B-like (32 q heads, 8 KV heads, head dim 128) at
    # decode and at prefill; MQA; head dims 64 and 256; block sizes 16, 32, 64; f32, bf16.
    (8, 8, 32, 8, 128, 16, jnp.bfloat16), (256, 4, 32, 8, 128, 32, jnp.bfloat16),
    (256, 4, 32, 8, 128, 16, jnp.float32), (64, 8, 16, 1, 128, 16, jnp.bfloat16),
    (64, 8, 8, 1, 64, 32, jnp.float32), (64, 8, 8, 2, 64, 16, jnp.bfloat16),
    (64, 8, 8, 4, 256, 16, jnp.bfloat16), (64, 8, 4, 2, 256, 32, jnp.float32),
    (64, 8, 8, 2, 128, 64, jnp.bfloat16),  # block size 64
    (64, 8, 32, 32, 96, 16, jnp.bfloat16), (64, 8, 8, 2, 80, 16, jnp.float32),  # Phi-3, -2
]


@pytest.mark.parametrize(
    "num_tokens,num_seq_rows,num_q_heads,num_kv_heads,head_dim,block_size,dtype",
    _EXPORT_GRID)
def test_lowers_for_tpu(num_tokens, num_seq_rows, num_q_heads, num_kv_heads, head_dim,
                        block_size, dtype):
  blocks_per_seq, num_blocks, num_layers = 32, 256, 4
  spec = jax.ShapeDtypeStruct
  pages = spec((num_layers, num_kv_heads, num_blocks, block_size, head_dim), dtype)
  args = (spec((num_tokens, num_q_heads, head_dim), dtype), pages, pages,
          spec((), jnp.int32), spec((num_seq_rows,), jnp.int32),
          spec((num_seq_rows, blocks_per_seq), jnp.int32),
          spec((num_seq_rows + 1,), jnp.int32), spec((), jnp.int32))

  def attend(*a):
    return tpu_kernel.ragged_paged_attention(*a, sm_scale=head_dim ** -0.5)

  exported = export.export(jax.jit(attend), platforms=["tpu"])(*args)
  module = exported.mlir_module()
  assert "tpu_custom_call" in module
  assert "cost_estimate" in module  # the pl.CostEstimate reaches XLA
  assert exported.out_avals[0].shape == (num_tokens, num_q_heads, head_dim)
  assert exported.out_avals[0].dtype == dtype


@pytest.mark.slow
def test_tpu_benchmark_dry_run_with_quantized_pools(tmp_path):
  # benchmarks/tpu/run.py's int8 / float8 checks and timing rows run (CPU, interpret mode):
  # the quantised pool matches the reference on the same bits and scales, and ours and the
  # XLA path agree on it.
  from benchmarks.tpu import run as tpu_run
  results = tpu_run.main(["--dry-run", "--kv-dtypes", "int8,float8_e4m3fn",
                          "--out", str(tmp_path)])
  checks = {c["kv_dtype"]: c for c in results["checks"]}
  assert set(checks) == {"bfloat16", "int8", "float8_e4m3fn"}
  assert all(c["ok"] for c in checks.values()), checks
  quantised = [t for t in results["timings"] if t["kv_dtype"] != "bfloat16"]
  assert {(t["kv_dtype"], t["impl"]) for t in quantised} == {
      (d, impl) for d in ("int8", "float8_e4m3fn") for impl in (tpu_run.OURS, tpu_run.XLA)}
  for t in quantised:
    assert "error" not in t, t
    assert t.get("max_abs_diff_vs_ours", 0.0) < 1e-2, t
