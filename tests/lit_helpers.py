"""Helpers for the Lightning adapter tests, and a script entry point for DDP runs."""
import os
import sys

import lightning.pytorch as L
import torch

from layerckpt.bench.lightning_workload import FineTuneModule


TINY = dict(n_layer=2, n_embd=32, lr=1e-3, task="count", dropout=0.1, batch_size=8, scheduler_step=5)


def Tiny(**kw) -> FineTuneModule:
    """A tiny model with dropout and a per-step LR schedule: every piece of state a resume must bring back."""
    return FineTuneModule(**{**TINY, **kw})


def pretrained(m: FineTuneModule) -> FineTuneModule:
    return m.pretrain()


class Crash(Exception):
    pass


class CrashAt(L.Callback):
    """Stops a run with an exception when it reaches ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash(f"stopped at step {self.step}")


def trainer(max_steps: int, callbacks, root: str, **kw) -> L.Trainer:
    kw.setdefault("logger", False)
    return L.Trainer(max_steps=max_steps, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, default_root_dir=root, num_sanity_val_steps=0, **kw)


def state_of(t: L.Trainer, m: L.LightningModule) -> dict:
    """Everything a resumed run must match: model, optimizer, scheduler, loops, step."""
    return {"model": {k: v.clone() for k, v in m.state_dict().items()},
            "optimizer": t.optimizers[0].state_dict(), "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(),
            "loops": t.fit_loop.state_dict(), "global_step": t.global_step, "epoch": t.current_epoch}


def ddp_main(root: str, mode: str, threshold: float) -> None:
    """mode: `ref` (uninterrupted), `crash` (stops at step 14), `resume` (from "last")."""
    import json

    from lightning_layerckpt import LayerCheckpoint

    torch.manual_seed(7)
    model = Tiny(seed=0 if mode != "resume" else 3)
    ck = LayerCheckpoint(dirpath=os.path.join(root, mode if mode == "ref" else "run"), every_n_train_steps=4,
                         threshold=threshold)
    cbs = [ck] + ([CrashAt(14)] if mode == "crash" else [])
    t = trainer(20, cbs, root, strategy="ddp", devices=2)
    try:
        t.fit(model, ckpt_path="last" if mode == "resume" else None)
    except Crash:
        pass
    if mode != "crash":
        out = {k: v.tolist() for k, v in model.state_dict().items()}
        st = t.optimizers[0].state_dict()["state"]
        out["opt"] = {str(i): {k: v.tolist() for k, v in s.items()} for i, s in st.items()}
        out["loops"] = json.loads(json.dumps(t.fit_loop.state_dict(), default=str))
        out["rng"] = torch.rand(3).tolist()
        with open(os.path.join(root, f"{mode}.rank{t.global_rank}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    ddp_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
