"""The consumption ledger's semantics, on its own index (no service)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rlplane import errors as E
from rlplane.claims import ClaimRequest
from rlplane_service.ledger import Ledger, SimpleIndexes


def _ledger(lease_s: float = 60.0) -> tuple[Ledger, SimpleIndexes]:
    idx = SimpleIndexes()
    return Ledger(idx.get, lease_s=lease_s), idx


def _put(idx: SimpleIndexes, p: str, ids: list[str], fields=("input_ids",), tags=None) -> None:
    idx.record(p, ids, list(fields), tags or [{} for _ in ids], create=True)


def _req(task: str = "train", n: int = 4, fields=("input_ids",), **kw) -> ClaimRequest:
    args = dict(min_batch=kw.pop("min_batch", n), wait_s=kw.pop("wait_s", 0.0))
    return ClaimRequest("p", task, n, tuple(fields), args["wait_s"], args["min_batch"], **kw)


def test_claims_are_oldest_first_and_once_per_task():
    led, idx = _ledger()
    _put(idx, "p", [f"s{i}" for i in range(10)])
    a = led.claim(_req(n=4), final=True)
    b = led.claim(_req(n=4), final=True)
    assert a["ids"] == ["s0", "s1", "s2", "s3"] and b["ids"] == ["s4", "s5", "s6", "s7"]
    other = led.claim(_req(task="logprob", n=10), final=True)
    assert other["ids"] == [f"s{i}" for i in range(10)]  # tasks are independent
    with pytest.raises(E.NotReadyError, match="2 of 4 samples"):
        led.claim(_req(n=4), final=True)
    assert led.claim(_req(n=4), final=False) is None  # would wait
    short = led.claim(_req(n=4, min_batch=2), final=True)
    assert short["ids"] == ["s8", "s9"]


def test_a_sample_is_ready_only_when_every_asked_field_is_written():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"])
    assert led.claim(_req(n=2, fields=("input_ids", "prev_logprobs")), final=False) is None
    idx.record("p", ["b"], ["prev_logprobs"], [{}], create=False)
    got = led.claim(_req(n=2, fields=("input_ids", "prev_logprobs"), min_batch=1), final=True)
    assert got["ids"] == ["b"] and set(got["fields"]) == {"input_ids", "prev_logprobs"}


def test_unknown_partition_waits_like_an_empty_one():
    led, _ = _ledger()
    assert led.claim(_req(), final=False) is None
    with pytest.raises(E.NotReadyError):
        led.claim(_req(), final=True)


def test_groups_are_handed_out_whole_and_only_when_complete():
    led, idx = _ledger()
    tags = lambda g, k: [{"group_id": g, "group_size": 3} for _ in range(k)]  # noqa: E731
    _put(idx, "p", ["g0a", "g0b"], tags=tags("g0", 2))
    _put(idx, "p", ["g1a", "g1b", "g1c"], tags=tags("g1", 3))
    got = led.claim(_req(n=4, group_key="group_id", min_batch=1), final=True)
    assert got["ids"] == ["g1a", "g1b", "g1c"]  # g0 is incomplete; g1 whole though the batch has room for 4
    _put(idx, "p", ["g0c"], tags=tags("g0", 1))
    assert led.claim(_req(n=3, group_key="group_id"), final=True)["ids"] == ["g0a", "g0b", "g0c"]
    _put(idx, "p", ["x1", "x2"], tags=tags("big", 2) and [{"group_id": "big", "group_size": 2}] * 2)
    with pytest.raises(E.InvalidArgumentError, match="does not fit"):
        led.claim(_req(n=1, group_key="group_id"), final=True)


def test_stale_samples_are_expired_and_counted_never_handed_out():
    led, idx = _ledger()
    _put(idx, "p", ["old0", "old1", "new0", "new1"],
         tags=[{"policy_version": 0}, {"policy_version": 0}, {"policy_version": 2}, {"policy_version": 2}])
    got = led.claim(_req(n=4, min_batch=1, current_version=2, max_staleness=1), final=True)
    assert got["ids"] == ["new0", "new1"]
    c = led.consumption("p", "train")
    assert c["expired"] == 2 and c["claimed"] == 2 and c["pending"] == 0


def test_leases_ack_nack_and_expiry():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b", "c", "d"])
    t = time.monotonic()
    first = led.claim(_req(n=2, lease_s=30.0), final=True, now=t)
    assert led.nack("p", "train", first["lease"], None) == 2  # back at once
    again = led.claim(_req(n=2, lease_s=30.0), final=True, now=t)
    assert again["ids"] == ["a", "b"]
    assert led.expire(now=t + 31) == 1  # the consumer died: lease lapsed
    with pytest.raises(E.LeaseError, match="expired or was never granted"):
        led.ack("p", "train", again["lease"], None)
    third = led.claim(_req(n=4), final=True)
    assert third["ids"] == ["a", "b", "c", "d"]  # redelivered to the same task
    assert led.ack("p", "train", third["lease"], ["a", "b"]) == 2
    assert led.ack("p", "train", third["lease"], ["c", "d"]) == 2
    with pytest.raises(E.LeaseError):
        led.ack("p", "train", third["lease"], None)  # settled
    c = led.consumption("p", "train")
    assert (c["acked"], c["claimed"], c["pending"], c["redelivered"]) == (4, 0, 0, 2)


def test_a_cleared_and_remade_partition_starts_fresh():
    led, idx = _ledger()
    _put(idx, "p", ["a"])
    led.claim(_req(n=1), final=True)
    idx.drop("p", None)
    _put(idx, "p", ["a"])
    assert led.claim(_req(n=1), final=True)["ids"] == ["a"]


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), "batch_size"), (dict(n=2, min_batch=3), "min_batch"), (dict(fields=()), "fields"),
    (dict(current_version=3), "go together"), (dict(lease_s=-1.0), "lease_s"),
])
def test_bad_claims_fail_at_once(kw, match):
    with pytest.raises(E.InvalidArgumentError, match=match):
        _req(**kw).check()


def test_acked_claims_move_the_cursor_past_every_consumed_sample():
    """A claim starts at the task's cursor, so its cost does not grow with what was consumed."""
    led, idx = _ledger()
    _put(idx, "p", [f"s{i}" for i in range(20000)])
    for _ in range(300):
        led.ack("p", "train", led.claim(_req(n=64), final=True)["lease"], None)
    ts = led._parts["p"].tasks["train"]
    assert ts.cursor == 300 * 64 and np.all(ts.state[: ts.cursor] == 2)


def test_tags_of_a_put_in_flight_are_read_once_it_commits():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"], tags=[{"group_id": "g", "group_size": 4, "policy_version": 5}] * 2)
    part = idx["p"]
    _put(idx, "p", ["c", "d"], tags=[{}, {}])  # reserved: slots taken, tags and liveness not yet
    part.alive[2:4] = False
    part.tags[2:4] = None
    assert led.claim(_req(n=4, group_key="group_id"), final=False) is None
    part.tags[2:4] = [{"group_id": "g", "group_size": 4, "policy_version": 5}] * 2  # the commit
    part.alive[2:4] = True
    got = led.claim(_req(n=4, group_key="group_id", current_version=6, max_staleness=1), final=True)
    assert got["ids"] == ["a", "b", "c", "d"]
