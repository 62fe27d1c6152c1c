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
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Optional, Union

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

import layerckpt
from layerckpt import _store as store
from layerckpt.config import Config
from layerckpt.errors import CheckpointError, ConfigError

log = logging.getLogger("layerckpt")

__all__ = ["LayerCheckpoint", "LayerCheckpointIO"]

#: Layerckpt's part of a loaded checkpoint dict: the RNG states, the report.
LOADED_KEY = "layerckpt"
_EXTRA_KEY = "lightning"  # the Lightning checkpoint dict, minus the model and optimizer 0, inside `extra`


# ---------------------------------------------------------------------------------------- dict <-> store

def _plain(value: Any, where: str, warned: List[str]) -> Any:
    """A copy of ``value`` that layerckpt's JSON codec takes: tensors and plain values stay, a few common
    types become plain values, anything else (which only pickle could keep) becomes its repr, with a warning."""
    import argparse
    import enum
    import pathlib

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    try:
        import numpy as np
        if isinstance(value, (np.ndarray, np.generic)):
            return value
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]", warned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_plain(v, f"{where}[{i}]", warned) for i, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, argparse.Namespace):
        return _plain(vars(value), where, warned)
    if isinstance(value, enum.Enum):
        return _plain(value.value, where, warned)
    if isinstance(value, (pathlib.PurePath, torch.device, torch.dtype)):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    try:  # omegaconf containers, if the user has them
        from omegaconf import Container, OmegaConf
        if isinstance(value, Container):
            return _plain(OmegaConf.to_container(value, resolve=True), where, warned)
    except ImportError:
        pass
    warned.append(f"{where} ({type(value).__qualname__})")
    return repr(value)


def _split(checkpoint: Dict[str, Any], has_optimizer: bool) -> Dict[str, Any]:
    """The part of a Lightning checkpoint dict that travels in layerckpt's ``extra``."""
    rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    if has_optimizer:
        rest["optimizer_states"] = [None] + list(rest.get("optimizer_states", [])[1:])
    warned: List[str] = []
    rest = _plain(rest, "checkpoint", warned)
    if warned:
        warnings.warn("layerckpt stores no pickles: these checkpoint entries were saved as their repr and will "
                      "come back as strings: " + ", ".join(warned[:8]) + (" ..." if len(warned) > 8 else ""),
                      stacklevel=3)
    return {_EXTRA_KEY: rest}


def _to_lightning(loaded: "layerckpt.LoadedCheckpoint") -> Dict[str, Any]:
    """Rebuild the dict Lightning's checkpoint connector expects from a read layerckpt checkpoint."""
    rest = loaded.extra.get(_EXTRA_KEY)
    if not isinstance(rest, dict):
        raise CheckpointError(
            f"{loaded.manifest} was not written by lightning_layerckpt (no Lightning state in it); "
            f"restore it with layerckpt.restore(dirpath, model, optimizer) instead")
    ckpt = dict(rest)
    ckpt["state_dict"] = {**loaded.model_other, **loaded.model}
    opt_states = list(ckpt.get("optimizer_states") or [])
    if opt_states and opt_states[0] is None:
        if loaded.optimizer is None:
            raise CheckpointError(f"{loaded.manifest} lacks the state of optimizer 0")
        opt_states[0] = loaded.optimizer
    if "optimizer_states" in ckpt:
        ckpt["optimizer_states"] = opt_states
    ckpt[LOADED_KEY] = {"step": loaded.step, "manifest": loaded.manifest, "layers": loaded.layers,
                        "staleness": loaded.staleness, "max_staleness": loaded.max_staleness,
                        "bytes_read": loaded.bytes_read, "seconds": loaded.seconds, "rng": loaded}
    return ckpt


class _StateModule(torch.nn.Module):
    """A module whose state_dict is a given dict: lets a Checkpointer save a plain state dict."""

    def __init__(self, state: Dict[str, Any]):
        super().__init__()
        self._state = state

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        return dict(self._state)


# ---------------------------------------------------------------------------------------- CheckpointIO

class LayerCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` whose checkpoints are layerckpt stores (directories).

    - ``save_checkpoint(checkpoint, path)`` writes a full checkpoint into the store ``path`` and
      returns once it is staged (``wait()``/``teardown()`` make it durable).  Lightning calls it on
      rank 0 only, so it involves no other rank.
    - ``load_checkpoint(path)`` takes a store (its newest composite), a store's
      ``manifests/step-N.json``, or anything the wrapped IO loads (an ordinary ``.ckpt``).
    - ``remove_checkpoint(path)`` removes a store (or defers to the wrapped IO).

    Used on its own (``Trainer(plugins=[LayerCheckpointIO()])``) with Lightning's ModelCheckpoint,
    each checkpoint is a full one in its own directory; :class:`LayerCheckpoint` installs it and adds
    the layer-selective store.
    """

    def __init__(self, config: Optional[Union[Config, str, os.PathLike]] = None,
                 fallback: Optional[CheckpointIO] = None):
        self.config = _as_config(config)
        self.fallback = fallback if fallback is not None else TorchCheckpointIO()
        self._saving: Optional[layerckpt.Checkpointer] = None
        self._callbacks: List["LayerCheckpoint"] = []

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"LayerCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        self._finish_standalone()
        path = os.fspath(path)
        if os.path.isfile(path):  # an earlier ordinary checkpoint of this name
            os.remove(path)
        elif os.path.isdir(path) and store.is_checkpoint(path):
            shutil.rmtree(path)
        model = _StateModule(checkpoint.get("state_dict", {}))
        ck = layerckpt.Checkpointer(path, model, None, self.config.replace(threshold=0.0, keep_last=1),
                                    distributed=False)
        try:
            ck.save(int(checkpoint.get("global_step", 0)), extra=_split(checkpoint, has_optimizer=False))
        except BaseException:
            ck.close()
            raise
        self._saving = ck

    def load_checkpoint(self, path: Union[str, os.PathLike], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if not store.is_checkpoint(path):
            if os.path.isdir(path):
                store.locate(path)  # raises the clear error: a directory, but not a checkpoint
            return self.fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        self.wait()  # a save of our own to the same place must be durable first
        loaded = layerckpt.read_checkpoint(path, config=self.config, strict=False)
        return _to_lightning(loaded)

    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        if os.path.isdir(path) and store.is_checkpoint(path):
            if self._saving is not None and os.path.abspath(self._saving.dirpath) == os.path.abspath(path):
                self._finish_standalone()
            shutil.rmtree(path)
        else:
            self.fallback.remove_checkpoint(path)

    def wait(self) -> None:
        """Every save of this IO and of its callbacks durable; raises the first failure."""
        for cb in list(self._callbacks):
            cb.wait()
        if self._saving is not None:
            self._saving.wait()

    def teardown(self) -> None:
        try:
            for cb in list(self._callbacks):
                cb._close(quiet=True)
        finally:
            self._finish_standalone()
            self.fallback.teardown()

    def _finish_standalone(self) -> None:
        ck, self._saving = self._saving, None
        if ck is not None:
            ck.close()


def _as_config(config: Optional[Union[Config, str, os.PathLike, Dict[str, Any]]]) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_yaml(config)
    raise ConfigError(f"config must be a layerckpt.Config, a dict or a YAML path, got {type(config).__name__}")


# ---------------------------------------------------------------------------------------- the callback

class LayerCheckpoint(ModelCheckpoint):
    """Layer-selective, asynchronous checkpoints for a Lightning Trainer.

    Args:
        dirpath: the layerckpt store; when omitted, resolved as ModelCheckpoint resolves it
            (``<logger save_dir>/<name>/<version>/checkpoints`` or ``<default_root_dir>/checkpoints``).
        every_n_train_steps, train_time_interval, every_n_epochs, save_on_exception,
        save_on_train_epoch_end: when to save, exactly as ModelCheckpoint.  A last save is made at
            the end of fit in any case.
        config: a layerckpt YAML file; the layerckpt fields below override it.
        enabled: ``False`` turns this into Lightning's ordinary ModelCheckpoint (full ``.ckpt``
            files, ``save_last=True`` so ``ckpt_path="last"`` still resumes).
        log_stats: log each checkpoint's bytes, layers persisted, stall, flush speed and staleness
            through the Trainer's loggers (``layerckpt/*``).
        threshold ... layers: layerckpt Config fields (see layerckpt.Config).
    """

    CHECKPOINT_NAME_LAST = "last"

    def __init__(
        self,
        dirpath: Optional[str] = None,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_exception: bool = False,
        save_on_train_epoch_end: Optional[bool] = None,
        config: Optional[str] = None,
        enabled: bool = True,
        log_stats: bool = True,
        threshold: Optional[float] = None,
        max_staleness: Optional[int] = None,
        base_every: Optional[int] = None,
        keep_last: Optional[int] = None,
        staging_bytes: Optional[Union[int, str]] = None,
        chunk_bytes: Optional[Union[int, str]] = None,
        queue_depth: Optional[int] = None,
        max_inflight: Optional[int] = None,
        backend: Optional[str] = None,
        direct_io: Optional[bool] = None,
        verify_checksums: Optional[bool] = None,
        restore_rng: Optional[bool] = None,
        budget_bytes: Optional[Union[int, str]] = None,
        drift_sample: Optional[int] = None,
        layers: Optional[Dict[str, str]] = None,
    ):
        fields = {k: v for k, v in dict(
            threshold=threshold, max_staleness=max_staleness, base_every=base_every, keep_last=keep_last,
            staging_bytes=staging_bytes, chunk_bytes=chunk_bytes, queue_depth=queue_depth,
            max_inflight=max_inflight, backend=backend, direct_io=direct_io, verify_checksums=verify_checksums,
            restore_rng=restore_rng, budget_bytes=budget_bytes, drift_sample=drift_sample, layers=layers,
        ).items() if v is not None}
        base = Config.from_yaml(config) if config is not None else Config()
        self.layer_config: Config = base.replace(**fields) if fields else base  # validates, names a bad field
        if isinstance(enabled, str) or not isinstance(enabled, bool):
            raise ConfigError(f"LayerCheckpoint(enabled=...) must be true or false, got {enabled!r}")
        self.enabled = enabled
        self.log_stats = log_stats
        super().__init__(
            dirpath=dirpath, every_n_train_steps=every_n_train_steps, train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs, save_on_exception=save_on_exception,
            save_on_train_epoch_end=save_on_train_epoch_end, save_last=None if enabled else True,
        )
        self._ckpt: Optional[layerckpt.Checkpointer] = None
        self._io: Optional[LayerCheckpointIO] = None
        self._unlogged: List[layerckpt.PendingSave] = []
        self._pending_rng: Optional[layerckpt.LoadedCheckpoint] = None
        self._loggers: List[Any] = []
        self.last_save: Optional[layerckpt.PendingSave] = None
        self.restored: Optional[Dict[str, Any]] = None  # what the last resume read: step, layers, staleness, ...
        self.saves: List[layerckpt.PendingSave] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath, every_n_train_steps=self._every_n_train_steps,
                                        every_n_epochs=self._every_n_epochs,
                                        train_time_interval=self._train_time_interval, layerckpt=self.enabled)

    # -- setup / resume -------------------------------------------------------------------------------------

    def setup(self, trainer: "Any", pl_module: "Any", stage: str) -> None:
        if not self.enabled:
            return super().setup(trainer, pl_module, stage)
        _refuse_sharded(trainer.strategy)
        self.restored, self._pending_rng = None, None  # set again if this fit resumes
        self.dirpath = trainer.strategy.broadcast(self._resolve_dir(trainer))
        self._install_io(trainer)

    def _install_io(self, trainer: Any) -> None:
        current = trainer.strategy.checkpoint_io
        if isinstance(current, LayerCheckpointIO):
            io = current
        else:
            io = LayerCheckpointIO(self.layer_config, fallback=current)
            trainer.strategy.checkpoint_io = io
        if self not in io._callbacks:
            io._callbacks.append(self)
        self._io = io

    def _resolve_dir(self, trainer: Any) -> str:
        if self.dirpath is not None:
            return os.fspath(self.dirpath)
        if trainer.loggers:
            lg = trainer.loggers[0]
            save_dir = lg.save_dir if lg.save_dir is not None else trainer.default_root_dir
            version = lg.version if isinstance(lg.version, str) else f"version_{lg.version}"
            return os.path.join(save_dir, str(lg.name), version, "checkpoints")
        return os.path.join(trainer.default_root_dir, "checkpoints")

    def _find_last_checkpoints(self, trainer: Any) -> set:
        """Where ``fit(ckpt_path="last")`` looks: the store, if it holds a committed checkpoint.  With no
        dirpath, a new process's logger has a new version, so earlier versions' stores are candidates too."""
        if not self.enabled:
            return super()._find_last_checkpoints(trainer)
        where = [self._resolve_dir(trainer)]
        if self.dirpath is None and trainer.loggers and trainer.loggers[0].save_dir is not None:
            lg = trainer.loggers[0]
            base = os.path.join(lg.save_dir, str(lg.name))
            if os.path.isdir(base):
                where += [os.path.join(base, v, "checkpoints") for v in sorted(os.listdir(base))]
        found = set()
        for d in where:
            try:
                store.resolve(d)
                found.add(os.path.normpath(d))
            except CheckpointError:
                pass
        return found

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        info = checkpoint.get(LOADED_KEY)
        if self.enabled and isinstance(info, dict):
            self.restored = {k: v for k, v in info.items() if k != "rng"}
            if self.layer_config.restore_rng:
                self._pending_rng = info.get("rng")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if self.enabled and self._ckpt is None:
            self._checkpointer(trainer)
            if self.restored is not None and os.path.dirname(os.path.dirname(self.restored["manifest"])) == \
                    self._ckpt.dirpath:
                self._ckpt.adopt(self.restored["manifest"])  # resumed from this store: stay selective
        loaded, self._pending_rng = self._pending_rng, None
        if loaded is not None:  # Lightning keeps no RNG state; put back each rank's own, as at the save
            loaded.restore_rng()

    def _checkpointer(self, trainer: Any) -> "layerckpt.Checkpointer":
        """This fit's Checkpointer (created on every rank at once: construction is collective)."""
        optimizers = trainer.optimizers
        if self._ckpt is None:
            self._ckpt = layerckpt.Checkpointer(self.dirpath, trainer.lightning_module,
                                                optimizers[0] if optimizers else None, self.layer_config)
        elif optimizers and self._ckpt.optimizer is not optimizers[0]:
            raise CheckpointError("the Trainer's optimizer changed since the first checkpoint of this fit; "
                                  "LayerCheckpoint follows one optimizer object per fit")
        return self._ckpt

    def state_dict(self) -> Dict[str, Any]:
        if not self.enabled:
            return super().state_dict()
        return {"dirpath": self.dirpath, "best_model_path": self.best_model_path,
                "last_model_path": self.last_model_path, "last_step": self._last_global_step_saved}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not self.enabled:
            return super().load_state_dict(state_dict)
        if state_dict.get("dirpath") == self.dirpath:
            self.best_model_path = state_dict.get("best_model_path", "")
            self.last_model_path = state_dict.get("last_model_path", "")

    # -- saving ------------------------------------------------------------------------------------------

    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: Dict[str, Any]) -> None:
        if not self.enabled:
            return super()._save_topk_checkpoint(trainer, monitor_candidates)
        self._save(trainer)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: Dict[str, Any]) -> None:
        if not self.enabled:
            return super()._save_last_checkpoint(trainer, monitor_candidates)
        if self._last_global_step_saved != trainer.global_step:
            self._save(trainer)

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if not self.enabled:
            return super()._save_checkpoint(trainer, filepath)
        self._save(trainer)

    def _save(self, trainer: Any) -> None:
        """One checkpoint of the current global step, on every rank."""
        t0 = time.perf_counter()
        step = int(trainer.global_step)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        pending = self._checkpointer(trainer).save(step, extra=_split(checkpoint, has_optimizer=bool(trainer.optimizers)))
        pending.stall_s = time.perf_counter() - t0  # what training waited for, the state dump included
        self._last_global_step_saved = step
        self._last_checkpoint_saved = self.last_model_path = self.best_model_path = pending.manifest_path or \
            os.path.join(self._ckpt.dirpath, "manifests", f"step-{step:08d}.json")
        self.last_save = pending
        self.saves.append(pending)
        self._unlogged.append(pending)
        self._loggers = list(trainer.loggers)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.enabled and self._ckpt is not None:
            self._ckpt.check()  # a failed flush stops training here, not in a log line
            self._log_finished(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.enabled:
            return super().on_train_end(trainer, pl_module)
        if not (trainer.fast_dev_run or trainer.sanity_checking) and self._last_global_step_saved != trainer.global_step:
            self._save(trainer)  # the state fit ends with is always committed
        self.wait()
        self._log_finished(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self.enabled:
            return super().on_exception(trainer, pl_module, exception)
        try:
            if self._should_save_on_exception(trainer) and trainer.optimizers:
                self._save(trainer)
        except Exception as e:  # noqa: BLE001 - do not hide the exception that stopped training
            log.error("layerckpt: the save on exception failed: %s", e)
        self._close(quiet=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.enabled:
            self._close(quiet=False)
        super().teardown(trainer, pl_module, stage)

    def wait(self) -> None:
        """Every checkpoint made so far durable; raises the first failure."""
        if self._ckpt is not None:
            self._ckpt.wait()

    def _close(self, quiet: bool) -> None:
        ck, self._ckpt = self._ckpt, None
        if self._io is not None and self in self._io._callbacks:
            self._io._callbacks.remove(self)
        if ck is None:
            return
        try:
            ck.close()
        except CheckpointError as e:
            if not quiet:
                raise
            log.error("layerckpt: %s", e)

    def _log_finished(self, trainer: Any) -> None:
        done = [p for p in self._unlogged if p.done()]
        self._unlogged = [p for p in self._unlogged if not p.done()]
        if not self.log_stats or not trainer.is_global_zero:
            return
        for p in done:
            if p.error is not None:
                continue
            metrics = {
                "layerckpt/bytes_written": float(p.bytes_all_ranks or p.bytes_written),
                "layerckpt/layers_persisted": float(p.layers_persisted),
                "layerckpt/stall_ms": p.stall_s * 1e3,
                "layerckpt/flush_gbps": p.flush_gbps,
                "layerckpt/max_staleness": float(p.max_staleness),
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=p.step)


def _refuse_sharded(strategy: Any) -> None:
    """FSDP, DeepSpeed and model-parallel strategies save and load around CheckpointIO; refuse them."""
    names = {c.__name__ for c in type(strategy).__mro__}
    bad = names & {"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy", "XLAFSDPStrategy"}
    if bad:
        raise CheckpointError(
            f"LayerCheckpoint does not support {type(strategy).__name__}: it saves sharded state outside "
            f"Lightning's CheckpointIO. Use ModelCheckpoint with this strategy, or DDP / single-device with "
            f"LayerCheckpoint")
