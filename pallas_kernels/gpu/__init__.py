"""Pallas GPU ragged paged attention: split-K (flash-decoding) over the paged KV cache.

``ragged_paged_attention`` has the shared kernel signature (see ``pallas_kernels``); the
Triton-lowered kernel lives in ``triton_ragged`` and the backend is chosen in ``ragged``.
"""

from paged_jax.pallas_kernels.gpu.ragged import (DEFAULT_BACKEND, default_tiling_for,
                                                 loaded_pages, ragged_paged_attention,
                                                 unsupported_reason)
from paged_jax.pallas_kernels.gpu.tiling import GpuTiling, default_tiling

__all__ = ["DEFAULT_BACKEND", "GpuTiling", "default_tiling", "default_tiling_for",
           "loaded_pages", "ragged_paged_attention", "unsupported_reason"]
