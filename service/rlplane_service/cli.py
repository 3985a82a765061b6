"""The ``rlplane`` command line: ``demo`` (the main job) and ``bench``.

Example::

    rlplane demo                       # one VLM GRPO step, verified bit for bit
    rlplane bench --json out/bench.json
"""

from __future__ import annotations

import os

# Large fresh buffers dominate the codec's cost; huge pages make first touch ~5x cheaper.
# Read by torch's CPU allocator once, at its first allocation: set before torch loads.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import logging  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

app = typer.Typer(
    help="rlplane: the data plane for RL post-training. Declared fields, bit-exact from rollout to trainer.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
# torch's nested-tensor constructor logs a one-off fx deprecation notice; it is not ours to act on.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


class Layout(str, Enum):
    padded = "padded"
    jagged = "jagged"


class WorkloadName(str, Enum):
    vlm_step = "vlm-step"
    text_step = "text-step"


@app.command()
def demo(
    batch: int = typer.Option(64, "--batch", "-b", min=1, help="Samples in the step (reference: 64)."),
    seqlen: int = typer.Option(2048, "--seqlen", "-s", min=4, help="Max sequence length (reference: 2048)."),
    dp_size: int = typer.Option(2, "--dp", min=1, help="Data-parallel ranks per stage."),
    text_only: bool = typer.Option(False, "--text-only", help="A text-only batch: no multimodal field may be requested."),
    layout: Layout = typer.Option(Layout.padded, help="How token fields come back."),
    seed: int = typer.Option(0, help="Seed of the generated batch."),
) -> None:
    """Run one VLM GRPO step's data flow (rollout -> logprob -> reference -> train), verified bit for bit.

    Exits 1 if any rank read anything other than what was written.
    """
    from rlplane_service.demo import DemoConfig, run_demo

    problems = run_demo(DemoConfig(batch, seqlen, dp_size, seed, text_only, layout.value), console)
    if problems:
        for line in problems:
            console.print(f"[red]MISMATCH[/] {line}")
        raise typer.Exit(1)
    console.print("[green]OK[/]: every rank read exactly what was written; train and logprob saw the same multimodal fields")


@app.command()
def bench(
    workload: WorkloadName = typer.Option(WorkloadName.vlm_step, help="Reference workload (DESIGN.md)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", min=1, help="Override the workload's batch size."),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", "-s", min=4, help="Override the workload's sequence length."),
    reps: int = typer.Option(5, min=1, help="Timed repetitions after one checked warm-up."),
    quick: bool = typer.Option(False, "--quick", help="A small batch and 3 repetitions (seconds, for smoke tests)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write machine-readable results here."),
) -> None:
    """Measure encode -> in-memory transport -> decode against memcpy of the same bytes."""
    from rlplane_service.bench import BenchConfig, run_codec_bench, write_json

    if quick:
        batch, seqlen, reps = batch or 8, seqlen or 512, min(reps, 3)
    results = run_codec_bench(BenchConfig(workload.value, batch, seqlen, reps), console)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(results, json_path)
        console.print(f"results written to {json_path}")


def main() -> None:
    """Entry point of the ``rlplane`` script."""
    app()


if __name__ == "__main__":
    main()
