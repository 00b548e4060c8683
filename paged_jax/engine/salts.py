"""Interned ``cache_salt`` ids: one int per salt string, the form the device compares.

The prefix cache shares blocks only between requests of one salt; on the device a salt is
an int32 id (``EngineState.salt_S``, the allocator's ``salt_N``). A request keeps its salt
as a string until it is admitted into a slot, and is given the id then (``intern``), so an
id is held only by the device state (a slot, a cached block) or by the admission under way.
Two rules keep tenants apart: an id so held always means one string, and an id is never
given to a second string while held. Ids count up and are reused only once they run out.

The table stays bounded on a long-lived server whose salts are per user or per request
(before, it kept every string ever seen): when it reaches its limit it keeps only the
strings whose ids are held (``live_ids``: a read of the device state) and the limit
becomes twice those plus ``SLACK``. A salt dropped and later seen again gets a new id: it
misses its old blocks (gone or about to be), never finds another's.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Sequence

import jax
import numpy as np

from paged_jax.engine.state import FREE, lost

__all__ = ["SaltIds", "SLACK", "engine_live_salts", "live_salt_ids"]

SLACK = 4096
"""New salts the table takes beyond twice its held ones before it is compacted."""
_LAST_ID = 2**31 - 1  # int32 on the device; 0 is "no salt"


def live_salt_ids(st, fetch=jax.device_get) -> set[int]:
  """The salt ids an ``EngineState`` holds: its busy slots' and its cached blocks'
  (``fetch``: how to bring an array to the host; a mesh's plan has its own)."""
  if lost(st):  # given to a device call that never returned: a fresh, empty one follows
    return set()
  salt_N, depth_N, salt_S, status_S = (np.asarray(fetch(x)) for x in (
      st.alloc.salt_N, st.alloc.depth_N, st.salt_S, st.status_S))
  busy = salt_S[status_S != FREE]
  return {int(i) for i in np.concatenate([salt_N[depth_N >= 0].ravel(), busy.ravel()])}


def engine_live_salts(llm) -> Callable[[], set[int]]:
  """``live_salt_ids`` of an engine's current state, read when called; holds the engine
  weakly (a strong reference from its own scheduler kept a deleted engine, its pool and
  parameters alive until Python's cycle collector ran)."""
  ref = weakref.ref(llm)

  def live() -> set[int]:
    engine = ref()
    if engine is None:
      return set()
    plan = engine._plan
    return live_salt_ids(engine._state, jax.device_get if plan is None else plan.fetch)

  return live


class SaltIds:
  """``cache_salt`` strings to device ids (module docstring). ``live_ids()``: the ids the
  engine's device state holds now."""

  def __init__(self, live_ids: Callable[[], Iterable[int]], *, slack: int = SLACK):
    self._live_ids, self._slack = live_ids, slack
    self._id_of: dict[str, int] = {}
    self._salt_of: dict[int, str] = {}
    self._next, self._limit = 1, slack

  def __len__(self) -> int:
    return len(self._id_of)

  @staticmethod
  def check(cache_salt, num_prompts: int) -> list[str | None]:
    """One salt (or None) per prompt from ``generate``'s ``cache_salt``: None, a str, or
    one str or None per prompt; anything else is a ``ValueError``."""
    if cache_salt is None or isinstance(cache_salt, str):
      return [cache_salt] * num_prompts
    if (not isinstance(cache_salt, Sequence) or isinstance(cache_salt, bytes)
        or len(cache_salt) != num_prompts):
      raise ValueError(f"cache_salt={cache_salt!r} must be None, a str, or one str (or None) "
                       f"per prompt ({num_prompts})")
    for i, salt in enumerate(cache_salt):
      if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt[{i}]={salt!r} must be a str or None")
    return list(cache_salt)

  def intern(self, salt: str | None, held: set[int]) -> int:
    """The id of ``salt`` (0 for None) for a slot being admitted; ``held``: the ids this
    admission has given out so far, which it extends (they are not on the device yet)."""
    if salt is None:
      return 0
    known = self._id_of.get(salt)
    if known is None:
      if len(self._id_of) >= self._limit:
        self._compact(held)
      while self._next in self._salt_of or self._next in held:  # only after a wrap
        self._advance(held)
      known = self._next
      self._id_of[salt], self._salt_of[known] = known, salt
      held.add(known)  # before a wrap's compaction in ``_advance``, which keeps it then
      self._advance(held)
    else:
      held.add(known)
    return known

  def _advance(self, held: set[int]) -> None:
    if self._next < _LAST_ID:
      self._next += 1
      return
    # Out of ids (2**31 - 1 salts): start over, skipping the held ones (``intern`` skips
    # the table's, which then holds every live id, and ``held``).
    self._compact(held)
    self._next = 1

  def _compact(self, held: set[int]) -> None:
    keep = set(self._live_ids()) | held
    self._id_of = {s: i for s, i in self._id_of.items() if i in keep}
    self._salt_of = {i: s for s, i in self._id_of.items()}
    self._limit = 2 * len(self._id_of) + self._slack
