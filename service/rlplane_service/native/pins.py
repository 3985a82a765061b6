"""Pins: which blocks a read in flight may still be copying, so their extents are not reused.

Every ``locate`` pins the blocks it names (a random 96-bit pin id) until the reader
unpins them (a one-way message after its copy), renews them (a zero-copy read whose
views are alive), or the pin's lease passes (the reader died). A block that loses its
last sample while pinned is *deferred*: it is freed on its units (``release``) only
once its last pin goes. At most ``limit`` pins are held; past that the oldest lapse.
Not thread-safe: the controller holds its lock around every call.

Example::

    pins = Pins(lease_s=120, release=lambda block, units: ...)
    pin = pins.pin([7, 9])
    pins.defer(7, (0, 1))     # block 7 was cleared: freed when the pin goes
    pins.unpin(pin)           # -> release(7, (0, 1))
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Callable, Sequence

from rlplane import errors as E

log = logging.getLogger(__name__)

#: How long a read's pin holds its blocks without being renewed (longer than a read's
#: default deadline, so only a reader that died or hangs loses it).
PIN_LEASE_S = 120.0
#: Most pins held at once (a reader that never unpins cannot grow the controller without bound).
MAX_PINS = 1 << 16


class Pins:
    """The pins of one controller (see the module docstring)."""

    def __init__(self, lease_s: float = PIN_LEASE_S, *, release: Callable[[int, tuple[int, ...]], None],
                 limit: int = MAX_PINS) -> None:
        self.lease_s, self.limit, self._release = lease_s, limit, release
        self._pins: dict[str, tuple[list[int], float]] = {}  # pin id -> (blocks, lease deadline)
        self._count: dict[int, int] = {}  # block -> pins holding it
        self._deferred: dict[int, tuple[int, ...]] = {}  # unreferenced pinned block -> units to free it on
        self._kept: set[str] = set()  # pins of zero-copy views (asked so, or renewed): never dropped for room

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def deferred(self) -> int:
        """Blocks no sample points at any more, waiting for their pins to go."""
        return len(self._deferred)

    def pin(self, blocks: Sequence[int], *, keep: bool = False, mine: bool = False) -> str:
        """A new pin of ``blocks``. At the limit the oldest pins no view holds make room (a
        reader that never unpins); a pin of live views (``keep``, or renewed) is never taken
        for room: with only those left, UnavailableError. ``mine``: the controller's own
        (a snapshot's cut, a repair's copy), kept and never refused."""
        if mine:
            keep = True
        elif len(self._pins) >= self.limit:
            self.expire(time.monotonic(), oldest=len(self._pins) - self.limit + 1)
            if len(self._pins) >= self.limit:
                raise E.UnavailableError(f"the controller holds {len(self._pins)} pins of zero-copy reads whose views "
                                         "are alive (its limit): let some views go, or read with copy=True",
                                         component="controller")
        pin = secrets.token_hex(12)
        if keep:
            self._kept.add(pin)
        self._pins[pin] = (list(blocks), time.monotonic() + self.lease_s)
        for b in blocks:
            self._count[b] = self._count.get(b, 0) + 1
        return pin

    def unpin(self, pin: Any) -> None:
        held = self._pins.pop(pin, None) if isinstance(pin, str) else None
        if held is None:
            return
        self._kept.discard(pin)
        for b in held[0]:
            left = self._count.get(b, 0) - 1
            if left > 0:
                self._count[b] = left
                continue
            self._count.pop(b, None)
            if b in self._deferred:
                self._release(b, self._deferred.pop(b))

    def renew(self, pins: Sequence[Any]) -> list[Any]:
        """Extend ``pins`` by a lease; the ones that are gone."""
        gone, deadline = [], time.monotonic() + self.lease_s
        for pin in pins:
            held = self._pins.get(pin) if isinstance(pin, str) else None
            if held is None:
                gone.append(pin)
            else:
                self._pins[pin] = (held[0], deadline)
                self._kept.add(pin)
        return gone

    def expire(self, now: float, oldest: int = 0) -> None:
        """Drop pins whose lease passed (and, to make room, the ``oldest`` others)."""
        late = [pin for pin, (_, deadline) in self._pins.items() if deadline < now]
        if oldest:
            gone = set(late)
            spare = (p for p in self._pins if p not in gone and p not in self._kept)
            late += sorted(spare, key=lambda p: self._pins[p][1])[:oldest]
        for pin in late:
            log.warning("a read's pin lapsed without an unpin (the reader died or hangs); its blocks may be freed")
            self.unpin(pin)

    def defer(self, b: int, units: tuple[int, ...]) -> bool:
        """Block ``b`` lost its last sample: True (and it waits) when a pin holds it, else False (free it now)."""
        if not self._count.get(b):
            return False
        self._deferred[b] = units
        return True

    def waiting(self, b: int) -> bool:
        """Whether block ``b`` is deferred (gone from the index, still on its units)."""
        return b in self._deferred


__all__ = ["Pins", "PIN_LEASE_S", "MAX_PINS"]
