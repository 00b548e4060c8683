"""The model protocol: what ``LLM``, ``Steps`` and the step API need of a model and config.

A model is any ``flax.nnx.Module`` with the method

    paged_forward(tokens_T, positions_T, cache, metadata, *, logits_indices=None)
        -> (logits, cache)

taking i32[T] tokens and positions, the ``KVCache`` and an ``AttentionMetadata``
(``paged_jax.step``), and returning logits ``[T, V]`` (one row per entry of
``logits_indices`` i32[S] when given) and the new cache. Its layers call
``cache.write(layer, k_TKD, v_TKD, metadata.slots_T)`` and ``paged_attention(q_THD, cache,
layer, metadata.kv_lens_S, metadata.block_tables_SP, metadata.cu_q_lens,
metadata.num_seqs)`` (under KV groups, below, with what ``metadata.for_layer(layer)``
returns in place of the layer, slots and tables). Nothing else is required (its
attributes need not hash: a config kept as a plain, mutable dataclass is served); the
built-in decoders (``paged_jax.models.Decoder``) are one implementation.

A config is any object with the int fields ``num_layers``, ``num_kv_heads``, ``head_dim``
(the KV cache's shape), ``vocab_size`` (prompt validation) and ``max_seq_len`` (longest
sequence), and optionally ``eos_token_ids`` (a tuple of ints; default none). A model that
keeps its own config as ``model.config`` (the built-in decoders do) must agree with the
given one on ``num_layers``, ``num_kv_heads`` and ``head_dim``.

Optional, for sliding-window layers that give blocks back: ``config.layer_windows``, one
entry per layer, None (full attention) or the layer's window W (the layer passes
``sliding_window=W`` to ``paged_attention``). With windowed freeing
(``LLM(..., free_outside_window=True)``, the default when ``kv_budget_bytes`` sizes the
pool) the engine puts the layers in KV groups (``paged_jax.kv_groups``): each group has its
own block tables and slots and the cache holds each group's layers, so each layer takes
what it writes and reads from ``cache_layer, slots_T, block_tables_SP =
metadata.for_layer(layer)`` (without groups that is ``(layer, metadata.slots_T,
metadata.block_tables_SP)``: a model written this way serves both layouts). A model that
ignores ``for_layer`` under groups is refused when its step traces where that shows: a
write or an attention given ``metadata.slots_T`` / ``metadata.block_tables_SP`` or the
traced index given to ``for_layer``, or a Python-int layer index past the cache's.

Optional, for ``LLM(..., mesh=...)`` with a "model" axis of size m > 1 (tensor
parallelism): a method ``with_model_axis(axis_name) -> model``, a copy whose forward runs
inside ``jax.shard_map`` on its slice of the weights and of the KV heads and ``psum``-s its
partial sums over ``axis_name``; which parameter axes are split is read from each
parameter's name (``paged_jax.sharding``: glossary letters H, K, I) unless the model
defines ``param_partition_specs(axis_name)`` returning a ``PartitionSpec`` pytree like
``nnx.state(model)``. A mesh whose "model" axis has size 1 (data parallel) needs nothing.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax._caller import user_stacklevel
from paged_jax.spec import KVCacheSpec

__all__ = ["CONFIG_FIELDS", "ModelConfigLike", "PagedModel", "check_config", "check_model",
           "check_model_config", "eos_token_ids", "kv_cache_spec", "layer_windows",
           "model_dtype"]

CONFIG_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_seq_len")
"""The int fields (>= 1) a config must have."""

_FORWARD = ("paged_forward(tokens_T, positions_T, cache, metadata, *, logits_indices=None) "
            "-> (logits, cache)")


@runtime_checkable
class PagedModel(Protocol):
  """What the engine and the step API call (module docstring)."""

  def paged_forward(self, tokens_T, positions_T, cache, metadata, *,
                    logits_indices=None) -> tuple[Any, Any]:
    """One step over ``tokens_T`` at ``positions_T``: each layer writes its K/V with
    ``cache.write`` and attends with ``paged_attention`` through ``metadata``; returns
    (logits ``[T, V]``, or one row per ``logits_indices`` entry, and the new cache)."""
    ...


@runtime_checkable
class ModelConfigLike(Protocol):
  """The config fields the engine reads (module docstring)."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  max_seq_len: int


class _ByIdentity:
  """A model structure that cannot be hashed, as a static argument of ``jax.jit``: hashed
  and compared by identity (one engine passes the same object every call)."""

  __slots__ = ("graphdef",)

  def __init__(self, graphdef):
    self.graphdef = graphdef


def static_graphdef(graphdef):
  """``graphdef`` (``nnx.split(model)[0]``) as a static argument of ``jax.jit``: itself
  when it hashes (models of equal structure then share compiled calls), else wrapped to be
  hashed by identity. A model may hold attributes that do not hash (a config kept as a
  plain, mutable dataclass); JAX refuses them as static arguments."""
  try:
    hash(graphdef)
  except TypeError:
    return _ByIdentity(graphdef)
  return graphdef


def merge(graphdef, params):
  """``nnx.merge`` of a graphdef, as it is or as ``static_graphdef`` wrapped it, over
  Variables made at the current trace level (``jax.tree.map`` rebuilds them; no op): merged
  inside a loop's body from parameters closed over from outside, the model may then run
  Flax transforms of its own (``nnx.scan`` over layers), which refuse Variables of another
  trace level."""
  return nnx.merge(graphdef.graphdef if isinstance(graphdef, _ByIdentity) else graphdef,
                   jax.tree.map(lambda leaf: leaf, params))


def check_model(model, *, serving: bool = False) -> None:
  """``ValueError`` naming what ``model`` lacks to be served (module docstring); with
  ``serving`` (an engine or ``Steps`` built over it) also a warning for a model left in
  training mode (``warn_training_mode``)."""
  _check_paged_forward(model)
  if serving:
    warn_training_mode(model)


def _check_paged_forward(model) -> None:
  """``check_model``'s checks: an ``nnx.Module`` whose ``paged_forward`` takes the
  protocol's arguments."""
  name = type(model).__name__
  if not isinstance(model, nnx.Module):
    raise ValueError(f"model={name} must be a flax.nnx.Module with a method {_FORWARD}")
  forward = getattr(model, "paged_forward", None)
  if not callable(forward):
    raise ValueError(f"model={name} lacks the method {_FORWARD} (paged_jax.protocol)")
  try:
    params = inspect.signature(forward).parameters
  except (TypeError, ValueError):  # a builtin or C callable: trust it
    return
  kinds = [p.kind for p in params.values()]
  varargs = inspect.Parameter.VAR_POSITIONAL in kinds
  positionals = [p for p in params.values() if p.kind in (
      inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
  takes_indices = ("logits_indices" in params
                   and params["logits_indices"].kind != inspect.Parameter.POSITIONAL_ONLY
                   or inspect.Parameter.VAR_KEYWORD in kinds)
  # Past the four and logits_indices every parameter needs a default: the engine passes
  # nothing else.
  empty, keyword_only = inspect.Parameter.empty, inspect.Parameter.KEYWORD_ONLY
  required = [p.name for p in positionals[4:] if p.default is empty] + [
      p.name for p in params.values()
      if p.kind is keyword_only and p.default is empty and p.name != "logits_indices"]
  if (len(positionals) < 4 and not varargs) or not takes_indices or required:
    extra = (f" (the engine passes nothing for {', '.join(required)}: give "
             f"{'it' if len(required) == 1 else 'them'} a default)" if required else "")
    raise ValueError(f"model={name}.paged_forward{inspect.signature(forward)} must accept "
                     f"{_FORWARD}{extra}")


def check_logits(model, logits_SV, vocab_size: int | None) -> None:
  """``ValueError`` at trace time where the logits ``model.paged_forward`` returned are not
  floating or not ``[S, V]`` with V = ``vocab_size`` (when given): the engine's sampled
  ids index the vocabulary."""
  if vocab_size and logits_SV.shape[-1] != vocab_size:
    raise ValueError(f"{type(model).__name__}.paged_forward returned logits of shape "
                     f"{tuple(logits_SV.shape)}: [S, V] must have V = config.vocab_size="
                     f"{vocab_size}")
  if not jnp.issubdtype(logits_SV.dtype, jnp.floating):
    raise ValueError(f"{type(model).__name__}.paged_forward returned logits of dtype "
                     f"{logits_SV.dtype}: they must be a floating dtype")


def warn_training_mode(model) -> None:
  """Warns (at the user's line) when ``model`` holds an ``nnx.Dropout`` set to
  ``deterministic=False`` (rate > 0) or an ``nnx.BatchNorm`` set to
  ``use_running_average=False``, as Flax builds them and ``model.train()`` leaves them:
  unless ``paged_forward`` overrides them at the call, a Dropout drops activations at
  random in every served step (its RNG state's updates are dropped) and a BatchNorm
  normalises by each batch's statistics. ``None`` (decided at the call) is not warned
  about. ``model.eval()`` first."""
  for path, node in nnx.iter_graph(model):
    where = ".".join(map(str, path)) or "the top"
    if (isinstance(node, nnx.Dropout) and getattr(node, "deterministic", None) is False
        and node.rate > 0):
      what = (f"its Dropout at {where} has deterministic=False (served so, it drops "
              "activations at random in every step)")
    elif (isinstance(node, nnx.BatchNorm)
          and getattr(node, "use_running_average", None) is False):
      what = (f"its BatchNorm at {where} has use_running_average=False (served so, each "
              "step normalises by its own batch)")
    else:
      continue
    warnings.warn(f"model={type(model).__name__} may be in training mode: {what}, unless "
                  "paged_forward passes otherwise at the call; call model.eval() before "
                  "serving it", UserWarning, stacklevel=user_stacklevel())
    return


def check_config(config) -> None:
  """``ValueError`` naming the first field ``config`` lacks (or holds a bad value in)."""
  name = type(config).__name__
  for field in CONFIG_FIELDS:
    if not hasattr(config, field):
      raise ValueError(f"config={name} lacks the field {field!r}: a config needs the ints "
                       f"{', '.join(CONFIG_FIELDS)} (paged_jax.protocol)")
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"config.{field}={value!r} must be an int >= 1")
  eos_token_ids(config)
  layer_windows(config)


# The config fields that shape the KV cache.
_CACHE_FIELDS = ("num_layers", "num_kv_heads", "head_dim")


def check_model_config(model, config) -> None:
  """``ValueError`` when ``model`` keeps a config of its own (``model.config``, as the
  built-in decoders do) whose cache fields differ from ``config``'s: the cache would have
  the given config's shape, and more layers than the model writes would only waste KV
  memory (fewer fail inside the forward). A model without ``.config`` is not checked."""
  own = getattr(model, "config", None)
  if own is None or own is config:
    return
  for field in _CACHE_FIELDS:
    mine = getattr(own, field, None)
    if isinstance(mine, bool) or not isinstance(mine, (int, np.integer)):
      continue
    if int(mine) != int(getattr(config, field)):
      raise ValueError(f"config.{field}={getattr(config, field)} disagrees with the model's "
                       f"own {type(model).__name__}.config.{field}={mine}: the KV cache "
                       f"takes the config's shape")


def layer_windows(config) -> tuple | None:
  """``config.layer_windows`` checked (module docstring) as a tuple of L entries, None or an
  int >= 1 each; None when the config has none."""
  windows = getattr(config, "layer_windows", None)
  if windows is None:
    return None
  num_layers = int(config.num_layers)
  try:
    windows = tuple(windows)
  except TypeError:
    windows = None
  if windows is None or len(windows) != num_layers:
    raise ValueError(f"config.layer_windows={getattr(config, 'layer_windows')!r} must be a "
                     f"tuple of num_layers={num_layers} entries, None (full attention) or a "
                     "sliding window W")
  for i, w in enumerate(windows):
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                          or w < 1):
      raise ValueError(f"config.layer_windows[{i}]={w!r} must be None (full attention) or "
                       "an int >= 1 (the layer's sliding window)")
  return tuple(None if w is None else int(w) for w in windows)


def eos_token_ids(config) -> tuple[int, ...]:
  """``config.eos_token_ids`` as a tuple of ints (empty when absent or None)."""
  ids = getattr(config, "eos_token_ids", None)
  if ids is None:
    return ()
  if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
    ids = (ids,)
  try:
    ids = tuple(ids)
  except TypeError:
    ids = None
  if ids is None or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                            and t >= 0 for t in ids):
    raise ValueError(f"config.eos_token_ids={getattr(config, 'eos_token_ids')!r} must be a "
                     "tuple of ints >= 0")
  return tuple(int(t) for t in ids)


def served_eos_token_ids(config) -> tuple[int, ...]:
  """``eos_token_ids(config)`` for an engine to stop at, with a ``UserWarning`` (at the
  user's line) naming any id outside ``[0, vocab_size)``: the model can never emit it, so
  its requests end only at ``max_tokens`` or a stop id (a checkpoint's EOS past a
  truncated vocabulary). Kept, not refused: the rest of the ids still stop."""
  ids = eos_token_ids(config)
  outside = [t for t in ids if t >= config.vocab_size]
  if outside:
    warnings.warn(f"config.eos_token_ids={ids} holds {outside}, outside the vocabulary "
                  f"(vocab_size={config.vocab_size}): the model never emits "
                  f"{'it' if len(outside) == 1 else 'them'}, so no request stops there",
                  UserWarning, stacklevel=user_stacklevel())
  return ids


def model_dtype(model) -> jnp.dtype:
  """The model's dtype: its ``dtype`` attribute when it has one, else the dtype most of
  its floating ``nnx.Param`` elements have, else float32."""
  dtype = getattr(model, "dtype", None)
  if dtype is not None:
    try:
      return jnp.dtype(dtype)
    except TypeError:
      pass
  sizes: dict[Any, int] = {}
  for _, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = value.get_value() if hasattr(value, "get_value") else value
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      sizes[jnp.dtype(x.dtype)] = sizes.get(jnp.dtype(x.dtype), 0) + int(np.prod(x.shape))
  return max(sizes, key=sizes.get) if sizes else jnp.dtype(jnp.float32)


def kv_cache_spec(config, *, block_size: int, num_blocks: int, dtype) -> KVCacheSpec:
  """The ``KVCacheSpec`` a model of ``config`` needs: L, K, D from the config."""
  return KVCacheSpec(num_layers=int(config.num_layers), num_kv_heads=int(config.num_kv_heads),
                     head_dim=int(config.head_dim), block_size=block_size,
                     num_blocks=num_blocks, dtype=dtype)
