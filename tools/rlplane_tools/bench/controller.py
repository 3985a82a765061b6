"""The bench's ``controller`` section: how many small operations one store index serves.

Every put, read, claim and ack of the native engine passes its controller (one actor,
one thread); this section finds its ceiling. ``processes`` client processes each run one
operation in a loop for ``seconds``, all at once:

- **put_samples** of one sample (B=1, a short text sample),
- **claim + ack** of one sample (a pre-filled partition, task ``ctl``),
- **read_columns** of one sample (the same stored sample over and over).

Reported: operations per second over all processes, and the per-operation p50/p99 each
process saw. On a machine with fewer cores than processes the clients compete with the
controller for CPU: the numbers are then a floor of the controller's ceiling.

Example::

    section = run_controller_bench(url, token, ControllerBenchConfig(seconds=2), console)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch
from rich.console import Console

OPS = ("put_samples", "claim+ack", "read_columns")


@dataclass
class ControllerBenchConfig:
    processes: int = 8
    seconds: float = 5.0  # per operation
    seqlen: int = 32
    transport: str = "direct"


def _one(seqlen: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(seqlen).reshape(1, seqlen), "input_lengths": torch.tensor([seqlen])}


def _client_loop(url: str, token: str | None, cfg_dict: dict, op: str, p: str, go: Any, start: Any, conn: Any) -> None:
    import rlplane
    from rlplane.errors import NotReadyError
    from rlplane.meta import SampleMeta

    cfg = ControllerBenchConfig(**cfg_dict)
    fields = _one(cfg.seqlen)
    seconds: list[float] = []
    errors = 0
    with rlplane.connect(url, token=token, transport=cfg.transport) as c:
        meta = SampleMeta(p, ["read-me"], [cfg.seqlen], {"input_ids", "input_lengths"})
        conn.send_bytes(b"ready")
        go.wait(120)
        end = start.value + cfg.seconds  # one window for every process (perf_counter is system-wide on Linux)
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                if op == "put_samples":
                    c.put_samples(p, fields)
                elif op == "claim+ack":
                    c.ack(c.claim(p, "ctl", batch_size=1, fields=["input_ids"], timeout=0), "ctl")
                else:
                    c.read_columns(meta, ["input_ids"])
            except NotReadyError:
                errors += 1
                continue
            seconds.append(time.perf_counter() - t0)
    conn.send_bytes(msgpack.packb({"seconds": seconds, "not_ready": errors}))


def run_controller_bench(url: str, token: str | None, cfg: ControllerBenchConfig, console: Console) -> dict[str, Any]:
    """Each operation of :data:`OPS` from ``cfg.processes`` processes at once; ops/s and latency."""
    import rlplane

    from rlplane_tools.bench.base import percentiles

    out: dict[str, Any] = {"processes": cfg.processes, "seconds": cfg.seconds, "rows": []}
    with rlplane.connect(url, token=token, transport=cfg.transport) as c:
        out["transport"] = c.transport.name
        for op in OPS:
            p = f"bench-ctl-{uuid.uuid4().hex[:8]}"
            if op == "read_columns":
                c.put_samples(p, _one(cfg.seqlen), sample_ids=["read-me"])
            elif op == "claim+ack":  # more than the claimers can take in the time
                for _ in range(int(8 * cfg.seconds)):
                    c.put_samples(p, {k: v.expand(1024, *v.shape[1:]).contiguous() for k, v in _one(cfg.seqlen).items()})
            with console.status(f"controller: {op} from {cfg.processes} processes for {cfg.seconds:g} s"):
                reports = _run(url, token, cfg, op, p)
            lat = [s for r in reports for s in r["seconds"]]
            out["rows"].append({"op": op, "ops": len(lat), "ops_per_s": len(lat) / cfg.seconds,
                                "latency": percentiles(lat) if lat else None,
                                "not_ready": sum(r["not_ready"] for r in reports)})
            c.clear(p)
    return out


def _run(url: str, token: str | None, cfg: ControllerBenchConfig, op: str, p: str) -> list[dict[str, Any]]:
    from rlplane_tools.bench.procs import run_together

    return run_together(_client_loop, (url, token, asdict(cfg), op, p), cfg.processes, finish_s=cfg.seconds + 120)


__all__ = ["ControllerBenchConfig", "run_controller_bench", "OPS"]
