"""Where one engine step's time goes on a long prompt (a random model of SmolLM2-135M's shape).

One ragged step through ``Decoder.paged_forward`` (30 layers, 9/3 heads, D=64, E=576,
I=1536, V=49152, float32): the last ``--rows`` tokens of one sequence at ``--context``
(a prompt's chunk; ``--rows 1`` with ``--tokens 32`` is a decode step in the engine's
smallest bucket), timed three ways, interleaved, best of ``--repeats``:
- ``forward``: the whole step (embedding, 30 layers with K/V writes, last-token logits);
- ``attention x 30``: ``paged_attention`` alone on the same metadata, once per layer;
- ``forward without attention``: the step with attention replaced by its query (the
  matmuls, norms, RoPE, K/V writes and logits).

    python benchmarks/prefill_profile.py                                # chunk 256 at 2048
    python benchmarks/prefill_profile.py --rows 512 --context 4000
    python benchmarks/prefill_profile.py --rows 1 --tokens 32 --context 4000   # decode
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import AttentionMetadata, KVCache, KVCacheSpec, attention  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402

SMOLLM2_135M = ModelConfig(model_type="llama", vocab_size=49152, embed_dim=576, mlp_dim=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           rms_norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
                           tie_word_embeddings=True, eos_token_ids=(2,))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=256, help="query rows of the sequence")
  parser.add_argument("--tokens", type=int, default=None, help="T (default: --rows)")
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  cfg, z, seqs = SMOLLM2_135M, 16, 4
  rows, context = args.rows, args.context
  num_tokens = args.tokens or rows
  model = init_random(cfg, seed=0)
  num_blocks = -(-context // z) + 8
  rng = np.random.default_rng(0)
  spec = KVCacheSpec(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, block_size=z, num_blocks=num_blocks,
                     dtype=jnp.float32)
  shape = KVCache.create(spec).k_pages.shape
  cache = KVCache(k_pages=jnp.asarray(rng.normal(size=shape), jnp.float32),
                  v_pages=jnp.asarray(rng.normal(size=shape), jnp.float32))
  tables = np.full((seqs, num_blocks), -1, np.int32)
  tables[0, :-(-context // z)] = rng.permutation(num_blocks)[:-(-context // z)]
  slots = np.full(num_tokens, -1, np.int32)
  pages = tables[0][np.arange(context - rows, context) // z]
  slots[:rows] = pages * z + np.arange(context - rows, context) % z
  meta = AttentionMetadata(jnp.asarray(slots), jnp.asarray([context, 0, 0, 0], jnp.int32),
                           jnp.asarray(tables), jnp.asarray([0] + [rows] * seqs, jnp.int32),
                           jnp.int32(1))
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, num_tokens), jnp.int32)
  positions = jnp.asarray(np.maximum(0, np.arange(num_tokens) + context - rows), jnp.int32)
  last = jnp.asarray([rows - 1, 0, 0, 0], jnp.int32)
  graphdef, params = nnx.split(model)

  def forward(params, cache):
    return nnx.merge(graphdef, params).paged_forward(tokens, positions, cache, meta,
                                                     logits_indices=last)

  def without_attention(params, cache):
    real = attention.paged_attention
    attention.paged_attention = lambda q, *a, **k: q  # traced only: restored below
    try:
      return forward(params, cache)
    finally:
      attention.paged_attention = real

  def attention_x30(q, cache):
    def body(total, layer):
      out = attention.paged_attention(q, cache, layer, meta.kv_lens_S, meta.block_tables_SP,
                                      meta.cu_q_lens, meta.num_seqs)
      return total + out.sum(), None
    return jax.lax.scan(body, 0.0, jnp.arange(cfg.num_layers))[0]

  q = jnp.asarray(rng.normal(size=(num_tokens, cfg.num_heads, cfg.head_dim)), jnp.float32)
  calls = {
      "forward": (jax.jit(forward), (params, cache)),
      "attention x 30": (jax.jit(attention_x30), (q, cache)),
      "forward without attention": (jax.jit(without_attention), (params, cache)),
  }
  for fn, call_args in calls.values():
    jax.block_until_ready(fn(*call_args))
  best = {name: float("inf") for name in calls}
  names = list(calls)
  for r in range(args.repeats):
    for name in names[r % 3:] + names[:r % 3]:
      fn, call_args = calls[name]
      start = time.perf_counter()
      jax.block_until_ready(fn(*call_args))
      best[name] = min(best[name], time.perf_counter() - start)
  print(f"| rows | T | context | " + " | ".join(f"{n} ms" for n in names) + " |")
  print("|---:|---:|---:|" + "---:|" * len(names))
  print(f"| {rows} | {num_tokens} | {context} | "
        + " | ".join(f"{1e3 * best[n]:.0f}" for n in names) + " |")
  return {name: 1e3 * value for name, value in best.items()}


if __name__ == "__main__":
  main()
