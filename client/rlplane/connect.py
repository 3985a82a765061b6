"""``rlplane.connect``: a Client for a running rlplane service, from its URL alone.

The client fetches the service's field registry, asks how to reach the data path
(``GET /v1/transport``) and picks a transport:

- ``"tq"``: straight to the TransferQueue storage units over ZMQ (bulk bytes never
  touch the HTTP proxy). Needs the ``transfer_queue`` package and a route to the units.
- ``"http"``: through the service's binary data endpoints. Works wherever the URL does.
- ``"auto"`` (default): ``tq`` when it is installed and the store answers within a
  second, else ``http``. ``client.transport.name`` says which was chosen.

No Ray cluster and no ``ray.init`` are needed in the calling process.

Example::

    client = rlplane.connect("http://127.0.0.1:8000", token="s3cret")
    meta = client.put_samples("step-0", batch)
"""

from __future__ import annotations

import logging
import os

from rlplane.client import Client
from rlplane.errors import InvalidArgumentError, TransportError
from rlplane.fields import Registry
from rlplane.http_api import ServiceAPI
from rlplane.transports.base import Transport

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tq", "http")
DEFAULT_URL = "http://127.0.0.1:8000"


def connect(
    url: str = DEFAULT_URL,
    *,
    token: str | None = None,
    transport: str = "auto",
    timeout: float = 300.0,
    reuse_buffers: bool = True,
) -> Client:
    """A :class:`~rlplane.client.Client` for the service at ``url`` (see the module docstring).

    ``token`` defaults to the ``RLPLANE_API_TOKEN`` environment variable. Raises
    TransportError when the service is unreachable or the asked-for transport is not
    available, AuthenticationError on a missing or wrong token. ``reuse_buffers``: see
    :class:`~rlplane.client.Client` (encode buffers kept between puts).

    Example::

        with rlplane.connect(transport="http") as client:
            print(client.partitions())
    """
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if token is None:
        token = os.environ.get("RLPLANE_API_TOKEN") or None
    api = ServiceAPI(url, token=token, timeout=timeout)
    try:
        registry = Registry.from_dict(api.json("GET", "/v1/registry"))
        described = api.json("GET", "/v1/transport")
        chosen = _transport(api, described, transport)
    except BaseException:
        api.close()
        raise
    log.info("connected to %s: %d fields, transport %s", url, len(registry.names()), chosen.name)
    return Client(registry, chosen, service=api, reuse_buffers=reuse_buffers)


def _transport(api: ServiceAPI, described: dict, wanted: str) -> Transport:
    from rlplane.transports.http import HttpTransport

    tq_info = described.get("tq")
    if wanted == "http":
        return HttpTransport(api)
    if wanted == "tq" and not tq_info:
        raise TransportError("this service publishes no TransferQueue address; connect with transport='http'")
    if wanted == "auto":
        from rlplane.transports.tq import reachable

        if not tq_info or not _importable("transfer_queue") or not reachable(tq_info):
            return HttpTransport(api)
    from rlplane.transports.tq import TQTransport

    try:
        return TQTransport(tq_info)
    except TransportError:
        if wanted == "auto":
            return HttpTransport(api)
        raise


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


__all__ = ["connect", "TRANSPORTS", "DEFAULT_URL"]
