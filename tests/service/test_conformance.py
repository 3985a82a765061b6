"""One behaviour for every transport: the same tests over the in-process memory store,
the native engine on each of its data paths (shared memory, the transfer engine, ZMQ, HTTP) and TransferQueue
on its simple and Mooncake storages (direct and HTTP). What `transports/base.py`
promises: bit-exact round trips, strict reads, one owner per sample id, clears that
count, typed errors that store nothing, claims exactly once per task."""

import uuid
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

import rlplane
from rlplane import Client, SampleMeta, default_registry
from rlplane import errors as E
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from rlplane.transports import MemoryTransport

#: (store, how the client reaches it): every transport and data path there is.
PATHS = ["memory", "native/shm", "native/te", "native/zmq", "native/http", "simple/tq", "simple/http", "mooncake/tq",
         "mooncake/http"]


def part() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=PATHS)
def conn(request):
    """``conn()``: a fresh client on this path (a context manager)."""
    store, how = request.param.split("/") if "/" in request.param else (request.param, "")
    if store == "memory":
        transport = MemoryTransport()  # one store for the module: clients come and go, it stays

        @contextmanager
        def memory():
            yield Client(default_registry(), transport)

        return memory
    live = request.getfixturevalue("service") if store == "native" else request.getfixturevalue(f"{store}_service")
    url = live.url
    token = live.settings.token() if store == "native" else live.token
    kw = {"transport": "native", "data_path": how} if how in ("shm", "te", "zmq") else {"transport": how}

    def remote():
        return rlplane.connect(url, token=token, **kw)

    return remote


def small(n: int = 3) -> dict:
    return {"input_ids": torch.arange(n * 4, dtype=torch.int64).reshape(n, 4),
            "input_lengths": torch.tensor([4, 3, 2, 1][:n])}


def test_a_vlm_batch_round_trips_bit_exactly_whole_and_by_subset(conn):
    w = vlm_step(6, 256, seed=11)
    with conn() as client:
        p = part()
        meta = client.put_samples(p, w.fields)
        assert diff_fields(client.registry, w.fields, client.read_columns(meta, list(w.fields)), w.lengths,
                           sample_ids=meta.sample_ids) == []
        pick = [4, 1]  # out of order, some only
        want = {k: v[pick] if isinstance(v, rlplane.PackedTensor) else v[torch.tensor(pick)] for k, v in w.fields.items()}
        got = client.read_columns(meta.subset(pick), list(w.fields))
        assert diff_fields(client.registry, want, got, w.lengths[torch.tensor(pick)],
                           sample_ids=[meta.sample_ids[i] for i in pick]) == []
        assert client.clear(p) == 6


def test_a_grpo_batch_whose_groups_share_images_round_trips_bit_exactly(conn):
    """Rows a put sends once for several samples (a group's image) come back to each of
    them, on the stores that keep them once and on those that keep every copy."""
    from rlplane.testing.workloads import vlm_grpo

    w = vlm_grpo(batch=16, seqlen=64, seed=13)
    with conn() as client:
        p = part()
        meta = client.put_samples(p, w.fields)
        assert diff_fields(client.registry, w.fields, client.read_columns(meta, list(w.fields)), w.lengths,
                           sample_ids=meta.sample_ids) == []
        pick = [9, 0, 8]  # members of two groups, out of order
        want = {k: v[pick] if isinstance(v, rlplane.PackedTensor) else v[torch.tensor(pick)] for k, v in w.fields.items()}
        assert diff_fields(client.registry, want, client.read_columns(meta.subset(pick), list(w.fields)),
                           w.lengths[torch.tensor(pick)], sample_ids=[meta.sample_ids[i] for i in pick]) == []
        assert client.clear(p) == 16


def test_a_vlm_batch_round_trips_bit_exactly_as_a_tensordict(conn):
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    from rlplane.integrations.tensordict import put_tensordict, read_tensordict

    w = vlm_step(6, 256, seed=12)
    td = TensorDict({k: NonTensorStack(*[NonTensorData(r) for r in v.rows]) if isinstance(v, rlplane.PackedTensor)
                     else v for k, v in w.fields.items()}, batch_size=[6])
    with conn() as client:
        p = part()
        meta = put_tensordict(client, p, td)
        back = read_tensordict(client, meta, list(w.fields), tokens="jagged")
        got = {k: rlplane.PackedTensor(back.get(k).tolist()) if isinstance(w.fields[k], rlplane.PackedTensor)
               else back.get(k) for k in w.fields}
        assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        assert client.clear(p) == 6


def test_a_field_written_later_is_read_with_the_first_ones(conn):
    with conn() as client:
        p = part()
        meta = client.put_samples(p, small())
        logp = torch.randn(3, 4)
        meta = client.write_columns(meta, {"prev_logprobs": logp})
        got = client.read_columns(meta, ["input_ids", "prev_logprobs"])
        mask = torch.arange(4) < small()["input_lengths"][:, None]
        assert torch.equal(got["prev_logprobs"] * mask, logp * mask)
        assert torch.equal(got["input_ids"], small()["input_ids"] * mask)
        client.clear(p)


def test_reading_cleared_unknown_or_unwritten_samples_raises_missing_data_naming_them(conn):
    with conn() as client:
        p = part()
        meta = client.put_samples(p, small(), sample_ids=["a", "b", "c"])
        assert client.clear(p, ["b"]) == 1
        with pytest.raises(E.MissingDataError) as err:
            client.read_columns(meta, ["input_ids"])
        assert list(err.value.missing) == ["b"]
        client.write_columns(meta.subset([0]), {"prev_logprobs": torch.zeros(1, 4)})
        with pytest.raises(E.MissingDataError) as err:
            client.read_columns(meta.subset([0, 2]), ["prev_logprobs"])
        assert err.value.missing == {"c": ["prev_logprobs"]}
        assert client.clear(p) == 2 and p not in client.partitions()
        with pytest.raises(E.MissingDataError):
            client.read_columns(meta.subset([0]), ["input_ids"])


def test_a_sample_id_has_one_owner_and_a_refused_put_changes_nothing(conn):
    with conn() as client:
        p = part()
        meta = client.put_samples(p, small(2), sample_ids=["x", "y"])
        with pytest.raises(E.DuplicateSampleError) as err:
            client.put_samples(p, {"input_ids": torch.full((2, 4), 9), "input_lengths": torch.tensor([4, 4])},
                               sample_ids=["z", "y"])
        assert "'y'" in str(err.value)
        got = client.read_columns(meta, ["input_ids"])["input_ids"]
        assert torch.equal(got, small(2)["input_ids"] * (torch.arange(4) < small(2)["input_lengths"][:, None]))
        with pytest.raises(E.MissingDataError):  # nothing of the refused put was kept
            client.read_columns(meta.__class__(p, ["z"], [4], frozenset({"input_ids"}), [{}]), ["input_ids"])
        client.clear(p)


@pytest.mark.parametrize(
    "fields, error, field",
    [
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 4]),
          "pixel_vals": rlplane.PackedTensor([torch.ones(1, 3), None])}, E.UnregisteredFieldError, "pixel_vals"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.float32), "input_lengths": torch.tensor([4, 4])}, E.DtypeError,
         "input_ids"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 9])}, E.ShapeError,
         "input_ids"),
    ],
    ids=["unregistered", "dtype", "length"],
)
def test_bad_input_is_a_typed_error_naming_the_field_and_stores_nothing(conn, fields, error, field):
    with conn() as client:
        p = part()
        with pytest.raises(error) as err:
            client.put_samples(p, fields)
        assert err.value.field == field
        assert p not in client.partitions()


def test_claims_hand_each_sample_out_once_per_task_and_a_nack_gives_them_back(conn, request):
    with conn() as client:
        p = part()
        if request.node.callspec.params["conn"] == "memory":  # no ledger in process: says where claims are
            with pytest.raises(E.TransportError, match="rlplane.connect"):
                client.claim(p, "train", batch_size=2, fields=["input_ids"], timeout=0)
            return
        ids = client.put_samples(p, small(3)).sample_ids + client.put_samples(p, small(3)).sample_ids
        first = client.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=10)
        second = client.claim(p, "train", batch_size=4, min_batch=1, fields=["input_ids"], timeout=1)
        assert sorted(first.sample_ids + second.sample_ids) == sorted(ids)
        assert client.read_columns(second, ["input_ids"])["input_ids"].shape[0] == 2
        with pytest.raises(E.NotReadyError):
            client.claim(p, "train", batch_size=1, fields=["input_ids"], timeout=0)
        other = client.claim(p, "logprob", batch_size=6, fields=["input_ids"], timeout=10)  # another task: all again
        assert sorted(other.sample_ids) == sorted(ids)
        assert client.nack(second, "train") == 2
        again = client.claim(p, "train", batch_size=2, fields=["input_ids"], timeout=10)
        assert sorted(again.sample_ids) == sorted(second.sample_ids)
        assert client.ack(first, "train") + client.ack(again, "train") == 6
        assert client.consumption(p, "train")["acked"] == 6
        client.clear(p)


def test_image_samples_put_apart_from_text_only_ones_keep_their_images_on_a_read_by_stage(conn, request):
    """A claim (or a concat) over text-only samples and image samples put apart listed only
    the fields every sample holds: a read by stage left pixel_values out for all of them and
    the model trained image-blind. The store now says which samples hold it."""
    image, grid = torch.randn(16, 1176), torch.tensor([[1, 4, 4]])
    with conn() as client:
        p = part()
        with_images = client.put_samples(p, {**small(2), "pixel_values": rlplane.PackedTensor([image, None]),
                                             "image_grid_thw": rlplane.PackedTensor([grid, None])})
        text = client.put_samples(p, {**small(2), "mm_token_type_ids": torch.zeros(2, 4, dtype=torch.int64)})
        plain = client.put_samples(p, small(2))
        metas = {"concat": SampleMeta.concat(text, with_images)}
        if request.node.callspec.params["conn"] != "memory":  # (no claims in process)
            metas["claim"] = client.claim(p, "logprob", batch_size=4, stage="logprob", timeout=10)
            assert set(metas["claim"].sample_ids) == set(text.sample_ids + with_images.sample_ids)
        for how, meta in metas.items():
            assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= meta.some_fields, how
            at = meta.sample_ids.index(with_images.sample_ids[0])
            with pytest.raises(E.MissingDataError, match="only some") as err:  # a token field some lack: named
                client.read_columns(meta, stage="logprob")
            lack = {s for s, names in err.value.missing.items() if "mm_token_type_ids" in names}
            assert lack == set(with_images.sample_ids) and "mm_token_type_ids" in str(err.value), how
            images = meta.subset([meta.sample_ids.index(s) for s in with_images.sample_ids])  # (none holds it)
            assert "mm_token_type_ids" not in client.read_columns(images, stage="logprob"), how
            stale = replace(meta, some_fields=meta.some_fields - {"mm_token_type_ids"})  # (the store says so still)
            with pytest.raises(E.MissingDataError, match="only some"):
                client.read_columns(stale, stage="logprob")
            mixed = SampleMeta.concat(plain, images)  # text-only samples without the token field, and images
            got = client.read_columns(mixed, stage="logprob")
            rows, at = got["pixel_values"].rows, mixed.sample_ids.index(with_images.sample_ids[0])
            assert torch.equal(rows[at][0], image.to(torch.bfloat16)) and sum(r is not None for r in rows) == 1, how
            assert torch.equal(got["image_grid_thw"].rows[at][0], grid) and len(got["image_grid_thw"]) == 4, how
            assert torch.equal(got["input_ids"][at, :4], small(2)["input_ids"][0]), how
            texts = meta.subset([meta.sample_ids.index(s) for s in text.sample_ids])
            assert "pixel_values" not in client.read_columns(texts, stage="logprob")  # none of them holds one
            with pytest.raises(E.MissingDataError) as err:  # named, a sample that lacks it is named too
                client.read_columns(meta, ["input_ids", "pixel_values"])
            assert set(err.value.missing) == set(text.sample_ids), how
        client.clear(p)


def test_a_meta_older_than_a_write_that_added_images_to_some_samples_reads_them_by_stage(conn):
    """A meta from the text-only put, handed on after a stage wrote images to some of its
    samples, lists no image field: a read by stage left them out and the model trained
    image-blind. The store says which optional fields the samples hold now."""
    image, grid = torch.randn(16, 1176), torch.tensor([[1, 4, 4]])
    with conn() as client:
        p = part()
        meta = client.put_samples(p, small(3))  # the meta the driver hands on
        client.write_columns(meta.subset([1]), {"pixel_values": rlplane.PackedTensor([image]),
                                                "image_grid_thw": rlplane.PackedTensor([grid])})
        assert "pixel_values" not in meta.fields | meta.some_fields
        for stage in ("logprob", "ref_logprob"):
            got = client.read_columns(meta, stage=stage)
            rows = got["pixel_values"].rows
            assert rows[0] is None and rows[2] is None and torch.equal(rows[1][0], image.to(torch.bfloat16)), stage
            assert torch.equal(got["image_grid_thw"].rows[1][0], grid) and len(got["image_grid_thw"]) == 3, stage
            ids = small(3)["input_ids"]
            assert all(torch.equal(got["input_ids"][i, :n], ids[i, :n]) for i, n in enumerate((4, 3, 2))), stage
        assert "pixel_values" not in client.read_columns(meta.subset([0, 2]), stage="logprob")  # none of them holds one
        assert list(client.read_columns(meta, ["input_ids"])) == ["input_ids"]  # named fields: what is named
        client.write_columns(meta.subset([0]), {"mm_token_type_ids": torch.zeros(1, 4, dtype=torch.int64)})
        with pytest.raises(E.MissingDataError, match="only some") as err:  # a token field some lack: named, not dropped
            client.read_columns(meta, stage="logprob")
        assert {s for s, names in err.value.missing.items() if "mm_token_type_ids" in names} == \
            {meta.sample_ids[1], meta.sample_ids[2]}
        client.clear(p)


def test_a_write_with_a_meta_older_than_its_samples_is_refused_naming_field_and_sample(conn):
    """A meta from before an extend would have stored prev_logprobs of the old length next
    to the longer input_ids; every store refuses it, storing nothing."""
    with conn() as client:
        p = part()
        step = {"input_ids": torch.randint(0, 1000, (2, 8)), "input_lengths": torch.full((2,), 8)}
        old = client.put_samples(p, step, finished=False)
        new = client.extend(old, step, finished=True)
        with pytest.raises(E.ShapeError, match="8 tokens where the sample holds 16") as err:
            client.write_columns(old, {"prev_logprobs": torch.randn(2, 8)})
        assert err.value.field == "prev_logprobs" and err.value.sample == old.sample_ids[0]
        assert "prev_logprobs" not in client.transport.describe(p).fields
        lp = torch.randn(2, 16)
        client.write_columns(new, {"prev_logprobs": lp})
        assert torch.equal(client.read_columns(new, ["prev_logprobs"])["prev_logprobs"], lp)
        client.clear(p)


def test_a_meta_of_samples_cleared_and_put_again_is_refused_for_writes_extends_and_reads(conn, request):
    """The same ids, the same lengths, new samples: a meta from before names the samples
    that are gone (their incarnation), and every store refuses it, storing nothing; the
    new samples' meta (from their put, or a claim) works."""
    from rlplane.tags import BORN_TAG

    with conn() as client:
        p = part()
        step = {"input_ids": torch.randint(0, 1000, (2, 8)), "input_lengths": torch.full((2,), 8)}
        old = client.put_samples(p, step, sample_ids=["a", "b"], finished=False)
        assert old.tags[0][BORN_TAG] > 0
        client.clear(p, ["a"])
        new = client.put_samples(p, {k: v[:1] for k, v in step.items()}, sample_ids=["a"], finished=False)
        assert new.tags[0][BORN_TAG] not in (0, old.tags[0][BORN_TAG])
        with pytest.raises(E.MissingDataError, match="write's meta is stale") as err:
            client.write_columns(old, {"prev_logprobs": torch.randn(2, 8)})
        assert list(err.value.missing) == ["a"]
        with pytest.raises(E.MissingDataError, match="meta is stale"):  # (its read of the stored rows says so)
            client.extend(old, {"input_ids": torch.ones(2, 2, dtype=torch.int64), "input_lengths": torch.full((2,), 2)})
        with pytest.raises(E.MissingDataError, match="read's meta is stale"):
            client.read_columns(old, ["input_ids"])
        got = client.read_columns(old.subset([1]), ["input_ids", "input_lengths"], layout="jagged")
        assert torch.equal(got["input_ids"][0], step["input_ids"][1])  # b: nothing of the refused calls stored
        assert "prev_logprobs" not in client.transport.describe(p).fields
        lp = torch.randn(1, 8)
        wrote = client.write_columns(new, {"prev_logprobs": lp})
        assert torch.equal(client.read_columns(new, ["prev_logprobs"])["prev_logprobs"], lp)
        grown = client.extend(wrote, {"input_ids": torch.ones(1, 2, dtype=torch.int64),  # a: both its token fields
                                      "prev_logprobs": torch.zeros(1, 2), "input_lengths": torch.full((1,), 2)})
        assert grown.lengths == [10]
        if request.node.callspec.params["conn"] != "memory":  # a claim's meta names the new sample
            claimed = client.claim(p, "peek", batch_size=2, fields=["input_ids"], timeout=5, unfinished=True)
            by_id = dict(zip(claimed.sample_ids, claimed.tags))
            assert by_id["a"][BORN_TAG] == new.tags[0][BORN_TAG] and by_id["b"][BORN_TAG] == old.tags[1][BORN_TAG]
            b = claimed.subset([claimed.sample_ids.index("b")])  # (a holds prev_logprobs too: a claim of
            client.extend(b, {"input_ids": torch.ones(1, 2, dtype=torch.int64),  # input_ids alone cannot grow it)
                              "input_lengths": torch.full((1,), 2)})
        client.clear(p)


def _partial_step(g: torch.Generator, lens: list[int]) -> dict:
    """Tokens for a step of a partial rollout: ``lens[i]`` new tokens for sample i."""
    n, width = len(lens), max(max(lens), 1)
    return {"input_ids": torch.randint(0, 1 << 40, (n, width), generator=g),
            "token_mask": torch.randint(0, 2, (n, width), generator=g).to(torch.int32),
            "generation_logprobs": torch.randn(n, width, generator=g),
            "input_lengths": torch.tensor(lens)}


def test_an_extend_leaving_out_a_token_field_a_stage_wrote_is_refused_and_stores_nothing(conn):
    """The store, not the caller's meta, says which token fields the samples hold: an extend
    with the put's meta after a stage wrote prev_logprobs (with its own meta) is a ShapeError
    naming that field and sample, and the samples read back as they were."""
    g = torch.Generator().manual_seed(8)
    with conn() as client:
        p = part()
        first = _partial_step(g, [2, 3])
        meta = client.put_samples(p, first, finished=False)
        client.write_columns(meta.subset([1]), {"prev_logprobs": torch.zeros(1, 3)})
        with pytest.raises(E.ShapeError) as err:
            client.extend(meta, _partial_step(g, [1, 1]), finished=True)
        assert (err.value.field, err.value.sample) == ("prev_logprobs", meta.sample_ids[1])
        got = client.read_columns(meta, [*first], layout="jagged")
        assert got["input_lengths"].tolist() == [2, 3]
        for f in first:
            if f != "input_lengths":
                assert all(torch.equal(got[f][i], first[f][i, : (2, 3)[i]]) for i in range(2)), f
        client.clear(p)


def test_a_crafted_extend_growing_a_samples_token_fields_unevenly_is_refused_and_stores_nothing(conn):
    """A write sent as an extend (not built by Client.extend) whose token rows of one sample
    differ in length, or are shorter than the sample: ShapeError naming the sample, and
    every sample reads back as it was (before, the store kept input_ids longer than the
    sample's other token rows, and reads failed later)."""
    import numpy as np

    from rlplane.codec import encode
    from rlplane.tags import SUM_TAG, WIRE_TAG

    g = torch.Generator().manual_seed(9)
    with conn() as client:
        p = part()
        first = _partial_step(g, [2, 3])
        meta = client.put_samples(p, first, finished=False)
        token = [n for n in client.registry.names() if client.registry.get(n).alignment == "token"]
        step = _partial_step(g, [4, 4])
        for ids_len, rest_len in (([4, 4], [3, 4]), ([1, 4], [1, 4])):  # uneven; shorter than stored (2)
            a = encode(client.registry, {"input_ids": step["input_ids"], "input_lengths": torch.tensor(ids_len)},
                       torch.tensor(ids_len), sample_ids=meta.sample_ids)
            b = encode(client.registry, {k: step[k] for k in ("token_mask", "generation_logprobs")},
                       torch.tensor(rest_len), sample_ids=meta.sample_ids)
            tags = [{WIRE_TAG: {**x[WIRE_TAG], **y[WIRE_TAG]}, SUM_TAG: {**x[SUM_TAG], **y[SUM_TAG]}}
                    for x, y in zip(a.tags, b.tags)]
            with pytest.raises(E.ShapeError) as err:
                client.transport.put(p, meta.sample_ids, {**a.columns, **b.columns}, tags, create=False,
                                     aligned=token, grows=np.array([2, 3]))
            assert err.value.sample == meta.sample_ids[0], err.value
        got = client.read_columns(meta, [*first], layout="jagged")
        assert got["input_lengths"].tolist() == [2, 3]
        for f in first:
            if f != "input_lengths":
                assert all(torch.equal(got[f][i], first[f][i, : (2, 3)[i]]) for i in range(2)), f
        client.clear(p)


def test_of_two_extends_of_a_sample_at_once_the_later_is_refused_and_the_earlier_kept(conn):
    """Two writers extend the same samples at once: the one that commits second read the
    samples before the first grew them. It is a ShapeError naming a field and a sample,
    stores nothing, and the first one's tokens stay (it used to undo them silently)."""
    g = torch.Generator().manual_seed(9)
    with conn() as a, conn() as b:
        p = part()
        first = _partial_step(g, [2, 3])
        meta = a.put_samples(p, first, finished=False)
        mine, theirs = _partial_step(g, [1, 2]), _partial_step(g, [3, 1])
        real_put, raced, started = a.transport.put, [], []

        def put_after_theirs(*args, **kwargs):  # a has read the samples; b extends them now, then a commits
            if not started:  # (once: the in-process store is both clients')
                started.append(True)
                raced.append(b.extend(meta, theirs))
            return real_put(*args, **kwargs)

        a.transport.put = put_after_theirs
        try:
            with pytest.raises(E.ShapeError, match="another extend grew it") as err:
                a.extend(meta, mine)
        finally:
            a.transport.put = real_put
        assert raced and err.value.sample in meta.sample_ids and err.value.field in first
        got = a.read_columns(raced[0], [*first], layout="jagged")
        assert got["input_lengths"].tolist() == [5, 4]
        for f in first:
            if f != "input_lengths":
                want = [torch.cat([first[f][i, : (2, 3)[i]], theirs[f][i, : (3, 1)[i]]]) for i in range(2)]
                assert all(torch.equal(x, y) for x, y in zip(got[f], want)), f
        client_meta = a.extend(raced[0], mine)  # from the meta that names the grown samples: fine
        assert client_meta.lengths == [6, 6]
        a.clear(p)


def test_partial_rollouts_grow_bit_exactly_through_extends_and_are_claimed_once_finished(conn, request):
    """Three rollouts written partway, then extended ten times (some steps add nothing to
    some samples), read back after every step equal to what a rollout that had it all
    at once would have written; an extend that leaves a token field out, or brings one
    the samples never had, changes nothing; claims skip the rollouts until they finish."""
    g = torch.Generator().manual_seed(5)
    with conn() as client:
        p = part()
        first = _partial_step(g, [3, 1, 2])
        meta = client.put_samples(p, first, finished=False)
        done = client.put_samples(p, small(1))  # a finished sample next to them
        want = {f: [first[f][i, : int(first["input_lengths"][i])] for i in range(3)] for f in first if f != "input_lengths"}
        claims = request.node.callspec.params["conn"] != "memory"
        if claims:
            got = client.claim(p, "train", batch_size=4, min_batch=1, fields=["input_ids"], timeout=0)
            assert got.sample_ids == done.sample_ids  # the partial rollouts are not handed out
            early = client.claim(p, "peek", batch_size=3, fields=["input_ids"], timeout=5, unfinished=True)
            assert sorted(early.sample_ids) == sorted(meta.sample_ids)  # unless asked for
            assert client.consumption(p, "train")["ready"] == 1
        for step in range(10):
            lens = torch.randint(0, 5, (3,), generator=g).tolist()
            more = _partial_step(g, lens)
            meta = client.extend(meta, more, finished=step == 9)
            for f in want:
                want[f] = [torch.cat([want[f][i], more[f][i, : lens[i]]]) for i in range(3)]
            assert meta.lengths == [len(r) for r in want["input_ids"]]
            got = client.read_columns(meta, [*want, "input_lengths"], layout="jagged")
            for f in want:
                assert all(torch.equal(a, b) for a, b in zip(got[f], want[f])), (step, f)
            if claims and step < 9:
                with pytest.raises(E.NotReadyError):
                    client.claim(p, "train", batch_size=1, fields=["input_ids"], timeout=0)
        with pytest.raises(E.ShapeError) as err:  # a token field left out: refused, nothing changes
            client.extend(meta, {"input_ids": torch.ones(3, 2, dtype=torch.int64), "input_lengths": torch.tensor([2, 2, 2])})
        assert err.value.field in ("generation_logprobs", "token_mask")
        with pytest.raises(E.ShapeError) as err:  # a token field the rollouts never had
            client.extend(meta, {**_partial_step(g, [1, 1, 1]), "advantages": torch.zeros(3, 1)})
        assert err.value.field == "advantages"
        got = client.read_columns(meta, list(want), layout="jagged")
        assert all(torch.equal(a, b) for f in want for a, b in zip(got[f], want[f]))
        if claims:
            rest = client.claim(p, "train", batch_size=3, fields=["input_ids"], timeout=10)
            assert sorted(rest.sample_ids) == sorted(meta.sample_ids) and rest.lengths == meta.lengths
            assert client.consumption(p, "train")["ready"] == 4
        client.clear(p)
