"""The backend registry and the interface every store implements: the settings, the CLI
and the chart offer exactly the registered backends, and a fourth backend is one class
and one registry line (shown here with an in-process store served by the real API)."""

import json
import typing
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from rlplane import Client, default_registry
from rlplane.http_api import ServiceAPI
from rlplane.transports import MemoryTransport
from rlplane.transports.http import HttpTransport
from rlplane_service import backends
from rlplane_service.api import ServiceState, build_api
from rlplane_service.backends.base import StoreBackend
from rlplane_service.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]


def test_settings_cli_and_chart_offer_exactly_the_registered_backends():
    from rlplane_service.cli import Backend

    names = set(backends.BACKENDS)
    assert set(typing.get_args(ServiceSettings.model_fields["backend"].annotation)) == names
    assert {b.value for b in Backend} == names
    schema = json.loads((ROOT / "helm/rlplane/values.schema.json").read_text())
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "backend" in node.get("properties", {}):
                found.append(set(node["properties"]["backend"]["enum"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    assert found and all(f == names for f in found)


def test_every_registered_backend_is_a_store_backend_of_its_own_name():
    for name in backends.BACKENDS:
        cls = backends.store_class(name)
        assert issubclass(cls, StoreBackend) and cls.name == name and cls.publish_key
        assert not getattr(cls, "__abstractmethods__", None), (name, cls.__abstractmethods__)


class InProcessStore(StoreBackend):
    """A fourth backend: samples in this process's memory (what adding one takes)."""

    name = "in-process"
    publish_key = "in-process"

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings, self.ledger = settings, None
        self.transport = MemoryTransport()

    @classmethod
    def attach_or_create(cls, settings: ServiceSettings) -> "InProcessStore":
        return cls(settings)

    def destroy(self) -> None:
        self.transport = MemoryTransport()

    def transport_info(self) -> dict:
        return {"backend": self.name, "storage_units": {"memory": {}}}

    def service_transport(self) -> MemoryTransport:
        return self.transport

    def health(self, timeout: float = 2.0) -> dict:
        return {"memory": True}

    def streams(self, timeout: float = 5.0) -> dict:
        return {}


def test_a_fourth_backend_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "in-process", f"{__name__}:InProcessStore")
    settings = ServiceSettings(api_token="t")
    store = backends.store_class("in-process").attach_or_create(settings)
    state = ServiceState(settings, default_registry(), store.service_transport(), store.transport_info(), store.health,
                         publish_key=store.publish_key, streams=store.streams, loss=store.loss,
                         transport_for=store.transport_for, store=store)
    http = TestClient(build_api(state), base_url="http://rlplane.test")
    api = ServiceAPI("http://rlplane.test", token="t", http=http)
    client = Client(default_registry(), HttpTransport(api), service=api)
    fields = {"input_ids": torch.arange(12).reshape(3, 4), "input_lengths": torch.tensor([4, 2, 1])}
    meta = client.put_samples("p", fields)
    assert torch.equal(client.read_columns(meta, ["input_lengths"])["input_lengths"], fields["input_lengths"])
    status = http.get("/v1/status", headers={"Authorization": "Bearer t"}).json()
    assert status["samples"] == 3 and "memory" not in status  # no slabs to report: the default says none
    metrics = http.get("/metrics").text
    assert 'rlplane_partition_samples{partition="p"} 3.0' in metrics
    assert http.get("/readyz").status_code == 200
    assert http.get("/v1/transport", headers={"Authorization": "Bearer t"}).json()["in-process"]["backend"] == "in-process"


class RecoveringStore(InProcessStore):
    """A store whose controller restarted and rebuilds its index (as NativeStore reports it)."""

    def health(self, timeout: float = 2.0) -> dict:
        return {"memory": True, "controller rebuilding its index": False}

    def recovering(self, timeout: float = 2.0) -> dict:
        return {"phase": "replaying", "units_done": 2, "units": 2, "entries_done": 1024, "entries": 4096}


def test_readyz_says_recovering_with_the_rebuilds_progress():
    settings = ServiceSettings()
    store = RecoveringStore(settings)
    state = ServiceState(settings, default_registry(), store.service_transport(), store.transport_info(), store.health,
                         store=store)
    http = TestClient(build_api(state), base_url="http://rlplane.test")
    r = http.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "recovering" and "rebuilding its index" in body["reason"]
    assert body["progress"]["entries_done"] == 1024 and body["progress"]["entries"] == 4096
