"""Fine-tune a small transformer with layerckpt on CPU, crash it, resume it, and print what it cost.

    python examples/finetune.py [--dir DIR] [--crash-at 170]

1. a reference run: pre-train on one synthetic task, fine-tune on another, checkpointing every
   --every steps with torch.save (+ fsync), the usual way;
2. the same run with layerckpt, killed with SIGKILL part-way (in a child process);
3. a fresh process restores the newest committed checkpoint and finishes the run.
It prints bytes written, time training was blocked, resume time, and the loss after resume
against the uninterrupted run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

import layerckpt
from layerckpt.bench.workload import (check_crash_resume, crash_resume_parser, make_model, make_optimizer, run,
                                      start_finetune)

PRETRAIN, FINETUNE = 60, 240


def reference(root: str, every: int) -> dict:
    """The uninterrupted run, checkpointing with torch.save + fsync."""
    model = make_model(0)
    opt = make_optimizer(model)
    run(model, opt, "count", 0, PRETRAIN)
    start_finetune(opt)
    blocked, written = 0.0, 0
    path = os.path.join(root, "torch.pt")

    def ckpt(step: int, loss: float) -> None:
        nonlocal blocked, written
        if (step + 1) % every == 0:
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            blocked += time.perf_counter() - t
            written += os.path.getsize(path)

    losses = run(model, opt, "affine", 0, FINETUNE, ckpt)
    t = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    m2 = make_model(1)
    o2 = make_optimizer(m2)
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["optim"])
    return {"losses": losses, "blocked_s": blocked, "bytes": written, "resume_s": time.perf_counter() - t}


def child(root: str, every: int, crash_at: int, config: str) -> None:
    """The layerckpt run that dies: SIGKILL while a flush may be in flight."""
    model = make_model(0)
    opt = make_optimizer(model)
    run(model, opt, "count", 0, PRETRAIN)
    start_finetune(opt)
    cfg = layerckpt.Config.from_dict(json.loads(config))
    ck = layerckpt.Checkpointer(os.path.join(root, "layerckpt"), model, opt, config=cfg)
    stats = {"blocked_s": 0.0, "bytes": 0}
    saves = []

    def ckpt(step: int, loss: float) -> None:
        if step == crash_at:
            # under lazy staging the step after a save waits for its copies: training pays that too
            # what reached the disk (encoded) by the saves committed before the kill
            stats["bytes"] = sum(p.bytes_written for p in saves if p.done() and not p.error)
            stats["save_return_s"] = stats["blocked_s"]
            stats["blocked_s"] += sum(p.step_wait_s for p in saves)
            with open(os.path.join(root, "stats.json"), "w") as f:
                json.dump(stats, f)
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % every == 0:
            t = time.perf_counter()
            p = ck.save(step + 1, extra={"finetune_step": step + 1}, loss=loss)
            stats["blocked_s"] += time.perf_counter() - t
            saves.append(p)

    run(model, opt, "affine", 0, FINETUNE, ckpt)


def main() -> int:
    ap = crash_resume_parser(__doc__, model=False)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="{}",
                    help='layerckpt Config fields as JSON, e.g. \'{"threshold": 0.0}\' for full checkpoints')
    args = ap.parse_args()
    check_crash_resume(ap, args, FINETUNE)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    if args.child:
        child(args.dir, args.every, args.crash_at, args.config)
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="layerckpt-example-")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(os.path.join(root, "layerckpt"), ignore_errors=True)
    try:
        print(f"reference run: {PRETRAIN} pre-training + {FINETUNE} fine-tuning steps, torch.save every {args.every}")
        ref = reference(root, args.every)
        print(f"layerckpt run, killed at fine-tuning step {args.crash_at} ...")
        r = subprocess.run([sys.executable, __file__, "--child", "--dir", root, "--every", str(args.every),
                            "--crash-at", str(args.crash_at), "--config", args.config])
        assert r.returncode == -signal.SIGKILL, f"the run was meant to be killed, it exited {r.returncode}"
        with open(os.path.join(root, "stats.json")) as f:
            stats = json.load(f)

        # a fresh process would do exactly this
        model = make_model(1)
        opt = make_optimizer(model)
        t = time.perf_counter()
        rep = layerckpt.restore(os.path.join(root, "layerckpt"), model, opt)
        resume_s = time.perf_counter() - t
        start = rep.extra["finetune_step"]
        steps = sorted(set(rep.layers.values()))
        print(f"resumed from the composite of step {start} in {resume_s * 1e3:.0f} ms: layers persisted at steps "
              f"{steps}, max staleness {rep.max_staleness} checkpoints")
        after = run(model, opt, "affine", start, FINETUNE)
        want = ref["losses"][start:]
        rel = max(abs(a - b) / abs(b) for a, b in zip(after, want))
        exact = after == want

        n_ref = (args.crash_at + 1) // args.every  # torch.save checkpoints over the same steps
        ref_bytes = ref["bytes"] / (FINETUNE // args.every) * n_ref
        ref_blocked = ref["blocked_s"] / (FINETUNE // args.every) * n_ref
        print()
        print(f"over the {n_ref} checkpoints before the crash   {'torch.save':>12} {'layerckpt':>12} {'ratio':>8}")
        print(f"  bytes written                         {ref_bytes / 1e6:>10.1f}MB {stats['bytes'] / 1e6:>10.1f}MB "
              f"{ref_bytes / max(stats['bytes'], 1):>7.1f}x")
        print(f"  save() returned after                 {ref_blocked * 1e3:>10.0f}ms "
              f"{stats['save_return_s'] * 1e3:>10.0f}ms")
        print(f"  training blocked (+ next step's wait) {ref_blocked * 1e3:>10.0f}ms {stats['blocked_s'] * 1e3:>10.0f}ms "
              f"{ref_blocked / max(stats['blocked_s'], 1e-9):>7.1f}x")
        print(f"  resume (restore model + optimizer)    {ref['resume_s'] * 1e3:>10.0f}ms {resume_s * 1e3:>10.0f}ms "
              f"{ref['resume_s'] / resume_s:>7.1f}x")
        mean_rel = abs(sum(after) - sum(want)) / sum(want)
        print(f"  loss after resume vs uninterrupted    mean over the {len(after)} steps after resume within "
              f"{mean_rel * 100:.3f}% ({'bit-identical' if exact else f'max step difference {rel * 100:.2f}%'}); "
              f"final loss {after[-1]:.4f} vs {want[-1]:.4f}")
        return 0
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
