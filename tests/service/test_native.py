"""The native engine for real: what only it can get wrong or must get right.

Concurrent puts of the same new ids, a writer killed between reserve and commit, a
storage unit killed under load, garbage and pickles sent to every data port, wrong
secrets. The round trips themselves run on every backend in test_service.py.
"""

import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import httpx
import pytest
import torch
import zmq

import rlplane
from rlplane import errors as E
from rlplane.channel import PLAIN_USER
from rlplane.transports.native import NativeTransport
from rlplane.wire import pack_message, unpack_message

TOKEN = "native-test-token"
UNIT_BYTES = 32 << 20  # each unit's slab: small, so a put can overflow it
ARGS = {"store_name": "nat", "backend": "native", "storage_units": 2, "put_lease_s": 2.0, "api_token": TOKEN,
        "te_protocol": "tcp", "unit_bytes": UNIT_BYTES, "te_port_min": 21000, "te_port_max": 21999}


def part() -> str:
    return f"n-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def nat(own_app):
    """An app of its own (a 2 s put lease, units this module may kill), at /nat."""
    with own_app(ARGS, "/nat") as url:
        yield url


def info(url: str) -> dict:
    r = httpx.get(f"{url}/v1/transport", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    return r.json()["native"]


def batch(n: int, value: int) -> dict:
    return {"input_ids": torch.full((n, 8), value, dtype=torch.int64), "input_lengths": torch.full((n,), 8)}


def test_a_put_over_http_that_does_not_fit_a_slab_is_507_naming_the_unit_and_keeps_nothing(nat):
    """The native store full, over the HTTP API: 507 with the typed error, the unit, its slab
    and what is free in the message; nothing of the put stored, what was stored reads on."""
    from rlplane.codec import encode
    from rlplane.envelope import pack

    headers = {"Authorization": f"Bearer {TOKEN}"}
    with rlplane.connect(nat, token=TOKEN, transport="http") as client:
        kept = client.put_samples(part(), batch(4, 9))
        big = {"input_ids": torch.ones(2, UNIT_BYTES // 8, dtype=torch.int64),
               "input_lengths": torch.full((2,), UNIT_BYTES // 8)}  # 64 MiB: more than either slab
        enc = encode(client.registry, big, big["input_lengths"], sample_ids=["x", "y"])
        body = pack({"sample_ids": ["x", "y"], "tags": list(enc.tags)}, enc.columns)
        p = part()
        r = httpx.post(f"{nat}/v1/data/{p}/put", content=body, headers=headers, timeout=60)
        assert r.status_code == 507 and r.json()["error"] == "StorageFullError", r.text
        msg = r.json()["message"]
        assert "storage unit" in msg and f"slab of {UNIT_BYTES} bytes" in msg and "free" in msg, msg
        assert p not in client.partitions()
        assert torch.equal(client.read_columns(kept, ["input_ids"])["input_ids"], batch(4, 9)["input_ids"])
        client.clear(kept.partition)


def test_the_units_transfer_engines_listen_in_the_configured_range(nat):
    with rlplane.connect(nat, token=TOKEN, transport="native", data_path="te") as client:
        ports = [int(r.peer.rpartition(":")[2]) for r in client.transport._remote.values()]
        assert len(ports) == 2 and all(21000 <= p <= 21999 for p in ports), ports
        meta = client.put_samples(part(), batch(4, 5))
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(4, 5)["input_ids"])
        client.clear(meta.partition)


def test_streaming_on_te_hands_each_sample_out_once_and_reads_it_bit_exact_over_the_engine(nat):
    """Two claimers on the transfer engine wait in claim while a producer (te too) writes:
    each sample once to one of them, its rows read back one-sided bit for bit, every ack
    counted."""
    p, written, got, failed = part(), {}, {}, []

    def claimer(c) -> None:
        try:
            while True:
                try:
                    meta = c.claim(p, "train", batch_size=4, fields=["input_ids"], timeout=4)
                except E.NotReadyError:
                    return
                rows = c.read_columns(meta, ["input_ids"])["input_ids"]
                got.update((s, (rows[i], got.get(s, (None, 0))[1] + 1)) for i, s in enumerate(meta.sample_ids))
                c.ack(meta, "train")
        except Exception as err:  # noqa: BLE001 - asserted below
            failed.append(err)

    clients = [rlplane.connect(nat, token=TOKEN, transport="native", data_path="te") for _ in range(3)]
    try:
        assert all(set(c.transport.paths().values()) == {"te"} for c in clients)
        threads = [threading.Thread(target=claimer, args=(c,)) for c in clients[1:]]
        for t in threads:
            t.start()  # they wait: nothing is there yet
        g = torch.Generator().manual_seed(22)
        for k in range(6):
            data = {"input_ids": torch.randint(0, 10**9, (4, 8), generator=g), "input_lengths": torch.full((4,), 8)}
            meta = clients[0].put_samples(p, data)
            written.update(zip(meta.sample_ids, data["input_ids"]))
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=60)
        assert not failed and not any(t.is_alive() for t in threads), failed
        assert sorted(got) == sorted(written) and all(n == 1 for _, n in got.values())
        assert all(torch.equal(got[s][0], row) for s, row in written.items())
        assert clients[0].consumption(p, "train")["acked"] == len(written) == 24
        clients[0].clear(p)
    finally:
        for c in clients:
            c.close()


def test_status_and_metrics_report_each_units_slab_as_puts_fill_and_clears_empty_it(nat):
    """/v1/status' memory (per unit: slab, used, free bytes) moves by at least what a put
    stored and back after its clear, and /metrics' rlplane_storage_unit_slab_bytes says the
    same numbers."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {TOKEN}"}

    def memory() -> dict:
        return httpx.get(f"{nat}/v1/status", headers=headers, timeout=30).json()["memory"]

    def gauges() -> dict:
        text = httpx.get(f"{nat}/metrics", headers=headers, timeout=30).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        return {(s.labels["unit"], s.labels["state"]): s.value for s in fams["rlplane_storage_unit_slab_bytes"].samples}

    def used() -> int:
        return sum(d["used_bytes"] for d in memory().values())

    def settles(ok, what: str) -> None:  # the units report their slabs with the controller's pings (seconds)
        deadline = time.monotonic() + 20
        while not ok():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    with rlplane.connect(nat, token=TOKEN) as client:
        def stored() -> int:  # what the controller knows the units hold (at once; the slab figures come with pings)
            return sum(d["bytes"] for d in client.transport.stats()["units"].values())

        settles(lambda: used() == stored(), "the slabs' figures never caught up with an earlier test's frees")
        before = used()
        mem = memory()
        assert len(mem) == 2 and all(d["slab_bytes"] == UNIT_BYTES for d in mem.values()), mem
        work = {"input_ids": torch.ones(64, 4096, dtype=torch.int64), "input_lengths": torch.full((64,), 4096)}
        meta = client.put_samples(part(), work)  # 2 MiB of rows
        settles(lambda: used() - before >= 64 * 4096 * 8, f"used bytes never grew by the put's (from {before})")
        for d in memory().values():
            assert d["used_bytes"] + d["free_bytes"] == d["slab_bytes"] and 0.0 <= d["fragmentation"] <= 1.0, d

        def same() -> bool:
            want = {(u, state): float(d[key]) for u, d in memory().items()
                    for state, key in (("total", "slab_bytes"), ("used", "used_bytes"), ("free", "free_bytes"))}
            return gauges() == want

        settles(same, "/metrics' slab gauges never said what /v1/status says")
        client.clear(meta.partition)
        settles(lambda: used() == before, "a clear did not give the put's extents back")


def test_concurrent_puts_of_the_same_new_ids_have_exactly_one_winner(nat):
    clients = [rlplane.connect(nat, token=TOKEN, transport="native") for _ in range(8)]
    try:
        for rep in range(20):
            p, ids = part(), [f"s{i}" for i in range(16)]
            barrier = threading.Barrier(8)
            outcome: dict[int, object] = {}

            def put(k: int) -> None:
                barrier.wait(timeout=30)
                try:
                    clients[k].put_samples(p, batch(16, k), sample_ids=ids)
                    outcome[k] = "ok"
                except E.DuplicateSampleError as err:
                    outcome[k] = err

            threads = [threading.Thread(target=put, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            winners = [k for k, v in outcome.items() if v == "ok"]
            assert len(outcome) == 8 and len(winners) == 1, (rep, outcome)
            meta = rlplane.SampleMeta(p, ids, [8] * 16)
            got = clients[0].read_columns(meta, ["input_ids"])["input_ids"]
            assert torch.equal(got, batch(16, winners[0])["input_ids"]), "rows of a loser mixed in"
            assert clients[0].clear(p) == 16
    finally:
        for c in clients:
            c.close()


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch, rlplane
    from rlplane.transports import native
    from rlplane.transports.native import NativeTransport
    url, token, partition = sys.argv[1:4]
    native.ONE_MESSAGE_BYTES = 0  # reserve, write, commit (a small put in one message has no "between")
    original = NativeTransport._land_blocks
    def write_then_hang(self, *args, **kwargs):
        out = original(self, *args, **kwargs)   # the bytes are in the units' extents (shm: copied by this process)...
        time.sleep(0.5)                         # ...the reservation is in too...
        print("reserved", flush=True)
        time.sleep(600)                         # ...but the commit never comes
    NativeTransport._land_blocks = write_then_hang
    client = rlplane.connect(url, token=token, transport="native")
    client.put_samples(partition, {"input_ids": torch.ones(4, 8, dtype=torch.int64),
                                   "input_lengths": torch.full((4,), 8)}, sample_ids=["a", "b", "c", "d"])
    """
)


@pytest.mark.parametrize("path", ["shm", "te", "zmq"])
def test_a_writer_killed_between_reserve_and_commit_leaves_nothing_and_its_retry_succeeds(nat, path):
    """SIGKILL after the bytes are in the units' extents, before the commit: nothing is
    visible, the ids and the extents are given back once the reservation lapses."""
    p = part()
    with rlplane.connect(nat, token=TOKEN, transport="native") as client:
        used_before = slab_used(client)
    env = {**os.environ, "RLPLANE_DATA_PATH": path}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, nat, TOKEN, p], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "reserved"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with rlplane.connect(nat, token=TOKEN, transport="native") as client:
        assert p not in client.partitions()
        with pytest.raises(E.MissingDataError):
            client.read_columns(rlplane.SampleMeta(p, ["a"], [8]), ["input_ids"])
        deadline = time.monotonic() + ARGS["put_lease_s"] + 10
        while True:  # refused while the dead writer's reservation holds, then accepted
            try:
                meta = client.put_samples(p, batch(4, 7), sample_ids=["a", "b", "c", "d"])
                break
            except E.DuplicateSampleError as err:
                assert "being written by another put" in str(err)
                assert time.monotonic() < deadline, "the dead writer's reservation never lapsed"
                time.sleep(0.2)
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(4, 7)["input_ids"])
        stats = client.transport.stats()
        assert stats["reservations"] == 0
        client.clear(p)
        deadline = time.monotonic() + 15  # the units' slab figures come with the controller's pings (1 s)
        while slab_used(client) > used_before:  # (the dead writer's extents: out of use a while, then back)
            assert time.monotonic() < deadline, f"extents not given back: {slab_used(client)} != {used_before}"
            time.sleep(0.2)


def slab_used(client) -> int:
    """Bytes allocated in every unit's slab and in use, as the controller last heard from
    the units (not those kept out of use a while: a dead writer's, LAPSED_FREE_S)."""
    deadline = time.monotonic() + 10  # (a store just started: the controller's first pings come within a second)
    units = client.transport.stats()["units"]
    while not all("slab" in u for u in units.values()):
        assert time.monotonic() < deadline, units
        time.sleep(0.2)
        units = client.transport.stats()["units"]
    return sum(u["slab"]["used_bytes"] - u["slab"].get("late_bytes", 0) for u in units.values())


def test_a_wrong_or_missing_secret_is_an_authentication_error_at_once(nat):
    good = info(nat)
    for secret in ("wrong", None):
        start = time.monotonic()
        with pytest.raises(E.AuthenticationError):
            NativeTransport({**good, "secret": secret})
        assert time.monotonic() - start < 5
    with pytest.raises(E.AuthenticationError):
        rlplane.connect(nat, token="wrong", transport="native")


class Evil:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_garbage_and_pickles_sent_to_every_data_port_execute_nothing(nat, tmp_path):
    good = info(nat)
    endpoints = [good["controller"]] + [ep for _, ep in good["units"]]
    marker = tmp_path / "executed"
    payload = pickle.dumps(Evil(str(marker)))
    bodies = [[payload], [b"", payload], [b"TQ_STORAGE_x", b"\x00pickle", payload], [b"\xff" * 64], [os.urandom(4096)],
              pack_message({"op": "__init__"}), pack_message({"op": "write", "b": "x"})]
    ctx = zmq.Context.instance()
    for ep in endpoints:
        for secret in (good["secret"].encode(), None):  # authenticated peers get an error; others not even that
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if secret is not None:
                sock.plain_username, sock.plain_password = PLAIN_USER, secret
            sock.connect(ep)
            for body in bodies:
                if secret is None:
                    time.sleep(0.2)  # give the handshake its chance to fail
                try:
                    sock.send_multipart(body, flags=zmq.NOBLOCK)
                except zmq.Again:  # no authenticated peer to queue the message for: fine
                    assert secret is None
                    continue
                if secret is not None:
                    assert sock.poll(5000), f"{ep} stopped answering after {body[:1]!r}"
                    reply = unpack_message(sock.recv_multipart())[0]
                    assert reply["ok"] is False and reply["error"]["error"] == "WireFormatError"
                else:
                    assert not sock.poll(300), f"{ep} answered a peer without the secret"
            sock.close()
    time.sleep(0.5)
    assert not marker.exists(), "a pickle sent to a data port was executed"
    with rlplane.connect(nat, token=TOKEN, transport="native") as client:  # and every port still serves
        p = part()
        meta = client.put_samples(p, batch(64, 3))
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(64, 3)["input_ids"])
        client.clear(p)


def test_a_killed_unit_loses_only_its_samples_named_within_seconds_and_readyz_names_it(nat, readyz):
    """Last in this module: it leaves the app without one of its units. With one copy of
    each block (RLPLANE_REPLICAS=1), the samples whose only copy was there are lost: a
    read of them is a MissingDataError naming them and the unit within 10 s, they leave
    the listings and the counts; everything else reads, and puts go to the live unit."""
    import ray

    with rlplane.connect(nat, token=TOKEN, transport="native") as client:
        metas = [client.put_samples(part(), batch(4, k)) for k in range(4)]  # round-robin over both units
        unit = ray.get_actor("nat-native-unit-1", namespace="rlplane")
        endpoint = dict(info(nat)["units"])["nat-native-unit-1"]
        ray.kill(unit, no_restart=True)  # asynchronous: wait until its port is closed
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                time.sleep(0.1)
            except OSError:
                break
        else:
            pytest.fail("the killed unit's port still accepts connections after 30 s")
        # A same-host reader still maps the dead unit's slab (the memory lives while any
        # process maps it), so a read may be served from there until the controller has
        # declared the loss: it does so within seconds, and from then on the rows are lost.
        killed = time.monotonic()
        while "nat-native-unit-1" not in client.transport.stats()["lost_units"]:
            assert time.monotonic() - killed < 10, "the controller did not declare the killed unit lost"
            time.sleep(0.1)
        lost = []
        for k, meta in enumerate(metas):
            start = time.monotonic()
            try:
                got = client.read_columns(meta, ["input_ids"])
                assert torch.equal(got["input_ids"], batch(4, k)["input_ids"])
            except E.MissingDataError as err:
                lost.append(meta.partition)
                assert "nat-native-unit-1" in str(err) and "lost" in str(err)
                assert set(err.missing) == set(meta.sample_ids)
            assert time.monotonic() - start < 10
        assert len(lost) == 2
        listed = set(client.partitions())
        assert not listed & set(lost) and {m.partition for m in metas} - set(lost) <= listed
        stats = client.transport.stats()
        assert stats["lost_units"] == ["nat-native-unit-1"] and stats["lost_samples"] >= 8  # (+ earlier tests' samples)
        for k in range(4):  # puts: placed on the live unit, all succeed, each within seconds
            start = time.monotonic()
            meta = client.put_samples(part(), batch(4, k))
            assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(4, k)["input_ids"])
            assert time.monotonic() - start < 10
    r = readyz(nat, lambda r: r.status_code == 503)
    assert r.status_code == 503 and r.json()["components"]["nat-native-unit-1"] is False
    assert "nat-native-unit-1" in r.json()["reason"]
    from scraping import scrape_text

    metrics = scrape_text(nat)
    assert f"rlplane_lost_samples {float(stats['lost_samples'])}" in metrics
