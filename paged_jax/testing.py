"""Assertions for your own model's tests, in the style of ``chex`` (``AssertionError``
saying what differs).

- ``assert_paged_matches_dense(model, config, sequences)``: the model's paged forward,
  fed the sequences in random ragged chunks (several sequences per step, some idle, block
  tables shuffled, every unused page NaN), gives the logits of its dense forward at every
  position; the step traces once; the allocator's invariants hold after every step.
- ``assert_allocator_invariants(state)``: ``allocator.validate`` as an assertion (a state
  with a leading data-shard axis, ``LLM.allocator_state`` under a mesh, is checked per
  shard).
- ``assert_traces_once(fn, calls)``: ``jit(fn)`` over several argument sets of one shape
  traces ``fn`` exactly once.
- ``shuffled_allocator(...)`` and ``nan_cache(spec)``: the fixtures the first one uses, for
  your own checks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import allocator
from paged_jax import kv_groups as kv_groups_lib
from paged_jax import protocol
from paged_jax import step as step_api
from paged_jax.kv_cache import KVCache
from paged_jax.spec import KVCacheSpec

__all__ = ["assert_allocator_invariants", "assert_paged_matches_dense", "assert_traces_once",
           "nan_cache", "shuffled_allocator"]


def shuffled_allocator(num_blocks: int, block_size: int, max_seqs: int,
                       max_blocks_per_seq: int, *, seed: int = 0,
                       windows=None) -> allocator.AllocatorState:
  """An empty allocator whose free blocks are handed out in a random order (its free order
  is least recently used first: each block gets a random distinct past stamp), so block
  tables are scattered over the pool, never ``0, 1, 2, ...``. ``windows``: its KV groups'
  (``allocator.init``)."""
  state = allocator.init(num_blocks, block_size, max_seqs, max_blocks_per_seq,
                         windows=windows)
  stamps_N = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
  return dataclasses.replace(state, last_used=jnp.asarray(stamps_N),
                             clock=jnp.int32(num_blocks))


# int8's 255 levels a token, float8's 3 (e4m3) or 2 (e5m2) mantissa bits; float16's 10
# mantissa bits against bfloat16's 7.
_DEFAULT_RTOL = {jnp.dtype(jnp.float64): 2e-5, jnp.dtype(jnp.float32): 2e-5,
                 jnp.dtype(jnp.float16): 1e-2, jnp.dtype(jnp.bfloat16): 2e-2,
                 jnp.dtype(jnp.int8): 4e-2, jnp.dtype(jnp.float8_e4m3fn): 6e-2,
                 jnp.dtype(jnp.float8_e5m2): 1.5e-1}


@jax.jit
def _fill_nan(cache: KVCache) -> KVCache:
  num_slots = cache.num_blocks * cache.block_size
  nan_TKD = jnp.full((num_slots, cache.num_kv_heads, cache.head_dim), jnp.nan, jnp.float32)
  slots_T = jnp.arange(num_slots, dtype=jnp.int32)
  for layer in range(cache.num_layers):
    cache = cache.write(layer, nan_TKD, nan_TKD, slots_T)
  return cache


def nan_cache(spec: KVCacheSpec) -> KVCache:
  """A cache of ``spec`` whose every slot holds NaN (written through ``KVCache.write``):
  a model that reads a page its sequence does not own gets NaN logits."""
  return _fill_nan(KVCache.create(spec))


def assert_allocator_invariants(state: allocator.AllocatorState) -> None:
  """Every invariant of ``allocator.validate`` holds (``AssertionError`` naming the first
  broken one). A state whose leaves carry a leading data-shard axis (an engine's on a mesh
  with a "data" axis) is checked per shard; a state with KV groups per group (its tables
  ``[g, S, P]`` have no shard axis: ``num_free``, a scalar per shard, tells them apart)."""
  allocator._check_state(state)  # a ValueError for anything else
  shards = [state]
  if np.ndim(state.num_free) == 1:
    shards = [jax.tree_util.tree_map(lambda x, i=i: x[i], state)
              for i in range(np.shape(state.num_free)[0])]
  for i, shard in enumerate(shards):
    try:
      allocator.validate(shard)
    except ValueError as e:
      where = "" if len(shards) == 1 else f" (data shard {i})"
      raise AssertionError(f"allocator invariant broken{where}: {e}") from None


def assert_traces_once(fn: Callable, calls: Iterable[Sequence[Any]], **jit_kwargs) -> list:
  """Run ``jax.jit(fn, **jit_kwargs)`` on each argument tuple of ``calls`` (same shapes,
  other values) and assert that ``fn`` was traced exactly once. Returns the outputs."""
  count = [0]

  def counted(*args, **kwargs):
    count[0] += 1
    return fn(*args, **kwargs)

  jitted = jax.jit(counted, **jit_kwargs)
  outs = [jitted(*args) for args in calls]
  if count[0] != 1:
    name = getattr(fn, "__name__", repr(fn))
    raise AssertionError(f"{name} was traced {count[0]} times over {len(outs)} calls; a step "
                         "must trace once (pad inputs to fixed shapes, keep Python values "
                         "that change out of its static arguments)")
  return outs


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return math.inf
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _schedule(lengths: list[int], num_tokens: int, rng) -> list[list[int]]:
  """Random ragged chunks: per step, tokens of each sequence (some idle), total <= T."""
  left, steps = list(lengths), []
  while any(left):
    chunk = [int(rng.integers(0, n + 1)) if rng.random() < 0.8 else 0 for n in left]
    if not any(chunk):  # progress: the first unfinished sequence gets a token
      chunk[next(i for i, n in enumerate(left) if n)] = 1
    budget = num_tokens
    for i, c in enumerate(chunk):
      chunk[i] = min(c, budget)
      budget -= chunk[i]
    if not any(chunk):
      chunk[next(i for i, n in enumerate(left) if n)] = 1
    steps.append(chunk)
    left = [n - c for n, c in zip(left, chunk)]
  return steps


@functools.partial(jax.jit, static_argnames=("graphdef", "kwargs", "kv_groups"),
                   donate_argnums=(1, 2))
def _paged_step(params, alloc, cache, tokens_T, num_new_S, *, graphdef, kwargs, kv_groups):
  """One step of ``assert_paged_matches_dense``: the logits of every new token, and of
  each sequence's last one through ``logits_indices`` (the second forward's cache is
  kept; both write the same K/V)."""
  model = protocol.merge(graphdef, params)
  alloc, inputs = step_api.prepare_step(alloc, tokens_T, num_new_S, kv_groups=kv_groups)
  logits_TV, _ = step_api.paged_forward_checked(model, cache, inputs, **dict(kwargs))
  logits_SV, cache = step_api.paged_forward_checked(model, cache, inputs,
                                                    logits_indices=inputs.last_S,
                                                    **dict(kwargs))
  return logits_TV, logits_SV, alloc, cache, inputs


def assert_paged_matches_dense(model, config, sequences: Sequence[Sequence[int]], *,
                               dense: Callable | None = None, block_size: int = 4,
                               num_blocks: int | None = None,
                               max_tokens_per_step: int | None = None,
                               cache_dtype=None, rtol: float | None = None, seed: int = 0,
                               forward_kwargs: dict | None = None,
                               free_outside_window: bool | None = None) -> dict:
  """Assert that ``model``'s paged forward gives its dense logits over a ragged batch.

  The sequences (token-id lists, of different lengths) are fed through
  ``paged_jax.step.prepare_step`` and ``model.paged_forward`` in random chunks: several
  sequences per step, some idle, a long one over several steps (chunked prefill, then
  single tokens as in decode), block tables shuffled over a pool whose every unused slot
  holds NaN. At each step every new token's logits must equal the dense forward's at its
  position (relative error ``max|paged - dense| / max|dense|`` per sequence below
  ``rtol``), ``logits_indices`` must select the same rows, the allocator's invariants
  must hold, and the jitted step must trace once.

  Args:
    model: the model (``paged_jax.protocol``).
    config: its config (``num_layers``, ``num_kv_heads``, ``head_dim``, ...).
    sequences: token-id lists, one per sequence (batch rows S = their number).
    dense: ``dense(tokens_BT) -> [B, T, V]`` causal logits (positions 0..T-1; rows right
      padded with 0); default ``model(tokens_BT)``.
    block_size: Z; ``num_blocks`` default: every sequence's blocks plus a quarter spare.
    max_tokens_per_step: T of every step (default half the tokens, at least 8).
    cache_dtype: KV dtype (default the model's); ``rtol`` default: the looser of the
      pool's and the dense logits' dtype's bound, 2e-5 for float32 (and float64), 1e-2
      for float16, 2e-2 for bfloat16, 4e-2 for int8, 6e-2 for float8_e4m3fn and 1.5e-1 for
      float8_e5m2 (their quantisation). A quantised pool's error grows with how sharp the
      model's attention is (an int8 pool: 1.0-1.3e-2 for ``examples/own_model.py``'s
      model, 2.7e-2 for a sharper one), and a 16-bit model's with its routing (a bf16
      mixture of experts can pick other experts: 8e-2 for a correct gpt-oss): pass
      ``rtol`` for yours. 16-bit runs cannot see small errors (a RoPE base 10 % off
      passes at 16 bits, fails by 200x in float32): check a model in float32 too.
    seed: the chunk schedule's and the block shuffle's seed.
    forward_kwargs: extra keyword arguments of ``paged_forward``.
    free_outside_window: with layer windows of more than one kind (``config.layer_windows``
      or a built-in config's), the layers are put in KV groups (``paged_jax.kv_groups``) as
      ``LLM`` does under a KV budget, unless this is False (one pool of every layer): the
      layout where each layer must take its cache layer, slots and tables from
      ``metadata.for_layer``.

  Returns:
    ``dict(steps=..., max_rel_error=..., rtol=..., kv_groups=...)``: the bound used, and
    ``kv_groups`` the groups' windows, None for one pool of every layer.
  """
  protocol.check_model(model)
  protocol.check_config(config)
  sequences = [[int(t) for t in s] for s in sequences]
  if not sequences or any(len(s) == 0 for s in sequences):
    raise ValueError(f"sequences={sequences!r} must be non-empty token-id lists")
  lengths = [len(s) for s in sequences]
  num_seqs, longest = len(sequences), max(lengths)
  kwargs = dict(forward_kwargs or {})
  dtype = jnp.dtype(cache_dtype or protocol.model_dtype(model))
  groups = None
  if free_outside_window is not False:  # the built-in configs' windows too, as LLM reads them
    groups = kv_groups_lib.KVGroups.from_layer_windows(kv_groups_lib.layer_windows_of(config))
    groups = None if groups.plain else groups
  num_groups = 1 if groups is None else groups.num_groups
  per_seq = math.ceil(longest / block_size)
  if num_blocks is None:
    num_blocks = (sum(math.ceil(n / block_size) for n in lengths) * 5 // 4 + 1) * num_groups
  num_tokens = max_tokens_per_step or max(8, sum(lengths) // 2)
  spec = protocol.kv_cache_spec(config, block_size=block_size, num_blocks=num_blocks,
                                dtype=dtype)
  if groups is not None:  # the cache holds each group's layers
    spec = dataclasses.replace(spec, num_layers=groups.layers_per_group)
  alloc = shuffled_allocator(num_blocks, block_size, num_seqs, per_seq, seed=seed,
                             windows=None if groups is None else groups.windows)
  cache = nan_cache(spec)
  graphdef, params = nnx.split(model)
  static = protocol.static_graphdef(graphdef)  # one object: every step finds its compilation
  kwargs_key = tuple(sorted(kwargs.items()))
  compiled_before = _paged_step._cache_size()
  if dense is None:
    dense_jit = jax.jit(lambda params, tokens_BT: nnx.merge(graphdef, params)(tokens_BT))
    dense = lambda tokens_BT: dense_jit(params, tokens_BT)
  padded_BT = np.zeros((num_seqs, longest), np.int32)
  for b, s in enumerate(sequences):
    padded_BT[b, :len(s)] = s
  want_BTV = dense(jnp.asarray(padded_BT))
  if rtol is None:  # the looser of the pool's and the logits' (a model computing in bf16
    # from float32 parameters: the parameters say float32, its logits say otherwise)
    rtol = max(_DEFAULT_RTOL.get(jnp.dtype(d), 2e-2)
               for d in (dtype, getattr(want_BTV, "dtype", np.float64)))
  want_BTV = np.asarray(want_BTV, np.float64)

  rng = np.random.default_rng(seed)
  done = [0] * num_seqs
  worst = 0.0
  schedule = _schedule(lengths, num_tokens, rng)
  for i, chunk in enumerate(schedule):
    flat = [t for s, c in enumerate(chunk) for t in sequences[s][done[s]:done[s] + c]]
    tokens_T = jnp.asarray(flat + [0] * (num_tokens - len(flat)), jnp.int32)
    logits_TV, logits_SV, alloc, cache, inputs = _paged_step(
        params, alloc, cache, tokens_T, jnp.asarray(chunk, jnp.int32), graphdef=static,
        kwargs=kwargs_key, kv_groups=groups)
    ok_S = np.asarray(inputs.ok_S)
    if not ok_S.all():
      raise AssertionError(f"step {i}: allocation failed for sequences "
                           f"{np.flatnonzero(~ok_S).tolist()} (num_blocks={num_blocks})")
    assert_allocator_invariants(alloc)
    logits_TV, logits_SV = np.asarray(logits_TV), np.asarray(logits_SV)
    row = 0
    for s, c in enumerate(chunk):
      if c == 0:
        continue
      got, want = logits_TV[row:row + c], want_BTV[s, done[s]:done[s] + c]
      err = _relative_error(got, want)
      if not err <= rtol:
        raise AssertionError(
            f"step {i}: sequence {s} positions {done[s]}..{done[s] + c - 1}: paged logits "
            f"differ from dense by {err:.3g} relative (rtol {rtol}); chunks {chunk}")
      worst = max(worst, err)
      err = _relative_error(logits_SV[s], logits_TV[row + c - 1])
      if not err <= rtol:
        raise AssertionError(f"step {i}: sequence {s}: the logits_indices row differs from "
                             f"its last token's logits by {err:.3g} relative")
      row += c
      done[s] += c
  compiled = _paged_step._cache_size() - compiled_before
  if compiled > 1:
    raise AssertionError(f"the paged step was compiled {compiled} times over "
                         f"{len(schedule)} steps of one shape; it must trace once")
  return dict(steps=len(schedule), max_rel_error=worst, rtol=rtol,
              kv_groups=None if groups is None else groups.windows)
