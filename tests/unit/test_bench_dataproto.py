"""The Mooncake DataProto bench row's conversion and check (no master needed): a
DataProto holds what rlplane stores, and the check catches a changed bit or row."""

import numpy as np
import torch
from rlplane.fields import default_registry
from rlplane.testing.workloads import vlm_step
from rlplane_tools.bench.dataproto import dataproto_of, same_dataproto


def test_dataproto_holds_the_stored_dtypes_and_one_array_per_sample():
    work = vlm_step(batch=4, seqlen=64, seed=3)
    dp = dataproto_of(default_registry(), work.fields)
    assert dp["batch"]["input_ids"].shape == (4, 64)
    pix = dp["non_tensor_batch"]["pixel_values"]
    assert pix.dtype == object and len(pix) == 4
    for row, want in zip(pix, work.fields["pixel_values"].rows):
        assert row.dtype == np.uint16  # the bits of bf16: DataProto's codecs refuse bf16
        n = 0 if not want else sum(t.shape[0] for t in want)
        assert row.shape == (n, 1176)
        if want:
            bf16 = torch.cat(want).to(torch.bfloat16).view(torch.uint16).numpy()
            assert np.array_equal(row, bf16)


def test_the_check_names_a_field_whose_bits_or_rows_differ():
    dp = dataproto_of(default_registry(), vlm_step(batch=4, seqlen=64, seed=3).fields)
    assert same_dataproto(dp, dp) == []
    rows = [0, 2]
    shard = {"batch": {"input_ids": dp["batch"]["input_ids"][rows]},
             "non_tensor_batch": {"pixel_values": dp["non_tensor_batch"]["pixel_values"][rows]}}
    fields = ["input_ids", "pixel_values"]
    assert same_dataproto(dp, shard, rows, fields) == []
    assert same_dataproto(dp, shard, [0, 1], fields) != []  # the wrong rows
    assert any("advantages" in p for p in same_dataproto(dp, shard, rows))  # a field left out
    bad = {"batch": dict(dp["batch"], input_ids=dp["batch"]["input_ids"].clone()), "non_tensor_batch": dp["non_tensor_batch"]}
    bad["batch"]["input_ids"][1, 0] ^= 1
    assert [p for p in same_dataproto(dp, bad) if "input_ids" in p]
    bad["batch"]["input_ids"] = None  # what Mooncake 0.3.13 returned for a 64 MB field (text-scale B=8192)
    assert same_dataproto(dp, bad) == ["DataProto field 'input_ids' came back as None"]


def test_the_row_converts_the_batch_it_is_given_even_where_a_freed_batchs_id_is_reused():
    """Found as a CI failure: the row cached its conversion under id(batch); a new batch at a
    freed one's address was put as the old one's bytes and the check blamed the peer."""
    from types import SimpleNamespace

    from rlplane_tools.bench.dataproto import MooncakeDataProto

    path = MooncakeDataProto.__new__(MooncakeDataProto)  # the conversion only: no master, no store
    path.registry, path._held = default_registry(), None
    for seed in range(20):
        batch = SimpleNamespace(work=vlm_step(batch=2, seqlen=16, seed=seed))
        assert same_dataproto(dataproto_of(path.registry, batch.work.fields), path._dataproto(batch)) == []
        del batch
