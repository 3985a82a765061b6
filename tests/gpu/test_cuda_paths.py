"""CUDA tensors through put and read on every native data path (shm, te, zmq).

Marked ``gpu``: out of ``make test`` (CI has no GPU), run by ``make gpu-test`` on a host
with one. A put takes tensors on the GPU (token fields are compacted there, media joined
and cast there, then one copy per field to the host); ``read_columns(device="cuda")``
lands every tensor on the GPU after its digests were checked on the host. Every check
is bit-exact against the CPU originals. ``-s`` prints what each path took on vlm-step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from rlplane import Client, PackedTensor, default_registry
from rlplane.testing.verify import diff_fields
from rlplane.testing.workloads import text_step, vlm_step
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

pytestmark = pytest.mark.gpu

PATHS = ("shm", "te", "zmq")


def moved(fields: dict[str, Any], device: str) -> dict[str, Any]:
    """Every tensor of ``fields`` on ``device`` (object fields stay lists)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, (torch.Tensor, PackedTensor)):
            out[name] = value.to(device)
        else:
            out[name] = value
    return out


def devices_of(fields: dict[str, Any]) -> set[str]:
    """The device types of every tensor (and every packed segment) in ``fields``."""
    seen: set[str] = set()
    for value in fields.values():
        if isinstance(value, torch.Tensor):
            seen.add(value.device.type)
        elif isinstance(value, PackedTensor):
            seen.update(seg.device.type for row in value.rows if row for seg in row)
    return seen


@pytest.fixture(scope="module")
def engine():
    if not torch.cuda.is_available():  # a failure, not a skip: this module exists to run on a GPU
        pytest.fail("these checks need a CUDA device: run make gpu-test on a host with one")
    with LocalEngine(2, secret=b"gpu-check-secret", slab_bytes=1 << 30, te_protocol="tcp") as eng:
        yield eng


@pytest.fixture(params=PATHS)
def client(engine, request):
    with Client(default_registry(), NativeTransport(engine.info, timeout=60, data_path=request.param)) as c:
        assert set(c.transport.paths().values()) == {request.param}
        yield c


def test_cuda_put_and_cuda_read_are_bit_exact(client):
    if set(client.transport.paths().values()) == {"shm"}:  # the mapped slabs page-locked for DMA
        for write in (False, True):
            assert client.transport.on_device(torch.device("cuda"), write=write)
    w = vlm_step(16, 512, seed=7)
    meta = client.put_samples("gpu-vlm", moved(w.fields, "cuda"))
    names = list(w.fields)
    on_host = client.read_columns(meta, names)
    assert devices_of(on_host) == {"cpu"}
    assert diff_fields(client.registry, w.fields, on_host, w.lengths) == []
    for copy in (True, False):
        on_gpu = client.read_columns(meta, names, device="cuda", copy=copy)
        assert devices_of(on_gpu) == {"cuda"}
        assert diff_fields(client.registry, w.fields, moved(on_gpu, "cpu"), w.lengths) == []
    jagged = client.read_columns(meta, ["input_ids"], layout="jagged", device="cuda")["input_ids"]
    assert jagged.is_cuda and torch.equal(jagged.values().cpu(), torch.cat([r[:n] for r, n in zip(
        w.fields["input_ids"], w.lengths.tolist())]))
    client.clear("gpu-vlm")


def test_a_logprob_stage_writes_back_from_the_gpu_and_a_trainer_claims_onto_it(client):
    w = text_step(32, 256, seed=8)
    client.put_samples("gpu-claim", moved(w.fields, "cuda"))
    got = client.claim("gpu-claim", "logprob", batch_size=32, fields=["input_ids"], timeout=10)
    batch = client.read_columns(got, ["input_ids", "input_lengths"], device="cuda")
    logprobs = -torch.rand(32, 256, device="cuda") * (torch.arange(256, device="cuda") < batch["input_lengths"][:, None])
    client.write_columns(got, {"prev_logprobs": logprobs})
    client.ack(got, "logprob")
    back = client.read_columns(got, ["prev_logprobs"], device="cuda")
    assert devices_of(back) == {"cuda"}
    assert diff_fields(client.registry, {"prev_logprobs": logprobs.cpu()}, moved(back, "cpu"),
                       batch["input_lengths"].cpu()) == []
    client.clear("gpu-claim")


def test_a_partial_rollout_extended_from_the_gpu_reads_back_whole(client):
    """A rollout on the GPU writes what it has, extends twice with CUDA tensors (two token
    fields together), finishes; the trainer reads every token onto the GPU."""
    lens = [[3, 5], [4, 0], [2, 6]]  # per step, per sample
    ids = [torch.randint(0, 1000, (2, 8), device="cuda") for _ in lens]
    lps = [-torch.rand(2, 8, device="cuda") for _ in lens]
    step = lambda k: {"input_ids": ids[k], "generation_logprobs": lps[k],  # noqa: E731
                      "input_lengths": torch.tensor(lens[k], device="cuda")}
    meta = client.put_samples("gpu-extend", step(0), finished=False)
    meta = client.extend(meta, step(1))
    meta = client.extend(meta, step(2), finished=True)
    got = client.read_columns(meta, ["input_ids", "generation_logprobs"], layout="jagged", device="cuda")
    for name, parts in (("input_ids", ids), ("generation_logprobs", lps)):
        rows = got[name].unbind()
        for i in range(2):
            want = torch.cat([parts[k][i, : lens[k][i]] for k in range(len(lens))])
            assert rows[i].is_cuda and torch.equal(rows[i], want.to(rows[i].dtype)), (name, i)
    client.clear("gpu-extend")


def test_a_tensordict_on_the_gpu_round_trips_onto_the_gpu(client):
    from rlplane.integrations.tensordict import put_tensordict, read_tensordict
    from tensordict import TensorDict

    w = text_step(8, 64, seed=12)
    td = TensorDict({k: v for k, v in w.fields.items()}, batch_size=[8]).to("cuda")
    meta = put_tensordict(client, "gpu-td", td)
    back = read_tensordict(client, meta, list(w.fields), device="cuda")
    assert devices_of(dict(back.items())) == {"cuda"}
    assert diff_fields(client.registry, w.fields, moved(dict(back.items()), "cpu"), w.lengths) == []
    client.clear("gpu-td")


def test_page_locking_a_slab_for_cuda_takes_once(capsys):
    """A fresh 1 GiB unit: a read's first on_device page-locks the read-only mapping, a put's
    the read-write one; again, each is free."""
    with LocalEngine(1, secret=b"gpu-register-secret", slab_bytes=1 << 30) as eng:
        with Client(default_registry(), NativeTransport(eng.info, timeout=60, data_path="shm")) as c:
            took = []
            for write in (False, True, False, True):
                t0 = time.perf_counter()
                assert c.transport.on_device(torch.device("cuda"), write=write)
                took.append(1e3 * (time.perf_counter() - t0))
    with capsys.disabled():
        print(f"\npage-locking a 1 GiB slab for CUDA: for reads {took[0]:.1f} ms, for puts {took[1]:.1f} ms; "
              f"again {took[2]:.3f} / {took[3]:.3f} ms")


def test_a_mapping_dropped_without_close_is_unregistered_before_its_address_is_reused():
    """Three stores in turn, each client dropped unclosed: each new mapping page-locks (CUDA
    refused one at an address it still held, error 712, before the finalizer existed) and
    a GPU put and read through it stay bit-exact (a stale registration copied to old pages)."""
    import gc
    import weakref

    w = vlm_step(4, 256, seed=10)
    for k in range(3):
        with LocalEngine(1, secret=b"gpu-drop-secret", slab_bytes=256 << 20) as eng:
            c = Client(default_registry(), NativeTransport(eng.info, timeout=60, data_path="shm"))
            for write in (False, True):
                assert c.transport.on_device(torch.device("cuda"), write=write), f"round {k}: not page-locked"
            meta = c.put_samples("drop", moved(w.fields, "cuda"))
            got = c.read_columns(meta, list(w.fields), device="cuda")
            assert diff_fields(c.registry, w.fields, moved(got, "cpu"), w.lengths) == []
            view = weakref.ref(next(iter(c.transport._slabs.values())))
            del c, got
            gc.collect()
            assert view() is None, "the slab's mapping outlived its last client: the finalizer was not exercised"


def test_vlm_step_from_and_to_the_gpu_on_every_path(engine, capsys):
    """Times the reference vlm-step batch (B=64, S=2048) put from CUDA tensors and read
    onto the GPU, per path (best of 3), and checks the last read bit-exact."""
    w = vlm_step(64, 2048, seed=9)
    on_gpu = moved(w.fields, "cuda")
    rows = []
    for path in PATHS:
        with Client(default_registry(), NativeTransport(engine.info, timeout=120, data_path=path)) as c:
            best_put = best_get = float("inf")
            for k in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                meta = c.put_samples(f"gpu-time-{path}", on_gpu)
                t1 = time.perf_counter()
                got = c.read_columns(meta, list(w.fields), device="cuda")
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                best_put, best_get = min(best_put, t1 - t0), min(best_get, t2 - t1)
                if k < 2:
                    c.clear(f"gpu-time-{path}")
            assert diff_fields(c.registry, w.fields, moved(got, "cpu"), w.lengths) == []
            c.clear(f"gpu-time-{path}")
            rows.append((path, best_put * 1e3, best_get * 1e3))
    stored = sum(col.nbytes for col in got.values() if isinstance(col, torch.Tensor))
    stored += sum(seg.numel() * seg.element_size() for v in got.values() if isinstance(v, PackedTensor)
                  for row in v.rows if row for seg in row)
    floors = {kind: _h2d_ms(stored, pinned) for kind, pinned in (("pageable", False), ("pinned", True))}
    with capsys.disabled():
        print(f"\nvlm-step B=64 S=2048 ({w.nbytes / 1e6:.1f} MB as given, {stored / 1e6:.1f} MB read), "
              "CUDA in and out, best of 3:")
        for path, put_ms, get_ms in rows:
            print(f"  {path:>4}: put {put_ms:7.1f} ms, get onto the GPU {get_ms:7.1f} ms")
        print("  one host-to-GPU copy of the read's bytes: " +
              ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in floors.items()))


def _h2d_ms(nbytes: int, pinned: bool) -> float:
    """The best of 3 copies of ``nbytes`` from host memory onto the GPU, in ms."""
    host = torch.ones(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if pinned else host
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.to("cuda")
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
