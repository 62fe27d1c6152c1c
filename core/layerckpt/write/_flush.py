"""Flush: on one background thread, checksum and write each staged chunk, fdatasync, then hand the
result to the commit stage, then tell the commit listeners (tiers, retention).  ``PendingSave`` is the
caller's handle on one save."""
from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from . import _commit, _encwrite, _spare
from ..select import _cost
from ..format import _encode, _sign, _store
from .. import _faults, _registry
from ..io._backend import CHECKSUM, Backend, open_file
from .._dist import Group
from ..format._layout import DTYPES, Layout
from ..format._manifest import Manifest
from ._stage import BufferPool
from ..format._store import fsync_dir
from ._writeloop import Tee, WriteLoop, as_checkpoint_error, discard
from ..config import Config
from ..errors import CheckpointError, CheckpointWriteError

log = logging.getLogger("layerckpt")


wait_for_saves = _registry.wait_for_saves  # read your writes: this process's saves into a root, finished


class Pending:
    """Handle of one piece of background work: ``wait()`` returns once it is done and re-raises its error
    (whoever sees an error through ``wait()`` has had it reported)."""

    def __init__(self) -> None:
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None):
        """Block until durable; re-raises the background error (CheckpointWriteError for I/O)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._what()} not durable after {timeout}s")
        self._reported = True
        if self.error is not None:
            raise self.error
        return self

    def _what(self) -> str:
        raise NotImplementedError


class PendingSave(Pending):
    """Handle of one save: ``wait()`` returns once it is durable and committed."""

    def __init__(self, step: int, path: str):
        super().__init__()
        self.step = step
        self.path = path
        self.root = os.path.dirname(os.path.dirname(path))  # the checkpoint directory
        self.stall_s: float = 0.0  # save() call to return ("save() returned after" in reports)
        #: under lazy staging, what the optimizer's step(s) after save() waited for this save's copies
        #: (0 under eager staging, or where the copies ended before the step)
        self.step_wait_s: float = 0.0
        self.durable_s: float = 0.0  # save() call to commit (the manifest durable; retention comes after)
        self.nbytes: int = 0  # bytes this save writes (known once staged)
        self.bytes_written: int = 0  # set once committed: this rank's file
        self.bytes_all_ranks: int = 0  # set once committed: every rank's file of this save
        #: staging buffers of it written without encoding because a save() waited for this one (once committed)
        self.unencoded: int = 0
        self.layers_persisted: int = 0  # layers written by this save (known once staged)
        self.layers_total: int = 0
        self.max_staleness: int = 0  # the composite's oldest layer, in checkpoints
        self.manifest_path: Optional[str] = None
        self.cancelled = False  # its directory was removed while it flushed: dropped, not failed
        #: seconds by phase: plan (gather, drift, selection, layout: what save() blocks for under lazy
        #: staging), stage (the copies), checksum, encode (the encoder threads' seconds, summed over them;
        #: encoded saves only), write (waiting for the disk beyond the copies, checksums and encoding), fdatasync,
        #: commit (ranks agree, the manifest durable), retention (after the commit)
        self.phases: Dict[str, float] = {}
        self._copying: Optional[Callable[[], bool]] = None  # whether the tiers still copy (rank 0, with tiers)

    def _what(self) -> str:
        return f"checkpoint of step {self.step}"

    def settled(self) -> bool:
        """Durable and committed (:meth:`done`), and the memory and remote tiers copy nothing any more (neither
        what its commit queued nor a later save's): all the work this save started is over."""
        return self.done() and not (self._copying is not None and self._copying())

    @property
    def save_return_s(self) -> float:
        """Seconds from the ``save()`` call to its return (``stall_s``)."""
        return self.stall_s

    @property
    def blocked_s(self) -> float:
        """What training paid for this save: ``save()``'s return time plus the next step's wait for the
        copies (known once that step ran)."""
        return self.stall_s + self.step_wait_s

    def _add_step_wait(self, seconds: float) -> None:
        self.step_wait_s += seconds

    @property
    def flush_gbps(self) -> float:
        """This rank's file (``bytes_written``) over ``durable_s``, in GB/s: the rate of the whole save from the
        ``save()`` call to its commit (planning, the staging copies, checksums, encoding, the writes, fdatasync
        and the ranks' agreement all count), not the disk's write rate (``phases`` splits that time)."""
        return self.bytes_written / self.durable_s / 1e9 if self.durable_s else 0.0

    def __repr__(self) -> str:
        state = "failed" if self.error else "dropped" if self.cancelled else "committed" if self.done() else "flushing"
        return f"PendingSave(step={self.step}, {state})"


@dataclass
class FlushJob:
    pending: PendingSave
    layout: Layout
    fname: str
    manifest: Manifest
    t0: float
    chunks: "queue.Queue" = field(default_factory=queue.Queue)  # from the stager (see _stage)
    staged: threading.Event = field(default_factory=threading.Event)  # the caller's copy is over
    on_commit: Optional[Callable[[Manifest], None]] = None
    abort_error: Optional[BaseException] = None  # why staging failed, sent with ABORT
    resolve: Optional[Callable[[Manifest], None]] = None  # completes the manifest from saves committed before
    on_fail: Optional[Callable[[], None]] = None
    crcs: Dict[int, int] = field(default_factory=dict)  # item -> checksum, of those the stager took itself
    self_contained: bool = False  # encode every tensor without a reference (a base composite)
    #: the share of the encoder's CPU time that comes out of the training (``_cost.charge``)
    charge: float = 1.0
    frozen: AbstractSet[str] = frozenset()  # keys of frozen layers' tensors: no reference copy kept for them
    moves: Dict[str, float] = field(default_factory=dict)  # ``SavePlan.moves``: weights' recent move per step
    #: once written encoded: what the manifest says of each tensor, and the file's size
    encoded: Optional[Dict[str, Any]] = None
    size: Optional[int] = None
    coding: Optional[Dict[str, Any]] = None  # Config(encoding='auto'): how each kind was written, and why
    digest: Optional[List[List[Any]]] = None  # a signed store's: the file's digest (``_sign``)
    kinds: List[str] = field(default_factory=list)  # Config(encoding='auto'): each layout item's kind


class CommitListener(Protocol):
    """Told of each commit on the flusher thread, in the order given to the Flusher (rank 0: the tiers
    first, which queue their copies, then the local retention, which keeps what they copy from)."""

    def committed(self, m: Manifest) -> None: ...


class FlushThread:
    """The flusher thread: one daemon thread that runs callables in the order queued, started by the
    first.  The Flusher queues its jobs here; the local retention (``_retain.Retention``) queues its runs
    after a tier's copy, so that retention never runs beside a flush."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()  # None: stop
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="layerckpt-flusher", daemon=True)
            self._thread.start()
        self._jobs.put(fn)

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the thread once everything queued so far is done (at once if none ran)."""
        if self._thread is None:
            fn()
        else:
            self._jobs.put(fn)

    def stop(self) -> None:
        """Finish what is queued, then end the thread (from the thread itself, e.g. when a dropped
        Checkpointer is collected there, it only asks)."""
        if self._thread is not None:
            self._jobs.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                return
            fn()
            del fn  # hold nothing of a finished job while waiting for the next


class Flusher:
    """Runs flush jobs in order on the flusher thread; after each commit tells ``listeners`` (rank 0's
    tiers and retention; none on other ranks) in order.  ``thread``: the flusher thread, shared with
    the local retention's runs after a tier's copy (a new one by default)."""

    def __init__(self, backend: Backend, pool: BufferPool, config: Config, root: str, group: Optional[Group] = None,
                 listeners: Sequence[CommitListener] = (), thread: Optional[FlushThread] = None):
        self.group = group if group is not None else Group()
        self.backend = backend
        self.pool = pool
        self.config = config
        self.root = root
        self.listeners = tuple(listeners)
        self.thread = thread if thread is not None else FlushThread()
        self.refs = _encwrite.Refs(config.encoding in ("delta", "auto", "lossy"), config.delta_chain,
                                   config.lossy_quantum, config.lossy_bits)
        #: Config(encoding='auto'): what encoding each kind of tensor gives and costs, and the local disk's rate
        self.cost = _cost.CostModel() if config.encoding == "auto" else None
        self.probes = _cost.Probes(self.cost) if self.cost is not None else None
        self.disk = _cost.Sink("local disk")
        self._kinds: Dict[tuple, str] = {}
        self._encoders: Optional[ThreadPoolExecutor] = None
        self._probing: List[Future] = []  # probe encodes still running (see _cost.Probes)
        self._hurry = threading.Event()  # a save() waits for the save flushing now: stop encoding it
        #: where to put a copy in memory of a data file written raw (the memory tier's, ``Tiers.staged_copy``)
        self.staged_copy: Optional[Callable[[str], Optional[str]]] = None
        #: the ranks that commit each manifest into their store: rank 0, or each node's store owner
        self.committers: AbstractSet[int] = frozenset({0})
        self.sign_key = _sign.key_of(config)  # a signed store's key (``_sign``), else None
        self._hashers: Optional[ThreadPoolExecutor] = None

    def hurry(self) -> None:
        """A ``save()`` waits for the save flushing now: the rest of it is written without encoding, so that
        training never waits for the encoder (only for the disk, as without encoding)."""
        self._hurry.set()

    def _encoder_threads(self) -> ThreadPoolExecutor:
        if self._encoders is None:
            self._encoders = ThreadPoolExecutor(_encwrite.threads(self.config.encode_threads),
                                                thread_name_prefix="layerckpt-encode", initializer=_encode.warm)
        return self._encoders

    def _hasher(self, loop: WriteLoop) -> Optional[_sign.Hasher]:
        """A signed store's digest of a file written raw, taken from its staged buffers on two threads (hashlib
        releases the GIL: about twice the disk's rate on a free core); None otherwise."""
        if self.sign_key is None or isinstance(loop, _encwrite.EncodingLoop):
            return None
        if self._hashers is None:
            self._hashers = ThreadPoolExecutor(2, thread_name_prefix="layerckpt-digest")
        loop.hasher = _sign.Hasher(self._hashers)
        return loop.hasher

    def settle(self) -> None:
        """Wait for the probe encodes still running (the background work of the saves that have ended)."""
        for p in list(self._probing):
            p.result()

    def submit(self, job: FlushJob) -> None:
        _registry.save_started(job.pending.root, job.pending)  # read your writes: restore waits for it
        self.thread.submit(functools.partial(self._run, job))

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the flusher thread once every job queued so far is done (at once if none ran)."""
        self.thread.then(fn)

    def stop(self) -> None:
        """Finish the jobs queued, then end the thread (from the thread itself it only asks)."""
        self.thread.stop()
        if self._encoders is not None and self.thread._thread is None:  # else the thread still runs jobs
            self._encoders.shutdown(wait=True)
            self._encoders = None
        if self._hashers is not None and self.thread._thread is None:
            self._hashers.shutdown(wait=True)
            self._hashers = None

    def _run(self, job: FlushJob) -> None:
        try:
            self._flush(job)
        except BaseException as e:  # noqa: BLE001 - kept and re-raised from wait()
            self.refs.failed()
            if job.on_fail is not None:
                job.on_fail()
            if not os.path.isdir(self.root):  # the user removed the directory: nothing to fight over
                job.pending.cancelled = True
                log.info("layerckpt: %s was removed while step %d was flushing; that save is dropped",
                         self.root, job.pending.step)
            else:
                job.pending.error = _as_checkpoint_error(e, job.pending.path)
                log.debug("layerckpt: flush of step %d failed: %s", job.pending.step, e)
        finally:
            self._hurry.clear()
            if not job.pending.durable_s:
                job.pending.durable_s = time.perf_counter() - job.t0
            job.pending._done.set()
            _registry.save_ended(job.pending.root, job.pending)

    def _flush(self, job: FlushJob) -> None:
        """Write this rank's file, then agree with every rank; rank 0 commits only if all succeeded."""
        try:
            crcs = self._write_local(job)
            t = time.perf_counter()
            fsync_dir(os.path.dirname(job.pending.path))
            job.pending.phases["fdatasync"] += time.perf_counter() - t
            if job.resolve is not None:
                job.resolve(job.manifest)
            failed: Optional[BaseException] = None
        except BaseException as e:  # noqa: BLE001 - every rank must still take part in the exchange
            failed, crcs = _as_checkpoint_error(e, job.pending.path), []
        _faults.point("flush.written")
        m = job.manifest
        mine = _commit.rank_result(self.group.rank, job.fname, job.layout, crcs, m.rng, failed, job.pending.path,
                                   tensors=job.encoded, size=job.size, coding=job.coding, digest=job.digest)
        ranks = _commit.agree(self.group, mine, failed, job.pending.path)
        _commit.merge(m, ranks, CHECKSUM)
        _encwrite.merge_refs(m.tensors, m.files, self.refs)
        t = time.perf_counter()
        if self.sign_key is not None:
            m.store = _store.store_id(self.root)
        job.pending.manifest_path, m = _commit.publish(self.group, self.root, m, self.committers, self.sign_key)
        self.refs.committed(m.tensors, m.files)
        job.pending.durable_s = time.perf_counter() - job.t0  # committed: what follows is housekeeping
        job.pending.phases["commit"] = time.perf_counter() - t
        t = time.perf_counter()
        if job.on_commit is not None:
            job.on_commit(m)
        job.pending.bytes_written = job.size if job.size is not None else job.layout.size
        job.pending.bytes_all_ranks = sum(r.size for r in ranks)
        for listener in self.listeners:  # the tiers queue their copies, then the local retention runs
            listener.committed(m)
        job.pending.phases["retention"] = time.perf_counter() - t

    def _write_local(self, job: FlushJob) -> list:
        """This rank's data file, durable; returns the per-tensor checksums."""
        path = job.pending.path
        self.backend.register_buffers([c.view for c in self.pool.chunks])
        try:
            spare = _spare.take(path, job.layout.size, self.config.direct_io)
            fd, direct = spare or open_file(path, write=True, direct=self.config.direct_io)
        except OSError as e:
            self._discard(job)
            raise CheckpointWriteError(e.errno or errno.EIO, path) from None
        loop, probe = self._loop(job, path)
        loop.recycled = spare is not None
        hasher = self._hasher(loop)
        tee = self._tee(job, loop)
        try:
            crcs = loop.run(fd, direct, job.layout.size, phases=job.pending.phases)
        except BaseException as e:
            if tee is not None:
                tee.drop()
            failed = e
            if direct and isinstance(e, OSError) and e.errno == errno.EINVAL:
                failed = _diagnose_einval(path, job.layout.size, e)
            _commit.unlink_quietly(path)
            raise failed
        if tee is not None:
            tee.finish(job.layout.size)
        crcs = [job.crcs.get(i, c) for i, c in enumerate(crcs)]
        encoded = isinstance(loop, _encwrite.EncodingLoop)
        if encoded:
            job.encoded, job.size = loop.entries(job.fname, crcs), loop.size
            job.pending.unencoded = loop.hurried
        if self.sign_key is not None:  # an encoded file's bytes are not the staged ones: read back, once durable
            size = loop.size if encoded else job.layout.size
            job.digest = (hasher.parts(size) if hasher is not None else None) or _sign.file_parts(path, size)
        if self.cost is not None:
            # the disk's rate: bytes over the time spent waiting for them (the writes and the sync)
            ph = job.pending.phases
            self.disk.observe(loop.size if encoded else job.layout.size, ph.get("write", 0.0) + ph.get("fdatasync", 0.0))
            if probe is not None and not probe.empty:  # off the save's path: the commit need not wait
                self._probing = [p for p in self._probing if not p.done()]
                self._probing.append(self._encoder_threads().submit(probe.run))
        return crcs

    def _tee(self, job: FlushJob, loop: WriteLoop) -> Optional[Tee]:
        """A copy in memory of this job's file, where one is wanted and the file is written raw (the staging
        buffers hold its bytes as they go to the disk)."""
        where = self.staged_copy(job.fname) if self.staged_copy is not None else None
        if where is None or isinstance(loop, _encwrite.EncodingLoop):
            return None
        try:
            tee = Tee(where)
        except OSError as e:
            log.debug("layerckpt: no copy in memory of %s: %s", job.fname, e)
            return None
        first = loop.tap
        loop.tap = tee.tap if first is None else lambda *a: (first(*a), tee.tap(*a))
        return tee

    def _loop(self, job: FlushJob, path: str) -> "Tuple[WriteLoop, Optional[_cost.ProbeSave]]":
        """The write loop of this job: encoded unless ``Config.encoding='off'``, or 'auto' decides that no
        tensor of it is; with 'auto', the probes this save feeds."""
        kw = dict(nitems=len(job.layout.items), staged=job.staged, aborted=lambda: job.abort_error or CheckpointError(
            "staging was interrupted; nothing was committed"))
        modes, probe = None, None
        if self.cost is not None:
            modes, probe = self._decide(job)
            if all(mode == _cost.RAW for mode in modes):
                self.refs.drop(it.key for it in job.layout.items)  # none of them reads or renews a reference
                loop = WriteLoop(self.backend, self.pool, job.chunks, path, **kw)
                loop.tap = None if probe.empty else probe.tap
                return loop, probe
        elif self.config.encoding == "off":
            return WriteLoop(self.backend, self.pool, job.chunks, path, **kw), None
        elif self.config.encoding == "lossy":
            modes = [_lossy_mode(it.key, it.tensor, it.nbytes, it.key in job.frozen) for it in job.layout.items]
        plan = self.refs.plan(job.layout, job.self_contained, job.frozen, modes, job.pending.step, job.moves)
        loop = _encwrite.EncodingLoop(self.backend, self.pool, job.chunks, path, layout=job.layout, plan=plan,
                                      pool_exec=self._encoder_threads(), chunk_bytes=self.pool.chunk_bytes,
                                      hurry=self._hurry, observe=self._observer(job, plan), **kw)
        loop.tap = None if probe is None or probe.empty else probe.tap
        return loop, probe

    def _decide(self, job: FlushJob) -> "Tuple[List[str], _cost.ProbeSave]":
        """Config(encoding='auto'): each item's mode for the local disk, the record of why (by kind), and
        the probes of the kinds not encoded against a reference."""
        self.cost.fold()
        items = job.layout.items
        kinds = job.kinds = [self._kind(it.key, it.tensor.dtype, it.key in job.frozen) for it in items]
        verdicts: Dict[str, _cost.Verdict] = {}
        record: Dict[str, Dict[str, Any]] = {}
        modes: List[str] = []
        for it, k in zip(items, kinds):
            v = verdicts.get(k)
            if v is None:
                delta_ok = " frozen" not in k and it.tensor.element_size() in _encode.ESIZES
                v = verdicts[k] = self.cost.decide(k, self.disk, job.charge, delta_ok)
                record[k] = {**v.record(self.disk, job.charge), "tensors": 0, "bytes": 0}
            small = it.nbytes < _cost.MIN_BYTES
            modes.append(_cost.RAW if small else v.mode)
            if not small:
                record[k]["tensors"] += 1
                record[k]["bytes"] += it.nbytes
        job.coding = {k: r for k, r in record.items() if r["tensors"]}
        wanted = {k for k, v in verdicts.items() if v.mode != _cost.DELTA}
        probe = self.probes.plan([(it.key, it.offset, it.nbytes, it.tensor.element_size()) for it in items],
                                 kinds, wanted)
        return modes, probe

    def _kind(self, key: str, dtype, frozen: bool) -> str:
        """``_cost.kind`` of a tensor, worked out once per key (saves repeat them)."""
        got = self._kinds.get((key, dtype, frozen))
        if got is None:
            if len(self._kinds) > 1 << 16:
                self._kinds.clear()
            got = self._kinds[(key, dtype, frozen)] = _cost.kind(key, DTYPES[dtype], frozen)
        return got

    def _observer(self, job: FlushJob, plan) -> Optional[Callable]:
        """What the encodes of this job tell the cost model: per block, its kind and mode (a delta where
        the tensor had a reference), raw and stored bytes, CPU seconds."""
        if self.cost is None:
            return None
        kinds = job.kinds

        def observe(seen) -> None:
            for i, raw, out, cpu in seen:
                mode = _cost.DELTA if plan.refs[i] is not None else _cost.COMPRESS
                self.cost.observe(kinds[i], mode, raw, max(out, 1), cpu)

        return observe

    def _discard(self, job: FlushJob) -> None:
        discard(job.chunks, self.pool)


_LOSSY_MODES = {"weight": "qdelta", "exp_avg": "qmom", "momentum": "qmom", "exp_avg_sq": "qsq"}  # by role


def _lossy_mode(key: str, tensor, nbytes: int, frozen: bool) -> str:
    """``Config(encoding='lossy')``: how a tensor is written (``_encwrite.Refs.plan``'s modes): fp32 training
    state of ``LOSSY_MIN`` bytes and more with bounded loss, by its role; everything else as 'delta'."""
    if DTYPES.get(tensor.dtype) != "F32" or nbytes < _encwrite.LOSSY_MIN or frozen:
        return "delta"
    return _LOSSY_MODES.get(_cost.role(key), "delta")


_as_checkpoint_error = as_checkpoint_error  # the one conversion, shared with the torch-file writer


def _diagnose_einval(path: str, size: int, err: OSError) -> OSError:
    """Our O_DIRECT writes are always aligned, so EINVAL means the kernel cut a write short at a
    limit (RLIMIT_FSIZE, quota, a full disk) and then refused the unaligned rest.  A buffered write
    at the file's intended end tells which limit it was."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.pwrite(fd, b"\0", size - 1)
        finally:
            os.close(fd)
    except OSError as e:
        return OSError(e.errno, os.strerror(e.errno or errno.EIO), path)
    return OSError(errno.EINVAL, "O_DIRECT write refused; set Config(direct_io=False) for this file system", path)
