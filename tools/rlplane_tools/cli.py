"""The ``rlplane`` script: the service's commands (``serve``, ``status``, from
:mod:`rlplane_service.cli`) plus the tools' ``demo`` (the main job), ``bench`` and ``soak``.

The tools register their commands here, on the service's Typer app, so the service never
imports the tools (they are left out of production images that do not need them).

Example::

    rlplane demo                       # one VLM GRPO step through the service, verified bit for bit
    rlplane bench --quick --json out/bench.json --plot out/bench.png
    rlplane soak --minutes 10
"""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from rlplane_service.cli import TOKEN_OPTION, URL_OPTION, Backend, app, console, main as service_main
from rlplane_service.quiet import captured_output


class Layout(str, Enum):
    padded = "padded"
    jagged = "jagged"


class WorkloadName(str, Enum):
    vlm_step = "vlm-step"
    vlm_grpo = "vlm-grpo"
    vlm_grpo_same = "vlm-grpo-same"
    text_step = "text-step"
    small = "small"
    text_scale = "text-scale"
    dp_shard = "dp-shard"
    claim = "claim"
    controller = "controller"


class TransportName(str, Enum):
    auto = "auto"
    direct = "direct"
    native = "native"
    tq = "tq"
    http = "http"


@app.command()
def demo(
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    transport: TransportName = typer.Option(TransportName.auto, help="Data path: straight to the store (direct: native or tq, whichever the service offers), HTTP, or auto."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", min=1, help="Samples in the step (default: the reference "
                                        "64); with --async, rollout batches of 16 samples (default 8)."),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", "-s", min=4, help="Max sequence length (default: the "
                                         "reference 2048; with --async 256)."),
    dp_size: int = typer.Option(2, "--dp", min=1, help="Data-parallel ranks per stage."),
    text_only: bool = typer.Option(False, "--text-only", help="A text-only batch: no multimodal field may be requested."),
    layout: Layout = typer.Option(Layout.padded, help="How token fields come back."),
    seed: int = typer.Option(0, help="Seed of the generated batch."),
    embedded: bool = typer.Option(True, "--embedded/--no-embedded", help="Start the embedded service when none answers at --url."),
    backend: Optional[Backend] = typer.Option(
        None, help="Storage backend of the embedded service, when one is started (default: RLPLANE_BACKEND or native).",
        show_default=False,
    ),
    async_: bool = typer.Option(
        False, "--async", help="Asynchronous GRPO instead: a rollout process keeps producing VLM groups (a group's "
        "members share its images, stored once; each batch is written partway, then extended and finished) while a "
        "logprob worker and two train workers claim them as they become ready (the trainers by token budget, whole "
        "groups; one is killed mid-lease); checks every sample was consumed exactly once per task and prints the "
        "bytes written against those stored. --batch/--seqlen set its batch count and length.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's, Serve's, Mooncake's and torch's own "
                                 "output live instead of in the log file."),
) -> None:
    """Run one VLM GRPO step through a live service (rollout -> logprob -> reference -> train), verified bit for bit.

    Uses the service at --url, or starts the embedded one there (and stops it after).
    Exits 1 if any rank read anything other than what was written. With --async, the
    streaming pipeline instead (claim / ack / lease redelivery), checked for exactly-once.
    """
    from rlplane.errors import RlplaneError
    from rlplane_tools.demo import DemoConfig, run_demo

    if async_:
        ignored = [flag for flag, given in (("--dp", dp_size != 2), ("--text-only", text_only),
                                            ("--layout", layout != Layout.padded), ("--seed", seed != 0)) if given]
        if ignored:
            console.print(f"[red]error[/]: {', '.join(ignored)} set the synchronous demo's step; --async runs its own "
                          "pipeline (--batch and --seqlen set its batches and their length)")
            raise typer.Exit(2)
        with captured_output(console, "demo", verbose=verbose):
            _async_demo(url, token, transport.value, embedded, backend.value if backend else None,
                        batches=batch or 8, seqlen=seqlen or 256)
        return
    samples = batch or 64
    if dp_size > samples:
        console.print(f"[red]error[/]: --dp {dp_size} ranks for a batch of {samples} samples: a rank would read none; "
                      f"use at most --dp {samples}")
        raise typer.Exit(2)
    cfg = DemoConfig(url, token, transport.value, samples, seqlen or 2048, dp_size, seed, text_only, layout.value,
                     embedded, backend.value if backend else None)
    try:
        with captured_output(console, "demo", verbose=verbose):
            problems = run_demo(cfg, console)
    except RlplaneError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(1)
    if problems:
        for line in problems:
            console.print(f"[red]MISMATCH[/] {line}")
        raise typer.Exit(1)
    console.print("[green]OK[/]: every rank read exactly what was written; train and logprob saw the same multimodal fields")


def _async_demo(url: str, token: str | None, transport: str, embedded: bool, backend: str | None, *, batches: int,
                seqlen: int) -> None:
    from rlplane.errors import RlplaneError
    from rlplane_tools.demo import live_service
    from rlplane_tools.demo_async import AsyncDemoConfig, run_async_demo

    cfg = AsyncDemoConfig(url=url, token=token, transport=transport, batches=batches, seqlen=seqlen)
    try:
        with live_service(url, start_embedded=embedded, backend=backend, console=console):
            problems = run_async_demo(cfg, console)
    except RlplaneError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(1)
    if problems:
        for line in problems:
            console.print(f"[red]VIOLATION[/] {line}")
        raise typer.Exit(1)
    console.print("[green]OK[/]: every sample was consumed exactly once per task (stale ones expired and counted), "
                  "and the killed trainer's samples were redelivered")


@app.command()
def bench(
    workloads: Optional[list[WorkloadName]] = typer.Option(
        None, "--workload", "-w", help="Workload(s) to run (repeat the flag); default: all, and the sweeps "
        "(vlm-grpo: the vlm-step batch as 8 groups of 8 sharing each group's images, native against raw TransferQueue, DataProto and the Ray object store, which store every copy, and the bytes native stored; vlm-grpo-same: the same with each group's very image tensors, native against raw TransferQueue; text-scale is the sweep over B at S=1024; dp-shard: a DP rank reads every other vlm-step sample's input_ids + pixel_values, through every path that can select rows; claim is the streaming section: claim latency, wake-up, 4 claimers; controller: B=1 puts, claim+ack and one-sample reads per second from 8 processes)."
    ),
    paths: Optional[list[str]] = typer.Option(
        None, "--path", "-p", help="Path(s) to run (repeat): rlplane-native (shm), rlplane-native-apart (shm, the vlm-grpo "
        "batch written one put per sample: rows shared across puts; vlm-grpo only), rlplane-native-te (the transfer engine), "
        "rlplane-native-zmq, rlplane-tq, rlplane-http, rlplane-mooncake, raw-tq, "
        "mooncake-dataproto (Mooncake's structured DataProto store; the bench starts its mooncake_master), ray-object-store, legacy-pickle."
    ),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", min=1, help="Batch size of vlm-step / text-step (default: theirs)."),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", "-s", min=4, help="Sequence length of every workload (default: theirs)."),
    reps: Optional[int] = typer.Option(None, min=1, help="Timed repetitions after one checked warm-up (default 5)."),
    ops: Optional[int] = typer.Option(None, min=2, help="Operations per path for the small-batch latency (default 200)."),
    scale_batches: Optional[list[int]] = typer.Option(
        None, "--scale-batch", min=1, help="Batch sizes of the text-scale sweep (repeat) (default 64 256 1024 4096 8192)."
    ),
    sweep_batches: Optional[list[int]] = typer.Option(
        None, "--sweep-batch", min=1, help="Batch sizes of the vlm-step sweep (repeat) (default 16 64 256)."
    ),
    writers: Optional[list[int]] = typer.Option(
        None, "--writers", min=1, help="Concurrent writer counts (repeat) (default 1 2 4)."
    ),
    sweeps: bool = typer.Option(True, "--sweeps/--no-sweeps", help="Run the batch, writers and text-scale sweeps "
                                "(an explicit --scale-batch still runs its sweep)."),
    quick: bool = typer.Option(
        False, "--quick", help="Every path, workload and sweep on small batches, 3 reps, 50 ops (under 2 minutes on 2 cores)."
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write machine-readable results here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart of GB/s per path and of the sweeps."),
    url: Optional[str] = typer.Option(
        None, "--url", help="Bench this running service (default: start the embedded one on a free port, stop it after)."
    ),
    token: Optional[str] = TOKEN_OPTION,
    mooncake_url: Optional[str] = typer.Option(
        None, "--mooncake-url", help="With --url: an rlplane app on the Mooncake backend for the rlplane-mooncake row "
        "(same token). Embedded runs deploy one themselves.",
    ),
    tq_url: Optional[str] = typer.Option(
        None, "--tq-url", help="With --url: an rlplane app on the TransferQueue backend (simple) for the rlplane-tq and "
        "raw-tq rows (same token; default: --url itself when it publishes one). Embedded runs deploy one themselves.",
    ),
    codec: bool = typer.Option(False, "--codec", help="Only the codec: encode -> in-memory transport -> decode vs memcpy, no service."),
    ledger: bool = typer.Option(False, "--ledger", help="Only the claim engine: p50 of claims by batch, groups, tokens "
                                "and tokens in groups over a backlog of pending samples, no service."),
    backlogs: Optional[list[int]] = typer.Option(None, "--backlog", min=64, help="With --ledger: pending samples "
                                                 "(repeat) (default 6400 102400)."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Only the controller's rebuild: fill a native engine with "
                                 "text-step samples and 64 vlm-step puts, restart the controller, time the rebuild of "
                                 "its index from the units (targets: 1M samples <= 10 s, 64 vlm-step puts <= 2 s)."),
    samples: int = typer.Option(1 << 20, "--samples", min=4096, help="With --rebuild: text-step samples to store "
                                "(in puts of 4096)."),
    durability: bool = typer.Option(False, "--durability", help="Only snapshots: fill a native engine with --gib of "
                                    "vlm-step, snapshot it while another process puts, restore it into 3 units; "
                                    "against this disk's sequential write / read in the same run (targets: >= 0.7x "
                                    "each; put p99 during the snapshot <= 2x without); then the journal: durable "
                                    "text-step puts against plain ones (<= 1.5x), vlm-step durable puts against the "
                                    "disk's write."),
    gib: float = typer.Option(1.0, "--gib", min=0.01, help="With --durability: GiB to store and snapshot."),
    snapshot_dir: Optional[Path] = typer.Option(None, "--dir", help="With --durability: the disk to snapshot to "
                                                "(default: the temporary directory)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's, Serve's, Mooncake's and torch's own "
                                 "output live instead of in the log file."),
) -> None:
    """Move the same batch writer process -> reader process through every path and compare.

    Paths: rlplane on its native engine over shared memory (the default), ZMQ and the
    transfer engine (te), on TransferQueue (tq), over HTTP and on Mooncake (put_samples /
    read_columns, encode, checksums and decode included); raw TransferQueue on the same
    store and bytes; Mooncake's DataProto store; the Ray object store (ray.put / ray.get);
    the legacy object array pickled through a Ray actor call; memcpy of the same bytes as
    the bound.

    Workloads: vlm-step (DESIGN.md), vlm-grpo, text-step, small (latency p50/p99),
    text-scale (µs per sample as B grows), dp-shard, claim (streaming) and controller
    (operations per second); sweeps of vlm-step batch sizes and concurrent writers (every
    sample checked after). Reports median and min..max ms, GB/s of stored bytes, the ratio
    to raw TransferQueue and whether each target is met. Every move is checked bit for bit
    (off the clock): an rlplane path's mismatch fails the run (exit 1), a peer's leaves
    that peer out of the section and the report says why. --codec, --ledger, --rebuild and
    --durability each run one section of their own instead.

    Examples: rlplane bench --quick --plot out/bench.png

    rlplane bench --url http://127.0.0.1:8000 --workload vlm-step --no-sweeps --json out/bench.json

    rlplane bench --durability --gib 1 --dir /mnt/snapshots
    """
    from rlplane.errors import RlplaneError
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        console.print("[red]error[/]: --plot draws with matplotlib, which this install lacks: "
                      "pip install 'rlplane[bench]' (or drop --plot)")
        raise typer.Exit(1)
    from rlplane_tools.bench.report import write_json

    if durability:
        from rlplane_tools.bench.durability import DurabilityBenchConfig, run_durability_bench

        results = run_durability_bench(DurabilityBenchConfig(gib=min(gib, 0.25) if quick else gib,
                                                             dir=str(snapshot_dir) if snapshot_dir else None,
                                                             put_seconds=2.0 if quick else 4.0), console)
    elif rebuild:
        from rlplane_tools.bench.rebuild import RebuildBenchConfig, run_rebuild_bench

        results = run_rebuild_bench(RebuildBenchConfig(text_samples=min(samples, 65536) if quick else samples,
                                                       vlm_puts=8 if quick else 64), console)
    elif ledger:
        from rlplane_tools.bench.ledger import LedgerBenchConfig, run_ledger_bench

        lcfg = LedgerBenchConfig(claims=min(ops or 60, 20) if quick else ops or 60)
        if backlogs:
            lcfg.backlogs = tuple(backlogs)
        results = run_ledger_bench(lcfg, console)
    elif codec:
        from rlplane_tools.bench.codec import CodecConfig, run_codec_bench

        from rlplane.testing.workloads import WORKLOADS

        asked = [w.value for w in workloads or [WorkloadName.vlm_step]]
        if len(asked) > 1 or asked[0] not in WORKLOADS:
            console.print(f"[red]error[/]: --codec encodes one batch workload: one of {', '.join(WORKLOADS)} "
                          f"(got {', '.join(asked)})")
            raise typer.Exit(2)
        one = asked[0]
        if quick:
            batch, seqlen, reps = batch or 8, seqlen or 512, min(reps or 3, 3)
        results = run_codec_bench(CodecConfig(one, batch, seqlen, reps or 5), console)
    else:
        from rlplane_tools.bench.run import BenchConfig, quick_config, run_bench

        given = {k: v for k, v in (("batch", batch), ("seqlen", seqlen), ("reps", reps), ("ops", ops),
                                   ("sweep_batches", sweep_batches), ("scale_batches", scale_batches)) if v is not None}
        cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
        if workloads:
            cfg.workloads = tuple(w.value for w in workloads)
        if paths:
            cfg.paths = tuple(paths)
        if writers:
            cfg.writers = tuple(writers)
        if not sweeps:
            cfg.sweep_batches, cfg.writers = (), ()
            if "scale_batches" not in given:
                cfg.scale_batches = ()
        if quick:
            cfg = quick_config(cfg, set(given) | ({"sweep_batches", "scale_batches"} if not sweeps else set()))
        try:
            with captured_output(console, "bench", verbose=verbose):
                results = run_bench(cfg, console, url=url, token=token, mooncake_url=mooncake_url, tq_url=tq_url)
        except RlplaneError as err:
            console.print(f"[red]error[/]: {err}")
            raise typer.Exit(1)
    if json_path is not None:  # first: a chart that fails must not cost the numbers
        write_json(results, json_path)
        console.print(f"results written to {json_path}")
    if plot_path is not None and not (codec or ledger or rebuild or durability):
        from rlplane_tools.bench.plot import write_plot

        write_plot(results, plot_path)
        console.print(f"chart written to {plot_path}")


@app.command("two-node")
def two_node(
    paths: Optional[list[str]] = typer.Option(None, "--path", "-p", help="Data path(s) the client is forced onto "
                                              "(repeat): te, zmq (default: both)."),
    batch: int = typer.Option(16, "--batch", "-b", min=1, help="vlm-step samples per put."),
    seqlen: int = typer.Option(2048, "--seqlen", "-s", min=4, help="vlm-step max sequence length."),
    reps: int = typer.Option(3, min=1, help="Puts and reads per path (each checked bit for bit)."),
    units: int = typer.Option(2, min=1, max=8, help="Storage units (each storage node may take them all)."),
    storage_nodes: int = typer.Option(1, "--storage-nodes", min=1, max=4, help="Nodes offering the storage resource "
                                      "(127.0.0.2, then .4, .5, .6): the units must spread over them."),
    replicas: int = typer.Option(1, min=1, max=8, help="Copies of every block (RLPLANE_REPLICAS; at most --units)."),
    unit_bytes: int = typer.Option(512 << 20, min=16 << 20, help="Each unit's slab."),
    keep: bool = typer.Option(False, "--keep", help="After the check, keep the cluster and service up until Ctrl-C "
                              "(e.g. for rlplane bench --url URL -p rlplane-native-te)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
) -> None:
    """Two Ray nodes on this machine's loopback (head 127.0.0.3, storage units on 127.0.0.2
    with their transfer engines over TCP; --storage-nodes 2 adds 127.0.0.4), the rlplane
    app deployed on them, and the vlm-step batch moved through each data path from a
    client on the head, checked bit for bit. Exit 1 on any difference, or when the units
    did not spread over the storage nodes. Every node is ended by pid on the way out.

    Example: rlplane two-node --path te --storage-nodes 2 --replicas 2 --json out/two-node.json
    """
    from rlplane_service.net import free_port
    from rlplane_service.settings import ServiceSettings
    from rlplane.errors import RlplaneError
    from rlplane_tools.loopback import ClusterError, LoopbackCluster, check

    chosen = paths or ["te", "zmq"]
    bad = [p for p in chosen if p not in ("te", "zmq")]
    if bad:  # (the client is on the head, the units elsewhere: shm cannot map them, and auto checks nothing)
        console.print(f"[red]error[/]: unknown data path(s) {bad} for the two-node check: it forces the client onto "
                      "te or zmq")
        raise typer.Exit(2)
    say = lambda msg: console.print(f"[dim]{msg}[/]")  # noqa: E731
    if replicas > units:
        console.print(f"[red]error[/]: --replicas {replicas} needs as many units (--units {units})")
        raise typer.Exit(2)
    cluster = LoopbackCluster(units=units, storage_nodes=storage_nodes, say=say)
    try:
        with captured_output(console, "two-node", verbose=False):
            try:
                cluster.start()
                settings = ServiceSettings(port=free_port(), storage_units=units, unit_bytes=unit_bytes,
                                           replicas=replicas, te_protocol="tcp",
                                           storage_resource=cluster.storage_resource)
                url = cluster.deploy(settings)
                results = check(url, chosen, batch=batch, seqlen=seqlen, node_ip=cluster.node_ip, reps=reps,
                                node_ips=cluster.node_ips, say=say)
                results.update(url=url, head_ip=cluster.head_ip, pids=cluster.pids())
                if json_path is not None:
                    json_path.parent.mkdir(parents=True, exist_ok=True)
                    json_path.write_text(json.dumps(results, indent=2))
                    console.print(f"results written to {json_path}")
                for problem in results["problems"][:20]:
                    console.print(f"[red]{problem}[/]")
                if keep:
                    console.print(f"rlplane is up at {url} (units on {', '.join(cluster.node_ips)}); Ctrl-C stops it")
                    # Ctrl-C and SIGTERM stop it, even where this process was started with SIGINT
                    # ignored (a background job of a non-interactive shell, as some CI runners are).
                    signal.signal(signal.SIGINT, _interrupted)
                    signal.signal(signal.SIGTERM, _interrupted)
                    try:
                        while True:
                            time.sleep(1)
                    except KeyboardInterrupt:
                        pass
            finally:
                say("stopping the cluster")
                cluster.stop()
    except (ClusterError, RlplaneError) as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(1)
    if results["problems"]:
        raise typer.Exit(1)
    console.print(f"[green]every read bit-exact[/] on {', '.join(chosen)}")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command()
def soak(
    minutes: float = typer.Option(10.0, min=0.05, help="How long the writers write (the readers read 5 s longer)."),
    writers: int = typer.Option(8, min=1, max=64, help="Writer processes (put_samples of text-step batches)."),
    readers: int = typer.Option(4, min=1, max=64, help="Reader processes (claim, read, check bit for bit, ack)."),
    batch: int = typer.Option(8, min=1, help="Samples per put."),
    seqlen: int = typer.Option(256, min=4, help="Sequence length."),
    kill: bool = typer.Option(True, "--kill/--no-kill", help="At half time kill storage unit 1, the Serve replica "
                              "and (SIGKILL) the controller's process (embedded service only; it runs with "
                              "replicas=2, and the controller rebuilds its index, so nothing may be lost)."),
    url: Optional[str] = typer.Option(None, "--url", help="Soak this running service (default: start the embedded one "
                                      "with 3 storage units and replicas=2; stop it after)."),
    token: Optional[str] = TOKEN_OPTION,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's and Serve's own logs here."),
) -> None:
    """Writers and readers for minutes, a unit, the replica and the controller killed midway, every byte checked.

    Exits 1 on a wrong byte, a lost acknowledged write, an untyped error, or a run in which
    no put (or no read) succeeded. Example:

    rlplane soak --minutes 10 --json out/soak.json
    """
    from rlplane.errors import RlplaneError
    from rlplane.http_api import ServiceAPI
    from rlplane_tools.soak import SoakConfig, run_soak

    cfg = SoakConfig(minutes=minutes, writers=writers, readers=readers, batch=batch, seqlen=seqlen, kill=kill)
    try:
        if url is not None:  # (answers, and takes the token: said here, not by a worker process's traceback)
            api = ServiceAPI(url, token=token, timeout=10)
            try:
                api.json("GET", "/v1/registry")
            finally:
                api.close()
        with captured_output(console, "soak", verbose=verbose):
            report = run_soak(cfg, console, url=url, token=token)
    except RlplaneError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(1)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
        console.print(f"report written to {json_path}")
    raise typer.Exit(1 if report["violations"] else 0)


def main() -> None:
    """Entry point of the ``rlplane`` script: the service's commands and these."""
    service_main()


if __name__ == "__main__":
    main()
