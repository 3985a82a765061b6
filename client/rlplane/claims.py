"""A claim as the client builds it, the wire carries it and the ledger reads it.

:class:`ClaimRequest` is the one definition of what a claim may ask: ``build`` makes one
from what a caller passes (``client.claim`` and the HTTP API both use it), ``parse``
from a wire header (the claim engine, :mod:`rlplane_service.ledger`), and both end in
``check``. Torch-free: the store's index processes read it.

Example::

    req = ClaimRequest.build(default_registry(), "step-0", "train", 64, stage="train", timeout=5.0)
    ClaimRequest.parse(req.to_header()) == req   # True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlplane import errors as E
from rlplane.names import MAX_NAME_LEN, check_partition

if TYPE_CHECKING:
    from rlplane.fields import Registry

#: Longest a server parks one claim; a client waiting longer asks again.
MAX_WAIT_S = 30.0
#: The longest wait of one request of an awaited claim (``Client.aclaim``): how soon a
#: cancelled one stops.
AWAIT_STEP_S = 0.5
#: Most samples one claim hands out (the batch size of a token-budget claim without one).
MAX_CLAIM_BATCH = 1 << 16


@dataclass(frozen=True)
class ClaimRequest:
    """One claim, as it crosses the wire (short keys) and as the ledger reads it."""

    partition: str
    task: str
    batch_size: int
    fields: tuple[str, ...]
    wait_s: float  # how long the server may park it (the client's timeout, capped)
    min_batch: int
    group_key: str | None = None
    current_version: int | None = None
    max_staleness: int | None = None
    lease_s: float | None = None
    #: Token budget: the summed lengths (rows of ``tokens_field``) of what one claim hands out.
    max_tokens: int | None = None
    min_tokens: int | None = None  # what a claim at its deadline needs at least (default: max_tokens)
    tokens_field: str | None = None  # the token field whose rows' lengths count (one of ``fields``)
    #: Hand out partial rollouts too (samples whose ``finished`` tag is False: rlplane.tags).
    unfinished: bool = False
    #: The answer's tags as columns (``g``: each field's wire geometry, ``user``: each
    #: sample's user tags) where the store keeps them so, instead of a map per sample.
    columnar: bool = False

    def to_header(self) -> dict[str, Any]:
        out = {"p": self.partition, "task": self.task, "n": self.batch_size, "fields": list(self.fields),
               "wait": self.wait_s, "min": self.min_batch, "group": self.group_key, "version": self.current_version,
               "stale": self.max_staleness, "lease_s": self.lease_s}
        if self.max_tokens is not None:
            out.update({"tok": self.max_tokens, "mintok": self.min_tokens, "tokf": self.tokens_field})
        if self.unfinished:
            out["unf"] = True
        if self.columnar:
            out["cols"] = True
        return out

    @classmethod
    def build(cls, registry: Registry, partition: str, task: str, batch_size: int | None, *, stage: str | None = None,
              fields: Sequence[str] | None = None, timeout: float = 0.0, min_batch: int | None = None,
              group_key: str | None = None, current_version: int | None = None, max_staleness: int | None = None,
              lease_s: float | None = None, max_tokens: int | None = None,
              min_tokens: int | None = None, unfinished: bool = False) -> ClaimRequest:
        """A checked claim from a caller's arguments: ``fields``, or ``stage``'s fields from
        ``registry`` (every name registered); typed errors name what is wrong. With
        ``max_tokens`` the lengths counted are those of the first token field among them,
        ``batch_size`` may be None (at most :data:`MAX_CLAIM_BATCH`) and ``min_batch``
        defaults to 1. ``unfinished``: partial rollouts are handed out too."""
        check_partition(partition)
        if not isinstance(task, str) or not task:
            raise E.InvalidArgumentError(f"task must be a non-empty string, got {task!r}")
        if fields is None and stage is None:
            raise E.InvalidArgumentError("a claim needs fields=[...] or stage=... (what makes a sample ready)")
        names = list(fields) if fields is not None else registry.fields_for_stage(stage)  # type: ignore[arg-type]
        specs = [registry.get(name) for name in names]
        tokens_field = None
        if max_tokens is not None or min_tokens is not None:
            tokens_field = next((s.name for s in specs if s.alignment == "token"), None)
            if tokens_field is None:
                raise E.InvalidArgumentError(f"a claim by tokens (max_tokens) counts the lengths of a token field; "
                                             f"none of {names} is one (add e.g. 'input_ids' to fields)")
            if max_tokens is None:
                raise E.InvalidArgumentError("min_tokens needs max_tokens")
        if batch_size is None and max_tokens is None:
            raise E.InvalidArgumentError("a claim needs batch_size, max_tokens, or both")
        if batch_size is None:
            batch_size = MAX_CLAIM_BATCH

        def arg(x: Any, kind: type, what: str) -> Any:  # a caller's argument, checked as a header's field is
            return _opt(x, kind, what, E.InvalidArgumentError)

        batch_size, max_tokens, min_tokens = arg(batch_size, int, "batch_size"), arg(max_tokens, int, "max_tokens"), \
            arg(min_tokens, int, "min_tokens")
        if min_batch is None:
            min_batch = 1 if max_tokens is not None else batch_size
        req = cls(partition, task, batch_size, tuple(names), arg(timeout or 0.0, float, "timeout"),
                  arg(min_batch, int, "min_batch"), arg(group_key, str, "group_key"),
                  arg(current_version, int, "current_version"), arg(max_staleness, int, "max_staleness"),
                  arg(lease_s, float, "lease_s"), max_tokens, max_tokens if min_tokens is None else min_tokens,
                  tokens_field, _flag(unfinished, "unfinished", E.InvalidArgumentError))
        req.check()
        return req

    def filled(self) -> ClaimRequest:
        """This claim asking for a full batch (and a full budget): what every wait but the
        last of a long claim asks (see ``Client.claim``)."""
        return replace(self, min_batch=self.batch_size, min_tokens=self.max_tokens)

    @classmethod
    def parse(cls, h: Mapping[str, Any]) -> ClaimRequest:
        """Checked request from a header; InvalidArgumentError/WireFormatError names what is wrong.
        Numbers must be numbers (a string such as ``"nan"`` is refused) and finite."""
        p, task, fields = h.get("p"), h.get("task"), h.get("fields") or []
        if not (isinstance(p, str) and p and isinstance(task, str) and task and isinstance(fields, list)
                and all(isinstance(f, str) for f in fields)):
            raise E.WireFormatError("claim needs partition 'p', 'task' and a list of 'fields'")
        n = _num(h.get("n"), int, "n")
        req = cls(p, task, n, tuple(fields), _num(h.get("wait") or 0.0, float, "wait"),
                  _num(h.get("min") or n, int, "min"), _opt(h.get("group"), str, "group"),
                  _opt(h.get("version"), int, "version"), _opt(h.get("stale"), int, "stale"),
                  _opt(h.get("lease_s"), float, "lease_s"), _opt(h.get("tok"), int, "tok"),
                  _opt(h.get("mintok"), int, "mintok"), _opt(h.get("tokf"), str, "tokf"), _flag(h.get("unf"), "unf"),
                  _flag(h.get("cols"), "cols"))
        req.check()
        return req

    def check(self) -> None:
        """InvalidArgumentError for a claim that can never be answered."""
        if self.batch_size < 1:
            raise E.InvalidArgumentError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 1 <= self.min_batch <= self.batch_size:
            raise E.InvalidArgumentError(f"min_batch must be between 1 and batch_size={self.batch_size}, got {self.min_batch}")
        if not self.fields:
            raise E.InvalidArgumentError("a claim needs the fields that make a sample ready (fields=[...] or stage=...)")
        if (self.current_version is None) != (self.max_staleness is None):
            raise E.InvalidArgumentError("current_version and max_staleness go together")
        if self.max_staleness is not None and not 0 <= self.max_staleness < 1 << 62:
            raise E.InvalidArgumentError(f"max_staleness must be in [0, 2**62), got {self.max_staleness}")
        if self.current_version is not None and not -(1 << 62) <= self.current_version < 1 << 62:
            raise E.InvalidArgumentError(f"current_version must be within +-2**62, got {self.current_version}")
        if self.lease_s is not None and not 0 < self.lease_s <= 86400:
            raise E.InvalidArgumentError(f"lease_s must be in (0, 86400], got {self.lease_s}")
        if (self.max_tokens is None) != (self.tokens_field is None) or (self.max_tokens is None) != (self.min_tokens is None):
            raise E.InvalidArgumentError("max_tokens, min_tokens and the field whose lengths count go together")
        if self.max_tokens is not None and not 1 <= self.min_tokens <= self.max_tokens:  # type: ignore[operator]
            raise E.InvalidArgumentError(f"max_tokens must be at least 1 and min_tokens between 1 and max_tokens, got "
                                         f"max_tokens={self.max_tokens}, min_tokens={self.min_tokens}")
        if self.tokens_field is not None and self.tokens_field not in self.fields:
            raise E.InvalidArgumentError(f"the field whose lengths count ({self.tokens_field!r}) must be one the claim "
                                         "waits for")
        if not 0 <= self.wait_s <= 86400:
            raise E.InvalidArgumentError(f"timeout must be in [0, 86400] seconds, got {self.wait_s}")
        if len(self.fields) > 1024 or len(self.partition) > MAX_NAME_LEN or len(self.task) > MAX_NAME_LEN:
            raise E.InvalidArgumentError(f"partition and task names are at most {MAX_NAME_LEN} characters, and a "
                                         "claim names at most 1024 fields")


def _num(x: Any, kind: type, what: str, error: type[E.RlplaneError] = E.WireFormatError) -> Any:
    """``x`` as an int (``kind=int``: an int of at most 63 bits; numpy's too) or a finite
    float; ``error`` naming ``what`` otherwise (a bool, a string, NaN, 1.5 for an int)."""
    if type(x).__module__ == "numpy" and hasattr(x, "item"):
        x = x.item()
    ok = isinstance(x, int) and not isinstance(x, bool) and -(1 << 63) <= x < 1 << 63
    if kind is float:
        ok = (ok or isinstance(x, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not ok:
        raise error(f"claim field {what!r} must be a finite {kind.__name__}, got {str(x)[:40]!r}")
    return kind(x)


def _flag(x: Any, what: str, error: type[E.RlplaneError] = E.WireFormatError) -> bool:
    """``x`` as a bool (None: False; numpy's bools too), else ``error`` naming ``what``."""
    if x is None or isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")):
        return bool(x)
    raise error(f"claim field {what!r} must be true or false, got {str(x)[:40]!r}")


def _opt(x: Any, kind: type, what: str, error: type[E.RlplaneError] = E.WireFormatError) -> Any:
    if x is None:
        return None
    if kind is str:
        if not isinstance(x, str) or len(x) > 256:
            raise error(f"claim field {what!r} must be a string of at most 256 characters")
        return x
    return _num(x, kind, what, error)


__all__ = ["AWAIT_STEP_S", "MAX_WAIT_S", "MAX_CLAIM_BATCH", "ClaimRequest"]
