"""Storage units' slabs in one process (no Ray): the shared-memory, transfer-engine and
ZMQ data paths, a full slab, pins under zero-copy reads, and who may map a slab."""

import gc
import socket
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import Client, PackedTensor, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.fields import FieldSpec, Registry
from rlplane.readpool import ReadPool
from rlplane.shm import open_slab
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from rlplane.transports.native import NativeTransport, TeOptions
from rlplane_service.native.local import LocalEngine

SECRET = b"slab-test-secret"
SLAB = 64 << 20


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, slab_bytes=SLAB, lease_s=30, replicas=2, te_protocol="tcp") as eng:
        yield {"info": eng.info, "core": eng.core, "cores": eng.cores, "units": eng.units}


#: The te path's staging buffer: small, so a vlm-step put or read moves in several batches.
STAGING = 256 << 10


def connect(engine, path: str, registry: Registry | None = None) -> Client:
    return Client(registry or default_registry(), NativeTransport(engine["info"], timeout=30, data_path=path,
                                                                  te=TeOptions(staging_bytes=STAGING)))


def used(engine) -> list[int]:
    return [c.alloc.used_bytes for c in engine["cores"]]


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["shm", "te", "zmq"])
def test_vlm_step_round_trips_bit_exactly_with_two_copies_on_each_path(engine, path):
    with connect(engine, path) as client:
        assert set(client.transport.paths().values()) == {path}
        w = vlm_step(8, 256, seed=11)
        before = used(engine)
        meta = client.put_samples(f"vlm-{path}", w.fields)
        assert all(u > b for u, b in zip(used(engine), before)), "R=2: both units hold a copy"
        got = client.read_columns(meta, list(w.fields))
        assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        sub = meta.subset([7, 0, 3])
        got = client.read_columns(sub, ["pixel_values", "input_ids"], layout="jagged")
        want = w.select([7, 0, 3])
        assert diff_fields(client.registry, {k: want.fields[k] for k in ("pixel_values", "input_ids")}, got,
                           want.lengths, sample_ids=sub.sample_ids) == []
        client.clear(f"vlm-{path}")
        wait_for(lambda: used(engine) == before, "the cleared blocks' extents were not given back")


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int64, torch.int32, torch.uint8, torch.bool]


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), seq=st.integers(1, 9), rest=st.lists(st.integers(1, 3), max_size=2),
       dtype=st.sampled_from(FLOATS + INTS), path=st.sampled_from(["shm", "te", "zmq"]), data=st.data())
def test_random_geometries_and_dtypes_round_trip_on_every_path(engine, batch, seq, rest, dtype, path, data):
    wire = torch.bfloat16 if dtype.is_floating_point else None
    reg = Registry([FieldSpec("tok", "token", "dense", {"s"}, wire_dtype=wire),
                    FieldSpec("smp", "sample", "dense", {"s"}),
                    FieldSpec("med", "media", "packed", {"s"}, wire_dtype=wire),
                    FieldSpec("input_lengths", "sample", "dense", {"s"})])
    lengths = data.draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
    def rnd(*shape):
        return (torch.randn(*shape) * 50).to(dtype)
    media = [data.draw(st.one_of(st.none(), st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3),
                                                     min_size=1, max_size=2))) for _ in range(batch)]
    fields = {"tok": rnd(batch, seq, *rest), "smp": rnd(batch, *rest), "input_lengths": torch.tensor(lengths),
              "med": PackedTensor([None if r is None else [rnd(*s) for s in r] for r in media])}
    with connect(engine, path, reg) as client:
        meta = client.put_samples("geom", fields)
        for layout in ("padded", "jagged"):
            got = client.read_columns(meta, list(meta.fields), layout=layout)
            assert diff_fields(reg, {k: v for k, v in fields.items() if k in meta.fields}, got, lengths) == []
        client.clear("geom")


@pytest.mark.parametrize("path", ["shm", "te", "zmq"])
def test_a_put_that_does_not_fit_is_storage_full_keeps_nothing_and_the_rest_reads(engine, path):
    with connect(engine, path) as client:
        small = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
        kept = client.put_samples(f"keep-{path}", small)
        before = used(engine)
        big = {"input_ids": torch.ones(4, SLAB // 16, dtype=torch.int64), "input_lengths": torch.full((4,), SLAB // 16)}
        with pytest.raises(E.StorageFullError) as err:
            client.put_samples(f"full-{path}", big, sample_ids=list("abcd"))
        msg = str(err.value)
        assert "has no room" in msg and "RLPLANE_UNIT_BYTES" in msg and "free" in msg
        assert any(f"storage unit {c.name} " in msg for c in engine["cores"]) and f"slab of {SLAB} bytes" in msg, msg
        assert f"full-{path}" not in client.partitions()
        wait_for(lambda: used(engine) == before, "a refused put left extents behind")
        assert torch.equal(client.read_columns(kept, ["input_ids"])["input_ids"], small["input_ids"])
        meta = client.put_samples(f"full-{path}", small, sample_ids=list("abcdefgh"))  # the ids were given back
        client.clear(meta.partition)
        client.clear(kept.partition)


def test_a_zero_copy_view_keeps_its_extent_until_it_is_freed(engine):
    """A clear under a live zero-copy tensor frees nothing; a new put cannot land in its
    memory; once the tensor is garbage, the extent goes back."""
    with connect(engine, "shm") as client:
        first = torch.arange(4096, dtype=torch.float32).reshape(8, 512)
        meta = client.put_samples("zc", {"advantages": first, "input_lengths": torch.full((8,), 512)},
                                  sample_ids=[f"s{i}" for i in range(8)])
        before_read = used(engine)
        view = client.read_columns(meta, ["advantages"], layout="jagged", copy=False)["advantages"]
        base = view.values()
        assert base.untyped_storage().data_ptr() != 0
        client.clear("zc")
        time.sleep(0.3)  # the controller would have sent the frees by now
        assert used(engine) == before_read, "a pinned block was freed under a live view"
        for k in range(3):  # new puts of the same size go elsewhere in the slab
            client.put_samples("zc", {"advantages": torch.full((8, 512), -1.0 - k), "input_lengths": torch.full((8,), 512)},
                               sample_ids=[f"t{k}{i}" for i in range(8)])
        assert torch.equal(torch.stack(list(view.unbind())), first), "a live view saw another put's bytes"
        client.clear("zc")
        del view, base
        gc.collect()
        wait_for(lambda: used(engine) < before_read, "the extent was not given back once the view was gone")
        assert client.transport.stats()["pins"] == 0


def _child_keeps_its_view(client, view, want, todo, q) -> None:
    try:
        later = todo.get(timeout=60)  # once the parent let go of its views and the memory was reused
        same = torch.equal(torch.stack(list(view.unbind())), want)
        fresh = client.read_columns(later, ["advantages"], layout="jagged", copy=False)["advantages"]
        ok = torch.equal(torch.stack(list(fresh.unbind())), torch.full((8, 512), -7.0))
        del fresh
        gc.collect()  # (its pin goes before this process does: a later test counts pins)
        wait_for(lambda: client.transport.stats()["pins"] == 0, "the child's pin was not released")
        q.put((same, ok))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        q.put(repr(err))


def test_a_forked_child_keeps_what_its_inherited_zero_copy_views_showed(engine):
    """A view's pin is its reader's: a forked child (a DataLoader worker) inherited the
    view but not the pin, and once the parent dropped its views, a clear and new puts
    showed through the child's tensor, silently (its digests were checked at the read).
    The child's inherited views now become copies of its own at the fork, and the
    client it inherited maps the slabs afresh for its own zero-copy reads."""
    import multiprocessing as mp

    with connect(engine, "shm") as client:
        first = torch.arange(4096, dtype=torch.float32).reshape(8, 512)
        meta = client.put_samples("zfork", {"advantages": first, "input_lengths": torch.full((8,), 512)})
        view = client.read_columns(meta, ["advantages"], layout="jagged", copy=False)["advantages"]
        ctx = mp.get_context("fork")
        todo, q = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_child_keeps_its_view, args=(client, view, first, todo, q))
        child.start()
        try:
            del view
            gc.collect()  # the parent is done with its views: their pin goes
            wait_for(lambda: client.transport.stats()["pins"] == 0, "the parent's pin was not released")
            client.clear("zfork")
            later = [client.put_samples("zfork", {"advantages": torch.full((8, 512), -7.0),
                                                  "input_lengths": torch.full((8,), 512)}) for _ in range(3)]
            todo.put(later[-1])
            answer = q.get(timeout=60)
        finally:
            child.join(timeout=30)
        assert answer == (True, True), answer
        client.clear("zfork")


def test_a_copied_read_is_owned_memory_that_later_puts_never_touch(engine):
    with connect(engine, "shm") as client:
        x = torch.arange(2048, dtype=torch.int64).reshape(4, 512)
        meta = client.put_samples("own", {"input_ids": x, "input_lengths": torch.full((4,), 512)})
        got = client.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
        client.clear("own")
        client.put_samples("own", {"input_ids": torch.zeros_like(x), "input_lengths": torch.full((4,), 512)})
        assert torch.equal(torch.stack(list(got.unbind())), x)
        client.clear("own")


def test_a_padded_read_pads_big_token_rows_out_of_the_slab_into_memory_it_owns(engine, monkeypatch):
    """Token rows a padded read pads are lent (views of the slab, not copied out first);
    what the read returns is the caller's: writable, untouched by later puts, and the
    pin on the rows is gone once the read has returned."""
    with connect(engine, "shm") as client:
        g = torch.Generator().manual_seed(8)
        lens = torch.randint(1, 1025, (512,), generator=g)
        lens[5] = 1024  # (a padded read pads to the longest)
        x = torch.randint(0, 10**9, (512, 1024), generator=g) * (torch.arange(1024) < lens[:, None])
        meta = client.put_samples("lent", {"input_ids": x, "input_lengths": lens})
        copied = []  # the fields whose rows were copied out of the slab (one field at a time, or a small read's at once)
        real = NativeTransport._copy_out
        monkeypatch.setattr(NativeTransport, "_copy_out", staticmethod(lambda *a: copied.extend(e[0] for e in a[1])
                                                                        or real(*a)))
        got = client.read_columns(meta, ["input_ids", "input_lengths"])
        assert copied == ["input_lengths"], "the token rows were copied out before they were padded"
        assert torch.equal(got["input_ids"], x) and torch.equal(got["input_lengths"], lens)
        wait_for(lambda: client.transport.stats()["pins"] == 0, "the lent rows' pin outlived the read")
        got["input_ids"][0, 0] += 1  # the caller's own memory
        client.clear("lent")
        client.put_samples("lent", {"input_ids": torch.zeros_like(x), "input_lengths": lens})
        assert torch.equal(got["input_ids"][1:], x[1:]) and int(got["input_ids"][0, 0]) == int(x[0, 0]) + 1
        small = client.put_samples("lent2", {"input_ids": x[:2, :8], "input_lengths": torch.full((2,), 8)})
        copied.clear()
        client.read_columns(small, ["input_ids"])
        assert copied == ["input_ids"]  # a small field is copied: a pin would cost what the copy saves
        client.clear("lent")
        client.clear("lent2")


def test_a_unit_stages_several_fields_at_once_all_or_none_and_a_block_frees_what_it_did_not_use(engine):
    ch = Channel(engine["units"][0].endpoint, "u0", secret=SECRET)
    core = engine["cores"][0]

    def settled() -> bool:  # the frees of earlier tests' clears have reached the unit
        last = core.alloc.used_bytes
        time.sleep(0.3)
        return core.alloc.used_bytes == last

    wait_for(settled, "the unit's memory kept changing")
    before = core.alloc.used_bytes
    bid = 9_876_543_210
    xs = ch.call({"op": "stage", "b": bid, "fs": [["a", "int64", 1 << 20], ["b", "float32", 2 << 20]]}, timeout=10)[0]["xs"]
    assert len(xs) == 2 and core.alloc.used_bytes >= before + (3 << 20)
    staged = core.alloc.used_bytes
    with pytest.raises(E.StorageFullError):  # the second does not fit: the first is not kept either
        ch.call({"op": "stage", "b": bid + 1, "fs": [["a", "int64", 1 << 20], ["b", "uint8", 2 * SLAB]]}, timeout=10)
    assert core.alloc.used_bytes == staged
    with pytest.raises(E.WireFormatError, match="twice"):
        ch.call({"op": "stage", "b": bid + 2, "fs": [["a", "int64", 8], ["a", "int64", 8]]}, timeout=10)
    with pytest.raises(E.WireFormatError, match="staged"):  # a field of the block staged already
        ch.call({"op": "stage", "b": bid, "fs": [["a", "int64", 8]]}, timeout=10)
    offsets = np.array([0, (1 << 20) // 8], np.int64)
    ch.call({"op": "alloc", "b": bid, "f": [["a", "int64", 1 << 20, xs[0]]]}, None, [offsets.tobytes()], timeout=10)
    assert core.alloc.used_bytes == staged - (2 << 20), "the block kept the extent staged for 'b', which it did not use"
    core.op_free({"b": np.array([bid], "<i8").tobytes()}, {}, [])  # (the controller's to send)
    assert core.alloc.used_bytes == before
    ch.close()


def test_a_put_stages_its_big_token_fields_in_one_round_trip_and_what_it_did_not_use_is_freed(engine, monkeypatch):
    """The sizes the codec knows before encoding are staged at once; a hint the encode does
    not follow (a field it never asks for, or another size) costs no correctness and no
    memory once the put is stored."""
    from rlplane.codec import alloc_sizes, decode, encode, prepare

    calls = []
    real = Channel.call
    monkeypatch.setattr(Channel, "call", lambda self, header, *a, **k: calls.append(header.get("op")) or
                        real(self, header, *a, **k))
    with connect(engine, "shm") as client:
        g = torch.Generator().manual_seed(9)
        lens = torch.randint(1, 1025, (1536,), generator=g)
        lens[0] = 1024
        valid = torch.arange(1024) < lens[:, None]
        fields = {"input_ids": torch.randint(0, 10**6, (1536, 1024), generator=g) * valid,
                  "generation_logprobs": -torch.rand(1536, 1024, generator=g) * valid,
                  "advantages": torch.randn(1536, 1024, generator=g) * valid, "input_lengths": lens}
        before = used(engine)
        meta = client.put_samples("stg", fields)
        assert calls.count("stage") == 1
        back = client.read_columns(meta, list(fields))
        assert all(torch.equal(back[f], fields[f]) for f in fields)
        t, reg = client.transport, client.registry
        prep = prepare(reg, fields, lens)
        sizes = alloc_sizes(reg, fields, prep)
        assert set(sizes) == {"input_ids", "generation_logprobs", "advantages"}
        ids = [f"h{i}" for i in range(1536)]
        for k, hint in enumerate([{**sizes, "token_mask": (400_000, torch.float32)},  # a field never asked for
                                  {"input_ids": (300_000, torch.int64)}]):  # another size than asked for
            calls.clear()
            with t.put_buffers(1536, None, hint) as alloc:
                enc = encode(reg, fields, alloc=alloc, prepared=prep)
                t.put(f"hint{k}", ids, enc.columns, enc.tags, create=True)
            assert calls.count("stage") == (1 if k == 0 else 3)  # (the two it was not told of: one each)
            cols, tags = t.get(f"hint{k}", ids, list(fields))
            got = decode(reg, cols, tags)
            assert all(torch.equal(got[f], fields[f]) for f in fields)
            client.clear(f"hint{k}")
        client.clear("stg")
        wait_for(lambda: used(engine) == before, "a staged extent the put did not use was kept")


def test_without_the_secret_no_ticket_and_without_a_ticket_no_slab(engine):
    endpoint = engine["units"][0].endpoint
    with pytest.raises(E.AuthenticationError):
        Channel(endpoint, "u0", secret=b"wrong").call({"op": "slab"}, timeout=10)
    good = Channel(endpoint, "u0", secret=SECRET)
    share = good.call({"op": "slab"}, timeout=10)[0]
    with pytest.raises(E.TransportError, match="refused"):
        open_slab(share["sock"], "0" * 32, share["bytes"], unit="u0", timeout=5)
    view = open_slab(share["sock"], share["ticket"], share["bytes"], unit="u0", timeout=5)
    view.close()
    with pytest.raises(E.TransportError, match="refused"):  # a ticket works once
        open_slab(share["sock"], share["ticket"], share["bytes"], unit="u0", timeout=5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # garbage on the socket: refused, share goes on
        s.connect("\0" + share["sock"])
        s.sendall(b"\xff" * 200)
    fresh = good.call({"op": "slab"}, timeout=10)[0]
    open_slab(fresh["sock"], fresh["ticket"], fresh["bytes"], unit="u0", timeout=5).close()
    good.close()


def test_peers_that_connect_and_say_nothing_hold_up_no_ticket_holder(engine):
    """Anyone on the host can find the share's socket (/proc/net/unix); it served one
    connection at a time, 2 s per silent peer, so a few idle connections kept every client
    from mapping the slab (data_path=shm failed, auto fell back to sockets)."""
    good = Channel(engine["units"][0].endpoint, "u0", secret=SECRET)
    share = good.call({"op": "slab"}, timeout=10)[0]
    idle = []
    try:
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + share["sock"])
            s.send(b"a")  # and never the rest of a ticket
            idle.append(s)
        t0 = time.monotonic()
        open_slab(share["sock"], share["ticket"], share["bytes"], unit="u0", timeout=5).close()
        assert time.monotonic() - t0 < 1.0
    finally:
        for s in idle:
            s.close()
        good.close()


def test_the_read_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    pool = ReadPool(max_bytes=64 << 20)
    a = pool.take(8 << 20)
    t = torch.from_numpy(a.view(np.int16))
    del a
    gc.collect()
    b = pool.take(8 << 20)  # `t` still uses the first buffer: this is another one
    assert pool.reused == 0 and b.ctypes.data != t.numpy().ctypes.data
    addr = t.numpy().ctypes.data
    del t
    gc.collect()
    c = pool.take(7 << 20)
    assert pool.reused == 1 and c.ctypes.data == addr
    assert pool.take(1000).size == 1000  # small requests are plain memory


def pixels(batch: int, patches: int, seed: int = 0) -> dict:
    """A packed float32 field well over STAGE_MIN_BYTES once cast (and small token fields)."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.arange(batch * 8).reshape(batch, 8), "input_lengths": torch.full((batch,), 8),
            "pixel_values": PackedTensor([torch.rand(patches, 1176, generator=g) for _ in range(batch)])}


def test_big_fields_are_encoded_straight_into_the_local_slab_and_read_back_bit_exact(engine, monkeypatch):
    copied: list[set] = []
    real = NativeTransport._copy_in

    def spy(view, where, part, staged):
        copied.append({f for f, c in part.items() if c.nbytes and f not in staged})
        return real(view, where, part, staged)

    monkeypatch.setattr(NativeTransport, "_copy_in", staticmethod(spy))
    with connect(engine, "shm") as client:
        fields = pixels(8, 256, seed=5)  # 8 x 256 x 1176 bf16: 4.8 MB of pixels
        meta = client.put_samples("staged", fields)
        # first copy: the pixels were cast into their extent (only the small fields copied);
        # the second copy (R=2) is copied from there
        assert "pixel_values" not in copied[0] and "input_ids" in copied[0] and "pixel_values" in copied[1]
        assert client._scratch is None or "pixel_values" not in client._scratch._free  # no buffer in between
        got = client.read_columns(meta, ["input_ids", "pixel_values"])
        for mine, want in zip(got["pixel_values"], fields["pixel_values"]):
            assert torch.equal(mine[0], want[0].to(torch.bfloat16))
        assert all(not c._staged for c in engine["cores"]), "a staged extent was left behind"
        copied.clear()
        lp = torch.randn(8, 8)
        logp = client.write_columns(meta, {"prev_logprobs": lp})  # small: one message, the controller hands it over
        assert copied == [] and logp.fields >= {"prev_logprobs"}
        assert torch.equal(client.read_columns(logp, ["prev_logprobs"])["prev_logprobs"], lp)
        client.clear("staged")


def test_a_refused_put_gives_back_the_extents_it_encoded_into(engine):
    with connect(engine, "shm") as client:
        client.put_samples("staged-dup", pixels(2, 8), sample_ids=["a", "b"])
        before = used(engine)
        with pytest.raises(E.DuplicateSampleError, match="'b'"):
            client.put_samples("staged-dup", pixels(4, 512, seed=1), sample_ids=["c", "d", "e", "b"])
        wait_for(lambda: used(engine) == before and all(not c._staged for c in engine["cores"]),
                 "a refused staged put left extents behind")
        with pytest.raises(E.StorageFullError, match="has no room"):  # too big to stage at all
            client.put_samples("staged-full", pixels(2, SLAB // 1176 // 2 + 1024))
        wait_for(lambda: used(engine) == before, "a put too big to stage left extents behind")
        assert "staged-full" not in client.partitions()
        assert client.clear("staged-dup") == 2


def test_a_unit_takes_a_staged_extent_only_into_its_own_block_and_frees_an_untaken_one(engine):
    core = engine["cores"][0]
    before = core.alloc.used_bytes
    x = core.op_stage({"b": 71, "f": "pixel_values", "d": "bfloat16", "n": 4096}, {}, [])[0]["x"]
    off = np.array([0, 2048], dtype=np.int64).tobytes()
    with pytest.raises(E.WireFormatError, match="not staged"):  # another block cannot take it
        core.op_alloc({"b": 72, "f": [["pixel_values", "bfloat16", 4096, x]]}, {}, [off])
    with pytest.raises(E.WireFormatError, match="not staged"):  # nor with another size
        core.op_alloc({"b": 71, "f": [["pixel_values", "bfloat16", 2048, x]]}, {}, [np.array([0, 1024]).tobytes()])
    with pytest.raises(E.WireFormatError, match="already"):
        core.op_stage({"b": 71, "f": "pixel_values", "d": "bfloat16", "n": 4096}, {}, [])
    with pytest.raises(E.ForbiddenError):
        core.op_stage({"b": 73, "f": "x", "d": "uint8", "n": 64, "_user": "tenant-a"}, {}, [])
    for bad in ({"b": 74, "f": "x", "d": "uint8", "n": 0}, {"b": 74, "f": "x", "d": "bfloat16", "n": 3},
                {"b": 74, "f": 5, "d": "uint8", "n": 64}, {"b": 74, "f": "x", "d": "no-such", "n": 64}):
        with pytest.raises(E.WireFormatError):
            core.op_stage(bad, {}, [])
    old = np.frombuffer(core.op_old({"age": 0}, {}, [])[0]["b"], dtype="<i8").tolist()
    assert 71 in old  # the controller's sweep sees an untaken staged extent like an orphan block...
    core.op_free({"b": np.array([71], dtype="<i8").tobytes()}, {}, [])
    assert core.alloc.used_bytes == before and not core._staged  # ...and frees it
    y = core.op_stage({"b": 75, "f": "pixel_values", "d": "bfloat16", "n": 4096}, {}, [])[0]["x"]
    got = core.op_alloc({"b": 75, "f": [["pixel_values", "bfloat16", 4096, y], ["ids", "int64", 16]]}, {},
                        [off, np.array([0, 2], dtype=np.int64).tobytes()])[0]
    assert got["x"]["pixel_values"] == y and not core._staged  # taken as is, the other field allocated
    core.op_free({"b": np.array([75], dtype="<i8").tobytes()}, {}, [])
    assert core.alloc.used_bytes == before


def test_a_unit_that_died_before_its_stage_makes_the_put_go_around_it():
    """The unit a put would encode into is gone: the big field is encoded as usual, the
    controller hears of the loss, and the put lands on the live units (bit for bit)."""
    with LocalEngine(3, secret=SECRET, slab_bytes=SLAB, lease_s=30, replicas=2) as eng:
        info = {"info": eng.info, "cores": eng.cores}
        with connect(info, "shm") as client:
            client.put_samples("before", pixels(2, 8))  # every slab mapped, the channels up
            eng.kill_unit(1)
            client.transport._cursor = 1  # the next put's local first copy would be unit 1
            fields = pixels(4, 512, seed=3)
            meta = client.put_samples("around", fields)
            got = client.read_columns(meta, ["pixel_values"])["pixel_values"]
            for mine, want in zip(got, fields["pixel_values"]):
                assert torch.equal(mine[0], want[0].to(torch.bfloat16))
            assert 1 in client.transport.down
            wait_for(lambda: not eng.cores[0]._staged and not eng.cores[2]._staged, "a staged extent was left behind")


def test_a_mapping_maps_each_granule_once_before_a_big_copy_and_skips_small_ones():
    """SlabView.prefault: the pages a copy is about to touch are mapped in one madvise per
    run of granules not touched yet; a granule is never mapped twice; small copies skip it;
    and what is copied after lands where the unit sees it."""
    import mmap
    import os

    from rlplane.shm import GRANULE_SHIFT, PREFAULT_MIN, SlabView

    n = 8 << GRANULE_SHIFT
    fd = os.memfd_create("rlplane-test-prefault")
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        ro = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
        owner = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)  # the unit's own mapping
    finally:
        os.close(fd)
    view = SlabView("u0", n, mm, np.frombuffer(mm, np.uint8), ro)
    g = 1 << GRANULE_SHIFT
    calls = []
    import rlplane.shm as shm

    real = shm.populate
    shm.populate = lambda u8, write: calls.append(u8.size) or real(u8, write=write)
    try:
        view.prefault(10, 10 + PREFAULT_MIN - 1)  # small: skipped
        assert calls == [] and not view._mapped.any()
        view.prefault(g + 5, 3 * g + 1)  # granules 1, 2, 3: one run
        assert calls == [3 * g] and view._mapped[1:4].all() and not view._mapped[0]
        view.prefault(0, 5 * g)  # granules 0 and 4 only: two runs
        assert calls == [3 * g, g, g] and view._mapped[:5].all()
        view.prefault(g, 4 * g)  # nothing new
        assert len(calls) == 3
        view.prefault(7 * g + 1, n)  # the last granule, clipped at the slab's end
        assert calls[-1] == g and view._mapped[7]
    finally:
        shm.populate = real
    data = np.arange(4 * g, dtype=np.uint64).view(np.uint8)[: 3 * g]
    view.u8[g : 4 * g] = data
    assert np.array_equal(np.frombuffer(owner, np.uint8)[g : 4 * g], data)
    del data
    view.close()
    owner.close()


@pytest.mark.parametrize("check", ["writer", "unit"])
def test_a_writer_stalled_past_its_lease_never_copies_into_another_puts_rows(monkeypatch, check):
    """A writer stalled between the unit's extents and its copy into them (stopped,
    swapping) while its reservation lapsed copied into blocks the controller had freed and
    given to another put: that put's committed rows changed under it. The writer now stops
    once most of its lease has passed ("writer"), and the unit keeps a lapsed put's extents
    out of use a while ("unit": the writer's check turned off, as if it stalled mid-copy)."""
    import threading

    import rlplane.transports.native as native

    monkeypatch.setattr(native, "ONE_MESSAGE_BYTES", 0)  # (the alloc-and-copy path every put past 256 KiB takes)
    stall = threading.Event()

    def stalled(real):
        def run(*args):
            if stall.is_set():
                stall.clear()
                time.sleep(2.5)  # past the 1 s lease: the reaper gave its reservation up meanwhile
            return real(*args)
        return run

    if check == "writer":  # stalled before the copy (the units' answers in)
        monkeypatch.setattr(native, "_offsets", stalled(native._offsets))
    else:  # stalled in the copy, as if past the writer's check
        monkeypatch.setattr(native, "COPY_WITHIN", 1e9)
        monkeypatch.setattr(native.NativeTransport, "_copy_in", staticmethod(stalled(native.NativeTransport._copy_in)))
    with LocalEngine(1, secret=SECRET, slab_bytes=8 << 20, lease_s=1.0) as eng:
        info = {"info": eng.info}
        a, b = connect(info, "shm"), connect(info, "shm")
        failed: list[BaseException] = []

        def write_a() -> None:
            stall.set()
            try:
                a.put_samples("A", {"input_ids": torch.full((4, 1024), 1111), "input_lengths": torch.full((4,), 1024)})
            except E.RlplaneError as err:
                failed.append(err)

        writer = threading.Thread(target=write_a)
        writer.start()
        time.sleep(1.8)
        want = torch.arange(4 * 1024).reshape(4, 1024)
        meta = b.put_samples("B", {"input_ids": want, "input_lengths": torch.full((4,), 1024)})
        writer.join(timeout=30)
        assert torch.equal(b.read_columns(meta, ["input_ids"])["input_ids"], want)
        assert "A" not in b.partitions()
        assert len(failed) == 1 and isinstance(failed[0], E.LeaseError), failed
        assert "RLPLANE_PUT_LEASE_S" in str(failed[0]) and ("stalled" in str(failed[0])) == (check == "writer")


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_put_a_full_unit_refuses_goes_to_a_unit_with_room(path):
    """Units are taken in turn whatever room they have: with one unit full, every other
    put failed with StorageFullError (which told the user to clear or grow the store)
    while the other unit had room to spare."""
    with LocalEngine(2, secret=SECRET, slab_bytes=8 << 20) as eng:
        c = connect({"info": eng.info}, path)
        row = {"input_ids": torch.zeros(1, 96 << 10, dtype=torch.int64), "input_lengths": torch.tensor([96 << 10])}
        for k in range(64):  # fill unit 0 (what lands on unit 1 is cleared)
            before = eng.cores[1].alloc.used_bytes
            try:
                c.put_samples(f"fill-{k}", row)
            except E.StorageFullError:
                pytest.fail("a put failed with a unit that has room")
            if eng.cores[1].alloc.used_bytes > before:
                c.clear(f"fill-{k}")
            if eng.cores[0].alloc.stats()["largest_free"] < row["input_ids"].nbytes:
                break
        assert eng.cores[0].alloc.stats()["largest_free"] < row["input_ids"].nbytes
        metas = [c.put_samples(f"more-{j}", row) for j in range(4)]  # every one on unit 1
        assert all(torch.equal(c.read_columns(m, ["input_ids"])["input_ids"], row["input_ids"]) for m in metas)
        with pytest.raises(E.StorageFullError, match="RLPLANE_UNIT_BYTES"):  # both full: said so
            for j in range(16):
                c.put_samples(f"over-{j}", row)


def test_a_writer_that_maps_one_full_unit_puts_on_the_unit_it_reaches_over_zmq():
    """With one unit mapped here (its host's), every put's first copy went to it: full, and
    the put failed while the unit on the other host was empty."""
    with LocalEngine(2, secret=SECRET, slab_bytes=8 << 20) as eng:
        transport = NativeTransport(eng.info, timeout=30, data_path="auto")
        transport._slab_map.pop(1)  # unit 1 on another host: reached over zmq
        c = Client(default_registry(), transport)
        row = {"input_ids": torch.zeros(1, 96 << 10, dtype=torch.int64), "input_lengths": torch.tensor([96 << 10])}
        with pytest.raises(E.StorageFullError):
            for k in range(40):
                c.put_samples(f"fill-{k}", row)
        assert [core.alloc.stats()["largest_free"] < row["input_ids"].nbytes for core in eng.cores] == [True, True]
        c.close()
