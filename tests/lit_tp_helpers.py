"""A Lightning ModelParallelStrategy run with tensor parallelism on 4 CPU processes (data_parallel_size=2,
tensor_parallel_size=2: ColwiseParallel/RowwiseParallel over the tp dim, fully_shard over dp), for
tests/test_layouts.py: ``python tests/lit_tp_helpers.py ROOT MODE`` with MODE ``ref`` (uninterrupted), ``crash``
(stops at step 10), ``resume`` (from "last") or ``reshard`` (from "last" of ``ROOT/reshard``, a copy of the
crashed run's store, into data_parallel_size=4, tensor_parallel_size=1, writing the state it starts from to ``ROOT/start.rank<r>.pt``).  Each rank writes its
final state, gathered, to ``ROOT/<mode>.rank<r>.pt``."""
import os
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lit_helpers import Crash, CrashAt  # noqa: E402
from tp_helpers import VOCAB, Net  # noqa: E402
from lightning_layerckpt import LayerCheckpoint  # noqa: E402


class Steps(torch.utils.data.Dataset):
    """Batches are made from the step (a resumed loader restarts its epoch; the step does not)."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return i


class TPModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        dp, tp = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
        for b in self.net.blocks:
            if tp.size() > 1:
                parallelize_module(b, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(b, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def training_step(self, batch, i):
        dp = self.device_mesh["data_parallel"].get_local_rank()  # the tp ranks of a dp rank see one batch
        g = torch.Generator().manual_seed(int(self.global_step) * self.device_mesh["data_parallel"].size() + dp)
        out = self.net(torch.randint(0, VOCAB, (4, 3), generator=g))
        return (out + 0.01 * torch.randn_like(out)).square().mean()  # the RNG of each rank matters

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Steps(), batch_size=4)


class Restored(L.Callback):
    """Writes the state the run starts training from, gathered, to ``ROOT/start.rank<r>.pt``."""

    def __init__(self, root: str):
        self.root = root

    def on_train_start(self, trainer, pl_module):
        torch.save(gathered(trainer, pl_module), os.path.join(self.root, f"start.rank{trainer.global_rank}.pt"))


def gathered(t: L.Trainer, model: L.LightningModule) -> dict:
    whole = (lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v)
    out = {f"model/{k}": whole(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in t.optimizers[0].state.items():
        out.update({f"optim/{names[id(p)]}/{k}": whole(v) for k, v in st.items()})
    return out


def main(root: str, mode: str) -> None:
    torch.manual_seed(7)
    model = TPModule()
    store = {"ref": "ref", "reshard": "reshard"}.get(mode, "run")  # reshard: a copy of the crashed run's store
    ck = LayerCheckpoint(dirpath=os.path.join(root, store), every_n_train_steps=4,
                         threshold=0.0, keep_last=0)
    dp, tp = (4, 1) if mode == "reshard" else (2, 2)  # reshard: resume into another layout
    t = L.Trainer(max_steps=14, accelerator="cpu", devices=4, enable_progress_bar=False, enable_model_summary=False,
                  logger=False, num_sanity_val_steps=0, default_root_dir=root,
                  strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
                  callbacks=[ck] + ([CrashAt(10)] if mode == "crash" else [])
                  + ([Restored(root)] if mode == "reshard" else []))
    try:
        t.fit(model, ckpt_path="last" if mode in ("resume", "reshard") else None)
    except Crash:
        return
    out = gathered(t, model)
    out["rng"] = torch.rand(3)
    out["restored_step"] = torch.tensor(ck.restored["step"] if ck.restored else -1)
    torch.save(out, os.path.join(root, f"{mode}.rank{t.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
