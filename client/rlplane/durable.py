"""Files that survive a power cut: written, fsynced, and their directory entry fsynced
(shared by snapshots and the journal; no torch, so a storage unit may import it).

Example::

    replace_durably(Path("/var/lib/rlplane/journal/u0/BASE"), b'{"seq": 12}')
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files made, renamed, deleted) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a temporary file, fsynced, renamed over it,
    the directory fsynced. A reader sees the old contents or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_durably(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


__all__ = ["fsync_dir", "write_durably", "replace_durably"]
