"""The fine-tuning workload of ``layerckpt.bench.workload`` as a LightningModule, for the example and the tests.

Batches depend only on (task, global step, rank), never on the data loader's position, so a run
stopped mid-epoch and resumed sees exactly the data of the run that never stopped; dropout draws
from the global RNG, so a resume is bit-exact only if each rank's RNG states come back too.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import lightning.pytorch as L
import torch
from torch.nn import functional as F

from .workload import FINETUNE_LR, batch, make_model, make_optimizer, run

_PRETRAINED: Dict[Tuple[int, int, int], Dict[str, torch.Tensor]] = {}


class FineTuneModule(L.LightningModule):
    def __init__(self, n_layer: int = 6, n_embd: int = 128, lr: float = FINETUNE_LR, task: str = "affine",
                 dropout: float = 0.0, seed: int = 0, batch_size: int = 16, scheduler_step: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.net = make_model(seed, n_layer=n_layer, n_embd=n_embd)
        self.losses: List[float] = []

    def training_step(self, b, i):
        world = self.trainer.world_size if self._trainer is not None else 1
        x, y = batch(self.hparams.task, int(self.global_step) * world + self.global_rank, self.hparams.batch_size)
        logits = self.net(x)
        if self.hparams.dropout:
            logits = F.dropout(logits, p=self.hparams.dropout, training=True)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = make_optimizer(self, lr=self.hparams.lr)
        if not self.hparams.scheduler_step:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=self.hparams.scheduler_step, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(100_000), batch_size=1)  # only its length matters

    def pretrain(self, steps: int = 60) -> "FineTuneModule":
        """Load weights pre-trained on the `count` task (computed once per process, RNG left as it was)."""
        key = (self.hparams.n_layer, self.hparams.n_embd, steps)
        if key not in _PRETRAINED:
            net = make_model(0, n_layer=self.hparams.n_layer, n_embd=self.hparams.n_embd)
            rng = torch.get_rng_state()
            run(net, make_optimizer(net), "count", 0, steps)
            torch.set_rng_state(rng)
            _PRETRAINED[key] = {k: v.clone() for k, v in net.state_dict().items()}
        self.net.load_state_dict(_PRETRAINED[key])
        return self
