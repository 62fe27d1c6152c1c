"""Stage: copy a save's file image into pooled, page-aligned host buffers (on a background thread
under lazy staging, see :class:`LazyStager`; else on the caller's).

The pool grows lazily up to ``limit`` bytes in ``chunk`` sized buffers; an
``acquire()`` past the limit blocks until the flusher returns a buffer
(back-pressure), so staging never allocates without bound.  Each full chunk
goes to the flusher at once, as ``(chunk, file offset, fill, segments)`` on a
queue, then ``None`` when the image is complete; ``STARVED`` says the stager
waits for a buffer, ``ABORT`` that staging failed.
"""
from __future__ import annotations

import mmap
import queue
import threading
from typing import Callable, Dict, List, Optional

import torch

from . import _faults
from ._backend import copy_crc32c, populate
from ._layout import Layout

STARVED = object()  # the stager waits for a free buffer
ABORT = object()  # staging failed: discard what was sent


def anon_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory.  No transparent huge pages are asked for: where the kernel compacts
    memory to find them on demand (defrag=madvise, the default) faulting in 1.5 GB took 4.3 s instead of
    0.37 s on the development machine, and copies into either ran at the same 13.7 GB/s."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def prefault(mem: mmap.mmap, tensor: torch.Tensor) -> None:
    """Back every page of ``mem`` now: one MADV_POPULATE_WRITE (an order of magnitude faster than
    touching each page here) where the native module has it, else by writing zeros."""
    if not populate(memoryview(mem)):
        tensor.zero_()


class Chunk:
    """One anonymous-mmap buffer (4 KiB aligned) and a uint8 tensor viewing it."""

    __slots__ = ("index", "mem", "view", "tensor", "pinned")

    def __init__(self, index: int, nbytes: int):
        self.index = index
        self.mem = anon_buffer(nbytes)
        self.view = memoryview(self.mem)
        self.tensor = torch.frombuffer(self.mem, dtype=torch.uint8)
        prefault(self.mem, self.tensor)  # fault the pages in now, not during the first save's copy
        self.pinned = False

    def pin(self) -> None:
        """Page-lock for asynchronous device-to-host copies (CUDA only)."""
        if not self.pinned and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
            self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0

    def free(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        try:
            self.view.release()
            self.mem.close()
        except BufferError:  # a slice is still referenced (e.g. by a traceback): freed when it goes
            pass


class BufferPool:
    def __init__(self, chunk_bytes: int, limit_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.capacity = max(1, limit_bytes // chunk_bytes)
        self.chunks: List[Chunk] = []
        self._free: List[Chunk] = []
        self._cv = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return len(self.chunks) * self.chunk_bytes

    def reserve(self, nbytes: int) -> None:
        """Allocate up front what a save of nbytes will use (capped by the limit)."""
        want = min(self.capacity, -(-nbytes // self.chunk_bytes))
        with self._cv:
            while len(self.chunks) < want:
                c = Chunk(len(self.chunks), self.chunk_bytes)
                self.chunks.append(c)
                self._free.append(c)

    def acquire(self, timeout: Optional[float] = None, on_wait: Optional[Callable[[], None]] = None) -> Chunk:
        """A free buffer; ``on_wait`` is called once if the pool is exhausted and this call must wait."""
        with self._cv:
            while not self._free:
                if len(self.chunks) < self.capacity:
                    c = Chunk(len(self.chunks), self.chunk_bytes)
                    self.chunks.append(c)
                    return c
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                if not self._cv.wait(timeout):
                    raise TimeoutError("no staging buffer was returned in time")
            # lowest index first keeps reuse (and registration) stable
            self._free.sort(key=lambda c: c.index, reverse=True)
            return self._free.pop()

    def release(self, chunk: Chunk) -> None:
        with self._cv:
            self._free.append(chunk)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            for c in self.chunks:
                c.free()
            self.chunks.clear()
            self._free.clear()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def stage(layout: Layout, pool: BufferPool, out: "queue.Queue", staged: threading.Event,
          verify: Optional[Callable[[], None]] = None, crcs: Optional[Dict[int, int]] = None,
          after: Optional[Dict[torch.device, "torch.cuda.Event"]] = None) -> None:
    """Copy the file image into pool chunks, handing each full chunk to the flusher at once.  ``verify``
    runs once every byte is copied, before the image is declared complete; it raises to fail the save.
    On failure the chunk being filled goes back to the pool (the caller sends ABORT).

    With ``crcs`` (a dict to fill) a host tensor is copied and checksummed in one pass (``copy_crc32c``:
    each block checksummed while in the CPU's cache) and its CRC32C lands in ``crcs[item]``; the chunks
    then list only the segments the flusher still has to checksum (device tensors').

    ``after``: per device, an event recorded on the caller's stream at ``save()`` (lazy staging runs on
    another thread, whose current stream is not the caller's); device copies are ordered after it."""
    C = pool.chunk_bytes
    fused = crcs is not None and copy_crc32c is not None
    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    sources = [(-1, header, len(layout.header))] + [(i, it.tensor, it.nbytes) for i, it in enumerate(layout.items)]
    streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    def starved() -> None:
        out.put(STARVED)

    chunk: Optional[Chunk] = pool.acquire(on_wait=starved)
    base, fill, segs = 0, 0, []
    try:
        for idx, t, nbytes in sources:
            if nbytes == 0:
                continue
            src = _flat_bytes(t)
            stream = _device_stream(src, streams, after) if src.is_cuda else None
            if stream is not None:
                chunk.pin()
            view = _host_view(src) if fused and idx >= 0 and stream is None else None
            if view is not None:
                crcs[idx] = 0
            pos = 0
            while pos < nbytes:
                if fill == C:
                    full, chunk = chunk, None
                    _emit(out, full, base, fill, segs, streams)
                    chunk = pool.acquire(on_wait=starved)
                    base, fill, segs = base + C, 0, []
                    if stream is not None:
                        chunk.pin()
                n = min(C - fill, nbytes - pos)
                if view is not None:
                    crcs[idx] = copy_crc32c(chunk.view[fill:fill + n], view[pos:pos + n], crcs[idx])
                elif stream is not None:
                    with torch.cuda.stream(stream):
                        chunk.tensor[fill:fill + n].copy_(src[pos:pos + n], non_blocking=True)
                else:
                    chunk.tensor[fill:fill + n].copy_(src[pos:pos + n])
                if idx >= 0 and view is None:
                    segs.append((idx, fill, fill + n))
                fill += n
                pos += n
        for s in streams.values():
            s.synchronize()
        _faults.point("stage.copied")
        if verify is not None:
            verify()
    except BaseException:
        if chunk is not None:
            pool.release(chunk)
        raise
    staged.set()
    _emit(out, chunk, base, fill, segs, streams)
    out.put(None)


class LazyStager:
    """Lazy staging: a save's copies run on a background thread while training goes on.

    Until ``optimizer.step()`` the parameters and the optimizer state do not
    change, so the copies may run through the next forward and backward; the
    step waits for them (:meth:`guard`, an optimizer step pre-hook).  One save's
    copies at a time.
    """

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def start(self, fn: Callable[[], None]) -> None:
        self._idle.clear()
        try:
            threading.Thread(target=self._run, args=(fn,), name="layerckpt-stager", daemon=True).start()
        except BaseException:
            self._idle.set()
            raise

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        finally:
            self._idle.set()

    def wait(self) -> None:
        self._idle.wait()

    def guard(self, optimizer, args, kwargs):
        """Step pre-hook: the update must not start before the copies are done.  A closure (Lightning's
        automatic optimization runs forward and backward in one, inside ``step``) runs first, and the
        wait comes after it, before the update."""
        if not self.busy:
            return None
        at = 1 if args and args[0] is optimizer else 0  # torch passes step()'s own arguments, self first
        closure = kwargs.get("closure")
        if closure is None and len(args) > at and callable(args[at]):
            closure = args[at]
        if closure is None:
            self.wait()
            return None

        def then_wait():
            out = closure()
            self.wait()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_wait}
        return tuple(args[:at]) + (then_wait,) + tuple(args[at + 1:]), kwargs


def _host_view(src: torch.Tensor) -> Optional[memoryview]:
    """The bytes of a contiguous host tensor, or None (then it is copied by torch, checksummed later)."""
    try:
        return memoryview(src.numpy())
    except (RuntimeError, TypeError, ValueError):
        return None


def caller_events(layout: Layout) -> Dict[torch.device, "torch.cuda.Event"]:
    """For lazy staging: an event on the caller's current stream of each CUDA device the layout reads."""
    out: Dict[torch.device, "torch.cuda.Event"] = {}
    for it in layout.items:
        d = it.tensor.device
        if d.type == "cuda" and d not in out:
            out[d] = torch.cuda.current_stream(d).record_event()
    return out


def _emit(out, chunk, base, fill, segs, streams) -> None:
    for s in streams.values():
        s.synchronize()  # the flusher reads this chunk next
    out.put((chunk, base, fill, segs))


def _device_stream(src: torch.Tensor, streams: Dict[torch.device, "torch.cuda.Stream"],
                   after: Optional[Dict[torch.device, "torch.cuda.Event"]] = None) -> "torch.cuda.Stream":
    """The side stream that copies ``src`` to the host, ordered after everything queued on the current
    stream so far (the ``.contiguous()`` that made ``src`` included) and after the caller's ``after``
    event, and ``src``'s memory kept from reuse until that copy is done."""
    s = streams.get(src.device)
    if s is None:
        s = streams[src.device] = torch.cuda.Stream(device=src.device)
        if after and src.device in after:
            s.wait_event(after[src.device])
    s.wait_stream(torch.cuda.current_stream(src.device))
    src.record_stream(s)
    return s
