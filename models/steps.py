"""Jitted prefill / decode steps: allocate, write K/V, attend, in one call.

Each step threads the allocator state (``paged_jax.allocator.AllocatorState``) and the KV
cache through one jitted function, both donated, so the pool is updated in place:

1. ``allocator.append(state, num_new_S)`` grows each sequence (all-or-nothing, ok_S).
2. The new tokens get their positions (each sequence's old length + j) and their flat slots
   (``allocator.slots``).
3. ``Decoder.paged_forward`` writes K/V and attends, with the allocator's block tables and
   lengths as the attention metadata (row s of the metadata is allocator slot s).
4. Logits of each sequence's last new token come back, ``[S, V]``.

Batch layout (S = ``max_seqs`` of the allocator): ``tokens_T`` holds the new tokens of
sequence 0, then of sequence 1, ... (``num_new_S[s]`` each, in slot order), then padding.
A sequence whose tokens would run past ``T``, or whose ``append`` fails, gets ok False and is
dropped from the step: its tokens are neither written nor attended, its row of
the logits is zero, and the host may preempt and retry. Decode is the same step with one
token per active sequence, given at the sequence's own row: ``tokens_S``, ``active_S``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import KVCache
from paged_jax import allocator
from paged_jax.models.decoder import AttentionMetadata, Decoder


def _pack_rows(values_T: jax.Array, counts_S: jax.Array, keep_S: jax.Array) -> jax.Array:
  """Repack rows laid out by ``counts_S`` so that only sequences with ``keep_S`` remain.

  Row ``cu[s] + j`` (``cu`` the exclusive cumsum of ``counts_S``) moves to ``cu'[s] + j``,
  ``cu'`` that of ``where(keep_S, counts_S, 0)``; rows of dropped sequences and padding rows
  become 0.
  """
  num_rows, num_seq_rows = values_T.shape[0], counts_S.shape[0]
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts_S)])
  kept_S = jnp.where(keep_S, counts_S, 0)
  cu_kept = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(kept_S)])
  t = jnp.arange(num_rows, dtype=jnp.int32)
  seq_T = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, num_seq_rows - 1)
  live_T = (t < cu[-1]) & keep_S[seq_T]
  dest_T = jnp.where(live_T, cu_kept[seq_T] + t - cu[seq_T], num_rows)
  return jnp.zeros_like(values_T).at[dest_T].set(values_T, mode="drop")


def prefill_step(model: Decoder, alloc_state: allocator.AllocatorState, cache: KVCache,
                 tokens_T: jax.Array, num_new_S: jax.Array, *, impl: str | None = None):
  """One ragged step (prefill, chunked prefill, decode, or a mix); traceable, not jitted.

  Args:
    model: the decoder.
    alloc_state: allocator state; sequence s is allocator slot s.
    cache: the KV cache.
    tokens_T: i32[T] new tokens, packed by sequence in slot order (module docstring).
    num_new_S: i32[S] new tokens of each sequence this step (0 for idle ones).
    impl: ``paged_attention`` implementation, default the model's.

  Returns:
    ``(logits_SV, alloc_state, cache, ok_S)``: logits of each sequence's last new token
    (zero rows for sequences with no token this step or whose allocation failed), the new
    allocator state and cache, and ``append``'s ok_S.
  """
  if tokens_T.ndim != 1:
    raise ValueError(f"tokens.shape={tuple(tokens_T.shape)} must be [T]")
  num_seq_rows = alloc_state.max_seqs
  if num_new_S.shape != (num_seq_rows,):
    raise ValueError(f"num_new.shape={tuple(num_new_S.shape)} must be [S]=[{num_seq_rows}] "
                     "(the allocator's max_seqs)")
  num_new_S = num_new_S.astype(jnp.int32)
  num_tokens = tokens_T.shape[0]
  old_lens_S = alloc_state.seq_lens
  # Layout of tokens_T; a sequence whose tokens would run past T is refused (ok False)
  # rather than given K/V slots that nothing writes. Negative requests: refused by append.
  counts_S = jnp.maximum(num_new_S, 0)
  fits_S = jnp.cumsum(counts_S) <= num_tokens
  alloc_state, ok_S = allocator.append(alloc_state, jnp.where(fits_S, num_new_S, 0))
  ok_S &= fits_S
  q_lens_S = jnp.where(ok_S, counts_S, 0)
  tokens_T = _pack_rows(tokens_T.astype(jnp.int32), counts_S, ok_S)

  cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens_S)])
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seq_rows - 1)
  live_T = t < cu_q_lens[-1]
  positions_T = jnp.where(live_T, old_lens_S[seq_T] + t - cu_q_lens[seq_T], 0)
  slots_T = jnp.where(live_T, allocator.slots(alloc_state, seq_T, positions_T),
                      allocator.PAD_SLOT)
  metadata = AttentionMetadata(
      slots_T=slots_T, kv_lens_S=alloc_state.seq_lens,
      block_tables_SP=alloc_state.block_tables, cu_q_lens=cu_q_lens,
      num_seqs=jnp.int32(num_seq_rows))
  last_S = jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1)
  logits_SV, cache = model.paged_forward(tokens_T, positions_T, cache, metadata,
                                         logits_indices=last_S, impl=impl)
  logits_SV = jnp.where((q_lens_S > 0)[:, None], logits_SV, 0)
  return logits_SV, alloc_state, cache, ok_S


def decode_step(model: Decoder, alloc_state: allocator.AllocatorState, cache: KVCache,
                tokens_S: jax.Array, active_S: jax.Array, *, impl: str | None = None):
  """One decode token for every active sequence; traceable, not jitted.

  Args:
    tokens_S: i32[S] the next token of sequence s at row s (ignored where not active).
    active_S: bool[S] sequences that decode this step.

  Returns:
    ``(logits_SV, alloc_state, cache, ok_S)`` as ``prefill_step``.
  """
  num_seq_rows = alloc_state.max_seqs
  for name, x in (("tokens", tokens_S), ("active", active_S)):
    if x.shape != (num_seq_rows,):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [S]=[{num_seq_rows}]")
  num_new_S = active_S.astype(jnp.int32)
  tokens_T = _pack_rows(tokens_S.astype(jnp.int32), jnp.ones_like(num_new_S), active_S)
  return prefill_step(model, alloc_state, cache, tokens_T, num_new_S, impl=impl)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"),
                   donate_argnames=("alloc_state", "cache"))
def _prefill_jit(graphdef, params, alloc_state, cache, tokens_T, num_new_S, *, impl):
  return prefill_step(nnx.merge(graphdef, params), alloc_state, cache, tokens_T, num_new_S,
                      impl=impl)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"),
                   donate_argnames=("alloc_state", "cache"))
def _decode_jit(graphdef, params, alloc_state, cache, tokens_S, active_S, *, impl):
  return decode_step(nnx.merge(graphdef, params), alloc_state, cache, tokens_S, active_S,
                     impl=impl)


class Steps:
  """Jitted ``prefill`` / ``decode`` of one model, the allocator state and cache donated.

  The model is split once (``nnx.split``) so each call is a plain ``jax.jit`` dispatch; the
  graph definition and ``impl`` are static, so a step compiles once per input shape (one
  ``T`` for prefill, one ``S`` for decode: pad to fixed sizes). The parameters are the
  model's at construction time; build a new ``Steps`` after changing them.

  Usage::

    steps = Steps(model)
    logits_SV, alloc_state, cache, ok_S = steps.prefill(alloc_state, cache, tokens_T, num_new_S)
    logits_SV, alloc_state, cache, ok_S = steps.decode(alloc_state, cache, tokens_S, active_S)
  """

  def __init__(self, model: Decoder, *, impl: str | None = None):
    if not isinstance(model, Decoder):
      raise ValueError(f"model={type(model).__name__} must be a models.Decoder")
    self.graphdef, self.params = nnx.split(model)
    self.impl = model.impl if impl is None else impl

  def prefill(self, alloc_state, cache, tokens_T, num_new_S):
    """``prefill_step`` jitted; ``alloc_state`` and ``cache`` are donated."""
    return _prefill_jit(self.graphdef, self.params, alloc_state, cache, tokens_T, num_new_S,
                        impl=self.impl)

  def decode(self, alloc_state, cache, tokens_S, active_S):
    """``decode_step`` jitted; ``alloc_state`` and ``cache`` are donated."""
    return _decode_jit(self.graphdef, self.params, alloc_state, cache, tokens_S, active_S,
                       impl=self.impl)
