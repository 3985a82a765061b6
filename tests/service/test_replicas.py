"""RLPLANE_REPLICAS=2 on the native engine: every block on two storage units, so a killed
unit loses nothing: reads go on bit for bit, puts go on, /readyz says degraded, the store
reports what has one copy left and copies it again to a spare unit (issue 13, "replicas")."""

import time
import uuid

import pytest

import rlplane
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from scraping import scrape_text

TOKEN = "replica-test-token"
ARGS = {"store_name": "rep", "backend": "native", "storage_units": 3, "replicas": 2, "api_token": TOKEN}
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def rep(own_app):
    """An app of its own with three units and two copies of every block, at /rep."""
    with own_app(ARGS, "/rep") as url:
        yield url


def test_a_killed_unit_loses_nothing_with_two_copies_and_its_copies_are_remade(rep, readyz):
    """Kill one unit: nothing is lost, reads go on bit for bit, /readyz says degraded; the
    controller copies what had a copy there to the spare unit, so a second kill loses
    nothing either."""
    import ray

    with rlplane.connect(rep, token=TOKEN, transport="native") as client:
        assert set(client.transport.paths().values()) == {"shm"}  # same host: puts and reads through the slabs
        works = [vlm_step(batch=6, seqlen=64, seed=k) for k in range(6)]
        metas = [client.put_samples(f"r-{uuid.uuid4().hex[:6]}", w.fields) for w in works]
        assert client.transport.stats()["under_replicated_samples"] == 0

        def all_read_back(works, metas):
            for w, meta in zip(works, metas):  # every sample, every field, from the surviving copies
                start = time.monotonic()
                got = client.read_columns(meta, sorted(meta.fields), pad_to_seqlen=64)
                assert time.monotonic() - start < 10
                assert not diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids)

        def until(what, seconds: float = 20.0):
            deadline = time.monotonic() + seconds
            while not what(client.transport.stats()) and time.monotonic() < deadline:
                time.sleep(0.2)
            return client.transport.stats()

        ray.kill(ray.get_actor("rep-native-unit-1", namespace="rlplane"), no_restart=True)
        all_read_back(works, metas)
        stats = until(lambda s: "rep-native-unit-1" in s["lost_units"], 10)  # declared lost within seconds
        assert stats["lost_units"] == ["rep-native-unit-1"] and stats["lost_samples"] == 0
        assert {m.partition for m in metas} <= set(client.partitions())
        more = vlm_step(batch=4, seqlen=64, seed=99)  # puts go on, two copies on the two live units
        meta = client.put_samples(f"r-{uuid.uuid4().hex[:6]}", more.fields)
        works, metas = works + [more], metas + [meta]
        all_read_back(works, metas)
        r = readyz(rep, lambda r: r.status_code == 200 and r.json()["status"] == "degraded")
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert r.json()["components"]["rep-native-unit-1"] is False and "rep-native-unit-1" in r.json()["reason"]

        stats = until(lambda s: s["under_replicated_samples"] == 0)  # re-replicated onto the spare unit
        assert stats["under_replicated_samples"] == 0, stats
        assert stats["units"]["rep-native-unit-1"]["samples"] == 0

        ray.kill(ray.get_actor("rep-native-unit-0", namespace="rlplane"), no_restart=True)
        all_read_back(works, metas)  # a second loss: still nothing lost, everything on the last unit
        stats = until(lambda s: "rep-native-unit-0" in s["lost_units"], 10)
        assert stats["lost_samples"] == 0 and stats["under_replicated_samples"] > 0  # no unit left to copy to
    metrics = scrape_text(rep)  # a body made after the losses above
    assert "rlplane_lost_samples 0.0" in metrics
    assert f"rlplane_under_replicated_samples {float(stats['under_replicated_samples'])}" in metrics
