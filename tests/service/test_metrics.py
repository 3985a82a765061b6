"""GET /metrics of the live service: counters move by exactly what a known put/read did,
on both backends and both transports, and the dashboard queries only what is exported."""

import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rlplane
from rlplane import errors as E
from rlplane.codec import encode
from rlplane_service.metrics import SCRAPE_TTL_S
from scraping import scrape, scrape_text, value

ROOT = Path(__file__).resolve().parents[2]


def batch(n: int = 3):
    return {
        "input_ids": torch.arange(n * 8, dtype=torch.int64).reshape(n, 8),
        "input_lengths": torch.tensor([8, 5, 2][:n]),
        "pixel_values": rlplane.PackedTensor([torch.ones(2, 1176), None, torch.zeros(1, 1176)][:n]),
    }


@pytest.mark.parametrize("transport", ["direct", "http"])
def test_counters_move_by_exactly_what_a_put_and_a_read_did(live, transport):
    p = f"m-{uuid.uuid4().hex[:8]}"
    fields = batch()
    nbytes = encode(rlplane.default_registry(), fields, fields["input_lengths"]).nbytes
    before = scrape(live.url)
    with rlplane.connect(live.url, token=live.token, transport=transport) as client:
        meta = client.put_samples(p, fields)
        client.read_columns(meta, list(fields))
        with pytest.raises(E.MissingDataError):
            client.read_columns(meta, ["prev_logprobs"])
        ops = client.stats()["ops"]
    after = scrape(live.url)  # the client reported its tq ops when it closed

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    t = live.direct if transport == "direct" else transport
    assert delta("rlplane_ops_total", op="put_samples", transport=t, status="ok") == 1
    assert delta("rlplane_ops_total", op="read_columns", transport=t, status="ok") == 1
    assert delta("rlplane_ops_total", op="read_columns", transport=t, status="error") == 1
    assert delta("rlplane_errors_total", op="read_columns", type="MissingDataError") == 1
    assert delta("rlplane_transferred_bytes_total", op="put_samples", transport=t, direction="in") == nbytes
    assert delta("rlplane_transferred_bytes_total", op="read_columns", transport=t, direction="out") == nbytes
    assert delta("rlplane_op_duration_seconds_count", op="put_samples", transport=t) == 1
    assert delta("rlplane_op_duration_seconds_bucket", op="read_columns", transport=t, le="+Inf") == 2
    assert value(after, "rlplane_partition_samples", partition=p) == 3
    assert value(after, "rlplane_partition_bytes", partition=p) == nbytes
    # ...and the client's own view, for the trainer's logger
    assert ops["put_samples"]["count"] == 1 and ops["put_samples"]["bytes"] == nbytes
    assert ops["read_columns"] == {**ops["read_columns"], "count": 2, "errors": 1, "bytes": nbytes}
    assert 0 < ops["read_columns"]["p50_s"] <= ops["read_columns"]["p90_s"]

    with rlplane.connect(live.url, token=live.token, transport=transport) as client:
        client.clear(p)
    gone = scrape(live.url)
    assert ("rlplane_partition_samples", (("partition", p),)) not in gone
    assert value(gone, "rlplane_ops_total", op="delete_partition", transport=t, status="ok") - value(
        after, "rlplane_ops_total", op="delete_partition", transport=t, status="ok"
    ) == 1


def test_store_gauges_add_up(live):
    p = f"m-{uuid.uuid4().hex[:8]}"
    with rlplane.connect(live.url, token=live.token) as client:
        client.put_samples(p, batch())
        s = scrape(live.url)
        client.clear(p)
    parts = [k for k in s if k[0] == "rlplane_partition_samples"]
    assert value(s, "rlplane_partitions") == len(parts) >= 1
    assert value(s, "rlplane_stored_samples") == sum(s[k] for k in parts)
    units = {dict(k[1])["unit"]: v for k, v in s.items() if k[0] == "rlplane_storage_unit_up"}
    assert len(units) == 2 and set(units.values()) == {1.0}
    if live.backend in ("simple", "native"):  # per-unit counts are exact (one put: a sample's rows on one unit)
        held = sum(v for k, v in s.items() if k[0] == "rlplane_storage_unit_samples")
        assert held == value(s, "rlplane_stored_samples")
        assert sum(v for k, v in s.items() if k[0] == "rlplane_storage_unit_bytes") == value(s, "rlplane_stored_bytes")
    else:
        assert value(s, "rlplane_mooncake_master_up") == 1
        assert value(s, "rlplane_mooncake_capacity_bytes") == 2 * (1 << 30)
        assert value(s, "rlplane_mooncake_allocated_bytes") > 0
    assert value(s, "rlplane_build_info", version=rlplane.__version__, backend=live.backend) == 1


@pytest.mark.parametrize("writer", ["direct", "http"])
def test_bytes_written_stored_and_shared_of_a_grpo_batch_in_stats_status_and_metrics(service, writer):
    """A GRPO batch (8 groups of 8 sharing their images) on the native store, put directly
    or over HTTP: the client's stats (direct and HTTP), /v1/status and /metrics all say that
    seven eighths of its pixel bytes were written but not stored; over HTTP each image
    crosses once each way, and reads back bit for bit."""
    from rlplane.testing.verify import diff_fields
    from rlplane.testing.workloads import vlm_grpo

    url, token = service.url, service.settings.token()
    headers = {"Authorization": f"Bearer {token}"}
    w = vlm_grpo(batch=16, seqlen=64, seed=5)
    pixels = sum(t.numel() * 2 for row in w.fields["pixel_values"].rows if row is not None for t in row)  # bf16
    with rlplane.connect(url, token=token) as direct, rlplane.connect(url, token=token, transport="http") as http:
        before = direct.stats()["sharing"]
        meta = (http if writer == "http" else direct).put_samples(f"m-{uuid.uuid4().hex[:8]}", w.fields)
        if writer == "http":
            assert http.ops.last("put_samples").nbytes < 0.25 * pixels  # (the images once, not eight times)
            got = http.read_columns(meta, ["pixel_values", "input_ids"])
            assert http.ops.last("read_columns").nbytes < 0.25 * pixels
            assert diff_fields(http.registry, {k: w.fields[k] for k in ("pixel_values", "input_ids")}, got,
                               w.lengths, sample_ids=meta.sample_ids) == []
        after = direct.stats()["sharing"]
        assert http.stats()["sharing"] == after == httpx.get(f"{url}/v1/status", headers=headers,
                                                            timeout=30).json()["sharing"]
        shared = after["shared_bytes"] - before["shared_bytes"]
        assert 0.85 * pixels <= shared <= pixels  # 7/8 of the pixels (and of the image grids) not stored again
        assert after["written_bytes"] - after["stored_bytes"] == after["shared_bytes"]
        time.sleep(SCRAPE_TTL_S + 0.1)  # (a scrape is reused for SCRAPE_TTL_S)
        assert value(scrape(url), "rlplane_shared_bytes") == after["shared_bytes"]
        direct.clear(meta.partition)
        assert direct.stats()["sharing"] == before


def exported_after_traffic(url: str, token: str) -> set[str]:
    """Metric names with at least one sample after a put, a failed read and a claim (a
    family with no sample would satisfy a name check without data)."""
    p = f"m-{uuid.uuid4().hex[:8]}"
    with rlplane.connect(url, token=token) as client:
        meta = client.put_samples(p, batch())
        with pytest.raises(E.MissingDataError):
            client.read_columns(meta, ["prev_logprobs"])
        client.claim(p, "metrics", batch_size=1, fields=["input_ids"], timeout=5)
    names = set()
    for family in text_string_to_metric_families(scrape_text(url)):
        if family.samples:
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    with rlplane.connect(url, token=token) as client:
        client.clear(p)
    return names


def test_every_metric_the_dashboard_and_rules_query_is_exported(service, simple_service, mooncake_service):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "deploy"))
    from promql import METRICS, dashboard_metric_names

    native = exported_after_traffic(service.url, service.settings.token())
    simple = exported_after_traffic(simple_service.url, simple_service.token)
    mooncake = exported_after_traffic(mooncake_service.url, mooncake_service.token)
    assert not any(name.startswith("rlplane_mooncake_") for name in native | simple)
    for names in (native, simple):
        assert "rlplane_storage_unit_samples" in names
    assert "rlplane_storage_unit_samples" not in mooncake  # Mooncake places values itself, see store_view
    assert native | simple | mooncake == set(METRICS)
    assert dashboard_metric_names(ROOT / "deploy" / "grafana" / "rlplane.json") <= native | simple | mooncake


@pytest.fixture(scope="module")
def two_replicas(service):
    """An app with two Serve replicas over one store (no token)."""
    from ray import serve

    from rlplane_service.app import RlplaneService

    serve.run(RlplaneService.options(num_replicas=2).bind({"store_name": "two", "storage_units": 1}),
              name="rlplane-two", route_prefix="/two")
    try:
        yield f"{service.url}/two"
    finally:
        serve.delete("rlplane-two")


def test_every_replica_reports_the_same_counts(two_replicas):
    """Ops are counted in one ledger per store, not per replica: however Serve spreads the
    puts and the scrapes over the two replicas, every scrape sees all of them."""
    p = f"m-{uuid.uuid4().hex[:8]}"
    before = value(scrape(two_replicas), "rlplane_ops_total", op="put_samples", transport="http", status="ok")
    with rlplane.connect(two_replicas, transport="http") as client:
        for i in range(6):
            client.put_samples(p, batch(1), sample_ids=[f"s{i}"])
    seen = {value(scrape(two_replicas), "rlplane_ops_total", op="put_samples", transport="http", status="ok") - before
            for _ in range(10)}
    assert seen == {6}
    with rlplane.connect(two_replicas, transport="http") as client:
        client.clear(p)


def test_a_scrape_is_reused_for_a_second_and_then_shows_what_happened(live):
    """Scrapes within SCRAPE_TTL_S of each other share one store read (a flood of them
    costs the store nothing more); one made after it shows the ops in between."""
    with rlplane.connect(live.url, token=live.token, transport="http") as client:
        client.put_samples(f"m-{uuid.uuid4().hex[:8]}", batch(1))  # (the counter below exists from here on)
        shared = 0
        for _ in range(5):
            time.sleep(SCRAPE_TTL_S)  # the first scrape below reads the store afresh, after `sent`
            sent = time.monotonic()
            first = httpx.get(f"{live.url}/metrics", timeout=30).text
            client.put_samples(f"m-{uuid.uuid4().hex[:8]}", batch(1))
            second = httpx.get(f"{live.url}/metrics", timeout=30).text
            if time.monotonic() - sent < SCRAPE_TTL_S:  # both answered within one TTL: one body
                assert second == first
                shared += 1
                break  # (more tries only for a machine too slow to answer twice within one TTL)
        assert shared, "no two scrapes ran within one TTL on this machine"
        counted = "rlplane_ops_total{op=\"put_samples\",status=\"ok\",transport=\"http\"}"
        before = next(line for line in first.splitlines() if line.startswith(counted))
        time.sleep(SCRAPE_TTL_S)  # past the TTL of the scrapes above
        after = next(line for line in scrape_text(live.url).splitlines() if line.startswith(counted))
        assert float(after.split()[-1]) > float(before.split()[-1])
