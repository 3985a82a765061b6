"""MemoryTransport: the reference semantics every transport must keep."""

import pytest
import torch

from rlplane.column import Column
from rlplane.errors import DuplicateSampleError, MissingDataError, ShapeError
from rlplane.transports import MemoryTransport


def col(*rows):
    return Column.from_rows([torch.tensor(r, dtype=torch.int64) for r in rows])


def test_get_returns_rows_in_requested_order_and_merged_tags():
    t = MemoryTransport()
    t.put("p", ["a", "b"], {"x": col([1, 2], [3])}, [{"k": 1}, {"k": 2}], create=True)
    t.put("p", ["b"], {"y": col([9])}, [{"z": 5}], create=False)
    cols, tags = t.get("p", ["b", "a"], ["x"])
    assert [r.tolist() for r in cols["x"].rows()] == [[3], [1, 2]]
    assert tags == [{"k": 2, "z": 5}, {"k": 1}]


def test_missing_sample_or_field_raises_never_partial():
    t = MemoryTransport()
    t.put("p", ["a", "b"], {"x": col([1], [2])}, [{}, {}], create=True)
    t.put("p", ["a"], {"y": col([1])}, [{}], create=False)
    with pytest.raises(MissingDataError) as err:
        t.get("p", ["a", "b", "c"], ["x", "y"])
    assert err.value.missing == {"b": ["y"], "c": []}
    assert "'b' lacks ['y']" in str(err.value) and "'c'" in str(err.value)
    with pytest.raises(MissingDataError):
        t.get("nope", ["a"], ["x"])


def test_failed_put_stores_nothing():
    t = MemoryTransport()
    t.put("p", ["a"], {"x": col([1])}, [{}], create=True)
    with pytest.raises(DuplicateSampleError, match="'a'"):
        t.put("p", ["b", "a"], {"x": col([2], [3])}, [{}, {}], create=True)
    with pytest.raises(MissingDataError, match="'c'"):
        t.put("p", ["a", "c"], {"y": col([2], [3])}, [{}, {}], create=False)
    with pytest.raises(ShapeError, match="'x'"):
        t.put("p", ["d", "e"], {"x": col([2])}, [{}, {}], create=True)
    info = t.describe("p")
    assert info.sample_ids == ["a"] and info.fields == {"x": 1}


def test_stored_bytes_do_not_alias_the_callers_or_the_readers():
    t = MemoryTransport()
    src = col([1, 2])
    t.put("p", ["a"], {"x": src}, [{}], create=True)
    src.values.fill_(7)
    got, _ = t.get("p", ["a"], ["x"])
    assert got["x"].values.tolist() == [1, 2]
    got["x"].values.fill_(0)
    assert t.get("p", ["a"], ["x"])[0]["x"].values.tolist() == [1, 2]


def test_clear_partition_and_samples():
    t = MemoryTransport()
    t.put("p", ["a", "b"], {"x": col([1], [2])}, [{}, {}], create=True)
    t.put("q", ["a"], {"x": col([1])}, [{}], create=True)
    assert t.clear("p", ["a", "zz"]) == 1
    with pytest.raises(MissingDataError):
        t.get("p", ["a"], ["x"])
    assert t.partitions() == ["p", "q"]
    assert t.clear("q") == 1 and t.partitions() == ["p"]
    assert t.describe("p").nbytes == 8
