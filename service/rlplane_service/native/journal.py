"""A storage unit's write-ahead journal writer (the format: :mod:`rlplane.journal`).

The unit appends every change the controller logs to it (``log`` requests: a commit's
record with the bytes of this unit's blocks of it, clears, acks) to its current segment
in ``DIR/<unit>/`` with one ``writev`` (the page cache: memory speed), before it answers
the controller, so before the change is answered. Making it durable is grouped:

- a flusher thread fsyncs every ``flush_ms`` (``RLPLANE_JOURNAL_FLUSH_MS``) when anything
  was appended since its last pass: a change is on disk at most that long after it was
  answered (``lag_s`` in :meth:`JournalWriter.stats` says how far behind it is);
- a ``log`` request that carries a durable put (``put_samples(..., durable=True)``) is
  answered only after :meth:`JournalWriter.sync`, which fsyncs everything appended before
  it: every commit of the controller's batch rides on that one fsync (group commit).

Segments roll over at ``segment_bytes``; a new process never appends to an old segment
(its last record may be torn). :meth:`JournalWriter.truncate` (after a snapshot whose cut
is at ``below``) deletes the segments holding only older changes and records ``below``
in ``BASE``.

Example::

    j = JournalWriter(Path("/var/lib/rlplane/journal"), "u0", flush_ms=20)
    j.append(7, "put", "step-0", record, [[block, [["input_ids", 0, 4096]]]], [view])
    j.sync()
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Collection, Sequence

from rlplane import errors as E
from rlplane.durable import fsync_dir, replace_durably
from rlplane.journal import BASE, SEGMENT_GLOB, frame, read_base, read_segment, trailer

log = logging.getLogger(__name__)

#: A segment rolls over once it holds this many bytes.
SEGMENT_BYTES = 256 << 20
_IOV_MAX = 512


class JournalWriter:
    """Appends, group fsyncs and truncates one unit's journal (see the module docstring)."""

    def __init__(self, root: Path, unit: str, *, flush_ms: float = 20.0, segment_bytes: int = SEGMENT_BYTES) -> None:
        if not 0 < flush_ms <= 10_000:
            raise E.InvalidArgumentError(f"RLPLANE_JOURNAL_FLUSH_MS must be in (0, 10000], got {flush_ms}")
        self.dir = Path(root) / unit
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise E.InvalidArgumentError(f"the journal directory {self.dir} cannot be made ({err.strerror}): "
                                         "check RLPLANE_JOURNAL_DIR") from None
        self.flush_s, self.segment_bytes = flush_ms / 1000.0, segment_bytes
        self._lock = threading.Lock()  # appends and rollovers
        self._sync_lock = threading.Lock()  # fsync passes (and closing the fds they sync)
        self._max: dict[Path, int] = {}  # segment -> highest seq in it
        for old in sorted(self.dir.glob(SEGMENT_GLOB)):  # earlier processes' segments (for truncation)
            try:
                self._max[old] = max((r.seq for r in read_segment(old, heads_only=True).records), default=0)
            except E.RlplaneError as err:
                log.error("journal: %s", err)
                self._max[old] = 1 << 62  # kept: the restore will say what is wrong with it
        try:
            self.base = int(read_base(self.dir).get("seq") or 0)  # the last truncation's change number
        except E.RlplaneError as err:  # journalling goes on; a restore from here says what is wrong
            log.error("journal: %s", err)
            self.base = 0
        self._fd, self._path, self._size, self._torn = -1, Path(), 0, False
        self._closing: list[int] = []  # fds rolled over, fsynced and closed by the next pass
        self._dirty_since: float | None = None
        self._unsynced = 0
        self.appended = self.synced = self.syncs = 0
        self._open()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._loop, name=f"rlplane-journal-{unit}", daemon=True)
        self._flusher.start()

    def _open(self) -> None:
        """Start a new segment (the current one, if any, is fsynced and closed by the next
        pass). OSError, and the current segment stays, when the disk refuses."""
        path = self.dir / f"seg-{time.time_ns():020d}-{secrets.token_hex(3)}.rlj"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        if self._fd >= 0:
            self._closing.append(self._fd)
        self._fd, self._path, self._size, self._torn = fd, path, 0, False
        self._max[path] = 0
        fsync_dir(self.dir)

    def append(self, seq: int, kind: str, partition: str, record: bytes | memoryview,
               places: list[list[Any]] | None = None, body: Sequence[memoryview] = ()) -> int:
        """Append one change (page cache); returns its bytes. OSError when the disk refuses."""
        prefix, h = frame(seq, kind, partition, record, places, body)
        tail = trailer(h)
        n = len(prefix) + sum(b.nbytes for b in body) + len(tail)
        with self._lock:
            if self._torn or (self._size and self._size + n > self.segment_bytes):
                self._open()
            try:
                _write_all(self._fd, [memoryview(prefix), *body, memoryview(tail)])
            except OSError:
                self._cut_back()
                raise
            self._size += n
            self._max[self._path] = max(self._max[self._path], seq)
            self.appended += n
            self._unsynced += n
            if self._dirty_since is None:
                self._dirty_since = time.monotonic()
        return n

    def _cut_back(self) -> None:
        """A record the disk took only part of is cut off, so the next one follows the last
        whole record (a reader refuses a segment with a broken record before whole ones:
        every later change would be lost). Where even that fails, the segment ends there
        (a torn last record is what a reader expects of a crash) and the next append starts
        a new one."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as err:
            log.error("journal %s: a refused record could not be cut off (%s); the next change starts a new segment",
                      self._path, err)
            self._torn = True

    def sync(self) -> None:
        """Everything appended before this call is on disk when it returns."""
        with self._sync_lock:
            with self._lock:
                fds, self._closing = [self._fd, *self._closing], []
                pending, since, self._unsynced, self._dirty_since = self._unsynced, self._dirty_since, 0, None
            try:
                for fd in fds:
                    os.fsync(fd)
            except OSError:  # what it did not sync stays to sync (and lag_s keeps its age)
                with self._lock:
                    self._closing[:0] = fds[1:]
                    self._unsynced += pending
                    if since is not None and (self._dirty_since is None or since < self._dirty_since):
                        self._dirty_since = since
                raise
            for fd in fds[1:]:
                os.close(fd)
            self.synced += pending
            self.syncs += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            if self._dirty_since is not None or self._closing:
                try:
                    self.sync()
                except OSError as err:  # the next pass tries again; lag_s shows it falling behind
                    log.error("journal %s: fsync failed: %s", self.dir, err)

    def prune_others(self, below: int, live: Collection[str]) -> int:
        """Delete the segments of journal directories beside this one that no unit of the
        store (``live``: their names) writes any more, where every change in them is
        before ``below`` (a snapshot holds them); a directory left without segments goes.
        What a store with fewer units, or units of other names, leaves behind. A damaged
        segment is kept (a restore names it). Returns segments deleted.

        Never a directory of a unit in ``live``: a live one may be appending to its newest
        segment (its own truncation handles it)."""
        n = 0
        try:
            dirs = sorted(d for d in self.dir.parent.iterdir() if d.is_dir() and d.name not in live and d != self.dir)
        except OSError:
            return 0
        for d in dirs:
            for seg in sorted(d.glob(SEGMENT_GLOB)):
                try:
                    top = max((r.seq for r in read_segment(seg, heads_only=True).records), default=0)
                except E.RlplaneError as err:
                    log.warning("journal: kept %s: %s", seg, err)
                    continue
                if top < below:
                    try:
                        seg.unlink()
                        n += 1
                    except FileNotFoundError:  # another unit pruned it first
                        pass
            if not any(d.glob(SEGMENT_GLOB)):
                try:
                    (d / BASE).unlink(missing_ok=True)
                    d.rmdir()
                except OSError:  # another unit's prune, or files of its own: left
                    pass
        if n:
            fsync_dir(self.dir.parent)
        return n

    def truncate(self, below: int, snapshot: str = "") -> int:
        """A snapshot holds every change before ``below``: roll over, delete the segments
        holding only older changes, record ``below`` in BASE. Returns segments deleted. An
        older snapshot's truncation arriving after a newer one's does nothing (BASE only rises)."""
        with self._lock:
            if below <= self.base:
                return 0
            self.base = below
            if self._size or self._torn:
                self._open()
            old = [p for p, top in self._max.items() if p != self._path and top < below]
        self.sync()
        replace_durably(self.dir / BASE, json.dumps({"seq": below, "snapshot": snapshot, "time": time.time()}).encode())
        for p in old:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            self._max.pop(p, None)
        fsync_dir(self.dir)
        return len(old)

    def stats(self) -> dict[str, Any]:
        """``lag_s`` (age of the oldest change not yet on disk), ``lag_bytes``, bytes appended
        and synced, fsyncs, segments."""
        since = self._dirty_since
        return {"lag_s": 0.0 if since is None else round(time.monotonic() - since, 4), "lag_bytes": self._unsynced,
                "appended_bytes": self.appended, "synced_bytes": self.synced, "syncs": self.syncs,
                "segments": len(self._max)}

    def close(self) -> None:
        self._stop.set()
        self._flusher.join(timeout=5)
        try:
            self.sync()
        except OSError as err:
            log.error("journal %s: final fsync failed: %s", self.dir, err)
        os.close(self._fd)
        self._fd = -1


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """``writev`` every buffer, however the kernel splits it."""
    bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in bufs if b.nbytes]
    while bufs:
        n = os.writev(fd, bufs[:_IOV_MAX])
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


__all__ = ["JournalWriter", "SEGMENT_BYTES"]
