"""Fine-tune a small GPT-2 with transformers' Trainer and layerckpt, crash it, resume it, compare.

    python examples/transformers_finetune.py [--dir DIR] [--crash-at 170]

The model is built from a GPT2Config (nothing is downloaded) and pre-trained for a few steps on one synthetic
task, then fine-tuned with Trainer on another:
1. a reference run: plain Trainer, a checkpoint every --every steps (model.safetensors + optimizer.pt in every
   folder), then Trainer's own resume from its newest folder, timed;
2. the same run with ``transformers_layerckpt.attach(trainer)``, killed with SIGKILL at fine-tuning step
   --crash-at (a flush may be in flight);
3. a fresh process calls ``trainer.train(resume_from_checkpoint=True)`` (the newest complete folder) and finishes.
Each phase runs in a child process.  It prints bytes written, the time training paid per checkpoint and resume
time against plain Trainer, and the loss after resume against the run that never stopped.
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
from typing import Any, Dict, List

import torch

from layerckpt.bench.workload import check_crash_resume, crash_resume_parser, folder_bytes

PHASES = ("reference", "crash", "resume")


# ---------------------------------------------------------------------- the training (child processes)

def _model(args: argparse.Namespace, pretrain: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    from layerckpt.bench.workload import SEQ, VOCAB, batch

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=args.n_embd, n_layer=args.n_layer,
                                       n_head=4))
    if pretrain:  # not checkpointed: every run starts fine-tuning from the same weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(args.pretrain):
            x, _ = batch("count", step, args.batch_size)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model


def _dataset(args: argparse.Namespace) -> List[Dict[str, torch.Tensor]]:
    from layerckpt.bench.workload import batch

    rows = torch.cat([batch("affine", i, 1)[0] for i in range(args.finetune * args.batch_size)])
    return [{"input_ids": r, "labels": r} for r in rows]


def _timer(role: str, args: argparse.Namespace, out: Dict[str, Any]):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """What each checkpoint cost training (from the end of its step to Trainer's on_save; layerckpt's lazy
        staging may also make a later optimizer step wait), its bytes, and the SIGKILL of the crash run."""

        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.pending: List[Any] = []  # layerckpt's saves, whose copies a later optimizer step may wait for

        def on_train_begin(self, a, state, control, **kw):
            out.setdefault("resume_s", time.perf_counter() - self.t)

        def on_step_end(self, a, state, control, **kw):
            self.t = time.perf_counter()
            if role == "crash" and state.global_step == args.crash_at:
                out["step_wait_s"] = sum(p.step_wait_s for p in self.pending)  # training paid that too
                # what reached the disk (encoded) once committed; what was staged for a save still flushing
                out["store_bytes"] = [p.bytes_all_ranks if p.done() and not p.error else p.nbytes
                                      for p in self.pending]
                with open(os.path.join(args.dir, f"{role}.json"), "w") as f:
                    json.dump(out, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_save(self, a, state, control, **kw):
            lc = getattr(self, "layerckpt", None)
            if lc is not None:
                self.pending.append(lc.last_save)
            out["saves"].append({"blocked_s": time.perf_counter() - self.t,
                                 "bytes": folder_bytes(os.path.join(a.output_dir, f"checkpoint-{state.global_step}"))})

    return Timer()


def child(role: str, args: argparse.Namespace) -> None:
    from transformers import Trainer, TrainingArguments

    import transformers_layerckpt

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core for the background flusher
    out: Dict[str, Any] = {"saves": [], "losses": {}}
    timer = _timer(role, args, out)
    targs = TrainingArguments(os.path.join(args.dir, "plain" if role == "reference" else "layerckpt"),
                              max_steps=args.finetune, save_steps=args.every, save_total_limit=args.total_limit,
                              per_device_train_batch_size=args.batch_size, learning_rate=3e-4,
                              lr_scheduler_type="constant",
                              logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=_model(args, pretrain=role != "resume"), args=targs, train_dataset=_dataset(args),
                      callbacks=[timer])
    if role != "reference":
        timer.layerckpt = transformers_layerckpt.attach(trainer)  # Config from $LAYERCKPT_CONFIG, else defaults
    if role == "resume":
        timer.t = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if role == "resume" else None)
    out["losses"] = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if role == "resume":
        r = timer.layerckpt.last_restore
        out["restored"] = {"step": r.step, "layer_steps": sorted(set(r.layers.values())),
                           "max_staleness": r.max_staleness}
    else:  # plain Trainer's own resume from its newest folder, timed the same way
        out.pop("resume_s", None)
        again = Trainer(model=_model(args, pretrain=False), args=targs, train_dataset=_dataset(args), callbacks=[timer])
        timer.t = time.perf_counter()
        again.train(resume_from_checkpoint=True)
    with open(os.path.join(args.dir, f"{role}.json"), "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------- the story (launcher process)

def _spawn(role: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--dir", args.dir]
    for k in ("pretrain", "finetune", "every", "crash_at", "n_layer", "n_embd", "batch_size", "total_limit"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return subprocess.run(cmd).returncode


def summarize(args: argparse.Namespace) -> Dict[str, Any]:
    ref, crash, res = ({**json.load(open(os.path.join(args.dir, f"{p}.json")))} for p in PHASES)
    n = len(crash["saves"])  # checkpoints before the crash
    ref_bytes, lc_bytes = (sum(s["bytes"] for s in r["saves"][:n]) + sum(r.get("store_bytes", [])[:n])
                           for r in (ref, crash))
    blocked = [sum(s["blocked_s"] for s in r["saves"][:n]) + r.get("step_wait_s", 0.0) for r in (ref, crash)]
    start = res["restored"]["step"]
    steps = [s for s in ref["losses"] if int(s) > start]
    after, want = [res["losses"][s] for s in steps], [ref["losses"][s] for s in steps]
    return {"checkpoints": n, "resumed_at": start, "restored": res["restored"],
            "bytes": {"trainer": ref_bytes, "layerckpt": lc_bytes, "ratio": ref_bytes / max(lc_bytes, 1)},
            "blocked_s": {"trainer": blocked[0], "layerckpt": blocked[1]},
            "resume_s": {"trainer": ref["resume_s"], "layerckpt": res["resume_s"]},
            "loss": {"mean_rel": abs(sum(after) - sum(want)) / sum(want), "identical": after == want,
                     "final": after[-1], "final_reference": want[-1]}}


def print_table(s: Dict[str, Any]) -> None:
    b, t, r, loss = s["bytes"], s["blocked_s"], s["resume_s"], s["loss"]
    print(f"resumed from fine-tuning step {s['resumed_at']}: layers persisted at steps "
          f"{s['restored']['layer_steps']}, max staleness {s['restored']['max_staleness']} checkpoints\n")
    head = f"over the {s['checkpoints']} checkpoints before the crash"
    print(f"{head:<46}{'plain Trainer':>16} {'layerckpt':>12} {'ratio':>8}")
    print(f"  {'bytes written':<44}{b['trainer'] / 1e6:>14.1f}MB {b['layerckpt'] / 1e6:>10.1f}MB {b['ratio']:>7.1f}x")
    print(f"  {'training paid (in the save, in later steps)':<44}{t['trainer'] * 1e3:>14.0f}ms "
          f"{t['layerckpt'] * 1e3:>10.0f}ms {t['trainer'] / max(t['layerckpt'], 1e-9):>7.1f}x")
    print(f"  {'resume (train() to the first step)':<44}{r['trainer'] * 1e3:>14.0f}ms {r['layerckpt'] * 1e3:>10.0f}ms")
    exact = "bit-identical" if loss["identical"] else "not bit-identical: layers were skipped"
    print(f"  loss after resume vs uninterrupted: mean over the logged steps within {loss['mean_rel'] * 100:.3f}% "
          f"({exact}); final loss {loss['final']:.4f} vs {loss['final_reference']:.4f}")


def main() -> int:
    ap = crash_resume_parser(__doc__, every="Trainer's save_steps", finetune="fine-tuning steps (Trainer's max_steps)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--total-limit", type=int, default=3, help="Trainer's save_total_limit of both runs")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--role", choices=PHASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        child(args.role, args)
        return 0
    check_crash_resume(ap, args)
    temporary = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="layerckpt-transformers-")
    try:
        for sub in ("plain", "layerckpt"):
            shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
        print(f"reference run: {args.pretrain} pre-training + {args.finetune} fine-tuning steps with Trainer, "
              f"a checkpoint every {args.every} (save_total_limit={args.total_limit})", flush=True)
        if _spawn("reference", args) != 0:
            raise SystemExit("the reference run failed")
        print(f"layerckpt run, killed at fine-tuning step {args.crash_at} ...", flush=True)
        rc = _spawn("crash", args)
        if rc != -signal.SIGKILL:
            raise SystemExit(f"the run was meant to be killed, it exited {rc}")
        if _spawn("resume", args) != 0:
            raise SystemExit("the resumed run failed")
        s = summarize(args)
        print_table(s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
        return 0
    finally:
        if temporary:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
