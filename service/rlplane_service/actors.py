"""What every store's Ray actors share, whatever the backend: their options (named,
detached, ``num_cpus=0``, pinned to storage nodes) and the full-access data secret.

Example::

    common = actor_options(settings)
    Unit.options(name="rlplane-native-unit-0", **unit_options(settings, common)).remote(...)
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Callable

from rlplane_service.settings import ServiceSettings


def actor_options(settings: ServiceSettings) -> dict[str, Any]:
    """No runtime environment of their own: Ray hands such actors a worker it started
    already (an actor with environment variables of its own waits for a new process)."""
    return {
        "namespace": settings.namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
    }


def unit_options(settings: ServiceSettings, common: dict[str, Any]) -> dict[str, Any]:
    """Spread over the nodes that may hold them (Ray packed them onto one: two copies of a
    block then shared one host, and a lost node took both); with a storage resource each
    unit takes one, so a node offering N of it hosts at most N units."""
    spread = dict(common, scheduling_strategy="SPREAD")
    return dict(spread, resources={settings.storage_resource: 1}) if settings.storage_resource else spread


def head_options(common: dict[str, Any]) -> dict[str, Any]:
    """A store's controller and ledger: on the Ray head node, whose loss ends the cluster
    anyway (on another node, its loss restarted the controller at an address no client
    or replica knew: the store could no longer be reached, with nothing lost)."""
    return dict(common, resources={HEAD_NODE_RESOURCE: 0.001})


#: The resource only Ray's head node offers (Ray's own, ``ray._common.constants``).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def tq_unit_options(settings: ServiceSettings, common: dict[str, Any]) -> dict[str, Any]:
    """A TransferQueue storage unit's (backend simple): :func:`unit_options` with its TQ_NUM_THREADS (which
    TransferQueue reads when it is imported, so it must be in the process's environment)."""
    return dict(unit_options(settings, common),
                runtime_env={"env_vars": {"TQ_NUM_THREADS": str(settings.tq_num_threads)}})


def data_secret(settings: ServiceSettings, random: Callable[[], str] | None = None) -> str | None:
    """The full-access data-path secret of a store: derived from the API token; with only
    tenants' tokens, ``random()`` (the store's own random secret, for the service's own
    connections); None when nothing needs a token."""
    token = settings.token()
    if token is None:
        return random() if settings.tokens_file and random is not None else None
    return hmac.new(token.encode(), f"rlplane-data:{settings.store_name}".encode(), hashlib.sha256).hexdigest()


__all__ = ["actor_options", "unit_options", "head_options", "HEAD_NODE_RESOURCE", "tq_unit_options", "data_secret"]
