"""What TransferQueue's and Mooncake's failures mean, as one table.

TransferQueue reports its storage's failures as exception text (Mooncake's with numeric
error codes). Each :class:`Rule` names the backend it applies to, the pattern that
recognises the failure, the typed error it becomes and what to tell the user. A failure
no rule recognises is a plain ``TransportError`` carrying TransferQueue's message.

Example::

    err = translate("mooncake", RuntimeError("... with error codes [-200] ..."))
    assert isinstance(err, StorageFullError)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from rlplane.errors import RlplaneError, StorageFullError, TransportError, UnavailableError

#: The TransferQueue storages TQTransport speaks to.
BACKENDS = ("simple", "mooncake")


def _codes(*codes: int) -> re.Pattern[str]:
    """Mooncake's batch failures list one error code per key: match any of ``codes``."""
    return re.compile(r"error codes \[[^\]]*(?:" + "|".join(str(c) for c in codes) + r")\b")


@dataclass(frozen=True)
class Rule:
    """One recognised failure: on ``backend``, text matching ``pattern`` is ``error(hint)``.
    ``{why}`` in the hint is filled in with the storage units the service declared dead."""

    backend: str
    name: str
    pattern: re.Pattern[str]
    error: type[RlplaneError]
    hint: str
    component: str = ""  # what an UnavailableError names (else: the one unit declared dead, if one)


RULES: tuple[Rule, ...] = (
    Rule("simple", "capacity exceeded", re.compile(r"Storage capacity exceeded"), StorageFullError,
         "the TransferQueue storage units have no room for this write (nothing of it was kept); clear "
         "consumed partitions, or raise RLPLANE_CAPACITY / RLPLANE_STORAGE_UNITS"),
    Rule("mooncake", "NO_AVAILABLE_HANDLE (-200)", _codes(-200), StorageFullError,
         "the Mooncake pool has no room for this write (nothing of it was kept); clear "
         "consumed partitions, or raise RLPLANE_MOONCAKE_SEGMENT_BYTES / RLPLANE_STORAGE_UNITS"),
    Rule("mooncake", "TRANSFER_FAIL (-800)", _codes(-800), UnavailableError,
         "a Mooncake storage unit this call needs does not answer ({why}); a dead unit's samples are declared "
         "lost within seconds, and Mooncake's master stops placing new values on its segment within its client "
         "TTL (30 s): retry, and check /readyz"),
    Rule("mooncake", "RPC_FAIL (-900)", _codes(-900), UnavailableError,
         "the Mooncake master does not answer (its process died, or it is out of reach): nothing can be placed, "
         "found or removed until the service is restarted with a new one; check /readyz", "mooncake_master"),
    Rule("mooncake", "LEASE_EXPIRED (-707)", _codes(-707), TransportError,
         "a Mooncake read took longer than the lease on its objects and was refused; read fewer "
         "samples per call, or raise RLPLANE_MOONCAKE_LEASE_TTL_MS on the service"),
)


def translate(backend: str, err: BaseException, dead: Callable[[], list[str]] = list) -> RlplaneError:
    """The typed error for ``err`` raised by TransferQueue over ``backend`` (the first rule
    that matches; ``dead()`` names the storage units the service declared dead)."""
    text = str(err)
    for rule in RULES:
        if rule.backend == backend and rule.pattern.search(text):
            if rule.component:
                return rule.error(rule.hint, component=rule.component)  # type: ignore[call-arg]
            if "{why}" not in rule.hint:
                return rule.error(rule.hint)
            units = dead()
            why = f"declared dead: {', '.join(units)}" if units else "its process died, or it is out of reach"
            if rule.error is UnavailableError:
                return UnavailableError(rule.hint.format(why=why), component=units[0] if len(units) == 1 else None)
            return rule.error(rule.hint.format(why=why))
    return TransportError(f"TransferQueue call failed: {err}")


_MOONCAKE_FAILED = re.compile(r"failed for keys \[([^\]]*)\] with error codes \[([^\]]*)\]")


def mooncake_not_found(message: str, ids_by_index: Mapping[int, str]) -> dict[str, list[str]]:
    """From TransferQueue's Mooncake read error: sample id -> fields whose value the pool
    reported OBJECT_NOT_FOUND (-704), for the keys (``{global index}@{field}``) it names."""
    found = _MOONCAKE_FAILED.search(message)
    if not found:
        return {}
    keys = re.findall(r"'([^']*)'", found.group(1))
    codes = [c.strip() for c in found.group(2).split(",")]
    out: dict[str, list[str]] = {}
    for key, code in zip(keys, codes):
        gi, _, name = key.partition("@")
        if code == "-704" and gi.isdigit() and int(gi) in ids_by_index:
            out.setdefault(ids_by_index[int(gi)], []).append(name)
    return out


__all__ = ["BACKENDS", "RULES", "Rule", "mooncake_not_found", "translate"]
