"""The values a request to the native controller carries, checked before any is used.

Every helper takes a value straight from a decoded header and returns it typed, or
raises the typed error that names what is wrong (WireFormatError for what no client of
ours would send, InvalidArgumentError for a caller's mistake): names and ids bounded
(:mod:`rlplane.names`), ids and fields distinct, block ids positive 63-bit ints, a put's
blocks covering its rows in order on distinct units, extents naming only reserved
blocks and fields.

Example::

    p = partition_of(header)                 # InvalidArgumentError for "../x"
    ids = sample_ids(header.get("ids"))      # InvalidArgumentError for ["a", "a"]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlplane import errors as E
from rlplane.names import MAX_ID_LEN, MAX_NAME_LEN, check_partition
from rlplane.wire import check_same
from rlplane_service.native.index import Reservation

#: An inventory cursor past every block id and sequence number (a unit lists nothing more of that kind).
LISTED = (1 << 63) - 1


def partition_of(header: dict) -> str:
    p = header.get("p")
    check_partition(p)
    return p  # type: ignore[return-value]


def sample_ids(x: Any, *, unique: bool = True) -> list[str]:
    """Sample ids from a request: strings of 1-MAX_ID_LEN characters (``unique``: no repeats)."""
    if not isinstance(x, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_ID_LEN for s in x):
        raise E.WireFormatError(f"'ids' must be a list of sample ids (strings of 1-{MAX_ID_LEN} characters)")
    if unique and len(set(x)) != len(x):
        seen: set[str] = set()
        twice = [s for s in x if s in seen or seen.add(s)]  # type: ignore[func-returns-value]
        raise E.InvalidArgumentError(f"a put names sample id(s) {twice[:3]} twice")
    return x


def field_names(x: Any, key: str = "fields") -> list[str]:
    """Field names from a request's ``key``: distinct strings of 1-MAX_NAME_LEN characters, at most 1024."""
    if not isinstance(x, list) or len(x) > 1024 or not all(isinstance(s, str) and 0 < len(s) <= MAX_NAME_LEN for s in x):
        raise E.WireFormatError(f"'{key}' must be a list of at most 1024 field names of 1-{MAX_NAME_LEN} characters")
    if len(set(x)) != len(x):
        raise E.InvalidArgumentError(f"a request names a field twice: {sorted(f for f in set(x) if x.count(f) > 1)[:3]}")
    return x


def births(x: Any, n: int, key: str = "bn") -> np.ndarray | None:
    """A request's ``bn``: the incarnation of each of its ``n`` samples the caller's meta
    names (int64 bytes, 0: not known; :data:`rlplane.tags.BORN_TAG`), or None when absent.
    Any other ``key`` of one int64 in [0, 2**62) per sample the same way (``gr``: the
    lengths an extend read)."""
    if x is None:
        return None
    if not isinstance(x, bytes) or len(x) != 8 * n:
        raise E.WireFormatError(f"{key!r} must be {n} int64 values ({8 * n} bytes)")
    born = np.frombuffer(x, "<i8").astype(np.int64)
    if born.size and (int(born.min()) < 0 or int(born.max()) >= 1 << 62):
        raise E.WireFormatError(f"{key!r} values must lie in [0, 2**62)")
    return born


def block_id_ok(b: Any) -> bool:
    """A block id is a positive int of at most 63 bits (it travels as int64)."""
    return isinstance(b, int) and not isinstance(b, bool) and 0 < b < 1 << 63


def plain_int(x: Any) -> bool:
    """An int from the wire that is not a bool (``True == 1``, ``0.0 == 0``: neither is a
    row number, and a list is not a key to look up)."""
    return type(x) is int


def blocks_of(given: Any, n: int, units: int) -> list[tuple[int, tuple[int, ...], int, int]]:
    """The blocks a put announces: ``[[block id, [units], first row, end row], ...]``
    covering rows ``0..n`` in order, on distinct existing units, with fresh ids."""
    if not isinstance(given, list):
        raise E.WireFormatError("reserve needs 'blocks': [[block id, [units], first row, end row], ...]")
    out, at = [], 0
    for entry in given:
        ok = (isinstance(entry, list) and len(entry) == 4 and block_id_ok(entry[0])
              and isinstance(entry[1], list) and entry[1] and len(set(entry[1])) == len(entry[1])
              and all(plain_int(u) and 0 <= u < units for u in entry[1])
              and plain_int(entry[2]) and entry[2] == at and plain_int(entry[3]) and entry[3] > at)
        if not ok:
            raise E.WireFormatError(f"bad block entry {entry!r} (rows must follow on from {at})")
        out.append((entry[0], tuple(entry[1]), entry[2], entry[3]))
        at = entry[3]
    if at != n and not (n == 0 and not out):
        raise E.WireFormatError(f"the blocks cover {at} of {n} rows")
    if len({b for b, _, _, _ in out}) != len(out):
        raise E.WireFormatError("a put names the same block id twice")
    return out


def digests(raw: Any, name: str) -> np.ndarray:
    """A commit's row checksums (little-endian uint64 bytes)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) % 8:
        raise E.WireFormatError("row checksums must be uint64 bytes", field=name)
    return np.frombuffer(raw, "<u8")


def extents(given: Any, res: Reservation) -> dict[int, tuple[dict[str, str], dict[int, dict[str, int]]]]:
    """A commit's ``x``: ``[[block, {field: dtype}, [[unit, {field: slab offset}], ...]], ...]``
    for the reservation's blocks (copies on units the reservation placed them on)."""
    if given is None:
        return {}
    placed = {b: set(units) for b, units, _, _ in res.blocks}
    if not isinstance(given, list) or len(given) > len(placed):
        raise E.WireFormatError("commit 'x' must list the extents of the reserved blocks")
    out = {}
    for entry in given:
        ok = (isinstance(entry, list) and len(entry) == 3 and plain_int(entry[0]) and entry[0] in placed
              and isinstance(entry[1], dict) and isinstance(entry[2], list))
        if not ok:
            raise E.WireFormatError(f"bad extent entry {str(entry)[:80]}")
        b, dtypes, copies = entry
        if not set(dtypes) <= set(res.fields) or not all(isinstance(d, str) for d in dtypes.values()):
            raise E.WireFormatError("extent dtypes must name reserved fields")
        where: dict[int, dict[str, int]] = {}
        for copy in copies:
            if not (isinstance(copy, list) and len(copy) == 2 and plain_int(copy[0]) and copy[0] in placed[b]
                    and isinstance(copy[1], dict) and set(copy[1]) == set(dtypes)
                    and all(plain_int(v) and v >= 0 for v in copy[1].values())):
                raise E.WireFormatError(f"bad extent copy {str(copy)[:80]} of block {b}")
            where[copy[0]] = dict(copy[1])
        out[b] = (dict(dtypes), where)
    return out


def shared_rows(given: Any, fields: list[str], n: int, row_bytes: dict[str, np.ndarray],
                row_sums: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """A commit's ``s``: per field whose rows repeat one another, each of its ``n`` rows'
    earlier twin (-1: none). A twin must hold its own bytes, be as long, and have the same
    digest where both are recorded: a writer cannot make one sample read another's bytes
    under a length or digest of its own."""
    if given is None:
        return {}
    if not isinstance(given, dict) or not set(given) <= set(fields):
        raise E.WireFormatError("commit 's' must map reserved fields to their rows' twins")
    out = {}
    for name, raw in given.items():
        if not isinstance(raw, bytes) or len(raw) != 8 * n:
            raise E.WireFormatError(f"commit 's' needs one int64 per row ({n})", field=name)
        same = np.frombuffer(raw, "<i8").astype(np.int64)
        check_same(same, n, name)
        dup = np.flatnonzero(same >= 0)
        if bool((row_bytes[name][dup] != row_bytes[name][same[dup]]).any()):
            raise E.WireFormatError("a row said to repeat another is of another length", field=name)
        h = row_sums[name]
        if h is not None and bool(((h[dup] != h[same[dup]]) & (h[dup] != 0) & (h[same[dup]] != 0)).any()):
            raise E.WireFormatError("a row said to repeat another has another digest", field=name)
        out[name] = same
    return out


__all__ = ["LISTED", "partition_of", "sample_ids", "field_names", "births", "block_id_ok", "plain_int", "blocks_of",
           "digests", "extents", "shared_rows"]
