"""The one exception family of layerckpt.

Every message names the bad value (a field, a file, a tensor) and says how to
fix it where there is a fix.
"""
from __future__ import annotations

import errno as _errno
import os
from typing import Iterable, Optional, Sequence


class CheckpointError(Exception):
    """Base class of every error layerckpt raises."""


class ConfigError(CheckpointError, ValueError):
    """A Config field (or a YAML key) holds a bad value."""


class CheckpointWriteError(CheckpointError, OSError):
    """A flush failed: disk full, I/O error, permission.  Earlier checkpoints are intact."""

    def __init__(self, err: int, path: Optional[str], detail: str = "", system: bool = True):
        # system: ``err`` is what the system said; else a stand-in for a failure that was not the system's, whose
        # text says nothing true of it (``detail`` says what it was)
        msg = f"checkpoint write failed: {os.strerror(err)}" if system else "checkpoint write failed"
        if path:
            msg += f" ({path})"
        if err in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG):
            msg += "; free space (or lower keep_last) and save again, earlier checkpoints are intact"
        if detail:
            msg += f"; {detail}"
        OSError.__init__(self, err, msg)
        self.filename = path
        self.path = path

    def __str__(self) -> str:
        return self.strerror or ""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A data file or manifest is damaged (checksum, truncation, malformed JSON, unsafe path)."""

    def __init__(self, msg: str, path: Optional[str] = None, tensor: Optional[str] = None):
        super().__init__(msg)
        self.path = path
        self.tensor = tensor


class CheckpointGoneError(CheckpointCorruptError):
    """A checkpoint being read was deleted meanwhile by the writer's retention (``keep_last``, ``release``):
    its manifest is gone, and a data file it named with it.  Nothing is damaged: restore the newest committed
    checkpoint (``restore()`` without a step retries once by itself).  A subclass of CheckpointCorruptError so
    that a handler of unreadable checkpoints still catches it; catch this one first to tell the two apart."""

    def __init__(self, msg: str, path: Optional[str] = None, tensor: Optional[str] = None):
        super().__init__(f"{msg}: deleted by retention, restore the newest", path=path, tensor=tensor)


class PretrainedNeededError(CheckpointError):
    """The checkpoint holds model tensors by reference to the pretrained weights the training started from
    (``Config.pretrained``), and nothing that reads it names those files (nor, for a restore, holds them)."""


class CheckpointMismatchError(CheckpointError):
    """The model (or optimizer) does not match the checkpoint; lists every difference, sorted."""

    def __init__(
        self,
        what: str,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Sequence[str] = (),
    ):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = []
        if self.missing:
            parts.append("missing from the checkpoint: " + ", ".join(self.missing))
        if self.unexpected:
            parts.append("in the checkpoint but not in the " + what + ": " + ", ".join(self.unexpected))
        if self.mismatched:
            parts.append("mismatched: " + "; ".join(self.mismatched))
        super().__init__(
            f"{what} does not match the checkpoint:\n  " + "\n  ".join(parts)
            + "\n(pass strict=False to load the entries that do match)"
        )


class StalenessError(CheckpointError):
    """A restored layer is older than Config.max_staleness allows."""
