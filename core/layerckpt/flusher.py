"""The background flusher: checksums, aligned writes, fdatasync, then the commit."""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from . import format as fmt
from . import store
from .backend import CHECKSUM, checksum, open_file
from .config import Config
from .errors import CheckpointError, CheckpointWriteError
from .staging import BufferPool

log = logging.getLogger("layerckpt")


class PendingSave:
    """Handle of one save: ``wait()`` returns once it is durable and committed."""

    def __init__(self, step: int, path: str):
        self.step = step
        self.path = path
        self.error: Optional[BaseException] = None
        self.stall_s: float = 0.0  # save() call to return
        self.durable_s: float = 0.0  # save() call to commit
        self.nbytes: int = 0  # bytes this save writes (known once staged)
        self.bytes_written: int = 0  # set once committed: this rank's file
        self.bytes_all_ranks: int = 0  # set once committed: every rank's file of this save
        self.layers_persisted: int = 0  # layers written by this save (known once staged)
        self.layers_total: int = 0
        self.max_staleness: int = 0  # the composite's oldest layer, in checkpoints
        self.manifest_path: Optional[str] = None
        self._done = threading.Event()
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> "PendingSave":
        """Block until committed; re-raises a background error (CheckpointWriteError)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not durable after {timeout}s")
        self._reported = True
        if self.error is not None:
            raise self.error
        return self

    @property
    def flush_gbps(self) -> float:
        return self.bytes_written / self.durable_s / 1e9 if self.durable_s else 0.0

    def __repr__(self) -> str:
        state = "failed" if self.error else ("committed" if self.done() else "flushing")
        return f"PendingSave(step={self.step}, {state})"


@dataclass
class FlushJob:
    ABORT = object()  # staging failed: discard what was sent
    STARVED = object()  # the stager waits for a free buffer

    pending: PendingSave
    layout: fmt.Layout
    fname: str
    manifest: Dict[str, Any]
    t0: float
    chunks: "queue.Queue" = field(default_factory=queue.Queue)
    staged: threading.Event = field(default_factory=threading.Event)  # the caller's copy is over
    on_commit: Optional[Callable[[Dict[str, Any]], None]] = None


class Flusher:
    """One daemon thread that runs flush jobs in order."""

    def __init__(self, backend, pool: BufferPool, config: Config, root: str, group=None):
        from .dist import Group

        self.group = group if group is not None else Group()
        self.backend = backend
        self.pool = pool
        self.config = config
        self.root = root
        self._jobs: "queue.Queue[Optional[FlushJob]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: FlushJob) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="layerckpt-flusher", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._flush(job)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised from wait()
                job.pending.error = _as_checkpoint_error(e, job.pending.path)
                log.debug("layerckpt: flush of step %d failed: %s", job.pending.step, e)
            finally:
                job.pending.durable_s = time.perf_counter() - job.t0
                job.pending._done.set()

    def _flush(self, job: FlushJob) -> None:
        """Write this rank's file, then agree with every rank; rank 0 commits only if all succeeded."""
        try:
            crcs = self._write_local(job)
            fmt.fsync_dir(os.path.dirname(job.pending.path))
            failed: Optional[BaseException] = None
        except BaseException as e:  # noqa: BLE001 - every rank must still take part in the exchange
            failed, crcs = _as_checkpoint_error(e, job.pending.path), []
        m = job.manifest
        mine = {
            "rank": self.group.rank, "fname": job.fname, "size": job.layout.size, "rng": m.get("rng"),
            "error": None if failed is None else [getattr(failed, "errno", None) or errno.EIO,
                                                  getattr(failed, "path", None) or job.pending.path, str(failed)],
            "tensors": {} if failed is not None else {
                it.key: {"file": job.fname, "dtype": fmt.DTYPES[it.tensor.dtype], "shape": list(it.tensor.shape),
                         "offset": it.offset, "nbytes": it.nbytes, "crc": crcs[i]}
                for i, it in enumerate(job.layout.items)},
        }
        ranks = self.group.exchange(mine)  # every rank's data is durable (or failed) past this point
        bad = [r for r in ranks if r["error"] is not None]
        if bad:
            _unlink_quietly(job.pending.path)
            if failed is not None:
                raise failed
            err, path, text = bad[0]["error"]
            raise CheckpointWriteError(err, path, detail=f"rank {bad[0]['rank']} failed ({text}); nothing was committed")
        _merge(m, ranks)
        status = None
        if self.group.rank == 0:
            try:
                job.pending.manifest_path = store.commit(self.root, m)
            except OSError as e:
                status = [e.errno or errno.EIO, getattr(e, "filename", None) or self.root]
        if self.group.world > 1:
            status = self.group.exchange(status)[0]  # rank 0's word: committed or not
            job.pending.manifest_path = os.path.join(self.root, fmt.MANIFEST_DIR, fmt.manifest_name(m["step"]))
        if status is not None:
            raise CheckpointWriteError(status[0], status[1], detail="the manifest could not be committed")
        if job.on_commit is not None:
            job.on_commit(m)
        job.pending.bytes_written = job.layout.size
        job.pending.bytes_all_ranks = sum(r["size"] for r in ranks)
        if self.group.rank == 0:
            try:
                store.retain(self.root, self.config.keep_last)
            except OSError as e:  # retention failing must not fail a committed save
                log.warning("layerckpt: retention after step %d failed: %s", m["step"], e)

    def _write_local(self, job: FlushJob) -> list:
        """This rank's data file, durable; returns the per-tensor checksums."""
        path = job.pending.path
        layout = job.layout
        self.backend.register_buffers([c.view for c in self.pool.chunks])
        try:
            fd, direct = open_file(path, write=True, direct=self.config.direct_io)
        except OSError as e:
            self._discard(job)
            raise CheckpointWriteError(e.errno or errno.EIO, path) from None
        w = _Writes(self.backend, self.pool, len(layout.items))
        failed: Optional[BaseException] = None
        msg: Any = None
        try:
            while True:
                msg = job.chunks.get()
                if msg is None or msg is FlushJob.ABORT:
                    break
                if failed is not None:  # keep consuming so the stager never blocks
                    if msg is not FlushJob.STARVED:
                        self.pool.release(msg[0])
                    continue
                try:
                    if msg is FlushJob.STARVED:
                        # the stager waits for a buffer: finish checksums, free one
                        w.checksum_all()
                        w.reap(1)
                        continue
                    chunk, base, fill, segs = msg
                    n = fill
                    if direct and n % fmt.ALIGN:
                        n = fmt.align_up(n)
                        chunk.view[fill:n] = bytes(n - fill)  # zeroed tail, truncated away below
                    w.submit(fd, chunk, base, n, segs, path)
                    if job.staged.is_set():  # the stall is over: checksum while the writes run
                        w.checksum_all()
                except OSError as e:
                    failed = e
                    w.abandon()
            if msg is FlushJob.ABORT and failed is None:
                failed = CheckpointError("staging was interrupted; nothing was committed")
            if failed is None:
                try:
                    # staging is over: checksums now cost no stall, and run while the writes do
                    w.checksum_all()
                    w.reap(w.inflight)
                    if direct:
                        os.ftruncate(fd, layout.size)
                    os.fdatasync(fd)
                except OSError as e:
                    failed = e
                    w.abandon()
        finally:
            os.close(fd)
        if failed is not None:
            if direct and isinstance(failed, OSError) and failed.errno == errno.EINVAL:
                failed = _diagnose_einval(path, layout.size, failed)
            _unlink_quietly(path)
            raise failed
        return w.crcs

    def _discard(self, job: FlushJob) -> None:
        while True:
            msg = job.chunks.get()
            if msg is None or msg is FlushJob.ABORT:
                return
            if msg is not FlushJob.STARVED:
                self.pool.release(msg[0])


class _Writes:
    """Writes in flight and checksums still owed; a buffer goes back to the pool when both are done.

    Checksums are deferred while staging runs (so they do not compete with the
    caller's copy for a core) unless the stager runs out of buffers.
    """

    def __init__(self, backend, pool: BufferPool, nitems: int):
        self.backend = backend
        self.pool = pool
        self.crcs = [0] * nitems
        self._writing: Dict[int, Any] = {}
        self._owed: list = []  # (chunk, segs) in file order
        self._owed_ids: set = set()
        self._written: set = set()

    @property
    def inflight(self) -> int:
        return len(self._writing)

    def submit(self, fd: int, chunk, base: int, n: int, segs, path: str) -> None:
        self._writing[chunk.index] = chunk
        self._owed.append((chunk, segs))
        self._owed_ids.add(chunk.index)
        self.backend.write(fd, chunk.view[:n], base, chunk, path)
        self.reap(0)

    def reap(self, want: int) -> None:
        for c in self.backend.wait(min(want, len(self._writing))):
            self._writing.pop(c.index)
            if c.index in self._owed_ids:
                self._written.add(c.index)
            else:
                self.pool.release(c)

    def checksum_all(self) -> None:
        for chunk, segs in self._owed:
            for i, a, b in segs:
                self.crcs[i] = checksum(chunk.view[a:b], self.crcs[i])
            self._owed_ids.discard(chunk.index)
            if chunk.index in self._written:
                self._written.discard(chunk.index)
                self.pool.release(chunk)
        self._owed.clear()

    def abandon(self) -> None:
        """After a failure: wait out the writes, hand every buffer back."""
        try:  # the backend raised only after its queue drained; make sure
            self.backend.drain()
        except OSError:
            pass
        for c in list(self._writing.values()) + [c for c, _ in self._owed if c.index not in self._writing]:
            self.pool.release(c)
        self._writing.clear()
        self._owed.clear()
        self._owed_ids.clear()
        self._written.clear()


def _merge(m: Dict[str, Any], ranks: list) -> None:
    """Fold every rank's file and tensors into the manifest (the same result on every rank)."""
    m["checksum"] = CHECKSUM
    fname = {}
    for r in ranks:
        fname[r["rank"]] = r["fname"]
        m["files"][r["fname"]] = {"step": m["step"], "rank": r["rank"], "size": r["size"]}
        m["tensors"].update(r["tensors"])
    for info in m["layers"].values():
        if info.get("file") is None:
            info["file"] = fname[info.get("rank", 0)]
    m["rng"] = ranks[0]["rng"]
    if len(ranks) > 1:
        m["rng_ranks"] = {str(r["rank"]): r["rng"] for r in ranks[1:]}


def _as_checkpoint_error(e: BaseException, path: str) -> BaseException:
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, OSError):
        return CheckpointWriteError(e.errno or errno.EIO, e.filename or path)
    return e


def _diagnose_einval(path: str, size: int, err: OSError) -> OSError:
    """Our O_DIRECT writes are always aligned, so EINVAL means the kernel cut a write short at a
    limit (RLIMIT_FSIZE, quota, a full disk) and then refused the unaligned rest.  A buffered write
    at the file's intended end tells which limit it was."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0", size - 1)
        finally:
            os.close(fd)
    except OSError as e:
        return OSError(e.errno, os.strerror(e.errno or errno.EIO), path)
    return OSError(errno.EINVAL, "O_DIRECT write refused; set Config(direct_io=False) for this file system", path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
