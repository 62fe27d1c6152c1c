"""LayerCheckpointIO: a Lightning ``CheckpointIO`` that writes standard ``.ckpt`` files through layerckpt's
writer (staged, asynchronous, aligned, durable) and also reads layerckpt stores."""
from __future__ import annotations

import errno
import os
import shutil
from typing import Any, Dict, List, Optional, Protocol, Union

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

import layerckpt
from layerckpt import TorchFileWriter, store
from layerckpt.adapters import as_config  # noqa: F401 - also imported from here by older code
from layerckpt.config import Config

from ._state import remote_holds_checkpoint, to_lightning


class Attached(Protocol):
    """What LayerCheckpointIO asks of a callback saving through it (LayerCheckpoint): its store, its Config,
    to wait for its saves and to close.  A protocol, so that this module does not import the callback's."""

    dirpath: Any
    layer_config: Config

    def wait(self) -> None: ...

    def _close(self, quiet: bool) -> None: ...


class LayerCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` whose checkpoints are standard ``torch.save`` files, written by layerckpt.

    - ``save_checkpoint(checkpoint, path)`` writes the file ``torch.save`` would (so
      ``Model.load_from_checkpoint``, ``torch.load(path, weights_only=True)`` and ``ckpt_path=`` take
      it; the zip's CRC-32 fields are zero, which torch does not check), but through layerckpt's writer:
      the tensors are copied into page-aligned staging buffers on the calling thread, then one
      background thread writes them with O_DIRECT, fsyncs ``<path>.<pid>.tmp`` and renames it into
      place.  During a fit the call returns once staged; after the Trainer's teardown (a
      ``trainer.save_checkpoint`` once ``fit`` is over) it returns once the file is durable, so it can
      be read at once by anyone.  Remote paths (``s3://...``) go to the wrapped IO.
    - ``load_checkpoint(path)`` first waits for a write of this IO to ``path`` (read your writes);
      files load with the wrapped IO (Lightning's ``TorchCheckpointIO`` by default, its
      ``weights_only`` rules), a layerckpt store or one of its ``manifests/step-N.json`` with layerckpt.
    - ``remove_checkpoint(path)`` waits for a write to ``path`` in flight, then removes the file (or a
      store directory).
    - ``wait()``: every write durable; ``teardown()`` also ends the writer thread and frees its buffers.
      A write that failed in the background is raised by the next ``save_checkpoint``, ``wait()`` or
      ``teardown()``.

    Used on its own, ``Trainer(plugins=[LayerCheckpointIO()])`` with Lightning's ModelCheckpoint;
    :class:`LayerCheckpoint` installs it (wrapping the IO there) beside its layer-selective store.
    """

    def __init__(self, config: Optional[Union[Config, str, os.PathLike]] = None,
                 fallback: Optional[CheckpointIO] = None):
        self.config = as_config(config)
        self.fallback = fallback if fallback is not None else TorchCheckpointIO()
        self._writer = TorchFileWriter(self.config)
        self._outside_fit = False  # after teardown, until a LayerCheckpoint attaches again: saves wait
        self._callbacks: List[Attached] = []  # whose saves wait() and teardown() also cover

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`."
            )
        path = os.fspath(path)
        if "://" in path:
            return self.fallback.save_checkpoint(checkpoint, path)
        self._writer.check()  # a write that failed since the last call stops this one
        if os.path.isdir(path) and not store.is_checkpoint(path):
            raise IsADirectoryError(errno.EISDIR, "cannot save a checkpoint file over a directory", path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pending = self._writer.save(checkpoint, path)
        if self._outside_fit:
            pending.wait()

    @override
    def load_checkpoint(self, path: Union[str, os.PathLike], map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        self._writer.wait_for(os.fspath(path))  # a write of ours to path lands first (and raises if it failed)
        if store.is_url(os.fspath(path)) and remote_holds_checkpoint(os.fspath(path), self.config):
            self.wait()  # our own copies to it land first
            return to_lightning(layerckpt.read_checkpoint(os.fspath(path), config=self.config, strict=False))
        if store.node_part(os.fspath(path)) is not None:  # a node part (docs/nodes.md): every rank gathers it
            self.wait()
            return to_lightning(layerckpt.read_checkpoint(os.fspath(path), config=self._node_config(os.fspath(path)),
                                                          strict=False))
        tiered = self._tiered_config(os.fspath(path))
        if tiered is not None:  # a callback's local store, empty or older than its remote tier
            self.wait()
            return to_lightning(layerckpt.read_checkpoint(os.fspath(path), config=tiered, strict=False))
        if not store.is_checkpoint(path):
            if os.path.isdir(path):
                store.locate(path)  # raises the clear error: a directory, but not a checkpoint
            where = {} if map_location is None else {"map_location": map_location}
            return self.fallback.load_checkpoint(path, weights_only=weights_only, **where)
        self.wait()  # a save of our own to the same place must be durable first
        loaded = layerckpt.read_checkpoint(path, config=self.config, strict=False)
        return to_lightning(loaded)

    @override
    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        self._writer.wait_for(os.fspath(path), check=False)  # a failure stays for the next save or wait()
        if os.path.isdir(path) and store.is_checkpoint(path):
            shutil.rmtree(path)
        else:
            self.fallback.remove_checkpoint(path)

    def _node_config(self, path: str) -> Config:
        """The Config a node part is read with: the attached callback's whose store it is (its memory tier and
        remote are where a lost node's part may be), else this CheckpointIO's."""
        root = store.node_part(path)
        for cb in self._callbacks:
            if cb.dirpath is not None and os.path.abspath(os.fspath(cb.dirpath)) == root:
                return cb.layer_config
        return self.config

    def _tiered_config(self, path: str) -> Optional[Config]:
        """The Config of the attached callback whose store is ``path`` and which has a remote tier: the store is
        read across its tiers (the freshest composite wins), even where the local directory holds none."""
        for cb in self._callbacks:
            if cb.dirpath is not None and cb.layer_config.remote is not None and \
                    os.path.normpath(os.fspath(cb.dirpath)) == os.path.normpath(os.path.abspath(path)):
                return cb.layer_config
        return None

    def wait(self) -> None:
        """Every save of this IO and of its callbacks durable; raises the first failure."""
        for cb in list(self._callbacks):
            cb.wait()
        self._writer.wait()

    @override
    def teardown(self) -> None:
        try:
            for cb in list(self._callbacks):
                cb._close(quiet=True)
        finally:
            self._outside_fit = True
            try:
                self._writer.close()
            finally:
                self.fallback.teardown()

    def _attach(self, callback: Attached) -> None:
        """``callback`` saves through this IO's strategy: wait() and teardown() cover its saves too."""
        self._outside_fit = False
        if callback not in self._callbacks:
            self._callbacks.append(callback)

    def _detach(self, callback: Attached) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

