"""Rows stored once: GRPO repeats every prompt's images for each of its G samples; the native
engine stores each such row once per put and reads it back once, as views of one buffer,
while every sample still reads exactly what was written (after clears, re-puts, a
snapshot, a journal replay and a controller restart). A forced digest collision is caught
by the byte compare; a forged commit cannot make one sample read another's bytes
(in one process plus storage units, no Ray)."""

import numpy as np
import pytest
import torch

from rlplane import Client, default_registry, dedup, snapshot
from rlplane import errors as E
from rlplane.column import Column
from rlplane.fields import FieldSpec, Registry
from rlplane.meta import SampleMeta
from rlplane.packed import PackedTensor
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_grpo, vlm_step
from rlplane.transports.memory import MemoryTransport
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.requests import shared_rows

SECRET = b"dedup-test-secret"
MEDIA = ["pixel_values", "image_grid_thw"]


def connect(eng: LocalEngine, path: str = "shm", registry: Registry | None = None) -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(registry or default_registry(), NativeTransport(info, timeout=30, data_path=path))


def stored_pixels(c: Client) -> tuple[int, int]:
    st = c.transport.stats()
    return st["live_bytes"], st["shared_bytes"]


def unique_bytes(w, names=MEDIA, wire=(2, 8)) -> int:
    """Bytes of the distinct media rows as stored (pixel values travel as bfloat16)."""
    total, seen = 0, set()
    for name, size in zip(names, wire):
        for i, row in enumerate(w.fields[name].rows):
            if row is not None and (name, i - i % 8) not in seen:
                seen.add((name, i - i % 8))
                total += sum(t.numel() for t in row) * size
    return total


def read_all(c: Client, meta, fields=None):
    return c.read_columns(meta, fields=fields or sorted(meta.fields))


# -- which rows are twins ------------------------------------------------------------------
def test_twins_are_found_by_identity_and_by_bytes_never_by_value_alone():
    a = torch.randn(6, 4)
    rows = [(a,), (a,), (a.clone(),), (torch.randn(6, 4),), (), (a.clone(), a.clone()), (a, a)]
    assert dedup.twins(rows).tolist() == [-1, 0, 0, -1, -1, -1, 5]
    z, nz = torch.zeros(4, 4), torch.zeros(4, 4)
    nz[1, 2] = -0.0  # equal as values, other bytes
    nan = torch.full((4, 4), float("nan"))
    assert dedup.twins([(z,), (nz,), (nan,), (nan.clone(),)]).tolist() == [-1, -1, -1, 2]
    assert dedup.twins([(a,), (a.reshape(4, 6).clone(),)]).tolist() == [-1, -1]  # same bytes, other shape


def test_a_forced_digest_collision_is_caught_by_the_byte_compare(monkeypatch):
    """Rows alike at both ends (so the cheap filter makes them candidates) and different in
    the middle: with every digest forced equal, the byte compare still keeps them apart."""
    base = torch.randn(3000, 8)
    other = base.clone()
    other[1500, 3] += 1.0
    rows = [(base,), (other,), (base.clone(),)]
    assert dedup.twins(rows).tolist() == [-1, -1, 0]
    # Many distinct rows of one kind: they are keyed by digest, and a candidate is compared
    # only with its digest's rows; every digest forced equal, the compare still decides.
    others = []
    for k in range(dedup.COMPARE_LEADERS + 2):
        o = base.clone()
        o[1000 + k, 0] += 1.0
        others.append((o,))
    many = [(base,), *others, (base.clone(),), (others[-1][0].clone(),)]
    want = [-1] * (len(others) + 1) + [0, len(others)]
    assert dedup.twins(many).tolist() == want
    calls = []
    monkeypatch.setattr(dedup, "digest", lambda row: calls.append(1) or (0, 0))
    assert dedup.twins(rows).tolist() == [-1, -1, 0] and not calls  # a few distinct rows: compared, not hashed
    assert dedup.twins(many).tolist() == want and calls
    w = PackedTensor([base, other, base.clone()])
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", {"pixel_values": w})
        got = c.read_columns(meta, fields=["pixel_values"])["pixel_values"]
        assert torch.equal(got[1][0], other.to(torch.bfloat16)) and torch.equal(got[0][0], base.to(torch.bfloat16))
        assert got[2][0].data_ptr() == got[0][0].data_ptr()



@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_rows_longer_than_a_compare_chunk_differ_anywhere_in_any_chunk(dtype):
    """Rows of several compare chunks (an odd byte count for uint8: not 8-byte words): one
    bit flipped in the last byte of a later chunk, or near the end, keeps two rows apart;
    equal rows are still twins."""
    n = 3 * (dedup._CHUNK // torch.tensor([], dtype=dtype).element_size()) + 1001
    base = torch.randint(0, 100, (n,)).to(dtype)
    rows = [(base,), (base.clone(),)]
    nbytes = n * base.element_size()
    for at in (2 * dedup._CHUNK - 1, nbytes - 1500):  # a chunk's last byte; near the end (not in the edge key)
        other = base.clone()
        other.view(torch.uint8)[at] ^= 1
        rows.append((other,))
    assert dedup.twins(rows).tolist() == [-1, 0, -1, -1]

# -- the store -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_groups_shared_images_are_stored_once_and_read_back_equal_for_every_member(path):
    w = vlm_grpo(batch=32, seqlen=128, seed=3)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng, path) as c:
        meta = c.put_samples("grpo", w.fields)
        live, shared = stored_pixels(c)
        text = sum(v.numel() * v.element_size() for k, v in w.fields.items() if isinstance(v, torch.Tensor)
                   and k != "input_lengths")
        assert live <= 1.05 * (unique_bytes(w) + text + 32 * 8), (live, unique_bytes(w))
        assert shared > 6 * unique_bytes(w)  # seven of eight copies were not stored
        assert c.stats()["sharing"] == {"written_bytes": live + shared, "stored_bytes": live, "shared_bytes": shared}
        got = read_all(c, meta)
        assert diff_fields(c.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        pv = got["pixel_values"]
        for i in range(32):
            lead = i - i % 8
            if pv[i] is not None:  # one buffer: a member's segments are views of its group's one copy
                assert [t.data_ptr() for t in pv[i]] == [t.data_ptr() for t in pv[lead]]
        shard = meta.subset([9, 10, 14])  # a DP rank's rows, not the group's first sample
        part = c.read_columns(shard, fields=MEDIA)
        want = w.select([9, 10, 14]).fields
        assert diff_fields(c.registry, {k: want[k] for k in MEDIA}, part, sample_ids=shard.sample_ids) == []
        # a plain transport read (no sharing asked) gets every row's bytes
        plain = c.transport.get("grpo", meta.sample_ids, ["pixel_values"])[0]["pixel_values"]
        once = c.transport.get("grpo", meta.sample_ids, ["pixel_values"], shared=True)[0]["pixel_values"]
        assert plain.same is None and once.same is not None and 6 * once.nbytes < plain.nbytes
        assert torch.equal(plain.values, once.expanded().values) and torch.equal(plain.offsets, once.expanded().offsets)


def test_clearing_a_groups_first_sample_and_re_putting_the_same_bytes_keeps_every_read_exact():
    w = vlm_grpo(batch=16, seqlen=64, seed=4)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", w.fields)
        blocks = c.transport.stats()["blocks"]
        c.clear("p", [meta.sample_ids[0], meta.sample_ids[8]])  # the owners of both groups' bytes
        rest = [i for i in range(16) if i not in (0, 8)]
        keep = meta.subset(rest)
        assert diff_fields(c.registry, w.select(rest).fields, read_all(c, keep), w.lengths[rest]) == []
        again = c.put_samples("p", w.fields)  # the same bytes, new ids: stored again, read equal
        assert diff_fields(c.registry, w.fields, read_all(c, again), w.lengths) == []
        assert diff_fields(c.registry, w.select(rest).fields, read_all(c, keep), w.lengths[rest]) == []
        c.clear("p", keep.sample_ids[:7])  # every sample of the first put's group 0 but none of group 1
        assert diff_fields(c.registry, w.select(rest[7:]).fields, read_all(c, keep.subset(list(range(7, 14)))),
                           w.lengths[rest[7:]]) == []
        c.clear("p")
        st = c.transport.stats()
        assert (st["blocks"], st["shared_bytes"], st["written_bytes"], st["live_bytes"]) == (0, 0, 0, 0)
        assert blocks >= 1


def test_a_field_can_turn_sharing_off_and_only_media_fields_may_turn_it_on():
    w = vlm_grpo(batch=8, seqlen=32, seed=5)
    reg = default_registry()
    spec = reg.get("pixel_values")
    off = Registry([FieldSpec.from_dict({**spec.to_dict(), "dedup": False}) if s.name == "pixel_values" else s
                    for s in reg.specs()])
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng, registry=off) as c:
        meta = c.put_samples("p", w.fields)
        cols, _ = c.transport.get("p", meta.sample_ids, ["pixel_values", "image_grid_thw"], shared=True)
        assert cols["pixel_values"].same is None and cols["image_grid_thw"].same is not None
        assert diff_fields(c.registry, w.fields, read_all(c, meta), w.lengths) == []
    with pytest.raises(E.RegistryError, match="only media fields"):
        Registry([FieldSpec("ids2", "token", "dense", dedup=True)])
    assert FieldSpec.from_dict({**spec.to_dict(), "dedup": False}).dedup is False
    plain = reg.without_sharing()  # what a bench that refills a store with one batch uses
    assert not any(s.shares_rows for s in plain.specs()) and plain.names() == reg.names()
    assert plain.get("input_ids").to_dict() == reg.get("input_ids").to_dict()


def test_a_snapshot_a_journal_replay_and_a_controller_restart_keep_rows_shared_and_exact(tmp_path):
    w = vlm_grpo(batch=16, seqlen=64, seed=6)
    jdir = tmp_path / "journal"
    with LocalEngine(2, secret=SECRET, lease_s=30, journal_dir=jdir) as eng, connect(eng) as c:
        m1 = c.put_samples("a", w.fields, durable=True)
        c.snapshot(str(tmp_path / "snap"))
        m2 = c.put_samples("b", w.fields, durable=True)  # after the cut: only in the journal
        want_shared = stored_pixels(c)[1]
        eng.kill_controller()
        eng.restart_controller()  # rebuilt from the units' commit logs
        assert stored_pixels(c)[1] == want_shared
        for meta in (m1, m2):
            assert diff_fields(c.registry, w.fields, read_all(c, meta), w.lengths) == []
    with LocalEngine(3, secret=SECRET, lease_s=30) as new, connect(new) as b:
        snapshot.restore(b.transport, tmp_path / "snap", journal=jdir)
        assert stored_pixels(b)[1] == want_shared
        for meta in (m1, m2):
            assert diff_fields(b.registry, w.fields, read_all(b, meta), w.lengths) == []


# -- what a writer may say -----------------------------------------------------------------
def test_a_commit_cannot_point_a_row_at_bytes_of_another_length_digest_or_a_later_row():
    nb = {"f": np.array([8, 8, 4], np.int64)}
    sums = {"f": np.array([1, 1, 2], np.uint64)}
    ok = shared_rows({"f": np.array([-1, 0, -1], "<i8").tobytes()}, ["f"], 3, nb, sums)
    assert ok["f"].tolist() == [-1, 0, -1]
    for bad, why in (([-1, -1, 0], "another length"), ([-1, 2, -1], "earlier row"), ([0, -1, -1], "earlier row")):
        with pytest.raises(E.WireFormatError, match=why):
            shared_rows({"f": np.array(bad, "<i8").tobytes()}, ["f"], 3, nb, sums)
    with pytest.raises(E.WireFormatError, match="another digest"):
        shared_rows({"f": np.array([-1, 0, -1], "<i8").tobytes()}, ["f"], 3, nb,
                    {"f": np.array([1, 3, 2], np.uint64)})
    with pytest.raises(E.WireFormatError, match="reserved fields"):
        shared_rows({"g": b""}, ["f"], 3, nb, sums)


def test_columns_put_together_keep_their_digests_geometry_and_which_row_each_shared_row_repeats():
    from rlplane.geometry import Geometry

    a = Column(torch.arange(3.0), torch.tensor([0, 3, 3]), sums=np.array([5, 6], np.uint64),
               geom=Geometry.token(np.array([3, 3]), []), same=np.array([-1, 0]))
    b = Column(torch.tensor([7.0, 8.0]), torch.tensor([0, 1, 2]), sums=np.array([1, 2], np.uint64),
               geom=Geometry.token(np.array([1, 1]), []))
    both = Column.concat([a, b, a])
    assert both.same.tolist() == [-1, 0, -1, -1, -1, 4]  # the third part's shared row names its own first row
    assert [both.row(i).tolist() for i in range(6)] == [[0, 1, 2], [0, 1, 2], [7], [8], [0, 1, 2], [0, 1, 2]]
    assert both.sums.tolist() == [5, 6, 1, 2, 5, 6] and both.geom.tolist() == [[3], [3], [1], [1], [3], [3]]
    assert Column.concat([b, Column(torch.tensor([9.0]), torch.tensor([0, 1]))]).sums is None
    with pytest.raises(E.WireFormatError, match="dtypes"):
        Column.concat([b, Column(torch.tensor([9]), torch.tensor([0, 1]))])


def test_a_transport_that_stores_every_row_refuses_a_shared_column_and_gets_plain_ones():
    col = Column(torch.arange(3.0), torch.tensor([0, 3, 3]), same=np.array([-1, 0]))
    assert col.expanded().values.tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0] and col.row(1).tolist() == [0.0, 1.0, 2.0]
    assert col.take(np.array([1])).same.tolist() == [-1] and col.take(np.array([1])).values.tolist() == [0, 1, 2]
    with pytest.raises(E.WireFormatError, match="stored empty"):
        Column(torch.arange(3.0), torch.tensor([0, 2, 3]), same=np.array([-1, 0]))
    mem = MemoryTransport()
    with pytest.raises(E.WireFormatError, match="expanded"):
        mem.put("p", ["a", "b"], {"pixel_values": col}, [{}, {}], create=True)
    c = Client(default_registry(), mem)
    w = vlm_grpo(batch=8, seqlen=32, seed=7)
    meta = c.put_samples("p", w.fields)  # no sharing asked of a transport that has none
    assert diff_fields(c.registry, w.fields, read_all(c, meta), w.lengths) == []


def test_a_batch_without_repeats_is_stored_as_before():
    w = vlm_step(batch=8, seqlen=32, seed=8)
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", w.fields)
        assert stored_pixels(c)[1] == 0
        cols, _ = c.transport.get("p", meta.sample_ids, MEDIA, shared=True)
        assert all(col.same is None for col in cols.values())


def test_clearing_the_sample_that_holds_a_groups_bytes_hands_them_to_the_next_and_stats_stay_exact():
    """Live bytes count what is still read: once the holder of a group's images goes, the
    next member holds them; the stats equal those of the remaining samples stored afresh,
    and go back to zero with the last of them."""
    w = vlm_grpo(batch=16, seqlen=64, seed=6)
    rest = [i for i in range(16) if i not in (0, 8)]
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", w.fields)
        c.clear("p", [meta.sample_ids[0], meta.sample_ids[8]])  # the holders of both groups' images
        after = c.transport.stats()
        keep = meta.subset(rest)
        assert diff_fields(c.registry, w.select(rest).fields, read_all(c, keep), w.lengths[rest]) == []
        fresh = c.put_samples("q", w.select(rest).fields)
        both = c.transport.stats()
        assert both["live_bytes"] - after["live_bytes"] == after["live_bytes"]
        assert both["written_bytes"] - after["written_bytes"] == after["written_bytes"]
        assert both["shared_bytes"] - after["shared_bytes"] == after["shared_bytes"] > 0
        c.clear("q", fresh.sample_ids)
        c.clear("p", keep.sample_ids[:3])  # the next holder goes too: the one after it takes over
        assert diff_fields(c.registry, w.select(rest[3:]).fields, read_all(c, keep.subset(list(range(3, 14)))),
                           w.lengths[rest[3:]]) == []
        c.clear("p")
        st = c.transport.stats()
        assert (st["blocks"], st["shared_bytes"], st["written_bytes"], st["live_bytes"]) == (0, 0, 0, 0)


def test_empty_rows_beside_a_shared_one_never_take_over_its_bytes_when_its_holder_goes():
    """An empty segment repeated by a group (a text-only group's image) lies at the offset
    of the next stored row: clearing the holder of that row's bytes handed them to an empty
    twin, the stats lost the bytes still stored, and a put of the same image stored it again."""
    from rlplane.dedup import row_keys

    x, z = torch.randn(40, 1176, generator=torch.Generator().manual_seed(1)), torch.zeros(0, 1176)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        def put(prefix: str, rows: list):
            n = len(rows)
            return c.put_samples("p", {"input_ids": torch.ones(n, 4, dtype=torch.int64),
                                       "input_lengths": torch.full((n,), 4), "pixel_values": PackedTensor(rows)},
                                 sample_ids=[f"{prefix}{i}" for i in range(n)])

        meta = put("a", [[z], [z], [x], [x]])
        c.clear("p", ["a2"])  # the holder of x's bytes; a3 still reads them
        assert torch.equal(read_all(c, meta.subset([3]), ["pixel_values"])["pixel_values"].rows[0][0], x.bfloat16())
        key = row_keys([(x,)], np.array([-1]), torch.bfloat16)
        assert c.transport.held_rows("p", "pixel_values", key)[0][3] == x.numel() * 2  # found under its key
        before = c.stats()["sharing"]
        assert before["stored_bytes"] > x.numel() * 2 and before["shared_bytes"] == 0  # (what a3 and a0..a1 hold)
        put("b", [[x]])  # the same image again: stored once still
        after = c.stats()["sharing"]
        assert after["shared_bytes"] == x.numel() * 2 and after["stored_bytes"] < before["stored_bytes"] + 100


@pytest.mark.parametrize("gone", [[1], [0, 1], [0, 0, 3]], ids=["a-sharer", "the-holder-and-a-sharer", "an-id-twice"])
def test_stats_stay_exact_whichever_members_of_a_group_go(gone):
    w = vlm_grpo(batch=8, seqlen=64, seed=4)  # one group of 8, two images each
    rest = [i for i in range(8) if i not in gone]
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", w.fields)
        assert c.transport.stats()["shared_bytes"] > 0
        assert c.clear("p", [meta.sample_ids[i] for i in gone]) == len(set(gone))
        after = c.transport.stats()
        assert diff_fields(c.registry, w.select(rest).fields, read_all(c, meta.subset(rest)), w.lengths[rest]) == []
        c.put_samples("q", w.select(rest).fields)
        both = c.transport.stats()
        for k in ("live_bytes", "written_bytes", "shared_bytes"):
            assert both[k] - after[k] == after[k], k
        c.clear("p")
        c.clear("q")
        st = c.transport.stats()
        assert (st["blocks"], st["shared_bytes"], st["written_bytes"], st["live_bytes"]) == (0, 0, 0, 0)


# -- across puts ---------------------------------------------------------------------------
def put_apart(c: Client, p: str, w, members) -> list:
    """One put per sample (a rollout worker writing each group member when it is done)."""
    return [c.put_samples(p, w.select([i]).fields) for i in members]


def read_each(c: Client, w, metas, members) -> None:
    for i, m in zip(members, metas):
        assert diff_fields(c.registry, w.select([i]).fields, read_all(c, m), w.lengths[[i]]) == [], i


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_groups_images_put_one_member_at_a_time_are_stored_once_and_read_back_exact(path):
    w = vlm_grpo(batch=16, seqlen=64, seed=11)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng, path) as c:
        c.put_samples("one-put", w.fields)  # the same batch in one put: what sharing within a put stores
        once = stored_pixels(c)
        c.clear("one-put")
        metas = put_apart(c, "p", w, range(16))
        live, shared = stored_pixels(c)
        # sixteen puts store what one put of them stores, but for rows too small to look for
        # (image_grid_thw's 24 bytes a row, dedup.MIN_KEYED_BYTES)
        assert 0 <= live - once[0] == once[1] - shared <= 16 * 24
        read_each(c, w, metas, range(16))
        pv = c.read_columns(SampleMeta.concat(metas[8:]), fields=["pixel_values"])["pixel_values"]
        assert all([t.data_ptr() for t in pv[i]] == [t.data_ptr() for t in pv[0]] for i in range(8))  # one buffer
        c.clear("p", metas[8].sample_ids)  # the sample that stored group 1's images
        rest = [i for i in range(16) if i != 8]
        read_each(c, w, [metas[i] for i in rest], rest)
        again = put_apart(c, "p", w, [8])  # found under the next member, which holds them now
        assert stored_pixels(c) == (live, shared)
        read_each(c, w, again + [metas[i] for i in rest], [8, *rest])
        c.clear("p")
        st = c.transport.stats()
        assert (st["blocks"], st["shared_bytes"], st["written_bytes"], st["live_bytes"]) == (0, 0, 0, 0)


def test_rows_are_found_only_in_their_own_partition_and_field():
    w = vlm_grpo(batch=8, seqlen=32, seed=12)
    assert w.fields["pixel_values"]._rows[0]
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        put_apart(c, "a", w, [0])
        alone = stored_pixels(c)
        metas = put_apart(c, "b", w, [1])  # the same images in another partition: stored again
        assert stored_pixels(c)[0] > alone[0] and stored_pixels(c)[1] == 0
        read_each(c, w, metas, [1])


def test_a_holder_cleared_between_the_lookup_and_the_commit_leaves_the_put_whole():
    """The put found group 0's images stored; before it commits they are cleared: it
    writes them itself (no error), or, when another member still holds them, shares them."""
    w = vlm_grpo(batch=8, seqlen=32, seed=17)  # one group with images
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        first = put_apart(c, "p", w, [0])
        found = c.transport.held_rows
        calls = []

        def then_clear(p, field, keys, ids):
            refs = found(p, field, keys)
            if field == "pixel_values" and not calls:
                calls.append(int((refs[:, 0] >= 0).sum()))
                c.clear(p, ids)
            return refs

        c.transport.held_rows = lambda p, f, k: then_clear(p, f, k, first[0].sample_ids)
        late = put_apart(c, "p", w, [1])
        assert calls == [1]  # it was found, then cleared
        read_each(c, w, late, [1])
        assert stored_pixels(c)[1] == 0  # stored by the put itself
        calls.clear()
        more = put_apart(c, "p", w, [2])  # shares member 1's rows...
        assert stored_pixels(c)[1] > 0
        c.transport.held_rows = lambda p, f, k: then_clear(p, f, k, late[0].sample_ids)
        last = put_apart(c, "p", w, [3])  # ...and member 1 goes meanwhile: member 2 holds them
        assert calls == [1]
        read_each(c, w, more + last, [2, 3])
        assert stored_pixels(c)[1] > 0


def test_a_commit_cannot_point_a_row_at_bytes_no_row_of_its_partition_holds():
    """Refs a lookup did not give (another length, another partition's bytes) point at
    nothing: the put stores its own rows and every read stays exact."""
    w = vlm_grpo(batch=8, seqlen=32, seed=18)  # one group with images
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        other = put_apart(c, "other", w, [0])
        mine = put_apart(c, "p", w, [1])
        before = c.transport.stats()["shared_bytes"]
        found = c.transport.held_rows
        c.transport.held_rows = lambda p, f, k: _forged(found(p, f, k), nbytes=-8)
        late = put_apart(c, "p", w, [2])
        c.transport.held_rows = lambda p, f, k: found("other", f, k)
        late += put_apart(c, "p", w, [3])
        read_each(c, w, late + mine + other, [2, 3, 1, 0])
        assert c.transport.stats()["shared_bytes"] == before == 0


def test_held_refs_refuse_another_length_digest_or_a_row_that_also_repeats_one():
    from rlplane_service.native.held import held_refs
    from rlplane_service.native.index import Partition

    part = Partition()
    keys = np.array([[1, 2], [1, 2]], np.uint64)
    refs = np.array([[-1] * 5, [77, 0, 0, 16, 5]], np.int64)
    for nb, sums, same, why in (([16, 8], None, None, "another length"),
                                ([16, 16], np.array([5, 6], np.uint64), None, "another digest"),
                                ([16, 16], None, np.array([-1, 0]), "cannot also repeat")):
        with pytest.raises(E.WireFormatError, match=why):
            held_refs(part, "f", refs, keys, np.array(nb), sums, same)
    with pytest.raises(E.LeaseError) as err:  # nothing in the partition holds those bytes
        held_refs(part, "f", refs, keys, np.array([16, 16]), None, None)
    assert err.value.component == E.HELD_GONE


def _forged(refs: np.ndarray, *, nbytes: int) -> np.ndarray:
    refs = refs.copy()
    hit = refs[:, 0] >= 0
    refs[hit, 3] += nbytes
    return refs


def test_rows_shared_across_puts_survive_a_controller_restart_and_are_found_after_it():
    w = vlm_grpo(batch=16, seqlen=64, seed=15)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        metas = put_apart(c, "p", w, range(0, 16, 2))
        want = stored_pixels(c)
        eng.kill_controller()
        eng.restart_controller()  # rebuilt from the units' commit logs, keys included
        assert stored_pixels(c) == want
        read_each(c, w, metas, range(0, 16, 2))
        more = put_apart(c, "p", w, range(1, 16, 2))
        live, shared = stored_pixels(c)
        assert live - want[0] < 0.1 * (shared - want[1])  # the odd members' images were found, not stored
        read_each(c, w, metas + more, [*range(0, 16, 2), *range(1, 16, 2)])


def test_a_store_with_a_journal_shares_rows_only_within_a_put(tmp_path):
    w = vlm_grpo(batch=8, seqlen=32, seed=19)  # one group with images
    with LocalEngine(1, secret=SECRET, lease_s=30, journal_dir=tmp_path / "j") as eng, connect(eng) as c:
        asked, ask = [], c.transport._ask
        c.transport._ask = lambda header, timeout=None: asked.append(header["op"]) or ask(header, timeout)
        metas = put_apart(c, "p", w, range(4))
        assert stored_pixels(c)[1] == 0  # each journal record replays on its own
        assert "held" not in asked and "commit" in asked  # the client knows from hello: it does not ask
        keys = dedup.row_keys(w.fields["pixel_values"]._rows[:1], np.array([-1]), torch.bfloat16)
        reply = ask({"op": "held", "p": "p", "f": "pixel_values", "k": keys.astype("<u8").tobytes()})
        assert (np.frombuffer(reply["x"], "<i8").reshape(-1, 5)[:, 0] == -1).all()  # and the controller finds none
        read_each(c, w, metas, range(4))


def test_a_row_alike_at_every_sampled_byte_is_confirmed_on_all_of_them_and_stored_apart():
    """Keys sample a row's bytes; a row found under its key is stored once only if its
    every byte's digest is the stored row's too."""
    a = torch.rand(64, 1176)
    b = a.clone()
    nbytes = a.numel() * 4
    step = (nbytes - 2 * dedup._EDGE) // (dedup._WINDOWS + 1)
    at = (dedup._EDGE + step + 2 * dedup._WINDOW) // 4  # between two sampled windows
    b.view(-1)[at] += 1.0
    same = np.array([-1, -1])
    keys = dedup.row_keys([(a,), (b,)], same, torch.bfloat16)
    assert (keys[0] == keys[1]).all() and keys[0].any()  # the key cannot tell them apart
    ids = torch.randint(0, 100, (1, 8))
    one = {"input_ids": ids, "input_lengths": torch.tensor([8]), "image_grid_thw": PackedTensor([[torch.tensor([1, 8, 8])]])}
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        m1 = c.put_samples("p", {**one, "pixel_values": PackedTensor([[a]])})
        m2 = c.put_samples("p", {**one, "pixel_values": PackedTensor([[b]])})
        m3 = c.put_samples("p", {**one, "pixel_values": PackedTensor([[a.clone()]])})  # truly the same: shared
        got = [c.read_columns(m, ["pixel_values"])["pixel_values"][0][0] for m in (m1, m2, m3)]
        assert torch.equal(got[0], a.to(torch.bfloat16)) and torch.equal(got[1], b.to(torch.bfloat16))
        assert torch.equal(got[2], a.to(torch.bfloat16)) and not torch.equal(got[0], got[1])
        pv_bytes = a.numel() * 2
        assert c.transport.stats()["shared_bytes"] == pv_bytes  # m3's pixels (rows of 24 bytes are not looked for)
