"""Preemption (layerckpt.preempt): a notice (a real SIGTERM, sent by one rank to its own process) becomes one committed
checkpoint at one step every rank agrees on, and a restart resumes at that step with nothing redone.

tests/preempt_helpers.py runs the processes: the plain loop (one rank, and two under torchrun with DDP on gloo) and
Lightning (one process, and DDP over two).  Each scenario runs uninterrupted (``ref``), stopped by a notice at step 6
(``notice``) and resumed (``resume``); saves are full, so the resume is bit-exact against ``ref``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import layerckpt
from layerckpt import preempt
from layerckpt.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "preempt_helpers.py")
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, HERE)
import preempt_helpers as ph  # noqa: E402


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LAYERCKPT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "TORCHELASTIC_", "PL_"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def _run(kind: str, root, mode: str, ranks: int = 1, **opts) -> subprocess.CompletedProcess:
    args = [HELPER, kind, str(root), mode, *(f"{k}={v}" for k, v in opts.items())]
    if kind == "plain" and ranks > 1:
        cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(ranks), *args]
    else:
        cmd = [sys.executable, *args] + ([f"devices={ranks}"] if kind == "lightning" else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())


def _out(root, mode: str, rank: int) -> dict:
    with open(os.path.join(root, f"{mode}.rank{rank}.json")) as f:
        return json.load(f)


def _same_state(root, a: str, b: str, rank: int) -> None:
    x = torch.load(os.path.join(root, f"{a}.rank{rank}.pt"), weights_only=True)
    y = torch.load(os.path.join(root, f"{b}.rank{rank}.pt"), weights_only=True)
    assert x["model"].keys() == y["model"].keys()
    for k in x["model"]:
        assert torch.equal(x["model"][k], y["model"][k]), k
    for i, s in x["optim"]["state"].items():
        for k, v in s.items():
            w = y["optim"]["state"][i][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (i, k)


def _story(kind: str, root, ranks: int, stop: int, **opts) -> None:
    """ref, notice, resume: the notice stops every rank at ``stop`` with that step committed; the resume restores
    it (nothing redone) and ends where the uninterrupted run ended, bit for bit."""
    for mode in ("ref", "notice", "resume"):
        r = _run(kind, root, mode, ranks, **(opts if mode == "notice" else {}))
        outs = [_out(root, mode, rank) for rank in range(ranks)]  # every rank got to its end
        if mode == "notice":
            assert [o["stopped"] for o in outs] == [stop] * ranks, (outs, r.stderr[-3000:])
            assert [o["exit"] for o in outs] == [layerckpt.EXIT_PREEMPTED] * ranks
            assert "preemption notice (" in r.stderr, r.stderr[-3000:]
            assert f"step {stop} committed" in r.stderr, r.stderr[-3000:]
            assert layerckpt.read_checkpoint(os.path.join(root, "store")).step == stop
        else:
            assert r.returncode == 0, f"{mode}: {r.stderr[-3000:]}"
    for rank in range(ranks):
        assert _out(root, "resume", rank)["restored"] == stop  # 0 steps redone
        _same_state(root, "ref", "resume", rank)


def test_plain_loop_one_process_saves_the_step_of_the_notice_and_resumes_there(tmp_path):
    _story("plain", tmp_path, 1, stop=ph.SIGNAL_AT)


def test_plain_loop_two_ranks_one_signalled_agree_on_the_next_step(tmp_path):
    """Only rank 1 gets SIGTERM (at step 6): both ranks learn of it at the next boundary and save step 7."""
    _story("plain", tmp_path, 2, stop=ph.SIGNAL_AT + 1)


def test_lightning_one_process_stops_on_sigterm_by_default_and_resumes_at_its_step(tmp_path):
    _story("lightning", tmp_path, 1, stop=ph.SIGNAL_AT)
    assert _out(tmp_path, "resume", 0)["global_step"] == ph.STEPS


def test_lightning_a_sigterm_before_layercheckpoints_handler_is_still_saved_on(tmp_path):
    """The notice comes at the fit's start, to Lightning's handler (ours is installed once the Checkpointer opens):
    LayerCheckpoint takes it over, so Lightning's SIGTERMException does not end the fit unsaved."""
    _story("lightning", tmp_path, 1, stop=1, early=1)


def test_lightning_ddp_one_rank_signalled_both_stop_at_one_step(tmp_path):
    _story("lightning", tmp_path, 2, stop=ph.SIGNAL_AT + 1)


def test_a_grace_too_short_saves_nothing_and_says_why(tmp_path):
    """A save takes longer than the time left: none is started; the restart resumes from step 4, whole."""
    r = _run("plain", tmp_path, "notice", grace_s="0.0001")
    out = _out(tmp_path, "notice", 0)
    assert out["stopped"] == ph.SIGNAL_AT and out["exit"] == layerckpt.EXIT_PREEMPTED
    assert "is not saved; a restart resumes from the newest committed composite (step 4)" in r.stderr, r.stderr[-2000:]
    store = os.path.join(tmp_path, "store")
    assert sorted(os.listdir(os.path.join(store, "manifests"))) == ["step-00000004.json"]
    assert layerckpt.read_checkpoint(store).step == 4
    _run("plain", tmp_path, "resume")
    assert _out(tmp_path, "resume", 0)["restored"] == 4


@pytest.mark.parametrize("fault", ["flush.written", "commit.before", "tier.data-copied"])
def test_a_notice_during_a_save_in_flight_leaves_one_committed_composite(tmp_path, fault):
    """The notice arrives while a save is at ``fault`` (on the flusher thread; with a remote tier, during
    its upload): that save commits, the notice is acted on at the next boundary (step 5 saved), nothing hangs, and
    the remote holds the agreed step once the deadline allows."""
    remote = tmp_path / "remote"
    fault_opts = dict(fault=fault, remote=f"file://{remote}") if fault.startswith("tier.") else dict(fault=fault)
    # the fault is armed at step 6: the save of step 8 meets it
    t0 = time.monotonic()
    r = _run("plain", tmp_path, "notice", **fault_opts)
    assert time.monotonic() - t0 < 120
    out = _out(tmp_path, "notice", 0)
    assert out["exit"] == layerckpt.EXIT_PREEMPTED, r.stderr[-3000:]
    store = os.path.join(tmp_path, "store")
    stop = out["stopped"]
    # the save of step 8 meets a flush or commit point; an upload (of step 4's composite, or 8's) may meet it sooner
    allowed = (8, 9) if not fault.startswith("tier.") else range(ph.SIGNAL_AT, ph.STEPS + 1)
    assert stop in allowed, (stop, r.stderr[-2000:])
    steps = sorted(int(n[5:13]) for n in os.listdir(os.path.join(store, "manifests")))
    assert steps[-1] == stop, steps
    if fault.startswith("tier."):
        assert layerckpt.read_checkpoint(f"file://{remote}").step == stop
    _run("plain", tmp_path, "resume")
    assert _out(tmp_path, "resume", 0)["restored"] == stop


# ------------------------------------------------------------------ in this process: the handler and the agreement


def test_config_names_signals_and_refuses_what_cannot_be_handled():
    assert preempt.signal_names(None) is None and preempt.signal_names(None, ("SIGTERM",)) == ("SIGTERM",)
    assert preempt.signal_names(True) == ("SIGTERM",) and preempt.signal_names(False) is None
    assert preempt.signal_names(["term", "SIGUSR1"]) == ("SIGTERM", "SIGUSR1")
    assert preempt.signal_names([]) == ()
    with pytest.raises(ConfigError, match="'SIGKILL' is not a signal this process can handle"):
        layerckpt.Config(preemption="SIGKILL")
    with pytest.raises(ConfigError, match="grace_s must be >= 0.0"):
        layerckpt.Config(preemption=True, grace_s=-1)


def test_handlers_are_installed_only_when_on_and_put_back_at_close(tmp_path):
    model = torch.nn.Linear(4, 4)
    before = signal.getsignal(signal.SIGTERM)
    with layerckpt.Checkpointer(tmp_path / "off", model):
        assert signal.getsignal(signal.SIGTERM) is before  # a plain Checkpointer leaves signals alone
    ck = layerckpt.Checkpointer(tmp_path / "on", model, config=layerckpt.Config(preemption=["SIGTERM", "SIGUSR1"]))
    assert signal.getsignal(signal.SIGTERM) != before and signal.getsignal(signal.SIGUSR1) != before
    ck.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_notice_by_call_takes_its_deadline_and_needs_preemption_on(tmp_path):
    model = torch.nn.Linear(4, 4)
    with layerckpt.Checkpointer(tmp_path / "off", model) as ck:
        with pytest.raises(ConfigError, match="preempt\\(\\) needs Config\\(preemption=...\\) on"):
            ck.preempt(5)
    with layerckpt.Checkpointer(tmp_path / "call", model, config=layerckpt.Config(preemption=[])) as ck:
        assert not ck.preempted(1)
        t = time.time()
        ck.preempt(20)
        d = ck.notice(2)
        assert d is not None and 19 < d - t < 21
        assert ck.notice(3) is None  # once


def test_a_second_signal_keeps_the_first_deadline_and_does_not_kill(tmp_path):
    model = torch.nn.Linear(4, 4)
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(preemption=True, grace_s=50)) as ck:
        os.kill(os.getpid(), signal.SIGTERM)
        first = ck._notice.received
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck._notice.received == first and first[0] == "SIGTERM"
        assert ck.preempted(3)
        assert layerckpt.read_checkpoint(str(tmp_path)).step == 3


# ------------------------------------------------------------------ layerckpt launch: no restart after a notice

LOOP = """
import os, sys, time, torch, layerckpt
root = sys.argv[1]
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
ck = layerckpt.Checkpointer(os.path.join(root, "store"), m, opt, config=layerckpt.Config(preemption=True, full=True))
with open(os.path.join(root, "attempts"), "a") as f:
    f.write(os.environ.get("LAYERCKPT_RESTART_COUNT", "?") + "\\n")
for step in range(1, 100000):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    open(os.path.join(root, "step"), "w").write(str(step))
    if ck.preempted(step):
        ck.close()
        sys.exit(layerckpt.EXIT_PREEMPTED)
    time.sleep(0.02)
"""


def _until_file(path: str, timeout: float = 120) -> None:
    t = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < t, path
        time.sleep(0.05)


def test_launch_passes_the_notice_on_and_does_not_restart_a_preempted_job(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", "launch", "--max-restarts", "3", str(script),
                          str(tmp_path)], stderr=subprocess.PIPE, text=True, env=_env())
    _until_file(str(tmp_path / "step"))
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == layerckpt.EXIT_PREEMPTED, err[-2000:]
    assert (tmp_path / "attempts").read_text() == "0\n"  # the attempt was not restarted
    stopped = int((tmp_path / "step").read_text())
    assert layerckpt.read_checkpoint(str(tmp_path / "store")).step == stopped  # the step it stopped at, committed


def test_launch_passes_sigusr1_to_the_attempt(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP.replace("preemption=True", "preemption='SIGUSR1', grace_s=60"))
    p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", "launch", str(script), str(tmp_path)],
                         stderr=subprocess.PIPE, text=True, env=_env())
    _until_file(str(tmp_path / "step"))
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=120)
    assert p.returncode == layerckpt.EXIT_PREEMPTED, err[-2000:]
    assert "notice of preemption, its checkpoint handled; no restart here" in err
    assert "preemption notice (SIGUSR1)" in err
