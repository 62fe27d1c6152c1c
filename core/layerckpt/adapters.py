"""What the framework adapters share (``lightning_layerckpt``, ``accelerate_layerckpt``), in one place.

- the Config an adapter is given: :func:`as_config` (a Config, a dict of fields, a YAML path, or an
  environment variable's YAML), and Config fields as keyword arguments: :func:`with_config_fields`
  gives a function one typed keyword parameter per :class:`~layerckpt.Config` field, generated from
  ``dataclasses.fields(Config)`` (the one list of fields), and :func:`config_overrides` checks what a
  caller passed against those types;
- the step of each save into a store: :class:`StepCounter`;
- closing several Checkpointers at once: :func:`close_all`;
- which adapter object holds a store in this process, so that a newer one takes it over: :func:`hold`;
- which model an optimizer belongs to: :func:`owners`, :func:`pair_optimizers`;
- writing a file or folder durably under its final name: :func:`replace_durably`;
- a framework folder's pointer file and the store it names (beside the folders only): :func:`pointer_store`,
  :func:`check_store_inside`; exporting such a folder, its own regular files only, staged under a fresh name:
  :func:`export_paths`, :func:`export_staging`, :func:`export_done`;
- the loss a save's selection is scaled by, in the unit of clipped gradients: :class:`SelectionLoss`.
"""
from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import stat
import typing
from typing import (Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence, Set, Tuple,
                    TypeVar, Union)

import torch

from . import _faults, _registry, store
from .select._clip import SelectionLoss  # noqa: F401 - for the adapters
from .config import Config
from .errors import CheckpointError, ConfigError

log = logging.getLogger("layerckpt")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
ConfigLike = Union[Config, str, "os.PathLike[str]", Mapping[str, Any], None]


# ------------------------------------------------------------------ Config

def as_config(config: ConfigLike, *, env: Optional[str] = None, only_config: bool = False) -> Config:
    """A Config from a Config, a dict of its fields or a YAML path (``only_config``: a Config alone).  None:
    the YAML file the environment variable ``env`` names, when it is set, else the defaults."""
    if config is None:
        path = os.environ.get(env) if env else None
        return Config.from_yaml(path) if path else Config()
    if isinstance(config, Config):
        return config
    if only_config:
        raise ConfigError(f"config must be a layerckpt.Config, got {type(config).__name__}")
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_yaml(config)
    raise ConfigError(f"config must be a layerckpt.Config, a dict or a YAML path, got {type(config).__name__}")


def default_of(name: str) -> Any:
    """The default of the Config field ``name``."""
    f = next(f for f in dataclasses.fields(Config) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def with_preemption(config: Config) -> Config:
    """The adapters' default for ``Config.preemption``: SIGTERM where the user left it unset (None); a notice
    handled is never worse than one ignored.  ``False`` turns it off, a name or list picks the signals."""
    from .preempt import ADAPTER_DEFAULT

    return config if config.preemption is not None else config.replace(preemption=list(ADAPTER_DEFAULT))


@functools.lru_cache(maxsize=None)
def _field_types() -> Dict[str, Any]:
    """Config field -> the type an adapter's keyword argument for it takes (None: not given).  Byte counts
    (fields named ``*_bytes``, ``*_bandwidth``) also take strings such as ``'16MiB'``, as Config does."""
    hints = typing.get_type_hints(Config)
    out = {}
    for f in dataclasses.fields(Config):
        t = hints[f.name]
        if f.name.endswith(("_bytes", "_bandwidth")) and str not in typing.get_args(t):
            t = Union[t, str]
        out[f.name] = Optional[t]
    return out


def with_config_fields(fn: F) -> F:
    """Give ``fn`` (whose last parameter is ``**overrides``) the signature that names its Config fields: its
    own parameters, then one keyword-only parameter per Config field it does not already take, typed as
    :func:`config_overrides` checks and defaulting to None.  Tools that read signatures (``help()``,
    LightningCLI's typed ``init_args`` through jsonargparse) see every field with its type."""
    sig = inspect.signature(fn)
    own = typing.get_type_hints(fn)
    params = [p.replace(annotation=own.get(p.name, p.annotation)) for p in sig.parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=t)
               for name, t in _field_types().items() if name not in taken]
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


def config_overrides(given: Mapping[str, Any], where: str, none_unset: bool = True) -> Dict[str, Any]:
    """The Config fields among ``given``, each checked against its field's type; an unknown name or a value of
    the wrong type is refused, naming both (Config then checks the values).  ``none_unset``: a None is the
    signature's default, "not given", and left out; else it is passed on (e.g. ``threshold=None``)."""
    types = _field_types()
    unknown = sorted(set(given) - set(types))
    if unknown:
        raise ConfigError(f"{where}() got unknown argument(s) {', '.join(unknown)}; the layerckpt Config fields it "
                          f"also takes: {', '.join(sorted(types))}")
    out = {}
    for name, value in given.items():
        if value is None and none_unset:
            continue
        if not _fits(value, types[name]):
            raise ConfigError(f"{where}({name}={value!r}): Config.{name} takes {_describe(types[name])}, got "
                              f"{type(value).__name__}")
        out[name] = value
    return out


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` (the forms Config's fields use; others are left to Config)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Union:
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is int:  # 2.0 is an int to Config, as in YAML
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if hint is float:
        return isinstance(value, (int, float))
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        return isinstance(value, Mapping)
    return not isinstance(hint, type) or isinstance(value, hint)


def _describe(hint: Any) -> str:
    """``Optional[Union[int, str]]`` -> ``'int or str'``: what a field takes besides None."""
    parts = [a for a in (typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,))
             if a is not type(None)]
    return " or ".join(getattr(a, "__name__", None) or str(a).replace("typing.", "") for a in parts)


# ------------------------------------------------------------------ steps and Checkpointers

class StepCounter:
    """The step of each save into one store: a caller's own step where it gives one, else one past the
    previous save (the first: one past the newest step the store holds, :func:`layerckpt.store.next_step`),
    so a step never names two composites."""

    def __init__(self, first: int = 0):
        self.next = first

    def step(self, given: Any = None) -> int:
        """``given`` when it is a non-negative int, else the next free step."""
        if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
            return given
        return self.next

    def saved(self, step: int) -> None:
        """A save of ``step`` was made: the next one goes after it."""
        self.next = step + 1


def close_all(checkpointers: Union[MutableMapping[Any, Any], List[Any]], quiet: bool = False,
              what: str = "a save") -> None:
    """Close every Checkpointer in ``checkpointers`` (a dict or a list, emptied as they close; each close waits
    for its saves), then raise the first failure (``quiet``: log it).  One failure never leaves the others open."""
    first: Optional[BaseException] = None
    while checkpointers:
        ck = checkpointers.popitem()[1] if isinstance(checkpointers, MutableMapping) else checkpointers.pop(0)
        try:
            ck.close()
        except BaseException as e:  # the other stores still close
            first = first or e
    if first is not None and quiet:
        log.error("layerckpt: %s was not committed: %s", what, first)
    elif first is not None:
        raise first


# ------------------------------------------------------------------ stores held by adapter objects

def hold(root: str, on_taken: Callable[[str], None]) -> None:
    """The object of the bound method ``on_taken`` (a plugin, a callback, a Fabric handle) is about to open
    Checkpointers on the store ``root`` in this process.  The adapter object that held it before, if it is still
    alive and another one, is told first through its own ``on_taken(root)``: it closes what it keeps open there
    (its saves in flight end first) and refuses later saves there with a clear error.  So an adapter's cache
    follows the engine's takeover (a newer Checkpointer on a store takes it over from an older one of this
    process) instead of keeping a Checkpointer that was replaced.  The holder is kept in the engine's one
    registry of this process's stores (``_registry``), beside the store's open writer."""
    root = os.path.abspath(os.fspath(root))
    older = _registry.hold(root, on_taken)
    if older is not None:
        _faults.point("takeover.begun")
        older(root)


def close_quietly(checkpointers: Union[MutableMapping[Any, Any], List[Any]], what: str) -> None:
    """:func:`close_all` for a takeover: a failure is logged (each PendingSave keeps its own), not raised into
    the newer object's call."""
    close_all(checkpointers, quiet=True, what=what)


def owners(optimizer: Any, models: Sequence[torch.nn.Module]) -> Set[Optional[int]]:
    """The indices of the ``models`` that own ``optimizer``'s parameters (None for a parameter none of them
    owns); an optimizer wrapper with an ``optimizer`` attribute (accelerate's) is looked through."""
    owner: Dict[int, int] = {}
    for i, m in enumerate(models):
        for p in m.parameters():
            owner.setdefault(id(p), i)
    opt = getattr(optimizer, "optimizer", optimizer)
    return {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}


def pair_optimizers(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> List[Optional[Any]]:
    """Per model, the one optimizer (unwrapped) over its parameters, or None.  An optimizer over parameters of
    no model or of several, and a model with two optimizers, are refused, saying what to change."""
    paired: List[Optional[Any]] = [None] * len(models)
    paired_from: Dict[int, int] = {}
    for j, wrapped in enumerate(optimizers):
        opt = getattr(wrapped, "optimizer", wrapped)
        idx = owners(opt, models)
        if len(idx) != 1 or None in idx:
            what = "parameters of no prepared model" if idx <= {None} else "parameters of several prepared models"
            raise CheckpointError(
                f"optimizer {j} ({type(opt).__name__}) holds {what}; layerckpt pairs each optimizer with the one "
                f"prepared model that owns all its parameters")
        i = idx.pop()
        if paired[i] is not None:
            raise CheckpointError(
                f"model {i} ({type(models[i]).__name__}) has two optimizers (optimizers {paired_from[i]} and {j}); "
                f"layerckpt keeps one optimizer per model: split the model or use one optimizer with "
                f"several param_groups")
        paired[i], paired_from[i] = opt, j
    return paired


# ------------------------------------------------------------------ durable files

def replace_durably(tmp: str, output: str) -> str:
    """Move ``tmp`` (a file or a folder, completely written) to ``output`` durably: every file and folder in
    it fsynced, then the rename, then the parent folder fsynced, so that after a power loss ``output`` is
    either whole or absent.  Returns ``output``."""
    _fsync_tree(tmp)
    os.replace(tmp, output)
    store.fsync_dir(os.path.dirname(os.path.abspath(output)))
    return output


def _fsync_tree(path: str) -> None:
    if not os.path.isdir(path):
        _fsync_file(path)
        return
    for d, _, files in os.walk(path, topdown=False):
        for f in files:
            _fsync_file(os.path.join(d, f))
        store.fsync_dir(d)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


__all__ = ["as_config", "default_of", "with_config_fields", "config_overrides", "StepCounter", "close_all",
           "owners", "pair_optimizers", "replace_durably"]


def write_pointer(path: str, body: Dict[str, Any]) -> str:
    """Write a framework folder's small JSON pointer file atomically (tmp + rename), not fsynced: like the
    framework's own files beside it, and a folder whose composite never committed is refused anyway."""
    import json

    with store.create_file(path + ".tmp", "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
    os.replace(path + ".tmp", path)
    return path


def read_pointer_json(path: str) -> Any:
    """A pointer file's parsed JSON: ``FileNotFoundError`` when there is none; None when it is malformed (the
    caller says so, as a pointer); a FIFO, device or link is refused by the reader's error."""
    from .errors import CheckpointCorruptError

    try:
        return store.read_json(path, "pointer")
    except CheckpointCorruptError:
        if not os.path.isfile(path) or os.path.islink(path):
            raise  # not a plain file: the reader's error says which
        return None


def read_folder_pointer(folder: str, name: str, parse: Callable[[Any, str], T]) -> Optional[T]:
    """``parse(d, path)`` of the parsed pointer file ``name`` in ``folder`` (``d`` None when it is malformed);
    None when the folder has none (a folder the framework wrote on its own)."""
    path = os.path.join(os.path.abspath(folder), name)
    try:
        d = read_pointer_json(path)
    except FileNotFoundError:
        return None
    return parse(d, path)


def pointer_store(d: Any, path: str, fmt: str, version: int, reader: str, holds: str,
                  valid: Callable[[Dict[str, Any]], bool], up: int = 1) -> str:
    """Check what every adapter's pointer file holds (``format``, ``version``, ``store`` relative to its folder,
    ``step``, ``token``) and ``valid(d)`` for the adapter's own fields; the store's root.  A malformed one is a
    CheckpointCorruptError saying the folder cannot be loaded (``holds``: what the composite holds); a newer
    version one naming ``reader`` to upgrade; a ``store`` anywhere but where the adapter writes it (one folder
    name, one to ``up`` folders above the checkpoint folder: see :func:`pointed_store`) one saying so."""
    from .errors import CheckpointCorruptError

    ok = (isinstance(d, dict) and d.get("format") == fmt and isinstance(d.get("version"), int)
          and isinstance(d.get("store"), str) and isinstance(d.get("step"), int) and d["step"] >= 0
          and isinstance(d.get("token"), str) and valid(d))
    if not ok:
        raise CheckpointCorruptError(
            f"{path} is not a valid layerckpt pointer (truncated or edited?); it names the layerckpt composite "
            f"holding {holds}, so the folder cannot be loaded", path=path)
    if d["version"] > version:
        raise CheckpointCorruptError(f"{path} has pointer version {d['version']}, newer than this {reader} reads "
                                     f"({version}); upgrade layerckpt", path=path)
    return pointed_store(path, d["store"], up)


def pointed_store(path: str, rel: str, up: int) -> str:
    """The store root that the pointer file ``path`` names as ``rel``, which must be where the adapters write it:
    ``..`` one to ``up`` times, then one folder name (``../layerckpt`` beside the checkpoint folders,
    ``../../layerckpt`` beside their ``checkpoints/``).  A folder may come from elsewhere (a download, a copy of
    someone's run), and its pointer decides what a load or ``layerckpt export`` reads: an absolute path, one
    climbing further up or going down elsewhere would read whatever store lies there.  Checked on the text alone
    (a remote folder's pointer is a URL); :func:`check_store_inside` checks the links of a local one."""
    from .errors import CheckpointCorruptError

    parts = [p for p in rel.split("/") if p not in ("", ".")]
    ups = next((i for i, p in enumerate(parts) if p != ".."), len(parts))
    if os.path.isabs(rel) or "\0" in rel or not 1 <= ups <= up or len(parts) != ups + 1:
        what = ("is an absolute path" if os.path.isabs(rel) else
                f"climbs {ups} folders up" if ups > up else "is not a folder beside the checkpoint folder")
        beside = " or ".join("/".join([".."] * n + ["<store>"]) for n in range(1, up + 1))
        raise CheckpointCorruptError(
            f"{path} names the layerckpt store {rel!r}, which {what}; layerckpt writes it beside the checkpoint "
            f"folders ({beside}), so the pointer was edited and the folder is not loaded: restore its "
            f"{os.path.basename(path)} as layerckpt wrote it, with the store in its place", path=path)
    return os.path.normpath(os.path.join(os.path.dirname(path), rel))


def check_store_inside(pointer: str, root: str) -> None:
    """Refuse the store ``root`` that the local pointer file ``pointer`` names (see :func:`pointed_store`) when it
    resolves outside the folder it lies in: a symbolic link in its place leading elsewhere would have an export
    read (and copy out) whatever store that is.  A store linked within that folder is followed."""
    real, base = os.path.realpath(root), os.path.realpath(os.path.dirname(root))
    if not real.startswith(base.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"{pointer} names the layerckpt store {root}, which is a symbolic link to {real}, outside {base}; an "
            f"export reads only a store beside the checkpoint folders: put the store itself there (not a link to "
            f"it) and export again")


def pointed_manifest(root: str, step: int, token: Any, folder: str, token_at: Callable[[str], Any],
                     older: str) -> str:
    """The manifest of step ``step`` in the store ``root`` that the pointer file of ``folder`` names (its
    ``token``, read from a manifest by ``token_at``); a CheckpointNotFoundError when that composite was never
    committed or another one holds the step (``older``: what to do instead, e.g. "load an older checkpoint
    folder")."""
    from .errors import CheckpointNotFoundError

    try:
        mpath = store.resolve(root, step)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"the layerckpt composite of {folder} (step {step} in {root}) was never committed: the run stopped "
            f"before that checkpoint was durable; {older}") from None
    found = token_at(mpath)
    if found != token:
        raise CheckpointNotFoundError(
            f"{mpath} belongs to another checkpoint than {folder} (token {found!r}, the pointer names {token!r}): "
            f"that folder's own composite was never committed; {older}")
    return mpath


def export_paths(folder: Union[str, "os.PathLike[str]"], output: Union[str, "os.PathLike[str]"]) -> Tuple[str, str]:
    """(folder, output) as absolute paths for an export of a framework's checkpoint folder into a new directory;
    an output directory that exists and is not empty is refused."""
    folder, output = os.path.abspath(os.fspath(folder)), os.path.abspath(os.fspath(output))
    if os.path.exists(output) and os.listdir(output):
        raise CheckpointError(f"{output} exists and is not empty; export into a new directory")
    return folder, output


@contextlib.contextmanager
def export_staging(folder: str, output: str, pointer: str) -> Iterator[str]:
    """The staging folder of an export into ``output`` (see :func:`export_paths`), holding a copy of the
    framework's checkpoint ``folder`` without its pointer file ``pointer``; the caller writes the rest into it
    and ends with :func:`export_done`.  Its name is a fresh one beside ``output`` (``.<name>.<random>.tmp``): a
    path that was there before, whatever its name, is never touched.  Everything the copy would take is checked
    before anything is written (:func:`_export_entries`); on a failure the staging folder goes, nothing else."""
    import shutil
    import tempfile

    entries = _export_entries(folder, pointer)
    parent, name = os.path.split(output)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp")
    try:
        _copy_entries(folder, tmp, entries)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_done(tmp: str, output: str) -> str:
    """The staged export ``tmp`` becomes ``output`` (an empty folder there is replaced), durably."""
    if os.path.exists(output):
        os.rmdir(output)
    return replace_durably(tmp, output)


_KINDS = ((stat.S_ISLNK, "is a symbolic link"), (stat.S_ISFIFO, "is a FIFO"), (stat.S_ISCHR, "is a character device"),
          (stat.S_ISBLK, "is a block device"), (stat.S_ISSOCK, "is a socket"))


def _not_copied(path: str, mode: int) -> CheckpointError:
    what = next((name for test, name in _KINDS if test(mode)), "changed while the export read it")
    return CheckpointError(
        f"{path} {what}; an export copies only the regular files and folders inside the checkpoint folder, never "
        f"what a link or special file leads to: replace it with the file itself, or remove it, and export again")


def _export_entries(folder: str, skip: str) -> List[Tuple[str, bool]]:
    """(path relative to ``folder``, whether a folder) of everything an export copies, each folder before what it
    holds; ``skip``, the pointer file, left out.  A checkpoint folder may come from elsewhere: a symbolic link
    (to a file or a folder), FIFO, device or socket in it is refused, naming it, instead of copying a file from
    outside the folder into the output, reading /dev/zero until the disk is full or waiting on a FIFO forever."""
    out: List[Tuple[str, bool]] = []
    todo = [""]
    while todo:
        rel = todo.pop()
        with os.scandir(os.path.join(folder, rel) if rel else folder) as it:
            for e in it:
                sub = os.path.join(rel, e.name)
                if rel or e.name != skip:
                    mode = e.stat(follow_symlinks=False).st_mode
                    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                        raise _not_copied(os.path.join(folder, sub), mode)
                    out.append((sub, stat.S_ISDIR(mode)))
                    if stat.S_ISDIR(mode):
                        todo.append(sub)
    return out


def _copy_entries(folder: str, tmp: str, entries: List[Tuple[str, bool]]) -> None:
    """Copy ``entries`` (:func:`_export_entries`) of ``folder`` into ``tmp``, each file with its mode and times
    (as ``shutil.copy2``), ``tmp`` with the folder's mode (its owner may always write: the export goes on)."""
    import shutil

    for rel, is_dir in entries:
        if is_dir:
            os.mkdir(os.path.join(tmp, rel))
            continue
        fd, st = _open_below(folder, rel)
        with os.fdopen(fd, "rb") as src, open(os.path.join(tmp, rel), "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.chmod(os.path.join(tmp, rel), stat.S_IMODE(st.st_mode))
        os.utime(os.path.join(tmp, rel), ns=(st.st_atime_ns, st.st_mtime_ns))
    os.chmod(tmp, stat.S_IMODE(os.stat(folder).st_mode) | stat.S_IRWXU)


def _open_below(folder: str, rel: str) -> Tuple[int, os.stat_result]:
    """The file ``rel`` of ``folder`` opened for reading as the store's own files are (``_json.open_regular``: no
    component of ``rel`` followed through a link, a FIFO not waited on), and what it is; anything but a regular
    file, or a link in place of a folder above it (put there since :func:`_export_entries` listed the folder),
    refused as there."""
    from .errors import CheckpointCorruptError
    from .format._json import open_regular

    path = os.path.join(folder, rel)
    try:
        return open_regular(path, "file", follow=False, under=folder)
    except CheckpointCorruptError as e:
        at = e.path or path
        try:
            mode = os.lstat(at).st_mode
        except OSError:
            mode = stat.S_IFLNK
        raise _not_copied(at, mode) from None
