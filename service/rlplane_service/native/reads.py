"""The native controller's read side: ``locate`` (where every requested row is, pinned
while it is read), the read capabilities a unit checks, and pins' release and renewal.

Reads ``locate`` samples (which unit, block and row holds each requested field) and get
the tags back; clients then read the units directly: rows on a unit whose slab the
client mapped (same host) come with their slab addresses, and the client copies them
out itself; other rows it asks the unit for. Every locate pins the blocks it names, so
an extent is never reused under a read in flight. Reads go to the first copy on a unit
that is not suspect.

:class:`ReadOps` is mixed into :class:`~rlplane_service.native.controller.ControllerCore`.

Example::

    core.op_locate({"p": "step-0", "ids": ["a"], "fields": ["input_ids"], "shm": [0]}, {}, [])
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

import numpy as np

from rlplane import errors as E
from rlplane.tags import stale_meta
from rlplane.wire import int_array, ints
from rlplane_service.native.index import Partition
from rlplane_service.native.pins import MAX_PINS, Pins
from rlplane_service.native.requests import births, field_names, partition_of, sample_ids
from rlplane_service.native.unit import read_cap

log = logging.getLogger(__name__)

#: The most (sample, field) pairs one locate answers: each costs its answer at least 16
#: bytes (the row's size and digest), so more can never be sent (the header limit, 16 MiB);
#: the client asks for at most READ_CELLS (2**18) at a time. Checked before the answer is
#: built (a locate naming one sample a million times over 32 fields took 2 GB to refuse).
MAX_LOCATE_CELLS = 1 << 20


def _holds(part: Partition, field: str, slots: np.ndarray) -> bool:
    """Whether any of ``slots`` holds a row of ``field``."""
    fi = part.fields.get(field)
    return fi is not None and bool((fi.at("block", slots) >= 0).any())


class ReadOps:
    """Locate / unpin / renew over the controller's index (a mixin)."""

    _lock: threading.RLock
    _parts: dict[str, Partition]
    _block_units: dict[int, tuple[int, ...]]
    _block_ext: dict[int, Any]
    units: list[tuple[str, str]]
    pins: Pins
    pin_lease_s: float
    seal_key: bytes | None

    def op_locate(self, header: dict, columns: dict, extra: list) -> Any:
        """Where every requested (sample, field) is: per unit, ``[field, blocks, rows,
        positions in the request]`` plus, for units in ``shm`` (slabs the client mapped),
        each row's slab address and the field's dtype. The blocks named are pinned
        (``pin`` in the answer) until the client unpins them or the pin's lease passes.
        ``opt`` (optional): fields not read, looked for: FieldsHeldError naming those some of
        the samples hold (a reader's meta older than the write that added them)."""
        p, ids, fields = partition_of(header), sample_ids(header.get("ids"), unique=False), field_names(header.get("fields"))
        probe = field_names(header["opt"], "opt") if header.get("opt") is not None else []
        self._access(header, p, write=False)
        if len(ids) * len(fields) > MAX_LOCATE_CELLS:  # (its answer, built first, would be refused as too big)
            raise E.PayloadTooLargeError(f"a locate of {len(ids)} samples x {len(fields)} fields asks for more than "
                                         f"{MAX_LOCATE_CELLS} (sample, field) pairs at once: read in pieces")
        shm = header.get("shm") or []
        if not isinstance(shm, list) or len(shm) > len(self.units) or not all(isinstance(u, int) for u in shm):
            raise E.WireFormatError("'shm' must list unit indices")
        local = {u for u in shm if 0 <= u < len(self.units)}
        with self._lock:
            part = self._parts.get(p)
            slots = self._slots(p, part, ids)  # MissingDataError unless the partition holds them all
            born = births(header.get("bn"), len(ids))  # the incarnations the reader's meta names
            if born is not None and (bad := self._parts[p].stale(slots, born)).size:
                raise stale_meta(p, ids, bad, "read")
            if held := [f for f in probe if f not in fields and _holds(self._parts[p], f, slots)]:
                raise E.FieldsHeldError(p, held)  # (a stale meta: the reader asks for them too)
            pinned: set[int] = set()
            out = self._locate(p, self._parts[p], slots, ids, fields, local, pinned, share=header.get("share") is True)
            keep = header.get("keep") is True
            out["pin"] = self.pins.pin(sorted(pinned), keep=keep) if pinned else None
            if keep and pinned:  # views may outlive this controller: their renewals name the blocks (pins.py)
                out["pb"] = ints(sorted(pinned))
        return out, {}, []

    def _locate(self, p: str, part: Partition, slots: np.ndarray, ids: list[str], fields: list[str], local: set[int],
                pinned: set[int], share: bool = False) -> dict[str, Any]:
        """A locate's answer for ``slots`` (samples ``ids``) of ``part`` (under the lock); the
        blocks it names are added to ``pinned`` (the caller pins them). ``share``: a row
        stored once for several of the samples is located once, for the first of them: the
        answer's ``s`` gives, per such field, each sample's earlier twin (-1: none), and the
        twins' sizes are 0 (the reader makes them views of the one copy)."""
        missing: dict[str, list[str]] = {}
        per_unit: dict[int, list[list[Any]]] = {}
        unmapped: dict[int, set[int]] = {}  # per unit, the blocks the client reads over ZMQ (they need a capability)
        geoms, sizes, digests, twins = {}, {}, {}, {}
        plans: dict[bytes, list[_Share]] = {}  # fields of one put share their blocks: planned once
        for name in fields:
            fi = part.fields.get(name)
            blk = fi.at("block", slots) if fi is not None else np.full(slots.size, -1, np.int64)
            if fi is None or bool((blk < 0).any()):
                for i in np.flatnonzero(blk < 0).tolist():
                    missing.setdefault(ids[i], []).append(name)
                continue
            rows = fi.row[slots]
            nbytes = fi.nbytes[slots]
            same = first_twins(blk, rows) if share and bool(fi.dup[slots].any()) else None
            if same is not None:  # only the first sample of each shared row is read
                twins[name] = same.astype("<i8").tobytes()
                nbytes = np.where(same >= 0, 0, nbytes)
                own = np.flatnonzero(same < 0)
                for part_share in self._plan(blk[own], local, pinned):
                    pos = own[part_share.pos]
                    entry = [name, part_share.blocks, ints(rows[pos]), ints(pos)]
                    if part_share.mapped:
                        entry += self._addresses(name, part_share, fi.off[slots[pos]])
                    else:
                        unmapped.setdefault(part_share.unit, set()).update(part_share.uniq.tolist())
                    per_unit.setdefault(part_share.unit, []).append(entry)
            else:
                key = blk.tobytes()
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = self._plan(blk, local, pinned)
                for unit_share in plan:
                    entry = [name, unit_share.blocks, ints(rows[unit_share.pos]), unit_share.positions]
                    if unit_share.mapped:  # else the client reads them over ZMQ
                        entry += self._addresses(name, unit_share, fi.off[slots[unit_share.pos]])
                    else:
                        unmapped.setdefault(unit_share.unit, set()).update(unit_share.uniq.tolist())
                    per_unit.setdefault(unit_share.unit, []).append(entry)
            geoms[name] = fi.geometry(slots).to_wire()
            sizes[name] = ints(nbytes)
            digests[name] = fi.sums[slots].astype("<u8").tobytes()
        if missing:
            raise E.MissingDataError(p, missing)
        tagged = part.user[slots]
        user = tagged.tolist() if bool(np.not_equal(tagged, None).any()) else None  # None: no sample has tags
        out = {"units": [[u, entries] for u, entries in per_unit.items()], "user": user, "g": geoms, "nb": sizes,
               "h": digests, "pin_lease_s": self.pin_lease_s, "caps": self._read_caps(unmapped)}
        if twins:
            out["s"] = twins
        return out

    def _read_caps(self, unmapped: dict[int, set[int]]) -> list[list[Any]]:
        """Per unit ``[unit, [[block, capability], ...]]`` for the blocks a locate has the
        client read over ZMQ there (``unmapped``; a unit reads a block only for a holder of
        its capability; rows read out of a mapped slab need none); [] without a seal key."""
        if self.seal_key is None:
            return []
        return [[u, [[b, read_cap(self.seal_key, b, self.units[u][0])] for b in sorted(blocks)]]
                for u, blocks in unmapped.items()]

    def op_unpin(self, header: dict, columns: dict, extra: list) -> Any:
        """A read is done with the blocks its locate pinned (sent one-way)."""
        with self._lock:
            self.pins.unpin(header.get("pin"))
        return {}, {}, []

    def unsent(self, answer: dict[str, Any], header: dict[str, Any]) -> None:
        """An answer the server could not send (too big): the pin it carried is released
        (a claim's batch goes back by StreamOps.unsent)."""
        if isinstance(answer.get("pin"), str):
            with self._lock:
                self.pins.unpin(answer["pin"])
        else:
            super().unsent(answer, header)  # type: ignore[misc]

    def op_renew(self, header: dict, columns: dict, extra: list) -> Any:
        """Extend pins (a zero-copy read whose views are still alive); answers the ones that
        are gone. ``pb`` (optional): each pin's blocks as its locate named them (int64
        bytes), for a restarted controller to take up the pins it does not know."""
        pins = header.get("pins")
        if not isinstance(pins, list) or len(pins) > MAX_PINS:
            raise E.WireFormatError("renew needs 'pins': a list of pin ids")
        named = header.get("pb")
        if named is not None and (not isinstance(named, list) or len(named) != len(pins)
                                  or not all(isinstance(b, bytes) and len(b) % 8 == 0 for b in named)):
            raise E.WireFormatError("renew's 'pb' must give each pin's blocks as int64 bytes")
        blocks = [int_array(b).tolist() for b in named] if named is not None else None
        with self._lock:
            before = self.pins.taken_up
            gone = self.pins.renew(pins, blocks, stored=self._block_units.__contains__, units=tuple(range(len(self.units))))
            if self.pins.taken_up > before:
                log.info("took up %d pins of zero-copy views held across a restart", self.pins.taken_up - before)
        return {"gone": gone}, {}, []

    def _copy_for(self, b: int, local: set[int]) -> int:
        """The copy of block ``b`` a read uses: one on a unit the client mapped, if any; a
        copy on a suspect unit only when there is no other."""
        units = self._block_units[b]
        if self._suspect and len(units) > 1:
            units = tuple(u for u in units if u not in self._suspect) or units
        if local:
            for u in units:
                if u in local and u in self._block_ext.get(b, ({}, {}))[1]:
                    return u
        return units[0]

    def _plan(self, blk: np.ndarray, local: set[int], pinned: set[int]) -> list[_Share]:
        """Which unit each requested row of blocks ``blk`` is read from, as one share per
        unit (the blocks named are added to ``pinned``)."""
        uniq, which = groups(blk)
        pinned.update(uniq.tolist())
        first = [self._copy_for(b, local) for b in uniq.tolist()]
        unit_of = np.array(first, np.int64)[which]
        plan = []
        for u in groups(unit_of)[0].tolist():
            pos = np.flatnonzero(unit_of == u) if len(first) > 1 else np.arange(unit_of.size)
            ub, uw = groups(blk[pos])
            mapped = u in local and all(u in self._block_ext.get(b, ({}, {}))[1] for b in ub.tolist())
            plan.append(_Share(u, pos, ints(blk[pos]), ints(pos), mapped, ub, uw))
        return plan

    def _addresses(self, name: str, share: _Share, off: np.ndarray) -> list[Any]:
        """``[slab address of each row, dtype]`` of field ``name``'s rows in ``share``."""
        bases = np.empty(share.uniq.size, np.int64)
        dtypes = set()
        for k, b in enumerate(share.uniq.tolist()):
            dt, where = self._block_ext.get(b, ({}, {}))
            start = where.get(share.unit, {}).get(name)
            if start is None:
                raise E.MissingDataError("(locate)", {}, hint=f"the extent of field {name!r} of block {b} on "
                                         f"{self.units[share.unit][0]} is not known (written by an older client?)")
            bases[k] = start
            dtypes.add(dt[name])
        if len(dtypes) > 1:
            raise E.ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
        return [ints(bases[share.which] + off), dtypes.pop()]

    # -- housekeeping --------------------------------------------------------------------


class _Share(NamedTuple):
    """The rows of a locate one unit serves: their positions in the request (``pos``, and
    as the wire's ``positions``), their ``blocks`` (wire), whether the client reads them at
    their addresses (``mapped``), and the distinct blocks with each row's index in them."""

    unit: int
    pos: np.ndarray
    blocks: Any
    positions: Any
    mapped: bool
    uniq: np.ndarray
    which: np.ndarray


def first_twins(blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For each requested row at ``(blocks, rows)``, the first earlier position naming the
    same stored row (-1: it is the first).

    Example: ``first_twins(np.array([5, 5, 5]), np.array([0, 0, 1]))`` -> ``array([-1, 0, -1])``.
    """
    _, first, which = np.unique(np.stack([blocks, rows], axis=1), axis=0, return_index=True, return_inverse=True)
    src = first[which.reshape(-1)]
    return np.where(src == np.arange(src.size), -1, src).astype(np.int64)


def groups(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)``, without its sort when every value is the
    same (a read of one put's rows names one block on one unit: the usual case).

    Example: ``groups(np.array([7, 7, 7]))`` -> ``(array([7]), array([0, 0, 0]))``.
    """
    if a.size and bool((a == a[0]).all()):
        return a[:1].copy(), np.zeros(a.size, np.intp)
    uniq, which = np.unique(a, return_inverse=True)
    return uniq, which.reshape(-1)


__all__ = ["ReadOps", "groups", "first_twins"]
