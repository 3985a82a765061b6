"""The memory reads land in (rlplane.readpool): private to the process that read, and
asking the kernel for huge pages."""

import os
import select
import signal

import numpy as np

from rlplane.readpool import ReadPool, fresh_map


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_fresh_buffer_asks_for_huge_pages():
    buf = np.frombuffer(fresh_map(8 << 20), np.uint8)
    assert "hg" in _vm_flags(buf.ctypes.data)  # MADV_HUGEPAGE: first touch faults 2 MiB at a time


def test_a_child_that_writes_into_a_read_buffer_after_fork_does_not_change_the_parents():
    """A trainer that forks (a data loader's workers) after a read: the child gets a copy
    on write of what was read, as of any memory, never the parent's very pages."""
    pool = ReadPool()
    buf = pool.take(4 << 20)
    buf[:] = np.arange(buf.size, dtype=np.uint64).astype(np.uint8)
    want = buf.copy()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: scribble over the batch (numpy: no thread pool to inherit), say it is done
        try:
            buf.fill(0xFF)
            os.write(w, b"x" if (buf == 0xFF).all() else b"?")
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        assert ready and os.read(r, 1) == b"x", "the child did not write into its copy within 30 s"
    finally:
        os.close(r)
        if not os.waitpid(pid, os.WNOHANG)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert np.array_equal(buf, want)
