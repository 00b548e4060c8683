"""The paged KV cache: every layer's K and V pages in one pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout
from paged_jax.spec import KVCacheSpec


def _check_int32_vector(name: str, x) -> None:
  if x.ndim != 1:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be rank 1")
  if jnp.dtype(x.dtype) != jnp.int32:
    raise ValueError(f"{name}.dtype={x.dtype} must be int32")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """K and V pages of every layer, ``[L, K, N, Z, D]`` each (``pallas_kernels.layout``).

  Immutable: ``write`` and ``copy_blocks`` return a new cache. Under ``jit`` donate the
  cache argument so XLA updates the pool in place instead of copying it each step.
  """

  k_pages: jax.Array
  v_pages: jax.Array

  @classmethod
  def create(cls, spec: KVCacheSpec, *, sharding=None) -> "KVCache":
    """A zeroed cache of the shape ``spec`` describes."""
    if not isinstance(spec, KVCacheSpec):
      raise ValueError(f"spec={spec!r} must be a KVCacheSpec")
    shape = layout.pages_shape(spec.num_layers, spec.num_kv_heads, spec.num_blocks,
                               spec.block_size, spec.head_dim)
    zeros = lambda: jnp.zeros(shape, spec.dtype, device=sharding)
    return cls(k_pages=zeros(), v_pages=zeros())

  @property
  def spec(self) -> KVCacheSpec:
    dims = layout.unpack_pages_shape(self.k_pages.shape)
    return KVCacheSpec(num_layers=dims["L"], num_kv_heads=dims["K"], head_dim=dims["D"],
                       block_size=dims["Z"], num_blocks=dims["N"], dtype=self.k_pages.dtype)

  @property
  def num_layers(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[1]

  @property
  def num_blocks(self) -> int:
    return self.k_pages.shape[2]

  @property
  def block_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[4]

  @property
  def dtype(self):
    return self.k_pages.dtype

  def _check_layer(self, layer) -> None:
    if jnp.ndim(layer) != 0:
      raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    if hasattr(layer, "dtype") and not jnp.issubdtype(layer.dtype, jnp.integer):
      raise ValueError(f"layer.dtype={layer.dtype} must be an integer dtype")
    if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < self.num_layers:
      raise ValueError(f"layer={int(layer)} must be in [0, L={self.num_layers})")

  def write(self, layer, k: jax.Array, v: jax.Array, slots: jax.Array) -> "KVCache":
    """Store token t's K/V at flat slot ``slots[t] = block_id * Z + offset`` of ``layer``.

    Args:
      layer: int or traced int scalar.
      k, v: [T, K, D]; cast to the cache dtype.
      slots: i32[T]. A slot outside ``[0, N * Z)`` (negative means padding) writes nothing:
        it is never clamped or wrapped into a real block.
    """
    k_TKD, v_TKD, slots_T = k, v, slots
    self._check_layer(layer)
    expected = (self.num_kv_heads, self.head_dim)
    for name, x in (("k", k_TKD), ("v", v_TKD)):
      if x.ndim != 3 or tuple(x.shape[1:]) != expected:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, K, D]=[T, {expected[0]}, "
                         f"{expected[1]}]")
    if k_TKD.shape != v_TKD.shape:
      raise ValueError(f"v.shape={tuple(v_TKD.shape)} must equal k.shape={tuple(k_TKD.shape)}")
    _check_int32_vector("slots", slots_T)
    if slots_T.shape[0] != k_TKD.shape[0]:
      raise ValueError(f"slots.shape={tuple(slots_T.shape)} must be [T]=[{k_TKD.shape[0]}]")
    num_slots = self.num_blocks * self.block_size
    # Explicitly out of range (jnp would wrap a negative index), then dropped by the scatter.
    safe_T = jnp.where((slots_T >= 0) & (slots_T < num_slots), slots_T, num_slots)
    block_T, offset_T = safe_T // self.block_size, safe_T % self.block_size
    # Index [layer, :, block, offset, :]: the advanced indices go first -> [T, K, D].
    k_pages = self.k_pages.at[layer, :, block_T, offset_T].set(
        k_TKD.astype(self.dtype), mode="drop")
    v_pages = self.v_pages.at[layer, :, block_T, offset_T].set(
        v_TKD.astype(self.dtype), mode="drop")
    return KVCache(k_pages=k_pages, v_pages=v_pages)

  def copy_blocks(self, src: jax.Array, dst: jax.Array) -> "KVCache":
    """Copy whole blocks ``src[c] -> dst[c]`` (i32[C] each) in every layer (fork / COW).

    A pair with either id outside ``[0, N)`` (``NO_BLOCK`` included) copies nothing. All
    reads happen before any write.
    """
    src_C, dst_C = src, dst
    _check_int32_vector("src", src_C)
    _check_int32_vector("dst", dst_C)
    if src_C.shape != dst_C.shape:
      raise ValueError(f"dst.shape={tuple(dst_C.shape)} must equal src.shape={tuple(src_C.shape)}")
    n = self.num_blocks
    valid_C = (src_C >= 0) & (src_C < n) & (dst_C >= 0) & (dst_C < n)
    src_C = jnp.where(valid_C, src_C, n)
    dst_C = jnp.where(valid_C, dst_C, n)

    def copy(pages):
      blocks = pages.at[:, :, src_C].get(mode="fill", fill_value=0)
      return pages.at[:, :, dst_C].set(blocks, mode="drop")

    return KVCache(k_pages=copy(self.k_pages), v_pages=copy(self.v_pages))

  def nbytes(self) -> int:
    return self.k_pages.nbytes + self.v_pages.nbytes
