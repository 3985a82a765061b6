"""Snapshots and journals damaged in ways a second adversarial review found: each is refused
with a SnapshotError naming the file, nothing of it stays loaded, and nothing the store held
before is touched; acks and claims whose samples were cleared keep exactly-once across a
restore; out-of-range numbers in the HTTP API are 422s, not 500s."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import msgpack
import pytest
import xxhash
from fastapi.testclient import TestClient

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane import journal as J
from rlplane import snapshot
from rlplane.testing.workloads import text_step
from rlplane.transports import MemoryTransport
from rlplane.transports.native import NativeTransport
from rlplane_service.api import ServiceState, build_api
from rlplane_service.native.local import LocalEngine
from rlplane_service.settings import ServiceSettings

SECRET = b"damaged-restore-secret"
P0, P1 = "part-00000.rlsnap", "part-00001.rlsnap"


def engine(units: int = 2, **kw) -> LocalEngine:
    return LocalEngine(units, secret=SECRET, lease_s=30, slab_bytes=64 << 20, **kw)


def connect(eng: LocalEngine) -> Client:
    return Client(default_registry(), NativeTransport(eng.info, timeout=30))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A snapshot of partitions "a" and "b" (8 text-step samples each, tagged)."""
    path = tmp_path_factory.mktemp("snap") / "good"
    with engine() as eng, connect(eng) as c:
        for i, p in enumerate(("a", "b")):
            c.put_samples(p, text_step(8, 16, seed=i).fields, tags=[{"g": k} for k in range(8)])
        c.snapshot(str(path))
    return path


def _manifest(path: Path, edit) -> None:
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _header(path: Path, name: str, edit) -> None:
    """Rewrite partition file ``name`` with its header as ``edit`` leaves it, its digest in
    the manifest made to match (a digest is not a MAC: whoever writes the files can)."""
    data = (path / name).read_bytes()
    hlen = struct.unpack("<Q", data[8:16])[0]
    h = msgpack.unpackb(data[16:16 + hlen], raw=False, strict_map_key=False)
    values = data[-(-(16 + hlen) // 64) * 64:]
    edit(h)
    header = msgpack.packb(h, use_bin_type=True)
    head = data[:8] + struct.pack("<Q", len(header)) + header
    head += b"\0" * (-len(head) % 64)
    (path / name).write_bytes(head + values)
    _manifest(path, lambda m: m["files"].__setitem__(name, {"bytes": len(head + values),
                                                            "xxh3_128": xxhash.xxh3_128_hexdigest(head + values)}))


DAMAGE = {
    "manifest 'created' is a string": lambda s: _manifest(s, lambda m: m.__setitem__("created", "x")),
    "manifest 'seq' is a string": lambda s: _manifest(s, lambda m: m.__setitem__("seq", "x")),
    "manifest names a file with no size": lambda s: _manifest(s, lambda m: m["files"].__setitem__("junk", 5)),
    "manifest names two partitions alike": lambda s: _manifest(s, lambda m: m["partitions"][1].__setitem__("name", "a")),
    "second header's tasks are a list": lambda s: _header(s, P1, lambda h: h.__setitem__("tasks", [])),
    "second header's fields are a list": lambda s: _header(s, P1, lambda h: h.__setitem__("fields", [])),
    "second header has no partition": lambda s: _header(s, P1, lambda h: h.pop("p")),
    "second header names the store's own partition": lambda s: _header(s, P1, lambda h: h.__setitem__("p", "mine")),
    "second header's field starts at infinity": lambda s: _header(
        s, P1, lambda h: h["fields"]["input_ids"].__setitem__("start", float("inf"))),
    "second header's tags are a map": lambda s: _header(s, P1, lambda h: h.__setitem__("user", {i: {} for i in range(8)})),
    "second header names a sample twice": lambda s: _header(s, P1, lambda h: h.__setitem__("ids", [h["ids"][0]] * 8)),
    # (a third review's: untyped errors, or a WireFormatError naming no file, once partitions were in)
    "manifest names a file with a NUL": lambda s: _manifest(s, lambda m: (
        m["partitions"][1].__setitem__("file", "p\0x"), m["files"].__setitem__("p\0x", m["files"].pop(P1)))),
    "second header's tags have an int key": lambda s: _header(s, P1, lambda h: h.__setitem__("user", [{1: 2}] * 8)),
    "second header has a task without a name": lambda s: _header(s, P1, lambda h: h.__setitem__("tasks", {"": b"\0" * 8})),
    "second header has a sample id too long": lambda s: _header(s, P1, lambda h: h["ids"].__setitem__(0, "x" * 600)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_snapshot_loads_nothing_and_leaves_the_store_as_it_was(good, tmp_path, damage):
    path = tmp_path / "snap"
    shutil.copytree(good, path)
    DAMAGE[damage](path)
    with engine(3) as eng, connect(eng) as c:
        mine = text_step(4, 16, seed=9).fields
        meta = c.put_samples("mine", mine)
        with pytest.raises(E.SnapshotError, match="manifest.json|part-0000|p\x00x"):
            snapshot.restore(c.transport, path)
        assert c.partitions() == ["mine"]
        assert c.read_columns(meta, ["input_ids"], pad_to_seqlen=16)["input_ids"].equal(mine["input_ids"])


def test_a_manifest_renaming_a_partition_to_one_the_store_holds_neither_merges_nor_wipes_it(good, tmp_path):
    """Checks ran on the manifest's names, the load and the clean-up on the files': a renamed
    entry let the snapshot's "a" merge into the store's "a" (4 samples became 12), or, with a
    later file damaged, took the store's own "a" away."""
    for damaged in (False, True):
        path = tmp_path / f"snap-{damaged}"
        shutil.copytree(good, path)
        _manifest(path, lambda m: m["partitions"][0].__setitem__("name", "q"))
        if damaged:
            raw = bytearray((path / P1).read_bytes())
            raw[len(raw) // 2] ^= 1
            (path / P1).write_bytes(bytes(raw))
        with engine() as eng, connect(eng) as c:
            meta = c.put_samples("a", text_step(4, 16, seed=5).fields)
            with pytest.raises(E.SnapshotError):
                snapshot.restore(c.transport, path)
            assert c.partitions() == ["a"] and len(c.transport.describe("a").sample_ids) == 4
            c.read_columns(meta, ["input_ids"])


def _journalled(jdir: Path) -> None:
    with engine(1, journal_dir=jdir) as eng, connect(eng) as c:
        for p in ("a", "b", "c"):
            c.put_samples(p, text_step(4, 16, seed=1).fields, durable=True)


def test_a_damaged_journal_record_before_whole_ones_is_refused_not_taken_for_a_torn_end(tmp_path):
    """One flipped bit in the first record's body length made it look torn: the replay
    stopped there and silently dropped the two whole records after it."""
    jdir = tmp_path / "j"
    _journalled(jdir)
    (seg,) = J.segments(jdir)
    raw = bytearray(seg.read_bytes())
    raw[15] ^= 1  # the high byte of the first record's body length
    seg.write_bytes(bytes(raw))
    with engine() as eng, connect(eng) as c:
        with pytest.raises(E.SnapshotError, match="damaged"):
            snapshot.restore(c.transport, None, journal=jdir)
        assert c.partitions() == []


def test_a_journal_base_that_is_not_a_number_is_a_snapshot_error(tmp_path):
    jdir = tmp_path / "j"
    _journalled(jdir)
    (unit_dir,) = [d for d in jdir.iterdir() if d.is_dir()]
    (unit_dir / J.BASE).write_text(json.dumps({"seq": "x"}))
    with engine() as eng, connect(eng) as c:
        with pytest.raises(E.SnapshotError, match="BASE"):
            snapshot.restore(c.transport, None, journal=jdir)


def test_an_ack_of_a_lease_whose_sample_was_cleared_survives_a_restore(tmp_path):
    """Acking a whole lease after one of its samples was cleared journalled a None id; the
    replay then skipped the whole ack and handed the acked samples to the task again."""
    jdir = tmp_path / "j"
    with engine(1, journal_dir=jdir) as eng, connect(eng) as c:
        c.put_samples("p", text_step(8, 16, seed=1).fields, durable=True)
        got = c.claim("p", "train", batch_size=4, fields=["input_ids"], timeout=0)
        c.clear("p", got.sample_ids[:1])
        assert c._streams().ack("p", "train", c._lease(got), None) == 3  # the cleared one is not acked
    with engine() as eng, connect(eng) as c:
        snapshot.restore(c.transport, None, journal=jdir)
        assert c.consumption("p", "train")["acked"] == 3
        rest = c.claim("p", "train", batch_size=7, min_batch=1, fields=["input_ids"], timeout=0)
        assert not set(rest.sample_ids) & set(got.sample_ids)  # nothing handed to the task twice


@pytest.mark.parametrize("path,body", [
    ("claim", {"task": "t", "batch_size": 1, "current_version": 2**70, "max_staleness": 0}),
    ("claim", {"task": "t", "batch_size": 1, "current_version": 0, "max_staleness": 2**70}),
    ("ack", {"task": "t", "lease": 2**64}),
])
def test_numbers_past_64_bits_in_the_http_api_are_422_not_500(path, body):
    settings = ServiceSettings(api_token="tok", max_request_bytes=1 << 20)
    http = TestClient(build_api(ServiceState(settings, default_registry(), MemoryTransport())),
                      base_url="http://rlplane.test")
    got = http.post(f"/v1/partitions/p/{path}", json=body, headers={"Authorization": "Bearer tok"})
    assert got.status_code == 422, got.text
