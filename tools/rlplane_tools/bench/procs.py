"""Client processes that start, wait for one signal, run at once, and report: the bench's
multi-process rows (claimers, controller load).

``target(*args, go, start, conn)`` runs in each spawned process: it sends ``b"ready"`` on
``conn`` once connected, waits for ``go``, reads the shared start time from
``start.value`` (``time.perf_counter``, system-wide on Linux) if it needs one, and sends one
msgpack report.

Example::

    reports = run_together(_claimer, (url, token, cfg_dict, p), 4, finish_s=300)
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any, Callable

import msgpack


def run_together(target: Callable[..., None], args: tuple, n: int, *, finish_s: float,
                 indexed: bool = False, on_start: Callable[[], None] | None = None,
                 cancel: threading.Event | None = None) -> list[dict[str, Any]]:
    """Start ``n`` processes, release them together, return their reports (see the module
    docstring). ``indexed``: each process also gets its number (0..n-1) after ``args``;
    ``on_start`` is called as they are released; once ``cancel`` is set (the caller was
    interrupted) the processes are killed at once and RuntimeError raised."""
    ctx = mp.get_context("forkserver")  # forked from one process that imported the target's module once
    ctx.set_forkserver_preload([target.__module__, "rlplane_tools.preloaded"])  # (and the compiled row copies: ~0.4 s a process)
    go, start = ctx.Event(), ctx.Value("d", 0.0)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
    procs = [ctx.Process(target=target, args=(*args, *((k,) if indexed else ()), go, start, there), daemon=True)
             for k, (_, there) in enumerate(pipes)]
    for proc in procs:
        proc.start()
    try:
        for (here, _), proc in zip(pipes, procs):
            _await(here, proc, 120, "start", cancel)
            here.recv_bytes()
        start.value = time.perf_counter()
        go.set()
        if on_start is not None:
            on_start()
        reports = []
        for (here, _), proc in zip(pipes, procs):
            _await(here, proc, finish_s, "finish", cancel)
            reports.append(msgpack.unpackb(here.recv_bytes(), raw=False))
        return reports
    finally:
        for proc in procs:
            proc.join(timeout=0 if cancel is not None and cancel.is_set() else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _await(conn: Any, proc: Any, seconds: float, what: str, cancel: threading.Event | None = None) -> None:
    """Until ``conn`` has a message; TimeoutError after ``seconds``, at once if ``proc`` died,
    RuntimeError once ``cancel`` is set."""
    deadline = time.monotonic() + seconds
    while not conn.poll(0.2):
        if cancel is not None and cancel.is_set():
            raise RuntimeError("cancelled: the run was interrupted")
        if not proc.is_alive():
            raise RuntimeError(f"a bench client process exited (code {proc.exitcode}) before it could {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"a bench client process did not {what} within {seconds:.0f} s")


__all__ = ["run_together"]
