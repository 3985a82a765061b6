"""What the service asks of a store: the interface every backend implements.

A backend is one module with one :class:`StoreBackend` subclass, registered by name in
:data:`rlplane_service.backends.BACKENDS`. The service never asks which backend it has:
it calls these methods, and a backend that lacks a capability keeps the default (which
says so: ``None``, or the generic answer).

Example::

    store = store_class("native").attach_or_create(settings)
    transport = store.service_transport()
    store.sizes(transport, list(store.transport_info()["storage_units"]))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Optional

from rlplane.errors import MissingDataError
from rlplane_service.settings import ServiceSettings
from rlplane_service.tenants import Access

#: Per partition ``(samples, bytes)``; per storage unit ``(samples, bytes)`` or None when
#: the backend cannot say where a sample's bytes are.
Sizes = tuple[dict[str, tuple[int, int]], dict[str, Optional[tuple[int, int]]]]


class StoreBackend(ABC):
    """A store's actors and what the service needs of them (see the module docstring)."""

    #: The backend's name (``RLPLANE_BACKEND``) and the key ``/v1/transport`` publishes its
    #: direct data path under (the client transport that speaks it).
    name: ClassVar[str]
    publish_key: ClassVar[str]
    settings: ServiceSettings
    ledger: Any  # the op-counter actor /metrics reads (rlplane_service.metrics)
    master_info: Any = None  # extra components to report (Mooncake's master), else None
    #: ``loss()``: samples lost with dead storage units, as the service counts them
    #: (``lost_samples``, ``lost_units``); None where the engine reports its own (native).
    loss: Optional[Callable[..., dict[str, Any]]] = None

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def attach_or_create(cls, settings: ServiceSettings) -> StoreBackend:
        """The store's actors: created on first start, re-attached after a replica restart."""

    @staticmethod
    def stop_processes(settings: ServiceSettings) -> None:
        """Stop what the store runs outside Ray, by pid (the default: nothing does)."""

    @abstractmethod
    def destroy(self) -> None:
        """Stop the store (every sample is lost). Only for the process that owns it."""

    # -- what clients are told -------------------------------------------------------
    @abstractmethod
    def transport_info(self) -> dict[str, Any]:
        """What ``GET /v1/transport`` publishes under :attr:`publish_key` (full access)."""

    def transport_for(self, access: Access) -> Optional[dict[str, Any]]:
        """What ``/v1/transport`` publishes to ``access``; None: the HTTP data path only
        (the default for a tenant: a store whose engine authenticates nobody)."""
        return self.transport_info() if access.full else None

    @abstractmethod
    def service_transport(self) -> Any:
        """The Transport the service itself uses (HTTP relay, listings)."""

    # -- what the service reports ----------------------------------------------------
    @abstractmethod
    def health(self, timeout: float = 2.0) -> dict[str, bool]:
        """Per component: whether it answers within ``timeout``."""

    def recovering(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """Progress of a rebuild the store runs after a component restarted (None: none runs)."""
        return None

    def alive(self, timeout: float = 2.0) -> bool:
        return all(self.health(timeout).values())

    @abstractmethod
    def streams(self, timeout: float = 5.0) -> dict[str, Any]:
        """Every (partition, task)'s consumption and the claim-wait histogram (for /metrics)."""

    def watch_units(self, transport: Any) -> Any:
        """A started watcher that declares dead storage units lost (``.stop()``), where
        the service must do it; None where the engine watches its own units."""
        return None

    def engine_stats(self, transport: Any) -> Optional[dict[str, Any]]:
        """The engine's own account (per unit samples, bytes and slab; lost and
        under-replicated samples), where it keeps one; None otherwise."""
        return None

    def sizes(self, transport: Any, unit_names: list[str]) -> Sizes:
        """Samples and bytes per partition and per storage unit (blocking: run it off the
        event loop). The default: :func:`described_sizes`."""
        return described_sizes(transport, unit_names)


def described_sizes(transport: Any, unit_names: list[str]) -> Sizes:
    """Per partition as the transport describes it, one by one; per unit unknown."""
    partitions: dict[str, tuple[int, int]] = {}
    for name in transport.partitions():
        try:
            info = transport.describe(name)
        except MissingDataError:  # cleared meanwhile
            continue
        partitions[name] = (info.num_samples, info.nbytes)
    return partitions, {u: None for u in unit_names}


__all__ = ["Sizes", "StoreBackend", "described_sizes"]
