"""A buggy or hostile client cannot take the native engine down, change what is not its
own or make it forget data (issue 23). Each test sends what a bad client would, asserts
the typed error, and then that the engine still answers and what it held reads back
bit-exactly."""

from __future__ import annotations

import logging
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import PLAIN_USER, Channel
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane.wire import VERSION, ints
from rlplane_service.native import unit as unit_mod
from rlplane_service.native.local import LocalEngine

SECRET = b"hardening-secret"


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
    """A partition every test checks afterwards: it must read back bit-exactly."""
    fields = {"input_ids": torch.arange(40).reshape(5, 8), "input_lengths": torch.tensor([8, 3, 8, 1, 5])}
    meta = client.put_samples("known", fields, sample_ids=[f"k{i}" for i in range(5)])
    return meta, fields


def intact(client, known) -> None:
    meta, fields = known
    got = client.read_columns(meta, ["input_ids", "input_lengths"])
    assert torch.equal(got["input_lengths"], fields["input_lengths"])
    for i, n in enumerate(fields["input_lengths"].tolist()):
        assert torch.equal(got["input_ids"][i, :n], fields["input_ids"][i, :n])


@pytest.fixture
def ctrl(engine):
    ch = Channel(engine.info["controller"], "controller", secret=SECRET)
    yield ch
    ch.close()


def test_a_claim_whose_wait_is_not_a_finite_number_is_refused_and_the_controller_keeps_serving(ctrl, client, known):
    base = {"op": "claim", "p": "known", "task": "t", "n": 1, "fields": ["input_ids"]}
    for wait in ("nan", float("nan"), float("inf"), -1.0, 1e300, "5", True):
        with pytest.raises((E.WireFormatError, E.InvalidArgumentError)):
            ctrl.call({**base, "wait": wait}, timeout=5)
    for n in (0, "3", 2**64 - 1, None):
        with pytest.raises((E.WireFormatError, E.InvalidArgumentError)):
            ctrl.call({**base, "n": n}, timeout=5)
    assert ctrl.call({"op": "ping"}, timeout=5)[0]["ok"] is True
    intact(client, known)


def test_a_parked_request_with_any_deadline_cannot_stop_the_loop(engine, ctrl, client, known):
    """The loop clamps what a handler parks: even a NaN deadline from a bug is answered."""
    from rlplane_service.native.server import Park

    core = engine.core
    core.op_nanpark = lambda h, c, x: (_ for _ in ()).throw(Park(float("nan"))) if not h["_final"] else ({"late": 1}, {}, [])
    try:
        assert ctrl.call({"op": "nanpark"}, timeout=5)[0]["late"] == 1
    finally:
        del core.op_nanpark
    intact(client, known)


def test_a_refused_reserve_takes_no_ids(ctrl, client, known):
    """Refused for a reused block id, the reserve's sample ids stay free for the next put."""
    block = next(iter(client.transport._ctrl().call({"op": "locate", "p": "known", "ids": ["k0"],
                                                      "fields": ["input_ids"]}, timeout=5)[0]["units"]))
    used = int(np.frombuffer(block[1][0][1], "<i8")[0])
    ask = {"op": "reserve", "p": "fresh", "ids": ["f0", "f1"], "create": True, "fields": ["input_ids"],
           "blocks": [[used, [0], 0, 2]]}
    with pytest.raises(E.WireFormatError, match="already in use"):
        ctrl.call(ask, timeout=5)
    meta = client.put_samples("fresh", {"input_ids": torch.ones(2, 3, dtype=torch.int64),
                                        "input_lengths": torch.tensor([3, 3])}, sample_ids=["f0", "f1"])
    assert meta.sample_ids == ["f0", "f1"]
    assert client.clear("fresh") == 2
    intact(client, known)


def test_a_reserve_naming_an_id_or_a_field_twice_is_refused_and_clear_still_works(ctrl, client, known):
    for ids, fields in ((["a", "a"], ["input_ids"]), (["a", "b"], ["input_ids", "input_ids"])):
        with pytest.raises(E.InvalidArgumentError, match="twice"):
            ctrl.call({"op": "reserve", "p": "twice", "ids": ids, "create": True, "fields": fields,
                       "blocks": [[12345, [0], 0, 2]]}, timeout=5)
    for bad in ({"p": "../x"}, {"p": "x" * 201}, {"ids": ["y" * 600, "b"]}, {"blocks": [[1 << 63, [0], 0, 2]]},
                {"blocks": [[5, [0], 0, 1], [5, [1], 1, 2]]}, {"create": "yes"}):
        ask = {"op": "reserve", "p": "twice", "ids": ["a", "b"], "create": True, "fields": ["input_ids"],
               "blocks": [[4321, [0], 0, 2]], **bad}
        # create="yes" is not True: an update of ids that do not exist
        with pytest.raises((E.WireFormatError, E.InvalidArgumentError, E.MissingDataError)):
            ctrl.call(ask, timeout=5)
    assert client.clear("twice") == 0
    assert ctrl.call({"op": "stats"}, timeout=5)[0]["reservations"] == 0
    intact(client, known)


def test_a_data_client_cannot_free_or_copy_out_blocks_on_a_unit(engine, client, known):
    meta, _ = known
    loc = client.transport._ctrl().call({"op": "locate", "p": "known", "ids": meta.sample_ids,
                                         "fields": ["input_ids"]}, timeout=5)[0]
    u, entries = loc["units"][0]
    blocks = np.frombuffer(entries[0][1], "<i8")
    unit = Channel(engine.units[u].endpoint, f"u{u}", secret=SECRET)  # the data endpoint a client knows
    try:
        with pytest.raises(E.ForbiddenError, match="controller only"):
            unit.call({"op": "free", "b": ints(blocks)}, timeout=5)
        with pytest.raises(E.ForbiddenError):
            unit.call({"op": "block", "b": int(blocks[0])}, timeout=5)
        assert unit.call({"op": "ping"}, timeout=5)[0]["unit"] == f"u{u}"
    finally:
        unit.close()
    intact(client, known)


def test_a_client_cannot_reach_the_control_socket_with_the_data_secret(engine):
    """Refused, typed, within the connection deadline, however the send and the failed
    handshake interleave (a send after the refusal has no peer to queue on: it used to
    block for good)."""
    for k in range(8):
        ch = Channel(engine.units[0].control_endpoint, "u0 control", secret=SECRET, connect_timeout=1.0)
        try:
            if k % 2:
                time.sleep(0.3)  # let the handshake fail before the send
            start = time.monotonic()
            with pytest.raises((E.AuthenticationError, E.UnavailableError)):
                ch.call({"op": "free", "b": ints([1])}, timeout=3)
            assert time.monotonic() - start < 5
        finally:
            ch.close()


def test_the_engine_never_logs_a_password_and_refuses_a_wrong_one_of_any_kind(engine, caplog):
    """PLAIN credentials are checked by rlplane's own ZAP handler (constant-time compare;
    pyzmq's logged every admitted password at DEBUG)."""
    caplog.set_level(logging.DEBUG, logger="rlplane_service.native.server.zap")
    ok = Channel(engine.info["controller"], "controller", secret=SECRET)
    try:
        assert ok.call({"op": "ping"}, timeout=5)[0]["ok"]
    finally:
        ok.close()
    for wrong in (SECRET[:-1], SECRET + b"x", "hardening-s\u00e9cret".encode(), b"\xff\xfe" * 8):
        ch = Channel(engine.info["controller"], "controller", secret=wrong, connect_timeout=1.0)
        try:
            with pytest.raises((E.AuthenticationError, E.UnavailableError)):
                ch.call({"op": "ping"}, timeout=2)
        finally:
            ch.close()
    assert SECRET.decode() not in caplog.text


def test_discard_frees_only_blocks_the_index_does_not_know(ctrl, client, known):
    meta, _ = known
    loc = ctrl.call({"op": "locate", "p": "known", "ids": meta.sample_ids, "fields": ["input_ids"]}, timeout=5)[0]
    blocks = [int(b) for _, entries in loc["units"] for b in np.frombuffer(entries[0][1], "<i8")]
    got = ctrl.call({"op": "discard", "blocks": [[b, [0, 1]] for b in set(blocks)]}, timeout=5)[0]
    assert got["discarded"] == 0
    time.sleep(0.3)
    intact(client, known)


def test_a_small_read_cannot_ask_a_unit_for_more_than_the_cap(engine, client, known, monkeypatch):
    meta, _ = known
    loc = client.transport._ctrl().call({"op": "locate", "p": "known", "ids": meta.sample_ids[:1],
                                         "fields": ["input_ids"]}, timeout=5)[0]
    u, entries = loc["units"][0]
    field, blocks, rows = entries[0][:3]
    caps = dict(loc["caps"])[u]
    monkeypatch.setattr(unit_mod, "MAX_READ_BYTES", 64 << 10)
    unit = Channel(engine.units[u].endpoint, f"u{u}", secret=SECRET)
    try:
        times = 20_000  # one 64-byte row asked for 20,000 times: 1.28 MB from a 300 kB request
        many = [[field, ints(np.repeat(np.frombuffer(blocks, "<i8"), times)),
                 ints(np.repeat(np.frombuffer(rows, "<i8"), times))]]
        with pytest.raises(E.PayloadTooLargeError, match="fewer samples"):
            unit.call({"op": "read", "f": many, "caps": caps}, timeout=10)
        with pytest.raises(E.WireFormatError, match="twice"):
            unit.call({"op": "read", "f": [entries[0][:3], entries[0][:3]], "caps": caps}, timeout=5)
        with pytest.raises(E.WireFormatError, match="does not hold"):
            unit.call({"op": "read", "f": [[field, blocks, ints([10**6])]], "caps": caps}, timeout=5)
        assert unit.call({"op": "read", "f": [[field, blocks, rows]], "caps": caps}, timeout=5)[1][field].num_rows == 1
        with pytest.raises(E.ForbiddenError, match="capability"):  # the same read without the locate's capability
            unit.call({"op": "read", "f": [[field, blocks, rows]]}, timeout=5)
    finally:
        unit.close()
    intact(client, known)


def test_a_header_that_would_decode_to_a_huge_object_is_refused(engine, client, known):
    """2 MiB of empty maps (~130 MiB as Python objects) is refused before it is built."""
    raw = _raw(engine.info["controller"], SECRET)
    try:
        n = 3 << 20
        body = b"\x83" + msgpack.packb("v") + msgpack.packb(VERSION) + msgpack.packb("op") + msgpack.packb("ping")
        body += msgpack.packb("x") + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
        reply = _ask(raw, [body])
        assert reply["ok"] is False and reply["error"]["error"] == "WireFormatError"
        assert "lists and maps" in reply["error"]["message"]
    finally:
        raw.close(linger=0)
    intact(client, known)


def test_lease_and_reservation_ids_cannot_be_guessed(ctrl, client, known):
    leases = []
    for task in ("g1", "g2", "g3"):
        got = ctrl.call({"op": "claim", "p": "known", "task": task, "n": 1, "fields": ["input_ids"]}, timeout=5)[0]
        leases.append(got["lease"])
    assert len(set(leases)) == 3 and all(x > 1 << 20 for x in leases), leases  # 63 random bits each
    with pytest.raises(E.LeaseError):  # a lease is bound to its task too
        ctrl.call({"op": "ack", "p": "known", "task": "g2", "lease": leases[0]}, timeout=5)
    with pytest.raises(E.LeaseError):
        ctrl.call({"op": "ack", "p": "known", "task": "g1", "lease": leases[0] ^ 1}, timeout=5)
    for task, lease in zip(("g1", "g2", "g3"), leases):
        ctrl.call({"op": "nack", "p": "known", "task": task, "lease": lease}, timeout=5)
    res = ctrl.call({"op": "reserve", "p": "g", "ids": ["x"], "create": True, "fields": ["input_ids"],
                     "blocks": [[98765, [0], 0, 1]]}, timeout=5)[0]["res"]
    epoch, _, token = res.partition(".")
    assert len(epoch) == 8 and len(token) == 24  # the controller's epoch, then 96 random bits
    assert ctrl.call({"op": "abort", "res": 1}, timeout=5)[0]["aborted"] is False
    assert ctrl.call({"op": "abort", "res": res}, timeout=5)[0]["aborted"] is True
    intact(client, known)


def test_a_write_into_a_partition_cleared_and_made_again_meanwhile_is_refused(engine, client, known, monkeypatch):
    """The update reserved in the old partition; committing it into the new one would
    write another sample's rows."""
    fields = {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4])}
    meta = client.put_samples("again", fields, sample_ids=["a", "b"])
    transport = client.transport
    real = transport._land_blocks
    monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # (a put in one message has no "meanwhile")

    def clear_and_remake(*args, **kwargs):
        where = real(*args, **kwargs)
        other = Client(default_registry(), NativeTransport(engine.info, timeout=20))
        other.clear("again")
        other.put_samples("again", fields, sample_ids=["a", "b"])
        other.close()
        return where

    monkeypatch.setattr(transport, "_land_blocks", clear_and_remake)
    with pytest.raises(E.MissingDataError, match="cleared"):
        client.write_columns(meta, {"prev_logprobs": torch.zeros(2, 4)})
    monkeypatch.undo()
    with pytest.raises(E.MissingDataError):
        client.read_columns(meta, ["prev_logprobs"])
    assert client.clear("again") == 2
    intact(client, known)


def test_a_failing_background_round_or_server_iteration_is_survived_and_counted(engine, ctrl, client, known,
                                                                                 monkeypatch):
    core = engine.core

    def broken(now: float, oldest: int = 0) -> None:
        raise RuntimeError("a bug in the reaper")

    monkeypatch.setattr(core.pins, "expire", broken)  # what the reaper's rounds call
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and core.loop_errors.get("reaper", 0) < 2:
        time.sleep(0.1)
    assert core.loop_errors.get("reaper", 0) >= 2
    assert all(core.health()["threads"].values())
    monkeypatch.undo()
    def bad_expire(now: float | None = None) -> int:
        raise RuntimeError("a bug in what the server loop's wake() calls")

    before = engine.server.failures
    monkeypatch.setattr(core.ledger, "expire", bad_expire)
    time.sleep(0.5)
    monkeypatch.undo()
    assert engine.server.failures > before and engine.server.health()["alive"]
    assert ctrl.call({"op": "ping"}, timeout=5)[0]["ok"] is True
    intact(client, known)


def test_unauthenticated_or_garbage_frames_never_stop_a_server(engine, client, known):
    """Bursts of garbage at the controller and a unit, with and without the secret."""
    rng = np.random.default_rng(7)
    for endpoint in (engine.info["controller"], engine.units[0].endpoint):
        for secret in (SECRET, None, b"wrong"):
            raw = _raw(endpoint, secret)
            try:
                for _ in range(50):
                    frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 4)))]
                    try:
                        raw.send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:  # no peer (yet, or any more: a refused handshake)
                        pass
            finally:
                raw.close(linger=200)
    assert Channel(engine.units[0].endpoint, "u0", secret=SECRET).call({"op": "ping"}, timeout=5)[0]["ok"]
    intact(client, known)


# -- stalls are not losses ---------------------------------------------------------------

def test_a_stopped_unit_is_suspect_not_lost_and_keeps_its_data_when_it_resumes():
    """SIGSTOP a unit's process for longer than the controller's pings wait (and have a
    client report it down meanwhile); after SIGCONT every sample reads back."""
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, processes=True, grace_s=3600) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=10, data_path="zmq"))
        try:
            fields = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
            meta = c.put_samples("stall", fields)
            on = {u for u, _ in c.transport._ctrl().call({"op": "locate", "p": "stall", "ids": meta.sample_ids,
                                                          "fields": ["input_ids"]}, timeout=5)[0]["units"]}
            u = on.pop()
            os.kill(eng.unit_pid(u), signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and u not in eng.core._suspect:
                    time.sleep(0.2)
                assert u in eng.core._suspect and not eng.core._lost_units
                t0 = time.monotonic()
                with pytest.raises(E.UnavailableError):  # typed, within the client's deadline; reports it down
                    c.read_columns(meta, ["input_ids"])
                assert time.monotonic() - t0 < 25
                time.sleep(4)  # stopped ~14 s by now: past what used to make it lost (two missed pings, a client's report)
                stats = eng.core.stats()
                assert stats["lost_units"] == [] and stats["suspect_units"] == [f"u{u}"] and stats["lost_samples"] == 0
                other = c.put_samples("stall-2", fields)  # writes go around the suspect unit
                assert torch.equal(c.read_columns(other, ["input_ids"])["input_ids"], fields["input_ids"])
            finally:
                os.kill(eng.unit_pid(u), signal.SIGCONT)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and eng.core._suspect:
                time.sleep(0.2)
            assert eng.core.stats()["suspect_units"] == []
            assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], fields["input_ids"])
        finally:
            c.close()


def test_a_put_no_unit_takes_says_which_units_are_lost_which_do_not_answer_and_which_are_full():
    """A put while the units were only suspect (stalled: they may answer again) was told
    "every storage unit of the store is lost; the service needs a restart"."""
    with LocalEngine(3, secret=SECRET, slab_bytes=16 << 20) as eng:
        t = NativeTransport(eng.info, timeout=10, data_path="zmq")
        try:
            t._gone, t.down = set(), {0, 1, 2}  # (as the controller says while all three are suspect)
            t._down_at = time.monotonic()
            with pytest.raises(E.UnavailableError) as err:
                t._place(4, 64)
            assert "u0, u1, u2 not answering (suspect" in str(err.value) and "restart" not in str(err.value)
            t._gone, t.down = {0}, {0, 1}
            with pytest.raises(E.UnavailableError, match=r"u0 lost; u1 not answering .*; u2 full for this put"):
                t._place(4, 64, avoid={2})
            t._gone = t.down = {0, 1, 2}
            with pytest.raises(E.UnavailableError, match=r"every storage unit of the store is lost \(u0, u1, u2\); "
                                                         "the service needs a restart"):
                t._place(4, 64)
        finally:
            t.close()


def test_a_killed_unit_is_lost_at_once_and_puts_route_around_it_within_two_seconds():
    with LocalEngine(3, secret=SECRET, slab_bytes=16 << 20, processes=True, replicas=2, grace_s=3600) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=20, data_path="zmq"))
        try:
            fields = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
            metas = [c.put_samples(f"kill-{k}", fields) for k in range(3)]
            eng.kill_unit(0)
            t0 = time.monotonic()
            meta = c.put_samples("after", fields)
            took = time.monotonic() - t0
            assert took < 2.0, f"the put after a unit died took {took:.1f} s"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not eng.core._lost_units:
                time.sleep(0.1)
            assert eng.core.stats()["lost_units"] == ["u0"] and eng.core.stats()["lost_samples"] == 0
            for m in [*metas, meta]:
                assert torch.equal(c.read_columns(m, ["input_ids"])["input_ids"], fields["input_ids"])
        finally:
            c.close()


# -- helpers -------------------------------------------------------------------------------

def _raw(endpoint: str, secret: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 5000  # bounded: a refused handshake leaves no peer to queue for
    if secret is not None:
        sock.plain_username = PLAIN_USER
        sock.plain_password = secret
    sock.connect(endpoint)
    return sock


def _ask(sock: zmq.Socket, frames: list[bytes], timeout_s: float = 10.0) -> dict:
    sock.send_multipart(frames)
    if not sock.poll(int(timeout_s * 1000)):
        raise AssertionError("no answer")
    return msgpack.unpackb(sock.recv_multipart()[0], raw=False)


def test_blocks_written_outside_any_put_are_swept_and_known_ones_are_kept(engine, client, known, monkeypatch):
    from rlplane.wire import RawColumn
    from rlplane_service.native import health as health_mod

    unit = Channel(engine.units[1].endpoint, "u1", secret=SECRET)
    try:
        orphan = 0x1234_5678_9ABC
        col = RawColumn("int64", np.arange(16, dtype=np.int64), np.array([0, 16], np.int64))
        unit.call({"op": "write", "b": orphan}, {"x": col}, timeout=5)  # no reservation names it
    finally:
        unit.close()
    assert orphan in engine.cores[1]._blocks
    monkeypatch.setattr(health_mod, "ORPHAN_MARGIN_S", -1e9)  # every block is old enough
    before = engine.core.orphans_freed
    engine.core._sweep()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and orphan in engine.cores[1]._blocks:
        time.sleep(0.05)
    assert orphan not in engine.cores[1]._blocks
    assert engine.core.orphans_freed == before + 1  # only the orphan: the known partition's blocks stay
    intact(client, known)


def test_servers_bind_inside_the_engine_port_range_and_say_when_it_is_full():
    from rlplane_service.native.server import Server
    from rlplane_service.native.unit import UnitCore
    from rlplane_service.net import free_port
    from rlplane_service.settings import ServiceSettings

    lo = free_port()
    core = UnitCore("ranged", 1 << 20, share=False)
    first = Server(core, port=(lo, lo), secret=SECRET, name="ranged").start()
    try:
        assert first.endpoint.endswith(f":{lo}")
        with pytest.raises(E.UnavailableError, match="no free port"):
            Server(core, port=(lo, lo), secret=SECRET, name="second")
    finally:
        first.stop()
    assert ServiceSettings(engine_port_min=20000, engine_port_max=20199).engine_ports() == (20000, 20199)
    assert ServiceSettings().engine_ports() is None
    for lo_hi in ((20000, 0), (30000, 20000), (80, 90)):
        with pytest.raises(ValueError, match="engine_port"):
            ServiceSettings(engine_port_min=lo_hi[0], engine_port_max=lo_hi[1])


@pytest.mark.parametrize(("lie", "one_message"), [("row bytes", False), ("seal", False), ("no seals", False),
                                                  ("row bytes", True)])
def test_a_commit_cannot_claim_extents_or_sizes_its_units_did_not_seal(engine, client, known, monkeypatch, lie,
                                                                       one_message):
    """A writer that lies about its rows' sizes (readers would copy past its extents) or
    forges a unit's seal is refused, and nothing of the put becomes visible (a put sent in
    one message has no seals to forge: its controller hands the rows to the units itself)."""
    real = Channel.call
    if not one_message:
        monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)

    def lying(self, header, *args, **kwargs):
        if header.get("op") in ("commit", "put"):
            header = dict(header)
            if lie == "row bytes":
                header["nb"] = {f: ints(np.frombuffer(v, "<i8") * 2) for f, v in header["nb"].items()}
            elif lie == "seal":
                header["xs"] = [[b, u, {f: [d, n, r, "0" * 32] for f, (d, n, r, _) in fs.items()}]
                                for b, u, fs in header["xs"]]
            else:
                header.pop("xs")
        return real(self, header, *args, **kwargs)

    monkeypatch.setattr(Channel, "call", lying)
    fields = {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4])}
    with pytest.raises(E.WireFormatError, match="seal|differ"):
        client.put_samples("liar", fields, sample_ids=["l0", "l1"])
    monkeypatch.undo()
    assert "liar" not in client.partitions()
    meta = client.put_samples("liar", fields, sample_ids=["l0", "l1"])  # the ids came free with the abort
    assert client.clear("liar") == 2 and meta.sample_ids == ["l0", "l1"]
    intact(client, known)


def test_a_commit_wakes_only_the_claims_parked_on_its_partition(engine, client, known, monkeypatch):
    """Hundreds of waiting claims on one partition cost nothing per commit to another."""
    core = engine.core
    runs = {"n": 0}
    real = core.op_claim

    def counted(header, columns, extra):
        runs["n"] += 1
        return real(header, columns, extra)

    monkeypatch.setattr(core, "op_claim", counted)
    raw = _raw(engine.info["controller"], SECRET)
    try:
        waiting = 200
        for k in range(waiting):
            raw.send_multipart([msgpack.packb({"op": "claim", "rid": k, "p": "idle", "task": "t", "n": 1,
                                               "fields": ["input_ids"], "wait": 30.0, "v": VERSION, "c": [], "nbuf": 0})])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.server.health()["parked"] < waiting:
            time.sleep(0.05)
        assert engine.server.health()["parked"] == waiting
        before = runs["n"]
        fields = {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4])}
        for k in range(3):
            client.put_samples(f"busy-{k}", fields)
        time.sleep(0.5)  # the loop has seen the commits (it wakes every request)
        assert runs["n"] == before  # no parked claim ran again
        client.put_samples("idle", fields, sample_ids=["i0", "i1"])  # two samples: two claims of one answered
        got = []
        while len(got) < 2 and raw.poll(5000):
            got.append(msgpack.unpackb(raw.recv_multipart()[0], raw=False))
        assert [r["ok"] for r in got] == [True, True] and sorted(r["ids"][0] for r in got) == ["i0", "i1"]
        deadline = time.monotonic() + 10  # the loop answers the first two while it still goes through the rest
        while time.monotonic() < deadline and runs["n"] < before + waiting:
            time.sleep(0.05)
        assert runs["n"] >= before + waiting  # every claim parked on "idle" looked again
        # health() may read the list while the loop rebuilds it: wait for the settled count
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.server.health()["parked"] != waiting - 2:
            time.sleep(0.05)
        assert engine.server.health()["parked"] == waiting - 2
    finally:
        raw.close(linger=0)
        for k in range(3):
            client.clear(f"busy-{k}")
        client.clear("idle")
    intact(client, known)


def test_work_a_handler_leaves_for_after_its_answer_runs_before_the_next_request_and_cannot_stop_the_loop():
    """A commit answers once it has checked everything and updates its index right after:
    the answer comes first, the next request (any peer's) sees the update, and a failure
    of that after-work is counted, not fatal."""
    from rlplane_service.native.server import Server

    class Handler:
        done = 0

        def op_slow(self, header, columns, extra):
            def then():
                time.sleep(0.5)
                Handler.done += 1
                if header.get("boom"):
                    raise RuntimeError("after-work failed")
            return {"ok2": True}, {}, [], then

        def op_done(self, header, columns, extra):
            return {"done": Handler.done}, {}, []

    server = Server(Handler(), secret=SECRET, name="then").start()
    try:
        first = Channel(server.endpoint, "then", secret=SECRET)
        other = Channel(server.endpoint, "then", secret=SECRET)
        first.call({"op": "done"}, timeout=10)  # connected
        other.call({"op": "done"}, timeout=10)
        t0 = time.monotonic()
        first.call({"op": "slow"}, timeout=10)
        answered = time.monotonic() - t0
        assert answered < 0.4, f"the answer waited for the after-work ({answered:.2f} s)"
        assert other.call({"op": "done"}, timeout=10)[0]["done"] == 1  # queued behind it, saw it
        first.call({"op": "slow", "boom": True}, timeout=10)
        assert other.call({"op": "done"}, timeout=10)[0]["done"] == 2
        assert server.health()["failures"] == 1 and server.health()["alive"]
        first.close()
        other.close()
    finally:
        server.stop()


def _index_bytes(part) -> int:
    return sum(getattr(fi, name).nbytes for fi in part.fields.values() for name, _ in fi._COLUMNS)


def test_a_reserve_of_many_ids_in_a_wide_partition_costs_only_the_fields_it_writes(engine, ctrl, client, known):
    """A reserve takes slots, not rows of every field the partition holds: 50k ids in a
    partition of 64 fields grew each field's arrays (~250 MB) before; now the fields grow
    as they are written, and a field a sample does not hold reads as absent, named."""
    from rlplane.fields import FieldSpec, Registry

    reg = Registry([*default_registry().specs(), *(FieldSpec(f"w{i}", "sample", "dense", {"train"}) for i in range(64))])
    c = Client(reg, NativeTransport(engine.info, timeout=20))
    try:
        wide = {f"w{i}": torch.full((4, 2), float(i)) for i in range(64)}
        first = c.put_samples("wide", wide)
        c.transport.describe("wide")  # (the controller applies a one-message put after it answers: synced by this)
        part = engine.core._parts["wide"]
        before = _index_bytes(part)
        ids = [f"r{i}" for i in range(50_000)]
        got = ctrl.call({"op": "reserve", "p": "wide", "ids": ids, "create": True, "fields": ["w0"],
                         "blocks": [[987654321, [0], 0, len(ids)]]}, timeout=20)[0]
        assert _index_bytes(part) == before  # (before: 64 fields x 50k slots x 77 bytes)
        ctrl.call({"op": "abort", "res": got["res"]}, timeout=5)
        some = c.put_samples("wide", {"w63": torch.arange(2000.0).reshape(1000, 2)})
        c.transport.describe("wide")
        assert _index_bytes(part) < before + 2 * 50_000 * 77 + (1 << 16)  # one field grew, the others did not
        assert torch.equal(c.read_columns(some, ["w63"])["w63"], torch.arange(2000.0).reshape(1000, 2))
        with pytest.raises(E.MissingDataError, match="w0"):
            c.read_columns(some, ["w0"])
        assert c.transport.describe("wide").fields == {**{f"w{i}": 4 for i in range(63)}, "w63": 1004}
        assert c.clear("wide", some.sample_ids[:999]) == 999
        assert all(torch.equal(v, wide[k]) for k, v in c.read_columns(first, list(wide)).items())
        assert torch.equal(c.read_columns(some.slice(999, 1000), ["w63"])["w63"], torch.tensor([[1998.0, 1999.0]]))
    finally:
        c.clear("wide")
        c.close()
    intact(client, known)


def test_a_step_whose_samples_were_all_filtered_out_puts_and_writes_nothing_and_reads_say_so(client, known):
    """A put of no samples was a WireFormatError about block entries on the native engine
    (and stored an empty partition on the memory transport); it is a checked no-op on both,
    as is a write of no samples, and a read of none is an InvalidArgumentError that says so."""
    from rlplane.transports import MemoryTransport

    empty = {"input_ids": torch.zeros(0, 4, dtype=torch.int64), "input_lengths": torch.zeros(0, dtype=torch.int64)}
    for c in (client, Client(default_registry(), MemoryTransport())):
        meta = c.put_samples("none", empty)
        assert len(meta) == 0 and "none" not in c.partitions()
        assert c.write_columns(meta, {"prev_logprobs": torch.zeros(0, 4)}) is meta
        with pytest.raises(E.InvalidArgumentError, match="no samples"):
            c.read_columns(meta, ["input_ids"])
        with pytest.raises(E.UnknownFieldError):  # still checked
            c.put_samples("none", {**empty, "no_such_field": torch.zeros(0, 4)})
    intact(client, known)


def test_a_put_whose_header_the_engine_would_refuse_is_refused_at_the_client_at_once(client, known):
    """Tags of more than 2M lists and maps in all: the engine's decoder refuses such a header
    and cannot say to whom, so the put waited out its whole timeout, told nothing."""
    ids = {"input_ids": torch.ones(1, 4, dtype=torch.int64), "input_lengths": torch.tensor([4])}
    t0 = time.monotonic()
    with pytest.raises(E.WireFormatError, match="would refuse .*lists and maps"):
        client.put_samples("nested", ids, tags=[{"x": [[]] * ((2 << 20) + 1)}])
    assert time.monotonic() - t0 < 10 and "nested" not in client.partitions()
    intact(client, known)


def test_a_unit_stalled_across_a_controller_rebuild_keeps_its_samples_and_the_others_are_listed(monkeypatch):
    """A unit that did not answer the rebuild (stopped a few seconds: a GC pause, a slow
    node) had its samples declared lost, and its blocks freed as orphans once it answered;
    and waiting on it in turn used up the inventory's deadline, so the units after it were
    counted unreachable too, with their samples, silently."""
    from rlplane_service.native import health, recovery

    monkeypatch.setattr(recovery, "INVENTORY_TIMEOUT_S", 3.0)
    monkeypatch.setattr(health, "ORPHAN_MARGIN_S", 0.0)
    with LocalEngine(3, secret=SECRET, slab_bytes=16 << 20, processes=True, grace_s=3600, lease_s=0.5) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=10, data_path="shm"))
        try:
            fields = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
            metas = [c.put_samples("stall", fields) for _ in range(6)]  # blocks on every unit
            os.kill(eng.unit_pid(0), signal.SIGSTOP)
            try:
                eng.kill_controller()
                report = eng.restart_controller()
                assert len(report["unreachable_units"]) == 1 and report["unreachable_units"][0].startswith("u0")
                assert report["lost_samples"] == 0 and report["samples"] == 48 and report["waiting_blocks"] > 0
            finally:
                os.kill(eng.unit_pid(0), signal.SIGCONT)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (eng.core._suspect or eng.core._unlisted):
                time.sleep(0.2)
            assert not eng.core._suspect and not eng.core._unlisted
            time.sleep(1.2)  # older than a put's lease could keep them: what the sweep frees, if it does
            eng.core._sweep()
            assert eng.core.orphans_freed == 0 and eng.core.stats()["lost_samples"] == 0
            for meta in metas:  # (over the slab, mapped: the extents it listed once it answered)
                assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], fields["input_ids"])
        finally:
            c.close()


def test_a_put_that_failed_on_a_slow_unit_leaves_no_record_a_rebuild_counts_as_lost(monkeypatch):
    """A unit too slow to answer a put's commit-log write still kept the record; the failed
    put's records were withdrawn only from the units that had answered, and a rebuild then
    counted its samples lost (rlplane_lost_samples) though they were never stored."""
    from rlplane_service.native import recovery

    monkeypatch.setattr(recovery, "LOG_TIMEOUT_S", 0.5)
    with LocalEngine(3, secret=SECRET, slab_bytes=16 << 20, replicas=2, grace_s=3600, lease_s=30) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=10, data_path="zmq"))
        try:
            c.put_samples("p", {"input_ids": torch.full((2, 4), 7), "input_lengths": torch.full((2,), 4)})
            slow, real = eng.cores[0], eng.cores[0].op_log

            def late(header, columns, extra):
                time.sleep(1.0)
                return real(header, columns, extra)

            slow.op_log = late
            failed = 0
            for k in range(4):  # (whichever units the put's copies and records go to, one is u0 now and then)
                try:
                    c.put_samples("p", {"input_ids": torch.full((2, 4), k), "input_lengths": torch.full((2,), 4)})
                except E.RlplaneError:
                    failed += 1
            slow.op_log = real
            assert failed
            eng.core._ping(0, timeout=20)  # (answered after what it was sent before, the one-way forgets among it)
            eng.kill_controller()
            report = eng.restart_controller()
            assert report["lost_samples"] == 0 and eng.core.stats()["lost_samples"] == 0, report
            assert report["samples"] == 2 * (1 + 4 - failed)
        finally:
            c.close()


def test_a_put_every_unit_refused_never_costs_a_later_change_its_record_across_restarts():
    """A refused put's records were withdrawn 'early' from units that had refused them (and
    never would keep them): the sequence number was then handed out again by a rebuilt
    controller, and the unit dropped that later change, a clear (the partition came back)
    or an acknowledged put (gone)."""
    with LocalEngine(1, secret=SECRET, slab_bytes=1 << 20, lease_s=30) as eng:
        c = Client(default_registry(), NativeTransport(eng.info, timeout=10, data_path="zmq"))
        try:
            for k in range(40):  # the unit fills, and refuses the last put itself
                try:
                    c.put_samples("full", {"input_ids": torch.full((4, 2048), k),
                                           "input_lengths": torch.full((4,), 2048)})
                except E.StorageFullError:
                    break
            else:
                pytest.fail("the unit never filled")
            eng.kill_controller()
            eng.restart_controller()
            assert c.clear("full") > 0
            kept = c.put_samples("b", {"input_ids": torch.full((3, 8), 2), "input_lengths": torch.full((3,), 8)})
            eng.kill_controller()
            eng.restart_controller()
            assert c.partitions() == ["b"]
            assert torch.equal(c.read_columns(kept, ["input_ids"])["input_ids"], torch.full((3, 8), 2))
        finally:
            c.close()
