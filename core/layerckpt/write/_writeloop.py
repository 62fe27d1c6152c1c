"""Write: the one loop that turns a stager's queue (``_stage``) into a durable file.

Each :class:`StagedChunk` is written where it belongs in the file through the I/O backend (O_DIRECT
writes padded to the alignment with zeros, cut back to the image's size at the end), the checksums
the stager left to the writer are computed, and every buffer goes back to the pool once written (and
checksummed).  After ``Signal.DONE`` the last writes are reaped and the file is synced.  Any failure,
``Signal.ABORT`` included, waits out the writes in flight, hands every buffer back and consumes the
queue to its end, so the stager never blocks on a buffer nobody will return.

The Flusher writes a checkpoint's data file through it (checksumming as it goes), the torch-file
writer a ``torch.save`` file (nothing to checksum).
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .. import _faults
from ..io._backend import Backend, checksum
from ..format._layout import align_up
from ._stage import BufferPool, Chunk, Handoff, Signal, StagedChunk
from ..config import ALIGN
from ..errors import CheckpointError, CheckpointWriteError
from ._commit import unlink_quietly

log = logging.getLogger("layerckpt")


def discard(chunks: "queue.Queue[Handoff]", pool: BufferPool) -> None:
    """Consume a stager's queue to its end (DONE or ABORT), handing every chunk back to the pool."""
    while True:
        msg = chunks.get()
        if msg is Signal.DONE or msg is Signal.ABORT:
            return
        if isinstance(msg, StagedChunk):
            pool.release(msg.chunk)


def as_checkpoint_error(e: BaseException, path: str) -> BaseException:
    """An OSError as the CheckpointWriteError naming its errno and file; anything else as it is."""
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, OSError):
        return CheckpointWriteError(e.errno or errno.EIO, e.filename or path)
    return e


class WriteLoop:
    """Writes one file image from its stager's queue into ``fd`` (opened by the caller, closed here).

    ``nitems``: how many items the chunks' segments checksum (their CRCs are :meth:`run`'s result); None
    when nothing is checksummed.  Checksums wait while the stager copies (not to compete with the
    caller's copy for a core) unless it runs out of buffers, and start as soon as ``staged`` is set.
    ``aborted`` makes the error ``Signal.ABORT`` fails the write with.
    """

    def __init__(self, backend: Backend, pool: BufferPool, chunks: "queue.Queue[Handoff]", path: str,
                 aborted: Callable[[], BaseException], nitems: Optional[int] = None,
                 staged: Optional[threading.Event] = None):
        self.chunks = chunks
        self.path = path
        self.writes = Writes(backend, pool, nitems or 0)
        self._aborted = aborted
        self._checksums = nitems is not None
        self._staged = staged
        self._ended = False  # the queue's last message (DONE or ABORT) was taken
        #: shown each staged buffer (image offset, memory, bytes filled) before it is written or encoded
        self.tap: Optional[Callable[[int, memoryview, int], None]] = None
        #: the file is a spare written over (``_spare``): it is truncated to its size at the end, however long
        self.recycled = False
        #: a signed store's (``_sign.Hasher``): each staged buffer's digest, taken while its write is in flight
        self.hasher = None

    def run(self, fd: int, direct: bool, size: int, sync: Callable[[int], None] = os.fdatasync,
            phases: Optional[Dict[str, float]] = None) -> List[int]:
        """Write every chunk, then make the file ``size`` bytes and durable (``sync``); closes ``fd``.
        Returns the checksums.  Fills ``phases`` with the seconds spent checksumming (``checksum``),
        waiting for writes (``write``) and syncing (``fdatasync``, on success)."""
        phases = {} if phases is None else phases
        try:
            self._pump(fd, direct)
            self._finish(fd, direct, size, sync, phases)
        except BaseException:
            self.writes.abandon()
            if not self._ended:  # the stager may wait for a buffer: keep freeing them
                discard(self.chunks, self.writes.pool)
            raise
        finally:
            os.close(fd)
            phases.update(checksum=self.writes.checksum_s, write=self.writes.wait_s)
        return self.writes.crcs

    def _pump(self, fd: int, direct: bool) -> None:
        """Submit each staged chunk as it comes, until the image is complete (or staging failed)."""
        while True:
            msg = self.chunks.get()
            if msg is Signal.DONE or msg is Signal.ABORT:
                self._ended = True
                if msg is Signal.ABORT:
                    raise self._aborted()
                return
            if msg is Signal.STARVED:
                self._starved()
            else:
                self._take(fd, direct, msg)

    def _starved(self) -> None:
        """The stager waits for a buffer: finish checksums, free one."""
        self._checksum()
        self.writes.reap(1)

    def _take(self, fd: int, direct: bool, s: StagedChunk) -> None:
        """A staged buffer: write it where it belongs."""
        if self.tap is not None:
            self.tap(s.base, s.chunk.view, s.fill)
        if self.hasher is not None:  # the buffer is held until its digest is taken too
            self.writes.hold(s.chunk, self.hasher.submit(s.base, s.chunk.view, s.fill))
        self._submit(fd, direct, s)
        if self._staged is not None and self._staged.is_set():  # the stall is over: checksum while writing
            self._checksum()

    def _submit(self, fd: int, direct: bool, s: StagedChunk) -> None:
        n = s.fill
        if direct and n % ALIGN:
            n = align_up(n)
            s.chunk.view[s.fill:n] = bytes(n - s.fill)  # zeroed tail, truncated away at the end
        self.writes.submit(fd, s.chunk, s.base, n, s.segs, self.path)

    def _finish(self, fd: int, direct: bool, size: int, sync: Callable[[int], None],
                phases: Dict[str, float]) -> None:
        # staging is over: checksums now cost no stall, and run while the writes do
        self._checksum()
        self.writes.reap(self.writes.inflight)
        if (direct and size % ALIGN) or self.recycled:
            os.ftruncate(fd, size)
        t = time.perf_counter()
        sync(fd)
        phases["fdatasync"] = time.perf_counter() - t

    def _checksum(self) -> None:
        if self._checksums:
            self.writes.checksum_all()


class Writes:
    """Writes in flight and checksums still owed; a buffer goes back to the pool when both are done."""

    def __init__(self, backend: Backend, pool: BufferPool, nitems: int):
        self.backend = backend
        self.pool = pool
        self.crcs = [0] * nitems
        self._writing: Dict[int, Chunk] = {}
        self._owed: List[Any] = []  # (chunk, segs) in file order
        self._owed_ids: set = set()
        self._written: set = set()
        self._held: Dict[int, Any] = {}  # chunk index -> the future of its digest (``_sign.Hasher``)
        self.checksum_s = 0.0  # time spent checksumming
        self.wait_s = 0.0  # time spent waiting for writes to complete

    @property
    def inflight(self) -> int:
        return len(self._writing)

    def hold(self, chunk: Chunk, digest: Any) -> None:
        """Keep ``chunk`` from the pool until ``digest`` (a future) is done, as well as its write."""
        self._held[chunk.index] = digest

    def _release(self, chunk: Chunk) -> None:
        held = self._held.pop(chunk.index, None)
        if held is not None:
            try:
                held.result()
            except Exception:  # noqa: BLE001 - its error is the digest's to report (``Hasher.parts``)
                pass
        self.pool.release(chunk)

    def submit(self, fd: int, chunk: Chunk, base: int, n: int, segs, path: str) -> None:
        self._writing[chunk.index] = chunk
        if segs:  # none where the stager checksummed this chunk's bytes itself
            self._owed.append((chunk, segs))
            self._owed_ids.add(chunk.index)
        self.backend.write(fd, chunk.view[:n], base, chunk, path)
        self.reap(0)

    def reap(self, want: int) -> None:
        t = time.perf_counter()
        done = self.backend.wait(min(want, len(self._writing)))
        self.wait_s += time.perf_counter() - t
        for c in done:
            self._writing.pop(c.index)
            if c.index in self._owed_ids:
                self._written.add(c.index)
            else:
                self._release(c)

    def checksum_all(self) -> None:
        _faults.point("flush.checksum")
        t = time.perf_counter()
        for chunk, segs in self._owed:
            for i, a, b in segs:
                self.crcs[i] = checksum(chunk.view[a:b], self.crcs[i])
            self._owed_ids.discard(chunk.index)
            if chunk.index in self._written:
                self._written.discard(chunk.index)
                self._release(chunk)
        self._owed.clear()
        self.checksum_s += time.perf_counter() - t

    def abandon(self) -> None:
        """After a failure: wait out the writes, hand every buffer back."""
        try:  # the backend raised only after its queue drained; make sure
            self.backend.drain()
        except OSError:
            pass
        for c in list(self._writing.values()) + [c for c, _ in self._owed if c.index not in self._writing]:
            self._release(c)
        self._writing.clear()
        self._owed.clear()
        self._owed_ids.clear()
        self._written.clear()


class Tee:
    """A second copy of a file image, in memory (the memory tier's staged copy, ``Tiers.staged_copy``), written
    from the staging buffers as the write loop is shown them (``WriteLoop.tap``): the tiers then need not
    read the file back from the disk.  Written beside its place and renamed into it by :meth:`finish`; it
    never fails the write it copies: an error (a full ``/dev/shm``) drops the copy, and the tiers read the
    file from the disk as before."""

    def __init__(self, path: str):
        self.path = path
        self._part = path + ".part"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd: Optional[int] = os.open(self._part, flags, 0o600)

    def tap(self, base: int, view: memoryview, fill: int) -> None:
        if self._fd is None:
            return
        try:
            data, done = view[:fill], 0
            while done < fill:
                done += os.pwrite(self._fd, data[done:], base + done)
        except OSError as e:
            log.debug("layerckpt: no copy in memory of %s: %s", self.path, e)
            self.drop()

    def finish(self, size: int) -> None:
        """The image is written whole: the copy takes its place (unless it was dropped)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, size)
            os.close(self._fd)
            self._fd = None
            os.replace(self._part, self.path)
        except OSError as e:
            log.debug("layerckpt: no copy in memory of %s: %s", self.path, e)
            self.drop()

    def drop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        unlink_quietly(self._part)
