"""Gemma 3's multimodal checkpoints (model_type "gemma3": the 4B, 12B and 27B models) serve
their text decoder.

A tiny random ``Gemma3ForConditionalGeneration`` (a 5:1 sliding / global text decoder and a
one-layer SigLIP vision tower) is saved with ``save_pretrained``; ``load_pretrained`` reads
its text decoder without torch: its dense logits equal transformers' text-only forward
within 1e-4, in the three forms such a checkpoint comes in (the config as transformers 5
writes it; the sparse ``text_config`` of the published checkpoints, which lists only what
differs from transformers' defaults; the text tensors under either prefix transformers
has used), and ``LLM`` serves it token for token as transformers' greedy ``generate``.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax import models  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.models.config import GEMMA3_TEXT_DEFAULTS  # noqa: E402
from tests.models import helpers  # noqa: E402

RTOL = 1e-4
VOCAB = 128
WINDOW = 5
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
            max_position_embeddings=256, query_pre_attn_scalar=12)
EOS = [1, 106]  # the published instruction-tuned models stop at <eos> and <end_of_turn>


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(path, the transformers model)."""
  text = transformers.Gemma3TextConfig(**TEXT)
  vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14)
  config = transformers.Gemma3Config(
      text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
      image_token_index=120, boi_token_index=121, eoi_token_index=122, eos_token_id=EOS)
  torch.manual_seed(0)
  hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
  helpers.randomize_torch_model(hf_model, seed=3)
  path = tmp_path_factory.mktemp("gemma3_mm")
  hf_model.save_pretrained(path)
  return path, hf_model


def _prompts(num: int = 2, length: int = 12) -> np.ndarray:
  # Ids below the image tokens (120-122): text only.
  return np.random.default_rng(1).integers(3, 100, (num, length), dtype=np.int32)


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _load_quietly(path):
  """``load_pretrained`` of ``path``, failing on any warning (vision tensors left unread
  must not be reported as a config / weights mismatch)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return models.load_pretrained(path, dtype=jnp.float32, impl="xla")


def _as_published(src, dst) -> None:
  """A copy of checkpoint ``src`` whose config.json is written as Google published Gemma 3
  4B's: a ``text_config`` with only what differs from transformers' defaults, the legacy
  RoPE keys, no ``layer_types``."""
  shutil.copytree(src, dst)
  with open(dst / "config.json") as f:
    hf = json.load(f)
  text = hf["text_config"]
  assert text["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
  sparse = {k: v for k, v in TEXT.items() if GEMMA3_TEXT_DEFAULTS.get(k) != v}
  hf["text_config"] = dict(sparse, model_type="gemma3_text",
                           rope_scaling=None)  # published: null at 1B-scale configs
  hf["torch_dtype"] = hf.pop("dtype")
  with open(dst / "config.json", "w") as f:
    json.dump(hf, f)


def _renamed(src, dst, old: str, new: str) -> None:
  """A copy of checkpoint ``src`` whose tensor names start with ``new`` instead of ``old``."""
  from safetensors.numpy import load_file, save_file
  shutil.copytree(src, dst)
  tensors = load_file(str(src / "model.safetensors"))
  save_file({(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()},
            str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_defaults_are_transformers_gemma3_text_defaults():
  defaults = transformers.Gemma3TextConfig()
  for key, value in GEMMA3_TEXT_DEFAULTS.items():
    assert getattr(defaults, key) == value, key


def test_dense_logits_match_transformers_in_every_form(checkpoint, tmp_path):
  path, hf_model = checkpoint
  tokens_BT = _prompts()
  with torch.no_grad():
    want = hf_model(input_ids=torch.from_numpy(tokens_BT).long()).logits.numpy()
    # Non-vacuity: the window changes transformers' own logits on these prompts.
    config = copy.deepcopy(hf_model.config)
    config.text_config.sliding_window = 10_000
    wide = transformers.Gemma3ForConditionalGeneration(config).eval()
    wide.load_state_dict(hf_model.state_dict())
    changed = wide(input_ids=torch.from_numpy(tokens_BT).long()).logits.numpy()
    assert _relative_error(changed, want) > 1e-2
  _as_published(path, tmp_path / "published")
  _renamed(path, tmp_path / "renamed", "language_model.model.", "model.language_model.")
  for folder in (path, tmp_path / "published", tmp_path / "renamed"):
    model, config = _load_quietly(folder)
    assert config.model_type == "gemma3_text" and config.eos_token_ids == tuple(EOS)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.sliding_window, config.rope_theta, config.local_rope_theta) == (
        WINDOW, 1_000_000.0, 10_000.0)
    assert _relative_error(model(jnp.asarray(tokens_BT)), want) < RTOL, folder


def test_engine_greedy_equals_transformers_generate(checkpoint):
  path, hf_model = checkpoint
  prompt = _prompts(1, 9)[0]
  with torch.no_grad():
    out = hf_model.generate(torch.from_numpy(prompt[None]).long(), max_new_tokens=6,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
  want = out[0, len(prompt):].tolist()
  llm = LLM.from_pretrained(path, dtype="float32", impl="xla", block_size=4, num_blocks=16,
                            max_seqs=2, max_tokens_per_step=16)
  got, = llm.generate([prompt.tolist()], SamplingParams(max_tokens=6, ignore_eos=True))
  assert list(got.token_ids) == want
