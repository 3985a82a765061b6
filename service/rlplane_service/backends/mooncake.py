"""Backend ``mooncake``: TransferQueue's controller with the bytes in Mooncake segments.

The store's unit actors mount the segments; the store owns a ``mooncake_master`` process
(by pid, see :mod:`rlplane_service.mooncake`). Mooncake places values itself, so this
backend cannot say which unit holds a sample: /metrics reports the pool's allocated and
total bytes from the master instead.

Example::

    store = MooncakeStore.attach_or_create(ServiceSettings(backend="mooncake"))
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlplane.tags import WIRE_TAG
from rlplane_service.actors import unit_options
from rlplane_service.backends.tq import PING_TIMEOUT_S, TQStore
from rlplane_service.settings import ServiceSettings

log = logging.getLogger(__name__)


class MooncakeStore(TQStore):
    """A TransferQueue store whose units mount Mooncake segments."""

    name: ClassVar[str] = "mooncake"

    def _held_by(self, transport: Any, ids: list[str], meta: Any, unit: int) -> list[str]:
        """A unit holds a sample when the pool's replica descriptors of any of its values
        name the unit's segment endpoint (a value the pool no longer knows counts as held
        there: ask only about a unit that died)."""
        names = list(self.unit_infos) or ["?"]
        endpoint = self.unit_infos[names[unit]].get("endpoint")
        keys = {s: [f"{gi}@{f}" for f in ((tag or {}).get(WIRE_TAG) or {})]
                for s, gi, tag in zip(ids, meta.global_indexes, meta.custom_meta)}
        where = transport.replica_endpoints([k for ks in keys.values() for k in ks])
        return [s for s, ks in keys.items() if any(where.get(k, {endpoint}) == {endpoint} for k in ks)]

    def _drop_lost(self, transport: Any, meta: Any) -> Any:
        return transport.clear_samples(meta)  # the master also drops their values on live segments

    @classmethod
    def _start_units(cls, settings: ServiceSettings, common: dict[str, Any]) -> tuple[Any, dict, dict, dict]:
        from rlplane_service.mooncake import ray_actors

        MasterActor, UnitActor = ray_actors()
        prefix = settings.store_name
        args = settings.as_args()
        # Next to the process creating the store (the Serve replica: the Ray head in the Helm
        # chart), so the master's metrics port is where the chart's PodMonitor looks.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
        master = MasterActor.options(name=f"{prefix}-mooncake-master", scheduling_strategy=here, **common).remote(args)
        master_info = ray.get(master.info.remote(), timeout=PING_TIMEOUT_S)
        units = {
            f"{prefix}-mooncake-unit-{i}": UnitActor.options(
                name=f"{prefix}-mooncake-unit-{i}", **unit_options(settings, common)
            ).remote(args, master_info)
            for i in range(settings.storage_units)
        }
        infos = {name: ray.get(h.info.remote(), timeout=PING_TIMEOUT_S) for name, h in units.items()}
        for info in infos.values():
            info["segment_bytes"] = settings.mooncake_segment_bytes
        return master, master_info, units, infos

    def _ping(self, unit: Any) -> Any:
        return unit.info.remote()

    def transport_info(self) -> dict[str, Any]:
        """TransferQueue's addresses plus where Mooncake's master is and how to reach the pool."""
        s = self.settings
        return {**super().transport_info(), "mooncake": {
            "master_address": self.master_info["master_address"],  # type: ignore[index]
            "metadata_server": self.master_info["metadata_server"],  # type: ignore[index]
            "protocol": s.mooncake_protocol, "device_name": s.mooncake_device_name,
            "buffer_bytes": s.mooncake_buffer_bytes}}

    @staticmethod
    def stop_processes(settings: ServiceSettings) -> None:
        """Stop Mooncake's master by its pid (the embedded service, before Ray goes down)."""
        from rlplane_service.mooncake import stop_master

        stop_master(settings)

    def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """TransferQueue's components and ``mooncake_master`` (its /health)."""
        out = super().health(timeout)
        try:
            out["mooncake_master"] = bool(ray.get(self.master.healthy.remote(), timeout=timeout))
        except (ray.exceptions.RayError, TimeoutError):
            out["mooncake_master"] = False
        return out

    def destroy(self) -> None:
        """Unmount the segments and stop the master by its pid, then kill the actors."""
        stops = [u.stop.remote() for u in self.units.values()] + [self.master.stop.remote()]
        try:
            ray.get(stops, timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.warning("could not stop the Mooncake side cleanly: %s", err)
        super().destroy()


__all__ = ["MooncakeStore"]
