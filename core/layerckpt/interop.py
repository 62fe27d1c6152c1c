"""Interop with ``torch.distributed.checkpoint`` (DCP): a composite out as a DCP checkpoint, a DCP
checkpoint in as a layerckpt store.

The DCP checkpoint holds what ``get_model_state_dict`` and ``get_optimizer_state_dict``
(``torch.distributed.checkpoint.state_dict``) give for a plain, unsharded model, under ``"model"`` and
``"optim"``: tensors named as in ``model.state_dict()`` (tied names each present), optimizer state keyed
by parameter name (``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...], ...}]}``); DCP
reshards it on load onto any world size.

``layerckpt export DIR --dcp OUT_DIR`` runs :func:`export_dcp`; importing needs the model (and
optimizer) to load into, so :func:`import_dcp` is Python only.

PEFT: :func:`peft_extra` is what a save records of a ``peft.PeftModel``'s adapters (the Trainer and Lightning
adapters record it at every save), :func:`export_peft` writes a composite's adapter as PEFT's ``save_pretrained``
does (``layerckpt export DIR --peft OUT_DIR``); see ``layerckpt._peft``.
"""
from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Union

import torch

from .format._manifest import load_manifest
from ._peft import export_peft, peft_extra
from .format._store import fsync_dir
from .config import Config
from .errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .restore import read_checkpoint

__all__ = ["export_dcp", "import_dcp", "dcp_state", "load_dcp", "export_peft", "peft_extra"]

MODEL = "model"
OPTIM = "optim"

PathLike = Union[str, "os.PathLike[str]"]


def dcp_state(path: PathLike, step: Optional[int] = None, pretrained: Optional[PathLike] = None) -> Dict[str, Any]:
    """The checkpoint at ``path`` (a store or one of its manifests; the newest, or that of ``step``) as
    the state dict ``dcp.save`` takes: ``{"model": ..., "optim": ...}`` (no ``"optim"`` without optimizer
    state), in fresh memory, checksums verified.  ``pretrained``: the pretrained weights the training started
    from, for a checkpoint that holds tensors by reference to them (``Config.pretrained``)."""
    # a stale composite is still what was saved
    ck = read_checkpoint(path, step=step, strict=False, config=pretrained_config(pretrained))
    state: Dict[str, Any] = {MODEL: {**ck.model_other, **ck.model}}  # tied names share one tensor, as in a model
    if ck.optimizer is not None:
        state[OPTIM] = _by_name(ck.optimizer, load_manifest(ck.manifest).optimizer or {})
    return state


def _by_name(numbered: Dict[str, Any], saved: Dict[str, Any]) -> Dict[str, Any]:
    """``Optimizer.state_dict()`` form (parameters numbered) -> keyed by parameter name, as DCP's
    ``get_optimizer_state_dict`` gives it.  Numbers follow first appearance in the saved groups, as
    ``read_checkpoint`` gave them."""
    index: Dict[str, int] = {}
    for g in saved.get("param_groups", []):
        for n in g["params"]:
            index.setdefault(n, len(index))
    names = list(index)
    groups = []
    for g in numbered["param_groups"]:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = [names[i] for i in g["params"]]
        groups.append(d)
    return {"state": {names[i]: st for i, st in numbered["state"].items()}, "param_groups": groups}


def export_dcp(path: PathLike, out_dir: PathLike, step: Optional[int] = None,
               pretrained: Optional[PathLike] = None) -> str:
    """Write the checkpoint at ``path`` (the newest composite, or that of ``step``) as a DCP checkpoint
    into ``out_dir``, a new or empty directory whose parent exists.  One process writes it, whole
    tensors even from a sharded store (in a torch.distributed job: call it on one rank); the directory
    appears whole (written aside, then renamed).  ``pretrained``: as for :func:`dcp_state`.  Returns
    ``out_dir``.  Load it with ``dcp.load({"model": get_model_state_dict(m), "optim":
    get_optimizer_state_dict(m, opt)}, checkpoint_id=out_dir)`` and the matching ``set_*_state_dict``."""
    import torch.distributed.checkpoint as dcp

    out = _fresh_dir(out_dir)
    state = dcp_state(path, step, pretrained)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        with _single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        os.replace(tmp, out)  # onto an empty directory too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(out))
    return out


def pretrained_config(pretrained: Optional[PathLike]) -> Optional[Config]:
    """The Config an export reads with: one naming the pretrained weights where given (a checkpoint that holds
    tensors by reference to them needs them; one that does not ignores them), else the default."""
    return Config(pretrained=os.fspath(pretrained)) if pretrained is not None else None


def _fresh_dir(out_dir: PathLike) -> str:
    out = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {out}: the directory {parent} does not exist; create it first")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CheckpointError(f"cannot write a DCP checkpoint into {out}: it exists and is not a directory")
        if os.listdir(out):
            raise CheckpointError(f"cannot write a DCP checkpoint into {out}: the directory is not empty; "
                                  f"name a new or empty directory")
    return out


def import_dcp(
    dcp_dir: PathLike,
    out_dir: PathLike,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    step: int = 0,
    *,
    strict: bool = True,
    config: Optional[Config] = None,
) -> str:
    """Load the DCP checkpoint in ``dcp_dir`` into ``model`` (and ``optimizer``), then save it into the
    layerckpt store ``out_dir`` as the full checkpoint of ``step``.  Returns its committed manifest.

    ``dcp_dir`` holds ``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``
    as ``dcp.save`` wrote it (or ``layerckpt export --dcp``).  The model must match it (every name,
    shape and dtype; ``strict=False`` loads what matches).  ``config`` defaults to
    ``Config(threshold=0.0)``; later saves of a Checkpointer on ``out_dir`` are selective as usual.
    Under torch.distributed every rank calls it together, as it constructs a Checkpointer; a sharded
    (FSDP2) model loads its shards, as ``dcp.load`` reshards.  Python only: there is no command, since
    it needs the model.
    """
    from .checkpointer import Checkpointer

    load_dcp(dcp_dir, model, optimizer, strict=strict)
    with Checkpointer(out_dir, model, optimizer, config if config is not None else Config(threshold=0.0)) as ck:
        pending = ck.save(step).wait()
    return pending.manifest_path or ""


def load_dcp(dcp_dir: PathLike, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
             strict: bool = True) -> None:
    """Load the ``"model"`` (and ``"optim"``) state of the DCP checkpoint in ``dcp_dir`` into ``model``
    (and ``optimizer``) through DCP's own ``get_*``/``set_*_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)

    where = os.fspath(dcp_dir)
    stored = _stored_keys(where)
    state: Dict[str, Any] = {MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIM] = get_optimizer_state_dict(model, optimizer)
    _check_keys(where, stored, state, strict)
    try:
        with _single_process() as no_dist:
            dcp.load(state, checkpoint_id=where, planner=DefaultLoadPlanner(allow_partial_load=not strict),
                     no_dist=no_dist)
    except Exception as e:  # DCP wraps the cause in a per-rank traceback; its last line says what failed
        lines = [s for s in str(e).strip().splitlines() if s.strip()]
        raise CheckpointError(f"cannot load the DCP checkpoint in {where}: {lines[-1] if lines else e!r}") from e
    options = StateDictOptions(strict=strict)
    set_model_state_dict(model, state[MODEL], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM], options=options)


def _stored_keys(where: str) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(where, ".metadata")):
        raise CheckpointNotFoundError(f"no DCP checkpoint in {where}: it has no .metadata file (a directory "
                                      f"dcp.save wrote to, whole)")
    return set(FileSystemReader(where).read_metadata().state_dict_metadata)


def _check_keys(where: str, stored: set, state: Dict[str, Any], strict: bool) -> None:
    """Say what does not match in one error, before DCP reads anything."""
    for part, hint in ((MODEL, ""), (OPTIM, "; pass optimizer=None to load the model alone")):
        if part in state and not any(k.startswith(part + ".") for k in stored):
            tops = sorted({k.split(".")[0] for k in stored})
            raise CheckpointError(f"the DCP checkpoint in {where} has no {part!r} entry (its top-level keys: "
                                  f"{', '.join(tops)}); import_dcp reads the layout of dcp.save({{'model': "
                                  f"get_model_state_dict(m), 'optim': get_optimizer_state_dict(m, opt)}}){hint}")
    want = {f"{MODEL}.{k}" for k in state[MODEL]}
    have = {k for k in stored if k.startswith(MODEL + ".")}
    cut = len(MODEL) + 1
    if strict and want != have:
        raise CheckpointMismatchError("model", missing=[k[cut:] for k in want - have],
                                      unexpected=[k[cut:] for k in have - want])
    if OPTIM in state:
        cut = len(OPTIM) + len(".state.")
        missing = [k[cut:] for k in (f"{OPTIM}.state.{n}.{s}" for n, st in state[OPTIM]["state"].items() for s in st)
                   if k not in stored]
        if strict and missing:
            raise CheckpointMismatchError("optimizer", missing=missing)


@contextmanager
def _single_process() -> Iterator[bool]:
    """Whether DCP runs without collectives (no process group), and its warning that it assumes so muted."""
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield no_dist
