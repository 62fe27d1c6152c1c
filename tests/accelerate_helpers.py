"""A small accelerate training loop for the adapter tests: imported by them, and run as a script
(also under torchrun, one process per rank) when a test needs a fresh process.

    python tests/accelerate_helpers.py --dir D --out OUT [--config JSON] [--steps N] [--every E]
                                       [--resume FOLDER|auto] [--total-limit K] [--no-plugin]

Each rank writes OUT.rank<r>.json (losses, RNG draws after each save/load, scheduler, counters)
and OUT.rank<r>.pt (final model and optimizer state).  A single process never waits for its
last flush: a normal exit must complete it.  Several processes wait, then leave together.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import layerckpt
from accelerate_layerckpt import LayerCheckpointPlugin
from layerckpt.bench.workload import batch, make_model, make_optimizer, start_finetune
from layerckpt.bench.workload import run as run_steps


class Progress:
    """Where the loop is: saved by accelerate as a register_for_checkpointing object."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, d: Dict[str, int]) -> None:
        self.step = d["step"]


def tiny(seed: int = 0) -> torch.nn.Module:
    return make_model(seed, n_layer=2, n_embd=32)


class Run:
    """An Accelerator with one tiny GPT, AdamW, a StepLR scheduler and a Progress object."""

    def __init__(self, project_dir, *, automatic: bool = True, total_limit: Optional[int] = None,
                 config: Optional[layerckpt.Config] = None, plugin: bool = True, seed: int = 0, pretrain: int = 0,
                 wait_below: int = 0):
        self.acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=automatic, total_limit=total_limit))
        model = tiny(seed)
        opt = make_optimizer(model)
        if pretrain:  # the post-training story: pre-train on one task, fine-tune (checkpointed) on another
            run_steps(model, opt, "count", 0, pretrain)
        start_finetune(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.progress = Progress()
        self.acc.register_for_checkpointing(self.progress)
        # wait_below=0: every save_state flushes in the background, as a large model's would
        self.plugin = LayerCheckpointPlugin(config, wait_below=wait_below).register(self.acc) if plugin else None

    @property
    def plain_model(self) -> torch.nn.Module:
        return self.acc.unwrap_model(self.model)

    def train(self, n: int) -> Dict[int, float]:
        """n steps; the data depends on (step, rank) only, the loss also on the global RNG (so a resume
        is only exact when accelerate restored it)."""
        acc, losses = self.acc, {}
        for _ in range(n):
            s = self.progress.step
            x, y = batch("affine", s * acc.num_processes + acc.process_index)
            with acc.accumulate(self.model):
                loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
                loss = loss * (1 + 0.01 * torch.rand(()))
                acc.backward(loss)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
            losses[s] = loss.item()
            self.progress.step += 1
        return losses

    def snapshot(self) -> Dict[str, Any]:
        return {"model": {k: v.clone() for k, v in self.plain_model.state_dict().items()},
                "optim": _clone(self.opt.optimizer.state_dict())}


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="layerckpt Config fields as JSON; default: Config()")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--resume", default=None, help="a folder to load_state from, or 'auto' for load_state()")
    ap.add_argument("--total-limit", type=int, default=None)
    ap.add_argument("--no-plugin", action="store_true")
    ap.add_argument("--pretrain", type=int, default=0, help="pre-training steps before the checkpointed run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = layerckpt.Config.from_dict(json.loads(args.config)) if args.config else None
    run = Run(args.dir, total_limit=args.total_limit, config=cfg, plugin=not args.no_plugin,
              pretrain=0 if args.resume else args.pretrain)
    acc = run.acc
    out: Dict[str, Any] = {"world": acc.num_processes, "losses": {}, "draws": {}, "saved": []}
    if args.resume:
        acc.load_state(None if args.resume == "auto" else args.resume)
        out["loaded"] = {"progress": run.progress.step, "accelerator_step": acc.step,
                         "iteration": acc.project_configuration.iteration, "sched": run.sched.state_dict(),
                         "draw": torch.rand(1).item()}
        if run.plugin is not None and run.plugin.last_restore:
            r = run.plugin.last_restore[0]
            out["loaded"]["report"] = {"step": r.step, "max_staleness": r.max_staleness, "layers": r.layers}
    while run.progress.step < args.steps:
        out["losses"].update(run.train(args.every))
        folder = acc.save_state()
        out["saved"].append({"folder": os.path.basename(folder), "progress": run.progress.step,
                             "accelerator_step": acc.step, "sched": run.sched.state_dict()})
        out["draws"][os.path.basename(folder)] = torch.rand(1).item()
    r = acc.process_index
    torch.save(run.snapshot(), f"{args.out}.rank{r}.pt")
    with open(f"{args.out}.rank{r}.json", "w") as f:
        json.dump(out, f)
    if acc.num_processes > 1:  # leave together: a rank tearing gloo down while its peer still talks aborts it
        if run.plugin is not None:
            run.plugin.wait()
        acc.wait_for_everyone()
        acc.end_training()  # destroys the process groups, layerckpt's included, on every rank at once
    return 0


if __name__ == "__main__":
    sys.exit(main())
