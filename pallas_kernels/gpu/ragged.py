"""The jitted public wrapper of the GPU ragged paged attention kernel.

Work-item metadata, query packing, the split-K merge and the scatter back to rows are jnp
in this wrapper; the kernel itself comes from the backend chosen in ``_BACKENDS`` (the one
place that picks it). Only the Triton-lowered backend exists today; a Mosaic GPU (Hopper)
variant with the same ``split_attention`` signature would sit beside it.
"""

from __future__ import annotations

import functools

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
                    backend: str) -> None:
  """The shared shape checks plus what this kernel needs; raises ``ValueError``."""
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs)
  if backend not in _BACKENDS:
    raise ValueError(f"backend={backend!r} must be one of {tuple(_BACKENDS)}")
  if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating)):
    raise ValueError(f"sm_scale={sm_scale!r} must be a static float")
  if tiling is not None and not isinstance(tiling, GpuTiling):
    raise ValueError(f"tiling={tiling!r} must be a GpuTiling or None")


def default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP) -> GpuTiling:
  """``tiling.default_tiling`` for these arguments' shapes."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  return tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=dims["K"],
      group=num_q_heads // dims["K"], block_size=dims["Z"], head_dim=head_dim,
      blocks_per_seq=blocks_per_seq)


@functools.partial(jax.jit, static_argnames=("sm_scale", "tiling", "interpret", "backend"))
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, sm_scale: float,
                           tiling: GpuTiling | None = None, interpret: bool = False,
                           backend: str = DEFAULT_BACKEND):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``.

  Args:
    q_THD: [T, H, D] queries; sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (``pallas_kernels.layout``);
      Z and D powers of two.
    layer: int or traced i32[] scalar: the layer read, indexed inside the kernel.
    kv_lens_S: i32[S]; block_tables_SP: i32[S, P]; cu_q_lens: i32[S + 1];
    num_seqs: i32[] live sequences.
    sm_scale: softmax scale (static).
    tiling: static ``GpuTiling``; ``None`` derives it from the shapes.
    interpret: run the Pallas kernel in interpret mode (CPU).
    backend: which Pallas GPU lowering runs the kernel (only "triton" today).

  Returns:
    [T, H, D] in q's dtype; padding rows are zero.
  """
  static_validate(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                  cu_q_lens, num_seqs, sm_scale=sm_scale, tiling=tiling, backend=backend)
  num_tokens, num_q_heads, head_dim = q_THD.shape
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_kv_heads = dims["K"]
  group = num_q_heads // num_kv_heads
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  if num_tokens == 0:
    return jnp.zeros_like(q_THD)
  if tiling is None:
    tiling = default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP)
  tiling.check_shapes(group=group, block_size=dims["Z"], head_dim=head_dim)
  rows = tiling_lib.packed_rows(tiling.q_tile, group)
  num_items = tiling_lib.num_work_items(num_tokens, num_seq_rows, tiling.q_tile)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)

  items = work_items.build_work_items(kv_lens_S, cu_q_lens, num_seqs,
                                      num_tokens=num_tokens, q_tile=tiling.q_tile,
                                      num_items=num_items)
  compute_dtype = jnp.promote_types(q_THD.dtype, k_pages_LKNZD.dtype)
  q_WKMD, qpos_WM = work_items.pack_queries(q_THD, items, num_kv_heads=num_kv_heads,
                                            rows=rows, dtype=compute_dtype)
  # The kernel loads table entries a whole chunk at a time: pad the width to a multiple
  # of R. Entries past the horizon are loaded but replaced, never used as page ids. A
  # horizon past the table (an invalid kv_len) is cut, so no load leaves the table.
  table_pad = -blocks_per_seq % tiling.pages_per_chunk
  tables_SP = jnp.pad(block_tables_SP, ((0, 0), (0, table_pad)))
  horizon_W = jnp.minimum(items.horizon_W, blocks_per_seq * dims["Z"])

  out_XWKMD, lse_XWKM = _BACKENDS[backend](
      q_WKMD, qpos_WM, k_pages_LKNZD, v_pages_LKNZD, layer, items.seq_W, horizon_W,
      tables_SP, sm_scale=float(sm_scale), tiling=tiling, interpret=interpret)
  out_WKMD = work_items.combine_splits(out_XWKMD, lse_XWKM)
  out_THD = work_items.unpack_outputs(out_WKMD, items, num_tokens=num_tokens,
                                      num_q_heads=num_q_heads)
  return out_THD.astype(q_THD.dtype)
