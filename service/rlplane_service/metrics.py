"""Prometheus metrics: ``GET /metrics``, the same whichever Serve replica answers.

Two sources, both shared by every replica:

* **Operations** (counts, bytes, latency histograms, errors) go to one :class:`Ledger`
  per store, held by a detached named Ray actor (``{store}-metrics``). Replicas record
  the HTTP data path themselves; ``tq`` clients move bytes straight to the store and
  report their ops with ``POST /v1/metrics/report`` (see :meth:`rlplane.Client.report_ops`).
* **Stored state** (partitions, samples and bytes per partition and per storage unit,
  capacity, units up, the Mooncake master) is read from the store at scrape time.

Names follow Prometheus conventions; the README lists them.

Example::

    ledger = Ledger()
    ledger.record([{"op": "put_samples", "transport": "http", "seconds": 0.1, "nbytes": 10, "error": None}])
    text = render(ledger.snapshot(), StoreView(...))
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel, Field

import rlplane
from rlplane.errors import ERROR_NAMES, RlplaneError
from rlplane.opstats import OPS

if TYPE_CHECKING:
    from rlplane_service.backends.base import Sizes

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the op latency histogram.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TRANSPORTS = ("native", "tq", "http")
#: Partitions (and partition/task pairs) with labels of their own: the biggest ones; the
#: rest are summed under ``other``, so a store of many partitions keeps /metrics small.
TOP_LABELLED = 50


class OpReport(BaseModel):
    """One finished operation, as a client reports it."""

    op: str = Field(..., max_length=64, description=f"One of {', '.join(OPS)}.")
    transport: str = Field("tq", max_length=16, description="native, tq or http.")
    seconds: float = Field(..., ge=0, le=86_400)
    nbytes: int = Field(0, ge=0, le=1 << 50)
    error: str | None = Field(None, max_length=64, description="Error class name when the op failed (one of "
                              "rlplane.errors'; anything else counts as 'Other').")


class OpsReport(BaseModel):
    events: list[OpReport] = Field(..., max_length=10_000)


@dataclass
class Ledger:
    """Op counters of one store (see the module docstring). Not thread-safe: the actor
    that holds it runs one call at a time."""

    ops: dict[tuple[str, str, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[str, str, str], int] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    latency: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # bucket counts + [sum]

    def record(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Count ``events`` (dicts like :class:`OpReport`); unknown ops/transports are
        dropped. Returns how many were counted."""
        counted = 0
        for e in events:
            op, transport, error = str(e.get("op")), str(e.get("transport")), e.get("error")
            if op not in OPS or transport not in TRANSPORTS:
                continue
            seconds = max(0.0, float(e.get("seconds", 0.0)))
            status = "error" if error else "ok"
            self.ops[(op, transport, status)] = self.ops.get((op, transport, status), 0) + 1
            if error:
                kind = str(error) if str(error) in ERROR_NAMES else "Other"  # a fixed set: no label flooding
                self.errors[(op, kind)] = self.errors.get((op, kind), 0) + 1
            elif op != "snapshot":  # (a snapshot's bytes go to disk, not through the store: its own gauges)
                direction = "out" if op == "read_columns" else "in"
                key = (op, transport, direction)
                self.nbytes[key] = self.nbytes.get(key, 0) + int(e.get("nbytes", 0))
            hist = self.latency.setdefault((op, transport), [0.0] * (len(BUCKETS) + 2))
            hist[bisect.bisect_left(BUCKETS, seconds)] += 1
            hist[-1] += seconds
            counted += 1
        return counted

    def snapshot(self) -> dict[str, Any]:
        return {"ops": dict(self.ops), "nbytes": dict(self.nbytes), "errors": dict(self.errors),
                "latency": {k: list(v) for k, v in self.latency.items()}}


@dataclass
class StoreView:
    """The stored state at scrape time (what :func:`store_view` reads)."""

    backend: str
    partitions: dict[str, tuple[int, int]] | None  # name -> (samples, bytes); None: not known (the store is down)
    units: dict[str, tuple[int, int] | None]  # unit -> (samples, bytes), None where unknown
    units_up: dict[str, bool]
    capacity: int | None
    mooncake_up: bool | None = None
    mooncake: dict[str, float] = field(default_factory=dict)  # master_* gauges we re-export
    streams: dict[str, Any] | None = None  # the consumption ledger's snapshot (rlplane_service.ledger.Ledger.snapshot)
    loss: dict[str, int] | None = None  # lost_samples (every backend), under_replicated_samples (native)
    slabs: dict[str, dict[str, Any]] = field(default_factory=dict)  # native: unit -> its slab's figures
    components: dict[str, bool] = field(default_factory=dict)  # every component and loop the store's health names
    controller: dict[str, float] | None = None  # native: the controller's restarts and its last rebuild's seconds
    snapshot_interval_s: float = 0.0  # RLPLANE_SNAPSHOT_INTERVAL_S (0: no periodic snapshots)
    shared_bytes: int | None = None  # native: bytes samples hold in rows stored once for several of them


#: The native controller's account of the last snapshot (rlplane.snapshot), as gauges.
SNAPSHOT_STATS = {
    "last_snapshot_time": "Unix time the last snapshot of the store was written (0: none since the controller started).",
    "last_snapshot_bytes": "Bytes on disk of the last snapshot.",
    "last_snapshot_seconds": "How long the last snapshot took, cut to rename.",
    "last_snapshot_samples": "Samples in the last snapshot.",
}


def store_view(
    sizes: Callable[[list[str]], Sizes],
    *,
    backend: str,
    unit_names: list[str],
    health: Mapping[str, bool],
    capacity: int | None,
    engine_stats: Callable[[], dict[str, Any] | None] = lambda: None,
    mooncake_metrics_url: str | None = None,
    streams: Callable[[], dict[str, Any]] | None = None,
    loss: Callable[[], dict[str, Any]] | None = None,
) -> StoreView:
    """Read the stored state (blocking; run it off the event loop): ``sizes(unit_names)``
    per partition and unit, and the engine's own account (``engine_stats()``) or the
    service's loss count (``loss()``) where the store keeps one (see
    :class:`~rlplane_service.backends.base.StoreBackend`)."""
    try:
        partitions, units = sizes(unit_names)
        stats = engine_stats()
    except RlplaneError as err:  # (the controller is down: the rest still renders, its up gauge 0 among it)
        log.warning("a scrape could not read the stored sizes: %s", err)
        partitions, units, stats = None, {u: None for u in unit_names}, None
    counts = None
    slabs: dict[str, Any] = {}
    controller = None
    if stats is not None and "controller_restarts" in stats:
        controller = {k: float(stats.get(k, 0.0))
                      for k in ("controller_restarts", "rebuild_seconds", "commit_log_records", "started",
                                *SNAPSHOT_STATS)}
    if stats is not None:
        counts = {k: int(stats.get(k, 0)) for k in ("lost_samples", "under_replicated_samples")}
        slabs = {u: d["slab"] for u, d in stats.get("units", {}).items() if isinstance(d.get("slab"), dict)}
    elif loss is not None:  # the service counts what dead units took
        try:
            counts = {"lost_samples": int(loss()["lost_samples"])}
        except Exception as err:  # noqa: BLE001 - a scrape reports what it can
            log.warning("could not read the lost samples: %s", err)
    view = StoreView(backend, partitions, units, {u: bool(health.get(u)) for u in unit_names}, capacity, loss=counts,
                     components={str(k): bool(v) for k, v in health.items()})
    view.slabs = slabs
    view.controller = controller
    if stats is not None and "shared_bytes" in stats:
        view.shared_bytes = int(stats["shared_bytes"])
    if streams is not None:
        try:
            view.streams = streams()
        except Exception as err:  # noqa: BLE001 - a scrape reports what it can
            log.warning("could not read the consumption ledger: %s", err)
    if mooncake_metrics_url is not None:
        view.mooncake_up = bool(health.get("mooncake_master"))
        view.mooncake = _scrape_mooncake(mooncake_metrics_url) if view.mooncake_up else {}
    return view


def _scrape_mooncake(url: str) -> dict[str, float]:
    import httpx

    try:
        return parse_mooncake_metrics(httpx.get(url, timeout=2.0).text)
    except (httpx.HTTPError, ValueError):
        return {}


#: A /metrics body is reused for this long: any scrape at least this long after an
#: operation sees it. Prometheus scrapes every 15-60 s; many scrapers share one read.
SCRAPE_TTL_S = 1.0


class ScrapeCache:
    """``/metrics``' body, produced by ``produce`` on a thread of its own (never the data
    path's pool, so a slow store read cannot starve puts and reads, and a flood of scrapes
    costs one store read per ``ttl``); concurrent scrapes wait for the one in flight.

    Example::

        cache = ScrapeCache(lambda: render(ledger.snapshot(), store_view(...)))
        body = await cache.get()
    """

    def __init__(self, produce: Callable[[], Any], ttl: float = SCRAPE_TTL_S) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        self._produce, self._ttl = produce, ttl
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rlplane-scrape")
        self._lock = asyncio.Lock()
        self._started, self._body = float("-inf"), None

    async def get(self) -> Any:
        import asyncio

        async with self._lock:
            if time.monotonic() - self._started < self._ttl:
                return self._body
            started = time.monotonic()  # the body reflects everything done before this
            self._body = await asyncio.get_running_loop().run_in_executor(self._pool, self._produce)
            self._started = started
            return self._body


def render(ledger: Mapping[str, Any], view: StoreView) -> bytes:
    """Prometheus text exposition of a ledger snapshot and a store view."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(ledger, view))
    return generate_latest(registry)


class _Collector:
    def __init__(self, ledger: Mapping[str, Any], view: StoreView) -> None:
        self.ledger, self.view = ledger, view

    def collect(self) -> Iterable[Any]:
        led, v = self.ledger, self.view
        ops = CounterMetricFamily("rlplane_ops", "Operations by op, transport and status.", labels=["op", "transport", "status"])
        for (op, transport, status), n in sorted(led["ops"].items()):
            ops.add_metric([op, transport, status], n)
        yield ops
        moved = CounterMetricFamily(
            "rlplane_transferred_bytes", "Column bytes moved by successful ops (in: written, out: read).",
            labels=["op", "transport", "direction"],
        )
        for (op, transport, direction), n in sorted(led["nbytes"].items()):
            moved.add_metric([op, transport, direction], n)
        yield moved
        errors = CounterMetricFamily("rlplane_errors", "Failed operations by op and error class.", labels=["op", "type"])
        for (op, kind), n in sorted(led["errors"].items()):
            errors.add_metric([op, kind], n)
        yield errors
        hist = HistogramMetricFamily(
            "rlplane_op_duration_seconds",
            "Wall time of an op (http: in the service; tq: in the client that did it).",
            labels=["op", "transport"],
        )
        for (op, transport), counts in sorted(led["latency"].items()):
            cumulative, buckets = 0.0, []
            for bound, n in zip((*BUCKETS, float("inf")), counts[:-1]):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            hist.add_metric([op, transport], buckets, sum_value=counts[-1])
        yield hist

        if v.partitions is not None:  # (None: not known, the controller down; not 0)
            yield from _sizes(v.partitions)
        if v.shared_bytes is not None:
            yield _gauge("rlplane_shared_bytes", "Bytes of rlplane_stored_bytes that no storage unit holds a second "
                         "time: rows identical across samples (a GRPO group's images) are stored once (native).",
                         v.shared_bytes)
        if v.loss is not None:
            yield _gauge("rlplane_lost_samples", "Samples lost with a storage unit that held their only copy, since "
                         "the store started.", v.loss["lost_samples"])
        if v.loss is not None and "under_replicated_samples" in v.loss:
            yield _gauge("rlplane_under_replicated_samples", "Samples with fewer live copies than RLPLANE_REPLICAS "
                         "(native).", v.loss["under_replicated_samples"])
        if v.controller is not None:
            restarts = CounterMetricFamily("rlplane_controller_restarts", "Times the native controller's process was "
                                           "restarted and rebuilt its index from the storage units.")
            restarts.add_metric([], v.controller.get("controller_restarts", 0.0))
            yield restarts
            yield _gauge("rlplane_controller_rebuild_seconds", "How long the controller's last rebuild of its index "
                         "took (0: it never restarted).", v.controller.get("rebuild_seconds", 0.0))
            yield _gauge("rlplane_commit_log_records", "Commit-log records the storage units keep for a rebuild of the "
                         "index: it follows what the store holds, not how long it ran.",
                         v.controller.get("commit_log_records", 0.0))
            for key, what in SNAPSHOT_STATS.items():
                yield _gauge(f"rlplane_{key}", what, v.controller.get(key, 0.0))
            since = max(v.controller.get("last_snapshot_time", 0.0), v.controller.get("started", 0.0))
            yield _gauge("rlplane_snapshot_age_seconds", "Seconds since the last snapshot was written, or since the "
                         "controller started when none was since (what the snapshot alert watches).",
                         max(0.0, time.time() - since) if since else 0.0)
            yield _gauge("rlplane_snapshot_interval_seconds", "How often the service takes a snapshot "
                         "(RLPLANE_SNAPSHOT_INTERVAL_S; 0: it does not).", v.snapshot_interval_s)
        yield _gauge("rlplane_capacity_samples", "Most samples the store holds (RLPLANE_CAPACITY; 0: no limit).", v.capacity or 0)
        unit_samples = GaugeMetricFamily("rlplane_storage_unit_samples", "Samples per storage unit.", labels=["unit"])
        unit_bytes = GaugeMetricFamily("rlplane_storage_unit_bytes", "Stored bytes per storage unit.", labels=["unit"])
        for unit, held in sorted(v.units.items()):
            if held is not None:
                unit_samples.add_metric([unit], held[0])
                unit_bytes.add_metric([unit], held[1])
        yield unit_samples
        yield unit_bytes
        if v.slabs:
            slab = GaugeMetricFamily("rlplane_storage_unit_slab_bytes", "A native storage unit's slab (RLPLANE_UNIT_BYTES): "
                                     "total, used (allocated extents) and free bytes.", labels=["unit", "state"])
            frag = GaugeMetricFamily("rlplane_storage_unit_slab_fragmentation", "1 - the largest free hole / free bytes "
                                     "of a native storage unit's slab (0: one hole).", labels=["unit"])
            for unit, d in sorted(v.slabs.items()):
                for state, key in (("total", "slab_bytes"), ("used", "used_bytes"), ("free", "free_bytes")):
                    slab.add_metric([unit, state], float(d.get(key, 0)))
                frag.add_metric([unit], float(d.get("fragmentation", 0.0)))
            yield slab
            yield frag
            journals = {u: d["journal"] for u, d in v.slabs.items() if isinstance(d.get("journal"), dict)}
            if journals:
                lag = GaugeMetricFamily("rlplane_journal_lag_seconds", "Age of the oldest change a native storage "
                                        "unit appended to its journal and has not yet fsynced (RLPLANE_JOURNAL_DIR; "
                                        "durable=True puts never wait in it).", labels=["unit"])
                lag_bytes = GaugeMetricFamily("rlplane_journal_lag_bytes", "Bytes a storage unit appended to its "
                                              "journal and has not yet fsynced.", labels=["unit"])
                for unit, j in sorted(journals.items()):
                    lag.add_metric([unit], float(j.get("lag_s", 0.0)))
                    lag_bytes.add_metric([unit], float(j.get("lag_bytes", 0)))
                yield lag
                yield lag_bytes
        if v.components:
            comp = GaugeMetricFamily("rlplane_component_up", "1 when a component of the store answers and does its "
                                     "work; 0 for one that does not, or for a loop of one that died ('controller "
                                     "rlplane-watch').", labels=["component"])
            for name, ok in sorted(v.components.items()):
                comp.add_metric([name], 1.0 if ok else 0.0)
            yield comp
        up = GaugeMetricFamily("rlplane_storage_unit_up", "1 when the storage unit answers.", labels=["unit"])
        for unit, ok in sorted(v.units_up.items()):
            up.add_metric([unit], 1.0 if ok else 0.0)
        yield up
        if v.mooncake_up is not None:
            yield _gauge("rlplane_mooncake_master_up", "1 when the store's mooncake_master is healthy.", float(v.mooncake_up))
            for name, value in sorted(v.mooncake.items()):
                yield _gauge(f"rlplane_mooncake_{name}", f"mooncake_master's {name}.", value)
        if v.streams is not None:
            yield from _consumption(v.streams)
        info = GaugeMetricFamily("rlplane_build_info", "rlplane version and storage backend.", labels=["version", "backend"])
        info.add_metric([rlplane.__version__, v.backend], 1.0)
        yield info


#: The label of what is summed beyond the TOP_LABELLED biggest: no partition name has parentheses.
OTHER = "(other)"


def _sizes(parts: Mapping[str, tuple[int, int]]) -> Iterable[Any]:
    """rlplane_partitions, rlplane_partition_{samples,bytes} and rlplane_stored_{samples,bytes}."""
    yield _gauge("rlplane_partitions", "Partitions holding samples.", len(parts))
    samples = GaugeMetricFamily("rlplane_partition_samples", "Samples per partition.", labels=["partition"])
    nbytes = GaugeMetricFamily("rlplane_partition_bytes", "Stored bytes per partition.", labels=["partition"])
    for name, (n, b) in sorted(_top_partitions(parts).items()):
        samples.add_metric([name], n)
        nbytes.add_metric([name], b)
    yield samples
    yield nbytes
    yield _gauge("rlplane_stored_samples", "Samples held by the store.", sum(n for n, _ in parts.values()))
    yield _gauge("rlplane_stored_bytes", "Bytes held by the store.", sum(b for _, b in parts.values()))


def _top_partitions(parts: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The TOP_LABELLED biggest partitions (bytes, then samples) by name, the rest summed as
    :data:`OTHER` (no partition can be named so: a real one called ``other`` keeps its own)."""
    if len(parts) <= TOP_LABELLED:
        return dict(parts)
    ranked = sorted(parts.items(), key=lambda kv: (kv[1][1], kv[1][0], kv[0]), reverse=True)
    out = dict(ranked[: TOP_LABELLED])
    rest = ranked[TOP_LABELLED:]
    out[OTHER] = (sum(n for _, (n, _) in rest), sum(b for _, (_, b) in rest))
    return out


def _top_tasks(tasks: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The TOP_LABELLED (partition, task) pairs holding the most samples, the rest summed as :data:`OTHER`."""
    if len(tasks) <= TOP_LABELLED:
        return tasks
    size = lambda t: sum(int(t.get(k, 0)) for k in CONSUMPTION_STATES)  # noqa: E731
    ranked = sorted(tasks, key=size, reverse=True)
    rest = ranked[TOP_LABELLED:]
    other = {"partition": OTHER, "task": OTHER, **{k: sum(int(t.get(k, 0)) for t in rest) for k in CONSUMPTION_STATES}}
    return [*ranked[: TOP_LABELLED], other]


#: Per-task sample states exported by rlplane_consumption_samples.
CONSUMPTION_STATES = ("pending", "claimed", "acked", "expired")


def _consumption(streams: Mapping[str, Any]) -> Iterable[Any]:
    """rlplane_consumption_samples, rlplane_claim_redelivered and the claim-wait histogram."""
    per = GaugeMetricFamily("rlplane_consumption_samples",
                            "Samples per partition and consuming task, by state (pending: ready, never claimed; "
                            "claimed: leased, not acked; acked; expired: too stale for the task).",
                            labels=["partition", "task", "state"])
    again = CounterMetricFamily("rlplane_claim_redelivered", "Samples whose lease lapsed and went back to the task "
                                f"(the {TOP_LABELLED} tasks with the most).", labels=["partition", "task"])
    tasks = streams.get("tasks", [])
    for t in _top_tasks(tasks):
        for state in CONSUMPTION_STATES:
            per.add_metric([t["partition"], t["task"], state], t.get(state, 0))
    # (no sum of the rest for a counter: tasks moving in and out of the top made it fall and rise, a false count)
    for t in sorted(tasks, key=lambda t: (int(t.get("redelivered", 0)), t["partition"], t["task"]),
                    reverse=True)[:TOP_LABELLED]:
        again.add_metric([t["partition"], t["task"]], t.get("redelivered", 0))
    yield per
    yield again
    wait = HistogramMetricFamily("rlplane_claim_wait_seconds", "How long answered claims waited for their samples.")
    cumulative, buckets = 0.0, []
    for bound, n in zip((*streams.get("wait_buckets", []), float("inf")), streams.get("wait_counts", [])):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    if buckets:
        wait.add_metric([], buckets, sum_value=float(streams.get("wait_sum", 0.0)))
    yield wait
    yield _gauge("rlplane_claim_leases", "Claim leases held (not acked, not lapsed).", streams.get("leases", 0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


#: mooncake_master gauges re-exported as rlplane_mooncake_<name> (pool size and use).
MOONCAKE_GAUGES = {"master_allocated_bytes": "allocated_bytes", "master_total_capacity_bytes": "capacity_bytes",
                   "master_key_count": "keys", "master_active_clients": "clients"}


def parse_mooncake_metrics(text: str) -> dict[str, float]:
    """The gauges of :data:`MOONCAKE_GAUGES` from a mooncake_master ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in MOONCAKE_GAUGES and not sample.labels:
                out[MOONCAKE_GAUGES[sample.name]] = float(sample.value)
    return out


@functools.cache
def ledger_actor_class() -> Any:
    """The Ray actor class that holds a store's :class:`Ledger` (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class LedgerActor:
        def __init__(self) -> None:
            self._ledger = Ledger()
            self._secrets: dict[str, str] = {}
            self._kept: dict[str, Any] = {}
            self._counts: dict[str, int] = {}

        def record(self, events: list[dict[str, Any]]) -> int:
            return self._ledger.record(events)

        def snapshot(self) -> dict[str, Any]:
            return self._ledger.snapshot()

        def store_secret(self, kind: str) -> str:
            """A random secret of this store (``control``: the controller's credential on the
            units), drawn by the first call and the same for every later one: replicas that
            create the store at once agree on it (this actor is the store's first, made
            once by name)."""
            import secrets

            return self._secrets.setdefault(kind, secrets.token_hex(32))

        def remember(self, key: str, value: Any) -> Any:
            """``key``'s value, set to ``value`` by the first call (the controller's port: a
            restarted controller serves where clients look for it)."""
            return self._kept.setdefault(key, value)

        def keep(self, key: str, value: Any) -> None:
            """Set ``key`` to ``value`` (the restore's state, beat by the replica restoring)."""
            import time

            self._kept[key] = value
            self._kept[f"at:{key}"] = time.monotonic()

        def kept(self, key: str) -> list[Any]:
            """``[value, seconds since it was last kept]`` of ``key`` (``[None, None]``: never;
            the age by this actor's clock, so replicas on other hosts compare no clocks)."""
            import time

            at = self._kept.get(f"at:{key}")
            return [self._kept.get(key), None if at is None else time.monotonic() - at]

        def turn(self, key: str, period_s: float) -> bool:
            """True for the first caller in each ``period_s`` (one replica of several takes
            the periodic snapshot)."""
            import time

            now = time.time()
            if now - float(self._kept.get(f"turn:{key}", 0.0)) < period_s * 0.9:
                return False
            self._kept[f"turn:{key}"] = now
            return True

        def count(self, key: str, add: int = 1) -> int:
            """Counter ``key`` after adding ``add`` (the controller's restarts)."""
            self._counts[key] = self._counts.get(key, 0) + add
            return self._counts[key]

    return LedgerActor


__all__ = ["BUCKETS", "Ledger", "OpReport", "OpsReport", "StoreView", "ledger_actor_class", "parse_mooncake_metrics", "render", "store_view"]
