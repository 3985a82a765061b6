"""The Transport interface: how encoded columns reach a store and come back.

A transport speaks partitions, sample ids, :class:`~rlplane.column.Column` s and
per-sample tags; it knows nothing of fields' meaning. Every implementation keeps the
same strict semantics (pinned by the in-memory reference, ``MemoryTransport``):

- ``put(create=True)`` adds new samples (an existing id raises DuplicateSampleError);
  ``put(create=False)`` adds or replaces fields of stored samples (an unknown id raises
  MissingDataError). Either way a failed put stores nothing.
- ``get`` returns every requested (sample, field) or raises MissingDataError naming
  what is missing: never a partial result. Tags come back as stored (merged over writes).
- Stored bytes never alias the caller's tensors, and returned ones never alias the store.

Example::

    transport.put("step-3", ["a", "b"], enc.columns, enc.tags, create=True)
    columns, tags = transport.get("step-3", ["b"], ["input_ids"])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from rlplane.column import Column
from rlplane.errors import ShapeError, WireFormatError
from rlplane.scratch import Alloc
from rlplane.geometry import Geometry
from rlplane.tags import WIRE_TAG, born_of, check_grown, check_lengths, grown_evenly

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PartitionInfo:
    """What a partition holds: its samples, how many of them hold each field, and bytes."""

    partition: str
    sample_ids: list[str]
    fields: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)


class Transport(ABC):
    """Moves encoded columns to and from a store (see the module docstring)."""

    name: str = "transport"
    #: Whether its waits on the store are counted (rlplane.opstats: an op's ``wait`` part);
    #: where they are not, they fall in ``client``.
    counts_waits: bool = False
    #: Whether its ops bypass the service's HTTP edge (the client then reports them to the
    #: service's /metrics itself; the service counts HTTP ops as it serves them).
    direct: bool = False
    #: How this transport reaches the store's consumption ledger (claim/ack/nack); None
    #: when it cannot (see :mod:`rlplane.streams`).
    streams: Any = None
    #: Whether ``put`` takes ``durable=True`` (native: the store's journal decides).
    durable_puts: bool = False
    #: Whether ``put`` stores columns with shared rows (:attr:`rlplane.column.Column.same`)
    #: once, and ``get(..., shared=True)`` hands them back so (native); else every
    #: row travels and is stored as its own.
    shares_rows: bool = False
    #: Whether ``put(..., create=False)`` takes ``aligned=`` (the token-aligned field names):
    #: the store then refuses a write whose token rows are not as long as the sample it
    #: writes to (a meta older than the sample: extended, or cleared and put again), and
    #: with ``grows`` (an extend: the samples' lengths it read) one that leaves out a token
    #: field a sample holds, or grows a sample another extend grew since.
    checks_lengths: bool = False
    #: Whether an extend's commit is refused when a write replaced a token row it read
    #: since (``put(read_sums=)``; the native engine: atomic, at the commit).
    checks_rewrites: bool = False
    #: Whether ``put`` and ``get`` take ``born=`` (each sample's incarnation as the caller's
    #: meta names it, :data:`rlplane.tags.BORN_TAG`): the store then refuses a meta naming
    #: samples that were cleared and put again under the same ids (MissingDataError), and a
    #: put that creates samples returns the incarnation it gave them (an int).
    checks_born: bool = False
    #: Whether ``get`` takes ``lend=`` (fields the caller copies out of the columns itself,
    #: e.g. token rows a padded read pads): they may come back as read-only views of the
    #: store's memory, as with ``copy=False`` (native, shared memory).
    lends_views: bool = False
    #: Whether ``get`` takes ``verified=`` (a set): rows it copies out of the store's memory
    #: are checked against their digests as they are copied, and the fields checked whole
    #: are added to the set, for the caller not to digest them again (native, shared memory).
    verifies_reads: bool = False
    #: Whether ``get`` takes ``probe=`` (field names not read): FieldsHeldError naming those
    #: that some of the samples hold, before anything is read. A read by stage probes the
    #: stage's optional fields its meta does not list (written after the meta was made).
    probes_fields: bool = False

    @abstractmethod
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        *,
        create: bool,
    ) -> None:
        """Store ``columns`` (one row per sample id) and merge ``tags`` into each sample's tags.

        Keeps no reference to ``columns`` once it returns (the client reuses their buffers)."""

    @abstractmethod
    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], *, copy: bool = True
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        """The requested fields' columns (rows in ``sample_ids`` order) and the samples' tags.

        ``copy=False`` allows read-only views of the store's memory where a transport has
        them (the native engine's shared-memory path); others return owned memory anyway."""

    @contextmanager
    def put_buffers(self, batch: int, fallback: Alloc | None,
                    sizes: Mapping[str, tuple[int, torch.dtype]] | None = None) -> Iterator[Alloc | None]:
        """Where the next put of ``batch`` samples (in this thread) encodes its fields:
        ``fallback`` (the client's reusable buffers) unless the store offers memory the
        put lands in (the native engine's staged slab extents). ``sizes``: the ``(numel,
        dtype)`` the caller will ask for, per field, where it knows them (a hint)."""
        yield fallback

    def replaced(self, partition: str, sample_ids: Sequence[str], tags: Sequence[Mapping[str, Any]]) -> list[str]:
        """Which of the samples a read got (with ``tags``) the store no longer holds as they
        were: cleared, or cleared and put again, while the read ran. Asked only when a read's
        rows fail their digests, to tell such a race (MissingDataError) from damage. [] here:
        a store that cannot tell (its reads never see another put's rows, or, over HTTP, the
        service does not say)."""
        return []

    def on_device(self, device: Any, *, write: bool = False) -> bool:
        """Ready this transport's memory for copies from ``device`` (a torch.device other
        than the host; ``write``: for a put) or onto it: True when reads onto it should take
        views of the store's memory (``get(copy=False)``), which the copy onto the device then
        replaces (the native engine's slabs, mapped here and page-locked for CUDA); False:
        owned copies."""
        return False

    def sharing(self) -> dict[str, int] | None:
        """Where the store keeps rows identical across samples once (native): the bytes
        its samples hold as written (``written_bytes``), what of them it stores
        (``stored_bytes``) and the difference (``shared_bytes``); None where every row is
        stored as written."""
        return None

    def paths(self) -> dict[str, str]:
        """How bytes move to each storage unit (``{unit: path}``); ``{}`` where a transport
        has one way only (its ``name`` says which)."""
        return {}

    @abstractmethod
    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        """Drop samples (all of the partition when ``sample_ids`` is None); returns how many."""

    @abstractmethod
    def partitions(self) -> list[str]:
        """Names of partitions holding at least one sample."""

    @abstractmethod
    def describe(self, partition: str) -> PartitionInfo:
        """What ``partition`` holds (MissingDataError if it holds nothing)."""

    def close(self) -> None:
        """Release connections; the default holds none."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_put(sample_ids: Sequence[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]], *,
              shares_rows: bool = False) -> None:
    """Shape checks every transport makes before storing anything (``shares_rows``: the
    transport stores a column's shared rows once; any other refuses such a column rather
    than store its repeated rows empty)."""
    n = len(sample_ids)
    if len(set(sample_ids)) != n:
        raise ShapeError("sample ids within one put must be unique")
    if len(tags) != n:
        raise ShapeError(f"{len(tags)} tag dicts for {n} samples")
    for name, col in columns.items():
        if col.num_rows != n:
            raise ShapeError(f"column has {col.num_rows} rows for {n} samples", field=name)
        if col.same is not None and not shares_rows:
            raise WireFormatError("this column stores repeated rows once (Column.same) and this transport stores "
                                  "every row as its own: pass column.expanded()", field=name)
        if col.held is not None and col.held.rows.size and not shares_rows:
            raise WireFormatError("this column names rows another store holds (Column.held): encode it for this "
                                  "transport", field=name)


def check_written_lengths(sample_ids: Sequence[str], stored: Sequence[Mapping[str, Any]],
                          columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]],
                          aligned: Sequence[str], grows: Any = None) -> None:
    """For a store that keeps each sample's tags (``stored``): a write whose token rows
    (``columns`` of the ``aligned`` fields; their lengths from the column's geometry, else
    the written ``tags``) are not as long as the sample holds is a ShapeError naming field
    and sample (:func:`rlplane.tags.check_lengths`), before anything is stored. ``grows``
    (an extend: each sample's length as it read it): its rows grow instead, every
    ``aligned`` field a sample holds must be among them, and each sample must still be as
    long as it read (:func:`rlplane.tags.check_grown`).

    Example: ``check_written_lengths(ids, stored_tags, enc.columns, enc.tags, registry.token_fields())``."""
    written = {f: Geometry.coerce(c.geom if c.geom is not None else
                                  [(t.get(WIRE_TAG) or {}).get(f) for t in tags]).leads()
               for f, c in columns.items() if f in aligned}
    if grows is not None:
        check_grown(sample_ids, stored, set(columns), aligned, grows)
        grown_evenly(written, grows, sample_ids.__getitem__)
        return
    check_lengths(sample_ids, stored, written, aligned)


def sharing_of(stats: Mapping[str, Any]) -> dict[str, int]:
    """:meth:`Transport.sharing` out of the native controller's stats (``written_bytes``:
    what the samples hold as written; ``shared_bytes``: what of it no block stores).

    Example: ``sharing_of({"written_bytes": 800, "shared_bytes": 700})["stored_bytes"]  # 100``"""
    written, shared = int(stats.get("written_bytes", 0)), int(stats.get("shared_bytes", 0))
    return {"written_bytes": written, "stored_bytes": written - shared, "shared_bytes": shared}


def length_check(registry: Any, transport: Transport, *, grows: Any = None,
                 read_sums: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The keywords a write of existing samples passes to ``transport.put`` so that a store
    that checks lengths (:attr:`Transport.checks_lengths`) refuses token rows of another
    length than their sample's, or, ``grows`` (an extend: each sample's length as it read
    it), one that leaves out a token field a sample holds or grows a sample another extend
    grew since; nothing for another store. ``read_sums`` (an extend: the digests of the
    token rows it read, per field): a store that checks them (:attr:`Transport.checks_rewrites`)
    refuses the extend when a write replaced one of those rows since.

    Example: ``transport.put(p, ids, columns, tags, create=False, **length_check(registry, transport))``."""
    if not transport.checks_lengths:
        return {}
    read = {"grows": np.asarray(grows, np.int64).reshape(-1)} if grows is not None else {}
    if read_sums and getattr(transport, "checks_rewrites", False):
        read["read_sums"] = dict(read_sums)
    return {"aligned": registry.token_fields(), **read}


def born_check(transport: Transport, tags: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The keyword a write or read with a meta passes to ``transport.put`` / ``get`` so
    that a store that keeps incarnations (:attr:`Transport.checks_born`) refuses a stale
    meta (its samples cleared and put again since); nothing for another store, or for a
    meta that names none (built by hand).

    Example: ``transport.get(p, meta.sample_ids, fields, **born_check(transport, meta.tags))``."""
    if not transport.checks_born:
        return {}
    born = born_of(tags)
    return {} if born is None else {"born": born}
