"""What a Checkpointer holds for its life, opened and freed in one place: the store's lock (rank 0), its torn
leftovers cleaned up, the tiers, the writer backend and the staging pool.

Opening is collective: every rank learns whether rank 0 could lock and clean the store, so all of them go on
or all refuse together.  Freeing runs once, from ``close()``, the Checkpointer being dropped, or a newer
Checkpointer of this process taking the store over; the flusher finishes what it has first.
"""
from __future__ import annotations

import logging
import os
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


def open_store(dirpath: str, config: Config, group: _dist.Group, retention: _retain.Retention
               ) -> Tuple[Optional[_store.WriterLock], Optional[_tiers.Tiers], _dist.Placement]:
    """Each store's owner (rank 0 for a directory every rank shares; on node-local directories, each node's
    lowest rank: ``_dist.place``) locks its store, removes torn leftovers and opens the tiers; every rank
    learns whether each did, so all of them go on or all refuse together."""
    try:
        os.makedirs(dirpath, exist_ok=True)
    except OSError:
        pass  # _dist.place says which rank could not write it, on every rank
    placement = _dist.place(group, dirpath)
    identity = _agree_identity(dirpath, group, placement, config) if placement.split else None
    writer: Optional[_store.WriterLock] = None
    tiers: Optional[_tiers.Tiers] = None
    refused: Optional[str] = None
    if placement.is_owner:
        try:
            writer, tiers = _lock_and_clean(dirpath, config, retention, placement, identity)
        except (CheckpointError, OSError) as e:
            refused = str(e) if not placement.split else f"node {placement.nodes[group.rank]}: {e}"
    if group.world > 1:  # no rank writes before the leftovers are gone, or all refuse together
        refused = next((r for r in group.exchange(refused, what="opening the checkpoint directory")
                        if r is not None), None)
    if refused is not None:
        if tiers is not None:
            tiers.close()
        if writer is not None:
            writer.release()
        raise CheckpointError(refused)
    return writer, tiers, placement


def _agree_identity(dirpath: str, group: _dist.Group, placement: _dist.Placement, config: Config) -> str:
    """The one store identity of every node's part: the first node's that has one, else the remote's (every
    node came back empty and restored from it: ``_tiers.claim_identity``'s rule for one directory), else a new
    one.  Parts that carry different identities hold different stores' composites: refused, naming them."""
    import uuid

    mine: Optional[str] = None
    error: Optional[str] = None
    new = uuid.uuid4().hex
    if placement.is_owner:
        try:
            mine = _store.store_id(dirpath)
        except CheckpointError as e:
            error = str(e)
    if group.rank == 0 and mine is None and config.remote is not None and not _store.list_manifests(dirpath):
        new = _remote_identity(config) or new
    answers = group.exchange({"id": mine, "error": error, "new": new},
                             what="agreeing on the store identity of the nodes' parts")
    errors = [f"node {placement.nodes[r]}: {a['error']}" for r, a in enumerate(answers) if a["error"]]
    if errors:
        raise CheckpointError("layerckpt: " + "; ".join(errors))
    found = {r: a["id"] for r, a in enumerate(answers) if a["id"] is not None}
    ids = sorted(set(found.values()))
    if len(ids) > 1:
        by = "; ".join(f"node {placement.nodes[r]} ({dirpath}) holds store {i}" for r, i in sorted(found.items()))
        raise CheckpointError(f"layerckpt: the nodes' checkpoint directories hold different stores' checkpoints: "
                              f"{by}; give every node the directory of one run (or empty ones)")
    return ids[0] if ids else answers[0]["new"]


def _remote_identity(config: Config) -> Optional[str]:
    """The identity the remote tier carries, None without one (or where it cannot be read: its tier says why
    when it opens)."""
    from .tiers._remote import FsspecStore

    try:
        found = _tiers.tier_id(FsspecStore(config.remote, config.remote_options))
    except Exception:  # noqa: BLE001 - an unreachable remote is reported when the tier opens
        return None
    return found if found != _tiers.BAD_ID else None


def _lock_and_clean(dirpath: str, config: Config, retention: _retain.Retention, placement: _dist.Placement,
                    identity: Optional[str]) -> Tuple[_store.WriterLock, Optional[_tiers.Tiers]]:
    """One writer per store: its owner holds the lock for the Checkpointer's life, and only the holder
    cleans up, so no opener ever deletes what another one is still writing.  A node's part records the
    agreed store identity and whose part it is (``_store.PART``)."""
    _store.ensure_layout(dirpath)
    writer = _store.WriterLock(dirpath)
    try:
        removed = _retain.cleanup(dirpath)
        if removed:
            log.info("layerckpt: removed %d leftover file(s) of interrupted saves", len(removed))
        if identity is not None:
            _store.ensure_store_id(dirpath, identity)
            _store.write_part(dirpath, placement.part())
        else:
            _store.clear_part(dirpath)
        # memory/remote: a bad URL fails here
        part = None
        if identity is not None:  # this node's ranks copy their own files; rank 0's node commits the remote
            part = (frozenset(placement.ranks_of(placement.rank)), placement.rank == 0)
        return writer, _tiers.open_tiers(dirpath, config, retention, part)
    except BaseException:
        writer.release()
        raise


def start_io(dirpath: str, config: Config, writer: Optional[_store.WriterLock],
             tiers: Optional[_tiers.Tiers], group: Optional[_dist.Group] = None,
             split: bool = False) -> Tuple[int, Any, BufferPool]:
    """The commit number to continue from (on node-local parts, the highest of any node's: every node
    commits the same manifests), the writer backend and the staging buffers."""
    try:
        seq = _store.max_seq(dirpath, mark=writer is not None)
        if tiers is not None:  # commit order continues past what the tiers hold
            seq = max(seq, tiers.seq)
        if split and group is not None:
            seq = max(group.exchange(seq, what="agreeing on the commit number to continue from"))
        return seq, make_backend(config.backend, config.queue_depth), \
            BufferPool(config.chunk_bytes, config.staging_bytes)
    except BaseException:
        if writer is not None:  # a Checkpointer that never came to be holds no lock
            writer.release()
        raise


def open_replicas(dirpath: str, config: Config, placement: _dist.Placement, retention: _retain.Retention
                  ) -> Tuple[Optional[Any], Optional[_dist.Group]]:
    """``Config.replicas`` on node-local directories: the owners' process group (formed by every rank) and,
    on each owner, its store's replication (``tiers/_replica``)."""
    if config.replicas <= 0:
        return None, None
    if not placement.split:
        if placement.rank == 0:
            log.info("layerckpt: Config.replicas=%d is not used: every rank shares %s", config.replicas, dirpath)
        return None, None
    from .tiers._replica import Replicas

    owners = placement.owners
    group = _dist.Group(ranks=owners)
    if not placement.is_owner:
        return None, group
    me = placement.owner[placement.rank]
    return Replicas(dirpath, placement.node_of(me), placement.ranks_of(me), [placement.node_of(o) for o in owners],
                    group, config.replicas, _store.store_id(dirpath), retention), group


def open_notice(config: Config, group: _dist.Group) -> Optional[Any]:
    """``Config.preemption``: the signal handlers, and (several ranks) the gloo group of its own over which every
    rank posts what it was told at each step boundary (formed by every rank, in the same order)."""
    from .preempt import open_notice as open_it

    return open_it(config.preemption, config.grace_s, group.world)


def shutdown(flusher: Flusher, backend, pool: BufferPool, writer: Optional[_store.WriterLock],
             tiers: Optional[_tiers.Tiers] = None, hook=None, owner: Optional[Owner] = None,
             group: Optional[_dist.Group] = None, stager: Optional[LazyStager] = None, replicas: Any = None,
             replica_group: Optional[_dist.Group] = None) -> None:
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
        if replicas is not None:  # after the flusher: no more rounds are queued
            replicas.close()
        if replica_group is not None:
            replica_group.close()
        backend.close()
        pool.close()
        if writer is not None:
            writer.release()
        if group is not None:  # last: no collective of ours is left (see _dist.Group.close)
            group.close()
    finally:
        if owner is not None:  # a newer Checkpointer waiting to take over may lock the store now
            owner.closed()
