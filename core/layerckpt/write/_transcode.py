"""Transcode: a data file as a slower tier wants it (``Config(encoding='auto')`` with a remote tier).

The local disk gets raw bytes where encoding does not pay there; a remote that moves far fewer bytes a
second may be paid by the same encoding (``_cost``, with the remote as the sink: its ``remote_bandwidth``
or its measured upload rate).  Before the tier uploads a data file whose tensors the cost model encodes for
it, :class:`Transcoder` writes an encoded copy of the file (the format the flusher writes, ``_encwrite``):
each tensor delta-encoded against the version of it the tier already holds (a host copy kept here, for at
most ``delta_chain`` versions, then a fresh self-contained one), compressed on its own, or raw, block by
block as ``_encode`` does; the tier's manifest names the copy and its encoded entries, and lists the files
of the references its deltas read, so that the tier's retention keeps them.  A composite whose remote copy
must restore from its own files (``remote_every='base'``) is transcoded without deltas.  What is read back
from the local file is checked against its checksum before anything is encoded from it.

Used by one tier's copier thread; the uploads of one composite may run on several threads at once, so the
encoding of each file takes a lock.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..select import _cost
from ..format import _encode, _store
from ..io._backend import checksum
from ._commit import unlink_quietly
from ._encwrite import MIN_REF, _starts, header_bytes, reserve, rival
from ..format._layout import ITEMSIZE
from ..format._manifest import FileEntry, Manifest, TensorEntry
from ..format._places import sealed_ok
from ..errors import CheckpointCorruptError

#: (the tier's files of the copy, its tensors' entries, each file's size)
Done = Tuple[List[str], Dict[str, TensorEntry], Dict[str, int]]
PART = 64 << 20  # encoded bytes per part of a copy: one part is uploaded while the next is encoded


class _Ref:
    __slots__ = ("data", "esize", "where", "versions")

    def __init__(self, data: np.ndarray, esize: int):
        self.data = data
        self.esize = esize
        self.where: Optional[Dict[str, Any]] = None  # the tier manifest's "ref" record, once committed there
        self.versions = 0


class Transcoder:
    """A tier's encoded copies of local data files, and the references its deltas are taken against."""

    def __init__(self, cost: _cost.CostModel, sink: _cost.Sink, charge: Callable[[], float], chain: int,
                 delta: bool = True):
        self.cost = cost
        self.sink = sink
        self.charge = charge
        self.chain = chain
        self.delta = delta
        self.refs: Dict[str, _Ref] = {}
        self._pending: Dict[str, _Ref] = {}  # written self-contained by the composite being copied
        self._used: List[str] = []  # encoded against their reference by it
        #: local file -> its encoded copy on the tier, once committed there (a later composite that reads the
        #: same tensors of the file reuses it), and this composite's
        self.done: Dict[str, Done] = {}
        self._new: Dict[str, Done] = {}
        self._lock = threading.Lock()
        #: local file -> what the cost model decided for its kinds on this tier, and why (the tier manifest's
        #: ``coding``), for the composite being copied
        self.coding: Dict[str, Dict[str, Any]] = {}
        self.raw_bytes = 0  # bytes of the local files transcoded (what uploading them as they are would take)
        self.encoded_bytes = 0  # bytes of their encoded copies

    @property
    def memory_bytes(self) -> int:
        return sum(r.data.nbytes for r in self.refs.values()) + sum(r.data.nbytes for r in self._pending.values())

    def modes(self, m: Manifest, f: str, bases_only: bool) -> Optional[Dict[str, Tuple[str, str]]]:
        """key -> (how each tensor ``m`` reads from the local file ``f`` is written to the tier, its kind); None
        where the file goes as it is (nothing of it encoded for the tier, or it was encoded locally already)."""
        entries = {k: e for k, e in m.tensors.items() if e.file == f}
        if not entries or any(e.enc is not None for e in entries.values()):
            return None
        frozen = {k for layer in m.layers.values() if layer.frozen for k in layer.tensors}
        charge = self.charge()
        verdicts: Dict[Tuple[str, bool], str] = {}
        record: Dict[str, Dict[str, Any]] = {}
        out = {}
        for k, e in entries.items():
            kind = _cost.kind(k, e.dtype, k in frozen)
            delta_ok = self.delta and not bases_only and k not in frozen and ITEMSIZE[e.dtype] in _encode.ESIZES
            mode = verdicts.get((kind, delta_ok))
            if mode is None:
                v = self.cost.decide(kind, self.sink, charge, delta_ok)
                mode = verdicts[(kind, delta_ok)] = v.mode
                record.setdefault(kind, {**v.record(self.sink, charge), "tensors": 0, "bytes": 0})
            out[k] = (mode if e.nbytes >= _cost.MIN_BYTES else _cost.RAW, kind)
            if e.nbytes >= _cost.MIN_BYTES:
                record[kind]["tensors"] += 1
                record[kind]["bytes"] += e.nbytes
        with self._lock:
            self.coding[f] = {k: r for k, r in record.items() if r["tensors"]}
        return out if any(v[0] != _cost.RAW for v in out.values()) else None

    def write(self, root: str, f: str, m: Manifest, modes: Dict[str, Tuple[str, str]], name: str,
              fresh: Callable[[], str], upload: Callable[[str, str], None]) -> Done:
        """The encoded copy of the local file ``f`` (the tensors of ``m`` in it), in parts of about ``PART``
        bytes: the first named ``name``, the next ones ``fresh()``; each part is handed to ``upload(path,
        name)`` (on a thread of its own) as soon as it is written, while the next one is encoded, and its file
        removed after.  Returns (the parts' names, the entries, each part's size)."""
        with self._lock:
            return self._write(root, f, m, modes, name, fresh, upload)

    def _write(self, root: str, f: str, m: Manifest, modes: Dict[str, Tuple[str, str]], name: str,
               fresh: Callable[[], str], upload: Callable[[str, str], None]) -> Done:
        src = _store.safe_join(root, _store.DATA_DIR, f, "the tier's copy")
        keys = sorted(modes, key=lambda k: m.tensors[k].offset)
        entries: Dict[str, TensorEntry] = {}
        sizes: Dict[str, int] = {}
        names: List[str] = []
        pending: List[Future] = []
        part: Optional[_Part] = None
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        ex = ThreadPoolExecutor(1, thread_name_prefix="layerckpt-upload")

        def send(p: _Part) -> None:
            sizes[p.name] = p.close()
            pending.append(ex.submit(_upload_then_remove, upload, p.path, p.name))

        try:
            for k in keys:
                e = m.tensors[k]
                raw = _read(fd, e.offset, e.nbytes, src)
                if not sealed_ok(checksum, e.crc, k, checksum(memoryview(raw), 0), m.files[f].step):
                    raise CheckpointCorruptError(f"tensor {k!r} in {src} does not match its checksum; the "
                                                 f"tier's copy of it was not made", path=src, tensor=k)
                if part is None:
                    part = _Part(src, len(names), name if not names else fresh())
                    names.append(part.name)
                blocks, ref = self._encode(k, e, raw, *modes[k], part.out, part.pos)
                part.pos += sum(b[1] for b in blocks)
                entries[k] = TensorEntry(file=part.name, dtype=e.dtype, shape=list(e.shape),
                                         offset=blocks[0][0] if blocks else part.pos, nbytes=e.nbytes, crc=e.crc,
                                         enc={"codec": _encode.CODEC, "blocks": blocks, "ref": ref})
                if part.pos >= PART:
                    send(part)
                    part = None
            if part is not None:
                send(part)
                part = None
            for p in pending:
                p.result()
        except BaseException:
            if part is not None:
                part.discard()
            for p in pending:
                try:
                    p.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        finally:
            os.close(fd)
            ex.shutdown(wait=True)
        self.raw_bytes += m.files[f].size
        self.encoded_bytes += sum(sizes.values())
        done = (names, entries, sizes)
        self._new[f] = done
        return done

    def _encode(self, key: str, e: TensorEntry, raw: np.ndarray, mode: str, kind_: str, out, pos: int
                ) -> Tuple[List[List[int]], Optional[Dict[str, Any]]]:
        """Write one tensor's blocks at ``pos`` of ``out``; returns its blocks and its reference's record."""
        es = ITEMSIZE[e.dtype]
        r = self.refs.get(key)
        ref, where, starts = None, None, {}
        if mode == _cost.DELTA and r is not None and r.where is not None and r.data.size == e.nbytes \
                and r.esize == es and r.versions < self.chain:
            ref, where, starts = r.data, r.where, _starts(r.where["blocks"])
            self._used.append(key)
        elif mode == _cost.DELTA and e.nbytes >= MIN_REF:
            self.refs.pop(key, None)  # a fresh self-contained version: the next reference, once committed
            self._pending[key] = _Ref(raw.copy(), es)
        elif mode != _cost.DELTA:
            self.refs.pop(key, None)
        blocks: List[List[int]] = []
        for a in range(0, max(e.nbytes, 1), _encode.BLOCK):
            blk = raw[a:a + _encode.BLOCK]
            if not blk.size:
                break
            if mode == _cost.RAW:
                m_, data = _encode.RAW, None
            else:
                m_, data, n, cpu = _encode.encode_timed(blk, None if ref is None else ref[a:a + blk.size], es,
                                                        rival(starts, a, blk.size))
                self.cost.observe(kind_, _cost.DELTA if ref is not None else _cost.COMPRESS, blk.size, max(n, 1),
                                  cpu)
            payload = blk if m_ == _encode.RAW else np.frombuffer(data, dtype=np.uint8)
            out.write(memoryview(payload))
            blocks.append([pos, payload.size, blk.size, m_])
            pos += payload.size
        return blocks, where

    def committed(self, m: Manifest, d: Dict[str, Any]) -> None:
        """The tier committed ``d`` (the tier's manifest of ``m``): this composite's copies and references are
        the tier's now."""
        for key in self._used:
            r = self.refs.get(key)
            if r is not None:
                r.versions += 1
        for key, r in self._pending.items():
            e = d["tensors"].get(key)
            if e is None or not e.get("enc"):
                continue
            f = d["files"][e["file"]]
            r.where = {"file": e["file"], "step": f["step"], "rank": f["rank"], "size": f["size"], "crc": e["crc"],
                       "blocks": e["enc"]["blocks"]}
            self.refs[key] = r
        self.done.update(self._new)
        self.failed()

    def keep_only(self, held: AbstractSet[str]) -> None:
        """Forget the references and copies whose files the tier no longer ``held`` (its retention removes a file
        once no composite it keeps names it, as when the copies after it went raw): a delta is never taken against
        a file that is gone, and a gone copy is never reused; a tensor without a reference is written self-contained
        by the next encoded copy."""
        with self._lock:
            self.refs = {k: r for k, r in self.refs.items() if r.where is None or r.where["file"] in held}
            self.done = {f: d for f, d in self.done.items() if all(n in held for n in d[0])}

    def names(self, f: str) -> List[str]:
        """The tier files of the committed copy of the local file ``f`` (none: not transcoded)."""
        got = self.done.get(f)
        return got[0] if got is not None else []

    def failed(self) -> None:
        """The copy of a composite ended (failed, or committed and recorded): nothing of it is pending."""
        self._pending.clear()
        self._used.clear()
        self._new.clear()
        self.coding.clear()


class _Part:
    """One part of an encoded copy, being written: a safetensors file whose one ``U8`` tensor spans its blocks
    (the header, whose size is reserved up front, is written last)."""

    def __init__(self, src: str, index: int, name: str):
        self.name = name
        self.path = f"{src}.tier{index}.tmp"
        self.reserve = reserve(1)
        self.out = open(self.path, "wb")
        self.out.write(bytes(self.reserve))
        self.pos = self.reserve

    def close(self) -> int:
        self.out.seek(0)
        self.out.write(header_bytes([(self.reserve, self.pos - self.reserve)], self.reserve))
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        return self.pos

    def discard(self) -> None:
        self.out.close()
        unlink_quietly(self.path)


def _upload_then_remove(upload: Callable[[str, str], None], path: str, name: str) -> None:
    try:
        upload(path, name)
    finally:
        unlink_quietly(path)


def apply(d: Dict[str, Any], copies: Dict[str, Done], where: Dict[str, str], m: Manifest) -> None:
    """The tier's manifest ``d`` (``_tiers.renamed``), with each transcoded local file's copy: its parts in
    place of the file, the encoded entries of the tensors ``m`` reads from it, and every file a reference of them
    lives in listed.  A copy made for an older composite may hold tensors ``m`` reads from a newer file (a layer
    written again since): those keep the newer file's entries."""
    from ..format._manifest import plain

    for f, (names, entries, sizes) in copies.items():
        if f not in m.files:
            continue
        fe = d["files"].pop(where[f])
        for name in names:
            d["files"][name] = {**fe, "size": sizes[name]}
        for k, e in entries.items():
            t = m.tensors.get(k)
            if t is None or t.file != f:
                continue
            d["tensors"][k] = plain(e)
            ref = e.enc.get("ref") if e.enc else None
            if ref and ref["file"] not in d["files"]:
                d["files"][ref["file"]] = plain(FileEntry(step=ref["step"], rank=ref["rank"], size=ref["size"]))


def _read(fd: int, offset: int, n: int, path: str) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise CheckpointCorruptError(f"{path} ends before the bytes its manifest places at {offset}..{offset + n}",
                                         path=path)
        got += k
    return buf

