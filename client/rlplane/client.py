"""Client: the verbs stages use — put samples, add columns, read what a stage needs.

The client speaks fields and metas; a :class:`~rlplane.transports.Transport` moves the
encoded columns. Validation happens here, before any byte moves: a call that fails
stores nothing.

Example::

    client = Client(default_registry(), MemoryTransport())
    meta = client.put_samples("step-0", batch)                 # rollout
    for shard in meta.shard(2):
        inputs = client.read_columns(shard, stage="logprob")   # logprob ranks
        client.write_columns(shard, {"prev_logprobs": lp})
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import msgpack
import torch

from rlplane.codec import RESERVED_TAG_PREFIX, decode, encode, merge_tags
from rlplane.errors import InvalidArgumentError, MissingDataError, ShapeError
from rlplane.fields import LENGTHS_FIELD, Registry
from rlplane.meta import SampleMeta
from rlplane.opstats import OpStats
from rlplane.scratch import Scratch
from rlplane.transports.base import Transport

log = logging.getLogger(__name__)

#: How often (at most) a tq client hands its op counts to the service's /metrics.
REPORT_EVERY_S = 5.0


class Client:
    """Put and read declared fields through a transport (see the module docstring)."""

    def __init__(self, registry: Registry, transport: Transport, *, service: Any = None, reuse_buffers: bool = True) -> None:
        self.registry = registry
        self.transport = transport
        # Encode buffers kept from one put to the next (see rlplane.scratch): the second and
        # later puts skip the page faults of fresh memory. reuse_buffers=False frees them.
        self._scratch = Scratch() if reuse_buffers else None
        self._service = service  # the ServiceAPI when made by rlplane.connect; closed with the client
        self.ops = OpStats(transport.name)
        self._last_report = time.monotonic()

    # -- writing ---------------------------------------------------------------------
    def put_samples(
        self,
        partition: str,
        fields: Mapping[str, Any],
        *,
        sample_ids: Sequence[str] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> SampleMeta:
        """Store new samples; returns their meta.

        Lengths come from ``input_lengths`` (required when a token field is written).
        An invalid field raises a typed error naming field and sample; nothing is stored.

        Example::

            meta = client.put_samples("step-0", {"input_ids": ids, "input_lengths": lens})
        """
        with self._op("put_samples") as op:
            check_partition(partition)
            batch = self.registry.validate(fields)
            ids = [str(s) for s in sample_ids] if sample_ids is not None else _new_ids(batch)
            if len(ids) != batch:
                raise ShapeError(f"{len(ids)} sample ids for a batch of {batch} samples")
            lengths = self._lengths(fields, batch)
            user = _user_tags(tags, batch, ids)
            with self._buffers() as alloc:
                enc = encode(self.registry, fields, lengths, sample_ids=ids, alloc=alloc)
                merged = [merge_tags(u, w) for u, w in zip(user, enc.tags)]
                self.transport.put(partition, ids, enc.columns, merged, create=True)
                op.nbytes = enc.nbytes
        stored_lengths = lengths.tolist() if lengths is not None else [0] * batch
        return SampleMeta(partition, ids, stored_lengths, frozenset(enc.columns), merged)

    def write_columns(self, meta: SampleMeta, fields: Mapping[str, Any]) -> SampleMeta:
        """Add (or replace) fields of stored samples, e.g. a stage's outputs.

        Example::

            meta = client.write_columns(shard, {"prev_logprobs": logprobs})
        """
        with self._op("write_columns") as op:
            lengths = torch.tensor(meta.lengths, dtype=torch.int64)
            given = self._lengths(fields, len(meta))
            if given is not None and not torch.equal(given, lengths):
                raise ShapeError("differs from the meta's lengths; lengths are fixed at put_samples", field=LENGTHS_FIELD)
            with self._buffers() as alloc:
                enc = encode(self.registry, fields, lengths, sample_ids=meta.sample_ids, alloc=alloc)
                if not enc.columns:
                    return meta
                self.transport.put(meta.partition, meta.sample_ids, enc.columns, enc.tags, create=False)
                op.nbytes = enc.nbytes
        return meta.with_fields(enc.columns, enc.tags)

    # -- reading ---------------------------------------------------------------------
    def fields_for_stage(self, stage: str, meta_or_partition: SampleMeta | str) -> list[str]:
        """The fields ``stage`` reads for these samples (required + optional ones present).

        Example: ``client.fields_for_stage("train", meta)``.
        """
        if isinstance(meta_or_partition, SampleMeta):
            present = meta_or_partition.fields
        else:
            present = set(self.transport.describe(meta_or_partition).fields)
        return self.registry.fields_for_stage(stage, present)

    def read_columns(
        self,
        meta: SampleMeta,
        fields: Sequence[str] | None = None,
        *,
        stage: str | None = None,
        layout: str = "padded",
        pad_to_seqlen: int | None = None,
    ) -> dict[str, Any]:
        """Every requested field of every sample in ``meta``, or MissingDataError.

        Name ``fields`` or a ``stage`` (its fields come from the registry). Token fields
        come back ``[B, pad_to_seqlen]`` (default: the meta's, else the longest sample)
        or jagged; packed fields as PackedTensor; object fields as lists.

        Example::

            batch = client.read_columns(shard, stage="train")
        """
        with self._op("read_columns") as op:
            if fields is None and stage is None:
                raise InvalidArgumentError("read_columns needs fields=[...] or stage=...")
            names = list(fields) if fields is not None else self.fields_for_stage(stage, meta)  # type: ignore[arg-type]
            for name in names:
                self.registry.get(name)
            columns, tags = self.transport.get(meta.partition, meta.sample_ids, names)
            op.nbytes = sum(col.nbytes for col in columns.values())
            pad = pad_to_seqlen if pad_to_seqlen is not None else meta.pad_to_seqlen
            return decode(self.registry, columns, tags, layout, pad, sample_ids=meta.sample_ids)

    # -- housekeeping ----------------------------------------------------------------
    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        """Drop samples (the whole partition when ``sample_ids`` is None); returns how many."""
        with self._op("delete_partition" if sample_ids is None else "clear"):
            check_partition(partition)
            return self.transport.clear(partition, sample_ids)

    def partitions(self) -> list[str]:
        """Partitions that hold samples."""
        return self.transport.partitions()

    def stats(self) -> dict[str, Any]:
        """What the store holds (per partition: sample count, fields present, bytes) and
        what this client did (``ops``: per op count, errors, bytes, wall time p50/p90;
        see :meth:`rlplane.opstats.OpStats.summary`).

        Example: ``client.stats()["partitions"]["step-0"]["nbytes"]``,
        ``client.stats()["ops"]["read_columns"]["p90_s"]``.
        """
        parts = {}
        for name in self.transport.partitions():
            try:
                info = self.transport.describe(name)
            except MissingDataError:  # cleared meanwhile
                continue
            parts[name] = {"num_samples": info.num_samples, "fields": dict(info.fields), "nbytes": info.nbytes}
        return {
            "transport": self.transport.name,
            "registry_version": self.registry.version,
            "partitions": parts,
            "samples": sum(p["num_samples"] for p in parts.values()),
            "nbytes": sum(p["nbytes"] for p in parts.values()),
            "ops": self.ops.summary(),
        }

    def report_ops(self) -> None:
        """Hand the ops done since the last report to the service's ``/metrics`` (direct
        transports only: the service counts http ops itself). Never raises; a failed report is retried
        with the next one. Runs by itself every few seconds and on :meth:`close`."""
        self._last_report = time.monotonic()
        if self._service is None or self.transport.name not in ("native", "tq"):
            return
        events = self.ops.drain()
        if not events:
            return
        try:
            self._service.json("POST", "/v1/metrics/report", json={"events": [e.to_dict() for e in events]})
        except Exception as err:  # noqa: BLE001 - metrics must never fail the caller's work
            self.ops.requeue(events)
            log.warning("could not report %d ops to the service: %s", len(events), err)

    def close(self) -> None:
        """Release the transport's connections (and the service connection, if any)."""
        self.report_ops()
        self.transport.close()
        if self._service is not None:
            self._service.close()

    @contextmanager
    def _buffers(self) -> Iterator[Any]:
        if self._scratch is None:
            yield None
        else:
            with self._scratch.lease() as alloc:
                yield alloc

    @contextmanager
    def _op(self, name: str) -> Iterator[Any]:
        with self.ops.timed(name) as event:
            yield event
        if time.monotonic() - self._last_report >= REPORT_EVERY_S:
            self.report_ops()

    # -- async twins: the same verbs, awaitable; the work runs in a worker thread ----
    async def aput_samples(self, partition: str, fields: Mapping[str, Any], **kwargs: Any) -> SampleMeta:
        """Awaitable :meth:`put_samples`."""
        return await asyncio.to_thread(self.put_samples, partition, fields, **kwargs)

    async def awrite_columns(self, meta: SampleMeta, fields: Mapping[str, Any]) -> SampleMeta:
        """Awaitable :meth:`write_columns`."""
        return await asyncio.to_thread(self.write_columns, meta, fields)

    async def aread_columns(self, meta: SampleMeta, fields: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Awaitable :meth:`read_columns`, e.g. ``await client.aread_columns(shard, stage="train")``."""
        return await asyncio.to_thread(self.read_columns, meta, fields, **kwargs)

    async def afields_for_stage(self, stage: str, meta_or_partition: SampleMeta | str) -> list[str]:
        """Awaitable :meth:`fields_for_stage`."""
        return await asyncio.to_thread(self.fields_for_stage, stage, meta_or_partition)

    async def aclear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        """Awaitable :meth:`clear`."""
        return await asyncio.to_thread(self.clear, partition, sample_ids)

    async def apartitions(self) -> list[str]:
        """Awaitable :meth:`partitions`."""
        return await asyncio.to_thread(self.partitions)

    async def astats(self) -> dict[str, Any]:
        """Awaitable :meth:`stats`."""
        return await asyncio.to_thread(self.stats)

    async def aclose(self) -> None:
        """Awaitable :meth:`close`."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lengths(self, fields: Mapping[str, Any], batch: int) -> torch.Tensor | None:
        """Each sample's length from ``input_lengths``; None when not given (the codec then
        refuses token fields instead of cutting them to nothing)."""
        given = fields.get(LENGTHS_FIELD)
        if given is None:
            return None
        lengths = torch.as_tensor(given).reshape(-1).cpu().to(torch.int64)
        if lengths.numel() != batch:
            raise ShapeError(f"{lengths.numel()} lengths for {batch} samples", field=LENGTHS_FIELD)
        return lengths


_PARTITION = re.compile(r"[A-Za-z0-9_.:@=+\-]{1,200}")


def check_partition(partition: str) -> None:
    """InvalidArgumentError unless ``partition`` is a legal partition name (the client and
    the service check the same rule). Example: ``check_partition("step-0")``."""
    if not isinstance(partition, str) or not _PARTITION.fullmatch(partition):
        raise InvalidArgumentError(
            f"partition name {partition!r} must be 1-200 characters of letters, digits and _ . : @ = + -"
        )


def _new_ids(n: int) -> list[str]:
    base = uuid.uuid4().hex[:12]
    return [f"{base}-{i}" for i in range(n)]


def _user_tags(tags: Sequence[Mapping[str, Any]] | None, batch: int, ids: list[str]) -> list[dict[str, Any]]:
    if tags is None:
        return [{} for _ in range(batch)]
    if len(tags) != batch:
        raise ShapeError(f"{len(tags)} tag dicts for {batch} samples")
    out = []
    for sid, tag in zip(ids, tags):
        if not isinstance(tag, Mapping):
            raise ShapeError(f"tags must be dicts, got {type(tag).__name__}", sample=sid)
        if not all(isinstance(k, str) for k in tag):
            raise ShapeError(f"tag keys must be strings, got {sorted(map(repr, tag))}", sample=sid)
        reserved = [k for k in tag if k.startswith(RESERVED_TAG_PREFIX)]
        if reserved:
            raise ShapeError(f"tag keys starting with {RESERVED_TAG_PREFIX!r} are reserved for rlplane: {reserved}", sample=sid)
        try:
            msgpack.packb(dict(tag), use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as err:
            raise ShapeError(f"tags must be msgpack-able ({err})", sample=sid) from None
        out.append(dict(tag))
    return out
