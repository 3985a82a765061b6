"""Streaming on the live service: claim, ack, nack, consumption on every backend and transport."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E

S = 32  # tokens per sample: small, the ledger is what is under test


def part() -> str:
    return f"st-{uuid.uuid4().hex[:8]}"


def batch(n: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (n, S), generator=g), "input_lengths": torch.full((n,), S)}


@pytest.fixture(params=["direct", "http"])
def client(request, live):
    with rlplane.connect(live.url, token=live.token, transport=request.param) as c:
        yield c


def test_claim_reads_acks_and_counts(client):
    p = part()
    data = batch(6)
    client.put_samples(p, data, sample_ids=[f"s{i}" for i in range(6)], tags=[{"policy_version": 3}] * 6)
    meta = client.claim(p, "logprob", batch_size=4, stage="logprob", timeout=5)
    assert meta.sample_ids == ["s0", "s1", "s2", "s3"] and meta.lengths == [S] * 4 and meta.pad_to_seqlen == S
    assert meta.tags[0]["policy_version"] == 3 and {"input_ids", "input_lengths"} <= meta.fields
    got = client.read_columns(meta, stage="logprob")
    assert torch.equal(got["input_ids"], data["input_ids"][:4])
    assert client.consumption(p, "logprob")["claimed"] == 4
    assert client.ack(meta, "logprob") == 4
    c = client.consumption(p, "logprob")
    assert (c["samples"], c["acked"], c["claimed"], c["pending"]) == (6, 4, 0, 2)
    assert client.consumption(p, "train")["acked"] == 0  # another task is independent
    with pytest.raises(E.LeaseError):
        client.ack(meta, "logprob")  # settled already
    with pytest.raises(E.NotReadyError, match="2 of 4 samples"):
        client.claim(p, "logprob", batch_size=4, stage="logprob", timeout=0)
    assert client.claim(p, "logprob", batch_size=4, stage="logprob", timeout=0, min_batch=2).sample_ids == ["s4", "s5"]
    client.clear(p)


def test_a_stage_waits_for_its_fields_and_groups_come_whole(client):
    p = part()
    tags = [{"group_id": f"g{i // 3}", "group_size": 3, "policy_version": 0 if i < 3 else 1} for i in range(9)]
    meta = client.put_samples(p, batch(9), tags=tags)
    with pytest.raises(E.NotReadyError):  # train needs prev_logprobs & co: none written yet
        client.claim(p, "train", batch_size=1, fields=["input_ids", "prev_logprobs"], timeout=0.2)
    client.write_columns(meta.slice(0, 5), {"prev_logprobs": torch.zeros(5, S)})
    got = client.claim(p, "train", batch_size=6, fields=["input_ids", "prev_logprobs"], group_key="group_id",
                       timeout=0.3, min_batch=1)
    assert got.sample_ids == meta.sample_ids[:3]  # g0 whole; g1 has only 2 of 3 ready
    # staleness: version 0 is too old for current 2 with max_staleness 1; counted, never handed out
    fresh = client.claim(p, "fresh", batch_size=9, fields=["input_ids"], current_version=2, max_staleness=1,
                         timeout=0.2, min_batch=1)
    assert fresh.sample_ids == meta.sample_ids[3:]
    assert client.consumption(p, "fresh")["expired"] == 3
    client.clear(p)


def test_leases_lapse_and_come_back_nack_at_once(client):
    p = part()
    client.put_samples(p, batch(4))
    held = client.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=2, lease_s=1.0)
    with pytest.raises(E.NotReadyError):
        client.claim(p, "train", batch_size=1, fields=["input_ids"], timeout=0)
    t0 = time.monotonic()
    again = client.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=10)  # the holder "died"
    assert again.sample_ids == held.sample_ids and time.monotonic() - t0 < 3.0
    with pytest.raises(E.LeaseError, match="expired"):
        client.ack(held, "train")
    assert client.nack(again, "train") == 4
    t0 = time.monotonic()
    third = client.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=5)
    assert third.sample_ids == held.sample_ids and time.monotonic() - t0 < 1.0
    shards = third.shard(2, balance="contiguous")
    assert client.ack(shards[0], "train") + client.ack(shards[1], "train") == 4  # each rank acks its shard
    c = client.consumption(p, "train")
    assert (c["acked"], c["redelivered"]) == (4, 4)
    client.clear(p)


def test_a_blocked_claim_returns_soon_after_the_put(live, client):
    p = part()
    out: dict[str, float] = {}

    def wait() -> None:
        with rlplane.connect(live.url, token=live.token, transport=client.transport.name) as other:
            out["meta"] = other.claim(p, "train", batch_size=8, fields=["input_ids"], timeout=20)  # type: ignore[assignment]
            out["t"] = time.monotonic()

    th = threading.Thread(target=wait)
    th.start()
    th.join(timeout=1.5)  # an unknown partition waits like an empty one: still waiting after 1.5 s
    assert th.is_alive() and "t" not in out
    client.put_samples(p, batch(8))
    put_done = time.monotonic()
    th.join(timeout=25)
    assert out["t"] - put_done < 1.0
    client.clear(p)


def test_bad_claims_fail_at_once(client):
    p = part()
    t0 = time.monotonic()
    for kwargs, err in [
        (dict(batch_size=0, fields=["input_ids"]), E.InvalidArgumentError),
        (dict(batch_size=4, min_batch=5, fields=["input_ids"]), E.InvalidArgumentError),
        (dict(batch_size=4, stage="no-such-stage"), E.UnknownStageError),
        (dict(batch_size=4, fields=["not_registered"]), E.UnregisteredFieldError),
        (dict(batch_size=4), E.InvalidArgumentError),
    ]:
        with pytest.raises(err):
            client.claim(p, "train", timeout=30, **kwargs)
    assert time.monotonic() - t0 < 5
    with pytest.raises(E.LeaseError):
        client.ack(rlplane.SampleMeta(p, ["x"]), "train")


def test_http_claim_endpoints_answer_typed_errors(live):
    headers = {"Authorization": f"Bearer {live.token}"}
    url = f"{live.url}/v1/partitions/{part()}"
    r = httpx.post(f"{url}/claim", json={"task": "t", "batch_size": 0, "fields": ["input_ids"]}, headers=headers)
    assert r.status_code == 422
    r = httpx.post(f"{url}/claim", json={"task": "t", "batch_size": 2, "fields": ["input_ids"]}, headers=headers)
    assert r.status_code == 408 and r.json()["error"] == "NotReadyError"
    r = httpx.post(f"{url}/ack", json={"task": "t", "lease": 123456789}, headers=headers)
    assert r.status_code == 409 and r.json()["error"] == "LeaseError"
    assert httpx.post(f"{url}/claim", json={"task": "t", "batch_size": 2}).status_code == 401


#: What each task's claimers ask: "logprob" by batch size, "train" by a token budget in whole groups.
CLAIMS = {"logprob": dict(batch_size=5, min_batch=1),
          "train": dict(max_tokens=3 * S, min_tokens=1, group_key="group_id")}
GROUP = 5


def _claimer(url: str, token: str, transport: str, p: str, results: mp.Queue, until: float, written: Any) -> None:
    """Claim for every task in turn until nothing more comes after the producer is done
    (``written`` set); report what each claim got."""
    with rlplane.connect(url, token=token, transport=transport) as c:
        idle, done = dict.fromkeys(CLAIMS, 0), False
        while time.monotonic() < until and min(idle.values()) < (1 if done else 3):
            if not done and written.is_set():  # from here on, one empty round of every task ends it
                idle, done = dict.fromkeys(CLAIMS, 0), True
            for task, how in CLAIMS.items():
                try:
                    meta = c.claim(p, task, fields=["input_ids"], timeout=0.5, **how)
                except E.NotReadyError:
                    idle[task] += 1
                    continue
                idle[task] = 0
                results.put((task, meta.sample_ids, meta.lengths, meta.over_budget))
                c.ack(meta, task)
    results.put(("done", [], [], False))


def test_exactly_once_per_task_under_concurrent_claimer_processes(live):
    """Four claimer processes, two tasks (one by batch size, one by tokens in whole groups)
    while the producer writes: every sample once per task, no group split, no budget
    exceeded but by a group alone."""
    p = part()
    ctx = mp.get_context("forkserver")  # a clean process (no Ray, no sockets) forked from one that imported these once
    ctx.set_forkserver_preload(["torch", "rlplane", "rlplane.client", "httpx"])
    results: mp.Queue = ctx.Queue()
    until, all_written = time.monotonic() + 90, ctx.Event()
    procs = [ctx.Process(target=_claimer, args=(live.url, live.token, live.direct, p, results, until, all_written))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    written: list[str] = []
    group_of: dict[str, str] = {}
    with rlplane.connect(live.url, token=live.token) as producer:
        for k in range(12):  # the producer writes while they claim
            data = batch(10, seed=k)
            data["input_lengths"] = torch.randint(1, S + 1, (10,), generator=torch.Generator().manual_seed(k))
            tags = [{"group_id": f"{k}-{i // GROUP}", "group_size": GROUP} for i in range(10)]
            ids = producer.put_samples(p, data, tags=tags).sample_ids
            group_of.update({s: t["group_id"] for s, t in zip(ids, tags)})
            written += ids
            time.sleep(0.1)
        all_written.set()
        got: dict[str, list[str]] = {task: [] for task in CLAIMS}
        done = 0
        while done < len(procs):
            task, ids, lengths, over = results.get(timeout=max(1.0, until - time.monotonic() + 10))
            if task == "done":
                done += 1
                continue
            got[task] += ids
            if task == "train":
                groups = {group_of[s] for s in ids}
                assert len(ids) == GROUP * len(groups), f"a group was split: {ids}"
                budget = CLAIMS["train"]["max_tokens"]
                assert sum(lengths) <= budget or (over and len(groups) == 1), (ids, lengths, over)
        for proc in procs:
            proc.join(timeout=10)
        for task, ids in got.items():
            assert len(ids) == len(set(ids)), f"{task}: a sample was handed out twice"
            assert sorted(ids) == sorted(written), f"{task}: {len(set(written) - set(ids))} samples never claimed"
            assert producer.consumption(p, task)["acked"] == len(written)
        producer.clear(p)


def test_a_token_budget_claim_takes_whole_groups_while_they_fit(client):
    p = part()
    lens = [8, 8, 4, 4, 30, 30, 2, 2]
    data = batch(8)
    data["input_lengths"] = torch.tensor(lens)
    tags = [{"group_id": f"g{i // 2}", "group_size": 2} for i in range(8)]
    meta = client.put_samples(p, data, tags=tags)
    first = client.claim(p, "train", max_tokens=30, fields=["input_ids"],
                         group_key="group_id", timeout=5)
    assert first.sample_ids == meta.sample_ids[:4] and sum(first.lengths) == 24 and not first.over_budget
    big = client.claim(p, "train", max_tokens=30, fields=["input_ids"], group_key="group_id", timeout=5)
    assert big.sample_ids == meta.sample_ids[4:6] and big.over_budget  # 60 tokens: a group alone over the budget
    with pytest.raises(E.NotReadyError, match="4 tokens, min_tokens=30"):
        client.claim(p, "train", max_tokens=30, fields=["input_ids"], group_key="group_id", timeout=0.2)
    last = client.claim(p, "train", max_tokens=30, min_tokens=4, fields=["input_ids"], group_key="group_id",
                        timeout=0.2)
    assert last.sample_ids == meta.sample_ids[6:] and last.lengths == [2, 2]
    got = client.read_columns(last, ["input_ids"])
    assert got["input_ids"].shape == (2, 2) and torch.equal(got["input_ids"], data["input_ids"][6:, :2])
    with pytest.raises(E.InvalidArgumentError, match="token field"):
        client.claim(p, "train", max_tokens=30, fields=["input_lengths"], timeout=0)
    client.clear(p)


def test_metrics_show_each_tasks_consumption_and_claim_waits(live):
    from scraping import scrape

    p = part()
    with rlplane.connect(live.url, token=live.token) as c:
        c.put_samples(p, batch(10))
        before = scrape(live.url)
        c.ack(c.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=5), "train")
        c.claim(p, "train", batch_size=2, fields=["input_ids"], timeout=5)
        after = scrape(live.url)
        got = {state: after[("rlplane_consumption_samples", (("partition", p), ("state", state), ("task", "train")))]
               for state in ("pending", "claimed", "acked", "expired")}
        assert got == {"pending": 4, "claimed": 2, "acked": 4, "expired": 0}
        count = ("rlplane_claim_wait_seconds_count", ())
        assert after[count] - before.get(count, 0) == 2
        c.clear(p)
