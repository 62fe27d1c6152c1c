"""Which layers a checkpoint persists, and why.

A layer is written when this is the first save, a base (full) checkpoint is due,
its drift reached ``threshold``, or skipping it would let it lag more than
``max_staleness`` checkpoints.  Frozen layers (no parameter requires grad) are
written once and then only if they change.  With ``budget_bytes`` the drifted
layers are taken most-drifted first until the budget is spent; the forced ones
always go.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

FIRST, BASE, DRIFT, STALE, CHANGED = "first", "base", "drift", "stale", "frozen-changed"
SKIP_DRIFT, SKIP_FROZEN, SKIP_BUDGET = "below-threshold", "frozen", "over-budget"


@dataclass
class LayerState:
    drift: float
    age: int  # checkpoints since this layer was persisted (before this one)
    nbytes: int
    frozen: bool


def decide(layers: Dict[str, LayerState], *, first: bool, base_due: bool, threshold: float, max_staleness: int,
           budget_bytes: Optional[int] = None) -> Dict[str, str]:
    """layer -> reason; reasons in WRITE are persisted now."""
    if first or base_due:
        why = FIRST if first else BASE
        return {name: why for name in layers}
    out: Dict[str, str] = {}
    wanted = []
    for name, s in layers.items():
        if s.frozen:
            out[name] = CHANGED if s.drift > 0 else SKIP_FROZEN
        elif s.age + 1 > max_staleness:
            out[name] = STALE
        elif s.drift >= threshold:
            wanted.append(name)
        else:
            out[name] = SKIP_DRIFT
    if budget_bytes is not None:
        spent = sum(layers[n].nbytes for n, why in out.items() if why in WRITE)
        for name in sorted(wanted, key=lambda n: -layers[n].drift):
            if spent + layers[name].nbytes <= budget_bytes:
                out[name] = DRIFT
                spent += layers[name].nbytes
            else:
                out[name] = SKIP_BUDGET
    else:
        out.update({n: DRIFT for n in wanted})
    return out


WRITE = frozenset({FIRST, BASE, DRIFT, STALE, CHANGED})
