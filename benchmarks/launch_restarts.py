"""What `layerckpt launch` spares a job that fails: the same job restarted from the warm standby (each attempt
a fork of the launcher, which has imported torch, layerckpt and ``--preload``) against a new interpreter per
attempt (``--no-standby``, as ``torchrun --max-restarts`` restarts).

    python benchmarks/launch_restarts.py --dir D [--lightning] [--kills 3] [--reps 3]

The job (this file with ``--job``) imports torch and layerckpt (and ``lightning.pytorch`` with ``--lightning``),
builds the goodput bench's GPT-2-mini and AdamW, restores the newest composite of ``D/store`` (the first run
of all saves one), takes one training step and, until it has been killed ``--kills`` times, SIGKILLs itself.
A restart's cost is the wall time from one attempt's kill to the end of the next attempt's first step (what
a failure costs beyond the work redone); printed as medians (s) over every restart of every repeat, with the
launcher's total wall time, as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def job(root: str, kills: int, lightning: bool) -> None:
    import signal

    import torch
    from torch.nn import functional as F

    import layerckpt
    from layerckpt.bench.models import GPT, GPTConfig
    from layerckpt.bench.workload import batch
    if lightning:
        import lightning.pytorch  # noqa: F401

    restart = int(os.environ.get("LAYERCKPT_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=512, n_layer=6, n_head=8)  # the goodput bench's gpt2-mini
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = os.path.join(root, "store")
    start = layerckpt.restore(store, model, opt).step if os.path.isdir(os.path.join(store, "manifests")) else 0
    x, y = batch("affine", start, 2)
    F.cross_entropy(model(x % cfg.vocab_size).flatten(0, 1), (y % cfg.vocab_size).flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if start == 0:
        with layerckpt.Checkpointer(store, model, opt) as ck:
            ck.save(1).wait()
    with open(os.path.join(root, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"restart": restart, "first_step_done": time.time()}) + "\n")
    if restart < kills:
        os.kill(os.getpid(), signal.SIGKILL)


def measure(args, standby: bool) -> dict:
    steps = os.path.join(args.dir, "steps.jsonl")
    if os.path.exists(steps):
        os.unlink(steps)
    cmd = [sys.executable, "-m", "layerckpt.cli", "launch", "--max-restarts", str(args.kills)]
    cmd += (["--preload", "lightning.pytorch"] if args.lightning else []) + ([] if standby else ["--no-standby"])
    cmd += [os.path.abspath(__file__), "--job", "--dir", args.dir, "--kills", str(args.kills)]
    cmd += ["--lightning"] if args.lightning else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(steps) as f:
        done = [json.loads(line)["first_step_done"] for line in f]
    return {"wall": wall, "restarts": [b - a for a, b in zip(done, done[1:])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a folder for the job's store and its timings")
    ap.add_argument("--lightning", action="store_true", help="the job imports lightning.pytorch too")
    ap.add_argument("--kills", type=int, default=3, help="times the job kills itself (restarts per run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args.dir, args.kills, args.lightning)
    os.makedirs(args.dir, exist_ok=True)
    runs = {"standby": [], "new interpreter": []}
    for _ in range(args.reps):  # interleaved: the same conditions for both
        for name in runs:
            runs[name].append(measure(args, name == "standby"))
    out = {"lightning": args.lightning, "kills": args.kills, "reps": args.reps}
    for name, rs in runs.items():
        restarts = [r for run in rs for r in run["restarts"]]
        out[name] = {"restart_s": round(statistics.median(restarts), 3),
                     "restart_s_range": [round(min(restarts), 3), round(max(restarts), 3)],
                     "launcher_wall_s": round(statistics.median(r["wall"] for r in rs), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
