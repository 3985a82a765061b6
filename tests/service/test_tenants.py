"""Tenants end to end (issue 23): a service with a tokens file; a token for ``job-a:``
cannot list, read, claim, write or clear ``job-b:`` over HTTP nor over the native engine
(where its credential is its own, handed out by /v1/transport)."""

from __future__ import annotations

import httpx
import pytest
import torch

import rlplane
from rlplane import errors as E

TOKEN = "tenants-test-token"

A, READER = "token-of-job-a-0123456", "token-of-a-reader-789"
FILE = f"""
tokens:
  - {{name: job-a, token: "{A}", prefixes: ["job-a:"]}}
  - {{name: reader, token: "{READER}", prefixes: ["job-a:"], access: read}}
"""
FIELDS = {"input_ids": torch.arange(24).reshape(3, 8), "input_lengths": torch.tensor([8, 5, 2])}
WANT = FIELDS["input_ids"] * (torch.arange(8) < FIELDS["input_lengths"][:, None])


@pytest.fixture(scope="module")
def url(own_app, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tokens.yaml"
    path.write_text(FILE)
    args = {"store_name": "tenants", "storage_units": 2, "unit_bytes": 64 << 20, "api_token": TOKEN,
            "tokens_file": str(path)}
    with own_app(args, "/ten") as u:
        yield u


@pytest.mark.parametrize("transport", ["http", "native"])
def test_a_tenant_token_reaches_its_own_partitions_only(url, transport):
    admin = rlplane.connect(url, token=TOKEN, transport=transport, timeout=30)
    a = rlplane.connect(url, token=A, transport=transport, timeout=30)
    reader = rlplane.connect(url, token=READER, transport=transport, timeout=30)
    try:
        assert a.transport.name == transport
        if transport == "native":
            assert set(a.transport.paths().values()) == {"zmq"}  # its own credential, never a slab mapping
        other = admin.put_samples(f"job-b:{transport}", FIELDS)
        mine = a.put_samples(f"job-a:{transport}", FIELDS)
        assert torch.equal(a.read_columns(mine, ["input_ids"])["input_ids"], WANT)
        assert f"job-b:{transport}" not in a.partitions() and f"job-a:{transport}" in a.partitions()
        assert {f"job-a:{transport}", f"job-b:{transport}"} <= set(admin.partitions())
        for attempt in (lambda c: c.put_samples(f"job-b:{transport}-new", FIELDS),
                        lambda c: c.read_columns(other, ["input_ids"]),
                        lambda c: c.clear(f"job-b:{transport}"),
                        lambda c: c.claim(f"job-b:{transport}", "train", batch_size=1, fields=["input_ids"], timeout=0)):
            with pytest.raises(E.ForbiddenError):
                attempt(a)
        assert torch.equal(reader.read_columns(mine, ["input_ids"])["input_ids"], WANT)
        batch = reader.claim(f"job-a:{transport}", "eval", batch_size=3, fields=["input_ids"], timeout=10)
        assert reader.ack(batch, "eval") == 3
        with pytest.raises(E.ForbiddenError, match="read-only"):
            reader.put_samples(f"job-a:{transport}-2", FIELDS)
        assert torch.equal(admin.read_columns(other, ["input_ids"])["input_ids"], WANT)  # untouched
        assert a.clear(f"job-a:{transport}") == 3 and admin.clear(f"job-b:{transport}") == 3
    finally:
        for c in (admin, a, reader):
            c.close()


def test_http_answers_403_out_of_scope_and_401_without_a_known_token(url):
    with httpx.Client(base_url=url, timeout=10) as http:
        r = http.get("/v1/partitions/job-b:x", headers={"Authorization": f"Bearer {A}"})
        assert r.status_code == 403 and r.json()["error"] == "ForbiddenError"
        assert http.get("/v1/partitions", headers={"Authorization": "Bearer not-a-token"}).status_code == 401
        described = http.get("/v1/transport", headers={"Authorization": f"Bearer {A}"}).json()
        assert described["native"]["user"] == "job-a" and A not in str(described)  # a credential, not the token
