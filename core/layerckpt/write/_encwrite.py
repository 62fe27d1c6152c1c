"""Encoded writes: the flush path of ``Config(encoding='delta'|'compress')``, and of ``'auto'`` where its
cost model (``_cost``) encodes some tensor of a save.

The stager copies a save's raw file image into pool buffers as always (the copy is all training waits
for).  Instead of writing each buffer where it lies in the raw image, :class:`EncodingLoop` encodes it (on
the encoder threads, once the caller's copy is over, or at once when the stager runs out of buffers),
compacting the encoded blocks in place at the buffer's start, and writes them one after the other: each
buffer's output, padded to 4 KiB, becomes one ``U8`` tensor of the data file, which stays a valid
safetensors file whose header (reserved up front, written last) lists those tensors.  The manifest says
where each tensor's blocks are and how each was encoded (``TensorEntry.enc``).

:class:`Refs` keeps, per tensor, its reference: a host copy of the bytes of its newest self-contained
version, and where the store holds it.  A delta refers to a reference only once that reference's save is
committed; a save that fails forgets the references it was writing.

Under ``Config(encoding='lossy')`` the fp32 weights that have a reference are stored as bounded-loss deltas
against it (``_qblock``), the moments as bounded-loss codes of their own, a second moment's told against the
codes of its reference where that is smaller; a weight's self-contained versions, which become references,
stay lossless, and a second moment's reference is the bytes its own codes restore to.  The manifest's checksum
of such a tensor is over the bytes a restore decodes (the encoder decodes each block it codes), and its entry
records the error the codes made.
"""
from __future__ import annotations

import collections
import json
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..format import _encode, _qblock
from .. import _faults
from ..io._backend import checksum, checksum_combine
from ..format._layout import DTYPES, Layout, align_up
from ..format._manifest import FileEntry, TensorEntry
from ._stage import StagedChunk, anon_buffer
from ..io._units import KiB
from ._writeloop import WriteLoop

MIN_REF = 64 * KiB  # smaller tensors are compressed on their own each time: no copy kept for them
#: ``Config(encoding='lossy')`` codes fp32 tensors of this many bytes and more (128 elements: a bias, a norm's
#: weight), keeping a reference copy for a weight's deltas however small: on the bench family's dense workloads
#: the tensors between this and MIN_REF were a fifth of a save's bytes once the big ones were coded
LOSSY_MIN = 512
#: a bounded-loss delta's reference is renewed this many times less often than a lossless one's: its errors do not
#: grow with the distance from it (each delta is rounded against the lossless reference), its codes' width only
#: with the log of it, and the reference, written lossless, costs as much as 5-10 deltas
LOSSY_CHAIN = 8
WRITER = "layerckpt"


def threads(n: int) -> int:
    """Encoder threads for ``Config.encode_threads`` (0: half the cores, at least one)."""
    return n if n > 0 else max(1, (os.cpu_count() or 2) // 2)


class _Ref:
    __slots__ = ("data", "esize", "where", "versions", "fails", "skip", "digest")

    def __init__(self, data: np.ndarray, esize: int, fails: int = 0, skip: int = 0):
        self.data = data
        self.esize = esize
        self.where: Optional[Dict[str, Any]] = None  # the manifest's "ref" record, once committed
        self.versions = 0  # versions encoded against it
        #: consecutive saves whose delta did not pay for any block, and the writes left before the next try:
        #: a tensor that changes too much for a delta is written self-contained (renewing its reference)
        #: without the delta's encoding first, trying again after 2, 4, ... up to ``chain`` writes
        self.fails = fails
        self.skip = skip
        self.digest: Optional[List[Any]] = None  # a signed store's: the digest of the file it lies in (``_sign``)


class Refs:
    """Per tensor key, its reference (see the module docstring).  Used by the flusher thread only."""

    def __init__(self, delta: bool, chain: int, quantum: float = 0.0, bits: int = 8):
        self.delta = delta
        self.chain = chain
        self.quantum = quantum  # Config(encoding='lossy'): a weight delta's quantum, in steps' moves
        self.bits = bits  # and its moment codes' width
        self._refs: Dict[str, _Ref] = {}
        self._pending: Dict[str, _Ref] = {}  # written self-contained by the save in flight
        self._used: List[str] = []  # encoded against their reference by the save in flight

    @property
    def memory_bytes(self) -> int:
        return sum(r.data.nbytes for r in self._refs.values()) + sum(r.data.nbytes for r in self._pending.values())

    def plan(self, layout: Layout, self_contained: bool, frozen: AbstractSet[str] = frozenset(),
             modes: Optional[List[str]] = None, step: int = 0, moves: Optional[Dict[str, float]] = None
             ) -> "ItemPlan":
        """For each item of the save about to be written: its reference (or None: self-contained), and the
        buffer its bytes are copied into to become the next reference (or None).  ``frozen``: keys of frozen
        layers, rewritten only if they change: no host copy is kept for them.  ``modes``: per item, 'raw'
        (stored as it is, not encoded, no reference kept), 'compress' or 'delta' (``Config(encoding='auto')``'s
        decisions), or under ``Config(encoding='lossy')`` 'qdelta' (a delta as 'delta', bounded-loss where it
        has a reference), 'qmom' (bounded-loss codes of its own, no reference kept) or 'qsq' (bounded-loss
        codes, told against its reference's for at most ``chain`` versions, the reference the bytes its own
        codes restore to); None: every item 'delta' (or 'compress' where this Refs makes no deltas).
        ``step``: the save's; ``moves``: per key, its RMS move per step over the last interval (a bounded-loss
        delta's quantum is a fraction of one step's move: since its reference, or over the last interval where
        that is more)."""
        out = ItemPlan([], [], {}, quantum=self.quantum, bits=self.bits)
        for i, it in enumerate(layout.items):
            mode = modes[i] if modes is not None else "delta" if self.delta else "compress"
            if mode == "qsq":
                out.lossy[i] = (mode, 0, 0.0)
            if mode == "qmom":
                self._refs.pop(it.key, None)
                out.refs.append(None)
                out.news.append(None)
                out.lossy[i] = (mode, 0, 0.0)
                continue
            if mode == "raw":
                self._refs.pop(it.key, None)  # a save in flight that encodes against it holds its bytes
                out.refs.append(None)
                out.news.append(None)
                out.raw.add(i)
                continue
            delta = self.delta and mode in ("delta", "qdelta", "qsq")
            es = it.tensor.element_size()
            r = self._refs.get(it.key)
            usable = (delta and not self_contained and r is not None and r.where is not None
                      and r.data.size == it.nbytes and r.esize == es
                      and r.versions < self.chain * (LOSSY_CHAIN if mode == "qdelta" else 1))
            if usable and r.skip > 0:  # its deltas have not paid lately: self-contained, a fresh reference
                r.skip -= 1
                usable = False
            if usable:
                out.refs.append(r.data)
                out.news.append(None)
                out.where[i] = r.where
                if mode == "qdelta":
                    out.lossy[i] = (mode, max(1, step - r.where["step"]), (moves or {}).get(it.key, 0.0))
                out.starts[i] = _starts(r.where["blocks"])
                self._used.append(it.key)
                continue
            out.refs.append(None)
            big = it.nbytes >= (LOSSY_MIN if mode in ("qdelta", "qsq") else MIN_REF)
            if delta and big and es in _encode.ESIZES and it.key not in frozen:
                self._refs.pop(it.key, None)  # rewritten: no reference until this save commits
                same = r is not None and r.data.size == it.nbytes
                data = r.data if same else np.empty(it.nbytes, np.uint8)
                self._pending[it.key] = _Ref(data, es, r.fails if same else 0, r.skip if same else 0)
                out.news.append(data)
            else:
                self._refs.pop(it.key, None)
                out.news.append(None)
        return out

    def digests(self) -> Dict[str, Any]:
        """A signed store's digest of each file a reference lies in, by file name."""
        return {r.where["file"]: r.digest for r in self._refs.values() if r.where is not None and r.digest}

    def committed(self, tensors: Dict[str, TensorEntry], files: Dict[str, FileEntry]) -> None:
        for key in self._used:
            r = self._refs.get(key)
            if r is not None:
                r.versions += 1
                e = tensors.get(key)
                paid = e is not None and e.enc is not None and _encode.reads_ref(e.enc["blocks"])
                r.fails = 0 if paid else r.fails + 1
                r.skip = 0 if paid else min(1 << r.fails, self.chain)
        for key, r in self._pending.items():
            e = tensors.get(key)
            if e is None or e.enc is None:
                continue
            f = files[e.file]
            r.where = {"file": e.file, "step": f.step, "rank": f.rank, "size": f.size, "crc": e.crc,
                       "blocks": e.enc["blocks"]}
            r.digest = f.digest
            self._refs[key] = r
        self._pending.clear()
        self._used.clear()

    def drop(self, keys) -> None:
        """These tensors are written raw (``encoding='auto'``): their references' host copies go (a save in
        flight that encodes against one holds its bytes itself)."""
        for k in keys:
            self._refs.pop(k, None)

    def failed(self) -> None:
        """The save in flight failed: what it was writing is no reference (its buffers hold its bytes)."""
        self._pending.clear()
        self._used.clear()


@dataclass
class ItemPlan:
    refs: List[Optional[np.ndarray]]  # per item: its reference's bytes, or None
    news: List[Optional[np.ndarray]]  # per item: where its bytes go to become a reference, or None
    where: Dict[int, Dict[str, Any]]  # item -> its reference's manifest record

    #: item -> {raw start of each of its reference's blocks: (stored length, raw length)}
    starts: Dict[int, Dict[int, Tuple[int, int]]] = field(default_factory=dict)
    raw: set = field(default_factory=set)  # items stored as they are, not encoded
    #: item -> (its bounded-loss code, steps since its reference, its RMS move per step over the last interval or
    #: 0.0): ``Config(encoding='lossy')``
    lossy: Dict[int, Tuple[str, int, float]] = field(default_factory=dict)
    quantum: float = 0.0
    bits: int = 8

    def rival(self, i: int, start: int, length: int) -> Optional[int]:
        """The stored size of item ``i``'s reference's block of raw bytes [start, start + length), if it has
        one there (None: not known)."""
        return rival(self.starts.get(i, {}), start, length)


def rival(starts: Dict[int, Tuple[int, int]], start: int, length: int) -> Optional[int]:
    """Of a reference's blocks by raw start (``_starts``): the stored size of its block of raw bytes
    [start, start + length), if it has one there (None: not known)."""
    hit = starts.get(start)
    return hit[0] if hit is not None and hit[1] == length else None


def _starts(blocks: List[List[int]]) -> Dict[int, Tuple[int, int]]:
    return {pos: (b[1], b[2]) for b, pos in _encode.placed(blocks)}


def header_reserve(layout: Layout, chunk_bytes: int) -> int:
    """Bytes reserved at the file's start for the safetensors header of the encoded file."""
    return reserve(-(-layout.size // chunk_bytes))


def reserve(n: int) -> int:
    """Bytes reserved at an encoded file's start for a header naming ``n`` spans (``header_bytes``)."""
    big = 10 ** 19
    one = len(json.dumps({f"enc/{n:07d}": {"dtype": "U8", "shape": [big], "data_offsets": [big, big]}}))
    meta = len(json.dumps(_metadata()))
    return align_up(8 + meta + 32 + n * (one + 1))


def _metadata() -> Dict[str, Any]:
    return {"__metadata__": {"format": "pt", "writer": WRITER, "encoding": _encode.CODEC}}


def header_bytes(spans: List[Tuple[int, int]], reserve: int) -> bytes:
    """The safetensors header naming each written buffer's output (``spans``: file offset, length) as a U8
    tensor, padded with spaces to ``reserve`` bytes."""
    meta = _metadata()
    for j, (off, n) in enumerate(spans):
        meta[f"enc/{j:07d}"] = {"dtype": "U8", "shape": [n], "data_offsets": [off - reserve, off - reserve + n]}
    body = json.dumps(meta, separators=(",", ":")).encode()
    hlen = reserve - 8
    if len(body) > hlen:  # cannot happen: the reserve bounds every entry
        raise ValueError("encoded file header exceeds its reserve")
    return hlen.to_bytes(8, "little") + body + b" " * (hlen - len(body))


def chunk_blocks(layout: Layout, chunk_bytes: int) -> Dict[int, List[Tuple[int, int, int]]]:
    """Chunk index -> its blocks (item, image start, image end), in image order."""
    out: Dict[int, List[Tuple[int, int, int]]] = collections.defaultdict(list)
    for i, it in enumerate(layout.items):
        for a, b in _encode.cuts(it.offset, it.offset + it.nbytes, chunk_bytes):
            out[a // chunk_bytes].append((i, a, b))
    for v in out.values():
        v.sort(key=lambda x: x[1])
    return out


Record = Tuple[int, int, int, int, int, int]  # item, start in the tensor, raw length, mode, start in the output, length
Observed = Tuple[int, int, int, float]  # item, raw length, stored length, CPU seconds: one block's encode
#: a block of a bounded-loss item: item, the checksum of the bytes it restores to, raw length, whether coded
#: with loss, its largest element error, the sum of its squared errors and of its squared move (or values)
Restored = Tuple[int, int, int, bool, float, float, float]


def _lossy_block(raw: np.ndarray, ref: Optional[np.ndarray], esize: int, lossy: Tuple[str, int, float],
                 plan: ItemPlan, rival: Optional[int], new: Optional[np.ndarray] = None
                 ) -> Tuple[int, Optional[bytes], Tuple[int, bool, float, float, float]]:
    """(mode, encoded bytes, (checksum of what it restores to, coded with loss, largest error, summed squared
    error, summed squared move or value)) of one block of a bounded-loss item; lossless where its code does
    not fit it, unchanged (``SAME``) where it equals its reference (the bytes it restores to).  ``lossy``: the
    item's (code, steps since its reference, recent move per step).  ``new``: where a second moment's block
    goes to become a reference: the bytes it restores to are put there."""
    code, steps, recent = lossy
    if ref is not None and np.array_equal(raw, ref):
        return _encode.SAME, b"", (checksum(raw), False, 0.0, 0.0, 0.0)
    got = _qblock.encode(code, raw, ref, plan.quantum, steps, plan.bits, recent)
    if got is None:
        mode, data = _encode.encode_block(raw, ref, esize, rival)
        return mode, data, (checksum(raw), False, 0.0, 0.0, 0.0)
    mode, data, restored, emax, esq, ss = got
    if new is not None and code == "qsq":
        new[:] = restored
    return mode, data, (checksum(restored), True, emax, esq, ss)


def encode_chunk(s: StagedChunk, blocks: List[Tuple[int, int, int]], layout: Layout, plan: ItemPlan,
                 hurry: Optional[threading.Event] = None
                 ) -> Tuple[int, List[Record], float, List[Observed], List[Restored]]:
    """Encode a staged buffer's blocks, compacted in place at its start; returns (bytes, records, seconds,
    what each block's encode took and gave, what each block of a bounded-loss item restores to).  Once
    ``hurry`` is set the blocks left are stored as they are (self-contained), nothing compressed; items
    ``plan.raw`` are always stored as they are."""
    t0 = time.perf_counter()
    arr = s.chunk.tensor.numpy()
    pos = 0
    recs: List[Record] = []
    seen: List[Observed] = []
    restored: List[Restored] = []
    for i, a, b in blocks:
        it = layout.items[i]
        raw = arr[a - s.base:b - s.base]
        ra, rb = a - it.offset, b - it.offset
        new = plan.news[i]
        if new is not None:
            new[ra:rb] = raw
        ref = plan.refs[i]
        lossy = plan.lossy.get(i)
        if i in plan.raw or (hurry is not None and hurry.is_set()):
            mode, data = _encode.RAW, None
            if lossy is not None:
                restored.append((i, checksum(raw), b - a, False, 0.0, 0.0, 0.0))
        elif lossy is not None:
            part = None if ref is None else ref[ra:rb]
            mode, data, got = _lossy_block(raw, part, it.tensor.element_size(), lossy, plan,
                                           None if ref is None else plan.rival(i, ra, rb - ra),
                                           None if new is None else new[ra:rb])
            restored.append((i, got[0], b - a, *got[1:]))
        else:
            mode, data, stored, cpu = _encode.encode_timed(
                raw, None if ref is None else ref[ra:rb], it.tensor.element_size(),
                None if ref is None else plan.rival(i, ra, rb - ra))
            seen.append((i, b - a, stored, cpu))
        if mode == _encode.RAW:
            n = b - a
            if pos != a - s.base:
                arr[pos:pos + n] = raw.copy()
        else:
            n = len(data)
            arr[pos:pos + n] = np.frombuffer(data, dtype=np.uint8)
        recs.append((i, ra, b - a, mode, pos, n))
        pos += n
    return pos, recs, time.perf_counter() - t0, seen, restored


class EncodingLoop(WriteLoop):
    """A :class:`WriteLoop` that encodes each staged buffer before writing it (see the module docstring).
    ``run`` returns the raw bytes' checksums; then ``size`` is the file's size and :meth:`entries` what the
    manifest says of each tensor."""

    def __init__(self, *args, layout: Layout, plan: ItemPlan, pool_exec: ThreadPoolExecutor, chunk_bytes: int,
                 hurry: Optional[threading.Event] = None,
                 observe: Optional[Callable[[List[Observed]], None]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.observe = observe  # told what each buffer's encodes took and gave (the cost model)
        self.hurry = hurry if hurry is not None else threading.Event()
        self.hurried = 0  # buffers written without encoding because a save() waited
        self.layout = layout
        self.plan = plan
        self.exec = pool_exec
        self.C = chunk_bytes
        self.blocks = chunk_blocks(layout, chunk_bytes)
        self.reserve = header_reserve(layout, chunk_bytes)
        self.size = self.reserve
        self._waiting: "collections.deque[StagedChunk]" = collections.deque()
        self._encoding: "collections.deque[Tuple[StagedChunk, Future]]" = collections.deque()
        self._spans: List[Tuple[int, int]] = []
        self._blocks: Dict[int, List[List[int]]] = {i: [] for i in range(len(layout.items))}
        self._fd = -1
        self._direct = False
        self.encode_s = 0.0  # seconds the encoder threads spent on this file, summed over them
        #: bounded-loss item -> [checksum of its restored bytes so far, blocks coded with loss, largest error,
        #: summed squared error, summed squared move or value]
        self._restored: Dict[int, List[Any]] = {}

    # the WriteLoop's steps, encoded
    def _pump(self, fd: int, direct: bool) -> None:
        self._fd, self._direct = fd, direct
        try:
            super()._pump(fd, direct)
        except BaseException:
            self._abandon_encodes()  # before the queue is consumed: the stager may wait for these buffers
            raise

    def _starved(self) -> None:
        """Encode and write the oldest buffer now: that frees one."""
        self._dispatch(1)
        self._drain(1)
        self.writes.reap(1)

    def _take(self, fd: int, direct: bool, s: StagedChunk) -> None:
        """Encode once the caller's copy is over (not to compete with it for a core), write what is done."""
        if self.tap is not None:  # before the buffer is encoded in place
            self.tap(s.base, s.chunk.view, s.fill)
        self._waiting.append(s)
        if self._staged is None or self._staged.is_set():
            self._dispatch(len(self._waiting))
        self._drain(0)

    def _finish(self, fd: int, direct: bool, size: int, sync, phases: Dict[str, float]) -> None:
        try:
            self._dispatch(len(self._waiting))
            self._drain(len(self._encoding))
        except BaseException:
            self._abandon_encodes()
            raise
        self.writes.reap(self.writes.inflight)
        phases["encode"] = self.encode_s
        _write_header(fd, header_bytes(self._spans, self.reserve))
        if self.recycled:  # a spare written over: what lies past the encoded file goes
            os.ftruncate(fd, self.size)
        t = time.perf_counter()
        sync(fd)
        phases["fdatasync"] = time.perf_counter() - t

    def _dispatch(self, n: int) -> None:
        """Checksum (in order: a tensor's checksum runs across buffers) and hand ``n`` waiting buffers to the
        encoder threads."""
        for _ in range(min(n, len(self._waiting))):
            _faults.point("flush.checksum")
            s = self._waiting.popleft()
            for i, a, b in s.segs:
                if i not in self.plan.lossy:  # (a bounded-loss item's is over the bytes it restores to)
                    self.writes.crcs[i] = checksum(s.chunk.view[a:b], self.writes.crcs[i])
            blocks = self.blocks.get(s.base // self.C, [])
            self._encoding.append((s, self.exec.submit(encode_chunk, s, blocks, self.layout, self.plan, self.hurry)))

    def _drain(self, want: int) -> None:
        """Write the encoded buffers at the head of the line: ``want`` of them at least (waiting for them),
        and any others already done."""
        while self._encoding and (want > 0 or self._encoding[0][1].done()):
            s, fut = self._encoding.popleft()
            want -= 1
            try:
                n, recs, took, seen, restored = fut.result()
                self.encode_s += took
                self._fold(restored)
                if self.observe is not None and seen:
                    self.observe(seen)
                self.hurried += self.hurry.is_set() and any(r[3] == _encode.RAW for r in recs)
            except BaseException:
                self.writes.pool.release(s.chunk)
                raise
            self._write(s, n, recs)

    def _fold(self, restored: List[Restored]) -> None:
        """Each bounded-loss item's checksum and errors, over its blocks in order."""
        for i, crc, n, coded, emax, esq, ss in restored:
            r = self._restored.get(i)
            if r is None:
                self._restored[i] = [crc, int(coded), emax, esq, ss]
                continue
            r[0] = checksum_combine(r[0], crc, n)
            r[1] += coded
            r[2] = max(r[2], emax)
            r[3] += esq
            r[4] += ss

    def _write(self, s: StagedChunk, n: int, recs: List[Record]) -> None:
        off = self.size
        for i, ra, rlen, mode, pos, elen in recs:  # every block, those that store nothing (unchanged) too
            self._blocks[i].append([off + pos, elen, rlen, mode])
        if n == 0:
            self.writes.pool.release(s.chunk)
            return
        padded = align_up(n)
        s.chunk.view[n:padded] = bytes(padded - n)
        self.writes.submit(self._fd, s.chunk, off, padded, (), self.path)
        self._spans.append((off, padded))
        self.size += padded

    def entries(self, fname: str, crcs: List[int]) -> Dict[str, TensorEntry]:
        """What the manifest says of each tensor written: raw checksum (plain: ``_commit.merge`` seals it to the
        tensor's key and the save's step, ``_places``), blocks, reference."""
        out = {}
        for i, it in enumerate(self.layout.items):
            blocks = self._blocks[i]
            # the reference is recorded even where no block reads it (every block self-contained): it is this
            # tensor's reference still, which the saves after this one may encode against, so every composite
            # lists its file and retention keeps it (a restore reads only the reference blocks a delta needs)
            enc = {"codec": _encode.CODEC, "blocks": blocks, "ref": self.plan.where.get(i)}
            crc = crcs[i]
            got = self._restored.get(i)
            if got is not None:
                crc = got[0]
                if got[1]:
                    enc["lossy"] = _lossy_record(self.plan.lossy[i], it.nbytes // 4, *got[2:])
            out[it.key] = TensorEntry(file=fname, dtype=DTYPES[it.tensor.dtype], shape=list(it.tensor.shape),
                                      offset=blocks[0][0] if blocks else self.reserve, nbytes=it.nbytes,
                                      crc=crc, enc=enc)
        return out

    def _abandon_encodes(self) -> None:
        for s, fut in self._encoding:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the save fails anyway; the buffer goes back
                pass
            self.writes.pool.release(s.chunk)
        self._encoding.clear()
        for s in self._waiting:
            self.writes.pool.release(s.chunk)
        self._waiting.clear()



def _lossy_record(lossy: Tuple[str, int, float], n: int, emax: float, esq: float, ss: float) -> Dict[str, Any]:
    """The manifest's record of a tensor stored with bounded loss: its code, its largest and RMS element error,
    and the RMS of what the error is measured against: a weight's move per step (since its reference, or over
    the last interval where that is more: what its quantum is a fraction of; so ``rms_err / move`` is the
    error in steps of training), a moment's values."""
    code, steps, recent = lossy
    out = {"code": code, "max_err": emax, "rms_err": (esq / max(1, n)) ** 0.5}
    rms = (ss / max(1, n)) ** 0.5
    if code == "qdelta":
        out["move"] = max(rms / max(1, steps), recent if math.isfinite(recent) else 0.0)
    else:
        out["rms"] = rms
    return out


def _write_header(fd: int, header: bytes) -> None:
    """The header at offset 0, from page-aligned memory (the file may be open with O_DIRECT)."""
    buf = anon_buffer(len(header))
    try:
        buf[:] = header
        view = memoryview(buf)
        done = 0
        while done < len(header):
            done += os.pwrite(fd, view[done:], done)
        view.release()
    finally:
        buf.close()


def merge_refs(tensors: Dict[str, TensorEntry], files: Dict[str, FileEntry], refs: Optional["Refs"] = None) -> None:
    """Every file a tensor's reference lives in, listed with the files of the composite (retention and the
    tiers keep and copy what ``files`` lists), with its digest in a signed store (``refs``: the writer's)."""
    digests = refs.digests() if refs is not None else {}
    for e in tensors.values():
        ref = e.enc.get("ref") if e.enc else None
        if ref and ref["file"] not in files:
            files[ref["file"]] = FileEntry(step=ref["step"], rank=ref["rank"], size=ref["size"],
                                           digest=digests.get(ref["file"]))
