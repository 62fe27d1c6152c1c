"""Reading across tiers: which tier holds the freshest committed composite, and a local view of it.

``restore``/``read_checkpoint`` open a :func:`view` first: the local directory
itself, or, for a remote URL or a local directory whose memory or remote tier
holds a fresher composite, a local folder of that composite: the memory tier's
own, or a temporary folder its manifest and referenced data files were
downloaded into (checksums are verified by the reader as always).  The reader
then reads that folder once, as it reads any local directory.  Freshness is
commit order (``seq``, which a Checkpointer continues past what its tiers
hold), then the commit time (two runs that forked from one remote composite),
so an older tier never shadows a newer one; copies of one composite tie, and
the faster tier is read.  An error about what a remote's view holds names the
remote's file by its URL (:func:`named_as`), never the temporary copy.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from ..format import _store
from ..write._flush import wait_for_saves
from ..format._json import loads_strict
from ..format._manifest import Manifest, load_manifest
from ..tiers._memtier import memory_path, refusal
from ..tiers._remote import DATA, MANIFESTS, FsspecStore, bigger, is_url
from ..tiers._tiers import COPIES_IN_FLIGHT, read_all, same_store, tier_id, wait_for_tiers
from ..config import Config
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt")

_SPEED = {"memory": 2, "local": 1, "remote": 0}  # on a tie in freshness, the faster tier is read


def split_url(url: str) -> Tuple[str, Optional[int]]:
    """(store URL, step or None) of a store URL or of one of its manifests' URLs."""
    url = url.rstrip("/")
    head, _, name = url.rpartition("/")
    step = _store.manifest_step(name)
    if step is not None and head.endswith("/" + MANIFESTS):
        return head[: -len(MANIFESTS) - 1], step
    return url, None


def pick(store, step: Optional[int]) -> Tuple[str, Manifest]:
    """The tier's manifest for ``step``, else its newest committed one (never past a newer damaged one).

    Only that manifest is read whole: the newest is told by the others' first bytes (``_store.peek``, one ranged
    read each), so a restore from a tier of 2,000 composites reads about what one of 2 does."""
    names = [n for n in store.names(MANIFESTS) if _store.manifest_step(n) is not None]
    if step is not None:
        name = _store.manifest_name(step)
        m = _read_one(store, name) if name in names else None
        if m is not None:
            return name, m
        have = sorted(_store.manifest_step(n) for n in names if n != name)
        raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {store.url}; committed steps: {have}")
    name, m, bad, _ = _store.pick_newest(names, lambda n: _peek(store, n), lambda n: _read_one(store, n))
    if m is None:
        hint = f" ({len(bad)} damaged manifest(s): {', '.join(sorted(bad))})" if bad else ""
        raise CheckpointNotFoundError(f"no committed checkpoint in {store.url}{hint}")
    for n in names:  # never fall back silently past a newer checkpoint that was committed and then damaged
        if _store.manifest_step(n) > m.step:
            try:
                _read_one(store, n)
            except CheckpointCorruptError:
                raise damage(store, n, f"; it is newer than the newest readable one ({name})") from None
    return name, m


def _peek(store, name: str) -> Optional[Tuple[int, int]]:
    """(seq, step) from the first bytes of the tier's manifest ``name`` (``_store.peek``), None where they do not
    tell (or cannot be read): then it is read whole."""
    try:
        m = _store.HEAD.match(store.head(MANIFESTS, name, _store.HEAD_BYTES))
    except Exception:  # noqa: BLE001 - a full read says what is wrong, in its own words
        return None
    if m is None or int(m.group(1)) != _store.manifest_step(name):
        return None
    return int(m.group(2)), int(m.group(1))


def _read_one(store, name: str) -> Optional[Manifest]:
    """The tier's manifest ``name`` read whole and validated; None if retention removed it since the listing;
    CheckpointCorruptError (``damage``) where it does not parse."""
    where = store.where(MANIFESTS, name)
    try:
        return Manifest.from_dict(loads_strict(store.read(MANIFESTS, name), where), where)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError, CheckpointCorruptError):
        raise damage(store, name, "") from None


def damage(store, name: str, more: str) -> CheckpointCorruptError:
    """What is wrong with the tier's manifest ``name``, which ``read_all`` could not read, ``more`` added."""
    where = store.where(MANIFESTS, name)
    why = f"manifest {where} is truncated or malformed"
    try:
        Manifest.from_dict(loads_strict(store.read(MANIFESTS, name), where), where)
    except CheckpointCorruptError as e:
        why = str(e)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        why = f"manifest {where} cannot be read ({type(e).__name__}: {e})"
    return CheckpointCorruptError(why + more, path=where)


def download(store, manifests: Mapping[str, Manifest], dest: str, data: bool = True, strict: bool = True) -> None:
    """Make ``dest`` a layerckpt directory holding ``manifests`` (and the data files they reference).
    ``strict=False`` (for ``verify``) leaves a missing or mis-sized file to the reader to report."""
    _store.ensure_layout(dest)
    files: Dict[str, int] = {}
    for name, m in manifests.items():
        with os.fdopen(_store.create(os.path.join(dest, _store.MANIFEST_DIR, name)), "wb") as f:
            f.write(store.read(MANIFESTS, name))
        for fname, fe in m.files.items():
            _store.safe_join(dest, _store.DATA_DIR, fname, f"manifest {store.where(MANIFESTS, name)}")
            files[fname] = fe.size
    if not data or not files:
        return

    def get(fname: str) -> None:
        dst = os.path.join(dest, _store.DATA_DIR, fname)
        try:  # never more than the manifest records: a bigger file is refused, not copied whole
            store.get_file(DATA, fname, dst, files[fname])
        except FileNotFoundError:
            if not strict:
                return
            raise CheckpointCorruptError(f"{store.where(DATA, fname)}, which a committed manifest references, is "
                                         f"missing", path=store.where(DATA, fname)) from None
        if strict and os.path.getsize(dst) != files[fname]:
            raise CheckpointCorruptError(
                f"{store.where(DATA, fname)} has {os.path.getsize(dst)} bytes, its manifest says {files[fname]}",
                path=store.where(DATA, fname))

    with ThreadPoolExecutor(min(COPIES_IN_FLIGHT, len(files)), thread_name_prefix="layerckpt-fetch") as ex:
        for fut in [ex.submit(get, f) for f in sorted(files)]:
            fut.result()


@dataclass(frozen=True)
class View:
    """A local place one read takes a composite from: ``path`` (a directory, or for the local directory as
    given, maybe one of its manifests) at ``step`` (None: as ``path`` names it)."""
    path: Any
    step: Optional[int]
    #: the manifest a report names, where not the one read: the tier's (a remote's URL), or the local copy
    #: of the memory tier's composite, so that ``Checkpointer.adopt(report)`` continues it
    manifest: Optional[str] = None
    opened: float = field(default_factory=time.perf_counter)  # when the view was opened (a report's seconds)
    tier: str = "local"  # whose copy it is: "local", "memory" or "remote"


class Source:
    """A committed composite outside the local directory: on the memory tier, or on a remote one."""

    def __init__(self, kind: str, store, name: str, m: Manifest, local: Optional[str] = None):
        self.kind, self.store, self.name, self.m = kind, store, name, m
        self.local = local  # the local directory whose tier this is, if any

    @contextlib.contextmanager
    def open(self) -> Iterator[View]:
        """A local view of the composite: the memory tier's own folder, a ``file://`` remote's own folder (read
        in place, as the memory tier is: a copy first would read every byte twice), or a temporary folder the
        remote composite is downloaded into (removed on exit)."""
        t0 = time.perf_counter()
        if self.kind == "memory":
            yield View(self.store.root, self.m.step, self._local_copy(), t0, self.kind)
            return
        if getattr(self.store, "local", False):
            self._not_bigger()
            with named_as(self.store.url, *in_place(self.store)):  # its own folder, named by its URL
                yield View(self.store.root, self.m.step, self.store.where(MANIFESTS, self.name), t0, self.kind)
            return
        with tempfile.TemporaryDirectory(prefix="layerckpt-fetch-") as tmp:
            self._download(tmp)  # what goes wrong writing the copy names the copy: the local disk failed
            with named_as(self.store.url, tmp):  # what is wrong with what it holds names the tier's file
                yield View(tmp, self.m.step, self.store.where(MANIFESTS, self.name), t0, self.kind)

    def _not_bigger(self) -> None:
        """A tier's data file larger than its manifest records is not the one recorded: refused, as a download
        refuses it (the reader checks the rest: links, other kinds of file, truncation, checksums)."""
        for fname, f in sorted(self.m.files.items()):
            try:
                have = os.lstat(os.path.join(self.store.root, DATA, fname)).st_size
            except OSError:  # missing or unreadable: the reader says which
                continue
            if have > f.size:
                raise bigger(self.store.where(DATA, fname), have, f.size)

    def _local_copy(self) -> Optional[str]:
        """The local directory's manifest of the same composite (same commit), if it has it."""
        mine = os.path.join(self.local or "", _store.MANIFEST_DIR, self.name)
        if self.local and os.path.exists(mine) and load_manifest(mine).seq == self.m.seq:
            return mine
        return None

    def _download(self, dest: str) -> None:
        try:
            download(self.store, {self.name: self.m}, dest)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"downloading the composite of step {self.m.step} from {self.store.url} "
                                  f"failed: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def view(path: Any, step: Optional[int], config: Optional[Config], memory: bool = True) -> Iterator[View]:
    """Where one read of ``path`` takes its composite from (see the module's docstring): the local
    directory as given, or a local view of the fresher tier's composite.  ``memory=False``: never the memory
    tier's (its copy was found damaged)."""
    src = source(path, step, config, memory)
    if src is None:
        yield View(path, step)
        return
    with src.open() as v:
        yield v


def remote_store(url: str, config: Optional[Config]) -> FsspecStore:
    wait_for_tiers(url)  # read your writes: this process's copies into it land first
    return FsspecStore(url, config.remote_options if config is not None else None)


def source(path: Any, step: Optional[int], config: Optional[Config], memory: bool = True) -> Optional[Source]:
    """Where to read from when it is not simply the local directory ``path``; None to read that."""
    if is_url(path):
        return _url_source(path, step, config)
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root) and os.path.exists(root):
        return None  # a manifest file: that one is read
    wait_for_saves(root)
    if config is None or not (config.memory_tier or config.remote):
        return None  # no tier named: the local directory is read (and its reader resolves it, once)
    found: List[_Found] = []
    _local_candidate(root, step, found)
    # only the tiers the caller's Config names: a manifest is data, and its recorded Config never redirects
    if config is not None and config.memory_tier and memory:
        _memory_candidate(root, step, found)
    if config is not None:
        _remote_candidate(config.remote, root, step, config, found)
    if not found:
        return None  # the local reader says what is missing
    return max(found, key=lambda f: f[0])[2]


#: a tier holding the composite asked for: ((seq, commit time, speed), tier, its Source; None for the local one)
_Found = Tuple[Tuple[int, float, int], str, Optional[Source]]


def _url_source(path: str, step: Optional[int], config: Optional[Config]) -> Source:
    url, located = split_url(path)
    if step is not None and located is not None and step != located:
        raise CheckpointError(f"{path} is the checkpoint of step {located}, but step={step} was asked for")
    try:
        store = remote_store(url, config)
        with named_as(store.url, *in_place(store)):
            return Source("remote", store, *pick(store, located if step is None else step))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
        raise CheckpointError(f"{url} cannot be read: {type(e).__name__}: {e}; pass its options as "
                              f"config=Config(remote=URL, remote_options={{...}})") from None


def _local_candidate(root: str, step: Optional[int], found: List[_Found]) -> None:
    """The local directory's composite, if it has it."""
    try:
        m = load_manifest(_store.resolve(root, step))
    except CheckpointNotFoundError:
        return
    found.append(((m.seq, m.created, _SPEED["local"]), "local", None))


def foreign(root: str, store, local_empty: bool = False) -> Optional[str]:
    """Why the tier ``store`` is not the store ``root``'s (its identity differs), or None when it is."""
    try:
        local = _store.store_id(root)
    except CheckpointError as e:
        return f"this store's identity cannot be read ({e})"
    tier = tier_id(store)
    if same_store(local, tier, local_empty):
        return None
    return (f"it holds another store's checkpoints (its identity is {tier or 'missing'}, the identity of {root} "
            f"is {local or 'missing'})")


def _memory_candidate(root: str, step: Optional[int], found: List[_Found]) -> None:
    from ..tiers._remote import LocalStore

    mem = memory_path(root)
    try:
        why = refusal(mem) or foreign(root, LocalStore(mem))
    except FileNotFoundError:
        return
    if why is not None:  # planted, or another store's: never loaded
        log.warning("layerckpt: the memory tier %s is not used: %s; the disk is read", mem, why)
        return
    if not os.path.isdir(os.path.join(mem, _store.MANIFEST_DIR)):
        return
    try:
        name, mm = pick(LocalStore(mem), step)
    except CheckpointError as e:  # a stale or damaged memory tier: the disk is read
        log.info("layerckpt: memory tier %s not used: %s", mem, e)
        return
    found.append(((mm.seq, mm.created, _SPEED["memory"]), "memory", Source("memory", LocalStore(mem), name, mm, root)))


def _remote_candidate(url: Optional[str], root: str, step: Optional[int], config: Optional[Config],
                      found: List[_Found]) -> None:
    if not url:
        return
    try:
        store = remote_store(url, config)
        with named_as(store.url, *in_place(store)):
            name, rm = pick(store, step)
    except CheckpointNotFoundError:
        return
    except Exception as e:  # noqa: BLE001 - an unreachable remote must not hide a local checkpoint
        if not found:
            raise
        log.warning("layerckpt: the remote tier %s could not be read (%s: %s); restoring from %s",
                    url, type(e).__name__, e, "memory" if found[-1][1] == "memory" else root)
        return
    why = foreign(root, store, local_empty=not _store.list_manifests(root))
    if why is not None:
        msg = f"the remote tier {url} (Config.remote) is not used: {why}"
        if not found:
            raise CheckpointError(f"{msg}; restore it by its URL if it is the one meant")
        log.warning("layerckpt: %s; restoring from %s", msg, "memory" if found[-1][1] == "memory" else root)
        return
    found.append(((rm.seq, rm.created, _SPEED["remote"]), "remote", Source("remote", store, name, rm)))


@contextlib.contextmanager
def local_view(url: str, options: Optional[Mapping[str, Any]], step: Optional[int], what: str) -> Iterator[str]:
    """A temporary local directory of a remote store for the CLI: its manifests only (``what='manifests'``),
    plus the data of the composite the command reads (``'one'``), or of every composite (``'all'``)."""
    base, located = split_url(url)
    store = FsspecStore(base, options)
    local = in_place(store)  # a file:// tier's own folder: named by its URL, as the copy is
    with named_as(store.url, *local) as rename:
        good, bad = read_all(store)
    with tempfile.TemporaryDirectory(prefix="layerckpt-view-") as tmp, named_as(store.url, *local):
        download(store, good, tmp, data=what == "all", strict=False)
        unreadable: Dict[str, str] = {}
        for n in bad:  # for the command to report; one that cannot even be read (a FIFO, too big) raises here,
            try:       # but for verify, which reports it (:func:`unreadable_in`) and checks every other one
                raw = store.read(MANIFESTS, n)
            except FileNotFoundError:  # retention removed it since the listing
                continue
            except (CheckpointError, OSError) as e:
                if what != "all":
                    raise
                unreadable[n] = rename(str(e)) if isinstance(e, CheckpointError) else \
                    rename(f"manifest {store.where(MANIFESTS, n)} cannot be read ({type(e).__name__}: {e})")
                continue
            with os.fdopen(_store.create(os.path.join(tmp, _store.MANIFEST_DIR, n)), "wb") as f:
                f.write(raw)
        if what == "one":
            name, m = pick(store, located if step is None else step)
            download(store, {name: m}, tmp)
        _UNREADABLE[os.path.realpath(tmp)] = unreadable
        try:
            # the command's output and its error name the tier's files (``store.where``), never the copy
            with named_as(store.url, tmp, *local) as named, _renamed_output(named):
                yield tmp if located is None else os.path.join(tmp, _store.MANIFEST_DIR, _store.manifest_name(located))
        finally:
            _UNREADABLE.pop(os.path.realpath(tmp), None)


# -- a local view's files named as the tier's: a downloaded copy is temporary (and gone when the error is read),
# and the URL is what the user gave; a ``file://`` remote read in place is named by its URL too.  The memory
# tier's folder is read in place and is a real location: its paths stand.

def in_place(store) -> Tuple[str, ...]:
    """The local folder a ``file://`` tier is read in place from (named by its URL), if it is one."""
    root = getattr(store, "root", None)
    return (root,) if getattr(store, "local", False) and isinstance(store, FsspecStore) and root else ()


def renamer(url: str, *roots: str):
    """A function of a text that names each file under one of ``roots`` (a local view's folder) as the tier's
    file at ``url``: ``<root>/manifests/x.json`` -> ``<url>/manifests/x.json`` (``store.where``), ``<root>`` ->
    ``<url>``.  Only whole path components match: a longer name that starts alike, or a root inside a URL
    (``file:///<root>``), is left alone."""
    found = {r.rstrip(os.sep) for root in roots if root for r in (os.path.abspath(root), os.path.realpath(root))}
    found.discard("")
    if not found:
        return lambda text: text
    alt = "|".join(re.escape(r) for r in sorted(found, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w./-])(?:" + alt + r")(?![\w.-])")
    base = url.rstrip("/")

    def rename(text: str) -> str:
        return pattern.sub(lambda _: base, text) if isinstance(text, str) else text

    return rename


def rename_error(e: BaseException, rename) -> None:
    """``e``'s message and the paths it carries (``path``, ``filename``, ...) renamed in place (``renamer``); the
    error keeps its type, traceback and cause."""
    e.args = tuple(rename(a) if isinstance(a, str) else a for a in e.args)
    for k, v in list(vars(e).items()):
        if isinstance(v, str):
            setattr(e, k, rename(v))
    if isinstance(e, OSError):  # CheckpointNotFoundError, CheckpointWriteError: str() may read these
        for k in ("strerror", "filename", "filename2"):
            v = getattr(e, k, None)
            if isinstance(v, str):
                setattr(e, k, rename(v))


@contextlib.contextmanager
def named_as(url: str, *roots: str):
    """A library error raised inside names the local view ``roots``' files as the tier's at ``url`` (see
    :func:`renamer`, which it yields)."""
    rename = renamer(url, *roots)
    try:
        yield rename
    except CheckpointError as e:
        rename_error(e, rename)
        raise


class _RenamingStream:
    """A text stream that writes to ``out`` what it is given, renamed."""

    def __init__(self, out, rename):
        self._out, self._rename = out, rename

    def write(self, text: str) -> int:
        self._out.write(self._rename(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...: the stream's own
        return getattr(self._out, name)


@contextlib.contextmanager
def _renamed_output(rename) -> Iterator[None]:
    """The command's stdout and stderr written renamed (a CLI command over a :func:`local_view`)."""
    out, err = sys.stdout, sys.stderr
    with contextlib.redirect_stdout(_RenamingStream(out, rename)), \
            contextlib.redirect_stderr(_RenamingStream(err, rename)):
        yield


#: local view (its real path) -> the tier's manifests it could not copy, by name: why each cannot be read
_UNREADABLE: Dict[str, Dict[str, str]] = {}


def unreadable_in(root: str) -> Dict[str, str]:
    """The manifests of the tier a :func:`local_view` at ``root`` copies that could not be read at all (a FIFO, a
    link, past the size cap), by name: why each cannot be read; {} for any other directory."""
    return dict(_UNREADABLE.get(os.path.realpath(root), {}))


def cli_options(text: Optional[str]) -> Dict[str, Any]:
    if not text:
        return {}
    try:
        out = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"--remote-options must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"--remote-options must be a JSON object, got {text!r}")
    return out

