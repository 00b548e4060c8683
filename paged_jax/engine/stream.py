"""``generate_stream``'s result: a generator of ``StreamEvent``s that starts serving at its
first ``next()``, and that is left unstarted when the engine refuses it then.

A plain generator that raises at its first ``next()`` is finished: iterated again, it
yields nothing, and its requests are gone without a word. A stream made while the engine
was free but first iterated while another stream of the engine is open is refused (a
``RuntimeError``); this one can then be iterated again once the other is done.
"""

from __future__ import annotations

from collections import abc
from typing import Callable, Iterator


class Stream(abc.Generator):
  """The events of one serve, started lazily. ``check_idle()`` raises while the engine is
  busy; ``start()`` returns the serving generator (``Scheduler.serve``)."""

  def __init__(self, check_idle: Callable[[], None], start: Callable[[], Iterator]):
    self._check_idle, self._start = check_idle, start
    self._events, self._closed = None, False

  def send(self, value):
    if self._events is None:
      if self._closed:
        raise StopIteration
      if value is not None:
        raise TypeError("can't send non-None value to a just-started generator")
      self._check_idle()  # refused: still unstarted, its requests kept
      self._events = self._start()
    return self._events.send(value)

  def throw(self, typ, val=None, tb=None):
    if self._events is None:  # as an unstarted generator: raised here, and closed
      self._closed = True
      self._events = self._start()
    if val is None and tb is None:
      return self._events.throw(typ)
    return self._events.throw(typ, val, tb)

  def close(self) -> None:
    """Drop the unfinished requests (their blocks are released), as a generator's close."""
    self._closed = True
    if self._events is not None:
      self._events.close()
