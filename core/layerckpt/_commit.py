"""Commit: fold every rank's file into the manifest, then write it atomically, the one commit point.

No manifest, no checkpoint: data files are durable before this runs, and the
manifest's rename makes the checkpoint exist.  ``latest`` is written after it
as a hint for readers; it never decides what is committed.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

from . import _faults
from ._dist import Group
from ._layout import DTYPES, Layout
from ._manifest import FileEntry, Manifest, TensorEntry
from ._store import LATEST, MANIFEST_DIR, manifest_name, write_atomic
from .errors import CheckpointWriteError

log = logging.getLogger("layerckpt")


def rank_result(rank: int, fname: str, layout: Layout, crcs: Sequence[int], rng: Any,
                failed: Optional[BaseException], path: str) -> Dict[str, Any]:
    """What this rank tells the others about its file (JSON): where each tensor landed, or its error."""
    return {
        "rank": rank, "fname": fname, "size": layout.size, "rng": rng,
        "error": None if failed is None else [getattr(failed, "errno", None) or errno.EIO,
                                              getattr(failed, "path", None) or path, str(failed)],
        "tensors": {} if failed is not None else {
            it.key: dataclasses.asdict(TensorEntry(
                file=fname, dtype=DTYPES[it.tensor.dtype], shape=list(it.tensor.shape), offset=it.offset,
                nbytes=it.nbytes, crc=crcs[i]))
            for i, it in enumerate(layout.items)},
    }


def agree(group: Group, mine: Dict[str, Any], failed: Optional[BaseException], path: str) -> List[Dict[str, Any]]:
    """Every rank's result, once every rank's data is durable (or failed).  If any rank failed, nothing
    is committed: this rank's file goes, and the error names every rank that failed and why."""
    ranks = group.exchange(mine)
    bad = [r for r in ranks if r["error"] is not None]
    if not bad:
        return ranks
    unlink_quietly(path)
    if failed is not None and len(bad) == 1:
        raise failed
    err, where, _ = bad[0]["error"]
    detail = "; ".join(f"rank {r['rank']} failed ({r['error'][2]})" for r in bad)
    raise CheckpointWriteError(err, where, detail=f"{detail}; nothing was committed")


def publish(group: Group, root: str, m: Manifest) -> str:
    """Rank 0 commits; every rank learns whether it did.  Returns the manifest path."""
    status = None
    path = os.path.join(root, MANIFEST_DIR, manifest_name(m.step))
    if group.rank == 0:
        try:
            commit(root, m)
        except OSError as e:
            status = [e.errno or errno.EIO, getattr(e, "filename", None) or root]
    if group.world > 1:
        status = group.exchange(status)[0]  # rank 0's word: committed or not
    if status is not None:
        raise CheckpointWriteError(status[0], status[1], detail="the manifest could not be committed")
    return path


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def merge(m: Manifest, ranks: List[Dict[str, Any]], checksum: str) -> None:
    """Fold every rank's file and tensors into ``m`` (the same result on every rank)."""
    m.checksum = checksum
    fname = {}
    for r in ranks:
        fname[r["rank"]] = r["fname"]
        m.files[r["fname"]] = FileEntry(step=m.step, rank=r["rank"], size=r["size"])
        m.tensors.update({k: TensorEntry(**e) for k, e in r["tensors"].items()})
    for info in m.layers.values():
        if info.file is None:
            info.file = fname[info.rank]
    m.rng = ranks[0]["rng"]
    if len(ranks) > 1:
        m.rng_ranks = {str(r["rank"]): r["rng"] for r in ranks[1:]}


def commit(root: str, m: Manifest) -> str:
    """Write the manifest atomically: from its rename on, the checkpoint exists.  Then point `latest` at
    it, best effort: a failure there is logged and does not undo the commit.  Returns the manifest path."""
    _faults.point("commit.before")
    name = manifest_name(m.step)
    path = os.path.join(root, MANIFEST_DIR, name)
    write_atomic(path, m.to_json())
    try:
        _faults.point("commit.latest")
        write_atomic(os.path.join(root, LATEST), (name + "\n").encode())
    except OSError as e:
        log.warning("layerckpt: step %d is committed, but %s/%s could not be updated: %s", m.step, root, LATEST, e)
    return path
