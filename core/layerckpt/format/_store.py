"""The checkpoint directory: where manifests and data files live, and which manifest a path names.

```
<dirpath>/data/step-00000100.rank0.safetensors   one file per (step, rank): a valid safetensors file
<dirpath>/manifests/step-00000100.json           the commit record (see _manifest)
<dirpath>/latest                                  name of the newest committed manifest (a hint)
<dirpath>/.store-id                               the store's identity (random, made by its first writer)
<dirpath>/.step-order                             present while commit order is step order (see ``ORDER``)
```
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ._json import open_dir, open_regular, read_regular
from ._manifest import Manifest, load_manifest
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt")

DATA_DIR = "data"
MANIFEST_DIR = "manifests"
LATEST = "latest"
_MANIFEST_RE = re.compile(r"^step-(\d{8,})\.json$")
_DATA_RE = re.compile(r"^step-(\d{8,})(?:\.v(\d+))?\.rank(\d+)\.safetensors$")


def manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


def data_name(step: int, rank: int, version: int = 0) -> str:
    v = f".v{version}" if version else ""
    return f"step-{step:08d}{v}.rank{rank}.safetensors"


def manifest_step(name: str) -> Optional[int]:
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def is_data_name(name: str) -> bool:
    return _DATA_RE.match(name) is not None


def data_step(name: str) -> Optional[Tuple[int, int]]:
    """(step, version) of a data file's name; None for another name."""
    m = _DATA_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


NAME_MAX = 255  # the longest file name (in bytes) the file systems layerckpt writes to take


def safe_join(root: str, sub: str, name: Any, what: str) -> str:
    """Join a file name from a manifest under root/sub, refusing anything that could escape it: a name that is
    not a plain one, or longer than a file name may be, or that is a symbolic link (each open refuses links
    too, see ``_json.open_regular``: this check keeps a stat of the path from following one)."""
    folder = os.path.join(root, sub)
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise CheckpointCorruptError(
            f"{what} names {name!r}, which is not a plain file name inside {folder}; refused", path=folder)
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise CheckpointCorruptError(
            f"{what} names a file of {len(name)} characters ({name[:40]}...), longer than a file name may be "
            f"({NAME_MAX} bytes): not a file layerckpt wrote, the manifest is damaged", path=folder)
    path = os.path.join(folder, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path  # the reader says what is missing
    except OSError as e:  # a folder on the way that is a file, a loop of links
        raise CheckpointCorruptError(f"{what} names {path}, which cannot be reached: "
                                     f"{os.strerror(e.errno or errno.EIO)}; the store is damaged", path=path) from None
    if stat.S_ISLNK(mode):
        raise CheckpointCorruptError(f"{what} names {path}, which is a symbolic link; layerckpt reads the files it "
                                     f"wrote itself, never through a link: the store is damaged", path=path)
    return path


def create(path: str) -> int:
    """``path`` opened for writing, created or truncated, never through a symbolic link planted in its place
    (``OSError`` ELOOP instead): how every file layerckpt writes is opened (O_DIRECT aside: ``_backend``)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_CLOEXEC", 0), 0o644)


def write_atomic(path: str, data: bytes, durable: bool = True) -> None:
    """Write tmp, fsync, rename over path, fsync the directory.  ``durable=False``: no fsync (a hint that
    decides nothing, such as ``latest``): still replaced whole, never seen half written."""
    tmp = path + ".tmp"
    fd = create(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_layout(root: str) -> None:
    """Refuse a store whose ``data`` or ``manifests`` is a symbolic link (a read would leave the store through
    it) or anything but a directory, naming it; either may be missing.  The root itself may be a link."""
    if not os.path.isdir(root):
        return
    for sub in (DATA_DIR, MANIFEST_DIR):
        try:
            os.close(open_dir(root, sub, "store folder"))
        except CheckpointNotFoundError:
            pass


def list_manifests(root: str) -> List[Tuple[int, str]]:
    """Committed manifests as (step, name), oldest step first."""
    check_layout(root)
    d = os.path.join(root, MANIFEST_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    out = [(manifest_step(n), n) for n in names]
    return sorted((s, n) for s, n in out if s is not None)


WRITER_LOCK = ".writer.lock"


class WriterLock:
    """One writing process per store: an exclusive ``flock`` on ``<root>/.writer.lock``, held while a
    Checkpointer is open (released by the kernel if its process dies).  Readers never take it.  Inside one
    process a newer Checkpointer takes over from the older one before it locks (see ``_registry``)."""

    def __init__(self, root: str):
        import fcntl
        import socket

        path = os.path.join(root, WRITER_LOCK)
        self._fd: Optional[int] = _open_lock_file(path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 256, 0).decode("utf-8", "replace").strip() or "another Checkpointer"
            os.close(self._fd)
            ours = holder.startswith(f"pid {os.getpid()} ")
            raise CheckpointError(
                f"{root} already has a writer ({holder}): a store takes one Checkpointer at a time, in one "
                + ("process; a Checkpointer of this process holds it under another path: open it by the same "
                   "path to take over, or close() that one first" if ours else
                   "process; close() that one (or end that process) first, or save into another directory")
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _open_lock_file(path: str) -> int:
    """The lock file, opened for writing; never through a symbolic link, never anything but a plain file."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise CheckpointError(
                f"{path} is a symbolic link; layerckpt never writes through one: remove it (the store's writer "
                f"lock is a plain file it creates itself)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a plain file; remove it (the store's writer lock is a plain file "
                              f"layerckpt creates itself)")
    return fd


STORE_ID = ".store-id"
_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def parse_store_id(raw: bytes, where: str) -> str:
    """The identity a ``.store-id`` file holds (32 hex digits); anything else is a damaged file."""
    text = bytes(raw).decode("ascii", "replace").strip()
    if not _ID_RE.match(text):
        raise CheckpointCorruptError(f"store identity {where} does not hold 32 hex digits; the file is damaged "
                                     f"or not layerckpt's", path=where)
    return text


def store_id(root: str) -> Optional[str]:
    """The identity of the store ``root``, None where it has none (a store no writer opened since identities
    exist); never read through a link."""
    path = os.path.join(root, STORE_ID)
    try:
        raw = read_regular(path, "store identity", cap=4096, follow=False, under=root)
    except CheckpointNotFoundError:
        return None
    return parse_store_id(raw, path)


def ensure_store_id(root: str, value: Optional[str] = None) -> str:
    """The identity of the store ``root``, created (``value``, else a random one) where it has none; the file
    is created exclusively and never through a link."""
    import uuid

    path = os.path.join(root, STORE_ID)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:  # made before (or a link, which store_id refuses)
        found = store_id(root)
        if found is None:
            raise CheckpointError(f"{path} vanished while it was being read; open the store again")
        return found
    value = value or uuid.uuid4().hex
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return value


def local_path(path: Union[str, "os.PathLike[str]"], what: str = "checkpoint directory") -> str:
    """An absolute local path; a URL (``s3://``, ``gs://``, ...) is refused rather than taken for a folder."""
    p = os.fspath(path)
    if isinstance(p, str) and "://" in p:
        raise CheckpointError(
            f"{what} {p!r} is a URL: layerckpt writes to a local directory; pass a local path, and the URL as "
            f"Config(remote=...) to copy the checkpoints there (restore() and the CLI read URLs)")
    return os.path.abspath(p)


def ensure_layout(root: str) -> None:
    check_layout(root)
    for sub in (DATA_DIR, MANIFEST_DIR):
        os.makedirs(os.path.join(root, sub), exist_ok=True)


def read_all(root: str) -> Tuple[Dict[str, Manifest], List[str]]:
    """All committed manifests that parse, by name, and the names of those that do not; one that retention
    deleted since the listing is neither."""
    good, bad, _ = _read_listed(root)
    return good, bad


def _read_listed(root: str) -> Tuple[Dict[str, Manifest], List[str], int]:
    """:func:`read_all`, and how many listed manifests vanished before they were read (retention)."""
    good, bad, gone = {}, [], 0
    for _, name in list_manifests(root):
        try:
            good[name] = load_manifest(os.path.join(root, MANIFEST_DIR, name))
        except CheckpointNotFoundError:
            gone += 1
        except CheckpointError:
            bad.append(name)
    return good, bad, gone


def recency(manifests: Dict[str, Manifest]):
    """Commit order (seq), then step: the newest committed is not always the highest step."""
    return lambda n: (manifests[n].seq, manifests[n].step)


def newest(manifests: Dict[str, Manifest]) -> Optional[str]:
    return max(manifests, key=recency(manifests), default=None)


def resolve(root: str, step: Optional[int] = None) -> str:
    """Path of the manifest to restore: the one for `step`, else the newest committed."""
    root = local_path(root)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    check_layout(root)
    if not os.path.isdir(os.path.join(root, MANIFEST_DIR)):
        raise CheckpointNotFoundError(
            f"{root} is not a layerckpt directory (no {MANIFEST_DIR}/); point at the dirpath given to Checkpointer"
        )
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        path = os.path.join(root, MANIFEST_DIR, manifest_name(step))
        if not os.path.exists(path):
            have = [s for s, _ in list_manifests(root)]
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {root}; committed steps: {have}")
        return path
    # the manifests are the only commit record: `latest` may lag them after a crash, so it decides nothing
    for _ in range(3):  # a writer's retention may delete what was listed: list again
        name, listed, bad, gone = _newest_listed(root)
        if name is not None or not gone:
            break
    if name is None:
        hint = f" ({len(bad)} damaged manifest(s): {', '.join(bad)})" if bad else ""
        raise CheckpointNotFoundError(f"no committed checkpoint in {root}{hint}")
    # never fall back silently past a newer checkpoint that was committed and then damaged: every manifest of a
    # higher step is read whole (none but after a rollback to an earlier step); a damaged one raises, naming it
    at = manifest_step(name)
    for step, other in listed:
        if step > at:
            try:
                load_manifest(os.path.join(root, MANIFEST_DIR, other))
            except CheckpointNotFoundError:
                pass
    return os.path.join(root, MANIFEST_DIR, name)


#: how this library's writer starts a manifest (``Manifest.to_json``): the step, then the commit number
HEAD = re.compile(rb'^\{"step":(\d{1,19}),"seq":(\d{1,19}),')
HEAD_BYTES = 64


def peek(path: str) -> Optional[Tuple[int, int]]:
    """(seq, step) of the manifest ``path`` from its first bytes, without parsing the rest; None where they are
    not laid out as this library writes them (another writer's, or damage): read it whole.  Opened as
    :func:`load_manifest` opens it (no link followed, nothing but a regular file)."""
    fd, _ = open_regular(path, "manifest", follow=False)
    try:
        head = os.read(fd, HEAD_BYTES)
    finally:
        os.close(fd)
    m = HEAD.match(head)
    return (int(m.group(2)), int(m.group(1))) if m else None


def max_seq(root: str, mark: bool = False) -> int:
    """The highest commit number of the committed manifests (0 for none): a new writer's commits go past it.
    From each manifest's first bytes (:func:`peek`) where they tell, else from the manifest read whole; a
    damaged or vanished one counts for nothing.  Where the store's commit order is its step order
    (``ORDER``), the highest step's alone; else read from every manifest, and with ``mark`` (the store's
    writer, holding its lock) ``ORDER`` made where their numbers rise with their steps, removed where not."""
    listed = list_manifests(root)
    if step_ordered(root, listed):
        for step, name in reversed(listed):
            got = _seq(root, step, name)
            if got is not None:
                return got
        return 0
    top, ordered = 0, True
    for step, name in listed:
        got = _seq(root, step, name)
        if got is not None:
            ordered = ordered and got > top
            top = max(top, got)
    if mark:
        mark_order(root, ordered)
    return top


def _seq(root: str, step: int, name: str) -> Optional[int]:
    """The commit number of the manifest ``name`` (of ``step``), None where it is damaged or gone."""
    path = os.path.join(root, MANIFEST_DIR, name)
    try:
        head = peek(path)
        return head[0] if head is not None and head[1] == step else load_manifest(path).seq
    except CheckpointError:
        return None


def _newest_listed(root: str) -> Tuple[Optional[str], List[Tuple[int, str]], List[str], int]:
    """The newest committed manifest's name (commit order, then step), read whole and valid; the listing; the
    names found damaged; how many listed vanished before they were read (retention).  In a store whose commit
    order is its step order (:func:`step_ordered`) the manifests are tried from the highest step down, none
    but those read; else each one's first bytes are read to order them."""
    listed = list_manifests(root)

    def read(name: str) -> Optional[Manifest]:
        try:
            return load_manifest(os.path.join(root, MANIFEST_DIR, name))
        except CheckpointNotFoundError:
            return None

    if step_ordered(root, listed):
        bad: List[str] = []
        gone = 0
        for _, name in reversed(listed):
            try:
                m = read(name)
            except CheckpointError:
                bad.append(name)
                continue
            if m is not None:
                return name, listed, bad, gone
            gone += 1
        return None, listed, bad, gone
    name, _, bad, gone = pick_newest([n for _, n in listed], lambda n: peek(os.path.join(root, MANIFEST_DIR, n)),
                                     read)
    return name, listed, bad, gone


#: Commit order is step order in a store holding this file: its writer made it (durably) at opening, having
#: read every manifest's commit number in step order, and removes it (durably) before it commits a step at or
#: below one the store holds, which a restore of an older step and training on from there do.  While it is
#: there, the newest commit is the manifest of the highest step, and a restore or a writer's opening reads
#: that one, not the first bytes of every manifest: their cost does not grow with the checkpoints kept.
ORDER = ".step-order"


def step_ordered(root: str, listed: List[Tuple[int, str]]) -> bool:
    """Whether the store's commit order is its step order (``listed``: its manifests, as listed): ``ORDER`` is
    there, and ``latest``, where it names another listed manifest than the highest step's, does not name a
    later commit (a writer of a version before ``ORDER`` that committed a lower step leaves it so)."""
    if not listed or not os.path.isfile(os.path.join(root, ORDER)):
        return False
    top = listed[-1][1]
    try:
        hint = read_regular(os.path.join(root, LATEST), "latest", cap=256, follow=False, under=root)
    except CheckpointError:
        return True  # no hint (never written, or damaged): the marker alone decides
    name = bytes(hint).decode("ascii", "replace").strip()
    if name == top or manifest_step(name) is None or all(n != name for _, n in listed):
        return True
    try:
        a = peek(os.path.join(root, MANIFEST_DIR, name))
        b = peek(os.path.join(root, MANIFEST_DIR, top))
    except CheckpointError:
        return False
    return a is not None and b is not None and a[0] < b[0]


def mark_order(root: str, ordered: bool) -> None:
    """Make (``ordered``) or remove the store's ``ORDER`` file, durably, where it is not so already."""
    path = os.path.join(root, ORDER)
    if ordered == os.path.isfile(path):
        return
    if ordered:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
    fsync_dir(root)


def before_commit(root: str, step: int) -> None:
    """A writer is about to commit ``step``: where that is not above every step the store holds, its commit
    order stops being its step order (``ORDER`` goes, durably, before the manifest is written)."""
    if not os.path.isfile(os.path.join(root, ORDER)):
        return
    listed = list_manifests(root)
    if listed and listed[-1][0] >= step:
        mark_order(root, False)


def pick_newest(names: List[str], head: Callable[[str], Optional[Tuple[int, int]]],
                read: Callable[[str], Optional[Manifest]]) -> Tuple[Optional[str], Optional[Manifest], List[str], int]:
    """The newest committed of the manifests ``names`` (commit order, then step), of a store or a tier: (its
    name, it read whole and valid, the names found damaged, how many vanished since the listing).

    Only the newest is parsed: the others' order comes from their first bytes (``head``: (seq, step), or None
    where they do not tell; :func:`peek`), so a restore costs the same with 2 composites in the store or 2,000.
    A manifest whose first bytes do not tell is read whole.  ``read`` gives None for a vanished manifest and
    raises :class:`CheckpointError` for a damaged one."""
    order: List[Tuple[Tuple[int, int], str, Optional[Manifest]]] = []
    bad: List[str] = []
    gone = 0
    for name in names:
        try:
            h = head(name)
            if h is not None and h[1] == manifest_step(name):
                order.append((h, name, None))
                continue
            m = read(name)
        except CheckpointNotFoundError:
            m = None
        except CheckpointError:
            bad.append(name)
            continue
        if m is None:
            gone += 1
        else:
            order.append(((m.seq, m.step), name, m))
    for _, name, m in sorted(order, key=lambda o: (o[0], o[1]), reverse=True):
        try:
            m = m if m is not None else read(name)
        except CheckpointError:
            bad.append(name)
            continue
        if m is not None:
            return name, m, bad, gone
        gone += 1
    return None, None, bad, gone


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a layerckpt checkpoint directory or one of its manifests."""
    try:
        locate(path)
        return True
    except CheckpointError:
        return False


def locate(path: Union[str, os.PathLike]) -> Tuple[str, Optional[int]]:
    """(checkpoint directory, step or None for the newest) named by a directory or a manifest path."""
    p = local_path(path)
    if os.path.exists(p) and not (os.path.isfile(p) or os.path.isdir(p)):
        raise CheckpointCorruptError(f"{p} is neither a directory nor a regular file; pass a checkpoint directory "
                                     f"or one of its {MANIFEST_DIR}/step-N.json", path=p)
    if os.path.isfile(p):
        parent = os.path.dirname(p)
        step = manifest_step(os.path.basename(p))
        if step is None or os.path.basename(parent) != MANIFEST_DIR:
            raise CheckpointNotFoundError(f"{p} is a file but not a layerckpt manifest ({MANIFEST_DIR}/step-N.json)")
        return os.path.dirname(parent), step
    if os.path.isdir(p) and os.path.isdir(os.path.join(p, MANIFEST_DIR)):
        return p, None
    if os.path.isdir(p):
        raise CheckpointNotFoundError(
            f"{p} is a directory but not a layerckpt checkpoint (it has no {MANIFEST_DIR}/ folder); "
            f"pass the dirpath layerckpt saved into, or one of its {MANIFEST_DIR}/step-N.json")
    raise CheckpointNotFoundError(f"checkpoint {p} does not exist")


PART = "part.json"  # in a node's store of node-local directories: whose part of the composites it holds


def write_part(root: str, part: Dict[str, Any]) -> None:
    """Record, in a node's store, that it is a part of its composites (and whose)."""
    body = json.dumps(part, sort_keys=True).encode()
    path = os.path.join(root, PART)
    try:
        with open(path, "rb") as f:
            if f.read(1 << 16) == body:
                return
    except OSError:
        pass
    write_atomic(path, body)


def read_part(root: str) -> Optional[Dict[str, Any]]:
    """``part.json`` of a store (None where it has none: a store that holds whole composites)."""
    path = os.path.join(root, PART)
    try:
        raw = read_regular(path, "node part record", cap=1 << 16, follow=False, under=root)
    except CheckpointNotFoundError:
        return None
    try:
        d = json.loads(bytes(raw))
        if not (isinstance(d, dict) and isinstance(d.get("node"), str) and isinstance(d.get("ranks"), list)
                and all(isinstance(r, int) for r in d["ranks"]) and isinstance(d.get("nodes"), list)):
            raise ValueError("fields")
    except ValueError as e:
        raise CheckpointCorruptError(f"{path} is not a node part record ({e}); remove it if this directory is "
                                     f"not a node's part", path=path) from None
    return d


def clear_part(root: str) -> None:
    try:
        os.unlink(os.path.join(root, PART))
    except OSError:
        pass
