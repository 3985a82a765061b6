"""A storage unit of the native engine: columnar blocks in memory, served over ZMQ.

A *block* is what one put wrote to this unit: per field, one contiguous values buffer
and int64 row offsets (a column), kept as the very frames that arrived (no copy on
receive). Block ids come from the controller and are never reused, so a read can never
be served another put's bytes. A read names, per field, the (block, row) of every sample
it wants; the unit gathers them with one vectorized copy per field
(:func:`rlplane.gather.gather`) and answers one column per field. A block is dropped
when the controller says every row of it was cleared (``free``). ``block`` hands a whole
block back as stored, for the controller to copy it to another unit (re-replication).

Example::

    unit = UnitCore("unit-0")
    Server(unit, secret=b"...").start()
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from rlplane import errors as E
from rlplane.gather import gather
from rlplane.wire import RawColumn, int_array

log = logging.getLogger(__name__)


class UnitCore:
    """The blocks of one storage unit and the operations on them (called by :class:`Server`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._blocks: dict[int, dict[str, RawColumn]] = {}
        self._lock = threading.Lock()
        self._nbytes = 0

    # -- operations (header, columns, buffers) -> (reply, columns, buffers) ------------
    def op_write(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Store ``columns`` as block ``b`` (a block is written once)."""
        bid = header.get("b")
        if not isinstance(bid, int) or bid < 0:
            raise E.WireFormatError("write needs a block id 'b'")
        rows = {c.num_rows for c in columns.values()}
        if len(rows) > 1:
            raise E.WireFormatError(f"a block's columns must hold the same number of rows, got {sorted(rows)}")
        with self._lock:
            if bid in self._blocks:
                raise E.WireFormatError(f"block {bid} is already stored on {self.name}")
            self._blocks[bid] = dict(columns)
            self._nbytes += sum(c.nbytes + c.offsets.nbytes for c in columns.values())
        return {"stored": sum(c.nbytes for c in columns.values())}, {}, []

    def op_read(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Per requested field, the rows ``(block, row)`` in the order asked, as one column."""
        wanted = header.get("f")
        if not isinstance(wanted, list):
            raise E.WireFormatError("read needs 'f': [[field, blocks, rows], ...]")
        out: dict[str, RawColumn] = {}
        for entry in wanted:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                raise E.WireFormatError(f"bad read entry {entry!r}")
            name = entry[0]
            blocks, rows = int_array(entry[1], "blocks"), int_array(entry[2], "rows")
            if blocks.size != rows.size:
                raise E.WireFormatError("blocks and rows differ in length", field=name)
            out[name] = self._gather(name, blocks, rows, header.get("p"))
        return {}, out, []

    def op_block(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Every column of block ``b`` as stored (the controller copies it to another unit
        when a copy was lost with a unit). MissingDataError when it is not here."""
        bid = header.get("b")
        with self._lock:
            block = self._blocks.get(bid) if isinstance(bid, int) else None
        if block is None:
            raise E.MissingDataError("(block copy)", {}, hint=f"block {bid!r} is not on {self.name}")
        return {}, dict(block), []

    def op_free(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        """Drop blocks (every row of them was cleared, or their put never committed)."""
        bids = int_array(header.get("b", b""), "blocks").tolist()
        freed = 0
        with self._lock:
            for bid in bids:
                block = self._blocks.pop(bid, None)
                if block is not None:
                    freed += 1
                    self._nbytes -= sum(c.nbytes + c.offsets.nbytes for c in block.values())
        return {"freed": freed}, {}, []

    def op_stats(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        return self.stats(), {}, []

    def op_ping(self, header: dict[str, Any], columns: dict[str, RawColumn], extra: list[Any]) -> Any:
        return {"unit": self.name}, {}, []

    def damage(self, bid: int, name: str, row: int) -> bool:
        """Flip one bit of row ``row`` of field ``name`` in block ``bid`` (what a failing
        memory module or a stray write would do): the hook the integrity tests use.
        False when the block, field or row is not here (or the row is empty)."""
        with self._lock:
            col = self._blocks.get(bid, {}).get(name)
            if col is None or not 0 <= row < col.num_rows or col.offsets[row] == col.offsets[row + 1]:
                return False
            values = col.values.copy()
            values.view(np.uint8)[int(col.offsets[row]) * values.itemsize] ^= 1
            self._blocks[bid][name] = RawColumn(col.dtype, values, col.offsets)
            return True

    # -- helpers -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"unit": self.name, "blocks": len(self._blocks), "nbytes": self._nbytes}

    def _gather(self, name: str, blocks: np.ndarray, rows: np.ndarray, partition: Any) -> RawColumn:
        uniq, which = np.unique(blocks, return_inverse=True)
        sources = []
        dtypes = set()
        with self._lock:
            for bid in uniq.tolist():
                col = self._blocks.get(bid, {}).get(name)
                if col is None:
                    raise E.MissingDataError(str(partition), {}, hint=f"field {name!r}: block {bid} is gone from "
                                             f"{self.name} (the samples were cleared while this read was in flight)")
                sources.append((col.values, col.offsets))
                dtypes.add(col.dtype)
        if len(dtypes) > 1:
            raise E.ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
        if not sources:
            return RawColumn("uint8", np.empty(0, np.uint8), np.zeros(1, np.int64))
        try:
            values, offsets = gather(sources, which.astype(np.int64), rows)
        except IndexError as err:
            raise E.WireFormatError(f"read asks for a row the block does not hold ({err})", field=name) from None
        return RawColumn(dtypes.pop(), values, offsets)


def unit_actor_class() -> Any:
    """The Ray actor class of a storage unit (lazy: no Ray at import)."""
    import ray

    @ray.remote(num_cpus=0)
    class NativeUnitActor:
        """Hosts a :class:`UnitCore` and its server thread; Ray calls are for the service only."""

        def __init__(self, name: str, host: str | None, secret: str | None) -> None:
            from rlplane_service.native.server import Server

            self._core = UnitCore(name)
            bind = host or ray.util.get_node_ip_address()
            self._server = Server(self._core, host=bind, secret=secret.encode() if secret else None, name=name).start()

        def info(self) -> dict[str, Any]:
            return {"name": self._core.name, "endpoint": self._server.endpoint}

        def stats(self) -> dict[str, Any]:
            return self._core.stats()

        def damage(self, bid: int, name: str, row: int) -> bool:
            """Test hook: flip a stored bit (see :meth:`UnitCore.damage`)."""
            return self._core.damage(bid, name, row)

    return NativeUnitActor


__all__ = ["UnitCore", "unit_actor_class"]
