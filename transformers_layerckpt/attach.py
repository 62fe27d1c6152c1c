"""``attach(trainer)``: route a Trainer's checkpoint model and optimizer through layerckpt.

Every Trainer method this adapter replaces is replaced here, on the one instance it is given (a subclass's
overrides are what get wrapped), and nowhere else.  Public, overridable methods: ``train`` (resolve
``resume_from_checkpoint=True`` to the newest folder whose composite committed; wait for the saves when it
returns), ``training_step`` (the loss), ``save_model`` (a checkpoint folder's weights go to the store); and the
public ``clip_grad_norm_`` of the Trainer's Accelerator (the gradient norms Trainer clips).  Trainer
has no hook for the rest, so four private methods are wrapped, each falling through to Trainer's own for a
folder without a layerckpt pointer (transformers 4.50 to 5.x, the range the ``transformers`` extra pins):

* ``_save_optimizer_and_scheduler``: for a folder whose optimizer went to the store, writes the scheduler only;
* ``_load_from_checkpoint``: checks the folder's composite is committed (the model is restored with the
  optimizer, once Trainer has created it);
* ``_load_optimizer_and_scheduler``: restores model and optimizer from the composite, the scheduler from
  Trainer's file;
* ``_load_best_model``: ``load_best_model_at_end`` restores the best folder's model.

A wrapper replaces the method with one of a fixed signature, so before anything is replaced :func:`_check_methods`
compares Trainer's own signatures of these four (and ``save_model``'s) with the ones this module knows, and a
subclass's override with the calls the wrapper makes: a Trainer whose methods changed shape is refused at
``attach()``, not failed deep in a run.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Union

from transformers import Trainer, TrainerCallback

from layerckpt import Config, LayerSpec
from layerckpt.adapters import as_config, config_overrides, default_of, with_config_fields, with_preemption
from layerckpt.errors import CheckpointError, ConfigError
from layerckpt.preempt import signal_names

from .session import Attached

log = logging.getLogger("layerckpt.transformers")

ENV_SWITCH = "TRANSFORMERS_LAYERCKPT"
ENV_ENABLED = "LAYERCKPT_ENABLED"
ENV_CONFIG = "LAYERCKPT_CONFIG"
SUPPORTED = "transformers>=4.50,<6"  # the ``transformers`` extra's range
# The Trainer methods whose wrappers have a fixed signature: the signature Trainer gives each (without annotations:
# they differ between 4.x and 5.x), the same from 4.50 to 5.x, and the call the wrapper makes to the method it
# replaces (a subclass's override must take it).
KNOWN: Dict[str, Tuple[str, Tuple[Any, ...], Dict[str, Any]]] = {
    "save_model": ("(self, output_dir=None, _internal_call=False)", ("checkpoint-1",), {"_internal_call": True}),
    "_save_optimizer_and_scheduler": ("(self, output_dir)", ("checkpoint-1",), {}),
    "_load_from_checkpoint": ("(self, resume_from_checkpoint, model=None)", ("checkpoint-1", None), {}),
    "_load_optimizer_and_scheduler": ("(self, checkpoint)", ("checkpoint-1",), {}),
    "_load_best_model": ("(self)", (), {}),
}
_attached: "weakref.WeakKeyDictionary[Any, Attached]" = weakref.WeakKeyDictionary()


def enabled_by_env() -> bool:
    """Both ``TRANSFORMERS_LAYERCKPT`` and ``LAYERCKPT_ENABLED``: unset or 1/true/yes/on leaves layerckpt on,
    0/false/no/off turns it off."""
    for name in (ENV_SWITCH, ENV_ENABLED):
        value = os.environ.get(name, "")
        v = value.strip().lower()
        if v in ("0", "false", "no", "off"):
            return False
        if v not in ("", "1", "true", "yes", "on"):
            raise ConfigError(f"{name}={value!r} is neither on nor off; set it to 1 or 0")
    return True


@with_config_fields
def attach(trainer: Any, config: Union[Config, str, "os.PathLike[str]", Dict[str, Any], None] = None, *,
           layers: LayerSpec = None, **config_fields: Any) -> Attached:
    """From now on ``trainer``'s checkpoints put the model and optimizer through a layerckpt store
    (``<output_dir>/layerckpt``); everything else stays as Trainer writes it, in ``checkpoint-<step>`` folders
    that ``save_total_limit``, ``load_best_model_at_end`` and ``resume_from_checkpoint`` handle as Trainer does.

    ``config``: a :class:`layerckpt.Config`, a dict of its fields or a YAML path (default: the YAML file
    ``$LAYERCKPT_CONFIG`` names, else the defaults); Config fields as keyword arguments override it.
    ``layers`` groups parameters into layers as in :class:`layerckpt.Checkpointer`.  ``TRANSFORMERS_LAYERCKPT=0``
    or ``LAYERCKPT_ENABLED=0`` leaves the Trainer as it is (the returned handle says ``enabled=False``).

    A notice of preemption (``Config.preemption``: SIGTERM unless set otherwise, ``False`` for none) is acted on
    at the end of an optimizer step that every rank agrees on: Trainer saves that step as any checkpoint folder,
    where it can be durable before the deadline (``Config.grace_s``), and stops; ``resume_from_checkpoint=True``
    then resumes at that step.  The handle's ``preempted`` says so, for ``sys.exit(layerckpt.EXIT_PREEMPTED)``.
    Returns the handle: ``wait()``, ``last_save``, ``last_restore``, ``store``, ``preempted``."""
    cfg = as_config(config, env=ENV_CONFIG)
    overrides = config_overrides(config_fields, "attach")
    cfg = with_preemption(cfg.replace(**overrides) if overrides else cfg)
    _check_keep_last(cfg)
    _check_trainer(trainer)
    if not enabled_by_env():
        log.warning("layerckpt: %s=%s / %s=%s: the Trainer saves and loads checkpoints its own way",
                    ENV_SWITCH, os.environ.get(ENV_SWITCH), ENV_ENABLED, os.environ.get(ENV_ENABLED))
        return Attached(trainer, cfg, layers, enabled=False)
    if trainer in _attached:
        raise CheckpointError("attach(): this Trainer is already attached to layerckpt; attach it once")
    _check_methods(trainer)
    if getattr(trainer.args, "enable_jit_checkpoint", False) and "SIGTERM" in (signal_names(cfg.preemption) or ()):
        log.warning("layerckpt: SIGTERM is a notice of preemption (Config.preemption), whose handler stands in for "
                    "the one of enable_jit_checkpoint from train() on; set one of the two off")
    if getattr(trainer.args, "push_to_hub", False):
        log.warning("layerckpt: push_to_hub pushes checkpoint folders without weights while attached (they are in "
                    "the store); the final trainer.save_model() and push_to_hub() are Trainer's own")
    att = Attached(trainer, cfg, layers)
    _attached[trainer] = att
    _route(trainer, att)
    return att


def _check_keep_last(config: Config) -> None:
    """``save_total_limit`` decides which folders stay, and a composite stays while a folder points at it."""
    if config.keep_last != default_of("keep_last"):
        raise ConfigError(
            f"Config.keep_last={config.keep_last} does not apply with attach(): Trainer's save_total_limit decides "
            f"which checkpoint folders stay, and each composite stays while a folder points at it; drop keep_last "
            f"and set TrainingArguments(save_total_limit=N) instead")


def _check_trainer(trainer: Any) -> None:
    if not isinstance(trainer, Trainer):
        raise CheckpointError(f"attach() needs a transformers.Trainer (or a subclass), got {type(trainer).__name__}")
    for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            hint = (" For FSDP2 (fully_shard) models outside Trainer, layerckpt.Checkpointer(dir, model, optimizer) "
                    "on every rank saves and restores each rank's shards" if what == "FSDP" else "")
            raise CheckpointError(
                f"attach(): this Trainer runs {what}, whose engine saves its own sharded state; layerckpt handles "
                f"single-process and DDP Trainers: do not attach it for this run.{hint}")


def _shape(fn: Callable[..., Any]) -> str:
    """``fn``'s signature without annotations, as ``(self, a, b=None)``."""
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def _check_methods(trainer: Any) -> None:
    """Refuse a Trainer whose wrapped methods are not the ones this module's wrappers replace: a missing one, one
    of transformers' own whose signature is not the one known (another transformers version), or a subclass's
    override that does not take the wrapper's call."""
    import transformers

    version = transformers.__version__
    fix = (f"install a transformers layerckpt supports: pip install '{SUPPORTED}' (or 'layerckpt[transformers]'), "
           f"or leave this Trainer unattached (TRANSFORMERS_LAYERCKPT=0)")
    for name, (known, args, kwargs) in KNOWN.items():
        own = getattr(Trainer, name, None)
        if not callable(own) or not callable(getattr(trainer, name, None)):
            raise CheckpointError(f"attach(): transformers {version} has no Trainer.{name}, which layerckpt replaces "
                                  f"while attached; {fix}")
        if _shape(own) != known:
            raise CheckpointError(
                f"attach(): transformers {version} has Trainer.{name}{_shape(own)}, not the {name}{known} of "
                f"transformers 4.50 to 5.x that layerckpt replaces while attached; {fix}")
        method = getattr(trainer, name)
        if getattr(method, "__func__", method) is own:
            continue
        try:  # a subclass's override (or a function set on the instance): the wrapper hands it this call
            inspect.signature(method).bind(*args, **kwargs)
        except TypeError as e:
            shown = _shape(getattr(method, "__func__", method))
            raise CheckpointError(
                f"attach(): {type(trainer).__name__}.{name}{shown} overrides Trainer.{name}{known} but does not "
                f"take the call layerckpt's replacement passes on to it ({e}); give the override Trainer's "
                f"parameters") from None


def _route(trainer: Any, att: Attached) -> None:
    """Replace the Trainer methods listed in this module's docstring, on this instance."""
    routes: Dict[str, Callable[..., Callable[..., Any]]] = {
        "train": _train, "training_step": _training_step, "save_model": _save_model,
        "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
        "_load_from_checkpoint": _load_from_checkpoint,
        "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
        "_load_best_model": _load_best_model,
    }
    for name, make in routes.items():
        orig = getattr(trainer, name)
        setattr(trainer, name, functools.wraps(orig)(make(orig, att)))
    trainer.add_callback(_StepEnd(att))


def _train(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def train(resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # Trainer would take the highest step, committed or not
            resume_from_checkpoint = att.newest_loadable() or True
        ok = False
        try:
            out = orig(resume_from_checkpoint, *args, **kwargs)
            ok = True
            return out
        finally:  # saves committed before train() returns or raises, as Trainer's own are
            att.finish(quiet=not ok)
    return train


def _training_step(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def training_step(*args: Any, **kwargs: Any) -> Any:
        _watch_clipping(att)
        loss = orig(*args, **kwargs)
        att.micro_batch(loss)
        return loss
    return training_step


def _watch_clipping(att: Attached) -> None:
    """Have the Trainer's Accelerator tell ``att`` each gradient clipping (``max_grad_norm``): its public
    ``clip_grad_norm_(parameters, max_norm, norm_type=2)``, through which Trainer clips (4.50 to 5.x), is
    replaced on that one instance by a call of it that also hands ``att`` the norm it returns, before
    clipping.  Checked at each micro-batch: Trainer may make a new Accelerator (a hyperparameter search)."""
    acc = getattr(att.trainer, "accelerator", None)
    clip = getattr(acc, "clip_grad_norm_", None)
    if clip is None or getattr(clip, "_layerckpt", None) is att:
        return

    @functools.wraps(clip)
    def clip_grad_norm_(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
        norm = clip(parameters, max_norm, *args, **kwargs)
        att.clipped(norm, max_norm)
        return norm

    clip_grad_norm_._layerckpt = att  # type: ignore[attr-defined]
    acc.clip_grad_norm_ = clip_grad_norm_


def _save_model(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def save_model(output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if _internal_call and att.is_checkpoint(output_dir):
            att.save(output_dir)
            return None
        return orig(output_dir, _internal_call=_internal_call)
    return save_model


def _save_optimizer_and_scheduler(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def save_optimizer_and_scheduler(output_dir: str) -> None:
        if att.saves_optimizer_of(output_dir):
            att.save_scheduler(output_dir)
            return None
        return orig(output_dir)
    return save_optimizer_and_scheduler


def _load_from_checkpoint(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def load_from_checkpoint(resume_from_checkpoint: str, model: Any = None) -> None:
        if att.check_loadable(resume_from_checkpoint):
            return None  # the model is restored with the optimizer: _load_optimizer_and_scheduler
        return orig(resume_from_checkpoint, model)
    return load_from_checkpoint


def _load_optimizer_and_scheduler(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def load_optimizer_and_scheduler(checkpoint: Optional[str]) -> None:
        if checkpoint is not None and att.restore(checkpoint, with_optimizer=True):
            att.load_scheduler(checkpoint)
            return None
        return orig(checkpoint)
    return load_optimizer_and_scheduler


def _load_best_model(orig: Callable[..., Any], att: Attached) -> Callable[..., Any]:
    def load_best_model() -> None:
        best = att.trainer.state.best_model_checkpoint
        if best is not None and att.restore(best, with_optimizer=False):
            return None
        return orig()
    return load_best_model


class _StepEnd(TrainerCallback):
    """Trainer's public callback: the end of an optimizer step adds its loss and gradient clipping to those the
    next save is scaled by, and is the step boundary at which the ranks agree on a notice of preemption (added
    last, it sets ``control`` after Trainer's own flow callback)."""

    def __init__(self, att: Attached):
        self.att = att

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.att.begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.att.step_done()
        self.att.step_boundary(control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.att.saved()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.att.epoch_end(control)
