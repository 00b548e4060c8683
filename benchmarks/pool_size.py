"""Cost against pool size: a call must cost the tokens it touches, never the pool it sits in.

For float32 and bfloat16 pools of 1k, 8k and 32k blocks (2 layers, 2 KV heads, head dim 32,
blocks of 16 tokens; the 32k bfloat16 pool is 268 MB), times under ``jit``:
- attention: ``paged_attention(impl="xla")`` of 8 decode rows over 8 sequences of 40 tokens;
- write: a donated ``cache.write`` of 8 tokens;
- copy: a donated ``cache.copy_blocks`` of 4 blocks;
- engine: ``LLM`` tokens/s on 8 requests (prompts of 24 tokens, 32 new tokens each), every
  device-call shape compiled before the clock starts;
- allocator: ``lookup`` of 8 sequences against a prefix cache holding their blocks (each
  admission), ``register`` of 8 sequences' first full blocks (registration walks the cache),
  and a decode step's ``append`` (one token each, no block boundary crossed).
The same blocks are touched at every pool size (the sequences' blocks are spread over the
pool). Each figure is the median of ``rounds`` interleaved rounds; the last column of each
table is largest / smallest pool (goal <= 1.5x).

    python benchmarks/pool_size.py            # writes pool_size_RESULTS_section.md
    python benchmarks/pool_size.py --quick    # seconds; never writes
    python benchmarks/pool_size.py --own-model  # the engine rows alone, serving
                                                # examples/own_model.py's TinyGPT (its
                                                # layers unrolled); prints, never writes
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import (LLM, KVCache, KVCacheSpec, SamplingParams, allocator,  # noqa: E402
                       paged_attention)
from paged_jax.models import ModelConfig, init_random  # noqa: E402
from benchmarks.throughput import machine  # noqa: E402

RESULTS_PATH = pathlib.Path(__file__).with_name("pool_size_RESULTS_section.md")
LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 32, 16
SEQS, CONTEXT = 8, 40
MODEL = dict(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256,
             num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
             max_seq_len=512, bos_token_id=1, eos_token_ids=(2,))


def _spec(num_blocks, dtype):
  return KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     block_size=BLOCK, num_blocks=num_blocks, dtype=dtype)


def _median_ms(fn, rounds):
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


class Case:
  """One pool: its cache and the jitted calls, the touched blocks spread over the pool."""

  def __init__(self, num_blocks, dtype):
    self.dtype = dtype
    rng = np.random.default_rng(0)
    pages = -(-CONTEXT // BLOCK)
    blocks = rng.choice(num_blocks, SEQS * pages, replace=False).astype(np.int32)
    self.tables = jnp.asarray(blocks.reshape(SEQS, pages))
    self.kv_lens = jnp.full((SEQS,), CONTEXT, jnp.int32)
    self.cu = jnp.arange(SEQS + 1, dtype=jnp.int32)
    self.q = jnp.asarray(rng.normal(size=(SEQS, HEADS, HEAD_DIM)), dtype)
    self.k = jnp.asarray(rng.normal(size=(SEQS, KV_HEADS, HEAD_DIM)), dtype)
    self.slots = jnp.asarray(blocks[::pages] * BLOCK + 3, jnp.int32)
    self.src, self.dst = jnp.asarray(blocks[:4]), jnp.asarray(blocks[4:8])
    self.cache = KVCache.create(_spec(num_blocks, dtype))
    self.attend = jax.jit(lambda c, q: paged_attention(
        q, c, 1, self.kv_lens, self.tables, self.cu, jnp.int32(SEQS), impl="xla"))
    self.write = jax.jit(lambda c, k: c.write(0, k, k, self.slots), donate_argnums=0)
    self.copy = jax.jit(lambda c: c.copy_blocks(self.src, self.dst), donate_argnums=0)

  def run_attention(self):
    return self.attend(self.cache, self.q)

  def run_write(self):
    self.cache = self.write(self.cache, self.k)
    return self.cache.k_bits

  def run_copy(self):
    self.cache = self.copy(self.cache)
    return self.cache.k_bits


class AllocatorCase:
  """One allocator over the pool: 8 sequences of 40 tokens, their full blocks registered in
  the prefix cache; each call jitted, on the same state every time (nothing donated)."""

  def __init__(self, num_blocks):
    pages = -(-CONTEXT // BLOCK)
    state = allocator.init(num_blocks, BLOCK, SEQS, 2 * pages)
    state, _ = allocator.append(state, jnp.full((SEQS,), CONTEXT, jnp.int32))
    rng = np.random.default_rng(0)
    self.tokens = jnp.asarray(rng.integers(3, 256, (SEQS, 2 * CONTEXT)), jnp.int32)
    self.state = jax.jit(allocator.register)(state, self.tokens)
    # The same sequences before any registration: registering them walks the cache.
    self.fresh = state
    self.lookup_fn = jax.jit(allocator.lookup)
    self.register_fn = jax.jit(allocator.register)
    self.append_fn = jax.jit(allocator.append)

  def run_lookup(self):  # admission: the longest cached prefix of each sequence
    return self.lookup_fn(self.state, self.tokens, jnp.full((SEQS,), CONTEXT, jnp.int32))

  def run_register(self):  # each sequence's first full blocks: registration walks the cache
    return self.register_fn(self.fresh, self.tokens).depth_N

  def run_append(self):  # a decode step: one token each, no block boundary crossed
    return self.append_fn(self.state, jnp.ones((SEQS,), jnp.int32))[1]


def _interleaved(cases, name, rounds, calls=1):
  """{size: median ms}: each pool size measured in turn in every round (noise hits all
  alike), after one compile-and-warm-up call each."""
  for case in cases.values():
    jax.block_until_ready(getattr(case, f"run_{name}")())
  per = {n: [] for n in cases}
  for _ in range(rounds):
    for n, case in cases.items():
      per[n].append(_median_ms(getattr(case, f"run_{name}"), calls))
  return {n: statistics.median(v) for n, v in per.items()}


def _own_model():
  """examples/own_model.py's TinyGPT (2 layers run in a Python loop, 2 heads of 16) and its
  config: a model whose last attention is no step of a scan over layers."""
  examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
  if examples not in sys.path:  # called once per pool dtype
    sys.path.insert(0, examples)
  import own_model  # noqa: E402  (examples/ is no package)
  from flax import nnx
  config = own_model.TinyGPTConfig(vocab_size=256, max_seq_len=64)
  return own_model.TinyGPT(config, rngs=nnx.Rngs(0)), config


def engine_tokens_per_s(sizes, dtype, rounds, quick, own_model=False):
  """{num_blocks: median tokens/s}: one engine per pool size, rounds interleaved (each size
  served in turn, so the machine's noise hits all alike)."""
  if own_model:
    model, config = _own_model()
  else:
    config = ModelConfig(**MODEL)
    model = init_random(config, seed=0, dtype=jnp.float32)
  llms = {}
  for n in sizes:
    llms[n] = LLM(model, config, num_blocks=n, block_size=BLOCK, max_seqs=8,
                  max_tokens_per_step=64, kv_cache_dtype=dtype, compilation_cache=False)
    llms[n].precompile()
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 256, 24)] for _ in range(8)]
  params = SamplingParams(max_tokens=8 if quick else 32, ignore_eos=True)
  rates = {n: [] for n in sizes}
  for _ in range(rounds):
    for n, llm in llms.items():
      llm.reset_stats()
      llm.generate(prompts, params)
      rates[n].append(llm.stats["tokens_per_s"])
  return {n: statistics.median(v) for n, v in rates.items()}


def _table(rows, sizes):
  """(markdown table, worst largest / smallest ratio) of ``{(what, dtype): {size: value}}``."""
  header = ("| what | pool dtype | " + " | ".join(f"{n} blocks" for n in sizes)
            + " | largest / smallest |")
  lines = [header, "|" + "---|" * (len(sizes) + 3)]
  worst = 0.0
  for (name, dtype), by_size in rows.items():
    first, last = by_size[sizes[0]], by_size[sizes[-1]]
    ratio = first / last if name.startswith("engine") else last / first
    worst = max(worst, ratio)
    unit = "" if name.startswith("engine") else " ms"
    lines.append(f"| {name} | {dtype} | " + " | ".join(
        f"{by_size[n]:.{1 if name.startswith('engine') else 3}f}{unit}" for n in sizes)
        + f" | {ratio:.2f}x |")
  return "\n".join(lines), worst


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny pools, few rounds; no file")
  parser.add_argument("--rounds", type=int, default=None, help="rounds per figure (default 7)")
  parser.add_argument("--own-model", action="store_true",
                      help="only the engine rows, serving examples/own_model.py; no file")
  args = parser.parse_args(argv)
  sizes = (256, 1024) if args.quick else (1024, 8192, 32768)
  rounds = args.rounds or (2 if args.quick else 7)
  dtypes = (jnp.float32, jnp.bfloat16)
  rows = {}
  if args.own_model:
    for dtype in dtypes:
      rows[("engine tokens/s, own_model.py", jnp.dtype(dtype).name)] = engine_tokens_per_s(
          sizes, dtype, rounds, args.quick, own_model=True)
    table, worst = _table(rows, sizes)
    print(table)
    print(f"worst growth largest / smallest pool: {worst:.2f}x (goal <= 1.5x)")
    return 0
  for dtype in dtypes:
    cases = {n: Case(n, dtype) for n in sizes}
    for name in ("attention", "write", "copy"):
      rows[(name, jnp.dtype(dtype).name)] = _interleaved(cases, name, rounds)
    del cases
    rows[("engine tokens/s", jnp.dtype(dtype).name)] = engine_tokens_per_s(
        sizes, dtype, rounds, args.quick)
  table, worst = _table(rows, sizes)
  print(table)
  print(f"worst growth largest / smallest pool: {worst:.2f}x (goal <= 1.5x)")
  # The allocator's own calls, apart: each is one O(N) pass or a few (no sort); alone and
  # not donated they also allocate their N-sized outputs, so they grow with the pool, but
  # by tenths of a millisecond at 32k blocks (the engine rows above include them).
  cases = {n: AllocatorCase(n) for n in sizes}
  alloc_rows = {(f"allocator {name}", "any"): _interleaved(cases, name, rounds, calls=20)
                for name in ("lookup", "register", "append")}
  del cases
  alloc_table, _ = _table(alloc_rows, sizes)
  print(alloc_table)
  if not args.quick:
    command = "python benchmarks/pool_size.py"
    RESULTS_PATH.write_text(
        f"## Cost against pool size\n\nCommand: `{command}`\n\nMachine: {machine()}.\n\n"
        f"{table}\n\nWorst growth from the smallest to the largest pool: {worst:.2f}x "
        "(engine: smallest / largest tokens/s; the others: largest / smallest time).\n\n"
        f"The allocator's calls alone (jitted, not donated, median of 20 calls):\n\n"
        f"{alloc_table}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
