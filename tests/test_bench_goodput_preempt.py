"""`layerckpt bench --goodput --failure preempt`: a notice (SIGTERM), then SIGKILL after the grace.  Each contender
handles the notice as its users would; the accounting keeps the save on the notice out of the redone work; the JSON
and the tables show the kind.  A tiny model: a check of the machinery, not a measurement."""
import json
import os
import time

import pytest

from layerckpt.bench import goodput
from layerckpt.bench.goodput import contenders
from layerckpt.bench.goodput_account import PARTS, account, read_progress

STEPS, AT = 400, 20  # a tiny step takes milliseconds: the notice comes once step AT is done, well before the end


def _step(s, t, loss=1.0):
    return {"e": "step", "s": s, "t": t, "loss": loss}


def _attempts(resumed):
    """A job of 6 steps of 1 s: a notice at 5.2 s, during step 3; the process saves step 3 (it says nothing of it)
    and exits at 6.5 s; the next one resumes at ``resumed`` and finishes."""
    second = [_step(s, 10.0 + s - resumed) for s in range(resumed + 1, 7)]
    return [
        {"spawned": 0.0, "killed": 6.5, "notice": 5.2, "exit": 75, "failure_s": 5.2, "events": [
            {"e": "imports", "t": 1.0}, {"e": "setup", "t": 2.0}, {"e": "restored", "t": 2.0, "step": 0},
            _step(1, 3.5), _step(2, 4.5), _step(3, 5.5)]},
        {"spawned": 6.6, "killed": None, "failure_s": None, "events": [
            {"e": "imports", "t": 8.0}, {"e": "setup", "t": 9.0}, {"e": "restored", "t": 10.0, "step": resumed},
            *second]},
    ]


def test_the_save_on_a_notice_is_checkpoint_time_where_the_restart_resumes_from_it():
    r = account(_attempts(3), 6, 1.0)
    assert r["buckets"]["redone"] == 0.0 and r["redone_steps"] == 0
    assert r["buckets"]["checkpoint"] == pytest.approx(1.0)  # step 3's end to the exit
    assert (r["saves"], r["notices"], r["kills"]) == (1, 1, 1)  # the save on the notice, counted
    assert sum(r["buckets"].values()) == pytest.approx(r["wall_s"])
    # not saved on it (the restart resumed before it): the time after step 3 and step 3 itself are redone
    r = account(_attempts(2), 6, 1.0)
    assert r["redone_steps"] == 1 and r["buckets"]["redone"] == pytest.approx(1.0 + 1.0)
    assert r["saves"] == 0 and sum(r["buckets"].values()) == pytest.approx(r["wall_s"])


def _notice_at_step(monkeypatch, at):
    """The supervisor's wait, with the notice sent once the child has done step ``at`` (instead of at a drawn
    time: a tiny model's steps take milliseconds, its start seconds)."""
    wait = goodput._wait_or_preempt
    calls = []

    def notice_at_step(proc, due, grace):
        calls.append(proc.pid)
        if len(calls) > 1:
            return wait(proc, None, grace)
        progress = json.loads(proc.args[-1])["progress"]
        while proc.poll() is None and not any(e["e"] == "step" and e["s"] >= at for e in read_progress(progress)):
            time.sleep(0.002)
        return wait(proc, time.time(), grace)

    monkeypatch.setattr(goodput, "_wait_or_preempt", notice_at_step)


@pytest.mark.parametrize("name, status", [("layerckpt", 75), ("torch.save", 0), ("dcp.async_save", 0)])
def test_each_plain_contender_saves_on_the_notice_and_redoes_nothing(name, status, tmp_path, monkeypatch):
    """The notice lands after step AT of a job saving every 50 steps: the process saves the step it is at (its own
    mechanism, or a handler written by hand), exits before the grace runs out, and the restart resumes there."""
    _notice_at_step(monkeypatch, AT)
    failures = goodput.Failures(60, 0)
    failures.times = [0.0, 1e9]
    spec = {"model": goodput.model_config("tiny"), "batch": 2, "lr": 3e-4, "seed": 0, "mtbf": None, "threads": 1,
            "steps": STEPS, "grace": 20.0}
    work = tmp_path / "work"
    os.mkdir(work)
    attempts = goodput.supervise(goodput.Contender(name, "plain", 50), spec, str(work), STEPS, failures, False)
    assert len(attempts) == 2
    first, second = attempts
    assert first["exit"] == status and first["killed"] - first["notice"] < 20.0, first  # an exit, not the SIGKILL
    last = max(e["s"] for e in first["events"] if e["e"] == "step")
    assert AT <= last < 50  # saved on the notice, not at the cadence
    assert [e["s"] for e in first["events"] if e["e"] == "save"] == [last]
    assert next(e["step"] for e in second["events"] if e["e"] == "restored") == last
    r = account(attempts, STEPS, 0.01)
    assert r["redone_steps"] == 0 and r["buckets"]["redone"] == 0.0
    assert r["notices"] == r["kills"] == 1 and r["steps_done"] == STEPS
    assert sum(r["buckets"].values()) == pytest.approx(r["wall_s"], abs=1e-6)


def test_the_json_and_the_tables_show_the_preempt_kind(monkeypatch):
    """``run`` with the kind preempt: the spec carries the grace to every contender, each row has its redone steps
    and notices, the attempts their notice and exit status; the tables name the kind and judge layerckpt's redone
    work and its lost time against ModelCheckpoint's (1/4 under Lightning)."""
    from layerckpt.bench.goodput_report import format_summary, format_table

    seen = []

    def supervise(c, spec, work, steps, failures, node_loss, restarts):
        seen.append((c.name, spec.get("grace"), node_loss, restarts))
        if spec.get("grace") is None:  # the failure-free runs
            return [{"spawned": 0.0, "killed": None, "failure_s": None, "events": [
                {"e": "imports", "t": 1.0}, {"e": "setup", "t": 2.0}, {"e": "restored", "t": 2.0, "step": 0},
                *[_step(s, 2.0 + s) for s in range(1, 7)]]}]
        return _attempts(2 if c.name == "torch.save" else 3)  # torch.save's notice unsaved: step 3 redone

    monkeypatch.setattr(goodput, "supervise", supervise)
    monkeypatch.setattr(goodput, "machine", lambda: {"cpu": "a test", "cores": 2, "torch": "2"})
    res = json.loads(json.dumps(goodput.run(size="tiny", steps=6, kinds=("preempt",), cadences=(5,),
                                            restarts=("fresh", "standby"), grace=7.0)))
    assert res["grace_s"] == 7.0 and res["kinds"] == ["preempt"]
    ran = [x for x in seen if x[0] != "none"]
    assert ran == [(c.name, 7.0, False, "fresh") for c in contenders([5])]  # no standby under a notice
    rows = res["runs"]["preempt"]
    for r in rows:
        assert set(r["buckets"]) == set(PARTS) and r["notices"] == r["kills"] == 1
        assert r["redone_steps"] == (1 if r["name"] == "torch.save" else 0)
        assert r["attempts"][0]["notice_s"] == 5.2 and r["attempts"][0]["exit"] == 75
        assert "notice_s" not in r["attempts"][1]
    ours = [r for r in rows if r["name"] in ("layerckpt", "LayerCheckpoint")]
    assert ours and all(r["redone_steps"] == 0 and r["buckets"]["redone"] == 0.0 for r in ours)
    table = format_table(res)
    assert "preempt: a notice, SIGTERM, then SIGKILL 7 s later where the process is still there" in table
    assert "redone: layerckpt every 5 (plain loop): 0 step(s), 0.0 s over 1 notice(s) (target 0): met" in table
    assert "steps redone, plain loop: torch.save 5: 1, dcp.async_save 5: 0, layerckpt 5: 0, layerckpt mtbf: 0" \
        in table
    lost = [x for x in table.splitlines() if x.startswith("  lost: LayerCheckpoint")]
    assert lost and all("vs ModelCheckpoint every 5 (its best)" in x for x in lost)
    assert all("(target <= 0.25x)" in x or "noise" in x or "spread" in x for x in lost), lost
    summary = format_summary(res)
    assert "\npreempt: a notice, SIGTERM" in summary and "ck.preempted(step)" in summary
    assert "    redone: LayerCheckpoint mtbf= (Lightning Trainer): 0 step(s)" in summary


@pytest.mark.slow  # about 40 s: four Lightning processes, each importing for 6-10 s here
@pytest.mark.parametrize("name", ["LayerCheckpoint", "ModelCheckpoint"])
def test_under_lightning_the_notice_is_handled_by_the_callbacks(name, tmp_path, monkeypatch):
    """LayerCheckpoint (SIGTERM on by default, the script exiting 75 where it stopped on a notice) and
    ModelCheckpoint (Lightning's SIGTERMException, with its opt-in save_on_exception) each save the step the notice
    lands in; the restart resumes there."""
    _notice_at_step(monkeypatch, AT)
    failures = goodput.Failures(60, 0)
    failures.times = [0.0, 1e9]
    spec = {"model": goodput.model_config("tiny"), "batch": 2, "lr": 3e-4, "seed": 0, "mtbf": None, "threads": 1,
            "steps": STEPS, "grace": 20.0, "save_on_exception": True}
    work = tmp_path / "work"
    os.mkdir(work)
    attempts = goodput.supervise(goodput.Contender(name, "lightning", 50), spec, str(work), STEPS, failures, False)
    first, second = attempts
    assert first["exit"] == (75 if name == "LayerCheckpoint" else 0), first
    last = max(e["s"] for e in first["events"] if e["e"] == "step")
    assert next(e["step"] for e in second["events"] if e["e"] == "restored") == last
    r = account(attempts, STEPS, 0.01)
    assert r["redone_steps"] == 0 and r["buckets"]["redone"] == 0.0
