"""Stores a tier copies composites into: any fsspec URL (the remote tier) or a local folder (the memory tier).

A tier holds the same layout as the checkpoint directory, ``data/<file>`` and
``manifests/step-N.json`` (no ``latest``), so what it holds is a layerckpt
directory.  Object stores have no rename: a data file is put whole, the manifest
goes last and is the tier's commit point, and a reader believes manifests only,
never a listing of data.  Both stores offer the same few calls; ``_tiers``
decides what to copy and what to delete.
"""
from __future__ import annotations

import errno
import logging
import os
import uuid
import shutil
from typing import Any, Dict, List, Mapping, Optional

from ..format import _json
from ._bandwidth import TokenBucket
from ..format._store import create, write_atomic
from ..format._json import cap_text, open_dir, open_regular, read_regular, too_big
from .._url import _fsspec, bounded, check_config, is_url  # noqa: F401 - their home was here; names others import
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt")

DATA, MANIFESTS = "data", "manifests"
PART_BYTES_MIN = 5 << 20  # S3's smallest multipart part
# Under a bandwidth cap a file goes up in chunks of rate/4 bytes within these bounds: a sleep is at most
# about a quarter of a second, and a chunk is never so small that the per-chunk cost shows.
CAPPED_CHUNK_MIN, CAPPED_CHUNK_MAX = 64 << 10, 1 << 20
CAPPED_BURST = 64 << 10  # bytes an upload may send ahead of the cap after a pause
GET_PIECE = 32 << 20  # a download goes in pieces of at most this many bytes, each read with an explicit end
# Object stores whose PUT makes an object appear whole or not at all: a manifest is put directly; on any
# other file system it is put under a temporary name and moved into place.
_ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _what(sub: str) -> str:
    return {MANIFESTS: "manifest", DATA: "data file"}.get(sub, "file")


# -- a tier on the local file system (file://, the memory tier): every read from the tier's root, one
# component at a time, never through a link, never anything but a regular file or folder (see _json)

def _local_layout(root: str) -> None:
    """The tier's folders, made where missing; one that is a link or not a directory is refused."""
    for sub in (DATA, MANIFESTS):
        try:
            os.close(open_dir(root, sub, "tier folder"))
        except CheckpointNotFoundError:
            os.makedirs(os.path.join(root, sub), exist_ok=True)


def _local_names(root: str, sub: str) -> List[str]:
    try:
        fd = open_dir(root, sub, "tier folder")
    except CheckpointNotFoundError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def _local_read(root: str, path: str, what: str, cap: int) -> bytes:
    return read_regular(path, what, cap, follow=False, under=root)


def _local_head(root: str, path: str, what: str, nbytes: int) -> bytes:
    fd, _ = open_regular(path, what, follow=False, under=root)
    try:
        return os.read(fd, nbytes)
    finally:
        os.close(fd)


def _local_get(root: str, sub: str, src: str, dst: str, size: Optional[int]) -> None:
    fd, st = open_regular(src, _what(sub), follow=False, under=root)
    try:
        if size is not None and st.st_size > size:  # refused before a byte is copied
            raise bigger(src, st.st_size, size, _what(sub))
        copy_capped(lambda n: os.read(fd, n), dst, st.st_size if size is None else size, src, _what(sub),
                    "its manifest records" if size is not None else "it held when opened")
    finally:
        os.close(fd)


def bigger(where: str, have: Optional[int], cap: int, what: str = "data file",
            expected: str = "its manifest records") -> CheckpointCorruptError:
    held = f"{have} bytes" if have is not None else "more bytes"
    return CheckpointCorruptError(f"{what} {where} holds {held}, more than the {cap_text(cap)} {expected}; the tier's "
                                  f"copy is damaged or not the one recorded: no more of it is read (restore "
                                  f"another step, or copy the file again)", path=where)


def copy_capped(read, dst: str, cap: int, where: str, what: str = "data file",
                expected: str = "its manifest records") -> int:
    """Copy what ``read(n)`` gives, a piece at a time, into the new local file ``dst`` (never through a link),
    refusing (the partial copy deleted) once more than ``cap`` bytes came; returns the bytes copied."""
    fd = create(dst)
    total = 0
    try:
        while True:
            b = read(min(GET_PIECE, cap + 1 - total))
            if not b:
                return total
            total += len(b)
            if total > cap:
                raise bigger(where, None, cap, what, expected)
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        fd = -1
        try:
            os.unlink(dst)
        except OSError:
            pass
        raise
    finally:
        if fd >= 0:
            os.close(fd)


class FsspecStore:
    """A tier on any fsspec file system; ``url`` names it in messages and reports."""

    def __init__(self, url: str, options: Optional[Mapping[str, Any]] = None, part_bytes: int = 16 << 20,
                 bandwidth: Optional[int] = None):
        fsspec = _fsspec()
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **bounded(self.url, options))
        except (TypeError, ValueError, ImportError) as e:
            raise CheckpointError(f"remote tier {url}: fsspec refused the URL or Config.remote_options ({e})") from None
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.local = type(self.fs).__name__ == "LocalFileSystem"
        self.atomic_put = bool(set(protocols) & _ATOMIC_PUT) and not self.local
        self._put_kw: Dict[str, Any] = {}
        if set(protocols) & {"s3", "s3a"}:  # multipart in parts of this size, a few in flight
            self._put_kw = {"chunksize": max(PART_BYTES_MIN, part_bytes), "max_concurrency": 4}
        self._part_bytes = max(PART_BYTES_MIN, part_bytes)
        # Config.remote_bandwidth: one bucket for every upload of this store (the tier's copy threads share
        # it), taken chunk by chunk as the bytes are handed to the file system
        self.bucket: Optional[TokenBucket] = None
        self._chunk = 0
        if bandwidth is not None:
            self._chunk = int(min(CAPPED_CHUNK_MAX, max(CAPPED_CHUNK_MIN, bandwidth // 4)))
            self.bucket = TokenBucket(bandwidth, CAPPED_BURST)

    def _path(self, sub: str, name: str = "") -> str:
        return "/".join(p for p in (self.root.rstrip("/"), sub, name) if p)

    def where(self, sub: str, name: str) -> str:
        return f"{self.url}/{sub}/{name}"

    def prepare(self) -> None:
        """Make the layout where the file system has folders, and prove the store takes writes."""
        if self.local:
            _local_layout(self.root)
        # a name of this opener's own: the nodes of one job open the remote at once (docs/nodes.md)
        probe = self._path(f".layerckpt-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.fs.pipe_file(probe, b"layerckpt\n")
        self.fs.rm_file(probe)

    def names(self, sub: str) -> List[str]:
        if self.local:
            return _local_names(self.root, sub)
        path = self._path(sub)
        self.fs.invalidate_cache(path)  # never a cached listing: another process may have written since
        try:
            return sorted(_name(p) for p in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def read(self, sub: str, name: str, what: Optional[str] = None, cap: Optional[int] = None) -> bytes:
        """The bytes of a small file of the tier (a manifest, the identity), refused past ``cap`` bytes
        (``_json.MAX_JSON_BYTES``) before they are read: the size is asked first, and the read has an end."""
        what, cap = what or _what(sub), _json.MAX_JSON_BYTES if cap is None else cap
        path = self._path(sub, name)
        if self.local:
            return _local_read(self.root, path, what, cap)
        self.fs.invalidate_cache(path)  # the size now, not a listing's from before the file was replaced
        size = self.fs.size(path)
        if size is not None and size > cap:
            raise too_big(self.where(sub, name), what, size, cap)
        if size == 0:  # S3 refuses a range of an empty object (416): it holds nothing to read
            return b""
        raw = self.fs.cat_file(path, start=0, end=cap + 1)
        if len(raw) > cap:  # it grew since its size was asked
            raise CheckpointCorruptError(f"{what} {self.where(sub, name)} holds more than the {cap_text(cap)} a "
                                         f"{what} may hold", path=self.where(sub, name))
        return raw

    def head(self, sub: str, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of a file of the tier (one ranged read)."""
        path = self._path(sub, name)
        if self.local:
            return _local_head(self.root, path, _what(sub), nbytes)
        return bytes(self.fs.cat_file(path, start=0, end=nbytes))[:nbytes]

    def size(self, sub: str, name: str) -> int:
        return int(self.fs.size(self._path(sub, name)))

    def put_file(self, src: str, sub: str, name: str) -> None:
        """Upload ``src`` whole.  Where a put is not atomic (a ``file://`` folder: the file is truncated, then
        written) it goes to a name of this writer's own and is moved into place: a kill midway through
        uploading a file the remote already holds (a node's catch-up after a restart) must not leave it torn
        under a committed manifest."""
        final = self._path(sub, name)
        dst = final if self.atomic_put else self._path(sub, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        if self.bucket is None:
            self.fs.put_file(src, dst, **self._put_kw)
        else:
            self._put_capped(src, dst)
        if dst != final:
            self.fs.mv(dst, final)
        want, got = os.path.getsize(src), self.size(sub, name)
        if got != want:
            raise OSError(errno.EIO, f"uploaded {got} of {want} bytes", self.where(sub, name))

    def _put_capped(self, src: str, dst: str) -> None:
        """Stream ``src`` to ``dst`` a chunk at a time, each chunk's bytes taken from the bucket first.  The
        file system's writer keeps its own parts (multipart on S3, in parts of the uncapped size)."""
        with open(src, "rb") as fin, self.fs.open(dst, "wb", block_size=self._part_bytes) as fout:
            while True:
                buf = fin.read(self._chunk)
                if not buf:
                    break
                self.bucket.take(len(buf))
                fout.write(buf)

    def put_bytes(self, sub: str, name: str, data: bytes) -> None:
        dst = self._path(sub, name)
        if self.bucket is not None:
            self.bucket.take(len(data))
        if self.atomic_put:
            self.fs.pipe_file(dst, data)
        else:  # no atomic put here: a reader must never see half a manifest
            tmp = self._path(sub, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # one writer's own
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, dst)

    def get_file(self, sub: str, name: str, dst: str, size: Optional[int] = None) -> None:
        """Copy the tier's file to the local ``dst``: at most ``size`` bytes (what its manifest records; else
        the size the tier reports for it), refused before copying where the tier reports more, and the partial
        copy deleted where more comes."""
        src = self._path(sub, name)
        if self.local:
            return _local_get(self.root, sub, src, dst, size)
        self.fs.invalidate_cache(src)  # the size (and version) now, not a listing's from before
        have = self.fs.size(src)
        if size is not None and have is not None and have > size:
            raise bigger(self.where(sub, name), have, size, _what(sub))
        cap, expected = (size, "its manifest records") if size is not None else (have, "the tier reported for it")
        if cap is None:
            raise CheckpointError(f"{self.where(sub, name)}: the remote reports no size for it; refused")
        with self.fs.open(src, "rb", block_size=min(GET_PIECE, max(cap, 1 << 20))) as fin:
            copy_capped(fin.read, dst, cap, self.where(sub, name), _what(sub), expected)

    def delete(self, sub: str, names: List[str]) -> List[str]:
        gone = []
        for n in names:
            try:
                self.fs.rm_file(self._path(sub, n))
                gone.append(n)
            except FileNotFoundError:
                pass
            except OSError as e:  # one failed delete must not stop the rest
                log.warning("layerckpt: could not delete %s: %s", self.where(sub, n), e)
        return gone


class LocalStore:
    """A tier in a local folder (the memory tier's ``/dev/shm/...``): plain files, manifests renamed into place."""

    def __init__(self, path: str):
        self.root = path
        self.url = path
        self.local = True

    def where(self, sub: str, name: str) -> str:
        return os.path.join(self.root, sub, name)

    def prepare(self) -> None:
        _local_layout(self.root)

    def names(self, sub: str) -> List[str]:
        return _local_names(self.root, sub)

    def read(self, sub: str, name: str, what: Optional[str] = None, cap: Optional[int] = None) -> bytes:
        # a local tier may sit in a shared folder (/dev/shm): no FIFO, device or link is read, and not unbounded
        return _local_read(self.root, self.where(sub, name), what or _what(sub),
                           _json.MAX_JSON_BYTES if cap is None else cap)

    def head(self, sub: str, name: str, nbytes: int) -> bytes:
        return _local_head(self.root, self.where(sub, name), _what(sub), nbytes)

    def size(self, sub: str, name: str) -> int:
        return os.path.getsize(self.where(sub, name))

    def put_file(self, src: str, sub: str, name: str) -> None:
        dst = self.where(sub, name)
        tmp = dst + ".tmp"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)

    def put_bytes(self, sub: str, name: str, data: bytes) -> None:
        write_atomic(self.where(sub, name), data)

    def get_file(self, sub: str, name: str, dst: str, size: Optional[int] = None) -> None:
        _local_get(self.root, sub, self.where(sub, name), dst, size)

    def delete(self, sub: str, names: List[str]) -> List[str]:
        gone = []
        for n in names:
            try:
                os.unlink(self.where(sub, n))
                gone.append(n)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("layerckpt: could not delete %s: %s", self.where(sub, n), e)
        return gone
