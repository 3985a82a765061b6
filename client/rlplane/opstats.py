"""OpStats: what a client did — per operation counts, errors, bytes and wall time.

Every :class:`~rlplane.Client` keeps one. ``summary()`` is for the trainer's own logger;
``drain()`` hands the not-yet-reported events to the service (``POST /v1/metrics/report``)
so that ``/metrics`` also counts the operations that went straight to the store over the
``tq`` transport, which the service never sees.

Each op also says where its time went (``OpEvent.parts``, and ``parts_p50_s`` in the
summary): ``wait``, the time its thread spent blocked on the store's answers (the native
engine's round trips and the service's HTTP answers: :func:`add_wait`, called by
:mod:`rlplane.channel` and :mod:`rlplane.http_api`; TransferQueue's client counts none,
so there its waits are ``client``); ``codec``, its
own work encoding or decoding the fields (row digests and shared-row matching included,
waits inside excluded); ``client``, the rest of its wall time in the client (copies into
and out of the store's memory, checks, messages). The three add up to the op's time.
Where the native engine's answers say how long its servers took over them
(:func:`add_engine`), ``engine`` is that share of ``wait`` (the rest of the wait is the way
there and back: sockets, the network, threads waking up).

Example::

    stats = OpStats()
    with stats.timed("read_columns") as op:
        op.nbytes = 1024
        with op.part("codec"):
            ...                                     # decode
    stats.summary()["read_columns"]["count"]    # 1
    stats.last("read_columns").parts            # {"wait": 0.0, "codec": ..., "client": ...}
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

#: The operations a client reports (the ``op`` label of rlplane's metrics).
OPS = ("put_samples", "write_columns", "extend", "read_columns", "clear", "delete_partition", "claim", "ack", "nack",
       "snapshot")

_WINDOW = 1024  # recent durations kept per op for the percentiles
_PENDING_LIMIT = 10_000  # events kept for the service when it cannot be reached
#: Where an op's time goes (see the module docstring), in the order a report lists them;
#: and the share of ``wait`` the engine's servers said they took, where they said it.
PARTS, ENGINE = ("wait", "codec", "client"), "engine"

_waits = threading.local()


def add_wait(seconds: float) -> None:
    """Count ``seconds`` this thread spent blocked on a store's answer (the channel calls it)."""
    _waits.total = getattr(_waits, "total", 0.0) + seconds


def add_engine(seconds: float) -> None:
    """Count ``seconds`` an engine server said it took over a request this thread made."""
    _waits.engine = getattr(_waits, "engine", 0.0) + seconds
    _waits.answers = getattr(_waits, "answers", 0) + 1


def failure(op: str, err: BaseException) -> str | None:
    """The error ``op`` ending in ``err`` counts as: its class's name, or None for a claim
    that found nothing ready in time (an answer a polling consumer gets all day, not a
    failure: counted as one, it fired the error-ratio alert on healthy pipelines).

    Example: ``failure("claim", NotReadyError("0 of 8 ready")) is None``."""
    from rlplane.errors import NotReadyError

    return None if op == "claim" and isinstance(err, NotReadyError) else type(err).__name__


def _waited() -> float:
    return getattr(_waits, "total", 0.0)


def _engine() -> tuple[float, int]:
    return getattr(_waits, "engine", 0.0), getattr(_waits, "answers", 0)


@dataclass
class OpEvent:
    """One finished operation (JSON-able via :meth:`to_dict`)."""

    op: str
    transport: str
    seconds: float
    nbytes: int = 0
    error: str | None = None
    #: Seconds per part of the op (:data:`PARTS`), once it has finished.
    parts: dict[str, float] = field(default_factory=dict)
    #: Made through the service, which counted it for ``/metrics`` itself (not reported again).
    by_service: bool = False

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the block's wall time, less what its thread waited on the store in it, as
        part ``name`` of the op (``codec``)."""
        start, waited = time.perf_counter(), _waited()
        try:
            yield
        finally:
            own = time.perf_counter() - start - (_waited() - waited)
            self.parts[name] = self.parts.get(name, 0.0) + max(own, 0.0)

    @property
    def direction(self) -> str:
        return "out" if self.op == "read_columns" else "in"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "transport": self.transport, "seconds": self.seconds, "nbytes": self.nbytes, "error": self.error}


class OpStats:
    """Thread-safe per-op counters of one client (see the module docstring)."""

    def __init__(self, transport: str = "memory") -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._count: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._wall: dict[str, float] = {}
        self._recent: dict[str, list[float]] = {}
        self._recent_parts: dict[str, list[dict[str, float]]] = {}
        self._last: dict[str, OpEvent] = {}
        self._pending: list[OpEvent] = []

    @contextmanager
    def timed(self, op: str) -> Iterator[OpEvent]:
        """Time the block as one ``op``; set ``.nbytes`` on the yielded event. An exception
        is recorded as an error of its class (see :func:`failure`) and re-raised."""
        event = OpEvent(op, self.transport, 0.0)
        start, waited, (engine, answers) = time.perf_counter(), _waited(), _engine()
        try:
            yield event
        except BaseException as err:
            event.error = failure(op, err)
            raise
        finally:
            event.seconds = time.perf_counter() - start
            wait, codec = _waited() - waited, event.parts.get("codec", 0.0)
            event.parts = {"wait": wait, "codec": codec, "client": max(event.seconds - wait - codec, 0.0)}
            took, told = _engine()
            if told > answers:  # (requests in flight at once each took their time: at most the wait)
                event.parts[ENGINE] = min(took - engine, wait)
            self.record(event)

    def record(self, event: OpEvent) -> None:
        with self._lock:
            op = event.op
            self._count[op] = self._count.get(op, 0) + 1
            self._wall[op] = self._wall.get(op, 0.0) + event.seconds
            if event.error:
                self._errors[op] = self._errors.get(op, 0) + 1
            else:
                self._bytes[op] = self._bytes.get(op, 0) + event.nbytes
            recent = self._recent.setdefault(op, [])
            recent.append(event.seconds)
            del recent[:-_WINDOW]
            parts = self._recent_parts.setdefault(op, [])
            parts.append(event.parts)
            del parts[:-_WINDOW]
            self._last[op] = event
            self._pending.append(event)
            del self._pending[:-_PENDING_LIMIT]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per op: ``count``, ``errors``, ``bytes`` (of the successful ones), ``wall_s``
        (total), ``p50_s`` / ``p90_s`` over the last 1024 calls, and ``parts_p50_s``: the
        median of each part of their time (:data:`PARTS`)."""
        with self._lock:
            out = {}
            for op, n in self._count.items():
                recent = sorted(self._recent[op])
                parts = self._recent_parts[op]
                out[op] = {
                    "count": n,
                    "errors": self._errors.get(op, 0),
                    "bytes": self._bytes.get(op, 0),
                    "wall_s": round(self._wall[op], 6),
                    "p50_s": round(_quantile(recent, 0.5), 6),
                    "p90_s": round(_quantile(recent, 0.9), 6),
                    "parts_p50_s": {k: round(statistics.median(p[k] for p in parts), 6) for k in _common(parts)},
                }
            return out

    def last(self, op: str) -> OpEvent | None:
        """The last finished ``op`` of this client (None before the first)."""
        with self._lock:
            return self._last.get(op)

    def drain(self) -> list[OpEvent]:
        """The events not handed out before (oldest first), now marked as handed out."""
        with self._lock:
            out, self._pending = self._pending, []
            return out

    def requeue(self, events: list[OpEvent]) -> None:
        """Put back events whose report failed (they go out with the next one)."""
        with self._lock:
            self._pending[:0] = events
            del self._pending[:-_PENDING_LIMIT]


def _common(parts: list[dict[str, float]]) -> list[str]:
    """The parts every one of ``parts`` has (``engine`` only where every answer said it)."""
    return [k for k in (*PARTS, ENGINE) if all(k in p for p in parts)]


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q * 100) - 1]


__all__ = ["OPS", "PARTS", "ENGINE", "OpEvent", "OpStats", "add_wait", "add_engine"]
