"""A write made with a meta older than its samples (extended since, or cleared and put
again with other lengths) is refused with a ShapeError naming the field and the sample,
and nothing of it is stored: it used to store token rows as long as the old meta said
next to rows of the sample's real length (a trainer then reads prev_logprobs shorter
than input_ids). In one process plus storage units; tests/service runs it over HTTP."""

import pytest
import torch

from rlplane import Client, SampleMeta, default_registry
from rlplane import errors as E
from rlplane.tags import BORN_TAG
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
    with pytest.raises(E.MissingDataError, match="meta is stale: 1 of its 2 samples .first 'a'.") as err:
        client.write_columns(first, {"advantages": torch.randn(2, 16)})
    assert list(err.value.missing) == ["a"]
    got = client.read_columns(again, ["input_ids"])
    assert torch.equal(got["input_ids"][0, :9], w["input_ids"][0, :9])
    assert "advantages" not in client.transport.describe("again").fields
    # a meta that names no incarnation (built by hand) is still held to the sample's length
    bare = SampleMeta("again", ["a"], [10], first.fields)
    with pytest.raises(E.ShapeError) as err:
        client.write_columns(bare, {"advantages": torch.randn(1, 16)})
    assert err.value.field == "advantages" and err.value.sample == "a" and "1 of the write's 1" in str(err.value)
    ok = client.write_columns(first.subset([1]), {"advantages": torch.randn(1, 16)})  # b is as it was
    assert ok.lengths == [12]


def test_a_meta_of_a_sample_cleared_and_put_again_with_the_same_length_can_neither_write_nor_read_it(client):
    """The same length: the length check cannot tell. The meta names which incarnation of
    each id it was made for; the store refuses it once that one is gone."""
    old = client.put_samples("same", tokens([8, 8]), sample_ids=["a", "b"])
    assert len({t[BORN_TAG] for t in old.tags}) == 1 and old.tags[0][BORN_TAG] > 0  # one put: one incarnation
    client.clear("same", ["a"])
    now = client.put_samples("same", tokens([8]), sample_ids=["a"])
    assert now.tags[0][BORN_TAG] != old.tags[0][BORN_TAG]
    lp = torch.randn(1, 16)
    client.write_columns(now, {"prev_logprobs": lp})
    before = client.read_columns(now, ["input_ids", "prev_logprobs"])
    with pytest.raises(E.MissingDataError, match="write's meta is stale") as err:
        client.write_columns(old, {"prev_logprobs": torch.randn(2, 16)})  # the stale write
    assert list(err.value.missing) == ["a"]
    with pytest.raises(E.MissingDataError, match="read's meta is stale"):
        client.read_columns(old, ["input_ids"])
    with pytest.raises(E.MissingDataError, match="extend's meta is stale: 1 of its 2 samples .first 'a'.*"
                                                 "Nothing was appended") as err:  # (it reads first: the read's words)
        client.extend(old, tokens([2, 2], width=2))
    assert list(err.value.missing) == ["a"]
    after = client.read_columns(now, ["input_ids", "prev_logprobs"])  # the refused calls changed nothing
    assert all(torch.equal(before[f], after[f]) for f in before)
    assert client.read_columns(old.subset([1]), ["input_ids"])["input_ids"].shape == (1, 8)  # b is the same b
    # the incarnation rides along everything a meta goes through
    for m in (SampleMeta.from_msgpack(old.to_msgpack()), SampleMeta.from_json(old.to_json()), old.subset([1, 0]),
              SampleMeta.concat(old.slice(0, 1), old.slice(1, 2)), *old.shard(2, balance="contiguous"),
              old.with_fields({"advantages"}, [{"x": 1} for _ in old.sample_ids])):
        if "a" in m.sample_ids:
            with pytest.raises(E.MissingDataError, match="stale"):
                client.read_columns(m, ["input_ids"])
        else:
            client.read_columns(m, ["input_ids"])


def test_a_claimed_meta_names_its_incarnations_and_goes_stale_like_any(client):
    put = client.put_samples("claimed", tokens([4, 4, 4]), sample_ids=["x", "y", "z"])
    meta = client.claim("claimed", "train", batch_size=3, fields=["input_ids"], timeout=5)
    assert [t[BORN_TAG] for t in meta.tags] == [t[BORN_TAG] for t in put.tags]
    client.write_columns(meta, {"advantages": torch.ones(3, 4)})  # its own samples: written
    client.ack(meta, "train")
    client.clear("claimed", ["y"])
    client.put_samples("claimed", tokens([4]), sample_ids=["y"])
    with pytest.raises(E.MissingDataError, match="stale") as err:
        client.write_columns(meta, {"advantages": torch.zeros(3, 4)})
    assert list(err.value.missing) == ["y"]
    assert torch.equal(client.read_columns(put.subset([0, 2]), ["advantages"])["advantages"], torch.ones(2, 4))


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


def stale_then_fresh(c: Client, p: str, old, new) -> None:
    """``old`` names sample "a" before it was put again, ``new`` after: only ``new`` writes."""
    with pytest.raises(E.MissingDataError, match="stale"):
        c.write_columns(old, {"advantages": torch.zeros(len(old), 16)})
    c.write_columns(new, {"advantages": torch.ones(1, 16)})
    assert torch.equal(c.read_columns(new, ["advantages"])["advantages"], torch.ones(1, new.lengths[0]))


def test_incarnations_survive_a_controller_restart():
    """A rebuilt controller gives each sample the incarnation its put record names."""
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
        with Client(default_registry(), NativeTransport(info, timeout=30)) as c:
            old = c.put_samples("r", tokens([6, 6]), sample_ids=["a", "b"])
            c.clear("r", ["a"])
            new = c.put_samples("r", tokens([6]), sample_ids=["a"])
            eng.kill_controller()
            eng.restart_controller()
            stale_then_fresh(c, "r", old, new)
            c.write_columns(old.subset([1]), {"advantages": torch.ones(1, 16)})  # b: put once, still its meta's


def test_incarnations_survive_a_snapshot_restored_into_another_store_and_a_journal_replay(tmp_path):
    """Metas handed out before a snapshot (or before a crash the journal covers) still
    name the restored samples; a restore that kept none would make every one stale."""
    from rlplane import snapshot

    with LocalEngine(2, secret=SECRET, lease_s=30, journal_dir=tmp_path / "j") as src:
        info = {"controller": src.server.endpoint, "secret": SECRET.decode()}
        with Client(default_registry(), NativeTransport(info, timeout=30)) as a:
            old = a.put_samples("s", tokens([5, 5]), sample_ids=["a", "b"])
            a.snapshot(str(tmp_path / "snap"))
            late = a.put_samples("j", tokens([7]), sample_ids=["c"], durable=True)  # in the journal only
    for journal in (None, tmp_path / "j"):
        with LocalEngine(3, secret=SECRET, lease_s=30) as dst:
            info = {"controller": dst.server.endpoint, "secret": SECRET.decode()}
            with Client(default_registry(), NativeTransport(info, timeout=30)) as b:
                snapshot.restore(b.transport, tmp_path / "snap", journal=journal)
                b.write_columns(old, {"advantages": torch.ones(2, 16)})  # the restored samples are those it names
                if journal is not None:
                    b.write_columns(late, {"advantages": torch.ones(1, 16)})
                b.clear("s", ["a"])
                new = b.put_samples("s", tokens([5]), sample_ids=["a"])
                stale_then_fresh(b, "s", old, new)


def test_a_stale_meta_error_names_every_stale_sample(client):
    """A caller may retry without the samples ``missing`` names: it lists every one."""
    ids = [f"s{i}" for i in range(12)]
    old = client.put_samples("many", tokens([4] * 12), sample_ids=ids)
    client.clear("many")
    client.put_samples("many", tokens([4] * 12), sample_ids=ids)
    with pytest.raises(E.MissingDataError, match="12 of its 12 samples") as err:
        client.read_columns(old, ["input_ids"])
    assert sorted(err.value.missing) == sorted(ids)


def test_a_replayed_record_with_malformed_incarnations_takes_no_id():
    """A put record whose incarnations are malformed is skipped by a rebuild before it
    takes anything: its ids stay free for a later put (they used to stay reserved for ever)."""
    from rlplane_service.native.commitlog import PUT, Entry

    with LocalEngine(2, secret=SECRET) as eng:
        info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
        with Client(default_registry(), NativeTransport(info, timeout=30)) as c:
            c.put_samples("x", tokens([4]), sample_ids=["y"])
            rec = {"rid": "9.abc", "ids": ["z"], "create": True, "fields": [], "blocks": [[987654321, [0], 0, 1]],
                   "g": {}, "nb": {}, "h": {}, "bn": b"\x01" * 7}
            with eng.core._lock, pytest.raises(E.WireFormatError, match="'bn'"):
                eng.core._replay(Entry(10**6, PUT, "x", b"", b""), rec)
            assert "z" not in eng.core._parts["x"].ids and 987654321 not in eng.core._block_units
            c.put_samples("x", tokens([4]), sample_ids=["z"])
