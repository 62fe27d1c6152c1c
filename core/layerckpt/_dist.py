"""The one place that talks to torch.distributed; world size 1 when it is not initialised."""
from __future__ import annotations

import datetime
import json
import logging
from typing import Any, List

import torch.distributed as _dist

log = logging.getLogger("layerckpt")


def initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def rank() -> int:
    return _dist.get_rank() if initialized() else 0


def world_size() -> int:
    return _dist.get_world_size() if initialized() else 1


class Group:
    """A gloo group of its own for checkpoint coordination, so the flusher thread's collectives never
    interleave with the training's.  Every rank must create it (with its Checkpointer) in the same order."""

    def __init__(self, timeout_s: float = 1800.0, enabled: bool = True):
        self.rank = rank() if enabled else 0
        self.world = world_size() if enabled else 1
        self._pg = None
        if self.world > 1:
            self._pg = _dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

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

    def barrier(self) -> None:
        if self._pg is not None:
            _dist.barrier(group=self._pg)

    def exchange(self, obj: Any) -> List[Any]:
        """Every rank's JSON-able ``obj``, in rank order (sent as JSON text: nothing is unpickled as code)."""
        if self._pg is None:
            return [obj]
        out: List[Any] = [None] * self.world
        _dist.all_gather_object(out, json.dumps(obj), group=self._pg)
        return [json.loads(s) for s in out]
