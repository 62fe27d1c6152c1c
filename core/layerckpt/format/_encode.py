"""Encode: what a data file holds, losslessly smaller.

A tensor is encoded in blocks of at most ``BLOCK`` bytes (cut where the file image's ``BLOCK`` and
staging-chunk boundaries fall, so a partial read decodes only the blocks it needs).  Each block is one of:

- ``RAW``: the bytes as they are (where nothing below pays);
- ``PLANES``: split into byte planes (byte k of every element together: the sign and exponent bytes of
  floats repeat, the low mantissa bytes do not), each plane zstd-compressed, or kept raw where a sample
  says it does not compress;
- ``DELTA``: the element-wise difference of the bit patterns, as integers of the element's width (wrapping),
  against the same bytes of the tensor's *reference* (a self-contained version the store already holds),
  zigzag-mapped so small changes of either sign have many leading zero bits, then byte planes as above.
  Measured on the bench family's fine-tunes (fp32 AdamW, 5 steps apart): the weights 1.71x (XOR: 1.66x),
  ``exp_avg_sq`` 1.61x (1.49x); bf16 weights 5.5x (4.9x);
- ``SAME``: bit-identical to the reference: nothing stored;
- ``QDELTA``, ``QMOM``, ``QSQ``, ``QSQREF``: bounded-loss codes of fp32 state (``Config(encoding='lossy')``
  only; see ``_qblock``): a weight's quantized difference against its reference, a moment's block-wise codes,
  a second moment's codes told as their difference from the codes its reference's restored values take.

An encoded block's bytes start with one little-endian u32 per plane: the plane's stored length (equal to
the plane's size when it is stored raw).  Decoding is the exact inverse; the tensor's CRC32C over its raw
bytes, checked after decoding, covers what is restored.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np

from ._planes import from_planes, plane_bytes
from ._qblock import QDELTA, QMOM, QSQ, QSQREF, decode as _qblock_decode
from ._zstd import MARGIN, PAYS as _PAYS, bad as _bad, compressor as _compressor, inflate as _inflate

CODEC = "lc1"  # the manifest's name for this encoding
BLOCK = 1 << 20  # raw bytes per block at most
RAW, PLANES, DELTA, SAME = 0, 1, 2, 3
# QDELTA, QMOM, QSQ, QSQREF = 4, 5, 6, 7: bounded loss (``_qblock``)
MODES = (RAW, PLANES, DELTA, SAME, QDELTA, QMOM, QSQ, QSQREF)
LOSSY = (QDELTA, QMOM, QSQ, QSQREF)
ESIZES = (1, 2, 4, 8)  # element sizes a delta is taken in
READS_REF = (DELTA, SAME, QDELTA, QSQREF)  # the modes whose blocks decode on top of the reference's bytes
#: the modes a reference's own blocks may have: self-contained ones (a second moment's reference is coded with loss)
SELF_CONTAINED = (RAW, PLANES, QSQ)
_SAMPLE = 1 << 15  # bytes of a plane compressed first to tell whether the plane is worth compressing

def warm() -> None:
    """Create this thread's zstd contexts and run them once, so that an encoder thread's first block is
    timed (by the cost model) as the rest are."""
    block = np.arange(1 << 14, dtype=np.float32).view(np.uint8)
    encode_block(block, block[::-1].copy(), 4)


def _pack_planes(x: np.ndarray, esize: int, limit: int) -> Optional[bytes]:
    """``x`` (byte planes, plane after plane), each plane compressed where that pays; None if the whole is not
    below ``limit``."""
    cctx = _compressor()
    parts: List[bytes] = []
    sizes: List[int] = []
    total = 4 * esize
    m = x.size // esize
    for p in (x[k * m:(k + 1) * m] for k in range(esize)):
        n = p.size
        packed = None
        if n > 2 * _SAMPLE:
            if len(cctx.compress(p[:_SAMPLE].data)) < _PAYS * _SAMPLE:
                packed = cctx.compress(p.data)
        else:
            packed = cctx.compress(p.data)
        if packed is None or len(packed) >= _PAYS * n:
            packed = p.data
        parts.append(packed)
        sizes.append(len(packed))
        total += len(packed)
        if total >= limit:
            return None
    return b"".join([np.asarray(sizes, dtype="<u4").tobytes(), *parts])


def encode_block(raw: np.ndarray, ref: Optional[np.ndarray], esize: int, rival: Optional[int] = None
                 ) -> Tuple[int, Optional[bytes]]:
    """(mode, the encoded bytes) of one block of raw bytes; ``ref``: the reference's same bytes, or None
    (self-contained).  RAW comes with None: the raw bytes stay as they are.  ``rival``: the stored size of
    the reference's own (self-contained) version of this block, where known: a delta must be smaller than
    ``MARGIN`` times it, else the block is stored self-contained, so that a restore need not read the
    reference for it (a delta costs the restore the reference's bytes too)."""
    n = raw.size
    limit = int(_PAYS * n)
    if n % esize:
        return RAW, None
    if ref is not None:
        planes, changed = plane_bytes(raw, ref, esize)
        if not changed:
            return SAME, b""
        out = _pack_planes(planes, esize, limit if rival is None else min(limit, int(MARGIN * rival)))
        if out is not None:
            return DELTA, out
    if n >= 64:
        out = _pack_planes(plane_bytes(raw, None, esize)[0], esize, limit)
        if out is not None:
            return PLANES, out
    return RAW, None


def encode_timed(raw: np.ndarray, ref: Optional[np.ndarray], esize: int, rival: Optional[int] = None
                 ) -> Tuple[int, Optional[bytes], int, float]:
    """:func:`encode_block`, and what it gave and took: (mode, encoded bytes, stored length, CPU seconds of
    this thread), for the cost model (``_cost``)."""
    t = time.thread_time()
    mode, data = encode_block(raw, ref, esize, rival)
    return mode, data, raw.size if mode == RAW else len(data), time.thread_time() - t


def decode_block(mode: int, data: memoryview, out: np.ndarray, esize: int, where: str) -> None:
    """Decode one block into ``out`` (its raw bytes' place; for DELTA and SAME it holds the reference's)."""
    if mode == SAME:
        if len(data):
            raise _bad(where, "an unchanged block carries data")
        return
    if mode == RAW:
        if len(data) != out.size:
            raise _bad(where, f"a raw block of {out.size} bytes carries {len(data)}")
        out[:] = np.frombuffer(data, dtype=np.uint8)
        return
    if mode in LOSSY:
        if esize != 4:
            raise _bad(where, f"a bounded-loss block holds fp32 elements, not elements of {esize} bytes")
        _qblock_decode(mode, data, out, where)
        return
    if out.size % esize:
        raise _bad(where, f"a block of {out.size} bytes is not whole elements of {esize} bytes")
    from_planes(_unpack_planes(data, out.size, esize, where), out, esize, mode == DELTA)


def _unpack_planes(data: memoryview, n: int, esize: int, where: str) -> np.ndarray:
    """The byte planes, plane after plane, of an encoded block."""
    head = 4 * esize
    if len(data) < head:
        raise _bad(where, "a block is shorter than its plane table")
    sizes = np.frombuffer(data[:head], dtype="<u4").astype(np.int64)
    if int(sizes.sum()) != len(data) - head:
        raise _bad(where, "a block's plane sizes do not add up to its length")
    plane = n // esize
    x = np.empty(n, dtype=np.uint8)
    pos = head
    for k, size in enumerate(sizes.tolist()):
        part = data[pos:pos + size]
        pos += size
        x[k * plane:(k + 1) * plane] = np.frombuffer(part, dtype=np.uint8) if size == plane else _inflate(
            part, plane, where)
    return x


def reads_ref(blocks: List[List[int]]) -> bool:
    """Whether any of a tensor's blocks ([file offset, length, raw length, mode]) reads its reference."""
    return any(b[3] in READS_REF for b in blocks)


def placed(blocks: List[List[int]]) -> List[Tuple[List[int], int]]:
    """Each block with the raw position (in the tensor's bytes) it decodes to."""
    out, pos = [], 0
    for b in blocks:
        out.append((b, pos))
        pos += b[2]
    return out


def cuts(start: int, end: int, chunk: int) -> List[Tuple[int, int]]:
    """The blocks of the image range [start, end): cut at every multiple of ``BLOCK`` and of ``chunk``."""
    out = []
    a = start
    while a < end:
        b = min(end, (a // BLOCK + 1) * BLOCK, (a // chunk + 1) * chunk)
        out.append((a, b))
        a = b
    return out
