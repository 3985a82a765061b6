"""rlplane: the data plane for RL post-training — declared fields, bit-exact round trips.

``import rlplane`` never imports Ray.

Example::

    import rlplane
    client = rlplane.connect("http://127.0.0.1:8000")       # a running service (rlplane serve)
    meta = client.put_samples("step-0", {"input_ids": ids, "input_lengths": lens})
"""

from importlib import import_module
from typing import Any

from rlplane import errors
from rlplane.connect import connect  # eager: the module of the same name must not shadow the function

#: Public names and the modules they live in, imported on first use: a process that
#: only speaks the engine's wire (a storage unit) never loads torch through ``rlplane``.
_LAZY = {
    "Client": "rlplane.client", "decode": "rlplane.codec", "encode": "rlplane.codec", "Column": "rlplane.column",
    "FieldSpec": "rlplane.fields", "Registry": "rlplane.fields",
    "default_registry": "rlplane.fields", "SampleMeta": "rlplane.meta", "PackedTensor": "rlplane.packed",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlplane' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__version__ = "0.1.0"

__all__ = [
    "errors",
    "FieldSpec",
    "Registry",
    "default_registry",
    "PackedTensor",
    "SampleMeta",
    "Client",
    "connect",
    "Column",
    "encode",
    "decode",
]
