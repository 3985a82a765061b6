"""Client over the in-memory transport: the stage flow a GRPO step runs."""

import pytest
import torch

from rlplane import PackedTensor, SampleMeta, default_registry
from rlplane.client import Client
from rlplane.errors import DtypeError, DuplicateSampleError, MissingDataError, ShapeError, UnregisteredFieldError
from rlplane.transports import MemoryTransport
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step


@pytest.fixture
def client():
    return Client(default_registry(), MemoryTransport())


def test_rollout_to_trainer_flow_is_bit_exact(client):
    w = vlm_step(batch=8, seqlen=128, seed=1)
    fields = dict(w.fields)
    adv = fields.pop("advantages")
    meta = client.put_samples("step", fields, tags=[{"reward": float(i)} for i in range(8)])
    assert meta.tags[3]["reward"] == 3.0 and meta.lengths == w.lengths.tolist()
    shards = meta.shard(2)
    for r, shard in enumerate(shards):
        got = client.read_columns(shard, stage="logprob")
        assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(got)
        lp = torch.zeros(len(shard), shard.pad_to_seqlen)
        shards[r] = client.write_columns(shard, {"prev_logprobs": lp, "reference_policy_logprobs": lp})
    full = client.write_columns(SampleMeta.concat(*shards), {"advantages": adv[[int(s.rsplit("-", 1)[1]) for s in SampleMeta.concat(*shards).sample_ids]]})
    out = client.read_columns(full.subset(sorted(range(8), key=lambda i: int(full.sample_ids[i].rsplit("-", 1)[1]))), stage="train")
    assert diff_fields(default_registry(), {**fields, "advantages": adv}, out, w.lengths) == []


def test_text_only_batch_reads_no_multimodal_field(client):
    meta = client.put_samples("t", text_step(batch=4, seqlen=32).fields)
    for stage in ("logprob", "ref_logprob"):
        assert not {"pixel_values", "mm_token_type_ids"} & set(client.fields_for_stage(stage, meta))
    assert client.fields_for_stage("logprob", "t") == client.fields_for_stage("logprob", meta)


def test_invalid_put_names_field_and_sample_and_stores_nothing(client):
    ok = client.put_samples("p", {"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 2])},
                            sample_ids=["a", "b"])
    bad = [
        ({"input_ids": torch.ones(2, 4, dtype=torch.int32), "input_lengths": torch.tensor([4, 2])}, DtypeError, "'input_ids'"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 6])}, ShapeError, "sample 'd'"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64), "input_lengths": torch.tensor([4, 2]), "pixel_vals": None},
         UnregisteredFieldError, "'pixel_vals'"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64)}, ShapeError, "needs each sample's length"),
    ]
    for fields, err, match in bad:
        with pytest.raises(err, match=match):
            client.put_samples("p", fields, sample_ids=["c", "d"])
    with pytest.raises(DuplicateSampleError):
        client.put_samples("p", {"input_lengths": torch.tensor([1, 1])}, sample_ids=["x", "a"])
    assert client.transport.describe("p").sample_ids == ["a", "b"]
    assert client.read_columns(ok, ["input_ids"])["input_ids"].shape == (2, 4)


def test_reading_cleared_or_unknown_samples_raises(client):
    meta = client.put_samples("p", {"sample_mask": torch.ones(3)})
    client.clear("p", meta.sample_ids[:1])
    with pytest.raises(MissingDataError, match=meta.sample_ids[0]):
        client.read_columns(meta, ["sample_mask"])
    with pytest.raises(MissingDataError, match="prev_logprobs"):
        client.read_columns(meta.slice(1, 3), stage="train")


def test_packed_field_with_empty_rows_comes_back_with_empty_rows(client):
    pv = PackedTensor([None, torch.randn(4, 8), None])
    meta = client.put_samples("p", {"pixel_values": pv})
    got = client.read_columns(meta, ["pixel_values"])["pixel_values"]
    assert got[0] is None and got[2] is None and got[1][0].dtype == torch.bfloat16
