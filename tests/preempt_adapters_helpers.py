"""What tests/test_preempt_adapters.py runs: transformers' Trainer + attach and an Accelerator + LayerCheckpointPlugin,
each sent a real SIGTERM from inside a training step (``os.kill`` of its own process), at the adapters' defaults
(SIGTERM is a notice, 30 s of grace) in full mode:

    python tests/preempt_adapters_helpers.py PHASE DIR              (one process)
    accelerate-launch ... tests/preempt_adapters_helpers.py PHASE DIR   (2 ranks: PHASE first2, resume2)

PHASE ``first``: ``trainer`` and ``accel`` get the signal at step SIGNAL, before their first checkpoint; ``*_late``
get it at step LATE, after the checkpoint of step EVERY committed, with ``grace_s`` too short for any save;
``trainer_off`` (``preemption=False``, no signal) records that SIGTERM keeps its default handler.  The
Trainer's runs return from train() (``preempted``); the plugin raises SystemExit(EXIT_PREEMPTED), caught for
``accel_late`` and let through for ``accel``, the last run: the process exits with it.  PHASE ``resume`` (a new
process) resumes each from its newest checkpoint to STEPS and runs ``*_ref``, the uninterrupted runs.

PHASE ``first2``: ``trainer2`` and ``accel2``, where rank 1 alone gets the signal at step SIGNAL2; the plugin's
SystemExit ends the launch.  PHASE ``resume2`` resumes them and runs the uninterrupted ``*_ref2``.

Each run trains in DIR/<run> and writes DIR/<phase>/<run>.rank<r>.json (the steps it trained, where it stopped or
resumed, its checkpoint folders and composites, layerckpt's log lines) and DIR/<phase>/<run>.rank<r>.pt (its final
model and optimizer state).  Batches depend on (step, rank) only and both models draw from the global RNG (dropout,
the loss's noise), so a resume is bit-exact only where it came back too.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

import layerckpt
from layerckpt import store

STEPS, EVERY = 12, 4  # both adapters save every EVERY steps
SIGNAL, LATE, SIGNAL2 = 3, 6, 5
TINY_GRACE_S = 0.001  # shorter than any save
PHASE = ""  # main()'s: where the runs' records go


class Logged(logging.Handler):
    """layerckpt's log lines (its adapters' included) while a run goes on."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def __enter__(self) -> "Logged":
        logging.getLogger("layerckpt").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("layerckpt").removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def record(root: str, run: str, out: Dict[str, Any], model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    r, where = rank(), os.path.join(root, PHASE)
    os.makedirs(where, exist_ok=True)
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": optim.state_dict()},
               os.path.join(where, f"{run}.rank{r}.pt"))
    with open(os.path.join(where, f"{run}.rank{r}.json"), "w") as f:
        json.dump(out, f)


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------ Trainer + attach

def trainer_run(root: str, run: str, *, signal_at: Optional[int] = None, signal_rank: int = 0, resume: bool = False,
                grace_s: Optional[float] = None, preemption: Any = None) -> None:
    from transformers import TrainerCallback

    import test_transformers as tt

    class Steps(TrainerCallback):
        """The steps trained; the signal at the end of step ``signal_at``, once the saves so far committed (a
        notice then has the newest save's time to go by)."""

        def __init__(self) -> None:
            self.steps: List[int] = []
            self.handled: List[bool] = []  # whether SIGTERM had a handler other than the default at each step

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)
            self.handled.append(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
            if state.global_step == signal_at and args.process_index == signal_rank:
                t.layerckpt.wait()
                sigterm_self()

    cb = Steps()
    attach = {"full": True, **{k: v for k, v in (("grace_s", grace_s), ("preemption", preemption)) if v is not None}}
    with Logged() as logged:
        t = tt.make(os.path.join(root, run), attach=attach, callbacks=[cb])
        t.train(resume_from_checkpoint=True if resume else None)
    att = t.layerckpt
    d = os.path.join(root, run)
    out = {"steps": cb.steps, "global_step": t.state.global_step, "preempted": att.preempted,
           "restored": att.last_restore.step if att.last_restore is not None else None,
           "folders": sorted(n for n in os.listdir(d) if n.startswith("checkpoint-")),
           "store": store.steps(os.path.join(d, "layerckpt")), "log": logged.lines, "handled": cb.handled,
           "handled_after": signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL}
    record(root, run, out, t.model, t.optimizer.optimizer)


# ------------------------------------------------------------------ Accelerator + the plugin

def accel_step(r: Any, signal_at: Optional[int], signal_rank: int) -> None:
    """One optimizer step of accelerate_helpers.Run's loop; the signal inside step ``signal_at``, before its
    backward."""
    from layerckpt.bench.workload import batch

    acc, s = r.acc, r.progress.step
    x, y = batch("affine", s * acc.num_processes + acc.process_index)
    with acc.accumulate(r.model):
        loss = F.cross_entropy(r.model(x).flatten(0, 1), y.flatten())
        loss = loss * (1 + 0.01 * torch.rand(()))
        if s + 1 == signal_at and acc.process_index == signal_rank:
            sigterm_self()
        acc.backward(loss)
        r.opt.step()
        r.sched.step()
        r.opt.zero_grad(set_to_none=True)
    r.progress.step += 1


def accel_run(root: str, run: str, *, signal_at: Optional[int] = None, signal_rank: int = 0, resume: bool = False,
              grace_s: Optional[float] = None) -> None:
    from accelerate_helpers import Run

    # wait_below: every save_state returns committed, so the notice always has the newest save's time to go by
    r = Run(os.path.join(root, run), config=layerckpt.Config(full=True, grace_s=grace_s), wait_below=1 << 30)
    out: Dict[str, Any] = {"steps": [], "restored": None, "exit": None}
    with Logged() as logged:
        try:
            if resume:
                r.acc.load_state()  # the newest folder whose composite committed
                out["restored"] = r.progress.step
            while r.progress.step < STEPS:
                accel_step(r, signal_at, signal_rank)
                out["steps"].append(r.progress.step)
                if r.progress.step % EVERY == 0:
                    r.acc.save_state()
        except SystemExit as e:
            out["exit"] = e.code
            raise
        finally:
            d = os.path.join(root, run)
            folders, composites = os.path.join(d, "checkpoints"), os.path.join(d, "layerckpt", "model_0")
            out.update(stopped=r.progress.step, preempted=r.plugin.preempted, log=logged.lines,
                       folders=sorted(os.listdir(folders)) if os.path.isdir(folders) else [],
                       store=store.steps(composites) if os.path.isdir(composites) else [])
            record(root, run, out, r.plain_model, r.opt.optimizer)
            r.plugin.close()


def caught(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except SystemExit:
        pass  # recorded by the run; the next one goes on in this process


def leave_together() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: List[str]) -> int:
    global PHASE
    phase, root = argv
    PHASE = phase
    torch.set_num_threads(1)  # every process computes with the same arithmetic: the resume is bit-exact
    os.makedirs(root, exist_ok=True)
    if phase == "first":
        trainer_run(root, "trainer", signal_at=SIGNAL)
        trainer_run(root, "trainer_late", signal_at=LATE, grace_s=TINY_GRACE_S)
        trainer_run(root, "trainer_off", preemption=False)  # no handler: a SIGTERM would end this process
        caught(accel_run, root, "accel_late", signal_at=LATE, grace_s=TINY_GRACE_S)
        accel_run(root, "accel", signal_at=SIGNAL)  # its SystemExit ends the process
    elif phase == "resume":
        for run in ("trainer", "trainer_late", "trainer_ref"):
            trainer_run(root, run, resume=run != "trainer_ref")
        for run in ("accel", "accel_late", "accel_ref"):
            accel_run(root, run, resume=run != "accel_ref")
    elif phase == "first2":
        trainer_run(root, "trainer2", signal_at=SIGNAL2, signal_rank=1)
        try:
            accel_run(root, "accel2", signal_at=SIGNAL2, signal_rank=1)  # its SystemExit ends the launch
        finally:
            leave_together()  # every rank recorded its runs before one exits (the launcher then ends the other)
    elif phase == "resume2":
        trainer_run(root, "trainer2", resume=True)
        trainer_run(root, "trainer_ref2")
        accel_run(root, "accel2", resume=True)
        accel_run(root, "accel_ref2")
        leave_together()
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
