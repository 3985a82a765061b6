"""Network helpers shared by the service's pieces (no imports of the rest of the service).

Example::

    port = free_port("127.0.0.1")
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["free_port"]
