"""Counts in reports read as English ("1 request", "2 requests"). No imports, so the CLI
uses it before JAX loads."""


def count(n: int, noun: str) -> str:
  """``"n noun"``, the noun plural unless n is 1."""
  return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
