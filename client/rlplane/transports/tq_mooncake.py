"""Mooncake's store (TransferQueue's ``MooncakeStore``) behind :class:`~rlplane.transports.tq.TQTransport`.

What differs from the shared part: the client reaches the Mooncake master and metadata
server (it mounts no memory of its own: samples live in the service's segments, so a
worker that exits takes nothing with it); a key-value store cannot hold a zero-byte
value, so empty rows travel as one element each and are cut back on read by the byte
count recorded per row; a clear removes each sample's own values from the pool (by the
fields its tags record), then the controller forgets the samples; a read of a value the
pool lost says which.

Example::

    t = tq_transport(info)   # info["backend"] == "mooncake": a MooncakeTQTransport
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import torch

from rlplane.column import Column
from rlplane.errors import TransportError, UnavailableError
from rlplane.transports.tq import NBYTES_TAG, TQTransport, reachable, refuses
from rlplane.transports.tq_errors import mooncake_not_found


class MooncakeTQTransport(TQTransport):
    """A TransferQueue controller over a Mooncake store."""

    kind = "mooncake"

    @classmethod
    def storage(cls, info: Mapping[str, Any], server: Any) -> tuple[str, dict[str, Any], str]:
        config = mooncake_config(info)
        return "MooncakeStore", config, config["master_server_address"]

    @classmethod
    def data_endpoints(cls, info: Mapping[str, Any]) -> list[tuple[str, int]]:
        mc = info["mooncake"]
        return [_host_port(mc["master_address"]), _host_port(urlsplit(mc["metadata_server"]).netloc)]

    @classmethod
    def before_connect(cls, info: Mapping[str, Any], config: dict[str, Any], where: str) -> None:
        if not reachable(info, timeout=2.0):
            # Mooncake's own setup retries an unreachable master for ~90 s; say so at once.
            raise TransportError(
                f"cannot reach the Mooncake master at {where} or its metadata server "
                f"{info['mooncake']['metadata_server']} from this host; check the service is up and "
                "that this pod may reach the data ports (NetworkPolicy), or connect with transport='http'"
            )
        # Mooncake's transfer engine otherwise binds its RPC socket to whichever interface
        # it finds first; bind it where this client says it can be reached.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config["local_hostname"])

    def _refusing(self) -> str | None:
        """As for every TransferQueue store, and ``mooncake_master`` when its RPC or metadata
        port refuses a connection (its process died: Mooncake's client retries it for long)."""
        dead = super()._refusing()
        if dead is not None:
            return dead
        return "mooncake_master" if any(refuses(h, p) for h, p in self.data_endpoints(self.info)) else None

    def _pool(self) -> Any:
        """This client's Mooncake store (inside TransferQueue's MooncakeStoreClient)."""
        return self._client.storage_manager.storage_client._store

    def replica_endpoints(self, keys: list[str]) -> dict[str, set[str]]:
        """Key (``{global index}@{field}``) -> the transfer endpoints of the segments holding
        its memory replicas (keys the pool does not know are left out)."""
        store = self._pool()
        out = {}
        for key, replicas in store.batch_get_replica_desc(keys).items():
            out[key] = {r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                        for r in replicas if r.is_memory_replica()}
        return out

    async def _undo_create(self, meta: Any, data: Any, columns: Mapping[str, Column], err: BaseException) -> None:
        await self._clear_samples(meta.add_fields(data, set_all_ready=False) if columns else meta)

    def _not_found(self, err: Exception, meta: Any, ids: list[str]) -> dict[str, list[str]]:
        return mooncake_not_found(str(err), dict(zip(meta.global_indexes, ids)))

    def _restored(self, col: Column, stored: list[int]) -> Column:
        return _unpad(col, stored)

    def _rows(self, col: Column) -> torch.Tensor:
        if col.num_rows and bool((col.row_numels() == 0).any()):  # no zero-byte values: one element each
            pad = torch.zeros(1, dtype=col.dtype)
            col = Column.from_rows([r if r.numel() else pad for r in col.rows()], col.dtype)
        return col.to_nested()

    async def _clear_all(self, partition: str, held: Mapping[str, Any]) -> None:
        await self._clear_samples(await self._meta(partition, list(held), create=False))

    async def _clear_samples(self, meta: Any) -> None:
        """Remove every value each sample holds from the pool, then the controller forgets
        them. (TransferQueue's own clear removes only the fields *every* sample holds, its
        meta's ``field_names``: a clear of samples of different fields left the rest in the
        pool for good, a mix of image and text samples their images.)"""
        keys = pool_keys(meta.global_indexes, meta.custom_meta)
        await self._client._mark_clearing_in_controller(meta)
        if keys:
            store = self._pool()
            codes = await asyncio.get_running_loop().run_in_executor(None, lambda: store.batch_remove(keys, force=True))
            failed = [(k, c) for k, c in zip(keys, codes) if c not in (0, _NOT_FOUND)]
            if failed:
                raise UnavailableError(f"the Mooncake pool did not remove {len(failed)} of {len(keys)} values "
                                       f"(first {failed[0][0]!r}: error {failed[0][1]}); the samples stay listed: "
                                       "clear them again", component="mooncake_master")
        await self._client._clear_meta_in_controller(meta)  # (marked as clearing above)


#: Mooncake's "object not found": a value already gone (a clear that ran before, a lost segment).
_NOT_FOUND = -704


def pool_keys(global_indexes: Sequence[int], tags: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pool's keys (``{global index}@{field}``) of every value each sample holds, by the
    fields its tags record a byte count for.

    Example: ``pool_keys([3], [{NBYTES_TAG: {"input_ids": 64}}])  # ['3@input_ids']``
    """
    return [f"{g}@{f}" for g, t in zip(global_indexes, tags) for f in sorted((t or {}).get(NBYTES_TAG) or {})]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def mooncake_config(info: Mapping[str, Any]) -> dict[str, Any]:
    """TransferQueue's MooncakeStore config for a client of the store ``info`` describes.

    The client mounts no memory (samples live in the service's segments, so a worker that
    exits takes nothing with it) and advertises ``RLPLANE_MOONCAKE_HOSTNAME`` or else the
    local address it reaches the master from. Mooncake gives each client engine its own
    port, so engine names are unique per process.
    """
    mc = info["mooncake"]
    hostname = os.environ.get("RLPLANE_MOONCAKE_HOSTNAME") or _local_address_towards(*_host_port(mc["master_address"]))
    return {
        "metadata_server": mc["metadata_server"],
        "master_server_address": mc["master_address"],
        "local_hostname": hostname,
        "protocol": mc.get("protocol", "tcp"),
        "device_name": mc.get("device_name", ""),
        "global_segment_size": 0,
        "local_buffer_size": int(mc.get("buffer_bytes", 64 << 20)),
        "hard_pin": True,
    }


def _local_address_towards(host: str, port: int) -> str:
    """The local IP this host would use to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _unpad(col: Column, nbytes: list[int]) -> Column:
    """Cut the rows stored as one padding element (recorded size 0) back to empty."""
    empty = [i for i, n in enumerate(nbytes) if n == 0]
    if not empty:
        return col
    rows = col.rows()
    for i in empty:
        rows[i] = rows[i][:0]
    return Column.from_rows(rows, col.dtype)


__all__ = ["MooncakeTQTransport", "mooncake_config", "pool_keys"]
