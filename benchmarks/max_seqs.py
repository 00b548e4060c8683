"""What a large ``max_seqs`` costs when few sequences are resident.

``paged-jax run``'s workload (64 synthetic requests; the embedded tiny Llama: 2 layers,
width 128, vocab 256) on a pool of 64 blocks of 16 tokens, which holds a few dozen
sequences at a time, served with more and more slots. Every step works on all S slots in
the allocator, the LM head and the sampler, and the smallest default token bucket holds a
decode row of every slot (``default_token_buckets``), so idle slots cost. Stop 42 found
``register``'s in-call duplicate check comparing every pair of slots ([S, S] temporaries:
31 GB asked for at S = 100000) and replaced it with a sort of the S rows; the second
table gives the compiled ``register``'s temporary bytes against S.

Each engine is compiled first (``precompile``); tokens/s is the best of ``--repeats``
rounds, the engines alternating; the outputs are checked equal across every engine.

    python benchmarks/max_seqs.py            # S = 16, 64, 256, 1024, 4096
    python benchmarks/max_seqs.py --quick    # S = 16, 64
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import allocator  # noqa: E402
from paged_jax.cli_run import TINY_LLAMA  # noqa: E402
from paged_jax.engine import LLM  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.workload import Workload, make_requests  # noqa: E402

NUM_BLOCKS, SMALL_BUCKETS = 64, (32, 128, 256)


def engine_rows(sizes, repeats: int) -> list[dict]:
  config = ModelConfig(**TINY_LLAMA)
  model = init_random(config, seed=0)
  prompts, params = make_requests(Workload(vocab_size=config.vocab_size))
  cases = {(s, None): dict(max_seqs=s) for s in sizes}
  if max(sizes) >= 256:
    cases[(256, SMALL_BUCKETS)] = dict(max_seqs=256, token_buckets=SMALL_BUCKETS)
  engines, outputs = {}, {}
  for key, options in cases.items():
    engines[key] = LLM(model, config, num_blocks=NUM_BLOCKS, **options)
    engines[key].precompile()
    outputs[key] = [o.token_ids for o in engines[key].generate(prompts, params)]
  first = next(iter(outputs.values()))
  assert all(out == first for out in outputs.values()), "engines generated different tokens"
  best = dict.fromkeys(cases, 0.0)
  for _ in range(repeats):
    for key, llm in engines.items():
      llm.reset_stats()
      llm.generate(prompts, params)
      best[key] = max(best[key], llm.stats["tokens_per_s"])
  rows = []
  for (s, buckets), llm in engines.items():
    row = dict(max_seqs=s, buckets=llm.token_buckets, tokens_per_s=best[(s, buckets)],
               vs_16=best[(s, buckets)] / best[(sizes[0], None)])
    rows.append(row)
    print(f"| {s} | {', '.join(map(str, llm.token_buckets))} | {row['tokens_per_s']:.0f} | "
          f"{row['vs_16']:.2f}x |", flush=True)
  return rows


def register_rows(sizes) -> list[dict]:
  rows = []
  for s in sizes:
    state = allocator.init(num_blocks=NUM_BLOCKS, block_size=16, max_seqs=s,
                           max_blocks_per_seq=2)
    compiled = jax.jit(allocator.register).lower(state, jnp.zeros((s, 32), jnp.int32)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    rows.append(dict(max_seqs=s, temp_bytes=temp))
    print(f"| {s} | {temp / 2**20:.2f} |", flush=True)
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="S = 16 and 64 only")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  sizes = (16, 64) if args.quick else (16, 64, 256, 1024, 4096)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {NUM_BLOCKS} blocks of 16 "
        f"tokens; best of {args.repeats} rounds")
  print("| max_seqs | token buckets | tokens/s | vs max_seqs 16 |")
  print("|---:|---|---:|---:|")
  rows = engine_rows(sizes, args.repeats)
  print("\n| max_seqs | register's temporaries, MiB |")
  print("|---:|---:|")
  return rows + register_rows((256, 1024) if args.quick else (1024, 4096, 16384))


if __name__ == "__main__":
  main()
