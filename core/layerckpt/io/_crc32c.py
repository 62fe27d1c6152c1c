"""CRC32C (Castagnoli) without the native module: checkpoints written with it stay verifiable anywhere.

Table-driven, vectorised with numpy over many equal lanes of the buffer at once
(each lane's CRC register computed independently), then the lanes are joined by
shifting each register over the bytes that follow it, a linear map over GF(2)
raised to the lane length by squaring.  A few hundred MB/s: a fallback, not the
fast path (``layerckpt.io._uring.crc32c`` runs the CPU's CRC instruction).
"""
from __future__ import annotations

import functools
from typing import List

import numpy as np

POLY = 0x82F63B78  # reflected Castagnoli polynomial
LANES = 4096


@functools.lru_cache(maxsize=2)
def _table(poly: int = POLY) -> np.ndarray:
    t = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (poly if c & 1 else 0)
        t[i] = c
    return t


TABLE = _table()


def _zero_byte(reg: int, table: np.ndarray = TABLE) -> int:
    return int(table[reg & 0xFF]) ^ (reg >> 8)


def _apply(cols: List[int], v: int) -> int:
    out, j = 0, 0
    while v:
        if v & 1:
            out ^= cols[j]
        v >>= 1
        j += 1
    return out


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int, poly: int = POLY) -> tuple:
    """The linear map taking a CRC register over ``nbytes`` zero bytes, as 32 columns."""
    result = [1 << j for j in range(32)]  # identity
    table = _table(poly)
    base = [_zero_byte(1 << j, table) for j in range(32)]
    n = nbytes
    while n:
        if n & 1:
            result = [_apply(base, c) for c in result]
        base = [_apply(base, c) for c in base]
        n >>= 1
    return tuple(result)


def _serial(reg: int, data: np.ndarray) -> int:
    for b in data.tolist():
        reg = int(TABLE[(reg ^ b) & 0xFF]) ^ (reg >> 8)
    return reg


def crc32c(buf, crc: int = 0) -> int:
    """CRC32C of ``buf`` (any buffer), continuing from ``crc``; the same values as the native one."""
    data = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    reg = crc ^ 0xFFFFFFFF
    n = data.size
    lanes = min(LANES, n // 64)
    if lanes >= 2:
        width = n // lanes
        body = data[: lanes * width].reshape(lanes, width)
        regs = np.zeros(lanes, dtype=np.uint32)
        regs[0] = reg
        for j in range(width):
            regs = TABLE[(regs ^ body[:, j]) & 0xFF] ^ (regs >> 8)
        shift = list(_shift(width))
        reg = int(regs[0])
        for r in regs[1:].tolist():  # register(A + B) = shift(register(A), |B|) ^ register of B from zero
            reg = _apply(shift, reg) ^ r
        data = data[lanes * width:]
    return _serial(reg, data) ^ 0xFFFFFFFF


def combine(crc_a: int, crc_b: int, len_b: int, poly: int = POLY) -> int:
    """The CRC of bytes A then B from the CRC of each and B's length (zlib's ``crc32_combine``; ``poly``, the
    reflected polynomial: CRC32C's, or 0xEDB88320 for zlib's CRC32)."""
    return _apply(list(_shift(len_b, poly)), crc_a) ^ crc_b
