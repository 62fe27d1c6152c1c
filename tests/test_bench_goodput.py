"""`layerckpt bench --goodput`: the wall time's buckets, the failure times, the contenders' resumes, and one small
run end to end (a tiny model: a check of the machinery, not a measurement; nothing about speed is asserted)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from layerckpt import cli
from layerckpt.bench.goodput import Failures, contenders
from layerckpt.bench.goodput_account import PARTS, account, figures, read_progress


def _step(s, t, loss=1.0):
    return {"e": "step", "s": s, "t": t, "loss": loss}


# a job of 6 steps whose median step is 1 s: killed at 8.5 s after step 4 (its checkpoint of step 3 done), resumed
# at step 3 by a second process that finishes at 15 s
ATTEMPTS = [
    {"spawned": 0.0, "killed": 8.5, "events": [
        {"e": "imports", "t": 2.0}, {"e": "setup", "t": 3.0}, {"e": "restored", "t": 3.0, "step": 0},
        _step(1, 4.5), _step(2, 5.5), _step(3, 6.5), {"e": "save", "s": 3, "t": 6.6}, _step(4, 8.0)]},
    {"spawned": 8.6, "killed": None, "events": [
        {"e": "imports", "t": 10.0}, {"e": "setup", "t": 11.0}, {"e": "restored", "t": 11.5, "step": 3},
        _step(4, 13.0), _step(5, 14.0), _step(6, 15.0, 0.5)]},
]


def test_buckets_are_the_wall_time_split_by_hand():
    """Worked out by hand: every second of the 15 s falls in one bucket; step 4 is done twice (once redone) and the
    half second in flight at the kill is lost."""
    r = account(ATTEMPTS, 6, 1.0)
    want = {"compute": 6.0, "checkpoint": 0.5, "imports": 3.4, "setup": 2.0, "load": 0.5, "warmup": 1.0,
            "redone": 1.5, "restart": 0.1}
    assert r["buckets"] == pytest.approx(want, abs=1e-9)
    assert sum(r["buckets"].values()) == pytest.approx(r["wall_s"]) == pytest.approx(15.0)
    assert (r["steps_done"], r["executed"], r["saves"], r["kills"], r["resumed_at"]) == (6, 7, 1, 1, [0, 3])
    assert r["final_loss"] == 0.5 and r["first_start_s"] == pytest.approx(3.5)  # spawn to step 1, less its work
    assert r["tail_loss"] == pytest.approx((5 * 1.0 + 0.5) / 6)  # the job's 6 steps, step 4's as redone


def test_the_runs_are_compared_on_the_mean_loss_of_their_last_steps():
    from layerckpt.bench.goodput_account import TAIL, tail_loss

    n = TAIL + 5
    assert tail_loss({s: float(s) for s in range(1, n + 1)}, n) == pytest.approx(sum(range(6, n + 1)) / TAIL)
    assert tail_loss({s: 1.0 for s in range(1, n)}, n) is None  # the last step missing: no mean
    # step 4 done twice: the second process's loss counts, the one that led to the end
    again = [dict(a, events=[dict(e, loss=2.0) if e["e"] == "step" and e["s"] == 4 and a["killed"] is None
                             else e for e in a["events"]]) for a in ATTEMPTS]
    assert account(again, 6, 1.0)["tail_loss"] == pytest.approx((4 * 1.0 + 2.0 + 0.5) / 6)


def test_lost_time_and_the_optimum_against_the_failure_free_run():
    free = account([{"spawned": 0.0, "killed": None, "events": [
        {"e": "imports", "t": 2.0}, {"e": "setup", "t": 3.0}, {"e": "restored", "t": 3.0, "step": 0},
        *[_step(s, 3.0 + s) for s in range(1, 7)]]}], 6, 1.0)
    assert free["wall_s"] == 9.0 and free["buckets"]["checkpoint"] == 0.0
    r = account(ATTEMPTS, 6, 1.0)
    figures(r, free, mtbf=50.0)
    # 15 s less imports (3.4) and restart (0.1), against 9 s less imports (2): 11.5 - 7
    assert r["lost_s"] == pytest.approx(4.5)
    assert r["goodput"] == pytest.approx(6 / 15)
    assert r["save_cost_s"] == pytest.approx(0.5)  # one save; no noise in the failure-free run
    assert r["young_daly_s"] == 6.0  # sqrt(2 x 0.5 x 50) = 7.1 s, capped at the job's 6 s of work
    assert 0 < r["optimum"] < 1


def test_failure_times_are_seeded_and_the_same_for_every_contender():
    a, b = Failures(60.0, 7), Failures(60.0, 7)
    assert [a.at(k) for k in range(5)] == [b.at(k) for k in range(5)]
    assert all(x < y for x, y in zip(a.times, a.times[1:])) and a.times[0] > 0
    assert Failures(60.0, 8).at(0) != a.at(0)


def test_a_line_cut_short_by_the_kill_is_dropped(tmp_path):
    p = tmp_path / "0.jsonl"
    p.write_text(json.dumps({"e": "imports", "t": 1.0}) + "\n" + '{"e": "step", "s": 1, "t"')
    assert read_progress(str(p)) == [{"e": "imports", "t": 1.0}]
    assert read_progress(str(tmp_path / "none.jsonl")) == []


@pytest.mark.parametrize("kind", ["torch.save", "dcp.async_save", "layerckpt"])
def test_each_plain_contender_resumes_after_losing_the_node(kind, tmp_path, monkeypatch):
    """A job of 6 steps saving every 3; the node's store and memory tier deleted; the next job resumes at step 3
    from what survives, and its steps 4-6 give the first job's losses exactly (the first save is full)."""
    from layerckpt.bench.goodput import model_config
    from layerckpt.bench.goodput_child import main

    monkeypatch.setenv("LAYERCKPT_SHM", str(tmp_path / "shm"))
    os.mkdir(tmp_path / "shm")
    spec = {"model": model_config("tiny"), "batch": 2, "lr": 3e-4, "seed": 0, "mtbf": None, "threads": 1,
            "loop": "plain", "kind": kind, "every": 3, "node": str(tmp_path / "node"),
            "remote": str(tmp_path / "remote"), "spawned": 0.0}
    main({**spec, "steps": 6, "progress": str(tmp_path / "0.jsonl")})
    shutil.rmtree(tmp_path / "node", ignore_errors=True)
    shutil.rmtree(tmp_path / "shm")
    os.mkdir(tmp_path / "shm")
    main({**spec, "steps": 9, "progress": str(tmp_path / "1.jsonl")})
    first, second = (read_progress(str(tmp_path / f"{n}.jsonl")) for n in (0, 1))
    assert [e["s"] for e in first if e["e"] == "save"] == [3]
    assert next(e["step"] for e in second if e["e"] == "restored") == 3
    losses = lambda ev: {e["s"]: e["loss"] for e in ev if e["e"] == "step"}  # noqa: E731
    assert [losses(second)[s] for s in (4, 5, 6)] == [losses(first)[s] for s in (4, 5, 6)]


@pytest.mark.parametrize("args, says", [
    (["--failure", "disk"], "--failure disk: give crash, node and/or preempt"),
    (["--grace", "soon"], "--grace='soon' is not a duration"),
    (["--cadences", "5,0"], "--cadences 5,0: give distinct whole numbers"),
    (["--mtbf", "soon"], "--mtbf='soon' is not a duration"),
    (["--reps", "2"], "--reps does not apply to bench --goodput"),
])
def test_refusals_are_one_line(args, says, capsys):
    assert cli.main(["bench", "--goodput", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("layerckpt bench: ") and says in err, err


@pytest.mark.slow  # about 70 s (a Lightning process imports for 6-10 s here); the plain contenders' kill and resume
# run in the default suite (test_each_plain_contender_resumes_after_losing_the_node)
def test_a_small_run_kills_restarts_and_finishes_every_contender():
    """Seed 165 draws the first failure 1.0 s into each run and the next 197 s later: each contender is killed once
    (while it starts) and restarted.  The node kind alone (its restarts find the stores gone), one cadence."""
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--goodput", "--size", "tiny",
                        "--goodput-steps", "40", "--mtbf", "60", "--seed", "165", "--cadences", "5",
                        "--failure", "node", "--json", "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    rows = res["runs"]["node"]
    want = [(c.loop, c.name, c.every, c.mtbf) for c in contenders([5])]
    assert [(x["loop"], x["name"], x["every"], x["mtbf"]) for x in rows] == want and len(want) == 7
    for x in rows + list(res["free"].values()):
        assert set(x["buckets"]) == set(PARTS)
        assert sum(x["buckets"].values()) == pytest.approx(x["wall_s"], abs=1e-6), x["label"]
        assert x["steps_done"] == 40 and math.isfinite(x["final_loss"]), x["label"]
    for x in rows:
        assert x["kills"] >= 1 and len(x["attempts"]) == x["kills"] + 1, x["label"]
        assert x["failure_times_s"] == res["failure_times_s"][:x["kills"]], x["label"]
        for a, b in zip(x["attempts"], x["attempts"][1:]):  # a restart never resumes before a finished save
            if x["name"] == "torch.save" and a["last_save"] is not None:
                assert b["resumed_at"] >= a["last_save"], x["label"]
    assert all(x["kills"] == 0 for x in res["free"].values())


@pytest.mark.parametrize("last", ["exits", "killed on its way out"])
def test_standby_restarts_are_forks_that_resume_where_a_new_interpreter_would(last, tmp_path, monkeypatch):
    """``--restarts standby``: the supervisor runs the job under ``layerckpt launch`` and kills the attempts, not the
    launcher; the attempt after a kill is a fork (its progress says so) that resumes from the newest save, and the
    run's buckets add up to its wall time as a fresh run's do.  The kill comes once the first attempt has saved
    (the supervisor's own wait, told to kill once a save is committed instead of at a drawn time)."""
    import signal
    import time

    from layerckpt.bench import goodput

    waited = goodput._wait_or_kill_pid
    work = tmp_path / "work"
    calls = []

    def kill_after_a_save(pid, due):
        calls.append(pid)
        if len(calls) > 1:
            if last == "exits":
                return waited(pid, due)
            # the failure lands once the last step is done: the launcher restarts it, and the run must still end
            while not os.path.exists(work / "progress" / "1.jsonl") or not any(
                    e["e"] == "step" and e["s"] == 12 for e in read_progress(str(work / "progress" / "1.jsonl"))):
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            return waited(pid, None) or time.time()
        while not list(work.glob("node/**/manifests/step-*.json")):  # a committed save
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return waited(pid, None) or time.time()

    monkeypatch.setattr(goodput, "_wait_or_kill_pid", kill_after_a_save)
    failures = goodput.Failures(60, 0)
    failures.times = [0.0, 1e9]
    spec = {"model": goodput.model_config("tiny"), "batch": 2, "lr": 3e-4, "seed": 0, "mtbf": None, "threads": 1,
            "steps": 12}
    os.mkdir(work)
    attempts = goodput.supervise(goodput.Contender("layerckpt", "plain", 3), spec, str(work), 12, failures, False,
                                 "standby")
    assert len(attempts) == 2 and attempts[0]["killed"] is not None and attempts[1]["killed"] is None
    first, second = attempts[0]["events"], attempts[1]["events"]
    assert first[0]["e"] == "spawned" and first[0]["standby"] and second[0]["standby"]
    restored = next(e["step"] for e in second if e["e"] == "restored")
    assert restored > 0 and restored % 3 == 0 and restored in [e["s"] for e in first if e["e"] == "save"]
    assert max(e["s"] for e in second if e["e"] == "step") == 12
    r = account(attempts, 12, 0.01)
    assert sum(r["buckets"].values()) == pytest.approx(r["wall_s"], abs=1e-6) and r["kills"] == 1
    deadline = time.time() + 60  # nothing of the run is left: the launcher, and the attempt it started after the
    while time.time() < deadline:  # last (it ends itself within milliseconds once orphaned; a loaded box is slow)
        left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.05)
    assert left == []


def test_a_contender_that_cannot_finish_leaves_the_others_results(monkeypatch):
    """A run that fails (a restart that could not restore) becomes a row saying so, the others still run, and the
    table and the targets name it: one failure no longer loses hours of results."""
    from layerckpt.bench import goodput
    from layerckpt.bench.goodput_report import format_table

    def supervise(c, spec, work, steps, failures, node_loss, restarts):
        if c.name == "layerckpt" and c.mtbf:
            raise RuntimeError(f"{c.label}: attempt 1 exited with status 1 before step {steps}: Traceback ...\n"
                               f"MissingDataError: data file x is missing")
        return [dict(a, failure_s=None if a["killed"] is None else 8.5) for a in ATTEMPTS]

    monkeypatch.setattr(goodput, "supervise", supervise)
    monkeypatch.setattr(goodput, "machine", lambda: {"cpu": "a test", "cores": 2, "torch": "2"})
    said = []
    res = goodput.run(size="tiny", steps=6, kinds=("crash",), cadences=(5,), say=said.append)
    rows = res["runs"]["crash"]
    assert [(r["name"], r["every"], r["mtbf"]) for r in rows] == [(c.name, c.every, c.mtbf) for c in contenders([5])]
    failed = [r for r in rows if r.get("failed")]
    assert [(r["name"], r["mtbf"]) for r in failed] == [("layerckpt", True)]
    assert failed[0]["failed"].endswith("MissingDataError: data file x is missing")
    assert all(set(r["buckets"]) == set(PARTS) for r in rows if not r.get("failed"))
    text = format_table(json.loads(json.dumps(res)))  # what --json prints, rendered as the docs render it
    assert "  layerckpt         mtbf  FAILED: MissingDataError: data file x is missing" in text
    assert "layerckpt mtbf= (plain loop): its run FAILED, so no target holds for it" in text
    assert "goodput, LayerCheckpoint mtbf=" in text  # the other rows' targets are still judged
    assert [line for line in said if "FAILED" in line] == [
        "goodput: crash: layerckpt mtbf=: FAILED: " + failed[0]["failed"]]


def test_the_summary_shows_each_contender_at_its_best_cadence_with_its_lost_time_split():
    """The README's table: per kind and loop, each contender's least-lost fixed cadence and its mtbf= row; the
    three parts of the lost time sum to it; a failed contender says so instead of vanishing."""
    from layerckpt.bench.goodput_report import format_summary

    root = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
    with open(os.path.join(root, "goodput-100steps-gpt2-mini-2core-epyc.json"), encoding="utf-8") as f:
        res = json.load(f)
    text = format_summary(res)
    crash = text.split("\nnode: ")[0]
    for loop in ("plain", "lightning"):
        for name in {r["name"] for r in res["runs"]["crash"] if r["loop"] == loop}:
            fixed = [r for r in res["runs"]["crash"] if r["loop"] == loop and r["name"] == name and not r["mtbf"]]
            best = min(fixed, key=lambda r: r["lost_s"])
            line = next(x for x in crash.splitlines() if x.split()[:2] == [name, str(best["every"])])
            lost, ckpt, start, redone = (float(v) for v in line.split()[4:8])
            assert lost == pytest.approx(best["lost_s"], abs=0.06)
            assert ckpt + start + redone == pytest.approx(lost, abs=0.16)
            assert not any(x.split()[:2] == [name, str(r["every"])] for x in crash.splitlines()
                           for r in fixed if r is not best)
    assert crash.count(" mtbf ") == 2
    assert "failure-free without checkpoints: plain loop 96.0 s" in text
    res["runs"]["crash"] = [{"name": r["name"], "label": r["label"], "loop": r["loop"], "every": r["every"],
                             "mtbf": r["mtbf"], "failed": "Traceback ...\nMissingDataError: x is missing"}
                            if r["name"] == "layerckpt" and r["mtbf"] else r for r in res["runs"]["crash"]]
    text = format_summary(res)
    assert "    layerckpt         mtbf  FAILED: MissingDataError: x is missing" in text
    assert "layerckpt mtbf= (plain loop): its run FAILED, so no target holds for it" in text
