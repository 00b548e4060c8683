"""The XLA path's prefill tiles (``pallas_kernels/xla/prefill.py``) against the float64 oracle.

One ragged batch holds every kind of row: a long prefill whose first tile starts before row
0 and covers an earlier sequence's row, a chunked prefill at a longer context, a sequence
just under ``min_rows`` (the unit path), decodes, an idle sequence and padding; unused
memory is NaN. Small explicit tilings (Q = 32, J = 16) give several tiles and chunks per
sequence; the default tiling is checked through ``paged_attention`` too. The plan is
checked to read the causal triangle (the band with a window) and no more. Under ``slow``:
a 300-token prompt through ``LLM`` at T = 256 against the dense model (tokens and log-probs).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, paged_attention
from paged_jax.pallas_kernels.xla import ragged as xla_ragged
from paged_jax.pallas_kernels.xla import XlaTiling, ragged_paged_attention as xla_attention
from paged_jax.pallas_kernels.xla.prefill import PrefillTiling, plan_prefill
from tests import attention_cases as cases

PREFILL = PrefillTiling(q_tile=32, pages_per_chunk=2, min_rows=16)  # J = 16 at Z = 8
TILING = XlaTiling(q_tile=4, pages_per_chunk=2, prefill=PREFILL)
# Rows: a decode; 100 prefill rows from position 0 (4 tiles, the first starting 27 rows
# before row 0 and holding the decode's row); a decode; 40 rows of a chunked prefill at 150
# (2 tiles); 15 rows (< min_rows: units); an idle sequence; 3 rows at 60 (units).
Q_LENS = [1, 100, 1, 40, 15, 0, 3]
KV_LENS = [37, 100, 9, 150, 15, 5, 60]
SCALE = 64 ** -0.5


def make(seed, dtype=jnp.float32, group=2):
  return cases.make_case(seed, q_lens=Q_LENS, kv_lens=KV_LENS, num_kv_heads=2, group=group,
                         head_dim=64, block_size=8, dtype=dtype)


def check(case, out, dtype, **variants):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert np.all(np.isfinite(out)), "output must be finite (NaN pages were read)"
  expected = cases.oracle(case, SCALE, **variants)
  live = int(case.cu_q_lens[case.num_seqs])
  tol = dict(rtol=2e-5, atol=2e-5) if jnp.dtype(dtype) == jnp.float32 else dict(rtol=2e-2,
                                                                                 atol=2e-2)
  np.testing.assert_allclose(out[:live], expected[:live], **tol)
  np.testing.assert_array_equal(out[live:], 0.0)  # padding rows are zero


_plan = jax.jit(plan_prefill, static_argnames=("num_tokens", "block_size", "blocks_per_seq",
                                               "tiling", "sliding_window"))


def plan_of(q_lens, kv_lens, *, tiling, block_size, blocks_per_seq, window=None, pad=0):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  return _plan(jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(len(q_lens)),
               num_tokens=sum(q_lens) + pad, block_size=block_size,
               blocks_per_seq=blocks_per_seq, tiling=tiling, sliding_window=window)


def test_batch_takes_both_paths():
  case = make(0)
  plan = plan_of(Q_LENS, KV_LENS, tiling=PREFILL, block_size=8, blocks_per_seq=20, pad=2)
  live = int(plan.num_items)
  assert live == 6  # 4 tiles of the 100 rows, 2 of the 40
  np.testing.assert_array_equal(np.asarray(plan.seq_W)[:live], [1, 1, 1, 1, 3, 3])
  np.testing.assert_array_equal(np.asarray(plan.row0_W)[:live], [-27, 5, 37, 69, 78, 110])
  np.testing.assert_array_equal(np.asarray(plan.first_live_W)[:live], [28, 0, 0, 0, 24, 0])
  # The unit path serves every other live row and none of these.
  plan_work = jax.jit(xla_ragged.plan_work, static_argnames=(
      "num_tokens", "block_size", "blocks_per_seq", "tiling", "sliding_window"))
  units = plan_work(jnp.asarray(case.kv_lens_S), jnp.asarray(case.cu_q_lens),
                    jnp.int32(case.num_seqs), num_tokens=case.q_THD.shape[0], block_size=8,
                    blocks_per_seq=case.block_tables_SP.shape[1], tiling=TILING)
  seqs = set(np.asarray(units.item_seq_W)[np.asarray(units.row_live_WQ).any(axis=1)].tolist())
  assert seqs == {0, 2, 4, 6}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_prefill_tiles_match_oracle(dtype):
  case = make(1, dtype)
  storage = jnp.dtype(dtype).itemsize < 4  # bfloat16 pages as storage bits
  out = xla_attention(*case.jax_args(storage=storage), sm_scale=SCALE, tiling=TILING,
                      kv_dtype=case.kv_dtype if storage else None)
  check(case, out, dtype)


def test_default_tiling_through_paged_attention():
  # T = 266: a decode, 200 prefill rows (one tile of 256 whose first 56 rows are the decode's
  # and padding before row 0), a 3-row chunk and a 60-row one (units).
  case = cases.make_case(2, q_lens=[1, 200, 3, 60], kv_lens=[37, 200, 60, 300],
                         num_kv_heads=2, group=4, head_dim=64, block_size=8)
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  default = xla_ragged.default_tiling(q.shape[0], tables.shape[0], 8, tables.shape[1],
                                      num_kv_heads=2, group=4)
  # J = 32 pages of 8 (256 positions); Q = 256 (K * Q * G * J = 2^20); >= 128 rows.
  assert default.prefill == PrefillTiling(q_tile=256, pages_per_chunk=32, min_rows=128)
  # Below 256 rows a call keeps the units alone.
  assert xla_ragged.default_tiling(255, 4, 8, 39, num_kv_heads=2, group=4).prefill is None
  out = paged_attention(q, KVCache(k_pages=k_pages, v_pages=v_pages), layer, kv_lens, tables,
                        cu, num_seqs, impl="xla")
  check(case, out, jnp.float32)


def test_variants_window_cap_sinks():
  # Window 60: late tiles skip the chunks before their window (poisoned) and use some
  # chunks unmasked (wholly inside every row's window, at or before the first row).
  case = cases.poison_before_window(make(3), 60)
  variants = dict(sliding_window=60, soft_cap=2.0, sinks=cases.make_sinks(4, case.num_q_heads))
  out = xla_attention(*case.jax_args(), sm_scale=SCALE, tiling=TILING, **variants)
  check(case, out, jnp.float32, **variants)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_quantised_kv(dtype):
  case = make(4)
  args, kwargs = cases.quantized_args(case, dtype)  # unused memory keeps NaN scales
  out = xla_attention(*args, sm_scale=SCALE, tiling=TILING, **kwargs)
  check(cases.dequantized_case(case, dtype), out, jnp.float32)


def test_hand_computed_case_in_one_tile():
  # The hand case of test_attention through a prefill tile of 2 rows and chunks of 1 page
  # (Z = 2): keys at 0, 1, 2 are 0, ln 2, ln 3 and values 3, 6, 9; queries 1 at positions 1
  # and 2: 5 = (3 + 6 * 2) / 3 and 7 = (3 + 12 + 27) / 6. Row 2 is padding.
  k_pages, v_pages = cases.hand_case_pages()
  tiling = XlaTiling(q_tile=1, pages_per_chunk=1,
                     prefill=PrefillTiling(q_tile=2, pages_per_chunk=1, min_rows=2))
  out = xla_attention(jnp.ones((3, 1, 1), jnp.float32), jnp.asarray(k_pages),
                      jnp.asarray(v_pages), 0, jnp.array([3], jnp.int32),
                      jnp.array([[3, 1]], jnp.int32), jnp.array([0, 2], jnp.int32),
                      jnp.int32(1), sm_scale=1.0, tiling=tiling)
  np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [5.0, 7.0, 0.0], rtol=1e-6)


def test_plan_reads_the_causal_triangle():
  # 4096 rows from position 0, Q = 256, J = 256 (16 pages of 16): tile k (positions
  # 256k .. 256k + 255) reads chunks 0..k, so 16 * 17 / 2 = 136 chunks, not 16 * 16 = 256.
  tiling = PrefillTiling(q_tile=256, pages_per_chunk=16, min_rows=128)
  plan = plan_of([4096], [4096], tiling=tiling, block_size=16, blocks_per_seq=256)
  assert int(plan.num_items) == 16
  assert int(np.sum(plan.chunks_W)) == 136
  # A window of 512: tile k's first row at 256k sees from 256k - 511, page 16k - 32 (or 0):
  # chunks start there and end at the tile's last row: at most ceil(767 / 256) = 3.
  plan = plan_of([4096], [4096], tiling=tiling, block_size=16, blocks_per_seq=256,
                 window=512)
  first_page = np.asarray(plan.first_page_W)[:16]
  np.testing.assert_array_equal(first_page, np.maximum(0, 16 * np.arange(16) - 32))
  assert int(np.max(plan.chunks_W)) == 3 and int(np.sum(plan.chunks_W)) == 1 + 2 + 14 * 3
  # A chunk of 40 rows at context 1000 (Q = 256): one tile, rows before it are padding.
  plan = plan_of([40], [1000], tiling=tiling, block_size=16, blocks_per_seq=64)
  assert int(plan.num_items) == 0  # 40 < min_rows: the unit path's
  plan = plan_of([200], [1000], tiling=tiling, block_size=16, blocks_per_seq=64)
  assert int(plan.num_items) == 1 and int(plan.first_live_W[0]) == 56
  assert int(plan.pos0_W[0]) == 1000 - 256 and int(plan.chunks_W[0]) == 4  # 63 pages


def test_bad_prefill_tiling_raises_value_error():
  with pytest.raises(ValueError, match=r"q_tile=0 must be an int >= 1"):
    PrefillTiling(q_tile=0, pages_per_chunk=1, min_rows=1)
  with pytest.raises(ValueError, match=r"prefill=\(2, 1\) must be a PrefillTiling or None"):
    XlaTiling(q_tile=1, pages_per_chunk=1, prefill=(2, 1))


@pytest.mark.slow
def test_engine_long_prompt_matches_dense_model():
  # A 300-token prompt through LLM at T = 256: its first chunk (256 rows) takes the tiles,
  # the rest and the decode rows the units; a short prompt shares the steps. Greedy tokens
  # equal those of the dense model run on the whole sequence (one padded compilation).
  from paged_jax.engine import LLM, SamplingParams
  from paged_jax.models import ModelConfig, init_random

  config = ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=512, eos_token_ids=(2,))
  model = init_random(config, seed=1, impl="xla")
  assert xla_ragged.default_tiling(256, 2, 16, 20, num_kv_heads=2, group=2).prefill is not None
  llm = LLM(model, config, block_size=16, num_blocks=48, max_seqs=2, max_tokens_per_step=256,
            token_buckets=(256,), enable_prefix_caching=False, compilation_cache=False)
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (300, 20)]
  outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True))
  dense = jax.jit(lambda t: jax.nn.log_softmax(model(t)[0], axis=-1))
  for prompt, out in zip(prompts, outs):
    seq, logprobs = list(prompt), []
    for _ in range(4):
      padded = np.zeros((1, 320), np.int32)
      padded[0, :len(seq)] = seq
      logp = np.asarray(dense(jnp.asarray(padded)))[len(seq) - 1]
      seq.append(int(np.argmax(logp)))
      logprobs.append(float(logp[seq[-1]]))
    assert list(out.token_ids) == seq[len(prompt):]
    # A random 2-layer model's argmax barely depends on attention: its log-probs do.
    np.testing.assert_allclose(out.logprobs, logprobs, rtol=1e-4, atol=1e-4)
