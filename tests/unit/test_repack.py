"""A partition cleared sample by sample renumbers its slots (Partition.repack): its index
follows what it holds, not every sample it ever held, and nothing a user sees changes:
reads, claims (groups, staleness, leases taken before), writes in flight, rows stored once
across puts, the commit log and a controller restart. In one process plus storage units."""

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_grpo
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"repack-test-secret"


@pytest.fixture
def eng():
    with LocalEngine(2, secret=SECRET, lease_s=30, replicas=2) as e:
        e.core.REPACK_MIN_SLOTS = 64
        yield e


def connect(eng: LocalEngine) -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30, data_path="shm"))


def repack(eng: LocalEngine) -> int:
    """What the controller's loops do every 2 s: forget what the log no longer needs, then renumber."""
    eng.core._compact()
    eng.core._compact()
    return eng.core._repack_all()


def same(c: Client, w, meta) -> None:
    got = c.read_columns(meta, list(w.fields))
    assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []


def churn(c: Client, p: str, rounds: int, n: int = 16) -> None:
    for k in range(rounds):
        m = c.put_samples(p, text_step(n, 16, seed=k).fields)
        c.clear(p, m.sample_ids)


def put_high(c: Client, p: str, fields, **kw):
    """Put ``fields`` above slots that a renumbering takes away: they move down in it. (A
    sample kept meanwhile keeps the partition: one whose last sample goes starts anew.)"""
    anchor = c.put_samples(p, text_step(1, 16, seed=99).fields)
    churn(c, p, 4)
    meta = c.put_samples(p, fields, **kw)
    c.clear(p, anchor.sample_ids)
    return meta


def test_a_streaming_partition_keeps_its_samples_claims_and_leases_through_renumbering(eng):
    with connect(eng) as c:
        early = c.put_samples("s", text_step(16, 16, seed=0).fields, tags=[
            {"group_id": f"e{i // 4}", "group_size": 4, "policy_version": 0} for i in range(16)])
        seen = c.claim("s", "peek", batch_size=16, fields=["input_ids"], group_key="group_id", timeout=0,
                       current_version=0, max_staleness=0)  # the tag caches and peek's cursor now hold slots 0-15
        keep = text_step(8, 64, seed=1)
        kept = put_high(c, "s", keep.fields, tags=[{"group_id": i // 4, "group_size": 4, "policy_version": 0}
                                                    for i in range(8)])
        assert c.ack(seen, "peek") == 16
        c.clear("s", early.sample_ids)
        done = c.claim("s", "logprob", batch_size=4, fields=["input_ids"], timeout=0)
        assert c.ack(done, "logprob") == 4
        held = c.claim("s", "logprob", batch_size=4, fields=["input_ids"], timeout=0)  # leased across the renumbering
        churn(c, "s", 12)
        w = text_step(8, 64, seed=2)
        late = c.put_samples("s", w.fields, tags=[{"group_id": 10 + i // 4, "group_size": 4, "policy_version": 3}
                                                  for i in range(8)])
        c.clear("s", late.sample_ids[:1])  # one member of a group gone: the group is never complete
        used = eng.core._parts["s"].used
        assert repack(eng) == 1
        part = eng.core._parts["s"]
        assert part.used < used // 4 and part.used >= 15
        same(c, keep, kept)
        same(c, w.select(list(range(1, 8))), late.subset(list(range(1, 8))))
        assert c.ack(held, "logprob") == 4  # the lease names the same samples as before
        assert c.consumption("s", "logprob")["acked"] == 8 and c.consumption("s", "logprob")["pending"] == 7
        got = c.claim("s", "train", batch_size=16, fields=["input_ids"], group_key="group_id", timeout=0, min_batch=1,
                      current_version=3, max_staleness=1)
        assert sorted(got.sample_ids) == sorted(late.sample_ids[4:])  # the old groups expired, the broken one waits
        assert c.consumption("s", "train")["expired"] == 8
        more = c.claim("s", "logprob", batch_size=16, fields=["input_ids"], timeout=0, min_batch=1)
        assert sorted(more.sample_ids) == sorted(late.sample_ids[1:])  # exactly the ones not handed out before
        peek = c.claim("s", "peek", batch_size=32, fields=["input_ids"], timeout=0, min_batch=1)
        assert sorted(peek.sample_ids) == sorted(kept.sample_ids + late.sample_ids[1:])
        records = c.transport.stats()["commit_log_records"]
        c.clear("s", late.sample_ids)
        repack(eng)  # the log forgets the late put's record: the book followed the renumbering
        assert c.transport.stats()["commit_log_records"] < records
        eng.kill_controller()
        assert eng.restart_controller()["samples"] == 8
        same(c, keep, kept)


def test_a_put_and_a_write_in_flight_land_on_their_samples_when_the_slots_are_renumbered(eng, monkeypatch):
    with connect(eng) as c:
        base = put_high(c, "s", text_step(4, 16, seed=3).fields)
        churn(c, "s", 8)
        commit = eng.core.op_commit
        done = []

        def renumber_first(*a, **kw):  # after the reservation, before its commit
            done.append(repack(eng))
            return commit(*a, **kw)

        monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # (a put in one message has no "in flight")
        monkeypatch.setattr(eng.core, "op_commit", renumber_first)
        w = text_step(4, 16, seed=4)
        new = c.put_samples("s", w.fields)
        assert done == [1]
        monkeypatch.setattr(eng.core, "op_commit", commit)
        churn(c, "s", 8)
        lp = torch.randn(4, 16)
        monkeypatch.setattr(eng.core, "op_commit", renumber_first)
        c.write_columns(base, {"prev_logprobs": lp})
        assert done == [1, 1]
        monkeypatch.setattr(eng.core, "op_commit", commit)
        same(c, w, new)
        got = c.read_columns(base, ["prev_logprobs"])["prev_logprobs"]
        assert all(torch.equal(got[i, :n], lp[i, :n]) for i, n in enumerate(base.lengths))

        def clear_then_renumber(*a, **kw):  # one of the write's samples goes in between
            eng.core.op_clear({"op": "clear", "p": "s", "ids": base.sample_ids[:1]}, {}, [])
            return renumber_first(*a, **kw)

        churn(c, "s", 8)
        monkeypatch.setattr(eng.core, "op_commit", clear_then_renumber)
        with pytest.raises(E.MissingDataError) as err:
            c.write_columns(base, {"prev_logprobs": torch.zeros(4, 16)})
        assert list(err.value.missing) == base.sample_ids[:1] and done == [1, 1, 1]
        monkeypatch.setattr(eng.core, "op_commit", commit)
        base = base.subset([1, 2, 3])
        assert torch.equal(c.read_columns(base, ["prev_logprobs"])["prev_logprobs"], got[1:])  # nothing was written
        eng.kill_controller()  # what the log replays lands on the same samples too
        assert eng.restart_controller()["samples"] == 7
        same(c, w, new)
        assert torch.equal(c.read_columns(base, ["prev_logprobs"])["prev_logprobs"], got[1:])


def test_rows_stored_once_are_still_found_after_the_slots_are_renumbered(eng):
    w = vlm_grpo(batch=8, seqlen=32, seed=15)  # one group: every member carries the same images
    with connect(eng) as c:
        first = put_high(c, "g", w.select([0]).fields)
        churn(c, "g", 8)
        assert repack(eng) == 1
        rest = c.put_samples("g", w.select(list(range(1, 8))).fields)
        assert c.transport.stats()["shared_bytes"] > 0  # the first member's rows were found under their keys
        same(c, w.select([0]), first)
        same(c, w.select(list(range(1, 8))), rest)


def test_a_lease_whose_samples_were_cleared_acks_the_rest_after_renumbering(eng):
    with connect(eng) as c:
        gone = put_high(c, "s", text_step(3, 16, seed=9).fields)  # their put's record is forgotten once cleared
        c.put_samples("s", text_step(3, 16, seed=10).fields)
        lease = c.claim("s", "train", batch_size=6, fields=["input_ids"], timeout=0)
        c.clear("s", gone.sample_ids)
        churn(c, "s", 8)
        last = c.put_samples("s", text_step(2, 16, seed=11).fields)
        assert repack(eng) == 1
        assert c.ack(lease, "train") == 3
        with pytest.raises(E.LeaseError):
            c.ack(lease, "train")
        assert c.consumption("s", "train") == {
            "samples": 5, "ready": 5, "claimed": 0, "acked": 3, "expired": 0, "pending": 2, "redelivered": 0}
        got = c.claim("s", "train", batch_size=8, fields=["input_ids"], timeout=0, min_batch=1).sample_ids
        assert sorted(got) == sorted(last.sample_ids)


def test_renumbering_keeps_order_and_only_what_is_named():
    from rlplane_service.native.index import COMMITTED, Partition

    part = Partition()
    slots = part.take([f"s{i}" for i in range(10)])
    part.state[slots] = COMMITTED
    fi = part.field_index("x")
    fi.cover(slots[:8])  # written at slots 0-7 only: its arrays end before slot 8 ...
    fi.block[slots[:8]] = np.arange(100, 108)
    fi.keyed = {b"k3": 3, b"k4": 4}
    part.logged[5] = 1  # a cleared slot a log record still names
    for s in (1, 4, 5, 8):
        part.state[s] = 0
        del part.ids[f"s{s}"]
    keep = np.flatnonzero((part.state[:10] != 0) | (part.logged[:10] > 0))
    remap = part.repack(keep)
    assert part.used == 7 and remap.tolist() == [0, -1, 1, 2, -1, 3, 4, 5, -1, 6]
    assert part.ids == {"s0": 0, "s2": 1, "s3": 2, "s6": 4, "s7": 5, "s9": 6}
    assert fi.upto("block", part.used).tolist() == [100, 102, 103, 105, 106, 107, -1] and fi.keyed == {b"k3": 2}
    assert fi.size == 64  # ... and still grow only as far as the field is written
    assert part.logged[3] == 1 and part.state.size >= part.used


def test_no_renumbering_while_a_batch_of_log_entries_is_being_written(eng):
    """A failed entry's undo names its samples by slot: the renumbering waits for the batch
    (a few tries, 5 ms apart), and a round that never finds a gap changes nothing."""
    import threading

    with connect(eng) as c:
        kept = put_high(c, "s", text_step(4, 16, seed=12).fields)
        core = eng.core
        used = core._parts["s"].used
        core._compact(), core._compact()
        with core._lock:
            core._unwritten = core._seq  # as flush() holds it while the units take a batch
        core.REPACK_TRIES = 3
        assert core._repack_all() == 0 and core._parts["s"].used == used
        core.REPACK_TRIES = 400
        threading.Timer(0.05, lambda: setattr(core, "_unwritten", None)).start()
        assert core._repack_all() == 1 and core._parts["s"].used < used
        same(c, text_step(4, 16, seed=12), kept)


def test_a_partition_whose_cleared_slots_the_log_still_names_is_left_as_it_is(eng):
    """A put's record stays while one sample it made is stored, and with it every slot it
    named: renumbering would keep them all, so it does not run (nor every round again)."""
    with connect(eng) as c:
        for k in range(6):  # each put keeps its first sample: its record names all 16
            m = c.put_samples("s", text_step(16, 16, seed=k).fields)
            c.clear("s", m.sample_ids[1:])
        core = eng.core
        used = core._parts["s"].used
        assert 2 * len(core._parts["s"].ids) <= used and used >= core.REPACK_MIN_SLOTS
        assert repack(eng) == 0 and core._parts["s"].used == used and core.repacked == 0
