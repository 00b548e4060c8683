"""KVCache: create, write (padding and out-of-range slots), copy_blocks, donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, KVCacheSpec, paged_attention

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=5,
                   dtype=jnp.float32)


def test_create_layout_and_bytes():
  cache = KVCache.create(SPEC)
  assert cache.k_pages.shape == (3, 2, 5, 4, 4)  # [L, K, N, Z, D]
  assert cache.v_pages.shape == (3, 2, 5, 4, 4)
  assert cache.spec == SPEC
  assert cache.nbytes() == SPEC.total_bytes
  assert not np.any(np.asarray(cache.k_pages))


def test_create_rejects_non_spec():
  with pytest.raises(ValueError, match="spec="):
    KVCache.create((3, 2, 4))


def test_write_places_tokens_at_their_slots():
  cache = KVCache.create(SPEC)
  rng = np.random.default_rng(0)
  k = rng.normal(size=(3, 2, 4)).astype(np.float32)
  v = rng.normal(size=(3, 2, 4)).astype(np.float32)
  # slot = block * Z + offset: 9 -> block 2 offset 1; 0 -> block 0 offset 0; 19 -> block 4
  # offset 3 (the very last slot).
  cache = cache.write(1, jnp.asarray(k), jnp.asarray(v), jnp.array([9, 0, 19], jnp.int32))
  kp, vp = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
  for t, (block, offset) in enumerate([(2, 1), (0, 0), (4, 3)]):
    np.testing.assert_array_equal(kp[1, :, block, offset], k[t])
    np.testing.assert_array_equal(vp[1, :, block, offset], v[t])
  assert np.count_nonzero(kp) == k.size and np.count_nonzero(kp[[0, 2]]) == 0


@pytest.mark.parametrize("bad_slot", [-1, -7, -20, 20, 21, 2**31 - 1])
def test_padding_and_out_of_range_slots_write_nothing(bad_slot):
  # jnp would wrap -1 to the last slot, and a clamping scatter would put 20 into slot 19:
  # both must leave the pool untouched.
  cache = KVCache.create(SPEC)
  ones = jnp.ones((2, 2, 4), jnp.float32)
  out = cache.write(0, ones, 2 * ones, jnp.array([bad_slot, 5], jnp.int32))
  kp = np.asarray(out.k_pages)
  assert np.count_nonzero(kp) == 2 * 4  # only slot 5 (block 1, offset 1) was written
  np.testing.assert_array_equal(kp[0, :, 1, 1], 1.0)
  np.testing.assert_array_equal(np.asarray(out.v_pages)[0, :, 1, 1], 2.0)


def test_write_casts_to_cache_dtype_and_accepts_traced_layer():
  spec = KVCacheSpec(2, 1, 2, 2, 2, jnp.bfloat16)
  cache = KVCache.create(spec)
  write = jax.jit(lambda c, layer, k, s: c.write(layer, k, k, s))
  out = write(cache, jnp.int32(1), jnp.full((1, 1, 2), 1.5, jnp.float32),
              jnp.array([3], jnp.int32))
  assert out.k_pages.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out.k_pages[1, 0, 1, 1], np.float32), 1.5)


def test_a_float16_pool_saturates_instead_of_storing_inf():
  # A bf16 / float32 model's K of 7e4 was stored as inf in a float16 pool and attention
  # returned NaN; the cast now saturates at float16's largest (NaN stays NaN).
  cache = KVCache.create(KVCacheSpec(1, 1, 4, 2, 2, jnp.float16))
  k = jnp.asarray([[[7e4, -1e6, 3.0, 0.5]], [[1.0, 2.0, -3.0, jnp.nan]]], jnp.bfloat16)
  out = cache.write(0, k, k.astype(jnp.float32), jnp.array([0, 2], jnp.int32))
  for pages in (out.k_pages, out.v_pages):
    np.testing.assert_array_equal(np.asarray(pages[0, 0, :, 0], np.float32),
                                  [[65504, -65504, 3, 0.5], [1, 2, -3, np.nan]])
  q = jnp.full((1, 1, 4), 1e-3, jnp.float16)
  got = paged_attention(q, out, 0, jnp.array([1], jnp.int32), jnp.array([[0]], jnp.int32),
                        jnp.array([0, 1], jnp.int32), 1, impl="reference")
  np.testing.assert_array_equal(np.asarray(got[0, 0], np.float32), [65504, -65504, 3, 0.5])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_a_traced_layer_out_of_range_writes_and_reads_nothing(dtype):
  # A Python int outside [0, L) is refused; a traced one cannot be, and -1 used to wrap:
  # write stored into layer L - 1 and the reference read it back (the XLA path read
  # zeros). Now no impl writes or reads a wrapped layer.
  cache = KVCache.create(KVCacheSpec(2, 1, 8, 4, 2, dtype))
  ones = jnp.ones((1, 1, 8), jnp.float32)
  slots = jnp.array([0], jnp.int32)
  for layer in (-1, -2, 2, 7):
    written = jax.jit(lambda c, l: c.write(l, ones, ones, slots))(cache, jnp.int32(layer))
    for got, fresh in zip(jax.tree_util.tree_leaves(written), jax.tree_util.tree_leaves(cache)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(fresh))
  full = cache.write(1, ones, ones, slots)  # layer 1 (= L - 1) holds a token
  for impl in ("reference", "xla"):
    attend = jax.jit(lambda c, l: paged_attention(
        ones, c, l, jnp.array([1], jnp.int32), jnp.array([[0]], jnp.int32),
        jnp.array([0, 1], jnp.int32), jnp.int32(1), impl=impl))
    np.testing.assert_allclose(np.asarray(attend(full, jnp.int32(1))), 1.0, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(attend(full, jnp.int32(-1))), 0.0)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu"])
def test_a_traced_layer_out_of_range_reads_nothing_in_the_kernels(impl):
  # Before, -1 read layer L - 1 (wrapped) and L read past the pool (the interpreters'
  # out-of-bounds error; on a device, whatever lies there). Now every row is padding: 0.
  cache = KVCache.create(KVCacheSpec(2, 1, 64, 8, 2, jnp.float32))
  ones = jnp.ones((1, 1, 64), jnp.float32)
  cache = cache.write(1, ones, ones, jnp.array([0], jnp.int32))
  attend = jax.jit(lambda c, l: paged_attention(
      jnp.ones((8, 1, 64)), c, l, jnp.array([1], jnp.int32), jnp.array([[0]], jnp.int32),
      jnp.array([0, 1], jnp.int32), jnp.int32(1), impl=impl, interpret=True))
  np.testing.assert_allclose(np.asarray(attend(cache, jnp.int32(1))[0]), 1.0, rtol=1e-6)
  for layer in (-1, 2):
    np.testing.assert_array_equal(np.asarray(attend(cache, jnp.int32(layer))), 0.0)


@pytest.mark.parametrize("kwargs,match", [
    # Named with what sets the cache's shape in an engine (a config's wrong head_dim).
    (dict(k=jnp.ones((2, 3, 4)), v=jnp.ones((2, 3, 4))),
     r"k\.shape=\(2, 3, 4\) must be \[T, K, D\]=\[T, 2, 4\]: the cache's KV heads and "
     r"head dim \(an engine shapes its cache from config\.num_kv_heads and config\.head_dim"),
    (dict(k=jnp.ones((2, 2, 4)), v=jnp.ones((1, 2, 4))), r"v\.shape"),
    (dict(k=jnp.ones((2, 2, 4), jnp.int32)), r"k\.dtype=int32 must be a floating"),
    (dict(v=jnp.ones((2, 2, 4), jnp.int8)), r"v\.dtype=int8 must be a floating"),
    (dict(v=jnp.ones((2, 2, 4), jnp.bool_)), r"v\.dtype=bool must be a floating"),
    (dict(slots=jnp.array([0, 1], jnp.float32)), r"slots\.dtype"),
    (dict(slots=jnp.array([0], jnp.int32)), r"slots\.shape"),
    (dict(layer=3), r"layer=3"),
    (dict(layer=jnp.float32(0)), r"layer\.dtype"),
    (dict(layer=1.5), r"layer=1\.5 must be an int"),
])
def test_write_bad_input(kwargs, match):
  args = dict(layer=0, k=jnp.ones((2, 2, 4)), v=jnp.ones((2, 2, 4)),
              slots=jnp.array([0, 1], jnp.int32))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    KVCache.create(SPEC).write(**args)


def test_copy_blocks_copies_every_layer_and_ignores_no_block():
  rng = np.random.default_rng(1)
  k = rng.normal(size=(3, 2, 5, 4, 4)).astype(np.float32)
  v = rng.normal(size=(3, 2, 5, 4, 4)).astype(np.float32)
  cache = KVCache(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))
  # Pairs: 0 -> 3, then NO_BLOCK pairs, an out-of-range destination, and 3 -> 1 which must
  # read block 3 as it was BEFORE this call (reads happen before writes).
  src = jnp.array([0, -1, 2, 3, 4], jnp.int32)
  dst = jnp.array([3, 2, -1, 1, 5], jnp.int32)
  out = cache.copy_blocks(src, dst)
  expected_k, expected_v = k.copy(), v.copy()
  expected_k[:, :, 3], expected_v[:, :, 3] = k[:, :, 0], v[:, :, 0]
  expected_k[:, :, 1], expected_v[:, :, 1] = k[:, :, 3], v[:, :, 3]
  np.testing.assert_array_equal(np.asarray(out.k_pages), expected_k)
  np.testing.assert_array_equal(np.asarray(out.v_pages), expected_v)


def test_the_constructor_refuses_what_a_spec_refuses():
  # An int32 pool was taken and write truncated every value (2.7 stored as 2); pages of
  # different shapes, or of another rank, failed only inside paged_attention.
  pages = jnp.zeros((1, 1, 2, 4, 8), jnp.float32)
  for kwargs, match in ((dict(k_pages=pages.astype(jnp.int32), v_pages=pages.astype(jnp.int32)),
                         r"k_pages\.dtype=int32 must be a floating dtype"),
                        (dict(k_pages=pages, v_pages=pages[:, :, :1]),
                         r"v_pages\.shape=\(1, 1, 1, 4, 8\) must equal k_pages\.shape"),
                        # V was cast to K's dtype in silence (or failed in paged_attention)
                        (dict(k_pages=pages.astype(jnp.float16), v_pages=pages),
                         r"v_pages\.dtype=float32 must equal k_pages\.dtype=float16"),
                        (dict(k_pages=pages, v_pages=pages.astype(jnp.bfloat16)),
                         r"v_pages\.dtype=bfloat16 must equal k_pages\.dtype=float32"),
                        (dict(k_pages=pages[0], v_pages=pages[0]),
                         r"k_pages\.shape=\(1, 2, 4, 8\) must be \[L, K, N, Z, D\]"),
                        (dict(k_pages=pages, v_pages=pages, dtype=jnp.float8_e4m3fnuz),
                         r"dtype=float8_e4m3fnuz must be a floating dtype")):
    with pytest.raises(ValueError, match=match):
      KVCache(**kwargs)
  # A list of K/V values: AttributeError 'list' object has no attribute 'ndim' before.
  cache = KVCache.create(SPEC)
  with pytest.raises(ValueError, match="k is a list; must be an array"):
    cache.write(0, [[[1.0] * 4] * 2], jnp.ones((1, 2, 4)), jnp.zeros(1, jnp.int32))
  with pytest.raises(ValueError, match=r"src\.dtype=float64 must be int32"):
    cache.copy_blocks([0.5], jnp.zeros(1, jnp.int32))


def test_host_slots_and_block_ids_of_any_integer_type():
  # np.array([...]) is int64, and was refused ("slots.dtype=int64 must be int32"), as were
  # lists. Host arrays and lists of ints whose values fit int32 are taken; a value past
  # int32 is refused naming the argument (as int32 it would wrap onto a real slot).
  rng = np.random.default_rng(2)
  k = jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)
  cache = KVCache.create(SPEC)
  want = cache.write(2, k, -k, jnp.array([7, -1, 12], jnp.int32))
  for slots in (np.array([7, -1, 12]), [7, -1, 12], np.array([7, -1, 12], np.int16)):
    got = cache.write(2, k, -k, slots)
    np.testing.assert_array_equal(np.asarray(got.k_pages), np.asarray(want.k_pages))
    np.testing.assert_array_equal(np.asarray(got.v_pages), np.asarray(want.v_pages))
  with pytest.raises(ValueError, match=r"slots holds 4294967303, which does not fit int32"):
    cache.write(2, k, -k, np.array([7 + 2**32, -1, 12]))
  copied = want.copy_blocks(jnp.array([1, 3], jnp.int32), jnp.array([0, 2], jnp.int32))
  np.testing.assert_array_equal(np.asarray(want.copy_blocks([1, 3], np.array([0, 2])).k_pages),
                                np.asarray(copied.k_pages))
  with pytest.raises(ValueError, match=r"dst holds -4294967296, which does not fit int32"):
    want.copy_blocks([1], np.array([-2**32]))


def test_copy_blocks_bad_input():
  cache = KVCache.create(SPEC)
  with pytest.raises(ValueError, match=r"dst\.shape"):
    cache.copy_blocks(jnp.array([0, 1], jnp.int32), jnp.array([2], jnp.int32))
  with pytest.raises(ValueError, match=r"src\.dtype"):
    cache.copy_blocks(jnp.array([0.0]), jnp.array([2], jnp.int32))


def test_donated_write_updates_the_pool_in_place():
  spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, num_blocks=256,
                     dtype=jnp.float32)
  write = jax.jit(lambda c, k, s: c.write(1, k, k, s), donate_argnums=0)
  cache = KVCache.create(spec)
  k = jnp.ones((4, 2, 16), jnp.float32)
  slots = jnp.array([0, 9, 100, -1], jnp.int32)
  out = write(cache, k, slots)  # compile (the first call may allocate)
  pointer = out.k_pages.unsafe_buffer_pointer()
  out2 = write(out, k, slots + 1)
  assert out.k_pages.is_deleted() and out.v_pages.is_deleted()  # the input was donated
  assert out2.k_pages.unsafe_buffer_pointer() == pointer  # ... and reused, not copied
  lowered = write.lower(out2, k, slots)
  temp_bytes = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temp_bytes < spec.total_bytes // 4, temp_bytes  # no pool-sized temporary


def test_cache_is_a_pytree():
  cache = KVCache.create(SPEC)
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  assert len(leaves) == 2
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(rebuilt, KVCache) and rebuilt.spec == SPEC


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_cache_copies_pickles_and_sizes_abstractly(dtype):
  # copy.copy, copy.deepcopy and pickle of a host copy raised FrozenInstanceError (their
  # default path sets attributes); nbytes() of jax.eval_shape's cache an AttributeError.
  import copy
  import functools
  import pickle
  spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=5,
                     dtype=dtype)
  cache = KVCache.create(spec)
  cache = cache.write(1, jnp.full((2, 2, 4), 0.5), jnp.full((2, 2, 4), -0.25),
                      jnp.asarray([3, 17], jnp.int32))
  host = jax.device_get(cache)
  for twin in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(host))):
    assert isinstance(twin, KVCache) and twin.spec == spec and twin.dtype == cache.dtype
    for a, b in zip(jax.tree.leaves(twin), jax.tree.leaves(cache)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  abstract = jax.eval_shape(functools.partial(KVCache.create, spec))
  assert abstract.nbytes() == cache.nbytes() == spec.total_bytes
  with pytest.raises(ValueError, match=r"passed as a static value: jax.eval_shape\("
                     r"functools.partial\(KVCache.create, spec\)\)"):
    jax.eval_shape(KVCache.create, spec)  # the spec (it has a dtype) read as a scalar


def test_gradients_through_a_pool_of_bits_are_refused_not_zero():
  # jax.grad through K/V written into a bfloat16 pool was exactly 0 (the pool stores bits,
  # which carry no derivative); a float32 pool gives the true gradient.
  def loss_for(dtype):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4,
                       num_blocks=4, dtype=dtype)

    def loss(k_TKD):
      cache = KVCache.create(spec).write(0, k_TKD, k_TKD, jnp.arange(3, dtype=jnp.int32))
      out = paged_attention(jnp.ones((3, 1, 8)), cache, 0, jnp.asarray([3]),
                            jnp.asarray([[0, 1, 2, 3]]), jnp.asarray([0, 3]), 1,
                            impl="reference")
      return out.sum()
    return loss

  k_TKD = jnp.linspace(0.0, 1.0, 24).reshape(3, 1, 8)
  assert float(jnp.abs(jax.grad(loss_for(jnp.float32))(k_TKD)).max()) > 0.1
  for dtype in (jnp.bfloat16, jnp.float16):
    with pytest.raises(ValueError, match="differentiating through a KV pool of 8- or 16-bit "
                                         "floats: KVCache stores them as raw bits"):
      jax.grad(loss_for(dtype))(k_TKD)
    loss_for(dtype)(k_TKD)  # no derivative asked: written and read as before
