"""copy_ranges: every range lands where asked, equal to a naive range-by-range copy, and
nothing outside the ranges is touched (one run, several runs, many small runs)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane.copies import copy_ranges


def naive(dst, dst_at, src, src_at, lens):
    for d, s, n in zip(dst_at.tolist(), src_at.tolist(), lens.tolist()):
        dst[d : d + n] = src[s : s + n]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 80), st.sampled_from(["one run", "src runs", "dst runs", "scattered"]))
def test_copy_ranges_equals_a_range_by_range_copy(seed, n, layout):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 40, size=n).astype(np.int64)
    back_to_back = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    gaps = np.cumsum(rng.integers(0, 9, size=n)).astype(np.int64)  # rising starts that never overlap
    src_at = back_to_back + (gaps if layout in ("dst runs", "scattered") else 0) + 5
    dst_at = back_to_back + (gaps if layout in ("src runs", "scattered") else 0) + 3
    if layout == "scattered":  # ranges in any order in the destination
        order = rng.permutation(n)
        dst_at = (np.concatenate([[0], np.cumsum(lens[order])[:-1]]) + 3)[np.argsort(order)].astype(np.int64)
    src = rng.integers(0, 256, size=int((src_at + lens).max()) + 7, dtype=np.uint8)
    size = int((dst_at + lens).max()) + 11
    got = np.full(size, 0xAB, np.uint8)
    want = got.copy()
    copy_ranges(got, dst_at, src, src_at, lens)
    naive(want, dst_at, src, src_at, lens)
    assert np.array_equal(got, want)


def test_one_run_of_rows_is_copied_whole():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(70, np.uint8)
    copy_ranges(dst, np.array([2, 10, 10, 30]), src, np.array([8, 16, 16, 36]), np.array([8, 0, 20, 4]))
    assert dst[2:34].tolist() == list(range(8, 40)) and not dst[:2].any() and not dst[34:].any()
