"""Flax NNX decoders (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, gpt-oss) and the
Hugging Face checkpoint loader.

- ``ModelConfig`` (``from_hf_dict`` / ``from_json``): the frozen model config.
- ``Decoder``: the decoder; ``paged_forward(tokens_T, positions_T, cache, metadata)`` and
  dense ``model(tokens_BT)``.
- ``init_random(config, seed=...)``: a random model drawn on the host (tests, demos).
- ``AttentionMetadata``: re-exported from ``paged_jax.step`` (where it lives).
- ``load_pretrained(path, dtype=...) -> (model, config)``: safetensors, no torch.
- ``prefill_step`` / ``decode_step`` / ``Steps``: ``paged_jax.step``'s, under their old names.
"""

from __future__ import annotations

from paged_jax.models.config import (CheckpointNotFoundError, LinearRopeScaling, ModelConfig,
                                     RopeScaling)
from paged_jax.models.decoder import Decoder, init_random
from paged_jax.models.loader import load_pretrained
from paged_jax.models.moe import MoEMLP
from paged_jax.models.rope import YarnScaling
from paged_jax.models.steps import Steps, decode_step, prefill_step
from paged_jax.step import AttentionMetadata  # moved to paged_jax; kept here for old imports

__all__ = [
    "AttentionMetadata",
    "CheckpointNotFoundError",
    "Decoder",
    "LinearRopeScaling",
    "ModelConfig",
    "MoEMLP",
    "RopeScaling",
    "Steps",
    "YarnScaling",
    "decode_step",
    "init_random",
    "load_pretrained",
    "prefill_step",
]
