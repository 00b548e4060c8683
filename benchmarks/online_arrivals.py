"""Requests that arrive over time: a ``Session`` (``LLM.session()``, through
``paged_jax.workload.serve_arrivals``) against waves of ``generate_stream`` calls, the one
way to serve them before sessions.

A wave serves the requests that have arrived when it starts, and those that arrive during it
wait for its end, however many slots free meanwhile. A session adds each request when it
arrives and admits it at the next device call with a free slot (continuous batching); a
capped session does so with each call cut to 2 engine steps (``Session.step(max_steps=2)``),
so a request waits for fewer steps before its call, at more host syncs.

The workload: ``--requests`` prompts of random length in [16, 128), 16-63 generated tokens
each (greedy, ignore_eos), arriving as a Poisson process at ``load`` x the engine's
capacity (its requests/s serving all of them at once, measured first), on a random Llama of
2 layers (E = 128, V = 256, H = 4, K = 2, D = 32: ``paged-jax run``'s embedded model's
shape), impl "xla", block size 16, max_seqs 8, 128 tokens per step, 8 steps per device
call, every program compiled first. Every way serves the same arrival times on one engine
(their outputs are checked equal), alternated over ``--repeats`` draws. Reported: time to
first token (arrival to its first token event) and latency (arrival to the last event),
median and 90th percentile over all requests of all draws, in seconds.

    python benchmarks/online_arrivals.py          # loads 0.5 and 0.9; writes
                                                  # online_RESULTS_section.md
    python benchmarks/online_arrivals.py --quick  # few requests, one load; never writes
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import platform
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.workload import Waits, Workload, arrival_times, serve_arrivals  # noqa: E402


CAP = 2  # the capped session's steps per device call (of 8)


def make_engine(seed: int = 0) -> LLM:
  config = ModelConfig(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_seq_len=256, eos_token_ids=(2,))
  llm = LLM(init_random(config, seed=seed, impl="xla"), config, block_size=16,
            num_blocks=128, max_seqs=8, max_tokens_per_step=128, steps_per_call=8)
  llm.precompile()
  return llm


def make_requests(n: int, seed: int):
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(3, 256, int(k))] for k in rng.integers(16, 128, n)]
  params = [SamplingParams(max_tokens=int(k), ignore_eos=True) for k in rng.integers(16, 64, n)]
  return prompts, params


def serve_waves(llm: LLM, prompts, params, arrivals_s) -> dict:
  """Waves of ``generate_stream``: each serves the requests arrived when it starts; the
  result as ``serve_arrivals``'."""
  n, start, t0 = len(prompts), 0, time.perf_counter()
  waits = Waits(params)
  while start < n:
    time.sleep(max(0.0, arrivals_s[start] - (time.perf_counter() - t0)))
    end = int(np.searchsorted(arrivals_s, time.perf_counter() - t0, side="right"))
    for ev in llm.generate_stream(prompts[start:end], params[start:end]):
      waits.record(start + ev.prompt_index, ev, time.perf_counter() - t0)
    start = end
  return waits.result(arrivals_s)


def measure(llm: LLM, load: float, requests: int, repeats: int, capacity: float) -> dict:
  ways = {"waves": serve_waves, "session": serve_arrivals,
          "capped": functools.partial(serve_arrivals, max_steps=CAP)}
  totals = {name: dict(ttft_s=[], latency_s=[]) for name in ways}
  for r in range(repeats):
    prompts, params = make_requests(requests, seed=100 + r)
    arrivals_s = arrival_times(Workload(num_requests=requests, seed=200 + r,
                                        request_rate=load * capacity))
    order = list(ways) if r % 2 == 0 else list(ways)[::-1]  # drift hits all alike
    results = {name: ways[name](llm, prompts, params, arrivals_s) for name in order}
    assert all(res["token_ids"] == results["waves"]["token_ids"] for res in results.values()), (
        "the ways generated different tokens")
    for name, res in results.items():
      for metric in ("ttft_s", "latency_s"):
        totals[name][metric] += res[metric]
  row = dict(load=load, rate=load * capacity)
  for name, res in totals.items():
    for metric, values in res.items():
      row[f"{name}_{metric[:-2]}_p50"] = float(np.percentile(values, 50))
      row[f"{name}_{metric[:-2]}_p90"] = float(np.percentile(values, 90))
  return row


def table(rows) -> str:
  lines = ["| load | arrivals/s | TTFT p50, waves | TTFT p50, session | ratio | "
           "TTFT p90, waves | TTFT p90, session | latency p50, waves | latency p50, session | "
           "ratio | TTFT p50, capped | TTFT p90, capped | latency p50, capped |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['load']:.1f} | {r['rate']:.1f} | {r['waves_ttft_p50']:.3f} | "
        f"{r['session_ttft_p50']:.3f} | {r['waves_ttft_p50'] / r['session_ttft_p50']:.1f}x | "
        f"{r['waves_ttft_p90']:.3f} | {r['session_ttft_p90']:.3f} | "
        f"{r['waves_latency_p50']:.3f} | {r['session_latency_p50']:.3f} | "
        f"{r['waves_latency_p50'] / r['session_latency_p50']:.1f}x | "
        f"{r['capped_ttft_p50']:.3f} | {r['capped_ttft_p90']:.3f} | "
        f"{r['capped_latency_p50']:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  requests = 8 if args.quick else args.requests
  repeats = 1 if args.quick else args.repeats
  loads = (0.9,) if args.quick else (0.5, 0.9)
  llm = make_engine()
  prompts, params = make_requests(requests, seed=99)
  llm.generate(prompts, params)  # warm-up
  llm.reset_stats()
  llm.generate(prompts, params)
  capacity = llm.stats["requests_per_s"]
  print(f"capacity: {capacity:.1f} requests/s served all at once")
  rows = [measure(llm, load, requests, repeats, capacity) for load in loads]
  text = table(rows)
  print(text)
  if not args.quick:
    command_args = "".join(f" --{name} {value}" for name, value in (
        ("requests", args.requests), ("repeats", args.repeats))
        if value != parser.get_default(name))
    where = (f"{jax.default_backend()} ({platform.processor() or platform.machine()}), "
             f"jax {jax.__version__}")
    section = (
        "## Requests arriving over time: sessions (`benchmarks/online_arrivals.py`)\n\n"
        f"`python benchmarks/online_arrivals.py{command_args}` on {where}: {requests} "
        "requests per draw "
        "(prompts of 16-127 tokens, 16-63 generated, greedy, ignore_eos), Poisson arrivals "
        f"at load x the engine's capacity ({capacity:.1f} requests/s serving them all at "
        "once), random Llama of 2 layers (E 128, V 256), max_seqs 8, T = 128, 8 steps per "
        f"call, {repeats} draws per load, outputs of every way equal. \"waves\": "
        "`generate_stream` of the requests arrived when it starts, the next wave after it "
        "ends; \"session\": `llm.session()`, each request added as it arrives; \"capped\": "
        f"the same with `session.step(max_steps={CAP})`. Seconds from "
        "arrival; ratio = waves / session.\n\n" + text + "\n")
    out = pathlib.Path(__file__).with_name("online_RESULTS_section.md")
    out.write_text(section)
    print(f"wrote {out}")
  return rows


if __name__ == "__main__":
  main()
