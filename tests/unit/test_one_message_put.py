"""A small put goes to the native controller in one message: it reserves, hands the rows to
their block's units with the put's commit-log record, and commits, in one round trip (a
bigger put reserves, writes to the units and commits). Pinned here: which puts take it,
that they read back bit for bit on every path, that a unit that cannot store the rows fails
the put typed with nothing of it left anywhere (no reservation, no block, no record), that
a put sent again after its answer was lost is answered as done, and that hostile messages
are refused with nothing reserved. In one process plus storage units (LocalEngine)."""

import secrets
import threading
import time

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.codec import encode
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import small_step, vlm_grpo
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane_service.native import commitlog as clog
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.unit import UnitCore
from rlplane_service.native.writes import PUT_MAX_BYTES

SECRET = b"one-message-secret"


@pytest.fixture
def engine():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        yield eng


def connect(eng: LocalEngine, path: str = "shm") -> Client:
    return Client(default_registry(), NativeTransport({"controller": eng.server.endpoint, "secret": SECRET.decode()},
                                                      timeout=30, data_path=path))


def ops(monkeypatch) -> list[str]:
    """The operations this thread's client sends, to the controller and the units, in order
    (not the in-process controller's to its units)."""
    seen: list[str] = []
    send, me = Channel.send, threading.get_ident()

    def counted(self, header, *args, **kwargs):
        if threading.get_ident() == me:
            seen.append(str(header.get("op")))
        return send(self, header, *args, **kwargs)

    monkeypatch.setattr(Channel, "send", counted)
    return seen


def blocks(eng: LocalEngine) -> list[tuple[int, int]]:
    return [(len(core._blocks), core.alloc.used_bytes) for core in eng.cores]


def wait_for(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def put_message(t: NativeTransport, partition: str, ids: list[str], enc) -> dict:
    """The ``put`` a client sends for encoded columns ``enc`` (a fresh id), to send by hand."""
    cols = enc.columns
    return {"op": "put", "put": secrets.token_hex(16), "p": partition, "ids": ids, "create": True,
            "fields": list(cols), "blocks": t._place(len(ids), 1), **native_transport._described(
                cols, {f: col.geom for f, col in cols.items()},
                {f: col.sums.astype("<u8").tobytes() for f, col in cols.items()}, None, None, None, False)}


def small_put(c, partition: str, prefix: str):
    """A small_step batch encoded, its ids and the ``put`` that sends it by hand."""
    w = small_step()
    enc = encode(c.registry, w.fields, w.fields["input_lengths"])
    ids = [f"{prefix}{i}" for i in range(len(w.lengths))]
    return w, enc, ids, put_message(c.transport, partition, ids, enc)


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_small_put_is_one_message_and_reads_back_bit_exact(engine, monkeypatch, path):
    with connect(engine, path) as c:
        w = small_step()
        sent = ops(monkeypatch)
        meta = c.put_samples("p", w.fields)
        assert sent == ["put"]  # no reserve, no extents asked of a unit, no commit
        got = c.read_columns(meta, list(w.fields))
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        del sent[:]
        width = int(w.lengths.max())
        lp = torch.randn(len(meta), width) * (torch.arange(width)[None, :] < w.lengths[:, None])  # (padding reads 0)
        meta = c.write_columns(meta, {"prev_logprobs": lp})  # a write of stored samples, too
        assert sent == ["put"]
        assert torch.equal(c.read_columns(meta, ["prev_logprobs"])["prev_logprobs"], lp)
        # rows a group shares are stored once in a one-message put as in any
        g = vlm_grpo(8, 32, seed=2, group=4, sides=(2, 3))
        del sent[:]
        mg = c.put_samples("g", g.fields)
        assert sent[-1] == "put" and "reserve" not in sent
        got = c.read_columns(mg, list(g.fields))
        assert diff_fields(c.registry, g.fields, got, g.lengths, sample_ids=mg.sample_ids) == []
        assert c.transport.stats()["shared_bytes"] > 0


def test_a_put_over_the_one_message_size_reserves_writes_and_commits(engine, monkeypatch):
    monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 100)
    with connect(engine) as c:
        w = small_step()
        sent = ops(monkeypatch)
        meta = c.put_samples("p", w.fields)
        assert sent[0] == "reserve" and "alloc" in sent and sent[-1] == "commit" and "put" not in sent
        got = c.read_columns(meta, list(w.fields))
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []


def test_a_unit_that_cannot_store_the_rows_fails_the_put_typed_and_leaves_nothing(engine, monkeypatch):
    with connect(engine) as c:
        kept = c.put_samples("p", small_step().fields)
        before, entries = blocks(engine), [len(core.log.entries()) for core in engine.cores]

        def full(self, bid, layout, staged=None):
            raise E.StorageFullError(f"storage unit {self.name} is full (test)")

        monkeypatch.setattr(UnitCore, "_store", full)
        with pytest.raises(E.StorageFullError, match="is full .test."):
            c.put_samples("p", small_step().fields, sample_ids=[f"n{i}" for i in range(8)])
        monkeypatch.undo()
        assert c.transport.describe("p").sample_ids == kept.sample_ids
        assert c.transport.stats()["reservations"] == 0
        assert wait_for(lambda: blocks(engine) == before)
        # the unit that kept the record without the rows (the second copy of a record) forgot it
        assert wait_for(lambda: [len(core.log.entries()) for core in engine.cores] == entries)
        again = c.put_samples("p", small_step().fields, sample_ids=[f"n{i}" for i in range(8)])
        assert len(again) == 8


def test_a_put_sent_again_is_answered_as_done_also_after_a_controller_restart(engine):
    with connect(engine) as c:
        w, enc, ids, header = small_put(c, "again", "s")
        t = c.transport
        first = t._ask(header, 10, dict(enc.columns))
        assert first["committed"] == len(ids) and "again" not in first
        assert t._ask(header, 10, dict(enc.columns))["again"] is True
        engine.kill_controller()
        engine.restart_controller()
        again = t._ask(header, 30, dict(enc.columns))
        assert (again["committed"], again["again"], again["bn"]) == (len(ids), True, first["bn"])
        assert t.describe("again").sample_ids == ids  # stored once
        meta = c.claim("again", "t", batch_size=len(ids), fields=list(enc.columns), timeout=5)
        got = c.read_columns(meta, list(w.fields))
        order = [ids.index(s) for s in meta.sample_ids]
        want = {f: v[order] for f, v in w.fields.items()}
        assert diff_fields(c.registry, want, got, w.lengths[order], sample_ids=meta.sample_ids) == []


def test_hostile_one_message_puts_are_refused_typed_and_reserve_nothing(engine):
    with connect(engine) as c:
        w, enc, ids, good = small_put(c, "h", "h")
        t = c.transport
        ch = Channel(engine.server.endpoint, "controller", secret=SECRET)
        cols = dict(enc.columns)
        some = dict(list(cols.items())[:2])
        ids_bytes = {**good["nb"], "input_ids": good["nb"]["input_ids"][:-8] + (10**6).to_bytes(8, "little")}
        big = {"input_ids": type(cols["input_ids"])(torch.zeros(PUT_MAX_BYTES // 8 + 1, dtype=torch.int64),
                                                    torch.tensor([0, PUT_MAX_BYTES // 8 + 1]))}
        for header, columns, error in [
            ({**good, "put": "short"}, cols, E.WireFormatError),
            ({**good, "put": "x" * 20 + "/"}, cols, E.WireFormatError),
            ({**good, "put": secrets.token_hex(16)}, some, E.WireFormatError),  # rows of some fields only
            ({**good, "put": secrets.token_hex(16), "nb": ids_bytes}, cols, E.WireFormatError),  # sizes that lie
            ({**good, "put": secrets.token_hex(16), "ids": ["b0"], "fields": ["input_ids"]}, big, E.PayloadTooLargeError),
            ({**good, "put": secrets.token_hex(16), "g": 3}, cols, E.WireFormatError),
        ]:
            with pytest.raises(error):
                ch.call(header, columns, timeout=10)
            assert t.stats()["reservations"] == 0 and "h" not in t.partitions()
        ch.close()
        assert wait_for(lambda: sum(n for n, _ in blocks(engine)) == 0)
        assert all(e.kind != clog.PUT or e.partition != "h" for core in engine.cores for e in core.log.entries())
        meta = c.put_samples("h", w.fields, sample_ids=ids)  # the real one
        assert diff_fields(c.registry, w.fields, c.read_columns(meta, list(w.fields)), w.lengths,
                           sample_ids=ids) == []
