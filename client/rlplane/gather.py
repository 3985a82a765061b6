"""Gather rows out of several columns into one contiguous buffer, in a requested order.

The one copy a read makes on a storage unit (rows of the blocks a read asks for) and on
the client (one field's parts from several units). Vectorized: rows that lie one after
another in the same source are copied as one run; when a request breaks into many small
runs, one index gather per source does the copy. No Python loop per row.

Example::

    values, offsets = gather([(v0, o0), (v1, o1)], which=np.array([1, 0]), rows=np.array([0, 2]))
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Copy run by run while there are at most this many runs (or runs are big on average).
MAX_RUNS = 64
BIG_RUN = 256  # elements: shorter runs on average go through one index gather


def gather(
    sources: Sequence[tuple[np.ndarray, np.ndarray]], which: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of row ``rows[i]`` of source ``which[i]``, for every ``i`` in order.

    ``sources[k]`` is ``(values, offsets)`` (1-D values, int64 offsets of ``rows + 1``);
    every source has the same dtype. Returns a view of the source when the request is
    one run of one source (no copy), else a new buffer. IndexError on a row out of range.
    """
    which = np.asarray(which, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    n = which.size
    if not sources:
        raise IndexError("no sources to gather from")
    dtype = sources[0][0].dtype
    starts = np.empty(n, dtype=np.int64)
    lens = np.empty(n, dtype=np.int64)
    for k in np.unique(which).tolist():
        if not 0 <= k < len(sources):
            raise IndexError(f"source {k} of {len(sources)}")
        values, offsets = sources[k]
        if values.dtype != dtype:
            raise TypeError(f"sources hold different dtypes ({values.dtype} and {dtype})")
        mask = which == k
        r = rows[mask]
        if r.size and (int(r.min()) < 0 or int(r.max()) >= offsets.size - 1):
            raise IndexError(f"row out of range of a source of {offsets.size - 1} rows")
        starts[mask] = offsets[r]
        lens[mask] = offsets[r + 1] - offsets[r]
    out_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=out_offsets[1:])
    total = int(out_offsets[-1])
    if n == 0:
        return np.empty(0, dtype=dtype), out_offsets
    # A run continues while the source stays the same and the next row starts where this one ends.
    breaks = np.ones(n, dtype=bool)
    breaks[1:] = (which[1:] != which[:-1]) | (starts[1:] != starts[:-1] + lens[:-1])
    run_at = np.flatnonzero(breaks)
    if run_at.size == 1:
        k, s = int(which[0]), int(starts[0])
        return sources[k][0][s : s + total], out_offsets
    out = np.empty(total, dtype=dtype)
    if run_at.size <= MAX_RUNS or total >= BIG_RUN * run_at.size:
        run_end = np.append(run_at[1:], n)
        src0 = starts[run_at].tolist()
        dst0 = out_offsets[run_at].tolist()
        dst1 = out_offsets[run_end].tolist()
        for k, s, d0, d1 in zip(which[run_at].tolist(), src0, dst0, dst1):
            out[d0:d1] = sources[k][0][s : s + (d1 - d0)]
        return out, out_offsets
    for k in np.unique(which).tolist():
        mask = which == k
        klens = lens[mask]
        ktotal = int(klens.sum())
        if not ktotal:
            continue
        # element j of the m-th selected row: source starts[m] + j -> destination out_offsets[m] + j
        within = np.arange(ktotal, dtype=np.int64) - np.repeat(np.cumsum(klens) - klens, klens)
        src = np.repeat(starts[mask], klens) + within
        dst = np.repeat(out_offsets[:-1][mask], klens) + within
        out[dst] = sources[k][0][src]
    return out, out_offsets


__all__ = ["gather", "MAX_RUNS", "BIG_RUN"]
