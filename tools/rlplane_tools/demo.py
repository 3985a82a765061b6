"""``rlplane demo``: one whole VLM GRPO step through a live rlplane service, verified bit for bit.

A rollout worker ``put_samples`` the reference batch; the driver shards the meta for the
DP ranks (seqlen balanced); rank workers read ``fields_for_stage("logprob")`` and write
``prev_logprobs``, read ``ref_logprob`` and write ``reference_policy_logprobs``; the
driver writes ``advantages``; the ranks read ``train``. Every worker is a separate plain
Python process that knows only the service URL (and token): no Ray in them. Each rank
checks every field it read against what was written (regenerating the batch from the
seed), and the driver checks that the train and logprob passes saw the same multimodal
fields. Metas travel between processes as msgpack bytes.

Without ``--url`` the demo uses a service at the default address, or starts the
embedded one there and stops it at the end.

Example::

    problems = run_demo(DemoConfig(batch=8, seqlen=256), console)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import msgpack
import torch
from rich.console import Console

from rlplane.errors import RlplaneError, TransportError, error_from_payload, error_payload
from rlplane.meta import SampleMeta
from rlplane.packed import PackedTensor
from rlplane.testing.workloads import Workload, fields_nbytes, text_step, vlm_step
from rlplane_tools.timing import Phase, phase_table

ROLLOUT_FIELDS = (
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "generation_logprobs",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
)
MULTIMODAL = ("mm_token_type_ids", "pixel_values", "image_grid_thw")
STAGE_OUTPUT = {"logprob": "prev_logprobs", "ref_logprob": "reference_policy_logprobs"}
_WORKER_TIMEOUT_S = 600.0


@dataclass
class DemoConfig:
    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    transport: str = "auto"
    batch: int = 64
    seqlen: int = 2048
    dp_size: int = 2
    seed: int = 0
    text_only: bool = False
    layout: str = "padded"
    start_embedded: bool = True
    backend: str | None = None  # of the embedded service, when one is started (None: RLPLANE_BACKEND or native)


def make_workload(cfg: DemoConfig) -> Workload:
    make = text_step if cfg.text_only else vlm_step
    return make(batch=cfg.batch, seqlen=cfg.seqlen, seed=cfg.seed)


def stage_output(field: str, meta: SampleMeta) -> torch.Tensor:
    """Stand-in for a model pass: per-sample deterministic values, zero past each length.

    Every process computes the same bits for the same sample, so a reader can check
    what a writer wrote without the bytes travelling twice.
    """
    width = meta.pad_to_seqlen or max(meta.lengths, default=0)
    idx = torch.tensor([_index(s) for s in meta.sample_ids], dtype=torch.float32)
    salt = 1.0 + sum(map(ord, field)) % 7
    pos = torch.arange(width, dtype=torch.float32)
    out = -(idx[:, None] * 1e-3 + pos[None, :] * 1e-4 + salt * 1e-2)
    return out * (pos[None, :] < torch.tensor(meta.lengths)[:, None])


def _index(sample_id: str) -> int:
    return int(sample_id.rsplit("-", 1)[1])


def _rows(fields: dict, idx: list[int]) -> dict:
    out = {}
    for k, v in fields.items():
        if isinstance(v, PackedTensor):
            out[k] = v.select(idx)
        elif isinstance(v, torch.Tensor):
            out[k] = v[idx]
        else:
            out[k] = [v[i] for i in idx]
    return out


# ---------------------------------------------------------------------------------------
# the worker process: a plain Python process with a URL, a token and nothing else


def _worker(conn: Any, cfg_dict: dict) -> None:
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import rlplane
    from rlplane.testing.verify import diff_fields

    cfg = DemoConfig(**cfg_dict)
    # The ranks run side by side: each gets its share of the cores, as a rank on its own
    # GPU host would have its own (torch's default, every core per process, oversubscribes).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, cfg.dp_size)))
    client = None
    work: Workload | None = None
    while True:
        msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
        if msg["op"] == "exit":
            break
        try:
            if client is None:
                client = rlplane.connect(cfg.url, token=cfg.token, transport=cfg.transport)
            if work is None:
                work = make_workload(cfg)
            written = {k: v for k, v in work.fields.items() if k in ROLLOUT_FIELDS}
            if msg["op"] == "put":
                ids = [f"s-{i}" for i in range(cfg.batch)]
                t0 = time.perf_counter()
                meta = client.put_samples(msg["partition"], written, sample_ids=ids)
                reply = {"meta": meta.to_dict(), "s": time.perf_counter() - t0, "bytes": fields_nbytes(written),
                         "transport": client.transport.name}
            else:  # a stage on one shard
                meta = SampleMeta.from_dict(msg["meta"])
                stage = msg["stage"]
                names = client.fields_for_stage(stage, meta)
                t0 = time.perf_counter()
                got = client.read_columns(meta, stage=stage, layout=cfg.layout)
                read_s = time.perf_counter() - t0
                idx = [_index(s) for s in meta.sample_ids]
                want = _rows({**written, "advantages": work.fields["advantages"]}, idx)
                for name in STAGE_OUTPUT.values():
                    want[name] = stage_output(name, meta)
                problems = diff_fields(
                    client.registry, {k: want[k] for k in got if k in want}, got, meta.lengths, sample_ids=meta.sample_ids
                )
                unchecked = [k for k in got if k not in want]
                problems += [f"field {k!r}: read but the demo does not know what was written" for k in unchecked]
                read_bytes, multimodal = fields_nbytes(got), sorted(k for k in MULTIMODAL if k in got)
                got = want = None  # a rank lets go of the batch it is done with: its next read reuses the memory
                paths = sorted(set(client.transport.paths().values())) or [client.transport.name]
                reply = {"fields": names, "read_s": read_s, "read_bytes": read_bytes, "problems": problems,
                         "path": "+".join(paths),
                         "multimodal": multimodal}
                out_field = msg.get("write")
                if out_field:
                    out = {out_field: stage_output(out_field, meta)}
                    t0 = time.perf_counter()
                    meta = client.write_columns(meta, out)
                    reply.update(write_s=time.perf_counter() - t0, write_bytes=fields_nbytes(out))
                reply["meta"] = meta.to_dict()
        except RlplaneError as err:  # (the driver raises it again, typed: the CLI says it in a line)
            reply = {"error": f"{type(err).__name__}: {err}", "typed": error_payload(err)}
        except Exception as err:  # noqa: BLE001 - report any failure to the driver, whole
            reply = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"}
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
    if client is not None:
        client.close()


class _Workers:
    """Worker processes started by the demo and ended by it (by their own handles)."""

    def __init__(self, names: list[str], cfg: DemoConfig) -> None:
        # Clean processes (no threads, sockets or Ray of this one) forked from a server that
        # imported torch and rlplane once, not each its own (~2-3 s of CPU a worker), and
        # loaded rlplane's compiled row copies (~0.4 s a worker, else paid in its first read)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "rlplane_tools.preloaded"])
        self.procs = {}
        self.conns = {}
        for name in names:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(there, asdict(cfg)), name=f"rlplane-demo-{name}", daemon=True)
            proc.start()
            self.procs[name], self.conns[name] = proc, here

    def ask(self, requests: dict[str, dict]) -> dict[str, dict]:
        """Send each named worker its request, then collect every reply (they run concurrently)."""
        for name, req in requests.items():
            self.conns[name].send_bytes(msgpack.packb(req, use_bin_type=True))
        replies = {}
        for name in requests:
            if not self.conns[name].poll(_WORKER_TIMEOUT_S):
                raise TransportError(f"demo worker {name} did not answer within {_WORKER_TIMEOUT_S:.0f} s")
            reply = msgpack.unpackb(self.conns[name].recv_bytes(), raw=False)
            if isinstance(reply.get("typed"), dict):
                typed = reply["typed"]
                raise error_from_payload({**typed, "message": f"demo worker {name}: {typed.get('message')}"})
            if "error" in reply:
                raise RuntimeError(f"demo worker {name} failed: {reply['error']}")
            replies[name] = reply
        return replies

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send_bytes(msgpack.packb({"op": "exit"}))
            except (OSError, ValueError):
                pass
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


# ---------------------------------------------------------------------------------------
# the driver


def run_demo(cfg: DemoConfig, console: Console) -> list[str]:
    """Run the step; print progress and the per-phase table; return every problem found."""
    ranks = [f"rank{r}" for r in range(cfg.dp_size)]
    workers = _Workers(["rollout", *ranks], cfg)  # they import torch while the service starts
    try:
        with live_service(cfg.url, start_embedded=cfg.start_embedded, backend=cfg.backend, console=console):
            return _step(cfg, workers, ranks, console)
    finally:
        workers.close()


def clear_partitions(url: str, token: str | None, partitions: list[str], console: Console) -> None:
    """A run's ``partitions`` cleared at its end, an interrupted one's too (a store that does
    not answer is said, not raised: the run's own outcome is what the caller reports).

    Example: ``clear_partitions(url, None, ["soak-1a2b-w0"], console)``
    """
    import rlplane

    try:
        with rlplane.connect(url, token=token, transport="http") as c:
            for p in partitions:
                c.clear(p)
    except RlplaneError as err:
        console.print(f"[yellow]partition(s) {', '.join(partitions)} not cleared[/]: {err}")


@contextmanager
def live_service(url: str, *, start_embedded: bool, backend: str | None, console: Console) -> Iterator[None]:
    """The service at ``url``; when none answers there, the embedded one started there
    (and stopped on exit), or TransportError when ``start_embedded`` is False."""
    from rlplane_service.embedded import EmbeddedService, _answers
    from rlplane_service.quiet import stages
    from rlplane_service.settings import ServiceSettings

    if _answers(url):
        yield
        return
    if not start_embedded:
        raise TransportError(f"no rlplane service answers at {url}; start one with `rlplane serve`")
    host, port = _host_port(url)
    settings = ServiceSettings(host=host, port=port, **({"backend": backend} if backend else {}))
    with stages(console, "starting the embedded service") as say:
        embedded = EmbeddedService(settings, say=say)
        embedded.start()
    try:
        yield
    finally:
        console.print("[dim]stopping the embedded service[/]")
        embedded.stop()


def _step(cfg: DemoConfig, workers: _Workers, ranks: list[str], console: Console) -> list[str]:
    import rlplane

    partition = f"demo-{uuid.uuid4().hex[:8]}"
    with console.status("generating the reference batch"):
        work = make_workload(cfg)
    phases: list[Phase] = []
    problems: list[str] = []
    seen_mm: dict[str, set[str]] = {}
    read_counts: list[tuple[list[str], int]] = []

    def phase(op: str, samples: int, nbytes: int, seconds: float) -> None:
        phases.append(Phase(op, samples, nbytes, [seconds]))

    driver = rlplane.connect(cfg.url, token=cfg.token, transport=cfg.transport)
    try:
        console.print(f"[cyan]rollout[/] worker: put_samples into partition {partition}")
        put = workers.ask({"rollout": {"op": "put", "partition": partition}})["rollout"]
        console.print(
            f"[bold]{work.name}[/]: B={cfg.batch} S={cfg.seqlen}, {put['bytes'] / 1e6:.1f} MB as written, "
            f"{cfg.dp_size} DP ranks, transport={put['transport']}, layout={cfg.layout}, service {cfg.url}"
        )
        phase("rollout put_samples", cfg.batch, put["bytes"], put["s"])
        shards = SampleMeta.from_dict(put["meta"]).shard(cfg.dp_size, balance="seqlen")
        console.print(f"sharded for {cfg.dp_size} ranks: tokens per rank {[sum(s.lengths) for s in shards]}")

        def stage(name: str, write: str | None) -> None:
            nonlocal shards
            replies = workers.ask(
                {r: {"op": "stage", "stage": name, "meta": s.to_dict(), "write": write} for r, s in zip(ranks, shards)}
            )
            for i, (r, shard) in enumerate(zip(ranks, shards)):
                rep = replies[r]
                gbps = rep["read_bytes"] / rep["read_s"] / 1e9 if rep["read_s"] else float("inf")
                console.print(f"[cyan]{name}[/] rank {i}: read {rep['fields']} ({rep['read_bytes'] / 1e6:.1f} MB at "
                              f"{gbps:.2f} GB/s, data path {rep['path']})")
                read_counts.append((rep["fields"], len(shard)))
                phase(f"{name} read (rank {i})", len(shard), rep["read_bytes"], rep["read_s"])
                if write:
                    phase(f"{name} write {write} (rank {i})", len(shard), rep["write_bytes"], rep["write_s"])
                problems.extend(f"{name} rank {i}: {line}" for line in rep["problems"])
                seen_mm.setdefault(name, set()).update(rep["multimodal"])
                if cfg.text_only and rep["multimodal"]:
                    problems.append(f"{name} rank {i}: requested multimodal fields {rep['multimodal']} for a text-only batch")
            shards = [SampleMeta.from_dict(replies[r]["meta"]) for r in ranks]

        for name, out in STAGE_OUTPUT.items():
            stage(name, out)

        console.print("[cyan]driver[/] write advantages")
        full = SampleMeta.concat(*shards)
        adv = {"advantages": work.fields["advantages"][[_index(s) for s in full.sample_ids]]}
        t0 = time.perf_counter()
        full = driver.write_columns(full, adv)
        phase("driver write advantages", cfg.batch, fields_nbytes(adv), time.perf_counter() - t0)
        shards = full.shard(cfg.dp_size, balance="seqlen")
        stage("train", None)

        for name in ("ref_logprob", "train"):
            if seen_mm.get(name) != seen_mm.get("logprob"):
                problems.append(
                    f"{name} saw multimodal fields {sorted(seen_mm.get(name, ()))} but logprob saw "
                    f"{sorted(seen_mm.get('logprob', ()))}"
                )
        console.print(phase_table(f"rlplane demo: one GRPO step (transport {put['transport']})", phases))
        checked = sum(len(rep_fields) * n for rep_fields, n in read_counts)
        console.print(f"verified bit for bit: {checked} (sample, field) reads by {cfg.dp_size} ranks over 3 stages, "
                      f"{sum(p.nbytes for p in phases) / 1e6:.1f} MB moved in "
                      f"{sum(sum(p.seconds) for p in phases) * 1e3:.0f} ms of transfers")
    finally:
        try:
            driver.clear(partition)
        finally:
            driver.close()
    return problems


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 8000
