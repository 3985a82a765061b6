"""rlplane: the data plane for RL post-training — declared fields, bit-exact round trips.

``import rlplane`` never imports Ray.

Example::

    import rlplane
    reg = rlplane.default_registry()
    pt = rlplane.PackedTensor([torch.randn(16, 1176), None])
"""

from rlplane import errors
from rlplane.client import Client
from rlplane.codec import decode, encode
from rlplane.column import Column
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
    "Column",
    "encode",
    "decode",
]
