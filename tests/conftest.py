"""Shared fixtures. One embedded rlplane service (one Ray cluster) per test session,
started only when a test asks for it and shut down at the session's end."""

import os
import socket

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


@pytest.fixture(scope="session")
def service():
    """The embedded service on a free loopback port, with an API token."""
    from rlplane_service.embedded import EmbeddedService
    from rlplane_service.settings import ServiceSettings

    svc = EmbeddedService(ServiceSettings(port=free_port(), api_token=TOKEN, storage_units=2), num_cpus=8)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()
