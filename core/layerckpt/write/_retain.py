"""Retention: drop old composites, and the data files no kept composite uses (a few of them kept as spares for
later saves to write over, ``_spare``); clean up torn saves.

Manifests go first and are made durable before any data file goes, so a kill
at any moment leaves every kept composite whole; what it leaves behind is
unreferenced and removed by :func:`cleanup` on the next open.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import AbstractSet, Callable, Dict, Iterable, List, Set

from .. import _faults
from . import _spare
from ..format._manifest import Manifest, parse_once, still_valid
from ..format._store import (DATA_DIR, MANIFEST_DIR, data_step, fsync_dir, is_data_name, list_manifests,
                             manifest_name, read_all, recency)

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
    if not _suspects(root):
        return removed
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


def _suspects(root: str) -> List[str]:
    """The data files that may be leftovers: those of a step with no committed manifest (a torn save, or a
    retention killed between a composite's manifest and its data) and every version of a step written more
    than once.  A step's own files are referenced by its manifest, so a store without suspects is clean
    without reading a manifest: opening a store of 2,000 composites costs what opening one of 2 does."""
    d = os.path.join(root, DATA_DIR)
    named = [(n, sv) for n in (os.listdir(d) if os.path.isdir(d) else ()) for sv in (data_step(n),) if sv is not None]
    committed = {s for s, _ in list_manifests(root)}
    versions: Dict[int, Set[int]] = {}
    for _, (step, version) in named:
        versions.setdefault(step, set()).add(version)
    return [n for n, (step, _) in named if step not in committed or len(versions[step]) > 1]


def retain(root: str, keep_last: int, pinned: AbstractSet[str] = frozenset()) -> List[str]:
    """Keep the keep_last newest composites and the ``pinned`` ones (manifest file names); delete the
    rest, then the data no kept composite uses.  ``keep_last`` 0 keeps everything."""
    if keep_last <= 0:
        return []
    good, bad = read_all(root)
    order = sorted(good, key=recency(good), reverse=True)
    return drop(root, good, bad, [n for n in order[keep_last:] if n not in pinned])


class Retention:
    """The one owner of a writer's local retention (rank 0): after each commit it keeps the composites
    pinned by ``Checkpointer.keep()`` (:meth:`pin`), those a tier copies from or has queued (:meth:`hold`,
    told by the tiers) and the ``keep_last`` newest, and deletes the rest.  It always runs on the flusher
    thread: as a commit listener, or through ``later`` (the flusher thread's queue) when a tier's copy
    ends (:meth:`soon`)."""

    def __init__(self, root: str, keep_last: int, later: Callable[[Callable[[], None]], None]):
        self.root = root
        self.keep_last = keep_last
        self._later = later
        self._lock = threading.Lock()
        self._pinned: AbstractSet[str] = frozenset()
        self._held: AbstractSet[str] = frozenset()
        self._holders: Dict[str, AbstractSet[str]] = {}
        self._parsed: dict = {}  # the manifests parsed so far (see _manifest.parse_once), on the flusher thread

    def pin(self, names: Iterable[str]) -> None:
        """Manifest file names kept whatever their age; replaces the previous set."""
        with self._lock:
            self._pinned = frozenset(names)

    def pinned(self) -> AbstractSet[str]:
        with self._lock:
            return self._pinned

    def hold(self, names: Iterable[str], who: str = "tiers") -> None:
        """The manifest names ``who`` (the tiers, the peer replicas) still copies from or has queued; replaces
        the previous set of that holder."""
        with self._lock:
            self._holders[who] = frozenset(names)
            self._held = frozenset().union(*self._holders.values())

    def keep(self) -> AbstractSet[str]:
        """What stays besides the ``keep_last`` newest."""
        with self._lock:
            return self._pinned | self._held

    def committed(self, m: Manifest) -> None:
        """Commit listener, on the flusher thread, after the tiers were told of ``m``.  ``m`` is what its file
        holds: retention takes it as parsed instead of reading the file back."""
        path = os.path.join(self.root, MANIFEST_DIR, manifest_name(m.step))
        try:
            st = os.stat(path)
            self._parsed[(path, st.st_ino, st.st_size, st.st_mtime_ns)] = m
        except OSError:  # gone already: read_all will not list it either
            pass
        self._run(f"after step {m.step}")

    def soon(self) -> None:
        """A tier's copy ended: what it held may go, on the flusher thread."""
        if self.keep_last > 0:
            self._later(self._run)

    def _run(self, when: str = "") -> None:
        if self.keep_last <= 0:
            return
        try:
            # each manifest is parsed once over the writer's life, not at every commit
            with parse_once(self._parsed):
                retain(self.root, self.keep_last, self.keep())
        except OSError as e:  # retention failing must not fail a committed save
            log.warning("layerckpt: retention in %s %s failed: %s", self.root, when, e)
        finally:
            self._parsed = still_valid(self._parsed)


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
        path = os.path.join(root, DATA_DIR, f)
        if _spare.keep(path):  # written over by a later save instead of deleted
            removed.append(path)
        else:
            _unlink(path, removed)
    return removed


def _unlink(path: str, removed: List[str]) -> None:
    try:
        os.unlink(path)
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # one failed delete must not stop the rest of the cleanup
        log.warning("layerckpt: could not delete %s: %s", path, e)
