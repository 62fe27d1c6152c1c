"""What one save cost and wrote, as the flat ``{name: float}`` metrics every framework's loggers take.

The adapters log them once a save has committed (its bytes and flush rate are known only then) and
never wait for that: :class:`SaveMetrics` keeps the saves not logged yet and hands back, at each call
of :meth:`SaveMetrics.finished`, those that are done.  The names are the Lightning callback's, so a
dashboard reads the same keys from every adapter.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Union

from .write._flush import PendingSave

PREFIX = "layerckpt/"


def save_metrics(p: PendingSave) -> Dict[str, float]:
    """The metrics of one committed save ``p``: bytes written (every rank's), layers persisted, what
    training paid (``save()``'s return plus the next step's wait for the copies, and each part), the
    bytes written over the time from ``save()`` to the commit in GB/s (planning, staging, checksums and the
    commit included: not the disk's rate) and the composite's oldest layer in checkpoints."""
    return {
        PREFIX + "bytes_written": float(p.bytes_all_ranks or p.bytes_written),
        PREFIX + "layers_persisted": float(p.layers_persisted),
        PREFIX + "stall_ms": p.blocked_s * 1e3,
        PREFIX + "save_return_ms": p.stall_s * 1e3,
        PREFIX + "step_wait_ms": p.step_wait_s * 1e3,
        PREFIX + "flush_gbps": p.flush_gbps,
        PREFIX + "max_staleness": float(p.max_staleness),
    }


def merged_metrics(saves: List[PendingSave]) -> Dict[str, float]:
    """The metrics of saves made together (one per model of one ``save_state``): bytes and layers
    summed, training's wait summed (the saves run one after the other), the flush rate over all the
    bytes, the oldest layer of any."""
    if len(saves) == 1:
        return save_metrics(saves[0])
    each = [save_metrics(p) for p in saves]
    out = {k: sum(m[k] for m in each) for k in each[0]}
    out[PREFIX + "max_staleness"] = max(m[PREFIX + "max_staleness"] for m in each)
    seconds = max(p.durable_s for p in saves)
    out[PREFIX + "flush_gbps"] = sum(p.bytes_written for p in saves) / seconds / 1e9 if seconds else 0.0
    return out


class SaveMetrics:
    """The saves whose metrics are not logged yet, in the order made."""

    def __init__(self) -> None:
        self._unlogged: List[Tuple[int, List[PendingSave]]] = []

    def add(self, saves: Union[PendingSave, Iterable[PendingSave]], step: Optional[int] = None) -> None:
        """One save just made, or saves made together (one per model of one ``save_state``): logged as one,
        at ``step`` (the training step it was made at; by default the save's own step)."""
        group = [saves] if isinstance(saves, PendingSave) else list(saves)
        if group:
            self._unlogged.append((group[0].step if step is None else step, group))

    def finished(self) -> List[Tuple[int, Dict[str, float]]]:
        """``(step, metrics)`` of every save (or group) that committed since the last call, oldest first; one
        that failed or was dropped is forgotten (its error reaches the caller through ``wait()``), one still
        flushing is kept for a later call.  Never blocks."""
        done = [(s, g) for s, g in self._unlogged if all(p.done() for p in g)]
        self._unlogged = [(s, g) for s, g in self._unlogged if not all(p.done() for p in g)]
        return [(s, merged_metrics(g)) for s, g in done if all(p.error is None and not p.cancelled for p in g)]

    def __len__(self) -> int:
        return len(self._unlogged)
