"""Mooncake's transfer engine: one-sided reads and writes of storage units' slabs from
another host.

A storage unit started with ``RLPLANE_TE_PROTOCOL`` (``tcp`` or ``rdma``) registers its
slab with a ``mooncake.engine.TransferEngine`` (peer-to-peer handshake: no metadata
server) and, asked with full-access credentials, says where it is: the engine's peer
name, the slab's base address and size (the unit's ``te`` operation). A client that
cannot map a unit's slab (another host, or told ``RLPLANE_DATA_PATH=te``) opens one
:class:`TransferPool` per process: an engine of its own and a staging buffer registered
with it once (pre-faulted, reused; ``RLPLANE_TE_STAGING_BYTES``). A put's values are
written to the extents the unit allocated with one batched transfer
(``batch_transfer_sync_write``) per block copy; a read's rows come with one batched
transfer per unit (``batch_transfer_sync_read``) straight into the memory the read hands
back. Over ``tcp`` the caller's buffers are registered for the transfer (cheap there);
over ``rdma`` (registering pins pages) the bytes go through the staging buffer, in
batches of its size (made at its first use). ZMQ carries control as on the other data
paths, so commits, pins, replicas and digests work as there. A transfer to a peer that
stops answering fails after STALL_S without progress, and a first contact with a peer
(the engine's handshake) after REACH_S; the memory of a failed transfer is quarantined
(the engine may still move its bytes when the peer comes back). A forked child opens an
engine of its own.

Trust: the engine authenticates nobody. Whoever reaches its ports reads and writes the
memory registered with it: the handshake hands the registered buffers' addresses to any
peer that asks (``get_first_buffer_address``), and the engine refuses only ranges outside
what was registered. The installed engine binds its two listeners (the
handshake port and the TCP data port, drawn at random, observed in 15000-17000) on every
interface whatever ``MC_TCP_BIND_ADDRESS`` says, so the transfer engine is off unless
configured and its ports must be confined by the network (the chart's NetworkPolicy).
Digests catch corruption in transit or at rest, not forgery.

Example::

    slab = RemoteSlab("unit-0", info["peer"], info["base"], info["bytes"], PoolSpec("tcp", "10.0.0.5"))
    slab.write([(values_u8, start)])                 # into extents the unit allocated
    slab.read(at, lens, [out], which, out_at)        # rows out of the unit's slab
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from rlplane.copies import copy, copy_ranges
from rlplane.errors import TransportError, UnavailableError, WireFormatError
from rlplane.shm import populate

log = logging.getLogger(__name__)

#: The transfer engine's protocols rlplane configures (RDMA NICs by RLPLANE_TE_DEVICES).
PROTOCOLS = ("tcp", "rdma")
#: Most bytes of failed transfers' memory a process keeps in quarantine: past it, the
#: pool moves nothing more (TransportError), rather than grow until the host kills it.
MAX_QUARANTINE_BYTES = 4 << 30
#: A client's staging buffer unless RLPLANE_TE_STAGING_BYTES says otherwise.
DEFAULT_STAGING_BYTES = 64 << 20
#: Seconds a TCP transfer may go without progress (or wait for its peer's status) before the
#: engine fails it: a unit whose engine stops answering is then UnavailableError well within
#: 10 s (the engine's own default is 30 s). Set MC_TCP_PROGRESS_TIMEOUT_SEC /
#: MC_TCP_STATUS_TIMEOUT_SEC to choose otherwise.
STALL_S = 4
#: Seconds the first contact with a peer (the engine's handshake, which the engine lets
#: wait about 60 s on a peer that stopped answering, whatever STALL_S says) may take before
#: the unit is UnavailableError. Made before a pool's first transfer to each peer, and again
#: after a transfer to it failed.
REACH_S = 2 * STALL_S


def open_engine(hostname: str, protocol: str, devices: str = "", ports: tuple[int, int] | None = None) -> Any:
    """A started ``TransferEngine`` advertising ``hostname`` (peer-to-peer handshake).
    ``ports``: the range its two listeners (handshake RPC and TCP data port) are drawn from
    (``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT``, set for this process); None: the engine's
    own choice (observed 15000-17000).

    TransportError when the mooncake wheel is missing or the engine does not start.

    Example: ``engine = open_engine("127.0.0.1", "tcp", ports=(15000, 15099))``
    """
    if protocol not in PROTOCOLS:
        raise TransportError(f"transfer engine protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if ports is not None:
        lo, hi = ports
        if not 1024 <= lo < hi <= 65535:
            raise TransportError(f"the transfer engine's port range must lie in 1024-65535 with room for its two "
                                 f"listeners, got {lo}-{hi}")
        os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(lo), str(hi)
    # The engine's glog INFO lines (every handshake, every segment) would go to stderr;
    # warnings and errors still do. Read when the library loads: set MC_LOG_LEVEL=INFO to see them.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    for knob in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):  # (read by each transfer)
        os.environ.setdefault(knob, str(STALL_S))
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        raise TransportError(f"the transfer engine needs Mooncake's wheel ({err}): pip install 'rlplane[mooncake]', "
                             "or use RLPLANE_DATA_PATH=zmq") from None
    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, devices)
    if rc != 0:
        raise TransportError(f"Mooncake's transfer engine did not start on {hostname} (protocol {protocol!r}, devices "
                             f"{devices or 'any'!r}: initialize returned {rc}); check RLPLANE_TE_PROTOCOL and "
                             "RLPLANE_TE_DEVICES")
    return engine


def register(engine: Any, addr: int, nbytes: int, what: str) -> None:
    """Register ``nbytes`` at ``addr`` with ``engine`` (TransportError if it refuses)."""
    rc = engine.register_memory(addr, nbytes)
    if rc != 0:
        raise TransportError(f"the transfer engine refused to register {what} ({nbytes} bytes; register_memory "
                             f"returned {rc})")


def local_address(peer_host: str) -> str:
    """The address of this host's interface that reaches ``peer_host`` (what the peer
    sees this process as); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class TransferPool:
    """One engine and its registered staging buffer (see the module docstring). Transfers
    through one pool take turns (the buffer is one); they run without the GIL.

    ``direct`` (default: with ``tcp``, where registering memory is bookkeeping, ~0.02 ms
    for 168 MB here): a transfer registers the caller's own buffers for its duration and
    moves the bytes straight between them and the unit's slab, with no copy through the
    staging buffer (which stays the way for RDMA, where registering pins pages, and for
    memory the engine will not register)."""

    def __init__(self, protocol: str, *, hostname: str, devices: str = "",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, direct: bool | None = None) -> None:
        if staging_bytes < mmap.PAGESIZE:
            raise TransportError(f"the transfer engine's staging buffer must be at least {mmap.PAGESIZE} bytes "
                                 "(RLPLANE_TE_STAGING_BYTES)")
        self.protocol, self.hostname = protocol, hostname
        self.direct = protocol == "tcp" if direct is None else direct
        self.engine = open_engine(hostname, protocol, devices)
        self.nbytes = staging_bytes - staging_bytes % mmap.PAGESIZE
        self._mm: mmap.mmap | None = None  # the staging buffer, made at its first use (see _staging)
        self._lock = threading.Lock()
        # Memory of transfers that failed: the engine may still move bytes of them (a peer
        # that stalled and came back), so it is never freed, reused or unregistered.
        self.quarantined: list[Any] = []
        self.quarantined_bytes = 0
        self._reached: set[str] = set()  # peers this engine made contact with (see reach)
        self._reaching: dict[str, _Contact] = {}
        self._reach_lock = threading.Lock()
        self._probe: np.ndarray | None = None

    def _staging(self) -> None:
        """The staging buffer, pre-faulted and registered (taken only once registered); made
        at its first use: a direct pool (tcp) never needs it."""
        if self._mm is not None:
            return
        mm = mmap.mmap(-1, self.nbytes)
        u8 = np.frombuffer(mm, np.uint8)
        if not populate(u8, write=True):  # older kernels: touch a byte a page
            u8[:: mmap.PAGESIZE] = 0
        register(self.engine, u8.ctypes.data, self.nbytes, "the client's staging buffer")
        self._mm, self.u8, self.base = mm, u8, u8.ctypes.data

    def reach(self, peer: str, unit: str, at: int) -> None:
        """Contact with ``peer`` within REACH_S, or UnavailableError naming storage unit
        ``unit``: a read of 8 bytes at its address ``at`` (registered there), which makes the
        engine's handshake; once per peer, and again after a transfer to it failed. A
        contact that outlasts REACH_S goes on in the background (one per peer at a time)."""
        if peer in self._reached:
            return
        with self._reach_lock:
            if self._probe is None:  # 8 bytes a late contact may still land in: never read, never reused
                probe = np.zeros(mmap.PAGESIZE, np.uint8)
                register(self.engine, probe.ctypes.data, probe.size, "the client's handshake page")
                self._probe = probe  # (only once registered)
            contact = self._reaching.get(peer)
            if contact is None:
                contact = self._reaching[peer] = _Contact(self.engine, peer, self._probe.ctypes.data, at, self._ended)
        if not contact.done.wait(REACH_S):
            raise UnavailableError(f"storage unit {unit}'s transfer engine at {peer} did not answer a handshake within "
                                   f"{REACH_S} s: the unit stalled or died", component=unit)
        if contact.rc != 0:
            raise UnavailableError(f"storage unit {unit}'s transfer engine at {peer} did not answer (rc {contact.rc}): "
                                   "the unit died, or its engine is not listening there", component=unit)

    def _ended(self, contact: _Contact) -> None:
        """A contact ended: the peer is reached, or the next caller makes a new one (a failure
        that ended after its callers gave up is no one's answer: the peer may answer again)."""
        with self._reach_lock:
            if self._reaching.get(contact.peer) is contact:
                del self._reaching[contact.peer]
            if contact.rc == 0:
                self._reached.add(contact.peer)

    def write(self, peer: str, unit: str, pieces: Sequence[tuple[np.ndarray, int]]) -> None:
        """Each ``(uint8 values, remote address)`` into the peer's memory."""
        srcs = [src for src, _ in pieces if src.size]
        remote = np.array([addr for src, addr in pieces if src.size], np.int64)
        lens = np.array([src.size for src in srcs], np.int64)
        if not lens.size:
            return
        self._room()
        self.reach(peer, unit, int(remote[0]))
        with self._lock, self._registered(srcs) as direct, self._staging_kept_on_failure(direct):
            if direct:
                self._move(peer, unit, "write", np.array([src.ctypes.data for src in srcs], np.int64), remote, lens)
                return
            self._staging()
            for b0, b1, k, off, n, stage in _windows(lens, self.nbytes):
                for j, o, m, s in zip(k[b0:b1].tolist(), off[b0:b1].tolist(), n[b0:b1].tolist(),
                                      stage[b0:b1].tolist()):
                    copy(self.u8[s : s + m], srcs[j][o : o + m])
                self._move(peer, unit, "write", stage[b0:b1] + self.base, remote[k[b0:b1]] + off[b0:b1], n[b0:b1])

    def read(self, peer: str, unit: str, at: np.ndarray, lens: np.ndarray, dsts: Sequence[np.ndarray],
             which: np.ndarray, dst_at: np.ndarray) -> None:
        """The peer's bytes at ``at[k]`` (``lens[k]`` of them) into ``dsts[which[k]]`` at
        ``dst_at[k]``, for every ``k``: one batched transfer per window of the staging buffer."""
        keep = lens > 0
        at, lens, which, dst_at = at[keep], lens[keep], which[keep], dst_at[keep]
        if not lens.size:
            return
        self._room()
        self.reach(peer, unit, int(at[0]))
        with self._lock, self._registered(dsts) as direct, self._staging_kept_on_failure(direct):
            if direct:
                local = np.array([d.ctypes.data for d in dsts], np.int64)[which] + dst_at
                starts = _runs(at, lens, local)
                self._move(peer, unit, "read", local[starts], at[starts], np.add.reduceat(lens, starts))
                return
            self._staging()
            # Rows that follow one another in the peer's memory move as one range.
            starts = _runs(at, lens)
            run_at, run_len = at[starts], np.add.reduceat(lens, starts)
            for (r0, r1, k, off, n, stage), (b0, b1, rk, roff, rn, rstage) in zip(_windows(run_len, self.nbytes),
                                                                                   _windows(lens, self.nbytes)):
                self._move(peer, unit, "read", stage[r0:r1] + self.base, run_at[k[r0:r1]] + off[r0:r1], n[r0:r1])
                rows = rk[b0:b1]
                for d in np.unique(which[rows]).tolist():
                    mine = which[rows] == d
                    copy_ranges(dsts[d], dst_at[rows[mine]] + roff[b0:b1][mine], self.u8, rstage[b0:b1][mine],
                                rn[b0:b1][mine])

    @contextmanager
    def _registered(self, arrays: Sequence[np.ndarray]) -> Iterator[bool]:
        """Whether the caller's ``arrays`` are registered for one transfer (``direct`` and the
        engine took them); they are unregistered on the way out. False: use the staging buffer."""
        spans = self._register(arrays) if self.direct else None
        try:
            yield spans is not None
        except BaseException:
            if spans is not None:  # a failed transfer's memory stays alive and registered (see __init__)
                self._quarantine(list(arrays), sum(a.nbytes for a in arrays))
                spans = None
            raise
        finally:
            if spans is not None:
                self._unregister(spans)

    @contextmanager
    def _staging_kept_on_failure(self, direct: bool) -> Iterator[None]:
        """A transfer through the staging buffer that fails leaves that buffer to the engine
        (quarantined) and takes a new one: no later transfer shares memory with it."""
        try:
            yield
        except BaseException:
            if not direct and self._mm is not None:
                self._quarantine(self._mm, self.nbytes)
                self._mm = None  # (a new one at the next transfer)
            raise

    def _quarantine(self, memory: Any, nbytes: int) -> None:
        self.quarantined.append(memory)
        self.quarantined_bytes += nbytes

    def _room(self) -> None:
        """TransportError once the quarantine holds MAX_QUARANTINE_BYTES: no more transfers."""
        if self.quarantined_bytes >= MAX_QUARANTINE_BYTES:
            raise TransportError(
                f"this process keeps {self.quarantined_bytes / 2**20:.0f} MiB of memory from failed transfer-engine "
                f"transfers, which the engine may still write into (at most {MAX_QUARANTINE_BYTES / 2**20:.0f} MiB), "
                "so it moves no more bytes over the transfer engine: find why storage units stall (their hosts, "
                "the network), then restart this process, or connect with data_path='zmq'")

    def _register(self, arrays: Sequence[np.ndarray]) -> list[int] | None:
        """Register the memory of ``arrays`` (as disjoint spans) for one transfer; the spans'
        starts, or None when the engine refuses one (then nothing stays registered)."""
        spans: list[list[int]] = []
        for lo, hi in sorted((a.ctypes.data, a.ctypes.data + a.size) for a in arrays if a.size):
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        done: list[int] = []
        for lo, hi in spans:
            if self.engine.register_memory(lo, hi - lo) != 0:  # e.g. it overlaps the staging buffer
                self._unregister(done)
                return None
            done.append(lo)
        return done

    def _unregister(self, starts: list[int]) -> None:
        for lo in starts:
            self.engine.unregister_memory(lo)

    def _move(self, peer: str, unit: str, op: str, local: np.ndarray, remote: np.ndarray, lens: np.ndarray) -> None:
        fn = self.engine.batch_transfer_sync_write if op == "write" else self.engine.batch_transfer_sync_read
        rc = fn(peer, local.tolist(), remote.tolist(), lens.tolist())
        if rc != 0:
            self._reached.discard(peer)  # (the engine may handshake again: bounded by reach)
            raise UnavailableError(f"storage unit {unit}'s transfer engine at {peer} did not take a {op} of "
                                   f"{int(lens.sum())} bytes (rc {rc}): the unit may have died", component=unit)


class _Contact:
    """One first contact with a peer, on a thread of its own (the engine's call cannot be
    cut short; it lets go of the GIL): ``done`` once it ended, ``rc`` its outcome (0: made)."""

    def __init__(self, engine: Any, peer: str, local: int, at: int, ended: Callable[[_Contact], None]) -> None:
        self.peer, self.done, self.rc = peer, threading.Event(), -1
        threading.Thread(target=self._run, args=(engine, local, at, ended), name="rlplane-te-handshake",
                         daemon=True).start()

    def _run(self, engine: Any, local: int, at: int, ended: Callable[[_Contact], None]) -> None:
        try:
            self.rc = int(engine.batch_transfer_sync_read(self.peer, [local], [at], [8]))
        except Exception:  # noqa: BLE001 - (rc stays -1: reach says the peer did not answer)
            pass
        finally:
            ended(self)  # (before done: a caller that saw it succeed finds the peer reached)
            self.done.set()


def _runs(at: np.ndarray, lens: np.ndarray, local: np.ndarray | None = None) -> np.ndarray:
    """Where runs start: ranges that follow one another at the peer (and here) move as one."""
    brk = np.ones(lens.size, bool)
    brk[1:] = at[1:] != at[:-1] + lens[:-1]
    if local is not None:
        brk[1:] |= local[1:] != local[:-1] + lens[:-1]
    return np.flatnonzero(brk)


def _windows(lens: np.ndarray, cap: int) -> list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The ranges ``lens`` laid end to end, cut into windows of ``cap`` bytes (one batch
    each): per window ``(first, end)`` into the piece arrays ``(range, offset in it,
    length, offset in the window)``. Vectorized; a range crossing a window's end is split."""
    start = np.cumsum(lens) - lens
    end = start + lens
    first, last = start // cap, (end - 1) // cap
    count = last - first + 1
    k = np.repeat(np.arange(lens.size), count)
    window = np.repeat(first, count) + (np.arange(k.size) - np.repeat(np.cumsum(count) - count, count))
    lo = np.maximum(start[k], window * cap)
    hi = np.minimum(end[k], (window + 1) * cap)
    off, n, stage = lo - start[k], hi - lo, lo - window * cap
    bounds = np.flatnonzero(np.diff(window)) + 1
    cuts = [0, *bounds.tolist(), k.size]
    return [(a, z, k, off, n, stage) for a, z in zip(cuts[:-1], cuts[1:])]


_pools: dict[tuple[str, str, str, int], TransferPool] = {}
_pools_lock = threading.Lock()


def transfer_pool(protocol: str, *, hostname: str, devices: str = "",
                  staging_bytes: int = DEFAULT_STAGING_BYTES) -> TransferPool:
    """This process's pool for ``protocol`` seen as ``hostname`` (opened once, kept for
    the process: an engine cannot be stopped and started again cheaply). A forked child
    opens its own (its parent's engine has no threads there: it is let go at the fork).

    Example: ``pool = transfer_pool("tcp", hostname=local_address("10.0.0.7"))``
    """
    key = (protocol, hostname, devices, staging_bytes)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = TransferPool(protocol, hostname=hostname, devices=devices, staging_bytes=staging_bytes)
        return pool


def _forget_pools() -> None:
    """In a forked child: the parent's engines have no threads here, so none is used, and
    none is ever torn down (that crashed the child, at once or at its exit): each is kept
    alive for good (a reference never given back), and the child opens its own."""
    global _pools_lock
    _pools_lock = threading.Lock()
    for pool in _pools.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool.engine))
        _inherited.append(pool)
    _pools.clear()


_inherited: list[TransferPool] = []  # (a forked child's parent's pools: their memory stays mapped)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


@dataclass(frozen=True)
class PoolSpec:
    """Which :func:`transfer_pool` a client's transfers go through (looked up at each use:
    a forked child gets one of its own)."""

    protocol: str
    hostname: str
    devices: str = ""
    staging_bytes: int = DEFAULT_STAGING_BYTES

    def pool(self) -> TransferPool:
        return transfer_pool(self.protocol, hostname=self.hostname, devices=self.devices,
                             staging_bytes=self.staging_bytes)


@dataclass(eq=False)
class RemoteSlab:
    """A storage unit's slab reached through the transfer engine (offsets are the slab's)."""

    unit: str
    peer: str
    base: int
    nbytes: int
    spec: PoolSpec

    @property
    def pool(self) -> TransferPool:
        return self.spec.pool()

    def reach(self) -> None:
        """Contact with the unit's engine within REACH_S, or UnavailableError naming it."""
        if self.nbytes < 8:
            raise WireFormatError(f"storage unit {self.unit} says its slab holds {self.nbytes} bytes")
        self.pool.reach(self.peer, self.unit, self.base)

    def write(self, pieces: Sequence[tuple[np.ndarray, int]]) -> None:
        """Each ``(uint8 values, slab offset)`` into the slab (extents the unit allocated)."""
        for src, start in pieces:
            if start < 0 or start + src.size > self.nbytes:
                raise WireFormatError(f"storage unit {self.unit} allocated an extent outside its slab")
        self.pool.write(self.peer, self.unit, [(src, self.base + start) for src, start in pieces])

    def read(self, at: np.ndarray, lens: np.ndarray, dsts: Sequence[np.ndarray], which: np.ndarray,
             dst_at: np.ndarray) -> None:
        """Rows at slab offsets ``at`` (``lens`` bytes each) into ``dsts[which[k]]`` at ``dst_at[k]``."""
        if at.size and (int(at.min()) < 0 or int((at + lens).max()) > self.nbytes):
            raise WireFormatError(f"the controller located rows outside storage unit {self.unit}'s slab")
        self.pool.read(self.peer, self.unit, at + self.base, lens, dsts, which, dst_at)


__all__ = ["PROTOCOLS", "DEFAULT_STAGING_BYTES", "REACH_S", "PoolSpec", "RemoteSlab", "TransferPool", "local_address",
           "open_engine", "register", "transfer_pool"]
