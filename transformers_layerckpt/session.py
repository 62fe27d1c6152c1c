"""What one attached Trainer does with layerckpt: save a checkpoint folder's model and optimizer, restore them.

:class:`Attached` knows nothing of which Trainer methods call it (``attach`` routes them, in one place); it
reads only Trainer's public attributes (``model``, ``optimizer``, ``lr_scheduler``, ``args``, ``state``,
``accelerator``).
"""
from __future__ import annotations

import json
import logging
import os
import uuid
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from layerckpt import Checkpointer, Config, LayerSpec, PendingSave, RestoreReport, restore
from layerckpt.adapters import SelectionLoss, close_quietly, hold
from layerckpt.errors import CheckpointError
from layerckpt.interop import peft_extra
from layerckpt.preempt import signal_names

from . import folders

log = logging.getLogger("layerckpt.transformers")

SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
TRAINING_ARGS_NAME = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME


class Attached:
    """The layerckpt side of one Trainer: its store's Checkpointer, the loss of the last step, the last save
    and restore.  ``attach()`` returns it; ``enabled`` is False when the environment turned layerckpt off.
    ``preempted``: the last ``train()`` stopped on a notice of preemption (``Config.preemption``), its step
    saved where it could be durable in time; a script may then ``sys.exit(layerckpt.EXIT_PREEMPTED)``."""

    def __init__(self, trainer: Any, config: Config, layers: LayerSpec = None, enabled: bool = True):
        self.trainer = trainer
        self.config = config
        self.layers = layers
        self.enabled = enabled
        self.last_save: Optional[PendingSave] = None
        self.last_restore: Optional[RestoreReport] = None
        #: the optimizer steps' losses and gradient clipping since the last save (see :meth:`selection_loss`)
        self._interval = SelectionLoss()
        self._ck: Optional[Checkpointer] = None
        self._key: Optional[Tuple[str, int, int]] = None  # (store, model, optimizer) of _ck
        self._run_id: Optional[str] = None
        self._folder: Optional[str] = None  # the checkpoint folder being saved
        self._pruner = folders.Pruner()
        self.preempted = False
        self._deadline: Optional[float] = None  # of the notice whose checkpoint Trainer is saving

    # ------------------------------------------------------------ public

    def wait(self) -> None:
        """Block until every checkpoint so far is durable and committed; re-raises a flush error."""
        if self._ck is not None:
            self._ck.wait()

    def close(self) -> None:
        """Wait for the saves in flight, then free the Checkpointer (the next save opens it again)."""
        ck, self._ck, self._key = self._ck, None, None
        if ck is not None:
            ck.close()

    @property
    def store(self) -> str:
        """Where this Trainer's checkpoints put their models and optimizers: ``<output_dir>/layerckpt``."""
        return os.path.join(os.path.abspath(self.trainer.args.output_dir), folders.STORE)

    def __repr__(self) -> str:
        return f"Attached({'enabled' if self.enabled else 'disabled'}, store={self.store!r})"

    # ------------------------------------------------------------ loss

    @property
    def loss(self) -> Optional[torch.Tensor]:
        """The loss the last save's selection was scaled by (see :meth:`selection_loss`)."""
        return self._interval.loss

    def micro_batch(self, loss: Any) -> None:
        """A micro-batch's loss as ``training_step`` returns it (already divided for gradient accumulation)."""
        if isinstance(loss, torch.Tensor):
            self._interval.add(loss)

    def clipped(self, norm: Any, max_norm: Any) -> None:
        """Trainer clipped this step's gradients (``accelerator.clip_grad_norm_``): ``norm`` before clipping,
        to at most ``max_norm`` (``inf``: measured only); the optimizer got them scaled by ``min(1, max_norm /
        norm)``."""
        self._interval.clipped(norm, max_norm)

    def step_done(self) -> None:
        """An optimizer step ended: its loss and its gradient norms join those of the interval the next save's
        selection is scaled by."""
        self._interval.step_done()

    def selection_loss(self) -> Optional[torch.Tensor]:
        """The loss a save's selection is scaled by (its allowance is ``Config.fidelity`` times it): the mean
        training loss of the optimizer steps since the last save, times the share of their squared gradient
        norms Trainer's clipping (``max_grad_norm``) kept (:class:`layerckpt.adapters.SelectionLoss`).  Without
        a step since the last save: the last save's."""
        return self._interval.take()

    # ------------------------------------------------------------ preemption

    def begin(self) -> None:
        """Training starts (every rank): with ``Config.preemption`` on, the Checkpointer opens now rather than at
        the first save, so that its signal handlers and the ranks' agreement on a notice are there from the
        first step (a notice before the first checkpoint is saved too)."""
        self.preempted, self._deadline = False, None
        if signal_names(self.config.preemption) is not None:
            self._checkpointer(self.store)

    def step_boundary(self, control: Any) -> None:
        """An optimizer step ended, on every rank (``on_step_end``): where every rank agreed on a notice at this
        step, Trainer saves it as any checkpoint (``should_save``: folder, trainer state, RNG) where it can be
        durable before the deadline, and stops (``should_training_stop``); without the time for it, no save
        starts (the log says why) and a restart resumes from the newest committed checkpoint."""
        ck = self._ck
        if ck is None:
            return
        step = self.trainer.state.global_step
        deadline = ck.notice(step)
        if deadline is None:
            return
        self.preempted = True
        control.should_training_stop = True
        control.should_evaluate = False  # the time left goes to the save
        control.should_save = ck.can_save_by(deadline, step)
        if control.should_save:
            self._deadline = deadline  # waited for once Trainer saved it: on_save
        else:
            ck.durable_by(deadline)  # the saves in flight

    def saved(self) -> None:
        """Trainer saved a checkpoint (``on_save``): the one of a notice is waited for, with the tiers' copies,
        until the deadline."""
        deadline, self._deadline = self._deadline, None
        if deadline is not None and self._ck is not None:
            self._ck.durable_by(deadline)

    def epoch_end(self, control: Any) -> None:
        """The epoch ends (``on_epoch_end``): after a notice, no second save of the step, no evaluation."""
        if self.preempted:
            control.should_save = False
            control.should_evaluate = False

    # ------------------------------------------------------------ save

    def is_checkpoint(self, output_dir: Optional[str]) -> bool:
        """Whether ``save_model(output_dir, _internal_call=True)`` is the model save of a checkpoint folder:
        ``<output_dir>/checkpoint-<global_step>`` (not the final model, not a hyperparameter-search copy)."""
        if output_dir is None or getattr(self.trainer, "hp_search_backend", None) is not None:
            return False
        folder = os.path.abspath(os.fspath(output_dir))
        return (folders.folder_step(folder) == self.trainer.state.global_step
                and os.path.dirname(folder) == os.path.abspath(self.trainer.args.output_dir))

    def save(self, output_dir: str) -> None:
        """Stage the model and optimizer of the checkpoint folder ``output_dir`` into the store, write the
        folder's pointer and the model files that are not weights (config, training arguments)."""
        folder = os.path.abspath(os.fspath(output_dir))
        step = self.trainer.state.global_step
        root = folders.store_of(folder)
        ck = self._checkpointer(root)
        if self.trainer.is_world_process_zero():  # rotation has removed folders since the last save
            self._pruner.submit(root, os.path.dirname(folder))
        token = f"{self._run_id}-{step}"
        adapters = peft_extra(self._model())  # a PeftModel's adapter configs, for `layerckpt export --peft`
        extra = {folders.EXTRA_KEY: {"token": token, "folder": os.path.basename(folder)}, **adapters}
        self.last_save = ck.save(step, extra=extra, loss=self.selection_loss())
        self._folder = folder
        os.makedirs(folder, exist_ok=True)
        if self.trainer.args.should_save:
            folders.write_pointer(folder, root, step, token, self._optimizer() is not None)
            self._save_model_files(folder, adapters)

    def saves_optimizer_of(self, output_dir: str) -> bool:
        """Whether the optimizer of the checkpoint folder ``output_dir`` went into the store (save())."""
        return self._folder is not None and os.path.abspath(os.fspath(output_dir)) == self._folder

    def save_scheduler(self, output_dir: str) -> None:
        """Trainer's scheduler file, as Trainer writes it (the optimizer's state is in the store)."""
        if self.trainer.args.should_save and self.trainer.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's warning about saving a scheduler's optimizer
                torch.save(self.trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_model_files(self, folder: str, adapters: Dict[str, Any]) -> None:
        """What Trainer's model save writes besides the weights: the model's config (and generation config), a
        PeftModel's ``adapter_config.json`` (``adapters``: the save's PEFT record), the processing class's files
        and the training arguments."""
        model = self._model()
        for name, adapter in (a for rec in adapters.values() for a in rec["adapters"].items()):
            where = folder if name == "default" else os.path.join(folder, name)  # as PeftModel.save_pretrained
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, "adapter_config.json"), "w", encoding="utf-8") as f:
                json.dump(adapter["config"], f, indent=2, sort_keys=True)
        for what in (getattr(model, "config", None), getattr(model, "generation_config", None)):
            if what is not None and hasattr(what, "save_pretrained"):
                what.save_pretrained(folder)
        processing = getattr(self.trainer, "processing_class", None) or getattr(
            getattr(self.trainer, "data_collator", None), "tokenizer", None)
        if processing is not None and hasattr(processing, "save_pretrained"):
            processing.save_pretrained(folder)
        torch.save(self.trainer.args, os.path.join(folder, TRAINING_ARGS_NAME))

    def finish(self, quiet: bool) -> None:
        """Training returned (``quiet``: with an exception): every save committed, unneeded composites pruned,
        the Checkpointer closed.  ``quiet`` logs a flush error instead of raising it over the exception."""
        self._pruner.drain()
        ck = self._ck
        if ck is None:
            return
        root = ck.dirpath
        try:
            self.close()
        except CheckpointError as e:
            if not quiet:
                raise
            log.error("layerckpt: a checkpoint was not committed: %s", e)
        if self.trainer.is_world_process_zero():
            folders.prune(root, os.path.abspath(self.trainer.args.output_dir))

    # ------------------------------------------------------------ restore

    def restore(self, folder: str, with_optimizer: bool) -> bool:
        """Load the model (and the optimizer, ``with_optimizer``) of the checkpoint folder ``folder`` from its
        composite; False when the folder has no pointer (plain Trainer's, loaded by Trainer).  Trainer keeps
        restoring the RNG from its own files.  A resume continues the composite: the next save is selective."""
        ptr = folders.read_pointer(folder)
        if ptr is None:
            return False
        self.wait()  # read your writes
        folders.check_committed(ptr)
        opt = self._optimizer() if with_optimizer and ptr.optimizer else None
        cfg = self.config.replace(restore_rng=False)
        if with_optimizer and os.path.normpath(ptr.store) == os.path.normpath(self.store):
            self.close()  # the next save goes to this store: open it afresh and continue from the restored one
            self.last_restore = restore(ptr.store, self._model(), opt, step=ptr.step, config=cfg)
            self._checkpointer(ptr.store).adopt(self.last_restore)
        else:
            self.last_restore = restore(ptr.store, self._model(), opt, step=ptr.step, config=cfg)
        return True

    def load_scheduler(self, folder: str) -> None:
        path = os.path.join(folder, SCHEDULER_NAME)
        if self.trainer.lr_scheduler is not None and os.path.isfile(path):
            self.trainer.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def check_loadable(self, folder: str) -> bool:
        """Whether ``folder`` has a pointer (then its composite must be committed: a clear error if not)."""
        ptr = folders.read_pointer(folder)
        if ptr is None:
            return False
        self.wait()
        folders.check_committed(ptr)
        return True

    def newest_loadable(self) -> Optional[str]:
        """The folder ``resume_from_checkpoint=True`` loads: the newest whose composite committed."""
        self.wait()
        return folders.newest_loadable(os.path.abspath(self.trainer.args.output_dir))

    # ------------------------------------------------------------ model, optimizer, Checkpointer

    def _model(self) -> torch.nn.Module:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer whose state goes with the model (unwrapped); None under ``save_only_model``."""
        opt = self.trainer.optimizer
        if opt is None or self.trainer.args.save_only_model:
            return None
        return getattr(opt, "optimizer", opt)

    def _checkpointer(self, root: str) -> Checkpointer:
        """The Checkpointer of the store ``root`` for the current model and optimizer; opened (on every rank:
        checkpoint saves and loads run on all) when there is none or they changed."""
        model, opt = self._model(), self._optimizer()
        key = (os.path.normpath(root), id(model), id(opt))
        if self._ck is not None and self._key == key:
            return self._ck
        self.close()
        if self._run_id is None:
            self._run_id = self._shared_id()
        hold(root, self._taken_over)  # an older attach of this process on root closes its Checkpointer first
        self._ck = Checkpointer(root, model, opt, config=self.config.replace(keep_last=0), layers=self.layers)
        self._key = key
        return self._ck

    def _shared_id(self) -> str:
        """One id for this run's tokens, the same on every rank."""
        start = [uuid.uuid4().hex[:12]]
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(start, from_process=0)
        return start[0]

    def _taken_over(self, root: str) -> None:
        """A newer attach of this process opens the store ``root``: close ours (its saves end first)."""
        if self._ck is not None and self._key is not None and self._key[0] == os.path.normpath(root):
            cks = [self._ck]
            self._ck, self._key = None, None
            close_quietly(cks, what="a Trainer checkpoint")
