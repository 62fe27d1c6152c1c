"""The memory tier's place: the newest composite, in the checkpoint directory's format, under
``/dev/shm/layerckpt-<hash of the directory's absolute path>/``.

Shared memory outlives the process (a restart after a crash finds it) but not
the node (a reboot empties it, and the disk is read instead).  ``LAYERCKPT_SHM``
names another base folder where /dev/shm is missing or small.

The place is predictable and /dev/shm is writable by every local user (and every container sharing it),
so the folder is created private (0700) and, before any use, must be a real folder (not a link) owned by
this user and writable by nobody else (:func:`refusal`); that it holds this store's composites is then
checked by the store identity it carries (``_tiers``).
"""
from __future__ import annotations

import hashlib
import os
import stat
from typing import Optional

SHM = "/dev/shm"
ORIGIN = ".origin"  # in a memory tier: the absolute path of the directory whose composites it copies, and a newline


def _base() -> str:
    """The folder memory tiers live in: ``LAYERCKPT_SHM``, else /dev/shm."""
    return os.environ.get("LAYERCKPT_SHM") or SHM


def base_hint() -> str:
    """What to check where a memory tier's folder could not be made: its base folder, named by where it came
    from."""
    if os.environ.get("LAYERCKPT_SHM"):
        return f"that LAYERCKPT_SHM names an existing folder this user can write ({_base()})"
    return f"that {SHM} is writable, or name another base folder in LAYERCKPT_SHM"


def memory_path(root: str) -> str:
    """Where the memory tier of the checkpoint directory ``root`` lives."""
    base = _base()
    digest = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]
    return os.path.join(base, f"layerckpt-{digest}")


def refusal(path: str) -> Optional[str]:
    """Why the existing folder ``path`` must not be used as a memory tier; None when it may (a real folder,
    owned by this user, not writable by group or others).  Raises FileNotFoundError when it is absent."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if os.path.islink(path):
            return "it is a symbolic link"
        return f"it cannot be opened as a folder ({os.strerror(e.errno or 0)})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_private(path: str) -> Optional[str]:
    """Create the memory tier's folder ``path`` (0700) unless it exists; why it must not be used, or None."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return refusal(path)


def record_origin(tier: str, root: str) -> None:
    """Write ``tier``'s ``.origin``: the directory ``root`` whose composites it copies, read by ``layerckpt shm``
    (``_shm``) to find the tiers whose directory is gone (atomically; a failure only leaves the tier "unknown"
    there)."""
    tmp = os.path.join(tier, f"{ORIGIN}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write((os.path.abspath(root) + "\n").encode("utf-8", "surrogateescape"))
        os.replace(tmp, os.path.join(tier, ORIGIN))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
