"""Where a warning raised inside the package should point: the user's line."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
  """The ``stacklevel`` for a ``warnings.warn`` in the function calling this one that names
  the first frame outside this package (the user's ``LLM(...)``, through any of ours)."""
  level, frame = 1, sys._getframe(1)
  while frame is not None and _inside(frame.f_code.co_filename):
    level, frame = level + 1, frame.f_back
  return level


def _inside(filename: str) -> bool:
  """In this package's folder (not merely a sibling whose name starts alike:
  ``paged_jax_demo.py`` is the user's)."""
  return os.path.abspath(filename).startswith(_PACKAGE + os.sep)
