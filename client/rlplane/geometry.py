"""Each row's wire geometry of one field, held as arrays when the rows are dense.

A row's geometry is what the codec needs to give it back its shape: ``[n, *rest]`` for
a token row of n tokens, the shape for a sample row, ``[nbytes]`` for an object row and
``{"d": dim, "p": pad, "s": [segment shapes]}`` for a packed row. Dense fields have one
trailing shape for (nearly) every row, so a :class:`Geometry` keeps them as a leading
dimension per row (``lead``, int64, or none) plus a small table of trailing shapes and
each row's index into it (``kind``): building, moving, storing and checking 4096 rows
costs a few array operations instead of 4096 Python lists. Packed rows stay one object
per row (a batch holds few of them and each is already a list of shapes).

Torch-free (numpy only): the controller stores geometries too.

Example::

    g = Geometry.token(np.array([5, 9]), rest=[])
    g[1]                  # [9]
    Geometry.from_wire(g.to_wire()).tolist()   # [[5], [9]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlplane.errors import WireFormatError

Shape = tuple[int, ...]

#: At most this many distinct trailing shapes in one geometry (more: the rows are not dense).
MAX_SHAPES = 1024
#: A row's leading dim (its tokens) is below this: sums of a batch's lengths stay far from
#: int64's end (a token-budget claim adds them up).
MAX_LEAD = 1 << 40


class Geometry(Sequence[Any]):
    """Rows' geometries: dense (``lead`` + ``shapes`` + ``kind``) or one object per row."""

    __slots__ = ("lead", "shapes", "kind", "_rows")

    def __init__(self, lead: np.ndarray | None, shapes: Sequence[Shape], kind: np.ndarray | None,
                 rows: list[Any] | None = None, n: int | None = None) -> None:
        self.lead = lead
        self.shapes = tuple(shapes)
        self.kind = kind
        self._rows = rows
        if rows is None and lead is None and kind is None:
            if n is None:
                raise ValueError("a geometry without lead or kind needs its row count")
            self.kind = np.zeros(n, np.int32)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def token(cls, lengths: np.ndarray, rest: Sequence[int]) -> Geometry:
        """``[lengths[i], *rest]`` per row."""
        return cls(np.ascontiguousarray(lengths, np.int64), [tuple(int(x) for x in rest)], None)

    @classmethod
    def uniform(cls, shape: Sequence[int], n: int) -> Geometry:
        """``shape`` for each of ``n`` rows."""
        return cls(None, [tuple(int(x) for x in shape)], None, n=n)

    @classmethod
    def of_rows(cls, rows: Sequence[Any]) -> Geometry:
        """One geometry object per row, as given (packed rows; a foreign writer's tags)."""
        return cls(None, (), None, list(rows))

    @classmethod
    def coerce(cls, g: Geometry | Sequence[Any]) -> Geometry:
        return g if isinstance(g, Geometry) else cls.of_rows(g)

    @classmethod
    def concat(cls, parts: Sequence[Geometry]) -> Geometry:
        """The rows of ``parts`` one after another (dense when they all are, with one table).

        Example: ``Geometry.concat([Geometry.token(np.array([2]), []), Geometry.token(np.array([5]), [])]).tolist()``
        is ``[[2], [5]]``.
        """
        first = parts[0] if parts else None
        if first is not None and all(g.dense and g.shapes == first.shapes and (g.lead is None) == (first.lead is None)
                                     and (g.kind is None) == (first.kind is None) for g in parts):
            return cls(np.concatenate([g.lead for g in parts]) if first.lead is not None else None, first.shapes,
                       np.concatenate([g.kind for g in parts]) if first.kind is not None else None,
                       n=sum(len(g) for g in parts))
        return cls.of_rows([row for g in parts for row in g.tolist()])

    # -- inspection ------------------------------------------------------------------
    @property
    def dense(self) -> bool:
        return self._rows is None

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        return int((self.lead if self.lead is not None else self.kind).shape[0])  # type: ignore[union-attr]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if self._rows is not None:
            return self._rows[i]
        shape = list(self.shapes[int(self.kind[i]) if self.kind is not None else 0])
        return [int(self.lead[i]), *shape] if self.lead is not None else shape

    def tolist(self) -> list[Any]:
        """Every row's geometry object (what a sample's tags record)."""
        if self._rows is not None:
            return list(self._rows)
        return [self[i] for i in range(len(self))]

    def trailing(self) -> Shape | None:
        """The one trailing shape every row shares (dense rows), else None."""
        if self._rows is not None:
            return None
        if len(self.shapes) == 1 or self.kind is None:
            return self.shapes[0] if self.shapes else None
        used = np.unique(self.kind)
        return self.shapes[int(used[0])] if used.size == 1 else None

    def first_other(self) -> int:
        """The first row whose trailing shape differs from row 0's (dense rows; -1 if none)."""
        if self.kind is None or not len(self):
            return -1
        differ = np.flatnonzero(self.kind != self.kind[0])
        return int(differ[0]) if differ.size else -1

    def leads(self) -> np.ndarray:
        """Each row's leading dim (a token row's: its length) as int64, -1 where it has none.

        Example: ``Geometry.token(np.array([3, 5]), []).leads()`` is ``array([3, 5])``."""
        if self._rows is None:
            return self.lead.astype(np.int64) if self.lead is not None else np.full(len(self), -1, np.int64)
        return np.asarray([r[0] if isinstance(r, list) and r and type(r[0]) is int else -1 for r in self._rows],
                          np.int64)

    def take(self, index: np.ndarray) -> Geometry:
        """The rows at ``index`` (int positions), in that order."""
        if self._rows is not None:
            rows = self._rows
            return Geometry.of_rows([rows[i] for i in index.tolist()])
        return Geometry(self.lead[index] if self.lead is not None else None, self.shapes,
                        self.kind[index] if self.kind is not None else None, n=int(index.size))

    # -- the wire ---------------------------------------------------------------------
    def to_wire(self) -> Any:
        """A header value: ``{"n", "l", "k", "t"}`` for dense rows, else the list of rows."""
        if self._rows is not None:
            return self._rows
        return {"n": len(self),
                "l": None if self.lead is None else self.lead.astype("<i8", copy=False).tobytes(),
                "k": None if self.kind is None or len(self.shapes) == 1 else self.kind.astype("<i4", copy=False).tobytes(),
                "t": [list(s) for s in self.shapes]}

    @classmethod
    def from_wire(cls, value: Any, field: str | None = None, rows: int | None = None) -> Geometry:
        """The geometry a header carried (WireFormatError naming ``field`` if malformed);
        ``rows``: how many rows it must describe, checked before anything is allocated.
        A row kept as an object must be a list of dims (ints >= 0) or of shapes, or a map."""
        if isinstance(value, list):
            if rows is not None and len(value) != rows:
                raise WireFormatError(f"row geometry describes {len(value)} rows of {rows}", field=field)
            if not all(is_packed_row(r) if isinstance(r, dict) else _is_row(r) for r in value):
                raise WireFormatError(f"a row's geometry must be a shape (at most {MAX_DIMS} ints in [0, 2**40) of "
                                      f"fewer than 2**62 elements), its segments' shapes, or a packed row's "
                                      "{d, p, s} map", field=field)
            return cls.of_rows(value)
        if not isinstance(value, dict) or set(value) != {"n", "l", "k", "t"}:
            raise WireFormatError("row geometry must be a list of rows or a dense {n, l, k, t} map", field=field)
        n, raw_lead, raw_kind, table = value["n"], value["l"], value["k"], value["t"]
        if type(n) is not int or n < 0:
            raise WireFormatError("dense row geometry needs a row count", field=field)
        if rows is not None and n != rows:
            raise WireFormatError(f"row geometry describes {n} rows of {rows}", field=field)
        if not isinstance(table, list) or not 1 <= len(table) <= MAX_SHAPES or not all(is_shape(s) for s in table):
            raise WireFormatError(f"dense row geometry needs 1..{MAX_SHAPES} shapes of ints >= 0", field=field)
        lead = _array(raw_lead, "<i8", n, "leading dims", field)
        kind = _array(raw_kind, "<i4", n, "shape indices", field)
        if lead is not None and lead.size and (int(lead.min()) < 0 or int(lead.max()) >= MAX_LEAD):
            raise WireFormatError(f"a row's leading dim is negative or not below {MAX_LEAD}", field=field)
        if kind is not None and kind.size and (int(kind.min()) < 0 or int(kind.max()) >= len(table)):
            raise WireFormatError("a row's shape index is outside the geometry's shapes", field=field)
        if kind is None and len(table) != 1:
            raise WireFormatError("dense row geometry with several shapes needs each row's index", field=field)
        return cls(lead, [tuple(s) for s in table], kind, n=n)


#: A shape's most dims, and (below) the most elements it may describe: what any row of a
#: real tensor keeps to, so sizes worked out from a shape never overflow int64.
MAX_DIMS, MAX_NUMEL = 32, 1 << 62


def is_shape(x: Any) -> bool:
    """Whether ``x`` is a shape as rlplane writes one: a list of at most :data:`MAX_DIMS`
    ints (never bools) in ``[0, MAX_LEAD)`` whose product is below :data:`MAX_NUMEL`.

    Example: ``is_shape([36, 1176])`` is True; ``is_shape([2**62, 4])`` is False.
    """
    if not isinstance(x, list) or len(x) > MAX_DIMS:
        return False
    numel = 1
    for v in x:
        if type(v) is not int or not 0 <= v < MAX_LEAD:
            return False
        numel *= v
    return numel < MAX_NUMEL


def is_packed_row(x: Any) -> bool:
    """Whether ``x`` is a packed field's row geometry: ``{"d": int, "p": bool, "s": [shapes]}``.

    Example: ``is_packed_row({"d": 0, "p": False, "s": [[4, 1176]]})`` is True.
    """
    return (isinstance(x, dict) and set(x) == {"d", "p", "s"} and type(x["d"]) is int and -MAX_DIMS <= x["d"] < MAX_DIMS
            and type(x["p"]) is bool and isinstance(x["s"], list) and all(is_shape(seg) for seg in x["s"]))


def _is_row(x: Any) -> bool:
    """A row's geometry object as a list: its shape, or its segments' shapes (nothing deeper)."""
    return is_shape(x) or (isinstance(x, list) and all(is_shape(seg) for seg in x))


def _array(raw: Any, dtype: str, n: int, what: str, field: str | None) -> np.ndarray | None:
    if raw is None:
        return None
    size = np.dtype(dtype).itemsize
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != n * size:
        raise WireFormatError(f"row geometry's {what} must be {n} x {dtype} bytes", field=field)
    return np.frombuffer(raw, dtype).astype(np.int64 if size == 8 else np.int32, copy=False)


__all__ = ["Geometry", "MAX_SHAPES", "MAX_LEAD", "MAX_DIMS", "MAX_NUMEL", "is_shape", "is_packed_row"]
