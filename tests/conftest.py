"""Shared fixtures. One embedded rlplane service (one Ray cluster) per test session,
started only when a test asks for it and shut down at the session's end."""

import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass

# Tests only: a throwaway local cluster needs no Ray token auth (the product keeps Ray's
# secure default). Loopback everywhere: must be set before Ray is first imported.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # noqa: E402

TOKEN = "test-token-3f9a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Live:
    """One live rlplane app: where it answers and what it runs on."""

    url: str
    token: str
    backend: str
    app: str  # the Serve application name

    @property
    def direct(self) -> str:
        """The name of this backend's direct transport."""
        return "native" if self.backend == "native" else "tq"


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """The embedded service (default backend: native) on a free loopback port, with an API
    token, its units' slabs also on the transfer engine (TCP) for the ``te`` data path, and
    a write-ahead journal (so every service test runs with one)."""
    from rlplane_service.embedded import EmbeddedService
    from rlplane_service.settings import ServiceSettings

    svc = EmbeddedService(ServiceSettings(port=free_port(), api_token=TOKEN, storage_units=2, unit_bytes=512 << 20,
                                          te_protocol="tcp",  # the units' slabs on the transfer engine too
                                          # a journal (its timed fsync seldom: no test here times it)
                                          journal_dir=tmp_path_factory.mktemp("journal"), journal_flush_ms=500),
                          num_cpus=8)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def own_app(service):
    """``with own_app(args, "/nat") as url:`` an app of its own in the session's cluster at
    that prefix (for a module that kills its units or wants odd settings); on exit the app
    is deleted and its store's actors killed."""
    from ray import serve

    from rlplane_service.app import build_app

    @contextmanager
    def deploy(args: dict, prefix: str):
        name = f"rlplane-{prefix.strip('/')}"
        serve.run(build_app(args), name=name, route_prefix=prefix)
        try:
            yield f"{service.url}{prefix}"
        finally:
            serve.delete(name)
            end_store(args)

    return deploy


#: The names of a store's actors after its own name, on every backend (rlplane_service.backends).
_STORE_ACTOR = re.compile(r"-(native-controller|tq-controller|metrics|streams|mooncake-master|(native|tq|mooncake)-unit-\d+)")


@pytest.fixture(scope="session")
def ending_store():
    """``ending_store(args)``: :func:`end_store` (for a module's own app)."""
    return end_store


def end_store(args: dict) -> None:
    """Kill the actors of the store ``args`` names that still run, starting none (attaching
    to a store whose unit or master a test killed would start a new one just to kill it); its
    mooncake_master, if its actor runs, is stopped by pid first."""
    import ray

    from rlplane_service.mooncake import stop_master
    from rlplane_service.settings import ServiceSettings

    settings = ServiceSettings(**args)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == settings.namespace and a["name"].startswith(settings.store_name)
             and _STORE_ACTOR.fullmatch(a["name"][len(settings.store_name):])]
    if f"{settings.store_name}-mooncake-master" in names:
        stop_master(settings)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=settings.namespace), no_restart=True)
        except ValueError:  # gone meanwhile
            pass


SIMPLE_ARGS = {"store_name": "tq", "backend": "simple", "storage_units": 2, "api_token": TOKEN}


@pytest.fixture(scope="session")
def simple_service(service):
    """A second app in the session's cluster on the TransferQueue backend, at /tq."""
    from ray import serve

    from rlplane_service.app import build_app
    from rlplane_service.settings import ServiceSettings
    from rlplane_service.backends import open_store

    serve.run(build_app(SIMPLE_ARGS), name="rlplane-tq", route_prefix="/tq")
    try:
        yield Live(f"{service.url}/tq", TOKEN, "simple", "rlplane-tq")
    finally:
        serve.delete("rlplane-tq")
        open_store(ServiceSettings(**SIMPLE_ARGS)).destroy()


MOONCAKE_ARGS = {"store_name": "mc", "backend": "mooncake", "storage_units": 2, "mooncake_segment_bytes": 1 << 30,
                 "api_token": TOKEN}


@pytest.fixture(scope="session")
def mooncake_service(service):
    """A second app in the session's cluster on the Mooncake backend (its own
    mooncake_master, TCP on loopback), at /mc. Teardown stops the store and checks that
    the master process it started is gone."""
    import httpx
    from ray import serve

    from rlplane_service.app import build_app
    from rlplane_service.settings import ServiceSettings
    from rlplane_service.backends import open_store

    serve.run(build_app(MOONCAKE_ARGS), name="rlplane-mc", route_prefix="/mc")
    live = Live(f"{service.url}/mc", TOKEN, "mooncake", "rlplane-mc")
    status = httpx.get(f"{live.url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    pid = status["store"]["mooncake_master"]["pid"]
    try:
        yield live
    finally:
        serve.delete("rlplane-mc")
        open_store(ServiceSettings(**MOONCAKE_ARGS)).destroy()
        assert not _pid_alive(pid), f"mooncake_master pid {pid} outlived its store"


@pytest.fixture(scope="session")
def pid_alive():
    """``pid_alive(pid)``: whether a process is running (for tests that watch a pid)."""
    return _pid_alive


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session", params=["native", "simple", "mooncake"])
def live(request, service):
    """The live service on each storage backend."""
    if request.param == "native":
        return Live(service.url, TOKEN, "native", "rlplane")
    return request.getfixturevalue(f"{request.param}_service")


@pytest.fixture(scope="session")
def readyz():
    """``readyz(url, lambda r: r.status_code == 503)``: GET /readyz until the answer
    satisfies the predicate (a probe is reused for up to a second) or 5 s pass; the last answer."""
    import time

    import httpx

    def poll(url: str, ok, within: float = 5.0):
        deadline = time.monotonic() + within
        r = httpx.get(f"{url}/readyz", timeout=30)
        while not ok(r) and time.monotonic() < deadline:
            time.sleep(0.25)
            r = httpx.get(f"{url}/readyz", timeout=30)
        return r

    return poll
