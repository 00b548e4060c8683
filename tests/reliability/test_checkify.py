"""Out-of-range block ids in a user-supplied table.

Plain JAX indexing clamps an out-of-range index silently (``x[N]`` is ``x[N - 1]``, and a
negative index wraps); ``validate_attention_inputs`` raises on the host,
``checked_paged_attention`` (``paged_attention(..., debug=True)`` under ``checkify``)
raises under ``jit``, and the unchecked paths never depend on the clamp: a bad entry reads
as an empty block, never as block N - 1 (extends
tests/paged_jax/test_attention.py::test_out_of_range_table_entry_is_never_clamped, which
checks the zero output of the reference and XLA paths eagerly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from paged_jax import KVCache, paged_attention, validate_attention_inputs
from paged_jax.attention import checked_paged_attention
from tests import attention_cases as cases

IMPLS = ("reference", "xla")
BAD_IDS = ("N", "N+5", "int32 max", "-2", "NO_BLOCK")
# Negative ids must not wrap either: jnp normalises negative indices before the "fill"
# bounds check, so both paths mask ``(id >= 0) & (id < N)`` before the gather.
UNCHECKED_IDS = BAD_IDS


def _bad(name, n):
  return {"N": n, "N+5": n + 5, "int32 max": 2 ** 31 - 1, "-2": -2, "NO_BLOCK": -1}[name]


def _args(case):
  q, k, v, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  return dict(q=q, cache=KVCache(k_pages=k, v_pages=v), layer=layer, kv_lens=kv_lens,
              block_tables=tables, cu_q_lens=cu, num_seqs=num_seqs)


def _case():
  q_lens, kv_lens = cases.mixed_lengths(8)
  return cases.make_case(21, q_lens=q_lens, kv_lens=kv_lens, group=2)


def test_plain_jax_indexing_clamps_silently():
  x = jnp.arange(4.0)
  idx = jnp.int32(7)
  assert float(jax.jit(lambda x, i: x[i])(x, idx)) == 3.0  # x[N-1], no error
  assert float(jax.jit(lambda x, i: x[i])(x, jnp.int32(-2))) == 2.0  # wraps
  pages = jnp.arange(3 * 2.0).reshape(3, 2)
  np.testing.assert_array_equal(jax.jit(lambda p, i: p[i])(pages, jnp.int32(3)), pages[2])


@pytest.mark.parametrize("bad", BAD_IDS)
def test_host_validation_and_checkify_catch_bad_ids(bad):
  case = _case()
  args = _args(case)
  n = args["cache"].num_blocks
  table = case.block_tables_SP.copy()
  table[5, 2] = _bad(bad, n)  # sequence 5 (kv_len 3Z + 1) reads its logical block 2
  args["block_tables"] = jnp.asarray(table)
  match = r"block_tables\[5, 2\]=.* must be a block id in \[0, N=%d\)" % n
  with pytest.raises(ValueError, match=match):
    validate_attention_inputs(**args)
  for impl in IMPLS:
    with pytest.raises(ValueError, match=match):
      checked_paged_attention(**args, impl=impl)
  # The same mode by hand: debug=True inside a user's jit, functionalised by checkify.
  f = checkify.checkify(jax.jit(lambda a: paged_attention(**a, impl="xla", debug=True)))
  err, _ = f(args)
  assert "block_tables[5, 2]" in err.get()
  # debug=True called eagerly: the same ValueError (checkify's JaxRuntimeError before).
  with pytest.raises(ValueError, match=match):
    paged_attention(**args, impl="xla", debug=True)
  # checked_paged_attention inside a user's jit cannot raise after its call: it says what
  # to do there (err.get() on a tracer raised TracerBoolConversionError before).
  with pytest.raises(ValueError, match=r"checked_paged_attention raises after its call, so "
                                       r"it cannot run inside jit"):
    jax.jit(lambda a: checked_paged_attention(**a, impl="xla"))(args)


def test_checkify_catches_inconsistent_lengths():
  case = _case()
  good = _args(case)
  out = checked_paged_attention(**good, impl="xla")
  np.testing.assert_array_equal(out, paged_attention(**good, impl="xla"))
  kv = case.kv_lens_S.copy()
  kv[2] = 1  # below its q_len of 5
  with pytest.raises(ValueError, match=r"kv_lens\[2\]=1 must be in \[q_len=5"):
    checked_paged_attention(**{**good, "kv_lens": jnp.asarray(kv)}, impl="xla")
  kv = case.kv_lens_S.copy()
  kv[0] = case.block_tables_SP.shape[1] * 8 + 1  # past P * Z
  with pytest.raises(ValueError, match=r"kv_lens\[0\]"):
    checked_paged_attention(**{**good, "kv_lens": jnp.asarray(kv)}, impl="xla")
  cu = case.cu_q_lens.copy()
  cu[2], cu[3] = cu[3], cu[2]
  with pytest.raises(ValueError, match=r"non-decreasing"):
    checked_paged_attention(**{**good, "cu_q_lens": jnp.asarray(cu)}, impl="xla")
  cu = case.cu_q_lens.copy()
  cu[case.num_seqs:] = case.q_THD.shape[0] + 1
  with pytest.raises(ValueError, match=r"cu_q_lens\[num_seqs\]"):
    checked_paged_attention(**{**good, "cu_q_lens": jnp.asarray(cu)}, impl="xla")
  with pytest.raises(ValueError, match=r"num_seqs=9"):
    checked_paged_attention(**{**good, "num_seqs": jnp.int32(9)}, impl="xla")
  with pytest.raises(ValueError, match=r"layer=5"):
    checked_paged_attention(**{**good, "layer": jnp.int32(5)}, impl="xla")
  with pytest.raises(ValueError, match=r"debug="):
    paged_attention(**good, impl="xla", debug="yes")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", UNCHECKED_IDS)
def test_unchecked_paths_never_read_a_clamped_block(impl, bad):
  # One decode row over one full block (Z = 8). Every block but the sequence's own is NaN:
  # a clamp to N - 1 or a wrap of a negative id would read NaN. Under jit, the bad entry
  # reads as an empty block: zero keys and values, so a zero output.
  case = cases.make_case(9, q_lens=[1], kv_lens=[8], padding_seqs=0, padding_tokens=0,
                         extra_blocks=3)
  n = case.k_pages_LKNZD.shape[2]
  case.block_tables_SP[0, 0] = _bad(bad, n)
  args = _args(case)
  attend = jax.jit(lambda a: paged_attention(**a, impl=impl))
  out = np.asarray(attend(args))
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, 0.0, atol=1e-6)
  # Reading block N - 1 (what a clamping gather would do) gives a different answer.
  k = case.k_pages_LKNZD.copy()
  k[:, :, n - 1] = 1.0
  v = case.v_pages_LKNZD.copy()
  v[:, :, n - 1] = 1.0
  clamped = {**args, "block_tables": jnp.asarray(np.full_like(case.block_tables_SP, n - 1)),
             "cache": KVCache(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))}
  np.testing.assert_allclose(np.asarray(attend(clamped)), 1.0, atol=1e-6)
  poisoned = {**args, "cache": KVCache(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))}
  np.testing.assert_allclose(np.asarray(attend(poisoned)), 0.0, atol=1e-6)


def test_cache_write_and_copy_never_clamp():
  # Slots and copy ids outside [0, N) write nothing (a clamping scatter would hit block N-1).
  cache = KVCache(k_pages=jnp.zeros((1, 1, 3, 2, 1)), v_pages=jnp.zeros((1, 1, 3, 2, 1)))
  k = jnp.ones((4, 1, 1))
  out = jax.jit(lambda c, s: c.write(0, k, k, s))(cache, jnp.array([6, 7, -1, 2 ** 31 - 1],
                                                                   jnp.int32))
  assert not np.any(np.asarray(out.k_pages))
  filled = KVCache(k_pages=jnp.ones((1, 1, 3, 2, 1)), v_pages=jnp.ones((1, 1, 3, 2, 1)))
  filled = filled.write(0, jnp.zeros((2, 1, 1)), jnp.zeros((2, 1, 1)),
                        jnp.array([0, 1], jnp.int32))  # block 0 -> zeros
  out = jax.jit(lambda c: c.copy_blocks(jnp.array([3, 0, -2], jnp.int32),
                                        jnp.array([2, 3, 1], jnp.int32)))(filled)
  np.testing.assert_array_equal(np.asarray(out.k_pages)[0, 0, :, :, 0], [[0, 0], [1, 1], [1, 1]])
