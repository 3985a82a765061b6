"""Column: the unit transports move — one field's rows for a batch of samples.

A column is a contiguous 1-D ``values`` buffer and ``offsets`` (int64, ``B + 1``
entries): row ``i`` is ``values[offsets[i]:offsets[i+1]]``. Every field travels like
this, whatever its container, so no field ever crosses the wire as a bare 1-D column
whose per-row shape a backend could guess wrong; each row's true shape travels in the
sample's tags (see ``rlplane.codec``).

Example::

    col = Column.from_rows([torch.arange(3), torch.arange(2)])
    col.num_rows, col.row(1)          # (2, tensor([0, 1]))
    col.select([1, 0]).offsets        # tensor([0, 2, 5])

**Shared rows.** A column may store a row once for several samples (identical images of
a GRPO group): ``same[i] = j`` (``j < i``) says row ``i``'s bytes are row ``j``'s, and
row ``i`` itself is stored empty; ``same[i] = -1`` for a row that holds its own bytes.
Only the codec, the native engine and the decoders make or take such columns; anything
else gets :meth:`Column.expanded` (every row its own bytes).

**Rows held from earlier puts.** A column a writer hands the native engine may also name
rows whose bytes the store already holds (:class:`HeldRows`, ``Column.held``): those are
stored empty too, and the commit points them at the stored bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlplane.copies import copy_ranges
from rlplane.errors import WireFormatError
from rlplane.geometry import Geometry
from rlplane.wire import check_same


def offsets_from_numels(numels: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Offsets (``[0, n0, n0+n1, ...]``) for rows of the given element counts."""
    counts = torch.as_tensor(numels, dtype=torch.int64)
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class HeldRows:
    """Which rows of a column being written the store holds already (:mod:`rlplane.dedup`):
    ``keys`` ``(n, 2)`` uint64, each row's key (zero: none); ``refs`` ``(n, 5)`` int64, for
    a held row where its bytes are stored (block, row in the block, byte offset in the
    block's extent, byte count, the row's digest as int64), block -1 for the others.

    Example::

        HeldRows(np.zeros((2, 2), np.uint64), np.full((2, 5), -1, np.int64)).rows   # array([], dtype=int64)
    """

    keys: np.ndarray
    refs: np.ndarray

    def __post_init__(self) -> None:
        n = self.keys.shape[0]
        if self.keys.shape != (n, 2) or self.keys.dtype != np.uint64 or self.refs.shape != (n, 5) \
                or self.refs.dtype != np.int64:
            raise WireFormatError("held rows need (n, 2) uint64 keys and (n, 5) int64 refs")

    @property
    def rows(self) -> np.ndarray:
        """The rows the store holds already."""
        return np.flatnonzero(self.refs[:, 0] >= 0)


@dataclass(frozen=True, eq=False)
class Column:
    """One field's rows: ``values`` (1-D, contiguous) split by ``offsets`` (int64, B+1).

    ``sums`` (uint64, one per row) and ``geom`` (one wire geometry per row), when set,
    are the rows' digests and shapes as the codec recorded them: transports that keep
    them per field (the native engine) move them as arrays instead of through each
    sample's tags. None: look in the tags."""

    values: torch.Tensor
    offsets: torch.Tensor
    sums: np.ndarray | None = None
    geom: Geometry | None = None
    same: np.ndarray | None = None  # int64, one per row: -1, or the earlier row whose bytes this one shares
    held: HeldRows | None = None  # rows whose bytes the store holds from earlier puts (written only)

    def __post_init__(self) -> None:
        if self.geom is not None and not isinstance(self.geom, Geometry):
            object.__setattr__(self, "geom", Geometry.of_rows(self.geom))
        v, o = self.values, self.offsets
        n = o.numel() - 1
        if self.sums is not None and self.sums.shape != (n,):
            raise WireFormatError(f"{self.sums.size} row digests for {n} rows")
        if self.geom is not None and len(self.geom) != n:
            raise WireFormatError(f"{len(self.geom)} row geometries for {n} rows")
        if self.same is not None:
            check_same(self.same, n)
        if v.dim() != 1 or not v.is_contiguous():
            raise WireFormatError(f"column values must be 1-D and contiguous, got shape {list(v.shape)}")
        if not v.numel() and v.stride() != (1,):  # (an empty selection's stride 0: a byte view of it fails)
            object.__setattr__(self, "values", v := v.new_empty(0))
        if o.dim() != 1 or o.dtype != torch.int64 or o.numel() < 1:
            raise WireFormatError("column offsets must be a non-empty 1-D int64 tensor")
        # Checked through a numpy view on the CPU: a few small torch ops cost more than the check.
        a = o.numpy() if o.device.type == "cpu" else o.cpu().numpy()
        if a[0] != 0 or a[-1] != v.numel() or (a.size > 1 and bool((a[1:] < a[:-1]).any())):
            raise WireFormatError(
                f"column offsets must rise from 0 to {v.numel()} (the values' length); got {int(a[0])}..{int(a[-1])}"
            )
        if self.same is not None and bool((np.diff(a)[self.same >= 0] != 0).any()):
            raise WireFormatError("a row that shares another row's bytes must be stored empty")
        if self.held is not None:
            rows = self.held.rows
            if self.held.keys.shape[0] != n or bool((np.diff(a)[rows] != 0).any()):
                raise WireFormatError("a row the store holds already must be stored empty, one key per row")
            if self.same is not None and bool((self.same[rows] >= 0).any()):
                raise WireFormatError("a row the store holds already cannot also repeat a row of its put")

    def with_meta(self, sums: np.ndarray | None, geom: Geometry | Sequence[Any] | None) -> Column:
        """The same rows with their digests and geometries (values and offsets are not
        checked again: this column's were, when it was made)."""
        n = self.offsets.numel() - 1
        if geom is not None:
            geom = Geometry.coerce(geom)
        if sums is not None and sums.shape != (n,):
            raise WireFormatError(f"{sums.size} row digests for {n} rows")
        if geom is not None and len(geom) != n:
            raise WireFormatError(f"{len(geom)} row geometries for {n} rows")
        out = object.__new__(Column)
        for name, value in (("values", self.values), ("offsets", self.offsets), ("sums", sums), ("geom", geom),
                            ("same", self.same), ("held", self.held)):
            object.__setattr__(out, name, value)
        return out

    def to(self, device: torch.device | str) -> Column:
        """The same rows with their values on ``device`` (one copy; offsets, digests and
        geometry stay on the host, where the codec reads them).

        Example::

            Column.from_rows([torch.arange(3)]).to("cpu").values   # tensor([0, 1, 2])
        """
        values = self.values.to(device)
        return self if values is self.values else replace(self, values=values)

    def sharing(self, same: np.ndarray | None) -> Column:
        """The same stored rows, with row ``i``'s bytes those of row ``same[i]`` where it is >= 0
        (those rows must be stored empty). ``None``: every row holds its own bytes."""
        return Column(self.values, self.offsets, self.sums, self.geom, None if same is None else
                      np.ascontiguousarray(same, dtype=np.int64))

    def take(self, rows: np.ndarray) -> Column:
        """Rows ``rows`` (distinct, in that order) in a new buffer, keeping which of them share
        bytes: the first taken row of each shared group holds the bytes, the rest repeat it.

        Example::

            col = Column(torch.arange(3), torch.tensor([0, 3, 3, 3]), same=np.array([-1, 0, 0]))
            col.take(np.array([1, 2])).same      # array([-1,  0])
        """
        rows = np.asarray(rows, np.int64)
        src = rows if self.same is None else np.where(self.same[rows] >= 0, self.same[rows], rows)
        same = None
        if self.same is not None:
            _, first, which = np.unique(src, return_index=True, return_inverse=True)
            back = first[which.reshape(-1)]
            same = np.where(back == np.arange(rows.size), -1, back).astype(np.int64)
        off = self.offsets.numpy()
        lens = np.diff(off)[src] if same is None else np.where(same >= 0, 0, np.diff(off)[src])
        out = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=out[1:])
        values = torch.empty(int(out[-1]), dtype=self.dtype)
        size = self.values.element_size()
        if values.numel():
            copy_ranges(values.view(torch.uint8).numpy(), out[:-1] * size, self.values.view(torch.uint8).numpy(),
                        off[:-1][src] * size, lens * size)
        return Column(values, torch.from_numpy(out), same=same)

    def expanded(self) -> Column:
        """This column with every row holding its own bytes (shared rows copied out; the column
        itself when no row is shared).

        Example::

            Column(torch.arange(3), torch.tensor([0, 3, 3]), same=np.array([-1, 0])).expanded().values
            # tensor([0, 1, 2, 0, 1, 2])
        """
        if self.held is not None and self.held.rows.size:
            raise WireFormatError("a column naming rows the store holds already has not their bytes to expand")
        if self.same is None:
            return self
        plain = Column(self.values, self.offsets)
        src = np.where(self.same >= 0, self.same, np.arange(self.same.size))
        return plain.take(src).with_meta(self.sums, self.geom)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> Column:
        """Concatenate flattened ``rows`` in one copy. ``dtype`` is needed when ``rows`` is empty."""
        if not rows:
            return cls.empty(dtype or torch.uint8)
        flat = [r.reshape(-1) for r in rows]
        return cls(torch.cat(flat), offsets_from_numels([r.numel() for r in flat]))

    @classmethod
    def empty(cls, dtype: torch.dtype) -> Column:
        """A 0-row column."""
        return cls(torch.empty(0, dtype=dtype), torch.zeros(1, dtype=torch.int64))

    @classmethod
    def uniform(cls, values: torch.Tensor, num_rows: int) -> Column:
        """``num_rows`` rows of equal size over ``values`` (no copy when contiguous)."""
        flat = values.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        per_row = flat.numel() // num_rows if num_rows else 0
        return cls(flat, torch.arange(num_rows + 1, dtype=torch.int64) * per_row)

    @classmethod
    def from_nested(cls, nested: torch.Tensor) -> Column:
        """From a jagged NestedTensor of rows (any trailing dims are flattened into the row)."""
        if not nested.is_nested:
            raise WireFormatError("expected a NestedTensor")
        if nested.layout == torch.jagged and getattr(nested, "_lengths", None) is None:
            offsets = nested.offsets().to("cpu", torch.int64)
            inner = math.prod(nested.values().shape[1:])
            values = nested.values()[int(offsets[0]) : int(offsets[-1])].reshape(-1)
            return cls(values.contiguous(), (offsets - offsets[0]) * inner)
        return cls.from_rows(list(nested.unbind()))

    @classmethod
    def concat(cls, columns: Sequence[Column], into: Callable[[int, torch.dtype], torch.Tensor] | None = None
               ) -> Column:
        """Rows of ``columns`` one after another (one copy; into ``into(numel, dtype)`` when
        given, e.g. pooled memory), with their digests and geometries where every column has
        them, and which rows share another's bytes (a shared row names a row of its own
        column: renumbered here).

        Example: ``Column.concat([a, b]).num_rows == a.num_rows + b.num_rows``."""
        if not columns:
            raise WireFormatError("concat needs at least one column")
        dtypes = {c.dtype for c in columns}
        if len(dtypes) > 1:
            raise WireFormatError(f"cannot concat columns of dtypes {sorted(map(str, dtypes))}")
        if any(c.held is not None for c in columns):
            raise WireFormatError("a column naming rows the store holds already cannot be concatenated")
        numels = torch.cat([c.row_numels() for c in columns])
        sums = np.concatenate([c.sums for c in columns]) if all(c.sums is not None for c in columns) else None
        geom = Geometry.concat([c.geom for c in columns]) if all(c.geom is not None for c in columns) else None
        same = None
        if any(c.same is not None for c in columns):
            firsts = np.cumsum([0] + [c.num_rows for c in columns[:-1]])
            same = np.concatenate([np.where(c.same >= 0, c.same + k, -1) if c.same is not None
                                   else np.full(c.num_rows, -1, np.int64) for c, k in zip(columns, firsts.tolist())])
        values = [c.values for c in columns]
        out = torch.cat(values) if into is None else torch.cat(values, out=into(int(numels.sum()), values[0].dtype))
        return cls(out, offsets_from_numels(numels), sums, geom, same)

    # -- inspection ------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def row_numels(self) -> torch.Tensor:
        """Element count of every row as stored (int64, length B; 0 for a row sharing another's)."""
        return torch.diff(self.offsets)

    def logical_numels(self) -> torch.Tensor:
        """Element count of every row's bytes, shared or not (int64, length B)."""
        numels = torch.diff(self.offsets)
        if self.held is not None:  # a held row's bytes are where the store keeps them
            rows = self.held.rows
            numels = numels.clone()
            numels[torch.from_numpy(rows)] = torch.from_numpy(self.held.refs[rows, 3] // self.values.element_size())
        if self.same is None:
            return numels
        return numels[torch.from_numpy(np.where(self.same >= 0, self.same, np.arange(self.same.size)))]

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` as a 1-D view (a shared row: a view of the row whose bytes it shares)."""
        if self.same is not None and self.same[i] >= 0:
            i = int(self.same[i])
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def rows(self) -> list[torch.Tensor]:
        """Every row as a 1-D view of ``values``."""
        if self.same is not None:
            return [self.row(i) for i in range(self.num_rows)]
        return list(self.values.split(self.row_numels().tolist())) if self.num_rows else []

    # -- selection -------------------------------------------------------------------
    def select(self, indices: Sequence[int]) -> Column:
        """Rows at ``indices`` in that order, gathered into a new buffer (one copy)."""
        rows = self.rows()
        return Column.from_rows([rows[i] for i in indices], dtype=self.dtype)

    def to_nested(self) -> torch.Tensor:
        """A jagged NestedTensor of the 1-D rows (shares ``values``)."""
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets.to(self.values.device))

    def __repr__(self) -> str:
        shared = f", shared_rows={int((self.same >= 0).sum())}" if self.same is not None else ""
        return f"Column(rows={self.num_rows}, dtype={self.dtype}, nbytes={self.nbytes}{shared})"

