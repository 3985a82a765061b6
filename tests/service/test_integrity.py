"""Every stored row carries the writer's checksum; a read whose bytes differ from what was
written is an IntegrityError naming partition, sample and field, on every backend and
transport (issue 13, "integrity, always on")."""

import uuid

import pytest
import ray
import torch

import rlplane
from rlplane import errors as E
from rlplane.codec import encode
from rlplane.integrity import SUM_TAG
from rlplane.meta import SampleMeta
from rlplane.testing.workloads import text_step


def part() -> str:
    return f"integrity-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["direct", "http"])
def client(request, live):
    c = rlplane.connect(live.url, token=live.token, transport=live.direct if request.param == "direct" else "http")
    yield c
    c.close()


def test_rows_round_trip_with_their_checksums_and_a_wrong_checksum_names_the_row(client):
    p = part()
    work = text_step(batch=4, seqlen=32, seed=5)
    ids = [f"s{i}" for i in range(4)]
    meta = client.put_samples(p, work.fields, sample_ids=ids)
    assert all(set(t[SUM_TAG]) == set(work.fields) for t in meta.tags)  # one digest per (sample, field)
    got = client.read_columns(meta, ["input_ids", "advantages"], pad_to_seqlen=32)
    assert torch.equal(got["input_ids"], work.fields["input_ids"])

    # A writer whose recorded digest does not match its bytes (what a torn or altered
    # row looks like to the reader): stored as given, refused on read, the row named.
    q = part()
    enc = encode(client.registry, work.fields, work.lengths, sample_ids=ids)
    enc.tags[2][SUM_TAG]["advantages"] ^= 1  # where the tq backends take it from
    enc.columns["advantages"].sums[2] ^= 1  # where the native path takes it from (the column's digests)
    client.transport.put(q, ids, enc.columns, enc.tags, create=True)
    bad = SampleMeta(q, ids, meta.lengths, meta.fields, enc.tags)
    with pytest.raises(E.IntegrityError) as err:
        client.read_columns(bad, ["input_ids", "advantages"])
    assert f"partition '{q}'" in str(err.value) and "sample 's2'" in str(err.value) and "'advantages'" in str(err.value)
    assert torch.equal(client.read_columns(bad, ["input_ids"], pad_to_seqlen=32)["input_ids"], work.fields["input_ids"])  # the rest reads
    assert torch.equal(client.read_columns(bad.subset([0, 1, 3]), ["advantages"], pad_to_seqlen=32)["advantages"],
                       work.fields["advantages"][[0, 1, 3]])
    client.clear(p)
    client.clear(q)


@pytest.mark.parametrize("transport", ["native", "te", "http"])
def test_a_bit_flipped_on_a_storage_unit_is_an_integrity_error_naming_sample_and_field(service, transport):
    """The native engine's unit test hook flips one stored bit; the read says which row
    (over shared memory, one-sided over the transfer engine, or HTTP)."""
    from rlplane_service.settings import ServiceSettings

    token = service.settings.token()
    c = (rlplane.connect(service.url, token=token, transport="native", data_path="te") if transport == "te"
         else rlplane.connect(service.url, token=token, transport=transport))
    assert transport != "te" or set(c.transport.paths().values()) == {"te"}
    direct = rlplane.connect(service.url, token=token, transport="native")
    try:
        p = part()
        work = text_step(batch=6, seqlen=64, seed=7)
        ids = [f"v{i}" for i in range(6)]
        meta = c.put_samples(p, work.fields, sample_ids=ids)
        loc = direct.transport._ctrl().call({"op": "locate", "p": p, "ids": ["v4"], "fields": ["input_ids"]}, timeout=10)[0]
        unit, entries = loc["units"][0]
        bid, row = (int.from_bytes(entries[0][k][:8], "little") for k in (1, 2))
        actor = ray.get_actor(direct.transport.units[unit][0], namespace=ServiceSettings().namespace)
        assert ray.get(actor.damage.remote(bid, "input_ids", row))
        with pytest.raises(E.IntegrityError) as err:
            c.read_columns(meta, ["input_ids"])
        text = str(err.value)
        assert "sample 'v4'" in text and "field 'input_ids'" in text and p in text and "1 of 6 rows" in text
        others = c.read_columns(meta, ["advantages", "token_mask"], pad_to_seqlen=64)  # the sample's other fields are intact
        assert torch.equal(others["advantages"], work.fields["advantages"])
        good = meta.subset([0, 1, 2, 3, 5])
        assert torch.equal(c.read_columns(good, ["input_ids"], pad_to_seqlen=64)["input_ids"], work.fields["input_ids"][[0, 1, 2, 3, 5]])
        c.clear(p)
    finally:
        c.close()
        direct.close()
