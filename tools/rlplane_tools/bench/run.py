"""``rlplane bench``: the same batch, writer process -> reader process, through every path.

One invocation starts what it needs (the embedded service on a free loopback port
unless a URL is given; a local Ray for the worker actors when the service's is not in
this process), then per workload and path: one warm-up move checked bit for bit, then
``reps`` timed moves (put in the writer, get in the reader). It adds the per-operation
latency of a small batch, a batch-size sweep, a concurrent-writers sweep (every sample
read back and checked after), memcpy of the same bytes as the bound, and the targets.

Example::

    results = run_bench(BenchConfig(quick=True), console)
    print(results["targets"])
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rlplane.errors import RlplaneError

from rlplane_tools.bench.base import median_parts, percentiles
from rlplane_tools.bench.paths import PATHS, REFERENCE, WorkerEnv
from rlplane_tools.bench.report import machine_facts, print_report
from rlplane_tools.bench.targets import evaluate
from rlplane_tools.bench.workers import Share, start_workers
from rlplane_tools.timing import Phase, memcpy_phases

THROUGHPUT_WORKLOADS = ("vlm-step", "text-step")
#: vlm-grpo: the vlm-step batch as 8 groups of 8 sharing each group's images. The native engine
#: stores each group's images once; raw TransferQueue, DataProto and the Ray object store store
#: every copy. Only these rows: the others store every copy too and add nothing the vlm-step
#: section does not show.
GRPO_WORKLOAD = "vlm-grpo"
GRPO_PATHS = ("rlplane-native", "rlplane-native-apart", "raw-tq", "mooncake-dataproto", "ray-object-store")
#: Paths only the vlm-grpo section runs (the batch written one put per sample).
GRPO_ONLY = ("rlplane-native-apart",)
#: vlm-grpo-same: the same batch whose members hold their group's very image tensors (what a
#: rollout that repeats a prompt's processed images hands over): no bytes to compare.
GRPO_SAME_WORKLOAD = "vlm-grpo-same"
GRPO_SAME_PATHS = ("rlplane-native", "raw-tq")
LATENCY_WORKLOAD = "small"
SWEEP_WORKLOAD = "vlm-step"
#: The HTTP proxy moves ~0.1-0.2 GB/s (DESIGN.md): at B=256 it alone would take minutes. Mooncake
#: DataProto's writer holds its batch three times (as given, converted, in its segment): at B=256
#: (~700 MB stored) that and the other rows ran a 24 GiB host out of memory.
#: The native engine's zmq row and rlplane on Mooncake sit out too: each rlplane path's client
#: keeps its encode buffers (~700 MB at B=256), the units' slabs are pre-faulted, and with
#: them the sweep ran the 24 GiB host out of memory.
SWEEP_PATHS = tuple(p for p in PATHS if p not in ("rlplane-http", "mooncake-dataproto", "rlplane-native-zmq",
                                                   "rlplane-native-te", "rlplane-mooncake"))
#: The row that needs the units' slabs on the transfer engine (the embedded service runs it over TCP).
TE_PATH = "rlplane-native-te"
WRITERS_PATH = "rlplane-native"
#: text-scale: the text fields at S=1024 over growing B, through these paths (cost per sample).
SCALE_WORKLOAD = "text-scale"
SCALE_PATHS = ("rlplane-native", "rlplane-native-te", "rlplane-native-zmq", "rlplane-tq", "raw-tq", "mooncake-dataproto",
               "ray-object-store")
#: A data-parallel rank's read: every other sample of the vlm-step batch, two fields,
#: through every path that can select rows.
DP_SHARD_SECTION = "dp-shard"
DP_SHARD_FIELDS = ["input_ids", "pixel_values"]
DP_SHARD_PATH = "mooncake-dataproto"
#: The streaming section (claim latency, wake-up, N claimers), against the service itself.
CLAIM_SECTION = "claim"
#: How many small ops (B=1 puts, claim+ack, one-sample reads) one store index serves.
CONTROLLER_SECTION = "controller"


class BenchError(RlplaneError):
    """A path moved something other than what was written, or the bench could not run."""


class PeerMismatch(BenchError):
    """A peer (not rlplane) returned something other than what was written: its row is
    left out of that section and the report says why; the run goes on."""


@dataclass
class BenchConfig:
    """What one ``rlplane bench`` run measures. ``quick`` shrinks batches, reps and ops
    (every path, workload and sweep still runs); explicit values win over it."""

    workloads: tuple[str, ...] = (*THROUGHPUT_WORKLOADS, GRPO_WORKLOAD, GRPO_SAME_WORKLOAD, LATENCY_WORKLOAD, SCALE_WORKLOAD, DP_SHARD_SECTION,
                                  CLAIM_SECTION, CONTROLLER_SECTION)
    paths: tuple[str, ...] = tuple(PATHS)
    batch: int | None = None
    seqlen: int | None = None
    reps: int = 5
    ops: int = 200
    sweep_batches: tuple[int, ...] = (16, 64, 256)
    scale_batches: tuple[int, ...] = (64, 256, 1024, 4096, 8192)
    writers: tuple[int, ...] = (1, 2, 4)
    seed: int = 0
    quick: bool = False


QUICK = {"batch": 8, "seqlen": 512, "reps": 3, "ops": 50, "sweep_batches": (4, 8, 16), "scale_batches": (16, 64)}


def quick_config(cfg: BenchConfig, given: set[str]) -> BenchConfig:
    """``cfg`` with the quick values for every option the user did not give."""
    return replace(cfg, quick=True, **{k: v for k, v in QUICK.items() if k not in given})


@dataclass
class _Pool:
    reader: Any
    writers: list[Any]

    def prepare(self, actors: list[Any], shares: list[Share]) -> list[int]:
        import ray

        return ray.get([a.prepare.remote(asdict(s)) for a, s in zip(actors, shares)])


#: The apps the embedded bench deploys next to the default (native) one, for the rows that need them.
MOONCAKE_APP = {"name": "rlplane-bench-mooncake", "route_prefix": "/bench-mooncake",
                "args": {"store_name": "bench-mooncake", "backend": "mooncake", "mooncake_segment_bytes": 3 << 30}}
TQ_APP = {"name": "rlplane-bench-tq", "route_prefix": "/bench-tq", "args": {"store_name": "bench-tq", "backend": "simple"}}
TQ_ROWS = ("rlplane-tq", "raw-tq")


def run_bench(
    cfg: BenchConfig,
    console: Console,
    *,
    url: str | None = None,
    token: str | None = None,
    mooncake_url: str | None = None,
    tq_url: str | None = None,
) -> dict:
    """Run every measurement in ``cfg``; print the report; return machine-readable results.

    Embedded (no ``url``), the bench also deploys a Mooncake-backed app for the
    ``rlplane-mooncake`` row; against a running service that row needs ``mooncake_url``
    and is left out without it."""
    from rlplane_service.embedded import EmbeddedService, free_port
    from rlplane_service.settings import ServiceSettings

    unknown = [p for p in cfg.paths if p not in PATHS]
    if unknown:
        raise BenchError(f"unknown path(s) {unknown}; known: {list(PATHS)}")
    started = time.time()
    service = None
    own_ray = False
    dataproto = None
    if url is None:
        from rlplane_service.quiet import stages

        with stages(console, "starting the embedded service") as say:
            # 1 GiB slabs (pre-faulted): the B=256 sweep puts ~700 MB in one local block; bigger
            # slabs, with the peers' own memory, ran the 24 GiB host out of memory. --quick on its own
            # small batches: 256 MiB, faulted in before the timing starts in a fraction of the time.
            small = cfg.quick and (cfg.batch or 0) <= 16 and max(cfg.sweep_batches, default=0) <= 16
            unit_bytes = 256 << 20 if small else 1 << 30
            service = EmbeddedService(ServiceSettings(port=free_port(), unit_bytes=unit_bytes, te_protocol="tcp"),
                                      say=say)
            service.start()
        url, token = service.url, service.settings.token()
    try:
        if service is not None and "rlplane-mooncake" in cfg.paths:
            mooncake_url = _deploy(service, console, MOONCAKE_APP, "a Mooncake-backed rlplane (its own mooncake_master, TCP)")
        if service is not None and any(p in cfg.paths for p in TQ_ROWS):
            tq_url = _deploy(service, console, TQ_APP, "a TransferQueue-backed rlplane (backend simple)")
        if tq_url is None and any(p in cfg.paths for p in TQ_ROWS):
            tq_url = url if _publishes(url, token, "tq") else None
        if tq_url is None and any(p in cfg.paths for p in TQ_ROWS):
            console.print("[yellow]no --tq-url: the rlplane-tq and raw-tq rows are left out[/]")
            cfg = replace(cfg, paths=tuple(p for p in cfg.paths if p not in TQ_ROWS))
        if TE_PATH in cfg.paths and not _runs_transfer_engine(url, token):
            console.print("[yellow]the service's storage units run no transfer engine (RLPLANE_TE_PROTOCOL): the "
                          f"{TE_PATH} row is left out[/]")
            cfg = replace(cfg, paths=tuple(p for p in cfg.paths if p != TE_PATH))
        if mooncake_url is None and "rlplane-mooncake" in cfg.paths:
            console.print("[yellow]no --mooncake-url: the rlplane-mooncake row is left out[/]")
            cfg = replace(cfg, paths=tuple(p for p in cfg.paths if p != "rlplane-mooncake"))
        if DP_SHARD_PATH in cfg.paths:
            from rlplane_tools.bench.dataproto import start_master

            with console.status("starting a mooncake_master for the Mooncake DataProto row"):
                dataproto = start_master()
        own_ray = _ensure_ray(console)
        results = _measure(cfg, console, url, token, mooncake_url, tq_url, dataproto and dataproto.info())
    finally:
        if dataproto is not None:
            dataproto.stop()
        if own_ray:
            import ray

            ray.shutdown()
        if service is not None:
            console.print("[dim]stopping the embedded service[/]")
            if mooncake_url is not None and "rlplane-mooncake" in cfg.paths:
                from rlplane_service.backends import store_class

                store_class("mooncake").stop_processes(ServiceSettings(**MOONCAKE_APP["args"]))
            service.stop()
    results.update(
        config=asdict(cfg),
        url=url,
        embedded=service is not None,
        date=time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
        wall_s=time.time() - started,
        machine=machine_facts(),
    )
    results["targets"] = evaluate(results)
    print_report(results, console)
    return results


def _deploy(service: Any, console: Console, app: dict, what: str) -> str:
    """Deploy ``app`` in the embedded service's cluster (same token); return its URL."""
    from ray import serve

    from rlplane_service.app import build_app

    args = dict(app["args"], api_token=service.settings.token())
    with console.status(f"deploying {what}"):
        serve.run(build_app(args), name=app["name"], route_prefix=app["route_prefix"])
    return service.url + app["route_prefix"]


def _publishes(url: str, token: str | None, key: str) -> bool:
    from rlplane.http_api import ServiceAPI

    api = ServiceAPI(url, token=token)
    try:
        return bool(api.json("GET", "/v1/transport").get(key))
    finally:
        api.close()


def _slabs_ready(url: str, token: str | None) -> None:
    """Wait until the native service's units have pre-faulted their slabs (none to wait
    for on a service of another backend)."""
    import rlplane
    from rlplane.errors import RlplaneError
    from rlplane_tools.bench.durability import populated

    try:
        with rlplane.connect(url, token=token, transport="native", timeout=30) as client:
            populated(client.transport)
    except RlplaneError:
        return


def _runs_transfer_engine(url: str, token: str | None) -> bool:
    import rlplane
    from rlplane.errors import RlplaneError

    try:
        with rlplane.connect(url, token=token, transport="native", data_path="te", timeout=30):
            return True
    except RlplaneError:
        return False


def _measure(cfg: BenchConfig, console: Console, url: str, token: str | None, mooncake_url: str | None,
             tq_url: str | None, dataproto_master: dict | None) -> dict:
    import ray
    from rlplane.http_api import ServiceAPI

    api = ServiceAPI(url, token=token)
    try:
        registry = api.json("GET", "/v1/registry")
    finally:
        api.close()
    tq_info = None
    if tq_url is not None:
        api = ServiceAPI(tq_url, token=token)
        try:
            tq_info = api.json("GET", "/v1/transport").get("tq")
        finally:
            api.close()
    env = WorkerEnv(url, token, registry, tq_info, mooncake_url, tq_url, dataproto_master)
    n_writers = max(cfg.writers, default=1)
    with console.status(f"starting {n_writers + 1} worker processes"):
        actors = start_workers(env, n_writers + 1)
        pool = _Pool(actors[0], actors[1:])
        ray.get(pool.reader.open.remote(list(cfg.paths)))
        ray.get(pool.writers[0].open.remote(list(cfg.paths)))
        ray.get([w.open.remote([WRITERS_PATH]) for w in pool.writers[1:]])
    with console.status("waiting for the storage units to pre-fault their slabs"):
        _slabs_ready(url, token)  # (a unit faults its slab in the background at start: not during a timed op)
    out: dict[str, Any] = {"workloads": [], "latency": None, "dp_shard": None,
                           "sweeps": {"batch": [], "writers": [], "scale": []}}
    try:
        with Progress(console=console, transient=True) as progress:
            for name in cfg.workloads:
                if name in THROUGHPUT_WORKLOADS:
                    share = _share(cfg, name, cfg.batch)
                    out["workloads"].append(_throughput(cfg, pool, share, _batch_paths(cfg), progress))
            for name, allowed in ((GRPO_WORKLOAD, GRPO_PATHS), (GRPO_SAME_WORKLOAD, GRPO_SAME_PATHS)):
                if name in cfg.workloads:
                    paths = tuple(p for p in cfg.paths if p in allowed)
                    out["workloads"].append(_throughput(cfg, pool, _share(cfg, name, cfg.batch), paths, progress,
                                                        stored=True))
            if LATENCY_WORKLOAD in cfg.workloads:
                out["latency"] = _latency(cfg, pool, progress)
            if DP_SHARD_SECTION in cfg.workloads:
                out["dp_shard"] = _dp_shard(cfg, pool, progress)
            if cfg.sweep_batches and SWEEP_WORKLOAD in cfg.workloads:
                paths = tuple(p for p in cfg.paths if p in SWEEP_PATHS)
                for b in cfg.sweep_batches:
                    out["sweeps"]["batch"].append(_throughput(cfg, pool, _share(cfg, SWEEP_WORKLOAD, b), paths, progress))
            if cfg.scale_batches and SCALE_WORKLOAD in cfg.workloads:
                paths = tuple(p for p in cfg.paths if p in SCALE_PATHS)
                for b in cfg.scale_batches:
                    out["sweeps"]["scale"].append(_throughput(cfg, pool, _share(cfg, SCALE_WORKLOAD, b, 1024), paths, progress))
            if cfg.writers and WRITERS_PATH in cfg.paths and SWEEP_WORKLOAD in cfg.workloads:
                for n in cfg.writers:
                    out["sweeps"]["writers"].append(_writers(cfg, pool, n, progress))
            if CLAIM_SECTION in cfg.workloads:
                from rlplane_tools.bench.claim import ClaimBenchConfig, run_claim_bench

                claim_cfg = ClaimBenchConfig(batch=cfg.batch or 64, seqlen=cfg.seqlen or (512 if cfg.quick else 4096),
                                             ops=min(cfg.ops, 100), wakeups=min(cfg.ops, 10 if cfg.quick else 30),
                                             drain_batches=8 if cfg.quick else 32,
                                             stream_rounds=100 if cfg.quick else 1500)
                out["claim"] = run_claim_bench(url, token, claim_cfg, progress)
        if CONTROLLER_SECTION in cfg.workloads:  # its own status lines: outside the progress display
            from rlplane_tools.bench.controller import ControllerBenchConfig, run_controller_bench

            ctl = ControllerBenchConfig(processes=2, seconds=1.0) if cfg.quick else ControllerBenchConfig()
            out["controller"] = run_controller_bench(url, token, ctl, console)
    finally:
        ray.get([a.close.remote() for a in actors])
        for a in actors:
            ray.kill(a)
    return out


def _share(cfg: BenchConfig, workload: str, batch: int | None, seqlen: int | None = None) -> Share:
    import inspect

    from rlplane.testing.workloads import WORKLOADS

    defaults = inspect.signature(WORKLOADS[workload]).parameters
    return Share(workload, batch or defaults["batch"].default, seqlen or cfg.seqlen or defaults["seqlen"].default, cfg.seed)


def _move(pool: _Pool, path: str, key: str, verify: bool, writer: Any = None, rows: list[int] | None = None,
          fields: list[str] | None = None, stored: dict[str, int] | None = None) -> _Moved:
    """One writer -> reader move through ``path`` (the reader reads ``fields`` of ``rows``
    when given): put s, get s, and where each one's time went (where the path can tell).
    Raises on any difference. With ``stored``, the bytes the put added to its store are
    recorded there under ``path`` (where the path can tell)."""
    import ray

    writer = writer or pool.writers[0]
    peer = pool.reader if PATHS[path].needs_peer else None
    sent = ray.get(writer.write.remote(path, key, peer, stored is not None))
    if stored is not None and sent["stored"] is not None:
        stored[path] = sent["stored"]
    got = ray.get(pool.reader.read.remote(path, sent["handle"], verify, rows, fields))
    ray.get(writer.clear.remote(path, key))
    if got["problems"]:
        error = BenchError if path.startswith("rlplane-") else PeerMismatch
        raise error(f"{path}: what the reader got is not what the writer wrote: " + "; ".join(got["problems"]))
    return _Moved(sent["end"] - sent["start"], got["end"] - got["start"], sent["parts"], got["parts"])


@dataclass
class _Moved:
    """One move's put and get seconds, and their parts (BenchPath.parts; None: not told)."""

    put: float
    get: float
    put_parts: dict[str, float] | None
    get_parts: dict[str, float] | None


def _throughput(cfg: BenchConfig, pool: _Pool, share: Share, paths: tuple[str, ...], progress: Progress,
                stored: bool = False) -> dict:
    """A warm-up move through every path, then ``reps`` rounds of one timed move per path,
    every move checked bit for bit after its timing (a peer that dropped a field in a
    timed round would look faster). Rounds, not one path after the other: whichever path ran first used to
    pay for the machine settling (its reads were 2-3x slower, whichever path it was).
    With ``stored``, the warm-up also records what each put added to its store (the
    paths that can tell) and the batch's unique bytes (every repeated row once)."""
    task = progress.add_task(f"{share.workload} B={share.batch}: preparing", total=len(paths) * (cfg.reps + 1))
    nbytes = pool.prepare([pool.writers[0], pool.reader], [share, share])[0]
    puts = {path: Phase("put", share.batch, nbytes) for path in paths}
    gets = {path: Phase("get", share.batch, nbytes) for path in paths}
    parts: dict[tuple[str, str], list[dict[str, float] | None]] = {(p, op): [] for p in paths for op in ("put", "get")}
    wrong: dict[str, str] = {}
    held: dict[str, int] | None = {} if stored else None
    for rep in range(cfg.reps + 1):
        progress.update(task, description=f"{share.workload} B={share.batch}: {'warm-up' if rep == 0 else f'round {rep}'}")
        for path in [p for p in _turn(paths, rep) if p not in wrong]:
            moved = _checked_move(pool, path, _key(path, rep), True, wrong, stored=held if rep == 0 else None)
            if moved and rep:
                puts[path].seconds.append(moved.put)
                gets[path].seconds.append(moved.get)
                parts[path, "put"].append(moved.put_parts)
                parts[path, "get"].append(moved.get_parts)
            progress.advance(task)
    paths = tuple(p for p in paths if p not in wrong)
    rows = []
    for path in paths:
        put, get = puts[path], gets[path]
        trip = Phase("round trip", share.batch, nbytes, [a + b for a, b in zip(put.seconds, get.seconds)])
        ops = {ph.op: ph.to_dict() for ph in (put, get, trip)}
        for op in ("put", "get"):
            ops[op]["parts_ms"] = median_parts(parts[path, op])
        rows.append({"path": path, "label": PATHS[path].label, "ops": ops})
    progress.remove_task(task)
    warm, fresh = memcpy_phases(nbytes, cfg.reps)
    _ratios(rows)
    import ray

    out = {"workload": share.workload, "batch": share.batch, "seqlen": share.seqlen, "bytes_stored": nbytes,
           "paths": rows, "bounds": [warm.to_dict(), fresh.to_dict()], "wrong": wrong,
           "checksum_ms": ray.get(pool.writers[0].checksum_ms.remote(cfg.reps))}
    if held is not None:
        out.update(unique_bytes=ray.get(pool.writers[0].unique_bytes.remote()), held_bytes=held)
    return out


def _turn(paths: tuple[str, ...], k: int) -> tuple[str, ...]:
    """``paths`` starting at the ``k``-th (each round another path goes first: what one
    path leaves behind, e.g. a store's background frees, falls on each of the others alike)."""
    k %= max(len(paths), 1)
    return paths[k:] + paths[:k]


def _checked_move(pool: _Pool, path: str, key: str, verify: bool, wrong: dict[str, str],
                  **read: Any) -> _Moved | None:
    """:func:`_move`; a peer's wrong bytes are recorded in ``wrong`` (None returned) instead of ending the run."""
    try:
        return _move(pool, path, key, verify, **read)
    except PeerMismatch as err:
        wrong[path] = str(err)
        return None


def _ratios(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["path"] == REFERENCE), None)
    for r in rows:
        r["ratio_to_raw_tq"] = (
            {op: r["ops"][op]["gb_per_s"] / ref["ops"][op]["gb_per_s"] for op in r["ops"]} if ref else None
        )


def _batch_paths(cfg: BenchConfig) -> tuple[str, ...]:
    """The paths that move a batch as one put (every section's but vlm-grpo's own rows)."""
    return tuple(p for p in cfg.paths if p not in GRPO_ONLY)


def _latency(cfg: BenchConfig, pool: _Pool, progress: Progress) -> dict:
    """``ops`` moves of the small batch per path: p50 / p99 of put and of get."""
    share = _share(cfg, LATENCY_WORKLOAD, None)
    nbytes = pool.prepare([pool.writers[0], pool.reader], [share, share])[0]
    paths = _batch_paths(cfg)
    task = progress.add_task(f"{share.workload} latency", total=len(paths) * (cfg.ops + 1))
    put: dict[str, list[float]] = {path: [] for path in paths}
    get: dict[str, list[float]] = {path: [] for path in paths}
    parts: dict[tuple[str, str], list[dict[str, float] | None]] = {(p, op): [] for p in paths for op in ("put", "get")}
    wrong: dict[str, str] = {}
    for op in range(cfg.ops + 1):  # in rounds, like _throughput
        for path in [p for p in _turn(paths, op) if p not in wrong]:
            moved = _checked_move(pool, path, _key(path, op), True, wrong)
            if moved and op:
                put[path].append(moved.put)
                get[path].append(moved.get)
                parts[path, "put"].append(moved.put_parts)
                parts[path, "get"].append(moved.get_parts)
            progress.advance(task)
    rows = [{"path": path, "label": PATHS[path].label,
             "put": {**percentiles(put[path]), "parts_ms": median_parts(parts[path, "put"])},
             "get": {**percentiles(get[path]), "parts_ms": median_parts(parts[path, "get"])}}
            for path in paths if path not in wrong]
    progress.remove_task(task)
    return {"workload": share.workload, "batch": share.batch, "seqlen": share.seqlen, "bytes_stored": nbytes,
            "ops": cfg.ops, "paths": rows, "wrong": wrong}


def _dp_shard(cfg: BenchConfig, pool: _Pool, progress: Progress) -> dict:
    """A DP rank's read of the vlm-step batch: every other sample, ``DP_SHARD_FIELDS``,
    through every path that can select rows (first read checked, then ``reps`` timed)."""
    share = _share(cfg, SWEEP_WORKLOAD, cfg.batch)
    nbytes = pool.prepare([pool.writers[0], pool.reader], [share, share])[0]
    rows = list(range(0, share.batch, 2))
    paths = [p for p in cfg.paths if PATHS[p].selects_rows]
    task = progress.add_task(f"DP shard of {share.workload} B={share.batch}", total=len(paths) * (cfg.reps + 1))
    gets: dict[str, list[float]] = {p: [] for p in paths}
    parts: dict[str, list[dict[str, float] | None]] = {p: [] for p in paths}
    wrong: dict[str, str] = {}
    for rep in range(cfg.reps + 1):
        for path in [p for p in paths if p not in wrong]:
            moved = _checked_move(pool, path, _key(path, rep, "-dp"), True, wrong, rows=rows, fields=DP_SHARD_FIELDS)
            if moved and rep:
                gets[path].append(moved.get)
                parts[path].append(moved.get_parts)
            progress.advance(task)
    progress.remove_task(task)
    return {"workload": share.workload, "batch": share.batch, "seqlen": share.seqlen, "bytes_stored": nbytes,
            "rows": len(rows), "fields": DP_SHARD_FIELDS, "wrong": wrong,
            "paths": [{"path": p, "label": PATHS[p].label, "get": {**percentiles(gets[p]), "parts_ms": median_parts(parts[p])}}
                      for p in paths if p not in wrong]}


def _writers(cfg: BenchConfig, pool: _Pool, n: int, progress: Progress) -> dict:
    """``n`` writers put their share of one batch at once; aggregate GB/s; then the
    reader reads every share back and checks every sample."""
    import ray

    base = _share(cfg, SWEEP_WORKLOAD, cfg.batch)
    shares = [replace(base, part=i, parts=n) for i in range(n)]
    writers = pool.writers[:n]
    nbytes = sum(pool.prepare(writers, shares))
    task = progress.add_task(f"{n} concurrent writers ({PATHS[WRITERS_PATH].label})", total=cfg.reps + 1)
    seconds: list[float] = []
    checked = 0
    for rep in range(cfg.reps + 1):
        keys = [_key(WRITERS_PATH, rep, f"w{i}") for i in range(n)]
        sent = ray.get([w.write.remote(WRITERS_PATH, k) for w, k in zip(writers, keys)])
        if rep:
            seconds.append(max(s["end"] for s in sent) - min(s["start"] for s in sent))
        else:  # every sample of every share, read back and checked
            problems = ray.get([pool.reader.read_share.remote(WRITERS_PATH, s["handle"], asdict(sh))
                                for s, sh in zip(sent, shares)])
            bad = [line for lines in problems for line in lines]
            if bad:
                raise BenchError(f"{n} writers: " + "; ".join(bad))
            checked = sum(len(sh.indices()) for sh in shares)
        ray.get([w.clear.remote(WRITERS_PATH, k) for w, k in zip(writers, keys)])
        progress.advance(task)
    progress.remove_task(task)
    agg = Phase(f"{n} writers put", base.batch, nbytes, seconds)
    return {"writers": n, "path": WRITERS_PATH, "batch": base.batch, "bytes_stored": nbytes,
            "put": agg.to_dict(), "verified_samples": checked}


def _key(path: str, rep: int, extra: str = "") -> str:
    return f"bench-{path}-{rep}{extra}-{uuid.uuid4().hex[:8]}"


def _ensure_ray(console: Console) -> bool:
    """A Ray for the worker actors: the embedded service's (this process), else a local
    one on loopback that the bench owns. True when the bench started it."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import logging

    import ray

    if ray.is_initialized():
        return False
    console.print("[dim]starting a local Ray for the bench's worker processes[/]")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return True



