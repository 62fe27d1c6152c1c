"""layerckpt: layer-selective, asynchronous, crash-safe checkpoints for PyTorch."""
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
from .flusher import PendingSave
from .restore import LoadedCheckpoint, RestoreReport, read_checkpoint, restore

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "Config", "PendingSave", "RestoreReport", "restore", "read_checkpoint", "LoadedCheckpoint",
    "CheckpointError", "CheckpointWriteError", "CheckpointCorruptError", "CheckpointMismatchError",
    "CheckpointNotFoundError", "ConfigError", "StalenessError",
]
