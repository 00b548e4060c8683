"""The jitted public wrapper of the Mosaic GPU ragged paged attention kernel.

Work items, query packing, the split-K merge and the scatter back to rows are jnp here;
the kernel is ``kernel.split_attention``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import validation
from paged_jax.pallas_kernels.mosaic_gpu import compat
from paged_jax.pallas_kernels.mosaic_gpu import items as items_lib
from paged_jax.pallas_kernels.mosaic_gpu import kernel as kernel_lib
from paged_jax.pallas_kernels.mosaic_gpu import tiling as tiling_lib
from paged_jax.pallas_kernels.mosaic_gpu.tiling import MosaicTiling, OperandPlan

_MMA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _mma_dtype_and_pieces(q_dtype, pages_dtype, kv_dtype):
  """``(mma_dtype, pieces)``: the 16-bit dtype the tensor cores multiply and how many pieces
  of it each float32 operand takes (three bfloat16 pieces for float32 compute).

  Unquantised pools compute in ``promote(q, K/V)``. Quantised pools (scale after the dot,
  see ``OperandPlan.scaled``) compute in bfloat16 when q is bfloat16: q and the stored
  values are exact there, only the probabilities times the V scales are rounded, as a
  bfloat16 pool's probabilities are. Any other q (float16, float32) computes in float32:
  ``p_j * v_scale_j`` spans float32's range (a float8_e5m2 scale is amax / 57344), which
  float16 operands would underflow."""
  if layout.is_quantized(kv_dtype):
    compute = jnp.dtype(jnp.bfloat16 if jnp.dtype(q_dtype) == jnp.bfloat16 else jnp.float32)
  else:
    logical = jnp.dtype(kv_dtype if kv_dtype is not None else pages_dtype)
    compute = jnp.dtype(jnp.promote_types(q_dtype, logical))
  if compute in _MMA_DTYPES:
    return compute, 1
  return jnp.dtype(jnp.bfloat16), 3


def operand_plan(q_dtype, pages_dtype, *, kv_dtype=None) -> OperandPlan:
  """How K/V tiles reach the tensor cores for these dtypes (see ``OperandPlan``)."""
  quantized = layout.is_quantized(kv_dtype)
  mma_dtype, pieces = _mma_dtype_and_pieces(q_dtype, pages_dtype, kv_dtype)
  staged = pieces > 1 or quantized or jnp.dtype(pages_dtype) != mma_dtype
  return OperandPlan(storage_itemsize=jnp.dtype(pages_dtype).itemsize,
                     mma_dtype_name=mma_dtype.name, pieces=pieces, staged=staged,
                     scaled=quantized)


def static_validate(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, *, sm_scale, tiling, sliding_window=None,
                    soft_cap=None, sinks=None, kv_dtype=None, k_scales=None,
                    v_scales=None) -> None:
  """The shared shape and variant checks plus what this kernel needs; raises
  ``ValueError``."""
  validation.static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                                    block_tables_SP, cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    k_scales=k_scales, v_scales=v_scales)
  if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating)):
    raise ValueError(f"sm_scale={sm_scale!r} must be a static float")
  if tiling is not None and not isinstance(tiling, MosaicTiling):
    raise ValueError(f"tiling={tiling!r} must be a MosaicTiling or None")
  validation.static_validate_variants(q_THD.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  validation.refuse_float64(q_THD, k_pages_LKNZD, kv_dtype, "the Mosaic GPU kernel")
  if not jnp.issubdtype(q_THD.dtype, jnp.floating) or q_THD.dtype.itemsize < 2:
    raise ValueError(f"q.dtype={q_THD.dtype} must be float16, bfloat16 or float32")


def default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, *, kv_dtype=None,
                       sliding_window: int | None = None) -> MosaicTiling:
  """``tiling.default_tiling`` for these arguments' shapes and dtypes."""
  num_tokens, num_q_heads, head_dim = q_THD.shape
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_seq_rows, blocks_per_seq = block_tables_SP.shape
  plan = operand_plan(q_THD.dtype, k_pages_LKNZD.dtype, kv_dtype=kv_dtype)
  return tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=dims["K"],
      group=num_q_heads // dims["K"], block_size=dims["Z"], head_dim=head_dim,
      blocks_per_seq=blocks_per_seq, plan=plan, sliding_window=sliding_window)


def unsupported_reason(q_THD, k_pages_LKNZD, block_tables_SP, *, kv_dtype=None,
                       sliding_window: int | None = None) -> str | None:
  """Why this kernel cannot take arguments of these shapes and dtypes, or None if it can
  (with its default tiling): what an "auto" choice can ask before picking it. Static: only
  shapes and dtypes are read. The installed JAX is checked too (``available()``)."""
  if not compat.available():
    return f"jax {jax.__version__} lacks Mosaic GPU pieces: {', '.join(compat.missing_names())}"
  if not jnp.issubdtype(q_THD.dtype, jnp.floating) or jnp.dtype(q_THD.dtype).itemsize < 2:
    return f"q.dtype={q_THD.dtype} must be float16, bfloat16 or float32"
  def check_shapes(**shape):
    validation.refuse_float64(q_THD, k_pages_LKNZD, kv_dtype, "the Mosaic GPU kernel")
    tiling = default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, kv_dtype=kv_dtype,
                                sliding_window=sliding_window)
    tiling.check_shapes(**shape, plan=operand_plan(q_THD.dtype, k_pages_LKNZD.dtype,
                                                   kv_dtype=kv_dtype))

  return validation.refusal_reason(q_THD, k_pages_LKNZD, check_shapes)


_STATICS = ("sm_scale", "sliding_window", "soft_cap", "kv_dtype", "tiling", "interpret")


@dataclasses.dataclass(frozen=True)
class CopiedPages:
  """What ``copied_pages`` counted inside the kernel (all arrays int32 / bool).

  Attributes:
    copies_WKP: i32[W, K, P]: copy units (min(Z, J) positions; one K and one V TMA copy
      each) the programs of (work item w, KV head k) issued from entry p of the item's
      block-table row, summed over the split-K programs. A page is brought in iff its
      entry is > 0; a whole page takes Z / min(Z, J) units.
    seq_W: i32[W]: each item's sequence (block-table row).
    live_W: bool[W]: whether the item has any KV range (a real item).
    tiling: the ``MosaicTiling`` the kernel ran with (static).
  """

  copies_WKP: jax.Array
  seq_W: jax.Array
  live_W: jax.Array
  tiling: MosaicTiling = dataclasses.field(metadata=dict(static=True))

  @property
  def pages_WK(self) -> jax.Array:
    """i32[W, K]: pages (table entries) each (item, KV head) brought in."""
    return jnp.sum(self.copies_WKP > 0, axis=-1).astype(jnp.int32)


jax.tree_util.register_dataclass(CopiedPages)


def _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
               cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, sinks, kv_dtype,
               k_scales, v_scales, tiling, interpret, count_pages, profile_dir=None,
               profile_space=0):
  """The body of ``ragged_paged_attention``; with ``count_pages`` it returns
  ``(out_THD, CopiedPages)``: the same output and the copies the kernel issued. With
  ``profile_dir`` the kernel is built with the Mosaic GPU profiler on
  (``profiled_attention``)."""
  compat.require()
  static_validate(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                  cu_q_lens, num_seqs, sm_scale=sm_scale, tiling=tiling,
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
  plan = operand_plan(q_THD.dtype, k_pages_LKNZD.dtype, kv_dtype=kv_dtype)
  if tiling is None:
    tiling = default_tiling_for(q_THD, k_pages_LKNZD, block_tables_SP, kv_dtype=kv_dtype,
                                sliding_window=sliding_window)
  tiling.check_shapes(group=group, block_size=block_size, head_dim=head_dim, plan=plan)
  mma_dtype, pieces = jnp.dtype(plan.mma_dtype_name), plan.pieces
  rows = tiling_lib.packed_rows(tiling.q_tile, group)
  num_items = tiling_lib.num_work_items(num_tokens, num_seq_rows, tiling.q_tile)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)

  items = items_lib.build_items(kv_lens_S, cu_q_lens, num_seqs, num_tokens=num_tokens,
                                q_tile=tiling.q_tile, num_items=num_items,
                                block_size=block_size, blocks_per_seq=blocks_per_seq,
                                sliding_window=sliding_window)
  q_WKMD = items_lib.pack_queries(q_THD, items, num_kv_heads=num_kv_heads, rows=rows,
                                  dtype=jnp.float32 if pieces > 1 else mma_dtype)
  q_pieces = kernel_lib.split_pieces(q_WKMD, pieces, mma_dtype, explicit_rounding=True)
  cfg = kernel_lib.KernelConfig(
      sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
      kv_dtype=kv_dtype, mma_dtype=mma_dtype, plan=plan,
      tiling=tiling, group=group, has_sinks=sinks is not None, interpret=interpret,
      count_pages=count_pages, profile_dir=profile_dir, profile_space=profile_space)
  out_rows = tiling_lib.out_rows(tiling.q_tile, group)
  lse_rows = min(rows, tiling_lib.lse_rows(tiling.q_tile, group))
  outs = kernel_lib.split_attention(
      q_pieces, k_pages_LKNZD, v_pages_LKNZD, layer, items.seq_W, items.begin_W,
      items.horizon_W, items.qbase_W, items.lo_W, items.hi_W, block_tables_SP,
      None if sinks is None else sinks.astype(jnp.float32), k_scales, v_scales, cfg=cfg,
      out_rows=out_rows, lse_rows=lse_rows, num_entries=blocks_per_seq)
  out_XWKMD, lse_XWKM = outs[:2]
  out_WKMD = items_lib.combine_splits(out_XWKMD, lse_XWKM[..., :out_rows])
  out_THD = items_lib.unpack_outputs(out_WKMD, items, num_tokens=num_tokens,
                                     num_q_heads=num_q_heads).astype(q_THD.dtype)
  if count_pages:
    return out_THD, CopiedPages(copies_WKP=jnp.sum(outs[2], axis=0), seq_W=items.seq_W,
                                live_W=items.horizon_W > 0, tiling=tiling)
  return out_THD


@functools.partial(jax.jit, static_argnames=_STATICS)
def ragged_paged_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, k_scales=None, v_scales=None,
                           tiling: MosaicTiling | None = None, interpret: bool = False):
  """Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference``.

  Args:
    q_THD: [T, H, D] queries (float16, bfloat16 or float32); sequence i owns rows
      ``cu_q_lens[i]:cu_q_lens[i + 1]``.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages (``pallas_kernels.layout``);
      D a multiple of 16 up to 256, Z a multiple of 8 up to
      128.
    layer: int or traced i32[] scalar: the layer read, indexed inside the kernel.
    kv_lens_S: i32[S]; block_tables_SP: i32[S, P]; cu_q_lens: i32[S + 1];
    num_seqs: i32[] live sequences.
    sm_scale: softmax scale (static).
    sliding_window: static int W >= 1: a query at position p sees keys at positions
      ``p - W < k <= p``; pages wholly before an item's window are never copied.
    soft_cap: static float c > 0: scores become ``c * tanh(s / c)`` before the mask.
    sinks: f32[H] (traced) or None: one extra logit per query head in the softmax
      denominator, with no value.
    kv_dtype: the logical K/V dtype when the pages hold its storage bits
      (``layout.to_storage``); None when they hold it already.
    k_scales, v_scales: f32[L, K, N, Z] per-token scales, given exactly when
      ``kv_dtype`` is quantised (int8, float8_e4m3fn, float8_e5m2; ``layout.quantize``):
      ``value = stored * scale``, applied in the kernel to what it loads (a page's scale
      row read with its page).
    tiling: static ``MosaicTiling``; ``None`` derives it from the shapes.
    interpret: run the kernel in the Mosaic GPU interpret mode (CPU).

  Returns:
    [T, H, D] in q's dtype; padding rows are zero.

  Scores and the probability update run on bfloat16/float16 tensor cores with float32
  accumulation: in the compute dtype ``promote(q, K/V)`` when that is 16-bit, and for
  float32 as three bfloat16 pieces per operand (float32 accuracy, six products per dot).
  Quantised pages: the stored values go to the tensor cores as they are (converted to
  bfloat16 in the kernel, exactly) and the scales multiply the dots' columns,
  ``s_j = (q . k_j) * k_scale_j`` and ``sum_j (p_j * v_scale_j) v_j``; the compute dtype
  is bfloat16 for a bfloat16 q, else float32 (three pieces of q and of the weights
  against one of K/V: three products per dot).
  """
  return _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, tiling=tiling, interpret=interpret,
                    count_pages=False)


@functools.partial(jax.jit, static_argnames=_STATICS)
def copied_pages(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                 cu_q_lens, num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None, sinks=None, kv_dtype=None, k_scales=None,
                 v_scales=None, tiling: MosaicTiling | None = None, interpret: bool = True):
  """The pages the kernel copies by TMA for these arguments, counted inside the kernel.

  Runs the kernel of ``ragged_paged_attention`` (same work items, same tiling, the same
  copy loop: prologue and refills) with a counter beside each page copy it issues,
  incremented under the copy's own condition. Interpret mode only (tests, benchmarks).

  Returns:
    ``(out_THD, copied)``: the attention output, as ``ragged_paged_attention`` returns it,
    and a ``CopiedPages``.
  """
  return _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, tiling=tiling, interpret=interpret,
                    count_pages=True)


@functools.partial(jax.jit, static_argnames=_STATICS + ("profile_dir", "profile_space"))
def profiled_attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                       cu_q_lens, num_seqs, *, sm_scale: float, profile_dir: str,
                       profile_space: int, sliding_window: int | None = None,
                       soft_cap: float | None = None, sinks=None, kv_dtype=None,
                       k_scales=None, v_scales=None, tiling: MosaicTiling | None = None,
                       interpret: bool = False):
  """``ragged_paged_attention`` with the Mosaic GPU profiler on (a GPU only; benchmarks).

  Every call also writes a JSON trace (Chrome trace events) into ``profile_dir``: for each
  program (warpgroup), the clock (SM cycles) where it entered and left each named region
  of the kernel (``kernel.region``: prologue; per chunk pages, wait, stage, scores,
  softmax, update, refill; epilogue). ``profile_space`` is how many regions one program
  may record: at least 7 per chunk it walks plus 2, or the trace is corrupt. The
  profiler's clock reads and shared-memory trace buffer slow the kernel a little and take
  ``16 * profile_space`` bytes of shared memory.
  """
  return _attention(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                    cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, k_scales=k_scales,
                    v_scales=v_scales, tiling=tiling, interpret=interpret,
                    count_pages=False, profile_dir=profile_dir, profile_space=profile_space)
