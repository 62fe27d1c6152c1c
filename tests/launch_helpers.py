"""What tests/test_launchers.py runs under the frameworks' own launchers, 2 CPU processes on gloo:

    python tests/launch_helpers.py SCENARIO[,SCENARIO...] PHASE DIR

Each SCENARIO runs in DIR/<scenario>, one after the other in the same processes:
  checkpointer  under torchrun: DDP and the plain Checkpointer
  accelerate    under accelerate launch: Accelerator + LayerCheckpointPlugin
  trainer       under accelerate launch: transformers' Trainer + attach
  lightning     no launcher: Trainer(accelerator="cpu", devices=2, strategy="ddp") starts the second process itself

PHASE ``first`` runs the uninterrupted run without layerckpt (``ref``), then a full-mode run (``full``) and a run at
the default Config (``defaults``), each saving every EVERY steps and stopped after STOP steps, between two saves, as
a crash stops training (out of the training loop; the processes go on to the next run, and the saves in flight
complete before the launch ends).  PHASE ``resume`` (a second
launch) resumes ``full`` and ``defaults`` from the newest checkpoint each left and trains them to STEPS.

Each run writes <scenario>/<run>.rank<r>.pt: its final model and optimizer state, its loss at each step it ran, the
step it resumed from and the bytes of one copy of its state.  Each rank writes DIR/<phase>.rank<r>.json last, once
every save is durable and closed and the process group is gone: that rank got to the end (rank 0 of a Lightning
launch also records the exit codes of the processes Lightning started).  Batches depend on (step, rank) alone and
every model draws dropout from its rank's global RNG, so a resume is bit-exact only if each rank's RNG came back too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import layerckpt

STEPS, EVERY, STOP = 12, 2, 7  # saves at 2, 4, 6 before the stop at 7: the resume reads the composite of step 6
#: the two modes: every layer at every save, and the default selection rule
MODES: Dict[str, Dict[str, Any]] = {"full": {"full": True}, "defaults": {}}
N_EMBD, N_LAYER, DROPOUT = 16, 2, 0.1  # about 9k parameters (30k for the Accelerator's, accelerate_helpers.tiny)


@dataclass
class Left:
    """What a scenario leaves for the end of the launch: what to close, the processes it started."""
    close: List[Callable[[], None]] = field(default_factory=list)
    children: List[subprocess.Popen] = field(default_factory=list)


class Stopped(Exception):
    """Ends a run part-way, as a crash would: out of the training loop, between two saves."""


def runs(phase: str) -> List[str]:
    return ["ref", *MODES] if phase == "first" else list(MODES)


def stop_at(phase: str, run: str) -> int:
    return STOP if phase == "first" and run != "ref" else STEPS


def state_bytes(model: torch.nn.Module, optim_state: Dict[str, Any]) -> int:
    """One copy of the state: the model's tensors (a tied one once) and every tensor of the optimizer's state."""
    seen, n = set(), 0
    tensors = list(model.state_dict().values()) + [v for s in optim_state["state"].values() for v in s.values()
                                                   if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def record(root: str, run: str, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           losses: Dict[int, float], restored: Optional[int]) -> None:
    optim_state = optimizer.state_dict()
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": optim_state,
                "losses": losses, "restored": restored, "state_bytes": state_bytes(model, optim_state)},
               os.path.join(root, f"{run}.rank{rank}.pt"))


# ------------------------------------------------------------------ torchrun: DDP and the plain Checkpointer

def checkpointer(phase: str, root: str) -> Left:
    from torch.nn.parallel import DistributedDataParallel

    from layerckpt.bench.workload import batch, make_model, make_optimizer

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # env:// as torchrun sets it
    rank, world = dist.get_rank(), dist.get_world_size()
    left = Left()
    for run in runs(phase):
        model = make_model(0, n_layer=N_LAYER, n_embd=N_EMBD)
        opt = make_optimizer(model)
        torch.manual_seed(100 + rank)  # each rank's dropout draws its own numbers
        store, done, restored, ck = os.path.join(root, run), 0, None, None
        if run != "ref":
            report = layerckpt.restore(store, model, opt) if phase == "resume" else None  # this rank's RNG too
            ck = layerckpt.Checkpointer(store, model, opt, config=layerckpt.Config(**MODES[run]))
            left.close.append(ck.close)
            if report is not None:
                ck.adopt(report)  # the next save continues the restored composite
                done = restored = report.step
        ddp = DistributedDataParallel(model)
        losses = {}
        for step in range(done + 1, stop_at(phase, run) + 1):
            x, y = batch("affine", step * world + rank, 8)
            loss = F.cross_entropy(F.dropout(ddp(x), DROPOUT, training=True).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            if ck is not None and step % EVERY == 0:
                ck.save(step, loss=losses[step])
        record(root, run, rank, model, opt, losses, restored)
    return left


# ------------------------------------------------------------------ accelerate launch: Accelerator + the plugin

def accelerate(phase: str, root: str) -> Left:
    from accelerate_helpers import Run

    left = Left()
    for run in runs(phase):
        r = Run(os.path.join(root, run), plugin=run != "ref",
                config=layerckpt.Config(**MODES[run]) if run != "ref" else None)
        if r.plugin is not None:
            left.close.append(r.plugin.close)
        restored = None
        if phase == "resume":
            r.acc.load_state()  # the newest folder whose composite committed
            restored = r.progress.step
        losses = {}
        while r.progress.step < stop_at(phase, run):
            n = min(EVERY - r.progress.step % EVERY, stop_at(phase, run) - r.progress.step)
            losses.update({s + 1: v for s, v in r.train(n).items()})
            if r.plugin is not None and r.progress.step % EVERY == 0:
                r.acc.save_state()
        record(root, run, r.acc.process_index, r.plain_model, r.opt.optimizer, losses, restored)
    return left


# ------------------------------------------------------------------ accelerate launch: Trainer + attach

def trainer(phase: str, root: str) -> Left:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import transformers_layerckpt

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STOP:
                raise Stopped(f"stopped at step {STOP}")

    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r.clone()} for r in ids]
    left = Left()
    for run in runs(phase):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=N_EMBD, n_layer=N_LAYER, n_head=2,
                                           resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT))
        args = TrainingArguments(os.path.join(root, run), max_steps=STEPS, save_steps=EVERY,
                                 save_strategy="no" if run == "ref" else "steps", per_device_train_batch_size=4,
                                 learning_rate=1e-3, report_to=[], use_cpu=True, seed=0, logging_steps=1,
                                 dataloader_num_workers=0, disable_tqdm=True)
        t = Trainer(model=model, args=args, train_dataset=data,
                    callbacks=[StopAt()] if stop_at(phase, run) < STEPS else [])
        att = transformers_layerckpt.attach(t, **MODES[run]) if run != "ref" else None
        if att is not None:
            left.close.append(att.close)
        try:
            t.train(resume_from_checkpoint=phase == "resume" or None)  # True: the newest checkpoint folder
        except Stopped:
            pass  # attach's train() raises with every checkpoint it made committed
        restored = att.last_restore.step if att is not None and att.last_restore is not None else None
        # the loss Trainer logs: the mean over the ranks, rounded to 4 decimals
        losses = {e["step"]: e["loss"] for e in t.state.log_history if "loss" in e}
        record(root, run, t.args.process_index, t.model, t.optimizer, losses, restored)
    return left


# ------------------------------------------------------------------ Lightning: Trainer(strategy="ddp", devices=2)

def lightning(phase: str, root: str) -> Left:
    from lit_helpers import Crash, CrashAt, Tiny, trainer as lit_trainer

    from lightning_layerckpt import LayerCheckpoint

    left = Left()
    for run in runs(phase):
        torch.manual_seed(7)
        # a resume starts from other weights: the restore must bring every one back
        model = Tiny(n_layer=N_LAYER, n_embd=N_EMBD, dropout=DROPOUT, seed=0 if phase == "first" else 3)
        cb = LayerCheckpoint(dirpath=os.path.join(root, run), every_n_train_steps=EVERY,
                             **MODES[run]) if run != "ref" else None
        cbs = [c for c in (cb, CrashAt(STOP) if stop_at(phase, run) < STEPS else None) if c is not None]
        t = lit_trainer(STEPS, cbs, root, strategy="ddp", devices=2, enable_checkpointing=cb is not None)
        try:
            t.fit(model, ckpt_path="last" if phase == "resume" else None)
        except Crash:
            pass  # every rank stops at the same step; LayerCheckpoint waited for its last flush
        launcher = t.strategy.launcher
        if not left.children and getattr(launcher, "procs", None):
            left.children = list(launcher.procs)  # started by the first fit (rank 0 only)
        restored = cb.restored["step"] if cb is not None and cb.restored else None
        first = STEPS - len(model.losses) + 1 if phase == "resume" else 1
        record(root, run, t.global_rank, model, t.optimizers[0],
               {first + i: v for i, v in enumerate(model.losses)}, restored)
    return left


SCENARIOS: Dict[str, Callable[[str, str], Left]] = {
    "checkpointer": checkpointer, "accelerate": accelerate, "trainer": trainer, "lightning": lightning}


def main(argv: List[str]) -> int:
    names, phase, root = argv
    torch.set_num_threads(1)  # every launch computes with the same arithmetic: the resume is bit-exact against ref
    left = Left()
    for name in names.split(","):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        got = SCENARIOS[name](phase, os.path.join(root, name))
        left.close += got.close
        left.children += got.children
    for close in left.close:  # the stopped runs' last saves too: every save durable, no layerckpt thread left
        close()
    rank = dist.get_rank()
    dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks aborts the peer
    dist.destroy_process_group()
    codes = [p.wait(timeout=60) for p in left.children]
    with open(os.path.join(root, f"{phase}.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "children": codes}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
