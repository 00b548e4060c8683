"""Per-token metadata of a ragged batch, shared by the jnp implementations."""

from __future__ import annotations

import jax.numpy as jnp


def search_right(sorted_a, v):
  """``jnp.searchsorted(sorted_a, v, side="right")`` as int32, with no loop in the program.

  jnp's default method is a ``while`` loop of log2(len(a)) steps; these searches run
  inside every attention call (and the XLA path's loop body), where XLA on a GPU runs a
  ``while`` as a loop of small kernels decided step by step. ``scan_unrolled`` is the same
  binary search unrolled: one gather and compare per step, the same cost on CPU. (At one
  step, len(a) = 1, jax still emits a one-trip ``while``: up to 16 entries each query is
  compared with all of them instead, which is no dearer.)
  """
  method = "compare_all" if sorted_a.shape[0] <= 16 else "scan_unrolled"
  return jnp.searchsorted(sorted_a, v, side="right", method=method).astype(jnp.int32)


def token_sequence_ids(cu_q_lens, num_seqs, num_tokens: int):
  """For each query row t: ``(seq_T, live_T)``.

  ``seq_T[t]`` is the sequence i with ``cu_q_lens[i] <= t < cu_q_lens[i + 1]`` (empty
  sequences never own a row); ``live_T[t]`` is False for padding rows, those at or past
  ``cu_q_lens[num_seqs]``. Entries of ``cu_q_lens`` past ``num_seqs`` are padding and may
  hold anything (zeros, garbage): the search sees them as ``cu_q_lens[num_seqs]``.
  """
  num_seq_rows = cu_q_lens.shape[0] - 1
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  # Clipped to [0, S]: a traced -1 would index cu_q_lens[-1] (every row live, all read as
  # sequence 0's); the kernels treat it as no live sequence.
  num_seqs = jnp.clip(jnp.asarray(num_seqs, jnp.int32), 0, num_seq_rows)
  end = cu_q_lens[num_seqs]
  live_cu = jnp.where(jnp.arange(num_seq_rows + 1) <= num_seqs, cu_q_lens, end)
  seq_T = search_right(live_cu, t) - 1
  seq_T = jnp.clip(seq_T, 0, num_seq_rows - 1)
  live_T = t < end
  return seq_T, live_T


def query_positions(t, seq, kv_lens_S, cu_q_lens):
  """Position in its sequence of query row ``t`` of sequence ``seq``.

  The queries of a sequence are its last ``q_len`` tokens: row ``cu_q_lens[i] + j`` sits at
  ``kv_lens[i] - q_len_i + j``.
  """
  q_start = cu_q_lens[seq]
  q_len = cu_q_lens[seq + 1] - q_start
  return kv_lens_S[seq] - q_len + (t - q_start)


def tile_sequence_items(cu_q_lens, num_seqs, *, num_tokens: int, q_tile: int,
                        num_items: int, skip_S=None):
  """Enumerate the work items of a ragged batch: (query tile, sequence) pairs, token order.

  A tile of ``q_tile`` consecutive query rows that spans a sequence boundary yields one item
  per sequence it touches; empty and padding sequences yield none, nor do those marked in
  ``skip_S`` (bool[S], optional: rows another path serves). Every implementation
  that tiles queries (the XLA path, the TPU and GPU kernels) shares this enumeration.

  Returns ``(seq_W, tile_W, live_W, q_start_S, q_end_S)``: each item's sequence and tile,
  whether it is a real item (items past the last are dead; their seq and tile are
  meaningless), and each sequence's query row range clipped to ``[0, num_tokens]``.
  """
  num_seq_rows = cu_q_lens.shape[0] - 1
  q_start_S = jnp.clip(cu_q_lens[:-1], 0, num_tokens)
  q_end_S = jnp.clip(cu_q_lens[1:], 0, num_tokens)
  live_S = (jnp.arange(num_seq_rows) < num_seqs) & (q_end_S > q_start_S)
  if skip_S is not None:
    live_S &= ~skip_S
  first_tile_S = q_start_S // q_tile
  tiles_S = jnp.where(live_S, (q_end_S - 1) // q_tile - first_tile_S + 1, 0)
  tiles_end_S = jnp.cumsum(tiles_S)
  w = jnp.arange(num_items, dtype=jnp.int32)
  seq_W = jnp.minimum(search_right(tiles_end_S, w), num_seq_rows - 1)
  live_W = w < tiles_end_S[-1]
  tile_W = (first_tile_S[seq_W] + w - (tiles_end_S - tiles_S)[seq_W]).astype(jnp.int32)
  return seq_W, tile_W, live_W, q_start_S, q_end_S
