"""Clients give back what they open: dropped without close(), by the hundred, across a
fork, inside an event loop; a closed client says so; running out of descriptors is a
typed error (the native engine in a process of its own, no Ray)."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.channel import reap
from rlplane.transports.native import NativeTransport

SECRET = b"hygiene-secret"
#: The suite runs this many connect/put/read/drop cycles; the issue's 10,000 run the same
#: loop with RLPLANE_HYGIENE_CYCLES=10000.
CYCLES = int(os.environ.get("RLPLANE_HYGIENE_CYCLES", "500"))


#: The engine runs in a process of its own: every descriptor of this process is then a
#: client's (an engine here opens channels of its own lazily, when its background threads
#: first have work, and a test's count would take them for a client's).
ENGINE = textwrap.dedent("""
    import json, sys
    from rlplane_service.native.local import LocalEngine
    with LocalEngine(2, secret=sys.argv[1].encode(), slab_bytes=32 << 20, lease_s=30) as eng:
        print(json.dumps(eng.info), flush=True)
        sys.stdin.read()  # until the test closes it
""")


@pytest.fixture(scope="module")
def engine():
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, SECRET.decode()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the engine process did not start"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its pid
            proc.wait(timeout=10)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_fds() -> int:
    """Descriptors once the sockets of dropped clients are closed: a dropped channel's
    sockets go to a reaper that closes them within a second (rlplane.channel)."""
    gc.collect()
    time.sleep(1.2)
    reap()
    return fds()


def batch(k: int = 0) -> dict:
    return {"input_ids": torch.arange(32).reshape(4, 8) + k, "input_lengths": torch.full((4,), 8)}


def cycle(engine, k: int, path: str) -> None:
    client = Client(default_registry(), NativeTransport(engine, timeout=30, data_path=path))
    meta = client.put_samples(f"h{k}", batch(k))
    assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(k)["input_ids"])
    client.clear(meta.partition)
    # dropped here without close(): what it opened must go with it


def test_clients_dropped_without_close_leave_no_descriptor_behind(engine):
    for k in range(20):  # warm up: the process's ZMQ context and its threads exist from here on
        cycle(engine, k, "shm")
    start = fds()
    for k in range(CYCLES):
        cycle(engine, k, "shm" if k % 2 else "zmq")
    deadline = time.monotonic() + 10  # the last clients' sockets go with the reaper (0.5 s) and ZMQ's own
    while fds() > start + 20:
        assert time.monotonic() < deadline, f"{fds() - start} descriptors more after {CYCLES} dropped clients"
        time.sleep(0.1)


def _live_client(engine, k: int) -> Client:
    client = Client(default_registry(), NativeTransport(engine, timeout=30, data_path="shm"))
    client.read_columns(client.put_samples(f"many{k}", batch(k)), ["input_ids"])
    return client


def _settled_fds(deadline_s: float = 10.0) -> int:
    """The process's descriptors once closed sockets are given back (ZMQ's reaper, ours)."""
    last, deadline = fds(), time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = fds()
        if now == last:
            return now
        last = now
    return last


#: What a hundred live clients may hold beyond twice one client's descriptors.
HUNDRED_CLIENTS_SLACK = 8


def test_a_hundred_live_clients_cost_at_most_twice_one_and_give_everything_back_on_close(engine):
    cycle(engine, 0, "shm")  # the process's ZMQ context and its I/O threads exist from here on
    gc.collect()
    base = _settled_fds()
    first = _live_client(engine, 0)
    one = fds() - base  # its channels (controller, 2 units), their server ends here, the slab mappings
    clients = [first] + [_live_client(engine, k) for k in range(1, 100)]
    held = fds() - base
    print(f"in process: one client {one} descriptors (its server ends included), 100 clients {held}")
    # same credentials, same process: the clients share one channel per endpoint and thread
    assert held <= 2 * one + HUNDRED_CLIENTS_SLACK, (held, one)
    for k, c in enumerate(clients[1:], 1):  # closing some leaves the others' channels working
        c.clear(f"many{k}")
        c.close()
    assert torch.equal(first.read_columns(first.put_samples("still", batch(3)), ["input_ids"])["input_ids"],
                       batch(3)["input_ids"])
    first.clear("still")
    first.clear("many0")
    first.close()
    assert _settled_fds() <= base + 8, f"{fds() - base} descriptors left after closing 100 clients"


def test_clients_in_many_threads_share_per_thread_channels_and_dropping_them_gives_them_back(engine):
    import threading

    cycle(engine, 0, "shm")
    base = _settled_fds()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for k in range(5):  # several clients in one thread: one set of channels between them
                cycle(engine, 1000 * t + k, "shm" if k % 2 else "zmq")
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    gc.collect()
    assert _settled_fds() <= base + 20, f"{fds() - base} descriptors left after 8 threads of dropped clients"


def test_closing_is_idempotent_and_a_closed_client_says_so(engine):
    client = Client(default_registry(), NativeTransport(engine, timeout=30))
    meta = client.put_samples("closed", batch())
    client.close()
    client.close()
    with pytest.raises(E.TransportError, match="closed client"):
        client.read_columns(meta, ["input_ids"])
    with pytest.raises(E.TransportError, match="closed"):
        client.transport.clear("closed")
    other = Client(default_registry(), NativeTransport(engine, timeout=30))  # others of the process are unaffected
    assert other.clear("closed") == 4
    other.close()


def _child_uses_parents_client(client: Client, q) -> None:
    try:
        meta = client.put_samples("forked-child", batch(7))
        got = client.read_columns(meta, ["input_ids"])["input_ids"]
        q.put("ok" if torch.equal(got, batch(7)["input_ids"]) else "wrong bytes")
    except E.RlplaneError as err:  # a typed error is allowed; a shared socket is not
        q.put(f"typed {type(err).__name__}")
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        q.put(f"untyped {type(err).__name__}: {err}")


def test_a_forked_child_gets_its_own_connections_and_the_parent_keeps_working(engine):
    client = Client(default_registry(), NativeTransport(engine, timeout=30))
    meta = client.put_samples("forked-parent", batch(1))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_uses_parents_client, args=(client, q))
    child.start()
    try:
        answer = q.get(timeout=60)
    finally:
        child.join(timeout=30)
    assert answer == "ok" or answer.startswith("typed"), answer
    assert child.exitcode == 0
    for _ in range(3):  # the parent's sockets were never touched by the child
        assert torch.equal(client.read_columns(meta, ["input_ids"])["input_ids"], batch(1)["input_ids"])
    client.clear("forked-parent")
    client.clear("forked-child")
    client.close()


def test_an_async_client_dropped_inside_a_running_loop_gives_its_sockets_back(engine):
    async def use(k: int) -> None:
        client = Client(default_registry(), NativeTransport(engine, timeout=30))
        meta = await client.aput_samples(f"async{k}", batch(k))
        await client.aread_columns(meta, ["input_ids"])
        await client.aclear(meta.partition)

    async def many() -> None:
        for k in range(50):
            await use(k)

    async def twice() -> tuple[int, int]:
        # A fixed executor whose threads all exist from the start: each thread keeps its own
        # sockets per endpoint, so a thread born in the second round would look like a leak.
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        both = threading.Barrier(2)
        await asyncio.gather(*(loop.run_in_executor(None, both.wait, 10) for _ in range(2)))
        await many()  # warms up the threads' sockets
        start = settled_fds()
        await many()
        return start, settled_fds()

    start, end = asyncio.run(twice())  # one loop, one executor: a second asyncio.run would bring new threads
    assert end <= start + 20


RUN_OUT = textwrap.dedent("""
    import resource, sys
    from rlplane import errors as E
    from rlplane.channel import Channel
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
    held = []
    try:
        for k in range(500):
            held.append(Channel(sys.argv[1], f"c{k}"))
    except E.TransportError as err:
        print("typed:", err)
        sys.exit(0)
    except Exception as err:
        print("untyped:", type(err).__name__, err)
        sys.exit(1)
    print("never ran out")
    sys.exit(1)
""")


def test_running_out_of_descriptors_is_a_typed_error_that_says_so(engine):
    res = subprocess.run([sys.executable, "-c", RUN_OUT, engine["controller"]], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "out of file descriptors" in res.stdout and "holds" in res.stdout and "close" in res.stdout


def test_a_cancelled_aclaim_stops_waiting_and_gives_back_a_batch_that_came_meanwhile(engine):
    """Cancelled, an awaited claim's thread went on waiting (up to 30 s a request; asyncio.run
    waited for it) and leased the batch that came to nobody: another claimer found nothing
    until the lease ran out. Now it stops within AWAIT_STEP_S and gives such a batch back."""
    client = Client(default_registry(), NativeTransport(engine, timeout=30))
    writer = Client(default_registry(), NativeTransport(engine, timeout=30))

    async def cancelled() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.aclaim("acancel", "train", batch_size=4, fields=["input_ids"], timeout=None),
                                   0.2)
        writer.put_samples("acancel", batch())  # while the claim's last request is still parked on the ledger

    try:
        t0 = time.monotonic()
        asyncio.run(cancelled())  # (waits for the claim's thread)
        assert time.monotonic() - t0 < 3.0
        got = client.claim("acancel", "train", batch_size=4, fields=["input_ids"], timeout=0)
        assert len(got) == 4 and client.ack(got, "train") == 4
    finally:
        writer.clear("acancel")
        client.close()
        writer.close()


def test_an_aclaim_cancelled_after_its_answer_came_but_before_it_was_taken_gives_the_batch_back(engine):
    """(A diff review's: the thread had the batch when the cancel came; it was thrown away
    with its lease.)"""
    client = Client(default_registry(), NativeTransport(engine, timeout=30))

    async def answered_then_cancelled() -> None:
        task = asyncio.ensure_future(client.aclaim("alate", "train", batch_size=4, fields=["input_ids"], timeout=5))
        await asyncio.sleep(0)  # its thread starts
        time.sleep(0.5)  # the loop is busy while the thread's claim is answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        client.put_samples("alate", batch())
        asyncio.run(answered_then_cancelled())  # (waits for the give-back, on the loop's executor)
        got = client.claim("alate", "train", batch_size=4, fields=["input_ids"], timeout=0)
        assert len(got) == 4 and client.ack(got, "train") == 4
    finally:
        client.clear("alate")
        client.close()
