"""Malformed input never gets a 5xx: hypothesis mutates valid envelopes and JSON bodies
and sends them to the in-process API (FastAPI TestClient over a MemoryTransport)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings, strategies as st

from rlplane import PackedTensor, default_registry
from rlplane.codec import encode
from rlplane.envelope import CONTENT_TYPE, pack
from rlplane.transports import MemoryTransport
from rlplane_service.api import ServiceState, build_api
from rlplane_service.settings import ServiceSettings

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def http():
    """The API over a MemoryTransport, with a real consumption ledger served on loopback for the claim endpoints."""
    from rlplane.streams import DirectStreams
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60), host="127.0.0.1", name="ledger").start()
    store = MemoryTransport()
    store.streams = DirectStreams({"endpoint": server.endpoint}, timeout=10)
    app = build_api(ServiceState(ServiceSettings(api_token=TOKEN, max_request_bytes=1 << 20), default_registry(), store))
    try:
        yield TestClient(app, base_url="http://rlplane.test", raise_server_exceptions=False)
    finally:
        store.streams.close()
        server.stop()


def _valid_body() -> bytes:
    reg = default_registry()
    fields = {"input_ids": torch.arange(12).reshape(2, 6), "input_lengths": torch.tensor([6, 3]),
              "pixel_values": PackedTensor([torch.randn(2, 4), None])}
    enc = encode(reg, fields, torch.tensor([6, 3]), sample_ids=["a", "b"])
    return bytes(pack({"sample_ids": ["a", "b"], "tags": list(enc.tags)}, enc.columns))


VALID = _valid_body()
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
)


def _mutate(body: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(body)
    for kind, at, value in edits:
        at = min(at, len(out))
        if kind == "flip" and at < len(out):
            out[at] ^= value
        elif kind == "cut":
            del out[at:]
        else:
            out[at:at] = bytes([value])
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(mutation, min_size=1, max_size=4), create=st.booleans())
def test_mutated_envelopes_never_get_a_5xx(http, edits, create):
    body = _mutate(VALID, edits)
    r = http.post("/v1/data/fuzz/put", params={"create": str(create).lower()}, content=body,
                  headers={**AUTH, "Content-Type": CONTENT_TYPE})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert "error" in r.json()
    http.delete("/v1/partitions/fuzz", headers=AUTH)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
ENDPOINTS = [
    ("POST", "/v1/data/fuzz/get", {"sample_ids": ["a"], "fields": ["input_ids"]}),
    ("POST", "/v1/partitions/fuzz/clear", {"sample_ids": ["a"]}),
    ("POST", "/v1/partitions/fuzz/claim", {"task": "t", "batch_size": 2, "fields": ["input_ids"]}),
    ("POST", "/v1/partitions/fuzz/ack", {"task": "t", "lease": 1}),
    ("POST", "/v1/metrics/report", {"events": [{"op": "put_samples", "transport": "tq", "seconds": 0.1,
                                                "nbytes": 1, "error": None}]}),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, len(ENDPOINTS) - 1), key=st.text(max_size=12), value=json_values, drop=st.booleans())
def test_mutated_json_bodies_never_get_a_5xx(http, which, key, value, drop):
    method, path, body = ENDPOINTS[which]
    body = dict(body)
    target = key if drop or not body else list(body)[len(key) % len(body)]
    if drop:
        body.pop(target, None)
    else:
        body[target] = value
    r = http.request(method, path, content=json.dumps(body, allow_nan=True), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_garbage_json_never_gets_a_5xx(http, raw):
    r = http.post("/v1/data/fuzz/get", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code < 500, r.text


def test_an_infinite_number_is_a_422_naming_the_field_not_a_500(http):
    r = http.post("/v1/data/fuzz/get", content='{"sample_ids": Infinity, "fields": ["input_ids"]}',
                  headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "InvalidArgumentError" and "sample_ids" in r.json()["message"]
