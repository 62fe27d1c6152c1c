"""The memory tier's place: the newest composite, in the checkpoint directory's format, under
``/dev/shm/layerckpt-<hash of the directory's absolute path>/``.

Shared memory outlives the process (a restart after a crash finds it) but not
the node (a reboot empties it, and the disk is read instead).  ``LAYERCKPT_SHM``
names another base folder where /dev/shm is missing or small.
"""
from __future__ import annotations

import hashlib
import os

SHM = "/dev/shm"


def memory_path(root: str) -> str:
    """Where the memory tier of the checkpoint directory ``root`` lives."""
    base = os.environ.get("LAYERCKPT_SHM") or SHM
    digest = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]
    return os.path.join(base, f"layerckpt-{digest}")
