"""Every jitted device call of one engine, and their compilation (all of it, in one place).

An engine makes three kinds of device calls:

- ``step T=<bucket>``: the scheduling loop (``loop.device_call``) at one token bucket,
  one compiled executable per bucket, ``call(params, state, slots_wanted, step_limit) ->
  (state, report)``, the state donated; and ``step T=<bucket> scoring``, its variant that
  computes every row's logits (prompt log-probs), compiled only once a request asks for
  them (``precompile`` leaves it out unless told);
- ``admit``: write host rows into the state (new requests, cleared slots), a fixed chunk
  of slots at a time (``admit_chunks``);
- ``abort``: release the sequences of an abandoned stream.

Each is compiled on first use, or ahead of serving by ``precompile`` (``LLM.precompile``),
which lowers and compiles every one of them with the engine's real arguments, timing each:
JAX caches the lowering and the executable, so the first real call then compiles nothing.
``compile_seconds`` holds the seconds each precompiled call took.

Without a mesh and ``max_traces``, the step is one module-level ``jax.jit`` shared by every
engine: two engines over the same model structure and sizes compile it once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from typing import Any, Callable

import chex
import jax
import numpy as np

from paged_jax.engine import state as state_lib
from paged_jax.engine.loop import device_call

__all__ = ["DeviceCalls"]

_device_call_jit = jax.jit(device_call,
                           static_argnames=("graphdef", "steps_per_call", "num_tokens",
                                            "scrub_on_release", "prefix_caching", "hash_fn",
                                            "downshift_at", "upshift", "kv_groups",
                                            "vocab_size", "scoring"),
                           donate_argnames=("st",))
_admit_jit = jax.jit(state_lib.admit, donate_argnums=(0,))
_abort_jit = jax.jit(state_lib.abort, static_argnames=("scrub_on_release",),
                     donate_argnums=(0,))


class _Bound:
  """A jitted function with some keyword arguments bound: call it or ``lower`` it.
  ``names``: the keywords its positional arguments go to."""

  def __init__(self, jitted, names: tuple[str, ...] | None = None, **bound):
    self.jitted, self.names, self.bound = jitted, names, bound

  def _kwargs(self, args) -> tuple[tuple, dict]:
    if self.names is None:
      return args, self.bound
    return (), dict(zip(self.names, args), **self.bound)

  def __call__(self, *args):
    args, kwargs = self._kwargs(args)
    return self.jitted(*args, **kwargs)

  def lower(self, *args):
    args, kwargs = self._kwargs(args)
    return self.jitted.lower(*args, **kwargs)


@dataclasses.dataclass
class DeviceCalls:
  """The device calls of one engine (module docstring).

  Attributes:
    static: the step's static arguments but ``num_tokens`` and the bucket shifts
      (``graphdef``, ``steps_per_call``, ``scrub_on_release``, ``prefix_caching``,
      ``hash_fn``).
    token_buckets: the step budgets, increasing.
    plan: the ``ShardingPlan`` (None: one device).
    param_specs: with a plan, the ``PartitionSpec`` pytree of the parameters.
    max_traces: wrap each step in ``chex.assert_max_traces(n=max_traces)`` (tests).
  """

  static: dict
  token_buckets: tuple[int, ...]
  plan: Any = None
  param_specs: Any = None
  max_traces: int | None = None
  steps: dict = dataclasses.field(default_factory=dict)
  scoring_steps: dict = dataclasses.field(default_factory=dict)
  compile_seconds: dict = dataclasses.field(default_factory=dict)
  # Seconds compiled on first use while serving (``ensure_compiled``), since the counters
  # were reset: serving's wall time less these is what the throughput stats divide by.
  serve_compile_s: float = 0.0

  def __post_init__(self):
    self.admit = _admit_jit
    self.abort = _Bound(_abort_jit, scrub_on_release=self.static["scrub_on_release"])
    if self.plan is not None:  # admit / abort per data shard
      self.admit = self.plan.per_shard(state_lib.admit)
      self.abort = self.plan.per_shard(functools.partial(
          state_lib.abort, scrub_on_release=self.static["scrub_on_release"]))

  def admit_chunks(self, st, entries: list):
    """``entries`` (``(slot, values)`` pairs, global slot ids) as ``admit``'s host
    arguments, chunk by chunk (``state.row_chunks``), for the engine's state ``st``."""
    return state_lib.row_chunks(
        entries, max_model_len=st.tokens_SJ.shape[-1],
        shards=1 if self.plan is None else self.plan.data_size,
        slots_per_shard=st.status_S.shape[-1])  # a mesh's state: [d, S/d]

  def step(self, bucket: int, scoring: bool = False) -> Callable:
    """The jitted step loop whose budget is ``bucket`` (one of ``token_buckets``), built on
    first use: ``call(params, state, slots_wanted, step_limit) -> (state, report)``, the
    state donated; ``scoring``: its prompt log-probs variant (``device_call``).
    With a mesh it runs under the plan's ``shard_map``; with ``max_traces`` it is wrapped in
    ``chex.assert_max_traces`` (per bucket)."""
    steps = self.scoring_steps if scoring else self.steps
    if bucket not in steps:
      i = self.token_buckets.index(bucket)
      static = dict(self.static, num_tokens=bucket,
                    downshift_at=self.token_buckets[i - 1] if i else 0,
                    upshift=i + 1 < len(self.token_buckets), scoring=scoring)
      if self.plan is None and self.max_traces is None:
        call = _Bound(_device_call_jit, ("params", "st", "slots_wanted", "step_limit"),
                      **static)
      else:
        def call(params, st, slots_wanted, step_limit):
          return device_call(params=params, st=st, slots_wanted=slots_wanted,
                             step_limit=step_limit, **static)
        if self.plan is not None:  # one shard_map over the mesh; state with a data axis
          call = self.plan.device_call(call, param_specs=self.param_specs)
        if self.max_traces is not None:
          # chex counts the traces of a footprint: the function's name and source and the
          # stack's function names where it is wrapped, alike for every bucket and every
          # engine built at one line. A name of its own makes the count per engine and bucket.
          call.__name__ = f"step_T{bucket}{'_scoring' * scoring}_{uuid.uuid4().hex[:8]}"
          call = chex.assert_max_traces(call, n=self.max_traces)
        call = jax.jit(call, donate_argnums=(1,))
      steps[bucket] = call
    return steps[bucket]

  def precompile(self, params, st, progress: Callable[[int, int, str], Any] | None = None,
                 *, scoring: bool = False) -> dict[str, float]:
    """Compile every device call the engine will make, before serving: the step loop at
    each token bucket, then ``admit`` and ``abort``; ``scoring``: the prompt log-probs
    variants too. ``progress(i, n, what)`` is called
    before each (i from 0). Nothing runs and ``st`` is not consumed. Returns (and adds to
    ``compile_seconds``) the seconds each took, keyed by ``what`` ("step T=32", ...)."""
    jobs = [(what, lower) for what, lower in self._lowerings(params, st).items()
            if scoring or not what.endswith(" scoring")]
    done = {}
    for i, (what, lower) in enumerate(jobs):
      if progress is not None:
        progress(i, len(jobs), what)
      t0 = time.perf_counter()
      lower().compile()
      done[what] = time.perf_counter() - t0
    self.compile_seconds.update(done)
    return done

  def ensure_compiled(self, what: str, params, st) -> None:
    """Compile the call ``what`` ("step T=32", "step T=32 scoring", "admit", "abort") now
    if neither
    ``precompile`` nor an earlier use did, timing it apart (``compile_seconds``,
    ``serve_compile_s``), so a first ``generate`` that compiles reports its serving speed,
    not its compilations'."""
    if what in self.compile_seconds:
      return
    lower = self._lowerings(params, st)[what]
    t0 = time.perf_counter()
    lower().compile()
    seconds = time.perf_counter() - t0
    self.compile_seconds[what] = seconds
    self.serve_compile_s += seconds

  def _lowerings(self, params, st) -> dict[str, Callable]:
    """Every device call by name ("step T=32", ..., "admit", "abort"), each a function
    lowering it as the engine calls it (nothing runs, ``st`` is not consumed)."""
    num_seqs = st.status_S.shape[-1]
    mask = np.zeros(num_seqs if self.plan is None else num_seqs * self.plan.data_size, bool)
    chunk = next(self.admit_chunks(st, [(0, {})]))  # admit's shapes
    jobs = {f"step T={b}": functools.partial(self._lower_step, b, params, st)
            for b in self.token_buckets}
    jobs.update({f"step T={b} scoring": functools.partial(self._lower_step, b, params, st,
                                                          scoring=True)
                 for b in self.token_buckets})
    jobs["admit"] = lambda: self._lower(self.admit, st, *chunk)
    jobs["abort"] = lambda: self._lower(self.abort, st, mask)
    return jobs

  def _lower_step(self, bucket, params, st, scoring=False):
    return self.step(bucket, scoring).lower(params, st,
                                            *jax.device_put((np.int32(0), np.int32(1))))

  def _lower(self, call, st, *rows):
    """Lower ``admit`` / ``abort`` as the engine calls them (host rows as device arrays)."""
    if self.plan is not None:
      return call.lower(st, *rows)
    return call.lower(st, *jax.device_put(rows))
