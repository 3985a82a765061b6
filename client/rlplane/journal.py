"""The write-ahead journal: its file format, reading it back, and replaying it into a store.

With ``RLPLANE_JOURNAL_DIR`` set, every storage unit appends each change the controller
logs to it (a commit's record with the bytes of the blocks this unit holds, a clear, an
ack, samples a claim expired) to a journal file in ``DIR/<unit name>/``, and fsyncs in
groups (see :mod:`rlplane_service.native.journal`). After every engine process died, a
new store replays the journal on top of the last snapshot
(:func:`rlplane.snapshot.restore` with ``journal=DIR``): every change after the
snapshot's cut, in the order the controller applied it.

**On disk**: ``DIR/<unit>/seg-*.rlj`` segments, each a run of records::

    b"RLJ1" | head length (u32) | body length (u64) | head (msgpack) | body | xxh3-64 (u64)

The head holds the change's sequence number (``seq``, the controller's), its kind
(``put``, ``clear``, ``drop``, ``ack``; ``void``: that change failed, see :data:`VOID`),
the partition, the change's record (``r``) and, for a put, where each of this unit's
blocks' fields lie in the body (``x``). The checksum covers everything after the magic.
``DIR/<unit>/BASE`` says below which sequence number the journal was truncated (at a
snapshot): a snapshot older than that cannot be continued by this journal.

**Torn and damaged records**: a record that runs past the end of its file (the process
died writing it) or fails its checksum with no whole record after it (the disk took only
part of the file's last records: power lost before their fsync) is *torn*: skipped with
the rest of the file, and reported. A record that fails its checksum with a whole record
after it is damage: :class:`~rlplane.errors.SnapshotError` naming the file, and nothing
is replayed.

Example::

    j = Journal.open("/var/lib/rlplane/journal")      # every segment read and checked
    j.last_seq, j.torn                                 # (1834, [])
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import msgpack
import numpy as np
import xxhash

from rlplane import errors as E
from rlplane.names import check_partition, check_task
from rlplane.tags import incarnation

log = logging.getLogger(__name__)

MAGIC = b"RLJ1"
FRAME = struct.Struct("<4sIQ")  # magic, head length, body length
TRAILER = struct.Struct("<Q")  # xxh3-64 of frame (after the magic), head and body
#: A segment's name pattern, and the file that records the last truncation.
SEGMENT_GLOB, BASE = "seg-*.rlj", "BASE"
#: Kinds of records (the commit log's, plus acks).
PUT, CLEAR, DROP, ACK = "put", "clear", "drop", "ack"
#: A unit's word that change ``seq`` failed (a put answered as failed that this unit had
#: journalled already: one of its copies could not be stored): no replay applies it.
VOID = "void"
_KINDS = frozenset({PUT, CLEAR, DROP, ACK, VOID})
_ACKED, _EXPIRED = 2, 3  # the ledger's states of an acked sample and of one expired (stale)
_MAX_HEAD = 1 << 30
#: Most candidate record starts looked at after a record that seems torn (is a whole one after it?).
_MAX_SCAN = 4096


def frame(seq: int, kind: str, partition: str, record: bytes | memoryview,
          places: list[list[Any]] | None, body: Sequence[memoryview]) -> tuple[bytes, Any]:
    """One record's prefix (frame and head) and a checksum object over it, to be updated
    with ``body`` and finished as the trailer (see :func:`trailer`)."""
    head = msgpack.packb({"seq": seq, "k": kind, "p": partition, "r": bytes(record), "x": places or []},
                         use_bin_type=True)
    nbody = sum(b.nbytes for b in body)
    prefix = FRAME.pack(MAGIC, len(head), nbody) + head
    h = xxhash.xxh3_64()
    h.update(memoryview(prefix)[4:])
    for b in body:
        h.update(b)
    return prefix, h


def trailer(h: Any) -> bytes:
    return TRAILER.pack(h.intdigest())


@dataclass
class Record:
    """One change as the journal holds it: ``seq``, ``kind``, ``partition``, its record
    (``rec``) and, for a put, per block the bytes of each field (views of the file)."""

    seq: int
    kind: str
    partition: str
    rec: dict[str, Any]
    blocks: dict[int, dict[str, memoryview]] = field(default_factory=dict)
    where: str = ""


@dataclass
class Segment:
    """A segment's records, checked; ``torn``: why its last record was skipped, if it was."""

    path: Path
    records: list[Record]
    torn: str | None
    nbytes: int


def read_segment(path: Path, *, heads_only: bool = False) -> Segment:
    """Every record of segment ``path`` (SnapshotError on damage, see the module docstring).
    ``heads_only``: skip the bodies and checksums (a unit learning its segments' seqs)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    view = memoryview(buf)
    out: list[Record] = []
    at, torn = 0, None

    def bad(why: str) -> E.SnapshotError:
        return E.SnapshotError(f"journal file {path} {why} at byte {at}; nothing of the journal was replayed",
                               component=str(path))

    def whole_after(start: int) -> bool:
        """Whether a record that passes its checksum starts after ``start``: then what looks
        torn at ``start`` is damage (a torn record is only ever the last one)."""
        if heads_only:
            return False
        find = buf.find if isinstance(buf, mmap.mmap) else bytes(buf).find
        c = find(MAGIC, start + 1)
        for _ in range(_MAX_SCAN):
            if c < 0 or size - c < FRAME.size:
                return False
            _, hl, bl = FRAME.unpack_from(view, c)
            e = c + FRAME.size + hl + bl + TRAILER.size
            if hl <= _MAX_HEAD and e <= size:
                h = xxhash.xxh3_64()
                h.update(view[c + 4 : e - TRAILER.size])
                if h.intdigest() == TRAILER.unpack_from(view, e - TRAILER.size)[0]:
                    return True
            c = find(MAGIC, c + 1)
        return False

    while at < size:
        if size - at < FRAME.size:
            torn = f"{size - at} bytes of a record's frame at the end"
            break
        magic, hlen, blen = FRAME.unpack_from(view, at)
        end = at + FRAME.size + hlen + blen + TRAILER.size
        if magic != MAGIC or hlen > _MAX_HEAD:
            if (end >= size or magic == b"\0\0\0\0") and not whole_after(at):
                torn = "a record's frame was not written whole"
                break
            raise bad("holds no record frame where one should start (damaged)")
        if end > size:
            if whole_after(at):
                raise bad("has a record whose frame is damaged (it claims more bytes than follow)")
            torn = f"a record of {end - at} bytes of which {size - at} were written"
            break
        hstart = at + FRAME.size
        body = view[hstart + hlen : end - TRAILER.size]
        if not heads_only:
            h = xxhash.xxh3_64()
            h.update(view[at + 4 : hstart + hlen])
            h.update(body)
            if h.intdigest() != TRAILER.unpack_from(view, end - TRAILER.size)[0]:
                if end == size or not whole_after(at):  # no whole record after it: the disk took only part
                    torn = "its last record fails its checksum" if end == size else \
                        f"its last {size - at} bytes fail their checksums (records the disk took only part of)"
                    break
                raise bad("has a record that fails its checksum (damaged)")
        try:
            head = msgpack.unpackb(view[hstart : hstart + hlen], raw=False, strict_map_key=False)
            rec = msgpack.unpackb(head["r"], raw=False, strict_map_key=False) if not heads_only else {}
            seq, kind, p = _plain_int(head["seq"]), str(head["k"]), str(head["p"])
            if kind not in _KINDS or not isinstance(rec, dict):
                raise ValueError(f"kind {kind!r}")
            blocks: dict[int, dict[str, memoryview]] = {}
            for b, places in head.get("x") or []:
                got = blocks.setdefault(_plain_int(b), {})
                for name, off, nb in places:
                    if not 0 <= _plain_int(off) <= off + _plain_int(nb) <= body.nbytes:
                        raise ValueError(f"field {name!r} of block {b} lies outside the record")
                    got[str(name)] = body[off : off + nb]
        except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
            if end == size:
                torn = f"its last record does not parse ({err})"
                break
            raise bad(f"has a record that does not parse ({err})") from None
        out.append(Record(seq, kind, p, rec, blocks, str(path)))
        at = end
    return Segment(path, out, torn, size)


def _plain_int(x: Any) -> int:
    """``x`` if it is an int (a record's numbers are; a float or anything else is damage)."""
    if type(x) is not int:
        raise ValueError(f"{x!r} where a record holds an integer")
    return x


def read_base(unit_dir: Path) -> dict[str, Any]:
    """A unit directory's last truncation (``seq``: records below it were dropped, an int;
    ``snapshot``); SnapshotError naming the file if it is not that."""
    try:
        got = json.loads((unit_dir / BASE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise E.SnapshotError(f"{unit_dir / BASE} does not parse ({err})", component=str(unit_dir / BASE)) from None
    seq = got.get("seq", 0) if isinstance(got, dict) else None
    if type(seq) is not int or seq < 0:
        raise E.SnapshotError(f"{unit_dir / BASE} is damaged: it needs 'seq', the change number it was truncated at",
                              component=str(unit_dir / BASE))
    return got


def base(root: str | os.PathLike[str]) -> tuple[int, str]:
    """The journal's last truncation (every unit's ``BASE``; only these small files are read):
    the change number it starts at (0: never truncated) and the snapshot that truncated it.

    Example: ``seq, snap = base("/var/lib/rlplane/journal")``"""
    path, seq, snap = Path(root), 0, ""
    if path.is_dir():
        for unit_dir in sorted(d for d in path.iterdir() if d.is_dir()):
            b = read_base(unit_dir)
            if int(b.get("seq") or 0) > seq:
                seq, snap = int(b["seq"]), str(b.get("snapshot") or "")
    return seq, snap


class Journal:
    """A journal directory read back: every unit's segments, checked, merged by sequence
    number (a change several units journalled is one change; a put's blocks are gathered
    from every unit that held one). Use :meth:`open`."""

    def __init__(self, root: Path, segments: list[Segment], base: int, base_snapshot: str) -> None:
        self.root = root
        self.segments = segments
        self.base, self.base_snapshot = base, base_snapshot
        self.changes: dict[int, Record] = {}
        void: set[int] = set()
        for seg in segments:
            for r in seg.records:
                if r.kind == VOID:
                    void.add(r.seq)
                    continue
                got = self.changes.get(r.seq)
                if got is None:
                    self.changes[r.seq] = Record(r.seq, r.kind, r.partition, r.rec, dict(r.blocks), r.where)
                else:
                    for b, fields in r.blocks.items():
                        got.blocks.setdefault(b, fields)
        self.last_seq = max([*self.changes, *void], default=0)
        for seq in void:  # a change some unit voided was answered as failed: no unit's copy of it counts
            self.changes.pop(seq, None)
        self.torn = [f"{seg.path}: {seg.torn}" for seg in segments if seg.torn]

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Journal:
        """Read and check every segment under ``root`` (an empty or missing one is an empty journal)."""
        path = Path(root)
        segments = []
        if path.is_dir():
            for unit_dir in sorted(d for d in path.iterdir() if d.is_dir()):
                segments += [read_segment(s) for s in sorted(unit_dir.glob(SEGMENT_GLOB))]
        return cls(path, segments, *base(path))

    def after(self, seq: int) -> list[Record]:
        """The changes from sequence number ``seq`` on, in order."""
        return [self.changes[s] for s in sorted(self.changes) if s >= seq]

    def fields(self, since: int) -> set[str]:
        return {str(f) for r in self.after(since) if r.kind == PUT for f in r.rec.get("fields") or ()}


@dataclass(frozen=True)
class ReplayInfo:
    """What a replay applied: changes, samples put, samples cleared, acks, the last
    sequence number, records skipped as torn and changes that could not apply (why)."""

    changes: int
    samples: int
    cleared: int
    acks: int
    last_seq: int
    torn: list[str]
    skipped: list[str]
    expired: int = 0  # samples a claim found stale, expired again


def check(journal: Journal, since: int, declared: Collection[str] | None, snapshot: str = "") -> None:
    """Refuse, before anything is loaded, a journal that cannot continue a snapshot cut at
    ``since`` (it was truncated after it) or that holds fields the service does not declare."""
    if journal.base > since:
        what = f"snapshot {snapshot}" if snapshot else "an empty store"
        later = f" ({journal.base_snapshot})" if journal.base_snapshot else ""
        raise E.SnapshotError(f"the journal in {journal.root} was truncated at a later snapshot{later} (it starts at "
                              f"change {journal.base}, {what} ends before change {since}): restore from that "
                              "snapshot, or empty the journal directory to start afresh", component=str(journal.root))
    odd = sorted(journal.fields(since) - set(declared)) if declared is not None else []
    if odd:
        raise E.UnregisteredFieldError(f"the journal in {journal.root} holds field(s) {odd} this service does not "
                                       "declare: add them to its registry (RLPLANE_REGISTRY_FILE); nothing was loaded",
                                       field=odd[0])


def _born_of(r: Record, n: int) -> np.ndarray | None:
    """The incarnations a put record gave its new samples (rlplane.tags.BORN_TAG): those
    it names (a snapshot's restore), else its reservation's; None for a record with neither."""
    given = r.rec.get("bn")
    if isinstance(given, bytes) and len(given) == 8 * n:
        born = np.frombuffer(given, "<i8").astype(np.int64)
        return born if not born.size or (int(born.min()) >= 0 and int(born.max()) < 1 << 62) else None
    rid = r.rec.get("rid")
    return np.full(n, incarnation(rid), np.int64) if isinstance(rid, str) else None


def replay(transport: Any, journal: Journal, since: int, *, touched: list[str] | None = None,
           progress: Callable[[str], None] | None = None) -> ReplayInfo:
    """Apply the journal's changes from ``since`` on to the store ``transport`` reaches, in
    order: puts (with their ids, rows and tags), clears and acks. ``touched`` collects
    the partitions written (the caller takes them back if it fails). A put whose blocks
    no unit journalled whole (a crash before its group reached the disk) is skipped and
    named in ``skipped``.

    Example: ``replay(client.transport, Journal.open(d), snapshot_seq).samples``
    """
    say = progress or (lambda msg: None)
    todo = journal.after(since)
    samples = cleared = acks = expired = 0
    skipped: list[str] = []
    for k, r in enumerate(todo):
        if touched is not None and r.partition not in touched and r.kind == PUT:
            touched.append(r.partition)
        if r.kind == PUT:
            try:
                got = _put_of(r)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, E.RlplaneError) as err:
                raise E.SnapshotError(f"journal file {r.where}: change {r.seq} does not describe a put ({err!r}); "
                                      "nothing of the journal stays loaded", component=r.where) from None
            if isinstance(got, str):
                skipped.append(got)
                continue
            ids, columns, tags, create = got
            born = _born_of(r, len(ids)) if create and getattr(transport, "checks_born", False) else None
            try:
                if born is not None:  # the samples stay the incarnations metas from before the crash name
                    transport.put(r.partition, ids, columns, tags, create=create, born=born)
                else:
                    transport.put(r.partition, ids, columns, tags, create=create)
            except (E.MissingDataError, E.LeaseError) as err:  # an extension of samples cleared or lost since
                skipped.append(f"change {r.seq} ({r.partition!r}): {err}")
                continue
            samples += len(ids) if create else 0
        elif r.kind == DROP:
            cleared += transport.clear(_checked(r)[0])
        elif r.kind == CLEAR:
            cleared += transport.clear(*_checked(r))
        else:  # an ack, or samples a claim found stale ({"state": "expired"})
            ids = _checked(r)[1]
            stale = r.rec.get("state") == "expired"
            if not stale and r.rec.get("state") is not None:  # written by a later rlplane: not an ack
                skipped.append(f"change {r.seq} ({r.partition!r}): consumption state {r.rec.get('state')!r} unknown")
                continue
            try:
                marked = _ack(transport, r.partition, str(r.rec.get("task")), ids, _EXPIRED if stale else _ACKED)
            except (E.MissingDataError, E.InvalidArgumentError) as err:
                skipped.append(f"change {r.seq} ({'expiry' if stale else 'ack'} on {r.partition!r}): {err}")
                continue
            if stale:
                expired += marked
            else:
                acks += marked
        if k % 256 == 255:
            say(f"journal: {k + 1} of {len(todo)} changes replayed")
    if skipped:
        log.error("journal replay: %d change(s) could not apply: %s", len(skipped), "; ".join(skipped[:5]))
    for t in journal.torn:
        log.warning("journal replay: skipped a torn last record: %s", t)
    return ReplayInfo(len(todo), samples, cleared, acks, todo[-1].seq if todo else since - 1, list(journal.torn),
                      skipped, expired)


def _checked(r: Record) -> tuple[str, list[str]]:
    """A clear's, drop's or ack's partition and sample ids, checked: SnapshotError naming
    the file for a record that holds no such thing (its checksum passed: it was written so)."""
    ids = r.rec.get("ids") or []
    try:
        check_partition(r.partition)
        if r.kind == ACK:
            check_task(r.rec.get("task"))
        if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids):
            raise E.WireFormatError("its 'ids' are not a list of sample ids")
    except E.RlplaneError as err:
        raise E.SnapshotError(f"journal file {r.where}: change {r.seq} ({r.kind}) is damaged: {err}; nothing of the "
                              "journal stays loaded", component=r.where) from None
    return r.partition, ids


def _ack(transport: Any, partition: str, task: str, ids: list[str], state: int = _ACKED) -> int:
    """Mark ``ids`` acked (or ``state``) for ``task``, CONSUMPTION_BATCH at a time; the ones
    the store no longer holds (cleared after the ack) are left out, not the whole ack.
    Returns how many were marked."""
    marked = 0
    for a in range(0, len(ids), CONSUMPTION_BATCH):
        part = ids[a : a + CONSUMPTION_BATCH]
        for _ in range(2):
            if not part:
                break
            try:
                transport.set_consumption(partition, task, part, np.full(len(part), state, np.int8).tobytes())
                marked += len(part)
                break
            except E.MissingDataError as err:
                gone = set(err.missing or ())
                if not gone:
                    raise
                part = [i for i in part if i not in gone]
    return marked


#: Ids one replayed ack or expiry marks per request (a record of many ids, e.g. a claim
#: that expired a stale backlog, would be a request past the engine's header limit).
CONSUMPTION_BATCH = 1 << 16


def _put_of(r: Record) -> tuple[list[str], dict[str, Any], list[dict[str, Any]], bool] | str:
    """A journalled put as ``(ids, columns, tags, create)``, or why it cannot be replayed."""
    import torch  # here: a storage unit writes journals with this module and never loads torch

    from rlplane.column import Column
    from rlplane.dtypes import dtype_from_name
    from rlplane.geometry import Geometry
    from rlplane.integrity import check_rows, row_sums

    rec = r.rec
    ids = [str(s) for s in rec["ids"]]
    fields = [str(f) for f in rec["fields"]]
    # as recorded: in row order (the controller checked so; block ids are random, never an order)
    blocks = [(int(b), int(a), int(z)) for b, _, a, z in rec["blocks"]]
    missing = [b for b, _, _ in blocks if b not in r.blocks or not set(fields) <= set(r.blocks[b])]
    if missing:
        return (f"change {r.seq} ({r.partition!r}, {len(ids)} samples): block(s) {missing[:3]} are in no unit's "
                "journal (the store died before they reached the disk)")
    dtypes = {str(f): str(d) for f, d in (rec["x"][0][1].items() if rec.get("x") else ())}
    columns = {}
    twins = rec.get("s") or {}
    for f in fields:
        dtype = dtype_from_name(dtypes[f])
        row_bytes = np.frombuffer(rec["nb"][f], "<i8")
        same = np.frombuffer(twins[f], "<i8").astype(np.int64) if f in twins else None
        if same is not None:  # a row repeating an earlier one was stored empty (rlplane.dedup)
            if same.size != row_bytes.size:
                return f"change {r.seq} ({r.partition!r}): field {f!r} names twins for other rows"
            row_bytes = np.where(same >= 0, 0, row_bytes)
        size = torch.empty(0, dtype=dtype).element_size()
        parts = [np.frombuffer(r.blocks[b][f], np.uint8) for b, _, _ in blocks]
        raw = np.concatenate(parts) if len(parts) != 1 else parts[0].copy()
        if raw.size != int(row_bytes.sum()):
            return f"change {r.seq} ({r.partition!r}): field {f!r} holds {raw.size} bytes, its rows {row_bytes.sum()}"
        values = torch.from_numpy(raw).view(dtype) if raw.size else torch.empty(0, dtype=dtype)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(row_bytes // size)]).astype(np.int64))
        sums = np.frombuffer(rec["h"][f], "<u8") if rec.get("h") and f in rec["h"] else None
        columns[f] = Column(values, offsets, same=same).with_meta(sums, Geometry.from_wire(rec["g"][f], f))
        if sums is not None:  # each row is the one its writer digested
            try:
                check_rows(r.partition, ids, f, row_sums(columns[f]), sums)
            except E.IntegrityError as err:  # a writer's wrong digests, or a damaged record: this change only
                return f"change {r.seq} ({r.partition!r}): {err}"
    user = rec.get("user")
    tags = [dict(t) if isinstance(t, dict) else {} for t in user] if user else [{} for _ in ids]
    return ids, columns, tags, rec.get("create") is True


def segments(root: Path) -> Iterator[Path]:
    """Every segment file under journal directory ``root``."""
    if root.is_dir():
        for unit_dir in sorted(d for d in root.iterdir() if d.is_dir()):
            yield from sorted(unit_dir.glob(SEGMENT_GLOB))


__all__ = ["Journal", "Record", "Segment", "ReplayInfo", "read_segment", "read_base", "base", "replay", "check", "frame",
           "trailer", "segments", "MAGIC", "PUT", "CLEAR", "DROP", "ACK", "VOID", "BASE", "SEGMENT_GLOB"]
