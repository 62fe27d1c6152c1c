"""Fine-tune a small transformer in a plain accelerate loop with layerckpt, crash it, resume it, compare.

    python examples/accelerate_finetune.py [--dir DIR] [--crash-at 170]
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_finetune.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_finetune.py

(``accelerate launch --cpu --num_processes 2`` starts ONE process in accelerate 1.15; the
commands above start two CPU processes on gloo.)

1. a reference run: pre-train on one synthetic task, fine-tune on another, with
   ``accelerator.save_state()`` every --every steps, accelerate's own way (model.safetensors +
   optimizer.bin in every folder);
2. the same run with ``LayerCheckpointPlugin`` registered on the accelerator, killed with SIGKILL
   at fine-tuning step --crash-at (a flush may be in flight);
3. fresh processes call ``accelerator.load_state()`` (the newest complete folder) and finish.
Each phase runs in child processes (under a launcher: one per rank, in a process group of their
own).  It prints bytes written, time training was blocked and resume time against accelerate's
save_state, and the loss after resume against the run that never stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from layerckpt.bench.workload import check_crash_resume, crash_resume_parser, folder_bytes

PHASES = ("reference", "crash", "resume")


# ---------------------------------------------------------------------- the training (child processes)

class Progress:
    """The fine-tuning step, saved by accelerate as a register_for_checkpointing object."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, d: Dict[str, int]) -> None:
        self.step = d["step"]


def child(role: str, args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from accelerate_layerckpt import LayerCheckpointPlugin
    from layerckpt.bench.workload import batch, make_model, make_optimizer, start_finetune

    project = os.path.join(args.dir, "accelerate" if role == "reference" else "layerckpt")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=args.total_limit))
    # leave a core to the background flusher: oversubscribed CPU threads stall training on small machines
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // acc.num_processes - 1))
    model = make_model(0 if role != "resume" else 1, n_layer=args.n_layer, n_embd=args.n_embd)
    opt = make_optimizer(model)
    model, opt = acc.prepare(model, opt)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    plugin = None
    if role != "reference":
        plugin = LayerCheckpointPlugin().register(acc)  # Config from $LAYERCKPT_CONFIG, else the defaults

    def train(task: str, step: int) -> float:
        x, y = batch(task, step * acc.num_processes + acc.process_index, args.batch_size)  # each rank its own
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out: Dict[str, Any] = {"rank": acc.process_index, "world": acc.num_processes, "losses": {}, "saves": []}
    if role == "resume":
        t = time.perf_counter()
        acc.load_state()  # the newest folder whose state is complete
        out["resume_s"] = time.perf_counter() - t
        r = plugin.last_restore[0] if plugin and plugin.last_restore else None
        out["restored"] = {"step": progress.step, "layer_steps": sorted(set(r.layers.values())) if r else [],
                           "max_staleness": r.max_staleness if r else 0}
    else:
        for step in range(args.pretrain):
            train("count", step)
        start_finetune(opt)
    path = os.path.join(args.dir, f"{role}.rank{acc.process_index}.json")
    pendings = []  # per save_state: layerckpt's saves, whose copies the next optimizer step may wait for
    while progress.step < args.finetune:
        step = progress.step
        if role == "crash" and step == args.crash_at:
            for rec, ps in zip(out["saves"], pendings):  # training paid the step's wait too
                rec["step_wait_s"] = sum(p.step_wait_s for p in ps)
                rec["blocked_s"] += rec["step_wait_s"]
            with open(path, "w") as f:
                json.dump(out, f)
            os.kill(os.getpid(), signal.SIGKILL)
        out["losses"][step] = train("affine", step)
        progress.step += 1
        if progress.step % args.every == 0:
            t = time.perf_counter()
            folder = acc.save_state()
            blocked = time.perf_counter() - t
            pendings.append(list(plugin.last_saves) if plugin else [])
            out["saves"].append({"blocked_s": blocked, "save_return_s": blocked,
                                 "folder_bytes": folder_bytes(folder) if acc.is_main_process else 0,
                                 "layerckpt_bytes": sum(p.nbytes for p in plugin.last_saves) if plugin else 0})
    if role == "reference":  # accelerate's own resume, from the newest folder
        acc.wait_for_everyone()  # save_state ends without a barrier: rank 0 may still be writing
        t = time.perf_counter()
        acc.load_state()
        out["resume_s"] = time.perf_counter() - t
    with open(path, "w") as f:
        json.dump(out, f)
    if acc.num_processes > 1:  # leave together: a rank tearing gloo down while its peer still talks aborts it
        if plugin is not None:
            plugin.wait()
        acc.wait_for_everyone()
        acc.end_training()  # destroys the process groups (layerckpt's included) on every rank at once


# ---------------------------------------------------------------------- the story (launcher processes)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, args: argparse.Namespace, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}  # a group of their own
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        env["MASTER_PORT"] = str(port)
        env.setdefault("MASTER_ADDR", "127.0.0.1")
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--dir", args.dir]
    for k in ("pretrain", "finetune", "every", "crash_at", "n_layer", "n_embd", "batch_size", "total_limit"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return subprocess.Popen(cmd, env=env)


def _load(root: str, role: str, world: int) -> List[Dict[str, Any]]:
    out = []
    for r in range(world):
        with open(os.path.join(root, f"{role}.rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def summarize(args: argparse.Namespace, world: int) -> Dict[str, Any]:
    ref, crash, res = (_load(args.dir, role, world) for role in PHASES)
    n = len(crash[0]["saves"])  # checkpoints before the crash
    ref_bytes = sum(s["folder_bytes"] for s in ref[0]["saves"][:n])
    lc_bytes = sum(s["folder_bytes"] for s in crash[0]["saves"][:n]) + sum(
        s["layerckpt_bytes"] for c in crash for s in c["saves"][:n])
    blocked = lambda runs: sum(max(r["saves"][i]["blocked_s"] for r in runs) for i in range(n))  # noqa: E731
    start = res[0]["restored"]["step"]
    after = [res[0]["losses"][str(s)] for s in range(start, args.finetune)]
    want = [ref[0]["losses"][str(s)] for s in range(start, args.finetune)]
    return {
        "world": world, "checkpoints": n, "resumed_at": start, "restored": res[0]["restored"],
        "bytes": {"accelerate": ref_bytes, "layerckpt": lc_bytes, "ratio": ref_bytes / max(lc_bytes, 1)},
        "blocked_s": {"accelerate": blocked(ref), "layerckpt": blocked(crash),
                      "ratio": blocked(ref) / max(blocked(crash), 1e-9)},
        "resume_s": {"accelerate": max(r["resume_s"] for r in ref), "layerckpt": max(r["resume_s"] for r in res)},
        "loss": {"mean_rel": abs(sum(after) - sum(want)) / sum(want), "identical": after == want,
                 "max_rel": max(abs(a - b) / abs(b) for a, b in zip(after, want)),
                 "final": after[-1], "final_reference": want[-1]},
    }


def print_table(s: Dict[str, Any]) -> None:
    b, t, r, loss = s["bytes"], s["blocked_s"], s["resume_s"], s["loss"]
    print(f"resumed from fine-tuning step {s['resumed_at']}: layers persisted at steps "
          f"{s['restored']['layer_steps']}, max staleness {s['restored']['max_staleness']} checkpoints")
    print()
    print(f"over the {s['checkpoints']} save_state calls before the crash ({s['world']} process(es)) "
          f"{'accelerate':>12} {'layerckpt':>12} {'ratio':>8}")
    pad = 58
    print(f"  {'bytes written':<{pad}}{b['accelerate'] / 1e6:>10.1f}MB {b['layerckpt'] / 1e6:>10.1f}MB "
          f"{b['ratio']:>7.1f}x")
    print(f"  {'training blocked (save_state + wait in the next step)':<{pad}}{t['accelerate'] * 1e3:>10.0f}ms {t['layerckpt'] * 1e3:>10.0f}ms "
          f"{t['ratio']:>7.1f}x")
    print(f"  {'resume (load_state)':<{pad}}{r['accelerate'] * 1e3:>10.0f}ms {r['layerckpt'] * 1e3:>10.0f}ms "
          f"{r['accelerate'] / max(r['layerckpt'], 1e-9):>7.1f}x")
    exact = "bit-identical" if loss["identical"] else f"max step difference {loss['max_rel'] * 100:.2f}%"
    print(f"  loss after resume vs uninterrupted: mean over the steps after resume within "
          f"{loss['mean_rel'] * 100:.3f}% ({exact}); final loss {loss['final']:.4f} vs {loss['final_reference']:.4f}")


def main() -> int:
    ap = crash_resume_parser(__doc__, every="save_state every N fine-tuning steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step and process")
    ap.add_argument("--total-limit", type=int, default=3, help="ProjectConfiguration.total_limit of both runs")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--overlap", action="store_true",
                    help="run the reference alongside the layerckpt run: quicker, but the timings are not comparable")
    ap.add_argument("--role", choices=PHASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        child(args.role, args)
        return 0
    check_crash_resume(ap, args)

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    temporary = args.dir is None
    ports = [0, 0, 0]
    if world > 1:  # one launcher process per rank: agree on a directory and a port per phase
        import torch.distributed as dist

        dist.init_process_group("gloo")
        shared = [args.dir or tempfile.mkdtemp(prefix="layerckpt-accelerate-"), [_free_port() for _ in PHASES]]
        dist.broadcast_object_list(shared, src=0)
        args.dir, ports = shared
    args.dir = args.dir or tempfile.mkdtemp(prefix="layerckpt-accelerate-")
    try:
        if rank == 0:
            for sub in ("accelerate", "layerckpt"):
                shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
            print(f"reference run: {args.pretrain} pre-training + {args.finetune} fine-tuning steps, "
                  f"accelerator.save_state() every {args.every} (total_limit={args.total_limit})", flush=True)
        if world > 1:
            dist.barrier()
        reference = _spawn("reference", args, ports[0])
        if not args.overlap and reference.wait() != 0:
            raise SystemExit(f"the reference run failed ({reference.returncode})")
        if rank == 0:
            print(f"layerckpt run, killed at fine-tuning step {args.crash_at} ...", flush=True)
        rc = _spawn("crash", args, ports[1]).wait()
        if rc != -signal.SIGKILL:
            raise SystemExit(f"the run was meant to be killed, it exited {rc}")
        if reference.wait() != 0:
            raise SystemExit(f"the reference run failed ({reference.returncode})")
        rc = _spawn("resume", args, ports[2]).wait()
        if rc != 0:
            raise SystemExit(f"the resumed run failed ({rc})")
        if world > 1:
            dist.barrier()
        if rank == 0:
            s = summarize(args, world)
            print_table(s)
            if args.overlap:
                print("  (--overlap: both runs shared the CPUs, so the timings above are not comparable)")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(s, f, indent=1)
        return 0
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        if temporary and rank == 0:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
