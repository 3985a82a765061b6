"""``rlplane soak``: many writers and readers against one store for minutes, a storage
unit, the Serve replica and the controller killed midway, and every byte checked.

Writers put text-step batches (B samples, ids ``w{i}-{seq}-{k}``, each batch generated
from its (writer, seq) seed, so anyone can regenerate what a sample must hold) into
partition ``soak-<run>-w{i}`` (``<run>`` drawn per run, the partitions cleared at its end,
an interrupted one's too); a put that returns is *acknowledged*. Readers claim from every
writer's partition (each reader its own task, so every sample is read once per reader),
read every field, compare it bit for bit with the regenerated batch (the row checksums
are checked on the way too), and ack. Midway the driver kills storage unit 1, the Serve
replica and the controller's process (SIGKILL: Ray restarts it, and it rebuilds its index
from the units; the store runs with ``replicas=2``, so the unit takes no sample with it).
At the end the driver reads back every acknowledged sample.

Violations (exit 1): a wrong byte, an acknowledged sample that is gone, an error that is
not one of rlplane's typed errors, a run in which no put or no read succeeded (nothing was
tested: a full store, a read-only token). Typed errors (a put failing while the unit dies)
are counted by type and are not violations.

Example::

    report = run_soak(SoakConfig(minutes=0.5, writers=4, readers=2), console)
    assert not report["violations"]
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
from rich.console import Console
from rich.table import Table

#: The read-back at the end reads this many puts' samples per read_columns.
READ_BACK_PUTS = 32
FIELDS = ["input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs", "advantages"]


@dataclass
class SoakConfig:
    minutes: float = 10.0
    writers: int = 8
    readers: int = 4
    batch: int = 8
    seqlen: int = 256
    kill: bool = True  # kill storage unit 1, the Serve replica and the controller at half time (embedded only)
    replicas: int = 2  # (of the embedded service; a service at --url keeps its own)
    storage_units: int = 3
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # in the partitions' names: runs never meet

    def partition(self, writer: int) -> str:
        return f"soak-{self.run}-w{writer}"


def soak_batch(writer: int, seq: int, cfg: SoakConfig) -> Any:
    """The batch writer ``writer`` puts as its ``seq``-th (deterministic)."""
    from rlplane.testing.workloads import text_step

    return text_step(batch=cfg.batch, seqlen=cfg.seqlen, seed=writer * 1_000_003 + seq)


def _ids(writer: int, seq: int, cfg: SoakConfig) -> list[str]:
    return [f"w{writer}-{seq}-{k}" for k in range(cfg.batch)]


def _writer(url: str, token: str | None, cfg_dict: dict, i: int, go: Any, start: Any, conn: Any) -> None:
    import rlplane
    from rlplane.errors import RlplaneError

    cfg = SoakConfig(**cfg_dict)
    report: dict[str, Any] = {"role": "writer", "i": i, "acked": [], "ms": [], "errors": {}, "untyped": []}
    errors: Counter[str] = Counter()
    with rlplane.connect(url, token=token, transport="direct") as c:
        conn.send_bytes(b"ready")
        go.wait(300)
        end = start.value + cfg.minutes * 60
        seq = 0
        while time.perf_counter() < end:
            work = soak_batch(i, seq, cfg)
            t0 = time.perf_counter()
            try:
                c.put_samples(cfg.partition(i), work.fields, sample_ids=_ids(i, seq, cfg))
                report["ms"].append((time.perf_counter() - t0) * 1e3)
                report["acked"].append(seq)
            except RlplaneError as err:
                errors[type(err).__name__] += 1
                time.sleep(0.2)
            except Exception:  # noqa: BLE001 - an untyped error is what the soak exists to find
                report["untyped"].append(traceback.format_exc(limit=3)[-600:])
            seq += 1
    report["errors"] = dict(errors)
    conn.send_bytes(msgpack.packb(report, use_bin_type=True))


def _reader(url: str, token: str | None, cfg_dict: dict, j: int, go: Any, start: Any, conn: Any) -> None:
    import rlplane
    from rlplane.errors import IntegrityError, NotReadyError, RlplaneError

    cfg = SoakConfig(**cfg_dict)
    report: dict[str, Any] = {"role": "reader", "j": j, "samples": 0, "ms": [], "errors": {}, "untyped": [], "wrong": []}
    errors: Counter[str] = Counter()
    with rlplane.connect(url, token=token, transport="direct") as c:
        conn.send_bytes(b"ready")
        go.wait(300)
        end = start.value + cfg.minutes * 60 + 5  # the last writes get read too
        w = j % cfg.writers
        while time.perf_counter() < end:
            w = (w + 1) % cfg.writers
            try:
                meta = c.claim(cfg.partition(w), f"reader-{j}", batch_size=4 * cfg.batch, fields=FIELDS, timeout=0.5)
            except NotReadyError:
                continue
            except RlplaneError as err:
                errors[type(err).__name__] += 1
                time.sleep(0.2)
                continue
            except Exception:  # noqa: BLE001
                report["untyped"].append(traceback.format_exc(limit=3)[-600:])
                continue
            t0 = time.perf_counter()
            try:
                got = c.read_columns(meta, FIELDS, pad_to_seqlen=cfg.seqlen)
                report["ms"].append((time.perf_counter() - t0) * 1e3)
                report["wrong"] += check_rows(c.registry, meta.sample_ids, got, cfg)
                report["samples"] += len(meta)
                c.ack(meta, f"reader-{j}")
            except IntegrityError as err:
                report["wrong"].append(str(err))
            except RlplaneError as err:
                errors[type(err).__name__] += 1
                try:
                    c.nack(meta, f"reader-{j}")
                except RlplaneError:
                    pass
            except Exception:  # noqa: BLE001
                report["untyped"].append(traceback.format_exc(limit=3)[-600:])
    report["errors"] = dict(errors)
    conn.send_bytes(msgpack.packb(report, use_bin_type=True))


def check_rows(registry: Any, ids: list[str], got: dict[str, Any], cfg: SoakConfig,
               batches: dict[tuple[int, int], Any] | None = None) -> list[str]:
    """Every row of ``got`` against the batch its id says it came from (lines naming the
    differences); ``batches``: (writer, seq) -> batch already generated."""
    import torch

    from rlplane.testing.verify import diff_fields

    batches = {} if batches is None else batches
    want: dict[str, list[Any]] = {f: [] for f in FIELDS}
    lengths = []
    for sid in ids:
        w, seq, k = (int(x) for x in sid[1:].split("-"))
        work = batches.get((w, seq)) or batches.setdefault((w, seq), soak_batch(w, seq, cfg))
        for f in FIELDS:
            want[f].append(work.fields[f][k])
        lengths.append(int(work.lengths[k]))
    written = {f: torch.stack(rows) for f, rows in want.items()}
    return diff_fields(registry, written, got, torch.tensor(lengths), sample_ids=ids)


@dataclass
class Outcome:
    """What the driver saw and decided (see :func:`run_soak`)."""

    reports: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)  # the storage units' peak RSS (embedded service)


def run_soak(cfg: SoakConfig, console: Console, *, url: str | None = None, token: str | None = None) -> dict[str, Any]:
    """Run the soak (against ``url``, or an embedded service it starts and stops); print
    the report; return it (``violations`` empty when every byte and write survived)."""
    from rlplane_tools.bench.procs import run_together

    service = None
    if url is None:
        from rlplane_service.embedded import EmbeddedService, free_port
        from rlplane_service.quiet import stages
        from rlplane_service.settings import ServiceSettings

        with stages(console, "starting the embedded service") as say:
            settings = ServiceSettings(port=free_port(), replicas=cfg.replicas, storage_units=cfg.storage_units)
            service = EmbeddedService(settings, say=say)
            service.start()
        url, token = service.url, service.settings.token()
    out = Outcome()
    started = time.time()
    cancel, threads = threading.Event(), []  # (set on the way out: an interrupted run's workers stop first)
    memory = UnitMemory(service) if service is not None else None
    try:
        runs: list[list[dict[str, Any]]] = [[], []]
        failures: list[BaseException] = []
        args = (url, token, asdict(cfg))
        finish = cfg.minutes * 60 + 300

        writing = threading.Event()

        def run(k: int, target: Any, n: int) -> None:
            try:
                runs[k] = run_together(target, args, n, finish_s=finish, indexed=True,
                                       on_start=writing.set if k == 0 else None, cancel=cancel)
            except BaseException as err:  # noqa: BLE001 - reported by the driver
                failures.append(err)
            finally:
                writing.set()

        threads = [threading.Thread(target=run, args=(0, _writer, cfg.writers), daemon=True),
                   threading.Thread(target=run, args=(1, _reader, cfg.readers), daemon=True)]
        for t in threads:
            t.start()
        console.print(f"[bold]soak[/]: {cfg.writers} writers x {cfg.readers} readers for {cfg.minutes:g} min "
                      f"(B={cfg.batch}, S={cfg.seqlen}) against {url}")
        if cfg.kill and service is not None and writing.wait(300) and not failures:
            time.sleep(cfg.minutes * 30)  # half time of the writers' window
            out.events += _kill_unit_and_replica(service)
            for e in out.events:
                console.print(f"  [yellow]{e}[/]")
        deadline = time.monotonic() + finish + 120
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()))
        if failures:
            raise failures[0]
        out.reports = runs[0] + runs[1]
        with console.status("reading back every acknowledged sample"):
            out.final = _read_back(url, token, cfg, runs[0])
        if memory is not None:
            out.memory = memory.report()
    finally:
        cancel.set()
        for t in threads:
            if t.ident is not None:  # (one interrupted before it started is not joined)
                t.join(10)
        from rlplane_tools.demo import clear_partitions

        clear_partitions(url, token, [cfg.partition(i) for i in range(cfg.writers)], console)
        if service is not None:
            service.stop()
    report = _summary(cfg, out, time.time() - started, embedded=service is not None)
    print_soak(report, console)
    return report


#: Target of the slab issue: a unit's resident memory stays within its slab plus this.
UNIT_RSS_OVER_SLAB_MB = 150


class UnitMemory:
    """Samples the resident memory of the embedded service's storage units (same host,
    /proc) every ``every_s`` while the soak runs; ``report()`` has each unit's peak."""

    def __init__(self, service: Any, every_s: float = 2.0) -> None:
        import ray

        s = service.settings
        self.slab_mb = s.unit_bytes / 2**20
        self.pids: dict[str, int] = {}
        for i in range(s.storage_units):
            name = f"{s.store_name}-native-unit-{i}"
            try:
                self.pids[name] = int(ray.get(ray.get_actor(name, namespace=s.namespace).info.remote(), timeout=30)["pid"])
            except Exception:  # noqa: BLE001 - a unit we cannot see is left out of the report, not the soak
                continue
        self.peak: dict[str, float] = {}
        self.start = {name: mb for name, pid in self.pids.items() if (mb := rss_mb(pid)) is not None}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), name="soak-unit-rss", daemon=True)
        self._thread.start()

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for name, pid in self.pids.items():
                mb = rss_mb(pid)
                if mb is not None:
                    self.peak[name] = max(self.peak.get(name, 0.0), mb)

    def report(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=10)
        limit = self.slab_mb + UNIT_RSS_OVER_SLAB_MB
        return {"slab_mb": self.slab_mb, "limit_mb": limit, "unit_rss_start_mb": dict(sorted(self.start.items())),
                "unit_rss_peak_mb": dict(sorted(self.peak.items())),
                "met": bool(self.peak) and max(self.peak.values()) <= limit}


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (its slab's touched pages included), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _kill_unit_and_replica(service: Any) -> list[str]:
    import ray

    store = service.settings.store_name
    events = []
    unit = ray.get_actor(f"{store}-native-unit-1", namespace=service.settings.namespace)
    ray.kill(unit, no_restart=True)
    events.append(f"{time.strftime('%H:%M:%S')} killed storage unit {store}-native-unit-1")
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::rlplane#")]
    for a in replicas[:1]:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=False)
        events.append(f"{time.strftime('%H:%M:%S')} killed the Serve replica {a['name'].split('#')[-1]} (Serve starts another)")
    controller = ray.get_actor(f"{store}-native-controller", namespace=service.settings.namespace)
    pid = int(ray.get(controller.info.remote(), timeout=60)["pid"])
    os.kill(pid, signal.SIGKILL)  # Ray restarts it; it rebuilds its index from the units' commit log
    events.append(f"{time.strftime('%H:%M:%S')} SIGKILLed the controller (pid {pid}; Ray restarts it)")
    return events


def _read_back(url: str, token: str | None, cfg: SoakConfig, writers: list[dict[str, Any]]) -> dict[str, Any]:
    """Every acknowledged sample, read and compared: (checked, lost ids, wrong lines)."""
    import rlplane
    from rlplane.errors import IntegrityError, MissingDataError
    from rlplane.meta import SampleMeta

    checked, lost, wrong = 0, [], []
    with rlplane.connect(url, token=token, transport="direct") as c:
        for rep in writers:
            i = rep["i"]
            for k in range(0, len(rep["acked"]), READ_BACK_PUTS):
                batches = {(i, seq): soak_batch(i, seq, cfg) for seq in rep["acked"][k:k + READ_BACK_PUTS]}
                meta = SampleMeta(cfg.partition(i), [s for (_, seq) in batches for s in _ids(i, seq, cfg)],
                                  [n for work in batches.values() for n in work.lengths.tolist()], set(FIELDS))
                try:
                    got = c.read_columns(meta, FIELDS, pad_to_seqlen=cfg.seqlen)
                except MissingDataError as err:
                    lost += list(err.missing) or meta.sample_ids
                    continue
                except IntegrityError as err:
                    wrong.append(str(err))
                    continue
                wrong += check_rows(c.registry, meta.sample_ids, got, cfg, batches)
                checked += len(meta)
    return {"checked": checked, "lost": lost, "wrong": wrong}



def _pcts(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"p50_ms": statistics.median(ms), "p99_ms": q[98]}


def _summary(cfg: SoakConfig, out: Outcome, wall_s: float, embedded: bool = True) -> dict[str, Any]:
    writers = [r for r in out.reports if r["role"] == "writer"]
    readers = [r for r in out.reports if r["role"] == "reader"]
    seconds = cfg.minutes * 60
    puts = [m for r in writers for m in r["ms"]]
    reads = [m for r in readers for m in r["ms"]]
    errors: Counter[str] = Counter()
    for r in out.reports:
        errors.update(r["errors"])
    untyped = [u for r in out.reports for u in r["untyped"]]
    wrong = [w for r in readers for w in r["wrong"]] + out.final.get("wrong", [])
    lost = out.final.get("lost", [])
    idle = [f"no {what} succeeded ({', '.join(f'{k} x{n}' for k, n in errors.most_common(3)) or 'no errors'}): "
            "nothing was tested" for what, done in (("put", puts), ("claim+read+ack", reads)) if not done]
    violations = ([f"{len(wrong)} wrong rows: {wrong[:3]}"] if wrong else []) + \
        ([f"{len(lost)} acknowledged samples lost: {lost[:5]}"] if lost else []) + \
        ([f"{len(untyped)} untyped errors: {untyped[:2]}"] if untyped else []) + idle
    return {
        "config": {**asdict(cfg), "replicas": cfg.replicas if embedded else None}, "wall_s": wall_s,
        "events": out.events,
        "ops": {
            "put_samples": {"count": len(puts), "per_s": len(puts) / seconds, "samples": len(puts) * cfg.batch, **_pcts(puts)},
            "claim+read+ack": {"count": len(reads), "per_s": len(reads) / seconds,
                               "samples": sum(r["samples"] for r in readers), **_pcts(reads)},
        },
        "errors": dict(errors), "read_back": {k: (v if k == "checked" else len(v)) for k, v in out.final.items()},
        "violations": violations, "memory": out.memory,
    }


def print_soak(report: dict[str, Any], console: Console) -> None:
    cfg = report["config"]
    t = Table(title=f"soak: {cfg['writers']} writers x {cfg['readers']} readers, {cfg['minutes']:g} min, "
                    f"B={cfg['batch']} S={cfg['seqlen']}"
                    + (f", replicas={cfg['replicas']}" if cfg.get("replicas") else ", the service's replicas"))
    for col in ("op", "count", "per s", "samples", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op, d in report["ops"].items():
        t.add_row(op, str(d["count"]), f"{d['per_s']:.1f}", str(d["samples"]), f"{d['p50_ms']:.1f}", f"{d['p99_ms']:.1f}")
    console.print(t)
    console.print("typed errors: " + (", ".join(f"{k} {v}" for k, v in sorted(report["errors"].items())) or "none"))
    rb = report["read_back"]
    mem = report.get("memory") or {}
    if mem.get("unit_rss_peak_mb"):
        start = mem.get("unit_rss_start_mb", {})
        peaks = ", ".join(f"{n.rsplit('-', 1)[-1]} {mb:.0f} (at start {start.get(n, 0):.0f})"
                          for n, mb in mem["unit_rss_peak_mb"].items())
        console.print(f"storage units' peak RSS (MiB, unit {peaks}) against slab {mem['slab_mb']:.0f} + "
                      f"{UNIT_RSS_OVER_SLAB_MB} = {mem['limit_mb']:.0f}: " + ("met" if mem["met"] else "[red]missed[/]"))
    console.print(f"read back at the end: {rb.get('checked', 0)} acknowledged samples bit for bit, "
                  f"{rb.get('lost', 0)} lost, {rb.get('wrong', 0)} wrong")
    if report["violations"]:
        for v in report["violations"]:
            console.print(f"[red]VIOLATION[/] {v}")
    else:
        console.print("[green]OK[/]: zero wrong bytes, zero lost acknowledged writes, every error typed")


__all__ = ["SoakConfig", "check_rows", "print_soak", "run_soak", "soak_batch"]
