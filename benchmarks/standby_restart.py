"""What a warm standby would spare a restart: a fresh process against a fork of one that has imported the job's
modules, each doing a restart's work (build the goodput bench's GPT-2-mini and AdamW, restore the newest
composite, one training step).

    python benchmarks/standby_restart.py --dir D [--lightning] [--reps 3]

The first run leaves one composite in D (one step, one save).  Each repeat of "cold" starts a new interpreter that
imports torch and layerckpt (and ``lightning.pytorch`` with ``--lightning``) before the work; "warm" imports them
once in this process, then forks a child per repeat that does the work alone.  Prints the medians (s) of the wall
time from the spawn or the fork to the end of the first step, and of each phase.  Nothing is built on it yet: it
measures what a launcher that keeps such a standby could spare, before anyone builds one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict

PHASES = ("wall", "imports", "setup", "load", "first_step")


def work(root: str, t0: float, save: bool = False) -> Dict[str, float]:
    """A restart's work after its imports, timed from ``t0`` (the imports' start)."""
    import torch
    from torch.nn import functional as F

    import layerckpt
    from layerckpt.bench.models import GPT, GPTConfig
    from layerckpt.bench.workload import batch

    torch.set_num_threads(1)
    t_imp = time.perf_counter()
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=512, n_layer=6, n_head=8)  # the goodput bench's gpt2-mini
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_setup = time.perf_counter()
    start = layerckpt.restore(root, model, opt).step if os.path.isdir(os.path.join(root, "manifests")) else 0
    t_load = time.perf_counter()
    x, y = batch("affine", start, 2)
    loss = F.cross_entropy(model(x % cfg.vocab_size).flatten(0, 1), (y % cfg.vocab_size).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t_step = time.perf_counter()
    if save:
        with layerckpt.Checkpointer(root, model, opt) as ck:
            ck.save(start + 1).wait()
    return {"imports": t_imp - t0, "setup": t_setup - t_imp, "load": t_load - t_setup, "first_step": t_step - t_load}


def _imports(lightning: bool) -> None:
    import torch  # noqa: F401

    import layerckpt  # noqa: F401
    if lightning:
        import lightning.pytorch  # noqa: F401


def _child(args) -> None:
    t = time.perf_counter()
    _imports(args.lightning)
    print(json.dumps(work(args.dir, t, args.save)))


def _cold(args, env) -> Dict[str, float]:
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir] + (
        ["--lightning"] if args.lightning else [])
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["wall"] = time.perf_counter() - t0
    return r


def _warm(args) -> Dict[str, float]:
    r_fd, w_fd = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the standby's child: everything is imported already
        os.close(r_fd)
        os.write(w_fd, json.dumps(work(args.dir, time.perf_counter())).encode())
        os._exit(0)
    os.close(w_fd)
    data = b""
    while True:
        chunk = os.read(r_fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r_fd)
    os.waitpid(pid, 0)
    r = json.loads(data)
    r["wall"] = time.perf_counter() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the store (made with one composite where it has none)")
    ap.add_argument("--lightning", action="store_true", help="the job imports lightning.pytorch too")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a restart of an installed job finds its bytecode cached
    if not os.path.isdir(os.path.join(args.dir, "manifests")):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--save", "--dir", args.dir],
                       check=True, env=env, stdout=subprocess.DEVNULL)
    cold = [_cold(args, env) for _ in range(args.reps)]
    t = time.perf_counter()
    _imports(args.lightning)
    once = time.perf_counter() - t
    warm = [_warm(args) for _ in range(args.reps)]
    med = lambda rs: {k: round(statistics.median(r[k] for r in rs), 3) for k in PHASES}  # noqa: E731
    out: Dict[str, Any] = {"lightning": args.lightning, "reps": args.reps, "standby_imports_once_s": round(once, 3),
                           "cold": med(cold), "warm": med(warm),
                           "cold_walls": [round(r["wall"], 3) for r in cold],
                           "warm_walls": [round(r["wall"], 3) for r in warm]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
