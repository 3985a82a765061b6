"""The native engine's messages: a msgpack header frame followed by raw buffer frames.

Every message between a client, the controller and the storage units is a ZMQ
multipart message ``[header, buffer, buffer, ...]``. The header is a msgpack map (plain
values only: str, int, float, bool, None, bytes, lists, maps); it names the operation
(``op``), a request id (``rid``) and lists the columns that follow as
``[name, dtype, rows]``: each column is two frames, its values and its int64 offsets.
Replies carry ``ok`` and, on failure, the typed error's payload (``rlplane.errors``).

No pickle, no callables, no paths: nothing in a message is ever executed or opened.
Parsing is strict and raises WireFormatError on anything else, so a server answers
garbage with an error frame and keeps serving.

Example::

    frames = pack_message({"op": "write", "rid": 1}, {"input_ids": col})
    header, columns = unpack_message(frames)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import msgpack
import numpy as np

from rlplane.dtypes import dtype_name, numpy_of
from rlplane.errors import WireFormatError

if TYPE_CHECKING:  # the engine's servers speak this wire without torch (see rlplane.dtypes)
    import torch


class Rows(Protocol):
    """What a message carries of a column (``rlplane.column.Column`` or :class:`RawColumn`):
    flat values, int64 offsets, a dtype, a row count. Named here so this module, which the
    column module uses, does not depend on it."""

    values: Any
    offsets: Any
    dtype: Any

    @property
    def num_rows(self) -> int: ...

VERSION = 1
#: Largest header frame a peer accepts: a commit carries ~21 bytes per (sample, field), so a
#: put of ~100,000 samples of 6 fields fits (140,000 do not: split the put); a locate answers
#: ~55 per pair (the native client reads bigger batches in pieces). Decoded, a header costs at
#: most ~20x its size (a hostile one of short strings), about what one put's bulk frames cost.
MAX_HEADER_BYTES = 16 << 20
#: A header over SMALL_HEADER_BYTES may hold at most MAX_CONTAINERS lists and maps: an
#: empty one is one byte on the wire and ~60 in memory, so without a count one message
#: could make a peer allocate 60x its size. (Smaller headers are decoded without the count.)
SMALL_HEADER_BYTES, MAX_CONTAINERS = 1 << 20, 2 << 20
#: Longest string and bytes value, and most items of one list or map, in a header.
MAX_STR_LEN, MAX_BIN_LEN, MAX_ITEMS = 1 << 20, MAX_HEADER_BYTES, 4 << 20

def raw(t: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of a contiguous 1-D tensor or array (bf16 included), without a copy."""
    if isinstance(t, np.ndarray):
        return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.stride(-1) != 1:  # one element, stride 0 (an expand): "contiguous" to torch, but no byte view
        t = t.clone()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def ints(a: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """An int64 array as bytes for a header (see :func:`int_array`)."""
    if not isinstance(a, (np.ndarray, list, tuple)) and hasattr(a, "numpy"):  # a torch tensor
        a = a.numpy()
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def int_array(b: Any, what: str = "array") -> np.ndarray:
    """The int64 array a header carries as bytes (a read-only view)."""
    if not isinstance(b, (bytes, bytearray, memoryview)) or len(b) % 8:
        raise WireFormatError(f"{what} must be int64 bytes")
    return np.frombuffer(b, dtype="<i8")


def pack_message(header: Mapping[str, Any], columns: Mapping[str, Rows] | None = None,
                 buffers: Sequence[Any] = (), *, checked: bool = False) -> list[Any]:
    """Frames of one message: the header, then per column its values and offsets, then
    any extra ``buffers`` (their count is in the header as ``nbuf``). ``checked`` (a
    request): a header over SMALL_HEADER_BYTES is decoded here as the engine will, so one
    it would refuse is a WireFormatError now, not a request that is never answered."""
    frames: list[Any] = [b""]
    layout = []
    for name, col in (columns or {}).items():
        dname = col.dtype if isinstance(col, RawColumn) else dtype_name(col.dtype)
        layout.append([name, dname, col.num_rows])
        frames += [raw(col.values), raw(col.offsets)]
    frames += list(buffers)
    frames[0] = msgpack.packb({**header, "v": VERSION, "c": layout, "nbuf": len(buffers)}, use_bin_type=True)
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise WireFormatError(f"a {header.get('op', 'message')!s} header of {len(frames[0])} bytes is over the engine's "
                              f"limit of {MAX_HEADER_BYTES}: split the batch into smaller calls")
    if checked and len(frames[0]) > SMALL_HEADER_BYTES:  # (the engine cannot answer what it cannot decode:
        try:                                             # the caller would wait out its timeout, told nothing)
            unpack_header(frames[0])
        except WireFormatError as err:
            raise WireFormatError(f"a {header.get('op', 'message')!s} header the engine would refuse ({err}): keep "
                                  "tags small (big values go in fields) or split the batch") from None
    return frames


def unpack_header(frame: Any) -> dict[str, Any]:
    """The header map of a message (WireFormatError unless it is one)."""
    view = memoryview(frame)
    if view.nbytes > MAX_HEADER_BYTES:
        raise WireFormatError(f"message header of {view.nbytes} bytes is over the limit of {MAX_HEADER_BYTES}")
    header = unpack_counted(view, MAX_CONTAINERS if view.nbytes > SMALL_HEADER_BYTES else None, "message header",
                            raw=False, strict_map_key=True, use_list=True, max_str_len=MAX_STR_LEN,
                            max_bin_len=MAX_BIN_LEN, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS)
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise WireFormatError(f"not an rlplane engine message of version {VERSION}")
    return header


def unpack_counted(data: Any, containers: int | None, what: str, **limits: Any) -> Any:
    """``msgpack.unpackb(data, **limits)`` that decodes at most ``containers`` lists and
    maps (None: uncounted) and no ext types (WireFormatError naming ``what`` otherwise):
    what a header may cost in memory is bounded by its size, not by how many empty maps fit.

    Example: ``unpack_counted(body, MAX_CONTAINERS, "envelope header", raw=False)``.
    """
    hooks = _counting_hooks(containers) if containers is not None else {}
    try:
        return msgpack.unpackb(data, max_ext_len=0, **limits, **hooks)
    except _TooMany:
        raise WireFormatError(f"{what} holds more than {containers} lists and maps") from None
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as err:
        raise WireFormatError(f"{what} is not msgpack ({type(err).__name__})") from None


class _TooMany(Exception):
    pass


def _counting_hooks(containers: int = MAX_CONTAINERS) -> dict[str, Any]:
    """msgpack hooks that raise once a header has decoded ``containers`` lists and maps."""
    left = [containers]

    def count(x: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise _TooMany
        return x

    return {"list_hook": count, "object_hook": count}


@dataclass(frozen=True)
class RawColumn:
    """A column as it arrived: numpy views of the received frames (read-only), its wire
    dtype name, values as the numpy type of the same width, int64 offsets."""

    dtype: str
    values: np.ndarray
    offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.offsets.size - 1

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


def unpack_message(frames: Sequence[Any], header: dict[str, Any] | None = None,
                   ) -> tuple[dict[str, Any], dict[str, RawColumn], list[memoryview]]:
    """Inverse of :func:`pack_message`: header, columns (read-only numpy views of the
    frames) and the extra buffers. Offsets are checked (rise from 0 to the values' length).
    ``header``: the first frame already unpacked (by :func:`unpack_header`)."""
    if not frames:
        raise WireFormatError("empty message")
    if header is None:
        header = unpack_header(frames[0])
    layout, nbuf = header.get("c"), header.get("nbuf")
    if not isinstance(layout, list) or not isinstance(nbuf, int) or nbuf < 0:
        raise WireFormatError("message header lacks its column layout")
    if len(frames) != 1 + 2 * len(layout) + nbuf:
        raise WireFormatError(f"message has {len(frames)} frames; its header announces {1 + 2 * len(layout) + nbuf}")
    columns: dict[str, RawColumn] = {}
    for k, entry in enumerate(layout):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and isinstance(entry[2], int) and entry[2] >= 0):
            raise WireFormatError(f"bad column entry {entry!r}")
        name, dname, rows = entry
        try:
            np_dtype = numpy_of(dname)
        except ValueError as err:
            raise WireFormatError(str(err), field=name) from None
        values = _view(frames[1 + 2 * k], np_dtype, name)
        offsets = _view(frames[2 + 2 * k], np.dtype("<i8"), name)
        check_offsets(offsets, values.size, rows, name)
        columns[name] = RawColumn(dname, values, offsets)
    extra = [memoryview(f) for f in frames[1 + 2 * len(layout):]]
    return header, columns, extra


def check_offsets(offsets: np.ndarray, size: int, rows: int, name: str) -> None:
    """WireFormatError unless ``offsets`` has ``rows + 1`` entries rising from 0 to ``size``."""
    if offsets.size != rows + 1:
        raise WireFormatError(f"{offsets.size} offsets for {rows} rows", field=name)
    if offsets[0] != 0 or offsets[-1] != size or (rows and bool((offsets[1:] < offsets[:-1]).any())):
        raise WireFormatError(f"offsets must rise from 0 to {size} (the values' length)", field=name)

def check_same(same: np.ndarray, n: int, field: str | None = None) -> None:
    """WireFormatError unless ``same`` (one per row) names, for each row, -1 or an earlier
    row that holds its own bytes."""
    if same.shape != (n,) or same.dtype != np.int64:
        raise WireFormatError(f"'same' must be one int64 per row ({n})", field=field)
    dup = np.flatnonzero(same >= 0)
    if dup.size and (bool((same[dup] >= dup).any()) or bool((same[same[dup]] != -1).any())):
        raise WireFormatError("a shared row must name an earlier row that holds its own bytes", field=field)
    if bool((same < -1).any()):
        raise WireFormatError("'same' holds -1 or a row index", field=field)



def _view(frame: Any, dtype: Any, name: str) -> np.ndarray:
    view = memoryview(frame).cast("B")
    dtype = np.dtype(dtype)
    if view.nbytes % dtype.itemsize:
        raise WireFormatError(f"{view.nbytes} bytes is not a whole number of {dtype} elements", field=name)
    return np.frombuffer(view, dtype=dtype)


def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of the same width (bfloat16 travels as its 16-bit pattern)."""
    return numpy_of(dtype_name(dtype)).type


__all__ = ["VERSION", "RawColumn", "pack_message", "unpack_message", "unpack_header", "check_offsets", "check_same",
           "ints", "int_array", "raw", "numpy_dtype"]
