"""Checkpointer: the save path, top to bottom.

On the caller's thread: gather (``write/_gather``) -> track drift and plan what
to persist (``select/_plan``, deciding with ``select/_policy`` on
``select/_track``'s drift) -> lay out the file (``format/_layout``).  Then stage
into pooled buffers (``write/_stage``): on a background thread under lazy
staging (``write/_lazy``: the optimizer's step waits for it), else on the
caller's.  On the flusher thread: write + checksum + fdatasync
(``write/_flush``) -> agree across ranks and commit the manifest
(``write/_commit``) -> the commit listeners: the tiers (``tiers/_tiers``), then
retention (``write/_retain``).

What the Checkpointer holds for its life (the store's lock, the tiers, the
backend, the pool) is opened and freed by ``_session``.  One open writer per
store: another process is refused (``format/_store.WriterLock``); a newer
Checkpointer of this process on the same store takes over from the older one
once its saves in flight have ended (``_registry``).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import _dist, _faults, _registry, _session
from .config import Config
from .errors import CheckpointError, ConfigError
from .format import _sign, _store
from .format._codec import Entries
from .format._layout import LayoutCache
from .format._manifest import Manifest, RowBlocks, load_manifest
from .read._pretrained import PretrainedFiles
from .select import _cost, _policy
from .select._blocks import split, table_names
from .select._layers import LayerSpec
from .select._plan import Selector
from .write import _retain
from .write._encwrite import threads
from .write._flush import FlushJob, Flusher, FlushThread, PendingSave
from .write._gather import gather, shard_entries
from .write._lazy import split_later, start_copy
from .write._stage import LazyStager


log = logging.getLogger("layerckpt")


class Checkpointer:
    """Saves ``model`` (and ``optimizer``) into ``dirpath``.

    ``layers`` overrides the automatic grouping: a callable mapping a state_dict
    name to its layer, or a dict of glob patterns to layer names (first match).

    ``save(step)`` decides what to write and returns a :class:`PendingSave`; the
    state is copied into pooled host buffers in the background while training
    goes on (``Config.lazy_staging``: the optimizer's next step waits for the
    copies; without an optimizer, or with it off, before ``save`` returns), and a
    background thread writes the data, makes it durable and commits the manifest.

    Under torch.distributed every rank constructs its Checkpointer (collectively)
    and calls ``save`` with the same steps; each persisted layer is written by
    one rank.  ``distributed=False`` makes a single-process Checkpointer even
    there: one rank writes everything, with no collective.
    """

    def __init__(
        self,
        dirpath: Union[str, os.PathLike],
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        config: Optional[Config] = None,
        *,
        layers: LayerSpec = None,
        distributed: bool = True,
    ):
        self.config = _checked(model, optimizer, config)
        # their headers parsed now, before anything is opened: a path that is not one is a ConfigError here
        pretrained = PretrainedFiles(self.config.pretrained) if self.config.pretrained is not None else None
        self._charge_now = [1.0]  # the newest save's share of the encoder's CPU charged to training (_cost.charge)
        self.dirpath = _store.local_path(dirpath)
        self.model = model
        self.optimizer = optimizer
        # an older Checkpointer of this process on this store: its saves in flight end, then it closes
        _registry.take_over(self.dirpath)
        # every rank builds its Checkpointer together: the group and the cleanup are collective
        self.group = _dist.Group(enabled=distributed)
        self.rank = self.group.rank
        thread = FlushThread()
        self._retention = _retain.Retention(self.dirpath, self.config.keep_last, later=thread.then)
        self._writer, self._tiers, self.placement = _session.open_store(self.dirpath, self.config, self.group,
                                                                        self._retention)
        self._seq, self.backend, self.pool = _session.start_io(self.dirpath, self.config, self._writer, self._tiers,
                                                               self.group, self.placement.split)
        self._flusher = Flusher(self.backend, self.pool, self.config, self.dirpath, self.group,
                                listeners=self._listeners(), thread=thread)
        self._flusher.committers = frozenset(self.placement.owners)
        self._replicas, self._replica_group = _session.open_replicas(self.dirpath, self.config, self.placement,
                                                                     self._retention)
        self._flusher.listeners = tuple(self._listeners())
        self._notice = _session.open_notice(self.config, self.group)  # Config.preemption (``preempt``)
        self._saves: List[PendingSave] = []  # the newest few, whatever became of them (for a notice's estimate)
        if self._tiers is not None:
            if self._flusher.cost is not None:  # encoding='auto': a remote gets encoded what pays there
                box = self._charge_now  # not self: the tier must not keep the Checkpointer alive
                self._tiers.attach(self._flusher.cost, lambda: box[0])
            self._flusher.staged_copy = self._tiers.staged_copy
            self._tiers.catch_up()
        self._pending: List[PendingSave] = []
        self._closed = False
        self._replaced = False
        self._lock = threading.Lock()  # one save() at a time
        self._training_threads = torch.get_num_threads()
        self._stager = LazyStager()
        self._lazy, hook = self._guard_optimizer()
        self._release = self._arrange_release(hook)
        self._layout_cache = LayoutCache()
        self.selector = Selector(model, self.config, layers, self.group)
        if pretrained is not None and self.group.world > 1:
            log.warning("layerckpt: Config.pretrained is used by one process only; with %d ranks every tensor is "
                        "written", self.group.world)
        elif pretrained is not None:
            self.selector.pretrained = pretrained
            # the frozen parameters' pretrained twins fingerprinted in the background from now, not in the first save
            pretrained.warm({(str(p.dtype), tuple(p.shape)) for p in model.parameters() if not p.requires_grad})
            weakref.finalize(self, pretrained.stop, False)

    # ------------------------------------------------------------ opening (the store, the I/O: ``_session``)

    def _listeners(self) -> list:
        """What runs after each commit, in order (each store's owner: rank 0, or on node-local directories each
        node's lowest rank): the tiers queue their copies, then the local retention keeps what they copy from,
        the pinned composites and the ``keep_last`` newest."""
        if not self.placement.is_owner:
            return []
        replicas = getattr(self, "_replicas", None)
        return ([self._tiers] if self._tiers is not None else []) + ([replicas] if replicas is not None else []) + [
            self._retention]

    def _guard_optimizer(self) -> Tuple[bool, Any]:
        """Lazy staging: the optimizer's step waits for the copies of a save still being staged."""
        if self.optimizer is None or not self.config.lazy_staging:
            return False, None
        return True, self.optimizer.register_step_pre_hook(self._stager.guard)

    def _arrange_release(self, hook: Any) -> "weakref.finalize":
        """What frees the thread, ring, pool, lock and hook: ``close()``, the Checkpointer being dropped
        (the flusher finishes what it has first), or a newer Checkpointer of this process on this store
        (after this one's saves in flight end).  A flush in flight also completes before a normal exit."""
        ref = weakref.ref(self)
        owner = _registry.Owner(self.dirpath, functools.partial(_retire, ref))
        release = weakref.finalize(self, _session.shutdown, self._flusher, self.backend, self.pool, self._writer,
                                   self._tiers, hook, owner, self.group, self._stager, self._replicas,
                                   self._replica_group)
        owner.claim()
        # It must run before thread pools refuse new work at shutdown, hence threading's exit hooks (run
        # newest first, before concurrent.futures' own) where this Python has them.
        getattr(threading, "_register_atexit", atexit.register)(
            lambda: ref() is not None and ref()._finish_at_exit())
        return release

    # ------------------------------------------------------------ public

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None, *,
             loss: Union[None, float, torch.Tensor] = None, name: Optional[str] = None) -> PendingSave:
        """Stage the state of ``step``; returns once training may go on.

        ``loss``: the current training loss (a float or a one-element tensor).  It sets the scale of
        the default selection rule (``Config.fidelity``): pass it and the layers that barely matter
        are skipped; without it a conservative rule writes more.  ``name``: recorded in the manifest
        (``layerckpt inspect`` shows it), e.g. a templated file name of the framework's."""
        self._check_open("save()")
        _check_save_args(step, extra, name)
        loss = _as_loss(loss)
        with self._lock:
            self._check_open("save()")  # a newer Checkpointer may have taken over meanwhile
            self._stager.wait()  # one save's copies at a time
            self._raise_unreported()
            # a selective save composes on the one before it: in one process on its plan, completed at the
            # commit; across ranks the ranks agree on the last committed one, which must be finished
            self._throttle(self.config.max_inflight - 1 if self.selector.full or self.group.world == 1 else 0)
            self._raise_unreported()  # the flush just waited for may have failed
            self._training_threads = torch.get_num_threads()  # the training's, before _serial sets one
            with _serial():
                pending = self._save(step, extra, loss, name)
            self._saves = self._saves[-3:] + [pending]
            return pending

    def keep(self, manifests: Iterable[Union[str, "os.PathLike[str]"]]) -> None:
        """Composites (manifest paths of this directory) that retention keeps besides the
        ``keep_last`` newest, e.g. the best by a monitored metric; replaces the previous set.  One
        dropped from the set goes at the next retention, after the next commit."""
        self._check_replaced("keep()")
        self._retention.pin(os.path.basename(os.fspath(m)) for m in manifests)

    def adopt(self, restored: Any) -> None:
        """Continue from a checkpoint of this directory that was just restored into the model (a
        :class:`RestoreReport`, a :class:`LoadedCheckpoint` or its manifest path): the next save is
        then selective against it instead of full.  Call it before the weights change again."""
        self._check_replaced("adopt()")
        path = restored if isinstance(restored, (str, os.PathLike)) else getattr(restored, "manifest", None)
        if path is None:
            raise CheckpointError(f"adopt() takes a RestoreReport, a LoadedCheckpoint or a manifest path, "
                                  f"got {type(restored).__name__}")
        root, step = _store.locate(path)
        if os.path.abspath(root) != self.dirpath:
            raise CheckpointError(f"adopt(): {path} belongs to {root}, not to this Checkpointer's {self.dirpath}")
        mpath, key = _store.resolve(root, step), _sign.key_of(self.config)
        m = load_manifest(mpath) if key is None else _sign.load_signed(root, mpath, key, files=False)
        with self._lock:
            self._check_replaced("adopt()")
            if self._pending or self.selector.composite is not None:
                raise CheckpointError("adopt() must come before the first save() of this Checkpointer")
            self._stager.wait()
            entries, _ = self._gather(None)
            self.selector.adopt(m, entries)

    def check(self) -> None:
        """Raise the first background failure not yet reported, without waiting for flushes in flight."""
        self._raise_unreported()

    def wait(self) -> None:
        """Wait for every flush in flight; raises the first unreported error.  After a newer Checkpointer
        on the same directory took over, ``wait()``, ``check()`` and ``close()`` still report this one's
        saves (they had all ended); ``save()``, ``keep()`` and ``adopt()`` raise."""
        self._throttle(0)
        self._flusher.settle()  # and the cost model's probes of the saves that ended
        self._raise_unreported()
        if self._tiers is not None:  # and every copy to the memory and remote tiers
            self._tiers.wait()
        if self._replicas is not None:  # and the partners' copies of this node's part
            self._replicas.wait()

    # ------------------------------------------------------------ preemption (``preempt``)

    def preempt(self, seconds: Optional[float] = None) -> None:
        """Tell a notice of preemption this process learned of (a cloud's metadata notice): it ends ``seconds``
        from now (``Config.grace_s``, else 30 s, where not given).  Thread-safe; acted on at the next step
        boundary (:meth:`preempted`).  Needs ``Config.preemption`` on (``[]``: notices by this call only)."""
        if self._notice is None:
            raise ConfigError("preempt() needs Config(preemption=...) on: True or a signal name to save on that "
                              "signal, [] to save on notices told by preempt() only")
        self._notice.tell(seconds)

    def preempted(self, step: int, extra: Optional[Dict[str, Any]] = None) -> bool:
        """Ask at every step boundary, on every rank, once the optimizer stepped (the state is that of ``step``):
        True once a notice (a ``Config.preemption`` signal, or :meth:`preempt`, on any rank) was agreed on by
        every rank at this step, and ``step`` saved and committed before the deadline where it could be (else
        the newest committed composite is what a restart resumes from, and the log says why).  Then stop
        training: ``raise SystemExit(layerckpt.EXIT_PREEMPTED)``.  Cheap otherwise: no blocking collective.
        ``extra``: what ``save()`` would be given at this step (a data loader's position, ...)."""
        deadline = self.notice(step)
        if deadline is None:
            return self._notice is not None and self._notice.agreed is not None
        if self.can_save_by(deadline, step):
            self.save(step, extra)
        self.durable_by(deadline)
        return True

    def notice(self, step: int) -> Optional[float]:
        """The step-boundary check (every rank, every step): the deadline (``time.time()``) of a notice every rank
        agreed to act on at this ``step``, once; else None.  An adapter saves through its framework then, where
        :meth:`can_save_by` says so, and waits with :meth:`durable_by`."""
        return None if self._notice is None else self._notice.boundary(step)

    def can_save_by(self, deadline: float, step: int) -> bool:
        """At the agreed step, on every rank (collective): whether to save ``step`` now, that is, it was not saved
        yet and every rank's newest save went from ``save()`` to its commit in the time left (logged where not)."""
        from .preempt import FIT, estimate_s

        need, left = estimate_s(self._saves), deadline - time.time()
        saved = bool(self._saves) and self._saves[-1].step == step
        fits = self._notice.all_can(need is None or need <= FIT * left)
        if not fits and self.rank == 0:
            newest = next((p.step for p in reversed(self._saves) if p.done() and p.error is None), None)
            log.warning("layerckpt: preemption: %.1f s left before the deadline, and a save takes about %.1f s on the "
                        "slowest rank: step %d is not saved; a restart resumes from the newest committed "
                        "composite%s", left, need or 0.0, step, f" (step {newest})" if newest is not None else "")
        return fits and not saved

    def durable_by(self, deadline: float) -> bool:
        """Wait for the saves in flight to commit and for the tiers to copy them, until ``deadline``; whether all
        of it ended in time (a failure is logged, never raised: the process is about to be killed)."""
        from .preempt import wait_until

        ended, error = wait_until(self.wait, deadline)
        if error is not None:
            log.error("layerckpt: preemption: the last save did not complete: %s", error)
        elif not ended:
            log.warning("layerckpt: preemption: the deadline came before every copy was durable")
        else:
            log.warning("layerckpt: preemption: step %s committed (%.1f s before the deadline)",
                        self._saves[-1].step if self._saves else "-", deadline - time.time())
        return ended and error is None

    @property
    def replicas(self) -> Dict[str, Any]:
        """What the peer replication of this node's part did (``Config.replicas``, node-local directories, the
        node's lowest rank): rounds, bytes sent, bytes held of other nodes' parts, seconds from each commit to
        its replicas; {} elsewhere."""
        from .tiers._replica import stats

        return stats(self._replicas)

    def close(self, wait: bool = True) -> None:
        """Wait for in-flight work, then free the thread, the buffers, the ring and the store's lock.

        ``wait=False`` returns at once: no more saves, and the flusher frees all that itself after its
        last one.  Errors stay with each :class:`PendingSave`; a later ``close()`` waits and raises them."""
        if self.selector.pretrained is not None:
            self.selector.pretrained.stop(wait)
        if self._notice is not None:  # the signal handlers found are put back
            self._notice.close()
        if wait:
            try:
                self.wait()
            finally:
                self._closed = True
                self._release()
        elif not self._closed:
            self._closed = True
            self._flusher.then(self._release)

    def _finish_at_exit(self) -> None:
        if self._closed:
            return
        for p in list(self._pending):
            p._done.wait()
            if p.error is not None and not p._reported:
                log.error("layerckpt: the checkpoint of step %d was not committed: %s", p.step, p.error)
        if self._tiers is not None:
            try:
                self._tiers.wait()
            except CheckpointError as e:
                log.error("layerckpt: %s", e)
        if self._replicas is not None:  # the partners' copies of the last commit (bounded by the group's timeout)
            self._replicas.wait()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:  # do not hide the exception in flight behind a flush error
            try:
                self.close()
            except CheckpointError as e:
                log.error("layerckpt: %s", e)

    # ------------------------------------------------------------ internals

    def _replace(self) -> None:
        """A newer Checkpointer of this process takes over this one's store: no save starts any more, the
        copies of one being staged end (the optimizer hook still guards them), then everything is freed
        once the saves in flight have ended; each PendingSave keeps its outcome."""
        with self._lock:
            self._replaced = True
            self._closed = True
            self._stager.wait()
        _faults.point("takeover.begun")
        self._release()

    def _check_replaced(self, what: str) -> None:
        if self._replaced:
            raise CheckpointError(
                f"{what} on a Checkpointer of {self.dirpath} that was replaced by a newer Checkpointer on the same "
                f"directory in this process; its saves in flight ended first (each PendingSave holds its outcome) "
                f"and it is closed: use the newer one")

    def _check_open(self, what: str) -> None:
        self._check_replaced(what)
        if self._closed:
            raise CheckpointError(f"{what} on a closed Checkpointer; create a new one")

    def _throttle(self, allowed: int) -> None:
        running = [p for p in self._pending if not p.done()]
        if len(running) > allowed:
            self._flusher.hurry()  # training waits for it now: what is not encoded yet goes to disk raw
        for p in running[: max(0, len(running) - allowed)]:
            p._done.wait()

    def _raise_unreported(self) -> None:
        """Raise a background failure nobody has seen through wait() yet (once)."""
        done = [p for p in self._pending if p.done()]
        self._pending = [p for p in self._pending if not p.done()]
        for p in done:
            if p.error is not None and not p._reported:
                p._reported = True
                raise p.error

    def _gather(self, extra: Optional[Dict[str, Any]]) -> Tuple[Entries, Dict[str, Any]]:
        """What a save holds, embedding tables cut into row blocks (selective saves only)."""
        entries, meta = gather(self.model, self.optimizer, extra, self.rank)
        self.selector.requires_grad = meta.pop("requires_grad")
        self.selector.grad_bias = meta.pop("grad_bias")
        entries, self.selector.shards = shard_entries(entries)  # FSDP2: this rank's shards only
        tables = {} if self.selector.full else table_names(self.model, self.config.row_block_bytes)
        entries, blocks = split(entries, tables)
        meta["blocks"] = {**blocks, **{k: b for k, b in self.selector.shards.items() if isinstance(b, RowBlocks)}}
        meta["boxes"] = {k: b for k, b in self.selector.shards.items() if not isinstance(b, RowBlocks)}
        return entries, meta

    def _save(self, step: int, extra: Optional[Dict[str, Any]], loss: Optional[float],
              name: Optional[str]) -> PendingSave:
        t0 = time.perf_counter()
        entries, meta = self._gather(extra)
        fname = self._fresh_name(step)
        loss = self._agreed_loss(loss)
        later = self._lazy and split_later(entries, self.model)
        plan = self.selector.plan(step, fname, entries, self.rank, self.group.world, loss)
        layout = self._layout_cache.plan(plan.write)
        manifest = self._manifest(step, plan, meta, loss, name)
        pending = PendingSave(step, os.path.join(self.dirpath, _store.DATA_DIR, fname))
        if self._tiers is not None:  # its work ends with the tiers' copies of it (PendingSave.settled)
            pending._copying = self._tiers.busy
        job = self._submit(pending, plan, layout, fname, manifest, t0)
        pending.phases["plan"] = time.perf_counter() - t0
        start_copy(job, self.pool, self._stager, later or None, step)
        _tell(pending, plan, layout, t0)
        return pending

    def _agreed_loss(self, loss: Optional[float]) -> Optional[float]:
        """Every rank must take the same decisions: the ranks' mean loss (or none if one lacks it)."""
        if self.group.world > 1 and not self.selector.full:
            losses = self.group.exchange(loss)
            loss = None if None in losses else sum(losses) / len(losses)
        return loss

    def _manifest(self, step: int, plan, meta: Dict[str, Any], loss: Optional[float],
                  name: Optional[str]) -> Manifest:
        """The commit record of this save, as far as it is known before the flush."""
        self._seq += 1
        full = self.selector.full
        return Manifest(
            step=step, seq=self._seq, chain=plan.chain, world_size=self.group.world, created=time.time(),
            config=self.config.recorded(), files=dict(plan.files), tensors=dict(plan.carried), layers=plan.layers,
            model=meta["model"], optimizer=meta["optimizer"], rng=meta["rng"], extra=meta["extra"],
            cost=None if full else plan.cost, progress=None if full else plan.progress,
            loss=loss, name=name, blocks=meta["blocks"] or None, boxes=meta["boxes"] or None,
            pretrained=dict(plan.pretrained) or None)

    def _submit(self, pending: PendingSave, plan, layout, fname: str, manifest: Manifest, t0: float) -> FlushJob:
        """Queue the flush; it writes what the stager hands it, chunk by chunk."""
        job = FlushJob(pending=pending, layout=layout, fname=fname, manifest=manifest, t0=t0,
                       on_commit=functools.partial(self.selector.committed, samples=plan.samples, plan=plan),
                       resolve=functools.partial(self.selector.resolve, plan) if plan.deferred else None,
                       on_fail=functools.partial(self.selector.failed, plan),
                       self_contained=_is_base(plan, self.config), charge=self._charge(),
                       frozen={k for n in plan.persisted if plan.layers[n].frozen for k in plan.layers[n].tensors},
                       moves=plan.moves)
        self.pool.reserve(layout.size)
        self._flusher.submit(job)
        self._pending.append(pending)
        return job

    def _charge(self) -> float:
        """How much of an encoder thread's CPU time comes out of the training now (``_cost.charge``): all of
        it where the model trains on the CPU with a thread per core, less where cores sit idle beside a GPU."""
        p = next(self.model.parameters(), None)
        on_cpu = p is None or p.device.type == "cpu"
        self._charge_now[0] = _cost.charge(on_cpu, self._training_threads, threads(self.config.encode_threads))
        return self._charge_now[0]

    def _fresh_name(self, step: int) -> str:
        """A data file name no committed manifest uses, so a re-save never overwrites committed data."""
        d = os.path.join(self.dirpath, _store.DATA_DIR)
        v = 0
        while os.path.lexists(os.path.join(d, _store.data_name(step, self.rank, v))):
            v += 1
        return _store.data_name(step, self.rank, v)


@contextlib.contextmanager
def _serial():
    """save()'s own tensor operations (the drift samples, the fingerprints' host copies) are many and small:
    they run on the calling thread alone, so that torch's worker threads are not woken for each one and left
    spinning after it (which on two cores doubled the CPU time they took).  The setting is the calling
    thread's (OpenMP's per-thread number of threads), put back on return."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _is_base(plan, config: Config) -> bool:
    """Whether a save is a base (the first, a due ``base_every``, in full mode too): written self-contained,
    no delta."""
    due = config.full and config.base_every > 0 and plan.chain % config.base_every == 0
    return due or any(plan.layers[n].reason in (_policy.FIRST, _policy.BASE) for n in plan.persisted)


def _tell(pending: PendingSave, plan, layout, t0: float) -> None:
    """What the caller learns of a save once ``save()`` returns."""
    pending.stall_s = time.perf_counter() - t0
    pending.nbytes = layout.size
    pending.layers_total = len(plan.layers)
    pending.layers_persisted = len(plan.persisted)
    pending.max_staleness = max((e.age for e in plan.layers.values()), default=0)


def _retire(ref: "weakref.ref[Checkpointer]") -> None:
    """How a newer Checkpointer of this process on the same store takes over from the one ``ref`` names
    (if it was collected meanwhile, its release has run or is running)."""
    ck = ref()
    if ck is not None:
        ck._replace()


def _checked(model: Any, optimizer: Any, config: Any) -> Config:
    """The Checkpointer's arguments, checked; returns the Config to use."""
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise CheckpointError(f"config must be a layerckpt.Config, got {type(config).__name__}")
    return config


def _check_save_args(step: Any, extra: Any, name: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict of tensors and plain values, got {type(extra).__name__}")
    if name is not None and not isinstance(name, str):
        raise CheckpointError(f"name must be a string, got {type(name).__name__}")


def _as_loss(loss: Any) -> Optional[float]:
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise CheckpointError(f"loss must be a number or a one-element tensor, got a tensor of shape "
                                  f"{tuple(loss.shape)}; pass the mean loss")
        loss = loss.detach().float().item()
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or loss != loss or abs(loss) == float("inf"):
        raise CheckpointError(f"loss must be a finite number or a one-element tensor, got {loss!r}")
    return float(loss)


__all__ = ["Checkpointer", "PendingSave"]
