"""The commit log holds what the store holds, not its history: a partition cleared sample by
sample (a streaming buffer) lets the storage units forget the records a rebuild no longer
needs, and a restarted controller still serves every stored sample bit for bit and none of
the cleared ones (rlplane_service.native.logbook). In one process plus storage units, no Ray."""

import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.meta import SampleMeta
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_grpo
from rlplane.transports.native import NativeTransport
from rlplane.wire import ints
from rlplane_service.native import recovery
from rlplane_service.native.index import COMMITTED, FREE, Partition
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.logbook import LogBook

SECRET = b"logbook-test-secret"


def connect(eng: LocalEngine, path: str = "shm") -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30, data_path=path))


def compact(eng: LocalEngine) -> None:
    """Two rounds, as the controller's loop runs them: the puts first, then the clears they freed."""
    eng.core._compact()
    eng.core._compact()


def log_entries(eng: LocalEngine) -> list[int]:
    return [len(core.log) for core in eng.cores]


def restart(eng: LocalEngine) -> dict:
    eng.kill_controller()
    return eng.restart_controller()


def same(c: Client, w, meta) -> None:
    got = c.read_columns(meta, list(w.fields))
    assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []


# -- the book alone ---------------------------------------------------------------------

def part_of(n: int) -> tuple[Partition, np.ndarray]:
    part = Partition()
    slots = part.take([f"s{i}" for i in range(n)])
    part.state[slots] = COMMITTED
    return part, slots


def test_a_clear_is_forgotten_only_after_every_put_that_names_its_samples_is():
    book = LogBook()
    part, slots = part_of(4)
    book.put(1, part, slots, [11], pins=True)
    book.put(2, part, slots[:2], [12], pins=False)  # a write of two of them
    part.state[slots[:2]] = FREE
    part.forgets += 1
    book.blocks_gone([11, 12])  # (block 11 also held rows of s2, s3 until here: they were overwritten)
    book.cleared(3, part, slots[:2], whole=False)
    assert book.forgettable(below=4) == [2]  # the put of new samples still creates s2 and s3
    book.forgotten([2])
    assert book.forgettable(below=4) == []  # the put that made s0, s1 still names them: the clear stays
    part.state[slots[2:]] = FREE
    part.forgets += 1
    assert book.forgettable(below=4) == [1]
    book.forgotten([1])
    assert book.forgettable(below=4) == [3]
    book.forgotten([3])
    assert len(book) == 0 and not part.logged.any() and book.stats()["forgot"] == 3


def test_a_record_is_kept_while_a_block_it_wrote_is_referenced_and_entries_not_yet_written_are_never_named():
    book = LogBook()
    part, slots = part_of(2)
    book.put(5, part, slots, [21, 22], pins=True)
    part.state[slots] = FREE
    part.forgets += 1
    book.blocks_gone([21])
    assert book.forgettable(below=9) == []  # block 22 holds rows a later put shares
    book.blocks_gone([22])
    assert book.forgettable(below=5) == []  # entry 5 may still be staged in a batch being written
    assert book.forgettable(below=6) == [5]


def test_a_whole_clear_drops_the_partitions_records_and_goes_once_every_unit_took_it():
    book = LogBook()
    part, slots = part_of(3)
    book.put(1, part, slots, [31], pins=True)
    book.cleared(2, part, slots[:1], whole=False)
    book.cleared(3, part, slots, whole=True)  # a unit missed it: it must stay, to undo that unit's older records
    assert book.forgettable(below=10) == []
    again, more = part_of(2)
    book.put(4, again, more, [41], pins=True)
    book.cleared(5, again, more, whole=True, everywhere=True)  # the units dropped the older records themselves
    assert book.forgettable(below=5) == []  # a record staged before it may still reach a unit: its mark stays
    assert book.forgettable(below=6) == [5]
    book.forgotten([5])
    assert len(book) == 0


# -- the engine ---------------------------------------------------------------------------

def test_a_partition_cleared_sample_by_sample_keeps_only_the_records_of_what_it_holds():
    with LocalEngine(2, secret=SECRET, lease_s=30, replicas=2) as eng, connect(eng) as c:
        keep = text_step(4, 64, seed=1)
        kept = c.put_samples("stream", keep.fields, sample_ids=[f"keep-{i}" for i in range(4)])
        c.write_columns(kept, {"prev_logprobs": torch.randn(4, 64)})
        c.write_columns(kept, {"prev_logprobs": torch.randn(4, 64)})  # the first write's rows are gone: its record too
        logprobs = c.read_columns(kept, ["prev_logprobs"])["prev_logprobs"]
        for step in range(40):  # a streaming buffer: put, consume, clear what was consumed
            w = text_step(8, 64, seed=100 + step)
            m = c.put_samples("stream", w.fields, sample_ids=[f"s{step}-{i}" for i in range(8)])
            c.write_columns(m, {"advantages": torch.randn(8, 64)})
            c.clear("stream", m.sample_ids)
        last = text_step(8, 64, seed=7)
        lm = c.put_samples("stream", last.fields, sample_ids=[f"last-{i}" for i in range(8)])
        c.clear("stream", lm.sample_ids[:3])  # a partial clear of a put: its record and the clear stay
        assert min(log_entries(eng)) > 100  # 40 steps of records, before the controller's next round
        compact(eng)
        assert log_entries(eng) == [4, 4]  # keep's put and second write, last's put and the clear of 3 of it
        before = c.transport.describe("stream").sample_ids
        report = restart(eng)
        assert report["samples"] == 4 + 5 and report["lost_samples"] == 0 and report["ignored"] == 0
        assert sorted(c.transport.describe("stream").sample_ids) == sorted(before)
        same(c, keep, kept)
        assert torch.equal(c.read_columns(kept, ["prev_logprobs"])["prev_logprobs"], logprobs)
        same(c, last.select(list(range(3, 8))), lm.subset(list(range(3, 8))))
        with pytest.raises(E.MissingDataError):
            c.read_columns(lm.subset([0]), ["input_ids"])
        with pytest.raises(E.MissingDataError):
            c.read_columns(m.subset([0]), ["input_ids"])


def test_a_record_whose_rows_a_later_put_shares_stays_until_those_rows_go():
    w = vlm_grpo(batch=8, seqlen=64, seed=15)  # one group: every member carries the same images
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        first = c.put_samples("p", w.select([0]).fields)
        rest = c.put_samples("p", w.select(list(range(1, 8))).fields)  # its images are the first put's rows
        assert c.transport.stats()["shared_bytes"] > 0
        c.clear("p", first.sample_ids)
        compact(eng)
        report = restart(eng)  # the first put's record is replayed: the rows the others read are its block's
        assert report["samples"] == 7 and report["lost_samples"] == 0 and report["ignored"] == 0
        same(c, w.select(list(range(1, 8))), rest)
        with pytest.raises(E.MissingDataError):
            c.read_columns(first, ["input_ids"])
        c.clear("p", rest.sample_ids[:6])
        compact(eng)
        assert restart(eng)["samples"] == 1
        same(c, w.select([7]), rest.subset([6]))


def test_partial_rollouts_keep_their_state_through_compaction_and_a_restart():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        ids = torch.arange(6 * 4).reshape(6, 4)
        meta = c.put_samples("roll", {"input_ids": ids, "input_lengths": torch.full((6,), 4)}, finished=False)
        for k in range(3):
            more = torch.full((6, 2), 100 + k)
            meta = c.extend(meta, {"input_ids": more, "input_lengths": torch.full((6,), 2)}, finished=k == 2)
        other = c.put_samples("roll", {"input_ids": ids[:2], "input_lengths": torch.full((2,), 4)}, finished=False)
        compact(eng)
        restart(eng)
        got = c.read_columns(meta, ["input_ids"])["input_ids"]
        want = torch.cat([ids, torch.full((6, 2), 100), torch.full((6, 2), 101), torch.full((6, 2), 102)], dim=1)
        assert torch.equal(got, want)
        claimed = c.claim("roll", "train", batch_size=8, fields=["input_ids"], timeout=0, min_batch=1)
        assert sorted(claimed.sample_ids) == sorted(meta.sample_ids)  # the finished ones only
        assert sorted(c.claim("roll", "look", batch_size=8, fields=["input_ids"], timeout=0, min_batch=1,
                              unfinished=True).sample_ids) == sorted(meta.sample_ids + other.sample_ids)


def test_a_unit_that_does_not_answer_keeps_every_record_counted_as_held(monkeypatch):
    from rlplane_service.native import controller

    monkeypatch.setattr(recovery, "LOG_TIMEOUT_S", 0.5)
    monkeypatch.setattr(controller, "COMPACT_EVERY_S", 3600.0)  # only the compactions below (one of the loop's
    # between the count and the SIGSTOP forgot the cleared puts first, on a loaded machine)
    with LocalEngine(2, secret=SECRET, lease_s=30, replicas=2, processes=True) as eng, connect(eng) as c:
        c.put_samples("stream", text_step(1, 32, seed=9).fields, sample_ids=["keeper"])
        for step in range(3):
            m = c.put_samples("stream", text_step(4, 32, seed=step).fields, sample_ids=[f"s{step}-{i}" for i in range(4)])
            c.clear("stream", m.sample_ids)
        held = eng.core.book.stats()
        assert held["puts"] == 4 and held["clears"] == 3
        os.kill(eng.unit_pid(1), signal.SIGSTOP)  # not answering, not (yet) lost (the engine's stop resumes it)
        try:
            compact(eng)
            assert eng.core.book.stats() == held  # nothing counts as forgotten until every unit forgot it
        finally:
            os.kill(eng.unit_pid(1), signal.SIGCONT)
        compact(eng)
        assert eng.core.book.stats() == {"puts": 1, "clears": 0, "drops": 0, "forgot": 6}
        report = restart(eng)
        assert report["samples"] == 1 and report["entries"] == 1 and report["ignored"] == 0


def test_a_partition_per_step_leaves_nothing_in_the_units_logs():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        for step in range(20):
            w = text_step(4, 32, seed=step)
            c.put_samples(f"step-{step}", w.fields)
            c.clear(f"step-{step}")
        kept = c.put_samples("step-20", text_step(4, 32, seed=20).fields)
        assert min(log_entries(eng)) >= 20  # each whole clear's record, before the controller's next round
        compact(eng)
        assert log_entries(eng) == [1, 1] and [len(core.log._dropped) for core in eng.cores] == [0, 0]
        report = restart(eng)
        assert report["samples"] == 4 and report["partitions"] == 1
        same(c, text_step(4, 32, seed=20), kept)


def test_a_whole_clear_a_unit_missed_stays_to_undo_that_units_records(monkeypatch):
    monkeypatch.setattr(recovery, "LOG_TIMEOUT_S", 0.5)
    with LocalEngine(2, secret=SECRET, lease_s=30, processes=True) as eng, connect(eng) as c:
        c.put_samples("gone", text_step(4, 32, seed=1).fields)  # its record is on both units
        os.kill(eng.unit_pid(1), signal.SIGSTOP)
        try:
            eng.core._suspected(1, "stopped by the test")  # (the watch loop would find it so within seconds)
            c.clear("gone")  # written to the units that answer: unit 0
        finally:
            os.kill(eng.unit_pid(1), signal.SIGCONT)
        deadline = time.monotonic() + 20
        while 1 in eng.core._suspect and time.monotonic() < deadline:  # the watch loop finds it answering again
            time.sleep(0.1)
        assert 1 not in eng.core._suspect
        compact(eng)
        assert eng.core.book.stats()["drops"] == 0 and len(eng.core.book) == 0
        report = restart(eng)  # unit 1 still lists the put: the whole clear on unit 0 undoes it
        assert report["samples"] == 0 and report["partitions"] == 0 and report["lost_samples"] == 0
        assert c.transport.partitions() == []


def test_random_puts_writes_and_clears_rebuild_to_the_same_store_after_compaction():
    """A seeded mix of puts, writes, partial clears and whole clears over three partitions,
    compacting between them: the rebuilt store holds exactly the samples (and bytes) the
    old one did."""
    rng = random.Random(1234)
    with LocalEngine(3, secret=SECRET, lease_s=30, replicas=2) as eng, connect(eng) as c:
        live: dict[tuple[str, str], torch.Tensor] = {}  # (partition, id) -> its advantages row
        n = 0
        for step in range(60):
            p = rng.choice(["a", "b", "c"])
            held = [s for (q, s) in live if q == p]
            op = rng.random()
            if op < 0.45 or not held:
                k = rng.randint(1, 6)
                ids = [f"x{n + i}" for i in range(k)]
                n += k
                adv = torch.randn(k, 16)
                c.put_samples(p, {"input_ids": torch.arange(k * 16).reshape(k, 16), "input_lengths": torch.full((k,), 16),
                                  "advantages": adv}, sample_ids=ids)
                live.update({(p, s): adv[i] for i, s in enumerate(ids)})
            elif op < 0.7:
                ids = rng.sample(held, rng.randint(1, len(held)))
                adv = torch.randn(len(ids), 16)
                c.write_columns(SampleMeta(p, ids, lengths=[16] * len(ids), fields={"input_ids"}), {"advantages": adv})
                live.update({(p, s): adv[i] for i, s in enumerate(ids)})
            elif op < 0.95:
                ids = rng.sample(held, rng.randint(1, len(held)))
                c.clear(p, ids)
                for s in ids:
                    del live[(p, s)]
            else:
                c.clear(p)
                for key in [key for key in live if key[0] == p]:
                    del live[key]
            if step % 7 == 6:
                eng.core._compact()
        compact(eng)
        report = restart(eng)
        assert report["samples"] == len(live) and report["lost_samples"] == 0 and report["ignored"] == 0
        for p in ["a", "b", "c"]:
            ids = sorted(s for (q, s) in live if q == p)
            assert sorted(c.transport.describe(p).sample_ids if ids else []) == ids
            if ids:
                got = c.read_columns(SampleMeta(p, ids, lengths=[16] * len(ids)), ["advantages"])["advantages"]
                assert torch.equal(got, torch.stack([live[(p, s)] for s in ids]))
        assert sum(log_entries(eng)) < 3 * 40  # what the store holds, not its 60 steps' history


def test_only_the_controller_may_make_a_unit_forget_and_garbage_forgets_nothing():
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        w = text_step(4, 32, seed=3)
        meta = c.put_samples("p", w.fields)
        held = log_entries(eng)
        data = Channel(eng.units[0].endpoint, "u0", secret=SECRET)  # the data endpoint every client knows
        ctl = Channel(eng.units[0].control_endpoint, "u0", secret=eng.seal_key)
        try:
            with pytest.raises(E.ForbiddenError, match="controller only"):
                data.call({"op": "forget", "s": ints([1, 2, 3])}, timeout=5)
            for bad in ("1", [1, 2], b"\x01\x02\x03", ints(range(1 << 17))):
                with pytest.raises(E.WireFormatError):
                    ctl.call({"op": "forget", "s": bad}, timeout=5)
            assert ctl.call({"op": "ping"}, timeout=5)[0]["unit"] == "u0"
        finally:
            data.close()
            ctl.close()
        assert log_entries(eng) == held
        restart(eng)
        same(c, w, meta)


def _used(eng: LocalEngine) -> int:
    return sum(core.alloc.used_bytes for core in eng.cores)


def test_a_group_member_whose_images_it_found_stored_survives_compaction_and_a_restart(monkeypatch):
    """Members of one GRPO group put one at a time find their images stored by an earlier
    member, which is then cleared: once the log forgot the cleared members' records, the
    replay found no live row holding the images for the last member's put, skipped it, and
    the never-cleared member was gone. A replay trusts the rows its record says it found
    (checked when it committed; the units keep them while a row points at them)."""
    monkeypatch.setattr(recovery, "RESTART_HOLD_S", 1.0)  # (the frees after the restart wait less)
    w = vlm_grpo(batch=8, seqlen=32, seed=17)  # one group: every member has the same images
    w.fields["pixel_values_videos"] = w.fields["pixel_values"]  # two fields stored once, in one block (a second
    # field's rows were left sharing bytes no row held after the restart, and found by no later put)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        c = connect(eng)
        empty = _used(eng)
        m0 = c.put_samples("p", w.select([0]).fields)  # stores the images
        m1 = c.put_samples("p", w.select([1]).fields)  # finds them: shares m0's bytes
        c.clear("p", m0.sample_ids)  # m1 holds them now
        m2 = c.put_samples("p", w.select([2]).fields)  # finds them under m1
        c.clear("p", m1.sample_ids)  # m2 holds them
        compact(eng)
        assert eng.core.book.stats()["forgot"] >= 1
        rep = restart(eng)
        assert rep["samples"] == 1 and rep["skipped"] == 0 and rep["lost_samples"] == 0, rep
        got = c.read_columns(m2, sorted(m2.fields))
        assert diff_fields(c.registry, w.select([2]).fields, got, w.lengths[[2]], sample_ids=m2.sample_ids) == []
        images = w.select([3]).fields["pixel_values"].as_tensor().numel() * 2  # (stored bfloat16)
        before = c.transport.stats()
        assert before["shared_bytes"] == 0  # m2 holds both fields' bytes
        m3 = c.put_samples("p", w.select([3]).fields)  # the images are found under m2 after the rebuild too
        after = c.transport.stats()
        assert after["shared_bytes"] == 2 * images and after["live_bytes"] - before["live_bytes"] < images
        c.clear("p")
        c.close()
        deadline = time.monotonic() + 20  # (frees wait out the restart's hold)
        while _used(eng) > empty and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _used(eng) == empty and m3  # nothing of the images stays behind


@pytest.mark.parametrize("extend", [False, True])
def test_a_write_over_samples_one_of_which_was_cleared_survives_compaction_and_a_restart(extend):
    """Samples put one at a time, a write_columns (and an extend) over them together, then one
    cleared: the log forgot its put, and the replay skipped the whole write for naming a
    sample it never had: the other sample silently read its rows from before the write, or
    (after an extend) was lost."""
    one = lambda: {"input_ids": torch.arange(4).reshape(1, 4), "advantages": torch.zeros(1, 4),  # noqa: E731
                   "input_lengths": torch.tensor([4])}
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        c = connect(eng)
        a, b = c.put_samples("w", one(), finished=False), c.put_samples("w", one(), finished=False)
        meta = c.write_columns(SampleMeta.concat([a, b]), {"advantages": torch.full((2, 4), 5.0)})
        want = [5.0] * 4
        if extend:
            meta = c.extend(meta, {"input_ids": torch.full((2, 2), 9), "advantages": torch.full((2, 2), 1.0),
                                   "input_lengths": torch.tensor([2, 2])}, finished=True)
            want += [1.0, 1.0]
        c.clear("w", a.sample_ids)
        compact(eng)
        assert eng.core.book.stats()["forgot"] >= 1
        rep = restart(eng)
        assert rep["samples"] == 1 and rep["skipped"] == 0 and rep["lost_samples"] == 0, rep
        kept = meta.subset([1])
        assert c.read_columns(kept, ["advantages"], layout="jagged")["advantages"][0].tolist() == want
        assert c.transport.describe("w").sample_ids == b.sample_ids
        c.close()
