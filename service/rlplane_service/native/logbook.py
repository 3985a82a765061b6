"""Which commit-log entries a rebuild still needs, so the storage units can forget the rest.

The units keep the controller's commit log (:mod:`~rlplane_service.native.commitlog`) so a
restarted controller can rebuild its index. A whole clear of a partition makes them drop
its older entries; a partition that lives all run and is cleared sample by sample (a
streaming buffer: put, claim, train, clear what was trained on) would otherwise keep every
put's and clear's record for as long as it lives, in every unit's memory, and a rebuild
would replay all of them. The controller keeps this book and tells the units to forget an
entry once replaying it would change nothing:

- a **put's record** is needed while a block it wrote is still referenced by some row (its
  rows are read, or a later put's rows share them), and, for a put of new samples or one
  that set user tags, while one of the samples it names is still stored (the rebuild must
  create them, and keep their tags);
- a **clear's record** is needed while a put's record that names one of the samples it
  cleared may still be on a unit (replayed without the clear, that put would bring the
  samples back); a **whole clear's** (which made the units drop the partition's older
  records) while a unit may not have taken it: one that every unit that is not lost took
  has nothing left to undo.

A put's record counts as gone only once every unit that is not lost has confirmed it
forgot it (a unit that missed the message would otherwise give it back to a rebuild after
the clear that undid it was forgotten); entries that may not yet be on the units (staged
by a batch that is still being written) are never named. Samples are tracked as slots of
their partition's index (a slot is never reused: a sample cleared and put again has a new
one; a renumbering of the slots, ``Partition.repack``, renumbers the book's too), with one counter per slot of the put records still on the units that name it
(:attr:`Partition.logged`), so nothing here loops over samples.

Example::

    book = LogBook()
    book.put(7, part, slots, blocks=[1234], pins=True)    # a commit, as it is applied
    book.blocks_gone([1234]); part.state[slots] = FREE      # later: its samples were cleared
    book.forgettable(below=8)                               # [7]: the units may drop it
    book.forgotten([7])                                     # every unit did
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from rlplane_service.native.commitlog import MAX_FORGET
from rlplane_service.native.index import COMMITTED, Partition


@dataclass(slots=True)
class _Put:
    part: Partition
    slots: np.ndarray
    pins: bool  # a put of new samples, or one that set user tags: needed while a sample it names is stored
    blocks: int  # blocks it wrote that some row still points at
    seen: int = -1  # the partition's ``forgets`` when its samples were last found stored


@dataclass(slots=True)
class _Clear:
    part: Partition
    slots: np.ndarray


class LogBook:
    """The controller's record of the commit-log entries the units still hold that a
    rebuild needs (see the module docstring). Not thread-safe: used under the controller's lock."""

    def __init__(self) -> None:
        self._puts: dict[int, _Put] = {}
        self._clears: dict[int, _Clear] = {}
        self._block_seq: dict[int, int] = {}  # block id -> the put record that wrote it
        self._idle: set[int] = set()  # put records none of whose blocks is referenced any more
        self._drops: set[int] = set()  # whole clears every unit took: nothing left for them to undo
        self._of_part: dict[int, set[int]] = {}  # id(partition) -> its records (a whole clear drops them)
        self.forgot = 0  # entries the units were told to forget, in all

    def __len__(self) -> int:
        return len(self._puts) + len(self._clears) + len(self._drops)

    def put(self, seq: int, part: Partition, slots: np.ndarray, blocks: Iterable[int], pins: bool) -> None:
        """Put record ``seq`` was applied: it names ``slots`` of ``part`` and wrote ``blocks``."""
        blocks = list(blocks)
        self._puts[seq] = _Put(part, slots.copy(), pins, len(blocks))
        part.logged[slots] += 1
        for b in blocks:
            self._block_seq[b] = seq
        if not blocks:
            self._idle.add(seq)
        self._of_part.setdefault(id(part), set()).add(seq)

    def blocks_gone(self, bids: Iterable[int]) -> None:
        """No row points at ``bids`` any more (the controller dropped them)."""
        for b in bids:
            seq = self._block_seq.pop(b, None)
            rec = self._puts.get(seq) if seq is not None else None
            if rec is not None:
                rec.blocks -= 1
                if rec.blocks <= 0:
                    self._idle.add(seq)  # type: ignore[arg-type]

    def cleared(self, seq: int, part: Partition, slots: np.ndarray, *, whole: bool, everywhere: bool = False) -> None:
        """Clear record ``seq`` was applied to ``slots`` of ``part``; ``whole``: it cleared the
        whole partition, and the units drop its older records themselves; ``everywhere``:
        every unit that is not lost took that record, so none holds an older record of the
        partition for it to undo, and it may go too."""
        if whole:
            for old in self._of_part.pop(id(part), ()):
                self._drop(old)
            if everywhere:
                self._drops.add(seq)
            return
        self._clears[seq] = _Clear(part, slots.copy())
        self._of_part.setdefault(id(part), set()).add(seq)

    def renumber(self, part: Partition, remap: np.ndarray) -> None:
        """``part`` renumbered its slots (old -> new in ``remap``, -1: gone). Every slot a put
        record names is kept (it counts in :attr:`Partition.logged`); a clear's slots that
        went are ones no put record names any more, which is all a clear is kept for."""
        for seq in self._of_part.get(id(part), ()):
            rec = self._puts.get(seq)
            if rec is not None:
                rec.slots = remap[rec.slots]
            else:
                new = remap[self._clears[seq].slots]
                self._clears[seq].slots = new[new >= 0]

    def forgettable(self, below: int, limit: int = MAX_FORGET) -> list[int]:
        """Entries below sequence number ``below`` (those above may not be on the units yet)
        that a rebuild no longer needs, at most ``limit``, oldest first."""
        out: list[int] = []
        for seq in sorted(self._idle):
            if seq >= below or len(out) >= limit:
                break
            rec = self._puts[seq]
            if rec.pins and rec.seen != rec.part.forgets:  # only a clear since the last look can change it
                if bool((rec.part.state[rec.slots] == COMMITTED).any()):
                    rec.seen = rec.part.forgets
                    continue
            elif rec.pins:
                continue
            out.append(seq)
        for seq, c in self._clears.items():
            if len(out) >= limit:
                break
            if seq < below and not (c.slots.size and bool(c.part.logged[c.slots].any())):
                out.append(seq)
        out += [seq for seq in sorted(self._drops) if seq < below][: max(0, limit - len(out))]
        return out

    def forgotten(self, seqs: Iterable[int]) -> None:
        """Every unit that is not lost forgot ``seqs``."""
        for seq in seqs:
            if self._drop(seq):
                self.forgot += 1

    def _drop(self, seq: int) -> bool:
        if seq in self._drops:
            self._drops.discard(seq)
            return True
        rec = self._puts.pop(seq, None)
        if rec is not None:
            rec.part.logged[rec.slots] -= 1
            self._idle.discard(seq)
            part = rec.part
        else:
            c = self._clears.pop(seq, None)
            if c is None:
                return False
            part = c.part
        mine = self._of_part.get(id(part))
        if mine is not None:
            mine.discard(seq)
            if not mine:
                del self._of_part[id(part)]
        return True

    def stats(self) -> dict[str, int]:
        return {"puts": len(self._puts), "clears": len(self._clears), "drops": len(self._drops), "forgot": self.forgot}


__all__ = ["LogBook"]
