"""Quantised pools (int8, float8_e4m3fn): memory math with scales, write quantises per token
and KV head, copy_blocks moves scales with their blocks, padding writes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, KVCacheSpec, paged_attention
from paged_jax.pallas_kernels import layout

QUANTIZED = [jnp.int8, jnp.float8_e4m3fn]
ids = lambda d: jnp.dtype(d).name


def test_block_bytes_count_the_scales_by_hand():
  # L=2, Z=16, K=4, D=128: int8 stores 128 bytes + a 4-byte scale per token, head, K or V:
  # 2 * 2 * 16 * 4 * (128 + 4) = 33,792 bytes; bfloat16: 2 * 2 * 16 * 4 * 256 = 65,536.
  int8 = KVCacheSpec(2, 4, 128, 16, 10, jnp.int8)
  bf16 = KVCacheSpec(2, 4, 128, 16, 10, jnp.bfloat16)
  assert int8.block_bytes == 33_792 and bf16.block_bytes == 65_536
  assert int8.total_bytes == 337_920 and int8.quantized and not bf16.quantized
  # The same budget holds 65536 / 33792 = 1.94x the blocks.
  budget = 100 * bf16.block_bytes
  assert KVCacheSpec.from_budget(budget, 2, 4, 128, 16, jnp.int8).num_blocks == 193
  assert KVCache.create(int8).nbytes() == int8.total_bytes


def test_spec_refuses_other_integer_dtypes():
  with pytest.raises(ValueError, match="dtype=int16"):
    KVCacheSpec(1, 1, 8, 4, 4, jnp.int16)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=ids)
def test_write_quantises_per_token_and_head(dtype):
  spec = KVCacheSpec(2, 2, 64, 4, 6, dtype)
  rng = np.random.default_rng(0)
  # Heads 10x apart, one outlier token: per-token, per-head scales keep every row accurate.
  k = rng.normal(size=(5, 2, 64)) * np.array([1.0, 10.0])[None, :, None]
  k[2] *= 50.0
  v = rng.normal(size=(5, 2, 64))
  slots = jnp.array([0, 1, 9, 23, -1], jnp.int32)
  cache = jax.jit(lambda c, k, v: c.write(1, k, v, slots), donate_argnums=0)(
      KVCache.create(spec), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  k_pages, v_pages = cache.dequantized()
  bound = {jnp.dtype(jnp.int8): 0.5 / 127, jnp.dtype(jnp.float8_e4m3fn): 2.0 ** -4}[
      jnp.dtype(dtype)]
  for t, slot in enumerate([0, 1, 9, 23]):
    for x, pages in ((k, k_pages), (v, v_pages)):
      got = np.asarray(pages[1, :, slot // 4, slot % 4])
      # Each row's error is bounded by its own amax times the format's step.
      err = np.abs(got - x[t]).max(axis=-1) / np.abs(x[t]).max(axis=-1)
      assert (err <= bound * 1.01).all(), (t, err)
  # Layer 0 and the padding row wrote nothing: bits zero, scales one.
  assert not np.asarray(cache.k_bits[0]).any() and (np.asarray(cache.k_scales[0]) == 1).all()
  assert int(jnp.sum(cache.k_scales[1] != 1)) == 4 * 2


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=lambda d: jnp.dtype(d).name)
def test_a_token_below_the_smallest_scale_is_kept_not_made_nan(dtype):
  # amax = 1e-36: amax / 448 (float8_e4m3fn) is below float32's smallest normal, 1.18e-38,
  # and was flushed to a 0 scale, making every zero of the token 0 / 0 = NaN, and the
  # attention over it NaN. The scale is now at least that smallest normal.
  cache = KVCache.create(KVCacheSpec(1, 1, 8, 8, 2, dtype))
  for amax in (1e-36, 1e-37, 1e-30):
    token = np.zeros((1, 1, 8), np.float32)
    token[0, 0, 0] = amax
    written = cache.write(0, jnp.asarray(token), jnp.asarray(-token), jnp.array([0], jnp.int32))
    k_pages, v_pages = written.dequantized()
    for got, want in ((k_pages, token), (v_pages, -token)):
      np.testing.assert_allclose(np.asarray(got[0, 0, 0, 0]), want[0, 0], rtol=0.125, atol=0)
    q = jnp.ones((1, 1, 8), jnp.float32)
    out = paged_attention(q, written, 0, jnp.array([1], jnp.int32), jnp.array([[0]], jnp.int32),
                          jnp.array([0, 1], jnp.int32), jnp.int32(1), impl="xla")
    np.testing.assert_allclose(np.asarray(out[0, 0]), -token[0, 0], rtol=0.125, atol=0)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=ids)
def test_copy_blocks_moves_scales_with_their_blocks(dtype):
  spec = KVCacheSpec(2, 2, 8, 4, 5, dtype)
  rng = np.random.default_rng(1)
  pages = jnp.asarray(rng.normal(size=(2, 2, 5, 4, 8)) * rng.uniform(0.1, 10, (2, 2, 5, 4, 1)),
                      jnp.float32)
  cache = KVCache(pages, pages * 3, dtype=dtype)
  assert cache.k_scales.shape == layout.scales_shape(2, 2, 5, 4)
  copied = cache.copy_blocks(jnp.array([1, 4, -1], jnp.int32), jnp.array([3, 0, 2], jnp.int32))
  before_k, before_v = cache.dequantized()
  after_k, after_v = copied.dequantized()
  for src, dst in ((1, 3), (4, 0)):
    np.testing.assert_array_equal(after_k[:, :, dst], before_k[:, :, src])
    np.testing.assert_array_equal(after_v[:, :, dst], before_v[:, :, src])
  np.testing.assert_array_equal(after_k[:, :, 2], before_k[:, :, 2])  # NO_BLOCK pair: no copy


def test_cache_from_bits_needs_its_scales():
  bits = jnp.zeros((1, 1, 2, 4, 8), jnp.int8)
  with pytest.raises(ValueError, match="k_scales and v_scales are required"):
    KVCache(bits, bits, dtype=jnp.int8, k_scales=jnp.ones((1, 1, 2, 4)))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2], ids=ids)
def test_pages_of_the_pools_dtype_keep_the_scales_given(dtype):
  # Stored values from elsewhere (JAX's ragged paged attention keeps float8 pages and one
  # float k_scale / v_scale): fp8 pages with their scales were re-quantised as if they were
  # K/V, the scales dropped in silence (2 * 0.5 read as 2, not 1), and a Python float scale
  # failed inside paged_attention. The pages are now the pool's stored values, their scales
  # kept: a scalar for every token, or one per token and KV head; none: scales of 1.
  rng = np.random.default_rng(3)
  values = jnp.asarray(rng.integers(-6, 7, size=(1, 2, 3, 4, 8)), jnp.float32).astype(dtype)
  per_token = jnp.asarray(rng.uniform(0.1, 2.0, size=(1, 2, 3, 4)), jnp.float32)
  as_f32 = np.asarray(values, np.float32)
  for k_scales, v_scales, k_factor, v_factor in (
      (0.5, 0.25, 0.5, 0.25), (per_token, per_token * 2, np.asarray(per_token)[..., None],
                               2 * np.asarray(per_token)[..., None]),
      (None, None, 1.0, 1.0), (np.float32(3.0), jnp.float32(0.5), 3.0, 0.5)):
    cache = KVCache(values, values, dtype=dtype, k_scales=k_scales, v_scales=v_scales)
    k, v = cache.dequantized()
    np.testing.assert_array_equal(np.asarray(k), as_f32 * k_factor)
    np.testing.assert_array_equal(np.asarray(v), as_f32 * v_factor)
    assert cache.k_scales.dtype == jnp.float32 and cache.k_scales.shape == (1, 2, 3, 4)
  # Attention reads them so: one sequence of 12 tokens over blocks 2, 0, 1 (Z = 4).
  cache = KVCache(values, values, dtype=dtype, k_scales=0.5, v_scales=per_token)
  q = jnp.asarray(rng.normal(size=(1, 2, 8)), jnp.float32)
  args = (jnp.array([12], jnp.int32), jnp.array([[2, 0, 1]], jnp.int32),
          jnp.array([0, 1], jnp.int32), jnp.int32(1))
  want = paged_attention(q, KVCache(jnp.asarray(as_f32 * 0.5), jnp.asarray(
      as_f32 * np.asarray(per_token)[..., None])), 0, *args, impl="reference")
  for impl in ("reference", "xla"):
    out = paged_attention(q, cache, 0, *args, impl=impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_scales_given_where_they_cannot_be_kept_are_refused():
  pages = jnp.zeros((1, 1, 2, 4, 8), jnp.float32)
  values = pages.astype(jnp.float8_e4m3fn)
  for kwargs, match in (
      (dict(k_pages=pages, v_pages=pages, dtype=jnp.int8, k_scales=1.0, v_scales=1.0),
       r"k_scales / v_scales were given with k_pages.dtype=float32 for dtype=int8: float32 "
       r"pages are quantised here"),
      (dict(k_pages=pages, v_pages=pages, dtype=jnp.bfloat16, k_scales=1.0, v_scales=1.0),
       r"for dtype=bfloat16: a bfloat16 pool keeps no scales"),
      (dict(k_pages=values, v_pages=values, k_scales=jnp.ones((1, 1, 2)), v_scales=1.0),
       r"k_scales.shape=\(1, 1, 2\) must be \[L, K, N, Z\]=\[1, 1, 2, 4\]"),
      (dict(k_pages=values, v_pages=values, k_scales=1.0, v_scales=jnp.ones(8, jnp.int32)),
       r"v_scales.dtype=int32 must be a floating dtype"),
      (dict(k_pages=values, v_pages=values, k_scales=1.0, v_scales="1"),
       r"v_scales is a str; it must be an array"),
      (dict(k_pages=values, v_pages=values, k_scales=1.0),
       r"^v_scales must be given with float8_e4m3fn pages for dtype=float8_e4m3fn: k_scales "
       r"and v_scales are required together"),
      (dict(k_pages=values, v_pages=values, k_scales=-0.5, v_scales=1.0),
       r"k_scales=-0\.5 must be a finite number > 0"),
      (dict(k_pages=values, v_pages=values, k_scales=1.0, v_scales=float("nan")),
       r"v_scales=nan must be a finite number > 0"),
      (dict(k_pages=values.view(jnp.uint8), v_pages=values.view(jnp.uint8),
            dtype=jnp.float8_e4m3fn), r"k_scales and v_scales are required")):
    with pytest.raises(ValueError, match=match):
      KVCache(**kwargs)


@pytest.mark.parametrize("dtype, fmax", [(jnp.int8, 127.0), (jnp.float8_e4m3fn, 448.0),
                                         (jnp.float8_e5m2, 57344.0)], ids=["int8", "e4m3fn",
                                                                          "e5m2"])
def test_a_tokens_scale_is_its_largest_magnitude_over_the_formats_largest(dtype, fmax):
  # The documented rule, exactly: scale = amax / (the format's largest finite value), so
  # the largest element is stored as that value (a power-of-two amax keeps it exact).
  spec = KVCacheSpec(1, 1, 4, 2, 1, dtype)
  k_TKD = jnp.asarray([[[0.25, -fmax * 0.5, 1.0, 0.0]]], jnp.float32)
  cache = KVCache.create(spec).write(0, k_TKD, k_TKD * 4, jnp.array([1], jnp.int32))
  assert float(cache.k_scales[0, 0, 0, 1]) == 0.5 and float(cache.v_scales[0, 0, 0, 1]) == 2.0
  assert float(cache.k_pages[0, 0, 0, 1, 1]) == -fmax


def test_host_pages_of_the_pools_dtype_make_a_writable_cache():
  # NumPy int8 pages were kept as NumPy (int8 pages used to be re-quantised into a JAX
  # array): write and copy_blocks failed with "'numpy.ndarray' object has no attribute 'at'".
  pages = np.zeros((1, 1, 2, 4, 8), np.int8)
  for cache in (KVCache(pages, pages, dtype=jnp.int8),
                KVCache(pages.astype(np.float32), pages.astype(np.float32))):
    written = cache.write(0, jnp.ones((1, 1, 8)), jnp.ones((1, 1, 8)), jnp.array([5]))
    np.testing.assert_allclose(np.asarray(written.dequantized()[0])[0, 0, 1, 1], 1.0,
                               rtol=1e-2)
    assert isinstance(cache.copy_blocks(jnp.array([0]), jnp.array([1])).k_bits, jax.Array)
