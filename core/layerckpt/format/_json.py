"""Reading the small files a store and its folders hold (manifests, pointers), as untrusted input.

A store may be damaged, or written by someone else (a shared file system, a copied folder), so a read
here never hangs, never follows a link it was not meant to, never reads without bound, and every
malformation becomes a :class:`CheckpointCorruptError` naming the file (and the field or key):

- :func:`read_regular` opens without blocking (a FIFO in place of a file would otherwise wait for a
  writer forever), looks at what it opened before reading (only a regular file is read: not a directory,
  not ``/dev/zero``), and refuses more than a cap of bytes;
- :func:`open_regular` is the one open of every file of every tier for reading: a store's own file is
  opened from the folder above its store folder (``data/``, ``manifests/``), or from a tier's root, one
  component at a time, none followed through a link, so a folder linked elsewhere never leads a read
  outside the store (the root itself, which the user chose, may be a link); :func:`open_dir` opens a
  folder for listing the same way;
- :func:`loads_strict` parses JSON refusing duplicate keys (the last one would silently win: a second
  entry for a tensor could point it at another tensor's bytes), integers with absurdly many digits, and
  nesting deeper than the parser can follow.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, List, Optional, Tuple, Union

from ..errors import CheckpointCorruptError, CheckpointNotFoundError

#: the most bytes a manifest (or any JSON file of a store) may hold: generous, far above any real one
MAX_JSON_BYTES = 256 << 20
#: the most digits an integer in a store's JSON may have (a step, a size, an offset, a checksum: < 25)
MAX_INT_DIGITS = 100


#: a store's own folders (and its tiers'): a file in one is opened from the folder above it, and the folder
#: itself never through a link (the store's root, which the user chose, may be one)
STORE_FOLDERS = ("data", "manifests")
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_regular(path: str, what: str = "manifest", follow: bool = True, *, under: Optional[str] = None
                 ) -> Tuple[int, os.stat_result]:
    """``path`` opened for reading without blocking (a FIFO would wait for a writer forever), and what it is;
    a missing one raises :class:`CheckpointNotFoundError`, anything but a regular file a
    :class:`CheckpointCorruptError`.  ``follow=False`` refuses a symbolic link too (a file the library itself
    wrote inside a store), and a link or anything but a directory in place of the store folder it lies in
    (``data/``, ``manifests/``).  ``under``: a folder ``path`` lies in (a tier's root); no component of
    ``path`` below it is followed through a link.  The caller closes the descriptor."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if follow and under is None:
        fd = _open_file(path, flags, path, what)
    else:
        start, parts = _below(path, under, what)
        dfd = _walk(start, parts[:-1], path, what)
        try:
            fd = _open_file(parts[-1], flags | _NOFOLLOW, path, what, dfd)
        finally:
            os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{what} {path} is not a regular file ({_kind(st.st_mode)}); remove it", path=path)
    return fd, st


def open_dir(under: str, rel: str, what: str = "folder") -> int:
    """The folder ``under/rel`` opened for listing, no component of ``rel`` followed through a link (``under``
    may be one); a missing one raises :class:`CheckpointNotFoundError`, a link or anything but a directory a
    :class:`CheckpointCorruptError`.  The caller closes the descriptor."""
    parts = [p for p in rel.split("/") if p]
    path = "/".join([under.rstrip("/") or "/"] + parts)
    _plain_parts(parts, path, what)
    return _walk(under, parts, path, what)


def _open_file(name: str, flags: int, path: str, what: str, dir_fd: Optional[int] = None) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise CheckpointCorruptError(_refusal(path, what, e), path=path) from None


def _below(path: str, under: Optional[str], what: str) -> Tuple[str, List[str]]:
    """(the folder an open of ``path`` starts from, following links, and the components below it)."""
    if under is None:
        parent = os.path.dirname(path)
        if os.path.basename(parent) in STORE_FOLDERS:
            return os.path.dirname(parent) or ".", [os.path.basename(parent), os.path.basename(path)]
        return parent or ".", [os.path.basename(path)]
    base = under.rstrip("/") or "/"
    if not path.startswith(base.rstrip("/") + "/"):
        raise CheckpointCorruptError(f"{what} {path} lies outside {base}; refused", path=path)
    parts = [p for p in path[len(base):].split("/") if p]
    _plain_parts(parts, path, what)
    return base, parts


def _plain_parts(parts: List[str], path: str, what: str) -> None:
    if any(p in (".", "..") for p in parts):
        raise CheckpointCorruptError(f"{what} {path} names a parent or current folder ('..', '.'); refused",
                                     path=path)


def _walk(start: str, parts: List[str], path: str, what: str) -> int:
    """``start`` opened (following a link: a root the user chose), then each folder of ``parts`` below it
    without following one; the descriptor of the last."""
    try:
        fd = os.open(start, _DIR)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} {path} does not exist") from None
    except OSError as e:
        why = "is not a directory" if e.errno == errno.ENOTDIR else f"cannot be opened: {os.strerror(e.errno or 0)}"
        raise CheckpointCorruptError(f"{what} {path} cannot be read: {start} {why}", path=start) from None
    here = start
    for part in parts:
        here = os.path.join(here, part)
        try:
            nxt = os.open(part, _DIR | _NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            os.close(fd)
            raise CheckpointNotFoundError(f"{what} {path} does not exist") from None
        except OSError as e:
            why = _folder_refusal(part, fd, here, e)
            os.close(fd)
            raise CheckpointCorruptError(why if here == path else f"{what} {path} cannot be read: {why}",
                                         path=here) from None
        os.close(fd)
        fd = nxt
    return fd


def _folder_refusal(part: str, dir_fd: int, here: str, e: OSError) -> str:
    if e.errno in (errno.ENOTDIR, errno.ELOOP):
        try:
            mode = os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
        if stat.S_ISLNK(mode):
            return (f"the folder {here} is a symbolic link; layerckpt never reads a store's own folders through "
                    f"a link (it could lead outside the store): replace the link by the folder it points to")
        return (f"{here} is {_kind(mode)}, not a directory; a store keeps its files in its own folders "
                f"(data/, manifests/): move it away")
    if e.errno == errno.ENAMETOOLONG:
        return f"the name of the folder {here} is longer than the file system allows"
    return f"the folder {here} cannot be opened: {os.strerror(e.errno or errno.EIO)}"


def cap_text(cap: int) -> str:
    """A size cap as a message says it: whole MiB, else bytes (a 4 KiB cap is not '0 MiB')."""
    return f"{cap >> 20} MiB" if cap >= 1 << 20 and cap % (1 << 20) == 0 else f"{cap} bytes"


def too_big(path: str, what: str, size: int, cap: int) -> CheckpointCorruptError:
    """The refusal of a ``what`` of ``size`` bytes past its ``cap``, before any of it is read."""
    return CheckpointCorruptError(f"{what} {path} holds {size} bytes, more than the {cap_text(cap)} a {what} may "
                                  f"hold; the file is damaged or not a {what}", path=path)


def read_regular(path: str, what: str = "manifest", cap: int = MAX_JSON_BYTES, follow: bool = True, *,
                 under: Optional[str] = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), refused past ``cap`` bytes."""
    fd, st = open_regular(path, what, follow, under=under)
    try:
        if st.st_size > cap:
            raise too_big(path, what, st.st_size, cap)
        return _read_capped(fd, path, what, cap)
    finally:
        os.close(fd)


def _read_capped(fd: int, path: str, what: str, cap: int) -> bytes:
    chunks: List[bytes] = []
    total = 0
    while True:
        try:
            b = os.read(fd, min(1 << 20, cap + 1 - total))
        except OSError as e:
            raise CheckpointCorruptError(f"reading {what} {path} failed: {os.strerror(e.errno or errno.EIO)}",
                                         path=path) from None
        if not b:
            return b"".join(chunks)
        total += len(b)
        if total > cap:  # it grew while being read
            raise CheckpointCorruptError(f"{what} {path} holds more than the {cap_text(cap)} a {what} may hold",
                                         path=path)
        chunks.append(b)


def _refusal(path: str, what: str, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return f"{what} {path} is a symbolic link; layerckpt reads the files it wrote itself, never through a link"
    if e.errno == errno.EISDIR:
        return f"{what} {path} is a directory, not a file; remove it"
    if e.errno == errno.ENAMETOOLONG:
        return (f"{what} {path} has a name longer than the file system allows; it is not a file layerckpt "
                f"wrote: the store is damaged")
    if e.errno == errno.ENOTDIR:
        return f"{what} {path} lies under something that is not a directory; the store is damaged"
    return f"{what} {path} cannot be read: {os.strerror(e.errno or errno.EIO)}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a plain file"


def loads_strict(raw: Union[bytes, str], where: str, what: str = "manifest") -> Any:
    """Parse the JSON text of the file ``where``: UTF-8, no duplicate key in any object, no integer of more
    than MAX_INT_DIGITS digits, no nesting deeper than the parser follows; NaN and Infinity are accepted
    (a manifest records them).  Any failure is a :class:`CheckpointCorruptError` naming ``where``."""
    try:
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
        text = raw if isinstance(raw, str) else data.decode("utf-8")
        if data.translate(_DIGITS).find(_LONG_RUN) < 0:  # no integer can be too long: the parser's own int()
            return json.loads(text, object_pairs_hook=_Pairs(where, what))
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


#: a run of digits longer than an integer may be; where the text holds none (in a string or not), no integer in it
#: can be, and the parser converts them without a call per integer (a manifest holds thousands)
_DIGITS, _LONG_RUN = bytes.maketrans(b"123456789", b"000000000"), b"0" * (MAX_INT_DIGITS + 1)


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
