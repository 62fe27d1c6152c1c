"""Where a killed and restarted job's wall time went, from its attempts' progress files (``bench --goodput``).

The wall time runs from the first process's spawn to the last step's end.  Every second of it falls in one
bucket, so the buckets sum to it:

* ``compute``: the steps' productive work, steps x the median step of a failure-free run without checkpoints;
* ``checkpoint``: what each step took beyond that median (a blocking save, a step slowed by a save behind it);
* ``imports``, ``setup``, ``load``: a process's spawn to its imports done, to model, optimizer and
  checkpointer (or Trainer) built, to the restore done (for a first process: nothing found);
* ``warmup``: the first step of each process beyond the median (a new process's allocations, cold caches);
* ``redone``: the median step for every step done again after a restart, and the work in flight at a kill;
* ``restart``: from a kill to the next spawn (the supervisor reaps the process, wipes the node's stores).

A process that got a notice (the preempt kind: the attempt holds ``notice``) ends with its exit or the SIGKILL
after the grace.  From its last step to that end it saved that step, where the next process resumed from it:
that time is ``checkpoint`` (the save on the notice, its wait and the exit; counted as a save where the process
recorded none at that step), else ``redone`` as at a kill.  ``redone_steps`` counts the steps done again.

``restore`` is imports + setup + load + warmup: a process's spawn to its first step done.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional

PARTS = ("compute", "checkpoint", "imports", "setup", "load", "warmup", "redone", "restart")
RESTORE = ("imports", "setup", "load", "warmup")


def read_progress(path: str) -> List[Dict[str, Any]]:
    """The events a process wrote; a line cut short by the kill is dropped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break
    except FileNotFoundError:
        pass
    return out


TAIL = 10  # the last steps whose mean loss compares the runs (one batch's loss is as noisy as the batch)


def tail_loss(losses: Dict[int, float], steps: int) -> Optional[float]:
    """The mean loss of the job's last :data:`TAIL` steps on the path that reached the end (each step's batch is the
    same in every run: a paired comparison); None where one is missing."""
    tail = [losses.get(s) for s in range(max(1, steps - TAIL + 1), steps + 1)]
    return None if any(x is None for x in tail) else sum(tail) / len(tail)


def account(attempts: List[Dict[str, Any]], steps: int, base_s: float) -> Dict[str, Any]:
    """Buckets and counts of one contender's attempts, each ``{"spawned": t, "killed": t or None, "events": [...]}``
    in order, the last one reaching ``steps``; ``base_s`` is the failure-free median step."""
    b = dict.fromkeys(PARTS, 0.0)
    done: set = set()
    executed = saves = 0
    final_loss: Optional[float] = None
    losses: Dict[int, float] = {}  # step -> its loss on the path that reached the end (a redone step's last)
    first_start: Optional[float] = None
    prev_end: Optional[float] = None
    for i, a in enumerate(attempts):
        ev = a["events"]
        end = a["killed"]
        if end is None:  # the last process: its run ends with the last step
            end = next(e["t"] for e in ev if e["e"] == "step" and e["s"] == steps)
        if prev_end is not None:
            b["restart"] += a["spawned"] - prev_end
        t = a["spawned"]
        for part, kind in (("imports", "imports"), ("setup", "setup"), ("load", "restored")):
            mark = next((e["t"] for e in ev if e["e"] == kind), end)
            b[part] += min(mark, end) - t
            t = min(mark, end)
        first, last = True, None
        for e in ev:
            if e["t"] > end:
                break
            if e["e"] == "save":
                saves += 1
            if e["e"] != "step":
                continue
            executed += 1
            b["compute" if e["s"] not in done else "redone"] += base_s
            b["warmup" if first else "checkpoint"] += (e["t"] - t) - base_s
            done.add(e["s"])
            losses[e["s"]] = e["loss"]
            first, t, last = False, e["t"], e["s"]
            if e["s"] == steps:
                final_loss = e["loss"]
        if a["killed"] is not None and any(e["e"] == "restored" for e in ev):
            kept = a.get("notice") is not None and last is not None and _resumed(attempts[i + 1:]) == last
            b["checkpoint" if kept else "redone"] += end - t  # the step (or save) in flight at the kill
            if kept and not any(e["e"] == "save" and e["s"] == last and e["t"] <= end for e in ev):
                saves += 1  # saved on the notice by a process that does not say so (layerckpt's ck.preempted)
        if prev_end is None and not first:  # the first process reached a step: its start, whole
            first_start = sum(b[p] for p in RESTORE)
        prev_end = end
    wall = prev_end - attempts[0]["spawned"]
    return {"buckets": b, "wall_s": wall, "steps_done": len(done), "executed": executed, "saves": saves,
            "redone_steps": executed - len(done), "notices": sum(a.get("notice") is not None for a in attempts),
            "final_loss": final_loss, "tail_loss": tail_loss(losses, steps), "first_start_s": first_start,
            "kills": sum(a["killed"] is not None for a in attempts),
            "resumed_at": [next((e["step"] for e in a["events"] if e["e"] == "restored"), None) for a in attempts]}


def _resumed(later: List[Dict[str, Any]]) -> Optional[int]:
    """The step the first of ``later`` attempts that restored resumed at."""
    return next((e["step"] for a in later for e in a["events"] if e["e"] == "restored"), None)


def _noise(free: Dict[str, Any]) -> float:
    """The failure-free run's excess per step over its own median (its steps' skew, no save in it)."""
    return free["buckets"]["checkpoint"] / max(1, free["executed"] - 1)


def _steady(run: Dict[str, Any]) -> int:
    """A run's steps other than each process's first (those are its warm-up)."""
    return run["executed"] - len([s for s in run["resumed_at"] if s is not None])


def figures(run: Dict[str, Any], free: Dict[str, Any], mtbf: float) -> None:
    """Add to ``run`` (an :func:`account` result) what it lost and the optimum its own costs allow, against
    ``free``, the failure-free run without checkpoints of the same loop:

    * ``goodput``: compute / wall;
    * ``lost_s``: the wall time beyond the failure-free run's, less every process's imports and the restarts
      (checkpoints, setups and loads, warm-ups, redone work);
    * ``save_cost_s`` (C): the checkpoint bucket beyond the failure-free run's per-step noise, per save;
    * ``restart_cost_s`` (R): per kill, the restarts and every start after the first (imports, setup, load,
      warm-up; a start cut short by a kill included);
    * ``young_daly_s``: sqrt(2 x C x MTBF), the interval that loses least, and in steps;
    * ``optimum``: the goodput at that interval with the same kills: compute / (first start + compute + noise +
      saves at every interval x C + kills x (R + half an interval)).

    A C below zero is the run's steps having gone faster than the failure-free run's by chance (a save cannot
    speed training up): it is noise, and no Young/Daly interval or optimum is computed from it (None).
    """
    b, fb = run["buckets"], free["buckets"]
    base = fb["compute"] / free["steps_done"]
    run["goodput"] = b["compute"] / run["wall_s"]
    kept = lambda r: r["wall_s"] - r["buckets"]["imports"] - r["buckets"]["restart"]  # noqa: E731
    run["lost_s"] = kept(run) - kept(free)
    noise = _noise(free)
    cost = (b["checkpoint"] - noise * _steady(run)) / run["saves"] if run["saves"] else None
    run["save_cost_s"] = cost
    first = run["first_start_s"] if run["first_start_s"] is not None else sum(fb[p] for p in RESTORE)
    again = b["restart"] + sum(b[p] for p in RESTORE) - first
    run["restart_cost_s"] = again / run["kills"] if run["kills"] else None
    if cost is None or cost < 0:
        run["young_daly_s"] = run["young_daly_steps"] = run["optimum"] = None
        return
    c = max(cost, 1e-4)
    t = min(math.sqrt(2 * c * mtbf), b["compute"])
    saves = math.floor(b["compute"] / t)
    wall = first + b["compute"] + noise * run["steps_done"] + saves * c + again + run["kills"] * t / 2
    run["young_daly_s"], run["young_daly_steps"] = t, t / base
    run["optimum"] = b["compute"] / wall


def step_spread(rows: List[Dict[str, Any]], free: Dict[str, Any]) -> float:
    """The steps' spread between runs of one loop, s a step: the most that one of ``rows`` (runs of that loop,
    each a repeat of the same steps) stepped faster on average than ``free``, the failure-free run, once its
    saves' cost is taken out: ``-C x saves / steady steps`` where C is below zero.  A save cannot make a step
    faster, so that much of a run's speed is chance, and the same chance moves every row's C and lost time.
    A lower bound of the spread (what the repeats showed); 0.0 where no run stepped faster."""
    noise = _noise(free)
    fast = [-(r["buckets"]["checkpoint"] - noise * _steady(r)) / _steady(r)
            for r in rows if not r.get("failed") and _steady(r) > 0]
    return max([0.0] + fast)


def save_noise_s(run: Dict[str, Any], spread: float) -> Optional[float]:
    """How far :func:`step_spread` moves one run's C: the spread over its steady steps, per save."""
    return spread * _steady(run) / run["saves"] if run.get("saves") else None


def within_noise(run: Dict[str, Any]) -> bool:
    """A run whose measured save cost C is below zero: noise, with no optimum (a JSON of before this rule
    still holds one computed from C clamped to zero; it is not shown)."""
    return run.get("save_cost_s") is not None and run["save_cost_s"] < 0


def optimum(run: Dict[str, Any]) -> Optional[float]:
    """The run's optimum goodput, None where C was not measured or is within noise."""
    return None if within_noise(run) else run.get("optimum")
