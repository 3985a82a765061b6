"""The wire codec: a pure function of (registry, value) — no I/O, no Ray, no sockets.

``encode`` turns user fields into :class:`~rlplane.column.Column` s (one 1-D buffer +
row offsets per field) and per-sample tags that record every row's true geometry under
the reserved key :data:`WIRE_TAG`. ``decode`` inverts it. What it guarantees:

- token fields are cut to each sample's length on write and padded back with the
  field's ``pad_value`` on read (``layout="padded"``), returned jagged, or packed (the
  samples' rows one after another);
- media fields are never cut or padded to the sequence length;
- ``wire_dtype`` casts floating payloads only; integer grids travel as written;
- object fields travel as msgpack (never pickle);
- every row's shape travels with it, so no backend can turn a ``(B,)`` field into
  ``(B, 1)`` or lose an image boundary;
- dispatch is closed: a value of a type the codec does not know raises ContainerError.

Example::

    enc = encode(registry, {"input_ids": ids, "pixel_values": pt}, lengths=[5, 9])
    out = decode(registry, enc.columns, enc.tags, layout="padded", pad_to_seqlen=16)
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

import msgpack
import numpy as np
import torch

from rlplane.column import Column, HeldRows, offsets_from_numels
from rlplane.dedup import row_keys, same_bytes, twins
from rlplane.errors import (
    ContainerError,
    DtypeError,
    InvalidArgumentError,
    ShapeError,
    WireFormatError,
)
from rlplane.fields import LENGTHS_FIELD, FieldSpec, Registry, check_dtype
from rlplane.geometry import MAX_LEAD, Geometry, is_packed_row, is_shape
from rlplane import parallel, rowkernels
from rlplane.integrity import check_rows, check_sums, range_sums, recorded, row_sums, shared_sums
from rlplane.packed import PackedTensor
from rlplane.readpool import ReadPool
from rlplane.scratch import Alloc
from rlplane.tags import RESERVED_TAG_PREFIX, WIRE_TAG, RowTags, merge_tags

#: ``held(field, keys) -> refs``: where the store keeps rows it holds already under
#: ``keys`` (see :class:`~rlplane.column.HeldRows`; block -1 for the rest).
HeldLookup = Callable[[str, np.ndarray], np.ndarray]

LAYOUTS = ("padded", "jagged", "packed")


class Encoded(NamedTuple):
    """What :func:`encode` returns: wire columns (with their rows' geometry and digests)
    and one tag dict per sample (:class:`~rlplane.tags.RowTags`, built when asked for)."""

    columns: dict[str, Column]
    tags: RowTags

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.columns.values())


# ---------------------------------------------------------------------------------------
# encode


class Prepared(NamedTuple):
    """What :func:`prepare` found: the batch size and each sample's length (int64, or
    None when no lengths were given)."""

    batch: int
    lengths: torch.Tensor | None


def prepare(
    registry: Registry,
    fields: Mapping[str, Any],
    lengths: Sequence[int] | torch.Tensor | None = None,
    *,
    sample_ids: Sequence[Any] | None = None,
) -> Prepared:
    """Validate ``fields`` against ``registry`` (the one check of a put: every field
    declared, of its container and dtype, one batch size; ``lengths`` integers >= 0, one
    per sample when a token field is present). Raises a typed error naming field and sample.

    Example::

        prep = prepare(default_registry(), {"input_ids": ids, "input_lengths": lens}, lens)
        prep.batch, prep.lengths
    """
    batch = registry.validate(fields)
    ids = list(sample_ids) if sample_ids is not None else None
    if ids is not None and fields and len(ids) != batch and any(v is not None for v in fields.values()):
        raise ShapeError(f"{len(ids)} sample ids for a batch of {batch} samples")
    return Prepared(batch, _lengths(lengths, batch, fields, registry, ids))


def encode(
    registry: Registry,
    fields: Mapping[str, Any],
    lengths: Sequence[int] | torch.Tensor | None = None,
    *,
    sample_ids: Sequence[Any] | None = None,
    alloc: Alloc | None = None,
    prepared: Prepared | None = None,
    share_rows: bool = False,
    held: HeldLookup | None = None,
    packed: frozenset[str] = frozenset(),
) -> Encoded:
    """Validate ``fields`` against ``registry`` and encode them for the wire.

    ``lengths`` (one per sample) is required when a token field is present. ``None``
    values and packed fields whose rows are all empty are not written. ``sample_ids``
    only name samples in errors. Columns may share memory with the inputs. ``alloc``
    supplies the buffers packed fields are copied into (:class:`rlplane.scratch.Scratch`).
    ``prepared``: what :func:`prepare` already found for these fields (not checked again).
    ``share_rows``: identical rows of a field that shares rows (:attr:`FieldSpec.shares_rows`,
    media by default) are stored once: its column says which rows repeat which
    (:mod:`rlplane.dedup`); only for a transport that stores such columns. ``held`` (with
    ``share_rows``): asked, per such field, which of its rows the store holds from earlier
    puts (``held(field, keys) -> refs``, see :class:`~rlplane.column.HeldRows`); those rows
    are not encoded at all. ``packed``: token fields given as their samples' rows one after
    another (``[sum(lengths), ...]``, what ``decode(layout="packed")`` gives), with
    ``prepared`` (:func:`prepare` checks padded and jagged values; packed ones are
    checked for their length and dtype here).

    Example::

        enc = encode(default_registry(), {"input_ids": ids, "input_lengths": lens}, lengths=lens)
        enc.columns["input_ids"].num_rows  # == len(lens)
    """
    ids = list(sample_ids) if sample_ids is not None else None
    batch, lens = prepared if prepared is not None else prepare(registry, fields, lengths, sample_ids=ids)
    geoms: dict[str, Geometry] = {}
    columns: dict[str, Column] = {}
    tokens = _TokenRows(lens) if lens is not None else None
    for name, value in fields.items():
        if value is None:
            continue
        spec = registry.get(name)
        if name in packed:
            out = _encode_token_rows(spec, value, tokens)
        elif share_rows and spec.shares_rows and spec.container == "packed":
            out = _encode_media_packed(spec, value, tokens, batch, ids, alloc, share=True, held=held)
        else:
            out = _ENCODERS[(spec.alignment, spec.container)](spec, value, tokens, batch, ids, alloc)
        if out is None:
            continue
        col, geoms[name] = out
        columns[name] = col if col.values.device.type == "cpu" else _to_host(col, name, alloc)
    digests = {name: col.sums if col.sums is not None else row_sums(col) for name, col in columns.items()}
    columns = {name: col.with_meta(digests[name], geoms[name]) for name, col in columns.items()}
    return Encoded(columns, RowTags(None, geoms, digests, batch))


def alloc_sizes(registry: Registry, fields: Mapping[str, Any], prepared: Prepared) -> dict[str, tuple[int, torch.dtype]]:
    """What :func:`encode` of ``fields`` will ask its ``alloc`` for, ``{field: (numel,
    dtype)}``, where that is known before encoding: the token fields whose rows it cuts on
    the host in pieces. A hint for the transport (e.g. to stage them all at once).

    Example::

        sizes = alloc_sizes(registry, fields, prepare(registry, fields, lengths))
    """
    lens = prepared.lengths
    if lens is None:
        return {}
    out = {}
    for name, value in fields.items():
        spec = registry.get(name)
        if (spec.alignment == "token" and spec.container == "dense" and isinstance(value, torch.Tensor)
                and not value.is_nested and value.dim() >= 2 and value.device.type == "cpu"
                and value.dtype in _NUMPY_OK and spec.stored_dtype(value.dtype) == value.dtype and _in_pieces(value)
                and bool((lens < value.shape[1]).any())):  # (else no row is cut: the tensor is stored as it is)
            out[name] = (int(lens.sum()) * math.prod(value.shape[2:]), value.dtype)
    return out


def _to_host(col: Column, name: str, alloc: Alloc | None) -> Column:
    """A column encoded on a GPU, copied to the host once: into the buffer ``alloc`` gives
    for it (the store's page-locked memory, when the transport stages the put there)."""
    if alloc is None:
        return col.to("cpu")
    host = alloc(name, col.values.numel(), col.values.dtype)
    host.copy_(col.values)
    return replace(col, values=host)


def _lengths(
    lengths: Sequence[int] | torch.Tensor | None,
    batch: int,
    fields: Mapping[str, Any],
    registry: Registry,
    ids: list[Any] | None,
) -> torch.Tensor | None:
    token = [n for n, v in fields.items() if v is not None and registry.get(n).alignment == "token"]
    if lengths is None:
        if token:
            raise ShapeError(
                "a token-aligned field needs each sample's length; pass lengths (input_lengths)",
                field=token[0],
            )
        return None
    if isinstance(lengths, torch.Tensor):
        lens = lengths.reshape(-1).cpu()
    else:
        values = list(lengths)
        lens = torch.tensor(values) if values else torch.empty(0, dtype=torch.int64)
    if lens.is_floating_point() or lens.dtype == torch.bool:
        raise ShapeError(f"lengths must be integers, got {lens.dtype}")
    lens = lens.to(torch.int64)
    if lens.numel() != batch and (token or batch):  # (they are stored, cut a token field or not; none: no batch)
        raise ShapeError(f"{lens.numel()} lengths for a batch of {batch} samples", field=token[0] if token else
                         LENGTHS_FIELD)
    if lens.numel() and int(lens.min()) < 0:
        i = int(torch.argmin(lens))
        raise ShapeError(f"negative length {int(lens[i])}", field=LENGTHS_FIELD, sample=_name(ids, i))
    return lens


def _name(ids: list[Any] | None, i: int) -> Any:
    return ids[i] if ids is not None and i < len(ids) else i


def _cast(spec: FieldSpec, t: torch.Tensor) -> torch.Tensor:
    target = spec.stored_dtype(t.dtype)
    return t if target == t.dtype else t.to(target)


def _encode_sample_dense(spec: FieldSpec, value: torch.Tensor, lens, batch: int, ids, alloc) -> tuple[Column, Geometry]:
    col = Column.uniform(_cast(spec, value), batch)
    return col, Geometry.uniform(value.shape[1:], batch)


class _TokenRows:
    """Each sample's length, and what every token field of one put derives from it (the
    longest, the [B, S] mask of real tokens, the rows' offsets), computed once per put."""

    __slots__ = ("lens", "_longest", "_masks", "_offsets")

    def __init__(self, lens: torch.Tensor) -> None:
        self.lens = lens
        self._longest: int | None = None
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def longest(self) -> int:
        if self._longest is None:
            self._longest = int(self.lens.max()) if self.lens.numel() else 0
        return self._longest

    def full(self, seq: int) -> bool:
        """Whether every sample fills a [B, seq] tensor (no row is cut)."""
        return not self.lens.numel() or bool((self.lens == seq).all())

    def mask(self, seq: int, device: torch.device) -> torch.Tensor:
        """Where a [B, seq] tensor holds real tokens (made once per seq and device; the
        compiled kernels need none: ~1 ms a field at B=4096, S=1024)."""
        key = (seq, str(device))
        if key not in self._masks:
            self._masks[key] = torch.arange(seq, device=device) < self.lens.to(device)[:, None]
        return self._masks[key]

    def offsets(self, inner: int) -> torch.Tensor:
        """Offsets of rows of ``lens * inner`` elements (shared: nothing writes into them)."""
        if inner not in self._offsets:
            self._offsets[inner] = offsets_from_numels(self.lens * inner)
        return self._offsets[inner]


def _encode_token_dense(
    spec: FieldSpec, value: torch.Tensor, tokens: _TokenRows, batch: int, ids, alloc
) -> tuple[Column, Geometry]:
    value = value.detach()  # (its bytes are stored, not its graph: numpy refuses a tensor that requires grad)
    lens = tokens.lens
    rest = list(value.shape[2:])
    if value.is_nested:
        offsets = value.offsets().to("cpu", torch.int64)
        holes = getattr(value, "_lengths", None)  # (a narrowed jagged tensor: rows with gaps between them)
        got = torch.diff(offsets) if holes is None else holes.to("cpu", torch.int64)
        bad = (got != lens).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ShapeError(
                f"jagged row has {int(got[i])} tokens but the sample's length is {int(lens[i])}",
                field=spec.name,
                sample=_name(ids, i),
            )
        if holes is not None:
            values = torch.cat(list(value.unbind()))
        else:
            values = value.values()[int(offsets[0]) : int(offsets[-1])]
        rest = list(values.shape[1:])
        values = _cast(spec, values).reshape(-1)
    else:
        seq = value.shape[1]
        if tokens.longest() > seq:
            i = int(torch.argmax((lens > seq).to(torch.int8)))
            raise ShapeError(
                f"length {int(lens[i])} exceeds the tensor's sequence dim {seq}",
                field=spec.name,
                sample=_name(ids, i),
            )
        full = tokens.full(seq)
        if full or spec.stored_dtype(value.dtype) != value.dtype:  # (a cast copies, and digests after)
            values = value if full else _masked_select(value, tokens)[0]
            return _token_column(_cast(spec, values).reshape(-1), rest, tokens)
        # Into the put's buffer (kept, or staged in the slab), digested on the way.
        values, sums = _masked_select(value, tokens, partial(alloc, spec.name) if alloc is not None else None)
        col, geom = _token_column(values.reshape(-1), rest, tokens)
        return (col if sums is None else col.with_meta(sums, None)), geom
    return _token_column(values, rest, tokens)


def _encode_token_rows(spec: FieldSpec, rows: torch.Tensor, tokens: _TokenRows | None) -> tuple[Column, Geometry]:
    """A token field given packed: its samples' rows one after another ``[sum(lengths), ...]``."""
    if spec.alignment != "token" or spec.container != "dense" or tokens is None:
        raise InvalidArgumentError("only a token field, with the samples' lengths, is given packed", field=spec.name)
    total = int(tokens.lens.sum())
    if not isinstance(rows, torch.Tensor) or rows.dim() < 1 or rows.shape[0] != total:
        got = list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ShapeError(f"packed rows {got} for samples of {total} tokens in all", field=spec.name)
    check_dtype(spec, rows.dtype)  # (what prepare checks of padded and jagged values)
    return _token_column(_cast(spec, rows).reshape(-1), list(rows.shape[1:]), tokens)


def _token_column(values: torch.Tensor, rest: list[int], tokens: _TokenRows) -> tuple[Column, Geometry]:
    """A token field's column: its values (flat, made contiguous) cut by the samples' lengths."""
    values = values if values.is_contiguous() else values.contiguous()
    return Column(values, tokens.offsets(math.prod(rest))), Geometry.token(tokens.lens.numpy().copy(), rest)


def _encode_media_packed(spec: FieldSpec, value: PackedTensor, lens, batch: int, ids, alloc, *,
                         share: bool = False, held: HeldLookup | None = None) -> tuple[Column, Geometry] | None:
    into = (lambda numel, dtype: alloc(spec.name, numel, dtype)) if alloc is not None else None
    d, p = value.dim_to_pack, value.pad_to_max_shape
    same = twins(value._rows) if share else None
    kept = _held_rows(spec, value, same, held) if same is not None and held is not None else None
    skip = same >= 0 if same is not None else None
    if kept is not None:
        skip = skip | (kept.refs[:, 0] >= 0)
    if skip is not None and bool(skip.any()):  # each repeated row is stored once, by its first sample
        shapes = value.shapes()
        stored = PackedTensor._from_rows([() if k else row for row, k in zip(value._rows, skip.tolist())], d, p)
        values, row_numels, _, sums = stored.flatten_with_sums(spec.wire_dtype, alloc=into)
        if values is None:  # every row held already: an empty column of the dtype they are stored as
            seg = value._rows[int(kept.rows[0])][0]  # type: ignore[union-attr]
            wire = spec.wire_dtype if spec.wire_dtype is not None and seg.is_floating_point() else seg.dtype
            values, row_numels = torch.empty(0, dtype=wire), [0] * len(value._rows)
    else:
        same = None
        values, row_numels, shapes, sums = value.flatten_with_sums(spec.wire_dtype, alloc=into)
    if values is None:
        return None  # every row empty: nothing to write
    if same is not None and not bool((same >= 0).any()):
        same = None
    col = Column(values, offsets_from_numels(row_numels), same=same, held=kept)
    if sums is not None:  # taken as each row was copied (else encode digests the column after)
        col = replace(col, sums=shared_sums(col, sums))
    return col, Geometry.of_rows([{"d": d, "p": p, "s": s} for s in shapes])


def _held_rows(spec: FieldSpec, value: PackedTensor, same: np.ndarray, held: HeldLookup) -> HeldRows | None:
    """Which rows of ``value`` the store holds from earlier puts (rlplane.dedup.row_keys):
    found by key, each confirmed on its every byte's digest; None when no row has a key.
    The keys go with the commit either way: later puts find these rows."""
    keys = row_keys(value._rows, same, spec.wire_dtype)
    if not bool(keys.any()):
        return None
    refs = np.array(held(spec.name, keys), np.int64).reshape(len(keys), 5)
    refs[same >= 0] = -1  # a twin follows its first row
    sums = refs[:, 4].view(np.uint64)
    for i in np.flatnonzero(refs[:, 0] >= 0).tolist():  # one cast per row found (rows stored anew pay none)
        row = PackedTensor._from_rows([value._rows[i]], value.dim_to_pack, value.pad_to_max_shape
                                      ).flatten(spec.wire_dtype)[0]
        if not sums[i] or row is None or not same_bytes(row, int(sums[i])):
            refs[i] = -1
    return HeldRows(keys, refs)


def _encode_sample_object(spec: FieldSpec, value: list[Any], lens, batch: int, ids, alloc) -> tuple[Column, Geometry]:
    blobs = []
    for i, item in enumerate(value):
        try:
            blobs.append(msgpack.packb(item, use_bin_type=True, strict_types=True, default=_reject))
        except (TypeError, ValueError, OverflowError) as err:
            raise ContainerError(
                f"value is not msgpack-able ({err}); object fields take str/int/float/bool/None/bytes/list/dict",
                field=spec.name,
                sample=_name(ids, i),
            ) from None
    numels = [len(b) for b in blobs]
    data = b"".join(blobs)
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return Column(values, offsets_from_numels(numels)), Geometry.token(np.array(numels, np.int64), [])


def _reject(obj: Any) -> Any:
    raise TypeError(f"{type(obj).__name__} is not a plain msgpack type")


_ENCODERS = {
    ("sample", "dense"): _encode_sample_dense,
    ("token", "dense"): _encode_token_dense,
    ("media", "packed"): _encode_media_packed,
    ("sample", "object"): _encode_sample_object,
}


# ---------------------------------------------------------------------------------------
# decode


def decode(
    registry: Registry,
    columns: Mapping[str, Column],
    tags: Sequence[Mapping[str, Any]],
    layout: str = "padded",
    pad_to_seqlen: int | None = None,
    *,
    sample_ids: Sequence[Any] | None = None,
    partition: str | None = None,
    verify: bool = True,
    device: torch.device | str | None = None,
    verified: Collection[str] = (),
    lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Turn wire columns back into fields: the exact inverse of :func:`encode`.

    First (``verify``) every row's bytes are checked against the digest its writer
    recorded (the column's, else the sample's tags): IntegrityError naming
    ``partition``, sample and field when they differ; ``verified``: fields whose rows the
    transport checked so as it copied them out of the store (not digested again). ``device``: where tensors land
    (default: where the columns are, the host): each field's checked bytes are copied
    there once, and padding, masks and packing are done there.

    Token fields come back ``[B, pad_to_seqlen, ...]`` padded with the field's
    ``pad_value`` (``pad_to_seqlen`` defaults to the longest sample); with
    ``layout="jagged"``, as a jagged NestedTensor; with ``layout="packed"``, as the
    samples' rows one after another, ``[sum(lengths), ...]`` (their lengths: the
    ``input_lengths`` field; what varlen attention takes, no padding, no nested tensor). Sample fields are ``[B, ...]``; packed
    fields PackedTensor; object fields lists. Dense results may share memory with the
    columns. ``sample_ids`` only name samples in errors. ``lengths``: the samples' lengths
    as the reader's meta names them (all 0: not known); a token row of another length is a
    ShapeError (the sample was extended since the meta was made).

    Example::

        fields = decode(registry, columns, meta.tags, layout="jagged")
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if pad_to_seqlen is not None and (not isinstance(pad_to_seqlen, int) or pad_to_seqlen < 0):
        raise InvalidArgumentError(f"pad_to_seqlen must be a non-negative int, got {pad_to_seqlen!r}")
    ids = list(sample_ids) if sample_ids is not None else None
    batch = len(tags)
    named = ids if ids is not None else [f"#{i}" for i in range(batch)]
    where = partition if partition is not None else "?"
    # Token fields padded here are checked as they are padded (each piece's rows digested
    # while in cache, before they are copied out); the rest first, here.
    padded_here = {name for name, col in columns.items() if verify and device is None and name not in verified
                   and _pads_on_host(registry.get(name), col, layout)}
    if verify:
        check_sums(where, named, {n: c for n, c in columns.items() if n not in padded_here and n not in verified},
                   tags)
    out: dict[str, Any] = {}
    leads: dict[str, np.ndarray | None] = {}
    masks = _Masks()  # the token fields of one read share their samples' lengths: one mask for all
    for name, col in columns.items():
        spec = registry.get(name)
        if col.num_rows != batch:
            raise WireFormatError(f"column has {col.num_rows} rows for {batch} samples", field=name)
        geoms = _geometries(spec, tags, ids, col.geom)
        if spec.alignment == "token":
            leads[name] = geoms.lead
            if lengths is not None and len(leads) == 1:
                _check_meta_lengths(name, geoms.lead, lengths, ids)
        if col.same is not None and spec.container != "packed":  # only packed rows come back as shared views
            col = col.expanded()
        if device is not None and spec.container != "object":
            col = col.to(device)
        kind = (spec.alignment, spec.container)
        if kind == ("token", "dense"):
            want = recorded(col, tags, name) if name in padded_here else None
            check = partial(check_rows, where, named, name, want=want) if want is not None and want.any() else None
            out[name] = _decode_token_dense(spec, col, geoms, layout, pad_to_seqlen, ids, masks, check)
        else:
            out[name] = _DECODERS[kind](spec, col, geoms, layout, pad_to_seqlen, ids)
    if leads and LENGTHS_FIELD in out:
        _check_lengths(leads, out[LENGTHS_FIELD], ids)
    return out


def _check_meta_lengths(name: str, got: np.ndarray | None, lengths: Sequence[int], ids: list[Any] | None) -> None:
    """ShapeError naming ``name`` and the first sample whose token rows (``got`` tokens each)
    are not as long as the reader's meta says (``lengths``, all 0 where it does not know):
    the sample was extended since the meta was made, and a read would hand out more
    tokens than the meta (a claim's token budget) said."""
    want = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if got is None or got.shape != want.shape or not want.any():
        return
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise ShapeError(f"the sample holds {int(got[i])} tokens where the meta read with says {int(want[i])} ("
                         f"{bad.size} samples differ): it was extended since the meta was made. Read with the meta "
                         "the extend returned (or claim again)", field=name, sample=_name(ids, i))


def _check_lengths(leads: Mapping[str, np.ndarray | None], lengths: Any, ids: list[Any] | None) -> None:
    """Every token row read holds its sample's ``input_lengths`` tokens, or ShapeError naming
    the field and the sample (rows stored apart, e.g. a partial rollout extended without one
    of its token fields, are never handed out as if they lined up)."""
    want = np.asarray(lengths.cpu().numpy() if isinstance(lengths, torch.Tensor) else lengths, dtype=np.int64).reshape(-1)
    for name, got in leads.items():
        if got is None or got.shape != want.shape:
            continue
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise ShapeError(f"row holds {int(got[i])} tokens but {LENGTHS_FIELD} says {int(want[i])} ({bad.size} "
                             "samples differ): its token fields were not written to the same length", field=name,
                             sample=_name(ids, i))


def check_columns(
    registry: Registry,
    columns: Mapping[str, Column],
    tags: Sequence[Mapping[str, Any]],
    *,
    sample_ids: Sequence[Any] | None = None,
) -> None:
    """Check encoded columns against ``registry`` before they are stored: what a service
    does with bytes that did not pass through this process's :func:`encode`.

    Every column must be a registered field, hold its stored dtype, match the geometry
    its tags record, and (when ``input_lengths`` travels along) cut token fields to each
    sample's length. Raises a typed error naming field and sample.

    Example::

        check_columns(registry, enc.columns, enc.tags, sample_ids=ids)
    """
    ids = list(sample_ids) if sample_ids is not None else None
    for name, col in columns.items():
        spec = registry.get(name)
        want = _stored_dtype(spec, col.dtype)
        if col.dtype != want:
            raise DtypeError(f"stored as {col.dtype} but the registry stores it as {want}", field=name)
        if col.same is not None and not (spec.shares_rows and spec.container == "packed"):  # (decode would copy them out)
            raise WireFormatError("names rows it shares (Column.same), but the registry stores each of this field's rows "
                                  "as its own", field=name)
    decode(registry, columns, tags, layout="packed", sample_ids=ids, verify=False)  # the reader checks the digests
    lengths = columns.get(LENGTHS_FIELD)
    if lengths is None:
        return
    lens = lengths.values.tolist()
    if len(lens) != len(tags):
        raise ShapeError(f"{len(lens)} lengths for {len(tags)} samples", field=LENGTHS_FIELD)
    want = np.asarray(lens, dtype=np.int64)
    for name, col in columns.items():
        spec = registry.get(name)
        if spec.alignment != "token":
            continue
        got = _geometries(spec, tags, ids, col.geom).lead
        bad = np.flatnonzero(got != want) if got is not None else np.arange(want.size)
        if bad.size:
            i = int(bad[0])
            raise ShapeError(f"row holds {int(got[i]) if got is not None else '?'} tokens but {LENGTHS_FIELD} says "
                             f"{lens[i]}", field=name, sample=_name(ids, i))


def _stored_dtype(spec: FieldSpec, dtype: torch.dtype) -> torch.dtype:
    if spec.container == "object":
        return torch.uint8
    if spec.dtype is not None:
        return spec.stored_dtype(spec.dtype)
    return spec.stored_dtype(dtype)


def _geometries(spec: FieldSpec, tags: Sequence[Mapping[str, Any]], ids: list[Any] | None,
                given: Geometry | None = None) -> Geometry:
    """Each sample's geometry of ``spec``'s field (``given``: the column's own, else from
    the tags), checked (WireFormatError naming the sample): dense rows (token, sample
    and object fields) as arrays, packed rows one object each."""
    if given is not None and given.dense:
        if spec.container != "packed" and _dense_ok(spec, given):
            return given
        rows = given.tolist()  # a geometry that does not fit the field: say which sample
    elif given is not None:
        rows = given.tolist()
    else:
        try:
            rows = [tag[WIRE_TAG][spec.name] for tag in tags]
        except (KeyError, TypeError, IndexError):
            rows = [_tag_geometry(t, spec.name) for t in tags]
    if spec.container == "packed":
        return Geometry.of_rows(_geometries_checked(spec, rows, ids))
    dense = _densify(spec, rows)
    if dense is not None:
        return dense
    return _dense_of_checked(spec, _geometries_checked(spec, rows, ids))  # something is off: sample by sample


def _dense_ok(spec: FieldSpec, g: Geometry) -> bool:
    """Whether dense rows have the form ``spec``'s encoder writes (a leading dim for token
    and object rows, and a one-dim object row)."""
    if spec.alignment == "token" or spec.container == "object":
        return g.lead is not None and (spec.container != "object" or all(len(t) == 0 for t in g.shapes))
    return g.lead is None


_MISSING = object()


def _tag_geometry(tag: Any, name: str) -> Any:
    try:
        return tag[WIRE_TAG][name]
    except (KeyError, TypeError, IndexError):
        return _MISSING


def _densify(spec: FieldSpec, rows: list[Any]) -> Geometry | None:
    """Shape lists of one rank (what encode writes for dense and object fields) as a dense
    Geometry, checked as one array instead of sample by sample; None if anything is off."""
    if not all(type(g) is list for g in rows):
        return None
    try:
        a = np.array(rows) if rows else np.zeros((0, 1), np.int64)
    except (ValueError, TypeError, OverflowError):  # ragged ranks or odd members: the careful path decides
        return None
    if a.ndim != 2 or (a.size and (a.dtype.kind not in "iu" or (a < 0).any() or int(a.max()) >= MAX_LEAD)):
        return None
    a = a.astype(np.int64, copy=False)
    leading = spec.alignment == "token" or spec.container == "object"
    if leading and a.shape[1] < 1 or spec.container == "object" and a.shape[1] != 1:
        return None
    geom = _from_matrix(a, leading, len(rows))
    top = [int(a[:, 0].max())] if leading and len(rows) else []
    if not all(is_shape([*top, *s]) for s in geom.shapes):  # (sizes past int64: the careful path names the row)
        return None
    return geom


def _from_matrix(a: np.ndarray, leading: bool, n: int) -> Geometry:
    rest = a[:, 1:] if leading else a
    table, kind = np.unique(rest, axis=0, return_inverse=True) if n else (np.zeros((1, rest.shape[1]), np.int64), None)
    shapes = [tuple(int(x) for x in row) for row in table]
    kinds = None if len(shapes) == 1 else np.asarray(kind, np.int32).reshape(-1)
    return Geometry(np.ascontiguousarray(a[:, 0]) if leading else None, shapes, kinds, n=n)


def _dense_of_checked(spec: FieldSpec, rows: list[Any]) -> Geometry:
    """Valid shape lists of ragged ranks (sample fields only; they cannot stack, which the
    decoder says naming the sample)."""
    leading = spec.alignment == "token" or spec.container == "object"
    shapes: dict[tuple[int, ...], int] = {}
    kind = np.empty(len(rows), np.int32)
    lead = np.empty(len(rows), np.int64)
    for i, g in enumerate(rows):
        key = tuple(g[1:] if leading else g)
        kind[i] = shapes.setdefault(key, len(shapes))
        lead[i] = g[0] if leading else 0
    return Geometry(lead if leading else None, list(shapes) or [()], kind if len(shapes) > 1 else None, n=len(rows))


def _geometries_checked(spec: FieldSpec, geoms: list[Any], ids: list[Any] | None) -> list[Any]:
    for i, g in enumerate(geoms):
        if g is _MISSING:
            raise WireFormatError(
                "the sample's tags carry no wire geometry for this field; it was not written by rlplane's codec",
                field=spec.name,
                sample=_name(ids, i),
            )
        if not _valid_geometry(spec, g):
            raise WireFormatError(f"malformed wire geometry {g!r}", field=spec.name, sample=_name(ids, i))
    return geoms


def _valid_geometry(spec: FieldSpec, g: Any) -> bool:
    """Geometry as encode writes it (foreign or corrupted tags must not crash decode)."""
    if spec.container == "packed":
        return is_packed_row(dict(g) if isinstance(g, Mapping) else g)
    if not is_shape(g):
        return False
    if spec.container == "object":
        return len(g) == 1
    return len(g) >= 1 if spec.alignment == "token" else True


def _check_numels(spec: FieldSpec, col: Column, want: np.ndarray | torch.Tensor, ids: list[Any] | None) -> None:
    offsets = col.offsets if col.offsets.device.type == "cpu" else col.offsets.cpu()
    got = np.diff(offsets.numpy())
    want = want.cpu().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.int64)
    if got.shape != want.shape:
        raise WireFormatError(f"{got.size} rows where the recorded shapes describe {want.size}", field=spec.name)
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise WireFormatError(
            f"row holds {int(got[i])} elements but its recorded shape needs {int(want[i])}",
            field=spec.name,
            sample=_name(ids, i),
        )


def _trailing(spec: FieldSpec, g: Geometry, ids: list[Any] | None, what: str) -> list[int]:
    """The one (trailing) shape all rows share; ShapeError naming the first that differs."""
    shape = g.trailing()
    if shape is None:
        i = g.first_other()
        first, other = g[0], g[i]
        if g.lead is not None:
            first, other = first[1:], other[1:]
        raise ShapeError(
            f"{what} {other} differs from sample {_name(ids, 0)!r}'s {first}; "
            "these samples were written with different shapes and cannot be stacked",
            field=spec.name,
            sample=_name(ids, i),
        )
    return list(shape)


def _decode_sample_dense(spec: FieldSpec, col: Column, geoms: Geometry, layout, pad, ids) -> torch.Tensor:
    if not len(geoms):
        return col.values.new_empty((0,))
    shape = _trailing(spec, geoms, ids, "shape")
    _check_numels(spec, col, np.full(len(geoms), math.prod(shape), np.int64), ids)
    return col.values.view(len(geoms), *shape)


class _Masks:
    """Per read: each distinct (lengths, width, device)'s ``[B, width]`` mask of real tokens,
    made once for the token fields that share it (~0.5 ms a field at B=256, S=4096)."""

    def __init__(self) -> None:
        self._made: list[tuple[np.ndarray, int, torch.device, torch.Tensor, torch.Tensor]] = []

    def lengths(self, lead: np.ndarray) -> torch.Tensor:
        for have, _, _, lens_t, _ in self._made:
            if np.array_equal(have, lead):
                return lens_t
        return torch.from_numpy(np.array(lead, np.int64))

    def mask(self, lens_t: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
        lead = lens_t.numpy()
        for have, w, d, _, mask in self._made:
            if w == width and d == device and np.array_equal(have, lead):
                return mask
        mask = torch.arange(width, device=device) < lens_t.to(device)[:, None]
        self._made.append((lead, width, device, lens_t, mask))
        return mask


def _pads_on_host(spec: FieldSpec, col: Column, layout: str) -> bool:
    """Whether decoding ``col`` pads its rows into host memory through numpy (where
    :func:`_padded` checks their digests as it goes)."""
    return (layout == "padded" and spec.alignment == "token" and spec.container == "dense" and col.same is None
            and col.values.device.type == "cpu" and col.dtype in _NUMPY_OK)


def _decode_token_dense(spec: FieldSpec, col: Column, geoms: Geometry, layout: str, pad: int | None, ids,
                        masks: _Masks | None = None, check: Callable[[np.ndarray], None] | None = None
                        ) -> torch.Tensor:
    """``check``: called with the rows' digests (padded on the host only; see _pads_on_host)."""
    batch = len(geoms)
    masks = masks if masks is not None else _Masks()
    rest = _trailing(spec, geoms, ids, "per-token shape") if batch else []
    lens_t = masks.lengths(geoms.lead) if batch else torch.zeros(0, dtype=torch.int64)
    inner = math.prod(rest)
    _check_numels(spec, col, lens_t * inner, ids)
    rows = col.values.view(-1, *rest)
    if layout == "packed":
        return rows
    if layout == "jagged":
        return torch.nested.nested_tensor_from_jagged(rows, offsets_from_numels(lens_t).to(rows.device))
    longest = int(lens_t.max()) if batch else 0
    width = longest if pad is None else pad
    if width < longest:
        i = int(torch.argmax(lens_t))
        raise ShapeError(
            f"pad_to_seqlen={width} is shorter than the sample's length {longest}; "
            "raise pad_to_seqlen (it must cover every sample of the step)",
            field=spec.name,
            sample=_name(ids, i),
        )
    padding = batch and int(lens_t.min()) < width
    return _padded(rows, lens_t, partial(masks.mask, lens_t, width, rows.device), (batch, width, *rest),
                   _pad_of(spec, rows.dtype) if padding else spec.pad_value, check)


def _pad_of(spec: FieldSpec, dtype: torch.dtype) -> Any:
    """``spec.pad_value``, DtypeError naming the field unless rows of ``dtype`` hold it (a
    pad of -1 in a bool field became True: padding counted in the loss; -100 in uint8
    rows 156); a float pad may round, not overflow to infinity."""
    pad = spec.pad_value
    if dtype == torch.bool:
        fits = pad in (0, 1)
    elif dtype.is_floating_point or dtype.is_complex:
        held = float(torch.tensor(float(pad), dtype=torch.float64).to(dtype))
        fits = not math.isfinite(float(pad)) or math.isfinite(held)
    else:
        info = torch.iinfo(dtype)
        fits = float(pad).is_integer() and info.min <= pad <= info.max
    if not fits:
        raise DtypeError(f"pad_value {pad!r} cannot be held by its rows' {str(dtype).removeprefix('torch.')}: padded "
                         "rows would carry another value; read it jagged or packed, or declare a pad_value that fits",
                         field=spec.name)
    return pad


def _as_numpy(t: torch.Tensor) -> Any:
    """A CPU tensor as a numpy view (bfloat16 as its 16-bit pattern)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _masked_select(value: torch.Tensor, tokens: _TokenRows,
                   into: Callable[[int, torch.dtype], torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, np.ndarray | None]:
    """Each sample's first ``tokens.lens`` tokens of a [B, S, ...] tensor, one after
    another (``value[mask]``, the mask of :meth:`_TokenRows.mask`); and each sample's row digest
    (:func:`~rlplane.integrity.range_sums`; None where it is not computed here). On CPU,
    written straight into ``into(numel, dtype)`` (the put's kept or staged buffer: no fresh
    pages, no copy after): by the compiled row kernels (:mod:`rlplane.rowkernels`: a memcpy
    and a digest per row, samples split over a few threads), else through numpy (~10x
    faster than torch) a few MB at a time, each piece digested while it is in cache."""
    if value.device.type != "cpu" or value.dtype not in _NUMPY_OK:
        return value[tokens.mask(value.shape[1], value.device)], None
    rest = value.shape[2:]
    starts = tokens.offsets(1).numpy()
    total = int(starts[-1])
    src = _as_numpy(value)
    bounds = starts * (math.prod(rest) * value.element_size())
    if not _in_pieces(value):  # one step, here: pieces and threads cost more than they save
        picked = src[tokens.mask(value.shape[1], value.device).numpy()]
        return (torch.from_numpy(picked).view(value.dtype),
                range_sums(memoryview(picked.reshape(-1).view(np.uint8)), bounds))
    out = into(total * math.prod(rest), value.dtype) if into is not None else \
        torch.empty(total * math.prod(rest), dtype=value.dtype)
    if rowkernels.ready() and value.is_contiguous() and out.is_contiguous():  # a memcpy and a digest a row, compiled
        row = value[0].numel() * value.element_size() if value.shape[0] else 0
        sums = rowkernels.copy_rows(_as_numpy(out).view(np.uint8), bounds[:-1], _as_numpy(value).reshape(-1).view(np.uint8),
                                    np.arange(value.shape[0], dtype=np.int64) * row, np.diff(bounds))
        return out.view(total, *rest), sums
    dst, where = _as_numpy(out).reshape(total, *rest), tokens.mask(value.shape[1], value.device).numpy()
    raw = memoryview(_as_numpy(out).view(np.uint8))
    sums = np.empty(value.shape[0], np.uint64)

    def step(x: int, y: int) -> None:  # digested while in cache
        dst[starts[x]:starts[y]] = src[x:y][where[x:y]]
        sums[x:y] = range_sums(raw, bounds[x:y + 1])

    _in_steps(value.shape[0], value[0].numel() * value.element_size() if value.shape[0] else 0, step)
    return out.view(total, *rest), sums


def _in_pieces(value: torch.Tensor) -> bool:
    """Whether a masked select of ``value`` (on the host) runs into the buffer it is given,
    by the compiled row kernels (:mod:`rlplane.rowkernels`) or in pieces (else in one numpy
    step, into memory of its own)."""
    return _big(value.numel() * value.element_size())


def _big(nbytes: int) -> bool:
    """Whether token rows of ``nbytes`` are cut or padded by the kernels or in numpy pieces
    (else in one numpy step). Small work never loads the kernels."""
    return nbytes >= _PIECE_BYTES or (nbytes >= _KERNEL_BYTES and rowkernels.ready())


def _in_steps(batch: int, per_sample: int, step: Callable[[int, int], None]) -> None:
    """``step(x, y)`` over samples ``[0, batch)`` in runs of about :data:`_PIECE_BYTES`
    (``per_sample`` bytes each), the samples split over a few threads (:mod:`rlplane.parallel`)."""
    every = max(1, _PIECE_BYTES // max(per_sample, 1))

    def piece(a: int, z: int) -> None:
        for x in range(a, z, every):
            step(x, min(z, x + every))

    parallel.run(piece, parallel.spans(np.arange(batch + 1, dtype=np.int64) * per_sample, parallel.workers()))


#: Bytes a masked select reads, or a padding writes, per step (numpy boolean indexing; 2-4 MB ran
#: fastest), so the rows a step digests are still in cache.
_PIECE_BYTES = 4 << 20
#: Bytes of a token field from which the compiled kernels cut or pad its rows (below, one
#: numpy step costs less than the call; and a process with only small work never loads them).
_KERNEL_BYTES = 256 << 10


def _padded(rows: torch.Tensor, lens: torch.Tensor, mask: Callable[[], torch.Tensor], shape: tuple[int, ...],
            pad: int | float | bool, check: Callable[[np.ndarray], None] | None = None) -> torch.Tensor:
    """A ``shape`` ([B, S, ...]) tensor of ``pad`` with each sample's ``lens`` rows of
    ``rows`` (packed) at its start, where the [B, S] ``mask()`` holds (made only where a
    path needs it: the compiled kernels do not). On the host, in a
    buffer of the process's :class:`~rlplane.readpool.ReadPool` (pages faulted in by an
    earlier read: fresh ones cost ~3x the fill and copy on this VM): by the compiled row
    kernels (:mod:`rlplane.rowkernels`), else a few MB at a time through numpy (~5x faster
    than torch's masked copy), samples split over a few threads; ``check`` called with
    every sample's digest. Elsewhere by torch (``check`` not called)."""
    if rows.device.type != "cpu" or rows.dtype not in _NUMPY_OK:
        out = torch.full(shape, pad, dtype=rows.dtype, device=rows.device)
        if rows.numel():
            out[mask()] = rows
        return out
    batch, inner = shape[0], math.prod(shape[2:])
    nbytes = math.prod(shape) * rows.element_size()
    src = _as_numpy(rows)
    starts = np.concatenate([[0], np.cumsum(lens.numpy())])
    raw = memoryview(src.reshape(-1).view(np.uint8))
    bounds = starts * (inner * rows.element_size())
    if not _big(nbytes):  # one step, here: a pool, pieces and threads cost more than they save
        if check is not None:
            check(range_sums(raw, bounds))
        out = torch.full(shape, pad, dtype=rows.dtype)
        _as_numpy(out)[mask().numpy()] = src
        return out
    out = torch.from_numpy(ReadPool.shared().take(nbytes)).view(rows.dtype).view(shape)
    dst = _as_numpy(out)
    if rowkernels.ready():  # each row one memcpy of its tokens, one of the padding and a digest, compiled
        row = nbytes // batch if batch else 0
        fill = _as_numpy(torch.full((row // rows.element_size(),), pad, dtype=rows.dtype)).view(np.uint8)
        sums = rowkernels.pad_rows(dst.reshape(-1).view(np.uint8), row, np.frombuffer(raw, np.uint8), bounds[:-1],
                                   np.diff(bounds), fill, digest=check is not None)
        if check is not None:
            check(sums)
        return out
    fill, where = _as_numpy(torch.tensor(pad, dtype=rows.dtype).reshape(())), mask().numpy()
    sums = np.zeros(batch, np.uint64)

    def step(x: int, y: int) -> None:
        if check is not None:
            sums[x:y] = range_sums(raw, bounds[x:y + 1])
        dst[x:y] = fill
        dst[x:y][where[x:y]] = src[starts[x]:starts[y]]

    _in_steps(batch, nbytes // batch if batch else 0, step)
    if check is not None:
        check(sums)
    return out


_NUMPY_OK = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.bfloat16, torch.float32, torch.float64}


def _decode_media_packed(spec: FieldSpec, col: Column, geometry: Geometry, layout, pad, ids) -> PackedTensor:
    geoms = geometry.tolist()
    if not geoms:
        return PackedTensor([])
    try:
        packing = {(g["d"], g["p"]) for g in geoms}
        shapes = [g["s"] for g in geoms]
    except (KeyError, TypeError):
        raise WireFormatError("packed geometry must be {'d', 'p', 's'}", field=spec.name) from None
    if len(packing) > 1:
        raise ShapeError(
            f"samples were written with different (dim_to_pack, pad_to_max_shape) {sorted(packing)}",
            field=spec.name,
        )
    d, p = packing.pop()
    if col.same is None:
        return PackedTensor._from_flat(col.values, col.row_numels().tolist(), shapes, d, p, field=spec.name)
    # Rows stored once for several samples: each sample's segments are views of the one copy.
    own = np.flatnonzero(col.same < 0)
    numels = col.row_numels().numpy()
    stored = PackedTensor._from_flat(col.values, numels[own].tolist(), [shapes[i] for i in own.tolist()], d, p,
                                     field=spec.name)._rows
    rank = np.cumsum(col.same < 0) - 1  # a row's place among the stored ones
    src = np.where(col.same >= 0, col.same, np.arange(col.same.size))
    rows = [stored[k] for k in rank[src].tolist()]
    for i, j in zip(np.flatnonzero(col.same >= 0).tolist(), col.same[col.same >= 0].tolist()):
        if shapes[i] != shapes[j]:
            raise WireFormatError(f"a row shared with sample {_name(ids, j)} has other segment "
                                  f"shapes than it was written with", field=spec.name, sample=_name(ids, i))
    return PackedTensor._from_rows(rows, d, p)


def _decode_sample_object(spec: FieldSpec, col: Column, geoms: Geometry, layout, pad, ids) -> list[Any]:
    _check_numels(spec, col, geoms.lead if geoms.lead is not None else np.zeros(len(geoms), np.int64), ids)
    if col.dtype != torch.uint8:
        raise WireFormatError(f"object column must be uint8 bytes, got {col.dtype}", field=spec.name)
    data = col.values.cpu().numpy().tobytes()
    offsets = col.offsets.tolist()
    out = []
    for i in range(len(geoms)):
        try:
            out.append(msgpack.unpackb(data[offsets[i] : offsets[i + 1]], raw=False, strict_map_key=False))
        except (ValueError, msgpack.UnpackException) as err:
            raise WireFormatError(f"object row is not valid msgpack ({err})", field=spec.name, sample=_name(ids, i)) from None
    return out


_DECODERS = {
    ("sample", "dense"): _decode_sample_dense,
    ("token", "dense"): _decode_token_dense,
    ("media", "packed"): _decode_media_packed,
    ("sample", "object"): _decode_sample_object,
}

__all__ = ["WIRE_TAG", "RESERVED_TAG_PREFIX", "LAYOUTS", "Encoded", "Prepared", "prepare", "encode", "decode", "alloc_sizes",
           "check_columns", "merge_tags"]
