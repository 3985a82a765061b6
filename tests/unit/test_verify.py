"""verify.diff_fields is what the round-trip tests and the demo trust: it must see every difference."""

import torch

from rlplane import PackedTensor, default_registry
from rlplane.testing.verify import diff_fields, same_bits

REG = default_registry()


def test_same_bits_is_bitwise():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 == 0.0 numerically, not in bits
    assert not same_bits(a, a.to(torch.float64))
    assert not same_bits(a, a[:2])


def test_token_field_differences_are_found():
    ids = torch.arange(12, dtype=torch.int64).view(2, 6)
    lengths = [6, 3]
    read = ids.clone()
    read[1, 3:] = 0
    assert diff_fields(REG, {"input_ids": ids}, {"input_ids": read}, lengths) == []
    flipped = read.clone()
    flipped[1, 2] += 1
    assert "sample 1" in diff_fields(REG, {"input_ids": ids}, {"input_ids": flipped}, lengths)[0]
    bad_pad = read.clone()
    bad_pad[1, 5] = 9
    assert "padding" in diff_fields(REG, {"input_ids": ids}, {"input_ids": bad_pad}, lengths)[0]


def test_a_padded_read_with_more_rows_than_written_is_a_difference():
    """The read's rows were taken per written row, so a row more went unseen."""
    ids = torch.arange(16, dtype=torch.int64).view(2, 8)
    extra = torch.cat([ids, torch.zeros(1, 8, dtype=torch.int64)])
    said = diff_fields(REG, {"input_ids": ids}, {"input_ids": extra}, [8, 8])
    assert said == ["field 'input_ids': 3 rows read for 2 written"]
    assert diff_fields(REG, {"input_ids": ids}, {"input_ids": ids[:1]}, [8, 8])[0].endswith("1 rows read for 2 written")


def test_packed_differences_are_found():
    seg = torch.randn(4, 6)
    written = PackedTensor([seg, None])
    ok = PackedTensor([seg.to(torch.bfloat16), None])
    assert diff_fields(REG, {"pixel_values": written}, {"pixel_values": ok}) == []
    assert diff_fields(REG, {"pixel_values": written}, {"pixel_values": PackedTensor([seg, None])})  # not cast
    assert diff_fields(REG, {"pixel_values": written}, {"pixel_values": PackedTensor([None, None])})  # dropped
    assert diff_fields(REG, {"pixel_values": written}, {"pixel_values": PackedTensor([ok[0][0].view(6, 4), None])})


def test_a_field_that_never_came_back_is_reported():
    assert "not read back" in diff_fields(REG, {"sample_mask": torch.ones(2)}, {})[0]
    assert diff_fields(REG, {"sample_mask": torch.ones(2)}, {"sample_mask": torch.ones(2, 1)})
