"""What a Checkpointer holds for its life, opened and freed in one place: the store's lock (rank 0), its torn
leftovers cleaned up, the tiers, the writer backend and the staging pool.

Opening is collective: every rank learns whether rank 0 could lock and clean the store, so all of them go on
or all refuse together.  Freeing runs once, from ``close()``, the Checkpointer being dropped, or a newer
Checkpointer of this process taking the store over; the flusher finishes what it has first.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from . import _dist
from ._registry import Owner
from .config import Config
from .errors import CheckpointError
from .format import _store
from .io._backend import make_backend
from .tiers import _tiers
from .write import _retain
from .write._flush import Flusher
from .write._stage import BufferPool, LazyStager

log = logging.getLogger("layerckpt")


def open_store(dirpath: str, config: Config, group: _dist.Group,
               retention: _retain.Retention) -> Tuple[Optional[_store.WriterLock], Optional[_tiers.Tiers]]:
    """Rank 0 locks the store, removes torn leftovers and opens the tiers; every rank learns whether it
    did, so all of them go on or all refuse together."""
    writer: Optional[_store.WriterLock] = None
    tiers: Optional[_tiers.Tiers] = None
    refused: Optional[str] = None
    if group.rank == 0:
        try:
            writer, tiers = _lock_and_clean(dirpath, config, retention)
        except (CheckpointError, OSError) as e:
            refused = str(e)
    if group.world > 1:  # no rank writes before the leftovers are gone, or all refuse together
        refused = group.exchange(refused)[0]
    if refused is not None:
        if tiers is not None:
            tiers.close()
        if writer is not None:
            writer.release()
        raise CheckpointError(refused)
    return writer, tiers


def _lock_and_clean(dirpath: str, config: Config,
                    retention: _retain.Retention) -> Tuple[_store.WriterLock, Optional[_tiers.Tiers]]:
    """One writer per store: rank 0 holds the lock for the Checkpointer's life, and only the holder
    cleans up, so no opener ever deletes what another one is still writing."""
    _store.ensure_layout(dirpath)
    writer = _store.WriterLock(dirpath)
    try:
        removed = _retain.cleanup(dirpath)
        if removed:
            log.info("layerckpt: removed %d leftover file(s) of interrupted saves", len(removed))
        # memory/remote: a bad URL fails here
        return writer, _tiers.open_tiers(dirpath, config, retention)
    except BaseException:
        writer.release()
        raise


def start_io(dirpath: str, config: Config, writer: Optional[_store.WriterLock],
             tiers: Optional[_tiers.Tiers]) -> Tuple[int, Any, BufferPool]:
    """The commit number to continue from, the writer backend and the staging buffers."""
    try:
        seq = _store.max_seq(dirpath, mark=writer is not None)
        if tiers is not None:  # commit order continues past what the tiers hold
            seq = max(seq, tiers.seq)
        return seq, make_backend(config.backend, config.queue_depth), \
            BufferPool(config.chunk_bytes, config.staging_bytes)
    except BaseException:
        if writer is not None:  # a Checkpointer that never came to be holds no lock
            writer.release()
        raise


def shutdown(flusher: Flusher, backend, pool: BufferPool, writer: Optional[_store.WriterLock],
             tiers: Optional[_tiers.Tiers] = None, hook=None, owner: Optional[Owner] = None,
             group: Optional[_dist.Group] = None, stager: Optional[LazyStager] = None) -> None:
    """Free everything a Checkpointer held, in the order that lets each part finish what the one before hands
    it; a newer Checkpointer waiting to take the store over may lock it once this returns."""
    try:
        if hook is not None:
            hook.remove()
        if stager is not None:  # its thread ends once the copies it runs are done
            stager.close()
        flusher.stop()
        if tiers is not None:  # after the flusher: no more copies are queued
            tiers.close()
        backend.close()
        pool.close()
        if writer is not None:
            writer.release()
        if group is not None:  # last: no collective of ours is left (see _dist.Group.close)
            group.close()
    finally:
        if owner is not None:  # a newer Checkpointer waiting to take over may lock the store now
            owner.closed()
