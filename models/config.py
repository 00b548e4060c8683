"""The model configuration: a frozen dataclass built from a checkpoint's ``config.json``.

Only the top-level model (``models.decoder.Decoder``) and the loader read it; every layer
below them takes plain ints and floats.

Supported ``model_type``s and what is refused:
- "llama" (Llama 2 / 3 / 3.1+): ``attention_bias`` (biases on q, k, v and o) supported;
  ``mlp_bias=True`` refused.
- "mistral": full attention only. ``sliding_window`` of None, or >= ``max_seq_len`` (so the
  window never cuts anything a served sequence can reach), is ignored; a smaller window is
  refused with a ValueError (the paged kernels attend to the whole sequence). Pass a smaller
  ``max_seq_len`` to ``from_hf_dict`` / ``load_pretrained`` to serve such a checkpoint with
  contexts no longer than its window (e.g. Mistral-7B-v0.1 with ``max_seq_len=4096``);
  keeping sequences within ``max_seq_len`` is then the caller's (engine's) job.
- "qwen2": q/k/v biases, ``tie_word_embeddings``. ``use_sliding_window=True`` (or
  "sliding_attention" in ``layer_types``) is refused like Mistral's window.
- RoPE: ``rope_scaling`` / ``rope_parameters`` of type None / "default" (plain) or "llama3";
  any other type ("linear", "dynamic", "yarn", ...) and ``partial_rotary_factor != 1`` are
  refused. Both the legacy keys (``rope_theta`` + ``rope_scaling`` with "type" or
  "rope_type") and transformers>=5's ``rope_parameters`` are read.
- ``hidden_act`` must be "silu" (SwiGLU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name}={value!r} must be a positive int")
  return int(value)


def _positive_float(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not value > 0:
    raise ValueError(f"{name}={value!r} must be a positive number")
  return float(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (``rope_type="llama3"``).

  Attributes:
    factor: how much longer the extended context is than the original one.
    low_freq_factor, high_freq_factor: wavelength band edges, as fractions of the original
      context, between which frequencies are smoothly interpolated.
    original_max_position_embeddings: the pre-training context length.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      object.__setattr__(self, name, _positive_float(f"rope_scaling.{name}", getattr(self, name)))
    object.__setattr__(self, "original_max_position_embeddings", _positive_int(
        "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings))
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must be > "
                       f"rope_scaling.low_freq_factor={self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Llama-family decoder.

  Attributes:
    model_type: "llama", "mistral" or "qwen2".
    vocab_size: V.
    embed_dim: E (HF ``hidden_size``).
    mlp_dim: I (HF ``intermediate_size``).
    num_layers: L.
    num_heads: H query heads.
    num_kv_heads: K KV heads; H must be a multiple of K.
    head_dim: D (HF ``head_dim``, default ``E // H``); must be even for RoPE.
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base.
    rope_scaling: None (plain RoPE) or a llama3 ``RopeScaling``.
    max_seq_len: longest sequence the model is meant to serve (HF
      ``max_position_embeddings`` unless overridden).
    tie_word_embeddings: the LM head is the transposed embedding.
    qkv_bias: q/k/v projections carry a bias (Qwen2; Llama's ``attention_bias``).
    o_bias: the output projection carries a bias (Llama's ``attention_bias``).
    bos_token_id: None or the BOS id.
    eos_token_ids: the EOS ids (a checkpoint may list several).
    checkpoint_dtype: the dtype name the checkpoint declares ("bfloat16", ...), or None.
  """

  model_type: str
  vocab_size: int
  embed_dim: int
  mlp_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_seq_len: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  checkpoint_dtype: str | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={self.model_type!r} is not supported; expected one of "
                       f"{SUPPORTED_MODEL_TYPES}")
    for name in ("vocab_size", "embed_dim", "mlp_dim", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_seq_len"):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    for name in ("rms_norm_eps", "rope_theta"):
      object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None or a RopeScaling")
    eos = self.eos_token_ids
    if not isinstance(eos, tuple) or not all(isinstance(e, int) for e in eos):
      raise ValueError(f"eos_token_ids={eos!r} must be a tuple of ints")

  @property
  def group(self) -> int:
    """G, query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  def rope_inv_frequencies(self) -> np.ndarray:
    """f32[D / 2] RoPE inverse frequencies, computed as transformers does (float32)."""
    exponent = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim
    inv_freq = (1.0 / (np.float32(self.rope_theta) ** exponent)).astype(np.float32)
    if self.rope_scaling is None:
      return inv_freq
    s = self.rope_scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  @classmethod
  def from_hf_dict(cls, hf: Mapping[str, Any], *, max_seq_len: int | None = None
                   ) -> "ModelConfig":
    """The config of a Hugging Face ``config.json`` dict; refuses what is not supported.

    Args:
      hf: the parsed ``config.json``.
      max_seq_len: serve at most this many tokens per sequence (default: the checkpoint's
        ``max_position_embeddings``); a sliding window >= it is ignored.
    """
    if not isinstance(hf, Mapping):
      raise ValueError(f"hf={type(hf).__name__} must be a mapping (a parsed config.json)")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={model_type!r} in config.json is not supported; expected "
                       f"one of {SUPPORTED_MODEL_TYPES}")

    def need(key: str):
      if hf.get(key) is None:
        raise ValueError(f"config.json key {key!r} is missing (model_type={model_type!r})")
      return hf[key]

    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU)")
    if hf.get("mlp_bias", False):
      raise ValueError("mlp_bias=True is not supported (Llama MLP without biases only)")
    num_heads = need("num_attention_heads")
    embed_dim = need("hidden_size")
    head_dim = hf.get("head_dim") or (embed_dim // num_heads if isinstance(embed_dim, int)
                                      and isinstance(num_heads, int) else None)
    positions = hf.get("max_position_embeddings", 4096)
    if max_seq_len is None:
      max_seq_len = positions
    max_seq_len = _positive_int("max_seq_len", max_seq_len)

    rope_theta, rope_scaling = _rope_from_hf(hf)

    window = hf.get("sliding_window")
    uses_window = window is not None
    if model_type == "qwen2":
      layer_types = hf.get("layer_types") or ()
      uses_window = window is not None and (bool(hf.get("use_sliding_window", False))
                                            or "sliding_attention" in layer_types)
    elif model_type == "llama":
      uses_window = False
    if uses_window and window < max_seq_len:
      raise ValueError(
          f"sliding_window={window} < max_seq_len={max_seq_len}: sliding-window attention is "
          "not supported (the paged kernels attend to the whole sequence). Pass "
          f"max_seq_len<={window} to serve this checkpoint with shorter contexts.")

    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    eos = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, (list, tuple))
                                  else (int(eos),))
    bos = hf.get("bos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        embed_dim=embed_dim,
        mlp_dim=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
    )

  @classmethod
  def from_json(cls, path: str | os.PathLike, *, max_seq_len: int | None = None
                ) -> "ModelConfig":
    """``from_hf_dict`` of a ``config.json`` file, or of the one in a checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
      try:
        hf = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid JSON: {e}") from e
    return cls.from_hf_dict(hf, max_seq_len=max_seq_len)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, rope_scaling) from ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``."""
  params = dict(hf.get("rope_parameters") or {})
  legacy = hf.get("rope_scaling")
  if legacy:
    params = {**params, **legacy}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; expected one of "
                     f"{SUPPORTED_ROPE_TYPES} (or no rope_scaling)")
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"partial_rotary_factor={partial} is not supported; only 1.0")
  if rope_type == "default":
    return theta, None
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings") if k not in params]
  if missing:
    raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")
  return theta, RopeScaling(
      factor=params["factor"], low_freq_factor=params["low_freq_factor"],
      high_freq_factor=params["high_freq_factor"],
      original_max_position_embeddings=params["original_max_position_embeddings"])
