"""Names for torch dtypes on the wire and in the registry ("float32", "bfloat16", ...).

Example::

    >>> dtype_from_name("bfloat16")
    torch.bfloat16
    >>> dtype_name(torch.int64)
    'int64'
"""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a wire name (a torch dtype passes through); ValueError if unknown."""
    if isinstance(name, torch.dtype):
        if name not in _BY_DTYPE:
            raise ValueError(f"dtype {name} is not supported on the wire; use one of {sorted(_BY_NAME)}")
        return name
    if not isinstance(name, str):
        raise ValueError(f"a dtype name must be a string like 'float32', got {name!r}")
    key = name.removeprefix("torch.")
    try:
        return _BY_NAME[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_BY_NAME)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32"); ValueError if it cannot travel."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire; use one of {sorted(_BY_NAME)}") from None
