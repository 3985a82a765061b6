"""The store: a TransferQueue controller and storage units as named, detached Ray actors.

The service creates them on first start and re-attaches to them afterwards, so a Serve
replica that dies and restarts finds every sample it held. Actor names derive from
``settings.store_name`` in ``settings.namespace``; ``get_if_exists`` makes concurrent
replicas agree on one store. All actors take ``num_cpus=0``: they wait on sockets, and
the Ray logical CPUs stay free for the user's workers.

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

from rlplane.errors import TransportError
from rlplane.transports.tq import server_info_to_dict
from rlplane_service.settings import ServiceSettings

log = logging.getLogger(__name__)

_PING_TIMEOUT_S = 60.0


@dataclass
class Store:
    """Handles on the store's actors and the addresses clients reach them at."""

    controller: Any
    units: dict[str, Any]
    controller_info: dict[str, Any]
    unit_infos: dict[str, dict[str, Any]]
    capacity: int | None

    @classmethod
    def attach_or_create(cls, settings: ServiceSettings) -> Store:
        """Attach to the store named by ``settings`` or create it (needs a connected Ray)."""
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.sampler import SequentialSampler
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        env = {"env_vars": {"TQ_NUM_THREADS": str(settings.tq_num_threads)}}
        common = {
            "namespace": settings.namespace,
            "lifetime": "detached",
            "get_if_exists": True,
            "num_cpus": 0,
            "runtime_env": env,
        }
        prefix = settings.store_name
        controller = TransferQueueController.options(name=f"{prefix}-tq-controller", **common).remote(
            sampler=SequentialSampler, polling_mode=True
        )
        unit_config = {
            "total_storage_size": settings.capacity,
            "num_data_storage_units": settings.storage_units,
            "_run_id": uuid.uuid4().hex,
        }
        # Pinning: with a storage resource each unit takes one, so a node offering N of it hosts at most N units.
        unit_opts = dict(common, resources={settings.storage_resource: 1}) if settings.storage_resource else common
        units = {
            f"{prefix}-tq-unit-{i}": SimpleStorageUnit.options(name=f"{prefix}-tq-unit-{i}", **unit_opts).remote(
                config=unit_config
            )
            for i in range(settings.storage_units)
        }
        try:
            controller_info = ray.get(controller.get_zmq_server_info.remote(), timeout=_PING_TIMEOUT_S)
            unit_infos = {
                name: ray.get(h.get_zmq_server_info.remote(), timeout=_PING_TIMEOUT_S) for name, h in units.items()
            }
        except (ray.exceptions.RayError, TimeoutError) as err:
            raise TransportError(f"the store's actors did not start: {err}") from err
        log.info("store %r: controller %s, %d storage units", prefix, controller_info, len(units))
        return cls(
            controller,
            units,
            server_info_to_dict(controller_info),
            {n: server_info_to_dict(i) for n, i in unit_infos.items()},
            settings.capacity,
        )

    def transport_info(self) -> dict[str, Any]:
        """The ``tq`` entry of ``GET /v1/transport``: what TQTransport needs."""
        return {"backend": "simple", "controller": self.controller_info, "storage_units": self.unit_infos}

    def alive(self, timeout: float = 2.0) -> bool:
        """Whether every actor answers within ``timeout`` seconds."""
        refs = [self.controller.get_zmq_server_info.remote()] + [u.get_zmq_server_info.remote() for u in self.units.values()]
        try:
            ray.get(refs, timeout=timeout)
            return True
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def destroy(self) -> None:
        """Kill the store's actors (every sample is lost). Only for the process that owns the store."""
        for handle in [*self.units.values(), self.controller]:
            try:
                ray.kill(handle, no_restart=True)
            except (ray.exceptions.RayError, ValueError) as err:
                log.warning("could not kill a store actor: %s", err)
