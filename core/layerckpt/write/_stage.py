"""Stage: copy a save's file image into pooled, page-aligned host buffers (on a background thread
under lazy staging, see :class:`LazyStager`; else on the caller's).

The pool grows lazily up to ``limit`` bytes in ``chunk`` sized buffers; an
``acquire()`` past the limit blocks until the writer returns a buffer
(back-pressure), so staging never allocates without bound.  Each full chunk
goes to the writer (``_writeloop``) at once, as a :class:`StagedChunk` on a
queue, then ``Signal.DONE`` when the image is complete; ``Signal.STARVED`` says
the stager waits for a buffer, ``Signal.ABORT`` that staging failed.
"""
from __future__ import annotations

import enum
import mmap
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .. import _faults
from ..io._backend import copy_crc32c, populate
from ..format._layout import Layout


class Signal(enum.Enum):
    """What the stager tells the writer besides a staged chunk."""

    DONE = "done"  # the image is complete: every chunk of it was sent
    STARVED = "starved"  # the stager waits for a free buffer: finish a write, free one
    ABORT = "abort"  # staging failed: discard what was sent, the file is not to be kept


STARVED = Signal.STARVED
ABORT = Signal.ABORT


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


@dataclass(frozen=True)
class StagedChunk:
    """One buffer of a file image, handed from the stager to the writer: the writer owns it from then on
    and gives it back to the pool once written (and checksummed)."""

    chunk: Chunk
    base: int  # the file offset of the buffer's first byte (a multiple of the chunk size)
    fill: int  # how many bytes of the image it holds (the chunk size, but in the last one)
    segs: Tuple[Tuple[int, int, int], ...] = ()  # (item, start, end) whose checksum the writer still owes


Handoff = Union[StagedChunk, Signal]  # what the stager's queue carries


class Filler:
    """The buffer being filled and its place in the file image.  A full buffer goes to the writer only once
    more bytes come (the last one, full or not, with :meth:`finish`); waiting for a free buffer tells the
    writer so (``Signal.STARVED``), which frees one."""

    def __init__(self, pool: BufferPool, out: "queue.Queue[Handoff]",
                 before_emit: Optional[Callable[[], None]] = None):
        self.pool, self.out, self._before_emit = pool, out, before_emit
        self.chunk: Optional[Chunk] = None
        self.chunk = pool.acquire(on_wait=self._starved)
        self.base, self.fill = 0, 0
        self.segs: List[Tuple[int, int, int]] = []

    def _starved(self) -> None:
        self.out.put(Signal.STARVED)

    def span(self, want: int) -> Tuple[Chunk, int, int]:
        """Where the next at most ``want`` bytes go: (buffer, offset in it, length); a fresh buffer once the
        current one is full."""
        C = self.pool.chunk_bytes
        if self.fill == C:
            self._emit()
            self.chunk = None  # not ours while we wait for the next one
            self.chunk = self.pool.acquire(on_wait=self._starved)
            self.base, self.fill, self.segs = self.base + C, 0, []
        return self.chunk, self.fill, min(C - self.fill, want)

    def advance(self, n: int, item: Optional[int] = None) -> None:
        """``n`` bytes were copied at the span's start; ``item``: whose checksum the writer owes for them."""
        if item is not None:
            self.segs.append((item, self.fill, self.fill + n))
        self.fill += n

    def finish(self) -> None:
        """The image is complete: the last buffer, then ``Signal.DONE``."""
        self._emit()
        self.out.put(Signal.DONE)

    def drop(self) -> None:
        """Staging failed: the buffer being filled goes back to the pool (the caller sends ABORT)."""
        if self.chunk is not None:
            self.pool.release(self.chunk)
            self.chunk = None

    def _emit(self) -> None:
        if self._before_emit is not None:
            self._before_emit()
        self.out.put(StagedChunk(self.chunk, self.base, self.fill, tuple(self.segs)))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def stage(layout: Layout, pool: BufferPool, out: "queue.Queue[Handoff]", staged: threading.Event,
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
    fused = crcs is not None and copy_crc32c is not None
    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
    sources = [(-1, header, len(layout.header))] + [(i, it.tensor, it.nbytes) for i, it in enumerate(layout.items)]
    streams: Dict[torch.device, "torch.cuda.Stream"] = {}
    filler = Filler(pool, out, before_emit=lambda: _synchronize(streams))  # the writer reads the chunk next
    try:
        for idx, t, nbytes in sources:
            if not nbytes:
                continue
            # the common case, a contiguous host tensor with its checksum taken here, needs no flat view first
            view = _host_bytes(t) if fused and idx >= 0 else None
            _copy_source(filler, idx, t if view is not None else _flat_bytes(t), nbytes, streams, after,
                         crcs if fused else None, view)
        _synchronize(streams)
        _faults.point("stage.copied")
        if verify is not None:
            verify()
    except BaseException:
        filler.drop()
        raise
    staged.set()
    filler.finish()


def _copy_source(filler: Filler, idx: int, src: torch.Tensor, nbytes: int,
                 streams: Dict[torch.device, "torch.cuda.Stream"],
                 after: Optional[Dict[torch.device, "torch.cuda.Event"]], crcs: Optional[Dict[int, int]],
                 view: Optional[memoryview] = None) -> None:
    """Copy one source (``idx`` -1: the header) into the buffers: a device tensor on its side stream into
    pinned buffers; a host tensor, with ``crcs``, checksummed in the same pass (``view``: its bytes, where the
    caller has them); else by torch (then the writer owes its checksum)."""
    stream = _device_stream(src, streams, after) if view is None and src.is_cuda else None
    if view is None and crcs is not None and idx >= 0 and stream is None:
        view = _host_bytes(src)
    if view is not None:
        crcs[idx] = 0
    pos = 0
    while pos < nbytes:
        chunk, at, n = filler.span(nbytes - pos)
        if view is not None:
            crcs[idx] = copy_crc32c(chunk.view[at:at + n], view[pos:pos + n], crcs[idx])
        elif stream is not None:
            chunk.pin()
            with torch.cuda.stream(stream):
                chunk.tensor[at:at + n].copy_(src[pos:pos + n], non_blocking=True)
        else:
            chunk.tensor[at:at + n].copy_(src[pos:pos + n])
        filler.advance(n, idx if idx >= 0 and view is None else None)
        pos += n


def _synchronize(streams: Dict[torch.device, "torch.cuda.Stream"]) -> None:
    for s in streams.values():
        s.synchronize()


class LazyStager:
    """Lazy staging: a save's copies run on a background thread while training goes on.

    Until ``optimizer.step()`` the parameters and the optimizer state do not
    change, so the copies may run through the next forward and backward; the
    step waits for them (:meth:`guard`, an optimizer step pre-hook).  One save's
    copies at a time.  How long a step waited is told to the ``waited`` callback of
    the save being staged (:meth:`start`): time training pays beyond ``save()``.

    The copies run on one thread kept between saves (not one started per save); it ends once it has had
    nothing to do for ``IDLE_S`` seconds, and the next save starts it again.
    """

    IDLE_S = 30.0

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._waited: Optional[Callable[[float], None]] = None
        self._cv = threading.Condition()
        self._jobs: List[Callable[[], None]] = []
        self._thread: Optional[threading.Thread] = None

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def start(self, fn: Callable[[], None], waited: Optional[Callable[[float], None]] = None) -> None:
        """Run ``fn`` (the copies of one save) in the background; ``waited(seconds)`` is called each time
        an optimizer step waited for it."""
        self._idle.clear()
        self._waited = waited
        with self._cv:
            self._jobs.append(fn)
            if self._thread is not None:
                self._cv.notify()
                return
            t = threading.Thread(target=self._loop, name="layerckpt-stager", daemon=True)
            try:
                t.start()
            except BaseException:
                self._jobs.remove(fn)
                self._idle.set()
                raise
            self._thread = t

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait(self.IDLE_S)
                if not self._jobs or self._jobs[0] is None:  # idle for IDLE_S, or closed
                    self._jobs.clear()
                    self._thread = None
                    return
                fn = self._jobs.pop(0)
            self._run(fn)

    def close(self) -> None:
        """End the thread once the copies queued are done (the next ``start`` would begin a new one)."""
        with self._cv:
            t = self._thread
            if t is None:
                return
            self._jobs.append(None)
            self._cv.notify()
        if t is not threading.current_thread():
            t.join()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        finally:
            self._idle.set()

    def wait(self) -> None:
        self._idle.wait()

    def _step_wait(self) -> None:
        """The step's wait for the copies, timed and told to the save being staged."""
        waited, t = self._waited, time.perf_counter()
        _faults.point("stage.step-waits")
        self._idle.wait()
        if waited is not None:
            waited(time.perf_counter() - t)

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
            self._step_wait()
            return None

        def then_wait():
            out = closure()
            self._step_wait()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_wait}
        return tuple(args[:at]) + (then_wait,) + tuple(args[at + 1:]), kwargs


def _host_bytes(t: torch.Tensor) -> Optional[memoryview]:
    """The bytes of a contiguous host tensor, flat, in one call (numpy's view of it); None where numpy has no
    view of it (bfloat16, a device tensor, a non-contiguous one)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    try:
        return memoryview(t.numpy()).cast("B")
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
