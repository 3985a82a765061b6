"""A storage unit of the native engine: columnar blocks in one pre-faulted slab.

A unit owns one slab of shared memory (:class:`~rlplane_service.native.slab.Slab`,
``RLPLANE_UNIT_BYTES``) and an allocator of its extents. A *block* is what one put
wrote to this unit: per field, one extent holding the rows' values back to back and
the rows' element offsets. A write that does not fit is StorageFullError naming the
unit, the size asked for and what is free; nothing of it is kept.

Bytes arrive two ways, into the same slab:

- ``alloc`` (a client on this host): the unit hands out the extents, the client copies
  (or encodes) straight into the mapped slab (:mod:`rlplane.shm`), then commits at the
  controller. Nothing the unit holds is visible before that commit. A big field can be
  staged first (``stage``): the unit hands out one extent before the block exists, the client
  encodes into it (the float32 -> bfloat16 pixel cast lands in the slab, no buffer in
  between), and the block's ``alloc`` names the staged extent instead of asking for one.
  A staged extent no block took is freed like an orphan block (``old``, ``free``).
- ``write`` (any client, and the controller when it re-replicates): the values arrive as
  ZMQ frames and are copied into freshly allocated extents.

Reads are either one-sided (a same-host client copies rows out of the mapped slab at
the addresses the controller located) or ``read``: the unit gathers the rows asked for
with one vectorized copy per field (:func:`rlplane.gather.gather`) and answers one
column per field. ``block`` hands a whole block back as stored (re-replication).

A unit also keeps its share of the controller's commit log (``log``; ``inventory`` hands
it back with every block's extents, :mod:`~rlplane_service.native.commitlog`): what a
restarted controller rebuilds its index from.

Only the controller (on the unit's control socket, with its own credential) may ``free``
blocks, copy a whole ``block`` out, list the ``old`` ones or touch the log: a data client can neither
delete nor copy out what it did not locate. A block's extents go back to the allocator
only on ``free``, which the controller sends
once no sample points at the block and no read that located it is still pinned (see
the controller), so an extent is never reused under a read in flight. Block ids come
from the writer (62 random bits) and are never reused. ``slab`` issues a ticket for
mapping the slab (see :class:`~rlplane_service.native.slab.SlabShare`); with a transfer
engine (``te`` in the constructor, RLPLANE_TE_PROTOCOL) ``te`` says where the slab is on
it, so a client on another host writes and reads it one-sided (:mod:`rlplane.te`).

Example::

    unit = UnitCore("unit-0", slab_bytes=1 << 30)
    Server(unit, secret=b"...").start()
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from rlplane import errors as E
from rlplane.channel import PLAIN_USER
from rlplane.dtypes import numpy_of
from rlplane.gather import gather
from rlplane.journal import VOID
from rlplane.names import MAX_NAME_LEN
from rlplane.wire import RawColumn, check_offsets, int_array, ints
from rlplane_service.native.allocator import ALIGN, Allocator
from rlplane_service.native import commitlog as clog
from rlplane_service.native.commitlog import MAX_ENTRIES_PER_REQUEST, MAX_FORGET, Entry, UnitLog
from rlplane_service.native.heap import HeapTrim
from rlplane_service.native.journal import JournalWriter
from rlplane_service.native.slab import Slab, SlabShare

log = logging.getLogger(__name__)

#: The slab of a unit built without a size (the service passes RLPLANE_UNIT_BYTES).
DEFAULT_SLAB_BYTES = 256 << 20
#: Most fields one block may hold (bounds what one request makes a unit allocate).
MAX_FIELDS = 256
#: Most extents staged and not yet taken into a block, at once (a writer that stages
#: without ever putting cannot make the unit keep a table of any size).
MAX_STAGED = 4096
#: Most bytes one ``read`` answers (rows asked for twice count twice): a small request
#: cannot make a unit build an answer of any size.
MAX_READ_BYTES = 4 << 30
#: Longest a ``free`` may keep a block's extents out of use (``after``: a one-sided write
#: into them failed, and the writer's engine may still deliver its bytes).
MAX_FREE_AFTER_S = 600.0
#: About how many header bytes one page of a unit's ``inventory`` holds, of blocks and of
#: commit-log entries each (well under the 16 MiB header limit).
INVENTORY_PAGE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class TransferEngineConfig:
    """How a unit offers its slab to Mooncake's transfer engine: the address it advertises,
    the protocol (``tcp`` or ``rdma``), the RDMA NICs (``""``: the engine picks) and the
    range its listeners' ports are drawn from (None: the engine's choice)."""

    host: str
    protocol: str
    devices: str = ""
    ports: tuple[int, int] | None = None

    def register(self, u8: np.ndarray, unit: str) -> tuple[Any, dict[str, Any]]:
        """Start an engine, register ``u8`` (the slab) with it; returns the engine and what
        the unit's ``te`` operation answers."""
        from rlplane.te import open_engine, register  # noqa: PLC0415 - mooncake only where configured

        engine = open_engine(self.host, self.protocol, self.devices, self.ports)
        register(engine, u8.ctypes.data, u8.size, f"storage unit {unit}'s slab")
        log.info("storage unit %s: slab on the transfer engine (%s) at %s:%d", unit, self.protocol, self.host,
                 engine.get_rpc_port())
        return engine, {"peer": f"{self.host}:{engine.get_rpc_port()}", "base": int(u8.ctypes.data),
                        "bytes": int(u8.size), "protocol": self.protocol}


@dataclass(frozen=True, slots=True)
class Extent:
    """One field of one block: ``nbytes`` at ``start`` in the slab, rows split by ``offsets`` (elements)."""

    dtype: str
    np_dtype: Any
    start: int
    nbytes: int
    offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.offsets.size - 1


class Block:
    """One block's fields on this unit, packed: a unit holds tens of thousands of blocks,
    so a block is one small object (names and dtypes shared with blocks of the same
    layout, starts and sizes in one array, every field's row offsets in one array)
    instead of a dict of per-field records. With one allocator extent for the fields
    not staged, a six-field block costs ~1 kB here, where it cost ~2.5 kB before.
    :meth:`get` and :meth:`items` give each field's :class:`Extent` (views)."""

    __slots__ = ("names", "dtypes", "where", "offsets", "allocs", "born")

    _layouts: dict[tuple[str, ...], tuple[str, ...]] = {}  # shared name / dtype tuples (bounded)

    def __init__(self, layout: list[tuple[str, str, Any, int, np.ndarray]], starts: list[int], allocs: list[int],
                 born: float) -> None:
        self.names = self._shared(tuple(name for name, *_ in layout))
        self.dtypes = self._shared(tuple(dname for _, dname, *_ in layout))
        self.where = np.array([starts, [nbytes for *_, nbytes, _ in layout]], np.int64)
        offsets = np.concatenate([off for *_, off in layout]) if layout else np.zeros(0, np.int64)
        small = not offsets.size or int(offsets.max()) < 1 << 31
        self.offsets = offsets.astype(np.int32) if small else offsets  # half the bytes when they fit
        self.allocs = tuple(allocs)  # the allocator's extents this block holds (one, plus any staged)
        self.born = born

    @classmethod
    def _shared(cls, key: tuple[str, ...]) -> tuple[str, ...]:
        got = cls._layouts.get(key)
        if got is None:
            if len(cls._layouts) >= 4096:
                return key
            got = cls._layouts.setdefault(key, key)
        return got

    def _extent(self, i: int) -> Extent:
        rows = self.offsets.size // len(self.names)
        dname = self.dtypes[i]
        return Extent(dname, numpy_of(dname), int(self.where[0, i]), int(self.where[1, i]),
                      self.offsets[i * rows : (i + 1) * rows].astype(np.int64))

    def get(self, name: str) -> Extent | None:
        try:
            return self._extent(self.names.index(name))
        except ValueError:
            return None

    def items(self) -> list[tuple[str, Extent]]:
        return [(name, self._extent(i)) for i, name in enumerate(self.names)]



class UnitCore:
    """The slab and blocks of one storage unit and the operations on them (called by :class:`Server`)."""

    #: Served only on the control socket (the controller's credential): dropping blocks,
    #: and copying a whole block out (re-replication).
    #: The commit log (``log``, ``inventory``) is the controller's too.
    CONTROL_OPS = frozenset({"free", "block", "old", "log", "forget", "inventory", "jtrunc"})

    def __init__(self, name: str, slab_bytes: int = DEFAULT_SLAB_BYTES, *, share: bool = True,
                 seal_key: bytes | None = None, te: TransferEngineConfig | None = None,
                 journal: JournalWriter | None = None, readers: Iterable[str] = ()) -> None:
        """``seal_key`` (the controller's credential): every extent the unit hands out is
        sealed with it (:func:`seal`), so a commit cannot claim extents or sizes it was not given.
        ``te``: register the slab with Mooncake's transfer engine (clients on other hosts
        then write and read it one-sided, :mod:`rlplane.te`). ``journal``: append every change
        the controller logs here to it (:mod:`rlplane_service.native.journal`). ``readers``:
        the engine users of read-only tenants (they may not write a block)."""
        self.name = name
        self.readers = frozenset(readers)
        self.journal = journal
        self.seal_key = seal_key
        self.slab = Slab(slab_bytes, name)
        self.alloc = Allocator(self.slab.nbytes)
        self.share = SlabShare(self.slab.fd, name).start() if share else None
        self.te: dict[str, Any] | None = None
        self._engine: Any = None  # kept for the unit's life: the engine serves the slab from its own threads
        if te is not None:
            self._engine, self.te = te.register(self.slab.u8, name)
        self._blocks: dict[int, Block] = {}
        self._staged: dict[int, dict[str, tuple[int, int, str]]] = {}  # block -> field -> (start, bytes, dtype)
        self._staged_born: dict[int, float] = {}
        self._late: list[tuple[float, list[int]]] = []  # (when, extents) freed with ``after``: out of use till then
        self.log = UnitLog()  # this unit's share of the controller's commit log (rlplane_service.native.commitlog)
        self._lock = threading.Lock()
        self.heap = HeapTrim()  # the transient buffers of writes and reads go back to the OS

    # -- operations (header, columns, buffers) -> (reply, columns, buffers) ------------
    def op_alloc(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Extents for block ``b``: ``f`` = ``[[field, dtype, nbytes], ...]``, each field's
        int64 element offsets in the extra buffers, in that order. Answers ``x``: the
        slab offset of each field's extent; the writer copies its values there."""
        _full_access(header, "allocate extents in the slab (they may hold another tenant's old bytes)")
        bid = _block_id(header)
        wanted = header.get("f")
        if not isinstance(wanted, list) or not 0 < len(wanted) <= MAX_FIELDS or len(extra) != len(wanted):
            raise E.WireFormatError("alloc needs 'f': [[field, dtype, nbytes], ...] and one offsets buffer per field")
        layout, staged = [], {}
        for entry, off in zip(wanted, extra):
            if not (isinstance(entry, list) and len(entry) in (3, 4) and isinstance(entry[0], str)
                    and isinstance(entry[1], str) and isinstance(entry[2], int) and 0 <= entry[2] < 1 << 62
                    and (len(entry) == 3 or isinstance(entry[3], int))):
                raise E.WireFormatError(f"bad alloc entry {str(entry)[:80]}")
            name, dname, nbytes = entry[:3]
            if len(entry) == 4:  # [field, dtype, nbytes, start of the extent staged for it]
                staged[name] = entry[3]
            np_dtype = _np_dtype(dname, name)
            if nbytes % np_dtype.itemsize:
                raise E.WireFormatError(f"{nbytes} bytes is not a whole number of {dname} elements", field=name)
            offsets = int_array(off, "offsets")  # copied into the block's one offsets array
            check_offsets(offsets, nbytes // np_dtype.itemsize, max(offsets.size - 1, 0), name)
            layout.append((name, dname, np_dtype, nbytes, offsets))
        where = self._store(bid, layout, staged)
        return {"x": where, "xs": self._seals(bid, layout, where)}, {}, []

    def op_stage(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Extents for fields of block ``b`` before the block exists: ``fs`` =
        ``[[field, dtype, nbytes], ...]`` (all or none; or one as ``f``, ``d``, ``n``). The
        writer encodes into them, then names those it used in the block's ``alloc``
        (``[field, dtype, nbytes, start]``); the block frees the others. Answers ``xs``: each
        extent's slab offset, in order (``x`` for the one-field form)."""
        _full_access(header, "allocate extents in the slab (they may hold another tenant's old bytes)")
        bid = _block_id(header)
        one = "fs" not in header
        wanted = [[header.get("f"), header.get("d"), header.get("n")]] if one else header.get("fs")
        if not isinstance(wanted, list) or not 0 < len(wanted) <= MAX_FIELDS:
            raise E.WireFormatError(f"stage needs 'fs': [[field, dtype, bytes], ...] (1 to {MAX_FIELDS} fields)")
        for entry in wanted:
            name, dname, nbytes = entry if isinstance(entry, list) and len(entry) == 3 else (None, None, None)
            if not (isinstance(name, str) and 0 < len(name) <= 200 and isinstance(dname, str)
                    and isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 < nbytes < 1 << 62):
                raise E.WireFormatError("stage needs, per field, its name, dtype and bytes (> 0)")
            if nbytes % _np_dtype(dname, name).itemsize:
                raise E.WireFormatError(f"{nbytes} bytes is not a whole number of {dname} elements", field=name)
        if len({name for name, _, _ in wanted}) != len(wanted):
            raise E.WireFormatError("stage names a field twice")
        with self._lock:
            mine = self._staged.get(bid, {})
            if bid in self._blocks or any(name in mine for name, _, _ in wanted):
                raise E.WireFormatError(f"block {bid} is already stored on {self.name}, or a field of it staged")
            if sum(len(f) for f in self._staged.values()) + len(wanted) > MAX_STAGED:
                raise E.UnavailableError(f"storage unit {self.name} has {MAX_STAGED} staged extents no put has taken; "
                                         "retry later", component=self.name)
            starts: list[int] = []
            for name, dname, nbytes in wanted:
                start = self.alloc.alloc(nbytes)
                if start is None:
                    for taken in starts:  # all or none
                        self.alloc.free(taken)
                    raise self._full(nbytes, name, nbytes)
                starts.append(start)
            mine = self._staged.setdefault(bid, {})
            for (name, dname, nbytes), start in zip(wanted, starts):
                mine[name] = (start, nbytes, dname)
            self._staged_born.setdefault(bid, time.monotonic())
        return ({"x": starts[0]} if one else {"xs": starts}), {}, []

    def op_write(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Store ``columns`` as block ``b`` (a block is written once): copied into new extents."""
        if header.get("_user") in self.readers:
            raise E.ForbiddenError(f"a read-only tenant's credential ({header.get('_user')!r}) may not write blocks "
                                   f"into {self.name}")
        bid = _block_id(header)
        layout, where = self._write(bid, columns)
        return {"x": where, "xs": self._seals(bid, layout, where), "stored": sum(c.nbytes for c in columns.values())}, {}, []

    def _write(self, bid: int, columns: dict[str, RawColumn]) -> tuple[list[tuple[str, str, Any, int, np.ndarray]],
                                                                         dict[str, int]]:
        """``columns`` stored as block ``bid`` in new extents; its layout and each field's start."""
        self.heap.moved()
        if not 0 < len(columns) <= MAX_FIELDS:
            raise E.WireFormatError(f"a block holds 1 to {MAX_FIELDS} fields")
        layout = [(name, c.dtype, c.values.dtype, c.values.nbytes, c.offsets) for name, c in columns.items()]
        where = self._store(bid, layout)
        for name, c in columns.items():
            start = where[name]
            self.slab.u8[start : start + c.values.nbytes] = c.values.view(np.uint8)
        return layout, where

    def op_read(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Per requested field, the rows ``(block, row)`` in the order asked, as one column."""
        self.heap.moved()
        wanted = header.get("f")
        if not isinstance(wanted, list) or len(wanted) > MAX_FIELDS:
            raise E.WireFormatError(f"read needs 'f': [[field, blocks, rows], ...] (at most {MAX_FIELDS} fields)")
        asks = []
        for entry in wanted:
            if not (isinstance(entry, list) and len(entry) >= 3 and isinstance(entry[0], str)):
                raise E.WireFormatError(f"bad read entry {str(entry)[:80]}")
            name = entry[0]
            blocks, rows = int_array(entry[1], "blocks"), int_array(entry[2], "rows")
            if blocks.size != rows.size:
                raise E.WireFormatError("blocks and rows differ in length", field=name)
            asks.append((name, blocks, rows))
        if len({name for name, _, _ in asks}) != len(asks):
            raise E.WireFormatError("a read names a field twice")
        self._check_caps(header, asks)
        partition = header.get("p") if isinstance(header.get("p"), str) else "?"
        plans = [(name, *self._sources(name, blocks, rows, partition)) for name, blocks, rows in asks]
        total = sum(nbytes for *_, nbytes in plans)
        if total > MAX_READ_BYTES:
            raise E.PayloadTooLargeError(f"a read of {total} bytes from storage unit {self.name} is over the limit of "
                                         f"{MAX_READ_BYTES} per request: read fewer samples per call")
        return {}, {name: self._gather(name, *plan) for name, *plan, _ in plans}, []

    def op_block(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Every column of block ``b`` as stored (the controller copies it to another unit
        when a copy was lost with a unit). MissingDataError when it is not here."""
        self.heap.moved()
        bid = _block_id(header)
        with self._lock:
            block = self._blocks.get(bid)
        if block is None:
            raise E.MissingDataError("(block copy)", {}, hint=f"block {bid!r} is not on {self.name}")
        return {}, {name: RawColumn(x.dtype, self._values(x), x.offsets) for name, x in block.items()}, []

    def op_free(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Drop blocks (every row of them was cleared, or their put never committed).
        ``after`` (seconds): the blocks go at once, their extents come back into use only
        then (a one-sided write into them failed: the writer's transfer engine may still
        deliver bytes there, which must not land in another put's rows)."""
        self.heap.moved()
        bids = int_array(header.get("b", b""), "blocks").tolist()
        after = header.get("after", 0.0)
        if not isinstance(after, (int, float)) or isinstance(after, bool) or not 0 <= after <= MAX_FREE_AFTER_S:
            raise E.WireFormatError(f"free's 'after' must be seconds in [0, {MAX_FREE_AFTER_S:.0f}]")
        freed, starts = 0, []
        with self._lock:
            for bid in bids:
                block = self._blocks.pop(bid, None)
                if block is not None:
                    freed += 1
                    starts += block.allocs
                staged = self._staged.pop(bid, None)
                self._staged_born.pop(bid, None)
                starts += [start for start, _, _ in (staged or {}).values()]
            if after and starts:
                self._late.append((time.monotonic() + after, starts))
            else:
                for start in starts:
                    self.alloc.free(start)
        return {"freed": freed}, {}, []

    def op_old(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Ids of the blocks stored more than ``age`` seconds ago (the controller frees those
        it does not know: a writer that died before its reserve, or wrote outside one)."""
        age = header.get("age")
        if not isinstance(age, (int, float)) or isinstance(age, bool) or not 0 <= age < 1e9:
            raise E.WireFormatError("old needs 'age': seconds")
        cut = time.monotonic() - age
        with self._lock:
            old = {b for b, k in self._blocks.items() if k.born < cut} | \
                {b for b, t in self._staged_born.items() if t < cut}
            return {"b": ints(sorted(old))}, {}, []

    def op_log(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Keep commit-log entries: ``e`` = ``[[seq, kind, partition, mac], ...]``, each
        body in the extra buffers, in that order (the controller's, before it answers).
        With ``columns``, the rows of a put sent in one message: stored first as block
        ``b`` (all or nothing: a unit that cannot store them keeps no entry either), their
        extents answered as ``x``."""
        heads = header.get("e")
        if not isinstance(heads, list) or not 0 < len(heads) <= MAX_ENTRIES_PER_REQUEST or len(extra) != len(heads):
            raise E.WireFormatError("log needs 'e': [[seq, kind, partition, mac], ...] and one body buffer each")
        entries = [Entry.from_wire(h, b) for h, b in zip(heads, extra)]
        where = self._write(_block_id(header), columns)[1] if columns else None
        self.log.extend(entries)
        if self.journal is not None and not header.get("nj"):
            try:
                for e in entries:
                    self._journal(e)
                if header.get("sync"):  # a durable put among them: on disk before the controller hears back
                    self.journal.sync()
            except OSError as err:
                log.error("storage unit %s: journal write failed (%s): its changes are not journalled", self.name, err)
                raise E.UnavailableError(f"storage unit {self.name} could not write its journal "
                                         f"({self.journal.dir}: {err.strerror or err})", component=self.name) from None
        return {"kept": len(heads), **({"x": where} if where is not None else {})}, {}, []

    def op_forget(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Drop the commit-log entries ``s`` (int64 sequence numbers): the controller found
        that a rebuild no longer needs them (rlplane_service.native.logbook), or (``early``)
        they are a failed put's, which may still arrive (kept out then; the journal records that
        they failed, so no replay applies them). The journal on disk keeps the others until a
        snapshot truncates it."""
        seqs = int_array(header.get("s", b""), "sequence numbers")
        if seqs.size > MAX_FORGET:
            raise E.WireFormatError(f"forget names at most {MAX_FORGET} entries at once")
        early = header.get("early") is True
        if early and self.journal is not None:  # a failed put this unit may have journalled: never replayed
            try:
                for s in seqs.tolist():
                    self.journal.append(s, VOID, "", b"\x80")
                self.journal.sync()
            except OSError as err:
                log.error("storage unit %s: could not journal that changes %s failed (%s): a restore from its "
                          "journal brings them back", self.name, seqs.tolist()[:8], err)
        return {"forgot": self.log.forget(seqs.tolist(), early=early)}, {}, []

    def _journal(self, e: Entry) -> None:
        """Append entry ``e`` to the journal; a put with the bytes of its blocks stored here."""
        places: list[list[Any]] = []
        body: list[memoryview] = []
        if e.kind == clog.PUT:
            rec = clog.parse(e)
            at = 0
            with self._lock:
                for b, *_ in rec.get("blocks") or ():
                    block = self._blocks.get(b) if isinstance(b, int) else None
                    if block is None:
                        continue
                    fields = []
                    for name, x in block.items():
                        fields.append([name, at, x.nbytes])
                        body.append(memoryview(self.slab.u8[x.start : x.start + x.nbytes]))
                        at += x.nbytes
                    places.append([b, fields])
        self.journal.append(e.seq, e.kind, e.partition, e.body, places, body)  # type: ignore[union-attr]

    def op_jtrunc(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """A snapshot holds every change before ``below``: drop the journal's older segments."""
        below, snap, units = header.get("below"), header.get("snapshot") or "", header.get("units")
        if not isinstance(below, int) or isinstance(below, bool) or not 0 < below < 1 << 63 or not isinstance(snap, str):
            raise E.WireFormatError("jtrunc needs 'below': a sequence number")
        if units is not None and not (isinstance(units, list) and len(units) <= 4096
                                      and all(isinstance(u, str) and u for u in units)):
            raise E.WireFormatError("jtrunc's 'units' must be the store's unit names")
        if self.journal is None:
            return {"deleted": 0}, {}, []
        try:
            deleted = self.journal.truncate(below, snap[:4096])
            if units:  # directories of units the store no longer has
                deleted += self.journal.prune_others(below, {*units, self.name})
            return {"deleted": deleted}, {}, []
        except OSError as err:
            raise E.UnavailableError(f"storage unit {self.name} could not truncate its journal ({err})",
                                     component=self.name) from None

    def op_inventory(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """What a restarting controller rebuilds from, a page at a time: ``blocks`` =
        ``[[block, [field, dtype, slab offset], ...], ...]`` of the blocks stored here with ids
        above ``b`` and the commit-log entries above sequence number ``s`` (``e``, the bodies
        in the extra buffers), in order, about INVENTORY_PAGE_BYTES of header each; ``more_b``
        / ``more_s``: where the next page starts (None: nothing left). One answer for all
        passed the header limit at about 300,000 live puts."""
        after_b, after_s = header.get("b", 0), header.get("s", 0)
        if not (type(after_b) is int and 0 <= after_b < 1 << 63 and type(after_s) is int and 0 <= after_s < 1 << 63):
            raise E.WireFormatError("inventory's 'b' and 's' are the last block id and sequence number already listed")
        blocks: list[list[Any]] = []
        more_b = more_s = None
        size = 0
        with self._lock:
            ids = np.fromiter(self._blocks, np.int64, len(self._blocks))
            for b in np.sort(ids[ids > after_b]).tolist():
                if size >= INVENTORY_PAGE_BYTES:
                    more_b = blocks[-1][0]
                    break
                block = self._blocks[b]
                fields = [list(f) for f in zip(block.names, block.dtypes, block.where[0].tolist())]
                blocks.append([b, fields])
                size += 16 + sum(len(name) + len(dtype) + 12 for name, dtype, _ in fields)
        entries: list[Entry] = []
        size = 0
        for e in self.log.entries(after=after_s):
            if size >= INVENTORY_PAGE_BYTES:
                more_s = entries[-1].seq
                break
            entries.append(e)
            size += 64 + len(e.partition) + len(e.mac)
        return ({"unit": self.name, "blocks": blocks, "e": [e.wire() for e in entries], "high": self.log.high,
                 "more_b": more_b, "more_s": more_s}, {}, [e.body for e in entries])

    def op_slab(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """How to map this unit's slab from the same host: its socket and a fresh ticket.
        Only for full-access credentials: the slab holds every tenant's bytes."""
        _full_access(header, "map this unit's slab")
        if self.share is None:
            raise E.UnavailableError(f"storage unit {self.name} does not share its slab", component=self.name)
        return {"sock": self.share.sock_name, "ticket": self.share.ticket(), "bytes": self.slab.nbytes}, {}, []

    def op_te(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Where this unit's slab is on the transfer engine: ``peer`` (the engine's
        ``host:port``), ``base`` (the slab's registered address), ``bytes``, ``protocol``.
        Only for full-access credentials: the engine itself checks nobody."""
        _full_access(header, "reach this unit's slab over the transfer engine")
        if self.te is None:
            raise E.InvalidArgumentError(f"storage unit {self.name} runs no transfer engine (the service starts one "
                                         "with RLPLANE_TE_PROTOCOL=tcp|rdma); use RLPLANE_DATA_PATH=auto or zmq")
        return dict(self.te), {}, []

    def op_stats(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        return self.stats(), {}, []

    def op_ping(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        with self._lock:
            slab = {**self.alloc.stats(), "late_bytes": self._late_bytes()}
        journal = {"journal": self.journal.stats()} if self.journal is not None else {}
        return {"unit": self.name, "slab": slab, **journal}, {}, []

    def damage(self, bid: int, name: str, row: int) -> bool:
        """Flip one bit of row ``row`` of field ``name`` in block ``bid`` (what a failing
        memory module or a stray write would do): the hook the integrity tests use.
        False when the block, field or row is not here (or the row is empty)."""
        with self._lock:
            x = self._blocks.get(bid, {}).get(name)
            if x is None or not 0 <= row < x.num_rows or x.offsets[row] == x.offsets[row + 1]:
                return False
            self.slab.u8[x.start + int(x.offsets[row]) * x.np_dtype.itemsize] ^= 1
            return True

    # -- helpers -----------------------------------------------------------------------
    def tick(self) -> None:
        """Between requests (the server loop, at least every 200 ms): give freed heap pages
        back when due, and the extents of ``free(after=...)`` once their time has come."""
        self.heap.tick()
        if self._late:
            now = time.monotonic()
            with self._lock:
                due = [starts for when, starts in self._late if when <= now]
                self._late = [(when, starts) for when, starts in self._late if when > now]
                for start in (x for starts in due for x in starts):
                    self.alloc.free(start)

    def _late_bytes(self) -> int:
        """Bytes of the extents kept out of use a while (``free(after=...)``): counted as used."""
        return sum(self.alloc.extent(x) or 0 for _, starts in self._late for x in starts)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"unit": self.name, "blocks": len(self._blocks), "nbytes": self.alloc.used_bytes,
                    "late_extents": sum(len(starts) for _, starts in self._late), "late_bytes": self._late_bytes(),
                    "populated": self.slab.populated.is_set(),
                    "slab": self.alloc.stats(), "log_entries": len(self.log), "log_bytes": self.log.nbytes(),
                    **({"journal": self.journal.stats()} if self.journal is not None else {})}

    def stop(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.share is not None:
            self.share.stop()

    def _full(self, need: int, name: str, nbytes: int) -> E.StorageFullError:
        st = self.alloc.stats()
        err = E.StorageFullError(
            f"storage unit {self.name} has no room for {need} bytes (field {name!r} needs {nbytes}): its "
            f"slab of {st['slab_bytes']} bytes has {st['free_bytes']} free, largest hole "
            f"{st['largest_free']}; nothing of this put was kept: clear consumed partitions or raise "
            "RLPLANE_UNIT_BYTES")
        err.component = f"storage unit {self.name}"  # (one unit is full: a writer may place the put on another)
        return err

    def _store(self, bid: int, layout: list[tuple[str, str, Any, int, np.ndarray]],
               staged: dict[str, int] | None = None) -> dict[str, int]:
        """Allocate every field's extent of block ``bid`` (all or none) and record the block.
        ``staged``: fields whose extent was staged for this block (their start): taken as is."""
        rows = {off.size - 1 for *_, off in layout}
        if len(rows) > 1:
            raise E.WireFormatError(f"a block's columns must hold the same number of rows, got {sorted(rows)}")
        if len({name for name, *_ in layout}) != len(layout):
            raise E.WireFormatError("a block names a field twice")
        if not all(0 < len(name) <= MAX_NAME_LEN and 0 < len(dname) <= 32 for name, dname, *_ in layout):
            # (a block's names are kept as long as it lives, and shared layouts longer: 1 MiB names piled up)
            raise E.WireFormatError(f"a block's field names are 1-{MAX_NAME_LEN} characters (and dtypes named)")
        with self._lock:
            if bid in self._blocks:
                raise E.WireFormatError(f"block {bid} is already stored on {self.name}")
            mine = self._staged.get(bid, {})
            for name, dname, _, nbytes, _ in layout:
                if name in (staged or {}) and mine.get(name) != (staged[name], nbytes, dname):  # type: ignore[index]
                    raise E.WireFormatError(f"block {bid} names an extent at {staged[name]} for {name!r} that was "  # type: ignore[index]
                                            f"not staged for it on {self.name} (or not with {nbytes} bytes of {dname})",
                                            field=name)
            # The fields not staged share one extent, each at an ALIGNed offset in it: one
            # allocation (and one free-list entry) a block, not one a field.
            allocs = [mine[name][0] for name in staged or {}]
            sizes = [-(-nbytes // ALIGN) * ALIGN for _, _, _, nbytes, _ in layout]
            total = sum(size for (name, *_), size in zip(layout, sizes) if name not in (staged or {}))
            at = 0
            if total:
                start = self.alloc.alloc(total)
                if start is None:
                    big = max(layout, key=lambda e: e[3])
                    raise self._full(total, big[0], big[3])
                allocs.append(start)
                at = start
            got: list[int] = []
            for (name, *_), size in zip(layout, sizes):
                if name in (staged or {}):
                    got.append(mine[name][0])
                else:
                    got.append(at)
                    at += size
            for name in staged or {}:
                del mine[name]
            for start, _, _ in mine.values():  # staged for the block and not used: no later alloc can name them
                self.alloc.free(start)
            self._staged.pop(bid, None)
            self._staged_born.pop(bid, None)
            self._blocks[bid] = Block(layout, got, allocs, time.monotonic())
        return {name: start for (name, *_), start in zip(layout, got)}

    def _seals(self, bid: int, layout: list[tuple[str, str, Any, int, np.ndarray]], where: dict[str, int],
               ) -> dict[str, list[Any]]:
        """Per field ``[dtype, nbytes, rows, seal]`` of what was just stored (no seal without a key)."""
        return {name: [dname, nbytes, int(off.size - 1),
                       seal(self.seal_key, bid, self.name, name, dname, where[name], nbytes, int(off.size - 1))]
                for name, dname, _, nbytes, off in layout}

    def _values(self, x: Extent) -> np.ndarray:
        return self.slab.u8[x.start : x.start + x.nbytes].view(x.np_dtype)

    def _check_caps(self, header: dict[str, Any], asks: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """With a seal key, every block a read names needs the controller's capability for
        it on this unit (``caps``: ``[[block, token], ...]``, from the locate that found it)."""
        if self.seal_key is None or header.get("_control") is True:
            return
        given = header.get("caps")
        caps = ({c[0]: c[1] for c in given if isinstance(c, list) and len(c) == 2 and isinstance(c[0], int)}
                if isinstance(given, list) else {})
        wanted = np.unique(np.concatenate([blocks for _, blocks, _ in asks])) if asks else np.empty(0, np.int64)
        for b in wanted.tolist():
            token = caps.get(b)
            if not (isinstance(token, str) and token.isascii()  # compare_digest takes ASCII strings only
                    and hmac.compare_digest(token, read_cap(self.seal_key, b, self.name))):
                raise E.ForbiddenError(f"{self.name}: a read of block {b} without the controller's capability for it "
                                       "(locate the samples first)")

    def _sources(self, name: str, blocks: np.ndarray, rows: np.ndarray, partition: str,
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray, str, int]:
        """What a read of field ``name``'s rows ``(blocks, rows)`` copies: the source
        extents, which of them each row is in, the rows, the dtype, the bytes it answers."""
        uniq, which = np.unique(blocks, return_inverse=True)
        sources, dtypes, nbytes = [], set(), 0
        with self._lock:
            for k, bid in enumerate(uniq.tolist()):
                x = self._blocks.get(bid, {}).get(name)
                if x is None:
                    raise E.MissingDataError(partition, {}, hint=f"field {name!r}: block {bid} is gone from "
                                             f"{self.name} (the samples were cleared while this read was in flight)")
                mine = rows[which == k]
                if mine.size and (int(mine.min()) < 0 or int(mine.max()) >= x.num_rows):
                    raise E.WireFormatError(f"read asks for a row block {bid} does not hold", field=name)
                nbytes += int((x.offsets[mine + 1] - x.offsets[mine]).sum()) * x.np_dtype.itemsize
                sources.append((self._values(x), x.offsets))
                dtypes.add(x.dtype)
        if len(dtypes) > 1:
            raise E.ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
        return sources, which.astype(np.int64), rows, dtypes.pop() if dtypes else "uint8", nbytes

    @staticmethod
    def _gather(name: str, sources: list[tuple[np.ndarray, np.ndarray]], which: np.ndarray, rows: np.ndarray,
                dtype: str) -> RawColumn:
        if not sources:
            return RawColumn("uint8", np.empty(0, np.uint8), np.zeros(1, np.int64))
        try:
            values, offsets = gather(sources, which, rows)
        except IndexError as err:
            raise E.WireFormatError(f"read asks for a row the block does not hold ({err})", field=name) from None
        return RawColumn(dtype, values, offsets)


def seal(key: bytes | None, bid: int, unit: str, field: str, dtype: str, start: int, nbytes: int, rows: int) -> str:
    """The unit's attestation that block ``bid``'s field ``field`` lies at ``start`` in its
    slab, ``nbytes`` of ``dtype`` in ``rows`` rows: 128 bits of HMAC-SHA256 under the
    controller's key ("" without one). The controller checks it at commit."""
    if key is None:
        return ""
    msg = f"{bid}|{unit}|{field}|{dtype}|{start}|{nbytes}|{rows}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]


def read_cap(key: bytes, bid: int, unit: str) -> str:
    """The controller's capability to read block ``bid`` on unit ``unit`` (128 bits of
    HMAC-SHA256): a locate hands it out to a caller allowed to read the block's partition."""
    return hmac.new(key, f"read|{bid}|{unit}".encode(), hashlib.sha256).hexdigest()[:32]


def _full_access(header: dict[str, Any], what: str) -> None:
    """ForbiddenError for a tenant's (scoped) credential: only full access may ``what``."""
    user = header.get("_user")
    if user not in (None, PLAIN_USER.decode()) and header.get("_control") is not True:
        raise E.ForbiddenError(f"a tenant's credential ({user!r}) may not {what}; its bytes move over the engine's "
                               "sockets (data_path='zmq')")


def _block_id(header: dict[str, Any]) -> int:
    bid = header.get("b")
    if not isinstance(bid, int) or not 0 < bid < 1 << 63:
        raise E.WireFormatError("the request needs a block id 'b' (a positive 63-bit int)")
    return bid


def _np_dtype(dname: str, field: str) -> np.dtype:
    try:
        return numpy_of(dname)
    except (ValueError, KeyError) as err:
        raise E.WireFormatError(f"unknown dtype {dname!r} ({err})", field=field) from None


def unit_actor_class() -> Any:
    """The Ray actor class of a storage unit (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class NativeUnitActor:
        """Hosts a :class:`UnitCore` and its server thread; Ray calls are for the service only."""

        def __init__(self, name: str, host: str | None, secret: str | None,
                     slab_bytes: int = DEFAULT_SLAB_BYTES, control_secret: str | None = None,
                     ports: Sequence[int] | None = None, tenants: dict[str, str] | None = None,
                     te: Sequence[str] | None = None, journal: Sequence[Any] | None = None,
                     readers: Sequence[str] = ()) -> None:
            """``tenants``: engine user -> secret of each tenant (they may not map the slab);
            ``readers``: those of them with read-only access (they may not write a block).
            ``te``: ``(protocol, devices[, port min, port max])`` of the transfer engine to register the slab with.
            ``journal``: ``(directory, flush ms)`` of its write-ahead journal (RLPLANE_JOURNAL_DIR)."""
            from pathlib import Path

            from rlplane_service.native.server import Server

            bind = host or ray.util.get_node_ip_address()
            engine = TransferEngineConfig(bind, str(te[0]), str(te[1]),
                                          (int(te[2]), int(te[3])) if len(te) == 4 else None) if te else None
            writer = JournalWriter(Path(journal[0]), name, flush_ms=float(journal[1])) if journal else None
            self._core = UnitCore(name, slab_bytes, seal_key=control_secret.encode() if control_secret else None,
                                  te=engine, journal=writer, readers=readers)
            self._server = Server(self._core, host=bind, secret=secret.encode() if secret else None, name=name,
                                  port=(int(ports[0]), int(ports[1])) if ports else 0,
                                  control_secret=control_secret.encode() if control_secret else None,
                                  users={u: s.encode() for u, s in (tenants or {}).items()}).start()

        def info(self) -> dict[str, Any]:
            """Name, data endpoint, control endpoint (the controller's) and the process id."""
            return {"name": self._core.name, "endpoint": self._server.endpoint,
                    "control": self._server.control_endpoint, "pid": os.getpid()}

        def stats(self) -> dict[str, Any]:
            return self._core.stats()

        def health(self) -> dict[str, Any]:
            return {"server": self._server.health(), "threads": {}}

        def damage(self, bid: int, name: str, row: int) -> bool:
            """Test hook: flip a stored bit (see :meth:`UnitCore.damage`)."""
            return self._core.damage(bid, name, row)

    return NativeUnitActor


__all__ = ["TransferEngineConfig", "UnitCore", "unit_actor_class", "seal", "read_cap"]
