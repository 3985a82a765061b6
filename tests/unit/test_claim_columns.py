"""A claim's answer as columns: the native ledger sends each field's wire geometry and each
sample's user tags (``g``, ``user``) to a client that asks for them, instead of a tag map
per sample; the meta a client builds from either form is the same."""

from dataclasses import replace

import pytest

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.claims import ClaimRequest
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step
from rlplane.transports.native import NativeTransport
from rlplane_service.ledger import Ledger, SimpleIndexes
from rlplane_service.native.local import LocalEngine

SECRET = b"unit-test-secret"
FIELDS = ["input_ids", "input_lengths", "token_mask"]


@pytest.fixture(scope="module")
def client():
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        c = Client(default_registry(), NativeTransport({"controller": eng.server.endpoint, "secret": SECRET.decode()},
                                                       timeout=30))
        yield c
        c.close()


def _both(c: Client, p: str, n: int, **kw):
    """The same samples claimed by two tasks: answered as columns, and as a tag map each."""
    req = ClaimRequest.build(c.registry, p, "cols", n, timeout=0, **kw)
    cols = c.transport.streams.claim(replace(req, columnar=True))
    maps = c.transport.streams.claim(replace(req, task="maps"))
    return cols, maps


def test_a_claim_asked_as_columns_is_answered_so_and_its_meta_is_the_tag_maps_one(client):
    w = text_step(batch=8, seqlen=32, seed=1)
    user = [{"group_id": i // 4, "note": "x" * i} if i % 3 else {} for i in range(8)]
    put = client.put_samples("cols", {k: w.fields[k] for k in FIELDS}, tags=user)
    cols, maps = _both(client, "cols", 8, fields=["input_ids"])
    assert "tags" not in cols and set(cols["g"]) == set(FIELDS) and [u or {} for u in cols["user"]] == user
    assert "g" not in maps and len(maps["tags"]) == 8
    (a_tags, a_len), (b_tags, b_len) = client._claimed(cols), client._claimed(maps)
    assert a_len == b_len == put.lengths == w.lengths.tolist()
    assert [a_tags[i] for i in range(8)] == [b_tags[i] for i in range(8)]
    assert [t["group_id"] for t in a_tags if "group_id" in t] == [u["group_id"] for u in user if u]
    meta = client.claim("cols", "read", batch_size=8, fields=["input_ids"], timeout=0)
    got = client.read_columns(meta, FIELDS, layout="padded")
    assert diff_fields(client.registry, {k: w.fields[k] for k in FIELDS}, got, w.lengths,
                       sample_ids=meta.sample_ids) == []
    assert client.ack(meta, "read") == 8


def test_samples_that_hold_different_fields_are_answered_as_tag_maps(client):
    w = text_step(batch=4, seqlen=16, seed=2)
    put = client.put_samples("mixed", {k: w.fields[k] for k in FIELDS}, sample_ids=["a", "b", "c", "d"])
    client.write_columns(put.subset([1, 3]), {"advantages": w.fields["advantages"][[1, 3]]})
    cols, maps = _both(client, "mixed", 4, fields=["input_ids"])
    assert "g" not in cols and [("advantages" in t["_rlplane_wire"]) for t in cols["tags"]] == [False, True, False, True]
    (a_tags, a_len), (b_tags, b_len) = client._claimed(cols), client._claimed(maps)
    assert a_len == b_len == w.lengths.tolist() and list(a_tags) == list(b_tags)


def test_the_columns_flag_crosses_the_wire_and_must_be_a_bool():
    req = ClaimRequest("p", "train", 4, ("input_ids",), 0.0, 4, columnar=True)
    assert ClaimRequest.parse({"op": "claim", **req.to_header()}) == req
    with pytest.raises(E.WireFormatError, match="cols"):
        ClaimRequest.parse({**req.to_header(), "cols": "yes"})


def test_a_ledger_over_an_index_without_columns_answers_tag_maps():
    idx = SimpleIndexes()
    led = Ledger(idx.get, lease_s=60.0)
    idx.record("p", ["a", "b"], ["input_ids"], [{"_rlplane_wire": {"input_ids": [3]}}, {"x": 1}], create=True)
    got = led.claim(ClaimRequest("p", "t", 2, ("input_ids",), 0.0, 2, columnar=True), final=True)
    assert "g" not in got and got["tags"][1] == {"x": 1}


@pytest.mark.parametrize("lie", [{"g": [1, 2]}, {"g": {"input_ids": {"n": 3, "l": None, "k": None, "t": [[]]}}},
                                 {"g": {}, "user": [None]}])
def test_a_malformed_column_answer_is_a_wire_format_error(client, lie):
    reply = {"lease": 1, "lease_s": 1.0, "ids": ["a", "b"], "fields": [], "user": None, **lie}
    with pytest.raises(E.WireFormatError):
        client._claimed(reply)
