"""``rlplane demo --async``: asynchronous GRPO through streaming claims, checked for exactly-once.

Four plain Python processes that know only the service URL (and token):

- **rollout** keeps producing VLM GRPO groups (tags ``group_id``, ``group_size``,
  ``policy_version``, bumped every ``version_every`` batches) with their advantages;
  every member of a group carries a copy of its group's images (which the native engine
  stores once). Each batch is a partial rollout first: the first half of every
  sample's tokens (``put_samples(..., finished=False)``), then the rest
  (``extend(..., finished=True)``); nobody may claim it in between;
- **logprob** claims ``stage="logprob"`` samples as they arrive, checks what it read,
  writes ``prev_logprobs`` and ``reference_policy_logprobs``, acks;
- **train-a** and **train-b** claim ``stage="train"`` whole groups by tokens
  (``max_tokens``, ``group_key="group_id"``, ``max_staleness=1`` against the newest
  policy version),
  check every field they read, ack. train-b trains slower than the rollout produces, so
  old groups go stale and are expired. train-a joins once the rollout is done, claims,
  and is killed (SIGKILL, by its pid) while it holds that lease: its samples come back
  to the task when the lease lapses and train-b consumes them.

The driver then checks, from the workers' reports and from the store's own
``consumption()``: per task, every sample acked exactly once or (train) expired as
too stale and counted, nothing claimed or pending left, the killed worker's samples
redelivered; and it prints a per-task timeline and the bytes the samples hold as written
against what the store keeps. Any violation is a problem (exit 1).

Example::

    problems = run_async_demo(AsyncDemoConfig(batches=6), console)
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import torch
from rich.console import Console
from rich.table import Table

from rlplane import errors as E
from rlplane.packed import PackedTensor
from rlplane.testing.workloads import vlm_grpo
from rlplane_tools.demo import clear_partitions, stage_output

#: What the rollout writes (a VLM GRPO step's fields, advantages included).
ROLLOUT = ("input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs", "advantages",
           "mm_token_type_ids", "pixel_values", "image_grid_thw")
#: Patches along an image's side (the reference workload's images, made small enough for a demo).
SIDES = (4, 12)
LOGPROB_OUT = ("prev_logprobs", "reference_policy_logprobs")


@dataclass
class AsyncDemoConfig:
    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    transport: str = "auto"
    batches: int = 8  # rollout batches
    groups: int = 4  # groups per batch
    group_size: int = 4
    seqlen: int = 256
    version_every: int = 2  # the policy version goes up every this many batches
    train_tokens: int | None = None  # token budget of a train claim (whole groups): default two groups' worth
    lease_s: float = 3.0  # of train claims: how soon a dead trainer's samples come back
    max_staleness: int = 1
    train_step_s: float = 0.25  # a train worker's "step" after each read
    deadline_s: float = 180.0  # the whole run; a worker still going then is a problem
    t0: float = field(default_factory=time.time)  # the timeline's zero (wall clock, shared by every process)
    partition: str = field(default_factory=lambda: f"async-{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        # Two groups at full length: a claim takes about two groups whatever the length (a fixed
        # budget let train-b take every group of a short run, so train-a never got a lease to die with).
        if self.train_tokens is None:
            self.train_tokens = 2 * self.group_size * self.seqlen


def _batch(cfg: AsyncDemoConfig, b: int) -> tuple[list[str], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Rollout batch ``b``: ids, fields and tags (every process regenerates the same bits)."""
    n = cfg.groups * cfg.group_size
    work = vlm_grpo(batch=n, seqlen=cfg.seqlen, seed=1000 + b, group=cfg.group_size, sides=SIDES)
    ids = [f"b{b}-{i}" for i in range(n)]
    tags = [{"group_id": f"b{b}-g{i // cfg.group_size}", "group_size": cfg.group_size,
             "policy_version": b // cfg.version_every} for i in range(n)]
    fields = {k: work.fields[k] for k in ROLLOUT}
    if b % 3 == 2:  # text-only prompts, put apart from image ones (claims mix them: the images must still come)
        for k in PACKED:
            del fields[k]
        fields["mm_token_type_ids"] = torch.zeros_like(fields["mm_token_type_ids"])
    return ids, fields, tags


def _expected(cfg: AsyncDemoConfig, ids: list[str], cache: dict[int, Any]) -> dict[str, torch.Tensor]:
    rows: dict[str, list[Any]] = {}
    for sid in ids:
        b, i = (int(x) for x in sid[1:].split("-"))
        if b not in cache:
            cache[b] = _batch(cfg, b)[1]
        for k in ROLLOUT:
            v = cache[b].get(k)  # (none: a text-only sample's media)
            rows.setdefault(k, []).append(None if v is None else v.rows[i] if isinstance(v, PackedTensor) else v[i])
    return {k: PackedTensor(v) if k in PACKED else torch.stack(v) for k, v in rows.items()}


PACKED = ("pixel_values", "image_grid_thw")


def _halves(registry: Any, fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout batch as a partial rollout: every field with the first half of each
    sample's tokens, then the rest of the tokens (gathered for every sample at once)."""
    lengths = fields["input_lengths"]
    head_n = lengths // 2
    rest_n = lengths - head_n
    width = int(lengths.max())
    at = (head_n[:, None] + torch.arange(width)[None, :]).clamp(max=width - 1)
    head, rest = dict(fields), {"input_lengths": rest_n}
    head["input_lengths"] = head_n
    for k, v in fields.items():
        if k != "input_lengths" and registry.get(k).alignment == "token":
            head[k] = v[:, : max(int(head_n.max()), 1)]
            rest[k] = torch.gather(v[:, :width], 1, at)
    return head, rest


def _worker(role: str, cfg_dict: dict, events: Any, stop: Any, version: Any) -> None:
    """One process: report ``[role, kind, t, ids, detail]`` events as msgpack bytes on its
    own pipe (a killed worker must not take a shared queue's lock with it)."""
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import rlplane
    from rlplane.testing.verify import diff_fields

    cfg = AsyncDemoConfig(**cfg_dict)
    t_start = time.monotonic()

    def say(kind: str, ids: list[str] | None = None, detail: str = "") -> None:
        events.send_bytes(msgpack.packb([role, kind, round(time.time() - cfg.t0, 3), ids or [], detail]))

    try:
        with rlplane.connect(cfg.url, token=cfg.token, transport=cfg.transport) as c:
            if role == "rollout":
                for b in range(cfg.batches):
                    ids, fields, tags = _batch(cfg, b)
                    version.value = b // cfg.version_every
                    head, rest = _halves(c.registry, fields)
                    meta = c.put_samples(cfg.partition, head, sample_ids=ids, tags=tags, finished=False)
                    say("put", ids, f"v{b // cfg.version_every}, {int(head['input_lengths'].sum())} tokens so far")
                    time.sleep(0.1)  # generating the rest: no claim may hand these samples out yet
                    c.extend(meta, rest, finished=True)
                    say("extend", ids, f"+{int(rest['input_lengths'].sum())} tokens, finished")
                    time.sleep(0.05)
                say("done")
                return
            task = "logprob" if role == "logprob" else "train"
            cache: dict[int, Any] = {}
            first = True
            if role == "train-a":
                stop.wait(cfg.deadline_s)  # joins late: the backlog is fresh then, so its lease outlives no version
            while time.monotonic() - t_start < cfg.deadline_s:
                try:
                    if task == "logprob":
                        meta = c.claim(cfg.partition, task, batch_size=cfg.groups * cfg.group_size, stage="logprob",
                                       timeout=0.5, min_batch=1)
                    else:
                        meta = c.claim(cfg.partition, task, max_tokens=cfg.train_tokens, min_tokens=1, stage="train",
                                       timeout=0.5, group_key="group_id", current_version=int(version.value),
                                       max_staleness=cfg.max_staleness, lease_s=cfg.lease_s)
                except E.NotReadyError:
                    left = c.consumption(cfg.partition, task)
                    if stop.is_set() and left["samples"] and left["acked"] + left["expired"] == left["samples"]:
                        break
                    continue
                versions = sorted({t["policy_version"] for t in meta.tags})
                say("claim", meta.sample_ids, f"v{versions}, {sum(meta.lengths)} tokens")
                if role == "train-a" and first:
                    time.sleep(60)  # the driver kills this process here, mid-lease
                first = False
                got = c.read_columns(meta, stage=task)
                want = _expected(cfg, meta.sample_ids, cache)
                want.update({k: stage_output(k, meta) for k in LOGPROB_OUT})
                bad = diff_fields(c.registry, {k: want[k] for k in got}, got, meta.lengths, sample_ids=meta.sample_ids)
                bad += [f"{k} left out: read image-blind" for k in PACKED if k not in got and not want[k].is_empty()]
                if bad or set(got) != set(c.fields_for_stage(task, meta)):
                    say("mismatch", meta.sample_ids, "; ".join(bad) or f"read {sorted(got)}")
                if task == "logprob":
                    c.write_columns(meta, {k: stage_output(k, meta) for k in LOGPROB_OUT})
                else:
                    time.sleep(cfg.train_step_s)
                c.ack(meta, task)
                say("ack", meta.sample_ids)
            say("finished", [], "")
    except Exception as err:  # noqa: BLE001 - report any failure to the driver, whole
        say("error", [], f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}")


def run_async_demo(cfg: AsyncDemoConfig, console: Console) -> list[str]:
    """Run the pipeline against the service at ``cfg.url``; print the timeline; return every problem."""
    import rlplane

    from multiprocessing.connection import wait

    ctx = mp.get_context("forkserver")  # workers forked from one process that imported torch and rlplane once
    ctx.set_forkserver_preload([__name__, "rlplane_tools.preloaded"])  # (and the compiled row copies: ~0.4 s a process)
    stop, version = ctx.Event(), ctx.Value("i", 0)
    roles = ["rollout", "logprob", "train-a", "train-b"]
    pipes = {r: ctx.Pipe(duplex=False) for r in roles}  # (driver's end, worker's end)
    procs = {r: ctx.Process(target=_worker, args=(r, asdict(cfg), pipes[r][1], stop, version), name=f"rlplane-async-{r}",
                            daemon=True) for r in roles}
    total = cfg.batches * cfg.groups * cfg.group_size
    console.print(f"[bold]async GRPO[/]: {cfg.batches} rollout batches of {cfg.groups} groups x {cfg.group_size}, "
                  f"policy version +1 every {cfg.version_every} batches, train max_staleness={cfg.max_staleness}, "
                  f"partition {cfg.partition}")
    before = _held(cfg, None)
    for p in procs.values():
        p.start()
    for r in roles:  # (the worker's end lives in the worker only: its exit reads as an end of file here)
        pipes[r][1].close()
    held: str | None = None
    log: list[list[Any]] = []
    ledger: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    killed: list[str] = []
    killed_roles: set[str] = set()
    finished: set[str] = set()
    closed: set[str] = set()
    deadline = time.monotonic() + cfg.deadline_s + 30

    def _on_event(role: str, kind: str, ids: list[str], detail: str) -> None:
        if kind == "claim" and role == "train-a" and not killed:
            procs["train-a"].kill()  # mid-lease: its samples must come back to the task
            killed.extend(ids)
            killed_roles.add(role)
            console.print(f"[yellow]killed train-a[/] (pid {procs['train-a'].pid}) holding {len(ids)} samples")
        elif kind == "done":
            stop.set()
            finished.add(role)
        elif kind == "finished":
            finished.add(role)
        elif kind in ("error", "mismatch"):
            problems.append(f"{role}: {kind} {detail} {ids[:4]}")
            if kind == "error":  # (the worker stops: the run ends now, not at its deadline)
                closed.add(role)
    try:
        while time.monotonic() < deadline and len(finished) < len(roles) - 1:  # train-a never finishes
            open_ = {pipes[r][0]: r for r in roles if r not in finished and r not in killed_roles and r not in closed}
            ready = wait(list(open_), timeout=1.0)
            for conn in ready:
                try:
                    log.append(msgpack.unpackb(conn.recv_bytes(), raw=False))
                except (EOFError, OSError):
                    closed.add(open_[conn])  # type: ignore[index]
                    continue
                role, kind, t, ids, detail = log[-1]
                _on_event(role, kind, ids, detail)
            dead = [r for r in closed if r not in finished and r not in killed_roles]
            if dead:
                problems.append(f"worker(s) {dead} exited without finishing")
                break
        else:
            if len(finished) < len(roles) - 1:
                problems.append(f"the run did not finish within {cfg.deadline_s + 30:.0f} s (finished: {sorted(finished)})")
        try:
            with rlplane.connect(cfg.url, token=cfg.token, transport="http") as c:
                ledger = {task: c.consumption(cfg.partition, task) for task in ("logprob", "train")}
                problems += _check(cfg, log, ledger, killed, total)
                held = _held(cfg, before) if before is not None else None
        except E.RlplaneError as err:  # (what the workers said is reported all the same)
            problems.append(f"the consumption could not be read: {type(err).__name__}: {err}")
    finally:
        stop.set()
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        clear_partitions(cfg.url, cfg.token, [cfg.partition], console)  # (an interrupted run's too)
    console.print(_timeline(log))
    summary = Table(title=f"consumption of {cfg.partition} ({total} samples)")
    for col in ("task", "samples", "acked", "expired", "claimed", "pending", "redelivered"):
        summary.add_column(col, justify="left" if col == "task" else "right")
    for task, c in ledger.items():
        summary.add_row(task, *(str(c[k]) for k in ("samples", "acked", "expired", "claimed", "pending", "redelivered")))
    console.print(summary)
    if held:
        console.print(held)
    return problems


def _held(cfg: AsyncDemoConfig, before: dict[str, int] | None) -> Any:
    """The native engine's written and stored byte counts (``before``: None), or a line
    with what this run added to them; None on a backend that does not count them."""
    import rlplane

    try:
        with rlplane.connect(cfg.url, token=cfg.token, transport="native") as c:
            st = c.transport.stats()
    except E.RlplaneError:
        return None
    now = {"written": int(st["written_bytes"]), "stored": int(st["live_bytes"])}
    if before is None:
        return now
    w, k = now["written"] - before["written"], now["stored"] - before["stored"]
    return (f"[bold]bytes[/]: the samples hold {w / 1e6:.1f} MB as written; the store keeps {k / 1e6:.1f} MB "
            f"({w / k:.1f}x less: each group's images are stored once)" if k > 0 else None)


def _check(cfg: AsyncDemoConfig, log: list[list[Any]], ledger: dict[str, dict[str, int]], killed: list[str],
           total: int) -> list[str]:
    """Exactly once per task, from the workers' reports and the store's consumption."""
    problems = []
    produced = [s for role, kind, _, ids, _ in log if kind == "put" for s in ids]
    if len(produced) != total:
        problems.append(f"rollout reported {len(produced)} samples, expected {total}")
    for task, roles in (("logprob", {"logprob"}), ("train", {"train-a", "train-b"})):
        acked = [s for role, kind, _, ids, _ in log if kind == "ack" and role in roles for s in ids]
        twice = sorted({s for s in acked if acked.count(s) > 1})
        if twice:
            problems.append(f"{task}: {len(twice)} samples consumed twice, e.g. {twice[:3]}")
        c = ledger[task]
        if c["acked"] != len(set(acked)):
            problems.append(f"{task}: the store counts {c['acked']} acked, the workers acked {len(set(acked))}")
        lost = set(produced) - set(acked)
        if task == "logprob" and lost:
            problems.append(f"logprob: {len(lost)} samples never consumed, e.g. {sorted(lost)[:3]}")
        if task == "train" and len(lost) != c["expired"]:
            problems.append(f"train: {len(lost)} samples not consumed but {c['expired']} counted expired")
        if c["claimed"] or c["pending"]:
            problems.append(f"{task}: {c['claimed']} still claimed and {c['pending']} pending at the end")
    if killed:
        later = {s for role, kind, _, ids, _ in log if kind == "ack" and role == "train-b" for s in ids}
        if not set(killed) <= later:
            problems.append(f"train-a's {len(killed)} leased samples were not redelivered to train-b")
        if ledger["train"]["redelivered"] < len(killed):
            problems.append(f"the store counts {ledger['train']['redelivered']} redelivered, train-a held {len(killed)}")
    else:
        problems.append("train-a never claimed anything, so the redelivery was not exercised")
    return problems


def _timeline(log: list[list[Any]]) -> Table:
    table = Table(title="timeline (seconds since the demo started)")
    for col in ("t", "worker", "event", "samples", "detail"):
        table.add_column(col, justify="right" if col in ("t", "samples") else "left")
    for role, kind, t, ids, detail in sorted(log, key=lambda e: e[2]):
        if kind in ("put", "extend", "claim", "ack", "error", "mismatch"):
            groups = sorted({s.rsplit("-", 1)[0] for s in ids})
            table.add_row(f"{t:.2f}", role, kind, str(len(ids)), detail or (f"batches {groups}" if groups else ""))
    return table


__all__ = ["AsyncDemoConfig", "run_async_demo"]
