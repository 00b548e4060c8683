"""Decode tokens/s against the number of "data" shards, on 8 host-platform CPU devices.

Each row serves the same kind of decode-heavy workload with ``LLM(..., mesh=Mesh(devices
[:d].reshape(d, 1), ("data", "model")))`` for d = 1, 2, 4, 8 (plus the unsharded engine,
no mesh, as the reference): short prompts (4-8 tokens), ``--max-tokens`` generated
tokens each, greedy, ignore_eos, on a small random Llama (4 layers, E=256, I=512, H=8, K=4,
D=32, V=512, float32, impl "xla"), block size 16.

- weak scaling: every data shard has ``--slots`` sequence slots and its own pool, and
  there are 2 requests per slot: the work per shard is constant, the total grows with d.
- strong scaling: ``8 * --slots`` slots in all, split over the d shards, the same requests
  for every d.

tokens/s = generated tokens / wall time of one ``generate`` (median of ``--repeats``
timed calls after a warm-up call that compiles). The outputs of every sharded engine are
checked equal to the unsharded engine's (greedy). The 8 "devices" are XLA's host platform
split (``--xla_force_host_platform_device_count=8``): they share this machine's cores, so
the table measures the sharded engine's overheads and how far the cores go, not 8 chips.

    python benchmarks/sharding.py            # also prints a section for RESULTS.md
    python benchmarks/sharding.py --quick    # small, one repeat
    python benchmarks/sharding.py --quick --json out.json   # rows as JSON too (tests)
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402

SMALL = dict(model_type="llama", vocab_size=512, embed_dim=256, mlp_dim=512, num_layers=4,
             num_heads=8, num_kv_heads=4, head_dim=32, max_seq_len=256, eos_token_ids=(2,))
TINY = dict(SMALL, embed_dim=64, mlp_dim=96, num_layers=2, head_dim=16)
"""``--quick``: a smaller model, weak scaling over 1 and 8 shards only (a test runs it)."""
QUICK_DATA_SHARDS = (1, 8)
DATA_SHARDS = (1, 2, 4, 8)


def workload(num_requests: int, max_tokens: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(3, SMALL["vocab_size"], int(n))]
             for n in rng.integers(4, 9, num_requests)]
  return prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def serve(model, config, *, shards, max_seqs, prompts, params, repeats, steps_per_call):
  """(median tokens/s, outputs) of an engine over ``shards`` data shards (None: no mesh)."""
  mesh = None
  if shards is not None:
    mesh = Mesh(np.array(jax.devices()[:shards]).reshape(shards, 1), ("data", "model"))
  per_seq_blocks = -(-(8 + params.max_tokens) // 16)
  llm = LLM(model, config, mesh=mesh, block_size=16, num_blocks=max_seqs * per_seq_blocks,
            max_seqs=max_seqs, max_tokens_per_step=max(64, max_seqs),
            steps_per_call=steps_per_call, enable_prefix_caching=False)
  outs = [o.token_ids for o in llm.generate(prompts, params)]  # warm-up: compile
  rates = []
  for _ in range(repeats):
    llm.reset_stats()
    llm.generate(prompts, params)
    rates.append(llm.stats["tokens_per_s"])
  return statistics.median(rates), outs


def measure(slots: int, max_tokens: int, repeats: int, steps_per_call: int,
            quick: bool = False) -> list[dict]:
  if jax.device_count() < max(DATA_SHARDS):
    raise RuntimeError(f"{jax.device_count()} devices: run this file as a script (it sets "
                       f"XLA_FLAGS={_FLAG} before JAX starts)")
  config = ModelConfig(**(TINY if quick else SMALL))
  model = init_random(config, seed=0, impl="xla")
  rows = []
  strong_seqs = max(DATA_SHARDS) * slots
  strong_prompts, params = workload(2 * strong_seqs, max_tokens, seed=1)
  base = {}
  kinds = (("weak", None),) if quick else (("weak", None), ("strong", strong_seqs))
  for kind, total in kinds:
    for shards in QUICK_DATA_SHARDS if quick else (None,) + DATA_SHARDS:
      d = 1 if shards is None else shards
      max_seqs = total if total is not None else slots * d
      prompts = strong_prompts if total is not None else workload(2 * max_seqs, max_tokens)[0]
      rate, outs = serve(model, config, shards=shards, max_seqs=max_seqs, prompts=prompts,
                         params=params, repeats=repeats, steps_per_call=steps_per_call)
      key = (kind, max_seqs)
      if shards is None:
        base[key] = outs
      elif key in base and outs != base[key]:
        raise AssertionError(f"{kind} scaling, {shards} data shards: outputs differ from the "
                             "unsharded engine")
      rows.append(dict(kind=kind, data_shards=shards, max_seqs=max_seqs,
                       slots_per_shard=max_seqs // d, requests=len(prompts),
                       tokens=len(prompts) * max_tokens, tokens_per_s=rate))
  for kind, _ in kinds:
    one = next(r["tokens_per_s"] for r in rows if r["kind"] == kind and r["data_shards"] == 1)
    for r in rows:
      if r["kind"] == kind:
        r["speedup"] = r["tokens_per_s"] / one
  return rows


def table(rows) -> str:
  lines = ["| scaling | data shards (devices) | slots per shard | requests | tokens "
           "| decode tokens/s | vs 1 shard |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    shards = "no mesh (1)" if r["data_shards"] is None else str(r["data_shards"])
    lines.append(f"| {r['kind']} | {shards} | {r['slots_per_shard']} | {r['requests']} "
                 f"| {r['tokens']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--slots", type=int, default=8, help="sequence slots per data shard")
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", help="also write the rows to this JSON file")
  args = parser.parse_args(argv)
  slots = 2 if args.quick else args.slots
  max_tokens = 8 if args.quick else args.max_tokens
  repeats = 1 if args.quick else args.repeats
  rows = measure(slots, max_tokens, repeats, steps_per_call=16, quick=args.quick)
  text = table(rows)
  print(text)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows))
  if not args.quick:
    where = (f"{platform.machine()} CPU, {os.cpu_count()} cores visible, jax "
             f"{jax.__version__}, 8 host-platform devices "
             f"(`--xla_force_host_platform_device_count=8`)")
    command = "python benchmarks/sharding.py" + ("" if argv is None and len(sys.argv) == 1
                                                  else " " + " ".join(argv or sys.argv[1:]))
    section = (
        "## Decode tokens/s against data shards (`benchmarks/sharding.py`)\n\n"
        f"Command: `{command}`\n\nMachine: {where}.\n\n"
        f"Meshes `(d, 1)` over the first d devices, one `shard_map` per device call; "
        f"random Llama with 4 layers, E=256, I=512, H=8, K=4, D=32, V=512, float32, impl xla; "
        f"prompts of 4-8 tokens, {max_tokens} generated tokens each (greedy, ignore_eos), "
        f"block size 16, 16 steps per device call; median of {repeats} timed `generate` "
        "calls after a compiling one. Weak scaling: "
        f"{slots} slots per data shard and 2 requests per slot. Strong scaling: "
        f"{max(DATA_SHARDS) * slots} slots split over the shards, the same "
        f"{2 * max(DATA_SHARDS) * slots} requests. Every sharded engine's tokens equal the "
        "unsharded engine's.\n\n" + text + "\n")
    print("\n--- section for benchmarks/RESULTS.md ---\n" + section)
  return rows


if __name__ == "__main__":
  main()
