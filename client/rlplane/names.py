"""The names a caller gives rlplane, and their limits (the client, the HTTP service and
the native engine check the same rules).

- a partition name: 1-200 characters of letters, digits and ``_ . : @ = + -``;
- a task name (a consumer of a partition): 1-200 characters;
- a sample id: 1-512 characters.

Example::

    check_partition("step-0")          # fine
    check_partition("../etc")          # InvalidArgumentError
"""

from __future__ import annotations

import re
from typing import Any

from rlplane.errors import InvalidArgumentError

MAX_NAME_LEN = 200
MAX_ID_LEN = 512

_PARTITION = re.compile(r"[A-Za-z0-9_.:@=+\-]{1,200}")


def check_partition(partition: Any) -> None:
    """InvalidArgumentError unless ``partition`` is a legal partition name."""
    if not isinstance(partition, str) or not _PARTITION.fullmatch(partition):
        raise InvalidArgumentError(
            f"partition name {str(partition)[:80]!r} must be 1-200 characters of letters, digits and _ . : @ = + -"
        )


def check_task(task: Any) -> None:
    """InvalidArgumentError unless ``task`` is a string of 1-200 characters."""
    if not isinstance(task, str) or not 0 < len(task) <= MAX_NAME_LEN:
        raise InvalidArgumentError(f"task name {str(task)[:80]!r} must be 1-{MAX_NAME_LEN} characters")


__all__ = ["MAX_NAME_LEN", "MAX_ID_LEN", "check_partition", "check_task"]
