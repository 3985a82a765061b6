"""The native engine in one process (no Ray): controller and units served on loopback,
a NativeTransport and a Client in front, the same semantics as every transport."""

import threading
import time

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane.testing.verify import diff_fields
from rlplane.wire import RawColumn, int_array, ints, pack_message, unpack_message
from rlplane.testing.workloads import text_step, vlm_grpo, vlm_step
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.unit import read_cap

SECRET = b"unit-test-secret"


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(3, secret=SECRET, lease_s=30) as eng:
        yield {"controller": eng.server.endpoint, "secret": SECRET.decode(), "core": eng.core, "units": eng.units,
               "seal_key": eng.seal_key}


@pytest.fixture(params=["shm", "zmq"])
def client(engine, request):
    """A client on each data path: the units' slabs mapped (same host), or every byte over ZMQ."""
    info = {"controller": engine["controller"], "secret": engine["secret"]}
    c = Client(default_registry(), NativeTransport(info, timeout=30, data_path=request.param))
    assert set(c.transport.paths().values()) == {request.param}
    yield c
    c.close()


def test_vlm_batch_round_trips_bit_exactly_and_shards_read_their_rows(client):
    w = vlm_step(12, 256, seed=3)
    meta = client.put_samples("vlm", w.fields)
    got = client.read_columns(meta, list(w.fields))
    assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
    for idx in ([11, 0, 5], [3], list(range(1, 12, 2))):  # out of order, one row, every other row
        sub = meta.subset(idx)
        got = client.read_columns(sub, ["input_ids", "pixel_values"])
        want = w.select(idx)
        assert diff_fields(client.registry, {k: want.fields[k] for k in ("input_ids", "pixel_values")}, got,
                           want.lengths, sample_ids=sub.sample_ids) == []
    assert client.clear("vlm") == 12


def test_write_columns_replaces_and_partial_clears_report_what_they_keep(client, engine):
    fields = {"input_ids": torch.arange(32).reshape(4, 8), "input_lengths": torch.full((4,), 8)}
    meta = client.put_samples("wc", fields, sample_ids=list("abcd"))
    client.write_columns(meta, {"prev_logprobs": torch.ones(4, 8)})
    client.write_columns(meta.subset([1]), {"prev_logprobs": torch.full((1, 8), 5.0)})
    got = client.read_columns(meta, ["prev_logprobs"])["prev_logprobs"]
    assert got[:, 0].tolist() == [1.0, 5.0, 1.0, 1.0]
    client.clear("wc", ["a"])
    stats = client.transport.stats()
    assert stats["retained_bytes"] > 0  # a's rows stay in blocks that still hold b, c, d
    client.clear("wc")
    stats = client.transport.stats()
    assert stats["live_bytes"] == 0 and stats["retained_bytes"] == 0 and stats["blocks"] == 0
    assert "wc" not in client.partitions()


def test_missing_samples_and_fields_are_named(client):
    meta = client.put_samples("miss", {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 2])},
                              sample_ids=["x", "y"])
    with pytest.raises(E.MissingDataError) as err:
        client.read_columns(meta, ["prev_logprobs"])
    assert err.value.missing == {"x": ["prev_logprobs"], "y": ["prev_logprobs"]}
    with pytest.raises(E.MissingDataError) as err:
        client.write_columns(meta.subset([0]).__class__("miss", ["z"], [4]), {"prev_logprobs": torch.zeros(1, 4)})
    assert list(err.value.missing) == ["z"]
    with pytest.raises(E.DuplicateSampleError):
        client.put_samples("miss", {"input_ids": torch.ones(1, 4, dtype=torch.int64), "input_lengths": torch.tensor([4])},
                           sample_ids=["y"])
    client.clear("miss")


def test_a_failed_put_aborts_its_reservation(client, engine, monkeypatch):
    def boom(*args, **kwargs):
        raise E.TransportError("the network went away")

    monkeypatch.setattr(NativeTransport, "_land_blocks", boom)
    monkeypatch.setattr(native_transport, "ONE_MESSAGE_BYTES", 0)  # a put that writes to the units itself
    with pytest.raises(E.TransportError):
        client.put_samples("ab", {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4])},
                           sample_ids=["a", "b"])
    monkeypatch.undo()
    assert engine["core"].stats()["reservations"] == 0
    meta = client.put_samples("ab", {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4])},
                              sample_ids=["a", "b"])
    assert client.read_columns(meta, ["input_lengths"])["input_lengths"].tolist() == [4, 4]
    client.clear("ab")


def test_garbage_gets_an_error_reply_and_the_server_keeps_serving(engine):
    ep = engine["units"][0].endpoint
    ch = Channel(ep, "u0", secret=SECRET)
    with pytest.raises(E.WireFormatError):
        ch.call({"op": "nope"}, timeout=5)
    with pytest.raises(E.WireFormatError):
        ch.call({"op": "read", "f": [["x", b"abc", b""]]}, timeout=5)
    with pytest.raises(E.ForbiddenError, match="capability"):  # no locate handed this read a capability
        ch.call({"op": "read", "f": [["x", ints([10**9]), ints([0])]]}, timeout=5)
    cap = read_cap(engine["seal_key"], 10**9, "u0")
    with pytest.raises(E.ForbiddenError, match="capability"):  # nor a capability for another block
        ch.call({"op": "read", "f": [["x", ints([10**9]), ints([0])]], "caps": [[10**9 + 1, cap]]}, timeout=5)
    with pytest.raises(E.MissingDataError):  # a capability, but the block is not there
        ch.call({"op": "read", "f": [["x", ints([10**9]), ints([0])]], "caps": [[10**9, cap]]}, timeout=5)
    with pytest.raises(E.WireFormatError):
        bad = RawColumn("int64", np.arange(3), np.array([0, 5], np.int64))  # offsets past the values
        ch.call({"op": "write", "b": 10**12}, {"x": bad}, timeout=5)
    assert ch.call({"op": "ping"}, timeout=5)[0]["unit"] == "u0"
    ch.close()


def test_a_locate_hands_read_capabilities_only_for_the_blocks_read_over_zmq(engine):
    """A row read out of a mapped slab needs no capability; one read over ZMQ needs one per
    block, valid on its unit (a unit's read refuses a block without it)."""
    info = {"controller": engine["controller"], "secret": engine["secret"]}
    c = Client(default_registry(), NativeTransport(info, timeout=30, data_path="zmq"))
    try:
        meta = c.put_samples("caps", {"input_ids": torch.arange(8).reshape(2, 4), "input_lengths": torch.tensor([4, 2])})
        ctrl = c.transport._ctrl()
        ask = {"op": "locate", "p": "caps", "ids": meta.sample_ids, "fields": ["input_ids", "input_lengths"]}
        mapped = ctrl.call({**ask, "shm": list(range(len(engine["units"])))}, timeout=5)[0]
        assert mapped["caps"] == [] and all(len(e) == 6 for _, entries in mapped["units"] for e in entries)
        over_zmq = ctrl.call(ask, timeout=5)[0]
        for loc in (mapped, over_zmq):
            c.transport.unpin(loc["pin"])
        blocks = {u: {int(b) for e in entries for b in int_array(e[1])} for u, entries in over_zmq["units"]}
        caps = {u: dict(pairs) for u, pairs in over_zmq["caps"]}
        assert {u: set(c) for u, c in caps.items()} == blocks
        for u, per_block in caps.items():
            name = engine["core"].units[u][0]
            assert all(cap == read_cap(engine["seal_key"], b, name) for b, cap in per_block.items())
        assert c.read_columns(meta, ["input_ids"])["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 0, 0]]
    finally:
        c.clear("caps")
        c.close()


def locates(monkeypatch) -> list[int]:
    """The samples each locate of the reads that follow names, in order (one list, kept up to date)."""
    import rlplane.transports.native as native

    sizes: list[int] = []
    real_get = native.NativeTransport._get

    def counted(self, partition, ids, *args, **kwargs):
        sizes.append(len(ids))
        return real_get(self, partition, ids, *args, **kwargs)

    monkeypatch.setattr(native.NativeTransport, "_get", counted)
    return sizes


def pins_gone(engine, timeout: float = 10.0) -> None:
    """Every pin released (an unpin is one-way, a view's goes from a background thread)."""
    deadline = time.monotonic() + timeout
    while engine["core"].stats()["pins"]:
        assert time.monotonic() < deadline, "a read's pin outlived it"
        time.sleep(0.05)


def test_a_read_by_stage_in_pieces_keeps_the_images_of_samples_put_apart_from_text_only_ones(client, monkeypatch):
    """A read in pieces names one piece's samples lacking a field at a time: every image
    sample keeps its images however many pieces hold text-only samples."""
    import rlplane.transports.native as native
    from rlplane import PackedTensor, SampleMeta

    def put(n: int, images: bool, audio: bool = False) -> SampleMeta:
        f = {"input_ids": torch.arange(n * 4).reshape(n, 4), "input_lengths": torch.full((n,), 4)}
        if images:
            f["pixel_values"] = PackedTensor([torch.full((2, 8), float(i + 1)) for i in range(n)])
        if audio:
            f["input_features"] = PackedTensor([torch.full((3, 2), float(i + 1)) for i in range(n)])
        return client.put_samples("apart", f)

    def first(rows: list) -> list:
        return [r[0][0, 0].item() if r else None for r in rows]

    parts = [put(4, True), put(3, False), put(3, True), put(2, False), put(1, True)]
    meta = SampleMeta.concat(*parts)
    monkeypatch.setattr(native, "READ_CELLS", 3 * 3)  # 3 samples a piece for 3 fields
    try:
        rows = client.read_columns(meta, stage="logprob")["pixel_values"].rows
        want = [float(i + 1) if p in (0, 2, 4) else None for p, m in enumerate(parts) for i in range(len(m))]
        assert first(rows) == want
        # Two media fields lacked by different samples, each found in another piece.
        parts = [put(3, True, True), put(3, True), put(3, False, True)]
        monkeypatch.setattr(native, "READ_CELLS", 3 * 4)
        got = client.read_columns(SampleMeta.concat(*parts), stage="logprob")
        assert first(got["pixel_values"].rows) == [1.0, 2.0, 3.0] * 2 + [None] * 3
        assert first(got["input_features"].rows) == [1.0, 2.0, 3.0] + [None] * 3 + [1.0, 2.0, 3.0]
    finally:
        client.clear("apart")


def test_a_required_field_only_some_samples_of_a_stage_read_hold_is_missing_data_not_empty_rows(client):
    from rlplane import FieldSpec, PackedTensor, SampleMeta
    from rlplane.fields import Registry

    reg = Registry([spec for spec in default_registry().specs() if spec.name in ("input_ids", "input_lengths")]
                   + [FieldSpec("pixel_values", "media", "packed", {"vision"}, dtype="float32")])
    c = Client(reg, client.transport)
    ids = {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.full((2,), 4)}
    images = c.put_samples("required", {**ids, "pixel_values": PackedTensor([torch.ones(2, 3), None])})
    text = c.put_samples("required", ids)
    try:
        with pytest.raises(E.MissingDataError) as err:
            c.read_columns(SampleMeta.concat(images, text), stage="vision")
        assert set(err.value.missing) == set(text.sample_ids)
    finally:
        c.clear("required")


def test_a_read_bigger_than_one_locate_goes_in_pieces_and_reads_back_bit_exact(client, engine, monkeypatch):
    """Past READ_CELLS (samples x fields) a read is located and read in pieces, put
    together: every field bit-exact, shared images still shared, owned (writable) memory,
    every piece's pin released, and a sample missing from a later piece named."""
    import rlplane.transports.native as native

    w = vlm_grpo(12, 64, seed=5, group=4, sides=(2, 4))
    meta = client.put_samples("pieces", w.fields)
    whole = client.read_columns(meta, list(w.fields))
    names = ["input_ids", "pixel_values", "image_grid_thw"]
    located = locates(monkeypatch)
    monkeypatch.setattr(native, "READ_CELLS", 3 * 5)  # 5 samples a piece for 3 fields
    try:
        for copy in (True, False):
            located.clear()
            got = client.read_columns(meta, names, copy=copy)
            assert located == [5, 5, 2]
            assert diff_fields(client.registry, {k: w.fields[k] for k in names}, got, w.lengths,
                               sample_ids=meta.sample_ids) == []
            assert torch.equal(got["input_ids"], whole["input_ids"])
            rows = got["pixel_values"].rows  # a group's image: read once for its members in a piece
            pairs = [(i, j) for i in range(12) for j in range(i + 1, 12) if i // 4 == j // 4 and rows[i] is not None]
            assert pairs and all((rows[i][0].data_ptr() == rows[j][0].data_ptr()) == (i // 5 == j // 5)
                                 for i, j in pairs)
            got["input_ids"][0, 0] = -1  # owned memory: writable, the store unchanged
        got = client.read_columns(meta, list(w.fields), layout="jagged")
        assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        monkeypatch.setattr(native, "READ_CELLS", 1 << 30)  # the ids' bytes bound a piece too
        monkeypatch.setattr(native, "READ_ID_BYTES", sum(map(len, meta.sample_ids[:6])) - 1)
        located.clear()
        assert torch.equal(client.read_columns(meta, names)["input_ids"], whole["input_ids"]) and located == [5, 5, 2]
        pins_gone(engine)
        client.clear("pieces", [meta.sample_ids[9]])
        with pytest.raises(E.MissingDataError, match=meta.sample_ids[9]):
            client.read_columns(meta, names)
    finally:
        client.clear("pieces")


def test_a_read_whose_answer_is_too_big_for_its_tags_is_read_in_halves(client, engine, monkeypatch):
    """Samples with big tags: the locate's answer is over the message limit even under
    READ_CELLS; the read halves until each answer fits, every pin released, tags intact."""
    import rlplane.wire as wire

    n = 300
    fields = {"input_ids": torch.arange(n * 8).reshape(n, 8), "input_lengths": torch.full((n,), 8)}
    meta = client.put_samples("halves", fields, tags=[{"note": f"{i:04d}" + "x" * 96} for i in range(n)])
    tried = locates(monkeypatch)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 20_000)  # the 300 samples' answer: ~45 kB; 75's fit
    try:
        got = client.read_columns(meta, list(fields))
        assert tried == [300, 150, 75, 75, 150, 75, 75]
        assert torch.equal(got["input_ids"], fields["input_ids"])
        _, tags = client.transport.get("halves", meta.sample_ids, ["input_lengths"])
        assert [t["note"][:4] for t in tags] == [f"{i:04d}" for i in range(n)]
        pins_gone(engine)
    finally:
        monkeypatch.undo()
        client.clear("halves")


def test_a_read_a_unit_refuses_as_too_big_is_read_in_halves(engine, monkeypatch):
    """Over ZMQ, a unit answers at most MAX_READ_BYTES a read (PayloadTooLargeError): the
    read halves until each unit's share fits."""
    from rlplane_service.native import unit as unit_mod

    info = {"controller": engine["controller"], "secret": engine["secret"]}
    c = Client(default_registry(), NativeTransport(info, timeout=30, data_path="zmq"))
    x = torch.arange(16 * 256).reshape(16, 256)  # 2 kB a row
    try:
        meta = c.put_samples("unit-cap", {"input_ids": x, "input_lengths": torch.full((16,), 256)})
        monkeypatch.setattr(unit_mod, "MAX_READ_BYTES", 9 << 10)  # 4 rows of one put: 8 kB
        assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], x)
        monkeypatch.setattr(unit_mod, "MAX_READ_BYTES", 1 << 10)  # not even one row: refused, named
        with pytest.raises(E.PayloadTooLargeError, match="read fewer samples"):
            c.read_columns(meta, ["input_ids"])
    finally:
        monkeypatch.undo()
        c.clear("unit-cap")
        c.close()


def test_a_read_past_the_engines_message_limit_in_one_locate_comes_back_whole(engine):
    """64k samples x 5 fields: one locate's answer would be over the 16 MiB message limit
    (PayloadTooLargeError before reads went in pieces)."""
    info = {"controller": engine["controller"], "secret": engine["secret"]}
    c = Client(default_registry(), NativeTransport(info, timeout=60, data_path="shm"))
    fields = ["input_ids", "input_lengths", "token_mask", "generation_logprobs", "advantages"]
    w = text_step(64 << 10, 4, seed=9)
    try:
        meta = c.put_samples("wide", {f: w.fields[f] for f in fields})
        got = c.read_columns(meta, fields)
        assert all(torch.equal(got[f], w.fields[f]) for f in fields)
    finally:
        c.clear("wide")
        c.close()


def test_wire_refuses_what_is_not_a_message():
    for frames in ([], [b"\x00\x01"], [b"\x80"], pack_message({"op": "x"})[:1] + [b"extra"]):
        with pytest.raises(E.WireFormatError):
            unpack_message(frames)
    assert int_array(ints([1, 2])).tolist() == [1, 2]
    with pytest.raises(E.WireFormatError):
        int_array(b"123")


@pytest.mark.parametrize("frames", [[b"only"], [b"", b"a", b""], [b"h" * 200, memoryview(bytearray(70_000)), np.arange(9)]])
def test_frames_go_and_come_as_one_message_each(frames):
    """send_frames / recv_frames (the servers' and channels' own multipart loops): every
    message whole, in order, each frame's bytes as sent; nothing waiting is an Again."""
    from rlplane.channel import recv_frames, send_frames

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
        with pytest.raises(zmq.Again):
            recv_frames(a, zmq.NOBLOCK)
        for _ in range(2):
            send_frames(b, frames)
        for _ in range(2):
            assert a.poll(5000) and [bytes(f.buffer) for f in recv_frames(a)] == [bytes(memoryview(f)) for f in frames]
        assert not a.poll(50)
    finally:
        a.close(0)
        b.close(0)


def test_concurrent_puts_of_the_same_ids_in_one_process(engine):
    transports = [NativeTransport({"controller": engine["controller"], "secret": engine["secret"]}) for _ in range(6)]
    clients = [Client(default_registry(), t) for t in transports]
    wins, barrier = [], threading.Barrier(6)

    def put(k):
        barrier.wait(timeout=10)
        try:
            clients[k].put_samples("race", {"input_ids": torch.full((3, 4), k), "input_lengths": torch.full((3,), 4)},
                                   sample_ids=["a", "b", "c"])
            wins.append(k)
        except E.DuplicateSampleError:
            pass

    threads = [threading.Thread(target=put, args=(k,)) for k in range(6)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert len(wins) == 1
    meta = clients[0].put_samples.__self__.transport.describe("race")
    assert sorted(meta.sample_ids) == ["a", "b", "c"]
    clients[0].clear("race")
    for c in clients:
        c.close()


def test_reserve_refuses_blocks_that_do_not_cover_the_rows_or_reuse_an_id(engine):
    ch = Channel(engine["controller"], "controller", secret=SECRET)
    bad = [[[7, [0], 0, 2]], [[7, [0], 1, 3]], [[7, [9], 0, 3]], [[7, [0, 0], 0, 3]], [[0, [0], 0, 3]], "x"]
    for blocks in bad:
        with pytest.raises(E.WireFormatError):
            ch.call({"op": "reserve", "p": "b", "ids": ["a", "b", "c"], "create": True, "fields": ["x"], "blocks": blocks},
                    timeout=5)
    ok = {"op": "reserve", "p": "b", "ids": ["a", "b", "c"], "create": True, "fields": ["x"], "blocks": [[77, [0], 0, 3]]}
    res = ch.call(ok, timeout=5)[0]["res"]
    with pytest.raises(E.WireFormatError):  # block 77 is taken by the reservation above
        ch.call({**ok, "ids": ["d", "e", "f"]}, timeout=5)
    ch.call({"op": "abort", "res": res}, timeout=5)
    assert engine["core"].stats()["reservations"] == 0
    ch.close()


@pytest.mark.parametrize("order", ["shard", "reversed", "every other"])
def test_a_batch_split_over_units_reads_back_in_any_order(client, order):
    """38 MB: the put is split over the three units; reads of any subset and order come
    back row for row (shares received in place, or scattered run by run)."""
    n, s = 24, 200_000
    lens = torch.randint(s // 2, s + 1, (n,), generator=torch.Generator().manual_seed(1))
    fields = {"input_ids": torch.randint(0, 1 << 40, (n, s)), "input_lengths": lens}
    meta = client.put_samples(f"split-{order.replace(' ', '-')}", fields)
    # over zmq the put is split so its shares move in parallel; on shm it is one local block
    expect = 1 if client.transport.data_path == "shm" else 3
    assert len({b for b, *_ in client.transport._place(n, 38 << 20)}) == expect
    idx = {"shard": meta.shard(2, balance="seqlen")[1].sample_ids, "reversed": meta.sample_ids[::-1],
           "every other": meta.sample_ids[::2]}[order]
    sub = meta.subset([meta.sample_ids.index(i) for i in idx])
    got = client.read_columns(sub, ["input_ids"], layout="jagged")["input_ids"].unbind()
    for row, sid in zip(got, sub.sample_ids):
        i = meta.sample_ids.index(sid)
        assert torch.equal(row, fields["input_ids"][i, : lens[i]])
    client.clear(meta.partition)


@given(st.lists(st.integers(1, 5), max_size=40))
def test_locates_grouping_of_blocks_is_np_unique_with_a_shortcut_for_one_block(values):
    """A locate groups a field's rows by block (and by unit) with ``groups``; a read of one
    put names one block, which skips the sort: either way, what np.unique would say."""
    from rlplane_service.native.reads import groups

    a = np.array(values, dtype=np.int64)
    uniq, which = groups(a)
    want_u, want_w = np.unique(a, return_inverse=True)
    assert uniq.tolist() == want_u.tolist() and which.tolist() == want_w.reshape(-1).tolist()


def test_read_onto_a_device_lands_there_and_a_device_this_process_lacks_is_refused(client):
    """``read_columns(device=...)``: the host ("cpu") gives what a default read gives; a
    device this process cannot allocate on is an InvalidArgumentError naming it, before
    anything is read (the GPU itself: tests/gpu, ``make gpu-test``)."""
    w = vlm_step(6, 128, seed=11)
    meta = client.put_samples("onto-device", w.fields)
    got = client.read_columns(meta, list(w.fields), device="cpu")
    assert diff_fields(client.registry, w.fields, got, w.lengths) == []
    assert all(v.device.type == "cpu" for v in got.values() if isinstance(v, torch.Tensor))
    bad = ["no-such-device"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        with pytest.raises(E.InvalidArgumentError, match=f"device={device!r}"):
            client.read_columns(meta, ["input_ids"], device=device)
    assert client.clear("onto-device") == 6


def test_a_cleared_partitions_index_is_freed_with_its_consumption_state():
    """A partition per step, claimed, acked and cleared: nothing of it stays in the controller
    (its index held every field's rows; the ledger kept it until the partition was looked at again)."""
    import gc
    import weakref

    with LocalEngine(1, secret=SECRET, lease_s=30) as eng:
        c = Client(default_registry(), NativeTransport({"controller": eng.server.endpoint, "secret": SECRET.decode()},
                                                       timeout=30))
        try:
            refs = []
            for step in range(3):
                p = f"step-{step}"
                c.put_samples(p, {"input_ids": torch.arange(8).reshape(2, 4), "input_lengths": torch.full((2,), 4)})
                c.ack(c.claim(p, "train", batch_size=2, fields=["input_ids"], timeout=0), "train")
                refs.append(weakref.ref(eng.core._parts[p]))
                c.clear(p, ["x"] if step == 2 else None)  # (an unknown id clears nothing)
                if step == 2:
                    c.clear(p, c.transport.describe(p).sample_ids)  # the last samples, named: the partition goes too
            gc.collect()
            assert [r() for r in refs] == [None, None, None]
            assert c.consumption("step-0", "train")["acked"] == 0
        finally:
            c.close()


@pytest.mark.parametrize("tag", [{"k": {1: 2}}, {"k": float("inf")}, {"k": [[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]}])
def test_a_tag_the_engine_cannot_take_is_a_shape_error_at_once_not_a_timeout(engine, tag):
    """The engine refuses such a header before it reads the request's id, so it cannot
    answer: the client waited out its whole timeout (60 s in the service) for a
    TransportError. The client refuses it first, naming the sample, and stores nothing."""
    c = Client(default_registry(), NativeTransport({"controller": engine["controller"], "secret": engine["secret"]},
                                                   timeout=30))
    try:
        t0 = time.monotonic()
        with pytest.raises(E.ShapeError, match="tag 'k'") as err:
            c.put_samples("bad-tags", {"input_ids": torch.ones(2, 3, dtype=torch.int64), "input_lengths": torch.tensor([3, 2])},
                          sample_ids=["a", "b"], tags=[{}, tag])
        assert err.value.sample == "b" and time.monotonic() - t0 < 5
        assert "bad-tags" not in c.partitions()
    finally:
        c.close()
