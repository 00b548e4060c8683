"""What this kernel needs from the installed JAX: the ONE place that imports Mosaic GPU.

Everything version-dependent lives here: the public Mosaic GPU Pallas module
(``jax.experimental.pallas.mosaic_gpu``) and the Mosaic GPU interpret mode, which is
private in jax 0.10.2 (``jax._src.pallas.mosaic_gpu.interpret``). The rest of the package
imports ``plgpu`` from here and asks ``interpret_params()`` for the interpreter, so a JAX
that moves or drops either is met with one clear error naming the installed version.
"""

from __future__ import annotations

import importlib

import jax

try:  # The public Mosaic GPU Pallas API (Hopper and later).
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover - depends on the installed JAX
  plgpu = None
  _IMPORT_ERROR: Exception | None = e
else:
  _IMPORT_ERROR = None

# The names the kernel uses: a JAX whose Mosaic GPU module lacks one of them cannot run it.
REQUIRED_NAMES = (
    "kernel", "SMEM", "Barrier", "ACC", "TilingTransform", "SwizzleTransform", "Layout",
    "copy_gmem_to_smem", "copy_smem_to_gmem", "wait_smem_to_gmem", "barrier_wait",
    "commit_smem", "wgmma", "transpose_ref", "layout_cast", "find_swizzle",
    "broadcasted_iota", "load",
)


def missing_names() -> tuple[str, ...]:
  """The required Mosaic GPU names the installed JAX lacks (all of them without the
  module)."""
  if plgpu is None:
    return REQUIRED_NAMES
  return tuple(name for name in REQUIRED_NAMES if not hasattr(plgpu, name))


def available() -> bool:
  """Whether the installed JAX has the Mosaic GPU backend pieces this kernel uses.

  Says nothing about the device: the kernel itself needs an sm_90 (Hopper) GPU or later
  to run, and any backend to lower for CUDA or to run in interpret mode.
  """
  return not missing_names()


def require() -> None:
  """Raises ``NotImplementedError`` naming the JAX version when ``available()`` is False."""
  missing = missing_names()
  if missing:
    cause = f" ({_IMPORT_ERROR})" if _IMPORT_ERROR is not None else ""
    raise NotImplementedError(
        f"impl='pallas_mosaic_gpu' needs JAX's Mosaic GPU Pallas backend; jax "
        f"{jax.__version__} lacks jax.experimental.pallas.mosaic_gpu."
        f"{', '.join(missing)}{cause}")


# Where jax 0.10.2 keeps the Mosaic GPU interpret mode (private).
INTERPRET_MODULES = ("jax._src.pallas.mosaic_gpu.interpret.params",
                     "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


def _interpret_module():
  try:
    params, interpret_pallas_call = (importlib.import_module(name)
                                     for name in INTERPRET_MODULES)
  except ImportError as e:
    raise NotImplementedError(
        f"interpret=True for impl='pallas_mosaic_gpu' needs the Mosaic GPU interpret mode "
        f"(jax._src.pallas.mosaic_gpu.interpret, private in jax 0.10.2); jax "
        f"{jax.__version__} does not have it at that path ({e})") from e
  if not hasattr(params, "InterpretGPUParams"):
    raise NotImplementedError(
        f"interpret=True for impl='pallas_mosaic_gpu': jax {jax.__version__}'s Mosaic GPU "
        "interpret mode has no InterpretGPUParams")
  return params, interpret_pallas_call


def interpret_available() -> bool:
  """Whether the Mosaic GPU interpret mode (CPU) can be used with the installed JAX."""
  try:
    _interpret_module()
  except NotImplementedError:
    return False
  return True


def interpret_params():
  """The value to pass as ``interpret=`` to ``plgpu.kernel`` to run it on CPU.

  Uninitialised shared memory reads as NaN, so a kernel that consumes a buffer it never
  filled shows it in its output. Raises ``NotImplementedError`` naming the JAX version when
  the interpret mode is missing.
  """
  params, _ = _interpret_module()
  return params.InterpretGPUParams(uninitialized_memory="nan")


def reset_interpret_state() -> None:
  """Clears the interpreter's global simulated-GPU state, which an exception raised inside
  an interpreted kernel leaves behind (the next interpreted kernel would fail on it)."""
  _, interpret_pallas_call = _interpret_module()
  interpret_pallas_call.reset_gpu_interpret_mode_state()
