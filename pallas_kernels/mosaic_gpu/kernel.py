"""Mosaic GPU kernel: split-K attention of packed work items over the paged KV cache.

One program (CTA, one warpgroup) per (work item w, KV head k, split x). It holds the
item's M packed query rows of KV head k in shared memory and walks its share of the item's
KV range ``[begin, horizon)`` one chunk of J positions at a time:

- Pages come in through the block table by TMA into a ring of ``num_stages`` chunk
  buffers, one copy of K and one of V per copy unit of min(Z, J) positions (J / Z whole
  pages, or part of one page when Z > J); every unit has its own barrier (both of its
  copies arrive there), so pages past the item's horizon, or with an id outside the pool,
  are neither copied nor waited for. Chunk c + S is issued as soon as chunk c's buffer is free:
  right after it is converted (staged path) or after the dots that read it (direct path).
  Its block-table entries (global-memory loads) are read at the start of chunk c's step
  and carried in the loop state, so no step waits on a table read before its page waits
  or its refill.
- Scores ``Q K^T`` and the update ``P V`` run on the tensor cores (``wgmma``) with float32
  accumulation; the online softmax, masks and variants run on the float32 accumulator
  fragments in registers.
- Staged path (pages stored as bits of another dtype, quantised pages, float32): each
  chunk goes through registers into operand buffers: storage bits are bitcast back
  (``layout.from_storage``), float32 split into three bfloat16 pieces, and V rows that
  must not count zeroed (a chunk of J < 64 positions, ``tiling.SMALL_CHUNKS``, goes
  through registers as its transpose: the wgmma register layout spans 64 rows, and the
  transposed tile has D rows; one-byte pages whose rows are no whole number of 32-byte
  swizzle groups land in an unswizzled ring). Direct path (pages already in the 16-bit
  compute dtype): the dots read the TMA buffers, and only a chunk holding rows that must
  not count (the item's last chunk, or a skipped page) has those V rows zeroed in place
  first: 0 * NaN would poison the P V dot.
- Quantised pages (int8, float8_e4m3fn, float8_e5m2; ``OperandPlan.scaled``): the stored
  values are staged as they are, converted to bfloat16 (exact), and each position's
  float32 scale multiplies its column after the dots: ``s_j = (q . k_j) * k_scale_j`` and
  ``sum_j (p_j * v_scale_j) v_j``, exactly the dequantised products, accumulated in
  float32. A chunk's scales are read from the scale rows of its pages, beside the pages'
  copies, and are set to 0 at positions that do not count (their scales may be NaN).

The body's phases are named regions (``region``: prologue; per chunk pages, wait, stage,
scores, softmax, update, refill; epilogue): with ``KernelConfig.profile_dir`` (a GPU,
``ragged.profiled_attention``) the Mosaic GPU profiler writes where each program entered
and left each of them.

With ``KernelConfig.count_pages`` (interpret mode, ``ragged.copied_pages``) every copy
unit issued also adds 1 to a per-program counter of its block-table entry, at the point
of issue and under the copy's own condition; without it the kernel has no counter.

Split x covers chunks ``[x * c, min((x + 1) * c, n))`` of the item's n chunks
(``c = cdiv(n, X)``); it writes its partial output normalised by its own softmax sum and
its log-sum-exp, and the caller merges the splits. Sinks enter split 0 only.

The primitives that the Mosaic GPU interpret mode on CPU cannot run (in jax 0.10.2: a
``wgmma`` reading a transposed operand, accumulator ``run_state``, ``layout_cast``) sit
behind one static switch, ``_Primitives``: in interpret mode the two dots are ``jnp.dot``
of the same shared-memory operands (bfloat16/float16 pieces, float32 accumulation) and
layout casts are dropped. Everything else (TMA copies through the block table, barriers
and their phases, the ring, staging, masks, softmax, the epilogue) is the same code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels.mosaic_gpu import compat
from paged_jax.pallas_kernels.mosaic_gpu import tiling as tiling_lib
from paged_jax.pallas_kernels.mosaic_gpu.tiling import MosaicTiling, OperandPlan

plgpu = compat.plgpu

# A finite floor for the running max: exp(-inf - floor) = 0 for masked scores, and a row
# that sees nothing keeps max = floor, sum = 0 without any inf - inf. float32's lowest, so
# that no finite score is below it (at -1e30, a row whose scores were all below, under a
# huge sm_scale, summed exp(s - floor) = 0 and came out zero).
_MAX_FLOOR = float(np.finfo(np.float32).min)


def _div(a, b):
  """``lax.div`` of an int32 value by ``b``: a Python int is made int32 (under x64 it would
  be int64, which ``lax.div`` refuses beside an int32)."""
  return lax.div(a, b if isinstance(b, jax.Array) else np.int32(b))


def _rem(a, b):
  """``lax.rem``, as ``_div`` divides."""
  return lax.rem(a, b if isinstance(b, jax.Array) else np.int32(b))


def piece_pairs(a_pieces: int, b_pieces: int) -> tuple[tuple[int, int], ...]:
  """The products (piece i of a, piece j of b) kept in a dot of operands split into pieces
  (``split_pieces``): orders i + j below the larger piece count (the rest fall below
  float32 rounding), smallest first. (3, 3): six pairs; (3, 1), an exact b: three."""
  top = max(a_pieces, b_pieces)
  pairs = [(i, j) for i in range(a_pieces) for j in range(b_pieces) if i + j < top]
  return tuple(sorted(pairs, key=lambda ij: (-(ij[0] + ij[1]), -ij[0])))


def split_pieces(x, pieces: int, dtype, *, explicit_rounding: bool = False):
  """``x`` as ``pieces`` values of ``dtype`` summing to it: hi, mid, lo for float32 in
  bfloat16 (24 bits of mantissa in three 8-bit pieces); ``[x]`` cast when ``pieces`` is 1.

  ``explicit_rounding`` (for a split done by XLA, outside the kernel): round each piece
  with ``lax.reduce_precision`` rather than a float32 -> ``dtype`` -> float32 round trip.
  XLA on GPU may drop such a round trip (``xla_allow_excess_precision``, on by default),
  which makes every piece after the first zero: measured on an H200, float32 queries were
  then multiplied as bfloat16 (1.8e-3 off on a long decode). ``reduce_precision`` is an
  op of its own that XLA keeps, but Mosaic GPU has no lowering for it: inside the kernel
  the round trip stays, and that lowering keeps it (its K, V and probability splits matched
  float32 on the H200)."""
  if pieces == 1:
    return [x.astype(dtype)]
  info = jnp.finfo(dtype)
  out = []
  rest = x.astype(jnp.float32)
  for i in range(pieces):
    if explicit_rounding:
      rounded = lax.reduce_precision(rest, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    else:
      rounded = rest.astype(dtype).astype(jnp.float32)
    out.append(rounded.astype(dtype))
    if i + 1 < pieces:
      rest = rest - rounded
  return out


def region(name: str):
  """A named region of the kernel body (``jax.named_scope``): with
  ``KernelConfig.profile_dir`` set, the Mosaic GPU profiler records the clock where each
  warpgroup enters and leaves it; otherwise it only names the code."""
  return jax.named_scope(name)


@dataclasses.dataclass(frozen=True)
class _Primitives:
  """The static switch between the Hopper primitives and their interpret-mode stand-ins.

  Everything the two paths share is written once in the kernel; only these methods differ.
  """

  interpret: bool

  def layout_cast(self, x, layout_):
    return x if self.interpret else plgpu.layout_cast(x, layout_)

  def iota(self, shape, dimension, layout_):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=layout_)

  def load_plain(self, ref):
    """A tile of an unswizzled, untiled buffer (a ring of one-byte rows that are no whole
    number of 32-byte swizzle groups), in the wgmma register layout."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

  def load_transposed(self, ref):
    """A [J, D] shared-memory tile as its transpose [D, J] in registers: the wgmma layout
    spans 64 rows, so a tile of J < 64 rows is loaded with its D rows as the rows."""
    if self.interpret:
      return ref[...].T
    return plgpu.load(plgpu.transpose_ref(ref, (1, 0)), (),
                      layout=plgpu.Layout.WGMMA_TRANSPOSED)

  def store_transposed(self, ref, value_DJ):
    """Stores ``value_DJ`` (from ``load_transposed``) into the [J, D] tile ``ref``."""
    if self.interpret:
      ref[...] = value_DJ.T
    else:
      plgpu.transpose_ref(ref, (1, 0))[...] = value_DJ

  def scale_row(self, scales_ref, index, offset, size):
    """``size`` float32 scalars ``scales_ref[*index, offset:offset + size]``: scalar loads
    from global memory on the GPU (a TMA copy of a unit's scales, ``4 * min(Z, J)`` bytes,
    into a contiguous [J] buffer would land at shared-memory offsets that are not
    128-byte aligned when Z < 32); one vector read in interpret mode, where every access
    is a host callback."""
    if self.interpret:
      row = scales_ref[(*index, pl.ds(offset, size))]
      return [row[u] for u in range(size)]
    return [scales_ref[(*index, offset + u)] for u in range(size)]

  def scores(self, q_refs, k_refs, shape):
    """``sum_{(i, j)} q_i @ k_j^T`` float32 [M, J] over the piece pairs."""
    pairs = piece_pairs(len(q_refs), len(k_refs))
    if self.interpret:
      qs = [ref[...] for ref in q_refs]
      ks = [ref[...] for ref in k_refs]
      total = None
      for i, j in pairs:
        s = jnp.dot(qs[i], ks[j].T, preferred_element_type=jnp.float32)
        total = s if total is None else total + s
      return total

    def run(acc_ref):
      for i, j in pairs:
        plgpu.wgmma(acc_ref, q_refs[i], plgpu.transpose_ref(k_refs[j], (1, 0)))
      return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

  def accumulate(self, acc_MD, p_pieces, v_refs):
    """``acc + sum_{(i, j)} p_i @ v_j`` (float32 accumulation)."""
    pairs = piece_pairs(len(p_pieces), len(v_refs))
    if self.interpret:
      vs = [ref[...] for ref in v_refs]
      for i, j in pairs:
        acc_MD = acc_MD + jnp.dot(p_pieces[i], vs[j], preferred_element_type=jnp.float32)
      return acc_MD

    def run(acc_ref):
      for i, j in pairs:
        plgpu.wgmma(acc_ref, p_pieces[i], v_refs[j])

    return pl.run_state(run)(plgpu.ACC.init(acc_MD))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static parameters of one kernel build."""

  sm_scale: float
  sliding_window: int | None
  soft_cap: float | None
  kv_dtype: object | None        # logical K/V dtype when the pages hold storage bits
  mma_dtype: object              # bfloat16 or float16: what the tensor cores multiply
  plan: OperandPlan              # plan.scaled: int8/float8 pages with float32 scales
  tiling: MosaicTiling
  group: int
  has_sinks: bool
  interpret: bool
  # Also write, per program, how many copy units of each table entry it issued (tests and
  # benchmarks, interpret mode only). False adds nothing to the kernel.
  count_pages: bool = False
  # The Mosaic GPU profiler (on a GPU only): a trace of the kernel's named regions
  # (``region``) for every program, written as JSON into this folder after each call;
  # ``profile_space`` regions a program may record (more corrupts the trace).
  profile_dir: str | None = None
  profile_space: int = 0


def _smem_tile(shape, dtype, *, max_swizzle: int = 128):
  """A shared-memory buffer laid out as the wgmma and TMA want it: 8-row tiles, swizzled
  (by at most ``max_swizzle`` bytes)."""
  itemsize_bits = jnp.dtype(dtype).itemsize * 8
  swizzle = min(max_swizzle, plgpu.find_swizzle(shape[-1] * itemsize_bits))
  minor = swizzle * 8 // itemsize_bits
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, minor)),
                                              plgpu.SwizzleTransform(swizzle)))


def _kernel(*refs, cfg: KernelConfig):
  t = cfg.tiling
  prims = _Primitives(cfg.interpret)
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)   # one value per row of an [M, J] fragment
  col_layout = wgmma_layout.reduce(0)   # one value per column

  refs = list(refs)
  # Input
  layer_ref = refs.pop(0)       # i32[1]
  seq_ref = refs.pop(0)         # i32[W] block-table row of each item
  begin_ref = refs.pop(0)       # i32[W] first KV position read (a multiple of Z)
  horizon_ref = refs.pop(0)     # i32[W] end of the KV range
  qbase_ref = refs.pop(0)       # i32[W] position of slot 0 of the item's tile
  lo_ref = refs.pop(0)          # i32[W] first live slot
  hi_ref = refs.pop(0)          # i32[W] end of the live slots
  tables_ref = refs.pop(0)      # i32[S, P] block tables
  sinks_ref = refs.pop(0) if cfg.has_sinks else None   # f32[H]
  q_hbm_refs = [refs.pop(0) for _ in range(cfg.plan.pieces)]  # [W, K, M, D] each: packed
                                # queries (mma dtype), one array per piece
  k_pages_ref = refs.pop(0)     # [L, K, N, Z, D] whole pool, storage dtype
  v_pages_ref = refs.pop(0)
  k_scales_ref = refs.pop(0) if cfg.plan.scaled else None   # f32[L, K, N, Z]
  v_scales_ref = refs.pop(0) if cfg.plan.scaled else None
  # Output
  out_ref = refs.pop(0)         # f32[X, W, K, M, D] normalised partial outputs (M: Q*G to 8)
  lse_ref = refs.pop(0)         # f32[X, W, K, M] log-sum-exp, -inf where nothing seen
  copies_ref = refs.pop(0) if cfg.count_pages else None  # i32[X, W, K, P] copy units issued
                                # per table entry (count_pages)
  assert not refs

  pieces, rows, head_dim = len(q_hbm_refs), q_hbm_refs[0].shape[2], q_hbm_refs[0].shape[3]
  kv_pieces = cfg.plan.kv_pieces
  num_blocks, block_size = k_pages_ref.shape[2], k_pages_ref.shape[3]
  num_stages, chunk = t.num_stages, t.chunk_size
  unit = min(block_size, chunk)        # positions per page copy
  num_copies = chunk // unit           # page copies per chunk
  group = cfg.group
  mma_dtype = cfg.mma_dtype
  compute_dtype = jnp.float32 if pieces > 1 else mma_dtype

  item = lax.axis_index("w")
  kv_head = lax.axis_index("k")
  split = lax.axis_index("x")
  layer = layer_ref[0]
  seq = seq_ref[item]
  begin = begin_ref[item]
  horizon = horizon_ref[item]
  num_chunks = _div(jnp.maximum(horizon - begin, 0) + (chunk - 1), chunk)
  per_split = _div(num_chunks + (t.num_splits - 1), t.num_splits)
  chunk_begin = jnp.minimum(split * per_split, num_chunks)
  chunk_end = jnp.minimum(chunk_begin + per_split, num_chunks)

  # Query position of each packed row (row m = slot q * G + head g); -1 for dead rows,
  # which then see nothing.
  row_M = prims.iota((rows,), 0, row_layout)
  slot_M = _div(row_M, group)
  lo, hi = lo_ref[item], hi_ref[item]
  row_live_M = (slot_M >= lo) & (slot_M < hi)
  qpos_M = jnp.where(row_live_M, qbase_ref[item] + slot_M, -1)

  table_width = tables_ref.shape[1]

  def page_ids(c):
    """The block-table entries of chunk c's copy units, one scalar load each. Loaded a ring
    of chunks ahead of use (``main_loop``), so the latency of these global-memory loads
    overlaps the waits and dots before them instead of stalling the chunk that needs
    them. The entry index is clamped into the table: a copy unit past the table's end
    (past the item's horizon, which is at most P * Z) loads entry P - 1 and never uses
    it."""
    ids = []
    for r in range(num_copies):
      pos = begin + c * chunk + r * unit
      ids.append(tables_ref[seq, jnp.minimum(_div(pos, block_size), table_width - 1)])
    return tuple(ids)

  def page_info(c, ids):
    """``[(read, page_id, offset)]``, one per copy unit of chunk c (page ids ``ids``):
    whether copy r happens, from which page and at which slot of it."""
    info = []
    for r, page_id in enumerate(ids):
      pos = begin + c * chunk + r * unit
      # A page past the horizon is never touched (garbage table entries, other
      # sequences' blocks); an id outside [0, N) (invalid input) reads nothing rather
      # than being clamped into a real block.
      read = (pos < horizon) & (page_id >= 0) & (page_id < num_blocks)
      offset = _rem(pos, block_size) if unit < block_size else 0
      info.append((read, page_id, offset))
    return info

  def issue(c, ids, slot, k_raw, v_raw, page_barriers):
    for r, (read, page_id, offset) in enumerate(page_info(c, ids)):
      rows_r = pl.ds(r * unit, unit)
      slots = pl.ds(offset, unit)
      barrier = page_barriers.at[slot * num_copies + r]

      @pl.when(read)
      def _copy():
        plgpu.copy_gmem_to_smem(k_pages_ref.at[layer, kv_head, page_id, slots],
                                k_raw.at[slot, rows_r], barrier)
        plgpu.copy_gmem_to_smem(v_pages_ref.at[layer, kv_head, page_id, slots],
                                v_raw.at[slot, rows_r], barrier)
        if copies_ref is not None:
          # Counted where the copy is issued, under the same condition: table entry
          # pos / Z of the item's sequence got one more copy unit (one K and one V copy).
          entry = (split, item, kv_head, _div(begin + c * chunk + r * unit, block_size))
          copies_ref[entry] = copies_ref[entry] + 1

  def valid_positions(c, info, vector_layout):
    """bool[J] (in ``vector_layout``): positions of chunk c that may count: before the
    horizon, on a page that was read."""
    return valid_at(c, info, prims.iota((chunk,), 0, vector_layout))

  def valid_at(c, info, within):
    """``(pos, valid)`` for offsets ``within`` chunk c (an int array of any shape and
    layout): the KV positions, and whether each may count (``valid_positions``)."""
    pos = begin + c * chunk + within
    valid = pos < horizon
    copy = _div(within, unit)
    for r, (read, _, _) in enumerate(info):
      valid = valid & ((copy != r) | read)
    return pos, valid

  def operand_values(raw):
    """A tile as loaded (pages as stored) as operand values: storage bits bitcast back
    (``from_storage``), in the compute dtype; quantised values (int8, float8) as they are,
    in the mma dtype, where each is exact (their scales apply to the dots' columns,
    ``scale_vector``)."""
    values = layout.from_storage(raw, cfg.kv_dtype)
    if not cfg.plan.scaled:
      return values.astype(compute_dtype)
    if jnp.issubdtype(values.dtype, jnp.floating) and values.dtype.itemsize == 1:
      # Hopper converts float8 to float16 only (one instruction per pair); every float8
      # value is a float16 and a bfloat16 value, so both steps are exact.
      values = values.astype(jnp.float16)
    return values.astype(mma_dtype)

  def scale_vector(scales_ref, info, valid_J):
    """f32[J] (column layout of an [M, J] fragment): the chunk's per-position scales,
    ``scales[layer, kv_head, page, slot]`` of each copy unit's positions, and 0 at the
    positions that do not count (the scale of a slot the sequence does not hold may be
    NaN; a page that was not copied reads block 0's scales, discarded here)."""
    col_J = prims.iota((chunk,), 0, col_layout)
    scale_J = prims.layout_cast(jnp.zeros((chunk,), jnp.float32), col_layout)
    for r, (read, page_id, offset) in enumerate(info):
      row_scales = prims.scale_row(scales_ref, (layer, kv_head, jnp.where(read, page_id, 0)),
                                   offset, unit)
      for u, scale in enumerate(row_scales):
        scale_J = jnp.where(col_J == r * unit + u, scale, scale_J)
    return jnp.where(valid_J, scale_J, 0.0)

  def stage(raw_ref, op_ref, c, info, *, zero_invalid_rows):
    if chunk < tiling_lib.CHUNK_TILE:
      stage_transposed(raw_ref, op_ref, c, info, zero_invalid_rows=zero_invalid_rows)
      return
    values_JD = operand_values(prims.load_plain(raw_ref) if plain_ring else raw_ref[...])
    if zero_invalid_rows:
      _, valid_J = valid_positions(c, info, row_layout)
      valid_JD = lax.broadcast_in_dim(valid_J, values_JD.shape, [0])
      values_JD = jnp.where(valid_JD, values_JD, jnp.zeros_like(values_JD))
    for i, piece in enumerate(split_pieces(values_JD, len(op_ref), mma_dtype)):
      op_ref[i][...] = piece

  def stage_transposed(raw_ref, op_ref, c, info, *, zero_invalid_rows):
    """``stage`` for chunks of J < 64 positions (``tiling.SMALL_CHUNKS``): the tile goes
    through registers as its transpose [D, J], and the positions that must not count are
    its columns (``valid_at`` of a [D, J] iota of offsets)."""
    transposed = plgpu.Layout.WGMMA_TRANSPOSED
    values_DJ = operand_values(prims.load_transposed(raw_ref))
    if zero_invalid_rows:
      _, valid_DJ = valid_at(c, info, prims.iota(values_DJ.shape, 1, transposed))
      values_DJ = jnp.where(valid_DJ, values_DJ, jnp.zeros_like(values_DJ))
    for i, piece in enumerate(split_pieces(values_DJ, len(op_ref), mma_dtype)):
      prims.store_transposed(op_ref[i], piece)

  sink_M = None
  if sinks_ref is not None:
    head_M = _rem(row_M, group)
    sink_M = prims.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
    for g in range(group):
      sink_M = jnp.where(row_live_M & (head_M == g), sinks_ref[kv_head * group + g], sink_M)

  def main_loop(q_smem, k_raw, v_raw, k_ops, v_ops, q_barrier, page_barriers):
    with region("prologue"):
      for i in range(pieces):
        plgpu.copy_gmem_to_smem(q_hbm_refs[i].at[item, kv_head], q_smem.at[i], q_barrier)
      # The page ids of the chunks in flight: entry s holds chunk c + s's (c: the chunk
      # the loop body consumes); the body loads chunk c + S's at its start and shifts the
      # ring.
      ids_ring = tuple(page_ids(chunk_begin + s) for s in range(num_stages))
      for s in range(num_stages):
        @pl.when(chunk_begin + s < chunk_end)
        def _prologue():
          issue(chunk_begin + s, ids_ring[s], s, k_raw, v_raw, page_barriers)
      plgpu.barrier_wait(q_barrier)
    q_refs = [q_smem.at[i] for i in range(pieces)]

    max_M = prims.layout_cast(jnp.full((rows,), _MAX_FLOOR, jnp.float32), row_layout)
    sum_M = prims.layout_cast(jnp.full((rows,), 0.0, jnp.float32), row_layout)
    if sink_M is not None:
      # The sink is one more logit with no value, counted once: split 0 starts from it
      # (running max = sink, running sum = exp(sink - max) = 1), the other splits from
      # nothing. A -inf sink (dead rows) adds 0. The condition is a vector (the same for
      # every row): Mosaic GPU lowers no select of a scalar predicate over vector cases
      # (jax 0.11.2 on an H200: "Implicit broadcast not implemented").
      first_M = (row_M >= 0) & (split == 0)
      max_M = jnp.where(first_M, jnp.maximum(sink_M, _MAX_FLOOR), max_M)
      sum_M = jnp.where(first_M, jnp.exp(sink_M - max_M), sum_M)
    acc_MD = prims.layout_cast(jnp.full((rows, head_dim), 0.0, jnp.float32), wgmma_layout)

    def body(step, carry):
      max_M, sum_M, acc_MD, ids_ring = carry
      c = chunk_begin + step
      slot = _rem(step, num_stages)
      refill_ids = page_ids(c + num_stages)   # used by the refill, after the waits
      with region("pages"):
        info = page_info(c, ids_ring[0])
      with region("wait"):
        for r, (read, _, _) in enumerate(info):
          @pl.when(read)
          def _wait():
            plgpu.barrier_wait(page_barriers.at[slot * num_copies + r])
      refill = c + num_stages < chunk_end
      if cfg.plan.staged:
        # Through registers into the operand buffers; then the ring slot is free and
        # the chunk S ahead is issued before this one's dots run.
        with region("stage"):
          stage(k_raw.at[slot], k_ops, c, info, zero_invalid_rows=False)
          stage(v_raw.at[slot], v_ops, c, info, zero_invalid_rows=True)
          plgpu.commit_smem()

        with region("refill"):
          @pl.when(refill)
          def _refill():
            issue(c + num_stages, refill_ids, slot, k_raw, v_raw, page_barriers)

        k_refs, v_refs = k_ops, v_ops
      else:
        # The item's last chunk (positions past the horizon) and a chunk with a skipped
        # page hold V rows that are stale or unwritten: zero them where they lie.
        any_skipped = functools.reduce(lambda a, b: a | b, [~read for read, _, _ in info])
        with region("stage"):
          @pl.when((c == num_chunks - 1) | any_skipped)
          def _zero_rows():
            stage(v_raw.at[slot], [v_raw.at[slot]], c, info, zero_invalid_rows=True)
            plgpu.commit_smem()
        k_refs, v_refs = [k_raw.at[slot]], [v_raw.at[slot]]

      with region("scores"):
        scores_MJ = prims.scores(q_refs, k_refs, (rows, chunk))
      with region("softmax"):
        pos_J, valid_J = valid_positions(c, info, col_layout)
        if k_scales_ref is not None:  # s_j = (q . k_j) * k_scale_j
          k_scale_J = scale_vector(k_scales_ref, info, valid_J)
          scores_MJ = scores_MJ * lax.broadcast_in_dim(k_scale_J, scores_MJ.shape, [1])
        scores_MJ = scores_MJ * cfg.sm_scale
        if cfg.soft_cap is not None:
          scores_MJ = cfg.soft_cap * jnp.tanh(scores_MJ / cfg.soft_cap)
        pos_MJ = lax.broadcast_in_dim(pos_J, scores_MJ.shape, [1])
        qpos_MJ = lax.broadcast_in_dim(qpos_M, scores_MJ.shape, [0])
        visible_MJ = (pos_MJ <= qpos_MJ) & lax.broadcast_in_dim(valid_J, scores_MJ.shape, [1])
        if cfg.sliding_window is not None:
          visible_MJ = visible_MJ & (pos_MJ > qpos_MJ - cfg.sliding_window)
        scores_MJ = jnp.where(visible_MJ, scores_MJ, -jnp.inf)

        new_max_M = jnp.maximum(max_M, jnp.max(scores_MJ, axis=1))
        probs_MJ = jnp.exp(scores_MJ - lax.broadcast_in_dim(new_max_M, scores_MJ.shape, [0]))
        rescale_M = jnp.exp(max_M - new_max_M)
        sum_M = sum_M * rescale_M + jnp.sum(probs_MJ, axis=1)
        acc_MD = acc_MD * lax.broadcast_in_dim(rescale_M, acc_MD.shape, [0])
        weights_MJ = probs_MJ
        if v_scales_ref is not None:  # sum_j (p_j * v_scale_j) v_j
          v_scale_J = scale_vector(v_scales_ref, info, valid_J)
          weights_MJ = probs_MJ * lax.broadcast_in_dim(v_scale_J, probs_MJ.shape, [1])
        weight_pieces = split_pieces(weights_MJ, pieces, mma_dtype)
      with region("update"):
        acc_MD = prims.accumulate(acc_MD, weight_pieces, v_refs)

      if not cfg.plan.staged:
        with region("refill"):
          @pl.when(refill)
          def _refill():
            issue(c + num_stages, refill_ids, slot, k_raw, v_raw, page_barriers)
      return new_max_M, sum_M, acc_MD, ids_ring[1:] + (refill_ids,)

    max_M, sum_M, acc_MD, _ = lax.fori_loop(0, chunk_end - chunk_begin, body,
                                            (max_M, sum_M, acc_MD, ids_ring))
    return max_M, sum_M, acc_MD

  storage_dtype = k_pages_ref.dtype
  ring_shape = (num_stages, chunk, head_dim)
  # One-byte rows that are no whole number of 32-byte swizzle groups (D = 48, 80, 112)
  # cannot be swizzled: that ring is a plain buffer, read only by the staging (the pages of
  # a quantised pool are always staged).
  plain_ring = head_dim * jnp.dtype(storage_dtype).itemsize % 32 != 0
  assert cfg.plan.staged or not plain_ring
  ring_buf = plgpu.SMEM if plain_ring else _smem_tile
  scratch = [
      _smem_tile((pieces, rows, head_dim), mma_dtype),
      ring_buf(ring_shape, storage_dtype),
      ring_buf(ring_shape, storage_dtype),
  ]
  if cfg.plan.staged:
    # The V operand's rows (J) are the K of the update's wgmma, which takes K in groups
    # of the swizzle's width: J * 2 bytes at most (32 bytes for J = 16).
    v_swizzle = chunk * jnp.dtype(mma_dtype).itemsize
    scratch += [[_smem_tile((chunk, head_dim), mma_dtype) for _ in range(kv_pieces)],
                [_smem_tile((chunk, head_dim), mma_dtype, max_swizzle=v_swizzle)
                 for _ in range(kv_pieces)]]
  else:
    scratch += [[], []]
  scratch += [plgpu.Barrier(num_arrivals=pieces),
              plgpu.Barrier(num_arrivals=2, num_barriers=num_stages * num_copies)]
  if copies_ref is not None:
    copies_ref[split, item, kv_head] = jnp.zeros(copies_ref.shape[3:], jnp.int32)
  max_M, sum_M, acc_MD = pl.run_scoped(main_loop, *scratch)

  seen_M = sum_M > 0.0
  safe_sum_M = jnp.where(seen_M, sum_M, 1.0)
  out_MD = acc_MD / lax.broadcast_in_dim(safe_sum_M, acc_MD.shape, [0])
  lse_M = jnp.where(seen_M, max_M + jnp.log(safe_sum_M), -jnp.inf)
  out_rows, lse_rows = out_ref.shape[3], lse_ref.shape[3]

  def epilogue(out_smem, lse_smem):
    out_smem[...] = out_MD
    lse_smem[...] = lse_M
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, out_rows)], out_ref.at[split, item, kv_head])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, lse_rows)], lse_ref.at[split, item, kv_head])
    plgpu.wait_smem_to_gmem(0)

  with region("epilogue"):
    pl.run_scoped(epilogue, _smem_tile((rows, head_dim), jnp.float32),
                  plgpu.SMEM((rows,), jnp.float32))


def split_attention(q_pieces, k_pages_LKNZD, v_pages_LKNZD, layer, seq_W, begin_W, horizon_W,
                    qbase_W, lo_W, hi_W, tables_SP, sinks_H=None, k_scales_LKNZ=None,
                    v_scales_LKNZ=None, *, cfg: KernelConfig, out_rows: int,
                    lse_rows: int, num_entries: int | None = None):
  """Partial attention of every (item, KV head, split); see the module docstring.

  Args:
    q_pieces: one [W, K, M, D] packed-query array per piece, in the mma dtype (float32 as
      three bfloat16 pieces), M a multiple of 64.
    k_pages_LKNZD, v_pages_LKNZD: [L, K, N, Z, D] pages as stored.
    layer: i32[] layer index.
    seq_W, begin_W, horizon_W, qbase_W, lo_W, hi_W: i32[W] item metadata (``items``).
    tables_SP: i32[S, P] block tables.
    sinks_H: f32[H] sink logits or None.
    k_scales_LKNZ, v_scales_LKNZ: f32[L, K, N, Z] scales of quantised pages, or None.
    cfg: static ``KernelConfig``.
    out_rows, lse_rows: rows of the partial outputs written back (<= M).
    num_entries: with ``cfg.count_pages``, P: the block-table entries counted (the table
      width before padding).

  Returns:
    ``(out_XWKMD, lse_XWKM)`` float32 with X = ``cfg.tiling.num_splits``, M = ``out_rows``
    for the outputs and ``lse_rows`` for the log-sum-exp; with ``cfg.count_pages`` also
    ``copies_XWKP`` i32: the copy units (of min(Z, J) positions, one K and one V copy
    each) every program issued from each entry p of its item's block-table row.
  """
  num_items, num_kv_heads, _, head_dim = q_pieces[0].shape
  num_splits = cfg.tiling.num_splits
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  inputs = [layer_arr, seq_W, begin_W, horizon_W, qbase_W, lo_W, hi_W, tables_SP]
  if cfg.has_sinks:
    inputs.append(sinks_H)
  inputs += [*q_pieces, k_pages_LKNZD, v_pages_LKNZD]
  if cfg.plan.scaled:
    inputs += [k_scales_LKNZ, v_scales_LKNZ]
  out_type = (
      jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, out_rows, head_dim),
                           jnp.float32),
      jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, lse_rows), jnp.float32),
  )
  if cfg.count_pages:
    if not cfg.interpret:
      raise ValueError(f"count_pages={cfg.count_pages} needs interpret=True (the counter is "
                       "scalar global-memory traffic, for tests and benchmarks on CPU)")
    if num_entries is None:
      raise ValueError(f"{num_entries=} must be the block-table width with count_pages")
    out_type += (jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, num_entries),
                                      jnp.int32),)
  interpret = compat.interpret_params() if cfg.interpret else None
  profile = {}
  if cfg.profile_dir is not None:
    if cfg.interpret or cfg.profile_space < 1:
      raise ValueError(f"profile_dir={cfg.profile_dir!r} needs a GPU (interpret=False) and "
                       f"profile_space >= 1 (got {cfg.profile_space})")
    profile = dict(profile_space=cfg.profile_space, profile_dir=cfg.profile_dir)
  run = plgpu.kernel(
      functools.partial(_kernel, cfg=cfg),
      out_type=out_type,
      grid=(num_items, num_kv_heads, num_splits),
      grid_names=("w", "k", "x"),
      compiler_params=plgpu.CompilerParams(approx_math=cfg.plan.pieces == 1, **profile),
      interpret=interpret,
  )
  return run(*inputs)
