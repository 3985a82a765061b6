"""Allocator: extents of one storage unit's slab, handed out and taken back.

Best fit over a free list kept sorted by offset (``sortedcontainers``), neighbours
merged on free, and a second index of the free fragments by (length, start), so the best
fit is one bisection: a call costs O(log fragments), however fragmented the slab gets.
Extents are aligned to ``ALIGN`` bytes (a cache line, and a whole
element of every dtype). Why best fit over a buddy allocator: a unit's extents are a
put's per-field values, whose sizes vary over six orders of magnitude (a 520-byte
``sample_mask`` next to 168 MB of pixels); a buddy system rounds every extent up to a
power of two (up to 2x waste on the pixels), best fit wastes at most ``ALIGN - 1``
bytes an extent, and the free list stays short because neighbours merge. A put takes one
extent per block and copy (its staged fields one each), never one per sample.

Example::

    a = Allocator(1 << 20)
    x = a.alloc(1000)          # an offset into the slab
    a.free(x)
    a.stats()["free_bytes"]    # 1048576
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList

#: Every extent starts at a multiple of this many bytes.
ALIGN = 64


class AllocatorError(Exception):
    """A free of an offset that is not an allocated extent (a bug in the caller)."""


class Allocator:
    """Best-fit extents over ``size`` bytes (see the module docstring). Not thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self._free = SortedDict({0: self.size} if self.size else {})  # start -> length
        self._by_size = SortedList([(self.size, 0)] if self.size else [])  # (length, start) of every free fragment
        self._used: dict[int, int] = {}  # start -> length (rounded up to ALIGN)
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new extent of at least ``nbytes`` (0 gets ALIGN), or None when
        no free fragment is big enough."""
        need = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        k = self._by_size.bisect_left((need, -1))  # the smallest fragment that fits (lowest start among equals)
        if k == len(self._by_size):
            return None
        best_len, best = self._by_size.pop(k)
        del self._free[best]
        if best_len > need:
            self._add_free(best + need, best_len - need)
        self._used[best] = need
        self.used_bytes += need
        return best

    def free(self, start: int) -> None:
        """Give extent ``start`` back; it merges with free neighbours."""
        length = self._used.pop(start, None)
        if length is None:
            raise AllocatorError(f"offset {start} is not an allocated extent")
        self.used_bytes -= length
        end = start + length
        after = self._free.get(end)
        if after is not None:
            self._drop_free(end, after)
            length += after
        k = self._free.bisect_left(start) - 1
        if k >= 0:
            prev, prev_len = self._free.peekitem(k)
            if prev + prev_len == start:
                self._drop_free(prev, prev_len)
                start, length = prev, prev_len + length
        self._add_free(start, length)

    def _add_free(self, start: int, length: int) -> None:
        self._free[start] = length
        self._by_size.add((length, start))

    def _drop_free(self, start: int, length: int) -> None:
        del self._free[start]
        self._by_size.remove((length, start))

    def extent(self, start: int) -> int | None:
        """The length of allocated extent ``start`` (None if it is not one)."""
        return self._used.get(start)

    @property
    def free_bytes(self) -> int:
        return self.size - self.used_bytes

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def stats(self) -> dict[str, float | int]:
        """``slab_bytes``, ``used_bytes``, ``free_bytes``, ``largest_free``, ``fragments``
        and ``fragmentation`` (1 - largest free fragment / free bytes: 0 = one hole)."""
        free = self.free_bytes
        largest = self.largest_free()
        return {"slab_bytes": self.size, "used_bytes": self.used_bytes, "free_bytes": free, "largest_free": largest,
                "fragments": len(self._free), "extents": len(self._used),
                "fragmentation": round(1.0 - largest / free, 4) if free else 0.0}

    def check(self) -> None:
        """AllocatorError unless free and used extents tile the slab exactly (tests)."""
        spans = sorted([*self._free.items(), *self._used.items()])
        at = 0
        for start, length in spans:
            if start != at or length <= 0:
                raise AllocatorError(f"extent at {start} (length {length}) does not follow on from {at}")
            at = start + length
        if at != self.size:
            raise AllocatorError(f"extents cover {at} of {self.size} bytes")
        if sum(self._used.values()) != self.used_bytes:
            raise AllocatorError("used_bytes disagrees with the extents")
        if list(self._by_size) != sorted((n, s) for s, n in self._free.items()):
            raise AllocatorError("the by-size index disagrees with the free list")


__all__ = ["Allocator", "AllocatorError", "ALIGN"]
