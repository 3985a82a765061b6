"""PackedTensor: rows keep their boundaries through every operation and the wire."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import PackedTensor
from rlplane.errors import ContainerError, ShapeError, WireFormatError
from rlplane.testing.verify import same_bits


def rows_equal(a: PackedTensor, b: PackedTensor) -> bool:
    if len(a) != len(b):
        return False
    for ra, rb in zip(a, b):
        ra, rb = ra or [], rb or []
        if len(ra) != len(rb) or not all(same_bits(x, y) for x, y in zip(ra, rb)):
            return False
    return True


def test_as_tensor_concatenates_segments_and_skips_empty_rows():
    a, b, c = torch.randn(4, 3), torch.randn(2, 3), torch.randn(5, 3)
    pt = PackedTensor([a, None, [b, c]])
    assert torch.equal(pt.as_tensor(), torch.cat([a, b, c]))
    assert pt[1] is None and len(pt[2]) == 2


def test_all_empty_rows_give_none_tensor_and_none_wire():
    pt = PackedTensor([None, [], None])
    assert pt.as_tensor() is None and pt.is_empty()
    nested, shapes = pt.to_wire()
    assert nested is None and shapes == [[], [], []]
    assert len(PackedTensor.from_wire(None, shapes)) == 3


def test_row_spanning_two_segments_with_different_trailing_dims_round_trips():
    pt = PackedTensor([[torch.randn(3, 4), torch.randn(2, 7)], None, torch.randn(1, 4)])
    nested, shapes = pt.to_wire()
    assert shapes == [[[3, 4], [2, 7]], [], [[1, 4]]]
    assert nested.values().numel() == 12 + 14 + 4  # nothing padded on the wire
    assert rows_equal(PackedTensor.from_wire(nested, shapes), pt)
    with pytest.raises(ShapeError, match="pad_to_max_shape"):
        pt.as_tensor()
    padded = PackedTensor(pt.rows, pad_to_max_shape=True).as_tensor()
    assert padded.shape == (6, 7)
    assert torch.equal(padded[3:5, :7], pt[0][1]) and torch.equal(padded[:3, 4:], torch.zeros(3, 3))


def test_mixed_rank_rows_travel_on_the_wire():
    pt = PackedTensor([torch.randn(2, 3), torch.tensor(1.5), torch.randn(2, 2, 2)])
    nested, shapes = pt.to_wire()
    assert shapes == [[[2, 3]], [[]], [[2, 2, 2]]]
    assert rows_equal(PackedTensor.from_wire(nested, shapes), pt)


def test_dim_to_pack_1_like_smolvlm():
    a, b = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
    pt = PackedTensor([a, None, b], dim_to_pack=1)
    assert torch.equal(pt.as_tensor(), torch.cat([a, b], dim=1))
    nested, shapes = pt.to_wire()
    back = PackedTensor.from_wire(nested, shapes, dim_to_pack=1)
    assert back.dim_to_pack == 1 and torch.equal(back.as_tensor(), pt.as_tensor())


def test_from_wire_rejects_dense_input_and_count_mismatch():
    pt = PackedTensor([torch.randn(2, 3), torch.randn(2, 3)])
    nested, shapes = pt.to_wire()
    with pytest.raises(WireFormatError, match="dense"):
        PackedTensor.from_wire(torch.randn(2, 6), shapes)
    with pytest.raises(WireFormatError, match="2 rows on the wire but 3"):
        PackedTensor.from_wire(nested, shapes + [[]])
    with pytest.raises(WireFormatError, match="elements"):
        PackedTensor.from_wire(nested, [[[2, 3]], [[3, 3]]])


def test_to_dtype_casts_floating_only():
    pt = PackedTensor([[torch.randn(2, 3)], None])
    grid = PackedTensor([torch.tensor([[1, 4, 6]]), None])
    assert pt.to_dtype(torch.bfloat16).dtype == torch.bfloat16
    assert grid.to_dtype(torch.bfloat16).dtype == torch.int64


def test_slice_select_concat_keep_row_boundaries():
    rows = [torch.randn(i + 1, 2) if i % 3 else None for i in range(7)]
    pt = PackedTensor(rows)
    assert rows_equal(PackedTensor.concat([pt.slice(0, 3), pt[3:]]), pt)
    picked = pt.select([5, 0, 2])
    assert picked[1] is None and torch.equal(picked[0][0], rows[5])


def test_bad_rows_raise_typed_errors():
    with pytest.raises(ContainerError, match="sample 1"):
        PackedTensor([torch.zeros(1), "img"])
    with pytest.raises(ContainerError, match="one dtype"):
        PackedTensor([torch.zeros(1), torch.zeros(1, dtype=torch.int64)])
    with pytest.raises(ContainerError, match="per sample"):
        PackedTensor(torch.zeros(3, 4))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
shape = st.lists(st.integers(0, 5), min_size=0, max_size=3)
row = st.one_of(st.none(), st.lists(shape, min_size=1, max_size=3))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row, min_size=0, max_size=8), dtype=st.sampled_from(DTYPES), dim=st.integers(0, 2))
def test_wire_round_trip_over_random_geometries(rows, dtype, dim):
    def make(s):
        return (torch.randn(s) * 10).to(dtype) if s else (torch.randn(()) * 10).to(dtype)
    pt = PackedTensor([None if r is None else [make(s) for s in r] for r in rows], dim_to_pack=dim)
    nested, shapes = pt.to_wire()
    assert shapes == pt.shapes()
    back = PackedTensor.from_wire(nested, shapes, dim_to_pack=dim)
    assert rows_equal(back, pt)
    assert back.dim_to_pack == dim
    if nested is not None:
        assert nested.values().numel() == sum(s.numel() for r in pt for s in (r or []))
