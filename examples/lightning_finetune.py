"""Fine-tune a small transformer with Lightning + layerckpt on CPU, kill it, resume it, print what it cost.

    python examples/lightning_finetune.py [--dir DIR] [--every 4] [--crash-at 170]

1. reference: pre-train on one synthetic task, then fine-tune on another with a Lightning Trainer
   and its own ModelCheckpoint (every --every steps, save_last="link"), uninterrupted;
2. the same fine-tuning with `LayerCheckpoint` in place of ModelCheckpoint, in a child process
   killed with SIGKILL at --crash-at (a flush may be in flight);
3. a new Trainer resumes with `fit(ckpt_path="last")` and finishes; ModelCheckpoint's last
   checkpoint of the same step is resumed too, for the resume time.
It prints bytes written, time training was blocked by checkpointing, resume time, and the loss
after the resume against the run that never stopped.
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
from layerckpt.bench.lightning_workload import FineTuneModule

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
    def __init__(self, step: int, stats_path: str, ck: LayerCheckpoint):
        self.step, self.stats_path, self.ck = step, stats_path, ck

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            stats = {"blocked_s": sum(p.stall_s for p in self.ck.saves), "bytes": sum(p.nbytes for p in self.ck.saves),
                     "saves": len(self.ck.saves)}
            with open(self.stats_path, "w") as f:
                json.dump(stats, f)
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(root: str, steps: int, callbacks) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks, default_root_dir=root)


def model(seed: int = 0) -> FineTuneModule:
    return FineTuneModule(seed=seed).pretrain()


def child(root: str, every: int, crash_at: int) -> None:
    ck = LayerCheckpoint(dirpath=os.path.join(root, "layerckpt"), every_n_train_steps=every)
    trainer(root, FINETUNE, [ck, KillAt(crash_at, os.path.join(root, "stats.json"), ck)]).fit(model())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="working directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--every", type=int, default=4, help="checkpoint every N fine-tuning steps")
    ap.add_argument("--crash-at", type=int, default=170, help="fine-tuning step at which the run is killed")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    if args.child:
        child(args.dir, args.every, args.crash_at)
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="layerckpt-lightning-")
    os.makedirs(root, exist_ok=True)
    for sub in ("layerckpt", "lightning"):
        shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    try:
        print(f"reference: {FINETUNE} fine-tuning steps after pre-training, Lightning's ModelCheckpoint every "
              f"{args.every} steps")
        ref_ck = TimedModelCheckpoint(dirpath=os.path.join(root, "lightning"), every_n_train_steps=args.every,
                                      save_top_k=-1, save_last="link")
        ref = model()
        trainer(root, FINETUNE, [ref_ck]).fit(ref)

        print(f"LayerCheckpoint run, killed with SIGKILL at step {args.crash_at} ...")
        r = subprocess.run([sys.executable, __file__, "--child", "--dir", root, "--every", str(args.every),
                            "--crash-at", str(args.crash_at)])
        if r.returncode != -signal.SIGKILL:
            print(f"the run was meant to be killed, it exited {r.returncode}", file=sys.stderr)
            return 1
        with open(os.path.join(root, "stats.json")) as f:
            stats = json.load(f)

        # a new process would do exactly this: a new Trainer, fit(ckpt_path="last")
        resumed = model(seed=1)
        ck = LayerCheckpoint(dirpath=os.path.join(root, "layerckpt"), every_n_train_steps=args.every)
        timer = ResumeTimer()
        trainer(root, FINETUNE, [ck, timer]).fit(resumed, ckpt_path="last")
        info = ck.restored
        start = info["step"]
        steps = sorted(set(info["layers"].values()))
        print(f"resumed from the composite of step {start}: layers persisted at steps {steps}, "
              f"max staleness {info['max_staleness']} checkpoints")

        # ModelCheckpoint's checkpoint of the same step, resumed the same way (timed, then stopped)
        plain = os.path.join(root, "lightning", f"epoch=0-step={start}.ckpt")
        plain_timer = ResumeTimer(stop=True)
        try:
            trainer(root, FINETUNE, [plain_timer]).fit(model(seed=1), ckpt_path=plain)
        except _Stop:
            pass

        after, want = resumed.losses, ref.losses[start:]
        n = stats["saves"]  # ModelCheckpoint's saves over the same steps
        ref_bytes = ref_ck.bytes / ref_ck.saves * n
        ref_blocked = ref_ck.blocked_s / ref_ck.saves * n
        mean_rel = abs(sum(after) - sum(want)) / sum(want)
        print()
        print(f"over the {n} checkpoints before the kill     {'ModelCheckpoint':>16} {'LayerCheckpoint':>16} {'ratio':>8}")
        print(f"  bytes written                         {ref_bytes / 1e6:>14.1f}MB {stats['bytes'] / 1e6:>14.1f}MB "
              f"{ref_bytes / max(stats['bytes'], 1):>7.1f}x")
        print(f"  training blocked                      {ref_blocked * 1e3:>14.0f}ms {stats['blocked_s'] * 1e3:>14.0f}ms "
              f"{ref_blocked / max(stats['blocked_s'], 1e-9):>7.1f}x")
        print(f"  resume (Trainer setup to first step)  {plain_timer.seconds * 1e3:>14.0f}ms "
              f"{timer.seconds * 1e3:>14.0f}ms {plain_timer.seconds / timer.seconds:>7.1f}x")
        print(f"  loss after resume vs uninterrupted    mean over the {len(after)} steps after the resume within "
              f"{mean_rel * 100:.3f}%{' (bit-identical)' if after == want else ''}; final loss {after[-1]:.4f} vs "
              f"{want[-1]:.4f}")
        return 0
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
