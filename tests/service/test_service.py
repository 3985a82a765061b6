"""The live service: a real Ray Serve app over real TransferQueue storage units.

One embedded service per test session (see tests/conftest.py); every test uses its own
partition names.
"""

import json
import subprocess
import sys
import textwrap
import time
import uuid

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E
from rlplane.codec import encode
from rlplane.envelope import CONTENT_TYPE, pack
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step



def part() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def vlm():
    return vlm_step(64, 256, sides=(4, 8))  # the reference batch's samples and fields, a few MB of them


@pytest.mark.parametrize("transport", ["direct", "http"])
def test_a_client_reusing_its_encode_buffers_never_changes_what_it_stored(live, transport):
    with rlplane.connect(live.url, token=live.token, transport=transport) as client:
        metas = [client.put_samples(part(), vlm_step(4, 64, seed=seed).fields) for seed in (1, 2)]
        for meta, seed in zip(metas, (1, 2)):
            w = vlm_step(4, 64, seed=seed)
            got = client.read_columns(meta, list(w.fields))
            assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
            client.clear(meta.partition)


def test_auto_picks_the_direct_path_when_the_store_is_reachable(live):
    with rlplane.connect(live.url, token=live.token) as client:
        assert client.transport.name == live.direct


PLAIN = textwrap.dedent(
    """
    import json, sys, torch, rlplane
    url, token, transport, partition = sys.argv[1:5]
    client = rlplane.connect(url, token=token, transport=transport)
    fields = {"input_ids": torch.arange(12).reshape(3, 4), "input_lengths": torch.tensor([4, 2, 3]),
              "pixel_values": rlplane.PackedTensor([torch.ones(2, 1176), None, torch.zeros(1, 1176)])}
    meta = client.put_samples(partition, fields)
    got = client.read_columns(meta, ["input_ids", "pixel_values"], pad_to_seqlen=4)
    ok = torch.equal(got["input_ids"], fields["input_ids"] * (torch.arange(4) < fields["input_lengths"][:, None]))
    ok = ok and torch.equal(got["pixel_values"].as_tensor().float(), fields["pixel_values"].as_tensor())
    ray = sys.modules.get("ray")
    print(json.dumps({"ok": bool(ok), "transport": client.transport.name,
                      "ray_initialized": bool(ray and ray.is_initialized()), "meta": meta.to_dict()}))
    """
)


@pytest.mark.parametrize("transport", ["direct", "http"])
def test_a_plain_process_with_only_url_and_token_can_put_and_read(live, transport, tmp_path):
    p = part()
    res = subprocess.run([sys.executable, "-c", PLAIN, live.url, live.token, transport, p],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {**out, "ok": True, "transport": live.direct if transport == "direct" else transport, "ray_initialized": False}
    # ...and what it wrote is there for this process to read
    with rlplane.connect(live.url, token=live.token) as client:
        meta = rlplane.SampleMeta.from_dict(out["meta"])
        assert client.read_columns(meta, ["input_lengths"])["input_lengths"].tolist() == [4, 2, 3]


def test_a_raw_http_put_that_fails_validation_is_a_4xx_naming_the_field(live):
    enc = encode(rlplane.default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4])
    body = pack({"sample_ids": ["a"], "tags": list(enc.tags)}, {"input_idz": enc.columns["input_ids"]})
    p = part()
    r = httpx.post(f"{live.url}/v1/data/{p}/put", content=body,
                   headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {live.token}"}, timeout=30)
    assert r.status_code == 422 and r.json()["field"] == "input_idz"
    r = httpx.get(f"{live.url}/v1/partitions/{p}", headers={"Authorization": f"Bearer {live.token}"})
    assert r.status_code == 404


def test_v1_without_the_token_is_401_health_is_open(live):
    assert httpx.get(f"{live.url}/healthz").status_code == 200
    ready = httpx.get(f"{live.url}/readyz").json()
    assert ready["status"] == "ready" and all(ready["components"].values())
    assert ("mooncake_master" in ready["components"]) == (live.backend == "mooncake")
    r = httpx.get(f"{live.url}/v1/registry")
    assert r.status_code == 401 and r.json()["error"] == "AuthenticationError"
    with pytest.raises(E.AuthenticationError):
        rlplane.connect(live.url, token="wrong")
    assert httpx.get(f"{live.url}/docs").status_code == 200


def test_a_client_of_another_release_is_refused_naming_both_releases(service, monkeypatch):
    theirs = rlplane.__version__
    monkeypatch.setattr(rlplane, "__version__", "9.9.9")  # this process plays a client of another release
    with pytest.raises(E.VersionMismatchError) as err:
        rlplane.connect(service.url, token=service.settings.token(), transport="http")
    assert f"runs rlplane {theirs}; this client is rlplane 9.9.9" in str(err.value)
    assert f"pip install rlplane=={theirs}" in str(err.value)
    from rlplane.connect import same_release

    with pytest.raises(E.VersionMismatchError, match="an older rlplane that does not say its version"):
        same_release(service.url, None)  # what a service from before versions were published answers
    same_release(service.url, "9.9.9")  # the same release goes on


def test_control_plane_status_and_stage_fields(live):
    headers = {"Authorization": f"Bearer {live.token}"}
    with rlplane.connect(live.url, token=live.token) as client:
        p = part()
        client.put_samples(p, vlm_step(4, 64).fields)
        st = httpx.get(f"{live.url}/v1/status", headers=headers).json()
        mine = [x for x in st["partitions"] if x["partition"] == p]
        assert st["store"]["storage_units"] == 2 and mine[0]["num_samples"] == 4 and mine[0]["nbytes"] > 0
        stage = httpx.get(f"{live.url}/v1/registry/stages/train", params={"partition": p}, headers=headers).json()
        assert stage["fields"] == client.fields_for_stage("train", p)
        assert "pixel_values" in stage["fields"]
        tr = httpx.get(f"{live.url}/v1/transport", headers=headers).json()
        direct = tr[live.direct]
        assert tr["backend"] == live.backend and len(direct["storage_units"]) == 2
        controller = direct["controller"] if live.backend == "native" else f"tcp://{direct['controller']['ip']}:0"
        assert controller.startswith("tcp://127.0.0.1:")
        client.clear(p)


def _replica_handles(app):
    import ray

    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


@pytest.mark.parametrize("live", ["native", "mooncake"], indirect=True)  # (simple re-attaches as mooncake does)
def test_a_replica_restart_keeps_every_sample(live, vlm):
    """...and every task's consumption: acked stays acked, a lease taken before still acks."""
    import ray

    with rlplane.connect(live.url, token=live.token, transport="direct") as client:
        p = part()
        meta = client.put_samples(p, vlm.fields)
        client.ack(client.claim(p, "train", batch_size=8, fields=["input_ids"], timeout=5), "train")
        held = client.claim(p, "train", batch_size=8, fields=["input_ids"], timeout=5)
    (replica,) = _replica_handles(live.app)
    ray.kill(replica, no_restart=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Serve notices, starts a new replica, which re-attaches
        try:
            handles = _replica_handles(live.app)
            if handles and handles[0] != replica and httpx.get(f"{live.url}/readyz", timeout=5).status_code == 200:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    else:
        pytest.fail("no new replica became ready within 120 s")
    with rlplane.connect(live.url, token=live.token, transport="http") as client:
        got = client.read_columns(meta, list(vlm.fields))
        assert diff_fields(client.registry, vlm.fields, got, vlm.lengths, sample_ids=meta.sample_ids) == []
        c = client.consumption(p, "train")
        assert (c["acked"], c["claimed"]) == (8, 8)
        assert client.ack(held, "train") == 8
        assert client.claim(p, "train", batch_size=8, fields=["input_ids"], timeout=5).sample_ids == meta.sample_ids[16:24]
        client.clear(p)


@pytest.fixture(scope="module")
def small_app(service, tmp_path_factory):
    """A second app in the same cluster: no token, a 1 MiB body limit, an extra field from a YAML file."""
    from ray import serve

    from rlplane_service.app import build_app

    reg = tmp_path_factory.mktemp("reg") / "fields.yaml"
    reg.write_text("fields:\n  - {name: reward_model_score, alignment: sample, container: dense, stages: [train], dtype: float32}\n")
    args = {"store_name": "small", "storage_units": 1, "max_request_bytes": 1 << 20, "registry_file": str(reg)}
    serve.run(build_app(args), name="rlplane-small", route_prefix="/small")
    try:
        yield f"{service.url}/small"
    finally:
        serve.delete("rlplane-small")


def test_registry_extension_file_adds_a_field(small_app):
    with rlplane.connect(small_app) as client:
        meta = client.put_samples(part(), {"reward_model_score": torch.tensor([0.5, 1.5])})
        assert client.read_columns(meta, ["reward_model_score"])["reward_model_score"].tolist() == [0.5, 1.5]


def test_http_body_over_the_limit_is_413(small_app):
    with rlplane.connect(small_app, transport="http") as client:
        p = part()
        big = {"input_ids": torch.ones(4, 70_000, dtype=torch.int64), "input_lengths": torch.full((4,), 70_000)}
        with pytest.raises(E.PayloadTooLargeError):
            client.put_samples(p, big)
        assert p not in client.partitions()


def test_concurrent_puts_of_the_same_new_ids_have_one_winner_on_every_backend(live):
    """TransferQueue's own check is check-then-create (two writers both 'succeeded', the last
    one's rows won); on simple and mooncake the store's ledger arbitrates new ids."""
    import threading

    clients = [rlplane.connect(live.url, token=live.token, transport=live.direct) for _ in range(8)]
    try:
        for rep in range(5):
            p, ids = part(), [f"s{i}" for i in range(8)]
            barrier = threading.Barrier(8)
            outcome: dict[int, object] = {}

            def put(k: int) -> None:
                barrier.wait(timeout=30)
                try:
                    clients[k].put_samples(p, {"input_ids": torch.full((8, 4), k), "input_lengths": torch.full((8,), 4)},
                                           sample_ids=ids)
                    outcome[k] = "ok"
                except E.DuplicateSampleError as err:
                    outcome[k] = err

            threads = [threading.Thread(target=put, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            winners = [k for k, v in outcome.items() if v == "ok"]
            assert len(outcome) == 8 and len(winners) == 1, (rep, outcome)
            got = clients[0].read_columns(rlplane.SampleMeta(p, ids, [4] * 8), ["input_ids"])["input_ids"]
            assert torch.equal(got, torch.full((8, 4), winners[0])), "a loser's rows won"
            assert clients[0].clear(p) == 8
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("backend", ["simple_service", "mooncake_service"])
def test_ids_a_killed_writer_left_in_transferqueue_are_written_again_by_the_retry(request, backend):
    """A writer killed inside a put on TransferQueue leaves its ids there without data
    (TransferQueue creates the ids before the bytes land) and never records them with the
    store's ledger. The retry with the same ids must store them, not refuse them as
    duplicates; ids that were written stay refused."""
    live = request.getfixturevalue(backend)
    with rlplane.connect(live.url, token=live.token, transport="tq") as client:
        p = f"ghost-{uuid.uuid4().hex[:8]}"
        client.transport._client.kv_retrieve_meta(["g0", "g1"], p, create=True)  # what the killed writer left
        fields = {"input_ids": torch.arange(16, dtype=torch.int64).reshape(2, 8), "input_lengths": torch.tensor([8, 8])}
        meta = client.put_samples(p, fields, sample_ids=["g0", "g1"])
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], fields["input_ids"])
        with pytest.raises(E.DuplicateSampleError):
            client.put_samples(p, fields, sample_ids=["g1", "g2"])
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], fields["input_ids"])
        client.clear(p)


def _slowed(client, seconds: float) -> None:
    """Make this client's TransferQueue writes land ``seconds`` late (ids and tags already taken)."""
    import asyncio

    write = client.transport._client.async_put

    async def late(*args, **kwargs):
        await asyncio.sleep(seconds)
        return await write(*args, **kwargs)

    client.transport._client.async_put = late


@pytest.mark.parametrize("backend", ["simple_service"])  # (the TransferQueue layer both share; one backend each)
def test_a_clear_racing_a_write_of_its_partition_never_changes_another_partition(request, backend):
    """TransferQueue hands a cleared sample's storage slots to the next put of any partition:
    a put (or write_columns) still under way into them landed in that put's rows (an
    IntegrityError for its reader, or worse). A clear now waits for the writes of its samples."""
    import threading

    live = request.getfixturevalue(backend)
    p, q = part(), part()
    with rlplane.connect(live.url, token=live.token, transport="tq") as a, \
            rlplane.connect(live.url, token=live.token, transport="tq") as b:
        a.put_samples(p, {"sample_mask": torch.zeros(1)}, sample_ids=["old"])
        stored = a.put_samples(f"{p}-w", {"sample_mask": torch.zeros(2), "input_lengths": torch.tensor([4, 4])},
                               sample_ids=["w0", "w1"])
        _slowed(a, 1.5)
        rounds = [(p, lambda: a.put_samples(p, {"sample_mask": torch.full((2,), 7.0)}, sample_ids=["p0", "p1"])),
                  (f"{p}-w", lambda: a.write_columns(stored, {"advantages": torch.ones(2, 4)}))]
        for target, write in rounds:
            done: list = []
            writer = threading.Thread(target=lambda: done.append(write()))
            writer.start()
            time.sleep(0.7)  # the writer holds its samples' storage slots; its bytes are not there yet
            cleared = b.clear(target)  # waits for the write: it clears what the write stored too
            mine = b.put_samples(q, {"sample_mask": torch.tensor([1.0, 2.0, 3.0])})
            writer.join(timeout=60)
            assert done and cleared == (3 if target == p else 2)
            assert torch.equal(b.read_columns(mine, ["sample_mask"])["sample_mask"], torch.tensor([1.0, 2.0, 3.0]))
            assert target not in b.partitions()
            b.clear(q)


@pytest.mark.parametrize("backend", ["simple_service"])  # (the TransferQueue layer both share; one backend each)
def test_a_read_that_raced_a_clear_whose_storage_went_to_another_put_says_the_samples_are_gone(request, backend):
    """It read the other put's rows, and said the stored copy was damaged (IntegrityError)."""
    import asyncio
    import threading

    live = request.getfixturevalue(backend)
    p, q = part(), part()
    with rlplane.connect(live.url, token=live.token, transport="tq") as a, \
            rlplane.connect(live.url, token=live.token, transport="tq") as b:
        meta = a.put_samples(p, {"sample_mask": torch.tensor([7.0, 8.0])})
        get = a.transport._client.async_get_data

        async def late(*args, **kwargs):
            await asyncio.sleep(1.5)
            return await get(*args, **kwargs)

        a.transport._client.async_get_data = late
        outcome: list = []

        def read() -> None:
            try:
                outcome.append(a.read_columns(meta, ["sample_mask"]))
            except E.RlplaneError as err:
                outcome.append(err)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.5)
        b.clear(p)
        mine = b.put_samples(q, {"sample_mask": torch.tensor([1.0, 2.0])})
        reader.join(timeout=60)
        # (TransferQueue itself says so when the slots were not yet reused; the digests, when they were)
        assert isinstance(outcome[0], E.MissingDataError) and "cleared" in str(outcome[0]), outcome
        assert torch.equal(b.read_columns(mine, ["sample_mask"])["sample_mask"], torch.tensor([1.0, 2.0]))
        b.clear(q)


def test_over_http_a_read_that_raced_a_clear_and_got_another_puts_rows_says_the_samples_are_gone(simple_service):
    """Over HTTP the client could not ask whether the samples it read were replaced
    meanwhile: such a read said the stored copy was damaged (IntegrityError). It asks the
    service for their tags alone now, naming the incarnations it read. (The race is made
    here: the read's answer is held back while the samples are cleared and put again, and
    comes back with rows that fail their digests, as the other put's do.)"""
    live = simple_service
    p = part()
    with rlplane.connect(live.url, token=live.token, transport="http") as a, \
            rlplane.connect(live.url, token=live.token, transport="http") as b:
        meta = a.put_samples(p, {"sample_mask": torch.tensor([7.0, 8.0])})
        get, again = a.transport.get, []

        def damaged(*args, **kwargs):
            columns, tags = get(*args, **kwargs)
            columns["sample_mask"].values.view(torch.uint8)[0] ^= 1
            return columns, tags

        def raced(*args, **kwargs):
            got = damaged(*args, **kwargs)
            b.clear(p)
            again.append(b.put_samples(p, {"sample_mask": torch.tensor([1.0, 2.0])}, sample_ids=meta.sample_ids))
            return got

        a.transport.get = raced
        with pytest.raises(E.MissingDataError, match="cleared"):
            a.read_columns(meta, ["sample_mask"])
        a.transport.get = damaged  # the same damage where nothing was replaced is damage
        with pytest.raises(E.IntegrityError):
            a.read_columns(again[0], ["sample_mask"])
        b.clear(p)


@pytest.mark.parametrize("backend", ["mooncake_service"])  # (the TransferQueue layer both share; one backend each)
def test_two_writes_of_different_fields_of_the_same_samples_at_once_keep_both(request, backend):
    """TransferQueue replaces a sample's whole tag map: of two write_columns at once, the
    slower one's tags dropped the other's field (its reads then said the field was never
    written). Writes of the same samples now take turns."""
    import threading

    live = request.getfixturevalue(backend)
    p = part()
    with rlplane.connect(live.url, token=live.token, transport="tq") as a, \
            rlplane.connect(live.url, token=live.token, transport="tq") as b:
        meta = a.put_samples(p, {"input_ids": torch.ones(2, 4, dtype=torch.int64),
                                 "input_lengths": torch.tensor([4, 4])})
        _slowed(a, 1.5)
        first = threading.Thread(target=a.write_columns, args=(meta, {"advantages": torch.full((2, 4), 0.5)}))
        first.start()
        time.sleep(0.5)
        b.write_columns(meta, {"prev_logprobs": torch.full((2, 4), -1.0)})
        first.join(timeout=60)
        got = b.read_columns(meta, ["advantages", "prev_logprobs"])
        assert torch.equal(got["advantages"], torch.full((2, 4), 0.5))
        assert torch.equal(got["prev_logprobs"], torch.full((2, 4), -1.0))
        assert b.clear(p, [meta.sample_ids[0], meta.sample_ids[0]]) == 1  # an id named twice clears once
        b.clear(p)


@pytest.mark.parametrize("transport", ["direct", "http"])
def test_a_hundred_connected_clients_cost_at_most_twice_one(service, transport):
    """Clients of one process with one URL and token share their HTTP and engine
    connections: a hundred hold at most twice the descriptors of one, plus 8 (the
    default backend; the sharing under test is the client's)."""
    import gc
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def use(client, p: str) -> None:
        w = vlm_step(2, 64, seed=3, sides=(2, 4))  # images of a few patches: what is measured is connections, not bytes
        meta = client.put_samples(p, w.fields)
        assert diff_fields(client.registry, w.fields, client.read_columns(meta, list(w.fields)), w.lengths,
                           sample_ids=meta.sample_ids) == []

    def settled() -> int:  # descriptors once closed sockets are given back (ZMQ's reaper, ours)
        last, deadline = fds(), time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.6)
            if fds() == last:
                break
            last = fds()
        return last

    url, token = service.url, service.settings.token()
    p = part()
    with rlplane.connect(url, token=token, transport=transport) as warm:  # the process's ZMQ context and threads
        use(warm, p)
    gc.collect()
    base = settled()  # no client holds a connection now
    first = rlplane.connect(url, token=token, transport=transport)
    use(first, p + "-0")
    one = fds() - base  # its channels or HTTP connection, the slab mappings
    clients = [first] + [rlplane.connect(url, token=token, transport=transport) for _ in range(99)]
    for k, c in enumerate(clients[1:], 1):
        use(c, f"{p}-{k}")
    held = fds() - base
    print(f"{transport}: one client {one} descriptors, 100 clients {held}")
    assert one >= 1 and held <= 2 * one + 8, (held, one)
    for c in clients[1:]:
        c.close()
    use(first, p + "-after")  # the others' close left its connections working
    for k in range(100):
        first.clear(f"{p}-{k}")
    first.clear(p + "-after")
    first.clear(p)
    first.close()


def test_an_embedded_service_that_cannot_start_leaves_the_processs_own_ray_up(service):
    """A start in a process whose Ray was already up (a notebook's) failed at ray.init, and
    the failure's cleanup shut that Ray down, taking its actors and objects with it."""
    import ray

    from rlplane_service.embedded import EmbeddedService
    from rlplane_service.net import free_port
    from rlplane_service.settings import ServiceSettings

    assert ray.is_initialized()  # (the session's service runs in this process)
    mine = ray.put("the caller's object")
    with pytest.raises(RuntimeError):
        EmbeddedService(ServiceSettings(port=free_port())).start()
    assert ray.is_initialized() and ray.get(mine) == "the caller's object"
    assert httpx.get(f"{service.url}/healthz", timeout=10).status_code == 200
