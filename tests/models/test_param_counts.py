"""Full-size configs of each family, built abstractly (``nnx.eval_shape``, no weights):
parameter counts equal the published ones.

The config dicts hold the fields of each checkpoint's config.json that size the model (no
download). Published figures: exact counts where the checkpoints' parameter totals are
quoted to the parameter (Gemma 2, Gemma 3 1B, Mistral 7B); the model cards' rounded
totals and non-embedding counts for Qwen3 (0.6B / 0.44B, 8.2B / 6.95B); the Gemma 3
technical report's non-embedding count for the 4B text decoder (3,209M; its 675M
embedding figure includes the vision projection, so the embedding is checked as V x E).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
from flax import nnx

from paged_jax import models

GEMMA2 = dict(model_type="gemma2", vocab_size=256000, head_dim=256, query_pre_attn_scalar=256,
              sliding_window=4096, max_position_embeddings=8192, tie_word_embeddings=True)
GEMMA3 = dict(model_type="gemma3_text", head_dim=256, query_pre_attn_scalar=256,
              sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0,
              rope_local_base_freq=10_000.0, max_position_embeddings=32768,
              tie_word_embeddings=True)
QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8,
             max_position_embeddings=40960, rope_theta=1_000_000.0, attention_bias=False,
             use_sliding_window=False, sliding_window=None, max_window_layers=28)

CONFIGS = {
    "Gemma-2-2B": dict(GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4),
    "Gemma-2-9B": dict(GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8),
    "Gemma-3-1B": dict(GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1),
    "Gemma-3-4B text": dict(GEMMA3, vocab_size=262208, hidden_size=2560,
                            intermediate_size=10240, num_hidden_layers=34,
                            num_attention_heads=8, num_key_value_heads=4,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "Qwen3-0.6B": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "Qwen3-8B": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "Mistral-7B-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                            intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8,
                            sliding_window=4096, max_position_embeddings=32768,
                            rope_theta=10000.0, tie_word_embeddings=False),
}

# name -> {"total" / "non_embedding": (published figure, half its last published digit)}.
EXACT = lambda n: {"total": (n, 0)}
PUBLISHED = {
    "Gemma-2-2B": EXACT(2_614_341_888),
    "Gemma-2-9B": EXACT(9_241_705_984),
    "Gemma-3-1B": EXACT(999_885_952),
    "Gemma-3-4B text": {"non_embedding": (3_209e6, 0.5e6)},
    "Qwen3-0.6B": {"total": (0.6e9, 0.05e9), "non_embedding": (0.44e9, 0.005e9)},
    "Qwen3-8B": {"total": (8.2e9, 0.05e9), "non_embedding": (6.95e9, 0.005e9)},
    "Mistral-7B-v0.1": EXACT(7_241_732_096),
}


def _counts(hf: dict) -> tuple[int, int, models.ModelConfig]:
  """(all parameters, those outside the embedding and LM head, the config)."""
  config = models.ModelConfig.from_hf_dict(hf)
  abstract = nnx.eval_shape(lambda: models.Decoder(config, dtype=jnp.bfloat16,
                                                   rngs=nnx.Rngs(0)))
  total = embedding = 0
  for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    size = math.prod(variable.get_value().shape)
    total += size
    if path[-1] in ("embed_VE", "lm_head_EV"):
      embedding += size
  return total, total - embedding, config


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_published(name):
  total, non_embedding, config = _counts(CONFIGS[name])
  got = {"total": total, "non_embedding": non_embedding}
  for what, (want, tolerance) in PUBLISHED[name].items():
    assert abs(got[what] - want) <= tolerance, (what, got[what], want)
  if name == "Gemma-3-4B text":
    assert total - non_embedding == 262208 * 2560  # V x E, tied
  # The kinds the config reads: Gemma 3 slides 5 layers of 6, Gemma 2 every other one.
  kinds, kind_of_layer = config.attention_kinds()
  if name.startswith("Gemma-3"):
    assert [kinds[k] for k in kind_of_layer[:6]] == ["sliding_attention"] * 5 + [
        "full_attention"]
  if name.startswith("Gemma-2"):
    assert [kinds[k] for k in kind_of_layer[:2]] == ["sliding_attention", "full_attention"]
