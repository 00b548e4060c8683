"""Shared tiny model and engine helpers of the reliability tests (as tests/paged_jax/test_engine.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.models import ModelConfig, init_random
from paged_jax import allocator
from paged_jax.engine import LLM

EOS = 2
VOCAB = 128


@pytest.fixture(scope="session")
def config():
  return ModelConfig(model_type="llama", vocab_size=VOCAB, embed_dim=64, mlp_dim=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=128,
                     eos_token_ids=(EOS,))


@pytest.fixture(scope="session")
def model(config):
  return init_random(config, seed=0, impl="xla")


def prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, VOCAB, int(n))] for n in lengths]


def make_llm(model, config, **kwargs):
  opts = dict(block_size=4, num_blocks=64, max_seqs=3, max_tokens_per_step=16,
              steps_per_call=8)
  opts.update(kwargs)
  return LLM(model, config, **opts)


def check_all_free(llm):
  allocator.validate(llm.allocator_state)
  assert int(llm.allocator_state.num_free) == llm.spec.num_blocks


def tokens_of(outs):
  return [(o.prompt_index, o.sample_index, o.token_ids, o.finish_reason) for o in outs]


def wrap_call(llm, before=None, after=None):
  """Run ``before(state) -> state`` ahead of, and ``after(old, new)`` behind, every device
  call of ``llm`` (the jitted step loop); returns nothing."""
  inner = llm._call

  def call(params, st, wanted, limit):
    if before is not None:
      st = before(st)
    new = inner(params, st, wanted, limit)
    if after is not None:
      after(st, new)
    return new

  llm._call = call
