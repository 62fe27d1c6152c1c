"""`layerckpt bench --policy --through ...`: the selection defaults on the workload family, through the adapters.

The same workloads, cadence and crash points as :mod:`layerckpt.bench.policy`, but trained and resumed the way a
user of each framework does it, so that what an adapter hands the selection (the loss it is scaled by, the step,
gradient clipping, a learning-rate schedule) is part of the measurement:

- ``lightning``: a LightningModule under ``lightning.Trainer`` with ``LayerCheckpoint(every_n_train_steps=...,
  save_top_k=-1)``, resumed by a new Trainer's ``fit(ckpt_path=<the composite's manifest>)``;
- ``accelerate``: a loop over ``Accelerator.backward`` with ``LayerCheckpointPlugin`` registered and
  ``save_state()`` at the cadence, resumed by a new Accelerator's ``load_state(<folder>)``;
- ``trainer``: ``transformers.Trainer`` with its defaults (linear decay to 0 over the run, gradient clipping at
  ``max_grad_norm=1.0``) on the workload's optimizer, ``attach(trainer)``, resumed by a new Trainer's
  ``train(resume_from_checkpoint=<checkpoint-N>)``.

Each step's batch is the workload's batch of the global step, whatever the framework's data loader yields (a
resume then sees the batches the uninterrupted run saw).  Each resume runs in a copy of the run's folder, so that
its own later saves leave the uninterrupted run's composites as they were.  Reported per adapter and workload:
bytes the selective saves persisted against full checkpoints at the same cadence, and the mean training loss
after each restore against the adapter's own uninterrupted run over the same steps (the 0.5% bound).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import Config
from ..format._manifest import load_manifest
from ..format._store import list_manifests
from .family import WORKLOADS, Workload

THROUGH = ("core", "lightning", "accelerate", "trainer")
ADAPTERS = THROUGH[1:]
#: what each adapter needs installed (the extra that brings it)
NEEDS = {"lightning": ("lightning", "lightning"), "accelerate": ("accelerate", "accelerate"),
         "trainer": ("transformers", "transformers")}


def parse_through(text: str) -> List[str]:
    """``--through``'s comma-separated names, checked (``CheckpointError`` naming a wrong or missing one)."""
    import importlib.util

    from ..errors import CheckpointError

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in THROUGH]
    if not names or bad or len(set(names)) < len(names):
        raise CheckpointError(f"--through {text}: give distinct names of {', '.join(THROUGH)}, comma-separated "
                              f"(e.g. core,lightning,accelerate,trainer)")
    for t in names:
        if t in NEEDS and importlib.util.find_spec(NEEDS[t][0]) is None:
            raise CheckpointError(f"--through {t}: {NEEDS[t][0]} is not installed; pip install "
                                  f"\"layerckpt[{NEEDS[t][1]}]\" or leave {t} out")
    return names


# ---------------------------------------------------------------- what a run wrote

def _store_roots(root: str) -> List[str]:
    """Every layerckpt store under ``root`` (a folder holding ``manifests/``)."""
    return sorted(d for d, subdirs, _ in os.walk(root) if "manifests" in subdirs)


def _manifests(store: str) -> list:
    """The committed composites of ``store``, oldest first."""
    return [load_manifest(os.path.join(store, "manifests", name)) for _, name in list_manifests(store)]


def written(root: str) -> Dict[str, int]:
    """What the composites of the one store under ``root`` persisted: layer bytes of each save's own layers
    (raw), the data files each save wrote (written), and the whole composites' layer bytes (a full checkpoint's
    payload, at the same cadence)."""
    stores = _store_roots(root)
    if len(stores) != 1:
        raise RuntimeError(f"expected one layerckpt store under {root}, found {stores or 'none'}")
    each = [save_bytes(m) for m in _manifests(stores[0])]
    return {"saves": len(each), "bytes": sum(b[0] for b in each), "written_bytes": sum(b[1] for b in each),
            "full_bytes": sum(b[2] for b in each)}


def save_bytes(m) -> Tuple[int, int, int]:
    """What the composite ``m``'s own save persisted: (layer bytes of the layers it wrote, bytes of the data files
    it wrote, layer bytes of the whole composite: a full checkpoint's payload)."""
    return (sum(e.nbytes for e in m.layers.values() if e.step == m.step and e.age == 0),
            sum(f.size for f in m.files.values() if f.step == m.step),
            sum(e.nbytes for e in m.layers.values()))


def _behind(root: str, nth: int, every: int) -> int:
    """Steps the oldest trained layer of the ``nth`` composite (1-based) trails it: its age in saves times the
    cadence (an adapter may number its composites otherwise than by training step)."""
    m = _manifests(_store_roots(root)[0])[nth - 1]
    return max((e.age * every for e in m.layers.values() if not e.frozen), default=0)


# ---------------------------------------------------------------- Lightning

def _lightning_module(w: Workload, losses: Dict[int, float]):
    import lightning.pytorch as pl

    class FamilyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = w.build()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            step = self.global_step  # optimizer steps so far: the index of this one
            loss = w.loss(self.model, w.batch(step))
            losses[step] = float(loss.detach())
            return loss

        def configure_optimizers(self):
            return w.optim(self.model)

    return FamilyModule()


def _steps_loader(steps: int):
    """A data loader of ``steps`` placeholder batches (the module takes the workload's batch of the step)."""
    return torch.utils.data.DataLoader(list(range(steps)), batch_size=1, shuffle=False)


def _lightning(w: Workload, config: Config, root: str, steps: int, resume_at: Optional[int] = None
               ) -> Dict[int, float]:
    import lightning.pytorch as pl

    from lightning_layerckpt import LayerCheckpoint
    from ..store import manifest_path

    losses: Dict[int, float] = {}
    torch.manual_seed(0 if resume_at is None else 1)
    module = _lightning_module(w, losses)
    cb = LayerCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=w.every, save_top_k=-1,
                         config=config.replace(keep_last=0), log_stats=False)
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                         callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root)
    ckpt = None if resume_at is None else manifest_path(os.path.join(root, "ckpt"), resume_at)
    trainer.fit(module, train_dataloaders=_steps_loader(steps), ckpt_path=ckpt)
    cb.wait()
    return losses


# ---------------------------------------------------------------- Accelerate

def _accelerate(w: Workload, config: Config, root: str, steps: int, resume_at: Optional[int] = None
                ) -> Dict[int, float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from accelerate_layerckpt import LayerCheckpointPlugin

    losses: Dict[int, float] = {}
    torch.manual_seed(0 if resume_at is None else 1)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root,
                                                                    automatic_checkpoint_naming=True))
    plugin = LayerCheckpointPlugin(config, log_stats=False).register(acc)
    try:
        model, opt = w.make()
        model, opt = acc.prepare(model, opt)
        start = 0
        if resume_at is not None:
            acc.load_state(os.path.join(root, "checkpoints", f"checkpoint_{resume_at // w.every - 1}"))
            start = resume_at
        for step in range(start, steps):
            model.train()
            loss = w.loss(model, w.batch(step))
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = float(loss.detach())
            if resume_at is None and (step + 1) % w.every == 0:
                acc.save_state()
        plugin.wait()
    finally:
        plugin.close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return losses


# ---------------------------------------------------------------- transformers Trainer

def _trainer(w: Workload, config: Config, root: str, steps: int, resume_at: Optional[int] = None
             ) -> Dict[int, float]:
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

    import transformers_layerckpt

    losses: Dict[int, float] = {}

    class FamilyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ARG002
            step = self.state.global_step
            loss = w.loss(model, w.batch(step))
            losses[step] = float(loss.detach())
            return (loss, None) if return_outputs else loss

    torch.manual_seed(0 if resume_at is None else 1)
    model, opt = w.make()
    args = TrainingArguments(root, max_steps=steps, save_steps=w.every, per_device_train_batch_size=1,
                             report_to=[], use_cpu=True, seed=0, logging_steps=w.every, disable_tqdm=True,
                             remove_unused_columns=False, dataloader_num_workers=0)  # Trainer's defaults otherwise
    trainer = FamilyTrainer(model=model, args=args, train_dataset=[{"i": i} for i in range(steps)],
                            data_collator=lambda rows: {"i": torch.tensor([r["i"] for r in rows])},
                            optimizers=(opt, None))
    for printer in (PrinterCallback, ProgressCallback):  # its logs on stdout: the table is the output
        trainer.remove_callback(printer)
    handle = transformers_layerckpt.attach(trainer, config)
    try:
        trainer.train(resume_from_checkpoint=None if resume_at is None
                      else os.path.join(root, f"checkpoint-{resume_at}"))
    finally:
        handle.wait()
    return losses


RUNNERS: Dict[str, Callable[..., Dict[int, float]]] = {
    "lightning": _lightning, "accelerate": _accelerate, "trainer": _trainer}


# ---------------------------------------------------------------- the measurement

def run(w: Workload, through: str, config: Config, root: str, crashes: Sequence[float],
        steps: Optional[int] = None) -> Dict[str, Any]:
    """One workload through one adapter: the uninterrupted run, then at each crash point a resume (in a copy of
    the run's folder) trained to the end; the loss after it against the uninterrupted run's."""
    steps = steps or w.steps
    t0 = time.perf_counter()
    runner = RUNNERS[through]
    first = os.path.join(root, "run")
    full = runner(w, config, first, steps)
    losses = [full[s] for s in range(steps)]
    out: Dict[str, Any] = {"workload": w.name, "through": through, "steps": steps, "every": w.every,
                           **written(first)}
    out["ratio"] = out["full_bytes"] / max(out["bytes"], 1)
    saves = list(range(w.every, steps + 1, w.every))
    out["crashes"] = []
    for frac in crashes:
        at = min(saves, key=lambda s: abs(s - frac * steps))
        copy = os.path.join(root, f"resume-{at}")
        shutil.copytree(first, copy, symlinks=True)
        try:
            after = runner(w, config, copy, steps, resume_at=at)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        got = [after[s] for s in range(at, steps)]
        out["crashes"].append({"step": at, "deviation": statistics.fmean(got) / statistics.fmean(losses[at:]) - 1.0,
                               "behind": _behind(first, at // w.every, w.every)})
    out["seconds"] = time.perf_counter() - t0
    return out


def sweep(through: Sequence[str], names: Optional[Sequence[str]], config: Config, dirpath: Optional[str],
          crashes: Sequence[float], steps: Optional[int] = None) -> List[Dict[str, Any]]:
    rows = []
    for t in through:
        for name in names or list(WORKLOADS):
            root = tempfile.mkdtemp(prefix=f"layerckpt-policy-{t}-{name}-", dir=dirpath)
            try:
                rows.append(run(WORKLOADS[name], t, config, root, crashes, steps=steps))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return rows


def quiet_frameworks() -> Dict[str, int]:
    """The frameworks' per-run banners and warnings about this bench's own choices (a CPU run, no logger, a
    placeholder dataset) off: the table is the output.  Returns the levels their loggers had (once imported)."""
    import importlib
    import logging
    import warnings

    for module in ("lightning.pytorch", "transformers", "accelerate"):  # each sets its loggers' levels at import
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    names = ("lightning.pytorch", "lightning.fabric", "lightning", "transformers", "accelerate")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning\..*")
    warnings.filterwarnings("ignore", module=r"transformers\..*")
    warnings.filterwarnings("ignore", module=r"accelerate\..*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return levels


def summary(rows: List[Dict[str, Any]]) -> List[Tuple[str, int, float, float]]:
    """Per adapter: (name, rows, worst |deviation| over every restore, the smallest raw bytes ratio)."""
    out = []
    for t in dict.fromkeys(r["through"] for r in rows):
        mine = [r for r in rows if r["through"] == t]
        worst = max((abs(c["deviation"]) for r in mine for c in r["crashes"] if c.get("deviation") is not None),
                    default=float("nan"))
        out.append((t, len(mine), worst, min(r["ratio"] for r in mine)))
    return out
