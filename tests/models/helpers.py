"""Tiny configs and checkpoint writers shared by the model tests."""

from __future__ import annotations

import json
import os

import numpy as np

from paged_jax.models.config import ModelConfig

VOCAB = 128
WIDTH = 64


def hf_config_dict(model_type: str = "llama", **overrides) -> dict:
  """A tiny config.json dict: 2 layers, width 64, 4 query heads, 2 KV heads, head dim 16."""
  d = {
      "model_type": model_type,
      "vocab_size": VOCAB,
      "hidden_size": WIDTH,
      "intermediate_size": 96,
      "num_hidden_layers": 2,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
      "head_dim": 16,
      "hidden_act": "silu",
      "rms_norm_eps": 1e-6,
      "max_position_embeddings": 256,
      "rope_theta": 10000.0,
      "tie_word_embeddings": False,
      "bos_token_id": 1,
      "eos_token_id": 2,
  }
  if model_type == "mistral":
    d["sliding_window"] = None
  if model_type == "qwen2":
    d.update(use_sliding_window=False, sliding_window=None)
  d.update(overrides)
  return d


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
  return ModelConfig.from_hf_dict(hf_config_dict(model_type, **overrides))


def hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors with the Hugging Face names and shapes of ``config``."""
  rng = np.random.default_rng(seed)
  c = config
  e, i, v, h, k, d = (c.embed_dim, c.mlp_dim, c.vocab_size, c.num_heads, c.num_kv_heads,
                      c.head_dim)
  w = lambda *shape: (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
  out = {"model.embed_tokens.weight": rng.standard_normal((v, e)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)}
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = w(v, e)
  for layer in range(c.num_layers):
    p = f"model.layers.{layer}."
    out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    out[p + "post_attention_layernorm.weight"] = (
        1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    out[p + "self_attn.q_proj.weight"] = w(h * d, e)
    out[p + "self_attn.k_proj.weight"] = w(k * d, e)
    out[p + "self_attn.v_proj.weight"] = w(k * d, e)
    out[p + "self_attn.o_proj.weight"] = w(e, h * d)
    if c.qkv_bias:
      for name, n in (("q", h * d), ("k", k * d), ("v", k * d)):
        out[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(
            np.float32)
    out[p + "mlp.gate_proj.weight"] = w(i, e)
    out[p + "mlp.up_proj.weight"] = w(i, e)
    out[p + "mlp.down_proj.weight"] = w(e, i)
  return out


def write_numpy_checkpoint(path, hf_dict: dict, tensors: dict[str, np.ndarray], *,
                           shards: int = 1) -> None:
  """A checkpoint directory without torch: config.json + safetensors (sharded if shards > 1)."""
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_dict, f)
  if shards == 1:
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, os.path.join(path, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def randomize_torch_model(model, seed: int = 0) -> None:
  """Re-draw an HF model's weights at O(1) scale so the parity test is sensitive.

  transformers initialises with std 0.02, which makes every tiny model's logits almost
  uniform; here matrices get N(0, 1 / fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2).
  """
  import torch

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)
