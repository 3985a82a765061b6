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
