"""What a checkpoint holds, gathered into (key, tensor) pairs plus JSON metadata.

Model tensors are keyed ``model/<name>``, optimizer state by parameter *name*
(``optim/<name>/<state key>``), RNG states under ``rng/`` and the user's extra
under ``extra/`` (prefixes named in ``_manifest``).  Plain values go to the manifest
through ``_codec``, which never pickles.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from ..format._codec import Entries, decode, encode
from ..format._layout import DTYPES
from ..format._manifest import (EXTRA, MODEL, MODEL_OTHER, OPTIM, OPTIM_GROUPS, Boxes, RowBlocks, box_key, param_of,
                                piece_key, rng_prefix)
from ..errors import CheckpointCorruptError, CheckpointError



# ------------------------------------------------------------------ model

def _storage_key(t: torch.Tensor) -> Tuple:
    if hasattr(t, "to_local"):  # a DTensor: its shard's storage tells ties apart
        t = t.to_local()
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def model_state(model: torch.nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, str], Dict[str, Any]]:
    """(unique tensors by name, aliases name -> canonical name, non-tensor entries)."""
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    other: Dict[str, Any] = {}
    seen: Dict[Tuple, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            other[name] = value
            continue
        t = value.detach()
        sk = _storage_key(t) if t.numel() else None
        if sk is not None and sk in seen:
            aliases[name] = seen[sk]
            continue
        if sk is not None:
            seen[sk] = name
        tensors[name] = t
    return tensors, aliases, other


# ------------------------------------------------------------------ optimizer

def param_names(model: torch.nn.Module) -> Dict[int, str]:
    """id(parameter) -> its first name (tied parameters are named once)."""
    return {id(p): n for n, p in model.named_parameters()}


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    """Parameters in the order Optimizer.state_dict() numbers them."""
    seen, out = set(), []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def optimizer_state(optimizer: torch.optim.Optimizer, names: Dict[int, str], out: Entries) -> Dict[str, Any]:
    params = optimizer_params(optimizer)
    unnamed = [i for i, p in enumerate(params) if id(p) not in names]
    if unnamed:
        raise CheckpointError(
            f"the optimizer holds {len(unnamed)} parameter(s) that are not parameters of the model "
            f"(indices {unnamed[:5]}); pass the model that owns every optimized parameter"
        )
    idx_name = [names[id(p)] for p in params]
    sd = optimizer.state_dict()
    state = {}
    for idx, st in sd["state"].items():
        name = idx_name[idx]
        state[name] = {k: encode(v, f"{OPTIM}{name}/{k}", out, f"optimizer.state[{name}][{k!r}]") for k, v in st.items()}
    groups = []
    for gi, g in enumerate(sd["param_groups"]):
        enc = {k: encode(v, f"{OPTIM_GROUPS}/{gi}/{k}", out, f"optimizer.param_groups[{gi}][{k!r}]")
               for k, v in g.items() if k != "params"}
        enc["params"] = [idx_name[i] for i in g["params"]]
        groups.append(enc)
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "param_groups": groups, "state": state}


# ------------------------------------------------------------------ RNG

def rng_state(out: Entries, rank: int = 0) -> Dict[str, Any]:
    k = rng_prefix(rank)
    st: Dict[str, Any] = {
        "python": encode(random.getstate(), f"{k}/python", out, "python RNG"),
        "numpy": encode(np.random.get_state(), f"{k}/numpy", out, "numpy RNG"),
        "torch": encode(torch.get_rng_state(), f"{k}/torch", out, "torch RNG"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = encode(torch.cuda.get_rng_state_all(), f"{k}/cuda", out, "CUDA RNG")
    return st


def rng_values(st: Any, tensors: Dict[str, torch.Tensor], where: str) -> Dict[str, Any]:
    """The saved RNG states ``st`` decoded, each proven settable on a scratch generator of its kind, so that a
    restore sets them only once everything is known to load; a damaged entry is a CheckpointCorruptError
    naming it.  A kind this layerckpt does not know is left out."""
    if not isinstance(st, dict):
        raise _bad_rng(where, "the record", f"a {type(st).__name__}, not an object")
    out: Dict[str, Any] = {}
    for kind, raw in st.items():
        try:
            v = decode(raw, tensors)
            if kind == "python":
                v = (v[0], tuple(v[1]), v[2])
                random.Random().setstate(v)
            elif kind == "numpy":
                np.random.RandomState().set_state(v)
            elif kind == "torch":
                # a tensor of its own: set_rng_state reads from the start of the storage, and a restored
                # state can be a view into a shared read buffer
                v = v.clone()
                torch.Generator().set_state(v)
            elif kind == "cuda":
                v = [s.clone() for s in v]
                if not all(s.dtype == torch.uint8 and s.dim() == 1 for s in v):
                    raise TypeError("each device's state must be a 1-D uint8 tensor")
            else:
                continue
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
            raise _bad_rng(where, f"the {kind} state", f"{type(e).__name__}: {e}") from None
        out[kind] = v
    return out


def _bad_rng(where: str, what: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"manifest {where}: {what} of the saved RNG is malformed ({why}); the manifest was edited or damaged: "
        f"restore another step, or restore without the RNG (Config(restore_rng=False))", path=where)


def set_rng_state(values: Dict[str, Any]) -> None:
    """Set the RNGs to states :func:`rng_values` decoded and checked."""
    if "python" in values:
        random.setstate(values["python"])
    if "numpy" in values:
        np.random.set_state(values["numpy"])
    if "torch" in values:
        torch.set_rng_state(values["torch"])
    if "cuda" in values and torch.cuda.is_available() and len(values["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(values["cuda"])


# ------------------------------------------------------------------ sharded tensors

def shard_rows(n: int, world: int, i: int) -> Tuple[int, int]:
    """Rows [a, b) of an n-row tensor that shard ``i`` of ``world`` holds under ``Shard(0)``: torch.chunk's
    split, which FSDP2 uses (the last shards may be short or empty)."""
    per = -(-n // world) if world else n
    return min(i * per, n), min((i + 1) * per, n)


def shard_entries(entries: Entries) -> Tuple[Entries, Dict[str, Union[RowBlocks, Boxes]]]:
    """DTensors (FSDP2's, tensor parallel's, HSDP's parameters and their optimizer state) become the boxes of
    the whole tensor this rank writes: its local shard's, unless another replica of it writes them.  Returns
    the entries and every sharded tensor's pieces on all ranks: row blocks where every piece spans the whole
    of the other dims (FSDP2 on a 1-D mesh), else boxes."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is None:  # nothing imported it, so no tensor is a DTensor (and its import is slow)
        return entries, {}
    out: Entries = []
    shards: Dict[str, Union[RowBlocks, Boxes]] = {}
    held: List[Tuple[str, Any, Layout]] = []
    for k, t in entries:
        if not isinstance(t, dt.DTensor):
            out.append((k, t))
            continue
        _refuse_partial(k, t)
        if not any(shards_dim(p) for p in t.placements):
            out.append((k, t.to_local()))  # the same on every rank: saved once, as any other tensor
            continue
        layout = layout_boxes(k, t)
        shards[k] = _record(k, t, layout)
        held.append((k, t, layout))
    me = torch.distributed.get_rank() if held else 0
    for k, t, layout in held:
        sc = layout.shard_coord(tuple(t.device_mesh.get_coordinate() or ()))
        local = t.to_local()
        for offsets, sizes, sl in layout.written[sc][layout.holders[sc].index(me)]:
            piece = local[sl] if sl else local
            key = (piece_key(k, offsets[0], offsets[0] + sizes[0]) if isinstance(shards[k], RowBlocks)
                   else box_key(k, offsets, sizes))
            out.append((key, piece if piece.is_contiguous() else piece.contiguous()))
    return out, shards


def shards_dim(p) -> bool:
    """Whether the placement ``p`` shards a tensor dim: ``Shard(d)``, or ``_StridedShard`` (which is no Shard)."""
    return p.is_shard() or (not p.is_replicate() and not p.is_partial() and hasattr(p, "dim")
                            and hasattr(p, "_split_tensor"))


def _refuse_partial(k: str, t) -> None:
    bad = [p for p in t.placements if p.is_partial()]
    if bad:
        raise CheckpointError(
            f"{k} is a DTensor with placements {t.placements}: a Partial placement holds summands of the tensor, "
            f"not its values, and has no saved meaning; reduce it first (e.g. t.redistribute(placements=[Replicate()"
            f" or Shard(d) ...]) or full_tensor()) before saving")


def _record(k: str, t, layout: "Layout") -> Union[RowBlocks, Boxes]:
    """Every rank's pieces of ``t``: row blocks where each spans the whole of the other dims, else boxes."""
    pieces = sorted({(tuple(o), tuple(s)) for parts in layout.written.values() for boxes in parts
                     for o, s, _ in boxes})
    shape = list(t.shape)
    if pieces and t.dim() >= 1 and all(list(o[1:]) == [0] * (t.dim() - 1) and list(s[1:]) == shape[1:] for o, s in pieces):
        return RowBlocks(dtype=DTYPES[t.dtype], shape=shape, rows=[[o[0], o[0] + s[0]] for o, s in pieces])
    return Boxes(dtype=DTYPES[t.dtype], shape=shape, boxes=[[list(o), list(s)] for o, s in pieces])


class Layout:
    """Where the shards of a DTensor lie: for each coordinate on the mesh's sharding dims, the boxes of the whole
    tensor its local tensor holds, ``(offsets, sizes, local slices)``, and the global ranks holding them (the
    replicas: the mesh's other dims, and the copies of the mesh a parameter sharded over a slice of a bigger mesh
    has, FSDP2's dp dim beside a tensor parallel dim)."""

    def __init__(self, placements, boxes: Dict[Tuple[int, ...], List[Box]], holders: Dict[Tuple[int, ...], List[int]]):
        self.sharding = [d for d, p in enumerate(placements) if shards_dim(p)]
        self.boxes = boxes
        self.holders = holders
        #: what each holder of a shard writes (by its place in ``holders``): the shard's boxes cut on their first
        #: dim among its holders as torch.chunk splits, so that replicas share the writing and each byte is
        #: written once
        self.written = {sc: [_cut(bx, len(holders[sc]), i) for i in range(len(holders[sc]))]
                        for sc, bx in boxes.items()}

    def shard_coord(self, coord: Tuple[int, ...]) -> Tuple[int, ...]:
        return tuple(coord[d] for d in self.sharding)


Box = Tuple[List[int], List[int], Tuple[slice, ...]]


def _cut(boxes: List[Box], n: int, i: int) -> List[Box]:
    """The part ``i`` of ``n`` of each box: its rows ``shard_rows`` gives part ``i`` (a 0-dim box: part 0's)."""
    out: List[Box] = []
    for o, s, sl in boxes:
        if not s:
            out.extend([(o, s, sl)] if i == 0 else [])
            continue
        a, b = shard_rows(s[0], n, i)
        if a < b:
            out.append(([o[0] + a] + o[1:], [b - a] + s[1:], (slice(sl[0].start + a, sl[0].start + b),) + sl[1:]))
    return out


def layout_boxes(k: str, t) -> Layout:
    """The :class:`Layout` of the DTensor ``t`` (its placements applied to index ranges, as DTensor applies them
    to the tensor: ``_StridedShard`` resolved to the boxes each rank really holds); this rank's local tensor
    checked to be the shard it computes."""
    mesh, placements = t.device_mesh, t.placements
    order = _order(t)
    layout = _layout(tuple(t.shape), mesh, tuple(placements), None if order is None else tuple(
        (d, tuple(ms)) for d, ms in sorted(order.items())))
    me = mesh.get_coordinate()
    if me is not None:
        held = layout.boxes[layout.shard_coord(tuple(me))]  # a grid of boxes covering the local tensor
        local = tuple(t.to_local().shape)
        if (local != tuple(max(sl[d].stop for _, _, sl in held) for d in range(t.dim()))) if held else math.prod(local):
            raise CheckpointError(
                f"{k}: this rank's shard has shape {tuple(t.to_local().shape)}, not the one its placements "
                f"{placements} on a mesh of shape {tuple(mesh.shape)} cut from {tuple(t.shape)} (padded or uneven "
                f"sharding other than torch.chunk's is not supported)")
    return layout


@functools.lru_cache(maxsize=1024)
def _layout(gshape: Tuple[int, ...], mesh, placements: tuple, order) -> Layout:
    """Every shard coordinate's boxes and holders (a save's weights and optimizer states share one computation)."""
    shape = tuple(mesh.shape)
    sharding = [d for d, p in enumerate(placements) if shards_dim(p)]
    boxes: Dict[Tuple[int, ...], List[Box]] = {}
    for sc in itertools.product(*(range(shape[d]) for d in sharding)):
        coord = [0] * len(shape)
        for d, c in zip(sharding, sc):
            coord[d] = c
        boxes[sc] = _boxes_at(list(gshape), shape, coord, placements, None if order is None else dict(order))
    holders: Dict[Tuple[int, ...], List[int]] = {sc: [] for sc in boxes}
    for copy in _copies(mesh):
        for coord in itertools.product(*map(range, shape)):
            holders[tuple(coord[d] for d in sharding)].append(int(copy[coord]))
    return Layout(placements, boxes, {sc: sorted(r) for sc, r in holders.items()})


def _copies(mesh) -> List[torch.Tensor]:
    """The global ranks of ``mesh`` and of each copy of it in its root mesh (the root's dims along which the
    mesh's ranks all sit at one coordinate are the dims it was sliced out of), each shaped as the mesh."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
    if root is None or root.size() == mesh.size():
        return [mesh.mesh]
    full = root.mesh
    coords = [(full == r).nonzero()[0].tolist() for r in mesh.mesh.flatten().tolist()]
    fixed = [d for d in range(full.dim()) if len({c[d] for c in coords}) == 1]
    if math.prod(full.shape[d] for d in fixed) * mesh.size() != root.size():
        raise CheckpointError(
            f"a DTensor is on a mesh of ranks {mesh.mesh.flatten().tolist()} that is not a slice of its root mesh "
            f"{full.tolist()}; layerckpt cannot tell which copy of it writes its shards: shard it over a slice of "
            f"the root mesh (mesh['dp']) or the root mesh itself")
    out = []
    for at in itertools.product(*(range(full.shape[d]) for d in fixed)):
        ranks = []
        for c in coords:
            c = list(c)
            for d, x in zip(fixed, at):
                c[d] = x
            ranks.append(int(full[tuple(c)]))
        out.append(torch.tensor(ranks).reshape(mesh.mesh.shape))
    return out


def _order(t) -> Optional[Dict[int, List[int]]]:
    """Tensor dim -> the mesh dims sharding it, in the order they apply, where the DTensor records an order
    (without ``_StridedShard``); None: left to right, as ``_StridedShard`` placements are written."""
    spec = getattr(t, "_spec", None)
    order = getattr(spec, "shard_order", None)
    if not order:
        return None
    return {e.tensor_dim: list(e.mesh_dims) for e in order}


def _boxes_at(gshape: List[int], mesh_shape, coord, placements, order) -> List[Box]:
    """The boxes of the whole tensor that the rank at ``coord`` holds, each with where it lies in the rank's local
    tensor."""
    runs = []
    for dim, n in enumerate(gshape):
        idx = torch.arange(n).reshape([n if i == dim else 1 for i in range(len(gshape))])  # split as the tensor
        mesh_dims = order.get(dim, []) if order is not None else [
            d for d, p in enumerate(placements) if shards_dim(p) and p.dim == dim]
        for d in mesh_dims:
            idx = placements[d]._split_tensor(idx, mesh_shape[d], with_padding=False)[0][coord[d]]
        runs.append(_runs(idx.reshape(-1)))
    return [([g for _, g, _ in combo], [n for _, _, n in combo], tuple(slice(i, i + n) for i, _, n in combo))
            for combo in itertools.product(*runs)]


def _runs(idx: torch.Tensor) -> List[Tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices (none if ``idx`` is empty)."""
    if idx.numel() == 0:
        return []
    starts = [0] + (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    ends = starts[1:] + [idx.numel()]
    return [(a, g, b - a) for a, b, g in zip(starts, ends, idx[starts].tolist())]


def grad_bias(optimizer: torch.optim.Optimizer, named: List[Tuple[str, torch.nn.Parameter]]) -> Dict[str, float]:
    """``1 - beta1^step`` of each parameter whose optimizer keeps Adam's ``exp_avg``, by name, where it is below
    0.9999: an average that starts at zero falls that much short of the gradients it averages until its steps add
    up (2x at step 6 with beta1 0.9), and the selection divides it by this before pricing a layer with it."""
    names = {id(p): n for n, p in named}
    found: List[Tuple[str, float, Any]] = []
    for g in optimizer.param_groups:
        betas = g.get("betas")
        if not isinstance(betas, (tuple, list)) or not betas:
            continue
        for p in g["params"]:
            st = optimizer.state.get(p)
            if st and "exp_avg" in st and "step" in st and id(p) in names:
                found.append((names[id(p)], float(betas[0]), st["step"]))
    if not found:
        return {}
    on_device = [s for _, _, s in found if torch.is_tensor(s) and not s.is_cpu]  # capturable Adam: one sync
    device_steps = iter(torch.stack([s.float() for s in on_device]).tolist() if on_device else [])
    out: Dict[str, float] = {}
    for name, beta1, step in found:
        t = next(device_steps) if torch.is_tensor(step) and not step.is_cpu else float(step)
        b = 1.0 - beta1 ** t
        if 0.0 < b < 0.9999:
            out[name] = b
    return out


def gather(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Optional[dict],
           rank: int = 0) -> Tuple[Entries, Dict[str, Any]]:
    """Everything one save holds: tensors to stage, and the manifest's JSON parts (and ``requires_grad``: each
    parameter's flag, by name, for the selection)."""
    entries: Entries = []
    tensors, aliases, other = model_state(model)
    entries.extend((MODEL + n, t) for n, t in tensors.items())
    named = list(model.named_parameters())  # one walk of the modules for both uses
    meta: Dict[str, Any] = {
        "model": {"aliases": aliases,
                  "other": encode(other, MODEL_OTHER, entries, "model.state_dict() non-tensor entry")},
        "optimizer": optimizer_state(optimizer, {id(p): n for n, p in named}, entries) if optimizer is not None
        else None,
        "requires_grad": {n: p.requires_grad for n, p in named},  # for the selection (not the manifest)
        "grad_bias": grad_bias(optimizer, named) if optimizer is not None else {},  # for the selection too
        "rng": rng_state(entries, rank),
        "extra": encode(extra if extra is not None else {}, EXTRA, entries, "extra"),
    }
    _check_unique(entries)
    return entries, meta


def _check_unique(entries: Entries) -> None:
    """Refuse two tensors under one key (``extra={'a/b': t, 'a': {'b': u}}``): one would be read back as both."""
    seen = set()
    for k, _ in entries:
        if k in seen:
            raise CheckpointError(
                f"two tensors would be stored under the key {k!r}: a dict key holding '/' names the same place as "
                f"nested dicts (e.g. extra['a/b'] and extra['a']['b']); rename one of them")
        seen.add(k)
