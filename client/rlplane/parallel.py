"""Memory-bound work on big buffers split over a few threads: the row digests of a put
and a read, the byte compares that find a group's copied images, big copies in and out
of the slabs.

One thread reads memory at ~10-15 GB/s on the hosts we measured; two read ~2x that
(xxh3 and numpy's compares and copies release the GIL), so a put of vlm-step digests its
168 MB in about half the time. The threads are rlplane's own, whatever torch's thread
count (a Ray actor's is its ``num_cpus``, often 1). Work below :data:`PARALLEL_MIN_BYTES` stays on the calling thread
(handing a piece to a thread costs tens of µs). The pool is one per process, made on
first use with :func:`workers` threads, and made again in a forked child (a pool's
threads do not survive a fork).

Example::

    bounds = np.array([0, 4 << 20, 8 << 20, 12 << 20])       # three rows of 4 MiB
    parts = spans(bounds, 2)                                  # [(0, 2), (2, 3)]
    sizes = run(lambda a, z: int(bounds[z] - bounds[a]), parts)   # [8 MiB, 4 MiB]
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

#: Bytes of work below which it runs on the calling thread.
PARALLEL_MIN_BYTES = 4 << 20
#: Threads at most, the calling one included (memory bandwidth stops growing past a few).
MAX_WORKERS = 4

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_local = threading.local()
_cpus: int | None = None  # what this process may use (affinity and cgroup quota), found once


def background() -> None:
    """Keep the calling thread's memory work on it from now on (:func:`workers` is 1
    there): a background thread at low CPU priority (a snapshot's) must not hand its
    work to the shared threads, which run at normal priority."""
    _local.background = True


def workers() -> int:
    """Threads a piece of work is split over: the CPUs this process may run on (its
    affinity, and its cgroup's CPU quota: a pod limited to one CPU on a big host gets
    one), at most :data:`MAX_WORKERS`; 1 on a :func:`background` thread."""
    global _cpus
    if getattr(_local, "background", False):
        return 1
    if _cpus is None:
        _cpus = _usable_cpus()
    return max(1, min(MAX_WORKERS, _cpus))


def _usable_cpus() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" (no limit) or "<quota> <period>"
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max" and int(period) > 0:
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def spans(bounds: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Split the rows whose byte bounds are ``bounds`` (n + 1 ascending offsets) into at
    most ``parts`` runs ``(first, end)`` of about equal bytes; one run when they hold
    fewer than :data:`PARALLEL_MIN_BYTES` or ``parts`` is 1.

    Example: ``spans(np.array([0, 10, 20, 30, 40]), 2)`` is ``[(0, 4)]`` (too few bytes).
    """
    n = int(bounds.size) - 1
    total = int(bounds[-1] - bounds[0]) if n > 0 else 0
    k = min(parts, n, max(1, total // (PARALLEL_MIN_BYTES // 2)))
    if k <= 1:
        return [(0, max(n, 0))]
    goals = bounds[0] + (total * np.arange(1, k)) // k
    cuts = np.unique(np.concatenate([[0], np.searchsorted(bounds[1:], goals, side="left") + 1, [n]]))
    cuts = cuts[(cuts >= 0) & (cuts <= n)]
    return [(int(a), int(z)) for a, z in zip(cuts[:-1], cuts[1:]) if z > a]


def chunks(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """Byte ranges ``(start, end)`` splitting a buffer of ``nbytes`` into at most ``parts``
    pieces of at least half :data:`PARALLEL_MIN_BYTES` each (4 KiB aligned); one range
    when it is smaller than :data:`PARALLEL_MIN_BYTES`.

    Example: ``chunks(32 << 20, 2)`` is ``[(0, 16 << 20), (16 << 20, 32 << 20)]``.
    """
    k = max(1, min(parts, nbytes // (PARALLEL_MIN_BYTES // 2)))
    cuts = [0, *(((nbytes * i) // k) & ~4095 for i in range(1, k)), nbytes]
    return [(a, z) for a, z in zip(cuts[:-1], cuts[1:]) if z > a] or [(0, nbytes)]


def run(fn: Callable[[int, int], T], parts: Sequence[tuple[int, int]]) -> list[T]:
    """``[fn(a, z) for a, z in parts]``, the first part on the calling thread and the
    others on the pool; the first exception raised is raised here, once all are done."""
    if len(parts) <= 1:
        return [fn(a, z) for a, z in parts]
    try:
        futures = [_executor().submit(fn, a, z) for a, z in parts[1:]]
    except RuntimeError:  # the interpreter is shutting down (its pools take nothing new): here, in turn
        return [fn(a, z) for a, z in parts]
    try:
        first = fn(*parts[0])
    finally:
        rest_errors = [f.exception() for f in futures]
    for err in rest_errors:
        if err is not None:
            raise err
    return [first, *(f.result() for f in futures)]


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # Its threads keep what they run to themselves (a nested run would wait on its own pool).
            _pool = ThreadPoolExecutor(max(1, workers() - 1), thread_name_prefix="rlplane-memory",
                                       initializer=background)
        return _pool


def _forget_pool() -> None:  # in a forked child: the parent's threads are not there
    global _pool, _lock, _cpus
    _pool, _lock, _cpus = None, threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


__all__ = ["PARALLEL_MIN_BYTES", "MAX_WORKERS", "background", "workers", "spans", "chunks", "run"]
