"""LayerCheckpoint: a ModelCheckpoint whose saves go to one layerckpt store, from every rank at once."""
from __future__ import annotations

import hashlib
import logging
import re
import os
import time
from datetime import timedelta
from types import MethodType
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

import layerckpt
from layerckpt import store
from layerckpt.adapters import (SelectionLoss, as_config, close_quietly, config_overrides, hold, with_config_fields,
                                with_preemption)
from layerckpt.config import Config
from layerckpt.errors import CheckpointError, ConfigError
from layerckpt.interop import peft_extra
from layerckpt.metrics import SaveMetrics
from layerckpt.preempt import signal_names

from ._state import EXTRA_KEY, LOADED_KEY, from_plain, remote_holds_checkpoint, to_extra
from .checkpoint_io import LayerCheckpointIO

log = logging.getLogger("layerckpt")

#: The hooks through which LayerCheckpoint saves and resumes with layerckpt instead of ``.ckpt`` files.
#: A disabled LayerCheckpoint has ModelCheckpoint's own for each (see :func:`_as_model_checkpoint`).
_LAYERCKPT_HOOKS = (
    "setup", "_find_last_checkpoints", "on_load_checkpoint", "on_train_start", "state_dict", "load_state_dict",
    "_get_metric_interpolated_filepath_name", "_save_last_checkpoint", "_save_checkpoint", "_remove_checkpoint",
    "on_train_batch_end", "on_before_optimizer_step", "on_train_end",
    "on_exception", "teardown",
)


def _as_model_checkpoint(cb: "LayerCheckpoint") -> None:
    """Decide ``enabled=False`` once: bind ModelCheckpoint's hooks on the instance, where they shadow the
    class's, so that Lightning (and the callback itself) reaches ModelCheckpoint's code for each."""
    for name in _LAYERCKPT_HOOKS:
        setattr(cb, name, MethodType(getattr(ModelCheckpoint, name), cb))


class LayerCheckpoint(ModelCheckpoint):
    """Layer-selective, asynchronous checkpoints for a Lightning Trainer.

    Takes ModelCheckpoint's arguments, with their meaning:

    - ``dirpath``: the layerckpt store; when omitted, resolved as ModelCheckpoint resolves it
      (``<logger save_dir>/<name>/<version>/checkpoints`` or ``<default_root_dir>/checkpoints``).
      A URL (``"s3://bucket/run"``, any fsspec URL) makes it the remote tier (``remote=``): saves are
      staged in a local directory, ``staging_dir`` (by default
      ``<default_root_dir>/layerckpt-staging/<the URL's bucket and path>-<hash>``), and each committed
      composite is copied to the URL in the background; ``fit(ckpt_path="last")`` resumes from the
      freshest of the two, the URL alone on a machine without the staging directory.
    - ``every_n_train_steps``, ``train_time_interval``, ``every_n_epochs``, ``save_on_exception``,
      ``save_on_train_epoch_end``: when to save.  A last save is made at the end of fit in any case.
    - ``monitor``, ``mode``, ``save_top_k``: with a monitored metric a trigger saves only when the
      score enters the top k, and the k best composites are kept by score (retention by reference:
      data a kept composite uses is never deleted); ``best_model_path``, ``best_model_score``,
      ``best_k_models``, ``kth_best_model_path`` name manifests (``<dirpath>/manifests/step-N.json``),
      and survive a resume.  Without ``monitor``, ``keep_last`` decides what is kept
      (``save_top_k=-1``: everything).
    - ``filename``, ``auto_insert_metric_name``, ``enable_version_counter``: the templated name
      (``"{epoch}-{val_loss:.2f}"`` as in ModelCheckpoint) is recorded in each composite's manifest
      (``layerckpt inspect`` shows it); the files themselves are named by step.
    - ``save_last``: the newest composite is always kept, since the next selective save builds on
      it, and ``last_model_path`` always names it; ``True`` (or ``"link"``) also saves at every trigger
      whose score did not enter the top k, as ModelCheckpoint writes ``last.ckpt``.
    - ``save_weights_only``: composites of the model alone (no optimizer or loop state).
    - ``verbose``: ModelCheckpoint's messages.

    Where the directory format differs: ``best_model_path`` is a manifest, which ``ckpt_path=``,
    ``trainer.validate(ckpt_path="best")`` and :func:`lightning_layerckpt.load_from_checkpoint` read;
    ``Model.load_from_checkpoint`` reads only ``.ckpt`` files, which ``layerckpt export DIR --lightning``
    (or :func:`lightning_layerckpt.export_ckpt`) writes.

    The loss each save's selection is scaled by (its allowance is ``fidelity`` times it) is the mean training
    loss of the optimizer steps since the last save (``training_step``'s loss, a step's micro-batches summed as
    Lightning divides them for ``accumulate_grad_batches``); with ``Trainer(gradient_clip_val=...)`` clipping by
    norm, times the share of those steps' squared gradient norms the clipping kept, since the selection prices
    stale layers with the optimizer's averages of the clipped gradients.  The norm is measured in
    ``on_before_optimizer_step``, right before Lightning clips, and only where it clips by norm (a
    ``configure_gradient_clipping`` of the module's own is not seen).

    layerckpt's own arguments:
        config: a layerckpt YAML file; the layerckpt fields below override it.  With ``monitor`` set
            and neither ``config`` nor ``keep_last`` given, ``keep_last`` is 1 (the top k plus the newest).
        enabled: ``False`` turns this into Lightning's ordinary ModelCheckpoint (full ``.ckpt``
            files; ``save_last`` defaults to ``True`` so ``ckpt_path="last"`` still resumes).  Fixed at
            construction.
        log_stats: log each checkpoint's bytes, layers persisted, stall, flush speed and staleness
            through the Trainer's loggers (``layerckpt/*``).  ``stall_ms`` is what training paid for the
            save: ``save_return_ms`` (the state dump and the plan) plus ``step_wait_ms`` (the next
            optimizer step's wait for the copies under lazy staging).
        staging_dir: with a URL as ``dirpath``, the local directory saves are staged in (see ``dirpath``).
        mtbf: the job's mean time between failures ("8h", "30m", seconds, a timedelta), or a
            :class:`layerckpt.Interval` (for its ``min_steps``/``max_steps``): save every
            sqrt(2 x C x MTBF) of training, in steps, with C what one save costs training (``stall_ms``
            and the steps it slows until it has settled) and the step time both measured as training goes (see :class:`layerckpt.Interval` for the
            formula and its assumptions).  Takes the place of ``every_n_train_steps``,
            ``train_time_interval`` and ``every_n_epochs``, which may not be given with it.  Rank 0's
            clock decides for every rank; the chosen interval and its inputs are logged at each save
            (``layerckpt/interval_*``).
        every other keyword (``fidelity``, ``threshold``, ``max_staleness``, ``keep_last``, ...): a layerckpt
            Config field (see layerckpt.Config), overriding ``config``.  The signature has one typed parameter
            per field, generated from ``dataclasses.fields(Config)`` (see ``layerckpt.adapters``), so
            LightningCLI's ``init_args`` are checked by type; an unknown name or a value of the wrong type is
            refused with a ConfigError naming both.  The tiers among them: ``memory_tier=True`` and
            ``remote="s3://bucket/run"`` (``remote_options``, ``remote_every``, ``remote_bandwidth``) copy each
            committed composite to shared memory and to object storage in the background.
    """

    CHECKPOINT_NAME_LAST = "last"

    @with_config_fields  # one typed keyword parameter per Config field, for LightningCLI's init_args
    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, Literal["link"]]] = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
        *,
        config: Optional[str] = None,
        enabled: bool = True,
        log_stats: bool = True,
        staging_dir: Optional[str] = None,
        mtbf: Optional[Union[str, float, timedelta, layerckpt.Interval]] = None,
        **overrides: Any,
    ):
        if not isinstance(enabled, bool):
            raise ConfigError(f"LayerCheckpoint(enabled=...) must be true or false, got {enabled!r}")
        fields = config_overrides(overrides, "LayerCheckpoint")  # checked against each field's type
        base = as_config(config)
        if "keep_last" not in fields and config is None:
            if monitor is not None:
                fields["keep_last"] = 1  # the k best are kept by score; of the rest, the newest (saves build on it)
            elif save_top_k == -1:
                fields["keep_last"] = 0
        self._url, dirpath = _url_as_remote(dirpath, staging_dir, enabled, fields, base)
        self.layer_config: Config = base.replace(**fields) if fields else base  # validates, names a bad field
        self._enabled = enabled
        self.log_stats = log_stats
        self.interval = _interval(mtbf, every_n_train_steps, train_time_interval, every_n_epochs, enabled)
        if self.interval is not None:  # no trigger of ModelCheckpoint's own: the interval's decides
            every_n_train_steps, every_n_epochs = 0, 0
        super().__init__(
            dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose,
            save_last=True if save_last is None and not enabled else save_last, save_top_k=save_top_k,
            save_on_exception=save_on_exception, save_weights_only=save_weights_only, mode=mode,
            auto_insert_metric_name=auto_insert_metric_name, every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval, every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end, enable_version_counter=enable_version_counter,
        )
        self._start_empty()
        if not enabled:
            _as_model_checkpoint(self)

    def _start_empty(self) -> None:
        """No Checkpointer, IO, save or resume yet: what a new callback holds beside ModelCheckpoint's state."""
        self._ckpt: Optional[layerckpt.Checkpointer] = None
        self._taken = False  # a newer LayerCheckpoint of this process took the store over during this fit
        self._io: Optional[LayerCheckpointIO] = None
        self._unlogged = SaveMetrics()  # saves whose metrics are not logged yet
        self._interval = SelectionLoss()  # the training steps' losses and gradient clipping since the last save
        self._step_seen = -1  # the global step of the last training batch
        self._pending_rng: Optional[layerckpt.LoadedCheckpoint] = None
        self._loggers: List[Any] = []
        self._names: Dict[str, str] = {}  # manifest path -> the templated name it was saved under
        self.last_save: Optional[layerckpt.PendingSave] = None
        self.restored: Optional[Dict[str, Any]] = None  # what the last resume read: step, layers, staleness, ...
        self.saves: List[layerckpt.PendingSave] = []
        #: whether this fit stopped on a notice of preemption (``Config.preemption``); a script may then
        #: ``sys.exit(layerckpt.EXIT_PREEMPTED)`` for its launcher to tell it from a crash and from the end
        self.preempted = False

    @property
    def enabled(self) -> bool:
        """Whether saves go through layerckpt (else this is Lightning's ModelCheckpoint); set at construction."""
        return self._enabled

    def __getstate__(self) -> Dict[str, Any]:
        # ModelCheckpoint's hooks bound on a disabled instance are not state: __setstate__ binds them again
        return {k: v for k, v in self.__dict__.items() if k not in _LAYERCKPT_HOOKS}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not self._enabled:
            _as_model_checkpoint(self)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self._url or self.dirpath, every_n_train_steps=self._every_n_train_steps,
                                        every_n_epochs=self._every_n_epochs,
                                        train_time_interval=self._train_time_interval, monitor=self.monitor,
                                        mode=self.mode, layerckpt=self.enabled)

    # -- setup / resume -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _refuse_sharded(trainer.strategy)
        self.restored, self._pending_rng = None, None  # set again if this fit resumes
        self._taken = False  # a new fit opens the store again
        # a dirpath given is each process's own (node-local directories may differ by node: docs/nodes.md); one
        # made from the logger is rank 0's, whose logger names the version
        self.dirpath = self._resolve_dir(trainer) if self.dirpath is not None else \
            trainer.strategy.broadcast(self._resolve_dir(trainer))
        self._install_io(trainer)
        if _is_model_parallel(trainer.strategy):
            self._route_sharded_load(trainer.strategy)

    def _route_sharded_load(self, strategy: Any) -> None:
        """ModelParallelStrategy loads a checkpoint itself (with DCP), not through CheckpointIO: a layerckpt
        store or manifest is restored here instead, straight into each rank's shards of the module and
        optimizer (which that strategy has set up before it loads)."""
        if "load_checkpoint" in vars(strategy):
            return
        dcp_load = strategy.load_checkpoint

        def load_checkpoint(checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
            path = strategy.broadcast(os.fspath(checkpoint_path))
            if not store.is_checkpoint(path):
                return dcp_load(path, weights_only=weights_only)
            return self._restore_sharded(strategy, path)

        strategy.load_checkpoint = load_checkpoint

    def _restore_sharded(self, strategy: Any, path: str) -> Dict[str, Any]:
        optimizers = strategy.optimizers
        report = layerckpt.restore(path, strategy.lightning_module, optimizers[0] if optimizers else None,
                                   strict=False, config=self.layer_config)  # each rank's RNG too
        rest = (report.extra or {}).get(EXTRA_KEY)
        if not isinstance(rest, dict):
            raise CheckpointError(f"{report.manifest} was not written by LayerCheckpoint (no Lightning state in it)")
        ckpt = from_plain(rest)  # the strategy loads no model or optimizer state from the dict: both are in place
        ckpt[LOADED_KEY] = {"step": report.step, "manifest": report.manifest, "layers": report.layers,
                            "staleness": report.staleness, "max_staleness": report.max_staleness,
                            "bytes_read": report.bytes_read, "seconds": report.seconds,
                            "rng": _RngStates() if self.layer_config.restore_rng else None}
        return ckpt

    def _install_io(self, trainer: Any) -> None:
        current = trainer.strategy.checkpoint_io
        if isinstance(current, LayerCheckpointIO):
            io = current
        else:
            io = LayerCheckpointIO(self.layer_config, fallback=current)
            trainer.strategy.checkpoint_io = io
        io._attach(self)
        self._io = io

    def _resolve_dir(self, trainer: Any) -> str:
        if self.dirpath is not None:
            return os.fspath(self.dirpath)
        if self._url is not None:  # the same for every run of this URL from this root: a restart finds it
            return staging_dir_for(self._url, trainer.default_root_dir)
        if trainer.loggers:
            lg = trainer.loggers[0]
            save_dir = lg.save_dir if lg.save_dir is not None else trainer.default_root_dir
            version = lg.version if isinstance(lg.version, str) else f"version_{lg.version}"
            return os.path.join(save_dir, str(lg.name), version, "checkpoints")
        return os.path.join(trainer.default_root_dir, "checkpoints")

    @override
    def _find_last_checkpoints(self, trainer: Any) -> set:
        """Where ``fit(ckpt_path="last")`` looks: the store, if it holds a committed checkpoint.  With no
        dirpath, a new process's logger has a new version, so earlier versions' stores are candidates too.
        With none of them holding one and a remote tier configured, the remote tier."""
        where = [self._resolve_dir(trainer)]
        if self.dirpath is None and self._url is None and trainer.loggers and trainer.loggers[0].save_dir is not None:
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
        if self.dirpath is not None and trainer.world_size > 1 and _distributed_now(trainer) and \
                store.node_part(where[0]) is not None:
            # node-local directories (docs/nodes.md): a node that came back empty resumes with the others, its
            # ranks' part gathered from the nodes and replicas that hold it; every rank must name its store
            anywhere = trainer.strategy.reduce_boolean_decision(bool(found), all=False)
            if anywhere:
                os.makedirs(where[0], exist_ok=True)
                return {os.path.normpath(where[0])}
        remote = self.layer_config.remote
        if not found and remote is not None and remote_holds_checkpoint(remote, self.layer_config):
            # The local store was lost with its node: resume from the remote tier, through the local directory
            # (created empty), which Lightning can date and which LayerCheckpointIO reads across its tiers.  The
            # URL itself is no candidate: Lightning would open it without Config.remote_options.
            os.makedirs(where[0], exist_ok=True)
            found.add(os.path.normpath(where[0]))
        return found

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        info = checkpoint.get(LOADED_KEY)
        if isinstance(info, dict):
            self.restored = {k: v for k, v in info.items() if k != "rng"}
            if self.layer_config.restore_rng:
                self._pending_rng = info.get("rng")

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._interval, self._step_seen = SelectionLoss(), trainer.global_step  # this fit's steps alone
        if self._ckpt is None:
            self._checkpointer(trainer)
            self._take_early_notice(trainer)
            if self.restored is not None and os.path.dirname(os.path.dirname(self.restored["manifest"])) == \
                    self._ckpt.dirpath:
                self._ckpt.adopt(self.restored["manifest"])  # resumed from this store: stay selective
        loaded, self._pending_rng = self._pending_rng, None
        if loaded is not None:  # Lightning keeps no RNG state; put back each rank's own, as at the save
            loaded.restore_rng()

    def _take_early_notice(self, trainer: Any) -> None:
        """A SIGTERM that came after Lightning installed its handler and before ours (the restore, the fit's
        setup) is ours to act on: told to the Checkpointer, and Lightning's flag cleared (else its
        SIGTERMException would end the fit unsaved at the first batch)."""
        connector = getattr(trainer, "_signal_connector", None)
        if getattr(connector, "received_sigterm", False) and \
                "SIGTERM" in (signal_names(with_preemption(self.layer_config).preemption) or ()):
            self._ckpt.preempt()
            connector.received_sigterm = False

    def _checkpointer(self, trainer: Any) -> "layerckpt.Checkpointer":
        """This fit's Checkpointer (created on every rank at once: construction is collective)."""
        optimizers = [] if self.save_weights_only else trainer.optimizers
        if self._ckpt is None:
            if self._taken:
                raise CheckpointError(
                    f"a newer LayerCheckpoint of this process took over the store {self.dirpath} during this fit "
                    f"(this one's saves there had ended and it closed them); save through the newer one")
            hold(self.dirpath, self._taken_over)  # an older LayerCheckpoint of this process there closes first
            # SIGTERM saved on by default: installed here, at the fit's start, our handler stands in for the one
            # Lightning installed (whose SIGTERMException would end the fit at this rank's batch end, unsaved,
            # and the other ranks' at their next); Lightning puts its predecessor back when the fit ends
            self._ckpt = layerckpt.Checkpointer(self.dirpath, trainer.lightning_module,
                                                optimizers[0] if optimizers else None,
                                                with_preemption(self.layer_config))
            self._pin()
        elif optimizers and self._ckpt.optimizer is not optimizers[0]:
            raise CheckpointError("the Trainer's optimizer changed since the first checkpoint of this fit; "
                                  "LayerCheckpoint follows one optimizer object per fit")
        return self._ckpt

    def _taken_over(self, root: str) -> None:
        """A newer LayerCheckpoint of this process opens the store ``root``: close ours (its saves end first)."""
        ck, self._ckpt, self._taken = self._ckpt, None, True
        if ck is not None:
            close_quietly([ck], what="a Lightning save")

    @override
    def state_dict(self) -> Dict[str, Any]:
        # ModelCheckpoint's state (best_k_models, scores, paths), so top-k survives a resume
        return {**super().state_dict(), "last_step": self._last_global_step_saved, "names": dict(self._names)}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "best_model_score" not in state_dict:  # written by a LayerCheckpoint that had no top-k
            if state_dict.get("dirpath") == self.dirpath:
                self.best_model_path = state_dict.get("best_model_path", "")
                self.last_model_path = state_dict.get("last_model_path", "")
            return
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath") != self.dirpath:
            return
        names = state_dict.get("names")
        self._names = dict(names) if isinstance(names, dict) else {}
        # composites retention already dropped (e.g. a crash between an unpin and the restart) are gone
        kept = {p: v for p, v in self.best_k_models.items() if os.path.isfile(p)}
        if kept != self.best_k_models:
            self.best_k_models = kept
            self._rank_best()
        if self._ckpt is not None:
            self._pin()

    def _rank_best(self) -> None:
        """best_model_path/score and the k-th from best_k_models, as ModelCheckpoint derives them."""
        worst, best = (max, min) if self.mode == "min" else (min, max)
        if self.best_k_models:
            self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
            self.best_model_score = self.best_k_models[self.best_model_path]
            if self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k:
                self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
                self.kth_value = self.best_k_models[self.kth_best_model_path]
        else:
            self.best_model_path, self.best_model_score, self.kth_best_model_path = "", None, ""

    def _pin(self) -> None:
        """Retention keeps the top-k composites by score besides the newest (monitor set only)."""
        if self._ckpt is not None and self.monitor is not None:
            self._ckpt.keep(self.best_k_models)

    # -- saving ------------------------------------------------------------------------------------------
    # ModelCheckpoint decides when to save and what to keep (monitor, top-k, save_last, version counter);
    # the "file path" it keeps for a composite is its manifest, and the file name it formats is recorded
    # in that manifest.

    def _manifest_path(self, step: int) -> str:
        return store.manifest_path(os.fspath(self.dirpath), step)

    @override
    def _get_metric_interpolated_filepath_name(self, monitor_candidates: Dict[str, Any], trainer: Any,
                                               del_filepath: Optional[str] = None) -> str:
        name = os.path.basename(self.format_checkpoint_name(dict(monitor_candidates)))
        name = name[: -len(self.FILE_EXTENSION)] if name.endswith(self.FILE_EXTENSION) else name
        if self._enable_version_counter:
            taken = {n for p, n in self._names.items() if p != del_filepath}
            stem, version = name, self.STARTING_VERSION
            while name in taken:
                name, version = f"{stem}{self.CHECKPOINT_JOIN_CHAR}v{version}", version + 1
        path = self._manifest_path(int(trainer.global_step))
        self._names[path] = name
        return path

    @override
    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: Dict[str, Any]) -> None:
        # the newest composite is the last one: save only where this step has none yet
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save(trainer, name=self.CHECKPOINT_NAME_LAST)

    @override
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        self._save(trainer, name=self._names.get(filepath))

    @override
    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        """A composite that left the top k: no longer kept by score; retention drops it after the next
        commit unless it is the newest (data that kept composites use stays)."""
        self._names.pop(filepath, None)
        self._pin()

    def _save(self, trainer: Any, name: Optional[str] = None) -> None:
        """One checkpoint of the current global step, on every rank."""
        t0 = time.perf_counter()
        step = int(trainer.global_step)
        path = self._manifest_path(step)
        # the paths are set before the state is dumped: the state saved names its own composite
        self._last_checkpoint_saved = self.last_model_path = path
        if self.monitor is None:
            self.best_model_path = path
        self._names.setdefault(path, name or f"step={step}")
        self._names = {p: n for p, n in self._names.items() if p == path or p in self.best_k_models}
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=self.save_weights_only)
        extra = to_extra(checkpoint, has_optimizer=bool(trainer.optimizers) and not self.save_weights_only)
        extra.update(peft_extra(trainer.lightning_module))  # a PeftModel's adapter configs, for export --peft
        ckpt = self._checkpointer(trainer)
        self._pin()  # before the save: its flush may commit, and run retention, before save() returns
        pending = ckpt.save(step, extra=extra, loss=self._interval.take(), name=self._names[path])
        pending.stall_s = time.perf_counter() - t0  # what training waited for, the state dump included
        self._last_global_step_saved = step
        self.last_save = pending
        self.saves.append(pending)
        self._unlogged.add(pending)
        self._loggers = list(trainer.loggers)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the training loss sets the scale of layerckpt's selection (Config.fidelity): Lightning's is the
        # micro-batch's, divided for gradient accumulation; a step ends where the global step moved
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._interval.add(loss)
        stepped = trainer.global_step != self._step_seen
        if stepped:
            self._step_seen = trainer.global_step
            self._interval.step_done()
        if self._ckpt is not None:
            self._ckpt.check()  # a failed flush stops training here, not in a log line
            self._log_finished(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.interval is not None:
            self._save_on_interval(trainer)
        if stepped and self._ckpt is not None:  # an optimizer step's boundary: every rank reaches it alike
            deadline = self._ckpt.notice(int(trainer.global_step))
            if deadline is not None:
                self._stop_on_notice(trainer, deadline)

    def _stop_on_notice(self, trainer: Any, deadline: float) -> None:
        """Every rank agreed on a notice at this step: save it where it can be durable in time, wait for it (and
        the tiers' copies) until the deadline, and stop the fit as Lightning stops one (``should_stop``)."""
        step = int(trainer.global_step)
        if self._ckpt.can_save_by(deadline, step) and self._last_global_step_saved != step:
            self._save(trainer, name=self.CHECKPOINT_NAME_LAST)
        self._ckpt.durable_by(deadline)
        self.preempted = True
        trainer.should_stop = True

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Lightning clips right after this hook (Trainer(gradient_clip_val=..., the "norm" algorithm)): the
        # norm the gradients have now is the one clipping scales them by, measured only where it will clip
        clip = _norm_clip(trainer, pl_module)
        if clip is not None:
            self._interval.clipped(_grad_norm(trainer, optimizer), clip)

    def _save_on_interval(self, trainer: Any) -> None:
        """With ``mtbf``: save when the interval says so (rank 0's answer, on every rank)."""
        step = int(trainer.global_step)
        due = trainer.strategy.broadcast(self.interval.due(step))
        if not due or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # as ModelCheckpoint does: saved once validation ran
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        if self.last_save is not None and self.last_save.step == step:
            self.interval.saved(self.last_save)
        if self.log_stats and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.interval.metrics(), step=step)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not (trainer.fast_dev_run or trainer.sanity_checking) and \
                self._last_global_step_saved != trainer.global_step:
            self._save(trainer, name=self.CHECKPOINT_NAME_LAST)  # the state fit ends with is always committed
        self.wait()
        self._log_finished(trainer)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            if self._should_save_on_exception(trainer) and trainer.optimizers:
                self._save(trainer)
        except Exception as e:  # noqa: BLE001 - do not hide the exception that stopped training
            log.error("layerckpt: the save on exception failed: %s", e)
        self._close(quiet=True)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        vars(trainer.strategy).pop("load_checkpoint", None)  # the strategy's own loader again
        self._close(quiet=False)
        super().teardown(trainer, pl_module, stage)

    def wait(self) -> None:
        """Every checkpoint made so far durable; raises the first failure."""
        if self._ckpt is not None:
            self._ckpt.wait()

    def _close(self, quiet: bool) -> None:
        ck, self._ckpt = self._ckpt, None
        if self._io is not None:
            self._io._detach(self)
        if ck is None:
            return
        try:
            ck.close()
        except CheckpointError as e:
            if not quiet:
                raise
            log.error("layerckpt: %s", e)

    def _log_finished(self, trainer: Any) -> None:
        """The metrics of the saves that committed since the last call (never waits for one)."""
        finished = self._unlogged.finished()
        if not self.log_stats or not trainer.is_global_zero:
            return
        for step, metrics in finished:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)


def _interval(mtbf: Any, every_n_train_steps: Optional[int], train_time_interval: Optional[timedelta],
              every_n_epochs: Optional[int], enabled: bool) -> Optional[layerckpt.Interval]:
    """The Interval of ``mtbf`` (None without one); refused beside another trigger, and where saves are
    ModelCheckpoint's (``enabled=False``: no layerckpt save measures its cost)."""
    if mtbf is None:
        return None
    if not enabled:
        raise ConfigError(f"LayerCheckpoint(mtbf={mtbf!r}, enabled=False): the interval is measured on layerckpt's "
                          f"saves, and enabled=False saves with ModelCheckpoint; give every_n_train_steps there")
    given = [f"{n}={v!r}" for n, v in (("every_n_train_steps", every_n_train_steps),
                                        ("train_time_interval", train_time_interval),
                                        ("every_n_epochs", every_n_epochs)) if v is not None]
    if given:
        raise ConfigError(f"LayerCheckpoint(mtbf={mtbf!r}) chooses when to save, but {', '.join(given)} is given too; "
                          f"pass one trigger: mtbf, or the others")
    return mtbf if isinstance(mtbf, layerckpt.Interval) else layerckpt.Interval(mtbf)


def _norm_clip(trainer: Any, pl_module: Any) -> Optional[float]:
    """The norm Lightning clips each optimizer step's gradients to (``gradient_clip_val`` with the "norm"
    algorithm, its default), None where it does not clip by norm (manual optimization clips nothing)."""
    val = trainer.gradient_clip_val
    if not val or val <= 0 or not getattr(pl_module, "automatic_optimization", True):
        return None
    algorithm = trainer.gradient_clip_algorithm
    if algorithm is not None and getattr(algorithm, "value", algorithm) != "norm":
        return None
    return float(val)


def _grad_norm(trainer: Any, optimizer: Any) -> Any:
    """The 2-norm of the gradients of ``optimizer``'s parameters, as the precision plugin's clipping computes
    it (over ``main_params``, once gradients are unscaled); a tensor, not read here (no device sync)."""
    grads = [p.grad for p in trainer.precision_plugin.main_params(optimizer) if p.grad is not None]
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None:
        return total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)


def _url_as_remote(dirpath: Any, staging_dir: Optional[str], enabled: bool, fields: Dict[str, Any],
                   base: Config) -> Tuple[Optional[str], Any]:
    """(the URL, the local dirpath): a URL as dirpath becomes the remote tier (``fields["remote"]``), its saves
    staged in ``staging_dir``; a staging_dir without a URL dirpath is refused."""
    if enabled and store.is_url(dirpath):
        url = os.fspath(dirpath).rstrip("/")
        other = fields.get("remote", base.remote)
        if other is not None and other.rstrip("/") != url:
            raise ConfigError(
                f"LayerCheckpoint(dirpath={dirpath!r}) is a URL, which makes it the remote tier, but the remote "
                f"tier is also set to {other!r}; give the URL once, as dirpath or as remote (with a local dirpath)")
        fields["remote"] = url
        return url, staging_dir
    if staging_dir is not None:
        why = f"dirpath is {dirpath!r}" + ("" if enabled else " and enabled=False")
        raise ConfigError(f"LayerCheckpoint(staging_dir={staging_dir!r}) is the local directory of a URL dirpath, "
                          f"but {why}; pass dirpath='s3://bucket/run' or drop staging_dir")
    return None, dirpath


def staging_dir_for(url: str, root: Any) -> str:
    """The default local directory of a URL dirpath: ``<root>/layerckpt-staging/<bucket and path>-<hash>``."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", url.split("://", 1)[-1]).strip("-.")[:80] or "remote"
    digest = hashlib.sha1(url.encode()).hexdigest()[:8]
    return os.path.join(os.path.abspath(os.fspath(root)), "layerckpt-staging", f"{readable}-{digest}")


class _RngStates:
    """The RNG states as a restore just set them (the checkpoint's), to put back at the start of training:
    Lightning draws from them between loading a checkpoint and its first step."""

    def __init__(self) -> None:
        import random

        import numpy as np

        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
                       else None)

    def restore_rng(self) -> None:
        import random

        import numpy as np

        py, npy, cpu, cuda = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _is_model_parallel(strategy: Any) -> bool:
    return any(c.__name__ == "ModelParallelStrategy" for c in type(strategy).__mro__)


def _refuse_sharded(strategy: Any) -> None:
    """FSDP1, DeepSpeed and XLA strategies save sharded state their own way, around CheckpointIO; refuse
    them, naming the sharded strategy that works (ModelParallelStrategy: FSDP2's fully_shard)."""
    names = {c.__name__ for c in type(strategy).__mro__}
    bad = names & {"FSDPStrategy", "DeepSpeedStrategy", "XLAStrategy", "XLAFSDPStrategy"}
    if bad:
        raise CheckpointError(
            f"LayerCheckpoint does not support {type(strategy).__name__}: it saves sharded state outside "
            f"Lightning's CheckpointIO. For sharded training use ModelParallelStrategy (FSDP2's fully_shard in "
            f"configure_model), whose shards LayerCheckpoint saves and restores; otherwise DDP or a single device, "
            f"or Lightning's ModelCheckpoint with this strategy")


def _distributed_now(trainer: Any) -> bool:
    """Whether the training's process group is up, brought up here where the strategy can do it at once:
    ``fit(ckpt_path="last")`` looks for the last checkpoint before the strategy's own setup, and on node-local
    directories the ranks must agree whether any node holds one (a node that came back empty holds none).
    ``DDPStrategy.setup_distributed`` returns early when called again, as it is later."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    setup = getattr(trainer.strategy, "setup_distributed", None)
    if setup is None or not dist.is_available():
        return False
    setup()
    return dist.is_initialized()

