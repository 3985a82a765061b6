"""Channel: one request/reply connection to a native-engine server, with a deadline.

A ZMQ DEALER socket to one endpoint (the controller or a storage unit) plus a monitor
socket that reports the connection's fate, so a call never hangs:

- the peer never completes a handshake within ``connect_timeout`` -> UnavailableError;
- the connection drops while a reply is awaited (the unit's process died) -> UnavailableError
  at once; a silent peer is caught by ZMQ heartbeats within seconds;
- the handshake is refused (wrong or missing data secret) -> AuthenticationError;
- no reply before the call's deadline -> TransportError.

After any of these the channel closes itself; a late reply can never be taken for the
answer to a later request (each request carries an id). Authentication is ZMQ's PLAIN
mechanism checked by the server's ZAP handler: a peer without the secret cannot hand
the server a single message.

Not thread-safe: :class:`ChannelPool` gives each thread its own channels, and
:class:`SharedChannels` lets every client of a process with the same credentials use one
pool (a hundred clients hold the sockets of one).

A channel dropped without :meth:`Channel.close` has its sockets closed once it is
garbage, so a client that is never closed leaks no descriptor. Its finalizer only hands
the sockets to a reaper (a finalizer may run in any thread, even inside one of ZMQ's own
I/O threads, where closing a socket would deadlock the context): the next channel made
in this process, or the reaper thread within a second, closes them. All channels of a
process share one ZMQ context; a forked child gets a context and channels of its own on
first use (it never touches its parent's sockets). Running out of descriptors is a
TransportError that says how many the process holds.

Example::

    ch = Channel("tcp://127.0.0.1:5555", "unit-0", secret=b"...")
    header, columns, extra = ch.call({"op": "stats"}, timeout=5.0)
"""

from __future__ import annotations

import errno
import functools
import itertools
import operator
import os
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from rlplane.shared import Refcounted
from rlplane.errors import AuthenticationError, TransportError, UnavailableError, WireFormatError, error_from_payload
from rlplane.wire import RawColumn, pack_message, unpack_header, unpack_message
from rlplane.opstats import add_engine, add_wait

if TYPE_CHECKING:
    from rlplane.column import Column

#: ``sink(reply header, k)``: a writable buffer for the reply's ``k``-th data frame, or None.
Sink = Callable[[dict[str, Any], int], Any]

#: The PLAIN user name every rlplane data connection presents (the secret is the password).
PLAIN_USER = b"rlplane"
#: How long a peer may take to accept a connection before it counts as unavailable.
CONNECT_TIMEOUT_S = 5.0
_HEARTBEAT_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 4000
_AUTH_FAILED = {getattr(zmq, n) for n in ("EVENT_HANDSHAKE_FAILED_AUTH", "EVENT_HANDSHAKE_FAILED_PROTOCOL",
                                          "EVENT_HANDSHAKE_FAILED_NO_DETAIL")}
_rids = itertools.count(1)
#: The socket events a channel acts on. Only these: a socket retrying a dead peer emits
#: connect events every reconnect interval, and a monitor pipe nobody drains (an idle
#: channel) must not fill up with them.
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | functools.reduce(operator.or_, _AUTH_FAILED)
#: ZMQ I/O threads of a client process: one per storage unit read in parallel, up to this.
IO_THREADS = 4
_ctx_lock = threading.Lock()
_ctx: zmq.Context | None = None
_ctx_pid = 0


def _context() -> zmq.Context:
    """The process's ZMQ context for channels (several I/O threads: a read from two units
    moves both shares at once instead of through one thread); a forked child makes its own."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx.closed or _ctx_pid != os.getpid():
            _ctx = zmq.Context(io_threads=IO_THREADS)  # a parent's context is unusable after fork: never term it
            _ctx_pid = os.getpid()
        return _ctx


def open_descriptors() -> int:
    """How many file descriptors this process holds (-1 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _no_descriptors(err: zmq.ZMQError, what: str) -> TransportError:
    return TransportError(f"cannot open a connection to {what}: this process is out of file descriptors (it holds "
                          f"{open_descriptors()}; ulimit -n) or ZMQ sockets ({_context().get(zmq.MAX_SOCKETS)} per process). "
                          "Close clients you no longer use (client.close(), or `with rlplane.connect(...)`), or share "
                          f"one client per process ({err})")


_graveyard: list[tuple[zmq.Socket, zmq.Socket, int]] = []  # sockets of dropped channels, to close
_graveyard_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _bury(sock: zmq.Socket, monitor: zmq.Socket, pid: int) -> None:
    """A dropped channel's finalizer: queue its sockets for :func:`reap` (no ZMQ call here)."""
    global _reaper
    with _graveyard_lock:
        _graveyard.append((sock, monitor, pid))
        if _reaper is None or not _reaper.is_alive() or _reaper.ident is None:
            _reaper = threading.Thread(target=_reap_loop, name="rlplane-socket-reaper", daemon=True)
            _reaper.start()


def reap() -> None:
    """Close the sockets of channels that were dropped (from an ordinary thread)."""
    with _graveyard_lock:
        dead = _graveyard[:]
        del _graveyard[:]
    for sock, monitor, pid in dead:
        _close_sockets(sock, monitor, pid)


def _reap_loop() -> None:
    while True:
        time.sleep(0.5)
        reap()


def _close_sockets(sock: zmq.Socket, monitor: zmq.Socket, pid: int) -> None:
    """Close a channel's sockets; in a forked child the parent's sockets are left alone
    (closing them there is undefined)."""
    if pid != os.getpid():
        return
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
    sock.close(linger=0)


#: zmq's SNDMORE as a plain int (pyzmq's own send_multipart ors the flag enum per frame).
_MORE = int(zmq.SNDMORE)


def send_frames(sock: Any, frames: Sequence[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)`` without pyzmq's per-frame flag
    arithmetic (its enum costs ~1.5 µs a frame, and a put's messages carry a dozen frames).

    Example: ``send_frames(sock, [ident, *reply])``."""
    last = len(frames) - 1
    send = sock.send
    for k, frame in enumerate(frames):
        send(frame, flags | _MORE if k < last else flags, copy=False)


def recv_frames(sock: Any, flags: int = 0) -> list[Any]:
    """``sock.recv_multipart(flags, copy=False)``, asking each frame whether more follow
    (``Frame.more``) where pyzmq asks the socket (a getsockopt, ~2 µs a frame).

    Example: ``ident, *body = recv_frames(sock, zmq.NOBLOCK)``."""
    frame = sock.recv(flags, copy=False)
    out = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        out.append(frame)
    return out


class Channel:
    """A deadline-bound request/reply connection (see the module docstring)."""

    def __init__(self, endpoint: str, name: str, *, secret: bytes | None = None,
                 context: zmq.Context | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 user: bytes = PLAIN_USER) -> None:
        """``secret`` (and ``user``, a tenant's engine credential): ZMQ PLAIN credentials."""
        self.endpoint, self.name = endpoint, name
        self.connect_timeout = connect_timeout
        reap()
        ctx = context or _context()
        try:
            self._sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise _no_descriptors(err, f"{name} at {endpoint}") from None
            raise
        self._sock.linger = 0
        # A DEALER with no connected peer blocks a send until one appears: a peer that is
        # gone, or that refused the handshake, would hang the call past any deadline.
        self._sock.sndtimeo = max(1, int(connect_timeout * 1000))
        self._sock.heartbeat_ivl = _HEARTBEAT_MS
        self._sock.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
        self._sock.reconnect_ivl = 100
        if secret is not None:
            self._sock.plain_username = user
            self._sock.plain_password = secret
        try:  # a unique address: pyzmq's default names it after the fd, which a dropped socket may still hold
            self._monitor = self._sock.get_monitor_socket(events=_MONITORED,
                                                          addr=f"inproc://rlplane-monitor-{uuid.uuid4().hex}")
        except zmq.ZMQError as err:
            self._sock.close(linger=0)
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise _no_descriptors(err, f"{name} at {endpoint}") from None
            raise
        self._finalizer = weakref.finalize(self, _bury, self._sock, self._monitor, os.getpid())
        self._finalizer.atexit = False  # at exit the process's sockets go with it
        self._created = time.monotonic()
        self._up = False
        self._pending: set[int] = set()
        self._stash: dict[int, Any] = {}
        self._sock.connect(endpoint)
        self.closed = False

    def call(self, header: Mapping[str, Any], columns: Mapping[str, Column | RawColumn] | None = None,
             buffers: Sequence[Any] = (), *, timeout: float) -> tuple[dict[str, Any], dict[str, RawColumn], list[memoryview]]:
        """Send one request and wait for its reply; raise the reply's typed error if it is one.
        A peer that dropped the connection since the last call is peer_down before anything
        is sent (:func:`ride` then makes the call again, once)."""
        self.raise_if_dropped()
        deadline = time.monotonic() + timeout
        return self.receive(self.send(header, columns, buffers), deadline)

    def send(self, header: Mapping[str, Any], columns: Mapping[str, Column | RawColumn] | None = None,
             buffers: Sequence[Any] = ()) -> int:
        """Queue one request; returns its id for :meth:`receive` (for requests in flight to several peers)."""
        if self.closed:
            raise TransportError(f"channel to {self.name} is closed")
        rid = next(_rids)
        self._send(pack_message({**header, "rid": rid}, columns, buffers, checked=True))
        self._pending.add(rid)
        return rid

    def post(self, header: Mapping[str, Any]) -> None:
        """Send a one-way request (the server handles it and never answers), e.g. an unpin."""
        if self.closed:
            raise TransportError(f"channel to {self.name} is closed")
        self._send(pack_message({**header, "rid": 0, "nr": True}, checked=True))

    def raise_if_dropped(self) -> None:
        """Raise peer_down (and close), before anything is sent, when the peer dropped this
        idle channel's connection since its last call (its process died or restarted).
        Noticed only after a send, the request would already be on its way to the
        restarted peer over the socket's reconnection, and a caller told that it failed
        would make it again: a claim twice (its first batch leased to nobody), a put's
        reservation twice (its block ids then refused as in use)."""
        if self._pending or not self._up or self.closed:
            return
        try:
            self._drain_monitor()
        except UnavailableError:
            self.close()
            raise

    def _send(self, frames: list[Any]) -> None:
        try:
            send_frames(self._sock, frames)
        except zmq.Again:  # no peer took the connection within connect_timeout
            try:
                self._drain_monitor()  # a refused handshake says so
            finally:
                self.close()
            raise peer_down(f"cannot reach {self.name} at {self.endpoint} (no connection within "
                            f"{self.connect_timeout:.0f} s); it may have died, or refused this connection's "
                            "credentials: check the service's /readyz", self.name) from None

    def receive(self, rid: int, deadline: float, sink: Sink | None = None
                ) -> tuple[dict[str, Any], dict[str, RawColumn], list[memoryview]]:
        """The reply to request ``rid`` (sent on this channel) by ``deadline`` (a monotonic time).

        ``sink(header, k)`` may name a writable buffer for the reply's ``k``-th data frame
        (its exact size): the frame is received straight into it, with no copy after."""
        try:
            while True:
                if rid in self._stash:
                    reply, cols, extra = self._stash.pop(rid)
                else:
                    self._wait(deadline)
                    reply, cols, extra = unpack_message(self._read(rid, sink))
                    got = reply.get("rid")
                    if got != rid:
                        if isinstance(got, int) and got in self._pending:
                            self._stash[got] = (reply, cols, extra)
                        continue  # else a late answer to a request given up on
                self._pending.discard(rid)
                if not reply.get("ok"):
                    raise error_from_payload(reply.get("error"))
                took = reply.pop("took", None)  # the server's time over it (rlplane.opstats), not an answer's
                if type(took) is float and 0.0 <= took < 1e6:
                    add_engine(took)
                return reply, cols, extra
        except (UnavailableError, AuthenticationError):
            self.close()  # a typed error in a reply leaves the channel usable; these do not
            raise

    def _wait(self, deadline: float) -> None:
        start = time.monotonic()
        try:
            self._wait_ready(deadline)
        finally:
            add_wait(time.monotonic() - start)  # (the op's time blocked on the store: rlplane.opstats)

    def _wait_ready(self, deadline: float) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            if now >= deadline:
                if self._sock.poll(0, zmq.POLLIN):  # an answer that came while others were awaited counts
                    return
                self.close()
                raise TransportError(f"{self.name} ({self.endpoint}) did not answer before the call's deadline; "
                                     "raise connect(timeout=...) for bigger batches, or check the service's /readyz")
            if not self._up and now - self._created > self.connect_timeout:
                self._drain_monitor()  # its handshake may have come while another channel's answer was awaited
            if not self._up and now - self._created > self.connect_timeout:
                raise peer_down(f"cannot reach {self.name} at {self.endpoint} (no connection within "
                                f"{self.connect_timeout:.0f} s); it may have died: check the service's /readyz",
                                self.name)
            ready = dict(poller.poll(timeout=max(1, int(min(deadline - now, 0.5) * 1000))))
            if self._monitor in ready:
                self._drain_monitor()
            if self._sock in ready:
                return

    def _read(self, rid: int, sink: Sink | None) -> list[Any]:
        """One whole message; data frames of the reply to ``rid`` go where ``sink`` says."""
        first = self._sock.recv(copy=False)
        head, more = first.bytes, first.more  # (a frame says whether more follow: no socket option asked)
        frames: list[Any] = [head]
        header = None
        if sink is not None:
            try:
                header = unpack_header(head)
            except WireFormatError:
                header = None
            if header is not None and header.get("rid") != rid:
                header = None
        k = 0
        while more:
            dest = sink(header, k) if header is not None and sink is not None else None
            if dest is None:
                frame = self._sock.recv(copy=False)
                frames.append(frame)
                more = frame.more
            else:
                got = self._sock.recv_into(dest)
                more = self._sock.rcvmore
                if got != len(dest):
                    while more:  # keep the socket in step before refusing the message
                        more = self._sock.recv(copy=False).more
                    raise WireFormatError(f"{self.name} sent a frame of {got} bytes where {len(dest)} were announced")
                frames.append(dest)
            k += 1
        return frames

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = True
            elif event in _AUTH_FAILED:
                raise AuthenticationError(
                    f"{self.name} at {self.endpoint} refused this connection's credentials; the data path needs "
                    "the secret the service hands out under its API token (connect with the right token=)")
            elif event == zmq.EVENT_DISCONNECTED and self._up:
                raise peer_down(f"{self.name} at {self.endpoint} dropped the connection mid-call "
                                "(its process died or restarted); check the service's /readyz", self.name)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._finalizer.detach() is not None:
            _close_sockets(self._sock, self._monitor, os.getpid())

    def abandon(self) -> None:
        """Close without a ZMQ call (from a finalizer): the reaper closes the sockets."""
        self.closed = True
        self._finalizer()


def peer_down(message: str, name: str) -> UnavailableError:
    """The UnavailableError of a peer that cannot be reached (``peer_down``: no answer came,
    unlike an UnavailableError a peer answers with)."""
    err = UnavailableError(message, component=name)
    err.peer_down = True  # type: ignore[attr-defined]
    return err


def ride(get: Callable[[], Channel], header: Mapping[str, Any], columns: Mapping[str, Column | RawColumn] | None = None,
         buffers: Sequence[Any] = (), *, timeout: float) -> tuple[dict[str, Any], dict[str, RawColumn], list[memoryview]]:
    """:meth:`Channel.call` on ``get()``'s channel, riding through a restart of the peer:
    while it cannot be reached (UnavailableError: its process died, or restarts and
    rebuilds) the call is made again on a new connection, backing off, until ``timeout``;
    then the last UnavailableError. Only for requests that may arrive twice.

    Example: ``ride(lambda: pool.get(endpoint, "controller"), {"op": "list"}, timeout=30)``
    """
    deadline = time.monotonic() + timeout
    pause, down = 0.05, None
    while True:
        try:
            return get().call(header, columns, buffers, timeout=max(0.001, deadline - time.monotonic()))
        except UnavailableError as err:
            if not getattr(err, "peer_down", False) or time.monotonic() + pause >= deadline:
                raise  # an answer that says a component is unavailable is the caller's to handle
            down = err
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        except TransportError as err:
            if down is None:
                raise
            raise UnavailableError(f"{down} (still no answer after the call's {timeout:.0f} s)",
                                   component=down.component) from err


class ChannelPool:
    """Per-thread channels to named endpoints; a channel that failed is replaced on next
    use, and the channels of threads that have ended are closed when a new one is made
    (a client used from short-lived threads keeps one set of sockets per live thread).
    ``close()`` closes them all; a pool dropped without it has its channels closed once
    they are garbage (see :class:`Channel`). A forked child starts with no channels (its
    parent's are never used there)."""

    def __init__(self, secret: bytes | None = None, user: bytes = PLAIN_USER) -> None:
        self.secret, self.user = secret, user
        self._local = threading.local()
        self._all: list[tuple[threading.Thread, Channel]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.closed = False

    def get(self, endpoint: str, name: str) -> Channel:
        if self.closed:
            raise TransportError(f"this client was closed; connect again to reach {name}")
        if self._pid != os.getpid():  # forked: the parent's channels are not ours to use (nor to close)
            with self._lock:
                self._all, self._pid = [], os.getpid()
            self._local = threading.local()
        chans = getattr(self._local, "chans", None)
        if chans is None:
            chans = self._local.chans = {}
        ch = chans.get(endpoint)
        if ch is None or ch.closed:
            ch = chans[endpoint] = Channel(endpoint, name, secret=self.secret, user=self.user)
            with self._lock:
                ended = [c for t, c in self._all if not t.is_alive()]
                self._all = [(t, c) for t, c in self._all if t.is_alive() and not c.closed]
                self._all.append((threading.current_thread(), ch))
            for c in ended:  # its thread is gone: nobody else uses its sockets
                c.close()
        return ch

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for _, c in self._all if not c.closed)

    def close(self, *, abandon: bool = False) -> None:
        """Close every channel; ``abandon`` (from a finalizer) leaves the ZMQ calls to the reaper."""
        self.closed = True
        with self._lock:
            chans, self._all = self._all, []
        self._local = threading.local()
        if self._pid != os.getpid():
            return
        for _, ch in chans:
            ch.abandon() if abandon else ch.close()


#: The pool every client of this process with the same (pid, secret, user) shares.
_POOLS: Refcounted[ChannelPool] = Refcounted(
    make=lambda key: ChannelPool(key[1], key[2]), closed=lambda pool: pool.closed,
    close=lambda key, pool, abandon: pool.close(abandon=abandon))


class SharedChannels:
    """A client's hold on its process's channels for one set of credentials.

    Every client of a process that presents the same data secret and user shares one
    :class:`ChannelPool` (per thread, one channel per endpoint), so a hundred clients
    cost the sockets of one. The pool is closed when its last holder closes or is
    garbage; closing one holder leaves the others' channels alone. A forked child holds
    a pool of its own from its first call (it never uses its parent's sockets).

    Example::

        chans = SharedChannels(b"secret")
        chans.get("tcp://127.0.0.1:5555", "controller").call({"op": "ping"}, timeout=5)
        chans.close()
    """

    def __init__(self, secret: bytes | None = None, user: bytes = PLAIN_USER) -> None:
        self.secret, self.user = secret, user
        self.closed = False
        self._take()

    def _take(self) -> None:
        key = (os.getpid(), self.secret, self.user)
        self._pool = _POOLS.hold(key)
        self._finalizer = weakref.finalize(self, _POOLS.let_go, key, self._pool, True)
        self._finalizer.atexit = False

    def get(self, endpoint: str, name: str) -> Channel:
        if self.closed:
            raise TransportError(f"this client was closed; connect again to reach {name}")
        if self._pool._pid != os.getpid():  # forked: hold the child's own pool
            self._finalizer.detach()
            self._take()
        return self._pool.get(endpoint, name)

    def __len__(self) -> int:
        return len(self._pool)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        args = self._finalizer.detach()
        if args is not None:
            _POOLS.let_go(args[2][0], args[2][1], False)


async def acall(endpoint: str, name: str, header: Mapping[str, Any], *, secret: bytes | None,
                timeout: float, user: bytes = PLAIN_USER) -> dict[str, Any]:
    """One request/reply from asyncio code, on a socket of its own (for calls that may wait
    long on the server, such as a parked claim, without holding a thread). Header-only
    replies; raises the reply's typed error, or TransportError at the deadline.

    Example: ``await acall(ep, "controller", {"op": "ping"}, secret=None, timeout=5)``
    """
    import asyncio

    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if secret is not None:
        sock.plain_username = user
        sock.plain_password = secret
    try:
        sock.connect(endpoint)
        rid = next(_rids)
        await sock.send_multipart(pack_message({**header, "rid": rid}))
        try:
            while True:
                reply = unpack_message(await asyncio.wait_for(sock.recv_multipart(), timeout))[0]
                if reply.get("rid") == rid:
                    break
        except asyncio.TimeoutError:
            raise UnavailableError(f"{name} at {endpoint} did not answer within {timeout:.0f} s (it may have died, or "
                                   "refused this connection's credentials)", component=name) from None
        if not reply.get("ok"):
            raise error_from_payload(reply.get("error"))
        return reply
    finally:
        sock.close(linger=0)


__all__ = ["Channel", "ChannelPool", "SharedChannels", "PLAIN_USER", "CONNECT_TIMEOUT_S", "acall", "send_frames",
           "recv_frames"]
