"""Snapshots: a consistent cut of a native store written to a directory while writers and
claimers go on, restored into another store (another number of storage units) bit for
bit with every task's consumption; a damaged snapshot is refused whole, naming the file
(in one process, without Ray: two LocalEngines)."""

import json
import os
import threading
import time

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane import snapshot
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_grpo, vlm_step
from rlplane.shm import populate as shm_populate
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"snapshot-test-secret"


@pytest.fixture
def source():
    with LocalEngine(2, secret=SECRET, lease_s=30, slab_bytes=128 << 20) as eng:
        yield eng


@pytest.fixture
def target():
    with LocalEngine(3, secret=SECRET, lease_s=30, slab_bytes=128 << 20) as eng:
        yield eng


def connect(eng: LocalEngine, path: str = "shm") -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30, data_path=path))


def wire(client: Client, p: str, ids: list, fields: list) -> dict:
    """What the store hands a reader, at the wire: per field values, offsets, digests, geometry; the tags."""
    cols, tags = client.transport.get(p, ids, fields)
    out = {f: (c.values.view(torch.uint8).clone(), c.offsets.clone(), c.sums.tolist(), c.geom.tolist())
           for f, c in cols.items()}
    return {"cols": out, "tags": [dict(t) for t in tags]}


def same(a: dict, b: dict) -> bool:
    if a["tags"] != b["tags"] or a["cols"].keys() != b["cols"].keys():
        return False
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]
               for x, y in ((a["cols"][f], b["cols"][f]) for f in a["cols"]))


def filled(c: Client) -> dict:
    """Two partitions: vlm-step (pixel values, a second write of some samples) and text with tags."""
    vlm = vlm_step(12, 128, seed=3)
    mv = c.put_samples("vlm", vlm.fields)
    c.write_columns(mv.subset([1, 4]), {"prev_logprobs": torch.randn(2, 128)})  # a field only two samples hold
    text = text_step(64, 64, seed=4)
    mt = c.put_samples("text", text.fields, tags=[{"group": i // 8, "policy_version": 3} for i in range(64)])
    c.clear("text", mt.sample_ids[:4])
    return {"vlm": (mv, vlm), "text": (mt, text)}


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_snapshot_restores_bit_exact_into_a_store_of_another_size_with_its_consumption(source, target, tmp_path,
                                                                                          path):
    with connect(source, path) as a, connect(target, path) as b:
        got = filled(a)
        acked = a.claim("text", "train", batch_size=20, fields=["input_ids"], timeout=0)
        a.ack(acked, "train")
        leased = a.claim("text", "train", batch_size=10, fields=["input_ids"], timeout=0)  # in flight at the cut
        a.claim("vlm", "ref", batch_size=12, fields=["input_ids"], timeout=0)
        with pytest.raises(E.NotReadyError):  # policy_version 3 is too old for this task: every sample expires
            a.claim("text", "fresh", batch_size=4, fields=["input_ids"], timeout=0, current_version=5, max_staleness=1)
        assert a.consumption("text", "fresh")["expired"] == 60
        mv, vlm = got["vlm"]
        reads = {"vlm": (mv.sample_ids, sorted(vlm.fields)), "prev": (mv.subset([1, 4]).sample_ids, ["prev_logprobs"]),
                 "text": (a.transport.describe("text").sample_ids, sorted(got["text"][1].fields))}
        part = {"vlm": "vlm", "prev": "vlm", "text": "text"}
        before = {k: wire(a, part[k], ids, fields) for k, (ids, fields) in reads.items()}
        info = a.snapshot(str(tmp_path / "snap"))
        assert (info.partitions, info.samples, info.tasks) == (2, 12 + 60, 3)
        assert 0 < info.cut_ms < info.seconds * 1e3  # the lock was held for the cut, not while bytes moved
        assert sorted(os.listdir(tmp_path)) == ["snap"]  # no temporary left behind
        manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
        assert manifest["version"] == snapshot.VERSION and len(manifest["files"]) == 2

        restored = snapshot.restore(b.transport, tmp_path / "snap")
        assert restored.samples == 72 and sorted(b.partitions()) == ["text", "vlm"]
        for p in ("vlm", "text"):
            assert b.transport.describe(p).sample_ids == a.transport.describe(p).sample_ids  # commit order kept
        for k, (ids, fields) in reads.items():
            assert same(wire(b, part[k], ids, fields), before[k]), k
        assert b.transport.describe("vlm").fields["prev_logprobs"] == 2
        assert diff_fields(b.registry, vlm.fields, b.read_columns(mv, list(vlm.fields)), vlm.lengths,
                           sample_ids=mv.sample_ids) == []
        # Acked stays acked; the lease in flight at the cut is pending again.
        train = b.consumption("text", "train")
        assert (train["acked"], train["claimed"], train["pending"]) == (20, 0, 40)
        rest = b.claim("text", "train", batch_size=40, fields=["input_ids"], timeout=0)
        assert set(rest.sample_ids) == set(a.transport.describe("text").sample_ids) - set(acked.sample_ids)
        assert set(leased.sample_ids) <= set(rest.sample_ids)
        assert b.consumption("vlm", "ref")["pending"] == 12
        fresh = b.consumption("text", "fresh")  # expired stays expired: never handed out, even without the bound
        assert (fresh["expired"], fresh["pending"]) == (60, 0)
        with pytest.raises(E.NotReadyError):
            b.claim("text", "fresh", batch_size=1, fields=["input_ids"], timeout=0)
        assert len(b.transport.stats()["units"]) == 3


def test_a_snapshot_while_writers_and_claimers_run_is_one_consistent_cut(source, target, tmp_path):
    """4 writers and 2 claimers go on while the snapshot copies (a 40 MB partition beside
    theirs keeps it busy): puts finish while it runs, the cut holds the lock well under
    100 ms, every sample in the snapshot has every field bit-exact to what its writer put
    (rows whole, none half there), and every ack before the cut is kept."""
    stop = threading.Event()
    errors: list = []
    puts: dict = {}
    put_done: list = []
    acks: list = []

    def writer(w: int) -> None:
        with connect(source) as c:
            k = 0
            while not stop.is_set() and k < 400:
                batch = text_step(8, 32, seed=1000 * w + k)
                m = c.put_samples("live", batch.fields, sample_ids=[f"w{w}-{k}-{i}" for i in range(8)])
                puts.update({s: (batch, i) for i, s in enumerate(m.sample_ids)})
                put_done.append(time.monotonic())
                k += 1

    def claimer(task: str) -> None:
        with connect(source) as c:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    m = c.claim("live", task, batch_size=8, fields=["input_ids"], timeout=0.05)
                except E.NotReadyError:
                    continue
                c.ack(m, task)
                acks.append((task, time.monotonic(), m.sample_ids))

    def guarded(fn, *args):
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    with connect(source) as c:
        c.put_samples("bulk", vlm_step(16, 256, seed=8).fields)  # bytes for the snapshot to copy while they go on
    threads = [threading.Thread(target=guarded, args=(writer, w)) for w in range(4)]
    threads += [threading.Thread(target=guarded, args=(claimer, t)) for t in ("train", "ref")]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while (len(puts) < 200 or len({t for t, _, _ in acks}) < 2) and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        with connect(source) as c:
            t_cut = time.monotonic()
            info = c.snapshot(str(tmp_path / "live"))
            t_end = time.monotonic()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert info.samples >= 200 and info.cut_ms < 100, info
    assert any(t_cut < t < t_end for t in put_done), "no put finished while the snapshot ran"
    with connect(target) as b:
        snapshot.restore(b.transport, tmp_path / "live")
        ids = b.transport.describe("live").sample_ids
        assert len(ids) == info.samples - 16 and set(ids) <= set(puts)
        fields = sorted(puts[ids[0]][0].fields)
        cols, _ = b.transport.get("live", ids, fields)
        for f in fields:
            for j, s in enumerate(ids):
                batch, i = puts[s]
                want = batch.fields[f][i]
                if want.dim() >= 1 and f != "input_lengths" and want.shape[0] == batch.fields["input_ids"].shape[1]:
                    want = want[: int(batch.fields["input_lengths"][i])]  # a token row: its sample's tokens
                row = cols[f].row(j)
                assert row.numel() == want.numel() and torch.equal(row.view(-1), want.reshape(-1).to(row.dtype)), (s, f)
        for task in ("train", "ref"):
            before = [s for t, when, got in acks if t == task and when < t_cut for s in got]
            assert before, f"no {task} ack before the cut: the test checks nothing"
            state = b.consumption("live", task)
            assert state["acked"] >= len(before)
            assert state["acked"] <= len([s for t, _, got in acks if t == task for s in got])
            rest = b.claim("live", task, batch_size=state["pending"], fields=["input_ids"], timeout=0) \
                if state["pending"] else None
            assert not set(before) & set(rest.sample_ids if rest else [])  # acked before the cut: never again


@pytest.mark.parametrize("path", ["shm", "zmq"])  # rows written from the mapped slabs / copied over sockets
def test_a_clear_after_the_cut_does_not_reach_into_the_snapshot(source, target, tmp_path, monkeypatch, path):
    with connect(source, path) as a, connect(target) as b:
        text = text_step(32, 64, seed=9)
        m = a.put_samples("p", text.fields)
        before = wire(a, "p", m.sample_ids, list(text.fields))
        collect = snapshot._collect
        cleared = []

        def clear_then_collect(*args, **kw):
            if not cleared:  # the cut is taken, no byte read yet: clear the partition and overwrite its memory
                cleared.append(a.clear("p"))
                a.put_samples("q", text_step(32, 64, seed=10).fields)
            return collect(*args, **kw)

        monkeypatch.setattr(snapshot, "_collect", clear_then_collect)
        info = snapshot.take(a.transport, tmp_path / "s")
        assert cleared == [32] and info.samples == 32 and info.partition_names == ["p"]
        snapshot.restore(b.transport, tmp_path / "s")
        assert same(wire(b, "p", m.sample_ids, list(text.fields)), before)


def test_rows_written_from_the_mapped_slabs_make_the_same_files_as_rows_copied_over_sockets(tmp_path):
    """A snapshot hands the file writer views of the slabs mapped on its host (no copy
    first); over ZMQ it copies the rows out. Both write the same bytes, shared rows and
    a field some samples hold included."""
    with LocalEngine(2, secret=SECRET, lease_s=30, slab_bytes=128 << 20) as eng:
        with connect(eng) as a:
            filled(a)
            a.put_samples("grpo", vlm_grpo(batch=16, seqlen=64, seed=6).fields)
            for k in range(3):  # several puts: a field's rows lie in several runs
                a.put_samples("many", text_step(8, 32, seed=20 + k).fields)
            assert a.transport.stats()["shared_bytes"] > 0
            views = a.transport.slab_runs
            runs = []
            a.transport.slab_runs = lambda *args: runs.append(views(*args)) or runs[-1]
            snapshot.take(a.transport, tmp_path / "shm")
            assert runs and all(r is not None for r in runs)
            assert any(r.same is not None for r in runs) and any(len(r.runs) > 1 for r in runs)
        with connect(eng, "zmq") as z:
            snapshot.take(z.transport, tmp_path / "zmq")
    files = sorted(f.name for f in (tmp_path / "shm").iterdir() if f.suffix == ".rlsnap")
    assert files == sorted(f.name for f in (tmp_path / "zmq").iterdir() if f.suffix == ".rlsnap") and len(files) == 4
    for name in files:
        assert (tmp_path / "shm" / name).read_bytes() == (tmp_path / "zmq" / name).read_bytes(), name


@pytest.mark.parametrize("advice", [True, False])  # the kernel maps the read-ahead / reads it into a buffer
def test_a_restore_reads_its_files_ahead_with_or_without_the_kernels_populate_advice(source, target, tmp_path,
                                                                                    monkeypatch, advice):
    monkeypatch.setattr(snapshot, "_READ_CHUNK", 64 << 10)  # several pieces per file
    faulted = []
    monkeypatch.setattr(snapshot, "populate", lambda u8, write: faulted.append(u8.size) or (advice and
                                                                                           shm_populate(u8, write=write)))
    with connect(source) as a, connect(target) as b:
        got = filled(a)
        mv, vlm = got["vlm"]
        before = wire(a, "vlm", mv.sample_ids, sorted(vlm.fields))
        a.snapshot(str(tmp_path / "snap"))
        snapshot.restore(b.transport, tmp_path / "snap")
        assert same(wire(b, "vlm", mv.sample_ids, sorted(vlm.fields)), before)
    for t in [t for t in threading.enumerate() if t.name == "rlplane-restore-readahead"]:
        t.join(timeout=10)  # (they may outlive the restore, which faults in what they have not reached)
    sizes = sum(f.stat().st_size for f in (tmp_path / "snap").iterdir() if f.suffix == ".rlsnap")
    # with the advice every piece is faulted in; without it, each file's first piece is tried (then read)
    assert (sum(faulted) == sizes) if advice else (len(faulted) == len(list((tmp_path / "snap").glob("*.rlsnap"))))


def test_a_restore_has_the_next_files_read_while_it_checks_and_loads_one(source, target, tmp_path, monkeypatch):
    """The disk keeps streaming: when partition k is checked, files up to k + _FILES_AHEAD
    have been asked for (each read on a thread of its own while k loads)."""
    asked, ahead = [], []
    prefetch, part = snapshot.Snapshot.prefetch, snapshot.Snapshot.part
    monkeypatch.setattr(snapshot.Snapshot, "prefetch", lambda self, k: asked.append(k) or prefetch(self, k))
    monkeypatch.setattr(snapshot.Snapshot, "part", lambda self, k: ahead.append((k, max(asked))) or part(self, k))
    with connect(source) as a, connect(target) as b:
        metas = [a.put_samples(f"p{k}", text_step(4, 16, seed=k).fields) for k in range(5)]
        a.snapshot(str(tmp_path / "snap"))
        snapshot.restore(b.transport, tmp_path / "snap")
        for m in metas:
            assert b.transport.describe(m.partition).num_samples == 4
    assert [k for k, _ in ahead] == list(range(5))
    assert all(most >= min(k + snapshot._FILES_AHEAD - (k == 0), 4) for k, most in ahead), ahead


def test_an_empty_store_snapshots_and_restores_nothing(source, target, tmp_path):
    with connect(source) as a, connect(target) as b:
        info = a.snapshot(str(tmp_path / "e"))
        assert (info.samples, info.partitions) == (0, 0)
        assert snapshot.restore(b.transport, tmp_path / "e").samples == 0 and b.partitions() == []


@pytest.fixture
def snap(source, tmp_path):
    with connect(source) as a:
        filled(a)
        a.snapshot(str(tmp_path / "snap"))
    return tmp_path / "snap"


def _part_file(snap) -> str:
    return sorted(f for f in os.listdir(snap) if f.endswith(".rlsnap"))[-1]


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip a value byte", "flip a header byte", "truncate", "drop a file",
                                    "other version", "no manifest", "bad manifest"])
def test_a_damaged_snapshot_is_refused_naming_the_file_and_nothing_is_loaded(snap, target, damage):
    name = _part_file(snap)
    f = snap / name
    named = name
    if damage == "flip a value byte":
        _flip(f, f.stat().st_size - 100)
    elif damage == "flip a header byte":
        _flip(f, 20)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "drop a file":
        f.unlink()
    else:
        named = "manifest.json"
        m = snap / "manifest.json"
        if damage == "other version":
            m.write_text(json.dumps({**json.loads(m.read_text()), "version": 99}))
        elif damage == "no manifest":
            m.unlink()
        else:
            m.write_text("{not json")
    with connect(target) as b:
        b.put_samples("mine", text_step(4, 16, seed=1).fields)  # already stored: must survive the refusal
        with pytest.raises(E.SnapshotError) as err:
            snapshot.restore(b.transport, snap)
        assert named in str(err.value) and named in err.value.component
        assert b.partitions() == ["mine"] and b.transport.describe("mine").num_samples == 4


def test_a_restore_refuses_a_store_that_holds_its_partitions(snap, target):
    with connect(target) as b:
        b.put_samples("text", text_step(4, 16, seed=1).fields)
        with pytest.raises(E.InvalidArgumentError, match="holds partition"):
            snapshot.restore(b.transport, snap)
        assert b.partitions() == ["text"] and b.transport.describe("text").num_samples == 4


def test_a_snapshot_never_overwrites_and_leaves_nothing_when_it_fails(source, tmp_path, monkeypatch):
    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        (tmp_path / "taken").mkdir()
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            a.snapshot(str(tmp_path / "taken"))

        def broken(*args, **kw):
            raise E.UnavailableError("storage unit u0 does not answer", component="u0")

        monkeypatch.setattr(a.transport, "fetch", broken)
        monkeypatch.setattr(a.transport, "slab_runs", broken)
        with pytest.raises(E.UnavailableError):
            a.snapshot(str(tmp_path / "half"))
        assert sorted(os.listdir(tmp_path)) == ["taken"]  # no half snapshot, no temporary
        deadline = time.monotonic() + 10  # the unpin is one-way: the controller takes it in its time
        while source.core.stats()["pins"]:
            assert time.monotonic() < deadline, "the cut's pin was never released"
            time.sleep(0.05)


def test_the_http_api_confines_snapshots_to_the_snapshot_dir(tmp_path):
    from pathlib import Path

    from rlplane_service.api import snapshot_path

    assert snapshot_path(tmp_path, "step-1") == tmp_path.resolve() / "step-1"
    assert snapshot_path(tmp_path, str(tmp_path / "a" / "b")) == tmp_path.resolve() / "a" / "b"
    for outside in ("../elsewhere", "/etc/cron.d/x", "a/../../b"):
        with pytest.raises(E.InvalidArgumentError, match="outside this service's snapshot directory"):
            snapshot_path(tmp_path, outside)
    assert snapshot_path(None, "/mnt/snaps/x") == Path("/mnt/snaps/x")
    assert snapshot_path(None, "s3://bucket/snaps/x") == "s3://bucket/snaps/x"  # a URL, kept whole
    assert snapshot_path(None, "file:///mnt/snaps/x") == Path("/mnt/snaps/x")
    with pytest.raises(E.InvalidArgumentError, match="is a URL"):
        snapshot_path(tmp_path, "s3://bucket/snaps/x")
    for root in (tmp_path, None):
        with pytest.raises(E.InvalidArgumentError, match="NUL"):  # (a ValueError, so a 500, before)
            snapshot_path(root, "a\0b")


def test_of_two_snapshots_to_one_path_the_second_to_finish_is_refused_typed(source, tmp_path, monkeypatch):
    """(Before: a raw OSError, Directory not empty: a 500 over HTTP.)"""
    from rlplane.snapplace import Local

    real = Local.move_to

    def first_lands_meanwhile(self, dest, last=None):
        dest.path.mkdir()  # the other snapshot's rename, between this one's check and its own
        (dest.path / "manifest.json").write_text("{}")
        return real(self, dest, last)

    with connect(source) as a:
        a.put_samples("p", text_step(4, 8, seed=2).fields)
        monkeypatch.setattr(Local, "move_to", first_lands_meanwhile)
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            a.snapshot(str(tmp_path / "S"))
    assert sorted(os.listdir(tmp_path)) == ["S"] and os.listdir(tmp_path / "S") == ["manifest.json"]


def test_a_restore_of_many_partitions_keeps_only_the_files_it_loads_and_reads_ahead_open(source, target, tmp_path,
                                                                                         monkeypatch):
    """Opening a snapshot opened and mapped every partition's file up front (two descriptors
    each): a store with a partition per step failed to restore under a limit of 1024."""
    with connect(source) as a:
        for k in range(24):
            a.put_samples(f"step-{k}", text_step(2, 8, seed=k).fields)
        a.snapshot(str(tmp_path / "S"))
    most, real = [0], snapshot.Snapshot._map

    def counted(self, k):
        got = real(self, k)
        most[0] = max(most[0], len(self._maps))
        return got

    monkeypatch.setattr(snapshot.Snapshot, "_map", counted)
    with connect(target) as b:
        info = snapshot.restore(b.transport, tmp_path / "S")
        assert info.partitions == 24 and len(b.partitions()) == 24
    assert most[0] <= snapshot._FILES_AHEAD + 2


def test_a_restore_refuses_fields_the_service_does_not_declare(snap, target):
    with connect(target) as b:
        with pytest.raises(E.UnregisteredFieldError, match="does not declare"):
            snapshot.restore(b.transport, snap, declared=["input_ids", "input_lengths"])
        assert b.partitions() == []
        assert snapshot.restore(b.transport, snap, declared=b.registry.names()).samples == 72


def test_the_controller_keeps_the_last_snapshot_for_metrics(source, tmp_path):
    with connect(source) as a:
        assert source.core.stats()["last_snapshot_time"] == 0.0
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        info = a.snapshot(str(tmp_path / "m"))
        st = source.core.stats()
        assert st["last_snapshot_time"] > 0 and st["last_snapshot_samples"] == 8
        assert st["last_snapshot_bytes"] == info.files_bytes


def test_a_snapshot_whose_pin_lapsed_is_not_written(source, tmp_path, monkeypatch):
    """The cut's pin is what keeps the blocks from reuse: a snapshot that lost it (a controller
    restart, a lease passed) writes nothing rather than bytes that may have been reused."""
    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        monkeypatch.setattr(a.transport, "renew", lambda pins: list(pins))  # every pin is gone
        with pytest.raises(E.IntegrityError, match="dropped the snapshot's pin"):
            a.snapshot(str(tmp_path / "s"))
        assert os.listdir(tmp_path) == []


# -- at an fsspec URL (memory://: fsspec's in-process filesystem, the same calls a remote one gets) -----------
@pytest.fixture
def memfs():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/rlplane-test-{os.getpid()}-{time.monotonic_ns()}"
    fs.makedirs(root, exist_ok=True)
    yield fs, f"memory://{root}"
    fs.rm(root, recursive=True)


def test_a_snapshot_at_a_url_restores_bit_exact_and_names_the_url_when_damaged(source, target, memfs):
    fs, root = memfs
    with connect(source) as a, connect(target) as b:
        got = filled(a)
        mv, vlm = got["vlm"]
        before = wire(a, "vlm", mv.sample_ids, sorted(vlm.fields))
        info = snapshot.take(a.transport, f"{root}/s1")
        assert info.path == f"{root}/s1" and info.samples == 12 + 60
        listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/s1", detail=False))
        assert listed[-1] == "part-00001.rlsnap" and "manifest.json" in listed
        assert [p for p in fs.ls(root, detail=False) if ".tmp-" in p] == []  # no temporary left behind
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            snapshot.take(a.transport, f"{root}/s1")
        back = snapshot.restore(b.transport, f"{root}/s1")
        assert back.samples == info.samples and same(wire(b, "vlm", mv.sample_ids, sorted(vlm.fields)), before)
    # A damaged file at the URL: refused, the error names the URL's file, nothing loaded.
    path = f"{root}/s1/part-00000.rlsnap"
    data = bytearray(fs.cat_file(path))
    data[-100] ^= 0x10
    fs.pipe_file(path, bytes(data))
    with LocalEngine(2, secret=SECRET, lease_s=30, slab_bytes=64 << 20) as eng, connect(eng) as c:
        with pytest.raises(E.SnapshotError) as err:
            snapshot.restore(c.transport, f"{root}/s1")
        assert f"{root}/s1/part-00000.rlsnap" in str(err.value) and c.partitions() == []
        with pytest.raises(E.SnapshotError, match="not a snapshot"):
            snapshot.restore(c.transport, f"{root}/nothing-here")


def test_a_snapshot_at_a_url_that_fails_leaves_nothing_there(source, memfs, monkeypatch):
    fs, root = memfs
    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)

        def broken(*args, **kw):
            raise E.UnavailableError("storage unit u0 does not answer", component="u0")

        monkeypatch.setattr(a.transport, "fetch", broken)
        monkeypatch.setattr(a.transport, "slab_runs", broken)
        with pytest.raises(E.UnavailableError):
            snapshot.take(a.transport, f"{root}/half")
        assert fs.ls(root, detail=False) == []


def test_two_snapshots_to_one_url_at_once_never_both_succeed_and_the_loser_removes_only_its_own(source, memfs,
                                                                                               monkeypatch):
    """Both wrote into the one directory and both said they succeeded (the files could
    mix); a writer now claims the place with a marker first, and one that finds another
    writer there refuses, removing only what it wrote."""
    from rlplane.snapplace import Remote, place

    fs, root = memfs
    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        first = place(f"{root}/s").temporary()  # (a writer that passed the check too, and writes)
        with first.open("part-00000.rlsnap") as f:
            f.write(b"theirs")
        with monkeypatch.context() as m:
            m.setattr(Remote, "check_new", lambda self: None)  # (this one checked before the other began)
            with pytest.raises(E.InvalidArgumentError, match="another snapshot is being written there"):
                snapshot.take(a.transport, f"{root}/s")
        assert fs.cat_file(f"{root}/s/part-00000.rlsnap") == b"theirs"
        assert len(fs.ls(f"{root}/s", detail=False)) == 2  # its marker and its file
        first.discard()
        assert fs.ls(root, detail=False) == []
        info = snapshot.take(a.transport, f"{root}/s")
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/s", detail=False))
        assert names == ["manifest.json", "part-00000.rlsnap"] and info.samples == 8  # (no marker left)


def test_a_snapshot_at_a_url_whose_store_refuses_deletes_is_complete_and_said_to_be(source, memfs, monkeypatch):
    """Removing the writer's marker after the manifest failed the snapshot, untyped, on a
    put-only credential (the complete snapshot stayed, said to have failed)."""
    fs, root = memfs

    def no_delete(path, *args, **kwargs):
        raise PermissionError("AccessDenied: s3:DeleteObject")

    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        monkeypatch.setattr(fs, "rm", no_delete)
        info = snapshot.take(a.transport, f"{root}/s")
        monkeypatch.undo()
        assert info.samples == 8 and fs.exists(f"{root}/s/manifest.json")
    with LocalEngine(2, secret=SECRET, lease_s=30, slab_bytes=64 << 20) as eng, connect(eng) as c:
        assert snapshot.restore(c.transport, f"{root}/s").samples == 8  # (the marker left there is not read)


def test_an_unknown_url_scheme_or_a_filesystems_root_is_a_clear_error(source):
    with connect(source) as a:
        a.put_samples("p", text_step(4, 16, seed=2).fields)
        with pytest.raises(E.InvalidArgumentError, match="no filesystem for this URL"):
            snapshot.take(a.transport, "nosuchscheme://x/y")
        for root in ("memory://", "memory:///"):
            with pytest.raises(E.InvalidArgumentError, match="not its root"):
                snapshot.take(a.transport, root)


def test_the_thread_that_keeps_the_cuts_pin_alive_runs_at_the_callers_priority(source, tmp_path, monkeypatch):
    """The copying threads are niced; the pin's renewer is not (started by the caller), so a
    busy host cannot starve it into letting the pin lapse."""
    seen = []
    loop = snapshot._Renewer._loop

    def spy(self):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return loop(self)

    monkeypatch.setattr(snapshot._Renewer, "_loop", spy)
    with connect(source) as a:
        a.put_samples("p", text_step(8, 16, seed=2).fields)
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        snapshot.take(a.transport, tmp_path / "s")
    assert seen == [mine] and mine < snapshot.NICE
