"""Load a Hugging Face checkpoint of a supported family (config.json + safetensors).

No torch: tensors are read with ``safetensors.safe_open(framework="np")``; bfloat16 ones
(which numpy cannot name) are mapped straight from the file with ``np.memmap`` and
``ml_dtypes.bfloat16``, using the offsets of the safetensors header.

Memory: the model is built abstractly (``nnx.eval_shape``, no random init); each parameter
kind is then filled one tensor at a time into one host buffer ``[L, ...]`` in the target
dtype, moved to the device, and the buffer dropped before the next kind. Peak host memory is
one stacked parameter kind plus one tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import struct
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from paged_jax.models.config import CheckpointNotFoundError, ModelConfig
from paged_jax.models import moe
from paged_jax.models.decoder import Decoder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# safetensors dtypes NumPy lacks, read as raw bytes (float8 weights with no quantization
# config hold plain values, which transformers loads as such).
_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
               "F8_E5M2": ml_dtypes.float8_e5m2}
# Checkpoint tensors no model reads and transformers loads without a word: the RoPE
# frequencies older exports saved as buffers (they are recomputed from the config).
_IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Where a multimodal Gemma 3 checkpoint keeps its text decoder's tensors (transformers
# 4.52 and later; 4.50-4.51), as (our name's prefix, the checkpoint's) pairs, and the
# tensors of its vision tower, which serving text does not read.
_TEXT_PREFIXES = (
    (("model.", "model.language_model."),),
    (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
)
_VISION_TENSORS = re.compile(r"(^|\.)(vision_tower|multi_modal_projector)\.")
# A checkpoint saved from the base model class (LlamaModel, not LlamaForCausalLM): the
# decoder's tensors without the "model." prefix and no lm_head, as transformers' causal LM
# loads it (its embeddings then serve as the head when the config ties them).
_BASE_MODEL_PREFIXES = (("model.", ""),)


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """How one model parameter comes from the checkpoint.

  Attributes:
    name: HF tensor name; ``{layer}`` is filled in for per-layer tensors.
    hf_shape: the shape the checkpoint must hold.
    convert: HF array -> our layout (transposes, head split).
  """

  name: str
  hf_shape: tuple[int, ...]
  convert: Callable[[np.ndarray], np.ndarray]


def _tensor_plan(config: ModelConfig) -> dict[tuple[str, ...], _Tensor]:
  """Our parameter path -> the checkpoint tensor it comes from."""
  c = config
  e, v = c.embed_dim, c.vocab_size
  h, k, d = c.num_heads, c.num_kv_heads, c.head_dim
  same = lambda x: x
  attn = "model.layers.{layer}.self_attn."
  plan = {
      ("embed_VE",): _Tensor(EMBED, (v, e), same),
      ("final_norm", "scale_E"): _Tensor("model.norm.weight", (e,), same),
      ("layers", "attn_norm", "scale_E"): _Tensor(
          "model.layers.{layer}.input_layernorm.weight", (e,), same),
      # Llama's "post_attention_layernorm" is the norm before the MLP; Gemma's is the norm
      # after attention (below), its pre-MLP norm "pre_feedforward_layernorm".
      ("layers", "mlp_norm", "scale_E"): _Tensor(
          "model.layers.{layer}." + ("pre_feedforward_layernorm.weight" if c.sandwich_norms
                                     else "post_attention_layernorm.weight"), (e,), same),
      # nn.Linear stores [out, in].
      ("layers", "attn", "q_EHD"): _Tensor(attn + "q_proj.weight", (h * d, e),
                                           lambda x: x.T.reshape(e, h, d)),
      ("layers", "attn", "k_EKD"): _Tensor(attn + "k_proj.weight", (k * d, e),
                                           lambda x: x.T.reshape(e, k, d)),
      ("layers", "attn", "v_EKD"): _Tensor(attn + "v_proj.weight", (k * d, e),
                                           lambda x: x.T.reshape(e, k, d)),
      ("layers", "attn", "o_HDE"): _Tensor(attn + "o_proj.weight", (e, h * d),
                                           lambda x: x.T.reshape(h, d, e)),
  }
  plan.update(_mlp_plan(c))
  if c.qkv_bias:
    plan[("layers", "attn", "q_bias_HD")] = _Tensor(attn + "q_proj.bias", (h * d,),
                                                    lambda x: x.reshape(h, d))
    plan[("layers", "attn", "k_bias_KD")] = _Tensor(attn + "k_proj.bias", (k * d,),
                                                    lambda x: x.reshape(k, d))
    plan[("layers", "attn", "v_bias_KD")] = _Tensor(attn + "v_proj.bias", (k * d,),
                                                    lambda x: x.reshape(k, d))
  if c.o_bias:
    plan[("layers", "attn", "o_bias_E")] = _Tensor(attn + "o_proj.bias", (e,), same)
  if c.qk_norm:
    plan[("layers", "attn", "q_norm", "scale_D")] = _Tensor(attn + "q_norm.weight", (d,), same)
    plan[("layers", "attn", "k_norm", "scale_D")] = _Tensor(attn + "k_norm.weight", (d,), same)
  if c.attention_sinks:
    plan[("layers", "attn", "sinks_H")] = _Tensor(attn + "sinks", (h,), same)
  if c.sandwich_norms:
    plan[("layers", "post_attn_norm", "scale_E")] = _Tensor(
        "model.layers.{layer}.post_attention_layernorm.weight", (e,), same)
    plan[("layers", "post_mlp_norm", "scale_E")] = _Tensor(
        "model.layers.{layer}.post_feedforward_layernorm.weight", (e,), same)
  if not c.tie_word_embeddings:
    plan[("lm_head_EV",)] = _Tensor(LM_HEAD, (v, e), lambda x: x.T)
  return plan


def _untie_if_distinct(config: ModelConfig, reader: "_CheckpointReader") -> ModelConfig:
  """A config that ties the output projection to the embeddings, for a checkpoint that
  holds its own, different ``lm_head.weight``, is untied: transformers (5.x) then keeps
  both and projects with ``lm_head`` (tying would silently change every logit)."""
  if not config.tie_word_embeddings or LM_HEAD not in reader:
    return config
  shape = (config.vocab_size, config.embed_dim)
  if np.array_equal(reader.read(LM_HEAD, shape), reader.read(EMBED, shape)):
    return config
  return dataclasses.replace(config, tie_word_embeddings=False)


def _mlp_plan(config: ModelConfig) -> dict[tuple[str, ...], _Tensor]:
  """The tensors of each layer's MLP: the gated MLP's (``layers.GatedMLP``); a family whose
  MLP module differs (``decoder._mlp``) maps its own parameters here."""
  e, i = config.embed_dim, config.mlp_dim
  mlp = "model.layers.{layer}.mlp."
  if config.num_experts:  # gpt-oss: a mixture of experts (models.moe.MoEMLP)
    o, same = config.num_experts, lambda x: x
    experts = mlp + "experts."
    gate, up = (lambda x: moe.from_hf_gate_up(x)[0]), (lambda x: moe.from_hf_gate_up(x)[1])
    return {
        ("layers", "mlp", "router_EO"): _Tensor(mlp + "router.weight", (o, e), lambda x: x.T),
        ("layers", "mlp", "router_bias_O"): _Tensor(mlp + "router.bias", (o,), same),
        # gate_up_proj is input-major [O, E, 2I] with gate and up interleaved; each of our
        # two parameters reads it and keeps its own columns.
        ("layers", "mlp", "gate_OEI"): _Tensor(experts + "gate_up_proj", (o, e, 2 * i), gate),
        ("layers", "mlp", "up_OEI"): _Tensor(experts + "gate_up_proj", (o, e, 2 * i), up),
        ("layers", "mlp", "gate_bias_OI"): _Tensor(experts + "gate_up_proj_bias", (o, 2 * i),
                                                   gate),
        ("layers", "mlp", "up_bias_OI"): _Tensor(experts + "gate_up_proj_bias", (o, 2 * i), up),
        ("layers", "mlp", "down_OIE"): _Tensor(experts + "down_proj", (o, i, e), same),
        ("layers", "mlp", "down_bias_OE"): _Tensor(experts + "down_proj_bias", (o, e), same),
    }
  return {
      ("layers", "mlp", "gate_EI"): _Tensor(mlp + "gate_proj.weight", (i, e), lambda x: x.T),
      ("layers", "mlp", "up_EI"): _Tensor(mlp + "up_proj.weight", (i, e), lambda x: x.T),
      ("layers", "mlp", "down_IE"): _Tensor(mlp + "down_proj.weight", (e, i), lambda x: x.T),
  }


class _CheckpointReader:
  """Tensor lookup across the safetensors files of a checkpoint directory (lazy opens)."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    self._path = path
    self._stack = stack
    self._handles = {}
    self._headers = {}
    self.names_read: set[str] = set()
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index_path):
      with open(index_path, encoding="utf-8") as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
          raise ValueError(f"index file {index_path!r} is not a safetensors index "
                           f"(needs a 'weight_map'): {e}") from e
      self._weight_map = dict(weight_map)
      for shard in sorted(set(self._weight_map.values())):
        if not os.path.isfile(os.path.join(path, shard)):
          raise CheckpointNotFoundError(f"shard {shard!r} named by {index_path!r} does not "
                                        "exist")
    elif os.path.isfile(single_path):
      handle = self._open(SINGLE_FILE)
      self._weight_map = {name: SINGLE_FILE for name in handle.keys()}
    else:
      pickled = sorted(f for f in os.listdir(path) if f.startswith("pytorch_model")
                       and f.endswith((".bin", ".bin.index.json")))
      shown = ", ".join(pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
      note = (f"; it holds {shown}: PyTorch pickles are not read (no torch), "
              "save the model with safe_serialization=True (transformers' default) "
              "first") if pickled else ""
      raise CheckpointNotFoundError(f"no {SINGLE_FILE!r} or {INDEX_FILE!r} in checkpoint "
                                    f"directory path={path!r}{note}")
    self._prefixes = ()  # a multimodal checkpoint's text decoder: its names' prefixes
    if EMBED not in self._weight_map:
      for prefixes in (*_TEXT_PREFIXES, _BASE_MODEL_PREFIXES):
        if self._checkpoint_name(EMBED, prefixes) in self._weight_map:
          self._prefixes = prefixes
          break

  def _checkpoint_name(self, name: str, prefixes=None) -> str:
    """The checkpoint's name of tensor ``name`` (as a text-only checkpoint names it)."""
    for ours, theirs in self._prefixes if prefixes is None else prefixes:
      if name.startswith(ours):
        return theirs + name[len(ours):]
    return name

  def _open(self, file: str):
    if file not in self._handles:
      self._header(file)  # a truncated or foreign file fails here, named
      from safetensors import safe_open  # imported here: keeps ``import paged_jax`` light
      full = os.path.join(self._path, file)
      try:
        handle = safe_open(full, framework="np")
      except Exception as e:  # safetensors raises its own error type
        raise ValueError(f"safetensors file {full!r} cannot be read: {e}") from e
      self._handles[file] = self._stack.enter_context(handle)
    return self._handles[file]

  def _header(self, file: str) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file, after checking that the file
    holds every byte its header promises (a truncated download fails here, named)."""
    if file not in self._headers:
      full = os.path.join(self._path, file)
      file_size = os.path.getsize(full)
      try:
        with open(full, "rb") as f:
          (size,) = struct.unpack("<Q", f.read(8))
          if 8 + size > file_size:
            raise ValueError(f"its header claims {size} bytes")
          header = json.loads(f.read(size))
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items()
                        if k != "__metadata__"), default=0)
      except (struct.error, ValueError, KeyError, TypeError, IndexError,
              UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"safetensors file {full!r} is not a valid safetensors file "
                         f"({e})") from e
      if 8 + size + data_end > file_size:
        raise ValueError(f"safetensors file {full!r} is truncated: {file_size} bytes, its "
                         f"header needs {8 + size + data_end}")
      self._headers[file] = (8 + size, header)
    return self._headers[file]

  def __contains__(self, name: str) -> bool:
    return self._checkpoint_name(name) in self._weight_map

  def unread(self) -> list[str]:
    """The checkpoint's tensors not read so far, less those no model reads
    (``_IGNORED_TENSORS``; a multimodal checkpoint's vision tower), in checkpoint order."""
    return [name for name in self._weight_map
            if name not in self.names_read and not _IGNORED_TENSORS.search(name)
            and not (self._prefixes and _VISION_TENSORS.search(name))]

  def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name`` as numpy, after checking its shape (before reading its data)."""
    name = self._checkpoint_name(name)
    if name not in self._weight_map:
      if name + "_blocks" in self._weight_map:
        raise ValueError(f"tensor {name!r} is stored MXFP4-quantised ({name}_blocks, "
                         f"{name}_scales) in the checkpoint at {self._path!r}: dequantise it "
                         "to bfloat16 first (models.moe's docstring)")
      base = (" (it was saved from the base model class, without the causal LM's head: "
              "its config must tie the word embeddings)"
              if self._prefixes == _BASE_MODEL_PREFIXES and name == LM_HEAD else "")
      raise ValueError(f"tensor {name!r} is missing from the checkpoint at {self._path!r}"
                       f"{base}")
    file = self._weight_map[name]
    self.names_read.add(name)
    handle = self._open(file)
    try:
      info = handle.get_slice(name)
    except Exception as e:  # safetensors raises its own error type for an unknown name
      raise ValueError(f"tensor {name!r} is missing from {file!r} (the index names it)") from e
    shape, dtype = tuple(info.get_shape()), info.get_dtype()
    if shape != tuple(expected_shape):
      raise ValueError(f"tensor {name!r} in {file!r} has shape {shape}, expected "
                       f"{tuple(expected_shape)}")
    if dtype not in _RAW_DTYPES:
      try:
        return handle.get_tensor(name)
      except (AttributeError, TypeError, ValueError) as e:  # a dtype NumPy cannot hold
        raise ValueError(f"tensor {name!r} in {file!r} has dtype {dtype}, which the loader "
                         f"cannot read ({e})") from e
    start, header = self._header(file)
    begin, end = header[name]["data_offsets"]
    raw = np.memmap(os.path.join(self._path, file), dtype=np.uint8, mode="r",
                    offset=start + begin, shape=(end - begin,))
    return raw.view(_RAW_DTYPES[dtype]).reshape(shape)


def _warn_unread(reader: _CheckpointReader, path: str, config: ModelConfig) -> None:
  """Warns, as transformers does, when the checkpoint holds tensors the model did not
  load (a layer past ``num_hidden_layers``, a bias the family has no place for, a head of
  another task): the config and the weights may not belong together."""
  unread = reader.unread()
  if not unread:
    return
  shown = ", ".join(repr(name) for name in unread[:5])
  more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
  warnings.warn(f"{len(unread)} tensor(s) of the checkpoint at {path!r} were not loaded: "
                f"{shown}{more}; no parameter of a {config.model_type!r} model with this "
                "config.json takes them (check num_hidden_layers and the model type)",
                UserWarning, stacklevel=3)


def _param_dtype(dtype) -> np.dtype:
  """``dtype=`` of ``load_pretrained``: the parameters' and activations' dtype."""
  if type(dtype).__module__ == "torch":  # torch.bfloat16, as a transformers habit
    dtype = str(dtype).rsplit(".", 1)[-1]
  try:
    canonical = jnp.dtype(dtype)
  except TypeError:
    canonical = None
  if canonical not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    shown = repr(dtype) if canonical is None else canonical.name
    raise ValueError(f"dtype={shown} must be the model's float dtype: jnp.float32, "
                     "jnp.bfloat16 or jnp.float16 (a quantised KV cache is the engine's "
                     "kv_cache_dtype=, e.g. jnp.int8)")
  return canonical


def _default_dtype(config: ModelConfig):
  if config.checkpoint_dtype in ("float32", "bfloat16", "float16"):
    return jnp.dtype(config.checkpoint_dtype)
  return jnp.dtype(jnp.float32)


def checkpoint_dir(path: str | os.PathLike) -> str:
  """The checkpoint directory ``path`` names (``~`` expanded; its ``config.json`` names its
  folder), for the weights and for the files beside them (the engine's tokenizer.json).

  Raises:
    ValueError: ``path`` is another file (a GGUF file is said not to be read).
    CheckpointNotFoundError: no such directory (a Hub id is said not to be downloaded).
  """
  path = os.path.expanduser(os.fspath(path))
  if os.path.isfile(path) and os.path.basename(path) == "config.json":
    return os.path.dirname(path) or "."  # the checkpoint's config.json: use its folder
  if os.path.isfile(path):
    gguf = (" (GGUF files are not read: transformers with gguf installed dequantises one, "
            "then save_pretrained writes a directory)" if path.endswith(".gguf") else "")
    raise ValueError(f"path={path!r} is a file: pass the checkpoint directory (the folder "
                     f"holding config.json and the safetensors files){gguf}")
  if not os.path.isdir(path):
    hub = (" (if it is a Hugging Face Hub id: nothing is downloaded; fetch it first, e.g. "
           "huggingface-cli download, and pass its local directory)"
           if path.count("/") == 1 and not path.startswith((".", "/")) else "")
    raise CheckpointNotFoundError(f"path={path!r}: checkpoint directory does not exist"
                                  f"{hub}")
  return path


def load_pretrained(path: str | os.PathLike, *, dtype=None, impl: str = "auto",
                    interpret: bool = False, max_seq_len: int | None = None,
                    sharding: Callable[[tuple[str, ...], tuple[int, ...]], Any] | None = None
                    ) -> tuple[Decoder, ModelConfig]:
  """``(model, config)`` from a Hugging Face checkpoint directory.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` or a sharded
      ``model.safetensors.index.json`` + shards (or that ``config.json`` itself).
    dtype: parameter / activation dtype; default the checkpoint's declared dtype (float32
      when it declares none).
    impl: the model's default ``paged_attention`` implementation.
    interpret: run a Pallas impl in interpret mode.
    max_seq_len: see ``ModelConfig.from_hf_dict``.
    sharding: optional ``(param_path, shape) -> jax.sharding.Sharding`` placing each
      parameter (e.g. a ``NamedSharding`` over a mesh); default: the default device.
      ``param_path`` is the parameter's path in the model, e.g. ``("layers", "attn",
      "q_EHD")``; stacked layer parameters carry a leading L axis.

  Raises:
    CheckpointNotFoundError: the directory, config.json, or a safetensors file is missing
      (a ``FileNotFoundError`` and a ``ValueError``).
    ValueError: unsupported model_type / feature, a missing or mis-shaped tensor, or a
      truncated or invalid safetensors file (each named).
  """
  path = checkpoint_dir(path)
  config = ModelConfig.from_json(os.path.join(path, "config.json"), max_seq_len=max_seq_len)
  with contextlib.ExitStack() as stack:  # one reader: its files are opened once
    reader = _CheckpointReader(path, stack)
    config = _untie_if_distinct(config, reader)
    dtype = _default_dtype(config) if dtype is None else _param_dtype(dtype)
    abstract = nnx.eval_shape(
        lambda: Decoder(config, dtype=dtype, impl=impl, interpret=interpret, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    plan = _tensor_plan(config)
    flat = list(nnx.to_flat_state(abstract_state))
    unplanned = [p for p, _ in flat if tuple(p) not in plan]
    if unplanned:  # a bug in the plan, not in the checkpoint
      raise RuntimeError(f"no checkpoint tensor mapped to parameters {unplanned}")

    filled = []
    for param_path, variable in flat:
      spec = plan[tuple(param_path)]
      target = variable.get_value()
      host = np.empty(target.shape, target.dtype)
      if param_path[0] == "layers":
        for layer in range(config.num_layers):
          name = spec.name.format(layer=layer)
          host[layer] = spec.convert(reader.read(name, spec.hf_shape))
      else:
        host[...] = spec.convert(reader.read(spec.name, spec.hf_shape))
      placement = None if sharding is None else sharding(tuple(param_path), host.shape)
      filled.append((param_path, variable.replace(value=jax.device_put(host, placement))))
      del host
    _warn_unread(reader, path, config)
  model = nnx.merge(graphdef, nnx.from_flat_state(filled))
  return model, config
