"""The native controller is not a single point of failure: a new controller process
rebuilds its index from the storage units' blocks and commit log, and serves every
committed sample bit for bit (in one process, without Ray: LocalEngine's controller is
stopped and a new one started on its port, as the service's restarted actor does)."""

import gc
import threading
import time

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.wire import ints
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane_service.native import commitlog as clog
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.recovery import RecoveryOps

SECRET = b"restart-test-secret"


@pytest.fixture
def engine():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        yield eng


def connect(eng: LocalEngine, path: str = "shm", timeout: float = 30) -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=timeout, data_path=path))


def rows(value: int, n: int = 2, width: int = 4) -> dict:
    return {"input_ids": torch.full((n, width), value, dtype=torch.int64), "input_lengths": torch.full((n,), width)}


def restart(eng: LocalEngine) -> dict:
    eng.kill_controller()
    return eng.restart_controller()


def view(client: Client) -> dict:
    """What a user sees of the store: listings, each partition's ids, the sample count."""
    t = client.transport
    return {"list": t.list(), "ids": {p: t.describe(p).sample_ids for p in t.partitions()},
            "samples": t.stats()["samples"]}


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_every_committed_sample_reads_bit_exact_after_a_restart(engine, path):
    with connect(engine, path) as c:
        vlm = vlm_step(16, 256, seed=5)
        mv = c.put_samples("vlm", vlm.fields)
        c.write_columns(mv, {"prev_logprobs": torch.randn(16, 256)})  # a second write of the same samples
        c.write_columns(mv.subset([3]), {"prev_logprobs": torch.full((1, 256), 7.0)})  # and a replacement
        lp = c.read_columns(mv, ["prev_logprobs"])["prev_logprobs"]
        text = text_step(64, 128, seed=6)
        mt = c.put_samples("text", text.fields, tags=[{"group": i // 8} for i in range(64)])
        c.clear("text", mt.sample_ids[:5])  # a partial clear
        gone = c.put_samples("gone", text.fields)
        c.clear("gone")  # a whole one
        before = view(c)
        report = restart(engine)
        assert report["samples"] == 16 + 59 and report["ignored"] == 0 and report["lost_samples"] == 0
        assert view(c) == before  # the same client: it rides through on a new connection
        got = c.read_columns(mv, list(vlm.fields))
        assert diff_fields(c.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []
        assert torch.equal(c.read_columns(mv, ["prev_logprobs"])["prev_logprobs"], lp)
        kept = mt.subset(list(range(5, 64)))
        want = text.select(list(range(5, 64)))
        got = c.read_columns(kept, list(text.fields))
        assert diff_fields(c.registry, want.fields, got, want.lengths, sample_ids=kept.sample_ids) == []
        with pytest.raises(E.MissingDataError):
            c.read_columns(mt.subset([0]), ["input_ids"])
        with pytest.raises(E.MissingDataError):
            c.read_columns(gone, ["input_ids"])
        assert "gone" not in c.partitions()
        claimed = c.claim("text", "train", batch_size=59, fields=["input_ids"], timeout=0)  # user tags kept
        assert sorted(claimed.sample_ids) == sorted(kept.sample_ids)
        # The new controller takes new puts and restarts again with them.
        more = c.put_samples("vlm", vlm.fields)
        again = restart(engine)
        assert again["samples"] == 16 + 59 + 16
        got = c.read_columns(more, list(vlm.fields))
        assert diff_fields(c.registry, vlm.fields, got, vlm.lengths, sample_ids=more.sample_ids) == []


def test_calls_made_while_the_controller_is_down_wait_for_it_and_succeed(engine):
    with connect(engine, timeout=30) as c:
        w = vlm_step(4, 64, seed=1)
        meta = c.put_samples("p", w.fields)
        engine.kill_controller()
        back = threading.Timer(1.5, engine.restart_controller)
        back.start()
        t0 = time.monotonic()
        got = c.read_columns(meta, list(w.fields))  # issued while nothing listens on the port
        waited = time.monotonic() - t0
        back.join()
        assert 1.0 < waited < 15, waited
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        engine.kill_controller()
        back = threading.Timer(1.0, engine.restart_controller)
        back.start()
        more = c.put_samples("p", w.fields)  # a put too: reserve and commit wait for the new controller
        back.join()
        assert len(c.transport.describe("p").sample_ids) == 8
        got = c.read_columns(more, list(w.fields))
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=more.sample_ids) == []


def test_a_call_gives_up_typed_within_its_timeout_when_no_controller_comes_back(engine):
    with connect(engine, timeout=3) as c:
        meta = c.put_samples("p", vlm_step(2, 16, seed=2).fields)
        engine.kill_controller()
        t0 = time.monotonic()
        with pytest.raises(E.UnavailableError):
            c.read_columns(meta, ["input_ids"])
        assert time.monotonic() - t0 < 3 + 6  # its timeout, plus one connection attempt
        engine.restart_controller()
        assert c.read_columns(meta, ["input_ids"])["input_ids"].shape[0] == 2


def _reserve(ch: Channel, ids: list[str], block: int) -> str:
    return ch.call({"op": "reserve", "p": "half", "ids": ids, "create": True, "fields": ["input_ids"],
                    "blocks": [[block, [0], 0, len(ids)]]}, timeout=5)[0]["res"]


def test_a_put_reserved_before_the_crash_is_invisible_and_its_retry_succeeds(engine):
    with connect(engine) as c:
        kept = c.put_samples("half", rows(1), sample_ids=["k0", "k1"])
        ch = Channel(engine.server.endpoint, "controller", secret=SECRET)
        rid = _reserve(ch, ["x0", "x1"], 7777)  # reserved, never committed
        ch.close()
        restart(engine)
        ch = Channel(engine.server.endpoint, "controller", secret=SECRET)
        with pytest.raises(E.LeaseError, match="controller restarted"):
            ch.call({"op": "commit", "res": rid, "g": {}, "nb": {}}, timeout=5)
        ch.close()
        assert c.transport.describe("half").sample_ids == ["k0", "k1"]
        retry = c.put_samples("half", rows(3), sample_ids=["x0", "x1"])
        assert c.read_columns(retry, ["input_ids"])["input_ids"].eq(3).all()
        assert c.read_columns(kept, ["input_ids"])["input_ids"].eq(1).all()


def test_a_commit_sent_again_after_a_restart_is_answered_as_done_not_stored_twice(engine, monkeypatch):
    commits = []
    real = NativeTransport._ask

    def spy(self, header, timeout=None):
        if header.get("op") == "commit":
            commits.append(dict(header))
        return real(self, header, timeout)

    monkeypatch.setattr(NativeTransport, "_ask", spy)
    monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # reserve, write, commit (test_one_message_put: a put)
    with connect(engine) as c:
        meta = c.put_samples("p", {"input_ids": torch.arange(8).reshape(2, 4), "input_lengths": torch.full((2,), 4)}, sample_ids=["a", "b"])
        restart(engine)
        ch = Channel(engine.server.endpoint, "controller", secret=SECRET)
        again = ch.call(commits[-1], timeout=5)[0]  # the writer never saw the first answer: it sends it again
        ch.close()
        assert again["again"] is True and again["committed"] == 2
        assert c.transport.describe("p").sample_ids == ["a", "b"]
        assert c.read_columns(meta, ["input_ids"])["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_controller_killed_mid_rebuild_rebuilds_the_next_time(engine, monkeypatch):
    with connect(engine) as c:
        w = text_step(32, 64, seed=3)
        metas = [c.put_samples(f"p{k}", w.fields) for k in range(6)]
        logs = [len(u.log) for u in engine.cores]
        engine.kill_controller()
        done = {"n": 0}
        real = RecoveryOps._replay

        def dies(self, e, rec):
            done["n"] += 1
            if done["n"] == 3:
                raise KeyboardInterrupt("killed mid-rebuild")  # not an error a rebuild catches
            return real(self, e, rec)

        monkeypatch.setattr(RecoveryOps, "_replay", dies)
        with pytest.raises(KeyboardInterrupt):
            engine.restart_controller()
        monkeypatch.setattr(RecoveryOps, "_replay", real)
        assert [len(u.log) for u in engine.cores] == logs  # a rebuild writes nothing
        report = engine.restart_controller()
        assert report["samples"] == 6 * 32
        for meta in metas:
            got = c.read_columns(meta, list(w.fields))
            assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_unit_lost_while_the_controller_was_down(replicas):
    """Two copies: every sample reads from the other copy. One: the samples on the lost
    unit are reported lost (reads name the unit), the rest read bit for bit."""
    with LocalEngine(3, secret=SECRET, lease_s=30, replicas=replicas) as eng, connect(eng, "zmq") as c:
        w = text_step(8, 32, seed=4)
        metas = [c.put_samples("p", w.fields) for _ in range(6)]  # blocks spread over the three units
        eng.kill_controller()
        eng.kill_unit(1)
        report = eng.restart_controller()
        assert report["unreachable_units"] and "u1" in report["unreachable_units"][0]
        lost = set()
        for meta in metas:
            try:
                got = c.read_columns(meta, list(w.fields))
                assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
            except E.MissingDataError as err:
                assert replicas == 1 and "u1" in str(err)
                lost |= set(err.missing)
        if replicas == 2:
            assert not lost and report["lost_samples"] == 0
        else:
            assert 0 < len(lost) == report["lost_samples"] < 48
            assert len(c.transport.describe("p").sample_ids) == 48 - len(lost)


def test_a_damaged_or_forged_log_entry_is_ignored_and_reported(engine):
    with connect(engine) as c:
        w = text_step(4, 16, seed=7)
        a = c.put_samples("a", w.fields)
        b = c.put_samples("b", w.fields)
        seqs = {p: [e.seq for e in engine.cores[0].log.entries() if e.partition == p] for p in ("a", "b")}
        for core in engine.cores:  # every copy of b's record is damaged
            assert core.log.damage(seqs["b"][0])
        assert engine.cores[0].log.damage(seqs["a"][0])  # a's only on one unit: the other copy is good
        # A forgery: an entry the controller never wrote, with a MAC under another key.
        body = clog.record({"rid": "x.y", "ids": ["evil"], "create": True, "fields": [], "blocks": [], "g": {},
                            "nb": {}, "h": {}})
        forged = clog.Entry(999, clog.PUT, "evil", body, clog.mac(b"not-the-key", 999, clog.PUT, "evil", body))
        ctl = Channel(engine.units[0].control_endpoint, "u0", secret=engine.seal_key)
        ctl.call({"op": "log", "e": [forged.wire()]}, buffers=[forged.body], timeout=5)
        ctl.close()
        data = Channel(engine.units[0].endpoint, "u0", secret=SECRET)  # a data client may not write the log
        with pytest.raises(E.ForbiddenError):
            data.call({"op": "log", "e": [forged.wire()]}, buffers=[forged.body], timeout=5)
        data.close()
        report = restart(engine)
        assert report["ignored"] == 4  # b's two copies, a's damaged copy, the forgery
        assert "evil" not in c.partitions() and "b" not in c.partitions()
        got = c.read_columns(a, list(w.fields))
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=a.sample_ids) == []
        with pytest.raises(E.MissingDataError):
            c.read_columns(b, ["input_ids"])


@pytest.mark.parametrize("one_message", [False, True])
def test_a_commit_no_unit_records_fails_typed_and_leaves_nothing(engine, monkeypatch, one_message):
    """Its record on no unit: the commit is refused (UnavailableError), or, for a put sent
    in one message, the units' own refusal of its rows and record is (here: full)."""
    from rlplane_service.native.unit import UnitCore

    if not one_message:
        monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)
    refused = (E.StorageFullError, "log is full") if one_message else (E.UnavailableError, "record")
    with connect(engine) as c:
        kept = c.put_samples("p", rows(1))

        def full(self, header, columns, extra):
            raise E.StorageFullError("the log is full (test)")

        def blocks() -> list[tuple[int, int]]:
            return [(len(core._blocks), core.alloc.used_bytes) for core in engine.cores]

        before = blocks()
        monkeypatch.setattr(UnitCore, "op_log", full)
        with pytest.raises(refused[0], match=refused[1]):  # (a batch of one: answered before it is indexed)
            c.put_samples("p", rows(0), sample_ids=["n0", "n1"])
        assert c.transport.describe("p").sample_ids == kept.sample_ids
        assert c.transport.stats()["reservations"] == 0
        deadline = time.monotonic() + 10  # its blocks are freed on their units (sent one way)
        while blocks() != before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert blocks() == before
        with pytest.raises(E.UnavailableError, match="record"):
            c.clear("p")  # a clear that could not be recorded is not applied
        assert c.transport.describe("p").sample_ids == kept.sample_ids
        monkeypatch.undo()
        retry = c.put_samples("p", rows(0), sample_ids=["n0", "n1"])
        assert c.read_columns(retry, ["input_ids"])["input_ids"].eq(0).all()


@pytest.mark.parametrize("first", ["claim", "put"])
def test_a_client_idle_across_a_restart_makes_its_next_call_once(engine, first):
    """The client's connection saw the old controller go while it was idle; its next call
    reaches the new one over the socket's reconnection. Noticed only after the send, the
    call went out twice: a claim's first copy leased the batch to nobody (for lease_s) and
    the second found nothing ready; a put's second reservation named block ids the first
    had taken (WireFormatError). Every one of a few rounds does its call once."""
    with connect(engine) as c:
        for k in range(3):
            c.put_samples(f"idle{k}", rows(k))
            restart(engine)
            time.sleep(0.3)  # the new controller is up and the client's socket reconnected
            if first == "put":
                meta = c.put_samples(f"new{k}", rows(10 + k))
                assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], rows(10 + k)["input_ids"])
                continue
            got = c.claim(f"idle{k}", "train", batch_size=2, fields=["input_ids"], timeout=0)
            assert len(got) == 2
            assert c.consumption(f"idle{k}", "train")["claimed"] == 2


def test_consumption_says_the_controller_restarted(engine):
    with connect(engine) as c:
        c.put_samples("p", rows(1, 4, 2))
        claim = c.claim("p", "train", batch_size=4, fields=["input_ids"], timeout=0)
        c.ack(claim, "train")
        assert "controller_restarts" not in c.consumption("p", "train")
        restart(engine)
        after = c.consumption("p", "train")
        assert after["controller_restarts"] == 1 and after["acked"] == 0 and after["pending"] == 4


def test_the_log_holds_what_the_store_holds_not_its_history(engine):
    with connect(engine) as c:
        w = text_step(8, 16, seed=8)
        for step in range(20):
            c.put_samples(f"step-{step}", w.fields)
            if step >= 2:
                c.clear(f"step-{step - 2}")
        entries = engine.cores[0].log.entries()
        puts = {e.partition for e in entries if e.kind == clog.PUT}
        assert puts <= {"step-18", "step-19"}  # what older partitions put is gone with their clear
        assert len(entries) <= 2 + 20  # two puts, and a small marker per cleared partition
        report = restart(engine)
        assert report["partitions"] == 2 and report["samples"] == 16


def test_entries_round_trip_and_refuse_garbage():
    body = clog.record({"ids": ["a"]})
    e = clog.Entry(5, clog.CLEAR, "p", body, clog.mac(b"k", 5, clog.CLEAR, "p", body))
    again = clog.Entry.from_wire(e.wire(), body)
    assert again == e and clog.valid(b"k", again) and not clog.valid(b"other", again)
    assert clog.parse(e) == {"ids": ["a"]}
    for bad in ([0, "put", "p", "m"], [1, "nope", "p", "m"], [1, "put", 3, "m"], "x", [1, "put", "p"]):
        with pytest.raises(E.WireFormatError):
            clog.Entry.from_wire(bad, b"")
    with pytest.raises(E.WireFormatError):
        clog.parse(clog.Entry(1, clog.PUT, "p", b"\xc1", ""))
    log = clog.UnitLog()
    log.extend([clog.Entry(s, clog.PUT, "p" if s < 4 else "q", body, "") for s in range(1, 6)])
    log.append(clog.Entry(6, clog.DROP, "p", b"", ""))
    assert [x.seq for x in log.entries()] == [4, 5, 6]
    assert np.all(np.diff([x.seq for x in log.entries()]) > 0)


@pytest.mark.parametrize("cleared", ["before", "after"])
def test_a_zero_copy_view_keeps_its_memory_across_a_controller_restart(cleared):
    """A view's pin lived in the old controller only. Its samples cleared before the crash
    (the block waited for the pin) or right after the restart (the new controller knows no
    pin): the new controller frees nothing until the reader's renewal has taken the pin up,
    later puts land elsewhere, and once the view is gone its memory comes back."""
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, pin_lease_s=3.0) as eng:  # renewals every second
        with connect(eng) as c:
            first = torch.arange(4096, dtype=torch.float32).reshape(8, 512)
            meta = c.put_samples("zc", {"advantages": first, "input_lengths": torch.full((8,), 512)})
            view = c.read_columns(meta, ["advantages"], layout="jagged", copy=False)["advantages"]
            held = sum(u.alloc.used_bytes for u in eng.cores)
            if cleared == "before":
                c.clear("zc")
            restart(eng)
            if cleared == "after":
                c.clear("zc")
            deadline = time.monotonic() + 10
            while eng.core.pins.taken_up < 1:  # the reader's next renewal names the pin's blocks
                assert time.monotonic() < deadline, "the reader's renewal did not take its pin up again"
                time.sleep(0.05)
            while eng.core.pins.holding:  # and what a hold alone kept is freed once it ends
                assert time.monotonic() < deadline + 10
                time.sleep(0.05)
            time.sleep(0.6)  # (the reaper and the free loop have run)
            for k in range(4):  # puts of the same size on both units: none may land under the view
                c.put_samples("zc", {"advantages": torch.full((8, 512), -1.0 - k),
                                     "input_lengths": torch.full((8,), 512)}, sample_ids=[f"t{k}{i}" for i in range(8)])
            assert torch.equal(torch.stack(list(view.unbind())), first), "a live view saw another put's bytes"
            c.clear("zc")
            time.sleep(0.6)
            assert sum(u.alloc.used_bytes for u in eng.cores) == held, "the view's block was freed, or a put kept"
            del view
            gc.collect()
            deadline = time.monotonic() + 10
            while sum(u.alloc.used_bytes for u in eng.cores) >= held:  # the unpin frees it (or the sweep, later)
                assert time.monotonic() < deadline, "the view's memory did not come back once it was gone"
                time.sleep(0.05)


def test_a_pin_taken_up_on_a_block_still_in_flight_never_frees_it_once_stored(monkeypatch):
    """While a restarted controller's hold lasts, a renewal may name blocks it does not
    store, which it then frees on every unit once the pin goes. A block of a put in flight
    is the controller's from the put's reserve on, so a renewal naming it takes it up as
    stored: letting go of that pin frees nothing, and the put reads back once committed."""
    with LocalEngine(1, secret=SECRET, slab_bytes=16 << 20) as eng:
        with connect(eng) as c:
            restart(eng)  # the hold is on for RESTART_HOLD_S
            c.transport.partitions()  # (the client's channel to the controller comes back first)
            monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # reserve, write, then commit
            real, named = NativeTransport._land_blocks, []

            def land(self, sent, deadline, *rest):
                out = real(self, sent, deadline, *rest)
                until = time.monotonic() + 5
                while not eng.core._res and time.monotonic() < until:  # the reservation has taken the block
                    time.sleep(0.01)
                ctrl = Channel(eng.server.endpoint, "controller", secret=SECRET)
                try:  # a renewal naming the in-flight put's block, under a pin the controller does not know
                    named.append(ctrl.call({"op": "renew", "pins": ["made-up"], "pb": [ints([sent[0].bid])]},
                                           timeout=5)[0]["gone"])
                finally:
                    ctrl.close()
                return out

            monkeypatch.setattr(NativeTransport, "_land_blocks", land)
            x = rows(5, n=4, width=64)
            meta = c.put_samples("flight", x)
            monkeypatch.setattr(NativeTransport, "_land_blocks", real)
            assert named == [[]] and eng.core.pins.taken_up == 1  # taken up while the hold lasted
            ctrl = Channel(eng.server.endpoint, "controller", secret=SECRET)
            ctrl.call({"op": "unpin", "pin": "made-up"}, timeout=5)
            ctrl.close()
            assert len(eng.core.pins) == 0
            time.sleep(0.6)  # (the free loop has run)
            assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], x["input_ids"])
            assert eng.cores[0].alloc.used_bytes > 0


def test_each_units_figures_count_a_sample_once_and_a_shared_row_once_and_survive_a_restart():
    """With two copies a sample whose blocks had their first and second copies on one unit
    counted twice there (27 of 24 samples), the number changed across a restart (the copies'
    order did), and a row stored once for a group counted once per sample in a unit's live bytes."""
    from rlplane.testing.workloads import vlm_grpo

    with LocalEngine(3, secret=SECRET, lease_s=30, replicas=2) as eng, connect(eng, "zmq") as c:
        w = vlm_grpo(batch=8, seqlen=32, seed=2)
        for k in range(3):
            c.put_samples(f"p{k}", w.fields)
        before = c.transport.stats()["units"]
        for name, unit in before.items():
            assert unit["samples"] <= 24 and unit["live_bytes"] <= unit["bytes"], (name, unit)
        eng.kill_controller()
        eng.restart_controller()
        after = c.transport.stats()["units"]
        assert {k: (u["samples"], u["live_bytes"]) for k, u in after.items()} == \
               {k: (u["samples"], u["live_bytes"]) for k, u in before.items()}
