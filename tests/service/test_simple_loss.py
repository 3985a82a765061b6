"""A TransferQueue storage unit that dies on the ``simple`` backend: the samples it held are
lost, and the store says so instead of offering them. Within 10 s of the kill a read of
them is a MissingDataError naming the unit (on the direct and the HTTP transport), they
leave listings, /metrics and claims; the other unit's samples read bit for bit; a put
either lands whole or fails typed within seconds, naming the unit."""

import time
import uuid

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E

ARGS = {"store_name": "tq-loss", "backend": "simple", "storage_units": 2}
DEAD = "tq-loss-tq-unit-1"


def part() -> str:
    return f"loss-{uuid.uuid4().hex[:8]}"


def batch(n: int, start: int = 0) -> dict:
    ids = torch.arange(start, start + n * 8, dtype=torch.int64).reshape(n, 8)
    return {"input_ids": ids, "input_lengths": torch.full((n,), 8)}


@pytest.fixture(scope="module")
def two_units(own_app):
    with own_app(ARGS, "/tq-loss") as url:
        yield url


def one_by_one(client, meta) -> dict[str, torch.Tensor | E.MissingDataError]:
    """Each sample of ``meta`` read alone: its row, or the MissingDataError it raised."""
    out = {}
    for i, sid in enumerate(meta.sample_ids):
        try:
            out[sid] = client.read_columns(meta.subset([i]), ["input_ids"])["input_ids"][0]
        except E.MissingDataError as err:
            out[sid] = err
    return out


def test_a_killed_unit_loses_its_samples_named_and_nothing_else(two_units):
    import ray

    p = part()
    with rlplane.connect(two_units, transport="tq") as client, rlplane.connect(two_units, transport="http") as web:
        meta = client.put_samples(p, batch(8))
        assert web.claim(p, "train", batch_size=1, fields=["input_ids"], timeout=0).sample_ids  # the ledger knows them
        unit = ray.get_actor(DEAD, namespace="rlplane")
        ray.kill(unit, no_restart=True)
        killed = time.monotonic()
        while killed + 30 > time.monotonic():  # the kill is asynchronous
            try:
                ray.get(unit.get_zmq_server_info.remote(), timeout=5)
                time.sleep(0.1)
            except ray.exceptions.ActorDiedError:
                break
        killed = time.monotonic()
        while True:  # until the service has declared the unit lost; typed errors only, and within 10 s
            try:
                client.read_columns(meta, ["input_ids"])
                pytest.fail("a read of samples on a dead unit succeeded")
            except E.MissingDataError as err:
                if "lost" in str(err):
                    missing = err
                    break
            except E.UnavailableError as err:
                assert err.component in (DEAD, None) and DEAD in str(err)
            assert time.monotonic() - killed < 10, "the unit was not declared lost within 10 s"
        assert DEAD in str(missing) and set(missing.missing) < set(meta.sample_ids)  # a proper subset: the lost ones
        lost = set(missing.missing)

        want = batch(8)["input_ids"]
        for reader in (client, web):
            rows = one_by_one(reader, meta)
            for i, sid in enumerate(meta.sample_ids):
                if sid in lost:
                    assert isinstance(rows[sid], E.MissingDataError) and DEAD in str(rows[sid]), rows[sid]
                else:
                    assert torch.equal(rows[sid], want[i]), sid
        assert client.transport.describe(p).num_samples == 8 - len(lost)
        claimed = web.claim(p, "ref", batch_size=8, fields=["input_ids"], timeout=0, min_batch=1)
        assert not set(claimed.sample_ids) & lost  # claims skip what was lost
        status = httpx.get(f"{two_units}/v1/status", timeout=30).json()
        assert status["loss"]["lost_units"] == [DEAD] and status["loss"]["lost_samples"] == len(lost)
        time.sleep(1.1)  # /metrics reuses a body for a second
        metrics = httpx.get(f"{two_units}/metrics", timeout=30).text
        assert f"rlplane_lost_samples {float(len(lost))}" in metrics
        assert f'rlplane_partition_samples{{partition="{p}"}} {float(8 - len(lost))}' in metrics
        r = httpx.get(f"{two_units}/readyz", timeout=30)
        assert r.status_code == 503 and DEAD in r.json()["reason"]

        landed = 0
        for k in range(4):  # a put lands whole on the live unit, or fails typed, naming the dead one
            q, start = part(), time.monotonic()
            try:
                again = client.put_samples(q, batch(2, 100 * k))
                assert torch.equal(client.read_columns(again, ["input_ids"])["input_ids"], batch(2, 100 * k)["input_ids"])
                landed += 1
            except E.UnavailableError as err:
                assert DEAD in str(err)
            assert time.monotonic() - start < 10
        assert landed < 4  # TransferQueue routes some of them to the dead unit
        kept = set(meta.sample_ids) - lost
        assert set(client.transport.describe(p).sample_ids) == kept  # the failed puts left nothing in p
