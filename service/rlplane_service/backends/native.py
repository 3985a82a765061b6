"""Backend ``native``: rlplane's own engine (:mod:`rlplane_service.native`) as Ray actors.

The store is a detached, named controller actor (``{store}-native-controller``) and
storage-unit actors (``{store}-native-unit-{i}``), all ``num_cpus=0``; a Serve replica
that restarts re-attaches to them by name. With an API token configured, every data
connection authenticates with a secret derived from the token and the store's name
(HMAC-SHA256), which ``/v1/transport`` hands out only under the token: the API token
itself never crosses a data port. Rotating the token needs a store restart.

Example::

    store = NativeStore.attach_or_create(ServiceSettings())
    store.transport_info()   # {"backend": "native", "controller": "tcp://...", ...}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray

from rlplane.errors import TransportError
from rlplane.transports.native import NativeTransport
from rlplane_service.actors import actor_options, data_secret, head_options, unit_options
from rlplane_service.backends.base import Sizes, StoreBackend
from rlplane_service.settings import ServiceSettings
from rlplane_service.tenants import Access, Tenants

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


@dataclass
class NativeStore(StoreBackend):
    """Handles on the native store's actors (see the module docstring)."""

    name: ClassVar[str] = "native"
    publish_key: ClassVar[str] = "native"
    settings: ServiceSettings
    controller: Any
    units: dict[str, Any]
    info: dict[str, Any]
    ledger: Any = None
    master_info: Any = None
    _unit_endpoints: dict[str, str] = field(default_factory=dict)
    users: dict[str, tuple[str, Access]] = field(default_factory=dict)  # tenant -> (engine secret, scope)

    @classmethod
    def attach_or_create(cls, settings: ServiceSettings) -> NativeStore:
        from rlplane_service.metrics import ledger_actor_class
        from rlplane_service.native.controller import controller_actor_class
        from rlplane_service.native.unit import unit_actor_class

        common = actor_options(settings)
        prefix = settings.store_name
        ledger = ledger_actor_class().options(name=f"{prefix}-metrics", **head_options(common)).remote()

        def store_secret(kind: str) -> str:  # the same for every replica creating the store at once
            return ray.get(ledger.store_secret.remote(kind), timeout=_START_TIMEOUT_S)

        secret = data_secret(settings, lambda: store_secret("data"))
        users = Tenants.load(settings.token(), str(settings.tokens_file or "")).data_users(prefix)
        scoped = {name: [s, access.wire()] for name, (s, access) in users.items()}  # user -> [secret, scope]
        host = settings.native_host or None
        Unit, Controller = unit_actor_class(), controller_actor_class()
        control = store_secret("control")  # the controller's own credential on the units; no client ever sees it
        units = {
            f"{prefix}-native-unit-{i}": Unit.options(name=f"{prefix}-native-unit-{i}", **unit_options(settings, common))
            .remote(f"{prefix}-native-unit-{i}", host, secret, settings.unit_bytes, control, settings.engine_ports(),
                    {name: s for name, (s, _) in scoped.items()},
                    (settings.te_protocol, settings.te_devices, *(settings.te_ports() or ())) if settings.te_protocol
                    else None,
                    (str(settings.journal_dir), settings.journal_flush_ms) if settings.journal_dir else None,
                    [name for name, (_, access) in users.items() if not access.write])
            for i in range(settings.storage_units)
        }
        try:
            unit_infos = ray.get([u.info.remote() for u in units.values()], timeout=_START_TIMEOUT_S)
            # Restarted by Ray when its process dies: it rebuilds its index from the units' commit log.
            controller = Controller.options(name=f"{prefix}-native-controller", max_restarts=-1,
                                            **head_options(common)).remote(
                host, secret, [(i["name"], i["endpoint"]) for i in unit_infos], settings.capacity,
                settings.put_lease_s, settings.replicas, settings.claim_lease_s,
                [i["control"] for i in unit_infos], control, settings.unit_grace_s, settings.engine_ports(), scoped,
                prefix, settings.journal_dir is not None)
            cinfo = ray.get(controller.info.remote(), timeout=_START_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            raise TransportError(f"the native store's actors did not start: {err}") from err
        # A store that existed keeps the units it was created with.
        units = {name: ray.get_actor(name, namespace=settings.namespace) for name, _ in cinfo["units"]}
        info = {
            "backend": "native",
            "controller": cinfo["endpoint"],
            "secret": cinfo["secret"],
            "storage_units": {name: {"endpoint": ep} for name, ep in cinfo["units"]},
            "units": [list(u) for u in cinfo["units"]],
            "streams": {"endpoint": cinfo["endpoint"], "secret": cinfo["secret"]},  # the controller keeps consumption
        }
        log.info("native store %r: controller %s, %d storage units", prefix, cinfo["endpoint"], len(units))
        return cls(settings, controller, units, info, ledger, users=users)

    def transport_info(self) -> dict[str, Any]:
        """What ``GET /v1/transport`` publishes under ``native`` (full access)."""
        return dict(self.info)

    def transport_for(self, access: Access) -> dict[str, Any] | None:
        """What ``GET /v1/transport`` publishes to ``access``: a tenant gets its own
        credential (``user``, ``secret``), whose scope the controller enforces."""
        if access.full:
            return dict(self.info)
        if access.tenant not in self.users:
            return None  # a tenant added after the store was made: its data goes over HTTP
        secret = self.users[access.tenant][0]
        return {**self.info, "user": access.tenant, "secret": secret,
                "streams": {**self.info["streams"], "user": access.tenant, "secret": secret}}

    def service_transport(self) -> NativeTransport:
        return NativeTransport(self.info, timeout=60.0)

    def streams(self, timeout: float = 5.0) -> dict[str, Any]:
        """Every (partition, task)'s consumption and the claim-wait histogram (for /metrics)."""
        return ray.get(self.controller.streams.remote(), timeout=timeout)

    def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """Per component: ``controller`` and each storage unit by name (False when it does
        not answer); plus ``<component> <loop>`` False for a server or background loop of
        one that died (the component answers Ray but no longer does that part of its work)."""
        refs = {"controller": self.controller.health.remote(), **{n: u.health.remote() for n, u in self.units.items()}}
        out = {}
        for name, ref in refs.items():
            try:
                got = ray.get(ref, timeout=timeout)
                out[name] = True
            except (ray.exceptions.RayError, TimeoutError):
                out[name] = False
                continue
            if got.get("recovering") is not None:
                out["controller rebuilding its index"] = False
                continue
            if not got.get("server", {}).get("alive", True):
                out[f"{name} server loop"] = False
            for loop, alive in got.get("threads", {}).items():
                if not alive:
                    out[f"{name} {loop}"] = False
        return out

    def recovering(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The controller's rebuild progress while a restarted controller rebuilds its index
        (None otherwise, or when it does not answer)."""
        try:
            got = ray.get(self.controller.health.remote(), timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        return got.get("recovering") or ({"failed": got["rebuild_failed"]} if got.get("rebuild_failed") else None)

    def engine_stats(self, transport: NativeTransport) -> dict[str, Any]:
        """The controller's account: per unit samples, live bytes and slab; lost and
        under-replicated samples."""
        return transport.stats()

    def sizes(self, transport: NativeTransport, unit_names: list[str]) -> Sizes:
        """One listing for every partition, the units' share from the controller."""
        partitions = {d["partition"]: (int(d["num_samples"]), int(d["nbytes"])) for d in transport.list()}
        units: dict[str, tuple[int, int] | None] = {u: None for u in unit_names}
        for u, d in transport.stats()["units"].items():
            if u in units:
                units[u] = (int(d["samples"]), int(d["live_bytes"]))
        return partitions, units

    def destroy(self) -> None:
        """Kill the store's actors (every sample is lost). Only for the process that owns the store."""
        for handle in [*self.units.values(), self.controller, self.ledger]:
            if handle is None:
                continue
            try:
                ray.kill(handle, no_restart=True)
            except (ray.exceptions.RayError, ValueError) as err:
                log.warning("could not kill a store actor: %s", err)


__all__ = ["NativeStore", "data_secret"]
