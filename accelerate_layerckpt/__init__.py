"""HF Accelerate adapter: ``accelerator.save_state``/``load_state`` persist models and optimizers with layerckpt.

    from accelerate_layerckpt import LayerCheckpointPlugin
    plugin = LayerCheckpointPlugin()          # or LayerCheckpointPlugin(layerckpt.Config(...)), .from_yaml(path)
    plugin.register(accelerator)              # after this, save_state/load_state go through layerckpt
    ...
    accelerator.save_state()                  # returns once staged; the flush runs in the background
    plugin.wait()                             # durable (a flush in flight also completes at normal exit)

Route (accelerate 1.15), read from its sources:

* models: a ``register_save_state_pre_hook`` clears ``weights`` (no ``model.safetensors``) and
  saves each prepared model with layerckpt; a ``register_load_state_pre_hook`` clears ``models``
  and restores them.  Both are accelerate's public hooks.
* optimizers: accelerate has no hook.  ``save_state`` writes ``optimizer.bin`` for every entry of
  ``accelerator._optimizers`` and ``load_state`` fails without that file, so ``register`` wraps the
  accelerator's own bound ``save_state``/``load_state`` (on that instance only) to set the list
  aside (``[]``) for the call and put it back in ``finally``.  The hooks save/restore each
  optimizer with the model that owns its parameters.  This one private attribute is the whole
  private surface.
* the loss layerckpt's selection is scaled by: ``register`` also wraps the accelerator's public
  ``backward`` (the loss) and ``clip_grad_norm_`` (the norm before clipping), on that instance only.
* everything else (schedulers, RNG states, samplers/dataloaders, ``register_for_checkpointing``
  objects, ``accelerator.step``, the GradScaler) is still written and read by accelerate.

Where the data goes: a store beside the folders, never inside them, since ``total_limit``
rotation deletes whole folders: ``<project_dir>/layerckpt`` with automatic naming, else
``<parent>/.layerckpt`` for ``save_state(<parent>/<name>)``.  Each folder gets ``layerckpt.json``,
naming the store (relative path), the composite's step and a token the composite's manifest also
holds, so ``load_state(folder)`` restores exactly that composite.  A composite lives while some
folder beside it points at it (and the newest always).  See docs/accelerate.md.
"""
from .plugin import ENV_CONFIG, ENV_ENABLED, LayerCheckpointPlugin

__all__ = ["LayerCheckpointPlugin", "ENV_CONFIG", "ENV_ENABLED"]
