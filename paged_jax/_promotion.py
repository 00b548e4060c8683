"""The library traces its own code under JAX's default promotion rules.

A user's program may turn on ``jax_numpy_rank_promotion="raise"`` (common in large code
bases) or ``jax_numpy_dtype_promotion="strict"``; both are checked while a function is
traced. The allocator, the decoders, the step API and the engine broadcast ``[S]`` against
``[S, P]`` and mix weak Python scalars by design, so their entry points trace under the
defaults (``standard_promotion``) whatever the caller's setting; the caller's own code keeps
its mode. Shapes and dtypes of the library's arguments are still checked by name.
"""

from __future__ import annotations

import functools

import jax


def standard_promotion(fn):
  """``fn`` traced (or run eagerly) with rank promotion "allow" and dtype promotion
  "standard", the defaults."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
      return fn(*args, **kwargs)

  return wrapper
