"""The TransferQueue part the ``simple`` and ``mooncake`` backends share.

A TransferQueue controller, storage units and rlplane's consumption ledger (TransferQueue
keeps none), as named, detached Ray actors: the service creates them on first start and
re-attaches afterwards, so a Serve replica that dies and restarts finds every sample.
Actor names derive from ``settings.store_name`` in ``settings.namespace``;
``get_if_exists`` makes concurrent replicas agree on one store. All actors take
``num_cpus=0``: they wait on sockets, and the Ray logical CPUs stay free for the user's
workers. What differs, the storage units (and Mooncake's master), is each subclass's.

Example::

    store = SimpleStore.attach_or_create(ServiceSettings(backend="simple"))
    store.transport_info()   # what GET /v1/transport publishes under "tq"
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import ray

from rlplane.errors import MissingDataError, TransportError
from rlplane.transports.tq import NBYTES_TAG, server_info_to_dict
from rlplane_service.actors import actor_options, data_secret, head_options
from rlplane_service.backends.base import Sizes, StoreBackend
from rlplane_service.settings import ServiceSettings

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 60.0


@dataclass
class TQStore(StoreBackend):
    """Handles on a TransferQueue store's actors and the addresses clients reach them at."""

    publish_key: ClassVar[str] = "tq"
    controller: Any
    units: dict[str, Any]
    controller_info: dict[str, Any]
    unit_infos: dict[str, dict[str, Any]]
    capacity: int | None
    settings: ServiceSettings
    ledger: Any  # the op-counter actor /metrics reads (rlplane_service.metrics)
    stream_actor: Any  # the consumption ledger (rlplane_service.native.stream)
    streams_info: dict[str, Any]
    master: Any = None
    master_info: dict[str, Any] | None = None

    @classmethod
    def attach_or_create(cls, settings: ServiceSettings) -> TQStore:
        """Attach to the store named by ``settings`` or create it (needs a connected Ray)."""
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.sampler import SequentialSampler

        from rlplane_service.metrics import ledger_actor_class
        from rlplane_service.native.stream import stream_actor_class

        common = actor_options(settings)
        prefix = settings.store_name
        controller = TransferQueueController.options(name=f"{prefix}-tq-controller", **head_options(common)).remote(
            sampler=SequentialSampler, polling_mode=True
        )
        ledger = ledger_actor_class().options(name=f"{prefix}-metrics", **head_options(common)).remote()
        streams = stream_actor_class().options(name=f"{prefix}-streams", **head_options(common)).remote(
            settings.native_host or None, data_secret(settings), settings.claim_lease_s, settings.put_lease_s)
        try:  # the units start while those three do (each a process of its own, importing for seconds)
            master, master_info, units, unit_infos = cls._start_units(settings, common)
            streams_info = ray.get(streams.info.remote(), timeout=PING_TIMEOUT_S)
            controller_info = ray.get(controller.get_zmq_server_info.remote(), timeout=PING_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            raise TransportError(f"the store's actors did not start: {_cause(err)}") from err
        log.info("store %r (%s): controller %s, %d storage units", prefix, cls.name, controller_info, len(units))
        return cls(controller, units, server_info_to_dict(controller_info), unit_infos, settings.capacity, settings,
                   ledger, streams, streams_info, master, master_info)

    @classmethod
    @abstractmethod
    def _start_units(cls, settings: ServiceSettings, common: dict[str, Any]
                     ) -> tuple[Any, dict[str, Any] | None, dict[str, Any], dict[str, dict[str, Any]]]:
        """The storage units (and their master, if any): ``(master, master_info, units, unit_infos)``."""

    @abstractmethod
    def _ping(self, unit: Any) -> Any:
        """An ObjectRef that resolves once storage unit ``unit`` answers."""

    def transport_info(self) -> dict[str, Any]:
        """The ``tq`` entry of ``GET /v1/transport``: what TQTransport needs."""
        return {"backend": self.name, "controller": self.controller_info, "storage_units": self.unit_infos,
                "streams": self.streams_info}

    def service_transport(self) -> Any:
        """The transport the service itself uses to reach this store."""
        from rlplane.transports.tq import tq_transport

        return tq_transport(self.transport_info(), client_id="rlplane-service")

    def streams(self, timeout: float = 5.0) -> dict[str, Any]:
        return ray.get(self.stream_actor.streams.remote(), timeout=timeout)

    def watch_units(self, transport: Any) -> Any:
        """TransferQueue keeps a dead unit's samples listed: the service forgets them."""
        from rlplane_service.unitloss import UnitLossWatch

        return UnitLossWatch(self, transport).start()

    def unit_of(self, global_index: int, unit_names: list[str]) -> str | None:
        """The storage unit holding the sample at ``global_index``, where the backend knows."""
        return None

    # -- the store's books, through the service's transport (service-only operations) ----
    def placement(self, transport: Any, partition: str) -> list[tuple[int, int]]:
        """``(global index, stored bytes)`` of every sample in ``partition`` (empty when it holds none)."""
        _, meta = transport.listing(partition)
        if meta is None:
            return []
        return [(int(gi), sum(int(n) for n in ((tag or {}).get(NBYTES_TAG) or {}).values()))
                for gi, tag in zip(meta.global_indexes, meta.custom_meta)]

    def held_on(self, transport: Any, partition: str, unit: int) -> list[str]:
        """The samples of ``partition`` that storage unit number ``unit`` (in the order
        ``/v1/transport`` lists them) holds a value of."""
        ids, meta = transport.listing(partition)
        return self._held_by(transport, ids, meta, unit) if ids else []

    def forget(self, transport: Any, partition: str, ids: Sequence[str], unit: str) -> None:
        """Storage unit ``unit`` died with ``ids``: tell the ledger (first: a read that finds
        them gone can then say why), then drop them from TransferQueue's books (the dead
        unit is not asked), so listings, counts and claims stop showing them."""
        ids = list(ids)
        if transport.streams is not None:
            transport.streams.lose(unit, partition, ids)
        if ids:
            meta = transport.metadata(partition, ids)
            if meta.size:
                transport.run(self._drop_lost(transport, meta))

    def _held_by(self, transport: Any, ids: list[str], meta: Any, unit: int) -> list[str]:
        """Which of ``ids`` (their TransferQueue ``meta``) storage unit number ``unit`` holds:
        by default the units :meth:`unit_of` routes them to."""
        names = list(self.unit_infos) or ["?"]
        return [s for s, gi in zip(ids, meta.global_indexes) if self.unit_of(int(gi), names) == names[unit]]

    def _drop_lost(self, transport: Any, meta: Any) -> Any:
        """The coroutine that drops a dead unit's samples: the controller forgets them."""
        return transport.forget_meta(meta)

    def sizes(self, transport: Any, unit_names: list[str]) -> Sizes:
        """Per partition from the rows' placement (one listing of TransferQueue's metadata);
        per unit where :meth:`unit_of` can say."""
        partitions: dict[str, tuple[int, int]] = {}
        knows = bool(unit_names) and self.unit_of(0, unit_names) is not None
        units: dict[str, tuple[int, int] | None] = {u: (0, 0) if knows else None for u in unit_names}
        for name in transport.partitions():
            try:
                placed = self.placement(transport, name)
            except MissingDataError:  # cleared meanwhile
                continue
            partitions[name] = (len(placed), sum(b for _, b in placed))
            for gi, b in placed:
                unit = self.unit_of(gi, unit_names)
                if unit is not None:
                    n, total = units[unit] or (0, 0)
                    units[unit] = (n + 1, total + b)
        return partitions, units

    def dead_units(self, timeout: float = 2.0) -> list[str]:
        """The storage units Ray reports dead (their process is gone, with what it held).
        A unit that is only slow is not in it."""
        refs = {name: self._ping(unit) for name, unit in self.units.items()}
        dead = []
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout)
            except ray.exceptions.ActorDiedError:  # not ActorUnavailableError: that one may come back
                dead.append(name)
            except (ray.exceptions.RayError, TimeoutError):
                continue
        return dead

    def loss(self, timeout: float = 5.0) -> dict[str, Any]:  # type: ignore[override]
        """``lost_samples`` (since the store started) and ``lost_units``, as the ledger keeps them."""
        return ray.get(self.stream_actor.loss.remote(), timeout=timeout)

    def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """Per component: ``controller``, ``streams``, each unit by name."""
        out = {"controller": answers(self.controller.get_zmq_server_info.remote(), timeout),
               "streams": answers(self.stream_actor.info.remote(), timeout)}
        for name, unit in self.units.items():
            out[name] = answers(self._ping(unit), timeout)
        return out

    def destroy(self) -> None:
        """Kill the store's actors (every sample is lost)."""
        handles = [*self.units.values(), self.controller] + [
            h for h in (self.master, self.ledger, self.stream_actor) if h is not None]
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except (ray.exceptions.RayError, ValueError) as err:
                log.warning("could not kill a store actor: %s", err)


def answers(ref: Any, timeout: float) -> bool:
    try:
        ray.get(ref, timeout=timeout)
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


def _cause(err: BaseException) -> str:
    """The innermost message of a Ray actor error (e.g. the master's start failure)."""
    cause = getattr(err, "cause", None) or err.__cause__
    return str(cause) if cause is not None else str(err)


__all__ = ["PING_TIMEOUT_S", "TQStore", "answers"]
