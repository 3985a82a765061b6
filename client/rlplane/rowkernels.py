"""Row copies and row digests compiled (numba), run without the interpreter lock.

A put cuts each sample's tokens out of a padded ``[B, S, ...]`` tensor and digests every
row; a read pads them back, or copies them out of a slab, and checks every row's digest.
Done with numpy, that is a boolean select (~1 ns a token, holding the interpreter lock)
and a Python call per row digest (~0.3 µs a row): on text-scale B=4096 (four token fields)
~17 ms of a put's 20 ms encode, where a memcpy of the same bytes takes ~4 ms. Here each
row is one ``memcpy`` and one ``XXH3_64bits`` call in compiled code (the very xxh3 the
``xxhash`` package calls: its library's symbol, checked against it at load), rows split
over a few threads (:mod:`rlplane.parallel`).

Every function checks that each range lies inside its buffers before any byte moves (an
offset out of bounds is a ValueError, never a stray write). Where numba cannot be
loaded, :func:`ready` is False and callers keep their numpy path (same bytes, same
digests). The loops themselves are in :mod:`rlplane._rowkernels_jit`, compiled once per
machine (numba's cache beside it, else the user's cache directory; ~2.4 s here) and
loaded by a process on its first big copy (~0.4 s, numba's import included).

Example::

    if rowkernels.ready():
        sums = rowkernels.copy_rows(dst, dst_at, src, src_at, lens)   # uint8 buffers, int64 offsets
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import xxhash

from rlplane import parallel

log = logging.getLogger(__name__)

_kernels: Any = None  # the compiled functions (their module), False when they cannot be loaded
_lock = threading.Lock()
_loading: threading.Thread | None = None  # the load_soon thread of this process, once started


def ready() -> bool:
    """Whether the compiled kernels are loaded here (loading them on first call)."""
    return _load() is not False


def load_soon() -> None:
    """Start loading the kernels on a daemon thread, once per process (no-op when loaded or
    under way); whoever needs them first waits for that load, never starts a second.

    Example: ``rowkernels.load_soon()`` at a worker's start, long before its first read.
    """
    global _loading
    if _kernels is not None or _loading is not None:
        return
    with _lock:
        if _kernels is not None or _loading is not None:
            return
        _loading = threading.Thread(target=_load, name="rlplane-rowkernels", daemon=True)
    _loading.start()


def digests(buf: np.ndarray, bounds: np.ndarray, *, split: bool = True) -> np.ndarray:
    """The xxh3-64 digest of each ``buf[bounds[k] : bounds[k + 1]]`` (``buf`` uint8, 1-D,
    contiguous; ``bounds`` ascending offsets), as uint64. ``split=False``: all on the
    calling thread (work already split over the threads).

    Example: ``digests(np.frombuffer(b"abcd", np.uint8), np.array([0, 2, 4]))``.
    """
    k = _need()
    bounds = _offsets(bounds)
    n = bounds.size - 1
    sums = np.empty(max(n, 0), np.uint64)
    if n <= 0:
        return sums
    if int(bounds[0]) < 0 or int(bounds[-1]) > buf.size or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"row bounds outside a buffer of {buf.size} bytes, or not ascending")
    parallel.run(lambda a, z: k.digest_ranges(buf, bounds, sums, a, z),
                 parallel.spans(bounds, parallel.workers() if split else 1))
    return sums


def copy_rows(dst: np.ndarray, dst_at: np.ndarray, src: np.ndarray, src_at: np.ndarray,
              lens: np.ndarray, *, digest: bool = True) -> np.ndarray | None:
    """``dst[dst_at[k] : dst_at[k] + lens[k]] = src[src_at[k] : ...]`` for every row ``k``
    (uint8 buffers, 1-D, contiguous), and each row's xxh3-64 digest (uint64; None with
    ``digest=False``). Destination rows must not overlap (rows run on several threads).

    Example: ``sums = copy_rows(out, np.array([0]), slab, np.array([4096]), np.array([64]))``.
    """
    k = _need()
    dst_at, src_at, lens = _offsets(dst_at), _offsets(src_at), _offsets(lens)
    _inside(dst, dst_at, lens, "destination")
    _inside(src, src_at, lens, "source")
    sums = np.empty(lens.size, np.uint64)
    ends = np.concatenate([[0], np.cumsum(lens)])
    parallel.run(lambda a, z: k.copy_rows(dst, dst_at, src, src_at, lens, sums, digest, a, z),
                 parallel.spans(ends, parallel.workers()))
    return sums if digest else None


def pad_rows(dst: np.ndarray, row_bytes: int, src: np.ndarray, src_at: np.ndarray, lens: np.ndarray,
             fill: np.ndarray, *, digest: bool = True) -> np.ndarray | None:
    """Padded rows from packed ones: row ``k`` of ``dst`` (``row_bytes`` each, one after
    another) gets ``src[src_at[k] : src_at[k] + lens[k]]`` then the rest of ``fill`` (one
    row's bytes of the pad value); returns each source row's xxh3-64 digest (uint64; None
    with ``digest=False``). Bytes of ``dst`` past ``len(lens)`` rows are not written.

    Example: ``sums = pad_rows(out, 8 * seq, packed, starts, lens, pad_row)``.
    """
    k = _need()
    src_at, lens = _offsets(src_at), _offsets(lens)
    n = lens.size
    if row_bytes < 0 or dst.size < n * row_bytes or fill.size < row_bytes or bool((lens > row_bytes).any()):
        raise ValueError(f"{n} rows of {row_bytes} bytes do not fit the padded buffer or its fill")
    _inside(src, src_at, lens, "source")
    sums = np.empty(n, np.uint64)
    parallel.run(lambda a, z: k.pad_rows(dst, row_bytes, src, src_at, lens, fill, sums, digest, a, z),
                 parallel.spans(np.arange(n + 1, dtype=np.int64) * row_bytes, parallel.workers()))
    return sums if digest else None


def _offsets(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise ValueError(f"row offsets and lengths must be integers, not {a.dtype}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError("a row offset or length beyond int64")
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


def _inside(buf: np.ndarray, at: np.ndarray, lens: np.ndarray, what: str) -> None:
    """ValueError unless every row ``[at[k], at[k] + lens[k])`` lies in ``buf`` (compared
    without adding, so no sum can wrap around)."""
    if at.size != lens.size:
        raise ValueError(f"{at.size} {what} offsets for {lens.size} rows")
    if lens.size and (int(lens.min()) < 0 or int(at.min()) < 0 or bool((at > buf.size - lens).any())):
        raise ValueError(f"a row outside the {what} buffer of {buf.size} bytes")


def _need() -> Any:
    k = _load()
    if k is False:
        raise RuntimeError("rlplane's compiled row kernels are not loaded here (numba is missing); check ready() first")
    return k


def _load() -> Any:
    global _kernels
    if _kernels is None:
        with _lock:
            if _kernels is None:
                try:
                    _kernels = _compile()
                except Exception as err:  # noqa: BLE001 - any failure to load leaves the numpy path
                    log.warning("rlplane: compiled row kernels unavailable (%s: %s); using numpy's slower path",
                                type(err).__name__, err)
                    _kernels = False
    return _kernels


def _compile() -> Any:
    """Import (compile, or load from numba's cache) the kernels; check their digest against
    the xxhash package's."""
    from rlplane import _rowkernels_jit as jit

    probe = np.frombuffer(b"rlplane row kernels", np.uint8)
    got = np.empty(2, np.uint64)
    jit.digest_ranges(probe, np.array([0, 7, probe.size], np.int64), got, 0, 2)
    want = [xxhash.xxh3_64_intdigest(probe[:7].tobytes()), xxhash.xxh3_64_intdigest(probe[7:].tobytes())]
    if got.tolist() != want:
        raise RuntimeError("the compiled xxh3 disagrees with the xxhash package's")
    return jit


#: How long a fork waits for the load :func:`load_soon` started (a child forked meanwhile
#: would inherit the import lock of a thread it does not have, and its own load would hang).
FORK_WAIT_S = 30.0
_cut_short = False  # a fork went ahead while that load still ran


def _finish_loading() -> None:
    global _cut_short
    t = _loading
    if t is not None and t.is_alive() and t is not threading.current_thread():
        t.join(FORK_WAIT_S)
        _cut_short = t.is_alive()


def _forget_lock() -> None:  # in a forked child: a load another thread had under way is not there
    global _lock, _loading, _kernels
    _lock = threading.Lock()
    _loading = None
    if _cut_short and _kernels is None:  # its import is half done here, for good: the numpy path
        _kernels = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_finish_loading, after_in_child=_forget_lock)


__all__ = ["ready", "load_soon", "digests", "copy_rows", "pad_rows"]
