"""Reading tensors back: coalesced, aligned, pipelined reads with checksums."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from . import format as fmt
from .backend import open_file
from .errors import CheckpointCorruptError
from .staging import BufferPool

GAP = 1 << 20  # read through holes smaller than this rather than issue another request


@dataclass
class Want:
    key: str
    offset: int
    nbytes: int
    crc: int
    sink: torch.Tensor  # flat uint8, nbytes long


def read_file(backend, pool: BufferPool, path: str, size: int, wants: List[Want],
              check: Optional[Callable], direct: bool = True) -> int:
    """Fill every Want's sink from ``path``; returns bytes read.  Damage raises CheckpointCorruptError."""
    wants = sorted(wants, key=lambda w: w.offset)
    try:
        fd, direct = open_file(path, write=False, direct=direct)
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"data file {path} is missing (needed for tensor {wants[0].key if wants else '?'})",
            path=path, tensor=wants[0].key if wants else None) from None
    try:
        have = os.fstat(fd).st_size
        if have < size:
            lost = next((w.key for w in wants if w.offset + w.nbytes > have), None)
            raise CheckpointCorruptError(
                f"data file {path} is truncated: {have} bytes, the manifest expects {size}"
                + (f"; tensor {lost!r} is cut off" if lost else ""), path=path, tensor=lost)
        pieces = _pieces(wants, pool.chunk_bytes)
        return _pump(backend, pool, fd, path, pieces, wants, check)
    finally:
        os.close(fd)


def _pieces(wants: List[Want], C: int) -> List[List[int]]:
    extents: List[List[int]] = []
    for w in wants:
        if w.nbytes == 0:
            continue
        s, e = w.offset // fmt.ALIGN * fmt.ALIGN, fmt.align_up(w.offset + w.nbytes)
        if extents and s <= extents[-1][1] + GAP:
            extents[-1][1] = max(extents[-1][1], e)
        else:
            extents.append([s, e])
    out = []
    for s, e in extents:
        while s < e:
            out.append([s, min(e, s + C)])
            s = out[-1][1]
    return out


def _pump(backend, pool, fd, path, pieces, wants, check) -> int:
    crcs = [0] * len(wants)
    got = [0] * len(wants)
    chunks: Dict[int, object] = {}
    done: set = set()
    nxt = first = 0  # next piece to submit; first want not yet complete
    total = 0
    depth = max(1, pool.capacity)
    try:
        for i, (ps, pe) in enumerate(pieces):
            while nxt < len(pieces) and nxt - i < depth:
                chunk = pool.acquire()
                chunks[nxt] = chunk
                s, e = pieces[nxt]
                backend.read(fd, chunk.view[: e - s], s, nxt, path)
                nxt += 1
            while i not in done:
                done.update(backend.wait(1))
            chunk = chunks.pop(i)
            total += pe - ps
            j = first
            while j < len(wants) and wants[j].offset < pe:
                w = wants[j]
                a, b = max(w.offset, ps), min(w.offset + w.nbytes, pe)
                if a < b:
                    seg = chunk.view[a - ps: b - ps]
                    w.sink[a - w.offset: b - w.offset].copy_(chunk.tensor[a - ps: b - ps])
                    if check is not None:
                        crcs[j] = check(seg, crcs[j])
                    got[j] += b - a
                if got[j] == w.nbytes and j == first:
                    if check is not None and crcs[j] != w.crc:
                        raise CheckpointCorruptError(
                            f"checksum mismatch in tensor {w.key!r} of {path} (bytes {w.offset}..{w.offset + w.nbytes}): "
                            f"expected {w.crc:#010x}, got {crcs[j]:#010x}; the file is damaged, restore an older step",
                            path=path, tensor=w.key)
                    first += 1
                j += 1
            pool.release(chunk)
        for j in range(first, len(wants)):
            w = wants[j]
            if w.nbytes == 0 and check is not None and w.crc != 0:
                raise CheckpointCorruptError(f"checksum mismatch in empty tensor {w.key!r} of {path}", path=path,
                                             tensor=w.key)
    except OSError as e:
        raise CheckpointCorruptError(f"reading {path} failed: {os.strerror(e.errno or errno.EIO)}", path=path) from None
    finally:
        try:
            backend.drain()
        except OSError:
            pass
        for c in chunks.values():
            pool.release(c)
    return total
