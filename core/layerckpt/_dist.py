"""The one place that talks to torch.distributed; world size 1 when it is not initialised.

And where each rank's store is (:func:`place`): Where each rank's store is: its node, and which ranks see the same checkpoint directory.

Every rank passes the same ``dirpath``.  Ranks whose ``dirpath`` is one directory
(a shared file system, or one machine) share one store, owned by the lowest of them;
ranks on different nodes with node-local disks have one store per node.  Which it is
is found out, not configured: each rank drops a probe file in its directory and
looks for the others' (:func:`place`).  One store for all ranks is the single
directory of before, unchanged.  Several stores are *parts*: each holds the files
its ranks write and every committed manifest (``part.json`` says whose part it is),
and reads of them are collective (``read/_parts``).

A rank's node is named by ``LAYERCKPT_NODE``, else the launcher's node rank (torchrun's
``GROUP_RANK``, Lightning's ``NODE_RANK``), else the host name: two torchrun node
launchers on one host are two nodes.
"""
from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch
import torch.distributed as _dist

from .errors import CheckpointError

log = logging.getLogger("layerckpt")

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for a gloo process group
_formed = itertools.count()  # checkpoint groups formed: every rank forms them in the same order


def initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def rank() -> int:
    return _dist.get_rank() if initialized() else 0


def world_size() -> int:
    return _dist.get_world_size() if initialized() else 1


def training_timeout_s() -> float:
    """The timeout of the training's default process group (``init_process_group(timeout=...)``), or torch's
    default where it cannot be read."""
    from torch.distributed import distributed_c10d as c10d

    for device in ("cpu", "cuda"):
        try:
            return c10d._get_default_group()._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no such backend on this group, or a torch that keeps it elsewhere
            continue
    return DEFAULT_TIMEOUT_S


class Group:
    """A gloo group of its own for checkpoint coordination, so the flusher thread's collectives never
    interleave with the training's.  Every rank must create it (with its Checkpointer) in the same order.

    Its timeout is the training's own (:func:`training_timeout_s`): where a rank died before the group formed,
    the others give up when the training's collectives would, not half an hour later.  Ranks agree on a save
    once every rank's data is durable, so that timeout also bounds how much later one rank's flush may end
    than another's.

    A collective that fails (a peer died, or stayed away past the timeout) raises a CheckpointError naming
    the ranks that had not reached it: before each one, every rank records in the rendezvous store how many
    collectives of this group it has begun (gloo's own error names a socket, and often a live peer that
    merely gave up first)."""

    def __init__(self, timeout_s: Optional[float] = None, enabled: bool = True, ranks: Optional[List[int]] = None):
        self.rank = rank() if enabled else 0
        self.world = world_size() if enabled else 1
        #: the global ranks of its members (``ranks``: a group of some ranks only; every rank forms it all the
        #: same, and ``rank`` is then this process's place among them, -1 outside it)
        self.members = list(range(self.world)) if ranks is None else list(ranks)
        self._pg = None
        self._begun = 0  # collectives begun on this group (its forming included): the same count on every rank
        self._roll = None  # where each rank records how many it has begun
        if self.world > 1:
            timeout_s = training_timeout_s() if timeout_s is None else timeout_s
            n = next(_formed)
            me = self.rank
            if ranks is not None:
                self.rank = self.members.index(me) if me in self.members else -1
                self.world = len(self.members)
            pg = _dist.new_group(ranks=None if ranks is None else self.members, backend="gloo",
                                 timeout=datetime.timedelta(seconds=timeout_s)) if ranks is not None else None
            if ranks is None:
                self._roll = _roll(n)
                self._pg = self._collective("forming the checkpoint's process group", lambda: _dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
            elif self.rank >= 0 and self.world > 1:
                self._roll = _roll(n)
                self._pg = pg

    @property
    def pg(self) -> Any:
        """The gloo process group (None alone, or outside a group of some ranks)."""
        return self._pg

    def close(self) -> None:
        """Destroy the group, once its Checkpointer's collectives are over (they all complete before its
        flusher stops).  Nothing of layerckpt then holds a process group past ``close()``: a group still
        referenced when the interpreter exits is torn down while Python finalizes, where gloo's threads
        releasing their last work can abort the process ("terminate called without an active exception")."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        from torch.distributed import distributed_c10d as c10d

        try:
            if initialized() and pg in c10d._world.pg_map:  # not already gone with destroy_process_group()
                _dist.destroy_process_group(pg)
        except Exception as e:  # noqa: BLE001 - a peer gone at exit must not turn close() into an error
            log.warning("layerckpt: its process group could not be destroyed cleanly: %s", e)

    def barrier(self, what: str = "a checkpoint barrier") -> None:
        if self._pg is not None:
            self._collective(what, lambda: _dist.barrier(group=self._pg))

    def exchange(self, obj: Any, what: str = "a checkpoint exchange") -> List[Any]:
        """Every rank's JSON-able ``obj``, in rank order (sent as JSON text: nothing is unpickled as code).
        ``what``: the exchange, as an error names it."""
        if self._pg is None:
            return [obj]
        out: List[Any] = [None] * self.world
        text = json.dumps(obj)
        self._collective(what, lambda: _dist.all_gather_object(out, text, group=self._pg))
        return [json.loads(s) for s in out]

    def broadcast(self, obj: Any, what: str = "a checkpoint broadcast") -> Any:
        """The first member's JSON-able ``obj``, on every rank (sent as JSON text: nothing is unpickled as code)."""
        if self._pg is None:
            return obj
        box = [json.dumps(obj) if self.rank == 0 else None]
        self._collective(what, lambda: _dist.broadcast_object_list(box, src=self.members[0], group=self._pg))
        return json.loads(box[0])

    def _collective(self, what: str, run: Callable[[], T]) -> T:
        self._begun += 1
        try:
            if self._roll is not None:
                self._roll.set(str(self.members[self.rank]), str(self._begun))
            return run()
        except Exception as e:  # noqa: BLE001 - gloo's errors (RuntimeError, DistError) name no rank
            raise self._failed(what, e) from e

    def _failed(self, what: str, e: BaseException) -> CheckpointError:
        """The error of a failed collective: the ranks that had not begun it, as the rendezvous store says."""
        cause = str(e).split("\n", 1)[0]
        fix = "restart the job; restore() picks the newest committed checkpoint"
        if self._roll is None:
            return CheckpointError(f"layerckpt: rank {rank()}: {what} failed (a peer rank is gone or stuck); "
                                   f"{fix} [{type(e).__name__}: {cause}]")
        try:
            absent = [r for r in self.members if r != self.members[self.rank] and self._reached(r) < self._begun]
        except Exception as store_error:  # noqa: BLE001 - its host (often rank 0's process) is gone too
            return CheckpointError(
                f"layerckpt: rank {rank()}: {what} failed, and the rendezvous store does not answer either "
                f"({str(store_error).splitlines()[0] if str(store_error) else type(store_error).__name__}): the "
                f"process hosting it (rank 0's, unless a launcher hosts it) is likely the one gone; {fix} "
                f"[{type(e).__name__}: {cause}]")
        if absent:
            who = f"rank {absent[0]}" if len(absent) == 1 else "ranks " + ", ".join(map(str, absent))
            return CheckpointError(
                f"layerckpt: rank {rank()}: {what} failed: {who} had not reached it (dead, or not there yet); "
                f"{fix} [{type(e).__name__}: {cause}]")
        return CheckpointError(
            f"layerckpt: rank {rank()}: {what} failed: every rank had reached it, so a rank died inside it; "
            f"{fix} [{type(e).__name__}: {cause}]")

    def _reached(self, r: int) -> int:
        key = str(r)
        return int(self._roll.get(key)) if self._roll.check([key]) else 0


def _roll(n: int) -> Optional[Any]:
    """The keys of the ``n``-th checkpoint group in the training's rendezvous store (none without one)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return _dist.PrefixStore(f"layerckpt/group{n}/begun", c10d._get_default_store())
    except Exception:  # noqa: BLE001 - initialised without a store (MPI): gloo's error alone then
        return None


# ------------------------------------------------------------------ where each rank's store is

NODE_ENV = "LAYERCKPT_NODE"
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
