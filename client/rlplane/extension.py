"""Partial rollouts: what ``Client.extend`` appends, checked, and the rows it writes.

An asynchronous RL loop interrupts generations at a weight update and resumes them
later; the rollout stores what it has so far (``put_samples(..., finished=False)``) and
appends the rest as it comes (``Client.extend``). This module holds the two pure steps
of an extend: :func:`token_fields` checks which fields an extension must carry (every
token field the samples hold, and nothing else), and :func:`appended` builds each
field's rows with the new tokens after the stored ones, for every sample at once (no
loop over samples).

Example::

    rows, lengths = appended(stored, stored_lengths, new, new_lengths)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

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


def appended(stored: torch.Tensor, stored_lengths: torch.Tensor, new: torch.Tensor,
             new_lengths: torch.Tensor, *, field: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[B, L, ...]`` holding each sample's stored tokens then its new ones, and the
    lengths (past a sample's length a row holds padding, which is not stored); ``new`` is
    cast to the stored dtype, as a put of the whole sequence would have cast it.

    Example::

        rows, lengths = appended(torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 1]),
                                 torch.tensor([[9], [8]]), torch.tensor([1, 1]))
        # rows [[1, 2, 9], [3, 8, 0]], lengths [3, 2]
    """
    if stored.shape[2:] != new.shape[2:]:
        raise ShapeError(f"appended tokens of shape [.., {list(new.shape[2:])}] after stored ones of "
                         f"[.., {list(stored.shape[2:])}]", field=field)
    b, t = new.shape[0], new.shape[1]
    if b and int(new_lengths.max()) > t:
        i = int(torch.argmax(new_lengths))
        raise ShapeError(f"{int(new_lengths[i])} tokens to append to sample #{i} but the tensor's sequence dim is {t}",
                         field=field)
    lengths = stored_lengths + new_lengths
    width = int(lengths.max()) if b else 0
    out = torch.zeros((b, width, *stored.shape[2:]), dtype=stored.dtype)
    keep = min(stored.shape[1], width)
    out[:, :keep] = stored[:, :keep]
    step = torch.arange(t)
    mask = step[None, :] < new_lengths[:, None]
    rows = torch.arange(b)[:, None].expand(b, t)
    out[rows[mask], (stored_lengths[:, None] + step[None, :])[mask]] = new[mask].to(stored.dtype)
    return out, lengths


__all__ = ["token_fields", "appended"]
