"""KV memory at equal budget: paged blocks vs contiguous reservations, on a long-tailed load.

Workload (``LONG_TAIL`` below; quick mode is smaller): ``num_requests`` requests, all queued
at t = 0 so that memory, never arrivals, bounds the batch. Prompt and output lengths are
independent log-normals, ``round(median * exp(sigma * N(0, 1)))`` clipped to ``[1, max]``
(``paged_jax.workload``'s distribution, numpy seed 0): prompts median 256, sigma 1.0, at most
1024; outputs median 128, sigma 1.0, at most 1024. The declared maximum length of a request
is ``max_prompt_len + max_output_len`` = 2048 (what a server must assume when it does not
know the output length). KV budget: N = 2048 blocks of Z = 16 tokens (32768 token slots).

Time advances in decode steps. A request is admitted (FCFS, its prompt prefilled at once)
when it fits; then each running request grows by one token per step until it reaches its
final length ``prompt + output`` and finishes, freeing its memory. Three policies, same
queue, same steps:

- paged: the functional allocator (``paged_jax.allocator``), one jitted
  ``release`` + ``append`` per step over S = ``max_seqs`` slots; a request is admitted while
  its prompt's blocks leave one free block per running sequence (a watermark). A sequence
  whose growth is refused stalls a step; if every one does, the latest-admitted is preempted
  (released and requeued, recompute).
- contiguous (max): each running request reserves the declared maximum length.
- contiguous (oracle): each reserves exactly its true final length (no server knows it).

Reported: KV utilisation = live tokens / reserved slots (blocks in use * Z for paged),
averaged over steps; budget holding tokens = live tokens / all budget slots, averaged (the
vLLM paper's 20.4%-38.2% figure); peak and mean concurrent sequences; steps to drain the
queue. matplotlib (if importable) plots blocks in use and utilisation over time into
``memory_blocks.png`` beside RESULTS.md.

A second mode compares pool dtypes at one byte budget: the paged policy on the same
queue with the blocks a bfloat16, an int8 and a float8_e4m3fn pool get from
``KVCacheSpec.from_budget`` (scales counted: 4 bytes per token, KV head and K or V) for a
Llama-3-8B-shaped cache (L = 32, K = 8, D = 128, Z = 16) and the budget of the bfloat16
pool of ``num_blocks`` blocks (4 GiB for LONG_TAIL); ``max_seqs`` is raised so that only
memory bounds the batch. Reported: blocks, peak concurrent sequences, mean concurrent while
requests are still queued (the memory-bound phase), steps to drain.

    python benchmarks/memory.py            # full; writes memory_RESULTS_section.md (+ PNG)
    python benchmarks/memory.py --quick    # seconds; never writes
    python benchmarks/memory.py --pool-dtypes [--quick]   # equal budget, three pool dtypes
    python benchmarks/memory.py --windowed [--quick]      # sliding windows: KV groups

A third mode, ``--windowed``, measures windowed freeing (``paged_jax.kv_groups``) on a
hybrid model: a Gemma-3-12B-like attention shape (48 layers, 5 sliding with window 1,024
to 1 full, K = 8, D = 256, bfloat16; KV groups of M = 8 layers: 5 sliding groups and 1
full one) at a byte budget of 24 GiB, Z = 16, on a long-context queue (contexts
log-normal, median 8,192, sigma 0.2, clipped to [4,096, 12,288], seed 0). The real
allocator (``paged_jax.allocator``) prefills the requests one after another in chunks of
512 tokens (``append``, which first gives back what no later query of a sliding group can
read) until one does not fit; reported: the sequences held at once, whole contexts, with
the groups' windows and with one full group of all 48 layers (every layer keeps every
block), at the same budget; beside it, the planner's arithmetic (``plan_windowed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import KVCacheSpec, allocator

HERE = pathlib.Path(__file__).parent
RESULTS_PATH = HERE / "memory_RESULTS_section.md"
PLOT_PATH = HERE / "memory_blocks.png"


@dataclasses.dataclass(frozen=True)
class MemoryWorkload:
  num_requests: int
  prompt_median: int
  prompt_sigma: float
  max_prompt_len: int
  output_median: int
  output_sigma: float
  max_output_len: int
  block_size: int  # Z
  num_blocks: int  # N, the KV budget in blocks
  max_seqs: int  # S, allocator slots (above what the budget can hold)
  seed: int = 0

  @property
  def max_len(self) -> int:
    return self.max_prompt_len + self.max_output_len


LONG_TAIL = MemoryWorkload(num_requests=400, prompt_median=256, prompt_sigma=1.0,
                           max_prompt_len=1024, output_median=128, output_sigma=1.0,
                           max_output_len=1024, block_size=16, num_blocks=2048, max_seqs=160)
QUICK = MemoryWorkload(num_requests=48, prompt_median=64, prompt_sigma=1.0, max_prompt_len=256,
                       output_median=32, output_sigma=1.0, max_output_len=256, block_size=16,
                       num_blocks=256, max_seqs=48)
# --pool-dtypes --quick: QUICK's 256 bfloat16 blocks would hold all 48 requests in the
# one-byte pools (their gain capped at the queue), so that comparison gets a smaller budget.
QUICK_POOL_DTYPES = dataclasses.replace(QUICK, num_blocks=96)


def lengths(w: MemoryWorkload) -> tuple[np.ndarray, np.ndarray]:
  """Prompt and output lengths (``paged_jax.workload``'s log-normal draw)."""
  rng = np.random.default_rng(w.seed)

  def draw(median, sigma, max_len):
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(w.num_requests))),
                   1, max_len).astype(np.int64)

  return (draw(w.prompt_median, w.prompt_sigma, w.max_prompt_len),
          draw(w.output_median, w.output_sigma, w.max_output_len))


@functools.partial(jax.jit, donate_argnums=(0,))
def _paged_step(state, release_S, num_new_S):
  state = allocator.release(state, release_S)
  state, ok_S = allocator.append(state, num_new_S)
  return state, ok_S, state.num_free, jnp.sum(state.seq_lens)


def simulate_paged(w: MemoryWorkload, prompt_R, output_R) -> dict:
  """The allocator serving the queue; per-step blocks in use, live tokens, running count."""
  z, n, s = w.block_size, w.num_blocks, w.max_seqs
  p = -(-w.max_len // z)
  state = allocator.init(n, z, s, p)
  final_R = prompt_R + output_R
  queue = list(range(w.num_requests))
  owner_S = np.full(s, -1)  # request in each slot
  len_S = np.zeros(s, np.int64)  # tokens held (host mirror of seq_lens)
  admitted_at_S = np.zeros(s, np.int64)
  num_free = n
  release_S = np.zeros(s, bool)
  blocks_t, live_t, running_t, queued_t = [], [], [], []
  preemptions = step = 0
  while queue or (owner_S >= 0).any():
    num_new_S = np.where(owner_S >= 0, 1, 0)
    # Admission: FCFS while the prompt's blocks leave one block per running sequence.
    free_after = num_free + int(sum(-(-len_S[i] // z) for i in np.flatnonzero(release_S)))
    running = int((owner_S >= 0).sum())
    while queue:
      r = queue[0]
      need = -(-int(prompt_R[r]) // z)
      slots = np.flatnonzero((owner_S < 0) & ~release_S)
      if not slots.size or free_after - need < running + 1:
        break
      queue.pop(0)
      slot = slots[0]
      owner_S[slot], num_new_S[slot], admitted_at_S[slot] = r, prompt_R[r], step
      free_after -= need
      running += 1
    state, ok_S, nf, live = _paged_step(state, jnp.asarray(release_S),
                                        jnp.asarray(num_new_S, jnp.int32))
    ok_S, num_free, live = np.asarray(ok_S), int(nf), int(live)
    release_S = np.zeros(s, bool)
    grew_S = ok_S & (num_new_S > 0)
    len_S = np.where(grew_S, len_S + num_new_S, len_S)
    failed_S = (num_new_S > 0) & ~ok_S
    new_admit_failed_S = failed_S & (len_S == 0)
    for slot in np.flatnonzero(new_admit_failed_S):  # back to the queue front
      queue.insert(0, int(owner_S[slot]))
      owner_S[slot] = -1
    if failed_S.any() and not grew_S.any():  # nobody progressed: preempt the latest
      live_slots = np.flatnonzero(owner_S >= 0)
      victim = live_slots[np.argmax(admitted_at_S[live_slots])]
      queue.insert(0, int(owner_S[victim]))
      owner_S[victim] = -1
      release_S[victim] = True
      len_S[victim] = 0
      preemptions += 1
    done_S = (owner_S >= 0) & (len_S >= final_R[np.maximum(owner_S, 0)])
    release_S |= done_S
    owner_S = np.where(done_S, -1, owner_S)
    blocks_t.append(n - num_free)
    live_t.append(live)
    running_t.append(int(((owner_S >= 0) | done_S).sum()))
    queued_t.append(len(queue))
    len_S = np.where(done_S, 0, len_S)
    step += 1
  blocks_t, live_t = np.asarray(blocks_t), np.asarray(live_t)
  return dict(reserved_t=blocks_t * z, live_t=live_t, running_t=np.asarray(running_t),
              queued_t=np.asarray(queued_t), steps=step, preemptions=preemptions)


def simulate_contiguous(w: MemoryWorkload, prompt_R, output_R, *, oracle: bool) -> dict:
  """Each running request reserves max_len (or, oracle, its final length) slots."""
  budget = w.num_blocks * w.block_size
  final_R = prompt_R + output_R
  reserve_R = final_R if oracle else np.full(w.num_requests, w.max_len)
  queue = list(range(w.num_requests))
  running: dict[int, int] = {}  # request -> tokens held
  reserved = 0
  reserved_t, live_t, running_t = [], [], []
  while queue or running:
    while queue and len(running) < w.max_seqs and reserved + reserve_R[queue[0]] <= budget:
      r = queue.pop(0)
      running[r] = int(prompt_R[r]) - 1  # +1 below: the prompt lands with this step
      reserved += int(reserve_R[r])
    for r in running:
      running[r] += 1
    reserved_t.append(reserved)
    live_t.append(sum(running.values()))
    running_t.append(len(running))
    for r in [r for r, n in running.items() if n >= final_R[r]]:
      del running[r]
      reserved -= int(reserve_R[r])
  return dict(reserved_t=np.asarray(reserved_t), live_t=np.asarray(live_t),
              running_t=np.asarray(running_t), steps=len(reserved_t), preemptions=0)


def summarise(name: str, sim: dict, budget_slots: int) -> dict:
  res, live = sim["reserved_t"].astype(float), sim["live_t"].astype(float)
  busy = res > 0
  return dict(policy=name, kv_utilization=float(np.mean(live[busy] / res[busy])),
              budget_holding_tokens=float(np.mean(live / budget_slots)),
              peak_concurrent=int(sim["running_t"].max()),
              mean_concurrent=float(np.mean(sim["running_t"])), steps=int(sim["steps"]),
              preemptions=int(sim["preemptions"]))


def plot(sims: dict, w: MemoryWorkload, path: pathlib.Path) -> str:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not importable here: no plot written"
  fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  for name, sim in sims.items():
    ax0.plot(sim["reserved_t"] / w.block_size, label=name)
    res = np.maximum(sim["reserved_t"], 1)
    ax1.plot(sim["live_t"] / res, label=name)
  ax0.set_ylabel("blocks in use / reserved")
  ax1.set_ylabel("KV utilisation")
  ax1.set_xlabel("decode step")
  ax0.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return f"plot written to {path}"


# The cache shape the pool-dtype comparison prices blocks with (Llama-3-8B: 32 layers, 8 KV
# heads of 128).
MODEL_SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128)
POOL_DTYPES = (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)


def compare_pool_dtypes(w: MemoryWorkload) -> tuple[list[dict], str]:
  """The paged policy on ``w``'s queue with the blocks each pool dtype gets from the byte
  budget of ``w.num_blocks`` bfloat16 blocks; ``max_seqs`` raised to the request count."""
  prompt_R, output_R = lengths(w)
  base = KVCacheSpec(block_size=w.block_size, num_blocks=w.num_blocks, dtype=jnp.bfloat16,
                     **MODEL_SHAPE)
  budget = base.total_bytes
  rows = []
  for dtype in POOL_DTYPES:
    spec = KVCacheSpec.from_budget(budget, block_size=w.block_size, dtype=dtype, **MODEL_SHAPE)
    wd = dataclasses.replace(w, num_blocks=spec.num_blocks, max_seqs=w.num_requests)
    sim = simulate_paged(wd, prompt_R, output_R)
    queued = sim["queued_t"] > 0
    rows.append(dict(dtype=jnp.dtype(dtype).name, block_bytes=spec.block_bytes,
                     num_blocks=spec.num_blocks, total_bytes=spec.total_bytes,
                     peak_concurrent=int(sim["running_t"].max()),
                     mean_concurrent_queued=float(sim["running_t"][queued].mean()
                                                  if queued.any() else np.nan),
                     steps=int(sim["steps"]), preemptions=int(sim["preemptions"])))
  for row in rows:
    row["peak_vs_bf16"] = row["peak_concurrent"] / rows[0]["peak_concurrent"]
    row["mean_vs_bf16"] = row["mean_concurrent_queued"] / rows[0]["mean_concurrent_queued"]
  lines = ["| pool dtype | bytes per block (scales incl.) | blocks in budget | peak concurrent "
           "| vs bfloat16 | mean concurrent while queued | vs bfloat16 | steps to drain "
           "| preemptions |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['dtype']} | {r['block_bytes']:,} | {r['num_blocks']} | "
                 f"{r['peak_concurrent']} | {r['peak_vs_bf16']:.2f}x | "
                 f"{r['mean_concurrent_queued']:.1f} | {r['mean_vs_bf16']:.2f}x | {r['steps']} "
                 f"| {r['preemptions']} |")
  desc = (f"budget {budget / 2 ** 30:.2f} GiB = {w.num_blocks} bfloat16 blocks of Z="
          f"{w.block_size} for L={MODEL_SHAPE['num_layers']}, K={MODEL_SHAPE['num_kv_heads']}, "
          f"D={MODEL_SHAPE['head_dim']}; {w.num_requests} requests queued at t=0 (the "
          f"workload above), max_seqs={w.num_requests}")
  return rows, "\n".join(lines) + f"\n\n{desc}."


# The hybrid model of the windowed comparison: Gemma-3-12B's attention shape (5:1 pattern).
HYBRID = dict(num_layers=48, num_kv_heads=8, head_dim=256, window=1024, every=6)


def _hybrid_layer_windows(num_layers: int, window: int, every: int) -> tuple:
  """Gemma 3's default pattern: every ``every``-th layer full, the others slide."""
  return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))


def fill_until_full(windows, num_blocks: int, block_size: int, contexts, chunk: int) -> dict:
  """Prefill ``contexts`` one request after another (chunks of ``chunk`` tokens, slot r for
  request r) with the real allocator until one does not fit; returns the requests held at
  once, the blocks in use, and the appends made."""
  s = len(contexts)
  p = -(-int(max(contexts)) // block_size) + 1
  state = allocator.init(num_blocks, block_size, s, p, windows=windows)
  append = jax.jit(allocator.append)
  calls = 0
  for r, ctx in enumerate(contexts):
    done = 0
    while done < ctx:
      n = min(chunk, int(ctx) - done)
      state, ok = append(state, jnp.zeros(s, jnp.int32).at[r].set(n))
      calls += 1
      if not bool(ok[r]):
        state = allocator.release(state, jnp.arange(s) == r)
        allocator.validate(state)
        return dict(held=r, blocks_in_use=num_blocks - int(state.num_free), appends=calls)
      done += n
  allocator.validate(state)
  return dict(held=s, blocks_in_use=num_blocks - int(state.num_free), appends=calls)


def compare_windowed(quick: bool) -> tuple[list[dict], str]:
  """Sequences a 24 GiB budget holds with and without windowed freeing (module docstring)."""
  from paged_jax import planner
  from paged_jax.kv_groups import KVGroups
  h = HYBRID
  layer_windows = _hybrid_layer_windows(h["num_layers"], h["window"], h["every"])
  budget = (3 if quick else 24) * 2**30
  z, chunk, num_requests = 16, 512, 16 if quick else 64
  rng = np.random.default_rng(0)
  contexts = np.clip(np.round(8192 * np.exp(0.2 * rng.standard_normal(num_requests))),
                     4096, 12288).astype(int)
  shape = (h["num_kv_heads"], h["head_dim"], z, jnp.bfloat16)
  rows = []
  for name, free in (("every layer holds every block", False),
                     ("sliding groups hold their window", True)):
    groups = KVGroups.from_layer_windows(layer_windows, free_outside_window=free)
    spec = KVCacheSpec.from_budget(budget, groups.layers_per_group, *shape)
    start = time.perf_counter()
    sim = fill_until_full(groups.windows, spec.num_blocks, z, contexts, chunk)
    rows.append(dict(policy=name, groups=groups.num_groups, layers_per_group=
                     groups.layers_per_group, block_bytes=spec.block_bytes,
                     num_blocks=spec.num_blocks, seconds=time.perf_counter() - start, **sim))
  model = planner.ModelShape(
      num_layers=h["num_layers"], num_kv_heads=h["num_kv_heads"], head_dim=h["head_dim"],
      layer_types=tuple("full_attention" if w is None else "sliding_attention"
                        for w in layer_windows), sliding_window=h["window"])
  dist = planner.LengthDistribution(median_len=8192, sigma=0.2, max_len=12288)
  plan = planner.plan_windowed(model, budget, z, dist)
  base = rows[0]["held"]  # 0 in a tiny quick run: no ratio to print then
  lines = ["| KV layout | groups x layers | block bytes | blocks in budget | sequences held "
           "(allocator) | vs without | planner's count | appends | s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r, p in zip(rows, (plan.without, plan.with_)):
    ratio = f"{r['held'] / base:.2f}x" if base else "n/a"
    lines.append(f"| {r['policy']} | {r['groups']} x {r['layers_per_group']} | "
                 f"{r['block_bytes']:,} | {r['num_blocks']:,} | {r['held']} | "
                 f"{ratio} | {p.num_seqs} | {r['appends']} | "
                 f"{r['seconds']:.1f} |")
  desc = (f"Gemma-3-12B-like attention (L={h['num_layers']}, every {h['every']}th layer full, "
          f"the others window {h['window']}; K={h['num_kv_heads']}, D={h['head_dim']}, "
          f"bfloat16), budget {budget / 2**30:.0f} GiB, Z={z}; {num_requests} requests, "
          f"contexts median {int(np.median(contexts))} (min {contexts.min()}, max "
          f"{contexts.max()}), prefilled in chunks of {chunk} in arrival order until one does "
          f"not fit; planner: the same model and budget, lengths log-normal median 8192 sigma "
          f"0.2 clipped to 12288, seed 0, each sequence counted at its final length with one "
          f"decode step's block")
  return rows, "\n".join(lines) + f"\n\n{desc}."


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small workload, seconds; no files")
  parser.add_argument("--pool-dtypes", action="store_true",
                      help="compare bfloat16 / int8 / float8 pools at one byte budget instead")
  parser.add_argument("--windowed", action="store_true",
                      help="a hybrid sliding-window model with and without windowed freeing")
  args = parser.parse_args(argv)
  w = QUICK if args.quick else LONG_TAIL
  if args.windowed:
    start = time.perf_counter()
    rows, table = compare_windowed(args.quick)
    print(table)
    print(f"\n{time.perf_counter() - start:.1f} s")
    return rows
  if args.pool_dtypes:
    start = time.perf_counter()
    rows, table = compare_pool_dtypes(QUICK_POOL_DTYPES if args.quick else w)
    print(table)
    print(f"\n{time.perf_counter() - start:.1f} s")
    return rows
  prompt_R, output_R = lengths(w)
  budget_slots = w.num_blocks * w.block_size
  start = time.perf_counter()
  sims = {"paged": simulate_paged(w, prompt_R, output_R),
          "contiguous (max length)": simulate_contiguous(w, prompt_R, output_R, oracle=False),
          "contiguous (oracle length)": simulate_contiguous(w, prompt_R, output_R, oracle=True)}
  rows = [summarise(name, sim, budget_slots) for name, sim in sims.items()]
  base = rows[1]["peak_concurrent"]
  for row in rows:
    row["concurrent_vs_max"] = row["peak_concurrent"] / base
  lines = ["| policy | KV utilisation | budget holding tokens | peak concurrent | mean concurrent "
           "| concurrent / max-length | steps to drain | preemptions |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['policy']} | {100 * r['kv_utilization']:.1f}% | "
                 f"{100 * r['budget_holding_tokens']:.1f}% | {r['peak_concurrent']} | "
                 f"{r['mean_concurrent']:.1f} | {r['concurrent_vs_max']:.2f}x | {r['steps']} | "
                 f"{r['preemptions']} |")
  table = "\n".join(lines)
  final_R = prompt_R + output_R
  desc = (f"{w.num_requests} requests queued at t=0; prompts log-normal median "
          f"{w.prompt_median} sigma {w.prompt_sigma} max {w.max_prompt_len}; outputs median "
          f"{w.output_median} sigma {w.output_sigma} max {w.max_output_len}; declared max "
          f"length {w.max_len}; final lengths mean {final_R.mean():.0f}, p50 "
          f"{np.median(final_R):.0f}, p99 {np.percentile(final_R, 99):.0f}; budget N="
          f"{w.num_blocks} blocks x Z={w.block_size} = {budget_slots} token slots; S="
          f"{w.max_seqs} slots; seed {w.seed}")
  print(table)
  print(f"\n{desc}; {time.perf_counter() - start:.1f} s")
  if not args.quick:
    note = plot(sims, w, PLOT_PATH)
    print(note)
    machine = (f"{platform.machine()} CPU, {os.cpu_count()} cores visible (shared), jax "
               f"{jax.__version__}, backend {jax.default_backend()}")
    RESULTS_PATH.write_text(
        "## KV memory: paged vs contiguous reservation (`benchmarks/memory.py`)\n\n"
        f"Command: `python benchmarks/memory.py`\n\nMachine: {machine}.\n\n{desc}.\n\n"
        f"{table}\n\n{note}.\n")
  return rows


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
