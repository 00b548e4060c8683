"""Cost of one jitted allocator ``append`` beside a decode step and a host free-list allocator.

For each batch S (sequences = the allocator's ``max_seqs``), one run times three things side
by side, interleaved in rounds so that load from other jobs hits all three alike:

- append: ``jax.jit(allocator.append)`` growing every sequence by 1 token (decode-like; the
  sequences whose length is a multiple of Z take a new block), its output state fed back.
- decode: ``models.Steps(model).decode`` of a tiny Llama (2 layers, E=64, H=4, K=2, D=16,
  impl "xla") at the same batch and allocator shape: allocator append + slots, K/V write,
  paged attention over each sequence's context, logits. The cache starts zero-filled (the
  attention work is the same as with real K/V).
- host: ``HostFreeList``, a numpy allocator with a stack of free block ids doing the same
  growth (all-or-nothing in slot order, as ``append``), then the host -> device copy of the
  block table and lengths the decode step would need (``jax.device_put`` +
  ``block_until_ready``).

Each column is the median of ``--repeats`` calls after ``--warmup`` calls of each (the first
one compiles), taken in ``--rounds`` rounds; in a round each op runs repeats / rounds + 1
times in a row and the first of those is dropped (on a shared CPU the previous op's XLA
worker threads may still be spinning: a host call right after a decode step measured ~2x
slower). All three start from the same lengths (uniform in [1, P * Z / 2]) and grow
identically, so about 1 / Z of the sequences cross a block boundary each step.

    python benchmarks/allocator.py            # S = 256, 1024; writes allocator_RESULTS_section.md
    python benchmarks/allocator.py --quick    # S = 16, 64, few repeats, seconds; never writes
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import models
from paged_jax import KVCache, allocator

RESULTS_PATH = pathlib.Path(__file__).with_name("allocator_RESULTS_section.md")
BLOCK_SIZE = 16  # Z
BLOCKS_PER_SEQ = 32  # P: 512 positions per sequence
FULL_BATCHES = (256, 1024)
QUICK_BATCHES = (16, 64)
MODEL_CONFIG = models.ModelConfig(model_type="llama", vocab_size=256, embed_dim=64, mlp_dim=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


class HostFreeList:
  """A host-side block allocator: numpy block table and lengths, a stack of free block ids.

  ``append`` has the functional allocator's semantics (all-or-nothing per sequence, granted in
  slot order while the running demand fits), vectorised with numpy: the blocks of every
  sequence that needs one are popped off the stack at once.
  """

  def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
    self.block_size = block_size
    self.free_N = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)  # top = end: lowest id
    self.num_free = num_blocks
    self.block_tables_SP = np.full((max_seqs, max_blocks_per_seq), allocator.NO_BLOCK,
                                   np.int32)
    self.seq_lens_S = np.zeros(max_seqs, np.int32)

  def append(self, num_new_S: np.ndarray) -> np.ndarray:
    """Grow sequence s by ``num_new_S[s]`` tokens; returns ok bool[S]."""
    z, p = self.block_size, self.block_tables_SP.shape[1]
    len_S = self.seq_lens_S
    valid_S = (num_new_S >= 0) & (num_new_S <= p * z - len_S)
    new_len_S = np.where(valid_S, len_S + num_new_S, len_S)
    have_S = -(-len_S // z)
    need_S = np.where(valid_S, -(-new_len_S // z) - have_S, 0)
    ok_S = valid_S & ((need_S == 0) | (np.cumsum(need_S) <= self.num_free))
    grant_S = np.where(ok_S, need_S, 0)
    rows = np.flatnonzero(grant_S)
    if rows.size:
      count_R = grant_S[rows]
      total = int(count_R.sum())
      popped = self.free_N[self.num_free - total:self.num_free][::-1]
      self.num_free -= total
      first_R = np.cumsum(count_R) - count_R
      seq_X = np.repeat(rows, count_R)
      col_X = np.repeat(have_S[rows] - first_R, count_R) + np.arange(total)
      self.block_tables_SP[seq_X, col_X] = popped
    self.seq_lens_S = np.where(ok_S, new_len_S, len_S).astype(np.int32)
    return ok_S

  def to_device(self) -> tuple[jax.Array, jax.Array]:
    """The block table and lengths on the device, transfer finished."""
    return jax.block_until_ready(jax.device_put((self.block_tables_SP, self.seq_lens_S)))


def bench(num_seqs: int, *, repeats: int, warmup: int, rounds: int, seed: int = 0) -> dict:
  """One row: median microseconds of append, decode step and host free list + copy at S.

  After ``warmup`` calls of each, ``rounds`` rounds each run every one of the three
  ``repeats // rounds + 1`` times in a row; the first call of each run is dropped (on a
  shared CPU, the XLA worker threads of the call before may still be spinning).
  """
  z, p = BLOCK_SIZE, BLOCKS_PER_SEQ
  num_blocks = num_seqs * p  # never runs out: every sequence can reach P blocks
  run = max(repeats // rounds, 1) + 1
  calls = warmup + rounds * run
  if calls > p * z // 2:
    raise ValueError(f"warmup + rounds * (repeats // rounds + 1)={calls} must be <= "
                     f"P * Z / 2={p * z // 2} (the sequences grow by one token per call)")
  rng = np.random.default_rng(seed)
  lens0_S = rng.integers(1, p * z // 2 + 1, num_seqs).astype(np.int32)

  append = jax.jit(allocator.append)
  empty = allocator.init(num_blocks, z, num_seqs, p)
  state_a, ok = append(empty, jnp.asarray(lens0_S))  # the append benchmark's state
  state_d, ok_d = append(empty, jnp.asarray(lens0_S))  # the decode step's (donated)
  host = HostFreeList(num_blocks, z, num_seqs, p)
  if not (bool(ok.all()) and bool(ok_d.all()) and host.append(lens0_S).all()):
    raise RuntimeError(f"the starting lengths do not fit N={num_blocks}")

  model = models.init_random(MODEL_CONFIG, seed=seed, impl="xla")
  steps = models.Steps(model)
  cache = KVCache.create(model.kv_cache_spec(block_size=z, num_blocks=num_blocks))
  tokens_S = jnp.asarray(rng.integers(0, MODEL_CONFIG.vocab_size, num_seqs), jnp.int32)
  active_S = jnp.ones(num_seqs, jnp.bool_)
  ones_S = jnp.ones(num_seqs, jnp.int32)
  host_ones_S = np.ones(num_seqs, np.int32)
  live = dict(state_a=state_a, state_d=state_d, cache=cache)
  oks = []
  crossings = [0]

  def call_append():
    live["state_a"], ok_S = append(live["state_a"], ones_S)
    jax.block_until_ready((live["state_a"], ok_S))
    return ok_S

  def call_decode():
    logits_SV, live["state_d"], live["cache"], ok_S = steps.decode(
        live["state_d"], live["cache"], tokens_S, active_S)
    jax.block_until_ready((logits_SV, live["state_d"], live["cache"], ok_S))
    return ok_S

  def call_host():
    crossings[0] += int(np.sum(host.seq_lens_S % z == 0))  # outside the timed part
    start = time.perf_counter()
    ok_S = host.append(host_ones_S)
    host.to_device()
    return ok_S, time.perf_counter() - start

  def timed(fn):
    start = time.perf_counter()
    ok_S = fn()
    return ok_S, time.perf_counter() - start

  ops = {"append": lambda: timed(call_append), "decode": lambda: timed(call_decode),
         "host": call_host}
  samples = {name: [] for name in ops}
  for _ in range(warmup):
    for op in ops.values():
      oks.append(op()[0])
  for _ in range(rounds):
    for name, op in ops.items():
      for i in range(run):
        ok_S, seconds = op()
        oks.append(ok_S)
        if i:
          samples[name].append(seconds)
  all_ok = all(bool(np.all(ok_S)) for ok_S in oks)
  state_a, state_d = live["state_a"], live["state_d"]

  # The three did the same work: every sequence grew by every step, nothing was refused.
  if not all_ok:
    raise RuntimeError(f"an allocation was refused at S={num_seqs}")
  allocator.validate(state_a)
  np.testing.assert_array_equal(np.asarray(state_a.seq_lens), host.seq_lens_S)
  np.testing.assert_array_equal(np.asarray(state_d.seq_lens), host.seq_lens_S)
  us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
  return dict(batch=num_seqs, append_us=us["append"], decode_us=us["decode"],
              append_over_decode=us["append"] / us["decode"], host_us=us["host"],
              append_over_host=us["append"] / us["host"], num_blocks=num_blocks,
              crossings_per_step=crossings[0] / calls, repeats=len(samples["append"]))


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  device = backend if kind == backend else f"{backend} ({kind})"
  return (f"{cpu}, {os.cpu_count()} cores visible, shared with other jobs (load average "
          f"{load} at the end); jax {jax.__version__}, backend {device}")


def table(rows: list[dict]) -> str:
  lines = ["| batch S | append us | decode step us | append / decode | host free-list + copy us "
           "| append / host |", "|---:|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['batch']} | {r['append_us']:.1f} | {r['decode_us']:.1f} | "
            f"{r['append_over_decode']:.3f} | {r['host_us']:.1f} | {r['append_over_host']:.2f} |"
            for r in rows]
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help=f"S = {QUICK_BATCHES}, few repeats; never writes the results file")
  parser.add_argument("--batches", type=int, nargs="+", default=None)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--warmup", type=int, default=None)
  parser.add_argument("--rounds", type=int, default=None,
                      help="runs of each op, interleaved (default 5; 2 with --quick)")
  parser.add_argument("--no-write", action="store_true",
                      help=f"print only; do not write {RESULTS_PATH.name}")
  args = parser.parse_args(argv)
  batches = args.batches or (QUICK_BATCHES if args.quick else FULL_BATCHES)
  repeats = args.repeats or (10 if args.quick else 200)
  warmup = args.warmup or (2 if args.quick else 5)
  rounds = args.rounds or (2 if args.quick else 5)
  rows = [bench(s, repeats=repeats, warmup=warmup, rounds=rounds) for s in batches]
  command = " ".join(["python benchmarks/allocator.py", *(argv if argv is not None else
                                                          sys.argv[1:])]).strip()
  c = MODEL_CONFIG
  crossing = ", ".join(f"{r['crossings_per_step']:.0f} of {r['batch']}" for r in rows)
  text = "\n".join([
      f"Command: `{command}`", "",
      f"Machine: {machine()}.", "",
      f"Z={BLOCK_SIZE}, P={BLOCKS_PER_SEQ}, N=S*P blocks; starting lengths uniform in "
      f"[1, {BLOCKS_PER_SEQ * BLOCK_SIZE // 2}], every sequence grows by 1 token per call "
      f"(sequences crossing a block boundary per step, mean: {crossing}). Decode step: tiny "
      f"Llama L={c.num_layers} E={c.embed_dim} I={c.mlp_dim} H={c.num_heads} "
      f"K={c.num_kv_heads} D={c.head_dim} V={c.vocab_size}, float32, impl \"xla\". "
      f"Microseconds per call, median of {rows[0]['repeats']} calls of each after {warmup} "
      f"warm-up calls, taken in {rounds} interleaved rounds (the first call of each run of an "
      "op dropped).", "",
      table(rows), ""])
  print(text)
  if not (args.quick or args.no_write):
    section = "\n".join([
        "## Functional allocator: `append` vs a decode step and a host free list "
        "(`benchmarks/allocator.py`)", "",
        "`append` is `jax.jit(allocator.append)` (its output state fed back); decode is "
        "`models.Steps.decode` at the same batch and allocator shape (it contains the same "
        "append); host is a numpy free-list allocator (`HostFreeList`: a stack of free ids, "
        "the needy sequences' blocks popped at once, all-or-nothing in slot order) plus "
        "`jax.device_put` of its block table and lengths + `block_until_ready`. On the CPU "
        "backend that copy is a host memcpy, so the host column is a lower bound on what a "
        "host allocator pays per step beside an accelerator (a host -> device transfer and a "
        "sync there).", "",
        text])
    RESULTS_PATH.write_text(section)
    print(f"wrote {RESULTS_PATH}")
  return rows


if __name__ == "__main__":
  main()
