"""The transfer-engine data path (Mooncake's engine over TCP on loopback, no Ray): the
staging windows, who may learn a unit's engine address, the choice of path, and a unit
killed under it."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.te import TransferPool, open_engine, register
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step
from rlplane.transports import native
from rlplane.transports.native import NativeTransport, TeOptions
from rlplane_service.native.local import LocalEngine
from rlplane_service.native.unit import UnitCore

SECRET = b"te-path-secret"


@pytest.fixture(scope="module")
def peer():
    """A bare engine with 1 MiB registered: what a unit's slab is to a client's pool."""
    engine = open_engine("127.0.0.1", "tcp")
    memory = np.zeros(1 << 20, np.uint8)
    register(engine, memory.ctypes.data, memory.size, "the test's memory")
    return {"engine": engine, "memory": memory, "name": f"127.0.0.1:{engine.get_rpc_port()}"}


@pytest.fixture(scope="module", params=["staged", "direct"])
def pool(request):
    """``staged`` (how RDMA moves): through 12 kB of staging, so most moves take several
    batches; ``direct`` (TCP's default): the caller's buffers registered for the transfer."""
    return TransferPool("tcp", hostname="127.0.0.1", staging_bytes=3 * 4096, direct=request.param == "direct")


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_writes_and_scattered_reads_are_bit_exact_staged_and_direct(peer, pool, sizes, seed):
    rng = np.random.default_rng(seed)
    memory, base = peer["memory"], peer["memory"].ctypes.data
    memory[:] = 0
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    at = np.cumsum([0] + [n + 3 for n in sizes[:-1]]).astype(np.int64)  # gaps between the extents
    pool.write(peer["name"], "peer", [(s, base + int(a)) for s, a in zip(srcs, at)])
    for s, a in zip(srcs, at.tolist()):
        assert np.array_equal(memory[a : a + s.size], s)
    # Read them back in a random order into two buffers, each at random places.
    order = rng.permutation(len(sizes))
    lens = np.array(sizes, np.int64)[order]
    which = rng.integers(0, 2, order.size)
    dsts = [np.zeros(int(lens.sum()) + 10, np.uint8) for _ in range(2)]
    dst_at = np.zeros(order.size, np.int64)
    for d in (0, 1):
        mine = np.flatnonzero(which == d)
        dst_at[mine] = np.cumsum(lens[mine]) - lens[mine]
    pool.read(peer["name"], "peer", at[order] + base, lens, dsts, which, dst_at)
    for k, i in enumerate(order.tolist()):
        a = int(dst_at[k])
        assert np.array_equal(dsts[which[k]][a : a + sizes[i]], srcs[i])


def test_a_transfer_to_a_peer_that_is_gone_is_unavailable_naming_the_unit(pool):
    with pytest.raises(E.UnavailableError) as err:
        pool.read("127.0.0.1:1", "unit-7", np.array([0], np.int64), np.array([16], np.int64),
                  [np.zeros(16, np.uint8)], np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert err.value.component == "unit-7" and "died" in str(err.value)


def test_only_full_access_learns_where_a_units_slab_is_on_the_engine():
    from rlplane_service.native.unit import TransferEngineConfig

    unit = UnitCore("u-te", 16 << 20, share=False, te=TransferEngineConfig("127.0.0.1", "tcp"))
    try:
        got = unit.op_te({"_user": None}, {}, [])[0]
        assert got["bytes"] == unit.slab.nbytes and got["protocol"] == "tcp" and got["peer"].startswith("127.0.0.1:")
        assert got["base"] == unit.slab.u8.ctypes.data
        with pytest.raises(E.ForbiddenError):
            unit.op_te({"_user": "tenant-a"}, {}, [])
    finally:
        unit.stop()
    plain = UnitCore("u-plain", 16 << 20, share=False)
    with pytest.raises(E.InvalidArgumentError, match="RLPLANE_TE_PROTOCOL"):
        plain.op_te({"_user": None}, {}, [])


def test_data_path_te_needs_every_unit_on_the_engine_and_says_what_to_set():
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20) as eng:
        with pytest.raises(E.TransportError) as err:
            NativeTransport(eng.info, timeout=10, data_path="te")
        assert "RLPLANE_TE_PROTOCOL" in str(err.value) and "data_path='auto'" in str(err.value)
        t = NativeTransport(eng.info, timeout=10)  # auto: the slabs are on this host
        assert set(t.paths().values()) == {"shm"}
        t.close()


def test_memory_of_a_failed_transfer_is_never_freed_reused_or_unregistered(peer, monkeypatch):
    """A transfer the engine failed (a peer that stalled) may still be moving bytes when the
    peer comes back: the caller's registered buffers are kept alive and registered, and a
    staging buffer is set aside for a new one, so no later use of that memory sees them."""
    for direct in (True, False):
        pool = TransferPool("tcp", hostname="127.0.0.1", staging_bytes=3 * 4096, direct=direct)
        base = peer["memory"].ctypes.data
        src = np.arange(5000, dtype=np.uint8)
        pool._staging()  # (made at its first use)
        stage, unregistered = pool._mm, []
        monkeypatch.setattr(pool, "engine", _Failing(pool.engine, unregistered))
        with pytest.raises(E.UnavailableError, match="did not take a write"):
            pool.write(peer["name"], "peer", [(src, base)])
        if direct:
            assert pool.quarantined == [[src]] and unregistered == [] and pool._mm is stage
        else:
            assert pool.quarantined == [stage] and pool._mm is not stage
        monkeypatch.undo()
        again = np.full(5000, 7, np.uint8)  # the pool works on, with memory of its own
        pool.write(peer["name"], "peer", [(again, base)])
        assert np.array_equal(peer["memory"][:5000], again)


def test_a_quarantine_that_reached_its_cap_stops_transfers_with_a_typed_error(peer, monkeypatch):
    """Failed transfers' memory is kept, but not without bound: once the quarantine holds
    MAX_QUARANTINE_BYTES, the pool moves nothing more and says why and what to do."""
    import rlplane.te as te

    monkeypatch.setattr(te, "MAX_QUARANTINE_BYTES", 8000)
    pool = TransferPool("tcp", hostname="127.0.0.1", staging_bytes=3 * 4096, direct=True)
    base = peer["memory"].ctypes.data
    with monkeypatch.context() as m:
        m.setattr(pool, "engine", _Failing(pool.engine, []))
        for k in range(2):
            with pytest.raises(E.UnavailableError, match="did not take a write"):
                pool.write(peer["name"], "peer", [(np.full(5000, k, np.uint8), base)])
    assert pool.quarantined_bytes == 10000
    before = peer["memory"][:5000].copy()
    with pytest.raises(E.TransportError, match="data_path='zmq'") as err:
        pool.write(peer["name"], "peer", [(np.full(5000, 9, np.uint8), base)])
    assert not isinstance(err.value, E.UnavailableError)  # (no unit is to blame: the client stops)
    with pytest.raises(E.TransportError, match="MiB of memory from failed"):
        pool.read(peer["name"], "peer", np.array([base]), np.array([16]), [np.zeros(16, np.uint8)], np.array([0]),
                  np.array([0]))
    assert np.array_equal(peer["memory"][:5000], before)


class _Failing:
    """An engine whose writes fail (as a stalled peer's do) and whose unregisters are counted."""

    def __init__(self, engine, unregistered):
        self._engine, self._unregistered = engine, unregistered

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_transfer_sync_write(self, *args):
        return -1

    def unregister_memory(self, addr):
        self._unregistered.append(addr)
        return self._engine.unregister_memory(addr)


def test_auto_reaches_units_it_cannot_map_over_the_engine(monkeypatch):
    """A unit on another host cannot be mapped (its socket is in another network
    namespace); auto then takes the engine, and the bytes round-trip bit for bit."""
    def elsewhere(*args, **kwargs):
        raise E.TransportError("no such socket on this host")

    monkeypatch.setattr(native, "shared_slab", elsewhere)
    with LocalEngine(2, secret=SECRET, slab_bytes=64 << 20, te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=20)) as client:
            assert set(client.transport.paths().values()) == {"te"}
            w = text_step(16, 128, seed=3)
            meta = client.put_samples("auto-te", w.fields)
            for copy in (True, False):  # no zero-copy views of a slab that is not mapped: copies
                got = client.read_columns(meta, list(w.fields), copy=copy)
                assert diff_fields(client.registry, w.fields, got, w.lengths) == []


def test_te_options_come_from_the_environment_and_a_bad_size_is_refused():
    opts = TeOptions.from_env({"RLPLANE_TE_STAGING_BYTES": str(8 << 20), "RLPLANE_TE_HOSTNAME": "10.1.2.3"})
    assert (opts.staging_bytes, opts.hostname, opts.devices) == (8 << 20, "10.1.2.3", "")
    for bad in ("lots", "1024"):
        with pytest.raises(E.InvalidArgumentError, match="RLPLANE_TE_STAGING_BYTES"):
            TeOptions.from_env({"RLPLANE_TE_STAGING_BYTES": bad})


def test_a_unit_killed_under_the_te_path_loses_nothing_with_two_copies():
    """SIGKILL of a unit's process takes its engine with it: the next read is served from
    the other copy and the next put goes around the dead unit, within seconds."""
    import time

    with LocalEngine(3, secret=SECRET, slab_bytes=64 << 20, processes=True, replicas=2, grace_s=3600,
                     te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=20, data_path="te")) as client:
            assert set(client.transport.paths().values()) == {"te"}
            w = vlm_step(6, 256, seed=5)
            metas = [client.put_samples(f"kill-{k}", w.fields) for k in range(3)]
            eng.kill_unit(0)
            t0 = time.monotonic()
            for m in metas:
                got = client.read_columns(m, list(w.fields))
                assert diff_fields(client.registry, w.fields, got, w.lengths) == []
            after = client.put_samples("after", w.fields)
            took = time.monotonic() - t0
            assert took < 10.0, f"reads and a put after a unit died took {took:.1f} s"
            assert diff_fields(client.registry, w.fields, client.read_columns(after, list(w.fields)), w.lengths) == []
            assert 0 in client.transport.down
            assert eng.core.stats()["lost_samples"] == 0
            assert torch.equal(client.read_columns(metas[0], ["input_ids"])["input_ids"].long(),
                               client.read_columns(after, ["input_ids"])["input_ids"].long())


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal takes effect when its threads
    next run; until then one of them may still answer a request)."""
    import os
    import signal
    import time

    import psutil

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_unit_that_dies_or_stops_answering_mid_read_leaves_the_read_to_the_other_copy(monkeypatch, how):
    """The unit's process is SIGKILLed, or SIGSTOPped (its sockets stay open: nothing
    refuses a connection), after the locate named it and before the bytes came: the
    transfer fails (a stopped engine's within rlplane.te.STALL_S), the unit is named down,
    and the read completes from the other copy, bit for bit, well within 10 s. (Before the
    quarantine of a failed transfer's memory, a stopped unit that resumed wrote into the
    reader's freed buffers: the test process died of heap corruption.)"""
    import time

    import rlplane.te as te

    with LocalEngine(2, secret=SECRET, slab_bytes=64 << 20, processes=True, replicas=2, grace_s=3600,
                     te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=30, data_path="te")) as client:
            w = vlm_step(6, 256, seed=9)
            meta = client.put_samples(f"mid-read-{how}", w.fields)
            victim = client.transport._remote[0].peer
            original, hit = te.TransferPool.read, []

            def read_after(self, peer, *args, **kwargs):
                if peer == victim and not hit:  # between the locate and the transfer of unit 0's rows
                    if how == "killed":
                        eng.kill_unit(0)
                    else:
                        stop(eng.unit_pid(0))
                    hit.append(time.monotonic())
                return original(self, peer, *args, **kwargs)

            monkeypatch.setattr(te.TransferPool, "read", read_after)
            got = client.read_columns(meta, list(w.fields))
            assert hit, "no read went to unit 0"
            took = time.monotonic() - hit[0]
            assert took < 10.0, f"the read waited {took:.1f} s on a unit that {how}"
            assert diff_fields(client.registry, w.fields, got, w.lengths) == []
            assert 0 in client.transport.down


def test_the_engine_hands_a_units_slab_to_any_peer_that_reaches_its_port():
    """The trust boundary is the network, as the README's Security section says: a stranger
    engine with no credential learns a unit's slab address from the handshake and reads
    its bytes. (Should a Mooncake release authenticate peers, this fails: update the
    README, the chart's NetworkPolicy comment and the tenants refusal.)"""
    with LocalEngine(1, secret=SECRET, slab_bytes=16 << 20, te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=20, data_path="te")) as client:
            slab = client.transport._remote[0]
            w = text_step(4, 64, seed=2)
            client.put_samples("private", w.fields)
            stranger = open_engine("127.0.0.1", "tcp")
            assert stranger.get_first_buffer_address(slab.peer) == slab.base
            out = np.zeros(1 << 20, np.uint8)
            register(stranger, out.ctypes.data, out.size, "the stranger's memory")
            assert stranger.transfer_sync_read(slab.peer, out.ctypes.data, slab.base, out.size) == 0
            ids = w.fields["input_ids"][0, :8].numpy().tobytes()
            assert ids in out.tobytes()  # a sample's tokens, read without any secret


def test_a_service_with_tenants_refuses_the_transfer_engine(tmp_path):
    from rlplane_service.settings import ServiceSettings

    tokens = tmp_path / "tokens.json"
    tokens.write_text("{}")
    with pytest.raises(ValueError, match="tenants would not be kept apart"):
        ServiceSettings(te_protocol="tcp", tokens_file=tokens)
    assert ServiceSettings(tokens_file=tokens).te_protocol == ""


@pytest.mark.parametrize("lo, hi", [(15000, 0), (0, 17000), (100, 200), (17000, 15000), (20000, 20000)])
def test_a_transfer_engine_port_range_must_be_whole_and_above_1023(lo, hi):
    from rlplane_service.settings import ServiceSettings

    with pytest.raises(ValueError, match="RLPLANE_TE_PORT_MIN/MAX"):
        ServiceSettings(te_protocol="tcp", te_port_min=lo, te_port_max=hi)
    assert ServiceSettings(te_protocol="tcp", te_port_min=15000, te_port_max=15099).te_ports() == (15000, 15099)


def test_a_client_with_a_wrong_secret_learns_no_engine_address():
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, te_protocol="tcp") as eng:
        asked = []
        with pytest.raises(E.AuthenticationError):
            t = NativeTransport({**eng.info, "secret": "not-the-secret"}, timeout=10, data_path="te")
            asked.append(t.paths())
        assert not asked
        from rlplane.channel import Channel

        ch = Channel(eng.units[0].endpoint, "u0", secret=b"not-the-secret", connect_timeout=3)
        try:
            with pytest.raises((E.AuthenticationError, E.UnavailableError)):
                ch.call({"op": "te"}, timeout=5)
        finally:
            ch.close()


def test_units_on_a_second_loopback_host_are_read_and_written_over_the_engine():
    """127.0.0.2 stands for a second node: its units' engines advertise it, a client
    forced onto te reaches them there, bit for bit, two copies on the two hosts."""
    hosts = ["127.0.0.1", "127.0.0.2"]
    with LocalEngine(2, secret=SECRET, slab_bytes=64 << 20, hosts=hosts, replicas=2, te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=20, data_path="te")) as client:
            assert [client.transport._remote[u].peer.rpartition(":")[0] for u in (0, 1)] == hosts
            w = vlm_step(8, 256, seed=13)
            meta = client.put_samples("two-hosts", w.fields)
            assert all(len(units) == 2 for units in eng.core._block_units.values())
            got = client.read_columns(meta, list(w.fields))
            assert diff_fields(client.registry, w.fields, got, w.lengths) == []


def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil

    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN)


def test_a_units_listeners_are_on_its_address_and_only_the_engines_two_are_on_every_interface():
    """rlplane's own sockets bind the unit's address. The transfer engine's two (its
    handshake and its TCP data port) bind every interface whatever MC_TCP_BIND_ADDRESS
    says (the installed wheel): exactly those two, none without the engine, and, with a
    port range (RLPLANE_TE_PORT_MIN/MAX, what the chart's NetworkPolicy opens), in it."""
    import random

    lo = random.randrange(20000, 30000)
    for protocol, pinned in (("", None), ("tcp", None), ("tcp", (lo, lo + 9))):
        with LocalEngine(1, secret=SECRET, slab_bytes=16 << 20, processes=True, te_protocol=protocol,
                         te_ports=pinned) as eng:
            ports = _listening(eng.unit_pid(0))
            wild = [(ip, port) for ip, port in ports if ip not in ("127.0.0.1",)]
            assert all(ip in ("0.0.0.0", "::") for ip, _ in wild), ports
            if not protocol:
                assert wild == [] and len(ports) == 2, ports  # the data and the control socket
                continue
            t = NativeTransport(eng.info, timeout=10, data_path="te")
            peer_port = int(t._remote[0].peer.rpartition(":")[2])
            t.close()
            assert len(wild) == 2 and peer_port in {port for _, port in wild}, (ports, peer_port)
            a, z = pinned or (15000, 17000)
            assert all(a <= port <= z for _, port in wild), (wild, pinned)


def test_the_extents_of_a_failed_one_sided_write_stay_out_of_use_while_late_bytes_may_land(monkeypatch):
    """A write over the transfer engine fails (its unit stalled), the put is aborted, and the
    engine delivers the write's bytes late, as a stalled peer that comes back does. Those
    bytes must not land in a later put's rows: the unit keeps the aborted extents out of use
    for LATE_FREE_S, then takes them back. (Before, the abort freed them at once, the next
    put of the same size was placed there, and the late bytes overwrote it.)"""
    import time

    import rlplane.te as te
    from rlplane_service.native import writes

    monkeypatch.setattr(writes, "LATE_FREE_S", 1.5)
    with LocalEngine(1, secret=SECRET, slab_bytes=16 << 20, te_protocol="tcp") as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=20, data_path="te")) as client:
            unit = eng.cores[0]
            g = torch.Generator().manual_seed(4)

            def batch() -> dict:  # 512 KiB of rows: past the one-message put, so written one-sided
                return {"input_ids": torch.randint(0, 10**9, (64, 1024), generator=g),
                        "input_lengths": torch.full((64,), 1024)}

            first = batch()
            kept = client.put_samples("kept", first)
            used = unit.alloc.used_bytes
            original, stalled = te.TransferPool.write, []

            def stalls(self, peer, name, pieces):
                stalled.append((self, peer, name, [(src.copy(), at) for src, at in pieces]))
                raise E.UnavailableError(f"storage unit {name} stalled mid-write", component=name)

            monkeypatch.setattr(te.TransferPool, "write", stalls)
            with pytest.raises(E.UnavailableError, match="stalled"):
                client.put_samples("failed", batch())
            monkeypatch.setattr(te.TransferPool, "write", original)
            assert stalled and "failed" not in client.partitions()
            time.sleep(0.5)  # (the controller's free has reached the unit)
            assert unit.alloc.used_bytes > used and unit.stats()["late_extents"] >= 1
            later = batch()
            meta = client.put_samples("later", later)
            pool, peer, name, pieces = stalled[0]
            original(pool, peer, name, pieces)  # the failed write's bytes arrive after all
            got = client.read_columns(meta, ["input_ids"])["input_ids"]
            assert torch.equal(got, later["input_ids"]), "late bytes of a failed write landed in a later put's rows"
            client.clear("later")
            deadline = time.monotonic() + 10
            while unit.alloc.used_bytes > used:  # and the aborted extents come back once their time is up
                assert time.monotonic() < deadline, "the extents of the failed write were never taken back"
                time.sleep(0.05)
            assert unit.stats()["late_extents"] == 0
            assert torch.equal(client.read_columns(kept, ["input_ids"])["input_ids"], first["input_ids"])


_STALLED_PEER = """
import json, sys, numpy as np
from rlplane.te import open_engine, register
engine = open_engine("127.0.0.1", "tcp")
memory = np.zeros(1 << 20, np.uint8)
register(engine, memory.ctypes.data, memory.size, "the peer's memory")
print(json.dumps({"peer": f"127.0.0.1:{engine.get_rpc_port()}", "base": memory.ctypes.data}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_peer_that_stopped_answering_before_the_first_transfer_is_named_within_the_bound(monkeypatch, op):
    """The engine's first contact with a peer (its handshake) waited ~60 s on a unit that
    had stopped answering (STALL_S bounds only transfers on a connection made): a put or
    read from a process that had not reached that unit yet hung a minute. Now the handshake
    is bounded by REACH_S and the unit is named."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import rlplane.te as te

    monkeypatch.setattr(te, "REACH_S", 2)
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        pool = TransferPool("tcp", hostname="127.0.0.1")
        os.kill(proc.pid, signal.SIGSTOP)
        buf = np.ones(4096, np.uint8)
        t0 = time.monotonic()
        with pytest.raises(E.UnavailableError, match="did not answer a handshake within 2 s") as err:
            if op == "write":
                pool.write(info["peer"], "unit-3", [(buf, info["base"])])
            else:
                pool.read(info["peer"], "unit-3", np.array([info["base"]]), np.array([4096]), [buf],
                          np.zeros(1, np.int64), np.zeros(1, np.int64))
        assert time.monotonic() - t0 < 4 and err.value.component == "unit-3"
        if op == "read":
            assert np.all(buf == 1)  # nothing landed
        os.kill(proc.pid, signal.SIGCONT)  # it answers again: the pool reaches it (the handshake went on meanwhile)
        deadline = time.monotonic() + 90
        while True:
            try:
                pool.write(info["peer"], "unit-3", [(buf, info["base"])])
                break
            except E.UnavailableError:
                assert time.monotonic() < deadline
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_forked_child_moves_bytes_over_an_engine_of_its_own_and_exits_cleanly(peer):
    """A forked child (a DataLoader worker) used its parent's engine, whose threads are not
    there: every transfer failed after 30 s, blaming the unit; and a child that opened an
    engine of its own beside the inherited one aborted at exit. Now the child lets the
    parent's go at the fork and opens its own at its first transfer."""
    import os
    import time

    import rlplane.te as te
    from rlplane.te import PoolSpec, RemoteSlab

    slab = RemoteSlab("unit-1", peer["name"], peer["memory"].ctypes.data, peer["memory"].size,
                      PoolSpec("tcp", "127.0.0.1"))
    peer["memory"][:64] = np.arange(64, dtype=np.uint8)
    got = np.zeros(64, np.uint8)
    slab.read(np.array([0]), np.array([64]), [got], np.zeros(1, np.int64), np.zeros(1, np.int64))
    parent_pool = slab.pool
    assert np.array_equal(got, np.arange(64, dtype=np.uint8))
    pid = os.fork()
    if pid == 0:  # (the child reports by its exit status only, and never returns into pytest)
        code = 1
        try:
            mine = np.zeros(64, np.uint8)
            t0 = time.monotonic()
            slab.read(np.array([0]), np.array([64]), [mine], np.zeros(1, np.int64), np.zeros(1, np.int64))
            slab.write([(np.full(8, 200, np.uint8), 100)])
            ok = slab.pool is not parent_pool and np.array_equal(mine, np.arange(64, dtype=np.uint8))
            mine_pool = slab.pool
            te._pools.clear()  # the child's own engine torn down now (beside the inherited one, this aborted)
            del mine_pool
            code = 0 if ok and time.monotonic() - t0 < 10 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the forked child hung"
        time.sleep(0.1)
    assert os.waitstatus_to_exitcode(status) == 0
    assert np.all(peer["memory"][100:108] == 200)


def test_a_handshake_that_failed_after_its_callers_gave_up_is_not_the_answer_of_the_next_one(monkeypatch):
    """A first contact that outlasted REACH_S and failed later (the engine gives up after
    ~60 s) was handed to the next caller, after the unit had come back, as "the unit died"."""
    import threading

    import rlplane.te as te

    monkeypatch.setattr(te, "REACH_S", 0.5)
    pool = TransferPool("tcp", hostname="127.0.0.1")
    release, calls = threading.Event(), []

    class Engine:  # the first contact hangs, then fails; the unit answers every later one
        def register_memory(self, addr, n):
            return 0

        def batch_transfer_sync_read(self, peer, local, remote, lens):
            calls.append(peer)
            if len(calls) == 1:
                release.wait(30)
                return -1
            return 0

    monkeypatch.setattr(pool, "engine", Engine())
    with pytest.raises(E.UnavailableError, match="did not answer a handshake within 0.5 s"):
        pool.reach("10.9.9.9:1234", "unit-5", 4096)
    release.set()  # the hung contact ends, failed, with no caller waiting for it
    deadline = time.monotonic() + 10
    while pool._reaching and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.reach("10.9.9.9:1234", "unit-5", 4096)  # a contact of its own, which the unit answers
    assert calls == ["10.9.9.9:1234"] * 2 and "10.9.9.9:1234" in pool._reached
    pool.reach("10.9.9.9:1234", "unit-5", 4096)  # reached: no contact more
    assert len(calls) == 2
