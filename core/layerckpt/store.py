"""The public store API: what code outside the engine may ask of a layerckpt store.

A *store* is a checkpoint directory (``<dir>/manifests/step-N.json`` beside ``<dir>/data/``) or a
remote tier of one (an fsspec URL such as ``s3://bucket/run`` with the same layout).  A *composite*
is one committed manifest and the data files it names; its manifest path (or URL) names it.

Where a function takes a URL, ``config`` is the :class:`~layerckpt.Config` whose ``remote_options``
open it (credentials, endpoint); reading a URL first waits for this process's own copies into it
(read your writes).

- which store, which composite: :func:`is_url`, :func:`is_checkpoint`, :func:`locate`,
  :func:`manifest_path`, :func:`resolve` (a directory, a manifest, a URL: the composite it names),
  :func:`newest`;
- what a store holds: :func:`steps`, :func:`next_step`, :func:`composites`, :func:`read_manifest`
  (a :class:`Composite`: a manifest's public facts);
- what stays: a Checkpointer's own retention keeps its ``Config.keep_last`` newest composites plus
  those pinned with ``Checkpointer.keep(manifests)`` (``keep([])`` releases the pins); a caller that
  decides itself what stays drops the rest with :func:`release` (a local store or a remote tier's URL);
- durability: :func:`fsync_dir`;
- plain files beside a remote tier: :class:`RemoteFiles` (copies capped by a bandwidth, as a tier's are).

The Lightning and Accelerate adapters use only this module, the names ``layerckpt`` exports and
:mod:`layerckpt.adapters`; the underscore modules behind them are the engine's own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Union

from .read import _fetch
from .format import _json, _store
from .tiers import _remote, _tiers
from .write import _retain
from .format._manifest import Manifest, load_manifest
from .config import Config
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

PathLike = Union[str, "os.PathLike[str]"]

MANIFEST_DIR = _store.MANIFEST_DIR
#: Whether a path is a URL (``s3://...``, ``file:///...``): a remote store, not a local directory.
is_url = _remote.is_url
#: Whether a path is a local layerckpt store or one of its manifests (never a URL).
is_checkpoint = _store.is_checkpoint
#: (local store, step or None for its newest) named by a store directory or one of its manifests.
locate = _store.locate
#: An absolute local path; a URL is refused with a message that says where URLs go instead.
local_path = _store.local_path
#: fsync a directory, so that the entries created or renamed in it survive a power loss.
fsync_dir = _store.fsync_dir
manifest_name = _store.manifest_name


@dataclass(frozen=True)
class Composite:
    """A committed composite's public facts, as its manifest records them."""

    path: str  #: its manifest: a local path, or a URL on a remote tier
    step: int
    seq: int  #: commit order within its store (the newest committed is the highest)
    created: float  #: commit time, seconds since the epoch
    world_size: int
    name: Optional[str]  #: the name given at save(), e.g. LayerCheckpoint's templated file name
    loss: Optional[float]  #: the training loss passed to save()
    extra: Any  #: the ``extra`` passed to save() (JSON-safe values and tensors)

    @classmethod
    def of(cls, m: Manifest, path: str) -> "Composite":
        return cls(path=path, step=m.step, seq=m.seq, created=m.created, world_size=m.world_size, name=m.name,
                   loss=m.loss, extra=m.extra)


def node_part(path: PathLike) -> Optional[str]:
    """Where ``path`` (a directory or one of its manifests) is one node's part of node-local directories under
    torch.distributed (docs/nodes.md), or a node's directory that came back empty: its store directory, which
    every rank reads together (``restore``/``read_checkpoint`` are then collective); None otherwise."""
    from .read import _parts

    return _parts.split(path)[0] if _parts.collective(path) else None


def manifest_path(root: PathLike, step: int) -> str:
    """The path (or, for a URL, the URL) the manifest of ``step`` has, or would have, in the store ``root``."""
    r = os.fspath(root)
    if is_url(r):
        return f"{r.rstrip('/')}/{MANIFEST_DIR}/{manifest_name(step)}"
    return os.path.join(r, MANIFEST_DIR, manifest_name(step))


def resolve(path: PathLike, step: Optional[int] = None, *, config: Optional[Config] = None) -> str:
    """The manifest of the composite ``path`` names: a store (its newest committed composite, or the one of
    ``step``), one of its manifests, or the URL of either.  Returns a local path, or a URL for a URL.
    Raises :class:`~layerckpt.CheckpointNotFoundError` when there is none, naming the steps there are."""
    p = os.fspath(path)
    if is_url(p):
        url, located = _fetch.split_url(p)
        tier = _open_url(url, config)
        name, _ = _remote_call(url, lambda: _fetch.pick(tier, _one_step(p, step, located)))
        return tier.where(_remote.MANIFESTS, name)
    root, located = locate(p)
    return _store.resolve(root, _one_step(p, step, located))


def newest(path: PathLike, *, config: Optional[Config] = None) -> Optional[str]:
    """The manifest of the newest committed composite of the store ``path`` (a directory or URL); None when
    it holds none.  A newer composite that was committed and then damaged raises, never is skipped."""
    try:
        return resolve(path, config=config)
    except CheckpointNotFoundError:
        return None


def steps(path: PathLike, *, config: Optional[Config] = None) -> List[int]:
    """The steps the store ``path`` (a directory or URL) holds a manifest of, lowest first, read from the
    file names alone (no manifest is parsed); none when it does not exist."""
    p = os.fspath(path)
    if not is_url(p):
        return [s for s, _ in _store.list_manifests(p)]
    names = _remote_call(p, lambda: _open_url(p, config).names(_remote.MANIFESTS))
    return sorted(s for s in map(_store.manifest_step, names) if s is not None)


def next_step(path: PathLike, *, config: Optional[Config] = None) -> int:
    """One past the highest step the store holds a manifest of (0 for an empty or missing store): a step
    that names no composite there yet."""
    return max(steps(path, config=config), default=-1) + 1


def composites(path: PathLike, *, config: Optional[Config] = None) -> List[Composite]:
    """The committed composites of the store ``path`` (a directory or URL) whose manifests parse, in commit
    order (oldest first)."""
    p = os.fspath(path)
    if is_url(p):
        tier = _open_url(p, config)
        good, _ = _remote_call(p, lambda: _tiers.read_all(tier))
        where = lambda n: tier.where(_remote.MANIFESTS, n)  # noqa: E731
    else:
        good, _ = _store.read_all(local_path(p))
        where = lambda n: manifest_path(local_path(p), good[n].step)  # noqa: E731
    order = sorted(good, key=_store.recency(good))
    return [Composite.of(good[n], where(n)) for n in order]


def read_manifest(path: PathLike, *, config: Optional[Config] = None) -> Composite:
    """The public facts of one manifest (a local path or a URL).  Raises
    :class:`~layerckpt.CheckpointNotFoundError` when it is not there and
    :class:`~layerckpt.CheckpointCorruptError` when it does not parse."""
    p = os.fspath(path)
    if not is_url(p):
        return Composite.of(load_manifest(p), p)
    url, step = _fetch.split_url(p)
    if step is None:
        raise CheckpointError(f"{p} names a store, not one of its manifests ({url}/{MANIFEST_DIR}/step-N.json); "
                              f"resolve() it first")
    tier = _open_url(url, config)
    try:
        raw = _remote_call(p, lambda: tier.read(_remote.MANIFESTS, manifest_name(step)))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {url}") from None
    try:
        return Composite.of(Manifest.from_dict(_json.loads_strict(raw, p), p), p)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"manifest {p} is truncated or malformed ({e})", path=p) from None


def release(root: PathLike, drop: Iterable[int], *, config: Optional[Config] = None) -> List[str]:
    """Delete the committed composites of the steps ``drop`` from the store ``root`` (a directory or a remote
    tier's URL); the newest committed composite always stays (the next selective save builds on it).
    Manifests go first (made durable locally), then the data files no remaining composite uses, so a kill at
    any moment leaves every other composite whole; with a damaged manifest present no data file is deleted.
    Returns the paths (URLs) removed."""
    if is_url(os.fspath(root)):
        url = os.fspath(root)
        return _remote_call(url, lambda: _release_remote(_open_url(url, config), set(drop)))
    root = local_path(root)
    wanted = set(drop)
    if not wanted & set(steps(root)):
        return []  # the common case: no manifest is parsed
    good, bad = _store.read_all(root)
    last = _store.newest(good)
    return _retain.drop(root, good, bad, sorted(n for n, m in good.items() if m.step in wanted and n != last))


def _release_remote(tier: "_remote.FsspecStore", wanted: set) -> List[str]:
    """:func:`release` on a remote tier, safe beside the tier's own copier: of the data objects, only those the
    dropped manifests used and no manifest listed *after* their removal uses are deleted, so a composite
    committed meanwhile (or one whose copy reuses an object the newest composite holds) keeps every object."""
    names = tier.names(_remote.MANIFESTS)
    if not wanted & {_store.manifest_step(n) for n in names}:
        return []
    good, bad = _tiers.read_all(tier)
    last = _store.newest(good)
    gone = sorted(n for n, m in good.items() if m.step in wanted and n != last)
    if not gone:
        return []
    used = _retain.referenced_files({n: good[n] for n in gone})
    removed = [tier.where(_remote.MANIFESTS, n) for n in tier.delete(_remote.MANIFESTS, gone)]
    after, bad_after = _tiers.read_all(tier)
    if bad or bad_after:  # what a damaged manifest references is unknown: keep every data object
        return removed
    orphans = sorted(used - _retain.referenced_files(after))
    return removed + [tier.where(_remote.DATA, n) for n in tier.delete(_remote.DATA, orphans)]


class RemoteFiles:
    """Plain files under an fsspec URL, e.g. beside a store's remote tier (the Accelerate plugin keeps its
    checkpoint folders there).  ``options`` are the file system's keyword arguments (``Config.remote_options``).
    Paths inside are ``sub`` (``/``-separated folders, may be empty) and a file ``name``.  ``bandwidth``
    (bytes per second, e.g. ``Config.remote_bandwidth``) caps the uploads of this object, as it caps each
    Checkpointer's remote tier: a copy of N bytes takes at least N / bandwidth seconds."""

    def __init__(self, url: str, options: Optional[dict] = None, *, bandwidth: Optional[int] = None):
        self._tier = _remote.FsspecStore(url, options, bandwidth=bandwidth)
        self.url = self._tier.url

    def _path(self, *parts: str) -> str:
        return "/".join(p for p in (self._tier.root.rstrip("/"), *parts) if p)

    def names(self, sub: str = "") -> List[str]:
        """The entries directly under ``sub`` (files and folders), sorted; none when it does not exist."""
        return self._tier.names(sub)

    def read(self, sub: str, name: str) -> bytes:
        """The bytes of the small file ``<url>/<sub>/<name>`` (a pointer), refused past 256 MiB."""
        return self._tier.read(sub, name)

    def upload(self, src: str, sub: str, name: str) -> None:
        """Copy the local file ``src`` to ``<url>/<sub>/<name>`` (whole, its size checked)."""
        if self._tier.local:  # a local file system wants the folders; object stores have none
            self._tier.fs.makedirs(self._path(sub), exist_ok=True)
        self._tier.put_file(src, sub, name)

    def delete(self, sub: str, names: Iterable[str]) -> List[str]:
        """Delete the files ``<url>/<sub>/<name>`` (those missing are no error); returns the names deleted."""
        return self._tier.delete(sub, list(names))

    def remove_tree(self, sub: str, first: Iterable[str] = ()) -> None:
        """Delete every file under ``<url>/<sub>``, the files named in ``first`` before the others (a folder's
        commit mark first, so that a kill midway never leaves it looking whole)."""
        self.delete(sub, first)
        base = self._path(sub)
        try:
            self._tier.fs.rm(base, recursive=True)
        except FileNotFoundError:
            pass
        self._tier.fs.invalidate_cache(base)

    def download(self, sub: str, dest: str) -> List[str]:
        """Copy every file under ``<url>/<sub>`` to the same relative path under the local ``dest``; returns
        the relative paths."""
        base = self._path(sub)
        got = []
        for path in self._tier.fs.find(base):
            rel = path[len(base):].lstrip("/")
            folder, _, name = rel.rpartition("/")
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            # as a tier's files are read: never through a link, never more than the size asked first
            self._tier.get_file("/".join(p for p in (sub, folder) if p), name, os.path.join(dest, rel))
            got.append(rel)
        return got


def _one_step(path: str, step: Optional[int], located: Optional[int]) -> Optional[int]:
    """The step asked for: ``step``, or the one ``path`` names; both must agree."""
    if step is not None and located is not None and step != located:
        raise CheckpointError(f"{path} is the checkpoint of step {located}, but step={step} was asked for")
    return located if step is None else step


def _open_url(url: str, config: Optional[Config]) -> "_remote.FsspecStore":
    return _remote_call(url, lambda: _fetch.remote_store(url, config))


def _remote_call(url: str, fn: Any) -> Any:
    """``fn()``, with what a file system raises of its own turned into a :class:`~layerckpt.CheckpointError`
    naming the URL (a missing file stays a ``FileNotFoundError``)."""
    try:
        return fn()
    except (CheckpointError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
        raise CheckpointError(f"{url} cannot be read: {type(e).__name__}: {e}; pass its options as "
                              f"config=Config(remote=URL, remote_options={{...}})") from None


def create_file(path: str, mode: str = "wb"):
    """A file object for writing ``path`` (created, or truncated), never through a symbolic link planted in
    its place (``OSError`` ELOOP instead): how every file layerckpt writes into a folder is opened."""
    return os.fdopen(_store.create(path), mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def read_json(path: str, what: str = "file") -> Any:
    """The JSON a small file of a store or of a framework's checkpoint folder holds, read as untrusted input:
    only a regular file (never a FIFO, a device or a symbolic link), bounded, UTF-8, no duplicate key; a
    missing file raises :class:`CheckpointNotFoundError`, anything else malformed a
    :class:`CheckpointCorruptError` naming the file."""
    return _json.load_strict(path, what, follow=False)


def parse_json(raw: bytes, where: str, what: str = "file") -> Any:
    """:func:`read_json` for bytes already read (e.g. from a remote), ``where`` naming where they came from."""
    return _json.loads_strict(raw, where, what)


__all__ = ["Composite", "create_file", "read_json", "parse_json", "is_url", "is_checkpoint", "locate", "local_path", "manifest_path", "manifest_name",
           "resolve", "newest", "steps", "next_step", "composites", "read_manifest", "release", "fsync_dir",
           "RemoteFiles", "MANIFEST_DIR"]
