"""What a checkpoint holds, gathered into (key, tensor) pairs plus JSON metadata.

Model tensors are keyed ``model/<name>``, optimizer state by parameter *name*
(``optim/<name>/<state key>``), RNG states under ``rng/`` and the user's extra
under ``extra/`` (prefixes named in ``_manifest``).  Plain values go to the manifest
through ``_codec``, which never pickles.
"""
from __future__ import annotations

import random
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ._codec import Entries, decode, encode
from ._layout import DTYPES
from ._manifest import EXTRA, MODEL, MODEL_OTHER, OPTIM, OPTIM_GROUPS, RowBlocks, piece_key, rng_prefix
from .errors import CheckpointError



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


def set_rng_state(st: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
    if "python" in st:
        v = decode(st["python"], tensors)
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "numpy" in st:
        np.random.set_state(decode(st["numpy"], tensors))
    if "torch" in st:
        # a tensor of its own: set_rng_state reads from the start of the storage, and a restored
        # state can be a view into a shared read buffer
        torch.set_rng_state(decode(st["torch"], tensors).clone())
    if "cuda" in st and torch.cuda.is_available():
        states = decode(st["cuda"], tensors)
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.clone() for s in states])


# ------------------------------------------------------------------ sharded tensors

def shard_rows(n: int, world: int, i: int) -> Tuple[int, int]:
    """Rows [a, b) of an n-row tensor that shard ``i`` of ``world`` holds under ``Shard(0)``: torch.chunk's
    split, which FSDP2 uses (the last shards may be short or empty)."""
    per = -(-n // world) if world else n
    return min(i * per, n), min((i + 1) * per, n)


def shard_entries(entries: Entries) -> Tuple[Entries, Dict[str, RowBlocks]]:
    """DTensors (FSDP2's parameters and their optimizer state) become this rank's shard, keyed as the row
    block it is of the whole tensor; returns the entries and every sharded tensor's blocks on all ranks."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is None:  # nothing imported it, so no tensor is a DTensor (and its import is slow)
        return entries, {}
    DTensor, Replicate, Shard = dt.DTensor, dt.Replicate, dt.Shard
    out: Entries = []
    shards: Dict[str, RowBlocks] = {}
    for k, t in entries:
        if not isinstance(t, DTensor):
            out.append((k, t))
            continue
        mesh, placements = t.device_mesh, t.placements
        if mesh.ndim == 1 and isinstance(placements[0], Replicate):
            out.append((k, t.to_local()))  # the same on every rank: saved once, as any other tensor
            continue
        if mesh.ndim != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0 or t.dim() == 0:
            raise CheckpointError(
                f"{k} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; layerckpt saves "
                f"DTensors sharded on dim 0 of a 1-D mesh (FSDP2's fully_shard) or replicated")
        world, me = mesh.size(), mesh.get_local_rank()
        local = t.to_local()
        a, b = shard_rows(t.shape[0], world, me)
        if tuple(local.shape) != (b - a, *t.shape[1:]):
            raise CheckpointError(
                f"{k}: this rank's shard has shape {tuple(local.shape)}, not rows {a}:{b} of {tuple(t.shape)} as "
                f"torch.chunk would split it (padded or uneven sharding is not supported)")
        rows = [list(r) for r in (shard_rows(t.shape[0], world, i) for i in range(world)) if r[0] < r[1]]
        shards[k] = RowBlocks(dtype=DTYPES[t.dtype], shape=list(t.shape), rows=rows)
        if a < b:
            out.append((piece_key(k, a, b), local))
    return out, shards


def gather(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Optional[dict],
           rank: int = 0) -> Tuple[Entries, Dict[str, Any]]:
    """Everything one save holds: tensors to stage, and the manifest's JSON parts."""
    entries: Entries = []
    tensors, aliases, other = model_state(model)
    entries.extend((MODEL + n, t) for n, t in tensors.items())
    meta: Dict[str, Any] = {
        "model": {"aliases": aliases,
                  "other": encode(other, MODEL_OTHER, entries, "model.state_dict() non-tensor entry")},
        "optimizer": optimizer_state(optimizer, param_names(model), entries) if optimizer is not None else None,
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
