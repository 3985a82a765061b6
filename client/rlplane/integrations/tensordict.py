"""TensorDict in and out: put a ``tensordict.TensorDict`` as samples, read samples back as one.

Install with ``pip install 'rlplane[tensordict]'`` (the ``tensordict`` package from PyPI).

A TensorDict of ``batch_size [B]`` is B samples. Its keys are field names (nested keys are
joined with ``"."``), each checked against the registry like any put: an undeclared key
is an ``UnregisteredFieldError`` and nothing is stored.

What :func:`put_tensordict` takes, per kind of field:

* sample fields: tensors ``[B, ...]``;
* token fields: tensors padded to ``[B, S, ...]``, or jagged nested tensors
  (``layout=torch.jagged``); without ``input_lengths`` the lengths are taken from the
  jagged ones;
* media fields: a ``NonTensorStack`` with one entry per sample (a Tensor, a list of
  Tensors, or None: what a :class:`~rlplane.packed.PackedTensor` row holds), or a jagged
  nested tensor (one segment per sample, ragged along its first dim);
* object fields: a ``NonTensorStack`` with one value per sample.

What :func:`read_tensordict` gives back: token fields padded (``tokens="padded"``) or
jagged (``tokens="jagged"``); media fields as per-sample rows in a ``NonTensorStack``
(``media="packed"``: every segment as it was written) or as a jagged nested tensor
(``media="nested"``: a sample's segments concatenated along their first dim, so their
boundaries live only in the fields that describe them, e.g. ``image_grid_thw``; an
empty sample is a row of length 0); object fields as a ``NonTensorStack``.

Media travel as per-sample rows and never as one ``NonTensorData`` holding a whole
PackedTensor: TensorDict hands that one object to every index, so ``td[:2]`` would carry
all B samples' images, the silent misalignment rlplane exists to refuse.

Example::

    from rlplane.integrations.tensordict import put_tensordict, read_tensordict

    meta = put_tensordict(client, "step-0", td)
    batch = read_tensordict(client, meta, stage="train", tokens="jagged")
    batch["input_ids"].is_nested   # True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import torch

from rlplane.errors import ContainerError, InvalidArgumentError, ShapeError
from rlplane.fields import LENGTHS_FIELD
from rlplane.packed import PackedTensor

if TYPE_CHECKING:
    from tensordict import TensorDict

    from rlplane.client import Client
    from rlplane.meta import SampleMeta

#: The separator nested TensorDict keys are joined with into field names.
SEP = "."
TOKENS = ("padded", "jagged")
MEDIA = ("packed", "nested")


def put_tensordict(
    client: Client,
    partition: str,
    td: TensorDict,
    *,
    sample_ids: Sequence[str] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
    dim_to_pack: Mapping[str, int] | None = None,
) -> SampleMeta:
    """Store the B samples of ``td`` (``batch_size [B]``) in ``partition``; returns their meta.

    ``dim_to_pack``: per media field, the dim its segments pack along (default 0), as
    :class:`~rlplane.packed.PackedTensor` takes it. Raises what ``put_samples`` raises
    (naming field and sample), or ``ShapeError`` / ``ContainerError`` for a TensorDict
    that is not one row per sample; nothing is stored then.

    Example::

        td = TensorDict({"input_ids": ids, "input_lengths": lens}, batch_size=[len(lens)])
        meta = put_tensordict(client, "step-0", td)
    """
    td = _flat(td)
    batch = _batch(td)
    fields: dict[str, Any] = {}
    for name in td.keys():
        spec = client.registry.get(name)  # an undeclared key fails here, before any byte moves
        value = _entry(td, name)
        if spec.container == "packed":
            fields[name] = _packed_in(name, value, batch, (dim_to_pack or {}).get(name, 0))
        elif spec.container == "object":
            fields[name] = _objects_in(name, value, batch)
        else:
            fields[name] = value
    if LENGTHS_FIELD not in fields:
        jagged = [(n, v) for n, v in fields.items() if isinstance(v, torch.Tensor) and v.is_nested
                  and client.registry.get(n).alignment == "token"]
        if jagged:
            name, first = jagged[0]
            _jagged_layout(first, name)
            holes = getattr(first, "_lengths", None)  # (a narrowed jagged tensor: its rows' own lengths)
            fields[LENGTHS_FIELD] = torch.diff(first.offsets().to("cpu", torch.int64)) if holes is None else \
                holes.to("cpu", torch.int64)
    return client.put_samples(partition, fields, sample_ids=sample_ids, tags=tags)


def read_tensordict(
    client: Client,
    meta: SampleMeta,
    fields: Sequence[str] | None = None,
    *,
    stage: str | None = None,
    tokens: Literal["padded", "jagged"] = "padded",
    media: Literal["packed", "nested"] = "packed",
    pad_to_seqlen: int | None = None,
    device: Any = None,
) -> TensorDict:
    """The samples of ``meta`` as a TensorDict of ``batch_size [len(meta)]``: the named
    ``fields`` or a ``stage``'s (see the module docstring for what each kind becomes).
    Field names with ``"."`` become nested keys (flat where one is another's prefix,
    e.g. "reward" beside "reward.score"); ``device`` is ``read_columns``'s (e.g.
    ``"cuda"``). Raises what ``read_columns`` raises.

    Example::

        batch = read_tensordict(client, shard, stage="logprob", media="nested")
    """
    if tokens not in TOKENS:
        raise InvalidArgumentError(f"tokens must be one of {TOKENS}, got {tokens!r}")
    if media not in MEDIA:
        raise InvalidArgumentError(f"media must be one of {MEDIA}, got {media!r}")
    TensorDict, NonTensorStack, _ = _tensordict()
    got = client.read_columns(meta, fields, stage=stage, layout=tokens, pad_to_seqlen=pad_to_seqlen, device=device)
    out: dict[str, Any] = {}
    for name, value in got.items():
        spec = client.registry.get(name)
        if spec.container == "packed":
            out[name] = _nested_out(name, value) if media == "nested" else _stack(NonTensorStack, value.rows)
        elif spec.container == "object":
            out[name] = _stack(NonTensorStack, value)
        else:
            out[name] = value
    td = TensorDict(out, batch_size=[len(meta)])
    return td.unflatten_keys(SEP) if any(SEP in k for k in out) and not _prefix_is_a_key(out) else td


# -- implementation ------------------------------------------------------------------
def _tensordict() -> tuple[Any, Any, Any]:
    try:
        from tensordict import NonTensorData, NonTensorStack, TensorDict
    except ImportError:
        raise InvalidArgumentError("rlplane.integrations.tensordict needs the tensordict package: "
                                   "pip install 'rlplane[tensordict]'") from None
    return TensorDict, NonTensorStack, NonTensorData


def _flat(td: Any) -> Any:
    TensorDict, _, _ = _tensordict()
    from tensordict import TensorDictBase

    if not isinstance(td, TensorDictBase):
        raise ContainerError(f"put_tensordict takes a tensordict.TensorDict, not {type(td).__name__}")
    try:
        return td.flatten_keys(SEP)
    except KeyError as err:  # {"a": {"b": x}} beside "a.b": one field name for two entries
        raise ShapeError(f"the TensorDict names one field twice, nested and flat ({err.args[0] if err.args else err}); "
                         f"a nested key is the field of its path joined by {SEP!r}") from None


def _prefix_is_a_key(out: Mapping[str, Any]) -> bool:
    """Whether a field's name with ``SEP`` starts with another field's name: nesting the
    keys would put one inside the other (both "reward" and "reward.score"), so they stay flat."""
    return any(SEP.join(k.split(SEP)[:i]) in out for k in out if SEP in k for i in range(1, k.count(SEP) + 1))


def _entry(td: Any, name: str) -> Any:
    """``td``'s entry ``name``; of a lazy stack of per-sample TensorDicts whose entries differ
    in length (rollouts of their own lengths), a jagged nested tensor of them."""
    try:
        return td.get(name)
    except RuntimeError as err:  # (its entries do not stack densely)
        from tensordict import LazyStackedTensorDict

        if isinstance(td, LazyStackedTensorDict):
            try:
                return td.get(name, as_nested_tensor=True, layout=torch.jagged)
            except (RuntimeError, ValueError, TypeError) as why:
                err = why
        raise ShapeError(f"its per-sample entries do not stack, not even as a jagged tensor ({err})",
                         field=name) from None


def _jagged_layout(value: torch.Tensor, name: str) -> None:
    """ContainerError naming ``name`` unless nested tensor ``value`` has the jagged layout."""
    if value.layout is not torch.jagged:
        raise ContainerError(f"a nested tensor of layout {value.layout}: rlplane takes nested tensors of layout "
                             "torch.jagged (torch.nested.nested_tensor(rows, layout=torch.jagged))", field=name)


def _batch(td: Any) -> int:
    if len(td.batch_size) != 1:
        raise ShapeError(f"a TensorDict of samples has batch_size [B] (one row per sample), got {list(td.batch_size)}")
    return int(td.batch_size[0])


def _per_sample(name: str, value: Any, batch: int) -> list[Any]:
    """The entries of a NonTensorStack, one per sample (ContainerError for anything else)."""
    from tensordict import NonTensorData, NonTensorStack

    if isinstance(value, NonTensorStack):
        rows = value.tolist()
    elif isinstance(value, NonTensorData):
        raise ContainerError("is one NonTensorData for the whole batch, which TensorDict gives to every index; "
                             "give one entry per sample (NonTensorStack)", field=name)
    elif isinstance(value, list):  # what TensorDict.get returns for a stack of non-tensors
        rows = value
    else:
        raise ContainerError(f"needs one entry per sample (a NonTensorStack), got {type(value).__name__}", field=name)
    if len(rows) != batch:
        raise ShapeError(f"{len(rows)} entries for a batch of {batch} samples", field=name)
    return rows


def _packed_in(name: str, value: Any, batch: int, dim: int) -> PackedTensor:
    if isinstance(value, torch.Tensor):
        if not value.is_nested:
            raise ContainerError("a media field is a NonTensorStack of per-sample rows or a jagged nested tensor, "
                                 f"not a dense tensor of shape {list(value.shape)}", field=name)
        _jagged_layout(value, name)
        offsets = value.offsets().to("cpu", torch.int64)
        lens = torch.diff(offsets).tolist()
        if getattr(value, "_lengths", None) is not None:  # a nested tensor with holes: its rows one by one
            segs = list(value.unbind())
        else:  # views of the nested tensor's one buffer, cut per sample
            segs = list(value.values()[int(offsets[0]) : int(offsets[-1])].split(lens))
        return PackedTensor([s if n else None for s, n in zip(segs, lens)], dim_to_pack=dim)
    return PackedTensor(_per_sample(name, value, batch), dim_to_pack=dim)


def _objects_in(name: str, value: Any, batch: int) -> list[Any]:
    return _per_sample(name, value, batch)


def _stack(NonTensorStack: Any, rows: Sequence[Any]) -> Any:
    from tensordict import NonTensorData

    return NonTensorStack(*[NonTensorData(r) for r in rows])


def _nested_out(name: str, packed: PackedTensor) -> torch.Tensor:
    """A sample's segments concatenated along dim 0, as one jagged nested tensor."""
    rows = packed.rows
    segs = [s for row in rows if row for s in row]
    if not segs:
        raise ShapeError("has no rows to make a nested tensor of", field=name)
    if packed.dim_to_pack != 0 or len({tuple(s.shape[1:]) for s in segs}) > 1:
        raise ShapeError("its segments differ in more than their first dim (or pack along another), so they do "
                         "not make one jagged nested tensor; read it with media='packed'", field=name)
    tail = list(segs[0].shape[1:])
    lens = torch.tensor([sum(int(s.shape[0]) for s in row) if row else 0 for row in rows], dtype=torch.int64)
    values = torch.cat(segs) if len(segs) > 1 else segs[0].reshape(-1, *tail)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


__all__ = ["put_tensordict", "read_tensordict"]
