"""Bounded-loss blocks: what ``Config(encoding='lossy')`` stores for fp32 training state (``_encode`` holds the
blocks they sit in; ``_lossy`` holds the whole-tensor codes of the study ``bench --lossy`` measured, whose second
moment code works on log2 where this one works on the bit pattern).

Three block modes, each decoded with IEEE basic arithmetic or integer operations alone, so that a restore on
any machine gives back, bit for bit, the bytes the writer decoded and checksummed (no ``exp2``/``log2``, whose
last bit varies between math libraries):

- ``QDELTA`` (weights): ``ref + step * code``, the difference against the tensor's reference (its newest
  self-contained version, stored lossless) rounded to a quantum ``step``, integer codes 1, 2 or 4 bytes wide.
  ``step`` is ``fraction`` times the RMS by which one training step moved the block's elements since the
  reference (its move over the steps between, divided by them): each element is restored within ``step / 2``
  (plus the rounding of one fp32 sum).  Errors never add up along the versions: every delta refers to the
  lossless reference, never to another delta.
- ``QMOM`` (signed moments: Adam's ``exp_avg``, SGD's momentum): block-wise absmax over ``GROUP`` elements at
  8 bits; at 4 bits over a 32nd of the block, 256 to 2,048 elements (``group_of``): each element within
  ``absmax(group) / (2 * L)``, L = 127 (8 bits) or 7 (4 bits).  (At 4 bits a group of 2,048 elements that
  spans most of a small tensor, whose rows differ in scale, rounds the small momenta to 0: the LoRA workload of
  the bench family, its adapters coded so, ended five restores in turn 1.71% above the uninterrupted loss,
  against 0.85% lossless; with groups of 256, 0.83%.  A dense matrix's 1 MiB blocks keep groups of 2,048,
  whose codes, mostly near 0, zstd packs 6% smaller.)  A group whose
  scale ``absmax / L`` would be subnormal (every value under ``L * 2 ** -126``, a momentum decayed for
  hundreds of steps) restores as zeros: its reciprocal would overflow.
- ``QSQ`` (second moments, non-negative): the fp32 bit pattern, a piecewise-linear log2 of the value, rounded
  to ``s`` units in each group's own [lowest, highest] pattern of the non-zero values, ``s`` the smallest
  step that spreads that range over the codes; code 0 keeps exact zeros.  Each value is within a relative
  error of ``s / 2 ** 24``: about ``range_in_octaves / 508`` at 8 bits (``/ 28`` at 4), never rounded to 0
  (Adam divides by its root) nor raised to its group's largest.
- ``QSQREF`` (second moments with a reference): ``QSQ``'s ranges and codes, each code stored as its difference
  (modulo ``2 ** bits``) from the code that the reference's restored value takes in this block's grid.  The
  values restored are the codes' alone, as ``QSQ``'s: the reference, itself a ``QSQ`` version, only predicts
  the codes, so its error never reaches this version's and errors do not add up.  A second moment moves by
  little between saves (Adam's ``beta2`` keeps 99.9% of it a step): on the bench family's classify-3e-5,
  2.1-4.2x fewer bytes than ``QSQ`` 1 to 8 saves after the reference.

A block's bytes: a 12-byte header (``<BBBxIf``: the code width, how the codes are laid out, log2 of the
elements per scale (0: ``GROUP``, as every block written before it was recorded), the number of fp32 scales,
the delta's step), the scales, then the codes.  The layouts: 0 the codes as they are, 1 zstd of them,
2 (a delta's 2- or 4-byte codes) zstd of their zigzag map's byte planes, low bytes first: a delta's codes
spread over hundreds of quanta once the reference is a few hundred steps old, and zstd's byte-wise entropy
coder sees their high bytes, mostly 0 or 1, apart from their noise-like low bytes (measured on classify-3e-5
200 steps after the reference: 2.91x -> 3.42x smaller than fp32, against 3.69x for the codes' entropy);
3 (a delta's 2- or 4-byte codes whose zigzag map stays under 2 ** 12, tried first) the map split at 4 bits,
its high part a byte each and its low bits two a byte (``_split``), within about 1% of the codes' entropy.

A block the code does not fit (a non-finite value, a negative second moment, a delta of more than 2 ** 24
quanta, codes no smaller than the raw bytes) is left to the lossless modes.
"""
from __future__ import annotations

import math
import struct
from typing import Optional, Tuple

import numpy as np

from ..io._backend import native_codes
from ._planes import from_planes, plane_bytes
from ._zstd import MARGIN, PAYS, bad as _bad, codes_compressor, inflate

QDELTA, QMOM, QSQ, QSQREF = 4, 5, 6, 7  # their modes among ``_encode``'s
GROUP = 2048  # elements per scale of QSQ, and of QMOM at 8 bits
GROUP4 = 256  # elements per scale of QMOM at 4 bits, at least
_TINY = np.finfo(np.float32).tiny  # the least normal fp32
HEAD = struct.Struct("<BBBxIf")
_CODE = {1: np.int8, 2: np.int16, 4: np.int32}
_NATIVE = native_codes()  # ``csrc/qcodes.c``: the numpy encoders' codes, a pass per group, 2-3x faster
AS_IS, ZSTD, PLANES, SPLIT = 0, 1, 2, 3  # a block's layouts of its codes (the header's second byte)
SPLIT_LOW = 4  # bits of a code's zigzag map that ``SPLIT`` stores apart from the rest
_PAIR = struct.Struct("<II")
#: (mode, the block's bytes, the bytes it restores to, the largest error of an element, the sum of the squared
#: errors, the sum of the squared values the error is measured against: a delta's, a moment's) of one block
Coded = Tuple[int, bytes, np.ndarray, float, float, float]


def _pack(codes: np.ndarray) -> np.ndarray:
    """Codes below 16 (uint8), two a byte, the first in the low nibble."""
    c = codes if codes.size % 2 == 0 else np.concatenate([codes, codes[:1] * 0])
    return c[0::2] | (c[1::2] << 4)


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & 15
    out[1::2] = packed >> 4
    return out[:n]


def group_of(mode: int, bits: int, n: int) -> int:
    """Elements per scale of a moment block of ``n`` elements."""
    if mode != QMOM or bits != 4:
        return GROUP
    return max(GROUP4, min(GROUP, 1 << max(0, (n // 32).bit_length() - 1)))


def _groups(x: np.ndarray, fill, group: int = GROUP) -> np.ndarray:
    pad = -x.size % group
    if pad:
        x = np.concatenate([x, np.full(pad, fill, dtype=x.dtype)])
    return x.reshape(-1, group)


def _zigzag_planes(codes: np.ndarray) -> np.ndarray:
    """Signed codes of 2 or 4 bytes as the byte planes of their zigzag map (0, -1, 1, -2... -> 0, 1, 2, 3...):
    ``_planes``' delta against zeros."""
    return plane_bytes(codes.view(np.uint8), np.zeros(codes.nbytes, np.uint8), codes.itemsize)[0]


def _from_zigzag_planes(planes: np.ndarray, width: int, n: int) -> np.ndarray:
    """The inverse of :func:`_zigzag_planes`: ``n`` signed codes of ``width`` bytes."""
    codes = np.zeros(n * width, dtype=np.uint8)
    from_planes(planes, codes, width, True)
    return codes.view(_CODE[width])


def _out(mode: int, width: int, scales: np.ndarray, step: float, codes: np.ndarray, raw_n: int,
         group: int = GROUP) -> Optional[bytes]:
    """The block's bytes, None where they would not be smaller than the raw ones.  A delta's wide codes go as
    split at ``SPLIT_LOW`` bits (``SPLIT``) where their zigzag maps fit it, else as its byte planes (``PLANES``)."""
    wide = mode == QDELTA and width > 1
    packed = _split(codes) if wide else None
    if packed is not None and len(packed) < codes.nbytes:
        layout, z = SPLIT, True
    else:
        body = _zigzag_planes(codes) if wide else codes
        packed = codes_compressor().compress(body.data)
        z = len(packed) < body.nbytes
        layout = (PLANES if wide else ZSTD) if z else AS_IS
    glog = 0 if group == GROUP else group.bit_length() - 1
    out = b"".join([HEAD.pack(width, layout, glog, scales.size, step), scales.astype("<f4").tobytes(),
                    packed if z else codes.tobytes()])
    return out if len(out) < int(PAYS * raw_n) else None


def _squeezed(part: np.ndarray) -> bytes:
    """zstd of ``part`` where that pays, else its bytes (told apart by length: only a smaller frame is kept)."""
    packed = codes_compressor().compress(part.data)
    return packed if len(packed) < PAYS * part.nbytes else part.tobytes()


def _split(codes: np.ndarray) -> Optional[bytes]:
    """A delta's wide codes as ``SPLIT``: each code's zigzag map ``z`` as its high part ``z >> SPLIT_LOW``, a
    byte each, and its low ``SPLIT_LOW`` bits, two a byte, each part zstd where that pays, after their two
    lengths (u32); None where a map reaches ``2 ** (8 + SPLIT_LOW)``.  Once a reference is a hundred steps and
    more old, a delta's codes spread over hundreds of quanta: their low bits are nearly uniform and their high
    part narrow, where byte planes cut each code at 8 bits and code the halves apart, losing what the high byte
    says of the low one (classify-3e-5 of the bench family, 120 to 195 steps after the reference: 2.8-7.3%
    fewer bytes than ``PLANES``)."""
    c = codes.astype(np.int32)
    zz = ((c << 1) ^ (c >> 31)).view(np.uint32)
    if int(zz.max(initial=0)) >> (8 + SPLIT_LOW):
        return None
    hi = _squeezed((zz >> SPLIT_LOW).astype(np.uint8))
    lo = _squeezed(_pack((zz & ((1 << SPLIT_LOW) - 1)).astype(np.uint8)))
    return _PAIR.pack(len(hi), len(lo)) + hi + lo


def _from_split(body: memoryview, n: int, where: str) -> np.ndarray:
    """The inverse of :func:`_split`: ``n`` codes (int32)."""
    if len(body) < _PAIR.size:
        raise _bad(where, "a split block is shorter than its part table")
    a, b = _PAIR.unpack_from(body)
    if _PAIR.size + a + b != len(body):
        raise _bad(where, "a split block's part lengths do not add up to its length")
    parts = []
    for part, size in ((body[_PAIR.size:_PAIR.size + a], n), (body[_PAIR.size + a:], -(-n // 2))):
        parts.append(np.frombuffer(part, dtype=np.uint8) if len(part) == size else inflate(part, size, where))
    zz = (parts[0].astype(np.int32) << SPLIT_LOW) | _unpack(parts[1], n).astype(np.int32)
    return (zz >> 1) ^ -(zz & 1)


def _errors(restored: np.ndarray, x: np.ndarray, ss: Optional[float] = None) -> Tuple[float, float, float]:
    """(largest error, summed squared error, ``ss`` or the summed squared values of ``x``)."""
    e = restored - x
    emax = float(max(e.max(), -e.min())) if e.size else 0.0
    esq = float(np.dot(e, e))
    ss = float(np.dot(x, x)) if ss is None else ss
    if not np.isfinite(esq + ss):  # beyond fp32's range: in float64
        e64 = e.astype(np.float64)
        esq = float(np.dot(e64, e64))
        x64 = x.astype(np.float64)
        ss = float(np.dot(x64, x64))
    return emax, esq, ss


def encode(code: str, raw: np.ndarray, ref: Optional[np.ndarray], fraction: float, steps: int, bits: int,
           recent: float = 0.0) -> Optional[Coded]:
    """One block of fp32 bytes (``raw``) in the bounded-loss ``code`` ('qdelta' against ``ref``'s same bytes,
    'qmom', 'qsq': against ``ref``, the restored bytes of its reference, where given), or None where it does not
    fit (the block goes lossless).  'qdelta': its quantum is ``fraction`` of one step's move, the RMS move per
    step since the reference over ``steps`` steps or ``recent`` (the tensor's over the last interval), the
    larger: a weight that wanders moves less per step on average since its reference than lately."""
    if raw.size % 4:
        return None
    x = raw.view(np.float32)
    if code == "qdelta":
        return _encode_delta(x, ref.view(np.float32), fraction, steps, raw.size, recent)
    if code == "qmom":
        return _encode_moment(x, bits, raw.size)
    return _encode_sq(x, bits, raw.size, None if ref is None or ref.size != raw.size else ref.view(np.float32))


def _native(*arrays: np.ndarray):
    """The native kernels where built and every array is fp32-aligned (a tensor's bytes in a staging buffer
    are), else None."""
    return _NATIVE if _NATIVE is not None and all(a.ctypes.data % 4 == 0 for a in arrays) else None


def _step(fraction: float, ss: float, size: int, steps: int, recent: float = 0.0) -> Optional[np.float32]:
    """A delta's quantum: ``fraction`` times the RMS per-step move (since the reference, or ``recent`` where that
    is more), None where that is not a positive number."""
    move = max((ss / max(1, size)) ** 0.5 / max(1, steps), recent if math.isfinite(recent) else 0.0)
    step = np.float32(fraction * move)
    return step if np.isfinite(step) and step > 0 else None


def _width(top: float) -> int:
    """Bytes per code for codes up to ``top`` in magnitude; 0 where beyond 2 ** 24."""
    return 1 if top <= 127 else 2 if top <= 32767 else 4 if top < 2 ** 24 else 0


def _encode_delta(x: np.ndarray, r: np.ndarray, fraction: float, steps: int, n: int, recent: float = 0.0
                  ) -> Optional[Coded]:
    native = _native(x, r)
    if native is not None:
        ss = native.qdelta_ss(x, r)
        step = None if ss is None else _step(fraction, ss, x.size, steps, recent)
        if step is None:
            return None
        codes, restored = np.empty(x.size, np.int32), np.empty(x.size, np.float32)
        got = native.qdelta(x, r, float(step), codes, restored)
        width = 0 if got is None else _width(got[0])
        if not width:
            return None
        out = _out(QDELTA, width, np.empty(0, np.float32), float(step), codes.astype(_CODE[width], copy=False), n)
        return None if out is None else (QDELTA, out, restored.view(np.uint8), got[1], got[2], ss)
    d = x - r
    ss = float(np.dot(d, d))
    if not np.isfinite(ss):  # a non-finite value in either, or a move beyond fp32's range
        d64 = d.astype(np.float64)
        ss = float(np.dot(d64, d64))
        if not np.isfinite(ss):
            return None
    step = _step(fraction, ss, d.size, steps, recent)
    if step is None:
        return None
    q = np.divide(d, step, out=d)
    np.rint(q, out=q)
    q += np.float32(0)  # -0.0 to +0.0, as an integer code decodes (a reference's -0.0 plus -0.0 stays -0.0)
    width = _width(float(max(q.max(), -q.min())))
    if not width:
        return None
    codes = q.astype(_CODE[width])
    restored = np.multiply(q, step, out=q)  # as the decoder does: ref + step * code
    restored = np.add(r, restored, out=restored)
    out = _out(QDELTA, width, np.empty(0, np.float32), float(step), codes, n)
    return None if out is None else (QDELTA, out, restored.view(np.uint8), *_errors(restored, x, ss))


def _native_parts(mode: int, x: np.ndarray, bits: int):
    """(scales, codes, restored values, (largest error, summed squared error, summed squared values)) of a
    moment block from the native kernels, None where the code does not fit."""
    group = group_of(mode, bits, x.size)
    groups = -(-x.size // group)
    scales = np.empty(groups * (2 if mode == QSQ else 1), np.float32)
    codes = np.empty(x.size if bits == 8 else (x.size + 1) // 2, np.uint8)
    restored = np.empty(x.size, np.float32)
    if mode == QSQ:
        st = _NATIVE.qsq(x, bits, scales, codes, restored)
    else:
        st = _NATIVE.qmom(x, bits, group, scales, codes, restored)
    return None if st is None else (scales, codes, restored, st)


def _native_moment(mode: int, x: np.ndarray, bits: int, n: int) -> Optional[Coded]:
    got = _native_parts(mode, x, bits)
    if got is None:
        return None
    scales, codes, restored, st = got
    out = _out(mode, bits, scales, 0.0, codes, n, group_of(mode, bits, x.size))
    return None if out is None else (mode, out, restored.view(np.uint8), *st)


def _encode_moment(x: np.ndarray, bits: int, n: int) -> Optional[Coded]:
    if _native(x) is not None:
        return _native_moment(QMOM, x, bits, n)
    if not np.isfinite(np.dot(x, x)) and not np.isfinite(x).all():  # (a finite sum: every value finite)
        return None
    top = 2 ** (bits - 1) - 1
    group = group_of(QMOM, bits, x.size)
    g = _groups(x, 0, group)
    scale = np.maximum(g.max(axis=1), -g.min(axis=1)) / np.float32(top)
    scale[scale < _TINY] = 0  # a group below 127 (7) times the least normal fp32: zeros (1 / scale would overflow)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    q = g * inv[:, None]
    np.rint(q, out=q)
    np.clip(q, -top, top, out=q)
    q += np.float32(0)  # -0.0 to +0.0, as an integer code decodes
    codes = q.reshape(-1)[:x.size].astype(np.int8)
    restored = np.multiply(q, scale[:, None], out=q).reshape(-1)[:x.size]  # as the decoder does
    if bits == 4:
        codes = _pack((codes + top).astype(np.uint8))
    out = _out(QMOM, bits, scale, 0.0, codes, n, group)
    return None if out is None else (QMOM, out, restored.view(np.uint8), *_errors(restored, x))


def _sq_step(lo: np.ndarray, hi: np.ndarray, bits: int) -> np.ndarray:
    return np.maximum(1, -(-(hi - lo) // (2 ** bits - 2)))


def _encode_sq(x: np.ndarray, bits: int, n: int, ref: Optional[np.ndarray] = None) -> Optional[Coded]:
    """``QSQ``, or ``QSQREF`` against ``ref`` (the reference's restored values) where that is below ``MARGIN``
    of ``QSQ``'s bytes."""
    got = _sq_parts(x, bits)
    if got is None:
        return None
    scales, codes, restored, st = got
    own = _out(QSQ, bits, scales, 0.0, codes, n)
    if ref is not None:
        rel = _out(QSQREF, bits, scales, 0.0, _told(ref, bits, scales.view(np.int32), codes, x.size, False), n)
        if rel is not None and (own is None or len(rel) < MARGIN * len(own)):
            return (QSQREF, rel, restored.view(np.uint8), *st)
    return None if own is None else (QSQ, own, restored.view(np.uint8), *st)


def _told(ref: np.ndarray, bits: int, lohi: np.ndarray, codes: np.ndarray, n: int, restore: bool) -> np.ndarray:
    """``QSQREF``'s codes from ``QSQ``'s (``restore``: the inverse), as stored (two a byte at 4 bits): each less
    (more) the code its reference's value takes in this block's grid (:func:`_sq_predict`), modulo
    ``2 ** bits``.  In place where the native kernel runs (``codes`` then must be writable)."""
    if _native(ref, lohi) is not None:
        _NATIVE.qsq_told(ref, bits, lohi, codes, restore)
        return codes
    pairs = lohi.reshape(-1, 2)
    c = codes if bits == 8 else _unpack(codes, n)
    p = _sq_predict(ref, pairs[:, 0], pairs[:, 1], bits)
    d = (c + p if restore else c - p) & np.uint8(2 ** bits - 1)  # (uint8: modulo 256)
    return d if bits == 8 else _pack(d)


def _sq_parts(x: np.ndarray, bits: int):
    """``QSQ``'s (lo/hi patterns as fp32 scales, codes (two a byte at 4 bits), restored values, (largest error,
    summed squared error, summed squared values)), None where the code does not fit.  (Non-negative finite fp32
    bit patterns are 0 to 0x7F7FFFFF: every sum below stays within int32.)"""
    if _native(x) is not None:
        return _native_parts(QSQ, x, bits)
    if not (float(x.min()) >= 0 and np.isfinite(x.max())):  # (NaN is not >= 0)
        return None
    g = _groups(x, 0).view(np.int32)
    zero = g <= 0  # +0.0, and -0.0 (the pattern -2 ** 31): the same value
    lo = np.where(zero, np.int32(0x7FFFFFFF), g).min(axis=1)
    hi = g.max(axis=1)
    empty = lo > hi  # a group of zeros
    lo[empty] = 0
    hi = np.maximum(hi, 0)
    s = _sq_step(lo, hi, bits)
    c = np.floor((g - lo[:, None] + s[:, None] // 2) / s[:, None].astype(np.float64))
    np.clip(c, 0, 2 ** bits - 2, out=c)
    codes = c.astype(np.int32) + 1
    codes[zero] = 0
    restored = _sq_restore(codes, lo, hi, s).reshape(-1)[:x.size]
    codes = codes.reshape(-1)[:x.size].astype(np.uint8)
    if bits == 4:
        codes = _pack(codes)
    scales = np.stack([lo, hi], axis=1).reshape(-1).astype(np.int32).view(np.float32)
    return scales, codes, restored, _errors(restored, x)


def _sq_predict(ref: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> np.ndarray:
    """The ``QSQ`` code (uint8) each of ``ref``'s values takes in the grid of the groups' [lo, hi] patterns:
    a ``QSQREF`` block's prediction of its codes, computed alike when coding and when restoring (integer
    operations on the bit patterns; any pattern, a negative or non-finite one too, gets some code)."""
    g = _groups(ref.view(np.int32), 0).astype(np.int64)
    s = _sq_step(lo, hi, bits).astype(np.int64)[:, None]
    c = (g - lo.astype(np.int64)[:, None] + s // 2) // s
    np.clip(c, 0, 2 ** bits - 2, out=c)
    c += 1
    c[g <= 0] = 0
    return c.reshape(-1)[:ref.size].astype(np.uint8)


def _sq_restore(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Values (fp32) of QSQ codes (rows of GROUP), each group's [lo, hi] bit patterns and step (int32 sums:
    ``lo + (code - 1) * s`` is at most ``hi + s / 2``, below 2 ** 31)."""
    pat = np.minimum(lo[:, None] + (codes.astype(np.int32) - 1) * s[:, None].astype(np.int32), hi[:, None])
    pat[codes == 0] = 0
    return pat.view(np.float32)


def decode(mode: int, data: memoryview, out: np.ndarray, where: str) -> None:
    """Decode one bounded-loss block into ``out`` (its raw bytes' place; for QDELTA it holds the reference's);
    ``where`` names it in the error a damaged block raises."""

    def bad(msg: str):
        return _bad(where, msg)

    if len(data) < HEAD.size:
        raise bad("a bounded-loss block is shorter than its header")
    width, layout, glog, nscales, step = HEAD.unpack_from(data)
    if out.size % 4:
        raise bad(f"a bounded-loss block of {out.size} bytes is not whole fp32 elements")
    n = out.size // 4
    group = GROUP if glog == 0 else 1 << glog
    groups = -(-n // group)
    if mode == QDELTA:
        ok, want, ncodes = width in _CODE and nscales == 0 and np.isfinite(step) and step > 0, 0, n * width
        ok = ok and glog == 0
    else:
        ok = width in (4, 8) and layout in (AS_IS, ZSTD) and (glog == 0 or (mode == QMOM and 6 <= glog <= 11))
        want = groups * (1 if mode == QMOM else 2)
        ncodes = n if width == 8 else -(-n // 2)
    if (not ok or layout not in (AS_IS, ZSTD, PLANES, SPLIT) or (layout in (PLANES, SPLIT) and width == 1)
            or nscales != want):
        raise bad("a bounded-loss block's header is malformed")
    pos = HEAD.size + 4 * nscales
    if len(data) < pos:
        raise bad("a bounded-loss block is shorter than its scales")
    body = data[pos:]
    if layout == SPLIT:
        codes = _from_split(body, n, where)
    elif layout != AS_IS:
        codes = inflate(body, ncodes, where)
    elif len(body) != ncodes:
        raise bad(f"a bounded-loss block holds {len(body)} bytes of codes, expected {ncodes}")
    else:
        codes = np.frombuffer(body, dtype=np.uint8)
    dest = out.view(np.float32)
    if mode == QDELTA:
        c = (codes if layout == SPLIT else _from_zigzag_planes(codes, width, n) if layout == PLANES
             else codes.view(_CODE[width])).astype(np.float32)
        dest[:] = dest + np.float32(step) * c
        return
    scales = np.frombuffer(data[HEAD.size:pos], dtype="<f4")
    if mode == QMOM:
        top = 2 ** (width - 1) - 1
        q = codes.view(np.int8) if width == 8 else _unpack(codes, n).astype(np.int8) - np.int8(top)
        if not np.isfinite(scales).all():
            raise bad("a bounded-loss block's scales are not finite")
        dest[:] = (_groups(q.astype(np.float32), 0, group) * scales[:, None]).reshape(-1)[:n]
        return
    lohi = scales.view(np.int32).reshape(-1, 2)
    lo, hi = lohi[:, 0], lohi[:, 1]
    if bool((lo < 0).any() or (hi < lo).any() or (hi >= 0x7F800000).any()):
        raise bad("a bounded-loss block's value ranges are malformed")
    if mode == QSQREF:  # ``dest`` holds the reference's restored values, which predict the codes
        codes = _told(dest, width, np.ascontiguousarray(lohi).reshape(-1), np.array(codes), n, True)
    c = codes if width == 8 else _unpack(codes, n)
    dest[:] = _sq_restore(_groups(c, 0), lo, hi, _sq_step(lo, hi, width)).reshape(-1)[:n]
