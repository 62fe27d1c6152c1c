"""Steps of training lost per crash: selective composites beside full checkpoints taken less often.

One unit for both.  A full checkpoint restores bit for bit, so a crash loses the steps since it was
taken.  A selective composite loses those too, plus its *lag*: the steps the resumed run needs to
catch up with the run that never stopped.

The lag is measured on a fixed held-out set (16 batches no training step sees): the restored
composite's held-out loss is placed on the uninterrupted run's held-out curve, recorded at the start
and at every save (linear in between: a forward pass over the set costs up to 10 training steps).  Its excess over the curve at the composite's own step (exactly 0 for a bit-exact restore) is
turned into steps with a monotone (isotonic, non-increasing) fit of the curve: the lag is how far
back the fit had to go to be that much higher.  An excess within the curve's own scatter around
that fit counts 0: on a plateau (the embedding workload after its first 40 steps) the run makes no
held-out progress, and a 3e-5 excess against 1e-3 of scatter would otherwise land anywhere on it.

Why this and not the shift that best aligns the resumed run's training-loss curve with the
uninterrupted one: the training loss moves batch by batch by far more than a stale layer costs (the
0.1-0.3% the family's restores show), so the best shift is mostly noise, and it needs training after
every restore.  The held-out placement needs one evaluation per crash point (many crash points are
cheap), is 0 for an exact restore by construction, and was stable when measured: two disjoint
held-out sets of 16 batches gave per-crash lags within 0.5 step of each other on finetune-3e-5 and
classify-1e-5 (means 2.1 and 2.2; 1.8 and 1.8 steps); with 4 batches classify-1e-5 moved by up to 8.

Crash points are spread over the run at (i + 1/2) / n of its steps; the arithmetic here is pure
(numbers in, numbers out) and :mod:`layerckpt.bench.policy` feeds it from real runs.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

N_CRASHES = 8
INTERVALS = (1, 2, 4, 8)  # full checkpoints every k checkpoint intervals: the measured frontier


def crash_points(steps: int, n: int = N_CRASHES) -> List[int]:
    """``n`` crash steps spread over a run of ``steps`` (the steps trained when it stops), none at 0."""
    return sorted({max(1, int((i + 0.5) * steps / n)) for i in range(n)})


def steps_since(crash: int, saves: Iterable[int]) -> int:
    """Steps a crash at ``crash`` trains again from the newest save at or before it (all of them if none)."""
    return crash - max((s for s in saves if s <= crash), default=0)


def mean_steps_since(crashes: Sequence[int], saves: Sequence[int]) -> float:
    return sum(steps_since(c, saves) for c in crashes) / len(crashes)


def isotonic_decreasing(ys: Sequence[float]) -> List[float]:
    """The least-squares non-increasing fit of ``ys`` (pool adjacent violators)."""
    blocks: List[List[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def scatter(curve: Sequence[float], fit: Sequence[float]) -> float:
    """How far the curve strays from its monotone fit (root mean square): its own step-to-step noise."""
    return math.sqrt(sum((c - f) ** 2 for c, f in zip(curve, fit)) / len(curve))


def lag_steps(curve: Sequence[float], step: int, loss: float, at: Optional[Sequence[int]] = None) -> float:
    """Steps a composite of ``step`` whose held-out loss is ``loss`` trails the uninterrupted run, whose
    held-out loss after ``at[i]`` steps (default: ``i``) is ``curve[i]`` (``step`` one of them): 0 when it is
    no worse than the run at ``step`` or worse by no more than the curve's own scatter around its isotonic
    fit (a plateau: no progress to lose), else the distance back to where that fit was higher by the same
    excess, linear between the curve's steps (at most ``step``)."""
    at = list(range(len(curve))) if at is None else list(at)
    i = at.index(step)
    excess = loss - curve[i]
    fit = isotonic_decreasing(curve)
    if excess <= 0 or excess <= scatter(curve, fit):
        return 0.0
    target = fit[i] + excess
    for j in range(i, 0, -1):  # fit[j] < target here; find the first earlier point at or above it
        if fit[j - 1] >= target:
            return step - (at[j] - (at[j] - at[j - 1]) * (target - fit[j]) / (fit[j - 1] - fit[j]))
    return float(step - at[0])


def frontier_at(points: Sequence[Tuple[float, float]], nbytes: float) -> float:
    """Steps lost by the frontier of ``(bytes, steps lost)`` points at ``nbytes``, interpolated linearly
    in log bytes.  Outside its range, the nearest end's value: above it, no full cadence beats the one
    that writes most; below it, the frontier would lose at least what its cheapest point loses."""
    pts = sorted((b, lost) for b, lost in points if b > 0)
    if not pts:
        raise ValueError("frontier_at: no point with bytes > 0 (every cadence wrote nothing)")
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, l0), (b1, l1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            t = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return l0 + t * (l1 - l0)
    return pts[-1][1]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n < 1e10 else f"{n / 1e9:.0f}G"


def _default_cell(d: Dict[str, Any]) -> str:
    if d.get("refused"):
        return f"{'REFUSED at ' + str(d['restored']):>24}"
    return f"{d['lost']:>6.1f} ({d['since']:.1f}+{d['lag']:.1f}) {d.get('estimated_lag', math.nan):>5.1f}"


def format_frontier(rows: List[Dict[str, Any]]) -> str:
    """One line per workload: the default's bytes (raw and written) and steps lost, the frontier's steps lost
    at the same written bytes, and each full cadence's (written bytes / steps lost)."""
    lines = ["steps lost per crash (mean over crash points at (i+1/2)/8 of the run; default = steps since its "
             "composite + the composite's held-out lag; full every k intervals: the steps since it)",
             f"{'workload':<17}{'raw':>9}{'written':>9}{'vs k1':>8}{'default lost (since+lag) est.lag':>33}"
             f"{'frontier@bytes':>15}  verdict   full every k: written / lost"]
    for r in rows:
        f = r.get("frontier")
        if not f:
            continue
        d = f["default"]
        cells = "  ".join(f"k{p['k']}{'~' if p.get('estimated') else ''} {_mb(p['bytes'])}/{p['lost']:.1f}"
                          for p in f["full"])
        name = r["workload"] + ("+lossy" if r.get("encoding") == "lossy" else "")
        lines.append(f"{name:<17}{_mb(d['raw']):>9}{_mb(d['bytes']):>9}{f['ratio']:>7.1f}x"
                     f"{_default_cell(d):>33}{f['frontier_lost']:>15.1f}  {'ok' if f['ok'] else 'MISSED':<8}  {cells}")
    lines.append("k~: beyond the measured cadences, estimated from every 8's bytes per save; est.lag: the lag the "
                 "composites' manifests estimate (first-order cost, in steps), beside the measured one")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str) -> Optional[str]:
    """The frontiers and the default's points, one panel per workload, into ``path``; None (nothing written)
    when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r.get("frontier")]
    cols = min(4, max(1, len(rows)))
    nrow = max(1, math.ceil(len(rows) / cols))
    fig, axes = plt.subplots(nrow, cols, figsize=(4 * cols, 3.2 * nrow), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        f = r["frontier"]
        ax.plot([p["bytes"] for p in f["full"]], [p["lost"] for p in f["full"]], "-", color="C0")
        measured = [p for p in f["full"] if not p.get("estimated")]
        guessed = [p for p in f["full"] if p.get("estimated")]
        ax.plot([p["bytes"] for p in measured], [p["lost"] for p in measured], "o", color="C0",
                label="full every k")
        if guessed:  # cadences never run: their bytes estimated from every 8's per save
            ax.plot([p["bytes"] for p in guessed], [p["lost"] for p in guessed], "o", mfc="none", color="C0",
                    label="full every k, estimated")
        for p in f["full"]:
            ax.annotate(f"k={p['k']}{'~' if p.get('estimated') else ''}", (p["bytes"], p["lost"]), fontsize=7)
        if not f["default"].get("refused"):
            ax.plot([f["default"]["bytes"]], [f["default"]["lost"]], "r*", ms=12, label="default")
        ax.set_xscale("log")
        ax.set_title(r["workload"], fontsize=9)
        ax.set_xlabel("bytes written")
        ax.set_ylabel("steps lost per crash")
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
