"""Checkpoint folders and the layerckpt store beside them: pointer files, folder numbers, pruning.

Every folder ``save_state`` writes gets a small pointer, ``layerckpt.json``, naming
the store (relative to the folder), the composite's step and a token that the
composite's manifest also holds.  The store sits *beside* the folders, never in
them, because accelerate's ``total_limit`` rotation deletes whole folders:

    <project_dir>/checkpoints/checkpoint_N/   (automatic naming)   store: <project_dir>/layerckpt/
    <parent>/<any folder>/                    (save_state(dir))     store: <parent>/.layerckpt/

A composite stays in the store while some folder beside it points at it (and
the newest one always); :func:`prune` drops the others.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from layerckpt import store
from layerckpt.adapters import pointed_manifest, pointer_store, read_folder_pointer, write_pointer as write_pointer_file
from layerckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt.accelerate")

POINTER = "layerckpt.json"
POINTER_FORMAT = "layerckpt-accelerate"
POINTER_VERSION = 1
AUTO_STORE = "layerckpt"  # <project_dir>/layerckpt, next to <project_dir>/checkpoints
EXPLICIT_STORE = ".layerckpt"  # <parent>/.layerckpt, next to the folders given to save_state

_NUMBER = re.compile(r"[0-9]+")


def model_dir(i: int) -> str:
    return f"model_{i}"


def folder_number(path: str) -> Optional[int]:
    """The number accelerate orders ``checkpoints/`` entries by: the first digits of the name."""
    m = _NUMBER.search(os.path.basename(os.path.normpath(path)))
    return int(m.group()) if m else None


def auto_dir(project_dir: str) -> str:
    """Where automatic naming puts the checkpoint folders: ``<project_dir>/checkpoints``."""
    return os.path.join(os.path.abspath(project_dir), "checkpoints")


def auto_store(project_dir: str) -> str:
    """The store of the folders automatic naming writes: ``<project_dir>/layerckpt``."""
    return os.path.join(os.path.abspath(project_dir), AUTO_STORE)


def layout(folder: str, project_dir: Optional[str], automatic: bool) -> Tuple[str, str]:
    """(store root, directory whose entries are the checkpoint folders) for a folder save_state wrote."""
    folder = os.path.abspath(folder)
    if automatic:
        return auto_store(project_dir), auto_dir(project_dir)
    parent = os.path.dirname(folder)
    return os.path.join(parent, EXPLICIT_STORE), parent


def is_inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _entries(folders_dir: str) -> List[str]:
    """The names in ``folders_dir``; none when it does not exist (yet)."""
    try:
        return os.listdir(folders_dir)
    except FileNotFoundError:
        return []


# ------------------------------------------------------------------ pointer files

@dataclass
class Pointer:
    path: str  # the pointer file
    store: str  # absolute store root
    step: int
    token: str
    optimizers: List[bool]  # per model: whether its optimizer state is in the composite

    def model_root(self, i: int) -> str:
        return os.path.join(self.store, model_dir(i))


def write_pointer(folder: str, store_root: str, step: int, token: str, optimizers: List[bool]) -> str:
    """Write ``folder/layerckpt.json`` atomically (tmp + rename).

    Like the files accelerate writes beside it (RNG, schedulers) it is not fsynced:
    it would block training for a file that is only as useful as its folder.  The
    composite it names is durable once committed, and a folder whose composite
    never committed is refused by name (and skipped by ``load_state()``).
    """
    body = {"format": POINTER_FORMAT, "version": POINTER_VERSION,
            "store": os.path.relpath(store_root, folder), "step": step, "token": token,
            "models": [{"dir": model_dir(i), "optimizer": has} for i, has in enumerate(optimizers)]}
    return write_pointer_file(os.path.join(folder, POINTER), body)


def read_pointer(folder: str) -> Optional[Pointer]:
    """The folder's pointer; None when it has none (a folder plain accelerate wrote)."""
    return read_folder_pointer(folder, POINTER, _pointer)


def parse_pointer(raw: bytes, path: str) -> Pointer:
    """The pointer whose bytes are ``raw``, read from ``path`` (a local file, or a URL for a remote folder's
    copy: its ``store`` then means nothing here, its step and token do)."""
    try:
        d = store.parse_json(raw, path, "pointer")
    except CheckpointCorruptError:
        d = None
    return _pointer(d, path)


def _pointer(d: Any, path: str) -> Pointer:
    """The pointer the parsed JSON ``d`` of ``path`` holds (None: it did not parse)."""
    root = pointer_store(d, path, POINTER_FORMAT, POINTER_VERSION, "accelerate_layerckpt",
                         "this checkpoint's models and optimizers",
                         lambda d: isinstance(d.get("models"), list) and bool(d["models"]) and all(
                             isinstance(m, dict) and isinstance(m.get("optimizer"), bool) for m in d["models"]),
                         up=2)  # the store of automatic naming is beside checkpoints/, two folders up (layout())
    return Pointer(path=path, store=root, step=d["step"], token=d["token"],
                   optimizers=[m["optimizer"] for m in d["models"]])


def check_committed(ptr: Pointer) -> List[str]:
    """The manifest of every model of ``ptr``'s composite; a clear error when one is missing or is not it."""
    if not os.path.isdir(ptr.store):
        raise CheckpointNotFoundError(
            f"{ptr.path} points to the layerckpt store {ptr.store}, which does not exist; the models and "
            f"optimizers of this checkpoint live there: keep that directory beside the checkpoint folders "
            f"(move or copy them together)")
    paths = []
    for i in range(len(ptr.optimizers)):
        root = ptr.model_root(i)
        if not os.path.isdir(root):
            raise CheckpointNotFoundError(
                f"{ptr.path} points to {root}, which does not exist: the layerckpt store {ptr.store} lacks the "
                f"data of model {i}; keep the store whole beside the checkpoint folders")
        paths.append(pointed_manifest(root, ptr.step, ptr.token, os.path.dirname(ptr.path), _token_at,
                                      "load an older checkpoint folder"))
    return paths


_TOKENS: Dict[Tuple[str, int, int, int], Any] = {}  # manifest (path, inode, size, mtime) -> its token


def _token_at(mpath: str) -> Any:
    """The pointer token of the local manifest ``mpath``, parsed once per version of the file: a
    ``load_state()`` checks one composite several times (which folder is newest, before the load), and a
    manifest is never rewritten in place (a new one is renamed over it: another inode)."""
    try:
        st = os.stat(mpath)
    except FileNotFoundError:  # gone since it was resolved: read_manifest says so in the library's terms
        return token_of(store.read_manifest(mpath).extra)
    key = (mpath, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _TOKENS:
        if len(_TOKENS) > 256:
            _TOKENS.clear()
        _TOKENS[key] = token_of(store.read_manifest(mpath).extra)
    return _TOKENS[key]


def loadable_step(folder: Optional[str]) -> int:
    """The step of ``folder``'s composite when it loads from the local store; -1 when there is none (no
    folder, a plain accelerate folder, a damaged pointer, a composite not committed here)."""
    if folder is None:
        return -1
    try:
        ptr = read_pointer(folder)
    except CheckpointError:
        return -1
    return ptr.step if ptr is not None and committed(ptr) else -1


def token_of(extra: Any) -> Any:
    """The pointer token a composite's ``extra`` holds (None when it holds none)."""
    return ((extra or {}).get("accelerate") or {}).get("token") if isinstance(extra, dict) else None


def committed(ptr: Pointer) -> bool:
    try:
        check_committed(ptr)
        return True
    except CheckpointError:
        return False


def pointers_in(folders_dir: str) -> Iterable[Pointer]:
    """Readable pointers of the folders directly inside ``folders_dir`` (damaged ones are skipped)."""
    for n in _entries(folders_dir):
        d = os.path.join(folders_dir, n)
        if not os.path.isfile(os.path.join(d, POINTER)):
            continue
        try:
            p = read_pointer(d)
        except CheckpointError:
            continue
        if p is not None:
            yield p


def referenced(store_root: str, folders_dir: str) -> Dict[str, int]:
    """Pointer file -> step, for the folders in ``folders_dir`` that point into ``store_root``."""
    root = os.path.normpath(store_root)
    return {p.path: p.step for p in pointers_in(folders_dir) if os.path.normpath(p.store) == root}


def newest_step(model_roots: Iterable[str]) -> int:
    """The highest committed step among the stores; -1 when there is none."""
    return max((s for r in model_roots for s in store.steps(r)), default=-1)


# ------------------------------------------------------------------ automatic naming

def numbered(folders_dir: str) -> List[Tuple[int, str]]:
    """(number, path) of the entries accelerate's automatic naming sees, oldest first."""
    out = [(folder_number(n), os.path.join(folders_dir, n)) for n in _entries(folders_dir)]
    return sorted((k, p) for k, p in out if k is not None)


def newest_loadable(folders_dir: str) -> Optional[str]:
    """The folder ``load_state()`` should pick: the newest one whose state is all there.

    Accelerate picks the highest number; a folder whose layerckpt composite was
    never committed (the process died while it was flushing) is skipped for the
    one before it, with a warning.
    """
    entries = numbered(folders_dir)
    for _, path in reversed(entries):
        try:
            ptr = read_pointer(path)
        except CheckpointError as e:
            log.warning("layerckpt: skipping %s: %s", path, e)
            continue
        if ptr is None or committed(ptr):
            return path
        log.warning("layerckpt: skipping %s: its layerckpt composite (step %d) was never committed", path, ptr.step)
    return entries[-1][1] if entries else None


# ------------------------------------------------------------------ retention

def prune(model_roots: Iterable[str], keep_steps: Set[int], below: int) -> List[str]:
    """Delete the composites of steps below ``below`` that no folder points at (the newest committed is
    always kept), then the data files only they used.

    Manifests go first and data files only when no kept manifest references
    them, so a kill at any moment leaves every kept composite whole.  Steps at
    or above ``below`` (saves newer than the caller knows of) are never touched.
    """
    removed: List[str] = []
    for root in model_roots:
        steps = store.steps(root)
        drop = {s for s in steps if s < below} - set(keep_steps) - {max(steps, default=-1)}
        if drop:  # else the common case: no manifest is parsed
            removed += store.release(root, drop)
    return removed


class Pruner:
    """Runs :func:`prune` on a thread of its own, so retention never blocks training; a newer request
    replaces one not yet started.  A failure is logged, and the next request tries again.  The thread
    ends as soon as no request waits (the next one starts another): none outlives the work."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._request: Optional[Tuple[List[str], Set[int], int]] = None
        self._busy = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, model_roots: List[str], keep_steps: Set[int], below: int) -> None:
        with self._cond:
            self._request = (list(model_roots), set(keep_steps), below)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="layerckpt-prune", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every request so far is done and the thread has ended."""
        with self._cond:
            while self._request is not None or self._busy or self._thread is not None:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._request is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                req, self._request, self._busy = self._request, None, True
            try:
                removed = prune(*req)
                if removed:
                    log.debug("layerckpt: dropped %d file(s) no checkpoint folder needs any more", len(removed))
            except Exception as e:  # housekeeping: one failure must not stop training
                log.warning("layerckpt: pruning the store failed (retried at the next save): %s", e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
