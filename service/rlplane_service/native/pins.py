"""Pins: which blocks a read in flight may still be copying, so their extents are not reused.

Every ``locate`` pins the blocks it names (a random 96-bit pin id) until the reader
unpins them (a one-way message after its copy), renews them (a zero-copy read whose
views are alive), or the pin's lease passes (the reader died). A block that loses its
last sample while pinned is *deferred*: it is freed on its units (``release``) only
once its last pin goes. At most ``limit`` pins are held; past that the oldest lapse.
Not thread-safe: the controller holds its lock around every call.

Pins live in the controller's memory, so a restarted controller starts with none while
readers may still hold zero-copy views. Two things keep those views' memory: for
RESTART_HOLD_S after its rebuild (:meth:`Pins.hold_frees`; three of the readers' renewal
intervals) it frees no block, and a renewal names each pin's blocks, so the new
controller takes up a pin it does not know (:meth:`Pins.renew`) as long as its blocks
were not freed: still stored, deferred, or the hold not yet over. Block ids are never
reused, so pinning a block again that was not freed is always safe. A client may name
blocks it never read: that delays their frees, as any pin does, within the pin limit and
MAX_TAKEN_BLOCKS blocks in all (each pin's ids counted once), half the pin limit, and a pin
lease after the restart (later, a pin the controller does not know is one that went).

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
from rlplane.transports.native import RENEW_EVERY_S

log = logging.getLogger(__name__)

#: How long a read's pin holds its blocks without being renewed (longer than a read's
#: default deadline, so only a reader that died or hangs loses it).
PIN_LEASE_S = 120.0
#: Most pins held at once (a reader that never unpins cannot grow the controller without bound).
MAX_PINS = 1 << 16
#: Most blocks the pins taken up after a restart hold in all (a renewal names them: a
#: client cannot make the controller keep lists of any size).
MAX_TAKEN_BLOCKS = 1 << 20
#: How long a restarted controller frees no block: three of the readers' renewal intervals,
#: for every reader holding views to take its pins up again (at most the pin lease).
RESTART_HOLD_S = 3 * RENEW_EVERY_S


class Pins:
    """The pins of one controller (see the module docstring)."""

    def __init__(self, lease_s: float = PIN_LEASE_S, *, release: Callable[[int, tuple[int, ...]], None],
                 limit: int = MAX_PINS) -> None:
        self.lease_s, self.limit, self._release = lease_s, limit, release
        self._pins: dict[str, tuple[list[int], float]] = {}  # pin id -> (blocks, lease deadline)
        self._count: dict[int, int] = {}  # block -> pins holding it
        self._deferred: dict[int, tuple[int, ...]] = {}  # unreferenced pinned block -> units to free it on
        self._kept: set[str] = set()  # pins of zero-copy views (asked so, or renewed): never dropped for room
        self._hold_until = 0.0  # (monotonic) until then no block is freed: see hold_frees
        self._take_up_until = 0.0  # (monotonic) until then renewals take up unknown pins (after a restart only)
        self.taken_up = 0  # pins of an earlier controller taken up by a renewal
        self._taken: set[str] = set()  # the pins taken up
        self._taken_blocks = 0  # blocks they hold (at most MAX_TAKEN_BLOCKS)

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
        if pin in self._taken:
            self._taken.discard(pin)
            self._taken_blocks -= len(held[0])
        for b in held[0]:
            left = self._count.get(b, 0) - 1
            if left > 0:
                self._count[b] = left
                continue
            self._count.pop(b, None)
            if b in self._deferred:
                self._release(b, self._deferred.pop(b))

    def renew(self, pins: Sequence[Any], blocks: Sequence[Sequence[int] | None] | None = None,
              stored: Callable[[int], bool] = lambda b: False, units: tuple[int, ...] = ()) -> list[Any]:
        """Extend ``pins`` by a lease; the ones that are gone. ``blocks``: each pin's blocks
        (as its locate named them): a pin this controller does not know (it was restarted)
        is taken up, under its id, when none of its blocks was freed (each is ``stored``,
        deferred, or the restart hold is not over), within a pin lease of the restart
        (:meth:`hold_frees`), while taken-up pins are under half the limit. A block taken up
        that the controller does not store (cleared before the restart, still on its unit)
        is freed on every one of ``units`` once its last pin goes."""
        now = time.monotonic()
        gone, deadline = [], now + self.lease_s
        for k, pin in enumerate(pins):
            held = self._pins.get(pin) if isinstance(pin, str) else None
            if held is not None:
                self._pins[pin] = (held[0], deadline)
                self._kept.add(pin)
                continue
            named = sorted(set(blocks[k])) if blocks is not None and k < len(blocks) and blocks[k] else None
            if (isinstance(pin, str) and len(pin) <= 64 and named and now < self._take_up_until
                    and len(self._pins) < self.limit and len(self._taken) < self.limit // 2
                    and self._taken_blocks + len(named) <= MAX_TAKEN_BLOCKS
                    and (now < self._hold_until or all(stored(b) or b in self._deferred for b in named))):
                self._taken.add(pin)
                self._taken_blocks += len(named)
                self._pins[pin] = (named, deadline)
                self._kept.add(pin)
                for b in named:
                    self._count[b] = self._count.get(b, 0) + 1
                    if not stored(b) and b not in self._deferred:
                        self._deferred[b] = units
                self.taken_up += 1
            else:
                gone.append(pin)
        return gone

    def hold_frees(self, seconds: float) -> None:
        """Free no block for ``seconds`` from now (a restarted controller: the readers' views
        are not pinned here until they renew). Blocks that lose their last sample meanwhile
        wait, and go once the hold is over unless a pin taken up holds them. Renewals take up
        pins this controller does not know for a pin lease from now (or the hold, if longer):
        every reader renews within seconds, and outside that window a pin it does not know
        is one that went (a client naming made-up pins once filled the pin table, and every
        read then failed)."""
        now = time.monotonic()
        self._hold_until = now + seconds
        self._take_up_until = now + max(seconds, self.lease_s)

    @property
    def holding(self) -> bool:
        """Whether the restart hold is on (no block is freed, the orphan sweep waits)."""
        return time.monotonic() < self._hold_until

    def holds(self, b: int) -> bool:
        """Whether a pin holds block ``b``."""
        return bool(self._count.get(b))

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
        if self._hold_until and now >= self._hold_until:  # the restart hold is over: what waited for it goes
            self._hold_until = 0.0
            for b in [b for b in self._deferred if not self._count.get(b)]:
                self._release(b, self._deferred.pop(b))

    def defer(self, b: int, units: tuple[int, ...]) -> bool:
        """Block ``b`` lost its last sample: True (and it waits) when a pin holds it or the
        restart hold is on, else False (free it now)."""
        if not self._count.get(b) and time.monotonic() >= self._hold_until:
            return False
        self._deferred[b] = units
        return True

    def revive(self, b: int) -> tuple[int, ...] | None:
        """Block ``b`` is the index's again (a rebuild's replay dropped it, then found a row
        pointing at it): it is not freed when the hold ends; the units it was deferred on."""
        return self._deferred.pop(b, None)

    def waiting(self, b: int) -> bool:
        """Whether block ``b`` is deferred (gone from the index, still on its units)."""
        return b in self._deferred


__all__ = ["Pins", "PIN_LEASE_S", "MAX_PINS", "MAX_TAKEN_BLOCKS", "RESTART_HOLD_S"]
