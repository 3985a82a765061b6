"""TransferQueue's own storage (``SimpleStorage``) behind :class:`~rlplane.transports.tq.TQTransport`.

What differs from the shared part: the client talks to every storage unit's ZMQ ports;
a put given up on (a unit died, the
deadline passed) is undone by the controller alone, since asking the units to clear
could hang the same way.

Example::

    t = tq_transport(info)   # info["backend"] == "simple": a SimpleTQTransport
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from rlplane.column import Column
from rlplane.transports.tq import TQTransport


class SimpleTQTransport(TQTransport):
    """A TransferQueue store on its own storage units."""

    kind = "simple"

    @classmethod
    def storage(cls, info: Mapping[str, Any], server: Any) -> tuple[str, dict[str, Any], str]:
        units = {n: server(d) for n, d in info["storage_units"].items()}
        return "SimpleStorage", {"zmq_info": units}, str(info["controller"]["ip"])

    @classmethod
    def data_endpoints(cls, info: Mapping[str, Any]) -> list[tuple[str, int]]:
        return [(u["ip"], int(p)) for u in info["storage_units"].values() for p in u["ports"].values()]

    async def _undo_create(self, meta: Any, data: Any, columns: Mapping[str, Column], err: BaseException) -> None:
        if isinstance(err, asyncio.CancelledError):
            await self._forget_meta(meta)  # given up on: only the controller forgets the ids
        else:
            await self._clear_samples(meta)


__all__ = ["SimpleTQTransport"]
