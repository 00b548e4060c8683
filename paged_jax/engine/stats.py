"""``LLM.stats``: the engine's counters and its pool now, as one dict."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import allocator

__all__ = ["engine_stats"]


def engine_stats(llm) -> dict[str, Any]:
  """``llm.stats`` (``LLM.stats`` says what each entry counts)."""
  r, h = llm._scheduler.device_counters, llm._scheduler.counters
  steps, busy = r.get("steps", 0), r.get("busy_steps", 0)
  preempt, peak = r.get("preemptions", 0), r.get("peak_blocks_in_use", 0)
  mean_blocks = r.get("blocks_in_use_sum", 0.0) / max(steps, 1)
  util = r["utilization_sum"] / busy if busy else 0.0
  tokens = h["tokens"]
  wall_s = max(h["wall_s"] - llm._device.serve_compile_s, 0.0)
  # The pool now (read on demand, outside the serving loop), not since a reset.
  # On the host (numpy): an eager jnp reduction here compiled on the first stats read.
  fetch = jax.device_get if llm._plan is None else llm._plan.fetch
  with llm._state_lock:  # no device call replaces the arrays while they are read
    alloc = llm.allocator_state
    host = dataclasses.replace(alloc, ref_counts=fetch(alloc.ref_counts),
                               depth_N=fetch(alloc.depth_N), num_free=fetch(alloc.num_free))
  free, cached = int(np.sum(host.num_free)), int(np.sum(allocator.cached_N(host)))
  prompt_tokens = r.get("prompt_tokens", 0)
  cached_tokens = r.get("cached_prompt_tokens", 0)
  return dict(
      preemptions=preempt, kv_utilization=util,
      prefix_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
      prompt_tokens=prompt_tokens, cached_prompt_tokens=cached_tokens,
      cached_blocks=cached,
      tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
      requests_per_s=h["requests"] / wall_s if wall_s > 0 else 0.0,
      num_blocks=llm.spec.num_blocks, num_free_blocks=free,
      kv_cache_dtype=jnp.dtype(llm.spec.dtype).name, block_size=llm.spec.block_size,
      kv_pool_bytes=llm.spec.total_bytes, kv_group_windows=llm.kv_groups.windows,
      prefix_caching=llm.enable_prefix_caching,
      host_syncs=h["host_syncs"],
      host_syncs_per_token=h["host_syncs"] / tokens if tokens else 0.0,
      peak_blocks_in_use=peak, mean_blocks_in_use=mean_blocks, steps=steps,
      device_calls=h["device_calls"], generated_tokens=tokens, requests=h["requests"],
      wall_s=wall_s, compile_s=sum(llm._device.compile_seconds.values()))
