"""restore(): read a committed checkpoint back into a model (and optimizer); read_checkpoint(): into dicts.

Both take their composite from a local view (``_fetch.view``: the directory,
its memory tier, or a remote tier's composite downloaded) and read it once
through one :class:`~layerckpt.read._reader.Reader`; what differs is where the
tensors go.  ``restore`` matches the model and optimizer with the manifest
before anything is read, reads the optimizer state, RNG and extra first (so
that damage there leaves the model untouched), then the model's tensors
straight into its memory.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, TypeVar, Union

import torch

from . import _dist
from .io._backend import checksum_function
from .read import _fetch, _parts, _pretrained
from .format._codec import decode, tensor_refs
from .write._gather import model_state, optimizer_params, param_names, rng_values, set_rng_state
from .format._layout import CODES, DTYPES
from .format._manifest import Manifest, is_rng, model_key, model_name, parse_once, piece_base
from .read._reader import (Reader, Window, is_row_sharded, is_sharded, local_boxes, local_rows,  # noqa: F401
                           open_reader, read_tensors, retry_gone)
from .config import Config
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                     StalenessError)

log = logging.getLogger("layerckpt")

# What a composite may be estimated to give up before a restore warns (strict: raises): a fraction of the
# training loss where the save knew it, else checkpoint intervals of progress.
MAX_LOSS_INCREASE = 0.01
MAX_LAG = 1.0


@dataclass
class _Summary:
    """What every read of a committed composite reports: :class:`RestoreReport` and :class:`LoadedCheckpoint`."""
    step: int
    layers: Dict[str, int]  # layer -> step its newest version was persisted at
    staleness: Dict[str, int]  # layer -> checkpoints it lags the restored step
    max_staleness: int
    #: layer -> the RMS error of its weights in steps of training, where stored with bounded loss
    #: (``Config(encoding='lossy')``, ``Manifest.quantization``); empty for a lossless checkpoint
    quantization: Dict[str, float]
    bytes_read: int
    extra: Dict[str, Any]
    #: the manifest read; a remote tier's URL, or the local directory's own copy of the memory tier's
    #: composite, so that ``Checkpointer.adopt(report)`` continues it
    manifest: str


@dataclass
class RestoreReport(_Summary):
    seconds: float = 0.0
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    mismatched: List[str] = field(default_factory=list)
    layer_bytes: Dict[str, int] = field(default_factory=dict)  # layer -> bytes of its tensors read
    staleness_steps: Dict[str, int] = field(default_factory=dict)  # layer -> steps it trails the restored step
    cost: Optional[float] = None  # estimated fidelity cost: first-order loss the stale layers give up
    lag: Optional[float] = None  # the same in checkpoint intervals of training progress
    loss_increase: Optional[float] = None  # the same as a fraction of the training loss at the save
    #: node-local directories (docs/nodes.md): rank -> where that rank's part of the composite came from on its
    #: node ("disk", "memory", "replica": a partner node's memory, "remote"); {} for one directory
    sources: Dict[int, str] = field(default_factory=dict)


@dataclass
class LoadedCheckpoint(_Summary):
    """A committed checkpoint read into fresh memory, for frameworks that load from dicts."""
    model: Dict[str, torch.Tensor]  # every state_dict name (tied names share one tensor) -> tensor
    model_other: Dict[str, Any]  # non-tensor state_dict entries
    optimizer: Optional[Dict[str, Any]]  # Optimizer.state_dict() form; parameters numbered in saved order
    rng: Optional[Dict[str, Any]]  # this rank's RNG states; apply with restore_rng()
    seconds: float = 0.0
    _rng_values: Dict[str, Any] = field(default_factory=dict, repr=False)  # decoded and checked at the read
    sources: Dict[int, str] = field(default_factory=dict)  # as :attr:`RestoreReport.sources`

    def restore_rng(self) -> None:
        """Set python/numpy/torch (and CUDA) RNG to their state at the save."""
        if self.rng:
            set_rng_state(self._rng_values)


@retry_gone
@parse_once()
def restore(
    dirpath: Union[str, os.PathLike],
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    step: Optional[int] = None,
    strict: bool = True,
    *,
    config: Optional[Config] = None,
) -> RestoreReport:
    """Load the newest committed checkpoint (or the one of ``step``) into ``model`` and ``optimizer``.

    Names, shapes and dtypes are all checked before anything is read, and the
    optimizer state, RNG and extra are verified before the model is touched; a
    checksum failure inside the model's own tensors can leave them partly
    loaded (restore another step).  Never unpickles.

    ``dirpath`` may be a remote URL (``s3://bucket/prefix``, with ``config=Config(remote=URL,
    remote_options=...)`` for credentials); for a local directory whose memory or remote tier holds
    a fresher composite, that one is read (``_fetch.view``).
    """
    return _read_viewed(dirpath, step, config, False,
                        lambda r: _restore_from(r, model, optimizer, strict, _bound(config)))


def _restore_from(r: Reader, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], strict: bool,
                  bound: int) -> RestoreReport:
    """restore() of the composite ``r`` reads: match, check, read what the model does not hold, then the model."""
    m = r.m
    rng = m.rng_for(_dist.rank()) if r.cfg.restore_rng else None
    # the disk starts on every range at once, in the order they are read (the model's bytes come in while the
    # optimizer state is checked and decoded); for a strict restore before the checks below, as one that passes
    # them reads every tensor the manifest holds for the model and the optimizer, and a hint reads nothing into
    # either: a mismatch found next still leaves both untouched
    state_keys = _state_keys(m, rng, with_optimizer=optimizer is not None)
    hinted = strict and _prefetch_all(r, state_keys, optimizer is not None)
    plan = _ModelPlan(model, m, strict)  # names, shapes and dtypes: every difference before anything is read
    # tensors held by reference to the pretrained files: proven held by the model, or read from Config.pretrained
    plan.pairs, held_back = _pretrained.resolve(m, plan.pairs, plan.targets, r.cfg.pretrained,
                                                checksum_function(m.checksum), r.mpath)
    plan.keys = sorted({k for _, k in plan.pairs})
    with _malformed(r.mpath, "the optimizer state"):
        opt_keys = _optimizer_keys(optimizer, model, m, strict) if optimizer is not None else []
    other_keys = set(opt_keys) | state_keys
    _check_staleness(m, bound, strict)
    if not hinted:
        r.prefetch([sorted(other_keys - set(plan.keys)), plan.keys])
    # optimizer state, RNG and extra: into one fresh buffer per file, where they stay as views (no second copy),
    # read and verified first, so that damage there leaves the model untouched
    tensors = r.tensors(sorted(other_keys - set(plan.keys)),
                        windows=_shard_windows(model, m) if optimizer is not None else None)
    state = _State.decoded(model, optimizer, m, tensors, rng, r.mpath)  # every malformation, before the model
    held_back.read()  # what the model lacks of the pretrained files' tensors: read and proven, before the model
    r.into([(key, plan.targets[name]) for name, key in plan.pairs])  # through bounce buffers into its memory
    held_back.load()
    state.load(model, optimizer)
    return RestoreReport(
        **_summary(r, tensors), missing=plan.missing, unexpected=plan.unexpected, mismatched=plan.mismatched,
        layer_bytes=_layer_bytes(m, set(plan.keys) | other_keys), staleness_steps=m.steps_behind(), cost=m.cost,
        lag=m.lag, loss_increase=m.loss_increase)


@retry_gone
@parse_once()
def read_checkpoint(path: Union[str, os.PathLike], step: Optional[int] = None, *,
                    config: Optional[Config] = None, strict: bool = True) -> LoadedCheckpoint:
    """Read the checkpoint at ``path`` (a checkpoint directory, or one of its manifests) into fresh tensors.

    Unlike :func:`restore` this needs no model or optimizer: the model comes back
    as a state dict and the optimizer state in ``Optimizer.state_dict()`` form.
    Checksums are verified; nothing is unpickled.  ``path`` may also be a remote URL, as for :func:`restore`.
    """
    return _read_viewed(path, step, config, True, lambda r: _load_from(r, strict, _bound(config)))


def _load_from(r: Reader, strict: bool, bound: int) -> LoadedCheckpoint:
    """read_checkpoint() of the composite ``r`` reads: every tensor but other ranks' RNG, into fresh memory."""
    m = r.m
    _check_staleness(m, bound, strict)
    rng = m.rng_for(_dist.rank())
    keys = {k for k in m.logical_keys() if not is_rng(k)} | set(tensor_refs(rng or {}))
    held = _pretrained.read_all(m, r.cfg.pretrained, checksum_function(m.checksum), r.mpath)  # refused before reading
    r.prefetch([sorted(keys)])
    tensors = {**r.tensors(sorted(keys)), **held}
    rng = rng if r.cfg.restore_rng else None
    state = _State.decoded(None, None, m, tensors, rng, r.mpath)
    return LoadedCheckpoint(
        **_summary(r, tensors), model=_model_dict(m, tensors), model_other=state.model_other,
        optimizer=state.optimizer, rng=rng, _rng_values=state.rng or {})


_Out = TypeVar("_Out", RestoreReport, LoadedCheckpoint)


def _read_viewed(path: Any, step: Optional[int], config: Optional[Config], manifest_paths: bool,
                 read: Callable[[Reader], _Out]) -> _Out:
    """``read`` of the composite :func:`_fetch.view` picks.  Where that is the memory tier's copy and its files
    turn out damaged, the composite is read again from the next tier (the disk): the memory tier is a cache,
    and damage to it never fails a read the disk can serve.  A model the first read partly filled is filled
    again by the second (the optimizer and RNG are set only once every tensor was read and verified)."""
    if _parts.collective(path):  # node-local directories: the ranks gather the composite together
        with _parts.gather(path, step, config) as got:
            if got.view is not None:
                with open_reader(got.view, config, manifest_paths=manifest_paths) as r:
                    out = _as_viewed(read(r), got.view)
                out.sources = got.sources
                return out
    with _fetch.view(path, step, config) as v:
        try:
            with open_reader(v, config, manifest_paths=manifest_paths) as r:
                return _as_viewed(read(r), v)
        except CheckpointCorruptError as e:
            if v.tier != "memory":
                raise
            damaged = e
    log.warning("layerckpt: the memory tier's copy of step %s is damaged (%s); the disk is read", v.step, damaged)
    try:
        with _fetch.view(path, step, config, memory=False) as v, \
                open_reader(v, config, manifest_paths=manifest_paths) as r:
            return _as_viewed(read(r), v)
    except CheckpointNotFoundError:  # nothing else holds a composite: the memory tier's damage is what to fix
        raise damaged from None


def _summary(r: Reader, tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The fields of :class:`_Summary`, of the composite ``r`` read."""
    m = r.m
    ages = {name: e.age for name, e in m.layers.items()}
    return dict(step=m.step, layers={name: e.step for name, e in m.layers.items()}, staleness=ages,
                max_staleness=max(ages.values(), default=0), quantization=m.quantization(), bytes_read=r.bytes_read,
                extra=decode(m.extra or {}, tensors), manifest=r.mpath)


def _as_viewed(out: _Out, v: _fetch.View) -> _Out:
    """``out`` naming the manifest the view stands for, and timed from the view's opening (a download's too)."""
    if v.manifest is not None:
        out.manifest = v.manifest
    out.seconds = time.perf_counter() - v.opened
    return out


def _bound(config: Optional[Config]) -> int:
    """The staleness bound restore checks: the caller's Config's, else the default's; never the one the
    manifest records (the policy that wrote the composite does not vouch for itself)."""
    return config.max_staleness if config is not None else Config.max_staleness


def _prefetch_all(r: Reader, state_keys: Set[str], with_optimizer: bool) -> bool:
    """:meth:`Reader.prefetch` of what a strict restore of the composite reads, known from its manifest alone:
    the optimizer state and the other state (``state_keys``) first, then the model's tensors.  False, with
    nothing asked, where the manifest holds no optimizer state to read: the checks after it say so."""
    m = r.m
    other = set(state_keys)
    if with_optimizer:
        saved = (m.optimizer or {}).get("state")  # validated: an object of objects where present
        if saved is None:
            return False
        other |= set(tensor_refs(saved))
    model_keys = sorted(k for k in m.logical_keys() if model_name(k) is not None)
    r.prefetch([sorted(other - set(model_keys)), model_keys])
    return True


def _state_keys(m: Manifest, rng: Optional[Dict[str, Any]], with_optimizer: bool) -> Set[str]:
    """The tensors restore() reads besides the model's and the optimizer state's: RNG, extra, non-tensor model
    state (a module's _extra_state) and, with an optimizer, tensors in its param_groups."""
    keys = set(tensor_refs(rng or {})) | set(tensor_refs(m.extra or {})) | set(tensor_refs(m.model_other))
    if with_optimizer:
        keys |= set(tensor_refs((m.optimizer or {}).get("param_groups", [])))
    return keys


class _State:
    """What restore() loads besides the model's tensors (non-tensor model state, the optimizer's state dict, the
    RNG states), decoded and checked while the model is still untouched, then loaded."""

    def __init__(self, model_other: Dict[str, Any], optimizer: Optional[Dict[str, Any]],
                 rng: Optional[Dict[str, Any]]):
        self.model_other, self.optimizer, self.rng = model_other, optimizer, rng

    @classmethod
    def decoded(cls, model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer], m: Manifest,
                tensors: Dict[str, torch.Tensor], rng: Optional[Dict[str, Any]], where: str) -> "_State":
        """``model=None``: the optimizer state in saved order (``read_checkpoint``, ``verify``)."""
        with _malformed(where, "the non-tensor model state"):
            other = decode(m.model_other, tensors) if m.model_other else {}
        with _malformed(where, "the extra"):
            decode(m.extra or {}, tensors)
        with _malformed(where, "the optimizer state"):
            if model is None:
                opt = _saved_optimizer_state(m, tensors)
            else:
                opt = _optimizer_state_dict(optimizer, model, m, tensors) if optimizer is not None else None
        return cls(other, opt, rng_values(rng, tensors, where) if rng else None)

    def load(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        if self.model_other:
            wanted = set(model.state_dict())
            model.load_state_dict({k: v for k, v in self.model_other.items() if k in wanted}, strict=False)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer)
        if self.rng:
            set_rng_state(self.rng)


@contextlib.contextmanager
def _malformed(where: str, what: str) -> Iterator[None]:
    """A value of the manifest that does not decode: a CheckpointCorruptError naming it, not a KeyError."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointCorruptError(f"manifest {where}: {what} is malformed ({type(e).__name__}: {e}); the "
                                     f"manifest was edited or damaged: restore another step", path=where) from None


class _Described(dict):
    """``tensors``, and for any other key the manifest describes (a sharded tensor stored in pieces) an empty
    stand-in: the optimizer state's structure decodes without its tensors assembled."""

    def __init__(self, m: Manifest, tensors: Dict[str, torch.Tensor]):
        super().__init__(tensors)
        self.m = m

    def __missing__(self, key: str) -> torch.Tensor:
        if self.m.describe(key) is None:
            raise KeyError(key)
        return torch.empty(0)


def check_state(m: Manifest, tensors: Dict[str, torch.Tensor], where: str) -> None:
    """What a restore decodes besides the model's and optimizer's tensors (every rank's RNG states, the extra,
    the non-tensor model state, the optimizer state's structure; ``tensors``: the composite's, as stored),
    checked as restore checks them:
    ``verify``'s test of a composite whose tensors read back."""
    _State.decoded(None, None, m, _Described(m, tensors), None, where)
    for rank_rng in _every_rng(m):
        rng_values(rank_rng, tensors, where)


def _every_rng(m: Manifest) -> List[Dict[str, Any]]:
    """Every rank's saved RNG states."""
    return [r for r in [m.rng, *(m.rng_ranks or {}).values()] if r]


def _layer_bytes(m: Manifest, read: Set[str]) -> Dict[str, int]:
    """Layer -> bytes of its tensors that were read."""
    return {name: sum(m.tensors[k].nbytes for k in e.tensors if piece_base(k)[0] in read)
            for name, e in m.layers.items()}


def _model_dict(m: Manifest, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Every state_dict name -> its tensor; tied names share one."""
    model = {model_name(k): t for k, t in tensors.items() if model_name(k) is not None}
    for alias, canon in m.aliases.items():
        model[alias] = model[canon]
    return model


class _ModelPlan:
    """Pairs each model tensor with its checkpoint key; collects every difference."""

    def __init__(self, model: torch.nn.Module, m: Manifest, strict: bool):
        tensors, aliases, _ = model_state(model)
        current = {**{n: t for n, t in tensors.items()}, **{a: tensors[c] for a, c in aliases.items()}}
        saved_alias = m.aliases
        saved = {n for n in map(model_name, [*m.logical_keys(), *(m.pretrained or {})]) if n is not None} | set(
            saved_alias)

        def key_of(name: str) -> str:
            return model_key(saved_alias.get(name, name))

        self.missing = sorted(set(current) - saved)
        self.unexpected = sorted(saved - set(current))
        self.mismatched: List[str] = []
        self.pairs: List[Tuple[str, str]] = []
        self.targets = current
        done_storage = set()
        for name in sorted(set(current) & saved):
            e = m.describe(key_of(name))
            if e is None:
                self.unexpected.append(name)
                continue
            t = current[name]
            if list(t.shape) != e[1] or DTYPES.get(t.dtype) != e[0]:
                self.mismatched.append(
                    f"{name}: checkpoint {tuple(e[1])} {e[0]}, model {tuple(t.shape)} "
                    f"{DTYPES.get(t.dtype, t.dtype)}")
                continue
            if name in aliases or (id(t) in done_storage):
                continue  # tied: loaded through its canonical name
            done_storage.add(id(t))
            self.pairs.append((name, key_of(name)))
        if strict and (self.missing or self.unexpected or self.mismatched):
            raise CheckpointMismatchError("model", self.missing, self.unexpected, self.mismatched)
        self.keys = sorted({k for _, k in self.pairs})


def _optimizer_keys(optimizer, model, m, strict) -> List[str]:
    saved = m.optimizer
    if saved is None:
        if strict:
            raise CheckpointMismatchError("optimizer", missing=["<optimizer state: this checkpoint has none>"])
        return []
    mine = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if saved.get("class") not in (None, mine):
        raise CheckpointMismatchError("optimizer", mismatched=[
            f"class: checkpoint {saved['class']}, optimizer {mine} (their states do not carry over; restore "
            f"with the optimizer class that saved it, or pass optimizer=None and start its state afresh)"])
    names = param_names(model)
    cur_groups = [[names.get(id(p), f"<unnamed #{i}>") for i, p in enumerate(g["params"])] for g in optimizer.param_groups]
    saved_groups = [g["params"] for g in saved["param_groups"]]
    if len(cur_groups) != len(saved_groups) or any(set(a) != set(b) for a, b in zip(cur_groups, saved_groups)):
        cur = {n for g in cur_groups for n in g}
        old = {n for g in saved_groups for n in g}
        raise CheckpointMismatchError(
            "optimizer", missing=cur - old, unexpected=old - cur,
            mismatched=[] if cur != old else [
                f"param_groups: checkpoint has {len(saved_groups)} group(s) of sizes {[len(g) for g in saved_groups]}, "
                f"optimizer has {len(cur_groups)} of sizes {[len(g) for g in cur_groups]}"])
    _check_optimizer_state(optimizer, model, m)
    return sorted(set(tensor_refs(saved["state"])))


# torch.optim classes whose per-parameter state tensors have their parameter's shape and dtype, but for the
# scalar entries below; an optimizer keeping factored state (Adafactor) or one not listed is checked by the
# generic rule of _state_problem
_PARAM_SHAPED = frozenset(getattr(torch.optim, n) for n in (
    "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
    "SparseAdam") if hasattr(torch.optim, n))
_SCALAR_STATE = frozenset(("step", "mu_product", "eta", "mu"))


def _check_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, m: Manifest) -> None:
    """Refuse optimizer state recorded with another shape or dtype than its parameter (a DTensor: its global
    shape) before anything is read: torch would cast the bytes it was given, or fail at the next step()."""
    params = dict(model.named_parameters())
    known = type(optimizer) in _PARAM_SHAPED
    bad = []
    for name, st in m.optimizer["state"].items():
        p = params.get(name)
        if p is None or not isinstance(st, dict):
            continue
        for key, v in st.items():
            problem = _state_problem(key, v, p, m, known)
            if problem:
                bad.append(f"optimizer.state[{name}][{key!r}]: {problem}")
    if bad:
        raise CheckpointMismatchError("optimizer", mismatched=bad)


def _state_problem(key: str, v: Any, p: torch.Tensor, m: Manifest, known: bool) -> Optional[str]:
    """What is wrong with the state entry ``key`` (encoded ``v``) of parameter ``p``, or None.  Known optimizers:
    a scalar entry is a number or a one-element tensor, any other tensor has p's shape and dtype.  Others: a
    tensor of p's size (more than one element) has p's shape, and its dtype unless it is an integer one (8-bit
    optimizers keep quantized state of a floating parameter's size)."""
    ref = v.get("__tensor__") if isinstance(v, dict) and len(v) == 1 else None
    d = m.describe(ref) if isinstance(ref, str) else None
    want = (DTYPES.get(p.dtype, str(p.dtype)), list(p.shape))
    if known and key in _SCALAR_STATE:
        if d is None and (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return None
        if d is not None and math.prod(d[1]) == 1 and len(d[1]) <= 1:
            return None
        return f"checkpoint {_shown(v, d)}, expected a number or a one-element tensor"
    if known and d is None:
        return None if v is None else f"checkpoint {_shown(v, d)}, expected a tensor {tuple(want[1])} {want[0]}"
    if d is None or list(d) == list(want):
        return None
    if not known and (math.prod(d[1]) != p.numel() or p.numel() <= 1
                      or (d[1] == want[1] and not getattr(CODES.get(d[0]), "is_floating_point", True))):
        return None
    return f"checkpoint {tuple(d[1])} {d[0]}, expected {tuple(want[1])} {want[0]} (its parameter's)"


def _shown(v: Any, d: Optional[Tuple[str, List[int]]]) -> str:
    return f"a tensor {tuple(d[1])} {d[0]}" if d is not None else f"a {type(v).__name__}"


def _shard_windows(model: torch.nn.Module, m: Manifest) -> Dict[str, Window]:
    """The optimizer-state keys of the model's sharded parameters -> this rank's shard of them (its boxes)."""
    out: Dict[str, Window] = {}
    saved = (m.optimizer or {}).get("state", {})
    for name, p in model.named_parameters():
        if is_sharded(p):
            window = (tuple(p.to_local().shape), local_boxes(p))
            for k in tensor_refs(saved.get(name, {})):
                d = m.describe(k)
                if d is not None and d[1] == list(p.shape):
                    out[k] = window
    return out


def _as_shards(state: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
    """A sharded parameter's optimizer state, read as its shard, made DTensors like the parameter."""
    if not is_sharded(p):
        return state
    from torch.distributed.tensor import DTensor

    local = tuple(p.to_local().shape)
    return {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and tuple(v.shape) == local and v.dim() > 0 else v
            for k, v in state.items()}


def _optimizer_state_dict(optimizer, model, m: Manifest, tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The saved optimizer state for ``optimizer.load_state_dict``: numbered as the live optimizer holds its
    parameters (load_state_dict zips ids with its own params), a sharded parameter's state made DTensors."""
    names = param_names(model)
    params = optimizer_params(optimizer)
    index = {names[id(p)]: i for i, p in enumerate(params)}
    order = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    return _numbered(m.optimizer, tensors, index, order, lambda n, st: _as_shards(st, params[index[n]]))


def _saved_optimizer_state(m: Manifest, tensors: Dict[str, torch.Tensor]) -> Optional[Dict[str, Any]]:
    """The saved optimizer state in ``Optimizer.state_dict()`` form, its parameters numbered in saved order."""
    saved = m.optimizer
    if saved is None:
        return None
    index: Dict[str, int] = {}
    for g in saved["param_groups"]:
        for n in g["params"]:
            index.setdefault(n, len(index))
    return _numbered(saved, tensors, index, [g["params"] for g in saved["param_groups"]])


def _numbered(saved: Dict[str, Any], tensors: Dict[str, torch.Tensor], index: Dict[str, int],
              order: List[List[str]], as_state=lambda n, st: st) -> Dict[str, Any]:
    """The manifest's optimizer record ``saved`` in ``Optimizer.state_dict()`` form: each parameter's state
    under its number in ``index`` (``as_state`` shapes it), each group's parameters in ``order``."""
    state = {index[n]: as_state(n, decode(st, tensors)) for n, st in saved["state"].items() if n in index}
    groups = []
    for g, names in zip(saved["param_groups"], order):
        d = {k: decode(v, tensors) for k, v in g.items() if k != "params"}
        d["params"] = [index[n] for n in names]
        groups.append(d)
    return {"state": state, "param_groups": groups}


def _check_staleness(m: Manifest, bound: int, strict: bool) -> None:
    """Refuse (strict) or warn about a composite that silently rolls training back: a layer older than
    ``bound`` checkpoints (the caller's, see :func:`_bound`), unless the save proved it bit-identical to its
    persisted version (``LayerEntry.unchanged``: every byte fingerprinted; a frozen or "unchanged" layer
    without that proof is held to the bound like any other), or a composite whose estimated fidelity cost
    exceeds ``MAX_LAG`` checkpoint intervals of progress."""
    behind = m.steps_behind()
    old = sorted((n, e.age) for n, e in m.layers.items() if e.age > bound and not e.unchanged)
    problems = []
    if old:
        oldest = max(a for _, a in old)
        problems.append(
            f"{len(old)} layer(s) older than max_staleness={bound} checkpoints and not proven unchanged: "
            + ", ".join(f"{n} (age {a}, {behind[n]} steps)" for n, a in old)
            + f"; to restore them, pass config=Config(max_staleness={oldest}) or more (the bound is the caller's, "
            f"or the default {Config.max_staleness}, never the one the checkpoint recorded)")
    if m.loss_increase is not None:
        rollback = m.loss_increase > MAX_LOSS_INCREASE
        what = f"raise the training loss by {m.loss_increase:.2%} (more than {MAX_LOSS_INCREASE:.0%})"
    else:
        rollback = m.lag is not None and m.lag > MAX_LAG
        what = f"give up {m.lag or 0:.1f} checkpoint intervals of training progress (more than {MAX_LAG})"
    if rollback:
        worst = sorted(((e.cost or 0.0, n) for n, e in m.layers.items() if not e.frozen), reverse=True)[:3]
        problems.append(
            f"restoring the composite of step {m.step} is estimated to {what}: its layers trail it by up to "
            f"{max(behind.values(), default=0)} steps, costliest " + ", ".join(
                f"{n} ({behind[n]} steps behind)" for _, n in worst)
            + "; a lower Config.fidelity (or threshold) persists them sooner")
    if not problems:
        return
    msg = "; ".join(problems)
    if strict:
        raise StalenessError(msg + "; pass strict=False to restore anyway")
    log.warning("layerckpt: %s", msg)
