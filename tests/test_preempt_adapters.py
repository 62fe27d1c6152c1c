"""A notice of preemption in the Trainer hook and the Accelerate plugin, at their defaults (SIGTERM, 30 s of grace): a
real SIGTERM that a training step sends its own process (tests/preempt_adapters_helpers.py), in one process and in 2
CPU ranks on gloo under ``accelerate launch`` where rank 1 alone gets it.

The step of the notice is saved as the adapter's framework saves any checkpoint, training stops there (Trainer: its
own stop, ``preempted``; the plugin: SystemExit(EXIT_PREEMPTED) on every rank), and a new process resumes at that
step, 0 steps redone, to the final weights and optimizer state of the uninterrupted run, bit for bit (full mode).  One
rank alone notices the signal at its step; the ranks agree one step later.  With a grace period too short for any
save, nothing is saved at the notice, the log says why, and the restart resumes from the checkpoint before.

Four processes' worth (two single runs, two launches of 2 ranks): each phase runs every scenario in the same process.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any, Dict

import pytest
import torch

from conftest import assert_same_optimizer_state, assert_same_tensors

import layerckpt
from test_launchers import ACCELERATE_CONFIG  # two CPU processes: a multi-GPU launch, ACCELERATE_USE_CPU=1

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "preempt_adapters_helpers.py")
BIN = os.path.dirname(sys.executable)
TIMEOUT_S = 120  # per process or launch: a hang fails the test instead of blocking the suite
STEPS, EVERY, SIGNAL, LATE, SIGNAL2 = 12, 4, 3, 6, 5  # as in the helper

def _env(root) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LAYERCKPT_", "TRANSFORMERS_LAYERCKPT", "ACCELERATE_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", ACCELERATE_USE_CPU="1",
               HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1", WANDB_MODE="disabled")
    return env


def _run(root, phase: str) -> Dict[str, Any]:
    """One phase, in a session of its own so that a hang is ended with every process it started."""
    if phase.endswith("2"):
        config = root / "accelerate.yaml"
        config.write_text(ACCELERATE_CONFIG)
        cmd = [os.path.join(BIN, "accelerate-launch"), "--config_file", str(config), HELPER, phase, str(root / "runs")]
    else:
        cmd = [sys.executable, HELPER, phase, str(root / "runs")]
    proc = subprocess.Popen(cmd, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{phase}: still running after {TIMEOUT_S}s\n{out[-4000:]}")
    return {"returncode": proc.returncode, "output": out}


#: each phase's exit: the plugin's SystemExit(EXIT_PREEMPTED) ends ``first`` and ``first2`` (the launcher then fails)
EXITS = {"first": lambda rc: rc == 75, "resume": lambda rc: rc == 0, "first2": lambda rc: rc != 0,
         "resume2": lambda rc: rc == 0}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """phases(first, resume): each phase's exit and output, run once, the first time a test asks; a phase that
    exits otherwise fails every test that asks for it, with its output."""
    done: Dict[str, Any] = {}
    root = tmp_path_factory.mktemp("preempt")

    def get(*names: str) -> Dict[str, Any]:
        for name in names:
            if name not in done:
                done[name] = _run(root, name)
            got = done[name]
            assert EXITS[name](got["returncode"]), f"{name}: exit code {got['returncode']}\n{got['output'][-4000:]}"
        return {n: done[n] for n in names}

    get.runs = root / "runs"  # type: ignore[attr-defined]
    return get


def _json(d, phase: str, run: str, rank: int = 0) -> Dict[str, Any]:
    return json.loads((d / phase / f"{run}.rank{rank}.json").read_text())


def _assert_as_uninterrupted(d, phase: str, run: str, ref: str, rank: int = 0) -> None:
    """The final model and optimizer state of ``run``, resumed in ``phase``, are the uninterrupted ``ref``'s."""
    got, want = (torch.load(d / phase / f"{r}.rank{rank}.pt", weights_only=True) for r in (run, ref))
    assert_same_tensors(got["model"], want["model"])
    assert_same_optimizer_state(got["optim"], want["optim"])


def _written_by(store, step: int) -> list:
    """The ranks whose data files the composite of ``step`` holds as new."""
    m = json.loads((store / "manifests" / f"step-{step:08d}.json").read_text())
    assert m["world_size"] == 2
    return sorted(e["rank"] for e in m["files"].values() if e["step"] == step)


def _said(lines, text: str) -> bool:
    return any(text in line for line in lines)


# ------------------------------------------------------------------ one process: the signal at step SIGNAL


def test_the_trainer_saves_the_step_of_the_notice_and_resumes_there(phases):
    phases("first", "resume")
    d = phases.runs
    first = _json(d, "first", "trainer")
    assert first["preempted"] and first["global_step"] == SIGNAL, first
    assert first["steps"] == list(range(1, SIGNAL + 1))  # Trainer's own stop, at the end of the step of the signal
    assert first["folders"] == [f"checkpoint-{SIGNAL}"] and first["store"] == [SIGNAL]  # before any periodic save
    assert _said(first["log"], f"(SIGTERM): stopping at step {SIGNAL}"), first["log"]
    assert _said(first["log"], f"step {SIGNAL} committed"), first["log"]
    resumed = _json(d, "resume", "trainer")
    assert resumed["restored"] == SIGNAL and resumed["steps"] == list(range(SIGNAL + 1, STEPS + 1))  # none redone
    _assert_as_uninterrupted(d, "resume", "trainer", "trainer_ref")


def test_the_plugin_saves_the_step_of_the_notice_exits_75_and_resumes_there(phases):
    ph, d = phases("first", "resume"), phases.runs
    # the plugin's SystemExit, let through by the script's last run, is the process's exit
    assert ph["first"]["returncode"] == layerckpt.EXIT_PREEMPTED == 75, ph["first"]["output"][-4000:]
    first = _json(d, "first", "accel")
    assert first["exit"] == 75 and first["preempted"]
    # the signal inside step SIGNAL, before its backward; the save and the stop where the next step starts
    assert first["stopped"] == SIGNAL and first["steps"] == list(range(1, SIGNAL + 1))
    assert first["folders"] == ["checkpoint_0"] and first["store"] == [0]  # save_state() as the script's first save
    assert _said(first["log"], f"(SIGTERM): stopping at step {SIGNAL}"), first["log"]
    assert _said(first["log"], "step 0 committed"), first["log"]
    resumed = _json(d, "resume", "accel")
    assert resumed["restored"] == SIGNAL and resumed["steps"] == list(range(SIGNAL + 1, STEPS + 1))  # none redone
    _assert_as_uninterrupted(d, "resume", "accel", "accel_ref")


@pytest.mark.parametrize("run,folder,step", [("trainer_late", "checkpoint-4", 4), ("accel_late", "checkpoint_0", 0)])
def test_a_grace_period_too_short_for_any_save_saves_nothing_and_the_log_says_why(phases, run, folder, step):
    """The signal at step LATE, after the checkpoint of step EVERY committed, with grace_s=0.001: nothing is saved at
    the notice (nothing torn either), the log says why, and the restart resumes from that checkpoint."""
    phases("first", "resume")
    d = phases.runs
    first = _json(d, "first", run)
    assert first["preempted"] and first.get("global_step", first.get("stopped")) == LATE, first
    assert first["folders"] == [folder] and first["store"] == [step], first  # no folder, no composite of the notice
    assert _said(first["log"], f"step {LATE if run.startswith('trainer') else step + 1} is not saved; a restart "
                               f"resumes from the newest committed composite (step {step})"), first["log"]
    if run.startswith("accel"):
        assert first["exit"] == 75
    resumed = _json(d, "resume", run)
    assert resumed["restored"] == EVERY and resumed["steps"] == list(range(EVERY + 1, STEPS + 1))
    _assert_as_uninterrupted(d, "resume", run, run.split("_")[0] + "_ref")


def test_sigterm_is_handled_during_training_only_and_false_turns_it_off(phases, tmp_path):
    """The adapters' default: SIGTERM is a notice from the start of training (the Trainer: train(); the plugin:
    register()) until its end (the plugin: close()), when the handler found is put back; ``preemption=False``
    leaves SIGTERM alone."""
    from accelerate_helpers import Run

    phases("first")
    d = phases.runs
    on, off = _json(d, "first", "trainer_late"), _json(d, "first", "trainer_off")
    assert all(on["handled"]) and not on["handled_after"], on
    assert not any(off["handled"]) and not off["handled_after"] and not off["preempted"], off
    found = signal.getsignal(signal.SIGTERM)
    r = Run(tmp_path / "on", config=layerckpt.Config(full=True))
    assert signal.getsignal(signal.SIGTERM) not in (found, signal.SIG_DFL)
    r.plugin.close()
    assert signal.getsignal(signal.SIGTERM) == found
    r = Run(tmp_path / "off", config=layerckpt.Config(full=True, preemption=False))
    assert signal.getsignal(signal.SIGTERM) == found
    r.plugin.close()


# ------------------------------------------------------------------ 2 ranks: rank 1 alone gets the signal


@pytest.mark.parametrize("run,folder,store,step", [("trainer2", "checkpoint-6", "layerckpt", 6),
                                                    ("accel2", "checkpoint_1", "layerckpt/model_0", 1)])
def test_two_ranks_stop_at_one_step_and_both_save_it(phases, run, folder, store, step):
    """Rank 1 alone is sent SIGTERM at step SIGNAL2: both ranks agree on the next step (one boundary later), both
    save it (one data file each in its composite), and stop there."""
    ph, d = phases("first2"), phases.runs
    for r in (0, 1):
        got = _json(d, "first2", run, r)
        assert got["preempted"] and got.get("global_step", got.get("stopped")) == SIGNAL2 + 1, (r, got)
        assert got["steps"] == list(range(1, SIGNAL2 + 2)) and got["folders"][-1] == folder, (r, got)
        what = "SIGTERM" if r == 1 else "another rank's notice"
        assert _said(got["log"], f"({what}): stopping at step {SIGNAL2 + 1}"), (r, got["log"])
    assert _written_by(d / run / store, step) == [0, 1]
    if run == "accel2":  # SystemExit(75) on every rank: the launcher reports it (and ends the launch)
        assert [_json(d, "first2", run, r)["exit"] for r in (0, 1)] == [75, 75]
        assert re.search(r"exitcode\s*:\s*75\b", ph["first2"]["output"]), ph["first2"]["output"][-4000:]


@pytest.mark.parametrize("run", ["trainer2", "accel2"])
def test_two_ranks_resume_at_the_step_of_the_notice_bit_for_bit(phases, run):
    phases("first2", "resume2")
    d = phases.runs
    for r in (0, 1):
        got = _json(d, "resume2", run, r)
        assert got["restored"] == SIGNAL2 + 1 and got["steps"] == list(range(SIGNAL2 + 2, STEPS + 1)), (r, got)
        _assert_as_uninterrupted(d, "resume2", run, run[:-1] + "_ref2", r)
