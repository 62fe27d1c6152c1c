"""This process's writers, by store root: their saves in flight and their tiers (what read-your-writes
waits for), the open writer of each store (what a newer Checkpointer on the same store takes over), and the
framework adapter object that holds the store (what a newer adapter object on the same store takes over).

A store has one writing process (``_store.WriterLock``, an flock).  Inside that process a newer
Checkpointer on the same directory takes over from the older one: :func:`take_over` lets the older
one's saves in flight end, closes it, and only then does the newer one lock and clean up the store.
Everything here is per process, so under torch.distributed each rank takes over from its own.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol


class PendingSave(Protocol):
    """What the registry needs of a save in flight (``_flush.PendingSave``): a leaf module, so it names
    no other module of the package."""

    _done: threading.Event


class Tier(Protocol):
    """What the registry needs of a tier's copier (``_tiers.Tier``): its store's URL, and waiting for its copies."""

    store: Any

    def drain(self) -> None: ...


class Owner:
    """An open writer's claim on its store in this process; ``retire`` is how a newer one takes over:
    it must let the writer's saves end, then close it (and call :meth:`closed` when done)."""

    def __init__(self, root: str, retire: Callable[[], None]):
        self.root = root
        self._retire = retire
        self._closed = threading.Event()

    def claim(self) -> None:
        """Become the store's open writer in this process (after :func:`take_over`)."""
        with _lock:
            _record(self.root).owner = self

    def retire(self) -> None:
        """Close this writer for a newer one; returns once it is closed (by whichever thread closed it)."""
        self._retire()
        self._closed.wait()

    def closed(self) -> None:
        """The writer is closed: its lock is free, and it is no longer the store's writer."""
        with _lock:
            rec = _stores.get(self.root)
            if rec is not None and rec.owner is self:
                rec.owner = None
                _prune(self.root)
        self._closed.set()


class _Store:
    """What this process writes into one store."""

    __slots__ = ("saves", "tiers", "owner", "holder")

    def __init__(self) -> None:
        self.saves: "weakref.WeakSet[PendingSave]" = weakref.WeakSet()  # in flight
        self.tiers: "weakref.WeakSet[Tier]" = weakref.WeakSet()  # opened by this store's writers
        self.owner: Optional[Owner] = None
        self.holder: Optional["weakref.WeakMethod[Callable[[str], None]]"] = None  # an adapter's on_taken


_lock = threading.Lock()
_stores: Dict[str, _Store] = {}


def _record(root: str) -> _Store:
    rec = _stores.get(root)
    if rec is None:
        rec = _stores[root] = _Store()
    return rec


def _prune(root: str) -> None:
    rec = _stores.get(root)
    if rec is not None and rec.owner is None and not rec.saves and not rec.tiers and \
            (rec.holder is None or rec.holder() is None):
        del _stores[root]


def take_over(root: str) -> None:
    """Before a new writer locks ``root``: the older writer of this process, if any, finishes its saves in
    flight (their errors stay with their PendingSave) and closes; then nothing of this process writes there."""
    with _lock:
        rec = _stores.get(root)
        owner = rec.owner if rec is not None else None
    if owner is not None:
        owner.retire()
    wait_for_saves(root)  # a writer already closed may still have had one on its thread


def hold(root: str, on_taken: Callable[[str], None]) -> Optional[Callable[[str], None]]:
    """The object of the bound method ``on_taken`` (a framework adapter's) now holds ``root``; returns the
    ``on_taken`` of the object that held it before, if that one is still alive and another one (the caller
    tells it, outside this lock)."""
    with _lock:
        rec = _record(root)
        before = rec.holder
        rec.holder = weakref.WeakMethod(on_taken)
    older = before() if before is not None else None
    return older if older is not None and older != on_taken else None  # bound methods compare by object


def save_started(root: str, pending: "PendingSave") -> None:
    with _lock:
        _record(root).saves.add(pending)


def save_ended(root: str, pending: "PendingSave") -> None:
    with _lock:
        rec = _stores.get(root)
        if rec is not None:
            rec.saves.discard(pending)
            _prune(root)


def tier_opened(root: str, tier: "Tier") -> None:
    with _lock:
        _record(root).tiers.add(tier)


def wait_for_saves(root: str) -> None:
    """Read your writes: wait for every save of this process into ``root`` still flushing (its outcome,
    success or failure, is the caller's to see in the directory; errors stay with their PendingSave)."""
    with _lock:
        rec = _stores.get(root)
        saves: List["PendingSave"] = list(rec.saves) if rec is not None else []
    for p in saves:
        p._done.wait()


def wait_for_tiers(where: str) -> None:
    """Read your writes: wait for this process's copies into the tier at ``where`` (URL or folder)."""
    with _lock:
        tiers: List["Tier"] = [t for rec in _stores.values() for t in rec.tiers]
    for t in tiers:
        if t.store.url.rstrip("/") == where.rstrip("/"):
            t.drain()
