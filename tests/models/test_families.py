"""Model families against Hugging Face transformers (PyTorch CPU, float32): Mistral and Qwen2
with real sliding windows, Qwen3, Gemma 2, Gemma 3 text.

For each family a tiny random checkpoint is made with transformers (weights re-drawn at O(1)
scale) and saved with ``save_pretrained``; ``load_pretrained`` reads it back without torch.
- Dense logits equal transformers' within 1e-4 on prompts longer than the window, and the
  test checks on transformers itself that the window (and Gemma 2's soft caps) change
  those logits, so it cannot pass with the variant ignored.
- Through ``LLM`` (the paged forward, block size 4): greedy tokens equal transformers'
  ``generate`` token for token, once with one request (no preemption) and once with three
  requests in a pool too small for them, so sequences are preempted and recomputed.
"""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax import allocator, models  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from tests.models import helpers  # noqa: E402

RTOL = 1e-4
WINDOW = 5
PROMPT_LEN = 20  # > WINDOW: the window cuts every late query's view

GEMMA = dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
             sliding_window=WINDOW, query_pre_attn_scalar=12)
FAMILIES = {
    # Every layer slides.
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW),
    # Layers >= max_window_layers slide (transformers' default layer_types).
    "qwen2": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=1),
    # q/k norms; one sliding layer between full ones, listed in layer_types.
    "qwen3": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                  layer_types=["full_attention", "sliding_attention", "full_attention"]),
    # Alternating sliding / global layers, both soft caps (small, so that they bite).
    "gemma2": dict(num_hidden_layers=4, attn_logit_softcapping=4.0,
                   final_logit_softcapping=8.0, **GEMMA),
    # 5 sliding layers to 1 global, two RoPE bases (global one with linear scaling), q/k
    # norms, head dim 256. Its config.json is rewritten in the legacy form of the published
    # Gemma 3 checkpoints (below).
    "gemma3_text": dict(num_hidden_layers=6, head_dim=256, num_attention_heads=2,
                        num_key_value_heads=1, rope_theta=1000.0, rope_local_base_freq=50.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, **GEMMA),
}
# Config overrides that must change transformers' logits on our prompts (non-vacuity).
ABLATIONS = {"window": dict(sliding_window=10_000)}
GEMMA2_ABLATIONS = {"attn soft cap": dict(attn_logit_softcapping=None),
                    "final soft cap": dict(final_logit_softcapping=None)}


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _hf_config(family: str):
  hf_dict = helpers.hf_config_dict(family, **FAMILIES[family])
  del hf_dict["model_type"]
  if family.startswith("gemma"):
    del hf_dict["hidden_act"]
  return transformers.AutoConfig.for_model(family, **hf_dict)


def _hf_model(config, seed: int = 0, state=None):
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32)
  if state is None:
    helpers.randomize_torch_model(model, seed)
  else:
    model.load_state_dict(state)
  if config.tie_word_embeddings:
    model.tie_weights()
  return model.eval()


def _legacy_gemma3_config(path) -> None:
  """Rewrite a transformers-5 Gemma 3 config.json the way the published checkpoints hold
  it: no layer_types (so the default 5:1 pattern applies), ``rope_theta``,
  ``rope_local_base_freq`` and ``rope_scaling`` instead of per-layer-type
  ``rope_parameters``."""
  with open(path / "config.json") as f:
    hf = json.load(f)
  rope = hf.pop("rope_parameters")
  assert hf.pop("layer_types") == ["sliding_attention"] * 5 + ["full_attention"]
  hf.update(rope_theta=rope["full_attention"]["rope_theta"],
            rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
            rope_scaling={"rope_type": "linear", "factor": rope["full_attention"]["factor"]})
  with open(path / "config.json", "w") as f:
    json.dump(hf, f)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  """(family, checkpoint path, the transformers model)."""
  name = request.param
  path = tmp_path_factory.mktemp(name)
  hf_model = _hf_model(_hf_config(name))
  hf_model.save_pretrained(path)
  if name == "gemma3_text":
    _legacy_gemma3_config(path)
  return name, path, hf_model


def _prompts(num: int, length: int = PROMPT_LEN, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, helpers.VOCAB, (num, length), dtype=np.int32)


def test_dense_logits_match_transformers(family):
  name, path, hf_model = family
  tokens_BT = _prompts(2)
  with torch.no_grad():
    want = hf_model(torch.from_numpy(tokens_BT).long()).logits.numpy()
    # Non-vacuity: each variant changes transformers' own logits on these prompts.
    ablations = dict(ABLATIONS, **(GEMMA2_ABLATIONS if name == "gemma2" else {}))
    for what, change in ablations.items():
      config = copy.deepcopy(hf_model.config)
      for key, value in change.items():
        setattr(config, key, value)
      other = _hf_model(config, state=hf_model.state_dict())
      changed = other(torch.from_numpy(tokens_BT).long()).logits.numpy()
      assert _relative_error(changed, want) > 1e-2, f"{what} does not matter here"

  model, config = models.load_pretrained(path, dtype=jnp.float32)
  assert config.model_type == name and config.sliding_window == WINDOW
  if name == "gemma3_text":
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.rope_theta, config.local_rope_theta) == (1000.0, 50.0)
    assert config.rope_scaling == models.LinearRopeScaling(4.0)
  got = model(jnp.asarray(tokens_BT))
  assert got.shape == want.shape
  assert _relative_error(got, want) < RTOL


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
  with torch.no_grad():
    return hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_tokens)[0, len(prompt):].tolist()


# One engine compile per family (~8 s on a quiet 2-core CPU). The default run takes two:
# Mistral (one attention kind: no lax.switch) and Gemma 3 (sliding and global kinds under
# the switch, two RoPE bases, q/k norms, D = 256); the others run with the slow tests
# (their paged-only differences, Gemma 2's caps among them, are also checked paged against
# dense in tests/models/test_decoder.py).
@pytest.mark.parametrize("family", [
    "mistral", "gemma3_text",
    pytest.param("gemma2", marks=pytest.mark.slow), pytest.param("qwen2", marks=pytest.mark.slow),
    pytest.param("qwen3", marks=pytest.mark.slow),
], indirect=True)
def test_greedy_equals_hf_generate_with_and_without_preemption(family):
  name, path, hf_model = family
  max_tokens = 8
  # Each request needs ceil((20 + 8) / 4) = 7 blocks: 10 blocks hold one at a time.
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=10,
                            max_seqs=3, max_tokens_per_step=16, token_buckets=(16,),
                            steps_per_call=1)
  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  prompts = [[int(t) for t in row] for row in _prompts(3, seed=2)]
  out, = llm.generate(prompts[:1], params)
  assert llm.stats["preemptions"] == 0
  assert list(out.token_ids) == _hf_greedy(hf_model, prompts[0], max_tokens), name
  outs = llm.generate(prompts, params)  # three at once: some are preempted, recomputed
  assert llm.stats["preemptions"] > 0
  for p, o in zip(prompts, outs):
    assert list(o.token_ids) == _hf_greedy(hf_model, p, max_tokens), name
  allocator.validate(llm.allocator_state)
