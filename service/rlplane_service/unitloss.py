"""Declaring a dead storage unit lost (the TransferQueue-based backends, ``simple`` and
``mooncake``).

TransferQueue keeps every sample's metadata in its controller even when the storage unit
that held its bytes died, so listings, counts and claims would go on offering samples
nobody can read. :class:`UnitLossWatch` (a thread in the Serve replica) asks Ray every
``every`` seconds whether a unit's actor died; for a dead one it finds the samples that
unit held (``simple``: TransferQueue routes a sample by its global index modulo the unit
count; ``mooncake``: the pool's replica descriptors name the segment) and makes the store
forget them: TransferQueue's controller drops their metadata (the dead unit is not
asked), the ledger drops them from claims and remembers which unit took them, so a read
raises ``MissingDataError`` "... lost with storage unit(s) X".

A unit that is only slow is never declared lost (Ray must report its actor dead). A
declared unit is looked at again every ``rescan_every`` seconds: a put that was under
way when it died may have left samples routed to it.

Example::

    watch = UnitLossWatch(store, transport).start()
    ...
    watch.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

WATCH_EVERY_S = 1.0
RESCAN_EVERY_S = 10.0


class UnitLossWatch:
    """See the module docstring. ``store`` offers ``dead_units()``, ``unit_infos`` (names
    in TransferQueue's routing order), ``held_on(transport, partition, unit)`` and
    ``forget(transport, partition, ids, unit)``; ``transport`` (the service's) offers
    ``partitions()``."""

    def __init__(self, store: Any, transport: Any, *, every: float = WATCH_EVERY_S,
                 rescan_every: float = RESCAN_EVERY_S) -> None:
        self.store, self.transport = store, transport
        self.units = list(store.unit_infos)
        self.every, self.rescan_every = every, rescan_every
        self.lost: dict[str, float] = {}  # unit -> when it was last swept
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlplane-unit-loss", daemon=True)

    def start(self) -> UnitLossWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 - keep watching; the next round retries
                log.warning("checking the storage units failed: %s", err)

    def check(self) -> list[str]:
        """One round: declare newly dead units, sweep declared ones when due. Returns the
        units swept."""
        now = time.monotonic()
        fresh = [u for u in self.store.dead_units() if u not in self.lost]
        due = fresh + [u for u, at in self.lost.items() if now - at >= self.rescan_every]
        for unit in due:
            self.sweep(unit)
            self.lost[unit] = time.monotonic()
        return due

    def sweep(self, unit: str) -> int:
        """Forget every sample ``unit`` held; how many there were."""
        index = self.units.index(unit)
        total = 0
        for partition in self.transport.partitions():
            ids = self.store.held_on(self.transport, partition, index)
            if ids:
                self.store.forget(self.transport, partition, ids, unit)
                total += len(ids)
        if unit not in self.lost:
            self.store.forget(self.transport, "", [], unit)  # the ledger learns of the unit even when it held nothing
            log.error("storage unit %s is lost (Ray reports its actor dead): %d samples lost with it", unit, total)
        elif total:
            log.error("storage unit %s (lost): %d more samples routed to it forgotten", unit, total)
        return total


__all__ = ["UnitLossWatch", "WATCH_EVERY_S"]
