"""``layerckpt shm``: the memory tiers under the base folder (``LAYERCKPT_SHM``, else /dev/shm), and which are
orphans.

A memory tier outlives its process on purpose (a restart after a crash reads it), so nothing removes it when a
run ends; it goes when its store's writer opens with ``memory_tier=False``, or at a reboot.  A store deleted
with its tier still there (``rm -rf`` of the checkpoint directory, a benchmark's temporary folder) leaves the
tier holding its newest composite in memory until the node reboots.  Each tier records the absolute path of
its store (``.origin``, beside the store identity); a tier is an orphan where that store is gone, or holds
another identity now.  Removing an orphan loses nothing committed: a tier only ever holds copies of a store's
composites.

Only folders named as tiers are looked at, and only those :func:`_memtier.refusal` accepts (a real folder,
this user's, private) are measured or removed; a tier written before origins were recorded is "unknown" and
left alone (remove it by hand once no run uses it).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from typing import List, Optional

from ..format import _store
from ..format._json import read_regular
from ..errors import CheckpointError
from ._memtier import ORIGIN, _base, base_hint, memory_path, refusal

ORIGIN_BYTES = 4096
_NAME = re.compile(r"^layerckpt-[0-9a-f]{16}$")

LIVE, ORPHAN, UNKNOWN, REFUSED = "live", "orphan", "unknown", "refused"


@dataclass
class Found:
    path: str
    state: str  # LIVE, ORPHAN, UNKNOWN or REFUSED
    why: str  # what decided the state
    nbytes: int = 0
    origin: Optional[str] = None


def _identity(folder: str) -> Optional[str]:
    """The store identity ``folder`` holds (``_store.store_id``), None where it has none or it cannot be read."""
    try:
        return _store.store_id(folder)
    except (CheckpointError, OSError):
        return None


def _size(path: str) -> int:
    """Bytes of the regular files under ``path``, no link followed."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _judge(path: str) -> Found:
    try:
        why = refusal(path)
    except FileNotFoundError:
        return Found(path, REFUSED, "gone")
    if why is not None:
        return Found(path, REFUSED, why)
    nbytes = _size(path)
    try:
        raw = read_regular(os.path.join(path, ORIGIN), "memory tier origin", ORIGIN_BYTES, follow=False, under=path)
    except (CheckpointError, OSError):
        return Found(path, UNKNOWN, "no record of its store (written before layerckpt recorded one)", nbytes)
    origin = raw.decode("utf-8", "surrogateescape").rstrip("\n")
    if not os.path.isabs(origin) or "\n" in origin:
        return Found(path, UNKNOWN, "its record of its store is not an absolute path", nbytes)
    if os.path.basename(memory_path(origin)) != os.path.basename(path):
        return Found(path, UNKNOWN, f"its record names {origin}, whose memory tier is another folder", nbytes, origin)
    if not os.path.isdir(os.path.join(origin, _store.MANIFEST_DIR)):
        return Found(path, ORPHAN, f"its store {origin} is gone", nbytes, origin)
    mine, theirs = _identity(path), _identity(origin)
    if mine is not None and theirs is not None and mine != theirs:
        return Found(path, ORPHAN, f"the store now at {origin} is another one (identity {theirs}, the tier's "
                                   f"{mine})", nbytes, origin)
    return Found(path, LIVE, f"copies {origin}", nbytes, origin)


def scan(base: Optional[str] = None) -> List[Found]:
    """Every folder under ``base`` (default: the memory tiers' base folder) named as a memory tier, judged."""
    base = base or _base()
    try:
        names = sorted(n for n in os.listdir(base) if _NAME.match(n))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"the memory tiers' folder {base} cannot be listed: {os.strerror(e.errno or 0)}; "
                              f"check {base_hint()}") from None
    return [_judge(os.path.join(base, n)) for n in names]


def prune(found: List[Found]) -> List[Found]:
    """Remove the orphans among ``found`` (each judged again just before); returns those removed."""
    out = []
    for f in found:
        if f.state != ORPHAN:
            continue
        now = _judge(f.path)
        if now.state == ORPHAN:
            shutil.rmtree(now.path, ignore_errors=True)
            if not os.path.lexists(now.path):
                out.append(now)
    return out
