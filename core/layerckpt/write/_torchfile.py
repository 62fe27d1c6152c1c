"""Standard ``torch.save`` files through layerckpt's writer: staged, asynchronous, aligned, durable.

torch lays the file out and layerckpt moves the bytes.  ``torch.save`` runs under
``torch.serialization.skip_data()`` into a recorder that keeps what torch writes (zip headers,
``data.pkl``, the central directory) and notes a hole where each storage's bytes belong; the
storages, numbered as torch numbers them (first pickled, first numbered), fill the holes.  That
image is copied into pooled, page-aligned buffers on the caller's thread (``save`` returns then);
one background thread writes the buffers in order with O_DIRECT through the I/O backend (the loop the
checkpoint's flusher writes through, ``_writeloop``), fsyncs
``<path>.<pid>.tmp``, renames it over ``path`` and fsyncs the directory.

The file is the one ``torch.save`` writes with ``storage_alignment=4096`` (each storage starts on a
page, so ``torch.load(mmap=True)`` maps whole pages) and ``compute_crc32=False``: the zip's CRC-32
fields are zero.  ``torch.load`` does not check them; other zip tools (``zipfile.testzip``) report
a CRC mismatch.  An object this cannot lay out is written by a plain ``torch.save`` instead.
"""
from __future__ import annotations

import collections
import io
import logging
import os
import pickle
import queue
import shutil
import threading
import time
import warnings
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.serialization import config as torch_config

from . import _commit
from ..format import _store
from ..io._backend import make_backend, open_file
from ._flush import Pending
from ._stage import BufferPool, Filler, Handoff, Signal
from ._writeloop import WriteLoop, as_checkpoint_error, discard
from ..config import ALIGN, Config
from ..errors import CheckpointError

log = logging.getLogger("layerckpt")

_LAYOUT = {"save.storage_alignment": ALIGN, "save.compute_crc32": False}


class PendingFile(Pending):
    """Handle of one file being written: ``wait()`` returns once it is durable at ``path``."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.nbytes = 0  # the file's size (0 when a plain torch.save wrote it)
        self.stall_s = self.durable_s = 0.0  # from the save() call to its return / to durable
        self._t0 = time.perf_counter()

    def _what(self) -> str:
        return self.path

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self.error, self.durable_s = error, time.perf_counter() - self._t0
        self._done.set()

    def __repr__(self) -> str:
        return f"PendingFile({self.path!r}, {'failed' if self.error else 'durable' if self.done() else 'writing'})"


class _Recorder:
    """The file object torch.save writes to under skip_data(): keeps the bytes, and the length of each
    hole torch seeks over (a storage's bytes)."""

    def __init__(self) -> None:
        self.parts: List[Union[bytearray, int]] = []
        self.size = 0

    def write(self, data: Any) -> int:
        if self.parts and isinstance(self.parts[-1], bytearray):
            self.parts[-1] += data
        else:
            self.parts.append(bytearray(data))
        self.size += memoryview(data).nbytes
        return memoryview(data).nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or offset <= 0:
            raise io.UnsupportedOperation(f"seek({offset}, {whence}): only skipping forward is recorded")
        self.parts.append(offset)
        self.size += offset
        return self.size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass


def _storages(obj: Any) -> List[torch.UntypedStorage]:
    """Every storage ``torch.save(obj)`` writes, in its key order ("0", "1", ...): torch keys a storage
    when its pickler first meets it, so the same pickling meets them in the same order."""
    found: Dict[int, torch.UntypedStorage] = {}

    class Numbering(pickle.Pickler):
        def persistent_id(self, o: Any) -> Optional[str]:
            if isinstance(o, torch.storage.TypedStorage):
                o = o._untyped_storage
            elif not torch.is_storage(o):
                return None
            found.setdefault(o._cdata, o)
            return ""

    Numbering(io.BytesIO(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(found.values())


def layout(obj: Any) -> Optional[Tuple[List[Any], int]]:
    """The file image of ``torch.save(obj)``: segments in file order (bytes torch wrote, or a storage's bytes,
    see :func:`_bytes_of`) and the size; None if it cannot be laid out (a plain torch.save writes it then,
    or raises why it cannot)."""
    rec = _Recorder()
    try:  # both passes pickle as torch.save does under skip_data() (an XLA tensor refuses there)
        with warnings.catch_warnings(), torch_config.patch(_LAYOUT), torch.serialization.skip_data():
            warnings.filterwarnings("ignore", "Serializing tensors on the meta device under skip_data")
            storages = _storages(obj)
            torch.save(obj, rec)
    except Exception:  # noqa: BLE001
        return None
    full = [s for s in storages if s.nbytes()]  # an empty storage leaves no hole
    if any(s.device.type not in ("cpu", "cuda") for s in full) or \
            [s.nbytes() for s in full] != [p for p in rec.parts if isinstance(p, int)]:
        return None
    it = iter(full)
    return [p if isinstance(p, bytearray) else _bytes_of(next(it)) for p in rec.parts], rec.size


def _bytes_of(s: torch.UntypedStorage) -> Any:
    """A storage's bytes: a numpy array on the CPU (copied by one memcpy that lets go of the GIL; torch's
    copy_ splits each copy over its thread pool, slow where the cores are busy), else a uint8 tensor."""
    t = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
    return t.numpy() if s.device.type == "cpu" else t


def _stage(segments: List[Any], pool: BufferPool, out: "queue.Queue[Handoff]") -> None:
    """Copy the image into pool chunks, handing each full one to the writer at once, then DONE."""
    filler = Filler(pool, out)
    try:
        for seg in segments:
            src = np.frombuffer(seg, dtype=np.uint8) if isinstance(seg, bytearray) else seg
            n, pos = len(src), 0
            while pos < n:
                chunk, at, k = filler.span(n - pos)
                if isinstance(src, np.ndarray):
                    np.frombuffer(chunk.mem, dtype=np.uint8)[at:at + k] = src[pos:pos + k]
                else:  # a CUDA storage, copied synchronously to this (pageable) buffer
                    chunk.tensor[at:at + k].copy_(src[pos:pos + k])
                filler.advance(k)
                pos += k
    except BaseException:
        filler.drop()  # not handed over: back to the pool
        raise
    filler.finish()


class TorchFileWriter:
    """Writes ``torch.save`` files on one background thread, started by a save and gone once idle.

    Writes run in the order of the ``save`` calls (a later save of a path lands after an earlier one);
    a write that failed is kept until :meth:`check` (or its :meth:`PendingFile.wait`) raises it.
    """

    def __init__(self, config: Config):
        self.config = config
        self._pool: Optional[BufferPool] = None
        self._jobs: Deque[Tuple[PendingFile, "queue.Queue[Handoff]"]] = collections.deque()
        self._lock = threading.Lock()
        self._staging = threading.Lock()  # one stager at a time: older jobs are then always fully staged
        self._running = False  # a writer thread takes the jobs queued
        self._thread: Optional[threading.Thread] = None  # the newest writer thread (it may be ending)
        self._pending: Dict[str, PendingFile] = {}  # the newest save of each path, while it is written
        self._failed: List[PendingFile] = []

    def __getstate__(self) -> Dict[str, Any]:  # a copy (e.g. in a spawned process) starts idle
        return {"config": self.config}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["config"])

    def save(self, obj: Any, path: str) -> PendingFile:
        """Stage ``obj`` for ``path`` and return; the write goes on in the background."""
        p = PendingFile(os.path.abspath(path))
        image = layout(obj)
        if image is None:
            self.wait_for(p.path, check=False)  # keep the order of writes to one path
            _save_plain(obj, p.path)
            p._finish()
            p.stall_s = p.durable_s
            return p
        segments, p.nbytes = image
        with self._staging:
            if self._pool is None:
                self._pool = BufferPool(self.config.chunk_bytes, self.config.staging_bytes)
            self._pool.reserve(p.nbytes)
            chunks: "queue.Queue[Handoff]" = queue.Queue()
            with self._lock:
                self._pending[p.path] = p
                self._jobs.append((p, chunks))
                if not self._running:  # the thread before, if any, may still be closing its backend
                    self._running = True
                    self._thread = threading.Thread(target=self._run, args=(self._thread,),
                                                    name="layerckpt-torchfile")
                    self._thread.start()
            try:
                _stage(segments, self._pool, chunks)
            except BaseException:
                p._reported = True  # the caller sees this failure now
                chunks.put(Signal.ABORT)
                raise
        p.stall_s = time.perf_counter() - p._t0
        return p

    def wait_for(self, path: str, check: bool = True) -> None:
        """Wait for the write in flight to ``path``, if any; ``check``: raise its failure."""
        p = self._pending.get(os.path.abspath(path))
        if p is not None:
            p._done.wait()
            if check and p.error is not None:
                p.wait()

    def wait(self) -> None:
        """Every write so far durable; raises the first failure not raised yet."""
        for p in list(self._pending.values()):
            p._done.wait()
        self.check()

    def check(self) -> None:
        """Raise the first failure not raised yet (the later ones are logged)."""
        with self._lock:
            failed, self._failed = [p for p in self._failed if not p._reported], []
        for p in failed:
            p._reported = True
        for p in failed[1:]:
            log.error("layerckpt: writing %s failed as well: %s", p.path, p.error)
        if failed:
            raise failed[0].error

    def close(self) -> None:
        """Wait for every write, end the thread, free the staging buffers; raises as :meth:`wait`."""
        for p in list(self._pending.values()):
            p._done.wait()
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            t.join()  # and through it every thread before
        with self._staging:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
        self.check()

    def _run(self, before: Optional[threading.Thread]) -> None:
        if before is not None:
            before.join()  # joining the newest thread then joins them all
        made: List[Any] = []  # the backend, made by the first write (inside its error handling)
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        self._running = False
                        return
                    p, chunks = self._jobs.popleft()
                error: Optional[BaseException] = None
                try:
                    self._write(made, p.path, p.nbytes, chunks)
                except BaseException as e:  # noqa: BLE001 - kept, raised at wait() or the next save
                    error = as_checkpoint_error(e, p.path)
                self._finished(p, error)
        finally:
            for b in made:
                b.close()

    def _finished(self, p: PendingFile, error: Optional[BaseException]) -> None:
        with self._lock:
            if error is not None and not p._reported:
                self._failed.append(p)
            if self._pending.get(p.path) is p:
                del self._pending[p.path]
            p._finish(error)

    def _write(self, made: List[Any], path: str, size: int, chunks: "queue.Queue[Handoff]") -> None:
        """Write ``<path>.<pid>.tmp`` through the one write loop, fsync it, rename it over ``path``."""
        pool, tmp = self._pool, f"{path}.{os.getpid()}.tmp"
        try:
            if not made:
                made.append(make_backend(self.config.backend, self.config.queue_depth))
            made[0].register_buffers([c.view for c in pool.chunks])
            fd, direct = open_file(tmp, write=True, direct=self.config.direct_io)
        except BaseException:
            discard(chunks, pool)  # the stager may wait for a buffer: keep freeing
            _commit.unlink_quietly(tmp)
            raise
        loop = WriteLoop(made[0], pool, chunks, tmp, aborted=lambda: CheckpointError(
            f"staging of {path} was interrupted; nothing was written"))
        try:
            loop.run(fd, direct, size, sync=os.fsync)
            if os.path.isdir(path) and _store.is_checkpoint(path):  # a store of this name, from before
                shutil.rmtree(path)
            os.replace(tmp, path)
            _store.fsync_dir(os.path.dirname(path))
        except BaseException:
            _commit.unlink_quietly(tmp)
            raise


def _save_plain(obj: Any, path: str) -> None:
    """torch.save to a temporary file, fsync, rename over ``path``, fsync the directory."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with os.fdopen(_store.create(tmp), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _commit.unlink_quietly(tmp)
        raise
    _store.fsync_dir(os.path.dirname(path))
