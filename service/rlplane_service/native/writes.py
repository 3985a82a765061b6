"""The native controller's write side: reserve, commit, abort, discard, and the reaper of
reservations whose writer went away.

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

A small put (at most PUT_MAX_BYTES of rows; the client sends those up to 256 KiB this
way) is one message instead, ``put``: reserve and commit at once, the rows in the
message; the controller hands them to the units of the put's one block with the put's
commit-log record (each stores them before it keeps the record), so the writer waits for
one round trip. A unit that cannot store them fails the put with its own error; the
units that kept the record forget it, the block is freed where it was stored.

:class:`WriteOps` is mixed into :class:`~rlplane_service.native.controller.ControllerCore`,
whose index, locks and block books it works on (see the attributes it declares).

Example::

    core.op_reserve({"p": "step-0", "ids": ["a"], "create": True, "fields": ["input_ids"], "blocks": []}, {}, [])
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlplane import errors as E
from rlplane.geometry import Geometry
from rlplane.names import MAX_NAME_LEN
from rlplane.tags import check_user_tags, extended_since, grown_evenly, left_out, older_meta, stale_meta
from rlplane.wire import int_array
from rlplane_service.native.held import MAX_HELD_KEYS, held_refs, lookup, parse_keys, parse_refs, register
from rlplane_service.native.index import (COMMITTED, FREE, RESERVED, Partition, Reservation, incarnation, objects,
                                          per_block)
from rlplane_service.native.logbook import LogBook
from rlplane_service.native.requests import (births, block_id_ok, blocks_of, digests, extents, field_names, partition_of,
                                             plain_int, sample_ids, shared_rows)
from rlplane_service.native.unit import seal as unit_seal

log = logging.getLogger(__name__)

#: How long a unit keeps the extents of an aborted put out of use where the writer's
#: one-sided (transfer engine) write into them failed: the writer's engine may still
#: deliver bytes there (the unit stalled and came back), which must not land in the rows
#: of a later put. Many times the engine's stall bound (rlplane.te.STALL_S).
LATE_FREE_S = 30.0
#: How long a unit keeps out of use the extents of a put the controller gave up on (its
#: reservation lapsed, or its blocks are orphans nothing refers to): its writer may only
#: be stalled (stopped, swapping) and copy into them when it wakes. A writer also stops
#: copying once most of its lease has passed (``rlplane.transports.native``).
LAPSED_FREE_S = 120.0
#: The most bytes of rows a put sent in one message (``put``) may carry: the controller
#: relays them to the units with the put's record; bigger puts go to the units directly.
PUT_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Parsed:
    """A commit's rows, checked: per field the geometry, row bytes and digests; ``run``: each
    field's running byte count over the rows; the block of each row and its block's first
    row; the extents of each copy (``ext``)."""

    shapes: dict[str, Geometry]
    row_bytes: dict[str, np.ndarray]
    row_sums: dict[str, np.ndarray | None]
    run: np.ndarray
    bid_of_row: np.ndarray
    first_row: np.ndarray
    ext: dict[int, Any]
    same: dict[str, np.ndarray]  # fields with rows stored once: per row -1, or the earlier row it repeats
    keys: dict[str, np.ndarray]  # fields whose rows have keys (rlplane_service.native.held): (n, 2) uint64
    held: dict[str, tuple[np.ndarray, np.ndarray]]  # fields with rows an earlier put stored: (rows, their refs)
    replayed: bool = False  # a rebuild's replay of its record: the rows it found stored are trusted (held_refs)

    @property
    def spans(self) -> dict[str, np.ndarray]:
        return {f: self.run[k] for k, f in enumerate(self.row_bytes)}


class WriteOps:
    """Reserve / commit / abort / discard over the controller's index (a mixin)."""

    _lock: threading.RLock
    _parts: dict[str, Partition]
    _res: dict[str, Reservation]
    _block_units: dict[int, tuple[int, ...]]
    _block_refs: dict[int, int]
    _block_bytes: dict[int, list[int]]
    _block_ext: dict[int, Any]
    _late: dict[int, dict[int, float]]
    units: list[tuple[str, str]]
    seal_key: bytes | None
    lease_s: float
    capacity: int | None
    book: LogBook

    def op_reserve(self, header: dict, columns: dict, extra: list) -> Any:
        res = self._reserve(header)
        return {"res": res.rid, "lease_s": self.lease_s}, {}, []

    def _reserve(self, header: dict, rid: str | None = None) -> Reservation:
        """The ids, fields and blocks of ``header`` checked and taken (see the module
        docstring); ``rid``: the reservation's id (default: a fresh one of this epoch)."""
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
            rid = rid or f"{self.epoch}.{secrets.token_hex(12)}"
            res = Reservation(rid, p, part, slots, create, fields, blocks,  # type: ignore[arg-type]
                              time.monotonic() + self.lease_s, ids=ids, born=incarnation(rid) if create else 0)
            self._res[res.rid] = res
        return res

    def op_held(self, header: dict, columns: dict, extra: list) -> Any:
        """Which rows of field ``f`` partition ``p`` holds under keys ``k`` (16 bytes each):
        ``x``, 5 int64 per key (:func:`rlplane_service.native.held.lookup`). None while the
        store journals (a journal record must replay on its own)."""
        p, name = partition_of(header), header.get("f")
        self._access(header, p, write=True)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise E.WireFormatError("'f' must be a field name")
        raw = header.get("k")
        if not isinstance(raw, bytes) or len(raw) % 16 or len(raw) > 16 * MAX_HELD_KEYS:
            raise E.WireFormatError(f"'k' must be 16 bytes per key, at most {MAX_HELD_KEYS} keys", field=name)
        keys = parse_keys(raw, len(raw) // 16, name)
        with self._lock:
            part = self._parts.get(p)
            if part is None or getattr(self, "journaling", False):
                refs = np.full((keys.shape[0], 5), -1, np.int64)
            else:
                refs = lookup(part, name, keys)
        return {"x": refs.astype("<i8").tobytes()}, {}, []

    def op_commit(self, header: dict, columns: dict, extra: list) -> Any:
        durable = _commit_header(header, getattr(self, "journaling", False))
        rid = header.get("res")
        # The lock is held from here until the index holds the put (``apply``, which the server
        # runs right after sending the answer, or before the next request of its batch):
        # nothing else sees the store in between.
        self._lock.acquire()
        try:
            res = self._res.get(rid) if isinstance(rid, str) else None
            if res is not None:
                self._access(header, res.partition, write=True)
            if res is None:
                done = self._done.get(rid) if isinstance(rid, str) else None
                if done is not None:  # a commit sent again (its answer was lost with a controller): it holds
                    self._lock.release()
                    return {"committed": done, "again": True, "bn": incarnation(rid)}, {}, []
                if isinstance(rid, str) and not rid.startswith(f"{self.epoch}."):
                    raise E.LeaseError("the controller restarted after this put reserved and before it committed; "
                                       "nothing of the put was stored: retry it")
                raise E.LeaseError("this put's reservation expired before it committed (the put took longer than "
                                   f"the service's lease of {self.lease_s:.0f} s, RLPLANE_PUT_LEASE_S); nothing was "
                                   "stored: retry it")
        except BaseException:
            self._lock.release()
            raise
        return self._commit(res, header, durable)

    def op_put(self, header: dict, columns: dict, extra: list) -> Any:
        """A small put in one message: reserve and commit at once (the header carries both
        requests' fields and ``put``, an id the writer drew), the rows in the message's
        columns, stored by the units of its one block with the put's commit-log record. A
        put sent again after a restart of the controller is answered as done when it was."""
        durable = _commit_header(header, getattr(self, "journaling", False))
        token = header.get("put")
        if not (isinstance(token, str) and 16 <= len(token) <= 64 and token.isascii() and token.isalnum()):
            raise E.WireFormatError("put needs 'put': an id the writer drew (16 to 64 letters and digits)")
        rid = f"i.{token}"
        with self._lock:
            done = self._done.get(rid)
        if done is not None:  # sent again: its first copy was committed (its answer lost with a controller)
            return {"committed": done, "again": True, "bn": incarnation(rid)}, {}, []
        size = sum(c.nbytes for c in columns.values())
        if size > PUT_MAX_BYTES:
            raise E.PayloadTooLargeError(f"a put in one message carries at most {PUT_MAX_BYTES} bytes of rows, got "
                                         f"{size}: reserve, write to the units and commit (the client does)")
        self._lock.acquire()  # held from the reserve to the index: nothing comes in between
        try:
            res = self._reserve(header, rid)
            if len(res.blocks) != 1 or set(columns) != set(res.fields) or any(
                    c.num_rows != res.slots.size for c in columns.values()):
                self._abort(res)
                raise E.WireFormatError("a put in one message carries every reserved field's rows, in one block")
        except BaseException:
            self._lock.release()
            raise
        bid = res.blocks[0][0]  # its dtypes as the record keeps them (a journal replays it by them); the extents
        header["x"] = [[bid, {f: c.dtype for f, c in columns.items()}, []]]  # are the units' answers (_commit)
        return self._commit(res, header, durable, columns)

    def _commit(self, res: Reservation, header: dict, durable: bool, rows: dict[str, Any] | None = None) -> Any:
        """Commit ``res`` as ``header`` describes it (the lock held: released when the
        answer's ``apply`` has run, or here on an error). ``rows``: the put's columns, sent
        with its commit-log record to the units of its block (see :meth:`op_put`)."""
        geoms, user, sizes, sums = header.get("g"), header.get("user"), header.get("nb"), header.get("h") or {}
        try:
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
                gone = [res.ids[i] for i in np.flatnonzero(part.state[res.slots] != COMMITTED).tolist()]
                raise E.MissingDataError(res.partition, {s: [] for s in gone}, hint="cleared while this write was in flight")
            parsed = self._parse_commit(res, geoms, sizes, sums, header.get("x"), header.get("s"), header.get("k"),
                                        header.get("hx"))
            self._check_born(res, births(header.get("bn"), n))
            if not res.create and header.get("t") is not None:
                if header.get("gr") is not None:
                    self._check_grown(res, parsed, header["t"], births(header["gr"], n, "gr"))
                    self._check_unreplaced(res, header.get("gs"))
                else:
                    self._check_aligned(res, parsed, header["t"])
            if rows is not None:  # the controller hands them to the units itself: no seals, sizes checked here
                _check_rows(res, rows, parsed.run)
            elif self.seal_key is not None:
                self._check_seals(header.get("xs"), res, parsed.ext, parsed.spans)
            stored = self._log_put(res, header, durable, rows)  # on the units before the answer: it outlives this process
            if rows is not None:
                bid = res.blocks[0][0]
                parsed = replace(parsed, ext={bid: (parsed.ext[bid][0], stored)})
        except BaseException:
            if rows is not None and self._res.get(res.rid) is res:  # a put in one message leaves nothing behind
                self._abort(res)  # (its block freed where it was stored)
            self._lock.release()
            raise

        def apply() -> None:
            try:
                if res.revoked:  # its record reached no unit (answered so): nothing of it is kept
                    self._abort(res)
                else:
                    self._apply_commit(res, parsed, user)
            finally:
                self._lock.release()

        # answered once checked; indexed right after. ``bn``: the incarnation the samples a
        # create made are (rlplane.tags.BORN_TAG), for their meta.
        return {"committed": n, **({"bn": res.born} if res.create and isinstance(res.born, int) else {})}, {}, [], apply

    def _check_born(self, res: Reservation, born: np.ndarray | None) -> None:
        """A create's ``born`` (from a snapshot: each sample's incarnation) is what its
        samples become; a write of stored samples whose meta names other incarnations than
        they are (cleared and put again since) is refused: MissingDataError naming them,
        nothing of it stored."""
        if born is None:
            return
        if res.create:
            res.born = born
            return
        bad = res.part.stale(res.slots, born)
        if bad.size:
            self._abort(res)
            raise stale_meta(res.partition, res.ids or res.part.names[res.slots].tolist(), bad, "write")

    def _check_grown(self, res: Reservation, c: Parsed, aligned: Any, read: np.ndarray | None) -> None:
        """An extend (``gr``: each sample's length as it read it) grows every token field of
        its samples together: one that leaves out a token field (of ``aligned``) a sample
        holds, e.g. one a stage wrote after the put whose meta the extend was given, that
        grows a sample another extend grew since it read it, or whose rows of one sample
        are of different lengths or shorter than it read, is a ShapeError naming the field
        and the first such sample, and nothing of it is stored."""
        _token_names(aligned)
        part, mine = res.part, set(res.fields)

        def sample(i: int) -> Any:
            return res.ids[i] if res.ids else part.names[res.slots[i]]

        try:
            grown_evenly({f: c.shapes[f].leads() for f in aligned if f in mine}, read, sample)
        except E.ShapeError:
            self._abort(res)
            raise

        for f in aligned:
            fi = part.fields.get(f)
            held = np.flatnonzero(fi.at("block", res.slots) >= 0) if fi is not None and f not in mine else ()
            if len(held):
                self._abort(res)
                raise left_out(f, sample(int(held[0])))
        if read is None:
            return
        refs = [f for f in aligned if f in part.fields]
        have, ref_of = _lengths(part, res.slots, refs)
        moved = np.flatnonzero((have >= 0) & (have != read))
        if moved.size:
            i = int(moved[0])
            self._abort(res)
            raise extended_since(refs[int(ref_of[i])], int(have[i]), int(read[i]), sample(i))

    def _check_unreplaced(self, res: Reservation, read: Any) -> None:
        """An extend's ``gs`` (per token field, the digests of the rows it read, uint64
        bytes): a row a write replaced since (its digest is another now) is a ShapeError
        naming the field and the sample, and nothing of the extend is stored (it would
        write back the rows it read, and the write would be lost without a word)."""
        if read is None:
            return
        n = res.slots.size
        if not isinstance(read, dict) or not set(read) <= set(res.fields) or \
                not all(isinstance(v, bytes) and len(v) == 8 * n for v in read.values()):
            self._abort(res)
            raise E.WireFormatError("an extend's 'gs' must map fields it extends to their rows' digests (uint64 bytes)")
        part = res.part
        for f, raw in read.items():
            fi = part.fields.get(f)
            if fi is None:
                continue
            moved = np.flatnonzero(fi.at("sums", res.slots) != np.frombuffer(raw, "<u8"))
            if moved.size:
                i = int(moved[0])
                self._abort(res)
                raise E.ShapeError("was written since this extend read it (a write_columns of the same sample in the "
                                   "meantime); nothing of the extend was stored: read the sample again and extend it",
                                   field=f, sample=res.ids[i] if res.ids else part.names[res.slots[i]])

    def _check_aligned(self, res: Reservation, c: Parsed, aligned: Any) -> None:
        """A write of existing samples whose token rows (``aligned``: the token-aligned field
        names) are not as long as the sample's stored token rows: ShapeError naming the field
        and the sample, and nothing of it is stored. A sample's length is set by its put and
        changed by extends only (which :meth:`_check_grown` checks instead); a write
        of another length comes from a meta older than the sample (extended, or cleared and
        put again since)."""
        _token_names(aligned)
        part, mine = res.part, set(aligned)
        refs = [f for f in aligned if f in part.fields]
        written = [f for f in res.fields if f in mine]
        if not refs or not written:
            return
        have, ref_of = _lengths(part, res.slots, refs)
        for f in written:
            new = c.shapes[f].leads()
            bad = np.flatnonzero((have >= 0) & (new != have))
            if bad.size:
                i = int(bad[0])
                self._abort(res)
                raise older_meta(f, int(new[i]), int(have[i]), refs[int(ref_of[i])], int(bad.size), res.slots.size,
                                 res.ids[i] if res.ids else None)

    def _parse_commit(self, res: Reservation, geoms: dict, sizes: dict, sums: dict, x: Any, same: Any = None,
                      keys: Any = None, held: Any = None, *, replayed: bool = False) -> Parsed:
        """A commit's rows checked against its reservation (a commit, or a record replayed).
        ``same``: per field whose rows repeat one another, each row's earlier twin (-1: none),
        as int64 bytes; such a row is stored empty and holds its twin's bytes. ``keys`` and
        ``held``: per field, its rows' keys and the rows whose bytes an earlier put of the
        partition stored (:mod:`rlplane_service.native.held`), stored empty too."""
        n = res.slots.size
        bid_of_row = np.empty(n, np.int64)
        first_row = np.empty(n, np.int64)  # the first row of each row's block
        for b, _, a, z in res.blocks:
            bid_of_row[a:z] = b
            first_row[a:z] = a
        shapes, row_bytes, row_sums = {}, {}, {}
        for name in res.fields:
            g, nb = Geometry.from_wire(geoms[name], name, rows=n), int_array(sizes[name], "row bytes")
            h = digests(sums[name], name) if name in sums else None
            if len(g) != n or nb.size != n:
                raise E.WireFormatError(f"commit describes {len(g)} rows of {n}", field=name)
            if h is not None and h.size != n:
                raise E.WireFormatError(f"commit carries checksums for other than {n} rows", field=name)
            if nb.size and int(nb.min()) < 0:
                raise E.WireFormatError("row byte counts must not be negative", field=name)
            shapes[name], row_bytes[name], row_sums[name] = g, nb, h
        twins = shared_rows(same, res.fields, n, row_bytes, row_sums)
        row_keys, kept = self._parse_held(res, keys, held, row_bytes, row_sums, twins, replayed)
        # Each field's running byte count as stored: a row's offset in its block's extent, a
        # block's bytes (a row that repeats another, or that an earlier put stored, is stored empty).
        run = np.zeros((len(res.fields), n + 1), np.int64)
        if n and res.fields:
            stored = []
            for f in res.fields:
                nb = np.where(twins[f] >= 0, 0, row_bytes[f]) if f in twins else row_bytes[f]
                if f in kept:
                    nb = nb.copy() if nb is row_bytes[f] else nb
                    nb[kept[f][0]] = 0
                stored.append(nb)
            np.cumsum(np.stack(stored), axis=1, out=run[:, 1:])
            if bool((run[:, 1:] < run[:, :-1]).any()):  # summed past int64 (rows of 2**63 bytes): never a real put's
                raise E.WireFormatError("the commit's row byte counts add up past 2**63")
        return Parsed(shapes, row_bytes, row_sums, run, bid_of_row, first_row, extents(x, res), twins, row_keys, kept,
                      replayed)

    def _parse_held(self, res: Reservation, keys: Any, held: Any, row_bytes: dict[str, np.ndarray],
                    row_sums: dict[str, np.ndarray | None], twins: dict[str, np.ndarray], replayed: bool = False
                    ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
        n = res.slots.size
        if keys is None and held is None:
            return {}, {}
        if not res.create:  # keys and held rows come with new samples only (a write over rows would drop what they point at)
            raise E.WireFormatError("commit 'k' and 'hx' are for a put of new samples (create)")
        if not isinstance(keys, dict) or not set(keys) <= set(res.fields) or \
                not (held is None or isinstance(held, dict) and set(held) <= set(keys)):
            raise E.WireFormatError("commit 'k' must map reserved fields to their rows' keys, and 'hx' fields of 'k' "
                                    "to the rows held already")
        out = {f: parse_keys(raw, n, f) for f, raw in keys.items()}
        kept = {}
        if held and getattr(self, "journaling", False):
            raise E.WireFormatError("this store journals its commits: every put stores its own rows (a journal "
                                    "record must replay on its own)")
        for f, raw in (held or {}).items():
            refs = parse_refs(raw, n, f)
            rows = held_refs(res.part, f, refs, out[f], row_bytes[f], row_sums[f], twins.get(f), live=not replayed)
            if rows.size:
                kept[f] = (rows, refs[rows])
        return out, kept

    def _apply_commit(self, res: Reservation, c: Parsed, user: Any) -> None:
        """Put a checked commit into the index (under the lock)."""
        part, n = res.part, res.slots.size
        if res.seq:  # what its commit-log entry keeps alive (rlplane_service.native.logbook; a writer sends
            # user tags only when some sample has one)
            self.book.put(res.seq, part, res.slots, [b for b, _, _, _ in res.blocks], pins=res.create or user is not None)
        row_in_block = np.arange(n, dtype=np.int64) - c.first_row
        refs: collections.Counter[int] = collections.Counter({b: (z - a) * len(res.fields) for b, _, a, z in res.blocks})
        going = []  # the rows this write replaces: released at once below
        revived = self._revived(c) if c.replayed and c.held else set()
        for k, name in enumerate(res.fields):
            fi = part.field_index(name)
            fi.cover(res.slots)
            going.append(self._release_rows(fi, res.slots))
            block, row, off = c.bid_of_row, row_in_block, c.run[k, :n] - c.run[k, c.first_row]
            same, kept = c.same.get(name), c.held.get(name)
            own = np.ones(n, bool)
            if kept is not None or same is not None:
                block, row, off = block.copy(), row.copy(), off.copy()
            if kept is not None:  # a row an earlier put stored points at those bytes
                rows, where = kept
                refs.subtract(block[rows].tolist())
                refs.update(where[:, 0].tolist())
                block[rows], row[rows], off[rows] = where[:, 0], where[:, 1], where[:, 2]
                heirs = _heirs_in(where, revived) if revived else None
                shared = rows if heirs is None else rows[~heirs]
                fi.dup[res.slots[shared]] = True
                fi.shares = True
                own[shared] = False
                self._shared_bytes += int(c.row_bytes[name][shared].sum())
                if heirs is not None and heirs.any():  # they hold those bytes now, as the heirs of the rows that did
                    for b, nb in zip(*per_block(where[heirs, 0], c.row_bytes[name][rows[heirs]])):
                        self._block_bytes[b][0] += nb
                        self._block_bytes[b][1] += nb
            if same is not None:  # a repeated row points at its twin's bytes, wherever they are stored
                dup = np.flatnonzero(same >= 0)
                moved, counts = np.unique(np.stack([block[dup], block[same[dup]]]), axis=1, return_counts=True)
                for (was, now), cnt in zip(moved.T.tolist(), counts.tolist()):
                    refs[was] -= cnt
                    refs[now] += cnt
                block[dup], row[dup], off[dup] = block[same[dup]], row[same[dup]], off[same[dup]]
                fi.dup[res.slots[dup]] = True
                fi.shares = True
                own[dup] = False
                self._shared_bytes += int(c.row_bytes[name][dup].sum())
            fi.block[res.slots] = block
            fi.row[res.slots] = row
            fi.off[res.slots] = off
            fi.nbytes[res.slots] = c.row_bytes[name]
            fi.set_geometry(res.slots, c.shapes[name])
            fi.sums[res.slots] = c.row_sums[name] if c.row_sums[name] is not None else 0
            if kept is not None:  # the digests the rows were stored with
                fi.sums[res.slots[kept[0]]] = kept[1][:, 4].view(np.uint64)
            register(part, name, res.slots, c.keys.get(name), own)
        self._release(going)
        mine = {b for b, _, _, _ in res.blocks}
        for b, cnt in refs.items():  # rows now pointing at blocks of earlier puts (checked live)
            if b not in mine and cnt:
                self._block_refs[b] += cnt
        for b, _, a, z in res.blocks:
            self._block_refs[b] = self._block_refs.get(b, 0) + refs[b]
            live = int((c.run[:, z] - c.run[:, a]).sum())
            tot = self._block_bytes.setdefault(b, [0, 0])
            tot[0] += live
            tot[1] += live
        if res.create:
            part.user[res.slots] = objects(user) if user is not None else None  # type: ignore[arg-type]
            part.born[res.slots] = res.born
            part.state[res.slots] = COMMITTED
        elif isinstance(user, list) and len(user) == n:  # user tags added by a later write
            for s, extra_tags in zip(res.slots.tolist(), user):
                if isinstance(extra_tags, dict) and extra_tags:
                    part.user[s] = {**(part.user[s] or {}), **extra_tags}
                    part.retagged[s] += 1  # the ledger reads them again (a partial rollout finished)
        self._block_ext.update(c.ext)
        for b, _, _, _ in res.blocks:  # a block no field row points at (nothing to store) is dropped
            if self._block_refs.get(b, 0) == 0:
                self._drop_blocks([b])
        self._res.pop(res.rid, None)
        self._committed(res.rid, n)
        self.ledger.touch(res.partition, res.slots)  # parked claims on it may be ready now

    def _revived(self, c: Parsed) -> set[int]:
        """Replaying: the blocks of rows the put found stored (every field's) that the replay
        had no row pointing at (it dropped them, or never saw them: the records of the rows
        that held them when it committed were forgotten from a compacted log; the units keep
        a block while a row points at it). Those are the index's again, their units taken
        from the units' inventory at the rebuild's end."""
        blocks = np.unique(np.concatenate([where[:, 0] for _, where in c.held.values()]))
        gone = {b for b in blocks.tolist() if b not in self._block_refs}
        for b in gone:
            self._block_units[b] = self.pins.revive(b) or ()
            self._block_refs[b] = 0
            self._block_bytes[b] = [0, 0]
        return gone

    def _check_seals(self, given: Any, res: Reservation, ext: dict[int, Any], run: dict[str, np.ndarray]) -> None:
        """Every copy of every block the commit names must come with its unit's seal of
        each field's extent (where, dtype, bytes, rows), and the commit's row sizes must add
        up to what the unit stored (``run``: each field's running byte count over the rows): a
        writer cannot point readers at bytes it was not given."""
        want = {(b, u) for b, units, _, _ in res.blocks for u in units}
        if not isinstance(given, list) or len(given) != len(want):
            raise E.WireFormatError("commit needs 'xs': each copy's extents as its storage unit sealed them")
        span = {b: (a, z) for b, _, a, z in res.blocks}
        seen = set()
        for entry in given:
            ok = (isinstance(entry, list) and len(entry) == 3 and plain_int(entry[0]) and plain_int(entry[1])
                  and (entry[0], entry[1]) in want and isinstance(entry[2], dict) and set(entry[2]) == set(res.fields))
            if not ok:
                raise E.WireFormatError(f"bad sealed extent {str(entry)[:80]}")
            b, u, fields = entry
            seen.add((b, u))
            a, z = span[b]
            dtypes, where = ext.get(b, ({}, {}))
            for f, sealed in fields.items():
                start = where.get(u, {}).get(f)
                if not (isinstance(sealed, list) and len(sealed) == 4 and start is not None
                        and sealed[0] == dtypes.get(f) and plain_int(sealed[1]) and plain_int(sealed[2])
                        and isinstance(sealed[3], str) and sealed[3].isascii()):  # compare_digest takes ASCII only
                    raise E.WireFormatError(f"the extent of block {b} on {self.units[u][0]} is not as sealed", field=f)
                dtype, nbytes, rows, tag = sealed
                expect = unit_seal(self.seal_key, b, self.units[u][0], f, dtype, start, nbytes, rows)
                if not hmac.compare_digest(tag, expect):
                    raise E.WireFormatError(f"storage unit {self.units[u][0]} did not seal this extent of block {b}",
                                            field=f)
                given_bytes = int(run[f][z] - run[f][a])
                if rows != z - a or nbytes != given_bytes:
                    raise E.WireFormatError(f"the commit's row sizes of block {b} ({given_bytes} bytes in "
                                            f"{z - a} rows) differ from what {self.units[u][0]} stored ({nbytes} in "
                                            f"{rows})", field=f)
        if seen != want:
            raise E.WireFormatError("commit 'xs' must seal every copy of every block once")

    def op_abort(self, header: dict, columns: dict, extra: list) -> Any:
        """The writer gives its reservation up: nothing of it is stored. ``late`` =
        ``[[block, unit], ...]``: copies whose one-sided write failed (see LATE_FREE_S)."""
        rid = header.get("res")
        late = self._late_copies(header)
        with self._lock:
            res = self._res.get(rid) if isinstance(rid, str) else None
            if res is not None:
                self._access(header, res.partition, write=True)
                for b, _, _, _ in res.blocks:
                    if b in late:
                        self._late[b] = dict.fromkeys(late[b], LATE_FREE_S)
                self._abort(res)
        return {"aborted": res is not None}, {}, []

    def _late_copies(self, header: dict) -> dict[int, set[int]]:
        """A writer's ``late`` (abort, discard: ``[[block, unit], ...]``), checked: block ->
        the units whose one-sided write of it failed."""
        late = header.get("late", [])
        if not isinstance(late, list) or len(late) > 4096 or not all(
                isinstance(e, list) and len(e) == 2 and block_id_ok(e[0]) and isinstance(e[1], int)
                and not isinstance(e[1], bool) and 0 <= e[1] < len(self.units) for e in late):
            raise E.WireFormatError("'late' must list [block id, unit index] pairs")
        out: dict[int, set[int]] = {}
        for b, u in late:
            out.setdefault(b, set()).add(u)
        return out

    def op_discard(self, header: dict, columns: dict, extra: list) -> Any:
        """A writer whose reserve was refused asks for the blocks it sent to be freed:
        ``blocks`` = ``[[block id, [units]], ...]``. Only blocks the index does not know
        are freed (a block of a reservation or of a sample is never touched this way)."""
        given = header.get("blocks")
        if not isinstance(given, list) or len(given) > 4096:
            raise E.WireFormatError("discard needs 'blocks': [[block id, [units]], ...]")
        late_of = self._late_copies(header)
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
                if b in late_of:
                    self._late[b] = dict.fromkeys(late_of[b], LATE_FREE_S)
                self._queue_frees(b, tuple(set(entry[1])))
                freed += 1
        return {"discarded": freed}, {}, []

    # -- reads ---------------------------------------------------------------------------

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
                self.ledger.forget(res.partition)
        self._drop_blocks([b for b, _, _, _ in res.blocks])

    def _reap(self) -> None:
        """Abort reservations whose writer never committed (it died, or hangs)."""
        now = time.monotonic()
        with self._lock:
            for res in [r for r in self._res.values() if r.deadline < now]:
                log.warning("put into %r of %d samples never committed; its reservation lapsed",
                            res.partition, res.slots.size)
                for b, units, _, _ in res.blocks:  # (its writer may only be stalled, and copy there yet)
                    self._late[b] = dict.fromkeys(units, LAPSED_FREE_S)
                self._abort(res)
            self.pins.expire(now)


def _lengths(part: Partition, slots: np.ndarray, refs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's length: the rows of the first of the token fields ``refs`` it holds (-1:
    none), and which of ``refs`` that is."""
    have, ref_of = np.full(slots.size, -1, np.int64), np.full(slots.size, -1, np.int64)
    for k, f in enumerate(refs):
        lead = part.leads(f, slots)
        fill = (have < 0) & (lead >= 0)
        have[fill], ref_of[fill] = lead[fill], k
    return have, ref_of


def _token_names(aligned: Any) -> None:
    """A commit's ``t`` checked: a list of at most 1024 field names."""
    if not isinstance(aligned, list) or not all(isinstance(f, str) for f in aligned) or len(aligned) > 1024:
        raise E.WireFormatError("commit 't' must list field names")


def _commit_header(header: dict, journaling: bool) -> bool:
    """A commit's description checked before anything is looked up; whether it is durable."""
    geoms, user, sizes, sums = header.get("g"), header.get("user"), header.get("nb"), header.get("h") or {}
    if not isinstance(geoms, dict) or not isinstance(sizes, dict) or not isinstance(sums, dict):
        raise E.WireFormatError("commit needs 'g' (geometry per field) and 'nb' (row bytes per field)")
    if user is not None and not (isinstance(user, list) and all(t is None or isinstance(t, dict) for t in user)):
        raise E.WireFormatError("commit 'user' must be one tag map per sample")
    for t in user or ():
        if t:  # nested at most 16 deep (a tag nested deep made every cut, so every snapshot, unanswerable); not
            check_user_tags(t, strict=False)  # strict: a restore or a journal brings back what an earlier release took
    durable = header.get("durable") is True
    if durable and not journaling:
        raise E.InvalidArgumentError("put_samples(..., durable=True) needs a journal: this store has none (start "
                                     "the service with RLPLANE_JOURNAL_DIR); nothing of the put was stored")
    return durable


def _check_rows(res: Reservation, rows: dict[str, Any], run: np.ndarray) -> None:
    """The rows a put sent in one message are as its header sizes them: each row's bytes
    as stored (``run``: each field's running count) are what its column holds."""
    for k, f in enumerate(res.fields):
        c = rows[f]
        if not np.array_equal(np.diff(c.offsets) * c.values.itemsize, np.diff(run[k])):
            raise E.WireFormatError("the put's rows differ from the sizes its header gives them", field=f)


def _heirs_in(where: np.ndarray, revived: set[int]) -> np.ndarray:
    """Of a field's rows found stored (``where``: their block, row, offset, ... refs), those
    that hold their bytes from now on: the first row of each stored row in a ``revived``
    block (a later row naming the same bytes shares them)."""
    heirs = np.isin(where[:, 0], list(revived))
    if heirs.any():
        _, first = np.unique(where[:, :3], axis=0, return_index=True)
        once = np.zeros(where.shape[0], bool)
        once[first] = True
        heirs &= once
    return heirs


__all__ = ["WriteOps", "PUT_MAX_BYTES"]

