"""The controller of the native engine: the index, clears, listings and stats, and the
loops that free blocks and reap lapsed reservations. It is one object made of concerns:

- :mod:`~rlplane_service.native.writes`: reserve / commit / abort / discard (a put is
  two-phase; nothing of a failed put is visible);
- :mod:`~rlplane_service.native.reads`: locate (pinned) / unpin / renew;
- :mod:`~rlplane_service.native.health`: unit health, loss, re-replication, the orphan sweep;
- :mod:`~rlplane_service.native.stream`: claims over the same index;
- :mod:`~rlplane_service.native.cut`: a snapshot's consistent cut, a restore's consumption;
- :mod:`~rlplane_service.native.index` holds, per partition, arrays over slots;
  :mod:`~rlplane_service.native.requests` checks request values before use; reads'
  pins live in :mod:`~rlplane_service.native.pins`.

Blocks whose rows are all cleared are freed on their units; rows cleared from a block
that still holds live rows keep their memory until the rest goes (``stats`` reports
those bytes as ``retained_bytes``). A put may place each block on ``replicas`` distinct
units (RLPLANE_REPLICAS).

Every value a request carries is checked before use; handles (reservations, pins,
leases) are random; with tenants (``scopes``) every partition a request names is checked
against its user's prefixes. No request and no failure of a background loop stops the
controller: ``health()`` names a loop that died anyway.

Example::

    core = ControllerCore(units=[("unit-0", "tcp://127.0.0.1:5001")], secret=None)
    Server(core).start()
"""

from __future__ import annotations

import logging
import math
import os
import queue
import secrets
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlplane import errors as E
from rlplane.channel import ChannelPool
from rlplane_service.ledger import Ledger
from rlplane.wire import ints
from rlplane_service.native.health import (CHECK_TIMEOUT_S, REPORT_TIMEOUT_S, SWEEP_EVERY_S, UNIT_GRACE_S,
                                           WATCH_EVERY_S, UnitHealth)
from rlplane_service.native.cut import CutOps
from rlplane_service.native.held import inherit
from rlplane_service.native.index import COMMITTED, FREE, FieldIndex, Partition, Reservation, per_block, rows_in
from rlplane_service.native.pins import PIN_LEASE_S, Pins
from rlplane_service.native.requests import (partition_of,
                                             sample_ids)
from rlplane_service.native.reads import ReadOps
from rlplane_service.native.recovery import COMPACT_EVERY_S, RecoveryOps
from rlplane_service.native.stream import StreamOps
from rlplane_service.native.writes import WriteOps
from rlplane_service.tenants import Access

log = logging.getLogger(__name__)

#: Most blocks the free thread gathers from its queue into one round of messages (one per unit).
FREE_BATCH = 1 << 16


class ControllerCore(WriteOps, ReadOps, UnitHealth, StreamOps, RecoveryOps, CutOps):
    """The index and its operations (called by :class:`~rlplane_service.native.server.Server`);
    streaming (claim/ack/nack/consumption) comes from :class:`StreamOps` over the same index;
    the commit log on the units and the rebuild from it from :class:`RecoveryOps`."""

    def __init__(self, units: Sequence[tuple[str, str]], *, secret: bytes | None = None, capacity: int | None = None,
                 lease_s: float = 60.0, replicas: int = 1, claim_lease_s: float = 300.0,
                 pin_lease_s: float = PIN_LEASE_S, control: Sequence[str] | None = None,
                 control_secret: bytes | None = None, grace_s: float = UNIT_GRACE_S,
                 is_dead: Callable[[int], bool] | None = None,
                 scopes: Mapping[str, tuple[Sequence[str], bool]] | None = None, start: bool = True,
                 journal: bool = False) -> None:
        """``units``: (name, data endpoint) of each storage unit; ``control``: their control
        endpoints (served with ``control_secret``), where the controller sends what only it
        may (free, block copies); without them it uses the data endpoints. ``is_dead(u)``:
        True once unit ``u``'s process is known dead (see the module docstring). ``scopes``:
        tenants' engine users -> (partition-name prefixes, may write); every other user
        has full access. ``start=False``: the background loops wait for :meth:`start` (a
        controller that rebuilds its index first must not sweep blocks it does not know yet).
        ``journal``: the units keep a journal (RLPLANE_JOURNAL_DIR): acks are journalled and
        ``durable`` puts wait for the disk."""
        self.units = list(units)
        self.journaling = journal
        self.started = time.time()
        self.epoch = secrets.token_hex(4)  # this process's: reservations of an earlier one are told apart
        self.scopes = {user: Access(user, tuple(prefixes), bool(write)) for user, (prefixes, write) in (scopes or {}).items()}
        self.grace_s = grace_s
        self.is_dead = is_dead
        self._control = list(control) if control is not None else [e for _, e in self.units]
        self.seal_key = control_secret if control is not None else None  # the units seal extents with it
        self.capacity = capacity
        self.lease_s = lease_s
        self.replicas = max(1, min(replicas, len(self.units)))
        self._parts: dict[str, Partition] = {}
        self._res: dict[str, Reservation] = {}
        self._block_units: dict[int, tuple[int, ...]] = {}
        # Where each block's extents are: the fields' dtypes, and per unit holding a copy
        # the slab offset of each field's extent (from the units' alloc/write answers).
        self._block_ext: dict[int, tuple[dict[str, str], dict[int, dict[str, int]]]] = {}
        self.pin_lease_s = pin_lease_s
        self.pins = Pins(pin_lease_s, release=self._queue_frees)  # reads in flight: their blocks stay
        self._unit_slabs: dict[int, dict[str, Any]] = {}  # unit -> its slab figures, from the last ping
        self._block_refs: dict[int, int] = {}  # (slot, field) pairs pointing at the block
        self._block_bytes: dict[int, list[int]] = {}  # [bytes written, bytes still referenced]
        self._shared_bytes = 0  # bytes of rows samples hold without storing them (a shared row's: rlplane.dedup)
        self._cursor = 0
        self._lock = threading.RLock()
        self.ledger = Ledger(self._parts.get, lease_s=claim_lease_s)
        self._pool = ChannelPool(control_secret if control is not None else secret)
        self._frees: queue.Queue[tuple[int, list[int], float] | None] = queue.Queue()  # (unit, blocks, after s)
        # block -> {unit: seconds its extents stay out of use once freed}: a one-sided write of it
        # failed (LATE_FREE_S), or its reservation lapsed (LAPSED_FREE_S)
        self._late: dict[int, dict[int, float]] = {}
        self._stop = threading.Event()
        self._lost_units: dict[int, str] = {}  # unit index -> why it was declared lost
        self._suspect: dict[int, tuple[float, str]] = {}  # unit index -> (suspect since, why)
        self._unlisted: dict[int, set[int]] = {}  # unit -> blocks a rebuild left waiting on it (it did not answer)
        self._reported: dict[int, float] = {}  # unit index -> when a client's report of it was last checked
        self._lost_samples = 0
        self.loop_errors: dict[str, int] = {}  # background loop -> iterations that failed (and were survived)
        self.orphans_freed = 0  # blocks freed on units because nothing referred to them
        self.repacked = 0  # times a partition renumbered its slots (_repack)
        self._init_log()
        self._init_cuts()
        self._threads = [threading.Thread(target=self._run, args=(name, every, body), name=f"rlplane-{name}", daemon=True)
                         for name, every, body in (("reaper", 0.5, self._reap), ("free", 0.0, self._free_some),
                                                   ("watch", WATCH_EVERY_S, self._watch),
                                                   ("repair", WATCH_EVERY_S, self._repair_round),
                                                   ("sweep", SWEEP_EVERY_S, self._sweep),
                                                   ("compact", COMPACT_EVERY_S, self._compact),
                                                   ("repack", COMPACT_EVERY_S, self._repack_all))]
        if start:
            self.start()

    def start(self) -> None:
        """Start the background loops (once)."""
        for t in self._threads:
            if not t.is_alive() and t.ident is None:
                t.start()

    def _run(self, name: str, every: float, body: Callable[[], None]) -> None:
        """A background loop: ``body`` every ``every`` seconds until stop; an error in one
        round is logged and counted, and the loop goes on."""
        while not self._stop.wait(every):
            try:
                body()
            except Exception:  # noqa: BLE001 - a loop that dies would leave the store without it
                self.loop_errors[name] = self.loop_errors.get(name, 0) + 1
                log.exception("controller loop %s failed a round; it goes on", name)

    def health(self) -> dict[str, Any]:
        """Each background loop: running or not (a dead one makes /readyz name it), and
        how many rounds failed."""
        return {"threads": {t.name: t.is_alive() for t in self._threads}, "loop_errors": dict(self.loop_errors)}

    # -- puts ----------------------------------------------------------------------------
    def op_hello(self, header: dict, columns: dict, extra: list) -> Any:
        """The topology a client needs to place its blocks: the storage units, how many
        copies of a block to write, the reservation lease, and whether a put may find rows
        earlier puts stored (not while the store journals: rlplane_service.native.held)."""
        return {"units": [list(u) for u in self.units], "lease_s": self.lease_s, "replicas": self.replicas,
                "down": sorted(self._lost_units), "suspect": sorted(self._suspect),
                "held": not self.journaling}, {}, []

    def op_unit_down(self, header: dict, columns: dict, extra: list) -> Any:
        """A client could not reach unit ``u``: ping it now (REPORT_TIMEOUT_S); if it does
        not answer it is suspect (never lost on a client's word, see the module docstring).
        Answers the lost units (``down``) and the suspect ones. A unit already suspect, or
        pinged for a report less than REPORT_TIMEOUT_S ago, is not pinged again (the watch
        loop follows it): reports of a hung unit from many clients at once cost the
        serving loop one ping a second, not one each."""
        u = header.get("u")
        if not isinstance(u, int) or isinstance(u, bool) or not 0 <= u < len(self.units):
            raise E.WireFormatError(f"unit_down needs a unit index 'u' below {len(self.units)}")
        now = time.monotonic()
        recent = now - self._reported.get(u, -math.inf) < REPORT_TIMEOUT_S
        if u not in self._lost_units and u not in self._suspect and not recent:
            self._reported[u] = now
            try:
                self._ping(u, timeout=REPORT_TIMEOUT_S)
                self._answers(u)
            except E.RlplaneError as err:
                self._suspected(u, f"a client could not reach it, nor could the controller: {err}")
        return {"down": sorted(self._lost_units), "suspect": sorted(self._suspect)}, {}, []

    def op_clear(self, header: dict, columns: dict, extra: list) -> Any:
        p = partition_of(header)
        self._access(header, p, write=True)
        ids = header.get("ids")
        if ids is not None:
            ids = sample_ids(ids, unique=False)
        with self._lock:
            part = self._parts.get(p)
            if part is None:
                return {"cleared": 0}, {}, []
            if ids is None:
                slots = part.committed()
            else:
                got = [part.ids.get(s, -1) for s in ids]
                slots = np.unique(np.asarray([s for s in got if s >= 0], np.int64))  # an id named twice goes once
                slots = slots[part.state[slots] == COMMITTED] if slots.size else slots
            whole = ids is None or (slots.size == len(part.ids) and not part.lost)
            seq, everywhere = self._log_clear(p, None if whole else part.names[slots].tolist())  # before the answer
            if ids is None:
                part.lost.clear()  # the partition is gone, and with it what it had lost
            self._forget(p, part, slots)
            self.book.cleared(seq, part, slots, whole=whole, everywhere=everywhere)
        return {"cleared": int(slots.size)}, {}, []

    def op_list(self, header: dict, columns: dict, extra: list) -> Any:
        with self._lock:
            out = [self._describe(name, part, with_ids=False) for name, part in sorted(self._parts.items())
                   if self._sees(header, name)]
        return {"partitions": [d for d in out if d["num_samples"]]}, {}, []

    def op_describe(self, header: dict, columns: dict, extra: list) -> Any:
        p = partition_of(header)
        self._access(header, p, write=False)
        with self._lock:
            part = self._parts.get(p)
            d = self._describe(p, part, with_ids=True) if part is not None else None
        if d is None or not d["num_samples"]:
            raise E.MissingDataError(p, {}, hint="the partition holds no samples")
        return d, {}, []

    def op_stats(self, header: dict, columns: dict, extra: list) -> Any:
        return self.stats(), {}, []

    def op_ping(self, header: dict, columns: dict, extra: list) -> Any:
        return {}, {}, []

    def stats(self) -> dict[str, Any]:
        """Samples, blocks and bytes: live, and retained by partial clears; per unit its
        blocks, the bytes they hold (``bytes``), the live bytes and the samples with a row there."""
        with self._lock:
            written = sum(b[0] for b in self._block_bytes.values())
            live = sum(b[1] for b in self._block_bytes.values())
            per_unit: dict[str, dict[str, int]] = {name: {"blocks": 0, "bytes": 0, "live_bytes": 0, "samples": 0}
                                                   for name, _ in self.units}
            for b, units in self._block_units.items():
                for u in units:
                    per_unit[self.units[u][0]]["blocks"] += 1
                    per_unit[self.units[u][0]]["bytes"] += self._block_bytes.get(b, [0, 0])[0]
            self._unit_usage(per_unit)
            for u, slab in self._unit_slabs.items():
                per_unit[self.units[u][0]]["slab"] = dict(slab)
            return {
                "partitions": len(self._parts),
                "samples": self._held(committed_only=True),
                "reservations": len(self._res),
                "pins": len(self.pins),
                "pinned_unreferenced_blocks": self.pins.deferred,
                "blocks": len(self._block_units),
                "live_bytes": live,
                "retained_bytes": written - live,
                # Rows identical across samples are stored once: what the samples hold as written,
                # and what of it no block stores a second time.
                "written_bytes": live + self._shared_bytes,
                "shared_bytes": self._shared_bytes,
                "units": per_unit,
                "replicas": self.replicas,
                "lost_units": sorted(self.units[u][0] for u in self._lost_units),
                "suspect_units": sorted(self.units[u][0] for u in self._suspect),
                "orphan_blocks_freed": self.orphans_freed,
                "partitions_repacked": self.repacked,
                "lost_samples": self._lost_samples,
                "under_replicated_samples": self._under_replicated(),
                "controller_restarts": self.restarts,
                "rebuild_seconds": float(self.rebuilt.get("seconds", 0.0)),
                # Commit-log records on the units that a rebuild needs, and those they were told to forget.
                "commit_log_records": len(self.book),
                "commit_log_forgotten": self.book.forgot,
                "started": self.started,
                "journal": self.journaling,
                **self.snapshot_stats(),
            }

    def _under_replicated(self) -> int:
        """Committed samples with a row in a block that has fewer live copies than RLPLANE_REPLICAS."""
        short = [b for b, units in self._block_units.items() if len(units) < self.replicas]
        if not short:
            return 0
        few = np.asarray(sorted(short), np.int64)
        return sum(int(rows_in(part, few).size) for part in self._parts.values())

    def _unit_usage(self, per_unit: dict[str, dict[str, int]]) -> None:
        """Add each unit's live bytes (a row stored once for several samples counted once, as
        the store's own figure does) and the samples with a row there, each once whichever
        of its blocks' copies the unit holds (vectorized per field)."""
        if not self._block_units:
            return
        bids = np.fromiter(self._block_units, np.int64, len(self._block_units))
        order = np.argsort(bids)
        bids = bids[order]
        lists = list(self._block_units.values())
        unit_of = [np.asarray([units[r] if r < len(units) else -1 for units in lists], np.int64)[order]
                   for r in range(max(map(len, lists)))]
        for part in self._parts.values():
            live = part.state[: part.used] == COMMITTED
            seen = np.full((len(self.units), part.used), False)
            for fi in part.fields.values():
                blk = fi.upto("block", part.used)
                has = live & (blk >= 0)
                if not has.any():
                    continue
                at = np.searchsorted(bids, blk[has])
                slots = np.flatnonzero(has)
                own = np.where(fi.upto("dup", part.used)[has], 0, fi.upto("nbytes", part.used)[has])
                for copies in unit_of:
                    u = copies[at]
                    ok = u >= 0
                    seen[u[ok], slots[ok]] = True
                    nb = np.bincount(u[ok], weights=own[ok], minlength=len(self.units))
                    for k, (name, _) in enumerate(self.units):
                        per_unit[name]["live_bytes"] += int(nb[k])
            for k, (name, _) in enumerate(self.units):
                per_unit[name]["samples"] += int(seen[k].sum())

    def stop(self) -> None:
        self._stop.set()
        self._frees.put(None)
        self._pool.close()

    # -- internals -----------------------------------------------------------------------
    def _forget(self, p: str, part: Partition, slots: np.ndarray) -> None:
        """Drop samples ``slots`` of partition ``p`` from the index (their rows' blocks are
        released); the partition goes when nothing of it is left to answer for."""
        self._release([self._release_rows(fi, fi.inside(slots)) for fi in part.fields.values()])
        for fi in part.fields.values():
            fi.forget(slots)
        part.state[slots] = FREE
        part.user[slots] = None
        part.forgets += 1
        for name in part.names[slots].tolist():
            del part.ids[name]
        part.names[slots] = None
        if not part.ids and not part.lost:
            del self._parts[p]
            self.ledger.forget(p)

    #: A partition renumbers its slots once it has this many and at most half of them hold
    #: anything (:meth:`Partition.repack`): its arrays then follow what it holds, not every
    #: sample it ever held (a streaming partition cleared sample by sample). ~4 ms of lock
    #: per 16k slots, at most once per loop round (2 s).
    REPACK_MIN_SLOTS = 1 << 14

    def _repack_all(self) -> int:
        """Renumber the slots of the partitions that are mostly cleared slots (under the
        lock, between requests); returns how many were. Not while a batch's commit-log
        entries are being written: a failed one's undo names its samples by slot."""
        for _ in range(self.REPACK_TRIES):  # (a batch's entries take one round trip to the units)
            with self._lock:
                if self._unwritten is None:
                    todo = [(p, part) for p, part in self._parts.items()
                            if part.used >= self.REPACK_MIN_SLOTS and 2 * len(part.ids) <= part.used]
                    return sum(self._repack(p, part) for p, part in todo)
            time.sleep(0.005)
        return 0

    #: How many times a round looks for a moment between batches (5 ms apart).
    REPACK_TRIES = 40

    def _repack(self, p: str, part: Partition) -> bool:
        """Renumber ``part``'s slots (see :meth:`Partition.repack`): what a sample holds, a
        put record names (:mod:`~rlplane_service.native.logbook`), a lease or a reservation
        holds stays; reservations, leases, the ledger's states and the book follow. Not
        when that keeps more than half of them (cleared slots the log still names): False."""
        used = part.used
        keep = (part.state[:used] != FREE) | (part.logged[:used] > 0)
        keep[self.ledger.leased(p, part)] = True
        reserved = [res for res in self._res.values() if res.part is part]
        for res in reserved:  # (a write's samples may have been cleared since its reserve)
            keep[res.slots] = True
        keep = np.flatnonzero(keep)
        if 2 * keep.size > used:
            return False
        remap = part.repack(keep)
        for res in reserved:
            res.slots = remap[res.slots]
        self.ledger.renumber(p, part, keep, remap)
        self.book.renumber(part, remap)
        self.repacked += 1
        return True

    def _held(self, committed_only: bool = False) -> int:
        if committed_only:
            return sum(int((p.state[: p.used] == COMMITTED).sum()) for p in self._parts.values())
        return sum(len(p.ids) for p in self._parts.values())

    def _slots(self, p: str, part: Partition | None, ids: list[str]) -> np.ndarray:
        """Slots of committed samples ``ids``; MissingDataError naming the unknown ones."""
        if part is None:
            raise self._missing(p, part, ids)
        got = [part.ids.get(s, -1) for s in ids]
        slots = np.asarray(got, np.int64)
        bad = slots < 0
        if slots.size and not bad.all():
            bad |= part.state[np.where(bad, 0, slots)] != COMMITTED
        if bad.any():
            raise self._missing(p, part, [ids[i] for i in np.flatnonzero(bad).tolist()])
        return slots

    @staticmethod
    def _missing(p: str, part: Partition | None, ids: list[str]) -> E.MissingDataError:
        lost = {s: part.lost[s] for s in ids if part is not None and s in part.lost}
        hint = E.lost_hint(lost, "they held the only copy; RLPLANE_REPLICAS=2 keeps two") if lost else ""
        return E.MissingDataError(p, {s: [] for s in ids}, hint=hint)

    def _release_rows(self, fi: FieldIndex, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``fi`` at ``slots`` go (cleared or overwritten): returns their blocks
        and the stored bytes they give back, for :meth:`_release` (the caller releases
        every field's at once: each block then loses a reference per row). A row sharing
        another's bytes gives back no stored bytes of its own, and a row whose bytes others
        still share hands them on (the first of those others holds them from now on), so
        live bytes count what is still read."""
        blocks, nbytes = fi.block[slots], fi.nbytes[slots]
        if not fi.shares:  # no row of the field shares bytes (the usual case): nothing to hand on
            return blocks, nbytes
        dup = fi.dup[slots]
        heirs = _heirs(fi, slots)  # before the going rows stop counting as sharers
        if bool(dup.any()):
            held = dup & (fi.block[slots] >= 0)
            self._shared_bytes -= int(nbytes[held].sum())
            nbytes = np.where(dup, 0, nbytes)
            fi.dup[slots] = False
        if heirs.size:  # their bytes stay live; they no longer count as shared
            fi.dup[heirs] = False
            inherit(fi, heirs)
            handed = int(fi.nbytes[heirs].sum())
            self._shared_bytes -= handed
            for b, nb in zip(*per_block(fi.block[heirs], fi.nbytes[heirs])):
                self._block_bytes[b][1] += nb
        return blocks, nbytes

    def _release(self, going: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Drop references from rows to blocks (``going``: per field, the rows' blocks and
        the bytes they give back, from :meth:`_release_rows`); free blocks nothing points
        at any more."""
        if not going:
            return
        blocks, nbytes = np.concatenate([b for b, _ in going]), np.concatenate([nb for _, nb in going])
        held = blocks >= 0
        if not held.any():
            return
        uniq, counts = np.unique(blocks[held], return_counts=True)
        freed_bytes = np.bincount(np.searchsorted(uniq, blocks[held]), weights=nbytes[held], minlength=uniq.size)
        dead = []
        for b, c, nb in zip(uniq.tolist(), counts.tolist(), freed_bytes.tolist()):
            self._block_refs[b] -= c
            self._block_bytes[b][1] -= int(nb)
            if self._block_refs[b] <= 0:
                dead.append(b)
        self._drop_blocks(dead)

    def _drop_blocks(self, bids: list[int]) -> None:
        """Forget blocks; free them on their units now, or once the reads pinning them are done."""
        self.book.blocks_gone(bids)
        for b in bids:
            units = self._block_units.pop(b, ())
            self._block_refs.pop(b, None)
            self._block_bytes.pop(b, None)
            self._block_ext.pop(b, None)
            if not self.pins.defer(b, units):
                self._queue_frees(b, units)

    def _queue_frees(self, b: int, units: tuple[int, ...]) -> None:
        late = self._late.pop(b, {})
        for u in units:
            if u not in self._lost_units:
                self._frees.put((u, [b], late.get(u, 0.0)))

    def _describe(self, name: str, part: Partition, *, with_ids: bool) -> dict[str, Any]:
        live = part.state[: part.used] == COMMITTED
        fields, nbytes = {}, 0
        for fname, fi in part.fields.items():
            has = live & (fi.upto("block", part.used) >= 0)
            count = int(has.sum())
            if count:
                fields[fname] = count
                nbytes += int(fi.upto("nbytes", part.used)[has].sum())
        out = {"partition": name, "num_samples": int(live.sum()), "fields": fields, "nbytes": nbytes}
        if with_ids:
            out["sample_ids"] = part.names[: part.used][live].tolist()
        return out

    def _free_some(self) -> None:
        """Send the frees queued so far (waits up to half a second for one), one message per
        unit (and hold) for up to FREE_BATCH blocks: a block at a time, 10 discards of 4096
        blocks each queued 80,000 round trips, and an honest clear's space came back 14 s late."""
        try:
            item = self._frees.get(timeout=0.5)
        except queue.Empty:
            return
        batches: dict[tuple[int, float], list[int]] = {}
        taken = 0
        while item is not None:
            u, bids, after = item
            batches.setdefault((u, after), []).extend(bids)
            taken += len(bids)
            if taken >= FREE_BATCH:
                break
            try:
                item = self._frees.get_nowait()
            except queue.Empty:
                break
        for (u, after), bids in batches.items():
            name = self.units[u][0]
            try:
                self._pool.get(self._control[u], name).call(
                    {"op": "free", "b": ints(bids), **({"after": after} if after else {})}, timeout=10.0)
            except E.RlplaneError as err:
                log.warning("could not free %d blocks on %s: %s", len(bids), name, err)


def controller_actor_class() -> Any:
    """The Ray actor class of the controller (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class NativeControllerActor:
        """Hosts a :class:`ControllerCore` and its server thread. Restarted by Ray after its
        process died (the service creates it with ``max_restarts``), it rebuilds its index
        from the storage units in the background (``health()`` says ``recovering`` with
        progress), then serves again on the port it served before, so clients ride through."""

        def __init__(self, host: str | None, secret: str | None, units: list[tuple[str, str]], capacity: int | None,
                     lease_s: float, replicas: int, claim_lease_s: float = 300.0, control: list[str] | None = None,
                     control_secret: str | None = None, grace_s: float = UNIT_GRACE_S,
                     ports: Sequence[int] | None = None, tenants: dict[str, Any] | None = None,
                     store: str | None = None, journal: bool = False) -> None:
            """``tenants``: engine user -> [secret, [prefixes, may write]] (rlplane_service.tenants).
            ``store``: the store's name; its ``{store}-metrics`` actor keeps the port and the restart count."""
            key = secret.encode() if secret else None
            tenants = tenants or {}
            names = [name for name, _ in units]
            handles: dict[int, Any] = {}

            def is_dead(u: int) -> bool:
                """Ray's word on unit ``u``: dead once its actor is gone (killed, or its node died);
                a stopped or busy process only times out, which says nothing."""
                try:
                    handle = handles.get(u) or handles.setdefault(u, ray.get_actor(names[u]))
                    ray.get(handle.info.remote(), timeout=CHECK_TIMEOUT_S)
                    return False
                except ValueError:  # no actor of that name any more
                    return True
                except ray.exceptions.RayActorError:
                    return True
                except ray.exceptions.GetTimeoutError:
                    return False

            self._kv = ray.get_actor(f"{store}-metrics") if store else None
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
            self._core = ControllerCore(units, secret=key, capacity=capacity, lease_s=lease_s, replicas=replicas,
                                        claim_lease_s=claim_lease_s, control=control,
                                        control_secret=control_secret.encode() if control_secret else None,
                                        grace_s=grace_s, is_dead=is_dead,
                                        scopes={user: tuple(scope) for user, (_, scope) in tenants.items()},
                                        start=not restarted, journal=journal)
            self._serve = {"host": host or ray.util.get_node_ip_address(), "secret": key,
                           "users": {user: s.encode() for user, (s, _) in tenants.items()}}
            self._secret = secret
            self._server: Any = None
            self._ready = threading.Event()
            self._failed: str | None = None
            if not restarted:
                self._listen((int(ports[0]), int(ports[1])) if ports else 0)
                self._remember("controller-port", int(self._server.endpoint.rsplit(":", 1)[1]))
                return
            port = self._remember("controller-port", 0) or ((int(ports[0]), int(ports[1])) if ports else 0)
            self._core.restarts = int(self._recall("controller-restarts", 1))
            threading.Thread(target=self._recover, args=(port,), name="rlplane-rebuild", daemon=True).start()

        def _remember(self, key: str, value: Any) -> Any:
            return ray.get(self._kv.remember.remote(key, value), timeout=30) if self._kv is not None else value

        def _recall(self, key: str, add: int) -> int:
            return int(ray.get(self._kv.count.remote(key, add), timeout=30)) if self._kv is not None else add

        def _listen(self, port: Any) -> None:
            from rlplane_service.native.server import Server

            self._server = Server(self._core, host=self._serve["host"], secret=self._serve["secret"],
                                  name="controller", port=port, users=self._serve["users"]).start()
            self._ready.set()

        def _recover(self, port: Any) -> None:
            """Rebuild the index, then serve on the old port and start the loops."""
            try:
                self._core.rebuild()
                self._listen(port)
                self._core.start()
            except Exception as err:  # noqa: BLE001 - said by health(); the actor stays up to say it
                self._failed = f"{type(err).__name__}: {err}"
                log.exception("the controller could not rebuild its index")

        def info(self, timeout: float = 120.0) -> dict[str, Any]:
            """Endpoint, secret and units; waits for a rebuild to finish (up to ``timeout``)."""
            if not self._ready.wait(timeout):
                raise E.NotReadyError(f"the controller is still rebuilding its index: {self._core.recovering}")
            return {"endpoint": self._server.endpoint, "secret": self._secret, "units": self._core.units,
                    "pid": os.getpid()}

        def stats(self) -> dict[str, Any]:
            return self._core.stats()

        def health(self) -> dict[str, Any]:
            """The server loop's and every background loop's state (see :meth:`ControllerCore.health`),
            and while a rebuild runs ``recovering`` (its progress); ``rebuild_failed`` if it failed."""
            if not self._ready.is_set():
                return {"server": {"alive": self._failed is None}, "threads": {}, "recovering": self._core.recovering
                        or {"phase": "starting"}, "rebuild_failed": self._failed, "restarts": self._core.restarts}
            return {"server": self._server.health(), **self._core.health(), "restarts": self._core.restarts,
                    "rebuild": self._core.rebuilt}

        def streams(self) -> dict[str, Any]:
            with self._core._lock:
                return self._core.ledger.snapshot()

    return NativeControllerActor


__all__ = ["ControllerCore", "controller_actor_class"]


def _heirs(fi: FieldIndex, slots: np.ndarray) -> np.ndarray:
    """Of the rows that share bytes (``fi.dup``) and are not among ``slots``, the first one
    (lowest slot) per stored row of ``slots`` that holds its own bytes: who holds those
    bytes once ``slots`` go. Vectorized: a sort of the candidates by where they point."""
    own = slots[~fi.dup[slots] & (fi.block[slots] >= 0) & (fi.nbytes[slots] > 0)]  # an empty row shares nothing
    if not own.size or not bool(fi.dup.any()):
        return own[:0]
    others = np.setdiff1d(np.flatnonzero(fi.dup), slots)
    others = others[fi.nbytes[others] > 0]  # (an empty row at the same offset shares nothing either)
    if not others.size:
        return others
    block = np.concatenate([fi.block[own], fi.block[others]])
    off = np.concatenate([fi.off[own], fi.off[others]])
    kind = np.concatenate([np.zeros(own.size, np.int8), np.ones(others.size, np.int8)])  # 0: goes, 1: stays
    slot = np.concatenate([own, others])
    order = np.lexsort((slot, kind, off, block))  # per (block, off): the going row first, then the others by slot
    block, off, kind, slot = block[order], off[order], kind[order], slot[order]
    first = np.ones(block.size, bool)
    first[1:] = (block[1:] != block[:-1]) | (off[1:] != off[:-1])
    after = np.zeros(block.size, bool)
    after[1:] = first[:-1] & (kind[:-1] == 0) & ~first[1:]  # right after a going row, in its group
    return slot[after & (kind == 1)]

