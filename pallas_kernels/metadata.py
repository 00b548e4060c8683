"""Per-token metadata of a ragged batch, shared by the jnp implementations."""

from __future__ import annotations

import jax.numpy as jnp


def token_sequence_ids(cu_q_lens, num_seqs, num_tokens: int):
  """For each query row t: ``(seq_T, live_T)``.

  ``seq_T[t]`` is the sequence i with ``cu_q_lens[i] <= t < cu_q_lens[i + 1]`` (empty
  sequences never own a row); ``live_T[t]`` is False for padding rows, those at or past
  ``cu_q_lens[num_seqs]``.
  """
  num_seq_rows = cu_q_lens.shape[0] - 1
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1
  seq_T = jnp.clip(seq_T, 0, num_seq_rows - 1)
  live_T = t < cu_q_lens[jnp.asarray(num_seqs, jnp.int32)]
  return seq_T, live_T


def query_positions(t, seq, kv_lens_S, cu_q_lens):
  """Position in its sequence of query row ``t`` of sequence ``seq``.

  The queries of a sequence are its last ``q_len`` tokens: row ``cu_q_lens[i] + j`` sits at
  ``kv_lens[i] - q_len_i + j``.
  """
  q_start = cu_q_lens[seq]
  q_len = cu_q_lens[seq + 1] - q_start
  return kv_lens_S[seq] - q_len + (t - q_start)
