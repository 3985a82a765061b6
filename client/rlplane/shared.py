"""Refcounted: objects shared by key within a process, closed with their last holder.

The channel pools and HTTP clients that every client of a process shares
(:mod:`rlplane.channel`, :mod:`rlplane.http_api`) are held and let go through one.

Example::

    pools = Refcounted(make=lambda key: open_pool(key), closed=lambda p: p.closed, close=lambda key, p: p.close())
    pool = pools.hold(("tcp://...",))
    pools.let_go(("tcp://...",), pool)   # closed: it had no other holder
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class Refcounted(Generic[T]):
    """``hold(key)`` the object for ``key`` (made anew when there is none, or it was
    closed); ``let_go(key, obj, *args)`` calls ``close(key, obj, *args)`` once its last
    holder has let go."""

    def __init__(self, make: Callable[[Any], T], closed: Callable[[T], bool], close: Callable[..., None]) -> None:
        self._make, self._closed, self._close = make, closed, close
        self._lock = threading.Lock()
        self._held: dict[Hashable, list[Any]] = {}  # key -> [object, holders]

    def hold(self, key: Hashable) -> T:
        with self._lock:
            entry = self._held.get(key)
            if entry is None or self._closed(entry[0]):
                entry = self._held[key] = [self._make(key), 0]
            entry[1] += 1
            return entry[0]

    def let_go(self, key: Hashable, obj: T, *args: Any) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is None or entry[0] is not obj:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._held[key]
        self._close(key, obj, *args)


__all__ = ["Refcounted"]
