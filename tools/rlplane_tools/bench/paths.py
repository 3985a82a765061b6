"""The data paths ``rlplane bench`` compares: one small object per way of moving a batch.

Every path moves the same batch from a writer process to a reader process. ``write``
runs in the writer and returns a small handle; the driver hands it to the reader, whose
``read`` returns what arrived; ``verify`` (untimed) says how it differs from what was
written. Each timed call returns its own ``(start, end)`` on the host's monotonic clock
(``time.monotonic``, one clock for every process on a Linux host), so a path whose bytes
land in the reader before ``read`` is called (the legacy actor call) can still say when
they left and when they arrived.

Adding a path (e.g. a Mooncake backend) is one subclass and one entry in :data:`PATHS`.

Example::

    path = PATHS["raw-tq"](env)
    sent = path.write(batch, "bench-0", peer=None)     # in the writer actor
    got, t0, t1 = path.read(batch, sent.handle)        # in the reader actor
    assert not path.verify(batch, got)
"""

from __future__ import annotations

import time
import warnings
from typing import Any, ClassVar

import msgpack
import numpy as np
import torch
from rlplane.codec import Encoded, decode, encode
from rlplane.column import Column
from rlplane.dtypes import dtype_from_name, dtype_name
from rlplane.meta import SampleMeta
from rlplane.testing.verify import diff_fields, same_bits

from rlplane_tools.bench.base import Batch, BenchPath, Sent, WorkerEnv
from rlplane_tools.bench.dataproto import MooncakeDataProto


class RlplanePath(BenchPath):
    """rlplane's client: ``put_samples`` (validate, encode, write) and ``read_columns``
    (fetch, check, decode), over one transport."""

    transport: ClassVar[str]
    data_path: ClassVar[str | None] = None  # native engine: shm, te, zmq (None: the client's default, auto)
    selects_rows = True

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env)
        import rlplane

        self.client = rlplane.connect(self.service_url(env), token=env.token, transport=self.transport,
                                      data_path=self.data_path)

    def service_url(self, env: WorkerEnv) -> str:
        return env.url

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        t0 = time.monotonic()
        meta = self.client.put_samples(key, batch.work.fields, sample_ids=batch.ids)
        t1 = time.monotonic()
        return Sent(msgpack.packb(meta.to_dict(), use_bin_type=True), t0, t1)

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        meta = SampleMeta.from_dict(msgpack.unpackb(handle, raw=False))
        t0 = time.monotonic()
        got = self.client.read_columns(meta, sorted(meta.fields))  # what was written: a share may hold no image
        return got, t0, time.monotonic()

    def read_rows(self, batch: Batch, handle: Any, rows: list[int], fields: list[str]) -> tuple[Any, float, float]:
        meta = SampleMeta.from_dict(msgpack.unpackb(handle, raw=False)).subset(rows)
        t0 = time.monotonic()
        got = self.client.read_columns(meta, fields)
        return got, t0, time.monotonic()

    def parts(self, op: str) -> dict[str, float] | None:
        if not self.client.transport.counts_waits:  # (TransferQueue's own waits are not counted)
            return None
        event = self.client.ops.last("put_samples" if op == "put" else "read_columns")
        return dict(event.parts) if event is not None and not event.error else None

    def clear(self, key: str) -> None:
        self.client.clear(key)

    def close(self) -> None:
        self.client.close()


class RlplaneNative(RlplanePath):
    """rlplane's default: the native engine, straight to its controller and units, bulk
    bytes through the units' shared-memory slabs (same host: what ``auto`` picks here)."""

    name = "rlplane-native"
    label = "rlplane (native, shm)"
    transport = "native"
    data_path = "shm"

    def held_bytes(self) -> int | None:
        """The bytes the engine's blocks hold for live samples (its controller's stats)."""
        return int(self.client.transport.stats()["live_bytes"])


class RlplaneNativeApart(RlplaneNative):
    """The native engine with the batch written one put per sample (each rollout writing its
    group member when it is done): a group's images are found across puts and stored once.
    Read as one batch. Runs in the vlm-grpo section only."""

    name = "rlplane-native-apart"
    label = "rlplane (native, shm, a put per sample)"
    selects_rows = False

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env)
        self._apart: tuple[Any, list[Any]] | None = None  # (the workload, its samples one by one)

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        if self._apart is None or self._apart[0] is not batch.work:  # cut before the clock starts
            self._apart = (batch.work, [batch.work.select([i]) for i in range(len(batch.ids))])
        parts = self._apart[1]
        t0 = time.monotonic()
        metas = [self.client.put_samples(key, w.fields, sample_ids=[sid]) for w, sid in zip(parts, batch.ids)]
        t1 = time.monotonic()
        every = SampleMeta.concat(metas)  # the fields every sample holds (a text-only one holds no image field)
        extra = sorted(frozenset().union(*(m.fields for m in metas)) - every.fields)
        rich = [i for i, m in enumerate(metas) if m.fields >= set(extra)]
        handle = {"meta": every.to_dict(), "extra": extra, "rich": rich}
        return Sent(msgpack.packb(handle, use_bin_type=True), t0, t1)

    def parts(self, op: str) -> dict[str, float] | None:
        return None  # (a put per sample, and two reads: no one op's parts)

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        """The batch as written: the fields every sample holds in one read, the image
        fields of the samples that have them in another (their rows None for the rest)."""
        from rlplane.packed import PackedTensor

        h = msgpack.unpackb(handle, raw=False)
        meta, extra, rich = SampleMeta.from_dict(h["meta"]), h["extra"], h["rich"]
        t0 = time.monotonic()
        got = self.client.read_columns(meta, sorted(meta.fields))
        if extra:
            more = self.client.read_columns(meta.subset(rich), extra)
            for name in extra:
                rows: list[Any] = [None] * len(meta)
                for i, row in zip(rich, more[name].rows):
                    rows[i] = row
                got[name] = PackedTensor(rows, more[name].dim_to_pack, pad_to_max_shape=more[name].pad_to_max_shape)
        return got, t0, time.monotonic()


class RlplaneNativeZmq(RlplaneNative):
    """The native engine with every byte over ZMQ frames (what a client on another host uses)."""

    name = "rlplane-native-zmq"
    label = "rlplane (native, zmq)"
    data_path = "zmq"


class RlplaneNativeTe(RlplaneNative):
    """The native engine with bulk bytes one-sided over Mooncake's transfer engine (TCP
    here; what a client on another host uses when the service runs RLPLANE_TE_PROTOCOL)."""

    name = "rlplane-native-te"
    label = "rlplane (native, te)"
    data_path = "te"


class RlplaneTQ(RlplanePath):
    """rlplane's ``tq`` transport to a service on the TransferQueue backend (``simple``)."""

    name = "rlplane-tq"
    label = "rlplane (tq)"
    transport = "tq"

    def service_url(self, env: WorkerEnv) -> str:
        if env.tq_url is None:
            raise RuntimeError("no TransferQueue-backed service: pass --tq-url (the bench starts one when it embeds)")
        return env.tq_url


class RlplaneHTTP(RlplanePath):
    name = "rlplane-http"
    label = "rlplane (http)"
    transport = "http"


class RlplaneMooncake(RlplanePath):
    """rlplane's ``tq`` transport to a service on the Mooncake backend (TCP here; RDMA
    on a cluster): the bytes go into the service's Mooncake segments."""

    name = "rlplane-mooncake"
    label = "rlplane (tq, mooncake)"
    transport = "tq"

    def service_url(self, env: WorkerEnv) -> str:
        if env.mooncake_url is None:
            raise RuntimeError("no Mooncake-backed service: pass --mooncake-url (the bench starts one when it embeds)")
        return env.mooncake_url


class _EncodedPath(BenchPath):
    """A path that moves the already-encoded columns (no rlplane encode, checks or decode)."""

    def verify(self, batch: Batch, got: Any, rows: list[int] | None = None, fields: list[str] | None = None) -> list[str]:
        work, ids, enc = batch.work, batch.ids, batch.encoded
        if rows is not None:  # what the shard's samples were stored as
            work, ids = batch.subset(rows), [batch.ids[i] for i in rows]
            work.fields = {f: work.fields[f] for f in fields or work.fields}
            enc = encode(self.registry, work.fields, work.lengths, sample_ids=ids)
        problems = [
            f"field {name!r}: stored bytes differ"
            for name, col in enc.columns.items()
            if name not in got or not same_bits(col.values, got[name].values)
        ]
        if problems:
            return problems
        decoded = decode(self.registry, got, enc.tags, "padded")
        return diff_fields(self.registry, work.fields, decoded, work.lengths, sample_ids=ids)


class RawTQ(_EncodedPath):
    """TransferQueue's own client on the service's store, the way ``kv_batch_put`` /
    ``kv_batch_get`` use it (``kv_retrieve_meta`` + ``put``; ``kv_retrieve_meta`` +
    ``get_data``), on the same encoded columns, through the same storage units. The
    engine beneath rlplane's ``tq`` transport, without rlplane's checks."""

    name = "raw-tq"
    label = "raw TransferQueue"
    selects_rows = True

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env)
        from rlplane.transports.tq import close_store_client, store_client
        from tensordict import TensorDict

        if env.tq_info is None:
            raise RuntimeError("the service publishes no TransferQueue address: raw-tq cannot run")
        self._TensorDict = TensorDict
        self.client = store_client(env.tq_info, f"bench-raw-{id(self)}")
        self._close = close_store_client

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        cols = batch.encoded.columns
        t0 = time.monotonic()
        data = self._TensorDict({k: c.to_nested() for k, c in cols.items()}, batch_size=len(batch.ids))
        meta = self.client.kv_retrieve_meta(batch.ids, key, create=True)
        meta.update_custom_meta(batch.encoded.tags)
        self.client.put(data, meta)
        t1 = time.monotonic()
        return Sent(msgpack.packb({"partition": key, "fields": list(cols)}), t0, t1)

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        h = msgpack.unpackb(handle, raw=False)
        t0 = time.monotonic()
        meta = self.client.kv_retrieve_meta(batch.ids, h["partition"], create=False)
        got = self.client.get_data(meta.select_fields(h["fields"]))
        t1 = time.monotonic()
        return {k: _as_column(got[k]) for k in h["fields"]}, t0, t1

    def read_rows(self, batch: Batch, handle: Any, rows: list[int], fields: list[str]) -> tuple[Any, float, float]:
        h = msgpack.unpackb(handle, raw=False)
        ids = [batch.ids[i] for i in rows]
        t0 = time.monotonic()
        meta = self.client.kv_retrieve_meta(ids, h["partition"], create=False)
        got = self.client.get_data(meta.select_fields(fields))
        t1 = time.monotonic()
        return {k: _as_column(got[k]) for k in fields}, t0, t1

    def clear(self, key: str) -> None:
        self.client.clear_partition(key)

    def close(self) -> None:
        self._close(self.client)


class RayObjectStore(_EncodedPath):
    """The Ray object store: ``ray.put`` of the encoded columns in the writer, ``ray.get``
    in the reader (the handle is the ObjectRef, passed through the driver). The columns
    travel as numpy arrays (bytes, with their dtype's name): Ray moves those out of band,
    zero copy, where it pickles torch tensors in band (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``
    is off by default), which would make the peer slower than Ray is when used well."""

    name = "ray-object-store"
    label = "Ray object store"

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        import ray

        t0 = time.monotonic()
        payload = {k: (c.values.view(torch.uint8).numpy(), dtype_name(c.values.dtype), c.offsets.numpy())
                   for k, c in batch.encoded.columns.items()}
        ref = ray.put(payload)
        t1 = time.monotonic()
        return Sent([ref], t0, t1)  # in a list, so Ray hands the reader the ref, not the value

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        import ray

        t0 = time.monotonic()
        payload = ray.get(handle[0])
        with warnings.catch_warnings():  # (the arrays are read-only views of the object store: as a user gets them)
            warnings.simplefilter("ignore", UserWarning)
            out = {k: Column(torch.from_numpy(v).view(dtype_from_name(d)), torch.from_numpy(o))
                   for k, (v, d, o) in payload.items()}
        t1 = time.monotonic()
        return out, t0, t1


class LegacyRow:
    """One sample's rows, field by field: what a pre-data-plane framework kept per
    sample in a numpy object array (each pickled on its own)."""

    __slots__ = ("rows",)

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows


class LegacyObjectArray(_EncodedPath):
    """The path RL frameworks used before a data plane: the batch as a numpy object array
    of per-sample row wrappers, handed to the reader as a Ray actor call argument. Ray
    pickles each object. Pickle is the point here (this row emulates that legacy path);
    rlplane's own wire never pickles. The reader collates the rows back into columns.

    Timing: the writer's part ends when the call's argument is serialized and stored;
    the reader's part ends when it has collated the rows (it stamps the time in the call)."""

    name = "legacy-pickle"
    label = "legacy pickle (actor call)"
    needs_peer = True

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        import ray

        rows = _legacy_rows(batch.encoded)  # the legacy framework already holds its batch this way
        t0 = time.monotonic()
        done = peer.legacy_receive.remote(key, rows)
        t1 = time.monotonic()
        arrived = ray.get(done)
        return Sent({"key": key, "sent": t1, "arrived": arrived}, t0, t1)

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        return LEGACY_INBOX.pop(handle["key"]), handle["sent"], handle["arrived"]


#: Columns the reader's ``legacy_receive`` collated, by key, until ``read`` takes them.
LEGACY_INBOX: dict[str, dict[str, Column]] = {}


def legacy_collate(key: str, rows: np.ndarray) -> float:
    """Run in the reader by the legacy actor call: rows -> columns; returns when it finished."""
    names = list(rows[0].rows) if len(rows) else []
    LEGACY_INBOX[key] = {n: Column.from_rows([r.rows[n] for r in rows]) for n in names}
    return time.monotonic()


def _legacy_rows(enc: Encoded) -> np.ndarray:
    batch = next(iter(enc.columns.values())).num_rows if enc.columns else 0
    per_field = {n: c.rows() for n, c in enc.columns.items()}
    out = np.empty(batch, dtype=object)
    for i in range(batch):
        # own storage per row: pickling a view would pickle the whole column
        out[i] = LegacyRow({n: rows[i].clone() for n, rows in per_field.items()})
    return out


def _as_column(value: Any) -> Column:
    if isinstance(value, torch.Tensor) and value.is_nested:
        return Column.from_nested(value)
    if isinstance(value, torch.Tensor):
        return Column.uniform(value, value.size(0))
    return Column.from_rows([torch.as_tensor(r).reshape(-1) for r in value])


#: Every path, in table order. Raw TransferQueue is the reference every ratio divides by.
PATHS: dict[str, type[BenchPath]] = {
    p.name: p for p in (RlplaneNative, RlplaneNativeApart, RlplaneNativeZmq, RlplaneNativeTe, RlplaneTQ, RlplaneHTTP, RlplaneMooncake, RawTQ, MooncakeDataProto, RayObjectStore,
              LegacyObjectArray)
}
REFERENCE = RawTQ.name

__all__ = ["PATHS", "REFERENCE", "Batch", "BenchPath", "Sent", "WorkerEnv", "legacy_collate"]
