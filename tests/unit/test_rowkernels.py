"""rowkernels: the compiled row copies and digests give the bytes and xxh3 digests numpy and
the xxhash package give, refuse a range outside their buffers before writing anything, and
the codec gives the same columns, digests and padded reads with them as without them."""

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import codec, parallel, rowkernels
from rlplane.errors import IntegrityError
from rlplane.fields import default_registry
from rlplane.integrity import range_sums



def xxh(buf, a, z):
    return xxhash.xxh3_64_intdigest(buf[a:z].tobytes())


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300))
def test_digests_are_xxhash_of_each_range_empty_rows_included(seed, n):
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, 5000, dtype=np.uint8)
    bounds = np.sort(rng.integers(0, buf.size + 1, n + 1))  # (repeats: empty rows)
    got = rowkernels.digests(buf, bounds)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxh(buf, a, z) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def test_digests_of_rows_split_over_threads_are_in_row_order(monkeypatch):
    monkeypatch.setattr(parallel, "workers", lambda: 2)  # (whatever this host has)
    runs = []
    monkeypatch.setattr(parallel, "run", lambda fn, parts, run=parallel.run: runs.append(len(parts)) or run(fn, parts))
    buf = np.random.default_rng(1).integers(0, 256, 3 * parallel.PARALLEL_MIN_BYTES, dtype=np.uint8)
    bounds = np.linspace(0, buf.size, 1001).astype(np.int64)
    got = rowkernels.digests(buf, bounds)
    assert runs == [2]  # (split over two threads)
    assert got.tolist() == [xxh(buf, a, z) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    assert range_sums(memoryview(buf), bounds).tolist() == got.tolist()  # (range_sums takes this path)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 120), st.booleans())
def test_copy_rows_lands_every_row_where_asked_and_digests_it(seed, n, digest):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 50, n).astype(np.int64)
    src_at = (np.concatenate([[0], np.cumsum(lens)[:-1]]) + np.cumsum(rng.integers(0, 9, n))).astype(np.int64)
    order = rng.permutation(n)  # rows in any order in the destination
    dst_at = (np.concatenate([[0], np.cumsum(lens[order])[:-1]]) + 5)[np.argsort(order)].astype(np.int64)
    src = rng.integers(0, 256, int((src_at + lens).max()) + 3, dtype=np.uint8)
    got = np.full(int((dst_at + lens).max()) + 7, 0xAB, np.uint8)
    want = got.copy()
    for d, s, m in zip(dst_at.tolist(), src_at.tolist(), lens.tolist()):
        want[d : d + m] = src[s : s + m]
    sums = rowkernels.copy_rows(got, dst_at, src, src_at, lens, digest=digest)
    assert np.array_equal(got, want)  # (bytes outside the rows untouched)
    if digest:
        assert sums.tolist() == [xxh(got, d, d + m) for d, m in zip(dst_at.tolist(), lens.tolist())]
    else:
        assert sums is None


@pytest.mark.parametrize("dtype,pad", [(torch.int64, -7), (torch.float32, 0.5), (torch.bfloat16, 0.0), (torch.bool, True)])
def test_pad_rows_puts_each_rows_tokens_first_then_the_pad_value(dtype, pad):
    lens = torch.tensor([3, 0, 5, 1])
    width = 6
    rows = (torch.arange(int(lens.sum())) % 2 == 0) if dtype == torch.bool else torch.arange(int(lens.sum())).to(dtype)
    want = torch.full((4, width), pad, dtype=dtype)
    want[torch.arange(width)[None, :] < lens[:, None]] = rows
    el = rows.element_size()
    out = torch.zeros((4, width), dtype=dtype)
    fill = torch.full((width,), pad, dtype=dtype)
    u8 = lambda t: t.view(torch.uint8).numpy().reshape(-1)  # noqa: E731
    bounds = np.concatenate([[0], np.cumsum(lens.numpy())]) * el
    sums = rowkernels.pad_rows(u8(out), width * el, u8(rows), bounds[:-1], np.diff(bounds), u8(fill))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    raw = u8(rows)
    assert sums.tolist() == [xxh(raw, a, z) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def test_a_range_outside_a_buffer_is_refused_before_any_byte_moves():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    ok = np.array([0, 10]), np.array([0, 10]), np.array([10, 10])
    with pytest.raises(ValueError, match="destination"):
        rowkernels.copy_rows(dst, np.array([0, 60]), src, ok[1], ok[2])  # second row would end at 70 > 64
    with pytest.raises(ValueError, match="source"):
        rowkernels.copy_rows(dst, ok[0], src, np.array([0, 95]), ok[2])
    with pytest.raises(ValueError):
        rowkernels.copy_rows(dst, ok[0], src, ok[1], np.array([10, -1]))
    huge = np.array([2**62, 2**62])  # offset + length wraps around int64: refused, not a wild copy
    with pytest.raises(ValueError):
        rowkernels.copy_rows(dst, huge, src, huge, huge, digest=False)
    with pytest.raises(ValueError):
        rowkernels.copy_rows(dst, ok[0], src, np.array([0, 2**63 - 4]), np.array([10, 8]))
    with pytest.raises(ValueError):
        rowkernels.pad_rows(dst, 16, src, np.array([2**63 - 4]), np.array([8]), np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="integers"):
        rowkernels.copy_rows(dst, np.array([0.9, 10.0]), src, ok[1], ok[2])
    with pytest.raises(ValueError):
        rowkernels.copy_rows(dst, np.array([-1, 10]), src, ok[1], ok[2])
    with pytest.raises(ValueError):
        rowkernels.digests(src, np.array([0, 50, 101]))
    with pytest.raises(ValueError):
        rowkernels.digests(src, np.array([0, 50, 40]))
    with pytest.raises(ValueError):
        rowkernels.pad_rows(dst, 8, src, np.array([0]), np.array([9]), np.zeros(8, np.uint8))  # a row longer than 8
    with pytest.raises(ValueError):
        rowkernels.pad_rows(dst, 32, src, np.array([0, 0, 0]), np.array([1, 1, 1]), np.zeros(32, np.uint8))  # 96 > 64
    assert not dst.any()  # nothing was written


def _batch(b=512, s=1024):
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, s + 1, (b,), generator=g)
    return {"input_ids": torch.randint(0, 50_000, (b, s), generator=g), "input_lengths": lens,
            "generation_logprobs": torch.randn(b, s, generator=g), "token_mask": torch.ones(b, s)}, lens


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the codec called each kernel (the kernels loaded)."""
    assert rowkernels.ready()
    calls = {"copy_rows": 0, "pad_rows": 0}
    for name in calls:
        def counted(*a, _name=name, _fn=getattr(rowkernels, name), **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(rowkernels, name, counted)
    return calls


@pytest.mark.parametrize("dtype,rest,pad,zeros", [
    (torch.int64, (), None, False), (torch.float32, (3,), -2.5, True), (torch.bfloat16, (2, 3), 1.0, False),
    (torch.bool, (), True, True), (torch.int8, (5,), -3, False)])
def test_the_codec_cuts_and_pads_the_same_bytes_and_digests_with_and_without_kernels(monkeypatch, kernel_calls,
                                                                                    dtype, rest, pad, zeros):
    from rlplane.fields import FieldSpec, Registry

    reg = Registry([*default_registry().specs(), FieldSpec("tok", "token", "dense", dtype=dtype, pad_value=pad or 0)])
    g = torch.Generator().manual_seed(7)
    b, s = 300, 1024
    lens = torch.randint(0, s + 1, (b,), generator=g) if zeros else torch.randint(1, s + 1, (b,), generator=g)
    value = (torch.rand(b, s, *rest, generator=g) * 100).to(dtype) if dtype != torch.bool else \
        torch.rand(b, s, *rest, generator=g) > 0.5
    assert value.numel() * value.element_size() >= codec._KERNEL_BYTES
    fields = {"tok": value, "input_lengths": lens}
    fast = codec.encode(reg, fields, lens)
    fast_out = codec.decode(reg, fast.columns, fast.tags, "padded", s)
    assert kernel_calls == {"copy_rows": 1, "pad_rows": 1}  # (the kernels did the work)
    monkeypatch.setattr(rowkernels, "_kernels", False)  # the numpy path
    slow = codec.encode(reg, fields, lens)
    slow_out = codec.decode(reg, slow.columns, slow.tags, "padded", s)
    assert kernel_calls == {"copy_rows": 1, "pad_rows": 1}
    col = fast.columns["tok"]
    assert torch.equal(col.values.view(torch.uint8), slow.columns["tok"].values.view(torch.uint8))
    assert np.array_equal(col.sums, slow.columns["tok"].sums)
    assert torch.equal(fast_out["tok"].view(torch.uint8), slow_out["tok"].view(torch.uint8))
    mask = torch.arange(s)[None, :] < lens[:, None]
    assert torch.equal(fast_out["tok"][mask], value[mask])
    assert bool((fast_out["tok"][~mask] == torch.tensor(pad or 0, dtype=dtype)).all())


def test_a_damaged_row_padded_by_the_kernels_is_named(kernel_calls):
    reg = default_registry()
    fields, lens = _batch()
    enc = codec.encode(reg, fields, lens)
    ids = [f"s{i}" for i in range(len(lens))]
    at = int(lens[:100].sum()) + 1  # a token of sample 100's row
    enc.columns["input_ids"].values[at] += 1
    with pytest.raises(IntegrityError) as err:
        codec.decode(reg, enc.columns, enc.tags, "padded", sample_ids=ids, partition="p")
    assert "sample 's100'" in str(err.value) and "field 'input_ids'" in str(err.value)
    assert kernel_calls["pad_rows"] >= 1 and kernel_calls["copy_rows"] >= 1


def test_without_numba_the_kernels_say_so_and_the_codec_keeps_its_numpy_path(monkeypatch, caplog):
    def broken():
        raise ImportError("No module named 'numba'")

    monkeypatch.setattr(rowkernels, "_kernels", None)
    monkeypatch.setattr(rowkernels, "_compile", broken)
    assert not rowkernels.ready()
    assert "numba" in caplog.text and "numpy" in caplog.text
    with pytest.raises(RuntimeError, match="ready"):
        rowkernels.digests(np.zeros(4, np.uint8), np.array([0, 4]))
    reg = default_registry()
    fields, lens = _batch(64, 1024)
    enc = codec.encode(reg, fields, lens)
    out = codec.decode(reg, enc.columns, enc.tags, "padded", 1024)
    mask = torch.arange(1024)[None, :] < lens[:, None]
    assert torch.equal(out["input_ids"][mask], fields["input_ids"][mask])


def _child_loads(q):
    from rlplane import _rowkernels_jit

    rowkernels._compile = lambda: _rowkernels_jit  # (the parent's slow load is not the child's)
    q.put(rowkernels.ready())


def test_a_process_forked_while_another_thread_loads_the_kernels_loads_them_itself(monkeypatch):
    """The loading thread's lock is not the child's: its ready() does not wait forever."""
    import multiprocessing
    import threading

    from rlplane import _rowkernels_jit

    holding, release = threading.Event(), threading.Event()

    def slow():
        holding.set()
        release.wait(30)
        return _rowkernels_jit

    monkeypatch.setattr(rowkernels, "_kernels", None)
    monkeypatch.setattr(rowkernels, "_compile", slow)
    loader = threading.Thread(target=rowkernels.ready)
    loader.start()
    try:
        assert holding.wait(30)  # the loader holds the load's lock now
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_child_loads, args=(q,))
        child.start()
        child.join(20)
        if child.exitcode is None:  # waited on a lock no thread of its will release
            child.kill()
            child.join(5)
        assert child.exitcode == 0 and q.get(timeout=5) is True
    finally:
        release.set()
        loader.join(30)
    assert rowkernels.ready()


def test_a_new_client_loads_the_kernels_on_a_thread_of_their_own_once(monkeypatch):
    """A worker connects long before its first big read: the ~0.4 s load is not that read's."""
    import threading
    import time

    from rlplane import _rowkernels_jit
    from rlplane.client import Client
    from rlplane.transports.memory import MemoryTransport

    calls = []

    def load():
        calls.append(threading.current_thread().name)
        time.sleep(0.2)  # a load under way while more clients are made
        return _rowkernels_jit

    monkeypatch.setattr(rowkernels, "_kernels", None)
    monkeypatch.setattr(rowkernels, "_loading", None)
    monkeypatch.setattr(rowkernels, "_compile", load)
    clients = [Client(default_registry(), MemoryTransport()) for _ in range(3)]  # none of them waits for the load
    deadline = time.monotonic() + 10
    while rowkernels._kernels is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rowkernels._kernels is _rowkernels_jit and calls == ["rlplane-rowkernels"]
    rowkernels.load_soon()  # loaded: nothing more starts
    assert rowkernels.ready() and calls == ["rlplane-rowkernels"]
    for c in clients:
        c.close()


def test_a_process_forked_while_a_new_client_loads_the_kernels_gets_them_and_does_not_hang():
    """A fork during the load a new Client starts (DataLoader or Pool workers forked right
    after connecting) left the child the import lock of a thread it does not have: its own
    load waited forever. A fork now waits for that load."""
    import subprocess
    import sys

    script = """
import os, signal, time
from rlplane import rowkernels
rowkernels.load_soon()
time.sleep(0.05)
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    os._exit(0 if rowkernels.ready() else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), rowkernels.ready())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert out.stdout.split() == ["0", "True"], out.stderr[-2000:]
