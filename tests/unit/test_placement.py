"""Where a block's copies go: distinct units, on distinct nodes when there are several;
a lost copy is made again on a node that holds none."""

import time

import torch

from rlplane import Client, default_registry
from rlplane.placement import spread
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"placement-test-secret"


def test_spread_prefers_hosts_without_a_copy_and_falls_back_to_distinct_units():
    eps = ["tcp://a:1", "tcp://a:2", "tcp://b:1", "tcp://b:2"]
    assert spread([0, 1, 2, 3], eps, 2) == [0, 2]
    assert spread([1, 0, 3, 2], [eps[1], eps[0], eps[3], eps[2]], 3) == [1, 3, 0]  # two hosts: the third shares
    assert spread([0, 1], eps[:2], 2) == [0, 1]  # one host: distinct units still
    assert spread([0, 1, 2], eps[:3], 1, taken=["tcp://a:9"]) == [2]  # a copy on host a already


def test_copies_land_on_two_hosts_and_a_lost_copy_is_remade_on_the_host_without_one():
    """Units on 127.0.0.1 and 127.0.0.2 (both loopback) stand for two nodes."""
    hosts = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    eng = LocalEngine(4, secret=SECRET, hosts=hosts, replicas=2)
    core = eng.core
    client = Client(default_registry(), NativeTransport(eng.info, timeout=30))
    try:
        fields = [{"input_ids": torch.arange(k, k + 64).reshape(8, 8), "input_lengths": torch.full((8,), 8)} for k in range(8)]
        metas = [client.put_samples(f"p{k}", f) for k, f in enumerate(fields)]
        placed = dict(core._block_units)
        assert placed and all({hosts[u] for u in us} == set(hosts[1:3]) for us in placed.values()), placed
        eng.kill_unit(2)  # a 127.0.0.2 unit dies: its copies are made again on the other one there
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not core._lost_units or core.stats()["under_replicated_samples"]):
            time.sleep(0.1)
        assert core.stats()["lost_units"] == ["u2"] and core.stats()["under_replicated_samples"] == 0
        for us in core._block_units.values():
            assert 2 not in us and {hosts[u] for u in us} == set(hosts[1:3]), core._block_units
        for meta, f in zip(metas, fields):
            assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], f["input_ids"])
    finally:
        client.close()
        eng.stop()


def test_a_store_that_lost_a_unit_is_still_reachable_and_auto_keeps_its_direct_path(caplog):
    """A new client of a store with two copies that lost a unit (nothing lost) keeps the
    native path (it fell back to HTTP, silently, for every client started after the loss);
    a store whose controller does not answer is unreachable, and the fallback says so."""
    import logging

    from rlplane.connect import _transport
    from rlplane.http_api import ServiceAPI
    from rlplane.transports.native import reachable

    eng = LocalEngine(3, secret=SECRET, slab_bytes=32 << 20, replicas=2)
    info = {"backend": "native", **eng.info, "units": [[n, e] for n, e in eng.core.units]}  # as /v1/transport says
    api = ServiceAPI("http://127.0.0.1:9")  # (never asked: the HTTP transport is only made)
    try:
        client = Client(default_registry(), NativeTransport(info, timeout=30))
        fields = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
        meta = client.put_samples("p", fields)
        client.close()
        eng.kill_unit(2)
        deadline = time.monotonic() + 20
        while not eng.core.stats()["lost_units"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.core.stats()["lost_units"] and reachable(info)
        chosen = _transport(api, {"native": info}, "auto", 30.0, "auto")
        with Client(default_registry(), chosen) as c:
            assert chosen.name == "native" and chosen.paths()["u2"] == "down"  # (it said zmq)
            assert torch.equal(c.read_columns(meta, ["input_ids"])["input_ids"], torch.arange(64).reshape(8, 8))
        eng.kill_controller()
        assert not reachable(info)
        with caplog.at_level(logging.WARNING, logger="rlplane.connect"):
            assert _transport(api, {"native": info}, "auto", 30.0, "auto").name == "http"
        assert "does not answer from this host" in caplog.text
    finally:
        eng.stop()


def test_a_data_path_asked_for_by_name_fails_saying_why_instead_of_moving_bytes_over_http(caplog):
    """``connect(data_path="te")`` to a store whose units run no transfer engine, or
    ``data_path="shm"`` to one whose engine does not answer, moved every byte through the
    HTTP proxy with a log line only; the path asked for by name is the call's, or it fails."""
    import pytest

    from rlplane import errors as E
    from rlplane.connect import _transport
    from rlplane.http_api import ServiceAPI

    eng = LocalEngine(1, secret=SECRET, slab_bytes=32 << 20)  # (no transfer engine)
    info = {"backend": "native", **eng.info, "units": [[n, e] for n, e in eng.core.units]}
    api = ServiceAPI("http://127.0.0.1:9")  # (never asked: the HTTP transport is only made)
    try:
        with pytest.raises(E.TransportError, match="data_path='te' needs every storage unit on the transfer engine"):
            _transport(api, {"native": info}, "auto", 30.0, "te")
        chosen = _transport(api, {"native": info}, "auto", 30.0, "auto")  # the client's choice: here, shm
        assert chosen.name == "native" and set(chosen.paths().values()) == {"shm"}
        chosen.close()
        eng.kill_controller()
        with pytest.raises(E.TransportError, match="data_path='shm': the store's native engine does not answer"):
            _transport(api, {"native": info}, "auto", 30.0, "shm")
        assert _transport(api, {"native": info}, "auto", 30.0, "auto").name == "http"  # (auto: as before)
    finally:
        eng.stop()
