"""What /metrics says matches what happened: a polling consumer is not an error, an extend
and a snapshot are counted once as what they are, a scrape answers while the controller is
down, counters never fall, and a client never waits on the service to report its ops (an
in-process engine and the service's app, no Ray)."""

import socket
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from rlplane import Client, default_registry
from rlplane import client as client_module
from rlplane import errors as E
from rlplane.http_api import ServiceAPI
from rlplane.transports.http import HttpTransport
from rlplane.transports.native import NativeTransport
from rlplane_service.api import ServiceState, build_api
from rlplane_service.metrics import SCRAPE_TTL_S, TOP_LABELLED, StoreView, render
from rlplane_service.native.local import LocalEngine
from rlplane_service.settings import ServiceSettings

TOKEN = "metrics-truth-token"


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, slab_bytes=64 << 20) as eng:
        yield eng


@pytest.fixture(scope="module")
def app(engine):
    state = ServiceState(ServiceSettings(api_token=TOKEN), default_registry(), NativeTransport(engine.info, timeout=30))
    with TestClient(build_api(state), base_url="http://rlplane.test",
                    headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        yield http


def series(http: TestClient, name: str) -> dict[str, float]:
    time.sleep(SCRAPE_TTL_S)  # (a scrape within the TTL of the last one gets its body)
    lines = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith(name + "{")]
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


def service(http: TestClient) -> ServiceAPI:
    """The app as a client's service (a connection of its own: a client closes its service's)."""
    return ServiceAPI(str(http.base_url), token=TOKEN, http=TestClient(http.app, base_url=str(http.base_url)))


def reporting(engine, http: TestClient) -> Client:
    """A direct client whose ops are reported to the app's /metrics."""
    return Client(default_registry(), NativeTransport(engine.info, timeout=30), service=service(http))


def tokens(n: int, width: int, **kw) -> dict:
    return {"input_ids": torch.ones(n, width, dtype=torch.int64), "input_lengths": torch.full((n,), width)}


def test_a_claim_that_finds_nothing_ready_is_an_answer_not_an_error(engine, app):
    """A healthy consumer polling with short timeouts counted every empty claim as an error:
    RlplaneErrorRatioHigh fired on a pipeline where nothing failed."""
    with reporting(engine, app) as direct:
        over_http = Client(default_registry(), HttpTransport(service(app)))
        for c in (direct, over_http):
            with pytest.raises(E.NotReadyError):
                c.claim("nothing-here", "train", batch_size=4, fields=["input_ids"], timeout=0)
        assert direct.ops.last("claim").error is None
        direct.report_ops()
    ops = series(app, "rlplane_ops_total")
    assert ops.get('rlplane_ops_total{op="claim",status="ok",transport="native"}') == 1.0
    assert ops.get('rlplane_ops_total{op="claim",status="ok",transport="http"}') == 1.0
    assert not any('op="claim",status="error"' in k for k in ops)


def test_an_extend_is_counted_as_one_directly_and_over_http_and_a_snapshot_moves_no_bytes_once(engine, app, tmp_path):
    """A direct client's extends never reached /metrics (an op the ledger did not know) and
    over HTTP counted as write_columns; a snapshot counted the whole store as bytes written,
    and one asked by a direct client through the service was counted twice."""
    with reporting(engine, app) as direct:
        over_http = Client(default_registry(), HttpTransport(service(app)))
        for c, p in ((direct, "ext-direct"), (over_http, "ext-http")):
            meta = c.put_samples(p, tokens(2, 4), finished=False)
            c.extend(meta, tokens(2, 3), finished=True)
        direct.snapshot(str(tmp_path / "snap"))
        direct.report_ops()
    ops = series(app, "rlplane_ops_total")
    assert ops.get('rlplane_ops_total{op="extend",status="ok",transport="native"}') == 1.0
    assert ops.get('rlplane_ops_total{op="extend",status="ok",transport="http"}') == 1.0
    assert not any('op="write_columns"' in k for k in ops)
    assert sum(v for k, v in ops.items() if 'op="snapshot"' in k) == 1.0
    moved = series(app, "rlplane_transferred_bytes_total")
    assert not any('op="snapshot"' in k for k in moved) and any('op="extend"' in k for k in moved)


def test_a_task_moving_in_and_out_of_the_labelled_top_never_makes_a_counter_fall():
    """The redeliveries of the tasks beyond the top were summed as (other): a task moving
    in and out of the top made that counter fall and rise, and increase() counted
    redeliveries that never happened."""
    def body(backlog: int) -> dict[str, float]:
        tasks = [{"partition": f"p{i}", "task": "t", "pending": 10, "claimed": 0, "acked": 0, "expired": 0,
                  "redelivered": 0} for i in range(TOP_LABELLED)]
        tasks.append({"partition": "big", "task": "t", "pending": backlog, "claimed": 0, "acked": 0, "expired": 0,
                      "redelivered": 1000})
        view = StoreView("native", {}, {}, {}, None, streams={"tasks": tasks, "wait_buckets": [], "wait_counts": []})
        lines = render({"ops": {}, "nbytes": {}, "errors": {}, "latency": {}}, view).decode().splitlines()
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
                if ln.startswith("rlplane_claim_redelivered_total{")}

    seen = [body(backlog) for backlog in (100, 0, 100)]  # in the top by backlog, out of it, in again
    for before, after in zip(seen, seen[1:]):
        assert all(after.get(k, v) >= v for k, v in before.items()), (before, after)
    assert all('partition="big"' in " ".join(s) for s in seen) and len(seen[0]) <= TOP_LABELLED


def test_a_scrape_answers_while_the_controller_is_down_and_says_so():
    """It answered 503 and every series vanished, the up gauges that should say what is down with them."""
    with LocalEngine(2, slab_bytes=32 << 20) as eng:
        up = {"controller": True}
        state = ServiceState(ServiceSettings(api_token=TOKEN), default_registry(), NativeTransport(eng.info, timeout=1),
                             transport_info=dict(eng.info), health=lambda: {**up, "u0": True, "u1": True})
        with TestClient(build_api(state), base_url="http://rlplane.test") as http:
            assert http.get("/metrics").status_code == 200
            eng.kill_controller()
            up["controller"] = False
            time.sleep(SCRAPE_TTL_S)
            got = http.get("/metrics")
            assert got.status_code == 200, got.text[:300]
            assert 'rlplane_component_up{component="controller"} 0.0' in got.text
            assert "rlplane_stored_samples" not in got.text  # (not known: not a store that went empty)


def test_a_direct_clients_ops_never_wait_for_a_service_that_does_not_answer(engine, monkeypatch):
    """Its ops reported themselves inline every few seconds: with the service hung (the store
    itself fine), every op then waited the service's whole timeout."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    held: list = []
    threading.Thread(target=lambda: [held.append(hung.accept()) for _ in range(8)], daemon=True).start()
    try:
        monkeypatch.setattr(client_module, "REPORT_EVERY_S", 0.01)  # (due at once)
        monkeypatch.setattr(client_module, "REPORT_TIMEOUT_S", 0.5)
        api = ServiceAPI(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout=3)
        c = Client(default_registry(), NativeTransport(engine.info, timeout=30), service=api)
        took = []
        for k in range(6):
            t0 = time.monotonic()
            c.put_samples("hung-service", tokens(2, 8), sample_ids=[f"h{k}a", f"h{k}b"])
            took.append(time.monotonic() - t0)
            time.sleep(0.3)
        assert max(took) < 1.5, took
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c._report_every <= 0.01:
            time.sleep(0.1)
        assert c._report_every > 0.01  # the failed report backs off, its ops kept for the next one
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < 3
        assert len(c.ops.drain()) >= 6
    finally:
        for conn, _ in held:
            conn.close()
        hung.close()
