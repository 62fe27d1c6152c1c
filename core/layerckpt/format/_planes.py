"""Byte planes and zigzag deltas of fixed-width elements (``_encode``'s PLANES and DELTA blocks, ``_qblock``'s
wide delta codes): one native pass where the extension has it, numpy otherwise, the same bytes either way."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..io._backend import native_planes

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def zigzag_delta(raw: np.ndarray, ref: np.ndarray, esize: int) -> np.ndarray:
    """``raw - ref`` element-wise on the bit patterns (wrapping), zigzag-mapped, as bytes."""
    a, b = raw.view(_INT[esize]), ref.view(_INT[esize])
    d = a - b
    z = (d << 1) ^ (d >> (8 * esize - 1))
    return z.view(np.uint8)


def undo_delta(z: np.ndarray, out: np.ndarray, esize: int) -> None:
    """``out += unzigzag(z)`` in place: ``out`` held the reference's bytes, now the encoded version's."""
    u = z.view(_UINT[esize])
    d = (u >> _UINT[esize](1)) ^ (-(u & _UINT[esize](1)))
    o = out.view(_UINT[esize])
    np.add(o, d, out=o)


_NATIVE = native_planes()


def plane_bytes(raw: np.ndarray, ref: Optional[np.ndarray], esize: int) -> Tuple[np.ndarray, bool]:
    """(the byte planes, plane after plane, of ``raw`` or of its zigzag delta against ``ref``; whether any
    byte is nonzero): one native pass where the extension has it."""
    if _NATIVE is not None:
        out = np.empty(raw.size, dtype=np.uint8)
        any_ = _NATIVE.planes(raw, ref, out, esize)
        return out, any_
    x = raw if ref is None else zigzag_delta(raw, ref, esize)
    out = x if esize == 1 else np.ascontiguousarray(x.reshape(-1, esize).T).reshape(-1)
    return out, bool(out.any())


def from_planes(planes: np.ndarray, out: np.ndarray, esize: int, add: bool) -> None:
    """The inverse of :func:`plane_bytes` into ``out`` (with ``add``, ``out`` holds the reference)."""
    if _NATIVE is not None:
        _NATIVE.unplanes(planes, out, esize, add)
        return
    x = planes if esize == 1 else np.ascontiguousarray(planes.reshape(esize, -1).T).reshape(-1)
    if add:
        undo_delta(x, out, esize)
    else:
        out[:] = x
