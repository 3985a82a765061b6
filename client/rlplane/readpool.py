"""ReadPool: the memory reads copy into, reused once the caller lets go of it.

A read copies its rows into memory the caller owns (the native transport's copies out of
a slab, and the padded tensors the codec builds from token rows). Into fresh memory that copy costs
a page fault per page (168 MB of vlm-step pixels: ~370 ms fresh, ~9 ms into pages
touched before, on a 2-core VM), so the copy would cost 40x the bytes. The pool hands
out buffers backed by anonymous maps it keeps (asking for huge pages, which fault in
~2.5x faster: :func:`fresh_map`): when every tensor made from a buffer is
gone (the caller dropped the batch), the buffer comes back to the pool, already faulted
in, and the next read of a similar size reuses it. The caller never sees memory another
read writes: a buffer is reused only once nothing refers to it any more.

At most ``max_bytes`` of idle buffers are kept; a buffer is reused for a request of at
least half its size. Every native client of a process shares one pool
(:meth:`ReadPool.shared`), so a process with many clients keeps one set of idle buffers.

Example::

    pool = ReadPool()
    buf = pool.take(1 << 20)        # a writable numpy uint8 array of 1 MiB
    del buf                         # ... and the tensors made from it: it is idle again
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref

import numpy as np

_ROUND = 1 << 21  # sizes are rounded up to 2 MiB, so similar requests share buffers


class ReadPool:
    """Reusable read buffers (see the module docstring). Thread-safe."""

    def __init__(self, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes  # smaller requests get plain numpy memory (malloc reuses those itself)
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        # Buffers given back by finalizers, which may run in any thread at any time (even
        # inside take()): a deque append is all they do; take() files them under the lock.
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self.reused = 0
        self.fresh = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``; back in the pool once nothing refers to it."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            self._file_returned()
            fit = [m for m in self._idle if nbytes <= len(m) <= 2 * nbytes + _ROUND]
            mm = min(fit, key=len) if fit else None
            if mm is not None:
                self._idle.remove(mm)
                self.reused += 1
            else:
                self.fresh += 1
        if mm is None:
            mm = fresh_map(-(-nbytes // _ROUND) * _ROUND)
        buf = np.frombuffer(mm, np.uint8, count=nbytes)
        weakref.finalize(buf, self._give_back, mm)
        return buf

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return sum(len(m) for m in self._idle)

    def _give_back(self, mm: mmap.mmap) -> None:
        self._returned.append(mm)

    def _file_returned(self) -> None:
        """Move given-back buffers to the idle list, keeping at most ``max_bytes`` (under the lock)."""
        if not self._returned:
            return
        while self._returned:
            self._idle.append(self._returned.popleft())
        self._idle.sort(key=len, reverse=True)
        total = 0
        keep = []
        for m in self._idle:  # the biggest first: they are the costly ones to fault in again
            if total + len(m) <= self.max_bytes:
                keep.append(m)
                total += len(m)
        self._idle = keep

    def clear(self) -> None:
        with self._lock:
            self._returned.clear()
            self._idle = []

    @classmethod
    def shared(cls) -> ReadPool:
        """The process's pool (made on first use)."""
        global _SHARED
        with _SHARED_LOCK:
            if _SHARED is None:
                _SHARED = cls()
            return _SHARED


def fresh_map(nbytes: int) -> mmap.mmap:
    """``nbytes`` of new private anonymous memory that asks for transparent huge pages
    (``MADV_HUGEPAGE``; hosts whose THP setting is ``madvise`` give them only when asked).
    Its first touch then faults 2 MiB at a time: 100 MB copied into fresh memory took
    35-41 ms here, against 96-100 ms in a shared anonymous map (Python's ``mmap(-1, n)``)
    and 78 ms in a private one without the advice. A host without THP, or a kernel without
    the advice, gives small pages as before. (Linux >= 6.7 starts such maps on a 2 MiB
    boundary; older kernels leave the first and last few pages small.)

    Example: ``buf = np.frombuffer(fresh_map(8 << 20), np.uint8)``.
    """
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # (a kernel built without THP)
            pass
    return mm


_SHARED: ReadPool | None = None
_SHARED_LOCK = threading.Lock()


__all__ = ["ReadPool", "fresh_map"]
