"""The controller's commit log and its rebuild: a restarted controller carries on with
every committed sample (see :mod:`~rlplane_service.native.commitlog` for the log itself).

Writing: a commit's record reaches its units (and one more when its blocks are on one
unit only) before the commit answers, a clear reaches every unit that answers before the
clear answers. A record no unit took fails the call (UnavailableError, nothing applied).
Why this is safe when the controller dies in between:

- before any unit took the record: the writer gets no answer (UnavailableError from its
  channel) and the put does not exist after the restart; its blocks are orphans that the
  sweep frees. A retry of the whole put succeeds.
- after a unit took it and before the answer: the put exists after the restart (its
  record is replayed). The writer's channel failed; it sends the same commit again and
  the new controller answers it as committed (it knows the reservation ids it replayed),
  so the retry neither fails nor stores twice.
- a reservation that never committed: the new controller does not know it; its commit is
  LeaseError "the controller restarted ...; nothing of the put was stored: retry it".

Rebuilding (:meth:`RecoveryOps.rebuild`): every unit lists its blocks (with their extents)
and its log; entries whose MAC fails are ignored and reported; the union is replayed in
sequence order through the same code a live commit or clear runs; then each block's
copies are where the units say they are (re-replicated copies included), and samples
whose rows are on no unit that answered are lost (reads name them). Rebuilding reads the
units and writes nothing to them, so a controller killed mid-rebuild simply rebuilds
again. Claims, leases and acks are not logged: after a restart every sample is pending
for every task again (``consumption()`` says ``controller_restarts``).

Example::

    core = ControllerCore(units, secret=key, start=False)
    core.rebuild()          # {"entries": 12, "samples": 768, "ignored": 0, ...}
    core.start()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Collection

import numpy as np

from rlplane import errors as E
from rlplane.channel import ChannelPool
from rlplane.gcpause import gc_paused
from rlplane.wire import ints
from rlplane_service.native import commitlog as clog
from rlplane_service.native.commitlog import ACK, CLEAR, DROP, MAX_ENTRIES_PER_REQUEST, PUT, Entry
from rlplane_service.native.index import COMMITTED, Partition, Reservation, incarnation
from rlplane_service.native.logbook import LogBook
from rlplane_service.native.pins import RESTART_HOLD_S, Pins
from rlplane_service.native.requests import LISTED, births, blocks_of

log = logging.getLogger(__name__)

#: How long a unit may take to keep a commit-log entry, to keep entries and fsync its
#: journal (a durable put), and to list its blocks and log.
LOG_TIMEOUT_S, SYNC_TIMEOUT_S, INVENTORY_TIMEOUT_S = 5.0, 60.0, 60.0
#: How often the controller tells the units which entries a rebuild no longer needs.
COMPACT_EVERY_S = 2.0
#: Reservation ids of recent commits remembered (a commit sent again is answered as done).
DONE_REMEMBERED = 1 << 16

#: Ids in one journalled expiry record (a claim over a stale backlog expires all of it at
#: once; one record of a million ids would be a request past the engine's header limit).
EXPIRED_PER_RECORD = 1 << 16


@dataclass(frozen=True, slots=True)
class _Staged:
    """An entry of a batch, for ``targets``; ``slot``: the request that wrote it; ``undo``:
    reverts it; ``durable``: the units in ``holders`` (those with its bytes) fsync it first."""

    entry: Entry
    targets: list[int]
    what: str
    slot: int
    undo: Callable[[], None] | None
    durable: bool = False
    holders: tuple[int, ...] = ()


class RecoveryOps:
    """The commit log's writing and the rebuild (a mixin of the controller)."""

    units: list[tuple[str, str]]
    seal_key: bytes | None
    _lock: threading.RLock
    _pool: ChannelPool
    _control: list[str]
    _parts: dict[str, Partition]
    _block_units: dict[int, tuple[int, ...]]
    _block_refs: dict[int, int]
    _block_ext: dict[int, Any]
    _lost_units: dict[int, str]
    _suspect: dict[int, tuple[float, str]]
    _unlisted: dict[int, set[int]]
    _lost_samples: int
    pins: Pins
    journaling: bool
    _forget: Callable[[str, Partition, np.ndarray], None]
    _dead: Callable[[int], bool]  # (UnitHealth's: whether a unit's process is known to be dead)
    _lose_blocks: Callable[[list[int], str], int]  # (UnitHealth's: samples with a row in these blocks are lost)
    _parse_commit: Callable[..., Any]
    _apply_commit: Callable[..., None]
    _suspected: Callable[[int, str], None]

    def _init_log(self) -> None:
        self._seq = 1
        self._done: OrderedDict[str, int] = OrderedDict()  # reservation id -> samples, of recent commits
        self._replaying = False
        self._group: list[_Staged] | None = None  # entries of the batch of requests being served
        self.batch_slot = 0  # the server's index of the request being handled in its batch
        self.restarts = 0  # times this store's controller restarted (its host counts them, across processes)
        self.rebuilt: dict[str, Any] = {}  # the last rebuild's report
        self.recovering: dict[str, Any] | None = None  # progress while a rebuild runs
        self.journal_paused = False  # a restore replays an old journal: what it puts is not journalled again
        self.book = LogBook()  # which entries on the units a rebuild still needs (the rest are forgotten)
        self._unwritten: int | None = None  # the first entry a batch staged that may not be on the units yet

    # -- writing -------------------------------------------------------------------------
    def _committed(self, rid: str, n: int) -> None:
        self._done[rid] = n
        if len(self._done) > DONE_REMEMBERED:
            self._done.popitem(last=False)

    def _log_put(self, res: Reservation, header: dict[str, Any], durable: bool = False,
                 rows: dict[str, Any] | None = None) -> dict[int, Any]:
        """The record of commit ``res`` (its header checked) on its units, or UnavailableError;
        ``durable``: in their journals on disk, too. ``rows``: the put's columns, sent with
        the record to the units of its one block, which store them first (a put sent in one
        message); returns each of those units' extents (``{unit: {field: slab offset}}``)."""
        if self._replaying:
            return {}
        body = clog.record({"rid": res.rid, "ids": res.part.names[res.slots].tolist(), "create": res.create,
                            "fields": list(res.fields), "blocks": [[b, list(u), a, z] for b, u, a, z in res.blocks],
                            "g": header["g"], "nb": header["nb"], "h": header.get("h") or {},
                            "user": header.get("user"), "x": header.get("x"),
                            **{k: header[k] for k in ("s", "k", "hx") if header.get(k)},
                            # a create's incarnations when given (a snapshot's); else its rid's
                            **({"bn": res.born.astype("<i8").tobytes()} if res.create and not isinstance(res.born, int)
                               else {})})
        holders = sorted({u for _, units, _, _ in res.blocks for u in units})
        bytes_on = tuple(holders)
        if len(holders) < 2:  # a record on one unit only would go with that unit
            spare = [u for u in self._answering() if u not in holders]
            holders += spare[: 2 - len(holders)]
        answers: dict[int, Any] = {}
        res.seq = self._journal(PUT, res.partition, body, holders, "put",
                                undo=self._unput(res) if res.create else None, durable=durable, holders=bytes_on,
                                rows=(res.blocks[0][0], rows, answers) if rows is not None else None)
        return {u: answers[u].get("x") for u in bytes_on} if rows is not None else {}

    def _log_ack(self, p: str, task: str, ids: list[str]) -> None:
        """Acks of ``ids`` for ``task`` in the journals of two units, before they apply
        (UnavailableError when no unit kept them). Only with a journal."""
        if self._replaying or not self.journaling or self.journal_paused or not ids:
            return
        group, self._group = self._group, None
        try:
            self._journal(ACK, p, clog.record({"task": task, "ids": ids}), self._answering()[:2], "ack")
        finally:
            self._group = group

    def _log_expired(self, p: str, task: str, ids: list[str]) -> None:
        """Samples a claim found stale and marked expired for ``task``, in the journals of two
        units (an ack record saying so: a replay marks them expired again). The claim stands
        when no unit kept it: the error is logged (a restore then hands them out as pending)."""
        if self._replaying or not self.journaling or self.journal_paused or not ids:
            return
        group, self._group = self._group, None
        try:
            for a in range(0, len(ids), EXPIRED_PER_RECORD):
                self._journal(ACK, p, clog.record({"task": task, "ids": ids[a : a + EXPIRED_PER_RECORD],
                                                   "state": "expired"}), self._answering()[:2], "expiry")
        except E.RlplaneError as err:
            log.error("journal: %d samples of %r expired for task %r are not journalled: %s", len(ids), p, task, err)
        finally:
            self._group = group

    def _unput(self, res: Reservation) -> Callable[[], None]:
        """What takes a new put back out of the index (its record reached no unit); a commit
        whose indexing has not run yet (the server runs a batch's last after its answers)
        aborts when it does."""
        def undo() -> None:
            res.revoked = True
            part = res.part
            if self._parts.get(res.partition) is part:
                self._forget(res.partition, part, res.slots[part.state[res.slots] == COMMITTED])
            self._done.pop(res.rid, None)
        return undo

    def _log_clear(self, p: str, ids: list[str] | None) -> tuple[int, bool]:
        """Samples ``ids`` of ``p`` (None: all of it) cleared, on every unit that answers;
        returns the entry's sequence number, and whether every unit that is not lost kept it."""
        if self._replaying:
            return 0, False
        kind, body = (DROP, clog.record({})) if ids is None else (CLEAR, clog.record({"ids": ids}))
        group, self._group = self._group, None  # a clear is written before it is applied, even in a batch
        kept: list[int] = []
        try:
            seq = self._journal(kind, p, body, self._answering(), "clear", kept=kept)
        finally:
            self._group = group
        return seq, set(kept) >= {u for u in range(len(self.units)) if u not in self._lost_units}

    def _answering(self) -> list[int]:
        return [u for u in range(len(self.units)) if u not in self._lost_units and u not in self._suspect]

    def _journal(self, kind: str, p: str, body: bytes, targets: list[int], what: str,
                 undo: Callable[[], None] | None = None, *, durable: bool = False, holders: tuple[int, ...] = (),
                 kept: list[int] | None = None, rows: tuple[int, dict[str, Any], dict[int, Any]] | None = None) -> int:
        """One entry for ``targets``; returns its sequence number. Within a batch
        (:meth:`open_batch`) it is staged and written by :meth:`flush` before the batch's
        answers go out (``undo`` then reverts the request's change if no unit kept it);
        otherwise written now (the units that kept it added to ``kept``): UnavailableError
        when no unit kept it. ``rows``: ``(block, columns, answers)``, a put's rows that the
        units of ``holders`` store with the entry (written now, even in a batch: the
        extents they answer, into ``answers``, are the index's); when one of them cannot,
        its error is raised and the units that kept the entry forget it (one that failed
        after keeping it, e.g. at its journal, keeps it: a rebuild then finds its rows gone)."""
        seq, self._seq = self._seq, self._seq + 1
        e = Entry(seq, kind, p, body, clog.mac(self.seal_key, seq, kind, p, body))
        staged = _Staged(e, targets, what, self.batch_slot, undo, durable, holders)
        if self._group is not None and rows is None:
            self._group.append(staged)
            if self._unwritten is None:
                self._unwritten = seq
            return seq
        answers: dict[int, Any] = rows[2] if rows is not None else {}
        errors = self._write_entries({u: [e] for u in targets}, {u for u in holders if durable},
                                     (rows[0], rows[1], set(holders)) if rows is not None else None, answers)
        if kept is not None:
            kept.extend(u for u in targets if u not in errors)
        if rows is not None and (short := [u for u in holders if u in errors]):
            forget = {"op": "forget", "s": ints([seq]), "early": True}
            self._tell([u for u in targets if u not in errors], forget)
            late = [u for u in targets if u in errors and isinstance(answers.get(u), E.TransportError)]
            self._post(late, forget)  # (one too slow to answer may keep it yet; one that refused never will)
            err = answers.get(short[0])
            raise err if isinstance(err, E.RlplaneError) else self._not_kept(what, [errors[u] for u in short])
        if not any(u not in errors for u in targets):
            raise self._not_kept(what, [errors[u] for u in targets])
        if (why := _not_durable(staged, errors)) is not None:
            raise why
        return seq

    def open_batch(self) -> None:
        """The server starts a batch of requests: their entries are staged (see :meth:`flush`)."""
        self._group = []
        self._early: dict[int, E.RlplaneError] = {}

    def settle(self) -> None:
        """Write what the batch staged so far now (a snapshot's cut must see only changes the
        units hold); the failures are answered with the batch's others."""
        if self._group:
            self._early.update(self.flush())
            self._group = []

    def flush(self) -> dict[int, E.RlplaneError]:
        """Write the batch's staged entries, one message per unit (group commit: one round trip
        for every commit and clear of the batch); returns, per request of the batch whose
        entry no unit kept, its error (its change is undone where it can be)."""
        group, self._group = self._group or [], None
        early, self._early = getattr(self, "_early", {}), {}
        if not group:
            return early
        per_unit: dict[int, list[Entry]] = {}
        for g in group:
            for u in g.targets:
                per_unit.setdefault(u, []).append(g.entry)
        failed: dict[int, E.RlplaneError] = {}
        try:
            errors = self._write_entries(per_unit, {u for g in group if g.durable for u in g.holders})
            for g in group:
                if not any(u not in errors for u in g.targets):
                    failed[g.slot] = self._not_kept(g.what, [errors[u] for u in g.targets])
                    if g.undo is not None:
                        with self._lock:
                            g.undo()
                elif (why := _not_durable(g, errors)) is not None:
                    failed[g.slot] = why
        finally:  # (after the undos: they name samples by slot, which a renumbering waits for)
            self._unwritten = None  # (the server stages the next batch only after this one is answered)
        return {**early, **failed}

    def _write_entries(self, per_unit: dict[int, list[Entry]], sync: Collection[int] = (),
                       rows: tuple[int, dict[str, Any], Collection[int]] | None = None,
                       answers: dict[int, Any] | None = None) -> dict[int, str]:
        """Send each unit its entries at once and wait (LOG_TIMEOUT_S, SYNC_TIMEOUT_S when a
        unit fsyncs); the units that did not keep them, and why. The units in ``sync`` fsync
        their journals before answering; while a restore replays an old journal the units
        keep the entries out of theirs. ``rows``: ``(block, columns, units)``, rows those
        units store as the block with their entry; ``answers`` gets each unit's answer, or
        the error it raised."""
        sent, errors = [], {}
        answers = answers if answers is not None else {}
        for u, entries in per_unit.items():
            name = self.units[u][0]
            try:
                ch = self._pool.get(self._control[u], name)
                for k in range(0, len(entries), MAX_ENTRIES_PER_REQUEST):
                    part = entries[k : k + MAX_ENTRIES_PER_REQUEST]
                    head: dict[str, Any] = {"op": "log", "e": [e.wire() for e in part]}
                    if u in sync and k + MAX_ENTRIES_PER_REQUEST >= len(entries):
                        head["sync"] = True
                    if self.journal_paused:
                        head["nj"] = True
                    stored = rows is not None and u in rows[2]
                    if stored:
                        head["b"] = rows[0]  # type: ignore[index]
                    sent.append((u, ch, ch.send(head, rows[1] if stored else None,  # type: ignore[index]
                                                buffers=[e.body for e in part])))
            except E.RlplaneError as err:
                errors[u], answers[u] = f"{name}: {err}", err
        deadline = time.monotonic() + (SYNC_TIMEOUT_S if sync else LOG_TIMEOUT_S)
        for u, ch, rid in sent:
            try:
                answers[u] = ch.receive(rid, deadline)[0]
            except E.RlplaneError as err:
                errors.setdefault(u, f"{self.units[u][0]}: {err}")
                answers.setdefault(u, err)
        if errors:
            log.warning("commit-log entries not kept by %s", "; ".join(errors.values()))
        return errors

    def _tell(self, targets: list[int], header: dict[str, Any]) -> list[str]:
        """``header`` to each unit of ``targets`` on its control channel, answers awaited
        (LOG_TIMEOUT_S); the failures, as text."""
        sent, failed = [], []
        for u in targets:
            name = self.units[u][0]
            try:
                ch = self._pool.get(self._control[u], name)
                sent.append((name, ch, ch.send(header)))
            except E.RlplaneError as err:
                failed.append(f"{name}: {err}")
        deadline = time.monotonic() + LOG_TIMEOUT_S
        for name, ch, rid in sent:
            try:
                ch.receive(rid, deadline)
            except E.RlplaneError as err:
                failed.append(f"{name}: {err}")
        return failed

    def _post(self, targets: list[int], header: dict[str, Any]) -> None:
        """``header`` to each unit of ``targets``, one-way (nothing awaited; a unit that is
        gone does not get it, which is what its loss would do anyway)."""
        for u in targets:
            name = self.units[u][0]
            try:
                self._pool.get(self._control[u], name).post(header)
            except E.RlplaneError as err:
                log.info("could not tell %s %s: %s", name, header.get("op"), err)

    def _compact(self) -> None:
        """Tell every unit that is not lost to forget the commit-log entries a rebuild no
        longer needs (:mod:`~rlplane_service.native.logbook`); they count as gone once all of
        them did. A unit that does not answer is asked again next round."""
        with self._lock:
            below = self._unwritten if self._unwritten is not None else self._seq
            seqs = self.book.forgettable(below)
            targets = [u for u in range(len(self.units)) if u not in self._lost_units]
        if not seqs:
            return
        failed = self._tell(targets, {"op": "forget", "s": ints(seqs)})
        if failed:
            log.warning("commit-log entries no longer needed stay on the units for now (%s)", "; ".join(failed))
            return
        with self._lock:
            self.book.forgotten(seqs)

    @staticmethod
    def _not_kept(what: str, errors: list[str]) -> E.UnavailableError:
        why = "; ".join(errors) or "no storage unit answers"
        return E.UnavailableError(f"no storage unit kept the record of this {what} ({why}); it was not applied: "
                                  "retry it", component="storage unit")

    # -- rebuilding ----------------------------------------------------------------------
    def rebuild(self, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Rebuild the index from the units' blocks and logs (see the module docstring);
        returns the report (also ``self.rebuilt``). Run before the controller serves."""
        self.pins.hold_frees(math.inf)  # readers' zero-copy views are pinned nowhere yet: nothing is freed
        try:
            with gc_paused():  # millions of ids and tags: the collector's passes would cost more than the work
                return self._rebuild(progress)
        finally:  # ...until they have had time to renew their pins with this controller (pins.py)
            self.pins.hold_frees(min(RESTART_HOLD_S, self.pins.lease_s))

    def _rebuild(self, progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        t0 = time.monotonic()
        state: dict[str, Any] = {"phase": "listing units", "units_done": 0, "units": len(self.units),
                                 "entries_done": 0, "entries": 0}
        self.recovering = state

        def step(**kv: Any) -> None:
            state.update(kv)
            if progress is not None:
                progress(dict(state))

        holders: dict[int, dict[int, list[Any]]] = {}  # block -> unit -> [[field, dtype, start], ...]
        copies: dict[int, list[tuple[str, Entry]]] = {}  # seq -> (unit, entry) of every copy
        unreachable, ignored, silent = [], [], set()
        high = 0  # the highest sequence number a unit saw (acks are journalled only)
        asked: dict[int, tuple[Any, int] | E.RlplaneError] = {}
        cursor = {u: {} for u in range(len(self.units))}  # unit -> where its next inventory page starts
        deadline = time.monotonic() + INVENTORY_TIMEOUT_S
        while cursor:  # every unit lists a page at once, until none has more
            for u in cursor:
                name = self.units[u][0]
                try:
                    ch = self._pool.get(self._control[u], name)
                    asked[u] = (ch, ch.send({"op": "inventory", **cursor[u]}))
                except E.RlplaneError as err:
                    asked[u] = err
            for u in list(cursor):
                name = self.units[u][0]
                try:
                    got = asked[u]
                    if isinstance(got, E.RlplaneError):
                        raise got
                    reply, _, bodies = got[0].receive(got[1], deadline)
                    for b, fields in reply.get("blocks", []):
                        holders.setdefault(int(b), {})[u] = fields
                    for head, body in zip(reply.get("e", []), bodies):
                        e = Entry.from_wire(head, body, copy=False)
                        copies.setdefault(e.seq, []).append((name, e))
                    high = max(high, int(reply.get("high") or 0))
                    more = {k: reply.get(f"more_{k}") for k in ("b", "s")}
                    if any(isinstance(v, int) for v in more.values()):  # a kind listed whole is asked past its end
                        cursor[u] = {k: v if isinstance(v, int) else LISTED for k, v in more.items()}
                        continue
                except E.RlplaneError as err:
                    unreachable.append(f"{name}: {err}")
                    silent.add(u)
                    self._suspected(u, f"it did not answer the controller's rebuild: {err}")
                del cursor[u]
                step(units_done=len(self.units) - len(cursor))
        entries: dict[int, Entry] = {}
        for seq, held in copies.items():  # the first copy whose MAC holds (most are checked once)
            for name, e in held:
                if clog.valid(self.seal_key, e):
                    entries[seq] = e
                    break
                ignored.append(f"entry {seq} on {name}")
        if ignored:
            log.error("rebuild: ignored %d commit-log entries that fail their MAC (damaged or forged): %s",
                      len(ignored), ", ".join(ignored[:10]))
        step(phase="replaying", entries=len(entries))
        skipped = 0
        with self._lock:
            self._replaying = True
            try:
                records, sizes = {}, {}
                for seq, e in entries.items():
                    try:
                        records[seq] = clog.parse(e)
                    except E.WireFormatError as err:
                        ignored.append(f"entry {seq}: {err}")
                        continue
                    if e.kind == PUT and records[seq].get("create") is True:
                        sizes[e.partition] = sizes.get(e.partition, 0) + len(records[seq].get("ids") or ())
                for p, n in sizes.items():  # each partition's arrays made once, at their size
                    self._parts.setdefault(p, Partition()).reserve(n)
                for k, seq in enumerate(sorted(records)):
                    try:
                        skipped += not self._replay(entries[seq], records[seq])
                    except (E.RlplaneError, KeyError, TypeError, ValueError) as err:
                        skipped += 1
                        ignored.append(f"entry {seq}: {err}")
                        log.error("rebuild: commit-log entry %d does not apply (%s); skipped", seq, err)
                    if k % 1024 == 1023:
                        step(entries_done=k + 1)
                self._seq = max(max(entries, default=0), high) + 1
                for p in [p for p, part in self._parts.items() if not part.ids and not part.lost]:
                    del self._parts[p]  # made for records a later clear undid
                lost = self._locate_copies(holders, [u for u in silent if not self._dead(u)])
            finally:
                self._replaying = False
        samples = sum(int((p.state[: p.used] == COMMITTED).sum()) for p in self._parts.values())
        self.rebuilt = {"seconds": round(time.monotonic() - t0, 3), "entries": len(entries), "samples": samples,
                        "partitions": len(self._parts), "blocks": len(self._block_units), "lost_samples": lost,
                        "ignored": len(ignored), "ignored_entries": ignored[:20], "skipped": skipped,
                        "unreachable_units": unreachable,
                        "waiting_blocks": sum(len(b) for b in self._unlisted.values())}
        self.recovering = None
        step(phase="done")
        log.warning("controller rebuilt its index in %.2f s: %d samples in %d partitions from %d log entries "
                    "(%d ignored, %d lost, units not answering: %s)", self.rebuilt["seconds"], samples,
                    len(self._parts), len(entries), len(ignored), lost, unreachable or "none")
        return self.rebuilt

    def _replay(self, e: Entry, rec: dict[str, Any]) -> bool:
        """Apply entry ``e`` (its body: ``rec``) to the index as its commit or clear did;
        False when it no longer applies."""
        p = e.partition
        part = self._parts.get(p)
        if e.kind == DROP:
            if part is not None:
                part.lost.clear()
                self._forget(p, part, part.committed())
                self.book.cleared(e.seq, part, np.zeros(0, np.int64), whole=True)
            return True
        if e.kind == CLEAR:
            if part is None:
                return False
            slots = np.unique(np.asarray([part.ids.get(s, -1) for s in rec["ids"]], np.int64))
            slots = slots[slots >= 0]
            slots = slots[part.state[slots] == COMMITTED]
            self._forget(p, part, slots)
            self.book.cleared(e.seq, part, slots, whole=False)
            return True
        ids, create, fields = list(rec["ids"]), rec["create"] is True, list(rec["fields"])
        blocks = blocks_of(rec["blocks"], len(ids), len(self.units))
        born = births(rec.get("bn"), len(ids)) if create else None  # checked before anything is taken
        stand_ins = None
        if create:
            if part is not None and (again := [part.ids[s] for s in ids if s in part.ids]):
                self._forget(p, part, np.asarray(again, np.int64))  # a later put of the same ids wins
                part = self._parts.get(p)
            if part is None:
                part = self._parts[p] = Partition()
            slots = part.take(ids)
        else:
            if part is None:
                return False
            slots = np.asarray([part.ids.get(s, -1) for s in ids], np.int64)
            gone = np.flatnonzero(slots < 0)
            if gone.size == len(ids) or bool((part.state[slots[slots >= 0]] != COMMITTED).any()):
                return False  # cleared after it was written
            if gone.size:  # some of its samples were cleared since (their put records are forgotten): the others
                # still take its rows, so the cleared ones stand in as samples of their own, dropped once it applied
                slots[gone] = part.take([ids[k] for k in gone.tolist()])
                part.state[slots[gone]] = COMMITTED
                stand_ins = slots[gone]
        for b, units, _, _ in blocks:
            self._block_units[b] = units
            self._block_refs.setdefault(b, 0)
        rid = str(rec["rid"])
        res = Reservation(rid, p, part, slots, create, fields, blocks, float("inf"), seq=e.seq, ids=ids,
                          born=(born if born is not None else incarnation(rid)) if create else 0)
        try:
            try:
                parsed = self._parse_commit(res, rec["g"], rec["nb"], rec["h"], rec.get("x"), rec.get("s"),
                                            rec.get("k"), rec.get("hx"), replayed=True)
            except BaseException:  # e.g. rows it shared from a put whose record no unit kept: it did not happen
                self._abort(res)
                raise
            self._apply_commit(res, parsed, rec.get("user"))
        finally:
            if stand_ins is not None:
                self._forget(p, part, stand_ins)
        return True

    def _locate_copies(self, holders: dict[int, dict[int, list[Any]]], silent: Collection[int] = ()) -> int:
        """Each block's copies as the units listed them, and as its record placed them on a
        unit of ``silent`` (which did not answer: it may still hold them, and says so once
        it answers, :meth:`~rlplane_service.native.health.UnitHealth._adopt`); samples
        with a row on no unit are lost. Returns how many were."""
        gone = []
        self._unlisted = {}
        for b in list(self._block_units):
            where = holders.get(b, {})
            waiting = tuple(u for u in self._block_units[b] if u in silent and u not in where)
            if not where and not waiting:
                gone.append(b)
                continue
            self._block_units[b] = tuple(sorted(where)) + waiting
            for u in waiting:
                self._unlisted.setdefault(u, set()).add(b)
            fields = next(iter(where.values())) if where else []
            self._block_ext[b] = ({str(f): str(d) for f, d, _ in fields},
                                  {u: {str(f): int(s) for f, _, s in got} for u, got in where.items()})
        if not gone:
            return 0
        went = ", ".join(sorted({self.units[u][0] for b in gone for u in self._block_units[b]})) or "a storage unit"
        lost = self._lose_blocks(gone, went)
        log.error("rebuild: %d samples had rows in %d blocks no storage unit holds; they are lost", lost, len(gone))
        return lost


def _not_durable(g: _Staged, errors: dict[int, str]) -> E.UnavailableError | None:
    """A durable put whose bytes a unit did not get into its journal on disk: stored, not durable."""
    failed = [errors[u] for u in g.holders if u in errors] if g.durable else []
    if not failed:
        return None
    return E.UnavailableError(f"this durable put is stored but not on disk: {'; '.join(failed)}; put it again (the "
                              "same ids replace it) once the journal's disk is back", component="journal")


__all__ = ["RecoveryOps", "LOG_TIMEOUT_S", "INVENTORY_TIMEOUT_S", "COMPACT_EVERY_S"]
