"""Phase timing shared by the demo and the benchmarks: ms, MB and GB/s per operation."""

from __future__ import annotations

import mmap
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from rich.table import Table


@dataclass
class Phase:
    """One measured operation (possibly repeated)."""

    op: str
    samples: int
    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9 if self.median_s > 0 else float("inf")

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "samples": self.samples,
            "bytes": self.nbytes,
            "median_ms": self.median_s * 1e3,
            "min_ms": min(self.seconds) * 1e3,
            "max_ms": max(self.seconds) * 1e3,
            "reps": len(self.seconds),
            "gb_per_s": self.gbps,
        }


@contextmanager
def timed(phase: Phase) -> Iterator[Phase]:
    """Append the wall time of the ``with`` body to ``phase.seconds``."""
    t0 = time.perf_counter()
    yield phase
    phase.seconds.append(time.perf_counter() - t0)


def memcpy_phases(nbytes: int, reps: int) -> tuple[Phase, Phase]:
    """Plain copies of ``nbytes``: into a warm buffer (the bound) and into a fresh one (a
    new anonymous mapping each time, whose pages the copy touches first: an allocation
    of the same size would hand back the memory the last one freed, warm, below glibc's
    mmap threshold of up to 32 MB)."""
    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    warm = Phase("memcpy (warm dst)", 0, nbytes)
    fresh = Phase("memcpy (fresh dst)", 0, nbytes)
    for _ in range(reps):
        with timed(warm):
            dst.copy_(src)
        with mmap.mmap(-1, src.numel()) as mm:
            with timed(fresh):
                into = torch.frombuffer(mm, dtype=torch.uint8)
                into.copy_(src)
            del into
    return warm, fresh


def phase_table(title: str, phases: list[Phase], *, spread: bool = False) -> Table:
    """A rich table: op, samples, MB, ms (median, and min/max when ``spread``), GB/s."""
    table = Table(title=title)
    for col in ("op", "samples", "MB", "ms"):
        table.add_column(col, justify="left" if col == "op" else "right")
    if spread:
        table.add_column("min..max ms", justify="right")
    table.add_column("GB/s", justify="right")
    for p in phases:
        row = [p.op, str(p.samples or ""), f"{p.nbytes / 1e6:.1f}", f"{p.median_s * 1e3:.1f}"]
        if spread:
            row.append(f"{min(p.seconds) * 1e3:.1f}..{max(p.seconds) * 1e3:.1f}")
        row.append(f"{p.gbps:.2f}")
        table.add_row(*row)
    return table

