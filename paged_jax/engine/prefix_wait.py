"""Which new sequences sit out a step for a block another sequence is about to fill
(``device.schedule_step``'s prefix cache, step 0): attaching it a step later beats computing
and holding a copy of it."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["waits_for_fill"]


def waits_for_fill(alloc, tokens_SJ, salt_S, hit_SP, hit_S, base_S, len_S, empty_S, rank_S):
  """bool[S]: the new sequences (``empty_S``) that sit out this step because one ahead of
  them in its order (``rank_S``) will fill the block their hit stops at: it wants tokens,
  holds (or is about to attach) the same block one level up (the same salt at level 0),
  has the same Z tokens at that level and has not computed them yet. Blocks are registered
  after the forward, so the two would otherwise compute and hold a copy each; next step the
  block is registered and the waiting one attaches it. Only a level the waiting sequence
  may hit (not its last token's) counts. The first in the order never waits."""
  num_slots, max_len = tokens_SJ.shape
  z = alloc.block_size
  anchor = alloc.windows.index(None)  # the group prefix hits follow (a full one)
  tables_SP = alloc.block_tables if alloc.block_tables.ndim == 2 else alloc.block_tables[anchor]
  hits_SP = hit_SP if hit_SP.ndim == 2 else hit_SP[anchor]
  end_S = (hit_S + 1) * z  # the tokens through the level each sequence computes first
  up_S = jnp.maximum(hit_S - 1, 0)  # the level above it, where its hit ends
  held_SP = jnp.where((alloc.seq_lens > 0)[:, None], tables_SP, hits_SP)
  # [a, b]: what sequence a holds at b's level above, against b's hit there.
  same_parent_SS = jnp.where(hit_S[None, :] == 0, salt_S[:, None] == salt_S[None, :],
                             held_SP[:, up_S] == hits_SP[jnp.arange(num_slots), up_S][None, :])
  cols_SZ = jnp.clip(hit_S[:, None] * z + jnp.arange(z)[None, :], 0, max_len - 1)
  same_block_SS = jnp.all(tokens_SJ[:, cols_SZ]
                          == jnp.take_along_axis(tokens_SJ, cols_SZ, axis=1)[None], axis=-1)
  fills_SS = (base_S[:, None] < end_S[None, :]) & (len_S[:, None] >= end_S[None, :])
  # Ahead in the order: wanting tokens (who wants none sorts last), and a new sequence
  # always wants its last token at least.
  ahead_SS = rank_S[:, None] < rank_S[None, :]
  may_hit_S = empty_S & (end_S <= len_S - 1)
  return may_hit_S & jnp.any(ahead_SS & fills_SS & same_parent_SS & same_block_SS, axis=0)
