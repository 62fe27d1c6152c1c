"""layerckpt: layer-selective, asynchronous, crash-safe checkpoints for PyTorch.

The public face is what this module exports; modules whose names start with an
underscore are internal, one per stage of the save and restore paths (see
``checkpointer`` and ``restore``).  ``layerckpt.cli`` is the ``layerckpt``
command; ``layerckpt.bench`` holds benchmarks and demo workloads.
"""
from ._flush import PendingSave
from .checkpointer import Checkpointer
from .config import Config
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
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
    "CheckpointError", "CheckpointWriteError", "CheckpointCorruptError", "CheckpointMismatchError",
    "CheckpointNotFoundError", "ConfigError", "StalenessError",
]
