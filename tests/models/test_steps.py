"""The jitted prefill / decode steps against the dense forward.

One module-scoped run (prefill of a ragged batch of three prompts, then decode steps with
changing active sets and lengths) feeds several tests, so the steps compile once for the
whole module: every later call has the same shapes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import models
from paged_jax import step as steps_lib
from paged_jax import KVCache, allocator
from tests.models import helpers

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_SEQS = 3
BLOCKS_PER_SEQ = 8
PREFILL_TOKENS = 24
PROMPTS = ([5, 17, 99, 3, 64], [7, 7, 120, 1, 0, 45, 2, 90, 33], [11, 12, 13])
ACTIVE = ([1, 1, 1], [1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 0])
RTOL = 1e-5


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _pack(chunks) -> tuple[jax.Array, jax.Array]:
  """tokens_T (chunks in slot order, zero padded to PREFILL_TOKENS) and num_new_S."""
  flat = [t for chunk in chunks for t in chunk]
  assert len(flat) <= PREFILL_TOKENS  # one shape for the whole module: no recompiles
  tokens_T = jnp.asarray(flat + [0] * (PREFILL_TOKENS - len(flat)), jnp.int32)
  return tokens_T, jnp.asarray([len(c) for c in chunks], jnp.int32)


@pytest.fixture(scope="module")
def model():
  return models.init_random(helpers.tiny_config("llama"), seed=0, impl="xla")


@pytest.fixture(scope="module")
def steps(model):
  return models.Steps(model)


def _fresh(model):
  alloc = allocator.init(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, BLOCKS_PER_SEQ)
  cache = KVCache.create(model.kv_cache_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
  return alloc, cache


DENSE_SHAPE = (MAX_SEQS, 16)


@pytest.fixture(scope="module")
def dense(model):
  """``dense(sequences)``: causal logits ``[B, 16, V]``, right padded (padding is never seen).

  Jitted at one shape so the module compiles the dense forward once.
  """
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, tokens_BT: nnx.merge(graphdef, params)(tokens_BT))

  def run(sequences):
    tokens_BT = np.zeros(DENSE_SHAPE, np.int32)
    for b, s in enumerate(sequences):
      tokens_BT[b, :len(s)] = s
    return np.asarray(forward(params, jnp.asarray(tokens_BT)))

  return run


@pytest.fixture(scope="module")
def run(model, steps):
  """Prefill PROMPTS, then decode with the ACTIVE masks; the decode step trace-guarded."""
  rng = np.random.default_rng(3)
  sequences = [list(p) for p in PROMPTS]
  alloc, cache = _fresh(model)
  guarded = chex.assert_max_traces(steps_lib.decode_step, n=1)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(steps_lib, "decode_step", guarded)
    decode_cache_before = steps_lib._decode_jit._cache_size()
    prefill_logits, alloc, cache, ok = steps.prefill(alloc, cache, *_pack(PROMPTS))
    assert bool(ok.all())
    decode_logits = []  # per step: {seq: logits of its new token}
    for active in ACTIVE:
      tokens_S = rng.integers(0, helpers.VOCAB, MAX_SEQS).astype(np.int32)
      logits_SV, alloc, cache, ok = steps.decode(alloc, cache, jnp.asarray(tokens_S),
                                                 jnp.asarray(active, bool))
      assert bool(ok.all())
      step = {}
      for s in range(MAX_SEQS):
        if active[s]:
          sequences[s].append(int(tokens_S[s]))
          step[s] = (len(sequences[s]) - 1, np.asarray(logits_SV[s]))
        else:
          np.testing.assert_array_equal(np.asarray(logits_SV[s]), 0.0)
      decode_logits.append(step)
    decode_compiles = steps_lib._decode_jit._cache_size() - decode_cache_before
  allocator.validate(alloc)
  return dict(prefill_logits=np.asarray(prefill_logits), decode_logits=decode_logits,
              sequences=sequences, alloc=alloc, decode_compiles=decode_compiles)


def test_prefill_then_decode_equals_dense(dense, run):
  want = dense(run["sequences"])
  for s, prompt in enumerate(PROMPTS):
    assert _rel(run["prefill_logits"][s], want[s, len(prompt) - 1]) < RTOL
  checked = 0
  for step in run["decode_logits"]:
    for s, (position, logits) in step.items():
      assert _rel(logits, want[s, position]) < RTOL
      checked += 1
  assert checked == sum(map(sum, ACTIVE))
  np.testing.assert_array_equal(np.asarray(run["alloc"].seq_lens),
                                [len(s) for s in run["sequences"]])


def test_decode_step_traces_once(run):
  # chex.assert_max_traces(n=1) guarded decode_step during all the steps above (lengths and
  # active sets changed every step); the jit cache gained at most the one entry.
  assert run["decode_compiles"] <= 1


def test_steps_take_lists_and_numpy_arrays_as_jax_arrays(model, steps):
  # Lists were traced item by item (a TracerArrayConversionError), and NumPy arrays beside
  # JAX arrays of the same shape compiled a second time: both are JAX arrays before the
  # jitted call now, with the same results and one compilation.
  tokens_T, num_new_S = _pack(PROMPTS)
  results, sizes = [], []
  for convert in (jnp.asarray, np.asarray, lambda x: np.asarray(x).tolist()):
    alloc, cache = _fresh(model)
    logits, alloc, cache, ok = steps.forward(alloc, cache, convert(tokens_T),
                                             convert(num_new_S))
    active = [True] * MAX_SEQS
    logits2, alloc, cache, ok2 = steps.decode(alloc, cache, convert(tokens_T[:MAX_SEQS]),
                                              active if convert is not jnp.asarray
                                              else jnp.asarray(active))
    assert bool(ok.all()) and bool(ok2.all())
    results.append((np.asarray(logits), np.asarray(logits2)))
    sizes.append((steps_lib._forward_jit._cache_size(), steps_lib._decode_jit._cache_size()))
  for got in results[1:]:
    np.testing.assert_array_equal(got[0], results[0][0])
    np.testing.assert_array_equal(got[1], results[0][1])
  assert sizes[1] == sizes[0] and sizes[2] == sizes[0], sizes
  with pytest.raises(ValueError, match="num_new holds 4294967299"):
    steps.forward(*_fresh(model), tokens_T, np.array([2**32 + 3] + [0] * (MAX_SEQS - 1)))
  with pytest.raises(ValueError, match=r"alloc_state=dict must be an allocator"):
    steps_lib.forward_step(model, {"block_size": 4}, _fresh(model)[1], tokens_T, num_new_S)


def test_ragged_batch_equals_each_alone(model, steps, run):
  for s, prompt in enumerate(PROMPTS):
    alloc, cache = _fresh(model)
    chunks = [[] for _ in PROMPTS]
    chunks[s] = prompt
    logits_SV, alloc, cache, ok = steps.prefill(alloc, cache, *_pack(chunks))
    assert bool(ok.all())
    assert _rel(logits_SV[s], run["prefill_logits"][s]) < RTOL
    others = [r for r in range(MAX_SEQS) if r != s]
    np.testing.assert_array_equal(np.asarray(logits_SV[jnp.asarray(others)]), 0.0)


def _sequence_kv(cache: KVCache, alloc, seq: int) -> tuple[np.ndarray, np.ndarray]:
  """K and V of sequence ``seq``, ``[L, K, len, D]``, read through its block table."""
  length = int(alloc.seq_lens[seq])
  slots = np.asarray(allocator.slots(alloc, jnp.full(length, seq), jnp.arange(length)))
  blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
  k = np.asarray(cache.k_pages)[:, :, blocks, offsets]
  v = np.asarray(cache.v_pages)[:, :, blocks, offsets]
  return k, v


def test_chunked_prefill_equals_single_prefill(model, steps, dense):
  prompt = [3, 9, 27, 81, 115, 89, 11, 33, 99, 41, 123]  # 11 tokens, chunks of 4, 4, 3
  seq = 1
  # Single prefill; another sequence in slot 0 so the blocks differ between the runs.
  alloc_one, cache_one = _fresh(model)
  logits_one, alloc_one, cache_one, ok = steps.prefill(alloc_one, cache_one,
                                                       *_pack([[], prompt, []]))
  assert bool(ok.all())
  alloc, cache = _fresh(model)
  _, alloc, cache, ok = steps.prefill(alloc, cache, *_pack([[1, 2, 3, 4, 5], [], []]))
  for start, end in ((0, 4), (4, 8), (8, 11)):
    chunks = [[], prompt[start:end], []]
    logits, alloc, cache, ok = steps.prefill(alloc, cache, *_pack(chunks))
    assert bool(ok.all())
  assert _rel(logits[seq], logits_one[seq]) < RTOL
  k_one, v_one = _sequence_kv(cache_one, alloc_one, seq)
  k, v = _sequence_kv(cache, alloc, seq)
  np.testing.assert_allclose(k, k_one, rtol=RTOL, atol=1e-6)
  np.testing.assert_allclose(v, v_one, rtol=RTOL, atol=1e-6)
  # And the next decode token sees the same context.
  active = jnp.asarray([False, True, False])
  token_S = jnp.asarray([0, 77, 0], jnp.int32)
  after_one, *_ = steps.decode(alloc_one, cache_one, token_S, active)
  # The step donated the pool and the allocator state: updated in place, not copied.
  assert cache_one.k_pages.is_deleted() and alloc_one.block_tables.is_deleted()
  after, *_ = steps.decode(alloc, cache, token_S, active)
  assert _rel(after[seq], after_one[seq]) < RTOL
  want = dense([prompt + [77]])
  assert _rel(after[seq], want[0, len(prompt)]) < RTOL


def test_failed_allocation_drops_only_that_sequence(model, steps, dense):
  a, hog, c = [5, 6, 7, 8, 9], list(range(20, 36)), [50, 51, 52]
  alloc, cache = _fresh(model)
  _, alloc, cache, ok = steps.prefill(alloc, cache, *_pack([a, hog, c]))
  assert bool(ok.all())
  hog_table = np.asarray(alloc.block_tables[1])  # read now: the step donates `alloc`
  # The hog asks for 17 more tokens: 16 + 17 > P * Z = 32, so its append fails; a and c grow
  # inside their partial last blocks and their tokens are packed around the dropped ones.
  logits_SV, alloc, cache, ok = steps.prefill(alloc, cache, *_pack([[60, 61], [1] * 17, [70]]))
  np.testing.assert_array_equal(np.asarray(ok), [True, False, True])
  np.testing.assert_array_equal(np.asarray(logits_SV[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(alloc.seq_lens), [7, 16, 4])
  np.testing.assert_array_equal(np.asarray(alloc.block_tables[1]), hog_table)
  allocator.validate(alloc)
  want = dense([a + [60, 61], c + [70]])
  assert _rel(logits_SV[0], want[0, 6]) < RTOL
  assert _rel(logits_SV[2], want[1, 3]) < RTOL


def test_tokens_past_the_step_are_refused(model, steps):
  alloc, cache = _fresh(model)
  # 20 + 10 > T = 24: the second sequence runs past the step, and so does the third (its
  # tokens would sit at rows 30..33). Both are refused; nothing is allocated for them.
  tokens_T = jnp.arange(PREFILL_TOKENS, dtype=jnp.int32)
  logits_SV, alloc, cache, ok = steps.prefill(alloc, cache, tokens_T,
                                              jnp.asarray([20, 10, 4], jnp.int32))
  np.testing.assert_array_equal(np.asarray(ok), [True, False, False])
  np.testing.assert_array_equal(np.asarray(alloc.seq_lens), [20, 0, 0])
  np.testing.assert_array_equal(np.asarray(logits_SV[1:]), 0.0)
  allocator.validate(alloc)


def test_a_cache_the_allocator_does_not_address_is_refused(model):
  # The allocator hands out slots block_id * Z + offset of ITS pool: a cache of another
  # block size, or of fewer blocks, was written and read at the wrong places (logits 1.4
  # off the dense forward, every ok True). Both are seen from the shapes, at trace time.
  alloc, _ = _fresh(model)
  tokens_T, num_new_S = _pack(PROMPTS)
  for block_size, num_blocks, name in ((8, NUM_BLOCKS, "block_size"),
                                       (BLOCK_SIZE, 2, "num_blocks")):
    cache = KVCache.create(model.kv_cache_spec(block_size=block_size, num_blocks=num_blocks))
    want = {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}[name]
    with pytest.raises(ValueError, match=rf"cache\.{name}=\d+ must equal "
                                         rf"alloc_state\.{name}={want}"):
      steps_lib.forward_step(model, alloc, cache, tokens_T, num_new_S)


def test_decode_step_refuses_float_tokens_and_non_bool_flags(model):
  # Float tokens were truncated and 0.5 counted as active, where forward_step refuses a
  # float tokens_T by name.
  alloc, cache = _fresh(model)
  tokens, active = jnp.asarray([5, 6, 7], jnp.int32), jnp.asarray([True, False, True])
  for bad_tokens, bad_active, match in (
      (jnp.asarray([1.7, 2.9, 3.0]), active, r"tokens\.shape=\(3,\) dtype=float32 must be ints"),
      (tokens, jnp.asarray([0.5, 0.0, 1.0]), r"active\.shape=\(3,\) dtype=float32 must be bools"),
      (tokens, jnp.asarray([2, 0, 1]), r"active\.shape=\(3,\) dtype=int32 must be bools"),
      (tokens[:2], active[:2], r"tokens\.shape=\(2,\) .* \[S\]=\[3\]")):
    with pytest.raises(ValueError, match=match):
      steps_lib.decode_step(model, alloc, cache, bad_tokens, bad_active)


def test_request_counts_that_would_wrap_int32_are_refused(model):
  # The running sum of the requests used to wrap: [2**31 - 1, 5, 0] made sequence 1 look
  # as if it fit, granted it 5 tokens read from rows that held none of its tokens, with
  # ok True. Now the sums saturate past T; an idle sequence (a request of 0) is always ok.
  tokens_T = jnp.arange(1, PREFILL_TOKENS + 1, dtype=jnp.int32)
  for num_new, want_ok in (([2**31 - 1, 5, 0], [False, False, True]),
                           ([2**30, 2**30, 3], [False, False, False]),
                           ([PREFILL_TOKENS + 1, 0, 0], [False, True, True]),
                           ([3, 2**31 - 1, 4], [True, False, False])):
    alloc, _ = _fresh(model)
    alloc, inputs = steps_lib.prepare_step(alloc, tokens_T, jnp.asarray(num_new, jnp.int32))
    np.testing.assert_array_equal(np.asarray(inputs.ok_S), want_ok)
    kept = [n if ok else 0 for n, ok in zip(num_new, want_ok)]
    np.testing.assert_array_equal(np.asarray(alloc.seq_lens), kept)
    np.testing.assert_array_equal(np.asarray(inputs.q_lens_S), kept)
    # Only the kept sequence's rows (the first 3 tokens for the last case) are live.
    live = sum(kept)
    np.testing.assert_array_equal(np.asarray(inputs.tokens_T)[:live], np.arange(1, live + 1))
    np.testing.assert_array_equal(np.asarray(inputs.tokens_T)[live:], 0)
    allocator.validate(alloc)


def test_host_integers_that_do_not_fit_int32_are_refused(model):
  # jnp.asarray of an int64 array wraps it to int32 (2**32 + 3 new tokens were taken as
  # 3, token id 2**32 + 5 as 5), where allocator.append refuses the same request.
  alloc, cache = _fresh(model)
  tokens_T = np.arange(PREFILL_TOKENS, dtype=np.int64)
  big = np.array([2**32 + 3, 0, 0], np.int64)
  with pytest.raises(ValueError, match="num_new holds 4294967299, which does not fit int32"):
    steps_lib.prepare_step(alloc, tokens_T, big)
  with pytest.raises(ValueError, match="num_new holds 4294967299"):
    steps_lib.forward_step(model, alloc, cache, tokens_T, big)
  tokens_T[1] = 2**32 + 5
  with pytest.raises(ValueError, match="tokens holds 4294967301"):
    steps_lib.prepare_step(alloc, tokens_T, np.array([3, 0, 0], np.int64))
  with pytest.raises(ValueError, match="tokens holds 4294967301"):
    steps_lib.decode_step(model, alloc, cache, tokens_T[:3], np.ones(3, bool))
  with pytest.raises(ValueError, match="start holds -4294967296"):
    steps_lib.tokens_from_history(np.zeros((3, 8), np.int32), np.array([-2**32, 0, 0]),
                                  np.array([1, 0, 0]), 4)


def test_tokens_from_history_packs_windows_inside_the_history():
  history_SJ = jnp.asarray(np.arange(3 * 6).reshape(3, 6) + 100, jnp.int32)
  pack = steps_lib.tokens_from_history
  # Sequence 0: columns 4..5, sequence 1: none, sequence 2: columns 0..2; then padding.
  got = pack(history_SJ, [4, 3, 0], [2, 0, 3], 8)  # lists are taken as arrays
  np.testing.assert_array_equal(np.asarray(got), [104, 105, 112, 113, 114, 0, 0, 0])
  # A window past the history was filled with its last column repeated ([104, 105, 105,
  # 105]) and one before it with column 0: concrete, now a ValueError naming it.
  for start, num_new, match in (([4, 0, 0], [4, 0, 0], r"start\[0\]=4, num_new\[0\]=4: the "
                                 r"window \[4, 8\) must lie inside the history \[0, M=6\)"),
                                ([0, -2, 0], [0, 3, 0], r"start\[1\]=-2, num_new\[1\]=3")):
    with pytest.raises(ValueError, match=match):
      pack(history_SJ, jnp.asarray(start), jnp.asarray(num_new), 8)
  # Under jit they cannot be refused: the positions outside the history give token 0.
  traced = jax.jit(pack, static_argnums=3)(history_SJ, jnp.asarray([4, -2, 0]),
                                           jnp.asarray([4, 3, 0]), 8)
  np.testing.assert_array_equal(np.asarray(traced), [104, 105, 0, 0, 0, 0, 106, 0])
  for args, match in (((history_SJ, jnp.asarray([0.0, 0, 0]), jnp.zeros(3, jnp.int32), 4),
                       r"start\.shape=\(3,\) dtype=float32 must be an integer \[S\]=\[3\]"),
                      ((history_SJ.astype(jnp.float32), jnp.zeros(3, jnp.int32),
                        jnp.zeros(3, jnp.int32), 4), r"tokens_SJ\.shape=\(3, 6\) dtype=float32"),
                      ((history_SJ, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), 0),
                       r"num_tokens=0 must be an int >= 1"),
                      ((history_SJ, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), 8.0),
                       r"num_tokens=8.0 must be an int >= 1")):
    with pytest.raises(ValueError, match=match):
      pack(*args)


def test_step_functions_name_a_bad_model_an_empty_step_and_unknown_ids(model):
  alloc, cache = _fresh(model)
  tokens_T, num_new_S = _pack(PROMPTS)
  # The model was used before it was checked: AttributeError 'paged_forward'.
  with pytest.raises(ValueError, match="model=object must be a flax.nnx.Module"):
    steps_lib.forward_step(object(), alloc, cache, tokens_T, num_new_S)
  with pytest.raises(ValueError, match="model=object must be a flax.nnx.Module"):
    steps_lib.decode_step(object(), alloc, cache, jnp.zeros(3, jnp.int32), jnp.ones(3, bool))
  # T = 0: jnp.take's IndexError before.
  with pytest.raises(ValueError, match=r"tokens.shape=\(0,\): a forward step needs T >= 1"):
    steps_lib.forward_step(model, alloc, cache, jnp.zeros(0, jnp.int32), num_new_S)
  # Ids outside the vocabulary were clamped to the nearest one (ok True, the logits of id
  # V - 1); called eagerly, a live row's id is refused as the dense forward refuses it.
  # Padding rows may hold any id.
  bad = tokens_T.at[2].set(helpers.VOCAB)
  with pytest.raises(ValueError, match=rf"tokens hold id {helpers.VOCAB}, outside the "
                                       rf"vocabulary \[0, vocab_size={helpers.VOCAB}\)"):
    steps_lib.forward_step(model, alloc, cache, bad, num_new_S)
  with pytest.raises(ValueError, match="tokens hold id -1"):
    steps_lib.decode_step(model, alloc, cache, jnp.asarray([3, -1, 4], jnp.int32),
                          jnp.ones(3, bool))
  padded = tokens_T.at[PREFILL_TOKENS - 1].set(-7)  # a padding row
  _, alloc, cache, ok = steps_lib.forward_step(model, alloc, cache, padded, num_new_S)
  assert bool(ok.all())
