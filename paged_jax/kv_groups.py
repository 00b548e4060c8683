"""KV groups: which layers share a block table, and what a sequence holds in the pool.

Layers of one attention kind (full attention, or a sliding window W) can share a block
table, because they need the same tokens. A *group* is M layers of one kind; every group
has M layers, so one pool of one block size serves them all: a physical block holds Z
tokens of the M layers of the ONE group that owns it (the cache is ``[M, K, N, Z, D]``, its
"layer" index is a layer's slot in its group), and each group has its own block table per
sequence (``allocator.init(..., windows=KVGroups.windows)``). M is the greatest common
divisor of the kinds' layer counts: Gemma 3's 5:1 pattern of 6 layers gives six one-layer
groups (five sliding, one full); a model of one kind is one group of all its L layers,
which is the plain layout (cache ``[L, ...]``, one table).

Why one pool of equal groups (as vLLM's hybrid allocator does) rather than a pool per
kind: the split between full and sliding memory then follows the workload instead of
being fixed in advance, and the allocator stays one allocator with a group axis.

A sliding group gives back the blocks behind every query still to come
(``allocator.slide``), so a sequence of length n holds at most
``sliding_blocks(W, Z, q)`` blocks in it (q: the tokens one step adds), against
``ceil(n / Z)`` in a full group.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KVGroups", "layer_windows_of", "sliding_blocks"]


def sliding_blocks(window: int, block_size: int, step_tokens: int) -> int:
  """The most blocks a sliding group of window W holds for one sequence, whatever its
  length, when a step adds at most ``step_tokens`` (q) tokens: before the step it keeps the
  blocks from ``(L - W + 1) // Z`` on, after it the step's tokens end at ``L + q``; that
  span of ``W - 1 + q`` tokens touches at most ``ceil((W - 1 + q) / Z) + 1`` blocks."""
  return -(-(window - 1 + step_tokens) // block_size) + 1


def layer_windows_of(config) -> tuple:
  """Each layer's sliding window (None: full attention): ``config.layer_windows`` when the
  config has one (an own model's, ``paged_jax.protocol``), else as the built-in decoders
  read it (``ModelConfig.attention_kinds`` and ``window_of``); every layer full for a
  config with neither. A window of ``config.max_seq_len`` or more hides no key of any
  sequence the model serves: that layer counts as full (None), so it neither forms a
  sliding group nor turns prefix caching off."""
  from paged_jax import protocol
  windows = protocol.layer_windows(config)
  if windows is None:
    kinds = getattr(config, "attention_kinds", None)
    if kinds is None or not hasattr(config, "window_of"):
      return (None,) * int(config.num_layers)
    names, kind_of_layer = kinds()
    windows = tuple(config.window_of(names[k]) for k in kind_of_layer)
  context = int(config.max_seq_len)
  return tuple(None if w is not None and w >= context else w for w in windows)


@dataclasses.dataclass(frozen=True)
class KVGroups:
  """The grouping of a model's layers (module docstring); static, hashable."""

  windows: tuple  # per group (g): None or W
  group_of_layer: tuple  # per layer (L)
  slot_of_layer: tuple  # per layer: its index among its group's M layers (the cache layer)
  layers_per_group: int  # M

  @classmethod
  def from_layer_windows(cls, layer_windows, *, free_outside_window: bool = True
                         ) -> "KVGroups":
    """Groups of ``layer_windows`` (one entry per layer). ``free_outside_window=False``:
    one full group of every layer (each layer still masks its own window), the layout
    without windowed freeing."""
    layer_windows = tuple(layer_windows)
    if not layer_windows:
      raise ValueError(f"layer_windows={layer_windows!r} must name at least one layer")
    for layer, w in enumerate(layer_windows):
      if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                            or w < 1):
        raise ValueError(f"layer_windows[{layer}]={w!r} must be None (full attention) or "
                         "an int window >= 1")
    num_layers = len(layer_windows)
    if not free_outside_window:
      return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    kinds = tuple(dict.fromkeys(layer_windows))
    if len(kinds) == 1:
      return cls(kinds, (0,) * num_layers, tuple(range(num_layers)), num_layers)
    m = math.gcd(*(layer_windows.count(w) for w in kinds))
    windows, group_of_layer, slot_of_layer = [], [0] * num_layers, [0] * num_layers
    for w in kinds:
      for i, layer in enumerate(l for l in range(num_layers) if layer_windows[l] == w):
        if i % m == 0:
          windows.append(w)
        group_of_layer[layer], slot_of_layer[layer] = len(windows) - 1, i % m
    return cls(tuple(windows), tuple(group_of_layer), tuple(slot_of_layer), m)

  @property
  def num_groups(self) -> int:
    return len(self.windows)

  @property
  def num_layers(self) -> int:
    return len(self.group_of_layer)

  @property
  def plain(self) -> bool:
    """One group of every layer: the cache and metadata of a model without groups."""
    return self.num_groups == 1

  @property
  def slides(self) -> bool:
    """Static: whether any group has a sliding window (its blocks then go back)."""
    return any(w is not None for w in self.windows)

  def blocks_held(self, seq_len: int, block_size: int, step_tokens: int) -> int:
    """The most blocks (over every group) one sequence of ``seq_len`` tokens holds."""
    full = -(-seq_len // block_size)
    return sum(full if w is None else min(full, sliding_blocks(w, block_size, step_tokens))
               for w in self.windows)

  def max_len_in_pool(self, num_blocks: int, block_size: int, step_tokens: int,
                      limit: int) -> int:
    """The longest sequence (at most ``limit``) whose blocks the pool holds alone."""
    if self.blocks_held(limit, block_size, step_tokens) <= num_blocks:
      return limit
    lo, hi = 0, limit  # blocks_held is non-decreasing in the length
    while lo < hi:
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if self.blocks_held(mid, block_size, step_tokens) <= num_blocks \
          else (lo, mid - 1)
    return lo

  def layer_arrays(self) -> tuple[jax.Array, jax.Array]:
    """(i32[L] group of each layer, i32[L] its cache layer), for ``AttentionMetadata``."""
    return (jnp.asarray(self.group_of_layer, jnp.int32),
            jnp.asarray(self.slot_of_layer, jnp.int32))
