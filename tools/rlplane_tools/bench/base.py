"""What every bench path is made of: the worker's environment, the batch it holds, and
the :class:`BenchPath` interface (write in the writer process, read in the reader,
verify untimed).

A path that can read a subset of rows and fields (a data-parallel rank's shard) sets
``selects_rows`` and implements :meth:`BenchPath.read_rows`.

Example::

    class MyPath(BenchPath):
        name, label = "mine", "my store"
        def write(self, batch, key, peer): ...
        def read(self, batch, handle): ...
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

from rlplane.codec import Encoded
from rlplane.fields import Registry
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import Workload


@dataclass
class WorkerEnv:
    """What every path may need to open its clients: the service and its registry."""

    url: str
    token: str | None
    registry: dict
    tq_info: dict | None  # the TransferQueue store of the tq_url app (raw-tq runs on it)
    mooncake_url: str | None = None  # an rlplane app on the Mooncake backend (same token)
    tq_url: str | None = None  # an rlplane app on the TransferQueue backend 'simple' (same token)
    dataproto_master: dict | None = None  # the mooncake_master the DataProto row uses (MooncakeMaster.info())


@dataclass
class Batch:
    """One writer's share of a workload, as the writer holds it and as it is stored."""

    work: Workload
    ids: list[str]
    encoded: Encoded

    @property
    def nbytes(self) -> int:
        """Stored bytes: what every path moves and every GB/s is computed from."""
        return self.encoded.nbytes

    def subset(self, rows: list[int]) -> Workload:
        """The samples at ``rows`` as written (what a shard read must return)."""
        return self.work.select(rows)


@dataclass
class Sent:
    """What ``write`` returns: a handle for the reader and the writer's timing."""

    handle: Any
    start: float
    end: float


class BenchPath:
    """A way of moving a batch from a writer process to a reader process."""

    name: ClassVar[str]
    label: ClassVar[str]
    #: needs a peer (the reader actor's handle) in ``write``
    needs_peer: ClassVar[bool] = False
    #: can read some rows and fields of a batch (``read_rows``)
    selects_rows: ClassVar[bool] = False

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.registry = Registry.from_dict(env.registry)

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        raise NotImplementedError

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        raise NotImplementedError

    def read_rows(self, batch: Batch, handle: Any, rows: list[int], fields: list[str]) -> tuple[Any, float, float]:
        """Read ``fields`` of the samples at positions ``rows`` (only where ``selects_rows``)."""
        raise NotImplementedError(f"{self.name} cannot select rows")

    def verify(self, batch: Batch, got: Any, rows: list[int] | None = None, fields: list[str] | None = None) -> list[str]:
        """Every difference between what was written (at ``rows``, of ``fields``) and
        ``got`` (empty when bit-exact)."""
        if rows is None:
            return diff_fields(self.registry, batch.work.fields, got, batch.work.lengths, sample_ids=batch.ids)
        sub = batch.subset(rows)
        written = {f: sub.fields[f] for f in fields or sub.fields}
        return diff_fields(self.registry, written, got, sub.lengths, sample_ids=[batch.ids[i] for i in rows])

    def parts(self, op: str) -> dict[str, float] | None:
        """Where this path's last timed ``op`` (``put`` or ``get``) spent its time: seconds
        per part (:data:`rlplane.opstats.PARTS`: waiting on the store, encoding or
        decoding, the rest in the client; and ``engine``, the share of the wait the
        engine's servers took, where they said it); None where the path cannot tell."""
        return None

    def held_bytes(self) -> int | None:
        """Bytes the path's store holds now (None: it cannot tell): the bench takes the
        difference across one write to see what that write stored."""
        return None

    def clear(self, key: str) -> None:
        """Drop what ``write`` stored under ``key`` (untimed)."""

    def close(self) -> None:
        """Release clients."""


def percentiles(seconds: list[float]) -> dict:
    """p50, p99, min and max in ms of op times in seconds, and their count."""
    ms = sorted(s * 1e3 for s in seconds)
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"p50_ms": statistics.median(ms), "p99_ms": q[98], "min_ms": ms[0], "max_ms": ms[-1], "ops": len(ms)}


def median_parts(parts: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The median ms of each part over timed ops' :meth:`BenchPath.parts` (None when the
    path told none; a part only some ops told is left out)."""
    told = [p for p in parts if p]
    if not told:
        return None
    return {k: statistics.median(p[k] for p in told) * 1e3 for k in told[0] if all(k in p for p in told)}
