"""Partial rollouts: what ``Client.extend`` appends, checked, and the rows it writes.

An asynchronous RL loop interrupts generations at a weight update and resumes them
later; the rollout stores what it has so far (``put_samples(..., finished=False)``) and
appends the rest as it comes (``Client.extend``). This module holds the two pure steps
of an extend: :func:`token_fields` checks which fields an extension must carry (every
token field the samples hold, and nothing else), and :class:`Appending` builds each
field's rows, packed, with the new tokens after the stored ones, for every sample at once
(two masked copies over the tokens; rows of thousands of tokens go instead as a copy of
bytes per sample, which costs less than the masked copy of its tokens).

Example::

    plan = Appending(stored_lengths, new_lengths)
    rows = plan.rows(stored, new)          # per token field; plan.lengths: the new lengths
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from rlplane.copies import copy_ranges
from rlplane.errors import ShapeError
from rlplane.fields import LENGTHS_FIELD, Registry


def token_fields(registry: Registry, held: Iterable[str], given: Mapping[str, Any]) -> list[str]:
    """The token fields an extension appends to: every token field the samples hold
    (``held``) must be given, and only those (ShapeError naming the field otherwise).

    Example: ``token_fields(reg, meta.fields, {"input_ids": x, "input_lengths": n})``.
    """
    have = sorted(f for f in held if f in registry and registry.get(f).alignment == "token")
    if not have:
        raise ShapeError("these samples hold no token field to extend (extend appends along the sequence of the token "
                         "fields written by put_samples)")
    if LENGTHS_FIELD not in given or given[LENGTHS_FIELD] is None:
        raise ShapeError("extend needs the number of tokens appended to each sample", field=LENGTHS_FIELD)
    for name, value in given.items():
        if name == LENGTHS_FIELD:
            continue
        spec = registry.get(name)
        if spec.alignment != "token":
            raise ShapeError(f"extend appends along the sequence; this is a {spec.alignment} field: write it with "
                             "write_columns", field=name)
        if name not in have:
            raise ShapeError("these samples hold no such token field yet: a token field starts with the samples, at "
                             "put_samples(..., finished=False), and is extended with the others", field=name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            raise ShapeError(f"extend takes the appended tokens as a [batch, tokens, ...] tensor, got "
                             f"{type(value).__name__}", field=name)
    missing = [f for f in have if f not in given]
    if missing:
        raise ShapeError(f"every token field the samples hold is extended together ({', '.join(have)}); this one was "
                         "not given", field=missing[0])
    return have


class Appending:
    """One extend's plan: where each sample's new tokens go after its stored ones, worked
    out once for all the token fields it extends (they share the samples' lengths); then
    :meth:`rows` per field. Packed rows throughout (``[sum(lengths), ...]``, the samples
    one after another, as a put stores them): no padding is built or dropped.

    Example::

        plan = Appending(torch.tensor([2, 1]), torch.tensor([1, 1]))
        plan.rows(torch.tensor([1, 2, 3]), torch.tensor([[9], [8]]))   # tensor([1, 2, 9, 3, 8])
        plan.lengths                                                   # tensor([3, 2])
    """

    def __init__(self, stored_lengths: torch.Tensor, new_lengths: torch.Tensor) -> None:
        self.old_n, self.add_n = stored_lengths.to(torch.int64).reshape(-1), new_lengths.to(torch.int64).reshape(-1)
        self.lengths = self.old_n + self.add_n
        self.total, self.n_new = int(self.lengths.sum()), int(self.add_n.sum())
        self._stored_at: np.ndarray | None = None
        self._picks: dict[int, torch.Tensor | None] = {}

    def rows(self, stored: torch.Tensor, new: torch.Tensor, *, field: str | None = None,
             into: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
        """The grown rows of one field: ``stored`` its stored tokens packed (as a packed read
        gives them), ``new`` the new ones ``[B, T, ...]`` (each row's first ``new_lengths``
        count) or a jagged NestedTensor, cast to the stored dtype as a put of the whole
        sequence would have cast them. ``into(numel, dtype)`` gives the flat buffer they are
        written to (e.g. the extent a put lands in; default a new tensor). ShapeError naming
        ``field`` when ``new`` does not fit."""
        rows = self._new_rows(new, field).to(stored.dtype)
        if stored.shape[1:] != rows.shape[1:]:
            raise ShapeError(f"appended tokens of shape [.., {list(rows.shape[1:])}] after stored ones of "
                             f"[.., {list(stored.shape[1:])}]", field=field)
        inner = math.prod(stored.shape[1:])
        numel = self.total * inner
        out = (into(numel, stored.dtype) if into is not None else torch.empty(numel, dtype=stored.dtype)).view(
            -1, *stored.shape[1:])
        width = stored.element_size() * inner  # bytes per token
        if not width or not self.total:
            return out
        if self.total >= _RUN_TOKENS * self.lengths.numel():  # long rows: each sample's two runs copied whole
            grown, old_n = _starts(self.lengths), self.old_n.numpy()
            dst = _bytes(out)
            copy_ranges(dst, grown * width, _bytes(stored), _starts(self.old_n) * width, old_n * width)
            copy_ranges(dst, (grown + old_n) * width, _bytes(rows), _starts(self.add_n) * width,
                        self.add_n.numpy() * width)
        else:  # two masked copies on the values' bit patterns (bit-exact for every dtype)
            keep = self._stored_positions()
            dst = _tokens(out, width)
            dst[keep] = _tokens(stored, width)
            dst[~keep] = _tokens(rows, width)
        return out

    def _stored_positions(self) -> np.ndarray:
        """Which of the grown rows' tokens are stored ones (the rest: each sample's new
        tokens, right after its stored ones)."""
        if self._stored_at is None:
            starts = torch.cumsum(self.lengths, 0) - self.lengths + self.old_n  # each sample's first new token
            firsts = torch.cumsum(self.add_n, 0) - self.add_n
            at = torch.arange(self.n_new) + torch.repeat_interleave(starts - firsts, self.add_n, output_size=self.n_new)
            self._stored_at = np.ones(self.total, bool)
            self._stored_at[at.numpy()] = False
        return self._stored_at

    def _new_rows(self, new: torch.Tensor, field: str | None) -> torch.Tensor:
        """The new tokens packed, checked against the new lengths."""
        b, add_n = self.add_n.numel(), self.add_n
        if new.is_nested and getattr(new, "_lengths", None) is None:
            offsets = new.offsets().to("cpu", torch.int64)
            got = torch.diff(offsets)
            if got.numel() != b:
                raise ShapeError(f"a jagged tensor of {got.numel()} samples to append to {b}", field=field)
            if bool((got != add_n).any()):
                i = int(torch.argmax((got != add_n).to(torch.int8)))
                raise ShapeError(f"{int(got[i])} tokens to append to sample #{i} where input_lengths says "
                                 f"{int(add_n[i])}", field=field)
            return new.values()[int(offsets[0]):int(offsets[-1])]
        if new.is_nested:  # a jagged tensor with holes (torch cannot pad those): its rows one by one, as encode does
            parts = new.unbind()
            got = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
            if got.numel() != b or bool((got != add_n).any()):
                raise ShapeError(f"a jagged tensor of rows of {got.tolist()[:8]} tokens to append where input_lengths "
                                 f"says {add_n.tolist()[:8]}", field=field)
            return torch.cat(parts) if parts else new.values()[:0]
        t = new.shape[1]
        if t not in self._picks:
            if b and int(add_n.max()) > t:
                i = int(torch.argmax(add_n))
                raise ShapeError(f"{int(add_n[i])} tokens to append to sample #{i} but the tensor's sequence dim is "
                                 f"{t}", field=field)
            self._picks[t] = None if not b or bool((add_n == t).all()) else \
                torch.arange(t)[None, :] < add_n[:, None]
        pick = self._picks[t]
        return (new if pick is None else new[pick]).reshape(-1, *new.shape[2:])


#: A token's bytes as one numpy item: an integer of its width where there is one (numpy's
#: masked copies of those run ~3x faster than of opaque items, and ~10x faster than of the
#: rows of a 2-D array).
_ITEMS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


#: Tokens per grown row (on average) from which an extend copies each sample's stored and new
#: tokens as two runs of bytes rather than by two masked copies over every token: a masked copy
#: costs ~1.5 ns a token, a run ~2 µs plus its bytes (64 rows of 12,800 tokens: int64 1.6 ->
#: 1.1 ms, float32 1.2 -> 0.8 ms; of 1,024 tokens the runs cost 3x more; measured 2026-12-06).
_RUN_TOKENS = 4096


def _bytes(t: torch.Tensor) -> np.ndarray:
    """``t`` (CPU, contiguous or made so) as its bytes, a flat uint8 array."""
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()  # (1-D first: a token may span several dims)


def _starts(lengths: torch.Tensor) -> np.ndarray:
    """Where each row starts when rows of ``lengths`` lie one after another (int64)."""
    n = lengths.numpy().astype(np.int64)
    return np.cumsum(n) - n


def _tokens(t: torch.Tensor, width: int) -> np.ndarray:
    """``t`` (CPU, ``width`` bytes per token, contiguous or made so) as one numpy item per token."""
    return _bytes(t).view(_ITEMS.get(width) or np.dtype((np.void, width)))


__all__ = ["token_fields", "Appending"]
