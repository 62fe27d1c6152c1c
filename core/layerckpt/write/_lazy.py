"""Lazy staging: a save's parameters and optimizer state are copied into the pool on the stager thread while
the training goes on, and the optimizer's next step waits for those copies (``Config.lazy_staging``).

What may change before that step (buffers, which forward passes update; RNG; extra) is copied at once; a tensor
copied late that changed meanwhile, other than through ``optimizer.step()``, fails its save instead of committing
torn bytes.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Dict, Optional

import torch

from ..errors import CheckpointError
from ..format._codec import Entries
from ..format._manifest import MODEL, OPTIM
from ._flush import FlushJob
from ._stage import ABORT, BufferPool, LazyStager, caller_events, stage


def split_later(entries: Entries, model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """Replace in ``entries`` what may change before the next optimizer step (buffers, which forward passes
    update; RNG; extra) by copies, taken now; returns the tensors left to be copied later (parameters, optimizer
    state) by key, or None (copy everything now) where one of them has no version counter to tell whether it
    changed meanwhile."""
    params = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params.add(local.untyped_storage().data_ptr())
    later: Dict[str, torch.Tensor] = {}
    for k, t in entries:
        if k.startswith(OPTIM) or (k.startswith(MODEL) and t.untyped_storage().data_ptr() in params):
            later[k] = t
    try:
        for t in later.values():
            t._version
    except RuntimeError:  # an inference tensor
        return None
    for i, (k, t) in enumerate(entries):
        if k not in later:
            entries[i] = (k, t.clone())
    return later


def start_copy(job: FlushJob, pool: BufferPool, stager: LazyStager, later: Optional[Dict[str, torch.Tensor]],
               step: int) -> None:
    """Copy ``job``'s bytes into the pool: on the stager thread where ``later`` names what is copied late (lazy
    staging), else now, on the caller's thread."""
    verify = _unchanged_since(job.layout, later, step) if later else None
    after = caller_events(job.layout) if later and torch.cuda.is_available() else None
    copy = functools.partial(_copy, job, pool, verify, after, bool(later))
    if later:
        stager.start(functools.partial(_quietly, copy), waited=job.pending._add_step_wait)
    else:
        copy()


def _unchanged_since(layout, later: Dict[str, torch.Tensor], step: int) -> Callable[[], None]:
    """After the copies: fail the save if a tensor copied late changed since save() (its version counter
    moved), which only happens outside ``optimizer.step()`` (that waits for the copies)."""
    seen = [(it.key, it.tensor, it.tensor._version) for it in layout.items if it.key in later]

    def verify() -> None:
        moved = [k for k, t, v in seen if t._version != v]
        if moved:
            raise CheckpointError(
                f"the checkpoint of step {step} was not committed: {len(moved)} tensor(s) changed while being "
                f"copied in the background ({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}), by "
                f"something other than optimizer.step(), which waits for the copies; change the weights only "
                f"through the optimizer's step, or set Config(lazy_staging=False)")

    return verify


def _copy(job: FlushJob, pool: BufferPool, verify: Optional[Callable[[], None]], after: Any, lazy: bool) -> None:
    """Stage ``job``'s bytes into the pool's chunks, handed to the flusher as they fill."""
    t = time.perf_counter()

    def copied() -> None:  # every byte is in the buffers; the flusher may commit once this returns
        job.pending.phases["stage"] = time.perf_counter() - t
        if verify is not None:
            verify()

    try:
        stage(job.layout, pool, job.chunks, job.staged, copied, job.crcs if lazy else None, after)
    except BaseException as e:
        job.abort_error = e if lazy else None
        job.chunks.put(ABORT)
        raise


def _quietly(fn: Callable[[], None]) -> None:
    """On the stager thread: a failure is already with the flusher (ABORT), which reports it."""
    try:
        fn()
    except BaseException:  # noqa: BLE001
        pass
