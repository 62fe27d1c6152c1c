"""Layer-selective ``fabric.save`` / ``fabric.load`` for ``lightning.Fabric``.

Fabric turns modules and optimizers into state dicts before a ``CheckpointIO`` sees them, so
:class:`LayerFabricCheckpoint` routes one Fabric's saves and loads through its strategy's public
``save_checkpoint``/``load_checkpoint`` instead::

    model, optimizer = fabric.setup(model, optimizer)   # after fabric.launch()
    ckpt = LayerFabricCheckpoint(fabric, keep_last=3)   # Config fields, or config=Config/dict/YAML path
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    fabric.load("ckpts", state)                         # if the store exists: in place; returns the rest
    fabric.save("ckpts", state)                         # or ckpt.save("ckpts", state, loss=loss)
    ckpt.close()                                        # all durable; Fabric's own save/load are back

``fabric.save(path, state)``: ``path`` is a store (a directory) of composites.  The first module in
``state`` and the first optimizer over its parameters go layer by layer through one
``layerckpt.Checkpointer`` per store; the other entries (stateful objects as ``state_dict()``,
tensors, plain values) ride in the manifest, kept exactly (what ``torch.load(weights_only=True)`` takes; anything needing pickle is refused).  The step is ``state["step"]`` if an int,
else one past the store's newest.  Every rank calls it: each writes its share, rank 0 commits.  It
returns once staged; ``ckpt.save(..., loss=loss)`` gives the selection rule its scale (a conservative
rule writes more without it).

``fabric.load(path, state)`` on a store (or a ``manifests/step-N.json``) finishes this process's
saves into it, restores the module and optimizer saved under the same keys in place (and the RNG
states unless ``restore_rng=False``; the report is ``ckpt.report``), puts the other entries back as
Fabric does and returns the rest.  With ``adopt=True`` (the default) the store then stays open,
holding its writer lock, so the next save continues the composite instead of writing a full one; a
process that only reads passes ``adopt=False``.  A state without a module and a path that is no
store are Fabric's own.

Each save, once committed, is logged through ``fabric.log_dict`` to the Fabric's loggers at the save's
step, under the names :class:`LayerCheckpoint` logs (``layerckpt/bytes_written``, ``layers_persisted``,
``stall_ms`` = ``save_return_ms`` + ``step_wait_ms``, ``flush_gbps``, ``max_staleness``): at the next
save, ``wait()``, ``load`` or ``close()``, never waiting for a flush (``log_stats=False``: not at all).

``close()`` (or leaving a ``with`` block) waits until every save is durable, raises the first
failure, closes the stores (no ``layerckpt-flusher`` thread is left) and gives Fabric its own
``save``/``load`` back; a handle never closed is closed at exit.  Limits: one module and one
optimizer per state are layer-selective (others are saved whole in the manifest, at every save);
``filter=`` may not name them.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Dict, Optional, Set, Union

import torch
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from torch.nn.parallel import DistributedDataParallel

import layerckpt
from layerckpt import store
from layerckpt.adapters import (StepCounter, as_config, close_all, close_quietly, config_overrides, hold, owners,
                                with_config_fields)
from layerckpt.config import Config
from layerckpt.errors import CheckpointError
from layerckpt.metrics import SaveMetrics

from ._state import from_plain, to_plain

log = logging.getLogger("layerckpt")

#: The Fabric state (all but the module and optimizer) and its keys, inside a manifest's ``extra``.
EXTRA_KEY = "fabric"


class LayerFabricCheckpoint:
    """Makes ``fabric.save``/``fabric.load`` layer-selective until :meth:`close` (see the module docstring)."""

    @with_config_fields  # one typed keyword parameter per Config field
    def __init__(self, fabric: Any, config: Optional[Union[Config, str, os.PathLike, Dict[str, Any]]] = None, *,
                 adopt: bool = True, log_stats: bool = True, **config_fields: Any):
        fields = config_overrides(config_fields, "LayerFabricCheckpoint", none_unset=False)
        base = as_config(config)
        self.config = base.replace(**fields) if fields else base  # validates, names a bad field
        self.adopt = adopt
        self.log_stats = log_stats
        self._metrics = SaveMetrics()  # saves whose metrics are not logged yet
        self.fabric = fabric
        self.strategy = s = fabric.strategy
        if isinstance(s, DeepSpeedStrategy) or not isinstance(s, (SingleDeviceStrategy, DDPStrategy)):
            raise CheckpointError(f"LayerFabricCheckpoint takes single-device and DDP strategies, not "
                                  f"{type(s).__name__}; save with Fabric's own fabric.save there")
        if "save_checkpoint" in vars(s):
            raise CheckpointError("this Fabric is already routed by a LayerFabricCheckpoint; close that one first")
        self._ckpts: Dict[str, layerckpt.Checkpointer] = {}  # store -> its Checkpointer
        self._steps: Dict[str, StepCounter] = {}  # store -> the step of its next save
        self._taken: Set[str] = set()  # stores a newer LayerFabricCheckpoint of this process took over
        self._loss, self._closed = None, False
        self.last_save: Optional[layerckpt.PendingSave] = None  # this rank's newest save
        self.report: Optional[layerckpt.RestoreReport] = None  # the newest load's restore report
        self._own_save, self._own_load = self.strategy.save_checkpoint, self.strategy.load_checkpoint
        self.strategy.save_checkpoint = self._save_checkpoint
        self.strategy.load_checkpoint = self._load_checkpoint
        weakref.finalize(self, close_all, self._ckpts, quiet=True, what="a Fabric save")

    def save(self, path: Union[str, os.PathLike], state: Dict[str, Any],
             filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None, *, loss: Any = None) -> None:
        """``fabric.save(path, state, filter)`` with the training loss that scales the layer selection."""
        if self._closed:
            raise CheckpointError("save() on a closed LayerFabricCheckpoint; create a new one")
        self._loss = loss
        try:
            self.fabric.save(path, state, filter)
        finally:
            self._loss = None

    def wait(self) -> None:
        """Every save so far durable and committed; raises the first failure."""
        try:
            for ck in list(self._ckpts.values()):
                ck.wait()
        finally:
            self._log_finished()

    def _log_finished(self) -> None:
        """The metrics of the saves that committed since the last call, through ``fabric.log_dict``."""
        finished = self._metrics.finished()
        if not self.log_stats or not self.fabric.is_global_zero:  # as the Lightning callback: rank 0 logs
            return
        for step, metrics in finished:
            self.fabric.log_dict(metrics, step=step)

    def close(self) -> None:
        """Wait for every save, close the stores and give Fabric its own save and load back."""
        self._closed = True
        try:
            close_all(self._ckpts, what="a Fabric save")
        finally:
            self._log_finished()
            for name, ours in (("save_checkpoint", self._save_checkpoint), ("load_checkpoint", self._load_checkpoint)):
                if vars(self.strategy).get(name) == ours:
                    delattr(self.strategy, name)

    def __enter__(self) -> "LayerFabricCheckpoint":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            self.close()
        except CheckpointError as e:
            if exc_type is None:
                raise
            log.error("layerckpt: %s", e)  # do not hide the exception in flight behind a flush error

    def _save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Any = None,
                         filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """The strategy's ``save_checkpoint``, on every rank."""
        mkey, okey = _pick(state)
        if mkey is None:
            return self._own_save(path=path, state=state, storage_options=storage_options, filter=filter)
        filter = filter or {}
        if storage_options is not None or set(filter) & {mkey, okey}:
            raise CheckpointError(f"a layer-selective fabric.save takes no storage_options, nor a filter on the module "
                                  f"or optimizer ({mkey!r}, {okey!r}): they are saved layer by layer, unfiltered")
        rest = {}
        for key, obj in state.items():
            if key in (mkey, okey):
                continue
            if isinstance(obj, torch.nn.Module):
                obj = self.strategy.get_module_state_dict(obj)
            elif _stateful(obj):  # optimizers, schedulers, ...
                obj = obj.state_dict()
            if key in filter and isinstance(obj, dict):
                obj = {k: v for k, v in obj.items() if filter[key](k, v)}
            rest[key] = obj
        rest = to_plain(rest, "state")  # kept exactly; a value that would need pickle is refused, naming its key
        root = store.local_path(path)
        if root in self._taken:
            raise CheckpointError(
                f"fabric.save({os.fspath(path)!r}): a newer LayerFabricCheckpoint of this process took over the store "
                f"{root} (this one's saves there had ended and it closed them); save through the newer one")
        ck = self._open(root, _unwrap(state[mkey]), state[okey] if okey else None)
        step = self._steps[root].step(state.get("step"))  # state["step"] if an int, else one past the last
        extra = {EXTRA_KEY: {"module": mkey, "optimizer": okey, "keys": list(state), "state": rest}}
        self._log_finished()
        self.last_save = ck.save(step, extra=extra, loss=self._loss)
        self._metrics.add(self.last_save)
        self._steps[root].saved(step)

    def _taken_over(self, root: str) -> None:
        """A newer LayerFabricCheckpoint of this process opens ``root``: close ours there (its saves end first)."""
        self._taken.add(root)
        ck = self._ckpts.pop(root, None)
        if ck is not None:
            close_quietly([ck], what="a Fabric save")

    def _load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                         weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """The strategy's ``load_checkpoint``: what Fabric's ``load`` and ``load_raw`` call."""
        if not store.is_checkpoint(path):
            if os.path.isdir(path):
                store.locate(path)  # raises the clear error: a directory, but not a checkpoint
            return self._own_load(path=path, state=state, strict=strict, weights_only=weights_only)
        root, step = store.locate(path)
        if self.adopt:  # this handle goes on saving there: an older one of this process ends its saves and closes
            hold(root, self._taken_over)
        ck = self._ckpts.pop(root, None)
        if ck is not None:  # read our own writes; a later save reopens the store on what was loaded
            ck.close()
            self._log_finished()
        mpath = store.resolve(root, step)
        m = store.read_manifest(mpath)
        info = (m.extra or {}).get(EXTRA_KEY)
        if not isinstance(info, dict):
            raise CheckpointError(f"{mpath} was not written by fabric.save through LayerFabricCheckpoint; "
                                  f"restore it with layerckpt.restore(dirpath, model, optimizer)")
        mkey, okey = _pick(state) if isinstance(state, dict) else (None, None)
        missing = [k for k in state if k not in info["keys"]] if isinstance(state, dict) and strict else []
        if missing:  # Fabric's own words
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                           f"checkpoint. To disable strict loading, set `strict=False`.")
        done = set()
        if mkey is not None and mkey == info["module"]:  # straight into the module's and optimizer's memory
            module = _unwrap(state[mkey])
            opt = state[okey] if okey is not None and okey == info["optimizer"] else None
            self.report = layerckpt.restore(root, module, opt, step=m.step, strict=strict, config=self.config)
            ckpt = from_plain(self.report.extra[EXTRA_KEY]["state"])
            done = {mkey, okey} if opt is not None else {mkey}
            if self.adopt:
                try:  # continue the composite just restored: the next save into root is selective
                    self._open(root, module, opt).adopt(self.report)
                except CheckpointError as e:  # refused on every rank alike, e.g. another process writes there
                    log.info("layerckpt: %s not opened for saves (%s); a save there starts full", root, e)
        else:
            loaded = layerckpt.read_checkpoint(root, step=m.step, config=self.config, strict=strict)
            ckpt = from_plain(loaded.extra[EXTRA_KEY]["state"])
            ckpt[info["module"]] = {**loaded.model_other, **loaded.model}
            if info["optimizer"] is not None:
                ckpt[info["optimizer"]] = loaded.optimizer
            if not state:
                return ckpt
            if not isinstance(state, dict):  # fabric.load_raw: a module or an optimizer
                state = {info["module"] if isinstance(state, torch.nn.Module) else info["optimizer"]: state}
                ckpt = {k: v for k, v in ckpt.items() if k in state}
        for name, obj in list(state.items()):  # the rest, as Fabric's own load puts it back
            if name in done or name not in ckpt:
                continue
            if isinstance(obj, torch.nn.Module):
                self.strategy.load_module_state_dict(obj, ckpt.pop(name), strict=strict)
            elif _stateful(obj):
                obj.load_state_dict(ckpt.pop(name))
            else:
                state[name] = ckpt.pop(name)
        return ckpt

    def _open(self, root: str, module: torch.nn.Module, optimizer: Any) -> layerckpt.Checkpointer:
        """The store's Checkpointer (collective when new: every rank saves and loads together)."""
        ck = self._ckpts.get(root)
        if ck is not None and ck.model is module and ck.optimizer is optimizer:
            return ck
        if ck is not None:  # other objects now: a fresh Checkpointer, whose first save is full
            self._ckpts.pop(root).close()
        hold(root, self._taken_over)  # an older handle of this process on root closes its Checkpointer first
        self._taken.discard(root)
        ck = self._ckpts[root] = layerckpt.Checkpointer(root, module, optimizer, self.config)
        self._steps[root] = StepCounter(store.next_step(root))
        return ck


def _pick(state: Dict[str, Any]):
    """The keys of the first module and of the first optimizer over only that module's parameters."""
    mkey = next((k for k, v in state.items() if isinstance(v, torch.nn.Module)), None)
    okey = next((k for k, v in state.items() if isinstance(v, torch.optim.Optimizer) and mkey is not None
                 and owners(v, [_unwrap(state[mkey])]) <= {0}), None)
    return mkey, okey


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

