"""The embedded default: a local Ray, the rlplane app on it, torn down as one unit.

``rlplane serve`` and ``rlplane demo`` (when no service answers) run this; the test suite
shares one per session. It owns what it starts: ``stop()`` shuts Serve down and then the
local Ray instance it created (which takes the store's actors with it).

On a loopback host everything binds 127.0.0.1: Ray's node address, the storage units'
ZMQ sockets and the HTTP proxy.

Example::

    with EmbeddedService(ServiceSettings(port=8001)) as svc:
        client = rlplane.connect(svc.url)
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Callable

import httpx

from rlplane.errors import TransportError
from rlplane_service.net import free_port  # noqa: F401 - re-exported: rlplane_service.embedded.free_port
from rlplane_service.settings import ServiceSettings

log = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class EmbeddedService:
    """A local Ray instance running the rlplane Serve app (see the module docstring)."""

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        num_cpus: int = 8,
        ready_timeout_s: float = 180.0,
        say: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.settings = settings
        self.num_cpus = num_cpus
        self.ready_timeout_s = ready_timeout_s
        self.say = say
        self._started_ray = False

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def start(self) -> EmbeddedService:
        """Start Ray, Serve and the app; return once ``/readyz`` answers 200."""
        if _answers(self.url):
            raise TransportError(f"something already answers at {self.url}; stop it or pick another --port")
        if self.settings.host in _LOOPBACK:
            # Ray otherwise advertises the machine's external address and TransferQueue's
            # sockets bind there. Ray reads this once, when it is first imported.
            if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
                log.warning("ray was imported before the embedded service started; it may bind a non-loopback address")
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray import serve

        from rlplane_service.app import build_app
        self.say(f"starting local Ray ({self.num_cpus} logical CPUs)")
        # ray.init installs its own SIGINT/SIGTERM handlers (SIGTERM aborts the process);
        # put back the caller's, so `rlplane serve` shuts down cleanly at any moment.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        was_up = ray.is_initialized()  # (then ray.init refuses, and that Ray is not this service's to stop)
        try:
            ray.init(
                num_cpus=self.num_cpus,
                namespace=self.settings.namespace,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except BaseException:  # (Ctrl-C while Ray starts: the processes it began go with it)
            if not was_up:
                ray.shutdown()
            raise
        self._started_ray = True
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        try:
            self.say(f"starting Ray Serve on {self.url}")
            serve.start(http_options={"host": self.settings.host, "port": self.settings.port}, logging_config={"log_level": "WARNING"})
            self.say(f"deploying rlplane ({self.settings.storage_units} storage units, backend {self.settings.backend})")
            try:
                serve.run(build_app(self.settings.as_args()), name="rlplane", route_prefix="/", blocking=False)
            except RuntimeError as err:  # Serve says only that the deployment failed: say why
                raise replica_error("rlplane") or err from None
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.say(f"rlplane is ready at {self.url}")
        return self

    def stop(self) -> None:
        """Shut Serve down, then the local Ray (and with it the store). Idempotent."""
        if not self._started_ray:
            return
        import ray
        from ray import serve

        try:
            serve.shutdown()
        except Exception as err:  # noqa: BLE001 - shutting down: report, carry on
            log.warning("serve.shutdown failed: %s", err)
        from rlplane_service.backends import store_class

        store_class(self.settings.backend).stop_processes(self.settings)  # by pid, before Ray takes the actors down
        ray.shutdown()
        self._started_ray = False

    def _wait_ready(self) -> None:
        wait_ready(self.url, self.ready_timeout_s)

    def __enter__(self) -> EmbeddedService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_ready(url: str, timeout_s: float) -> None:
    """Return once the service at ``url`` answers ``/readyz`` with 200; TransportError
    (with its last answer) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5.0)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.HTTPError as err:
            last = str(err)
        time.sleep(0.5)
    raise TransportError(f"rlplane did not become ready at {url} within {timeout_s:.0f} s: {last}")


#: The last line of a replica's traceback when rlplane raised it: "rlplane.errors.Name: message".
_RLPLANE_ERROR = re.compile(r"^rlplane\.errors\.(\w+): (.+)$", re.M)


def replica_error(app: str) -> Exception | None:
    """The typed rlplane error that stopped ``app``'s replicas from starting (e.g. the
    SnapshotError of a damaged ``--restore``, naming the file), as Serve's deployment
    status reports it; None when it was no rlplane error or Serve says nothing.

    Example: ``raise replica_error("rlplane") or err``."""
    from ray import serve

    from rlplane import errors

    try:
        deployments = serve.status().applications[app].deployments.values()
    except Exception:  # noqa: BLE001 - no status to read: the caller raises Serve's own error
        return None
    for d in deployments:
        found = _RLPLANE_ERROR.findall(d.message or "")
        if found:
            name, message = found[-1]
            kind = getattr(errors, name, None)
            if isinstance(kind, type) and issubclass(kind, errors.RlplaneError):
                try:
                    return kind(message)
                except TypeError:  # an error whose constructor takes more than a message
                    return errors.RlplaneError(f"{name}: {message}")
    return None


def _answers(url: str, timeout: float = 5.0) -> bool:
    """Whether a service answers ``/healthz`` at ``url``: False when nothing listens there
    (a refused port says so at once); TransportError when something listens but does not
    answer as HTTP within ``timeout`` (a loaded 2-core machine's Serve proxy can take over a
    second: starting a service there would only fail to bind), or the URL does not parse."""
    from rlplane.http_api import checked_url

    url = checked_url(url)
    try:
        httpx.get(f"{url}/healthz", timeout=timeout)
        return True
    except httpx.ConnectError:
        return False
    except httpx.ConnectTimeout:
        raise TransportError(f"no answer from {url} within {timeout:g} s (the connection timed out): check the URL, "
                             "or start a service there") from None
    except httpx.HTTPError as err:
        raise TransportError(f"something listens at {url} but does not answer as an rlplane service within "
                             f"{timeout:g} s ({type(err).__name__}); wait for it, stop it, or pick another "
                             "--url / --port") from None
