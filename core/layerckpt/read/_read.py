"""Reading tensors back: coalesced, aligned, pipelined reads straight into their final memory.

The byte ranges a restore needs are merged into few 4 KiB-aligned extents,
read (O_DIRECT where allowed) into one fresh buffer per call, and checked
against their checksums while later reads are still in flight.  The tensors
returned are views of that buffer, so restored state costs one allocation and
no extra copy.
"""
from __future__ import annotations

import errno
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from ..io import _backend
from ..io._backend import open_file
from ..format._layout import CODES, align_up
from ..format._manifest import TensorEntry
from ..format._places import sealed_ok
from ..config import ALIGN
from ..format._json import open_regular
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

GAP = 1 << 20  # read through holes smaller than this rather than issue another request
#: files at most this big are read buffered, straight into the targets: the page cache serves them (a file
#: read or written through it recently costs a memcpy), and O_DIRECT's per-request latency is not paid
#: for little data.  Bigger ones go through O_DIRECT at queue depth, where the disk's rate decides, unless
#: the page cache holds them already, the file system has no O_DIRECT (tmpfs, where the memory tier
#: lives) or it is turned off: buffered too.
SMALL_FILE = 64 << 20
PREFAULT_THREADS = 2
#: buffered reads go in pieces this big, each checksummed on a helper thread while the next one is read
#: (still in the CPU's cache); below two pieces the checksum runs inline
PIECE = 1 << 20


@dataclass
class Want:
    key: str
    offset: int
    nbytes: int
    crc: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    step: int = 0  # the step the manifest records for the tensor's file, which its seal binds (``_places``)

    @classmethod
    def from_entry(cls, key: str, e: TensorEntry, step: int) -> "Want":
        """What to read for the entry ``e`` of ``key``, in a file the manifest records at ``step``."""
        return cls(key, e.offset, e.nbytes, e.crc, CODES[e.dtype], tuple(e.shape), step)


def read_views(backend, path: str, size: int, wants: Sequence[Want], check: Optional[Callable],
               piece_bytes: int, direct: bool = True, advised: bool = False) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read every wanted tensor of one data file; returns ({key: tensor}, bytes read).  ``advised``: a
    :func:`prefetch` has asked the disk for these ranges already, or found them in the page cache."""
    wants = sorted(wants, key=lambda w: w.offset)
    fd = _direct_fd(path, size, wants, direct)
    if fd is None:
        return _views_small(path, size, wants, check, advised)
    try:
        extents = _extents(wants)
        total = sum(e - s for s, e in extents)
        buf = fresh_bytes(total, ALIGN)
        where = _pump(backend, fd, path, buf.numpy(), extents, piece_bytes, wants, check)
    finally:
        os.close(fd)
    out = {}
    for w in wants:
        if w.nbytes == 0:
            out[w.key] = torch.empty(w.shape, dtype=w.dtype)
        else:
            out[w.key] = buf[where[w.key]:where[w.key] + w.nbytes].view(w.dtype).reshape(w.shape)
    return out, total


def _direct_fd(path: str, size: int, wants: Sequence[Want], direct: bool) -> Optional[int]:
    """An O_DIRECT descriptor of the data file, where that is the read to make (a big file the page cache
    does not hold); None where a buffered read straight into the targets is (a small file, O_DIRECT off or
    refused, tmpfs where the memory tier lives, a file the page cache holds)."""
    if size <= SMALL_FILE or not direct:
        return None
    fd, direct = _open_checked(path, size, wants, direct)
    if not direct or _cached(path, wants):
        os.close(fd)
        return None
    return fd


def fresh_bytes(nbytes: int, align: int = 64) -> torch.Tensor:
    """Memory for tensors read back: from the allocator (which hands back memory freed a moment ago,
    already faulted in, where it has some; a fresh process gets fresh pages, faulted in by the readers'
    helper thread), ``align``-aligned."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + nbytes]


def _views_small(path: str, size: int, wants: Sequence[Want], check: Optional[Callable], advised: bool = False
                 ) -> Tuple[Dict[str, torch.Tensor], int]:
    """The tensors, read buffered into one fresh allocation packed at 64-byte boundaries, whose pages a
    helper thread faults in (one call per piece, not a fault per page inside the reads) ahead of them."""
    where, end = {}, 0
    for w in wants:
        where[w.key] = end
        end += -(-w.nbytes // 64) * 64
    buf = fresh_bytes(end)
    sinks = {w.key: buf[where[w.key]:where[w.key] + w.nbytes] for w in wants if w.nbytes}
    view = memoryview(buf.numpy())
    pieces = [(0, o, min(PIECE, end - o)) for o in range(0, end, PIECE)]
    pre = _Prefault(view, pieces, threads=1)
    try:
        def ready(key: str, a: int, n: int) -> None:  # the buffer's pages under this piece are in
            pre.wait((where[key] + a + n - 1) // PIECE)

        total = _read_small(path, size, [w for w in wants if w.nbytes], sinks, check, ready, advised)
    finally:
        pre.close()
        view.release()
    out = {}
    for w in wants:
        if w.nbytes == 0:
            _verify(check, 0, w, path)
            out[w.key] = torch.empty(w.shape, dtype=w.dtype)
        else:
            out[w.key] = sinks[w.key].view(w.dtype).reshape(w.shape)
    return out, total


def read_into(backend, pool, path: str, size: int, wants: Sequence[Want], sinks: Dict[str, torch.Tensor],
              check: Optional[Callable], direct: bool = True, advised: bool = False) -> int:
    """Read tensors into existing memory (``sinks``: key -> flat uint8 view of the target) through
    a few reused bounce buffers; cheaper than fresh memory where page faults are dear.
    A checksum failure can leave targets partly overwritten."""
    wants = sorted(wants, key=lambda w: w.offset)
    fd = _direct_fd(path, size, wants, direct)
    if fd is None:
        return _read_small(path, size, wants, sinks, check, advised=advised)
    try:
        extents = _extents(wants)
        pieces = [(o, min(pool.chunk_bytes, e - o)) for s, e in extents for o in range(s, e, pool.chunk_bytes)]
        sums = _Checksums(check, len(wants), threaded=True)  # of the targets, behind the copies
        held: Dict[int, object] = {}
        done: set = set()
        nxt = first = 0
        try:
            for i, (ps, n) in enumerate(pieces):
                pe = ps + n
                while nxt < len(pieces) and nxt - i < pool.capacity:
                    chunk = pool.acquire()
                    held[nxt] = chunk
                    backend.read(fd, chunk.view[: pieces[nxt][1]], pieces[nxt][0], nxt, path)
                    nxt += 1
                while i not in done:
                    done.update(backend.wait(1))
                chunk = held.pop(i)
                j = first
                while j < len(wants) and wants[j].offset < pe:
                    w = wants[j]
                    a, b = max(w.offset, ps), min(w.offset + w.nbytes, pe)
                    if a < b:
                        dst = sinks[w.key][a - w.offset: b - w.offset]
                        dst.copy_(chunk.tensor[a - ps: b - ps])
                        if dst.is_cpu:
                            sums.add(j, memoryview(dst.numpy()))
                        elif check is not None:  # a device target: its bytes are checked in the bounce buffer
                            sums.crcs[j] = check(chunk.view[a - ps: b - ps], sums.crcs[j])
                    if j == first and w.offset + w.nbytes <= pe:
                        first += 1
                    j += 1
                pool.release(chunk)
            crcs = sums.result()
        except OSError as e:
            raise _read_failed(path, e) from None
        finally:
            sums.close()
            _drain_quietly(backend)
            for c in held.values():
                pool.release(c)
    finally:
        os.close(fd)
    for j, w in enumerate(wants):
        _verify(check, crcs[j], w, path)
    return sum(n for _, n in pieces)


def _read_small(path: str, size: int, wants: Sequence[Want], sinks: Dict[str, torch.Tensor],
                check: Optional[Callable], ready: Optional[Callable[[str, int, int], None]] = None,
                advised: bool = False) -> int:
    """Each tensor read buffered straight into its target, a piece at a time; the checksums run on a
    helper thread a piece behind the reads (both release the GIL), and are compared at the end.  The disk
    is asked for every range at once first, unless the page cache holds them or ``advised`` (a
    :func:`prefetch` asked already, or found them cached: asking again costs a cold 40 MB resume about 4 ms)."""
    fd, _ = _open_checked(path, size, wants, direct=False)
    total = sum(w.nbytes for w in wants)
    sums = _Checksums(check, len(wants), threaded=total >= 2 * PIECE)
    try:
        if not advised and not _cached(path, wants):  # hints over pages the cache holds cost ms for nothing
            _advise(fd, wants)
        for i, w in enumerate(wants):
            view = memoryview(sinks[w.key].numpy()) if w.nbytes else memoryview(b"")
            for a in range(0, w.nbytes, PIECE):
                piece = view[a:a + PIECE]
                if ready is not None:
                    ready(w.key, a, len(piece))
                got = 0
                while got < len(piece):
                    n = os.preadv(fd, [piece[got:]], w.offset + a + got)
                    if n <= 0:
                        raise OSError(errno.EIO, "short read", path)
                    got += n
                sums.add(i, piece)
        crcs = sums.result()
    except OSError as e:
        raise _read_failed(path, e) from None
    finally:
        sums.close()
        os.close(fd)
    for i, w in enumerate(wants):
        _verify(check, crcs[i], w, path)
    return total


class _Checksums:
    """Running checksums of the wanted tensors, fed piece by piece; on a helper thread if ``threaded``."""

    def __init__(self, check: Optional[Callable], n: int, threaded: bool):
        self.check = check
        self.crcs = [0] * n
        self._error: Optional[BaseException] = None
        self._q: Optional["queue.SimpleQueue"] = None
        self._thread: Optional[threading.Thread] = None
        if check is not None and threaded:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, daemon=True, name="layerckpt-checksum")
            self._thread.start()

    def add(self, i: int, piece: memoryview) -> None:
        if self.check is None:
            return
        if self._q is None:
            self.crcs[i] = self.check(piece, self.crcs[i])
        else:
            self._q.put((i, piece))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self.crcs[item[0]] = self.check(item[1], self.crcs[item[0]])
                except BaseException as e:  # noqa: BLE001 - handed to the reader
                    self._error = e

    def result(self) -> List[int]:
        self.close()
        if self._error is not None:
            raise self._error
        return self.crcs

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None


#: the kernel reads at most about one readahead window (``read_ahead_kb``, or the device's largest request)
#: of what one hint asks for, often 128 KiB-8 MiB: a hint goes in pieces no bigger than this
ADVISE_PIECE = 512 << 10


def _advise(fd: int, wants: Sequence[Want]) -> None:
    """Ask the kernel to read every wanted range ahead at once (many requests in flight, not the
    readahead window's few); a no-op for what the page cache holds."""
    if not hasattr(os, "posix_fadvise"):
        return
    for s, e in _extents(wants):
        for o in range(s, e, ADVISE_PIECE):
            try:
                os.posix_fadvise(fd, o, min(ADVISE_PIECE, e - o), os.POSIX_FADV_WILLNEED)
            except OSError:
                return


def prefetch(files: Sequence[Tuple[str, int, Sequence[Want]]], direct: bool = True
             ) -> Tuple[Optional[threading.Thread], FrozenSet[Tuple[str, str]]]:
    """Ask the disk, on a helper thread and in the order given, for every range that buffered reads of these
    ``(path, size, wants)`` will ask for (where the read will be buffered: a small file, or O_DIRECT off).
    The reads of every file then overlap the restore's other work (the plan, the decoding, the copies of
    what came in first) instead of each file waiting its turn.  Queueing the requests takes a few ms of its
    own (about 7 ms for 40 MB here), which the helper takes off the reader; a file the page cache holds is
    not asked for (walking hints over cached pages cost a warm 40 MB resume 3-4 ms).  Only a hint: anything
    amiss with a file is left to the read itself to report.  Returns the thread (None where there was nothing
    to ask) and the (path, key) of every tensor it asked for or found in the page cache: their reads need
    neither ask again nor look at the page cache again."""
    if not hasattr(os, "posix_fadvise"):
        return None, frozenset()
    todo, settled = [], []
    for path, size, wants in files:
        if wants and not (direct and size > SMALL_FILE):
            wants = sorted(wants, key=lambda w: w.offset)
            settled.extend((path, w.key) for w in wants)
            if not _cached(path, wants):  # asked here, before any thread: a helper running Python holds the GIL
                todo.append((path, wants))
    if not todo:
        return None, frozenset(settled)

    def run() -> None:
        for path, wants in todo:
            try:
                fd, _ = open_regular(path, "data file", follow=False)
            except (CheckpointError, OSError):
                continue
            try:
                _advise(fd, wants)
            finally:
                os.close(fd)

    t = threading.Thread(target=run, daemon=True, name="layerckpt-prefetch")
    t.start()
    return t, frozenset(settled)


MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


_MEMORY_DEVS: Dict[int, bool] = {}  # st_dev of a file system -> whether it lies in memory: asked once each


def _in_memory(path: str) -> bool:
    """Whether ``path`` lies on a file system in memory (tmpfs: the memory tier), read from the mount table once
    per file system (its device number).  Newer kernels accept O_DIRECT there, where it only adds a copy
    through the bounce buffers."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return _mounted_in_memory(path)
    got = _MEMORY_DEVS.get(dev)
    if got is None:
        got = _MEMORY_DEVS[dev] = _mounted_in_memory(path)
    return got


def _mounted_in_memory(path: str) -> bool:
    """:func:`_in_memory`, from the mount table: the file system of the longest mount point above ``path``."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind in MEMORY_FS


def _cached(path: str, wants: Sequence[Want], probes: int = 16) -> bool:
    """Whether the page cache holds the wanted bytes: a page at each of ``probes`` points across them
    read without waiting (RWF_NOWAIT fails instead of going to the disk); a file in memory always is."""
    if _in_memory(path):
        return True
    flag = getattr(os, "RWF_NOWAIT", None)
    wanted = [w for w in wants if w.nbytes]
    if flag is None or not wanted:
        return False
    total = sum(w.nbytes for w in wanted)
    step = max(1, total // probes)
    one = bytearray(1)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        base, j = 0, 0
        for k in range(0, total, step):
            while k >= base + wanted[j].nbytes:
                base += wanted[j].nbytes
                j += 1
            try:
                if os.preadv(fd, [one], wanted[j].offset + k - base, flag) != 1:
                    return False
            except (BlockingIOError, OSError):
                return False
        return True
    finally:
        os.close(fd)


def _read_failed(path: str, e: OSError) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"reading {path} failed: {os.strerror(e.errno or errno.EIO)}", path=path)


def _drain_quietly(backend) -> None:
    """After a failure: let every read in flight land before its buffer can be reused or freed."""
    try:
        backend.drain()
    except OSError:
        pass


def _verify(check: Optional[Callable], crc: int, w: Want, path: str) -> None:
    """The bytes read for ``w`` (CRC ``crc``) are its own: the entry's CRC, sealed to its key and its file's step
    (``_places``), matches them."""
    if check is not None and not sealed_ok(check, w.crc, w.key, crc, w.step):
        raise CheckpointCorruptError(
            f"checksum mismatch in tensor {w.key!r} of {path} (bytes {w.offset}..{w.offset + w.nbytes}); "
            f"the file is damaged, or the manifest gives the tensor another's bytes: run `layerckpt verify`, or "
            f"restore an older step", path=path, tensor=w.key)


class MissingDataError(CheckpointCorruptError):
    """A data file the manifest names is not there: damage, or retention deleted it with its manifest
    (the reader, which knows the manifest, tells which: see ``_reader``)."""


def _open_checked(path: str, size: int, wants: Sequence[Want], direct: bool) -> Tuple[int, bool]:
    """The data file opened for reading, after checking, without blocking and without following a link, that
    it is a regular file holding every byte the manifest places in it."""
    first = wants[0].key if wants else None
    st = _probe(path, first)
    try:
        fd, direct = open_file(path, write=False, direct=direct)
    except FileNotFoundError:
        raise MissingDataError(f"data file {path} is missing (it holds tensor {first!r})", path=path) from None
    have = os.fstat(fd)
    bad = None
    if (have.st_dev, have.st_ino) != (st.st_dev, st.st_ino):  # replaced between the two opens
        bad = CheckpointCorruptError(f"data file {path} was replaced while it was opened; read it again", path=path)
    elif have.st_size < size:
        lost = next((w.key for w in wants if w.offset + w.nbytes > have.st_size), None)
        bad = CheckpointCorruptError(
            f"data file {path} is truncated: {have.st_size} bytes, the manifest expects {size}"
            + (f"; tensor {lost!r} is cut off" if lost else ""), path=path, tensor=lost)
    elif any(w.offset + w.nbytes > size for w in wants):
        key = next(w.key for w in wants if w.offset + w.nbytes > size)
        bad = CheckpointCorruptError(f"tensor {key!r} lies past the end of {path} in the manifest",
                                     path=path, tensor=key)
    if bad is not None:
        os.close(fd)
        raise bad
    return fd, direct


def _probe(path: str, first: Optional[str]) -> os.stat_result:
    """What ``path`` is (the manifests' reader's check: no FIFO, device or link is read): a regular file."""
    try:
        fd, st = open_regular(path, "data file", follow=False)
    except CheckpointNotFoundError:
        raise MissingDataError(f"data file {path} is missing (it holds tensor {first!r})", path=path) from None
    os.close(fd)
    return st


def _extents(wants: Sequence[Want]) -> List[List[int]]:
    out: List[List[int]] = []
    for w in wants:
        if w.nbytes == 0:
            continue
        s, e = w.offset // ALIGN * ALIGN, align_up(w.offset + w.nbytes)
        if out and s <= out[-1][1] + GAP:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _pump(backend, fd, path, buf, extents, piece_bytes, wants, check) -> Dict[str, int]:
    """Read extents into buf in pieces; verify each tensor once its bytes are in.  Returns key -> buffer offset."""
    pieces = []  # (file offset, buffer offset, length)
    b = 0
    for s, e in extents:
        for o in range(s, e, piece_bytes):
            n = min(piece_bytes, e - o)
            pieces.append((o, b + o - s, n))
        b += e - s
    view = memoryview(buf)
    where: Dict[str, int] = {}
    ext_i, ext_base = 0, 0
    for w in wants:  # buffer position of every tensor
        if w.nbytes == 0:
            continue
        while not (extents[ext_i][0] <= w.offset < extents[ext_i][1]):
            ext_base += extents[ext_i][1] - extents[ext_i][0]
            ext_i += 1
        where[w.key] = ext_base + w.offset - extents[ext_i][0]
    done: set = set()
    nxt = ptr = wi = 0
    pre = _Prefault(view, pieces)
    sums = _Checksums(check, len(wants), threaded=True)  # behind the reads, on a helper thread
    try:
        while ptr < len(pieces):
            while nxt < len(pieces) and backend.inflight < backend.depth and pre.ready(nxt):
                fo, bo, n = pieces[nxt]
                backend.read(fd, view[bo:bo + n], fo, nxt, path)
                nxt += 1
            if backend.inflight == 0 and ptr not in done:
                pre.wait(nxt)
                continue
            done.update(backend.wait(0 if ptr in done else 1))
            while ptr in done:
                fo, bo, n = pieces[ptr]
                # every tensor ending inside what is now contiguous is complete: check it
                while wi < len(wants) and wants[wi].offset + wants[wi].nbytes <= fo + n:
                    w = wants[wi]
                    if w.nbytes:
                        sums.add(wi, view[where[w.key]:where[w.key] + w.nbytes])
                    wi += 1
                ptr += 1
        crcs = sums.result()
    except OSError as e:
        raise _read_failed(path, e) from None
    finally:
        sums.close()
        pre.close()
        _drain_quietly(backend)
        view.release()
    for i, w in enumerate(wants):
        _verify(check, crcs[i], w, path)
    return where


class _Prefault:
    """Fault in the pages of fresh read buffers on helper threads, ahead of the reads.

    Page faults, not the disk, bound a restore into new memory on many
    machines; taken inside the read syscalls they serialise with submission,
    while here they run on the other cores as the device reads.
    """

    def __init__(self, view: memoryview, pieces: List[Tuple[int, int, int]], threads: int = PREFAULT_THREADS):
        self._events = [threading.Event() for _ in pieces]
        if not _backend.HAS_POPULATE or len(pieces) < 2 or threads < 1:
            for e in self._events:
                e.set()
            self._threads: List[threading.Thread] = []
            return
        self._view, self._pieces = view, pieces
        self._next = 0
        self._lock = threading.Lock()
        self._stop = False
        n = max(0, min(threads, os.cpu_count() or 1, len(pieces)))
        self._threads = [threading.Thread(target=self._run, daemon=True, name="layerckpt-prefault")
                         for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                i = self._next
                self._next += 1
            if self._stop or i >= len(self._pieces):
                return
            _, bo, n = self._pieces[i]
            try:
                _backend.populate(self._view[bo:bo + n])
            finally:
                self._events[i].set()

    def ready(self, i: int) -> bool:
        return self._events[i].is_set()

    def wait(self, i: int) -> None:
        self._events[i].wait()

    def close(self) -> None:
        self._stop = True
        for t in self._threads:
            t.join()
