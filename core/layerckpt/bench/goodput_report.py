"""The table ``layerckpt bench --goodput`` prints, and its targets, from the bench's JSON (no measuring here)."""
from __future__ import annotations

import textwrap
from typing import Any, Dict, List, Optional

from .goodput_account import PARTS, TAIL, optimum, save_noise_s, step_spread, within_noise

# the issue's targets: layerckpt's lost time against the contenders' at their best cadence, its final loss
# against theirs, its goodput against the optimum its own measured costs allow
LOST_VS = {"plain": ("dcp.async_save", 1 / 2), "lightning": ("ModelCheckpoint", 1 / 3)}
#: where a failure kind's target differs: under a notice, LayerCheckpoint's lost time against ModelCheckpoint's
LOST_VS_KIND = {"preempt": {"lightning": ("ModelCheckpoint", 1 / 4)}}
LOSS_REL, OPTIMUM_POINTS = 0.005, 2.0
OURS = ("layerckpt", "LayerCheckpoint")
KINDS = {"crash": "SIGKILL; the local store and the memory tier survive",
         "node": "SIGKILL, then the local store and /dev/shm are deleted; layerckpt restores from its file:// remote",
         "preempt": "a notice, SIGTERM, then SIGKILL {grace:g} s later where the process is still there; a restart "
                    "once it is gone; the local store and the memory tier survive"}
#: how each contender handles the notice (the preempt kind)
NOTICES = ("layerckpt: Config(preemption=True, grace_s) and ck.preempted(step) after each step, exit 75; "
           "LayerCheckpoint: its default (SIGTERM), grace_s; ModelCheckpoint: Lightning's SIGTERM handling "
           "(SIGTERMException at the batch end) {soe}; torch.save and dcp.async_save: a handler "
           "written by hand (a flag set on SIGTERM, checked after each step: the step saved, the save waited for, "
           "exit 0)")
LOOPS = {"plain": "plain loop", "lightning": "Lightning Trainer"}


def _notices(res: Dict[str, Any]) -> str:
    """NOTICES for a run: ModelCheckpoint saved on the exception only where the run asked (runs that predate the
    choice always did)."""
    soe = res.get("save_on_exception", True)
    return NOTICES.format(soe="with save_on_exception=True" if soe else "at its default (no save on it)")
HEADS = {"checkpoint": "ckpt"}
RESTARTS = {"fresh": "restarts in a new interpreter",
            "standby": "restarts from a warm standby (layerckpt launch: a fork of a process that imported the job's "
                       "modules)"}


def _mode(r: Dict[str, Any]) -> str:
    return r.get("restarts", "fresh")  # a JSON of before the standby: new interpreters


def _state(res: Dict[str, Any]) -> str:
    return f"{res['params'] / 1e6:.1f}M parameters, {res['params'] * 12 / 1e6:.1f} MB with AdamW"


def _head(res: Dict[str, Any]) -> List[str]:
    m = res["machine"]
    times = ", ".join(f"{t:.1f}" for t in res.get("failure_times_s", []))
    lines = [f"layerckpt bench --goodput: {res['size']} ({_state(res)}), {res['steps']} steps of batch {res['batch']} "
             f"x {res['seq']} tokens, MTBF {res['mtbf_s']:g} s (seed {res['seed']}), on {m['cpu']} "
             f"({m['cores']} cores), torch {m['torch']}",
             "failure times, s since a contender's run began (the same for each; each sees those before its end): "
             + times,
             ("after each kill a new process starts at once" if res.get("restarts", ["fresh"]) == ["fresh"] else
              "after each kill the job starts again at once (" + "; ".join(RESTARTS[m] for m in res["restarts"])
              + ")") + " and resumes from what its checkpointing left; layerckpt: "
             "default Config + memory tier + file:// remote tier (a folder on the same disk); torch.save, "
             "dcp.async_save and ModelCheckpoint write straight into such a folder, so a node loss costs them no more "
             "than a crash (a real remote would slow their saves instead)"]
    for loop, f in res["free"].items():
        b = f["buckets"]
        lines.append(f"failure-free, no checkpoints, {LOOPS[loop]}: median step {f['base_step_s']:.3f} s, "
                     f"{res['steps']} steps in {f['wall_s']:.1f} s (imports {b['imports']:.1f} s, "
                     f"setup {b['setup']:.1f} s, first step {b['warmup'] + f['base_step_s']:.2f} s), "
                     f"goodput {f['goodput'] * 100:.1f}%")
    if "preempt" in res["runs"]:
        lines.append(f"preempt: the notice handled as each contender's users would: {_notices(res)}")
    lines += ["goodput: compute / wall; lost: wall beyond the failure-free run's, less imports and restarts "
              "(checkpoints, setups and loads, warm-ups, redone work); C: a save's cost to training (blocking and "
              "slower steps); ~0+-x: a C measured below zero, within the noise (x: the steps' spread between runs, "
              "per save at its cadence), no optimum computed from it; Y/D: the Young/Daly interval "
              "sqrt(2 x C x MTBF), s and steps; optimum: the goodput at that interval with the same kills and "
              "restarts; * the contender's best cadence (least lost)"]
    return lines


def _best(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """name and loop -> the row of that contender with the least lost time (over its cadences and mtbf=)."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in _ran(rows):
        key = f"{r['loop']}:{r['name']}" + ("" if _mode(r) == "fresh" else f":{_mode(r)}")
        if key not in out or r["lost_s"] < out[key]["lost_s"]:
            out[key] = r
    return out


def _ran(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows of runs that finished (a failed run's row has only what it was and why, ``failed``)."""
    return [r for r in rows if not r.get("failed")]


def _why(r: Dict[str, Any]) -> str:
    """A failed run's reason, its last line cut to fit a table."""
    last = r["failed"].strip().splitlines()[-1] if r["failed"].strip() else "?"
    return last if len(last) <= 150 else last[:75] + " ... " + last[-70:]


def _num(x: Optional[float], fmt: str, width: int) -> str:
    return (format(x, fmt) if x is not None else "-").rjust(width)


def _cost(r: Dict[str, Any], spread: float, fmt: str, width: int) -> str:
    """A row's C: as measured, or ``~0+-x`` where it is below zero (noise; x: the steps' spread per save)."""
    if within_noise(r):
        return f"~0+-{save_noise_s(r, spread):.1f}".rjust(width)
    return _num(r.get("save_cost_s"), fmt, width)


def _yd(r: Dict[str, Any], key: str) -> Optional[float]:
    return None if within_noise(r) else r.get(key)


def spreads(res: Dict[str, Any]) -> Dict[str, float]:
    """loop -> the steps' spread between its runs (every kind's; :func:`goodput_account.step_spread`)."""
    out = {}
    for loop, free in res["free"].items():
        rows = {id(r): r for rs in res["runs"].values() for r in rs if r["loop"] == loop}
        out[loop] = step_spread(list(rows.values()), free)
    return out


def _row(r: Dict[str, Any], best: bool, kind: str, spread: float) -> str:
    every = "mtbf" if r["mtbf"] else str(r["every"])
    if r.get("failed"):
        return f"  {r['name']:<16}{every:>6}  FAILED: {_why(r)}"
    b = r["buckets"]
    pct = lambda x: None if x is None else x * 100  # noqa: E731
    name = r["name"] + ("^" if r.get("ran_under", kind) != kind else "")
    return (f"{'*' if best else ' '} {name:<16}{every:>6}{_num(pct(r['goodput']), '.1f', 8)}"
            f"{_num(pct(optimum(r)), '.1f', 8)}{r['wall_s']:>8.1f}"
            + "".join(f"{b[p]:>8.1f}" for p in PARTS)
            + f"{r['lost_s']:>8.1f}{r['kills']:>6}{r['saves']:>6}{_cost(r, spread, '.3f', 9)}"
            f"{_num(_yd(r, 'young_daly_s'), '.1f', 7)}{_num(_yd(r, 'young_daly_steps'), '.0f', 6)}"
            f"{_num(r['final_loss'], '.4f', 9)}")


def format_table(res: Dict[str, Any]) -> str:
    lines = _head(res)
    cols = (f"  {'contender':<16}{'every':>6}{'goodput':>8}{'optimum':>8}{'wall s':>8}"
            + "".join(f"{HEADS.get(p, p):>8}" for p in PARTS)
            + f"{'lost s':>8}{'kills':>6}{'saves':>6}{'C s':>9}{'Y/D s':>7}{'Y/D n':>6}{'loss':>9}")
    spread = spreads(res)
    for kind, rows in res["runs"].items():
        best = {id(r) for r in _best(rows).values()}
        lines += ["", f"{kind}: {_kind(kind, res)}; goodput and optimum in %, the buckets in s (they sum to the wall "
                      f"time)", cols]
        modes = res.get("restarts", ["fresh"])
        for loop in LOOPS:
            for mode in modes:
                lines.append(f"  {LOOPS[loop]}" + ("" if modes == ["fresh"] else f", {RESTARTS[mode].split(' (')[0]}"))
                lines += [_row(r, id(r) in best, kind, spread[loop]) for r in rows
                          if r["loop"] == loop and _mode(r) == mode]
        shared = sorted({r["ran_under"] for r in rows if r.get("ran_under", kind) != kind})
        if shared:
            lines.append(f"  ^ the {' and '.join(shared)} run's row: its files survive a node loss, which is a crash "
                         f"to it, so it ran once")
        if kind == "preempt":
            lines += _redone(rows)
        lines += targets(kind, rows, res["free"], spread)
    return "\n".join(lines)


def _kind(kind: str, res: Optional[Dict[str, Any]] = None) -> str:
    return KINDS.get(kind, kind).format(grace=(res or {}).get("grace_s", 0.0))


def _redone(rows: List[Dict[str, Any]]) -> List[str]:
    """Each contender's steps done again under the notices, per loop."""
    out = []
    for loop in LOOPS:
        mine = [r for r in _ran(rows) if r["loop"] == loop]
        if mine:
            out.append(f"  steps redone, {LOOPS[loop]}: " + ", ".join(
                f"{r['name']} {'mtbf' if r['mtbf'] else r['every']}: {r['redone_steps']}" for r in mine))
    return out


def targets(kind: str, rows: List[Dict[str, Any]], free: Dict[str, Any],
            spread: Optional[Dict[str, float]] = None) -> List[str]:
    """The targets' lines for one failure kind: each layerckpt row against the contenders' best cadence.

    ``spread``: loop -> the steps' spread between runs, s a step (:func:`spreads`; by default from ``rows``).  Each
    verdict can fail either way, and one that the noise decides is not judged:

    * lost time: ours over theirs within the target ratio; where theirs is not above the spread over the job's
      steps, not met if ours is above it, else not judged (noise); ours at or below zero is met only where theirs
      is above that spread;
    * the loss: layerckpt's rows within the target of every other row's and the failure-free run's, above or below;
    * goodput: within the target of the optimum, below or above it (above: the optimum's model of the costs is
      off); not judged where C is within noise (no optimum);
    * under a notice (the preempt kind): no step of layerckpt's redone and no time lost to redone work, each row;
      the lost time against ModelCheckpoint's under Lightning is :data:`LOST_VS_KIND`'s."""
    best = _best(rows)
    if spread is None:
        spread = {loop: step_spread([r for r in _ran(rows) if r["loop"] == loop], f) for loop, f in free.items()}
    out = [f"targets ({kind}):"]
    out += [f"  {r['name']} {'mtbf=' if r['mtbf'] else 'every ' + str(r['every'])} ({LOOPS[r['loop']]}): its run "
            f"FAILED, so no target holds for it: {_why(r)}" for r in rows if r.get("failed") and r["name"] in OURS]
    rows = _ran(rows)
    if kind == "preempt":
        for r in (x for x in rows if x["name"] in OURS):
            redone = r["buckets"]["redone"]
            out.append(f"  redone: {r['name']} {'mtbf=' if r['mtbf'] else 'every ' + str(r['every'])} "
                       f"({LOOPS[r['loop']]}): {r['redone_steps']} step(s), {redone:.1f} s over {r['kills']} "
                       f"notice(s) (target 0): {'met' if r['redone_steps'] == 0 and redone == 0 else 'not met'}")
    lost_vs = {**LOST_VS, **LOST_VS_KIND.get(kind, {})}
    for (loop, (them, most)), mode in ((x, m) for x in lost_vs.items() for m in sorted({_mode(r) for r in rows})):
        tail = "" if mode == "fresh" else f":{mode}"
        theirs = best.get(f"{loop}:{them}{tail}")
        for r in (x for x in rows if x["loop"] == loop and x["name"] in OURS and _mode(x) == mode and (
                x["mtbf"] or x is best.get(f"{loop}:{x['name']}{tail}"))):
            if theirs is None:
                continue
            what = f"{r['name']} {'mtbf=' if r['mtbf'] else 'every ' + str(r['every'])}" + (
                "" if mode == "fresh" else f", {mode} restarts")
            # every step of a run is as much faster or slower by chance as the spread: the lost time's noise
            band = spread.get(loop, 0.0) * free[loop]["steps_done"]
            if theirs["lost_s"] <= band < r["lost_s"]:  # a ratio to noise says nothing, but ours is above it
                verdict = f"not met: ours is above the steps' spread between runs (+-{band:.1f} s), theirs within it"
            elif theirs["lost_s"] <= band:
                verdict = f"not judged (noise): theirs is within the steps' spread between runs (+-{band:.1f} s)"
            elif r["lost_s"] <= 0:
                verdict = (f"met: ours is at or below the failure-free run's (noise), theirs above the steps' "
                           f"spread (+-{band:.1f} s)")
            else:
                q = r["lost_s"] / theirs["lost_s"]
                verdict = f"{q:.2f}x (target <= {most:.2f}x): {'met' if q <= most else 'not met'}"
            out.append(f"  lost: {what} {r['lost_s']:.1f} s vs {them} every {theirs['every']} (its best) "
                       f"{theirs['lost_s']:.1f} s: {verdict}")
    for loop in LOOPS:
        ours = [r for r in rows if r["loop"] == loop and r["name"] in OURS]
        others = [r for r in rows if r["loop"] == loop and r["name"] not in OURS] + [free[loop]]
        # the mean of the last steps' losses where the run kept them (a JSON of before: the last step's)
        key, what = ("tail_loss", f"mean loss of the last {TAIL} steps") if all(
            r.get("tail_loss") for r in ours + others) else ("final_loss", "final loss")
        if not ours or not all(r[key] for r in others):
            continue
        worst = max(abs(o[key] - t[key]) / t[key] for o in ours for t in others)
        out.append(f"  {what}, {LOOPS[loop]}: layerckpt's rows differ from every other row's and the failure-free "
                   f"run's by at most {worst * 100:.3f}% (target {LOSS_REL * 100:g}%): "
                   f"{'met' if worst <= LOSS_REL else 'not met'}")
    for r in (x for x in rows if x["name"] in OURS and x["mtbf"]):
        head = (f"  goodput, {r['name']} mtbf= ({LOOPS[r['loop']]}"
                f"{'' if _mode(r) == 'fresh' else ', ' + _mode(r) + ' restarts'}): {r['goodput'] * 100:.1f}%")
        opt = optimum(r)
        if within_noise(r):
            out.append(f"{head}: not judged: no optimum, C within noise (measured {r['save_cost_s']:+.2f} s)")
            continue
        if opt is None:
            continue  # no save measured (a JSON of before: no optimum either)
        gap = round((r["goodput"] - opt) * 100, 1)  # judged as printed: +2.0 is within 2, +2.1 is not
        verdict = "met" if abs(gap) <= OPTIMUM_POINTS else (
            "not met" if gap < 0 else "not met: above it, so the optimum's model of the costs is off")
        out.append(f"{head} against an optimum of {opt * 100:.1f}% ({gap:+.1f} points; target within "
                   f"{OPTIMUM_POINTS:g} either way): {verdict}")
    return out


def _start(b: Dict[str, Any]) -> float:
    """A run's starts as the lost time counts them: setup, load and warm-up (imports and restarts left out)."""
    return b["setup"] + b["load"] + b["warmup"]


def _picks(rows: List[Dict[str, Any]], loop: str, mode: str) -> List[Dict[str, Any]]:
    """One loop's rows for the summary: each contender at its best fixed cadence (least lost), then its
    ``mtbf=`` row; a contender whose every run failed shows its first failure."""
    mine = [r for r in rows if r["loop"] == loop and _mode(r) == mode]
    out: List[Dict[str, Any]] = []
    for name in dict.fromkeys(r["name"] for r in mine):
        for mtbf in (False, True):
            group = [r for r in mine if r["name"] == name and bool(r["mtbf"]) == mtbf]
            ran = _ran(group)
            if ran:
                out.append(min(ran, key=lambda r: r["lost_s"]))
            elif group:
                out.append(group[0])
    return out


def _commit(m: Dict[str, Any]) -> str:
    """The code a run measured, where its JSON recorded it."""
    if not m.get("commit"):
        return ""
    return f", at {m['commit'][:7]}" + (" with uncommitted changes" if m.get("commit_dirty") else "")


def format_summary(res: Dict[str, Any]) -> str:
    """The README's table of a ``bench --goodput`` JSON: per failure kind and loop, each contender at its best
    cadence and with its ``mtbf=`` interval, its goodput against the Young/Daly optimum of its own measured costs,
    its lost time split into checkpoints, starts and redone work (the three sum to it), and the targets."""
    m = res["machine"]
    lines = [f"layerckpt bench --goodput: {res['size']} ({_state(res)}), {res['steps']} steps, a failure every "
             f"{res['mtbf_s']:g} s on average",
             f"seed {res['seed']}: {len(res.get('failure_times_s', []))} failure times; fixed cadences every "
             f"{', '.join(str(c) for c in res['cadences'])} steps; {m['cpu']} ({m['cores']} cores), torch {m['torch']}"
             + _commit(m),
             "failure-free without checkpoints: " + ", ".join(
                 f"{LOOPS[loop]} {f['wall_s']:.1f} s ({f['base_step_s']:.3f} s a step)" for loop, f in res["free"].items()),
             *textwrap.wrap(
                 "each contender at its best cadence (least lost) and its mtbf= row; lost: wall time beyond the "
                 "failure-free run's, less imports and restarts, = ckpt (steps slowed or blocked by saves) + start "
                 "(setups, loads, first steps) + redone (work done again); optimum: goodput at the Young/Daly "
                 "interval sqrt(2 C MTBF) of the save cost C (s); ~0+-x: C below zero, noise (x: the steps' spread "
                 f"a save), no optimum; Y/D n: it in steps; loss: mean of the last {TAIL} steps"
                 + (f"; preempt: {_notices(res)}" if "preempt" in res["runs"] else ""),
                 116, break_on_hyphens=False)]
    spread = spreads(res)
    cols = (f"    {'contender':<16}{'every':>6}{'goodput':>9}{'optimum':>9}{'lost s':>8}{'ckpt':>7}{'start':>7}"
            f"{'redone':>7}{'kills':>6}{'C s':>9}{'Y/D n':>6}{'loss':>8}")
    for kind, rows in res["runs"].items():
        lines += ["", f"{kind}: {_kind(kind, res)}", cols]
        modes = res.get("restarts", ["fresh"])
        for loop in LOOPS:
            free = res["free"][loop]
            for mode in modes:
                lines.append(f"  {LOOPS[loop]}" + ("" if modes == ["fresh"] else f", {RESTARTS[mode].split(' (')[0]}"))
                for r in _picks(rows, loop, mode):
                    every = "mtbf" if r["mtbf"] else str(r["every"])
                    if r.get("failed"):
                        lines.append(f"    {r['name']:<16}{every:>6}  FAILED: {_why(r)}")
                        continue
                    b, fb = r["buckets"], free["buckets"]
                    name = r["name"] + ("^" if r.get("ran_under", kind) != kind else "")
                    opt = optimum(r)
                    lines.append(
                        f"    {name:<16}{every:>6}{r['goodput'] * 100:>8.1f}%"
                        + (f"{opt * 100:>8.1f}%" if opt is not None else f"{'-':>9}")
                        + f"{r['lost_s']:>8.1f}{b['checkpoint'] - fb['checkpoint']:>7.1f}{_start(b) - _start(fb):>7.1f}"
                        f"{b['redone']:>7.1f}{r['kills']:>6}{_cost(r, spread[loop], '.2f', 9)}"
                        f"{_num(_yd(r, 'young_daly_steps'), '.0f', 6)}"
                        f"{_num(r.get('tail_loss') or r['final_loss'], '.4f', 8)}")
        if any(r.get("ran_under", kind) != kind for r in rows):
            lines.append("    ^ ran once, in the crash kind: its files survive a node loss")
        if kind == "preempt":
            lines += ["  " + t for t in _redone(rows)]
        lines += ["  " + t for t in targets(kind, rows, res["free"], spread)]
    return "\n".join(lines)
