"""Hypothesis fuzzing over the public API: each call returns a correct, finite result or
raises ValueError / TypeError naming the argument. No crash, no NaN, no hang."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paged_jax import KVCache, allocator, paged_attention
from paged_jax.engine import SamplingParams
from tests import attention_cases as cases
from tests.reliability.conftest import VOCAB, check_all_free, make_llm

FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALLOC_STEPS = 40  # random allocator ops per example


# --- paged_attention -----------------------------------------------------------------------

@st.composite
def _case(draw):
  block_size = draw(st.sampled_from([1, 4, 8]))
  num_seqs = draw(st.integers(1, 4))
  kv_lens = [draw(st.integers(0, 3 * block_size + 2)) for _ in range(num_seqs)]
  q_lens = [draw(st.integers(0, k)) for k in kv_lens]
  group = draw(st.sampled_from([1, 2, 4]))
  return cases.make_case(draw(st.integers(0, 2 ** 20)), q_lens=q_lens, kv_lens=kv_lens,
                         block_size=block_size, group=group, num_kv_heads=draw(
                             st.sampled_from([1, 2])), head_dim=draw(st.sampled_from([8, 16])),
                         dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
                         padding_seqs=draw(st.integers(0, 2)),
                         padding_tokens=draw(st.integers(0, 3)))


def _attend(case, impl):
  q, k, v, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  return paged_attention(q, KVCache(k_pages=k, v_pages=v), layer, kv_lens, tables, cu,
                         num_seqs, impl=impl)


@FUZZ
@given(case=_case(), impl=st.sampled_from(["reference", "xla"]))
def test_fuzz_paged_attention_matches_oracle(case, impl):
  out = np.asarray(_attend(case, impl).astype(jnp.float32))
  assert np.all(np.isfinite(out))  # unused pages are NaN: never read
  live = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_allclose(out[:live], cases.oracle(case)[:live],
                             **cases.tolerance(case.q_THD.dtype))
  np.testing.assert_array_equal(out[live:], 0.0)


_BREAKS = {
    "q": lambda a: dict(q=a["q"][..., None]),
    "q.dtype": lambda a: dict(q=a["q"].astype(jnp.int32)),
    "block_tables": lambda a: dict(block_tables=a["block_tables"].astype(jnp.float32)),
    "kv_lens": lambda a: dict(kv_lens=a["kv_lens"][:-1]),
    "cu_q_lens": lambda a: dict(cu_q_lens=a["cu_q_lens"][1:]),
    "num_seqs": lambda a: dict(num_seqs=jnp.zeros(3, jnp.int32)),
    "layer": lambda a: dict(layer=7),
    "cache": lambda a: dict(cache=(a["cache"].k_pages, a["cache"].v_pages)),
    "impl": lambda a: dict(impl="tpu"),
    "sm_scale": lambda a: dict(sm_scale="big"),
}


@FUZZ
@given(case=_case(), which=st.sampled_from(sorted(_BREAKS)))
def test_fuzz_paged_attention_bad_input_names_the_argument(case, which):
  q, k, v, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  args = dict(q=q, cache=KVCache(k_pages=k, v_pages=v), layer=layer, kv_lens=kv_lens,
              block_tables=tables, cu_q_lens=cu, num_seqs=num_seqs, impl="xla")
  args.update(_BREAKS[which](args))
  name = which.split(".")[0]
  with pytest.raises((ValueError, TypeError)) as info:
    paged_attention(**args)
  assert name in str(info.value) or which == "sm_scale"


# --- allocator -----------------------------------------------------------------------------

N, Z, S, P = 10, 4, 4, 5
_append = jax.jit(allocator.append)
_release = jax.jit(allocator.release)
_fork = jax.jit(allocator.fork)
_preempt = jax.jit(allocator.preempt)


@FUZZ
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "release", "fork", "preempt"]),
                              st.lists(st.integers(-3, 12), min_size=S, max_size=S),
                              st.integers(-2, N + 2)),
                    min_size=ALLOC_STEPS, max_size=ALLOC_STEPS))
def test_fuzz_allocator_ops_keep_every_invariant(ops):
  state = allocator.init(N, Z, S, P)
  for op, values, extra in ops:
    v = jnp.asarray(values, jnp.int32)
    if op == "append":
      before = np.asarray(state.seq_lens)
      state, ok = _append(state, v)
      ok = np.asarray(ok)
      assert np.all(ok[np.asarray(values) == 0])  # a request of 0 is always ok
      np.testing.assert_array_equal(np.asarray(state.seq_lens)[~ok], before[~ok])
    elif op == "release":
      state = _release(state, v > 4)
    elif op == "fork":
      state, ok, src, dst = _fork(state, v[:2] % (S + 2) - 1, v[2:] % (S + 2) - 1)
    else:
      state, _ = _preempt(state, v, jnp.int32(extra))
    allocator.validate(state)  # invariants after every op, valid input or not


@FUZZ
@given(which=st.sampled_from(["append shape", "append dtype", "release dtype", "fork rank",
                              "preempt needed", "init"]))
def test_fuzz_allocator_bad_input_names_the_argument(which):
  state = allocator.init(N, Z, S, P)
  calls = {
      "append shape": (lambda: allocator.append(state, jnp.zeros(S + 1, jnp.int32)),
                       "num_new_tokens"),
      "append dtype": (lambda: allocator.append(state, jnp.zeros(S, jnp.float32)),
                       "num_new_tokens"),
      "release dtype": (lambda: allocator.release(state, jnp.zeros(S, jnp.int32)), "mask"),
      "fork rank": (lambda: allocator.fork(state, jnp.zeros((1, 1), jnp.int32),
                                           jnp.zeros((1, 1), jnp.int32)), "src"),
      "preempt needed": (lambda: allocator.preempt(state, jnp.zeros(S, jnp.int32),
                                                   jnp.zeros(2, jnp.int32)), "needed"),
      "init": (lambda: allocator.init(0, Z, S, P), "num_blocks"),
  }
  fn, name = calls[which]
  with pytest.raises((ValueError, TypeError), match=name):
    fn()


# --- SamplingParams and generate -----------------------------------------------------------

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 2 ** 33), st.floats(allow_nan=True),
                 st.text(max_size=3), st.tuples(st.integers(-2, 200)))
_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
           "ignore_eos", "logprobs", "n")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(field=st.sampled_from(_FIELDS), value=_ANY)
def test_fuzz_sampling_params(field, value):
  try:
    p = SamplingParams(**{field: value})
  except (ValueError, TypeError) as e:
    assert field in str(e)
    return
  assert getattr(p, field) is not None or field == "seed"


@pytest.fixture(scope="module")
def fuzz_llm(model, config):
  return make_llm(model, config, max_seqs=2)


_PROMPT = st.one_of(st.lists(st.integers(-2, VOCAB + 2), min_size=0, max_size=12),
                    st.just("text"), st.just(7), st.lists(st.integers(3, 50), min_size=80,
                                                          max_size=80))


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(_PROMPT, st.integers(1, 6), st.integers(1, 3)), min_size=1,
                      max_size=3))
def test_fuzz_generate(fuzz_llm, batch):
  prompts = [p for p, _, _ in batch]
  params = [SamplingParams(max_tokens=m, n=n, ignore_eos=True) for _, m, n in batch]
  try:
    outs = fuzz_llm.generate(prompts, params)
  except (ValueError, TypeError) as e:
    assert "prompts[" in str(e) or "params[" in str(e)
  else:
    assert len(outs) == sum(sp.n for sp in params)
    for o in outs:
      assert 1 <= len(o.token_ids) and all(0 <= t < VOCAB for t in o.token_ids)
  check_all_free(fuzz_llm)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_no_query_rows_returns_empty(impl):
  # Found by the fuzzer: T = 0 crashed the reference path (ZeroDivisionError); now [0, H, D].
  case = cases.make_case(1, q_lens=[0], kv_lens=[3], padding_tokens=0)
  out = _attend(case, impl)
  assert out.shape == (0,) + case.q_THD.shape[1:]
