"""The documented commands run end to end, small: the README's main job (examples/lightning_finetune.py),
`layerckpt bench --steps` (docs/performance.md) and `layerckpt bench --policy --plot` (docs/selection.md).  Each
in a new process, as a user runs it: exit 0 and the lines that carry its figures (a smoke test, not a
measurement)."""
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN_JOB = os.path.join(HERE, os.pardir, "examples", "lightning_finetune.py")
PNG = b"\x89PNG\r\n\x1a\n"


def _run(cmd, timeout: int = 300) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _lines(out: str, *starts: str) -> None:
    """Every one of ``starts`` begins a line of ``out`` (leading blanks aside)."""
    lines = [line.strip() for line in out.splitlines()]
    for s in starts:
        assert any(line.startswith(s) for line in lines), (s, out)


def test_main_job_runs_small(tmp_path):
    """Pre-train, fine-tune with ModelCheckpoint, the same with LayerCheckpoint killed by SIGKILL, resume, report:
    a 2-block model, 5 pre-training and 12 fine-tuning steps, a checkpoint every 3, the kill at step 7."""
    out = _run([sys.executable, MAIN_JOB, "--dir", str(tmp_path), "--finetune", "12", "--crash-at", "7", "--every",
                "3", "--pretrain", "5", "--n-layer", "2", "--n-embd", "32", "--json", str(tmp_path / "job.json")])
    _lines(out, "reference: 12 fine-tuning steps after pre-training, Lightning's ModelCheckpoint every 3 steps",
           "LayerCheckpoint run, killed with SIGKILL at step 7 ...",
           "the same 7 steps without checkpointing, for the step-time overhead ...",
           "over the 2 checkpoints before the kill", "bytes written", "save() returned after",
           "= training blocked by the saves", "step-time overhead vs no checkpoints",
           "per checkpoint, against the run's own", "resume in a new process", "(Trainer setup to the first step: reading the checkpoint and putting the state back)",
           "loss after resume vs uninterrupted")
    # the newest composite committed before the kill: step 6, or step 3 where 6's flush was still running
    start = int(re.search(r"^resumed from the composite of step (\d+): ", out, re.M).group(1))
    assert start in (3, 6), out
    assert f"mean over the {12 - start} steps after the resume within " in out
    # the resumed run went on to the end, saving as it went (the default keep_last=2)
    assert sorted(os.listdir(tmp_path / "layerckpt" / "manifests")) == ["step-00000009.json", "step-00000012.json"]
    # --json: what it measured, with the machine; the README's table is this object rendered, the text it printed
    from layerckpt.bench import main_job, report

    with open(tmp_path / "job.json") as f:
        res = json.load(f)
    assert res["main_job"]["crash_at"] == 7 and res["resumed_step"] == start and "commit" in res["machine"]
    assert main_job.format_table(res) in out
    assert report.view_of(res) == "main-job"


def test_main_job_prices_a_checkpoint_against_its_own_quiet_steps():
    """The per-checkpoint row: each run's steps beyond the median of its steps that neither save nor follow a
    save, per save; a run whose every step was slower by the same amount (another process) costs the same."""
    from layerckpt.bench import main_job as job

    every, span = 4, slice(1, 41)  # batches 1-40: saves at the ends of batches 3, 7, ..., 39 (10 saves)
    for base in (0.040, 0.050):
        steps = [base] * 41
        for i in range(3, 41, 4):
            steps[i] += 0.045  # the save
            if i + 1 < 41:
                steps[i + 1] += 0.010  # the step after it waits for the copies
        ms, got_base = job.per_checkpoint(steps, every, span)
        assert got_base == pytest.approx(base * 1e3) and ms == pytest.approx(45 + 10)
    assert job.per_checkpoint([0.04] * 41, 2, span) is None  # every step is next to a save: no baseline


def test_bench_steps_runs_small(tmp_path):
    out = _run([sys.executable, "-m", "layerckpt.cli", "bench", "--steps", "--size", "tiny", "--steps-n", "1",
                "--dir", str(tmp_path)])
    _lines(out, "layerckpt bench --steps: tiny + AdamW, a checkpoint after every step, 1 steps measured after",
           "checkpointing", "none ", "layerckpt ", "dcp async_save ", "torchsnapshot async_take ")
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself


def test_bench_steps_every_rounds_runs_small(tmp_path):
    out = _run([sys.executable, "-m", "layerckpt.cli", "bench", "--steps", "--size", "tiny", "--steps-n", "2",
                "--steps-every", "2", "--steps-rounds", "3", "--dir", str(tmp_path)])
    _lines(out, "layerckpt bench --steps: tiny + AdamW, a full checkpoint every 2 steps, 2 steps measured after",
           "checkpointing", "none ", "layerckpt ", "layerckpt delta ", "layerckpt off ", "dcp async_save ")
    assert "(each contender 3 times, each round in the reverse order of the one before, the disk settled" in out
    # one ratio of the default's total time to off's per round, then their mean's
    assert re.search(r"^the default against encoding='off': [0-9.]+x the mean total time of the measured steps "
                     r"\(by round: [0-9.]+x, [0-9.]+x, [0-9.]+x\)$", out, re.M), out
    assert not list(tmp_path.iterdir())


# the policy bench has no option for a workload's length: the command's own entry point, run on one workload
# shortened to 20 steps (4 saves) in the process that runs it
POLICY = """
import sys
from layerckpt import cli
from layerckpt.bench.family import WORKLOADS
WORKLOADS["cnn"].steps = 20
sys.exit(cli.main(["bench", "--policy", "--workloads", "cnn", "--plot", sys.argv[1], "--dir", sys.argv[2]]))
"""


def test_bench_policy_plot_runs_small(tmp_path):
    import matplotlib  # noqa: F401
    plot, work = tmp_path / "frontier.png", tmp_path / "work"
    work.mkdir()
    out = _run([sys.executable, "-c", POLICY, str(plot), str(work)])
    _lines(out, "selection: fidelity=", "steps lost per crash")
    assert re.search(r"^cnn +auto +4 +[0-9.]+x +[0-9.]+x ", out, re.M), out  # encoding, 4 saves; raw, written
    assert re.search(r"^cnn .* k1 [0-9.]+M/[0-9.]+ +k2 [0-9.]+M/[0-9.]+ +k4 [0-9.]+M/[0-9.]+", out, re.M), out
    with open(plot, "rb") as f:
        head = f.read(len(PNG))
    assert head == PNG and plot.stat().st_size > 1000, plot.stat().st_size
    assert not list(work.iterdir())  # each workload's store is removed after its row
