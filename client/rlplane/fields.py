"""The field registry: every field that may cross rlplane is declared here.

A :class:`FieldSpec` says how a field is shaped (``alignment``), what Python value holds
it (``container``), who reads it (``stages``) and how it travels (``dtype``,
``wire_dtype``, ``pad_value``). A :class:`Registry` holds the specs of one deployment
and answers "which fields does stage X read?".

Example::

    reg = default_registry()
    reg.fields_for_stage("train", present={"pixel_values", "image_grid_thw"})
    reg.register(FieldSpec("rewards", "sample", "dense", {"advantage"}, dtype="float32"))
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Mapping

import torch

from rlplane.dtypes import dtype_from_name, dtype_name
from rlplane.errors import (
    ContainerError,
    DtypeError,
    RegistryError,
    ShapeError,
    UnknownStageError,
    UnregisteredFieldError,
)
from rlplane.packed import PackedTensor

Alignment = Literal["sample", "token", "media"]
Container = Literal["dense", "packed", "object"]

#: The (alignment, container) pairs a field may declare.
LEGAL_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("sample", "dense"), ("sample", "object"), ("token", "dense"), ("media", "packed")}
)

#: Stages that run a forward pass of the policy or reference model. A multimodal
#: (media) field read by one of them must be read by all of them: otherwise one pass
#: sees the images and another trains image-blind.
MODEL_STAGES: frozenset[str] = frozenset({"logprob", "ref_logprob", "train"})

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")

#: The sample field whose values are each sample's sequence length.
LENGTHS_FIELD = "input_lengths"


@dataclass(frozen=True)
class FieldSpec:
    """The declaration of one field.

    ``dtype`` / ``wire_dtype`` accept a torch dtype or its name ("bfloat16") and are
    stored as torch dtypes. ``stages`` is stored as a frozenset.

    Example::

        FieldSpec("pixel_values", "media", "packed", {"logprob", "ref_logprob", "train"},
                  dtype="float32", wire_dtype="bfloat16", optional=True)
    """

    name: str
    alignment: str
    container: str
    stages: frozenset[str] = field(default_factory=frozenset)
    dtype: torch.dtype | None = None
    wire_dtype: torch.dtype | None = None
    pad_value: int | float | bool = 0
    optional: bool = False
    doc: str = ""
    #: Identical rows of the field stored once per put (and read back as views of one
    #: buffer): None means on for media fields, off otherwise; only media fields may share.
    dedup: bool | None = None

    def __post_init__(self) -> None:
        stages = self.stages
        if isinstance(stages, str):
            stages = {stages}
        elif isinstance(stages, Mapping):  # (a YAML mapping where a list was meant: its keys would be taken)
            raise RegistryError(f"field {self.name!r}: stages is a list of stage names, got a mapping",
                                field=str(self.name))
        object.__setattr__(self, "stages", frozenset(stages))
        for attr in ("dtype", "wire_dtype"):
            value = getattr(self, attr)
            if value is not None:
                try:
                    object.__setattr__(self, attr, dtype_from_name(value))
                except ValueError as err:
                    raise RegistryError(f"field {self.name!r}: {attr}: {err}", field=self.name) from None

    @property
    def shares_rows(self) -> bool:
        """Whether identical rows of this field are stored once (``dedup``, default: media fields)."""
        return self.alignment == "media" if self.dedup is None else bool(self.dedup)

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a payload of ``dtype`` is stored with: ``wire_dtype`` for floating payloads."""
        if self.wire_dtype is not None and dtype.is_floating_point:
            return self.wire_dtype
        return dtype

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-able description; ``FieldSpec.from_dict`` inverts it."""
        return {
            "name": self.name,
            "alignment": self.alignment,
            "container": self.container,
            "stages": sorted(self.stages),
            "dtype": None if self.dtype is None else dtype_name(self.dtype),
            "wire_dtype": None if self.wire_dtype is None else dtype_name(self.wire_dtype),
            "pad_value": self.pad_value,
            "optional": self.optional,
            "doc": self.doc,
            **({} if self.dedup is None else {"dedup": self.dedup}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Inverse of :meth:`to_dict`; unknown keys raise RegistryError."""
        known = {"name", "alignment", "container", "stages", "dtype", "wire_dtype", "pad_value", "optional", "doc",
                 "dedup"}
        extra = set(data) - known
        if extra:
            raise RegistryError(f"field spec {data.get('name')!r}: unknown keys {sorted(extra)}", field=data.get("name"))
        missing = {"name", "alignment", "container"} - set(data)
        if missing:
            raise RegistryError(f"field spec {data.get('name')!r}: missing keys {sorted(missing)}", field=data.get("name"))
        return cls(**{k: v for k, v in data.items()})


def _check_spec(spec: FieldSpec) -> None:
    """Raise RegistryError unless ``spec`` is a legal declaration."""
    name = spec.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RegistryError(
            f"field name {name!r} is not legal: use letters, digits, '_' and '.' only", field=str(name)
        )
    if (spec.alignment, spec.container) not in LEGAL_PAIRS:
        legal = ", ".join(f"{a}+{c}" for a, c in sorted(LEGAL_PAIRS))
        raise RegistryError(
            f"field {name!r}: alignment {spec.alignment!r} with container {spec.container!r} is not legal; "
            f"legal pairs are {legal}",
            field=name,
        )
    if spec.dedup is not None and not isinstance(spec.dedup, bool):
        raise RegistryError(f"field {name!r}: dedup must be true, false or left out", field=name)
    if spec.dedup and spec.alignment != "media":
        raise RegistryError(f"field {name!r}: only media fields store identical rows once (dedup); leave dedup out "
                            f"for a {spec.alignment} field", field=name)
    if spec.container == "object" and (spec.dtype is not None or spec.wire_dtype is not None):
        raise RegistryError(f"field {name!r}: object fields have no dtype/wire_dtype", field=name)
    if spec.wire_dtype is not None and not spec.wire_dtype.is_floating_point:
        raise RegistryError(
            f"field {name!r}: wire_dtype {dtype_name(spec.wire_dtype)} is not floating; "
            "wire_dtype only casts floating payloads",
            field=name,
        )
    if spec.dtype is not None and spec.wire_dtype is not None and not spec.dtype.is_floating_point:
        raise RegistryError(f"field {name!r}: wire_dtype is set but dtype {dtype_name(spec.dtype)} is not floating", field=name)
    if not isinstance(spec.pad_value, (int, float, bool)):
        raise RegistryError(f"field {name!r}: pad_value {spec.pad_value!r} must be a number", field=name)
    if (
        spec.dtype is not None
        and not spec.dtype.is_floating_point
        and isinstance(spec.pad_value, float)
        and not float(spec.pad_value).is_integer()
    ):
        raise RegistryError(
            f"field {name!r}: pad_value {spec.pad_value!r} is not representable in {dtype_name(spec.dtype)}",
            field=name,
        )
    if not isinstance(spec.optional, bool):  # (a YAML "false" string is true)
        raise RegistryError(f"field {name!r}: optional must be true or false, got {spec.optional!r}", field=name)
    integral = spec.dtype is not None and not (spec.dtype.is_floating_point or spec.dtype.is_complex
                                               or spec.dtype == torch.bool)
    if integral and not torch.iinfo(spec.dtype).min <= spec.pad_value <= torch.iinfo(spec.dtype).max:
        raise RegistryError(f"field {name!r}: pad_value {spec.pad_value!r} does not fit {dtype_name(spec.dtype)}",
                            field=name)
    if spec.dtype == torch.bool and spec.pad_value not in (0, 1):  # (-1 padded as True)
        raise RegistryError(f"field {name!r}: pad_value {spec.pad_value!r} of a bool field must be 0 or 1", field=name)
    if not all(isinstance(s, str) and s for s in spec.stages):
        raise RegistryError(f"field {name!r}: stages must be non-empty strings, got {sorted(map(str, spec.stages))}", field=name)
    model = spec.stages & MODEL_STAGES
    if spec.alignment == "media" and model and model != MODEL_STAGES:
        raise RegistryError(
            f"media field {name!r} is read by {sorted(model)} but not by {sorted(MODEL_STAGES - model)}: "
            "every model pass must see the same multimodal inputs (a pass without them trains image-blind); "
            f"declare stages ⊇ {sorted(MODEL_STAGES)}",
            field=name,
        )


class Registry:
    """The declared fields of one deployment, in registration order.

    Example::

        reg = Registry()
        reg.register(FieldSpec("input_ids", "token", "dense", {"train"}, dtype="int64"))
        reg.fields_for_stage("train")  # ["input_ids"]
    """

    def __init__(self, specs: Iterable[FieldSpec] = ()) -> None:
        self._specs: dict[str, FieldSpec] = {}
        for spec in specs:
            self.register(spec)

    # -- declaring -------------------------------------------------------------------
    def register(self, spec: FieldSpec) -> FieldSpec:
        """Add ``spec``; RegistryError on an illegal declaration or a duplicate name."""
        if not isinstance(spec, FieldSpec):
            raise RegistryError(f"register() takes a FieldSpec, got {type(spec).__name__}")
        _check_spec(spec)
        if spec.name in self._specs:
            raise RegistryError(f"field {spec.name!r} is already registered", field=spec.name)
        self._specs[spec.name] = spec
        return spec

    # -- looking up ------------------------------------------------------------------
    def get(self, name: str) -> FieldSpec:
        """The spec of ``name``; UnregisteredFieldError if it is not declared."""
        try:
            return self._specs[name]
        except (KeyError, TypeError):
            raise UnregisteredFieldError(
                f"not in the registry (registered: {', '.join(self._specs)}); "
                "declare it with Registry.register(FieldSpec(...)) before writing or reading it",
                field=str(name),
            ) from None

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[FieldSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        """Registered field names, in registration order."""
        return list(self._specs)

    def specs(self) -> list[FieldSpec]:
        """Registered specs, in registration order."""
        return list(self._specs.values())

    def token_fields(self) -> list[str]:
        """The token-aligned fields' names (a row per token: as long as its sample), in
        registration order. Example: ``default_registry().token_fields()[0]`` is ``"input_ids"``."""
        return [s.name for s in self._specs.values() if s.alignment == "token"]

    def without_sharing(self) -> Registry:
        """This registry with every field storing each of its rows (``dedup=False``): for a
        store that must hold every copy, e.g. a benchmark that fills it with one batch again
        and again.

        Example: ``Client(default_registry().without_sharing(), transport)``.
        """
        return Registry([FieldSpec.from_dict({**s.to_dict(), "dedup": False}) if s.shares_rows else s
                         for s in self.specs()])

    def stages(self) -> set[str]:
        """Every stage some field declares."""
        return {s for spec in self._specs.values() for s in spec.stages}

    def fields_for_stage(self, stage: str, present: Iterable[str] | None = None) -> list[str]:
        """The fields ``stage`` reads: its non-optional fields, plus its optional fields in ``present``.

        ``present`` is what a partition or meta holds (``SampleMeta.fields``). Names in
        ``present`` must be registered; an unknown stage raises UnknownStageError.

        Example::

            reg.fields_for_stage("logprob", present=meta.fields)
        """
        known = self.stages()
        if stage not in known:
            raise UnknownStageError(stage, known)
        have = set(present or ())
        for name in have:
            self.get(name)
        return [
            spec.name
            for spec in self._specs.values()
            if stage in spec.stages and (not spec.optional or spec.name in have)
        ]

    # -- validating values -----------------------------------------------------------
    def validate(self, fields: Mapping[str, Any]) -> int:
        """Check names, containers, dtypes and batch sizes of ``fields``; return the batch size.

        Raises (never warns) an error from ``rlplane.errors`` naming the field. ``None``
        values are skipped (a field not written in this batch). Per-sample geometry
        (sequence lengths) is checked by the codec.

        Example::

            reg.validate({"input_ids": ids, "pixel_values": PackedTensor(rows)})  # -> 64
        """
        batch: int | None = None
        first: str | None = None
        for name, value in fields.items():
            spec = self.get(name)
            if value is None:
                continue
            n = _check_value(spec, value)
            if batch is None:
                batch, first = n, name
            elif n != batch:
                raise ShapeError(
                    f"batch size {n} differs from field {first!r} with batch size {batch}; "
                    "every field of one put describes the same samples",
                    field=name,
                )
        return 0 if batch is None else batch

    # -- (de)serialising -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-able form; ``Registry.from_dict`` inverts it."""
        return {"fields": [spec.to_dict() for spec in self._specs.values()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Registry:
        """Inverse of :meth:`to_dict`; every spec is re-checked as by :meth:`register`."""
        if not isinstance(data, Mapping) or not isinstance(data.get("fields"), list):
            raise RegistryError("a registry dict has the form {'fields': [spec, ...]}")
        return cls(FieldSpec.from_dict(d) for d in data["fields"])

    @property
    def version(self) -> str:
        """A stable hash of the wire-relevant content (everything but ``doc``)."""
        body = [{k: v for k, v in d.items() if k != "doc"} for d in self.to_dict()["fields"]]
        blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Registry({len(self)} fields, version={self.version})"


def _check_value(spec: FieldSpec, value: Any) -> int:
    """Container and dtype check of one field's value; returns its batch size."""
    name = spec.name
    if spec.container == "dense":
        if not isinstance(value, torch.Tensor):
            raise ContainerError(
                f"expected a torch.Tensor (container 'dense'), got {type(value).__name__}", field=name
            )
        if value.is_nested:
            if spec.alignment != "token" or value.layout != torch.jagged:
                raise ContainerError(
                    "a nested tensor is accepted only for token fields, with layout=torch.jagged", field=name
                )
        elif spec.alignment == "sample" and value.dim() < 1:
            raise ShapeError("a sample field needs a batch dimension; got a 0-dim tensor", field=name)
        elif spec.alignment == "token" and value.dim() < 2:
            raise ShapeError(
                f"a token field is [batch, seq, ...]; got shape {list(value.shape)}", field=name
            )
        check_dtype(spec, value.dtype)
        return int(value.size(0))
    if spec.container == "packed":
        if not isinstance(value, PackedTensor):
            raise ContainerError(
                f"expected an rlplane.PackedTensor (container 'packed'), got {type(value).__name__}; "
                "wrap per-sample rows with PackedTensor(rows)",
                field=name,
            )
        if value.dtype is not None:
            check_dtype(spec, value.dtype)
        return len(value)
    if spec.container == "object":
        if not isinstance(value, list):
            raise ContainerError(
                f"expected a list with one msgpack-able value per sample (container 'object'), "
                f"got {type(value).__name__}",
                field=name,
            )
        return len(value)
    raise ContainerError(f"container {spec.container!r} is unknown", field=name)  # pragma: no cover


def check_dtype(spec: FieldSpec, dtype: torch.dtype) -> None:
    """DtypeError naming the field unless ``dtype`` is one ``spec`` takes (its declared
    dtype, or its wire dtype; any the wire carries where it declares none)."""
    if spec.dtype is None:
        try:
            dtype_name(dtype)
        except ValueError as err:
            raise DtypeError(f"{err}; cast before writing", field=spec.name) from None
        return
    if dtype == spec.dtype or (spec.wire_dtype is not None and dtype == spec.wire_dtype):
        return
    allowed = dtype_name(spec.dtype) + (f" or {dtype_name(spec.wire_dtype)}" if spec.wire_dtype else "")
    got = str(dtype).removeprefix("torch.")
    raise DtypeError(f"dtype {got} but the registry declares {allowed}; cast before writing", field=spec.name)


def default_registry() -> Registry:
    """The GRPO / VLM profile: text fields, stage outputs and every multimodal input.

    Adding a modality is one ``FieldSpec`` line.

    Example::

        reg = default_registry()
        reg.fields_for_stage("ref_logprob", present=["pixel_values", "image_grid_thw"])
    """
    model = MODEL_STAGES
    train = {"train"}
    mm = dict(stages=model, optional=True)
    return Registry(
        [
            FieldSpec("input_ids", "token", "dense", model, dtype="int64", doc="prompt + response token ids"),
            FieldSpec(LENGTHS_FIELD, "sample", "dense", model, dtype="int64", doc="valid tokens per sample"),
            FieldSpec("token_mask", "token", "dense", train, doc="1 where the loss applies (response tokens)"),
            FieldSpec("sample_mask", "sample", "dense", train, dtype="float32", doc="1 for samples that count"),
            FieldSpec("generation_logprobs", "token", "dense", train, dtype="float32", doc="logprobs from the rollout engine"),
            FieldSpec("prev_logprobs", "token", "dense", train, dtype="float32", doc="policy logprobs (logprob stage)"),
            FieldSpec("reference_policy_logprobs", "token", "dense", train, dtype="float32", doc="reference logprobs"),
            FieldSpec("advantages", "token", "dense", train, dtype="float32", doc="per-token advantages"),
            FieldSpec("mm_token_type_ids", "token", "dense", dtype="int64", doc="0 text, 1 image, 2 video", **mm),
            FieldSpec("token_type_ids", "token", "dense", dtype="int64", doc="token type ids", **mm),
            FieldSpec("pixel_values", "media", "packed", dtype="float32", wire_dtype="bfloat16", doc="image patches", **mm),
            FieldSpec("pixel_values_videos", "media", "packed", dtype="float32", wire_dtype="bfloat16", doc="video patches", **mm),
            FieldSpec("image_grid_thw", "media", "packed", dtype="int64", doc="(t, h, w) per image", **mm),
            FieldSpec("video_grid_thw", "media", "packed", dtype="int64", doc="(t, h, w) per video", **mm),
            FieldSpec("second_per_grid_ts", "media", "packed", dtype="float32", doc="seconds per temporal grid", **mm),
            FieldSpec("input_features", "media", "packed", dtype="float32", wire_dtype="bfloat16", doc="audio features", **mm),
            FieldSpec("feature_attention_mask", "media", "packed", doc="audio feature mask", **mm),
            FieldSpec("imgs_sizes", "media", "packed", dtype="int64", doc="original image sizes", **mm),
            FieldSpec("num_frames", "media", "packed", dtype="int64", doc="frames per video", **mm),
        ]
    )
