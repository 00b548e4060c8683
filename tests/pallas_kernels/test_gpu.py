"""Pallas GPU ragged paged attention (Triton backend): interpret mode on CPU, CUDA lowering.

Every kernel run here is in interpret mode, which is slow: shapes are tiny and one ragged
batch per case packs decode, chunked prefill, full prefill, empty sequences and padding
together. The full product grid is marked slow.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax
from paged_jax.pallas_kernels import gpu
from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels.gpu import GpuTiling
from paged_jax.pallas_kernels.gpu import tiling as tiling_lib
from paged_jax.pallas_kernels.gpu import work_items
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from tests import attention_cases

NO_BLOCK = -1
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}

# (q_len, kv_len) of the live sequences of the standard ragged batch: decode (q_len 1),
# chunked prefill (q_len < kv_len), full prefill (q_len == kv_len), an empty sequence,
# and lengths that are and are not multiples of the block sizes 8/16/32.
MIXED_BATCH = ((1, 21), (5, 32), (0, 9), (11, 11), (1, 1), (3, 17))


def make_case(seed, *, dtype=jnp.float32, block_size=8, group=1, head_dim=64,
              num_kv_heads=2, seqs=MIXED_BATCH, padding_rows=2, padding_seqs=1,
              num_layers=2, layer=1, spare_blocks=3):
  """A ragged batch with every hazard the kernel must ignore.

  Pages no live sequence owns are NaN, and so are slots of a sequence's last page past its
  length; layer ``1 - layer`` is NaN everywhere. Block tables are shuffled; entries past a
  sequence's pages point at other sequences' blocks or hold ``NO_BLOCK``. Rows past
  ``cu_q_lens[num_seqs]`` and sequence rows past ``num_seqs`` are padding with garbage.
  """
  rng = np.random.default_rng(seed)
  num_live = len(seqs)
  q_lens = [q for q, _ in seqs]
  kv_lens = [kv for _, kv in seqs]
  pages_needed = [-(-kv // block_size) for kv in kv_lens]
  blocks_per_seq = max(pages_needed) + 1
  num_blocks = sum(pages_needed) + spare_blocks
  ids = rng.permutation(num_blocks)
  num_seq_rows = num_live + padding_seqs
  tables = np.full((num_seq_rows, blocks_per_seq), NO_BLOCK, np.int32)
  owned = []
  start = 0
  for i, n in enumerate(pages_needed):
    tables[i, :n] = ids[start:start + n]
    owned.append(ids[start:start + n])
    start += n
  all_owned = np.concatenate(owned)
  for i in range(num_seq_rows):
    for j in range(pages_needed[i] if i < num_live else 0, blocks_per_seq):
      # Unused entries: another sequence's block (readable, finite data) or NO_BLOCK.
      if rng.random() < 0.6 and all_owned.size:
        tables[i, j] = rng.choice(all_owned)
  shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
  k_pages = np.full(shape, np.nan, np.float32)
  v_pages = np.full(shape, np.nan, np.float32)
  for i, kv in enumerate(kv_lens):
    for j, block in enumerate(owned[i]):
      used = min(block_size, kv - j * block_size)
      k_pages[layer, :, block, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
      v_pages[layer, :, block, :used] = rng.standard_normal((num_kv_heads, used, head_dim))
  num_q_heads = num_kv_heads * group
  num_tokens = sum(q_lens) + padding_rows
  q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
  cu = np.concatenate([[0], np.cumsum(q_lens), np.full(padding_seqs, sum(q_lens))])
  kv_lens_rows = np.array(kv_lens + [int(rng.integers(1, 5))] * padding_seqs, np.int32)
  return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k_pages, dtype),
              v_pages=jnp.asarray(v_pages, dtype), layer=jnp.int32(layer),
              kv_lens=jnp.asarray(kv_lens_rows), block_tables=jnp.asarray(tables),
              cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.int32(num_live))


def args_of(case):
  return (case["q"], case["k_pages"], case["v_pages"], case["layer"], case["kv_lens"],
          case["block_tables"], case["cu_q_lens"], case["num_seqs"])


def oracle_f64(case, sm_scale):
  """Plain numpy float64 attention, one sequence at a time, from the (rounded) inputs."""
  q = np.asarray(case["q"].astype(jnp.float32), np.float64)
  k_pages = np.asarray(case["k_pages"].astype(jnp.float32), np.float64)
  v_pages = np.asarray(case["v_pages"].astype(jnp.float32), np.float64)
  layer = int(case["layer"])
  kv_lens, tables = np.asarray(case["kv_lens"]), np.asarray(case["block_tables"])
  cu, num_seqs = np.asarray(case["cu_q_lens"]), int(case["num_seqs"])
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, block_size = k_pages.shape[1], k_pages.shape[3]
  group = num_q_heads // num_kv_heads
  out = np.zeros_like(q)
  for i in range(num_seqs):
    kv_len, q_len = int(kv_lens[i]), int(cu[i + 1] - cu[i])
    if q_len == 0:
      continue
    blocks = tables[i, : -(-kv_len // block_size)]
    k = k_pages[layer][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
    v = v_pages[layer][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
    for j in range(q_len):
      t, pos = cu[i] + j, kv_len - q_len + j
      for h in range(num_q_heads):
        scores = k[h // group, : pos + 1] @ q[t, h] * sm_scale
        probs = np.exp(scores - scores.max())
        out[t, h] = probs @ v[h // group, : pos + 1] / probs.sum()
  return out


def check_close(out, case, *, sm_scale=None, reference=False):
  """Against the float64 oracle (and the jnp reference if asked: it compiles per shape,
  which is slow here); padding rows must be exactly 0."""
  dtype = case["q"].dtype
  sm_scale = sm_scale if sm_scale is not None else case["q"].shape[-1] ** -0.5
  assert out.dtype == dtype and out.shape == case["q"].shape
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  tol = TOLERANCE[jnp.dtype(dtype).type]
  np.testing.assert_allclose(out, oracle_f64(case, sm_scale), rtol=tol, atol=tol)
  if reference:
    ref = ragged_paged_attention_reference(*args_of(case), sm_scale=sm_scale)
    np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
  live_rows = int(case["cu_q_lens"][int(case["num_seqs"])])
  np.testing.assert_array_equal(out[live_rows:], 0.0)


def run_gpu(case, **kwargs):
  sm_scale = kwargs.pop("sm_scale", case["q"].shape[-1] ** -0.5)
  return gpu.ragged_paged_attention(*args_of(case), sm_scale=sm_scale, interpret=True,
                                    **kwargs)


# --- Hand-computed cases. ---

def test_hand_computed_two_keys():
  # One sequence, kv_len 2, one query (position 1, sees both keys); D = 16, sm_scale 1.
  # q = e0, k0 = 0, k1 = ln(3) e0: scores (0, ln 3), softmax (1/4, 3/4).
  # v0 = 4 * e1, v1 = 8 * e2: out = 1/4 * v0 + 3/4 * v1 = e1 + 6 e2.
  head_dim, block_size = 16, 8
  k_pages = np.zeros((1, 1, 2, block_size, head_dim), np.float32)
  v_pages = np.full((1, 1, 2, block_size, head_dim), np.nan, np.float32)  # unread slots
  k_pages[0, 0, 1, 1, 0] = np.log(3.0)
  v_pages[0, 0, 1, :2] = 0.0
  v_pages[0, 0, 1, 0, 1] = 4.0
  v_pages[0, 0, 1, 1, 2] = 8.0
  q = np.zeros((2, 1, head_dim), np.float32)  # row 1 is padding
  q[0, 0, 0] = 1.0
  out = gpu.ragged_paged_attention(
      jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), 0,
      jnp.array([2], jnp.int32), jnp.array([[1, NO_BLOCK]], jnp.int32),
      jnp.array([0, 1], jnp.int32), jnp.int32(1), sm_scale=1.0, interpret=True)
  expected = np.zeros((2, 1, head_dim), np.float32)
  expected[0, 0, 1], expected[0, 0, 2] = 1.0, 6.0
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-6)


def test_hand_computed_causal_prefill():
  # Full prefill of 2 tokens: row 0 (position 0) sees only key 0, so out = v0 exactly,
  # whatever the scores; row 1 sees keys 0 and 1 with equal scores (k = 0): (v0 + v1) / 2.
  head_dim, block_size = 16, 16
  k_pages = np.zeros((1, 1, 1, block_size, head_dim), np.float32)
  v_pages = np.full((1, 1, 1, block_size, head_dim), np.nan, np.float32)
  v_pages[0, 0, 0, 0] = 2.0
  v_pages[0, 0, 0, 1] = 4.0
  q = np.ones((2, 1, head_dim), np.float32)
  out = gpu.ragged_paged_attention(
      jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), 0,
      jnp.array([2], jnp.int32), jnp.array([[0]], jnp.int32), jnp.array([0, 2], jnp.int32),
      jnp.int32(1), sm_scale=0.5, interpret=True)
  np.testing.assert_allclose(np.asarray(out)[:, 0], [[2.0] * head_dim, [3.0] * head_dim],
                             atol=1e-6)


# --- Metadata and merge (jnp, no kernel). ---

def test_work_items_cover_each_live_row_once():
  case = make_case(19)
  build = jax.jit(work_items.build_work_items,
                  static_argnames=("num_tokens", "q_tile", "num_items"))
  for q_tile in (1, 3):
    num_tokens = case["q"].shape[0]
    num_items = tiling_lib.num_work_items(num_tokens, case["kv_lens"].shape[0], q_tile)
    items = build(case["kv_lens"], case["cu_q_lens"], case["num_seqs"],
                  num_tokens=num_tokens, q_tile=q_tile, num_items=num_items)
    rows = np.asarray(items.row_WQ)[np.asarray(items.row_live_WQ)]
    live_rows = int(case["cu_q_lens"][int(case["num_seqs"])])
    np.testing.assert_array_equal(np.sort(rows), np.arange(live_rows))
    # Each item reads no further than its last query's position + 1 (and its length).
    seq_W, horizon_W = np.asarray(items.seq_W), np.asarray(items.horizon_W)
    qpos_WQ = np.asarray(items.qpos_WQ)
    np.testing.assert_array_equal(horizon_W, np.maximum(qpos_WQ.max(axis=1) + 1, 0))
    assert np.all(horizon_W <= np.asarray(case["kv_lens"])[seq_W])


def test_combine_splits_by_log_sum_exp():
  # Piece 0 saw total weight 1 (lse 0) with mean a, piece 1 weight 3 (lse ln 3) with mean
  # b: the merge is (1 * a + 3 * b) / 4. A row neither piece saw (lse -inf) stays zero.
  a, b = np.full(4, 2.0, np.float32), np.full(4, 6.0, np.float32)
  out = np.stack([np.stack([a, np.zeros(4, np.float32)]),
                  np.stack([b, np.zeros(4, np.float32)])])[:, None, None]  # [X, W, K, M, D]
  lse = np.array([[0.0, -np.inf], [np.log(3.0), -np.inf]], np.float32)[:, None, None]
  merged = work_items.combine_splits(jnp.asarray(out), jnp.asarray(lse))
  np.testing.assert_allclose(np.asarray(merged)[0, 0], [[5.0] * 4, [0.0] * 4], rtol=1e-6)


# --- The reference grid, interpret mode. ---

# A covering subset of dtype x block size x GQA ratio x head dim: every value of each axis,
# every (dtype, block size) and (block size, group) pair; the full product is slow.
FAST_GRID = (
    (jnp.float32, 8, 1, 64), (jnp.float32, 16, 4, 128), (jnp.float32, 32, 8, 64),
    (jnp.bfloat16, 8, 4, 64), (jnp.bfloat16, 16, 8, 64), (jnp.bfloat16, 32, 1, 128),
    (jnp.float16, 8, 8, 128), (jnp.float16, 16, 1, 64), (jnp.float16, 32, 4, 64),
    # Head dims that are not powers of two (Phi-3's 96, Phi-2's 80): tiles of 128, the
    # lanes past D masked off.
    (jnp.float32, 16, 2, 96), (jnp.bfloat16, 8, 1, 80),
)
FULL_GRID = tuple(itertools.product((jnp.float32, jnp.bfloat16, jnp.float16), (8, 16, 32),
                                    (1, 4, 8), (64, 128)))


def _grid_id(params):
  dtype, block_size, group, head_dim = params
  return f"{jnp.dtype(dtype).name}-Z{block_size}-G{group}-D{head_dim}"


@pytest.mark.parametrize("params", FAST_GRID, ids=_grid_id)
def test_matches_reference(params):
  dtype, block_size, group, head_dim = params
  case = make_case(zlib.crc32(_grid_id(params).encode()), dtype=dtype, block_size=block_size, group=group,
                   head_dim=head_dim)
  check_close(run_gpu(case), case, reference=dtype == jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("params", FULL_GRID, ids=_grid_id)
def test_matches_reference_full_grid(params):
  dtype, block_size, group, head_dim = params
  case = make_case(7, dtype=dtype, block_size=block_size, group=group, head_dim=head_dim)
  check_close(run_gpu(case), case, reference=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, block_size, head_dim", [
    (jnp.bfloat16, 64, 256), (jnp.float32, 128, 64), (jnp.float16, 8, 256),
    (jnp.float32, 16, 192), (jnp.bfloat16, 32, 40), (jnp.float32, 8, 100)])
def test_large_head_dim_and_blocks(dtype, block_size, head_dim):
  case = make_case(8, dtype=dtype, block_size=block_size, group=2, head_dim=head_dim,
                   seqs=((1, 150), (40, 200), (0, 3), (3, 3)))
  check_close(run_gpu(case), case, reference=True)


# --- Split-K (flash-decoding). ---

def test_split_k_long_sequence_splits_and_matches():
  # One long decode sequence plus a chunked prefill on it: 300 positions, J = 16, so 19
  # chunks cut into 4 splits of 5, 5, 5 and 4 chunks.
  case = make_case(11, seqs=((1, 300), (7, 290)), block_size=8, group=4, num_kv_heads=1)
  tiling = GpuTiling(q_tile=4, pages_per_chunk=2, num_splits=4)
  out_split = run_gpu(case, tiling=tiling)
  check_close(out_split, case)
  out_single = run_gpu(case, tiling=GpuTiling(q_tile=4, pages_per_chunk=2, num_splits=1))
  np.testing.assert_allclose(np.asarray(out_split), np.asarray(out_single), rtol=1e-5,
                             atol=1e-6)


def test_split_k_default_splits_a_lone_long_sequence():
  case = make_case(12, seqs=((1, 200),), block_size=16, group=8, num_kv_heads=1,
                   dtype=jnp.bfloat16, padding_rows=0, padding_seqs=0)
  tiling = gpu.default_tiling_for(case["q"], case["k_pages"], case["block_tables"])
  assert tiling.num_splits > 1, tiling
  check_close(run_gpu(case), case)


def test_split_k_more_splits_than_chunks():
  # 8 splits of sequences with 1 to 3 chunks: most programs see nothing (lse = -inf).
  case = make_case(13, seqs=((1, 40), (2, 9), (0, 5), (1, 16)), block_size=16)
  check_close(run_gpu(case, tiling=GpuTiling(q_tile=1, pages_per_chunk=1, num_splits=8)),
              case)


def test_tile_not_a_power_of_two():
  # Q = 3 (M = 3 * 2 padded to 16): tiles split sequences and span their boundaries. The
  # defaults cover Q = 1 (split-K tests) and Q = 16 // G (the grid, G = 1 gives 16).
  case = make_case(14, group=2)
  check_close(run_gpu(case, tiling=GpuTiling(q_tile=3, pages_per_chunk=2, num_splits=2)),
              case)


# --- Ragged edge cases. ---

def test_no_live_rows_is_zero():
  case = make_case(15, seqs=((0, 5), (0, 9)), padding_rows=3)
  out = run_gpu(case)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  case["num_seqs"] = jnp.int32(0)
  np.testing.assert_array_equal(np.asarray(run_gpu(case)), 0.0)


def test_traced_layer_and_mixed_dtypes():
  # layer traced under an outer jit; q float32 over bfloat16 pages (computed in float32).
  case = make_case(16, layer=0, num_layers=3, dtype=jnp.bfloat16)
  case["q"] = case["q"].astype(jnp.float32)
  f = jax.jit(lambda layer, *rest: gpu.ragged_paged_attention(
      rest[0], rest[1], rest[2], layer, *rest[3:], sm_scale=0.125, interpret=True))
  args = args_of(case)
  out = f(args[3], *args[:3], *args[4:])
  assert out.dtype == jnp.float32
  ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), oracle_f64(case, 0.125), rtol=1e-5, atol=1e-5)


def test_through_paged_attention_entry_point():
  # With every variant on: paged_attention passes them (and the cache's pages) through.
  q_lens, kv_lens = [1, 6, 0, 3], [40, 30, 5, 3]
  case = attention_cases.make_case(17, q_lens=q_lens, kv_lens=kv_lens, group=4,
                                   block_size=16, head_dim=32)
  variant = dict(sliding_window=9, soft_cap=3.0,
                 sinks=attention_cases.make_sinks(17, case.num_q_heads))
  q, k_pages, v_pages, *rest = case.jax_args()
  cache = paged_jax.KVCache(k_pages=k_pages, v_pages=v_pages)
  out = paged_jax.paged_attention(q, cache, *rest, impl="pallas_gpu", interpret=True,
                                  **_variant_kwargs(variant))
  np.testing.assert_allclose(np.asarray(out), attention_cases.oracle(case, **variant),
                             rtol=1e-5, atol=1e-5)


# --- Tiling: validation and defaults. ---

@pytest.mark.parametrize("kwargs, field", [
    (dict(q_tile=0, pages_per_chunk=2, num_splits=1), "q_tile"),
    (dict(q_tile=True, pages_per_chunk=2, num_splits=1), "q_tile"),
    (dict(q_tile=1, pages_per_chunk=3, num_splits=1), "pages_per_chunk"),
    (dict(q_tile=1, pages_per_chunk=2, num_splits=1.5), "num_splits"),
    (dict(q_tile=1, pages_per_chunk=2, num_splits=1, num_warps=6), "num_warps"),
    (dict(q_tile=1, pages_per_chunk=2, num_splits=1, num_stages=0), "num_stages"),
    (dict(q_tile=1, pages_per_chunk=1, num_splits=1, page_split=3), "page_split"),
    (dict(q_tile=1, pages_per_chunk=2, num_splits=1, page_split=2), "page_split"),
])
def test_tiling_rejects_bad_fields(kwargs, field):
  with pytest.raises(ValueError, match=field):
    GpuTiling(**kwargs)


def test_tiling_shape_checks():
  tiling = GpuTiling(q_tile=1, pages_per_chunk=1, num_splits=1)
  with pytest.raises(ValueError, match="pages_per_chunk"):
    tiling.check_shapes(group=1, block_size=8, head_dim=64)  # J = 8 < 16
  with pytest.raises(ValueError, match="block_size"):
    tiling.check_shapes(group=1, block_size=12, head_dim=64)
  with pytest.raises(ValueError, match="head_dim D=320"):
    tiling.check_shapes(group=1, block_size=16, head_dim=320)
  tiling.check_shapes(group=1, block_size=16, head_dim=96)  # in tiles of 128
  with pytest.raises(ValueError, match="q_tile"):
    GpuTiling(q_tile=512, pages_per_chunk=1, num_splits=1).check_shapes(
        group=8, block_size=16, head_dim=128)
  case = make_case(18, block_size=8)
  with pytest.raises(ValueError, match="pages_per_chunk"):
    run_gpu(case, tiling=tiling)
  with pytest.raises(ValueError, match="backend"):
    run_gpu(case, backend="cuda_graph")


@pytest.mark.parametrize("num_tokens, num_seq_rows, group, block_size, head_dim, blocks", [
    (1, 1, 4, 16, 128, 512), (256, 256, 4, 16, 128, 64), (2048, 4, 8, 8, 64, 256),
    (64, 64, 32, 32, 256, 16), (5, 3, 1, 64, 128, 2), (1, 1, 6, 8, 64, 1),
])
def test_default_tiling_is_valid(num_tokens, num_seq_rows, group, block_size, head_dim,
                                 blocks):
  tiling = tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=8, group=group,
      block_size=block_size, head_dim=head_dim, blocks_per_seq=blocks)
  tiling.check_shapes(group=group, block_size=block_size, head_dim=head_dim)
  assert tiling_lib.packed_rows(tiling.q_tile, group) >= tiling_lib.MIN_DOT_SIZE
  assert 1 <= tiling.num_splits <= tiling_lib.MAX_SPLITS


# --- Lowering for CUDA on CPU: the Triton custom call holds the kernel. ---

LOWERING_GRID = [
    # (name, T, S, H, K, D, Z, dtype): T query rows over S sequence rows.
    ("llama3_8b_decode", 32, 32, 32, 8, 128, 16, jnp.bfloat16),
    ("llama3_8b_mixed_prefill", 96, 4, 32, 8, 128, 16, jnp.bfloat16),
    ("mqa_decode", 8, 8, 16, 1, 128, 16, jnp.bfloat16),
    ("mqa_prefill", 64, 2, 16, 1, 64, 32, jnp.float16),
    ("d64_z8", 16, 4, 8, 2, 64, 8, jnp.float16),
    ("d256_z32", 8, 8, 8, 8, 256, 32, jnp.bfloat16),
    ("d256_z16_prefill", 64, 2, 16, 4, 256, 16, jnp.bfloat16),
    ("d128_z8_f32", 8, 8, 8, 8, 128, 8, jnp.float32),
    ("d64_z32_gqa6", 16, 2, 12, 2, 64, 32, jnp.bfloat16),
    ("d128_z64_long", 1, 1, 32, 8, 128, 64, jnp.bfloat16),
    ("d256_z128_f32_page_parts", 16, 4, 8, 4, 256, 128, jnp.float32),
    ("phi3_d96", 16, 4, 32, 32, 96, 16, jnp.bfloat16),
]


@pytest.mark.parametrize("name, T, S, H, K, D, Z, dtype", LOWERING_GRID,
                         ids=[row[0] for row in LOWERING_GRID])
def test_lowers_for_cuda(name, T, S, H, K, D, Z, dtype):
  num_blocks, blocks_per_seq, num_layers = 64, 32, 4
  q = jax.ShapeDtypeStruct((T, H, D), dtype)
  pages = jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f = lambda *a: gpu.ragged_paged_attention(*a, sm_scale=D ** -0.5)
  lowered = jax.jit(f).trace(q, pages, pages, i32(), i32(S), i32(S, blocks_per_seq),
                             i32(S + 1), i32()).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 1, name
  assert "ragged_paged_attention_split_k" in text
  # The pool goes to the kernel whole (%arg1, %arg2): no layer is sliced out before it.
  assert "%arg1, %arg2" in calls[0]


# --- Attention variants (issue 19): sliding window, soft cap, sinks, storage bits. ---

def _one_query_case(k_JD, v_JD, *, block_size=16, num_q_heads=1):
  """One sequence whose last position queries keys ``k_JD`` (values ``v_JD``), laid out
  in order over shuffled-free pages; slots past the keys are NaN. Returns the positional
  arguments of the kernel (q to be filled by the caller: row 0 live, row 1 padding)."""
  kv_len, head_dim = k_JD.shape
  num_blocks = -(-kv_len // block_size)
  k_pages = np.full((1, 1, num_blocks * block_size, head_dim), np.nan, np.float32)
  v_pages = np.full_like(k_pages, np.nan)
  k_pages[0, 0, :kv_len], v_pages[0, 0, :kv_len] = k_JD, v_JD
  shape = (1, 1, num_blocks, block_size, head_dim)
  q = np.zeros((2, num_q_heads, head_dim), np.float32)
  return dict(q=q, k_pages=jnp.asarray(k_pages.reshape(shape)),
              v_pages=jnp.asarray(v_pages.reshape(shape)), layer=0,
              kv_lens=jnp.array([kv_len], jnp.int32),
              block_tables=jnp.arange(num_blocks, dtype=jnp.int32)[None, :],
              cu_q_lens=jnp.array([0, 1], jnp.int32), num_seqs=jnp.int32(1))


def _run_one(case, **kwargs):
  case = dict(case, q=jnp.asarray(case["q"]))
  return np.asarray(gpu.ragged_paged_attention(*args_of(case), interpret=True, **kwargs))


def test_hand_computed_window_hides_one_key():
  # kv_len 3, the query at position 2 with W = 2 sees keys 1 and 2 (2 - 2 < k <= 2): key 0
  # alone is hidden. q = e0, sm_scale 1: k0 = 10 e0 would score 10 and take nearly all
  # the mass; k1 = k2 = 0 score 0 each, so out = (v1 + v2) / 2 = (2 e1 + 4 e1) / 2 = 3 e1.
  # Without the window: weights (e^10, 1, 1) / (e^10 + 2), out ~ v0 = 100 e1.
  head_dim = 16
  k, v = np.zeros((3, head_dim), np.float32), np.zeros((3, head_dim), np.float32)
  k[0, 0] = 10.0
  v[0, 1], v[1, 1], v[2, 1] = 100.0, 2.0, 4.0
  case = _one_query_case(k, v)
  case["q"][0, 0, 0] = 1.0
  out = _run_one(case, sm_scale=1.0, sliding_window=2)
  expected = np.zeros((2, 1, head_dim), np.float32)
  expected[0, 0, 1] = 3.0
  np.testing.assert_allclose(out, expected, atol=1e-6)
  e10 = np.exp(10.0)
  np.testing.assert_allclose(_run_one(case, sm_scale=1.0)[0, 0, 1],
                             (100 * e10 + 6.0) / (e10 + 2), rtol=1e-5)


def test_hand_computed_cap_changes_the_argmax():
  # Four keys, q = e0, sm_scale 1: k0 = 10 e0 scores 10, k1..k3 = 0 score 0. v0 = e0,
  # v1 = v2 = v3 = e1. Uncapped: out = (e^10 e0 + 3 e1) / (e^10 + 3) = 0.99986 e0 +
  # 0.00014 e1, argmax 0. soft_cap c = 1: scores (tanh 10, 0, 0, 0) = (0.99999999588, 0,
  # 0, 0): out = (2.7182818 e0 + 3 e1) / 5.7182818 = 0.47537 e0 + 0.52463 e1, argmax 1.
  head_dim = 16
  k, v = np.zeros((4, head_dim), np.float32), np.zeros((4, head_dim), np.float32)
  k[0, 0], v[0, 0], v[1:, 1] = 10.0, 1.0, 1.0
  case = _one_query_case(k, v)
  case["q"][0, 0, 0] = 1.0
  plain = _run_one(case, sm_scale=1.0)[0, 0, :2]
  capped = _run_one(case, sm_scale=1.0, soft_cap=1.0)[0, 0, :2]
  e10, et = np.exp(10.0), np.exp(np.tanh(10.0))
  np.testing.assert_allclose(plain, [e10 / (e10 + 3), 3 / (e10 + 3)], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(capped, [et / (et + 3), 3 / (et + 3)], rtol=1e-5)
  np.testing.assert_allclose(capped, [0.47537, 0.52463], atol=1e-5)
  assert np.argmax(plain) == 0 and np.argmax(capped) == 1


@pytest.mark.parametrize("num_splits", [pytest.param(1, marks=pytest.mark.slow), 2,
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_hand_computed_sink_takes_half_the_mass(num_splits):
  # 17 keys, all k = 0 (score 0), all v = 2 e0; two query heads on one KV head (G = 2).
  # Head 0's sink is ln 17: denominator e^(ln 17) + 17 * e^0 = 34, out = 17 * 2 / 34 = 1,
  # half of the sinkless 2. Head 1's sink is 0: out = 34 / (1 + 17) = 1.8889.
  # J = 16 (R = 1, Z = 16), so the keys span 2 chunks: with 2 or 4 splits the pieces
  # are merged, and a sink counted twice would give head 0 34 / 51 = 0.667.
  head_dim = 16
  k, v = np.zeros((17, head_dim), np.float32), np.zeros((17, head_dim), np.float32)
  v[:, 0] = 2.0
  case = _one_query_case(k, v, num_q_heads=2)
  case["q"][0] = 1.0
  sinks = jnp.array([np.log(17.0), 0.0], jnp.float32)
  tiling = GpuTiling(q_tile=1, pages_per_chunk=1, num_splits=num_splits)
  out = _run_one(case, sm_scale=1.0, sinks=sinks, tiling=tiling)
  np.testing.assert_allclose(out[0, :, 0], [1.0, 34.0 / 18.0], rtol=1e-6)
  np.testing.assert_array_equal(out[0, :, 1:], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)  # padding row


def _variant_kwargs(kwargs):
  """The oracle's keyword arguments as the kernel takes them (sinks a jnp array)."""
  kwargs = dict(kwargs)
  if kwargs.get("sinks") is not None:
    kwargs["sinks"] = jnp.asarray(kwargs["sinks"])
  return kwargs


def _check_variant(case, variant, *, tiling=None, reference=False):
  """The kernel against the float64 oracle (and the jnp reference if asked); bf16 and f16
  pools go in as storage bits with ``kv_dtype``."""
  storage = case.kv_dtype != jnp.float32
  kv_dtype = case.kv_dtype if storage else None
  kwargs = _variant_kwargs(variant)
  sm_scale = case.q_THD.shape[-1] ** -0.5
  out = gpu.ragged_paged_attention(*case.jax_args(storage=storage), sm_scale=sm_scale,
                                   kv_dtype=kv_dtype, tiling=tiling, interpret=True,
                                   **kwargs)
  assert out.dtype == case.q_THD.dtype and out.shape == case.q_THD.shape
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  tol = attention_cases.tolerance(case.kv_dtype)
  np.testing.assert_allclose(out, attention_cases.oracle(case, sm_scale, **variant), **tol)
  if reference:
    ref = ragged_paged_attention_reference(*case.jax_args(storage=storage),
                                           sm_scale=sm_scale, kv_dtype=kv_dtype, **kwargs)
    np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), **tol)
  live_rows = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_array_equal(out[live_rows:], 0.0)


def _variant_case(seed, dtype, group, head_dim, block_size):
  q_lens, kv_lens = attention_cases.mixed_lengths(block_size)
  return attention_cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens, group=group,
                                   head_dim=head_dim, block_size=block_size, dtype=dtype)


def _named_variant(case, name):
  context = int(max(case.kv_lens_S[:case.num_seqs]))
  return dict(attention_cases.variant_grid(context, case.num_q_heads))[name]


# A covering subset: each variant family, GQA 1/4/8, head dims 64/128/256, float32 and
# bfloat16 storage bits, the default tiling and a split-K tiling with Q > 1.
FAST_VARIANTS = (
    # (dtype, G, D, Z, variant, tiling)
    (jnp.float32, 4, 64, 8, "all", None),
    (jnp.float32, 1, 128, 16, "window1_sinks", GpuTiling(q_tile=4, pages_per_chunk=1,
                                                         num_splits=3)),
    (jnp.bfloat16, 8, 256, 16, "all", None),
    (jnp.bfloat16, 4, 64, 8, "window_cap", GpuTiling(q_tile=3, pages_per_chunk=2,
                                                     num_splits=2)),
)


def _variant_id(params):
  dtype, group, head_dim, block_size, variant, tiling = params
  split = "" if tiling is None else f"-Q{tiling.q_tile}X{tiling.num_splits}"
  return f"{jnp.dtype(dtype).name}-G{group}-D{head_dim}-Z{block_size}-{variant}{split}"


@pytest.mark.parametrize("params", FAST_VARIANTS, ids=_variant_id)
def test_variants_match_oracle(params):
  dtype, group, head_dim, block_size, variant, tiling = params
  case = _variant_case(zlib.crc32(_variant_id(params).encode()), dtype, group, head_dim,
                       block_size)
  _check_variant(case, _named_variant(case, variant), tiling=tiling)


VARIANT_SHAPES = ((jnp.float32, 1, 64, 8), (jnp.float32, 4, 128, 16),
                  (jnp.float32, 8, 256, 8), (jnp.bfloat16, 1, 256, 16),
                  (jnp.bfloat16, 4, 64, 16), (jnp.bfloat16, 8, 128, 8))
VARIANT_NAMES = tuple(name for name, _ in attention_cases.variant_grid(10, 1))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("shape", VARIANT_SHAPES,
                         ids=lambda s: f"{jnp.dtype(s[0]).name}-G{s[1]}-D{s[2]}-Z{s[3]}")
def test_variants_full_grid(shape, variant):
  dtype, group, head_dim, block_size = shape
  case = _variant_case(len(variant) + head_dim + group, dtype, group, head_dim, block_size)
  _check_variant(case, _named_variant(case, variant), reference=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ("window_small", "window_sinks", "all"))
def test_variants_split_k_long_sequences(variant):
  # Long decode and chunked prefill rows with a forced split-K and Q = 4 tiles.
  case = attention_cases.make_case(21, q_lens=[1, 9, 1], kv_lens=[300, 250, 7], group=4,
                                   num_kv_heads=1, head_dim=64, block_size=8)
  variant = dict(attention_cases.variant_grid(300, case.num_q_heads))[variant]
  _check_variant(case, variant, tiling=GpuTiling(q_tile=4, pages_per_chunk=2, num_splits=4),
                 reference=True)


# --- Cost follows the window: pages the kernel loads. ---

def _expected_pages(case, *, q_tile, window):
  """Pages each (query tile, sequence) item must load, from the case alone: those
  overlapping ``[first_qpos - W + 1, last_qpos]`` within the sequence. Sorted list."""
  z = case.k_pages_LKNZD.shape[3]
  counts = []
  for i in range(case.num_seqs):
    start, end = int(case.cu_q_lens[i]), int(case.cu_q_lens[i + 1])
    kv_len = int(case.kv_lens_S[i])
    for tile in range(start // q_tile, -(-end // q_tile)):
      rows = range(max(start, tile * q_tile), min(end, (tile + 1) * q_tile))
      if not rows:
        continue
      first = kv_len - (end - start) + (rows[0] - start)
      last = kv_len - (end - start) + (rows[-1] - start)
      lo = 0 if window is None else max(0, first - window + 1)
      counts.append(-(-(last + 1) // z) - lo // z)
  return sorted(counts)


@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 20, 1])
def test_window_bounds_the_pages_loaded(window):
  # Decode at 200 and 77 tokens, a 13-row chunked prefill at 120, Z = 8, Q = 4 (tiles
  # split the prefill and cross sequence boundaries), 3 splits. The kernel's own page
  # counter (``loaded_pages``: a page counts when its first slot is loaded) must equal
  # the pages each item's window overlaps, computed here from the case, and the helper
  # the wrapper uses for the loop bounds (``work_items.pages_read``).
  case = attention_cases.make_case(22, q_lens=[1, 13, 1], kv_lens=[200, 120, 77],
                                   num_kv_heads=2, head_dim=16, block_size=8)
  tiling = GpuTiling(q_tile=4, pages_per_chunk=2, num_splits=3)
  pages_WK, seq_W, live_W = gpu.loaded_pages(*case.jax_args(), sm_scale=0.25,
                                             sliding_window=window, tiling=tiling)
  pages_WK, live_W = np.asarray(pages_WK), np.asarray(live_W)
  assert np.all(pages_WK == pages_WK[:, :1])  # every KV head loads the same pages
  counted = sorted(pages_WK[live_W, 0].tolist())
  assert counted == _expected_pages(case, q_tile=4, window=window)
  assert np.all(pages_WK[~live_W] == 0)
  if window == 1:  # a decode item reads one page; a 4-row prefill tile at most two
    assert max(counted) <= 2
  if window is None:
    assert max(counted) == 25  # all of the 200-token sequence


def test_pages_before_the_window_are_never_read():
  # Poison with NaN every page lying wholly before a sequence's first window (its first
  # query's position - W): the kernel, in interpret mode, would carry a NaN into the
  # output through the probability-times-V dot if it loaded any of them.
  window = 11
  case = attention_cases.make_case(23, q_lens=[1, 6, 2], kv_lens=[90, 64, 41],
                                   num_kv_heads=1, group=4, head_dim=32, block_size=8)
  z = case.k_pages_LKNZD.shape[3]
  case.k_pages_LKNZD, case.v_pages_LKNZD = case.k_pages_LKNZD.copy(), case.v_pages_LKNZD.copy()
  poisoned = 0
  for i in range(case.num_seqs):
    q_len = int(case.cu_q_lens[i + 1] - case.cu_q_lens[i])
    first = int(case.kv_lens_S[i]) - q_len
    for p in range(max(0, first - window + 1) // z):  # pages wholly before the window
      block = case.block_tables_SP[i, p]
      case.k_pages_LKNZD[:, :, block] = np.nan
      case.v_pages_LKNZD[:, :, block] = np.nan
      poisoned += 1
  assert poisoned >= 10
  _check_variant(case, dict(sliding_window=window),
                 tiling=GpuTiling(q_tile=2, pages_per_chunk=2, num_splits=2))


def test_pages_read_helper_and_window_begin():
  # qpos of a 2-row item are 40, 41; W = 10: window of the first query starts at 31, so
  # with Z = 8 the item starts at page 3 (position 24) and reads pages 3, 4, 5 (to 41).
  items = work_items.WorkItems(
      seq_W=jnp.array([0, 0], jnp.int32), horizon_W=jnp.array([42, 0], jnp.int32),
      row_WQ=jnp.array([[0, 1], [2, 3]], jnp.int32),
      row_live_WQ=jnp.array([[True, True], [False, False]]),
      qpos_WQ=jnp.array([[40, 41], [-1, -1]], jnp.int32))
  begin_W = work_items.kv_begin(items, sliding_window=10, block_size=8)
  np.testing.assert_array_equal(np.asarray(begin_W), [24, 0])
  np.testing.assert_array_equal(
      np.asarray(work_items.pages_read(begin_W, items.horizon_W, block_size=8)), [3, 0])
  no_window = work_items.kv_begin(items, sliding_window=None, block_size=8)
  np.testing.assert_array_equal(
      np.asarray(work_items.pages_read(no_window, items.horizon_W, block_size=8)), [6, 0])


# --- Variant validation and the shared-memory budget (no kernel runs). ---

@pytest.mark.parametrize("kwargs, name", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"),
    (dict(soft_cap=0.0), "soft_cap"),
    (dict(soft_cap=float("inf")), "soft_cap"),
    (dict(sinks=jnp.zeros((3,), jnp.float32)), "sinks"),
    (dict(sinks=jnp.zeros((2,), jnp.bfloat16)), "sinks"),
    (dict(kv_dtype=jnp.int32), "kv_dtype"),
    (dict(kv_dtype=jnp.bfloat16), "k_pages"),  # float32 pages are not bf16's storage
])
def test_variant_arguments_are_validated(kwargs, name):
  case = make_case(24, seqs=((1, 5),))  # H = 2, float32 pages
  with pytest.raises(ValueError, match=name):
    run_gpu(case, **kwargs)


def test_shared_memory_estimate_by_hand():
  # Q = 1, G = 8: M = 16 rows; R = 2, Z = 16: J = 32; D = 256; bf16 (2 bytes); 2 stages.
  # K and V tiles: 2 stages * 2 * 32 * 256 * 2 = 65536; Q operand 16 * 256 * 2 = 8192;
  # probabilities 16 * 32 * 2 = 1024; float32 accumulator scratch 16 * 256 * 4 = 16384.
  tiling = GpuTiling(q_tile=1, pages_per_chunk=2, num_splits=1, num_stages=2)
  assert tiling.shared_memory_bytes(group=8, block_size=16, head_dim=256,
                                    itemsize=2) == 65536 + 8192 + 1024 + 16384


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("num_tokens, num_seq_rows, group, block_size", [
    (1, 1, 8, 16), (256, 256, 2, 16), (2048, 4, 1, 16), (2048, 4, 2, 64), (512, 8, 1, 8),
    (96, 3, 16, 32)])
def test_default_tiling_fits_shared_memory_at_head_dim_256(num_tokens, num_seq_rows, group,
                                                            block_size, itemsize):
  tiling = tiling_lib.default_tiling(
      num_tokens=num_tokens, num_seq_rows=num_seq_rows, num_kv_heads=4, group=group,
      block_size=block_size, head_dim=256, blocks_per_seq=256, itemsize=itemsize)
  tiling.check_shapes(group=group, block_size=block_size, head_dim=256, itemsize=itemsize)
  assert tiling.shared_memory_bytes(group=group, block_size=block_size, head_dim=256,
                                    itemsize=itemsize) <= tiling_lib.SHARED_MEMORY_BUDGET


def test_tiling_over_the_shared_memory_budget_is_refused():
  # J = 8 * 16 = 128 positions, 3 stages, f32, D = 256: the K/V tiles alone need
  # 3 * 2 * 128 * 256 * 4 = 786432 bytes (768 KiB), over 227 KiB.
  tiling = GpuTiling(q_tile=16, pages_per_chunk=8, num_splits=1, num_stages=3)
  with pytest.raises(ValueError, match="pages_per_chunk=8"):
    tiling.check_shapes(group=1, block_size=16, head_dim=256, itemsize=4)
  case = make_case(25, seqs=((1, 20),), block_size=16, head_dim=256)
  with pytest.raises(ValueError, match="shared memory"):
    run_gpu(case, tiling=tiling)
  tiling.check_shapes(group=1, block_size=16, head_dim=64, itemsize=2)  # fits there


def test_float32_at_head_dim_256_reads_pages_of_128_in_parts():
  # Z = 128, D = 256, f32: one page of K and V alone needs 2 * 128 * 256 * 4 = 256 KiB, over
  # 227. The default reads it in two parts (page_split = 2, J = 64, one stage: 128 KiB of
  # K/V + q, probabilities and scratch ~ 161 KiB); a user tiling of whole pages is refused,
  # naming the knobs. bf16 keeps whole pages (one stage of 128 KiB fits).
  kwargs = dict(num_tokens=64, num_seq_rows=4, num_kv_heads=4, group=1, block_size=128,
                head_dim=256, blocks_per_seq=16)
  shapes = dict(group=1, block_size=128, head_dim=256)
  tiling = tiling_lib.default_tiling(**kwargs, itemsize=4)
  assert (tiling.page_split, tiling.chunk_size(128), tiling.num_stages) == (2, 64, 1)
  tiling.check_shapes(**shapes, itemsize=4)
  whole = dataclasses.replace(tiling, page_split=1)
  with pytest.raises(ValueError, match="shared memory.*page_split=1"):
    whole.check_shapes(**shapes, itemsize=4)
  bf16 = tiling_lib.default_tiling(**kwargs, itemsize=2)
  assert bf16.page_split == 1
  bf16.check_shapes(**shapes, itemsize=2)


def test_float32_at_head_dim_256_with_pages_of_128_matches():
  # The default above, run: a decode at 300 positions (3 pages, 6 parts), a 5-row chunked
  # prefill at 140 and a full prefill of 20, every unused slot NaN.
  case = make_case(26, seqs=((1, 300), (5, 140), (20, 20)), block_size=128, head_dim=256,
                   num_kv_heads=1, group=2, padding_seqs=1)
  tiling = gpu.default_tiling_for(case["q"], case["k_pages"], case["block_tables"])
  assert tiling.page_split == 2
  check_close(run_gpu(case), case)


@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 20])
def test_page_parts_match_and_load_each_page_once(window):
  # page_split = 4 (J = 16 of Z = 64), 3 splits, Q = 4: chunks and splits end inside
  # pages. The kernel's page counter (a page counts when its first slot is loaded) still
  # equals the pages each item's window overlaps, and the output matches.
  case = attention_cases.make_case(27, q_lens=[1, 13, 1], kv_lens=[200, 120, 77],
                                   num_kv_heads=2, head_dim=16, block_size=64)
  tiling = GpuTiling(q_tile=4, pages_per_chunk=1, num_splits=3, page_split=4)
  pages_WK, _, live_W = gpu.loaded_pages(*case.jax_args(), sm_scale=0.25,
                                         sliding_window=window, tiling=tiling)
  pages_WK, live_W = np.asarray(pages_WK), np.asarray(live_W)
  assert sorted(pages_WK[live_W, 0].tolist()) == _expected_pages(case, q_tile=4,
                                                                  window=window)
  variant = {} if window is None else dict(sliding_window=window)
  _check_variant(case, variant, tiling=tiling)


def test_window_caps_the_default_splits():
  # One decode row at up to 4096 positions: 64 splits without a window; with W = 100
  # an item reads at most cdiv(100 + 15, 64) = 2 chunks of J = 64, so 2 splits.
  kwargs = dict(num_tokens=1, num_seq_rows=1, num_kv_heads=1, group=8, block_size=16,
                head_dim=128, blocks_per_seq=256)
  assert tiling_lib.default_tiling(**kwargs).num_splits == tiling_lib.MAX_SPLITS
  assert tiling_lib.default_tiling(**kwargs, sliding_window=100).num_splits == 2


# --- Lowering for CUDA with each variant on, bf16 pools as storage bits. ---

MODEL_SHAPES = [
    # (name, H, K, D, Z)
    ("llama3_8b", 32, 8, 128, 16),
    ("gemma3", 8, 4, 256, 16),
    ("gpt_oss", 64, 8, 64, 16),
]
LOWERING_VARIANTS = {
    "window": dict(sliding_window=128),
    "soft_cap": dict(soft_cap=50.0),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=128, soft_cap=50.0, sinks=True),
}


@pytest.mark.parametrize("variant", tuple(LOWERING_VARIANTS))
@pytest.mark.parametrize("model", MODEL_SHAPES, ids=[row[0] for row in MODEL_SHAPES])
def test_variants_lower_for_cuda(model, variant):
  # A mixed batch: 96 query rows over 8 sequences (prefill chunks and decodes).
  name, H, K, D, Z = model
  T, S, num_blocks, blocks_per_seq, num_layers = 96, 8, 256, 64, 2
  kwargs = dict(LOWERING_VARIANTS[variant])
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), jnp.uint16),
          jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), jnp.uint16),
          i32(), i32(S), i32(S, blocks_per_seq), i32(S + 1), i32()]
  if kwargs.pop("sinks", False):
    args.append(jax.ShapeDtypeStruct((H,), jnp.float32))
    f = lambda *a: gpu.ragged_paged_attention(*a[:8], sinks=a[8], sm_scale=D ** -0.5,
                                              kv_dtype=jnp.bfloat16, **kwargs)
  else:
    f = lambda *a: gpu.ragged_paged_attention(*a, sm_scale=D ** -0.5,
                                              kv_dtype=jnp.bfloat16, **kwargs)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 1, name
  assert "ragged_paged_attention_split_k" in text
  # The storage-bit pools go to the kernel whole and as they are (no convert of the pool).
  assert "%arg1, %arg2" in calls[0]
  assert f"{Z}x{D}xui16>" in calls[0]
  # No loop around the kernel (work items by an unrolled binary search, not a while).
  assert "stablehlo.while" not in text


# --- Quantised pools (issue 20): int8 / float8 bits, one float32 scale per token and head. ---

def _run_quantized(case, kv_dtype, *, tiling=None, per_tensor=False, **variants):
  """The kernel on ``case``'s K/V quantised by ``attention_cases.quantized_args`` (unused
  memory NaN, NaN scales too). Scales and sinks are traced, so cases of one shape and one
  set of statics share a compiled kernel."""
  args, pool_kwargs = attention_cases.quantized_args(case, kv_dtype, per_tensor=per_tensor)
  sm_scale = case.q_THD.shape[-1] ** -0.5
  out = gpu.ragged_paged_attention(*args, sm_scale=sm_scale, tiling=tiling, interpret=True,
                                   **pool_kwargs, **_variant_kwargs(variants))
  return out, sm_scale


def _check_quantized(case, kv_dtype, out, sm_scale, **variants):
  """Against the jnp reference on the SAME quantised pool (bits, scales, NaN scales on
  unused memory) and the float64 oracle of its dequantised pages, at the tolerance of q's
  dtype (float32: the kernel computes in float32); finite; padding rows zero. Returns the
  output as float64 numpy."""
  assert out.dtype == case.q_THD.dtype and out.shape == case.q_THD.shape
  out = np.asarray(out.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out))
  tol = attention_cases.tolerance(case.q_THD.dtype)
  args, pool_kwargs = attention_cases.quantized_args(case, kv_dtype)
  ref = ragged_paged_attention_reference(*args, sm_scale=sm_scale, **pool_kwargs,
                                         **_variant_kwargs(variants))
  ref = np.asarray(ref.astype(jnp.float32), np.float64)
  assert np.abs(ref).max() > 0.1  # the comparisons are not vacuous
  np.testing.assert_allclose(out, ref, **tol)
  expected = attention_cases.oracle(attention_cases.dequantized_case(case, kv_dtype),
                                    sm_scale, **variants)
  np.testing.assert_allclose(out, expected, **tol)
  np.testing.assert_array_equal(out[int(case.cu_q_lens[case.num_seqs]):], 0.0)
  return out


def _quant_id(params):
  variant, kv_dtype, q_dtype, group, head_dim, block_size, tiling = params
  split = "" if tiling is None else f"-Q{tiling.q_tile}X{tiling.num_splits}"
  return (f"{jnp.dtype(kv_dtype).name}-{variant}-q{jnp.dtype(q_dtype).name}-G{group}"
          f"-D{head_dim}-Z{block_size}{split}")


# (variant, K/V dtype, q dtype, G, D, Z, tiling). Default run: int8 and float8_e4m3fn with a
# float32 q (float32 tolerance), each with a window and a cap or sinks, one under split-K;
# float8_e5m2 with a bfloat16 q (q . k_bits on bfloat16 operands) and every variant. The
# slow grid adds every variant family, head dims 128 / 256, Z 32 and G 8.
QUANT_FAST = (
    ("window_sinks", jnp.int8, jnp.float32, 4, 64, 8,
     GpuTiling(q_tile=3, pages_per_chunk=2, num_splits=2)),
    ("window_cap", jnp.float8_e4m3fn, jnp.float32, 2, 32, 16, None),
    ("all", jnp.float8_e5m2, jnp.bfloat16, 2, 32, 8, None),
)
QUANT_SLOW = (
    ("all", jnp.int8, jnp.bfloat16, 4, 128, 16, None),
    ("window1_sinks", jnp.int8, jnp.float32, 1, 64, 32, None),
    ("cap", jnp.int8, jnp.float32, 8, 256, 8, None),
    ("all", jnp.float8_e4m3fn, jnp.bfloat16, 8, 256, 16, None),
    ("sinks", jnp.float8_e4m3fn, jnp.float32, 4, 64, 32,
     GpuTiling(q_tile=4, pages_per_chunk=1, num_splits=3)),
    ("window_small", jnp.float8_e4m3fn, jnp.bfloat16, 1, 128, 16, None),
    ("window_eq", jnp.float8_e5m2, jnp.float32, 4, 128, 8, None),
    ("window_sinks", jnp.float8_e5m2, jnp.float16, 2, 64, 16, None),
)


def _unused_block_first(case):
  """``case`` with its block ids relabelled so that block 0 is a page no live sequence owns
  (all NaN: bits and scales). The kernel points the lanes it does not load at block 0, so
  a scale (or tile) read that is not masked off reads NaN there and poisons the output."""
  owned = {int(case.block_tables_SP[i, p]) for i in range(case.num_seqs)
           for p in range(-(-int(case.kv_lens_S[i]) // case.k_pages_LKNZD.shape[3]))}
  unused = min(set(range(case.k_pages_LKNZD.shape[2])) - owned)
  order = np.arange(case.k_pages_LKNZD.shape[2])
  order[[0, unused]] = order[[unused, 0]]  # a swap: its own inverse
  case = dataclasses.replace(case, k_pages_LKNZD=case.k_pages_LKNZD[:, :, order],
                             v_pages_LKNZD=case.v_pages_LKNZD[:, :, order],
                             block_tables_SP=order[case.block_tables_SP].astype(np.int32))
  assert np.all(np.isnan(case.k_pages_LKNZD[:, :, 0]))
  return case


def _quant_case(params):
  _, _, q_dtype, group, head_dim, block_size, _ = params
  case = _variant_case(zlib.crc32(_quant_id(params).encode()), q_dtype, group, head_dim,
                       block_size)
  return _unused_block_first(case)


def _check_quantized_variant(params):
  variant_name, kv_dtype, q_dtype, group, head_dim, block_size, tiling = params
  case = _quant_case(params)
  variant = _named_variant(case, variant_name)
  out, sm_scale = _run_quantized(case, kv_dtype, tiling=tiling, **variant)
  if variant.get("sliding_window"):
    # Pages wholly before every window of a sequence NaN (bits and scales): never loaded,
    # so the output is bit for bit the same (same compiled kernel).
    poisoned = attention_cases.poison_before_window(case, variant["sliding_window"])
    poisoned_out, _ = _run_quantized(poisoned, kv_dtype, tiling=tiling, **variant)
    np.testing.assert_array_equal(np.asarray(poisoned_out), np.asarray(out))
  out = _check_quantized(case, kv_dtype, out, sm_scale, **variant)
  # Quantisation changed the answer a little (the pool's values were read, not float K/V),
  # and the variant changed it a lot.
  exact = attention_cases.oracle(case, sm_scale, **variant)
  assert 1e-5 < attention_cases.relative_error(out, exact, case) < 0.1
  if variant_name not in ("window_eq", "window_large"):
    plain = attention_cases.oracle(attention_cases.dequantized_case(case, kv_dtype),
                                   sm_scale)
    assert np.abs(out - plain).max() > 0.05


@pytest.mark.parametrize("params", QUANT_FAST, ids=_quant_id)
def test_quantized_matches_reference(params):
  _check_quantized_variant(params)


@pytest.mark.slow
@pytest.mark.parametrize("params", QUANT_SLOW, ids=_quant_id)
def test_quantized_matches_reference_slow_grid(params):
  _check_quantized_variant(params)


# Issue 20's accuracy batch, shared with every impl's tests and
# benchmarks/kv_quant_accuracy.py: four KV heads 1x..10x apart, three outlier tokens.
QUANT_ACCURACY_CASE = attention_cases.quant_accuracy_case()
QUANT_BOUND = {jnp.dtype(jnp.int8): 1.5e-2, jnp.dtype(jnp.float8_e4m3fn): 6e-2}


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name)
def test_quantized_accuracy_against_float32_kv(kv_dtype):
  # Issue 20's bound: max abs error / max abs output against the same attention over the
  # unquantised float32 K/V (float64 oracle). For int8, one scale per tensor on the same
  # data (same compiled kernel, only the scales differ) is the negative control.
  case = QUANT_ACCURACY_CASE
  exact = attention_cases.oracle(case, 128 ** -0.5)
  out, _ = _run_quantized(case, kv_dtype)
  assert np.all(np.isfinite(np.asarray(out)))
  error = attention_cases.relative_error(out, exact, case)
  print(f"\npallas_gpu {jnp.dtype(kv_dtype).name} relative error {error:.2e}")
  assert error <= QUANT_BOUND[jnp.dtype(kv_dtype)], error
  if jnp.dtype(kv_dtype) == jnp.int8:
    out_tensor, _ = _run_quantized(case, kv_dtype, per_tensor=True)
    per_tensor = attention_cases.relative_error(out_tensor, exact, case)
    print(f"pallas_gpu int8 per-tensor relative error {per_tensor:.2e}")
    assert per_tensor > QUANT_BOUND[jnp.dtype(kv_dtype)] and per_tensor > 2 * error


def test_quantized_through_paged_attention_entry_point():
  # paged_attention(impl="pallas_gpu") on a KVCache(dtype=float8_e4m3fn) built from float
  # pages (it quantises them, NaN pages giving NaN scales): the kernel gets the bits,
  # kv_dtype and both scale arrays. Same shapes and statics as the e4m3fn case above, so
  # the compiled kernel is shared.
  params = QUANT_FAST[1]
  variant_name, kv_dtype, _, _, head_dim, _, _ = params
  case = _quant_case(params)
  variant = _named_variant(case, variant_name)
  q, k_pages, v_pages, *rest = case.jax_args()
  cache = paged_jax.KVCache(k_pages, v_pages, dtype=kv_dtype)
  assert cache.quantized and cache.k_scales is not None
  out = paged_jax.paged_attention(q, cache, *rest, impl="pallas_gpu", interpret=True,
                                  **_variant_kwargs(variant))
  _check_quantized(case, kv_dtype, out, head_dim ** -0.5, **variant)


def _tiny_args(pages_dtype=jnp.float32):
  """Kernel arguments of one 5-token sequence over [1, 2, 4, 8, 16] pages (no kernel run
  is needed: validation fails at trace time)."""
  pages = jnp.zeros((1, 2, 4, 8, 16), pages_dtype)
  return (jnp.zeros((2, 2, 16), jnp.float32), pages, pages, 0, jnp.array([5], jnp.int32),
          jnp.array([[0]], jnp.int32), jnp.array([0, 1], jnp.int32), jnp.int32(1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_dtype=jnp.int8), "k_scales"),  # scales missing
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "v_scales"),
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 16), jnp.float32),
          v_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "k_scales"),  # wrong Z
    (dict(kv_dtype=jnp.int8, k_scales=jnp.ones((1, 2, 4, 8), jnp.float32),
          v_scales=jnp.ones((1, 2, 4, 8), jnp.bfloat16)), "v_scales"),  # not float32
    (dict(kv_dtype=jnp.float8_e4m3fn, k_scales=jnp.ones((1, 2, 4, 8), jnp.float32),
          v_scales=jnp.ones((1, 2, 4, 8), jnp.float32)), "k_pages"),  # int8 not e4m3 bits
])
def test_quantized_rejects_bad_scales(kwargs, match):
  with pytest.raises(ValueError, match=match):
    gpu.ragged_paged_attention(*_tiny_args(jnp.int8), sm_scale=1.0, interpret=True,
                               **kwargs)


def test_scales_for_an_unquantized_pool_are_refused():
  scales = jnp.ones((1, 2, 4, 8), jnp.float32)
  for kwargs in (dict(), dict(kv_dtype=jnp.bfloat16)):
    pages_dtype = jnp.uint16 if kwargs else jnp.float32
    with pytest.raises(ValueError, match="k_scales"):
      gpu.ragged_paged_attention(*_tiny_args(pages_dtype), sm_scale=1.0, interpret=True,
                                 k_scales=scales, v_scales=scales, **kwargs)


QUANT_LOWERINGS = [(model, kv_dtype) for model in MODEL_SHAPES[:2]
                   for kv_dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)]


@pytest.mark.parametrize("model, kv_dtype", QUANT_LOWERINGS,
                         ids=[f"{m[0]}-{jnp.dtype(d).name}" for m, d in QUANT_LOWERINGS])
def test_quantized_lowers_for_cuda(model, kv_dtype):
  # One-byte pools (int8 bits, float8 as uint8 bits) with f32[L, K, N, Z] scales, bfloat16
  # q, every variant on; a mixed batch of 96 rows over 8 sequences.
  name, H, K, D, Z = model
  T, S, num_blocks, blocks_per_seq, num_layers = 96, 8, 256, 64, 2
  storage = layout.storage_dtype(kv_dtype)
  pages = jax.ShapeDtypeStruct((num_layers, K, num_blocks, Z, D), storage)
  scales = jax.ShapeDtypeStruct(layout.scales_shape(num_layers, K, num_blocks, Z),
                                jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), pages, pages, i32(), i32(S),
          i32(S, blocks_per_seq), i32(S + 1), i32(),
          jax.ShapeDtypeStruct((H,), jnp.float32), scales, scales]
  f = lambda *a: gpu.ragged_paged_attention(
      *a[:8], sinks=a[8], k_scales=a[9], v_scales=a[10], sm_scale=D ** -0.5,
      sliding_window=128, soft_cap=50.0, kv_dtype=kv_dtype)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 1, name
  assert "ragged_paged_attention_split_k" in text
  # The one-byte pools and both scale arrays go to the kernel whole and as they are.
  bits = "ui8" if storage == jnp.uint8 else "i8"
  assert calls[0].count(f"{num_blocks}x{Z}x{D}x{bits}>") == 2, name
  assert calls[0].count(f"{num_layers}x{K}x{num_blocks}x{Z}xf32>") == 2, name
