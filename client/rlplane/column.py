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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from rlplane.errors import WireFormatError
from rlplane.geometry import Geometry


def offsets_from_numels(numels: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Offsets (``[0, n0, n0+n1, ...]``) for rows of the given element counts."""
    counts = torch.as_tensor(numels, dtype=torch.int64)
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=out[1:])
    return out


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

    def __post_init__(self) -> None:
        if self.geom is not None and not isinstance(self.geom, Geometry):
            object.__setattr__(self, "geom", Geometry.of_rows(self.geom))
        v, o = self.values, self.offsets
        n = o.numel() - 1
        if self.sums is not None and self.sums.shape != (n,):
            raise WireFormatError(f"{self.sums.size} row digests for {n} rows")
        if self.geom is not None and len(self.geom) != n:
            raise WireFormatError(f"{len(self.geom)} row geometries for {n} rows")
        if v.dim() != 1 or not v.is_contiguous():
            raise WireFormatError(f"column values must be 1-D and contiguous, got shape {list(v.shape)}")
        if o.dim() != 1 or o.dtype != torch.int64 or o.numel() < 1:
            raise WireFormatError("column offsets must be a non-empty 1-D int64 tensor")
        # Checked through a numpy view on the CPU: a few small torch ops cost more than the check.
        a = o.numpy() if o.device.type == "cpu" else o.cpu().numpy()
        if a[0] != 0 or a[-1] != v.numel() or (a.size > 1 and bool((a[1:] < a[:-1]).any())):
            raise WireFormatError(
                f"column offsets must rise from 0 to {v.numel()} (the values' length); got {int(a[0])}..{int(a[-1])}"
            )

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
        for name, value in (("values", self.values), ("offsets", self.offsets), ("sums", sums), ("geom", geom)):
            object.__setattr__(out, name, value)
        return out

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
    def concat(cls, columns: Sequence[Column]) -> Column:
        """Rows of ``columns`` one after another (one copy)."""
        if not columns:
            raise WireFormatError("concat needs at least one column")
        dtypes = {c.dtype for c in columns}
        if len(dtypes) > 1:
            raise WireFormatError(f"cannot concat columns of dtypes {sorted(map(str, dtypes))}")
        numels = torch.cat([c.row_numels() for c in columns])
        return cls(torch.cat([c.values for c in columns]), offsets_from_numels(numels))

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
        """Element count of every row (int64, length B)."""
        return torch.diff(self.offsets)

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` as a 1-D view."""
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def rows(self) -> list[torch.Tensor]:
        """Every row as a 1-D view of ``values``."""
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
        return f"Column(rows={self.num_rows}, dtype={self.dtype}, nbytes={self.nbytes})"

