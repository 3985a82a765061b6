"""Shared memory: a storage unit's slab mapped into this process.

A native storage unit keeps its bytes in one slab, an anonymous shared-memory file
(``memfd``) that has no name in any file system. A client on the same host gets it as
a file descriptor: it asks the unit, over the authenticated data connection, for a
single-use *ticket* and the name of the unit's Unix socket (an abstract socket: no file,
reachable only from the same network namespace, i.e. the same host or Kubernetes pod),
presents the ticket there, and receives the descriptor (``SCM_RIGHTS``). No secret, no
ticket; a process on another host cannot connect at all, which is also how a client
learns that a unit is *not* local. The memory goes when the unit and every client that
mapped it are gone.

Example::

    view = open_slab(info["sock"], info["ticket"], info["bytes"], timeout=5.0)
    view.u8[start : start + n]          # a numpy uint8 view of the unit's bytes
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from rlplane.errors import TransportError

log = logging.getLogger(__name__)

#: madvise advice (Linux >= 5.14): fault the pages in now, for writing / for reading.
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
_libc = ctypes.CDLL(None, use_errno=True)


def populate(u8: np.ndarray, *, write: bool) -> bool:
    """Fault ``u8``'s pages in with one call (a shared mapping faulted page by page costs
    ~6x a copy into it). Runs without the GIL. False where the kernel lacks the advice."""
    if not u8.size:
        return True
    addr = u8.ctypes.data
    start = addr - addr % mmap.PAGESIZE
    length = addr + u8.size - start
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0


#: The slab's pages are mapped into this process in granules of this many bytes (2 MiB).
GRANULE_SHIFT = 21
#: Copies smaller than this skip :meth:`SlabView.prefault` (their faults cost less than the check).
PREFAULT_MIN = 64 << 10


@dataclass(eq=False)
class SlabView:
    """A unit's slab mapped read-write into this process."""

    unit: str
    nbytes: int
    mm: mmap.mmap
    u8: np.ndarray
    ro: mmap.mmap  # the same memory mapped read-only: what zero-copy reads hand out (a write faults)
    pid: int = 0  # the process that mapped it

    def __post_init__(self) -> None:
        self._mapped = np.zeros((self.nbytes >> GRANULE_SHIFT) + 1, bool)  # granules this process mapped already

    def prefault(self, start: int, end: int) -> None:
        """Map the pages of bytes ``[start, end)`` into this process now, one madvise per run
        of granules it has not touched yet. The unit faulted the slab in, but each process's
        mapping faults again on first touch, page by page: a first copy of 512 MB into a fresh
        mapping took 148 ms here, 27 ms to map it first plus the 45 ms copy. Once per granule:
        mapping pages already mapped costs a third of a copy.

        Example: ``view.prefault(at, at + n)`` before copying ``n`` bytes to ``view.u8[at:]``.
        """
        if end - start < PREFAULT_MIN or not self.u8.size:
            return
        g0, g1 = start >> GRANULE_SHIFT, (end - 1) >> GRANULE_SHIFT
        todo = np.flatnonzero(~self._mapped[g0 : g1 + 1])
        if not todo.size:
            return
        breaks = np.flatnonzero(np.diff(todo) != 1)
        for a, z in zip(np.concatenate([[0], breaks + 1]).tolist(), np.append(breaks, todo.size - 1).tolist()):
            lo, hi = (g0 + int(todo[a])) << GRANULE_SHIFT, min(self.nbytes, (g0 + int(todo[z]) + 1) << GRANULE_SHIFT)
            populate(self.u8[lo:hi], write=True)  # an old kernel without the advice: faulted on touch, as before
        self._mapped[g0 + todo] = True

    def close(self) -> None:
        self.u8 = np.empty(0, np.uint8)
        for m in (self.mm, self.ro):
            try:
                m.close()
            except BufferError:  # a view still uses it: the mapping goes with the last one
                pass


_views: dict[str, weakref.ref] = {}  # slab socket name -> the process's mapping of it
_views_lock = threading.Lock()


def shared_slab(sock_name: str, ticket: str, nbytes: int, *, unit: str, timeout: float) -> SlabView:
    """The process's mapping of a unit's slab: the one another client of this process
    already holds, else a new one (:func:`open_slab`). Every client of a process shares
    it, so a hundred clients cost the descriptors of one."""
    with _views_lock:
        ref = _views.get(sock_name)
        view = ref() if ref is not None else None
        if view is not None and view.nbytes == nbytes and view.u8.size and os.getpid() == view.pid:
            return view
    view = open_slab(sock_name, ticket, nbytes, unit=unit, timeout=timeout)
    with _views_lock:
        for k in [k for k, r in _views.items() if r() is None]:
            del _views[k]
        _views[sock_name] = weakref.ref(view)
    return view


def open_slab(sock_name: str, ticket: str, nbytes: int, *, unit: str, timeout: float) -> SlabView:
    """Map unit ``unit``'s slab: present ``ticket`` at its abstract Unix socket
    ``sock_name`` and map the descriptor it hands back. TransportError when the socket
    is not reachable from here (another host or pod) or the unit refuses the ticket."""
    if not sock_name or "\0" in sock_name:
        raise TransportError(f"storage unit {unit} announced no slab socket")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect("\0" + sock_name)
            s.sendall(ticket.encode("ascii") + b"\n")
            msg, fds, _, _ = socket.recv_fds(s, 16, 1)
    except (OSError, UnicodeError) as err:
        raise TransportError(f"cannot map the slab of storage unit {unit} ({type(err).__name__}: {err}); "
                             "it is on another host, or refused the ticket") from None
    if msg != b"ok" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"storage unit {unit} refused to share its slab ({msg[:40]!r})")
    fd = fds[0]
    try:
        if os.fstat(fd).st_size < nbytes:
            raise TransportError(f"storage unit {unit}'s slab is smaller than it announced")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        ro = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as err:
        raise TransportError(f"cannot map the slab of storage unit {unit}: {err}") from None
    finally:
        os.close(fd)
    return SlabView(unit, nbytes, mm, np.frombuffer(mm, np.uint8), ro, os.getpid())


__all__ = ["SlabView", "open_slab", "shared_slab", "populate", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE",
           "GRANULE_SHIFT", "PREFAULT_MIN"]
