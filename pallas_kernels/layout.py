"""The physical layout of the paged KV cache: the ONE place that defines it.

Each of K and V is one array per model, holding every layer's pages:

    pages_LKNZD: [L, K, N, Z, D]   (layers, KV heads, blocks, tokens in a block, head dim)

Why head-major (K before N) and K, V apart:
- A page of one KV head, ``pages[l, k, n]``, is one contiguous ``[Z, D]`` matrix. That is the
  natural tile for both accelerators: the TPU kernel copies it with one rectangular DMA into
  VMEM (the last two dims map onto the (sublane, lane) tile, so no padding of a small K
  axis), and the GPU kernel loads it as one 2-D block for a tensor-core dot with the packed
  query heads of that KV head (GQA).
- Keeping all layers in one array lets a layer be chosen by a (possibly traced) index inside
  a kernel or a gather, so a scanned decoder never slices out, and so never copies, a layer's
  pool.
- K and V apart keeps every kernel free of ref reshapes or bitcasts (the TPU interpreter on
  CPU cannot run those), at the cost of two DMAs per page instead of one.

A token's flat slot id is ``block_id * Z + offset``; slots outside ``[0, N * Z)`` are
padding and must never be written or read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

PAGES_AXES = "LKNZD"


def pages_shape(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                head_dim: int) -> tuple[int, int, int, int, int]:
  """Shape of ``k_pages`` and of ``v_pages``."""
  return (num_layers, num_kv_heads, num_blocks, block_size, head_dim)


def unpack_pages_shape(shape) -> dict[str, int]:
  """``{"L": ..., "K": ..., "N": ..., "Z": ..., "D": ...}`` from a pages shape."""
  if len(shape) != len(PAGES_AXES):
    raise ValueError(f"pages shape={tuple(shape)} must have rank {len(PAGES_AXES)} "
                     f"({', '.join(PAGES_AXES)})")
  return dict(zip(PAGES_AXES, (int(s) for s in shape)))


# Storage dtype. The pools hold the raw bits of 8- and 16-bit floats in unsigned integers of
# the same width: XLA on CPU has no native bfloat16 / float8 gather or scatter and converts
# the WHOLE pool to float32 and back around one (a write of 8 tokens into a 32k-block bf16
# pool took 0.8 s). Integer pools are gathered and scattered in place on every backend; each
# kernel bitcasts what it loads back with ``from_storage`` (free: same width). float32 and
# int8 are stored as they are.

def storage_dtype(dtype):
  """The dtype the pool arrays hold for K/V of logical dtype ``dtype``."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(f"uint{8 * dtype.itemsize}")
  return dtype


def to_storage(x, dtype):
  """``x`` cast to the logical ``dtype``, as the bits the pool stores. Differentiating
  through bits is a ``ValueError`` (``_bits``). Into float16 the cast saturates at its
  largest finite value (a K of 7e4 from a bf16 model was stored as inf, and attention
  gave NaN); NaN stays NaN."""
  dtype = jnp.dtype(dtype)
  if (dtype == jnp.float16 and jnp.issubdtype(x.dtype, jnp.floating)
      and jnp.finfo(x.dtype).max > jnp.finfo(dtype).max):
    big = float(jnp.finfo(dtype).max)  # (bfloat16 cannot hold it: clip in float32)
    x = jnp.clip(x.astype(jnp.promote_types(x.dtype, jnp.float32)), -big, big)
  x = x.astype(dtype)
  target = storage_dtype(dtype)
  return x if target == jnp.dtype(dtype) else _bits(x, target)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _bits(x, target):
  """``x``'s raw bits as ``target`` (same width)."""
  return lax.bitcast_convert_type(x, target)


@_bits.defjvp
def _bits_jvp(target, primals, tangents):
  # An integer holds no derivative: JAX would give a gradient of zero through every K/V
  # written into the pool, in silence.
  del target, primals, tangents
  raise ValueError("differentiating through a KV pool of 8- or 16-bit floats: KVCache stores "
                   "them as raw bits, which carry no gradient (JAX would give zero); "
                   "differentiate over a float32 pool (KVCacheSpec(..., dtype=jnp.float32))")


def from_storage(x, dtype):
  """Values loaded from a pool (storage dtype) as the logical ``dtype``; ``dtype=None`` means
  the pool already holds that dtype."""
  if dtype is None or jnp.dtype(x.dtype) == jnp.dtype(dtype):
    return x
  return lax.bitcast_convert_type(x, dtype)


# Quantised pools. int8 and float8 (e4m3fn, e5m2) K/V keep one float32 scale per token and
# KV head, for K and for V apart:
#
#     k_scales_LKNZ, v_scales_LKNZ: [L, K, N, Z] float32;  value = stored * scale
#
# A token's scale is amax(|x|) over its D values / the format's largest value, computed when
# the token is written from that token alone. So a block is never requantised as it fills
# (writes only append; a scale never changes once written), an outlier token inflates no
# other token's scale, and heads whose magnitudes differ 10x each get their own. A scale
# page ``scales[l, k, n]`` is a ``[Z]`` row beside its ``[Z, D]`` page, copied with it. The
# cost: 4 bytes per token and KV head for K and for V, 3.1% of the int8 bytes at D = 128.

SCALE_DTYPE = jnp.float32
SCALES_AXES = "LKNZ"
_QUANTIZED = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0,
              jnp.dtype(jnp.float8_e5m2): 57344.0}


def is_quantized(dtype) -> bool:
  """True for the one-byte K/V dtypes that carry scales (int8, float8_e4m3fn, float8_e5m2)."""
  return dtype is not None and jnp.dtype(dtype) in _QUANTIZED


def scales_shape(num_layers: int, num_kv_heads: int, num_blocks: int,
                 block_size: int) -> tuple[int, int, int, int]:
  """Shape of ``k_scales`` and of ``v_scales`` (quantised pools only)."""
  return (num_layers, num_kv_heads, num_blocks, block_size)


def quantize(x, dtype):
  """``(bits, scales)``: ``x [..., D]`` stored as ``dtype`` bits with one float32 scale per
  leading index (``[...]``), so that ``dequantize(bits, scales, dtype) ~= x``."""
  dtype = jnp.dtype(dtype)
  limit = _QUANTIZED[dtype]
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # amax == 0 (all zeros) takes scale 1; a NaN row keeps a NaN scale, so poison survives.
  # A row so small that amax / limit is below float32's smallest normal (amax < limit *
  # 1.2e-38) takes that smallest normal: flushed to 0 it made 0 / 0 = NaN of every zero.
  scales = jnp.where(amax == 0, 1.0,
                     jnp.maximum(amax / limit, jnp.finfo(jnp.float32).tiny)).astype(SCALE_DTYPE)
  scaled = jnp.clip(x / scales[..., None], -limit, limit)
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  return to_storage(scaled, dtype), scales


def dequantize(bits, scales, dtype):
  """float32 values of loaded ``bits [..., D]`` and their ``scales [...]``; for an
  unquantised ``dtype`` (``scales`` None) just ``from_storage``."""
  values = from_storage(bits, dtype)
  if scales is None:
    return values
  return values.astype(jnp.float32) * scales[..., None].astype(jnp.float32)
