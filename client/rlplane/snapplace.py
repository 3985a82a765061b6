"""Where a snapshot is written and read: a local directory, or any fsspec URL.

A snapshot is a directory of a few big files and a manifest written last. :func:`place`
answers the directory the caller named as a :class:`Local` one (a path, or ``file://``)
or a :class:`Remote` one (``s3://``, ``gs://``, ``memory://``, ... through the ``fsspec``
package and that scheme's driver). Locally a snapshot is written under a hidden temporary
name, every file and the directory fsynced, then renamed into place. Remotely it is
written into place (a move on an object store is a copy of every byte), the manifest
last: a reader that finds the manifest finds every file it lists, and one that does not
finds no snapshot; a failed one is removed. A remote writer first leaves a marker of its
own there and refuses the place when it finds anything else (another writer's marker, or
files): two snapshots to one URL at once do not both succeed into one directory. A
restore reads a remote snapshot by copying its files into a local temporary directory
first (:meth:`Remote.fetched`): it needs that much room under ``TMPDIR``.

Example::

    where = place("memory://snaps/run-7")
    tmp = where.temporary()                 # remote: the place itself
    with tmp.open("part-00000.rlsnap") as f:
        f.write(b"...")
    tmp.put("manifest.json", b"{}")
    tmp.move_to(where, last="manifest.json")
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from rlplane import errors as E
from rlplane.durable import StreamedFile, fsync_dir, write_durably

log = logging.getLogger(__name__)


def is_url(path: Any) -> bool:
    """Whether ``path`` names a remote place (``scheme://...`` other than ``file://``)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def lasting(path: Any) -> bool:
    """Whether a snapshot at ``path`` outlives the process that wrote it (one at ``memory://``
    does not): only such a snapshot may stand in for the journal before it."""
    return not (is_url(path) and str(path).startswith("memory://"))


def local(path: str | os.PathLike[str]) -> Path:
    """The local path ``path`` names (a path, or a ``file://`` URL), absolute.

    Example: ``local("file:///srv/snaps/a") == Path("/srv/snaps/a")``."""
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text).resolve()


def place(path: str | os.PathLike[str]) -> Local | Remote:
    """The place ``path`` names (see the module docstring)."""
    if is_url(path):
        return Remote.of(str(path))
    return Local(local(path))


class Local:
    """A directory on this host's filesystem (local disk or a shared mount)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def check_new(self) -> None:
        """InvalidArgumentError unless a snapshot may be written here: it does not exist, its parent does."""
        if self.path.exists():
            raise E.InvalidArgumentError(f"{self.path} exists already: a snapshot goes to a new directory")
        if not self.path.parent.is_dir():
            raise E.InvalidArgumentError(f"{self.path.parent} is not a directory (make it first)")

    def temporary(self) -> Local:
        """A new hidden sibling to write into."""
        tmp = Local(self.path.parent / f".{self.path.name}.tmp-{secrets.token_hex(4)}")
        tmp.path.mkdir()
        return tmp

    def open(self, name: str) -> StreamedFile:
        """A new file ``name`` here, written around the page cache where it can be."""
        return StreamedFile(self.path / name)

    def put(self, name: str, data: bytes) -> None:
        """A small file ``name`` here, fsynced, and the directory fsynced."""
        write_durably(self.path / name, data)
        fsync_dir(self.path)

    def move_to(self, dest: Local, last: str | None = None) -> None:
        """Rename this directory to ``dest`` (durably; one rename, so ``last`` needs no order).
        InvalidArgumentError when ``dest`` came to exist meanwhile (another snapshot to the
        same path finished first)."""
        try:
            os.rename(self.path, dest.path)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                raise
            raise E.InvalidArgumentError(f"{dest.path} exists already (another snapshot to it finished first): a "
                                         "snapshot goes to a new directory") from None
        fsync_dir(dest.path.parent)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def fetched(self) -> Iterator[Path]:
        """The directory to read the snapshot from (this one)."""
        yield self.path


class _RemoteFile:
    """A file being written through fsspec, with :class:`StreamedFile`'s ``write`` and ``close``."""

    def __init__(self, f: Any) -> None:
        self._f, self._size, self._closed = f, 0, False

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._size += view.nbytes

    def close(self) -> int:
        if not self._closed:
            self._closed = True
            self._f.close()
        return self._size

    def __enter__(self) -> _RemoteFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._f.close()


class Remote:
    """A directory on an fsspec filesystem."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs, self.path, self.url = fs, path.rstrip("/"), url
        self._written: list[str] = []  # what this writer made here (its marker first)

    @classmethod
    def of(cls, url: str) -> Remote:
        try:
            import fsspec
        except ImportError:  # pragma: no cover - fsspec comes with torch
            raise E.InvalidArgumentError(f"{url}: snapshots at URLs need the fsspec package (pip install fsspec)") \
                from None
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as err:
            raise E.InvalidArgumentError(f"{url}: no filesystem for this URL ({err}); install its fsspec driver "
                                         "(e.g. s3fs, gcsfs, adlfs)") from None
        return cls(fs, path, url)

    def __str__(self) -> str:
        return self.url

    def _child(self, name: str) -> str:
        return str(PurePosixPath(self.path) / name)

    def check_new(self) -> None:
        """InvalidArgumentError unless a snapshot may be written here: a directory below the
        filesystem's root that does not exist (or the filesystem cannot be reached)."""
        if PurePosixPath(self.path).name in ("", ".") or str(PurePosixPath(self.path).parent) in ("", "."):
            raise E.InvalidArgumentError(f"{self.url}: name a new directory inside the filesystem or bucket, not "
                                         "its root")
        try:
            there = self.fs.exists(self.path)
        except Exception as err:  # noqa: BLE001 - a driver's own errors (credentials, network), named
            raise E.InvalidArgumentError(f"{self.url} cannot be reached ({type(err).__name__}: {err})") from None
        if there:
            raise E.InvalidArgumentError(f"{self.url} exists already: a snapshot goes to a new directory")

    def temporary(self) -> Remote:
        """The place itself (see the module docstring), made and claimed by a marker of this
        writer's: InvalidArgumentError (and nothing of it left) when anything else is there."""
        self.fs.makedirs(self.path, exist_ok=True)
        marker = self._child(f".rlplane-writing-{secrets.token_hex(8)}")
        self.fs.pipe_file(marker, b"")
        self._written = [marker]
        mine = PurePosixPath(marker).name
        if any(PurePosixPath(n).name != mine for n in self.fs.ls(self.path, detail=False)):
            self.discard()
            raise E.InvalidArgumentError(f"{self.url}: another snapshot is being written there (or was): a snapshot "
                                         "goes to a new directory")
        return self

    def open(self, name: str) -> _RemoteFile:
        self._written.append(self._child(name))
        return _RemoteFile(self.fs.open(self._child(name), "wb"))

    def put(self, name: str, data: bytes) -> None:
        self._written.append(self._child(name))
        self.fs.pipe_file(self._child(name), data)

    def move_to(self, dest: Remote, last: str | None = None) -> None:
        """Nothing to move: written in place, ``last`` (the manifest) after the rest; the
        writer's marker goes."""
        if dest.path != self.path:
            raise ValueError(f"a remote snapshot is written in place, not moved to {dest}")
        if self._written:
            try:
                self.fs.rm(self._written[0])
            except FileNotFoundError:
                pass
            except Exception as err:  # noqa: BLE001 - complete with its manifest; a restore never lists the marker
                log.warning("could not remove the writer's marker %s of the snapshot: %s", self._written[0], err)

    def discard(self) -> None:
        """Remove what this writer wrote of a snapshot that failed (it had no manifest: no
        reader took it), and the directory if nothing else is in it."""
        try:
            for path in reversed(self._written):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(path)
            if not self.fs.ls(self.path, detail=False):
                self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as err:  # noqa: BLE001 - the failure being raised is the one to report
            log.warning("could not remove the failed snapshot %s: %s", self.url, err)

    @contextlib.contextmanager
    def fetched(self) -> Iterator[Path]:
        """The snapshot's files copied into a local temporary directory (removed after)."""
        if not self.fs.isdir(self.path):
            raise E.SnapshotError(f"{self.url} is not a snapshot directory (nothing is there)", component=self.url)
        local = Path(tempfile.mkdtemp(prefix="rlplane-restore-"))
        try:
            for remote in self.fs.ls(self.path, detail=False):
                name = PurePosixPath(remote).name
                if self.fs.isfile(remote):
                    self.fs.get_file(remote, str(local / name))
            yield local
        finally:
            shutil.rmtree(local, ignore_errors=True)


__all__ = ["is_url", "lasting", "local", "place", "Local", "Remote"]
