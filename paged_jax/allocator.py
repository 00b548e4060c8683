"""Functional block allocator: the KV block manager as immutable JAX arrays, inside ``jit``.

All state lives in one pytree, ``AllocatorState``; every op is a pure function returning a new
state, jit-able with static shapes and vectorised over sequences and blocks (cumsum, sort,
scatter and gather formulations; no Python loop and no ``fori_loop``/``while_loop``/``scan``).
Each op does O(N + S * P) work plus one sort of N block keys (the free order below).

State (glossary letters: S sequences = ``max_seqs``, P = ``max_blocks_per_seq``, N blocks,
Z = ``block_size``):

    block_tables  i32[S, P]  physical block of each logical block; unused entries NO_BLOCK
    seq_lens      i32[S]     tokens of each sequence (row s holds ceil(seq_lens[s] / Z) blocks)
    ref_counts    i32[N]     block-table entries naming each block; 0 means the block is free
    num_free      i32[]      blocks with ref_counts == 0
    last_used     i32[N]     clock stamp of the op that last allocated or freed each block
    clock         i32[]      incremented by every state-changing op (wraps after 2**31 ops)
    block_size    int        static metadata (Z)

Free structure. There is no free list or stack: a block is free iff its ``ref_counts`` is 0,
and free blocks are handed out in the order of the key ``(last_used, block id)``: least
recently freed first, then the lowest id (``_free_order_N``, one stable sort). An op that
needs ``k`` blocks takes the first ``k`` of that order, and each requester receives a
contiguous range of it (exclusive cumsum of the grants).

How prefix caching plugs in (a later issue): add ``block_hash_N`` (the hash of the token
prefix a full block holds, or "none") to the state. ``release`` keeps the hash of a freed
block, so it is free (counted in ``num_free``, ref count 0) but still *cached*. The free order
key becomes ``(is_cached, last_used, id)``: uncached free blocks are taken first, then cached
ones in LRU order, taking one evicts its hash. A prefix hit revives a cached free block by
raising its ref count 0 -> 1 (``num_free`` - 1), and shares a live one (ref count + 1) like
``fork`` does. Only the sort key and one extra field change; no op is rewritten.

Policies (deterministic):
- ``append``: sequences needing new blocks are served in slot order while the running sum of
  their demand fits ``num_free``; the first one that does not fit and every later one that
  needs blocks get none (ok False). Requests needing no new block (0 tokens, or tokens that
  fit the partial last block) always succeed. When the total demand fits, all succeed.
- ``fork``: the same rule in batch order for the forks that need a fresh tail block.
- ``preempt``: smallest priority first; ties released higher slot index first.
- ``utilization`` of a state with no block in use is 1.0 (no fragmentation).

Sharing: ``fork`` shares only FULL blocks and copies the partial tail eagerly, so a block with
ref count > 1 is full for every holder and appending never writes into a shared block (no
copy-on-write is needed at append time). ``validate`` checks this.

Bad values under ``jit`` are masked no-ops, never writes to another sequence: negative or
too-large ``append`` requests get ok False; an out-of-range ``fork`` src/dst gets ok False;
``slots`` returns a negative (padding) slot for an out-of-range sequence id or position.
Shapes and dtypes are checked at trace time (``ValueError`` naming the argument); the values
of a state are checked by the host function ``validate``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NO_BLOCK = -1
"""Block-table entry of an unused logical block, and the `fork` copy id meaning "no copy"."""

PAD_SLOT = -1
"""Slot id returned by `slots` for padding; `KVCache.write` ignores negative slots."""

_INT32_MAX = int(np.iinfo(np.int32).max)

__all__ = ["NO_BLOCK", "PAD_SLOT", "AllocatorState", "init", "append", "slots", "release", "fork",
           "preempt", "utilization", "validate"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllocatorState:
  """The allocator's whole state; see the module docstring for the meaning of each field."""

  block_tables: jax.Array  # i32[S, P]
  seq_lens: jax.Array  # i32[S]
  ref_counts: jax.Array  # i32[N]
  num_free: jax.Array  # i32[]
  last_used: jax.Array  # i32[N]
  clock: jax.Array  # i32[]
  block_size: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_blocks(self) -> int:
    return self.ref_counts.shape[0]

  @property
  def max_seqs(self) -> int:
    return self.block_tables.shape[0]

  @property
  def max_blocks_per_seq(self) -> int:
    return self.block_tables.shape[1]


# ----------------------------------------------------------------------------- helpers


def _check_positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name}={value!r} must be an int > 0")
  return int(value)


def _check_vector(name: str, x, length: int, kind: str) -> jax.Array:
  """``x`` as an array of shape ``[length]``; kind "int" (cast to int32) or "bool"."""
  x = jnp.asarray(x)
  if x.shape != (length,):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be ({length},)")
  if kind == "bool":
    if x.dtype != jnp.bool_:
      raise ValueError(f"{name}.dtype={x.dtype} must be bool")
    return x
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
  return x.astype(jnp.int32)


def _blocks_for(len_S: jax.Array, block_size: int) -> jax.Array:
  """Blocks needed to hold ``len_S`` tokens: ceil(len / Z)."""
  return (len_S + block_size - 1) // block_size


def _count_N(blocks, mask, num_blocks: int) -> jax.Array:
  """i32[N]: how many entries of ``blocks`` (any shape) with ``mask`` True name each block."""
  # Masked entries go out of range and are dropped (jnp would wrap a negative index).
  idx = jnp.where(mask, blocks, num_blocks)
  return jnp.zeros(num_blocks, jnp.int32).at[idx].add(1, mode="drop")


def _free_order_N(state: AllocatorState) -> jax.Array:
  """i32[N] block ids: free blocks first, least recently used first, then by id."""
  key_N = jnp.where(state.ref_counts > 0, _INT32_MAX, state.last_used)
  return jnp.argsort(key_N, stable=True).astype(jnp.int32)


def _first_of_order_N(order_N: jax.Array, count) -> jax.Array:
  """bool[N]: the blocks at positions ``[0, count)`` of ``order_N``."""
  n = order_N.shape[0]
  return jnp.zeros(n, jnp.bool_).at[order_N].set(jnp.arange(n) < count)


def _grant_in_order(need_X: jax.Array, valid_X: jax.Array, num_free) -> jax.Array:
  """bool[X]: valid requests granted while the running sum of demand fits ``num_free``."""
  demand_X = jnp.where(valid_X, need_X, 0)
  return valid_X & ((demand_X == 0) | (jnp.cumsum(demand_X) <= num_free))


# ----------------------------------------------------------------------------- ops


def init(num_blocks: int, block_size: int, max_seqs: int,
         max_blocks_per_seq: int) -> AllocatorState:
  """An empty allocator: every block free, every sequence slot empty."""
  num_blocks = _check_positive_int("num_blocks", num_blocks)
  block_size = _check_positive_int("block_size", block_size)
  max_seqs = _check_positive_int("max_seqs", max_seqs)
  max_blocks_per_seq = _check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
  if num_blocks * block_size > _INT32_MAX:
    raise ValueError(f"num_blocks * block_size={num_blocks * block_size} must be <= "
                     f"{_INT32_MAX} (slot ids are int32)")
  if max_blocks_per_seq * block_size > _INT32_MAX:
    raise ValueError(f"max_blocks_per_seq * block_size={max_blocks_per_seq * block_size} must "
                     f"be <= {_INT32_MAX} (sequence lengths are int32)")
  return AllocatorState(
      block_tables=jnp.full((max_seqs, max_blocks_per_seq), NO_BLOCK, jnp.int32),
      seq_lens=jnp.zeros(max_seqs, jnp.int32),
      ref_counts=jnp.zeros(num_blocks, jnp.int32),
      num_free=jnp.int32(num_blocks),
      last_used=jnp.zeros(num_blocks, jnp.int32),
      clock=jnp.int32(0),
      block_size=block_size,
  )


def append(state: AllocatorState, num_new_tokens) -> tuple[AllocatorState, jax.Array]:
  """Grow every sequence at once by ``num_new_tokens`` i32[S] tokens.

  Returns ``(state, ok_S)``, ok bool[S]. All-or-nothing per sequence: a sequence that does not
  get every block it needs gets none, keeps its ``seq_len`` and has ok False. A request is
  refused when negative or beyond ``max_blocks_per_seq`` blocks; blocks are granted in slot
  order while the running demand fits ``num_free`` (module docstring). 0 is always ok.
  """
  n_S = _check_vector("num_new_tokens", num_new_tokens, state.max_seqs, "int")
  z, p = state.block_size, state.max_blocks_per_seq
  len_S = state.seq_lens
  # n <= P * Z - len rather than len + n <= P * Z: no int32 overflow for huge requests.
  valid_S = (n_S >= 0) & (n_S <= p * z - len_S)
  new_len_S = jnp.where(valid_S, len_S + n_S, len_S)
  have_S = _blocks_for(len_S, z)
  need_S = _blocks_for(new_len_S, z) - have_S
  ok_S = _grant_in_order(need_S, valid_S, state.num_free)
  grant_S = jnp.where(ok_S, need_S, 0)
  end_S = jnp.cumsum(grant_S)
  start_S = end_S - grant_S  # sequence s takes free-order positions [start_s, end_s)
  total = end_S[-1]

  order_N = _free_order_N(state)
  j_P = jnp.arange(p, dtype=jnp.int32)
  new_SP = (j_P >= have_S[:, None]) & (j_P < (have_S + grant_S)[:, None])
  rank_SP = jnp.clip(start_S[:, None] + j_P - have_S[:, None], 0, state.num_blocks - 1)
  block_tables = jnp.where(new_SP, order_N[rank_SP], state.block_tables)
  taken_N = _first_of_order_N(order_N, total)
  new_state = dataclasses.replace(
      state,
      block_tables=block_tables,
      seq_lens=jnp.where(ok_S, new_len_S, len_S),
      ref_counts=jnp.where(taken_N, 1, state.ref_counts),
      num_free=state.num_free - total,
      last_used=jnp.where(taken_N, state.clock, state.last_used),
      clock=state.clock + 1,
  )
  return new_state, ok_S


def slots(state: AllocatorState, seq_ids, positions) -> jax.Array:
  """Flat slot ids ``block_id * Z + position % Z`` for writing K/V (``KVCache.write``).

  ``seq_ids`` and ``positions`` are integer arrays of any broadcastable shapes; the result has
  their broadcast shape. A position outside ``[0, seq_lens[seq])``, a sequence id outside
  ``[0, S)`` or a ``NO_BLOCK`` entry gives ``PAD_SLOT`` (negative): never a clamped real slot.
  Call it after ``append`` so the new tokens are inside ``seq_lens``.
  """
  seq_ids, positions = jnp.asarray(seq_ids), jnp.asarray(positions)
  for name, x in (("seq_ids", seq_ids), ("positions", positions)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
  seq_ids, positions = jnp.broadcast_arrays(seq_ids.astype(jnp.int32),
                                            positions.astype(jnp.int32))
  z, s, p = state.block_size, state.max_seqs, state.max_blocks_per_seq
  seq_c = jnp.clip(seq_ids, 0, s - 1)
  valid = (seq_ids >= 0) & (seq_ids < s) & (positions >= 0) & (positions < state.seq_lens[seq_c])
  block = state.block_tables[seq_c, jnp.clip(positions // z, 0, p - 1)]
  valid &= block != NO_BLOCK
  return jnp.where(valid, block * z + positions % z, PAD_SLOT)


def release(state: AllocatorState, mask) -> AllocatorState:
  """Drop the sequences with ``mask`` bool[S] True: ref count - 1 for each of their blocks (a
  block reaching 0 is free again), their rows become ``NO_BLOCK`` and their lengths 0."""
  m_S = _check_vector("mask", mask, state.max_seqs, "bool")
  drop_SP = m_S[:, None] & (state.block_tables != NO_BLOCK)
  ref_counts = state.ref_counts - _count_N(state.block_tables, drop_SP, state.num_blocks)
  freed_N = (state.ref_counts > 0) & (ref_counts == 0)
  return dataclasses.replace(
      state,
      block_tables=jnp.where(m_S[:, None], NO_BLOCK, state.block_tables),
      seq_lens=jnp.where(m_S, 0, state.seq_lens),
      ref_counts=ref_counts,
      num_free=state.num_free + jnp.sum(freed_N, dtype=jnp.int32),
      last_used=jnp.where(freed_N, state.clock, state.last_used),
      clock=state.clock + 1,
  )


def fork(state: AllocatorState, src,
         dst) -> tuple[AllocatorState, jax.Array, jax.Array, jax.Array]:
  """Make each sequence ``dst_F[f]`` a copy of sequence ``src_F[f]`` (i32[F] each).

  The copy shares every FULL block of src (ref count + 1); src's partial last block, if any,
  is copied into a fresh block: ``(copy_src_F[f], copy_dst_F[f])`` is the pair to pass to
  ``KVCache.copy_blocks`` (``NO_BLOCK`` where nothing is copied). All forks read the state
  from before the call. A fork fails (ok False, changes nothing) when src or dst is outside
  ``[0, S)``, src == dst, dst is not empty (seq_len 0, no block), dst appears more than once
  in the batch (every such fork fails), or its tail block does not fit (granted in batch order
  while the running demand fits ``num_free``). Several forks of one src are fine.

  Returns ``(state, ok_F, copy_src_F, copy_dst_F)``.
  """
  src_F, dst_F = jnp.asarray(src), jnp.asarray(dst)
  if src_F.ndim != 1:
    raise ValueError(f"src.shape={tuple(src_F.shape)} must be rank 1 ([F])")
  src_F = _check_vector("src", src_F, src_F.shape[0], "int")
  dst_F = _check_vector("dst", dst_F, src_F.shape[0], "int")
  z, s, p, n = state.block_size, state.max_seqs, state.max_blocks_per_seq, state.num_blocks
  src_in_F = (src_F >= 0) & (src_F < s)
  dst_in_F = (dst_F >= 0) & (dst_F < s)
  src_c, dst_c = jnp.clip(src_F, 0, s - 1), jnp.clip(dst_F, 0, s - 1)
  dst_empty_F = (state.seq_lens[dst_c] == 0) & (state.block_tables[dst_c, 0] == NO_BLOCK)
  dst_uses_S = jnp.zeros(s, jnp.int32).at[jnp.where(dst_in_F, dst_F, s)].add(1, mode="drop")
  valid_F = (src_in_F & dst_in_F & (src_F != dst_F) & dst_empty_F & (dst_uses_S[dst_c] == 1))

  len_F = state.seq_lens[src_c]
  full_F = len_F // z
  need_F = (len_F % z != 0).astype(jnp.int32)
  ok_F = _grant_in_order(need_F, valid_F, state.num_free)
  copy_F = ok_F & (need_F == 1)
  grant_F = copy_F.astype(jnp.int32)
  rank_F = jnp.cumsum(grant_F) - grant_F  # fork f takes free-order position rank_f
  total = jnp.sum(grant_F)
  order_N = _free_order_N(state)
  new_block_F = order_N[jnp.clip(rank_F, 0, n - 1)]

  row_FP = state.block_tables[src_c]
  j_P = jnp.arange(p, dtype=jnp.int32)
  share_FP = ok_F[:, None] & (j_P < full_F[:, None])
  tail_FP = copy_F[:, None] & (j_P == full_F[:, None])
  new_row_FP = jnp.where(share_FP, row_FP, jnp.where(tail_FP, new_block_F[:, None], NO_BLOCK))
  dst_ok_F = jnp.where(ok_F, dst_F, s)  # failed forks are dropped by the scatters
  taken_N = _first_of_order_N(order_N, total)
  new_state = dataclasses.replace(
      state,
      block_tables=state.block_tables.at[dst_ok_F].set(new_row_FP, mode="drop"),
      seq_lens=state.seq_lens.at[dst_ok_F].set(len_F, mode="drop"),
      ref_counts=(state.ref_counts + _count_N(row_FP, share_FP, n) + taken_N.astype(jnp.int32)),
      num_free=state.num_free - total,
      last_used=jnp.where(taken_N, state.clock, state.last_used),
      clock=state.clock + 1,
  )
  tail_src_F = jnp.take_along_axis(row_FP, jnp.clip(full_F, 0, p - 1)[:, None], axis=1)[:, 0]
  copy_src_F = jnp.where(copy_F, tail_src_F, NO_BLOCK)
  copy_dst_F = jnp.where(copy_F, new_block_F, NO_BLOCK)
  return new_state, ok_F, copy_src_F, copy_dst_F


def preempt(state: AllocatorState, priority, needed) -> tuple[AllocatorState, jax.Array]:
  """Release whole sequences, smallest ``priority`` i32[S] first (ties: higher slot index
  first), until ``num_free >= needed`` (i32[] blocks) or no sequence holding blocks is left.

  A shared block comes free only with its last holder. Releasing the first k sequences of the
  order frees exactly the blocks whose holders all rank < k, i.e. whose highest holder rank is
  < k; a scatter-max over the table entries and a cumsum give the blocks freed by every
  prefix at once, and the shortest prefix reaching ``needed`` is released. Returns
  ``(state, preempted_S)``; nothing is released when ``num_free >= needed`` already.
  """
  prio_S = _check_vector("priority", priority, state.max_seqs, "int")
  needed = jnp.asarray(needed)
  if needed.ndim != 0 or not jnp.issubdtype(needed.dtype, jnp.integer):
    raise ValueError(f"needed (shape {needed.shape}, dtype {needed.dtype}) must be an "
                     f"integer scalar")
  s, n = state.max_seqs, state.num_blocks
  holds_S = state.block_tables[:, 0] != NO_BLOCK
  slot_S = jnp.arange(s, dtype=jnp.int32)
  # lexsort: the last key is the primary one. Holders first, then priority, then slot desc.
  order_S = jnp.lexsort((-slot_S, prio_S, (~holds_S).astype(jnp.int32)))
  rank_S = jnp.zeros(s, jnp.int32).at[order_S].set(slot_S)
  in_SP = state.block_tables != NO_BLOCK
  rank_SP = jnp.broadcast_to(rank_S[:, None], in_SP.shape)
  last_rank_N = jnp.full(n, -1, jnp.int32).at[jnp.where(in_SP, state.block_tables, n)].max(
      rank_SP, mode="drop")
  freed_at_S = jnp.zeros(s, jnp.int32).at[jnp.where(last_rank_N >= 0, last_rank_N, s)].add(
      1, mode="drop")
  freed_by_S = jnp.cumsum(freed_at_S)  # blocks freed by releasing ranks 0..r
  deficit = needed.astype(jnp.int32) - state.num_free
  k = jnp.where(deficit <= 0, 0, jnp.sum(freed_by_S < deficit, dtype=jnp.int32) + 1)
  preempted_S = holds_S & (rank_S < k)
  return release(state, preempted_S), preempted_S


def utilization(state: AllocatorState) -> jax.Array:
  """f32[]: tokens stored / (blocks in use * Z); 1.0 when no block is in use.

  Each physical token slot counts once (a shared block is one block, full). Only the partial
  last block of each sequence has unused slots, and it is never shared, so the waste is
  ``sum over sequences of (-seq_len) mod Z`` <= (Z - 1) per sequence.
  """
  z = state.block_size
  used = state.num_blocks - state.num_free
  waste = jnp.sum((-state.seq_lens) % z)
  capacity = (used * z).astype(jnp.float32)
  return jnp.where(used > 0, 1.0 - waste / jnp.maximum(capacity, 1.0), 1.0).astype(jnp.float32)


# ----------------------------------------------------------------------------- host checks


def validate(state: AllocatorState) -> None:
  """Host-side: raise ``ValueError`` naming the first broken invariant of ``state``."""
  tables_SP = np.asarray(state.block_tables)
  len_S = np.asarray(state.seq_lens)
  rc_N = np.asarray(state.ref_counts)
  num_free = int(state.num_free)
  last_used_N = np.asarray(state.last_used)
  clock = int(state.clock)
  z = state.block_size
  if tables_SP.ndim != 2:
    raise ValueError(f"block_tables.shape={tables_SP.shape} must be [S, P]")
  s, p = tables_SP.shape
  n = rc_N.shape[0]
  for name, x, shape in (("seq_lens", len_S, (s,)), ("ref_counts", rc_N, (n,)),
                         ("last_used", last_used_N, (n,))):
    if x.shape != shape:
      raise ValueError(f"{name}.shape={x.shape} must be {shape}")
  for name, x in (("block_tables", tables_SP), ("seq_lens", len_S), ("ref_counts", rc_N),
                  ("last_used", last_used_N)):
    if x.dtype != np.int32:
      raise ValueError(f"{name}.dtype={x.dtype} must be int32")

  bad = np.argwhere((tables_SP != NO_BLOCK) & ((tables_SP < 0) | (tables_SP >= n)))
  if bad.size:
    i, j = bad[0]
    raise ValueError(f"block_tables[{i}, {j}]={tables_SP[i, j]} must be NO_BLOCK={NO_BLOCK} "
                     f"or in [0, num_blocks={n})")
  bad = np.flatnonzero((len_S < 0) | (len_S > p * z))
  if bad.size:
    i = bad[0]
    raise ValueError(f"seq_lens[{i}]={len_S[i]} must be in [0, P * Z={p * z}]")
  blocks_S = (len_S + z - 1) // z
  real_SP = tables_SP != NO_BLOCK
  expect_SP = np.arange(p)[None, :] < blocks_S[:, None]
  bad = np.argwhere(real_SP != expect_SP)
  if bad.size:
    i, j = bad[0]
    raise ValueError(f"block_tables[{i}, {j}]={tables_SP[i, j]}: row {i} with seq_lens[{i}]="
                     f"{len_S[i]} must hold exactly ceil({len_S[i]} / {z})={blocks_S[i]} "
                     f"leading blocks, then NO_BLOCK")
  for i in range(s):
    row = tables_SP[i, :blocks_S[i]]
    if np.unique(row).size != row.size:
      raise ValueError(f"block_tables[{i}]={row.tolist()} names a block twice")

  count_N = np.bincount(tables_SP[real_SP], minlength=n)
  bad = np.flatnonzero(count_N != rc_N)
  if bad.size:
    b = bad[0]
    raise ValueError(f"ref_counts[{b}]={rc_N[b]} but {count_N[b]} block-table entries name "
                     f"block {b}")
  in_use = int(np.sum(rc_N > 0))
  if num_free + in_use != n:
    raise ValueError(f"num_free={num_free} + blocks in use={in_use} must equal num_blocks={n}")

  # A partial last block is never shared: appends write into it without copy-on-write.
  partial_S = np.flatnonzero(len_S % z != 0)
  tail_S = tables_SP[partial_S, blocks_S[partial_S] - 1]
  bad = np.flatnonzero(rc_N[tail_S] != 1)
  if bad.size:
    i, b = partial_S[bad[0]], tail_S[bad[0]]
    raise ValueError(f"partial last block {b} of sequence {i} has ref_counts[{b}]={rc_N[b]}, "
                     f"must be 1 (only full blocks are shared)")
  # Free order: stamps come from the clock.
  bad = np.flatnonzero((last_used_N < 0) | (last_used_N > clock))
  if bad.size:
    b = bad[0]
    raise ValueError(f"last_used[{b}]={last_used_N[b]} must be in [0, clock={clock}]")
