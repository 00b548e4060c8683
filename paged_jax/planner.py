"""KV capacity planning: how many sequences fit a memory budget, paged or contiguous.

The sequence lengths come from a long-tailed (log-normal) distribution, clipped to
``[1, max_len]``, drawn in arrival order with a fixed seed. Three ways to hold them:

- paged: each sequence takes ``ceil(len / Z)`` blocks, so the waste is one block's tail;
- contiguous, max length: each sequence reserves ``max_len`` tokens up front (what a
  static-shape cache does);
- contiguous, oracle: each reserves exactly its final length (an unreachable lower bound
  on contiguous waste, since the final length is unknown when a request arrives).

For each: the number of sequences of the stream that fit (the longest prefix of arrivals
whose reservations fit in the pool) and the KV utilisation (tokens held / tokens reserved).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from paged_jax import _words
from paged_jax.kv_groups import KVGroups
from paged_jax.spec import KVCacheSpec

MAX_BUDGET_BYTES = 2**60  # 1 EiB: past any device
MAX_STREAM = 2**23  # sequences the plan draws at most (~0.5 GB of host memory at the peak)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "eb": 10**18, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "eib": 2**60}


def parse_bytes(text: str | int, name: str = "budget") -> int:
  """``"16GiB"``, ``"8GB"``, ``"1.5e9"`` or an int -> bytes; errors name ``name`` (the
  CLI passes its option, ``--budget``)."""
  if isinstance(text, (int, np.integer)):
    return int(text)
  # The number's exponent needs digits after the e: "10EiB" is 10 EiB, "1.5e9" a count.
  match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+]?[0-9]+)?)\s*([a-zA-Z]*)\s*",
                       str(text))
  if not match or match.group(2).lower() not in _UNITS:
    raise ValueError(f"{name}={text!r} must be a size like '16GiB', '8GB' or a byte count")
  try:
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
  except ValueError as e:
    raise ValueError(f"{name}={text!r} must be a size like '16GiB', '8GB'") from e
  if not value < MAX_BUDGET_BYTES:  # inf and nan too
    raise ValueError(f"{name}={text!r} must be below 1 EiB (2**60 bytes)")
  return int(value)


def format_bytes(num_bytes: float) -> str:
  """A size in the largest binary unit it reaches: "16.00 GiB", "24.0 KiB", "512 bytes"."""
  for unit, digits in (("GiB", 2), ("MiB", 1), ("KiB", 1)):
    scale = _UNITS[unit.lower()]  # the parser's units
    if num_bytes >= scale:
      return f"{num_bytes / scale:.{digits}f} {unit}"
  return f"{int(num_bytes)} bytes"


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The part of a model that sizes its KV cache.

  ``layer_types``: () (every layer full attention) or "full_attention" /
  "sliding_attention" per layer, as transformers reads the config; ``sliding_window``: W
  of the sliding layers. Without windowed freeing every layer holds a block for each Z
  tokens of its sequence; with it (``plan_windowed``) sliding layers hold their window.
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any = jnp.bfloat16
  name: str = "custom"
  layer_types: tuple[str, ...] = ()
  sliding_window: int | None = None
  notes: tuple[str, ...] = ()  # what the plan assumed of the config, printed under it
  unknown_dtype: str | None = None  # the config's dtype when not a float one, "" when it
                                    # declares none (planned as float32, noted)


# The embedded default: Llama-3-8B's attention shape.
LLAMA3_8B = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                       name="Llama-3-8B shape (embedded default)")

_HF_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _config_int(path: str, config: dict, key: str) -> int:
  """``config[key]``, an int >= 1, or a ``ValueError`` naming the key and the file."""
  if key not in config:
    raise ValueError(f"config={path!r} lacks {key!r}")
  value = config[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"config={path!r}: {key}={value!r} must be an int >= 1")
  return value


def model_shape_from_config(path: str | os.PathLike) -> ModelShape:
  """A ``ModelShape`` from a Hugging Face ``config.json`` (or the directory holding it)."""
  path = os.path.expanduser(os.fspath(path))
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.exists(path):
    from paged_jax.models.config import CheckpointNotFoundError  # only when refusing
    raise CheckpointNotFoundError(f"config={path!r} does not exist")
  if not os.path.isfile(path):
    raise ValueError(f"config={path!r} is not a file (a Hugging Face config.json)")
  with open(path, encoding="utf-8") as f:
    try:
      config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"config={path!r} is not valid JSON: {e}") from e
  if not isinstance(config, dict):
    raise ValueError(f"config={path!r} must hold a JSON object (a Hugging Face config.json)")
  notes = []
  text = config.get("text_config")
  if "num_attention_heads" not in config and isinstance(text, dict):
    # A multimodal config (Gemma 3, Llama 4, ...): the KV cache is its text model's.
    from paged_jax.models.config import text_config_of
    gemma3 = config.get("model_type") == "gemma3"  # served: its text decoder
    notes.append(f"model_type={config.get('model_type')!r} is multimodal: planned from its "
                 f"text_config ({text.get('model_type')!r})" + (
                     ", the text decoder load_pretrained serves" if gemma3 else ""))
    outer = config
    config = {"_name_or_path": config.get("_name_or_path"),
              **(text_config_of(config) if gemma3 else text)}
    for key in ("torch_dtype", "dtype"):
      config.setdefault(key, outer.get(key))
  num_heads, num_layers, hidden = (_config_int(path, config, key) for key in (
      "num_attention_heads", "num_hidden_layers", "hidden_size"))
  num_kv_heads = config.get("num_key_value_heads")
  num_kv_heads = num_heads if num_kv_heads is None else _config_int(path, config,
                                                                    "num_key_value_heads")
  head_dim = config.get("head_dim")
  head_dim = hidden // num_heads if head_dim is None else _config_int(path, config, "head_dim")
  if head_dim < 1:
    raise ValueError(f"config={path!r}: head_dim={head_dim} (hidden_size / "
                     "num_attention_heads when not given) must be >= 1")
  # As load_pretrained reads it: a dtype it does not load, or none, serves as float32.
  dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "")
  # Lazy: the layer-type defaults of each family live with the model config.
  from paged_jax.models.config import SUPPORTED_MODEL_TYPES, hf_attention_layout
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    notes.append(f"model_type={model_type!r} is not a family paged-jax loads (one of "
                 f"{', '.join(SUPPORTED_MODEL_TYPES)}); planned from its attention shape")
  try:
    layer_types, window = hf_attention_layout(config)
  except ValueError as e:
    raise ValueError(f"config={path!r}: {e}") from e
  return ModelShape(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=_HF_DTYPES.get(dtype_name, jnp.float32),
                    name=_config_name(config, path),
                    layer_types=layer_types if window is not None else (),
                    sliding_window=window, notes=tuple(notes),
                    unknown_dtype=None if dtype_name in _HF_DTYPES else dtype_name)


def _config_name(config: dict, path: str) -> str:
  """What the plan calls a config: its ``_name_or_path``, else its checkpoint folder (a
  file named config.json) or its file name, with the ``model_type`` beside it."""
  name = config.get("_name_or_path")
  if not name:
    path = os.path.abspath(path)
    name = (os.path.basename(os.path.dirname(path))
            if os.path.basename(path) == "config.json" else os.path.basename(path))
  model_type = config.get("model_type")
  return f"{name} ({model_type})" if model_type and model_type != name else name


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
  """Log-normal sequence lengths (prompt + output tokens), clipped to ``[1, max_len]``."""

  median_len: int = 512
  sigma: float = 1.0
  max_len: int = 4096
  seed: int = 0

  def __post_init__(self):
    if self.median_len < 1:
      raise ValueError(f"median_len={self.median_len} must be >= 1")
    if not self.sigma >= 0:
      raise ValueError(f"sigma={self.sigma} must be >= 0")
    if self.max_len < 1:
      raise ValueError(f"max_len={self.max_len} must be >= 1")
    if self.seed < 0:
      raise ValueError(f"seed={self.seed} must be >= 0")

  def sample(self, num: int) -> np.ndarray:
    """i64[num] lengths drawn with ``seed`` (a longer draw starts with a shorter one)."""
    rng = np.random.default_rng(self.seed)
    lengths = np.exp(rng.normal(np.log(self.median_len), self.sigma, size=num))
    return np.clip(np.ceil(lengths), 1, self.max_len).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Placement:
  """How one strategy holds the stream: sequences that fit and the utilisation."""

  name: str
  num_seqs: int
  tokens_held: int
  tokens_reserved: int

  @property
  def utilization(self) -> float:
    """Tokens held / tokens reserved (0 when nothing is placed)."""
    return self.tokens_held / self.tokens_reserved if self.tokens_reserved else 0.0


def _fit_prefix(lengths: np.ndarray, reserved: np.ndarray,
                capacity: int) -> tuple[int, int, int]:
  """(sequences, tokens held, tokens reserved) of the longest prefix that fits."""
  cum = np.cumsum(reserved)
  n = int(np.searchsorted(cum, capacity, side="right"))
  return n, int(lengths[:n].sum()), int(cum[n - 1]) if n else 0


def _fit_stream(lengths: "LengthDistribution", limit: int, fit) -> list:
  """``fit(stream)`` (a list of ``_fit_prefix`` results) on the shortest prefix of the
  sampled stream that every strategy overflows, at most ``limit`` lengths: sampled in
  growing draws (one seed: a longer draw starts with the shorter one), so memory follows
  the sequences that fit, not the pool's tokens."""
  num = min(limit, 4096)
  while True:
    results = fit(lengths.sample(num))
    if num >= limit or all(r[0] < num for r in results):
      return results
    if num >= MAX_STREAM:
      raise ValueError(f"the budget holds more than {MAX_STREAM:,} sequences of this length "
                       "distribution, more than the plan draws: plan a smaller budget (the "
                       "counts scale with it)")
    num = min(limit, 4 * num, MAX_STREAM)


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """``plan_capacity``'s result: the pool, the length distribution, and how many sampled
  sequences each strategy holds (paged blocks; contiguous at the maximum length; contiguous
  at each sequence's exact length, an oracle no server has)."""

  spec: KVCacheSpec
  lengths: LengthDistribution
  paged: Placement
  contiguous_max: Placement
  contiguous_oracle: Placement


def plan_capacity(spec: KVCacheSpec, lengths: LengthDistribution) -> CapacityPlan:
  """Fit a stream of sampled sequences into ``spec``'s pool three ways."""
  capacity = spec.max_tokens
  z = spec.block_size
  names = ("paged", "contiguous, max length", "contiguous, oracle length")

  def fit(stream):
    return [_fit_prefix(stream, reserved, capacity)
            for reserved in (-(-stream // z) * z, np.full_like(stream, lengths.max_len),
                             stream)]

  # No strategy fits more sequences than the pool has tokens (each holds at least one).
  results = _fit_stream(lengths, capacity + 1, fit)
  return CapacityPlan(spec, lengths, *(Placement(name, *r) for name, r in zip(names, results)))


def format_plan(plan: CapacityPlan, model: ModelShape, budget_bytes: int) -> str:
  """The report ``paged-jax plan`` prints for ``plan``: the model, the pool, and a table of
  the three strategies (sequences held, tokens, utilisation)."""
  spec, dist = plan.spec, plan.lengths
  lines = [
      f"model      : {model.name}: L={spec.num_layers} K={spec.num_kv_heads} "
      f"D={spec.head_dim} dtype={jnp.dtype(model.dtype).name}"
      + ("" if jnp.dtype(spec.dtype) == jnp.dtype(model.dtype)
         else f", KV pool {jnp.dtype(spec.dtype).name}"),
      *(f"note       : {note}" for note in _dtype_note(model) + model.notes),
      f"budget     : {format_bytes(budget_bytes)} ({budget_bytes} bytes)",
      f"per token  : {spec.token_bytes} bytes ({spec.token_bytes / 1024:.1f} KiB)"
      + (", float32 scales per token and KV head included" if spec.quantized else ""),
      f"per block  : {spec.block_bytes} bytes ({format_bytes(spec.block_bytes)}), "
      f"Z={spec.block_size} tokens",
      f"blocks     : {spec.num_blocks}  ({format_bytes(spec.total_bytes)} used)",
      f"tokens     : {spec.max_tokens}",
      f"lengths    : log-normal, median {dist.median_len}, sigma {dist.sigma}, clipped to "
      f"[1, {dist.max_len}], seed {dist.seed}",
      *([f"note       : the median {dist.median_len} is above the maximum {dist.max_len}: "
         "most lengths are clipped to the maximum"] if dist.median_len > dist.max_len else []),
      "",
      *_layer_lines(spec, model),
      "",
      "| strategy | sequences that fit | KV utilisation | vs max-length |",
      "|---|---:|---:|---:|",
  ]
  base = plan.contiguous_max.num_seqs
  for p in (plan.paged, plan.contiguous_max, plan.contiguous_oracle):
    lines.append(f"| {p.name} | {p.num_seqs} | {100 * p.utilization:.1f}% | "
                 f"{_ratio(p.num_seqs, base)} |")
  return "\n".join(lines)


def _ratio(num: int, base: int) -> str:
  """``num / base`` as "1.50x"; "n/a" when the base fits nothing (not a ratio to 1)."""
  return f"{num / base:.2f}x" if base else "n/a"


def _dtype_note(model: ModelShape) -> tuple[str, ...]:
  if model.unknown_dtype is None:
    return ()
  what = ("config.json declares no dtype" if not model.unknown_dtype else
          f"the config's dtype {model.unknown_dtype!r} is not a float dtype")
  return (f"{what}; planned as float32, the dtype load_pretrained loads it in (--dtype or "
          "--kv-cache-dtype to choose)",)


def _layer_lines(spec: KVCacheSpec, model: ModelShape) -> list[str]:
  """Per-layer KV cost, by attention kind (a table), and what sliding layers hold."""
  per_layer = spec.block_bytes // spec.num_layers
  types = model.layer_types if len(model.layer_types) == spec.num_layers else ()
  window = model.sliding_window
  kinds = {}
  for layer, kind in enumerate(types or ("full_attention",) * spec.num_layers):
    kinds.setdefault(kind, []).append(layer)
  lines = ["| layers | attention | per layer, per block | all such layers, per block |",
           "|---|---|---:|---:|"]
  for kind, members in kinds.items():
    shown = ", ".join(map(str, members[:6])) + (", ..." if len(members) > 6 else "")
    what = (f"sliding, window {window}" if kind == "sliding_attention" and window is not None
            else "full")
    lines.append(f"| {len(members)} ({shown}) | {what} | {per_layer} bytes | "
                 f"{per_layer * len(members)} bytes |")
  if "sliding_attention" in kinds and window is not None:
    lines += [f"Sliding layers attend to their last {window} tokens. In the counts below "
              "every layer holds every block of its sequence;",
              "with windowed freeing (LLM(free_outside_window=True)) sliding layers hold only "
              "their window: see the KV groups table."]
  return lines


def layer_windows(model: ModelShape) -> tuple:
  """Each layer's window (None: full attention) of ``model``."""
  types = model.layer_types if len(model.layer_types) == model.num_layers else ()
  if not types or model.sliding_window is None:
    return (None,) * model.num_layers
  return tuple(model.sliding_window if t == "sliding_attention" else None for t in types)


@dataclasses.dataclass(frozen=True)
class WindowedPlan:
  """Sequences of a length stream that fit a budget with and without windowed freeing.

  ``groups``: the model's KV groups (``paged_jax.kv_groups``); ``group_spec``: the pool of
  one-group blocks the budget buys (``num_layers`` = the group's M layers);
  ``without``/``with_``: placements counting, per sequence of n tokens, ``ceil(n / Z)``
  blocks of all layers, or ``KVGroups.blocks_held(n, Z, step_tokens)`` one-group blocks.
  """

  groups: KVGroups
  group_spec: KVCacheSpec
  full_spec: KVCacheSpec
  step_tokens: int
  without: Placement
  with_: Placement


def plan_windowed(model: ModelShape, budget_bytes: int, block_size: int, lengths:
                  LengthDistribution, *, dtype=None, step_tokens: int = 1) -> WindowedPlan:
  """``WindowedPlan`` of ``model`` at ``budget_bytes``: how many sequences of the stream
  (arrival order, the longest prefix) are held at their final length at once. A sliding
  group's count assumes steps of ``step_tokens`` tokens (1: decoding; a chunked prefill of
  q tokens holds up to ``ceil((W - 1 + q) / Z) + 1`` blocks meanwhile)."""
  dtype = model.dtype if dtype is None else dtype
  groups = KVGroups.from_layer_windows(layer_windows(model))
  shape = (model.num_kv_heads, model.head_dim, block_size, dtype)
  full_spec = KVCacheSpec.from_budget(budget_bytes, model.num_layers, *shape)
  group_spec = KVCacheSpec.from_budget(budget_bytes, groups.layers_per_group, *shape)
  z = block_size

  def fit(stream):
    held = np.asarray([groups.blocks_held(int(n), z, step_tokens) for n in stream])
    return [_fit_prefix(stream, -(-stream // z), full_spec.num_blocks),
            _fit_prefix(stream, held, group_spec.num_blocks)]

  without, with_ = _fit_stream(lengths, full_spec.max_tokens + 1, fit)
  # Reservations in tokens of all layers (a one-group block holds Z * M / L of them).
  scale = z * groups.layers_per_group / model.num_layers
  return WindowedPlan(
      groups, group_spec, full_spec, step_tokens,
      Placement("every layer holds every block", without[0], without[1], without[2] * z),
      Placement("sliding groups hold their window", with_[0], with_[1],
                int(round(with_[2] * scale))))


def format_windowed(plan: WindowedPlan) -> str:
  """The KV groups table and the with / without windowed freeing counts."""
  g, spec = plan.groups, plan.group_spec
  per_token = spec.token_bytes
  kinds = {}
  for w in g.windows:
    kinds[w] = kinds.get(w, 0) + 1
  lines = [f"KV groups  : {_words.count(g.num_groups, 'group')} of "
           f"{_words.count(g.layers_per_group, 'layer')}, one pool of "
           f"{spec.num_blocks} blocks of {spec.block_bytes} bytes (Z={spec.block_size})",
           "| group kind | groups | bytes per token, per group | blocks held by a sequence "
           "of n tokens |", "|---|---:|---:|---|"]
  for w, count in kinds.items():
    what = "full" if w is None else f"sliding, window {w}"
    held = ("ceil(n / Z)" if w is None
            else f"min(ceil(n / Z), ceil({w - 1 + plan.step_tokens} / Z) + 1)")
    lines.append(f"| {what} | {count} | {per_token} bytes | {held} |")
  base = plan.without.num_seqs
  lines += ["", "| windowed freeing | sequences that fit | vs without |", "|---|---:|---:|"]
  for name, p in (("without", plan.without), ("with", plan.with_)):
    lines.append(f"| {name} ({p.name}) | {p.num_seqs} | {_ratio(p.num_seqs, base)} |")
  return "\n".join(lines)
