"""The HTTP API and the HTTP transport, in process: FastAPI's TestClient over a MemoryTransport.

The same app runs inside the Ray Serve replica (tests/service exercise that); here the
status codes, the typed errors that come back and the all-or-nothing writes are pinned
in milliseconds.
"""

import time

import pytest
import torch
from fastapi.testclient import TestClient

from rlplane import Client, PackedTensor, default_registry
from rlplane import errors as E
from rlplane.codec import encode
from rlplane.envelope import CONTENT_TYPE, pack
from rlplane.http_api import ServiceAPI
from rlplane.transports import MemoryTransport
from rlplane.transports.http import HttpTransport
from rlplane_service.api import ServiceState, build_api
from rlplane_service.settings import ServiceSettings

TOKEN = "t0ken"


@pytest.fixture
def served():
    store = MemoryTransport()
    settings = ServiceSettings(api_token=TOKEN, max_request_bytes=1 << 20)
    app = build_api(ServiceState(settings, default_registry(), store))
    http = TestClient(app, base_url="http://rlplane.test")
    api = ServiceAPI("http://rlplane.test", token=TOKEN, http=http)
    return store, http, Client(default_registry(), HttpTransport(api), service=api)


def batch(n=3, s=8):
    lens = torch.tensor([s, s // 2, 1][:n])
    return {
        "input_ids": torch.arange(n * s).reshape(n, s),
        "input_lengths": lens,
        "pixel_values": PackedTensor([torch.randn(4, 1176), None, [torch.randn(2, 1176), torch.randn(1, 1176)]][:n]),
        "image_grid_thw": PackedTensor([torch.tensor([[1, 2, 2]]), None, torch.tensor([[1, 1, 2], [1, 1, 1]])][:n]),
    }


def test_http_round_trip_is_bit_exact(served):
    _, _, client = served
    fields = batch()
    meta = client.put_samples("p", fields)
    got = client.read_columns(meta, list(fields), layout="jagged")
    assert torch.equal(got["pixel_values"].as_tensor().float(), fields["pixel_values"].as_tensor().bfloat16().float())
    assert [r.tolist() for r in got["input_ids"].unbind()] == [r[:n].tolist() for r, n in zip(fields["input_ids"], [8, 4, 1])]
    assert client.stats()["partitions"]["p"]["num_samples"] == 3


def test_v1_needs_the_token_and_health_does_not(served):
    _, http, _ = served
    bare = TestClient(http.app, base_url="http://rlplane.test")
    assert bare.get("/healthz").status_code == 200
    r = bare.get("/v1/registry")
    assert r.status_code == 401 and r.json()["error"] == "AuthenticationError"
    assert r.headers["www-authenticate"] == "Bearer"
    assert bare.get("/v1/partitions", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with pytest.raises(E.AuthenticationError):
        HttpTransport(ServiceAPI("http://rlplane.test", http=bare)).partitions()


def raw_put(http, partition, columns, tags, ids):
    body = pack({"sample_ids": ids, "tags": list(tags)}, columns)
    return http.post(f"/v1/data/{partition}/put", content=body, headers={"Content-Type": CONTENT_TYPE})


def test_raw_put_of_an_unregistered_field_is_422_naming_it_and_stores_nothing(served):
    store, http, _ = served
    enc = encode(default_registry(), {"input_lengths": torch.tensor([3])}, [3])
    cols = {**enc.columns, "pixel_vals": enc.columns["input_lengths"]}
    r = raw_put(http, "p", cols, enc.tags, ["a"])
    assert r.status_code == 422 and r.json()["error"] == "UnregisteredFieldError" and r.json()["field"] == "pixel_vals"
    assert store.partitions() == []


def test_raw_put_with_the_wrong_dtype_is_422(served):
    store, http, _ = served
    enc = encode(default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4])
    cols = {"input_ids": type(enc.columns["input_ids"])(enc.columns["input_ids"].values.float(), enc.columns["input_ids"].offsets)}
    r = raw_put(http, "p", cols, enc.tags, ["a"])
    assert r.status_code == 422 and r.json()["error"] == "DtypeError" and r.json()["field"] == "input_ids"
    assert store.partitions() == []


def test_raw_put_whose_tokens_disagree_with_input_lengths_is_422(served):
    store, http, _ = served
    fields = {"input_ids": torch.ones(2, 6, dtype=torch.int64), "input_lengths": torch.tensor([6, 2])}
    enc = encode(default_registry(), fields, [6, 2])
    enc.columns["input_lengths"].values[1] = 5  # lengths now say 5, the row holds 2 tokens
    r = raw_put(http, "p", enc.columns, enc.tags, ["a", "b"])
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "input_ids" and r.json()["sample"] == "b"
    assert store.partitions() == []


def test_body_over_the_limit_is_413_and_a_typed_error(served):
    store, _, client = served
    big = {"input_ids": torch.ones(4, 70_000, dtype=torch.int64), "input_lengths": torch.full((4,), 70_000)}
    with pytest.raises(E.PayloadTooLargeError, match="fewer samples"):
        client.put_samples("p", big)
    assert store.partitions() == []


def test_missing_data_comes_back_typed_with_the_samples_named(served):
    _, _, client = served
    meta = client.put_samples("p", batch())
    client.clear("p", [meta.sample_ids[1]])
    with pytest.raises(E.MissingDataError) as err:
        client.read_columns(meta, ["input_ids"])
    assert list(err.value.missing) == [meta.sample_ids[1]]
    with pytest.raises(E.MissingDataError) as err:
        client.read_columns(meta.subset([0]), ["prev_logprobs"])
    assert err.value.missing == {meta.sample_ids[0]: ["prev_logprobs"]}


def test_duplicate_put_is_409_typed(served):
    _, _, client = served
    meta = client.put_samples("p", batch())
    with pytest.raises(E.DuplicateSampleError):
        client.put_samples("p", batch(), sample_ids=meta.sample_ids)


def test_stage_fields_follow_what_the_partition_holds(served):
    _, http, client = served
    client.put_samples("vlm", batch())
    client.put_samples("text", {k: v for k, v in batch().items() if k in ("input_ids", "input_lengths")})
    vlm = http.get("/v1/registry/stages/logprob", params={"partition": "vlm"}).json()["fields"]
    text = http.get("/v1/registry/stages/logprob", params={"partition": "text"}).json()["fields"]
    assert "pixel_values" in vlm and "pixel_values" not in text
    r = http.get("/v1/registry/stages/rollout_typo")
    assert r.status_code == 404 and r.json()["error"] == "UnknownStageError"


def test_partitions_list_detail_delete(served):
    _, http, client = served
    client.put_samples("p", batch())
    listing = http.get("/v1/partitions").json()["partitions"]
    assert listing[0]["partition"] == "p" and listing[0]["num_samples"] == 3 and listing[0]["nbytes"] > 0
    assert len(http.get("/v1/partitions/p").json()["sample_ids"]) == 3
    assert http.delete("/v1/partitions/p").json()["cleared"] == 3
    assert http.get("/v1/partitions/p").status_code == 404


def test_bad_partition_names_are_refused_before_anything_moves(served):
    _, _, client = served
    with pytest.raises(E.InvalidArgumentError, match="partition name"):
        client.put_samples("a/b", batch())


def test_async_twins(served):
    import asyncio

    _, _, client = served

    async def go():
        meta = await client.aput_samples("p", batch())
        got = await client.aread_columns(meta, ["input_ids"])
        return meta, got, await client.apartitions()

    meta, got, parts = asyncio.run(go())
    assert got["input_ids"].shape == (3, 8) and parts == ["p"]


def test_tags_with_non_string_keys_are_refused_and_nothing_is_stored(served):
    store, _, client = served
    with pytest.raises(E.ShapeError, match="tag keys must be strings"):
        client.put_samples("p", batch(), tags=[{1: "x"}, {}, {}])
    assert store.partitions() == []


@pytest.mark.parametrize("geometry", [7, [], ["a"], [-1], {"d": 0}, [1, 2**62, 4], [3, 2**32, 2**32], [2**64 - 1]])
def test_raw_put_with_malformed_geometry_is_422_not_500(served, geometry):
    store, http, _ = served
    enc = encode(default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4])
    tags = [{"_rlplane_wire": {"input_ids": geometry}}]
    r = raw_put(http, "p", enc.columns, tags, ["a"])
    assert r.status_code == 422 and r.json()["error"] == "WireFormatError" and r.json()["field"] == "input_ids"
    assert store.partitions() == []


def test_settings_come_from_rlplane_env_and_args_win(monkeypatch):
    monkeypatch.setenv("RLPLANE_STORAGE_UNITS", "4")
    monkeypatch.setenv("RLPLANE_API_TOKEN", "")
    assert ServiceSettings().storage_units == 4 and ServiceSettings().api_token is None
    assert ServiceSettings(storage_units=3).storage_units == 3
    with pytest.raises(ValueError):
        ServiceSettings(storage_unitz=3)


def test_metrics_count_http_ops_and_reported_tq_ops_in_process(served):
    from prometheus_client.parser import text_string_to_metric_families

    _, http, client = served
    fields = batch()
    meta = client.put_samples("p", fields)
    with pytest.raises(E.MissingDataError):
        client.read_columns(meta, ["prev_logprobs"])
    report = {"events": [{"op": "read_columns", "transport": "tq", "seconds": 0.2, "nbytes": 7, "error": None}]}
    bare = TestClient(http.app, base_url="http://rlplane.test")
    assert bare.post("/v1/metrics/report", json=report).status_code == 401  # reports need the token; /metrics does not
    assert http.post("/v1/metrics/report", json=report).json() == {"received": 1}
    text = bare.get("/metrics").text
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    nbytes = encode(default_registry(), fields, fields["input_lengths"]).nbytes
    assert got[("rlplane_ops_total", (("op", "put_samples"), ("status", "ok"), ("transport", "http")))] == 1
    assert got[("rlplane_ops_total", (("op", "read_columns"), ("status", "error"), ("transport", "http")))] == 1
    assert got[("rlplane_transferred_bytes_total", (("direction", "in"), ("op", "put_samples"), ("transport", "http")))] == nbytes
    assert got[("rlplane_transferred_bytes_total", (("direction", "out"), ("op", "read_columns"), ("transport", "tq")))] == 7
    assert got[("rlplane_op_duration_seconds_bucket", (("le", "0.25"), ("op", "read_columns"), ("transport", "tq")))] == 1
    assert got[("rlplane_op_duration_seconds_bucket", (("le", "0.1"), ("op", "read_columns"), ("transport", "tq")))] == 0
    assert got[("rlplane_errors_total", (("op", "read_columns"), ("type", "MissingDataError")))] == 1
    assert got[("rlplane_partition_samples", (("partition", "p"),))] == 3
    assert got[("rlplane_partition_bytes", (("partition", "p"),))] == nbytes


def _asgi(app, path, headers, body_len):
    """One raw ASGI request whose body must never be read; returns (status, receive calls)."""
    import asyncio

    calls, sent = [], []

    async def receive():
        calls.append(1)
        return {"type": "http.request", "body": b"x" * 10, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-length", str(body_len).encode()), *headers], "http_version": "1.1",
             "scheme": "http", "server": ("rlplane.test", 80), "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], len(calls)


def test_the_token_and_the_size_limit_are_checked_before_any_body_is_read(served):
    _, http, _ = served
    app = http.app
    status, reads = _asgi(app, "/v1/data/p/get", [], 256 << 20)
    assert (status, reads) == (401, 0)
    status, reads = _asgi(app, "/v1/data/p/put", [(b"authorization", b"Bearer wrong")], 10)
    assert (status, reads) == (401, 0)
    status, reads = _asgi(app, "/v1/data/p/put", [(b"authorization", f"Bearer {TOKEN}".encode())], 256 << 20)
    assert (status, reads) == (413, 0)


@pytest.mark.parametrize("dtype", [7, None, ["int64"], {"a": 1}])
def test_a_column_dtype_that_is_not_a_name_is_a_422_not_a_500(served, dtype):
    import struct

    import msgpack

    _, http, _ = served
    enc = encode(default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4])
    body = bytearray(pack({"sample_ids": ["a"], "tags": list(enc.tags)}, enc.columns))
    # rewrite the column's dtype in the msgpack header, keeping the rest of the body
    magic, version, head_len = struct.unpack_from("<4sIQ", body)
    head = msgpack.unpackb(bytes(body[16 : 16 + head_len]), raw=False)
    head["c"][0][1] = dtype
    new_head = msgpack.packb(head, use_bin_type=True)
    start = 16 + len(new_head)
    pad = (-start) % 64
    old_start = 16 + head_len
    rest = body[old_start + ((-old_start) % 64):]
    new_body = struct.pack("<4sIQ", magic, version, len(new_head)) + new_head + bytes(pad) + bytes(rest)
    r = http.post("/v1/data/p/put", content=new_body,
                  headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["error"] == "WireFormatError"


def test_the_service_refuses_a_partition_name_the_client_would_refuse(served):
    _, http, _ = served
    enc = encode(default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4])
    body = pack({"sample_ids": ["a"], "tags": list(enc.tags)}, enc.columns)
    r = http.post("/v1/data/bad%20name%21/put", content=body,
                  headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and r.json()["error"] == "InvalidArgumentError"
    assert http.get("/v1/partitions", headers={"Authorization": f"Bearer {TOKEN}"}).json()["partitions"] == []


def _raw_put(app, path, chunks, length):
    """One raw ASGI put whose body arrives as ``chunks``, declaring ``length`` bytes (None:
    no Content-Length, as a chunked body); returns (status, the answer's JSON)."""
    import asyncio
    import json

    pieces, sent = list(chunks), []

    async def receive():
        body = pieces.pop(0) if pieces else b""
        return {"type": "http.request", "body": body, "more_body": bool(pieces)}

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", CONTENT_TYPE.encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("rlplane.test", 80),
             "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def _ids_body(ids, values):
    enc = encode(default_registry(), {"input_ids": values}, [values.shape[1]] * values.shape[0])
    return bytes(pack({"sample_ids": ids, "tags": list(enc.tags)}, enc.columns))


def test_a_put_body_lands_in_pooled_memory_reused_by_the_next_and_each_put_reads_back_bit_exact():
    from rlplane.readpool import ReadPool

    store = MemoryTransport()
    app = build_api(ServiceState(ServiceSettings(api_token=TOKEN, max_request_bytes=16 << 20), default_registry(), store))
    client = Client(default_registry(), HttpTransport(ServiceAPI(
        "http://rlplane.test", token=TOKEN, http=TestClient(app, base_url="http://rlplane.test"))))
    pool = ReadPool.shared()
    batches = [torch.randint(0, 1 << 40, (2, 200_000)) for _ in range(3)]  # 3.2 MB bodies: pooled
    reused = pool.reused
    metas = [client.put_samples(f"p{k}", {"input_ids": b, "input_lengths": torch.tensor([200_000] * 2)})
             for k, b in enumerate(batches)]
    assert pool.reused >= reused + 2  # the second and third bodies landed where the first did
    for meta, b in zip(metas, batches):
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], b)


@pytest.mark.parametrize("declared", ["shorter", "longer", "none"])
def test_a_body_of_another_length_than_it_declares_is_422_and_nothing_is_stored(served, declared):
    store, http, _ = served
    body = _ids_body(["a"], torch.ones(1, 4, dtype=torch.int64))
    length = {"shorter": len(body) - 1, "longer": len(body) + 10, "none": None}[declared]
    status, answer = _raw_put(http.app, "/v1/data/p/put", [body[:50], body[50:]], length)
    if length is None:  # a chunked body: no length to hold it to
        assert status == 200 and store.describe("p").sample_ids == ["a"]
    else:
        assert (status, answer["error"]) == (422, "WireFormatError") and f"{length} bytes" in answer["message"]
        assert "p" not in store.partitions()


def _answering(body: bytes, length: str | None) -> ServiceAPI:
    """A ServiceAPI whose every call is answered 200 with ``body``, declaring Content-Length
    ``length`` (None: no length)."""
    import httpx

    def handler(request):
        headers = {"content-length": length} if length is not None else {}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))

    return ServiceAPI("http://rlplane.test", http=httpx.Client(transport=httpx.MockTransport(handler),
                                                                base_url="http://rlplane.test"))


def test_an_answer_is_read_whole_into_memory_of_the_read_pool_or_refused_when_its_length_lies():
    import numpy as np

    from rlplane.readpool import ReadPool

    body = bytes(range(256)) * (8 << 10)  # 2 MiB: from the pool (not plain numpy memory)
    got = _answering(body, str(len(body))).read_into("POST", "/v1/data/p/get")
    assert isinstance(got, np.ndarray) and got.tobytes() == body and got.flags.writeable
    assert ReadPool.shared().fresh + ReadPool.shared().reused >= 1
    assert _answering(b"abcd", None).read_into("POST", "/x") == bytearray(b"abcd")  # no length: grown
    with pytest.raises(E.TransportError, match="ended after 50 of 100 bytes"):
        _answering(b"x" * 50, "100").read_into("POST", "/x")
    with pytest.raises(E.TransportError, match="longer than the 100 bytes it declared"):
        _answering(b"x" * 150, "100").read_into("POST", "/x")


def test_shared_rows_a_store_keeps_every_copy_of_are_bounded_by_the_request_limit(served):
    """A small body naming one image for many samples must not make a service whose store
    keeps every copy allocate them all: past max_request_bytes copied out, it is 413 and
    nothing is stored; under it, every sample reads its image back."""
    store, _, client = served
    img = torch.randn(64, 1176)  # 150 KB as bf16: one copy fits the 1 MiB limit, 16 of them do not
    many = {"input_ids": torch.ones(16, 4, dtype=torch.int64), "input_lengths": torch.full((16,), 4),
            "pixel_values": PackedTensor([img] * 16)}
    with pytest.raises(E.PayloadTooLargeError, match="copied out"):
        client.put_samples("shared", many)
    assert "shared" not in store.partitions()
    few = {k: (v[:4] if not isinstance(v, PackedTensor) else PackedTensor([img] * 4)) for k, v in many.items()}
    meta = client.put_samples("shared", few)
    assert client.ops.last("put_samples").nbytes < 64 * 1176 * 2 * 2  # the image crossed once
    got = client.read_columns(meta, ["pixel_values"])["pixel_values"]
    assert all(torch.equal(got[i][0], img.bfloat16()) for i in range(4))


@pytest.mark.parametrize("tag", [{"k": {1: 2}}, {"k": b"\xff"}, {"_rlplane_x": 1}, {"_rlplane_wire": 5}],
                         ids=["nested-int-key", "bytes", "reserved-key", "reserved-wire-not-a-map"])
def test_raw_writes_with_tags_no_store_can_keep_are_422_and_change_nothing(served, tag):
    """A put, and a tag-only write of stored samples: 422 naming the sample, before anything
    is stored (a bytes tag once made every later claim of the sample a 500 over JSON, a
    wire tag of 5 every later aligned write)."""
    store, http, client = served
    enc = encode(default_registry(), {"input_ids": torch.ones(1, 4, dtype=torch.int64)}, [4], sample_ids=["a"])
    r = raw_put(http, "p", enc.columns, [{**enc.tags[0], **tag}], ["a"])
    assert r.status_code == 422 and r.json()["error"] == "ShapeError" and r.json()["sample"] == "a", r.text
    assert store.partitions() == []
    meta = client.put_samples("p", {"input_ids": torch.ones(1, 4, dtype=torch.int64), "input_lengths": torch.tensor([4])},
                              sample_ids=["a"], tags=[{"group": 1}])
    body = pack({"sample_ids": ["a"], "tags": [tag]}, {})
    r = http.post("/v1/data/p/put?create=false", content=body, headers={"Content-Type": CONTENT_TYPE})
    assert r.status_code == 422 and r.json()["sample"] == "a", r.text
    assert client.write_columns(meta, {"prev_logprobs": torch.zeros(1, 4)})  # the stored tags as they were
    assert store.get("p", ["a"], ["input_ids"])[1][0]["group"] == 1


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/data/p/get", {"sample_ids": ["\ud800"], "fields": ["input_ids"]}),
    ("/v1/data/p/get", {"sample_ids": ["a"], "fields": ["\ud800"]}),
    ("/v1/data/p/get", {"sample_ids": ["a"] * 2000, "fields": ["input_ids"]}),
    ("/v1/data/p/get", {"sample_ids": ["a"], "fields": ["input_ids", "input_ids"]}),
    ("/v1/partitions/p/clear", {"sample_ids": ["\ud800"]}),
    ("/v1/partitions/p/nack", {"task": "t", "lease": 1, "sample_ids": ["\ud800"]}),
    ("/v1/partitions/p/claim", {"task": "\ud800", "batch_size": 1}),
], ids=["id-surrogate", "field-surrogate", "id-2000-times", "field-twice", "clear-surrogate", "nack-surrogate",
        "claim-task-surrogate"])
def test_json_requests_naming_what_no_store_can_answer_are_422_and_change_nothing(served, path, body):
    """A lone surrogate (valid JSON) was a 500 (msgpack or the answer's JSON could not carry
    it); a read naming one sample 2000 times answered 2000 copies of it (a 10 KB request for
    1000 MiB)."""
    store, http, client = served
    import json

    meta = client.put_samples("p", batch(1), sample_ids=["a"])
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})  # (escaped: "\\ud800")
    assert r.status_code == 422 and r.json()["error"] == "InvalidArgumentError", r.text
    got = client.read_columns(meta, ["input_ids"])
    assert torch.equal(got["input_ids"], batch(1)["input_ids"]) and store.partitions() == ["p"]


def test_a_put_sharing_rows_of_a_field_that_keeps_each_row_is_422_before_anything_is_copied_out(served):
    """A 0.2 MB body naming one 64 KiB token row for 1000 samples (Column.same): the service's
    check decoded it, copying the row out for each sample (a 0.7 MB body: 2 GB) before any
    size check; only media fields share rows."""
    import numpy as np

    from rlplane.column import Column

    store, http, _ = served
    n, row = 1000, 8 * 1024
    col = Column(torch.arange(row, dtype=torch.int64), torch.tensor([0] + [row] * n, dtype=torch.int64),
                 same=np.array([-1] + [0] * (n - 1), np.int64))
    r = raw_put(http, "p", {"input_ids": col}, [{"_rlplane_wire": {"input_ids": [row]}}] * n, [f"s{i}" for i in range(n)])
    assert r.status_code == 422 and r.json()["error"] == "WireFormatError" and r.json()["field"] == "input_ids", r.text
    assert "shares" in r.json()["message"] and store.partitions() == []


def test_a_chunked_body_over_the_limit_is_413_while_it_streams_and_changes_nothing(served):
    """The limit was checked against the declared length only: a JSON body sent chunked
    (no Content-Length) was read whole whatever its size (77 MiB against a 1 MiB limit)."""
    import json

    store, http, client = served
    client.put_samples("p", batch(1), sample_ids=["a"])
    ids = json.dumps({"sample_ids": ["a"] + [f"x{i:07d}" for i in range(200_000)]}).encode()  # ~2.4 MB
    assert len(ids) > 2 << 20

    def chunks():
        for k in range(0, len(ids), 64 << 10):
            yield ids[k : k + (64 << 10)]

    r = http.post("/v1/partitions/p/clear", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "PayloadTooLargeError"
    assert store.describe("p").num_samples == 1
    small = json.dumps({"sample_ids": ["a"]}).encode()
    r = http.post("/v1/partitions/p/clear", content=iter([small]), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["cleared"] == 1  # a chunked body under the limit goes through


def test_a_read_naming_40000_ids_one_of_them_twice_is_refused_at_once(served):
    """The duplicate check counted each id over the whole list (quadratic, on the event
    loop): 40k ids took 17 s and the service answered nothing else meanwhile."""
    import json
    import time

    _, http, _ = served
    ids = [f"s{i}" for i in range(40_000)] + ["s7"]
    t0 = time.monotonic()
    r = http.post("/v1/data/p/get", content=json.dumps({"sample_ids": ids, "fields": ["input_ids"]}),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "'s7'" in r.json()["message"] and time.monotonic() - t0 < 5


def test_an_http_claim_of_samples_whose_tags_json_cannot_carry_gives_its_batch_back():
    """Tags an earlier release stored (NaN, bytes: its Client took any msgpack value, and the
    engine still takes them back from snapshots and journals) made every HTTP claim of the
    samples a 500, after the ledger had leased them to nobody."""
    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    with LocalEngine(1, secret=b"claim-json-secret", slab_bytes=16 << 20) as eng:
        info = {**eng.info, "backend": "native", "streams": dict(eng.info)}
        transport = NativeTransport(info, timeout=10)
        try:
            app = build_api(ServiceState(ServiceSettings(api_token=TOKEN), default_registry(), transport,
                                         transport_info=info))
            http = TestClient(app, base_url="http://rlplane.test", headers={"Authorization": f"Bearer {TOKEN}"})
            enc = encode(default_registry(), {"input_ids": torch.arange(8).reshape(2, 4),
                                              "input_lengths": torch.tensor([4, 3])}, [4, 3], sample_ids=["a", "b"])
            old = enc.tags.with_user([{"reward": float("nan")}, {"raw": b"\xff"}])  # (straight to the engine)
            transport.put("p", ["a", "b"], enc.columns, old, create=True)
            r = http.post("/v1/partitions/p/claim", json={"task": "t", "batch_size": 2, "fields": ["input_ids"]})
            assert r.status_code == 422 and r.json()["error"] == "WireFormatError" and "given back" in r.json()["message"]
            state = http.get("/v1/partitions/p/consumption", params={"task": "t"}).json()
            assert state["claimed"] == 0 and state["pending"] == 2
            transport.put("q", ["c"], *_one_sample(), create=True)  # JSON-like tags claim as before
            r = http.post("/v1/partitions/q/claim", json={"task": "t", "batch_size": 1, "fields": ["input_ids"]})
            assert r.status_code == 200 and r.json()["sample_ids"] == ["c"] and r.json()["tags"][0]["group"] == 1
        finally:
            transport.close()


def _one_sample():
    enc = encode(default_registry(), {"input_ids": torch.arange(4).reshape(1, 4), "input_lengths": torch.tensor([4])},
                 [4], sample_ids=["c"])
    return enc.columns, enc.tags.with_user([{"group": 1}])



def test_a_json_body_has_a_limit_of_its_own_far_below_a_data_puts(served):
    """Parsed JSON takes ~40x its bytes: a 7.6 MiB get of 1M ids grew a replica by 311 MiB
    while the data limit (2 GiB) let it through. Every body but a data put's has its own cap."""
    import json

    store, _, _ = served
    settings = ServiceSettings(api_token=TOKEN, max_request_bytes=1 << 20, max_json_bytes=64 << 10)
    http = TestClient(build_api(ServiceState(settings, default_registry(), store)), base_url="http://rlplane.test")
    client = Client(default_registry(), HttpTransport(ServiceAPI("http://rlplane.test", token=TOKEN, http=http)))
    meta = client.put_samples("p", {"input_ids": torch.ones(2, 40_000, dtype=torch.int64),  # 640 kB: a data put
                                    "input_lengths": torch.tensor([40_000, 40_000])})
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    many = json.dumps({"sample_ids": [f"x{i:07d}" for i in range(10_000)], "fields": ["input_ids"]}).encode()
    assert 64 << 10 < len(many) < 1 << 20
    for path in ("/v1/data/p/get", "/v1/partitions/p/clear"):
        r = http.post(path, content=many, headers=auth)
        assert r.status_code == 413 and r.json()["error"] == "PayloadTooLargeError", r.text
        assert "RLPLANE_MAX_JSON_BYTES" in r.json()["message"]
        r = http.post(path, content=iter([many]), headers=auth)  # chunked: counted as it comes
        assert r.status_code == 413, r.text
    assert store.describe("p").num_samples == 2
    got = client.read_columns(meta, ["input_ids"])["input_ids"]
    assert torch.equal(got, torch.ones(2, 40_000, dtype=torch.int64))


def test_a_waiting_claim_whose_caller_leaves_gives_its_batch_back():
    """Serve cancels a handler when its HTTP client disconnects (Ctrl-C, a client timeout):
    the parked claim still leased the batch once samples came, to nobody, for its whole
    lease (300 s). Now the batch is given back as it lands: the same task claims it next."""
    import asyncio

    import httpx

    auth = {"Authorization": f"Bearer {TOKEN}"}
    fields = {"input_ids": torch.arange(16).reshape(2, 8), "input_lengths": torch.tensor([8, 8])}
    body = {"task": "train", "batch_size": 2, "fields": ["input_ids"], "timeout": 20}

    async def run(store, writer):
        app = build_api(ServiceState(ServiceSettings(api_token=TOKEN), default_registry(), store))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlplane.test") as http:
            waiting = asyncio.create_task(http.post("/v1/partitions/p/claim", json=body, headers=auth))
            await asyncio.sleep(0.5)  # parked at the controller
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            meta = await asyncio.to_thread(writer.put_samples, "p", fields)
            start = time.monotonic()
            r = await http.post("/v1/partitions/p/claim", json={**body, "timeout": 10}, headers=auth)
            assert r.status_code == 200, r.text
            assert sorted(r.json()["sample_ids"]) == sorted(meta.sample_ids) and time.monotonic() - start < 10
            r = await http.get("/v1/partitions/p/consumption", params={"task": "train"}, headers=auth)
            assert r.json()["claimed"] == 2 and r.json()["pending"] == 0

    _on_an_engine(run)


def test_past_the_cap_of_waiting_claims_a_claim_asks_once_and_puts_still_go_through(monkeypatch):
    """Each waiting claim takes one of the replica's request slots: trainer ranks waiting on
    claims filled them all and queued the very puts they waited for. Past the cap a claim
    does not wait: it takes what is ready, or is a 408 at once saying why."""
    import asyncio

    import httpx

    from rlplane_service import api as api_mod

    monkeypatch.setattr(api_mod, "MAX_WAITING_CLAIMS", 2)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"task": "train", "batch_size": 2, "fields": ["input_ids"], "timeout": 20}
    fields = {"input_ids": torch.arange(16).reshape(2, 8), "input_lengths": torch.tensor([8, 8])}

    async def run(store, writer):
        app = build_api(ServiceState(ServiceSettings(api_token=TOKEN), default_registry(), store))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlplane.test") as http:
            waiters = [asyncio.create_task(http.post("/v1/partitions/p/claim", json={**body, "task": f"w{k}"},
                                                     headers=auth)) for k in range(2)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            r = await http.post("/v1/partitions/p/claim", json=body, headers=auth)
            assert r.status_code == 408 and "did not wait" in r.json()["message"] and time.monotonic() - t0 < 5
            await asyncio.to_thread(writer.put_samples, "p", fields)
            r = await http.post("/v1/partitions/p/claim", json=body, headers=auth)  # ready: taken at once
            assert r.status_code == 200 and len(r.json()["sample_ids"]) == 2
            assert [w.status_code for w in await asyncio.gather(*waiters)] == [200, 200]  # and theirs came
            r = await http.post("/v1/partitions/q/claim", json={**body, "timeout": 0.5}, headers=auth)
            assert r.status_code == 408 and "did not wait" not in r.json()["message"]  # the waiters are done: it waited

    _on_an_engine(run)


def _on_an_engine(run) -> None:
    """``asyncio.run(run(store, writer))`` with a store (the app's transport) and a writer
    (a client) on one in-process native engine."""
    import asyncio

    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    with LocalEngine(1, secret=None, slab_bytes=16 << 20) as eng:
        store = NativeTransport(dict(eng.info), timeout=10)
        writer = Client(default_registry(), NativeTransport(dict(eng.info), timeout=10))
        try:
            asyncio.run(run(store, writer))
        finally:
            writer.close()
            store.close()
