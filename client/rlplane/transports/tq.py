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
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from rlplane.codec import WIRE_TAG, merge_tags
from rlplane.streams import DirectStreams
from rlplane.column import Column
from rlplane.errors import (DuplicateSampleError, FieldsHeldError, MissingDataError, RlplaneError, ShapeError,
                            TransportError, UnavailableError, WireFormatError, lost_hint)
from rlplane.tags import BORN_TAG, RowTags, born_of, incarnation, stale, stale_meta
from rlplane.transports.base import PartitionInfo, Transport, check_put, check_written_lengths
from rlplane.transports.tq_errors import translate

log = logging.getLogger(__name__)

#: A call still running after this long starts checking whether a TransferQueue process died.
PROBE_EVERY_S, PROBE_TIMEOUT_S = 1.0, 0.5

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
    """Whether the controller and every data endpoint (the storage units' ports, or the
    Mooncake master and metadata server) accept a TCP connection within ``timeout``."""
    try:
        for host, port in _endpoints(info):
            with socket.create_connection((host, port), timeout=timeout):
                pass
        return True
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return False


def _endpoints(info: Mapping[str, Any]) -> list[tuple[str, int]]:
    controller = info["controller"]
    return [(controller["ip"], int(p)) for p in controller["ports"].values()] + transport_class(info).data_endpoints(info)


def store_client(info: Mapping[str, Any], client_id: str) -> Any:
    """TransferQueue's own client, connected to the store ``info`` describes (the ``tq``
    entry of ``GET /v1/transport``), with the storage manager its backend needs (the
    backend's transport class says which). TransportError when the address is malformed
    or the store does not answer.

    Example: ``client = store_client(api.json("GET", "/v1/transport")["tq"], "bench")``.
    """
    _, TransferQueueClient, Role, ZMQServerInfo = _tq()

    def server(d: Mapping[str, Any]) -> Any:
        return ZMQServerInfo(Role(d["role"]), d["id"], d["ip"], dict(d["ports"]))

    try:
        kind = transport_class(info)
        controller = server(info["controller"])
        manager, config, where = kind.storage(info, server)
    except (KeyError, TypeError, ValueError, AttributeError, OSError) as err:
        raise TransportError(f"the service's TransferQueue address is malformed ({err})") from None
    kind.before_connect(info, config, where)
    client = TransferQueueClient(client_id, controller)
    try:
        client.initialize_storage_manager(manager, config)
    except (TimeoutError, RuntimeError, OSError, ValueError, ImportError) as err:
        client.close()
        raise TransportError(
            f"cannot reach the TransferQueue store at {where} ({err}); "
            "connect with transport='http' if the storage is not routable from here"
        ) from err
    _no_ray_context(client.storage_manager)
    return client


def close_store_client(client: Any) -> None:
    """Close a :func:`store_client`, including what TransferQueue's KV managers leave open
    (the Mooncake client that unregisters this process's engine, the thread pool).

    A storage call this transport gave up on (its master or unit died) can still run in a
    thread of TransferQueue's; closing the Mooncake client under it crashed the process
    (SIGSEGV). Those threads get up to SETTLE_S to return; a client one of them still uses
    is left open (and said so) rather than closed under it."""
    manager = getattr(client, "storage_manager", None)
    kv_client = getattr(manager, "storage_client", None)
    pools = [getattr(getattr(client, "_loop", None), "_default_executor", None),
             getattr(manager, "_multi_threads_executor", None)]
    settled = _settled([p for p in pools if p is not None], time.monotonic() + SETTLE_S)
    try:
        if kv_client is not None and settled:
            kv_client.close()
        elif kv_client is not None:
            log.warning("a storage call given up on still runs after %.0f s (its Mooncake master or unit does not "
                        "answer): this process's Mooncake client is left open, not closed under it", SETTLE_S)
    except Exception as err:  # noqa: BLE001 - closing: report, carry on
        log.warning("closing the Mooncake client failed: %s", err)
    client.close()


#: How long a close waits for the storage calls still running in TransferQueue's threads.
SETTLE_S = 30.0


def _settled(pools: list[Any], deadline: float) -> bool:
    """Shut ``pools`` (thread pools) down and wait until ``deadline`` for the calls running
    in them to return; whether they all did."""
    for pool in pools:
        pool.shutdown(wait=False)  # (idle threads leave at once)
    threads = [t for pool in pools for t in list(getattr(pool, "_threads", ()))]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def refuses(host: str, port: int) -> bool:
    """Whether ``host:port`` refuses a TCP connection (its process died). A slow or filtered
    port is no evidence of death: False (the caller's deadline covers it)."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _no_ray_context(manager: Any) -> None:
    """TransferQueue's KV managers size their thread pool from ``ray.get_runtime_context()``
    on first use, which starts a local Ray cluster in a plain process. Give them their pool
    up front so a client process never starts Ray."""
    if getattr(manager, "_multi_threads_executor", False) is None:
        manager._multi_threads_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlplane-kv")


#: One module per TransferQueue storage; each defines the TQTransport subclass of its ``kind``.
STORAGES = {"simple": "rlplane.transports.tq_simple", "mooncake": "rlplane.transports.tq_mooncake"}


def transport_class(info: Mapping[str, Any]) -> type[TQTransport]:
    """The transport class of the store ``info`` describes (its ``backend``, one of
    :data:`STORAGES`; ValueError otherwise). Its module is imported on first use."""
    backend = info.get("backend", "simple") if isinstance(info, Mapping) else None
    if backend not in STORAGES:
        raise ValueError(f"unknown backend {backend!r}")
    if backend not in _KINDS:
        import importlib

        importlib.import_module(STORAGES[backend])
    return _KINDS[backend]


def tq_transport(info: Mapping[str, Any], **kwargs: Any) -> TQTransport:
    """The transport for the store ``info`` describes (``GET /v1/transport``'s ``tq`` entry).

    Example: ``t = tq_transport(api.json("GET", "/v1/transport")["tq"], timeout=30)``.
    """
    return transport_class(info)(info, **kwargs)


def open_transport(info: Mapping[str, Any], *, timeout: float, data_path: str = "auto") -> TQTransport:
    """The transport ``rlplane.connect`` opens for the ``tq`` entry of ``/v1/transport``
    (``data_path`` is the native engine's: TransferQueue moves bytes its own way)."""
    return tq_transport(info, timeout=timeout)


_KINDS: dict[str, type[TQTransport]] = {}


class TQTransport(Transport):
    """Direct data path to a TransferQueue store (see the module docstring): what every
    TransferQueue storage shares. A storage's own module subclasses it (``kind``), says
    how its client connects (``storage``, ``before_connect``) and fills in the hooks
    where the storages differ; :func:`tq_transport` picks the class."""

    name = "tq"
    direct = True
    kind = ""
    checks_born = True  # each sample's incarnation is kept in its tags: a stale meta is refused
    checks_lengths = True  # a write's token rows are checked against the sample's stored lengths (its tags)
    probes_fields = True  # a sample's tags name the fields it holds: a stale meta's read learns of the others

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            _KINDS[cls.kind] = cls

    def __init__(self, info: Mapping[str, Any], *, client_id: str | None = None, timeout: float = 60.0) -> None:
        if not self.kind:
            raise TypeError("TQTransport is the shared part: use tq_transport(info) or TQTransport.from_info(info)")
        self._TensorDict = _tq()[0]
        self.info = dict(info)
        self.timeout = timeout
        self._client = store_client(info, client_id or f"rlplane-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        # TransferQueue has no consumption state of its own: the store runs a ledger that
        # this transport tells what it wrote and cleared (claims go there too).
        streams = self.info.get("streams")
        self.streams = DirectStreams(streams, timeout=timeout) if streams else None

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> TQTransport:
        """From the ``tq`` entry of ``GET /v1/transport`` (the class of its backend)."""
        return tq_transport(info)

    # -- where the storages differ (each storage's module overrides these) -------------
    @classmethod
    def data_endpoints(cls, info: Mapping[str, Any]) -> list[tuple[str, int]]:
        """``(host, port)`` of every data server a client of this store must reach."""
        raise NotImplementedError

    @classmethod
    def storage(cls, info: Mapping[str, Any], server: Any) -> tuple[str, dict[str, Any], str]:
        """TransferQueue's storage manager for this store, its config, and the address
        to name in errors (``server`` turns a published server dict into TransferQueue's)."""
        raise NotImplementedError

    @classmethod
    def before_connect(cls, info: Mapping[str, Any], config: dict[str, Any], where: str) -> None:
        """Anything to check or set before TransferQueue's client connects (nothing here)."""

    async def _undo_create(self, meta: Any, data: Any, columns: Mapping[str, Column], err: BaseException) -> None:
        """A put_samples failed part way: nothing of it may stay behind."""
        await self._clear_samples(meta)

    def _not_found(self, err: Exception, meta: Any, ids: list[str]) -> dict[str, list[str]]:
        """The samples (and fields) a failed read says the storage no longer holds ({}: none named)."""
        return {}

    def _restored(self, col: Column, stored: list[int]) -> Column:
        """A read column as written (``stored``: each row's recorded byte count, -1 unknown)."""
        return col

    def _rows(self, col: Column) -> torch.Tensor:
        """The column as TransferQueue takes it: a jagged NestedTensor of 1-D rows."""
        return col.to_nested()

    async def _clear_all(self, partition: str, held: Mapping[str, Any]) -> None:
        """Clear every sample of ``partition`` (``held``: what it lists)."""
        await self._client.async_clear_partition(partition)

    async def _clear_samples(self, meta: Any) -> None:
        await self._client.async_clear_samples(meta)

    # -- the Transport verbs ---------------------------------------------------------
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        *,
        create: bool,
        born: Any = None,
        aligned: Sequence[str] = (),
        grows: Any = None,
    ) -> int | None:
        """Store the columns. A put of new samples (``create``) gives them an incarnation
        (:data:`~rlplane.tags.BORN_TAG`, kept in their tags) and returns it; a write of
        stored ones with ``born`` (the incarnations the caller's meta names) is refused
        when they were cleared and put again since (MissingDataError, nothing stored), and
        with ``aligned`` (the token fields) when its token rows are not as long as the
        sample's, or, ``grows`` (an extend: the lengths it read), when it leaves out one a
        sample holds or grows a sample another extend grew since (ShapeError, nothing stored)."""
        check_put(sample_ids, columns, tags)
        ids = list(sample_ids)
        if born is not None and len(born) != len(ids):
            raise ShapeError(f"{len(born)} incarnations for {len(ids)} samples")
        given = None
        if create:  # (a restore's incarnations, one per sample, are kept as given)
            given = incarnation(f"tq.{uuid.uuid4().hex}") if born is None else None
            mine = np.asarray(born, np.int64) if born is not None else np.full(len(ids), given, np.int64)
            tags = tags.with_born(mine) if isinstance(tags, RowTags) else \
                [{**t, BORN_TAG: int(b)} for t, b in zip(tags, mine.tolist())]
            born = None
        # TransferQueue's own id check is check-then-create: the ledger arbitrates new ids first;
        # a write of stored samples holds them (a clear of them waits for it, and it for a clear).
        res = None
        if self.streams is not None:
            res = self.streams.reserve(partition, ids) if create else self.streams.hold(partition, ids, "write")
        with self._holding(res):
            self._run(self._put(partition, ids, columns, tags, create, reserved=create and res is not None, born=born,
                                aligned=() if create else aligned, grows=grows))
        if self.streams is not None:
            self.streams.record(partition, ids, list(columns), tags, create=create, reservation=res)
        return given

    def replaced(self, partition: str, sample_ids: Sequence[str], tags: Sequence[Mapping[str, Any]]) -> list[str]:
        """TransferQueue hands a cleared sample's storage slots to the next put: a read that
        raced a clear can get another sample's rows. Those whose sample is gone or whose
        incarnation changed since the read's tags."""
        ids = list(sample_ids)
        meta = self._run(self._meta(partition, ids, create=False))
        if meta.size != len(ids):  # some are gone: those
            return self._run(self._unknown(partition, ids))
        now = [(t or {}).get(BORN_TAG) for t in meta.custom_meta]  # (in the order of ids)
        return [s for s, was, t in zip(ids, now, tags) if was != (t or {}).get(BORN_TAG)]

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], *, copy: bool = True,
        born: Any = None, probe: Sequence[str] = (),
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        """``born``: the incarnations the caller's meta names (MissingDataError for samples
        cleared and put again since). ``probe``: fields not read, looked for in the samples'
        tags (FieldsHeldError naming those some of them hold, nothing read)."""
        if born is not None and len(born) != len(sample_ids):
            raise ShapeError(f"{len(born)} incarnations for {len(sample_ids)} samples")
        return self._run(self._get(partition, list(sample_ids), list(fields), born, tuple(probe)))

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        ids = None if sample_ids is None else list(dict.fromkeys(sample_ids))  # (an id named twice clears once)
        # Held first: TransferQueue hands a cleared sample's slots to the next put, so a write
        # of these samples still under way would land in that put's rows.
        hold = self.streams.hold(partition, ids, "clear") if self.streams is not None else None
        with self._holding(hold):
            cleared = self._run(self._clear(partition, ids))
        if self.streams is not None:
            self.streams.drop(partition, ids, hold)
        return cleared

    @contextmanager
    def _holding(self, hold: str | None) -> Iterator[None]:
        """Run the body with ``hold`` (a put's reservation, a write's or clear's hold) kept
        alive: renewed every third of the ledger's lease while the body runs, so a slow but
        live writer never loses it to another (who would clear what it is still writing);
        if the body fails, end it."""
        done = threading.Event()
        if hold is not None and self.streams is not None:
            every, streams = self.streams.hold_lease_s / 3, self.streams

            def renew() -> None:
                while not done.wait(every):
                    try:
                        if not streams.renew(hold) and not done.is_set():
                            log.warning("a write's hold on its samples lapsed while it ran; another writer may "
                                        "have them now")
                            return
                    except Exception:  # noqa: BLE001 - the ledger is away: the hold may lapse
                        continue

            threading.Thread(target=renew, name="rlplane-hold", daemon=True).start()
        try:
            yield
        except BaseException:
            if hold is not None and self.streams is not None:
                try:
                    self.streams.abort(hold)
                except Exception:  # noqa: BLE001 - it lapses on its own
                    pass
            raise
        finally:
            done.set()

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

    # -- what the service's TransferQueue backends read and drop (rlplane_service.backends.tq)
    def listing(self, partition: str) -> tuple[list[str], Any]:
        """The samples TransferQueue lists for ``partition`` and their metadata (global
        indexes, custom meta); ``([], None)`` when it lists none."""
        held = self._run(self._client.async_kv_list(partition)).get(partition) or {}
        if not held:
            return [], None
        ids = list(held)
        return ids, self._run(self._meta(partition, ids, create=False))

    def metadata(self, partition: str, ids: Sequence[str]) -> Any:
        """TransferQueue's metadata of ``ids`` (those it holds)."""
        return self._run(self._meta(partition, list(ids), create=False))

    def run(self, coro: Any) -> Any:
        """Run a coroutine on TransferQueue's client (``forget_meta``, ``clear_samples``), errors typed."""
        return self._run(coro)

    def forget_meta(self, meta: Any) -> Any:
        """A coroutine: TransferQueue's controller forgets ``meta``'s samples (no unit is asked)."""
        return self._forget_meta(meta)

    def clear_samples(self, meta: Any) -> Any:
        """A coroutine: clear ``meta``'s samples from the storage and the controller."""
        return self._clear_samples(meta)

    async def _forget_meta(self, meta: Any) -> None:
        await self._client._mark_clearing_in_controller(meta)
        await self._client._clear_meta_in_controller(meta)

    def close(self) -> None:
        client, self._client = getattr(self, "_client", None), None
        if self.streams is not None:
            self.streams.close()
        if client is not None:
            close_store_client(client)

    # -- implementation --------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        if self._client is None:
            raise TransportError("transport is closed")
        try:
            return self._client._run_coroutine(self._watched(coro))
        except RlplaneError:  # rlplane's own typed errors (a check of this transport's) as they are
            raise
        except KeyError as err:  # TransferQueue's StorageKeyNotFoundError: a clear raced this call
            raise MissingDataError(
                "(this call's partition)", {},
                hint=f"TransferQueue no longer holds {err}: the samples were cleared while this call ran",
            ) from err
        except (RuntimeError, OSError, ValueError, asyncio.TimeoutError) as err:
            raise translate(self.kind, err, self._lost_units) from err

    def _lost_units(self) -> list[str]:
        """The storage units the service has declared dead (best effort: [] if it cannot say)."""
        try:
            return self.streams.loss()["lost_units"] if self.streams is not None else []
        except Exception:  # noqa: BLE001 - only improves an error message
            return []

    async def _watched(self, coro: Any) -> Any:
        """``coro``, but over within about PROBE_EVERY_S of a TransferQueue process dying
        (TransferQueue itself retries a dead unit for minutes), naming it; and never past
        the transport's deadline."""
        task = asyncio.ensure_future(coro)
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROBE_EVERY_S)
            if done:
                return task.result()
            dead = await loop.run_in_executor(None, self._refusing)
            if dead is None and time.monotonic() - start < self.timeout:
                continue
            task.cancel()
            if dead is not None:
                raise UnavailableError(
                    f"TransferQueue's {dead} does not accept connections (its process died); this call was given "
                    "up on. What it held is gone unless the service restarts it: check the service's /readyz",
                    component=dead)
            raise TransportError(f"TransferQueue did not answer within {self.timeout:.0f} s (connect(timeout=...))")

    def _refusing(self) -> str | None:
        """The first TransferQueue process (controller, storage unit) whose ports refuse a
        TCP connection, or None."""
        servers = {"controller": self.info.get("controller"), **(self.info.get("storage_units") or {})}
        for name, d in servers.items():
            try:
                ip, ports = d["ip"], list(d["ports"].values())
            except (KeyError, TypeError, AttributeError):
                continue
            if any(refuses(ip, int(port)) for port in ports):
                return name
        return None

    async def _meta(self, partition: str, ids: list[str], create: bool) -> Any:
        return await self._client.async_kv_retrieve_meta(keys=ids, partition_id=partition, create=create)

    async def _unknown(self, partition: str, ids: list[str]) -> list[str]:
        """Which of ``ids`` the store does not hold (TransferQueue drops them silently)."""
        held = (await self._client.async_kv_list(partition)).get(partition) or {}
        return [s for s in ids if s not in held]

    async def _missing(self, partition: str, ids: list[str], fields: dict[str, list[str]] | None = None,
                       hint: str = "") -> MissingDataError:
        """MissingDataError for the ``ids`` the store does not hold (or, given ``fields``,
        whose values of those fields the Mooncake pool no longer has), saying which of them
        a dead storage unit took when the ledger knows."""
        unknown = await self._unknown(partition, ids) if fields is None else ids
        if fields is not None:
            hint = ("the Mooncake pool no longer holds these values: they were cleared while this read ran, or the "
                    "storage unit holding them died (then the service declares its samples lost within seconds; "
                    "see /readyz)")
        lost = {}
        if self.streams is not None and unknown:
            loop = asyncio.get_running_loop()
            lost = await loop.run_in_executor(None, self.streams.lost, partition, unknown)
        if lost:
            hint = lost_hint(lost, "its process died with the only copy; the native backend with RLPLANE_REPLICAS=2 "
                             "keeps two")
        return MissingDataError(partition, {s: (fields or {}).get(s, []) for s in unknown}, hint=hint)

    async def _put(
        self,
        partition: str,
        ids: list[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        create: bool,
        reserved: bool = False,
        born: Any = None,
        aligned: Sequence[str] = (),
        grows: Any = None,
    ) -> None:
        existing = await self._meta(partition, ids, create=False)
        if create and existing.size and reserved:
            # The ledger gave this put the ids, so none of them was ever recorded as written:
            # what TransferQueue holds of them is what a writer killed mid-put left behind
            # (ids without their data). Clear those ghosts; this put writes them whole.
            await self._clear_samples(existing)
        elif create and existing.size:
            held = set(ids) - set(await self._unknown(partition, ids))
            raise DuplicateSampleError(partition, [s for s in ids if s in held])
        if not create and existing.size != len(ids):
            raise await self._missing(partition, ids, hint="put_samples them before write_columns")
        old = list(existing.custom_meta) if not create else [{} for _ in ids]
        if born is not None and not create and (now := born_of(old)) is not None and \
                (bad := stale(np.asarray(born, np.int64), now)).size:
            raise stale_meta(partition, ids, bad, "write")
        if aligned:
            check_written_lengths(ids, old, columns, tags, aligned, grows)
        sizes = {name: (col.row_numels() * col.values.element_size()).tolist() for name, col in columns.items()}
        merged = [
            merge_tags(old[i], {**tags[i], NBYTES_TAG: {name: sizes[name][i] for name in columns}})
            for i in range(len(ids))
        ]
        data = self._TensorDict({name: self._rows(col) for name, col in columns.items()}, batch_size=len(ids))
        meta = await self._meta(partition, ids, create=True) if create else existing
        try:
            meta.update_custom_meta(merged)
            if columns:
                await self._client.async_put(data, meta)  # data first, then the tags that make it readable
            else:
                await self._client.async_set_custom_meta(meta)
        except BaseException as err:
            if create:  # nothing of a failed put_samples may stay behind
                await self._undo_create(meta, data, columns, err)
            raise

    async def _get(
        self, partition: str, ids: list[str], fields: list[str], born: Any = None, probe: tuple[str, ...] = ()
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        if not ids:
            return {f: Column.empty(torch.uint8) for f in fields}, []
        meta = await self._meta(partition, ids, create=False)
        if meta.size != len(ids):
            raise await self._missing(partition, ids)
        tags = [dict(t) for t in meta.custom_meta]
        if born is not None and (now := born_of(tags)) is not None and \
                (bad := stale(np.asarray(born, np.int64), now)).size:
            raise stale_meta(partition, ids, bad, "read")
        missing = {}
        for sid, tag in zip(ids, tags):
            have = tag.get(WIRE_TAG) or {}
            lacking = [f for f in fields if f not in have]
            if lacking:
                missing[sid] = lacking
        if missing:
            raise MissingDataError(partition, missing)
        held = {f for f in probe if f not in fields and any(f in (tag.get(WIRE_TAG) or {}) for tag in tags)}
        if held:
            raise FieldsHeldError(partition, sorted(held))
        stored = [tag.pop(NBYTES_TAG, None) or {} for tag in tags]
        if not fields:
            return {}, tags
        try:
            got = await self._client.async_get_data(meta.select_fields(fields))
        except RuntimeError as err:
            gone = self._not_found(err, meta, ids)
            if not gone:
                raise
            raise await self._missing(partition, list(gone), gone) from err
        columns = {}
        for name in fields:
            if name not in got.keys():
                if await self._unknown(partition, ids):  # forgotten while this read ran (a clear, a lost unit)
                    raise await self._missing(partition, ids)
                # (their tags say they hold it: not the store's word that they lack it, which a read by
                # stage would take as "none of them has an image")
                raise TransportError(f"partition {partition!r}: TransferQueue's storage units did not return field "
                                     f"{name!r} of {len(ids)} sample(s) whose tags say they hold it")
            columns[name] = self._restored(_column(got[name], name, len(ids)), [int(s.get(name, -1)) for s in stored])
        return columns, tags

    async def _clear(self, partition: str, ids: list[str] | None) -> int:
        if ids is None:
            held = (await self._client.async_kv_list(partition)).get(partition) or {}
            if not held:
                return 0
            await self._clear_all(partition, held)
            return len(held)
        if not ids:
            return 0
        meta = await self._meta(partition, ids, create=False)
        if meta.size:
            await self._clear_samples(meta)
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


__all__ = ["TQTransport", "NBYTES_TAG", "STORAGES", "close_store_client", "reachable", "server_info_to_dict", "store_client",
           "open_transport", "tq_transport", "transport_class"]
