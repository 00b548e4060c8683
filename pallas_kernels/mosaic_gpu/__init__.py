"""Pallas ragged paged attention on the Mosaic GPU backend (Hopper and later, no Triton).

``ragged_paged_attention`` has the shared kernel signature (see ``pallas_kernels``);
``available()`` says whether the installed JAX has the Mosaic GPU pieces it uses. Pages
come into shared memory by TMA through the block table, a ring of chunks deep; scores and
updates run on the tensor cores (wgmma) with float32 accumulation; long decode contexts
are split (flash-decoding). ``copied_pages`` runs the same kernel in interpret mode with a
counter beside each page copy it issues (the evidence that windows bound the copies);
``profiled_attention`` runs it on a GPU with the Mosaic GPU profiler on (a trace of where
each program spends its cycles).
"""

from paged_jax.pallas_kernels.mosaic_gpu.compat import available, interpret_available
from paged_jax.pallas_kernels.mosaic_gpu.ragged import (CopiedPages, copied_pages,
                                                      default_tiling_for, operand_plan,
                                                      profiled_attention,
                                                      ragged_paged_attention,
                                                      unsupported_reason)
from paged_jax.pallas_kernels.mosaic_gpu.tiling import MosaicTiling

__all__ = ["CopiedPages", "MosaicTiling", "available", "copied_pages", "default_tiling_for",
           "interpret_available", "operand_plan", "profiled_attention",
           "ragged_paged_attention", "unsupported_reason"]
