"""The slab allocator: extents never overlap, nothing leaks, a full slab says so."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane_service.native.allocator import ALIGN, Allocator, AllocatorError

SIZE = 1 << 16


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, SIZE // 4), st.integers(0, 1 << 30)), max_size=120))
def test_random_alloc_free_sequences_never_overlap_and_never_leak(ops):
    a = Allocator(SIZE)
    held: dict[int, int] = {}
    for do_alloc, nbytes, pick in ops:
        if do_alloc or not held:
            start = a.alloc(nbytes)
            if start is None:  # refused only when no hole fits
                assert a.largest_free() < max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
                continue
            assert start % ALIGN == 0 and start + nbytes <= SIZE
            for s, n in held.items():  # no overlap with anything still held
                assert start + max(nbytes, 1) <= s or s + max(n, 1) <= start
            held[start] = nbytes
        else:
            start = sorted(held)[pick % len(held)]
            del held[start]
            a.free(start)
        a.check()
    for start in list(held):
        a.free(start)
    a.check()
    assert a.used_bytes == 0 and a.stats()["fragments"] == 1 and a.largest_free() == SIZE


def test_a_full_slab_refuses_and_a_freed_neighbourhood_merges_back():
    a = Allocator(4 * ALIGN)
    xs = [a.alloc(ALIGN) for _ in range(4)]
    assert None not in xs and a.alloc(1) is None and a.stats()["free_bytes"] == 0
    a.free(xs[1])
    a.free(xs[2])
    assert a.stats()["fragments"] == 1 and a.alloc(2 * ALIGN) == xs[1]  # the two holes merged into one


def test_best_fit_keeps_the_big_hole_for_big_extents():
    a = Allocator(64 * ALIGN)
    small, gap, big = a.alloc(ALIGN), a.alloc(ALIGN), a.alloc(8 * ALIGN)
    a.alloc(ALIGN)
    a.free(small)
    a.free(big)  # holes: one of 1, one of 8 (plus the tail)
    assert a.alloc(ALIGN) == small  # the small request takes the small hole, not the big one
    assert gap is not None


def test_freeing_what_was_never_allocated_is_an_error():
    a = Allocator(SIZE)
    with pytest.raises(AllocatorError):
        a.free(128)
    x = a.alloc(100)
    a.free(x)
    with pytest.raises(AllocatorError):
        a.free(x)  # twice


def test_fragmentation_is_reported():
    a = Allocator(10 * ALIGN)
    xs = [a.alloc(ALIGN) for _ in range(10)]
    for x in xs[::2]:
        a.free(x)
    st = a.stats()
    assert st["free_bytes"] == 5 * ALIGN and st["largest_free"] == ALIGN and st["fragmentation"] == pytest.approx(0.8)
