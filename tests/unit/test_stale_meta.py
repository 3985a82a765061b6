"""A write made with a meta older than its samples (extended since, or cleared and put
again with other lengths) is refused with a ShapeError naming the field and the sample,
and nothing of it is stored: it used to store token rows as long as the old meta said
next to rows of the sample's real length (a trainer then reads prev_logprobs shorter
than input_ids). In one process plus storage units; tests/service runs it over HTTP."""

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"stale-meta-secret"


@pytest.fixture(scope="module")
def client():
    with LocalEngine(2, secret=SECRET, replicas=1) as eng:
        info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
        with Client(default_registry(), NativeTransport(info, timeout=30)) as c:
            yield c


def tokens(lengths: list[int], width: int = 16) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 1000, (len(lengths), width)), "input_lengths": torch.tensor(lengths)}


def test_a_meta_from_before_an_extend_cannot_write_rows_of_its_old_length(client):
    old = client.put_samples("ext", tokens([8, 8, 8]), finished=False)
    new = client.extend(old, tokens([8, 8, 8], width=8), finished=True)
    assert new.lengths == [16, 16, 16]
    with pytest.raises(E.ShapeError, match="8 tokens where the sample holds 16 .input_ids."):  # its only token field
        client.write_columns(old, {"input_ids": torch.randint(0, 9, (3, 8))})
    with pytest.raises(E.ShapeError) as err:
        client.write_columns(old, {"prev_logprobs": torch.randn(3, 8)})
    assert err.value.field == "prev_logprobs" and err.value.sample == old.sample_ids[0]
    assert "8 tokens where the sample holds 16 (input_ids)" in str(err.value) and "3 of the write's 3" in str(err.value)
    assert "prev_logprobs" not in client.transport.describe("ext").fields  # nothing of it stored
    lp = torch.randn(3, 16)
    client.write_columns(new, {"prev_logprobs": lp})  # the current meta writes
    assert torch.equal(client.read_columns(new, ["prev_logprobs"])["prev_logprobs"], lp)


def test_a_meta_of_a_sample_cleared_and_put_again_with_another_length_cannot_write_to_it(client):
    first = client.put_samples("again", tokens([10, 12]), sample_ids=["a", "b"])
    client.clear("again", ["a"])
    w = tokens([9])
    again = client.put_samples("again", w, sample_ids=["a"])
    with pytest.raises(E.ShapeError) as err:
        client.write_columns(first, {"advantages": torch.randn(2, 16)})
    assert err.value.field == "advantages" and err.value.sample == "a" and "1 of the write's 2" in str(err.value)
    got = client.read_columns(again, ["input_ids"])
    assert torch.equal(got["input_ids"][0, :9], w["input_ids"][0, :9])
    assert "advantages" not in client.transport.describe("again").fields
    ok = client.write_columns(first.subset([1]), {"advantages": torch.randn(1, 16)})  # b is as it was
    assert ok.lengths == [12]


def test_token_rows_match_the_samples_stored_length_and_other_fields_are_not_checked(client):
    w = text_step(4, 32, seed=3)
    meta = client.put_samples("fields", w.fields)
    lp = torch.randn(4, 32)
    meta = client.write_columns(meta, {"prev_logprobs": lp, "sample_mask": torch.ones(4)})  # lengths as stored
    assert diff_fields(client.registry, {**w.fields, "prev_logprobs": lp}, client.read_columns(
        meta, [*w.fields, "prev_logprobs"]), w.lengths, sample_ids=meta.sample_ids) == []
    short = meta.__class__(meta.partition, meta.sample_ids, [n - 1 for n in meta.lengths], meta.fields, meta.tags)
    with pytest.raises(E.ShapeError, match="prev_logprobs"):  # a field written before is checked against the others
        client.write_columns(short, {"prev_logprobs": torch.randn(4, 32)})
    with pytest.raises(E.ShapeError, match="input_ids"):  # nor a token field rewritten: a write never sets a length
        client.write_columns(short, {"input_ids": torch.randint(0, 9, (4, 32))})
    client.write_columns(short, {"sample_mask": torch.zeros(4)})  # no token rows: nothing to check
    want = {**w.fields, "prev_logprobs": lp, "sample_mask": torch.zeros(4)}  # the refused writes changed nothing
    assert diff_fields(client.registry, want, client.read_columns(meta, list(want)), w.lengths,
                       sample_ids=meta.sample_ids) == []


def test_a_commit_naming_token_fields_that_are_not_names_is_refused(client):
    from rlplane.codec import encode

    meta = client.put_samples("bad", tokens([4]))
    enc = encode(client.registry, {"prev_logprobs": torch.randn(1, 16)}, [4], sample_ids=meta.sample_ids)
    with pytest.raises(E.WireFormatError, match="'t' must list field names"):
        client.transport.put("bad", meta.sample_ids, enc.columns, enc.tags, create=False, aligned=[1, 2])  # type: ignore[list-item]
    assert "prev_logprobs" not in client.transport.describe("bad").fields
