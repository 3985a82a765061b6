"""A claim costs what it takes, not the backlog: the oldest ``batch_size`` ready samples
are looked for in windows of growing size, and a claim that found nothing ready looks
next time only at the slots that changed since (new samples, new rows or tags, samples
given back). Every change that can make a sample claimable must still be seen: these
tests make each one happen below where the last claim stopped looking."""

import threading

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane_service.ledger import SCAN_WINDOW
from rlplane_service.native.index import Partition
from rlplane_service.native.local import LocalEngine

SECRET = b"claim-scan-secret"


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        yield eng


@pytest.fixture
def client(engine):
    c = Client(default_registry(), NativeTransport({"controller": engine.server.endpoint, "secret": SECRET.decode()},
                                                   timeout=30))
    yield c
    c.close()


def tokens(b, s=4, start=0):
    return {"input_ids": torch.arange(start, start + b * s).reshape(b, s), "input_lengths": torch.full((b,), s)}


@pytest.fixture
def looked(monkeypatch):
    """The slot ranges claims look at (the spans the ledger asks the index's live() and has())."""
    spans = []
    live, has = Partition.live, Partition.has

    def looking(self, start=0, stop=None):
        spans.append((start, self.used if stop is None else min(stop, self.used)))

    monkeypatch.setattr(Partition, "live", lambda self, start=0, stop=None: looking(self, start, stop) or
                        live(self, start, stop))
    monkeypatch.setattr(Partition, "has", lambda self, name, start=0, stop=None: looking(self, start, stop) or
                        has(self, name, start, stop))
    return spans


def claim(c, p, task, n, fields=("input_ids",), **kw):
    return c.claim(p, task, batch_size=n, fields=list(fields), timeout=0, **kw)


def test_the_oldest_batch_of_a_big_backlog_comes_first_found_in_windows_not_the_whole_backlog(client, looked):
    p = "scan-window"
    metas = [client.put_samples(p, tokens(4096, start=k * 4096 * 4), sample_ids=[f"s{k * 4096 + i}" for i in range(4096)])
             for k in range(6)]
    looked.clear()
    first = claim(client, p, "t", 64)
    assert first.sample_ids == [f"s{i}" for i in range(64)]
    assert max(z - a for a, z in looked) <= max(4 * 64, SCAN_WINDOW)  # not the 24,576 slots
    looked.clear()
    assert client.ack(first.subset(list(range(32))), "t") == 32  # a shard (names its samples), then the rest
    assert client.ack(first.subset(list(range(32, 64))), "t") == 32
    assert looked and max(z - a for a, z in looked) <= 64  # the lease's slots, not the backlog
    # Sparse readiness: only every 5,000th sample holds the field asked for. The windows
    # grow until they found the batch, oldest first; a short claim names an exact count.
    sparse = [100, 5100, 10100, 15100, 20100]
    for i in sparse:
        client.write_columns(metas[i // 4096].subset([i % 4096]), {"prev_logprobs": torch.zeros(1, 4)})
    want = ("input_ids", "prev_logprobs")
    assert claim(client, p, "u", 3, want).sample_ids == [f"s{i}" for i in sparse[:3]]
    with pytest.raises(E.NotReadyError, match=r"2 of 3 samples"):
        claim(client, p, "u", 3, want)
    assert claim(client, p, "u", 3, want, min_batch=2).sample_ids == [f"s{i}" for i in sparse[3:]]


def test_a_claim_that_found_nothing_looks_at_new_slots_only_and_sees_every_change_below(client, looked):
    p = "scan-floor"
    metas = [client.put_samples(p, tokens(2000, start=k * 8000), sample_ids=[f"b{k * 2000 + i}" for i in range(2000)])
             for k in range(3)]
    want = ("input_ids", "prev_logprobs")
    with pytest.raises(E.NotReadyError):
        claim(client, p, "train", 8, want)
    looked.clear()
    client.put_samples(p, tokens(1, start=10**6), sample_ids=["new"])
    with pytest.raises(E.NotReadyError):
        claim(client, p, "train", 8, want)
    assert looked and max(z - a for a, z in looked) <= 1  # the one new slot, not the 6,000 behind it
    # A field written to old samples, far below where it stopped looking: they are claimable.
    old = metas[0].subset([5, 6])
    client.write_columns(old, {"prev_logprobs": torch.zeros(2, 4)})
    got = claim(client, p, "train", 8, want, min_batch=1)
    assert got.sample_ids == ["b5", "b6"]
    # Given back (nack): claimable again, though the claim that took them looked past them.
    with pytest.raises(E.NotReadyError):
        claim(client, p, "train", 8, want)
    client.nack(got, "train")
    assert claim(client, p, "train", 8, want, min_batch=1).sample_ids == ["b5", "b6"]


def test_a_partial_rollout_finished_below_where_claims_stopped_looking_is_claimed(client):
    p = "scan-finish"
    first = client.put_samples(p, tokens(2), sample_ids=["r0", "r1"], finished=False)
    client.put_samples(p, tokens(100, start=100), sample_ids=[f"f{i}" for i in range(100)])
    assert claim(client, p, "train", 100, min_batch=1).sample_ids == [f"f{i}" for i in range(100)]
    with pytest.raises(E.NotReadyError):
        claim(client, p, "train", 2)
    client.extend(first, {"input_ids": torch.ones(2, 1, dtype=torch.int64), "input_lengths": torch.ones(2, dtype=torch.int64)},
                  finished=True)
    assert claim(client, p, "train", 2).sample_ids == ["r0", "r1"]


def test_a_put_committed_after_a_later_one_is_claimed(client, monkeypatch):
    """Slots are taken at the reserve: a put reserved first and committed last lies below
    the slots a claim found before it committed."""
    p = "scan-order"
    monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # reserve, write, then commit
    held, go = threading.Event(), threading.Event()
    real = NativeTransport._land_blocks

    def land(self, sent, deadline, *rest):
        if threading.current_thread().name == "slow-writer":
            held.set()
            assert go.wait(20)
        return real(self, sent, deadline, *rest)

    monkeypatch.setattr(NativeTransport, "_land_blocks", land)
    slow = threading.Thread(target=lambda: client.put_samples(p, tokens(3), sample_ids=["a0", "a1", "a2"]),
                            name="slow-writer")
    slow.start()
    assert held.wait(20)
    client.put_samples(p, tokens(2, start=50), sample_ids=["b0", "b1"])
    assert claim(client, p, "train", 8, min_batch=1).sample_ids == ["b0", "b1"]
    with pytest.raises(E.NotReadyError):
        claim(client, p, "train", 8)
    go.set()
    slow.join(20)
    assert claim(client, p, "train", 8, min_batch=1).sample_ids == ["a0", "a1", "a2"]
