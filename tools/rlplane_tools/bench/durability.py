"""``rlplane bench --durability``: snapshots against this disk, and puts while one runs.

A native engine on loopback (``LocalEngine``: two storage units in processes of their own,
the snapshotting client in this process) is filled with vlm-step puts up to ``--gib``.
In the same run:

- the disk: one file of the snapshot's size written and fsynced (sequential write), then
  read back with its pages dropped from the page cache first (sequential read), written
  through the page cache and around it (as a snapshot writes), once before the snapshot
  and once after the restore: the fastest write and the fastest read are the baselines;
- ``snapshot.take`` of the whole store into a new directory there, from a process of its
  own (as the service's replica is): its GB/s against the disk's write (target >= 0.7x);
- ``snapshot.restore`` into a new engine of three units (their slabs pre-faulted first),
  from a process of its own, the snapshot's pages dropped from the page cache first: its
  GB/s against the disk's read (target >= 0.7x);
- small puts (text-step, B=8) from another process for a few seconds without a
  snapshot, then while one runs: p99 with against p99 without (target <= 2x);
- the journal (RLPLANE_JOURNAL_DIR on the same disk): text-step B=8 puts with
  ``durable=True`` into an engine with a journal against plain puts into one without
  (median, target <= 1.5x), and vlm-step durable puts' GB/s against the disk's write.

Example::

    results = run_durability_bench(DurabilityBenchConfig(gib=0.25), console)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from rlplane_tools.bench.report import machine_facts

#: Targets of the durability issue: snapshot / restore speed as a share of the disk's, put p99 growth,
#: a durable small put's time against a plain one's.
WRITE_SHARE, READ_SHARE, P99_GROWTH, DURABLE_SLOWDOWN = 0.7, 0.7, 2.0, 1.5
CHUNK = 64 << 20


@dataclass
class DurabilityBenchConfig:
    gib: float = 1.0
    dir: str | None = None  # where the snapshot and the disk's probe file go (default: a temporary directory)
    put_seconds: float = 4.0


def run_durability_bench(cfg: DurabilityBenchConfig, console: Console) -> dict:
    """Fill, probe the disk, snapshot (with puts going on), restore; print the table; return the results."""
    from rlplane import Client, default_registry
    from rlplane.snapshot import SnapshotInfo
    from rlplane.testing.workloads import vlm_step
    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    w = vlm_step(16, 1024, seed=7)
    want = int(cfg.gib * 2**30)
    slab = int(want * 1.15) + (128 << 20)  # a unit may get every put
    root = Path(tempfile.mkdtemp(prefix="rlplane-durability-", dir=cfg.dir))
    try:
        with LocalEngine(2, slab_bytes=slab, processes=True, lease_s=600) as src:
            client = Client(default_registry().without_sharing(), NativeTransport(src.info, timeout=600, data_path="shm"))
            try:
                populated(client.transport)
                stored = 0
                with console.status("filling with vlm-step puts of 16") as status:
                    for k in range(100_000):
                        if stored >= want:
                            break
                        client.put_samples(f"vlm-{k % 8}", w.fields)
                        stored = client.transport.stats()["live_bytes"]
                        status.update(f"filling: {k + 1} vlm-step puts of 16, {stored / 2**30:.2f} GiB")
                with console.status(f"disk: writing and reading {stored / 2**30:.2f} GiB"):
                    disk = [_disk(root / "probe", stored)]
                quiet = _puts_from_another_process(src.info, cfg.put_seconds, None)
                snapper = _Child()  # started (and its imports done) before the timed window opens
                started, done = threading.Event(), threading.Event()
                lat: dict = {}
                t = threading.Thread(target=lambda: lat.update(_puts_from_another_process(src.info, 600, done, started)))
                t.start()
                if not started.wait(120):
                    raise RuntimeError("the putting process did not start within 120 s")
                time.sleep(0.3)
                with console.status("snapshot (puts going on)"):
                    info = SnapshotInfo(**snapper.run(_snapshot_op, "take", src.info, str(root / "snap")))
                done.set()
                snapper.close()
                t.join(timeout=120)
            finally:
                client.close()
        _drop_cache(root / "snap")
        with LocalEngine(3, slab_bytes=slab, processes=True, lease_s=600) as dst:
            with Client(default_registry().without_sharing(), NativeTransport(dst.info, timeout=600, data_path="shm")) as c2:
                with console.status("restore into 3 storage units (their slabs pre-fault first)"):
                    populated(c2.transport)
                    restorer = _Child()
                    back = SnapshotInfo(**restorer.run(_snapshot_op, "restore", dst.info, str(root / "snap")))
                    restorer.close()
                if back.samples != info.samples:
                    raise RuntimeError(f"the restore came back with {back.samples} of {info.samples} samples")
        with console.status("disk: writing and reading it again"):
            disk.append(_disk(root / "probe", stored))  # the faster of two probes is the baseline
        disk_w = max(w for probe in disk for w, _ in probe.values())
        disk_r = max(r for probe in disk for _, r in probe.values())
        with console.status("journal: durable puts against plain ones"):
            shutil.rmtree(root / "snap", ignore_errors=True)
            journal = _journal_bench(root / "journal", min(cfg.gib, 0.5))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    snap_gbs, rest_gbs = info.files_bytes / info.seconds / 1e9, info.files_bytes / back.seconds / 1e9
    p99_quiet, p99_busy = quiet["p99_ms"], lat.get("p99_ms", float("nan"))
    if not lat.get("n"):
        raise RuntimeError("no put was timed while the snapshot ran")
    rows = [
        {"what": "snapshot", "GB/s": snap_gbs, "disk GB/s": disk_w, "ratio": snap_gbs / disk_w, "target": WRITE_SHARE,
         "met": snap_gbs / disk_w >= WRITE_SHARE, "seconds": info.seconds, "cut_ms": info.cut_ms},
        {"what": "restore", "GB/s": rest_gbs, "disk GB/s": disk_r, "ratio": rest_gbs / disk_r, "target": READ_SHARE,
         "met": rest_gbs / disk_r >= READ_SHARE, "seconds": back.seconds},
        {"what": "put p99 (text-step B=8)", "quiet ms": p99_quiet, "busy ms": p99_busy, "ratio": p99_busy / p99_quiet,
         "target": P99_GROWTH, "met": p99_busy / p99_quiet <= P99_GROWTH, "puts_quiet": quiet["n"],
         "puts_busy": lat.get("n", 0)},
        {"what": "durable put (text-step B=8)", "durable ms": journal["durable_ms"], "plain ms": journal["plain_ms"],
         "journalled ms": journal["journalled_ms"], "ratio": journal["durable_ms"] / journal["plain_ms"],
         "target": DURABLE_SLOWDOWN, "met": journal["durable_ms"] / journal["plain_ms"] <= DURABLE_SLOWDOWN},
        {"what": "durable put (vlm-step B=16)", "GB/s": journal["vlm_gbs"], "disk GB/s": disk_w,
         "ratio": journal["vlm_gbs"] / disk_w, "seconds": journal["vlm_seconds"], "bytes": journal["vlm_bytes"]},
    ]
    table = Table(title=f"snapshot of {info.files_bytes / 2**30:.2f} GiB ({info.samples} vlm-step samples) on "
                        f"{cfg.dir or tempfile.gettempdir()}")
    for col in ("", "measured", "baseline", "ratio", "target", ""):
        table.add_column(col, justify="right")
    table.add_row("snapshot", f"{snap_gbs:.2f} GB/s", f"disk write {disk_w:.2f} GB/s", f"{rows[0]['ratio']:.2f}x",
                  f">= {WRITE_SHARE}x", "met" if rows[0]["met"] else "missed")
    table.add_row("restore", f"{rest_gbs:.2f} GB/s", f"disk read {disk_r:.2f} GB/s", f"{rows[1]['ratio']:.2f}x",
                  f">= {READ_SHARE}x", "met" if rows[1]["met"] else "missed")
    table.add_row("put p99", f"{p99_busy:.2f} ms (snapshot)", f"{p99_quiet:.2f} ms (none)", f"{rows[2]['ratio']:.2f}x",
                  f"<= {P99_GROWTH}x", "met" if rows[2]["met"] else "missed")
    table.add_row("durable put", f"{journal['durable_ms']:.2f} ms (text-step B=8)",
                  f"{journal['plain_ms']:.2f} ms (no journal)", f"{rows[3]['ratio']:.2f}x", f"<= {DURABLE_SLOWDOWN}x",
                  "met" if rows[3]["met"] else "missed")
    table.add_row("durable put", f"{journal['vlm_gbs']:.2f} GB/s (vlm-step B=16)", f"disk write {disk_w:.2f} GB/s",
                  f"{rows[4]['ratio']:.2f}x", "bound by the disk", "")
    console.print(table)
    console.print(f"journal on, durable=False: {journal['journalled_ms']:.2f} ms a text-step put (fsynced every 20 ms "
                  "behind it)")
    console.print(f"cut: the controller's lock held {info.cut_ms:.1f} ms (the longest a commit or claim waited for it)")
    console.print("disk probes, write / read GB/s (the baseline is the fastest of each): " + "; ".join(
        f"{how} {w:.2f} / {r:.2f}" for probe in disk for how, (w, r) in probe.items()))
    return {"durability": rows, "disk_probes": disk, "config": asdict(cfg), "machine": machine_facts()}


def _journal_bench(jdir: Path, gib: float, n_small: int = 300) -> dict:
    """Median time of text-step B=8 puts: plain into an engine without a journal, plain and
    ``durable=True`` into one with a journal in ``jdir``; and vlm-step durable puts' GB/s."""
    from rlplane import Client, default_registry
    from rlplane.testing.workloads import text_step, vlm_step
    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    small, big = text_step(8, 128, seed=1), vlm_step(16, 1024, seed=7)
    slab = int(gib * 2**30 * 1.2) + (256 << 20)

    def timed(c: Any, durable: bool, n: int) -> float:
        lat = []
        for k in range(n):
            t0 = time.perf_counter()
            c.put_samples(f"small-{k % 4}", small.fields, durable=durable)
            lat.append(time.perf_counter() - t0)
            if k % 64 == 63:
                c.clear(f"small-{k % 4}")
        return float(np.median(lat)) * 1e3

    out: dict[str, float] = {}
    with LocalEngine(2, slab_bytes=slab, processes=True, lease_s=600) as plain:
        with Client(default_registry().without_sharing(), NativeTransport(plain.info, timeout=600, data_path="shm")) as c:
            timed(c, False, 20)
            out["plain_ms"] = timed(c, False, n_small)
    with LocalEngine(2, slab_bytes=slab, processes=True, lease_s=600, journal_dir=jdir) as journalled:
        with Client(default_registry().without_sharing(), NativeTransport(journalled.info, timeout=600, data_path="shm")) as c:
            timed(c, False, 20)
            out["journalled_ms"] = timed(c, False, n_small)
            out["durable_ms"] = timed(c, True, n_small)
            c.put_samples("vlm-size", big.fields)
            per_put = int(c.transport.describe("vlm-size").nbytes)  # the bytes one vlm-step put stores
            c.clear("vlm-size")
            k, t0 = 0, time.monotonic()
            while k * per_put < gib * 2**30 and k < 10_000:
                c.put_samples(f"vlm-{k % 8}", big.fields, durable=True)
                k += 1
            took = time.monotonic() - t0
            out.update(vlm_gbs=k * per_put / took / 1e9, vlm_seconds=took, vlm_bytes=float(k * per_put))
    shutil.rmtree(jdir, ignore_errors=True)
    return out


def populated(transport: Any, within_s: float = 300.0) -> None:
    """Wait until every unit's slab is pre-faulted (a unit does it in the background at start)."""
    deadline = time.monotonic() + within_s
    for u in range(len(transport.units)):
        while not transport._unit(u).call({"op": "stats"}, timeout=60)[0].get("populated", True):
            if time.monotonic() > deadline:
                raise RuntimeError(f"storage unit {u}'s slab was not pre-faulted within {within_s:.0f} s")
            time.sleep(0.2)


class _Child:
    """A process of its own (as the service's replica is: not the controller's, whose
    thread would share this one's interpreter lock), rlplane imported before it is used."""

    def __init__(self) -> None:
        self._pool = mp.get_context("spawn").Pool(1)
        self._pool.apply(_warm)

    def run(self, fn: Any, *args: Any) -> Any:
        return self._pool.apply(fn, args)

    def close(self) -> None:
        self._pool.close()
        self._pool.join()


def _warm() -> None:
    import rlplane.snapshot  # noqa: F401
    import rlplane.transports.native  # noqa: F401


def _snapshot_op(op: str, info: dict, path: str) -> dict:
    """``rlplane.snapshot.take`` or ``.restore`` (``op``) of the store at ``info``, in this process."""
    from rlplane import snapshot
    from rlplane.transports.native import NativeTransport

    t = NativeTransport(info, timeout=600, data_path="shm")
    try:
        return getattr(snapshot, op)(t, path).to_dict()
    finally:
        t.close()


def _disk(path: Path, nbytes: int) -> dict[str, tuple[float, float]]:
    """Sequential write (+ fsync) and read (page cache dropped first) of ``nbytes``, GB/s
    each, written through the page cache ("buffered") and around it ("direct", as a
    snapshot writes: rlplane.durable.StreamedFile). On a VM the two differ both ways: a
    buffered write is slowed by the guest's writeback, and its read back may come from
    the host's cache; the faster of each is the disk's speed."""
    from rlplane.durable import StreamedFile

    buf = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    out = {}
    for how in ("buffered", "direct"):
        t0 = time.monotonic()
        with (open(path, "wb") if how == "buffered" else StreamedFile(path)) as f:
            left = nbytes
            while left > 0:
                f.write(memoryview(buf)[: min(left, CHUNK)])
                left -= CHUNK
            if how == "buffered":
                f.flush()
                os.fsync(f.fileno())
        write = nbytes / (time.monotonic() - t0) / 1e9
        if how == "direct" and not f.direct:
            how = "direct (refused here: buffered)"
        _drop_cache(path)
        t0 = time.monotonic()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        out[how] = (write, nbytes / (time.monotonic() - t0) / 1e9)
        path.unlink()
    return out


def _drop_cache(path: Path) -> None:
    """Drop ``path``'s pages (a file, or every file of a directory) from the page cache."""
    for p in ([path] if path.is_file() else sorted(path.iterdir())):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _puts_from_another_process(info: dict, seconds: float, done: threading.Event | None,
                               started: threading.Event | None = None) -> dict:
    """p99 of text-step B=8 puts made by a child process for ``seconds`` (or from its
    first put, which sets ``started``, until ``done``)."""
    ctx = mp.get_context("spawn")
    stop, going = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    proc = ctx.Process(target=_putter, args=(dict(info), seconds, stop, going, out), daemon=True)
    proc.start()
    try:
        if done is not None:
            going.wait(120)
            if started is not None:
                started.set()
            done.wait(seconds)
            stop.set()
        got = out.get(timeout=seconds + 120)
    finally:
        stop.set()
        proc.join(timeout=30)
    lat = np.asarray(got, float)
    return {"n": int(lat.size), "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan")}


def _putter(info: dict, seconds: float, stop: Any, going: Any, out: Any) -> None:
    from rlplane import Client, default_registry
    from rlplane.testing.workloads import text_step
    from rlplane.transports.native import NativeTransport

    batch = text_step(8, 128, seed=1)
    lat = []
    with Client(default_registry().without_sharing(), NativeTransport(info, timeout=60, data_path="shm")) as c:
        end = time.monotonic() + seconds
        k = 0
        while time.monotonic() < end and not stop.is_set() and k < 100_000:
            t0 = time.perf_counter()
            c.put_samples(f"small-{k % 4}", batch.fields)
            lat.append((time.perf_counter() - t0) * 1e3)
            going.set()
            k += 1
            if k % 64 == 0:
                c.clear(f"small-{k % 4}")
    out.put(lat)


__all__ = ["DurabilityBenchConfig", "run_durability_bench"]
