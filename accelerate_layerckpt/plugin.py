"""LayerCheckpointPlugin: accelerator.save_state / load_state persist models and optimizers through layerckpt."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch

from layerckpt import EXIT_PREEMPTED, Checkpointer, Config, LayerSpec, PendingSave, RestoreReport, restore, store
from layerckpt.adapters import (SelectionLoss, StepCounter, as_config, close_all, close_quietly, default_of, hold,
                                pair_optimizers, with_preemption)
from layerckpt.errors import CheckpointError, CheckpointMismatchError, ConfigError
from layerckpt.metrics import SaveMetrics
from layerckpt.preempt import Notice, open_notice, wait_until

from . import folders, remote

log = logging.getLogger("layerckpt.accelerate")

ENV_ENABLED = "LAYERCKPT_ENABLED"
ENV_CONFIG = "LAYERCKPT_CONFIG"
_UNSUPPORTED = {"FSDP": "FSDP shards", "DEEPSPEED": "DeepSpeed engines", "MEGATRON_LM": "Megatron-LM models",
                "XLA": "XLA devices"}
WAIT_BELOW = 8 << 20  # save_states of at most this many bytes (this process's) return durable
_registered: "weakref.WeakKeyDictionary[Any, LayerCheckpointPlugin]" = weakref.WeakKeyDictionary()
_disabled_logged = False


def enabled_by_env() -> bool:
    """``LAYERCKPT_ENABLED``: unset or 1/true/yes/on enables the plugin, 0/false/no/off disables it."""
    value = os.environ.get(ENV_ENABLED, "")
    v = value.strip().lower()
    if v in ("", "1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{ENV_ENABLED}={value!r} is neither on nor off; set it to 1 or 0")


def _routed(orig, route):
    @functools.wraps(orig)
    def method(*args: Any, **kwargs: Any):
        return route(*args, **kwargs)

    return method


def _wait_for_flushes() -> None:
    """Read your writes: every save of this process's plugins (an older Accelerator's too) committed or failed."""
    for plugin in list(_registered.values()):
        for st in list(plugin._stores.values()):
            try:
                st.wait_flushes()
            except CheckpointError:  # that save's folder is then skipped as never committed
                pass


def _state_bytes(checkpointers: List[Checkpointer]) -> int:
    """What the models and optimizers of a store hold in all (not what a selective save writes of it)."""
    total = 0
    for ck in checkpointers:
        tensors = list(ck.model.parameters()) + list(ck.model.buffers())
        if ck.optimizer is not None:
            tensors += [v for state in ck.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def refuse_keep_last(config: Config) -> None:
    """Accelerate's ``total_limit`` decides which checkpoint folders stay, and a composite stays while a folder
    points at it: a ``keep_last`` of the Config would contradict that, so one set explicitly is refused.
    "Explicitly" is "other than the field's default": a Config that spells out the default passes."""
    if config.keep_last != default_of("keep_last"):
        raise ConfigError(
            f"Config.keep_last={config.keep_last} does not apply with LayerCheckpointPlugin: accelerate's "
            f"total_limit decides which checkpoint folders stay, and each composite stays while a folder points at "
            f"it; drop keep_last from the Config and set ProjectConfiguration(total_limit=N) instead")


def _with_optimizer(pairs) -> List[bool]:
    """Per model of ``pairs`` (see ``LayerCheckpointPlugin._pairs``): whether an optimizer goes with it."""
    return [opt is not None for _, opt in pairs]


class _Store:
    """One layerckpt store and its Checkpointers (one per prepared model)."""

    def __init__(self, root: str, checkpointers: List[Checkpointer], optimizers: List[bool], next_step: int,
                 run_id: str, live: Dict[str, int], uploads: Optional[remote.FolderUploads] = None):
        self.root = root
        self.uploads = uploads  # the checkpoint folders' copies to the remote tier (main process)
        self.checkpointers = checkpointers
        self.optimizers = optimizers
        self.steps = StepCounter(next_step)
        self.run_id = run_id
        self.live = live  # pointer file -> step of every folder known to point into this store (rank 0)
        self.pruner = folders.Pruner()

    @property
    def model_roots(self) -> List[str]:
        return [ck.dirpath for ck in self.checkpointers]

    def wait_flushes(self) -> None:
        """Every save into this store durable and committed; re-raises a flush error."""
        for ck in self.checkpointers:
            ck.wait()

    def wait(self) -> None:
        """Flushes done and pruning too, and the folders' copies to the remote tier."""
        self.wait_flushes()
        self.pruner.drain()
        if self.uploads is not None:
            self.uploads.wait()

    def close(self) -> None:
        try:
            close_all(self.checkpointers)
        finally:
            if self.uploads is not None:
                self.uploads.close()


class LayerCheckpointPlugin:
    """Routes ``accelerator.save_state``/``load_state`` for models and optimizers through layerckpt.

    ``config`` defaults to ``Config.from_yaml($LAYERCKPT_CONFIG)`` when that
    variable is set, else ``Config()``.  ``LAYERCKPT_ENABLED=0`` makes
    :meth:`register` a no-op.  A composite lives as long as a checkpoint folder
    points at it (accelerate's ``total_limit`` decides), so a Config whose
    ``keep_last`` is not the default is refused with a ConfigError saying so.
    ``layers`` overrides the layer grouping as in :class:`layerckpt.Checkpointer`.

    Each ``save_state``, once committed, is logged through ``accelerator.log`` to the trackers the
    script configured (``Accelerator(log_with=...)`` and ``init_trackers``), under the Lightning
    callback's names: ``layerckpt/bytes_written`` (every rank's, every model's), ``layers_persisted``,
    ``stall_ms`` (what training paid: ``save_state``'s staging plus the next step's wait for the copies,
    also apart as ``save_return_ms`` and ``step_wait_ms``), ``flush_gbps`` and ``max_staleness``.  The
    metrics are known only once the save commits, and training never waits for that: they are logged at
    the next ``backward``, ``save_state``, :meth:`wait` or :meth:`close`, at the step the save was made
    (the optimizer steps this process has run: ``backward`` calls that synced gradients).
    ``log_stats=False`` logs nothing.

    The loss each save's selection is scaled by (its allowance is ``Config.fidelity`` times it) is the mean of
    the losses given to ``accelerator.backward`` since the last ``save_state``, times the share of the squared
    gradient norms that ``accelerator.clip_grad_norm_`` kept: the selection prices stale layers with the
    optimizer's averages of the clipped gradients.  ``register`` wraps that method on its accelerator to read
    the norm it returns; gradients clipped by ``torch.nn.utils.clip_grad_norm_`` directly go unseen, and are
    priced as unclipped (a restore then gives up more than fidelity promises).

    ``save_state`` returns once the state is staged, and the save becomes durable in the background while
    training goes on; :meth:`wait`, ``load_state``, ``end_training`` and interpreter exit wait for it.  A
    ``save_state`` whose state (this process's models and optimizers) is at most ``wait_below`` bytes
    (default 8 MiB) returns done instead, as accelerate's own: committed and pruned, so nothing of it runs
    on once it returns (a test may delete ``project_dir`` right away).  Its flush is a few milliseconds of
    fsync there, and that wait counts in ``stall_ms``.  ``wait_below=0``: every save in the background.

    To save at the interval the failure rate calls for, see :class:`layerckpt.Interval`::

        interval = layerckpt.Interval(mtbf="8h", min_steps=20, max_steps=2000)
        for step, batch in enumerate(loader):
            ...                                   # forward, accelerator.backward, optimizer.step
            if interval.due(step):
                accelerator.save_state()
                interval.saved(plugin.last_saves)  # what this checkpoint cost training, measured
                accelerator.log(interval.metrics(), step=step)

    With ``Config(remote="s3://bucket/run", remote_options={...})`` the local store and folders are the
    staging place of a remote tier: model ``i``'s composites go to ``<remote>/model_<i>`` and every
    checkpoint folder's own files to ``<remote>/folders/<folder name>``, in the background.  When the
    folder ``load_state`` asks for (or, with automatic naming, any loadable folder) is missing locally, it
    is fetched from the remote, newest first, and the models restore from the remote tier.  One store per
    remote: save the folders of one run into one parent directory.

    A notice of preemption (``Config.preemption``: SIGTERM unless set otherwise, ``False`` for none; the
    handlers are installed at :meth:`register`, so a notice before the first ``save_state`` counts too) is
    agreed on by every rank at an optimizer step (each ``backward`` that syncs gradients is a step's boundary),
    and acted on where the next step starts: at ``accelerator.accumulate()`` or a prepared model's forward,
    once the script's bookkeeping of the agreed step (scheduler, counters, its own ``save_state``) is done.
    There the plugin calls ``save_state()``, as the script would (automatic checkpoint naming gives the folder;
    without it nothing is saved, and the log says so), unless the script saved that step already or the save
    cannot be durable before the deadline (``Config.grace_s``; the log says why), waits for the saves in
    flight, and stops the script: accelerate has no way to break its loop, so the plugin raises
    ``SystemExit(layerckpt.EXIT_PREEMPTED)`` (75) on every rank at once, ``preempted`` being True.  A restart's
    ``load_state()`` resumes at the agreed step.  A loop that steps several optimizers one after the other
    with forwards between them (a GAN) may reach that forward inside its iteration: turn preemption off there.
    """

    def __init__(self, config: Optional[Config] = None, *, layers: LayerSpec = None, log_stats: bool = True,
                 wait_below: int = WAIT_BELOW):
        self.config = with_preemption(as_config(config, env=ENV_CONFIG, only_config=True))
        refuse_keep_last(self.config)
        if isinstance(wait_below, bool) or not isinstance(wait_below, int) or wait_below < 0:
            raise ConfigError(f"LayerCheckpointPlugin(wait_below={wait_below!r}): a byte count >= 0 "
                              f"(0: every save_state flushes in the background)")
        self.wait_below = wait_below
        self.layers = layers
        self.log_stats = log_stats
        self._metrics = SaveMetrics()  # saves not logged yet, each with the step it was made at
        self._optimizer_steps = 0  # backward calls that synced gradients: the step a save is logged at
        self.accelerator = None
        self.enabled: Optional[bool] = None  # known once registered
        self.last_saves: List[PendingSave] = []  # this process's saves of the newest save_state, one per model
        self.last_restore: List[RestoreReport] = []  # of the newest load_state, one per model
        self._stores: Dict[str, _Store] = {}
        self._taken: Set[str] = set()  # stores a newer plugin of this process took over
        self._handles: list = []
        self._orig: Dict[str, Any] = {}
        #: the optimizer steps' losses and gradient clipping since the last save_state (see :meth:`_backward`)
        self._interval = SelectionLoss()
        self._synced = False  # the last backward synced gradients: its optimizer step ends at the next one
        self._active = False  # inside a save_state/load_state this plugin routes
        self._optimizers: List[Any] = []  # the accelerator's optimizers, set aside during that call
        self._pointer: Optional[folders.Pointer] = None
        self._paired: Optional[tuple] = None  # (identity of models and optimizers, their pairing)
        self._target: Optional[Tuple[str, _Store]] = None  # (folder, store) of the save_state in progress
        #: whether the script was stopped on a notice of preemption (see the class's docstring)
        self.preempted = False
        self._notice: Optional[Notice] = None  # from register(), with Config.preemption on
        self._due: Optional[float] = None  # the deadline of a notice agreed on, acted on at the next step's start
        self._saved_at = -1  # the optimizer step of the newest save_state
        self._hooked: Dict[int, Any] = {}  # id of a prepared model -> its forward pre-hook's handle

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike], **kwargs: Any) -> "LayerCheckpointPlugin":
        """A plugin whose Config is read from a YAML mapping of Config fields."""
        return cls(Config.from_yaml(path), **kwargs)

    # ------------------------------------------------------------ public

    def register(self, accelerator) -> "LayerCheckpointPlugin":
        """Install on ``accelerator``: from now on its save_state/load_state go through layerckpt."""
        global _disabled_logged
        from accelerate import Accelerator

        if not isinstance(accelerator, Accelerator):
            raise CheckpointError(f"register() needs an accelerate.Accelerator, got {type(accelerator).__name__}")
        if self.accelerator is not None:
            where = "this" if self.accelerator is accelerator else "another"
            raise CheckpointError(f"this LayerCheckpointPlugin is already registered on {where} Accelerator; "
                                  f"create one plugin per Accelerator")
        if not enabled_by_env():
            self.enabled = False
            if not _disabled_logged:
                _disabled_logged = True
                log.warning("layerckpt: %s=%s, the accelerate plugin is off: save_state/load_state are "
                            "accelerate's own", ENV_ENABLED, os.environ.get(ENV_ENABLED))
            return self
        if accelerator in _registered:
            raise CheckpointError("this Accelerator already has a LayerCheckpointPlugin registered; register one only")
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if kind in _UNSUPPORTED:
            hint = (" For FSDP2 (fully_shard) models, layerckpt.Checkpointer(dir, model, optimizer) on every rank "
                    "saves and restores each rank's shards" if kind == "FSDP" else "")
            raise CheckpointError(
                f"LayerCheckpointPlugin does not handle {_UNSUPPORTED[kind]} (distributed_type {kind}): their "
                f"state is saved by their own engine; do not register the plugin for this run.{hint}")
        self.accelerator = accelerator
        self.enabled = True
        _registered[accelerator] = self
        # Accelerate has hooks for models but none for optimizers: save_state writes optimizer.bin for every
        # entry of accelerator._optimizers, and load_state requires that file.  The accelerator's own
        # save_state/load_state are wrapped (on this instance only) to set that list aside for the call;
        # backward to keep the loss, which sets the scale of layerckpt's selection (Config.fidelity), and
        # clip_grad_norm_ to put it in the unit of the clipped gradients; and end_training to finish every save
        # first, as accelerate's own save_state is done when it returns (the script may then remove
        # project_dir, and no thread is left behind); accumulate as a step's start (a notice's save).
        for name, route in (("save_state", self._save_state), ("load_state", self._load_state),
                            ("backward", self._backward), ("clip_grad_norm_", self._clip_grad_norm),
                            ("end_training", self._end_training), ("accumulate", self._accumulate)):
            self._orig[name] = getattr(accelerator, name)
            setattr(accelerator, name, _routed(self._orig[name], route))
        self._handles = [accelerator.register_save_state_pre_hook(self._save_hook),
                         accelerator.register_load_state_pre_hook(self._load_hook)]
        self._notice = self._open_notice()
        return self

    def wait(self) -> None:
        """Block until every save_state so far is durable and committed; re-raises a flush error."""
        try:
            for st in self._stores.values():
                st.wait()
        finally:
            self._log_finished()

    def close(self) -> None:
        """Wait for in-flight flushes, free the buffers and give the accelerator its own methods back."""
        try:
            self.wait()
        finally:
            for st in self._stores.values():
                st.close()
            self._stores.clear()
            for h in self._handles + list(self._hooked.values()):
                h.remove()
            self._handles, self._hooked = [], {}
            notice, self._notice, self._due = self._notice, None, None
            if notice is not None:  # the signal handlers found are put back
                notice.close()
            acc = self.accelerator
            if acc is not None:
                for name in self._orig:
                    acc.__dict__.pop(name, None)
                _registered.pop(acc, None)
            self._orig = {}
            self.accelerator = None

    @property
    def stores(self) -> List[str]:
        """Store roots this plugin has written to, in first-use order."""
        return list(self._stores)

    def __repr__(self) -> str:
        state = {None: "not registered", False: "disabled", True: "registered"}[self.enabled]
        return f"LayerCheckpointPlugin({state}, fidelity={self.config.fidelity}, threshold={self.config.threshold}, stores={self.stores})"

    # ------------------------------------------------------------ save

    @contextlib.contextmanager
    def _routing(self):
        """For one save_state/load_state call: the hooks act, and the accelerator's optimizers are set
        aside (accelerate would write/read optimizer.bin for each), to be put back whatever happens."""
        acc = self.accelerator
        self._optimizers, acc._optimizers = acc._optimizers, []
        self._active = True
        try:
            yield
        finally:
            acc._optimizers, self._optimizers = self._optimizers, []
            self._active = False

    def _backward(self, loss, **kwargs: Any):
        """The loss of each micro-batch joins the optimizer step's (divided for gradient accumulation, as
        accelerate divides it); a step ends with the backward that synced gradients, and is closed at the next
        backward or save_state (clip_grad_norm_ comes between)."""
        acc = self.accelerator
        if self._synced:
            self._interval.step_done()
        if isinstance(loss, torch.Tensor):
            self._interval.add(loss.detach() / acc.gradient_accumulation_steps)
        self._synced = bool(acc.sync_gradients)
        if self._synced:
            self._optimizer_steps += 1
        self._log_finished()
        out = self._orig["backward"](loss, **kwargs)
        if self._synced and self._notice is not None:  # after it: a forward it recomputes is not a step's start
            self._boundary()
        return out

    def _clip_grad_norm(self, parameters: Any, max_norm: Any, *args: Any, **kwargs: Any):
        """The script's ``accelerator.clip_grad_norm_``: the norm it returns (before clipping) is recorded for
        the step under way; the optimizer gets the gradients scaled by ``min(1, max_norm / norm)``."""
        norm = self._orig["clip_grad_norm_"](parameters, max_norm, *args, **kwargs)
        self._interval.clipped(norm, max_norm)
        return norm

    def _log_finished(self) -> None:
        """The metrics of the save_states that committed since the last call, to the accelerator's trackers
        (main process; never waits for a flush)."""
        finished = self._metrics.finished()
        acc = self.accelerator
        if not self.log_stats or acc is None or not acc.is_main_process:
            return
        for step, metrics in finished:
            acc.log(metrics, step=step)

    def _end_training(self, *args: Any, **kwargs: Any):
        end_training = self._orig["end_training"]
        self.close()  # hands the accelerator its own methods back, so take ours first
        return end_training(*args, **kwargs)

    def _save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any):
        self._target = None
        with self._routing():
            out = self._orig["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)
        target, self._target = self._target, None
        if target is not None:
            # Staged last, once accelerate's own files are written: the flush that starts here then
            # overlaps training, not the rest of save_state (both want the interpreter).
            self._persist(*target)
        return out

    def _save_hook(self, models: List[torch.nn.Module], weights: List[dict], output_dir: str) -> None:
        """Runs inside save_state once the folder exists (and rotation is done), before accelerate writes:
        checks what will be saved where, so that a refusal comes before any file."""
        if not self._active:
            return
        weights.clear()  # no model.safetensors: the models go to layerckpt
        acc = self.accelerator
        pairs = self._pairs(models)
        folder = os.path.abspath(output_dir)
        automatic = acc.project_configuration.automatic_checkpoint_naming
        root, folders_dir = folders.layout(folder, acc.project_dir, automatic)
        if folders.is_inside(root, folder) or folders.is_inside(folder, root):
            raise CheckpointError(f"save_state({output_dir!r}) would put the checkpoint folder and its layerckpt "
                                  f"store {root} inside one another; choose another folder name")
        if root in self._taken:
            raise CheckpointError(
                f"save_state({output_dir!r}): a newer LayerCheckpointPlugin of this process (on another Accelerator) "
                f"took over the layerckpt store {root}; this plugin's saves there had ended and it closed them. "
                f"Save through the newer Accelerator")
        st = self._stores.get(root) or self._open(root, folders_dir, pairs)
        shape = _with_optimizer(pairs)
        if shape != st.optimizers:
            raise CheckpointError(
                f"the prepared models/optimizers changed since the first save_state into {root} "
                f"(models with an optimizer then {st.optimizers}, now {shape}); use a new folder for the new setup")
        self._target = (folder, st)

    def _persist(self, folder: str, st: "_Store") -> None:
        """Stage every model (and optimizer) into the store, point the folder at the composite, prune."""
        acc = self.accelerator
        step = st.steps.step()
        st.steps.saved(step)
        token = f"{st.run_id}-{step}"
        extra = {"accelerate": {"token": token, "folder": os.path.basename(folder), "accelerator_step": acc.step}}
        self._log_finished()
        loss = self._selection_loss()
        self.last_saves = [ck.save(step, extra=extra, loss=loss) for ck in st.checkpointers]
        self._saved_at = self._optimizer_steps
        self._metrics.add(self.last_saves, step=self._optimizer_steps)
        if acc.is_main_process:
            st.live[folders.write_pointer(folder, st.root, step, token, st.optimizers)] = step
            # rotation (or the user) may have deleted folders since: their composites can go
            st.live = {path: s for path, s in st.live.items() if os.path.exists(path)}
            st.pruner.submit(st.model_roots, set(st.live.values()), below=step)
            if st.uploads is not None:
                st.uploads.submit(folder)
        if _state_bytes(st.checkpointers) <= self.wait_below:
            self._finish(st)

    def _selection_loss(self) -> Optional[torch.Tensor]:
        """The loss a save's selection is scaled by (its allowance is ``Config.fidelity`` times it): the mean
        training loss of the optimizer steps since the last save_state, times the share of their squared
        gradient norms the script's ``accelerator.clip_grad_norm_`` kept (1 where it clips nothing or is not
        called), see :class:`layerckpt.adapters.SelectionLoss`.  Without a step since: the last save's."""
        if self._synced:
            self._interval.step_done()
            self._synced = False
        return self._interval.take()

    def _finish(self, st: "_Store") -> None:
        """A small save_state returns done, as accelerate's own: committed, pruned, nothing left running that
        could touch project_dir (a test may delete it right away).  What that wait took counts as save_state's."""
        t0 = time.perf_counter()
        try:
            st.wait_flushes()
            st.pruner.drain()
        finally:
            waited = time.perf_counter() - t0
            for p in self.last_saves:
                p.stall_s += waited
        self._log_finished()

    def _open(self, root: str, folders_dir: str, pairs) -> _Store:
        """The store's Checkpointers; collective under torch.distributed, as save_state is called on every rank."""
        # retention follows the folders (see folders.prune); notices reach the plugin's own handlers, the
        # Checkpointers keep theirs by call only, for can_save_by()
        cfg = self.config.replace(keep_last=0, preemption=[] if self._notice is not None else False)
        if cfg.remote is not None and self._stores:
            raise CheckpointError(
                f"save_state({os.path.dirname(folders_dir)!r}...) would open a second layerckpt store, {root}, on "
                f"the remote tier {cfg.remote} that the store {next(iter(self._stores))} uses; save the folders of "
                f"one run into one parent directory, or give this one a plugin with its own Config.remote")
        hold(root, self._taken_over)  # an older plugin of this process on root closes its Checkpointers first
        self._taken.discard(root)
        cks = [Checkpointer(os.path.join(root, folders.model_dir(i)), model, opt, config=remote.model_config(cfg, i),
                            layers=self.layers)
               for i, (model, opt) in enumerate(pairs)]
        live = folders.referenced(root, folders_dir)  # folders of earlier runs: kept while they exist
        # Steps name manifests: never reuse one a committed composite (local or remote) or a pointer holds
        first = max(folders.newest_step(ck.dirpath for ck in cks), max(live.values(), default=-1),
                    remote.newest_step(cfg, len(cks))) + 1
        start = [first, uuid.uuid4().hex[:12]]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(start, from_process=0)  # every rank saves the same steps
        uploads = None
        if cfg.remote is not None and self.accelerator.is_main_process:
            pc = self.accelerator.project_configuration  # total_limit rotates automatic naming's folders only
            limit = pc.total_limit if os.path.normpath(folders_dir) == self._auto_dir() else None
            uploads = remote.FolderUploads(cfg, len(cks), limit)
        st = _Store(root, cks, _with_optimizer(pairs), start[0], start[1], live, uploads)
        self._stores[root] = st
        return st

    def _taken_over(self, root: str) -> None:
        """A newer plugin of this process opens the store ``root``: close ours there (its saves end first)."""
        self._taken.add(root)
        st = self._stores.pop(root, None)
        if st is not None:
            try:
                st.wait()
            except CheckpointError as e:  # each PendingSave keeps its outcome
                log.error("layerckpt: %s", e)
            close_quietly(st.checkpointers, what="a save_state")
            if st.uploads is not None:
                st.uploads.close()

    # ------------------------------------------------------------ preemption

    def _open_notice(self) -> Optional[Notice]:
        """``Config.preemption``: the signal handlers and (several ranks) the group the ranks agree over, the
        plugin's own from ``register()`` on: its stores' Checkpointers open only at their first save_state."""
        return open_notice(self.config.preemption, self.config.grace_s)

    def _boundary(self) -> None:
        """A backward that synced gradients, on every rank alike: a step's boundary, where the ranks exchange
        what they were told (without blocking); a notice agreed on is acted on where the next step starts, once
        this one's optimizer step and the script's bookkeeping are done (:meth:`_step_start`)."""
        for model in self.accelerator._models:  # prepared since the last boundary
            if id(model) not in self._hooked:
                self._hooked[id(model)] = model.register_forward_pre_hook(self._forward_pre)
        deadline = self._notice.boundary(self._optimizer_steps)
        if deadline is not None:
            self._due = deadline

    def _accumulate(self, *models: Any):
        self._step_start()  # before accelerate counts the micro-batch (accelerator.step is saved)
        return self._orig["accumulate"](*models)

    def _forward_pre(self, module: Any, args: Any) -> None:
        self._step_start()

    def _step_start(self) -> None:
        if self._due is not None:
            deadline, self._due = self._due, None
            self._stop_on_notice(deadline)

    def _stop_on_notice(self, deadline: float) -> None:
        """Every rank agreed on a notice, and the next step starts: save the agreed step as the script's
        ``save_state()`` would (unless it saved that step already) where it can be durable in time, wait for
        the saves in flight until the deadline, and stop the script on every rank at once."""
        acc = self.accelerator
        self.preempted = True
        if self._saved_at != self._optimizer_steps and self._can_save_by(deadline):
            acc.save_state()
        for st in list(self._stores.values()):
            for ck in st.checkpointers:
                ck.durable_by(deadline)
            ended, error = wait_until(st.wait, deadline)  # and the folders' copies to the remote tier
            if error is not None or not ended:
                log.warning("layerckpt: preemption: the saves into %s did not all end before the deadline%s",
                            st.root, f": {error}" if error is not None else "")
        self._log_finished()
        notice, self._notice = self._notice, None
        notice.close()  # the handlers found are put back; its group goes before the interpreter's exit
        if acc.num_processes > 1:
            acc.wait_for_everyone()  # leave together: a rank tearing gloo down while a peer still talks aborts it
        raise SystemExit(EXIT_PREEMPTED)

    def _can_save_by(self, deadline: float) -> bool:
        """Whether ``save_state()`` saves at a notice (every rank: collective): each of its store's Checkpointers
        says whether its newest save's time fits the time left (and logs why not); before the first save there
        is nothing to go by, and it is tried."""
        if self._auto_dir() is None:
            if self.accelerator.is_main_process:
                log.warning("layerckpt: preemption: save_state() has no folder to save into without "
                            "ProjectConfiguration(automatic_checkpoint_naming=True): the step of the notice is not "
                            "saved; a restart resumes from the newest folder the script saved")
            return False
        st = self._stores.get(folders.auto_store(self.accelerator.project_dir))
        if st is None:
            return True
        step = st.steps.step()
        return all([ck.can_save_by(deadline, step) for ck in st.checkpointers])  # a list: every one asked

    # ------------------------------------------------------------ load

    def _load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any):
        self.last_restore = []
        self._interval, self._synced = SelectionLoss(), False  # the steps before the load are not the run's
        if load_kwargs is not None:  # accelerate before 1.10 takes no load_kwargs: passed on only where given
            kwargs["load_kwargs"] = load_kwargs
        folder = self._pick_folder(input_dir)
        if folder is None or not os.path.isdir(folder):
            return self._orig["load_state"](input_dir, **kwargs)  # accelerate's own error
        ptr = folders.read_pointer(folder)
        if ptr is None:  # written by plain accelerate (or before the plugin was registered)
            out = self._orig["load_state"](folder, **kwargs)
        else:
            self._check_loadable(ptr)  # before anything is loaded
            self._pointer = ptr
            try:
                with self._routing():
                    out = self._orig["load_state"](folder, **kwargs)
            finally:
                self._pointer = None
        self._next_iteration(folder)
        return out

    def _pick_folder(self, input_dir: Optional[str]) -> Optional[str]:
        """The folder to load: ``input_dir`` (fetched from the remote tier when it is not here), else under
        automatic naming the newest loadable one, local or remote: the remote's wins when its step is higher
        (steps grow across machines, see ``_open``), and is fetched into ``checkpoints/``."""
        auto = self._auto_dir()
        if input_dir is not None:
            folder = os.path.expanduser(os.fspath(input_dir))
            if self.config.remote is not None and not os.path.isdir(folder):
                return self._fetch(folder, auto) or folder
            return folder
        if auto is None:
            return None
        _wait_for_flushes()  # a folder of this process whose composite is still flushing is loadable
        folder = folders.newest_loadable(auto)
        if self.config.remote is None:
            return folder
        return self._fetch(None, auto, newer_than=folders.loadable_step(folder)) or folder

    def _check_loadable(self, ptr: folders.Pointer) -> None:
        """Every model's composite of ``ptr`` is committed, in the local store or else on the remote tier."""
        for plugin in [self, *_registered.values()]:  # saved by this process: a flush may be in flight
            st = plugin._stores.get(os.path.normpath(ptr.store))
            if st is not None:
                st.wait_flushes()
        try:
            folders.check_committed(ptr)
        except CheckpointError:
            # the local store lost, or never given this composite: the remote tier's is read.  A local
            # manifest of that step that is another composite (token) is an error, never shadowed
            here = [i for i in range(len(ptr.optimizers))
                    if os.path.exists(store.manifest_path(ptr.model_root(i), ptr.step))]
            if self.config.remote is None or here or not remote.committed(self.config, ptr):
                raise

    def _fetch(self, folder: Optional[str], auto: Optional[str], newer_than: int = -1) -> Optional[str]:
        """The checkpoint folder from the remote tier, downloaded where it would be: ``folder`` (an explicit
        load_state(dir)), or the newest loadable one into ``auto`` when its step is above ``newer_than``;
        None when there is none.  The main process downloads; every process gets its path (the folders are
        shared, as the plugin writes them)."""
        acc = self.accelerator
        found = [None]
        if acc.is_main_process:
            if folder is not None:
                where = os.path.abspath(folder)
                found[0] = remote.fetch_folder(self.config, os.path.basename(where), os.path.dirname(where))
            else:
                found[0] = remote.fetch_folder(self.config, None, auto, newer_than)
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(found, from_process=0)
        return found[0]

    def _load_hook(self, models: List[torch.nn.Module], input_dir: str) -> None:
        """Runs inside load_state before accelerate loads schedulers, RNG, samplers and registered objects."""
        if not self._active:
            return
        ptr = self._pointer
        pairs = self._pairs(models)
        shape = _with_optimizer(pairs)
        if shape != ptr.optimizers:
            raise CheckpointMismatchError(
                f"accelerator (models with an optimizer {shape}; the checkpoint {input_dir} has {ptr.optimizers})",
                mismatched=["number of prepared models or optimizers"])
        models.clear()  # accelerate loads no weights: layerckpt does, here
        cfg = self.config.replace(restore_rng=False)  # accelerate restores RNG from its random_states_*.pkl
        self.last_restore = [restore(ptr.model_root(i), model, opt, step=ptr.step, config=remote.model_config(cfg, i))
                             for i, (model, opt) in enumerate(pairs)]
        self._adopt(ptr, pairs)

    def _adopt(self, ptr: folders.Pointer, pairs) -> None:
        """With automatic naming the next saves go to the store just restored from: open it now (load_state
        runs on every rank, like save_state) and continue its composite, so the next save is selective
        rather than full.  Explicit folders may go anywhere: their first save is full."""
        base = self._auto_dir()
        if base is None:
            return
        root = folders.auto_store(self.accelerator.project_dir)
        if os.path.normpath(ptr.store) != os.path.normpath(root) or root in self._stores:
            return
        st = self._open(root, base, pairs)
        for ck, report in zip(st.checkpointers, self.last_restore):
            if not store.is_url(report.manifest):  # restored from the remote tier: the next save is full
                ck.adopt(report)

    def _next_iteration(self, folder: str) -> None:
        """Accelerate never moves project_configuration.iteration on load: the next automatic save would
        write checkpoint_0 again (or fail because it exists).  Continue after the newest existing folder."""
        base = self._auto_dir()
        if base is None:
            return
        nums = [n for n, _ in folders.numbered(base)] + remote.folder_numbers(self.config)  # never reuse a name
        if folders.is_inside(folder, base) and folders.folder_number(folder) is not None:
            nums.append(folders.folder_number(folder))
        pc = self.accelerator.project_configuration
        pc.iteration = max([pc.iteration] + [n + 1 for n in nums])

    def _auto_dir(self) -> Optional[str]:
        """``<project_dir>/checkpoints`` under automatic checkpoint naming (where save_state() writes and
        load_state() reads), else None."""
        acc = self.accelerator
        if not acc.project_configuration.automatic_checkpoint_naming or acc.project_dir is None:
            return None
        return folders.auto_dir(acc.project_dir)

    # ------------------------------------------------------------ models and optimizers

    def _pairs(self, models: List[torch.nn.Module]) -> List[Tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]]:
        """Each prepared model (unwrapped) with the optimizer that owns its parameters, or None."""
        if not models:
            raise CheckpointError("save_state/load_state with LayerCheckpointPlugin need a model passed through "
                                  "accelerator.prepare; none is prepared")
        key = (tuple(map(id, models)),
               tuple((id(o), tuple(len(g["params"]) for g in o.param_groups)) for o in self._optimizers))
        if self._paired is not None and self._paired[0] == key:
            return self._paired[1]
        pairs = self._pair(models)
        self._paired = (key, pairs)
        return pairs

    def _pair(self, models: List[torch.nn.Module]) -> List[Tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]]:
        plain = [self.accelerator.unwrap_model(m, keep_torch_compile=False) for m in models]
        return list(zip(plain, pair_optimizers(plain, self._optimizers)))
