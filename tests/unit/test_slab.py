"""Storage units' slabs in one process (no Ray): the shared-memory and ZMQ data paths,
a full slab, pins under zero-copy reads, and who may map a slab."""

import gc
import socket
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlplane import Client, PackedTensor, default_registry
from rlplane import errors as E
from rlplane.channel import Channel
from rlplane.fields import FieldSpec, Registry
from rlplane.readpool import ReadPool
from rlplane.shm import open_slab
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import vlm_step
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"slab-test-secret"
SLAB = 64 << 20


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(2, secret=SECRET, slab_bytes=SLAB, lease_s=30, replicas=2) as eng:
        yield {"info": eng.info, "core": eng.core, "cores": eng.cores, "units": eng.units}


def connect(engine, path: str, registry: Registry | None = None) -> Client:
    return Client(registry or default_registry(), NativeTransport(engine["info"], timeout=30, data_path=path))


def used(engine) -> list[int]:
    return [c.alloc.used_bytes for c in engine["cores"]]


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_vlm_step_round_trips_bit_exactly_with_two_copies_on_each_path(engine, path):
    with connect(engine, path) as client:
        assert set(client.transport.paths().values()) == {path}
        w = vlm_step(8, 256, seed=11)
        before = used(engine)
        meta = client.put_samples(f"vlm-{path}", w.fields)
        assert all(u > b for u, b in zip(used(engine), before)), "R=2: both units hold a copy"
        got = client.read_columns(meta, list(w.fields))
        assert diff_fields(client.registry, w.fields, got, w.lengths, sample_ids=meta.sample_ids) == []
        sub = meta.subset([7, 0, 3])
        got = client.read_columns(sub, ["pixel_values", "input_ids"], layout="jagged")
        want = w.select([7, 0, 3])
        assert diff_fields(client.registry, {k: want.fields[k] for k in ("pixel_values", "input_ids")}, got,
                           want.lengths, sample_ids=sub.sample_ids) == []
        client.clear(f"vlm-{path}")
        wait_for(lambda: used(engine) == before, "the cleared blocks' extents were not given back")


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int64, torch.int32, torch.uint8, torch.bool]


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), seq=st.integers(1, 9), rest=st.lists(st.integers(1, 3), max_size=2),
       dtype=st.sampled_from(FLOATS + INTS), path=st.sampled_from(["shm", "zmq"]), data=st.data())
def test_random_geometries_and_dtypes_round_trip_on_both_paths(engine, batch, seq, rest, dtype, path, data):
    wire = torch.bfloat16 if dtype.is_floating_point else None
    reg = Registry([FieldSpec("tok", "token", "dense", {"s"}, wire_dtype=wire),
                    FieldSpec("smp", "sample", "dense", {"s"}),
                    FieldSpec("med", "media", "packed", {"s"}, wire_dtype=wire),
                    FieldSpec("input_lengths", "sample", "dense", {"s"})])
    lengths = data.draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
    def rnd(*shape):
        return (torch.randn(*shape) * 50).to(dtype)
    media = [data.draw(st.one_of(st.none(), st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3),
                                                     min_size=1, max_size=2))) for _ in range(batch)]
    fields = {"tok": rnd(batch, seq, *rest), "smp": rnd(batch, *rest), "input_lengths": torch.tensor(lengths),
              "med": PackedTensor([None if r is None else [rnd(*s) for s in r] for r in media])}
    with connect(engine, path, reg) as client:
        meta = client.put_samples("geom", fields)
        for layout in ("padded", "jagged"):
            got = client.read_columns(meta, list(meta.fields), layout=layout)
            assert diff_fields(reg, {k: v for k, v in fields.items() if k in meta.fields}, got, lengths) == []
        client.clear("geom")


@pytest.mark.parametrize("path", ["shm", "zmq"])
def test_a_put_that_does_not_fit_is_storage_full_keeps_nothing_and_the_rest_reads(engine, path):
    with connect(engine, path) as client:
        small = {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": torch.full((8,), 8)}
        kept = client.put_samples(f"keep-{path}", small)
        before = used(engine)
        big = {"input_ids": torch.ones(4, SLAB // 16, dtype=torch.int64), "input_lengths": torch.full((4,), SLAB // 16)}
        with pytest.raises(E.StorageFullError) as err:
            client.put_samples(f"full-{path}", big, sample_ids=list("abcd"))
        msg = str(err.value)
        assert "has no room" in msg and "RLPLANE_UNIT_BYTES" in msg and "free" in msg
        assert f"full-{path}" not in client.partitions()
        wait_for(lambda: used(engine) == before, "a refused put left extents behind")
        assert torch.equal(client.read_columns(kept, ["input_ids"])["input_ids"], small["input_ids"])
        meta = client.put_samples(f"full-{path}", small, sample_ids=list("abcdefgh"))  # the ids were given back
        client.clear(meta.partition)
        client.clear(kept.partition)


def test_a_zero_copy_view_keeps_its_extent_until_it_is_freed(engine):
    """A clear under a live zero-copy tensor frees nothing; a new put cannot land in its
    memory; once the tensor is garbage, the extent goes back."""
    with connect(engine, "shm") as client:
        first = torch.arange(4096, dtype=torch.float32).reshape(8, 512)
        meta = client.put_samples("zc", {"advantages": first, "input_lengths": torch.full((8,), 512)},
                                  sample_ids=[f"s{i}" for i in range(8)])
        before_read = used(engine)
        view = client.read_columns(meta, ["advantages"], layout="jagged", copy=False)["advantages"]
        base = view.values()
        assert base.untyped_storage().data_ptr() != 0
        client.clear("zc")
        time.sleep(0.3)  # the controller would have sent the frees by now
        assert used(engine) == before_read, "a pinned block was freed under a live view"
        for k in range(3):  # new puts of the same size go elsewhere in the slab
            client.put_samples("zc", {"advantages": torch.full((8, 512), -1.0 - k), "input_lengths": torch.full((8,), 512)},
                               sample_ids=[f"t{k}{i}" for i in range(8)])
        assert torch.equal(torch.stack(list(view.unbind())), first), "a live view saw another put's bytes"
        client.clear("zc")
        del view, base
        gc.collect()
        wait_for(lambda: used(engine) < before_read, "the extent was not given back once the view was gone")
        assert client.transport.stats()["pins"] == 0


def test_a_copied_read_is_owned_memory_that_later_puts_never_touch(engine):
    with connect(engine, "shm") as client:
        x = torch.arange(2048, dtype=torch.int64).reshape(4, 512)
        meta = client.put_samples("own", {"input_ids": x, "input_lengths": torch.full((4,), 512)})
        got = client.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
        client.clear("own")
        client.put_samples("own", {"input_ids": torch.zeros_like(x), "input_lengths": torch.full((4,), 512)})
        assert torch.equal(torch.stack(list(got.unbind())), x)
        client.clear("own")


def test_without_the_secret_no_ticket_and_without_a_ticket_no_slab(engine):
    endpoint = engine["units"][0].endpoint
    with pytest.raises(E.AuthenticationError):
        Channel(endpoint, "u0", secret=b"wrong").call({"op": "slab"}, timeout=10)
    good = Channel(endpoint, "u0", secret=SECRET)
    share = good.call({"op": "slab"}, timeout=10)[0]
    with pytest.raises(E.TransportError, match="refused"):
        open_slab(share["sock"], "0" * 32, share["bytes"], unit="u0", timeout=5)
    view = open_slab(share["sock"], share["ticket"], share["bytes"], unit="u0", timeout=5)
    view.close()
    with pytest.raises(E.TransportError, match="refused"):  # a ticket works once
        open_slab(share["sock"], share["ticket"], share["bytes"], unit="u0", timeout=5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # garbage on the socket: refused, share goes on
        s.connect("\0" + share["sock"])
        s.sendall(b"\xff" * 200)
    fresh = good.call({"op": "slab"}, timeout=10)[0]
    open_slab(fresh["sock"], fresh["ticket"], fresh["bytes"], unit="u0", timeout=5).close()
    good.close()


def test_the_read_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    pool = ReadPool(max_bytes=64 << 20)
    a = pool.take(8 << 20)
    t = torch.from_numpy(a.view(np.int16))
    del a
    gc.collect()
    b = pool.take(8 << 20)  # `t` still uses the first buffer: this is another one
    assert pool.reused == 0 and b.ctypes.data != t.numpy().ctypes.data
    addr = t.numpy().ctypes.data
    del t
    gc.collect()
    c = pool.take(7 << 20)
    assert pool.reused == 1 and c.ctypes.data == addr
    assert pool.take(1000).size == 1000  # small requests are plain memory
