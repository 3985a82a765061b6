"""The bench's Mooncake DataProto row: the installed Mooncake's structured store
(``mooncake.structured_object_store.MooncakeBundleTransfer``), run the way its API
intends, the closest peer to rlplane's verbs.

Set-up (what :func:`start_master` and :class:`MooncakeDataProto` do): the bench starts
one ``mooncake_master`` with its HTTP metadata server on free 127.0.0.1 ports (stopped
by pid at the end); the writer's store client mounts a segment (the bytes live there,
TCP transfer), the reader's mounts none. A batch is what a DataProto user holds:
``batch`` = the padded per-sample tensors (``[B, S]`` and ``[B]``) in the dtypes rlplane
stores them, ``non_tensor_batch`` = per-sample object arrays for the image fields
(``pixel_values`` as the uint16 bits of bf16: its ragged codecs refuse bf16; a sample's
images are one concatenated array, so the boundaries between them travel only through
``image_grid_thw``). ``put_dataproto`` writes it, ``get_dataproto`` reads it back
(``rows=`` for a DP shard); the export/import handle crosses between the processes.

Example::

    master = start_master()                        # in the driver
    path = MooncakeDataProto(replace(env, dataproto_master=master.info()))
    sent = path.write(batch, "bench-0", peer=None)
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import msgpack
import numpy as np
import torch
from rlplane.fields import Registry
from rlplane.packed import PackedTensor

from rlplane_tools.bench.base import Batch, BenchPath, Sent, WorkerEnv

#: The writer's segment: the largest batch this row moves (text-scale B=8192 padded,
#: ~240 MB) with room for one not yet cleared. (It sits out the vlm-step batch sweep.)
SEGMENT_BYTES = 1 << 30
#: The store that names the bench's master (its log directory, nothing else).
STORE_NAME = "bench-dataproto"


def start_master() -> Any:
    """One ``mooncake_master`` (+ HTTP metadata server) on free loopback ports; ``.stop()`` it."""
    from rlplane_service.mooncake import MooncakeMaster
    from rlplane_service.settings import ServiceSettings

    return MooncakeMaster.start(ServiceSettings(store_name=STORE_NAME), "127.0.0.1")


def dataproto_of(registry: Registry, fields: dict[str, Any]) -> dict[str, Any]:
    """The DataProto a user holding ``fields`` would put: padded tensors in ``batch`` (in
    the stored dtype), packed image rows in ``non_tensor_batch`` (one array per sample)."""
    batch: dict[str, torch.Tensor] = {}
    non_tensor: dict[str, np.ndarray] = {}
    for name, value in fields.items():
        spec = registry.get(name)
        if isinstance(value, PackedTensor):
            non_tensor[name] = _object_rows(value, spec.stored_dtype(value.dtype or torch.float32))
        else:
            batch[name] = _numpy_safe(value.to(spec.stored_dtype(value.dtype)))
    return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": {}}


def _numpy_safe(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def _object_rows(value: PackedTensor, dtype: torch.dtype) -> np.ndarray:
    rows = value.rows
    width = next((r[0].shape[1:] for r in rows if r), ())
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        t = torch.cat(row) if row else torch.empty((0, *width))
        out[i] = _numpy_safe(t.to(dtype)).numpy()
    return out


def same_dataproto(want: dict[str, Any], got: dict[str, Any], rows: list[int] | None = None,
                   fields: list[str] | None = None) -> list[str]:
    """Every field of ``want`` (``fields`` of it, at ``rows`` when a shard) bit for bit
    in ``got``: a field missing, None or different is a problem named by field."""
    problems = []
    for section in ("batch", "non_tensor_batch"):
        for name, expect in want[section].items():
            if fields is not None and name not in fields:
                continue
            value = got.get(section, {}).get(name)
            if rows is not None:
                expect = expect[rows]
            if value is None:
                problems.append(f"DataProto field {name!r} came back as None")
                continue
            if section == "batch":
                ok = isinstance(value, torch.Tensor) and torch.equal(value, expect)
            else:
                ok = len(value) == len(expect) and all(
                    a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b) for a, b in zip(value, expect)
                )
            if not ok:
                problems.append(f"DataProto field {name!r}: what arrived differs from what was put")
    return problems


class MooncakeDataProto(BenchPath):
    """Mooncake's structured DataProto store (``put_dataproto`` / ``get_dataproto``)."""

    name = "mooncake-dataproto"
    label = "Mooncake DataProto"
    selects_rows: ClassVar[bool] = True

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env)
        from mooncake.structured_object_store import MooncakeBundleTransfer

        from rlplane_service.mooncake import mount_segment
        from rlplane_service.settings import ServiceSettings

        if env.dataproto_master is None:
            raise RuntimeError("no mooncake_master for the DataProto row (the bench starts one)")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self._store = None
        self._settings = ServiceSettings(store_name=STORE_NAME)
        self._mount = lambda size: mount_segment(self._settings, env.dataproto_master, "127.0.0.1", size)
        self._Transfer = MooncakeBundleTransfer
        self._refs: dict[str, Any] = {}
        self._held: tuple[Batch, dict] | None = None  # (the batch, its DataProto)

    def _transfer(self, writer: bool) -> Any:
        if self._store is None:  # the writer's client mounts the segment; a reader's mounts none
            self._store = self._mount(SEGMENT_BYTES if writer else 0)
            self._tx = self._Transfer(self._store)
        return self._tx

    def _dataproto(self, batch: Batch) -> dict:
        # Converted once per batch, untimed. Keyed by the batch itself, not id(batch): a freed
        # batch's id is reused, and a stale conversion read as "the peer returned wrong bytes".
        if self._held is None or self._held[0] is not batch:
            self._held = (batch, dataproto_of(self.registry, batch.work.fields))
        return self._held[1]

    def write(self, batch: Batch, key: str, peer: Any) -> Sent:
        from mooncake.structured_object_store import export_dataproto_ref

        dp = self._dataproto(batch)
        tx = self._transfer(writer=True)
        t0 = time.monotonic()
        ref = tx.put_dataproto(dp, partition=key)
        t1 = time.monotonic()
        self._refs[key] = ref
        return Sent(msgpack.packb(export_dataproto_ref(ref), use_bin_type=True), t0, t1)

    def read(self, batch: Batch, handle: Any) -> tuple[Any, float, float]:
        return self.read_rows(batch, handle, None, None)

    def read_rows(self, batch: Batch, handle: Any, rows: list[int] | None, fields: list[str] | None) -> tuple[Any, float, float]:
        from mooncake.structured_object_store import import_dataproto_ref

        tx = self._transfer(writer=False)
        ref = import_dataproto_ref(msgpack.unpackb(handle, raw=False))
        t0 = time.monotonic()
        got = tx.get_dataproto(ref, fields=fields, rows=rows)
        return got, t0, time.monotonic()

    def verify(self, batch: Batch, got: Any, rows: list[int] | None = None, fields: list[str] | None = None) -> list[str]:
        return same_dataproto(self._dataproto(batch), got, rows, fields)

    def clear(self, key: str) -> None:
        ref = self._refs.pop(key, None)
        if ref is not None:
            self._transfer(writer=True).cleanup_dataproto(ref)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


__all__ = ["MooncakeDataProto", "dataproto_of", "same_dataproto", "start_master"]
