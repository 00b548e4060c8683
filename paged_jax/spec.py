"""KV cache geometry and memory math.

One physical block holds ``block_size`` tokens of K and V for every layer and KV head:

    block_bytes = 2 * num_layers * block_size * num_kv_heads * (head_dim * itemsize + scale)

(the 2 is K and V; ``scale`` is 4 bytes for the per-token, per-KV-head float32 scale of a
quantised pool, int8 or float8, and 0 otherwise). Everything else the planner and the engine
say about memory derives from this one formula.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout


_POOL_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16,
                                             jnp.float64))


def _canonical_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
  try:
    canonical = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name}={dtype!r} is not a dtype; expected a floating dtype (jnp."
                     "float32, jnp.bfloat16, jnp.float16) or a quantised one (jnp.int8, "
                     "jnp.float8_e4m3fn, jnp.float8_e5m2)") from e
  # Other float8 / float4 formats (fnuz, e8m0, e2m1, ...) cannot hold K/V unscaled: a
  # value past their range, or a sign, reads back as NaN.
  if canonical not in _POOL_FLOATS and not layout.is_quantized(canonical):
    raise ValueError(f"{name}={canonical} must be a floating dtype (float32, bfloat16, "
                     "float16) or a quantised one (int8, float8_e4m3fn, float8_e5m2)")
  if canonical.itemsize > 4 and not jax.config.jax_enable_x64:
    # JAX would store float32 pages under a spec that counts 8 bytes per value.
    raise ValueError(f"{name}={canonical} needs jax_enable_x64 (without it JAX stores "
                     "float32); use float32, bfloat16 or float16")
  return canonical


def _positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name}={value!r} must be a positive Python int")
  if value <= 0:
    raise ValueError(f"{name}={value} must be > 0")
  return int(value)


MAX_SLOTS = 2**31 - 1
"""The most slots (``num_blocks * block_size``) a pool may have: slot ids are int32."""


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Shape of a paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens.

  Attributes:
    num_layers: L, decoder layers that each own a K and a V page pool.
    num_kv_heads: K, KV heads per layer.
    head_dim: D.
    block_size: Z, tokens per block.
    num_blocks: N, physical blocks in the pool (shared by all sequences).
    dtype: element type of the pages: float32, bfloat16, float16, or int8 / float8_e4m3fn /
      float8_e5m2 (quantised: one byte per element plus a float32 scale per token and KV
      head).
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  num_blocks: int
  dtype: Any = jnp.bfloat16

  def __post_init__(self):
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
    if self.num_blocks * self.block_size > MAX_SLOTS:
      raise ValueError(f"num_blocks={self.num_blocks} x block_size={self.block_size} = "
                       f"{self.num_blocks * self.block_size} slots must be at most 2**31 - 1 "
                       "(slot ids are int32)")

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def quantized(self) -> bool:
    """True for int8 / float8 pools, which keep a scale per token and KV head."""
    return layout.is_quantized(self.dtype)

  @property
  def scale_bytes(self) -> int:
    """Bytes of one token's scale per KV head, for K or V (4 when quantised, else 0)."""
    return jnp.dtype(layout.SCALE_DTYPE).itemsize if self.quantized else 0

  @property
  def token_bytes(self) -> int:
    """Bytes of K and V for one token across all layers, scales included."""
    return (2 * self.num_layers * self.num_kv_heads
            * (self.head_dim * self.itemsize + self.scale_bytes))

  @property
  def block_bytes(self) -> int:
    """``2 * L * Z * K * (D * itemsize + scale)``: one block across all layers, K and V."""
    return self.token_bytes * self.block_size

  @property
  def total_bytes(self) -> int:
    """Bytes of the whole pool: ``block_bytes * num_blocks``."""
    return self.block_bytes * self.num_blocks

  @property
  def max_tokens(self) -> int:
    """Tokens the pool can hold when every block is full."""
    return self.block_size * self.num_blocks

  def blocks_for(self, num_tokens: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens occupies: ``ceil(num_tokens / Z)``."""
    return -(-int(num_tokens) // self.block_size)

  @classmethod
  def from_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: Any = jnp.bfloat16) -> "KVCacheSpec":
    """The largest cache that fits in ``budget_bytes`` (whole blocks only)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
      raise ValueError(f"{budget_bytes=} must be an int number of bytes")
    probe = cls(num_layers, num_kv_heads, head_dim, block_size, 1, dtype)
    num_blocks = int(budget_bytes) // probe.block_bytes
    if num_blocks < 1:
      raise ValueError(f"{budget_bytes=} is smaller than one block ({probe.block_bytes} bytes "
                       f"for num_layers={num_layers}, num_kv_heads={num_kv_heads}, "
                       f"head_dim={head_dim}, block_size={block_size}, dtype={probe.dtype})")
    if num_blocks * block_size > MAX_SLOTS:
      raise ValueError(f"{budget_bytes=} holds {num_blocks} blocks of {block_size} tokens, "
                       "more than int32 slot ids address (2**31 - 1 slots); pass a smaller "
                       "budget")
    return dataclasses.replace(probe, num_blocks=num_blocks)
