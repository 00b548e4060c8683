"""paged_jax: paged attention for JAX.

A KV cache of fixed-size blocks in one pool, per-sequence block tables, ragged paged
attention kernels (reference, XLA, Pallas TPU, Pallas GPU) and a functional allocator.
"""

from paged_jax import allocator
from paged_jax.engine import LLM, Output, StreamEvent
from paged_jax.sampling import SamplingParams
from paged_jax.attention import paged_attention, resolve_impl, validate_attention_inputs
from paged_jax.kv_cache import KVCache
from paged_jax.spec import KVCacheSpec

__version__ = "0.1.0"

__all__ = [
    "allocator",
    "KVCache",
    "LLM",
    "Output",
    "SamplingParams",
    "StreamEvent",
    "KVCacheSpec",
    "paged_attention",
    "resolve_impl",
    "validate_attention_inputs",
]
