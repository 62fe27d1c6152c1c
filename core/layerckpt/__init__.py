"""layerckpt: layer-selective, asynchronous, crash-safe checkpoints for PyTorch.

The public face is what this module exports; modules whose names start with an
underscore are internal, one per stage of the save and restore paths (see
``checkpointer`` and ``restore``).  ``layerckpt.store`` is the public store API
(list, resolve, release composites; files beside a remote tier) and
``layerckpt.adapters`` what the framework adapters share; neither they nor any
code outside the engine needs an underscore module.  ``layerckpt.cli`` is the
``layerckpt`` command; ``layerckpt.bench`` holds benchmarks and demo workloads.
"""
from . import store
from .write._flush import PendingSave
from .select._layers import LayerSpec
from .write._torchfile import TorchFileWriter
from .checkpointer import Checkpointer
from .config import Config
from .interval import Interval
from .preempt import EXIT_PREEMPTED
from ._plot import plot
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointGoneError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    StalenessError,
)
from .restore import LoadedCheckpoint, RestoreReport, read_checkpoint, restore

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "Config", "PendingSave", "RestoreReport", "restore", "read_checkpoint", "LoadedCheckpoint",
    "CheckpointError", "CheckpointWriteError", "CheckpointCorruptError", "CheckpointGoneError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError", "ConfigError", "StalenessError", "LayerSpec", "TorchFileWriter", "store", "Interval", "plot",
    "EXIT_PREEMPTED",
]
