"""Peer replicas: each node's newest committed part also held in the memory of ``Config.replicas`` partner
nodes (a ring over the nodes' stores), sent over torch.distributed in the background.

After each commit the owner of each node's store (``_dist.place``) queues the composite; its replication thread
agrees with the other owners on the newest composite every one of them has queued (a round), then sends its
part (the data files its ranks wrote that the partner does not hold yet, and the manifest) to each partner,
and receives its sources' parts.  A partner writes what arrives into a folder of its memory tier's base
(``LAYERCKPT_SHM`` or /dev/shm), links what it held already from its previous copy, and renames the folder
into place: that rename is the replica's commit point, so a partial copy never shadows an older complete one.
Only the newest complete copy of each source stays, beside the one arriving.

The rounds run on a process group of their own (the owners only), never the flusher's nor the training's,
and never block a step.  A failed round (a partner gone) stops the replication, logged: the job restarts from
what is committed, and the replicas of the rounds before it stay usable.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _dist, _faults
from ..format import _store
from ..format._json import read_regular
from ..format._manifest import Manifest
from ._memtier import _base, make_private
from ._tiers import stop_worker

log = logging.getLogger("layerckpt")

CHUNK = 64 << 20  # the most bytes one message carries
_COMPLETE = re.compile(r"^c-(\d{12})$")
INCOMING = ".incoming"


def replica_root(identity: str) -> str:
    """Where the replicas of the store ``identity`` that this node holds for others live."""
    return os.path.join(_base(), f"layerckpt-replicas-{identity}")


def held(identity: str) -> Dict[str, str]:
    """The complete replicas this node holds of the store ``identity``: source node -> its newest complete
    copy's folder (a store laid out as the checkpoint directory: manifests/ and data/)."""
    root = replica_root(identity)
    out: Dict[str, str] = {}
    try:
        nodes = os.listdir(root)
    except OSError:
        return out
    for node in sorted(nodes):
        d = os.path.join(root, node)
        try:
            done = sorted(n for n in os.listdir(d) if _COMPLETE.match(n))
        except OSError:
            continue
        if done:
            out[node] = os.path.join(d, done[-1])
    return out


def _files_in(folder: str) -> Dict[str, int]:
    d = os.path.join(folder, _store.DATA_DIR)
    out = {}
    for n in os.listdir(d) if os.path.isdir(d) else ():
        try:
            out[n] = os.lstat(os.path.join(d, n)).st_size
        except OSError:
            pass
    return out


class Replicas:
    """The replication of one node's store (its owner's): a commit listener, and the thread that runs the
    rounds.  ``group``: the owners' own process group (``_dist.Group(ranks=owners)``)."""

    def __init__(self, root: str, node: str, my_ranks: List[int], nodes: List[str], group: _dist.Group, k: int,
                 identity: str, retention=None):
        self.root, self.node, self.my_ranks = root, node, set(my_ranks)
        self.group, self.identity, self.retention = group, identity, retention
        n = group.world
        i = group.rank
        self.k = min(k, n - 1)
        self.partners = [group.members[(i + d) % n] for d in range(1, self.k + 1)]
        self.sources = [group.members[(i - d) % n] for d in range(1, self.k + 1)]
        self.source_nodes = {group.members[(i - d) % n]: nodes[(i - d) % n] for d in range(1, self.k + 1)}
        self.home = replica_root(identity)
        self._cv = threading.Condition()
        self._queued: List[Tuple[str, Manifest]] = []
        self._queued_at: Dict[int, float] = {}  # commit number -> when it was queued
        #: the composites of the last two rounds: the one this node finished last, and the one before it, which
        #: every owner had finished once the next round's exchange was over.  Each node's retention keeps its
        #: own part of both: a replica is of use only beside every other node's own part of the same composite
        self._rounds: List[str] = []
        self._busy: Optional[str] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        #: what it did: rounds completed, bytes sent to partners, seconds from each commit to its replicas
        #: being complete on every partner, bytes it holds of its sources' parts
        self.rounds = 0
        self.bytes_sent = 0
        self.lag_s: List[float] = []
        self.bytes_held = 0
        why = make_private(os.path.dirname(self.home)) if not os.path.isdir(os.path.dirname(self.home)) else None
        why = why or make_private(self.home)
        if why is not None:
            raise OSError(f"the replicas' folder {self.home} cannot be used: {why}")

    # -------------------------------------------------------------- commit listener (flusher thread)

    def committed(self, m: Manifest) -> None:
        if self.error is not None:
            return
        snapshot = Manifest.from_dict(m.to_dict(), "manifest")
        with self._cv:
            self._queued.append((_store.manifest_name(m.step), snapshot))
            self._queued_at[m.seq] = time.perf_counter()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="layerckpt-replicas", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        self._hold()

    def _hold(self) -> None:
        if self.retention is not None:
            with self._cv:
                names = {n for n, _ in self._queued} | ({self._busy} if self._busy else set()) | set(self._rounds)
            self.retention.hold(names, "replicas")

    # -------------------------------------------------------------- the rounds (replication thread)

    def _run(self) -> None:
        try:  # the training's threads first on a busy machine: this one only copies in the background
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                while not self._queued and not self._stop:
                    self._cv.wait()
                if not self._queued:
                    return
                upto = self._queued[-1][1].seq
            try:
                self._round(upto)
            except BaseException as e:  # noqa: BLE001 - logged; the replicas stop, the training goes on
                self.error = e
                log.warning("layerckpt: node %s: peer replication stopped: %s", self.node, e)
                with self._cv:
                    self._queued.clear()
                    self._busy = None
                    self._cv.notify_all()
                self._hold()
                return

    def _round(self, upto: int) -> None:
        """One round: the owners agree on the newest composite all of them have queued, and each sends its
        part of it to its partners while receiving its sources' parts."""
        mine = {"upto": upto, "have": {str(s): self._have(self.source_nodes[s]) for s in self.sources}}
        answers = self.group.exchange(mine, what="agreeing on the composite the nodes replicate")
        seq = min(a["upto"] for a in answers)
        with self._cv:
            taken = [(n, m) for n, m in self._queued if m.seq <= seq]
            self._queued = [(n, m) for n, m in self._queued if m.seq > seq]
            name, m = taken[-1] if taken else (None, None)
            self._busy = name
        if m is None or m.seq != seq:  # cannot be: every owner queues every commit
            raise RuntimeError(f"node {self.node} has not queued the composite of commit {seq}")
        me = self.group.members[self.group.rank]
        part = {f: fe.size for f, fe in m.files.items() if fe.rank in self.my_ranks}
        sends = []
        body = read_regular(os.path.join(self.root, _store.MANIFEST_DIR, name), follow=False)
        for p in self.partners:
            their = answers[self.group.members.index(p)]["have"].get(str(me), {})
            todo = sorted(f for f, size in part.items() if their.get(f) != size)
            header = json.dumps({"node": self.node, "name": name, "seq": m.seq, "step": m.step, "part": part,
                                 "sent": todo, "manifest": len(body)}).encode()
            sends += self._send(p, header, body, todo)
        for s in self.sources:
            self._receive(s)
        for w in sends:
            w.wait()
        # every partner has it once the next round's exchange begins; measured here, at our side's end
        t0 = self._queued_at.pop(m.seq, None)
        if t0 is not None:
            self.lag_s.append(time.perf_counter() - t0)
        self.rounds += 1
        with self._cv:
            self._rounds = (self._rounds + [name])[-2:]
            self._busy = None
            self._cv.notify_all()
        self._hold()
        if self.retention is not None:
            self.retention.soon()

    def _have(self, node: str) -> Dict[str, int]:
        """The data files of ``node``'s part this node holds in its newest complete replica."""
        d = held(self.identity).get(node)
        return _files_in(d) if d else {}

    def _send(self, dst: int, header: bytes, body: bytes, files: List[str]) -> list:
        pg = self.group.pg
        works = [_dist._dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=pg),
                 _dist._dist.isend(_as_tensor(header), dst, group=pg),
                 _dist._dist.isend(_as_tensor(body), dst, group=pg)]
        for f in files:
            for chunk in file_chunks(os.path.join(self.root, _store.DATA_DIR, f)):
                works.append(_dist._dist.isend(chunk, dst, group=pg))
                self.bytes_sent += chunk.numel()
        _faults.point("replica.sent")
        return works

    def _receive(self, src: int) -> None:
        pg = self.group.pg
        n = torch.zeros(1, dtype=torch.int64)
        _dist._dist.recv(n, src, group=pg)
        raw = torch.empty(int(n.item()), dtype=torch.uint8)
        _dist._dist.recv(raw, src, group=pg)
        h = json.loads(bytes(raw.numpy()))
        node = self.source_nodes[src]
        body = torch.empty(int(h["manifest"]), dtype=torch.uint8)
        _dist._dist.recv(body, src, group=pg)
        here = os.path.join(self.home, node)
        os.makedirs(here, mode=0o700, exist_ok=True)
        incoming = os.path.join(here, INCOMING)
        shutil.rmtree(incoming, ignore_errors=True)
        os.makedirs(os.path.join(incoming, _store.DATA_DIR), mode=0o700)
        os.makedirs(os.path.join(incoming, _store.MANIFEST_DIR), mode=0o700)
        sent = set(h["sent"])
        for f in sorted(sent):
            receive_file(os.path.join(incoming, _store.DATA_DIR, f), h["part"][f], src, pg)
            _faults.point("replica.file-received")
        before = held(self.identity).get(node)
        for f, size in h["part"].items():  # what it held already: linked from its previous complete copy
            if f in sent:
                continue
            old = os.path.join(before or "", _store.DATA_DIR, f)
            os.link(old, os.path.join(incoming, _store.DATA_DIR, f))
        with open(os.path.join(incoming, _store.MANIFEST_DIR, h["name"]), "wb") as out:
            out.write(memoryview(body.numpy()))
        done = os.path.join(here, f"c-{h['seq']:012d}")
        shutil.rmtree(done, ignore_errors=True)
        os.rename(incoming, done)  # the replica's commit point
        for n in os.listdir(here):
            if _COMPLETE.match(n) and n != os.path.basename(done):
                shutil.rmtree(os.path.join(here, n), ignore_errors=True)
        self.bytes_held = sum(sum(_files_in(d).values()) for d in held(self.identity).values())

    # -------------------------------------------------------------- life

    def busy(self) -> bool:
        with self._cv:
            return bool(self._queued) or self._busy is not None

    def wait(self) -> None:
        """Until every composite queued is replicated (or the replication stopped)."""
        with self._cv:
            while (self._queued or self._busy is not None) and self.error is None:
                self._cv.wait(0.1)

    def close(self) -> None:
        stop_worker(self)


def _as_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


def file_chunks(path: str) -> List[torch.Tensor]:
    """The file's bytes as views of at most CHUNK bytes of one private mapping of it (no copy made here: the
    sender's transport reads the pages)."""
    size = os.path.getsize(path)
    if size == 0:
        return []
    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return [whole[off:off + CHUNK] for off in range(0, size, CHUNK)]


def receive_file(path: str, size: int, src: int, pg: Any, tag: int = 0) -> None:
    """Receive ``size`` bytes from ``src`` straight into a shared mapping of a new file at ``path`` (in chunks
    of at most CHUNK bytes, as :func:`file_chunks` sends them)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    if size == 0:
        return
    whole = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    for off in range(0, size, CHUNK):
        _dist._dist.recv(whole[off:off + CHUNK], src, group=pg, tag=tag)
    del whole  # unmapped: the pages stay in the file


def stats(r: Optional[Replicas]) -> Dict[str, Any]:
    if r is None:
        return {}
    return {"rounds": r.rounds, "bytes_sent": r.bytes_sent, "bytes_held": r.bytes_held, "lag_s": list(r.lag_s),
            "error": None if r.error is None else str(r.error)}
