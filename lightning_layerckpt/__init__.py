"""layerckpt for PyTorch Lightning (``lightning.pytorch`` 2.6; not the separate ``pytorch_lightning`` package).

Add one callback and the Trainer checkpoints layer-selectively, off the critical path::

    from lightning_layerckpt import LayerCheckpoint
    trainer = Trainer(callbacks=[LayerCheckpoint(every_n_train_steps=50)])
    trainer.fit(model, ckpt_path="last")     # resumes from the newest committed composite, if any

:class:`LayerCheckpoint` takes ``ModelCheckpoint``'s place (it subclasses it, because
``fit(ckpt_path="last")`` only asks ``ModelCheckpoint`` instances where the last checkpoint is)
and keeps its triggers (``every_n_train_steps``, ``train_time_interval``, ``every_n_epochs``,
``save_on_exception``), but each save goes to one layerckpt store in ``dirpath``, from every rank
at once: each rank writes its share of the persisted layers, and rank 0 commits once all are
durable.  It also installs :class:`LayerCheckpointIO` as the strategy's ``CheckpointIO`` so that
``trainer.save_checkpoint(path)`` and ``fit(ckpt_path=<store dir or a manifest>)`` go through
layerckpt while ordinary ``.ckpt`` files still load.

Modules: ``callback`` (:class:`LayerCheckpoint`), ``checkpoint_io`` (:class:`LayerCheckpointIO`),
``export`` (:func:`export_ckpt`: a standard ``.ckpt`` for ``Model.load_from_checkpoint``) and ``_state``
(Lightning's checkpoint dict to and from layerckpt's model, optimizer and ``extra``).
"""
from .callback import LayerCheckpoint
from .checkpoint_io import LayerCheckpointIO
from .export import export_ckpt, load_from_checkpoint
from .fabric import LayerFabricCheckpoint
from ._state import LOADED_KEY  # noqa: F401 - the key of layerckpt's report in a loaded checkpoint dict

__all__ = ["LayerCheckpoint", "LayerCheckpointIO", "export_ckpt", "load_from_checkpoint", "LayerFabricCheckpoint"]
