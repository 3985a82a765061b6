"""Rows' wire geometry as arrays (rlplane.geometry) and as the controller's index keeps it.

What a user would notice if this broke: a read gives a sample another sample's shape, a
malformed header crashes the controller instead of a typed error, or a 4096-sample put
builds 4096 Python lists per field again (the cost the dense form exists to remove).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplane.codec import decode, encode
from rlplane.errors import ShapeError, WireFormatError
from rlplane.fields import default_registry
from rlplane.geometry import Geometry
from rlplane.testing.workloads import text_step, vlm_step
from rlplane_service.native.index import FieldIndex


def test_dense_geometry_reads_back_as_the_rows_encode_used_to_write():
    g = Geometry.token(np.array([5, 0, 9]), rest=[3])
    assert g.tolist() == [[5, 3], [0, 3], [9, 3]]
    assert Geometry.uniform([2, 2], 2).tolist() == [[2, 2], [2, 2]]
    assert Geometry.uniform([], 3).tolist() == [[], [], []]
    back = Geometry.from_wire(g.to_wire())
    assert back.dense and back.tolist() == g.tolist()
    assert g.take(np.array([2, 0])).tolist() == [[9, 3], [5, 3]]


def test_several_trailing_shapes_round_trip_and_are_not_uniform():
    g = Geometry(np.array([1, 2, 3]), [(4,), (5,)], np.array([0, 1, 0], np.int32))
    assert g.tolist() == [[1, 4], [2, 5], [3, 4]]
    assert g.trailing() is None and g.first_other() == 1
    assert Geometry.from_wire(g.to_wire()).tolist() == g.tolist()
    assert g.take(np.array([0, 2])).trailing() == (4,)


@pytest.mark.parametrize("bad", [
    {"n": 2, "l": b"\x00" * 8, "k": None, "t": [[]]},                      # 1 leading dim for 2 rows
    {"n": 1, "l": np.array([-1], "<i8").tobytes(), "k": None, "t": [[]]},  # negative length
    {"n": 1, "l": None, "k": np.array([3], "<i4").tobytes(), "t": [[1], [2]]},  # shape index out of range
    {"n": 1, "l": None, "k": None, "t": [[1], [2]]},                       # several shapes, no index
    {"n": 1, "l": None, "k": None, "t": [["x"]]},                          # not a shape
    {"n": 1, "l": None, "k": None, "t": []},                               # no shape at all
    {"n": -1, "l": None, "k": None, "t": [[]]},
    {"n": 1, "l": None, "t": [[]]},                                        # a key missing
    "rows",
])
def test_a_malformed_wire_geometry_is_a_typed_error_naming_the_field(bad):
    with pytest.raises(WireFormatError) as err:
        Geometry.from_wire(bad, "input_ids")
    assert err.value.field == "input_ids"


def test_encode_keeps_dense_fields_as_arrays_and_packed_fields_as_rows():
    work = vlm_step(batch=6, seqlen=64, seed=3)
    enc = encode(default_registry(), work.fields, work.lengths)
    cols = enc.columns
    assert cols["input_ids"].geom.dense and cols["input_ids"].geom.lead.tolist() == work.lengths.tolist()
    assert cols["input_lengths"].geom.dense and cols["input_lengths"].geom.lead is None
    assert not cols["pixel_values"].geom.dense
    # The tags say the same, built when asked for.
    assert enc.tags[2]["_rlplane_wire"]["input_ids"] == [int(work.lengths[2])]
    out = decode(default_registry(), cols, enc.tags, "padded", pad_to_seqlen=64)
    assert torch.equal(out["input_ids"], work.fields["input_ids"] * (torch.arange(64) < work.lengths[:, None]))


def test_decode_names_the_sample_whose_trailing_shape_differs():
    work = text_step(batch=3, seqlen=8, seed=1)
    enc = encode(default_registry(), {"sample_mask": work.fields["sample_mask"]})
    col = enc.columns["sample_mask"]
    other = col.with_meta(col.sums, Geometry(None, [(), (1,)], np.array([0, 0, 1], np.int32)))
    with pytest.raises((ShapeError, WireFormatError)) as err:
        decode(default_registry(), {"sample_mask": other}, enc.tags, sample_ids=["a", "b", "c"])
    assert err.value.sample == "c"


def test_geometry_from_foreign_tags_is_checked_as_one_array():
    work = text_step(batch=4, seqlen=8, seed=2)
    enc = encode(default_registry(), {"input_ids": work.fields["input_ids"]}, work.lengths)
    tags = [dict(t) for t in enc.tags]  # what a tq backend hands back: plain lists
    plain = enc.columns["input_ids"].with_meta(None, None)
    out = decode(default_registry(), {"input_ids": plain}, tags, "jagged")
    assert [len(r) for r in out["input_ids"].unbind()] == work.lengths.tolist()
    tags[1]["_rlplane_wire"]["input_ids"] = [3.5]
    with pytest.raises(WireFormatError) as err:
        decode(default_registry(), {"input_ids": plain}, tags, "jagged", sample_ids=list("abcd"))
    assert err.value.sample == "b"


def test_the_index_keeps_dense_rows_as_arrays_and_gives_back_what_was_stored():
    fi = FieldIndex.empty(8)
    fi.set_geometry(np.array([0, 1, 2]), Geometry.token(np.array([4, 5, 6]), [2]))
    fi.set_geometry(np.array([3, 4]), Geometry.token(np.array([7, 8]), [3]))
    fi.set_geometry(np.array([5]), Geometry.of_rows([{"d": 0, "p": False, "s": [[2, 3]]}]))
    assert fi.geom[:5].tolist() == [None] * 5  # no object per dense row
    got = fi.geometry(np.array([4, 0]))
    assert got.dense and got.tolist() == [[8, 3], [4, 2]]
    mixed = fi.geometry(np.array([5, 1]))
    assert mixed.tolist() == [{"d": 0, "p": False, "s": [[2, 3]]}, [5, 2]]
    fi.forget(np.array([0]))
    fi.set_geometry(np.array([0]), Geometry.uniform([9], 1))
    assert fi.geometry(np.array([0])).tolist() == [[9]]


def test_geometries_put_together_stay_dense_with_one_table_and_fall_back_to_rows_otherwise():
    a, b = Geometry.token(np.array([5, 0]), rest=[3]), Geometry.token(np.array([9]), rest=[3])
    both = Geometry.concat([a, b])
    assert both.dense and both.tolist() == [[5, 3], [0, 3], [9, 3]]
    several = Geometry(np.array([1, 2]), [(4,), (5,)], np.array([1, 0], np.int32))
    mixed = Geometry.concat([a, several, Geometry.of_rows([{"d": 0, "p": False, "s": [[2]]}])])
    assert not mixed.dense
    assert mixed.tolist() == [[5, 3], [0, 3], [1, 5], [2, 4], {"d": 0, "p": False, "s": [[2]]}]
    assert Geometry.concat([Geometry.uniform([2], 2), Geometry.uniform([2], 1)]).tolist() == [[2], [2], [2]]
