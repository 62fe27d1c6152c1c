"""A Lightning ModelParallelStrategy (FSDP2) run on 2 CPU processes, for tests/test_sharded.py:
``python tests/lit_fsdp_helpers.py ROOT MODE`` with MODE ``ref`` (uninterrupted), ``crash`` (stops at step
14) or ``resume`` (from "last").  Each rank writes its final state, gathered, to ``ROOT/<mode>.rank<r>.pt``."""
import os
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lit_helpers import TINY, Crash, CrashAt  # noqa: E402
from layerckpt.bench.lightning_workload import FineTuneModule  # noqa: E402
from lightning_layerckpt import LayerCheckpoint  # noqa: E402


class ShardedTiny(FineTuneModule):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def main(root: str, mode: str) -> None:
    torch.manual_seed(7)
    model = ShardedTiny(**{**TINY, "dropout": float(os.environ.get("DROPOUT", TINY["dropout"])), "seed": 0 if mode != "resume" else 3})
    ck = LayerCheckpoint(dirpath=os.path.join(root, "ref" if mode == "ref" else "run"), every_n_train_steps=4,
                         threshold=0.0)
    t = L.Trainer(max_steps=20, accelerator="cpu", devices=2, enable_progress_bar=False, enable_model_summary=False,
                  logger=False, num_sanity_val_steps=0, default_root_dir=root,
                  strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                  callbacks=[ck] + ([CrashAt(14)] if mode == "crash" else []))
    try:
        t.fit(model, ckpt_path="last" if mode == "resume" else None)
    except Crash:
        return
    whole = (lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v)
    out = {f"model/{k}": whole(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in t.optimizers[0].state.items():
        out.update({f"optim/{names[id(p)]}/{k}": whole(v) for k, v in st.items()})
    out["rng"] = torch.rand(3)
    out["restored_step"] = torch.tensor(ck.restored["step"] if ck.restored else -1)
    torch.save(out, os.path.join(root, f"{mode}.rank{t.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
