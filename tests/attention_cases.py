"""Random ragged paged-attention problems and an independent float64 oracle for tests.

The oracle rebuilds each sequence's contiguous K/V from the pages with Python loops and runs
a plain causal softmax in float64 numpy, with the attention variants (sliding window, logit
soft cap, sinks) written out from the contract's formulas: it shares no code with the
implementations.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout

NO_BLOCK = -1


@dataclasses.dataclass
class Case:
  q_THD: np.ndarray
  k_pages_LKNZD: np.ndarray
  v_pages_LKNZD: np.ndarray
  layer: int
  kv_lens_S: np.ndarray
  block_tables_SP: np.ndarray
  cu_q_lens: np.ndarray
  num_seqs: int
  q_lens: list[int]

  @property
  def kv_dtype(self):
    """The logical K/V dtype (the pages' dtype)."""
    return jnp.dtype(self.k_pages_LKNZD.dtype)

  def jax_args(self, *, storage: bool = False):
    """The kernel's positional arguments. ``storage=True``: the pages as the pool's storage
    bits (``layout.to_storage``); pass ``kv_dtype=case.kv_dtype`` to the kernel with them."""
    k, v = jnp.asarray(self.k_pages_LKNZD), jnp.asarray(self.v_pages_LKNZD)
    if storage:
      k, v = layout.to_storage(k, self.kv_dtype), layout.to_storage(v, self.kv_dtype)
    return (jnp.asarray(self.q_THD), k, v, self.layer, jnp.asarray(self.kv_lens_S),
            jnp.asarray(self.block_tables_SP), jnp.asarray(self.cu_q_lens),
            jnp.int32(self.num_seqs))

  @property
  def num_q_heads(self) -> int:
    return self.q_THD.shape[1]


def make_case(seed: int, *, q_lens, kv_lens, num_kv_heads: int = 2, group: int = 1,
              head_dim: int = 64, block_size: int = 8, dtype=jnp.float32,
              num_layers: int = 2, layer: int = 1, extra_blocks: int = 3,
              padding_seqs: int = 1, padding_tokens: int = 2, spare_pages: int = 1) -> Case:
  """A ragged batch whose pages are shuffled and whose unused memory is NaN.

  - every page no live sequence owns, and every slot past a sequence's length, is NaN;
  - block-table entries past a sequence's last block point at OTHER sequences' blocks;
  - `padding_seqs` rows past num_seqs and `padding_tokens` query rows past the last
    sequence hold garbage.
  """
  rng = np.random.default_rng(seed)
  q_lens, kv_lens = list(q_lens), list(kv_lens)
  assert len(q_lens) == len(kv_lens) and all(q <= k for q, k in zip(q_lens, kv_lens))
  num_seqs = len(q_lens)
  num_rows = num_seqs + padding_seqs
  blocks_needed = [-(-k // block_size) for k in kv_lens]
  blocks_per_seq = max(blocks_needed + [1]) + spare_pages
  num_blocks = sum(blocks_needed) + extra_blocks
  np_dtype = jnp.dtype(dtype)
  shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
  k_pages = np.full(shape, np.nan, np.float32)
  v_pages = np.full(shape, np.nan, np.float32)
  physical = rng.permutation(num_blocks)
  tables = np.full((num_rows, blocks_per_seq), NO_BLOCK, np.int32)
  used = 0
  for i, kv_len in enumerate(kv_lens):
    for p in range(blocks_needed[i]):
      block = physical[used]
      used += 1
      tables[i, p] = block
      filled = min(block_size, kv_len - p * block_size)
      k_pages[:, :, block, :filled] = rng.normal(size=(num_layers, num_kv_heads, filled,
                                                       head_dim))
      v_pages[:, :, block, :filled] = rng.normal(size=(num_layers, num_kv_heads, filled,
                                                       head_dim))
  owned = tables[tables >= 0]
  for i in range(num_rows):  # unused entries: other sequences' (or any) blocks
    for p in range(blocks_needed[i] if i < num_seqs else 0, blocks_per_seq):
      if owned.size:
        tables[i, p] = rng.choice(owned)
  num_tokens = sum(q_lens) + padding_tokens
  cu_q_lens = np.zeros(num_rows + 1, np.int32)
  cu_q_lens[1:num_seqs + 1] = np.cumsum(q_lens)
  cu_q_lens[num_seqs + 1:] = cu_q_lens[num_seqs]
  kv_lens_S = np.zeros(num_rows, np.int32)
  kv_lens_S[:num_seqs] = kv_lens
  kv_lens_S[num_seqs:] = rng.integers(1, blocks_per_seq * block_size + 1, padding_seqs)
  q = rng.normal(size=(num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
  # Round through the storage dtype so the oracle sees exactly what the kernels see.
  cast = lambda x: np.asarray(jnp.asarray(x, np_dtype))
  return Case(cast(q), cast(k_pages), cast(v_pages), layer, kv_lens_S, tables, cu_q_lens,
              num_seqs, q_lens)


def oracle(case: Case, sm_scale: float | None = None, *, sliding_window: int | None = None,
           soft_cap: float | None = None, sinks=None) -> np.ndarray:
  """Dense causal attention in float64, sequence by sequence, query row by query row.

  The variants, as the contract writes them (design.md, "Contract, second wave"):
  - the query at position p sees the keys at positions k with k <= p, and, with
    ``sliding_window=W``, also k > p - W;
  - score s_k = sm_scale * q . k_k; with ``soft_cap=c``: s_k = c * tanh(s_k / c);
  - with ``sinks`` (f32[H]), query head h has one extra logit sinks[h] with no value:
    p_k = exp(s_k) / (exp(sinks[h]) + sum_k' exp(s_k')), out = sum_k p_k v_k.
  """
  q = case.q_THD.astype(np.float64)
  num_tokens, num_q_heads, head_dim = q.shape
  _, num_kv_heads, _, block_size, _ = case.k_pages_LKNZD.shape
  group = num_q_heads // num_kv_heads
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  sinks_H = None if sinks is None else np.asarray(sinks, np.float64)
  out = np.zeros((num_tokens, num_q_heads, head_dim), np.float64)
  for i in range(case.num_seqs):
    kv_len = int(case.kv_lens_S[i])
    start, end = int(case.cu_q_lens[i]), int(case.cu_q_lens[i + 1])
    q_len = end - start
    k = np.zeros((kv_len, num_kv_heads, head_dim))
    v = np.zeros((kv_len, num_kv_heads, head_dim))
    for pos in range(kv_len):
      block = case.block_tables_SP[i, pos // block_size]
      k[pos] = case.k_pages_LKNZD[case.layer, :, block, pos % block_size].astype(np.float64)
      v[pos] = case.v_pages_LKNZD[case.layer, :, block, pos % block_size].astype(np.float64)
    for j in range(q_len):
      qpos = kv_len - q_len + j
      first = 0 if sliding_window is None else max(0, qpos - sliding_window + 1)
      for h in range(num_q_heads):
        kv_head = h // group
        scores = k[first: qpos + 1, kv_head] @ q[start + j, h] * scale
        if soft_cap is not None:
          scores = soft_cap * np.tanh(scores / soft_cap)
        logits = scores if sinks_H is None else np.append(scores, sinks_H[h])
        shift = logits.max()
        weights = np.exp(scores - shift)
        weights /= np.exp(logits - shift).sum()  # the sink's term, if any, is in here
        out[start + j, h] = weights @ v[first: qpos + 1, kv_head]
  return out


def poison_before_window(case: Case, sliding_window: int) -> Case:
  """``case`` with NaN in every page wholly before the window of its sequence's first query
  row (all positions <= p_first - W): no query row of the sequence sees them, and an impl
  that reads (and multiplies) them returns NaN. Every tile's first row is at or after its
  sequence's first row, so these pages lie before every tile's window too."""
  k, v = case.k_pages_LKNZD.copy(), case.v_pages_LKNZD.copy()
  block_size = k.shape[3]
  for i in range(case.num_seqs):
    q_len = int(case.cu_q_lens[i + 1] - case.cu_q_lens[i])
    if q_len == 0:
      continue
    first_seen = int(case.kv_lens_S[i]) - q_len - sliding_window + 1
    for page in range(max(0, first_seen) // block_size):  # (page + 1) * Z <= first_seen
      block = case.block_tables_SP[i, page]
      k[:, :, block] = np.nan
      v[:, :, block] = np.nan
  return dataclasses.replace(case, k_pages_LKNZD=k, v_pages_LKNZD=v)


def make_sinks(seed: int, num_q_heads: int, *, scale: float = 2.0) -> np.ndarray:
  """f32[H] sink logits, some well above a typical score so they take real mass."""
  return (np.random.default_rng(seed).normal(size=num_q_heads) * scale).astype(np.float32)


def variant_grid(context: int, num_q_heads: int, seed: int = 0):
  """``[(name, kwargs)]``: the variants grid of issue 19 for a batch whose longest sequence
  holds ``context`` tokens. Windows 1, smaller than the context, equal to it and larger;
  soft cap; sinks; and combinations. ``kwargs`` go to the oracle and to every impl."""
  small = max(2, context // 3)
  sinks = make_sinks(seed, num_q_heads)
  return [
      ("window1", dict(sliding_window=1)),
      ("window_small", dict(sliding_window=small)),
      ("window_eq", dict(sliding_window=context)),
      ("window_large", dict(sliding_window=context + 5)),
      ("cap", dict(soft_cap=1.5)),
      ("sinks", dict(sinks=sinks)),
      ("window_cap", dict(sliding_window=small, soft_cap=2.0)),
      ("window_sinks", dict(sliding_window=small, sinks=sinks)),
      ("window1_sinks", dict(sliding_window=1, sinks=sinks)),
      ("all", dict(sliding_window=small, soft_cap=2.0, sinks=sinks)),
  ]


def mixed_lengths(block_size: int):
  """(q_lens, kv_lens): decode, chunked prefill, full prefill, q_len 0, aligned or not."""
  z = block_size
  q_lens = [1, 0, 5, 2 * z, 1, z + 2, 3]
  kv_lens = [z + 3, 7, 2 * z, 2 * z, 1, 3 * z + 1, 3]
  return q_lens, kv_lens


def tolerance(dtype) -> dict:
  if jnp.dtype(dtype) == jnp.float32:
    return dict(rtol=1e-5, atol=1e-5)
  return dict(rtol=1e-2, atol=1e-2)
