"""A snapshot's files are written around the page cache where the filesystem allows it
(rlplane.durable.StreamedFile): whatever the pieces' sizes, the file holds exactly the bytes
written, on a disk and on tmpfs, and a filesystem that refuses direct I/O at open or at
the first write gets the same bytes through the cache."""

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rlplane import durable
from rlplane.durable import DIRECT_ALIGN, StreamedFile

SIZES = [[], [0], [1], [DIRECT_ALIGN], [DIRECT_ALIGN + 1, 7], [3 << 20, 5, 1 << 20], [10 << 20], [64] * 1000]


def pieces(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def places(tmp_path):
    out = [tmp_path]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        out.append(shm)
    return out


@pytest.mark.parametrize("sizes", SIZES)
def test_the_file_holds_exactly_the_bytes_written_on_disk_and_on_tmpfs(tmp_path, sizes):
    data = pieces(sizes)
    for where in places(tmp_path):
        path = where / f"rlplane-test-{os.getpid()}-{len(sizes)}.bin"
        try:
            with StreamedFile(path, chunk=2 << 20) as f:
                for d in data:
                    f.write(memoryview(d))
                size = f.close()
            assert size == sum(sizes) == path.stat().st_size
            assert path.read_bytes() == b"".join(d.tobytes() for d in data)
        finally:
            path.unlink(missing_ok=True)


def refuse_direct_io(monkeypatch, at: str) -> None:
    """Make this filesystem refuse direct I/O at ``open`` (EINVAL) or at the first ``write``
    of a descriptor opened with it (EINVAL), as some filesystems do."""
    real_open, real_pwrite, direct_fds = os.open, os.pwrite, set()

    def fake_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            if at == "open":
                raise OSError(errno.EINVAL, "no direct I/O here")
            fd = real_open(path, flags & ~os.O_DIRECT, *a)
            direct_fds.add(fd)
            return fd
        fd = real_open(path, flags, *a)
        direct_fds.discard(fd)  # a number a closed direct descriptor had
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "unaligned for this device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(durable.os, "open", fake_open)
    monkeypatch.setattr(durable.os, "pwrite", fake_pwrite)


@pytest.mark.parametrize("refuse", ["open", "write"])
def test_direct_io_refused_at_open_or_at_the_first_write_falls_back_with_the_same_bytes(tmp_path, monkeypatch, refuse):
    refuse_direct_io(monkeypatch, refuse)
    data = pieces([5 << 20, 123])
    path = tmp_path / "f.bin"
    with StreamedFile(path, chunk=1 << 20) as f:
        for d in data:
            f.write(d)
    assert not f.direct
    assert path.read_bytes() == b"".join(d.tobytes() for d in data)


def test_an_error_inside_the_block_leaves_no_open_descriptor(tmp_path):
    def open_here() -> list[str]:  # (not a count of every descriptor: other tests' threads open and close theirs)
        fds = Path("/proc/self/fd")
        out = []
        for fd in os.listdir(fds):
            try:
                target = os.readlink(fds / fd)
            except OSError:
                continue
            if target.startswith(str(tmp_path)):
                out.append(target)
        return out

    with pytest.raises(RuntimeError):
        with StreamedFile(tmp_path / "f.bin") as f:
            f.write(b"x" * 100)
            assert open_here()  # (the check sees the file while it is open)
            raise RuntimeError("writer failed")
    assert open_here() == []


def test_a_write_that_fails_midway_fails_every_later_call_and_the_close(tmp_path, monkeypatch):
    """The second of four chunks fails (EIO): the failure is raised by a later write or by
    close, never swallowed into a file with a hole and a size that looks right."""
    real_pwrite, calls = os.pwrite, []

    def flaky(fd, data, at):
        calls.append(at)
        if len(calls) == 2:
            raise OSError(errno.EIO, "disk error")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(durable.os, "pwrite", flaky)
    chunk = 1 << 20
    f = StreamedFile(tmp_path / "f.bin", chunk=chunk)
    with pytest.raises(OSError, match="disk error"):
        for _ in range(4):
            f.write(bytes(chunk))
    with pytest.raises(OSError, match="disk error"):
        f.write(b"more")
    with pytest.raises(OSError, match="disk error"):
        f.close()
    assert calls[:2] == [0, chunk]  # each chunk at its own offset


@pytest.mark.parametrize("tail", [1, DIRECT_ALIGN - 1, DIRECT_ALIGN + 5])
def test_a_file_smaller_than_a_chunk_falls_back_at_its_close_with_the_same_bytes(tmp_path, monkeypatch, tail):
    refuse_direct_io(monkeypatch, "write")
    data = np.random.default_rng(tail).integers(0, 256, tail, dtype=np.uint8).tobytes()
    with StreamedFile(tmp_path / "f.bin") as f:
        f.write(data)
    assert not f.direct and (tmp_path / "f.bin").read_bytes() == data


def test_the_files_mode_is_the_umasks_like_every_other_snapshot_file(tmp_path):
    """The README's Security section: a snapshot's files are created with the service's umask."""
    old = os.umask(0o027)
    try:
        with StreamedFile(tmp_path / "f.bin") as f:
            f.write(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o640


def test_files_written_one_after_another_on_a_thread_reuse_its_buffers_and_files_open_together_do_not(tmp_path):
    """A snapshot writes its partition files in turn on one thread: their buffers' pages
    are faulted in once (fresh ones cost about what the copies into them cost). Two files
    open at once never share a buffer, and each holds exactly its bytes."""
    def ids(f):
        return [id(x) for x in f._bufs]

    def bufs_on_another_thread() -> list:
        with StreamedFile(tmp_path / "d", chunk=1 << 20) as f:
            return ids(f)

    a, b, c = pieces([5 << 20, 3], 1), pieces([3 << 20, 1 << 20], 2), pieces([(4 << 20) + 9], 3)
    with StreamedFile(tmp_path / "a", chunk=1 << 20) as fa:
        with StreamedFile(tmp_path / "b", chunk=1 << 20) as fb:  # open together: buffers of its own
            assert not set(ids(fb)) & set(ids(fa))
            for d in a:
                fa.write(d)
            for d in b:
                fb.write(d)
            last_closed = list(fb._bufs)  # (held: ids of freed objects may come back)
    with StreamedFile(tmp_path / "c", chunk=1 << 20) as fc:  # next on this thread: the spare pair
        assert all(x is y for x, y in zip(fc._bufs, last_closed, strict=True))
        for d in c:
            fc.write(d)
        with ThreadPoolExecutor(1) as other:  # another thread's are its own
            assert not set(other.submit(bufs_on_another_thread).result(timeout=30)) & set(ids(fc))
    for name, data in (("a", a), ("b", b), ("c", c)):
        assert (tmp_path / name).read_bytes() == b"".join(d.tobytes() for d in data), name
