"""Scratch: encode buffers reused from one put to the next, never shared between two at once."""

import torch

from rlplane import Client, PackedTensor, default_registry
from rlplane.scratch import Scratch
from rlplane.transports import MemoryTransport


def test_a_buffer_is_reused_by_the_next_lease_and_never_by_a_concurrent_one():
    scratch = Scratch()
    with scratch.lease() as alloc:
        first = alloc("pixel_values", 100, torch.bfloat16)
        with scratch.lease() as other:  # a concurrent put of the same client
            second = other("pixel_values", 100, torch.bfloat16)
            assert second.data_ptr() != first.data_ptr()
    with scratch.lease() as alloc:  # one of the two is kept and reused
        again = alloc("pixel_values", 60, torch.bfloat16)
        assert again.data_ptr() in (first.data_ptr(), second.data_ptr()) and again.numel() == 60
        assert alloc("image_grid_thw", 6, torch.int64).numel() == 6
    with scratch.lease() as alloc:  # another dtype or more elements: new memory
        assert alloc("pixel_values", 60, torch.float32).data_ptr() not in (first.data_ptr(), second.data_ptr())


def test_kept_buffers_stay_under_the_limit():
    scratch = Scratch(max_bytes=1000)
    with scratch.lease() as alloc:
        alloc("a", 400, torch.uint8)
        alloc("b", 800, torch.uint8)
    assert scratch.nbytes <= 1000


def test_a_second_put_does_not_change_what_the_first_stored():
    client = Client(default_registry(), MemoryTransport())
    def fields(v):
        return {"input_ids": torch.ones(1, 2, dtype=torch.int64), "input_lengths": torch.tensor([2]),
                "pixel_values": PackedTensor([torch.full((2, 1176), v)])}
    first = client.put_samples("a", fields(1.0))
    client.put_samples("b", fields(2.0))
    got = client.read_columns(first, ["pixel_values"])["pixel_values"].as_tensor()
    assert torch.equal(got.float(), torch.full((2, 1176), 1.0))
