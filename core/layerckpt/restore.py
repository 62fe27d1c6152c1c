"""restore(): read a committed checkpoint back into a model (and optimizer)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _dist, _fetch, _policy as policy, _store
from ._backend import checksum_function, make_backend
from ._codec import decode, tensor_refs
from ._flush import wait_for_saves
from ._gather import model_state, optimizer_params, param_names, set_rng_state, shard_rows
from ._layout import CODES, DTYPES
from ._manifest import Manifest, is_rng, load_manifest, model_key, model_name, parse_once, row_pieces, split_piece
from ._read import Want, read_into, read_views
from ._stage import BufferPool
from .config import Config
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, StalenessError

log = logging.getLogger("layerckpt")

# What a composite may be estimated to give up before a restore warns (strict: raises): a fraction of the
# training loss where the save knew it, else checkpoint intervals of progress.
MAX_LOSS_INCREASE = 0.01
MAX_LAG = 1.0


@dataclass
class RestoreReport:
    step: int
    layers: Dict[str, int]  # layer -> step its newest version was persisted at
    staleness: Dict[str, int]  # layer -> checkpoints it lags the restored step
    max_staleness: int
    bytes_read: int
    extra: Dict[str, Any]
    manifest: str
    seconds: float = 0.0
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    mismatched: List[str] = field(default_factory=list)
    layer_bytes: Dict[str, int] = field(default_factory=dict)  # layer -> bytes of its tensors read
    staleness_steps: Dict[str, int] = field(default_factory=dict)  # layer -> steps it trails the restored step
    cost: Optional[float] = None  # estimated fidelity cost: first-order loss the stale layers give up
    lag: Optional[float] = None  # the same in checkpoint intervals of training progress
    loss_increase: Optional[float] = None  # the same as a fraction of the training loss at the save


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
    a fresher composite, that one is read (``_fetch``).
    """
    src = _fetch.source(dirpath, step, config)  # a URL, or a fresher composite on the memory or remote tier
    if src is not None:
        return src.read(lambda root, s: restore(root, model, optimizer, s, strict, config=config))
    t0 = time.perf_counter()
    cfg = config or Config()
    root = _store.local_path(dirpath)
    wait_for_saves(root)  # a save of this process into root commits (or fails) first
    mpath = _store.resolve(root, step)
    m = load_manifest(mpath)

    # -- what goes where: model tensors, optimizer state, rng, extra
    plan = _ModelPlan(model, m, strict)
    opt_keys = _optimizer_keys(optimizer, model, m, strict) if optimizer is not None else []
    rng = _rng_for_this_rank(m)
    meta_keys = set(tensor_refs(rng or {})) if cfg.restore_rng else set()
    meta_keys |= set(tensor_refs(m.extra or {}))
    other = m.model_other  # non-tensor state_dict entries, e.g. a module's _extra_state
    meta_keys |= set(tensor_refs(other))
    meta_keys |= set(tensor_refs((m.optimizer or {}).get("param_groups", []))) if optimizer is not None else set()
    needed = set(plan.keys) | set(opt_keys) | meta_keys
    _check_staleness(m, config.max_staleness if config is not None else None, strict)

    # -- read.  Optimizer state, RNG and extra go into one fresh buffer each file
    # and stay there as views (no second copy); they are read and verified first,
    # so damage there leaves the model untouched.  Model tensors already have
    # memory: they are read through a few reused bounce buffers straight into it.
    check = checksum_function(m.checksum) if cfg.verify_checksums else None
    backend = make_backend(cfg.backend, cfg.queue_depth)
    pool = BufferPool(cfg.chunk_bytes, cfg.chunk_bytes * min(4, cfg.queue_depth))  # bounce buffers
    try:
        tensors, total = read_tensors(root, m, mpath, sorted(needed - set(plan.keys)), backend, check, cfg,
                                      windows=_shard_windows(model, m) if optimizer is not None else None)
        total += _read_model(root, m, mpath, plan, backend, pool, check, cfg)
    except CheckpointCorruptError as e:
        raise _with_layer(e, m) from None
    finally:
        backend.close()
        pool.close()

    if other:
        wanted = set(model.state_dict())
        model.load_state_dict({k: v for k, v in decode(other, tensors).items() if k in wanted}, strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_dict(optimizer, model, m, tensors))
    if cfg.restore_rng and rng:
        set_rng_state(rng, tensors)
    layers = {name: e.step for name, e in m.layers.items()}
    ages = {name: e.age for name, e in m.layers.items()}
    layer_bytes = {name: sum(m.tensors[k].nbytes for k in e.tensors if split_piece(k)[0] in needed)
                   for name, e in m.layers.items()}
    return RestoreReport(
        step=m.step, layers=layers, staleness=ages, max_staleness=max(ages.values(), default=0),
        bytes_read=total, extra=decode(m.extra or {}, tensors), manifest=mpath,
        seconds=time.perf_counter() - t0, missing=plan.missing, unexpected=plan.unexpected,
        mismatched=plan.mismatched, layer_bytes=layer_bytes, staleness_steps=m.steps_behind(), cost=m.cost,
        lag=m.lag, loss_increase=m.loss_increase,
    )


@dataclass
class LoadedCheckpoint:
    """A committed checkpoint read into fresh memory, for frameworks that load from dicts."""
    step: int
    model: Dict[str, torch.Tensor]  # every state_dict name (tied names share one tensor) -> tensor
    model_other: Dict[str, Any]  # non-tensor state_dict entries
    optimizer: Optional[Dict[str, Any]]  # Optimizer.state_dict() form; parameters numbered in saved order
    extra: Dict[str, Any]
    rng: Optional[Dict[str, Any]]  # this rank's RNG states; apply with restore_rng()
    manifest: str
    layers: Dict[str, int]
    staleness: Dict[str, int]
    max_staleness: int
    bytes_read: int
    seconds: float = 0.0
    _rng_tensors: Dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def restore_rng(self) -> None:
        """Set python/numpy/torch (and CUDA) RNG to their state at the save."""
        if self.rng:
            set_rng_state(self.rng, self._rng_tensors)


@parse_once()
def read_checkpoint(path: Union[str, os.PathLike], step: Optional[int] = None, *,
                    config: Optional[Config] = None, strict: bool = True) -> LoadedCheckpoint:
    """Read the checkpoint at ``path`` (a checkpoint directory, or one of its manifests) into fresh tensors.

    Unlike :func:`restore` this needs no model or optimizer: the model comes back
    as a state dict and the optimizer state in ``Optimizer.state_dict()`` form.
    Checksums are verified; nothing is unpickled.  ``path`` may also be a remote URL, as for :func:`restore`.
    """
    src = _fetch.source(path, step, config)  # a URL, or a fresher composite on the memory or remote tier
    if src is not None:
        return src.read(lambda root, s: read_checkpoint(root, s, config=config, strict=strict))
    t0 = time.perf_counter()
    cfg = config or Config()
    root, located = _store.locate(path)
    wait_for_saves(root)
    if step is not None and located is not None and step != located:
        raise CheckpointError(f"{path} is the checkpoint of step {located}, but step={step} was asked for")
    mpath = _store.resolve(root, located if step is None else step)
    m = load_manifest(mpath)
    _check_staleness(m, config.max_staleness if config is not None else None, strict)
    rng = _rng_for_this_rank(m)
    saved_opt = m.optimizer
    keys = {k for k in m.logical_keys() if not is_rng(k)}
    keys |= set(tensor_refs(rng or {}))
    check = checksum_function(m.checksum) if cfg.verify_checksums else None
    backend = make_backend(cfg.backend, cfg.queue_depth)
    try:
        tensors, total = read_tensors(root, m, mpath, sorted(keys), backend, check, cfg)
    except CheckpointCorruptError as e:
        raise _with_layer(e, m) from None
    finally:
        backend.close()
    model = {model_name(k): t for k, t in tensors.items() if model_name(k) is not None}
    for alias, canon in m.aliases.items():
        model[alias] = model[canon]
    optimizer = None
    if saved_opt is not None:
        index: Dict[str, int] = {}
        for g in saved_opt["param_groups"]:
            for n in g["params"]:
                index.setdefault(n, len(index))
        groups = []
        for g in saved_opt["param_groups"]:
            d = {k: decode(v, tensors) for k, v in g.items() if k != "params"}
            d["params"] = [index[n] for n in g["params"]]
            groups.append(d)
        optimizer = {"state": {index[n]: decode(st, tensors) for n, st in saved_opt["state"].items()},
                     "param_groups": groups}
    ages = {name: e.age for name, e in m.layers.items()}
    return LoadedCheckpoint(
        step=m.step, model=model, model_other=decode(m.model_other, tensors),
        optimizer=optimizer, extra=decode(m.extra or {}, tensors), rng=rng if cfg.restore_rng else None,
        manifest=mpath, layers={name: e.step for name, e in m.layers.items()}, staleness=ages,
        max_staleness=max(ages.values(), default=0), bytes_read=total, seconds=time.perf_counter() - t0,
        _rng_tensors=tensors,
    )


def read_tensors(root: str, m: Manifest, mpath: str, keys: List[str], backend, check, cfg: Config,
                 windows: Optional[Dict[str, Tuple[int, int]]] = None) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read the named tensors of manifest ``m`` (file by file, checksums verified); a tensor stored in
    row blocks comes back whole, or, for a key in ``windows``, only its rows [a, b) (e.g. this rank's
    shard), read from the blocks that hold them."""
    windows = windows or {}
    out: Dict[str, torch.Tensor] = {}
    targets: List[Tuple[str, torch.Tensor, int, int]] = []
    plain: List[str] = []
    for k in keys:
        desc = m.describe(k)
        if desc is None:
            raise CheckpointCorruptError(f"manifest {mpath} refers to tensor {k!r} but has no entry for it",
                                         path=mpath, tensor=k)
        if k in (m.blocks or {}) or k in windows:
            a, b = windows.get(k, (0, desc[1][0] if desc[1] else 1))
            out[k] = t = torch.empty([b - a, *desc[1][1:]], dtype=CODES[desc[0]])
            targets.append((k, t, a, b))
        else:
            plain.append(k)
    pool = BufferPool(cfg.chunk_bytes, cfg.chunk_bytes * min(4, cfg.queue_depth))  # bounce buffers
    try:
        read, total = _read_targets(root, m, mpath, targets, plain, backend, pool, check, cfg)
    finally:
        pool.close()
    out.update({k: read[k] for k in plain})
    return out, total


def _read_targets(root: str, m: Manifest, mpath: str, targets, plain: List[str], backend, pool, check,
                  cfg: Config) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read the ``plain`` keys into fresh memory, and each target's rows (see :func:`_route`) into the
    target, file by file; returns the fresh tensors and the bytes read."""
    direct, partial = _route(m, targets)
    by_file: Dict[str, List[Want]] = {}
    for k in list(dict.fromkeys(plain + sorted({src for src, _, _, _ in partial}))) + list(direct):
        by_file.setdefault(m.tensors[k].file, []).append(Want.from_entry(k, m.tensors[k]))
    total = 0
    read: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for fname, wants in sorted(by_file.items()):
            path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest {mpath}")
            ins = [w for w in wants if w.key in direct]
            if ins:
                total += read_into(backend, pool, path, m.files[fname].size, ins, direct, check, direct=cfg.direct_io)
            rest = [w for w in wants if w.key not in direct]
            if rest:
                views, n = read_views(backend, path, m.files[fname].size, rest, check, cfg.chunk_bytes,
                                      direct=cfg.direct_io)
                read.update(views)
                total += n
        _copy_partial(partial, read)
    return read, total


def _route(m: Manifest, targets) -> Tuple[Dict[str, torch.Tensor], List[Tuple[str, torch.Tensor, int, int]]]:
    """Where each stored block of the targets goes: straight into the target's rows where the block lies
    inside them (``direct``: block key -> byte view), else read whole and its overlap copied
    (``partial``: (stored key, target rows view, first stored row, end stored row))."""
    direct: Dict[str, torch.Tensor] = {}
    partial: List[Tuple[str, torch.Tensor, int, int]] = []
    blocks = m.blocks or {}
    for key, t, a, b in targets:
        flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
        if key in blocks:
            parts = row_pieces(blocks, key)
        else:
            n = m.tensors[key].shape[0] if m.tensors[key].shape else 1
            parts = [(key, 0, n)]
        row = (t.numel() // max(b - a, 1)) * t.element_size()
        for pk, pa, pb in parts:
            lo, hi = max(a, pa), min(b, pb)
            if lo >= hi:
                continue
            if flat is not None and pa >= a and pb <= b:
                direct[pk] = flat[(pa - a) * row:(pb - a) * row]
            else:
                partial.append((pk, t[lo - a:hi - a], lo - pa, hi - pa))
    return direct, partial


def _copy_partial(partial, read: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for src, dst, a, b in partial:
            v = read[src]
            dst.copy_(v.reshape(dst.shape) if v.dim() == 0 else v[a:b])


def _read_model(root, m, mpath, plan: "_ModelPlan", backend, pool, check, cfg: Config) -> int:
    """Model tensors read straight into their memory (a DTensor's: its shard's rows)."""
    targets = []
    copy_back = []  # targets that cannot be written in place: read into a flat copy, then copied
    for name, key in plan.pairs:
        t, a, b = _local_rows(plan.targets[name])
        flat = _flat_target(t)
        if not t.is_contiguous():
            copy_back.append((t, flat))
        targets.append((key, flat.view(t.dtype).reshape(t.shape), a, b))
    _, total = _read_targets(root, m, mpath, targets, [], backend, pool, check, cfg)
    with torch.no_grad():
        for t, flat in copy_back:
            t.copy_(flat.view(t.dtype).reshape(t.shape))
    return total


def _local_rows(t: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """The tensor a restore writes into, and the rows of the saved tensor it takes: a DTensor sharded on
    dim 0 takes its shard's rows, into its local tensor; anything else every row."""
    if hasattr(t, "to_local"):
        mesh = t.device_mesh
        a, b = shard_rows(t.shape[0], mesh.size(), mesh.get_local_rank()) if _is_row_sharded(t) else (0, t.shape[0])
        return t.to_local().detach(), a, b
    return t.detach(), 0, t.shape[0] if t.dim() else 1


def _is_row_sharded(t) -> bool:
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard) and t.placements[0].dim == 0


def _flat_target(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)
    return torch.empty(t.shape, dtype=t.dtype).reshape(-1).view(torch.uint8)


class _ModelPlan:
    """Pairs each model tensor with its checkpoint key; collects every difference."""

    def __init__(self, model: torch.nn.Module, m: Manifest, strict: bool):
        tensors, aliases, _ = model_state(model)
        current = {**{n: t for n, t in tensors.items()}, **{a: tensors[c] for a, c in aliases.items()}}
        saved_alias = m.aliases
        saved = {n for n in map(model_name, m.logical_keys()) if n is not None} | set(saved_alias)

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
    return sorted(set(tensor_refs(saved["state"])))


def _shard_windows(model: torch.nn.Module, m: Manifest) -> Dict[str, Tuple[int, int]]:
    """The optimizer-state keys of the model's sharded parameters -> the rows of this rank's shard."""
    out: Dict[str, Tuple[int, int]] = {}
    saved = (m.optimizer or {}).get("state", {})
    for name, p in model.named_parameters():
        if hasattr(p, "to_local") and _is_row_sharded(p):
            _, a, b = _local_rows(p)
            for k in tensor_refs(saved.get(name, {})):
                d = m.describe(k)
                if d is not None and d[1] == list(p.shape):
                    out[k] = (a, b)
    return out


def _as_shards(state: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
    """A sharded parameter's optimizer state, read as its shard's rows, made DTensors like the parameter."""
    if not (hasattr(p, "to_local") and _is_row_sharded(p)):
        return state
    from torch.distributed.tensor import DTensor

    local = tuple(p.to_local().shape)
    return {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and tuple(v.shape) == local and v.dim() > 0 else v
            for k, v in state.items()}


def _optimizer_state_dict(optimizer, model, m, tensors) -> Dict[str, Any]:
    saved = m.optimizer
    names = param_names(model)
    params = optimizer_params(optimizer)
    index = {names[id(p)]: i for i, p in enumerate(params)}
    state = {index[n]: _as_shards(decode(st, tensors), params[index[n]])
             for n, st in saved["state"].items() if n in index}
    groups = []
    for g, cur in zip(saved["param_groups"], optimizer.param_groups):
        d = {k: decode(v, tensors) for k, v in g.items() if k != "params"}
        # order as the live optimizer holds them: load_state_dict zips ids with its own params
        d["params"] = [index[names[id(p)]] for p in cur["params"]]
        groups.append(d)
    return {"state": state, "param_groups": groups}


def _rng_for_this_rank(m: Manifest) -> Optional[Dict[str, Any]]:
    return m.rng_for(_dist.rank())


def _with_layer(e: CheckpointCorruptError, m: Manifest) -> CheckpointCorruptError:
    """Say which layer, and the step it was persisted at, a damaged tensor or file belongs to."""
    where = []
    for name, info in sorted(m.layers.items()):
        if (e.tensor is not None and e.tensor in info.tensors) or (
                e.tensor is None and e.path is not None and os.path.basename(e.path) == info.file):
            where.append(f"layer {name!r} persisted at step {info.step}")
    if not where:
        return e
    shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
    out = CheckpointCorruptError(f"{e} [{shown}]", path=e.path, tensor=e.tensor)
    out.layers = [w.split("'")[1] for w in where]
    return out


def _check_staleness(m: Manifest, bound: Optional[int], strict: bool) -> None:
    """Refuse (strict) or warn about a composite that silently rolls training back: a layer older than the
    staleness bound (frozen and unchanged layers are exempt: their old version is their current one), or a composite
    whose estimated fidelity cost exceeds ``MAX_LAG`` checkpoint intervals of progress."""
    if bound is None:
        bound = m.config.get("max_staleness", Config.max_staleness)
    behind = m.steps_behind()
    old = sorted((n, e.age) for n, e in m.layers.items()
                 if e.age > bound and not e.frozen and e.reason != policy.UNCHANGED)
    problems = []
    if old:
        problems.append(f"{len(old)} layer(s) older than max_staleness={bound} checkpoints: "
                        + ", ".join(f"{n} (age {a}, {behind[n]} steps)" for n, a in old))
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
