"""Backend ``simple``: TransferQueue's own storage units (SimpleStorageUnit, ZMQ).

TransferQueue places a sample on unit ``global index % units``, so this backend can say
what each unit holds (per-unit samples and bytes on /metrics).

Example::

    store = SimpleStore.attach_or_create(ServiceSettings(backend="simple"))
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import ray

from rlplane.transports.tq import server_info_to_dict
from rlplane_service.actors import tq_unit_options
from rlplane_service.backends.tq import PING_TIMEOUT_S, TQStore
from rlplane_service.settings import ServiceSettings


class SimpleStore(TQStore):
    """A TransferQueue store on SimpleStorageUnits."""

    name: ClassVar[str] = "simple"

    @classmethod
    def _start_units(cls, settings: ServiceSettings, common: dict[str, Any]) -> tuple[Any, None, dict, dict]:
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        config = {"total_storage_size": settings.capacity, "num_data_storage_units": settings.storage_units,
                  "_run_id": uuid.uuid4().hex}
        prefix = settings.store_name
        units = {
            f"{prefix}-tq-unit-{i}": SimpleStorageUnit.options(name=f"{prefix}-tq-unit-{i}",
                                                               **tq_unit_options(settings, common)).remote(config=config)
            for i in range(settings.storage_units)
        }
        infos = {name: ray.get(h.get_zmq_server_info.remote(), timeout=PING_TIMEOUT_S) for name, h in units.items()}
        return None, None, units, {n: server_info_to_dict(i) for n, i in infos.items()}

    def _ping(self, unit: Any) -> Any:
        return unit.get_zmq_server_info.remote()

    def unit_of(self, global_index: int, unit_names: list[str]) -> str | None:
        """TransferQueue's rule: the unit at the sample's global index, modulo the units."""
        return unit_names[global_index % len(unit_names)] if unit_names else None


__all__ = ["SimpleStore"]
