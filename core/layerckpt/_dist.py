"""The one place that talks to torch.distributed; world size 1 when it is not initialised."""
from __future__ import annotations

import datetime
import itertools
import json
import logging
from typing import Any, Callable, List, Optional, TypeVar

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
