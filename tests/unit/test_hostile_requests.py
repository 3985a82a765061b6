"""Requests an authenticated but buggy or hostile client can send, found by an adversarial
review of the native engine's handlers: each is answered with a typed error (never a
"failed: TypeError" counted as a bug), holds no lock, hands out nothing it cannot take
back, and leaves what the store held bit-exact."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane.wire import RawColumn, ints
from rlplane_service.native.local import LocalEngine

SECRET = b"hostile-secret"


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, slab_bytes=32 << 20, lease_s=30) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    c = Client(default_registry(), NativeTransport(engine.info, timeout=20))
    yield c
    c.close()


@pytest.fixture(scope="module")
def known(client):
    fields = {"input_ids": torch.arange(40).reshape(5, 8), "input_lengths": torch.full((5,), 8)}
    return client.put_samples("known", fields, sample_ids=[f"k{i}" for i in range(5)]), fields


@pytest.fixture
def ctrl(engine):
    ch = Channel(engine.info["controller"], "controller", secret=SECRET)
    yield ch
    ch.close()


def still_serving(engine, client, known, failures: int) -> None:
    """No request was a bug, the lock is free, and the known samples read back bit-exactly."""
    assert engine.server.failures == failures and all(u.failures == 0 for u in engine.units)
    assert engine.core._lock.acquire(timeout=2)
    engine.core._lock.release()
    meta, fields = known
    got = client.read_columns(meta, ["input_ids", "input_lengths"])
    assert torch.equal(got["input_ids"], fields["input_ids"]) and torch.equal(got["input_lengths"], fields["input_lengths"])


def rewriting(monkeypatch, op: str, edit) -> None:
    """Every ``op`` request this process sends goes out as ``edit`` makes it; a reserve's or
    a commit's lie also rides in a put sent in one message (which carries both)."""
    real = Channel.send
    ops = {op, "put"} if op in ("reserve", "commit") else {op}

    def send(self, header, columns=None, buffers=()):
        if header.get("op") in ops:
            header = edit(copy.deepcopy(dict(header)))
        return real(self, header, columns, buffers)

    monkeypatch.setattr(Channel, "send", send)


def _first_field(h: dict) -> str:
    return next(iter(h["xs"][0][2]))


COMMIT_LIES = {
    "a block of 'x' as a list": lambda h: {**h, "x": [[[e[0]], *e[1:]] for e in h["x"]]},
    "a unit of 'x' as a list": lambda h: {**h, "x": [[e[0], e[1], [[[u], w] for u, w in e[2]]] for e in h["x"]]},
    "a unit of 'x' as a bool": lambda h: {**h, "x": [[e[0], e[1], [[True, w] for _, w in e[2]]] for e in h["x"]]},
    "a block of 'xs' as a list": lambda h: {**h, "xs": [[[b], u, f] for b, u, f in h["xs"]]},
    "a seal that is not ASCII": lambda h: {**h, "xs": [[b, u, {k: [*v[:3], "\u00e9" * 32] for k, v in f.items()}]
                                                      for b, u, f in h["xs"]]},
    "dense geometry of 2**64-1 rows": lambda h: {**h, "g": {f: {"n": 2**64 - 1, "l": None, "k": None, "t": [[8]]}
                                                          for f in h["g"]}},
    "dense geometry of 2**45 rows": lambda h: {**h, "g": {f: {"n": 2**45, "l": None, "k": None, "t": [[8]]}
                                                        for f in h["g"]}},
    "row geometry of strings": lambda h: {**h, "g": {**h["g"], "input_ids": [["abc"]] * 3}},
    "a row of 2**62 tokens": lambda h: {**h, "g": {**h["g"], "input_ids": {**h["g"]["input_ids"],
                                                                           "l": ints([2**62, 8, 8])}}},
    "row geometry of Nones": lambda h: {**h, "g": {**h["g"], "input_ids": [None] * 3}},
    # (a row of 2**64-1 tokens was stored, and every token-budget claim of the partition then
    # failed on it; rows nested deep were stored, and a claim's or a cut's answer, nesting them
    # deeper, could not be packed: the claim's batch stayed leased to nobody)
    "a row geometry of 2**64-1 tokens": lambda h: {**h, "g": {**h["g"], "input_ids": [[2**64 - 1], [8], [8]]}},
    "a row geometry nested deep": lambda h: {**h, "g": {**h["g"], "input_ids": [[[[[[8]]]]]] * 3}},
    "a packed row's map nested deep": lambda h: {**h, "g": {**h["g"], "input_ids": [{"d": 0, "p": False,
                                                                                      "s": [[[[[8]]]]]}] * 3}},
    # (2**63-1 + 2**63-1 + 194 wraps to the 192 bytes the unit sealed: readers were pointed at
    # another put's bytes)
    "row byte counts that wrap past 2**64": lambda h: {**h, "nb": {**h["nb"], "input_ids": ints(
        np.array([2**63 - 1, 2**63 - 1, 194], np.uint64).astype(np.int64))}},
    "incarnations of the wrong count": lambda h: {**h, "bn": ints([5, 5])},
    "an incarnation past 2**62": lambda h: {**h, "bn": ints([1, 2**62, 3])},
    "a negative incarnation": lambda h: {**h, "bn": ints([1, -2, 3])},
    "incarnations as a list": lambda h: {**h, "bn": [1, 2, 3]},
}


@pytest.mark.parametrize("born", [b"\x01" * 7, [1], "x", ints([-1])])
def test_a_locate_with_malformed_incarnations_is_refused_and_keeps_no_pin(engine, client, known, ctrl, born):
    failures = engine.server.failures
    meta, _ = known
    with pytest.raises(E.WireFormatError, match="'bn'"):
        ctrl.call({"op": "locate", "p": "known", "ids": meta.sample_ids[:1], "fields": ["input_ids"], "bn": born},
                  timeout=5)
    assert engine.core.stats()["pins"] == 0
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("probe", ["pixel_values", [1], [""], ["x" * 300], ["a"] * 1025, ["a", "a"]])
def test_a_locate_with_malformed_probe_fields_is_refused_and_keeps_no_pin(engine, client, known, ctrl, probe):
    failures = engine.server.failures
    meta, _ = known
    with pytest.raises((E.WireFormatError, E.InvalidArgumentError), match="'opt'|twice"):
        ctrl.call({"op": "locate", "p": "known", "ids": meta.sample_ids[:1], "fields": ["input_ids"], "opt": probe},
                  timeout=5)
    assert engine.core.stats()["pins"] == 0
    still_serving(engine, client, known, failures)


def test_a_locate_probing_fields_names_those_the_samples_hold_and_pins_nothing(engine, client, known, ctrl):
    """``opt``: fields a reader's meta does not list, looked for; the read stops there, naming
    those some of the samples hold (a field read, or one no sample holds, is not named)."""
    failures = engine.server.failures
    meta, _ = known
    ask = {"op": "locate", "p": "known", "ids": meta.sample_ids[:2], "fields": ["input_ids"]}
    with pytest.raises(E.FieldsHeldError) as err:
        ctrl.call({**ask, "opt": ["pixel_values", "input_lengths", "input_ids", "no.such.field"]}, timeout=5)
    assert err.value.fields == ["input_lengths"] and "input_lengths" in str(err.value)
    assert engine.core.stats()["pins"] == 0
    answer = ctrl.call({**ask, "opt": ["pixel_values", "input_ids"]}, timeout=5)[0]  # none held but the one read
    ctrl.call({"op": "unpin", "pin": answer["pin"]}, timeout=5)
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("named", [[b"\x01" * 7], [1], "x", [ints([1]), ints([2])], [None]])
def test_a_renewal_naming_malformed_blocks_is_refused_and_takes_no_pin_up(engine, client, known, ctrl, named):
    failures = engine.server.failures
    with pytest.raises(E.WireFormatError, match="'pb'"):
        ctrl.call({"op": "renew", "pins": ["not-a-pin-here"], "pb": named}, timeout=5)
    assert engine.core.stats()["pins"] == 0 and engine.core.pins.taken_up == 0
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("late", [[[1]], [["x", 0]], [[5, 99]], [[5, -1]], "x"])
def test_an_abort_or_discard_naming_malformed_late_copies_is_refused(engine, client, known, ctrl, late):
    failures = engine.server.failures
    for op in ({"op": "abort", "res": "none-such"}, {"op": "discard", "blocks": []}):
        with pytest.raises(E.WireFormatError, match="'late'"):
            ctrl.call({**op, "late": late}, timeout=5)
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("after", [-1.0, 1e9, "soon", True])
def test_a_free_that_keeps_extents_for_a_bad_while_is_refused_and_frees_nothing(engine, after):
    unit = engine.cores[0]
    used = unit.alloc.used_bytes
    with pytest.raises(E.WireFormatError, match="'after'"):
        unit.op_free({"b": ints([12345]), "after": after}, {}, [])
    assert unit.alloc.used_bytes == used and unit.stats()["late_extents"] == 0


def test_a_renewal_of_an_unknown_pin_whose_blocks_are_not_stored_is_answered_gone(engine, client, known, ctrl):
    """Outside a restart's hold, a pin the controller does not know is taken up only on
    blocks it still stores: naming any other block id pins nothing."""
    failures = engine.server.failures
    assert ctrl.call({"op": "renew", "pins": ["made-up"], "pb": [ints([12345])]}, timeout=5)[0]["gone"] == ["made-up"]
    assert engine.core.stats()["pins"] == 0
    still_serving(engine, client, known, failures)


def test_made_up_pins_on_stored_blocks_are_not_taken_up_by_a_controller_that_did_not_restart(engine, client,
                                                                                               known, ctrl):
    """A renewal naming 65,536 made-up pins on a block the store holds filled the pin table,
    and every read of the store then failed (UnavailableError) for as long as it renewed.
    Only a restarted controller takes up pins it does not know, for a pin lease."""
    failures = engine.server.failures
    blocks = [next(iter(engine.core._block_units))]  # a block the store holds
    pins = [f"fake{i}" for i in range(engine.core.pins.limit)]
    before = len(engine.core.pins)
    gone = ctrl.call({"op": "renew", "pins": pins, "pb": [ints(blocks)] * len(pins)}, timeout=30)[0]["gone"]
    assert len(gone) == len(pins) and len(engine.core.pins) <= before
    still_serving(engine, client, known, failures)


#: Lies about the extents and seals a writer's units gave it: a put sent in one message has
#: none to tell (its controller hands the rows to the units itself).
OF_EXTENTS = {lie for lie in COMMIT_LIES if "'x'" in lie or "'xs'" in lie or "seal" in lie}


@pytest.mark.parametrize(("lie", "one_message"), [(lie, False) for lie in sorted(COMMIT_LIES)]
                         + [(lie, True) for lie in sorted(COMMIT_LIES) if lie not in OF_EXTENTS])
def test_a_malformed_commit_is_a_wire_format_error_and_stores_nothing(engine, client, known, monkeypatch, lie,
                                                                      one_message):
    failures = engine.server.failures
    if not one_message:  # reserve, write to the units, commit
        monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)
    rewriting(monkeypatch, "commit", COMMIT_LIES[lie])
    fields = {"input_ids": torch.ones(3, 8, dtype=torch.int64), "input_lengths": torch.full((3,), 8)}
    with pytest.raises(E.WireFormatError):
        client.put_samples("lies", fields, sample_ids=["l0", "l1", "l2"])
    monkeypatch.undo()
    assert "lies" not in client.partitions()
    client.put_samples("lies", fields, sample_ids=["l0", "l1", "l2"])  # the ids came free with the abort
    assert client.clear("lies") == 3
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize(("key", "lie"), [("gr", ints([1])), ("gr", ints([3, -1])), ("gr", ints([2**62, 3])),
                                          ("gr", [3, 3]), ("gr", "3,3"), ("gr", True),
                                          ("gs", {"input_ids": b"\x00" * 8}), ("gs", {"nope": bytes(16)}),
                                          ("gs", {"input_ids": "x"}), ("gs", [1, 2])])
def test_an_extend_whose_read_lengths_or_digests_are_malformed_is_refused_and_changes_nothing(
        engine, client, known, monkeypatch, key, lie):
    """An extend's commit says the lengths it read (``gr``, int64 per sample) and the
    digests of the rows it read (``gs``, uint64 per sample of fields it extends): the wrong
    count, a negative or huge length, another field or another type is a WireFormatError,
    and the samples keep their rows and lengths."""
    failures = engine.server.failures
    fields = {"input_ids": torch.arange(6).reshape(2, 3), "input_lengths": torch.tensor([3, 2])}
    meta = client.put_samples("grow-lies", fields, finished=False)
    rewriting(monkeypatch, "commit", lambda h: {**h, key: lie} if "gr" in h else h)
    with pytest.raises(E.WireFormatError, match=f"'{key}'"):
        client.extend(meta, {"input_ids": torch.ones(2, 1, dtype=torch.int64), "input_lengths": torch.tensor([1, 1])})
    monkeypatch.undo()
    got = client.read_columns(meta, ["input_ids", "input_lengths"], layout="jagged")
    assert got["input_lengths"].tolist() == [3, 2] and got["input_ids"][1].tolist() == [3, 4]
    grown = client.extend(meta, {"input_ids": torch.ones(2, 1, dtype=torch.int64), "input_lengths": torch.tensor([1, 1])})
    assert grown.lengths == [4, 3]
    client.clear("grow-lies")
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("row", [0.0, True])
def test_a_reserve_whose_first_row_is_not_an_int_is_refused(engine, client, known, monkeypatch, row):
    """``0.0 == 0`` and ``True == 1``: a row number that only compares equal to one is refused
    at the reserve (it used to pass, and the commit then failed with a TypeError)."""
    failures = engine.server.failures
    rewriting(monkeypatch, "reserve", lambda h: {**h, "blocks": [[b, u, row if a == 0 else a, z]
                                                                 for b, u, a, z in h["blocks"]]})
    fields = {"input_ids": torch.ones(2, 8, dtype=torch.int64), "input_lengths": torch.full((2,), 8)}
    with pytest.raises(E.WireFormatError, match="bad block entry"):
        client.put_samples("float-row", fields, sample_ids=["f0", "f1"])
    monkeypatch.undo()
    assert engine.core.stats()["reservations"] == 0
    still_serving(engine, client, known, failures)


def test_a_read_with_a_capability_that_is_not_ascii_is_forbidden(engine, client, known):
    failures = engine.server.failures
    blk = int(next(iter(engine.core._block_units)))
    unit = Channel(engine.units[0].endpoint, "u0", secret=SECRET)
    try:
        with pytest.raises(E.ForbiddenError, match="capability"):
            unit.call({"op": "read", "f": [["input_ids", ints([blk]), ints([0])]], "caps": [[blk, "\u00e9" * 32]]},
                      timeout=5)
    finally:
        unit.close()
    still_serving(engine, client, known, failures)


def _versioned(client, p: str, n: int, version: int) -> None:
    fields = {"input_ids": torch.arange(8 * n).reshape(n, 8), "input_lengths": torch.full((n,), 8)}
    client.put_samples(p, fields, sample_ids=[f"{p}-{i}" for i in range(n)], tags=[{"policy_version": version}] * n)


def test_a_tag_too_big_for_int64_counts_as_absent_and_spoils_no_other_sample(engine, client, known, ctrl, monkeypatch):
    """One sample tagged ``policy_version = 2**64-1`` used to fail every versioned claim on its
    partition (OverflowError) and leave the other samples' versions unread: stale samples
    were then handed out as fresh."""
    failures = engine.server.failures
    _versioned(client, "pv", 4, 1)  # stale for a claim at version 10 with staleness 2
    rewriting(monkeypatch, "commit", lambda h: {**h, "user": [{"policy_version": 2**64 - 1, "group_size": 2**64 - 1}, None]})
    fields = {"input_ids": torch.ones(2, 8, dtype=torch.int64), "input_lengths": torch.full((2,), 8)}
    client.put_samples("pv", fields, sample_ids=["big", "plain"])
    monkeypatch.undo()
    claim = {"op": "claim", "p": "pv", "task": "t", "n": 6, "min": 1, "fields": ["input_ids"], "version": 10, "stale": 2}
    got = ctrl.call(claim, timeout=5)[0]
    assert sorted(got["ids"]) == ["big", "plain"]  # without a (usable) version: never stale; the others are
    ctrl.call({"op": "ack", "p": "pv", "task": "t", "lease": got["lease"]}, timeout=5)
    with pytest.raises(E.NotReadyError):  # where the stale samples used to come out
        ctrl.call(claim, timeout=5)
    client.clear("pv")
    pair = {"input_ids": torch.ones(2, 8, dtype=torch.int64), "input_lengths": torch.full((2,), 8)}
    client.put_samples("gp", pair, sample_ids=["a0", "a1"], tags=[{"grp": "A", "group_size": 2}] * 2)
    rewriting(monkeypatch, "commit", lambda h: {**h, "user": [{"grp": "B", "group_size": 2**64 - 1}]})
    client.put_samples("gp", {k: v[:1] for k, v in pair.items()}, sample_ids=["b0"])
    monkeypatch.undo()
    grouped = {"op": "claim", "p": "gp", "task": "g", "n": 3, "min": 1, "fields": ["input_ids"], "group": "grp"}
    with pytest.raises(E.InvalidArgumentError, match="'b0'.*group_size"):  # a size that does not fit is no size
        ctrl.call(grouped, timeout=5)
    client.clear("gp", ["b0"])
    assert sorted(ctrl.call(grouped, timeout=5)[0]["ids"]) == ["a0", "a1"]  # the others' sizes were read
    client.clear("gp")
    still_serving(engine, client, known, failures)


def test_an_ack_of_a_lease_on_a_partition_cleared_and_made_again_is_a_lease_error(engine, client, known, ctrl):
    """The lease's slots would name the new partition's samples: an IndexError, or the new
    samples acked (and journalled as acked) in place of the old ones."""
    failures = engine.server.failures

    def batch(n: int) -> dict:
        return {"input_ids": torch.arange(8 * n).reshape(n, 8), "input_lengths": torch.full((n,), 8)}

    client.put_samples("again", batch(10), sample_ids=[f"old{i}" for i in range(10)])
    low = ctrl.call({"op": "claim", "p": "again", "task": "t", "n": 4, "fields": ["input_ids"]}, timeout=5)[0]
    high = ctrl.call({"op": "claim", "p": "again", "task": "t", "n": 6, "fields": ["input_ids"]}, timeout=5)[0]
    assert client.clear("again") == 10
    client.put_samples("again", batch(4), sample_ids=[f"new{i}" for i in range(4)])
    for lease in (high["lease"], low["lease"]):
        with pytest.raises(E.LeaseError, match="cleared since"):
            ctrl.call({"op": "ack", "p": "again", "task": "t", "lease": lease}, timeout=5)
    state = client.transport.describe("again")
    assert state.sample_ids == [f"new{i}" for i in range(4)]
    got = ctrl.call({"op": "claim", "p": "again", "task": "t", "n": 4, "fields": ["input_ids"]}, timeout=5)[0]
    assert sorted(got["ids"]) == [f"new{i}" for i in range(4)]  # none of them was taken as acked
    client.clear("again")
    still_serving(engine, client, known, failures)


def test_a_locate_whose_answer_is_too_big_is_payload_too_large_and_keeps_no_pin(engine, client, known, ctrl):
    deadline = time.monotonic() + 10  # the reads before let go of their pins one way: counted once they have
    while engine.core.stats()["pins"] and time.monotonic() < deadline:
        time.sleep(0.02)
    failures, pins = engine.server.failures, engine.core.stats()["pins"]
    with pytest.raises(E.PayloadTooLargeError, match="too big"):
        ctrl.call({"op": "locate", "p": "known", "ids": ["k0"] * 1_000_000, "fields": ["input_ids"]}, timeout=60)
    assert engine.core.stats()["pins"] == pins
    still_serving(engine, client, known, failures)


def test_a_snapshot_report_truncates_the_journals_only_for_a_cut_the_controller_gave(tmp_path):
    """A 'snapshotted' with the current sequence number and a made-up path used to truncate
    every unit's journal though no snapshot existed; now only a cut's own number counts, once."""
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, lease_s=30, journal_dir=str(tmp_path)) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=20))
        ctrl = Channel(eng.info["controller"], "controller", secret=SECRET)
        try:
            c.put_samples("j", {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.full((2,), 4)})
            seq = ctrl.call({"op": "journal"}, timeout=5)[0]["seq"]
            report = {"op": "snapshotted", "bytes": 0, "seconds": 0, "samples": 0, "path": "/nowhere"}
            assert ctrl.call({**report, "seq": seq}, timeout=5)[0]["truncating"] is False
            cut = c.transport.cut()
            c.transport.unpin(cut["pin"])
            assert ctrl.call({**report, "seq": cut["seq"]}, timeout=5)[0]["truncating"] is True
            assert ctrl.call({**report, "seq": cut["seq"]}, timeout=5)[0]["truncating"] is False  # once
            deadline = time.monotonic() + 30  # the truncation runs on a thread of its own: let it end
            while time.monotonic() < deadline and eng.core._truncation.locked():
                time.sleep(0.05)
            assert not eng.core._truncation.locked()
        finally:
            ctrl.close()
            c.close()


def test_a_copy_a_client_wrote_under_a_known_block_id_is_never_adopted_as_a_replica():
    """A data client writes junk under a committed block's id on the unit with no copy. When a
    unit with a real copy is lost, re-replication to that unit used to take "already stored"
    as done: the junk became a replica, and after the second real copy's unit went, reads
    failed their checksums. Now the junk is replaced with the real bytes."""
    with LocalEngine(3, secret=SECRET, slab_bytes=16 << 20, lease_s=30, replicas=2, grace_s=2.0) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=20))
        try:
            fields = {"input_ids": torch.arange(32).reshape(4, 8), "input_lengths": torch.full((4,), 8)}
            meta = c.put_samples("r", fields, sample_ids=[f"r{i}" for i in range(4)])
            (b, units), = eng.core._block_units.items()
            spare = ({0, 1, 2} - set(units)).pop()
            unit = Channel(eng.units[spare].endpoint, f"u{spare}", secret=SECRET)
            try:
                junk = {"input_ids": RawColumn("int64", np.full(32, 7777, np.int64), np.arange(0, 33, 8, dtype=np.int64)),
                        "input_lengths": RawColumn("int64", np.full(4, 8, np.int64), np.arange(5, dtype=np.int64))}
                unit.call({"op": "write", "b": b}, junk, timeout=5)
            finally:
                unit.close()
            eng.kill_unit(units[0])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and spare not in eng.core._block_units.get(b, ()):
                time.sleep(0.1)
            assert spare in eng.core._block_units[b]
            eng.kill_unit(units[1])  # only the re-replicated copy is left
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and eng.core._block_units.get(b) != (spare,):
                time.sleep(0.1)
            got = c.read_columns(meta, ["input_ids", "input_lengths"])
            assert torch.equal(got["input_ids"], fields["input_ids"])
        finally:
            c.close()


def test_the_sweep_frees_a_copy_on_a_unit_the_index_does_not_place_it_on(engine, client, known, monkeypatch):
    from rlplane_service.native import health

    failures = engine.server.failures
    b, units = next((b, u) for b, u in engine.core._block_units.items() if len(u) == 1)
    other = 1 - units[0]
    unit = Channel(engine.units[other].endpoint, f"u{other}", secret=SECRET)
    try:
        junk = {"input_ids": RawColumn("int64", np.zeros(8, np.int64), np.arange(0, 9, 8, dtype=np.int64))}
        unit.call({"op": "write", "b": b}, junk, timeout=5)
    finally:
        unit.close()
    used = engine.cores[other].stats()["blocks"]
    monkeypatch.setattr(health, "ORPHAN_MARGIN_S", -2 * engine.core.lease_s)  # every block is old enough now
    engine.core._sweep()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.cores[other].stats()["blocks"] == used:
        time.sleep(0.05)
    assert engine.cores[other].stats()["blocks"] == used - 1
    assert units[0] in engine.core._block_units[b]  # the real copy stays
    still_serving(engine, client, known, failures)


def test_reports_of_a_hung_unit_from_many_clients_cost_the_controller_one_ping_not_one_each():
    """Every client that cannot reach a unit reports it (``unit_down``); the controller pinged
    it inline for each report, up to a second apiece, while every other request waited."""
    import os
    import signal

    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, processes=True, grace_s=3600) as eng:
        ctrl = Channel(eng.info["controller"], "controller", secret=SECRET)
        os.kill(eng.unit_pid(0), signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for _ in range(8):
                got = ctrl.call({"op": "unit_down", "u": 0}, timeout=10)[0]
            assert got["suspect"] == [0] and got["down"] == []
            assert time.monotonic() - t0 < 3.0  # one ping of a second at most, not eight
            t0 = time.monotonic()
            assert ctrl.call({"op": "ping"}, timeout=5)[0]["ok"] is True
            assert time.monotonic() - t0 < 0.5
        finally:
            os.kill(eng.unit_pid(0), signal.SIGCONT)
            ctrl.close()


def test_a_rebuild_reads_each_units_inventory_a_page_at_a_time(monkeypatch):
    """A unit answered its whole inventory (every block and commit-log entry) in one message,
    which passed the header limit at about 300,000 live puts: the rebuild then took the unit
    for unreachable and its samples for lost. Here the limit is 2 KiB and a page ~100 bytes."""
    from rlplane import wire
    from rlplane_service.native import unit as unit_mod

    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, lease_s=30) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=20))
        try:
            puts = []
            for k in range(40):
                fields = {"input_ids": torch.arange(8 * k, 8 * k + 16).reshape(2, 8), "input_lengths": torch.full((2,), 8)}
                puts.append((c.put_samples(f"p{k % 3}", fields, sample_ids=[f"s{k}a", f"s{k}b"]), fields))
            monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 2048)  # one answer of 40 puts' entries passes it
            monkeypatch.setattr(unit_mod, "INVENTORY_PAGE_BYTES", 100, raising=False)
            eng.kill_controller()
            report = eng.restart_controller()
            assert report["lost_samples"] == 0 and report["samples"] == 80 and report["entries"] == 40
            for meta, fields in puts:
                got = c.read_columns(meta, ["input_ids", "input_lengths"])
                assert torch.equal(got["input_ids"], fields["input_ids"])
        finally:
            c.close()


def test_a_claim_whose_answer_is_too_big_gives_its_batch_back_at_once(engine, client, known, ctrl, monkeypatch):
    """The ledger leases a batch before its answer is packed: a claim answered
    PayloadTooLargeError (big tags) left its samples leased to nobody until the lease
    lapsed (300 s), and a smaller claim right after found nothing ready."""
    from rlplane import wire

    failures = engine.server.failures
    n = 200
    client.put_samples("bigtags", {"input_ids": torch.ones(n, 4, dtype=torch.int64), "input_lengths": torch.full((n,), 4)},
                       sample_ids=[f"b{i}" for i in range(n)], tags=[{"note": "x" * 8192}] * n)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 1 << 20)  # 200 x 8 KiB of tags: over it
    with pytest.raises(E.PayloadTooLargeError):
        ctrl.call({"op": "claim", "p": "bigtags", "task": "t", "n": n, "fields": ["input_ids"]}, timeout=30)
    monkeypatch.undo()
    state = ctrl.call({"op": "consumption", "p": "bigtags", "task": "t"}, timeout=5)[0]
    assert state["claimed"] == 0 and state["pending"] == n
    got = client.claim("bigtags", "t", batch_size=10, fields=["input_ids"])
    assert len(got) == 10
    client.clear("bigtags")
    still_serving(engine, client, known, failures)


@pytest.mark.parametrize("one_message", [False, True])
def test_a_user_tag_nested_deep_is_refused_by_the_engine_itself(engine, client, known, monkeypatch, one_message):
    """A client that skips Client's check: such a tag was stored, and every cut (so every
    snapshot of the whole store) then failed, its answer nesting it deeper than msgpack packs."""
    failures = engine.server.failures
    if not one_message:
        monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)
    deep: list = []
    for _ in range(600):
        deep = [deep]
    rewriting(monkeypatch, "commit", lambda h: {**h, "user": [{"k": deep}, None, None]})
    fields = {"input_ids": torch.ones(3, 8, dtype=torch.int64), "input_lengths": torch.full((3,), 8)}
    with pytest.raises(E.ShapeError, match="nested more than"):
        client.put_samples("deeptag", fields, sample_ids=["d0", "d1", "d2"])
    monkeypatch.undo()
    assert "deeptag" not in client.partitions()
    assert engine.core.op_cut({"shm": []}, {}, [])[0]  # (a cut is answered)
    still_serving(engine, client, known, failures)


def test_a_locate_of_more_pairs_than_any_answer_holds_is_refused_before_it_is_built(engine, client, known, ctrl):
    """One sample named 300,000 times over 4 fields: 1.2M (sample, field) pairs, whose
    answer (16 bytes a pair at least) could never be sent; the controller built it first
    (2 GB for 1M ids x 32 fields) and only then refused it."""
    from rlplane_service.native.reads import MAX_LOCATE_CELLS

    failures, pins = engine.server.failures, len(engine.core.pins)  # (earlier reads' unpins may still be on their way)
    ids = ["k0"] * (MAX_LOCATE_CELLS // 4 + 1)
    t0 = time.monotonic()
    with pytest.raises(E.PayloadTooLargeError, match="pairs at once"):
        ctrl.call({"op": "locate", "p": "known", "ids": ids, "fields": ["input_ids", "input_lengths", "a", "b"]},
                  timeout=30)
    assert time.monotonic() - t0 < 5 and len(engine.core.pins) <= pins
    still_serving(engine, client, known, failures)


def test_a_block_whose_field_names_are_long_is_refused_and_keeps_nothing(engine):
    """A unit keeps a block's field names as long as the block lives (and their tuples
    longer, shared): 60 writes of six 1 MiB names each left 360 MiB after their blocks went."""
    unit = engine.cores[0]
    used, blocks = unit.alloc.used_bytes, len(unit._blocks)
    name = "f" * 4096
    col = RawColumn("int64", np.arange(4, dtype=np.int64), np.array([0, 2, 4], np.int64))
    with pytest.raises(E.WireFormatError, match="field names"):
        unit.op_write({"b": 987654321}, {name: col}, [])
    with pytest.raises(E.WireFormatError, match="field names"):
        unit.op_alloc({"b": 987654322, "f": [[name, "int64", 32]]}, {}, [ints([0, 2, 4])])
    from rlplane_service.native.unit import Block

    assert unit.alloc.used_bytes == used and len(unit._blocks) == blocks
    assert not any(name in layout for layout in Block._layouts)


def test_discards_of_many_blocks_do_not_hold_up_the_frees_of_a_clear(engine, client, known, ctrl):
    """Each discarded block was a free round trip of its own, one at a time: 10 discards of
    4096 made-up blocks kept the free thread busy for ~16 s, and an honest clear's extents
    came back only then. Frees queued together go as one message per unit."""
    failures = engine.server.failures
    fields = {"input_ids": torch.arange(16).reshape(2, 8), "input_lengths": torch.full((2,), 8)}
    client.put_samples("honest", fields, sample_ids=["h0", "h1"])
    used = lambda: sum(core.alloc.used_bytes for core in engine.cores)  # noqa: E731
    before = used()
    for r in range(10):
        ctrl.call({"op": "discard", "blocks": [[(7 << 40) + (r << 20) + i + 1, [0, 1]] for i in range(4096)]},
                  timeout=10)
    client.clear("honest")
    deadline = time.monotonic() + 3
    while used() >= before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert used() < before, "the clear's extents were not given back within 3 s"
    still_serving(engine, client, known, failures)
