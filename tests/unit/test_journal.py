"""The write-ahead journal: with RLPLANE_JOURNAL_DIR every commit, clear and ack is appended
on the storage units; after every engine process is SIGKILLed, a new store (another
number of units) restored from the last snapshot plus the journal holds every durable
put and ack bit for bit. A torn last record is skipped and reported; damage elsewhere is
refused naming the file, nothing loaded (in one process plus unit processes, no Ray)."""

import os
import time
from pathlib import Path

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane import journal as J
from rlplane import snapshot
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"journal-test-secret"


def engine(journal: Path | None = None, units: int = 2, **kw) -> LocalEngine:
    return LocalEngine(units, secret=SECRET, lease_s=30, slab_bytes=128 << 20, journal_dir=journal, **kw)


def connect(eng: LocalEngine) -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30))


def wire(client: Client, p: str, ids: list, fields: list) -> dict:
    """What a reader gets at the wire: per field values, offsets, digests, geometry; the tags."""
    cols, tags = client.transport.get(p, ids, fields)
    return {"cols": {f: (c.values.view(torch.uint8).clone(), c.offsets.clone(), c.sums.tolist(), c.geom.tolist())
                     for f, c in cols.items()}, "tags": [dict(t) for t in tags]}


def same(a: dict, b: dict) -> bool:
    if a["tags"] != b["tags"] or a["cols"].keys() != b["cols"].keys():
        return False
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]
               for x, y in ((a["cols"][f], b["cols"][f]) for f in a["cols"]))


def segments(root: Path) -> list[Path]:
    return list(J.segments(root))


def test_a_durable_put_needs_a_journal_and_stores_nothing_without_one():
    with engine() as eng, connect(eng) as c:
        with pytest.raises(E.InvalidArgumentError, match="RLPLANE_JOURNAL_DIR"):
            c.put_samples("p", text_step(4, 8, seed=1).fields, durable=True)
        assert c.partitions() == []
        c.put_samples("p", text_step(4, 8, seed=1).fields)  # a plain put still works
        assert c.transport.describe("p").sample_ids and c.transport.journal()["journal"] is False


def test_after_sigkill_of_every_engine_process_snapshot_plus_journal_bring_back_every_durable_put_and_ack(tmp_path):
    """Units in processes of their own, SIGKILLed after durable puts (nothing flushed them
    but the durable fsync); the controller's process state is dropped too. A new store
    of three units restored from the snapshot plus the journal holds everything."""
    jdir, snap = tmp_path / "journal", tmp_path / "snap"
    eng = engine(jdir, processes=True, journal_flush_ms=10_000)  # no timed flush: only durable fsyncs count
    try:
        with connect(eng) as a:
            vlm = vlm_step(8, 96, seed=5)
            mv = a.put_samples("vlm", vlm.fields, durable=True)
            text = text_step(40, 32, seed=6)
            mt = a.put_samples("text", text.fields, tags=[{"group": i // 4} for i in range(40)], durable=True)
            acked = a.claim("text", "train", batch_size=10, fields=["input_ids"], timeout=0)
            a.ack(acked, "train")
            a.snapshot(str(snap))  # the cut: everything above is in the snapshot
            late = text_step(16, 32, seed=7)
            ml = a.put_samples("late", late.fields, tags=[{"k": i} for i in range(16)], durable=True)
            a.write_columns(mv.subset([2, 5]), {"prev_logprobs": torch.randn(2, 96)})  # an extension after the cut
            a.clear("text", mt.sample_ids[:3])
            more = a.claim("text", "train", batch_size=12, fields=["input_ids"], timeout=0)
            a.ack(more, "train")
            a.put_samples("tail", late.fields, durable=True)  # the last durable put: its fsync covers the ones before
            want = {"vlm": wire(a, "vlm", mv.sample_ids, sorted(vlm.fields)),
                    "prev": wire(a, "vlm", mv.subset([2, 5]).sample_ids, ["prev_logprobs"]),
                    "late": wire(a, "late", ml.sample_ids, sorted(late.fields)),
                    "text": wire(a, "text", a.transport.describe("text").sample_ids, sorted(text.fields))}
            order = {p: a.transport.describe(p).sample_ids for p in ("vlm", "text", "late", "tail")}
            consumed = a.consumption("text", "train")
        for i in range(2):
            os.kill(eng.unit_pid(i), 9)
            eng.procs[i].wait(timeout=10)
        eng.kill_controller()
    finally:
        eng.stop()
    with engine(None, units=3) as new, connect(new) as b:
        info = snapshot.restore(b.transport, snap, journal=jdir)
        assert info.journal is not None and info.journal["torn"] == [] and info.journal["skipped"] == []
        assert sorted(b.partitions()) == ["late", "tail", "text", "vlm"]
        for p, ids in order.items():
            assert b.transport.describe(p).sample_ids == ids, p  # commit order kept
        assert same(wire(b, "vlm", mv.sample_ids, sorted(vlm.fields)), want["vlm"])
        assert same(wire(b, "vlm", mv.subset([2, 5]).sample_ids, ["prev_logprobs"]), want["prev"])
        assert same(wire(b, "late", ml.sample_ids, sorted(late.fields)), want["late"])
        assert same(wire(b, "text", order["text"], sorted(text.fields)), want["text"])
        assert diff_fields(b.registry, late.fields, b.read_columns(ml, list(late.fields)), late.lengths,
                           sample_ids=ml.sample_ids) == []
        got = b.consumption("text", "train")
        assert (got["acked"], got["pending"]) == (consumed["acked"], consumed["pending"] + consumed["claimed"])
        assert got["acked"] == 10 + 12 - len(set(mt.sample_ids[:3]) & set(acked.sample_ids))
        assert len(b.transport.stats()["units"]) == 3


def test_the_journal_alone_restores_a_store_that_never_snapshotted_and_skips_a_torn_last_record(tmp_path):
    jdir = tmp_path / "journal"
    with engine(jdir, units=1) as eng, connect(eng) as a:
        first = text_step(8, 16, seed=1)
        m1 = a.put_samples("a", first.fields, durable=True)
        want = wire(a, "a", m1.sample_ids, sorted(first.fields))
        a.put_samples("b", text_step(8, 16, seed=2).fields, durable=True)  # its record is torn below
    (seg,) = [s for s in segments(jdir) if s.stat().st_size]
    with open(seg, "r+b") as f:  # the process died writing the last record: its tail never reached the disk
        f.truncate(seg.stat().st_size - 100)
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert b.partitions() == ["a"] and same(wire(b, "a", m1.sample_ids, sorted(first.fields)), want)
        assert len(info.journal["torn"]) == 1 and str(seg) in info.journal["torn"][0]


def test_a_put_split_over_blocks_with_descending_ids_replays_each_row_onto_its_own_sample(tmp_path, monkeypatch):
    """A client with no slab mapped (another host) splits a big put over blocks with random
    ids: the replay joins them in row order, never id order (rows swapped between samples
    silently before); a row that replays onto another sample fails its writer's digest."""
    import secrets as real

    from rlplane.transports import native

    ids = iter(range(1 << 40, 0, -1))  # each block's id below the one before it
    monkeypatch.setattr(native, "secrets", type("Secrets", (), {"randbits": staticmethod(lambda k: next(ids)),
                                                                 "randbelow": staticmethod(real.randbelow),
                                                                 "token_hex": staticmethod(real.token_hex)}))
    monkeypatch.setattr(native, "CHUNK_BYTES", 1 << 10)  # a kB a block: the put below spans every unit
    jdir = tmp_path / "journal"
    with engine(jdir, units=4) as eng, Client(default_registry(), NativeTransport(
            {"controller": eng.server.endpoint, "secret": SECRET.decode()}, timeout=30, data_path="zmq")) as a:
        w = text_step(16, 64, seed=3)
        m = a.put_samples("big", w.fields, durable=True)
        want = wire(a, "big", m.sample_ids, sorted(w.fields))
    (rec,) = [r for r in J.Journal.open(jdir).changes.values() if r.kind == J.PUT]
    assert len(rec.rec["blocks"]) == 4  # split, each id below the one before
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert not info.journal["skipped"] and same(wire(b, "big", m.sample_ids, sorted(w.fields)), want)
    rec.rec["blocks"].reverse()  # a record joined out of row order: its rows fail their writers' digests
    why = J._put_of(rec)
    assert isinstance(why, str) and "'big', sample" in why and "differ from what the writer stored" in why


def test_a_put_whose_writer_recorded_wrong_digests_is_skipped_by_a_replay_and_the_rest_restored(tmp_path):
    """The engine takes a put's digests as its writer gives them (reads check them): one
    put with wrong ones is the replay's to skip and name, not a reason to load nothing."""
    import numpy as np

    jdir = tmp_path / "journal"
    with engine(jdir) as eng, connect(eng) as a:
        w = text_step(4, 16, seed=1)
        good = a.put_samples("good", w.fields, durable=True)
        want = wire(a, "good", good.sample_ids, sorted(w.fields))
        cols, _ = a.transport.get("good", good.sample_ids, ["input_ids"])
        col = cols["input_ids"]
        wrong = {"input_ids": col.with_meta(col.sums ^ np.uint64(1), col.geom)}
        a.transport.put("bad", ["x0", "x1", "x2", "x3"], wrong, [{}] * 4, create=True)
        later = a.put_samples("later", text_step(2, 16, seed=2).fields, durable=True)
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert sorted(b.partitions()) == ["good", "later"]
        assert same(wire(b, "good", good.sample_ids, sorted(w.fields)), want)
        assert b.transport.describe("later").sample_ids == later.sample_ids
        (skipped,) = info.journal["skipped"]
        assert "'bad', sample 'x0', field 'input_ids'" in skipped


def test_power_lost_with_the_last_two_records_written_in_part_keeps_every_fsynced_put(tmp_path):
    """The last two records reached the disk only in part (a page of zeros in the one, the
    other cut short): no whole record follows the damage, so both are torn, reported, and
    the durable put before them comes back (the whole journal was refused before)."""
    jdir = tmp_path / "journal"
    with engine(jdir, units=1, journal_flush_ms=10_000) as eng, connect(eng) as a:
        w = text_step(4, 16, seed=1)
        m = a.put_samples("durable", w.fields, durable=True)
        want = wire(a, "durable", m.sample_ids, sorted(w.fields))
        a.put_samples("late1", text_step(64, 256, seed=2).fields)  # in the page cache only
        a.put_samples("late2", text_step(64, 256, seed=3).fields)
    (seg,) = [s for s in segments(jdir) if s.stat().st_size]
    data, starts, at = bytearray(seg.read_bytes()), [], 0
    while at < len(data):
        _, hl, bl = J.FRAME.unpack_from(data, at)
        starts.append(at)
        at += J.FRAME.size + hl + bl + J.TRAILER.size
    mid = (starts[-2] + starts[-1]) // 2
    data[mid : mid + 4096] = bytes(4096)  # a page of the one before the last never written
    seg.write_bytes(bytes(data[: (starts[-1] + len(data)) // 2]))  # the last cut short
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert b.partitions() == ["durable"] and same(wire(b, "durable", m.sample_ids, sorted(w.fields)), want)
        assert len(info.journal["torn"]) == 1 and "fail their checksums" in info.journal["torn"][0]


def test_a_damaged_journal_record_is_refused_naming_the_file_and_nothing_is_loaded(tmp_path):
    jdir = tmp_path / "journal"
    with engine(jdir, units=1) as eng, connect(eng) as a:
        a.put_samples("a", text_step(8, 16, seed=1).fields, durable=True)
        a.put_samples("b", text_step(8, 16, seed=2).fields, durable=True)
    (seg,) = [s for s in segments(jdir) if s.stat().st_size]
    first = J.read_segment(seg)
    assert [r.kind for r in first.records] == ["put", "put"]
    data = bytearray(seg.read_bytes())
    data[200] ^= 0x10  # inside the first record, with another after it
    seg.write_bytes(bytes(data))
    with engine(None) as new, connect(new) as b:
        with pytest.raises(E.SnapshotError) as err:
            snapshot.restore(b.transport, None, journal=jdir)
        assert err.value.component == str(seg) and "checksum" in str(err.value)
        assert b.partitions() == []


def test_a_checksummed_journal_record_of_the_wrong_shape_is_refused_naming_the_file(tmp_path):
    """A record whose checksum passes but which no engine writes (a float change number or
    block id, ids that are not a list of strings, a bad partition or task name) is a
    SnapshotError naming its file, and the store keeps what it held (before: TypeError,
    OverflowError, WireFormatError; a float change number stopped a unit from starting)."""
    import msgpack

    from rlplane_service.native.journal import JournalWriter

    cases = {"clear ids": (1, "clear", "p", {"ids": 5}, None), "ack ids": (1, "ack", "p", {"task": "t", "ids": 5}, None),
             "ack task": (1, "ack", "p", {"task": 7, "ids": ["a"]}, None),
             "id types": (1, "clear", "p", {"ids": [1, 2]}, None), "partition": (1, "drop", "", {}, None),
             "block id": (1, "clear", "p", {"ids": ["a"]}, [[float("inf"), []]]),
             "seq": (float("inf"), "clear", "p", {"ids": ["a"]}, None)}
    with engine(None, units=1) as new, connect(new) as b:
        b.put_samples("other", text_step(2, 4, seed=1).fields)
        for name, (seq, kind, p, rec, places) in cases.items():
            j = JournalWriter(tmp_path / name, "u0", flush_ms=10)
            try:
                j.append(seq, kind, p, msgpack.packb(rec), places)
                j.append(2, "clear", "q", msgpack.packb({"ids": ["b"]}))  # (a whole record after it: not torn)
            finally:
                j.close()
            with pytest.raises(E.SnapshotError) as err:
                snapshot.restore(b.transport, None, journal=tmp_path / name)
            assert err.value.component.startswith(str(tmp_path / name / "u0")), name
            assert b.partitions() == ["other"], name


def test_a_snapshot_truncates_the_journal_and_an_older_snapshot_cannot_be_continued(tmp_path):
    jdir = tmp_path / "journal"
    with engine(jdir) as eng, connect(eng) as a:
        a.put_samples("a", text_step(8, 16, seed=1).fields)
        before = set(segments(jdir))
        old = a.snapshot(str(tmp_path / "s1"))
        a.put_samples("b", text_step(8, 16, seed=2).fields)
        a.snapshot(str(tmp_path / "s2"))
        def truncated() -> bool:  # both truncations run on a thread of the controller's: wait for s2's
            bases = [J.read_base(d) for d in jdir.iterdir()]
            return bool(bases) and all(b.get("snapshot") == str(tmp_path / "s2") for b in bases)

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not truncated():
            time.sleep(0.05)
        assert truncated()
        assert not before & set(segments(jdir))  # the segments holding only changes before the cut are gone
        assert all(J.read_base(d)["seq"] > old.seq for d in jdir.iterdir())
        a.put_samples("c", text_step(4, 16, seed=3).fields, durable=True)
    with engine(None) as new, connect(new) as b:
        with pytest.raises(E.SnapshotError, match="truncated at a later snapshot"):
            snapshot.restore(b.transport, tmp_path / "s1", journal=jdir)
        assert b.partitions() == []
        info = snapshot.restore(b.transport, tmp_path / "s2", journal=jdir)
        assert sorted(b.partitions()) == ["a", "b", "c"] and info.journal["changes"] == 1


def test_a_journal_a_snapshot_truncated_brings_the_store_back_alone_from_that_snapshot(tmp_path):
    """What a store with periodic snapshots needs after a crash: restarted with only its
    journal directory (no RLPLANE_RESTORE_FROM), it loads the snapshot the journal's
    truncation names, then the changes after it, bit for bit. Were that snapshot gone, the
    restore says which one and loads nothing."""
    import shutil

    jdir, s1, s2 = tmp_path / "journal", tmp_path / "auto-1", tmp_path / "auto-2"
    with engine(jdir) as eng, connect(eng) as a:
        first = text_step(8, 16, seed=1)
        m1 = a.put_samples("a", first.fields)
        a.snapshot(str(s1))
        second = vlm_step(4, 64, seed=2)
        m2 = a.put_samples("b", second.fields)
        a.snapshot(str(s2))  # the newest: the journal continues it
        third = text_step(4, 16, seed=3)
        m3 = a.put_samples("c", third.fields, durable=True)
        deadline = time.monotonic() + 20  # (the truncations run on a thread of the controller's)
        while time.monotonic() < deadline and not all(J.read_base(d).get("snapshot") == str(s2) for d in jdir.iterdir()):
            time.sleep(0.05)
        want = {"a": wire(a, "a", m1.sample_ids, sorted(first.fields)),
                "b": wire(a, "b", m2.sample_ids, sorted(second.fields)),
                "c": wire(a, "c", m3.sample_ids, sorted(third.fields))}
    said: list[str] = []
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir, progress=said.append)
        assert sorted(b.partitions()) == ["a", "b", "c"] and info.journal["changes"] == 1
        assert same(wire(b, "a", m1.sample_ids, sorted(first.fields)), want["a"])
        assert same(wire(b, "b", m2.sample_ids, sorted(second.fields)), want["b"])
        assert same(wire(b, "c", m3.sample_ids, sorted(third.fields)), want["c"])
        assert any(str(s2) in line for line in said)
    # A service whose RLPLANE_RESTORE_FROM still names the first snapshot (newest=True): the
    # journal continues the later one, which is loaded instead (the library call refuses).
    with engine(None) as new, connect(new) as b:
        with pytest.raises(E.SnapshotError, match="truncated at a later snapshot"):
            snapshot.restore(b.transport, s1, journal=jdir)
        assert b.partitions() == []
        snapshot.restore(b.transport, s1, journal=jdir, newest=True)
        assert sorted(b.partitions()) == ["a", "b", "c"]
        assert same(wire(b, "c", m3.sample_ids, sorted(third.fields)), want["c"])
    shutil.rmtree(s1)  # pruned since (snapshot_keep): the journal's snapshot still continues the store
    with engine(None) as new, connect(new) as b:
        snapshot.restore(b.transport, s1, journal=jdir, newest=True)
        assert sorted(b.partitions()) == ["a", "b", "c"]
    other = tmp_path / "elsewhere" / "run-9"  # a snapshot of another directory: an operator's choice, not switched
    shutil.copytree(s2, other)
    (other / "manifest.json").write_text((other / "manifest.json").read_text().replace('"seq":', '"seq": 1, "x":', 1))
    with engine(None) as new, connect(new) as b:
        with pytest.raises(E.SnapshotError, match="truncated at a later snapshot"):
            snapshot.restore(b.transport, other, journal=jdir, newest=True)
        assert b.partitions() == []
    shutil.rmtree(s2)
    with engine(None) as new, connect(new) as b:
        with pytest.raises(E.SnapshotError) as err:
            snapshot.restore(b.transport, None, journal=jdir)
        assert str(s2) in str(err.value) and b.partitions() == []


def test_a_snapshot_named_relative_or_by_file_url_continues_its_journal_and_one_in_memory_truncates_none(
        tmp_path, monkeypatch):
    """The journal records the snapshot it continues as its caller named it: a relative
    path (or one under a relative RLPLANE_SNAPSHOT_DIR) could not be found from another
    working directory, and a ``file://`` URL was taken for a relative path; a restore after
    a crash then failed. A snapshot to ``memory://`` (gone with its process) truncated the
    journal: every durable put before it was lost."""
    jdir = tmp_path / "journal"
    monkeypatch.chdir(tmp_path)

    def based_on(name: str) -> bool:  # (truncations run on a thread of the controller's)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(J.read_base(d).get("snapshot") == name for d in jdir.iterdir()):
            time.sleep(0.05)
        return all(J.read_base(d).get("snapshot") == name for d in jdir.iterdir())

    with engine(jdir) as eng, connect(eng) as a:
        a.put_samples("a", text_step(4, 16, seed=1).fields, durable=True)
        (tmp_path / "snaps").mkdir()
        a.snapshot("snaps/s1")
        assert based_on(str(tmp_path / "snaps" / "s1"))
        a.put_samples("b", text_step(4, 16, seed=2).fields, durable=True)
        a.snapshot(f"file://{tmp_path}/snaps/s2")
        assert based_on(str(tmp_path / "snaps" / "s2"))
        a.put_samples("c", text_step(4, 16, seed=3).fields, durable=True)
        a.snapshot("memory://rlplane-test/s3")
        time.sleep(0.5)
        a.put_samples("d", text_step(4, 16, seed=4).fields, durable=True)
        assert based_on(str(tmp_path / "snaps" / "s2"))  # the memory snapshot truncated nothing
    monkeypatch.chdir(jdir)
    for named in (None, f"file://{tmp_path}/snaps/s1"):  # a crash's restore; one naming the older snapshot
        with engine(None) as new, connect(new) as b:
            snapshot.restore(b.transport, named, journal=jdir, newest=True)
            assert sorted(b.partitions()) == ["a", "b", "c", "d"]


def test_a_restored_store_journals_on_after_the_old_journal(tmp_path):
    """The new store's own changes continue the old journal's numbers: a second crash is
    restored from the same snapshot and journal, old and new changes alike."""
    jdir = tmp_path / "journal"
    with engine(jdir) as eng, connect(eng) as a:
        m1 = a.put_samples("a", text_step(8, 16, seed=1).fields, durable=True)
    with engine(jdir, units=3) as eng, connect(eng) as b:
        snapshot.restore(b.transport, None, journal=jdir)
        assert b.transport.journal()["paused"] is False
        m2 = b.put_samples("b", text_step(4, 16, seed=2).fields, durable=True)
        b.clear("a", m1.sample_ids[:2])
        b.put_samples("c", text_step(2, 16, seed=3).fields, durable=True)
    with engine(None) as new, connect(new) as c:
        snapshot.restore(c.transport, None, journal=jdir)
        assert sorted(c.partitions()) == ["a", "b", "c"]
        assert c.transport.describe("a").sample_ids == m1.sample_ids[2:]
        assert c.transport.describe("b").sample_ids == m2.sample_ids


def test_a_snapshot_restored_into_a_journalling_store_without_its_journal_is_continued_by_the_new_one(tmp_path):
    """``snapshot.restore(transport, S)`` into a store that journals: its changes are numbered
    after S's cut, so a crash and a restore of S plus the new journal bring them back
    (before: numbered from 1, below the cut, they were skipped as older than S); and the
    new journal records that it continues S, so a restore from it alone loads S first."""
    with engine(None, units=1) as eng, connect(eng) as a:
        for k in range(6):
            a.put_samples("old", text_step(2, 8, seed=k).fields)
        a.snapshot(str(tmp_path / "S"))
    with engine(tmp_path / "D", units=1) as eng, connect(eng) as a:
        snapshot.restore(a.transport, tmp_path / "S")
        new = a.put_samples("new", text_step(4, 8, seed=9).fields, durable=True)
        want = wire(a, "new", new.sample_ids, ["input_ids"])
        deadline = time.monotonic() + 10  # (the units record it on a thread of the controller's)
        while not (tmp_path / "D" / "u0" / "BASE").exists():
            assert time.monotonic() < deadline, "the journal never recorded the snapshot it continues"
            time.sleep(0.05)
    with engine(None, units=1) as eng, connect(eng) as b:
        snapshot.restore(b.transport, tmp_path / "S", journal=tmp_path / "D")
        assert b.partitions() == ["new", "old"] and same(wire(b, "new", new.sample_ids, ["input_ids"]), want)
    with engine(None, units=1) as eng, connect(eng) as b:  # the journal alone: it loads the snapshot it continues
        snapshot.restore(b.transport, None, journal=tmp_path / "D")
        assert b.partitions() == ["new", "old"] and same(wire(b, "new", new.sample_ids, ["input_ids"]), want)


def test_a_journal_base_asked_while_a_truncation_runs_is_answered_at_once_and_not_recorded(tmp_path):
    """(The controller took the truncation lock blocking, on its serving thread: a request
    could stall every other one for as long as the units took to truncate.)"""
    with engine(tmp_path / "D", units=1) as eng, connect(eng) as a:
        assert eng.core._truncation.acquire(timeout=5)
        try:
            t0 = time.monotonic()
            assert a.transport.journal(base=(7, str(tmp_path / "S")))["based"] is False
            assert time.monotonic() - t0 < 2.0
        finally:
            eng.core._truncation.release()
        assert not (tmp_path / "D" / "u0" / "BASE").exists()


def test_a_rebuilt_controller_numbers_changes_above_the_journalled_acks(tmp_path):
    jdir = tmp_path / "journal"
    with engine(jdir) as eng, connect(eng) as a:
        a.put_samples("a", text_step(8, 16, seed=1).fields)
        for _ in range(3):
            got = a.claim("a", "t", batch_size=2, fields=["input_ids"], timeout=0)
            a.ack(got, "t")
        seq = a.transport.journal()["seq"]
        eng.kill_controller()
        eng.restart_controller()
        assert a.transport.journal()["seq"] >= seq  # no number an ack holds is given out again
        a.put_samples("b", text_step(2, 16, seed=2).fields, durable=True)
    j = J.Journal.open(jdir)  # a number given out twice would merge two changes into one here
    assert [r.kind for r in j.after(1)] == ["put", "ack", "ack", "ack", "put"]


def test_a_durable_put_returns_only_after_its_group_was_fsynced(tmp_path):
    """With the timed flush far off, a plain put leaves its record in the page cache; a
    durable one is answered after the fsync that covers it and everything before it."""
    with engine(tmp_path / "journal", journal_flush_ms=10_000) as eng, connect(eng) as a:
        a.put_samples("a", text_step(8, 16, seed=1).fields)
        lag = [c.journal.stats() for c in eng.cores]
        assert sum(s["lag_bytes"] for s in lag) > 0 and all(s["syncs"] == 0 for s in lag)
        a.put_samples("b", vlm_step(2, 32, seed=2).fields, durable=True)
        after = [c.journal.stats() for c in eng.cores]
        holders = [s for s in after if s["appended_bytes"] > 1 << 20]  # the unit(s) holding b's pixel values
        assert holders and all(s["lag_bytes"] == 0 and s["synced_bytes"] == s["appended_bytes"] for s in holders)


def test_with_two_copies_each_block_is_journalled_by_both_units_and_one_suffices(tmp_path):
    jdir = tmp_path / "journal"
    with engine(jdir, replicas=2) as eng, connect(eng) as a:
        w = vlm_step(4, 64, seed=9)
        m = a.put_samples("v", w.fields, durable=True)
        want = wire(a, "v", m.sample_ids, sorted(w.fields))
    mine = {d.name: [s for s in d.glob("seg-*.rlj") if s.stat().st_size] for d in jdir.iterdir()}
    assert all(mine.values()) and len(mine) == 2  # both units hold the put's bytes
    for seg in mine["u0"]:
        seg.unlink()  # one unit's journal gone: the other copy restores it all
    with engine(None) as new, connect(new) as b:
        snapshot.restore(b.transport, None, journal=jdir)
        assert same(wire(b, "v", m.sample_ids, sorted(w.fields)), want)


def test_a_durable_put_whose_journal_disk_fails_says_so_and_nothing_stored_is_lost(tmp_path, monkeypatch):
    import errno

    with engine(tmp_path / "journal", units=1) as eng, connect(eng) as a:
        kept = a.put_samples("kept", text_step(4, 16, seed=1).fields, durable=True)
        want = wire(a, "kept", kept.sample_ids, ["input_ids"])

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(eng.cores[0].journal, "append", full)
        with pytest.raises(E.UnavailableError, match="journal") as err:
            a.put_samples("late", text_step(4, 16, seed=2).fields, durable=True)
        assert "No space left" in str(err.value)
        monkeypatch.undo()
        assert same(wire(a, "kept", kept.sample_ids, ["input_ids"]), want)
        a.put_samples("late", text_step(4, 16, seed=2).fields, durable=True)  # the disk is back: it goes through
        assert sorted(a.partitions()) == ["kept", "late"]


@pytest.mark.parametrize("durable", [False, True])
def test_a_put_answered_as_failed_stays_failed_after_a_restore_though_its_other_copy_journalled_it(
        tmp_path, monkeypatch, durable):
    """Two copies; one holder's journal disk is full: the put fails, and the unit that
    journalled its copy records that the change failed (a restore brought it back before:
    a client that retried it got its samples twice)."""
    import errno

    jdir = tmp_path / "journal"
    with engine(jdir, replicas=2) as eng, connect(eng) as a:
        w = text_step(4, 16, seed=1)
        kept = a.put_samples("kept", w.fields, durable=True)
        want = wire(a, "kept", kept.sample_ids, sorted(w.fields))

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(eng.cores[0].journal, "append", full)
        with pytest.raises(E.UnavailableError, match="No space left"):
            a.put_samples("failed", text_step(4, 16, seed=2).fields, durable=durable)
        monkeypatch.undo()
        assert a.partitions() == ["kept"]
        later = a.put_samples("later", text_step(4, 16, seed=3).fields, durable=True)
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert sorted(b.partitions()) == ["kept", "later"] and not info.journal["skipped"]
        assert same(wire(b, "kept", kept.sample_ids, sorted(w.fields)), want)
        assert b.transport.describe("later").sample_ids == later.sample_ids


@pytest.mark.parametrize("cut_fails", [False, True])
def test_a_record_the_disk_took_only_part_of_never_hides_the_changes_after_it(tmp_path, monkeypatch, cut_fails):
    """ENOSPC part way through a record: the part is cut off (or, where even that fails,
    the segment ends there and the next change starts a new one), so the journal reads
    back every whole change (before: the torn part sat before later records and the whole
    journal was refused as damaged)."""
    import errno

    from rlplane_service.native import journal as NJ

    real, fail = NJ._write_all, []

    def partial(fd, bufs):
        if not fail:
            return real(fd, bufs)
        fail.pop()
        os.write(fd, bytes(bufs[0][: bufs[0].nbytes // 2]))  # the kernel took part of it, then the disk was full
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(NJ, "_write_all", partial)
    if cut_fails:
        monkeypatch.setattr(NJ.os, "ftruncate", no_truncate)
    j = NJ.JournalWriter(tmp_path, "u0", flush_ms=10)
    try:
        j.append(1, "clear", "p", b"\x80")
        fail.append(1)
        with pytest.raises(OSError, match="No space"):
            j.append(2, "clear", "p", b"\x80")
        j.append(3, "clear", "p", b"\x80")
        j.sync()
    finally:
        j.close()
    got = J.Journal.open(tmp_path)
    assert sorted(got.changes) == [1, 3]
    assert len(segments(tmp_path)) == (2 if cut_fails else 1)


def test_a_failed_fsync_leaves_everything_it_did_not_sync_to_the_next_one(tmp_path, monkeypatch):
    import errno

    from rlplane_service.native import journal as NJ

    j = NJ.JournalWriter(tmp_path, "u0", flush_ms=10_000, segment_bytes=64)  # (no flusher pass meanwhile)
    try:
        j.append(1, "clear", "p", b"\x80")
        j.append(2, "clear", "p", b"\x80")  # rolls over: the first segment waits to be synced and closed
        real = os.fsync
        monkeypatch.setattr(NJ.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(OSError):
            j.sync()
        assert j.stats()["lag_bytes"] > 0 and j.stats()["lag_s"] > 0 and len(j._closing) == 1
        monkeypatch.setattr(NJ.os, "fsync", real)
        j.sync()
        assert j.stats()["lag_bytes"] == 0 and not j._closing
    finally:
        j.close()


def test_an_older_snapshots_truncation_arriving_late_does_not_lower_the_base(tmp_path):
    from rlplane_service.native.journal import JournalWriter

    j = JournalWriter(tmp_path, "u0", flush_ms=10)
    try:
        for seq in (1, 2, 3):
            j.append(seq, "clear", "p", b"\x80")
        j.truncate(4, "s3")
        assert J.read_base(tmp_path / "u0")["seq"] == 4
        assert j.truncate(2, "s1") == 0  # late: the newer snapshot's base stays
        assert J.read_base(tmp_path / "u0")["seq"] == 4 and J.read_base(tmp_path / "u0")["snapshot"] == "s3"
    finally:
        j.close()
    again = JournalWriter(tmp_path, "u0", flush_ms=10)  # a new process knows the base too
    try:
        assert again.base == 4 and again.truncate(3, "s2") == 0
    finally:
        again.close()


def test_a_snapshot_prunes_the_journals_of_units_the_store_no_longer_has(tmp_path):
    """A store restored with fewer units leaves the old units' directories behind: the next
    snapshot's truncation deletes what of them it holds, keeps a segment with a later
    change, and never touches the live units' own."""
    from rlplane_service.native.journal import JournalWriter

    jdir = tmp_path / "journal"
    with engine(jdir, units=3) as eng, connect(eng) as a:
        a.put_samples("a", text_step(8, 16, seed=1).fields, durable=True)
    assert (jdir / "u2").is_dir() and list((jdir / "u2").glob("seg-*"))
    with engine(jdir, units=2) as eng, connect(eng) as b:
        snapshot.restore(b.transport, None, journal=jdir)
        b.put_samples("b", text_step(4, 16, seed=2).fields, durable=True)
        later = JournalWriter(jdir, "u7", flush_ms=10)  # a stale directory holding a change after the cut
        later.append(1 << 40, "clear", "nowhere", b"\x80")
        later.close()
        b.snapshot(str(tmp_path / "s"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (jdir / "u2").exists():
            time.sleep(0.05)
        assert not (jdir / "u2").exists()  # every change in it is in the snapshot
        assert len(list((jdir / "u7").glob("seg-*"))) == 1  # a later change: kept
        assert all(list((jdir / u).glob("seg-*")) for u in ("u0", "u1"))  # the live units' own journals
        b.put_samples("c", text_step(2, 16, seed=3).fields, durable=True)
    for f in (jdir / "u7").iterdir():
        f.unlink()
    (jdir / "u7").rmdir()
    with engine(None) as new, connect(new) as c:
        snapshot.restore(c.transport, tmp_path / "s", journal=jdir)
        assert sorted(c.partitions()) == ["a", "b", "c"]


def test_samples_a_claim_found_stale_stay_expired_after_a_restore_from_the_journal(tmp_path):
    """A claim with max_staleness marks stale samples expired for its task; the journal
    carries that (only acks before), so after a restore a claim without max_staleness does
    not hand them out as pending."""
    jdir, snap = tmp_path / "journal", tmp_path / "snap"
    with engine(jdir) as eng, connect(eng) as a:
        versions = [{"policy_version": 0}] * 4 + [{"policy_version": 5}] * 4
        a.put_samples("p", text_step(8, 16, seed=1).fields, tags=versions)
        a.snapshot(str(snap))  # the cut: nothing expired yet
        got = a.claim("p", "train", batch_size=4, fields=["input_ids"], timeout=0, max_staleness=1, current_version=5)
        a.ack(got, "train")
        with pytest.raises(E.NotReadyError):  # a claim that expires and finds nothing still says so
            a.claim("p", "other", batch_size=8, min_batch=8, fields=["input_ids"], timeout=0, max_staleness=1,
                    current_version=5)
        want = {t: a.consumption("p", t) for t in ("train", "other")}
        assert want["train"]["expired"] == 4 and want["other"]["expired"] == 4
    with engine(None) as new, connect(new) as b:
        info = snapshot.restore(b.transport, snap, journal=jdir)
        for task in ("train", "other"):
            got = b.consumption("p", task)
            keys = ("acked", "expired", "pending")
            assert {k: got[k] for k in keys} == {k: want[task][k] for k in keys}
        assert info.journal["expired"] == 8 and info.journal["acks"] == 4
        with pytest.raises(E.NotReadyError):  # nothing pending for train: the stale four stay out
            b.claim("p", "train", batch_size=1, fields=["input_ids"], timeout=0)


def test_a_claim_that_expires_a_large_backlog_is_journalled_and_replayed_in_bounded_pieces(tmp_path, monkeypatch):
    """One record, and one replayed request, per EXPIRED_PER_RECORD / CONSUMPTION_BATCH ids
    (a claim over a stale backlog wrote all of it as one record, and a replay sent it as one
    request: past the engine's header limit, the journal could not be restored at all)."""
    from rlplane_service.native import recovery

    monkeypatch.setattr(recovery, "EXPIRED_PER_RECORD", 4)
    monkeypatch.setattr(J, "CONSUMPTION_BATCH", 3)
    jdir = tmp_path / "journal"
    with engine(jdir) as eng, connect(eng) as a:
        versions = [{"policy_version": 0}] * 10 + [{"policy_version": 5}] * 2
        a.put_samples("p", text_step(12, 16, seed=1).fields, tags=versions)
        a.claim("p", "train", batch_size=2, fields=["input_ids"], timeout=0, max_staleness=1, current_version=5)
        assert a.consumption("p", "train")["expired"] == 10
    records = [r for r in J.Journal.open(jdir).changes.values() if r.rec.get("state") == "expired"]
    assert sorted(len(r.rec["ids"]) for r in records) == [2, 4, 4]
    with engine(None) as new, connect(new) as b:
        calls = []
        real = b.transport.set_consumption
        monkeypatch.setattr(b.transport, "set_consumption", lambda p, t, ids, states: (calls.append(len(ids)),
                                                                                         real(p, t, ids, states)))
        info = snapshot.restore(b.transport, None, journal=jdir)
        assert info.journal["expired"] == 10 and b.consumption("p", "train")["expired"] == 10
        assert max(calls) <= 3
