"""Where an op's time went: the client splits each op into waiting on the store, codec and
the rest of its own work (rlplane.opstats), and the bench reports that split beside every
target it misses."""

from __future__ import annotations

import time

import pytest
import rlplane
import torch
from rlplane.opstats import ENGINE, PARTS, OpStats, add_engine, add_wait
from rlplane_tools.bench.report import parts_table, parts_text
from rlplane_tools.bench.targets import evaluate


def test_an_ops_parts_split_its_wall_time_into_waiting_codec_and_the_rest():
    stats = OpStats("native")
    with stats.timed("put_samples") as op:
        t0 = time.perf_counter()
        with op.part("codec"):
            time.sleep(0.02)
            add_wait(0.015)  # a round trip inside the encode (a staged extent) is the store's, not the codec's
        block = time.perf_counter() - t0
        time.sleep(0.01)
        add_wait(0.005)
    event = stats.last("put_samples")
    parts = event.parts
    assert list(parts) == list(PARTS)
    assert parts["wait"] == pytest.approx(0.02)
    assert parts["codec"] == pytest.approx(block - 0.015, abs=1e-3) and parts["codec"] > 0.004
    assert parts["client"] == pytest.approx(event.seconds - block - 0.005, abs=1e-3) and parts["client"] > 0.004
    assert sum(parts.values()) == pytest.approx(event.seconds) and ENGINE not in parts


def test_waits_of_other_threads_and_of_ops_before_are_not_counted():
    stats = OpStats("native")
    add_wait(1.0)  # before the op
    with stats.timed("read_columns"):
        import threading

        th = threading.Thread(target=add_wait, args=(5.0,))
        th.start()
        th.join()
    assert stats.last("read_columns").parts["wait"] == 0.0


def test_the_summary_gives_each_parts_median_and_a_failed_op_still_has_its_parts():
    stats = OpStats("native")
    for wait in (0.001, 0.002, 0.003):
        with stats.timed("read_columns"):
            add_wait(wait)
    with pytest.raises(ValueError):
        with stats.timed("read_columns"):
            add_wait(0.004)
            raise ValueError("boom")
    summary = stats.summary()["read_columns"]
    assert set(summary["parts_p50_s"]) == set(PARTS)
    assert summary["parts_p50_s"]["wait"] == pytest.approx(0.0025)
    assert stats.last("read_columns").error == "ValueError" and stats.last("read_columns").parts["wait"] == pytest.approx(0.004)
    assert stats.last("put_samples") is None


def test_the_engines_share_is_what_its_answers_said_and_never_more_than_the_wait():
    stats = OpStats("native")
    with stats.timed("put_samples"):
        add_wait(0.01)
        add_engine(0.004)
        add_engine(0.003)  # two requests' answers
    assert stats.last("put_samples").parts[ENGINE] == pytest.approx(0.007)
    with stats.timed("put_samples"):  # requests in flight at once: their times overlap the one wait
        add_wait(0.01)
        add_engine(0.008)
        add_engine(0.008)
    assert stats.last("put_samples").parts[ENGINE] == pytest.approx(0.01)
    assert list(stats.summary()["put_samples"]["parts_p50_s"]) == [*PARTS, ENGINE]
    with stats.timed("put_samples"):  # no answer said it (an HTTP or TransferQueue transport)
        add_wait(0.01)
    assert ENGINE not in stats.last("put_samples").parts
    assert list(stats.summary()["put_samples"]["parts_p50_s"]) == list(PARTS)  # not every op told it


def test_a_servers_answer_says_how_long_it_took_over_the_request():
    from rlplane.channel import Channel
    from rlplane_service.native.server import Server

    class Handler:
        def op_slow(self, header, columns, extra):
            time.sleep(0.05)
            return {}, {}, []

    server = Server(Handler(), name="took").start()
    try:
        ch = Channel(server.endpoint, "took")
        stats = OpStats("native")
        with stats.timed("read_columns"):
            t0 = time.monotonic()
            reply = ch.call({"op": "slow"}, timeout=10)[0]
            wall = time.monotonic() - t0
        assert "took" not in reply  # (the channel takes it: callers get the answer, not its timing)
        parts = stats.last("read_columns").parts
        assert 0.05 <= parts[ENGINE] <= parts["wait"] <= wall
        ch.close()
    finally:
        server.stop()


def test_a_native_put_and_read_say_what_they_waited_for_and_what_the_codec_took():
    from rlplane.transports.native import NativeTransport
    from rlplane_service.native.local import LocalEngine

    lens = torch.tensor([5, 7])
    fields = {"input_ids": torch.arange(14).reshape(2, 7), "input_lengths": lens}
    with LocalEngine(units=1, slab_bytes=8 << 20) as eng:
        client = rlplane.Client(rlplane.default_registry(), NativeTransport(eng.info, timeout=10))
        meta = client.put_samples("p", fields)
        client.read_columns(meta, ["input_ids"])
        for op in ("put_samples", "read_columns"):
            event = client.ops.last(op)
            assert event.parts["wait"] > 0 and event.parts["codec"] > 0, (op, event.parts)
            assert 0 < event.parts[ENGINE] <= event.parts["wait"]  # the controller's (and its units') time
            assert sum(event.parts[k] for k in PARTS) == pytest.approx(event.seconds)
        client.close()


def _results(native_put_ms: float, parts: dict[str, float] | None) -> dict:
    row = {"p50_ms": native_put_ms, "p99_ms": native_put_ms, "min_ms": 1.0, "max_ms": 9.0, "ops": 3}
    ray = {"p50_ms": 2.0, "p99_ms": 2.0, "min_ms": 2.0, "max_ms": 2.0, "ops": 3}
    return {"workloads": [], "sweeps": {}, "latency": {"workload": "small", "batch": 8, "paths": [
        {"path": "rlplane-native", "label": "rlplane (native, shm)",
         "put": {**row, "parts_ms": parts}, "get": {**row, "parts_ms": parts}},
        {"path": "ray-object-store", "label": "Ray object store", "put": ray, "get": ray}]}}


def test_a_missed_target_says_where_the_time_went_and_a_met_one_does_not():
    parts = {"wait": 2.5, "codec": 0.75, "client": 1.25}
    missed = {t["name"]: t for t in evaluate(_results(4.5, parts))}
    put = missed["small: native put p50 <= Ray object store p50 + 0 ms"]
    assert put["met"] is False
    assert put["where"] == "put: waited on the store 2.50 + codec 0.75 + client 1.25 ms"
    met = {t["name"]: t for t in evaluate(_results(1.5, parts))}
    assert met["small: native put p50 <= Ray object store p50 + 0 ms"]["met"] is True
    assert "where" not in met["small: native put p50 <= Ray object store p50 + 0 ms"]
    untold = {t["name"]: t for t in evaluate(_results(4.5, None))}  # a path that cannot tell: no guess
    assert "where" not in untold["small: native put p50 <= Ray object store p50 + 0 ms"]
    assert parts_text(None) is None


def test_the_parts_table_lists_the_rows_that_told_their_parts():
    table = parts_table(_results(4.5, {"wait": 2.5, "codec": 0.75, "client": 1.25}))
    assert table is not None and table.row_count == 2  # native put and get; Ray's rows told nothing
    assert parts_table(_results(4.5, None)) is None
