"""``rlplane bench --ledger``: the claim engine alone, over a backlog of pending samples.

A native controller's index holds ``backlog`` committed samples (batches of 64 with
text-step lengths, GRPO groups of 8); one task claims a batch at a time, four ways: by
``batch_size``, by whole groups, by a token budget (one batch's tokens), by tokens in
whole groups. Each claim is acked before the next, so the backlog ahead stays about the
same. p50 ms per claim, no service and no sockets: what a claim costs its ledger as the
backlog grows (the service adds one round trip).

Example::

    results = run_ledger_bench(LedgerBenchConfig(backlogs=(6400, 102400)), console)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from rlplane_tools.bench.report import machine_facts

BATCH, GROUP = 64, 8


@dataclass
class LedgerBenchConfig:
    backlogs: tuple[int, ...] = (6400, 102400)
    claims: int = 60


def run_ledger_bench(cfg: LedgerBenchConfig, console: Console) -> dict:
    """Run every claim kind over each backlog; print the table; return the results."""
    from rlplane.claims import ClaimRequest
    from rlplane_service.ledger import Ledger

    rows = []
    for backlog in cfg.backlogs:
        with console.status(f"an index of {backlog} samples"):
            part, budget = _index(backlog, cfg.claims)
        led = Ledger({"p": part}.get)
        kinds = {
            "batch_size": ClaimRequest("p", "batch", BATCH, ("input_ids",), 0.0, BATCH),
            "groups": ClaimRequest("p", "groups", BATCH, ("input_ids",), 0.0, BATCH, group_key="group_id"),
            "max_tokens": ClaimRequest("p", "tokens", 1 << 16, ("input_ids",), 0.0, 1, max_tokens=budget,
                                       min_tokens=budget, tokens_field="input_ids"),
            "max_tokens + groups": ClaimRequest("p", "tokens-groups", 1 << 16, ("input_ids",), 0.0, 1,
                                                group_key="group_id", max_tokens=budget, min_tokens=budget,
                                                tokens_field="input_ids"),
        }
        with console.status(f"claims over a backlog of {backlog}"):
            row = {"backlog": backlog, **{kind: _claims(led, req, cfg.claims) for kind, req in kinds.items()}}
        rows.append(row)
    table = Table(title=f"the claim engine alone: p50 ms per claim of {BATCH} (groups of {GROUP})")
    for col in rows[0]:  # backlog, then the claim kinds
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["backlog"]), *[f"{row[k]['p50_ms']:.3f}" for k in row if k != "backlog"])
    console.print(table)
    return {"ledger": rows, "config": asdict(cfg), "machine": machine_facts()}


def _index(backlog: int, claims: int) -> tuple[object, int]:
    """A native index of ``backlog`` + what ``claims`` claims take, committed; one batch's tokens."""
    from rlplane.geometry import Geometry
    from rlplane.testing.workloads import text_step
    from rlplane_service.native.index import COMMITTED, Partition

    lens = text_step(BATCH, 4096, seed=7).lengths.numpy().astype(np.int64)
    part = Partition()
    for k in range(-(-backlog // BATCH) + claims + 1):
        slots = part.take([f"{k}-{i}" for i in range(BATCH)])
        fi = part.field_index("input_ids")
        fi.cover(slots)
        fi.block[slots] = 1
        fi.set_geometry(slots, Geometry.token(lens.copy(), []))
        part.user[slots] = np.array([{"group_id": f"{k}-{i // GROUP}", "group_size": GROUP} for i in range(BATCH)],
                                    dtype=object)
        part.state[slots] = COMMITTED
    return part, int(lens.sum())


def _claims(led: object, req: object, n: int) -> dict:
    from rlplane_tools.bench.base import percentiles

    took = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        out = led.claim(req, final=True)  # type: ignore[attr-defined]
        took.append(time.perf_counter() - t0)
        if len(out["ids"]) != BATCH:
            raise RuntimeError(f"a {req!r} claim took {len(out['ids'])} samples, not {BATCH}")
        led.ack("p", req.task, out["lease"], out["ids"])  # type: ignore[attr-defined]
    return percentiles(took[1:])  # the first fills the ledger's per-sample caches


__all__ = ["LedgerBenchConfig", "run_ledger_bench"]
