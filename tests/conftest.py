"""Suite-wide settings.

The engine turns JAX's persistent compilation cache on by default (a fast second start for
users). The suite keeps it off, so its time is what a fresh machine pays and no run depends
on what an earlier one left on disk; tests/paged_jax/test_compile_cache.py turns it on in a
subprocess of its own.
"""

import os

os.environ.setdefault("PAGED_JAX_COMPILATION_CACHE", "off")
