"""The bench's ``claim`` section: streaming consumers against the live service.

- **claim latency**: ``claim(batch_size=64)`` when the batch is ready (text-step shapes),
  p50/p99 over ``ops`` claims, and the ack after it;
- **claim by tokens**: ``claim(max_tokens=one batch's tokens, group_key=...)`` over
  GRPO groups of 8 with the batch ready, p50/p99;
- **wake-up**: a claimer blocked on an empty partition; from the producer's put
  returning (its commit) to the claimer's return, p50/p99 (negative: the claimer got its
  answer before the producer got the commit's reply);
- **extend**: partial rollouts of ``batch`` samples (``put_samples(..., finished=False)``)
  grown by ``ops`` extends of ``EXTEND_TOKENS`` tokens each on every token field;
  p50/p99 of the first and of the last tenth of the extends (what the cost does as a
  rollout grows), then the finished batch claimed;
- **long stream**: one partition that lives as long as a run: ``stream_rounds`` rounds of
  ``batch`` small samples (S=64) put, claimed, acked and cleared beside one sample kept
  all along; claim p50/p99 of the first and the last tenth of the rounds (a partition's
  cost should follow what it holds, not every sample it ever held), and how many times
  the engine renumbered its partitions' slots meanwhile (native: ``partitions_repacked``);
- **throughput**: ``claimers`` processes of one task claim 64 at a time, read the
  text-step fields and ack, until a pre-filled partition is drained; samples/s, and
  every sample consumed exactly once.

Example::

    section = run_claim_bench(url, token, ClaimBenchConfig(ops=20), progress)
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from rich.progress import Progress

from rlplane.testing.workloads import text_step

FIELDS = ["input_ids", "input_lengths", "token_mask", "generation_logprobs", "advantages"]
GROUP = 8  # samples per GRPO group in the claim-by-tokens row
EXTEND_TOKENS = 128  # tokens each extend appends to every sample


@dataclass
class ClaimBenchConfig:
    batch: int = 64
    seqlen: int = 4096  # text-step's
    ops: int = 100  # timed claims (latency) and wake-ups
    wakeups: int = 30
    claimers: int = 4
    drain_batches: int = 32  # pre-filled batches the claimers drain
    stream_rounds: int = 1500  # the long stream's put+claim+ack+clear rounds (1500 x 64: past one renumbering)
    transport: str = "direct"


def run_claim_bench(url: str, token: str | None, cfg: ClaimBenchConfig, progress: Progress) -> dict[str, Any]:
    """Measure the three rows (see the module docstring); returns the section's results."""
    import rlplane

    from rlplane_tools.bench.base import percentiles

    work = text_step(batch=cfg.batch, seqlen=cfg.seqlen, seed=7)
    fields = {k: work.fields[k] for k in FIELDS}
    out: dict[str, Any] = {"batch": cfg.batch, "seqlen": cfg.seqlen, "transport": cfg.transport}
    with rlplane.connect(url, token=token, transport=cfg.transport) as c:
        out["transport"] = c.transport.name
        # -- claim latency with the batch ready --------------------------------------------
        p = f"bench-claim-{uuid.uuid4().hex[:8]}"
        task = progress.add_task("claim latency", total=2 * cfg.ops + 2)
        for _ in range(cfg.ops + 1):
            c.put_samples(p, fields)
            progress.advance(task)
        claim_s, ack_s = [], []
        for i in range(cfg.ops + 1):
            t0 = time.perf_counter()
            meta = c.claim(p, "bench", batch_size=cfg.batch, fields=FIELDS, timeout=0)
            t1 = time.perf_counter()
            c.ack(meta, "bench")
            t2 = time.perf_counter()
            if i:  # the first warms the connection
                claim_s.append(t1 - t0)
                ack_s.append(t2 - t1)
            progress.advance(task)
        c.clear(p)
        out["claim"], out["ack"] = percentiles(claim_s), percentiles(ack_s)
        progress.remove_task(task)

        # -- claim by tokens: GRPO groups of 8, a budget of one batch's tokens -------------------
        p = f"bench-tokens-{uuid.uuid4().hex[:8]}"
        task = progress.add_task("claim by tokens", total=2 * cfg.ops + 2)
        budget = int(work.lengths.sum())
        group = GROUP if cfg.batch % GROUP == 0 else 1  # a small batch (--quick): groups of one
        for k in range(cfg.ops + 1):
            c.put_samples(p, fields, tags=[{"group_id": f"{k}-{i // group}", "group_size": group}
                                           for i in range(cfg.batch)])
            progress.advance(task)
        tokens_s = []
        for i in range(cfg.ops + 1):
            t0 = time.perf_counter()
            meta = c.claim(p, "bench", max_tokens=budget, fields=FIELDS, group_key="group_id", timeout=0)
            tokens_s.append(time.perf_counter() - t0)
            if len(meta) != cfg.batch:  # each claim's budget is exactly one batch's tokens
                raise RuntimeError(f"a claim by tokens took {len(meta)} samples, not the batch of {cfg.batch}")
            c.ack(meta, "bench")
            progress.advance(task)
        c.clear(p)
        out["claim_tokens"] = {**percentiles(tokens_s[1:]), "max_tokens": budget, "group": group}
        progress.remove_task(task)

        out["extend"] = _extends(c, cfg, progress)
        out["stream"] = _long_stream(c, cfg, progress)

        # -- wake-up: a blocked claimer, then the put that makes its batch ready ----------------
        small = {k: v[:, :64] if v.dim() == 2 else v.clamp(max=64) for k, v in fields.items()}
        task = progress.add_task("claim wake-up", total=cfg.wakeups)
        wake: list[float] = []
        with rlplane.connect(url, token=token, transport=cfg.transport) as waiter:
            for _ in range(cfg.wakeups):
                p = f"bench-wake-{uuid.uuid4().hex[:8]}"
                got: dict[str, float] = {}

                def wait(p: str = p, got: dict[str, float] = got) -> None:
                    waiter.ack(waiter.claim(p, "bench", batch_size=cfg.batch, fields=FIELDS, timeout=30), "bench")
                    got["t"] = time.perf_counter()

                th = threading.Thread(target=wait)
                th.start()
                time.sleep(0.05)  # parked on the server by now
                c.put_samples(p, small)
                put_done = time.perf_counter()
                th.join(timeout=40)
                if "t" in got:
                    wake.append(got["t"] - put_done)
                c.clear(p)
                progress.advance(task)
        out["wake"] = percentiles(wake) if wake else None
        out["wake_missed"] = cfg.wakeups - len(wake)
        progress.remove_task(task)

        # -- throughput: N claimers drain a pre-filled partition -------------------------------
        p = f"bench-drain-{uuid.uuid4().hex[:8]}"
        task = progress.add_task(f"{cfg.claimers} claimers: filling", total=cfg.drain_batches)
        written: list[str] = []
        for _ in range(cfg.drain_batches):
            written += c.put_samples(p, fields).sample_ids
            progress.advance(task)
        progress.remove_task(task)
        with progress.console.status(f"{cfg.claimers} claimer processes drain {len(written)} samples"):
            out["drain"] = _drain(url, token, cfg, p)
        c.clear(p)
        ids = out["drain"].pop("ids")
        out["drain"]["exactly_once"] = sorted(ids) == sorted(written)
    return out


def _extends(c: Any, cfg: ClaimBenchConfig, progress: Progress) -> dict[str, Any]:
    """Partial rollouts grown by ``cfg.ops`` extends (see the module docstring)."""
    import torch

    from rlplane_tools.bench.base import median_parts, percentiles

    p = f"bench-extend-{uuid.uuid4().hex[:8]}"
    work = text_step(batch=cfg.batch, seqlen=EXTEND_TOKENS, seed=8)
    step = {k: work.fields[k] for k in FIELDS if work.fields[k].dim() == 2}  # the token fields
    step["input_lengths"] = torch.full((cfg.batch,), EXTEND_TOKENS)
    ops = max(1, cfg.ops)  # the last extend finishes the rollouts
    task = progress.add_task(f"extend: {ops} x {EXTEND_TOKENS} tokens", total=ops + 1)
    meta = c.put_samples(p, step, finished=False)
    seconds, parts = [], []
    for i in range(ops):
        t0 = time.perf_counter()
        meta = c.extend(meta, step, finished=i == ops - 1)
        seconds.append(time.perf_counter() - t0)
        told = c.ops.last("extend") if c.transport.counts_waits else None  # (where the time went)
        parts.append(dict(told.parts) if told is not None else None)
        progress.advance(task)
    got = c.claim(p, "bench", batch_size=cfg.batch, fields=list(step), timeout=10)
    want = EXTEND_TOKENS * (ops + 1)
    if len(got) != cfg.batch or set(got.lengths) != {want}:
        raise RuntimeError(f"after {ops} extends the claim got {len(got)} samples of lengths {sorted(set(got.lengths))}, "
                           f"not {cfg.batch} of {want}")
    c.clear(p)
    progress.remove_task(task)
    tenth = max(1, ops // 10)
    return {"batch": cfg.batch, "tokens": EXTEND_TOKENS, "extends": ops, "fields": sorted(set(step) - {"input_lengths"}),
            "first": {**percentiles(seconds[:tenth]), "parts_ms": median_parts(parts[:tenth])},
            "last": {**percentiles(seconds[-tenth:]), "parts_ms": median_parts(parts[-tenth:])}, "length": want}


def _long_stream(c: Any, cfg: ClaimBenchConfig, progress: Progress) -> dict[str, Any]:
    """A partition streamed through for ``cfg.stream_rounds`` rounds (see the module docstring)."""
    from rlplane_tools.bench.base import percentiles

    p = f"bench-stream-{uuid.uuid4().hex[:8]}"
    work = text_step(batch=cfg.batch, seqlen=64, seed=9)
    fields = {k: work.fields[k] for k in FIELDS}
    keeper = c.put_samples(p, {k: fields[k][:1] for k in ("input_ids", "input_lengths")})  # never ready: never claimed
    repacked = _repacked(c)
    task = progress.add_task(f"long stream: {cfg.stream_rounds} x {cfg.batch} samples", total=cfg.stream_rounds)
    seconds = []
    for _ in range(cfg.stream_rounds):
        c.put_samples(p, fields)
        t0 = time.perf_counter()
        meta = c.claim(p, "bench", batch_size=cfg.batch, fields=FIELDS, timeout=0)
        seconds.append(time.perf_counter() - t0)
        c.ack(meta, "bench")
        c.clear(p, meta.sample_ids)
        progress.advance(task)
    left = c.stats()["partitions"].get(p, {}).get("num_samples")
    c.clear(p)
    progress.remove_task(task)
    if left != 1:
        raise RuntimeError(f"the long stream's partition held {left} samples at its end, not its one kept sample "
                           f"({keeper.sample_ids[0]})")
    tenth = max(1, len(seconds) // 10)
    after = _repacked(c)
    return {"rounds": cfg.stream_rounds, "batch": cfg.batch, "samples": cfg.stream_rounds * cfg.batch,
            "first": percentiles(seconds[:tenth]), "last": percentiles(seconds[-tenth:]),
            "repacked": after - repacked if after is not None and repacked is not None else None}


def _repacked(c: Any) -> int | None:
    """How many times the native engine renumbered a partition's slots (None: another store)."""
    stats = getattr(c.transport, "stats", None)
    try:
        got = stats() if callable(stats) else None
    except Exception:  # noqa: BLE001 - a store without engine stats
        return None
    return got.get("partitions_repacked") if isinstance(got, dict) else None


def _claimer(url: str, token: str | None, cfg_dict: dict, p: str, go: Any, start: Any, conn: Any) -> None:
    import rlplane
    from rlplane.errors import NotReadyError

    cfg = ClaimBenchConfig(**cfg_dict)
    ids: list[str] = []
    with rlplane.connect(url, token=token, transport=cfg.transport) as c:
        conn.send_bytes(b"ready")
        go.wait(60)
        t0 = time.perf_counter()
        last = t0
        while True:
            try:
                meta = c.claim(p, "drain", batch_size=cfg.batch, fields=FIELDS, timeout=0.5, min_batch=1)
            except NotReadyError:
                break
            c.read_columns(meta, FIELDS)
            c.ack(meta, "drain")
            ids += meta.sample_ids
            last = time.perf_counter()
    import msgpack

    conn.send_bytes(msgpack.packb({"ids": ids, "t0": t0, "t1": last}))


def _drain(url: str, token: str | None, cfg: ClaimBenchConfig, p: str) -> dict[str, Any]:
    from rlplane_tools.bench.procs import run_together

    reports = run_together(_claimer, (url, token, asdict(cfg), p), cfg.claimers, finish_s=300)
    ids = [s for r in reports for s in r["ids"]]
    seconds = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)  # perf_counter is system-wide on Linux
    return {"claimers": cfg.claimers, "samples": len(ids), "seconds": seconds,
            "samples_per_s": len(ids) / seconds if seconds > 0 else None, "ids": ids}


__all__ = ["ClaimBenchConfig", "run_claim_bench"]
