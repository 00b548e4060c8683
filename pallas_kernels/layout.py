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
  """``x`` cast to the logical ``dtype``, as the bits the pool stores."""
  x = x.astype(dtype)
  target = storage_dtype(dtype)
  return x if target == jnp.dtype(dtype) else lax.bitcast_convert_type(x, target)


def from_storage(x, dtype):
  """Values loaded from a pool (storage dtype) as the logical ``dtype``; ``dtype=None`` means
  the pool already holds that dtype."""
  if dtype is None or jnp.dtype(x.dtype) == jnp.dtype(dtype):
    return x
  return lax.bitcast_convert_type(x, dtype)
