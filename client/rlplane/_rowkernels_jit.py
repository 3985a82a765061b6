"""The compiled loops behind :mod:`rlplane.rowkernels` (imported by it on first use only:
importing this module imports numba and compiles, or loads from numba's cache, the three
functions). Nothing here checks its arguments: call them through :mod:`rlplane.rowkernels`,
which does.

The externals are module globals, not closure variables, so numba's on-disk cache keys
them by name and a process loads what another compiled (a closure's ``ExternalFunction``
pickles differently in every process, and numba would compile, and cache, again).
Pointers are passed as integers (the same registers in the x86-64 and AArch64 calling
conventions).

Example::

    from rlplane import _rowkernels_jit as jit
    jit.digest_ranges(buf, bounds, sums, 0, n)
"""

from __future__ import annotations

import ctypes
from typing import Any

import llvmlite.binding as llvm
import numba
import xxhash
from numba import types

# The xxh3 the xxhash package calls, by its library's exported symbol.
llvm.add_symbol("XXH3_64bits", ctypes.cast(ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits, ctypes.c_void_p).value)
xxh3 = types.ExternalFunction("XXH3_64bits", types.uint64(types.uintp, types.uintp))
memcpy = types.ExternalFunction("memcpy", types.uintp(types.uintp, types.uintp, types.uintp))

_SRC, _DST = types.Array(types.uint8, 1, "C", readonly=True), types.uint8[::1]  # (a writable source converts)
_AT, _SUMS, _INT = types.int64[::1], types.uint64[::1], types.int64


def _jit(*args: Any) -> Any:
    """Compiled now, for these argument types then (first row, end row) only."""
    sig = types.void(*args, _INT, _INT)

    def compiled(fn: Any) -> Any:
        try:
            return numba.njit(sig, nogil=True, cache=True)(fn)
        except RuntimeError:  # no writable cache directory: compiled in each process instead
            return numba.njit(sig, nogil=True)(fn)

    return compiled


@_jit(_SRC, _AT, _SUMS)
def digest_ranges(buf, bounds, sums, a, z):  # type: ignore[no-untyped-def]
    p = buf.ctypes.data
    for i in range(a, z):
        sums[i] = xxh3(p + bounds[i], bounds[i + 1] - bounds[i])


@_jit(_DST, _AT, _SRC, _AT, _AT, _SUMS, types.boolean)
def copy_rows(dst, dst_at, src, src_at, lens, sums, digest, a, z):  # type: ignore[no-untyped-def]
    d, s = dst.ctypes.data, src.ctypes.data
    for i in range(a, z):
        memcpy(d + dst_at[i], s + src_at[i], lens[i])
        if digest:
            sums[i] = xxh3(d + dst_at[i], lens[i])


@_jit(_DST, _INT, _SRC, _AT, _AT, _SRC, _SUMS, types.boolean)
def pad_rows(dst, row_bytes, src, src_at, lens, fill, sums, digest, a, z):  # type: ignore[no-untyped-def]
    d, s, f = dst.ctypes.data, src.ctypes.data, fill.ctypes.data
    for i in range(a, z):
        n = lens[i]
        memcpy(d + i * row_bytes, s + src_at[i], n)
        memcpy(d + i * row_bytes + n, f + n, row_bytes - n)
        if digest:
            sums[i] = xxh3(d + i * row_bytes, n)
