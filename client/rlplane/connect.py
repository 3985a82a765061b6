"""``rlplane.connect``: a Client for a running rlplane service, from its URL alone.

The client fetches the service's field registry, asks how to reach the data path
(``GET /v1/transport``) and picks a transport:

- ``"native"``: straight to the native engine's controller and storage units over ZMQ
  (the default backend; needs only ``pyzmq`` and a route to the units).
- ``"tq"``: straight to TransferQueue storage units or Mooncake (backends ``simple`` and
  ``mooncake``). Needs the ``transfer_queue`` package and a route to the store.
- ``"direct"``: whichever of those two the service publishes.
- ``"http"``: through the service's binary data endpoints. Works wherever the URL does.
- ``"auto"`` (default): the direct path when its package is installed and the store
  answers within a second, else ``http``. ``client.transport.name`` says which was chosen.

Bulk bytes never touch the HTTP proxy on a direct path. Every call has a deadline
(``timeout``, seconds).

No Ray cluster and no ``ray.init`` are needed in the calling process.

Example::

    client = rlplane.connect("http://127.0.0.1:8000", token="s3cret")
    meta = client.put_samples("step-0", batch)
"""

from __future__ import annotations

import importlib
import math
import logging
import os

from typing import TYPE_CHECKING

from rlplane.errors import InvalidArgumentError, TransportError, VersionMismatchError

if TYPE_CHECKING:  # imported when connect() runs: ``import rlplane`` stays light (see rlplane/__init__.py)
    from rlplane.client import Client
    from rlplane.http_api import ServiceAPI
    from rlplane.transports.base import Transport

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "direct", "native", "tq", "http")
#: Data paths of the native engine (see rlplane.transports.native.DATA_PATHS; no zmq import here).
DATA_PATHS = ("auto", "shm", "te", "zmq")
#: Direct data paths a service may publish at /v1/transport: key -> (module with
#: ``reachable`` and ``open_transport``, package it needs).
DIRECT = {"native": ("rlplane.transports.native", "zmq"), "tq": ("rlplane.transports.tq", "transfer_queue")}
DEFAULT_URL = "http://127.0.0.1:8000"


def connect(
    url: str = DEFAULT_URL,
    *,
    token: str | None = None,
    transport: str = "auto",
    timeout: float = 60.0,
    reuse_buffers: bool = True,
    data_path: str | None = None,
) -> Client:
    """A :class:`~rlplane.client.Client` for the service at ``url`` (see the module docstring).

    ``token`` defaults to the ``RLPLANE_API_TOKEN`` environment variable. Raises
    TransportError when the service is unreachable or the asked-for transport is not
    available, AuthenticationError on a missing or wrong token. ``reuse_buffers``: see
    :class:`~rlplane.client.Client` (encode buffers kept between puts). ``data_path``
    (native engine; default ``RLPLANE_DATA_PATH``, else ``auto``): ``shm`` maps the slabs
    of storage units on this host, ``te`` moves bytes one-sided over Mooncake's transfer
    engine (units on other hosts, when the service runs it: RLPLANE_TE_PROTOCOL), ``zmq``
    sends every byte as frames, ``auto`` maps what it can and uses the transfer engine
    for the rest where offered (see :mod:`rlplane.transports.native`);
    ``client.transport.paths()`` says which.

    Example::

        with rlplane.connect(transport="http") as client:
            print(client.partitions())
    """
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if token is None:
        token = os.environ.get("RLPLANE_API_TOKEN") or None
    if data_path is None:
        data_path = os.environ.get("RLPLANE_DATA_PATH") or "auto"
    if data_path not in DATA_PATHS:
        raise InvalidArgumentError(f"data_path (RLPLANE_DATA_PATH) must be one of {DATA_PATHS}, got {data_path!r}")
    from rlplane.client import Client
    from rlplane.fields import Registry
    from rlplane.http_api import ServiceAPI, shown_url

    api = ServiceAPI(url, token=token, timeout=timeout)
    url = api.url  # (checked)
    try:
        described = api.json("GET", "/v1/transport")
        same_release(shown_url(url), described.get("version"))
        registry = Registry.from_dict(api.json("GET", "/v1/registry"))
        chosen = _transport(api, described, transport, timeout, data_path)
    except BaseException:
        api.close()
        raise
    log.info("connected to %s: %d fields, transport %s", shown_url(url), len(registry.names()), chosen.name)
    return Client(registry, chosen, service=api, reuse_buffers=reuse_buffers)


def same_release(url: str, theirs: object) -> None:
    """VersionMismatchError unless the service at ``url`` runs this client's release of
    rlplane (``theirs``: the version its ``/v1/transport`` names; a service from before
    releases named it sends none). The engine's messages and the HTTP envelope change
    between releases without a version of their own, so a mismatch would misread fields.

    Example: ``same_release("http://127.0.0.1:8000", "0.1.0")``.
    """
    from rlplane import __version__

    if theirs == __version__:
        return
    runs = f"rlplane {theirs}" if isinstance(theirs, str) and theirs else "an older rlplane that does not say its version"
    raise VersionMismatchError(
        f"the service at {url} runs {runs}; this client is rlplane {__version__}. Client and service must be the same "
        "release (their messages change between releases): install the service's release in this environment"
        + (f" (pip install rlplane=={theirs})" if isinstance(theirs, str) and theirs else "")
        + ", or upgrade the service")


def _transport(api: ServiceAPI, described: dict, wanted: str, timeout: float, data_path: str) -> Transport:
    from rlplane.transports.http import HttpTransport

    if wanted == "http":
        return HttpTransport(api)
    published = [k for k in DIRECT if described.get(k)]
    if wanted in DIRECT and wanted not in published:
        raise TransportError(f"this service publishes no {wanted!r} data path (it offers {published or 'http only'}); "
                             "connect with transport='direct' or 'http'")
    kind = wanted if wanted in DIRECT else (published[0] if published else None)
    if kind is None:
        if wanted == "direct":
            raise TransportError("this service publishes no direct data path; connect with transport='http'")
        return HttpTransport(api)
    info = described[kind]
    # A data path asked for by name (data_path, RLPLANE_DATA_PATH) is the native engine's:
    # without it the call fails, saying why, rather than moving the bytes over HTTP.
    fallback = wanted == "auto" and not (kind == "native" and data_path != "auto")
    if wanted == "auto":
        module, package = DIRECT[kind]
        if not fallback and not _importable(package):
            raise TransportError(f"data_path={data_path!r} needs the {package!r} package (pip install {package!r}); "
                                 "or connect with data_path='auto' to let the client choose, HTTP included")
        if not _importable(package):
            log.warning("rlplane: the %r data path needs the %r package: this client moves its bytes over HTTP "
                        "(pip install %r; or connect with transport='http' to say so)", kind, package, package)
            return HttpTransport(api)
        if not importlib.import_module(module).reachable(info):
            if not fallback:
                raise TransportError(f"data_path={data_path!r}: the store's native engine does not answer from this "
                                     "host; connect with data_path='auto' to let the client choose, HTTP included")
            log.warning("rlplane: the store's %r data path does not answer from this host: this client moves its "
                        "bytes over HTTP (transport='direct' says why)", kind)
            return HttpTransport(api)
    try:
        return _open(kind, info, timeout, data_path)
    except TransportError as err:
        if fallback:
            log.warning("rlplane: the store's %r data path failed (%s): this client moves its bytes over HTTP",
                        kind, err)
            return HttpTransport(api)
        raise


def _open(kind: str, info: dict, timeout: float, data_path: str) -> Transport:
    module, _ = DIRECT[kind]
    return importlib.import_module(module).open_transport(info, timeout=timeout, data_path=data_path)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


__all__ = ["connect", "TRANSPORTS", "DEFAULT_URL"]
