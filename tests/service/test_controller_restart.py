"""The native controller's process SIGKILLed under a live service (Ray restarts the actor):
clients ride through, every committed sample reads bit for bit, /readyz and /metrics say
what happened, and consumption says its acks were lost."""

import os
import signal
import time
import uuid

import pytest

import rlplane
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step
from scraping import scrape_text

ARGS = {"store_name": "ctl-restart", "backend": "native", "storage_units": 2, "unit_bytes": 256 << 20}


@pytest.fixture(scope="module")
def url(own_app):
    with own_app(ARGS, "/ctl-restart") as url:
        yield url


def controller_pid() -> int:
    import ray

    actor = ray.get_actor(f"{ARGS['store_name']}-native-controller", namespace="rlplane")
    return int(ray.get(actor.info.remote(), timeout=120)["pid"])


def test_a_sigkilled_controller_comes_back_with_every_sample(url, readyz):
    p, q = f"vlm-{uuid.uuid4().hex[:6]}", f"text-{uuid.uuid4().hex[:6]}"
    with rlplane.connect(url, transport="native") as client:
        vlm, text = vlm_step(16, 256, seed=11), text_step(64, 128, seed=12)
        mv, mt = client.put_samples(p, vlm.fields), client.put_samples(q, text.fields)
        client.clear(q, mt.sample_ids[:4])
        client.ack(client.claim(p, "train", batch_size=16, fields=["input_ids"], timeout=0), "train")
        before = client.transport.list()
        pid = controller_pid()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        got = client.read_columns(mv, list(vlm.fields))  # waits for the restarted controller
        rode = time.monotonic() - t0
        assert diff_fields(client.registry, vlm.fields, got, vlm.lengths, sample_ids=mv.sample_ids) == []
        assert rode < 60, rode
        assert controller_pid() != pid
        assert client.transport.list() == before
        kept = list(range(4, 64))
        got = client.read_columns(mt.subset(kept), list(text.fields))
        want = text.select(kept)
        assert diff_fields(client.registry, want.fields, got, want.lengths, sample_ids=want_ids(mt, kept)) == []
        after = client.consumption(p, "train")  # acks are not logged: the task starts over, and is told so
        assert after["controller_restarts"] == 1 and after["acked"] == 0 and after["pending"] == 16
        more = client.put_samples(p, vlm.fields)  # and it takes new puts
        got = client.read_columns(more, list(vlm.fields))
        assert diff_fields(client.registry, vlm.fields, got, vlm.lengths, sample_ids=more.sample_ids) == []
    r = readyz(url, lambda r: r.status_code == 200, within=30)
    assert r.status_code == 200, r.text
    metrics = scrape_text(url)
    assert "rlplane_controller_restarts_total 1.0" in metrics
    seconds = [line for line in metrics.splitlines() if line.startswith("rlplane_controller_rebuild_seconds ")]
    assert seconds and 0 < float(seconds[0].split()[1]) < 30
    records = [line for line in metrics.splitlines() if line.startswith("rlplane_commit_log_records ")]
    assert records and float(records[0].split()[1]) >= 3  # at least the three puts whose samples it still holds


def want_ids(meta, idx):
    return [meta.sample_ids[i] for i in idx]
