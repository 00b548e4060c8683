"""The paged KV cache: every layer's K and V pages in one pytree."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout, validation
from paged_jax.spec import KVCacheSpec, _canonical_dtype

# While ``step.forward_step`` traces a model's forward (``recording``): the values a
# forward over KV groups must not hand to ``KVCache.write`` or ``paged_attention``: group
# 0's slots and block tables as the metadata holds them, and a traced layer index given to
# ``metadata.for_layer`` (only the cache layer, slots and tables it returns are a layer's).
# Each is refused on sight, by identity: nothing else is ever refused. None elsewhere; one
# per thread.
_record = contextvars.ContextVar("paged_jax_forward_record", default=None)


@contextlib.contextmanager
def recording(misused=()):
  """Yield the record (id -> (description, value)) of the block; ``misused``: ``(description,
  value)`` pairs to refuse from the start."""
  record: dict = {}
  token = _record.set(record)
  try:
    note_misused(*misused)
    yield record
  finally:
    _record.reset(token)


def note_misused(*described_values) -> None:
  """Inside ``recording``: refuse each ``(description, value)``'s value from now on."""
  record = _record.get()
  if record is not None:
    for description, x in described_values:
      record[id(x)] = (description, x)  # the value is kept alive: its id stays its own


def check_not_misused(argument: str, x) -> None:
  """Inside ``recording`` with KV groups: ``x`` must not be a value ``note_misused`` named."""
  record = _record.get()
  found = None if record is None else record.get(id(x))
  if found is not None:
    raise ValueError(
        f"{argument} is {found[0]}, but this cache keeps the layers in KV groups "
        "(layer_windows with windowed freeing): take each layer's cache layer, slots and "
        "block tables from cache_layer, slots_T, block_tables_SP = metadata.for_layer(layer) "
        "and pass those to cache.write and paged_attention")


def _check_int32_vector(name: str, x) -> None:
  if x.ndim != 1:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be rank 1")
  if jnp.dtype(x.dtype) != jnp.int32:
    raise ValueError(f"{name}.dtype={x.dtype} must be int32")


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _scales(name: str, x, shape: tuple) -> jax.Array:
  """Scales of a quantised pool as it keeps them: f32 ``shape`` ([L, K, N, Z], one per token
  and KV head); a scalar (a Python float, as JAX's ragged paged attention takes its
  ``k_scale``) stands for every token; None is scales of 1."""
  if x is None:
    return jnp.ones(shape, layout.SCALE_DTYPE)
  if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
    if not (math.isfinite(x) and x > 0):
      raise ValueError(f"{name}={x!r} must be a finite number > 0")
    x = np.float32(x)
  if not _is_array(x) and not isinstance(x, np.generic):
    raise ValueError(f"{name} is a {type(x).__name__}; it must be an array [L, K, N, Z]="
                     f"{list(shape)} or a scalar")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={x.dtype} must be a floating dtype (taken as float32)")
  if x.ndim == 0:
    return jnp.full(shape, x, layout.SCALE_DTYPE)
  if tuple(x.shape) != shape:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be [L, K, N, Z]={list(shape)}: one "
                     "scale per token and KV head (or a scalar for every token)")
  return jnp.asarray(x, layout.SCALE_DTYPE)


@jax.tree_util.register_pytree_with_keys_class
class KVCache:
  """K and V pages of every layer, ``[L, K, N, Z, D]`` each (``pallas_kernels.layout``).

  The pool arrays (``k_bits``, ``v_bits``) hold the K/V of logical ``dtype`` in the storage
  dtype the layout defines (``layout.storage_dtype``: the raw bits of 8- and 16-bit floats as
  unsigned integers, so no backend converts the whole pool around a gather or scatter);
  ``k_pages`` / ``v_pages`` view them in ``dtype`` (a whole-pool conversion: for tests and
  inspection, not for a step). A quantised pool (``dtype`` int8, float8_e4m3fn or
  float8_e5m2) also keeps ``k_scales`` / ``v_scales`` ``[L, K, N, Z]`` float32, one per token
  and KV head; they are None otherwise.

  ``KVCache(k_pages, v_pages)`` takes pages in their logical dtype; with ``dtype`` int8 or
  float8 and wider float pages it quantises them (a scale per token and KV head). Pages
  already in the quantised ``dtype`` (int8 or float8 values) are its stored values, kept as
  they are with ``k_scales`` / ``v_scales`` (``[L, K, N, Z]`` or a scalar for every token;
  none: scales of 1); ``KVCache(k_bits, v_bits, dtype=..., k_scales=..., v_scales=...)``
  takes storage bits (and scales) as they are.

  Immutable: ``write`` and ``copy_blocks`` return a new cache. Under ``jit`` donate the
  cache argument so XLA updates the pool in place instead of copying it each step.
  """

  __slots__ = ("k_bits", "v_bits", "k_scales", "v_scales", "dtype")

  def __init__(self, k_pages, v_pages, dtype=None, k_scales=None, v_scales=None):
    if _is_array(k_pages) and _is_array(v_pages):
      # Host (NumPy) pages become JAX arrays: a pool kept as NumPy cannot be written.
      k_pages, v_pages = (jnp.asarray(x) if isinstance(x, np.ndarray) else x
                          for x in (k_pages, v_pages))
      if k_pages.shape != v_pages.shape:
        raise ValueError(f"v_pages.shape={tuple(v_pages.shape)} must equal k_pages.shape="
                         f"{tuple(k_pages.shape)}")
      if k_pages.dtype != v_pages.dtype:  # V was cast to K's dtype, or failed later
        raise ValueError(f"v_pages.dtype={v_pages.dtype} must equal k_pages.dtype="
                         f"{k_pages.dtype}: one pool holds K and V alike")
      if k_pages.ndim != 5:
        raise ValueError(f"k_pages.shape={tuple(k_pages.shape)} must be [L, K, N, Z, D] "
                         "(KVCache.create(spec) builds one from a KVCacheSpec)")
      # What a KVCacheSpec takes (an int32 pool truncated every value it was given).
      logical = _canonical_dtype(dtype if dtype is not None else k_pages.dtype,
                                 "dtype" if dtype is not None else "k_pages.dtype")
      stored = layout.storage_dtype(logical)
      quantized = layout.is_quantized(logical)
      pages_dtype = jnp.dtype(k_pages.dtype)
      scales_given = k_scales is not None or v_scales is not None
      if quantized and pages_dtype in (stored, logical):
        # The pool's stored values (int8 / float8 values, or float8's uint8 bits), kept as
        # they are with their scales; values of the pool's own dtype default to scales of 1.
        if (k_scales is None) != (v_scales is None) or (
            not scales_given and pages_dtype != logical):
          missing = "v_scales" if v_scales is None and k_scales is not None else (
              "k_scales" if k_scales is None and v_scales is not None else "k_scales and "
              "v_scales")
          raise ValueError(f"{missing} must be given with {pages_dtype.name} pages for "
                           f"dtype={logical.name}: k_scales and v_scales are required "
                           "together (or neither, for pages of the pool's own dtype: scales "
                           "of 1; storage bits need both)")
        shape = tuple(k_pages.shape[:-1])
        k_scales, v_scales = (_scales(name, x, shape) for name, x in (
            ("k_scales", k_scales), ("v_scales", v_scales)))
        if pages_dtype != stored:
          k_pages, v_pages = (layout.to_storage(x, logical)
                              for x in (k_pages, v_pages))
      elif scales_given:
        what = (f"a {logical.name} pool keeps no scales" if not quantized else
                f"{pages_dtype.name} pages are quantised here, each token's scale computed; "
                f"pass {logical.name} values (or their storage bits) to keep scales of your own")
        raise ValueError(f"k_scales / v_scales were given with k_pages.dtype={pages_dtype.name}"
                         f" for dtype={logical.name}: {what}")
      elif quantized:  # float pages into a quantised pool
        (k_pages, k_scales), (v_pages, v_scales) = (
            layout.quantize(x, logical) for x in (k_pages, v_pages))
      elif pages_dtype != stored:
        k_pages, v_pages = (layout.to_storage(x, logical)
                            for x in (k_pages, v_pages))
      dtype = logical
    # Anything else (PartitionSpecs, shardings, None) is kept as is: a pytree of specs.
    for name, value in (("k_bits", k_pages), ("v_bits", v_pages), ("k_scales", k_scales),
                        ("v_scales", v_scales)):
      object.__setattr__(self, name, value)
    object.__setattr__(self, "dtype", None if dtype is None else jnp.dtype(dtype))

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

  _CHILDREN = ("k_bits", "v_bits", "k_scales", "v_scales")

  def tree_flatten_with_keys(self):
    keys = jax.tree_util.GetAttrKey
    return tuple((keys(n), getattr(self, n)) for n in self._CHILDREN), self.dtype

  @classmethod
  def tree_unflatten(cls, dtype, children):
    cache = object.__new__(cls)
    for name, value in zip(cls._CHILDREN, children):
      object.__setattr__(cache, name, value)
    object.__setattr__(cache, "dtype", dtype)
    return cache

  def __reduce__(self):
    # copy, deepcopy and pickle (of a host copy) rebuild the cache from its fields; their
    # default path sets attributes, which the frozen class refuses.
    return (KVCache.tree_unflatten, (self.dtype, tuple(getattr(self, n) for n in self._CHILDREN)))

  def replace_bits(self, k_bits, v_bits, k_scales=None, v_scales=None) -> "KVCache":
    """The same cache over new storage arrays (same shapes and storage dtype)."""
    return KVCache.tree_unflatten(self.dtype, (k_bits, v_bits, k_scales, v_scales))

  @property
  def quantized(self) -> bool:
    """True for int8 / float8 pools, which keep a scale per token and KV head."""
    return layout.is_quantized(self.dtype)

  def __repr__(self) -> str:
    shape = getattr(self.k_bits, "shape", None)
    return f"KVCache(shape={shape}, dtype={self.dtype})"

  @classmethod
  def create(cls, spec: KVCacheSpec, *, sharding=None) -> "KVCache":
    """A zeroed cache of the shape ``spec`` describes (scales of 1 when quantised)."""
    if isinstance(spec, jax.core.Tracer):  # jax.eval_shape(KVCache.create, spec)
      raise ValueError(f"spec={spec!r} must be a KVCacheSpec, passed as a static value: "
                       "jax.eval_shape(functools.partial(KVCache.create, spec)) sizes a "
                       "cache without allocating it")
    if not isinstance(spec, KVCacheSpec):
      raise ValueError(f"spec={spec!r} must be a KVCacheSpec")
    shape = layout.pages_shape(spec.num_layers, spec.num_kv_heads, spec.num_blocks,
                               spec.block_size, spec.head_dim)
    stored = layout.storage_dtype(spec.dtype)
    zeros = lambda: jnp.zeros(shape, stored, device=sharding)
    scales = (None, None)
    if layout.is_quantized(spec.dtype):
      ones = lambda: jnp.ones(shape[:-1], layout.SCALE_DTYPE, device=sharding)
      scales = (ones(), ones())
    return cls.tree_unflatten(jnp.dtype(spec.dtype), (zeros(), zeros()) + scales)

  @property
  def k_pages(self) -> jax.Array:
    """K pages ``[L, K, N, Z, D]`` in ``dtype`` (converts the whole pool; a quantised pool's
    stored values, before their scales: ``dequantized()`` gives float32 K/V)."""
    return layout.from_storage(self.k_bits, self.dtype)

  @property
  def v_pages(self) -> jax.Array:
    """V pages ``[L, K, N, Z, D]`` in ``dtype`` (converts the whole pool)."""
    return layout.from_storage(self.v_bits, self.dtype)

  def dequantized(self) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` pages ``[L, K, N, Z, D]`` as the values attention sees (float32 for a
    quantised pool, ``dtype`` otherwise). Whole-pool: for tests and inspection."""
    return (layout.dequantize(self.k_bits, self.k_scales, self.dtype),
            layout.dequantize(self.v_bits, self.v_scales, self.dtype))

  @property
  def spec(self) -> KVCacheSpec:
    dims = layout.unpack_pages_shape(self.k_bits.shape)
    return KVCacheSpec(num_layers=dims["L"], num_kv_heads=dims["K"], head_dim=dims["D"],
                       block_size=dims["Z"], num_blocks=dims["N"], dtype=self.dtype)

  @property
  def num_layers(self) -> int:
    return self.k_bits.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_bits.shape[1]

  @property
  def num_blocks(self) -> int:
    return self.k_bits.shape[2]

  @property
  def block_size(self) -> int:
    return self.k_bits.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k_bits.shape[4]

  def write(self, layer, k: jax.Array, v: jax.Array, slots: jax.Array) -> "KVCache":
    """Store token t's K/V at flat slot ``slots[t] = block_id * Z + offset`` of ``layer``.

    Args:
      layer: int or traced int scalar (a traced one outside ``[0, L)`` writes nothing).
      k, v: [T, K, D], a floating dtype (integer or bool K/V is refused, not cast); cast to
        the cache dtype (quantised with one scale per token and KV head for an int8 / float8
        pool).
      slots: i32[T] (or a host array of another integer type, NumPy's default int64 or a
        list: its values must fit int32). A slot outside ``[0, N * Z)`` (negative means
        padding) writes nothing: it is never clamped or wrapped into a real block. Slots in
        range must be distinct: of two tokens given one slot, which is stored is unspecified
        (K, V and the scales are separate scatters, and on an accelerator each may keep a
        different token).
    """
    check_not_misused("layer", layer)
    check_not_misused("slots", slots)
    k_TKD, v_TKD, slots_T = k, v, validation.host_int32("slots", slots)
    for name, x in (("k", k_TKD), ("v", v_TKD), ("slots", slots_T)):
      validation.check_is_array(name, x)
    validation.check_layer(layer, self.num_layers)
    expected = (self.num_kv_heads, self.head_dim)
    for name, x in (("k", k_TKD), ("v", v_TKD)):
      if x.ndim != 3 or tuple(x.shape[1:]) != expected:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, K, D]=[T, {expected[0]}, "
                         f"{expected[1]}]: the cache's KV heads and head dim (an engine "
                         "shapes its cache from config.num_kv_heads and config.head_dim)")
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={x.dtype} must be a floating dtype (K/V values, cast "
                         f"to the pool's {self.dtype.name})")
    if k_TKD.shape != v_TKD.shape:
      raise ValueError(f"v.shape={tuple(v_TKD.shape)} must equal k.shape={tuple(k_TKD.shape)}")
    _check_int32_vector("slots", slots_T)
    if slots_T.shape[0] != k_TKD.shape[0]:
      raise ValueError(f"slots.shape={tuple(slots_T.shape)} must be [T]=[{k_TKD.shape[0]}]")
    num_slots = self.num_blocks * self.block_size
    # Explicitly out of range (jnp would wrap a negative index), then dropped by the scatter.
    safe_T = jnp.where((slots_T >= 0) & (slots_T < num_slots), slots_T, num_slots)
    block_T, offset_T = safe_T // self.block_size, safe_T % self.block_size
    if not isinstance(layer, (int, np.integer)):  # traced: outside [0, L) writes nothing
      layer = jnp.asarray(layer, jnp.int32)
      layer = jnp.where((layer >= 0) & (layer < self.num_layers), layer, self.num_layers)
    # Index [layer, :, block, offset, :]: the advanced indices go first -> [T, K, D].
    if not self.quantized:
      k_bits = self.k_bits.at[layer, :, block_T, offset_T].set(
          layout.to_storage(k_TKD, self.dtype), mode="drop")
      v_bits = self.v_bits.at[layer, :, block_T, offset_T].set(
          layout.to_storage(v_TKD, self.dtype), mode="drop")
      return self.replace_bits(k_bits, v_bits)
    new = []
    for bits, scales, x_TKD in ((self.k_bits, self.k_scales, k_TKD),
                                (self.v_bits, self.v_scales, v_TKD)):
      x_bits_TKD, x_scales_TK = layout.quantize(x_TKD, self.dtype)
      new.append(bits.at[layer, :, block_T, offset_T].set(x_bits_TKD, mode="drop"))
      new.append(scales.at[layer, :, block_T, offset_T].set(x_scales_TK, mode="drop"))
    k_bits, k_scales, v_bits, v_scales = new
    return self.replace_bits(k_bits, v_bits, k_scales, v_scales)

  def copy_blocks(self, src: jax.Array, dst: jax.Array) -> "KVCache":
    """Copy whole blocks ``src[c] -> dst[c]`` (i32[C] each; host arrays of another integer
    type as ``write``'s slots) in every layer (fork / COW).

    A pair with either id outside ``[0, N)`` (``NO_BLOCK`` included) copies nothing. All
    reads happen before any write.
    """
    src_C, dst_C = validation.host_int32("src", src), validation.host_int32("dst", dst)
    validation.check_is_array("src", src_C)
    validation.check_is_array("dst", dst_C)
    _check_int32_vector("src", src_C)
    _check_int32_vector("dst", dst_C)
    if src_C.shape != dst_C.shape:
      raise ValueError(f"dst.shape={tuple(dst_C.shape)} must equal src.shape={tuple(src_C.shape)}")
    n = self.num_blocks
    valid_C = (src_C >= 0) & (src_C < n) & (dst_C >= 0) & (dst_C < n)
    src_C = jnp.where(valid_C, src_C, n)
    dst_C = jnp.where(valid_C, dst_C, n)

    def copy(pages):  # pages [L, K, N, ...]: K/V bits or their scales
      if pages is None:
        return None
      blocks = pages.at[:, :, src_C].get(mode="fill", fill_value=0)
      return pages.at[:, :, dst_C].set(blocks, mode="drop")

    return self.replace_bits(copy(self.k_bits), copy(self.v_bits), copy(self.k_scales),
                             copy(self.v_scales))

  def nbytes(self) -> int:
    """Bytes of the pool and its scales; also of an abstract cache (``jax.eval_shape``)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))
