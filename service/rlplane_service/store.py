"""The store: a TransferQueue controller and storage units as named, detached Ray actors.

The service creates them on first start and re-attaches to them afterwards, so a Serve
replica that dies and restarts finds every sample it held. Actor names derive from
``settings.store_name`` in ``settings.namespace``; ``get_if_exists`` makes concurrent
replicas agree on one store. All actors take ``num_cpus=0``: they wait on sockets, and
the Ray logical CPUs stay free for the user's workers.

With ``backend="mooncake"`` the sample bytes live in Mooncake segments instead, and the
store also owns a ``mooncake_master`` (see :mod:`rlplane_service.mooncake`).

Example::

    store = Store.attach_or_create(ServiceSettings())
    store.transport_info()   # what GET /v1/transport publishes
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlplane.errors import TransportError
from rlplane.transports.tq import server_info_to_dict
from rlplane_service.actors import actor_options, data_secret, unit_options
from rlplane_service.settings import ServiceSettings
from rlplane_service.tenants import Access

log = logging.getLogger(__name__)

_PING_TIMEOUT_S = 60.0


@dataclass
class Store:
    """Handles on the store's actors and the addresses clients reach them at.

    ``backend`` "simple": ``units`` are TransferQueue SimpleStorageUnits (ZMQ).
    ``backend`` "mooncake": ``units`` mount Mooncake segments and ``master`` owns the
    ``mooncake_master`` process (see :mod:`rlplane_service.mooncake`).
    """

    backend: str
    controller: Any
    units: dict[str, Any]
    controller_info: dict[str, Any]
    unit_infos: dict[str, dict[str, Any]]
    capacity: int | None
    master: Any = None
    master_info: dict[str, Any] | None = None
    settings: ServiceSettings | None = None
    ledger: Any = None  # the op-counter actor /metrics reads (rlplane_service.metrics)
    publish_key: str = "tq"  # /v1/transport publishes transport_info() under this key
    stream_actor: Any = None  # the consumption ledger (rlplane_service.native.stream): TransferQueue keeps none
    streams_info: dict[str, Any] | None = None

    @classmethod
    def attach_or_create(cls, settings: ServiceSettings) -> Store:
        """Attach to the store named by ``settings`` or create it (needs a connected Ray)."""
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.sampler import SequentialSampler

        from rlplane_service.metrics import ledger_actor_class

        common = actor_options(settings)
        prefix = settings.store_name
        controller = TransferQueueController.options(name=f"{prefix}-tq-controller", **common).remote(
            sampler=SequentialSampler, polling_mode=True
        )
        from rlplane_service.native.stream import stream_actor_class

        ledger = ledger_actor_class().options(name=f"{prefix}-metrics", **common).remote()
        streams = stream_actor_class().options(name=f"{prefix}-streams", **common).remote(
            settings.native_host or None, data_secret(settings), settings.claim_lease_s, settings.put_lease_s)
        master = master_info = None
        try:
            streams_info = ray.get(streams.info.remote(), timeout=_PING_TIMEOUT_S)
            controller_info = ray.get(controller.get_zmq_server_info.remote(), timeout=_PING_TIMEOUT_S)
            if settings.backend == "mooncake":
                master, master_info, units, unit_infos = _mooncake_units(settings, common)
            else:
                units, unit_infos = _simple_units(settings, common)
        except (ray.exceptions.RayError, TimeoutError) as err:
            raise TransportError(f"the store's actors did not start: {_cause(err)}") from err
        log.info("store %r (%s): controller %s, %d storage units", prefix, settings.backend, controller_info, len(units))
        return cls(
            settings.backend,
            controller,
            units,
            server_info_to_dict(controller_info),
            unit_infos,
            settings.capacity,
            master,
            master_info,
            settings,
            ledger,
            stream_actor=streams,
            streams_info=streams_info,
        )

    def transport_for(self, access: Access) -> dict[str, Any] | None:
        """What ``GET /v1/transport`` publishes to ``access``: a tenant's token gets no direct
        path (TransferQueue's units authenticate nobody), so its bytes go over HTTP."""
        return self.transport_info() if access.full else None

    def transport_info(self) -> dict[str, Any]:
        """The ``tq`` entry of ``GET /v1/transport``: what TQTransport needs."""
        info: dict[str, Any] = {"backend": self.backend, "controller": self.controller_info, "storage_units": self.unit_infos,
                                "streams": self.streams_info}
        if self.backend == "mooncake":
            s = self.settings or ServiceSettings()
            info["mooncake"] = {
                "master_address": self.master_info["master_address"],
                "metadata_server": self.master_info["metadata_server"],
                "protocol": s.mooncake_protocol,
                "device_name": s.mooncake_device_name,
                "buffer_bytes": s.mooncake_buffer_bytes,
            }
        return info

    @staticmethod
    def stop_processes(settings: ServiceSettings) -> None:
        """Stop the processes the store runs outside Ray (Mooncake's master, by its pid);
        the embedded service calls this before Ray goes down."""
        if settings.backend == "mooncake":
            from rlplane_service.mooncake import stop_master

            stop_master(settings)

    def service_transport(self) -> Any:
        """The transport the service itself uses to reach this store."""
        from rlplane.transports.tq import TQTransport

        return TQTransport(self.transport_info(), client_id="rlplane-service")

    def streams(self, timeout: float = 5.0) -> dict[str, Any]:
        """Every (partition, task)'s consumption and the claim-wait histogram (for /metrics)."""
        return ray.get(self.stream_actor.streams.remote(), timeout=timeout)

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

    def loss(self, timeout: float = 5.0) -> dict[str, Any]:
        """``lost_samples`` (since the store started) and ``lost_units``, as the ledger keeps them."""
        return ray.get(self.stream_actor.loss.remote(), timeout=timeout)

    def _ping(self, unit: Any) -> Any:
        """An ObjectRef that resolves once storage unit ``unit`` answers."""
        return (unit.info if self.backend == "mooncake" else unit.get_zmq_server_info).remote()

    def alive(self, timeout: float = 2.0) -> bool:
        """Whether every actor answers within ``timeout`` seconds (and the master is healthy)."""
        return all(self.health(timeout).values())

    def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """Per component: ``controller``, each unit by name, and ``mooncake_master`` when present."""
        out = {"controller": _answers(self.controller.get_zmq_server_info.remote(), timeout)}
        if self.stream_actor is not None:
            out["streams"] = _answers(self.stream_actor.info.remote(), timeout)
        for name, unit in self.units.items():
            out[name] = _answers(self._ping(unit), timeout)
        if self.master is not None:
            try:
                out["mooncake_master"] = bool(ray.get(self.master.healthy.remote(), timeout=timeout))
            except (ray.exceptions.RayError, TimeoutError):
                out["mooncake_master"] = False
        return out

    def destroy(self) -> None:
        """Stop the store (every sample is lost): unmount the segments, stop the Mooncake
        master by its pid, kill the actors. Only for the process that owns the store."""
        if self.backend == "mooncake":
            stops = [u.stop.remote() for u in self.units.values()]
            if self.master is not None:
                stops.append(self.master.stop.remote())
            try:
                ray.get(stops, timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as err:
                log.warning("could not stop the Mooncake side cleanly: %s", err)
        handles = [*self.units.values(), self.controller] + [
            h for h in (self.master, self.ledger, self.stream_actor) if h is not None]
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except (ray.exceptions.RayError, ValueError) as err:
                log.warning("could not kill a store actor: %s", err)


def _simple_units(settings: ServiceSettings, common: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    config = {
        "total_storage_size": settings.capacity,
        "num_data_storage_units": settings.storage_units,
        "_run_id": uuid.uuid4().hex,
    }
    prefix = settings.store_name
    units = {
        f"{prefix}-tq-unit-{i}": SimpleStorageUnit.options(name=f"{prefix}-tq-unit-{i}", **unit_options(settings, common)).remote(config=config)
        for i in range(settings.storage_units)
    }
    infos = {name: ray.get(h.get_zmq_server_info.remote(), timeout=_PING_TIMEOUT_S) for name, h in units.items()}
    return units, {n: server_info_to_dict(i) for n, i in infos.items()}


def _mooncake_units(settings: ServiceSettings, common: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    from rlplane_service.mooncake import ray_actors

    MasterActor, UnitActor = ray_actors()
    prefix = settings.store_name
    args = settings.as_args()
    # Next to the process creating the store (the Serve replica: the Ray head in the Helm
    # chart), so the master's metrics port is where the chart's PodMonitor looks.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    master = MasterActor.options(name=f"{prefix}-mooncake-master", scheduling_strategy=here, **common).remote(args)
    master_info = ray.get(master.info.remote(), timeout=_PING_TIMEOUT_S)
    units = {
        f"{prefix}-mooncake-unit-{i}": UnitActor.options(
            name=f"{prefix}-mooncake-unit-{i}", **unit_options(settings, common)
        ).remote(args, master_info)
        for i in range(settings.storage_units)
    }
    infos = {name: ray.get(h.info.remote(), timeout=_PING_TIMEOUT_S) for name, h in units.items()}
    for info in infos.values():
        info["segment_bytes"] = settings.mooncake_segment_bytes
    return master, master_info, units, infos


def _answers(ref: Any, timeout: float) -> bool:
    try:
        ray.get(ref, timeout=timeout)
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


def _cause(err: BaseException) -> str:
    """The innermost message of a Ray actor error (e.g. the master's start failure)."""
    cause = getattr(err, "cause", None) or err.__cause__
    return str(cause) if cause is not None else str(err)
