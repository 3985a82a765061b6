"""Which rows of a put are byte-for-byte the same: GRPO repeats every prompt's images for
each of its G samples, and rlplane stores such rows once.

:func:`twins` answers, for the rows of one media field (each a tuple of segments), the
``same`` array a shared :class:`~rlplane.column.Column` carries: -1 for a row that keeps
its own bytes, else the first earlier row equal to it. Equal means the same segment
shapes, the same dtype and the same bytes:

1. rows made of the very same tensors (same memory, shape and strides) are equal with
   no look at their bytes (the usual GRPO case: one image tensor handed to every member);
2. otherwise rows whose shapes and first and last KiB of every segment agree are
   candidates, and a candidate is **compared byte for byte** with the earlier distinct
   rows of its kind before it is called a twin. While a kind holds at most
   :data:`COMPARE_LEADERS` distinct rows that is all (the GRPO case: one image per kind;
   hashing every byte first would read each twin twice for nothing a compare does not
   decide). Past that, rows are keyed by an xxh3-128 digest (:func:`digest`) and a
   candidate is compared only with the rows of its digest, so the compares stay one per
   twin. A digest collision therefore stores both rows; it never makes one sample read
   another's image (a test forces one through :func:`digest`).

Rows on an accelerator are matched by (1) only (their bytes are not pulled to the host).

**Across puts** (the native engine): :func:`row_keys` names each distinct row by an
xxh3-128 digest of the dtype it is stored as, its segments' dtypes and shapes, and a
sample of their bytes (both ends and windows between: microseconds a row, where hashing
every byte of vlm-step's pixels took 28 ms). The writer asks the store which keys of a
field the partition holds, and for each row found it casts the row as it would store it
and compares that with the stored row's xxh3-64 digest of every byte (:func:`same_bytes`:
the integrity digest the store records and checks on every read); only then is the row
not stored. So a match needs equal shapes and dtypes, an equal 128-bit digest of the
sampled bytes and an equal 64-bit digest of all of them: that protects against accidental
collisions (two rows alike at every sampled byte and different elsewhere would still need
a 64-bit collision). It trusts the partition's writers, as a partition already does (any
of them may replace any sample's fields with ``write_columns``): the store keeps the
digest a writer records, so a writer that records another image's digest for its bytes
has later puts of that image point at them, and their reads fail with IntegrityError
(never silently wrong). Where writers of one partition do not trust each other, turn
sharing off for the field (``FieldSpec(dedup=False)``).

Example::

    img = torch.rand(4, 8)
    twins([(img,), (img,), (torch.rand(4, 8),)])   # array([-1,  0, -1])
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch
import xxhash

from rlplane import parallel

Row = tuple[torch.Tensor, ...]

#: Bytes of each end of a segment that pick candidates before any row is compared whole.
_EDGE = 1024
#: Distinct rows of one kind (shapes and edges) compared with a candidate before rows of
#: that kind are keyed by digest.
COMPARE_LEADERS = 2


def twins(rows: Sequence[Row]) -> np.ndarray:
    """``same`` for ``rows`` (see the module docstring): int64, one per row."""
    n = len(rows)
    same = np.full(n, -1, np.int64)
    by_identity: dict[tuple, int] = {}
    by_edges: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if not row:
            continue
        ident = tuple((s.data_ptr(), s.device, s.dtype, tuple(s.shape), s.stride()) for s in row)
        first = by_identity.setdefault(ident, i)
        if first != i:
            same[i] = first
        elif all(s.device.type == "cpu" for s in row):
            by_edges.setdefault(_edges(row), []).append(i)
    for group in by_edges.values():
        if len(group) > 1:
            _match(rows, group, same)
    # A twin of a twin names the first row of its kind (twins found by identity may point
    # at a row that itself was found equal by its bytes to an earlier one).
    dup = np.flatnonzero(same >= 0)
    if dup.size:
        same[dup] = np.where(same[same[dup]] >= 0, same[same[dup]], same[dup])
    return same


def _match(rows: Sequence[Row], group: list[int], same: np.ndarray) -> None:
    """Set ``same`` for the rows of one kind (``group``, in order, alike in shapes and
    edges): the first row is compared with all the others at once, then the first of those
    that differ with the rest, and so on; past :data:`COMPARE_LEADERS` distinct rows the
    rest are split by digest first."""
    rest = group
    for _ in range(COMPARE_LEADERS):
        if len(rest) < 2:
            return
        rest = _against_first(rows, rest, same)
    if len(rest) < 2:
        return
    keyed: dict[tuple[int, int], list[int]] = {}
    for i in rest:
        keyed.setdefault(digest(rows[i]), []).append(i)
    for members in keyed.values():
        while len(members) > 1:
            members = _against_first(rows, members, same)


#: Bytes of a row compared at a time: the first row's chunk stays in cache while every
#: other row's is compared with it, so each byte is read from memory once.
_CHUNK = 512 << 10


def _against_first(rows: Sequence[Row], members: list[int], same: np.ndarray) -> list[int]:
    """Compare every row of ``members[1:]`` with ``members[0]`` byte for byte (not ``==``
    on values: -0.0 equals 0.0 there, and NaN nothing), chunk by chunk; the equal ones
    become its twins; returns the others, in order."""
    first, raw = members[0], {i: [_u8(seg).numpy() for seg in rows[i]] for i in members}
    alive = [i for i in members[1:] if all(x.size == y.size for x, y in zip(raw[i], raw[first]))]
    row_bytes = sum(x.nbytes for x in raw[first])

    def equal(a: int, z: int) -> list[int]:  # the candidates alive[a:z] equal to the first row
        left = alive[a:z]
        for s, lead in enumerate(raw[first]):
            for lo in range(0, lead.size, _CHUNK):
                if not left:
                    return left
                part = lead[lo:lo + _CHUNK]
                left = [i for i in left if _equal(part, raw[i][s][lo:lo + _CHUNK])]
        return left

    # Candidates split over threads (each reads its own rows; the first row's chunk is
    # shared in cache): bandwidth, not the GIL, bounds a compare.
    parts = parallel.spans(np.arange(len(alive) + 1, dtype=np.int64) * row_bytes, parallel.workers())
    alive = [i for found in parallel.run(equal, parts) for i in found]
    same[alive] = first
    kept = set(alive)
    return [i for i in members[1:] if i not in kept]


def digest(row: Row) -> tuple[int, int]:
    """The xxh3-128 digest of a row's bytes, as two 64-bit halves (a test hook: replace it
    to force collisions)."""
    h = xxhash.xxh3_128()
    for seg in row:
        h.update(_bytes(seg))
    value = h.intdigest()
    return value >> 64, value & ((1 << 64) - 1)


def row_keys(rows: Sequence[Row], same: np.ndarray, stored_as: torch.dtype | None) -> np.ndarray:
    """The key the store finds each row under across puts (see the module docstring):
    ``(n, 2)`` uint64, an xxh3-128 digest of the dtype it is stored as, each segment's dtype
    and shape, and a sample of each segment's bytes (:func:`_probe`: both ends and
    :data:`_WINDOWS` windows between, all of a small segment), so a key costs microseconds
    however large the row. A row found under its key is confirmed by :func:`same_bytes`.
    Zero for an empty row, one not on the host or one under :data:`MIN_KEYED_BYTES`; a
    twin (``same >= 0``) gets its first row's.

    Example::

        img = torch.rand(64, 64)
        keys = row_keys([(img,), (img.clone(),)], np.array([-1, -1]), torch.bfloat16)
        bool((keys[0] == keys[1]).all())   # True: the same bytes, shapes and dtypes
    """
    keys = np.zeros((len(rows), 2), np.uint64)
    for i, row in enumerate(rows):
        if not row or same[i] >= 0 or not all(s.device.type == "cpu" for s in row):
            continue
        if sum(s.numel() * s.element_size() for s in row) < MIN_KEYED_BYTES:
            continue
        h = xxhash.xxh3_128()
        h.update(repr((str(stored_as), [(str(s.dtype), tuple(s.shape)) for s in row])).encode())
        for seg in row:
            h.update(_probe(seg))
        value = h.intdigest() or 1  # zero names no key
        keys[i] = (value >> 64, value & ((1 << 64) - 1))
    dup = np.flatnonzero(same >= 0)
    if dup.size:
        keys[dup] = keys[same[dup]]
    return keys


def same_bytes(stored: torch.Tensor, digest: int) -> bool:
    """Whether ``stored`` (a row as it would be stored: cast, flat) has every byte of the
    row a store holds under that row's key, as far as the store's xxh3-64 ``digest`` of
    those bytes tells (the integrity digest it checks on every read).

    Example: ``same_bytes(torch.zeros(4), xxhash.xxh3_64_intdigest(bytes(16)))`` -> True.
    """
    flat = stored.reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return xxhash.xxh3_64_intdigest(memoryview(flat.contiguous().numpy().view(np.uint8))) == digest


#: Rows smaller than this are not looked for across puts (a lookup's message costs more
#: than storing them again: a row of image_grid_thw is 24 bytes).
MIN_KEYED_BYTES = 4096
#: Windows of a segment's bytes between its ends that its key covers, and their size.
_WINDOWS, _WINDOW = 14, 256


def _probe(seg: torch.Tensor) -> memoryview | bytes:
    b = _bytes(seg)
    if len(b) <= 2 * _EDGE + _WINDOWS * _WINDOW:
        return b
    step = (len(b) - 2 * _EDGE) // (_WINDOWS + 1)
    parts = [b[:_EDGE]] + [b[_EDGE + k * step:_EDGE + k * step + _WINDOW] for k in range(1, _WINDOWS + 1)]
    return b"".join([*parts, b[-_EDGE:]])


def _edges(row: Row) -> tuple:
    key = []
    for seg in row:
        b = _bytes(seg)
        key.append((tuple(seg.shape), seg.dtype, xxhash.xxh3_64_intdigest(b[:_EDGE]),
                    xxhash.xxh3_64_intdigest(b[-_EDGE:])))
    return tuple(key)


def _u8(seg: torch.Tensor) -> torch.Tensor:
    flat = seg.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def _bytes(seg: torch.Tensor) -> memoryview:
    flat = _u8(seg)
    return memoryview(flat.numpy()) if flat.numel() else memoryview(b"")


#: libc's memcmp (bytes, int, int -> int). It runs without the GIL (ctypes lets it go), and
#: ~3x faster than numpy's ``==`` on a chunk in cache: no array of results is written.
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype, _memcmp.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two contiguous uint8 arrays hold the same bytes (memcmp)."""
    return a.nbytes == b.nbytes and (not a.nbytes or _memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0)


__all__ = ["twins", "digest", "row_keys", "same_bytes"]
