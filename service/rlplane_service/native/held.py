"""Rows stored once across puts: the controller's table of row keys per partition and field.

A writer names each distinct row of a field that shares rows by its key
(:func:`rlplane.dedup.row_keys`) and asks, before it encodes anything, which of them the
partition holds already (:func:`lookup`, the ``held`` request): those rows it does not
write, and its commit points them at the stored bytes (``hx``: per row the block, row,
byte offset, byte count and digest it was told). At the commit :func:`held_refs` checks
every such ref again, under the controller's lock: a live row of the same partition and
field must still hold exactly those bytes (a clear may have taken them since the lookup;
the commit is then a LeaseError the client answers by writing the rows itself). So a
writer can point a row only at bytes a live row of that partition and field holds, of
the length and digest it gives.

The table (``FieldIndex.keyed``) maps a key to a slot whose row holds the bytes:
:func:`register` adds the put's own rows at its commit, :func:`inherit` the rows that hold
them once their first holder went. An entry is checked against its slot's row whenever it is found
(state, block, key), so one that outlived its row names nothing; slots are never reused
within a partition (a renumbering, ``Partition.repack``, moves an entry with its slot or
drops it with it), so the table never grows past the partition's own arrays.

Example::

    refs = lookup(part, "pixel_values", keys)        # (m, 5) int64, block -1: not held
    register(part, "pixel_values", slots, keys, own)
"""

from __future__ import annotations

import numpy as np

from rlplane import errors as E
from rlplane.errors import HELD_GONE
from rlplane_service.native.index import COMMITTED, FieldIndex, Partition

#: Most keys one ``held`` request may ask about (a client splits a larger put's).
MAX_HELD_KEYS = 1 << 16


def parse_keys(raw: object, n: int, name: str) -> np.ndarray:
    """A commit's or request's keys of ``n`` rows: ``(n, 2)`` uint64 (WireFormatError otherwise)."""
    if not isinstance(raw, bytes) or len(raw) != 16 * n:
        raise E.WireFormatError(f"row keys must be 16 bytes for each of {n} rows", field=name)
    return np.frombuffer(raw, "<u8").astype(np.uint64).reshape(n, 2)


def parse_refs(raw: object, n: int, name: str) -> np.ndarray:
    """A commit's refs of ``n`` rows: ``(n, 5)`` int64 (WireFormatError otherwise)."""
    if not isinstance(raw, bytes) or len(raw) != 40 * n:
        raise E.WireFormatError(f"held rows need 5 int64 for each of {n} rows", field=name)
    return np.frombuffer(raw, "<i8").astype(np.int64).reshape(n, 5)


def lookup(part: Partition, name: str, keys: np.ndarray) -> np.ndarray:
    """Where ``part`` keeps a row of field ``name`` under each of ``keys``: ``(m, 5)`` int64
    (block, row, byte offset, byte count, digest as int64), block -1 where it keeps none."""
    out = np.full((keys.shape[0], 5), -1, np.int64)
    fi = part.fields.get(name)
    table = fi.keyed if fi is not None else None
    if not table or not keys.shape[0]:
        return out
    slots = np.fromiter((table.get(k, -1) for k in _names(keys)), np.int64, keys.shape[0])
    hit = _holds(part, fi, slots, keys)
    s = slots[hit]
    out[hit] = np.stack([fi.block[s], fi.row[s], fi.off[s], fi.nbytes[s], fi.sums[s].view(np.int64)], axis=1)
    return out


def held_refs(part: Partition, name: str, refs: np.ndarray, keys: np.ndarray, row_bytes: np.ndarray,
              row_sums: np.ndarray | None, same: np.ndarray | None, *, live: bool = True) -> np.ndarray:
    """The rows of a commit whose bytes an earlier put stored (``refs[:, 0] >= 0``), each
    ref checked (see the module docstring): WireFormatError for one no lookup could have
    given, LeaseError (``component`` :data:`HELD_GONE`) for bytes no live row holds now.
    ``live=False`` (a rebuild replaying a record, checked so at its commit): the rows that
    held the bytes then may be gone from a compacted log, so only the refs' form is checked."""
    rows = np.flatnonzero(refs[:, 0] >= 0)
    if not rows.size:
        return rows
    if same is not None and bool((same[rows] >= 0).any()):
        raise E.WireFormatError("a row held from an earlier put cannot also repeat a row of its own put", field=name)
    want = refs[rows]
    if bool((want[:, 3] != row_bytes[rows]).any()):
        raise E.WireFormatError("a row said to be held already is of another length", field=name)
    if bool((want[:, 3] <= 0).any()):
        raise E.WireFormatError("an empty row is never held from another put", field=name)
    if row_sums is not None and bool(((want[:, 4].view(np.uint64) != row_sums[rows]) & (row_sums[rows] != 0)).any()):
        raise E.WireFormatError("a row said to be held already has another digest", field=name)
    if not live:
        return rows
    now = lookup(part, name, keys[rows])
    stale = np.flatnonzero((now != want).any(axis=1))
    if stale.size:  # not where their keys say (the row that stored them went): any live row may hold them
        fi = part.fields.get(name)
        if fi is None or not bool(_held_by_some_row(part, fi, want[stale]).all()):
            raise E.LeaseError("rows this put found stored in the partition were cleared before it committed; "
                               "nothing of the put was stored: write them again", component=HELD_GONE)
    return rows


def register(part: Partition, name: str, slots: np.ndarray, keys: np.ndarray | None, own: np.ndarray) -> None:
    """Record the keys of a commit's rows at ``slots`` (none: the rows have no keys); the
    rows that stored their own bytes (``own``) become findable under theirs, unless a live
    row is found under that key already (the first keeps it: a row alike at every sampled
    byte and different elsewhere does not take its key from the row stored first)."""
    fi = part.fields[name]
    if keys is None:
        fi.k0[slots] = 0
        fi.k1[slots] = 0
        return
    mine = np.flatnonzero(own & keys.any(axis=1))
    if mine.size:
        names = _names(keys[mine])
        there = np.fromiter((fi.keyed.get(k, -1) for k in names), np.int64, len(names))
        free = ~_holds(part, fi, there, keys[mine])
        fi.keyed.update((names[i], int(slots[mine[i]])) for i in np.flatnonzero(free).tolist())
    fi.k0[slots] = keys[:, 0]
    fi.k1[slots] = keys[:, 1]


def inherit(fi: FieldIndex, heirs: np.ndarray) -> None:
    """Rows ``heirs`` hold their bytes from now on (their holder went): found under their keys."""
    keyed = heirs[(fi.k0[heirs] != 0) | (fi.k1[heirs] != 0)]
    if keyed.size:
        fi.keyed.update(zip(_names(np.stack([fi.k0[keyed], fi.k1[keyed]], axis=1)), keyed.tolist()))


def _names(keys: np.ndarray) -> list[bytes]:
    """The table's name of each ``(n, 2)`` uint64 key: its 16 bytes."""
    raw = keys.astype("<u8").tobytes()
    return [raw[i:i + 16] for i in range(0, len(raw), 16)]


def _holds(part: Partition, fi: FieldIndex, slots: np.ndarray, keys: np.ndarray) -> np.ndarray:
    ok = (slots >= 0) & (slots < part.used)
    s = np.where(ok, slots, 0)
    return ok & (part.state[s] == COMMITTED) & (fi.at("block", s) >= 0) & (fi.at("k0", s) == keys[:, 0]) \
        & (fi.at("k1", s) == keys[:, 1])


def _held_by_some_row(part: Partition, fi: FieldIndex, refs: np.ndarray) -> np.ndarray:
    """Per ref, whether a live row of ``fi`` holds exactly those bytes: one sort of the
    live rows' (block, row, offset, length, digest), whatever the number of refs."""
    u = part.used
    live = np.flatnonzero((part.state[:u] == COMMITTED) & (fi.upto("block", u) >= 0) & (fi.upto("nbytes", u) > 0))
    have = np.stack([fi.block[live], fi.row[live], fi.off[live], fi.nbytes[live], fi.sums[live].view(np.int64)], axis=1)
    row = np.dtype((np.void, 40))
    return np.isin(np.ascontiguousarray(refs, np.int64).view(row).reshape(-1),
                   np.ascontiguousarray(have).view(row).reshape(-1))


__all__ = ["MAX_HELD_KEYS", "parse_keys", "parse_refs", "lookup", "held_refs", "register", "inherit"]
