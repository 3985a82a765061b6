"""Give a process's free heap memory back to the OS, now and then (glibc ``malloc_trim``).

A storage unit's transient buffers (the ZMQ frames of a write, the answer of a read, a
block copied out for re-replication) are freed to glibc's heap, which keeps the pages:
after a burst the unit's resident memory stays at its peak for good, and a long soak
creeps up by the size of the largest bursts. :class:`HeapTrim` calls ``malloc_trim(0)``
(which hands every arena's free pages back) at most every ``every_s`` seconds, and only
after data moved since the last call. Elsewhere than glibc it does nothing.

Example::

    trim = HeapTrim(every_s=2.0)
    trim.moved()      # a request freed buffers
    trim.tick()       # from a loop: trims when due
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], Any] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class HeapTrim:
    """Trims the heap at most every ``every_s`` s, after data moved (see the module docstring)."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s = every_s
        self._trim = _malloc_trim()
        self._dirty = False
        self._last = time.monotonic()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def moved(self) -> None:
        """Buffers were freed since the last trim (cheap: a flag)."""
        self._dirty = True

    def tick(self, now: float | None = None) -> bool:
        """Trim if due; returns whether it did."""
        if self._trim is None or not self._dirty:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last < self.every_s:
            return False
        self._dirty, self._last = False, now
        self._trim(0)
        self.trims += 1
        return True


__all__ = ["HeapTrim"]
