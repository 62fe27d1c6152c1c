"""The training process of ``layerckpt bench --goodput``: one attempt of a job that may be killed at any moment.

It trains the bench's GPT with AdamW on the deterministic batches of ``workload.batch`` (a batch depends on
the step alone, so an attempt that resumed at step k sees the data an uninterrupted run saw), in a plain
loop or under a Lightning Trainer, with the checkpointing its spec names, resuming from what that
checkpointing left.  It writes one JSON line per event to its progress file, flushed at once (a SIGKILL loses
nothing written; the supervisor reads what is there): ``imports`` (everything the job needs imported),
``setup`` (model, optimizer, checkpointer or Trainer built), ``restored`` (the step it resumes at), ``step``
(one per optimizer step: steps done and the loss) and ``save`` (a checkpoint taken at that step), each with
its wall-clock time.  The process start is the supervisor's spawn time.

Under the preemption kind (the spec's ``grace``: seconds from the notice, SIGTERM, to the SIGKILL) each contender
handles the notice as its users would: layerckpt's plain loop with ``Config(preemption=True, grace_s=grace)`` and
``ck.preempted(step)`` after each step, exiting with ``layerckpt.EXIT_PREEMPTED``; LayerCheckpoint at its
default (SIGTERM saved on) with ``grace_s``, the script exiting with ``EXIT_PREEMPTED`` where it stopped on a
notice; ModelCheckpoint with Lightning's own handling (its SIGTERM handler, ``SIGTERMException`` at the batch end),
saving on it only with ``--save-on-exception`` (``save_on_exception=True``, Lightning's opt-in); torch.save and ``dcp.async_save`` with a handler written by hand: SIGTERM sets a
flag, checked after each step: that step saved where it was not, the save waited for, exit 0.

Where each contender's files live: layerckpt writes its local store in ``node`` (lost with the node; its
memory tier in ``LAYERCKPT_SHM``, lost too) and copies to a ``file://`` remote tier in ``remote``;
torch.save, ``dcp.async_save`` and ModelCheckpoint write straight into ``remote``, which survives a node loss.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from typing import Any, Dict, Optional


class Progress:
    """The progress file: appended, one JSON line per event, flushed at once."""

    def __init__(self, path: str):
        self._f = open(path, "a", encoding="utf-8")

    def event(self, kind: str, **fields: Any) -> None:
        self._f.write(json.dumps({"e": kind, "t": time.time(), **fields}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def main(spec: Dict[str, Any]) -> None:
    progress = Progress(spec["progress"])
    # the process start: the supervisor's clock at the spawn (a standby's fork: when the supervisor let it start)
    progress.event("spawned", at=spec["spawned"], **({"standby": True} if "standby" in spec else {}))
    warnings.filterwarnings("ignore")
    import torch  # what the job imports is timed together, before setup

    torch.set_num_threads(spec["threads"])

    if spec["loop"] == "lightning":
        import logging

        import lightning.pytorch  # noqa: F401

        import lightning_layerckpt  # noqa: F401

        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    if spec["kind"] == "dcp.async_save":
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    progress.event("imports")
    try:
        (_lightning if spec["loop"] == "lightning" else _plain)(spec, progress)
    finally:
        progress.close()


def _model(spec: Dict[str, Any]):
    import torch

    from .models import GPT, GPTConfig

    torch.manual_seed(spec["seed"])
    return GPT(GPTConfig(**spec["model"]))


def _loss(model, spec: Dict[str, Any], step: int):
    from torch.nn import functional as F

    from .workload import batch

    x, y = batch("affine", step, spec["batch"])
    vocab = spec["model"]["vocab_size"]  # the task's tokens, folded into a smaller vocabulary
    return F.cross_entropy(model(x % vocab).flatten(0, 1), (y % vocab).flatten())


# ---------------------------------------------------------------- the plain loop

def _plain(spec: Dict[str, Any], progress: Progress) -> None:
    import torch

    model = _model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    saver = SAVERS[spec["kind"]](spec, model, opt)
    progress.event("setup")
    start = saver.restore()
    progress.event("restored", step=start)
    for step in range(start, spec["steps"]):
        loss = _loss(model, spec, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        progress.event("step", s=step + 1, loss=value)
        if step + 1 < spec["steps"] and saver.after_step(step + 1, value):
            progress.event("save", s=step + 1)
        stop = saver.preempted(step + 1) if step + 1 < spec["steps"] else None  # the last step: the job is done
        if stop is not None:
            if stop:
                progress.event("save", s=step + 1)
            raise SystemExit(saver.exit_status)
    saver.close()


class NoSaver:
    exit_status = 0  # on a notice handled

    def __init__(self, spec: Dict[str, Any], model, opt):
        self.spec, self.model, self.opt = spec, model, opt
        self.every = spec.get("every")
        self.last: Optional[int] = None  # the step of the last save made

    def restore(self) -> int:
        return 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int, loss: float) -> bool:
        if not self.due(step):
            return False
        self.save(step)
        self.last = step
        return True

    def save(self, step: int) -> None:
        pass

    def preempted(self, step: int) -> Optional[bool]:
        """At a step boundary: None where no notice came; else the notice is handled (the loop then exits with
        ``exit_status``): whether this step was saved on it."""
        return None

    def close(self) -> None:
        pass


class ByHand(NoSaver):
    """A notice handled as a user of torch.save or DCP writes it (the preemption kind only): a SIGTERM handler that
    sets a flag, checked after each step; on it, the step saved where it was not yet, the save waited for, exit 0."""

    def __init__(self, spec: Dict[str, Any], model, opt):
        super().__init__(spec, model, opt)
        self.notice = False
        if spec.get("grace") is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.notice = True

    def preempted(self, step: int) -> Optional[bool]:
        if not self.notice:
            return None
        fresh = self.last != step
        if fresh:
            self.save(step)
            self.last = step
        self.close()
        return fresh


class TorchSaver(ByHand):
    """``torch.save`` of the model's and optimizer's state dicts into one file, replaced whole (written beside
    it, then renamed: a kill midway leaves the previous one), not fsynced (as ModelCheckpoint)."""

    def __init__(self, spec, model, opt):
        super().__init__(spec, model, opt)
        os.makedirs(spec["remote"], exist_ok=True)
        self.path = os.path.join(spec["remote"], "last.pt")

    def restore(self) -> int:
        import torch

        if not os.path.exists(self.path):
            return 0
        sd = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        return int(sd["step"])

    def save(self, step: int) -> None:
        import torch

        tmp = self.path + ".tmp"
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, self.path)


class DcpSaver(ByHand):
    """``dcp.async_save`` of ``get_state_dict(model, opt)`` into a folder per step; one save in flight (the
    previous one's future is waited for first, as DCP asks); a folder is complete once DCP wrote its
    ``.metadata``; older complete folders are removed once a newer one is."""

    def __init__(self, spec, model, opt):
        super().__init__(spec, model, opt)
        self.root = spec["remote"]
        os.makedirs(self.root, exist_ok=True)
        self.future: Optional[Any] = None

    def _complete(self):
        names = [n for n in os.listdir(self.root) if n.startswith("step-")]
        return sorted((n for n in names if os.path.exists(os.path.join(self.root, n, ".metadata"))), reverse=True)

    def restore(self) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = self._complete()
        if not done:
            return 0
        msd, osd = get_state_dict(self.model, self.opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(self.root, done[0]))
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return int(done[0].split("-")[1])

    def save(self, step: int) -> None:
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._wait()
        for old in self._complete()[1:]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        msd, osd = get_state_dict(self.model, self.opt)
        self.future = dcp.async_save({"model": msd, "optim": osd},
                                     checkpoint_id=os.path.join(self.root, f"step-{step:08d}"))

    def _wait(self) -> None:
        if self.future is not None:
            f, self.future = self.future, None
            (f.upload_completion if hasattr(f, "upload_completion") else f).result()

    def close(self) -> None:
        self._wait()


class LayerSaver(NoSaver):
    """layerckpt's ``Checkpointer``, the default Config with the memory tier and a ``file://`` remote tier, every
    ``every`` steps or where ``layerckpt.Interval(mtbf)`` says; the restore reads the freshest of the local
    store, the memory tier and the remote (after a node loss: the remote).  Under the preemption kind: SIGTERM a
    notice of ``grace`` seconds (``Config.preemption``, ``grace_s``), asked at each step (``ck.preempted``)."""

    def __init__(self, spec, model, opt):
        import layerckpt

        super().__init__(spec, model, opt)
        self.node = os.path.join(spec["node"], "layerckpt")
        notice = {} if spec.get("grace") is None else {"preemption": True, "grace_s": spec["grace"]}
        self.config = layerckpt.Config(memory_tier=True, remote="file://" + os.path.abspath(spec["remote"]),
                                       **notice)
        self.exit_status = layerckpt.EXIT_PREEMPTED
        self.interval = layerckpt.Interval(spec["mtbf"]) if spec.get("mtbf") else None
        self.ck: Optional[Any] = None

    def restore(self) -> int:
        import layerckpt

        try:
            report = layerckpt.restore(self.node, self.model, self.opt, config=self.config)
        except layerckpt.CheckpointNotFoundError:
            report = None
        self.ck = layerckpt.Checkpointer(self.node, self.model, self.opt, config=self.config)
        if report is not None and "://" not in str(report.manifest):  # a remote composite is no local one to adopt
            self.ck.adopt(report)
        return 0 if report is None else int(report.step)

    def after_step(self, step: int, loss: float) -> bool:
        if self.interval is not None:
            if not self.interval.due(step):
                return False
            self.interval.saved(self.ck.save(step, loss=loss))
            self.last = step
            return True
        if not self.due(step):
            return False
        self.ck.save(step, loss=loss)
        self.last = step
        return True

    def preempted(self, step: int) -> Optional[bool]:
        from layerckpt import store

        if not self.ck.preempted(step):
            return None
        return self.last != step and os.path.exists(store.manifest_path(self.node, step))

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


SAVERS = {"none": NoSaver, "torch.save": TorchSaver, "dcp.async_save": DcpSaver, "layerckpt": LayerSaver}


# ---------------------------------------------------------------- under a Lightning Trainer

def _lightning(spec: Dict[str, Any], progress: Progress) -> None:
    import lightning.pytorch as L
    import torch

    class Job(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model(spec)

        def training_step(self, b, i):
            return _loss(self.net, spec, int(self.global_step))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=spec["lr"])

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(10 ** 7), batch_size=1)  # only its length matters

        def on_save_checkpoint(self, checkpoint):
            progress.event("save", s=int(self.global_step))

    class Report(L.Callback):  # before any checkpoint callback (Lightning runs those last)
        def setup(self, trainer, pl_module, stage):
            progress.event("setup")

        def on_train_start(self, trainer, pl_module):
            progress.event("restored", step=int(trainer.global_step))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            progress.event("step", s=int(trainer.global_step), loss=float(loss))

    callbacks = [Report()] + _lightning_checkpoint(spec)
    trainer = L.Trainer(max_steps=spec["steps"], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_checkpointing=len(callbacks) > 1, callbacks=callbacks,
                        default_root_dir=spec["node"])
    trainer.fit(Job(), ckpt_path="last" if len(callbacks) > 1 else None)
    if any(getattr(c, "preempted", False) for c in callbacks):  # LayerCheckpoint stopped the fit on a notice
        import layerckpt

        raise SystemExit(layerckpt.EXIT_PREEMPTED)


def _lightning_checkpoint(spec: Dict[str, Any]) -> list:
    """The contender's checkpoint callback: ModelCheckpoint's cheapest resumable form (one ``last.ckpt``,
    replaced whole at each save), or LayerCheckpoint with both tiers.  Under the preemption kind ModelCheckpoint
    keeps Lightning's default (no save on the exception Lightning's SIGTERM handler raises) unless the spec's
    ``save_on_exception`` asks for Lightning's opt-in, and LayerCheckpoint,
    which saves on SIGTERM by default, is told the grace (``grace_s``)."""
    notice = spec.get("grace") is not None
    if spec["kind"] == "ModelCheckpoint":
        from lightning.pytorch.callbacks import ModelCheckpoint

        return [ModelCheckpoint(dirpath=spec["remote"], every_n_train_steps=spec["every"], save_top_k=0,
                                save_last=True, enable_version_counter=False,
                                save_on_exception=notice and spec.get("save_on_exception", False))]
    if spec["kind"] == "LayerCheckpoint":
        from lightning_layerckpt import LayerCheckpoint

        trigger = {"mtbf": spec["mtbf"]} if spec.get("mtbf") else {"every_n_train_steps": spec["every"]}
        if notice:
            trigger["grace_s"] = spec["grace"]
        return [LayerCheckpoint(dirpath=os.path.join(spec["node"], "layerckpt"), memory_tier=True,
                                remote="file://" + os.path.abspath(spec["remote"]), **trigger)]
    return []


if __name__ == "__main__":  # python -m layerckpt.bench.goodput_child SPEC (the supervisor uses goodput's entry)
    main(json.loads(sys.argv[1]))
