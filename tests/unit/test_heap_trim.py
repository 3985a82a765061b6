"""A storage unit gives freed heap pages back to the OS (rlplane_service.native.heap).

What an operator would notice if this broke: a unit's resident memory climbing to its
largest burst and staying there (the soak's RSS line), or a unit trimming on every
request (latency)."""

from __future__ import annotations

import numpy as np

from rlplane.wire import ints
from rlplane_service.native.heap import HeapTrim
from rlplane_service.native.unit import UnitCore


def test_trims_only_after_data_moved_and_at_most_every_interval():
    trim = HeapTrim(every_s=2.0)
    assert trim.available  # glibc here; elsewhere it is a no-op
    t0 = trim._last
    assert not trim.tick(t0 + 10)  # nothing moved: nothing to give back
    trim.moved()
    assert not trim.tick(t0 + 1)  # too soon
    assert trim.tick(t0 + 3)
    assert not trim.tick(t0 + 10)  # clean again
    trim.moved()
    assert not trim.tick(t0 + 4)  # within every_s of the last trim
    assert trim.tick(t0 + 5.5) and trim.trims == 2


def test_a_unit_marks_its_heap_after_a_write_and_trims_between_requests():
    unit = UnitCore("u", 1 << 20, share=False)
    unit.heap.every_s = 0.0
    unit.tick()
    assert unit.heap.trims == 0
    off = ints(np.array([0, 4, 8]))
    unit.op_alloc({"b": 7, "f": [["input_ids", "int64", 64]]}, {}, [off])
    unit.op_free({"b": ints([7])}, {}, [])
    unit.tick()
    assert unit.heap.trims == 1
    assert unit.alloc.used_bytes == 0  # the packed block record gave back every extent


def test_a_packed_block_record_answers_as_the_fields_were_stored():
    unit = UnitCore("u", 1 << 20, share=False)
    offs = [ints(np.array([0, 3, 5])), ints(np.array([0, 1, 2]))]
    where = unit.op_alloc({"b": 9, "f": [["a", "int64", 40], ["b", "float32", 8]]}, {}, offs)[0]["x"]
    unit.slab.u8[where["a"] : where["a"] + 40] = np.arange(5, dtype=np.int64).view(np.uint8)
    cols = unit.op_block({"b": 9}, {}, [])[1]
    assert cols["a"].offsets.tolist() == [0, 3, 5] and cols["b"].offsets.tolist() == [0, 1, 2]
    assert cols["a"].values.tolist() == [0, 1, 2, 3, 4] and str(cols["b"].values.dtype) == "float32"
