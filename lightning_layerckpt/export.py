"""A standard Lightning ``.ckpt`` from a layerckpt checkpoint: for ``Model.load_from_checkpoint``,
``torch.load(weights_only=True)`` and every ``ckpt_path=``, and for tools that know only ``.ckpt`` files.

``layerckpt export DIR --lightning -o model.ckpt`` runs the same from the command line.
"""
from __future__ import annotations

import io
import os
from typing import Any, Optional, Type, TypeVar, Union

import torch

import layerckpt
from layerckpt import store
from layerckpt.adapters import replace_durably
from layerckpt.errors import PretrainedNeededError
from layerckpt.interop import pretrained_config

from ._state import LOADED_KEY, to_lightning

M = TypeVar("M")


def lightning_dict(path: Union[str, os.PathLike], step: Optional[int] = None,
                   pretrained: Union[str, os.PathLike, None] = None) -> dict:
    """The Lightning checkpoint dict of a layerckpt checkpoint (a store or one of its manifests).  ``pretrained``:
    the pretrained weights the training started from, for a checkpoint that holds tensors by reference to them
    (``Config.pretrained``)."""
    ckpt = to_lightning(layerckpt.read_checkpoint(path, step=step, strict=False, config=pretrained_config(pretrained)))
    ckpt.pop(LOADED_KEY)
    return ckpt


def load_from_checkpoint(cls: Type[M], path: Union[str, os.PathLike], *,
                         pretrained_files: Union[str, os.PathLike, None] = None, **kwargs: Any) -> M:
    """``cls.load_from_checkpoint`` for a layerckpt checkpoint: ``path`` is a store or a manifest such as
    ``LayerCheckpoint.best_model_path``; ``kwargs`` go to ``cls.load_from_checkpoint`` (``map_location``,
    ``strict``, hyper-parameter overrides, ...).  ``pretrained_files``: the pretrained weights the training started
    from, for a checkpoint that holds tensors by reference to them (``LayerCheckpoint(pretrained=...)``; named so
    that a model's own ``pretrained`` hyper-parameter still passes through).  An ordinary ``.ckpt`` file is passed
    through."""
    if not store.is_checkpoint(path):
        return cls.load_from_checkpoint(path, **kwargs)  # type: ignore[attr-defined]
    try:
        ckpt = lightning_dict(path, pretrained=pretrained_files)
    except PretrainedNeededError as e:
        raise PretrainedNeededError(f"{e}; here: load_from_checkpoint(cls, path, pretrained_files=PATH)") from None
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return cls.load_from_checkpoint(buf, **kwargs)  # type: ignore[attr-defined]


def export_ckpt(path: Union[str, os.PathLike], output: Union[str, os.PathLike], step: Optional[int] = None,
                pretrained: Union[str, os.PathLike, None] = None) -> str:
    """Write the checkpoint at ``path`` (a layerckpt store of LayerCheckpoint, or one of its manifests)
    as one ``torch.save`` file at ``output``, atomically and durably (``pretrained``: as for
    :func:`lightning_dict`).  Returns ``output``."""
    ckpt = lightning_dict(path, step, pretrained)
    output = os.path.abspath(os.fspath(output))
    if not os.path.isdir(os.path.dirname(output)):
        raise layerckpt.CheckpointError(
            f"cannot write {output}: the directory {os.path.dirname(output)} does not exist; create it first")
    tmp = f"{output}.{os.getpid()}.tmp"
    with store.create_file(tmp) as f:
        torch.save(ckpt, f)
    return replace_durably(tmp, output)
