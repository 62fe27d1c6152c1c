"""The pretrained weights a training started from (``Config(pretrained=PATH)``): a source of model tensors that a
checkpoint need not hold.

A frozen tensor (a backbone under a trained head, the base under adapters) stays, for the whole run, what the
pretrained file holds.  Where a save proves one bit-identical to a tensor of the pretrained files (the same
fingerprint, ``select/_exact``: every byte, two CRCs per 16 MiB, dtype and shape), the manifest records a reference
instead of its bytes (``Manifest.pretrained``: the pretrained tensor's name, dtype, shape and fingerprint, sealed to
the entry's key): never a path.  The match is by content, so a tensor's name in the model (under a Lightning module's
attribute, PEFT's ``base_layer``) need not be its name in the file.

A restore puts such a tensor back from the model itself where the model holds it already (built from the same
pretrained weights, as a resumed fine-tune is: proven by the fingerprint), else from the pretrained files the
restore's own ``Config(pretrained=PATH)`` names (the bytes read proven by the fingerprint before the model is
touched), else refuses before anything is read, naming the tensors and both ways out.

The files are the caller's: opened read-only, never written, linked or moved.  A path that is not a regular file is
refused without waiting on it (a FIFO), a header is parsed strictly (bounded, every tensor's bytes inside its file)
before anything else is read, and a file that changed since its header was parsed is parsed again.
"""
from __future__ import annotations

import os
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import AbstractSet, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from ..errors import CheckpointCorruptError, CheckpointError, ConfigError, PretrainedNeededError
from ..format._entries import FINGERPRINT_CHUNK, PretrainedEntry
from ..format._json import loads_strict
from ..format._layout import CODES, ITEMSIZE
from ..format._manifest import Manifest
from ..format._places import Check, pretrained_seal
from ..select._exact import Fingerprint, fingerprint_parts, fingerprints

#: the largest header a pretrained file may have (safetensors' own bound)
MAX_HEADER = 100 << 20
_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class _Slot:
    """Where a pretrained tensor's bytes lie."""
    file: int  # its file's index in PretrainedFiles.paths
    offset: int  # absolute, in the file
    nbytes: int
    dtype: str  # safetensors dtype code, one layerckpt knows
    shape: Tuple[int, ...]


class PretrainedFiles:
    """The safetensors file, or every ``*.safetensors`` file directly in a folder (a sharded checkpoint), named by
    ``Config.pretrained``: their tensors by name, and the fingerprints of those asked about, taken once."""

    def __init__(self, path: "os.PathLike[str] | str"):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._warming: Optional[threading.Thread] = None  # the fingerprints taken ahead (``warm``)
        self._stop = threading.Event()
        self._load()

    def _load(self) -> None:
        self.paths = _listed(self.path)
        self.slots: Dict[str, _Slot] = {}
        self._ids: List[Tuple[int, int, int, int]] = []
        for i, p in enumerate(self.paths):
            ident, slots = _header(p, i)
            self._ids.append(ident)
            for name, slot in slots.items():
                if name in self.slots:
                    raise ConfigError(f"Config.pretrained: tensor {name!r} is in both {self.paths[self.slots[name].file]}"
                                      f" and {p}; name one file, or a folder whose files hold each tensor once")
                self.slots[name] = slot
        self._fps: Dict[str, Fingerprint] = {}
        self._by_fp: Dict[Fingerprint, str] = {}

    def _fresh(self) -> None:
        """Parse the files again where one of them changed since (another inode, size or mtime)."""
        try:
            now = [_identity(os.stat(p)) for p in self.paths]
        except OSError:
            now = None
        if now != self._ids:
            self._load()

    def match(self, wanted: Mapping[str, Fingerprint]) -> Dict[str, str]:
        """Of the tensors ``wanted`` (key -> fingerprint of its bytes now), those a pretrained tensor holds bit for
        bit: key -> that tensor's name.  The pretrained tensors of a dtype and shape asked about are fingerprinted
        the first time they are (read a chunk at a time), and remembered while the files stay as they were."""
        if not wanted:
            return {}
        with self._lock:
            self._fresh()
            kinds = {(fp[0], tuple(fp[1])) for fp in wanted.values()}
            for name, slot in self.slots.items():
                if name not in self._fps and (str(CODES[slot.dtype]), slot.shape) in kinds:
                    fp = self._fingerprint(name, slot)
                    self._fps[name] = fp
                    self._by_fp.setdefault(fp, name)
            return {k: self._by_fp[fp] for k, fp in wanted.items() if fp in self._by_fp}

    def warm(self, kinds: AbstractSet[Tuple[str, Tuple[int, ...]]]) -> None:
        """Fingerprint the pretrained tensors of ``kinds`` (dtype and shape, as a fingerprint names them: those of
        the model's frozen parameters) on a thread of their own, from now on: the first save that asks
        :meth:`match` about them finds them done instead of reading the files while training waits (it takes
        what is left itself; the two never read the same tensor)."""
        wanted = [n for n, slot in self.slots.items() if (str(CODES[slot.dtype]), slot.shape) in kinds]
        if wanted and self._warming is None:
            self._warming = threading.Thread(target=_warm, args=(weakref.ref(self), wanted, self._stop),
                                             name="layerckpt-pretrained", daemon=True)
            self._warming.start()

    def stop(self, wait: bool = True) -> None:
        """End the warm-up once the tensor in hand is done (``wait``: and wait for that)."""
        self._stop.set()
        if wait and self._warming is not None and self._warming is not threading.current_thread():
            self._warming.join()

    def _fingerprint(self, name: str, slot: _Slot) -> Fingerprint:
        buf = bytearray(min(FINGERPRINT_CHUNK, slot.nbytes))
        with _opened(self.paths[slot.file]) as fd:
            return fingerprint_parts(CODES[slot.dtype], slot.shape, _chunks(fd, slot, memoryview(buf), name))

    def slot(self, name: str, key: str, e: PretrainedEntry) -> _Slot:
        """Where the pretrained tensor ``name`` lies, of the dtype and shape the entry ``e`` of ``key`` records; a
        CheckpointError naming both where the files lack it or hold it otherwise."""
        slot = self.slots.get(name)
        if slot is None or slot.dtype != e.dtype or list(slot.shape) != e.shape:
            found = "has no such tensor" if slot is None else f"holds it as {slot.dtype} {list(slot.shape)}"
            raise CheckpointError(
                f"the checkpoint holds model tensor {key!r} by reference to pretrained tensor {name!r} "
                f"({e.dtype} {e.shape}), but Config.pretrained={self.path!r} {found}: name the pretrained files the "
                f"training started from")
        return slot

    def read(self, name: str, key: str, e: PretrainedEntry) -> torch.Tensor:
        """The pretrained tensor ``name`` in fresh host memory, proven to be the bytes the entry ``e`` of ``key``
        records; a CheckpointError naming both where it is not (another file than the training's)."""
        with self._lock:
            self._fresh()
        slot = self.slot(name, key, e)
        out = torch.empty(slot.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy()) if slot.nbytes else memoryview(bytearray(0))
        with _opened(self.paths[slot.file]) as fd:
            fp = fingerprint_parts(CODES[slot.dtype], slot.shape, _chunks(fd, slot, view, name, into=True))
        if list(fp[2]) != e.fp:
            raise CheckpointError(
                f"pretrained tensor {name!r} in {self.paths[slot.file]} is not the one the checkpoint recorded for "
                f"model tensor {key!r} (its bytes differ): Config.pretrained names other weights than the training "
                f"started from")
        return out.view(CODES[slot.dtype]).reshape(slot.shape)


def _warm(ref: "weakref.ref[PretrainedFiles]", names: List[str], stop: threading.Event) -> None:
    """:meth:`PretrainedFiles.warm`'s thread: each tensor fingerprinted under the files' lock, as :meth:`match`
    would (the files parsed again first where they changed).  It holds the files only while it works on one, and
    ends at the first error: the save that asks about the tensor meets the same error and says so."""
    for name in names:
        files = ref()
        if files is None or stop.is_set():
            return
        try:
            with files._lock:
                files._fresh()
                slot = files.slots.get(name)
                if slot is not None and name not in files._fps:
                    fp = files._fingerprint(name, slot)
                    files._fps[name] = fp
                    files._by_fp.setdefault(fp, name)
        except (CheckpointError, ConfigError, OSError):
            return
        finally:
            del files


def _identity(st: os.stat_result) -> Tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _listed(path: str) -> List[str]:
    """The pretrained files ``path`` names: itself, or the ``*.safetensors`` files directly in the folder it is."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"Config.pretrained={path!r} cannot be read ({e.strerror}); name the safetensors file (or "
                          f"the folder of them) the training started from") from None
    if not stat.S_ISDIR(st.st_mode):
        return [path]
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(_SUFFIX))
    except OSError as e:
        raise ConfigError(f"Config.pretrained={path!r}: the folder cannot be listed ({e.strerror})") from None
    if not names:
        raise ConfigError(f"Config.pretrained={path!r} is a folder without {_SUFFIX} files; name the safetensors "
                          f"file (or the folder of them) the training started from")
    return [os.path.join(path, n) for n in names]


class _opened:
    """A pretrained file opened read-only: a regular file (a FIFO or a device is refused, never waited on)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ConfigError(f"Config.pretrained: {self.path} cannot be opened ({e.strerror})") from None
        self.st = os.fstat(self.fd)
        if not stat.S_ISREG(self.st.st_mode):
            os.close(self.fd)
            raise ConfigError(f"Config.pretrained: {self.path} is not a regular file; name safetensors files")
        return self.fd

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _bad(path: str, why: str) -> ConfigError:
    return ConfigError(f"Config.pretrained: {path} is not a safetensors file this layerckpt reads ({why})")


def _header(path: str, index: int) -> Tuple[Tuple[int, int, int, int], Dict[str, _Slot]]:
    """The file's identity and its tensors of a dtype layerckpt knows (others are never matched), every one's bytes
    checked to lie inside the file, of its dtype and shape's size, before anything else is read."""
    with _opened(path) as fd:
        st = os.fstat(fd)
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes, fewer than a header's length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise _bad(path, f"a header of {n} bytes in a file of {size}")
        raw = _pread_all(fd, n, 8, path)
    try:
        doc = loads_strict(raw, path, "safetensors header")
    except CheckpointCorruptError as e:
        raise _bad(path, str(e)) from None
    if not isinstance(doc, dict):
        raise _bad(path, "its header is not a JSON object")
    data = size - 8 - n
    slots: Dict[str, _Slot] = {}
    for name, d in doc.items():
        if name == "__metadata__":
            continue
        dtype, shape, where = (d.get("dtype"), d.get("shape"), d.get("data_offsets")) if isinstance(d, dict) else (
            None, None, None)
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(_count(s) for s in shape)
                and isinstance(where, list) and len(where) == 2 and all(_count(x) for x in where)
                and where[0] <= where[1] <= data):
            raise _bad(path, f"tensor {name!r}: dtype, shape or data_offsets malformed or past the file's end")
        if dtype not in CODES:
            continue  # a dtype layerckpt does not store: nothing of the model's can match it
        nbytes = ITEMSIZE[dtype]
        for s in shape:
            nbytes *= s
        if where[1] - where[0] != nbytes:
            raise _bad(path, f"tensor {name!r}: {where[1] - where[0]} bytes for {dtype} {shape}")
        slots[name] = _Slot(index, 8 + n + where[0], nbytes, dtype, tuple(shape))
    return _identity(st), slots


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


def _pread_all(fd: int, n: int, at: int, path: str) -> bytes:
    parts = []
    while n:
        got = os.pread(fd, min(n, 1 << 24), at)
        if not got:
            raise CheckpointError(f"pretrained file {path} ended early: it changed while it was read")
        parts.append(got)
        n -= len(got)
        at += len(got)
    return b"".join(parts)


def _chunks(fd: int, slot: _Slot, view: memoryview, name: str, into: bool = False) -> Iterator[memoryview]:
    """The tensor's bytes a ``FINGERPRINT_CHUNK`` at a time (one empty part for a tensor of none): read into
    ``view``'s start each time, or, ``into``, each into its own place in ``view`` (the whole tensor's memory)."""
    if slot.nbytes == 0:
        yield view[:0]
        return
    for a in range(0, slot.nbytes, FINGERPRINT_CHUNK):
        n = min(FINGERPRINT_CHUNK, slot.nbytes - a)
        part = view[a:a + n] if into else view[:n]
        done = 0
        while done < n:
            got = os.preadv(fd, [part[done:]], slot.offset + a + done)
            if got <= 0:
                raise CheckpointError(f"pretrained tensor {name!r} ends past its file's end: the file changed while "
                                      f"it was read")
            done += got
        yield part


# ----------------------------------------------------------------------------------------------------- restore side


class HeldBack:
    """The model tensors a restore takes from the pretrained files rather than the store (``resolve``): read and
    proven (:meth:`read`) before the model is touched, then copied in (:meth:`load`)."""

    def __init__(self, files: Optional[PretrainedFiles], todo: List[Tuple[str, str, PretrainedEntry]],
                 targets: Mapping[str, torch.Tensor]):
        self.files, self.todo, self.targets = files, todo, targets
        self.read_bytes = 0
        self._fresh: Dict[str, torch.Tensor] = {}

    def read(self) -> None:
        for name, key, e in self.todo:
            self._fresh[name] = self.files.read(e.name, key, e)
            self.read_bytes += e.nbytes

    def load(self) -> None:
        with torch.no_grad():
            for name, t in self._fresh.items():
                self.targets[name].copy_(t)
        self._fresh.clear()


def check_seals(m: Manifest, keys: List[str], check: Check, where: str) -> None:
    """Every named entry of ``m.pretrained`` carries the seal of its own key, name, fingerprint, step, dtype and
    shape (the last three where it was written sealed to them)."""
    for k in keys:
        e = m.pretrained[k]
        if e.seal != pretrained_seal(check, k, e.name, e.fp, e.step, e.dtype, e.shape):
            raise CheckpointCorruptError(
                f"manifest {where}: the entry of tensor {k!r} in 'pretrained' does not carry its own seal: it was "
                f"copied from another tensor's or edited; restore another step", path=where, tensor=k)


def resolve(m: Manifest, pairs: List[Tuple[str, str]], targets: Mapping[str, torch.Tensor], pretrained: Optional[str],
            check: Check, where: str) -> Tuple[List[Tuple[str, str]], HeldBack]:
    """Of a restore's (model name, key) pairs, those held by reference to the pretrained files come out: each is
    proven held by the model already (its fingerprint), or is to be read from ``pretrained`` (the restore's
    ``Config.pretrained``); else a CheckpointError names them, before anything is read.  Returns the other pairs
    and what is to be read."""
    refs = m.pretrained or {}
    mine = [(n, k) for n, k in pairs if k in refs]
    if not mine:
        return pairs, HeldBack(None, [], targets)
    check_seals(m, [k for _, k in mine], check, where)
    now = fingerprints({k: targets[n] for n, k in mine})
    todo = [(n, k, refs[k]) for n, k in mine if list(now[k][2]) != refs[k].fp]
    files = None
    if todo:
        if pretrained is None:
            n, k, e = todo[0]
            raise PretrainedNeededError(
                f"checkpoint {where} holds {len(todo)} of the model's tensors by reference to the pretrained "
                f"weights the training started from (Config.pretrained), and the model's own differ from them (e.g. "
                f"{n!r}, {e.name!r} there): build the model from the same pretrained weights before restoring, or "
                f"pass config=Config(pretrained=PATH) naming those files")
        files = PretrainedFiles(pretrained)
        for _, k, e in todo:  # every one there, of its dtype and shape, before anything is read
            files.slot(e.name, k, e)
    return [(n, k) for n, k in pairs if k not in refs], HeldBack(files, todo, targets)


def read_all(m: Manifest, pretrained: Optional[str], check: Check, where: str) -> Dict[str, torch.Tensor]:
    """Every tensor ``m`` holds by reference to the pretrained files, read from ``pretrained`` and proven, by key
    (``read_checkpoint``, ``export``: no model holds them)."""
    refs = m.pretrained or {}
    if not refs:
        return {}
    if pretrained is None:
        k = next(iter(refs))
        raise PretrainedNeededError(
            f"checkpoint {where} holds {len(refs)} model tensors by reference to the pretrained weights the training "
            f"started from (e.g. {k!r}, {refs[k].name!r} there); pass config=Config(pretrained=PATH) naming those "
            f"files (the CLI: --pretrained PATH)")
    check_seals(m, list(refs), check, where)
    files = PretrainedFiles(pretrained)
    return {k: files.read(e.name, k, e) for k, e in refs.items()}
