"""The model configuration: a frozen dataclass built from a checkpoint's ``config.json``.

Only the top-level model (``models.decoder.Decoder``) and the loader read it; every layer
below them takes plain ints and floats.

Supported ``model_type``s, each read as transformers (5.x) reads its ``config.json``:
- "llama" (Llama 2 / 3 / 3.1+): ``attention_bias`` (biases on q, k, v and o) supported;
  ``mlp_bias=True`` refused. Every layer attends to the whole sequence.
- "mistral": ``sliding_window`` (None: full attention) applies to every layer; no biases
  (an ``attention_bias`` key is ignored, as transformers ignores it).
- "qwen2": q/k/v biases and none on o, whatever ``attention_bias`` says;
  ``tie_word_embeddings``. A window only when ``use_sliding_window``; which layers slide:
  ``layer_types`` when the config lists them, else layers ``>= max_window_layers``.
- "qwen3": as "qwen2" plus an RMSNorm over each head of q and k before RoPE; biases on
  q/k/v/o only with ``attention_bias``.
- "gemma2": ``layer_types`` (default: even layers slide, odd ones are global), attention
  and final logit soft caps, GeGLU (``hidden_activation`` "gelu_pytorch_tanh"), sandwich
  norms, Gemma RMSNorm (scale ``1 + weight``), embeddings times ``sqrt(hidden_size)``,
  query scale ``query_pre_attn_scalar ** -0.5``.
- "gemma3_text": as "gemma2" without soft caps by default, plus Gemma-style q/k norms;
  ``layer_types`` (default: every ``sliding_window_pattern``-th layer (6) is global, the
  rest slide); sliding layers rotate with ``rope_local_base_freq`` (10k), global ones with
  ``rope_theta`` (1M) and ``rope_scaling``; transformers 5 writes both as
  ``rope_parameters[layer_type]``.
- "gemma3" (the multimodal Gemma 3 checkpoints, 4B and up): their text decoder, a
  "gemma3_text" read from ``text_config`` over transformers' defaults
  (``GEMMA3_TEXT_DEFAULTS``); the vision tower's weights are not loaded (text prompts only).
- "gpt_oss": a mixture-of-experts MLP (``num_local_experts`` experts, the top
  ``num_experts_per_tok`` per token, ``models.moe``), a learned sink logit per query head,
  biases on q/k/v/o (``attention_bias``, default True), ``layer_types`` (default: even
  layers slide, odd ones are global) and YaRN RoPE (default: transformers' gpt-oss one).
  MXFP4-quantised checkpoints (``quantization_config`` of ``quant_method`` "mxfp4", as
  OpenAI publishes them) are refused: dequantise them to bfloat16 first (``models.moe``).
- RoPE: ``rope_scaling`` / ``rope_parameters`` of type None / "default" (plain), "linear",
  "llama3" or "yarn" (``models.rope.YarnScaling``, its attention factor multiplying cos and
  sin); any other type ("dynamic", "longrope", ...) and ``partial_rotary_factor != 1``
  are refused. Both the legacy keys (``rope_theta`` + ``rope_scaling`` with "type" or
  "rope_type") and transformers>=5's ``rope_parameters`` are read. The pretraining length
  of "llama3" / "yarn" is read as transformers reads it: a top-level
  ``original_max_position_embeddings`` first (flat parameters only; not Gemma 3's), then
  the dict's, then ``max_position_embeddings``.
- The MLP: SwiGLU (``hidden_act`` "silu") or GeGLU (Gemma's "gelu_pytorch_tanh"), or
  gpt-oss's experts (each a clamped SwiGLU, ``swiglu_alpha`` / ``swiglu_limit``).

A window is W tokens, the token itself included (``paged_attention``'s ``sliding_window``);
sliding layers are served at any window size, including windows shorter than the context.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from paged_jax._json import read_json_object
from paged_jax.models.rope import YarnScaling
from paged_jax.pallas_kernels.validation import MAX_SOFT_CAP

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                         "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Gemma 3's multimodal checkpoints (model_type "gemma3": the 4B, 12B and 27B models) keep
# the text decoder's config in ``text_config``, writing only what differs from
# transformers' ``Gemma3TextConfig`` defaults: these are those defaults (checked against
# transformers in tests/models/test_gemma3_multimodal.py).
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, sliding_window=4096,
    query_pre_attn_scalar=256, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0, eos_token_id=1, bos_token_id=2)
FULL, SLIDING = "full_attention", "sliding_attention"
"""The per-layer attention kinds of transformers' ``layer_types``."""
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gated MLP's activations: SwiGLU's and GeGLU's (tanh-approximated GELU)."""
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
"""transformers' RoPE for a gpt-oss config.json that names none (theta 150000)."""


class CheckpointNotFoundError(FileNotFoundError, ValueError):
  """A checkpoint path, its config.json or one of its weight files does not exist: a
  ``FileNotFoundError`` (an OS error, as ``open`` gives) and a ``ValueError`` (bad input,
  named, as every other argument of the library refuses it)."""


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
class LinearRopeScaling:
  """Linear RoPE position interpolation (``rope_type="linear"``): frequencies / ``factor``."""

  factor: float

  def __post_init__(self):
    object.__setattr__(self, "factor", _positive_float("rope_scaling.factor", self.factor))


def _inv_frequencies(head_dim: int, theta: float, scaling) -> np.ndarray:
  """f32[D / 2] RoPE inverse frequencies of one base and scaling, as transformers computes
  them (float32)."""
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
  if scaling is None:
    return inv_freq
  if isinstance(scaling, LinearRopeScaling):
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  if isinstance(scaling, YarnScaling):
    return scaling.inv_frequencies(head_dim, theta)[0]
  s = scaling
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder of the supported families (module docstring).

  Attributes:
    model_type: one of ``SUPPORTED_MODEL_TYPES``.
    vocab_size: V.
    embed_dim: E (HF ``hidden_size``).
    mlp_dim: I (HF ``intermediate_size``).
    num_layers: L.
    num_heads: H query heads.
    num_kv_heads: K KV heads; H must be a multiple of K.
    head_dim: D (HF ``head_dim``, default ``E // H``); must be even for RoPE.
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base (of the full-attention layers when ``local_rope_theta`` is set).
    rope_scaling: None (plain RoPE), a llama3 ``RopeScaling``, a ``LinearRopeScaling`` or
      a ``YarnScaling`` (of the full-attention layers when ``local_rope_theta`` is set).
    max_seq_len: longest sequence the model is meant to serve (HF
      ``max_position_embeddings`` unless overridden).
    tie_word_embeddings: the LM head is the transposed embedding.
    qkv_bias: q/k/v projections carry a bias (Qwen2; Llama's ``attention_bias``).
    o_bias: the output projection carries a bias (Llama's ``attention_bias``).
    bos_token_id: None or the BOS id.
    eos_token_ids: the EOS ids (a checkpoint may list several).
    checkpoint_dtype: the dtype name the checkpoint declares ("bfloat16", ...), or None.
    layer_types: () (every layer full attention) or one of ``FULL`` / ``SLIDING`` per layer.
    sliding_window: W of the ``SLIDING`` layers (None: they attend to everything).
    local_rope_theta: None, or the RoPE base of the ``SLIDING`` layers, which then rotate
      without ``rope_scaling`` (Gemma 3's ``rope_local_base_freq``).
    query_scale: the softmax scale, None for ``head_dim ** -0.5`` (Gemma:
      ``query_pre_attn_scalar ** -0.5``).
    attn_soft_cap: None or the attention logit soft cap (Gemma 2's 50).
    final_soft_cap: None or the cap of the output logits, ``c * tanh(logits / c)``.
    qk_norm: an RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3).
    gemma_norms: every RMSNorm scales by ``1 + weight``, multiplied in float32 before the
      cast back (Gemma); else by ``weight`` after the cast (Llama).
    sandwich_norms: a norm after attention and after the MLP too, before each residual
      add (Gemma 2 / 3: pre- and post-attention, pre- and post-feedforward norms).
    hidden_act: the gated MLP's activation, one of ``ACTIVATIONS``.
    scale_embeddings: the embedding rows are multiplied by ``sqrt(embed_dim)`` (cast to the
      model dtype first, as transformers does).
    attention_sinks: each layer learns one sink logit per query head (gpt-oss), passed to
      ``paged_attention(..., sinks=)``.
    num_experts: O, 0 for a dense gated MLP; else every layer's MLP is a mixture of O
      experts of width ``mlp_dim`` (``models.moe.MoEMLP``, gpt-oss).
    experts_per_token: k, the experts each token is routed to (0 when ``num_experts`` is).
    swiglu_alpha, swiglu_limit: the experts' clamped SwiGLU (gpt-oss: 1.702, 7.0).
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
  rope_scaling: RopeScaling | LinearRopeScaling | None = None
  max_seq_len: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  checkpoint_dtype: str | None = None
  layer_types: tuple[str, ...] = ()
  sliding_window: int | None = None
  local_rope_theta: float | None = None
  query_scale: float | None = None
  attn_soft_cap: float | None = None
  final_soft_cap: float | None = None
  qk_norm: bool = False
  gemma_norms: bool = False
  sandwich_norms: bool = False
  hidden_act: str = "silu"
  scale_embeddings: bool = False
  attention_sinks: bool = False
  num_experts: int = 0
  experts_per_token: int = 0
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={self.model_type!r} is not supported; expected one of "
                       f"{SUPPORTED_MODEL_TYPES}")
    for name in ("vocab_size", "embed_dim", "mlp_dim", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_seq_len"):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    for name in ("rms_norm_eps", "rope_theta"):
      object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
    for name in ("local_rope_theta", "query_scale", "attn_soft_cap", "final_soft_cap"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
    for name in ("attn_soft_cap", "final_soft_cap"):  # inf made NaN logits
      cap = getattr(self, name)
      if cap is not None and not cap <= MAX_SOFT_CAP:
        raise ValueError(f"{name}={cap!r} must be <= {MAX_SOFT_CAP:g} (a larger cap changes "
                         "no float32 logit: use None)")
    if self.sliding_window is not None:
      object.__setattr__(self, "sliding_window",
                         _positive_int("sliding_window", self.sliding_window))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    if self.rope_scaling is not None and not isinstance(
        self.rope_scaling, (RopeScaling, LinearRopeScaling, YarnScaling)):
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None, a RopeScaling, "
                       "a LinearRopeScaling or a YarnScaling")
    for name in ("num_experts", "experts_per_token"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"experts_per_token={self.experts_per_token} must be in "
                       f"[1, num_experts={self.num_experts}]")
    if not self.num_experts and self.experts_per_token:
      raise ValueError(f"experts_per_token={self.experts_per_token} needs num_experts > 0")
    for name in ("swiglu_alpha", "swiglu_limit"):
      object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
    eos = self.eos_token_ids
    if not isinstance(eos, tuple) or not all(isinstance(e, int) for e in eos):
      raise ValueError(f"eos_token_ids={eos!r} must be a tuple of ints")
    types = self.layer_types
    if not isinstance(types, tuple) or (types and (len(types) != self.num_layers or any(
        t not in (FULL, SLIDING) for t in types))):
      raise ValueError(f"layer_types={types!r} must be () or a tuple of num_layers="
                       f"{self.num_layers} entries, each {FULL!r} or {SLIDING!r}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act={self.hidden_act!r} must be one of {ACTIVATIONS}")

  @property
  def group(self) -> int:
    """G, query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def sm_scale(self) -> float:
    """The softmax scale of every layer."""
    return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

  def attention_kinds(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(the distinct layer types, in order of first use; the index of each layer's type).

    A model whose layers all attend alike has one kind; Gemma 2 / 3 have two.
    """
    types = self.layer_types or (FULL,) * self.num_layers
    kinds = tuple(dict.fromkeys(types))
    return kinds, tuple(kinds.index(t) for t in types)

  def window_of(self, layer_type: str) -> int | None:
    """``paged_attention``'s ``sliding_window`` for layers of this type."""
    return self.sliding_window if layer_type == SLIDING else None

  def rope_inv_frequencies(self, layer_type: str = FULL) -> np.ndarray:
    """f32[D / 2] RoPE inverse frequencies of layers of this type (float32, as
    transformers computes them)."""
    if layer_type == SLIDING and self.local_rope_theta is not None:
      return _inv_frequencies(self.head_dim, self.local_rope_theta, None)
    return _inv_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

  def rope_attention_factor(self, layer_type: str = FULL) -> float:
    """What RoPE's cos and sin are multiplied by in layers of this type: YaRN's attention
    factor, 1 for the other RoPE types."""
    if layer_type == SLIDING and self.local_rope_theta is not None:
      return 1.0
    if isinstance(self.rope_scaling, YarnScaling):
      return self.rope_scaling.inv_frequencies(self.head_dim, self.rope_theta)[1]
    return 1.0

  @classmethod
  def from_hf_dict(cls, hf: Mapping[str, Any], *, max_seq_len: int | None = None
                   ) -> "ModelConfig":
    """The config of a Hugging Face ``config.json`` dict; refuses what is not supported.

    Args:
      hf: the parsed ``config.json``.
      max_seq_len: serve at most this many tokens per sequence (default: the checkpoint's
        ``max_position_embeddings``).
    """
    if not isinstance(hf, Mapping):
      raise ValueError(f"hf={type(hf).__name__} must be a mapping (a parsed config.json)")
    hf = text_config_of(hf)
    model_type = hf.get("model_type")
    if model_type == "gemma3":  # text_config_of found none
      raise ValueError("model_type='gemma3' in config.json needs its text decoder's config "
                       "under 'text_config' (a multimodal Gemma 3 config), which is missing "
                       "or not an object; a text-only config is model_type 'gemma3_text'")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={model_type!r} in config.json is not supported; expected "
                       f"one of {SUPPORTED_MODEL_TYPES}, or gemma3 (served as its text "
                       "decoder, gemma3_text)")

    def need(key: str):
      if hf.get(key) is None:
        raise ValueError(f"config.json key {key!r} is missing (model_type={model_type!r})")
      return hf[key]

    gemma = model_type in ("gemma2", "gemma3_text")
    # Gemma's modules read only hidden_activation (its hidden_act, if any, is unused).
    act = (hf.get("hidden_activation") or "gelu_pytorch_tanh" if gemma
           else hf.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
      raise ValueError(f"hidden_act={act!r} is not supported; expected one of {ACTIVATIONS}")
    if hf.get("mlp_bias", False) and model_type == "llama":  # the one family reading it
      raise ValueError("mlp_bias=True is not supported (gated MLPs without biases only)")
    quantization = hf.get("quantization_config") or {}
    if quantization:
      raise ValueError(
          f"quantization_config={dict(quantization)!r}: quantised checkpoints are not "
          "supported; load a bfloat16 / float32 one (gpt-oss's MXFP4 experts: dequantise "
          "first, e.g. transformers' Mxfp4Config(dequantize=True) then save_pretrained)")
    if hf.get("use_bidirectional_attention"):
      raise ValueError("use_bidirectional_attention=True is not supported (causal decoders "
                       "only)")
    num_heads = need("num_attention_heads")
    embed_dim = need("hidden_size")
    head_dim = hf.get("head_dim") or (embed_dim // num_heads if isinstance(embed_dim, int)
                                      and isinstance(num_heads, int) else None)
    positions = hf.get("max_position_embeddings", 4096)
    if max_seq_len is None:
      max_seq_len = positions
    max_seq_len = _positive_int("max_seq_len", max_seq_len)

    layer_types, window = hf_attention_layout(hf)
    full_rope, sliding_rope = _rope_parameters_by_layer_type(hf)
    rope_theta, rope_scaling = _rope_from_params(full_rope, max_position_embeddings=positions)
    local_theta = None
    if sliding_rope is not None and SLIDING in layer_types:
      local_theta, local_scaling = _rope_from_params(sliding_rope)
      if local_scaling is not None:
        raise ValueError("rope_parameters['sliding_attention'] with a rope_type other than "
                         "'default' is not supported")

    gpt_oss = model_type == "gpt_oss"
    # transformers' Mistral and Qwen2 fix their biases in code (none; q/k/v only) and
    # ignore an attention_bias key; the others read it.
    attention_bias = (model_type not in ("mistral", "qwen2")
                      and bool(hf.get("attention_bias", gpt_oss)))
    num_experts = experts_per_token = 0
    if gpt_oss:  # transformers' attribute_map: num_experts -> num_local_experts
      num_experts = hf.get("num_local_experts", hf.get("num_experts"))
      experts_per_token = hf.get("num_experts_per_tok", hf.get("experts_per_token"))
      if num_experts is None or experts_per_token is None:
        raise ValueError("config.json keys 'num_local_experts' and 'num_experts_per_tok' "
                         f"are needed (got {num_experts!r}, {experts_per_token!r})")
    eos = hf.get("eos_token_id")
    eos = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, (list, tuple))
                                  else (int(eos),))
    bos = hf.get("bos_token_id")
    # transformers' defaults where the config.json omits them: Gemma 2 caps at 50 / 30.
    query_scalar = hf.get("query_pre_attn_scalar", 256) if gemma else None
    caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
    return cls(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        embed_dim=embed_dim,
        mlp_dim=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5 if gpt_oss else 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        layer_types=layer_types if SLIDING in layer_types else (),
        sliding_window=window,
        local_rope_theta=local_theta,
        query_scale=None if query_scalar is None else _positive_float(
            "query_pre_attn_scalar", query_scalar) ** -0.5,
        # Gemma 3's attention keeps the key but never applies it (transformers' Gemma3
        # attention passes no softcap; published configs set it null): neither do we.
        attn_soft_cap=(hf.get("attn_logit_softcapping", caps[0])
                       if model_type == "gemma2" else None),
        final_soft_cap=hf.get("final_logit_softcapping", caps[1]) if gemma else None,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        gemma_norms=gemma,
        sandwich_norms=gemma,
        hidden_act=act,
        scale_embeddings=gemma,
        attention_sinks=gpt_oss,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        swiglu_limit=hf.get("swiglu_limit", 7.0),
    )

  @classmethod
  def from_json(cls, path: str | os.PathLike, *, max_seq_len: int | None = None
                ) -> "ModelConfig":
    """``from_hf_dict`` of a ``config.json`` file, or of the one in a checkpoint directory."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise CheckpointNotFoundError(f"path={path!r}: config file does not exist")
    hf = read_json_object(path)
    # A checkpoint's generation_config.json (beside it) holds the EOS ids generation stops
    # at, often more than config.json lists (chat models' end-of-turn ids); transformers'
    # generate uses its ids when it names them, as do we.
    generation_path = os.path.join(os.path.dirname(path), "generation_config.json")
    if os.path.isfile(generation_path):
      eos = read_json_object(generation_path).get("eos_token_id")
      if eos is not None:
        hf = dict(hf, eos_token_id=eos)
    return cls.from_hf_dict(hf, max_seq_len=max_seq_len)


def text_config_of(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text decoder's config of a multimodal Gemma 3 ``config.json`` (``model_type``
  "gemma3" with a ``text_config``) as a "gemma3_text" dict: transformers' defaults, then
  the ``text_config``, the dtype when only the top level names it, and the top level's
  EOS / BOS / pad ids (those generation uses). Any other config is returned as it is."""
  text = hf.get("text_config")
  if hf.get("model_type") != "gemma3" or not isinstance(text, Mapping):
    return hf
  merged = {**GEMMA3_TEXT_DEFAULTS, **text, "model_type": "gemma3_text"}
  if merged.get("torch_dtype") is None and merged.get("dtype") is None:
    merged["torch_dtype"] = hf.get("torch_dtype") or hf.get("dtype")
  for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
    if hf.get(key) is not None:
      merged[key] = hf[key]
  return merged


# transformers' defaults (5.25) for a config.json that leaves ``sliding_window`` out.
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "gemma2": 4096, "gemma3_text": 4096,
                           "gpt_oss": 128}


def hf_attention_layout(hf: Mapping[str, Any]) -> tuple[tuple[str, ...], int | None]:
  """(one layer type per layer, the sliding window) of a ``config.json`` dict, with the
  defaults transformers fills in for its ``model_type`` (module docstring).

  Also used by the capacity planner, so it reads only what it needs and accepts any
  ``model_type`` (an unknown one: its ``layer_types`` if listed, else all full).
  """
  model_type = hf.get("model_type")
  num_layers = hf.get("num_hidden_layers")
  if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
    raise ValueError(f"num_hidden_layers={num_layers!r} in config.json must be a positive int")
  # A config.json without the key gets the window transformers' config class defaults to.
  window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type))
  if window is not None:
    window = _positive_int("sliding_window", window)
  listed = hf.get("layer_types")
  if model_type == "llama":
    return (FULL,) * num_layers, None
  if model_type == "mistral":  # one window for every layer (layer_types is not read)
    return ((FULL if window is None else SLIDING),) * num_layers, window
  if model_type in ("qwen2", "qwen3"):
    if not hf.get("use_sliding_window", False):
      window = None
    if not listed:
      first = hf.get("max_window_layers", 28)
      listed = [SLIDING if window is not None and i >= first else FULL
                for i in range(num_layers)]
  elif not listed and model_type in ("gemma2", "gemma3_text", "gpt_oss"):
    every = hf.get("sliding_window_pattern", 6) if model_type == "gemma3_text" else 2
    every = _positive_int("sliding_window_pattern", every)
    listed = [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
  listed = tuple(listed or (FULL,) * num_layers)
  if len(listed) != num_layers or any(t not in (FULL, SLIDING) for t in listed):
    raise ValueError(f"layer_types={list(listed)} in config.json must list {FULL!r} or "
                     f"{SLIDING!r} for each of num_hidden_layers={num_layers} layers")
  return listed, window


def _rope_parameters_by_layer_type(hf: Mapping[str, Any]
                                   ) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """(RoPE parameters of the full-attention layers, of the sliding ones or None when they
  are the same) from the legacy keys or transformers 5's ``rope_parameters`` (flat, or one
  dict per layer type as Gemma 3 writes it)."""
  params = dict(hf.get("rope_parameters") or {})
  sliding = None
  nested = isinstance(params.get(FULL), Mapping) or isinstance(params.get(SLIDING), Mapping)
  if nested:
    sliding = dict(params.get(SLIDING) or {})
    params = dict(params.get(FULL) or {})
  legacy = hf.get("rope_scaling")
  if legacy:
    params = {**params, **legacy}
  gemma3 = hf.get("model_type") == "gemma3_text"
  if hf.get("model_type") == "gpt_oss" and "rope_type" not in params and "type" not in params:
    params.update(GPT_OSS_ROPE)  # transformers' GptOssConfig default
  # transformers' defaults: Gemma 3 global 1M, gpt-oss 150k, local 10k; everyone else 10k.
  default_theta = {"gemma3_text": 1_000_000.0, "gpt_oss": 150_000.0}.get(
      hf.get("model_type"), 10_000.0)
  params.setdefault("rope_theta", hf.get("rope_theta", default_theta))
  params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if gemma3:
    sliding = dict(sliding or {})
    sliding.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
  # As transformers' standardize_rope_params: a llama3 / yarn RoPE's pretraining length is a
  # top-level original_max_position_embeddings when there is one (Phi-3 writes it there;
  # it wins over the dict's own for flat parameters only: not per layer type, as Gemma 3's
  # always are in transformers, a legacy flat rope_scaling too), else the dict's, else
  # max_position_embeddings.
  for group in (params, sliding):
    if group is None or group.get("rope_type", group.get("type")) not in ("llama3", "yarn"):
      continue
    if hf.get("original_max_position_embeddings") is not None and not (nested or gemma3):
      group["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    elif hf.get("max_position_embeddings") is not None:
      group.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
  return params, sliding


def _rope_from_params(params: Mapping[str, Any], *, max_position_embeddings: int | None = None
                      ) -> tuple[float, RopeScaling | LinearRopeScaling | YarnScaling | None]:
  """(rope_theta, rope_scaling) of one set of RoPE parameters (``max_position_embeddings``:
  YaRN's factor when its parameters give none)."""
  theta = params.get("rope_theta", 10000.0)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; expected one of "
                     f"{SUPPORTED_ROPE_TYPES} (or no rope_scaling)")
  partial = params.get("partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise ValueError(f"partial_rotary_factor={partial} is not supported; only 1.0")
  if rope_type == "default":
    return theta, None
  if rope_type == "linear":
    if "factor" not in params:
      raise ValueError("rope_scaling of type 'linear' lacks ['factor']")
    return theta, LinearRopeScaling(factor=params["factor"])
  if rope_type == "yarn":
    return theta, YarnScaling.from_hf(params, max_position_embeddings=max_position_embeddings)
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings") if k not in params]
  if missing:
    raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")
  return theta, RopeScaling(
      factor=params["factor"], low_freq_factor=params["low_freq_factor"],
      high_freq_factor=params["high_freq_factor"],
      original_max_position_embeddings=params["original_max_position_embeddings"])
