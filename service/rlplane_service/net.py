"""Network helpers shared by the service's pieces (no imports of the rest of the service).

Example::

    port = free_port("127.0.0.1")
    rpc, meta, metrics = free_ports("127.0.0.1", 3)   # three different ports
"""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(host: str = "127.0.0.1", count: int = 1) -> list[int]:
    """``count`` different ports that are free on ``host`` right now.

    Each port's socket stays bound until all are chosen: asked one after the other, the
    kernel may hand out a port it just gave (it was free again once its socket closed),
    and two servers told the same port leave one of them dead at start.
    """
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    return free_ports(host, 1)[0]


__all__ = ["free_port", "free_ports"]
