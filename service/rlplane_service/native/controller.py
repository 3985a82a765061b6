"""The controller of the native engine: puts, reads, clears and listings over the index.

The index (:mod:`~rlplane_service.native.index`) holds, per partition, arrays over
slots; request values are checked by :mod:`~rlplane_service.native.requests` before use;
reads' pins live in :mod:`~rlplane_service.native.pins`; unit health, loss, re-replication
and the orphan sweep in :mod:`~rlplane_service.native.health`; claims in
:mod:`~rlplane_service.native.stream`.

A put is two-phase:

1. ``reserve``: the ids are checked and taken atomically (the controller serves one
   request at a time, so of concurrent puts of the same new ids exactly one wins; the
   others get DuplicateSampleError). The client places its rows itself (blocks with
   fresh random ids on units it picks) and sends the blocks to the units while the
   reservation is on its way, so a put costs two round trips, not three.
2. once the units and the controller have answered, ``commit``: the samples become
   visible. The commit carries each copy's extents as its unit sealed them, and its
   row sizes must add up to what the units stored. ``abort``, or a reservation that
   outlives its lease (the writer died), frees the ids and tells the units to drop the
   blocks: nothing of a failed put is visible.

Reads ``locate`` samples (which unit, block and row holds each requested field) and get
the tags back; clients then read the units directly: rows on a unit whose slab the
client mapped (same host) come with their slab addresses, and the client copies them
out itself; other rows it asks the unit for. Every locate pins the blocks it names, so
an extent is never reused under a read in flight. Blocks whose rows are all cleared are
freed on their units; rows cleared from a block that still holds live rows keep their
memory until the rest goes (``stats`` reports those bytes as ``retained_bytes``). A put
may place each block on ``replicas`` distinct units (RLPLANE_REPLICAS); reads go to the
first copy on a unit that is not suspect.

Every value a request carries is checked before use; handles (reservations, pins,
leases) are random; with tenants (``scopes``) every partition a request names is checked
against its user's prefixes. No request and no failure of a background loop stops the
controller: ``health()`` names a loop that died anyway.

Example::

    core = ControllerCore(units=[("unit-0", "tcp://127.0.0.1:5001")], secret=None)
    Server(core).start()
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlplane import errors as E
from rlplane.channel import ChannelPool
from rlplane.geometry import Geometry
from rlplane_service.ledger import Ledger
from rlplane.wire import int_array, ints
from rlplane_service.native.health import (CHECK_TIMEOUT_S, REPORT_TIMEOUT_S, SWEEP_EVERY_S, UNIT_GRACE_S,
                                           WATCH_EVERY_S, UnitHealth)
from rlplane_service.native.index import COMMITTED, FREE, RESERVED, Partition, Reservation, objects, rows_in
from rlplane_service.native.pins import MAX_PINS, PIN_LEASE_S, Pins
from rlplane_service.native.requests import (block_id_ok, blocks_of, digests, extents, field_names, partition_of,
                                             sample_ids)
from rlplane_service.native.stream import StreamOps
from rlplane_service.tenants import Access
from rlplane_service.native.unit import read_cap
from rlplane_service.native.unit import seal as unit_seal

log = logging.getLogger(__name__)



class ControllerCore(UnitHealth, StreamOps):
    """The index and its operations (called by :class:`~rlplane_service.native.server.Server`);
    streaming (claim/ack/nack/consumption) comes from :class:`StreamOps` over the same index."""

    def __init__(self, units: Sequence[tuple[str, str]], *, secret: bytes | None = None, capacity: int | None = None,
                 lease_s: float = 60.0, replicas: int = 1, claim_lease_s: float = 300.0,
                 pin_lease_s: float = PIN_LEASE_S, control: Sequence[str] | None = None,
                 control_secret: bytes | None = None, grace_s: float = UNIT_GRACE_S,
                 is_dead: Callable[[int], bool] | None = None,
                 scopes: Mapping[str, tuple[Sequence[str], bool]] | None = None) -> None:
        """``units``: (name, data endpoint) of each storage unit; ``control``: their control
        endpoints (served with ``control_secret``), where the controller sends what only it
        may (free, block copies); without them it uses the data endpoints. ``is_dead(u)``:
        True once unit ``u``'s process is known dead (see the module docstring). ``scopes``:
        tenants' engine users -> (partition-name prefixes, may write); every other user
        has full access."""
        self.units = list(units)
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
        self._cursor = 0
        self._lock = threading.RLock()
        self.ledger = Ledger(self._parts.get, lease_s=claim_lease_s)
        self._pool = ChannelPool(control_secret if control is not None else secret)
        self._frees: queue.Queue[tuple[int, list[int]] | None] = queue.Queue()
        self._stop = threading.Event()
        self._lost_units: dict[int, str] = {}  # unit index -> why it was declared lost
        self._suspect: dict[int, tuple[float, str]] = {}  # unit index -> (suspect since, why)
        self._lost_samples = 0
        self.loop_errors: dict[str, int] = {}  # background loop -> iterations that failed (and were survived)
        self.orphans_freed = 0  # blocks freed on units because nothing referred to them
        self._threads = [threading.Thread(target=self._run, args=(name, every, body), name=f"rlplane-{name}", daemon=True)
                         for name, every, body in (("reaper", 0.5, self._reap), ("free", 0.0, self._free_some),
                                                   ("watch", WATCH_EVERY_S, self._watch),
                                                   ("repair", WATCH_EVERY_S, self._repair_round),
                                                   ("sweep", SWEEP_EVERY_S, self._sweep))]
        for t in self._threads:
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
        copies of a block to write, and the reservation lease."""
        return {"units": [list(u) for u in self.units], "lease_s": self.lease_s, "replicas": self.replicas,
                "down": sorted(self._lost_units), "suspect": sorted(self._suspect)}, {}, []

    def op_unit_down(self, header: dict, columns: dict, extra: list) -> Any:
        """A client could not reach unit ``u``: ping it now (REPORT_TIMEOUT_S); if it does
        not answer it is suspect (never lost on a client's word, see the module docstring).
        Answers the lost units (``down``) and the suspect ones."""
        u = header.get("u")
        if not isinstance(u, int) or isinstance(u, bool) or not 0 <= u < len(self.units):
            raise E.WireFormatError(f"unit_down needs a unit index 'u' below {len(self.units)}")
        if u not in self._lost_units:
            try:
                self._ping(u, timeout=REPORT_TIMEOUT_S)
                self._answers(u)
            except E.RlplaneError as err:
                self._suspected(u, f"a client could not reach it, nor could the controller: {err}")
        return {"down": sorted(self._lost_units), "suspect": sorted(self._suspect)}, {}, []

    def op_reserve(self, header: dict, columns: dict, extra: list) -> Any:
        p, ids = partition_of(header), sample_ids(header.get("ids"))
        self._access(header, p, write=True)
        create, fields = header.get("create") is True, field_names(header.get("fields"))
        blocks = blocks_of(header.get("blocks"), len(ids), len(self.units))
        taken = [b for b, _, _, _ in blocks if b in self._block_units or self.pins.waiting(b)]
        if taken:  # checked before anything is taken, so a refused reserve holds nothing
            raise E.WireFormatError(f"block id(s) {taken[:3]} are already in use; a client must draw fresh ones")
        on_lost = sorted({u for _, units, _, _ in blocks for u in units} & self._lost_units.keys())
        if on_lost:
            name = self.units[on_lost[0]][0]
            raise E.UnavailableError(f"storage unit {name} is lost (place this put on the others)", component=name)
        with self._lock:
            part = self._parts.get(p)
            if create:
                held = part.ids.keys() & set(ids) if part is not None else set()
                if held:
                    taken = [s for s in ids if s in held]
                    pending = [s for s in taken if part.state[part.ids[s]] == RESERVED]
                    err = E.DuplicateSampleError(p, taken)
                    if pending:
                        err.args = (f"{err} ({len(pending)} of them are being written by another put right now)",)
                    raise err
                if self.capacity is not None and self._held() + len(ids) > self.capacity:
                    raise E.StorageFullError(
                        f"the store holds {self._held()} samples and its capacity is {self.capacity}; nothing of this "
                        "put was kept: clear consumed partitions or raise RLPLANE_CAPACITY")
                if part is None:
                    part = self._parts[p] = Partition()
                slots = part.take(ids)
            else:
                slots = self._slots(p, part, ids)
            for b, units, _, _ in blocks:
                self._block_units[b] = units
                self._block_refs[b] = 0
            res = Reservation(secrets.token_hex(12), p, part, slots, create, fields, blocks,  # type: ignore[arg-type]
                              time.monotonic() + self.lease_s)
            self._res[res.rid] = res
        return {"res": res.rid, "lease_s": self.lease_s}, {}, []

    def op_commit(self, header: dict, columns: dict, extra: list) -> Any:
        geoms, user, sizes, sums = header.get("g"), header.get("user"), header.get("nb"), header.get("h") or {}
        if not isinstance(geoms, dict) or not isinstance(sizes, dict) or not isinstance(sums, dict):
            raise E.WireFormatError("commit needs 'g' (geometry per field) and 'nb' (row bytes per field)")
        if user is not None and not (isinstance(user, list) and all(t is None or isinstance(t, dict) for t in user)):
            raise E.WireFormatError("commit 'user' must be one tag map per sample")
        rid = header.get("res")
        with self._lock:
            res = self._res.get(rid) if isinstance(rid, str) else None
            if res is not None:
                self._access(header, res.partition, write=True)
            if res is None:
                raise E.LeaseError("this put's reservation expired before it committed (the put took longer than "
                                   f"the service's lease of {self.lease_s:.0f} s, RLPLANE_PUT_LEASE_S); nothing was "
                                   "stored: retry it")
            n = res.slots.size
            if set(geoms) != set(res.fields) or set(sizes) != set(res.fields):
                raise E.WireFormatError("commit must describe exactly the reserved fields")
            if user is not None and len(user) != n:
                raise E.WireFormatError("commit 'user' needs one tag map per sample (or none)")
            part = res.part
            if self._parts.get(res.partition) is not part:
                self._abort(res)
                raise E.MissingDataError(res.partition, {}, hint="the partition was cleared while this write was in "
                                         "flight; nothing of the write was stored")
            if any(b not in self._block_units for b, _, _, _ in res.blocks):
                self._abort(res)
                raise E.UnavailableError("a storage unit holding this put's only copy was lost before the commit; "
                                         "nothing of the put was stored: retry it", component="storage unit")
            if not res.create and bool((part.state[res.slots] != COMMITTED).any()):
                self._abort(res)
                gone = part.names[res.slots[part.state[res.slots] != COMMITTED]].tolist()
                raise E.MissingDataError(res.partition, {s: [] for s in gone}, hint="cleared while this write was in flight")
            bid_of_row = np.empty(n, np.int64)
            row_in_block = np.empty(n, np.int64)
            for b, _, a, z in res.blocks:
                bid_of_row[a:z] = b
                row_in_block[a:z] = np.arange(z - a)
            shapes = {}
            for name in res.fields:
                g, nb = Geometry.from_wire(geoms[name], name), int_array(sizes[name], "row bytes")
                if len(g) != n or nb.size != n:
                    raise E.WireFormatError(f"commit describes {len(g)} rows of {n}", field=name)
                shapes[name] = g
                if name in sums and digests(sums[name], name).size != n:
                    raise E.WireFormatError(f"commit carries checksums for other than {n} rows", field=name)
                if bool((nb < 0).any()):
                    raise E.WireFormatError("row byte counts must not be negative", field=name)
            ext = extents(header.get("x"), res)
            if self.seal_key is not None:
                self._check_seals(header.get("xs"), res, ext, sizes)
            for name in res.fields:
                fi = part.field_index(name)
                self._release(fi.block[res.slots], fi.nbytes[res.slots])  # rows this write replaces
                nb = int_array(sizes[name])
                fi.block[res.slots] = bid_of_row
                fi.row[res.slots] = row_in_block
                within = np.zeros(n, np.int64)  # each row's byte offset in its block's extent
                for _, _, a, z in res.blocks:
                    np.cumsum(nb[a : z - 1], out=within[a + 1 : z])
                fi.off[res.slots] = within
                fi.nbytes[res.slots] = nb
                fi.set_geometry(res.slots, shapes[name])
                fi.sums[res.slots] = digests(sums[name], name) if name in sums else 0
                for b, _, a, z in res.blocks:
                    self._block_refs[b] = self._block_refs.get(b, 0) + (z - a)
                    live = int(nb[a:z].sum())
                    tot = self._block_bytes.setdefault(b, [0, 0])
                    tot[0] += live
                    tot[1] += live
            if res.create:
                part.user[res.slots] = objects(user) if user is not None else None  # type: ignore[arg-type]
                part.state[res.slots] = COMMITTED
            elif isinstance(user, list) and len(user) == n:  # user tags added by a later write
                for s, extra_tags in zip(res.slots.tolist(), user):
                    if isinstance(extra_tags, dict) and extra_tags:
                        part.user[s] = {**(part.user[s] or {}), **extra_tags}
            self._block_ext.update(ext)
            for b, _, _, _ in res.blocks:  # a block no field row points at (nothing to store) is dropped
                if self._block_refs.get(b, 0) == 0:
                    self._drop_blocks([b])
            del self._res[res.rid]
            self.ledger.touch(res.partition)  # parked claims on it may be ready now
        return {"committed": n}, {}, []

    def _check_seals(self, given: Any, res: Reservation, ext: dict[int, Any], sizes: dict[str, Any]) -> None:
        """Every copy of every block the commit names must come with its unit's seal of
        each field's extent (where, dtype, bytes, rows), and the commit's row sizes must add
        up to what the unit stored: a writer cannot point readers at bytes it was not given."""
        want = {(b, u) for b, units, _, _ in res.blocks for u in units}
        if not isinstance(given, list) or len(given) != len(want):
            raise E.WireFormatError("commit needs 'xs': each copy's extents as its storage unit sealed them")
        span = {b: (a, z) for b, _, a, z in res.blocks}
        nb = {f: int_array(sizes[f], "row bytes") for f in res.fields}
        seen = set()
        for entry in given:
            ok = (isinstance(entry, list) and len(entry) == 3 and (entry[0], entry[1]) in want
                  and isinstance(entry[2], dict) and set(entry[2]) == set(res.fields))
            if not ok:
                raise E.WireFormatError(f"bad sealed extent {str(entry)[:80]}")
            b, u, fields = entry
            seen.add((b, u))
            a, z = span[b]
            dtypes, where = ext.get(b, ({}, {}))
            for f, sealed in fields.items():
                start = where.get(u, {}).get(f)
                if not (isinstance(sealed, list) and len(sealed) == 4 and start is not None
                        and sealed[0] == dtypes.get(f) and isinstance(sealed[1], int) and isinstance(sealed[2], int)
                        and isinstance(sealed[3], str)):
                    raise E.WireFormatError(f"the extent of block {b} on {self.units[u][0]} is not as sealed", field=f)
                dtype, nbytes, rows, tag = sealed
                expect = unit_seal(self.seal_key, b, self.units[u][0], f, dtype, start, nbytes, rows)
                if not hmac.compare_digest(tag, expect):
                    raise E.WireFormatError(f"storage unit {self.units[u][0]} did not seal this extent of block {b}",
                                            field=f)
                if rows != z - a or nbytes != int(nb[f][a:z].sum()):
                    raise E.WireFormatError(f"the commit's row sizes of block {b} ({int(nb[f][a:z].sum())} bytes in "
                                            f"{z - a} rows) differ from what {self.units[u][0]} stored ({nbytes} in "
                                            f"{rows})", field=f)
        if seen != want:
            raise E.WireFormatError("commit 'xs' must seal every copy of every block once")

    def op_abort(self, header: dict, columns: dict, extra: list) -> Any:
        rid = header.get("res")
        with self._lock:
            res = self._res.get(rid) if isinstance(rid, str) else None
            if res is not None:
                self._access(header, res.partition, write=True)
                self._abort(res)
        return {"aborted": res is not None}, {}, []

    def op_discard(self, header: dict, columns: dict, extra: list) -> Any:
        """A writer whose reserve was refused asks for the blocks it sent to be freed:
        ``blocks`` = ``[[block id, [units]], ...]``. Only blocks the index does not know
        are freed (a block of a reservation or of a sample is never touched this way)."""
        given = header.get("blocks")
        if not isinstance(given, list) or len(given) > 4096:
            raise E.WireFormatError("discard needs 'blocks': [[block id, [units]], ...]")
        freed = 0
        with self._lock:
            for entry in given:
                if not (isinstance(entry, list) and len(entry) == 2 and block_id_ok(entry[0])
                        and isinstance(entry[1], list) and len(entry[1]) <= len(self.units)
                        and all(isinstance(u, int) and 0 <= u < len(self.units) for u in entry[1])):
                    raise E.WireFormatError(f"bad discard entry {str(entry)[:80]}")
                b = entry[0]
                if b in self._block_units or self.pins.waiting(b):
                    continue
                self._queue_frees(b, tuple(set(entry[1])))
                freed += 1
        return {"discarded": freed}, {}, []

    # -- reads ---------------------------------------------------------------------------
    def op_locate(self, header: dict, columns: dict, extra: list) -> Any:
        """Where every requested (sample, field) is: per unit, ``[field, blocks, rows,
        positions in the request]`` plus, for units in ``shm`` (slabs the client mapped),
        each row's slab address and the field's dtype. The blocks named are pinned
        (``pin`` in the answer) until the client unpins them or the pin's lease passes."""
        p, ids, fields = partition_of(header), sample_ids(header.get("ids"), unique=False), field_names(header.get("fields"))
        self._access(header, p, write=False)
        shm = header.get("shm") or []
        if not isinstance(shm, list) or len(shm) > len(self.units) or not all(isinstance(u, int) for u in shm):
            raise E.WireFormatError("'shm' must list unit indices")
        local = {u for u in shm if 0 <= u < len(self.units)}
        with self._lock:
            part = self._parts.get(p)
            slots = self._slots(p, part, ids)  # MissingDataError unless the partition holds them all
            part = self._parts[p]
            missing: dict[str, list[str]] = {}
            per_unit: dict[int, list[list[Any]]] = {}
            pinned: set[int] = set()
            geoms, sizes, digests = {}, {}, {}
            for name in fields:
                fi = part.fields.get(name)
                blk = fi.block[slots] if fi is not None else np.full(slots.size, -1, np.int64)
                lacking = np.flatnonzero(blk < 0)
                for i in lacking.tolist():
                    missing.setdefault(ids[i], []).append(name)
                if lacking.size or fi is None:
                    continue
                rows = fi.row[slots]
                uniq, which = np.unique(blk, return_inverse=True)
                pinned.update(uniq.tolist())
                first = [self._copy_for(b, local) for b in uniq.tolist()]
                unit_of = np.array(first, np.int64)[which]
                for u in np.unique(unit_of).tolist():
                    pos = np.flatnonzero(unit_of == u)
                    entry = [name, ints(blk[pos]), ints(rows[pos]), ints(pos)]
                    if u in local and self._extents_known(blk[pos], u):  # else the client reads them over ZMQ
                        entry += self._addresses(name, u, blk[pos], fi.off[slots[pos]])
                    per_unit.setdefault(u, []).append(entry)
                geoms[name] = fi.geometry(slots).to_wire()
                sizes[name] = ints(fi.nbytes[slots])
                digests[name] = fi.sums[slots].astype("<u8").tobytes()
            if missing:
                raise E.MissingDataError(p, missing)
            tagged = part.user[slots]
            user = tagged.tolist() if bool(np.not_equal(tagged, None).any()) else None  # None: no sample has tags
            pin = self.pins.pin(sorted(pinned)) if pinned else None
            caps = self._read_caps(per_unit)
        return {"units": [[u, entries] for u, entries in per_unit.items()], "user": user, "g": geoms, "nb": sizes,
                "h": digests, "pin": pin, "pin_lease_s": self.pin_lease_s, "caps": caps}, {}, []

    def _read_caps(self, per_unit: dict[int, list[list[Any]]]) -> list[list[Any]]:
        """Per unit ``[unit, [[block, capability], ...]]`` for every block a locate names there
        (a unit reads a block only for a holder of its capability); [] without a seal key."""
        if self.seal_key is None:
            return []
        out = []
        for u, entries in per_unit.items():
            blocks = np.unique(np.concatenate([int_array(e[1], "blocks") for e in entries]))
            out.append([u, [[b, read_cap(self.seal_key, b, self.units[u][0])] for b in blocks.tolist()]])
        return out

    def op_unpin(self, header: dict, columns: dict, extra: list) -> Any:
        """A read is done with the blocks its locate pinned (sent one-way)."""
        with self._lock:
            self.pins.unpin(header.get("pin"))
        return {}, {}, []

    def op_renew(self, header: dict, columns: dict, extra: list) -> Any:
        """Extend pins (a zero-copy read whose views are still alive); answers the ones that are gone."""
        pins = header.get("pins")
        if not isinstance(pins, list) or len(pins) > MAX_PINS:
            raise E.WireFormatError("renew needs 'pins': a list of pin ids")
        with self._lock:
            gone = self.pins.renew(pins)
        return {"gone": gone}, {}, []

    def _copy_for(self, b: int, local: set[int]) -> int:
        """The copy of block ``b`` a read uses: one on a unit the client mapped, if any; a
        copy on a suspect unit only when there is no other."""
        units = self._block_units[b]
        if self._suspect and len(units) > 1:
            units = tuple(u for u in units if u not in self._suspect) or units
        if local:
            for u in units:
                if u in local and u in self._block_ext.get(b, ({}, {}))[1]:
                    return u
        return units[0]

    def _extents_known(self, blocks: np.ndarray, u: int) -> bool:
        return all(u in self._block_ext.get(b, ({}, {}))[1] for b in np.unique(blocks).tolist())

    def _addresses(self, name: str, u: int, blocks: np.ndarray, off: np.ndarray) -> list[Any]:
        """``[slab address of each row, dtype]`` of field ``name``'s rows (in ``blocks``) on unit ``u``."""
        uniq, which = np.unique(blocks, return_inverse=True)
        bases = np.empty(uniq.size, np.int64)
        dtypes = set()
        for k, b in enumerate(uniq.tolist()):
            dt, where = self._block_ext.get(b, ({}, {}))
            start = where.get(u, {}).get(name)
            if start is None:
                raise E.MissingDataError("(locate)", {}, hint=f"the extent of field {name!r} of block {b} on "
                                         f"{self.units[u][0]} is not known (written by an older client?)")
            bases[k] = start
            dtypes.add(dt[name])
        if len(dtypes) > 1:
            raise E.ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
        return [ints(bases[which] + off), dtypes.pop()]

    # -- housekeeping --------------------------------------------------------------------
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
                slots = np.asarray([s for s in got if s >= 0], np.int64)
                slots = slots[part.state[slots] == COMMITTED] if slots.size else slots
            if ids is None:
                part.lost.clear()  # the partition is gone, and with it what it had lost
            self._forget(p, part, slots)
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
                "units": per_unit,
                "replicas": self.replicas,
                "lost_units": sorted(self.units[u][0] for u in self._lost_units),
                "suspect_units": sorted(self.units[u][0] for u in self._suspect),
                "orphan_blocks_freed": self.orphans_freed,
                "lost_samples": self._lost_samples,
                "under_replicated_samples": self._under_replicated(),
            }

    def _under_replicated(self) -> int:
        """Committed samples with a row in a block that has fewer live copies than RLPLANE_REPLICAS."""
        short = [b for b, units in self._block_units.items() if len(units) < self.replicas]
        if not short:
            return 0
        few = np.asarray(sorted(short), np.int64)
        return sum(int(rows_in(part, few).size) for part in self._parts.values())

    def _unit_usage(self, per_unit: dict[str, dict[str, int]]) -> None:
        """Add each unit's live bytes and the samples with a row there (vectorized per field)."""
        if not self._block_units:
            return
        bids = np.fromiter(self._block_units, np.int64, len(self._block_units))
        order = np.argsort(bids)
        bids = bids[order]
        lists = list(self._block_units.values())
        for r in range(self.replicas):
            unit_of = np.asarray([units[r] if r < len(units) else -1 for units in lists], np.int64)[order]
            for part in self._parts.values():
                live = part.state[: part.used] == COMMITTED
                seen = np.full((len(self.units), part.used), False)
                for fi in part.fields.values():
                    blk = fi.block[: part.used]
                    has = live & (blk >= 0)
                    if not has.any():
                        continue
                    u = unit_of[np.searchsorted(bids, blk[has])]
                    slots = np.flatnonzero(has)
                    ok = u >= 0
                    seen[u[ok], slots[ok]] = True
                    nb = np.bincount(u[ok], weights=fi.nbytes[: part.used][has][ok], minlength=len(self.units))
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
        for fi in part.fields.values():
            self._release(fi.block[slots], fi.nbytes[slots])
            fi.block[slots] = -1
            fi.forget(slots)
            fi.sums[slots] = 0
        part.state[slots] = FREE
        part.user[slots] = None
        for name in part.names[slots].tolist():
            del part.ids[name]
        part.names[slots] = None
        if not part.ids and not part.lost:
            del self._parts[p]

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

    def _release(self, blocks: np.ndarray, nbytes: np.ndarray) -> None:
        """Drop references from rows to blocks; free blocks nothing points at any more."""
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
        for b in bids:
            units = self._block_units.pop(b, ())
            self._block_refs.pop(b, None)
            self._block_bytes.pop(b, None)
            self._block_ext.pop(b, None)
            if not self.pins.defer(b, units):
                self._queue_frees(b, units)

    def _queue_frees(self, b: int, units: tuple[int, ...]) -> None:
        for u in units:
            if u not in self._lost_units:
                self._frees.put((u, [b]))

    def _abort(self, res: Reservation) -> None:
        self._res.pop(res.rid, None)
        part = res.part
        if res.create:
            part.state[res.slots] = FREE
            for name in part.names[res.slots].tolist():
                part.ids.pop(name, None)
            part.names[res.slots] = None
            if not part.ids and not part.lost and self._parts.get(res.partition) is part:
                del self._parts[res.partition]
        self._drop_blocks([b for b, _, _, _ in res.blocks])

    def _describe(self, name: str, part: Partition, *, with_ids: bool) -> dict[str, Any]:
        live = part.state[: part.used] == COMMITTED
        fields, nbytes = {}, 0
        for fname, fi in part.fields.items():
            has = live & (fi.block[: part.used] >= 0)
            count = int(has.sum())
            if count:
                fields[fname] = count
                nbytes += int(fi.nbytes[: part.used][has].sum())
        out = {"partition": name, "num_samples": int(live.sum()), "fields": fields, "nbytes": nbytes}
        if with_ids:
            out["sample_ids"] = part.names[: part.used][live].tolist()
        return out

    def _reap(self) -> None:
        """Abort reservations whose writer never committed (it died, or hangs)."""
        now = time.monotonic()
        with self._lock:
            for res in [r for r in self._res.values() if r.deadline < now]:
                log.warning("put into %r of %d samples never committed; its reservation lapsed",
                            res.partition, res.slots.size)
                self._abort(res)
            self.pins.expire(now)

    def _free_some(self) -> None:
        """Send the frees queued so far (waits up to half a second for one)."""
        try:
            item = self._frees.get(timeout=0.5)
        except queue.Empty:
            return
        if item is None:
            return
        u, bids = item
        name = self.units[u][0]
        try:
            self._pool.get(self._control[u], name).call({"op": "free", "b": ints(bids)}, timeout=10.0)
        except E.RlplaneError as err:
            log.warning("could not free %d blocks on %s: %s", len(bids), name, err)


def controller_actor_class() -> Any:
    """The Ray actor class of the controller (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class NativeControllerActor:
        """Hosts a :class:`ControllerCore` and its server thread."""

        def __init__(self, host: str | None, secret: str | None, units: list[tuple[str, str]], capacity: int | None,
                     lease_s: float, replicas: int, claim_lease_s: float = 300.0, control: list[str] | None = None,
                     control_secret: str | None = None, grace_s: float = UNIT_GRACE_S,
                     ports: Sequence[int] | None = None, tenants: dict[str, Any] | None = None) -> None:
            """``tenants``: engine user -> [secret, [prefixes, may write]] (rlplane_service.tenants)."""
            from rlplane_service.native.server import Server

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

            self._core = ControllerCore(units, secret=key, capacity=capacity, lease_s=lease_s, replicas=replicas,
                                        claim_lease_s=claim_lease_s, control=control,
                                        control_secret=control_secret.encode() if control_secret else None,
                                        grace_s=grace_s, is_dead=is_dead,
                                        scopes={user: tuple(scope) for user, (_, scope) in tenants.items()})
            bind = host or ray.util.get_node_ip_address()
            self._server = Server(self._core, host=bind, secret=key, name="controller",
                                  port=(int(ports[0]), int(ports[1])) if ports else 0,
                                  users={user: s.encode() for user, (s, _) in tenants.items()}).start()
            self._secret = secret

        def info(self) -> dict[str, Any]:
            return {"endpoint": self._server.endpoint, "secret": self._secret, "units": self._core.units}

        def stats(self) -> dict[str, Any]:
            return self._core.stats()

        def health(self) -> dict[str, Any]:
            """The server loop's and every background loop's state (see :meth:`ControllerCore.health`)."""
            return {"server": self._server.health(), **self._core.health()}

        def streams(self) -> dict[str, Any]:
            with self._core._lock:
                return self._core.ledger.snapshot()

    return NativeControllerActor


__all__ = ["ControllerCore", "controller_actor_class"]
