"""TensorDict in and out (rlplane.integrations.tensordict) over the in-process store: what
each kind of field becomes, and every way a TensorDict can fail to be one row per sample.
The same round trip over every real transport is in tests/service/test_conformance.py."""

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlplane import FieldSpec, PackedTensor, default_registry
from rlplane.client import Client
from rlplane.errors import ContainerError, ShapeError, UnknownFieldError
from rlplane.integrations.tensordict import put_tensordict, read_tensordict
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from rlplane.transports import MemoryTransport


@pytest.fixture
def client():
    reg = default_registry()
    reg.register(FieldSpec("reward.score", "sample", "dense", {"train"}, dtype="float32"))
    reg.register(FieldSpec("prompt_text", "sample", "object", {"train"}))
    return Client(reg, MemoryTransport())


def as_td(fields: dict, batch: int) -> TensorDict:
    """A workload's fields as a user builds the TensorDict: media as per-sample rows."""
    out = {k: NonTensorStack(*[NonTensorData(r) for r in v.rows]) if isinstance(v, PackedTensor) else v
           for k, v in fields.items()}
    return TensorDict(out, batch_size=[batch])


def packed(td: TensorDict, name: str) -> PackedTensor:
    return PackedTensor(td.get(name).tolist())


def test_vlm_step_round_trips_bit_exactly_with_media_as_per_sample_rows(client):
    w = vlm_step(6, 128, seed=3)
    meta = put_tensordict(client, "p", as_td(w.fields, 6))
    td = read_tensordict(client, meta, list(w.fields))
    assert td.batch_size == torch.Size([6])
    got = {k: packed(td, k) if isinstance(w.fields[k], PackedTensor) else td.get(k) for k in w.fields}
    assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
    # Indexing the TensorDict keeps every sample's images with that sample.
    pick = td[torch.tensor([4, 1])]
    want = w.fields["pixel_values"].select([4, 1])
    assert diff_fields(client.registry, {"pixel_values": want}, {"pixel_values": packed(pick, "pixel_values")}) == []


def test_token_fields_read_jagged_and_a_jagged_put_takes_its_lengths_from_them(client):
    rows = [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate((3, 7, 1, 5))]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    meta = put_tensordict(client, "p", TensorDict({"input_ids": nt}, batch_size=[4]))
    assert meta.lengths == [3, 7, 1, 5]
    td = read_tensordict(client, meta, ["input_ids", "input_lengths"], tokens="jagged")
    assert td.get("input_ids").is_nested and all(torch.equal(a, b) for a, b in zip(td.get("input_ids").unbind(), rows))
    assert td.get("input_lengths").tolist() == [3, 7, 1, 5]
    padded = read_tensordict(client, meta, ["input_ids"]).get("input_ids")
    assert padded.shape == (4, 7) and torch.equal(padded[1], rows[1]) and int(padded[2, 1:].abs().sum()) == 0


def test_media_read_nested_concatenate_a_samples_segments_and_round_trip_as_nested(client):
    w = vlm_step(5, 96, seed=8)
    meta = put_tensordict(client, "p", as_td(w.fields, 5))
    td = read_tensordict(client, meta, ["pixel_values", "image_grid_thw", "input_ids", "input_lengths"], media="nested")
    pv = td.get("pixel_values")
    assert pv.is_nested
    for row, got in zip(w.fields["pixel_values"].rows, pv.unbind()):
        want = torch.cat(row).to(torch.bfloat16) if row else torch.zeros(0, 1176, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # stored as bf16: the cast, bit for bit
    meta2 = put_tensordict(client, "q", td)  # the nested tensor goes back in as one segment per sample
    again = read_tensordict(client, meta2, ["pixel_values"], media="nested").get("pixel_values")
    assert all(torch.equal(a, b) for a, b in zip(again.unbind(), pv.unbind()))
    rows = read_tensordict(client, meta2, ["pixel_values"]).get("pixel_values").tolist()
    assert [r is None for r in rows] == [not r for r in w.fields["pixel_values"].rows]


def test_nested_keys_are_dotted_field_names_and_objects_are_per_sample(client):
    td = TensorDict({"reward": TensorDict({"score": torch.tensor([0.5, 1.5])}, batch_size=[2]),
                     "prompt_text": NonTensorStack(NonTensorData("a cat"), NonTensorData("two dogs"))}, batch_size=[2])
    meta = put_tensordict(client, "p", td)
    assert meta.fields == {"reward.score", "prompt_text"}
    back = read_tensordict(client, meta, ["reward.score", "prompt_text"])
    assert torch.equal(back.get(("reward", "score")), torch.tensor([0.5, 1.5]))
    assert back.get("prompt_text").tolist() == ["a cat", "two dogs"]


def test_an_undeclared_key_is_refused_by_name_and_nothing_is_stored(client):
    td = TensorDict({"input_ids": torch.ones(2, 3, dtype=torch.int64), "input_lengths": torch.tensor([3, 3]),
                     "logits_oops": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(UnknownFieldError, match="logits_oops"):
        put_tensordict(client, "p", td)
    assert client.partitions() == []


def test_media_as_one_object_for_the_whole_batch_is_refused(client):
    """TensorDict would hand the one object to every index: td[:1] would carry every image."""
    w = vlm_step(3, 64, seed=2)
    td = as_td({k: v for k, v in w.fields.items() if k != "pixel_values"}, 3)
    td.set("pixel_values", NonTensorData(w.fields["pixel_values"], batch_size=[3]))
    with pytest.raises(ContainerError, match="pixel_values.*every index"):
        put_tensordict(client, "p", td)
    dense = as_td({k: v for k, v in w.fields.items() if k != "pixel_values"}, 3)
    dense.set("pixel_values", torch.zeros(3, 4, 1176))
    with pytest.raises(ContainerError, match="pixel_values"):
        put_tensordict(client, "p", dense)
    assert client.partitions() == []


def test_a_tensordict_that_is_not_one_row_per_sample_is_a_shape_error(client):
    td = TensorDict({"input_ids": torch.ones(2, 3, dtype=torch.int64)}, batch_size=[2, 3])
    with pytest.raises(ShapeError, match="batch_size"):
        put_tensordict(client, "p", td)
    with pytest.raises(ContainerError, match="TensorDict"):
        put_tensordict(client, "p", {"input_ids": torch.ones(2, 3)})
    assert client.partitions() == []


def test_a_narrowed_jagged_tensor_puts_its_rows_and_their_own_lengths(client):
    """A jagged tensor with gaps between its rows (torch.nested.narrow) was refused, blaming
    the wire's offsets, and its lengths were taken from the offsets (gaps included)."""
    flat = torch.arange(40, dtype=torch.int64)
    nt = torch.nested.narrow(flat.reshape(4, 10), 1, torch.zeros(4, dtype=torch.int64), torch.tensor([3, 5, 2, 4]),
                             layout=torch.jagged)
    meta = put_tensordict(client, "holes", TensorDict({"input_ids": nt}, batch_size=[4]))
    assert meta.lengths == [3, 5, 2, 4]
    got = read_tensordict(client, meta, ["input_ids"], tokens="jagged").get("input_ids")
    assert [r.tolist() for r in got.unbind()] == [list(range(10 * i, 10 * i + n)) for i, n in enumerate((3, 5, 2, 4))]


def test_a_field_named_like_another_ones_prefix_reads_flat_and_one_named_twice_is_a_shape_error(client):
    """Both "reward" and "reward.score" are legal field names: nesting the read's keys put one
    inside the other (KeyError); a TensorDict with "reward": {"score"} beside "reward.score"
    names one field twice (KeyError too)."""
    client.registry.register(FieldSpec("reward", "sample", "dense", {"train"}, dtype="float32"))
    meta = put_tensordict(client, "rr", TensorDict({"reward": torch.ones(2), "reward.score": torch.zeros(2)}, [2]))
    td = read_tensordict(client, meta, ["reward", "reward.score"])
    assert torch.equal(td.get("reward"), torch.ones(2)) and torch.equal(td.get("reward.score"), torch.zeros(2))
    twice = TensorDict({"reward": TensorDict({"score": torch.ones(2)}, [2]), "reward.score": torch.zeros(2)}, [2])
    with pytest.raises(ShapeError, match="names one field twice"):
        put_tensordict(client, "rr2", twice)


def test_a_tensor_on_the_meta_device_is_refused_typed(client):
    from rlplane.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="meta device"):
        put_tensordict(client, "m", TensorDict({"reward.score": torch.empty(2, device="meta")}, [2]))


def test_a_nested_tensor_of_torchs_default_strided_layout_is_a_container_error_naming_the_field(client):
    """It failed as an AttributeError ('Tensor' object has no attribute 'offsets')."""
    tokens = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)])  # (layout=torch.strided)
    with pytest.raises(ContainerError, match="torch.jagged") as err:
        put_tensordict(client, "s", TensorDict({"input_ids": tokens}, batch_size=[2]))
    assert err.value.field == "input_ids"
    images = torch.nested.nested_tensor([torch.randn(2, 1176), torch.randn(3, 1176)])
    with pytest.raises(ContainerError, match="torch.jagged") as err:
        put_tensordict(client, "s", TensorDict({"input_ids": torch.ones(2, 5, dtype=torch.int64),
                                                "input_lengths": torch.tensor([3, 5]), "pixel_values": images}, [2]))
    assert err.value.field == "pixel_values" and client.partitions() == []


def test_a_lazy_stack_of_rollouts_of_their_own_lengths_puts_each_ones_tokens(client):
    """TorchRL's form of a batch of rollouts: a lazy stack of per-sample TensorDicts whose
    token entries differ in length. It failed as an untyped RuntimeError (they do not stack)."""
    from tensordict import LazyStackedTensorDict

    rollouts = [TensorDict({"input_ids": torch.arange(n) + 10 * n, "reward.score": torch.tensor(float(n))}, [])
                for n in (2, 4, 3)]
    meta = put_tensordict(client, "lz", LazyStackedTensorDict.lazy_stack(rollouts, 0))
    got = read_tensordict(client, meta, ["input_ids", "input_lengths", "reward.score"], tokens="jagged")
    assert [r.tolist() for r in got["input_ids"].unbind()] == [r["input_ids"].tolist() for r in rollouts]
    assert got["input_lengths"].tolist() == [2, 4, 3] and got["reward", "score"].tolist() == [2.0, 4.0, 3.0]
