"""``rlplane demo``: one whole VLM GRPO step's data flow, verified bit for bit.

Rollout puts the reference batch; the driver shards it for 2 DP ranks (seqlen
balanced); logprob ranks read their stage's fields and write ``prev_logprobs``;
reference ranks write ``reference_policy_logprobs``; the driver writes ``advantages``;
trainer ranks read ``train``. Every rank checks the multimodal fields against what the
rollout wrote, and that the train and logprob passes saw the same multimodal fields.

Until the service lands this runs through the in-memory reference transport, so it
measures the codec (encode/decode) and the reference store's copies.

Example::

    problems = run_demo(DemoConfig(batch=8, seqlen=256), console)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console

from rlplane.client import Client
from rlplane.fields import default_registry
from rlplane.meta import SampleMeta
from rlplane.packed import PackedTensor
from rlplane.transports.memory import MemoryTransport
from rlplane.verify import diff_fields
from rlplane.workloads import fields_nbytes as payload_nbytes
from rlplane.workloads import text_step, vlm_step
from rlplane_service.timing import Phase, phase_table, timed

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


@dataclass
class DemoConfig:
    batch: int = 64
    seqlen: int = 2048
    dp_size: int = 2
    seed: int = 0
    text_only: bool = False
    layout: str = "padded"


def run_demo(cfg: DemoConfig, console: Console) -> list[str]:
    """Run the step; print progress and the per-phase table; return every problem found."""
    registry = default_registry()
    client = Client(registry, MemoryTransport())
    with console.status("generating the reference batch"):
        make = text_step if cfg.text_only else vlm_step
        work = make(batch=cfg.batch, seqlen=cfg.seqlen, seed=cfg.seed)
    written = {k: v for k, v in work.fields.items() if k in ROLLOUT_FIELDS}
    console.print(
        f"[bold]{work.name}[/]: B={cfg.batch} S={cfg.seqlen}, {work.nbytes / 1e6:.1f} MB as written, "
        f"{cfg.dp_size} DP ranks, transport=memory, layout={cfg.layout}"
    )
    phases: list[Phase] = []
    problems: list[str] = []
    seen_mm: dict[str, set[str]] = {}

    def phase(op: str, samples: int, nbytes: int) -> Phase:
        p = Phase(op, samples, nbytes)
        phases.append(p)
        return p

    def check(stage: str, rank: int, shard: SampleMeta, got: dict) -> None:
        idx = [int(s.rsplit("-", 1)[1]) for s in shard.sample_ids]
        want = _rows(written, idx)
        mm_present = {k for k in MULTIMODAL if k in got}
        seen_mm.setdefault(stage, set()).update(mm_present)
        for line in diff_fields(registry, {k: want[k] for k in got if k in want}, got, shard.lengths, sample_ids=shard.sample_ids):
            problems.append(f"{stage} rank {rank}: {line}")
        if cfg.text_only and mm_present:
            problems.append(f"{stage} rank {rank}: requested multimodal fields {sorted(mm_present)} for a text-only batch")

    console.print("[cyan]rollout[/] put_samples")
    with timed(phase("rollout put_samples", cfg.batch, payload_nbytes(written))):
        meta = client.put_samples("step-0", written, sample_ids=[f"s-{i}" for i in range(cfg.batch)])
    shards = meta.shard(cfg.dp_size, balance="seqlen")
    console.print(f"sharded for {cfg.dp_size} ranks: tokens per rank {[sum(s.lengths) for s in shards]}")

    outputs = {"logprob": "prev_logprobs", "ref_logprob": "reference_policy_logprobs"}
    for stage, out_field in outputs.items():
        for rank, shard in enumerate(shards):
            console.print(f"[cyan]{stage}[/] rank {rank}: read {client.fields_for_stage(stage, shard)}")
            p = phase(f"{stage} read (rank {rank})", len(shard), 0)
            with timed(p):
                got = client.read_columns(shard, stage=stage, layout=cfg.layout)
            p.nbytes = payload_nbytes(got)
            check(stage, rank, shard, got)
            logprobs = _fake_logprobs(shard, cfg.seed + rank + len(out_field))
            written_out = {out_field: logprobs}
            with timed(phase(f"{stage} write {out_field} (rank {rank})", len(shard), payload_nbytes(written_out))):
                shards[rank] = client.write_columns(shard, written_out)
            written.setdefault(out_field, torch.zeros(cfg.batch, logprobs.shape[1]))
            idx = [int(s.rsplit("-", 1)[1]) for s in shard.sample_ids]
            written[out_field][idx, : logprobs.shape[1]] = logprobs

    console.print("[cyan]driver[/] write advantages")
    adv = {"advantages": work.fields["advantages"]}
    full = SampleMeta.concat(*shards)
    order = [int(s.rsplit("-", 1)[1]) for s in full.sample_ids]
    with timed(phase("driver write advantages", cfg.batch, payload_nbytes(adv))):
        full = client.write_columns(full, {"advantages": adv["advantages"][order]})
    written["advantages"] = adv["advantages"]

    for rank, shard in enumerate(full.shard(cfg.dp_size, balance="seqlen")):
        console.print(f"[cyan]train[/] rank {rank}: read {client.fields_for_stage('train', shard)}")
        p = phase(f"train read (rank {rank})", len(shard), 0)
        with timed(p):
            got = client.read_columns(shard, stage="train", layout=cfg.layout)
        p.nbytes = payload_nbytes(got)
        check("train", rank, shard, got)

    for stage in ("ref_logprob", "train"):
        if seen_mm.get(stage) != seen_mm.get("logprob"):
            problems.append(
                f"{stage} saw multimodal fields {sorted(seen_mm.get(stage, ()))} but logprob saw "
                f"{sorted(seen_mm.get('logprob', ()))}"
            )
    console.print(phase_table("rlplane demo: one GRPO step (in-memory transport)", phases))
    return problems


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


def _fake_logprobs(shard: SampleMeta, seed: int) -> torch.Tensor:
    """Stand-in for a model pass: deterministic per-token logprobs, zero past each length."""
    g = torch.Generator().manual_seed(seed)
    width = shard.pad_to_seqlen or max(shard.lengths, default=0)
    lp = -torch.rand(len(shard), width, generator=g)
    lens = torch.tensor(shard.lengths, dtype=torch.int64)
    return lp * (torch.arange(width) < lens[:, None])

