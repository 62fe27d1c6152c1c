"""Where the Accelerate example's resume time goes: ``accelerator.load_state()`` timed in fresh processes, accelerate's
own against the plugin's, with the plugin's steps timed apart.

    python examples/accelerate_finetune.py --dir D             # leaves D/accelerate and D/layerckpt
    python benchmarks/accelerate_resume.py --dir D [--reps 11]

Each repeat starts one fresh process per contender (interleaved), builds the example's model, optimizer and
accelerator as its resume phase does, and times ``load_state()`` (the newest folder).  The example itself times
accelerate's resume in the process that just saved (modules, page cache and allocator warm) and the plugin's in a
fresh one; here both are fresh.  Prints the median and the range of each figure.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List


def _timed(owner, name: str, label: str, into: Dict[str, float]) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            into[label] = into.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrapper)


def child(role: str, args: argparse.Namespace) -> Dict[str, float]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import accelerate.accelerator as acc_module
    import accelerate_layerckpt.plugin as plugin_module
    from accelerate_layerckpt import LayerCheckpointPlugin
    from layerckpt.bench.workload import make_model, make_optimizer

    steps: Dict[str, float] = {}
    _timed(acc_module, "load_accelerator_state", "load_accelerator_state (accelerate: all; plugin: RNG, objects)",
           steps)
    if role == "layerckpt":
        _timed(plugin_module, "restore", "restore(): read, verify, load the composite", steps)
        _timed(plugin_module.LayerCheckpointPlugin, "_adopt",
               "_adopt: open the store's writer for the next save, take the drift baseline", steps)
        _timed(plugin_module.folders, "newest_loadable", "pick the newest loadable folder", steps)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=os.path.join(args.dir, role), automatic_checkpoint_naming=True, total_limit=args.total_limit))
    torch.set_num_threads(1)
    model = make_model(1, n_layer=args.n_layer, n_embd=args.n_embd)
    opt = make_optimizer(model)
    model, opt = acc.prepare(model, opt)

    class Progress:  # what the example registers
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, d):
            self.step = d["step"]

    acc.register_for_checkpointing(Progress())
    plugin = LayerCheckpointPlugin().register(acc) if role == "layerckpt" else None
    t = time.perf_counter()
    acc.load_state()
    steps["load_state() total"] = time.perf_counter() - t
    if plugin is not None:
        plugin.close()
    return steps


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the --dir of a finished examples/accelerate_finetune.py run")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--total-limit", type=int, default=3)
    ap.add_argument("--only", choices=("accelerate", "layerckpt"), help="time one contender only")
    ap.add_argument("--role", choices=("accelerate", "layerckpt"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        print(json.dumps(child(args.role, args)))
        return 0
    got: Dict[str, Dict[str, List[float]]] = {role: collections.defaultdict(list) for role in ("accelerate", "layerckpt")
                                              if args.only in (None, role)}
    for _ in range(args.reps):
        for role in got:
            r = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                "--role", role], capture_output=True, text=True, check=True)
            for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                got[role][k].append(v * 1e3)
    print(f"load_state() in a fresh process, {args.reps} interleaved repeats: median [min-max] ms")
    for role, figures in got.items():
        print(f"  {role}")
        for k in sorted(figures, key=lambda k: -statistics.median(figures[k])):
            v = figures[k]
            print(f"    {k:<76}{statistics.median(v):7.1f}  [{min(v):.1f}-{max(v):.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
