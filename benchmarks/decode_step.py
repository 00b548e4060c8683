"""The jitted decode step over the paged cache vs the same step over a contiguous cache, and
the engine's multi-step device loop vs one host call per step.

Part 1, decode step. ``models.Steps(model, impl=...).decode`` (allocator ``append`` +
``slots``, K/V write, ``paged_attention``, logits; allocator state and pool donated) against
a contiguous-cache decode step built from the same model code: the same embedding, decoder
layers (``DecoderLayer``) and logits, but K/V kept per layer in a contiguous ``[S, K, J, D]``
cache (J = every position the timed steps reach), written at each sequence's length and
attended densely (one einsum over J, positions past the length masked). Each case holds S
sequences of ``context`` tokens (equal live tokens on both sides; the paged blocks are
interleaved across sequences, as a pool that served them together would hold them) and
every call decodes one token for each. The logits of the two steps are checked equal
before timing. Per call: median over ``rounds`` interleaved rounds of ``calls`` calls of
each variant (the first call of each run dropped). Beside the step, one layer's attention
alone on the caches the steps left (``paged_attention`` vs the contiguous step's einsum):
the part of the step that differs. The Pallas impls ("pallas_tpu",
"pallas_gpu") run only in interpret mode on CPU, which is not a timing: they are skipped
here and listed as such.

Part 2, device loop. ``paged_jax.LLM`` serves one long-tailed queue
(``paged_jax.workload``) with ``steps_per_call`` K (the device loop: up to K scheduling
steps per jitted call, one host sync per call) and with ``steps_per_call=1`` (one host call
per step), alternating the two engines; tokens/s is the median of ``repeats`` runs after a
warm-up run.

    python benchmarks/decode_step.py            # full; writes decode_step_RESULTS_section.md
    python benchmarks/decode_step.py --quick    # seconds; never writes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import models  # noqa: E402
from paged_jax.models import layers  # noqa: E402
from paged_jax import KVCache, allocator, paged_attention  # noqa: E402
from paged_jax.engine import LLM  # noqa: E402
from paged_jax.workload import Workload, make_requests  # noqa: E402
from benchmarks.throughput import machine  # noqa: E402  (one machine line for both tables)

RESULTS_PATH = pathlib.Path(__file__).with_name("decode_step_RESULTS_section.md")
CPU_IMPLS = ("xla", "reference")
INTERPRET_ONLY_IMPLS = ("pallas_tpu", "pallas_gpu")


@dataclasses.dataclass(frozen=True)
class StepCase:
  """S sequences of ``context`` tokens each; every call decodes one more token for each."""

  num_seqs: int  # S
  context: int


@dataclasses.dataclass(frozen=True)
class StepBench:
  model: models.ModelConfig
  block_size: int  # Z
  cases: tuple[StepCase, ...]
  impls: tuple[str, ...]
  rounds: int
  calls: int  # per variant per round; the first one of each run is dropped
  warmup: int


@dataclasses.dataclass(frozen=True)
class LoopBench:
  model: models.ModelConfig
  workload: Workload
  block_size: int
  num_blocks: int
  max_seqs: int
  max_tokens_per_step: int
  steps_per_call: int  # the device loop's K (against 1)
  repeats: int


STEP_MODEL = models.ModelConfig(model_type="llama", vocab_size=512, embed_dim=256, mlp_dim=512,
                                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                                max_seq_len=4096)
LOOP_MODEL = models.ModelConfig(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                max_seq_len=512, eos_token_ids=(2,))
FULL_STEP = StepBench(model=STEP_MODEL, block_size=16,
                      cases=(StepCase(8, 256), StepCase(16, 1024), StepCase(64, 256),
                             StepCase(4, 4096)),
                      impls=CPU_IMPLS, rounds=7, calls=8, warmup=3)
QUICK_STEP = StepBench(
    model=dataclasses.replace(STEP_MODEL, embed_dim=64, mlp_dim=128, num_heads=4, head_dim=16,
                              vocab_size=128),
    block_size=16, cases=(StepCase(4, 40),), impls=CPU_IMPLS, rounds=2, calls=2, warmup=1)
FULL_LOOP = LoopBench(model=LOOP_MODEL,
                      workload=Workload(num_requests=256, vocab_size=LOOP_MODEL.vocab_size),
                      block_size=16, num_blocks=288, max_seqs=32, max_tokens_per_step=64,
                      steps_per_call=16, repeats=5)
QUICK_LOOP = LoopBench(model=dataclasses.replace(LOOP_MODEL, embed_dim=64, mlp_dim=128,
                                                 head_dim=16, vocab_size=128),
                       workload=Workload(num_requests=6, prompt_median=8, max_prompt_len=16,
                                         output_median=6, max_output_len=12, vocab_size=128),
                       block_size=8, num_blocks=32, max_seqs=4, max_tokens_per_step=16,
                       steps_per_call=8, repeats=1)


# ----------------------------------------------------------------------------- part 1


def _dense_decode(graphdef, params, k_LSKJD, v_LSKJD, len_S, tokens_S):
  """One decode token per sequence over contiguous per-layer caches (tuples of L arrays).

  Layer l's K/V go to ``k_LSKJD[l][s, :, len_S[s]]``; each query attends to positions
  ``<= len_S[s]`` of its own row. The layers run unrolled, each over its own cache array,
  so no layer's cache is sliced out of a larger one (the best case for a contiguous cache).
  """
  model = nnx.merge(graphdef, params)
  c = model.config
  num_seqs = tokens_S.shape[0]
  group = c.num_heads // c.num_kv_heads
  seq_S = jnp.arange(num_seqs)
  x_TE = model._embed(tokens_S)  # the same embedding, layers and logits as paged_forward
  cos_TD, sin_TD = layers.rope_cos_sin(len_S, c.rope_inv_frequencies(), x_TE.dtype)
  layer_graphdef, stacked = nnx.split(model.layers)
  k_out, v_out = [], []
  for layer in range(c.num_layers):
    block = nnx.merge(layer_graphdef, jax.tree.map(lambda p: p[layer], stacked))
    cache = {}

    def attend(q_THD, k_TKD, v_TKD, sinks_H, layer=layer, cache=cache):
      del sinks_H  # the benchmark's Llama shape has none
      k_SKJD = k_LSKJD[layer].at[seq_S, :, len_S].set(k_TKD.astype(k_LSKJD[layer].dtype),
                                                      mode="drop")
      v_SKJD = v_LSKJD[layer].at[seq_S, :, len_S].set(v_TKD.astype(v_LSKJD[layer].dtype),
                                                      mode="drop")
      cache.update(k=k_SKJD, v=v_SKJD)
      q_SKGD = q_THD.astype(jnp.float32).reshape(num_seqs, c.num_kv_heads, group, c.head_dim)
      scores_SKGJ = jnp.einsum("skgd,skjd->skgj", q_SKGD, k_SKJD.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST) * c.head_dim ** -0.5
      visible_SJ = jnp.arange(k_SKJD.shape[2])[None, :] <= len_S[:, None]
      scores_SKGJ = jnp.where(visible_SJ[:, None, None], scores_SKGJ, -jnp.inf)
      probs_SKGJ = jax.nn.softmax(scores_SKGJ, axis=-1)
      out_SKGD = jnp.einsum("skgj,skjd->skgd", probs_SKGJ, v_SKJD.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
      return out_SKGD.reshape(num_seqs, c.num_heads, c.head_dim).astype(q_THD.dtype), None

    x_TE, _ = block(x_TE, cos_TD, sin_TD, attend)
    k_out.append(cache["k"])
    v_out.append(cache["v"])
  return model._logits(x_TE), tuple(k_out), tuple(v_out), len_S + 1


_dense_decode_jit = jax.jit(_dense_decode, static_argnums=(0,), donate_argnums=(2, 3))


@jax.jit
def _dense_attention(q_SHD, k_SKJD, v_SKJD, len_S):
  """The contiguous step's attention alone: queries at position ``len_S``, keys ``<=``."""
  num_seqs, num_heads, head_dim = q_SHD.shape
  q_SKGD = q_SHD.reshape(num_seqs, k_SKJD.shape[1], -1, head_dim)
  scores_SKGJ = jnp.einsum("skgd,skjd->skgj", q_SKGD, k_SKJD,
                           precision=jax.lax.Precision.HIGHEST) * head_dim ** -0.5
  visible_SJ = jnp.arange(k_SKJD.shape[2])[None, :] <= len_S[:, None]
  probs_SKGJ = jax.nn.softmax(jnp.where(visible_SJ[:, None, None], scores_SKGJ, -jnp.inf), -1)
  out_SKGD = jnp.einsum("skgj,skjd->skgd", probs_SKGJ, v_SKJD,
                        precision=jax.lax.Precision.HIGHEST)
  return out_SKGD.reshape(num_seqs, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("block_size",))
def _grow_interleaved(state, context_S, *, block_size: int):
  """Append ``context_S`` tokens to every sequence one block per sequence at a time, so
  sequence s holds blocks s, s + S, s + 2S, ... (interleaved, as served together)."""
  def body(i, state):
    want_S = jnp.clip(context_S - i * block_size, 0, block_size)
    state, _ = allocator.append(state, want_S)
    return state
  rounds = (jnp.max(context_S) + block_size - 1) // block_size
  return jax.lax.fori_loop(0, rounds, body, state)


def _step_states(bench: StepBench, case: StepCase, model, seed: int = 0):
  """A paged (allocator state, cache) and the contiguous caches holding the same K/V."""
  z, s, ctx = bench.block_size, case.num_seqs, case.context
  steps = bench.warmup + bench.rounds * (bench.calls + 1)  # calls each variant makes
  p = math.ceil((ctx + steps) / z)
  n = s * p
  state = _grow_interleaved(allocator.init(n, z, s, p), jnp.full(s, ctx, jnp.int32),
                            block_size=z)
  if not bool(jnp.all(state.seq_lens == ctx)):
    raise RuntimeError(f"the pool of {n} blocks does not hold {s} x {ctx} tokens")
  c = bench.model
  rng = np.random.default_rng(seed)
  shape = (c.num_layers, c.num_kv_heads, n, z, c.head_dim)
  k_pages = rng.standard_normal(shape, np.float32)
  v_pages = rng.standard_normal(shape, np.float32)
  tables_SP = np.asarray(state.block_tables)
  # Sequence s's positions, contiguous: pages[l, k, tables[s]] -> [L, S, K, P * Z, D].
  def contiguous(pages):
    dense = pages[:, :, tables_SP]  # [L, K, S, P, Z, D]
    dense = dense.transpose(0, 2, 1, 3, 4, 5).reshape(c.num_layers, s, c.num_kv_heads, p * z,
                                                      c.head_dim)
    return tuple(jnp.asarray(dense[layer]) for layer in range(c.num_layers))
  cache = KVCache(k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))
  return state, cache, contiguous(k_pages), contiguous(v_pages)


def bench_step(bench: StepBench, case: StepCase, seed: int = 0) -> list[dict]:
  """Rows (one per impl) of paged / contiguous microseconds per decode call."""
  model = models.init_random(bench.model, seed=seed)
  graphdef, params = nnx.split(model)
  s = case.num_seqs
  rng = np.random.default_rng(seed + 1)
  tokens_S = jnp.asarray(rng.integers(0, bench.model.vocab_size, s), jnp.int32)
  active_S = jnp.ones(s, jnp.bool_)
  live = {}
  for impl in bench.impls:
    state, cache, _, _ = _step_states(bench, case, model, seed)
    live[impl] = dict(steps=models.Steps(model, impl=impl), state=state, cache=cache)
  _, _, k_dense, v_dense = _step_states(bench, case, model, seed)
  live["dense"] = dict(k=k_dense, v=v_dense, len_S=jnp.full(s, case.context, jnp.int32))

  def call(name):
    v = live[name]
    if name == "dense":
      logits_SV, v["k"], v["v"], v["len_S"] = _dense_decode_jit(graphdef, params, v["k"],
                                                                v["v"], v["len_S"], tokens_S)
      return jax.block_until_ready(logits_SV)
    logits_SV, v["state"], v["cache"], ok_S = v["steps"].decode(v["state"], v["cache"],
                                                                tokens_S, active_S)
    if not bool(jnp.all(ok_S)):
      raise RuntimeError(f"{name}: an append was refused")
    return jax.block_until_ready(logits_SV)

  names = list(bench.impls) + ["dense"]
  first = {name: np.asarray(call(name)) for name in names}  # compiles; same first token
  max_diff = {name: float(np.max(np.abs(first[name] - first["dense"]))) for name in names}
  for _ in range(bench.warmup - 1):
    for name in names:
      call(name)
  samples = {name: [] for name in names}
  for _ in range(bench.rounds):
    for name in names:
      for i in range(bench.calls + 1):
        start = time.perf_counter()
        call(name)
        if i:
          samples[name].append(time.perf_counter() - start)
  for impl in bench.impls:
    if not bool(jnp.all(live[impl]["state"].seq_lens == live["dense"]["len_S"])):
      raise RuntimeError(f"{impl}: the paged and contiguous lengths diverged")
  dense_us = 1e6 * statistics.median(samples["dense"])
  attention_us = _attention_only(bench, live, s, rng)
  rows = []
  for impl in bench.impls:
    paged_us = 1e6 * statistics.median(samples[impl])
    rows.append(dict(num_seqs=s, context=case.context, impl=impl, paged_us=paged_us,
                     dense_us=dense_us, ratio=paged_us / dense_us,
                     attention_paged_us=attention_us[impl],
                     attention_dense_us=attention_us["dense"],
                     attention_ratio=attention_us[impl] / attention_us["dense"],
                     max_abs_logit_diff=max_diff[impl], calls=len(samples[impl])))
  return rows


def _attention_only(bench: StepBench, live: dict, num_seqs: int, rng) -> dict:
  """Microseconds of one layer's attention alone, on the caches the steps left behind:
  ``paged_attention`` per impl, and the contiguous step's einsum attention."""
  c = bench.model
  q_SHD = jnp.asarray(rng.standard_normal((num_seqs, c.num_heads, c.head_dim)), jnp.float32)
  cu = jnp.arange(num_seqs + 1, dtype=jnp.int32)
  calls = {}
  for impl in bench.impls:
    state, cache = live[impl]["state"], live[impl]["cache"]
    fn = jax.jit(functools.partial(paged_attention, impl=impl))
    calls[impl] = functools.partial(fn, q_SHD, cache, jnp.int32(0), state.seq_lens,
                                    state.block_tables, cu, jnp.int32(num_seqs))
  d = live["dense"]
  calls["dense"] = functools.partial(_dense_attention, q_SHD, d["k"][0], d["v"][0],
                                     d["len_S"] - 1)
  samples = {name: [] for name in calls}
  for fn in calls.values():
    jax.block_until_ready(fn())
  for _ in range(bench.rounds):
    for name, fn in calls.items():
      for i in range(bench.calls + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        if i:
          samples[name].append(time.perf_counter() - start)
  return {name: 1e6 * statistics.median(v) for name, v in samples.items()}


def step_table(rows: list[dict]) -> str:
  lines = ["| S x context | impl | paged step us | contiguous step us | paged / contiguous "
           "| attention alone: paged us | contiguous us | paged / contiguous "
           "| max abs logit diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['num_seqs']} x {r['context']} | {r['impl']} | {r['paged_us']:.0f} | "
                 f"{r['dense_us']:.0f} | {r['ratio']:.2f} | {r['attention_paged_us']:.0f} | "
                 f"{r['attention_dense_us']:.0f} | {r['attention_ratio']:.2f} | "
                 f"{r['max_abs_logit_diff']:.1e} |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- part 2


def bench_loop(bench: LoopBench, seed: int = 0) -> list[dict]:
  """Rows for steps_per_call = K and = 1: median tokens/s serving the same queue."""
  model = models.init_random(bench.model, seed=seed, impl="xla")
  prompts, params = make_requests(bench.workload)
  w = bench.workload
  max_len = w.max_prompt_len + w.max_output_len
  engines = {k: LLM(model, bench.model, block_size=bench.block_size,
                    num_blocks=bench.num_blocks, max_seqs=bench.max_seqs,
                    max_tokens_per_step=bench.max_tokens_per_step, max_model_len=max_len,
                    steps_per_call=k, enable_prefix_caching=False)
             for k in (bench.steps_per_call, 1)}
  outputs = {k: [o.token_ids for o in llm.generate(prompts, params)]  # warm-up: compiles
             for k, llm in engines.items()}
  if outputs[bench.steps_per_call] != outputs[1]:
    raise RuntimeError("the device loop changed the outputs")
  rates = {k: [] for k in engines}
  stats = {}
  for _ in range(bench.repeats):
    for k, llm in engines.items():
      llm.reset_stats()
      llm.generate(prompts, params)
      stats[k] = llm.stats
      rates[k].append(stats[k]["tokens_per_s"])
  rows = []
  for k in engines:
    st = stats[k]
    rows.append(dict(steps_per_call=k, tokens_per_s=statistics.median(rates[k]),
                     device_calls=st["device_calls"], steps=st["steps"],
                     host_syncs_per_token=st["host_syncs_per_token"],
                     tokens=st["generated_tokens"]))
  base = rows[-1]["tokens_per_s"]
  for row in rows:
    row["speedup"] = row["tokens_per_s"] / base
  return rows


def loop_table(rows: list[dict]) -> str:
  lines = ["| steps_per_call | tokens/s | vs 1 step per call | device calls | engine steps "
           "| host syncs per token |", "|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['steps_per_call']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                 f"{r['device_calls']} | {r['steps']} | {r['host_syncs_per_token']:.3f} |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny cases, seconds; no files")
  parser.add_argument("--skip-loop", action="store_true", help="part 1 only")
  parser.add_argument("--skip-step", action="store_true", help="part 2 only")
  args = parser.parse_args(argv)
  step_bench = QUICK_STEP if args.quick else FULL_STEP
  loop_bench = QUICK_LOOP if args.quick else FULL_LOOP
  start = time.perf_counter()
  step_rows = [] if args.skip_step else [
      row for case in step_bench.cases for row in bench_step(step_bench, case)]
  loop_rows = [] if args.skip_loop else bench_loop(loop_bench)
  c, lc, w = step_bench.model, loop_bench.model, loop_bench.workload
  parts = []
  if step_rows:
    parts += [
        f"Decode step, float32, model L={c.num_layers} E={c.embed_dim} I={c.mlp_dim} "
        f"H={c.num_heads} K={c.num_kv_heads} D={c.head_dim} V={c.vocab_size}, Z="
        f"{step_bench.block_size}; microseconds per call, median of {step_rows[0]['calls']} "
        f"calls of each variant in {step_bench.rounds} interleaved rounds; \"attention "
        f"alone\" is one layer's attention on the same caches (``paged_attention`` vs the "
        f"contiguous step's einsum). Skipped on CPU: "
        f"{', '.join(INTERPRET_ONLY_IMPLS)} (interpret mode only, not a timing).", "",
        step_table(step_rows), ""]
  if loop_rows:
    parts += [
        f"Device loop: {w.num_requests} requests (prompts log-normal median "
        f"{w.prompt_median} sigma {w.prompt_sigma} max {w.max_prompt_len}; outputs median "
        f"{w.output_median} sigma {w.output_sigma} max {w.max_output_len}; greedy, seed "
        f"{w.seed}) queued at once; model L={lc.num_layers} E={lc.embed_dim} "
        f"H={lc.num_heads} K={lc.num_kv_heads} D={lc.head_dim} V={lc.vocab_size}; "
        f"Z={loop_bench.block_size}, N={loop_bench.num_blocks} blocks, max_seqs "
        f"{loop_bench.max_seqs}, max_tokens_per_step {loop_bench.max_tokens_per_step}; "
        f"median of {loop_bench.repeats} runs, the two engines alternating.", "",
        loop_table(loop_rows), ""]
  text = "\n".join(parts)
  print(text)
  print(f"{time.perf_counter() - start:.1f} s")
  if not args.quick:
    command = " ".join(["python benchmarks/decode_step.py", *(
        argv if argv is not None else sys.argv[1:])]).strip()
    RESULTS_PATH.write_text(
        "## Decode step: paged vs contiguous cache, and the device loop "
        "(`benchmarks/decode_step.py`)\n\n"
        f"Command: `{command}`\n\nMachine: {machine()}.\n\n{text}")
    print(f"wrote {RESULTS_PATH}")
  return dict(step=step_rows, loop=loop_rows)


if __name__ == "__main__":
  main()
