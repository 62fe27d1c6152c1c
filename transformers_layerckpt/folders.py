"""Trainer's ``checkpoint-<step>`` folders and the layerckpt store beside them: pointers, which folder loads, pruning.

Each folder Trainer writes while attached gets ``layerckpt.json``, naming the store (relative to the folder),
the composite's step (``state.global_step``) and a token the composite's manifest also holds.  The store sits
beside the folders, never in them, because ``save_total_limit`` rotation deletes whole folders:

    <output_dir>/checkpoint-<step>/     Trainer's files (trainer_state.json, scheduler.pt, rng_state.pth, ...)
    <output_dir>/layerckpt/             the store: the models' and optimizers' composites

A composite stays while some folder beside it points at it (and the newest one always); :func:`prune` drops
the others.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from layerckpt import store
from layerckpt.adapters import pointed_manifest, pointer_store, read_folder_pointer, write_pointer as write_pointer_file
from layerckpt.errors import CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt.transformers")

POINTER = "layerckpt.json"
POINTER_FORMAT = "layerckpt-transformers"
POINTER_VERSION = 1
STORE = "layerckpt"  # <output_dir>/layerckpt, beside the checkpoint-<step> folders
EXTRA_KEY = "transformers"  # the composite's extra: {"token": ..., "folder": ...}
_FOLDER = re.compile(r"^checkpoint-([0-9]+)$")  # transformers' PREFIX_CHECKPOINT_DIR and get_last_checkpoint


def store_of(folder: str) -> str:
    """The store the checkpoint folder ``folder`` puts its model and optimizer into."""
    return os.path.join(os.path.dirname(os.path.abspath(folder)), STORE)


def folder_step(folder: str) -> Optional[int]:
    """The step in a ``checkpoint-<step>`` folder's name; None for any other name."""
    m = _FOLDER.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


@dataclass
class Pointer:
    path: str  # the pointer file
    store: str  # absolute store root
    step: int
    token: str
    optimizer: bool  # whether the composite holds the optimizer's state


def write_pointer(folder: str, store_root: str, step: int, token: str, optimizer: bool) -> str:
    """Write ``folder/layerckpt.json`` atomically (tmp + rename).  Like Trainer's own files beside it, not
    fsynced: a folder whose composite never committed is skipped by ``resume_from_checkpoint=True`` and
    refused by name when given as a path."""
    body = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "store": os.path.relpath(store_root, folder),
            "step": step, "token": token, "optimizer": optimizer}
    return write_pointer_file(os.path.join(folder, POINTER), body)


def read_pointer(folder: str) -> Optional[Pointer]:
    """The folder's pointer; None when it has none (a folder plain Trainer wrote)."""
    return read_folder_pointer(folder, POINTER, _pointer)


def _pointer(d: Any, path: str) -> Pointer:
    root = pointer_store(d, path, POINTER_FORMAT, POINTER_VERSION, "transformers_layerckpt",
                         "this checkpoint's model and optimizer", lambda d: isinstance(d.get("optimizer"), bool))
    return Pointer(path=path, store=root, step=d["step"], token=d["token"], optimizer=d["optimizer"])


def check_committed(ptr: Pointer) -> str:
    """The manifest of ``ptr``'s composite; a clear error when it was never committed or is another one."""
    folder = os.path.dirname(ptr.path)
    if not os.path.isdir(ptr.store):
        raise CheckpointNotFoundError(
            f"{ptr.path} points to the layerckpt store {ptr.store}, which does not exist; the model and optimizer "
            f"of this checkpoint live there: keep that directory beside the checkpoint folders")
    return pointed_manifest(ptr.store, ptr.step, ptr.token, folder, lambda m: token_of(store.read_manifest(m).extra),
                            "resume from an older checkpoint folder")


def token_of(extra: object) -> object:
    return ((extra or {}).get(EXTRA_KEY) or {}).get("token") if isinstance(extra, dict) else None


def committed(ptr: Pointer) -> bool:
    try:
        check_committed(ptr)
        return True
    except CheckpointError:
        return False


def numbered(run_dir: str) -> List[str]:
    """The ``checkpoint-<step>`` folders in ``run_dir``, oldest step first."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    found = [(folder_step(n), os.path.join(run_dir, n)) for n in names]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None) if os.path.isdir(p)]


def newest_loadable(run_dir: str) -> Optional[str]:
    """What ``resume_from_checkpoint=True`` should load: the newest folder whose state is all there.  Trainer
    takes the highest step; a folder whose composite never committed (the process died while it flushed) is
    skipped for the one before it, with a warning."""
    entries = numbered(run_dir)
    for path in reversed(entries):
        try:
            ptr = read_pointer(path)
        except CheckpointError as e:
            log.warning("layerckpt: skipping %s: %s", path, e)
            continue
        if ptr is None or committed(ptr):
            return path
        log.warning("layerckpt: skipping %s: its layerckpt composite (step %d) was never committed", path, ptr.step)
    return None


def live_steps(store_root: str, run_dir: str) -> Dict[str, int]:
    """Folder -> step, for the folders in ``run_dir`` whose pointers point into ``store_root``."""
    root = os.path.normpath(store_root)
    out = {}
    for path in numbered(run_dir):
        try:
            ptr = read_pointer(path)
        except CheckpointError:
            continue
        if ptr is not None and os.path.normpath(ptr.store) == root:
            out[path] = ptr.step
    return out


def prune(store_root: str, run_dir: str) -> List[str]:
    """Delete the composites no folder of ``run_dir`` points at (the newest committed always stays), then the
    data files only they used.  Safe beside a save in flight: it builds on the composite before it, whose files
    the newest committed composite (kept) or a live folder's references.  A failure is logged, not raised: the
    next save tries again."""
    try:
        keep = set(live_steps(store_root, run_dir).values())
        drop = set(store.steps(store_root)) - keep
        return store.release(store_root, drop) if drop else []
    except (OSError, CheckpointError) as e:
        log.warning("layerckpt: pruning %s failed (retried at the next save): %s", store_root, e)
        return []


class Pruner:
    """:func:`prune` on a thread of its own, so that retention never blocks training; one at a time (a new
    request waits for the one before it)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None

    def submit(self, store_root: str, run_dir: str) -> None:
        self.drain()
        self._thread = threading.Thread(target=prune, args=(store_root, run_dir), name="layerckpt-prune", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Wait for the request in progress, if any."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
