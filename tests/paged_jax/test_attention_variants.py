"""Attention variants (sliding window, soft cap, sinks, head dim 256, storage-bits pages) on
the reference and XLA impls, against the float64 oracle and by hand.

The default run covers each variant and their combination on one mixed batch (decode,
chunked prefill, full prefill, an idle row, padding) with a few compilations; the product
grid of issue 19 is under ``slow``.
"""

from __future__ import annotations

import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, paged_attention
from paged_jax.attention import checked_paged_attention
from paged_jax.pallas_kernels import validation
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.xla import XlaTiling, ragged_paged_attention as xla_attention
from paged_jax.pallas_kernels.xla.ragged import plan_work
from tests import attention_cases as cases

IMPLS = ("reference", "xla")
KERNELS = {"reference": ragged_paged_attention_reference, "xla": xla_attention}


def run(case: cases.Case, impl: str, **kwargs):
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  cache = KVCache(k_pages=k_pages, v_pages=v_pages)
  return paged_attention(q, cache, layer, kv_lens, tables, cu, num_seqs, impl=impl, **kwargs)


def check(case: cases.Case, out, dtype, **variants) -> None:
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert np.all(np.isfinite(out)), "output must be finite (NaN pages were read)"
  expected = cases.oracle(case, **variants)
  live = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_allclose(out[:live], expected[:live], **cases.tolerance(dtype))
  np.testing.assert_array_equal(out[live:], 0.0)  # padding rows are zero


def mixed_case(seed, *, dtype=jnp.float32, group=4, head_dim=64, block_size=8):
  q_lens, kv_lens = cases.mixed_lengths(block_size)
  return cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens,
                         num_kv_heads=2 if group < 8 else 1, group=group, head_dim=head_dim,
                         block_size=block_size, dtype=dtype)


# mixed_lengths(8): longest sequence 25 tokens; its first query sits at 15.
_CASE = mixed_case(19)
_SINKS = cases.make_sinks(1, _CASE.num_q_heads)
DEFAULT_VARIANTS = [
    # Window 5 with cap and sinks: every mechanism at once, pages before the window poisoned.
    ("all", dict(sliding_window=5, soft_cap=2.0, sinks=_SINKS)),
    ("window1_sinks", dict(sliding_window=1, sinks=_SINKS)),  # one key; the sink shares it
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,variants", DEFAULT_VARIANTS, ids=[v[0] for v in DEFAULT_VARIANTS])
def test_variants_against_oracle(impl, name, variants):
  case = _CASE
  if variants.get("sliding_window"):
    case = cases.poison_before_window(case, variants["sliding_window"])
  check(case, run(case, impl, **variants), jnp.float32, **variants)


@pytest.mark.parametrize("impl", ["xla"])  # the reference's: the slow grid
def test_head_dim_256_gqa_8_bfloat16_storage_bits(impl):
  # The kernel directly, pages as uint16 bits with kv_dtype=bfloat16: the bitcast happens on
  # what is gathered. A head dim of 256 and 8 query heads per KV head.
  case = mixed_case(23, dtype=jnp.bfloat16, group=8, head_dim=256)
  variants = dict(sliding_window=7, soft_cap=3.0, sinks=cases.make_sinks(2, case.num_q_heads))
  case = cases.poison_before_window(case, 7)
  out = KERNELS[impl](*case.jax_args(storage=True), sm_scale=256 ** -0.5,
                      kv_dtype=case.kv_dtype, **variants)
  assert out.dtype == jnp.bfloat16
  check(case, out, jnp.bfloat16, sm_scale=256 ** -0.5, **variants)


def test_checked_paged_attention_takes_the_variants():
  variants = DEFAULT_VARIANTS[0][1]
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = _CASE.jax_args()
  out = checked_paged_attention(q, KVCache(k_pages=k_pages, v_pages=v_pages), layer, kv_lens,
                                tables, cu, num_seqs, impl="reference", **variants)
  check(_CASE, out, jnp.float32, **variants)


# --- hand-computed ---------------------------------------------------------------------------


def _one_sequence(keys, values, q_vec, *, block_size=2):
  """One sequence holding ``keys``/``values`` ([J, D] each, K = H = 1), one decode query
  (the last position) ``q_vec``, the pages shuffled, everything else NaN."""
  keys, values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
  num_keys, head_dim = keys.shape
  num_pages = -(-num_keys // block_size)
  num_blocks = num_pages + 2
  k_pages = np.full((1, 1, num_blocks, block_size, head_dim), np.nan, np.float32)
  v_pages = np.full_like(k_pages, np.nan)
  physical = np.arange(num_blocks)[::-1][:num_pages]  # logical 0 -> last block, ...
  for pos in range(num_keys):
    k_pages[0, 0, physical[pos // block_size], pos % block_size] = keys[pos]
    v_pages[0, 0, physical[pos // block_size], pos % block_size] = values[pos]
  cache = KVCache(k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))
  q = jnp.asarray(np.asarray(q_vec, np.float32).reshape(1, 1, head_dim))
  q = jnp.concatenate([q, jnp.ones_like(q)])  # row 1 is padding
  meta = (0, jnp.array([num_keys], jnp.int32), jnp.asarray(physical[None], jnp.int32),
          jnp.array([0, 1], jnp.int32), jnp.int32(1))
  return q, cache, meta


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_window_hides_exactly_one_key(impl):
  # Keys at positions 0, 1, 2 are 0, ln 2, ln 3 (D = 1), values 3, 6, 9; the query (1, at
  # position 2, sm_scale 1) scores them 0, ln 2, ln 3: weights 1 : 2 : 3.
  # No window: (3*1 + 6*2 + 9*3) / 6 = 42 / 6 = 7.
  # Window 2 sees positions 1 and 2 only (2 - 2 < k <= 2): (6*2 + 9*3) / 5 = 39 / 5 = 7.8.
  # (The no-window 7 is test_attention.py's hand-computed case; window >= 3 is the slow
  # grid's "window_eq" / "window_large".)
  q, cache, meta = _one_sequence([[0.0], [math.log(2)], [math.log(3)]], [[3.0], [6.0], [9.0]],
                                 [1.0])
  out = paged_attention(q, cache, *meta, sm_scale=1.0, sliding_window=2, impl=impl)
  np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [7.8, 0.0], rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_soft_cap_changes_the_argmax(impl):
  # D = 2, q = (1, 0), sm_scale 1. Key 0 = (4, 0) with value (1, 0); keys 1..3 = (1, 0) with
  # value (0, 1). Scores 4, 1, 1, 1.
  # No cap: weights e^3 : 1 : 1 : 1 = 20.0855 : 3 -> out = (20.0855, 3) / 23.0855
  #   = (0.8700, 0.1300): coordinate 0 wins.
  # Cap 2: scores 2 tanh(4/2) = 1.92806 and 2 tanh(1/2) = 0.92423 (x3); e^(1.92806 - 0.92423)
  #   = e^1.00383 = 2.72869 -> out = (2.72869, 3) / 5.72869 = (0.4763, 0.5237):
  #   coordinate 1 wins.
  # (A cap is monotone, so it reorders no scores; it flattens them until the three small
  # keys outweigh the large one.)
  keys = [[4.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
  values = [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
  q, cache, meta = _one_sequence(keys, values, [1.0, 0.0])
  for cap, expected in ((None, [0.87005, 0.12995]), (2.0, [0.47632, 0.52368])):
    out = np.asarray(paged_attention(q, cache, *meta, sm_scale=1.0, soft_cap=cap, impl=impl))
    np.testing.assert_allclose(out[0, 0], expected, rtol=2e-5)
    np.testing.assert_array_equal(out[1], 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_sink_takes_half_the_mass(impl):
  # The keys of the window case, all visible: sum_k e^(s_k) = 1 + 2 + 3 = 6. A sink logit of
  # ln 6 adds e^(ln 6) = 6 to the denominator: half the mass goes to the sink, which has no
  # value, so the output halves: (3*1 + 6*2 + 9*3) / (6 + 6) = 42 / 12 = 3.5.
  q, cache, meta = _one_sequence([[0.0], [math.log(2)], [math.log(3)]], [[3.0], [6.0], [9.0]],
                                 [1.0])
  sinks = jnp.array([math.log(6)], jnp.float32)
  out = paged_attention(q, cache, *meta, sm_scale=1.0, sinks=sinks, impl=impl)
  np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [3.5, 0.0], rtol=1e-6)


# --- cost follows the window -----------------------------------------------------------------


_plan = jax.jit(plan_work, static_argnames=("num_tokens", "block_size", "blocks_per_seq",
                                            "tiling", "sliding_window"))


def _plan_pages(q_lens, kv_lens, *, window, tiling, block_size=16, blocks_per_seq=512):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  return _plan(jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(len(q_lens)),
               num_tokens=sum(q_lens), block_size=block_size, blocks_per_seq=blocks_per_seq,
               tiling=tiling, sliding_window=window)


def test_xla_plan_reads_no_page_before_the_window():
  # Decode at 8k context with window 256, block size 16: the query at 8191 sees 7936..8191,
  # pages 496..511: 16 pages, and exactly the pages without a window would be 512.
  tiling = XlaTiling(q_tile=1, pages_per_chunk=4)
  for context in (512, 2048, 8192):
    plan = _plan_pages([1], [context], window=256, tiling=tiling)
    assert int(plan.first_page_W[0]) == (context - 256) // 16
    assert int(plan.pages_W[0]) == 16 and int(plan.num_units) == 4
    assert int(_plan_pages([1], [context], window=None, tiling=tiling).pages_W[0]) == context // 16
  # Prefill tiles of 64 rows at 4k: a tile whose first row sits at p reads from the page of
  # p - 255 up to its last row: (64 + 255) / 16 -> at most 21 pages, never a page ending at
  # or before p - 256.
  plan = _plan_pages([256], [4096], window=256, tiling=XlaTiling(q_tile=64, pages_per_chunk=4))
  first_pos = np.asarray(plan.qpos_WQ)[:4, 0]
  first_page = np.asarray(plan.first_page_W)[:4]
  assert np.all((first_page + 1) * 16 > first_pos - 256 + 1)  # the first page is seen
  assert np.all(first_page * 16 <= first_pos - 256 + 1)
  assert np.all(np.asarray(plan.pages_W)[:4] <= 21)


# --- validation --------------------------------------------------------------------------------


def test_paged_attention_takes_sinks_of_any_floating_dtype_as_float32():
  # bfloat16 sinks beside a bfloat16 model, a NumPy float64 array, a list of floats: all
  # were refused ("sinks.dtype=bfloat16 must be float32"); they are the same logits.
  want = np.asarray(run(_CASE, "xla", sinks=_SINKS))
  for sinks in (np.asarray(_SINKS, np.float64), np.asarray(_SINKS).tolist()):
    np.testing.assert_array_equal(np.asarray(run(_CASE, "xla", sinks=sinks)), want)
  rounded = jnp.asarray(_SINKS, jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(run(_CASE, "xla", sinks=rounded)),
      np.asarray(run(_CASE, "xla", sinks=rounded.astype(jnp.float32))))


def test_variants_given_as_concrete_jax_scalars_are_their_values():
  # A config's window and cap as jnp.int32(2) / jnp.float32(5.0) were refused
  # ("sliding_window=Array(2, dtype=int32) must be an int >= 1") where NumPy scalars
  # passed; traced ones stay refused (they are static).
  want = np.asarray(run(_CASE, "xla", sliding_window=2, soft_cap=5.0))
  got = run(_CASE, "xla", sliding_window=jnp.int32(2), soft_cap=jnp.float32(5.0))
  np.testing.assert_array_equal(np.asarray(got), want)
  with pytest.raises(ValueError, match=r"sliding_window=.*Tracer.* must be an int >= 1"):
    jax.jit(lambda w: run(_CASE, "xla", sliding_window=w))(jnp.int32(2))


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=0), r"sliding_window=0 must be an int >= 1"),
    (dict(sliding_window=-3), r"sliding_window=-3 must be an int >= 1"),
    (dict(sliding_window=2.0), r"sliding_window=2\.0 must be an int >= 1"),
    (dict(sliding_window=True), r"sliding_window=True must be an int >= 1"),
    (dict(soft_cap=0.0), r"soft_cap=0\.0 must be a finite float > 0"),
    (dict(soft_cap=-1.0), r"soft_cap=-1\.0 must be a finite float > 0"),
    (dict(soft_cap=float("inf")), r"soft_cap=inf must be a finite float > 0"),
    (dict(soft_cap=float("nan")), r"soft_cap=nan must be a finite float > 0"),
    (dict(soft_cap="30"), r"soft_cap='30' must be a finite float > 0"),
    # Past 1e30 the kernels' s / c left float32's normal range: 0.42 off, NaN past 3.4e38.
    (dict(soft_cap=1e31), r"soft_cap=1e\+31 must be a finite float > 0 and <= 1e\+30"),
    (dict(sinks=jnp.zeros((4,), jnp.float32)), r"sinks\.shape=\(4,\) must be \[H\]=\[8\]"),
    (dict(sinks=jnp.zeros((8, 1), jnp.float32)), r"sinks\.shape=\(8, 1\) must be \[H\]"),
    (dict(sinks=jnp.zeros((8,), jnp.int32)), r"sinks\.dtype=int32 must be float32"),
    (dict(sinks=[0] * 8),  # a kernel takes no list; paged_attention takes it as an array
     r"sinks=list must be a float32 array of shape \[H\]=\[8\]|sinks\.dtype=int64 must be"),
])
@pytest.mark.parametrize("entry", ["paged_attention", "reference", "xla"])
def test_bad_variant_raises_value_error(entry, kwargs, match):
  case = _CASE  # H = 8
  with pytest.raises(ValueError, match=match):
    if entry == "paged_attention":
      run(case, "xla", **kwargs)
    else:
      KERNELS[entry](*case.jax_args(), sm_scale=0.125, **kwargs)


def test_bad_kv_dtype_raises_value_error():
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = _CASE.jax_args()
  bits = (q, k_pages.view(jnp.uint32), v_pages.view(jnp.uint32), layer, kv_lens, tables, cu,
          num_seqs)
  with pytest.raises(ValueError, match=r"k_pages\.dtype=uint32 must be uint16, the storage "
                                       r"dtype of kv_dtype=bfloat16"):
    validation.static_validate_inputs(*bits, kv_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"kv_dtype=int32 must be a floating dtype"):
    validation.static_validate_inputs(*bits, kv_dtype=jnp.int32)
  with pytest.raises(ValueError, match=r"k_pages\.dtype=uint32 must be a floating dtype"):
    validation.static_validate_inputs(*bits)
  validation.static_validate_inputs(q, k_pages.astype(jnp.bfloat16).view(jnp.uint16),
                                    v_pages.astype(jnp.bfloat16).view(jnp.uint16), layer,
                                    kv_lens, tables, cu, num_seqs, kv_dtype=jnp.bfloat16)


# --- the product grid (slow) -----------------------------------------------------------------


GRID = list(itertools.product(IMPLS, [jnp.float32, jnp.bfloat16],
                              [(1, 64, 8), (4, 128, 16), (8, 256, 8)]))


@pytest.mark.slow
@pytest.mark.parametrize("impl,dtype,shape", GRID)
def test_variant_grid_against_oracle(impl, dtype, shape):
  group, head_dim, block_size = shape
  seed = zlib.crc32(f"variants-{impl}-{jnp.dtype(dtype)}-{shape}".encode())
  case = mixed_case(seed, dtype=dtype, group=group, head_dim=head_dim, block_size=block_size)
  context = int(max(case.kv_lens_S[: case.num_seqs]))
  scale = head_dim ** -0.5
  for name, variants in cases.variant_grid(context, case.num_q_heads, seed):
    poisoned = case
    if variants.get("sliding_window"):
      poisoned = cases.poison_before_window(case, variants["sliding_window"])
    # The 16-bit cases hand the kernel storage bits; float32 ones go through paged_attention.
    if jnp.dtype(dtype).itemsize < 4:
      out = KERNELS[impl](*poisoned.jax_args(storage=True), sm_scale=scale,
                          kv_dtype=poisoned.kv_dtype, **variants)
    else:
      out = run(poisoned, impl, **variants)
    try:
      check(poisoned, out, dtype, **variants)
    except AssertionError as e:
      raise AssertionError(f"variant {name}: {e}") from None


@pytest.mark.slow
@pytest.mark.parametrize("q_tile,pages_per_chunk", [(1, 1), (2, 3), (8, 2), (64, 8)])
def test_xla_tilings_with_variants(q_tile, pages_per_chunk):
  case = mixed_case(29, group=2)
  variants = dict(sliding_window=6, soft_cap=2.5, sinks=cases.make_sinks(3, case.num_q_heads))
  case = cases.poison_before_window(case, 6)
  out = xla_attention(*case.jax_args(), sm_scale=64 ** -0.5,
                      tiling=XlaTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk),
                      **variants)
  check(case, out, jnp.float32, sm_scale=64 ** -0.5, **variants)


@pytest.mark.slow
def test_window_benchmark_quick_mode(capsys):
  from benchmarks import window
  rows = window.main(["--quick"])
  assert rows and all(np.isfinite(r["window_ms"]) for r in rows)
  # The window's pages per tile do not grow with the context; the plain ones do.
  decode = [r for r in rows if r["workload"].startswith("decode")]
  assert len({r["window_pages_max"] for r in decode}) == 1
  assert decode[-1]["full_pages_max"] > decode[0]["full_pages_max"]


@pytest.mark.parametrize("impl", ("reference", "xla", "pallas_tpu", "pallas_gpu",
                                  "pallas_mosaic_gpu"))
def test_a_window_one_short_of_a_full_table_hides_the_first_key(impl):
  # Two sequences of 16 tokens fill their tables exactly (Z = 8, P = 2: no spare entry,
  # which every other case keeps). A window of P * Z - 1 = 15 hides key 0 from the query
  # at position 15 (p - W < k: k > 0) and from no other. A kernel that took a window of
  # P * Z - 1 or more as "wider than any sequence" dropped it: off by 8e-2 here, where the
  # grids (always a spare page) passed.
  case = cases.make_case(5, q_lens=[1, 3], kv_lens=[16, 16], num_kv_heads=1, group=2,
                         head_dim=64, block_size=8, spare_pages=0)
  assert case.jax_args()[5].shape[1] * 8 == 16
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  cache = KVCache(k_pages=k_pages, v_pages=v_pages)
  out = paged_attention(q, cache, layer, kv_lens, tables, cu, num_seqs, sliding_window=15,
                        impl=impl, interpret=impl.startswith("pallas"))
  check(case, out, jnp.float32, sliding_window=15)
  unwindowed = cases.oracle(case)
  assert np.abs(np.asarray(out)[0] - unwindowed[0]).max() > 1e-3  # key 0 was hidden
