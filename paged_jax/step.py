"""The public step API: one ragged step of any model over the paged KV cache.

A model joins by having ``paged_forward(tokens_T, positions_T, cache, metadata, *,
logits_indices=None) -> (logits, cache)`` (``paged_jax.protocol``). This module turns the
allocator state and the new tokens of each sequence into what that forward takes:

1. ``allocator.append(state, num_new_S)`` grows each sequence, all-or-nothing (``ok_S``).
2. A sequence whose allocation failed (or whose tokens would run past ``T``) is DROPPED
   together with its rows: the remaining sequences' tokens are repacked so that row
   ``cu_q_lens[s] + j`` is token j of sequence s. (Masking only the token count of a
   failed sequence but keeping its rows would make every later sequence read its
   neighbour's tokens: no error, wrong logits.)
3. Positions (each sequence's old length + j), flat slots (``allocator.slots``) and
   ``AttentionMetadata`` (row s of the metadata is allocator slot s).

Batch layout (S = the allocator's ``max_seqs``): ``tokens_T`` holds the new tokens of
sequence 0, then of sequence 1, ... (``num_new_S[s]`` each, in slot order), then padding.

Entry points, all traceable (call them inside your own ``jit``):
- ``prepare_step(alloc_state, tokens_T, num_new_S) -> (alloc_state, StepInputs)``
- ``forward_step(model, alloc_state, cache, tokens_T, num_new_S) -> (logits_SV,
  alloc_state, cache, ok_S)``: prepare + the model's forward, logits of each sequence's
  last new token (zero rows for sequences with no token or a failed allocation).
- ``decode_step(model, alloc_state, cache, tokens_S, active_S)``: one token per active
  sequence, given at the sequence's own row.
- ``tokens_from_history(tokens_SJ, start_S, num_new_S, num_tokens)``: pack new tokens
  from each sequence's token history (what a scheduler holds).
- ``Steps(model)``: ``forward`` / ``decode`` jitted once, the allocator state and cache
  donated.

A jitted greedy decode loop over your own model::

  @nnx.jit(donate_argnames=("alloc", "cache"))
  def decode(model, alloc, cache, tokens_S, active_S):
    def body(carry, _):
      alloc, cache, tokens_S = carry
      logits_SV, alloc, cache, ok_S = step.decode_step(model, alloc, cache, tokens_S,
                                                       active_S)
      decoded_S = ok_S & active_S  # False: inactive, or dropped (no block was free)
      next_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
      # A dropped sequence keeps its pending token for a later step; -1 marks no token.
      tokens_S = jnp.where(decoded_S, next_S, tokens_S)
      return (alloc, cache, tokens_S), jnp.where(decoded_S, next_S, -1)
    (alloc, cache, tokens_S), per_step = jax.lax.scan(body, (alloc, cache, tokens_S),
                                                      length=8)
    return per_step.T, tokens_S, alloc, cache  # [S, 8] tokens, the pending ones, ...
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import allocator
from paged_jax import kv_cache
from paged_jax import protocol
from paged_jax._promotion import standard_promotion
from paged_jax.pallas_kernels import metadata
from paged_jax.pallas_kernels import validation

__all__ = ["AttentionMetadata", "EveryRow", "StepInputs", "Steps", "decode_step",
           "forward_step", "prepare_step", "tokens_from_history"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """Where a ragged batch's tokens go and what they see (``paged_attention``'s contract).

  A model's layers call ``cache.write(layer, k_TKD, v_TKD, metadata.slots_T)`` and
  ``paged_attention(q_THD, cache, layer, metadata.kv_lens_S, metadata.block_tables_SP,
  metadata.cu_q_lens, metadata.num_seqs)``; with KV groups (``for_layer``) each layer takes
  the cache layer, slots and tables ``for_layer(layer)`` returns in their place.

  Attributes:
    slots_T: i32[T] flat slot (``block_id * Z + offset``) each token's K/V is written to;
      negative for padding tokens (nothing written).
    kv_lens_S: i32[S] tokens in each sequence's cache, the new ones included.
    block_tables_SP: i32[S, P] physical block of each logical block.
    cu_q_lens: i32[S + 1] cumulative new-token counts; sequence i owns token rows
      ``cu_q_lens[i]:cu_q_lens[i + 1]``, its last ``q_len`` tokens.
    num_seqs: i32[] live sequence rows; rows past it are padding.
    block_tables_gSP, slots_gT, group_L, cache_layer_L: KV groups (``paged_jax.kv_groups``;
      None without them): each group's block tables and slots, and each decoder layer's
      group and cache layer. With them ``block_tables_SP`` and ``slots_T`` are group 0's;
      a layer reads its own through ``for_layer``.
  """

  slots_T: jax.Array
  kv_lens_S: jax.Array
  block_tables_SP: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  block_tables_gSP: jax.Array | None = None
  slots_gT: jax.Array | None = None
  group_L: jax.Array | None = None
  cache_layer_L: jax.Array | None = None

  def _group_zero(self) -> tuple:
    """With groups: the fields holding group 0's slots and tables, described."""
    return (("metadata.slots_T, KV group 0's", self.slots_T),
            ("metadata.block_tables_SP, KV group 0's", self.block_tables_SP))

  def for_layer(self, layer) -> tuple[Any, jax.Array, jax.Array]:
    """``(cache_layer, slots_T, block_tables_SP)`` of decoder layer ``layer`` (an int or a
    traced scalar): what its ``cache.write`` and ``paged_attention`` take. Without groups
    that is ``(layer, self.slots_T, self.block_tables_SP)``."""
    if self.group_L is None:
      return layer, self.slots_T, self.block_tables_SP
    kv_cache.note_misused(*self._group_zero())
    # Indexing would clamp a layer past L to layer L - 1 (another layer's K/V, no error).
    num_layers = self.group_L.shape[0]
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
      if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} must be in [0, L={num_layers})")
      g = self.group_L[layer]
      return self.cache_layer_L[layer], self.slots_gT[g], self.block_tables_gSP[g]
    kv_cache.note_misused(("the layer index given to metadata.for_layer, not the cache "
                           "layer it returns", layer))
    inside = (layer >= 0) & (layer < num_layers)  # traced: outside, a cache layer of -1,
    clipped = jnp.clip(layer, 0, num_layers - 1)   # which writes and reads nothing
    g = self.group_L[clipped]
    return (jnp.where(inside, self.cache_layer_L[clipped], -1), self.slots_gT[g],
            self.block_tables_gSP[g])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """One step's packed inputs (``prepare_step``).

  Attributes:
    tokens_T: i32[T] new tokens of the kept sequences, packed in slot order; padding 0.
    positions_T: i32[T] position of each token in its sequence (padding 0).
    metadata: the ``AttentionMetadata`` of this batch.
    q_lens_S: i32[S] tokens of each sequence in this step (0: idle or dropped).
    ok_S: bool[S] ``append`` succeeded and the tokens fit ``T`` (a request of 0 is ok).
    last_S: i32[S] row of each sequence's last new token (``logits_indices``); meaningless
      where ``q_lens_S`` is 0.
  """

  tokens_T: jax.Array
  positions_T: jax.Array
  metadata: AttentionMetadata
  q_lens_S: jax.Array
  ok_S: jax.Array
  last_S: jax.Array


def _exclusive_cumsum(x_S: jax.Array, cap: int | None = None) -> jax.Array:
  """i32[S + 1]: 0, x0, x0 + x1, ...; with ``cap``, each sum is ``min(sum, cap)`` (the
  non-negative counts are clipped to ``cap`` first), so huge counts cannot wrap int32."""
  if cap is None:
    sums_S = jnp.cumsum(x_S, dtype=jnp.int32)
  else:  # min(a + b, cap) is associative for a, b in [0, cap]; 2 * cap fits int32
    sums_S = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap),
                                      jnp.clip(x_S.astype(jnp.int32), 0, cap))
  return jnp.concatenate([jnp.zeros(1, jnp.int32), sums_S])


def _row_owner(cu: jax.Array, num_rows: int) -> jax.Array:
  """i32[T]: the sequence owning each row of a layout with offsets ``cu`` (clipped)."""
  t = jnp.arange(num_rows, dtype=jnp.int32)
  return jnp.clip(metadata.search_right(cu, t) - 1, 0, cu.shape[0] - 2)


def _pack_rows(values_T: jax.Array, counts_S: jax.Array, keep_S: jax.Array) -> jax.Array:
  """Repack rows laid out by ``counts_S`` so that only sequences with ``keep_S`` remain.

  Row ``cu[s] + j`` (``cu`` the exclusive cumsum of ``counts_S``) moves to ``cu'[s] + j``,
  ``cu'`` that of ``where(keep_S, counts_S, 0)``; rows of dropped sequences and padding rows
  become 0.
  """
  num_rows = values_T.shape[0]
  cu = _exclusive_cumsum(counts_S, cap=num_rows + 1)
  cu_kept = _exclusive_cumsum(jnp.where(keep_S, counts_S, 0))
  t = jnp.arange(num_rows, dtype=jnp.int32)
  seq_T = _row_owner(cu, num_rows)
  live_T = (t < cu[-1]) & keep_S[seq_T]
  dest_T = jnp.where(live_T, cu_kept[seq_T] + t - cu[seq_T], num_rows)
  return jnp.zeros_like(values_T).at[dest_T].set(values_T, mode="drop")


def _as_int_array(name: str, x) -> jax.Array:
  """``x`` as a JAX array; a host integer array whose values do not fit int32 is refused
  (cast, they would wrap: 2**32 + 3 new tokens taken as 3)."""
  validation.check_int32_range(name, x)
  return jnp.asarray(x)


def _check_alloc_state(alloc_state) -> None:
  if not isinstance(alloc_state, allocator.AllocatorState):
    raise ValueError(f"alloc_state={type(alloc_state).__name__} must be an "
                     "allocator.AllocatorState")


def _check_step_args(alloc_state, tokens_T, num_new_S) -> None:
  _check_alloc_state(alloc_state)
  if tokens_T.ndim != 1 or not jnp.issubdtype(tokens_T.dtype, jnp.integer):
    raise ValueError(f"tokens.shape={tuple(tokens_T.shape)} dtype={tokens_T.dtype} must be "
                     "an integer [T]")
  num_seq_rows = alloc_state.max_seqs
  if num_new_S.shape != (num_seq_rows,) or not jnp.issubdtype(num_new_S.dtype, jnp.integer):
    raise ValueError(f"num_new.shape={tuple(num_new_S.shape)} dtype={num_new_S.dtype} must "
                     f"be an integer [S]=[{num_seq_rows}] (the allocator's max_seqs)")


@standard_promotion
def prepare_step(alloc_state: allocator.AllocatorState, tokens_T: jax.Array,
                 num_new_S: jax.Array, *, kv_groups=None
                 ) -> tuple[allocator.AllocatorState, StepInputs]:
  """Allocate this step's tokens and pack the model's inputs (module docstring).

  Args:
    alloc_state: allocator state; sequence s is allocator slot s.
    tokens_T: i32[T] new tokens, packed by sequence in slot order, then padding.
    num_new_S: i32[S] new tokens of each sequence (0 for idle ones).
    kv_groups: the model's ``KVGroups`` when the allocator has several groups (their
      windows must be the allocator's); the metadata then carries every group's tables.

  Returns:
    ``(alloc_state, inputs)``: the grown allocator state and the ``StepInputs``. A sequence
    whose ``append`` failed, or whose tokens would run past ``T``, has ``ok_S`` False, no
    rows, no new K/V and an unchanged length; the others' rows are packed without a gap.
  """
  tokens_T, num_new_S = _as_int_array("tokens", tokens_T), _as_int_array("num_new", num_new_S)
  _check_step_args(alloc_state, tokens_T, num_new_S)
  grouped = alloc_state.num_groups > 1
  if grouped and (kv_groups is None or tuple(kv_groups.windows) != alloc_state.windows):
    raise ValueError(f"kv_groups={kv_groups!r} must be the KVGroups whose windows are the "
                     f"allocator's {alloc_state.windows}")
  num_new_S = num_new_S.astype(jnp.int32)
  num_tokens = tokens_T.shape[0]
  old_lens_S = alloc_state.seq_lens
  # A sequence whose tokens would run past T is refused rather than given K/V slots that
  # nothing writes (the running sums saturate past T: 2**31 - 1 tokens cannot wrap them).
  # A request of 0 always fits. Negative requests: refused by append.
  counts_S = jnp.maximum(num_new_S, 0)
  fits_S = (_exclusive_cumsum(counts_S, cap=num_tokens + 1)[1:] <= num_tokens) | (
      counts_S == 0)
  alloc_state, ok_S = allocator.append(alloc_state, jnp.where(fits_S, num_new_S, 0))
  ok_S &= fits_S
  q_lens_S = jnp.where(ok_S, counts_S, 0)
  tokens_T = _pack_rows(tokens_T.astype(jnp.int32), counts_S, ok_S)

  cu_q_lens = _exclusive_cumsum(q_lens_S)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = _row_owner(cu_q_lens, num_tokens)
  live_T = t < cu_q_lens[-1]
  positions_T = jnp.where(live_T, old_lens_S[seq_T] + t - cu_q_lens[seq_T], 0)
  slots = jnp.where(live_T, allocator.slots(alloc_state, seq_T, positions_T),
                    allocator.PAD_SLOT)  # [T], or [g, T] with groups
  groups = {}
  if grouped:
    group_L, cache_layer_L = kv_groups.layer_arrays()
    groups = dict(block_tables_gSP=alloc_state.block_tables, slots_gT=slots,
                  group_L=group_L, cache_layer_L=cache_layer_L)
  metadata = AttentionMetadata(
      slots_T=slots[0] if grouped else slots, kv_lens_S=alloc_state.seq_lens,
      block_tables_SP=alloc_state.block_tables[0] if grouped else alloc_state.block_tables,
      cu_q_lens=cu_q_lens, num_seqs=jnp.int32(alloc_state.max_seqs), **groups)
  last_S = jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1)
  return alloc_state, StepInputs(tokens_T=tokens_T, positions_T=positions_T,
                                 metadata=metadata, q_lens_S=q_lens_S, ok_S=ok_S,
                                 last_S=last_S)


def paged_forward_checked(model, cache, inputs: StepInputs, **kwargs):
  """``model.paged_forward`` over ``inputs``; with KV groups, a write or an attention given
  group 0's slots or tables, or the raw traced index given to ``for_layer``, is refused."""
  m = inputs.metadata
  with kv_cache.recording(m._group_zero() if m.group_L is not None else ()):
    return model.paged_forward(inputs.tokens_T, inputs.positions_T, cache, m, **kwargs)


class EveryRow(NamedTuple):
  """Every row's logits of a ``forward_step(..., every_row=True)``: ``logits_TV``, the
  sequence and position of each row (``seq_T``, ``positions_T``), and ``live_T`` (False on
  padding rows, whose logits mean nothing)."""

  logits_TV: jax.Array
  seq_T: jax.Array
  positions_T: jax.Array
  live_T: jax.Array


@standard_promotion
def forward_step(model, alloc_state: allocator.AllocatorState, cache, tokens_T: jax.Array,
                 num_new_S: jax.Array, *, kv_groups=None, every_row: bool = False,
                 **forward_kwargs):
  """One ragged step (prefill, chunked prefill, decode, or a mix); traceable, not jitted.

  Args:
    model: any model with ``paged_forward`` (``paged_jax.protocol``).
    alloc_state, tokens_T, num_new_S, kv_groups: as ``prepare_step``.
    cache: the ``KVCache``.
    every_row: also return the logits of every row (``paged_forward`` with
      ``logits_indices=None``: T x V logits, for prompt log-probs), as a fifth element,
      ``EveryRow``.
    **forward_kwargs: passed on to ``model.paged_forward`` (e.g. the built-in decoders'
      ``impl=``).

  Returns:
    ``(logits_SV, alloc_state, cache, ok_S)``: logits of each sequence's last new token
    (zero rows for sequences with no token this step or whose allocation failed), the new
    allocator state and cache, and ``ok_S``; with ``every_row``, then an ``EveryRow``.
  """
  protocol.check_model(model)
  _check_alloc_state(alloc_state)  # before the cache's cross-check reads its fields
  if jnp.ndim(tokens_T) == 1 and jnp.shape(tokens_T)[0] == 0:
    raise ValueError("tokens.shape=(0,): a forward step needs T >= 1 rows (its logits are "
                     "read at each sequence's last row)")
  for name in ("block_size", "num_blocks"):
    # The allocator's slots address this cache's blocks: a cache of another block size
    # or fewer blocks would be written and read at the wrong places, without an error.
    have, want = getattr(cache, name, None), getattr(alloc_state, name)
    if have is not None and int(have) != int(want):
      raise ValueError(f"cache.{name}={have} must equal alloc_state.{name}={want}: the "
                       "allocator hands out this cache's blocks (make both from one spec)")
  alloc_state, inputs = prepare_step(alloc_state, tokens_T, num_new_S, kv_groups=kv_groups)
  try:
    out = paged_forward_checked(model, cache, inputs,
                                logits_indices=None if every_row else inputs.last_S,
                                **forward_kwargs)
  except ValueError as e:
    if hasattr(e, "add_note") and "trace level" in str(e):  # Flax's, from an nnx transform
      e.add_note(f"(raised in {type(model).__name__}.paged_forward: a model that runs Flax "
                 "transforms (nnx.scan over layers) must be built at the trace level it runs "
                 "at; inside a jax.lax.scan or while_loop body, merge it there: "
                 "graphdef, state = nnx.split(model) outside, then nnx.merge(graphdef, "
                 "jax.tree.map(lambda x: x, state)) in the body; LLM and Steps do this)")
    elif hasattr(e, "add_note") and "metadata.for_layer" not in str(e):  # Python 3.11+
      dims = tuple(getattr(cache, n, "?") for n in ("num_layers", "num_kv_heads", "head_dim"))
      source = ("num_layers (with KV groups: the layers of one group; each layer's cache "
                "layer comes from metadata.for_layer(layer))"
                if inputs.metadata.group_L is not None else "num_layers")
      e.add_note(f"(raised in {type(model).__name__}.paged_forward; the cache's L, K, D "
                 f"{dims} come from the config's {source}, num_kv_heads and head_dim: "
                 "they must match the model)")
    raise
  if (not isinstance(out, (tuple, list)) or len(out) != 2
      or not isinstance(out[0], jax.Array) or type(out[1]) is not type(cache)):
    name = lambda x: (f"an array {list(x.shape)}" if isinstance(x, jax.Array)
                      else f"a {type(x).__name__}")
    what = (f"a {type(out).__name__} of {len(out)} ({', '.join(map(name, out))})"
            if isinstance(out, (tuple, list)) else name(out))
    raise ValueError(f"{type(model).__name__}.paged_forward returned {what}; it must return "
                     f"(logits, cache): the logits array, then the {type(cache).__name__}")
  if all(a is b for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(cache))):
    raise ValueError(f"{type(model).__name__}.paged_forward returned the cache it was given: "
                     "its layers must store their K/V with cache = cache.write(layer, k_TKD, "
                     "v_TKD, metadata.slots_T) and return that cache (else every later "
                     "step attends to K/V never written)")
  logits_SV, cache = out
  num_seq_rows = alloc_state.max_seqs
  if every_row:
    logits_TV = logits_SV
    num_rows = inputs.tokens_T.shape[0]
    if logits_TV.ndim != 2 or logits_TV.shape[0] != num_rows:
      raise ValueError(f"{type(model).__name__}.paged_forward returned logits of shape "
                       f"{tuple(logits_TV.shape)}; with logits_indices=None it must return "
                       f"[T, V]=[{num_rows}, V]")
    logits_SV = logits_TV[inputs.last_S]
    m = inputs.metadata
    seq_T = _row_owner(m.cu_q_lens, num_rows)
    rows = EveryRow(logits_TV=logits_TV, seq_T=seq_T, positions_T=inputs.positions_T,
                    live_T=jnp.arange(num_rows) < m.cu_q_lens[-1])
  if logits_SV.ndim != 2 or logits_SV.shape[0] != num_seq_rows:
    raise ValueError(f"{type(model).__name__}.paged_forward returned logits of shape "
                     f"{tuple(logits_SV.shape)}; with logits_indices i32[{num_seq_rows}] it "
                     f"must return [S, V]=[{num_seq_rows}, V]")
  logits_SV = jnp.where((inputs.q_lens_S > 0)[:, None], logits_SV, 0)
  if every_row:
    return logits_SV, alloc_state, cache, inputs.ok_S, rows
  return logits_SV, alloc_state, cache, inputs.ok_S


@standard_promotion
def decode_step(model, alloc_state: allocator.AllocatorState, cache, tokens_S: jax.Array,
                active_S: jax.Array, **forward_kwargs):
  """One decode token for every active sequence; traceable, not jitted.

  Args:
    tokens_S: i32[S] the next token of sequence s at row s (ignored where not active).
    active_S: bool[S] sequences that decode this step.

  Returns:
    ``(logits_SV, alloc_state, cache, ok_S)`` as ``forward_step``.
  """
  _check_alloc_state(alloc_state)
  tokens_S, active_S = _as_int_array("tokens", tokens_S), jnp.asarray(active_S)
  num_seq_rows = alloc_state.max_seqs
  for name, x, kind, what in (("tokens", tokens_S, jnp.integer, "ints"),
                              ("active", active_S, jnp.bool_, "bools")):
    if x.shape != (num_seq_rows,) or not jnp.issubdtype(x.dtype, kind):
      raise ValueError(f"{name}.shape={tuple(x.shape)} dtype={x.dtype} must be {what} "
                       f"[S]=[{num_seq_rows}]")
  num_new_S = active_S.astype(jnp.int32)
  tokens_T = _pack_rows(tokens_S.astype(jnp.int32), jnp.ones_like(num_new_S), active_S)
  return forward_step(model, alloc_state, cache, tokens_T, num_new_S, **forward_kwargs)


@standard_promotion
def tokens_from_history(tokens_SJ: jax.Array, start_S: jax.Array, num_new_S: jax.Array,
                        num_tokens: int) -> jax.Array:
  """i32[T]: the new tokens ``tokens_SJ[s, start_S[s] : start_S[s] + num_new_S[s]]`` of
  every sequence, packed in slot order (``prepare_step``'s layout), zero padded to
  ``num_tokens``. Typically ``start_S`` is the allocator's ``seq_lens`` (the tokens
  already cached) and ``tokens_SJ`` each sequence's history.

  A window must lie inside the history (``0 <= start`` and ``start + num_new <= M`` where
  ``num_new > 0``): concrete inputs that break this are a ``ValueError``; under ``jit``
  positions outside ``[0, M)`` give token 0, never a neighbouring column's token.
  """
  if (isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer))
      or num_tokens < 1):
    raise ValueError(f"{num_tokens=} must be an int >= 1 (the step's rows, static)")
  tokens_SJ = _as_int_array("tokens_SJ", tokens_SJ)
  start_S, num_new_S = _as_int_array("start", start_S), _as_int_array("num_new", num_new_S)
  if tokens_SJ.ndim != 2 or not jnp.issubdtype(tokens_SJ.dtype, jnp.integer):
    raise ValueError(f"tokens_SJ.shape={tuple(tokens_SJ.shape)} dtype={tokens_SJ.dtype} must "
                     "be an integer [S, J]")
  num_seq_rows, max_len = tokens_SJ.shape
  for name, x in (("start", start_S), ("num_new", num_new_S)):
    if x.shape != (num_seq_rows,) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name}.shape={tuple(x.shape)} dtype={x.dtype} must be an integer "
                       f"[S]=[{num_seq_rows}]")
  if not any(isinstance(x, jax.core.Tracer) for x in (start_S, num_new_S)):
    start, count = np.asarray(start_S, np.int64), np.asarray(num_new_S, np.int64)
    bad = np.flatnonzero((count > 0) & ((start < 0) | (start + count > max_len)))
    if bad.size:
      s = int(bad[0])
      raise ValueError(f"start[{s}]={start[s]}, num_new[{s}]={count[s]}: the window "
                       f"[{start[s]}, {start[s] + count[s]}) must lie inside the history "
                       f"[0, M={max_len})")
  counts_S = jnp.maximum(num_new_S.astype(jnp.int32), 0)
  cu = _exclusive_cumsum(counts_S, cap=num_tokens + 1)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = _row_owner(cu, num_tokens)
  pos_T = start_S.astype(jnp.int32)[seq_T] + t - cu[seq_T]
  inside_T = (t < cu[-1]) & (pos_T >= 0) & (pos_T < max_len)
  return jnp.where(inside_T, tokens_SJ[seq_T, jnp.clip(pos_T, 0, max_len - 1)], 0
                   ).astype(jnp.int32)


def _frozen(kwargs: dict) -> tuple:
  return tuple(sorted(kwargs.items()))


@functools.partial(jax.jit, static_argnames=("graphdef", "kwargs"),
                   donate_argnames=("alloc_state", "cache"))
def _forward_jit(graphdef, params, alloc_state, cache, tokens_T, num_new_S, *, kwargs):
  return forward_step(protocol.merge(graphdef, params), alloc_state, cache, tokens_T,
                      num_new_S, **dict(kwargs))


@functools.partial(jax.jit, static_argnames=("graphdef", "kwargs"),
                   donate_argnames=("alloc_state", "cache"))
def _decode_jit(graphdef, params, alloc_state, cache, tokens_S, active_S, *, kwargs):
  return decode_step(protocol.merge(graphdef, params), alloc_state, cache, tokens_S,
                     active_S, **dict(kwargs))


class Steps:
  """Jitted ``forward`` / ``decode`` of one model, the allocator state and cache donated.

  The model (any ``flax.nnx.Module`` with ``paged_forward``) is split once (``nnx.split``)
  so each call is a plain ``jax.jit`` dispatch; the graph definition is static, so a step
  compiles once per input shape (one ``T`` for ``forward``, one ``S`` for ``decode``: pad to
  fixed sizes). The parameters are an argument of each call, not part of the compilation:
  ``Steps`` keeps the state ``nnx.split`` returned at construction, which under Flax 0.12
  (tested) holds the model's own Variables, so an in-place update of their values
  (``nnx.update``, an optimizer step) is used by the next call, with no recompilation. A
  submodule or Variable replaced by a new object, or a Python value ``paged_forward`` read
  while tracing, is not: build a new ``Steps`` then. (``LLM`` keeps its parameters alike;
  on a mesh, sharded copies.) ``forward_kwargs`` (hashable values) go to
  ``paged_forward``.

  Usage::

    steps = Steps(model)
    logits_SV, alloc_state, cache, ok_S = steps.forward(alloc_state, cache, tokens_T, num_new_S)
    logits_SV, alloc_state, cache, ok_S = steps.decode(alloc_state, cache, tokens_S, active_S)
  """

  def __init__(self, model, **forward_kwargs: Any):
    protocol.check_model(model, serving=True)
    graphdef, self.params = nnx.split(model)
    self.graphdef = protocol.static_graphdef(graphdef)
    self.forward_kwargs = _frozen(forward_kwargs)

  def forward(self, alloc_state, cache, tokens_T, num_new_S):
    """``forward_step`` jitted; ``alloc_state`` and ``cache`` are donated."""
    tokens_T, num_new_S = _device_args(tokens=tokens_T, num_new=num_new_S)
    return _forward_jit(self.graphdef, self.params, alloc_state, cache, tokens_T, num_new_S,
                        kwargs=self.forward_kwargs)

  prefill = forward  # the name of the built-in models' first release

  def decode(self, alloc_state, cache, tokens_S, active_S):
    """``decode_step`` jitted; ``alloc_state`` and ``cache`` are donated."""
    tokens_S, active_S = _device_args(tokens=tokens_S, active=active_S)
    return _decode_jit(self.graphdef, self.params, alloc_state, cache, tokens_S, active_S,
                       kwargs=self.forward_kwargs)


def _device_args(**inputs) -> list:
  """``Steps``' token inputs as JAX arrays before the jitted call: lists (which ``jit``
  would trace item by item) and NumPy arrays (another signature than a JAX array of the
  same shape: a second compilation) alike; host integers past int32 refused by name."""
  # validation.host_int32: host integers as int32 (under x64 too), range checked by name.
  return [x if isinstance(x, jax.Array) else jnp.asarray(validation.host_int32(name, np.asarray(x)))
          for name, x in inputs.items()]
