"""The binary envelope: raw buffers round-trip bit-exactly; anything else is a WireFormatError."""

import msgpack
import numpy as np
import pytest
import torch

from rlplane.column import Column
from rlplane.envelope import pack, unpack
from rlplane.errors import WireFormatError


def test_round_trip_every_dtype_and_empty_rows_bit_exact():
    cols = {
        "bf": Column.from_rows([torch.randn(5).bfloat16(), torch.empty(0, dtype=torch.bfloat16), torch.randn(3).bfloat16()]),
        "i64": Column.from_rows([torch.arange(4), torch.arange(2)]),
        "u8": Column.from_rows([torch.tensor([1, 2, 3], dtype=torch.uint8)]),
        "b": Column.from_rows([torch.tensor([True, False])]),
        "none": Column.empty(torch.float32),
    }
    header, got = unpack(bytearray(pack({"sample_ids": ["a", "b"], "tags": [{"x": 1}]}, cols)))
    assert header == {"sample_ids": ["a", "b"], "tags": [{"x": 1}]}
    for name, col in cols.items():
        assert got[name].dtype == col.dtype
        assert torch.equal(got[name].offsets, col.offsets)
        assert torch.equal(got[name].values.view(torch.uint8) if col.values.numel() else got[name].values,
                           col.values.view(torch.uint8) if col.values.numel() else col.values)


def test_unpacked_columns_are_writable_views_of_the_body():
    body = bytearray(pack({}, {"x": Column.from_rows([torch.arange(3, dtype=torch.float32)])}))
    _, cols = unpack(body)
    cols["x"].values[0] = 7.0  # no read-only buffer, no copy
    assert unpack(body)[1]["x"].values[0] == 7.0


@pytest.mark.parametrize("body", [b"", b"JUNKJUNKJUNKJUNKJUNK", bytes(64)])
def test_foreign_bytes_raise_wire_format_error(body):
    with pytest.raises(WireFormatError):
        unpack(bytearray(body))


def test_truncated_body_names_the_column():
    body = pack({}, {"input_ids": Column.from_rows([torch.arange(100)])})
    with pytest.raises(WireFormatError, match="input_ids"):
        unpack(bytearray(body[:-400]))


def test_header_is_msgpack_not_pickle():
    body = pack({"sample_ids": ["a"]}, {})
    assert b"\x80\x04" not in body[:32]  # no pickle protocol marker
    head_len = int.from_bytes(body[8:16], "little")
    assert msgpack.unpackb(body[16 : 16 + head_len])["h"] == {"sample_ids": ["a"]}


@pytest.mark.parametrize(
    "head",
    [
        [1, 2],  # not a map
        {"h": [], "c": []},  # header not a map
        {"h": {}, "c": [["x", "int64", "many", 0, 8, 64, 16]]},  # non-int row count
        {"h": {}, "c": [["x", "int64", 1, -64, 8, 64, 16]]},  # negative offset
        {"h": {}, "c": [["x", "complex64", 1, 0, 8, 64, 16]]},  # dtype that cannot travel
        {"h": {}, "c": [["x", "int64", 1, 0, 8, 1 << 40, 16]]},  # buffer past the body
    ],
)
def test_malformed_headers_raise_wire_format_error_not_a_crash(head):
    import struct

    raw = msgpack.packb(head)
    body = struct.pack("<4sIQ", b"RLPL", 1, len(raw)) + raw
    body += bytes((-len(body)) % 64) + bytes(256)
    with pytest.raises(WireFormatError):
        unpack(bytearray(body))


def test_shared_rows_cross_once_and_come_back_named():
    img = torch.arange(6, dtype=torch.float32)
    col = Column(torch.cat([img, torch.ones(2)]), torch.tensor([0, 6, 6, 8, 8]), same=np.array([-1, 0, -1, 0]))
    body = pack({}, {"pixel_values": col})
    assert len(body) < 256 + 8 * 4 + (8 + 5 * 8)  # the image once: 8 floats of values, not 20
    _, got = unpack(bytearray(body))
    assert got["pixel_values"].same.tolist() == [-1, 0, -1, 0]
    assert torch.equal(got["pixel_values"].expanded().values, torch.cat([img, img, torch.ones(2), img]))


@pytest.mark.parametrize("same", [[-1, 1, -1], [-1, -1, 1], [-1, 0, 1], [-1, -2, -1], [-1, 0]])
def test_shared_rows_that_do_not_name_an_earlier_stored_row_are_refused(same):
    """A shared row must be stored empty and name an earlier row that holds its own bytes."""
    import struct

    from rlplane.wire import ints

    good = pack({}, {"x": Column(torch.arange(4.0), torch.tensor([0, 2, 2, 4]), same=np.array([-1, 0, -1]))})
    head_len = int.from_bytes(good[8:16], "little")
    head = msgpack.unpackb(good[16 : 16 + head_len])
    head["c"][0][-1] = ints(same)
    raw = msgpack.packb(head)
    body = bytearray(struct.pack("<4sIQ", b"RLPL", 1, len(raw)) + raw)
    body += bytes((-len(body)) % 64) + good[16 + head_len + ((-(16 + head_len)) % 64):]
    with pytest.raises(WireFormatError):
        unpack(body)


def test_an_envelope_header_of_many_empty_maps_is_refused_while_it_is_decoded():
    """8 MiB of empty maps decoded to ~600 MiB before the shape check refused it (a 2 GiB
    body: ~150 GB); past 1 MiB a header holds at most one list or map per 16 bytes."""
    from rlplane.envelope import MAGIC, VERSION, _PREFIX

    head = msgpack.packb({"h": {"tags": [{}] * (4 << 20)}, "c": []})
    body = _PREFIX.pack(MAGIC, VERSION, len(head)) + head
    assert len(head) > 4 << 20
    with pytest.raises(WireFormatError, match="lists and maps"):
        unpack(body)
    ok = msgpack.packb({"h": {"sample_ids": [f"s{i}" for i in range(200_000)],
                              "tags": [{"group": i, "x": [i]} for i in range(200_000)]}, "c": []})
    assert len(ok) > 1 << 20
    assert len(unpack(_PREFIX.pack(MAGIC, VERSION, len(ok)) + ok)[0]["tags"]) == 200_000  # real tags pass
