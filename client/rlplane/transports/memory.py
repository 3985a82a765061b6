"""MemoryTransport: an in-process store with the reference semantics of every transport.

Unit tests and the codec demo use it instead of a live service. It copies on put and on
get, as any real transport moves bytes, and it is strict: a get that cannot return every
requested (sample, field) raises MissingDataError.

Example::

    t = MemoryTransport()
    t.put("p", ["a"], enc.columns, enc.tags, create=True)
    columns, tags = t.get("p", ["a"], list(enc.columns))
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from rlplane.codec import merge_tags
from rlplane.column import Column
from rlplane.errors import DuplicateSampleError, FieldsHeldError, MissingDataError, ShapeError
from rlplane.tags import incarnation, stale, stale_meta
from rlplane.transports.base import PartitionInfo, Transport, check_put, check_written_lengths


@dataclass
class _Sample:
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    born: int = 0  # its incarnation (rlplane.tags.BORN_TAG): drawn by the put that made it


class MemoryTransport(Transport):
    """Thread-safe in-memory store (see the module docstring)."""

    name = "memory"
    checks_born = True
    checks_lengths = True
    probes_fields = True

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, _Sample]] = {}
        self._dtypes: dict[tuple[str, str], torch.dtype] = {}
        self._lock = threading.Lock()

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
        """A put of new samples (``create``) gives them an incarnation and returns it (or
        keeps ``born``, one per sample, as given); a write with ``born`` naming samples
        cleared and put again since is refused (MissingDataError), and one with ``aligned``
        (the token fields) whose token rows are not as long as the sample's, or, ``grows``
        (an extend: the lengths it read), that leaves out one a sample holds or grows a
        sample another extend grew since (ShapeError): nothing stored."""
        check_put(sample_ids, columns, tags)
        if born is not None and len(born) != len(sample_ids):
            raise ShapeError(f"{len(born)} incarnations for {len(sample_ids)} samples")
        given = incarnation(f"memory.{uuid.uuid4().hex}") if create and born is None else None
        births = np.full(len(sample_ids), given, np.int64) if given is not None else \
            np.asarray(born, np.int64) if born is not None else None
        # Copy outside the lock: one buffer per column, rows are views of it.
        rows = {name: col.values.clone().split(col.row_numels().tolist()) for name, col in columns.items()}
        with self._lock:
            part = self._parts.get(partition, {})
            if create:
                taken = [s for s in sample_ids if s in part]
                if taken:
                    raise DuplicateSampleError(partition, taken)
            else:
                unknown = [s for s in sample_ids if s not in part]
                if unknown:
                    raise MissingDataError(
                        partition, {s: [] for s in unknown}, hint="put_samples them before write_columns"
                    )
                if births is not None and (bad := stale(births, self._born(part, sample_ids))).size:
                    raise stale_meta(partition, list(sample_ids), bad, "write")
                if aligned:
                    check_written_lengths(list(sample_ids), [part[s].tags for s in sample_ids], columns, tags, aligned,
                                          grows)
            part = self._parts.setdefault(partition, part)
            for i, sid in enumerate(sample_ids):
                sample = part.setdefault(sid, _Sample())
                for name in columns:
                    sample.rows[name] = rows[name][i]
                sample.tags = merge_tags(sample.tags, tags[i])
                if create and births is not None:
                    sample.born = int(births[i])
            for name, col in columns.items():
                self._dtypes[(partition, name)] = col.dtype
        return given

    @staticmethod
    def _born(part: Mapping[str, _Sample], sample_ids: Sequence[str]) -> np.ndarray:
        return np.array([part[s].born for s in sample_ids], np.int64)

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], *, copy: bool = True,
        born: Any = None, probe: Sequence[str] = (),
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        if born is not None and len(born) != len(sample_ids):
            raise ShapeError(f"{len(born)} incarnations for {len(sample_ids)} samples")
        with self._lock:
            part = self._parts.get(partition, {})
            missing: dict[str, list[str]] = {}
            for sid in sample_ids:
                sample = part.get(sid)
                if sample is None:
                    missing[sid] = []
                else:
                    lacking = [f for f in fields if f not in sample.rows]
                    if lacking:
                        missing[sid] = lacking
            if missing:
                raise MissingDataError(partition, missing)
            if born is not None and (bad := stale(np.asarray(born, np.int64), self._born(part, sample_ids))).size:
                raise stale_meta(partition, list(sample_ids), bad, "read")
            picked = [part[sid] for sid in sample_ids]
            held = {f for f in probe if f not in fields and any(f in s.rows for s in picked)}
            if held:
                raise FieldsHeldError(partition, sorted(held))
            dtypes = {f: self._dtypes.get((partition, f), torch.uint8) for f in fields}
        for f in fields:  # (torch.cat would promote rows written with another dtype, silently: bool rows as uint8)
            kinds = {s.rows[f].dtype for s in picked}
            if len(kinds) > 1:
                raise ShapeError(f"the requested samples were written with different dtypes "
                                 f"{sorted(str(k).removeprefix('torch.') for k in kinds)}", field=f)
        columns = {f: Column.from_rows([s.rows[f] for s in picked], dtype=dtypes[f]) for f in fields}
        return columns, [dict(s.tags) for s in picked]

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        with self._lock:
            part = self._parts.get(partition)
            if part is None:
                return 0
            if sample_ids is None:
                del self._parts[partition]
                return len(part)
            dropped = sum(part.pop(s, None) is not None for s in sample_ids)
            if not part:
                del self._parts[partition]
            return dropped

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(self._parts)

    def describe(self, partition: str) -> PartitionInfo:
        with self._lock:
            part = self._parts.get(partition)
            if not part:
                raise MissingDataError(partition, {}, hint="the partition holds no samples")
            counts: dict[str, int] = {}
            nbytes = 0
            for sample in part.values():
                for name, row in sample.rows.items():
                    counts[name] = counts.get(name, 0) + 1
                    nbytes += row.numel() * row.element_size()
            return PartitionInfo(partition, list(part), counts, nbytes)
