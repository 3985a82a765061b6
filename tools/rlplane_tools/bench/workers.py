"""The bench's writer and reader processes: Ray actors that each hold a share of a workload.

A worker generates its batch from the seed (so a reader can check bit for bit what a
writer wrote without the bytes travelling twice), opens the paths it is asked to run
and times each call itself. Handles between workers are msgpack bytes, except where a
path *is* Ray (an ObjectRef, an actor handle).

Example::

    w = start_workers(env, 2)
    ray.get(w[0].prepare.remote(Share("vlm-step", 8, 512, 0, 0, 1)))
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from rlplane.codec import encode
from rlplane.fields import Registry
from rlplane.testing.workloads import WORKLOADS

from rlplane_tools.bench.base import Batch, BenchPath, WorkerEnv
from rlplane_tools.bench.paths import PATHS, legacy_collate


@dataclass(frozen=True)
class Share:
    """Which samples of which generated workload a worker holds: part ``part`` of ``parts``."""

    workload: str
    batch: int
    seqlen: int
    seed: int
    part: int = 0
    parts: int = 1

    def indices(self) -> list[int]:
        lo, hi = self.part * self.batch // self.parts, (self.part + 1) * self.batch // self.parts
        return list(range(lo, hi))


class BenchWorker:
    """One writer or reader process (made a Ray actor by :func:`start_workers`)."""

    def __init__(self, env: dict) -> None:
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
        self.env = WorkerEnv(**env)
        self.registry = Registry.from_dict(self.env.registry)
        self.paths: dict[str, BenchPath] = {}
        self.batch: Batch | None = None
        self.share: Share | None = None

    def prepare(self, share: dict) -> int:
        """Hold ``share`` (generated once per workload, then sliced); returns its stored bytes."""
        s = Share(**share)
        if self.share != s:
            self.batch = None  # free the previous one first
            work = WORKLOADS[s.workload](batch=s.batch, seqlen=s.seqlen, seed=s.seed)
            idx = s.indices()
            if len(idx) != s.batch:
                work = work.select(idx)
            ids = [f"s-{i}" for i in idx]
            self.batch = Batch(work, ids, encode(self.registry, work.fields, work.lengths, sample_ids=ids))
            self.share = s
        return self.batch.nbytes

    def open(self, names: list[str]) -> None:
        """Connect the paths this worker will run (untimed)."""
        for name in names:
            if name not in self.paths:
                self.paths[name] = PATHS[name](self.env)

    def write(self, path: str, key: str, peer: Any = None, measure: bool = False) -> dict:
        """Write the held batch under ``key``; with ``measure``, also what the write added
        to the path's store (``stored``: bytes, None where the path cannot tell), read
        outside the timed call."""
        p = self.paths[path]
        before = p.held_bytes() if measure else None
        sent = p.write(self._batch(), key, peer)
        after = p.held_bytes() if before is not None else None
        return {"handle": sent.handle, "start": sent.start, "end": sent.end, "parts": p.parts("put"),
                "stored": None if after is None else after - before}

    def unique_bytes(self) -> int:
        """The held batch's bytes with every repeated row counted once (what a store that
        keeps identical rows once must hold at least)."""
        b = self._batch()
        return encode(self.registry, b.work.fields, b.work.lengths, sample_ids=b.ids, share_rows=True).nbytes

    def read(self, path: str, handle: Any, verify: bool, rows: list[int] | None = None,
             fields: list[str] | None = None) -> dict:
        """Read what ``handle`` names (only ``fields`` of the samples at ``rows``, when given)."""
        p = self.paths[path]
        if rows is None:
            got, start, end = p.read(self._batch(), handle)
        else:
            got, start, end = p.read_rows(self._batch(), handle, rows, fields)
        parts = p.parts("get")
        problems = p.verify(self._batch(), got, rows, fields) if verify else []
        return {"start": start, "end": end, "parts": parts, "problems": problems}

    def read_share(self, path: str, handle: Any, share: dict) -> list[str]:
        """Read another writer's share and check every sample of it (untimed)."""
        self.prepare(share)
        p = self.paths[path]
        got, _, _ = p.read(self._batch(), handle)
        return p.verify(self._batch(), got)

    def checksum_ms(self, reps: int) -> float:
        """Median ms to compute the row digests of the held batch (what integrity adds to a
        put, and again to a read: rlplane.integrity.row_sums over every column)."""
        import statistics
        import time

        from rlplane.integrity import row_sums

        cols = self._batch().encoded.columns.values()
        times = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            for col in cols:
                row_sums(col)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def clear(self, path: str, key: str) -> None:
        self.paths[path].clear(key)

    def legacy_receive(self, key: str, rows: Any) -> float:
        """The legacy path's actor call (see ``LegacyObjectArray``)."""
        return legacy_collate(key, rows)

    def close(self) -> None:
        for p in self.paths.values():
            p.close()
        self.paths.clear()

    def _batch(self) -> Batch:
        if self.batch is None:
            raise RuntimeError("prepare() a share before moving it")
        return self.batch


def start_workers(env: WorkerEnv, count: int) -> list[Any]:
    """``count`` worker actors on the current Ray cluster (no CPU reservation: they only
    move bytes, and the service's actors hold the logical CPUs)."""
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=1)(BenchWorker)
    return [actor.remote(asdict(env)) for _ in range(count)]
