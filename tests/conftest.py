"""Suite-wide settings.

The engine turns JAX's persistent compilation cache on by default (a fast second start for
users). The suite keeps it off, so its time is what a fresh machine pays and no run depends
on what an earlier one left on disk; tests/paged_jax/test_compile_cache.py turns it on in a
subprocess of its own.
"""

import os

import pytest

os.environ.setdefault("PAGED_JAX_COMPILATION_CACHE", "off")


class _NeverRaised(Exception):
  """No test raises this: as ``only_rerun`` it keeps every ordinary failure a failure."""


# XLA:CPU (jax 0.10.2) now and then segfaults while compiling the TPU interpreter's program
# for a test_tpu.py case (in backend_compile_and_load, at the optimisation level 0 the file
# asks for): up to two cases a CI run (stops 29-32), each time different ones, which passed
# when run again. Under pytest-xdist such a test gets TWO reruns when its worker dies (at
# ~1% of the grid's cases crashing per run, one case crashing twice would fail ~2% of CI
# runs; three times, ~0.02%); an assertion or exception still fails at once (only_rerun
# names an exception nobody raises), and a crash that repeats still fails.
_CRASH_RERUN_FILES = ("tests/pallas_kernels/test_tpu.py",)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.nodeid.startswith(_CRASH_RERUN_FILES):
      item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=[_NeverRaised]))
