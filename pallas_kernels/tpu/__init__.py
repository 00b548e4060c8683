"""Pallas TPU (Mosaic) kernels: ragged paged attention over the ``[L, K, N, Z, D]`` pool."""

from __future__ import annotations

from paged_jax.pallas_kernels.tpu.ragged import TpuTiling
from paged_jax.pallas_kernels.tpu.ragged import default_tiling
from paged_jax.pallas_kernels.tpu.ragged import ragged_paged_attention
from paged_jax.pallas_kernels.tpu.ragged import unsupported_reason

__all__ = ["TpuTiling", "default_tiling", "ragged_paged_attention", "unsupported_reason"]
