"""The Mooncake backend for real: the service's own mooncake_master over TCP on loopback.

The suites in this folder already run every round trip on both backends (the ``live``
fixture); this file pins what only Mooncake can get wrong: shapes of per-sample scalars,
empty rows, a full pool, an unreachable master, and the master's lifetime.
"""

import json
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E
from rlplane.transports.tq import tq_transport
from rlplane.testing.verify import diff_fields


def part() -> str:
    return f"mc-{uuid.uuid4().hex[:8]}"


def transport_info(live) -> dict:
    return httpx.get(f"{live.url}/v1/transport", headers={"Authorization": f"Bearer {live.token}"}, timeout=30).json()["tq"]


@pytest.mark.parametrize("n", [1, 5])
def test_per_sample_scalars_read_back_with_their_own_shape(mooncake_service, n):
    """TransferQueue's schema says (1,) for a (B,) field while KV backends store 0-dim rows,
    so a bare 1-D column would come back (B, 1). rlplane sends every row as 1-D data with
    its true shape in the tags: (B,) stays (B,), for any B, with no per-field rule."""
    fields = {
        "input_ids": torch.arange(n * 4, dtype=torch.int64).reshape(n, 4),
        "input_lengths": torch.arange(1, n + 1, dtype=torch.int64).clamp(max=4),
        "sample_mask": torch.tensor([float(i % 2 == 0) for i in range(n)]),
    }
    with rlplane.connect(mooncake_service.url, token=mooncake_service.token, transport="tq") as client:
        assert client.transport.info["backend"] == "mooncake"
        p = part()
        meta = client.put_samples(p, fields)
        got = client.read_columns(meta, ["input_lengths", "sample_mask"])
        client.clear(p)
    for name in ("input_lengths", "sample_mask"):
        assert got[name].shape == (n,) and got[name].dtype == fields[name].dtype
        assert torch.equal(got[name], fields[name])


def test_empty_rows_round_trip(mooncake_service):
    """Mooncake cannot hold a zero-byte value; a text-only sample in a VLM batch has no
    pixels. The row must come back empty, not as the padding element it travelled as."""
    fields = {
        "input_ids": torch.ones(3, 4, dtype=torch.int64),
        "input_lengths": torch.tensor([4, 4, 4]),
        "pixel_values": rlplane.PackedTensor([None, torch.full((2, 1176), 3.0), None]),
        "image_grid_thw": rlplane.PackedTensor([None, torch.tensor([[1, 2, 1]]), None]),
    }
    with rlplane.connect(mooncake_service.url, token=mooncake_service.token, transport="tq") as client:
        p = part()
        meta = client.put_samples(p, fields)
        got = client.read_columns(meta, list(fields))
        assert diff_fields(client.registry, fields, got, fields["input_lengths"], sample_ids=meta.sample_ids) == []
        empty = client.transport.get(p, meta.sample_ids, ["pixel_values"])[0]["pixel_values"]
        assert empty.row_numels().tolist() == [0, 2 * 1176, 0]
        client.clear(p)


def test_an_unreachable_master_is_a_typed_error_within_seconds(mooncake_service):
    info = transport_info(mooncake_service)
    host = info["mooncake"]["master_address"].rsplit(":", 1)[0]
    from rlplane_service.embedded import free_port

    info["mooncake"]["master_address"] = f"{host}:{free_port(host)}"  # nobody listens there
    start = time.monotonic()
    with pytest.raises(E.TransportError) as err:
        tq_transport(info)
    assert time.monotonic() - start < 10
    assert "Mooncake master" in str(err.value) and "transport='http'" in str(err.value)


@pytest.fixture(scope="module")
def tiny_mooncake(service, pid_alive, ending_store):
    """A third app with a 32 MiB pool and one storage unit, to fill up and to break."""
    from ray import serve

    from rlplane_service.app import build_app

    args = {"store_name": "mc-tiny", "backend": "mooncake", "storage_units": 1, "mooncake_segment_bytes": 32 << 20}
    serve.run(build_app(args), name="rlplane-mc-tiny", route_prefix="/mc-tiny")
    url = f"{service.url}/mc-tiny"
    try:
        yield url
    finally:
        status = httpx.get(f"{url}/v1/status", timeout=30).json()
        serve.delete("rlplane-mc-tiny")
        ending_store(args)  # a test killed its master: attaching would start another
        master = status["store"].get("mooncake_master", {})
        assert master.get("pid") is None or not pid_alive(master["pid"])
        if master.get("log_file"):  # (a master a test killed keeps its log: it ended by itself)
            shutil.rmtree(Path(master["log_file"]).parent, ignore_errors=True)


def test_a_full_pool_is_storage_full_and_keeps_what_was_stored(tiny_mooncake):
    with rlplane.connect(tiny_mooncake, transport="tq") as client:
        kept = part()
        small = {"input_ids": torch.arange(64, dtype=torch.int64).reshape(2, 32), "input_lengths": torch.tensor([32, 32])}
        meta = client.put_samples(kept, small)
        too_big = part()
        big = {"input_ids": torch.ones(8, 1 << 20, dtype=torch.int64), "input_lengths": torch.full((8,), 1 << 20)}
        start = time.monotonic()
        with pytest.raises(E.StorageFullError) as err:
            client.put_samples(too_big, big)
        assert time.monotonic() - start < 15
        assert "RLPLANE_MOONCAKE_SEGMENT_BYTES" in str(err.value)
        assert too_big not in client.partitions()
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], small["input_ids"])
        client.clear(kept)
    with rlplane.connect(tiny_mooncake, transport="http") as client:  # the same, as HTTP 507
        with pytest.raises(E.StorageFullError):
            client.put_samples(part(), big)


def _pool_keys(metrics_url: str) -> int:
    text = httpx.get(metrics_url, timeout=10).text
    return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith("master_key_count"))))


@pytest.mark.parametrize("how", ["partition", "samples", "no field in common"])
def test_deleting_samples_that_hold_different_fields_frees_the_pool(tiny_mooncake, how):
    """TransferQueue's own clear removes only the fields every sample holds: a clear of
    samples by id (or of a partition whose samples share no field) left the rest in the
    pool for good (a mix of image and text samples: their images)."""
    metrics_url = httpx.get(f"{tiny_mooncake}/readyz", timeout=30).json()["mooncake_master"]["metrics_url"]
    base = _pool_keys(metrics_url)
    with rlplane.connect(tiny_mooncake, transport="tq") as client:
        p = part()
        fields = {"input_ids": torch.arange(64, dtype=torch.int64).reshape(2, 32), "input_lengths": torch.tensor([32, 32])}
        meta = client.put_samples(p, fields, sample_ids=["a", "b"])
        client.write_columns(meta.subset([0]), {"advantages": torch.ones(1, 32)})  # 'b' has no advantages
        if how == "no field in common":
            client.put_samples(p, {"sample_mask": torch.ones(1)}, sample_ids=["c"])
        assert _pool_keys(metrics_url) > base
        assert client.clear(p, ["a", "b"] if how == "samples" else None) == (3 if how == "no field in common" else 2)
        assert p not in client.partitions()
    deadline = time.monotonic() + 10
    while _pool_keys(metrics_url) != base and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pool_keys(metrics_url) == base, "the partition's values stayed in the Mooncake pool after its delete"


def test_master_health_shows_in_readyz_and_a_killed_master_actor_takes_its_process(tiny_mooncake, pid_alive, readyz):
    import ray

    ready = httpx.get(f"{tiny_mooncake}/readyz", timeout=30)
    assert ready.status_code == 200 and ready.json()["components"]["mooncake_master"] is True
    metrics_url = ready.json()["mooncake_master"]["metrics_url"]
    assert "master_key_count" in httpx.get(metrics_url, timeout=10).text  # scrapeable as documented
    pid = httpx.get(f"{tiny_mooncake}/v1/status", timeout=30).json()["store"]["mooncake_master"]["pid"]
    assert pid_alive(pid)
    client = rlplane.connect(tiny_mooncake, transport="tq", timeout=60)
    meta = client.put_samples(part(), {"sample_mask": torch.ones(2)})

    ray.kill(ray.get_actor("mc-tiny-mooncake-master", namespace="rlplane"), no_restart=True)  # no chance to clean up
    deadline = time.monotonic() + 20
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(pid), "the master outlived the actor that started it"
    r = readyz(tiny_mooncake, lambda r: r.status_code == 503)
    assert r.status_code == 503 and r.json()["components"]["mooncake_master"] is False
    assert "mooncake_master" in json.dumps(r.json()["reason"])
    try:  # a client's calls name the master within seconds (a read's RPC_FAIL, after Mooncake's own
        # retries of ~15 s: tests/unit/test_tq_errors.py)
        for call in (lambda: client.clear(meta.partition),
                     lambda: client.put_samples(meta.partition, {"sample_mask": torch.ones(2)})):
            t0 = time.monotonic()
            with pytest.raises(E.UnavailableError) as err:
                call()
            assert err.value.component == "mooncake_master" and time.monotonic() - t0 < 10
    finally:
        client.close()  # the put given up on still retries in a thread: closed under it, this process crashed



def test_a_master_port_someone_else_holds_is_a_typed_error_naming_the_log():
    """The master's admin server says "ok" on /health for about a second before the master
    exits over an RPC port it could not bind: start must not call that master ready."""
    import socket

    from rlplane_service.mooncake import MooncakeMaster
    from rlplane_service.net import free_ports
    from rlplane_service.settings import ServiceSettings

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        meta, metrics = free_ports("127.0.0.1", 2)
        settings = ServiceSettings(store_name="mc-taken", mooncake_master_port=taken,
                                   mooncake_metadata_port=meta, mooncake_metrics_port=metrics)
        start = time.monotonic()
        with pytest.raises(E.TransportError) as err:
            MooncakeMaster.start(settings, "127.0.0.1")
        assert time.monotonic() - start < 35
        assert "mooncake_master" in str(err.value) and "mooncake_master.log" in str(err.value)
        named = str(err.value).split("(log ", 1)[1].split(")", 1)[0]
        assert Path(named).is_file()  # the log the error names is kept
        shutil.rmtree(Path(named).parent)
        with socket.create_connection(("127.0.0.1", taken), timeout=5):
            pass  # the holder still has its port


def test_a_chosen_port_taken_before_the_master_binds_it_starts_the_master_on_new_ports(monkeypatch):
    """Free ports are chosen, then bound by the master: another process can take one in
    between. The master that exits over it is started again on newly chosen ports."""
    import socket

    from rlplane_service import mooncake
    from rlplane_service.settings import ServiceSettings

    real = mooncake.free_ports
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        calls = []

        def first_choice_is_taken(host, count):
            calls.append(count)
            ports = real(host, count)
            return [taken, *ports[1:]] if len(calls) == 1 else ports

        monkeypatch.setattr(mooncake, "free_ports", first_choice_is_taken)
        made = []
        mkdtemp = mooncake.tempfile.mkdtemp
        monkeypatch.setattr(mooncake.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
        master = mooncake.MooncakeMaster.start(ServiceSettings(store_name="mc-retry"), "127.0.0.1")
    try:
        assert len(calls) == 2 and len(made) == 2
        assert not master.info()["master_address"].endswith(f":{taken}")
        assert master.healthy()
        assert not Path(made[0]).exists() and Path(made[1]).is_dir()  # the failed attempt's log is gone
    finally:
        master.stop()
    assert not master.healthy()
    assert not Path(made[1]).exists()  # a master stopped leaves no log directory behind


def test_settings_refuse_one_port_for_two_of_the_masters_servers():
    from pydantic import ValidationError

    from rlplane_service.settings import ServiceSettings

    with pytest.raises(ValidationError, match="must differ"):
        ServiceSettings(mooncake_master_port=15000, mooncake_metadata_port=15000)
    ServiceSettings(mooncake_master_port=15000, mooncake_metadata_port=15001)  # different: fine
