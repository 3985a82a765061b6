"""rlplane: the data plane for RL post-training — declared fields, bit-exact round trips.

``import rlplane`` never imports Ray.

Example::

    import rlplane
    client = rlplane.connect("http://127.0.0.1:8000")       # a running service (rlplane serve)
    meta = client.put_samples("step-0", {"input_ids": ids, "input_lengths": lens})
"""

from rlplane import errors
from rlplane.client import Client
from rlplane.codec import decode, encode
from rlplane.column import Column
from rlplane.connect import connect
from rlplane.fields import FieldSpec, Registry, default_registry
from rlplane.meta import SampleMeta
from rlplane.packed import PackedTensor

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
