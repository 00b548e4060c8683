"""Logits parity with Hugging Face transformers (PyTorch CPU), float32, 1e-4 relative.

Each test builds a tiny random HF model, re-draws its weights at O(1) scale (transformers'
std-0.02 init makes logits nearly uniform, which would hide mistakes), saves it with
``save_pretrained`` (one of them sharded), loads it back with ``models.load_pretrained`` (no
torch inside) and compares the dense forward. Cases: plain Llama; Llama-3 rope scaling with
attention biases, sharded; Mistral; Qwen2 with tied embeddings (both with an
``attention_bias`` key their transformers classes ignore). The plain Llama case also
runs the paged forward through the allocator-backed prefill step.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax import models  # noqa: E402
from paged_jax import KVCache, allocator  # noqa: E402
from tests.models import helpers  # noqa: E402

RTOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama": dict(model_type="llama"),
    # Also Llama's attention_bias (q, k, v and o biases).
    "llama3_rope_bias_sharded": dict(model_type="llama", rope_scaling=LLAMA3_ROPE,
                                     rope_theta=500000.0, attention_bias=True),
    # attention_bias=True in their config.json: transformers' Mistral (no biases) and Qwen2
    # (q/k/v biases, none on o) ignore it; load_pretrained asked for the o/k bias tensors.
    "mistral": dict(model_type="mistral", attention_bias=True),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True, attention_bias=True),
}


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _save_hf_model(path, case: str, seed: int = 0):
  kwargs = dict(CASES[case])
  model_type = kwargs.pop("model_type")
  hf_dict = helpers.hf_config_dict(model_type, **kwargs)
  del hf_dict["model_type"]
  torch.manual_seed(seed)
  config = transformers.AutoConfig.for_model(model_type, **hf_dict)
  model = transformers.AutoModelForCausalLM.from_config(
      config, attn_implementation="eager", dtype=torch.float32)
  helpers.randomize_torch_model(model, seed)
  if config.tie_word_embeddings:
    model.tie_weights()
  model.eval()
  shard = "20KB" if case.endswith("sharded") else "100MB"
  model.save_pretrained(path, max_shard_size=shard)
  return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_logits_match_transformers(tmp_path, case):
  hf_model = _save_hf_model(tmp_path, case)
  files = os.listdir(tmp_path)
  if case.endswith("sharded"):
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
  tokens_BT = np.random.default_rng(1).integers(0, helpers.VOCAB, (2, 24), dtype=np.int32)
  with torch.no_grad():
    want = hf_model(torch.from_numpy(tokens_BT).long()).logits.numpy()

  model, config = models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert config.model_type == CASES[case]["model_type"]
  if case == "llama3_rope_bias_sharded":
    assert config.rope_scaling == models.RopeScaling(8.0, 1.0, 4.0, 16)
    assert config.qkv_bias and config.o_bias
  if case == "qwen2_tied":
    assert config.tie_word_embeddings and config.qkv_bias and model.lm_head_EV is None
  got = model(jnp.asarray(tokens_BT))
  assert got.shape == want.shape
  assert _relative_error(got, want) < RTOL


def test_paged_prefill_matches_transformers(tmp_path):
  hf_model = _save_hf_model(tmp_path, "llama")
  prompts = [[5, 17, 99, 3, 64, 8, 21], [7, 7, 120, 1]]
  model, _ = models.load_pretrained(tmp_path, dtype=jnp.float32, impl="xla")
  alloc = allocator.init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  cache = KVCache.create(model.kv_cache_spec(block_size=4, num_blocks=8))
  tokens_T = jnp.asarray(prompts[0] + prompts[1] + [0] * 5, jnp.int32)
  num_new_S = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits_SV, alloc, cache, ok_S = models.Steps(model).prefill(alloc, cache, tokens_T, num_new_S)
  assert bool(ok_S.all())
  for s, prompt in enumerate(prompts):
    with torch.no_grad():
      want = hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
    assert _relative_error(logits_SV[s], want) < RTOL


def test_bf16_checkpoint_loads_exact_values(tmp_path):
  hf_model = _save_hf_model(tmp_path, "llama")
  hf_model.to(torch.bfloat16).save_pretrained(tmp_path)
  model, config = models.load_pretrained(tmp_path)  # the checkpoint's dtype by default
  assert model.embed_VE[...].dtype == jnp.bfloat16
  assert config.checkpoint_dtype == "bfloat16"
  want = hf_model.model.embed_tokens.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(model.embed_VE[...], np.float32), want)
  # q_proj [H * D, E] -> [E, H, D] at layer 1.
  q = hf_model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
  got = np.asarray(model.layers.attn.q_EHD[...][1], np.float32)
  np.testing.assert_array_equal(got, q.T.reshape(helpers.WIDTH, 4, 16))
