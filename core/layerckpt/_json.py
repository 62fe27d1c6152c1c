"""Reading the small files a store and its folders hold (manifests, pointers), as untrusted input.

A store may be damaged, or written by someone else (a shared file system, a copied folder), so a read
here never hangs, never follows a link it was not meant to, never reads without bound, and every
malformation becomes a :class:`CheckpointCorruptError` naming the file (and the field or key):

- :func:`read_regular` opens without blocking (a FIFO in place of a file would otherwise wait for a
  writer forever), looks at what it opened before reading (only a regular file is read: not a directory,
  not ``/dev/zero``), and refuses more than a cap of bytes;
- :func:`loads_strict` parses JSON refusing duplicate keys (the last one would silently win: a second
  entry for a tensor could point it at another tensor's bytes), integers with absurdly many digits, and
  nesting deeper than the parser can follow.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, List, Tuple, Union

from .errors import CheckpointCorruptError, CheckpointNotFoundError

#: the most bytes a manifest (or any JSON file of a store) may hold: generous, far above any real one
MAX_JSON_BYTES = 256 << 20
#: the most digits an integer in a store's JSON may have (a step, a size, an offset, a checksum: < 25)
MAX_INT_DIGITS = 100


def open_regular(path: str, what: str = "manifest", follow: bool = True) -> Tuple[int, os.stat_result]:
    """``path`` opened for reading without blocking (a FIFO would wait for a writer forever), and what it is;
    a missing one raises :class:`CheckpointNotFoundError`, anything but a regular file a
    :class:`CheckpointCorruptError`.  ``follow=False`` refuses a symbolic link too (a file the library itself
    wrote inside a store).  The caller closes the descriptor."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise CheckpointCorruptError(_refusal(path, what, e), path=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{what} {path} is not a regular file ({_kind(st.st_mode)}); remove it", path=path)
    return fd, st


def read_regular(path: str, what: str = "manifest", cap: int = MAX_JSON_BYTES, follow: bool = True) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), refused past ``cap`` bytes."""
    fd, st = open_regular(path, what, follow)
    try:
        if st.st_size > cap:
            raise CheckpointCorruptError(
                f"{what} {path} holds {st.st_size} bytes, more than the {cap >> 20} MiB a {what} may hold; "
                f"the file is damaged or not a {what}", path=path)
        return _read_capped(fd, path, what, cap)
    finally:
        os.close(fd)


def _read_capped(fd: int, path: str, what: str, cap: int) -> bytes:
    chunks: List[bytes] = []
    total = 0
    while True:
        try:
            b = os.read(fd, 1 << 20)
        except OSError as e:
            raise CheckpointCorruptError(f"reading {what} {path} failed: {os.strerror(e.errno or errno.EIO)}",
                                         path=path) from None
        if not b:
            return b"".join(chunks)
        total += len(b)
        if total > cap:  # it grew while being read
            raise CheckpointCorruptError(f"{what} {path} holds more than the {cap >> 20} MiB a {what} may hold",
                                         path=path)
        chunks.append(b)


def _refusal(path: str, what: str, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return f"{what} {path} is a symbolic link; layerckpt reads the files it wrote itself, never through a link"
    if e.errno == errno.EISDIR:
        return f"{what} {path} is a directory, not a file; remove it"
    return f"{what} {path} cannot be read: {os.strerror(e.errno or errno.EIO)}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a plain file"


def loads_strict(raw: Union[bytes, str], where: str, what: str = "manifest") -> Any:
    """Parse the JSON text of the file ``where``: UTF-8, no duplicate key in any object, no integer of more
    than MAX_INT_DIGITS digits, no nesting deeper than the parser follows; NaN and Infinity are accepted
    (a manifest records them).  Any failure is a :class:`CheckpointCorruptError` naming ``where``."""
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        return json.loads(text, object_pairs_hook=_Pairs(where, what), parse_int=_Int(where, what))
    except CheckpointCorruptError:
        raise
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(f"{what} {where} is not UTF-8 text ({e.reason} at byte {e.start})",
                                     path=where) from None
    except RecursionError:
        raise CheckpointCorruptError(f"{what} {where} nests objects or lists too deeply to be a {what}",
                                     path=where) from None
    except ValueError as e:  # json.JSONDecodeError among them
        raise CheckpointCorruptError(f"{what} {where} is truncated or malformed ({e})", path=where) from None


class _Pairs:
    """``object_pairs_hook``: a dict, refusing a key that occurs twice in one object."""

    def __init__(self, where: str, what: str):
        self.where, self.what = where, what

    def __call__(self, pairs: List[Tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise CheckpointCorruptError(
                f"{self.what} {self.where} has the key {dup!r} twice in one object; a {self.what} never repeats a "
                f"key (which one would count is ambiguous): the file was edited or damaged", path=self.where)
        return out


class _Int:
    """``parse_int``: refuses integers of more than MAX_INT_DIGITS digits (Python's own limit raises a bare
    ValueError at 4300, and converting is quadratic below it)."""

    def __init__(self, where: str, what: str):
        self.where, self.what = where, what

    def __call__(self, s: str) -> int:
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            raise CheckpointCorruptError(
                f"{self.what} {self.where} holds an integer of {len(s)} digits (at most {MAX_INT_DIGITS} are "
                f"accepted): {s[:20]}...", path=self.where)
        return int(s)


def load_strict(path: str, what: str = "manifest", follow: bool = True) -> Any:
    """:func:`read_regular` then :func:`loads_strict`."""
    return loads_strict(read_regular(path, what, follow=follow), path, what)
