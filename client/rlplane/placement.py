"""Where a block's copies go: distinct storage units, on distinct nodes when there are several.

The native transport picks the units of each block it writes (in turn, over the live
units), and the controller picks where a lost copy is made again; both ask :func:`spread`.
"""

from __future__ import annotations

from typing import Sequence


def spread(units: Sequence[int], endpoints: Sequence[str], k: int, taken: Sequence[str] = ()) -> list[int]:
    """The first ``k`` of ``units`` (in order), preferring units whose host (in
    ``endpoints``, one per unit) holds no copy yet, neither in ``taken`` (endpoints already
    holding one) nor among those picked: a block's copies land on distinct nodes when
    there are several.

    Example: ``spread([0, 1, 2], ["tcp://a:1", "tcp://a:2", "tcp://b:1"], 2) == [0, 2]``.
    """
    used = {_host(e) for e in taken}
    picked: list[int] = []
    for u, e in zip(units, endpoints):
        if len(picked) < k and _host(e) not in used:
            picked.append(u)
            used.add(_host(e))
    for u in units:
        if len(picked) < k and u not in picked:
            picked.append(u)
    return picked


def _host(endpoint: str) -> str:
    return endpoint.rpartition(":")[0]


__all__ = ["spread"]
