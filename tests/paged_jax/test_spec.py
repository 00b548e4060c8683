"""KVCacheSpec memory math and validation."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from paged_jax import KVCacheSpec


def test_opt_13b_figure_from_the_vllm_paper():
  # OPT-13B: L=40, K=40, D=128, fp16 (2 bytes). Per token: 2 (K and V) * 40 * 40 * 128 * 2
  # = 819,200 bytes = 800 KiB. A 16-token block: 16 * 800 KiB = 12,800 KiB = 12.5 MiB.
  spec = KVCacheSpec(num_layers=40, num_kv_heads=40, head_dim=128, block_size=16,
                     num_blocks=100, dtype=jnp.float16)
  assert spec.token_bytes == 819_200 == 800 * 1024
  assert spec.block_bytes == 13_107_200 == int(12.5 * 2**20)
  assert spec.total_bytes == 100 * spec.block_bytes
  assert spec.max_tokens == 1600


def test_block_bytes_formula_and_dtypes():
  # 2 * L * Z * K * D * b = 2 * 2 * 8 * 4 * 64 * 4 = 32768 for float32.
  spec = KVCacheSpec(2, 4, 64, 8, 10, jnp.float32)
  assert spec.block_bytes == 2 * 2 * 8 * 4 * 64 * 4 == 32768
  assert KVCacheSpec(2, 4, 64, 8, 10, jnp.bfloat16).block_bytes == 16384
  assert KVCacheSpec(2, 4, 64, 8, 10, "float16").dtype == jnp.float16


def test_blocks_for_rounds_up():
  spec = KVCacheSpec(1, 1, 8, 16, 4, jnp.float32)
  assert [spec.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_from_budget_takes_whole_blocks():
  # Llama-3-8B shape in bf16: 2 * 32 * 8 * 128 * 2 = 131072 bytes per token, 2 MiB per
  # 16-token block; a 1 GiB + 1 byte budget holds exactly 512 blocks = 8192 tokens.
  spec = KVCacheSpec.from_budget(2**30 + 1, num_layers=32, num_kv_heads=8, head_dim=128,
                                 block_size=16, dtype=jnp.bfloat16)
  assert spec.block_bytes == 2 * 2**20
  assert spec.num_blocks == 512 and spec.max_tokens == 8192
  assert spec.total_bytes <= 2**30 + 1


def test_from_budget_too_small_names_the_budget():
  with pytest.raises(ValueError, match="budget_bytes=100"):
    KVCacheSpec.from_budget(100, 32, 8, 128, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="budget_bytes"):
    KVCacheSpec.from_budget(1.5e9, 32, 8, 128, 16, jnp.bfloat16)


def test_a_pool_past_int32_slot_ids_is_refused():
  # Slot ids (block * Z + offset) are int32: 2**31 slots were accepted here and refused
  # only later, by the allocator or the engine.
  assert KVCacheSpec(1, 1, 8, 4, (2**31 - 1) // 4).max_tokens == 2**31 - 4
  with pytest.raises(ValueError, match=r"num_blocks=536870912 x block_size=4 = 2147483648 "
                                       r"slots must be at most 2\*\*31 - 1"):
    KVCacheSpec(1, 1, 8, 4, 2**29)
  with pytest.raises(ValueError, match=r"budget_bytes=1099511627776 holds 4294967296 blocks "
                                       "of 4 tokens, more than int32 slot ids address"):
    KVCacheSpec.from_budget(2**40, 1, 1, 8, 4, jnp.float32)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size",
                                   "num_blocks"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True, "8"])
def test_every_field_is_validated(field, value):
  kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=8)
  kwargs[field] = value
  with pytest.raises(ValueError, match=field):
    KVCacheSpec(**kwargs)


# Float formats a pool cannot hold K/V in unscaled: float8_e4m3fnuz read 500.0 back as NaN,
# float8_e8m0fnu every sign and zero, float4_e2m1fn failed inside write's bitcast.
@pytest.mark.parametrize("dtype", [jnp.int32, "not_a_dtype", bool, jnp.float8_e4m3fnuz,
                                   jnp.float8_e8m0fnu, jnp.float4_e2m1fn, jnp.float8_e5m2fnuz])
def test_dtype_is_validated(dtype):
  with pytest.raises(ValueError, match="dtype"):
    KVCacheSpec(2, 2, 64, 16, 8, dtype)


def test_spec_is_frozen_and_hashable():
  spec = KVCacheSpec(2, 2, 64, 16, 8)
  with pytest.raises(AttributeError):
    spec.num_blocks = 3  # type: ignore[misc]
  assert hash(spec) == hash(KVCacheSpec(2, 2, 64, 16, 8))
