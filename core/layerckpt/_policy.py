"""Policy: which layers a checkpoint persists, and why.  Pure: no tensors, no I/O.

Always written: every layer at the first save and when a base (full) checkpoint
is due; a frozen layer only when it changed; any other layer when skipping it
would let it lag more than ``max_staleness`` checkpoints, unless not one of its
sampled elements moved since it was persisted (its persisted version is current).

The rest is chosen by one of two rules:

- **fidelity budget** (the default, ``threshold=None``): skip layers, the least
  first-order cost per byte first, while the summed cost of everything the
  composite then holds stale stays within an allowance; persist the rest.  The
  cost (see ``_track``) is the first-order loss increase of restoring a layer's
  persisted version, so the allowance is ``fidelity`` x the training loss when
  the caller passes it (``save(step, loss=...)``; the adapters do): a restore is
  estimated to raise the loss by at most that fraction.  Without a loss the
  allowance is ``NO_LOSS_INTERVALS`` x the model's own first-order progress over
  the last checkpoint interval, a conservative stand-in.  Neither depends on the
  learning rate, the model's size or the run's length.
- **drift threshold** (``threshold=x``): a layer whose relative drift
  ||W - W_p|| / ||W_p|| reached ``x``.

With ``budget_bytes`` the chosen layers go most valuable first until the bytes
are spent; the forced ones always go.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

FIRST, BASE, COST, DRIFT, STALE, CHANGED = "first", "base", "cost", "drift", "stale", "frozen-changed"
SKIP_BUDGET, SKIP_DRIFT, SKIP_FROZEN, SKIP_BYTES = "within-budget", "below-threshold", "frozen", "over-budget"
UNCHANGED = "unchanged"  # not one sampled element moved since it was persisted: not stale, however old
WRITE = frozenset({FIRST, BASE, COST, DRIFT, STALE, CHANGED})
NO_LOSS_INTERVALS = 0.25  # without a loss: the composite may give up this much of one interval's progress


@dataclass
class LayerState:
    drift: float  # relative drift since persisted; 0.0 unchanged, inf unknown
    age: int  # checkpoints since this layer was persisted (before this one)
    nbytes: int
    frozen: bool
    cost: float = math.inf  # first-order loss given up by keeping the persisted version; inf unknown
    progress: float = 0.0  # this layer's first-order progress over the last interval


def decide(layers: Dict[str, LayerState], *, first: bool, base_due: bool, max_staleness: int,
           threshold: Optional[float] = None, fidelity: float = 0.0, loss: Optional[float] = None,
           budget_bytes: Optional[int] = None) -> Dict[str, str]:
    """layer -> reason; reasons in WRITE are persisted now."""
    if first or base_due:
        why = FIRST if first else BASE
        return {name: why for name in layers}
    out: Dict[str, str] = {}
    open_: List[str] = []
    for name, s in layers.items():
        if s.frozen:
            out[name] = CHANGED if s.drift > 0 else SKIP_FROZEN
        elif s.drift == 0.0:  # e.g. a block of embedding rows no batch touched
            out[name] = UNCHANGED
        elif s.age + 1 > max_staleness:
            out[name] = STALE
        else:
            open_.append(name)
    if threshold is not None:
        wanted = [n for n in open_ if layers[n].drift >= threshold]
        out.update({n: SKIP_DRIFT for n in open_ if n not in wanted})
        value = {n: layers[n].drift for n in wanted}
        why = DRIFT
    else:
        wanted = _over_budget(layers, open_, allowance(layers, fidelity, loss))
        out.update({n: SKIP_BUDGET for n in open_ if n not in wanted})
        value = {n: layers[n].cost / max(layers[n].nbytes, 1) for n in wanted}
        why = COST
    if budget_bytes is None:
        out.update({n: why for n in wanted})
        return out
    spent = sum(layers[n].nbytes for n, w in out.items() if w in WRITE)
    for name in sorted(wanted, key=lambda n: -value[n]):
        if spent + layers[name].nbytes <= budget_bytes:
            out[name] = why
            spent += layers[name].nbytes
        else:
            out[name] = SKIP_BYTES
    return out


def allowance(layers: Dict[str, LayerState], fidelity: float, loss: Optional[float]) -> float:
    """How much first-order loss the composite may give up."""
    if loss is not None:
        return fidelity * abs(loss)
    return NO_LOSS_INTERVALS * sum(s.progress for s in layers.values() if not s.frozen)


def _over_budget(layers: Dict[str, LayerState], names: List[str], allowance: float) -> List[str]:
    """The layers that do not fit in the allowance, taking the cheapest per byte into it first."""
    spent = 0.0
    wanted = []
    for name in sorted(names, key=lambda n: (layers[n].cost / max(layers[n].nbytes, 1), n)):
        c = layers[name].cost
        if math.isfinite(c) and spent + c <= allowance:
            spent += c
        else:
            wanted.append(name)
    return wanted


def composite_cost(layers: Dict[str, LayerState], persisted) -> float:
    """The composite's estimated fidelity cost: what every layer it leaves stale gives up."""
    return sum(s.cost for n, s in layers.items() if n not in persisted and not s.frozen and math.isfinite(s.cost))
