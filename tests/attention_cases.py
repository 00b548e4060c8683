"""Random ragged paged-attention problems and an independent float64 oracle for tests.

The oracle rebuilds each sequence's contiguous K/V from the pages with Python loops and runs
a plain causal softmax in float64 numpy, with the attention variants (sliding window, logit
soft cap, sinks) written out from the contract's formulas: it shares no code with the
implementations.
"""

from __future__ import annotations

import collections
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
  - `padding_seqs` rows past num_seqs (their cu_q_lens entries too, out of order) and
    `padding_tokens` query rows past the last sequence hold garbage.
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
  # Entries past num_seqs are padding: any values (here zeros and rows of other sequences,
  # out of order), never to be searched as if they were sequence boundaries.
  cu_q_lens[num_seqs + 1:] = rng.integers(0, num_tokens + 1, padding_seqs)
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


def hand_case_pages() -> tuple[np.ndarray, np.ndarray]:
  """(k_pages, v_pages) ``[1, 1, 4, 2, 1]`` of the hand-computed case (test_attention's
  ``test_hand_computed_case`` has the arithmetic): one sequence, K = D = 1, block size 2;
  keys at positions 0, 1, 2 are 0, ln 2, ln 3 and values 3, 6, 9, logical block 0 in
  physical block 3 and logical block 1 in physical block 1; every other slot NaN."""
  k_pages = np.full((1, 1, 4, 2, 1), np.nan, np.float32)
  v_pages = np.full((1, 1, 4, 2, 1), np.nan, np.float32)
  k_pages[0, 0, 3, :, 0] = [0.0, np.log(2)]
  k_pages[0, 0, 1, 0, 0] = np.log(3)
  v_pages[0, 0, 3, :, 0] = [3.0, 6.0]
  v_pages[0, 0, 1, 0, 0] = 9.0
  return k_pages, v_pages


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


# --- quantised pools (issue 20) -------------------------------------------------------------


def with_kv_structure(case: Case, seed: int, *, head_ratio: float = 10.0,
                      num_outliers: int = 3, outlier_v_gain: float = 8.0,
                      outlier_k_gain: float = 1.0) -> Case:
  """``case`` with K/V shaped like real activations, the structure quantisation must survive:

  - KV head k's K and V are scaled by ``head_ratio ** (k / (K - 1))`` (heads 1x .. 10x);
    q is divided by its KV head's factor, so the logits stay O(1) (std ~1, as with unit
    normal q and k) and the heads' outputs differ by the same factor as their V;
  - ``num_outliers`` tokens (positions live sequences hold, in the case's layer) have V
    ``outlier_v_gain`` times larger and K ``outlier_k_gain`` times larger in every head
    (massive-activation tokens). A K gain above 1 makes those tokens' logits that many
    times larger, and so their logit errors under any 8-bit K: kept at 1 by default, swept
    in ``benchmarks/kv_quant_accuracy.py``.
  Unused memory stays NaN.
  """
  rng = np.random.default_rng(seed)
  k = case.k_pages_LKNZD.astype(np.float32)
  v = case.v_pages_LKNZD.astype(np.float32)
  q = case.q_THD.astype(np.float32)
  num_kv_heads, block_size = k.shape[1], k.shape[3]
  group = q.shape[1] // num_kv_heads
  head_K = head_ratio ** (np.arange(num_kv_heads) / max(1, num_kv_heads - 1))
  k = k * head_K[None, :, None, None, None]
  v = v * head_K[None, :, None, None, None]
  q = q / np.repeat(head_K, group)[None, :, None]
  held = [(i, pos) for i in range(case.num_seqs) for pos in range(int(case.kv_lens_S[i]))]
  for j in rng.choice(len(held), size=min(num_outliers, len(held)), replace=False):
    i, pos = held[j]
    block, offset = case.block_tables_SP[i, pos // block_size], pos % block_size
    k[case.layer, :, block, offset] *= outlier_k_gain
    v[case.layer, :, block, offset] *= outlier_v_gain
  cast = lambda x, like: np.asarray(jnp.asarray(x, like.dtype))
  return dataclasses.replace(case, q_THD=cast(q, case.q_THD),
                             k_pages_LKNZD=cast(k, case.k_pages_LKNZD),
                             v_pages_LKNZD=cast(v, case.v_pages_LKNZD))


def quant_accuracy_case(seed: int = 20, **structure) -> Case:
  """The batch the quantised-KV accuracy bounds are measured on (issue 20), shared by every
  impl's test and ``benchmarks/kv_quant_accuracy.py``: four KV heads (1x, 2.2x, 4.6x, 10x),
  GQA 2, D = 128, Z = 16; decodes at 9, 130 and 200 tokens, a 24-row prefill chunk at 64
  and a 3-row one at 50; three outlier tokens (``with_kv_structure``, ``structure``
  overriding its defaults). Use ``sm_scale = 128 ** -0.5``."""
  case = make_case(seed, q_lens=[1, 1, 24, 1, 3], kv_lens=[9, 200, 64, 130, 50],
                   num_kv_heads=4, group=2, head_dim=128, block_size=16)
  return with_kv_structure(case, seed + 1, **structure)


def _quantize_pages(pages, dtype, per_tensor: bool):
  """``(bits, scales)`` of float ``pages [L, K, N, Z, D]``: ``layout.quantize`` (one scale per
  token and KV head) or, ``per_tensor``, one scale for the whole array (amax of its finite
  values), written out in the same ``[L, K, N, Z]`` scale layout. A token row holding NaN
  (unused memory) gets a NaN scale either way, so reading it poisons the output whatever
  the bits hold (int8 has no NaN)."""
  x = jnp.asarray(pages, jnp.float32)
  if per_tensor:
    dtype = jnp.dtype(dtype)
    limit = float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)
    scale = jnp.nanmax(jnp.abs(x)) / limit
    scaled = jnp.clip(x / scale, -limit, limit)
    bits = layout.to_storage(jnp.round(scaled) if dtype == jnp.int8 else scaled, dtype)
    scales = jnp.full(x.shape[:-1], scale, layout.SCALE_DTYPE)
  else:
    bits, scales = layout.quantize(x, dtype)
  scales = jnp.where(jnp.isnan(x).any(axis=-1), jnp.nan, scales).astype(layout.SCALE_DTYPE)
  return bits, scales


def quantized_args(case: Case, dtype, *, per_tensor: bool = False):
  """``(args, kwargs)`` for any kernel on ``case``'s K/V quantised to ``dtype`` (int8,
  float8_e4m3fn): ``args`` the eight positional arguments with the pages as storage bits,
  ``kwargs`` = ``dict(kv_dtype=dtype, k_scales=..., v_scales=...)``. Call
  ``kernel(*args, sm_scale=..., **kwargs, **variants)``. Unused (NaN) memory keeps NaN
  scales. ``per_tensor``: one scale per pool (K and V apart) instead of one per token and
  KV head, the coarse baseline."""
  k_bits, k_scales = _quantize_pages(case.k_pages_LKNZD, dtype, per_tensor)
  v_bits, v_scales = _quantize_pages(case.v_pages_LKNZD, dtype, per_tensor)
  q, _, _, *rest = case.jax_args()
  return ((q, k_bits, v_bits, *rest),
          dict(kv_dtype=jnp.dtype(dtype), k_scales=k_scales, v_scales=v_scales))


def dequantized_case(case: Case, dtype, *, per_tensor: bool = False) -> Case:
  """``case`` with the float32 K/V a ``dtype`` pool holds after quantising it
  (``quantized_args``): ``oracle`` of it is the exact answer for the quantised cache."""
  (_, k_bits, v_bits, *_), kw = quantized_args(case, dtype, per_tensor=per_tensor)
  k = layout.dequantize(k_bits, kw["k_scales"], kw["kv_dtype"])
  v = layout.dequantize(v_bits, kw["v_scales"], kw["kv_dtype"])
  return dataclasses.replace(case, k_pages_LKNZD=np.asarray(k), v_pages_LKNZD=np.asarray(v))


def relative_error(out, expected, case: Case, *, per_head: bool = False) -> float:
  """max |out - expected| / max |expected| over the live query rows; ``per_head``: that
  ratio for each query head apart (its own max), the worst head's (a head 10x smaller than
  the others is held to its own scale)."""
  live = int(case.cu_q_lens[case.num_seqs])
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)[:live]
  expected = np.asarray(expected, np.float64)[:live]
  axes = (0, 2) if per_head else None
  return float(np.max(np.max(np.abs(out - expected), axis=axes)
                      / np.max(np.abs(expected), axis=axes)))


def tolerance(dtype) -> dict:
  if jnp.dtype(dtype) == jnp.float32:
    return dict(rtol=1e-5, atol=1e-5)
  return dict(rtol=1e-2, atol=1e-2)


class CompiledCache:
  """The last ``keep`` compiled executables, by key, shared between tests. Only a few: each
  holds host memory and, on a CPU, memory maps of its own, and keeping every one took a
  worker past Linux's 65,530 maps a process, where compiling fails (tests/conftest.py)."""

  def __init__(self, keep: int):
    self.keep = keep
    self._executables = collections.OrderedDict()

  def get(self, key, compile_fn):
    """The executable under ``key``, compiled by ``compile_fn()`` when not kept."""
    if key not in self._executables:
      self._executables[key] = compile_fn()
      while len(self._executables) > self.keep:
        self._executables.popitem(last=False)
    self._executables.move_to_end(key)
    return self._executables[key]
