"""A folder plain accelerate can ``load_state``, from one that the plugin wrote.

The plugin's folders hold accelerate's own files (schedulers, RNG, registered objects) and a
``layerckpt.json`` pointer to the composite in the store beside them.  :func:`export_folder`
copies the folder and writes each model's composite as ``pytorch_model[_i].bin`` (the whole
state dict, tied names included) and its optimizer state as ``optimizer[_i].bin``, the names
accelerate's ``load_state`` reads; the pointer is left out.  Only the folder's own regular files
and folders are copied (a symbolic link, FIFO or device in it is refused, as is a pointer naming a
store anywhere but beside the folders), staged under a fresh name beside the output.  The copy is
made durable (every file fsynced, then renamed into place) as the Lightning export is.
``layerckpt export FOLDER --accelerate -o OUT`` runs the same.
"""
from __future__ import annotations

import os
from typing import Union

import torch
from accelerate.utils import MODEL_NAME, OPTIMIZER_NAME

import layerckpt
from layerckpt.adapters import check_store_inside, export_done, export_paths, export_staging
from layerckpt.errors import CheckpointError
from layerckpt.interop import pretrained_config

from . import folders


def export_folder(folder: Union[str, os.PathLike], output: Union[str, os.PathLike],
                  pretrained: Union[str, os.PathLike, None] = None) -> str:
    """Write ``output`` (a new directory) as plain accelerate would have written ``folder``.  ``pretrained``: the
    pretrained weights the training started from, for a checkpoint that holds tensors by reference to them
    (``Config.pretrained``)."""
    folder, output = export_paths(folder, output)
    ptr = folders.read_pointer(folder)
    if ptr is None:
        raise CheckpointError(f"{folder} has no {folders.POINTER}: it was not written through the layerckpt "
                              f"plugin (plain accelerate loads it as it is)")
    check_store_inside(ptr.path, ptr.store)  # before anything of the store is read
    manifests = folders.check_committed(ptr)  # a clear error when the composite never committed
    with export_staging(folder, output, folders.POINTER) as tmp:
        for i, manifest in enumerate(manifests):
            loaded = layerckpt.read_checkpoint(manifest, config=pretrained_config(pretrained))
            ending = f"_{i}" if i > 0 else ""
            torch.save({**loaded.model_other, **loaded.model}, os.path.join(tmp, f"{MODEL_NAME}{ending}.bin"))
            if ptr.optimizers[i]:
                if loaded.optimizer is None:
                    raise CheckpointError(f"{manifest} lacks the optimizer state its pointer {ptr.path} promises")
                name = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
                torch.save(loaded.optimizer, os.path.join(tmp, name))
        return export_done(tmp, output)
