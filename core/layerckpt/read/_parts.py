"""Reading a composite whose files are spread over the nodes' own directories (``_dist.place``): collective.

Every rank calls ``restore(dirpath, ...)`` with its node's directory.  The owner of each node's store lists
what it can serve: the composites and data files of its disk, of its memory tier, and of the replicas of
other nodes' parts it holds (``tiers/_replica``); rank 0 adds the remote tier's newest composite.  From
those lists every rank works out the same answer: the newest composite every rank can reach (all its
files held somewhere among the nodes), else the remote's, else a clear error naming what is missing.
Each owner then gathers a local view of it, a folder beside its store: the files its node holds are
linked in, the others arrive from the nodes that hold them over torch.distributed.  Files of its own
ranks' part that it had lost (a node replaced with an empty disk) are written back into its store first,
and the manifest where it lacked it, so that its store is whole again.  The ranks of each node then read
that view as they read any directory.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import _dist, _faults
from ..config import Config
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import _store
from ..format._manifest import Manifest
from ..tiers._memtier import memory_path, refusal
from ..tiers._remote import is_url
from ..tiers import _replica
from ._fetch import View

log = logging.getLogger("layerckpt")

VIEW = ".restore-"  # a view's folder in the store: .restore-<token>
_RANK = {"disk": 0, "memory": 1, "replica": 2}  # which holder of a file is read first


def collective(path: Any) -> bool:
    """Whether a read of ``path`` gathers the composite over the ranks: under torch.distributed with several
    ranks, of a directory (or one of its manifests) that is one node's part (``part.json``) or, in a job of
    several nodes, holds no composite at all (a node that came back empty; the others then say whether theirs
    are parts)."""
    if not _dist.initialized() or _dist.world_size() == 1 or not isinstance(path, (str, os.PathLike)):
        return False
    if is_url(os.fspath(path)):
        return False
    root, _ = split(path)
    try:
        if _store.read_part(root) is not None:
            return True
    except CheckpointError:
        return True  # the collective read reports it
    empty = not _store.list_manifests(root) if os.path.isdir(os.path.join(root, _store.MANIFEST_DIR)) else True
    return empty and several_nodes()


def several_nodes() -> bool:
    """Whether this job spans several nodes, as its launcher tells (torchrun's ``LOCAL_WORLD_SIZE`` below the
    world, SLURM's node count) or ``LAYERCKPT_NODE`` names them: only there may an empty directory be a node that
    came back empty, read with the others.  On one node an empty directory is read alone, as ever (a restore
    called by one rank only must not wait for the others)."""
    world = _dist.world_size()
    local, slurm = os.environ.get("LOCAL_WORLD_SIZE", ""), os.environ.get("SLURM_JOB_NUM_NODES", "")
    return bool(os.environ.get(_dist.NODE_ENV)) or (local.isdigit() and int(local) < world) or \
        (slurm.isdigit() and int(slurm) > 1)


def split(path: Any) -> Tuple[str, Optional[int]]:
    """(store directory, step or None) of a store directory or of one of its manifests (which a node that
    came back empty may lack)."""
    p = os.path.abspath(os.fspath(path))
    step = _store.manifest_step(os.path.basename(p))
    if step is not None and os.path.basename(os.path.dirname(p)) == _store.MANIFEST_DIR and not os.path.isdir(p):
        return os.path.dirname(os.path.dirname(p)), step
    return p, None


@dataclass
class Gathered:
    view: Optional[View]  # None: the ranks share one directory, read as ever
    sources: Dict[int, str] = field(default_factory=dict)  # rank -> where its part came from


@contextlib.contextmanager
def gather(path: Any, step: Optional[int], config: Optional[Config]) -> Iterator[Gathered]:
    """The local view of the composite every rank agrees on (see the module's docstring); collective."""
    t0 = time.perf_counter()
    root, located = split(path)
    if located is not None and step is not None and located != step:
        raise CheckpointError(f"{path} is the checkpoint of step {located}, but step={step} was asked for")
    step = located if located is not None else step
    group = _dist.Group()
    folder: Optional[str] = None
    placement: Optional[_dist.Placement] = None
    try:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError:
            pass
        placement = _dist.place(group, root)
        if not placement.split:
            yield Gathered(None)
            return
        token = group.exchange(uuid.uuid4().hex, what="opening a read of the nodes' parts")[0]
        folder = os.path.join(root, VIEW + token)
        mine = _inventory(root, config, placement, group.rank == 0) if placement.is_owner else None
        # the local paths (``places``) stay here: only the owner reads its files
        lists = group.exchange(None if mine is None else {k: v for k, v in mine.items() if k != "places"},
                               what="listing what every node holds of the composites")
        plan = _decide(placement, lists, step)
        plan["ids"] = [lists[o]["id"] for o in placement.owners]
        if plan["error"] is not None:
            raise CheckpointNotFoundError(plan["error"])
        error = None
        if placement.is_owner:
            try:
                _assemble(root, folder, placement, plan, mine, group, config)
            except Exception as e:  # noqa: BLE001 - every rank learns it below
                error = f"node {placement.nodes[group.rank]}: {type(e).__name__}: {e}"
        errors = [e for e in group.exchange(error, what="gathering the composite on every node") if e]
        if errors:
            raise CheckpointError("layerckpt: the composite could not be gathered: " + "; ".join(errors))
        local = os.path.join(root, _store.MANIFEST_DIR, plan["name"])
        try:
            yield Gathered(View(folder, plan["step"], local if os.path.exists(local) else None, t0, "nodes"),
                           {int(r): s for r, s in plan["sources"].items()})
        finally:  # a rank whose read failed comes here too: no rank waits for it past its error
            group.barrier("every rank's read of the gathered composite")
    finally:
        if folder is not None and placement is not None and placement.is_owner:
            shutil.rmtree(folder, ignore_errors=True)
        group.close()


# ------------------------------------------------------------------ what each node holds


def _inventory(root: str, config: Optional[Config], placement: _dist.Placement, first: bool) -> Dict[str, Any]:
    """What this node's store owner can serve: {"manifests": {name: {seq, created, step, files, where}},
    "files": {fname: [[size, where]]}, "remote": {name, seq, step, created} or None}; ``where``: disk,
    memory, or replica:<node>."""
    out: Dict[str, Any] = {"manifests": {}, "files": {}, "remote": None, "places": {}}

    def add_store(folder: str, where: str) -> None:
        good, _ = _store.read_all(folder) if os.path.isdir(os.path.join(folder, _store.MANIFEST_DIR)) else ({}, [])
        for n, m in good.items():
            have = out["manifests"].get(n)
            if have is None or _RANK[where.split(":")[0]] < _RANK[have["where"].split(":")[0]]:
                mp = os.path.join(folder, _store.MANIFEST_DIR, n)
                out["manifests"][n] = {"seq": m.seq, "created": m.created, "step": m.step, "where": where,
                                       "bytes": os.path.getsize(mp), "world": m.world_size,
                                       "files": {f: fe.size for f, fe in m.files.items()},
                                       "ranks": {f: fe.rank for f, fe in m.files.items()}}
                out["places"][n] = os.path.join(folder, _store.MANIFEST_DIR, n)
        d = os.path.join(folder, _store.DATA_DIR)
        for f in os.listdir(d) if os.path.isdir(d) else ():
            try:
                size = os.lstat(os.path.join(d, f)).st_size
            except OSError:
                continue
            out["files"].setdefault(f, []).append([size, where])
            out["places"].setdefault("data/" + f, {})[where] = os.path.join(d, f)

    add_store(root, "disk")
    if config is not None and config.memory_tier:
        mem = memory_path(root)
        try:
            ok = refusal(mem) is None
        except FileNotFoundError:
            ok = False
        if ok:
            add_store(mem, "memory")
    try:
        identity = _store.store_id(root)
    except CheckpointError:
        identity = None
    out["id"] = identity
    for ident in _replica_ids():  # a node that came back empty knows no identity: the agreed one filters
        for node, folder in _replica.held(ident).items():
            if ident == identity or identity is None:
                add_store(folder, f"replica:{node}@{ident}")
    if first and config is not None and config.remote:
        out["remote"] = _remote_newest(config)
    return out


def _replica_ids() -> List[str]:
    base = os.path.dirname(_replica.replica_root("x"))
    try:
        return [n[len("layerckpt-replicas-"):] for n in os.listdir(base) if n.startswith("layerckpt-replicas-")]
    except OSError:
        return []


def _remote_newest(config: Config) -> Optional[Dict[str, Any]]:
    from ._fetch import pick, remote_store

    try:
        name, m = pick(remote_store(config.remote, config), None)
    except CheckpointError:
        return None
    except Exception as e:  # noqa: BLE001 - an unreachable remote must not hide the nodes' composites
        log.warning("layerckpt: the remote tier %s could not be read (%s: %s)", config.remote, type(e).__name__, e)
        return None
    return {"name": name, "seq": m.seq, "step": m.step, "created": m.created}


# ------------------------------------------------------------------ the one answer every rank works out


def _decide(placement: _dist.Placement, lists: List[Optional[Dict[str, Any]]], step: Optional[int]
            ) -> Dict[str, Any]:
    """The composite to read and how each node gets each of its files: the same on every rank."""
    owners = placement.owners
    ids = [lists[o]["id"] for o in owners if lists[o]["id"]]
    for o in owners:  # replicas of another store's composites (a node that knew no identity listed every one)
        _only_store(lists[o], ids[0] if ids else None)
    found: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for o in owners:
        for n, d in lists[o]["manifests"].items():
            if step is not None and d["step"] != step:
                continue
            found.setdefault((n, d["seq"]), {**d, "holders": []})["holders"].append(o)
    remote = lists[0].get("remote") if lists[0] else None
    if remote is not None and step is not None and remote["step"] != step:
        remote = None
    order = sorted(found, key=lambda k: (found[k]["seq"], found[k]["created"]), reverse=True)
    lacking: Dict[str, List[str]] = {}
    for key in order:
        d = found[key]
        if remote is not None and (remote["seq"], remote["created"]) > (d["seq"], d["created"]):
            break  # the remote holds a newer one
        where = {f: _holders(lists, owners, f, size) for f, size in d["files"].items()}
        missing = sorted(f for f, h in where.items() if not h)
        if missing:
            lacking[key[0]] = missing
            continue
        return _plan(placement, key[0], d, where, lists)
    if remote is not None:
        return {"error": None, "name": remote["name"], "step": remote["step"], "remote": True,
                "moves": [], "sources": {str(r): "remote" for r in range(placement.world)}}
    what = f"step {step}" if step is not None else "a composite"
    if not found:
        nodes = ", ".join(placement.nodes[o] for o in owners)
        return {"error": f"no committed checkpoint of {what} on any node ({nodes}), in their memory tiers or "
                         f"replicas" + ("" if remote is not None else ", and no remote tier holds one (Config.remote)")}
    lines = []
    for name, files in list(lacking.items())[:3]:
        d = next(found[k] for k in found if k[0] == name)
        ranks = sorted({d["ranks"][f] for f in files})
        nodes = sorted({placement.nodes[r] for r in ranks if r < placement.world})
        lines.append(f"{name} lacks {len(files)} file(s) ({', '.join(files[:3])}) of rank(s) "
                     f"{', '.join(map(str, ranks))}" + (f" (node {', '.join(nodes)})" if nodes else ""))
    return {"error": f"no composite every rank can reach: {'; '.join(lines)}: those files are missing: no node "
                     f"holds them on its disk, in "
                     f"its memory tier or as a peer replica, and no remote tier holds the composite; set "
                     f"Config(replicas=1) and Config(remote=...) so that a lost node's part survives it"}


def _only_store(listed: Dict[str, Any], identity: Optional[str]) -> None:
    """Drop from one node's list what it holds as replicas of a store other than ``identity``."""
    def ours(where: str) -> bool:
        return "@" not in where or identity is None or where.rsplit("@", 1)[1] == identity

    listed["manifests"] = {n: d for n, d in listed["manifests"].items() if ours(d["where"])}
    listed["files"] = {f: [h for h in held if ours(h[1])] for f, held in listed["files"].items()}


def _holders(lists, owners: List[int], f: str, size: int) -> List[Tuple[int, int, str]]:
    """(preference, owner, where) of the nodes holding the data file ``f`` whole, best first."""
    out = []
    for o in owners:
        for have, where in lists[o]["files"].get(f, []):
            if have == size:
                out.append((_RANK[where.split(":")[0]], o, where))
    return sorted(out)


def _plan(placement: _dist.Placement, name: str, d: Dict[str, Any], where, lists) -> Dict[str, Any]:
    moves = []  # [what, from owner, from where, to owner]
    for o in placement.owners:
        if name not in lists[o]["manifests"] or lists[o]["manifests"][name]["seq"] != d["seq"]:
            src = d["holders"][0]
            held = lists[src]["manifests"][name]
            moves.append(["manifest:" + name, src, held["where"], o, held["bytes"]])
        for f in sorted(d["files"]):
            if any(ow == o for _, ow, _ in where[f]):
                continue
            _, src, kind = where[f][0]
            moves.append(["data:" + f, src, kind, o, d["files"][f]])
    sources = {}
    for r in range(placement.world):
        o = placement.owner[r]
        got = set()
        for f, fr in d["ranks"].items():
            if fr != r and d["world"] == placement.world:  # onto another world: every file is each rank's
                continue
            local = [w for _, ow, w in where[f] if ow == o]
            got.add(local[0].split(":")[0] if local else where[f][0][2].split(":")[0])
        sources[str(r)] = ", ".join(sorted(got)) if got else "disk"
    return {"error": None, "name": name, "step": d["step"], "seq": d["seq"], "remote": False, "moves": moves,
            "world": d["world"],
            "files": d["files"], "ranks": d["ranks"], "sources": sources}


# ------------------------------------------------------------------ the view, gathered


def _assemble(root: str, folder: str, placement: _dist.Placement, plan: Dict[str, Any], mine: Dict[str, Any],
              group: _dist.Group, config: Optional[Config]) -> None:
    _store.ensure_layout(root)  # a node that came back empty: its store is made whole again below
    ids = [lists_id for lists_id in plan.get("ids", []) if lists_id]
    if ids:
        _store.ensure_store_id(root, ids[0])
    _store.write_part(root, placement.part())
    os.makedirs(os.path.join(folder, _store.DATA_DIR))
    os.makedirs(os.path.join(folder, _store.MANIFEST_DIR))
    name = plan["name"]
    if plan["remote"]:
        from ._fetch import download, remote_store, pick

        store = remote_store(config.remote, config)
        n, m = pick(store, plan["step"])
        shutil.rmtree(folder)
        download(store, {n: m}, folder)
        _exchange_files(placement, plan, group, mine=mine, root=root, folder=folder)
        return
    _exchange_files(placement, plan, group, mine=mine, root=root, folder=folder)
    me = group.rank
    incoming = {mv[0] for mv in plan["moves"] if mv[3] == me}
    for f in plan["files"]:
        dst = os.path.join(folder, _store.DATA_DIR, f)
        if "data:" + f in incoming:
            continue  # received into place
        places = mine["places"]["data/" + f]
        src = sorted(places.items(), key=lambda kv: _RANK[kv[0].split(":")[0]])[0][1]
        _link_or_copy(src, dst)
        mine_f = _own(placement, plan, plan["ranks"][f], me)
        if mine_f and not os.path.exists(os.path.join(root, _store.DATA_DIR, f)):
            _heal(src, root, f)  # this node's own file, held only in its memory: back onto its disk
    mpath = os.path.join(folder, _store.MANIFEST_DIR, name)
    if "manifest:" + name not in incoming:
        _link_or_copy(mine["places"][name], mpath)
    own = os.path.join(root, _store.MANIFEST_DIR, name)
    if plan.get("world") == placement.world and not os.path.exists(own) and all(
            os.path.exists(os.path.join(root, _store.DATA_DIR, f)) for f, r in plan["ranks"].items()
            if _own(placement, plan, r, me)):
        with open(mpath, "rb") as src_f:
            _store.write_atomic(own, src_f.read())  # the node's store holds the composite again


def _exchange_files(placement: _dist.Placement, plan: Dict[str, Any], group: _dist.Group, mine, root: str,
                    folder: Optional[str]) -> None:
    """Send what others need from this node and receive what it lacks, over the group (its owners only)."""
    me = group.rank
    pg = group.pg
    works = []
    if any(mv[1] == me for mv in plan["moves"]):
        _faults.point("parts.sending")
    for i, (what, src, where, dst, _) in enumerate(plan["moves"]):
        if src == me:
            path = mine["places"][what.split(":", 1)[1]] if what.startswith("manifest:") else \
                mine["places"]["data/" + what.split(":", 1)[1]][where]
            works += [_dist._dist.isend(c, dst, group=pg, tag=i) for c in _replica.file_chunks(path)]
    try:
        for i, (what, src, where, dst, size) in enumerate(plan["moves"]):
            if dst != me:
                continue
            kind, name = what.split(":", 1)
            sub = _store.DATA_DIR if kind == "data" else _store.MANIFEST_DIR
            dst_path = os.path.join(folder, sub, name)
            if kind == "data" and _own(placement, plan, plan["ranks"][name], me):
                # this node's own file, lost with it: received into its store, durably, and linked into the view
                home = os.path.join(root, _store.DATA_DIR, name)
                _replica.receive_file(home + ".tmp", size, src, pg, tag=i)
                _durable(home + ".tmp", home)
                _link_or_copy(home, dst_path)
            else:
                _replica.receive_file(dst_path, size, src, pg, tag=i)
    finally:  # what others wait for from this node is sent, even where its own part failed
        for w in works:
            w.wait()


def _own(placement: _dist.Placement, plan: Dict[str, Any], rank: int, me: int) -> bool:
    """Whether a file the composite's rank ``rank`` wrote is this node's own (``me``: its owner): a rank of the
    same world on this node.  Restored onto another number of ranks, no old file is any node's own."""
    return plan.get("world") == placement.world and rank < placement.world and placement.owner[rank] == me


def _heal(src: str, root: str, fname: str) -> None:
    """Write this node's own data file back into its store, durably, from ``src``."""
    dst = os.path.join(root, _store.DATA_DIR, fname)
    shutil.copyfile(src, dst + ".tmp")
    _durable(dst + ".tmp", dst)


def _durable(tmp: str, dst: str) -> None:
    """``tmp`` synced and renamed to ``dst``, its folder synced."""
    fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dst)
    _store.fsync_dir(os.path.dirname(dst))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
