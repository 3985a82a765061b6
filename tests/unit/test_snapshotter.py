"""Periodic snapshots: the snapshotter takes one per interval when it has the turn, keeps
the newest RLPLANE_SNAPSHOT_KEEP automatic ones and never touches other snapshots; a
failing snapshot is counted and the next interval tries again."""

import time

import pytest

from rlplane import Client, default_registry
from rlplane.testing.workloads import text_step
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine
from rlplane_service.settings import ServiceSettings
from rlplane_service.snapshotter import PREFIX, Snapshotter

SECRET = b"snapshotter-secret"


@pytest.fixture
def client():
    with LocalEngine(1, secret=SECRET, slab_bytes=64 << 20) as eng:
        with Client(default_registry(), NativeTransport({"controller": eng.server.endpoint,
                                                         "secret": SECRET.decode()}, timeout=30)) as c:
            yield c


def test_it_keeps_the_newest_automatic_snapshots_and_leaves_others_alone(client, tmp_path):
    client.put_samples("a", text_step(4, 8, seed=1).fields)
    client.snapshot(str(tmp_path / "by-hand"))
    s = Snapshotter(client.transport, tmp_path, 3600, keep=2)
    taken = [s.once() for _ in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["by-hand", taken[1].name, taken[2].name])
    assert all(p.name.startswith(PREFIX) for p in taken) and s.taken == 3


def test_what_a_snapshot_killed_while_writing_left_is_removed_once_idle_and_one_being_written_is_not(client,
                                                                                                      tmp_path):
    """A snapshot whose process died while writing left its hidden temporary directory for
    good: a few preemptions filled the snapshot volume."""
    import os

    client.put_samples("a", text_step(4, 8, seed=1).fields)
    dead, live = (tmp_path / f".{PREFIX}{n}.tmp-0000" for n in ("20260101T000000Z", "29990101T000000Z"))
    for d in (dead, live):
        d.mkdir()
        (d / "part-00000.rlsnap").write_bytes(b"x" * 1024)
    (tmp_path / ".by-hand.tmp-0000").mkdir()  # (not an automatic one's: never touched)
    old = time.time() - 120
    for f in (dead / "part-00000.rlsnap", dead, tmp_path / ".by-hand.tmp-0000"):
        os.utime(f, (old, old))
    Snapshotter(client.transport, tmp_path, 30, keep=2).once()
    assert not dead.exists() and live.exists() and (tmp_path / ".by-hand.tmp-0000").exists()


def test_it_takes_one_per_interval_only_with_the_turn_and_survives_a_failure(client, tmp_path):
    client.put_samples("a", text_step(4, 8, seed=1).fields)
    turns = iter([False, True, True] + [False] * 1000)
    s = Snapshotter(client.transport, tmp_path / "snaps", 0.2, keep=5, turn=lambda: next(turns)).start()
    try:
        (tmp_path / "snaps").mkdir()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and s.taken < 2:
            time.sleep(0.05)
        assert s.taken == 2 and s.failed == 0
        (tmp_path / "gone").write_text("not a directory")
        s.root = tmp_path / "gone"  # the volume is not there as a directory: the next try fails, is counted
        s.turn = lambda: True
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and s.failed < 1:
            time.sleep(0.05)
        assert s.failed >= 1 and s.taken == 2
    finally:
        s.stop()


def test_settings_refuse_an_interval_without_a_directory_or_off_native():
    with pytest.raises(ValueError, match="RLPLANE_SNAPSHOT_DIR"):
        ServiceSettings(snapshot_interval_s=60)
    with pytest.raises(ValueError, match="native backend"):
        ServiceSettings(backend="simple", journal_dir="/tmp/j")
    assert ServiceSettings(snapshot_interval_s=60, snapshot_dir="/tmp/s").snapshot_keep == 3
