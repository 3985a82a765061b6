"""The controller of the native engine: the sample index, id reservation, placement.

Per partition the index is a set of arrays over *slots* (one slot per sample id):
its state (free / reserved / committed) and, per field, the block and row holding the
sample's bytes, the row's byte count and its wire geometry; plus the samples' user tags.
No per-sample Python object beyond the id map and the tags themselves.

A put is two-phase:

1. ``reserve``: the ids are checked and taken atomically (the controller serves one
   request at a time, so of concurrent puts of the same new ids exactly one wins; the
   others get DuplicateSampleError). The answer places the rows: blocks (fresh ids,
   never reused) on storage units.
   The client places its rows itself (blocks with fresh random ids on units it picks)
   and sends the blocks to the units while the reservation is on its way, so a put
   costs two round trips, not three.
2. once the units and the controller have answered, ``commit``: the samples become
   visible. ``abort``, or a reservation that outlives its lease (the writer died), frees
   the ids and tells the units to drop the blocks: nothing of a failed put is visible.

Reads ``locate`` samples (which unit, block and row holds each requested field) and get
the tags back; clients then read the units directly: rows on a unit whose slab the
client mapped (same host) come with their slab addresses, and the client copies them
out itself; other rows it asks the unit for. Every locate *pins* the blocks it names
until the client unpins them (a one-way message after its copy) or the pin's lease
passes (the reader died): a block whose last row was cleared while pinned is freed on
its unit only when its pins are gone, so the unit never reuses an extent a read may
still be copying (a zero-copy read renews its pin while the caller holds the views). Blocks whose rows are all cleared
are freed on their units; rows cleared from a block that still holds live rows keep
their memory until the rest goes (``stats`` reports those bytes as ``retained_bytes``).

Replicas and loss: a put may place each block on ``replicas`` distinct units
(RLPLANE_REPLICAS); reads go to the first live copy. The controller pings every unit
each second. A unit that misses a ping, whose connection drops, or that a client reports
unreachable is *suspect*: reads prefer its blocks' other copies and writers place
around it, but it keeps its data, and once it answers again it is a unit like the
others. It is *lost* only when the host says its process is dead (``is_dead``: the
service asks Ray whether the actor died) or it stayed suspect for ``grace_s``
(RLPLANE_UNIT_GRACE_S). A lost unit's blocks
keep their other copies (``under_replicated_samples`` counts what now has fewer than
``replicas``), and samples that had their only copy there leave the index (listings,
counts, claims) while a read of them raises MissingDataError naming the unit. The
controller then re-replicates: it copies each short block from a live copy to a live
unit that lacks it, so with R=2 and a spare unit the store survives the next loss too.

Every value a request carries is checked before use (names and ids bounded, ids and
fields unique, block ids fresh 63-bit ints, a commit only into the partition it
reserved in); handles (reservations, pins, leases) are random. No request and no
failure of a background loop stops the controller: ``health()`` names a loop that
died anyway.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlplane import errors as E
from rlplane.channel import ChannelPool
from rlplane.ledger import Ledger, grown
from rlplane.names import MAX_ID_LEN, MAX_NAME_LEN, check_partition
from rlplane.placement import spread
from rlplane.tags import WIRE_TAG
from rlplane.wire import int_array, ints
from rlplane_service.native.stream import StreamOps
from rlplane_service.native.unit import seal as unit_seal

log = logging.getLogger(__name__)

FREE, RESERVED, COMMITTED = 0, 1, 2
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
#: How long a read's pin holds its blocks without being renewed (longer than a read's
#: default deadline, so only a reader that died or hangs loses it).
PIN_LEASE_S = 120.0
#: Most pins held at once (a reader that never unpins cannot grow the controller without bound).
MAX_PINS = 1 << 16


def _rows_in(part: Partition, blocks: np.ndarray) -> np.ndarray:
    """Committed slots of ``part`` with a row of any field in one of ``blocks`` (sorted ids)."""
    hit = np.zeros(part.used, bool)
    for fi in part.fields.values():
        hit |= np.isin(fi.block[: part.used], blocks)
    return np.flatnonzero(hit & (part.state[: part.used] == COMMITTED))


def _digests(raw: Any, name: str) -> np.ndarray:
    """A commit's row checksums (little-endian uint64 bytes)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) % 8:
        raise E.WireFormatError("row checksums must be uint64 bytes", field=name)
    return np.frombuffer(raw, "<u8")


def _objects(items: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):  # numpy would turn lists of lists into a 2-D array
        out[i] = x
    return out


@dataclass
class FieldIndex:
    """Where one field of every slot lives."""

    block: np.ndarray
    row: np.ndarray
    nbytes: np.ndarray
    geom: np.ndarray
    sums: np.ndarray  # uint64 xxh3 digest of each row's bytes as the writer stored them (0: none recorded)
    off: np.ndarray  # byte offset of the row in its block's extent of this field

    @classmethod
    def empty(cls, cap: int) -> FieldIndex:
        return cls(np.full(cap, -1, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.empty(cap, object),
                   np.zeros(cap, np.uint64), np.zeros(cap, np.int64))

    def grow(self, cap: int) -> None:
        for name, fill in (("block", -1), ("row", 0), ("nbytes", 0), ("geom", None), ("sums", 0), ("off", 0)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype) if fill is not None else np.empty(cap, dtype=object)
            new[: old.size] = old
            setattr(self, name, new)


@dataclass
class Partition:
    """The index of one partition (see the module docstring)."""

    ids: dict[str, int] = field(default_factory=dict)
    names: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    user: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    fields: dict[str, FieldIndex] = field(default_factory=dict)
    used: int = 0  # slots handed out so far
    lost: dict[str, str] = field(default_factory=dict)  # sample id -> the storage unit it was lost with

    def take(self, ids: list[str]) -> np.ndarray:
        n = len(ids)
        need = self.used + n
        if need > self.state.size:
            cap = max(need, 2 * self.state.size, 64)
            self.names = grown(self.names, cap)
            self.state = grown(self.state, cap)
            self.user = grown(self.user, cap)
            for fi in self.fields.values():
                fi.grow(cap)
        slots = np.arange(self.used, need, dtype=np.int64)
        self.names[self.used : need] = _objects(ids)
        self.state[self.used : need] = RESERVED
        self.ids.update(zip(ids, range(self.used, need)))
        self.used = need
        return slots

    def field_index(self, name: str) -> FieldIndex:
        fi = self.fields.get(name)
        if fi is None:
            fi = self.fields[name] = FieldIndex.empty(self.state.size)
        return fi

    def committed(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self.used] == COMMITTED)

    # -- the ledger's view (rlplane.ledger.Index) -----------------------------------------
    def live(self) -> np.ndarray:
        return self.state[: self.used] == COMMITTED

    def has(self, name: str) -> np.ndarray:
        fi = self.fields.get(name)
        return fi.block[: self.used] >= 0 if fi is not None else np.zeros(self.used, bool)

    def field_names(self) -> list[str]:
        return list(self.fields)

    def ids_of(self, slots: np.ndarray) -> list[str]:
        return self.names[slots].tolist()

    def tags_of(self, slots: np.ndarray) -> list[dict[str, Any]]:
        geoms = {name: (fi.block[slots] >= 0, fi.geom[slots].tolist()) for name, fi in self.fields.items()}
        return [{**(u or {}), WIRE_TAG: {f: g[i] for f, (has, g) in geoms.items() if has[i]}}
                for i, u in enumerate(self.user[slots].tolist())]


@dataclass
class Reservation:
    rid: str
    partition: str
    part: Partition  # the partition it reserved in (one cleared and made again meanwhile is another)
    slots: np.ndarray
    create: bool
    fields: list[str]
    blocks: list[tuple[int, tuple[int, ...], int, int]]  # (block id, units, first row, end row)
    deadline: float


class ControllerCore(StreamOps):
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
        self.scopes = {user: (tuple(prefixes), bool(write)) for user, (prefixes, write) in (scopes or {}).items()}
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
        self._pins: dict[str, tuple[list[int], float]] = {}  # pin id -> (blocks, lease deadline)
        self._pinned: dict[int, int] = {}  # block -> pins holding it
        self._deferred: dict[int, tuple[int, ...]] = {}  # unreferenced pinned block -> units to free it on
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
        p, ids = _partition(header), _ids(header.get("ids"))
        self._access(header, p, write=True)
        create, fields = header.get("create") is True, _fields(header.get("fields"))
        blocks = self._blocks_of(header.get("blocks"), len(ids))
        taken = [b for b, _, _, _ in blocks if b in self._block_units or b in self._deferred]
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
            if res.create and (not isinstance(user, list) or len(user) != n):
                raise E.WireFormatError("commit of new samples needs 'user': one tag map per sample")
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
            for name in res.fields:
                g, nb = geoms[name], int_array(sizes[name], "row bytes")
                if not isinstance(g, list) or len(g) != n or nb.size != n:
                    raise E.WireFormatError(f"commit describes {len(g) if isinstance(g, list) else '?'} rows of {n}", field=name)
                if name in sums and _digests(sums[name], name).size != n:
                    raise E.WireFormatError(f"commit carries checksums for other than {n} rows", field=name)
                if bool((nb < 0).any()):
                    raise E.WireFormatError("row byte counts must not be negative", field=name)
            ext = _extents(header.get("x"), res)
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
                fi.geom[res.slots] = _objects(geoms[name])
                fi.sums[res.slots] = _digests(sums[name], name) if name in sums else 0
                for b, _, a, z in res.blocks:
                    self._block_refs[b] = self._block_refs.get(b, 0) + (z - a)
                    live = int(nb[a:z].sum())
                    tot = self._block_bytes.setdefault(b, [0, 0])
                    tot[0] += live
                    tot[1] += live
            if res.create:
                part.user[res.slots] = _objects(user)  # type: ignore[arg-type]
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
            self.ledger.dirty = True  # parked claims may be ready now
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
                if not (isinstance(entry, list) and len(entry) == 2 and _block_id_ok(entry[0])
                        and isinstance(entry[1], list) and len(entry[1]) <= len(self.units)
                        and all(isinstance(u, int) and 0 <= u < len(self.units) for u in entry[1])):
                    raise E.WireFormatError(f"bad discard entry {str(entry)[:80]}")
                b = entry[0]
                if b in self._block_units or b in self._deferred:
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
        p, ids, fields = _partition(header), _ids(header.get("ids"), unique=False), _fields(header.get("fields"))
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
                geoms[name] = fi.geom[slots].tolist()
                sizes[name] = ints(fi.nbytes[slots])
                digests[name] = fi.sums[slots].astype("<u8").tobytes()
            if missing:
                raise E.MissingDataError(p, missing)
            user = part.user[slots].tolist()
            pin = self._pin(sorted(pinned)) if pinned else None
        return {"units": [[u, entries] for u, entries in per_unit.items()], "user": user, "g": geoms, "nb": sizes,
                "h": digests, "pin": pin, "pin_lease_s": self.pin_lease_s}, {}, []

    def op_unpin(self, header: dict, columns: dict, extra: list) -> Any:
        """A read is done with the blocks its locate pinned (sent one-way)."""
        with self._lock:
            self._unpin(header.get("pin"))
        return {}, {}, []

    def op_renew(self, header: dict, columns: dict, extra: list) -> Any:
        """Extend pins (a zero-copy read whose views are still alive); answers the ones that are gone."""
        pins = header.get("pins")
        if not isinstance(pins, list) or len(pins) > MAX_PINS:
            raise E.WireFormatError("renew needs 'pins': a list of pin ids")
        gone = []
        with self._lock:
            deadline = time.monotonic() + self.pin_lease_s
            for pin in pins:
                held = self._pins.get(pin) if isinstance(pin, str) else None
                if held is None:
                    gone.append(pin)
                else:
                    self._pins[pin] = (held[0], deadline)
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

    def _pin(self, blocks: list[int]) -> str:
        if len(self._pins) >= MAX_PINS:
            self._expire_pins(time.monotonic(), oldest=len(self._pins) - MAX_PINS + 1)
        pin = secrets.token_hex(12)
        self._pins[pin] = (blocks, time.monotonic() + self.pin_lease_s)
        for b in blocks:
            self._pinned[b] = self._pinned.get(b, 0) + 1
        return pin

    def _unpin(self, pin: Any) -> None:
        held = self._pins.pop(pin, None) if isinstance(pin, str) else None
        if held is None:
            return
        free = []
        for b in held[0]:
            left = self._pinned.get(b, 0) - 1
            if left > 0:
                self._pinned[b] = left
                continue
            self._pinned.pop(b, None)
            if b in self._deferred:
                free.append(b)
        for b in free:
            self._queue_frees(b, self._deferred.pop(b))

    def _expire_pins(self, now: float, oldest: int = 0) -> None:
        """Drop pins whose lease passed (and, to make room, the ``oldest`` others)."""
        late = [pin for pin, (_, deadline) in self._pins.items() if deadline < now]
        if oldest:
            late += sorted((p for p in self._pins if p not in late), key=lambda p: self._pins[p][1])[:oldest]
        for pin in late:
            log.warning("a read's pin lapsed without an unpin (the reader died or hangs); its blocks may be freed")
            self._unpin(pin)

    # -- housekeeping --------------------------------------------------------------------
    def op_clear(self, header: dict, columns: dict, extra: list) -> Any:
        p = _partition(header)
        self._access(header, p, write=True)
        ids = header.get("ids")
        if ids is not None:
            ids = _ids(ids, unique=False)
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
        p = _partition(header)
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
                "pins": len(self._pins),
                "pinned_unreferenced_blocks": len(self._deferred),
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
        return sum(int(_rows_in(part, few).size) for part in self._parts.values())

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
            fi.geom[slots] = None
            fi.sums[slots] = 0
        part.state[slots] = FREE
        part.user[slots] = None
        for name in part.names[slots].tolist():
            del part.ids[name]
        part.names[slots] = None
        if not part.ids and not part.lost:
            del self._parts[p]

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
            gone = []
            for b, units in list(self._block_units.items()):
                if u in units:
                    rest = tuple(x for x in units if x != u)
                    self._block_ext.get(b, ({}, {}))[1].pop(u, None)
                    if rest:
                        self._block_units[b] = rest
                    else:
                        gone.append(b)
            lost = 0
            if gone:
                dead = np.asarray(sorted(gone), np.int64)
                for p, part in list(self._parts.items()):
                    slots = _rows_in(part, dead)
                    if slots.size:
                        part.lost.update(dict.fromkeys(part.names[slots].tolist(), name))
                        self._forget(p, part, slots)
                        lost += int(slots.size)
                for b in gone:  # nothing to free on a dead unit
                    self._block_units.pop(b, None)
                    self._block_refs.pop(b, None)
                    self._block_bytes.pop(b, None)
                    self._block_ext.pop(b, None)
            self._lost_samples += lost
            self.ledger.dirty = True
        log.error("storage unit %s is lost (%s): %d samples lost with it, %d blocks keep a copy elsewhere",
                  name, why, lost, sum(1 for units in self._block_units.values() if len(units) < self.replicas))

    def _watch(self) -> None:
        """One round of pings: a unit that answers is well; one that does not is suspect,
        and lost once ``is_dead`` says so or it stayed suspect for ``grace_s``."""
        for u in range(len(self.units)):
            if u in self._lost_units or self._stop.is_set():
                continue
            try:
                self._ping(u)
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
            self._unit_slabs[u] = reply["slab"]

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
        """Free the blocks units hold that the index does not know and that are older than
        any put still in flight could be (twice the put lease, plus a margin)."""
        age = max(0.0, 2 * self.lease_s + ORPHAN_MARGIN_S)
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
                orphans = [b for b in old.tolist() if b not in self._block_units and b not in self._deferred]
            if orphans:
                log.warning("freeing %d blocks on %s that no sample or put refers to (a writer died mid-put?)",
                            len(orphans), name)
                self._frees.put((u, orphans))
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
            pin = self._pin([b])  # the source's extents stay put while they are copied
        where = None
        try:
            _, columns, _ = self._pool.get(src_at, src).call({"op": "block", "b": b}, timeout=REPAIR_TIMEOUT_S)
            try:
                reply = self._pool.get(dst_at, dst).call({"op": "write", "b": b}, columns, timeout=REPAIR_TIMEOUT_S)[0]
                where = reply.get("x")
            except E.WireFormatError as err:
                if "already stored" not in str(err):  # else an earlier copy's reply was lost: the block is there
                    raise
        except E.MissingDataError:
            return True  # freed while this ran
        except E.RlplaneError as err:
            log.warning("could not copy block %d from %s to %s: %s", b, src, dst, err)
            return False
        finally:
            with self._lock:
                self._unpin(pin)
        with self._lock:
            units = self._block_units.get(b)
            kept = units is not None and target not in units and target not in self._lost_units
            if kept:
                self._block_units[b] = units + (target,)
                if isinstance(where, dict) and b in self._block_ext:
                    self._block_ext[b][1][target] = {str(k): int(v) for k, v in where.items()}
        if not kept:  # cleared meanwhile: the copy is garbage
            self._frees.put((target, [b]))
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

    def _blocks_of(self, given: Any, n: int) -> list[tuple[int, tuple[int, ...], int, int]]:
        """The blocks a put announces: ``[[block id, [units], first row, end row], ...]``
        covering rows ``0..n`` in order, on distinct existing units, with fresh ids."""
        if not isinstance(given, list):
            raise E.WireFormatError("reserve needs 'blocks': [[block id, [units], first row, end row], ...]")
        out, at = [], 0
        for entry in given:
            ok = (isinstance(entry, list) and len(entry) == 4 and _block_id_ok(entry[0])
                  and isinstance(entry[1], list) and entry[1] and len(set(entry[1])) == len(entry[1])
                  and all(isinstance(u, int) and 0 <= u < len(self.units) for u in entry[1])
                  and entry[2] == at and isinstance(entry[3], int) and entry[3] > at)
            if not ok:
                raise E.WireFormatError(f"bad block entry {entry!r} (rows must follow on from {at})")
            out.append((entry[0], tuple(entry[1]), entry[2], entry[3]))
            at = entry[3]
        if at != n and not (n == 0 and not out):
            raise E.WireFormatError(f"the blocks cover {at} of {n} rows")
        if len({b for b, _, _, _ in out}) != len(out):
            raise E.WireFormatError("a put names the same block id twice")
        return out

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
            if self._pinned.get(b):
                self._deferred[b] = units
            else:
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
            self._expire_pins(now)

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


def _extents(given: Any, res: Reservation) -> dict[int, tuple[dict[str, str], dict[int, dict[str, int]]]]:
    """A commit's ``x``: ``[[block, {field: dtype}, [[unit, {field: slab offset}], ...]], ...]``
    for the reservation's blocks (copies on units the reservation placed them on)."""
    if given is None:
        return {}
    placed = {b: set(units) for b, units, _, _ in res.blocks}
    if not isinstance(given, list) or len(given) > len(placed):
        raise E.WireFormatError("commit 'x' must list the extents of the reserved blocks")
    out = {}
    for entry in given:
        ok = (isinstance(entry, list) and len(entry) == 3 and entry[0] in placed and isinstance(entry[1], dict)
              and isinstance(entry[2], list))
        if not ok:
            raise E.WireFormatError(f"bad extent entry {str(entry)[:80]}")
        b, dtypes, copies = entry
        if not set(dtypes) <= set(res.fields) or not all(isinstance(d, str) for d in dtypes.values()):
            raise E.WireFormatError("extent dtypes must name reserved fields")
        where: dict[int, dict[str, int]] = {}
        for copy in copies:
            if not (isinstance(copy, list) and len(copy) == 2 and copy[0] in placed[b] and isinstance(copy[1], dict)
                    and set(copy[1]) == set(dtypes)
                    and all(isinstance(v, int) and v >= 0 for v in copy[1].values())):
                raise E.WireFormatError(f"bad extent copy {str(copy)[:80]} of block {b}")
            where[copy[0]] = dict(copy[1])
        out[b] = (dict(dtypes), where)
    return out


def _partition(header: dict) -> str:
    p = header.get("p")
    check_partition(p)
    return p  # type: ignore[return-value]


def _ids(x: Any, *, unique: bool = True) -> list[str]:
    """Sample ids from a request: strings of 1-MAX_ID_LEN characters (``unique``: no repeats)."""
    if not isinstance(x, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_ID_LEN for s in x):
        raise E.WireFormatError(f"'ids' must be a list of sample ids (strings of 1-{MAX_ID_LEN} characters)")
    if unique and len(set(x)) != len(x):
        seen: set[str] = set()
        twice = [s for s in x if s in seen or seen.add(s)]  # type: ignore[func-returns-value]
        raise E.InvalidArgumentError(f"a put names sample id(s) {twice[:3]} twice")
    return x


def _fields(x: Any) -> list[str]:
    """Field names from a request: distinct strings of 1-MAX_NAME_LEN characters, at most 1024."""
    if not isinstance(x, list) or len(x) > 1024 or not all(isinstance(s, str) and 0 < len(s) <= MAX_NAME_LEN for s in x):
        raise E.WireFormatError(f"'fields' must be a list of at most 1024 field names of 1-{MAX_NAME_LEN} characters")
    if len(set(x)) != len(x):
        raise E.InvalidArgumentError(f"a request names a field twice: {sorted(f for f in set(x) if x.count(f) > 1)[:3]}")
    return x


def _block_id_ok(b: Any) -> bool:
    """A block id is a positive int of at most 63 bits (it travels as int64)."""
    return isinstance(b, int) and not isinstance(b, bool) and 0 < b < 1 << 63


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
