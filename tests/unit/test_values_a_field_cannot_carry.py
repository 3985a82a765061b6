"""Values a field cannot carry as given: never silently changed or stored empty, always a
typed error naming the field, and nothing stored (the in-process store and the native
engine over both its data paths)."""

import pytest
import torch

from rlplane import Client, FieldSpec, default_registry
from rlplane import errors as E
from rlplane.transports import MemoryTransport
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, slab_bytes=64 << 20) as eng:
        yield eng


@pytest.fixture(params=["memory", "shm", "zmq"])
def client(request, engine):
    if request.param == "memory":
        return Client(default_registry(), MemoryTransport())
    return Client(default_registry(), NativeTransport(engine.info, timeout=30, data_path=request.param))


def part(request) -> str:
    """A partition of this test's own (the engine is shared)."""
    return request.node.name.replace("[", "-").replace("]", "")[-60:]


def tokens(n: int, width: int = 4) -> dict:
    return {"input_ids": torch.arange(n * width).reshape(n, width), "input_lengths": torch.full((n,), width)}


def test_a_token_field_written_to_samples_put_without_lengths_is_refused_not_stored_empty(client, request):
    meta = client.put_samples(part(request), {"sample_mask": torch.ones(2)})
    with pytest.raises(E.ShapeError, match="without input_lengths") as err:
        client.write_columns(meta, {"advantages": torch.randn(2, 5)})
    assert err.value.field == "advantages"


def test_lengths_of_another_shape_than_the_batch_are_refused_before_anything_is_stored(client, request):
    with pytest.raises(E.ShapeError, match="4 lengths for a batch of 2") as err:
        client.put_samples(part(request), {"sample_mask": torch.ones(2), "input_lengths": torch.ones(2, 2).long()})
    assert err.value.field == "input_lengths" and part(request) not in client.partitions()
    with pytest.raises(E.ShapeError, match="negative length") as err:
        client.put_samples(part(request), {"input_ids": torch.ones(2, 4).long(),
                                           "input_lengths": torch.tensor([4, -1])})
    assert err.value.field == "input_lengths"


def test_a_pad_value_its_rows_cannot_hold_is_a_dtype_error_on_a_padded_read(engine):
    """A pad of -100 in uint8 rows padded with 156, -1 in a bool field with True."""
    reg = default_registry()
    reg.register(FieldSpec("labels", "token", "dense", {"train"}, pad_value=-100))
    c = Client(reg, NativeTransport(engine.info, timeout=30))
    meta = c.put_samples("pads", {**tokens(2), "input_lengths": torch.tensor([4, 2]),
                                  "labels": torch.ones(2, 4, dtype=torch.uint8)})
    with pytest.raises(E.DtypeError, match="-100") as err:
        c.read_columns(meta, ["labels"])
    assert err.value.field == "labels"
    assert [r.tolist() for r in c.read_columns(meta, ["labels"], layout="jagged")["labels"]] == [[1] * 4, [1] * 2]
    with pytest.raises(E.RegistryError, match="0 or 1"):
        reg.register(FieldSpec("keep", "token", "dense", {"train"}, dtype="bool", pad_value=-1))
    full = c.put_samples("pads", {**tokens(2), "labels": torch.ones(2, 4, dtype=torch.uint8)})
    assert c.read_columns(full, ["labels"])["labels"].tolist() == [[1] * 4] * 2  # (no row padded: no pad needed)
    reg.register(FieldSpec("tenth", "token", "dense", {"train"}, pad_value=0.1))  # (a float pad may round)
    meta = c.put_samples("pads", {**tokens(2), "input_lengths": torch.tensor([4, 2]), "tenth": torch.ones(2, 4)})
    assert c.read_columns(meta, ["tenth"])["tenth"][1, 3].item() == pytest.approx(0.1)
    assert c.write_columns(meta, {}) is meta and c.write_columns(meta, {"advantages": None}) is meta


def test_a_dtype_the_wire_cannot_carry_and_a_tensor_that_requires_grad(client, request):
    p = part(request)
    for dtype in (torch.complex64, torch.uint16):
        with pytest.raises(E.DtypeError) as err:
            client.put_samples(p, {**tokens(2), "token_mask": torch.ones(2, 4, dtype=dtype)})
        assert err.value.field == "token_mask"
    grads = torch.randn(2, 4, requires_grad=True) * 1
    meta = client.put_samples(p, {**tokens(2), "input_lengths": torch.tensor([3, 4]), "advantages": grads})
    got = client.read_columns(meta, ["advantages"], layout="jagged")["advantages"]
    assert torch.equal(got[0], grads.detach()[0, :3]) and torch.equal(got[1], grads.detach()[1])


def test_the_in_process_store_refuses_rows_of_one_field_written_with_two_dtypes():
    """It read bool and uint8 rows back as uint8, silently (torch.cat promotes)."""
    c = Client(default_registry(), MemoryTransport())
    meta = c.put_samples("d", {**tokens(2), "token_mask": torch.ones(2, 4, dtype=torch.bool)})
    c.write_columns(meta.subset([1]), {"token_mask": torch.ones(1, 4, dtype=torch.uint8)})
    with pytest.raises(E.ShapeError, match="different dtypes") as err:
        c.read_columns(meta, ["token_mask"])
    assert err.value.field == "token_mask"
