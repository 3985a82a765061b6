"""The controller's side of snapshots: a consistent cut of the whole store, and the
consumption a restore puts back (the snapshot itself is :mod:`rlplane.snapshot`).

A cut is taken under the controller's lock, which every commit, clear, claim and ack
also holds: so it sees each of them entirely or not at all. It answers, per partition,
where every committed sample's rows are (one locate per field, over the samples that
hold it) and, per task, each sample's consumption (a lease in flight comes back as
pending); every block it names is pinned by one pin, so a clear or an overwrite after
the cut frees nothing the snapshot still copies (the pin is renewed while it copies,
and released at the end). The lock is held for the index walk only (numpy over slots),
not while bytes move: writes and claims go on while the snapshot copies.

Example::

    cut = core.op_cut({}, {}, [])[0]    # {"pin": ..., "partitions": [{"p": ..., "ids": ..., "fields": {...}}]}
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from rlplane import errors as E
from rlplane_service.ledger import Ledger
from rlplane_service.native.index import COMMITTED, Partition
from rlplane_service.native.requests import partition_of, sample_ids

log = logging.getLogger(__name__)


#: Cuts a controller remembers: a snapshot reports the cut it was written from, and only
#: a cut handed out here (once each) truncates the journals.
CUTS_REMEMBERED = 16


class CutOps:
    """``cut`` and ``consumed`` over the controller's index and ledger (a mixin)."""

    _lock: threading.RLock
    _parts: dict[str, Partition]
    ledger: Ledger
    units: list[tuple[str, str]]

    def _init_cuts(self) -> None:
        self._cut_seqs: OrderedDict[int, None] = OrderedDict()  # the sequence numbers of recent cuts
        self._truncation = threading.Lock()  # held while the units truncate their journals

    def op_cut(self, header: dict, columns: dict, extra: list) -> Any:
        """A consistent cut of every partition (see the module docstring). ``shm``: the
        units whose slabs the caller mapped (as for ``locate``). Full access only."""
        self._full_only(header, "take a snapshot of the whole store")
        shm = header.get("shm") or []
        if not isinstance(shm, list) or not all(isinstance(u, int) for u in shm):
            raise E.WireFormatError("'shm' must list unit indices")
        local = {u for u in shm if 0 <= u < len(self.units)}
        out, pinned = [], set()
        self.settle()  # type: ignore[attr-defined]  # commits of this batch on the units first
        with self._lock:
            t0 = time.perf_counter()
            for p, part in sorted(self._parts.items()):
                slots = part.committed()
                if not slots.size:
                    continue
                ids = part.names[slots].tolist()
                fields = {}
                for name, fi in part.fields.items():
                    has = np.flatnonzero(fi.at("block", slots) >= 0)
                    if has.size:
                        fields[name] = {"at": has.astype("<i8").tobytes(),
                                        "loc": self._locate(p, part, slots[has], [ids[i] for i in has.tolist()],
                                                            [name], local, pinned, share=True)}
                tasks = {t: st.astype(np.int8).tobytes() for t, st in self.ledger.export(p, slots).items()}
                user = part.user[slots]
                out.append({"p": p, "ids": ids, "fields": fields, "tasks": tasks,
                            "user": user.tolist() if bool(np.not_equal(user, None).any()) else None,
                            "bn": part.born[slots].astype("<i8").tobytes()})  # metas from before still name them
            pin = self.pins.pin(sorted(pinned), mine=True) if pinned else None  # type: ignore[attr-defined]
            held_ms = (time.perf_counter() - t0) * 1e3
            seq = self._seq  # type: ignore[attr-defined]  # every change before it is in the cut, none after
            self._cut_seqs[seq] = None
            while len(self._cut_seqs) > CUTS_REMEMBERED:
                self._cut_seqs.popitem(last=False)
        return {"partitions": out, "pin": pin, "pin_lease_s": self.pin_lease_s,  # type: ignore[attr-defined]
                "held_ms": held_ms, "seq": seq}, {}, []

    def op_consumed(self, header: dict, columns: dict, extra: list) -> Any:
        """Set task ``task``'s consumption of samples ``ids`` of ``p`` to ``states`` (int8
        bytes, one per sample: 0 pending, 2 acked, 3 expired), as a snapshot kept it."""
        self._full_only(header, "set a task's consumption")
        p, ids, task = partition_of(header), sample_ids(header.get("ids")), header.get("task")
        if not isinstance(task, str) or not 0 < len(task) <= 200:
            raise E.WireFormatError("consumed needs 'task' (a name)")
        states = np.frombuffer(header.get("states") or b"", np.int8) if isinstance(header.get("states"), bytes) \
            else np.zeros(0, np.int8)
        if states.size != len(ids):
            raise E.WireFormatError(f"consumed needs one state per sample ({len(ids)}), got {states.size}")
        with self._lock:
            part = self._parts.get(p)
            slots = self._slots(p, part, ids)  # type: ignore[attr-defined]
            if bool((part.state[slots] != COMMITTED).any()):  # type: ignore[union-attr]
                raise E.MissingDataError(p, {}, hint="some samples are being written")
            self.ledger.load(p, task, slots, states)
        return {"set": len(ids)}, {}, []

    def op_snapshotted(self, header: dict, columns: dict, extra: list) -> Any:
        """A snapshot was written: its ``bytes`` (files), ``seconds`` and ``samples``, kept for
        ``stats()`` and /metrics (the last one's, whoever took it)."""
        self._full_only(header, "report a snapshot")
        got = {k: header.get(k) for k in ("bytes", "seconds", "samples")}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e18 for v in got.values()):
            raise E.WireFormatError("snapshotted needs 'bytes', 'seconds' and 'samples' (numbers)")
        with self._lock:
            self.last_snapshot = {"time": time.time(), **{k: float(v) for k, v in got.items()}}
        seq, path = header.get("seq"), header.get("path")
        with self._lock:  # a cut handed out here, reported once: nothing else truncates the journals
            known = type(seq) is int and seq in self._cut_seqs
            if known:
                del self._cut_seqs[seq]
        truncating = getattr(self, "journaling", False) and known and self._truncation.acquire(blocking=False)
        if truncating:  # off the serving thread: the units fsync and delete files
            threading.Thread(target=self._truncate_journals, args=(seq, str(path or "")[:4096]),
                             name="rlplane-journal-truncate", daemon=True).start()
        return {"truncating": truncating}, {}, []

    def _truncate_journals(self, below: int, path: str) -> int:
        """The snapshot ``path`` holds every change before ``below``: each unit drops its
        journal's older segments (a unit that does not answer keeps them: harmless). Runs
        holding ``_truncation`` (taken by its caller), and lets go of it at the end."""
        deleted = 0
        names = [name for name, _ in self.units]  # type: ignore[attr-defined]
        try:
            for u, name in enumerate(names):
                try:
                    ch = self._pool.get(self._control[u], name)  # type: ignore[attr-defined]
                    ask = {"op": "jtrunc", "below": below, "snapshot": path, "units": names}
                    deleted += int(ch.call(ask, timeout=30.0)[0]["deleted"])
                except Exception as err:  # noqa: BLE001 - a unit (or the store, stopping) that does not answer keeps its segments
                    log.warning("journal of %s not truncated after snapshot %s: %s", name, path, err)
        finally:
            self._truncation.release()
        log.info("journals truncated below change %d (snapshot %s): %d segment(s) deleted", below, path, deleted)
        return deleted

    def op_journal(self, header: dict, columns: dict, extra: list) -> Any:
        """A restore replays an old journal: ``pause`` (bool) keeps what it puts out of the
        units' journals, ``floor``: the next change's sequence number is at least this (the
        new journal continues the old one); ``base``: [a restored snapshot's cut, its path]
        the units record their journals continue (``based`` in the answer: False when a
        truncation is running; a request never waits for one). Answers the journal's state."""
        self._full_only(header, "steer the journal")
        floor, pause, base = header.get("floor"), header.get("pause"), header.get("base")
        if floor is not None and not (isinstance(floor, int) and not isinstance(floor, bool) and 0 < floor < 1 << 62):
            raise E.WireFormatError("journal 'floor' must be a sequence number")
        based = False
        if base is not None:
            if not (isinstance(base, list) and len(base) == 2 and type(base[0]) is int and 0 < base[0] < 1 << 62
                    and isinstance(base[1], str) and 0 < len(base[1]) <= 4096 and "\0" not in base[1]):
                raise E.WireFormatError("journal 'base' must be [a change number, a snapshot's path]")
            based = getattr(self, "journaling", False) and self._truncation.acquire(blocking=False)
            if based:  # off the serving thread, as a snapshot's truncation (which releases the lock)
                threading.Thread(target=self._truncate_journals, args=(base[0], base[1]),
                                 name="rlplane-journal-base", daemon=True).start()
        with self._lock:
            if floor is not None:
                self._seq = max(self._seq, floor)  # type: ignore[attr-defined]
            if isinstance(pause, bool):
                self.journal_paused = pause
            return {"journal": bool(getattr(self, "journaling", False)), "seq": self._seq,  # type: ignore[attr-defined]
                    "paused": bool(getattr(self, "journal_paused", False)), "based": based}, {}, []

    def snapshot_stats(self) -> dict[str, float]:
        """The last snapshot's unix time, file bytes, seconds and samples (zeros: none yet)."""
        last = getattr(self, "last_snapshot", None) or {}
        return {f"last_snapshot_{k}": float(last.get(k, 0.0)) for k in ("time", "bytes", "seconds", "samples")}

    def _full_only(self, header: dict, what: str) -> None:
        user = header.get("_user")
        if user in self.scopes:  # type: ignore[attr-defined]
            raise E.ForbiddenError(f"a tenant's credential ({user!r}) may not {what}")


__all__ = ["CutOps"]
