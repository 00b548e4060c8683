"""The model of ``own_model.py`` served by ``paged_jax.LLM``.

``LLM(model, config)`` takes any ``flax.nnx.Module`` with ``paged_forward`` and any config
with the five fields: continuous batching, chunked prefill, preemption, prefix caching,
forks, streaming and stats come with it. Here six prompts share a 12-token prefix and the
pool holds 14 blocks of 4 tokens, too few for the four sequences running at once: the
engine preempts (and recomputes) some, reuses the shared prefix's blocks, and every greedy
output (and its log-probabilities) still equals a host loop over the model's dense forward.
Run it: ``python examples/serve_own_model.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # own_model.py beside it
from own_model import TinyGPT, TinyGPTConfig, dense_greedy  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402

# A pool of 14 blocks of 4 tokens, smaller than the model's context (64): its sequences are
# at most 18 + 10 tokens, so max_model_len says how long they may be (else the engine warns
# that the pool caps them at 56).
ENGINE = dict(block_size=4, num_blocks=14, max_seqs=4, max_tokens_per_step=16,
              token_buckets=(16,), steps_per_call=8, max_model_len=32)
PREFIX = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
SUFFIXES = ([1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13], [20, 21, 22, 23, 24, 25],
            [30, 31])
MAX_TOKENS = 10


def main() -> dict:
  config = TinyGPTConfig()
  model = TinyGPT(config, rngs=nnx.Rngs(1))
  llm = LLM(model, config, **ENGINE)
  prompts = [PREFIX + s for s in SUFFIXES]
  params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=True)
  outputs = llm.generate(prompts, params)
  stats = llm.stats
  for prompt, out in zip(prompts, outputs):
    want, want_logprobs = dense_greedy(model, prompt, MAX_TOKENS)
    assert list(out.token_ids) == want, (prompt, out.token_ids, want)
    assert np.allclose(out.logprobs, want_logprobs, atol=1e-4), (out.logprobs, want_logprobs)
    print(f"...{prompt[-4:]} -> {list(out.token_ids)} ({out.finish_reason})")
  print(f"preemptions {stats['preemptions']}, prefix hit rate "
        f"{stats['prefix_hit_rate']:.2f}, peak blocks {stats['peak_blocks_in_use']}"
        f"/{stats['num_blocks']}, {stats['tokens_per_s']:.0f} tokens/s: every output equals "
        "the dense forward's greedy tokens")
  # Streaming: tokens as the engine decides them.
  streamed = [ev.token_id for ev in llm.generate_stream(prompts[:1], params)
              if ev.token_id is not None]
  assert streamed == list(outputs[0].token_ids)
  return dict(outputs=outputs, stats=stats, prompts=prompts, llm=llm, model=model)


if __name__ == "__main__":
  main()
