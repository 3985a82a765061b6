"""Storage backends: one module each, chosen by name (``RLPLANE_BACKEND``) through one registry.

A backend's store object offers what the service needs and nothing more:

- ``attach_or_create(settings)`` (classmethod): the store's actors, created on first start
  and re-attached after a Serve replica restart;
- ``publish_key`` and ``transport_info()``: what ``GET /v1/transport`` publishes under
  that key for clients' direct data path (``backend`` and ``storage_units`` included);
- ``service_transport()``: the Transport the service itself uses (HTTP relay, listings);
- ``health(timeout)`` per component, ``destroy()``, ``ledger`` (the metrics actor) and
  ``master_info`` (extra components to report, e.g. Mooncake's master; None otherwise);
- ``stop_processes(settings)`` (static): stop what the store runs outside Ray, by pid.

Adding a backend is one module and one line in :data:`BACKENDS`.

Example::

    store = open_store(ServiceSettings(backend="native"))
    store.transport_info()
"""

from __future__ import annotations

import importlib
from typing import Any

from rlplane_service.settings import ServiceSettings

#: backend name -> "module:class" of its store.
BACKENDS = {
    "native": "rlplane_service.backends.native:NativeStore",
    "simple": "rlplane_service.store:Store",
    "mooncake": "rlplane_service.store:Store",
}


def store_class(name: str) -> Any:
    """The store class of backend ``name`` (ValueError naming the known ones otherwise)."""
    try:
        module, _, cls = BACKENDS[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)


def open_store(settings: ServiceSettings) -> Any:
    """Attach to (or create) the store ``settings`` describe (needs a connected Ray)."""
    return store_class(settings.backend).attach_or_create(settings)


__all__ = ["BACKENDS", "open_store", "store_class"]
