"""Reading the JSON files of a checkpoint (``config.json``, ``generation_config.json``)."""

from __future__ import annotations

import json

__all__ = ["read_json_object"]


def read_json_object(path: str, what: str = "config file") -> dict:
  """The JSON object in ``path``; a ``ValueError`` naming the file (as ``what``) when it
  is not valid JSON or not an object."""
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{what} {path!r} must hold a JSON object, not {type(data).__name__}")
  return data
