"""Bit-exact comparison of what a writer gave and what a reader got back.

The demo, the benchmarks and the tests use it to prove every declared field survived
the trip: same dtype (the field's stored dtype), same shape, same bits, and nothing but
``pad_value`` beyond each sample's length.

Example::

    problems = diff_fields(registry, written, read_back, lengths)
    assert not problems, problems
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from rlplane.fields import FieldSpec, Registry
from rlplane.packed import PackedTensor

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have one dtype, one shape and identical bytes (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = _INT_VIEW[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def diff_fields(
    registry: Registry,
    written: Mapping[str, Any],
    read: Mapping[str, Any],
    lengths: Sequence[int] | torch.Tensor | None = None,
    *,
    sample_ids: Sequence[Any] | None = None,
    limit: int = 10,
) -> list[str]:
    """Every difference between ``written`` (as given to put) and ``read`` (as decoded).

    Returns human-readable lines naming field and sample; empty when all is bit-exact.
    Written floating payloads are compared after the field's ``wire_dtype`` cast.
    """
    lens = None if lengths is None else [int(x) for x in torch.as_tensor(lengths).reshape(-1).tolist()]
    out: list[str] = []
    for name, value in written.items():
        if value is None:
            continue
        spec = registry.get(name)
        if name not in read:
            if spec.container == "packed" and value.is_empty():
                continue
            out.append(f"field {name!r}: written but not read back")
            continue
        out.extend(_diff(spec, value, read[name], lens, sample_ids))
        if len(out) >= limit:
            break
    return out[:limit]


def _who(ids: Sequence[Any] | None, i: int) -> str:
    return repr(ids[i]) if ids is not None else str(i)


def _diff(spec: FieldSpec, want: Any, got: Any, lens: list[int] | None, ids) -> list[str]:
    name = spec.name
    if spec.container == "object":
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
        if len(want) != len(got):
            return [f"field {name!r}: {len(got)} values read for {len(want)} written"]
        return [f"field {name!r}, sample {_who(ids, i)}: {got[i]!r} != written {want[i]!r}" for i in bad[:3]]
    if spec.container == "packed":
        return _diff_packed(spec, want, got, ids)
    if not isinstance(got, torch.Tensor):
        return [f"field {name!r}: read back a {type(got).__name__}, not a tensor"]
    want = want.to(spec.stored_dtype(want.dtype))
    if spec.alignment == "sample":
        if not same_bits(want, got):
            return [f"field {name!r}: differs (written {list(want.shape)} {want.dtype}, read {list(got.shape)} {got.dtype})"]
        return []
    return _diff_token(spec, want, got, lens, ids)


def _diff_token(spec: FieldSpec, want: torch.Tensor, got: torch.Tensor, lens: list[int] | None, ids) -> list[str]:
    name = spec.name
    want_rows = list(want.unbind()) if want.is_nested else [want[i, : lens[i]] for i in range(want.shape[0])]
    if got.is_nested:
        got_rows = list(got.unbind())
        tails: list[torch.Tensor] = []
    elif got.dim() < 1 or got.shape[0] != len(want_rows):  # (rows past the written ones were not looked at)
        return [f"field {name!r}: {got.shape[0] if got.dim() else 0} rows read for {len(want_rows)} written"]
    else:
        got_rows = [got[i, : len(w)] for i, w in enumerate(want_rows)]
        tails = [got[i, len(w) :] for i, w in enumerate(want_rows)]
    if len(got_rows) != len(want_rows):
        return [f"field {name!r}: {len(got_rows)} rows read for {len(want_rows)} written"]
    out = []
    for i, (w, g) in enumerate(zip(want_rows, got_rows)):
        if not same_bits(w, g):
            out.append(f"field {name!r}, sample {_who(ids, i)}: tokens differ ({list(w.shape)} vs {list(g.shape)})")
        elif tails and tails[i].numel() and not bool((tails[i] == spec.pad_value).all()):
            out.append(f"field {name!r}, sample {_who(ids, i)}: padding is not pad_value {spec.pad_value}")
        if len(out) >= 3:
            break
    return out


def _diff_packed(spec: FieldSpec, want: PackedTensor, got: Any, ids) -> list[str]:
    name = spec.name
    if not isinstance(got, PackedTensor):
        return [f"field {name!r}: read back a {type(got).__name__}, not a PackedTensor"]
    if len(got) != len(want):
        return [f"field {name!r}: {len(got)} rows read for {len(want)} written"]
    if (got.dim_to_pack, got.pad_to_max_shape) != (want.dim_to_pack, want.pad_to_max_shape):
        return [f"field {name!r}: packing changed to dim_to_pack={got.dim_to_pack}, pad={got.pad_to_max_shape}"]
    stored = want.dtype and spec.stored_dtype(want.dtype)
    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = w or [], g or []
        if len(w) != len(g):
            out.append(f"field {name!r}, sample {_who(ids, i)}: {len(g)} segments read for {len(w)} written")
        elif not all(same_bits(a.to(stored), b) for a, b in zip(w, g)):
            out.append(f"field {name!r}, sample {_who(ids, i)}: segment bits or shapes differ")
        if len(out) >= 3:
            break
    return out
