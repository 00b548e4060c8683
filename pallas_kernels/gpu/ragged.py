"""The jitted public wrapper of the GPU ragged paged attention kernel.

Work-item metadata, query packing, the split-K merge and the scatter back to rows are jnp
in this wrapper; the kernel itself comes from the backend chosen in ``_BACKENDS`` (the one
place that picks it). Only the Triton-lowered backend exists today; a Mosaic GPU (Hopper)
variant with the same ``split_attention`` signature would sit beside it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import validation
from paged_jax.pallas_kernels.gpu import tiling as tiling_lib
from paged_jax.pallas_kernels.gpu import triton_ragged
from paged_jax.pallas_kernels.gpu import work_items
from paged_jax.pallas_kernels.gpu.tiling import GpuTiling

_BACKENDS = {"triton": triton_ragged.split_attention}
DEFAULT_BACKEND = "triton"


def static_validate(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, *, sm_scale, tiling: GpuTiling | None,
                    backend: str, sliding_window=None, soft_cap=None, sinks=None,
                    kv_dtype=None, k_scales=None, v_scales=None) -> None:
  """The shared shape and variant checks plus what this kernel needs; raises
  ``ValueError``."""
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    k_scales=k_scales, v_scales=v_scales)
  if backend not in _BACKENDS:
    raise ValueError(f"backend={backend!r} must be one of {tuple(_BACKENDS)}")
  if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating)):
    raise ValueError(f"sm_scale={sm_scale!r} must be a static float")
  if tiling is not None and not isinstance(tiling, GpuTiling):
    raise ValueError(f"tiling={tiling!r} must be a GpuTiling or None")
  validation.static_validate_variants(q_THD.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  validation.refuse_float64(q_THD, k_pages_LKNZD, kv_dtype, "the Pallas GPU kernel")
  _check_offsets(k_pages_LKNZD)


# JAX's Triton lowering addresses a ref with 32-bit element offsets unless the array holds
# more than 2**32 bytes: a one-byte pool (int8, float8 bits) of 2**31 to 2**32 elements
# would read past offset 2**31 - 1 at a negative one (read in jax 0.10.2's lowering; not
# run on a GPU). Two- and four-byte pools of that many elements take 64-bit offsets.
_OFFSET_BYTES_32 = 2 ** 32


def _check_offsets(k_pages_LKNZD) -> None:
  """``ValueError`` for a pool JAX's Triton lowering would address with overflowing 32-bit
  offsets (see ``_OFFSET_BYTES_32``)."""
  size = math.prod(k_pages_LKNZD.shape)
  itemsize = jnp.dtype(k_pages_LKNZD.dtype).itemsize
  if size > 2 ** 31 and size * itemsize <= _OFFSET_BYTES_32:
    raise ValueError(
        f"k_pages.shape={tuple(k_pages_LKNZD.shape)} ({size} elements of {itemsize} byte) "
        "is too large a one-byte pool for the Triton kernel: JAX's Triton lowering "
        "addresses it with 32-bit offsets, which overflow past 2**31 elements (use "
        "impl='pallas_mosaic_gpu' or 'xla', or fewer blocks)")


def _compute_dtype(q_THD, k_pages_LKNZD, kv_dtype):
  """The dtype of the kernel's dot operands: float32 for a quantised pool (q . k_bits may
  run on q's 16-bit dtype, see ``_qk_dtype``), else q's and the pages' promoted."""
  if layout.is_quantized(kv_dtype):
    return jnp.dtype(jnp.float32)
  return jnp.promote_types(q_THD.dtype, kv_dtype if kv_dtype is not None
                           else k_pages_LKNZD.dtype)


def _qk_dtype(q_THD, k_pages_LKNZD, kv_dtype):
  """The dtype q is packed in, that of the q . k dot: for a quantised pool q's own if it is
  bfloat16 or float16 (int8 and float8 values are exact in both), else float32."""
  if layout.is_quantized(kv_dtype) and jnp.dtype(q_THD.dtype).itemsize == 2:
    return jnp.dtype(q_THD.dtype)
  return _compute_dtype(q_THD, k_pages_LKNZD, kv_dtype)


def default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, *, kv_dtype=None,
                       sliding_window: int | None = None) -> GpuTiling:
  """``tiling.default_tiling`` for these arguments' shapes."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  itemsize = jnp.dtype(_compute_dtype(q_THD, k_pages_LKNZD, kv_dtype)).itemsize
  return tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=dims["K"],
      group=num_q_heads // dims["K"], block_size=dims["Z"], head_dim=head_dim,
      blocks_per_seq=blocks_per_seq, itemsize=itemsize, sliding_window=sliding_window)


def unsupported_reason(q_THD, k_pages_LKNZD, block_tables_SP, *, kv_dtype=None,
                       sliding_window: int | None = None) -> str | None:
  """Why this kernel cannot take arguments of these shapes and dtypes, or None if it can
  (with its default tiling): what an "auto" choice asks before picking it. Static: only
  shapes and dtypes are read."""
  def check_shapes(**shape):
    validation.refuse_float64(q_THD, k_pages_LKNZD, kv_dtype, "the Pallas GPU kernel")
    _check_offsets(k_pages_LKNZD)
    tiling = default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, kv_dtype=kv_dtype,
                                sliding_window=sliding_window)
    tiling.check_shapes(**shape, itemsize=jnp.dtype(_compute_dtype(q_THD, k_pages_LKNZD,
                                                                   kv_dtype)).itemsize)

  return validation.refusal_reason(q_THD, k_pages_LKNZD, check_shapes)


def _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
               cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, sinks, kv_dtype,
               k_scales, v_scales, tiling, interpret, backend, count_pages):
  """The body of ``ragged_paged_attention``; with ``count_pages`` it returns, instead of
  the output, ``(pages_WK, seq_W, live_W)``: pages loaded by each (item, KV head), summed
  over splits, with each item's sequence and whether it is a real item."""
  static_validate(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                  cu_q_lens, num_seqs, sm_scale=sm_scale, tiling=tiling, backend=backend,
                  sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                  kv_dtype=kv_dtype, k_scales=k_scales, v_scales=v_scales)
  sliding_window, soft_cap = validation.canonical_variants(sliding_window, soft_cap)
  kv_dtype = None if kv_dtype is None else jnp.dtype(kv_dtype)
  num_tokens, num_q_heads, head_dim = q_THD.shape
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_kv_heads, block_size = dims["K"], dims["Z"]
  group = num_q_heads // num_kv_heads
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  if num_tokens == 0 and not count_pages:
    return jnp.zeros_like(q_THD)
  if sliding_window is not None and sliding_window >= blocks_per_seq * block_size:
    sliding_window = None  # wider than any sequence: no key is ever hidden by it
  if tiling is None:
    tiling = default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, kv_dtype=kv_dtype,
                                sliding_window=sliding_window)
  compute_dtype = _compute_dtype(q_THD, k_pages_LKNZD, kv_dtype)
  tiling.check_shapes(group=group, block_size=block_size, head_dim=head_dim,
                      itemsize=jnp.dtype(compute_dtype).itemsize)
  rows = tiling_lib.packed_rows(tiling.q_tile, group)
  num_items = tiling_lib.num_work_items(num_tokens, num_seq_rows, tiling.q_tile)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)

  items = work_items.build_work_items(kv_lens_S, cu_q_lens, num_seqs,
                                      num_tokens=num_tokens, q_tile=tiling.q_tile,
                                      num_items=num_items)
  q_WKMD, qpos_WM = work_items.pack_queries(
      q_THD, items, num_kv_heads=num_kv_heads, rows=rows,
      dtype=_qk_dtype(q_THD, k_pages_LKNZD, kv_dtype))
  # The kernel's tiles are D' = tile_head_dim(D) wide: zero q columns past D, and the
  # outputs' columns past D (zero too) are cut after the merge.
  tile_dim = tiling_lib.tile_head_dim(head_dim)
  q_WKMD = jnp.pad(q_WKMD, ((0, 0), (0, 0), (0, 0), (0, tile_dim - head_dim)))
  sinks_KM = None
  if sinks is not None:
    sinks_KM = work_items.pack_sinks(sinks, num_kv_heads=num_kv_heads,
                                     q_tile=tiling.q_tile, rows=rows)
  # The kernel loads table entries a whole chunk at a time from a page-aligned start:
  # pad the width by R. Entries past the horizon are loaded but replaced, never used as
  # page ids. A horizon past the table (an invalid kv_len) is cut, so no load leaves it.
  tables_SP = jnp.pad(block_tables_SP, ((0, 0), (0, tiling.pages_per_chunk)))
  horizon_W = jnp.minimum(items.horizon_W, blocks_per_seq * block_size)
  begin_W = work_items.kv_begin(items, sliding_window=sliding_window,
                                block_size=block_size)

  outs = _BACKENDS[backend](
      q_WKMD, qpos_WM, k_pages_LKNZD, v_pages_LKNZD, layer, items.seq_W, begin_W,
      horizon_W, tables_SP, sinks_KM, k_scales, v_scales, sm_scale=float(sm_scale),
      tiling=tiling, sliding_window=sliding_window, soft_cap=soft_cap, kv_dtype=kv_dtype,
      count_pages=count_pages, interpret=interpret)
  if count_pages:
    return jnp.sum(outs[2], axis=0), items.seq_W, horizon_W > 0
  out_XWKMD, lse_XWKM = outs
  out_WKMD = work_items.combine_splits(out_XWKMD, lse_XWKM)[..., :head_dim]
  out_THD = work_items.unpack_outputs(out_WKMD, items, num_tokens=num_tokens,
                                      num_q_heads=num_q_heads)
  return out_THD.astype(q_THD.dtype)


_STATICS = ("sm_scale", "sliding_window", "soft_cap", "kv_dtype", "tiling", "interpret",
            "backend")


@functools.partial(jax.jit, static_argnames=_STATICS)
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, k_scales=None, v_scales=None,
                           tiling: GpuTiling | None = None, interpret: bool = False,
                           backend: str = DEFAULT_BACKEND):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``.

  Args:
    q_THD: [T, H, D] queries; sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (``pallas_kernels.layout``);
      Z a power of two, D up to 256 (tiles of a power of two >= D, lanes past D masked).
    layer: int or traced i32[] scalar: the layer read, indexed inside the kernel.
    kv_lens_S: i32[S]; block_tables_SP: i32[S, P]; cu_q_lens: i32[S + 1];
    num_seqs: i32[] live sequences.
    sm_scale: softmax scale (static).
    sliding_window: static int W >= 1: a query at position p sees keys at positions
      ``p - W < k <= p``; pages wholly before an item's window are never loaded.
    soft_cap: static float c > 0: scores become ``c * tanh(s / c)`` before the mask.
    sinks: f32[H] (traced) or None: one extra logit per query head in the softmax
      denominator, with no value.
    kv_dtype: the logical K/V dtype when the pages hold its storage bits
      (``layout.to_storage``); None when they hold it already.
    k_scales, v_scales: f32[L, K, N, Z], exactly when ``kv_dtype`` is quantised (int8,
      float8): one scale per token and KV head, value = stored * scale. Each loaded tile's
      scales are loaded with it and applied inside the kernel; float32 accumulation.
    tiling: static ``GpuTiling``; ``None`` derives it from the shapes.
    interpret: run the Pallas kernel in interpret mode (CPU).
    backend: which Pallas GPU lowering runs the kernel (only "triton" today).

  Returns:
    [T, H, D] in q's dtype; padding rows are zero.
  """
  return _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, tiling=tiling, interpret=interpret, backend=backend,
                    count_pages=False)


@functools.partial(jax.jit, static_argnames=_STATICS)
def loaded_pages(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                 cu_q_lens, num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None, sinks=None, kv_dtype=None, k_scales=None,
                 v_scales=None, tiling: GpuTiling | None = None, interpret: bool = True,
                 backend: str = DEFAULT_BACKEND):
  """Pages the kernel loads for these arguments, counted inside the kernel.

  Runs the same kernel as ``ragged_paged_attention`` (same work items, same loop bounds)
  with a page counter: a page counts once per (item, KV head) when any of its slots is
  loaded. Meant for tests and benchmarks, in interpret mode.

  Returns:
    ``(pages_WK, seq_W, live_W)``: i32[W, K] pages loaded per (work item, KV head), summed
    over splits; i32[W] each item's sequence; bool[W] whether the item is real.
  """
  return _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, tiling=tiling, interpret=interpret, backend=backend,
                    count_pages=True)
