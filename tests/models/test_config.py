"""``ModelConfig.from_hf_dict``: what is read, what is refused, and the RoPE frequencies."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from paged_jax.models import ModelConfig, RopeScaling
from tests.models import helpers


def test_llama_fields():
  c = helpers.tiny_config("llama", eos_token_id=[2, 9])
  assert (c.vocab_size, c.embed_dim, c.mlp_dim, c.num_layers) == (128, 64, 96, 2)
  assert (c.num_heads, c.num_kv_heads, c.head_dim, c.group) == (4, 2, 16, 2)
  assert c.eos_token_ids == (2, 9) and c.bos_token_id == 1
  assert not c.qkv_bias and not c.o_bias and c.rope_scaling is None
  assert c.max_seq_len == 256
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.num_layers = 3  # frozen


def test_head_dim_defaults_to_width_over_heads():
  hf = helpers.hf_config_dict()
  del hf["head_dim"]
  assert ModelConfig.from_hf_dict(hf).head_dim == 16


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_mlp_bias_is_ignored_where_transformers_ignores_it(model_type):
  # Only Llama's MLP reads mlp_bias in transformers; the others' MLPs have no biases
  # whatever the key says, and their checkpoints were refused.
  plain = helpers.tiny_config(model_type)
  assert helpers.tiny_config(model_type, mlp_bias=True) == plain


def test_llama_attention_bias_and_qwen2_bias():
  assert helpers.tiny_config("llama", attention_bias=True).o_bias
  qwen = helpers.tiny_config("qwen2", tie_word_embeddings=True)
  assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings


def test_rope_parameters_of_transformers_5():
  hf = helpers.hf_config_dict()
  del hf["rope_theta"]
  hf["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
  c = ModelConfig.from_hf_dict(hf)
  assert c.rope_theta == 500000.0
  assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])  # yarn: test_gpt_oss.py
def test_unsupported_rope_scaling_is_refused(rope_type):
  with pytest.raises(ValueError, match=f"rope_scaling type '{rope_type}'"):
    helpers.tiny_config(rope_scaling={"type": rope_type, "factor": 2.0})


def test_llama3_rope_without_its_keys_is_refused():
  with pytest.raises(ValueError, match="high_freq_factor"):
    helpers.tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 16})


_YARN = {"rope_type": "yarn", "factor": 4.0}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("rope,top", [
    ({**_YARN, "original_max_position_embeddings": 32}, 16),  # the top-level value wins
    ({**_LLAMA3, "original_max_position_embeddings": 16}, 64),
    (_YARN, 64),  # only the top-level value (was refused)
    (_YARN, None),  # none: max_position_embeddings (was refused)
    (_LLAMA3, None),
    ({**_YARN, "original_max_position_embeddings": 32}, None),  # the dict's own
])
def test_rope_pretraining_length_is_read_as_transformers_reads_it(rope, top):
  # A top-level original_max_position_embeddings (Phi-3 writes it there) was ignored for
  # the rope dict's own: every logit off (3.2 of ~5 in an audit's tiny Llama), no error.
  transformers = pytest.importorskip("transformers")
  hf = helpers.hf_config_dict(rope_parameters={**rope, "rope_theta": 10000.0})
  if top is not None:
    hf["original_max_position_embeddings"] = top
  ours = ModelConfig.from_hf_dict(hf)
  rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
      transformers.LlamaConfig(**hf))
  np.testing.assert_allclose(ours.rope_inv_frequencies(), rotary.inv_freq.numpy(), rtol=4e-7)
  assert math.isclose(ours.rope_attention_factor(), rotary.attention_scaling, rel_tol=1e-6)
  want = top or rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
  assert ours.rope_scaling.original_max_position_embeddings == want


@pytest.mark.parametrize("own", [32, None])
def test_gemma3_rope_pretraining_length_ignores_a_top_level_one(own):
  # transformers keeps Gemma 3's RoPE per layer type, where a top-level
  # original_max_position_embeddings is not read (a review caught the flat rule applied to
  # Gemma 3's legacy rope_scaling: the global layers' frequencies off by up to 60%).
  transformers = pytest.importorskip("transformers")
  rope = {"rope_type": "yarn", "factor": 4.0}
  if own is not None:
    rope["original_max_position_embeddings"] = own
  hf = helpers.hf_config_dict("gemma3_text", hidden_act="gelu_pytorch_tanh", sliding_window=8,
                              query_pre_attn_scalar=16, rope_scaling=rope,
                              layer_types=["sliding_attention", "full_attention"],
                              original_max_position_embeddings=16)
  theirs = transformers.Gemma3TextConfig(**hf).rope_parameters["full_attention"]
  assert ModelConfig.from_hf_dict(hf).rope_scaling.original_max_position_embeddings == (
      theirs["original_max_position_embeddings"]) == (own or hf["max_position_embeddings"])


def test_llama3_inverse_frequencies_by_hand():
  # head_dim 4: base inv_freq = theta ** -(0/4, 2/4). original context 32, low 1, high 4:
  # wavelengths above 32 are slowed by factor 8, below 8 kept, between interpolated.
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=32)
  c = lambda theta: ModelConfig(model_type="llama", vocab_size=8, embed_dim=8, mlp_dim=8,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                                rope_theta=theta, rope_scaling=scaling)
  # theta 100: inv_freq (1, 0.1), wavelengths (6.28, 62.8): kept, then 0.1 / 8 = 0.0125.
  np.testing.assert_allclose(c(100.0).rope_inv_frequencies(), [1.0, 0.0125], rtol=1e-6)
  # theta 16: inv_freq (1, 0.25), wavelength 8 pi = 25.13 is in (8, 32):
  # smooth = (32 / 25.13 - 1) / (4 - 1) = 0.09104; (1 - smooth) * 0.25 / 8 + smooth * 0.25.
  smooth = (32 / (8 * math.pi) - 1) / 3
  want = (1 - smooth) * 0.25 / 8 + smooth * 0.25
  np.testing.assert_allclose(c(16.0).rope_inv_frequencies(), [1.0, want], rtol=1e-6)
  np.testing.assert_allclose(want, 0.05118, rtol=1e-3)


def test_mistral_window_applies_to_every_layer():
  assert helpers.tiny_config("mistral", sliding_window=None).layer_types == ()
  c = helpers.tiny_config("mistral", sliding_window=64)  # shorter than max_seq_len=256
  assert c.sliding_window == 64 and c.max_seq_len == 256
  assert c.attention_kinds() == (("sliding_attention",), (0, 0))
  assert c.window_of("sliding_attention") == 64


def test_qwen2_sliding_window_only_when_enabled():
  c = helpers.tiny_config("qwen2", use_sliding_window=False, sliding_window=32)
  assert c.layer_types == () and c.sliding_window is None
  # Without layer_types, layers >= max_window_layers slide (transformers' default).
  c = helpers.tiny_config("qwen2", use_sliding_window=True, sliding_window=32,
                          max_window_layers=1)
  assert c.layer_types == ("full_attention", "sliding_attention")
  assert c.attention_kinds() == (("full_attention", "sliding_attention"), (0, 1))
  assert [c.window_of(t) for t in c.layer_types] == [None, 32]
  # Listed layer_types win.
  c = helpers.tiny_config("qwen2", use_sliding_window=True, sliding_window=32,
                          layer_types=["sliding_attention", "full_attention"])
  assert c.layer_types == ("sliding_attention", "full_attention")


@pytest.mark.parametrize("override, match", [
    (dict(model_type="gpt2"), "model_type='gpt2'.* or gemma3 \\(served as its text decoder"),
    # A multimodal type without its text_config was told gemma3 is served (it is).
    (dict(model_type="gemma3"), "model_type='gemma3' in config.json needs its text "
     "decoder's config under 'text_config'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(model_type="gemma2", layer_types=["full_attention"]), "layer_types="),
    (dict(model_type="gemma2", layer_types=["full_attention", "chunked_attention"]),
     "layer_types="),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window=0"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(vocab_size=0), "vocab_size=0"),
    (dict(num_hidden_layers=None), "num_hidden_layers"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    # An infinite cap made NaN logits; one past 1e30 changes nothing in float32.
    (dict(model_type="gemma2", final_logit_softcapping=float("inf")),
     r"final_soft_cap=inf must be <= 1e\+30"),
    (dict(model_type="gemma2", attn_logit_softcapping=1e31),
     r"attn_soft_cap=1e\+31 must be <= 1e\+30"),
])
def test_invalid_configs_are_refused(override, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_dict({**helpers.hf_config_dict(), **override})


def test_from_json(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(helpers.hf_config_dict("qwen2")))
  assert ModelConfig.from_json(tmp_path).model_type == "qwen2"
  assert ModelConfig.from_json(tmp_path / "config.json").qkv_bias
  with pytest.raises(FileNotFoundError, match="nope.json"):
    ModelConfig.from_json(tmp_path / "nope.json")
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="not valid JSON"):
    ModelConfig.from_json(tmp_path / "bad.json")


def test_gemma2_defaults_as_transformers_fills_them():
  hf = helpers.hf_config_dict("gemma2", num_hidden_layers=4, sliding_window=8)
  del hf["hidden_act"], hf["tie_word_embeddings"]  # Gemma's defaults: GeGLU, tied
  c = ModelConfig.from_hf_dict(hf)
  assert c.layer_types == ("sliding_attention", "full_attention") * 2
  assert (c.attn_soft_cap, c.final_soft_cap) == (50.0, 30.0)
  assert c.sm_scale == 256 ** -0.5  # query_pre_attn_scalar defaults to 256, not head_dim
  assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
  assert c.gemma_norms and c.sandwich_norms and c.scale_embeddings and not c.qk_norm


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gemma3_text", "qwen2", "qwen3",
                                        "gpt_oss"])
def test_missing_sliding_window_gets_transformers_default(model_type):
  # A hand-written config.json may leave sliding_window out: transformers' config class
  # then fills in its default (4096 for Mistral and Gemma, 128 for gpt-oss, None for Qwen).
  transformers = pytest.importorskip("transformers")
  hf = helpers.hf_config_dict(model_type, num_hidden_layers=2)
  if model_type == "gpt_oss":
    hf.update(num_local_experts=4, num_experts_per_tok=2)
  hf.pop("sliding_window", None)
  config_class = transformers.AutoConfig.for_model(model_type).__class__
  expected = config_class().sliding_window
  if model_type in ("qwen2", "qwen3"):
    expected = None  # use_sliding_window defaults to False: no layer slides
  assert ModelConfig.from_hf_dict(hf).sliding_window == expected


def test_gemma3_rope_parameters_per_layer_type_of_transformers_5():
  hf = helpers.hf_config_dict("gemma3_text", num_hidden_layers=7, sliding_window=8,
                              query_pre_attn_scalar=16)
  del hf["rope_theta"]
  hf["rope_parameters"] = {
      "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
      "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 400.0}}
  c = ModelConfig.from_hf_dict(hf)
  # Default pattern: every 6th layer global.
  assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
  assert c.qk_norm and c.attn_soft_cap is None and c.sm_scale == 0.25
  # transformers' Gemma 3 attention reads attn_logit_softcapping but never applies it: a
  # config that sets it gets no cap (the final logit cap it does apply).
  capped = ModelConfig.from_hf_dict(dict(hf, attn_logit_softcapping=4.0,
                                         final_logit_softcapping=6.0))
  assert (capped.attn_soft_cap, capped.final_soft_cap) == (None, 6.0)
  # head_dim 16: inv_freq = theta ** -(0, 2, ..., 14) / 16; the global ones / factor 2.
  exponent = np.arange(0, 16, 2) / 16
  np.testing.assert_allclose(c.rope_inv_frequencies("sliding_attention"), 100.0 ** -exponent,
                             rtol=1e-6)
  np.testing.assert_allclose(c.rope_inv_frequencies("full_attention"),
                             400.0 ** -exponent / 2, rtol=1e-6)
  # The legacy keys of the published checkpoints say the same.
  del hf["rope_parameters"]
  hf.update(rope_theta=400.0, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=3)
  legacy = ModelConfig.from_hf_dict(hf)
  assert legacy.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2 + (
      "sliding_attention",)
  assert (legacy.rope_theta, legacy.local_rope_theta, legacy.rope_scaling) == (
      c.rope_theta, c.local_rope_theta, c.rope_scaling)


def test_qwen3_qk_norm_and_biases_only_with_attention_bias():
  c = helpers.tiny_config("qwen3")
  assert c.qk_norm and not c.qkv_bias and not c.o_bias and c.layer_types == ()
  c = helpers.tiny_config("qwen3", attention_bias=True)
  assert c.qkv_bias and c.o_bias
