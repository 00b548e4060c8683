"""Functional block allocator: the KV block manager as immutable JAX arrays, inside ``jit``.

All state lives in one pytree, ``AllocatorState``; every op is a pure function returning a new
state, jit-able with static shapes and vectorised over sequences and blocks (cumsum, sort,
scatter and gather formulations; no Python loop and no ``fori_loop``/``while_loop``/``scan``).
Each op does at most O(N + S * P) work plus, rarely, one sort of N block keys (the free
order below); the common cases cost O(S * P): an ``append`` that takes no block, a
``register`` extending chains already registered.

State (glossary letters: S sequences = ``max_seqs``, P = ``max_blocks_per_seq``, N blocks,
Z = ``block_size``):

    block_tables  i32[S, P]  physical block of each logical block; unused entries NO_BLOCK
                             (i32[g, S, P] with several KV groups, below)
    seq_lens      i32[S]     tokens of each sequence (row s holds ceil(seq_lens[s] / Z) blocks;
                             a sliding group's row only its last ones)
    ref_counts    i32[N]     block-table entries naming each block; 0 means the block is free
    num_free      i32[]      blocks with ref_counts == 0
    last_used     i32[N]     clock stamp of the op that last allocated or freed each block
    clock         i32[]      incremented by every state-changing op (``append`` rebases it and
                             the stamps before it could overflow: ``_rebase_clock``)
    block_size    int        static metadata (Z)
    windows       tuple      static: each KV group's sliding window, None for full attention

KV groups (g). Layers of one attention kind form a group: full attention, or a sliding
window W (``init(..., windows=(None, W, ...))``, one entry per group; default one full
group). Groups are a dimension of the same arrays: each group has its own block table per
sequence (``block_tables`` i32[g, S, P]; i32[S, P] when g == 1, the contract's shape) and
all groups draw from the one pool of N blocks of Z tokens (a block holds the K/V of its
group's layers only). ``seq_lens`` is shared: every group holds the same tokens. A new
logical block needs one block in every group, so the demand of a request is g times its
logical blocks, all-or-nothing across groups. A sliding group gives a block back once every
query that can still come lies beyond its window (``slide``, run first by ``append``): the
tokens below ``seq_len`` are computed, so a query still to come sits at ``seq_len`` or
later and reads from ``seq_len - W + 1``; the blocks wholly before that become
``NO_BLOCK`` in its row. Its row is therefore one contiguous run of blocks ending at the
last logical block, and the partial last block is always inside it. Forks share the run
and copy the partial tail in every group; preemption and release drop every group's
blocks. Prefix caching (below) follows one chain per prefix, in the *anchor* group (the
first full-attention group); every other group registers its block of each level beside
the anchor's (a sibling link) and a hit of k blocks needs, in each of them, the blocks
the query at ``k * Z`` reads: all k in a full group, those from ``_keep_from_gS`` on in a
sliding one (their earlier blocks are not needed, and may long be evicted). With no full
group (every layer slides) there is no anchor: ``lookup`` finds nothing, ``attach`` takes
nothing and ``register`` registers nothing.

Free structure. There is no free list or stack: a block is free iff its ``ref_counts`` is 0,
and free blocks are handed out in the order of the key ``(last_used, block id)``: least
recently freed first, then the lowest id (``_free_order_N``, one stable sort, which
``_take`` runs only to take more than ``_SELECT_MAX`` blocks, or from a small pool: it
finds fewer in O(N) passes). An op that needs ``k`` blocks takes the first ``k`` of that
order, and each requester receives a contiguous range of it (exclusive cumsum of the
grants).

Prefix cache. A FULL block whose K/V are written can be *registered*: it then records the
content it holds so that later sequences whose token prefix matches can share it instead of
recomputing it (``lookup`` + ``attach``). Extra state, per block:

    block_hash_N     u32[N]     chained hash of the prefix the block ends (``chain_hashes``)
    depth_N          i32[N]     logical index of the block in its chain; -1 = not registered
    parent_N         i32[N]     physical block of the previous link (NO_BLOCK at depth 0)
    parent_gen_N     i32[N]     generation of that parent when this block was registered
    salt_N           i32[N]     cache salt of the registering sequence (tenants never mix)
    generation_N     i32[N]     bumped each time the block is handed out fresh
    block_tokens_NZ  i32[N, Z]  the token ids the registered block holds
    group_N          i32[N]     KV group of the registered block
    beside_gN        i32[g, N]  per anchor block, the block registered beside it in each
                                other group (NO_BLOCK where none; may be stale)

With KV groups the anchor's blocks form the chains above (only they enter the hash
table); a registered block of another group g has the anchor's block of its level as
``parent_N`` (and that block's generation as ``parent_gen_N``), and that anchor block
points to it (``beside_gN[g]``). A lookup follows the pointers from the anchor blocks it
confirmed and confirms each block found by its group, depth and salt and by the link back
with an unchanged generation: the anchor's chain (tokens and links) vouches for the whole
prefix, the link for the block having been written from that prefix by a sequence holding
the anchor block when it was registered, so its tokens need no second comparison and no
hash is involved (no lost hits; O(S * P) per extra group). A pointer left stale by an
eviction on either side fails that check.

The hash table is the registered (``block_hash_N``, block) pairs, scattered into buckets by
a mix of the hash (``_candidates``: no sort, O(N + S * P) per lookup), and every query block
is looked up at once. A hash only *proposes* a block; a
hit is confirmed by the block's stored tokens, depth and salt, and by its parent link: the
parent must be the block confirmed one level up, with an unchanged generation (a parent that
was evicted and reused since carries a new generation). A hash collision therefore costs a
miss, never a wrong reuse. Registration is canonical: a sequence's new full blocks chain off
the registered blocks its prefix matches (its own, or another sequence's copy of the same
prefix), and of several sequences registering the same new block in one call only the
first (slot order) does, so each prefix has one entry.

Freed registered blocks stay registered: free (ref count 0, counted in ``num_free``) but
*cached*, and ``attach`` can revive them (ref count 0 -> 1). The free order key is
``(registered, last_used, -depth, id)``: unregistered free blocks are handed out first; then
cached ones, least recently used first and, among blocks freed together, the deepest first,
so a chain shrinks from its tail. Handing a block out (``append``, ``fork``'s tail) evicts
it: it is unregistered and its generation bumped.

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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax._promotion import standard_promotion
from paged_jax.pallas_kernels import validation

NO_BLOCK = -1
"""Block-table entry of an unused logical block, and the `fork` copy id meaning "no copy"."""

PAD_SLOT = -1
"""Slot id returned by `slots` for padding; `KVCache.write` ignores negative slots."""

_INT32_MAX = int(np.iinfo(np.int32).max)

__all__ = ["NO_BLOCK", "PAD_SLOT", "AllocatorState", "init", "append", "slots", "release", "fork",
           "preempt", "utilization", "validate", "chain_hashes", "lookup", "attach", "register",
           "cached_N", "num_cached", "slide", "supports_prefix_caching"]


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
  # Prefix cache (module docstring).
  block_hash_N: jax.Array  # u32[N]
  depth_N: jax.Array  # i32[N]
  parent_N: jax.Array  # i32[N]
  parent_gen_N: jax.Array  # i32[N]
  salt_N: jax.Array  # i32[N]
  generation_N: jax.Array  # i32[N]
  block_tokens_NZ: jax.Array  # i32[N, Z]
  group_N: jax.Array  # i32[N]
  beside_gN: jax.Array  # i32[g, N]
  block_size: int = dataclasses.field(metadata=dict(static=True))
  # KV groups (module docstring): the sliding window of each group, None for full attention.
  windows: tuple = dataclasses.field(default=(None,), metadata=dict(static=True))

  @property
  def num_blocks(self) -> int:
    return self.ref_counts.shape[0]

  @property
  def max_seqs(self) -> int:
    """Static: sequence slots (S, the rows of each block table)."""
    return self.block_tables.shape[-2]

  @property
  def max_blocks_per_seq(self) -> int:
    """Static: block-table width (P)."""
    return self.block_tables.shape[-1]

  @property
  def num_groups(self) -> int:
    return len(self.windows)

  @property
  def slides(self) -> bool:
    """Static: whether any group has a sliding window (``slide`` then gives blocks back)."""
    return any(w is not None for w in self.windows)


# ----------------------------------------------------------------------------- helpers


def _check_state(state) -> None:
  if not isinstance(state, AllocatorState):
    raise ValueError(f"state={type(state).__name__} must be a paged_jax.allocator."
                     "AllocatorState (from allocator.init, or returned by an operation)")


def _state_op(fn):
  """An operation on an ``AllocatorState`` (its first argument, checked: anything else is a
  ``ValueError`` naming it), traced under JAX's default promotion modes."""
  wrapped = standard_promotion(fn)

  @functools.wraps(fn)
  def op(state, *args, **kwargs):
    _check_state(state)
    return wrapped(state, *args, **kwargs)

  return op


def _check_positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name}={value!r} must be an int > 0")
  return int(value)


def _check_vector(name: str, x, length: int, kind: str) -> jax.Array:
  """``x`` as an array of shape ``[length]``; kind "int" (cast to int32) or "bool"."""
  if kind == "int":
    validation.check_int32_range(name, x)
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


def _tables_gSP(state: AllocatorState) -> jax.Array:
  """The block tables with their group axis: i32[g, S, P] (g = 1 for a 2-D state)."""
  t = state.block_tables
  return t[None] if t.ndim == 2 else t


def _pack(state: AllocatorState, tables_gSP: jax.Array) -> jax.Array:
  """``tables_gSP`` in the state's own layout (i32[S, P] when it has one group)."""
  return tables_gSP[0] if state.block_tables.ndim == 2 else tables_gSP


def _anchor(state: AllocatorState):
  """Static: the group whose chains prefix hits follow (module docstring), the first
  full-attention group; None when every group slides (prefix caching is then off)."""
  return next((g for g, w in enumerate(state.windows) if w is None), None)


def supports_prefix_caching(windows) -> bool:
  """Whether a state of KV groups with these ``windows`` serves prefix caching: it needs a
  full-attention group (None) to anchor its chains (module docstring)."""
  return None in tuple(windows)


def _prefix_caching(state: AllocatorState) -> bool:
  return supports_prefix_caching(state.windows)


def _keep_from_gS(state: AllocatorState, len_S: jax.Array) -> jax.Array:
  """i32[g, S]: the first logical block a query at position ``len_S`` (or later) can read in
  each group: 0 for full attention, ``max(0, len - W + 1) // Z`` for a window W."""
  rows = [jnp.zeros_like(len_S) if w is None
          else jnp.maximum(len_S - (w - 1), 0) // state.block_size for w in state.windows]
  return jnp.stack(rows)


def _blocks_for(len_S: jax.Array, block_size: int) -> jax.Array:
  """Blocks needed to hold ``len_S`` tokens: ceil(len / Z)."""
  return (len_S + block_size - 1) // block_size


def _count_N(blocks, mask, num_blocks: int) -> jax.Array:
  """i32[N]: how many entries of ``blocks`` (any shape) with ``mask`` True name each block."""
  # Masked entries go out of range and are dropped (jnp would wrap a negative index).
  idx = jnp.where(mask, blocks, num_blocks)
  return jnp.zeros(num_blocks, jnp.int32).at[idx].add(1, mode="drop")


def _free_order_N(state: AllocatorState) -> jax.Array:
  """i32[N] block ids: free blocks first; among them unregistered ones, then cached ones;
  each group least recently used first, then the deepest chain link, then by id."""
  in_use_N = (state.ref_counts > 0).astype(jnp.int32)
  cached_N = (state.depth_N >= 0).astype(jnp.int32)
  ids_N = jnp.arange(state.num_blocks, dtype=jnp.int32)
  # lexsort: the last key is the primary one.
  return jnp.lexsort((ids_N, -state.depth_N, state.last_used, cached_N,
                      in_use_N)).astype(jnp.int32)


def _evict(state: AllocatorState, taken_N: jax.Array) -> dict:
  """Fields of a state whose blocks ``taken_N`` are handed out fresh: unregistered, a new
  generation (so no registered child can confirm them as its parent any more)."""
  return dict(depth_N=jnp.where(taken_N, -1, state.depth_N),
              generation_N=state.generation_N + taken_N.astype(jnp.int32))


def _first_of_order_N(order_N: jax.Array, count) -> jax.Array:
  """bool[N]: the blocks at positions ``[0, count)`` of ``order_N`` (entries N: none)."""
  n = order_N.shape[0]
  return jnp.zeros(n, jnp.bool_).at[order_N].set(jnp.arange(n) < count, mode="drop")


_SELECT_MAX = 1024
"""Static: the most blocks ``_take`` orders without sorting the pool (``_select``); a call
taking more (a prefill of over 16k tokens of blocks of 16 from a cycled pool) sorts it."""

_SORT_SMALL_POOL = 1024
"""Static: a pool of at most this many blocks is sorted rather than selected from (a sort
of 1024 keys costs about 0.3 ms on a CPU, and compiles faster than ``_select``)."""

_NARROW_WALK_FROM = 128
"""Static: rows of at least this many levels (2048 tokens of blocks of 16) are walked
narrowly where they can be (``lookup``'s short rows, ``register``'s ``window``); shorter
ones cost little whole, and one walk compiles faster than two."""


def _lowest_at_least(mask_N, value_N, need, lo, hi, steps: int):
  """The smallest v in ``[lo, hi]`` with at least ``need`` blocks of ``mask_N`` having
  ``value_N <= v`` (``hi`` when none is): a binary search of ``steps`` O(N) counts, unrolled
  (the allocator's ops have no loops)."""
  for _ in range(steps):
    mid = lo + (hi - lo) // 2
    enough = jnp.sum(mask_N & (value_N <= mid), dtype=jnp.int32) >= need
    lo, hi = jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)
  return hi


def _select(state: AllocatorState, count, ranks) -> tuple[jax.Array, jax.Array]:
  """``_take`` for ``count <= _SELECT_MAX`` blocks, in O(N) passes and a sort of only the
  blocks taken: the ``count``-th free block's key ``(cached, stamp, -depth, id)`` is found
  one field at a time (counts for ``cached``, binary searches over the values of ``stamp``
  and of ``-depth``, prefix sums over ids), the blocks at or below it are the taken set,
  and they alone are laid out in ``_SELECT_MAX`` entries and sorted."""
  n, size = state.num_blocks, min(state.num_blocks, _SELECT_MAX)
  big = jnp.iinfo(jnp.int32).max
  free_N = state.ref_counts == 0
  cached_N = state.depth_N >= 0
  neg_depth_N = -state.depth_N  # 1 for unregistered blocks, <= 0 for cached ones
  fresh = jnp.sum(free_N & ~cached_N, dtype=jnp.int32)
  level_cached = count > fresh
  in_level_N = free_N & (cached_N == level_cached)
  need = count - jnp.where(level_cached, fresh, 0)
  # The stamp of the last block taken, then its -depth among that stamp's blocks.
  stamp = _lowest_at_least(in_level_N, state.last_used, need, jnp.int32(0),
                           jnp.max(jnp.where(in_level_N, state.last_used, 0)), 32)
  need -= jnp.sum(in_level_N & (state.last_used < stamp), dtype=jnp.int32)
  in_stamp_N = in_level_N & (state.last_used == stamp)
  depth_steps = max(1, int(np.ceil(np.log2(state.max_blocks_per_seq + 2))) + 1)
  neg_depth = _lowest_at_least(in_stamp_N, neg_depth_N, need,
                               jnp.int32(-state.max_blocks_per_seq), jnp.int32(1),
                               depth_steps)
  need -= jnp.sum(in_stamp_N & (neg_depth_N < neg_depth), dtype=jnp.int32)
  in_class_N = in_stamp_N & (neg_depth_N == neg_depth)
  before_N = free_N & ((cached_N < level_cached)
                       | ((cached_N == level_cached)
                          & ((state.last_used < stamp)
                             | ((state.last_used == stamp) & (neg_depth_N < neg_depth)))))
  taken_N = (before_N | (in_class_N & (jnp.cumsum(in_class_N, dtype=jnp.int32) <= need)))
  taken_N &= count > 0
  ids_N = jnp.arange(n, dtype=jnp.int32)
  slot_N = jnp.where(taken_N, jnp.cumsum(taken_N, dtype=jnp.int32) - 1, size)
  ids_n = jnp.full(size, n, jnp.int32).at[slot_N].set(ids_N, mode="drop")
  used_n = ids_n < n
  at_n = jnp.clip(ids_n, 0, n - 1)
  keys = (jnp.where(used_n, cached_N[at_n].astype(jnp.int32), big),
          jnp.where(used_n, state.last_used[at_n], big),
          jnp.where(used_n, neg_depth_N[at_n], big), ids_n)
  order_n = jax.lax.sort(keys, num_keys=4)[3]
  return order_n[jnp.clip(jnp.asarray(ranks, jnp.int32), 0, size - 1)], taken_N


def _take(state: AllocatorState, count, ranks) -> tuple[jax.Array, jax.Array]:
  """``(blocks, taken_N)``: the blocks at positions ``ranks`` (any shape, each < ``count``
  where used) of the free order ``_free_order_N(state)``, and bool[N] its first ``count``.

  When the free, unregistered blocks of the two oldest ``last_used`` stamps hold ``count``
  blocks (a big pool's never-used blocks share stamp 0; a release frees a sequence's
  blocks under one stamp), prefix sums rank them by (stamp, id) exactly as the sort would,
  one scatter lays them out by rank and one gather reads each of ``ranks``: a few O(N)
  passes and O(1) per rank (a binary search per rank cost log N gathers for each entry of
  an append's [g, S, P] ranks, most of a long-context decode step). Otherwise (a pool that
  has cycled holds mostly cached blocks, freed under many stamps) ``_select`` finds the
  taken set in O(N) passes and sorts only it; the O(N log N) sort of the whole pool runs
  only for more than ``_SELECT_MAX`` blocks, or in a pool of at most ``_SORT_SMALL_POOL``."""
  n = state.num_blocks
  fresh_N = (state.ref_counts == 0) & (state.depth_N < 0)
  big = jnp.iinfo(jnp.int32).max
  stamp_N = jnp.where(fresh_N, state.last_used, big)
  first = jnp.min(stamp_N)
  second = jnp.min(jnp.where(stamp_N > first, stamp_N, big))
  in_first_N = fresh_N & (stamp_N == first)
  in_second_N = fresh_N & (stamp_N == second) & (second > first)
  num_first = jnp.sum(in_first_N, dtype=jnp.int32)
  enough = num_first + jnp.sum(in_second_N, dtype=jnp.int32) >= count

  def two_groups():
    # The prefix sums only here: a cycled pool's calls take the other branch.
    cum_first_N = jnp.cumsum(in_first_N, dtype=jnp.int32)
    cum_second_N = jnp.cumsum(in_second_N, dtype=jnp.int32)
    rank_N = jnp.where(in_first_N, cum_first_N - 1,
                       jnp.where(in_second_N, num_first + cum_second_N - 1, n))
    by_rank_N = jnp.zeros(n, jnp.int32).at[rank_N].set(jnp.arange(n, dtype=jnp.int32),
                                                       mode="drop")
    blocks = by_rank_N[jnp.clip(jnp.asarray(ranks, jnp.int32), 0, n - 1)]
    taken_N = rank_N < count
    return blocks, taken_N

  def sorted_pool():
    order_N = _free_order_N(state)
    return order_N[jnp.clip(ranks, 0, n - 1)], _first_of_order_N(order_N, count)

  def not_two_groups():
    if n <= _SORT_SMALL_POOL:
      return sorted_pool()
    return jax.lax.cond(count <= _SELECT_MAX, lambda: _select(state, count, ranks),
                        sorted_pool)

  return jax.lax.cond(enough, two_groups, not_two_groups)


def _grant_in_order(need_X: jax.Array, valid_X: jax.Array, num_free) -> jax.Array:
  """bool[X]: valid requests granted while the running sum of demand fits ``num_free``."""
  demand_X = jnp.where(valid_X, need_X, 0)
  return valid_X & ((demand_X == 0) | (jnp.cumsum(demand_X) <= num_free))


# ----------------------------------------------------------------------------- ops


@standard_promotion
def init(num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int, *,
         windows=None) -> AllocatorState:
  """An empty allocator: every block free, every sequence slot empty.

  ``windows``: one entry per KV group, None (full attention) or the group's sliding window
  W (an int > 0); default ``(None,)``, one full group. With one group ``block_tables`` is
  i32[S, P]; with several it is i32[g, S, P].
  """
  windows = (None,) if windows is None else tuple(windows)
  if not windows:
    raise ValueError(f"windows={windows!r} must name at least one group")
  for g, w in enumerate(windows):
    if w is not None:
      _check_positive_int(f"windows[{g}]", w)
  windows = tuple(None if w is None else int(w) for w in windows)
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
  groups = () if len(windows) == 1 else (len(windows),)
  return AllocatorState(
      block_tables=jnp.full(groups + (max_seqs, max_blocks_per_seq), NO_BLOCK, jnp.int32),
      seq_lens=jnp.zeros(max_seqs, jnp.int32),
      ref_counts=jnp.zeros(num_blocks, jnp.int32),
      num_free=jnp.int32(num_blocks),
      last_used=jnp.zeros(num_blocks, jnp.int32),
      clock=jnp.int32(0),
      block_hash_N=jnp.zeros(num_blocks, jnp.uint32),
      depth_N=jnp.full(num_blocks, -1, jnp.int32),
      parent_N=jnp.full(num_blocks, NO_BLOCK, jnp.int32),
      parent_gen_N=jnp.zeros(num_blocks, jnp.int32),
      salt_N=jnp.zeros(num_blocks, jnp.int32),
      generation_N=jnp.zeros(num_blocks, jnp.int32),
      block_tokens_NZ=jnp.zeros((num_blocks, block_size), jnp.int32),
      group_N=jnp.zeros(num_blocks, jnp.int32),
      beside_gN=jnp.full((len(windows), num_blocks), NO_BLOCK, jnp.int32),
      block_size=block_size,
      windows=windows,
  )


@_state_op
def slide(state: AllocatorState) -> AllocatorState:
  """Give back, in every sliding group, the blocks no query still to come can read.

  The tokens below ``seq_lens`` are computed, so every query still to come sits at position
  ``seq_len`` or later and, with window W, reads keys at ``seq_len - W + 1`` or later: the
  blocks wholly before that (``_keep_from_gS``) are dropped (ref count - 1; free at 0) and
  their entries become ``NO_BLOCK``. Full groups keep everything; a state with no sliding
  group is returned as it is. ``append`` slides first; call it alone to see the free count
  that the next ``append`` will find.
  """
  if not state.slides:
    return state
  t_gSP = _tables_gSP(state)
  j_P = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)
  drop_gSP = ((j_P < _keep_from_gS(state, state.seq_lens)[..., None]) & (t_gSP != NO_BLOCK))

  def give_back(state):
    ref_counts = state.ref_counts - _count_N(t_gSP, drop_gSP, state.num_blocks)
    freed_N = (state.ref_counts > 0) & (ref_counts == 0)
    return dataclasses.replace(
        state,
        block_tables=_pack(state, jnp.where(drop_gSP, NO_BLOCK, t_gSP)),
        ref_counts=ref_counts,
        num_free=state.num_free + jnp.sum(freed_N, dtype=jnp.int32),
        last_used=jnp.where(freed_N, state.clock, state.last_used))

  # Most calls find nothing behind a window (a block leaves it once every Z tokens): the
  # pass over the pool runs only when some block is given back.
  state = jax.lax.cond(jnp.any(drop_gSP), give_back, lambda state: state, state)
  return dataclasses.replace(state, clock=state.clock + 1)


_CLOCK_REBASE_AT = 1 << 30  # ~12 days of serving at 1,000 ops/s; int32 overflows at 2**31
_CLOCK_KEEP = 1 << 20  # the clock after a rebase: the newest 2**20 stamps keep their order


def _rebase_clock(state: AllocatorState) -> AllocatorState:
  """Once the clock passes 2**30, shift it and every ``last_used`` stamp down by the same
  amount (stamps older than the last 2**20 ops become 0: tied, then ordered by id), so the
  int32 clock never wraps and the LRU order of recent blocks is kept; O(1) otherwise."""

  def rebase(state):
    shift = state.clock - _CLOCK_KEEP
    return dataclasses.replace(state, clock=state.clock - shift,
                               last_used=jnp.maximum(state.last_used - shift, 0))

  return jax.lax.cond(state.clock >= _CLOCK_REBASE_AT, rebase, lambda state: state, state)


@_state_op
def append(state: AllocatorState, num_new_tokens) -> tuple[AllocatorState, jax.Array]:
  """Grow every sequence at once by ``num_new_tokens`` i32[S] tokens.

  Returns ``(state, ok_S)``, ok bool[S]. All-or-nothing per sequence: a sequence that does not
  get every block it needs (one per new logical block in every group) gets none, keeps its
  ``seq_len`` and has ok False. A request is refused when negative or beyond
  ``max_blocks_per_seq`` blocks; blocks are granted in slot order while the running demand
  fits ``num_free`` (module docstring). 0 is always ok. Sliding groups first give back the
  blocks behind their windows (``slide``), so the demand is met from those too.
  """
  n_S = _check_vector("num_new_tokens", num_new_tokens, state.max_seqs, "int")
  state = slide(_rebase_clock(state))
  z, p, g = state.block_size, state.max_blocks_per_seq, state.num_groups
  len_S = state.seq_lens
  # n <= P * Z - len rather than len + n <= P * Z: no int32 overflow for huge requests.
  valid_S = (n_S >= 0) & (n_S <= p * z - len_S)
  new_len_S = jnp.where(valid_S, len_S + n_S, len_S)
  have_S = _blocks_for(len_S, z)
  need_S = _blocks_for(new_len_S, z) - have_S  # per group
  ok_S = _grant_in_order(g * need_S, valid_S, state.num_free)
  grant_S = jnp.where(ok_S, need_S, 0)
  end_S = jnp.cumsum(g * grant_S)
  start_S = end_S - g * grant_S  # sequence s takes free-order positions [start_s, end_s)
  total = end_S[-1]

  j_P = jnp.arange(p, dtype=jnp.int32)
  g_g = jnp.arange(g, dtype=jnp.int32)
  new_SP = (j_P >= have_S[:, None]) & (j_P < (have_S + grant_S)[:, None])
  # Group g of sequence s takes positions [start_s + g * grant_s, start_s + (g + 1) * grant_s).
  rank_gSP = jnp.clip(start_S[None, :, None] + g_g[:, None, None] * grant_S[None, :, None]
                      + j_P - have_S[None, :, None], 0, state.num_blocks - 1)

  def take(state):
    new_block_gSP, taken_N = _take(state, total, rank_gSP)
    return dataclasses.replace(
        state,
        block_tables=_pack(state, jnp.where(new_SP, new_block_gSP, _tables_gSP(state))),
        ref_counts=jnp.where(taken_N, 1, state.ref_counts),
        last_used=jnp.where(taken_N, state.clock, state.last_used),
        **_evict(state, taken_N))

  # Most decode steps cross no block boundary: the pass over the pool runs only when some
  # block is taken, so a step's cost follows its tokens, not the pool.
  state = jax.lax.cond(total > 0, take, lambda state: state, state)
  new_state = dataclasses.replace(
      state,
      seq_lens=jnp.where(ok_S, new_len_S, len_S),
      num_free=state.num_free - total,
      clock=state.clock + 1,
  )
  return new_state, ok_S


@_state_op
def slots(state: AllocatorState, seq_ids, positions) -> jax.Array:
  """Flat slot ids ``block_id * Z + position % Z`` for writing K/V (``KVCache.write``).

  ``seq_ids`` and ``positions`` are integer arrays of any broadcastable shapes; the result has
  their broadcast shape. A position outside ``[0, seq_lens[seq])``, a sequence id outside
  ``[0, S)`` or a ``NO_BLOCK`` entry gives ``PAD_SLOT`` (negative): never a clamped real slot.
  Call it after ``append`` so the new tokens are inside ``seq_lens``. With several groups
  the result has a leading g axis: each group's slots (its blocks differ).
  """
  for name, x in (("seq_ids", seq_ids), ("positions", positions)):
    validation.check_int32_range(name, x)
  seq_ids, positions = jnp.asarray(seq_ids), jnp.asarray(positions)
  for name, x in (("seq_ids", seq_ids), ("positions", positions)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
  try:
    shape = jnp.broadcast_shapes(seq_ids.shape, positions.shape)
  except ValueError:
    raise ValueError(f"seq_ids.shape={tuple(seq_ids.shape)} and positions.shape="
                     f"{tuple(positions.shape)} must broadcast together") from None
  seq_ids = jnp.broadcast_to(seq_ids.astype(jnp.int32), shape)
  positions = jnp.broadcast_to(positions.astype(jnp.int32), shape)
  z, s, p = state.block_size, state.max_seqs, state.max_blocks_per_seq
  seq_c = jnp.clip(seq_ids, 0, s - 1)
  valid = (seq_ids >= 0) & (seq_ids < s) & (positions >= 0) & (positions < state.seq_lens[seq_c])
  block = _tables_gSP(state)[:, seq_c, jnp.clip(positions // z, 0, p - 1)]
  valid = valid & (block != NO_BLOCK)
  out = jnp.where(valid, block * z + positions % z, PAD_SLOT)
  return out[0] if state.block_tables.ndim == 2 else out


@_state_op
def release(state: AllocatorState, mask) -> AllocatorState:
  """Drop the sequences with ``mask`` bool[S] True: ref count - 1 for each of their blocks (a
  block reaching 0 is free again), their rows become ``NO_BLOCK`` and their lengths 0."""
  m_S = _check_vector("mask", mask, state.max_seqs, "bool")
  t_gSP = _tables_gSP(state)
  drop_gSP = m_S[:, None] & (t_gSP != NO_BLOCK)
  ref_counts = state.ref_counts - _count_N(t_gSP, drop_gSP, state.num_blocks)
  freed_N = (state.ref_counts > 0) & (ref_counts == 0)
  return dataclasses.replace(
      state,
      block_tables=_pack(state, jnp.where(m_S[:, None], NO_BLOCK, t_gSP)),
      seq_lens=jnp.where(m_S, 0, state.seq_lens),
      ref_counts=ref_counts,
      num_free=state.num_free + jnp.sum(freed_N, dtype=jnp.int32),
      last_used=jnp.where(freed_N, state.clock, state.last_used),
      clock=state.clock + 1,
  )


@_state_op
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

  Returns ``(state, ok_F, copy_src_F, copy_dst_F)``. With g groups each fork shares and
  copies in every group (its demand is g fresh tail blocks) and the copy pairs are
  i32[g * F], group-major (all of group 0's forks, then group 1's, ...).
  """
  validation.check_int32_range("src", src)
  validation.check_int32_range("dst", dst)
  src_F, dst_F = jnp.asarray(src), jnp.asarray(dst)
  if src_F.ndim != 1:
    raise ValueError(f"src.shape={tuple(src_F.shape)} must be rank 1 ([F])")
  src_F = _check_vector("src", src_F, src_F.shape[0], "int")
  dst_F = _check_vector("dst", dst_F, src_F.shape[0], "int")
  z, s, p, n = state.block_size, state.max_seqs, state.max_blocks_per_seq, state.num_blocks
  g = state.num_groups
  t_gSP = _tables_gSP(state)
  src_in_F = (src_F >= 0) & (src_F < s)
  dst_in_F = (dst_F >= 0) & (dst_F < s)
  src_c, dst_c = jnp.clip(src_F, 0, s - 1), jnp.clip(dst_F, 0, s - 1)
  dst_empty_F = ((state.seq_lens[dst_c] == 0)
                 & jnp.all(t_gSP[:, dst_c, 0] == NO_BLOCK, axis=0))
  dst_uses_S = jnp.zeros(s, jnp.int32).at[jnp.where(dst_in_F, dst_F, s)].add(1, mode="drop")
  valid_F = (src_in_F & dst_in_F & (src_F != dst_F) & dst_empty_F & (dst_uses_S[dst_c] == 1))

  len_F = state.seq_lens[src_c]
  full_F = len_F // z
  need_F = (len_F % z != 0).astype(jnp.int32)  # per group
  ok_F = _grant_in_order(g * need_F, valid_F, state.num_free)
  copy_F = ok_F & (need_F == 1)
  grant_F = g * copy_F.astype(jnp.int32)
  rank_F = jnp.cumsum(grant_F, dtype=jnp.int32) - grant_F  # fork f takes positions from rank_f
  total = jnp.sum(grant_F, dtype=jnp.int32)
  rank_gF = rank_F[None, :] + jnp.arange(g, dtype=jnp.int32)[:, None]
  new_block_gF, taken_N = _take(state, total, jnp.clip(rank_gF, 0, n - 1))

  row_gFP = t_gSP[:, src_c]
  j_P = jnp.arange(p, dtype=jnp.int32)
  # A sliding group's rows start with NO_BLOCK where it gave blocks back: nothing to share.
  share_gFP = ok_F[:, None] & (j_P < full_F[:, None]) & (row_gFP != NO_BLOCK)
  tail_FP = copy_F[:, None] & (j_P == full_F[:, None])
  new_row_gFP = jnp.where(share_gFP, row_gFP,
                          jnp.where(tail_FP, new_block_gF[:, :, None], NO_BLOCK))
  dst_ok_F = jnp.where(ok_F, dst_F, s)  # failed forks are dropped by the scatters
  new_state = dataclasses.replace(
      state,
      block_tables=_pack(state, t_gSP.at[:, dst_ok_F].set(new_row_gFP, mode="drop")),
      seq_lens=state.seq_lens.at[dst_ok_F].set(len_F, mode="drop"),
      ref_counts=(state.ref_counts + _count_N(row_gFP, share_gFP, n)
                  + taken_N.astype(jnp.int32)),
      num_free=state.num_free - total,
      last_used=jnp.where(taken_N, state.clock, state.last_used),
      clock=state.clock + 1,
      **_evict(state, taken_N),
  )
  tail_src_gF = jnp.take_along_axis(row_gFP, jnp.clip(full_F, 0, p - 1)[None, :, None],
                                    axis=2)[..., 0]
  copy_src = jnp.where(copy_F, tail_src_gF, NO_BLOCK).reshape(-1)
  copy_dst = jnp.where(copy_F, new_block_gF, NO_BLOCK).reshape(-1)
  return new_state, ok_F, copy_src, copy_dst


@_state_op
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
  validation.check_int32_range("needed", needed)
  needed = jnp.asarray(needed)
  if needed.ndim != 0 or not jnp.issubdtype(needed.dtype, jnp.integer):
    raise ValueError(f"needed.shape={tuple(needed.shape)}, needed.dtype={needed.dtype}: "
                     "must be an integer scalar (blocks)")
  s, n = state.max_seqs, state.num_blocks
  t_gSP = _tables_gSP(state)
  in_gSP = t_gSP != NO_BLOCK
  holds_S = jnp.any(in_gSP, axis=(0, 2))
  slot_S = jnp.arange(s, dtype=jnp.int32)
  # lexsort: the last key is the primary one. Holders first, then priority, then slot desc.
  order_S = jnp.lexsort((-slot_S, prio_S, (~holds_S).astype(jnp.int32)))
  rank_S = jnp.zeros(s, jnp.int32).at[order_S].set(slot_S)
  rank_gSP = jnp.broadcast_to(rank_S[:, None], in_gSP.shape)
  last_rank_N = jnp.full(n, -1, jnp.int32).at[jnp.where(in_gSP, t_gSP, n)].max(
      rank_gSP, mode="drop")
  freed_at_S = jnp.zeros(s, jnp.int32).at[jnp.where(last_rank_N >= 0, last_rank_N, s)].add(
      1, mode="drop")
  freed_by_S = jnp.cumsum(freed_at_S)  # blocks freed by releasing ranks 0..r
  deficit = needed.astype(jnp.int32) - state.num_free
  k = jnp.where(deficit <= 0, 0, jnp.sum(freed_by_S < deficit, dtype=jnp.int32) + 1)
  preempted_S = holds_S & (rank_S < k)
  return release(state, preempted_S), preempted_S


@_state_op
def utilization(state: AllocatorState) -> jax.Array:
  """f32[]: tokens stored / (blocks in use * Z); 1.0 when no block is in use.

  Each physical token slot counts once (a shared block is one block, full). Only the partial
  last block of each sequence has unused slots, and it is never shared, so the waste is
  ``sum over sequences of (-seq_len) mod Z`` <= (Z - 1) per sequence, in each of the g
  groups (a sliding group always holds the partial last block: it is inside every window).
  """
  z = state.block_size
  used = state.num_blocks - state.num_free
  waste = (state.num_groups * jnp.sum((-state.seq_lens) % z)).astype(jnp.float32)
  capacity = (used * z).astype(jnp.float32)
  return jnp.where(used > 0, 1.0 - waste / jnp.maximum(capacity, 1.0), 1.0).astype(jnp.float32)


# ----------------------------------------------------------------------------- prefix cache

_HASH_SEED = 0x5BD1E995
_CHAIN_MULT = 0x2545F491  # odd, so invertible modulo 2**32
_U32_MAX = 0xFFFFFFFF


def _fmix32(h: jax.Array) -> jax.Array:
  """A 32-bit avalanche finaliser (xor-shift-multiply), uint32 in and out."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _powers_u32(base: int, count: int) -> np.ndarray:
  out, x = [], 1
  for _ in range(count):
    out.append(x)
    x = x * base % 2**32
  return np.asarray(out, np.uint32)


@standard_promotion
def chain_hashes(tokens_SPZ: jax.Array, salt_S: jax.Array) -> jax.Array:
  """u32[S, P]: the chained hash of every block of every sequence (the default ``hash_fn``).

  Block j's hash covers its parent's and its own tokens: with ``c_j`` a hash of block j's Z
  tokens (each mixed with its offset) and ``h_-1`` one of the salt,
  ``h_j = R * h_{j-1} + c_j (mod 2**32)``, and the key is ``fmix(h_j)``. Unrolled,
  ``h_j = R**j * (R * h_-1 + sum_{i <= j} R**-i * c_i)`` (R is odd, so ``R**-1`` exists
  modulo 2**32): one cumsum computes every level at once, no loop over blocks. Any function
  with this signature can replace it (``lookup``/``register``'s ``hash_fn``); hits never
  trust it alone (module docstring), so a weak or even constant hash costs hits, not safety.
  """
  return _chain_from(tokens_SPZ, _salt_root(salt_S))


def _salt_root(salt_S: jax.Array) -> jax.Array:
  """u32[S]: the chain's ``h`` before level 0, a hash of the salt (``chain_hashes``)."""
  return _fmix32(salt_S.astype(jnp.uint32) ^ jnp.uint32(_HASH_SEED))


def _chain_from(tokens_SwZ: jax.Array, h_S: jax.Array) -> jax.Array:
  """u32[S, w]: ``chain_hashes``'s keys of w consecutive blocks of each sequence, chained
  from ``h_S`` (u32[S]), the ``h`` of the level before the first (the salt's at level 0)."""
  _, w, z = tokens_SwZ.shape
  tok_SwZ = tokens_SwZ.astype(jnp.uint32)
  offset_Z = (jnp.arange(z, dtype=jnp.uint32) + 1) * jnp.uint32(0x632BE5AB)
  c_Sw = _fmix32(jnp.sum(_fmix32(tok_SwZ * jnp.uint32(0x9E3779B9) + offset_Z), axis=-1,
                         dtype=jnp.uint32))
  r_pow_w = jnp.asarray(_powers_u32(_CHAIN_MULT, w))
  r_inv_pow_w = jnp.asarray(_powers_u32(pow(_CHAIN_MULT, -1, 2**32), w))
  acc_Sw = (jnp.cumsum(c_Sw * r_inv_pow_w, axis=1, dtype=jnp.uint32)
            + jnp.uint32(_CHAIN_MULT) * h_S.astype(jnp.uint32)[:, None])
  return _fmix32(acc_Sw * r_pow_w)


def _unfmix32(key: jax.Array) -> jax.Array:
  """The inverse of ``_fmix32`` (each of its steps is a bijection of uint32): the ``h`` a
  registered block's key was made from, so a chain continues from a stored key."""
  h = key ^ (key >> 16)
  h = h * jnp.uint32(pow(0xC2B2AE35, -1, 2**32))
  h = h ^ (h >> 13) ^ (h >> 26)
  h = h * jnp.uint32(pow(0x85EBCA6B, -1, 2**32))
  return h ^ (h >> 16)


def _token_blocks(state: AllocatorState, tokens) -> jax.Array:
  """``tokens`` i32[S, J] (each sequence's tokens from position 0) as i32[S, P, Z]."""
  x = jnp.asarray(tokens)
  s, p, z = state.max_seqs, state.max_blocks_per_seq, state.block_size
  if x.ndim != 2 or x.shape[0] != s:
    raise ValueError(f"tokens.shape={tuple(x.shape)} must be [S, J]=[{s}, J]")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"tokens.dtype={x.dtype} must be an integer dtype")
  x = x.astype(jnp.int32)[:, :p * z]
  x = jnp.pad(x, ((0, 0), (0, p * z - x.shape[1])))
  return x.reshape(s, p, z)


def _salt(state: AllocatorState, salt) -> jax.Array:
  if salt is None:
    return jnp.zeros(state.max_seqs, jnp.int32)
  return _check_vector("salt", salt, state.max_seqs, "int")


def _root_links(root_S, level_S, s: int):
  """``(root_S, level_S)`` of a walk over columns: the block the first column hangs off
  (NO_BLOCK: it is a chain's root) and the first column's level; defaults NO_BLOCK, 0."""
  root_S = jnp.full(s, NO_BLOCK, jnp.int32) if root_S is None else root_S
  level_S = jnp.zeros(s, jnp.int32) if level_S is None else level_S
  return root_S, level_S


def _hangs_off(state: AllocatorState, bc_X: jax.Array, prev_X: jax.Array) -> jax.Array:
  """bool (``bc_X``'s shape): block ``bc_X`` (in range) was registered off ``prev_X`` as it
  is now (same generation), or is a root where ``prev_X`` is NO_BLOCK."""
  n = state.num_blocks
  return jnp.where(prev_X == NO_BLOCK, state.parent_N[bc_X] == NO_BLOCK,
                   (state.parent_N[bc_X] == prev_X)
                   & (state.parent_gen_N[bc_X]
                      == state.generation_N[jnp.clip(prev_X, 0, n - 1)]))


def _chained_SP(state: AllocatorState, b_SP: jax.Array, root_S=None,
                level_S=None) -> jax.Array:
  """bool[S, P]: block ``b_SP[s, j]`` is registered at depth j and is a root (j == 0) or
  hangs off ``b_SP[s, j - 1]`` as it was when registered (same generation). Ids outside
  ``[0, N)`` are read clipped: callers that may pass them check the range themselves.
  ``root_S`` / ``level_S`` (``_root_links``): columns from level ``level_S`` on, the first
  hanging off ``root_S``."""
  s, p = b_SP.shape
  n = state.num_blocks
  root_S, level_S = _root_links(root_S, level_S, s)
  j_P = jnp.arange(p, dtype=jnp.int32)
  bc_SP = jnp.clip(b_SP, 0, n - 1)
  prev_SP = jnp.concatenate([root_S[:, None], b_SP[:, :-1]], axis=1)
  linked_SP = jnp.where(
      j_P == 0, _hangs_off(state, bc_SP, prev_SP),
      (state.parent_N[bc_SP] == prev_SP)
      & (state.parent_gen_N[bc_SP] == state.generation_N[jnp.clip(prev_SP, 0, n - 1)]))
  return (state.depth_N[bc_SP] == level_S[:, None] + j_P) & linked_SP


_BUCKET_MIXES = (0, 0x7FEB352D)  # two bucket functions of one key: fewer lost hits


def _live_N(state: AllocatorState) -> jax.Array:
  """bool[N]: the anchor group's registered blocks whose chain links, level by level, up to
  a root: each parent registered one level up with the generation it had when the child
  was registered. A block with an ancestor evicted since (however far up) is stale: it can
  never be part of a hit, and it holds the same key as the live entry of its prefix, if one
  is registered again. Pointer doubling, ceil(log2 P) gathers over N: each block points at
  its parent, a root at itself, a broken link at a sink N; a block is live when its pointer,
  jumped P levels up, has not reached the sink."""
  n = state.num_blocks
  reg_N = (state.depth_N >= 0) & (state.group_N == _anchor(state))
  root_N = state.depth_N == 0
  pc_N = jnp.clip(state.parent_N, 0, n - 1)
  link_N = reg_N & jnp.where(
      root_N, state.parent_N == NO_BLOCK,
      (state.parent_N >= 0) & (state.parent_N < n) & reg_N[pc_N]
      & (state.depth_N[pc_N] == state.depth_N - 1)
      & (state.parent_gen_N == state.generation_N[pc_N]))
  up_N = jnp.where(link_N, jnp.where(root_N, jnp.arange(n, dtype=jnp.int32), pc_N), n)
  up_X = jnp.concatenate([up_N, jnp.full((1,), n, jnp.int32)])  # the sink points at itself
  # After r rounds up_X[b] is b's ancestor 2**r levels up (a root, or the sink, stays put);
  # a chain has at most P blocks. A loop, not unrolled: XLA fuses a chain of gathers into
  # one that recomputes each level (2**r reads an entry; 10x slower at r = 9 on a CPU).
  rounds = (state.max_blocks_per_seq - 1).bit_length()
  up_X = jax.lax.fori_loop(0, rounds, lambda _, up_X: up_X[up_X], up_X)
  return up_X[:n] < n


def _candidates(state: AllocatorState, tokens_SPZ: jax.Array, key_SP: jax.Array,
                salt_S: jax.Array, root_S=None, level_S=None) -> jax.Array:
  """i32[S, P]: the anchor-group block proposed for each key, from a table built without a
  sort.

  The anchor group's live registered blocks (``_live_N``: stale ones, an ancestor evicted
  since, however far up, can never be hit and share their key with the live entry of the
  same prefix) are scattered into B >= 8N buckets (a power of two) by a mix of their hash;
  each bucket keeps its highest and its lowest block id, under two bucket functions: up to
  four blocks per key, in O(N log P + B + S * P * Z) (no sort of the pool). Proposed is the
  one that holds this block's tokens (hash, salt and depth agreeing) on the deepest chain
  of such blocks linking, level by level, to a root (``_chain_pick``). NO_BLOCK past that
  chain. ``root_S`` / ``level_S``: as for ``_chained_SP``.

  A key loses its block (a lost hit, never a wrong one: ``_walk`` confirms every hit) when
  it is neither the highest nor the lowest id of its bucket under both functions: with no
  stale entries in the table, only when distinct live keys share its buckets. With the
  pool full of registered blocks that is about 1e-3 of the keys at 2N buckets (load 0.5:
  64 prefixes of 124 blocks lost levels, the shortest hit 9,
  ``benchmarks/prefix_lookup.py``) and about 6e-6 at 8N (load 0.125). The tables are
  transient: 4 * B int32, 128 bytes per block of the pool."""
  n, p = state.num_blocks, key_SP.shape[1]
  b = 1 << max(1, (8 * n - 1).bit_length())
  reg_N = _live_N(state)
  ids_N = jnp.arange(n, dtype=jnp.int32)
  root_S, level_S = _root_links(root_S, level_S, key_SP.shape[0])
  j_P = level_S[:, None] + jnp.arange(p, dtype=jnp.int32)
  cands, holds = [], []
  for mix in _BUCKET_MIXES:
    bucket = lambda h: (_fmix32(h ^ jnp.uint32(mix)) & jnp.uint32(b - 1)).astype(jnp.int32)
    dest_N = jnp.where(reg_N, bucket(state.block_hash_N), b)  # b: dropped
    q_SP = bucket(key_SP)
    for table_B in (jnp.full(b, -1, jnp.int32).at[dest_N].max(ids_N, mode="drop"),
                    jnp.full(b, n, jnp.int32).at[dest_N].min(ids_N, mode="drop")):
      c_SP = table_B[q_SP]
      cc_SP = jnp.clip(c_SP, 0, n - 1)
      cands.append(jnp.where((c_SP >= 0) & (c_SP < n), c_SP, NO_BLOCK))
      holds.append((c_SP >= 0) & (c_SP < n) & (state.block_hash_N[cc_SP] == key_SP)
                   & (state.salt_N[cc_SP] == salt_S[:, None]) & (state.depth_N[cc_SP] == j_P)
                   & jnp.all(state.block_tokens_NZ[cc_SP] == tokens_SPZ, axis=-1))
  return _chain_pick(state, jnp.stack(cands, axis=-1), jnp.stack(holds, axis=-1), root_S)


def _bool_matmul(a, b):
  """Boolean matrix product over the last two axes: ``(a @ b)[i, k] = any_j a[i, j] & b[j, k]``."""
  return jnp.any(a[..., :, :, None] & b[..., None, :, :], axis=-2)


def _chain_pick(state: AllocatorState, c_SPC: jax.Array, holds_SPC: jax.Array,
                root_S: jax.Array) -> jax.Array:
  """i32[S, P]: one candidate a level (of the C in ``c_SPC``, those that hold the level's
  tokens: ``holds_SPC``) forming the deepest chain that links from a root: candidate b at
  level j links to candidate a at level j - 1 when b hangs off a as a is now (parent id and
  generation), and a first-column candidate hanging off ``root_S`` (NO_BLOCK: a root)
  starts one. NO_BLOCK past the chain's end.

  Exact over the candidates, and no loop over levels: reachability from level 0 is a
  product of C x C boolean link matrices (``lax.associative_scan`` over P, log P deep),
  and the chain is read back from its deepest level down by composing, again by a scan, the
  maps "candidate at j + 1 -> the first reachable candidate at j it hangs off", starting
  from "none -> the first reachable candidate". A stale entry that still holds its tokens
  (an ancestor above it evicted and reused) is never reachable, however deep its break."""
  s, p, c = c_SPC.shape
  n = state.num_blocks
  cc_SPC = jnp.clip(c_SPC, 0, n - 1)
  parent_SPC, parent_gen_SPC = state.parent_N[cc_SPC], state.parent_gen_N[cc_SPC]
  gen_SPC = state.generation_N[cc_SPC]
  up = lambda x_SPC, fill: jnp.concatenate(  # level j - 1's values at level j
      [jnp.full((s, 1, c), fill, x_SPC.dtype), x_SPC[:, :-1]], axis=1)
  # link_SPAB[s, j, a, b]: candidate b of level j hangs off candidate a of level j - 1.
  link_SPAB = (holds_SPC[:, :, None, :] & up(holds_SPC, False)[:, :, :, None]
               & (parent_SPC[:, :, None, :] == up(c_SPC, NO_BLOCK)[:, :, :, None])
               & (parent_gen_SPC[:, :, None, :] == up(gen_SPC, -1)[:, :, :, None]))
  root_SC = holds_SPC[:, 0] & _hangs_off(state, cc_SPC[:, 0], root_S[:, None])
  # Level 0's matrix has every row equal to its roots, so row 0 of the product up to level j
  # is the set of candidates reachable at level j.
  step_SPAB = link_SPAB.at[:, 0].set(jnp.broadcast_to(root_SC[:, None, :], (s, c, c)))
  reach_SPC = jax.lax.associative_scan(_bool_matmul, step_SPAB, axis=1)[:, :, 0, :]
  first = lambda m_XC: jnp.where(jnp.any(m_XC, axis=-1), jnp.argmax(m_XC, axis=-1), c)
  # map_SPX[s, j, x]: the candidate of level j under candidate x of level j + 1 (x = C:
  # none there, so the first reachable one of level j; C: none).
  below_SPAB = jnp.concatenate([link_SPAB[:, 1:], jnp.zeros((s, 1, c, c), jnp.bool_)], axis=1)
  map_SPX = jnp.concatenate(
      [first(jnp.swapaxes(below_SPAB & reach_SPC[..., :, None], -1, -2)),
       first(reach_SPC)[..., None]], axis=-1).astype(jnp.int32)
  # F_j = map_j o map_{j+1} o ... o map_{P-1}; the scan in reverse hands (later, earlier).
  compose = lambda later, earlier: jnp.take_along_axis(earlier, later, axis=-1)
  pick_SP = jax.lax.associative_scan(compose, map_SPX, axis=1, reverse=True)[..., c]
  c_SPX = jnp.concatenate([c_SPC, jnp.full((s, p, 1), NO_BLOCK, c_SPC.dtype)], axis=-1)
  return jnp.take_along_axis(c_SPX, pick_SP[..., None], axis=-1)[..., 0]


def _walk(state: AllocatorState, tokens_SPZ, salt_S, limit_S, hash_fn, *, key_SP=None,
          root_S=None, level_S=None):
  """Match every sequence's blocks ``j < limit_S`` against the anchor group's registered ones.

  Returns ``(key_SP, cand_SP, hit_SP, num_hit_S)``: the hashes, the block each hash proposes
  (``_candidates``), the confirmed leading run of levels (bool) and its length. With
  ``root_S`` / ``level_S`` (``_chained_SP``) the columns are levels ``level_S + j`` of a
  chain continuing off ``root_S``, and ``key_SP`` their keys (``hash_fn`` is not called).
  """
  s, p = tokens_SPZ.shape[:2]
  n = state.num_blocks
  if key_SP is None:
    key_SP = jnp.asarray(hash_fn(tokens_SPZ, salt_S))
    if key_SP.shape != (s, p):
      raise ValueError(f"hash_fn returned shape {tuple(key_SP.shape)}, must be [S, P]="
                       f"{(s, p)}")
  key_SP = key_SP.astype(jnp.uint32)
  cand_SP = _candidates(state, tokens_SPZ, key_SP, salt_S, root_S, level_S)
  cc_SP = jnp.clip(cand_SP, 0, n - 1)
  j_P = jnp.arange(p, dtype=jnp.int32)
  ok_SP = ((cand_SP != NO_BLOCK) & (state.depth_N[cc_SP] >= 0)
           & (state.block_hash_N[cc_SP] == key_SP) & (state.salt_N[cc_SP] == salt_S[:, None])
           & (state.group_N[cc_SP] == _anchor(state))
           & jnp.all(state.block_tokens_NZ[cc_SP] == tokens_SPZ, axis=-1)
           & _chained_SP(state, cc_SP, root_S, level_S) & (j_P < limit_S[:, None]))
  hit_SP = jnp.cumprod(ok_SP.astype(jnp.int32), axis=1).astype(jnp.bool_)
  return key_SP, cc_SP, hit_SP, jnp.sum(hit_SP, axis=1, dtype=jnp.int32)


def _beside_SP(state: AllocatorState, b_SP: jax.Array, anchor_SP: jax.Array,
               group: int) -> jax.Array:
  """bool[S, P]: block ``b_SP[s, j]`` is registered in ``group`` at depth j beside the anchor
  block ``anchor_SP[s, j]`` as that block is now (same generation). Both ids are checked
  against ``[0, N)``."""
  n, p = state.num_blocks, b_SP.shape[1]
  bc_SP, ac_SP = jnp.clip(b_SP, 0, n - 1), jnp.clip(anchor_SP, 0, n - 1)
  return ((b_SP >= 0) & (b_SP < n) & (anchor_SP >= 0) & (anchor_SP < n)
          & (state.depth_N[bc_SP] == jnp.arange(p, dtype=jnp.int32))
          & (state.group_N[bc_SP] == group) & (state.parent_N[bc_SP] == anchor_SP)
          & (state.parent_gen_N[bc_SP] == state.generation_N[ac_SP]))


def _hit_span_gSP(state: AllocatorState, k_S: jax.Array) -> jax.Array:
  """bool[g, S, P]: the blocks a hit of ``k_S`` levels gives each group, those a query at
  ``k * Z`` reads: levels ``[0, k)`` in a full group, ``[_keep_from_gS, k)`` in a sliding one."""
  j_P = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)
  keep_gS = _keep_from_gS(state, k_S * state.block_size)
  return (j_P >= keep_gS[..., None]) & (j_P < k_S[:, None])


def _group_hits(state: AllocatorState, salt_S, anchor_SP, num_hit_S):
  """The hit of every sequence across the groups: ``(blocks_gSP, k_S)``, k the longest run
  of anchor levels (``anchor_SP``, ``num_hit_S`` of them) that every other group can serve
  (``_hit_span_gSP``) with the blocks the anchor blocks point to (``beside_gN``),
  confirmed by their links back (``_beside_SP``) and their salt."""
  s, p, z = state.max_seqs, state.max_blocks_per_seq, state.block_size
  anchor = _anchor(state)
  k_K = jnp.arange(p + 1, dtype=jnp.int32)
  keep_gK = _keep_from_gS(state, k_K * z)  # the first level a hit of k levels needs
  good_SK = k_K <= num_hit_S[:, None]
  rows = []
  for g in range(state.num_groups):
    if g == anchor:
      rows.append(anchor_SP)
      continue
    c_SP = state.beside_gN[g][jnp.clip(anchor_SP, 0, state.num_blocks - 1)]
    good_SP = (_beside_SP(state, c_SP, anchor_SP, g)
               & (state.salt_N[jnp.clip(c_SP, 0, state.num_blocks - 1)] == salt_S[:, None]))
    pick_SP = jnp.where(good_SP, c_SP, NO_BLOCK)
    rows.append(pick_SP)
    # Misses among the levels below k, for every k: a hit of k needs none in [keep, k).
    miss_SK = jnp.concatenate([jnp.zeros((s, 1), jnp.int32),
                               jnp.cumsum(pick_SP == NO_BLOCK, axis=1, dtype=jnp.int32)], axis=1)
    good_SK &= miss_SK == miss_SK[:, keep_gK[g]]
  k_S = jnp.max(jnp.where(good_SK, k_K, 0), axis=1)
  return jnp.where(_hit_span_gSP(state, k_S), jnp.stack(rows), NO_BLOCK), k_S


@_state_op
def lookup(state: AllocatorState, tokens, num_tokens, salt=None, *,
           hash_fn=chain_hashes) -> tuple[jax.Array, jax.Array]:
  """The longest cached prefix of every sequence's tokens; reads the state only.

  Args:
    tokens: i32[S, J] each sequence's token ids from position 0 (J is cut or padded to P * Z).
    num_tokens: i32[S] how many leading tokens of each row may be matched: only full blocks
      inside them are (pass ``len - 1`` to leave at least one token to compute).
    salt: i32[S] cache salt of each sequence (default 0): only blocks registered under the
      same salt match.
    hash_fn: the block hash (``chain_hashes``'s signature).

  Returns:
    ``(blocks, num_hit_S)``: the matched blocks in the layout of ``block_tables`` (i32[S, P],
    or i32[g, S, P] with groups: each group's blocks of the hit, ``_hit_span_gSP``;
    ``NO_BLOCK`` elsewhere), ready for ``attach``. With groups a hit is as long as every
    group can serve: the anchor's chain cut where another group misses a block it needs.

  With the default hash and P >= ``_NARROW_WALK_FROM``, when no row may match past the
  first ``P // 16`` levels, only those are hashed and walked (the same result: a level's
  key depends on the levels up to it only), so admitting short prompts costs their length,
  not ``max_model_len``.
  """
  tokens_SPZ = _token_blocks(state, tokens)
  limit_S = _check_vector("num_tokens", num_tokens, state.max_seqs, "int") // state.block_size
  salt_S = _salt(state, salt)
  if not _prefix_caching(state):  # every group slides: nothing is ever registered
    return (jnp.full(state.block_tables.shape, NO_BLOCK, jnp.int32),
            jnp.zeros(state.max_seqs, jnp.int32))
  p = state.max_blocks_per_seq

  def walk(cols: int):
    def run():
      _, cand_SP, hit_SP, num_hit_S = _walk(state, tokens_SPZ[:, :cols], salt_S, limit_S,
                                            hash_fn)
      anchor_SP = jnp.pad(jnp.where(hit_SP, cand_SP, NO_BLOCK), ((0, 0), (0, p - cols)),
                          constant_values=NO_BLOCK)
      return anchor_SP, num_hit_S
    return run

  # The default hash of a level depends on the levels up to it only: when no row may match
  # past the first P / 16 levels (a short prompt in a long max_model_len), walk just those.
  narrow = hash_fn is chain_hashes and p >= _NARROW_WALK_FROM
  widths = sorted({max(8, p // 16), p}) if narrow else [p]
  if len(widths) == 1:
    anchor_SP, num_hit_S = walk(p)()
  else:
    anchor_SP, num_hit_S = jax.lax.cond(jnp.max(limit_S) <= widths[0], walk(widths[0]),
                                        walk(p))
  if state.num_groups == 1:
    return anchor_SP, num_hit_S
  return _group_hits(state, salt_S, anchor_SP, num_hit_S)


@_state_op
def attach(state: AllocatorState, blocks, num_blocks, *, tokens=None,
           salt=None) -> tuple[AllocatorState, jax.Array]:
  """Give each sequence s with ``num_blocks[s] = k > 0`` the registered blocks of a hit of k
  levels (``blocks`` in the layout of ``block_tables``, e.g. from ``lookup``): its first k
  blocks (with groups, each group's blocks of ``_hit_span_gSP``; other entries are not
  read). ``seq_lens`` becomes ``k * Z``, each block's ref count + 1 (a cached free block is
  revived: 0 -> 1, ``num_free`` - 1) and its ``last_used`` the clock (a hit refreshes its LRU
  stamp).

  Returns ``(state, ok_S)``. A sequence is refused (ok False, nothing changes for it) unless
  it is empty (seq_len 0, no block), ``k <= P`` and its blocks form one registered chain
  (depths 0..k-1, each linked to the previous one, one salt), with groups in the anchor
  group, and every other group's blocks sit beside the chain's (``_beside_SP``, same salt).
  ``k == 0`` is always ok.

  A ``lookup`` result holds for the state it read. Attach it to that state (as the engine
  does, in the same step), or pass ``tokens`` (i32[S, J]) and ``salt`` (i32[S], default 0)
  as given to ``lookup``: each attached block's stored tokens must then equal the
  sequence's at its level, and its chain's salt the sequence's, else the sequence is
  refused. Without them a result kept across operations that take blocks
  (``append``, ``fork``, another ``attach``) can name a block evicted meanwhile and
  registered again with other tokens under the same parent: a chain still, but not this
  prompt's (its K/V would be another prompt's).
  """
  s, p, n, z = state.max_seqs, state.max_blocks_per_seq, state.num_blocks, state.block_size
  b = jnp.asarray(blocks)
  if b.shape != state.block_tables.shape:
    layout = "[S, P]" if state.block_tables.ndim == 2 else "[g, S, P]"
    raise ValueError(f"blocks.shape={tuple(b.shape)} must be {layout}="
                     f"{tuple(state.block_tables.shape)}")
  if not jnp.issubdtype(b.dtype, jnp.integer):
    raise ValueError(f"blocks.dtype={b.dtype} must be an integer dtype")
  b_gSP = b.astype(jnp.int32)[None] if b.ndim == 2 else b.astype(jnp.int32)
  k_S = _check_vector("num_blocks", num_blocks, s, "int")
  if not _prefix_caching(state):  # every group slides: no registered chain to attach
    return dataclasses.replace(state, clock=state.clock + 1), k_S == 0
  anchor = _anchor(state)
  a_SP = b_gSP[anchor]
  bc_gSP = jnp.clip(b_gSP, 0, n - 1)
  salt_S = state.salt_N[jnp.clip(a_SP[:, 0], 0, n - 1)]
  same_tokens_SP = True
  if tokens is not None:  # the blocks still hold this prompt's tokens (a stale lookup's not)
    same_tokens_SP = jnp.all(state.block_tokens_NZ[bc_gSP[anchor]]
                             == _token_blocks(state, tokens), axis=-1)
    same_tokens_SP &= (salt_S == _salt(state, salt))[:, None]
  elif salt is not None:
    raise ValueError("salt= checks a lookup's result with tokens=: pass both, or neither")
  ok_g = []
  for g in range(state.num_groups):
    same_salt_SP = state.salt_N[bc_gSP[g]] == salt_S[:, None]
    if g == anchor:
      ok_g.append((a_SP >= 0) & (a_SP < n) & _chained_SP(state, a_SP) & same_salt_SP
                  & (state.group_N[bc_gSP[g]] == anchor) & same_tokens_SP)
    else:
      ok_g.append(_beside_SP(state, b_gSP[g], a_SP, g) & same_salt_SP)
  use_gSP = _hit_span_gSP(state, k_S)
  t_gSP = _tables_gSP(state)
  empty_S = (state.seq_lens == 0) & ~jnp.any(t_gSP != NO_BLOCK, axis=(0, 2))
  grant_S = ((k_S > 0) & (k_S <= p) & empty_S
             & jnp.all(jnp.where(use_gSP, jnp.stack(ok_g), True), axis=(0, 2)))
  give_gSP = grant_S[:, None] & use_gSP
  count_N = _count_N(b_gSP, give_gSP, n)
  revived_N = (state.ref_counts == 0) & (count_N > 0)
  new_state = dataclasses.replace(
      state,
      block_tables=_pack(state, jnp.where(give_gSP, b_gSP, t_gSP)),
      seq_lens=jnp.where(grant_S, k_S * z, state.seq_lens),
      ref_counts=state.ref_counts + count_N,
      num_free=state.num_free - jnp.sum(revived_N, dtype=jnp.int32),
      last_used=jnp.where(count_N > 0, state.clock, state.last_used),
      clock=state.clock + 1,
  )
  return new_state, grant_S | (k_S == 0)


@_state_op
def register(state: AllocatorState, tokens, salt=None, *, hash_fn=chain_hashes,
             window: int | None = None) -> AllocatorState:
  """Register every full block of every sequence that the cache does not hold yet.

  Call it once the K/V of those blocks are written (after the forward that filled them).
  ``tokens`` i32[S, J]: each sequence's tokens from position 0, as for ``lookup``; ``salt``
  i32[S] (default 0). A sequence with new full blocks (past its last registered one) first
  matches its prefix against the cache (``lookup``'s walk) and registers only the levels
  the cache does not hold, as one chain hanging off the matched prefix: a block the cache
  already holds (another sequence registered the same prefix since this one attached, forked
  or computed it) is not registered twice, and the sequence's own copy stays unregistered
  (one O(N) pass per call with new blocks). When several sequences would register the same
  block (same tokens after the same parent, same salt) in one call, only the first in slot
  order does (so a prefix has one entry); the others walk again in a second round of the
  same call and register only where they part from it. With groups the chains are the
  anchor group's, and every other group registers its block of each level the anchor
  registers now, beside it (the block the sequence holds there, if its window still does).
  Changes nothing else.

  ``window`` (static int, optional; only with the default ``hash_fn``): when every
  sequence with new blocks has at most ``window`` of them past its last registered block,
  and that block is live (its chain links up to a root), the walk covers only those levels:
  it continues off that block, its key giving the chain hash's state (``_unfmix32``), in
  O(S * window * Z) rather than O(S * P * Z) (an engine's decode step fills a block or so
  per sequence, and P grows with ``max_model_len``). Otherwise, and without ``window`` or
  with P < ``_NARROW_WALK_FROM``, the whole rows are walked. Either way the same blocks
  are registered.
  """
  tokens_SPZ = _token_blocks(state, tokens)
  salt_S = _salt(state, salt)
  if not _prefix_caching(state):  # every group slides: registers nothing (module docstring)
    return dataclasses.replace(state, clock=state.clock + 1)
  if window is not None:
    window = _check_positive_int("window", window)
  s, p, n, z = state.max_seqs, state.max_blocks_per_seq, state.num_blocks, state.block_size
  anchor = _anchor(state)
  j_P = jnp.arange(p, dtype=jnp.int32)
  take = lambda x_SX, j_S: jnp.take_along_axis(x_SX, jnp.clip(j_S, 0, x_SX.shape[1] - 1)[
      :, None], axis=1)[:, 0]

  def pending(state):
    """(t_gSP, full_S, own_reg_SP, after_S, pending_S): the tables, each sequence's full
    levels, those it holds registered, the level past its last registered one, and
    whether it has full levels past that."""
    full_S = state.seq_lens // z
    t_gSP = _tables_gSP(state)
    b_SP = t_gSP[anchor]
    own_reg_SP = ((b_SP != NO_BLOCK) & (state.depth_N[jnp.clip(b_SP, 0, n - 1)] >= 0)
                  & (j_P < full_S[:, None]))
    after_S = jnp.max(jnp.where(own_reg_SP, j_P + 1, 0), axis=1)
    return t_gSP, full_S, own_reg_SP, after_S, full_S > after_S

  def write(state, w):
    """One round: every sequence with new levels registers those the cache does not hold
    (but a duplicate of an earlier sequence's first new block, this round); returns the
    state and whether such a duplicate waits for the next round. ``w``: None to walk the
    whole rows, else the window of levels from each sequence's ``after_S`` on."""
    t_gSP, full_S, own_reg_SP, after_S, pending_S = pending(state)
    b_SP = t_gSP[anchor]
    if w is None:  # columns are levels 0..P-1
      cols, first_level_S, root_S = p, jnp.zeros(s, jnp.int32), None
      at = lambda x_SP: x_SP
      at_gSP = lambda x_gSP: x_gSP
      toks_SwZ = tokens_SPZ
      key_Sw = None
      prev0_S = jnp.full(s, NO_BLOCK, jnp.int32)
    else:  # columns are levels after_S .. after_S + w - 1
      cols, first_level_S = w, after_S
      level_Sw = after_S[:, None] + jnp.arange(w, dtype=jnp.int32)
      lc_Sw = jnp.clip(level_Sw, 0, p - 1)
      at = lambda x_SP: jnp.take_along_axis(x_SP, lc_Sw, axis=1)
      at_gSP = lambda x_gSP: jnp.take_along_axis(x_gSP, lc_Sw[None], axis=2)
      toks_SwZ = jnp.take_along_axis(tokens_SPZ, lc_Sw[:, :, None], axis=1)
      root_S = jnp.where(after_S > 0, take(b_SP, after_S - 1), NO_BLOCK)
      prev0_S = root_S
      h_S = jnp.where(after_S > 0,
                      _unfmix32(state.block_hash_N[jnp.clip(root_S, 0, n - 1)]),
                      _salt_root(salt_S))
      key_Sw = _chain_from(toks_SwZ, h_S)
    j_w = jnp.arange(cols, dtype=jnp.int32)
    level_Sw = first_level_S[:, None] + j_w
    b_Sw = at(b_SP)
    bc_Sw = jnp.clip(b_Sw, 0, n - 1)
    full_Sw = level_Sw < full_S[:, None]
    own_reg_Sw = at(own_reg_SP) & (level_Sw < p)
    own_prev_Sw = jnp.concatenate([prev0_S[:, None], b_Sw[:, :-1]], axis=1)
    # Hang each sequence's new levels off the longest prefix the cache holds (lookup's
    # walk), so no block the cache holds is registered twice: a sequence matched at least
    # up to its own last registered block skips the levels the cache holds (its own blocks
    # there stay unregistered) and registers the rest, up to its next registered block;
    # one the walk matches less far (a lost bucket) extends its own chain. (A window starts
    # past the last registered block, which the call's check found on a live chain.)
    key_Sw, cand_Sw, _, hit_w_S = _walk(state, toks_SwZ, salt_S, full_S - first_level_S,
                                        hash_fn, key_SP=key_Sw, root_S=root_S,
                                        level_S=first_level_S)
    hit_S = first_level_S + hit_w_S
    walked_S = hit_S >= after_S
    stop_Sw = (j_w >= hit_w_S[:, None]) & (own_reg_Sw | ~full_Sw)
    stop_S = jnp.where(walked_S, jnp.where(jnp.any(stop_Sw, axis=1),
                                           jnp.argmax(stop_Sw, axis=1), cols),
                       full_S - first_level_S)
    first_S = jnp.where(walked_S, hit_w_S, after_S - first_level_S)
    first_parent_S = jnp.where(
        walked_S, jnp.where(hit_w_S > 0, take(cand_Sw, hit_w_S - 1), prev0_S),
        take(b_SP, after_S - 1))
    has_new_S = pending_S & (stop_S > first_S)
    # In-call duplicates: the same first new block (hash, depth, parent, salt) earlier in
    # slot order. The later ones register in the next round, off the blocks the first
    # registers now (their tails may part from its; a hash collision with other tokens
    # merely waits a round, and registers its own there). Found by one sort of the S
    # rows, not an [S, S] comparison (which grew as max_seqs squared).
    first_key_S = take(key_Sw, first_S)
    first_depth_S = first_level_S + first_S
    dup_S = _later_duplicates(has_new_S, first_key_S, first_depth_S, first_parent_S, salt_S)
    new_Sw = ((has_new_S & ~dup_S)[:, None] & (j_w >= first_S[:, None])
              & (j_w < stop_S[:, None]))
    new_Sw &= _first_holder(b_Sw, new_Sw, n)  # a block held by forks is registered once
    parent_Sw = jnp.where(j_w == first_S[:, None], first_parent_S[:, None], own_prev_Sw)
    parent_gen_Sw = jnp.where(parent_Sw >= 0,
                              state.generation_N[jnp.clip(parent_Sw, 0, n - 1)], 0)
    dest_gSw = [jnp.where(new_Sw, b_Sw, n)]  # n: dropped by the scatters
    parent_gSw, parent_gen_gSw, group_g = [parent_Sw], [parent_gen_Sw], [anchor]
    beside_gN = state.beside_gN
    if state.num_groups > 1:
      # Every other group: its block of each level the anchor registers now (by anyone),
      # linked to that anchor block, which points to it.
      now_N = jnp.zeros(n, jnp.bool_).at[dest_gSw[0]].set(True, mode="drop")
      others = [g for g in range(state.num_groups) if g != anchor]
      o_oSw = at_gSP(t_gSP[jnp.asarray(others)])
      new_oSw = ((o_oSw != NO_BLOCK) & (b_Sw != NO_BLOCK) & now_N[bc_Sw] & full_Sw
                 & (state.depth_N[jnp.clip(o_oSw, 0, n - 1)] < 0))
      new_oSw &= _first_holder(o_oSw, new_oSw, n)
      for i, g in enumerate(others):
        dest_gSw.append(jnp.where(new_oSw[i], o_oSw[i], n))
        parent_gSw.append(b_Sw)
        parent_gen_gSw.append(state.generation_N[bc_Sw])
        group_g.append(g)
      g_oSw = jnp.broadcast_to(jnp.asarray(others, jnp.int32)[:, None, None], o_oSw.shape)
      beside_gN = beside_gN.at[g_oSw, jnp.where(new_oSw, b_Sw, n)].set(o_oSw, mode="drop")
    dest = jnp.stack(dest_gSw)
    put = lambda field, value: field.at[dest].set(
        jnp.broadcast_to(value, dest.shape + field.shape[1:]), mode="drop")
    state = dataclasses.replace(
        state,
        block_hash_N=put(state.block_hash_N, key_Sw),  # every group's: the anchor's key
        depth_N=put(state.depth_N, level_Sw),
        parent_N=put(state.parent_N, jnp.stack(parent_gSw)),
        parent_gen_N=put(state.parent_gen_N, jnp.stack(parent_gen_gSw)),
        salt_N=put(state.salt_N, salt_S[:, None]),
        block_tokens_NZ=put(state.block_tokens_NZ, toks_SwZ),
        group_N=put(state.group_N, jnp.asarray(group_g, jnp.int32)[:, None, None]),
        beside_gN=beside_gN,
    )
    return state, jnp.any(has_new_S & dup_S)

  def rounds(state, w):
    # Rounds until no duplicate waits: one when no two sequences register the same block.
    return jax.lax.while_loop(lambda carry: carry[1], lambda carry: write(carry[0], w),
                              (state, jnp.any(pending(state)[-1])))[0]

  if (window is None or hash_fn is not chain_hashes or window >= p
      or p < _NARROW_WALK_FROM):
    state = rounds(state, None)
  else:
    _, full_S, _, after_S, pending_S = pending(state)
    root_S = _tables_gSP(state)[anchor][jnp.arange(s), jnp.clip(after_S - 1, 0, p - 1)]
    live_S = (after_S == 0) | _live_N(state)[jnp.clip(root_S, 0, n - 1)]
    fits = jnp.all(~pending_S | ((full_S - after_S <= window) & live_S))
    state = jax.lax.cond(fits, lambda st: rounds(st, window), lambda st: rounds(st, None),
                         state)
  return dataclasses.replace(state, clock=state.clock + 1)


def _later_duplicates(mask_S: jax.Array, *keys_S: jax.Array) -> jax.Array:
  """bool[S]: the rows of ``mask_S`` whose ``keys_S`` (a tuple of columns) equal those of
  an earlier row of ``mask_S`` (in slot order): a sort of the S rows by (not in mask, keys,
  slot), each row compared with the one before it."""
  s = mask_S.shape[0]
  slot_S = jnp.arange(s, dtype=jnp.int32)
  out_S, *sorted_S, slot_sorted_S = jax.lax.sort(
      ((~mask_S).astype(jnp.int32), *keys_S, slot_S), num_keys=len(keys_S) + 2)
  same_S = (out_S[1:] == 0) & jnp.all(
      jnp.stack([k[1:] == k[:-1] for k in sorted_S]), axis=0)
  dup_sorted_S = jnp.concatenate([jnp.zeros(1, jnp.bool_), same_S])
  return jnp.zeros(s, jnp.bool_).at[slot_sorted_S].set(dup_sorted_S)


def _first_holder(b_XP: jax.Array, mask_XP: jax.Array, num_blocks: int) -> jax.Array:
  """bool (``b``'s shape): the entry is the first (row-major) with ``mask`` True naming its
  block, so that a block several rows hold (forks) is registered once."""
  flat = jnp.arange(b_XP.size, dtype=jnp.int32).reshape(b_XP.shape)
  first_N = jnp.full(num_blocks, b_XP.size, jnp.int32).at[
      jnp.where(mask_XP, b_XP, num_blocks)].min(flat, mode="drop")
  return first_N[jnp.clip(b_XP, 0, num_blocks - 1)] == flat


@_state_op
def cached_N(state: AllocatorState) -> jax.Array:
  """bool[N]: free blocks that still hold a registered prefix (reusable until evicted)."""
  return (state.ref_counts == 0) & (state.depth_N >= 0)


@_state_op
def num_cached(state: AllocatorState) -> jax.Array:
  """i32[]: how many blocks ``cached_N`` marks."""
  return jnp.sum(cached_N(state), dtype=jnp.int32)


# ----------------------------------------------------------------------------- host checks


def validate(state: AllocatorState) -> None:
  """Host-side: raise ``ValueError`` naming the first broken invariant of ``state``.

  With groups every table check runs per group (entries named ``block_tables[g, i, j]``); a
  full group's row holds exactly its ``ceil(len / Z)`` leading blocks, a sliding group's
  one contiguous run ending there and starting no later than the window of a query at
  ``seq_len`` needs (``_keep_from_gS``); a block belongs to one group only.
  """
  _check_state(state)
  tables = np.asarray(state.block_tables)
  len_S = np.asarray(state.seq_lens)
  rc_N = np.asarray(state.ref_counts)
  num_free = int(state.num_free)
  last_used_N = np.asarray(state.last_used)
  clock = int(state.clock)
  z = state.block_size
  windows = tuple(state.windows)
  grouped = len(windows) > 1
  if tables.ndim != (3 if grouped else 2) or (grouped and tables.shape[0] != len(windows)):
    raise ValueError(f"block_tables.shape={tables.shape} must be "
                     + (f"[g={len(windows)}, S, P]" if grouped else "[S, P]"))
  tables_gSP = tables if grouped else tables[None]
  _, s, p = tables_gSP.shape
  n = rc_N.shape[0]
  for name, x, shape in (("seq_lens", len_S, (s,)), ("ref_counts", rc_N, (n,)),
                         ("last_used", last_used_N, (n,))):
    if x.shape != shape:
      raise ValueError(f"{name}.shape={x.shape} must be {shape}")
  for name, x in (("block_tables", tables), ("seq_lens", len_S), ("ref_counts", rc_N),
                  ("last_used", last_used_N)):
    if x.dtype != np.int32:
      raise ValueError(f"{name}.dtype={x.dtype} must be int32")
  bad = np.flatnonzero((len_S < 0) | (len_S > p * z))
  if bad.size:
    i = bad[0]
    raise ValueError(f"seq_lens[{i}]={len_S[i]} must be in [0, P * Z={p * z}]")
  blocks_S = (len_S + z - 1) // z
  j_P = np.arange(p)
  keep_gS = np.asarray(_keep_from_gS(state, jnp.asarray(len_S)))
  count_gN = np.zeros((len(windows), n), np.int64)

  for g, (w, tables_SP) in enumerate(zip(windows, tables_gSP)):
    at = (lambda i, j: f"block_tables[{g}, {i}, {j}]") if grouped else (
        lambda i, j: f"block_tables[{i}, {j}]")
    bad = np.argwhere((tables_SP != NO_BLOCK) & ((tables_SP < 0) | (tables_SP >= n)))
    if bad.size:
      i, j = bad[0]
      raise ValueError(f"{at(i, j)}={tables_SP[i, j]} must be NO_BLOCK={NO_BLOCK} "
                       f"or in [0, num_blocks={n})")
    real_SP = tables_SP != NO_BLOCK
    if w is None:
      expect_SP = j_P[None, :] < blocks_S[:, None]
      bad = np.argwhere(real_SP != expect_SP)
      if bad.size:
        i, j = bad[0]
        raise ValueError(f"{at(i, j)}={tables_SP[i, j]}: row {i} with seq_lens[{i}]="
                         f"{len_S[i]} must hold exactly ceil({len_S[i]} / {z})={blocks_S[i]} "
                         f"leading blocks, then NO_BLOCK")
    else:
      first_S = np.where(real_SP.any(axis=1), real_SP.argmax(axis=1), blocks_S)
      expect_SP = (j_P[None, :] >= first_S[:, None]) & (j_P[None, :] < blocks_S[:, None])
      bad = np.argwhere((real_SP != expect_SP) | (first_S > keep_gS[g])[:, None])
      if bad.size:
        i, j = bad[0]
        raise ValueError(f"{at(i, j)}={tables_SP[i, j]}: row {i} of sliding group {g} "
                         f"(window {w}) with seq_lens[{i}]={len_S[i]} must hold one run of "
                         f"blocks ending at block {blocks_S[i] - 1} and starting at or before "
                         f"block max(0, {len_S[i]} - {w} + 1) // {z}={keep_gS[g, i]}")
    for i in range(s):
      row = tables_SP[i][real_SP[i]]
      if np.unique(row).size != row.size:
        raise ValueError(f"block_tables{'[%d]' % g if grouped else ''}[{i}]="
                         f"{tables_SP[i, :blocks_S[i]].tolist()} names a block twice")
    count_gN[g] = np.bincount(tables_SP[real_SP], minlength=n)
    # A partial last block is never shared: appends write into it without copy-on-write.
    partial_S = np.flatnonzero(len_S % z != 0)
    tail_S = tables_SP[partial_S, blocks_S[partial_S] - 1]
    bad = np.flatnonzero(rc_N[tail_S] != 1)
    if bad.size:
      i, b = partial_S[bad[0]], tail_S[bad[0]]
      raise ValueError(f"partial last block {b} of sequence {i}"
                       + (f" in group {g}" if grouped else "")
                       + f" has ref_counts[{b}]={rc_N[b]}, must be 1 (only full blocks are "
                       f"shared)")

  bad = np.flatnonzero(np.sum(count_gN > 0, axis=0) > 1)
  if bad.size:
    b = bad[0]
    raise ValueError(f"block {b} is named by groups {np.flatnonzero(count_gN[:, b]).tolist()}"
                     f": a block belongs to one group")
  count_N = count_gN.sum(axis=0)
  bad = np.flatnonzero(count_N != rc_N)
  if bad.size:
    b = bad[0]
    raise ValueError(f"ref_counts[{b}]={rc_N[b]} but {count_N[b]} block-table entries name "
                     f"block {b}")
  in_use = int(np.sum(rc_N > 0))
  if num_free + in_use != n:
    raise ValueError(f"num_free={num_free} + blocks in use={in_use} must equal num_blocks={n}")

  # Free order: stamps come from the clock.
  bad = np.flatnonzero((last_used_N < 0) | (last_used_N > clock))
  if bad.size:
    b = bad[0]
    raise ValueError(f"last_used[{b}]={last_used_N[b]} must be in [0, clock={clock}]")

  # Prefix cache: a registered block sits at its depth in every table holding it, full.
  depth_N = np.asarray(state.depth_N)
  parent_N = np.asarray(state.parent_N)
  for name, x, shape in (("depth_N", depth_N, (n,)), ("parent_N", parent_N, (n,)),
                         ("block_tokens_NZ", np.asarray(state.block_tokens_NZ), (n, z))):
    if x.shape != shape:
      raise ValueError(f"{name}.shape={x.shape} must be {shape}")
  bad = np.flatnonzero((depth_N < -1) | (depth_N >= p))
  if bad.size:
    b = bad[0]
    raise ValueError(f"depth_N[{b}]={depth_N[b]} must be -1 (not registered) or in [0, P={p})")
  group_N = np.asarray(state.group_N)
  if group_N.shape != (n,):
    raise ValueError(f"group_N.shape={group_N.shape} must be {(n,)}")
  beside_gN = np.asarray(state.beside_gN)
  if beside_gN.shape != (len(windows), n):
    raise ValueError(f"beside_gN.shape={beside_gN.shape} must be [g, N]={(len(windows), n)}")
  bad = np.argwhere((beside_gN != NO_BLOCK) & ((beside_gN < 0) | (beside_gN >= n)))
  if bad.size:
    g, b = bad[0]
    raise ValueError(f"beside_gN[{g}, {b}]={beside_gN[g, b]} must be NO_BLOCK or in "
                     f"[0, num_blocks={n})")
  reg_N = depth_N >= 0
  anchor = _anchor(state)
  if anchor is None and reg_N.any():
    b = np.flatnonzero(reg_N)[0]
    raise ValueError(f"depth_N[{b}]={depth_N[b]} must be -1: with every group sliding "
                     f"(windows={windows}) nothing is registered")
  bad = np.flatnonzero(reg_N & ((group_N < 0) | (group_N >= len(windows))))
  if bad.size:
    b = bad[0]
    raise ValueError(f"group_N[{b}]={group_N[b]} must be in [0, {len(windows)})")
  # The anchor's chains: only a root has no parent. Other groups: a sibling in the pool.
  in_anchor_N = group_N == anchor
  bad = np.flatnonzero(reg_N & in_anchor_N & ((depth_N == 0) != (parent_N == NO_BLOCK)))
  if bad.size:
    b = bad[0]
    raise ValueError(f"parent_N[{b}]={parent_N[b]} with depth_N[{b}]={depth_N[b]}: only a "
                     f"depth-0 block has parent NO_BLOCK")
  bad = np.flatnonzero(reg_N & ((depth_N > 0) | ~in_anchor_N)
                       & ((parent_N < 0) | (parent_N >= n)))
  if bad.size:
    b = bad[0]
    raise ValueError(f"parent_N[{b}]={parent_N[b]} must be in [0, num_blocks={n})")
  full_SP = np.arange(p)[None, :] < (len_S // z)[:, None]
  for g, tables_SP in enumerate(tables_gSP):
    for i, j in np.argwhere(tables_SP != NO_BLOCK):
      b = tables_SP[i, j]
      if reg_N[b] and (depth_N[b] != j or not full_SP[i, j] or group_N[b] != g):
        raise ValueError(f"registered block {b} (depth_N={depth_N[b]}"
                         + (f", group_N={group_N[b]}" if grouped else "")
                         + f") is held by sequence {i} at logical block {j}"
                         + (f" of group {g}" if grouped else "")
                         + ", which must be full and at that depth"
                         + (" and group" if grouped else ""))
