"""The one place that talks to torch.distributed; world size 1 when it is not initialised."""
from __future__ import annotations

from typing import Any, List

import torch.distributed as _dist


def initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def rank() -> int:
    return _dist.get_rank() if initialized() else 0


def world_size() -> int:
    return _dist.get_world_size() if initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        _dist.barrier()


def all_gather_object(obj: Any) -> List[Any]:
    if world_size() == 1:
        return [obj]
    out: List[Any] = [None] * world_size()
    _dist.all_gather_object(out, obj)
    return out
