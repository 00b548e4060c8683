"""Blocked ragged paged attention in plain XLA: the CPU path and the fallback everywhere."""

from paged_jax.pallas_kernels.xla.ragged import XlaTiling, default_tiling, ragged_paged_attention

__all__ = ["XlaTiling", "default_tiling", "ragged_paged_attention"]
