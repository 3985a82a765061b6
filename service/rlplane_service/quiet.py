"""Quiet command output: rlplane's own lines on the terminal, everything else in a log file.

Ray, Serve, the raylet, Mooncake's glog and Python warnings write straight to the
process's stdout/stderr file descriptors (and so do the worker processes the demo and
the bench start, which inherit them). :func:`captured_output` points descriptors 1 and 2
at a log file for the duration of a command and gives rlplane's console a copy of the
original terminal; the command prints the log's path once. ``--verbose`` skips it.

Example::

    with captured_output(console, "demo", verbose=False) as log_path:
        run_demo(cfg, console)      # only rlplane's lines reach the terminal
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console


def log_dir() -> Path:
    """Where command logs go: ``RLPLANE_LOG_DIR``, else ``<tmp>/rlplane-logs`` (not ``<tmp>/rlplane``: a
    directory of the package's name in a process's working directory would shadow the package)."""
    return Path(os.environ.get("RLPLANE_LOG_DIR") or Path(tempfile.gettempdir()) / "rlplane-logs")


@contextmanager
def captured_output(console: Console, command: str, *, verbose: bool) -> Iterator[Path | None]:
    """Send the process's stdout/stderr to a log file; ``console`` keeps the terminal.
    Yields the log's path (None when ``verbose``: everything stays live)."""
    if verbose:
        yield None
        return
    folder = log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rlplane-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    previous = console.file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    console.file = terminal
    console.print(f"[dim]logs of Ray, Serve, Mooncake and torch go to {path} (--verbose shows them here)[/]")
    ours = _ConsoleHandler(console)  # rlplane's own warnings still reach the user
    for name in ("rlplane", "rlplane_service", "rlplane_tools"):
        logging.getLogger(name).addHandler(ours)
    try:
        yield path
    finally:
        for name in ("rlplane", "rlplane_service", "rlplane_tools"):
            logging.getLogger(name).removeHandler(ours)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        console.file = previous
        terminal.close()


class _ConsoleHandler(logging.Handler):
    """rlplane's own warnings, on the console in rlplane's voice."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(f"[yellow]warning[/]: {record.getMessage()}", highlight=False)
        except Exception:  # noqa: BLE001 - a log line must never fail the command
            self.handleError(record)


@contextmanager
def stages(console: Console, first: str) -> Iterator[Callable[[str], None]]:
    """A status line for a start-up of several stages: ``say(stage)`` prints the stage
    (with the seconds since the start) and shows it as the spinner's text."""
    t0 = time.monotonic()
    with console.status(first) as status:
        def say(msg: str) -> None:
            console.print(f"[dim]{time.monotonic() - t0:5.1f} s  {msg}[/]")
            status.update(f"{msg} ...")

        yield say


__all__ = ["captured_output", "stages", "log_dir"]
