"""Snapshots under the live service: ``rlplane snapshot --to`` and ``Client.snapshot`` while
the store serves, then a new store of another size started with RLPLANE_RESTORE_FROM
serves every sample bit for bit and every task's consumption; the TransferQueue-based
backends refuse with a clear error."""

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

    args = {"store_name": "snap-dst", "backend": "native", "storage_units": 3, "unit_bytes": 64 << 20,
            "restore_from": str(tmp_path / "by-client")}
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


def test_a_snapshot_never_overwrites_and_the_tq_backends_refuse_snapshots(source, simple_service, tmp_path):
    with rlplane.connect(source) as c:
        c.put_samples(f"t-{uuid.uuid4().hex[:6]}", text_step(4, 16, seed=1).fields)
        c.snapshot(str(tmp_path / "s"))
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            c.snapshot(str(tmp_path / "s"))
    with rlplane.connect(simple_service.url, token=simple_service.token, transport="http") as c:
        with pytest.raises(E.InvalidArgumentError, match="native backend"):
            c.snapshot(str(tmp_path / "tq"))


def test_after_every_engine_process_is_killed_a_new_store_replays_the_journal_before_it_is_ready(own_app, tmp_path):
    """RLPLANE_JOURNAL_DIR under the live service: durable puts and acks, every unit's
    process SIGKILLed and the controller killed for good; a new store of another size on
    the same journal directory serves all of it, bit for bit, once /readyz says ready."""
    import ray

    jdir = tmp_path / "journal"
    src = {"store_name": "jr-src", "backend": "native", "storage_units": 2, "unit_bytes": 64 << 20,
           "journal_dir": str(jdir), "journal_flush_ms": 20}
    p = f"vlm-{uuid.uuid4().hex[:6]}"
    with own_app(src, "/jr-src") as url:
        with rlplane.connect(url) as c:
            vlm = vlm_step(6, 128, seed=31)
            mv = c.put_samples(p, vlm.fields, durable=True)
            acked = c.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=0)
            c.ack(acked, "train")
            c.put_samples(p + "-t", text_step(8, 16, seed=32).fields, durable=True)  # fsyncs the ack's group too
        units = [ray.get_actor(f"jr-src-native-unit-{i}", namespace="rlplane") for i in range(2)]
        pids = [int(ray.get(u.info.remote(), timeout=60)["pid"]) for u in units]
        for pid in pids:
            os.kill(pid, 9)
        ray.kill(ray.get_actor("jr-src-native-controller", namespace="rlplane"), no_restart=True)
    dst = {**src, "store_name": "jr-dst", "storage_units": 3}
    with own_app(dst, "/jr-dst") as url:
        assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200
        with rlplane.connect(url) as r:
            assert sorted(r.partitions()) == sorted([p, p + "-t"])
            got = r.read_columns(mv, list(vlm.fields))
            assert diff_fields(r.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []
            assert r.consumption(p, "train")["acked"] == 4
            r.put_samples(p + "-new", text_step(2, 16, seed=33).fields, durable=True)  # the new store journals on


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
