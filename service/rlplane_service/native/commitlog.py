"""The commit log on the storage units: what a restarted controller rebuilds its index from.

The controller's index lives in its process only. So that losing that process loses no
committed sample, every change to the index that must outlive it is written to the
storage units *before* the change is answered:

- ``put``: a commit's record (partition, sample ids, fields, per-row geometry, byte
  counts and digests, user tags, and which rows went into which block) goes to every unit
  holding one of its blocks, and to one more unit when that is only one, before the
  commit answers. A reservation whose commit never got that far has no record: after a
  restart its blocks are orphans (the sweep frees them) and its samples do not exist.
- ``clear``: cleared samples (``ids``) or a whole partition (``all``) go to every unit
  that answers, before the clear answers; a unit drops the records of a partition older
  than a whole clear of it, and ``forget`` drops the puts and clears the controller found a
  rebuild no longer needs (:mod:`~rlplane_service.native.logbook`: a partition cleared
  sample by sample), so the log holds what the store holds, not its history.

Each entry carries a sequence number (the controller's, continued across restarts), so
the rebuild replays the union of the units' logs in the order the controller applied
them, and a MAC under the controller's own credential (a SHA-256 digest without one): an
entry a unit mangled or that someone forged is ignored and reported, never indexed.
Consumption (claims, acks) is not in the log: a restarted controller has every sample
pending again, and ``consumption()`` says ``controller_restarts``. With a journal
(:mod:`~rlplane_service.native.journal`) acks are sent as ``ack`` entries too, which a
unit only journals; it counts their numbers (``high``) so a rebuilt controller never
gives one out again.

:class:`UnitLog` is the units' side; :func:`record` / :func:`parse` the entries' bodies.

Example::

    log = UnitLog()
    log.append(Entry(1, "put", "step-0", body, mac(key, 1, "put", "step-0", body)))
    log.entries()    # [Entry(seq=1, ...)]
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import msgpack

from rlplane import errors as E

#: The kinds of entries: a commit's record, cleared samples, a whole partition cleared;
#: and acks, which only a journal keeps (a unit counts their sequence numbers, see ``high``).
PUT, CLEAR, DROP, ACK = "put", "clear", "drop", "ack"
KINDS = frozenset({PUT, CLEAR, DROP, ACK})
#: Most entries one ``log`` request carries, and one ``forget`` request names.
MAX_ENTRIES_PER_REQUEST = 4096
MAX_FORGET = 1 << 16


@dataclass(frozen=True, slots=True)
class Entry:
    """One change to the index: ``seq`` (the order the controller applied it in), ``kind``,
    the partition, the body (msgpack, see :func:`record`) and its ``mac``."""

    seq: int
    kind: str
    partition: str
    body: bytes | memoryview
    mac: str

    def wire(self) -> list[Any]:
        return [self.seq, self.kind, self.partition, self.mac]

    @classmethod
    def from_wire(cls, head: Any, body: Any, *, copy: bool = True) -> Entry:
        """An entry as a request carried it: ``[seq, kind, partition, mac]`` and its body frame
        (``copy=False``: the body stays a view of the frame, for entries read once)."""
        if not (isinstance(head, list) and len(head) == 4 and isinstance(head[0], int) and not isinstance(head[0], bool)
                and 0 < head[0] < 1 << 63 and head[1] in KINDS and isinstance(head[2], str) and isinstance(head[3], str)
                and len(head[3]) <= 64):
            raise E.WireFormatError(f"bad commit-log entry {str(head)[:80]}")
        return cls(head[0], head[1], head[2], bytes(body) if copy else memoryview(body), head[3])


def mac(key: bytes | None, seq: int, kind: str, partition: str, body: bytes | memoryview) -> str:
    """The entry's MAC: 128 bits of HMAC-SHA256 under the controller's credential, or a
    SHA-256 digest without one (then it catches damage, not forgery)."""
    h = hashlib.sha256() if key is None else hmac.new(key, digestmod=hashlib.sha256)
    h.update(b"%d|%s|%s|" % (seq, kind.encode(), partition.encode()))
    h.update(body)
    return h.hexdigest()[:32]


def valid(key: bytes | None, e: Entry) -> bool:
    return e.mac.isascii() and hmac.compare_digest(e.mac, mac(key, e.seq, e.kind, e.partition, e.body))


def record(fields: dict[str, Any]) -> bytes:
    """An entry's body."""
    return msgpack.packb(fields, use_bin_type=True)


def parse(e: Entry) -> dict[str, Any]:
    """An entry's body as a map (WireFormatError if it is not one)."""
    try:
        out = msgpack.unpackb(e.body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise E.WireFormatError(f"commit-log entry {e.seq} does not decode ({err})") from None
    if not isinstance(out, dict):
        raise E.WireFormatError(f"commit-log entry {e.seq} is not a map")
    return out


#: At most this many sequence numbers a unit was told to forget before it saw them (UnitLog).
MAX_EARLY = 4096


class UnitLog:
    """A storage unit's share of the commit log (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._dropped: dict[str, int] = {}  # partition -> its latest whole clear
        # Entries forgotten before they arrived (a failed put's, withdrawn while this unit was
        # still too slow to have kept it): kept out when they come.
        self._early: set[int] = set()
        self._lock = threading.Lock()
        self.high = 0  # the highest sequence number seen (acks included): a rebuilt controller continues above it

    def append(self, e: Entry) -> None:
        """Keep ``e`` (an entry with a sequence number seen before replaces it); a whole
        clear drops the partition's older entries, and any that arrive after it."""
        with self._lock:
            self.high = max(self.high, e.seq)
            if e.kind == ACK:
                return
            if e.seq in self._early:
                self._early.discard(e.seq)
                return
            if e.kind == DROP:
                for seq in [s for s, old in self._entries.items() if old.partition == e.partition and s < e.seq]:
                    del self._entries[seq]
                self._dropped[e.partition] = max(e.seq, self._dropped.get(e.partition, 0))
            elif e.seq < self._dropped.get(e.partition, 0):
                return
            self._entries[e.seq] = e

    def extend(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            self.append(e)

    def forget(self, seqs: Iterable[int], *, early: bool = False) -> int:
        """Drop the entries ``seqs`` (a rebuild no longer needs them; a whole clear's entry
        goes with the mark that kept older entries of its partition out: the controller names
        one only once no such entry can still arrive). ``early``: the entries of a failed
        put, which may not have arrived yet; kept out when they do. Returns how many were held."""
        n = 0
        with self._lock:
            for s in seqs:
                e = self._entries.pop(s, None)
                if e is None:
                    if early:  # (not seen yet: it may still come; its number is never handed out again)
                        self.high = max(self.high, s)
                        if len(self._early) >= MAX_EARLY:  # (the older half: long past coming)
                            self._early = set(sorted(self._early)[MAX_EARLY // 2:])
                        self._early.add(s)
                    continue
                n += 1
                if e.kind == DROP and self._dropped.get(e.partition) == s:
                    del self._dropped[e.partition]
        return n

    def entries(self, after: int = 0) -> list[Entry]:
        """The entries above sequence number ``after``, in sequence order."""
        with self._lock:
            return [self._entries[s] for s in sorted(s for s in self._entries if s > after)]

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.body.nbytes if isinstance(e.body, memoryview) else len(e.body) for e in self._entries.values())

    def damage(self, seq: int) -> bool:
        """Flip one bit of entry ``seq``'s body (the hook the rebuild tests use)."""
        with self._lock:
            e = self._entries.get(seq)
            if e is None or not e.body:
                return False
            body = bytearray(e.body)
            body[len(body) // 2] ^= 1
            self._entries[seq] = Entry(e.seq, e.kind, e.partition, bytes(body), e.mac)
            return True


__all__ = ["Entry", "UnitLog", "mac", "valid", "record", "parse", "PUT", "CLEAR", "DROP", "ACK", "KINDS",
           "MAX_ENTRIES_PER_REQUEST", "MAX_FORGET"]
