"""Streaming operations served next to a store's index: claim, ack, nack, consumption.

:class:`StreamOps` is the request side of a :class:`rlplane_service.ledger.Ledger`; the native
controller mixes it in (its index is the ledger's), and :class:`LedgerCore` serves it
for the TransferQueue-based backends, whose writers ``record`` what they committed and
``drop`` what they cleared. A claim that has to wait is parked by the server (no
thread per waiter) and answered as soon as a commit makes it ready, or at its deadline.

Example::

    core = LedgerCore(lease_s=300)
    Server(core, secret=b"...").start()
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Mapping, NamedTuple

import numpy as np

from rlplane import errors as E
from rlplane.claims import MAX_WAIT_S, ClaimRequest
from rlplane_service.ledger import Ledger, SimpleIndexes
from rlplane.names import MAX_ID_LEN, check_partition, check_task
from rlplane.tags import WIRE_TAG
from rlplane_service.tenants import FULL, Access
from rlplane_service.native.server import Park


_NOTHING = np.empty(0, np.int64)


class _Hold(NamedTuple):
    """A put's reservation, or a write's or clear's hold, at the ledger (see LedgerCore)."""

    partition: str
    ids: list[str] | None  # None: the whole partition
    deadline: float  # it lapses then, unless its writer renews it
    kind: str  # put, write or clear


class StreamOps:
    """Ops over ``self.ledger``, each under ``self._lock``; every op on a partition is
    checked against the caller's scope (``scopes``: engine user -> its tenant's
    :class:`~rlplane_service.tenants.Access`; a user not in it has full access)."""

    ledger: Ledger
    _lock: threading.RLock
    restarts: int = 0
    scopes: Mapping[str, Access] = {}

    def _access(self, header: dict, partition: str, *, write: bool) -> None:
        """ForbiddenError unless the request's user may read (or ``write``) ``partition``."""
        self.scopes.get(header.get("_user"), FULL).check(partition, write=write)  # type: ignore[arg-type]

    def _sees(self, header: dict, partition: str) -> bool:
        return self.scopes.get(header.get("_user"), FULL).sees(partition)  # type: ignore[arg-type]

    def op_claim(self, header: dict, columns: dict, extra: list) -> Any:
        req = ClaimRequest.parse(header)
        self._access(header, req.partition, write=False)
        t0 = float(header.get("_t0") or time.monotonic())  # set by the server, never by a client
        final = bool(header.get("_final")) or req.wait_s <= 0
        # the native controller's, when it journals (the ledger names the expired samples only then)
        journal = getattr(self, "_log_expired", None) if getattr(self, "journaling", False) else None
        expired = (lambda ids: journal(req.partition, req.task, ids)) if journal is not None else None
        with self._lock:
            out = self.ledger.claim(req, final=final, expired=expired)
            if out is None:
                raise Park(t0 + min(req.wait_s, MAX_WAIT_S), key=req.partition)
            self.ledger.observe_wait(time.monotonic() - t0)
        return out, {}, []

    def unsent(self, answer: dict[str, Any], header: dict[str, Any]) -> None:
        """A claim's answer the server could not send (too big): its batch goes back to the
        task at once (the ledger leased it first; it stayed leased to nobody until the lease
        lapsed, minutes on)."""
        if header.get("op") == "claim" and type(answer.get("lease")) is int:
            with self._lock:
                self.ledger.nack(header["p"], header["task"], answer["lease"])

    def op_ack(self, header: dict, columns: dict, extra: list) -> Any:
        p, task, lease, ids = _lease_args(header)
        self._access(header, p, write=False)
        journal = getattr(self, "_log_ack", None)  # the native controller's (a journal, when it has one)
        with self._lock:
            before = (lambda got: journal(p, task, got)) if journal is not None else None
            return {"acked": self.ledger.ack(p, task, lease, ids, before=before)}, {}, []

    def op_nack(self, header: dict, columns: dict, extra: list) -> Any:
        p, task, lease, ids = _lease_args(header)
        self._access(header, p, write=False)
        with self._lock:
            return {"nacked": self.ledger.nack(p, task, lease, ids)}, {}, []

    def op_consumption(self, header: dict, columns: dict, extra: list) -> Any:
        p, task = header.get("p"), header.get("task")
        check_partition(p)
        check_task(task)
        self._access(header, p, write=False)  # type: ignore[arg-type]
        with self._lock:
            out = self.ledger.consumption(p, task)
        if self.restarts:  # claims, leases and acks before a rebuild are gone: every sample is pending again
            out["controller_restarts"] = self.restarts
        return out, {}, []

    def op_streams(self, header: dict, columns: dict, extra: list) -> Any:
        with self._lock:
            snap = self.ledger.snapshot()
        if self.scopes and header.get("_user") in self.scopes:
            snap = {**snap, "tasks": [t for t in snap.get("tasks", []) if self._sees(header, t["partition"])]}
        return snap, {}, []

    def wake(self) -> set[str]:
        """The partitions whose parked claims should look again (a commit, a nack, a lapsed
        lease there): only those are run again, so a flood of waiting claims costs nothing
        per commit elsewhere."""
        with self._lock:
            self.ledger.expire()
            return self.ledger.touched()


def _lease_args(header: dict) -> tuple[str, str, int, list[str] | None]:
    p, task, lease, ids = header.get("p"), header.get("task"), header.get("lease"), header.get("ids")
    if not (isinstance(p, str) and isinstance(task, str) and isinstance(lease, int) and not isinstance(lease, bool)
            and (ids is None or _strs(ids))):
        raise E.WireFormatError("ack/nack needs 'p', 'task', an int 'lease' and optionally 'ids'")
    return p, task, lease, ids


class LedgerCore(StreamOps):
    """A ledger with its own index, for stores without one to share (see the module docstring).

    It also arbitrates new ids for those stores, whose own check is check-then-create:
    a writer ``reserve`` s its ids first (of concurrent puts of the same new ids exactly one
    gets them; the others DuplicateSampleError), writes, then ``record`` s with the
    reservation; ``abort`` (or a reservation outliving ``put_lease_s`` without a ``renew``
    from its writer, which renews while it works) frees them.

    And it keeps writes and clears of the same samples apart (TransferQueue frees a
    cleared sample's storage slots for the next put of any partition: a write still
    under way into them landed in that put's rows). A write of stored samples and a clear
    ``hold`` their ids first (a whole-partition clear, the partition), a put's reservation
    counts as a hold of its ids, and a hold that overlaps a live one waits (parked, no
    thread) until that one is recorded, aborted, dropped or lapses; ``abort`` ends a hold
    too, and ``drop`` with the clear's hold.

    And it remembers what a dead storage unit took (``lose``): those samples leave the
    index, and ``lost`` tells a reader which unit they went with."""

    def __init__(self, *, lease_s: float = 300.0, put_lease_s: float = 60.0) -> None:
        self.indexes = SimpleIndexes()
        self.ledger = Ledger(self.indexes.get, lease_s=lease_s)
        self._lock = threading.RLock()
        self.put_lease_s = put_lease_s
        self._held: dict[str, _Hold] = {}  # reservation or hold -> what it holds
        # the clears parked until the holds they overlap end: (partition, arrival) -> (deadline, ids)
        self._clearing: dict[tuple[str, Any], tuple[float, list[str] | None]] = {}
        self.lost: dict[str, dict[str, str]] = {}  # partition -> {sample id: the storage unit it was lost with}
        self.lost_units: set[str] = set()
        self.lost_samples = 0  # since the store started, like the native controller's count

    def op_reserve(self, header: dict, columns: dict, extra: list) -> Any:
        p, ids = header.get("p"), header.get("ids")
        check_partition(p)
        if not _strs(ids) or len(set(ids)) != len(ids):
            raise E.WireFormatError("reserve needs 'p' and distinct 'ids'")
        with self._lock:
            now = self._lapse()
            index = self.indexes.get(p)
            stored = [s for s in ids if index is not None and s in index.slot]
            pending = {s for h in self._held.values() if h.partition == p and h.kind == "put" and h.ids
                       for s in h.ids} & set(ids)
            if stored or pending:
                err = E.DuplicateSampleError(p, stored + sorted(pending))
                if pending:
                    err.args = (f"{err} ({len(pending)} of them are being written by another put right now)",)
                raise err
            self._wait_for(header, p, ids, "put")
            rid = secrets.token_hex(12)
            self._held[rid] = _Hold(p, list(ids), now + self.put_lease_s, "put")
        return {"res": rid, "lease_s": self.put_lease_s}, {}, []

    def op_hold(self, header: dict, columns: dict, extra: list) -> Any:
        """Hold samples ``ids`` of ``p`` (None: the whole partition) for a ``write`` or a
        ``clear``: answered once no live put, write or clear holds any of them (see the
        class docstring), with ``res`` to end it by (record, abort, drop)."""
        p, ids, kind = header.get("p"), header.get("ids"), header.get("kind")
        check_partition(p)
        if kind not in ("write", "clear") or not (ids is None or _strs(ids)):
            raise E.WireFormatError("hold needs 'p', a kind ('write' or 'clear') and 'ids' (or none: the partition)")
        with self._lock:
            now = self._lapse()
            self._wait_for(header, p, ids, kind)
            rid = secrets.token_hex(12)
            self._held[rid] = _Hold(p, None if ids is None else list(ids), now + self.put_lease_s, kind)
        return {"res": rid, "lease_s": self.put_lease_s}, {}, []

    def op_renew(self, header: dict, columns: dict, extra: list) -> Any:
        """Extend a live put's reservation or hold by ``put_lease_s`` (its writer still
        works on it): ``renewed`` False when it lapsed already (or never was)."""
        with self._lock:
            now = self._lapse()
            rid = _res(header, "renew")
            held = self._held.get(rid)
            if held is not None:
                self._held[rid] = held._replace(deadline=now + self.put_lease_s)
        return {"renewed": held is not None}, {}, []

    def _lapse(self) -> float:
        """Drop the holds that outlived ``put_lease_s`` (their writer died or hung); the time now."""
        now = time.monotonic()
        for rid in [r for r, h in self._held.items() if h.deadline <= now]:
            self._release(self._held.pop(rid).partition)
        return now

    def _wait_for(self, header: dict, p: str, ids: list[str] | None, kind: str) -> None:
        """Park the request while a live hold overlaps ``ids`` of ``p`` (for a put: a clear's
        only; puts of the same new ids are told apart above), or, for a put or a write, while
        a clear of them waits (it comes first: it waits only for what was under way when it
        came, not for every put that keeps arriving); at its deadline, UnavailableError."""
        want = None if ids is None else set(ids)

        def overlaps(held: list[str] | None) -> bool:
            return held is None or want is None or not want.isdisjoint(held)

        now = time.monotonic()
        me = (p, header.get("_t0"))
        mine = self._clearing.pop(me, None)  # (this clear's own marker, from when it parked)
        for gone in [k for k, w in self._clearing.items() if w[0] <= now]:  # (their callers gave up)
            del self._clearing[gone]
            self._release(gone[0])
        busy = [h.kind for h in self._held.values() if h.partition == p and (kind != "put" or h.kind == "clear")
                and overlaps(h.ids)]
        if kind != "clear":
            busy += ["clear" for (q, _), (_, held) in self._clearing.items() if q == p and overlaps(held)]
        if not busy:
            return
        wait_s = min(float(self.put_lease_s), MAX_WAIT_S)
        deadline = float(header.get("_t0") or now) + wait_s
        if not header.get("_final"):
            if kind == "clear":
                self._clearing[me] = (deadline, ids)

                def not_parked() -> None:  # (the server refused to park it: nothing waits here)
                    with self._lock:
                        if self._clearing.pop(me, None) is not None:
                            self._release(p)

                raise Park(deadline, key=p, refused=not_parked)
            raise Park(deadline, key=p)
        if mine is not None:
            self._release(p)  # (what waited behind it goes on)
        what = "of the same samples" if ids is not None else "in it"
        raise E.UnavailableError(f"a {kind} of partition {p!r} waited {wait_s:.0f} s for a {busy[0]} {what} that is "
                                 "still under way; retry", component="ledger")

    def _release(self, p: str) -> None:
        """A hold on ``p`` ended: what waits on one there looks again (claims rescan nothing)."""
        self.ledger.touch(p, _NOTHING)

    def op_abort(self, header: dict, columns: dict, extra: list) -> Any:
        rid = _res(header, "abort")
        with self._lock:
            gone = self._held.pop(rid, None)
            if gone is not None:
                self._release(gone.partition)
        return {"aborted": gone is not None}, {}, []

    def op_record(self, header: dict, columns: dict, extra: list) -> Any:
        p, ids, fields, tags = header.get("p"), header.get("ids"), header.get("fields"), header.get("tags")
        if not (isinstance(p, str) and p and _strs(ids) and _strs(fields) and isinstance(tags, list)
                and len(tags) in (0, len(ids)) and all(isinstance(t, dict) and isinstance(t.get(WIRE_TAG, {}), dict)
                                                         for t in tags)):
            raise E.WireFormatError(f"record needs 'p', 'ids', 'fields' and one tag map per id (its {WIRE_TAG!r} a "
                                    "map of field to geometry)")
        rid = _res(header, "record")
        with self._lock:
            held = self._held.pop(rid, None)
            if held is not None:
                self._release(held.partition)
            if header.get("create"):
                if held is None or held.partition != p or held.ids != ids:  # lapsed: another put may hold the ids now
                    raise E.LeaseError(f"this put's reservation of its ids lapsed before it was recorded (it took "
                                       f"longer than {self.put_lease_s:.0f} s) or is another put's; the samples are "
                                       "not claimable: put them again")
                index = self.indexes.get(p)
                stored = [s for s in ids if index is not None and s in index.slot]
                if stored:
                    raise E.DuplicateSampleError(p, stored)
            self.indexes.record(p, ids, fields, tags, create=bool(header.get("create")))
            if header.get("create") and p in self.lost:
                for s in ids:  # written again: no longer lost
                    self.lost[p].pop(s, None)
            self.ledger.touch(p)
        return {}, {}, []

    def op_drop(self, header: dict, columns: dict, extra: list) -> Any:
        p, ids = header.get("p"), header.get("ids")
        if not isinstance(p, str) or not (ids is None or _strs(ids)):
            raise E.WireFormatError("drop needs 'p' and optionally 'ids'")
        rid = _res(header, "drop")
        with self._lock:
            if self._held.pop(rid, None) is not None:
                self._release(p)  # (the clear's hold ends with it)
            self.indexes.drop(p, ids, self.ledger)
            if p not in self.indexes:
                self.ledger.forget(p)
            if ids is None:
                self.lost.pop(p, None)
        return {}, {}, []

    def op_lose(self, header: dict, columns: dict, extra: list) -> Any:
        """Storage unit ``unit`` died with partition ``p``'s samples ``ids`` (their only copy)."""
        unit, p, ids = header.get("unit"), header.get("p"), header.get("ids") or []
        if not (isinstance(unit, str) and unit and _strs(ids) and (isinstance(p, str) or not ids)):
            raise E.WireFormatError("lose needs 'unit' and optionally 'p' and 'ids'")
        with self._lock:
            self.lost_units.add(unit)
            if ids:
                self.indexes.drop(p, ids, self.ledger)
                if p not in self.indexes:
                    self.ledger.forget(p)
                self.lost.setdefault(p, {}).update(dict.fromkeys(ids, unit))
                self.lost_samples += len(ids)
                self.ledger.touch(p)
        return {}, {}, []

    def op_lost(self, header: dict, columns: dict, extra: list) -> Any:
        """Which of ``ids`` in ``p`` were lost, with which unit: ``{"lost": {id: unit}}``."""
        p, ids = header.get("p"), header.get("ids")
        if not (isinstance(p, str) and _strs(ids)):
            raise E.WireFormatError("lost needs 'p' and 'ids'")
        with self._lock:
            known = self.lost.get(p, {})
            return {"lost": {s: known[s] for s in ids if s in known}}, {}, []

    def op_loss(self, header: dict, columns: dict, extra: list) -> Any:
        return self.loss(), {}, []

    def loss(self) -> dict[str, Any]:
        """``lost_samples`` (since the store started) and ``lost_units`` (declared dead)."""
        with self._lock:
            return {"lost_samples": self.lost_samples, "lost_units": sorted(self.lost_units)}

    def op_ping(self, header: dict, columns: dict, extra: list) -> Any:
        return {}, {}, []


def _res(header: dict, op: str) -> str | None:
    """The reservation or hold a request names (None: none), WireFormatError unless a string."""
    rid = header.get("res")
    if rid is not None and not isinstance(rid, str):
        raise E.WireFormatError(f"{op} names its reservation or hold by the string 'res' it was given, not a "
                                f"{type(rid).__name__}")
    return rid


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) and 0 < len(s) <= MAX_ID_LEN for s in x)


def stream_actor_class() -> Any:
    """The Ray actor class hosting a :class:`LedgerCore` and its server (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class StreamActor:
        def __init__(self, host: str | None, secret: str | None, lease_s: float, put_lease_s: float = 60.0) -> None:
            from rlplane_service.native.server import Server

            key = secret.encode() if secret else None
            self._core = LedgerCore(lease_s=lease_s, put_lease_s=put_lease_s)
            self._server = Server(self._core, host=host or ray.util.get_node_ip_address(), secret=key,
                                  name="ledger").start()
            self._secret = secret

        def info(self) -> dict[str, Any]:
            return {"endpoint": self._server.endpoint, "secret": self._secret}

        def streams(self) -> dict[str, Any]:
            with self._core._lock:
                return self._core.ledger.snapshot()

        def loss(self) -> dict[str, Any]:
            return self._core.loss()

    return StreamActor


__all__ = ["StreamOps", "LedgerCore", "stream_actor_class"]
