"""Runs on 2 CPU devices (``python -m tests.sharding._run_gpt_oss``): a tiny random gpt-oss
decoder served over a (1 data x 2 model) mesh, which splits its query / KV heads and sinks
and every expert's I columns; prints one JSON line with the engine's greedy tokens and
log-probs and, for the same prompt + generated sequences, the one-device dense forward's
argmax and log-probs at each generated position (teacher forcing: greedy decoding agrees
with it token for token). ``test_gpt_oss_sharding.py`` compares them."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=2"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from paged_jax import LLM, SamplingParams, models  # noqa: E402

HF = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
          max_position_embeddings=256)


def main() -> None:
  config = models.ModelConfig.from_hf_dict(HF)
  model = models.init_random(config, impl="xla")
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (9, 5, 13)]
  params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
  options = dict(block_size=4, num_blocks=32, max_seqs=4, max_tokens_per_step=16,
                 token_buckets=(16,), compilation_cache=False)
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
  outs = LLM(model, config, **options, mesh=mesh).generate(prompts, params)
  result = {"tokens": [list(o.token_ids) for o in outs],
            "logprobs": [list(o.logprobs) for o in outs]}
  # One dense batch: each sequence padded at its end (causal, so padding changes nothing
  # before it); position j's logits predict token j + 1.
  full = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
  width = max(len(f) for f in full)
  tokens_BT = np.zeros((len(full), width), np.int32)
  for b, f in enumerate(full):
    tokens_BT[b, :len(f)] = f
  log_probs = jax.nn.log_softmax(model(jnp.asarray(tokens_BT)).astype(jnp.float32), axis=-1)
  log_probs = np.asarray(log_probs)
  dense_tokens, dense_logprobs = [], []
  for b, (p, f) in enumerate(zip(prompts, full)):
    rows = log_probs[b, len(p) - 1:len(f) - 1]
    dense_tokens.append([int(t) for t in rows.argmax(-1)])
    dense_logprobs.append([float(rows[j, f[len(p) + j]]) for j in range(len(rows))])
  result["dense"] = {"tokens": dense_tokens, "logprobs": dense_logprobs}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
