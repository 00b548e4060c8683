"""Compile time of the jitted decode step at several depths; prints a markdown table.

The decoder scans over stacked layer parameters, so the decode step's program, and its
compile time, should not grow with the number of layers. Each depth builds an abstract
model (``nnx.eval_shape``: no weights are materialised), then times tracing + lowering and
XLA compilation of ``models.steps`` decode step (allocator append + slots, K/V write, paged
attention, logits), with ``jax.clear_caches()`` between runs; the best of ``--repeats`` is
reported. ``--unrolled`` adds the same step with the layer loop unrolled
(``Decoder(scan_unroll=True)``) as a baseline.

    python benchmarks/compile_time.py [--layers 2 8 32] [--impl auto] [--repeats 2] [--unrolled]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.models import Decoder, ModelConfig
from paged_jax import step as steps_lib
from paged_jax import KVCache, allocator


@dataclasses.dataclass(frozen=True)
class Workload:
  """Tiny width; only the depth varies."""

  embed_dim: int = 64
  mlp_dim: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  vocab_size: int = 256
  block_size: int = 16
  num_blocks: int = 64
  max_seqs: int = 8
  max_blocks_per_seq: int = 16


def compile_decode(num_layers: int, w: Workload, impl: str, unroll: bool = False
                   ) -> tuple[float, float]:
  """(trace + lower seconds, compile seconds) of one decode step (layers unrolled or not)."""
  config = ModelConfig(model_type="llama", vocab_size=w.vocab_size, embed_dim=w.embed_dim,
                       mlp_dim=w.mlp_dim, num_layers=num_layers, num_heads=w.num_heads,
                       num_kv_heads=w.num_kv_heads, head_dim=w.head_dim)
  model = nnx.eval_shape(lambda: Decoder(config, impl=impl, scan_unroll=True if unroll else 1,
                                         rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  spec = model.kv_cache_spec(block_size=w.block_size, num_blocks=w.num_blocks)
  cache = jax.eval_shape(lambda: KVCache.create(spec))
  alloc = jax.eval_shape(lambda: allocator.init(w.num_blocks, w.block_size, w.max_seqs,
                                                w.max_blocks_per_seq))
  tokens_S = jax.ShapeDtypeStruct((w.max_seqs,), jnp.int32)
  active_S = jax.ShapeDtypeStruct((w.max_seqs,), jnp.bool_)
  start = time.perf_counter()
  traced = steps_lib._decode_jit.trace(graphdef, params, alloc, cache, tokens_S, active_S,
                                       kwargs=(("impl", impl),))
  lowered = traced.lower()
  lowered_at = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return lowered_at - start, done - lowered_at


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
  parser.add_argument("--impl", default="auto")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--unrolled", action="store_true",
                      help="also time the step with the layers unrolled (baseline)")
  args = parser.parse_args()
  w = Workload()
  print(f"backend={jax.default_backend()} impl={args.impl} width E={w.embed_dim} "
        f"H={w.num_heads} K={w.num_kv_heads} D={w.head_dim} S={w.max_seqs} "
        f"Z={w.block_size} N={w.num_blocks}; best of {args.repeats}\n")
  header = "| layers L | scan: trace + lower (s) | scan: XLA compile (s) | scan: total (s) |"
  rule = "|---:|---:|---:|---:|"
  if args.unrolled:
    header += " unrolled: total (s) |"
    rule += "---:|"
  print(header)
  print(rule)
  best = lambda runs: min(runs, key=sum)
  for num_layers in args.layers:
    runs = []
    for _ in range(args.repeats):
      jax.clear_caches()
      runs.append(compile_decode(num_layers, w, args.impl))
    lower_s, compile_s = best(runs)
    row = f"| {num_layers} | {lower_s:.2f} | {compile_s:.2f} | {lower_s + compile_s:.2f} |"
    if args.unrolled:
      unrolled = []
      for _ in range(args.repeats):
        jax.clear_caches()
        unrolled.append(compile_decode(num_layers, w, args.impl, unroll=True))
      row += f" {sum(best(unrolled)):.2f} |"
    print(row, flush=True)


if __name__ == "__main__":
  main()
