"""Snapshots of a native store: a consistent cut of every partition and every task's
consumption, written to a directory; and the restore of one into another store.

**Taking one** (:func:`take`): the controller cuts the store under its lock (every
commit, clear, claim and ack is on one side of it entirely: see
:mod:`rlplane_service.native.cut`), pins every block the cut names, and answers where
the rows are. Then the bytes are copied, one field of one partition at a time, straight
from the units (the mapped slabs on this host, or their sockets) into the snapshot's
files, while writes and claims go on; the pin is renewed meanwhile and released at the
end. What is kept: every committed sample's rows of every field, bit for bit, with
their geometry, digests and user tags, in commit order; per task, which samples were
acked or expired (a lease in flight comes back as pending, since its claimer may never ack).

**On disk**: a directory ``PATH`` holding ``manifest.json`` (format version, when, what,
and each file's size and xxh3-128) and one ``part-NNNNN.rlsnap`` per partition (a magic,
a msgpack header, then the values). It is written as ``PATH.tmp-*``, every file fsynced,
then renamed to ``PATH`` and the parent directory fsynced: a snapshot is complete, or
there is no ``PATH``.

**Restoring** (:func:`restore`): the manifest is read and every file checked to be there
at its size before anything is stored; then partition by partition, its file is checked
against its xxh3-128 and its header parsed, its samples are put back with their ids and
tags (into a store with any number of storage units) and its tasks' consumption is set,
while the next files are read ahead. A missing, truncated or damaged file, or
another format version, is :class:`~rlplane.errors.SnapshotError` naming the file, and
the partitions loaded before it are taken back: nothing of a refused snapshot stays.

Example::

    info = snapshot.take(transport, "/snapshots/step-1200")   # SnapshotInfo(samples=..., nbytes=...)
    snapshot.restore(other_transport, "/snapshots/step-1200")
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Collection, Iterator

import msgpack
import numpy as np
import torch
import xxhash

from rlplane import errors as E
from rlplane import parallel
from rlplane.column import Column
from rlplane.shm import populate
from rlplane.snapplace import Local, Remote, is_url, lasting, local, place
from rlplane.dtypes import dtype_from_name, dtype_name
from rlplane.geometry import Geometry
from rlplane.names import MAX_ID_LEN, MAX_NAME_LEN, check_task
from rlplane.tags import tag_problem
from rlplane.wire import raw

log = logging.getLogger(__name__)

#: The snapshot format this code writes and reads.
FORMAT, VERSION = "rlplane-snapshot", 1
MAGIC = b"RLSNAP01"
MANIFEST = "manifest.json"
#: Samples one put of a restore carries at most (and bytes, roughly).
RESTORE_BATCH, RESTORE_BYTES = 4096, 256 << 20
#: Task states a snapshot keeps (rlplane_service.ledger): pending, acked, expired.
_STATES = (0, 2, 3)
_ALIGN = 64


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot holds and what it took: ``path``, ``partitions``, ``samples``, ``nbytes``
    (values), ``files_bytes`` (on disk), ``tasks`` (partition/task pairs), ``cut_ms`` (how
    long the cut held the controller's lock: the longest a commit or claim waited for it), ``seconds`` (all of it), ``created`` (unix time);
    ``seq``: the cut's change number (a journal continues from it); after a restore with a
    journal, ``journal``: what its replay applied (:class:`rlplane.journal.ReplayInfo`)."""

    path: str
    partitions: int
    samples: int
    nbytes: int
    files_bytes: int
    tasks: int
    cut_ms: float
    seconds: float
    created: float
    partition_names: list[str] = field(default_factory=list)
    seq: int = 0
    journal: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- taking -------------------------------------------------------------------------------
#: The nice value of a snapshot's copying and writing threads: they yield the CPU to the
#: store's serving threads in the same process or host (Linux; a no-op elsewhere). Not the
#: idle class: a thread that never runs while the cores are busy can hold the interpreter
#: lock, and stall the process's serving threads, for as long. Not 19 either: with two
#: busy processes at nice 0 on this 2-core VM a snapshot at 19 wrote 0.03 GB/s (at 10: 0.17),
#: holding its pins, and the blocks they keep, that much longer.
NICE = 10


def take(transport: Any, path: str | os.PathLike[str], *, progress: Callable[[str], None] | None = None
         ) -> SnapshotInfo:
    """Snapshot the store ``transport`` reaches (a native one) into directory ``path``
    (which must not exist; its parent must), or into an fsspec URL (``s3://...``, with
    that scheme's driver installed; :mod:`rlplane.snapplace`). Returns what was written.
    The copying and writing run on threads of their own at nice ``NICE`` (their files
    written around the page cache), so puts and reads served on the same host keep their
    latency while it copies; the thread that keeps the cut's pin alive runs at this
    thread's priority, so a busy host cannot starve it.

    Example: ``take(client.transport, "/mnt/snap/run-7-step-1200").samples``
    """
    renewer = _Renewer(transport)  # started here: threads inherit their maker's priority
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="rlplane-snapshot", initializer=_yield_cpu) as worker:
            return worker.submit(_take, transport, path, progress, renewer).result()
    finally:
        renewer.stop()


def _yield_cpu() -> None:
    """Lower this thread's CPU priority to nice ``NICE`` and keep its memory work on it
    (:func:`rlplane.parallel.background`, not on the shared threads at normal priority).
    A thread of its own: it ends with the snapshot."""
    parallel.background()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the snapshot runs at normal priority
        pass


def _take(transport: Any, path: str | os.PathLike[str], progress: Callable[[str], None] | None,
          renewer: _Renewer) -> SnapshotInfo:
    if not hasattr(transport, "cut"):
        raise E.InvalidArgumentError(f"snapshots need the native backend (this store's transport is "
                                     f"{getattr(transport, 'name', type(transport).__name__)!r})")
    dest = place(path)
    dest.check_new()
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    cut = transport.cut()
    cut_ms = float(cut.get("held_ms") or 0.0)  # what the controller's lock was held for (the pause writers see)
    pin = cut.get("pin")
    tmp: Local | Remote | None = None
    renewer.arm(pin, float(cut.get("pin_lease_s") or 60.0))
    try:
        tmp = dest.temporary()
        files, parts, samples, nbytes = {}, [], 0, 0
        # One thread writes (and fsyncs) a partition's file while the next one's rows are
        # collected: views of the slabs mapped here, copied once, into the file's buffers;
        # rows on other hosts are copied out of their units first (at most two partitions'
        # bytes held at once).
        with ThreadPoolExecutor(1, thread_name_prefix="rlplane-snapshot-write", initializer=_yield_cpu) as disk:
            pending: Future | None = None
            for k, entry in enumerate(cut["partitions"]):
                name = f"part-{k:05d}.rlsnap"
                say(f"snapshot: partition {entry['p']!r} ({len(entry['ids'])} samples)")
                header, blobs = _collect(transport, entry)
                if pending is not None:
                    pending.result()
                pending = disk.submit(_write_file, tmp, header, blobs, files, name)
                size = sum(r.nbytes for runs in blobs for r in runs)
                parts.append({"name": entry["p"], "file": name, "samples": len(entry["ids"]), "nbytes": size,
                              "fields": sorted(entry["fields"]), "tasks": sorted(entry["tasks"])})
                samples += len(entry["ids"])
                nbytes += size
                del header, blobs
            if pending is not None:
                pending.result()
        renewer.check()
        created = time.time()
        manifest = {"format": FORMAT, "version": VERSION, "created": created, "cut_ms": round(cut_ms, 3),
                    "seq": int(cut.get("seq") or 0), "partitions": parts, "files": files, "samples": samples,
                    "nbytes": nbytes}
        tmp.put(MANIFEST, json.dumps(manifest, indent=1).encode())
        tmp.move_to(dest, last=MANIFEST)  # complete or absent: the manifest goes in last
    except BaseException:
        if tmp is not None:
            tmp.discard()
        raise
    finally:
        renewer.stop()
        if isinstance(pin, str):
            transport.unpin(pin)
    info = SnapshotInfo(str(dest), len(parts), samples, nbytes, sum(f["bytes"] for f in files.values()),
                        sum(len(p["tasks"]) for p in parts), round(cut_ms, 3), round(time.monotonic() - t0, 3),
                        created, [p["name"] for p in parts], int(cut.get("seq") or 0))
    try:
        # (its journal is truncated: at a lasting place only, recorded absolute for a restore elsewhere)
        seq = int(cut.get("seq") or 0) if lasting(path) else 0
        transport.snapshotted(info.files_bytes, info.seconds, info.samples, seq or None, _where(path))
    except E.RlplaneError as err:  # the snapshot is on disk; only its metrics miss it
        log.warning("the controller was not told of snapshot %s: %s", dest, err)
    say(f"snapshot: {samples} samples, {nbytes} bytes in {info.seconds:.2f} s -> {dest}")
    return info


def _collect(transport: Any, entry: dict[str, Any]) -> tuple[bytes, list[list[memoryview]]]:
    """One partition's file contents: the header (ids, tags, consumption, per field its
    rows' positions, dtype, offsets, geometry, digests and where its values are) and each
    field's values, as the runs of bytes that make them up. Rows in a slab mapped here are
    handed over as views of it (the cut's pin holds them; the file's writer copies them
    once, straight into its buffers); others are copied out of their units first."""
    p, ids = entry["p"], list(entry["ids"])
    fields, blobs, at = {}, [], 0
    for name, fe in sorted(entry["fields"].items()):
        pos = np.frombuffer(fe["at"], "<i8")
        sub = [ids[i] for i in pos.tolist()] if pos.size != len(ids) else ids
        loc = fe["loc"]
        mapped = transport.slab_runs(loc, len(sub), name)
        if mapped is not None:
            dtype, runs, offsets, same = mapped
        else:
            col = transport.fetch(loc, p, sub, [name])[0][name]
            dtype, runs, offsets, same = dtype_name(col.dtype), [raw(col.values)], col.offsets.numpy(), col.same
        nbytes = sum(r.nbytes for r in runs)
        fields[name] = {"at": fe["at"], "dtype": dtype, "offsets": offsets.astype("<i8", copy=False).tobytes(),
                        "g": loc["g"][name], "h": loc["h"][name], "start": at, "nbytes": nbytes}
        if same is not None:  # rows stored once for several samples stay so on disk and after a restore
            fields[name]["s"] = same.astype("<i8").tobytes()
        blobs.append(runs)
        at += -(-nbytes // _ALIGN) * _ALIGN
    head = {"p": p, "ids": ids, "user": entry.get("user"), "tasks": entry["tasks"], "fields": fields}
    if isinstance(entry.get("bn"), bytes):  # each sample's incarnation: metas from before the snapshot still name them
        head["bn"] = entry["bn"]
    header = msgpack.packb(head, use_bin_type=True)
    return header, blobs


#: Bytes of a file's contents copied for writing and digested at a time (they stay in cache between).
_PIECE = 1 << 20


def _write_file(where: Local | Remote, header: bytes, blobs: list[list[memoryview]], files: dict[str, Any],
                name: str) -> None:
    """Write a partition's file (magic, header, each field's values 64-byte aligned; a
    field's values are the runs of ``blobs``) and fsync it; its size and xxh3-128 go into
    ``files[name]``."""
    h = xxhash.xxh3_128()
    with where.open(name) as f:  # around the page cache where it can: puts elsewhere keep their latency
        head = MAGIC + struct.pack("<Q", len(header)) + header
        head += b"\0" * (-len(head) % _ALIGN)
        chunks: list[Any] = [head]
        for runs in blobs:
            chunks += runs
            chunks.append(b"\0" * (-sum(r.nbytes for r in runs) % _ALIGN))
        for chunk in chunks:
            whole = memoryview(chunk).cast("B")
            for at in range(0, whole.nbytes, _PIECE):  # digested while the piece is in cache
                piece = whole[at:at + _PIECE]
                f.write(piece)
                h.update(piece)
        size = f.close()
    files[name] = {"bytes": size, "xxh3_128": h.hexdigest()}


class _Renewer:
    """Renews the cut's pin every third of its lease while the bytes are copied. Its thread
    starts with the object (at its maker's priority) and waits for :meth:`arm`."""

    def __init__(self, transport: Any) -> None:
        self._transport, self._pin, self._every = transport, None, 1.0
        self._armed, self._stop = threading.Event(), threading.Event()
        self.gone: str | None = None
        self._thread = threading.Thread(target=self._loop, name="rlplane-snapshot-pin", daemon=True)
        self._thread.start()

    def arm(self, pin: Any, lease_s: float) -> None:
        """Keep ``pin`` alive from now on (nothing to do for a cut without one)."""
        self._pin, self._every = pin, max(0.5, lease_s / 3)
        self._armed.set()

    def _loop(self) -> None:
        self._armed.wait()  # set by arm, or by stop
        if not isinstance(self._pin, str):
            return
        while not self._stop.wait(self._every):
            try:
                if self._transport.renew([self._pin]):
                    self.gone = "the controller dropped the snapshot's pin (did it restart?)"
                    return
            except E.RlplaneError as err:
                self.gone = f"the snapshot's pin could not be renewed: {err}"
                return

    def check(self) -> None:
        """IntegrityError when the pin lapsed (asked once more now): the bytes copied may have been reused."""
        if not self.gone and isinstance(self._pin, str):
            try:
                if self._transport.renew([self._pin]):
                    self.gone = "the controller dropped the snapshot's pin (did it restart?)"
            except E.RlplaneError as err:
                self.gone = f"the snapshot's pin could not be renewed: {err}"
        if self.gone:
            raise E.IntegrityError(f"{self.gone}; nothing was written: take the snapshot again")

    def stop(self) -> None:
        self._stop.set()
        self._armed.set()


#: Bytes a restore's read-ahead faults in per call, one call at a time on a thread of its own
#: per file. One sequential stream let the kernel's read-ahead run: a cold 1 GiB file here read
#: 1.6-1.9 GB/s that way against 1.2-1.5 GB/s with four 16 MiB requests in flight, and a
#: restore of 1 GiB in 8 files 1.01-1.21 GB/s against 0.84-1.20 (2026-12-06, alternated).
_READ_CHUNK = 64 << 20
#: Files read ahead of the one being loaded (each on a thread of its own): with one, the disk
#: idled while a partition's rows were copied in; with two, rlplane bench --durability --gib 1
#: restored 1.27-1.30 GB/s against 1.06-1.22 (three alternated pairs, 2026-12-06).
_FILES_AHEAD = 2


def _read_through(fd: int, mapped: np.ndarray) -> None:
    """Fault ``mapped`` (a file's mapping) into this process ``_READ_CHUNK`` bytes at a
    time, first to last: read from the disk into the page cache and mapped, so the checks
    and copies after find them (no page fault each 4 kB, no copy out to a buffer). Where
    the kernel lacks the advice, read them into a buffer and drop it (they stay in the
    page cache). ``fd``: a descriptor of the file of its own, closed here."""
    buf: np.ndarray | None = None
    try:
        for at in range(0, mapped.size, _READ_CHUNK):
            piece = mapped[at : at + _READ_CHUNK]
            if buf is None and not populate(piece, write=False):
                buf = np.empty(min(_READ_CHUNK, mapped.size), np.uint8)
            if buf is not None and os.preadv(fd, [buf[: piece.size]], at) <= 0:
                return
    except OSError as err:  # the faults read what is left
        log.debug("restore read-ahead stopped: %s", err)
    finally:
        os.close(fd)


# -- reading ------------------------------------------------------------------------------
@dataclass
class _Part:
    """One partition of a snapshot, parsed and checked (its values stay in the mapped file)."""

    name: str
    ids: list[str]
    user: list[Any] | None
    tasks: dict[str, np.ndarray]
    fields: dict[str, tuple[np.ndarray, Column]]  # name -> (positions in ids, column)
    born: np.ndarray | None = None  # each sample's incarnation (rlplane.tags.BORN_TAG); None: not kept


class Snapshot:
    """A snapshot on disk. Opening it reads the manifest and checks that every file is
    there at its size; :meth:`part` maps a partition's file, checks it against its digest
    and parses its header (SnapshotError naming the file); :meth:`release` unmaps it. At
    most the files being loaded and read ahead are open at once, whatever the number of
    partitions (a snapshot of thousands restores under a limit of 1024 descriptors). Close
    it (or use ``with``) to unmap what is still mapped."""

    def __init__(self, path: str | os.PathLike[str], *, shown: str | None = None) -> None:
        self.path = Path(path)
        self.shown = shown or str(self.path)  # what errors name (a URL the files were fetched from)
        self._maps: dict[int, Any] = {}
        self._files: dict[int, BinaryIO] = {}
        self.manifest = self._manifest()
        for entry in self.manifest["partitions"]:
            self._sized(entry)

    def __len__(self) -> int:
        return len(self.manifest["partitions"])

    def _bad(self, name: str, why: str) -> E.SnapshotError:
        where = f"{self.shown.rstrip('/')}/{name}"
        return E.SnapshotError(f"{where} {why}; nothing of the snapshot was loaded", component=str(where))

    def _sized(self, entry: Any) -> str:
        """Partition ``entry``'s file name, once the file is there at the size the manifest says."""
        name = str(entry.get("file")) if isinstance(entry, dict) else "?"
        want = self.manifest["files"].get(name)
        if not isinstance(want, dict) or "/" in name or "\0" in name or name.startswith("."):
            raise self._bad(name, "is named by the manifest without its size and digest")
        try:
            size = os.stat(self.path / name).st_size
        except OSError as err:
            raise self._bad(name, f"cannot be opened ({err.strerror})") from None
        if size != want.get("bytes"):
            raise self._bad(name, f"holds {size} bytes where the manifest says {want.get('bytes')} (truncated?)")
        return name

    def _map(self, k: int) -> Any:
        """Partition ``k``'s file, mapped (once; until :meth:`release`)."""
        if k not in self._maps:
            name = self._sized(self.manifest["partitions"][k])  # (again: it may have changed since the open)
            try:
                f = open(self.path / name, "rb")
            except OSError as err:
                raise self._bad(name, f"cannot be opened ({err.strerror})") from None
            self._files[k] = f
            size = os.fstat(f.fileno()).st_size
            self._maps[k] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return self._maps[k]

    def release(self, k: int) -> None:
        """Unmap partition ``k``'s file and close it (a tensor still viewing it keeps the
        mapping alive until it goes)."""
        m, f = self._maps.pop(k, None), self._files.pop(k, None)
        try:
            if isinstance(m, mmap.mmap):
                m.close()
        except BufferError:
            pass
        if f is not None:
            f.close()

    def prefetch(self, k: int) -> None:
        """Fault partition ``k``'s file into its mapping on a thread of its own while
        another is loaded (:func:`_read_through`): its check and its puts then find every
        page mapped instead of reading the disk 4 kB at a time."""
        if 0 <= k < len(self) and isinstance(m := self._map(k), mmap.mmap):
            threading.Thread(target=_read_through, args=(os.dup(self._files[k].fileno()), np.frombuffer(m, np.uint8)),
                             name="rlplane-restore-readahead", daemon=True).start()

    def part(self, k: int) -> _Part:
        """Partition ``k``, its file checked against its digest and its header parsed."""
        return self._part(self.manifest["partitions"][k], self._map(k))

    def _manifest(self) -> dict[str, Any]:
        where = f"{self.shown.rstrip('/')}/{MANIFEST}"
        try:
            m = json.loads((self.path / MANIFEST).read_bytes())
        except FileNotFoundError:
            raise E.SnapshotError(f"{where} does not exist: {self.shown} is not a complete snapshot",
                                  component=str(where)) from None
        except (OSError, ValueError) as err:
            raise E.SnapshotError(f"{where} does not parse ({err})", component=str(where)) from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise E.SnapshotError(f"{where} is not an rlplane snapshot's manifest", component=str(where))
        if m.get("version") != VERSION:
            raise E.SnapshotError(f"{where} is of snapshot format version {m.get('version')!r}; this rlplane "
                                  f"reads version {VERSION}", component=str(where))
        if not isinstance(m.get("partitions"), list) or not isinstance(m.get("files"), dict):
            raise E.SnapshotError(f"{where} lists no partitions or files", component=str(where))
        # Every value the restore uses, checked before anything is loaded (a damaged manifest
        # must not fail once partitions are in, or name other partitions than its files hold).
        names = [p.get("name") if isinstance(p, dict) else None for p in m["partitions"]]
        odd = (not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names)
               or not all(isinstance(p.get("file"), str) for p in m["partitions"])
               or not all(isinstance(f, dict) and _count(f.get("bytes")) and isinstance(f.get("xxh3_128"), str)
                          for f in m["files"].values())
               or not (m.get("seq") is None or _count(m["seq"]))
               or not (m.get("created") is None or (type(m["created"]) in (int, float) and math.isfinite(m["created"]))))
        if odd:
            raise E.SnapshotError(f"{where} is damaged: its partitions need distinct names and files, its files sizes "
                                  "and digests, its seq and created numbers", component=str(where))
        return m

    def _part(self, entry: dict[str, Any], buf: Any) -> _Part:
        name = str(entry.get("file"))
        size = len(buf)

        def bad(why: str) -> E.SnapshotError:
            return self._bad(name, why)

        if xxhash.xxh3_128_hexdigest(buf) != self.manifest["files"][name].get("xxh3_128"):
            raise bad("does not match its digest in the manifest (damaged)")
        view = memoryview(buf)
        if size < 16 or bytes(view[:8]) != MAGIC:
            raise bad("is not an rlplane snapshot partition file")
        (hlen,) = struct.unpack("<Q", view[8:16])
        try:
            h = msgpack.unpackb(view[16 : 16 + hlen], raw=False, strict_map_key=False)
            base = -(-(16 + hlen) // _ALIGN) * _ALIGN
            if not (isinstance(h, dict) and isinstance(h.get("ids"), list) and isinstance(h.get("tasks"), dict)
                    and isinstance(h.get("fields"), dict)):
                raise ValueError("it is not a map of ids, tasks and fields")
            if h.get("p") != entry.get("name"):  # the partition the manifest names, which the restore checked
                raise ValueError(f"it holds partition {h.get('p')!r} where the manifest says {entry.get('name')!r}")
            ids = h["ids"]
            n = len(ids)
            if not all(isinstance(i, str) and 0 < len(i) <= MAX_ID_LEN for i in ids) or len(set(ids)) != n:
                raise ValueError(f"its sample ids are not distinct strings of 1-{MAX_ID_LEN} characters")
            user = h.get("user")
            if user is not None and not (isinstance(user, list) and len(user) == n
                                         and all(t is None or isinstance(t, dict) for t in user)):
                raise ValueError("its tags are not one map (or none) per sample")
            odd = next((p for p in (tag_problem(t, strict=False) for t in user or () if t) if p), None)
            if odd:
                raise ValueError(f"a sample's tags hold {odd}")
            for t in h["tasks"]:
                check_task(t)
            if not all(isinstance(f, str) and 0 < len(f) <= MAX_NAME_LEN for f in h["fields"]):
                raise ValueError(f"its field names are not strings of 1-{MAX_NAME_LEN} characters")
            born = h.get("bn")
            if born is not None:
                if not isinstance(born, bytes) or len(born) != 8 * n:
                    raise ValueError("its incarnations are not one int64 per sample")
                born = np.frombuffer(born, "<i8").astype(np.int64)
                if born.size and (int(born.min()) < 0 or int(born.max()) >= 1 << 62):
                    raise ValueError("its incarnations lie outside [0, 2**62)")
            tasks = {str(t): np.frombuffer(s, np.int8) for t, s in h["tasks"].items()}
            if any(s.size != n or not bool(np.isin(s, _STATES).all()) for s in tasks.values()):
                raise ValueError("bad consumption states")
            fields = {}
            for fname, fe in h["fields"].items():
                pos = np.frombuffer(fe["at"], "<i8")
                offsets = np.frombuffer(fe["offsets"], "<i8")
                dtype = dtype_from_name(fe["dtype"])
                if not (_count(fe["start"]) and _count(fe["nbytes"])):
                    raise ValueError(f"field {fname!r} has no start and size")
                start, nb = base + fe["start"], fe["nbytes"]
                if start + nb > size or offsets.size != pos.size + 1 or (pos.size and (pos.min() < 0 or pos.max() >= n)):
                    raise ValueError(f"field {fname!r} lies outside the file")
                if np.unique(pos).size != pos.size:
                    raise ValueError(f"field {fname!r} names a sample twice")
                with warnings.catch_warnings():  # read-only: the restore only copies out of it
                    warnings.simplefilter("ignore", UserWarning)
                    values = torch.frombuffer(view[start : start + nb], dtype=torch.uint8) if nb else \
                        torch.empty(0, dtype=torch.uint8)
                values = values.view(dtype)
                if int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or bool((np.diff(offsets) < 0).any()):
                    raise ValueError(f"field {fname!r}'s row offsets do not fit its values")
                g = Geometry.from_wire(fe["g"], fname)
                sums = np.frombuffer(fe["h"], "<u8")
                same = np.frombuffer(fe["s"], "<i8").astype(np.int64) if fe.get("s") is not None else None
                col = Column(values, torch.from_numpy(offsets.copy()), same=same).with_meta(sums, g)
                fields[str(fname)] = (pos, col)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError, E.RlplaneError, RuntimeError) as err:
            raise bad(f"has a bad header ({err})") from None
        return _Part(h["p"], ids, user, tasks, fields, born)

    def close(self) -> None:
        for k in list(self._maps):
            self.release(k)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore(transport: Any, path: str | os.PathLike[str] | None, *, progress: Callable[[str], None] | None = None,
            declared: Collection[str] | None = None, journal: str | os.PathLike[str] | None = None,
            newest: bool = False) -> SnapshotInfo:
    """Load snapshot ``path`` (a directory, or an fsspec URL whose files are fetched into
    ``TMPDIR`` first) into the (empty of its partitions) store ``transport`` reaches: every sample with its id, rows and tags, then each task's consumption; then,
    with ``journal`` (a journal directory, RLPLANE_JOURNAL_DIR), every change the journal
    holds after the snapshot's cut (``path=None``: the journal alone, on an empty store;
    a journal a snapshot truncated continues that snapshot, which is then loaded first).
    SnapshotError (naming the file) when any of it is missing, truncated or damaged, or
    when the journal was truncated after this snapshot; with ``declared`` (the service's
    registry's names), UnregisteredFieldError for a field that is not declared. Either
    way nothing of it stays stored. A torn last journal record is skipped and reported
    (``info.journal["torn"]``). ``newest`` (what a service's restart wants: its
    RLPLANE_RESTORE_FROM stays set while periodic snapshots go on, and the oldest of them
    are pruned): a journal truncated at a later snapshot of the same directory as ``path``
    (or at one when ``path`` is gone from it) continues that one, which is loaded instead.

    Example: ``restore(client.transport, "/mnt/snap/run-7-step-1200", journal="/mnt/journal").samples``
    """
    later = _continued(path, journal) if newest and path is not None and journal is not None else None
    if later is not None:
        log.warning("restore: the journal in %s was truncated at snapshot %s, taken after %s: loading that one",
                    journal, later, path)
        (progress or (lambda msg: None))(f"restore: the journal in {journal} was truncated at snapshot {later}, "
                                         f"taken after {path}: loading that one instead")
        path = later
    return _restore(transport, path, progress, declared, journal)


def _continued(path: str | os.PathLike[str], journal: str | os.PathLike[str]) -> str | None:
    """The later snapshot a journal was truncated at, where it is one of the same (local)
    directory as ``path`` and ``path`` is older or gone: None otherwise (``path`` is loaded,
    and refused if the journal cannot continue it)."""
    from rlplane import journal as J

    seq, later = J.base(journal)
    if seq <= 1 or not later or is_url(path) or is_url(later):
        return None
    mine, theirs = local(path), local(later)
    if mine == theirs or mine.parent != theirs.parent:
        return None  # another directory: an operator's choice, not a periodic snapshot's
    try:
        since = int(json.loads((mine / "manifest.json").read_text()).get("seq") or 0)
    except (OSError, ValueError, AttributeError):
        since = -1  # pruned (or unreadable): the journal's snapshot continues the store
    return str(later) if since < seq else None


def _restore(transport: Any, path: str | os.PathLike[str] | None, progress: Callable[[str], None] | None,
             declared: Collection[str] | None, journal: str | os.PathLike[str] | None) -> SnapshotInfo:
    from rlplane import journal as J

    if not hasattr(transport, "set_consumption"):
        raise E.InvalidArgumentError("restoring a snapshot needs the native backend")
    if path is None and journal is None:
        raise E.InvalidArgumentError("restore needs a snapshot, a journal, or both")
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    jr = J.Journal.open(journal) if journal is not None else None
    if path is None and jr is not None and jr.base > 1 and jr.base_snapshot:
        # A journal a snapshot truncated continues that snapshot (the newest: BASE only rises):
        # a store that died after its periodic snapshots comes back from the journal alone.
        path = jr.base_snapshot
        say(f"restore: the journal in {journal} continues snapshot {path}: loading it first")
    with _opened(path) as snap:
        # Every file is there at its size (checked on open), the journal read and checked
        # whole. Each partition's file is checked against its digest just before it is
        # loaded, while the next ones are read ahead; a damaged one takes back every
        # partition loaded before it.
        since = int(snap.manifest.get("seq") or 0)
        if jr is not None:
            if path is not None and not since and jr.changes:
                raise E.SnapshotError(f"snapshot {path} records no change number (taken by an older rlplane): it "
                                      f"cannot be continued by the journal in {journal}", component=str(path))
            J.check(jr, since or 1, declared, str(path or ""))
        for k in range(_FILES_AHEAD):
            snap.prefetch(k)
        head = snap.part(0) if len(snap) else None
        names = [str(p.get("name")) for p in snap.manifest["partitions"]]
        there = set(transport.partitions()) & (set(names) | {r.partition for r in (jr.after(since) if jr else [])})
        if there:
            raise E.InvalidArgumentError(f"the store holds partition(s) {sorted(there)[:5]} already: restore into "
                                         "a store without them (nothing was loaded)")
        samples = nbytes = tasks = 0
        loaded: list[str] = []
        replayed: Any = None
        paused = False
        try:
            state = transport.journal()
            # A store that journals into a new directory, and has journalled nothing yet, records
            # that its journal continues this snapshot: a restore from the journal alone loads it first.
            based = jr is None and bool(state.get("journal")) and int(state.get("seq") or 0) <= 1 and since > 0 \
                and path is not None
            if jr is not None or state.get("journal"):
                # What the restore puts is in the snapshot or the old journal already; a store that
                # journals numbers its changes after both, so its journal continues the snapshot
                # (without the floor, a restore of both after a crash took its changes for older
                # ones and skipped them).
                transport.journal(floor=max(jr.last_seq if jr is not None else 0, since) + 1, pause=True)
                paused = True
                if jr is None and not based:
                    log.warning("restore: this store journalled changes before the restore; a restore from its "
                                "journal alone will not bring back snapshot %s (restore it with the journal)", path)
            for k in range(len(snap)):
                snap.prefetch(k + _FILES_AHEAD)
                part = head if k == 0 else snap.part(k)
                head = None
                _check_declared(part, declared, f"{snap.shown.rstrip('/')}/{snap.manifest['partitions'][k]['file']}")
                say(f"restore: partition {part.name!r} ({len(part.ids)} samples)")
                loaded.append(part.name)
                nbytes += _load(transport, part)
                samples += len(part.ids)
                tasks += len(part.tasks)
                del part  # (its columns view the mapped file)
                snap.release(k)
            if jr is not None:
                say(f"restore: replaying {len(jr.after(since or 1))} journal changes from {journal}")
                replayed = J.replay(transport, jr, since or 1, touched=loaded, progress=say)
                samples += replayed.samples
            if paused:
                answer = transport.journal(pause=False, base=(since, _where(path)) if based else None)
            if paused and based and not answer.get("based"):
                log.warning("restore: the store was truncating its journal, so it does not record that the journal "
                            "continues snapshot %s: until its next snapshot, restore it with that snapshot", path)
        except BaseException:
            for name in loaded:  # nothing of a refused snapshot stays
                try:
                    transport.clear(name)
                except E.RlplaneError as err:
                    log.error("could not take back partition %r of a failed restore: %s", name, err)
            if paused:
                try:
                    transport.journal(pause=False)
                except E.RlplaneError as err:
                    log.error("could not resume the journal after a failed restore: %s", err)
            raise
        created = float(snap.manifest.get("created") or 0.0)
        files = sum(int(f.get("bytes", 0)) for f in snap.manifest["files"].values())
    info = SnapshotInfo(str(path or journal), len(names), samples, nbytes, files, tasks, 0.0,
                        round(time.monotonic() - t0, 3), created, names, since,
                        asdict(replayed) if replayed is not None else None)
    say(f"restore: {samples} samples, {nbytes} bytes in {info.seconds:.2f} s from {path or journal}"
        + (f" (+{replayed.changes} journal changes)" if replayed is not None else ""))
    return info


def _where(path: str | os.PathLike[str]) -> str:
    """A snapshot's path as a journal records it: absolute (a restore may run elsewhere), or the URL."""
    return str(path) if is_url(path) else str(local(path))


def _load(transport: Any, part: _Part) -> int:
    """Put partition ``part``'s samples and set its tasks' consumption; returns its bytes."""
    nbytes, keeps_born = 0, getattr(transport, "checks_born", False)
    for ids, columns, tags, create, born in _puts(part):
        if create and born is not None and keeps_born:  # the samples stay the incarnations metas name
            transport.put(part.name, ids, columns, tags, create=create, born=born)
        else:
            transport.put(part.name, ids, columns, tags, create=create)
        nbytes += sum(c.nbytes for c in columns.values())
    for task, states in part.tasks.items():
        for a in range(0, len(part.ids), RESTORE_BATCH * 16):
            transport.set_consumption(part.name, task, part.ids[a : a + RESTORE_BATCH * 16],
                                      states[a : a + RESTORE_BATCH * 16].tobytes())
    return nbytes


def _count(x: Any) -> bool:
    """A size or offset from a file: an int (not a bool) of 0 or more."""
    return type(x) is int and x >= 0


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str] | None) -> Iterator[Snapshot | _NoSnapshot]:
    """Snapshot ``path`` opened (a URL's files fetched into a local directory first), or
    nothing (the journal alone)."""
    if path is None:
        yield _NoSnapshot()
        return
    where = place(path)
    with where.fetched() as local, Snapshot(local, shown=str(where)) as snap:
        yield snap


class _NoSnapshot:
    """What :func:`restore` reads when there is no snapshot (the journal alone)."""

    manifest: dict[str, Any] = {"partitions": [], "files": {}}
    path = Path(".")
    shown = "."

    def __len__(self) -> int:
        return 0

    def prefetch(self, k: int) -> None:
        pass

    def release(self, k: int) -> None:
        pass

    def part(self, k: int) -> _Part:
        raise IndexError(k)

    def __enter__(self) -> _NoSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _check_declared(part: _Part, declared: Collection[str] | None, where: str) -> None:
    odd = sorted(set(part.fields) - set(declared)) if declared is not None else []
    if odd:
        raise E.UnregisteredFieldError(f"the snapshot holds field(s) {odd} this service does not declare ({where}): "
                                       "add them to its registry (RLPLANE_REGISTRY_FILE); nothing was loaded",
                                       field=odd[0])


def _puts(part: _Part) -> Iterator[tuple[list[str], dict[str, Column], list[dict[str, Any]], bool, np.ndarray | None]]:
    """The partition's samples as puts ``(ids, columns, tags, create, born)``, at most
    RESTORE_BATCH samples or ~RESTORE_BYTES each: every sample in commit order with the
    fields all of them hold, then each other field over the samples that hold it (as a
    later write of theirs did). Without a field every sample holds, samples holding the
    same fields are put together (commit order kept within each such group)."""
    n = len(part.ids)
    row_of = {}  # field -> row of each sample in the field's column (-1: none)
    for f, (pos, _) in part.fields.items():
        rows = np.full(n, -1, np.int64)
        rows[pos] = np.arange(pos.size)
        row_of[f] = rows
    common = sorted(f for f, rows in row_of.items() if bool((rows >= 0).all()))
    if common or not n:
        steps = [(np.arange(n), common, True)]
        steps += [(np.flatnonzero(row_of[f] >= 0), [f], False) for f in sorted(set(part.fields) - set(common))]
    else:
        names = sorted(part.fields)
        has = np.stack([row_of[f] >= 0 for f in names], axis=1)
        kinds, which = np.unique(has, axis=0, return_inverse=True)
        which = np.asarray(which).reshape(-1)
        steps = [(np.flatnonzero(which == g), [f for f, on in zip(names, kind.tolist()) if on], True)
                 for g, kind in enumerate(kinds)]
    for members, fields, create in steps:
        per_sample = sum(part.fields[f][1].nbytes for f in fields) / max(1, n)
        step = int(max(1, min(RESTORE_BATCH, RESTORE_BYTES // max(1.0, per_sample))))
        for a in range(0, members.size, step):
            take = members[a : a + step]
            cols = {f: _rows(part.fields[f][1], row_of[f][take]) for f in fields}
            ids = [part.ids[i] for i in take.tolist()]
            tags = [dict(t) if isinstance(t, dict) else {} for t in _pick(part.user, take)] if create else \
                [{} for _ in ids]
            yield ids, cols, tags, create, part.born[take] if part.born is not None else None


def _pick(user: list[Any] | None, take: np.ndarray) -> list[Any]:
    return [None] * take.size if user is None else [user[i] for i in take.tolist()]


def _rows(col: Column, rows: np.ndarray) -> Column:
    """Rows ``rows`` of ``col`` (a view when they are consecutive, else one copy), with their meta."""
    if col.same is not None:  # rows that share bytes keep sharing them, within what is taken
        picked = col.take(rows)
    elif rows.size and bool((np.diff(rows) == 1).all()):
        a, z = int(rows[0]), int(rows[-1]) + 1
        lo, hi = int(col.offsets[a]), int(col.offsets[z])
        picked = Column(col.values[lo:hi], col.offsets[a : z + 1] - lo)
    else:
        picked = col.select(rows.tolist())
    return picked.with_meta(col.sums[rows] if col.sums is not None else None,
                            col.geom.take(rows) if col.geom is not None else None)


__all__ = ["SnapshotInfo", "Snapshot", "take", "restore", "FORMAT", "VERSION"]
