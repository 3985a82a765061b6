"""Wire fuzz of the native engine (issue 23): hypothesis mutates valid requests — values
swapped for others of any type, keys dropped, header bytes flipped or cut, frames added
or removed — and sends them to the controller and to every storage unit, with the data
secret, without it and with a wrong one. After each batch the servers answer a ping and
a known partition reads back bit-exactly; every authenticated request got an answer."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from rlplane import Client, default_registry
from rlplane.channel import PLAIN_USER
from rlplane.errors import _BY_NAME
from rlplane.transports.native import NativeTransport
from rlplane.wire import VERSION, ints
from rlplane_service.native.local import LocalEngine

SECRET = b"fuzz-secret"
TYPED = set(_BY_NAME) - {"RlplaneError", "TransportError"}  # a bare TransportError is what a bug becomes
#: Batches (hypothesis examples) per target, and requests per batch.
EXAMPLES, PER_BATCH = 60, 25


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, slab_bytes=32 << 20, lease_s=5, grace_s=3600, te_protocol="tcp") as eng:
        client = Client(default_registry(), NativeTransport(eng.info, timeout=20))
        fields = {"input_ids": torch.arange(48).reshape(6, 8), "input_lengths": torch.tensor([8, 1, 8, 4, 2, 8])}
        meta = client.put_samples("known", fields, sample_ids=[f"k{i}" for i in range(6)])
        yield eng, client, meta, fields
        client.close()


def _valid(meta_blocks: list[int]) -> list[dict]:
    """One valid request of each kind (on a partition of its own, never ``known``)."""
    b = meta_blocks[0]
    return [
        {"op": "claim", "p": "fz", "task": "t", "n": 2, "fields": ["input_ids"], "wait": 0.0, "min": 1},
        {"op": "claim", "p": "fz", "task": "u", "n": 2, "fields": ["input_ids"], "wait": 0.0, "min": 1, "unf": True,
         "tok": 8, "mintok": 1, "tokf": "input_ids", "group": "g"},
        {"op": "reserve", "p": "fz", "ids": ["a", "b"], "create": True, "fields": ["input_ids"],
         "blocks": [[777, [0], 0, 2]]},
        {"op": "commit", "res": "00" * 12, "g": {"input_ids": [[[2]], [[2]]]}, "nb": {"input_ids": ints([16, 16])},
         "user": [{}, {}]},
        {"op": "commit", "res": "00" * 12, "g": {"input_ids": [[[2]], [[2]]]}, "nb": {"input_ids": ints([16, 16])},
         "t": ["input_ids", "token_mask"], "gr": ints([1, 1])},  # an extend: the lengths it read
        {"op": "commit", "res": "00" * 12, "g": {"pixel_values": [[[2, 4]], [[2, 4]]]},  # a row stored once
         "nb": {"pixel_values": ints([16, 0])}, "s": {"pixel_values": ints([-1, 0])}, "user": [{"finished": False}, {}]},
        {"op": "commit", "res": "00" * 12, "g": {"pixel_values": [[[2, 4]], [[2, 4]]]},  # a row held from a put
         "nb": {"pixel_values": ints([16, 16])}, "k": {"pixel_values": b"\x01" * 32},
         "hx": {"pixel_values": ints([-1] * 5 + [777, 0, 0, 16, 9])}},
        {"op": "held", "p": "known", "f": "pixel_values", "k": b"\x02" * 16 + b"\x00" * 16},
        {"op": "locate", "p": "fz", "ids": ["a"], "fields": ["input_ids"], "shm": [0]},
        {"op": "locate", "p": "fz", "ids": ["a", "b"], "fields": ["pixel_values"], "shm": [0], "share": True},
        {"op": "ack", "p": "fz", "task": "t", "lease": 5, "ids": ["a"]},
        {"op": "clear", "p": "fz", "ids": ["a"]},
        {"op": "describe", "p": "fz"},
        {"op": "consumption", "p": "fz", "task": "t"},
        {"op": "renew", "pins": ["x"]},
        {"op": "unpin", "pin": "x", "nr": True},
        {"op": "read", "p": "fz", "f": [["input_ids", ints([b]), ints([0])]]},
        {"op": "alloc", "b": 4242, "f": [["x", "int64", 16]]},
        {"op": "stage", "b": 4545, "fs": [["x", "int64", 16], ["y", "float32", 8]]},
        {"op": "write", "b": 4343},
        {"op": "slab"},
        {"op": "te"},
        {"op": "stats"},
    ]


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4),
                      max_leaves=20)
edit = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10), values),
    st.tuples(st.just("drop"), st.integers(0, 10), st.none()),
    st.tuples(st.just("flip"), st.integers(0, 4000), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 4000), st.none()),
    st.tuples(st.just("frames"), st.integers(-2, 3), st.binary(max_size=64)),
)
batch = st.lists(st.tuples(st.integers(0, 100), st.lists(edit, min_size=1, max_size=4)), min_size=PER_BATCH,
                 max_size=PER_BATCH)


def _mutate(header: dict, edits: list) -> list[bytes]:
    header = dict(header)
    keys = [k for k in header if k != "op"]
    frames_extra: list[bytes] = []
    drop_frames = 0
    for kind, at, value in edits:
        if kind == "set" and keys:
            header[keys[at % len(keys)]] = value
        elif kind == "drop" and keys:
            header.pop(keys[at % len(keys)], None)
    body = bytearray(msgpack.packb({**header, "v": VERSION, "c": [], "nbuf": 0}, use_bin_type=True))
    for kind, at, value in edits:
        if kind == "flip" and body:
            body[at % len(body)] ^= value
        elif kind == "cut" and body:
            del body[at % len(body):]
        elif kind == "frames":
            if at > 0:
                frames_extra += [value] * at
            else:
                drop_frames += -at
    frames = [bytes(body), *frames_extra]
    return frames[: max(1, len(frames) - drop_frames)]


def _socket(endpoint: str, secret: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.sndtimeo = 5000  # a send never blocks for good (a refused handshake leaves no peer to queue for)
    if secret is not None:
        sock.plain_username = PLAIN_USER
        sock.plain_password = secret
    sock.connect(endpoint)
    return sock


def _still_serving(engine) -> None:
    eng, client, meta, fields = engine
    for endpoint in [eng.info["controller"], *(u.endpoint for u in eng.units)]:
        sock = _socket(endpoint, SECRET)
        try:
            sock.send_multipart([msgpack.packb({"op": "ping", "rid": 1, "v": VERSION, "c": [], "nbuf": 0})])
            assert msgpack.unpackb(sock.recv_multipart()[0])["ok"] is True
        finally:
            sock.close()
    got = client.read_columns(meta, ["input_ids", "input_lengths"])
    assert torch.equal(got["input_lengths"], fields["input_lengths"])
    for i, n in enumerate(fields["input_lengths"].tolist()):
        assert torch.equal(got["input_ids"][i, :n], fields["input_ids"][i, :n])


@pytest.mark.parametrize("target", ["controller", "unit-0", "unit-1"])
def test_mutated_requests_never_stop_a_server_or_change_what_it_holds(engine, target):
    eng, client, meta, _ = engine
    loc = client.transport._ctrl().call({"op": "locate", "p": "known", "ids": meta.sample_ids[:1],
                                         "fields": ["input_ids"]}, timeout=5)[0]
    blocks = [int(np.frombuffer(loc["units"][0][1][0][1], "<i8")[0])]
    requests = _valid(blocks)
    endpoint = eng.info["controller"] if target == "controller" else eng.units[int(target[-1])].endpoint
    sent = {"n": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(batch)
    def run(cases):
        authed = _socket(endpoint, SECRET)
        strangers = [_socket(endpoint, None), _socket(endpoint, b"wrong")]
        try:
            waiting = 0
            for k, (which, edits) in enumerate(cases):
                frames = _mutate({**requests[which % len(requests)], "rid": 10_000 + k}, edits)
                if k % 5 == 4:  # a stranger: its handshake is refused, so its messages may never leave
                    try:
                        strangers[k % 2].send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                else:
                    authed.send_multipart(frames)
                    waiting += 1
            authed.send_multipart([msgpack.packb({"op": "ping", "rid": -1, "v": VERSION, "c": [], "nbuf": 0})])
            answered = 0
            while True:  # answers in order: ok, or a typed error, up to the ping sent last (parked ones come later)
                assert authed.poll(10_000), "a server stopped answering"
                reply = msgpack.unpackb(authed.recv_multipart()[0], raw=False)
                if reply.get("rid") == -1:
                    break
                assert reply["ok"] is True or reply["error"]["error"] in TYPED, reply
                answered += 1
            assert answered <= waiting
            for s in strangers:  # a peer without the secret gets nothing at all
                assert not s.poll(10)
        finally:
            authed.close()
            for s in strangers:
                s.close()
        sent["n"] += len(cases)
        _still_serving(engine)

    run()
    assert sent["n"] >= EXAMPLES * PER_BATCH
    servers = [eng.server, *eng.units]
    assert [srv.failures for srv in servers] == [0] * len(servers)  # no request took a bug's path
    assert all(eng.core.health()["threads"].values()) and not eng.core.loop_errors
