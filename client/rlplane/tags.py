"""Sample tags: the user's scalars plus rlplane's reserved entries (wire geometry).

Torch-free, so the store's index processes (controller, ledger) can read them.

Example::

    merge_tags({"_rlplane_wire": {"a": [3]}}, {"_rlplane_wire": {"b": [2]}})
"""

from __future__ import annotations

from typing import Any, Mapping

#: Reserved key in each sample's tags: ``{field: geometry}`` for every field written.
#: Geometry is a shape list for dense and object fields and
#: ``{"d": dim_to_pack, "p": pad_to_max_shape, "s": [segment shapes]}`` for packed ones.
WIRE_TAG = "_rlplane_wire"

#: Tag keys starting with this prefix belong to rlplane (wire geometry, transport
#: bookkeeping); user tags may not use them. Their values merge key by key over writes.
RESERVED_TAG_PREFIX = "_rlplane"


def merge_tags(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """One sample's tags after a write: ``new`` wins; rlplane's reserved entries (wire
    geometry, transport bookkeeping) merge field by field.

    Example: ``merge_tags(stored, enc.tags[i])``.
    """
    out = dict(old)
    for key, value in new.items():
        if isinstance(key, str) and key.startswith(RESERVED_TAG_PREFIX) and isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


__all__ = ["WIRE_TAG", "RESERVED_TAG_PREFIX", "merge_tags"]
