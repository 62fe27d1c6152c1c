"""A checkpoint folder plain Trainer resumes from, out of one written while attached.

The attached folder holds Trainer's own files and a ``layerckpt.json`` pointer to the composite of the model and
optimizer in the store beside it.  :func:`export_folder` copies the folder (the pointer left out) and writes the
composite as Trainer would have: the weights as ``model.safetensors`` (a tensor tied to others under one name
only, the first in the state dict, as ``save_pretrained`` does; with the folder's ``config.json`` that is also
what ``from_pretrained`` reads) and the optimizer's state as ``optimizer.pt``.  Only the folder's own regular
files and folders are copied (a symbolic link, FIFO or device in it is refused, as is a pointer naming a store
anywhere but beside the folders), staged under a fresh name beside the output.  The copy is made durable (every
file fsynced, then renamed into place).  ``layerckpt export FOLDER --transformers -o OUT`` runs the same.
"""
from __future__ import annotations

import os
from typing import Dict, Union

import torch
from safetensors.torch import save_file

import layerckpt
from layerckpt.adapters import check_store_inside, export_done, export_paths, export_staging
from layerckpt.errors import CheckpointError
from layerckpt.interop import pretrained_config

from . import folders

WEIGHTS = "model.safetensors"  # transformers.utils.SAFE_WEIGHTS_NAME
OPTIMIZER = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME


def export_folder(folder: Union[str, os.PathLike], output: Union[str, os.PathLike],
                  pretrained: Union[str, os.PathLike, None] = None) -> str:
    """Write ``output`` (a new directory) as plain Trainer would have written the checkpoint folder ``folder``.
    ``pretrained``: the pretrained weights the training started from, for a checkpoint that holds tensors by
    reference to them (``Config.pretrained``)."""
    folder, output = export_paths(folder, output)
    ptr = folders.read_pointer(folder)
    if ptr is None:
        raise CheckpointError(f"{folder} has no {folders.POINTER}: it was not written through "
                              f"transformers_layerckpt (plain Trainer resumes from it as it is)")
    check_store_inside(ptr.path, ptr.store)  # before anything of the store is read
    loaded = layerckpt.read_checkpoint(folders.check_committed(ptr), config=pretrained_config(pretrained))
    if ptr.optimizer and loaded.optimizer is None:
        raise CheckpointError(f"the composite of {folder} lacks the optimizer state its pointer promises")
    with export_staging(folder, output, folders.POINTER) as tmp:
        save_file(untied(loaded.model), os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        if ptr.optimizer:
            torch.save(loaded.optimizer, os.path.join(tmp, OPTIMIZER))
        return export_done(tmp, output)


def untied(model: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``model`` with each tensor under its first name only (safetensors refuses shared tensors; a model's
    ``tie_weights`` ties the others again on load)."""
    seen, out = set(), {}
    for name, t in model.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.contiguous()
    return out
