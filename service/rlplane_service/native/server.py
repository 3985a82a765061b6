"""The server loop of a native-engine component: a ZMQ ROUTER socket served by one thread.

Each request is ``[identity, header, frames...]`` (see :mod:`rlplane.wire`); the loop
parses it, calls the handler's ``op_<name>(header, columns, extra)`` and answers
``[identity, reply header, frames...]``. Whatever a handler raises becomes an error
reply: an rlplane error keeps its type; anything else (a bug) is logged and answered as
a TransportError. Malformed frames get a WireFormatError reply and the loop goes on.

A handler may *park* a request (a claim waiting for samples) by raising :class:`Park`
with a deadline and a key (its partition): the loop keeps it, without a thread, and runs
it again whenever the handler's ``wake()`` names its key among those that changed (or
answers True: all), and once more, marked final (``header["_final"]``), when its
deadline passes. A handler may also return a fourth item, a callable the loop runs
right after the answer is sent (before it reads the next request): a commit answers
once it has checked everything and then updates its index, off the writer's clock.
An answer too big to send (over the header limit) is answered as PayloadTooLargeError,
and the handler's ``unsent(answer)``, if it has one, takes back what the answer would
have handed out (a locate's pin).
A handler with ``open_batch()`` and ``flush()`` (the controller: its commit-log entries)
is served in batches: the requests waiting on a socket (up to MAX_BATCH) are handled one
after the other, each one's after-answer work run before the next is handled, then
``flush()`` does what they staged (one round trip to the storage units for all of them:
group commit), and only then are their answers sent, then the last one's after-answer
work runs (off its writer's clock, as outside a batch); ``flush()`` names the requests
whose staged work failed, and those are answered with its error. Headers carry ``_t0``, when the
request arrived; keys starting with ``_`` from the network are dropped. A request
whose header has ``nr: true`` is one-way: it is handled and never answered. A successful
answer says how long the server took over it (``took``: seconds from its arrival, a
parked request's wait included, to its answer; a batch's ``flush()`` not included), so a
client can tell the engine's time from the time on the way (:mod:`rlplane.opstats`).

With a secret, the socket is a ZMQ PLAIN server and a ZAP handler admits only peers
that present it: unauthenticated peers cannot deliver a single message. With a
``control_secret`` the server binds a second socket (``control_endpoint``) that admits
only peers holding that one: the handler's ``CONTROL_OPS`` (a storage unit's ``free``,
``block``...) are served there and refused on the data socket with ForbiddenError,
so a data client cannot delete or copy out what the controller manages. ``users`` adds
PLAIN users of their own to the data socket (tenants, :mod:`rlplane_service.tenants`):
every request's header then carries ``_user``, the name its connection authenticated
as (``rlplane`` for the full-access secret), for the handler to check its scope, and
``_control``, True only for a request that came in on the control socket (no user name
can say that: a tenant may be called anything its tokens file allows).

No request can stop the loop: whatever one request raises is answered or logged, a
parked request's deadline is clamped to a finite time at most ``MAX_PARK_S`` away, at
most ``MAX_PARKED`` requests wait at once, and ``health()`` says whether the loop
thread is alive and how many requests failed with a bug (``/readyz`` and ``/metrics``
show it).

Example::

    server = Server(handler, host="127.0.0.1", secret=b"...")
    server.start()
    server.endpoint        # "tcp://127.0.0.1:43121"
"""

from __future__ import annotations

import gc
import hmac
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping

import zmq
from zmq.auth.thread import ThreadAuthenticator

from rlplane import errors as E
from rlplane.channel import PLAIN_USER, recv_frames, send_frames
from rlplane.gcpause import gc_paused
from rlplane.wire import pack_message, unpack_header, unpack_message

log = logging.getLogger(__name__)

#: A handler answers ``(reply header, columns, buffers)``.
Reply = tuple[dict[str, Any], dict[str, Any], list[Any]]  # (+ an optional callable run once it is sent)
#: Largest frame a server accepts (bounds what one message can make it allocate).
MAX_FRAME_BYTES = 16 << 30
#: Longest a parked request waits for its final run, and most requests parked at once.
MAX_PARK_S, MAX_PARKED = 3600.0, 4096
#: Most requests served as one batch by a handler that stages work (``flush``).
MAX_BATCH = 64


class Park(Exception):
    """Raised by a handler op: answer this request later (see the module docstring)."""

    def __init__(self, deadline: float, key: Any = None, refused: Callable[[], None] | None = None) -> None:
        """``refused``: run when the server does not park it after all (MAX_PARKED waiting)."""
        super().__init__(deadline)
        self.deadline, self.key, self.refused = deadline, key, refused


class _PlainAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with a PLAIN password compared in constant time and never
    logged (pyzmq's compares with ``==`` and logs an admitted password at DEBUG)."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        want = self.passwords.get(domain or "*", {}).get(username)
        given = password.encode("utf-8", "surrogateescape")
        ok = want is not None and hmac.compare_digest(given, want.encode("utf-8", "surrogateescape"))
        if not ok:
            self.log.debug("refused a PLAIN peer (domain %s, user %r)", domain, username[:64])
        return ok, b"" if ok else b"Invalid credentials"


class Server:
    """Serves ``handler.op_<name>`` on a ROUTER socket from one thread (see the module docstring)."""

    def __init__(self, handler: Any, *, host: str = "127.0.0.1", port: int | tuple[int, int] = 0,
                 secret: bytes | None = None, name: str = "server", control_secret: bytes | None = None,
                 control_port: int = 0, users: Mapping[str, bytes] | None = None) -> None:
        """``port``: a port, ``(lowest, highest)`` to bind a free one of that range, or 0 for any."""
        self.handler, self.name = handler, name
        self._ctx = zmq.Context()
        self._auth = None
        if secret is not None or control_secret is not None:
            self._auth = _PlainAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
        try:
            self._sock = self._bind(host, port, secret, "rlplane", users)
            self._control = self._bind(host, control_port, control_secret, "rlplane-ctl") if control_secret else None
        except BaseException:
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control_endpoint = self._control.getsockopt_string(zmq.LAST_ENDPOINT) if self._control else None
        self._control_ops = frozenset(getattr(handler, "CONTROL_OPS", ())) if self._control else frozenset()
        self._stop = threading.Event()
        # (socket, identity, frames, arrival, deadline, key)
        self._parked: list[tuple[Any, Any, list[Any], float, float, Any]] = []
        self.failures = 0  # requests that failed with a bug (not a typed error), and loop iterations that did
        self._thread = threading.Thread(target=self._loop, name=f"rlplane-{name}", daemon=True)

    def _bind(self, host: str, port: int | tuple[int, int], secret: bytes | None, domain: str,
              users: Mapping[str, bytes] | None = None) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.maxmsgsize = MAX_FRAME_BYTES
        sock.router_mandatory = False
        if secret is not None:
            assert self._auth is not None
            passwords = {name: pw.decode() for name, pw in (users or {}).items()}
            self._auth.configure_plain(domain=domain, passwords={**passwords, PLAIN_USER.decode(): secret.decode()})
            sock.plain_server = True
            sock.zap_domain = domain.encode()
        if isinstance(port, tuple):
            lo, hi = port
            try:
                sock.bind_to_random_port(f"tcp://{host}", min_port=lo, max_port=hi + 1, max_tries=4 * (hi - lo + 1))
            except zmq.ZMQBindError:
                sock.close(linger=0)
                raise E.UnavailableError(f"{self.name}: no free port in {lo}-{hi} (RLPLANE_ENGINE_PORT_MIN/MAX): widen "
                                         "the range", component=self.name) from None
        elif port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind_to_random_port(f"tcp://{host}")
        return sock

    def health(self) -> dict[str, Any]:
        """Whether the loop thread runs, and how many requests failed with a bug so far."""
        return {"alive": self._thread.is_alive() and not self._stop.is_set(), "failures": self.failures,
                "parked": len(self._parked)}

    def start(self) -> Server:
        gc.freeze()  # what the process holds by now (torch, Ray) is never scanned again by the collector
        self._thread.start()
        return self

    def _loop(self) -> None:
        poller = zmq.Poller()
        socks = [self._sock] + ([self._control] if self._control is not None else [])
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        wake = getattr(self.handler, "wake", None)
        tick = getattr(self.handler, "tick", None)  # housekeeping between requests (a unit trims its heap)
        flush = getattr(self.handler, "flush", None)  # work staged by a batch, done before its answers go out
        while not self._stop.is_set():
            try:
                wait_ms = 200
                if self._parked:
                    first = min(p[4] for p in self._parked)
                    wait_ms = max(0, min(wait_ms, int((first - time.monotonic()) * 1000) + 1))
                for sock, _ in poller.poll(wait_ms):
                    if flush is None:
                        frames = recv_frames(sock)
                        if len(frames) >= 2:  # else not even an identity and a header: nothing to answer
                            self._answer(sock, frames[0], frames[1:], time.monotonic(), final=False)
                    else:
                        self._batch(sock, flush)
                changed = wake() if wake is not None else False
                if tick is not None:
                    tick()
                if self._parked:
                    self._rerun(changed)
            except Exception:  # noqa: BLE001 - nothing one request does may stop the loop
                if self._stop.is_set():
                    return
                self.failures += 1
                log.exception("%s: the server loop caught an error and goes on", self.name)

    def _batch(self, sock: Any, flush: Callable[[], Mapping[int, E.RlplaneError]]) -> None:
        """Serve the requests waiting on ``sock`` (up to MAX_BATCH) one after the other, then
        ``flush()`` what they staged, then send their answers: a request whose staged work
        failed is answered with its error (see the module docstring)."""
        self.handler.open_batch()
        answers: list[tuple[Any, list[Any], list[Any] | None]] = []
        failed: Mapping[int, E.RlplaneError] = {}
        later: Callable[[], None] | None = None  # the last request's after-answer work: run once the answers are out
        try:
            for _ in range(MAX_BATCH):
                try:
                    frames = recv_frames(sock, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) < 2:
                    continue
                if later is not None:  # the request before runs its work first
                    later, run = None, later
                    self._then(run)
                self.handler.batch_slot = len(answers)
                reply, later = self._answer(sock, frames[0], frames[1:], time.monotonic(), final=False, send=False)
                answers.append((frames[0], frames[1:], reply))
        finally:
            try:
                failed = flush()
            except Exception:  # noqa: BLE001 - every request of the batch is answered, with the bug named
                self.failures += 1
                log.exception("%s: a batch's staged work failed", self.name)
                failed = {k: E.TransportError(f"{self.name} failed to finish this request") for k in range(len(answers))}
        for k, (ident, body, reply) in enumerate(answers):
            if reply is None:
                continue  # parked, or one-way
            if k in failed:
                reply = pack_message({"ok": False, "rid": _rid(body), "error": _payload(failed[k])})
            try:
                send_frames(sock, [ident, *reply])
            except zmq.ZMQError as err:
                log.warning("%s: could not answer a peer: %s", self.name, err)
        if later is not None:  # (a writer's commit is indexed here, off its clock)
            self._then(later)

    def _rerun(self, changed: Any) -> None:
        """Run parked requests again: those whose key is in ``changed`` (every one when it
        is True), and those whose deadline passed (their final run)."""
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for sock, ident, body, t0, deadline, key in parked:
            again = changed is True or (bool(changed) and (key is None or key in changed))
            if again or deadline <= now:
                self._answer(sock, ident, body, t0, final=deadline <= now)
            else:
                self._parked.append((sock, ident, body, t0, deadline, key))

    def _answer(self, sock: Any, ident: Any, body: list[Any], t0: float, *, final: bool,
                send: bool = True) -> Any:
        """Handle one request and send its answer (``send=False``: return the answer, for
        :meth:`_batch` to send, and what it left for after, for the caller to run)."""
        then: Callable[[], None] | None = None
        try:
            with gc_paused():
                reply, then = self._handle(body, t0, final, control=sock is self._control)
        except Park as park:
            if len(self._parked) < MAX_PARKED:
                now = time.monotonic()
                deadline = park.deadline if math.isfinite(park.deadline) else now
                self._parked.append((sock, ident, body, t0, min(max(deadline, now), now + MAX_PARK_S), park.key))
                return None if send else (None, None)
            if park.refused is not None:
                try:
                    park.refused()
                except Exception:  # noqa: BLE001 - a bug in one request must not stop the server
                    self.failures += 1
                    log.exception("%s: a request it could not park failed to let go", self.name)
            reply = pack_message({"ok": False, "rid": _rid(body), "error": _payload(E.UnavailableError(
                f"{self.name} has {MAX_PARKED} requests waiting already; retry later", component=self.name))})
        if not send:
            return reply, then
        try:
            if reply is not None:  # else a one-way message (``nr``): nobody waits for an answer
                send_frames(sock, [ident, *reply])
        except zmq.ZMQError as err:
            log.warning("%s: could not answer a peer: %s", self.name, err)
        finally:
            if then is not None:
                self._then(then)
        return None

    def _unsent(self, out: dict[str, Any], header: dict[str, Any]) -> None:
        """What an answer that could not be sent would have handed out (a locate's pin, a
        claim's lease) is taken back by the handler, if it says how."""
        unsent = getattr(self.handler, "unsent", None)
        if unsent is not None:
            try:
                unsent(out, header)
            except Exception:  # noqa: BLE001 - a bug in one request must not stop the server
                self.failures += 1
                log.exception("%s: could not take back an unsent answer", self.name)

    def _then(self, then: Callable[[], None]) -> None:
        """Run what a handler left for after its answer (it must run: it holds the handler's state)."""
        try:
            with gc_paused():
                then()
        except Exception:  # noqa: BLE001 - a bug in one request must not stop the server
            self.failures += 1
            log.exception("%s: the work after an answer failed", self.name)

    def _handle(self, frames: list[Any], t0: float = 0.0, final: bool = False, control: bool = False,
                ) -> tuple[list[Any] | None, Callable[[], None] | None]:
        """The answer to one request (None: one-way) and what to run once it is sent."""
        rid, one_way = None, False
        try:
            header = unpack_header(frames[0])
            rid = header.get("rid")  # first, so that even a bad body gets its answer
            if not isinstance(rid, (int, str, type(None))) or isinstance(rid, bool):
                rid = None
            one_way = header.get("nr") is True
            header, columns, extra = unpack_message(frames, header)
            header = {k: v for k, v in header.items() if not (isinstance(k, str) and k.startswith("_"))}
            header["_t0"], header["_final"] = t0, final
            header["_control"] = control
            header["_user"] = None if control else self._user_of(frames[0])
            op = header.get("op")
            fn: Callable[..., Reply] | None = getattr(self.handler, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
            if fn is None:
                raise E.WireFormatError(f"unknown operation {str(op)[:64]!r}")
            if op in self._control_ops and not control:
                raise E.ForbiddenError(f"{self.name}: operation {op!r} is for the controller only")
            out, cols, bufs, *then = fn(header, columns, extra)
        except Park:
            raise
        except E.RlplaneError as err:
            return (None if one_way else pack_message({"ok": False, "rid": rid, "error": _payload(err)})), None
        except Exception as err:  # noqa: BLE001 - a bug in one request must not stop the server
            self.failures += 1
            log.exception("%s: request failed", self.name)
            if one_way:
                return None, None
            return pack_message({"ok": False, "rid": rid,
                                 "error": {"error": "TransportError", "message": f"{self.name} failed: {type(err).__name__}: {err}"}}), None
        after = then[0] if then else None
        try:
            if one_way:
                return None, after
            took = {"took": time.monotonic() - t0} if t0 else {}  # (the client's view of where its time went)
            return pack_message({**out, "ok": True, "rid": rid, **took}, cols, bufs), after
        except E.WireFormatError as err:  # an answer over the header limit: the request asked for too much at once
            self._unsent(out, header)
            if after is not None:
                self._then(after)
            too_big = E.PayloadTooLargeError(f"{self.name}: the answer to {str(op)[:64]!r} is too big ({err})")
            return pack_message({"ok": False, "rid": rid, "error": _payload(too_big)}), None
        except Exception:
            self._unsent(out, header)
            if after is not None:  # it must still run (it holds the handler's state); the answer says what failed
                self._then(after)
            self.failures += 1
            log.exception("%s: could not pack an answer", self.name)
            return (None if one_way else pack_message({"ok": False, "rid": rid, "error": {
                "error": "TransportError", "message": f"{self.name} could not pack its answer"}})), None

    def _user_of(self, frame: Any) -> str | None:
        """The PLAIN user a message's connection authenticated as (None: no authentication)."""
        if self._auth is None:
            return None
        try:
            return frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            return None

    def stop(self, *, join: bool = True) -> None:
        """Stop serving and close the sockets; ``join=False`` only tells the loop to stop
        (it notices within its 200 ms poll), so that several servers stopping together
        wait for their loops once, not one after the other."""
        self._stop.set()
        if not join:
            return
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._control is not None:
            self._control.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _rid(body: list[Any]) -> Any:
    try:
        rid = unpack_header(body[0]).get("rid")
    except E.RlplaneError:
        return None
    return rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else None


def _payload(err: E.RlplaneError) -> dict[str, Any]:
    out = E.error_payload(err)
    for key in ("sample_ids", "known"):
        if key in out:
            out[key] = list(out[key])
    return out


__all__ = ["Server", "Reply", "Park"]
