"""Encoded reads: decode the tensors a composite holds encoded (``TensorEntry.enc``, see ``_encode``).

Each tensor's encoded bytes (and its reference's, in the older file that holds it) are read in one span per
file through the ordinary reader (``_read.read_views``, no checksum: the raw checksum is checked after
decoding), then decoded on several threads: first every reference (and every self-contained tensor) into
its destination, then every delta on top of its reference, then each tensor's CRC32C over its decoded
bytes against the manifest's.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..format import _encode, _store
from ..format._layout import CODES
from ..format._manifest import Manifest, TensorEntry
from ..format._places import sealed_ok
from ._read import Want, read_views
from ..errors import CheckpointCorruptError

Task = Tuple[int, memoryview, np.ndarray, int, str, str, str]  # mode, encoded bytes, destination, element size,
#                                                               where (for messages), tensor key, file path


def span(blocks: List[List[int]]) -> Tuple[int, int]:
    """The file range [first byte, end) a list of blocks ([file offset, length, raw length, mode]) spans."""
    if not blocks:
        return 0, 0
    return min(b[0] for b in blocks), max(b[0] + b[1] for b in blocks)


Placed = List[Tuple[List[int], int]]  # blocks of a tensor, each with the raw position it decodes to
Run = Tuple[str, str, Placed]  # (key of the read, file, blocks): blocks read in one span of one file


GROUP = 64 << 20  # encoded bytes read at a time: the decoders work on one group while the next one is read
TASK = 8  # blocks decoded per task (a big tensor's blocks spread over the threads)


def read_encoded(root: str, m: Manifest, mpath: str, keys: List[str], sinks: Dict[str, torch.Tensor], backend,
                 check: Optional[Callable], cfg) -> Tuple[Dict[str, torch.Tensor], int]:
    """Decode the encoded tensors ``keys`` of ``m``: into ``sinks[key]`` (a flat uint8 view of the tensor's
    bytes) where given, else into fresh memory (returned by key).  Returns (fresh tensors, bytes read).
    Of a tensor's reference only the blocks its deltas need are read.  Reads go a group of tensors at a
    time, each group decoded while the next is read."""
    runs = {k: _runs(k, m.tensors[k]) for k in keys}
    out, dests = _destinations(m, mpath, keys, sinks)
    by_file: Dict[str, List[Want]] = {}
    for own, refs in runs.values():
        for key, fname, placed in [own] + refs:
            a, b = span([blk for blk, _ in placed])
            by_file.setdefault(fname, []).append(Want(key, a, b - a, 0, torch.uint8, (b - a,)))
    total = 0
    with _Decoder(root, m, runs, dests) as decoder:
        for fname, wants in sorted(by_file.items()):
            path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest {mpath}")
            for group in _groups(sorted(wants, key=lambda w: w.offset)):
                got, n = read_views(backend, path, m.files[fname].size, group, None, cfg.chunk_bytes,
                                    direct=cfg.direct_io)
                total += n
                for key, view in got.items():
                    decoder.ready(key, view)
        decoder.finish()
    if check is not None:
        for k in keys:
            _verify(k, m.tensors[k], m.files[m.tensors[k].file].step, dests[k], check, root, mpath)
    return out, total


def _destinations(m: Manifest, mpath: str, keys: List[str], sinks: Dict[str, torch.Tensor]
                  ) -> Tuple[Dict[str, torch.Tensor], Dict[str, np.ndarray]]:
    """Where each tensor decodes to: its sink, or fresh memory (returned)."""
    out: Dict[str, torch.Tensor] = {}
    dests: Dict[str, np.ndarray] = {}
    for k in keys:
        sink = sinks.get(k)
        if sink is None:
            out[k] = t = _fresh(k, m.tensors[k], mpath)
            sink = t.reshape(-1).view(torch.uint8)
        dests[k] = sink.numpy()
    return out, dests


def _groups(wants: List[Want]) -> List[List[Want]]:
    out: List[List[Want]] = [[]]
    size = 0
    for w in wants:
        if out[-1] and size + w.nbytes > GROUP:
            out.append([])
            size = 0
        out[-1].append(w)
        size += w.nbytes
    return out


class _Decoder:
    """Decodes each run of blocks once its bytes are read: a reference's blocks at once, a tensor's own
    blocks once every run of its reference is decoding (they wait for those: a delta adds to them)."""

    def __init__(self, root: str, m: Manifest, runs: Dict[str, Tuple[Run, List[Run]]],
                 dests: Dict[str, np.ndarray]):
        self.root, self.m, self.runs, self.dests = root, m, runs, dests
        self.owner = {key: k for k, (own, refs) in runs.items() for key, _, _ in [own] + refs}
        self.left = {k: len(refs) for k, (_, refs) in runs.items()}
        self.deps: Dict[str, List[Future]] = {k: [] for k in runs}
        self.own: Dict[str, torch.Tensor] = {}
        self.futs: List[Future] = []
        self.ex = ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8)), thread_name_prefix="layerckpt-decode")

    def __enter__(self) -> "_Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.ex.shutdown(wait=True, cancel_futures=True)

    def ready(self, key: str, view: torch.Tensor) -> None:
        k = self.owner[key]
        own, refs = self.runs[k]
        if key == own[0]:
            self.own[k] = view
        else:
            run = next(r for r in refs if r[0] == key)
            tasks = _tasks(run[2], view, self.dests[k], self._es(k), k, _path(self.root, run[1]), " (its reference)")
            self.deps[k] += self._submit(tasks, [])
            self.left[k] -= 1
        if k in self.own and self.left[k] == 0:
            tasks = _tasks(own[2], self.own.pop(k), self.dests[k], self._es(k), k, _path(self.root, own[1]))
            self._submit(tasks, self.deps[k])
            self.left[k] = -1  # decoding

    def _es(self, k: str) -> int:
        return CODES[self.m.tensors[k].dtype].itemsize

    def _submit(self, tasks: List[Task], after: List[Future]) -> List[Future]:
        out = [self.ex.submit(_decode_after, after, tasks[i:i + TASK]) for i in range(0, len(tasks), TASK)]
        self.futs += out
        return out

    def finish(self) -> None:
        for f in self.futs:
            f.result()
        missing = [k for k, n in self.left.items() if n != -1]
        if missing:  # cannot happen: every run read is handed over; a decoder that skipped one must not pass
            raise CheckpointCorruptError(f"tensor {missing[0]!r} was not decoded: some of its blocks were not read",
                                         tensor=missing[0])


def _decode_after(after: List[Future], tasks: List[Task]) -> None:
    """Decode ``tasks`` once ``after`` are done (submitted earlier to the same first-in-first-out pool, so
    they are running or done: no wait can block a thread that one of them needs)."""
    for f in after:
        f.result()
    _decode_many(tasks)


def _runs(key: str, e: TensorEntry) -> Tuple[Run, List[Run]]:
    """A tensor's own blocks, and the runs of its reference's blocks that its deltas (and unchanged blocks)
    overlap: only those are read."""
    own = _encode.placed(e.enc["blocks"])
    ref = e.enc.get("ref")
    if ref is None:
        return (key + "\0own", e.file, own), []
    need = [(pos, pos + b[2]) for b, pos in own if b[3] in _encode.READS_REF]
    runs: List[Placed] = []
    last, i = -2, 0
    for j, (b, pos) in enumerate(_encode.placed(ref["blocks"])):
        while i < len(need) and need[i][1] <= pos:  # both in raw order: skip the needs behind this block
            i += 1
        if i < len(need) and need[i][0] < pos + b[2]:
            if j != last + 1:
                runs.append([])
            runs[-1].append((b, pos))
            last = j
    return (key + "\0own", e.file, own), [(f"{key}\0ref{r}", ref["file"], run) for r, run in enumerate(runs)]


def _fresh(key: str, e: TensorEntry, mpath: str) -> torch.Tensor:
    try:
        return torch.empty(e.shape, dtype=CODES[e.dtype])
    except (RuntimeError, MemoryError):
        raise CheckpointCorruptError(f"tensor {key!r} of manifest {mpath} claims {e.nbytes} bytes, more than this "
                                     f"machine can allocate; the manifest may be damaged: run `layerckpt verify`",
                                     path=mpath, tensor=key) from None


def _path(root: str, fname: str) -> str:
    return os.path.join(root, _store.DATA_DIR, fname)


def _tasks(placed: Placed, view: torch.Tensor, dest: np.ndarray, esize: int, key: str, path: str,
           what: str = "") -> List[Task]:
    base = span([b for b, _ in placed])[0]
    buf = memoryview(view.numpy())
    out: List[Task] = []
    for (off, elen, rlen, mode), pos in placed:
        where = f"tensor {key!r}{what} of {path} (bytes {off}..{off + elen})"
        out.append((mode, buf[off - base:off - base + elen], dest[pos:pos + rlen], esize, where, key, path))
    return out


def _decode_many(tasks: List[Task]) -> None:
    for mode, data, dest, esize, where, key, path in tasks:
        try:
            _encode.decode_block(mode, data, dest, esize, where)
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(str(e), path=path, tensor=key) from None


def _verify(key: str, e: TensorEntry, step: int, dest: np.ndarray, check: Callable, root: str, mpath: str) -> None:
    """The decoded bytes are the tensor's own: its CRC, sealed to its key and its file's ``step`` (``_places``),
    matches them (a delta's reference, of an older step, is not sealed apart: what is checked is the tensor)."""
    if not sealed_ok(check, e.crc, key, check(memoryview(dest), 0), step):
        path = os.path.join(root, _store.DATA_DIR, e.file)
        ref = e.enc.get("ref")
        also = f" or its reference in {ref['file']}" if ref else ""
        raise CheckpointCorruptError(
            f"checksum mismatch in tensor {key!r} of {path}{also} after decoding; the file is damaged, or the "
            f"manifest gives the tensor another's blocks: run `layerckpt verify`, or restore an older step",
            path=path, tensor=key)
