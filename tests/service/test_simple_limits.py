"""The TransferQueue backend (``simple``) at its limits: a write past its capacity is a
typed StorageFullError (HTTP 507), keeps nothing of itself, and loses nothing already
stored; a storage unit that dies fails the calls that need it within seconds, named."""

import os
import uuid

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E

ARGS = {"store_name": "tq-tiny", "backend": "simple", "storage_units": 1, "capacity": 4}


def part() -> str:
    return f"full-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def tiny_simple(own_app):
    """An app whose one TransferQueue storage unit holds 4 samples, at /tq-tiny."""
    with own_app(ARGS, "/tq-tiny") as url:
        yield url


def batch(n: int, start: int = 0) -> dict:
    ids = torch.arange(start, start + n * 8, dtype=torch.int64).reshape(n, 8)
    return {"input_ids": ids, "input_lengths": torch.full((n,), 8)}


@pytest.mark.parametrize("transport", ["tq", "http"])
def test_a_write_past_capacity_is_storage_full_and_keeps_what_was_stored(tiny_simple, transport):
    with rlplane.connect(tiny_simple, transport=transport) as client:
        kept = part()
        meta = client.put_samples(kept, batch(3), sample_ids=["a", "b", "c"])
        over = part()
        with pytest.raises(E.StorageFullError) as err:
            client.put_samples(over, batch(2, 100), sample_ids=["x", "y"])
        assert "RLPLANE_CAPACITY" in str(err.value)
        assert over not in client.partitions()  # no ghost ids of the refused write
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(3)["input_ids"])
        client.clear(kept, ["c"])
        again = client.put_samples(over, batch(2, 100), sample_ids=["x", "y"])  # the room it freed takes them
        assert torch.equal(client.read_columns(again, ["input_ids"])["input_ids"], batch(2, 100)["input_ids"])
        client.clear(kept)
        client.clear(over)


def test_storage_full_is_http_507_with_the_typed_error(tiny_simple):
    from rlplane.codec import encode
    from rlplane.envelope import pack

    with rlplane.connect(tiny_simple, transport="http") as client:
        meta = client.put_samples(part(), batch(4))  # the store is full now
        work = batch(1, 500)
        enc = encode(client.registry, work, work["input_lengths"], sample_ids=["z"])
        body = pack({"sample_ids": ["z"], "tags": list(enc.tags)}, enc.columns)
        r = httpx.post(f"{tiny_simple}/v1/data/{part()}/put", content=body, timeout=30)
        assert r.status_code == 507 and r.json()["error"] == "StorageFullError", r.text
        client.clear(meta.partition)


def test_a_killed_storage_unit_fails_calls_within_seconds_naming_it(tiny_simple, readyz):
    """Last in this module (it leaves the app without its unit). TransferQueue retries a
    dead unit for minutes; rlplane gives the call up within seconds, naming the unit: a put
    is UnavailableError; a read of what it held is UnavailableError until the service has
    declared the unit lost, MissingDataError "lost with" it after (test_unit_loss.py)."""
    import time

    import ray

    with rlplane.connect(tiny_simple, transport="tq") as client:
        meta = client.put_samples(part(), batch(2))
        unit = ray.get_actor("tq-tiny-tq-unit-0", namespace="rlplane")
        pid = ray.get(unit.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        ray.kill(unit, no_restart=True)
        deadline = time.monotonic() + 30  # the kill is asynchronous: wait until the process is gone
        while _alive(pid):
            assert time.monotonic() < deadline, f"storage unit process {pid} still runs 30 s after ray.kill"
            time.sleep(0.05)
        for call, typed in ((lambda: client.read_columns(meta, ["input_ids"]), (E.UnavailableError, E.MissingDataError)),
                            (lambda: client.put_samples(part(), batch(1)), E.UnavailableError)):
            start = time.monotonic()
            with pytest.raises(typed) as err:
                call()
            assert time.monotonic() - start < 10
            assert "tq-tiny-tq-unit-0" in str(err.value)
    r = readyz(tiny_simple, lambda r: r.status_code == 503)
    assert r.status_code == 503 and "tq-tiny-tq-unit-0" in r.json()["reason"]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
