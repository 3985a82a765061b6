"""The binary envelope: how columns cross HTTP between the client and the service.

One body is a small msgpack header followed by the columns' raw buffers, each starting
on a 64-byte boundary::

    b"RLPL" | u32 version | u64 header length | msgpack header | pad | buffer | pad | buffer ...

The header carries the request's plain values (partition, sample ids, tags, ...) and,
per column, its dtype name, row count and where its ``values`` and int64 ``offsets``
buffers lie, and for a column with shared rows (a GRPO group's images, stored once:
:attr:`rlplane.column.Column.same`) which earlier row each repeats, as int64 bytes. No
pickle, no base64, no JSON lists of numbers: tensors travel as their bytes and come back
as zero-copy views of the received body.

Example::

    body = pack({"partition": "p"}, enc.columns)
    header, columns = unpack(bytearray(body))
"""

from __future__ import annotations

import struct
from typing import Any, Iterator, Mapping, Sequence

import msgpack
import torch

from rlplane.column import Column
from rlplane.dtypes import dtype_from_name, dtype_name
from rlplane.errors import WireFormatError
from rlplane.wire import MAX_CONTAINERS, SMALL_HEADER_BYTES, int_array, ints, unpack_counted
from rlplane.wire import raw as _raw  # the bytes of a tensor without a copy, shared with the engine's wire

MAGIC = b"RLPL"
VERSION = 1
CONTENT_TYPE = "application/x-rlplane"
_PREFIX = struct.Struct("<4sIQ")  # magic, version, header length
_ALIGN = 64


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def pack(header: Mapping[str, Any], columns: Mapping[str, Column] | None = None) -> bytes:
    """One body: ``header`` (msgpack-able) and ``columns`` as raw buffers.

    Example: ``pack({"partition": "p", "sample_ids": ids}, enc.columns)``.
    """
    return b"".join(pack_parts(header, columns))


def pack_parts(header: Mapping[str, Any], columns: Mapping[str, Column] | None = None) -> list[bytes | memoryview]:
    """The pieces of :func:`pack`'s body, in order, the columns' bytes as views (no copy):
    for senders that stream the body instead of joining it.

    Example: ``sum(len(p) for p in pack_parts(header, cols)) == len(pack(header, cols))``.
    """
    buffers: list[memoryview] = []
    layout = []
    pos = 0
    for name, col in (columns or {}).items():
        entry = [name, dtype_name(col.dtype), col.num_rows]
        for t in (col.values, col.offsets):
            raw = _raw(t)
            entry += [pos, raw.nbytes]
            buffers.append(raw)
            pos += raw.nbytes + _pad(raw.nbytes)
        if col.same is not None:
            entry.append(ints(col.same))
        layout.append(entry)
    head = msgpack.packb({"h": dict(header), "c": layout}, use_bin_type=True)
    start = _PREFIX.size + len(head)
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, VERSION, len(head)), head, bytes(_pad(start))]
    for raw in buffers:
        parts += [raw, bytes(_pad(raw.nbytes))]
    return parts


def chunked(parts: Sequence[bytes | memoryview], size: int) -> Iterator[memoryview]:
    """``parts`` (e.g. :func:`pack_parts`) as views of at most ``size`` bytes, no copy:
    for streaming a body in pieces.

    Example: ``b"".join(chunked([b"abc", b"de"], 2)) == b"abcde"``.
    """
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), size):
            yield view[start : start + size]


def unpack(body: bytearray | memoryview | bytes) -> tuple[dict[str, Any], dict[str, Column]]:
    """Inverse of :func:`pack`. Columns are views of ``body`` (pass a ``bytearray`` to get
    writable tensors). Raises WireFormatError on anything that is not a valid envelope.

    Example: ``header, columns = unpack(bytearray(response.content))``.
    """
    view = memoryview(body)
    if view.nbytes < _PREFIX.size:
        raise WireFormatError("body too short to be an rlplane envelope")
    magic, version, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireFormatError(f"not an rlplane envelope (content-type {CONTENT_TYPE} expected)")
    if version != VERSION:
        raise WireFormatError(f"envelope version {version} is not supported (this client speaks {VERSION})")
    start = _PREFIX.size + head_len
    if start > view.nbytes:
        raise WireFormatError("envelope header runs past the body")
    # (a header of 8 MiB of empty maps decoded to 600 MiB: past 1 MiB, at most a list or map per 16 bytes, about
    # what real tags hold, so decoded it costs a few times its size at most)
    containers = max(MAX_CONTAINERS, head_len // 16) if head_len > SMALL_HEADER_BYTES else None
    head = unpack_counted(view[_PREFIX.size : start], containers, "envelope header", raw=False, strict_map_key=False)
    try:
        header, layout = head["h"], head["c"]
    except (KeyError, TypeError) as err:
        raise WireFormatError(f"envelope header is not an rlplane one ({err})") from None
    if not isinstance(header, dict) or not isinstance(layout, list):
        raise WireFormatError("envelope header must be a map with a list of columns")
    base = start + _pad(start)
    columns = {}
    for entry in layout:
        try:
            name, dname, rows, v_at, v_len, o_at, o_len, *shared = entry
            dtype = dtype_from_name(dname)
        except (ValueError, TypeError) as err:
            raise WireFormatError(f"bad column entry in envelope header ({err})") from None
        if len(shared) > 1 or (shared and not isinstance(shared[0], bytes)):
            raise WireFormatError("a column's shared rows travel as one int64 bytes field", field=str(name)[:80])
        if not isinstance(name, str) or not all(isinstance(x, int) and x >= 0 for x in (rows, v_at, v_len, o_at, o_len)):
            raise WireFormatError(f"bad column entry in envelope header: {entry!r}")
        if o_len != 8 * (rows + 1):
            raise WireFormatError(f"offsets of {rows} rows need {8 * (rows + 1)} bytes, got {o_len}", field=name)
        values = _tensor(body, base + v_at, v_len, dtype, name)
        offsets = _tensor(body, base + o_at, o_len, torch.int64, name)
        same = int_array(shared[0], "shared rows").copy() if shared else None  # (checked by Column)
        columns[name] = Column(values, offsets, same=same)
    return header, columns


def _tensor(body: Any, at: int, nbytes: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    if at < 0 or at + nbytes > memoryview(body).nbytes or nbytes % size:
        raise WireFormatError(f"buffer [{at}, {at + nbytes}) does not fit the body or the dtype", field=name)
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(body, dtype=torch.uint8, count=nbytes, offset=at).view(dtype)


__all__ = ["CONTENT_TYPE", "pack", "unpack"]
