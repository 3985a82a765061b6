"""The server loop of a native-engine component: a ZMQ ROUTER socket served by one thread.

Each request is ``[identity, header, frames...]`` (see :mod:`rlplane.wire`); the loop
parses it, calls the handler's ``op_<name>(header, columns, extra)`` and answers
``[identity, reply header, frames...]``. Whatever a handler raises becomes an error
reply: an rlplane error keeps its type; anything else (a bug) is logged and answered as
a TransportError. Malformed frames get a WireFormatError reply and the loop goes on.

A handler may *park* a request (a claim waiting for samples) by raising :class:`Park`
with a deadline: the loop keeps it, without a thread, and runs it again whenever the
handler's ``wake()`` says something changed, and once more, marked final
(``header["_final"]``), when its deadline passes. Headers carry ``_t0``, when the
request arrived; keys starting with ``_`` from the network are dropped. A request
whose header has ``nr: true`` is one-way: it is handled and never answered.

With a secret, the socket is a ZMQ PLAIN server and a ZAP handler admits only peers
that present it: unauthenticated peers cannot deliver a single message.

Example::

    server = Server(handler, host="127.0.0.1", secret=b"...")
    server.start()
    server.endpoint        # "tcp://127.0.0.1:43121"
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any, Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from rlplane import errors as E
from rlplane.channel import PLAIN_USER
from rlplane.gcpause import gc_paused
from rlplane.wire import pack_message, unpack_header, unpack_message

log = logging.getLogger(__name__)

#: A handler answers ``(reply header, columns, buffers)``.
Reply = tuple[dict[str, Any], dict[str, Any], list[Any]]
#: Largest frame a server accepts (bounds what one message can make it allocate).
MAX_FRAME_BYTES = 16 << 30


class Park(Exception):
    """Raised by a handler op: answer this request later (see the module docstring)."""

    def __init__(self, deadline: float) -> None:
        super().__init__(deadline)
        self.deadline = deadline


class Server:
    """Serves ``handler.op_<name>`` on a ROUTER socket from one thread (see the module docstring)."""

    def __init__(self, handler: Any, *, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 name: str = "server") -> None:
        self.handler, self.name = handler, name
        self._ctx = zmq.Context()
        self._auth = None
        if secret is not None:
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
            self._auth.configure_plain(domain="rlplane", passwords={PLAIN_USER.decode(): secret.decode()})
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.maxmsgsize = MAX_FRAME_BYTES
        self._sock.router_mandatory = False
        if secret is not None:
            self._sock.plain_server = True
            self._sock.zap_domain = b"rlplane"
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._parked: list[tuple[Any, list[Any], float, float]] = []  # (identity, frames, arrival, deadline)
        self._thread = threading.Thread(target=self._loop, name=f"rlplane-{name}", daemon=True)

    def start(self) -> Server:
        gc.freeze()  # what the process holds by now (torch, Ray) is never scanned again by the collector
        self._thread.start()
        return self

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        wake = getattr(self.handler, "wake", None)
        while not self._stop.is_set():
            wait_ms = 200
            if self._parked:
                first = min(p[3] for p in self._parked)
                wait_ms = max(0, min(wait_ms, int((first - time.monotonic()) * 1000) + 1))
            if poller.poll(wait_ms):
                frames = self._sock.recv_multipart(copy=False)
                if len(frames) >= 2:  # else not even an identity and a header: nothing to answer
                    self._answer(frames[0], frames[1:], time.monotonic(), final=False)
            changed = bool(wake()) if wake is not None else False
            if self._parked:
                self._rerun(changed)

    def _rerun(self, changed: bool) -> None:
        """Run parked requests again: all when the handler says something changed, else
        only those whose deadline passed (their final run)."""
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for ident, body, t0, deadline in parked:
            if changed or deadline <= now:
                self._answer(ident, body, t0, final=deadline <= now)
            else:
                self._parked.append((ident, body, t0, deadline))

    def _answer(self, ident: Any, body: list[Any], t0: float, *, final: bool) -> None:
        try:
            with gc_paused():
                reply = self._handle(body, t0, final)
        except Park as park:
            self._parked.append((ident, body, t0, park.deadline))
            return
        if reply is None:  # a one-way message (``nr``): nobody waits for an answer
            return
        try:
            self._sock.send_multipart([ident, *reply], copy=False)
        except zmq.ZMQError as err:
            log.warning("%s: could not answer a peer: %s", self.name, err)

    def _handle(self, frames: list[Any], t0: float = 0.0, final: bool = False) -> list[Any] | None:
        rid, one_way = None, False
        try:
            header = unpack_header(frames[0])
            rid = header.get("rid")  # first, so that even a bad body gets its answer
            one_way = header.get("nr") is True
            header, columns, extra = unpack_message(frames, header)
            header = {k: v for k, v in header.items() if not (isinstance(k, str) and k.startswith("_"))}
            header["_t0"], header["_final"] = t0, final
            op = header.get("op")
            fn: Callable[..., Reply] | None = getattr(self.handler, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
            if fn is None:
                raise E.WireFormatError(f"unknown operation {op!r}")
            out, cols, bufs = fn(header, columns, extra)
            return None if one_way else pack_message({**out, "ok": True, "rid": rid}, cols, bufs)
        except Park:
            raise
        except E.RlplaneError as err:
            return None if one_way else pack_message({"ok": False, "rid": rid, "error": _payload(err)})
        except Exception as err:  # noqa: BLE001 - a bug in one request must not stop the server
            log.exception("%s: request failed", self.name)
            if one_way:
                return None
            return pack_message({"ok": False, "rid": rid,
                                 "error": {"error": "TransportError", "message": f"{self.name} failed: {type(err).__name__}: {err}"}})

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _payload(err: E.RlplaneError) -> dict[str, Any]:
    out = E.error_payload(err)
    for key in ("sample_ids", "known"):
        if key in out:
            out[key] = list(out[key])
    return out


__all__ = ["Server", "Reply", "Park"]
