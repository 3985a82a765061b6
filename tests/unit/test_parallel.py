"""Memory-bound work split over threads (rlplane.parallel): the split covers every row once
and in order, an error in any piece is raised, a forked child gets a pool of its own, and
the digests and compares that use it give what one thread gives, wherever the split falls."""

import multiprocessing as mp

import numpy as np
import pytest
import torch
import xxhash

from rlplane import dedup, parallel
from rlplane.column import Column
from rlplane.integrity import row_sums

MB = 1 << 20


@pytest.mark.parametrize("sizes", [[1] * 10, [4 * MB] * 3, [MB] * 40, [30 * MB, 1, 1, 1], [0, 0, 9 * MB, 0],
                                   [3 * MB, 3 * MB, 3 * MB, 3 * MB, 7]])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_spans_cover_every_row_once_in_order_and_split_only_big_work(sizes, parts):
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    got = parallel.spans(bounds, parts)
    assert got[0][0] == 0 and got[-1][1] == len(sizes)
    assert all(a < z for a, z in got) and all(z == a2 for (_, z), (a2, _) in zip(got, got[1:]))
    assert len(got) <= parts
    if bounds[-1] < parallel.PARALLEL_MIN_BYTES:
        assert len(got) == 1
    if sizes == [4 * MB] * 3:
        assert len(got) == min(parts, 3)  # 12 MiB: a row a thread
    assert parallel.spans(np.array([0]), 4) == [(0, 0)]


def test_run_keeps_the_order_and_raises_an_error_of_any_part_after_all_are_done():
    parts = [(0, 2), (2, 5), (5, 6), (6, 9)]
    assert parallel.run(lambda a, z: list(range(a, z)), parts) == [[0, 1], [2, 3, 4], [5], [6, 7, 8]]
    done = []

    def fail_in_third(a, z):
        if a == 5:
            raise ValueError("third")
        done.append(a)
        return a

    with pytest.raises(ValueError, match="third"):
        parallel.run(fail_in_third, parts)
    assert sorted(done) == [0, 2, 6]


def _child(q):
    q.put(parallel.run(lambda a, z: z - a, [(0, 1), (1, 3), (3, 6)]))


def test_a_forked_child_gets_a_pool_of_its_own():
    parallel.run(lambda a, z: 0, [(0, 1), (1, 2)])  # the parent's pool exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=30) == [1, 2, 3]
    finally:
        p.join(30)
    assert p.exitcode == 0


@pytest.fixture
def split(monkeypatch):
    """Three threads whatever this host has; records how many pieces each run had."""
    pieces, run = [], parallel.run
    monkeypatch.setattr(parallel, "workers", lambda: 3)
    monkeypatch.setattr(parallel, "run", lambda fn, parts: pieces.append(len(parts)) or run(fn, parts))
    return pieces


def test_digests_of_a_big_column_are_each_rows_wherever_the_split_falls(split):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 3 * MB // 4, (40,), generator=g)
    lens[5] = 0
    values = torch.randint(-2**31, 2**31 - 1, (int(lens.sum()),), generator=g, dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
    col = Column(values, offsets)
    assert values.numel() * 4 > 2 * parallel.PARALLEL_MIN_BYTES  # split over threads
    raw = values.numpy().view(np.uint8)
    want = [xxhash.xxh3_64_intdigest(raw[4 * int(a):4 * int(z)].tobytes()) for a, z in zip(offsets[:-1], offsets[1:])]
    assert row_sums(col).tolist() == want
    assert split == [3]


def test_a_copy_that_differs_in_one_byte_is_told_apart_in_whichever_thread_compares_it(split):
    base = torch.randn(MB // 2, dtype=torch.float32)  # 2 MiB a row; 15 copies: compared over threads
    for odd in (1, 8, 15):
        rows = [(base,)] + [(base.clone(),) for _ in range(15)]
        other = base.clone()
        other.view(torch.uint8)[MB + 3] ^= 1
        rows[odd] = (other,)
        want = [-1] + [0] * 15
        want[odd] = -1
        assert dedup.twins(rows).tolist() == want
    assert split and max(split) == 3


@pytest.mark.parametrize("nbytes", [0, 1, parallel.PARALLEL_MIN_BYTES - 1, 5 * parallel.PARALLEL_MIN_BYTES + 12345])
def test_chunks_cover_a_buffer_once_in_order(nbytes):
    got = parallel.chunks(nbytes, 3)
    assert got[0][0] == 0 and got[-1][1] == nbytes and all(z == a2 for (_, z), (a2, _) in zip(got, got[1:]))
    assert len(got) == (3 if nbytes > 2 * parallel.PARALLEL_MIN_BYTES else 1)


def test_a_big_copy_over_threads_moves_every_byte(split):
    from rlplane.copies import copy

    src = np.random.default_rng(1).integers(0, 256, 5 * parallel.PARALLEL_MIN_BYTES + 4097, dtype=np.uint8)
    src.flags.writeable = False  # a read-only slab view copies too
    dst = np.zeros_like(src)
    copy(dst, src)
    assert np.array_equal(dst, src) and split == [3]
    with pytest.raises(ValueError):
        copy(dst[:-1], src)


def test_packed_rows_cast_over_threads_are_what_one_cat_gives(split):
    from rlplane.packed import PackedTensor

    g = torch.Generator().manual_seed(2)
    rows = [[torch.randn(int(n), 1176, generator=g) for n in torch.randint(1, 600, (k,), generator=g)] if k else None
            for k in [2, 0, 1, 3, 1, 2, 0, 2]]
    values, numels, _ = PackedTensor(rows).flatten(torch.bfloat16)
    want = torch.cat([s.reshape(-1) for r in rows if r for s in r]).to(torch.bfloat16)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16)) and split == [3]


@pytest.mark.parametrize("counts", [[2, 0, 1, 3, 1, 2, 0, 2], [3, 1], [0, 0, 0, 2]])
def test_packed_rows_digested_as_they_are_cast_over_threads_are_each_rows_digest(split, counts):
    """Each row digested right after its copy (in cache), on whichever thread copies it:
    the digest of the row's bytes as stored. Fewer rows than threads: split by segment,
    digested after (None here); the column's digests are then row_sums' as before."""
    from rlplane.codec import encode
    from rlplane.fields import default_registry
    from rlplane.packed import PackedTensor

    g = torch.Generator().manual_seed(4)
    rows = [[torch.randn(int(n), 1176, generator=g) for n in torch.randint(1, 600, (k,), generator=g)] if k else None
            for k in counts]
    values, numels, _, sums = PackedTensor(rows).flatten_with_sums(torch.bfloat16)
    want = torch.cat([s.reshape(-1) for r in rows if r for s in r]).to(torch.bfloat16)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))
    col = Column(values, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(numels), 0)]))
    if len(counts) >= 3:  # (one row holds every byte of the last: one thread's piece)
        assert sums is not None and sums.tolist() == row_sums(col).tolist() and split[0] == (3 if counts[0] else 1)
    else:
        assert sums is None
    enc = encode(default_registry(), {"pixel_values": PackedTensor(rows)})
    assert enc.columns["pixel_values"].sums.tolist() == row_sums(col).tolist()


def test_token_rows_padded_over_threads_land_where_one_masked_assign_puts_them(split):
    """Padded into a reused read buffer (another batch's bytes still in it): every pad and
    every row where torch's masked assign puts them."""
    from rlplane.codec import _padded
    from rlplane.readpool import ReadPool

    g = torch.Generator().manual_seed(4)
    pool = ReadPool.shared()
    for pad in (7, -1):  # the second batch lands in the first's buffer, given back
        lens = torch.randint(0, 4097, (512,), generator=g)
        lens[7] = 4096
        rows = torch.randint(-10**9, 10**9, (int(lens.sum()), 2), generator=g)
        mask = torch.arange(4096) < lens[:, None]
        want = torch.full((512, 4096, 2), pad, dtype=torch.int64)
        want[mask] = rows
        reused = pool.reused
        got = _padded(rows, lens, lambda: mask, (512, 4096, 2), pad)
        assert torch.equal(got, want)
        del got
    assert pool.reused > reused and split == [3, 3]


def test_token_rows_selected_over_threads_into_a_given_buffer_with_each_rows_digest(split):
    from rlplane.codec import _masked_select, _TokenRows
    from rlplane.integrity import row_sums

    g = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 2049, (600,), generator=g)
    lens[3], lens[4] = 0, 2048
    value = torch.randint(-10**9, 10**9, (600, 2048, 3), generator=g)
    tokens = _TokenRows(lens)
    mask = tokens.mask(2048, value.device)
    given = torch.full((int(lens.sum()) * 3,), -5, dtype=torch.int64)
    got, sums = _masked_select(value, tokens, lambda numel, dtype: given[:numel])
    assert got.data_ptr() == given.data_ptr() and torch.equal(got, value[mask])
    assert split == [3]  # (the select, over three threads)
    assert np.array_equal(sums, row_sums(Column(given, tokens.offsets(3))))


def test_a_snapshots_thread_yields_the_cpu_and_keeps_its_memory_work_on_itself():
    """The snapshot's copying threads run at nice NICE and split nothing over the shared
    threads, which run at normal priority."""
    import os
    import threading

    from rlplane import snapshot

    seen = {}

    def body():
        snapshot._yield_cpu()
        tid = threading.get_native_id()
        seen["workers"] = parallel.workers()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert seen["workers"] == 1
    assert seen["nice"] >= snapshot.NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < snapshot.NICE  # this thread is untouched


def test_media_put_in_inference_mode_or_with_grad_is_cast_over_threads_alike(split):
    """torch's inference mode and grad mode are per thread: the pool's threads take the caller's."""
    from rlplane.packed import PackedTensor

    g = torch.Generator().manual_seed(5)
    rows = [[torch.randn(900, 1176, generator=g)], [torch.randn(700, 1176, generator=g)], [torch.randn(800, 1176, generator=g)]]
    want = torch.cat([r[0].reshape(-1) for r in rows]).to(torch.bfloat16)
    with torch.inference_mode():
        values, _, _ = PackedTensor(rows).flatten(torch.bfloat16)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))
    needs_grad = [[r[0].clone().requires_grad_()] for r in rows]
    values, _, _ = PackedTensor(needs_grad).flatten(torch.bfloat16)
    assert not values.requires_grad and torch.equal(values.view(torch.int16), want.view(torch.int16))
    assert split == [3, 3]


def test_a_damaged_row_is_found_by_every_layout_wherever_the_split_and_the_pieces_fall(split):
    """Rows padded on the host are digested piece by piece as they are padded: a changed
    value in any piece of any thread's share is an IntegrityError naming its sample."""
    from rlplane import default_registry
    from rlplane.codec import decode, encode
    from rlplane.errors import IntegrityError

    g = torch.Generator().manual_seed(6)
    lens = torch.randint(1, 2049, (900,), generator=g)
    fields = {"input_ids": torch.randint(0, 10**6, (900, 2048), generator=g), "input_lengths": lens}
    ids = [f"s{i}" for i in range(900)]
    enc = encode(default_registry(), fields, lens)
    back = decode(default_registry(), enc.columns, enc.tags, sample_ids=ids)
    assert torch.equal(back["input_ids"], fields["input_ids"] * (torch.arange(2048) < lens[:, None]))
    starts = enc.columns["input_ids"].offsets
    for sample in (0, 450, 899):  # the first piece, a middle one, the last thread's last
        values = enc.columns["input_ids"].values
        at = int(starts[sample]) + int(lens[sample]) - 1
        values[at] += 1
        for layout in ("padded", "jagged", "packed"):
            with pytest.raises(IntegrityError, match=f"sample 's{sample}', field 'input_ids'"):
                decode(default_registry(), enc.columns, enc.tags, layout, sample_ids=ids, partition="p")
        values[at] -= 1
    assert 3 in split  # the padding ran over three threads
