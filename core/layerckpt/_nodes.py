"""Where each rank's store is: its node, and which ranks see the same checkpoint directory.

Every rank passes the same ``dirpath``.  Ranks whose ``dirpath`` is one directory
(a shared file system, or one machine) share one store, owned by the lowest of them;
ranks on different nodes with node-local disks have one store per node.  Which it is
is found out, not configured: each rank drops a probe file in its directory and
looks for the others' (:func:`place`).  One store for all ranks is the single
directory of before, unchanged.  Several stores are *parts*: each holds the files
its ranks write and every committed manifest (``part.json`` says whose part it is),
and reads of them are collective (``read/_nodes``).

A rank's node is named by ``LAYERCKPT_NODE``, else the launcher's node rank (torchrun's
``GROUP_RANK``, Lightning's ``NODE_RANK``), else the host name: two torchrun node
launchers on one host are two nodes.
"""
from __future__ import annotations

import json
import os
import re
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .errors import CheckpointCorruptError, CheckpointError

NODE_ENV = "LAYERCKPT_NODE"
PART = "part.json"  # in a node's store: whose part of the composites it holds
_PROBE = ".probe-"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def node_name() -> str:
    """This process's node: ``LAYERCKPT_NODE``, else ``node<GROUP_RANK>`` / ``node<NODE_RANK>``, else the host."""
    given = os.environ.get(NODE_ENV)
    if given:
        if not _NAME.match(given):
            raise CheckpointError(f"{NODE_ENV}={given!r} is not a node name: use up to 128 letters, digits, '.', "
                                  f"'_' or '-'")
        return given
    for var in ("GROUP_RANK", "NODE_RANK"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return f"node{int(v)}"
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:128]
    return host or "node"


@dataclass(frozen=True)
class Placement:
    """Every rank's node and store.  ``owner[r]``: the rank that owns rank r's store (locks it, cleans it,
    commits into it, runs its retention and tiers); ``nodes[r]``: rank r's node name."""

    rank: int
    owner: List[int]
    nodes: List[str]

    @property
    def world(self) -> int:
        return len(self.owner)

    @property
    def split(self) -> bool:
        """Whether the ranks have several stores (node-local directories) rather than one shared one."""
        return len(self.owners) > 1

    @property
    def owners(self) -> List[int]:
        """The store owners, in rank order: one per store."""
        return sorted(set(self.owner))

    @property
    def is_owner(self) -> bool:
        return self.owner[self.rank] == self.rank

    def ranks_of(self, owner: int) -> List[int]:
        """The ranks whose store ``owner`` owns."""
        return [r for r, o in enumerate(self.owner) if o == owner]

    def node_of(self, owner: int) -> str:
        """The name of the store ``owner`` owns: its owner's node."""
        return self.nodes[owner]

    def part(self) -> Dict[str, Any]:
        """What ``part.json`` records of this rank's store."""
        me = self.owner[self.rank]
        return {"node": self.nodes[me], "ranks": self.ranks_of(me), "world": self.world,
                "nodes": [self.nodes[o] for o in self.owners]}


ALONE = Placement(0, [0], ["node"])


def place(group, dirpath: str) -> Placement:
    """Which ranks share ``dirpath`` (collective over ``group``, a ``_dist.Group``; every rank's ``dirpath``
    must exist).  Probe files, one per rank, tell: a rank sees another's exactly when they share the folder."""
    if group.world == 1:
        return Placement(0, [0], [node_name()])
    token = uuid.uuid4().hex
    first = group.exchange({"node": node_name(), "token": token}, what="learning every rank's node")
    token = first[0]["token"]
    nodes = [d["node"] for d in first]
    mine = os.path.join(dirpath, f"{_PROBE}{token}-{group.rank}")
    try:
        with open(mine, "x"):
            pass
        made = None
    except OSError as e:
        made = f"{mine} cannot be made: {e.strerror or e}"
    group.barrier("every rank's probe of the checkpoint directory made")
    seen = [r for r in range(group.world) if os.path.exists(os.path.join(dirpath, f"{_PROBE}{token}-{r}"))]
    answers = group.exchange({"seen": seen, "error": made}, what="learning which ranks share a checkpoint directory")
    try:
        os.unlink(mine)
    except OSError:
        pass
    errors = [f"rank {r}: {a['error']}" for r, a in enumerate(answers) if a["error"]]
    if errors:
        raise CheckpointError("layerckpt: the checkpoint directory cannot be written on every rank: "
                              + "; ".join(errors))
    views = [tuple(a["seen"]) for a in answers]
    for r, v in enumerate(views):
        odd = [s for s in v if views[s] != v]
        if odd or r not in v:
            raise CheckpointError(
                f"layerckpt: ranks {r} and {odd[0] if odd else r} disagree on which ranks share the checkpoint "
                f"directory {dirpath} (rank {r} sees the files of ranks {list(v)}): a file system that shows "
                f"files to some nodes late; give each node a directory of its own on its local disk, or one "
                f"that every node sees at once")
    return Placement(group.rank, [min(v) for v in views], nodes)


def write_part(root: str, placement: Placement) -> None:
    """Record, in a node's store, that it is a part of its composites (and whose)."""
    from .format._store import write_atomic

    body = json.dumps(placement.part(), sort_keys=True).encode()
    path = os.path.join(root, PART)
    try:
        with open(path, "rb") as f:
            if f.read(1 << 16) == body:
                return
    except OSError:
        pass
    write_atomic(path, body)


def read_part(root: str) -> Optional[Dict[str, Any]]:
    """``part.json`` of a store (None where it has none: a store that holds whole composites)."""
    from .format._json import read_regular
    from .errors import CheckpointNotFoundError

    path = os.path.join(root, PART)
    try:
        raw = read_regular(path, "node part record", cap=1 << 16, follow=False, under=root)
    except CheckpointNotFoundError:
        return None
    try:
        d = json.loads(bytes(raw))
        if not (isinstance(d, dict) and isinstance(d.get("node"), str) and isinstance(d.get("ranks"), list)
                and all(isinstance(r, int) for r in d["ranks"]) and isinstance(d.get("nodes"), list)):
            raise ValueError("fields")
    except ValueError as e:
        raise CheckpointCorruptError(f"{path} is not a node part record ({e}); remove it if this directory is "
                                     f"not a node's part", path=path) from None
    return d


def clear_part(root: str) -> None:
    try:
        os.unlink(os.path.join(root, PART))
    except OSError:
        pass
