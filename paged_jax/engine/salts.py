"""Interned ``cache_salt`` ids: one int per salt string, the form the device compares.

The prefix cache shares blocks only between requests of one salt; on the device a salt is
an int32 id (``EngineState.salt_S``, the allocator's ``salt_N``). Two rules keep tenants
apart: a live id (one a slot or a cached block still holds) always means one string, and
an id is never handed to a second string while anything might still hold it. Ids count up
and are not reused until they run out, so a request of a salt dropped from the table (and
later seen again, under a new id) merely misses its old blocks, never another's.

The table stays bounded on a long-lived server whose salts are per user or per request
(before, it kept every string ever seen): when it reaches its limit it keeps only the
strings whose ids are live (``live_ids``: a read of the device state) or were handed out
by the ``ids`` call under way, and the limit becomes twice those plus ``SLACK``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

__all__ = ["SaltIds", "SLACK", "live_salt_ids"]

SLACK = 4096
"""New salts the table takes beyond twice its live ones before it is compacted."""
_LAST_ID = 2**31 - 1  # int32 on the device; 0 is "no salt"


def live_salt_ids(st) -> set[int]:
  """The salt ids an ``EngineState`` holds: its busy slots' and its cached blocks'."""
  if any(getattr(x, "is_deleted", lambda: False)()
         for x in (st.salt_S, st.status_S, st.alloc.salt_N, st.alloc.depth_N)):
    return set()  # a lost state (``state.lost``): the engine starts a fresh, empty one
  cached = np.asarray(st.alloc.salt_N)[np.asarray(st.alloc.depth_N) >= 0]
  busy = np.asarray(st.salt_S)[np.asarray(st.status_S) != 0]  # 0: FREE
  return {int(i) for i in np.concatenate([cached.ravel(), busy.ravel()])}


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

  def ids(self, cache_salt, num_prompts: int, *, intern: bool = True) -> list[int]:
    """One id per prompt (0: no salt) for ``generate``'s ``cache_salt`` (None, a str, or
    one str or None per prompt); ``intern=False`` (a check alone) adds nothing to the table
    and gives an unseen salt the id 0."""
    if cache_salt is None or isinstance(cache_salt, str):
      cache_salt = [cache_salt] * num_prompts
    elif (not isinstance(cache_salt, Sequence) or isinstance(cache_salt, bytes)
          or len(cache_salt) != num_prompts):
      raise ValueError(f"cache_salt={cache_salt!r} must be None, a str, or one str (or None) "
                       f"per prompt ({num_prompts})")
    for i, salt in enumerate(cache_salt):
      if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt[{i}]={salt!r} must be a str or None")
    ids = []
    for salt in cache_salt:
      known = 0 if salt is None else self._id_of.get(salt)
      if known is None and intern:
        known = self._new(salt, held=ids)
      ids.append(known or 0)
    return ids

  def _new(self, salt: str, held: list[int]) -> int:
    if len(self._id_of) >= self._limit:
      self._compact(held)
    while self._next in self._salt_of or self._next in held:  # only after a wrap
      self._advance(held)
    new = self._next
    self._advance(held + [new])
    self._id_of[salt], self._salt_of[new] = new, salt
    return new

  def _advance(self, held: list[int]) -> None:
    if self._next < _LAST_ID:
      self._next += 1
      return
    # Out of ids (2**31 - 1 salts): start over, skipping those that anything may still
    # hold (``_new`` skips the table's, which are then the live ones, and ``held``).
    self._compact(held)
    self._next = 1

  def _compact(self, held: list[int]) -> None:
    keep = set(self._live_ids()) | set(held)
    self._id_of = {s: i for s, i in self._id_of.items() if i in keep}
    self._salt_of = {i: s for s, i in self._id_of.items()}
    self._limit = 2 * len(self._id_of) + self._slack
