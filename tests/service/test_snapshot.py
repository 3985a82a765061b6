"""Snapshots under the live service: ``rlplane snapshot --to`` and ``Client.snapshot`` while
the store serves, then a new store of another size started with RLPLANE_RESTORE_FROM
serves every sample bit for bit and every task's consumption; that store journals
(RLPLANE_JOURNAL_DIR), has every engine process killed, and a third one restored from
the snapshot plus the journal serves all of it, and a fourth, still pointed at the first
snapshot after a later one truncated the journal, loads the later one and the journal;
the TransferQueue-based backends refuse with a clear error."""

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

import rlplane
from rlplane import errors as E
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step

SOURCE = {"store_name": "snap-src", "backend": "native", "storage_units": 2, "unit_bytes": 128 << 20}


@pytest.fixture(scope="module")
def source(own_app):
    with own_app(SOURCE, "/snap-src") as url:
        yield url


def test_a_snapshot_restores_into_a_new_store_before_it_is_ready(source, own_app, tmp_path):
    p, q = f"vlm-{uuid.uuid4().hex[:6]}", f"text-{uuid.uuid4().hex[:6]}"
    with rlplane.connect(source) as c:
        vlm = vlm_step(8, 256, seed=21)
        mv = c.put_samples(p, vlm.fields)
        text = text_step(32, 64, seed=22)
        mt = c.put_samples(q, text.fields, tags=[{"group": i // 4} for i in range(32)])
        acked = c.claim(q, "train", batch_size=12, fields=["input_ids"], timeout=0)
        c.ack(acked, "train")
        info = c.snapshot(str(tmp_path / "by-client"))  # the service writes it (POST /v1/snapshot)
        assert (info.samples, info.partitions) == (40, 2)
        c.put_samples(q, text_step(4, 64, seed=23).fields)  # after the snapshot: not in it
    out = subprocess.run([sys.executable, "-m", "rlplane_tools", "snapshot", "--to", str(tmp_path / "by-cli"),
                          "--url", source, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["samples"] == 44
    deadline = time.monotonic() + 30  # /metrics caches a scrape for a moment
    while "rlplane_last_snapshot_samples 44.0" not in httpx.get(f"{source}/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the last snapshot never showed in /metrics"
        time.sleep(0.5)

    jdir = tmp_path / "journal"
    args = {"store_name": "snap-dst", "backend": "native", "storage_units": 3, "unit_bytes": 64 << 20,
            "restore_from": str(tmp_path / "by-client"), "journal_dir": str(jdir), "journal_flush_ms": 20}
    with own_app(args, "/snap-dst") as restored:
        assert httpx.get(f"{restored}/readyz", timeout=30).status_code == 200
        with rlplane.connect(restored) as r:
            assert sorted(r.partitions()) == sorted([p, q])
            got = r.read_columns(mv, list(vlm.fields))
            assert diff_fields(r.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []
            got = r.read_columns(mt, list(text.fields))
            assert diff_fields(r.registry, text.fields, got, text.lengths, sample_ids=mt.sample_ids) == []
            assert r.transport.describe(q).num_samples == 32
            train = r.consumption(q, "train")
            assert (train["acked"], train["pending"]) == (12, 20)
            status = httpx.get(f"{restored}/v1/status", timeout=30).json()
            assert status["store"]["storage_units"] == 3
            # The restored store journals on: durable puts and acks, then every engine process killed.
            late = vlm_step(4, 128, seed=24)
            ml = r.put_samples(f"{p}-late", late.fields, durable=True)
            r.ack(r.claim(q, "train", batch_size=5, fields=["input_ids"], timeout=0), "train")
            # (An ack is appended to two units' journals before it is answered, and reaches the disk
            # within the flush interval; SIGKILL keeps what was appended, as the page cache does.)
            r.put_samples(f"{p}-tail", text_step(2, 16, seed=25).fields, durable=True)
        kill_engine("snap-dst", 3)
    # A third store from the same snapshot plus the journal: the snapshot's samples, then all the above.
    with own_app({**args, "store_name": "snap-again", "storage_units": 2}, "/snap-again") as again:
        assert httpx.get(f"{again}/readyz", timeout=30).status_code == 200
        with rlplane.connect(again) as r:
            assert sorted(r.partitions()) == sorted([p, q, f"{p}-late", f"{p}-tail"])
            got = r.read_columns(ml, list(late.fields))
            assert diff_fields(r.registry, late.fields, got, late.lengths, sample_ids=ml.sample_ids) == []
            got = r.read_columns(mv, list(vlm.fields))
            assert diff_fields(r.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []
            assert r.consumption(q, "train")["acked"] == 12 + 5
            r.put_samples(f"{p}-new", text_step(2, 16, seed=26).fields, durable=True)  # and it journals on
            r.snapshot(str(tmp_path / "later"))  # (a periodic one would do the same): truncates the journal
            last = text_step(3, 16, seed=27)
            m_last = r.put_samples(f"{p}-last", last.fields, durable=True)
        kill_engine("snap-again", 2)
    # A fourth store, still configured with the first snapshot (as a chart's restoreFrom stays
    # set): the journal continues the later one, which it loads instead, then the journal.
    with own_app({**args, "store_name": "snap-fourth", "storage_units": 2}, "/snap-fourth") as fourth:
        assert httpx.get(f"{fourth}/readyz", timeout=30).status_code == 200
        with rlplane.connect(fourth) as r:
            assert sorted(r.partitions()) == sorted([p, q, f"{p}-late", f"{p}-tail", f"{p}-new", f"{p}-last"])
            got = r.read_columns(m_last, list(last.fields))
            assert diff_fields(r.registry, last.fields, got, last.lengths, sample_ids=m_last.sample_ids) == []
            got = r.read_columns(mv, list(vlm.fields))
            assert diff_fields(r.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []


def kill_engine(store: str, units: int) -> None:
    """SIGKILL every storage unit's process of ``store`` and kill its controller for good."""
    import ray

    handles = [ray.get_actor(f"{store}-native-unit-{i}", namespace="rlplane") for i in range(units)]
    for pid in [int(ray.get(u.info.remote(), timeout=60)["pid"]) for u in handles]:
        os.kill(pid, 9)
    ray.kill(ray.get_actor(f"{store}-native-controller", namespace="rlplane"), no_restart=True)


def test_a_snapshot_never_overwrites_and_the_tq_backends_refuse_snapshots(source, simple_service, mooncake_service,
                                                                         tmp_path):
    with rlplane.connect(source) as c:
        c.put_samples(f"t-{uuid.uuid4().hex[:6]}", text_step(4, 16, seed=1).fields)
        c.snapshot(str(tmp_path / "s"))
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            c.snapshot(str(tmp_path / "s"))
    for other, name in ((simple_service, "simple"), (mooncake_service, "mooncake")):
        with rlplane.connect(other.url, token=other.token, transport="http") as c:
            with pytest.raises(E.InvalidArgumentError, match="native backend"):
                c.snapshot(str(tmp_path / name))
            assert not (tmp_path / name).exists()


def test_durable_puts_over_http_reach_the_journal_and_the_tq_backends_refuse_them(service, simple_service):
    from rlplane import journal as J

    p = f"durable-{uuid.uuid4().hex[:6]}"
    with rlplane.connect(service.url, token=service.settings.token(), transport="http") as c:
        meta = c.put_samples(p, text_step(4, 16, seed=41).fields, durable=True)
    j = J.Journal.open(service.settings.journal_dir)  # the session's service keeps one
    (rec,) = [r for r in j.after(1) if r.partition == p]
    assert rec.kind == "put" and rec.rec["ids"] == meta.sample_ids and rec.blocks
    with rlplane.connect(simple_service.url, token=simple_service.token, transport="http") as c:
        with pytest.raises(E.InvalidArgumentError, match="durable=True needs the native backend"):
            c.put_samples(p, text_step(4, 16, seed=41).fields, durable=True)
        assert p not in c.partitions()


def test_a_damaged_snapshot_stops_a_new_store_from_starting_and_names_the_file(source, tmp_path, ending_store):
    """A new store pointed at a snapshot with one flipped byte does not start: the deploy
    fails, and what `rlplane serve --restore` prints (rlplane_service.embedded.replica_error)
    is the SnapshotError naming the damaged file, not Serve's "failed to update"."""
    from ray import serve

    from rlplane_service.app import build_app
    from rlplane_service.embedded import replica_error

    with rlplane.connect(source) as c:
        c.put_samples(f"t-{uuid.uuid4().hex[:6]}", text_step(4, 16, seed=3).fields)
        c.snapshot(str(tmp_path / "s"))
    part = sorted((tmp_path / "s").glob("part-*.rlsnap"))[0]
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 1
    part.write_bytes(bytes(damaged))
    args = {"store_name": "snap-bad", "backend": "native", "storage_units": 1, "unit_bytes": 32 << 20,
            "restore_from": str(tmp_path / "s")}
    try:
        with pytest.raises(RuntimeError, match="failed"):
            serve.run(build_app(args), name="rlplane-snap-bad", route_prefix="/snap-bad")
        err = replica_error("rlplane-snap-bad")
        assert isinstance(err, E.SnapshotError), err
        assert part.name in str(err) and "damaged" in str(err) and "nothing of the snapshot was loaded" in str(err)
    finally:
        serve.delete("rlplane-snap-bad")
        ending_store(args)


@pytest.fixture()
def ledger(service):
    """A store's ledger actor of its own (on the suite's Ray cluster)."""
    import ray

    from rlplane_service.metrics import ledger_actor_class

    actor = ledger_actor_class().remote()
    try:
        yield actor
    finally:
        ray.kill(actor)


def _store(ledger):
    from types import SimpleNamespace

    return SimpleNamespace(name="native", ledger=ledger)


def test_a_replica_waits_for_the_one_restoring_and_refuses_a_restore_that_failed_after_it_began_waiting(ledger):
    """The others serve only once the restoring replica is done (they served a half-loaded
    store before), and a failure that comes while they wait stops them (a waiter's first
    look used to hide it)."""
    import threading

    import ray

    from rlplane_service.app import restore_once

    ray.get(ledger.remember.remote("restored-by", "the-first-replica"))
    ray.get(ledger.keep.remote("restore", {"state": "running"}))
    threading.Timer(1.0, lambda: ray.get(ledger.keep.remote("restore", {"state": "done"}))).start()
    t0 = time.monotonic()
    restore_once(_store(ledger), None, "/snap/a", [])
    assert time.monotonic() - t0 >= 0.9  # it waited for the restore to finish

    ray.get(ledger.keep.remote("restore", {"state": "running"}))
    failed = {"state": "failed", "why": "disk gone"}
    threading.Timer(1.0, lambda: ray.get(ledger.keep.remote("restore", failed))).start()
    with pytest.raises(E.SnapshotError, match="the restore from /snap/a failed: disk gone"):
        restore_once(_store(ledger), None, "/snap/a", [])


def test_a_replica_started_after_the_restoring_one_died_mid_way_refuses_to_serve_the_part(ledger, monkeypatch):
    from rlplane_service import app

    monkeypatch.setattr(app, "RESTORE_SILENT_S", 1.5)
    import ray

    ray.get(ledger.remember.remote("restored-by", "a-replica-killed-while-restoring"))
    ray.get(ledger.keep.remote("restore", {"state": "running"}))  # its last sign
    t0 = time.monotonic()
    with pytest.raises(E.SnapshotError, match="stopped mid-way .* the store holds part of it"):
        app.restore_once(_store(ledger), None, "/snap/b", [])
    assert 1.4 < time.monotonic() - t0 < 10


def test_the_restoring_replica_tells_the_others_it_failed(ledger):
    """The restorer's own error reaches the replicas after it (here: a transport that
    cannot restore), as a SnapshotError naming it."""
    from rlplane_service.app import restore_once

    with pytest.raises(E.InvalidArgumentError, match="needs the native backend"):
        restore_once(_store(ledger), object(), "/snap/c", [])
    with pytest.raises(E.SnapshotError, match="failed: InvalidArgumentError"):
        restore_once(_store(ledger), object(), "/snap/c", [])


@pytest.mark.parametrize("ends", ["done", "interrupted"])
def test_the_restoring_replicas_last_word_is_its_outcome_and_its_beat_stops(ledger, monkeypatch, ends):
    """A beat sent after the outcome made a finished restore look alive, then dead (every
    later replica refused to serve); an interrupt (KeyboardInterrupt) left the beat going,
    so the others waited for ever."""
    import threading
    from types import SimpleNamespace

    import ray

    from rlplane import snapshot
    from rlplane_service import app

    monkeypatch.setattr(app, "RESTORE_BEAT_S", 0.001)  # a beat every millisecond: any late one shows

    def restore(*args, **kwargs):
        time.sleep(0.05)
        if ends == "interrupted":
            raise KeyboardInterrupt
        return SimpleNamespace(samples=0, partitions=0, seconds=0.05, journal=None)

    monkeypatch.setattr(snapshot, "restore", restore)
    if ends == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            app.restore_once(_store(ledger), None, "/snap/d", [])
    else:
        app.restore_once(_store(ledger), None, "/snap/d", [])
    assert not [t for t in threading.enumerate() if t.name == "rlplane-restore-beat" and t.is_alive()]
    time.sleep(0.3)
    state, _ = ray.get(ledger.kept.remote("restore"))
    assert state == ({"state": "done"} if ends == "done" else {"state": "failed", "why": "the restore was interrupted"})
