"""Decode cost against ``max_model_len``: the same batch, tokens and blocks at every J.

An engine's per-slot token history is ``[S, J]`` (J = ``max_model_len``) and its block
tables ``[S, P]`` (P = J / Z), so a step's bookkeeping grows with J even when no sequence
is long; the attention and the model do not (the same tokens, the same blocks). This
serves S identical short decodes (8-token prompts, 64 tokens each, greedy) on a tiny
random Llama (2 layers, E=64, K=1, D=32, block size 16, one token bucket of S, one pool
that holds the longest J) at several
``max_model_len``, with the prefix cache off and on, and prints the best of ``--repeats``
``generate`` calls as ms per decode step and as a ratio to the smallest J (1.0 = no growth).

Stop 40 dropped an [S, J] copy of the history that every step made (a fork's rows) and
the allocator's binary search over the pool for each of an append's [g, S, P] ranks (see
RESULTS.md for the figures before and after). What grows still: the [S, P] block-table
passes of every step and, with the prefix cache, the hashing of whole histories on the
steps that admit or fill blocks.

    python benchmarks/max_model_len.py            # J in (2k, 8k, 32k), S = 32
    python benchmarks/max_model_len.py --quick    # J in (256, 1024), S = 8
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402

NEW_TOKENS = 64


def measure(max_seqs: int, lengths, repeats: int, prefix_caching: bool) -> list[dict]:
  config = ModelConfig(model_type="llama", vocab_size=256, embed_dim=64, mlp_dim=128,
                       num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                       max_seq_len=max(lengths), eos_token_ids=(2,))
  model = init_random(config, seed=0)
  prompts = [[3 + i % 200, 5, 7, 9, 11, 13, 15, 17] for i in range(max_seqs)]
  params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
  rows, first = [], None
  num_blocks = max(lengths) // 16  # one pool for every J: the longest sequence fits
  for max_model_len in lengths:
    llm = LLM(model, config, block_size=16, num_blocks=num_blocks, max_seqs=max_seqs,
              max_tokens_per_step=max_seqs, token_buckets=(max_seqs,),
              max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, params)  # compiles
    if first is None:
      first = [o.token_ids for o in outs]
    assert [o.token_ids for o in outs] == first, "outputs changed with max_model_len"
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      llm.generate(prompts, params)
      best = min(best, time.perf_counter() - t0)
    ms = best / NEW_TOKENS * 1e3
    rows.append(dict(J=max_model_len, prefix_caching=prefix_caching, ms_per_step=ms,
                     ratio=ms / rows[0]["ms_per_step"] if rows else 1.0))
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two small lengths, S = 8")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  max_seqs, lengths = (8, (256, 1024)) if args.quick else (32, (2048, 8192, 32768))
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; S = {max_seqs}, "
        f"{NEW_TOKENS} decode steps, best of {args.repeats}")
  print(f"| prefix cache | {'J':>6} | ms / step | vs smallest J |")
  print("|---|---:|---:|---:|")
  results = []
  for prefix_caching in (False, True):
    for r in measure(max_seqs, lengths, args.repeats, prefix_caching):
      results.append(r)
      print(f"| {'on' if prefix_caching else 'off'} | {r['J']:>6} | {r['ms_per_step']:.2f} | "
            f"{r['ratio']:.2f}x |", flush=True)
  return results


if __name__ == "__main__":
  main()
