"""The native controller's index: per partition, arrays over *slots* (one per sample id).

A slot's state (free / reserved / committed), per field the block and row holding the
sample's bytes, the row's byte count, wire geometry, digest and offset in its block's
extent, and the samples' user tags. No per-sample Python object beyond the id map and
the tags themselves. :class:`Partition` is also the index a consumption ledger reads
(:class:`rlplane_service.ledger.Index`).

Example::

    part = Partition()
    slots = part.take(["a", "b"])        # reserved
    part.state[slots] = COMMITTED
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from rlplane.geometry import Geometry
from rlplane_service.ledger import grown, kept
from rlplane.tags import BORN_TAG, WIRE_TAG, incarnation, stale

FREE, RESERVED, COMMITTED = 0, 1, 2

#: Distinct trailing shapes a field keeps as a table (beyond: its rows' geometry as objects).
MAX_FIELD_SHAPES = 65536


def rows_in(part: Partition, blocks: np.ndarray) -> np.ndarray:
    """Committed slots of ``part`` with a row of any field in one of ``blocks`` (sorted ids)."""
    hit = np.zeros(part.used, bool)
    for fi in part.fields.values():
        hit |= np.isin(fi.upto("block", part.used), blocks)
    return np.flatnonzero(hit & (part.state[: part.used] == COMMITTED))


def per_block(blocks: np.ndarray, nbytes: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct ``blocks`` and the ``nbytes`` of their rows summed per block.

    Example: ``per_block(np.array([7, 5, 7]), np.array([1, 2, 3]))`` -> ``([5, 7], [2, 4])``."""
    uniq, inv = np.unique(blocks, return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=nbytes, minlength=uniq.size)
    return uniq.tolist(), [int(x) for x in sums.tolist()]


def objects(items: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):  # numpy would turn lists of lists into a 2-D array
        out[i] = x
    return out


@dataclass
class FieldIndex:
    """Where one field of every slot lives. Its arrays grow as the field is written
    (:meth:`cover`), not as slots are taken: a slot past their end holds no row of it
    (:meth:`at` and :meth:`upto` read the empty row's values there). A reserve of many
    ids in a partition of many fields so costs the fields it writes, once it commits."""

    block: np.ndarray
    row: np.ndarray
    nbytes: np.ndarray
    geom: np.ndarray  # a row's geometry object, for rows not kept dense (packed rows)
    sums: np.ndarray  # uint64 xxh3 digest of each row's bytes as the writer stored them (0: none recorded)
    off: np.ndarray  # byte offset of the row in its block's extent of this field
    # Dense rows' geometry (rlplane.geometry): the leading dim (-1: none) and the index of
    # the trailing shape in ``shapes`` (-1: the row's geometry is the object in ``geom``).
    lead: np.ndarray
    kind: np.ndarray
    dup: np.ndarray  # bool: the row's bytes are another slot's row (stored once, rlplane.dedup)
    k0: np.ndarray  # uint64 halves of the row's key (rlplane.dedup.row_keys; 0, 0: none)
    k1: np.ndarray
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    # Row key (16 bytes) -> a slot whose row holds those bytes (rlplane_service.native.held;
    # checked against the slot's row when found: a stale entry names nothing).
    keyed: dict[bytes, int] = field(default_factory=dict)
    _shape_kind: dict[tuple[int, ...], int] = field(default_factory=dict)
    shares: bool = False  # some row was ever marked ``dup`` (False: none is; releases skip the sharing bookkeeping)

    _COLUMNS = (("block", -1), ("row", 0), ("nbytes", 0), ("geom", None), ("sums", 0), ("off", 0), ("lead", -1),
                ("kind", -1), ("dup", False), ("k0", 0), ("k1", 0))

    _FILL = {name: fill for name, fill in _COLUMNS}

    @classmethod
    def empty(cls, cap: int = 0) -> FieldIndex:
        return cls(np.full(cap, -1, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.empty(cap, object),
                   np.zeros(cap, np.uint64), np.zeros(cap, np.int64), np.full(cap, -1, np.int64),
                   np.full(cap, -1, np.int32), np.zeros(cap, bool), np.zeros(cap, np.uint64), np.zeros(cap, np.uint64))

    def grow(self, cap: int) -> None:
        for name, fill in self._COLUMNS:
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype) if fill is not None else np.empty(cap, dtype=object)
            new[: old.size] = old
            setattr(self, name, new)

    @property
    def size(self) -> int:
        """Slots below this have an entry in the arrays (past it: no row)."""
        return self.block.size

    def cover(self, slots: np.ndarray) -> None:
        """Room in the arrays for rows at ``slots`` (before they are written)."""
        n = int(slots.max()) + 1 if slots.size else 0
        if n > self.block.size:
            self.grow(max(n, 2 * self.block.size, 64))

    def inside(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` that have an entry in the arrays (the others hold no row of the field)."""
        return slots if not slots.size or int(slots.max()) < self.block.size else slots[slots < self.block.size]

    def at(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Column ``name`` at ``slots`` (an empty row's value past the arrays' end).

        Example: ``fi.at("block", slots) >= 0`` says which of ``slots`` hold a row."""
        col = getattr(self, name)
        if not slots.size or int(slots.max()) < col.size:
            return col[slots]
        out = np.full(slots.size, self._FILL[name], col.dtype)
        ok = slots < col.size
        out[ok] = col[slots[ok]]
        return out

    def upto(self, name: str, n: int) -> np.ndarray:
        """Column ``name`` over slots ``0..n-1`` (an empty row's value past the arrays' end)."""
        col = getattr(self, name)
        if n <= col.size:
            return col[:n]
        out = np.full(n, self._FILL[name], col.dtype)
        out[: col.size] = col
        return out

    def set_geometry(self, slots: np.ndarray, g: Geometry) -> None:
        """Record the rows' geometry at ``slots`` (dense rows as arrays, others as objects)."""
        known = self._shape_kind
        if g.dense and len(known) + len(g.shapes) <= MAX_FIELD_SHAPES:
            remap = np.array([known.setdefault(s, len(known)) for s in g.shapes], np.int32)
            if len(known) > len(self.shapes):
                self.shapes.extend(list(known)[len(self.shapes):])
            self.kind[slots] = remap[g.kind] if g.kind is not None else remap[0]
            self.lead[slots] = g.lead if g.lead is not None else -1
            self.geom[slots] = None
        else:
            self.kind[slots] = -1
            self.geom[slots] = objects(g.tolist())

    def geometry(self, slots: np.ndarray) -> Geometry:
        """The geometry of the rows at ``slots`` (dense when every row is)."""
        kind, lead = self.at("kind", slots), self.at("lead", slots)
        if slots.size and bool((kind >= 0).all()):
            has_lead = lead >= 0
            if bool(has_lead.all()) or not bool(has_lead.any()):
                if bool((kind == kind[0]).all()):  # one trailing shape: the usual case, no sort
                    used, which = kind[:1], None
                else:
                    used, which = np.unique(kind, return_inverse=True)
                return Geometry(lead if bool(has_lead[0]) else None, [self.shapes[k] for k in used.tolist()],
                                which.astype(np.int32).reshape(-1) if which is not None and used.size > 1 else None,
                                n=int(slots.size))
        rows = self.at("geom", slots).tolist()
        for i in np.flatnonzero(kind >= 0).tolist():
            shape = list(self.shapes[int(kind[i])])
            rows[i] = [int(lead[i]), *shape] if lead[i] >= 0 else shape
        return Geometry.of_rows(rows)

    def renumber(self, keep: np.ndarray, remap: np.ndarray) -> None:
        """Keep the rows of slots ``keep`` only, as slots 0.. in the same order (``remap``:
        old slot -> new one, -1 for a slot that goes)."""
        inside = keep[: int(np.searchsorted(keep, self.block.size))]  # (the slots kept first: keep is sorted)
        for name, fill in self._COLUMNS:
            setattr(self, name, kept(getattr(self, name), inside, fill))
        self.keyed = {k: int(remap[s]) for k, s in self.keyed.items() if 0 <= s < remap.size and remap[s] >= 0}

    def forget(self, slots: np.ndarray) -> None:
        """The rows at ``slots`` are gone: drop their geometry and keys."""
        slots = self.inside(slots)
        self.block[slots] = -1
        self.sums[slots] = 0
        self.geom[slots] = None
        self.kind[slots] = -1
        self.k0[slots] = 0
        self.k1[slots] = 0


@dataclass
class Partition:
    """The index of one partition (see the module docstring)."""

    #: Every change that can make a slot claimable (a commit: new samples, or rows or tags
    #: of stored ones, a journal's or the commit log's replay included) goes through the
    #: controller's ``_apply_commit``, which hands its slots to the ledger (Ledger.touch).
    touches = True

    ids: dict[str, int] = field(default_factory=dict)
    names: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    user: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    retagged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # user tag changes after the commit
    # Put records still on the storage units that name the slot (rlplane_service.native.logbook).
    logged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Which incarnation of its id the slot holds (incarnation(); 0: not known, e.g. restored
    # from a snapshot that kept none). A meta naming another one is stale.
    born: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fields: dict[str, FieldIndex] = field(default_factory=dict)
    used: int = 0  # slots handed out so far
    lost: dict[str, str] = field(default_factory=dict)  # sample id -> the storage unit it was lost with
    forgets: int = 0  # times samples were dropped from it (a cleared slot stays FREE: it is never reused)

    def reserve(self, cap: int) -> None:
        """Room for ``cap`` slots (a rebuild knows how many it will take)."""
        if cap > self.state.size:
            self.names = grown(self.names, cap)
            self.state = grown(self.state, cap)
            self.user = grown(self.user, cap)
            self.retagged = grown(self.retagged, cap)
            self.logged = grown(self.logged, cap)
            self.born = grown(self.born, cap)

    def take(self, ids: list[str]) -> np.ndarray:
        n = len(ids)
        need = self.used + n
        if need > self.state.size:
            self.reserve(max(need, 2 * self.state.size, 64))
        slots = np.arange(self.used, need, dtype=np.int64)
        self.names[self.used : need] = objects(ids)
        self.state[self.used : need] = RESERVED
        self.ids.update(zip(ids, range(self.used, need)))
        self.used = need
        return slots

    def repack(self, keep: np.ndarray) -> np.ndarray:
        """Renumber the slots: ``keep`` (sorted; every slot a sample holds among them) become
        0.. in the same order, so arrival order stays slot order, and every other slot goes.
        Returns the old slot -> new slot map (-1: gone). A partition cleared sample by sample
        otherwise grows by a slot per sample it ever held (every field's row records)."""
        remap = np.full(self.used, -1, np.int64)
        remap[keep] = np.arange(keep.size, dtype=np.int64)
        self.names, self.user = kept(self.names, keep), kept(self.user, keep)
        self.state = kept(self.state, keep, FREE)
        self.retagged, self.logged = kept(self.retagged, keep), kept(self.logged, keep)
        self.born = kept(self.born, keep)
        for fi in self.fields.values():
            fi.renumber(keep, remap)
        self.ids = {name: int(remap[s]) for name, s in self.ids.items()}
        self.used = int(keep.size)
        self.forgets += 1
        return remap

    def field_index(self, name: str) -> FieldIndex:
        fi = self.fields.get(name)
        if fi is None:
            fi = self.fields[name] = FieldIndex.empty()
        return fi

    def committed(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self.used] == COMMITTED)

    # -- the ledger's view (rlplane_service.ledger.Index) -----------------------------------------
    def live(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.state[start : self.used if stop is None else min(stop, self.used)] == COMMITTED

    def has(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        z = self.used if stop is None else min(stop, self.used)
        fi = self.fields.get(name)
        return fi.upto("block", z)[start:] >= 0 if fi is not None else np.zeros(max(0, z - start), bool)

    def field_names(self) -> list[str]:
        return list(self.fields)

    def epochs(self) -> np.ndarray:
        return self.retagged[: self.used]

    def ids_of(self, slots: np.ndarray) -> list[str]:
        return self.names[slots].tolist()

    def leads(self, name: str, slots: np.ndarray) -> np.ndarray:
        fi = self.fields.get(name)
        if fi is None:
            return np.full(slots.size, -1, np.int64)
        has = fi.at("block", slots) >= 0
        lead = np.where(has, fi.at("lead", slots), -1)
        odd = np.flatnonzero(has & (fi.at("kind", slots) < 0))  # rows kept as geometry objects
        if odd.size:
            lead[odd] = [g[0] if isinstance(g, list) and g and type(g[0]) is int and g[0] >= 0 else -1
                         for g in fi.geom[slots[odd]].tolist()]
        return lead

    def tags_of(self, slots: np.ndarray) -> list[dict[str, Any]]:
        geoms = {name: (fi.at("block", slots) >= 0, fi.geometry(slots)) for name, fi in self.fields.items()}
        born = self.born[slots].tolist()
        return [{**(u or {}), WIRE_TAG: {f: g[i] for f, (has, g) in geoms.items() if has[i]},
                 **({BORN_TAG: born[i]} if born[i] else {})}
                for i, u in enumerate(self.user[slots].tolist())]

    def user_tags(self, slots: np.ndarray) -> list[dict[str, Any] | None]:
        return self.user[slots].tolist()

    def wire_columns(self, slots: np.ndarray) -> dict[str, Any] | None:
        out = {}
        for name, fi in self.fields.items():
            has = fi.at("block", slots) >= 0
            if bool(has.all()):
                out[name] = fi.geometry(slots).to_wire()
            elif bool(has.any()):
                return None  # (a field some of them hold: a tag map each says which)
        return out

    def stale(self, slots: np.ndarray, born: np.ndarray) -> np.ndarray:
        """Which of ``slots`` a meta naming incarnations ``born`` (0: not known) does not
        name as they are now: the positions where both are known and differ."""
        return stale(born, self.born[slots])


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
    seq: int = 0  # its commit-log entry's sequence number, once logged (rlplane_service.native.logbook)
    ids: Sequence[str] = ()  # the samples of ``slots`` (a sample cleared meanwhile has no name in the index)
    born: Any = 0  # the incarnation a create gives its samples (an int, or one per sample from a snapshot)
    revoked: bool = False  # its commit-log entry reached no unit: a commit not yet indexed aborts instead




__all__ = ["FREE", "RESERVED", "COMMITTED", "FieldIndex", "Partition", "Reservation", "incarnation", "rows_in", "objects"]
