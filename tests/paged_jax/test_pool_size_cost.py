"""A call costs the tokens it touches, never the pool it sits in (issue 17).

XLA on CPU has no native 16-bit float scatter: a bfloat16 pool updated in place was first
converted whole to float32 and back (a write of 8 tokens into a 32k-block pool took 0.8 s).
The pools now hold integer bits (``layout.storage_dtype``). These tests compile each call at
two pool sizes and check that the temporary buffers XLA allocates do not grow with the pool:
a whole-pool conversion or copy would add pool-sized temporaries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from paged_jax import KVCache, KVCacheSpec, paged_attention

SMALL, LARGE = 64, 1024  # blocks; LARGE's pool is 16x SMALL's


def _cache(num_blocks, dtype):
  return KVCache.create(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8,
                                    num_blocks=num_blocks, dtype=dtype))


def _temp_bytes(fn, *args, donate=()):
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _pool_bytes(num_blocks, dtype):
  return _cache(num_blocks, dtype).nbytes()


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _assert_flat(small, large, dtype):
  # Anything pool-sized at LARGE would be >= the pool of SMALL times 16 / 2 (K or V alone).
  assert large - small < _pool_bytes(SMALL, dtype), (small, large)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_write_temporaries_do_not_grow_with_the_pool(dtype):
  k = jnp.ones((8, 2, 32), dtype)
  slots = jnp.arange(8, dtype=jnp.int32) * 5
  write = lambda c, k, s: c.write(1, k, k, s)
  small, large = (_temp_bytes(write, _cache(n, dtype), k, slots, donate=(0,))
                  for n in (SMALL, LARGE))
  _assert_flat(small, large, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_copy_blocks_temporaries_do_not_grow_with_the_pool(dtype):
  src, dst = jnp.arange(4, dtype=jnp.int32), jnp.arange(4, 8, dtype=jnp.int32)
  copy = lambda c, s, d: c.copy_blocks(s, d)
  small, large = (_temp_bytes(copy, _cache(n, dtype), src, dst, donate=(0,))
                  for n in (SMALL, LARGE))
  _assert_flat(small, large, dtype)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_attention_temporaries_do_not_grow_with_the_pool(impl, dtype):
  q = jnp.ones((4, 4, 32), dtype)
  tables = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
  kv_lens = jnp.array([20, 9, 1, 17], jnp.int32)
  cu = jnp.arange(5, dtype=jnp.int32)
  attend = functools.partial(lambda c, q, t: paged_attention(
      q, c, 0, kv_lens, t, cu, jnp.int32(4), impl=impl))
  small, large = (_temp_bytes(attend, _cache(n, dtype), q, tables) for n in (SMALL, LARGE))
  _assert_flat(small, large, dtype)


def test_the_check_catches_a_whole_pool_conversion():
  """Negative control: a bfloat16 scatter straight into a bfloat16 pool does grow."""
  def write_bf16(pages, k, slots):
    return pages.at[0, :, slots // 8, slots % 8].set(k, mode="drop")
  k = jnp.ones((8, 2, 32), jnp.bfloat16)
  slots = jnp.arange(8, dtype=jnp.int32)
  small, large = (_temp_bytes(write_bf16, jnp.zeros((2, 2, n, 8, 32), jnp.bfloat16), k, slots,
                              donate=(0,)) for n in (SMALL, LARGE))
  with pytest.raises(AssertionError):
    _assert_flat(small, large, jnp.bfloat16)


def test_append_reads_each_taken_block_with_one_gather_at_any_pool_size():
  # append ranks a block for every table entry ([g, S, P]: 65k at S = 32 and a 32k
  # context); _take found each rank by a binary search over the pool, log2(N) + 1 gathers
  # per entry (a long-context decode step was mostly that). One scatter by rank, then one
  # gather per entry: the gathers of append's program no longer grow with the pool. (A pool
  # of more than _SELECT_MAX blocks adds the whole-pool sort's branch, hence two sizes each
  # side of it.)
  import re
  from paged_jax import allocator

  def gathers(num_blocks):
    state = allocator.init(num_blocks, 4, 8, 64)
    text = jax.jit(allocator.append).lower(state, jnp.ones(8, jnp.int32)).as_text()
    return len(re.findall(r"stablehlo\.\w*gather", text))

  assert gathers(SMALL) == gathers(allocator._SELECT_MAX) <= 10
  assert gathers(2 * allocator._SELECT_MAX) == gathers(64 * allocator._SELECT_MAX) <= 12
