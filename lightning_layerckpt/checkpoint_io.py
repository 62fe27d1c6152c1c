"""LayerCheckpointIO: a Lightning ``CheckpointIO`` whose checkpoints are layerckpt stores (directories)."""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

import layerckpt
from layerckpt import _store as store
from layerckpt.config import Config
from layerckpt.errors import ConfigError

from ._state import StateModule, to_extra, to_lightning

if TYPE_CHECKING:
    from .callback import LayerCheckpoint


class LayerCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` whose checkpoints are layerckpt stores (directories).

    - ``save_checkpoint(checkpoint, path)`` writes a full checkpoint into the store ``path`` and
      returns once it is staged (``wait()``/``teardown()`` make it durable).  Lightning calls it on
      rank 0 only, so it involves no other rank.
    - ``load_checkpoint(path)`` takes a store (its newest composite), a store's
      ``manifests/step-N.json``, or anything the wrapped IO loads (an ordinary ``.ckpt``).
    - ``remove_checkpoint(path)`` removes a store (or defers to the wrapped IO).

    Used on its own (``Trainer(plugins=[LayerCheckpointIO()])``) with Lightning's ModelCheckpoint,
    each checkpoint is a full one in its own directory; :class:`LayerCheckpoint` installs it and adds
    the layer-selective store.
    """

    def __init__(self, config: Optional[Union[Config, str, os.PathLike]] = None,
                 fallback: Optional[CheckpointIO] = None):
        self.config = as_config(config)
        self.fallback = fallback if fallback is not None else TorchCheckpointIO()
        self._saving: Optional[layerckpt.Checkpointer] = None
        self._callbacks: List["LayerCheckpoint"] = []  # whose saves wait() and teardown() also cover

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"LayerCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        self._finish_standalone()
        path = os.fspath(path)
        if os.path.isfile(path):  # an earlier ordinary checkpoint of this name
            os.remove(path)
        elif os.path.isdir(path) and store.is_checkpoint(path):
            shutil.rmtree(path)
        model = StateModule(checkpoint.get("state_dict", {}))
        ck = layerckpt.Checkpointer(path, model, None, self.config.replace(threshold=0.0, keep_last=1),
                                    distributed=False)
        try:
            ck.save(int(checkpoint.get("global_step", 0)), extra=to_extra(checkpoint, has_optimizer=False))
        except BaseException:
            ck.close()
            raise
        ck.close(wait=False)  # one save per store: its thread and buffers go once it is durable
        self._saving = ck  # wait(), teardown() and the next save still raise its error

    @override
    def load_checkpoint(self, path: Union[str, os.PathLike], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if not store.is_checkpoint(path):
            if os.path.isdir(path):
                store.locate(path)  # raises the clear error: a directory, but not a checkpoint
            return self.fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        self.wait()  # a save of our own to the same place must be durable first
        loaded = layerckpt.read_checkpoint(path, config=self.config, strict=False)
        return to_lightning(loaded)

    @override
    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        if os.path.isdir(path) and store.is_checkpoint(path):
            if self._saving is not None and os.path.abspath(self._saving.dirpath) == os.path.abspath(path):
                self._finish_standalone()
            shutil.rmtree(path)
        else:
            self.fallback.remove_checkpoint(path)

    def wait(self) -> None:
        """Every save of this IO and of its callbacks durable; raises the first failure."""
        for cb in list(self._callbacks):
            cb.wait()
        if self._saving is not None:
            self._saving.wait()

    @override
    def teardown(self) -> None:
        try:
            for cb in list(self._callbacks):
                cb._close(quiet=True)
        finally:
            self._finish_standalone()
            self.fallback.teardown()

    def _attach(self, callback: "LayerCheckpoint") -> None:
        """``callback`` saves through this IO's strategy: wait() and teardown() cover its saves too."""
        if callback not in self._callbacks:
            self._callbacks.append(callback)

    def _detach(self, callback: "LayerCheckpoint") -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def _finish_standalone(self) -> None:
        ck, self._saving = self._saving, None
        if ck is not None:
            ck.close()


def as_config(config: Optional[Union[Config, str, os.PathLike, Dict[str, Any]]]) -> Config:
    """A layerckpt Config from a Config, a dict of its fields or a YAML path (None: the defaults)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_yaml(config)
    raise ConfigError(f"config must be a layerckpt.Config, a dict or a YAML path, got {type(config).__name__}")
