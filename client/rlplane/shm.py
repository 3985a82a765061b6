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
        self._cuda: list[int] = []  # addresses of mappings registered with CUDA
        self._cuda_tried: set[bool] = set()  # which mappings were tried (write: the read-write one)
        self._cuda_ok: set[bool] = set()
        self._cuda_lock = threading.Lock()

    def register_cuda(self, *, write: bool) -> bool:
        """Page-lock a mapping for CUDA (``cudaHostRegister``, once per process): the
        read-write one that puts write into (``write``), else the read-only one that reads
        take views of. Copies between it and a GPU then run by DMA at the bus's speed, not
        through the driver's pageable staging (220 MB onto an H200: 4.0 ms pinned, 29 ms
        pageable); the first call pins every page (about 0.4 s per GiB there). False when
        CUDA refuses: the copies stay correct, only slower (logged).

        Example: ``view.register_cuda(write=False)`` before reading this unit's rows onto a GPU.
        """
        with self._cuda_lock:
            if write not in self._cuda_tried:
                if not self._cuda_tried:
                    # Unregistered before a mapping can go: CUDA keeps a registered range's pages pinned
                    # by address, so memory mapped there later would be copied to and from the old pages.
                    weakref.finalize(self, _cuda_unregister, self._cuda).atexit = False  # exit unmaps it all
                self._cuda_tried.add(write)
                mapping, flags = (self.mm, _CUDA_PORTABLE) if write else (self.ro, _CUDA_PORTABLE | _CUDA_READ_ONLY)
                addr = _cuda_register(self.unit, mapping, self.nbytes, flags)
                if addr is not None:
                    self._cuda.append(addr)
                    self._cuda_ok.add(write)
            return write in self._cuda_ok

    def close(self) -> None:
        with self._cuda_lock:
            _cuda_unregister(self._cuda)
            self._cuda_tried, self._cuda_ok = {True, False}, set()  # a closed view is never registered again
        self.u8 = np.empty(0, np.uint8)
        for m in (self.mm, self.ro):
            try:
                m.close()
            except BufferError:  # a view still uses it: the mapping goes with the last one
                pass

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


#: cudaHostRegister's flags: portable (every CUDA context of the process), read-only.
_CUDA_PORTABLE, _CUDA_READ_ONLY = 1, 8


def _cuda_register(unit: str, mapping: mmap.mmap, nbytes: int, flags: int) -> int | None:
    """Register one of unit ``unit``'s slab mappings with CUDA; its address, or None."""
    import torch

    addr = np.frombuffer(mapping, np.uint8).ctypes.data
    rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags))
    if rc == 0:
        return addr
    _clear_cuda_error()
    log.warning("CUDA did not page-lock storage unit %s's slab (cudaHostRegister error %d, flags %d): its copies "
                "to and from the GPU go through pageable staging, correct but slower", unit, rc, flags)
    return None


def _cuda_unregister(addrs: list[int]) -> None:
    """Unregister (and forget) every address in ``addrs``; a view's finalizer and close share it."""
    import torch

    while addrs:
        rc = int(torch.cuda.cudart().cudaHostUnregister(addrs.pop()))
        if rc != 0:
            _clear_cuda_error()
            log.warning("cudaHostUnregister of a slab mapping failed (error %d)", rc)


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a refused call, so the next unrelated op does not
    report it: through the runtime library torch already loaded (found, never loaded)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetLastError()
        return


_MAP_FIXED = 0x10  # (Linux; Python's mmap module does not name it)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def privatize(addr: int, nbytes: int) -> bool:
    """Make the pages under ``[addr, addr + nbytes)`` of a shared mapping this process's
    own copy of what they hold now (private anonymous memory with the same bytes, read-only):
    what a forked child does to the zero-copy views it inherited, whose memory the store
    reuses once the parent lets go of them. False where the kernel refuses.

    Example: ``privatize(view.ctypes.data, view.nbytes)`` in a forked child."""
    page = mmap.PAGESIZE
    start, end = addr - addr % page, -(-(addr + nbytes) // page) * page
    if end <= start:
        return True
    keep = ctypes.string_at(start, end - start)
    got = _libc.mmap(ctypes.c_void_p(start), end - start, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
    if got != start:
        return False
    ctypes.memmove(start, keep, end - start)
    _libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.PROT_READ)
    return True


_views: dict[str, weakref.ref] = {}  # slab socket name -> the process's mapping of it
_views_lock = threading.Lock()


def _forget_views_lock() -> None:
    global _views_lock
    _views_lock = threading.Lock()  # (a thread of the parent may have held it at the fork: the child maps afresh)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_views_lock)


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


__all__ = ["SlabView", "open_slab", "shared_slab", "populate", "privatize", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE",
           "GRANULE_SHIFT", "PREFAULT_MIN"]
