"""Python's cyclic garbage collector paused for the length of one data-path operation.

A batch's header and tags are tens of thousands of small dicts and lists; allocating
them triggers the collector, whose full passes walk every object in the process (torch
alone brings hundreds of thousands), and cost more than the work itself: on text-scale
B=4096 a read took 160 ms with the collector running and 70 ms without. rlplane's
messages hold no reference cycles, so nothing is lost by deferring collection until the
operation ends. Nested and concurrent operations share one count; the collector comes
back on when the last one ends (and only if it was on before the first).

Example::

    with gc_paused():
        header = msgpack.unpackb(frame)
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector until the outermost of the running pauses ends."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


__all__ = ["gc_paused"]
