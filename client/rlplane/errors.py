"""Every error rlplane raises, in one hierarchy.

Catch :class:`RlplaneError` to handle them all. Each error names what it is about
(field, sample, partition, stage) in its attributes and says what to do in its message.

Example::

    try:
        registry.validate({"pixel_vals": pt})
    except UnregisteredFieldError as err:
        print(err.field)  # "pixel_vals"
"""

from __future__ import annotations

from typing import Any, Sequence


class RlplaneError(Exception):
    """Base class of every rlplane error."""


class RegistryError(RlplaneError, ValueError):
    """A field declaration is illegal (bad alignment/container pair, duplicate name...)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidArgumentError(RlplaneError, ValueError):
    """An argument outside its allowed values (a layout name, a dp_size of 0...)."""


class UnknownStageError(RlplaneError, ValueError):
    """A stage name that no registered field declares."""

    def __init__(self, stage: str, known: Sequence[str]) -> None:
        super().__init__(
            f"unknown stage {stage!r}: no registered field is read by it. "
            f"Known stages: {sorted(known)}. Check the spelling or register the stage's fields."
        )
        self.stage = stage
        self.known = sorted(known)


def _where(field: str | None, sample: Any) -> str:
    parts = []
    if field is not None:
        parts.append(f"field {field!r}")
    if sample is not None:
        parts.append(f"sample {sample!r}")
    return ", ".join(parts)


class FieldValidationError(RlplaneError, ValueError):
    """A value does not match its field's declaration. Nothing was written.

    ``field`` is the field's name; ``sample`` the offending sample (its id where known,
    else its index in the batch), or None when the whole column is wrong.
    """

    def __init__(self, message: str, *, field: str | None = None, sample: Any = None) -> None:
        where = _where(field, sample)
        super().__init__(f"{where}: {message}" if where else message)
        self.field = field
        self.sample = sample


class UnregisteredFieldError(FieldValidationError):
    """A field name the registry does not declare."""


#: The name the GRPO-pipeline issue and some callers use for :class:`UnregisteredFieldError`
#: (the same class: ``except UnknownFieldError`` catches it).
UnknownFieldError = UnregisteredFieldError


class ContainerError(FieldValidationError):
    """The value's type does not match the field's container (dense/packed/object)."""


class DtypeError(FieldValidationError):
    """The value's dtype is not the field's declared dtype."""


class ShapeError(FieldValidationError):
    """Batch size, sequence length or row geometry does not match."""


class WireFormatError(RlplaneError, ValueError):
    """Bytes on the wire do not describe what they claim (corrupt or foreign data)."""

    def __init__(self, message: str, *, field: str | None = None, sample: Any = None) -> None:
        where = _where(field, sample)
        super().__init__(f"{where}: {message}" if where else message)
        self.field = field
        self.sample = sample


class MissingDataError(RlplaneError, LookupError):
    """Requested (sample, field) pairs that the store does not hold. Never a partial result.

    ``missing`` maps each sample id to the field names it lacks (an empty list when the
    sample itself is unknown).
    """

    def __init__(self, partition: str, missing: dict[Any, list[str]], *, hint: str = "") -> None:
        unknown = [s for s, f in missing.items() if not f]
        lacking = {s: f for s, f in missing.items() if f}
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} unknown sample(s) {_head(unknown)}")
        if lacking:
            fields = sorted({f for fs in lacking.values() for f in fs})
            parts.append(
                f"{len(lacking)} sample(s) lacking field(s) {fields}: "
                + ", ".join(f"{s!r} lacks {f}" for s, f in list(lacking.items())[:5])
                + (" ..." if len(lacking) > 5 else "")
            )
        msg = f"partition {partition!r}: " + "; ".join(parts)
        if hint:
            msg += f". {hint}"
        super().__init__(msg)
        self.partition = partition
        self.missing = missing


class FieldsHeldError(RlplaneError, LookupError):
    """A read's samples hold fields it was asked to look for (``probe``) but not to read:
    optional fields its meta does not list, written after the meta was made (e.g. by a
    ``write_columns`` that added images to some of them). ``fields`` names them. A read by
    stage reads them too (:meth:`rlplane.Client.read_columns`); only a caller of a
    transport's ``get(..., probe=...)`` sees this error.

    Example::

        try:
            transport.get("step-0", ids, ["input_ids"], probe=["pixel_values"])
        except FieldsHeldError as err:
            err.fields  # ["pixel_values"]
    """

    def __init__(self, partition: str, fields: list[str]) -> None:
        super().__init__(f"partition {partition!r}: the samples hold field(s) {sorted(fields)} the read's meta does "
                         "not list (written after the meta was made): read them too")
        self.partition = partition
        self.fields = sorted(fields)


class DuplicateSampleError(RlplaneError, ValueError):
    """put_samples with sample ids that already exist in the partition. Nothing was written."""

    def __init__(self, partition: str, sample_ids: Sequence[Any]) -> None:
        super().__init__(
            f"partition {partition!r}: sample id(s) already stored {_head(list(sample_ids))}; "
            "use write_columns to add fields to stored samples, or clear them first"
        )
        self.partition = partition
        self.sample_ids = list(sample_ids)


class TransportError(RlplaneError, ConnectionError):
    """Moving bytes failed (service unreachable, storage unit down...)."""


class UnavailableError(TransportError):
    """A component of the store (a storage unit, the controller) does not answer: it died,
    or it is out of reach. ``component`` names it. Calls that need it fail within seconds
    instead of hanging; check ``/readyz`` and the service's logs."""

    def __init__(self, message: str, *, component: str | None = None) -> None:
        super().__init__(message)
        self.component = component


class VersionMismatchError(TransportError):
    """The service runs another release of rlplane than this client. Their messages are
    not kept compatible across releases, so the client refuses to talk to it rather than
    misread a field: install the service's release here (the message says which)."""


class StorageFullError(TransportError):
    """The store has no room for the write (nothing of it was kept). Clear consumed
    partitions, or give the store more memory (more storage units or larger segments)."""


class NotReadyError(RlplaneError, TimeoutError):
    """A claim found fewer ready samples than it needs before its deadline; nothing was claimed."""


class LeaseError(RlplaneError, ValueError):
    """An ack/nack/commit for a lease or reservation that expired or was never granted."""

    def __init__(self, message: str = "", *, component: str = "") -> None:
        super().__init__(message)
        if component:
            self.component = component


#: The ``component`` of the LeaseError of a put that found rows stored in its partition
#: (rlplane.dedup) which a clear took before it committed: ``put_samples`` writes them itself then.
HELD_GONE = "held rows"


class IntegrityError(RlplaneError, ValueError):
    """Bytes read back differ from what the writer stored (checksum mismatch)."""


class SnapshotError(IntegrityError):
    """A snapshot that cannot be restored (truncated, corrupted, of another format
    version, or missing a file); ``component`` names the file. Nothing of it was loaded."""

    def __init__(self, message: str, *, component: str = "") -> None:
        super().__init__(message)
        self.component = component


class AuthenticationError(RlplaneError, PermissionError):
    """The service wants ``Authorization: Bearer <token>`` and got none or a wrong one."""


class ForbiddenError(RlplaneError, PermissionError):
    """The caller is authenticated but may not do this (an operation for the controller
    only, or a partition outside the token's scope)."""


class PayloadTooLargeError(InvalidArgumentError):
    """One HTTP request body is over the service's limit. Nothing was written."""


# -- errors on the wire ----------------------------------------------------------------
# The service answers an error as JSON {"error": class name, "message": ..., attributes};
# the HTTP client rebuilds the same typed error, so a caller catches the same classes
# whichever transport moved the bytes.

_ATTRS = ("field", "sample", "partition", "missing", "sample_ids", "stage", "known", "component", "fields")


def lost_hint(lost: dict[str, str], advice: str) -> str:
    """The hint of a MissingDataError for samples a dead storage unit took (``{sample: unit}``).

    Example: ``lost_hint({"s1": "unit-1"}, "RLPLANE_REPLICAS=2 keeps two")`` ->
    "1 of them were lost with storage unit(s) unit-1 (RLPLANE_REPLICAS=2 keeps two)".
    """
    return f"{len(lost)} of them were lost with storage unit(s) {', '.join(sorted(set(lost.values())))} ({advice})"


def error_payload(err: RlplaneError) -> dict[str, Any]:
    """JSON-able form of ``err`` (see :func:`error_from_payload`)."""
    out: dict[str, Any] = {"error": type(err).__name__, "message": str(err)}
    for attr in _ATTRS:
        if hasattr(err, attr):
            value = getattr(err, attr)
            if attr == "missing":
                value = {str(k): list(v) for k, v in value.items()}
            out[attr] = value
    return out


def error_from_payload(payload: Any, *, default: type[RlplaneError] = TransportError) -> RlplaneError:
    """Rebuild the typed error the service reported; ``default`` for anything unknown.

    Example::

        raise error_from_payload(response.json())
    """
    if not isinstance(payload, dict):
        return default(f"service error: {payload!r}")
    cls = _BY_NAME.get(str(payload.get("error")), default)
    err = cls.__new__(cls)
    Exception.__init__(err, str(payload.get("message", "service error")))
    for attr in _ATTRS:
        if attr in payload:
            setattr(err, attr, payload[attr])
    return err


def _head(items: list[Any], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}]"


__all__ = [
    "RlplaneError",
    "RegistryError",
    "InvalidArgumentError",
    "UnknownStageError",
    "FieldValidationError",
    "UnregisteredFieldError",
    "UnknownFieldError",
    "ContainerError",
    "DtypeError",
    "ShapeError",
    "WireFormatError",
    "MissingDataError",
    "FieldsHeldError",
    "DuplicateSampleError",
    "TransportError",
    "VersionMismatchError",
    "UnavailableError",
    "StorageFullError",
    "NotReadyError",
    "LeaseError",
    "HELD_GONE",
    "IntegrityError",
    "SnapshotError",
    "AuthenticationError",
    "ForbiddenError",
    "PayloadTooLargeError",
    "error_payload",
    "ERROR_NAMES",
    "error_from_payload",
    "lost_hint",
]


_BY_NAME: dict[str, type[RlplaneError]] = {
    cls.__name__: cls
    for cls in (
        RlplaneError, RegistryError, InvalidArgumentError, UnknownStageError, FieldValidationError,
        UnregisteredFieldError, ContainerError, DtypeError, ShapeError, WireFormatError,
        MissingDataError, FieldsHeldError, DuplicateSampleError, TransportError, UnavailableError, StorageFullError,
        NotReadyError, LeaseError, IntegrityError, SnapshotError, AuthenticationError, ForbiddenError, PayloadTooLargeError,
    )
}
#: The class names a peer may report an error under (anything else is not an rlplane error).
ERROR_NAMES = frozenset(_BY_NAME)
