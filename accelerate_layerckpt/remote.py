"""The plugin's remote tier (``Config.remote``): where a store's models and checkpoint folders go, and how a
folder comes back on a machine that lost the local directory.

    <remote>/model_<i>/            the remote tier of model i's Checkpointer (``data/``, ``manifests/``)
    <remote>/folders/<name>/...    the files of the checkpoint folder ``<name>`` (accelerate's RNG states,
                                   schedulers, samplers, registered objects), its pointer ``layerckpt.json`` last

A folder is copied in the background once ``save_state`` has written it; the models' composites go up
through each Checkpointer's remote tier.  A folder on the remote is loadable once its pointer is there
and every model's composite it names is committed on the remote (the manifest, holding the pointer's
token): the manifests are the commit points, as for every tier.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

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
    """The remote checkpoint folders: ``<remote>/folders/``."""
    return store.RemoteFiles(config.remote, config.remote_options)


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
    """Copies checkpoint folders to ``<remote>/folders/``, one at a time on one thread, in save order."""

    def __init__(self, config: Config):
        self.store = _folders_of(config)
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="layerckpt-folders")
        self._lock = threading.Lock()
        self._futures: List[Future] = []

    def submit(self, folder: str) -> None:
        with self._lock:
            self._futures.append(self._ex.submit(self._upload, folder))

    def _upload(self, folder: str) -> None:
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
        except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
            raise CheckpointWriteError(
                getattr(e, "errno", None) or 5, f"{self.store.url}/{FOLDERS}/{name}",
                detail=f"copying the checkpoint folder {folder} to the remote tier failed ({type(e).__name__}: "
                       f"{e}); the local folder is intact") from None

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


def fetch_folder(config: Config, name: Optional[str], into: str) -> Optional[str]:
    """Download the checkpoint folder ``name`` (None: the newest loadable one by accelerate's numbering) from
    the remote tier into ``into/<name>``; returns that path, or None when the remote has no such folder whose
    composite is committed."""
    remote = _folders_of(config)
    listed = remote.names(FOLDERS)
    if name is not None:
        candidates = [name] if name in listed else []
    else:
        numbered = [(folders.folder_number(n), n) for n in listed]
        candidates = [n for k, n in sorted(numbered, reverse=True) if k is not None]
    for n in candidates:
        dest = os.path.join(into, n)
        tmp = dest + ".fetch-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            remote.download(f"{FOLDERS}/{n}", tmp)
            ptr = folders.read_pointer(tmp)
        except CheckpointError as e:
            log.warning("layerckpt: skipping %s/%s/%s: %s", remote.url, FOLDERS, n, e)
            ptr = None
        if ptr is None or not committed(config, ptr):
            shutil.rmtree(tmp, ignore_errors=True)
            if ptr is not None:
                log.warning("layerckpt: skipping %s/%s/%s: its composite (step %d) is not committed on the "
                            "remote tier", remote.url, FOLDERS, n, ptr.step)
            continue
        shutil.rmtree(dest, ignore_errors=True)  # a folder without its files: the remote's is whole
        os.replace(tmp, dest)
        log.info("layerckpt: checkpoint folder %s fetched from %s", dest, remote.url)
        return dest
    return None
