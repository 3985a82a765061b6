"""The codec: encode -> transport -> decode is bit-exact; bad input fails loudly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import Client, FieldSpec, PackedTensor, Registry, default_registry
from rlplane.codec import WIRE_TAG, Prepared, decode, encode
from rlplane.column import Column
from rlplane.errors import (ContainerError, DtypeError, InvalidArgumentError, ShapeError, UnregisteredFieldError,
                            WireFormatError)
from rlplane.transports import MemoryTransport
from rlplane.testing.verify import diff_fields, same_bits
from rlplane.testing.workloads import vlm_step


def through_store(reg, fields, lengths, layout="padded", pad=None):
    enc = encode(reg, fields, lengths)
    ids = [f"s{i}" for i in range(len(enc.tags))]
    t = MemoryTransport()
    t.put("p", ids, enc.columns, enc.tags, create=True)
    cols, tags = t.get("p", ids, list(enc.columns))
    return decode(reg, cols, tags, layout, pad)


@pytest.fixture(scope="module")
def vlm():
    w = vlm_step(batch=6, seqlen=64, seed=3)
    rows = w.fields["pixel_values"].rows
    rows[0], rows[1] = None, [torch.randn(20, 1176), torch.randn(6, 1176)]  # a text-only row and a two-image row
    w.fields["pixel_values"] = PackedTensor(rows)
    grids = w.fields["image_grid_thw"].rows
    grids[0], grids[1] = None, torch.tensor([[1, 4, 5], [1, 2, 3]])
    w.fields["image_grid_thw"] = PackedTensor(grids)
    return w


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_full_vlm_batch_round_trips_bit_exactly(vlm, layout):
    reg = default_registry()
    out = through_store(reg, vlm.fields, vlm.lengths, layout)
    assert set(out) == set(vlm.fields)
    assert diff_fields(reg, vlm.fields, out, vlm.lengths) == []
    pv = out["pixel_values"]
    assert pv[0] is None and [s.shape for s in pv[1]] == [(20, 1176), (6, 1176)]
    assert pv.dtype == torch.bfloat16 and out["image_grid_thw"].dtype == torch.int64
    assert same_bits(out["image_grid_thw"][1][0], torch.tensor([[1, 4, 5], [1, 2, 3]]))
    if layout == "jagged":
        assert out["input_ids"].is_nested
        assert [r.numel() for r in out["input_ids"].unbind()] == vlm.lengths.tolist()


def test_a_packed_read_gives_every_samples_tokens_one_after_another_and_encodes_back(vlm):
    reg = default_registry()
    packed, jagged = through_store(reg, vlm.fields, vlm.lengths, "packed"), through_store(reg, vlm.fields, vlm.lengths, "jagged")
    tokens = sorted(f for f in vlm.fields if reg.get(f).alignment == "token")
    assert tokens and all(not packed[f].is_nested and same_bits(packed[f], jagged[f].values()) for f in tokens)
    assert packed["input_ids"].shape[0] == int(vlm.lengths.sum())
    assert [s.shape for s in packed["pixel_values"][1]] == [(20, 1176), (6, 1176)]  # other fields as in any layout
    rows = {f: packed[f] for f in tokens}
    enc = encode(reg, {**rows, "input_lengths": vlm.lengths}, prepared=Prepared(6, vlm.lengths), packed=frozenset(tokens))
    back = decode(reg, enc.columns, enc.tags, "jagged")
    assert all(same_bits(back[f].values(), jagged[f].values()) for f in tokens)
    with pytest.raises(ShapeError, match="packed rows") as err:  # one token short of the lengths' sum
        encode(reg, {"input_ids": rows["input_ids"][1:], "input_lengths": vlm.lengths}, prepared=Prepared(6, vlm.lengths),
               packed=frozenset({"input_ids"}))
    assert err.value.field == "input_ids"
    with pytest.raises(DtypeError, match="float64") as err:  # a dtype the registry does not declare
        encode(reg, {"generation_logprobs": rows["generation_logprobs"].double(), "input_lengths": vlm.lengths},
               prepared=Prepared(6, vlm.lengths), packed=frozenset({"generation_logprobs"}))
    assert err.value.field == "generation_logprobs"
    client = Client(reg, MemoryTransport())
    meta = client.put_samples("p", vlm.fields)
    assert same_bits(client.read_columns(meta, ["input_ids"], layout="packed")["input_ids"], packed["input_ids"])


def test_padded_read_uses_pad_value_and_pad_to_seqlen(vlm):
    reg = default_registry()
    reg2 = Registry([FieldSpec(s.name, s.alignment, s.container, s.stages, s.dtype, s.wire_dtype,
                               -100 if s.name == "input_ids" else s.pad_value, s.optional) for s in reg])
    out = through_store(reg2, vlm.fields, vlm.lengths, pad=80)
    ids = out["input_ids"]
    assert ids.shape == (6, 80)
    n = int(vlm.lengths[0])
    assert torch.equal(ids[0, :n], vlm.fields["input_ids"][0, :n]) and bool((ids[0, n:] == -100).all())
    with pytest.raises(ShapeError, match="pad_to_seqlen=3"):
        through_store(reg, vlm.fields, vlm.lengths, pad=3)


def test_token_fields_are_cut_to_length_on_the_wire(vlm):
    enc = encode(default_registry(), {"input_ids": vlm.fields["input_ids"]}, vlm.lengths)
    assert enc.columns["input_ids"].values.numel() == int(vlm.lengths.sum())
    assert enc.tags[2][WIRE_TAG]["input_ids"] == [int(vlm.lengths[2])]


def test_token_fields_of_one_read_with_different_lengths_each_pad_to_their_own():
    """A read's token fields share one mask of real tokens when their lengths agree; rows of
    other lengths (as two puts wrote them) get their own, never another field's."""
    reg = default_registry()
    short, long = torch.tensor([1, 3, 2]), torch.tensor([4, 1, 3])
    a = encode(reg, {"input_ids": torch.arange(12).reshape(3, 4) + 1}, short)
    b = encode(reg, {"advantages": torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1}, long)
    c = encode(reg, {"token_mask": torch.ones(3, 4)}, short)
    cols = {**a.columns, **b.columns, **c.columns}
    out = decode(reg, cols, a.tags)
    for name, lens, width in (("input_ids", short, 3), ("advantages", long, 4), ("token_mask", short, 3)):
        got = out[name]
        assert got.shape == (3, width), name
        real = torch.arange(width)[None, :] < lens[:, None]
        assert bool((got[~real] == 0).all()) and bool((got[real] != 0).all()), name


def test_media_fields_are_never_cut_to_seqlen():
    reg = default_registry()
    pv = PackedTensor([torch.randn(500, 8)])  # far more rows than tokens
    out = through_store(reg, {"input_ids": torch.ones(1, 4, dtype=torch.int64), "pixel_values": pv}, [2])
    assert out["pixel_values"][0][0].shape == (500, 8)


def test_zero_row_shard_decodes_to_empty(vlm):
    reg = default_registry()
    enc = encode(reg, vlm.fields, vlm.lengths)
    t = MemoryTransport()
    t.put("p", [f"s{i}" for i in range(6)], enc.columns, enc.tags, create=True)
    cols, tags = t.get("p", [], list(enc.columns))
    out = decode(reg, cols, tags)
    assert out["input_ids"].shape[0] == 0 and out["sample_mask"].shape == (0,)
    assert len(out["pixel_values"]) == 0
    assert decode(reg, cols, tags, "jagged")["input_ids"].shape[0] == 0


def test_all_none_packed_field_is_not_written():
    reg = default_registry()
    enc = encode(reg, {"input_ids": torch.ones(2, 3, dtype=torch.int64), "pixel_values": PackedTensor([None, None])}, [3, 1])
    assert "pixel_values" not in enc.columns
    assert "pixel_values" not in enc.tags[0][WIRE_TAG]


def test_bf16_wire_cast_leaves_int_grids_alone():
    reg = default_registry()
    enc = encode(reg, {"pixel_values": PackedTensor([torch.randn(4, 6)]),
                       "image_grid_thw": PackedTensor([torch.tensor([[1, 2, 2]])]),
                       "sample_mask": torch.ones(1)}, None)
    assert enc.columns["pixel_values"].dtype == torch.bfloat16
    assert enc.columns["image_grid_thw"].dtype == torch.int64
    assert enc.columns["sample_mask"].dtype == torch.float32


def test_one_d_sample_field_never_goes_bare_and_reads_back_b():
    reg = default_registry()
    lens = torch.tensor([5, 7, 2])
    enc = encode(reg, {"input_lengths": lens}, None)
    assert [t[WIRE_TAG]["input_lengths"] for t in enc.tags] == [[], [], []]
    out = through_store(reg, {"input_lengths": lens}, None)
    assert out["input_lengths"].shape == (3,) and torch.equal(out["input_lengths"], lens)


def test_object_fields_travel_as_msgpack():
    reg = Registry([FieldSpec("meta", "sample", "object", {"train"})])
    vals = [{"prompt": "hi", "score": 1.5, "ok": True, "ids": [1, 2]}, None, b"\x00\xff", {1: "int key"}]
    out = through_store(reg, {"meta": vals}, None)
    assert out["meta"] == vals


def test_object_field_rejects_non_msgpack_values_naming_field_and_sample():
    reg = Registry([FieldSpec("meta", "sample", "object", {"train"})])
    with pytest.raises(ContainerError, match="'meta', sample 1.*set"):
        encode(reg, {"meta": ["ok", {1, 2}]}, None)
    with pytest.raises(ContainerError, match="sample 0"):
        encode(reg, {"meta": [torch.zeros(1)]}, None)


def test_unregistered_field_illegal_container_and_length_mismatch_name_field_and_sample():
    reg = default_registry()
    with pytest.raises(UnregisteredFieldError, match="'pixel_vals'"):
        encode(reg, {"pixel_vals": PackedTensor([None])}, None)
    with pytest.raises(ContainerError, match="'pixel_values'"):
        encode(reg, {"pixel_values": [torch.zeros(1, 3)]}, None)
    with pytest.raises(ShapeError, match="'input_ids', sample 's1'.*length 9"):
        encode(reg, {"input_ids": torch.ones(2, 4, dtype=torch.int64)}, [3, 9], sample_ids=["s0", "s1"])
    with pytest.raises(ShapeError, match="'input_ids'.*needs each sample's length"):
        encode(reg, {"input_ids": torch.ones(2, 4, dtype=torch.int64)}, None)
    with pytest.raises(ShapeError, match="'input_ids'.*3 lengths for a batch of 2"):
        encode(reg, {"input_ids": torch.ones(2, 4, dtype=torch.int64)}, [1, 2, 3])
    jag = torch.nested.nested_tensor([torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)], layout=torch.jagged)
    with pytest.raises(ShapeError, match="sample 1.*2 tokens"):
        encode(reg, {"input_ids": jag}, [3, 4])


def test_jagged_input_is_accepted_for_token_fields():
    reg = default_registry()
    rows = [torch.arange(3), torch.arange(5)]
    jag = torch.nested.nested_tensor(rows, layout=torch.jagged)
    out = through_store(reg, {"input_ids": jag}, [3, 5])
    assert torch.equal(out["input_ids"][1], rows[1]) and bool((out["input_ids"][0, 3:] == 0).all())


def test_decode_rejects_corrupt_or_foreign_columns(vlm):
    reg = default_registry()
    enc = encode(reg, {"input_ids": vlm.fields["input_ids"]}, vlm.lengths)
    assert decode(reg, enc.columns, [{} for _ in enc.tags])["input_ids"].shape[0] == 6  # the column carries its geometry
    bare = {k: Column(c.values, c.offsets) for k, c in enc.columns.items()}  # a transport that keeps only bytes
    with pytest.raises(WireFormatError, match="no wire geometry"):
        decode(reg, bare, [{} for _ in enc.tags])
    bad = [dict(t) for t in enc.tags]
    bad[4] = {WIRE_TAG: {"input_ids": [int(vlm.lengths[4]) + 1]}}
    with pytest.raises(WireFormatError, match="sample 4"):
        decode(reg, bare, bad)
    geom = list(enc.columns["input_ids"].geom)
    geom[4] = [int(vlm.lengths[4]) + 1]
    with pytest.raises(WireFormatError, match="sample 4"):  # a column's own geometry is checked the same way
        decode(reg, {"input_ids": Column(bare["input_ids"].values, bare["input_ids"].offsets, geom=geom)}, enc.tags)
    with pytest.raises(InvalidArgumentError, match="layout"):
        decode(reg, enc.columns, enc.tags, layout="ragged")


def test_dense_rows_of_different_shapes_refuse_to_stack():
    reg = Registry([FieldSpec("emb", "sample", "dense", {"train"})])
    a, b = encode(reg, {"emb": torch.zeros(1, 3)}, None), encode(reg, {"emb": torch.zeros(1, 4)}, None)
    t = MemoryTransport()
    t.put("p", ["a"], a.columns, a.tags, create=True)
    t.put("p", ["b"], b.columns, b.tags, create=True)
    cols, tags = t.get("p", ["a", "b"], ["emb"])
    with pytest.raises(ShapeError, match="'emb', sample 1"):
        decode(reg, cols, tags)


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int64, torch.int32, torch.uint8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(0, 6),
    seq=st.integers(1, 12),
    rest=st.lists(st.integers(1, 3), max_size=2),
    dtype=st.sampled_from(FLOATS + INTS),
    wire=st.sampled_from([None, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_codec_round_trip_over_random_geometries_and_dtypes(batch, seq, rest, dtype, wire, data):
    stages = {"collate"}
    floating = dtype.is_floating_point
    reg = Registry([
        FieldSpec("tok", "token", "dense", stages, wire_dtype=wire if floating else None),
        FieldSpec("smp", "sample", "dense", stages, wire_dtype=wire if floating else None),
        FieldSpec("med", "media", "packed", stages, wire_dtype=wire if floating else None),
    ])
    lengths = data.draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
    def rnd(*shape):
        return (torch.randn(*shape) * 50).to(dtype)
    media_rows = [data.draw(st.one_of(st.none(), st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=2)))
                  for _ in range(batch)]
    fields = {
        "tok": rnd(batch, seq, *rest),
        "smp": rnd(batch, *rest),
        "med": PackedTensor([None if r is None else [rnd(*s) for s in r] for r in media_rows]),
    }
    for layout in ("padded", "jagged"):
        out = through_store(reg, fields, lengths, layout)
        if batch == 0:  # a 0-row read has no row to tell its trailing dims: it must just not crash
            assert out["smp"].shape[0] == 0 and "med" not in out  # an all-empty packed field is not written
            continue
        assert diff_fields(reg, fields, out, lengths) == []
        assert out["smp"].shape == (batch, *rest)


def test_decode_checks_every_row_against_its_writers_digest_naming_partition_sample_field():
    from rlplane.errors import IntegrityError

    fields = {"input_ids": torch.arange(12).reshape(2, 6), "input_lengths": torch.tensor([6, 3])}
    enc = encode(default_registry(), fields, [6, 3])
    assert decode(default_registry(), enc.columns, enc.tags, sample_ids=["a", "b"])  # intact: reads back
    enc.columns["input_ids"].values[7] += 1  # a flipped value in sample b's row
    with pytest.raises(IntegrityError) as err:
        decode(default_registry(), enc.columns, enc.tags, sample_ids=["a", "b"], partition="step-0")
    msg = str(err.value)
    assert "sample 'b'" in msg and "field 'input_ids'" in msg and "partition 'step-0'" in msg
    # The same digests ride in the tags (what the tq backends keep): checked from there too.
    plain = {k: c.with_meta(None, c.geom) for k, c in enc.columns.items()}
    with pytest.raises(IntegrityError):
        decode(default_registry(), plain, [dict(t) for t in enc.tags], sample_ids=["a", "b"])


def test_a_token_field_of_samples_without_tokens_encodes_to_an_empty_column_any_store_can_take():
    """An empty selection came out with stride 0: TransferQueue's byte view of it failed
    (an untyped TransportError for write_columns on samples of no tokens, backend simple)."""
    enc = encode(default_registry(), {"advantages": torch.ones(2, 4)}, torch.tensor([0, 0]), sample_ids=["a", "b"])
    values = enc.columns["advantages"].values
    assert values.numel() == 0 and values.stride() == (1,)
    assert values.view(torch.uint8).numel() == 0
