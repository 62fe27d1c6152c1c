"""The commit record of one checkpoint: typed, built in one place, validated in one place.

A manifest is a *composite*: for every layer it names the step and file of the
layer's newest persisted version, and for every tensor where its bytes are.
On disk it is JSON (``manifests/step-N.json``).  Format version 2 adds ``enc`` to a tensor entry
(how its bytes are encoded, ``_encode``); version 3 adds ``boxes`` (tensors stored as boxes of the whole
tensor: DTensor shards of any layout), written only by a save that has such a tensor; version 1 and 2
manifests read unchanged.  A tensor entry's ``crc`` with bits 32 and 33 set is sealed to the entry's key and
to the step its file records (``_places``: every entry written since format version 5); bit 32 alone, sealed to
the key only (entries written as version 4, read as before); neither, a plain CRC, as written before that.  A
manifest holding a step-sealed entry is written as version 5, one holding a key-sealed one (and none sealed to
its step) as version 4: a reader of an older format refuses them as too new instead of reporting damage.

``Manifest.from_dict`` (``_validate``) is the one validator every field passes before anything is read or
allocated; any damage is a CheckpointCorruptError naming the file and the field.

The tensor keys' prefixes and the entry types are ``_entries``' (imported from here too).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ._json import load_strict, loads_strict  # noqa: F401 - loads_strict: the JSON reader of every store file
from ._places import SEALED, STEPPED
from ._entries import (  # noqa: F401 - the entry types and key helpers, imported from here by the rest
    BOX, Boxes, EXTRA, FORMAT_NAME, FORMAT_VERSION, FileEntry, LayerEntry, MODEL, MODEL_OTHER, OPTIM, OPTIM_GROUPS, PretrainedEntry, RNG, ROWS, RowBlocks, TensorEntry, _BOX, _BOXES_VERSION, _PIECE, _PRETRAINED_STEPPED_VERSION, _PRETRAINED_VERSION, _QSQREF_MODE, _QSQREF_VERSION, _SEALED_VERSION, _STEPPED_VERSION, box_key, is_rng, model_key, model_name, param_of, piece_base, piece_key, rng_prefix, row_pieces, shard_pieces, split_piece)
from ._validate import _check_cover, validated  # noqa: F401 - _check_cover: for its tests

@dataclass
class Manifest:
    step: int
    world_size: int
    files: Dict[str, FileEntry]
    tensors: Dict[str, TensorEntry]
    layers: Dict[str, LayerEntry]
    model: Dict[str, Any]  # {"aliases": {name: canonical}, "other": encoded non-tensor entries}
    seq: int = 0  # commit order within the directory
    chain: int = 0  # saves since the first of this Checkpointer's chain
    created: float = 0.0
    config: Dict[str, Any] = field(default_factory=dict)
    optimizer: Optional[Dict[str, Any]] = None
    rng: Optional[Dict[str, Any]] = None
    rng_ranks: Optional[Dict[str, Any]] = None
    extra: Any = None
    checksum: str = "crc32c"
    cost: Optional[float] = None  # the composite's estimated fidelity cost: its stale layers' summed cost
    progress: Optional[float] = None  # the model's progress over the last interval, in the same unit
    loss: Optional[float] = None  # the training loss passed to save()
    name: Optional[str] = None  # a name given at save(), e.g. LayerCheckpoint's templated filename
    blocks: Optional[Dict[str, RowBlocks]] = None  # tensors stored as row blocks (see ``_blocks``), by key
    boxes: Optional[Dict[str, Boxes]] = None  # tensors stored as boxes (DTensor shards of any layout), by key
    #: the data files this save wrote -> {tensor kind: how its tensors were written (raw, compress, delta) and
    #: why, with the measured ratio, encoder rate, sink bandwidth and CPU charge} (``Config(encoding='auto')``;
    #: informational: a restore never reads it)
    coding: Optional[Dict[str, Dict[str, Dict[str, Any]]]] = None
    #: model tensors held by reference to the pretrained files the training started from, by key, instead of
    #: in a data file (``Config(pretrained=...)``, ``read/_pretrained``); a layer lists them among its tensors
    pretrained: Optional[Dict[str, PretrainedEntry]] = None
    #: a signed store's identity (``_sign``: a signed manifest belongs to the store it names); None unsigned
    store: Optional[str] = None
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def aliases(self) -> Dict[str, str]:
        return self.model.get("aliases", {})

    @property
    def model_other(self) -> Dict[str, Any]:
        return self.model.get("other") or {}

    @property
    def lag(self) -> Optional[float]:
        """The estimated fidelity cost in checkpoint intervals of progress (None where not recorded)."""
        if self.cost is None or not self.progress:
            return None
        return self.cost / self.progress

    @property
    def loss_increase(self) -> Optional[float]:
        """The estimated fidelity cost as a fraction of the training loss (None where no loss was given)."""
        if self.cost is None or not self.loss:
            return None
        return self.cost / abs(self.loss)

    def logical_keys(self) -> List[str]:
        """Every tensor key, a tensor stored in row blocks or boxes named once by its own key."""
        stored = {**(self.blocks or {}), **(self.boxes or {})}
        parts = {pk for k, rec in stored.items() for pk, _, _ in shard_pieces(rec, k)}
        return [k for k in self.tensors if k not in parts] + list(stored)

    def pieces(self, key: str) -> Optional[List[Tuple[str, List[int], List[int]]]]:
        """(piece key, offsets, sizes) of every piece of a tensor stored in row blocks or boxes, else None."""
        rec = (self.blocks or {}).get(key) or (self.boxes or {}).get(key)
        return None if rec is None else shard_pieces(rec, key)

    def describe(self, key: str) -> Optional[Tuple[str, List[int]]]:
        """(dtype code, shape) of a tensor key, whole or in pieces; None if there is no such tensor."""
        rec = (self.blocks or {}).get(key) or (self.boxes or {}).get(key)
        if rec is not None:
            return rec.dtype, list(rec.shape)
        e = self.tensors.get(key)
        if e is None and self.pretrained:
            e = self.pretrained.get(key)
        return None if e is None else (e.dtype, list(e.shape))

    def steps_behind(self) -> Dict[str, int]:
        """Each layer's staleness in steps: how far its persisted version trails this composite."""
        return {name: self.step - e.step for name, e in self.layers.items()}

    def quantization(self) -> Dict[str, float]:
        """Of each layer whose weights were stored with bounded loss (``Config(encoding='lossy')``): the RMS error
        of its weights in steps of training, the error over the RMS by which one step moved them (the largest
        of its tensors'): a layer restored 0.6 steps' move off, as a stale layer is some steps behind."""
        out: Dict[str, float] = {}
        for name, layer in self.layers.items():
            for k in layer.tensors:
                e = self.tensors.get(k)
                rec = e.enc.get("lossy") if e is not None and e.enc else None
                if rec and rec.get("code") == "qdelta" and rec.get("move"):
                    out[name] = max(out.get(name, 0.0), rec["rms_err"] / rec["move"])
        return out

    def rng_for(self, rank: int) -> Optional[Dict[str, Any]]:
        """A rank's own RNG states when the checkpoint has them, else rank 0's."""
        if rank > 0 and str(rank) in (self.rng_ranks or {}):
            return self.rng_ranks[str(rank)]
        return self.rng

    def _fields(self) -> Dict[str, Any]:
        """The fields as written, shallow (the entries stay dataclasses, nothing is copied)."""
        d = fields_of(self)
        if d["rng_ranks"] is None:
            del d["rng_ranks"]
        if d["coding"] is None:
            del d["coding"]
        if d["pretrained"] is None:
            del d["pretrained"]
        if d["store"] is None:
            del d["store"]
        d["version"] = min(d["version"], _QSQREF_VERSION - 1)  # 6 only where its blocks are there (below)
        if d["boxes"] is None:  # readable by the layerckpt that wrote version 2
            del d["boxes"]
            d["version"] = min(d["version"], _BOXES_VERSION - 1)
        else:  # a reader that does not know boxes refuses it instead of reading its pieces as tensors
            d["version"] = max(d["version"], _BOXES_VERSION)
        # the newest seal held sets the version: an older reader says "upgrade", not "damaged"
        seals = {e.crc & (SEALED | STEPPED) for e in d["tensors"].values()}
        if any(s & STEPPED for s in seals):
            d["version"] = max(d["version"], _STEPPED_VERSION)
        elif any(seals):
            d["version"] = max(d["version"], _SEALED_VERSION)
        if any(b[3] == _QSQREF_MODE for e in d["tensors"].values() if e.enc and "lossy" in e.enc
               for b in e.enc["blocks"]):
            d["version"] = max(d["version"], _QSQREF_VERSION)
        if "pretrained" in d:  # a reader that does not know them would find layers without their tensors
            d["version"] = max(d["version"], _PRETRAINED_VERSION)
            if any(e.step is not None for e in d["pretrained"].values()):  # a reader of 7 would find their seals bad
                d["version"] = max(d["version"], _PRETRAINED_STEPPED_VERSION)
        return d

    def to_dict(self) -> Dict[str, Any]:
        """A plain copy (dicts, lists and scalars): the JSON document, to change without touching this one."""
        return plain(self._fields())

    def to_json(self) -> bytes:
        # the entries are turned into dicts by the encoder as it meets them: no copy of the whole manifest; a
        # tensor's entry, which the composites after it carry unchanged, is serialised once (``_entry_json``)
        d = self._fields()
        d = head_first(d)
        tensors = d.pop("tensors")
        head = json.dumps(d, separators=(",", ":"), allow_nan=True, default=fields_of)
        body = ",".join([_entry_json(k, e) for k, e in tensors.items()])
        return (head[:-1] + ',"tensors":{' + body + "}}").encode()

    @classmethod
    def from_dict(cls, m: Any, path: str) -> "Manifest":
        """Validate a parsed manifest (``_validate``, the one validator of every field); any damage is a
        CheckpointCorruptError naming the file and the field."""
        return cls(**validated(m, path, _OTHER_FIELDS))


_NAMES: Dict[type, Tuple[str, ...]] = {}
_quote = json.encoder.encode_basestring_ascii  # a JSON string, as json.dumps writes it


def _entry_json(key: str, e: "TensorEntry") -> str:
    """``"key":{...}``, the JSON member of one tensor entry.  Composites carry the same entry objects from one
    manifest to the next (entries are never changed once made), so each is serialised once: the member is kept
    on the entry itself, and goes with it (a cache beside the entries would keep every entry of every manifest
    alive, and the collector walking them)."""
    hit = e.__dict__.get("_json")
    if hit is not None and hit[0] == key:
        return hit[1]
    # the fields in TensorEntry's order, as json.dumps would write them (one call per entry costs more)
    enc = "null" if e.enc is None else json.dumps(e.enc, separators=(",", ":"), allow_nan=True)
    member = (f'{_quote(key)}:{{"file":{_quote(e.file)},"dtype":{_quote(e.dtype)},"shape":'
              f'[{",".join(map(str, e.shape))}],"offset":{e.offset},"nbytes":{e.nbytes},"crc":{e.crc},"enc":{enc}}}')
    e.__dict__["_json"] = (key, member)
    return member


_OTHER_FIELDS = [f.name for f in dataclasses.fields(Manifest)
                 if f.name not in ("step", "world_size", "files", "tensors", "layers", "model")]


def fields_of(obj: Any) -> Dict[str, Any]:
    """A dataclass instance's fields by name, shallow (also the ``default`` of ``json.dumps``)."""
    if type(obj) is FileEntry and obj.digest is None:  # an unsigned store's file entry, as it was always written
        return {"step": obj.step, "rank": obj.rank, "size": obj.size}
    names = _NAMES.get(type(obj))
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
        names = _NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {n: getattr(obj, n) for n in names}


def plain(obj: Any) -> Any:
    """A deep copy of ``obj`` with every dataclass instance turned into a dict of its fields, as
    ``dataclasses.asdict`` makes, without its per-leaf ``deepcopy``: the leaves here are immutable scalars."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    if type(obj) in _NAMES or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return {k: plain(v) for k, v in fields_of(obj).items()}
    return obj


_parsed: "contextvars.ContextVar[Optional[Dict[Tuple[str, int, int, int], Manifest]]]" = contextvars.ContextVar(
    "layerckpt_parsed_manifests", default=None)


def head_first(d: Dict[str, Any]) -> Dict[str, Any]:
    """A manifest's fields with its step and commit number first, as every writer of a manifest lays them out:
    they order the composites, and a reader takes them from a manifest's first bytes (``_store.peek``)."""
    return {"step": d["step"], "seq": d["seq"], **{k: v for k, v in d.items() if k not in ("step", "seq")}}


@contextlib.contextmanager
def parse_once(memo: Optional[Dict[Tuple[str, int, int, int], Manifest]] = None):
    """Inside it (a decorator too) each manifest file is parsed once: a restore reads the same manifests
    to pick the tier, to find the newest and to load it.  A committed manifest is never rewritten in
    place (a new one is renamed over it: a new inode), and what is returned must not be changed.
    ``memo``: a dict kept by the caller, to parse each file once over several calls (see :func:`still_valid`)."""
    if _parsed.get() is not None:
        yield
        return
    token = _parsed.set({} if memo is None else memo)
    try:
        yield
    finally:
        _parsed.reset(token)


def still_valid(memo: Dict[Tuple[str, int, int, int], Manifest]) -> Dict[Tuple[str, int, int, int], Manifest]:
    """The entries of a :func:`parse_once` memo whose file is still there, as it was parsed."""
    out = {}
    for key, m in memo.items():
        try:
            st = os.stat(key[0])
        except OSError:
            continue
        if key == (key[0], st.st_ino, st.st_size, st.st_mtime_ns):
            out[key] = m
    return out


def load_manifest(path: str) -> Manifest:
    """Read, parse and validate the manifest at ``path`` (see ``_json``: never a hang, never unbounded, never a
    bare Python exception on a damaged or hostile file)."""
    memo = _parsed.get()
    key = None
    if memo is not None:
        try:
            st = os.stat(path)  # no open: a FIFO is refused by read_regular, not waited on here
            key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key in memo:
            return memo[key]
    out = Manifest.from_dict(load_strict(path, "manifest", follow=False), path)
    if memo is not None and key is not None:
        memo[key] = out
    return out

