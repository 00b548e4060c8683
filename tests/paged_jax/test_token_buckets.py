"""Token buckets: a step's forward runs in the smallest compiled size holding its tokens."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.models import ModelConfig, init_random
from paged_jax import allocator
from paged_jax.engine import LLM, SamplingParams, default_token_buckets


def test_default_token_buckets_by_hand():
  # First bucket: max(32, S) (a decode row per slot fits); then x4 while below T; then T.
  assert default_token_buckets(16, 3) == (16,)
  assert default_token_buckets(32, 8) == (32,)
  assert default_token_buckets(256, 16) == (32, 128, 256)
  assert default_token_buckets(512, 48) == (48, 192, 512)
  assert default_token_buckets(2048, 8) == (32, 128, 512, 2048)


@pytest.fixture(scope="module")
def tiny():
  config = ModelConfig(model_type="llama", vocab_size=128, embed_dim=64, mlp_dim=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_seq_len=128, eos_token_ids=(2,))
  return init_random(config, seed=0, impl="xla"), config


@pytest.mark.slow
def test_bucketed_steps_give_the_same_tokens(tiny):
  model, config = tiny
  rng = np.random.default_rng(0)
  # Prompts from 3 to 60 tokens: steps of a few decode rows (bucket 8), mixed steps and
  # full prefill chunks (bucket 64) all occur.
  prompts = [[int(t) for t in rng.integers(3, 128, n)] for n in (3, 60, 17, 41, 9, 25)]
  params = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=True)
  opts = dict(block_size=4, num_blocks=96, max_seqs=3, max_tokens_per_step=64,
              steps_per_call=8)
  one = LLM(model, config, token_buckets=(64,), **opts).generate(prompts, params)
  llm = LLM(model, config, token_buckets=(8, 24, 64), **opts)
  three = llm.generate(prompts, params)
  assert [o.token_ids for o in one] == [o.token_ids for o in three]
  for a, b in zip(one, three):
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
  allocator.validate(llm.allocator_state)
  assert sorted(llm._calls) == [8, 24, 64]  # every bucket served some device call


def _pool_copies(model, config, scoring=False):
  """Copy instructions of the pool's shape, of the token history's and its log-probs'
  ([S, J]), or of the logits' ([S, V]: V = J for the built-in models here, 96 for
  own_model.py's), in the compiled device call of an engine (prefix caching on);
  ``scoring``: its prompt log-probs variant."""
  llm = LLM(model, config, block_size=4, num_blocks=97, max_seqs=3, max_tokens_per_step=64,
            steps_per_call=4, scrub_on_release=True, max_traces=1)
  pages = llm._state.cache.k_pages
  shape = lambda x: ",".join(map(str, x.shape))
  big = [f"f32[{shape(pages)}]", f"s32[{shape(llm._state.tokens_SJ)}]",
         f"f32[{shape(llm._state.logprobs_SJ)}]", f"f32[3,{config.vocab_size}]"]
  hlo = llm._call_for(64, scoring).lower(llm._params, llm._state, jnp.int32(0),
                                         jnp.int32(8)).compile().as_text()
  assert all(x in hlo for x in big)
  return [line for line in hlo.splitlines() for x in big
          if re.search(re.escape(x) + r"\{[^}]*\} copy\(", line)]


def _own_gpt(num_layers):
  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location(
      "own_model_for_copies", os.path.join(here, "examples", "own_model.py"))
  own_model = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = own_model  # its dataclasses look their module up there
  spec.loader.exec_module(own_model)
  config = own_model.TinyGPTConfig(max_seq_len=128, num_layers=num_layers)
  return own_model.TinyGPT(config, rngs=nnx.Rngs(0)), config


@pytest.mark.parametrize("model_kind", [
    "built-in, 2 layers", pytest.param("built-in, 1 layer", marks=pytest.mark.slow),
    pytest.param("own_model.py, 2 layers", marks=pytest.mark.slow)])
def test_device_call_never_copies_the_pool(tiny, model_kind):
  # A pool passed through a lax.switch / cond branch is copied by XLA on every step (the
  # first token-bucket design had 6 pool-sized copies per step). The compiled device call,
  # scrub on release included (it zeroes blocks under a cond), must update the pool in
  # place: no copy instruction of the pool's shape. A decoder whose last attention is no
  # step of a loop over layers (1 layer, or layers unrolled as examples/own_model.py runs
  # them) had 6: the fork, which writes the pool, could run before that attention read it.
  # The token history [S, J] was copied twice a step with prefix caching on (every model):
  # the sampled tokens' write could run before the prefix registration's read. The logits
  # [S, V] were copied into a cond that adjusted them (penalties, min_tokens).
  if model_kind == "built-in, 2 layers":
    model, config = tiny
  elif model_kind == "built-in, 1 layer":
    config = dataclasses.replace(tiny[1], num_layers=1)
    model = init_random(config, seed=0, impl="xla")
  else:
    model, config = _own_gpt(2)
  copies = _pool_copies(model, config)
  assert not copies, copies[:3]


def test_the_scoring_device_call_never_copies_the_pool(tiny):
  # The prompt log-probs variant (every row's logits, a cond that ranks them) too.
  copies = _pool_copies(*tiny, scoring=True)
  assert not copies, copies[:3]


@pytest.mark.parametrize("bad", [(), (8, 4, 64), (8, 32), (0, 64), (8.0, 64), "64", (8, 8, 64)])
def test_token_buckets_are_validated(tiny, bad):
  model, config = tiny
  with pytest.raises(ValueError, match=r"token_buckets=.* must be increasing ints >= 1 "
                                       r"ending at max_tokens_per_step=64"):
    LLM(model, config, block_size=4, num_blocks=96, max_seqs=3, max_tokens_per_step=64,
        token_buckets=bad)
