"""Suite-wide settings.

The engine turns JAX's persistent compilation cache on by default (a fast second start for
users). The suite keeps it off, so its time is what a fresh machine pays and no run depends
on what an earlier one left on disk; tests/paged_jax/test_compile_cache.py turns it on in a
subprocess of its own.
"""

import os

import pytest

os.environ.setdefault("PAGED_JAX_COMPILATION_CACHE", "off")

# The suite's shapes are tiny, so its time is mostly XLA:CPU compiling, and much of that is
# code generation for programs that then run for microseconds. Two settings of XLA_FLAGS cut
# it; they are set here before JAX starts its backend, and subprocesses the tests start
# inherit them. README's main job, the CLI and the benchmarks keep XLA's defaults, and so
# does a run that sets either option itself (XLA_FLAGS="--xla_backend_optimization_level=3
# --xla_cpu_use_fusion_emitters=true" python -m pytest ...); the suite passes either way.
# - Backend (LLVM) optimisation level 0: the same HLO, its elementwise math not vectorised,
#   so a result can differ from the default build's in the last bits (measured: exp, tanh
#   and log1p up to 8 float32 ulps apart, relative 1e-6, on 3-4% of elements; a tiny
#   Llama's logits within 1.4e-6), far inside every tolerance here. README's suite: 22%
#   less time (885 s -> 695 s on an earlier 2-core machine).
# - XLA:CPU's older loop emitters instead of its MLIR fusion emitters (the default): an
#   engine's device call compiles in about half the time (12 s -> 6 s for a tiny Llama's
#   step on this 2-core machine; test_engine.py and test_token_buckets.py took 294 -> 150
#   CPU-seconds). A flag XLA does not know aborts the process, so it is set only where a
#   subprocess shows this jaxlib takes it (~2 s, in the process pytest starts; the xdist
#   workers inherit the flag, or, where it was refused, check again each).
_XLA_TEST_FLAGS = ("--xla_backend_optimization_level=0",
                   "--xla_cpu_use_fusion_emitters=false")


def _xla_takes(flags: str) -> bool:
  """Whether a JAX started with XLA_FLAGS=``flags`` comes up (XLA aborts on a flag it does
  not know)."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  try:
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
  except subprocess.TimeoutExpired:
    return False
  return done.returncode == 0


def _add_xla_test_flags() -> None:
  current = os.environ.get("XLA_FLAGS", "")
  for flag in _XLA_TEST_FLAGS:
    name = flag.split("=")[0]
    if name in current:  # set by the caller, or by the process that started this one
      continue
    candidate = f"{current} {flag}".strip()
    if name == "--xla_backend_optimization_level" or _xla_takes(candidate):
      current = candidate
  os.environ["XLA_FLAGS"] = current


_add_xla_test_flags()


@pytest.fixture(scope="session", autouse=True)
def _shared_jobs_started(request, tmp_path_factory):
  """Starts the subprocess jobs the collected tests read (``tests/shared_jobs.py``) as each
  worker begins, so they run beside other tests; once per run however many workers."""
  from tests import shared_jobs  # noqa: PLC0415
  shared_jobs.start_needed(request.session.items,
                           shared_jobs.folder_for_run(tmp_path_factory))


class _NeverRaised(Exception):
  """No test raises this: as ``only_rerun`` it keeps every ordinary failure a failure."""


# Every program XLA:CPU compiles keeps its code in memory maps of its own (the TPU grid:
# ~360 maps a test), and JAX's caches keep every program for the life of the process. A
# worker that ran half the slow grids passed Linux's default limit of 65,530 maps a process
# (vm.max_map_count); its next compilation then failed: "LLVM compilation error: Cannot
# allocate memory", or the process aborted inside backend_compile_and_load. That was the
# "XLA:CPU segfault" of the TPU grid in stops 29-34 (measured: the slow TPU grid alone
# takes one process from ~900 to ~39,000 maps; a process filled to the limit with other
# maps fails its first compilation). So every few tests, and at each module's end, the
# worker counts its maps and empties JAX's caches past MAP_BUDGET (the tests after it
# compile again what they share, once per emptying).
MAP_BUDGET = 30_000
_CHECK_EVERY = 8  # a count reads /proc/self/maps: ~1 ms per thousand maps
_tests_since_check = 0


def _num_maps() -> int | None:
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:  # not Linux
    return None


def pytest_runtest_teardown(item, nextitem):
  global _tests_since_check
  _tests_since_check += 1
  same_module = (nextitem is not None
                 and getattr(nextitem, "module", None) is getattr(item, "module", None))
  if _tests_since_check < _CHECK_EVERY and same_module:
    return
  _tests_since_check = 0
  maps = _num_maps()
  if maps is not None and maps > MAP_BUDGET:
    import jax  # noqa: PLC0415 (imported by then; kept out of this file's import)
    jax.clear_caches()


# The TPU grid's crashes were the map limit above, which the guard should now prevent. Its
# tests keep TWO reruns when their worker dies, a net for a crash of another cause: an
# assertion or exception still fails at once (only_rerun names an exception nobody raises),
# and a crash that repeats still fails.
_CRASH_RERUN_FILES = ("tests/pallas_kernels/test_tpu.py",)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.nodeid.startswith(_CRASH_RERUN_FILES):
      item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=[_NeverRaised]))
