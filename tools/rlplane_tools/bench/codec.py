"""``rlplane bench --codec``: encode -> in-memory transport -> decode of a reference workload.

Each repetition encodes the batch, puts it into a fresh :class:`MemoryTransport`, gets
every column back and decodes it (padded); a warm-up pass runs first and is checked
bit for bit. A plain memcpy of the stored bytes runs in the same process as the bound.
Ratios compare GB/s of stored bytes.

Example::

    results = run_codec_bench(CodecConfig(workload="vlm-step", reps=5), console)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.progress import Progress
from rlplane.codec import decode, encode
from rlplane.fields import default_registry
from rlplane.transports.memory import MemoryTransport
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import WORKLOADS

from rlplane_tools.bench.report import machine_facts
from rlplane_tools.timing import Phase, memcpy_phases, phase_table


@dataclass
class CodecConfig:
    workload: str = "vlm-step"
    batch: int | None = None
    seqlen: int | None = None
    reps: int = 5
    seed: int = 0


def run_codec_bench(cfg: CodecConfig, console: Console) -> dict:
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
