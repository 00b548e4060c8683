"""RoPE frequency schemes beyond plain and Llama-3: YaRN (gpt-oss).

A scheme gives the inverse frequencies ``inv_freq`` f32[D / 2] (angle of pair ``i`` at
position ``p`` is ``p * inv_freq[i]``) and an ``attention_factor`` that multiplies both cos
and sin (so q.k scales by its square). Computed on the host in float32 with the
operations transformers' ``modeling_rope_utils`` uses, in the same order (numpy's float32
``pow`` may round an ulp away from torch's).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_frequencies(*, head_dim: int, theta: float, factor: float,
                         original_max_position_embeddings: int, beta_fast: float = 32.0,
                         beta_slow: float = 1.0, truncate: bool = True,
                         attention_factor: float | None = None, mscale: float | None = None,
                         mscale_all_dim: float | None = None
                         ) -> tuple[np.ndarray, float]:
  """``(inv_freq f32[D / 2], attention_factor)`` of YaRN RoPE (``rope_type="yarn"``).

  Pairs that turn more than ``beta_fast`` times over the original context keep their
  frequency (extrapolate), pairs that turn fewer than ``beta_slow`` times are slowed by
  ``factor`` (interpolate), and a linear ramp over the pair index blends the band
  between. gpt-oss: theta 150000, factor 32, beta_fast 32, beta_slow 1, original context
  4096, ``truncate=False``.

  Args:
    head_dim: D (even).
    theta: RoPE base.
    factor: context extension factor (> 0).
    original_max_position_embeddings: the pre-training context.
    beta_fast, beta_slow: the ramp's ends, in rotations over the original context
      (transformers replaces a 0 or None by 32 and 1).
    truncate: round the ramp's ends outward to whole pair indices (transformers' default
      when the config has no ``truncate`` key; gpt-oss's config says False).
    attention_factor: the cos/sin multiplier; None derives it from ``factor`` (and from
      ``mscale`` / ``mscale_all_dim`` when both are given), as transformers does.
  """
  if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
    raise ValueError(f"{head_dim=} must be a positive even int")
  if not factor > 0:
    raise ValueError(f"{factor=} must be > 0")
  if not theta > 1:
    raise ValueError(f"{theta=} must be > 1")
  if (isinstance(original_max_position_embeddings, bool)
      or not isinstance(original_max_position_embeddings, int)
      or original_max_position_embeddings <= 0):
    raise ValueError(f"{original_max_position_embeddings=} must be a positive int")
  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
      attention_factor = yarn_mscale(factor)
  beta_fast = beta_fast or 32.0
  beta_slow = beta_slow or 1.0
  d = head_dim

  def pair_of(rotations: float) -> float:
    # The (fractional) pair index whose wavelength fits `rotations` times in the original
    # context: solve original / (2 pi theta^(2i/d)) = rotations for i.
    return (d * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = pair_of(beta_fast), pair_of(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001  # as transformers: a zero-width ramp would divide by zero

  exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
  pos_freqs = np.float32(theta) ** exponent
  extrapolation = np.float32(1.0) / pos_freqs
  interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
  ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  keep = np.float32(1) - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
  inv_freq = interpolation * (np.float32(1) - keep) + extrapolation * keep
  return inv_freq.astype(np.float32), float(attention_factor)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling (``rope_type="yarn"``), as a ``ModelConfig.rope_scaling``.

  Attributes: those of ``yarn_inv_frequencies`` (``attention_factor`` None: derived from
  ``factor``, and from ``mscale`` / ``mscale_all_dim`` when both are given).
  """

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None

  def __post_init__(self):
    if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not (
        self.factor > 0):
      raise ValueError(f"rope_scaling.factor={self.factor!r} must be a positive number")
    o = self.original_max_position_embeddings
    if isinstance(o, bool) or not isinstance(o, int) or o <= 0:
      raise ValueError(f"rope_scaling.original_max_position_embeddings={o!r} must be a "
                       "positive int")
    if not isinstance(self.truncate, bool):
      raise ValueError(f"rope_scaling.truncate={self.truncate!r} must be a bool")
    if self.attention_factor is not None and not self.attention_factor > 0:
      raise ValueError(f"rope_scaling.attention_factor={self.attention_factor!r} must be > 0")

  @classmethod
  def from_hf(cls, params: Mapping[str, Any], *, max_position_embeddings: int | None = None
              ) -> "YarnScaling":
    """From a ``rope_parameters`` / ``rope_scaling`` dict of type "yarn", with transformers'
    defaults: a missing ``factor`` is ``max_position_embeddings / original``, a 0 or missing
    beta is 32 / 1, a missing ``truncate`` is True."""
    original = params.get("original_max_position_embeddings")
    if original is None:
      raise ValueError("rope_scaling of type 'yarn' lacks 'original_max_position_embeddings'")
    factor = params.get("factor")
    if factor is None:
      if max_position_embeddings is None:
        raise ValueError("rope_scaling of type 'yarn' lacks 'factor'")
      factor = max_position_embeddings / original
    return cls(factor=factor, original_max_position_embeddings=original,
               beta_fast=params.get("beta_fast") or 32.0,
               beta_slow=params.get("beta_slow") or 1.0,
               truncate=params.get("truncate", True),
               attention_factor=params.get("attention_factor"),
               mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"))

  def inv_frequencies(self, head_dim: int, theta: float) -> tuple[np.ndarray, float]:
    """``(inv_freq f32[D / 2], attention_factor)`` (``yarn_inv_frequencies``)."""
    return yarn_inv_frequencies(
        head_dim=head_dim, theta=theta, factor=self.factor,
        original_max_position_embeddings=self.original_max_position_embeddings,
        beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
        attention_factor=self.attention_factor, mscale=self.mscale,
        mscale_all_dim=self.mscale_all_dim)
