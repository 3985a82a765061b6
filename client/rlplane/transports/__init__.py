"""Transports move encoded columns; ``Transport`` is the interface, ``MemoryTransport`` the reference."""

from rlplane.transports.base import PartitionInfo, Transport
from rlplane.transports.memory import MemoryTransport

__all__ = ["Transport", "PartitionInfo", "MemoryTransport"]
