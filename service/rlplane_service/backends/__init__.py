"""Storage backends: one module each, chosen by name (``RLPLANE_BACKEND``) through one registry.

Every backend's store is a :class:`~rlplane_service.backends.base.StoreBackend`: what the
service asks of a store (its actors, what ``/v1/transport`` publishes, the transport the
service uses, health, consumption, loss, sizes per partition and unit, destroy) is
declared there, and nothing outside ``backends/`` asks which backend it has.

Adding a backend is one module (a StoreBackend subclass) and one line in :data:`BACKENDS`.

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
    "simple": "rlplane_service.backends.simple:SimpleStore",
    "mooncake": "rlplane_service.backends.mooncake:MooncakeStore",
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
