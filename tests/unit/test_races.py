"""Races a third adversarial review found through the public client API: a claimed sample
cleared before the ack, zero-copy views outliving their client, a flood of locates that
never unpin, and a staged put retried after a unit died. Each test fails on the code
before its fix."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from rlplane import Client, PackedTensor, default_registry
from rlplane import errors as E
from rlplane.fields import FieldSpec
from rlplane.transports import native as N
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.pins import Pins

SECRET = b"races-secret"


def registry():
    reg = default_registry()
    reg.register(FieldSpec("blob", "sample", "dense", {"train"}, dtype="float32"))
    return reg


def connect(eng: LocalEngine, timeout: float = 20) -> Client:
    return Client(registry(), NativeTransport(eng.info, timeout=timeout, data_path="shm"))


def test_an_ack_after_one_claimed_sample_was_cleared_acks_the_others_and_none_comes_back():
    """Client.ack sends the meta's ids; a cleared one made the whole ack a LeaseError, and
    the task was handed the three live samples again when the lease lapsed."""
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20) as eng:
        c, other = connect(eng), connect(eng)
        try:
            c.put_samples("p", {"input_ids": torch.arange(16).reshape(4, 4), "input_lengths": torch.full((4,), 4)},
                          sample_ids=["a", "b", "c", "d"])
            meta = c.claim("p", "train", batch_size=4, fields=["input_ids"], timeout=1, lease_s=1)
            other.clear("p", ["a"])
            c.ack(meta, "train")
            assert c.consumption("p", "train")["acked"] == 3
            time.sleep(1.5)  # past the lease
            with pytest.raises(E.NotReadyError):
                c.claim("p", "train", batch_size=4, min_batch=1, fields=["input_ids"], timeout=0)
        finally:
            c.close()
            other.close()


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_a_zero_copy_view_keeps_its_bytes_after_its_client_is_closed_or_dropped(how):
    """The pins of live views were renewed by the client's own thread, which stopped with the
    client: the pins lapsed and later puts reused the memory under the views."""
    with LocalEngine(1, secret=SECRET, slab_bytes=16 << 20, pin_lease_s=1.0) as eng:
        w = connect(eng)
        try:
            meta = w.put_samples("p", {"blob": torch.full((4, 1 << 16), 7.0)})
            r = connect(eng)
            view = r.read_columns(meta, ["blob"], copy=False)["blob"]
            if how == "closed":
                r.close()
            else:
                del r
                gc.collect()
            w.clear("p")
            end = time.monotonic() + 3.0  # three pin leases
            k = 0
            while time.monotonic() < end:
                k += 1
                w.put_samples("q", {"blob": torch.full((4, 1 << 16), float(100 + k))})
                assert bool((view == 7.0).all()), f"the view changed under its holder after {k} puts"
                w.clear("q")
                time.sleep(0.05)
            del view
            gc.collect()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and len(eng.core.pins):
                time.sleep(0.05)
            assert len(eng.core.pins) == 0  # the last view gone: unpinned
        finally:
            w.close()


def test_pins_of_live_views_are_never_dropped_to_make_room_and_a_full_table_is_a_typed_error():
    """At the pin limit the oldest pins were dropped, live views' included: a flood of locates
    that never unpin took another reader's protection away."""
    freed = []
    pins = Pins(60.0, release=lambda b, u: freed.append(b), limit=4)
    view = pins.pin([1], keep=True)
    renewed = pins.pin([2])
    pins.renew([renewed])  # a renewed pin holds views too
    for k in range(10):  # a reader that never unpins
        pins.pin([100 + k])
    assert pins.renew([view, renewed]) == [] and len(pins) == 4
    pins.pin([7], keep=True)
    pins.pin([8], keep=True)
    with pytest.raises(E.UnavailableError, match="zero-copy"):
        pins.pin([9])
    assert pins.pin([10], mine=True)  # the controller's own (a cut, a repair) is never refused


def test_a_restarted_controller_takes_up_only_pins_whose_blocks_it_did_not_free():
    """A renewal naming a pin the controller does not know (it was restarted) takes it up
    while the restart hold lasts, or later when every block is still stored or waiting; a
    block freed since is never pinned again, and what the hold kept goes once it ends."""
    freed = []
    pins = Pins(60.0, release=lambda b, u: freed.append((b, u)))
    stored = {1, 2}.__contains__
    pins.hold_frees(60.0)
    assert pins.defer(3, (0,)) and freed == []  # a block cleared in the hold waits, unpinned or not
    assert pins.renew(["old-a", "old-b"], [[1, 3], [9]], stored, units=(0, 1)) == [] and pins.taken_up == 2
    pins.hold_frees(0.0)
    pins.expire(time.monotonic())
    assert freed == []  # 3 and 9 are pinned by the pins taken up
    assert pins.renew(["old-c", "old-d"], [[2], [5]], stored, units=(0, 1)) == ["old-d"]  # 5: freed, not known here
    pins.unpin("old-b")
    assert freed == [(9, (0, 1))]  # a block it did not store (cleared before the restart): freed on every unit
    pins.unpin("old-a")
    assert freed == [(9, (0, 1)), (3, (0,))] and not pins.holds(1) and pins.holds(2)


def test_the_blocks_pins_taken_up_hold_are_counted_once_each_and_capped(monkeypatch):
    """A renewal names blocks the controller must keep lists of: ids repeated in one pin
    count once, and past MAX_TAKEN_BLOCKS in all the pin is answered gone."""
    from rlplane_service.native import pins as pins_module

    monkeypatch.setattr(pins_module, "MAX_TAKEN_BLOCKS", 10)
    pins = Pins(60.0, release=lambda b, u: None)
    pins.hold_frees(60.0)
    assert pins.renew(["a"], [[7] * 100_000]) == [] and pins._pins["a"][0] == [7]
    assert pins.renew(["b", "c"], [list(range(9)), list(range(100, 102))]) == ["c"]  # 1 + 9 fit, 2 more do not
    pins.unpin("b")
    assert pins.renew(["c"], [list(range(100, 102))]) == []  # room again once a pin taken up goes


def test_a_staged_put_retried_after_a_unit_died_writes_its_own_bytes_not_the_freed_extents(monkeypatch):
    """A put whose pixels were cast straight into staged slab extents was retried after its
    replica's unit died; the failed attempt had freed those extents, another put reused
    them, and the retry stored that put's bytes under its own digests (every read then
    failed its checksums)."""
    g = torch.Generator().manual_seed(0)

    def pixels() -> PackedTensor:
        return PackedTensor([[torch.randn(512, 1176, generator=g)] for _ in range(4)])

    with LocalEngine(2, secret=SECRET, slab_bytes=32 << 20, replicas=2, grace_s=3600) as eng:
        c, other = connect(eng, 8), connect(eng, 8)
        try:
            c.transport._cursor = 0  # the local first copy on unit 0, the replica on unit 1
            mine = pixels()
            state = {"sent": False, "lost": False}
            send, lost = N.NativeTransport._send_blocks, N.NativeTransport._lost

            def sending(self, blocks, columns, stage=None):
                if self is c.transport and not state["sent"]:
                    state["sent"] = True
                    assert stage is not None and stage.fields  # the pixels were encoded into the slab
                    eng.kill_unit(1)
                return send(self, blocks, columns, stage)

            def losing(self, err):
                out = lost(self, err)
                if self is c.transport and out and not state["lost"]:
                    state["lost"] = True
                    time.sleep(1.0)  # the abort's frees reach unit 0
                    other.put_samples("q", {"pixel_values": pixels()})  # and another writer takes the extents
                return out

            monkeypatch.setattr(N.NativeTransport, "_send_blocks", sending)
            monkeypatch.setattr(N.NativeTransport, "_lost", losing)
            meta = c.put_samples("p", {"pixel_values": mine})
            monkeypatch.undo()
            assert state["lost"]
            got = c.read_columns(meta, ["pixel_values"])["pixel_values"]
            for i in range(4):
                assert torch.equal(got[i][0], mine.rows[i][0].to(torch.bfloat16).float())
        finally:
            c.close()
            other.close()
