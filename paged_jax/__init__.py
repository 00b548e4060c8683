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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The names below are imported on first use (PEP 562), so that ``import paged_jax`` (and the
# ``paged-jax`` command, which lives here) starts at once; ``from paged_jax import LLM``
# works as usual. The block under TYPE_CHECKING is what type checkers and readers see.
if TYPE_CHECKING:
  from paged_jax import (allocator, attention, engine, kv_cache, kv_groups, models,
                         pallas_kernels, planner, protocol, sampling, sharding, spec, step,
                         testing)
  from paged_jax.attention import (checked_paged_attention, paged_attention, resolve_impl,
                                   validate_attention_inputs)
  from paged_jax.engine import (LLM, ChatTemplate, EngineState, Output, Session,
                                StreamEvent, default_token_buckets)
  from paged_jax.kv_cache import KVCache
  from paged_jax.kv_groups import KVGroups
  from paged_jax.models import (CheckpointNotFoundError, Decoder, ModelConfig, init_random,
                                load_pretrained)
  from paged_jax.protocol import ModelConfigLike, PagedModel
  from paged_jax.sampling import SamplingParams
  from paged_jax.spec import KVCacheSpec
  from paged_jax.step import (AttentionMetadata, StepInputs, Steps, decode_step,
                              forward_step, prepare_step, tokens_from_history)

_HOME = {
    "paged_jax.attention": ("checked_paged_attention", "paged_attention", "resolve_impl",
                            "validate_attention_inputs"),
    "paged_jax.engine": ("LLM", "ChatTemplate", "EngineState", "Output", "Session",
                         "StreamEvent", "default_token_buckets"),
    "paged_jax.kv_cache": ("KVCache",),
    "paged_jax.kv_groups": ("KVGroups",),
    "paged_jax.models": ("CheckpointNotFoundError", "Decoder", "ModelConfig", "init_random",
                         "load_pretrained"),
    "paged_jax.protocol": ("ModelConfigLike", "PagedModel"),
    "paged_jax.sampling": ("SamplingParams",),
    "paged_jax.spec": ("KVCacheSpec",),
    "paged_jax.step": ("AttentionMetadata", "StepInputs", "Steps", "decode_step",
                       "forward_step", "prepare_step", "tokens_from_history"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}
# Modules a user reaches as ``paged_jax.<name>`` after ``import paged_jax`` (imported on
# first use too): ``testing`` (assertions for your own model), ``sharding`` (meshes),
# ``models`` (the built-in decoders), ``pallas_kernels`` (the kernels themselves), ...
_SUBMODULES = ("allocator", "attention", "engine", "kv_cache", "kv_groups", "models",
               "pallas_kernels", "planner", "protocol", "sampling", "sharding", "spec",
               "step", "testing")


def __getattr__(name: str):
  if name in _MODULE_OF:
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"paged_jax.{name}")
  else:
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  # What a user may reach: the public names and the module's dunders, not the helpers this
  # file imports for itself (importlib, TYPE_CHECKING) nor private submodules.
  return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})


from paged_jax._version import __version__  # noqa: E402  (one place; the CLI reads it too)

__all__ = [
    "AttentionMetadata",
    "ChatTemplate",
    "CheckpointNotFoundError",
    "Decoder",
    "EngineState",
    "KVCache",
    "KVCacheSpec",
    "KVGroups",
    "LLM",
    "ModelConfig",
    "ModelConfigLike",
    "Output",
    "PagedModel",
    "SamplingParams",
    "Session",
    "StepInputs",
    "Steps",
    "StreamEvent",
    "allocator",
    "attention",
    "checked_paged_attention",
    "decode_step",
    "default_token_buckets",
    "engine",
    "forward_step",
    "init_random",
    "kv_cache",
    "kv_groups",
    "load_pretrained",
    "models",
    "paged_attention",
    "pallas_kernels",
    "planner",
    "prepare_step",
    "protocol",
    "resolve_impl",
    "sampling",
    "sharding",
    "spec",
    "step",
    "testing",
    "tokens_from_history",
    "validate_attention_inputs",
]
