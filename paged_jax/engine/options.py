"""Checks of ``LLM``'s options: each bad value is a ``ValueError`` naming the argument and
what was expected, raised before anything is built or compiled."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from paged_jax import protocol
from paged_jax._caller import user_stacklevel
from paged_jax.spec import KVCacheSpec, _canonical_dtype as canonical_dtype

__all__ = ["pool_spec", "check_plain", "check_int", "check_bools", "check_seed",
           "check_tokenizer", "check_budget", "pool_dtype", "check_token_buckets",
           "check_max_model_len", "limit_note", "pretrained_signature",
           "check_pretrained_keywords"]


def check_int(name: str, value, low: int = 1) -> int:
  """``value`` as an int in ``[low, 2**31)``: the device counts in int32."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name}={value!r} must be an int >= {low}")
  if value >= 2**31:
    raise ValueError(f"{name}={value!r} must be < 2**31 (the engine counts in int32)")
  return int(value)


def check_plain(*, block_size, max_seqs, max_tokens_per_step, steps_per_call, num_blocks,
                kv_budget_bytes, seed, tokenizer, max_traces, enable_prefix_caching,
                scrub_on_release, free_outside_window, prefix_hash_fn) -> None:
  """The options of ``LLM`` checked on their own (the pool's, which depend on the model
  and each other, are checked as the pool is sized)."""
  for name, value in (("block_size", block_size), ("max_seqs", max_seqs),
                      ("max_tokens_per_step", max_tokens_per_step),
                      ("steps_per_call", steps_per_call)):
    check_int(name, value)
  if num_blocks is not None and kv_budget_bytes is not None:
    raise ValueError(f"{num_blocks=} and {kv_budget_bytes=}: give at most one")
  check_seed(seed)
  check_tokenizer(tokenizer)
  if max_traces is not None:
    check_int("max_traces", max_traces)
  check_bools(enable_prefix_caching=enable_prefix_caching, scrub_on_release=scrub_on_release,
              free_outside_window=free_outside_window)
  if prefix_hash_fn is not None and not callable(prefix_hash_fn):
    raise ValueError(f"{prefix_hash_fn=} must be None or a function like "
                     "allocator.chain_hashes")


def check_seed(seed) -> int:
  """``seed``: seeds numpy's draw of request seeds, an int >= 0."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"{seed=} must be an int >= 0")
  return int(seed)


def check_tokenizer(tokenizer) -> None:
  """``tokenizer``: None or an object with ``encode(text)`` and ``decode(ids)``: a
  ``tokenizers.Tokenizer`` (``encode`` gives an Encoding, its ``.ids`` the token ids) or a
  transformers tokenizer (``encode`` gives the list)."""
  if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                    and callable(getattr(tokenizer, "decode", None))):
    raise ValueError(f"tokenizer={type(tokenizer).__name__} must be None, a "
                     "tokenizers.Tokenizer or a transformers tokenizer (encode(text) and "
                     "decode(ids))")


def load_tokenizer(path: str):
  """The ``tokenizers.Tokenizer`` of a checkpoint's ``tokenizer.json``, or None when the
  optional ``tokenizers`` package is missing; a file it cannot read is a ``ValueError``."""
  try:
    import tokenizers
  except ImportError:
    return None
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the library raises a bare Exception on a bad file
    raise ValueError(f"{path} is not a tokenizer the tokenizers library reads ({e}); "
                     "replace it, or remove it to serve token ids only") from None


def check_budget(kv_budget_bytes, block_bytes: int, what: str) -> None:
  """``kv_budget_bytes``: an int holding one block at least (``what`` says of which
  shape)."""
  if (isinstance(kv_budget_bytes, bool) or not isinstance(kv_budget_bytes, (int, np.integer))
      or kv_budget_bytes < block_bytes):
    raise ValueError(f"{kv_budget_bytes=} must be an int number of bytes >= one KV block "
                     f"({block_bytes} bytes: {what})")


def check_bools(**flags) -> None:
  for name, value in flags.items():
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f"{name}={value!r} must be a bool")


def pool_dtype(dtype, kv_cache_dtype):
  """The KV pool's dtype from ``LLM``'s two spellings of it (None: the model's)."""
  if kv_cache_dtype is None:
    return None if dtype is None else canonical_dtype(dtype, "dtype")
  kv_cache_dtype = canonical_dtype(kv_cache_dtype, "kv_cache_dtype")
  if dtype is not None and canonical_dtype(dtype) != kv_cache_dtype:
    raise ValueError(f"dtype={jnp.dtype(dtype).name} and kv_cache_dtype="
                     f"{kv_cache_dtype.name}: both name the KV pool's dtype; give one")
  return kv_cache_dtype


def check_token_buckets(token_buckets, max_tokens_per_step: int) -> tuple[int, ...]:
  if (isinstance(token_buckets, (str, bytes)) or not isinstance(token_buckets, Sequence)
      or not token_buckets
      or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1
             for b in token_buckets)
      or list(token_buckets) != sorted(set(token_buckets))
      or token_buckets[-1] != max_tokens_per_step):
    raise ValueError(f"token_buckets={token_buckets!r} must be increasing ints >= 1 ending "
                     f"at max_tokens_per_step={max_tokens_per_step}")
  return tuple(int(b) for b in token_buckets)


def check_max_model_len(max_model_len, max_seq_len: int, pool_tokens: int,
                        limit: str) -> tuple[int, str]:
  """``(max_model_len, note)``: ``max_model_len`` (None: the longest the model and the pool
  allow) as an int, and what bounds it, for the refusal of a prompt too long. ``limit``:
  ``limit_note``'s account of the model's and the pool's bound, for the messages; the note
  is that, or the caller's own smaller value named as theirs."""
  bound = min(max_seq_len, pool_tokens)
  if max_model_len is None:
    if bound < 2:  # one prompt token and one generated, at least
      raise ValueError(f"the longest sequence this engine could serve is {bound} token(s) "
                       f"({limit}); it must be >= 2: a prompt token and a generated one")
    if bound < max_seq_len:
      warnings.warn(
          f"max_model_len={bound}, below the model's context {max_seq_len}: no sequence "
          f"longer fits the KV pool alone ({limit}); one that reaches it ends with "
          "finish_reason 'length'. Give the pool more blocks (num_blocks, kv_budget_bytes) "
          "for longer sequences, or pass max_model_len to choose this limit (and silence "
          "this warning)", UserWarning, stacklevel=user_stacklevel())
    return int(bound), limit
  if (isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer))
      or not 2 <= max_model_len <= bound):
    raise ValueError(f"{max_model_len=} must be an int in [2, {bound}]: the longest sequence "
                     f"the model and the pool allow ({limit})")
  if max_model_len < bound:  # the caller's own limit: a too-long prompt names it
    limit = f"as passed to LLM; the model and the pool allow up to {bound}: {limit}"
  return int(max_model_len), limit


def limit_note(max_seq_len: int, spec, kv_groups, pool_tokens: int, shards: int) -> str:
  """What bounds ``max_model_len``, for the refusal of a prompt too long: the model's
  context and the longest sequence the pool holds alone (with KV groups every group holds
  a block per logical block, its window's in a sliding one, so that is less than the
  pool's token slots)."""
  blocks = spec.num_blocks // shards
  note = f"model context {max_seq_len}, KV pool {blocks} blocks x {spec.block_size} tokens"
  if shards > 1:
    note += " per data shard"
  if not kv_groups.slides:
    return note + f" = {blocks * spec.block_size} tokens"  # pool_tokens: capped at context
  windows = kv_groups.windows
  fits = f"{pool_tokens} tokens" if pool_tokens < max_seq_len else "the whole context or more"
  if kv_groups.plain:  # every layer slides: a sequence holds its window's blocks only
    return note + f", every layer sliding (window {windows[0]}): one sequence fits in {fits}"
  return note + (f" shared by {len(windows)} KV groups ({windows.count(None)} full, "
                 f"{len(windows) - windows.count(None)} sliding): one sequence fits in {fits}")


def pool_spec(config, kv_dtype, layers: int, *, block_size: int, num_blocks, kv_budget_bytes,
              max_seqs: int, shards: int) -> KVCacheSpec:
  """The KV pool's spec from ``LLM``'s options: ``num_blocks`` blocks, or as many as
  ``kv_budget_bytes`` holds (rounded down to a multiple of the data shards), or enough
  for ``max_seqs`` sequences of ``min(config.max_seq_len, 2048)`` tokens. A block holds
  ``layers`` layers (one KV group's; all L without groups); with a mesh each data shard
  owns N / d blocks."""
  c = config
  if kv_budget_bytes is not None:
    probe = dataclasses.replace(protocol.kv_cache_spec(c, block_size=block_size, num_blocks=1,
                                                       dtype=kv_dtype), num_layers=layers)
    check_budget(kv_budget_bytes, probe.block_bytes,
                 f"K and V x {layers} layers x {c.num_kv_heads} KV heads x head_dim "
                 f"{c.head_dim} x block_size {block_size} of {probe.dtype.name}"
                 + (", with their scales" if probe.quantized else ""))
    spec = KVCacheSpec.from_budget(kv_budget_bytes, layers, c.num_kv_heads, c.head_dim,
                                   block_size, kv_dtype)
    blocks = spec.num_blocks
    if blocks < shards:
      raise ValueError(f"{kv_budget_bytes=} holds {blocks} KV block(s) of "
                       f"{spec.block_bytes} bytes; each of the mesh's {shards} data shards "
                       f"needs one at least: >= {shards * spec.block_bytes} bytes")
    spec = dataclasses.replace(spec, num_blocks=blocks - blocks % shards)
  else:
    if num_blocks is None:
      num_blocks = max_seqs * math.ceil(min(c.max_seq_len, 2048) / block_size)
    spec = dataclasses.replace(protocol.kv_cache_spec(c, block_size=block_size,
                                                      num_blocks=num_blocks, dtype=kv_dtype),
                               num_layers=layers)
  for name, value in (("max_seqs", max_seqs), ("num_blocks", spec.num_blocks)):
    if value % shards:
      raise ValueError(f"{name}={value} must be a multiple of mesh.shape['data']={shards} "
                       f"(each data shard owns {name} / {shards})")
  return spec


def _engine_options(engine_cls) -> list[inspect.Parameter]:
  """The keyword options of ``engine_cls.__init__`` beside a loaded model: all but ``self``,
  ``model``, ``config`` and ``dtype`` (``from_pretrained`` has its own, the model's)."""
  params = inspect.signature(engine_cls.__init__).parameters.values()
  return [p for p in params if p.name not in ("self", "model", "config", "dtype")]


def pretrained_signature(engine_cls) -> inspect.Signature:
  """``from_pretrained``'s signature with the engine's options spelled out, so that
  ``help``, ``inspect`` and editors show them (its code takes them as ``**kwargs``)."""
  own = list(inspect.signature(engine_cls.from_pretrained.__func__).parameters.values())
  return inspect.Signature([p for p in own if p.kind != p.VAR_KEYWORD]
                           + _engine_options(engine_cls))


def check_pretrained_keywords(engine_cls, kwargs: dict) -> None:
  """A ``TypeError`` (as Python gives for a call) for a keyword the engine does not take,
  raised before a checkpoint is read: a misspelt option would surface only after loading."""
  options = _engine_options(engine_cls)
  if any(p.kind == p.VAR_KEYWORD for p in options):  # a subclass taking **kwargs: its call
    return
  names = {p.name for p in options}
  unknown = sorted(set(kwargs) - names)
  if unknown:
    raise TypeError(f"LLM.from_pretrained() got an unexpected keyword argument "
                    f"{unknown[0]!r}; the engine's options: {', '.join(sorted(names))}")
