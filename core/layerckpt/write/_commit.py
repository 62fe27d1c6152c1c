"""Commit: fold every rank's file into the manifest, then write it atomically, the one commit point.

No manifest, no checkpoint: data files are durable before this runs, and the
manifest's rename makes the checkpoint exist.  ``latest`` is written after it
as a hint for readers; it never decides what is committed.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .. import _faults
from .._dist import Group
from ..io._backend import checksum_function
from ..format._layout import DTYPES, Layout
from ..format._json import loads_strict
from ..format._manifest import FileEntry, Manifest, TensorEntry, plain
from ..format._places import seal
from ..format._sign import sign
from ..format._store import LATEST, MANIFEST_DIR, before_commit, manifest_name, write_atomic
from ..errors import CheckpointWriteError

log = logging.getLogger("layerckpt")


class RankFailure(NamedTuple):
    """Why a rank's file could not be written (a JSON list at the exchange)."""

    errno: int
    path: str
    message: str


@dataclass(frozen=True)
class RankResult:
    """What one rank tells the others about its file: where each tensor landed, or why it failed.  Crosses
    between ranks as a plain JSON dict (:meth:`to_dict`, :meth:`from_dict`), nowhere else.  Its entries' ``crc``
    is the plain CRC of each tensor's raw bytes: :func:`merge`, which records the file's step, seals it."""

    rank: int
    fname: str
    size: int  # the file's size in bytes
    rng: Any  # this rank's RNG states, as the manifest holds them
    error: Optional[RankFailure] = None
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)  # none when it failed
    coding: Optional[Dict[str, Any]] = None  # how its tensors were written, by kind, and why (``_cost``)
    digest: Optional[List[List[Any]]] = None  # a signed store's: the file's digest (``_sign``)

    def to_dict(self) -> Dict[str, Any]:
        return {"rank": self.rank, "fname": self.fname, "size": self.size, "rng": self.rng,
                "error": None if self.error is None else list(self.error),
                "tensors": {k: plain(e) for k, e in self.tensors.items()}, "coding": self.coding,
                "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RankResult":
        return cls(rank=d["rank"], fname=d["fname"], size=d["size"], rng=d["rng"],
                   error=None if d["error"] is None else RankFailure(*d["error"]),
                   tensors={k: TensorEntry(**e) for k, e in d["tensors"].items()}, coding=d.get("coding"),
                   digest=d.get("digest"))


def rank_result(rank: int, fname: str, layout: Layout, crcs: Sequence[int], rng: Any,
                failed: Optional[BaseException], path: str, tensors: Optional[Dict[str, TensorEntry]] = None,
                size: Optional[int] = None, coding: Optional[Dict[str, Any]] = None,
                digest: Optional[List[List[Any]]] = None) -> RankResult:
    """What this rank tells the others about its file: where each tensor landed, or its error.  ``tensors``
    and ``size``: the file's entries and size when it was written encoded (else the layout's); ``coding``:
    the cost model's decisions for its tensors, by kind."""
    if failed is not None:
        error = RankFailure(getattr(failed, "errno", None) or errno.EIO, getattr(failed, "path", None) or path,
                            str(failed))
        return RankResult(rank, fname, layout.size, rng, error)
    if tensors is not None:
        return RankResult(rank, fname, layout.size if size is None else size, rng, tensors=tensors, coding=coding,
                          digest=digest)
    tensors = {it.key: TensorEntry(file=fname, dtype=DTYPES[it.tensor.dtype], shape=list(it.tensor.shape),
                                   offset=it.offset, nbytes=it.nbytes, crc=crcs[i])
               for i, it in enumerate(layout.items)}  # plain CRCs: merge seals them to key and step (``_places``)
    return RankResult(rank, fname, layout.size, rng, tensors=tensors, coding=coding, digest=digest)


def agree(group: Group, mine: RankResult, failed: Optional[BaseException], path: str) -> List[RankResult]:
    """Every rank's result, once every rank's data is durable (or failed).  If any rank failed, nothing
    is committed: this rank's file goes, and the error names every rank that failed and why."""
    # alone, nothing crosses a process: this rank's result as it is (no round trip through plain dicts)
    if group.world == 1:
        ranks = [mine]
    else:
        ranks = [RankResult.from_dict(d) for d in group.exchange(
            mine.to_dict(), what=f"the ranks' agreement that every file of this save (here {mine.fname}) is durable")]
    bad = [r for r in ranks if r.error is not None]
    if not bad:
        return ranks
    unlink_quietly(path)
    if failed is not None and len(bad) == 1:
        raise failed
    detail = "; ".join(f"rank {r.rank} failed ({r.error.message})" for r in bad)
    raise CheckpointWriteError(bad[0].error.errno, bad[0].error.path, detail=f"{detail}; nothing was committed")


def publish(group: Group, root: str, m: Manifest, committers: AbstractSet[int] = frozenset({0}),
            key: Optional[bytes] = None) -> Tuple[str, Manifest]:
    """Each store's owner (``committers``: rank 0, or each node's owner on node-local directories) commits the
    one manifest into its store; every rank learns whether each did.  Returns the manifest path and the
    manifest committed: rank 0's, which every node's store receives byte for byte (each rank's own ``m``
    differs in what only rank 0 records, such as the extra state it wrote).  ``key``: a signed store's
    (``_sign``), which rank 0 signs the manifest with."""
    status = None
    path = os.path.join(root, MANIFEST_DIR, manifest_name(m.step))
    body: Optional[bytes] = sign(m.to_json(), key) if key is not None and group.rank == 0 else None
    split = group.world > 1 and len(committers) > 1
    if split:
        text = group.broadcast((body or m.to_json()).decode() if group.rank == 0 else None,
                               what=f"sending the manifest of step {m.step} to every node")
        body = text.encode()
        if group.rank != 0:
            m = Manifest.from_dict(loads_strict(body, path), path)
    if group.rank in committers:
        try:
            commit(root, m, body)
        except OSError as e:
            status = [e.errno or errno.EIO, getattr(e, "filename", None) or root]
    if group.world > 1:
        who = "the nodes' owners" if split else "rank 0"
        answers = group.exchange(status, what=f"learning from {who} whether step {m.step} is committed (it may be)")
        failed = [(r, a) for r, a in enumerate(answers) if a is not None]
        status = failed[0][1] if failed else None
        if failed and split:
            nodes = ", ".join(f"rank {r}'s ({a[1]})" for r, a in failed)
            raise CheckpointWriteError(status[0], status[1], detail=f"the manifest could not be committed into "
                                       f"{nodes}; the nodes that hold it restore it, the others fetch it from them")
    if status is not None:
        raise CheckpointWriteError(status[0], status[1], detail="the manifest could not be committed")
    return path, m


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def merge(m: Manifest, ranks: List[RankResult], checksum: str) -> None:
    """Fold every rank's file and tensors into ``m`` (the same result on every rank).  Each file is recorded at
    this save's step, and each of its tensors' CRCs sealed to the tensor's key and that step (``_places``): the
    step every later composite and tier copy records for the file, which a reader seals what it reads with."""
    m.checksum = checksum
    check = checksum_function(checksum)
    fname = {}
    for r in ranks:
        fname[r.rank] = r.fname
        m.files[r.fname] = FileEntry(step=m.step, rank=r.rank, size=r.size, digest=r.digest)
        step = m.step  # a new entry each (entries are never changed once made), built directly: replace() costs 10x
        m.tensors.update({k: TensorEntry(e.file, e.dtype, e.shape, e.offset, e.nbytes, seal(check, k, e.crc, step),
                                         e.enc) for k, e in r.tensors.items()})
        if r.coding:
            m.coding = {**(m.coding or {}), r.fname: r.coding}
    for info in m.layers.values():
        if info.file is None:
            info.file = fname[info.rank]
    m.rng = ranks[0].rng
    if len(ranks) > 1:
        m.rng_ranks = {str(r.rank): r.rng for r in ranks[1:]}


def commit(root: str, m: Manifest, body: Optional[bytes] = None) -> str:
    """Write the manifest atomically: from its rename on, the checkpoint exists.  Then point `latest` at
    it, best effort: a failure there is logged and does not undo the commit.  Returns the manifest path."""
    _faults.point("commit.before")
    name = manifest_name(m.step)
    path = os.path.join(root, MANIFEST_DIR, name)
    before_commit(root, m.step)
    write_atomic(path, m.to_json() if body is None else body)
    try:
        _faults.point("commit.latest")
        # a hint that decides nothing (the manifests are the commit record): not worth two more fsyncs a save
        write_atomic(os.path.join(root, LATEST), (name + "\n").encode(), durable=False)
    except OSError as e:
        log.warning("layerckpt: step %d is committed, but %s/%s could not be updated: %s", m.step, root, LATEST, e)
    return path
