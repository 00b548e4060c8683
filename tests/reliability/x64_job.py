"""The engine's outputs for ``test_x64.py``: run as ``python -m tests.reliability.x64_job``
(with ``JAX_ENABLE_X64=1`` in the environment, or without), prints one JSON line."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.models import ModelConfig, init_random


def outputs() -> dict:
  """Token ids of a small workload on three engines: a pool small enough to preempt, with
  forks (n = 2) and prefix hits; an int8 pool; a sliding / full model in KV groups."""
  common = dict(vocab_size=128, embed_dim=64, mlp_dim=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, max_seq_len=128, eos_token_ids=(2,))
  llama = ModelConfig(model_type="llama", **common)
  hybrid = ModelConfig(model_type="gemma2", sliding_window=6,
                       layer_types=("sliding_attention", "full_attention"), **common)
  rng = np.random.default_rng(0)
  shared = [int(t) for t in rng.integers(3, 128, 10)]
  prompts = [shared + [int(t) for t in rng.integers(3, 128, n)] for n in (3, 9, 14, 5)]
  params = [SamplingParams(max_tokens=8, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, n=2),
            SamplingParams(max_tokens=9, ignore_eos=True, logprobs=True),
            SamplingParams(max_tokens=5, top_k=5, temperature=1.0, seed=4)]
  engines = {"small pool": (llama, dict(num_blocks=10)),
             "int8": (llama, dict(num_blocks=40, kv_cache_dtype=jnp.int8)),
             "kv groups": (hybrid, dict(kv_budget_bytes=2 * 2 * 16 * 4 * 4 * 60))}
  out = {}
  for name, (config, options) in engines.items():
    llm = LLM(init_random(config, seed=0, impl="xla"), config, block_size=4, max_seqs=3,
              max_tokens_per_step=16, token_buckets=(16,), **options)
    done = llm.generate(prompts, params)
    out[name] = dict(tokens=[list(o.token_ids) for o in done],
                     free=llm.stats["num_free_blocks"] == llm.stats["num_blocks"],
                     preemptions=llm.stats["preemptions"])
  return out


if __name__ == "__main__":
  print(json.dumps(outputs()))
