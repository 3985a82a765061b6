"""Storage-unit health for the native controller: pings, suspicion, loss, re-replication
and the sweep of blocks nobody refers to.

The controller pings every unit each WATCH_EVERY_S. A unit that misses a ping, whose
connection drops, or that a client reports unreachable is *suspect*: reads prefer its
blocks' other copies and writers place around it, but it keeps its data, and once it
answers again it is a unit like the others. It is *lost* only when the host says its
process is dead (``is_dead``: the service asks Ray whether the actor died) or it stayed
suspect for ``grace_s`` (RLPLANE_UNIT_GRACE_S). A lost unit's blocks keep their other
copies; samples whose only copy it held leave the index and read as lost with it. Then
every block short of copies is copied from a live copy to a live unit that lacks it.
Every SWEEP_EVERY_S the units list their old blocks and those the index does not know
(a writer that died between writing and reserving, or wrote outside any put) are freed.

:class:`UnitHealth` is mixed into :class:`~rlplane_service.native.controller.ControllerCore`
and works on its index under its lock.

Example::

    core._watch()          # one round of pings (the controller's "watch" loop runs it)
    core.stats()["suspect_units"], core.stats()["lost_units"]
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from rlplane import errors as E
from rlplane.channel import ChannelPool
from rlplane.placement import spread
from rlplane.wire import int_array, ints
from rlplane_service.native.index import Partition, rows_in
from rlplane_service.native.pins import Pins
from rlplane_service.native.requests import LISTED
from rlplane_service.native.writes import LAPSED_FREE_S

log = logging.getLogger(__name__)

#: The controller pings every storage unit this often, each ping waiting CHECK_TIMEOUT_S.
WATCH_EVERY_S, CHECK_TIMEOUT_S = 1.0, 3.0
#: A unit suspect this long is declared lost (unless it answers again first): longer
#: than a live process stalls (a full collection of a big heap, a swap storm, a stop by
#: a debugger), short enough that claims do not wait on a dead host for long.
UNIT_GRACE_S = 60.0
#: How long a client's report that a unit is unreachable waits for the unit's answer.
REPORT_TIMEOUT_S = 1.0
#: How often the controller asks the units for blocks it does not know (orphans: their
#: writer died between writing and reserving, or wrote outside any put), and how much
#: older than a put's lease such a block must be before it is freed.
SWEEP_EVERY_S, ORPHAN_MARGIN_S = 30.0, 60.0
#: A block copy (re-replication) from one unit to another gives up after this long.
REPAIR_TIMEOUT_S = 60.0


class UnitHealth:
    """The unit-health half of the controller (see the module docstring)."""

    units: list[tuple[str, str]]
    replicas: int
    lease_s: float
    grace_s: float
    is_dead: Callable[[int], bool] | None
    pins: Pins
    orphans_freed: int
    _lock: threading.RLock
    _stop: threading.Event
    _pool: ChannelPool
    _control: list[str]
    _parts: dict[str, Partition]
    _block_units: dict[int, tuple[int, ...]]
    _block_refs: dict[int, int]
    _block_bytes: dict[int, list[int]]
    _block_ext: dict[int, Any]
    _lost_units: dict[int, str]
    _suspect: dict[int, tuple[float, str]]
    _unlisted: dict[int, set[int]]  # unit -> blocks a rebuild found recorded on it while it did not answer
    _unit_slabs: dict[int, dict[str, Any]]
    _lost_samples: int
    _frees: Any
    ledger: Any

    _forget: Callable[[str, Partition, np.ndarray], None]  # the controller's: drop samples from the index

    def _lose_unit(self, u: int, why: str) -> None:
        """Unit ``u`` is gone with its memory: blocks keep their other copies; samples with
        a row in a block that had no other copy are lost: they leave listings, counts and
        claims, and reading them says they were lost with this unit."""
        name = self.units[u][0]
        with self._lock:
            if u in self._lost_units:
                return
            self._lost_units[u] = why
            self._suspect.pop(u, None)
            self._unlisted.pop(u, None)
            lost = self._drop_copies(u, [b for b, units in self._block_units.items() if u in units], name)
        log.error("storage unit %s is lost (%s): %d samples lost with it, %d blocks keep a copy elsewhere",
                  name, why, lost, sum(1 for units in self._block_units.values() if len(units) < self.replicas))

    def _drop_copies(self, u: int, blocks: list[int], name: str) -> int:
        """Unit ``u`` holds no copy of ``blocks`` (any more): those with a copy elsewhere keep
        it; samples with a row in one that had no other are lost (with ``name``); returns
        how many. Under the lock."""
        gone = []
        for b in blocks:
            units = self._block_units.get(b, ())
            rest = tuple(x for x in units if x != u)
            self._block_ext.get(b, ({}, {}))[1].pop(u, None)
            if rest:
                self._block_units[b] = rest
            elif units:
                gone.append(b)
        lost = self._lose_blocks(gone, name)
        for p in self._parts:
            self.ledger.touch(p)
        return lost

    def _lose_blocks(self, gone: list[int], where: str) -> int:
        """No unit holds ``gone`` any more: the samples with a row in one are lost (reads
        say so, naming ``where``) and the blocks leave the index; returns how many samples
        were lost. Under the lock."""
        if not gone:
            return 0
        dead, lost = np.asarray(sorted(gone), np.int64), 0
        for p, part in list(self._parts.items()):
            slots = rows_in(part, dead)
            if slots.size:
                part.lost.update(dict.fromkeys(part.names[slots].tolist(), where))
                self._forget(p, part, slots)
                lost += int(slots.size)
        for b in gone:  # nothing to free on a unit that does not hold them
            self._block_units.pop(b, None)
            self._block_refs.pop(b, None)
            self._block_bytes.pop(b, None)
            self._block_ext.pop(b, None)
        self._lost_samples += lost
        return lost

    def _adopt(self, u: int) -> None:
        """Unit ``u`` did not answer a rebuild and answers now: the blocks the rebuild left
        waiting on it (``_unlisted``) take the extents it lists; those it does not hold are
        dropped from it, their samples lost where it held the only copy. A typed error when
        it stops answering again (it stays suspect, its blocks waiting)."""
        name = self.units[u][0]
        listed: dict[int, list[Any]] = {}
        after = 0
        for _ in range(1 << 20):  # a page of blocks a call (entries: none, they were replayed)
            reply = self._pool.get(self._control[u], name).call({"op": "inventory", "b": after, "s": LISTED},
                                                                timeout=CHECK_TIMEOUT_S)[0]
            for b, fields in reply.get("blocks", []):
                listed[int(b)] = fields
            if not isinstance(reply.get("more_b"), int):
                break
            after = int(reply["more_b"])
        with self._lock:
            waiting = self._unlisted.pop(u, set())
            missing, freed = [], 0
            for b in waiting:
                fields = listed.get(b)
                if b not in self._block_units:
                    freed += 1  # (its samples were cleared meanwhile)
                    continue
                if fields is None:
                    missing.append(b)
                    continue
                dtypes, where = self._block_ext.setdefault(b, ({}, {}))
                dtypes.update({str(f): str(d) for f, d, _ in fields})
                where[u] = {str(f): int(at) for f, _, at in fields}
            lost = self._drop_copies(u, missing, name) if missing else 0
        log.warning("storage unit %s, which did not answer the controller's rebuild, answers now: %d of its %d blocks "
                    "found, %d cleared meanwhile, %d samples lost with the rest", name,
                    len(waiting) - len(missing) - freed, len(waiting), freed, lost)

    def _watch(self) -> None:
        """One round of pings: a unit that answers is well; one that does not is suspect,
        and lost once ``is_dead`` says so or it stayed suspect for ``grace_s``."""
        for u in range(len(self.units)):
            if u in self._lost_units or self._stop.is_set():
                continue
            try:
                self._ping(u)
                if u in self._unlisted:
                    self._adopt(u)
                self._answers(u)
            except E.RlplaneError as err:
                self._suspected(u, str(err))
            if u in self._suspect:
                since, why = self._suspect[u]
                if self._dead(u):
                    self._lose_unit(u, f"its process is dead ({why})")
                elif time.monotonic() - since >= self.grace_s:
                    self._lose_unit(u, f"it did not answer for {self.grace_s:.0f} s (RLPLANE_UNIT_GRACE_S): {why}")

    def _dead(self, u: int) -> bool:
        if self.is_dead is None:
            return False
        try:
            return bool(self.is_dead(u))
        except Exception as err:  # noqa: BLE001 - a failing oracle says nothing; the grace period decides
            log.warning("could not tell whether storage unit %s is dead: %s", self.units[u][0], err)
            return False

    def _suspected(self, u: int, why: str) -> None:
        with self._lock:
            if u not in self._suspect and u not in self._lost_units:
                self._suspect[u] = (time.monotonic(), why)
                log.warning("storage unit %s is suspect (%s): reads prefer other copies, writes go elsewhere; it is "
                            "declared lost if its process is dead or after %.0f s", self.units[u][0], why, self.grace_s)

    def _answers(self, u: int) -> None:
        with self._lock:
            if self._suspect.pop(u, None) is not None:
                log.warning("storage unit %s answers again; it keeps its data", self.units[u][0])

    def _ping(self, u: int, timeout: float = CHECK_TIMEOUT_S) -> None:
        """Unit ``u`` answers within ``timeout``, or a typed error."""
        name, _ = self.units[u]
        reply = self._pool.get(self._control[u], name).call({"op": "ping"}, timeout=timeout)[0]
        if isinstance(reply.get("slab"), dict):
            self._unit_slabs[u] = {**reply["slab"], **({"journal": reply["journal"]}
                                                       if isinstance(reply.get("journal"), dict) else {})}

    def _repair_round(self) -> None:
        """Re-replication: once a unit is lost, copy every committed block that has fewer
        than ``replicas`` copies from a live copy to a live unit that lacks it (the least
        loaded first), one block at a time, until each has its copies or no unit is spare."""
        if not self._lost_units:
            return
        for b, source, target in self._repairs():
            if self._stop.is_set() or not self._repair(b, source, target):
                break  # a unit failed mid-way: plan again next round, from what is true then

    def _sweep(self) -> None:
        """Free the blocks units hold that the index does not know, or does not place on that
        unit (a copy written under a known id by a client: never a replica), and that are older
        than any put still in flight could be (twice the put lease, plus a margin)."""
        age = max(0.0, 2 * self.lease_s + ORPHAN_MARGIN_S)
        with self._lock:
            if self.pins.holding:  # a restarted controller: readers' views may pin blocks it does not know yet
                return
        for u, (name, _) in enumerate(self.units):
            if u in self._lost_units or u in self._suspect or self._stop.is_set():
                continue
            try:
                old = int_array(self._pool.get(self._control[u], name).call({"op": "old", "age": age},
                                                                             timeout=CHECK_TIMEOUT_S)[0].get("b", b""))
            except E.RlplaneError as err:
                log.warning("could not list old blocks on %s: %s", name, err)
                continue
            with self._lock:
                orphans = [b for b in old.tolist() if u not in self._block_units.get(b, ()) and not self.pins.waiting(b)
                           and not self.pins.holds(b)]  # (a pin taken up after a restart: its views' memory)
            if orphans:
                log.warning("freeing %d blocks on %s that no sample or put refers to (a writer died mid-put?)",
                            len(orphans), name)
                self._frees.put((u, orphans, LAPSED_FREE_S))  # (a writer of them may only be stalled)
                self.orphans_freed += len(orphans)

    def _repairs(self) -> list[tuple[int, int, int]]:
        """(block, a unit holding it, the unit to copy it to) for every block short of copies."""
        with self._lock:
            live = [u for u in range(len(self.units)) if u not in self._lost_units and u not in self._suspect]
            load = dict.fromkeys(live, 0)
            short = []
            for b, units in self._block_units.items():
                size = self._block_bytes.get(b, [0, 0])[0]
                for u in units:
                    if u in load:
                        load[u] += size
                if len(units) < self.replicas and self._block_refs.get(b, 0) > 0:  # committed, still read
                    short.append((b, units, size))
            plan = []
            for b, units, size in short:
                spare = sorted((u for u in live if u not in units), key=load.__getitem__)
                if spare and units:  # the least loaded, on a node that holds no copy if there is one
                    target = spread(spare, [self.units[u][1] for u in spare], 1, [self.units[u][1] for u in units])[0]
                    load[target] += size
                    plan.append((b, units[0], target))
            return plan

    def _repair(self, b: int, source: int, target: int) -> bool:
        """Copy block ``b`` from ``source`` to ``target``; False when either unit failed."""
        (src, _), (dst, _) = self.units[source], self.units[target]
        src_at, dst_at = self._control[source], self._control[target]
        with self._lock:
            if b not in self._block_units:
                return True  # freed meanwhile
            pin = self.pins.pin([b], mine=True)  # the source's extents stay put while they are copied
        where = None
        try:
            _, columns, _ = self._pool.get(src_at, src).call({"op": "block", "b": b}, timeout=REPAIR_TIMEOUT_S)
            target_ch = self._pool.get(dst_at, dst)
            try:
                reply = target_ch.call({"op": "write", "b": b}, columns, timeout=REPAIR_TIMEOUT_S)[0]
            except E.WireFormatError as err:
                if "already stored" not in str(err):
                    raise
                # An earlier copy whose reply was lost, or bytes a client wrote under the id: not
                # trusted either way. That copy goes, and the source's is written in its place.
                target_ch.call({"op": "free", "b": ints([b])}, timeout=REPAIR_TIMEOUT_S)
                reply = target_ch.call({"op": "write", "b": b}, columns, timeout=REPAIR_TIMEOUT_S)[0]
            where = reply.get("x")
        except E.MissingDataError:
            return True  # freed while this ran
        except E.RlplaneError as err:
            log.warning("could not copy block %d from %s to %s: %s", b, src, dst, err)
            return False
        finally:
            with self._lock:
                self.pins.unpin(pin)
        with self._lock:
            units = self._block_units.get(b)
            kept = units is not None and target not in units and target not in self._lost_units
            if kept:
                self._block_units[b] = units + (target,)
                if isinstance(where, dict) and b in self._block_ext:
                    self._block_ext[b][1][target] = {str(k): int(v) for k, v in where.items()}
        if not kept:  # cleared meanwhile: the copy is garbage
            self._frees.put((target, [b], 0.0))
        return True


__all__ = ["UnitHealth", "WATCH_EVERY_S", "CHECK_TIMEOUT_S", "UNIT_GRACE_S", "REPORT_TIMEOUT_S", "SWEEP_EVERY_S",
           "ORPHAN_MARGIN_S", "REPAIR_TIMEOUT_S"]
