"""A read checks the rows it copies out of a mapped slab as it copies them: each row's
digest of the bytes as copied against the one its writer recorded, in the same pass
(``integrity.copied_sums``), so the decode does not digest them again."""

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane import integrity
from rlplane.copies import copy_ranges
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from rlplane.transports import native as native_transport
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"read-checks-secret"


def layouts():
    """(name, src_at, dst_at, lens): rows in order and big (a row several steps long), many
    small ones in order, shuffled small ones (many runs), gaps between rows, empty rows."""
    rng = np.random.default_rng(3)
    big = np.array([5 << 20, 3 << 20, 1, 7 << 20, 0], np.int64)
    small = rng.integers(0, 300, 5000).astype(np.int64)
    out = []
    for name, lens in (("big", big), ("small", small)):
        ends = np.concatenate([[0], np.cumsum(lens)])
        out.append((f"{name} in order", ends[:-1] + 64, ends[:-1], lens))
        order = rng.permutation(lens.size)  # the source's rows in another order, back to back in the destination
        out.append((f"{name} shuffled", (ends[:-1] + 64)[order], np.cumsum(lens[order]) - lens[order], lens[order]))
        gaps = ends[:-1] + np.arange(lens.size) * 8
        out.append((f"{name} with gaps", gaps + 64, gaps, lens))
    return out


@pytest.mark.parametrize("name,src_at,dst_at,lens", layouts(), ids=[x[0] for x in layouts()])
def test_copied_sums_copies_as_copy_ranges_does_and_digests_each_row_as_copied(name, src_at, dst_at, lens):
    size = int(max((src_at + lens).max(), (dst_at + lens).max())) + 64
    src = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
    want, got = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    copy_ranges(want, dst_at, src, src_at, lens)
    sums = integrity.copied_sums(got, dst_at, src, src_at, lens)
    assert np.array_equal(got, want)
    raw = memoryview(want)
    assert sums.tolist() == [integrity.digest(raw[a:a + m]) for a, m in zip(dst_at.tolist(), lens.tolist())]


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        yield eng


def connect(engine, path):
    info = {"controller": engine.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30, data_path=path))


def reads_back(c, w, meta, names):
    """How ``names`` of the samples of ``meta`` read back differ from workload ``w``'s ([]: bit-exact)."""
    return diff_fields(c.registry, {k: w.fields[k] for k in names}, c.read_columns(meta, names), w.lengths,
                       sample_ids=meta.sample_ids)


def damage(engine, client, partition, sample, field):
    """Flip a bit of ``sample``'s row of ``field`` where a unit stores it; the unit's core."""
    loc = client.transport._ctrl().call({"op": "locate", "p": partition, "ids": [sample], "fields": [field]},
                                        timeout=10)[0]
    unit, entries = loc["units"][0]
    bid, row = (int.from_bytes(entries[0][k][:8], "little") for k in (1, 2))
    assert engine.cores[unit].damage(bid, field, row)
    return lambda: engine.cores[unit].damage(bid, field, row)  # flips it back


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_rows_copied_out_of_a_slab_are_checked_there_and_a_damaged_one_is_named(engine, path):
    c = connect(engine, path)
    w = vlm_step(6, 128, seed=9)
    meta = c.put_samples(f"checked-{path}", w.fields)
    names = ["input_ids", "pixel_values", "image_grid_thw"]
    try:
        verified: set[str] = set()
        c.transport.get(meta.partition, meta.sample_ids, names, verified=verified)
        assert verified == (set(names) if path == "shm" else set())  # over ZMQ the decode digests them
        assert reads_back(c, w, meta, names) == []
        k = max(i for i, r in enumerate(w.fields["pixel_values"].rows) if r is not None)  # a sample with images
        undo = damage(engine, c, meta.partition, meta.sample_ids[k], "pixel_values")
        named = f"sample '{meta.sample_ids[k]}', field 'pixel_values'"
        if path == "shm":  # the transport's own check finds it, as it copies
            with pytest.raises(E.IntegrityError, match=named):
                c.transport.get(meta.partition, meta.sample_ids, names, verified=set())
        for read in (lambda: c.read_columns(meta, names), lambda: c.read_columns(meta, names, layout="jagged")):
            with pytest.raises(E.IntegrityError, match=named):
                read()
        rest = [i for i in range(6) if i != k]
        assert reads_back(c, w.select(rest), meta.subset(rest), names) == []  # the rest reads
        undo()
        assert reads_back(c, w, meta, names) == []
    finally:
        c.clear(meta.partition)
        c.close()


def test_a_read_in_pieces_reports_nothing_checked_and_the_decode_finds_a_damaged_row(engine, monkeypatch):
    """The pieces are put together in a copy of their own: the decode digests that."""
    c = connect(engine, "shm")
    w = vlm_step(6, 128, seed=10)
    meta = c.put_samples("checked-pieces", w.fields)
    monkeypatch.setattr(native_transport, "READ_CELLS", 2 * 3)  # 3 samples a piece for 2 fields
    try:
        verified: set[str] = set()
        c.transport.get(meta.partition, meta.sample_ids, ["input_ids", "pixel_values"], verified=verified)
        assert verified == set()
        k = min(i for i, r in enumerate(w.fields["pixel_values"].rows) if r is not None)  # a sample with images
        damage(engine, c, meta.partition, meta.sample_ids[k], "pixel_values")
        with pytest.raises(E.IntegrityError, match=f"sample '{meta.sample_ids[k]}', field 'pixel_values'"):
            c.read_columns(meta, ["input_ids", "pixel_values"])
    finally:
        c.clear(meta.partition)
        c.close()


@pytest.mark.parametrize("sides", [(2, 4), None], ids=["small: one buffer", "big: a buffer per field"])
def test_every_field_of_a_small_read_moves_in_one_pass_into_a_buffer_of_its_own_slices(engine, monkeypatch, sides):
    """A read smaller than the read pool's buffers copies every field's rows out of a slab
    in one pass into one buffer: each field a slice of its own (aligned, no overlap), checked
    and bit-exact as a bigger read's, which copies field by field into pooled buffers."""
    c = connect(engine, "shm")
    w = vlm_step(8, 256, seed=11, **({"sides": sides} if sides else {}))
    meta = c.put_samples(f"one-pass-{sides is None}", w.fields)
    names = sorted(meta.fields)
    passes: list[int] = []  # fields copied by each pass out of a slab
    real = NativeTransport._copy_out
    monkeypatch.setattr(NativeTransport, "_copy_out", staticmethod(lambda *a: passes.append(len(a[1])) or real(*a)))
    try:
        verified: set[str] = set()
        cols, _ = c.transport.get(meta.partition, meta.sample_ids, names, verified=verified)
        small = sum(col.nbytes for col in cols.values()) < c.transport.pool.min_bytes
        assert small == (sides is not None)
        assert passes == ([len(names)] if small else [1] * len(names))
        assert verified == set(names)
        spans = sorted((col.values.data_ptr(), col.values.data_ptr() + col.nbytes) for col in cols.values())
        assert all(z <= a for (_, z), (a, _) in zip(spans, spans[1:])), "two fields' rows overlap"
        if small:
            assert len({a % 64 for a, _ in spans}) == 1, "a field does not start on its own cache line"
        assert reads_back(c, w, meta, names) == []
    finally:
        c.clear(meta.partition)
        c.close()


def test_a_location_naming_rows_past_the_request_is_refused_before_anything_is_copied(engine, monkeypatch):
    c = connect(engine, "shm")
    w = vlm_step(4, 64, seed=12)
    meta = c.put_samples("hostile-locate", w.fields)
    real = NativeTransport._ask

    def lying(self, header, *a, **k):  # the controller answers a position past the 4 samples asked
        out = real(self, header, *a, **k)
        if header.get("op") == "locate":
            for _, entries in out["units"]:
                entries[0][3] = (np.frombuffer(entries[0][3], "<i8") + 4).astype("<i8").tobytes()
        return out

    monkeypatch.setattr(NativeTransport, "_ask", lying)
    try:
        with pytest.raises(E.WireFormatError, match="located rows it was not asked for"):
            c.read_columns(meta, ["input_ids", "input_lengths"])
    finally:
        monkeypatch.setattr(NativeTransport, "_ask", real)
        assert reads_back(c, w, meta, ["input_ids"]) == []
        c.clear(meta.partition)
        c.close()


@pytest.mark.parametrize("address", [2**63 - 4, 2**62, -8, 60])
def test_a_controller_locating_rows_beyond_the_slab_is_refused_before_a_byte_is_copied(address):
    """An address whose sum with the row's length wraps around int64 is refused like any
    other out-of-slab address (a WireFormatError naming the field), never copied from."""
    from types import SimpleNamespace

    slab = np.arange(64, dtype=np.uint8)
    view = SimpleNamespace(nbytes=slab.size, u8=slab, prefault=lambda lo, hi: None)
    entry = ["input_ids", None, None, np.array([0], "<i8").tobytes(), np.array([address], "<i8").tobytes()]
    buf = np.zeros(8, np.uint8)
    with pytest.raises(E.WireFormatError) as err:
        NativeTransport._copy_out(view, [entry], buf, {"input_ids": 0}, {"input_ids": np.array([0, 8])},
                                  {"input_ids": np.array([8])}, {"input_ids": np.zeros(1, np.uint64)})
    assert err.value.field == "input_ids" and not buf.any()
