"""`layerckpt bench --goodput`'s verdicts on hand-made rows: each one passes, fails in either direction, or is not
judged where the noise decides it; a save cost below zero is shown as noise with no optimum computed from it."""
import glob
import json
import os

import pytest

from layerckpt.bench.goodput_account import account, figures, save_noise_s, step_spread
from layerckpt.bench.goodput_report import format_summary, format_table, targets

STEPS = 100
FREE = {loop: {"tail_loss": 2.0, "final_loss": 2.0, "steps_done": STEPS} for loop in ("plain", "lightning")}
SPREAD = {"plain": 0.1, "lightning": 0.1}  # s a step: over 100 steps, lost times within +-10 s are noise


def _row(name, loop="plain", every=10, mtbf=False, lost=5.0, loss=2.0, goodput=0.9, optimum=0.9, cost=0.5):
    return {"name": name, "loop": loop, "every": None if mtbf else every, "mtbf": mtbf, "lost_s": lost,
            "tail_loss": loss, "final_loss": loss, "goodput": goodput, "optimum": optimum, "save_cost_s": cost}


def _lost(ours, theirs, loop="plain"):
    them, us = ("dcp.async_save", "layerckpt") if loop == "plain" else ("ModelCheckpoint", "LayerCheckpoint")
    lines = targets("crash", [_row(them, loop, lost=theirs), _row(us, loop, mtbf=True, lost=ours)], FREE, SPREAD)
    line, = [x for x in lines if x.startswith("  lost: ")]
    return line


@pytest.mark.parametrize("ours, theirs, says", [
    (10.0, 40.0, "0.25x (target <= 0.50x): met"),
    (20.0, 40.0, "0.50x (target <= 0.50x): met"),
    (25.0, 40.0, "0.62x (target <= 0.50x): not met"),  # ours over the target ratio
    (90.0, 40.0, "2.25x (target <= 0.50x): not met"),  # ours worse than theirs
    (-3.0, 40.0, "met: ours is at or below the failure-free run's (noise), theirs above the steps' spread (+-10.0 s)"),
    # theirs at or below zero, or within the spread: noise, whatever ours is; never met
    (5.0, -1.0, "not judged (noise): theirs is within the steps' spread between runs (+-10.0 s)"),
    (-3.0, -1.0, "not judged (noise)"),
    (-3.0, 8.0, "not judged (noise)"),  # ours below zero is not met against a theirs within the noise
    (2.0, 9.0, "not judged (noise)"),
    # theirs within the noise and ours above it: worse, whatever the ratio
    (15.0, -1.0, "not met: ours is above the steps' spread between runs (+-10.0 s), theirs within it"),
    (10.7, 0.9, "not met: ours is above the steps' spread between runs (+-10.0 s), theirs within it"),
])
def test_lost_time_verdict(ours, theirs, says):
    line = _lost(ours, theirs)
    verdict = line.split("(its best) ")[1].split(": ", 1)[1]
    assert verdict.endswith(says) or verdict.startswith(says), line
    if says.startswith("not judged"):
        assert "met" not in verdict.replace(",", " ").split(), line


def test_lost_time_target_is_the_loops_own():
    assert _lost(12.0, 40.0, "lightning").endswith("0.30x (target <= 0.33x): met")
    assert _lost(14.0, 40.0, "lightning").endswith("0.35x (target <= 0.33x): not met")


@pytest.mark.parametrize("ours_loss, met", [(2.0, True), (2.009, True), (2.012, False), (1.988, False)])
def test_loss_verdict_fails_above_and_below(ours_loss, met):
    lines = targets("crash", [_row("dcp.async_save", lost=40.0), _row("layerckpt", mtbf=True, loss=ours_loss)],
                    FREE, SPREAD)
    line, = [x for x in lines if "mean loss of the last" in x and "plain loop" in x]
    assert line.endswith(": met" if met else ": not met"), line


@pytest.mark.parametrize("goodput, says", [
    (0.885, "(-1.5 points; target within 2 either way): met"),
    (0.920, "(+2.0 points; target within 2 either way): met"),
    (0.876, "(-2.4 points; target within 2 either way): not met"),  # below the optimum
    (0.921, "(+2.1 points; target within 2 either way): not met: above it, so the optimum's model of the costs is off"),
    (0.924, "(+2.4 points; target within 2 either way): not met: above it, so the optimum's model of the costs is off"),
])
def test_goodput_verdict_fails_below_and_above_the_optimum(goodput, says):
    lines = targets("crash", [_row("layerckpt", mtbf=True, goodput=goodput, optimum=0.9)], FREE, SPREAD)
    line, = [x for x in lines if x.startswith("  goodput, ")]
    assert line.endswith(says), line


def test_goodput_verdict_is_not_judged_where_the_save_cost_is_noise():
    """A JSON of before the rule holds an optimum computed from C clamped to zero: neither shown nor judged."""
    lines = targets("crash", [_row("layerckpt", mtbf=True, goodput=0.93, optimum=0.906, cost=-0.49)], FREE, SPREAD)
    line, = [x for x in lines if x.startswith("  goodput, ")]
    assert line.endswith(": not judged: no optimum, C within noise (measured -0.49 s)"), line
    assert "met" not in line


def _step(s, t):
    return {"e": "step", "s": s, "t": t, "loss": 1.0}


def _one_process(step_s, saves=()):
    ev = [{"e": "imports", "t": 1.0}, {"e": "setup", "t": 2.0}, {"e": "restored", "t": 2.0, "step": 0}]
    t = 2.0
    for s in range(1, 21):
        t += step_s if s > 1 else 1.0
        ev.append(_step(s, t))
        if s in saves:
            ev.append({"e": "save", "s": s, "t": t})
    return [{"spawned": 0.0, "killed": None, "events": ev}]


def test_a_save_cost_below_zero_is_noise_with_no_optimum():
    """A run whose steps went 0.05 s faster than the failure-free run's median (chance: a process's step time
    moves) measures C below zero: no Young/Daly interval or optimum comes from it, and the spread between the
    runs is what that run showed, which is at least |C| for each of its saves."""
    free = account(_one_process(1.0), 20, 1.0)
    fast = account(_one_process(0.95, saves=(10, 20)), 20, 1.0)
    slow = account(_one_process(1.1, saves=(10, 20)), 20, 1.0)
    for r in (fast, slow):
        figures(r, free, mtbf=60.0)
    assert fast["save_cost_s"] == pytest.approx(-19 * 0.05 / 2)
    assert fast["optimum"] is fast["young_daly_s"] is fast["young_daly_steps"] is None
    assert slow["save_cost_s"] == pytest.approx(19 * 0.1 / 2) and 0 < slow["optimum"] < 1
    spread = step_spread([fast, slow], free)
    assert spread == pytest.approx(0.05)
    assert step_spread([slow], free) == 0.0  # no run went faster: nothing shows a spread
    assert save_noise_s(fast, spread) == pytest.approx(-fast["save_cost_s"])


def _json(name):
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", name), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(__file__), os.pardir,
                                                              "benchmarks", "goodput*.json"))))
def test_no_table_prints_a_negative_save_cost_or_an_optimum_from_one(path):
    res = _json(os.path.basename(path))
    for text, c_col, opt_col in ((format_table(res), -4, 3), (format_summary(res), -3, 3)):
        for line in text.splitlines():
            cells = line.lstrip("* ").split()
            if len(cells) < 12 or "FAILED" in line or not cells[1].replace("mtbf", "1").isdigit():
                continue  # not a contender's row
            c = cells[c_col]
            assert not c.startswith("-") or c == "-", line
            if c.startswith("~0+-"):
                assert cells[opt_col] == "-" and float(c[4:]) > 0, line


def test_the_headline_run_shows_noise_as_noise():
    text = format_summary(_json("goodput-300steps-gpt2-mini-2core-epyc.json"))
    row = next(x for x in text.splitlines() if x.split()[:2] == ["layerckpt", "50"])
    assert row.split()[3] == "-" and row.split()[-3] == "~0+-2.7"  # was C -1.77 s and an optimum of 92.3%
    assert "+2.4 points" not in text and "(+1.6 points; target within 2 either way): met" in text
    assert text.count("not judged: no optimum, C within noise") == 3


def test_the_summary_names_the_code_it_measured():
    res = _json("goodput-300steps-gpt2-mini-2core-epyc.json")
    assert "torch 2.13.0+cpu, at b334467\n" in format_summary(res)
    res["machine"]["commit_dirty"] = True
    assert ", at b334467 with uncommitted changes\n" in format_summary(res)
    del res["machine"]["commit"]
    assert "torch 2.13.0+cpu\n" in format_summary(res)
