"""Scratch: encode buffers a client reuses from one put to the next.

Encoding a multimodal batch writes its pixels once more (cast to the stored dtype). Into
fresh memory that costs a page fault per page on first touch, which dominates the cast:
168 MB of vlm-step pixels took ~190 ms into new memory and ~12 ms into memory touched
before (2-core VM). A client therefore keeps the last put's buffer of each field and
casts into it next time. Transports never keep references to the columns they were
given once ``put`` returns (they copy), so a buffer is free again after the put.

Each ``lease()`` hands out the buffers exclusively: a concurrent put of the same client
allocates its own, and the larger of the two is kept afterwards.

Example::

    scratch = Scratch()
    with scratch.lease() as alloc:
        enc = encode(registry, fields, lengths, alloc=alloc)
        transport.put(partition, ids, enc.columns, enc.tags, create=True)
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

#: ``alloc(field, numel, dtype)``: a 1-D CPU tensor of ``numel`` elements to encode ``field`` into.
Alloc = Callable[[str, int, torch.dtype], torch.Tensor]


class Scratch:
    """Per-field reusable buffers, at most ``max_bytes`` kept between puts."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[str, torch.Tensor] = {}

    @contextmanager
    def lease(self) -> Iterator[Alloc]:
        """An ``alloc`` backed by the kept buffers; they are kept again when the block ends."""
        with self._lock:
            held, self._free = self._free, {}
        used: dict[str, torch.Tensor] = {}

        def alloc(field: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            buf = used.get(field)  # a field is encoded once per put; a second ask gets new memory
            if buf is not None:
                return torch.empty(numel, dtype=dtype)
            buf = held.pop(field, None)
            if buf is None or buf.dtype != dtype or buf.numel() < numel:
                buf = torch.empty(numel, dtype=dtype)
            used[field] = buf
            return buf[:numel]

        try:
            yield alloc
        finally:
            self._keep({**held, **used})

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._free.values())

    def _keep(self, bufs: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for field, buf in bufs.items():
                old = self._free.get(field)
                if old is None or buf.numel() * buf.element_size() > old.numel() * old.element_size():
                    self._free[field] = buf
            total = 0
            for field in sorted(self._free, key=lambda f: self._free[f].numel() * self._free[f].element_size()):
                total += self._free[field].numel() * self._free[field].element_size()
                if total > self.max_bytes:
                    del self._free[field]


__all__ = ["Alloc", "Scratch"]
