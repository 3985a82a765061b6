"""``rlplane bench --rebuild``: how long a restarted controller takes to rebuild its index.

A native engine on loopback (``LocalEngine``: two storage units, each in a process of its
own, as the service runs them; the controller in this process), filled with committed
samples: text-step rows (``--samples``, default 1,048,576, in puts of 4096) and 64
vlm-step puts (B=2: a rebuild reads no image byte, only rows and blocks). Then the controller is stopped and a new one rebuilds its index from
the units' blocks and commit log; the rebuild's seconds against the targets (1M text
samples <= 10 s, 64 vlm-step puts <= 2 s), and every sample's count checked after.

Example::

    results = run_rebuild_bench(RebuildBenchConfig(text_samples=65536), console)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from rlplane_tools.bench.report import machine_facts

#: Targets of the controller-recovery issue: seconds to rebuild (text samples, vlm-step puts).
TEXT_TARGET_S, VLM_TARGET_S = 10.0, 2.0


@dataclass
class RebuildBenchConfig:
    text_samples: int = 1 << 20
    text_batch: int = 4096
    text_seqlen: int = 16
    vlm_puts: int = 64
    vlm_batch: int = 2  # the images dominate the bytes (~19 MB a sample); the rebuild reads none of them


def run_rebuild_bench(cfg: RebuildBenchConfig, console: Console) -> dict:
    """Fill, restart, rebuild; print the table; return the results."""
    rows = [_case(console, "text-step", cfg.text_samples // cfg.text_batch, cfg.text_batch, cfg.text_seqlen,
                  TEXT_TARGET_S if cfg.text_samples >= 1_000_000 else None),
            _case(console, "vlm-step", cfg.vlm_puts, cfg.vlm_batch, 1024, VLM_TARGET_S if cfg.vlm_puts >= 64 else None)]
    table = Table(title="a restarted controller rebuilds its index from 2 storage units")
    for col in ("workload", "puts", "samples", "log MiB", "put s", "rebuild s", "target s", ""):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["workload"], str(r["puts"]), str(r["samples"]), f"{r['log_mib']:.1f}", f"{r['put_s']:.1f}",
                      f"{r['rebuild_s']:.2f}", "-" if r["target_s"] is None else f"{r['target_s']:.0f}",
                      "" if r["met"] is None else ("met" if r["met"] else "missed"))
    console.print(table)
    return {"rebuild": rows, "config": asdict(cfg), "machine": machine_facts()}


def _case(console: Console, workload: str, puts: int, batch: int, seqlen: int, target: float | None) -> dict:
    from rlplane import Client, default_registry
    from rlplane.testing.workloads import fields_nbytes, text_step, vlm_step
    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    w = (text_step if workload == "text-step" else vlm_step)(batch, seqlen, seed=3)
    slab = max(256 << 20, int(puts * fields_nbytes(w.fields) * 1.1) + (64 << 20))  # a unit may get every put
    with LocalEngine(2, slab_bytes=slab, processes=True, lease_s=600) as eng:
        client = Client(default_registry().without_sharing(), NativeTransport(eng.info, timeout=600, data_path="shm"))
        try:
            t0 = time.monotonic()
            with console.status(f"{workload}: {puts} puts of {batch}") as status:
                for k in range(puts):
                    client.put_samples(f"{workload}-{k % 16}", w.fields)
                    if k % 16 == 15:
                        status.update(f"{workload}: {k + 1} of {puts} puts of {batch}")
            put_s = time.monotonic() - t0
            log_bytes = sum(int(client.transport._unit(u).call({"op": "stats"}, timeout=60)[0].get("log_bytes", 0))
                            for u in range(len(client.transport.units)))
            before = client.transport.stats()["samples"]
            eng.kill_controller()
            with console.status(f"{workload}: rebuilding the index of {before} samples"):
                t0 = time.monotonic()
                report = eng.restart_controller()
                rebuild_s = time.monotonic() - t0
            after = client.transport.stats()["samples"]
        finally:
            client.close()
    if after != before or report["ignored"] or report["lost_samples"]:
        raise RuntimeError(f"the rebuild of {workload} came back with {after} of {before} samples: {report}")
    return {"workload": workload, "puts": puts, "samples": after, "log_mib": log_bytes / 2**20, "put_s": put_s,
            "rebuild_s": rebuild_s, "target_s": target, "met": None if target is None else rebuild_s <= target}


__all__ = ["RebuildBenchConfig", "run_rebuild_bench", "TEXT_TARGET_S", "VLM_TARGET_S"]
