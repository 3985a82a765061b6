"""Names for torch dtypes on the wire and in the registry ("float32", "bfloat16", ...).

The names and their numpy equivalents need no torch (a storage unit never imports it:
~190 MB of resident memory per process); the torch dtypes are looked up on first use.

Example::

    >>> dtype_from_name("bfloat16")
    torch.bfloat16
    >>> dtype_name(torch.int64)
    'int64'
    >>> numpy_of("bfloat16")   # bfloat16 travels as its 16-bit pattern
    dtype('int16')
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

#: Every dtype that travels, by wire name, as the numpy dtype of the same width.
NUMPY_BY_NAME: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_), "uint8": np.dtype(np.uint8), "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.int16), "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


@lru_cache(maxsize=1)
def _torch_tables() -> tuple[dict[str, Any], dict[Any, str]]:
    import torch

    by_name = {name: getattr(torch, name) for name in NUMPY_BY_NAME}
    return by_name, {v: k for k, v in by_name.items()}


def _unknown(name: Any) -> ValueError:
    return ValueError(f"unknown dtype {name!r}; use one of {sorted(NUMPY_BY_NAME)}")


def numpy_of(name: str) -> np.dtype:
    """The numpy dtype of the same width as wire dtype ``name``; ValueError if unknown."""
    if not isinstance(name, str):
        raise ValueError(f"a dtype name must be a string like 'float32', got {name!r}")
    try:
        return NUMPY_BY_NAME[name.removeprefix("torch.")]
    except KeyError:
        raise _unknown(name) from None


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a wire name (a torch dtype passes through); ValueError if unknown."""
    by_name, by_dtype = _torch_tables()
    if not isinstance(name, str):
        if name in by_dtype:
            return name
        if type(name).__name__ == "dtype" and type(name).__module__ == "torch":
            raise ValueError(f"dtype {name} is not supported on the wire; use one of {sorted(NUMPY_BY_NAME)}")
        raise ValueError(f"a dtype name must be a string like 'float32', got {name!r}")
    try:
        return by_name[name.removeprefix("torch.")]
    except KeyError:
        raise _unknown(name) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32"); ValueError if it cannot travel."""
    try:
        return _torch_tables()[1][dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {dtype} is not supported on the wire; use one of {sorted(NUMPY_BY_NAME)}") from None
