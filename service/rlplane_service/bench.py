"""``rlplane bench``: encode -> in-memory transport -> decode of a reference workload.

Each repetition encodes the batch, puts it into a fresh :class:`MemoryTransport`, gets
every column back and decodes it (padded); a warm-up pass runs first and is checked
bit for bit. A plain memcpy of the stored bytes runs in the same process as the bound.
Ratios compare GB/s of stored bytes.

Example::

    results = run_codec_bench(BenchConfig(workload="vlm-step", reps=5), console)
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from rlplane.codec import decode, encode
from rlplane.fields import default_registry
from rlplane.transports.memory import MemoryTransport
from rlplane.verify import diff_fields
from rlplane.workloads import WORKLOADS
from rlplane_service.timing import Phase, memcpy_phases, phase_table


@dataclass
class BenchConfig:
    workload: str = "vlm-step"
    batch: int | None = None
    seqlen: int | None = None
    reps: int = 5
    seed: int = 0


def run_codec_bench(cfg: BenchConfig, console: Console) -> dict:
    """Run the codec benchmark; print the table; return machine-readable results."""
    registry = default_registry()
    kwargs = {k: v for k, v in (("batch", cfg.batch), ("seqlen", cfg.seqlen)) if v is not None}
    with console.status(f"generating {cfg.workload}"):
        work = WORKLOADS[cfg.workload](seed=cfg.seed, **kwargs)
    ids = [f"s-{i}" for i in range(work.batch)]

    enc = encode(registry, work.fields, work.lengths)
    stored = enc.nbytes
    names = list(enc.columns)
    phases = {op: Phase(op, work.batch, stored) for op in ("encode", "put (copy in)", "get (copy out)", "decode", "round trip")}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("encode -> put -> get -> decode", total=cfg.reps + 1)
        for rep in range(cfg.reps + 1):
            warm = rep == 0
            transport = MemoryTransport()
            t0 = time.perf_counter()
            enc = encode(registry, work.fields, work.lengths)
            t1 = time.perf_counter()
            transport.put("bench", ids, enc.columns, enc.tags, create=True)
            t2 = time.perf_counter()
            columns, tags = transport.get("bench", ids, names)
            t3 = time.perf_counter()
            out = decode(registry, columns, tags, "padded")
            t4 = time.perf_counter()
            t = {"encode": t1 - t0, "put (copy in)": t2 - t1, "get (copy out)": t3 - t2, "decode": t4 - t3}
            if warm:
                problems = diff_fields(registry, work.fields, out, work.lengths)
                if problems:
                    raise RuntimeError("round trip is not bit-exact: " + "; ".join(problems))
            else:
                for op, s in t.items():
                    phases[op].seconds.append(s)
                phases["round trip"].seconds.append(sum(t.values()))
            progress.advance(task)
    warm_copy, fresh_copy = memcpy_phases(stored, cfg.reps)
    rows = list(phases.values()) + [warm_copy, fresh_copy]
    console.print(phase_table(f"codec bench: {work.name} B={work.batch}, {stored / 1e6:.1f} MB stored", rows, spread=True))

    codec = Phase("encode + decode", work.batch, stored, [e + d for e, d in zip(phases["encode"].seconds, phases["decode"].seconds)])
    ratios = {
        "encode+decode / memcpy(warm)": codec.gbps / warm_copy.gbps,
        "encode+decode / memcpy(fresh)": codec.gbps / fresh_copy.gbps,
        "round trip / memcpy(warm)": phases["round trip"].gbps / warm_copy.gbps,
        "round trip / memcpy(fresh)": phases["round trip"].gbps / fresh_copy.gbps,
    }
    console.print(f"encode + decode: {codec.gbps:.2f} GB/s (median of {cfg.reps})")
    for k, v in ratios.items():
        console.print(f"  {k}: {v:.0%}")
    return {
        "workload": work.name,
        "config": asdict(cfg),
        "batch": work.batch,
        "bytes_written": work.nbytes,
        "bytes_stored": stored,
        "phases": [p.to_dict() for p in rows + [codec]],
        "ratios": ratios,
        "machine": machine_facts(),
    }


def machine_facts() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
    }


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2))


# ---------------------------------------------------------------------------------------
# through a live service: rlplane per transport next to raw TransferQueue, same run


def run_service_bench(cfg: BenchConfig, url: str, token: str | None, console: Console) -> dict:
    """put_samples / read_columns per transport against a live service, and raw
    TransferQueue (``kv_retrieve_meta`` + ``put`` / ``get_data`` of the same encoded
    columns, no rlplane checks) against the same store, in one run. GB/s of stored bytes.

    Example::

        results = run_service_bench(BenchConfig(reps=3), "http://127.0.0.1:8000", None, console)
    """
    import rlplane

    kwargs = {k: v for k, v in (("batch", cfg.batch), ("seqlen", cfg.seqlen)) if v is not None}
    with console.status(f"generating {cfg.workload}"):
        work = WORKLOADS[cfg.workload](seed=cfg.seed, **kwargs)
    registry = default_registry()
    stored = encode(registry, work.fields, work.lengths).nbytes
    phases: list[Phase] = []
    with Progress(console=console, transient=True) as progress:
        for transport in ("tq", "http"):
            with rlplane.connect(url, token=token, transport=transport) as client:
                put = Phase(f"rlplane put_samples ({transport})", work.batch, stored)
                get = Phase(f"rlplane read_columns ({transport})", work.batch, stored)
                task = progress.add_task(f"{transport}: put -> read", total=cfg.reps + 1)
                for rep in range(cfg.reps + 1):
                    partition = f"bench-{transport}-{rep}-{os.getpid()}"
                    t0 = time.perf_counter()
                    meta = client.put_samples(partition, work.fields)
                    t1 = time.perf_counter()
                    out = client.read_columns(meta, list(work.fields))
                    t2 = time.perf_counter()
                    client.clear(partition)
                    if rep == 0:
                        problems = diff_fields(registry, work.fields, out, work.lengths)
                        if problems:
                            raise RuntimeError(f"{transport} round trip is not bit-exact: " + "; ".join(problems))
                    else:
                        put.seconds.append(t1 - t0)
                        get.seconds.append(t2 - t1)
                    progress.advance(task)
                phases += [put, get]
            if transport == "tq":
                phases += _raw_tq(url, token, work, cfg.reps, progress)
    warm_copy, fresh_copy = memcpy_phases(stored, cfg.reps)
    phases += [warm_copy, fresh_copy]
    console.print(phase_table(f"service bench: {work.name} B={work.batch}, {stored / 1e6:.1f} MB stored, {url}", phases, spread=True))
    return {
        "workload": work.name,
        "config": asdict(cfg),
        "url": url,
        "bytes_stored": stored,
        "phases": [p.to_dict() for p in phases],
        "machine": machine_facts(),
    }


def _raw_tq(url: str, token: str | None, work, reps: int, progress: Progress) -> list[Phase]:
    """TransferQueue's own client on the same store and the same encoded columns."""
    from tensordict import TensorDict

    from rlplane.http_api import ServiceAPI
    from rlplane.transports.tq import store_client

    api = ServiceAPI(url, token=token)
    try:
        info = api.json("GET", "/v1/transport")["tq"]
    finally:
        api.close()
    client = store_client(info, f"bench-raw-{os.getpid()}")
    enc = encode(default_registry(), work.fields, work.lengths)
    put = Phase("raw TransferQueue put (same columns)", work.batch, enc.nbytes)
    get = Phase("raw TransferQueue get_data", work.batch, enc.nbytes)
    task = progress.add_task("raw TransferQueue", total=reps + 1)
    try:
        for rep in range(reps + 1):
            partition = f"bench-raw-{rep}-{os.getpid()}"
            data = TensorDict({k: c.to_nested() for k, c in enc.columns.items()}, batch_size=work.batch)
            t0 = time.perf_counter()
            meta = client.kv_retrieve_meta([f"r-{i}" for i in range(work.batch)], partition, create=True)
            client.put(data, meta)
            t1 = time.perf_counter()
            client.get_data(meta)
            t2 = time.perf_counter()
            client.clear_partition(partition)
            if rep:
                put.seconds.append(t1 - t0)
                get.seconds.append(t2 - t1)
            progress.advance(task)
    finally:
        client.close()
    return [put, get]
