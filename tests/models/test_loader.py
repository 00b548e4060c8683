"""``load_pretrained`` without torch: round trip of numpy-written checkpoints, and errors."""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax
from paged_jax import models
from tests.models import helpers

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _checkpoint(path, model_type="llama", shards=1, **overrides):
  hf = helpers.hf_config_dict(model_type, **overrides)
  tensors = helpers.hf_tensors(models.ModelConfig.from_hf_dict(hf))
  helpers.write_numpy_checkpoint(path, hf, tensors, shards=shards)
  return hf, tensors


@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip_places_every_tensor(tmp_path, shards):
  _, tensors = _checkpoint(tmp_path, "qwen2", shards=shards)
  model, config = models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert config.qkv_bias and not config.o_bias
  e, h, k, d = 64, 4, 2, 16
  np.testing.assert_array_equal(model.embed_VE[...], tensors["model.embed_tokens.weight"])
  np.testing.assert_array_equal(model.lm_head_EV[...], tensors["lm_head.weight"].T)
  np.testing.assert_array_equal(model.final_norm.scale_E[...], tensors["model.norm.weight"])
  for layer in range(2):
    p = f"model.layers.{layer}."
    np.testing.assert_array_equal(model.layers.attn.k_EKD[...][layer],
                                  tensors[p + "self_attn.k_proj.weight"].T.reshape(e, k, d))
    np.testing.assert_array_equal(model.layers.attn.o_HDE[...][layer],
                                  tensors[p + "self_attn.o_proj.weight"].T.reshape(h, d, e))
    np.testing.assert_array_equal(model.layers.attn.q_bias_HD[...][layer],
                                  tensors[p + "self_attn.q_proj.bias"].reshape(h, d))
    np.testing.assert_array_equal(model.layers.mlp.down_IE[...][layer],
                                  tensors[p + "mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(model.layers.mlp_norm.scale_E[...][layer],
                                  tensors[p + "post_attention_layernorm.weight"])


def test_bfloat16_target_dtype(tmp_path):
  _, tensors = _checkpoint(tmp_path)
  model, _ = models.load_pretrained(tmp_path, dtype=jnp.bfloat16)
  assert model.layers.attn.q_EHD[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(model.embed_VE[...]),
      tensors["model.embed_tokens.weight"].astype(jnp.bfloat16))
  # The bf16 model runs and tracks the float32 one.
  model32, _ = models.load_pretrained(tmp_path, dtype=jnp.float32)
  tokens_BT = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
  logits16, logits32 = model(tokens_BT), model32(tokens_BT)
  assert logits16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(logits16, np.float32) - np.asarray(logits32))
  assert err.max() / np.abs(np.asarray(logits32)).max() < 5e-2


def test_sharding_callback_places_each_parameter(tmp_path):
  _checkpoint(tmp_path)
  device = jax.devices()[0]
  seen = []

  def sharding(path, shape):
    seen.append((path, shape))
    return jax.sharding.SingleDeviceSharding(device)

  model, _ = models.load_pretrained(tmp_path, dtype=jnp.float32, sharding=sharding)
  assert (("layers", "attn", "q_EHD"), (2, 64, 4, 16)) in seen
  assert (("embed_VE",), (helpers.VOCAB, helpers.WIDTH)) in seen
  assert model.embed_VE[...].sharding == jax.sharding.SingleDeviceSharding(device)


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    models.load_pretrained(tmp_path / "nowhere")
  # Bad input, as every argument the library refuses: a ValueError too, naming the path.
  with pytest.raises(ValueError, match=r"path='.*nowhere': checkpoint directory does not"):
    models.load_pretrained(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=r"path='.*nowhere': checkpoint directory does not"):
    paged_jax.LLM.from_pretrained(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=r"path='.*config\.json': config file does not exist"):
    models.ModelConfig.from_json(tmp_path)
  assert paged_jax.CheckpointNotFoundError is models.CheckpointNotFoundError
  # A Hub id is not downloaded; a GGUF file is not read; each message says so.
  with pytest.raises(ValueError, match=r"path='HuggingFaceTB/SmolLM2-135M': checkpoint "
                     r"directory does not exist \(if it is a Hugging Face Hub id: nothing is "
                     r"downloaded"):
    models.load_pretrained("HuggingFaceTB/SmolLM2-135M")
  (tmp_path / "model.gguf").write_bytes(b"GGUF")
  with pytest.raises(ValueError, match=r"is a file: .* \(GGUF files are not read"):
    models.load_pretrained(tmp_path / "model.gguf")


def test_a_path_from_the_home_directory_is_expanded(tmp_path, monkeypatch):
  # "~/ckpt" was looked up literally, as a folder named "~" (transformers expands it).
  _checkpoint(tmp_path / "ckpt")
  monkeypatch.setenv("HOME", str(tmp_path))
  _, config = models.load_pretrained("~/ckpt", dtype=jnp.float32)
  assert config == models.ModelConfig.from_json("~/ckpt")


def test_missing_config(tmp_path):
  _checkpoint(tmp_path)
  os.remove(tmp_path / "config.json")
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.load_pretrained(tmp_path)


def test_missing_safetensors(tmp_path):
  _checkpoint(tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    models.load_pretrained(tmp_path)
  # A directory of PyTorch pickles only: the message says so and what to do.
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"it holds pytorch_model\.bin: PyTorch pickles "
                     r"are not read \(no torch\), save the model with safe_serialization"):
    models.load_pretrained(tmp_path)


def test_missing_shard(tmp_path):
  _checkpoint(tmp_path, shards=2)
  os.remove(tmp_path / "model-00002-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    models.load_pretrained(tmp_path)


def test_unsupported_model_type(tmp_path):
  hf, tensors = _checkpoint(tmp_path)
  hf["model_type"] = "gpt2"
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  with pytest.raises(ValueError, match="model_type='gpt2'"):
    models.load_pretrained(tmp_path)


def test_a_dtype_that_is_not_a_model_float_is_refused(tmp_path):
  # int8 weights would only fail later, deep in attention ("q.dtype=int8 must be a
  # floating dtype"); a quantised KV pool is the engine's kv_cache_dtype.
  _checkpoint(tmp_path)
  for dtype, shown in ((jnp.int8, "int8"), ("int8", "int8"), ("fp8", "'fp8'"),
                       (jnp.float64, "float64")):
    with pytest.raises(ValueError, match=rf"dtype={shown} must be the model's float dtype.*"
                                         "kv_cache_dtype"):
      models.load_pretrained(tmp_path, dtype=dtype)
  # A torch dtype (a transformers user's habit) names the same float: taken, by its name.
  torch = pytest.importorskip("torch")
  model, _ = models.load_pretrained(tmp_path, dtype=torch.bfloat16)
  assert model.embed_VE[...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"dtype=int8 must be the model's float dtype"):
    models.load_pretrained(tmp_path, dtype=torch.int8)


def test_missing_tensor_is_named(tmp_path):
  hf, tensors = _checkpoint(tmp_path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    models.load_pretrained(tmp_path)


def test_missing_lm_head_when_untied(tmp_path):
  hf, tensors = _checkpoint(tmp_path)
  del tensors["lm_head.weight"]
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors)
  with pytest.raises(ValueError, match=r"lm_head\.weight"):
    models.load_pretrained(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
  hf, tensors = _checkpoint(tmp_path, shards=2)
  # k_proj [K * D, E] = [32, 64]; written transposed.
  name = "model.layers.0.self_attn.k_proj.weight"
  tensors[name] = np.ascontiguousarray(tensors[name].T)
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors, shards=2)
  with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight.*\(64, 32\).*\(32, 64\)"):
    models.load_pretrained(tmp_path)


def test_tensors_the_model_does_not_take_are_named_in_a_warning(tmp_path):
  # A checkpoint with a third layer under a config of two (a config from another size of
  # the model): transformers warns that those weights were not used; so do we, by name.
  hf, tensors = _checkpoint(tmp_path)
  extra = {name.replace("layers.1.", "layers.2."): value for name, value in tensors.items()
           if "layers.1." in name}
  helpers.write_numpy_checkpoint(tmp_path, hf, {**tensors, **extra}, shards=2)
  with pytest.warns(UserWarning, match=r"9 tensor\(s\) .* not loaded: "
                                       r"'model\.layers\.2\..*and 4 more"):
    models.load_pretrained(tmp_path)
  # RoPE frequencies saved as buffers by older exports are recomputed, as transformers
  # does: no warning for them, and none for a checkpoint that holds exactly the model.
  inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)
              for i in range(2)}
  helpers.write_numpy_checkpoint(tmp_path / "buffers", hf, {**tensors, **inv_freq})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    models.load_pretrained(tmp_path / "buffers")


def test_tied_checkpoint_with_its_own_lm_head(tmp_path):
  # tie_word_embeddings with an lm_head.weight equal to the embeddings: tied (one copy).
  hf, tensors = _checkpoint(tmp_path, tie_word_embeddings=True)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors)
  model, config = models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert config.tie_word_embeddings and model.lm_head_EV is None
  # A different one: transformers (5.x) warns "both are present with different values, so
  # we will NOT tie them" and projects with lm_head; so do we (tying changed every logit).
  tensors["lm_head.weight"] = np.zeros((helpers.VOCAB, helpers.WIDTH), np.float32)
  tensors["lm_head.weight"][3] = 1.0
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors)
  model, config = models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert not config.tie_word_embeddings
  np.testing.assert_array_equal(model.lm_head_EV[...], tensors["lm_head.weight"].T)
  logits = np.asarray(model(jnp.array([[5, 9, 2]], jnp.int32)))
  assert (logits[..., 3] != 0).all() and (np.delete(logits, 3, axis=-1) == 0).all()


def test_generation_config_eos_ids_are_the_ones_generation_stops_at(tmp_path):
  # Chat checkpoints list their end-of-turn ids in generation_config.json (Llama 3
  # Instruct: 128001, 128008, 128009 against config.json's 128001); transformers' generate
  # stops at those, so the engine must too. Without the file, or without the key in it,
  # config.json's ids hold.
  hf, _ = _checkpoint(tmp_path, eos_token_id=2)
  assert models.ModelConfig.from_json(tmp_path).eos_token_ids == (2,)
  gen = tmp_path / "generation_config.json"
  gen.write_text(json.dumps({"do_sample": False}))
  assert models.ModelConfig.from_json(tmp_path).eos_token_ids == (2,)
  gen.write_text(json.dumps({"eos_token_id": [2, 19], "bos_token_id": 1}))
  _, config = models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert config.eos_token_ids == (2, 19)
  gen.write_text(json.dumps({"eos_token_id": 7}))
  assert models.ModelConfig.from_json(tmp_path / "config.json").eos_token_ids == (7,)
  gen.write_text("{not json")
  with pytest.raises(ValueError, match="generation_config.json.*not valid JSON"):
    models.ModelConfig.from_json(tmp_path)
  gen.write_text("[1, 2]")
  with pytest.raises(ValueError, match="generation_config.json.*JSON object"):
    models.ModelConfig.from_json(tmp_path)


def test_a_base_model_checkpoint_loads_as_transformers_causal_lm_does(tmp_path):
  # LlamaModel.save_pretrained writes the decoder's tensors without "model." and no
  # lm_head; transformers' LlamaForCausalLM loads it (tied: the embeddings are the head).
  # It was refused as "tensor 'model.embed_tokens.weight' is missing".
  hf, tensors = _checkpoint(tmp_path / "full", tie_word_embeddings=True)
  assert "lm_head.weight" not in tensors
  base = {name[len("model."):]: value for name, value in tensors.items()}
  helpers.write_numpy_checkpoint(tmp_path / "base", hf, base)
  model, _ = models.load_pretrained(tmp_path / "base", dtype=jnp.float32)
  full, _ = models.load_pretrained(tmp_path / "full", dtype=jnp.float32)
  tokens_BT = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
  np.testing.assert_array_equal(model(tokens_BT), full(tokens_BT))
  # Untied, a base checkpoint has no head to load: refused, saying why.
  helpers.write_numpy_checkpoint(tmp_path / "base", dict(hf, tie_word_embeddings=False),
                                 base)
  with pytest.raises(ValueError, match=r"'lm_head.weight' is missing .* saved from the base "
                     r"model class, without the causal LM's head"):
    models.load_pretrained(tmp_path / "base")


def test_float8_tensors_load_as_their_values(tmp_path):
  # A weight stored as F8_E4M3 (no quantization_config: plain values) failed inside NumPy
  # ("module 'numpy' has no attribute 'float8_e4m3fn'"), naming neither tensor nor file.
  import ml_dtypes
  hf, tensors = _checkpoint(tmp_path)
  name = "model.layers.0.self_attn.q_proj.weight"
  tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors)
  model, _ = models.load_pretrained(tmp_path, dtype=jnp.float32)
  e, h, d = 64, 4, 16
  np.testing.assert_array_equal(model.layers.attn.q_EHD[...][0],
                                tensors[name].astype(np.float32).T.reshape(e, h, d))
