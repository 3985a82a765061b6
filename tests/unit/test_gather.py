"""gather: rows of several sources, in the order asked, equal to a naive row-by-row copy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane.gather import gather


def naive(sources, which, rows):
    parts = [sources[k][0][sources[k][1][r] : sources[k][1][r + 1]] for k, r in zip(which, rows)]
    return np.concatenate(parts) if parts else np.empty(0, sources[0][0].dtype)


def source(rng, n, longest, dtype=np.int64):
    lens = rng.integers(0, longest + 1, size=n)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    return rng.integers(0, 1 << 30, size=int(off[-1])).astype(dtype), off


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 3, 300]), st.sampled_from(["sorted", "random", "run", "one"]))
def test_gather_equals_a_row_by_row_copy(seed, longest, order):
    rng = np.random.default_rng(seed)
    sources = [source(rng, 100, longest) for _ in range(3)]
    n = int(rng.integers(0, 300))
    which, rows = rng.integers(0, 3, n), rng.integers(0, 100, n)
    if order == "sorted":
        idx = np.lexsort((rows, which))
        which, rows = which[idx], rows[idx]
    elif order == "run":
        which, rows = np.full(60, 1), np.arange(20, 80)
    elif order == "one":
        which, rows = np.array([2]), np.array([5])
    values, offsets = gather(sources, which, rows)
    assert np.array_equal(values, naive(sources, which, rows))
    want = [sources[k][1][r + 1] - sources[k][1][r] for k, r in zip(which, rows)]
    assert np.array_equal(np.diff(offsets), np.asarray(want, np.int64).reshape(-1))


def test_one_run_is_a_view_and_many_runs_a_new_buffer():
    rng = np.random.default_rng(0)
    src = source(rng, 50, 10)
    v, _ = gather([src], np.zeros(10, np.int64), np.arange(5, 15))
    assert np.shares_memory(v, src[0])
    v, _ = gather([src], np.zeros(10, np.int64), np.arange(0, 20, 2))
    assert not np.shares_memory(v, src[0])


def test_a_row_out_of_range_is_an_index_error():
    src = source(np.random.default_rng(0), 5, 3)
    with pytest.raises(IndexError):
        gather([src], np.array([0]), np.array([5]))
    with pytest.raises(IndexError):
        gather([src], np.array([1]), np.array([0]))
