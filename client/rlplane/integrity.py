"""Checksums of every stored row: computed by the writer, checked on every read.

Each (sample, field) row's stored bytes get an xxh3-64 digest when the codec encodes
them (:func:`row_sums`); the digests travel in the sample's reserved tag
:data:`SUM_TAG` (``{field: digest}``), are kept by every backend with the row's wire
geometry, and come back with the row. :func:`check_sums` recomputes them over what
arrived and raises :class:`~rlplane.errors.IntegrityError` naming the partition, the
sample and the field of the first row whose bytes differ: a flipped bit on a storage
unit, a torn write, or a backend handing back another row.

xxh3 (the ``xxhash`` library) runs at memory speed (~15 GB/s a thread here; a big
column's rows are split over a few threads, :mod:`rlplane.parallel`); crc32c's Python
binding needs ``bytes`` (a copy per row). A digest of 0 means "not recorded" (rows
written before digests existed, or by a foreign writer) and is not checked.

Example::

    sums = row_sums(column)                  # uint64, one per row
    check_sums("step-0", ids, {"input_ids": column}, tags)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from rlplane import parallel, rowkernels
from rlplane.copies import copy_ranges, gathers, run_starts
from rlplane.column import Column
from rlplane.errors import IntegrityError
from rlplane.tags import SUM_TAG


def row_sums(col: Column) -> np.ndarray:
    """The xxh3-64 digest of each row's bytes (uint64; an empty row's is xxh3 of nothing; a
    row sharing another's bytes gets that row's, one the store holds already the digest it
    was stored with)."""
    values = col.values
    if values.device.type != "cpu":
        values = values.cpu()
    if values.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        values = values.view(torch.int16)
    buf = memoryview(values.detach().numpy().view(np.uint8))  # 1-D and contiguous (a Column's invariant)
    offsets = col.offsets if col.offsets.device.type == "cpu" else col.offsets.cpu()
    bounds = offsets.numpy() * values.element_size()
    sums = np.concatenate(parallel.run(lambda a, z: range_sums(buf, bounds[a:z + 1]),
                                       parallel.spans(bounds, parallel.workers())))
    return shared_sums(col, sums)


def shared_sums(col: Column, sums: np.ndarray) -> np.ndarray:
    """``sums`` (each row's digest of the bytes it stores, in place) with the digests of the
    rows stored empty: a row the store holds from an earlier put gets the digest recorded
    with it, a row sharing another's bytes that row's.

    Example: ``col.with_meta(shared_sums(col, range_sums(raw, bounds)), geom)``."""
    if col.held is not None:  # a row the store holds from an earlier put: the digest recorded with it
        held = col.held.rows
        sums[held] = col.held.refs[held, 4].view(np.uint64)
    if col.same is not None:  # a shared row's digest is that of the row whose bytes it shares
        dup = np.flatnonzero(col.same >= 0)
        sums[dup] = sums[col.same[dup]]
    return sums


def range_sums(buf: memoryview, bounds: np.ndarray) -> np.ndarray:
    """The xxh3-64 digest of each ``buf[bounds[k] : bounds[k + 1]]`` (uint64; ``buf`` bytes,
    ``bounds`` ascending byte offsets): :func:`row_sums` of a column, or of the rows just
    written into one (the codec's masked select digests each piece while it is in cache).

    Example: ``range_sums(memoryview(b"abcd"), np.array([0, 2, 4]))`` digests ``ab`` and ``cd``.
    """
    if bounds.size > _KERNEL_ROWS and rowkernels.ready():  # compiled: no Python call per row
        return rowkernels.digests(np.frombuffer(buf, np.uint8), bounds, split=False)  # (callers split the work)
    edges = bounds.tolist()
    digest = _digest  # (a comprehension over plain ints: ~0.17 µs a row here, a chain of maps ~0.25)
    return np.array([digest(buf[a:z]) for a, z in zip(edges, edges[1:])], np.uint64)


#: A row's digest: xxh3-64 of its bytes (anything with the buffer protocol), as an int.
digest = _digest = xxhash.xxh3_64_intdigest

#: Rows from which :func:`range_sums` digests them with the compiled kernels (a Python call
#: per row costs ~0.3 µs; the kernels' call ~20 µs).
_KERNEL_ROWS = 128

#: The biggest row :func:`copied_sums` copies with the kernels (a row is one thread's work).
_KERNEL_MAX_ROW = 4 << 20

#: Bytes a fused copy moves before it digests them (they are still in cache then).
_STEP = 2 << 20


def copied_sums(dst: np.ndarray, dst_at: np.ndarray, src: np.ndarray, src_at: np.ndarray,
                lens: np.ndarray) -> np.ndarray:
    """Copy rows ``src[src_at[k] : src_at[k] + lens[k]]`` to ``dst[dst_at[k]:]`` (uint8
    arrays) and return each row's xxh3-64 digest of the bytes as copied (uint64): a read
    checks what it hands out without a pass of its own. Big rows that follow one another
    in both go a few MB at a time, each piece digested right after its copy while it is
    in cache, on a few threads; a few MB of rows, or many small runs, are copied at once
    (:func:`~rlplane.copies.copy_ranges`), then digested. Many rows, or MBs of rows of at
    most 4 MiB each, go through the compiled kernels instead (:mod:`rlplane.rowkernels`).

    Example: ``got = copied_sums(out, out_at, slab.u8, slab_at, lens)``.
    """
    n = lens.size
    if n and int(lens.max()) <= _KERNEL_MAX_ROW and (n > _KERNEL_ROWS or int(lens.sum()) >= parallel.PARALLEL_MIN_BYTES) \
            and rowkernels.ready():  # many rows, or MBs of them: one memcpy and one digest a row, compiled
        return rowkernels.copy_rows(dst, dst_at, src, src_at, lens)
    ends = np.concatenate([[0], np.cumsum(lens)])  # where each row would start if the rows were packed
    brk = run_starts(dst_at, src_at, lens)
    if int(ends[-1]) < parallel.PARALLEL_MIN_BYTES or gathers(int(ends[-1]), int(brk.sum())):
        copy_ranges(dst, dst_at, src, src_at, lens)
        raw = memoryview(dst)
        return np.array([_digest(raw[a : a + m]) for a, m in zip(dst_at.tolist(), lens.tolist())], np.uint64)
    # Steps: rows of one run, a new one every _STEP bytes into it (a bigger row is a step of its own).
    run_of = np.cumsum(brk) - 1
    into_run = ends[:-1] - ends[:-1][np.flatnonzero(brk)][run_of]
    key = run_of * (int(ends[-1]) // _STEP + 2) + into_run // _STEP
    steps = np.append(np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]])), n)
    sums = np.empty(n, np.uint64)
    raw = memoryview(dst)

    def piece(a: int, z: int) -> None:
        for x, y in zip(steps[a:z].tolist(), steps[a + 1 : z + 1].tolist()):
            d, s, size = int(dst_at[x]), int(src_at[x]), int(ends[y] - ends[x])
            dst[d : d + size] = src[s : s + size]
            sums[x:y] = range_sums(raw, d + (ends[x : y + 1] - ends[x]))

    parallel.run(piece, parallel.spans(ends[steps], parallel.workers()))
    return sums


def check_sums(partition: str, sample_ids: Sequence[str], columns: Mapping[str, Column],
               tags: Sequence[Mapping[str, Any]]) -> None:
    """IntegrityError unless every row of ``columns`` hashes to the digest its tag recorded."""
    for name, col in columns.items():
        want = recorded(col, tags, name)
        if want.any():
            check_rows(partition, sample_ids, name, row_sums(col), want)


def recorded(col: Column, tags: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    """Each row's digest as its writer recorded it (uint64; 0: none recorded): the column's
    (the transport kept them as an array), else the samples' tags'."""
    if col.sums is not None:
        return col.sums.astype(np.uint64, copy=False)
    return np.fromiter((_recorded(t, name) for t in tags), np.uint64, len(tags))


def check_rows(partition: str, sample_ids: Sequence[str], name: str, got: np.ndarray, want: np.ndarray) -> None:
    """IntegrityError naming the first row of field ``name`` whose digest ``got`` is not the
    one recorded (``want``; rows with none recorded are not checked)."""
    bad = np.flatnonzero((want != 0) & (got != want))
    if bad.size:
        i = int(bad[0])
        raise IntegrityError(
            f"partition {partition!r}, sample {sample_ids[i]!r}, field {name!r}: the bytes read back differ from "
            f"what the writer stored (xxh3 {int(got[i]):#018x}, recorded {int(want[i]):#018x}); "
            f"{bad.size} of {want.size} rows differ. The stored copy is damaged: rewrite the samples"
        )


def _recorded(tag: Mapping[str, Any], name: str) -> int:
    sums = tag.get(SUM_TAG)
    value = sums.get(name, 0) if isinstance(sums, Mapping) else 0
    return value if isinstance(value, int) and 0 <= value < 1 << 64 else 0


__all__ = ["SUM_TAG", "check_rows", "check_sums", "digest", "range_sums", "recorded", "row_sums", "shared_sums"]
