"""SampleMeta: rows, lengths and tags always travel together."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import SampleMeta
from rlplane.errors import InvalidArgumentError, ShapeError


def make(n=10, pad=None):
    return SampleMeta("p", [f"s{i}" for i in range(n)], lengths=[(i * 37) % 100 + 1 for i in range(n)],
                      fields={"input_ids"}, tags=[{"i": i} for i in range(n)], pad_to_seqlen=pad)


def aligned(meta):
    return all(t["i"] == int(s[1:]) for s, t in zip(meta.sample_ids, meta.tags)) and all(
        length == (int(s[1:]) * 37) % 100 + 1 for s, length in zip(meta.sample_ids, meta.lengths))


def test_subset_slice_keep_tags_and_lengths_with_rows():
    m = make()
    assert aligned(m.subset([7, 2])) and m.subset([7, 2]).sample_ids == ["s7", "s2"]
    assert aligned(m.slice(3, 6)) and len(m.slice(3, 6)) == 3
    mask = torch.tensor([i % 2 == 0 for i in range(10)])
    assert m.subset(mask).sample_ids == ["s0", "s2", "s4", "s6", "s8"]


@pytest.mark.parametrize("balance", ["seqlen", "contiguous"])
def test_shard_keeps_tags_aligned_and_covers_every_sample_once(balance):
    m = make(11)
    shards = m.shard(3, balance=balance)
    assert len(shards) == 3 and all(aligned(s) for s in shards)
    assert sorted(s for sh in shards for s in sh.sample_ids) == sorted(m.sample_ids)
    assert {s.pad_to_seqlen for s in shards} == {max(m.lengths)}  # every rank pads alike
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_seqlen_balance_beats_contiguous_on_skewed_lengths():
    m = SampleMeta("p", [f"s{i}" for i in range(8)], lengths=[1000, 900, 800, 700, 10, 10, 10, 10])
    tokens = lambda shards: max(sum(s.lengths) for s in shards) - min(sum(s.lengths) for s in shards)  # noqa: E731
    assert tokens(m.shard(2, "seqlen")) < tokens(m.shard(2, "contiguous"))


def test_shard_more_ranks_than_samples_gives_empty_shards():
    shards = make(2).shard(4)
    assert [len(s) for s in shards].count(0) == 2


def test_concat_inverts_shard_and_keeps_common_fields():
    m = make(9, pad=128)
    shards = m.shard(2)
    back = SampleMeta.concat(*shards)
    assert sorted(back.sample_ids) == sorted(m.sample_ids) and aligned(back)
    assert back.pad_to_seqlen == 128
    one = shards[0].with_fields({"prev_logprobs"})
    assert SampleMeta.concat(one, shards[1]).fields == {"input_ids"}
    with pytest.raises(InvalidArgumentError, match="different partitions"):
        SampleMeta.concat(make(1), SampleMeta("q", ["x"]))


def test_fields_only_some_samples_hold_are_kept_through_concat_subset_and_the_wire():
    """A concat of an image put and a text-only put said only what both hold: a read by
    stage of it then left the images out for every sample."""
    images = make(2).with_fields({"pixel_values"})
    both = SampleMeta.concat(images, SampleMeta("p", ["t0"], fields={"input_ids"}))
    assert both.fields == {"input_ids"} and both.some_fields == {"pixel_values"}
    assert both.subset([2]).some_fields == {"pixel_values"}  # (which of them hold it: the store says)
    assert SampleMeta.from_msgpack(both.to_msgpack()) == both and SampleMeta.from_json(both.to_json()) == both
    assert both.with_fields({"pixel_values"}).some_fields == set() and "some_fields" in repr(both)
    assert SampleMeta.concat(images.slice(0, 1), images.slice(1, 2)).some_fields == set()


def test_msgpack_and_json_round_trip():
    m = make(4, pad=100)
    assert SampleMeta.from_msgpack(m.to_msgpack()) == m
    assert SampleMeta.from_json(json.loads(json.dumps(m.to_json()))) == m


def test_invalid_metas_raise():
    with pytest.raises(ShapeError, match="appears twice"):
        SampleMeta("p", ["a", "a"])
    with pytest.raises(ShapeError, match="lengths"):
        SampleMeta("p", ["a", "b"], lengths=[1])
    with pytest.raises(ShapeError, match="pad_to_seqlen"):
        SampleMeta("p", ["a"], lengths=[10], pad_to_seqlen=5)
    with pytest.raises(InvalidArgumentError):
        make().shard(0)
    with pytest.raises(InvalidArgumentError, match="balance"):
        make().shard(2, balance="tokens")


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 4096), max_size=40), dp=st.integers(1, 8), balance=st.sampled_from(["seqlen", "contiguous"]))
def test_shard_property(lengths, dp, balance):
    m = SampleMeta("p", [f"s{i}" for i in range(len(lengths))], lengths=lengths, tags=[{"n": x} for x in lengths])
    shards = m.shard(dp, balance=balance)
    assert len(shards) == dp
    assert sorted(s for sh in shards for s in sh.sample_ids) == sorted(m.sample_ids)
    for sh in shards:
        assert [t["n"] for t in sh.tags] == sh.lengths
        assert [int(s[1:]) for s in sh.sample_ids] == sorted(int(s[1:]) for s in sh.sample_ids)
