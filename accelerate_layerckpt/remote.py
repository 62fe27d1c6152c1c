"""The plugin's remote tier (``Config.remote``): where a store's models and checkpoint folders go, and how a
folder comes back on a machine that lost the local directory.

    <remote>/model_<i>/            the remote tier of model i's Checkpointer (``data/``, ``manifests/``)
    <remote>/folders/<name>/...    the files of the checkpoint folder ``<name>`` (accelerate's RNG states,
                                   schedulers, samplers, registered objects), its pointer ``layerckpt.json`` last

A folder is copied in the background once ``save_state`` has written it (under ``remote_bandwidth``, as the
composites are); the models' composites go up through each Checkpointer's remote tier.  A folder on the
remote is loadable once its pointer is there and every model's composite it names is committed on the remote
(the manifest, holding the pointer's token): the manifests are the commit points, as for every tier.

Retention on the remote follows the folders there, as locally: after each copy the numbered folders beyond
accelerate's ``total_limit`` go (pointer first), and a model's composite stays while a remote folder's pointer
names its step.  The pins are read from the remote's pointers, not from the local folders, so a machine that
resumed from the remote never drops the composites of remote folders it did not fetch.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Set, Union

from layerckpt import store
from layerckpt.config import Config
from layerckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointWriteError

from . import folders

log = logging.getLogger("layerckpt.accelerate")

FOLDERS = "folders"


def model_config(config: Config, i: int) -> Config:
    """Model ``i``'s Config: its remote tier is ``<remote>/model_<i>`` (each model is a store of its own)."""
    if config.remote is None:
        return config
    return config.replace(remote=f"{config.remote.rstrip('/')}/{folders.model_dir(i)}")


def _folders_of(config: Config) -> store.RemoteFiles:
    """The remote checkpoint folders: ``<remote>/folders/``, their copies capped at ``remote_bandwidth``."""
    return store.RemoteFiles(config.remote, config.remote_options, bandwidth=config.remote_bandwidth)


def remote_pointer(files: store.RemoteFiles, name: str) -> Optional[folders.Pointer]:
    """The pointer of the remote folder ``name``; None when it has none (yet)."""
    try:
        raw = files.read(f"{FOLDERS}/{name}", folders.POINTER)
    except FileNotFoundError:
        return None
    return folders.parse_pointer(raw, f"{files.url}/{FOLDERS}/{name}/{folders.POINTER}")


def folder_numbers(config: Config) -> List[int]:
    """The numbers of the remote folders automatic naming wrote (none without a remote)."""
    if config.remote is None:
        return []
    nums = (folders.folder_number(n) for n in _folders_of(config).names(FOLDERS))
    return sorted(k for k in nums if k is not None)


def _pointers(files: store.RemoteFiles) -> Dict[str, Union[folders.Pointer, None, CheckpointError]]:
    """Every remote folder's pointer: None where it has none, the error where it is damaged."""
    out: Dict[str, Union[folders.Pointer, None, CheckpointError]] = {}
    for n in files.names(FOLDERS):
        try:
            out[n] = remote_pointer(files, n)
        except CheckpointError as e:
            out[n] = e
    return out


def _rotate(files: store.RemoteFiles, ptrs: dict, total_limit: Optional[int]) -> None:
    """Drop the numbered remote folders older than the ``total_limit`` newest whole ones (those with a
    pointer), each pointer first, so a kill midway never leaves a folder that looks whole but is not."""
    whole = sorted((folders.folder_number(n), n) for n, p in ptrs.items()
                   if isinstance(p, folders.Pointer) and folders.folder_number(n) is not None)
    if total_limit is None or total_limit < 1 or len(whole) <= total_limit:
        return
    oldest = whole[-total_limit][0]
    for n in sorted(ptrs):
        k = folders.folder_number(n)
        if k is not None and k < oldest:
            files.remove_tree(f"{FOLDERS}/{n}", first=[folders.POINTER])
            del ptrs[n]


def retain(config: Config, models: int, total_limit: Optional[int], below: int) -> List[str]:
    """The remote's retention after a folder copy: rotate the folders, then drop every model's composite of
    a step below ``below`` that no remaining remote folder's pointer names (the newest always stays; saves
    at or above ``below`` are newer than this copy and never touched).  Returns the URLs removed."""
    files = _folders_of(config)
    ptrs = _pointers(files)
    _rotate(files, ptrs, total_limit)
    if any(isinstance(p, CheckpointError) for p in ptrs.values()):
        log.warning("layerckpt: a damaged pointer under %s/%s: what it pins is unknown, no composite is dropped",
                    files.url, FOLDERS)
        return []
    pins: Set[int] = {p.step for p in ptrs.values() if p is not None}
    removed: List[str] = []
    for i in range(models):
        url = model_config(config, i).remote
        drop = {s for s in store.steps(url, config=config) if s < below} - pins
        if drop:
            removed += store.release(url, drop, config=config)
    return removed


def newest_step(config: Config, models: int) -> int:
    """The highest step any model's remote tier holds a manifest of; -1 when none (or no remote)."""
    if config.remote is None:
        return -1
    return max((s for i in range(models) for s in store.steps(model_config(config, i).remote, config=config)),
               default=-1)


def committed(config: Config, ptr: folders.Pointer) -> bool:
    """Whether every model's composite that ``ptr`` names is committed on the remote tier."""
    for i in range(len(ptr.optimizers)):
        try:
            m = store.read_manifest(store.manifest_path(model_config(config, i).remote, ptr.step), config=config)
        except (CheckpointNotFoundError, CheckpointCorruptError):  # not there, or damaged
            return False
        if folders.token_of(m.extra) != ptr.token:
            return False
    return True


class FolderUploads:
    """Copies checkpoint folders to ``<remote>/folders/``, one at a time on one thread, in save order, each
    followed by the remote's retention (:func:`retain`) for ``models`` models and ``total_limit`` folders."""

    def __init__(self, config: Config, models: int = 1, total_limit: Optional[int] = None):
        self.config = config
        self.models = models
        self.total_limit = total_limit
        self.store = _folders_of(config)
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="layerckpt-folders")
        self._lock = threading.Lock()
        self._futures: List[Future] = []

    def submit(self, folder: str) -> None:
        with self._lock:
            self._futures.append(self._ex.submit(self._upload, folder))

    def _upload(self, folder: str) -> None:
        try:
            ptr = folders.read_pointer(folder)
        except (CheckpointError, OSError):
            ptr = None
        if self._copy(folder) and ptr is not None:
            self._retain(ptr.step)

    def _retain(self, below: int) -> None:
        """Housekeeping: a failure is logged, and the next copy tries again."""
        try:
            removed = retain(self.config, self.models, self.total_limit, below)
            if removed:
                log.debug("layerckpt: dropped %d object(s) no remote checkpoint folder needs", len(removed))
        except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
            log.warning("layerckpt: the remote tier's retention failed (retried after the next copy): %s", e)

    def _copy(self, folder: str) -> bool:
        """Copy the folder's files, the pointer last; False when it was rotated away before its copy."""
        name = os.path.basename(os.path.normpath(folder))
        files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
        files.sort(key=lambda f: f == folders.POINTER)  # the pointer last: the folder is whole once it is there
        try:
            for rel in files:
                sub, base = os.path.split(rel.replace(os.sep, "/"))
                where = "/".join(p for p in (FOLDERS, name, sub) if p)
                self.store.upload(os.path.join(folder, rel), where, base)
        except FileNotFoundError:  # rotated away (total_limit) before its copy: nothing left to keep
            log.info("layerckpt: %s was removed before its copy to %s", folder, self.store.url)
            return False
        except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
            raise CheckpointWriteError(
                getattr(e, "errno", None) or 5, f"{self.store.url}/{FOLDERS}/{name}",
                detail=f"copying the checkpoint folder {folder} to the remote tier failed ({type(e).__name__}: "
                       f"{e}); the local folder is intact") from None
        return True

    def wait(self) -> None:
        """Every folder submitted so far copied; raises the first failure (once)."""
        with self._lock:
            futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        errors = [e for e in errors if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._ex.shutdown(wait=True)


def fetch_folder(config: Config, name: Optional[str], into: str, newer_than: int = -1) -> Optional[str]:
    """Download the checkpoint folder ``name`` (None: the newest loadable one by accelerate's numbering) from
    the remote tier into ``into/<name>``; returns that path, or None when the remote has no such folder whose
    composite is committed, or when that folder's step is not above ``newer_than`` (a local folder that new
    wins)."""
    files = _folders_of(config)
    listed = files.names(FOLDERS)
    if name is not None:
        candidates = [name] if name in listed else []
    else:
        numbered = [(folders.folder_number(n), n) for n in listed]
        candidates = [n for k, n in sorted(numbered, reverse=True) if k is not None]
    for n in candidates:
        ptr = _loadable(config, files, n)
        if ptr is None:
            continue
        if ptr.step <= newer_than:
            return None
        return _download(files, n, into)
    return None


def _loadable(config: Config, files: store.RemoteFiles, name: str) -> Optional[folders.Pointer]:
    """The remote folder's pointer when every model's composite it names is committed there, else None."""
    try:
        ptr = remote_pointer(files, name)
    except CheckpointError as e:
        log.warning("layerckpt: skipping %s/%s/%s: %s", files.url, FOLDERS, name, e)
        return None
    if ptr is not None and not committed(config, ptr):
        log.warning("layerckpt: skipping %s/%s/%s: its composite (step %d) is not committed on the remote tier",
                    files.url, FOLDERS, name, ptr.step)
        return None
    return ptr


def _download(files: store.RemoteFiles, name: str, into: str) -> str:
    dest = os.path.join(into, name)
    tmp = dest + ".fetch-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    files.download(f"{FOLDERS}/{name}", tmp)
    shutil.rmtree(dest, ignore_errors=True)  # a folder without its files: the remote's is whole
    os.replace(tmp, dest)
    log.info("layerckpt: checkpoint folder %s fetched from %s", dest, files.url)
    return dest
