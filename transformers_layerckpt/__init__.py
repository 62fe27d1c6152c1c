"""transformers Trainer adapter: a Trainer's checkpoints put the model and optimizer through layerckpt.

    from transformers_layerckpt import attach
    trainer = Trainer(model=model, args=args, train_dataset=ds)   # any Trainer, or a subclass
    attach(trainer)                   # or attach(trainer, layerckpt.Config(...)), attach(trainer, full=True)
    trainer.train()                   # checkpoint-<step> folders as usual; resume_from_checkpoint as usual

Each ``checkpoint-<step>`` folder keeps what Trainer writes there (``trainer_state.json``, ``scheduler.pt``,
``rng_state.pth``, ``training_args.bin``, the model's ``config.json``) and a ``layerckpt.json`` pointer to the
composite holding the model's weights and the optimizer's state, in the store ``<output_dir>/layerckpt``
beside the folders (``save_total_limit`` deletes whole folders; a composite stays while a folder points at
it).  The selection's loss is Trainer's mean training loss since the last save, put in the unit of the
clipped gradients where Trainer clips (``max_grad_norm``), the step ``state.global_step``.
``TRANSFORMERS_LAYERCKPT=0`` or ``LAYERCKPT_ENABLED=0`` leaves the Trainer as it is.  Which Trainer methods
are wrapped, and why: :mod:`transformers_layerckpt.attach`.
"""
from .attach import ENV_CONFIG, ENV_ENABLED, ENV_SWITCH, attach, enabled_by_env
from .session import Attached

__all__ = ["attach", "Attached", "enabled_by_env", "ENV_SWITCH", "ENV_ENABLED", "ENV_CONFIG"]
