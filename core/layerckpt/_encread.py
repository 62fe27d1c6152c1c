"""Encoded reads: decode the tensors a composite holds encoded (``TensorEntry.enc``, see ``_encode``).

Each tensor's encoded bytes (and its reference's, in the older file that holds it) are read in one span per
file through the ordinary reader (``_read.read_views``, no checksum: the raw checksum is checked after
decoding), then decoded on several threads: first every reference (and every self-contained tensor) into
its destination, then every delta on top of its reference, then each tensor's CRC32C over its decoded
bytes against the manifest's.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import _encode, _store
from ._layout import CODES
from ._manifest import Manifest, TensorEntry
from ._read import Want, read_views
from .errors import CheckpointCorruptError

Task = Tuple[int, memoryview, np.ndarray, int, str, str, str]  # mode, encoded bytes, destination, element size,
#                                                               where (for messages), tensor key, file path


def _span(blocks: List[List[int]]) -> Tuple[int, int]:
    if not blocks:
        return 0, 0
    return min(b[0] for b in blocks), max(b[0] + b[1] for b in blocks)


def read_encoded(root: str, m: Manifest, mpath: str, keys: List[str], sinks: Dict[str, torch.Tensor], backend,
                 check: Optional[Callable], cfg) -> Tuple[Dict[str, torch.Tensor], int]:
    """Decode the encoded tensors ``keys`` of ``m``: into ``sinks[key]`` (a flat uint8 view of the tensor's
    bytes) where given, else into fresh memory (returned by key).  Returns (fresh tensors, bytes read)."""
    by_file: Dict[str, List[Want]] = {}
    for k in keys:
        e = m.tensors[k]
        _want(by_file, e.file, k + "\0own", e.enc["blocks"])
        ref = e.enc.get("ref")
        if ref is not None:
            _want(by_file, ref["file"], k + "\0ref", ref["blocks"])
    views: Dict[str, torch.Tensor] = {}
    total = 0
    for fname, wants in sorted(by_file.items()):
        path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest {mpath}")
        got, n = read_views(backend, path, m.files[fname].size, wants, None, cfg.chunk_bytes, direct=cfg.direct_io)
        views.update(got)
        total += n
    out: Dict[str, torch.Tensor] = {}
    dests: Dict[str, np.ndarray] = {}
    for k in keys:
        e = m.tensors[k]
        sink = sinks.get(k)
        if sink is None:
            out[k] = t = _fresh(k, e, mpath)
            sink = t.reshape(-1).view(torch.uint8)
        dests[k] = sink.numpy()
    _decode_all(root, m, keys, views, dests)
    if check is not None:
        for k in keys:
            _verify(k, m.tensors[k], dests[k], check, root, mpath)
    return out, total


def _fresh(key: str, e: TensorEntry, mpath: str) -> torch.Tensor:
    try:
        return torch.empty(e.shape, dtype=CODES[e.dtype])
    except (RuntimeError, MemoryError):
        raise CheckpointCorruptError(f"tensor {key!r} of manifest {mpath} claims {e.nbytes} bytes, more than this "
                                     f"machine can allocate; the manifest may be damaged: run `layerckpt verify`",
                                     path=mpath, tensor=key) from None


def _want(by_file: Dict[str, List[Want]], fname: str, key: str, blocks: List[List[int]]) -> None:
    a, b = _span(blocks)
    by_file.setdefault(fname, []).append(Want(key, a, b - a, 0, torch.uint8, (b - a,)))


def _decode_all(root: str, m: Manifest, keys: List[str], views: Dict[str, torch.Tensor], dests: Dict[str, np.ndarray]
                ) -> None:
    first: List[Task] = []
    second: List[Task] = []
    for k in keys:
        e = m.tensors[k]
        es = CODES[e.dtype].itemsize
        ref = e.enc.get("ref")
        own = _tasks(e.enc["blocks"], views[k + "\0own"], dests[k], es, k, _path(root, e.file))
        if ref is not None:
            first += _tasks(ref["blocks"], views[k + "\0ref"], dests[k], es, k, _path(root, ref["file"]),
                            " (its reference)")
            second += own
        else:
            first += own
    workers = max(1, min(os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="layerckpt-decode") as ex:
        for tasks in (first, second):
            for f in [ex.submit(_decode_many, tasks[i::workers]) for i in range(workers)]:
                f.result()


def _path(root: str, fname: str) -> str:
    return os.path.join(root, _store.DATA_DIR, fname)


def _tasks(blocks: List[List[int]], view: torch.Tensor, dest: np.ndarray, esize: int, key: str, path: str,
           what: str = "") -> List[Task]:
    base = _span(blocks)[0]
    buf = memoryview(view.numpy())
    out: List[Task] = []
    pos = 0
    for off, elen, rlen, mode in blocks:
        where = f"tensor {key!r}{what} of {path} (bytes {off}..{off + elen})"
        out.append((mode, buf[off - base:off - base + elen], dest[pos:pos + rlen], esize, where, key, path))
        pos += rlen
    return out


def _decode_many(tasks: List[Task]) -> None:
    for mode, data, dest, esize, where, key, path in tasks:
        try:
            _encode.decode_block(mode, data, dest, esize, where)
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(str(e), path=path, tensor=key) from None


def _verify(key: str, e: TensorEntry, dest: np.ndarray, check: Callable, root: str, mpath: str) -> None:
    if check(memoryview(dest), 0) != e.crc:
        path = os.path.join(root, _store.DATA_DIR, e.file)
        ref = e.enc.get("ref")
        also = f" or its reference in {ref['file']}" if ref else ""
        raise CheckpointCorruptError(
            f"checksum mismatch in tensor {key!r} of {path}{also} after decoding; the file is damaged: run "
            f"`layerckpt verify`, or restore an older step", path=path, tensor=key)
