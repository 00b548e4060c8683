"""Blocked ragged paged attention in plain XLA: the CPU path and the fallback everywhere."""

from paged_jax.pallas_kernels.xla.prefill import PrefillTiling
from paged_jax.pallas_kernels.xla.ragged import XlaTiling, default_tiling, ragged_paged_attention

__all__ = ["PrefillTiling", "XlaTiling", "default_tiling", "ragged_paged_attention"]
