"""Triton-backend Pallas kernel: split-K attention of packed work items over paged KV.

One program per (work item w, KV head k, split x). The program holds the item's M packed
query rows of KV head k (Q query rows times G heads), walks its share of the item's KV
range ``[begin, horizon)`` J positions at a time (R whole pages, J = R * Z; or with
``page_split`` a part of one page, J = Z / page_split) through the block table, and keeps
an online softmax in float32. ``begin`` is 0, or with a sliding window the start of the
page holding the item's first query's window start, so pages wholly before the window are
never loaded. Split x of an item covers chunks ``[x * c, min((x + 1) * c,
n))`` with ``n = cdiv(horizon - begin, J)`` and ``c = cdiv(n, X)``, so a long decode
sequence is spread over X programs (flash-decoding) and a short one leaves the extra
programs empty. Each program writes its normalised partial output and its log-sum-exp; the
caller merges them. Sinks enter split 0 only, so the merge counts each once.

Variants (static): ``soft_cap`` maps scores to ``c * tanh(s / c)`` before the mask;
``sliding_window`` W hides keys at or before ``qpos - W``; ``kv_dtype`` bitcasts each
loaded tile from the pool's storage bits.

Quantised pools (``kv_dtype`` int8 / float8, scales f32[L, K, N, Z]): each K and V tile is
gathered as storage bits together with its keys' scales (one float32 per position, from the
same page ids and offsets under the same mask, so a slot whose tile row is not loaded has
no scale read either), and the scales are applied after the dots, which is exact because a
scale belongs to one key row and one value row: ``s_j = (q . k_bits_j) * k_scale_j`` and
``out = sum_j (p_j * v_scale_j) v_bits_j``. q . k_bits runs on q's dtype (int8 and float8
values are exact in bfloat16 and float16, so a 16-bit q keeps the tensor-core dot) with
float32 accumulation; the weights, the V dot and the softmax are float32.

Pages are gathered with masked loads: positions at or past the item's horizon (its causal
reach, never past the sequence's length) are masked off, so pages a sequence does not own,
or the unwritten tail of its last page, are never read. The layer is an int32 input used in
the load index, so the [L, K, N, Z, D] pool is never sliced outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels.gpu.tiling import GpuTiling

# A finite floor for the running max: exp(-inf - floor) = 0 for masked scores, and a row
# that sees nothing keeps max = floor, sum = 0 without any inf - inf. float32's lowest, so
# that no finite score is below it (at -1e30, a row whose scores were all below, under a
# huge sm_scale, summed exp(s - floor) = 0 and came out zero).
_MAX_FLOOR = float(np.finfo(np.float32).min)


def _kernel(
    # Input
    layer_ref,      # i32[1]
    seq_ref,        # i32[W] sequence of each item
    begin_ref,      # i32[W] first KV position each item reads (page-aligned)
    horizon_ref,    # i32[W] KV positions each item needs (end of its range)
    tables_ref,     # i32[S, P'] block tables, P' >= P + R
    qpos_ref,       # i32[M] (block of [W, M]) query position of each packed row, -1 = none
    q_ref,          # [M, D] (block of [W, K, M, D])
    sinks_ref,      # f32[M] (block of [K, M]) sink logit of each packed row, or None
    k_pages_ref,    # [L, K, N, Z, D] whole pool, read through masked gathers
    v_pages_ref,    # [L, K, N, Z, D]
    k_scales_ref,   # f32[L, K, N, Z] whole (quantised pools), read with the pages, or None
    v_scales_ref,   # f32[L, K, N, Z], or None
    # Output
    out_ref,        # f32[M, D] (block of [X, W, K, M, D]) normalised partial output
    lse_ref,        # f32[M] (block of [X, W, K, M]) log-sum-exp, -inf where nothing seen
    pages_ref,      # i32[M] (block of [X, W, K, M]) pages loaded (count_pages), or None
    *, sm_scale: float, chunk: int, num_splits: int, compute_dtype,
    sliding_window: int | None, soft_cap: float | None, kv_dtype):
  # ``compute_dtype``: the operands of the V dot (and of q . k unless quantised); q
  # arrives in its QK dtype.
  item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_blocks, block_size, head_dim = k_pages_ref.shape[2:]
  # The tiles' D: a power of two (Triton's block shapes), D or more; the q columns past
  # D are zero and the K/V lanes past it are never loaded (read as 0).
  rows, tile_dim = q_ref.shape

  layer = layer_ref[0]
  seq = seq_ref[item]
  begin = begin_ref[item]
  horizon = horizon_ref[item]
  num_chunks = pl.cdiv(jnp.maximum(horizon - begin, 0), np.int32(chunk))  # int32 under x64
  per_split = pl.cdiv(num_chunks, np.int32(num_splits))
  chunk_begin = jnp.minimum(split * per_split, num_chunks)
  chunk_end = jnp.minimum(chunk_begin + per_split, num_chunks)

  quantized = k_scales_ref is not None
  qk_dtype = q_ref.dtype if quantized else compute_dtype
  q_MD = q_ref[...].astype(qk_dtype)
  qpos_M = qpos_ref[...]

  dim_1D = jnp.arange(tile_dim, dtype=jnp.int32)[None, :]
  padded = tile_dim > head_dim
  if padded:
    in_dim_1D = dim_1D < head_dim
    dim_1D = jnp.minimum(dim_1D, head_dim - 1)  # lanes past D: in-bounds, masked addresses
  zero = 0 if jnp.issubdtype(k_pages_ref.dtype, jnp.integer) else 0.0

  def load_chunk(pages_ref, page_ids_J, offset_J, valid_JD, dtype):
    # Every index is an array or a scalar, none a slice: one pointer per element of the
    # [J, D] tile (row j from page ``page_ids_J[j]``, slot ``offset_J[j]``), a gather that
    # both the Triton lowering and the interpreter accept. Storage bits are bitcast back
    # to the logical dtype on the loaded tile only; quantised values (int8 / float8) go
    # through float32 to ``dtype`` (exact for bfloat16 and float16 too).
    index = (layer, kv_head, page_ids_J[:, None], offset_J[:, None], dim_1D)
    x_JD = layout.from_storage(plgpu.load(pages_ref.at[index], mask=valid_JD, other=zero),
                               kv_dtype)
    if quantized:
      x_JD = x_JD.astype(jnp.float32)
    return x_JD.astype(dtype)

  def load_scales(scales_ref, page_ids_J, offset_J, read_J):
    # The scales of the tile's rows: same page ids, offsets and mask as the tile, so a
    # slot that is not loaded has no scale read (its NaN scale, if unused, stays unread).
    return plgpu.load(scales_ref.at[layer, kv_head, page_ids_J, offset_J], mask=read_J,
                      other=0.0)

  def body(c, carry):
    max_M, sum_M, acc_MD, pages = carry
    # Chunks start at ``begin``, a page boundary: the pages before the item's window
    # (all their positions before its first query's window) are never touched.
    pos_J = begin + c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    in_range_J = pos_J < horizon
    # The table is padded by R entries (R >= 1 and J <= R * Z), so this load is in
    # bounds; each entry is read once per row of its page (from cache).
    page_ids_J = plgpu.load(tables_ref.at[seq, pos_J // block_size])
    # A position past the horizon is never dereferenced: its page id is replaced and its
    # lanes masked, so garbage table entries (NO_BLOCK, other sequences' blocks) and the
    # unwritten tail of the last page stay unread. An id outside [0, N) (invalid input)
    # reads nothing rather than being clamped into a real block.
    read_J = in_range_J & (page_ids_J >= 0) & (page_ids_J < num_blocks)
    page_ids_J = jnp.where(read_J, page_ids_J, 0)
    offset_J = pos_J % block_size
    if padded:
      valid_JD = read_J[:, None] & in_dim_1D
    else:
      valid_JD = jnp.broadcast_to(read_J[:, None], (chunk, tile_dim))
    k_JD = load_chunk(k_pages_ref, page_ids_J, offset_J, valid_JD, qk_dtype)
    v_JD = load_chunk(v_pages_ref, page_ids_J, offset_J, valid_JD, compute_dtype)
    if pages_ref is not None:
      # A page is loaded iff its first slot is (the chunk is page-aligned, or a part of
      # one page: each page's first slot falls in exactly one chunk).
      pages += jnp.sum((read_J & (offset_J == 0)).astype(jnp.int32))

    scores_MJ = plgpu.dot(q_MD, k_JD, trans_b=True, precision=lax.Precision.HIGHEST)
    if quantized:  # s_j = (q . k_bits_j) * k_scale_j, with sm_scale folded in
      k_scale_J = load_scales(k_scales_ref, page_ids_J, offset_J, read_J)
      scores_MJ = scores_MJ * (k_scale_J * sm_scale)[None, :]
    else:
      scores_MJ = scores_MJ * sm_scale
    if soft_cap is not None:
      scores_MJ = soft_cap * jnp.tanh(scores_MJ / soft_cap)
    visible_MJ = (pos_J[None, :] <= qpos_M[:, None]) & in_range_J[None, :]
    if sliding_window is not None:
      visible_MJ &= pos_J[None, :] > qpos_M[:, None] - sliding_window
    scores_MJ = jnp.where(visible_MJ, scores_MJ, -jnp.inf)

    new_max_M = jnp.maximum(max_M, jnp.max(scores_MJ, axis=1))
    probs_MJ = jnp.exp(scores_MJ - new_max_M[:, None])
    rescale_M = jnp.exp(max_M - new_max_M)
    sum_M = sum_M * rescale_M + jnp.sum(probs_MJ, axis=1)
    weights_MJ = probs_MJ
    if quantized:  # out = sum_j (p_j * v_scale_j) v_bits_j
      v_scale_J = load_scales(v_scales_ref, page_ids_J, offset_J, read_J)
      weights_MJ = probs_MJ * v_scale_J[None, :]
    acc_MD = acc_MD * rescale_M[:, None] + plgpu.dot(
        weights_MJ.astype(compute_dtype), v_JD, precision=lax.Precision.HIGHEST)
    return new_max_M, sum_M, acc_MD, pages

  max_M = jnp.full((rows,), _MAX_FLOOR, jnp.float32)
  sum_M = jnp.zeros((rows,), jnp.float32)
  if sinks_ref is not None:
    # The sink is one more logit with no value, counted once: split 0 starts from it
    # (running max = sink, running sum = exp(sink - max) = 1), the other splits from
    # nothing, and the merge adds the splits' sums. A -inf sink (padding rows) adds 0.
    sink_M = sinks_ref[...]
    first = split == 0
    max_M = jnp.where(first, jnp.maximum(sink_M, _MAX_FLOOR), max_M)
    sum_M = jnp.where(first, jnp.exp(sink_M - max_M), sum_M)
  init = (max_M, sum_M, jnp.zeros((rows, tile_dim), jnp.float32), jnp.int32(0))
  max_M, sum_M, acc_MD, pages = lax.fori_loop(chunk_begin, chunk_end, body, init)
  seen_M = sum_M > 0.0
  safe_sum_M = jnp.where(seen_M, sum_M, 1.0)
  out_ref[...] = acc_MD / safe_sum_M[:, None]
  lse_ref[...] = jnp.where(seen_M, max_M + jnp.log(safe_sum_M), -jnp.inf)
  if pages_ref is not None:
    pages_ref[...] = jnp.full((rows,), pages, jnp.int32)


def split_attention(q_WKMD, qpos_WM, k_pages_LKNZD, v_pages_LKNZD, layer, seq_W, begin_W,
                    horizon_W, block_tables_SP, sinks_KM=None, k_scales_LKNZ=None,
                    v_scales_LKNZ=None, *, sm_scale: float, tiling: GpuTiling,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    kv_dtype=None, count_pages: bool = False, interpret: bool = False):
  """Partial attention of every (item, KV head, split); see the module docstring.

  Args:
    q_WKMD: [W, K, M, D'] packed queries (M a power of two >= 16), in the compute dtype,
      or for a quantised pool in the dtype of q . k_bits (q's own if 16-bit, else float32);
      D' = ``tiling.tile_head_dim(D)``, the columns past the pages' D zero.
    qpos_WM: i32[W, M] query position of each packed row; -1 for padding rows.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (storage bits if ``kv_dtype``).
    layer: i32[] layer index.
    seq_W, begin_W, horizon_W: i32[W] item sequence, first KV position read (a multiple
      of Z) and end of the KV range.
    block_tables_SP: i32[S, P'] with P' >= P + ``tiling.pages_per_chunk``.
    sinks_KM: f32[K, M] sink logit of each packed row (-inf on padding rows), or None.
    k_scales_LKNZ, v_scales_LKNZ: f32[L, K, N, Z] for a quantised ``kv_dtype``, else None.
    sm_scale, sliding_window, soft_cap: as ``ragged_paged_attention`` (static).
    kv_dtype: logical dtype of the pages when they hold storage bits, else None.
    count_pages: also return how many pages each program loaded (for tests and
      benchmarks; interpret mode).

  Returns:
    ``(out_XWKMD, lse_XWKM)`` float32, X = ``tiling.num_splits``, D' columns (those
    past D zero); with ``count_pages`` also ``pages_XWK`` i32.
  """
  num_items, num_kv_heads, rows, head_dim = q_WKMD.shape  # head_dim: D', the tiles' D
  num_splits = tiling.num_splits
  has_sinks = sinks_KM is not None
  quantized = k_scales_LKNZ is not None
  if quantized != layout.is_quantized(kv_dtype) or quantized != (v_scales_LKNZ is not None):
    raise ValueError(f"k_scales and v_scales must be given exactly when kv_dtype={kv_dtype} "
                     "is int8 or float8")
  # q arrives in the compute dtype (quantised pools: q . k's, the rest is float32); pages
  # of another dtype are cast after loading.
  compute_dtype = jnp.float32 if quantized else q_WKMD.dtype
  full_kernel = functools.partial(_kernel, sm_scale=sm_scale,
                                  chunk=tiling.chunk_size(k_pages_LKNZD.shape[3]),
                                  num_splits=num_splits, compute_dtype=compute_dtype,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  kv_dtype=kv_dtype)

  def kernel(*refs):
    # Absent operands arrive as None, in the kernel's argument order.
    refs = iter(refs)
    take = lambda n, present=True: [next(refs) for _ in range(n)] if present else [None] * n
    return full_kernel(*take(7), *take(1, has_sinks), *take(2), *take(2, quantized),
                       *take(2), *take(1, count_pages))

  whole = lambda shape: pl.BlockSpec(shape, lambda w, k, x: (0,) * len(shape))
  row_spec = pl.BlockSpec((None, None, None, rows), lambda w, k, x: (x, w, k, 0))
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  inputs = [layer_arr, seq_W, begin_W, horizon_W, block_tables_SP, qpos_WM, q_WKMD]
  in_specs = [
      whole(layer_arr.shape),
      whole(seq_W.shape),
      whole(begin_W.shape),
      whole(horizon_W.shape),
      whole(block_tables_SP.shape),
      pl.BlockSpec((None, rows), lambda w, k, x: (w, 0)),
      pl.BlockSpec((None, None, rows, head_dim), lambda w, k, x: (w, k, 0, 0)),
  ]
  if has_sinks:
    inputs.append(sinks_KM)
    in_specs.append(pl.BlockSpec((None, rows), lambda w, k, x: (k, 0)))
  inputs += [k_pages_LKNZD, v_pages_LKNZD]
  in_specs += [whole(k_pages_LKNZD.shape), whole(v_pages_LKNZD.shape)]
  if quantized:
    inputs += [k_scales_LKNZ, v_scales_LKNZ]
    in_specs += [whole(k_scales_LKNZ.shape), whole(v_scales_LKNZ.shape)]
  out_specs = [
      pl.BlockSpec((None, None, None, rows, head_dim), lambda w, k, x: (x, w, k, 0, 0)),
      row_spec,
  ]
  out_shape = [
      jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, rows, head_dim),
                           jnp.float32),
      jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, rows), jnp.float32),
  ]
  if count_pages:
    out_specs.append(row_spec)
    out_shape.append(
        jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, rows), jnp.int32))
  outs = pl.pallas_call(
      kernel,
      grid=(num_items, num_kv_heads, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                           num_stages=tiling.num_stages),
      interpret=interpret,
      name="ragged_paged_attention_split_k",
  )(*inputs)
  if count_pages:
    return outs[0], outs[1], outs[2][..., 0]
  return outs[0], outs[1]
