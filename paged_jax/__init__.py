"""paged_jax: paged attention for JAX.

A KV cache of fixed-size blocks in one pool, per-sequence block tables, ragged paged
attention kernels (reference, XLA, Pallas TPU, Pallas GPU), a functional allocator, the
step API that runs any Flax NNX model over them (``paged_jax.step``) and a serving engine
(``LLM``) for any model of the protocol (``paged_jax.protocol``). Everything a user needs
is importable from here; ``paged_jax.testing`` holds assertions for your own model's tests.

Layering (no import cycle): ``pallas_kernels`` <- ``spec``, ``kv_cache``, ``allocator``,
``attention`` <- ``protocol``, ``step`` <- ``models`` (the built-in decoders) and
``engine``; this package's ``__init__`` only re-exports.
"""

from paged_jax import allocator
from paged_jax import protocol
from paged_jax import step
from paged_jax.attention import paged_attention, resolve_impl, validate_attention_inputs
from paged_jax.engine import LLM, EngineState, Output, StreamEvent, default_token_buckets
from paged_jax.kv_cache import KVCache
from paged_jax.models import Decoder, ModelConfig, init_random, load_pretrained
from paged_jax.protocol import ModelConfigLike, PagedModel
from paged_jax.sampling import SamplingParams
from paged_jax.spec import KVCacheSpec
from paged_jax.step import (AttentionMetadata, StepInputs, Steps, decode_step, forward_step,
                            prepare_step, tokens_from_history)

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata",
    "Decoder",
    "EngineState",
    "KVCache",
    "KVCacheSpec",
    "LLM",
    "ModelConfig",
    "ModelConfigLike",
    "Output",
    "PagedModel",
    "SamplingParams",
    "StepInputs",
    "Steps",
    "StreamEvent",
    "allocator",
    "decode_step",
    "default_token_buckets",
    "forward_step",
    "init_random",
    "load_pretrained",
    "paged_attention",
    "prepare_step",
    "protocol",
    "resolve_impl",
    "step",
    "tokens_from_history",
    "validate_attention_inputs",
]
