"""Named points in the save, retention and read paths where tests inject faults.

Product code only calls :func:`point`; nothing happens unless a test has
installed a hook for that name (in its own process) with :func:`install`.

Points: ``"stage.copied"`` (every tensor of a save copied into the staging buffers, before the image is
declared complete; on the stager thread under lazy staging), ``"stage.step-waits"`` (an optimizer step begins
waiting for a save's copies still running under lazy staging, its wait's clock started; on the training
thread), ``"takeover.begun"`` (a newer Checkpointer of this process takes over the store of an older one, or a
newer adapter object that of an older one (``adapters.hold``): before the older one's saves in flight are
waited for; on the newer one's thread),
``"flush.checksum"`` (before each chunk is checksummed),
``"flush.written"`` (this rank's data file is durable, before the ranks agree),
``"commit.before"`` (before the manifest is written), ``"retain.manifests-dropped"``
(old manifests deleted and made durable, their data files not yet).  Tier copies (``_tiers``):
``"tier.file-copied"`` (after each data file), ``"tier.data-copied"`` (the composite's data is on the
tier, its manifest not yet), ``"tier.committed"``, ``"tier.manifests-dropped"``.  Reads:
``"read.manifest-loaded"`` (a reader picked a composite and holds its manifest, nothing of it read yet).
Many nodes: ``"replica.sent"`` (a replication round's sends are queued, before its receives),
``"replica.file-received"`` (after each data file a partner received), ``"parts.sending"`` (a collective
restore's node owner, before it sends the files other nodes lack).
"""
from __future__ import annotations

from typing import Callable, Dict

_hooks: Dict[str, Callable[[], None]] = {}


def install(name: str, hook: Callable[[], None]) -> None:
    _hooks[name] = hook


def remove(name: str) -> None:
    _hooks.pop(name, None)


def point(name: str) -> None:
    hook = _hooks.get(name)
    if hook is not None:
        hook()
