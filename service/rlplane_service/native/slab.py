"""A storage unit's slab: one pre-faulted shared-memory file, and the socket that shares it.

:class:`Slab` is ``RLPLANE_UNIT_BYTES`` of ``memfd`` memory mapped into the unit and
faulted in for writing by a background thread at start (the kernel zeroes each page
once, ~2 s/GiB on a small VM; the unit serves meanwhile). Its allocator is
:class:`~rlplane_service.native.allocator.Allocator`.

:class:`SlabShare` hands the slab's descriptor to same-host clients: a thread serving
an abstract Unix socket with an unguessable name, which answers a connection with the
descriptor only if it presents a ticket the unit issued over its authenticated ZMQ
connection (single use, valid ``TICKET_TTL_S``). See :mod:`rlplane.shm` for the client.

Example::

    slab = Slab(1 << 30)
    share = SlabShare(slab.fd, "unit-0").start()
    ticket = share.ticket()
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
import time

import numpy as np

from rlplane.shm import populate

log = logging.getLogger(__name__)

#: A ticket not presented within this long is void.
TICKET_TTL_S = 30.0
_MAX_TICKETS = 4096
#: How long a connection may take to present its ticket, and how many are served at once.
SERVE_S, MAX_SERVING = 1.0, 64


class Slab:
    """``nbytes`` of shared memory (see the module docstring)."""

    def __init__(self, nbytes: int, name: str = "unit") -> None:
        self.nbytes = nbytes - nbytes % mmap.PAGESIZE
        self.fd = os.memfd_create(f"rlplane-{name}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.u8 = np.frombuffer(self.mm, np.uint8)
        self.populated = threading.Event()
        threading.Thread(target=self._populate, name=f"rlplane-{name}-prefault", daemon=True).start()

    def close(self) -> None:
        """Give the memory back now (not when the collector gets to this object): the
        descriptor is closed and the mapping too, unless an array still views it (then it
        goes with the last view). Nothing may use the slab after."""
        if self.fd < 0:
            return
        self.populated.wait(10)
        self.u8 = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass
        os.close(self.fd)
        self.fd = -1

    def _populate(self) -> None:
        t0 = time.monotonic()
        step = 256 << 20  # in slices, so a failing call says where
        for at in range(0, self.nbytes, step):
            if not populate(self.u8[at : at + step], write=True):
                int(self.u8[at : at + step : mmap.PAGESIZE].sum())  # older kernels: read one byte a page
        self.populated.set()
        log.info("slab of %d MiB pre-faulted in %.1f s", self.nbytes >> 20, time.monotonic() - t0)


class SlabShare:
    """Serves the slab's descriptor to ticket holders (see the module docstring)."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name
        self.sock_name = f"rlplane-slab-{secrets.token_hex(16)}"
        self._tickets: dict[str, float] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.sock_name)
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._serving = threading.BoundedSemaphore(MAX_SERVING)
        self._thread = threading.Thread(target=self._loop, name=f"rlplane-{name}-share", daemon=True)

    def start(self) -> SlabShare:
        self._thread.start()
        return self

    def ticket(self) -> str:
        """A new single-use ticket (128 random bits)."""
        t = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            if len(self._tickets) >= _MAX_TICKETS:
                self._tickets = {k: d for k, d in self._tickets.items() if d > now}
                while len(self._tickets) >= _MAX_TICKETS:
                    self._tickets.pop(next(iter(self._tickets)))
            self._tickets[t] = now + TICKET_TTL_S
        return t

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if not self._serving.acquire(blocking=False):  # (a flood of idle connections: the newest go)
                conn.close()
                continue
            threading.Thread(target=self._serve_one, args=(conn,), name=f"rlplane-{self.name}-share-conn",
                             daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        """One connection on a thread of its own, so a peer that connects and sends
        nothing (anyone on the host can find the socket) holds up no one else."""
        try:
            self._serve(conn)
        except OSError as err:  # a peer that went away mid-way, or too slow: nothing to do
            log.debug("%s: slab share connection failed: %s", self.name, err)
        finally:
            conn.close()
            self._serving.release()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + SERVE_S
        data = b""
        while b"\n" not in data and len(data) < 64:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = conn.recv(64 - len(data))
            if not chunk:
                return
            data += chunk
        ticket = data.split(b"\n", 1)[0].decode("ascii", "replace")
        with self._lock:
            deadline = self._tickets.pop(ticket, None)
        if deadline is None or deadline < time.monotonic():
            conn.sendall(b"no")
            return
        socket.send_fds(conn, [b"ok"], [self.fd])

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # with the close right after, the loop's accept fails at
        except OSError:                             # once (EBADF) instead of waiting out its 0.5 s timeout
            pass
        self._sock.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2)


__all__ = ["Slab", "SlabShare", "TICKET_TTL_S"]
