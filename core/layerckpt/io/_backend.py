"""I/O backends with one interface: the native io_uring ring and a thread pool.

Both take whole-buffer requests ``write(fd, buf, offset, token, path)`` /
``read(...)``, keep at most ``depth`` in flight, finish short transfers
themselves, and return tokens from ``wait()``/``drain()``.  A failure is raised
as ``OSError(errno, strerror, path)`` once every request in flight finished, so
no buffer is reused while the kernel may still touch it.

The choice between them is made here and only here (:func:`make_backend`).
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import functools
import logging
import os
import threading
from typing import Any, List, Optional, Protocol

log = logging.getLogger("layerckpt")

try:  # the native module is optional: the build skips it where it cannot compile
    from . import _uring
    _IMPORT_ERROR: Optional[str] = None
except ImportError as _e:  # pragma: no cover - exercised on machines without a compiler
    _uring = None
    _IMPORT_ERROR = str(_e)

#: where ``setup.py`` keeps the reason a build of the native module failed, beside where the module would be
UNBUILT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_uring.unbuilt")


def native_missing(record: str = UNBUILT) -> Optional[str]:
    """None where the native module is built and imports; else why not, as precisely as is known: the build's own
    failure (kept by ``setup.py``), else the import's error."""
    if _uring is not None:
        return None
    try:
        with open(record, encoding="utf-8") as f:
            why = f.read().strip()
    except OSError:
        why = ""
    if why:
        return f"the native module layerckpt.io._uring failed to build ({why})"
    return (f"the native module layerckpt.io._uring is not importable ({_IMPORT_ERROR}); it was not built: "
            "reinstall with a C compiler and the Python headers (pip install -v shows the build)")


def native_planes():
    """The native module where it was built with the byte-plane kernels (``planes``), else None: the encoder's one
    way to the native code, so that this module stays the only one that imports it."""
    return _uring if hasattr(_uring, "planes") else None


def native_gather():
    """The native module where it was built with the drift sample's kernels (``gather_runs``, ``segsums``), else
    None (``select._track`` then runs them in torch)."""
    return _uring if hasattr(_uring, "gather_runs") and hasattr(_uring, "segsums") else None


def native_codes():
    """The native module where it was built with the bounded-loss code kernels (``qmom``, ``qsq``, ``qdelta``),
    else None (``format._qblock`` then runs its numpy encoders, which give the same codes)."""
    return _uring if hasattr(_uring, "qdelta") else None


ENV_BACKEND = "LAYERCKPT_BACKEND"
_logged = set()


class Backend(Protocol):
    """What the reader, the stager and the flusher need from an I/O backend."""

    name: str

    def write(self, fd: int, buf: Any, offset: int, token: Any, path: Optional[str] = None) -> None:
        """Queue a write of all of ``buf`` at ``offset``; waits for a free slot if ``depth`` are in flight."""

    def read(self, fd: int, buf: Any, offset: int, token: Any, path: Optional[str] = None) -> None:
        """Queue a read filling ``buf`` from ``offset`` (short only at end of file)."""

    def wait(self, min_complete: int = 0) -> List[Any]:
        """Tokens of requests completed so far, waiting for at least ``min_complete``."""

    def drain(self) -> List[Any]:
        """Wait for every request in flight; their tokens."""

    @property
    def inflight(self) -> int: ...

    def register_buffers(self, buffers: List[Any]) -> None:
        """Hint that these buffers are reused for I/O (io_uring registers them; a no-op elsewhere)."""

    def close(self) -> None: ...


HAS_POPULATE = _uring is not None and hasattr(_uring, "populate")


def populate(view: memoryview) -> bool:
    """Back every page of ``view`` now with one MADV_POPULATE_WRITE; False where that is not to be had."""
    if _uring is None:
        return False
    try:
        _uring.populate(view)
        return True
    except (AttributeError, OSError):
        return False


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg, *args)


class ThreadsBackend:
    """A pool of ``depth`` threads running ``os.pwrite``/``os.preadv`` (GIL released in each call)."""

    name = "threads"

    def __init__(self, depth: int = 8):
        self.depth = depth
        self._pool = cf.ThreadPoolExecutor(max_workers=depth, thread_name_prefix="layerckpt-io")
        self._futures: dict = {}
        self._ready: List[Any] = []
        self._error: Optional[BaseException] = None

    @staticmethod
    def _write(fd: int, buf: memoryview, offset: int, path: Optional[str]) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(view):
                n = os.pwrite(fd, view[done:], offset + done)
                if n == 0:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                done += n
        except OSError as e:
            raise OSError(e.errno, os.strerror(e.errno or errno.EIO), path) from None

    @staticmethod
    def _read(fd: int, buf: memoryview, offset: int, path: Optional[str]) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:  # EOF
                    return
                done += n
        except OSError as e:
            raise OSError(e.errno, os.strerror(e.errno or errno.EIO), path) from None

    def _submit(self, fn, fd, buf, offset, token, path) -> None:
        if len(self._futures) >= self.depth:  # a full queue waits for one completion
            self._harvest(cf.wait(list(self._futures), return_when=cf.FIRST_COMPLETED)[0])
            self._raise_if_failed()
        self._futures[self._pool.submit(fn, fd, buf, offset, path)] = token

    def write(self, fd: int, buf: Any, offset: int, token: Any, path: Optional[str] = None) -> None:
        self._submit(self._write, fd, buf, offset, token, path)

    def read(self, fd: int, buf: Any, offset: int, token: Any, path: Optional[str] = None) -> None:
        self._submit(self._read, fd, buf, offset, token, path)

    def _harvest(self, done) -> None:
        for fut in done:
            token = self._futures.pop(fut)
            exc = fut.exception()
            if exc is None:
                self._ready.append(token)
            elif self._error is None:
                self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is None:
            return
        self._harvest(cf.wait(list(self._futures))[0])  # drain before anyone reuses a buffer
        err, self._error, self._ready = self._error, None, []
        raise err

    def wait(self, min_complete: int = 0) -> List[Any]:
        while len(self._ready) < min_complete and self._futures and self._error is None:
            self._harvest(cf.wait(list(self._futures), return_when=cf.FIRST_COMPLETED)[0])
        self._harvest([f for f in self._futures if f.done()])
        self._raise_if_failed()
        out, self._ready = self._ready, []
        return out

    def drain(self) -> List[Any]:
        return self.wait(len(self._futures) + len(self._ready))

    @property
    def inflight(self) -> int:
        return len(self._futures)

    def register_buffers(self, buffers: List[Any]) -> None:
        """Nothing to register for plain syscalls."""

    def close(self) -> None:
        cf.wait(list(self._futures))
        self._futures.clear()
        self._pool.shutdown(wait=True)


class UringBackend:
    """The native ring (``layerckpt.io._uring.Ring``), with buffer registration that degrades quietly."""

    name = "uring"

    def __init__(self, depth: int = 8):
        if _uring is None:
            raise OSError(errno.ENOSYS, "layerckpt.io._uring is not built")
        self.depth = depth
        self._ring = _uring.Ring(depth)
        self._registered: Optional[List[Any]] = None

    def write(self, fd, buf, offset, token, path=None) -> None:
        self._ring.write(fd, buf, offset, token, path)

    def read(self, fd, buf, offset, token, path=None) -> None:
        self._ring.read(fd, buf, offset, token, path)

    def wait(self, min_complete: int = 0) -> List[Any]:
        return self._ring.wait(min_complete)

    def drain(self) -> List[Any]:
        return self._ring.drain()

    @property
    def inflight(self) -> int:
        return self._ring.inflight

    def register_buffers(self, buffers: List[Any]) -> None:
        """Register pooled buffers once; re-registers only when the list changed."""
        if self._registered is not None and len(self._registered) == len(buffers) and all(
            a is b for a, b in zip(self._registered, buffers)
        ):
            return
        try:
            self._ring.register_buffers(buffers)
            self._registered = list(buffers)
        except OSError as e:  # e.g. RLIMIT_MEMLOCK: plain READ/WRITE work as well
            _log_once("register", "layerckpt: io_uring buffer registration refused (%s); using unregistered I/O", e)
            self._ring.register_buffers([])
            self._registered = list(buffers)

    @property
    def registered(self) -> int:
        return self._ring.registered

    def close(self) -> None:
        self._ring.close()


@functools.lru_cache(maxsize=None)
def uring_available() -> Optional[str]:
    """None if io_uring works here, else the reason it does not.  Setting a ring up is not enough (kernels
    5.1-5.5 accept io_uring_setup but refuse the read and write operations used): one small write and
    read go through a ring, once per process."""
    if _uring is None:
        return native_missing()
    try:
        _uring.probe()
    except OSError as e:
        return f"io_uring_setup refused: {e.strerror} (errno {e.errno})"
    try:
        _probe_read_write()
    except OSError as e:
        return f"io_uring refused a write or read on this kernel: {e.strerror} (errno {e.errno})"
    return None


def _probe_read_write() -> None:
    import mmap
    import tempfile

    ring = _uring.Ring(2)
    out, back = mmap.mmap(-1, mmap.PAGESIZE), mmap.mmap(-1, mmap.PAGESIZE)
    out.write(b"layerckpt" * (mmap.PAGESIZE // 9))
    try:
        with tempfile.TemporaryFile() as f:
            ring.write(f.fileno(), out, 0, "w", f.name)
            ring.drain()
            ring.read(f.fileno(), back, 0, "r", f.name)
            ring.drain()
        if back[:] != out[:]:
            raise OSError(errno.EIO, "io_uring read back other bytes than it wrote")
    finally:
        ring.close()
        out.close()
        back.close()


def resolve_backend_name(requested: str = "auto") -> str:
    env = os.environ.get(ENV_BACKEND, "").strip().lower()
    name = env or requested
    if name not in ("auto", "uring", "threads"):
        from ..errors import ConfigError

        raise ConfigError(f"{ENV_BACKEND}={env!r} is not one of 'uring', 'threads', 'auto'")
    if name == "auto":
        why = uring_available()
        if why is not None:
            _log_once("fallback", "layerckpt: io_uring unavailable (%s); using the threads backend", why)
            return "threads"
        return "uring"
    if name == "uring":
        why = uring_available()
        if why is not None:
            from ..errors import ConfigError

            raise ConfigError(f"backend 'uring' was forced but {why}; use LAYERCKPT_BACKEND=threads")
    return name


def make_backend(requested: str = "auto", depth: int = 8) -> Backend:
    name = resolve_backend_name(requested)
    return UringBackend(depth) if name == "uring" else ThreadsBackend(depth)


_direct_refused = threading.local()
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_file(path: str, write: bool, direct: bool = True, create: bool = True) -> "tuple[int, bool]":
    """Open for O_DIRECT I/O where the file system allows; returns (fd, is_direct).  ``create=False``: write
    over the file that is there (not created, not truncated)."""
    # a file the library creates is never written through a symbolic link planted in its place
    flags = (os.O_WRONLY | NOFOLLOW | (os.O_CREAT | os.O_TRUNC if create else 0)) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT (tmpfs)
                raise
            _log_once("nodirect:" + os.path.dirname(path), "layerckpt: O_DIRECT refused under %s; using buffered I/O",
                      os.path.dirname(path))
    return os.open(path, flags, 0o644), False


# ------------------------------------------------------------------ checksums
# CRC32C in hardware (about 14 GB/s a core here) when the native module is built;
# zlib's CRC32 for new saves otherwise (the manifest records which one wrote it), and
# CRC32C in numpy (_crc32c, a few hundred MB/s) to verify what the native one wrote.
if _uring is not None:
    CHECKSUM = "crc32c"
    checksum = _uring.crc32c
    copy_crc32c = getattr(_uring, "copy_crc32c", None)  # copy and checksum in one pass
else:  # pragma: no cover
    import zlib

    CHECKSUM = "crc32"
    checksum = zlib.crc32
    copy_crc32c = None


def checksum_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``checksum`` of bytes A then B from ``checksum`` of each and B's length."""
    from ._crc32c import POLY, combine

    return combine(crc_a, crc_b, len_b, POLY if CHECKSUM == "crc32c" else 0xEDB88320)


def checksum_function(name: str):
    if name == "crc32c":
        if _uring is not None:
            return _uring.crc32c
        from ._crc32c import crc32c

        return crc32c
    if name == "crc32":
        import zlib

        return zlib.crc32
    from ..errors import CheckpointCorruptError

    raise CheckpointCorruptError(f"unknown checksum {name!r} in the manifest; this layerckpt knows crc32c and crc32")
