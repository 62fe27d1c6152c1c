"""Fine-tune a small transformer with Lightning + layerckpt on CPU, kill it, resume it, print what it cost.

    python examples/lightning_finetune.py [--dir DIR] [--every 4] [--crash-at 170] [--json PATH]
        [--finetune 240] [--pretrain 60] [--n-layer 6] [--n-embd 128]   (smaller: a quick check, not the figures)

1. reference: pre-train on one synthetic task, then fine-tune on another with a Lightning Trainer
   and its own ModelCheckpoint (every --every steps, save_last="link"), uninterrupted;
2. the same fine-tuning with `LayerCheckpoint` in place of ModelCheckpoint, in a child process
   killed with SIGKILL at --crash-at (a flush may be in flight);
3. a new process resumes with a new Trainer and `fit(ckpt_path="last")` and finishes; ModelCheckpoint's
   checkpoint of the same step is resumed the same way in another new process, for the resume time (a
   restart's: each path's first use in its process, as after a real failure).
4. the same fine-tuning without any checkpointing, for the step-time overhead.
It prints bytes written, what training paid for checkpointing (the save itself, the wait inside the
next optimizer step for copies still running, the training time against no checkpointing over
the same steps, and per checkpoint against each run's own steps away from its saves, which the step time
of a whole process, 10-20% apart from one run to the next, does not move), resume time, and the loss after
the resume against the run that never stopped; with --json PATH, also what it measured, with the machine and the
commit that ran (the README's table is rendered from such a file).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_layerckpt import LayerCheckpoint
from layerckpt.bench import main_job
from layerckpt.bench.lightning_workload import FineTuneModule
from layerckpt.bench.machine import machine
from layerckpt.bench.workload import check_crash_resume, crash_resume_parser

FINETUNE = 240


class TimedModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, timing each save and counting the bytes it writes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.blocked_s, self.bytes, self.saves = 0.0, 0, 0

    def _save_checkpoint(self, trainer, filepath):
        t = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.blocked_s += time.perf_counter() - t
        self.bytes += os.path.getsize(filepath)
        self.saves += 1


class StepTimer(L.Callback):
    """Wall time from one training batch's start to the next one's: the step, the checkpoint saved at its
    end and, under lazy staging, the next step's wait for the copies all fall in it."""

    def __init__(self):
        self.t = None
        self.seconds = []  # seconds[i]: batch i's start to batch i+1's start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.t is not None:
            self.seconds.append(now - self.t)
        self.t = now


class ResumeTimer(L.Callback):
    """Time from the Trainer's setup to the first training step: where the restore happens."""

    def __init__(self, stop: bool = False):
        self.stop = stop
        self.t0 = self.seconds = None

    def setup(self, trainer, pl_module, stage):
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.t0
        if self.stop:
            raise _Stop()


class _Stop(Exception):
    pass


class KillAt(L.Callback):
    def __init__(self, step: int, stats_path: str, ck: LayerCheckpoint, steps: StepTimer):
        self.step, self.stats_path, self.ck, self.steps = step, stats_path, ck, steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            saves = self.ck.saves
            stats = {"save_return_s": sum(p.stall_s for p in saves), "step_wait_s": sum(p.step_wait_s for p in saves),
                     # what reached the disk (encoded) by the saves committed before the kill
                     "bytes": sum(p.bytes_all_ranks or p.bytes_written for p in saves if p.done() and not p.error),
                     "saves": len(saves), "step_s": self.steps.seconds}
            with open(self.stats_path, "w") as f:
                json.dump(stats, f)
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(root: str, steps: int, callbacks) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks, default_root_dir=root)


def model(args: argparse.Namespace, seed: int = 0) -> FineTuneModule:
    return FineTuneModule(seed=seed, n_layer=args.n_layer, n_embd=args.n_embd).pretrain(args.pretrain)


def child(args: argparse.Namespace) -> None:
    root = args.dir
    ck = LayerCheckpoint(dirpath=os.path.join(root, "layerckpt"), every_n_train_steps=args.every)
    steps = StepTimer()  # first: its batch start comes before the kill
    kill = KillAt(args.crash_at, os.path.join(root, "stats.json"), ck, steps)
    trainer(root, args.finetune, [steps, ck, kill]).fit(model(args))


def main() -> int:
    ap = crash_resume_parser(__doc__)
    ap.add_argument("--json", metavar="PATH", help="also write what the run measured, with the machine and the "
                    "commit that ran, as JSON to PATH (python -m layerckpt.bench.report renders the README's table "
                    "from it)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-resume", choices=("layerckpt", "lightning"), help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    check_crash_resume(ap, args)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    if args.child:
        child(args)
        return 0
    if args.child_resume:
        child_resume(args)
        return 0
    root, keep = args.dir or tempfile.mkdtemp(prefix="layerckpt-lightning-"), bool(args.dir)
    os.makedirs(root, exist_ok=True)
    for sub in ("layerckpt", "lightning"):
        shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    try:
        args.dir = root
        ref, ref_ck, ref_steps = reference(args)
        stats = killed_run(args)
        if stats is None:
            return 1
        resumed = resume(args)
        plain = resume_plain(args, resumed["step"])
        bare = no_checkpoints(args)
        start = resumed["step"]
        res = report(args, ref_ck, ref_steps.seconds, stats, bare.seconds, (plain["seconds"], resumed["seconds"]),
                     start, resumed["losses"], ref.losses[start:])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f)
                f.write("\n")
            print(f"wrote {args.json}")
        return 0
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def reference(args: argparse.Namespace):
    """The uninterrupted run with Lightning's own ModelCheckpoint."""
    print(f"reference: {args.finetune} fine-tuning steps after pre-training, Lightning's ModelCheckpoint every "
          f"{args.every} steps")
    ref_ck = TimedModelCheckpoint(dirpath=os.path.join(args.dir, "lightning"), every_n_train_steps=args.every,
                                  save_top_k=-1, save_last="link")
    ref, steps = model(args), StepTimer()
    trainer(args.dir, args.finetune, [steps, ref_ck]).fit(ref)
    return ref, ref_ck, steps


def killed_run(args: argparse.Namespace):
    """The LayerCheckpoint run in a child process, SIGKILLed at ``--crash-at``; what it paid, or None."""
    print(f"LayerCheckpoint run, killed with SIGKILL at step {args.crash_at} ...")
    cmd = [sys.executable, __file__, "--child", "--dir", args.dir]
    for k in ("every", "crash_at", "finetune", "pretrain", "n_layer", "n_embd"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    r = subprocess.run(cmd)
    if r.returncode != -signal.SIGKILL:
        print(f"the run was meant to be killed, it exited {r.returncode}", file=sys.stderr)
        return None
    with open(os.path.join(args.dir, "stats.json")) as f:
        return json.load(f)


def resume(args: argparse.Namespace) -> dict:
    """What a restart does: a new process, a new Trainer, fit(ckpt_path="last") to the end."""
    out = _child_resume(args, "layerckpt")
    steps = sorted(set(out["layers"].values()))
    print(f"resumed from the composite of step {out['step']}: layers persisted at steps {steps}, "
          f"max staleness {out['max_staleness']} checkpoints")
    return out


def resume_plain(args: argparse.Namespace, start: int) -> dict:
    """ModelCheckpoint's checkpoint of the same step, resumed the same way in a new process (timed, then stopped)."""
    return _child_resume(args, "lightning", start)


def _child_resume(args: argparse.Namespace, which: str, start: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child-resume", which, "--start", str(start), "--dir", args.dir]
    for k in ("every", "crash_at", "finetune", "pretrain", "n_layer", "n_embd"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    subprocess.run(cmd, check=True)
    with open(os.path.join(args.dir, f"resume-{which}.json")) as f:
        return json.load(f)


def child_resume(args: argparse.Namespace) -> None:
    """One resume in this new process; the model is not pre-trained first: the restore must set every weight."""
    resumed = FineTuneModule(seed=1, n_layer=args.n_layer, n_embd=args.n_embd)
    if args.child_resume == "layerckpt":
        ck = LayerCheckpoint(dirpath=os.path.join(args.dir, "layerckpt"), every_n_train_steps=args.every)
        timer = ResumeTimer()
        trainer(args.dir, args.finetune, [ck, timer]).fit(resumed, ckpt_path="last")
        info = ck.restored
        out = {"step": info["step"], "layers": info["layers"], "max_staleness": info["max_staleness"],
               "losses": resumed.losses}
    else:
        plain = os.path.join(args.dir, "lightning", f"epoch=0-step={args.start}.ckpt")
        timer = ResumeTimer(stop=True)
        try:
            trainer(args.dir, args.finetune, [timer]).fit(resumed, ckpt_path=plain)
        except _Stop:
            pass
        out = {}
    out["seconds"] = timer.seconds
    with open(os.path.join(args.dir, f"resume-{args.child_resume}.json"), "w") as f:
        json.dump(out, f)


def no_checkpoints(args: argparse.Namespace) -> StepTimer:
    """The same fine-tuning steps without checkpointing: the step time the others are measured against."""
    steps = args.crash_at
    print(f"the same {steps} steps without checkpointing, for the step-time overhead ...")
    timer = StepTimer()
    trainer(args.dir, steps + 1, [timer]).fit(model(args))
    return timer


def report(args: argparse.Namespace, ref_ck: TimedModelCheckpoint, ref_step_s, stats, bare_step_s, resumes,
           start: int, after, want) -> dict:
    """What the run measured (:func:`layerckpt.bench.main_job.result`), printed as its table."""
    res = main_job.result(
        {k: getattr(args, k) for k in ("every", "crash_at", "finetune", "pretrain", "n_layer", "n_embd")}, machine(),
        {"bytes": ref_ck.bytes, "blocked_s": ref_ck.blocked_s, "saves": ref_ck.saves},
        {k: stats[k] for k in ("bytes", "save_return_s", "step_wait_s", "saves")},
        {"none": bare_step_s, "ModelCheckpoint": ref_step_s, "LayerCheckpoint": stats["step_s"]},
        {"ModelCheckpoint": resumes[0], "LayerCheckpoint": resumes[1]}, start, after, want)
    print()
    print(main_job.format_table(res))
    return res


if __name__ == "__main__":
    sys.exit(main())
