"""How a client reaches the store's consumption ledger (claim, ack, nack, consumption).

:class:`DirectStreams` talks to the ledger's server over the rlplane wire (the native
controller, or the ledger actor beside a TransferQueue-based store), with the address
and data secret ``GET /v1/transport`` publishes under ``streams``. The HTTP transport
has its own (:class:`rlplane.transports.http.HttpStreams`) with the same methods.

A claim request carries how long the server may park it (``wait_s``, at most
:data:`rlplane.claims.MAX_WAIT_S`); the client's deadline for the reply is that plus
the transport timeout. Longer waits are several requests (see ``Client.claim``).

Example::

    streams = DirectStreams(info["streams"], timeout=60)
    reply = streams.claim(ClaimRequest("step-0", "train", 64, ("input_ids",), 5.0, 64))
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rlplane.channel import PLAIN_USER, SharedChannels, acall, ride
from rlplane.errors import TransportError
from rlplane.claims import MAX_WAIT_S, ClaimRequest


class DirectStreams:
    """The ledger over the rlplane wire (see the module docstring)."""

    def __init__(self, info: Mapping[str, Any], *, timeout: float = 60.0, name: str = "ledger") -> None:
        try:
            self.endpoint = str(info["endpoint"])
            secret = info.get("secret")
            self.user = str(info.get("user") or PLAIN_USER.decode()).encode()  # a tenant's engine user
        except (KeyError, TypeError) as err:
            raise TransportError(f"the service's streams address is malformed ({err})") from None
        self.secret = secret.encode() if secret else None
        self.timeout, self.name = timeout, name
        self.hold_lease_s = 60.0  # the ledger's put_lease_s, as its last reserve or hold said
        self._pool = SharedChannels(self.secret, self.user)

    def _call(self, header: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """The answer to ``header``, riding through a restart of the ledger's process."""
        return ride(lambda: self._pool.get(self.endpoint, self.name), header, timeout=timeout or self.timeout)[0]

    def claim(self, req: ClaimRequest) -> dict[str, Any]:
        """The ledger's answer: ``lease``, ``lease_s``, ``ids``, ``tags``, ``fields``."""
        return self._call({"op": "claim", **req.to_header()}, req.wait_s + self.timeout)

    def ack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None) -> int:
        return int(self._call({"op": "ack", "p": partition, "task": task, "lease": lease, "ids": _ids(ids)})["acked"])

    def nack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None) -> int:
        return int(self._call({"op": "nack", "p": partition, "task": task, "lease": lease, "ids": _ids(ids)})["nacked"])

    def consumption(self, partition: str, task: str) -> dict[str, int]:
        out = self._call({"op": "consumption", "p": partition, "task": task})
        return {k: v for k, v in out.items() if k not in ("ok", "rid", "v", "c", "nbuf")}

    def snapshot(self) -> dict[str, Any]:
        """Every (partition, task)'s consumption and the claim-wait histogram."""
        return self._call({"op": "streams"})

    def reserve(self, partition: str, ids: Sequence[str]) -> int:
        """Take new ids before writing them (TransferQueue-based stores): DuplicateSampleError
        when any is stored or being written by another put. Returns the reservation."""
        return self._held(self._call({"op": "reserve", "p": partition, "ids": [str(s) for s in ids]},
                                     MAX_WAIT_S + self.timeout))  # (it may wait for a clear of the partition)

    def hold(self, partition: str, ids: Sequence[str] | None, kind: str) -> str:
        """Hold stored samples (``ids``; None: the whole partition) for a ``write`` or a
        ``clear`` (TransferQueue-based stores): answered once no put, write or clear of any
        of them is under way (UnavailableError after MAX_WAIT_S). Ended by ``record``
        (a write), ``drop`` (a clear) or ``abort``. Returns the hold."""
        return self._held(self._call({"op": "hold", "p": partition, "ids": _ids(ids), "kind": kind},
                                     MAX_WAIT_S + self.timeout))

    def _held(self, answer: dict[str, Any]) -> str:
        lease = answer.get("lease_s")
        if isinstance(lease, (int, float)) and lease > 0:
            self.hold_lease_s = float(lease)  # (how often a holder renews: rlplane.transports.tq)
        return str(answer["res"])

    def renew(self, hold: str) -> bool:
        """Keep a reservation or hold alive (its writer still works on it): whether it was
        (False: it lapsed before, and another writer may have the samples now)."""
        return bool(self._call({"op": "renew", "res": hold})["renewed"])

    def abort(self, reservation: str) -> None:
        """Give up a reservation (the write failed)."""
        self._call({"op": "abort", "res": reservation})

    def record(self, partition: str, ids: Sequence[str], fields: Sequence[str], tags: Sequence[Mapping[str, Any]], *,
               create: bool, reservation: str | None = None) -> None:
        """Tell a ledger that keeps its own index what a put stored (TransferQueue-based
        stores); it ends the put's ``reservation``."""
        self._call({"op": "record", "p": partition, "ids": list(ids), "fields": list(fields),
                    "tags": [dict(t) for t in tags], "create": create, "res": reservation})

    def drop(self, partition: str, ids: Sequence[str] | None, hold: str | None = None) -> None:
        """Tell such a ledger what a clear removed; it ends the clear's ``hold``."""
        self._call({"op": "drop", "p": partition, "ids": _ids(ids), "res": hold})

    def lose(self, unit: str, partition: str = "", ids: Sequence[str] = ()) -> None:
        """Tell such a ledger that storage ``unit`` died, taking ``partition``'s ``ids`` with it."""
        self._call({"op": "lose", "unit": unit, "p": partition, "ids": [str(s) for s in ids]})

    def lost(self, partition: str, ids: Sequence[str]) -> dict[str, str]:
        """Which of ``ids`` were lost with a dead storage unit: ``{sample id: unit}``."""
        return dict(self._call({"op": "lost", "p": partition, "ids": [str(s) for s in ids]})["lost"])

    def loss(self) -> dict[str, Any]:
        """``lost_units`` (storage units declared dead) and ``lost_samples`` (since the store started)."""
        out = self._call({"op": "loss"})
        return {"lost_units": list(out.get("lost_units", [])), "lost_samples": int(out.get("lost_samples", 0))}

    async def acall(self, header: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        """Any op from asyncio code (the service's HTTP endpoints), holding no thread while it waits."""
        return await acall(self.endpoint, self.name, header, secret=self.secret, timeout=wait_s + self.timeout,
                           user=self.user)

    def close(self) -> None:
        self._pool.close()


def _ids(ids: Sequence[str] | None) -> list[str] | None:
    return None if ids is None else [str(s) for s in ids]


__all__ = ["DirectStreams"]
