"""What tests/test_preempt.py runs in processes of their own, one or two ranks (torchrun, or Lightning's DDP):

    python tests/preempt_helpers.py plain|lightning ROOT MODE [KEY=VALUE ...]

MODE ``ref`` trains STEPS steps uninterrupted; ``notice`` trains until a notice stops it: at step SIGNAL_AT the rank
``signal_rank`` sends SIGTERM to its own process (a real signal, through the handler the library installed), and
the run stops where the ranks agreed; ``resume`` restores the newest committed checkpoint and trains to STEPS.  The
plain loop saves every EVERY steps with ``full=True`` (a resume is then bit-exact) and asks ``ck.preempted(step)``
at each step; Lightning runs LayerCheckpoint at its defaults but ``full=True`` (preemption is on by default there).

Each rank writes ROOT/MODE.rank<r>.json last: the step it stopped at, the step it resumed from, its exit status to
be, and ROOT/MODE.rank<r>.pt: its final weights and optimizer state.  Options: ``signal_rank`` (default: the last
rank), ``grace_s``, ``fault`` (a fault point at which the notice is sent instead, from the flusher thread),
``remote`` (a remote tier URL); Lightning: ``devices``, ``early`` (the notice at the fit's start, before
LayerCheckpoint's handler is installed).
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import layerckpt

STEPS, EVERY, SIGNAL_AT = 12, 4, 6
HERE = os.path.dirname(os.path.abspath(__file__))


def _notice() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _write(root: str, mode: str, rank: int, out: Dict[str, Any], model, opt) -> None:
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": opt.state_dict()}, os.path.join(root, f"{mode}.rank{rank}.pt"))
    with open(os.path.join(root, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump(out, f)


def plain(root: str, mode: str, opts: Dict[str, str]) -> int:
    from torch.nn.parallel import DistributedDataParallel

    from layerckpt import _faults
    from layerckpt.bench.workload import batch, make_model, make_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = make_model(0, n_layer=2, n_embd=16)
    opt = make_optimizer(model)
    torch.manual_seed(100 + rank)
    store = os.path.join(root, "store")
    cfg = dict(full=True, preemption=True)
    if "grace_s" in opts:
        cfg["grace_s"] = float(opts["grace_s"])
    if "remote" in opts:
        cfg["remote"] = opts["remote"]
    out: Dict[str, Any] = {"rank": rank, "stopped": None, "restored": None, "exit": 0}
    ck = None
    done = 0
    if mode != "ref":
        if mode == "resume":
            report = layerckpt.restore(store, model, opt)
            done = out["restored"] = report.step
        ck = layerckpt.Checkpointer(store, model, opt, config=layerckpt.Config(**cfg))
    signal_rank = int(opts.get("signal_rank", world - 1))
    net = DistributedDataParallel(model) if world > 1 else model
    for step in range(done + 1, STEPS + 1):
        x, y = batch("affine", step * world + rank, 8)
        loss = F.cross_entropy(F.dropout(net(x), 0.1, training=True).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ck is not None and step % EVERY == 0:
            ck.save(step, loss=loss.item())
        if mode == "notice" and step == SIGNAL_AT and rank == signal_rank:
            if "fault" in opts:  # the notice comes while that save is at this point, on the flusher thread
                _faults.install(opts["fault"], _notice)
            else:
                _notice()
        if ck is not None and ck.preempted(step):
            out["stopped"], out["exit"] = step, layerckpt.EXIT_PREEMPTED
            break
    if ck is not None:
        ck.close()
    _write(root, mode, rank, out, model, opt)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return out["exit"]


def lightning(root: str, mode: str, opts: Dict[str, str]) -> int:
    import lightning.pytorch as L

    sys.path.insert(0, HERE)
    from lit_helpers import Tiny, trainer

    from lightning_layerckpt import LayerCheckpoint

    devices = int(opts.get("devices", "1"))

    class SignalAt(L.Callback):
        def on_train_start(self, trainer, pl_module):  # before LayerCheckpoint's: Lightning's handler gets it
            if mode == "notice" and opts.get("early") and trainer.global_rank == int(opts.get("signal_rank", 0)):
                _notice()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if mode == "notice" and not opts.get("early") and trainer.global_step == SIGNAL_AT and \
                    trainer.global_rank == int(opts.get("signal_rank", devices - 1)):
                _notice()

    torch.manual_seed(7)
    model = Tiny(seed=0 if mode != "resume" else 3)
    kw = {"grace_s": float(opts["grace_s"])} if "grace_s" in opts else {}
    cb = LayerCheckpoint(dirpath=os.path.join(root, "ref" if mode == "ref" else "store"), every_n_train_steps=EVERY,
                         full=True, **kw)
    t = trainer(STEPS, [SignalAt(), cb], root, strategy="ddp" if devices > 1 else "auto", devices=devices)
    t.fit(model, ckpt_path="last" if mode == "resume" else None)
    out = {"rank": t.global_rank, "stopped": int(t.global_step) if cb.preempted else None,
           "restored": cb.restored["step"] if cb.restored else None,
           "exit": layerckpt.EXIT_PREEMPTED if cb.preempted else 0, "global_step": int(t.global_step),
           "losses": list(model.losses)}
    _write(root, mode, t.global_rank, out, model, t.optimizers[0])
    return out["exit"]


def main(argv) -> int:
    kind, root, mode, *rest = argv
    opts = dict(kv.split("=", 1) for kv in rest)
    torch.set_num_threads(1)
    return {"plain": plain, "lightning": lightning}[kind](root, mode, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
