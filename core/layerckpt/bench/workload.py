"""A small, deterministic post-training workload: pre-train on one synthetic task, fine-tune on another.

Batches depend only on (task, step), never on global RNG state, so a run that
is stopped and restored sees exactly the data the uninterrupted run saw.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Tuple

import torch
from torch.nn import functional as F

from .models import GPT, GPTConfig

VOCAB = 96
SEQ = 32
NOISE = 0.3  # chance that the next token jumps at random: an irreducible loss, as in language data
TASKS = {
    "count": (1, 1),  # x[t+1] = (a * x[t] + b) mod VOCAB
    "affine": (5, 3),
}


def make_model(seed: int = 0, n_layer: int = 6, n_embd: int = 128) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer, n_head=4))


PRETRAIN_LR = 1e-3
FINETUNE_LR = 3e-4  # post-training runs at a lower learning rate than pre-training


def make_optimizer(model: torch.nn.Module, lr: float = PRETRAIN_LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def start_finetune(opt: torch.optim.Optimizer, lr: float = FINETUNE_LR) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def batch(task: str, step: int, batch_size: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = TASKS[task]
    g = torch.Generator().manual_seed(step * 1009 + sorted(TASKS).index(task))  # stable across processes
    x0 = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    jump = torch.rand(batch_size, SEQ, generator=g) < NOISE
    rand = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    seq = [x0]
    for t in range(SEQ):
        seq.append(torch.where(jump[:, t:t + 1], rand[:, t:t + 1], (a * seq[-1] + b) % VOCAB))
    s = torch.cat(seq, dim=1)
    return s[:, :-1], s[:, 1:]


def train_step(model, opt, task: str, step: int) -> float:
    x, y = batch(task, step)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run(model, opt, task: str, start: int, stop: int,
        after_step: Optional[Callable[[int, float], None]] = None) -> List[float]:
    """Train steps [start, stop) of ``task``; returns the losses."""
    losses = []
    for step in range(start, stop):
        loss = train_step(model, opt, task, step)
        losses.append(loss)
        if after_step is not None:
            after_step(step, loss)
    return losses


def post_training_run(root: str, config=None, every: int = 4, crash_at: int = 168, pretrain: int = 60,
                      finetune: int = 240, seed: int = 0) -> dict:
    """The whole story on one directory: pre-train, fine-tune with a checkpoint every ``every`` steps,
    then restore the composite of fine-tuning step ``crash_at`` in a fresh model and optimizer and
    train on to the end.  Returns bytes written against full checkpoints, and the losses after the
    restore against the run that never stopped."""
    import time

    from ..checkpointer import Checkpointer
    from ..config import Config
    from ..restore import restore

    cfg = (config or Config()).replace(keep_last=0)  # keep every composite: any step may be restored
    model = make_model(seed)
    opt = make_optimizer(model)
    run(model, opt, "count", 0, pretrain)
    start_finetune(opt)
    saves = []
    with Checkpointer(root, model, opt, config=cfg) as ck:
        def after(step: int, loss: float) -> None:
            if (step + 1) % every == 0:
                p = ck.save(step + 1, extra={"finetune_step": step + 1}, loss=loss)
                saves.append(p)
                p.wait()

        reference = run(model, opt, "affine", 0, finetune, after)
    full_bytes = saves[0].nbytes  # the first save is always full
    model2 = make_model(seed + 1)
    opt2 = make_optimizer(model2)
    t = time.perf_counter()
    report = restore(root, model2, opt2, step=crash_at)
    resume_s = time.perf_counter() - t
    resumed = run(model2, opt2, "affine", crash_at, finetune)
    want = reference[crash_at:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "saves": len(saves), "bytes": sum(p.nbytes for p in saves), "full_bytes": full_bytes * len(saves),
        "stall_s": sum(p.stall_s for p in saves), "report": report, "resume_s": resume_s,
        "losses_after": resumed, "reference_after": want,
        "mean_loss_rel": abs(mean(resumed) - mean(want)) / mean(want), "identical": resumed == want,
    }


# ------------------------------------------------------------------ what the crash-and-resume examples share

def crash_resume_parser(doc: Optional[str], every: str = "checkpoint every N fine-tuning steps",
                        finetune: str = "fine-tuning steps of every run",
                        model: bool = True) -> argparse.ArgumentParser:
    """The arguments every crash-and-resume example takes (``examples/*_finetune.py``): where it works, the
    cadence, the step it is killed at and, with ``model``, the run's length and the model's size.  ``every`` and
    ``finetune`` name the framework's own setting in the help."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="working directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--every", type=int, default=4, help=every)
    ap.add_argument("--crash-at", type=int, default=170, help="fine-tuning step at which the run is killed")
    if model:
        ap.add_argument("--finetune", type=int, default=240, help=finetune)
        ap.add_argument("--pretrain", type=int, default=60,
                        help="pre-training steps of the model every run starts from (not checkpointed)")
        ap.add_argument("--n-layer", type=int, default=6, help="transformer blocks of the model")
        ap.add_argument("--n-embd", type=int, default=128, help="width of the model")
    return ap


def check_crash_resume(ap: argparse.ArgumentParser, args: argparse.Namespace, finetune: int = 240) -> None:
    """A run that saves before the kill and has steps after it to resume, or a usage error naming the three."""
    total = getattr(args, "finetune", finetune)
    if not 0 < args.every < args.crash_at < total:
        ap.error(f"need 0 < --every ({args.every}) < --crash-at ({args.crash_at}) < --finetune ({total}): "
                 f"a checkpoint before the kill, and steps after it to resume")


def folder_bytes(folder: str) -> int:
    """Bytes of the files below ``folder``; a file renamed or removed meanwhile (another rank's temporary file)
    counts for nothing."""
    total = 0
    for d, _, files in os.walk(folder):
        for n in files:
            try:
                total += os.path.getsize(os.path.join(d, n))
            except FileNotFoundError:
                pass
    return total
