"""How a mapped slab is page-locked for CUDA and let go again, with CUDA's runtime replaced
by a recorder (the GPU itself: tests/gpu, ``make gpu-test``). A registration must end
before its mapping does: CUDA pins a registered range by address, so memory mapped there
later would be copied to and from the old pages (seen on an H200 before the finalizer)."""

import gc
import logging
import weakref

import pytest
import torch

from rlplane import Client, default_registry
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"cuda-register-secret"


class Recorder:
    """cudaHostRegister / cudaHostUnregister: which ranges are registered (refusing ``refuse``'s flags)."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = refuse
        self.live: dict[int, tuple[int, int]] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, addr: int, nbytes: int, flags: int) -> int:
        self.calls.append(f"register {flags}")
        if flags in self.refuse:
            return 712
        assert addr not in self.live, "a range registered twice"
        self.live[addr] = (nbytes, flags)
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        self.calls.append("unregister")
        return 0 if self.live.pop(addr, None) is not None else 713


@pytest.fixture(scope="module")
def engine():
    with LocalEngine(1, secret=SECRET, slab_bytes=32 << 20) as eng:
        yield eng


@pytest.fixture
def cudart(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rec)
    return rec


def shm_client(engine) -> Client:
    return Client(default_registry(), NativeTransport(engine.info, timeout=20, data_path="shm"))


def test_a_read_locks_the_read_only_mapping_a_put_the_other_once_each_and_close_lets_both_go(engine, cudart):
    c = shm_client(engine)
    cuda = torch.device("cuda")
    assert c.transport.on_device(cuda) and c.transport.on_device(cuda)
    assert c.transport.on_device(cuda, write=True) and c.transport.on_device(cuda, write=True)
    assert cudart.calls == ["register 9", "register 1"]  # portable | read-only, then portable
    assert sorted(n for n, _ in cudart.live.values()) == [32 << 20] * 2
    assert not c.transport.on_device(torch.device("cpu"))  # the host needs nothing
    view = next(iter(c.transport._slabs.values()))
    view.close()
    assert cudart.live == {} and cudart.calls[-2:] == ["unregister", "unregister"]
    assert not view.register_cuda(write=False)  # a closed view is never registered again
    c.close()


def test_a_mapping_dropped_without_close_is_unregistered_by_its_finalizer(engine, cudart):
    c = shm_client(engine)
    assert c.transport.on_device(torch.device("cuda"), write=True)
    view = weakref.ref(next(iter(c.transport._slabs.values())))
    assert len(cudart.live) == 1
    del c
    gc.collect()
    assert view() is None and cudart.live == {}
    c = shm_client(engine)  # the next client maps again and registers afresh
    assert c.transport.on_device(torch.device("cuda"), write=True) and len(cudart.live) == 1
    c.close()
    del c
    gc.collect()
    assert cudart.live == {}


def test_a_refused_registration_says_so_and_reads_stay_copies(engine, monkeypatch, caplog):
    rec = Recorder(refuse=(9,))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rec)
    with shm_client(engine) as c, caplog.at_level(logging.WARNING, "rlplane.shm"):
        assert not c.transport.on_device(torch.device("cuda"))
        assert c.transport.on_device(torch.device("cuda"), write=True)  # the other mapping is its own call
    assert "cudaHostRegister error 712" in caplog.text and "correct but slower" in caplog.text
    gc.collect()
    assert rec.live == {}
