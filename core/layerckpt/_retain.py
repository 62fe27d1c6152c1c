"""Retention: drop old composites, and the data files no kept composite uses; clean up torn saves.

Manifests go first and are made durable before any data file goes, so a kill
at any moment leaves every kept composite whole; what it leaves behind is
unreferenced and removed by :func:`cleanup` on the next open.
"""
from __future__ import annotations

import logging
import os
from typing import AbstractSet, Dict, List, Set

from . import _faults
from ._manifest import Manifest
from ._store import DATA_DIR, MANIFEST_DIR, fsync_dir, is_data_name, read_all, recency

log = logging.getLogger("layerckpt")


def referenced_files(manifests: Dict[str, Manifest]) -> Set[str]:
    return {f for m in manifests.values() for f in m.files}


def cleanup(root: str) -> List[str]:
    """Remove torn leftovers: temp files and data no committed manifest references."""
    removed = []
    for sub in ("", MANIFEST_DIR, DATA_DIR):
        d = os.path.join(root, sub)
        for n in os.listdir(d) if os.path.isdir(d) else ():
            if n.endswith(".tmp"):
                _unlink(os.path.join(d, n), removed)
    good, bad = read_all(root)
    if bad:  # we cannot know what a damaged manifest references: keep every data file
        log.warning("layerckpt: damaged manifest(s) %s in %s; no data file is cleaned up", bad, root)
        return removed
    keep = referenced_files(good)
    d = os.path.join(root, DATA_DIR)
    for n in os.listdir(d) if os.path.isdir(d) else ():
        if is_data_name(n) and n not in keep:
            _unlink(os.path.join(d, n), removed)
    return removed


def retain(root: str, keep_last: int, pinned: AbstractSet[str] = frozenset()) -> List[str]:
    """Keep the keep_last newest composites and the ``pinned`` ones (manifest file names); delete the
    rest, then the data no kept composite uses.  ``keep_last`` 0 keeps everything."""
    if keep_last <= 0:
        return []
    good, bad = read_all(root)
    order = sorted(good, key=recency(good), reverse=True)
    return drop(root, good, bad, [n for n in order[keep_last:] if n not in pinned])


def drop(root: str, good: Dict[str, Manifest], bad: List[str], names: List[str]) -> List[str]:
    """Delete the committed manifests ``names`` (``good``/``bad``: what :func:`read_all` returned), then
    the data files only they referenced.  Manifests go first and are made durable before any data file
    goes, so a kill at any moment leaves every kept composite whole.  With a damaged manifest present
    no data file is deleted (what it references is unknown)."""
    removed: List[str] = []
    for n in names:
        _unlink(os.path.join(root, MANIFEST_DIR, n), removed)
    if names:
        fsync_dir(os.path.join(root, MANIFEST_DIR))
        _faults.point("retain.manifests-dropped")
    if bad:
        return removed
    gone = set(names)
    keep = referenced_files({n: m for n, m in good.items() if n not in gone})
    for f in sorted(referenced_files({n: good[n] for n in names}) - keep):
        _unlink(os.path.join(root, DATA_DIR, f), removed)
    return removed


def _unlink(path: str, removed: List[str]) -> None:
    try:
        os.unlink(path)
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # one failed delete must not stop the rest of the cleanup
        log.warning("layerckpt: could not delete %s: %s", path, e)
