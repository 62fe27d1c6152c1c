"""The worker of tests/test_nodes_lightning.py: one rank of a Lightning DDP fit over simulated nodes.

    python -m torch.distributed.run --nnodes N --node-rank K ... tests/nodes_lightning_helpers.py MODE BASE

Lightning takes its world from torchrun's environment (``Trainer(num_nodes=N, devices=2, strategy="ddp")``).
MODE ``ref`` trains 20 steps uninterrupted into BASE/ref<K>; ``crash`` saves every 4 steps into the node's own
directory BASE/node<K> (``LayerCheckpoint(dirpath=..., replicas=1)``, full checkpoints; each node's ranks as torchrun gives them) and stops at step 14 as
a crash would; ``resume`` runs ``fit(ckpt_path="last")`` to step 20 in the same directories.  Each rank of
``ref`` and ``resume`` writes BASE/<mode>.rank<R>.pt: its final model and optimizer state and a draw of its
RNG (a resume is bit-exact only if the weights, the optimizer, the loops and every rank's RNG came back), and
``resume`` its LayerCheckpoint's ``restored`` record.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lit_helpers import Crash, CrashAt, Tiny, trainer  # noqa: E402


def main(mode: str, base: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_layerckpt import LayerCheckpoint

    node = int(os.environ["GROUP_RANK"])
    nnodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(7)
    model = Tiny(seed=0 if mode != "resume" else 3)
    where = os.path.join(base, f"ref{node}" if mode == "ref" else f"node{node}")
    ck = LayerCheckpoint(dirpath=where, every_n_train_steps=4, threshold=0.0, replicas=1)
    cbs = [ck] + ([CrashAt(14)] if mode == "crash" else [])
    strategy = DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    t = trainer(20, cbs, where, strategy=strategy, devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=nnodes)
    try:
        t.fit(model, ckpt_path="last" if mode == "resume" else None)
    except Crash:
        pass
    if mode != "crash":
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optim": t.optimizers[0].state_dict(), "rng": torch.rand(3), "global_step": t.global_step,
                    "restored": ck.restored}, os.path.join(base, f"{mode}.rank{t.global_rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (tests/test_exit.py)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
