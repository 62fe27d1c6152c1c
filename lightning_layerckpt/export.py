"""A standard Lightning ``.ckpt`` from a layerckpt checkpoint: for ``Model.load_from_checkpoint``,
``torch.load(weights_only=True)`` and every ``ckpt_path=``, and for tools that know only ``.ckpt`` files.

``layerckpt export DIR --lightning -o model.ckpt`` runs the same from the command line.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch

import layerckpt
from layerckpt._store import fsync_dir

from ._state import LOADED_KEY, to_lightning


def export_ckpt(path: Union[str, os.PathLike], output: Union[str, os.PathLike], step: Optional[int] = None) -> str:
    """Write the checkpoint at ``path`` (a layerckpt store of LayerCheckpoint, or one of its manifests)
    as one ``torch.save`` file at ``output``, atomically and durably.  Returns ``output``."""
    loaded = layerckpt.read_checkpoint(path, step=step, strict=False)
    ckpt = to_lightning(loaded)
    ckpt.pop(LOADED_KEY)
    output = os.path.abspath(os.fspath(output))
    if not os.path.isdir(os.path.dirname(output)):
        raise layerckpt.CheckpointError(
            f"cannot write {output}: the directory {os.path.dirname(output)} does not exist; create it first")
    tmp = f"{output}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    fsync_dir(os.path.dirname(output))
    return output
