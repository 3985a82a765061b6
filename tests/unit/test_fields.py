"""The field registry: declarations, stage queries, (de)serialisation."""

import pytest
import torch

from rlplane import FieldSpec, PackedTensor, Registry, default_registry
from rlplane.errors import (
    ContainerError,
    DtypeError,
    RegistryError,
    ShapeError,
    UnknownStageError,
    UnregisteredFieldError,
)
from rlplane.fields import MODEL_STAGES

MM = {"mm_token_type_ids", "token_type_ids", "pixel_values", "pixel_values_videos", "image_grid_thw",
      "video_grid_thw", "second_per_grid_ts", "input_features", "feature_attention_mask", "imgs_sizes", "num_frames"}


def test_default_registry_declares_the_grpo_vlm_profile():
    names = set(default_registry().names())
    assert {"input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs", "prev_logprobs",
            "reference_policy_logprobs", "advantages"} | MM <= names


@pytest.mark.parametrize("alignment,container", [("sample", "packed"), ("token", "packed"), ("token", "object"),
                                                 ("media", "dense"), ("media", "object"), ("bogus", "dense")])
def test_illegal_alignment_container_pairs_raise_at_register(alignment, container):
    spec = FieldSpec("x", alignment, container, {"train"})
    with pytest.raises(RegistryError, match="'x'"):
        Registry().register(spec)


def test_duplicate_name_raises():
    reg = Registry([FieldSpec("x", "sample", "dense", {"train"})])
    with pytest.raises(RegistryError, match="already registered"):
        reg.register(FieldSpec("x", "sample", "object", {"train"}))


def test_wire_dtype_must_be_floating_and_pad_must_fit_an_int_dtype():
    with pytest.raises(RegistryError, match="not floating"):
        Registry().register(FieldSpec("g", "media", "packed", {"train"}, wire_dtype="int32"))
    with pytest.raises(RegistryError, match="pad_value"):
        Registry().register(FieldSpec("ids", "token", "dense", {"train"}, dtype="int64", pad_value=0.5))


def test_media_field_read_by_one_model_pass_must_be_read_by_all():
    with pytest.raises(RegistryError, match="image-blind"):
        Registry().register(FieldSpec("pixel_values", "media", "packed", {"logprob", "train"}))


def test_unknown_stage_raises_and_lists_known_stages():
    with pytest.raises(UnknownStageError, match="trian") as err:
        default_registry().fields_for_stage("trian")
    assert "train" in err.value.known


@pytest.mark.parametrize("present", [{"pixel_values", "image_grid_thw", "mm_token_type_ids"},
                                     {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"},
                                     {"input_features", "feature_attention_mask"}])
def test_model_stages_get_the_same_multimodal_fields(present):
    reg = default_registry()
    per_stage = {s: set(reg.fields_for_stage(s, present)) & MM for s in MODEL_STAGES}
    assert per_stage["train"] == per_stage["logprob"] == per_stage["ref_logprob"] == present


def test_text_only_batch_requests_no_multimodal_field():
    reg = default_registry()
    for stage in MODEL_STAGES:
        fields = reg.fields_for_stage(stage, {"input_ids", "input_lengths"})
        assert not set(fields) & MM
        assert "input_ids" in fields


def test_stage_fields_include_required_ones_even_when_not_present():
    assert "prev_logprobs" in default_registry().fields_for_stage("train", present=set())


def test_present_with_unregistered_name_raises():
    with pytest.raises(UnregisteredFieldError, match="pixel_vals"):
        default_registry().fields_for_stage("train", {"pixel_vals"})


def test_round_trip_through_dict_keeps_version():
    reg = default_registry()
    again = Registry.from_dict(reg.to_dict())
    assert again.version == reg.version
    assert again["pixel_values"].wire_dtype == torch.bfloat16
    assert again["pixel_values"].stages == MODEL_STAGES


def test_version_changes_with_wire_content_not_with_doc():
    a = Registry([FieldSpec("x", "sample", "dense", {"train"}, doc="one")])
    b = Registry([FieldSpec("x", "sample", "dense", {"train"}, doc="two")])
    c = Registry([FieldSpec("x", "sample", "dense", {"train"}, dtype="int64")])
    assert a.version == b.version != c.version


def test_a_modality_registered_in_one_line_is_validated_stored_and_read_back():
    from rlplane import Client
    from rlplane.transports import MemoryTransport

    reg = default_registry()
    reg.register(FieldSpec("depth_maps", "media", "packed", MODEL_STAGES, dtype="float32", optional=True))
    assert "depth_maps" in reg.fields_for_stage("train", {"depth_maps"})
    maps = PackedTensor([torch.rand(2, 5, 7), None, torch.rand(1, 5, 7)])
    client = Client(reg, MemoryTransport())
    meta = client.put_samples("p", {"depth_maps": maps, "sample_mask": torch.ones(3)})
    got = client.read_columns(meta, ["depth_maps"])["depth_maps"]
    assert [r is None for r in got] == [False, True, False]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, maps) if b is not None)
    with pytest.raises(DtypeError, match="depth_maps"):
        client.put_samples("p", {"depth_maps": PackedTensor([torch.zeros(1, 5, 7, dtype=torch.int64)])})


def test_validate_names_container_dtype_and_batch():
    reg = default_registry()
    with pytest.raises(UnregisteredFieldError, match="'pixel_vals'"):
        reg.validate({"pixel_vals": PackedTensor([None])})
    with pytest.raises(ContainerError, match="'pixel_values'.*PackedTensor"):
        reg.validate({"pixel_values": torch.zeros(2, 4)})
    with pytest.raises(ContainerError, match="'input_ids'"):
        reg.validate({"input_ids": [[1, 2]]})
    with pytest.raises(DtypeError, match="'input_ids'.*int32"):
        reg.validate({"input_ids": torch.zeros(2, 4, dtype=torch.int32)})
    with pytest.raises(ShapeError, match="'sample_mask'.*batch size 3"):
        reg.validate({"input_ids": torch.zeros(2, 4, dtype=torch.int64), "sample_mask": torch.zeros(3)})
    assert reg.validate({"input_ids": torch.zeros(2, 4, dtype=torch.int64), "pixel_values": PackedTensor([None, None])}) == 2


def test_wire_dtype_payload_is_accepted_for_a_field_written_in_float32():
    reg = default_registry()
    assert reg.validate({"pixel_values": PackedTensor([torch.zeros(2, 3, dtype=torch.bfloat16)])}) == 1
    with pytest.raises(DtypeError):
        reg.validate({"pixel_values": PackedTensor([torch.zeros(2, 3, dtype=torch.float16)])})
