"""SampleMeta: the small handle to a batch of stored samples that stages pass around.

A meta names a partition and the samples in it (ids, sequence lengths, per-sample tags
that carry wire geometry and user scalars) and which fields have been written. It is
plain data: msgpack/JSON round-trip, cheap to send between processes. Selecting rows
(``subset``, ``slice``, ``shard``) always carries ids, lengths and tags together, and
``pad_to_seqlen`` is one value for the whole step so every DP shard pads alike.

Example::

    shards = meta.shard(2, balance="seqlen")
    batch = client.read_columns(shards[rank], stage="train")
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import torch

from rlplane.tags import RowTags, merge_tags
from rlplane.errors import InvalidArgumentError, ShapeError, WireFormatError


@dataclass(frozen=True)
class SampleMeta:
    """Handle to samples of one partition (see the module docstring).

    Example::

        meta = SampleMeta("step-7", ["a", "b"], lengths=[10, 4], fields={"input_ids"})
        meta.slice(0, 1).sample_ids  # ['a']
    """

    partition: str
    sample_ids: list[str]
    lengths: list[int] = field(default_factory=list)
    fields: frozenset[str] = field(default_factory=frozenset)
    tags: Sequence[dict[str, Any]] = field(default_factory=list)
    pad_to_seqlen: int | None = None
    #: The claim lease these samples are held under (``client.claim``); ``ack``/``nack`` need it.
    lease: int | None = None
    #: A token-budget claim whose first sample (or group) alone was larger than ``max_tokens``.
    over_budget: bool = False
    #: Fields some samples may hold and others not (``fields`` is what every one holds): text-only
    #: samples put apart from image ones. A read by stage asks for those too; see ``Client.read_columns``.
    some_fields: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        object.__setattr__(self, "sample_ids", [str(s) for s in self.sample_ids])
        object.__setattr__(self, "lengths", [int(x) for x in self.lengths] if self.lengths else [0] * n)
        if not isinstance(self.tags, RowTags):  # RowTags: kept as they are, built when asked for
            object.__setattr__(self, "tags", list(self.tags) if self.tags else [{} for _ in range(n)])
        object.__setattr__(self, "fields", frozenset(self.fields))
        object.__setattr__(self, "some_fields", frozenset(self.some_fields) - self.fields)
        if not isinstance(self.partition, str) or not self.partition:
            raise InvalidArgumentError(f"partition must be a non-empty string, got {self.partition!r}")
        if len(self.lengths) != n or len(self.tags) != n:
            raise ShapeError(
                f"meta of {n} samples has {len(self.lengths)} lengths and {len(self.tags)} tags; they must match"
            )
        if len(set(self.sample_ids)) != n:
            dup = next(s for s, c in Counter(self.sample_ids).items() if c > 1)
            raise ShapeError(f"sample id {dup!r} appears twice in one meta", sample=dup)
        if self.pad_to_seqlen is not None and self.pad_to_seqlen < max(self.lengths, default=0):
            raise ShapeError(
                f"pad_to_seqlen={self.pad_to_seqlen} is shorter than the longest sample ({max(self.lengths)})"
            )

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.sample_ids)

    # -- selecting rows --------------------------------------------------------------
    def subset(self, indices: Sequence[int] | torch.Tensor) -> SampleMeta:
        """The samples at ``indices`` (ints, or a bool mask), in that order.

        Example: ``meta.subset([3, 0])``.
        """
        idx = _indices(indices, len(self))
        return replace(
            self,
            sample_ids=[self.sample_ids[i] for i in idx],
            lengths=[self.lengths[i] for i in idx],
            tags=self.tags.take(idx) if isinstance(self.tags, RowTags) else [self.tags[i] for i in idx],
        )

    def slice(self, start: int, stop: int) -> SampleMeta:
        """Samples ``start:stop``. Example: ``meta.slice(0, 32)``."""
        return self.subset(range(len(self))[start:stop])

    @classmethod
    def concat(cls, *metas: SampleMeta | Sequence[SampleMeta]) -> SampleMeta:
        """Samples of ``metas`` one after another (same partition).

        ``fields`` is what every part holds (the intersection), ``some_fields`` what only
        some parts hold; ``pad_to_seqlen`` the largest set. Example: ``SampleMeta.concat(*shards)``.
        """
        parts: list[SampleMeta] = []
        for m in metas:
            parts.extend(m if isinstance(m, (list, tuple)) else [m])
        if not parts:
            raise InvalidArgumentError("concat needs at least one SampleMeta")
        partitions = {m.partition for m in parts}
        if len(partitions) > 1:
            raise InvalidArgumentError(f"cannot concat metas of different partitions {sorted(partitions)}")
        pads = [m.pad_to_seqlen for m in parts if m.pad_to_seqlen is not None]
        leases = {m.lease for m in parts}
        every = frozenset.intersection(*(m.fields for m in parts))
        return cls(
            partition=parts[0].partition,
            sample_ids=[s for m in parts for s in m.sample_ids],
            lengths=[x for m in parts for x in m.lengths],
            fields=every,
            tags=[t for m in parts for t in m.tags],
            pad_to_seqlen=max(pads) if pads else None,
            lease=leases.pop() if len(leases) == 1 else None,
            over_budget=any(m.over_budget for m in parts),
            some_fields=frozenset().union(*(m.fields | m.some_fields for m in parts)) - every,
        )

    def shard(self, dp_size: int, balance: str = "seqlen") -> list[SampleMeta]:
        """Split into ``dp_size`` shards for data-parallel ranks.

        ``"contiguous"``: consecutive runs of near-equal size. ``"seqlen"``: near-equal
        sample counts (they differ by at most one) with balanced token totals; each
        shard keeps its samples in their original order. Every shard gets the same
        ``pad_to_seqlen`` (this meta's, or its longest sample's), so every rank pads alike.

        Example: ``meta.shard(2, balance="seqlen")[rank]``.
        """
        if not isinstance(dp_size, int) or dp_size < 1:
            raise InvalidArgumentError(f"dp_size must be a positive int, got {dp_size!r}")
        n = len(self)
        pad = self.pad_to_seqlen if self.pad_to_seqlen is not None else max(self.lengths, default=0)
        if balance == "contiguous":
            bounds = [n * r // dp_size for r in range(dp_size + 1)]
            groups = [list(range(bounds[r], bounds[r + 1])) for r in range(dp_size)]
        elif balance == "seqlen":
            groups = _balanced(self.lengths, dp_size)
        else:
            raise InvalidArgumentError(f"balance must be 'seqlen' or 'contiguous', got {balance!r}")
        return [replace(self.subset(g), pad_to_seqlen=pad) for g in groups]

    # -- updating --------------------------------------------------------------------
    def with_fields(self, names: Iterable[str], tags: Sequence[Mapping[str, Any]] | None = None) -> SampleMeta:
        """A copy that also lists ``names`` (and, if given, per-sample ``tags`` merged in)."""
        if tags is None:
            new_tags = self.tags
        elif isinstance(self.tags, RowTags):
            new_tags = self.tags.merged(tags)
        else:
            new_tags = [merge_tags(a, b) for a, b in zip(self.tags, tags, strict=True)]
        return replace(self, fields=self.fields | set(names), tags=new_tags, some_fields=self.some_fields - set(names))

    # -- (de)serialising -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/msgpack-able); ``SampleMeta.from_dict`` inverts it."""
        return {
            "partition": self.partition,
            "sample_ids": list(self.sample_ids),
            "lengths": list(self.lengths),
            "fields": sorted(self.fields),
            "tags": list(self.tags),
            "pad_to_seqlen": self.pad_to_seqlen,
            "lease": self.lease,
            "over_budget": self.over_budget,
            "some_fields": sorted(self.some_fields),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SampleMeta:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                partition=data["partition"],
                sample_ids=data["sample_ids"],
                lengths=data.get("lengths") or [],
                fields=frozenset(data.get("fields") or ()),
                tags=data.get("tags") or [],
                pad_to_seqlen=data.get("pad_to_seqlen"),
                lease=data.get("lease"),
                over_budget=bool(data.get("over_budget", False)),
                some_fields=frozenset(data.get("some_fields") or ()),
            )
        except (KeyError, TypeError) as err:
            raise WireFormatError(f"not a SampleMeta dict: {err}") from None

    def to_msgpack(self) -> bytes:
        """msgpack bytes. Example: ``SampleMeta.from_msgpack(meta.to_msgpack())``."""
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> SampleMeta:
        """Inverse of :meth:`to_msgpack`."""
        return cls.from_dict(msgpack.unpackb(data, raw=False, strict_map_key=False))

    def to_json(self) -> str:
        """JSON text (tags must hold JSON-able values)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> SampleMeta:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"SampleMeta(partition={self.partition!r}, samples={len(self)}, "
            f"fields={sorted(self.fields)}, "
            + (f"some_fields={sorted(self.some_fields)}, " if self.some_fields else "")
            + f"pad_to_seqlen={self.pad_to_seqlen})"
        )


def _indices(indices: Sequence[int] | torch.Tensor | range, n: int) -> list[int]:
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            if indices.numel() != n:
                raise ShapeError(f"bool mask of {indices.numel()} entries for {n} samples")
            return indices.nonzero().flatten().tolist()
        indices = indices.tolist()
    idx = [int(i) for i in indices]
    for i in idx:
        if not -n <= i < n:
            raise InvalidArgumentError(f"sample index {i} out of range for {n} samples")
    return [i % n for i in idx] if n else idx


def _balanced(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices per part: counts differ by at most one, token totals greedily balanced."""
    n = len(lengths)
    capacity = [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, r) for r in range(parts) if capacity[r]]
    heapq.heapify(heap)
    for i in sorted(range(n), key=lambda k: (-lengths[k], k)):
        load, r = heapq.heappop(heap)
        groups[r].append(i)
        if len(groups[r]) < capacity[r]:
            heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(g) for g in groups]
