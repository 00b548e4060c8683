"""gpt-oss end to end: a tiny random ``GptOssForCausalLM`` saved by transformers, loaded by
``load_pretrained`` (no torch inside), against transformers itself (float32).

The tiny model keeps every gpt-oss feature: 2 layers (sliding, full), window 6 < the
prompts, a learned sink per head, q/k/v/o biases, 4 experts with top-2 routing, and YaRN
RoPE whose ramp falls inside the head dim (original context 32, factor 8). Its weights are
re-drawn at O(1) scale (transformers' std-0.02 init would make the logits nearly uniform).
Checks: dense logits within 1e-4 (and the window does change transformers' logits for these
prompts, so the comparison is not vacuous); greedy tokens through ``LLM`` equal transformers'
``generate``, first with no preemption, then in a pool too small for the batch; the full
gpt-oss-20b and -120b configs give their parameter counts under ``nnx.eval_shape``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from paged_jax import LLM, SamplingParams, allocator, models  # noqa: E402
from paged_jax.models import rope  # noqa: E402

VOCAB, WIDTH, EXPERT_WIDTH, WINDOW = 128, 64, 48, 6
TINY = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=EXPERT_WIDTH,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 8.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 32})


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _randomize(model, seed: int = 0) -> None:
  """O(1)-scale weights: matrices N(0, 1 / fan_in), norms 1 + N(0, 0.1^2), biases
  N(0, 0.1^2), sinks and embeddings N(0, 1)."""
  gen = torch.Generator().manual_seed(seed)
  fan_in = {"gate_up_proj": WIDTH, "down_proj": EXPERT_WIDTH}  # input-major [O, in, out]
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      last = name.rsplit(".", 1)[-1]
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif last == "bias" or last.endswith("_bias"):
        p.copy_(0.1 * noise)
      elif last == "sinks" or "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise * fan_in.get(last, p.shape[-1]) ** -0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_gpt_oss")
  torch.manual_seed(0)
  config = transformers.GptOssConfig(**TINY)
  model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager",
                                                      dtype=torch.float32)
  _randomize(model)
  model.eval()
  model.save_pretrained(path)
  return path, model


def test_config_reads_gpt_oss(checkpoint):
  path, _ = checkpoint
  config = models.ModelConfig.from_json(path)
  assert (config.num_experts, config.experts_per_token) == (4, 2)
  assert config.attention_sinks and config.qkv_bias and config.o_bias
  assert config.layer_types == ("sliding_attention", "full_attention")
  assert config.sliding_window == WINDOW and config.rms_norm_eps == 1e-5
  assert config.rope_scaling == rope.YarnScaling(factor=8.0, beta_fast=8.0, beta_slow=1.0,
                                                 truncate=False,
                                                 original_max_position_embeddings=32)
  assert config.rope_attention_factor() == pytest.approx(0.1 * np.log(8.0) + 1)


def test_dense_logits_match_transformers(checkpoint):
  path, hf_model = checkpoint
  tokens_BT = np.random.default_rng(1).integers(0, VOCAB, (2, 20), dtype=np.int32)
  with torch.no_grad():
    want = hf_model(torch.from_numpy(tokens_BT).long()).logits.numpy()
    # The window matters for these prompts: without it transformers' logits move.
    hf_model.config.sliding_window = 10_000
    try:
      unwindowed = hf_model(torch.from_numpy(tokens_BT).long()).logits.numpy()
    finally:
      hf_model.config.sliding_window = WINDOW
  assert _relative_error(unwindowed, want) > 1e-2

  model, _ = models.load_pretrained(path, dtype=jnp.float32)
  got = model(jnp.asarray(tokens_BT))
  assert _relative_error(got, want) < 1e-4


def _generate(hf_model, prompt, max_tokens):
  with torch.no_grad():
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0,
                            min_new_tokens=max_tokens)
  return out[0, len(prompt):].tolist()


def test_greedy_equals_generate_with_and_without_preemption(checkpoint):
  path, hf_model = checkpoint
  # 12 blocks of 4 tokens: two short requests fit side by side; five longer ones cannot.
  # One token bucket: one compiled step serves prefill and decode (compile time).
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=12,
                            max_seqs=3, max_tokens_per_step=16, steps_per_call=8,
                            token_buckets=(16,))
  rng = np.random.default_rng(0)
  params = SamplingParams(max_tokens=10, ignore_eos=True)
  prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (9, 5)]
  outs = llm.generate(prompts, params)
  assert llm.stats["preemptions"] == 0
  for p, o in zip(prompts, outs):
    assert list(o.token_ids) == _generate(hf_model, p, 10)
  prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (10, 14, 8, 12, 6)]
  outs = llm.generate(prompts, params)
  assert llm.stats["preemptions"] > 0
  for p, o in zip(prompts, outs):
    assert list(o.token_ids) == _generate(hf_model, p, 10)
  allocator.validate(llm.allocator_state)
  assert llm.stats["num_free_blocks"] == 12


# gpt-oss-20b's config.json (the keys that shape it; transformers' GptOssConfig fills the
# rest with these same values). 120b: 36 layers, 128 experts.
GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                   intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                   rope_theta=150000.0, rms_norm_eps=1e-5, attention_bias=True,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096})


def _count(hf: dict) -> int:
  config = models.ModelConfig.from_hf_dict(hf)
  abstract = nnx.eval_shape(lambda: models.Decoder(config, dtype=jnp.bfloat16,
                                                   rngs=nnx.Rngs(0)))
  return sum(int(np.prod(v.get_value().shape))
             for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))


def test_full_size_parameter_counts():
  # 20b, per layer: attention q 2880*4096 + 4096, k and v 2880*512 + 512 each, o
  # 4096*2880 + 2880, sinks 64: 26,550,144; 32 experts of 2880*5760 + 5760 (gate_up) +
  # 2880*2880 + 2880 (down) = 24,891,840 each: 796,538,880; router 2880*32 + 32 = 92,192;
  # two norms 5,760; so 823,186,976 a layer, 19,756,487,424 for 24. Embedding and LM head
  # 201088*2880 each, final norm 2880: 20,914,757,184 in all, what transformers'
  # GptOssForCausalLM counts on the meta device (published: "21B"); 120b likewise
  # 116,829,156,672 ("117B").
  assert _count(GPT_OSS_20B) == 20_914_757_184
  assert _count({**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}) == (
      116_829_156_672)


def test_config_defaults_and_refusals_follow_transformers():
  # A config.json naming no RoPE, layer types or eps gets transformers' gpt-oss defaults.
  sizes = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=EXPERT_WIDTH,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_local_experts=4, num_experts_per_tok=2)
  ours = models.ModelConfig.from_hf_dict({"model_type": "gpt_oss", **sizes})
  theirs = transformers.GptOssConfig(**sizes)
  rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(theirs)
  np.testing.assert_allclose(ours.rope_inv_frequencies(), rotary.inv_freq.numpy(), rtol=4e-7)
  assert ours.rope_attention_factor() == rotary.attention_scaling
  assert ours.rope_theta == 150000.0 and ours.rms_norm_eps == theirs.rms_norm_eps
  assert ours.layer_types == tuple(theirs.layer_types)
  assert ours.sliding_window == theirs.sliding_window == 128
  assert ours.qkv_bias and ours.o_bias  # attention_bias defaults to True for gpt-oss
  # Refusals, each naming what is wrong.
  hub = {**GPT_OSS_20B, "quantization_config": {"quant_method": "mxfp4"}}
  with pytest.raises(ValueError, match="quantization_config.*dequantise"):
    models.ModelConfig.from_hf_dict(hub)
  # A yarn dict without its pretraining length takes max_position_embeddings, as
  # transformers' standardize_rope_params does (was refused).
  short = models.ModelConfig.from_hf_dict({**GPT_OSS_20B, "rope_scaling": {
      "rope_type": "yarn", "factor": 32.0}})
  assert (short.rope_scaling.original_max_position_embeddings
          == GPT_OSS_20B["max_position_embeddings"])
  with pytest.raises(ValueError, match="experts_per_token=5 must be in"):
    models.ModelConfig.from_hf_dict({**GPT_OSS_20B, "num_local_experts": 4,
                                     "num_experts_per_tok": 5})


def test_mxfp4_expert_tensors_are_named_in_the_error(checkpoint, tmp_path):
  """A checkpoint holding the experts as MXFP4 blocks and scales (no quantization_config
  to refuse it early) fails on the first such tensor, saying what it is."""
  import json
  import os

  from safetensors.numpy import load_file

  from tests.models import helpers

  path, _ = checkpoint
  tensors = load_file(os.path.join(path, "model.safetensors"))
  for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
    o, e, two_i = tensors.pop(name).shape
    tensors[name + "_blocks"] = np.zeros((o, two_i, e // 32, 16), np.uint8)
    tensors[name + "_scales"] = np.full((o, two_i, e // 32), 127, np.uint8)
  with open(os.path.join(path, "config.json")) as f:
    hf_dict = json.load(f)
  helpers.write_numpy_checkpoint(tmp_path, hf_dict, tensors)
  with pytest.raises(ValueError, match=r"gate_up_proj' is stored MXFP4-quantised"):
    models.load_pretrained(tmp_path, dtype=jnp.float32)


def test_bfloat16_checkpoint_loads_the_same_expert_weights(checkpoint, tmp_path):
  """gpt-oss ships bfloat16 tensors: the loader maps them from the file (no float32 copy)
  and de-interleaves gate and up from that mapping; every expert weight must come out
  bit-equal to transformers' own bfloat16 tensors."""
  import copy

  _, hf_model = checkpoint
  copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
  model, config = models.load_pretrained(tmp_path)
  assert config.checkpoint_dtype == "bfloat16"
  mlp = model.layers.mlp
  assert mlp.gate_OEI[...].dtype == jnp.bfloat16
  for layer in range(2):
    experts = hf_model.model.layers[layer].mlp.experts
    gate_up = experts.gate_up_proj.detach().to(torch.bfloat16).float().numpy()
    gate_up_bias = experts.gate_up_proj_bias.detach().to(torch.bfloat16).float().numpy()
    down = experts.down_proj.detach().to(torch.bfloat16).float().numpy()
    as32 = lambda p: np.asarray(p[...][layer].astype(jnp.float32))
    np.testing.assert_array_equal(as32(mlp.gate_OEI), gate_up[..., 0::2])
    np.testing.assert_array_equal(as32(mlp.up_OEI), gate_up[..., 1::2])
    np.testing.assert_array_equal(as32(mlp.gate_bias_OI), gate_up_bias[..., 0::2])
    np.testing.assert_array_equal(as32(mlp.up_bias_OI), gate_up_bias[..., 1::2])
    np.testing.assert_array_equal(as32(mlp.down_OIE), down)
