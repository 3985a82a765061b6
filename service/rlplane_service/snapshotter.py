"""Periodic snapshots (``RLPLANE_SNAPSHOT_INTERVAL_S``): every interval one replica of the
service snapshots the native store into ``RLPLANE_SNAPSHOT_DIR/auto-<UTC time>`` and
deletes the oldest automatic snapshots beyond ``RLPLANE_SNAPSHOT_KEEP`` (snapshots named
otherwise are never touched). Each snapshot truncates the journal (RLPLANE_JOURNAL_DIR).

Which replica: the store's metrics actor hands out one turn per interval (``turn``), so
several replicas take one snapshot between them. A snapshot that fails is logged and the
next interval tries again; ``rlplane_snapshot_age_seconds`` (and the RlplaneSnapshotStale
alert) shows when none has succeeded for three intervals.

Example::

    s = Snapshotter(transport, Path("/var/lib/rlplane/snapshots"), 600, keep=3, turn=lambda: True).start()
    s.stop()
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rlplane import errors as E

log = logging.getLogger(__name__)

PREFIX = "auto-"


class Snapshotter:
    """Takes a snapshot every ``interval_s`` when ``turn()`` says so (see the module docstring)."""

    def __init__(self, transport: Any, root: Path, interval_s: float, *, keep: int = 3,
                 turn: Callable[[], bool] = lambda: True) -> None:
        self.transport, self.root, self.interval_s, self.keep, self.turn = transport, Path(root), interval_s, keep, turn
        self.taken = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlplane-snapshotter", daemon=True)

    def start(self) -> Snapshotter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.turn():
                    self.once()
            except Exception as err:  # noqa: BLE001 - the next interval tries again; the age metric shows it
                self.failed += 1
                log.error("periodic snapshot failed: %s: %s", type(err).__name__, err)

    def once(self) -> Path:
        """Take one snapshot now and prune the oldest beyond ``keep``; returns its path."""
        from rlplane import snapshot

        self.root.mkdir(parents=True, exist_ok=True)
        dest = self.root / f"{PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        k = 1
        while dest.exists():  # two in one second
            dest, k = self.root / f"{PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{k}", k + 1
        info = snapshot.take(self.transport, dest)
        self.taken += 1
        log.info("periodic snapshot: %d samples, %d bytes in %.2f s -> %s", info.samples, info.nbytes, info.seconds,
                 dest)
        self.prune()
        return dest

    def prune(self) -> list[Path]:
        """Delete the oldest complete automatic snapshots beyond ``keep``, and what the
        automatic snapshots of a process that died while writing left (a hidden
        ``.auto-*.tmp-*`` directory nothing was written into for an interval, at least a
        minute: one still being written is left alone); returns them."""
        done = sorted(p for p in self.root.glob(f"{PREFIX}*") if (p / "manifest.json").is_file())
        gone = done[: max(0, len(done) - self.keep)]
        idle_s = max(float(self.interval_s), 60.0)
        gone += [p for p in self.root.glob(f".{PREFIX}*.tmp-*") if p.is_dir() and _idle_s(p) > idle_s]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone


def _idle_s(path: Path) -> float:
    """Seconds since anything in directory ``path`` (one level) was last written."""
    try:
        last = max([path.stat().st_mtime] + [f.stat().st_mtime for f in path.iterdir()])
    except OSError:  # (removed meanwhile)
        return 0.0
    return time.time() - last


def start_snapshotter(settings: Any, transport: Any, ledger: Any) -> Snapshotter | None:
    """The replica's snapshotter, when RLPLANE_SNAPSHOT_INTERVAL_S is set (native only)."""
    if not settings.snapshot_interval_s:
        return None
    if settings.snapshot_dir is None:
        raise E.InvalidArgumentError("RLPLANE_SNAPSHOT_INTERVAL_S needs RLPLANE_SNAPSHOT_DIR (where the periodic "
                                     "snapshots go)")
    import ray

    def turn() -> bool:
        return bool(ray.get(ledger.turn.remote("snapshot", float(settings.snapshot_interval_s)), timeout=30))

    return Snapshotter(transport, Path(settings.snapshot_dir), float(settings.snapshot_interval_s),
                       keep=settings.snapshot_keep, turn=turn).start()


__all__ = ["Snapshotter", "start_snapshotter", "PREFIX"]
