"""The serving engine: continuous batching inside ``jit``, preemption by recompute.

Host API: ``LLM`` (``LLM.from_pretrained``), ``generate``, ``chat``, ``generate_stream``,
``session`` (``Session``: requests added and aborted while it serves), ``stats``,
``precompile``;
``SamplingParams`` lives in ``paged_jax.sampling``. The engine serves any model of the
protocol (``paged_jax.protocol``). Its modules, each readable alone:

- ``state``: ``EngineState``, all device-side state in one pytree, and its small edits;
- ``device``: one scheduling step (prefix hits, token budget, blocks and preemption, one
  ragged forward through ``paged_jax.step``, forks, sampling, stops); ``loop``: the device
  call (a ``while_loop`` of steps) and its report; ``prefix_wait``: which new sequences
  wait a step for a block another is filling; ``scoring``: prompt log-probs;
- ``calls``: the jitted device calls of one engine and their compilation;
- ``scheduler``: the host side (requests, slots, token buckets, reading reports);
  ``results``: ``Output`` and ``StreamEvent``;
- ``session``: serving as requests come and go (``Session``), and ``generate_stream``'s
  loop on it;
- ``stream``: ``generate_stream``'s generator, started at its first event;
- ``text``: prompts to token ids, and each completion's text as it grows (stop strings);
- ``chat``: conversations to prompts through a checkpoint's chat template (``LLM.chat``);
- ``salts``: the ids of ``cache_salt`` strings;
- ``options``: the checks of ``LLM``'s options (a ``ValueError`` naming each bad one);
- ``llm``: ``LLM``, construction, ``generate``, ``stats``.
"""

from __future__ import annotations

from paged_jax.engine.chat import ChatTemplate
from paged_jax.engine.loop import device_call as _device_call
from paged_jax.engine.llm import LLM
from paged_jax.engine.scheduler import Output, StreamEvent, default_token_buckets
from paged_jax.engine.session import Session
from paged_jax.engine.state import EngineState
from paged_jax.sampling import SamplingParams

__all__ = ["LLM", "ChatTemplate", "Output", "SamplingParams", "Session", "StreamEvent",
           "EngineState", "default_token_buckets"]
