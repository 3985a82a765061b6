"""TQTransport: columns straight to TransferQueue storage units over ZMQ.

The service owns a TransferQueue controller and storage units; this transport talks to
them directly with TransferQueue's own client, so bulk bytes never touch the HTTP proxy.
It needs only the addresses the service publishes at ``GET /v1/transport`` — no Ray
cluster, no ``ray.init`` — and the ``transfer_queue`` package (rlplane's ``service``
extra), imported on first use so ``import rlplane`` stays light.

TransferQueue's key-value calls are lenient where rlplane is strict, so this transport
adds the strictness: a key that is not stored is dropped silently by TransferQueue, a
field missing on some keys comes back as nothing at all, and tags replace rather than
merge. Here every put checks which samples exist first, every get checks each
(sample, field) against the wire geometry in the sample's tags before fetching and the
row counts after, and tags are merged before they are written. Each row travels as a
1-D tensor (its true shape is in the tags), so TransferQueue never guesses a shape.

Example::

    t = TQTransport.from_info(requests.get(url + "/v1/transport").json()["tq"])
    t.put("step-0", ids, enc.columns, enc.tags, create=True)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from typing import Any, Mapping, Sequence

import torch

from rlplane.codec import WIRE_TAG, merge_tags
from rlplane.column import Column
from rlplane.errors import DuplicateSampleError, MissingDataError, TransportError, WireFormatError
from rlplane.transports.base import PartitionInfo, Transport, check_put

log = logging.getLogger(__name__)

#: Per-sample bookkeeping this transport keeps in the tags: stored bytes of every field.
NBYTES_TAG = "_rlplane_nbytes"


def _tq():
    """Import TransferQueue's client pieces on first use (they pull in Ray's module, not a cluster)."""
    # TransferQueue sizes its thread pools from TQ_NUM_THREADS at import; its default (8)
    # only warns on small hosts.
    os.environ.setdefault("TQ_NUM_THREADS", str(max(1, min(8, os.cpu_count() or 1))))
    try:
        from tensordict import TensorDict
        from transfer_queue.client import TransferQueueClient
        from transfer_queue.utils.enum_utils import Role
        from transfer_queue.utils.zmq_utils import ZMQServerInfo
    except ImportError as err:
        raise TransportError(
            f"transport 'tq' needs the transfer_queue package ({err}); "
            "pip install 'rlplane[service]' or connect with transport='http'"
        ) from None
    return TensorDict, TransferQueueClient, Role, ZMQServerInfo


def server_info_to_dict(info: Any) -> dict[str, Any]:
    """JSON form of a TransferQueue ZMQServerInfo (what ``/v1/transport`` publishes)."""
    role = getattr(info.role, "value", info.role)
    return {"role": str(role), "id": str(info.id), "ip": str(info.ip), "ports": {k: int(v) for k, v in info.ports.items()}}


def reachable(info: Mapping[str, Any], timeout: float = 1.0) -> bool:
    """Whether the controller and every storage unit accept a TCP connection within ``timeout``."""
    try:
        servers = [info["controller"], *info["storage_units"].values()]
        for server in servers:
            for port in server["ports"].values():
                with socket.create_connection((server["ip"], int(port)), timeout=timeout):
                    pass
        return True
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return False


def store_client(info: Mapping[str, Any], client_id: str) -> Any:
    """TransferQueue's own client, connected to the store ``info`` describes (the ``tq``
    entry of ``GET /v1/transport``). TransportError when the address is malformed or
    the store does not answer.

    Example: ``client = store_client(api.json("GET", "/v1/transport")["tq"], "bench")``.
    """
    _, TransferQueueClient, Role, ZMQServerInfo = _tq()

    def server(d: Mapping[str, Any]) -> Any:
        return ZMQServerInfo(Role(d["role"]), d["id"], d["ip"], dict(d["ports"]))

    try:
        controller = server(info["controller"])
        units = {name: server(d) for name, d in info["storage_units"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise TransportError(f"the service's TransferQueue address is malformed ({err})") from None
    client = TransferQueueClient(client_id, controller)
    try:
        client.initialize_storage_manager("SimpleStorage", {"zmq_info": units})
    except (TimeoutError, RuntimeError, OSError, ValueError) as err:
        client.close()
        raise TransportError(
            f"cannot reach the TransferQueue store at {controller.ip} ({err}); "
            "connect with transport='http' if the storage units are not routable from here"
        ) from err
    return client


class TQTransport(Transport):
    """Direct data path to a TransferQueue store (see the module docstring)."""

    name = "tq"

    def __init__(self, info: Mapping[str, Any], *, client_id: str | None = None) -> None:
        self._TensorDict = _tq()[0]
        self.info = dict(info)
        self._client = store_client(info, client_id or f"rlplane-{os.getpid()}-{uuid.uuid4().hex[:6]}")

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TQTransport:
        """From the ``tq`` entry of ``GET /v1/transport``."""
        return cls(info)

    # -- the Transport verbs ---------------------------------------------------------
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        *,
        create: bool,
    ) -> None:
        check_put(sample_ids, columns, tags)
        self._run(self._put(partition, list(sample_ids), columns, tags, create))

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        return self._run(self._get(partition, list(sample_ids), list(fields)))

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        return self._run(self._clear(partition, None if sample_ids is None else list(sample_ids)))

    def partitions(self) -> list[str]:
        listing = self._run(self._client.async_kv_list(None))
        return sorted(p for p, keys in listing.items() if keys)

    def describe(self, partition: str) -> PartitionInfo:
        keys = self._run(self._client.async_kv_list(partition)).get(partition) or {}
        if not keys:
            raise MissingDataError(partition, {}, hint="the partition holds no samples")
        counts: dict[str, int] = {}
        nbytes = 0
        for tag in keys.values():
            for name, n in (tag.get(NBYTES_TAG) or {}).items():
                counts[name] = counts.get(name, 0) + 1
                nbytes += int(n)
        return PartitionInfo(partition, list(keys), counts, nbytes)

    def close(self) -> None:
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            client.close()

    # -- implementation --------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        if self._client is None:
            raise TransportError("transport is closed")
        try:
            return self._client._run_coroutine(coro)
        except (MissingDataError, DuplicateSampleError, WireFormatError):
            raise
        except (RuntimeError, OSError, ValueError, asyncio.TimeoutError) as err:
            raise TransportError(f"TransferQueue call failed: {err}") from err

    async def _meta(self, partition: str, ids: list[str], create: bool) -> Any:
        return await self._client.async_kv_retrieve_meta(keys=ids, partition_id=partition, create=create)

    async def _unknown(self, partition: str, ids: list[str]) -> list[str]:
        """Which of ``ids`` the store does not hold (TransferQueue drops them silently)."""
        held = (await self._client.async_kv_list(partition)).get(partition) or {}
        return [s for s in ids if s not in held]

    async def _put(
        self,
        partition: str,
        ids: list[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        create: bool,
    ) -> None:
        existing = await self._meta(partition, ids, create=False)
        if create and existing.size:
            held = set(ids) - set(await self._unknown(partition, ids))
            raise DuplicateSampleError(partition, [s for s in ids if s in held])
        if not create and existing.size != len(ids):
            unknown = await self._unknown(partition, ids)
            raise MissingDataError(partition, {s: [] for s in unknown}, hint="put_samples them before write_columns")
        old = list(existing.custom_meta) if not create else [{} for _ in ids]
        sizes = {name: (col.row_numels() * col.values.element_size()).tolist() for name, col in columns.items()}
        merged = [
            merge_tags(old[i], {**tags[i], NBYTES_TAG: {name: sizes[name][i] for name in columns}})
            for i in range(len(ids))
        ]
        data = self._TensorDict({name: col.to_nested() for name, col in columns.items()}, batch_size=len(ids))
        meta = await self._meta(partition, ids, create=True) if create else existing
        try:
            meta.update_custom_meta(merged)
            if columns:
                await self._client.async_put(data, meta)  # data first, then the tags that make it readable
            else:
                await self._client.async_set_custom_meta(meta)
        except BaseException:
            if create:  # nothing of a failed put_samples may stay behind
                await self._client.async_clear_samples(meta)
            raise

    async def _get(
        self, partition: str, ids: list[str], fields: list[str]
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        if not ids:
            return {f: Column.empty(torch.uint8) for f in fields}, []
        meta = await self._meta(partition, ids, create=False)
        if meta.size != len(ids):
            unknown = await self._unknown(partition, ids)
            raise MissingDataError(partition, {s: [] for s in unknown})
        tags = [dict(t) for t in meta.custom_meta]
        missing = {}
        for sid, tag in zip(ids, tags):
            have = tag.get(WIRE_TAG) or {}
            lacking = [f for f in fields if f not in have]
            if lacking:
                missing[sid] = lacking
        if missing:
            raise MissingDataError(partition, missing)
        for tag in tags:
            tag.pop(NBYTES_TAG, None)
        if not fields:
            return {}, tags
        got = await self._client.async_get_data(meta.select_fields(fields))
        columns = {}
        for name in fields:
            if name not in got.keys():
                raise MissingDataError(
                    partition, {s: [name] for s in ids}, hint="the storage units did not return the field"
                )
            columns[name] = _column(got[name], name, len(ids))
        return columns, tags

    async def _clear(self, partition: str, ids: list[str] | None) -> int:
        if ids is None:
            held = (await self._client.async_kv_list(partition)).get(partition) or {}
            if held:
                await self._client.async_clear_partition(partition)
            return len(held)
        if not ids:
            return 0
        meta = await self._meta(partition, ids, create=False)
        if meta.size:
            await self._client.async_clear_samples(meta)
        return int(meta.size)


def _column(value: Any, name: str, rows: int) -> Column:
    """One field as TransferQueue returns it (jagged NestedTensor of 1-D rows, a dense
    [B, n] tensor when every row has the same length, or a list) as a Column."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        col = Column.from_nested(value)
    elif isinstance(value, torch.Tensor) and value.dim() >= 1:
        col = Column.uniform(value, value.size(0))
    elif isinstance(value, (list, tuple)):
        col = Column.from_rows([torch.as_tensor(r).reshape(-1) for r in value])
    else:
        raise WireFormatError(f"TransferQueue returned {type(value).__name__}, not rows", field=name)
    if col.num_rows != rows:
        raise WireFormatError(f"TransferQueue returned {col.num_rows} rows for {rows} samples", field=name)
    return col


__all__ = ["TQTransport", "NBYTES_TAG", "reachable", "server_info_to_dict", "store_client"]
