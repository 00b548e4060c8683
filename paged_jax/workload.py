"""A synthetic serving workload: a long-tailed mix of prompt and output lengths.

Prompt and output lengths are drawn independently from log-normal distributions,
``round(median * exp(sigma * N(0, 1)))`` clipped to ``[1, max]``, so most requests are short
and a few are long (sigma 0.8 puts the 95th percentile near 3.7x the median). Prompt tokens
are uniform over ``[first_token_id, vocab_size)`` (ids below ``first_token_id`` are left to
special tokens such as BOS/EOS). Every request decodes greedily with ``ignore_eos=True`` so
its output length is exactly the drawn one. Everything follows from ``seed``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported in make_requests: the CLI builds its parser without JAX
  from paged_jax.sampling import SamplingParams

__all__ = ["Workload", "make_requests"]


@dataclasses.dataclass(frozen=True)
class Workload:
  """Parameters of the synthetic workload (module docstring).

  Attributes:
    num_requests: how many requests.
    prompt_median, prompt_sigma, max_prompt_len: log-normal prompt lengths.
    output_median, output_sigma, max_output_len: log-normal output lengths (max_tokens).
    vocab_size: prompt ids are drawn below it.
    first_token_id: prompt ids are drawn at or above it.
    seed: the numpy seed of every draw.
  """

  num_requests: int = 64
  prompt_median: int = 24
  prompt_sigma: float = 0.8
  max_prompt_len: int = 192
  output_median: int = 16
  output_sigma: float = 0.8
  max_output_len: int = 96
  vocab_size: int = 256
  first_token_id: int = 3
  seed: int = 0

  def __post_init__(self):
    for name in ("num_requests", "prompt_median", "max_prompt_len", "output_median",
                 "max_output_len", "vocab_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    for name in ("prompt_sigma", "output_sigma"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
    if not 0 <= self.first_token_id < self.vocab_size:
      raise ValueError(f"first_token_id={self.first_token_id} must be in [0, vocab_size="
                       f"{self.vocab_size})")


def _lognormal_lengths(rng, n, median, sigma, max_len) -> np.ndarray:
  draw = median * np.exp(sigma * rng.standard_normal(n))
  return np.clip(np.round(draw), 1, max_len).astype(np.int64)


def make_requests(workload: Workload) -> tuple[list[list[int]], list[SamplingParams]]:
  """``(prompts, params)`` of the workload, ready for ``LLM.generate``."""
  from paged_jax.sampling import SamplingParams
  w = workload
  rng = np.random.default_rng(w.seed)
  prompt_lens = _lognormal_lengths(rng, w.num_requests, w.prompt_median, w.prompt_sigma,
                                   w.max_prompt_len)
  output_lens = _lognormal_lengths(rng, w.num_requests, w.output_median, w.output_sigma,
                                   w.max_output_len)
  prompts = [[int(t) for t in rng.integers(w.first_token_id, w.vocab_size, n)]
             for n in prompt_lens]
  params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in output_lens]
  return prompts, params
