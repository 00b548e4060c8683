"""JAX's persistent compilation cache, on by default for ``LLM`` and the CLI.

A second start of the same engine (same model shapes, options and JAX version) loads its
compiled device calls from disk instead of compiling them again. The cache lives in the
user's cache directory (``$XDG_CACHE_HOME/paged_jax/jax`` or ``~/.cache/paged_jax/jax``).
Move it with ``LLM(..., compilation_cache="DIR")`` or the environment variable
``PAGED_JAX_COMPILATION_CACHE=DIR``; disable it with ``compilation_cache=False`` or
``PAGED_JAX_COMPILATION_CACHE=off``. A cache directory the user already gave JAX
(``jax_compilation_cache_dir``, e.g. from ``JAX_COMPILATION_CACHE_DIR``) is left as it is,
except by the CLI's explicit ``--compilation-cache DIR|off``, which replaces it.
"""

from __future__ import annotations

import os
import pathlib
import warnings

import jax

from paged_jax._caller import user_stacklevel

ENV_VAR = "PAGED_JAX_COMPILATION_CACHE"
_OFF = ("", "0", "off", "false", "no", "none")
_MIN_COMPILE_SECS = 0.2
"""Compilations shorter than this are not written (JAX's default is 1 s, which leaves out
the engine's smaller device calls on a fast machine)."""


def default_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/paged_jax/jax``, else ``~/.cache/paged_jax/jax``."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "paged_jax" / "jax"


def resolve(setting: bool | str | os.PathLike | None = True) -> pathlib.Path | None:
  """The directory ``setting`` selects, or None when the cache is off.

  ``True`` (or None): the environment variable if set, else ``default_dir()``. ``False``:
  off. A path: that directory.
  """
  if setting is False:
    return None
  if setting is True or setting is None:
    env = os.environ.get(ENV_VAR)
    if env is not None:
      return None if env.strip().lower() in _OFF else pathlib.Path(env).expanduser()
    return default_dir()
  if isinstance(setting, (str, os.PathLike)):
    if str(setting).strip().lower() in _OFF:
      return None
    return pathlib.Path(setting).expanduser()
  raise ValueError(f"compilation_cache={setting!r} must be True, False or a directory path")


def enable(setting: bool | str | os.PathLike | None = True, *, override: bool = False,
           name: str = "compilation_cache") -> pathlib.Path | None:
  """Point JAX's persistent compilation cache at the directory ``setting`` selects.

  Returns the directory in use (None when off). Leaves a directory the user already set
  through ``jax.config`` alone, and returns it, unless ``override`` (a setting the user
  gave explicitly, as the CLI's ``--compilation-cache``): then ``setting`` replaces it, and
  an "off" setting turns JAX's cache off. ``name``: what a directory that cannot be made
  is called in the ``ValueError`` (the environment variable when the path came from it).
  """
  directory = resolve(setting)
  current = jax.config.jax_compilation_cache_dir
  if current and not override:
    # A directory of the caller's own (False / "off" leave JAX's setting alone, as said).
    if directory is not None and setting is not True and setting is not None and (
        directory.resolve() != pathlib.Path(current).resolve()):
      shown = repr(os.fspath(setting)) if isinstance(setting, os.PathLike) else repr(setting)
      warnings.warn(f"{name}={shown} is not used: JAX's compilation cache is "
                    f"{current!r} in this process (set before, by another engine, the CLI or "
                    "JAX_COMPILATION_CACHE_DIR), and one process has one", UserWarning,
                    stacklevel=user_stacklevel())
    return pathlib.Path(current)
  if directory is None:
    if current:
      _point_jax_at(None)
    return None
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    if (setting is True or setting is None) and os.environ.get(ENV_VAR) is not None:
      name = ENV_VAR
    what = " (a file of that name is there; it must be a directory)" * directory.is_file()
    raise ValueError(f"{name}={str(directory)!r} cannot be created: {e}{what}") from e
  _point_jax_at(str(directory))
  if jax.config.jax_persistent_cache_min_compile_time_secs > _MIN_COMPILE_SECS:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_SECS)
  return directory


def _point_jax_at(directory: str | None) -> None:
  """Set JAX's cache directory (None: no cache). JAX opens its cache once, at the first
  compilation after a directory is set: a cache already open elsewhere is closed, so the
  next compilation opens the new one."""
  opened = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", directory)
  if opened and opened != directory:
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()
