"""Copies between byte buffers: one range, or many ranges in one vectorized pass.

What a read does to move rows out of a mapped slab or a staging buffer into the memory
it hands back, and a put to move values in: rows that follow one another in source and
destination move as one run; many small runs go through one index gather; big copies
run on a few threads (:mod:`rlplane.parallel`). No Python loop per row unless rows are big.

Example::

    copy_ranges(out, out_at, slab.u8, slab_at, lens)
"""

from __future__ import annotations

import numpy as np

from rlplane import parallel
from rlplane.gather import BIG_RUN, MAX_RUNS


def copy_ranges(dst: np.ndarray, dst_at: np.ndarray, src: np.ndarray, src_at: np.ndarray, lens: np.ndarray) -> None:
    """``dst[dst_at[k] : dst_at[k] + lens[k]] = src[src_at[k] : ...]`` for every ``k`` (uint8
    arrays): ranges that follow one another in both are copied as one run; many small
    runs go through one index gather. No Python loop per row unless rows are big."""
    n = lens.size
    if not n:
        return
    total = int(lens.sum())
    s0, d0 = int(src_at[0]), int(dst_at[0])
    if n == 1 or (bool((src_at[1:] - src_at[:-1] == lens[:-1]).all())
                  and bool((dst_at[1:] - dst_at[:-1] == lens[:-1]).all())):  # one run: the usual read of one put
        copy(dst[d0 : d0 + total], src[s0 : s0 + total])
        return
    run_at = np.flatnonzero(run_starts(dst_at, src_at, lens))
    if not gathers(total, run_at.size):
        ends = np.concatenate([[0], np.cumsum(lens)])
        size = (ends[np.append(run_at[1:], n)] - ends[run_at]).tolist()  # (plain ints: no numpy scalar per run)
        small = parallel.PARALLEL_MIN_BYTES
        for s0, d0, m in zip(src_at[run_at].tolist(), dst_at[run_at].tolist(), size):
            if m < small:  # (copy's own test, without its call per run)
                dst[d0 : d0 + m] = src[s0 : s0 + m]
            else:
                copy(dst[d0 : d0 + m], src[s0 : s0 + m])
        return
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    dst[np.repeat(dst_at, lens) + within] = src[np.repeat(src_at, lens) + within]


def run_starts(dst_at: np.ndarray, src_at: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Bool per range ``k`` of :func:`copy_ranges`: it starts a run (it does not follow
    range ``k - 1`` in both source and destination).

    Example: ``run_starts(np.array([0, 4]), np.array([8, 12]), np.array([4, 4]))`` is ``[True, False]``.
    """
    starts = np.ones(lens.size, dtype=bool)
    if lens.size:
        starts[1:] = (src_at[1:] != src_at[:-1] + lens[:-1]) | (dst_at[1:] != dst_at[:-1] + lens[:-1])
    return starts


def gathers(total: int, runs: int) -> bool:
    """Whether ``runs`` runs of ``total`` bytes in all move by one index gather (many small
    runs) rather than by a copy per run."""
    return runs > MAX_RUNS and total < 8 * BIG_RUN * runs


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for uint8 arrays of one size; a big copy split over a few threads
    (:mod:`rlplane.parallel`)."""
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    if dst.size < parallel.PARALLEL_MIN_BYTES:  # one piece: on this thread, no split
        dst[:] = src
        return

    def piece(a: int, z: int) -> None:
        dst[a:z] = src[a:z]

    parallel.run(piece, parallel.chunks(int(dst.size), parallel.workers()))


__all__ = ["copy", "copy_ranges", "gathers", "run_starts"]
