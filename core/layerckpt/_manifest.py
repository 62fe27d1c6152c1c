"""The commit record of one checkpoint: typed, built in one place, validated in one place.

A manifest is a *composite*: for every layer it names the step and file of the
layer's newest persisted version, and for every tensor where its bytes are.
On disk it is JSON (``manifests/step-N.json``).  Format version 2 adds ``enc`` to a tensor entry
(how its bytes are encoded, ``_encode``); version 3 adds ``boxes`` (tensors stored as boxes of the whole
tensor: DTensor shards of any layout), written only by a save that has such a tensor; version 1 and 2
manifests read unchanged.  A tensor entry's ``crc`` with bit 32 set is sealed to the entry's key, dtype and shape
(``_places``: every entry written since seals exist; an entry without it is a plain CRC, as written before).

``Manifest.from_dict`` is the one validator every field passes before anything is read or allocated: types and
ranges, tensors' regions of their files (none overlapping another's, an encoded tensor's blocks in file order:
``_places``), row blocks and boxes covering their tensor once, references to tensors that have entries, finite
fidelity costs; any damage is a CheckpointCorruptError naming the file and the field.

Tensor keys in a checkpoint have fixed prefixes, named here and nowhere else:
``model/<state_dict name>``, ``optim/<parameter name>/<state key>``,
``optim_groups/<i>/...``, ``rng/...`` (``rng.rankN/...`` for other ranks),
``extra/...`` and ``model_other/...``; ``<key>#rows=<a>:<b>`` is a row block of a tensor
(see ``_blocks``), ``<key>#box=<o0>,<o1>,...:<s0>,<s1>,...`` the box at offsets ``o`` with sizes ``s``.
"""
from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from ._layout import CODES, ITEMSIZE
from ._json import load_strict, loads_strict  # noqa: F401 - loads_strict: the JSON reader of every store file
from ._places import CRC_MAX, check_block_order, check_regions, max_blocks
from .errors import CheckpointCorruptError

FORMAT_NAME = "layerckpt"
FORMAT_VERSION = 3  # 2: tensors may be encoded (TensorEntry.enc); 3: tensors stored as boxes (Manifest.boxes)
_BOXES_VERSION = 3  # the version a manifest with boxes is written as; without, 2

MODEL = "model/"
OPTIM = "optim/"
OPTIM_GROUPS = "optim_groups"
RNG = "rng"
EXTRA = "extra"
MODEL_OTHER = "model_other"
ROWS = "#rows="  # <key>#rows=<a>:<b>: rows [a, b) of a tensor stored in row blocks
_PIECE = re.compile(r"^(.*)#rows=(\d+):(\d+)$")
BOX = "#box="  # <key>#box=<offsets>:<sizes>: the box of a tensor stored in boxes
_BOX = re.compile(r"^(.*)#box=(\d*(?:,\d+)*):(\d*(?:,\d+)*)$")


def model_key(name: str) -> str:
    return MODEL + name


def model_name(key: str) -> Optional[str]:
    """The state_dict name of a model tensor key, else None."""
    return key[len(MODEL):] if key.startswith(MODEL) else None


def param_of(key: str) -> Optional[str]:
    """The parameter a model or optimizer-state key belongs to, else None."""
    if key.startswith(MODEL):
        return key[len(MODEL):]
    if key.startswith(OPTIM):
        parts = key.split("/", 2)
        if len(parts) == 3:
            return parts[1]
    return None


def piece_key(key: str, a: int, b: int) -> str:
    """The key of rows [a, b) of a tensor stored in row blocks."""
    return f"{key}{ROWS}{a}:{b}"


def split_piece(key: str) -> Tuple[str, Optional[Tuple[int, int]]]:
    """(the whole tensor's key, (first row, end row)) of a row-block key; (key, None) for any other key."""
    m = _PIECE.match(key)
    if m is None:
        return key, None
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def box_key(key: str, offsets: List[int], sizes: List[int]) -> str:
    """The key of the box of a tensor at ``offsets`` with ``sizes`` (one of each per dim)."""
    return f"{key}{BOX}{','.join(map(str, offsets))}:{','.join(map(str, sizes))}"


def piece_base(key: str) -> Tuple[str, str]:
    """(the whole tensor's key, the piece suffix) of a row-block or box key; (key, "") for any other key."""
    for pattern in (_PIECE, _BOX):
        m = pattern.match(key)
        if m is not None:
            return m.group(1), key[len(m.group(1)):]
    return key, ""


def shard_pieces(rec: "Union[RowBlocks, Boxes]", key: str) -> List[Tuple[str, List[int], List[int]]]:
    """(piece key, offsets, sizes) of every stored piece of a tensor held as row blocks or as boxes."""
    if isinstance(rec, Boxes):
        return [(box_key(key, o, s), list(o), list(s)) for o, s in rec.boxes]
    rest = list(rec.shape[1:])
    return [(piece_key(key, a, b), [a] + [0] * len(rest), [b - a] + rest) for a, b in rec.rows]


def row_pieces(blocks: Dict[str, "RowBlocks"], key: str) -> List[Tuple[str, int, int]]:
    """(block key, first row, end row) of every block of a tensor stored in row blocks."""
    return [(piece_key(key, a, b), a, b) for a, b in blocks[key].rows]


def is_rng(key: str) -> bool:
    return key.startswith(RNG)


def rng_prefix(rank: int) -> str:
    """Key prefix of a rank's RNG states: each rank keeps its own."""
    return RNG if rank == 0 else f"{RNG}.rank{rank}"


@dataclass
class TensorEntry:
    file: str
    dtype: str  # safetensors dtype code
    shape: List[int]
    offset: int  # absolute offset in the file
    nbytes: int
    #: CRC of the raw bytes (after decoding, for an encoded tensor); sealed to this entry's key, dtype and shape
    #: where bit 32 is set (``_places``: every entry written since; a plain CRC in entries written before)
    crc: int
    #: how it is encoded (``_encode``): {"codec", "blocks": [[file offset, length, raw length, mode], ...],
    #: "ref": None or the reference's {"file", "step", "rank", "size", "crc", "blocks"}}; None: raw bytes at
    #: ``offset`` (format version 1's only kind)
    enc: Optional[Dict[str, Any]] = None


@dataclass
class FileEntry:
    step: int
    rank: int
    size: int


@dataclass
class LayerEntry:
    """Where a layer's newest version lives, and why this save wrote or skipped it."""
    step: int  # the step it was persisted at
    file: Optional[str]  # None until the ranks' results are merged
    tensors: List[str]
    nbytes: int
    rank: int = 0
    age: int = 0  # checkpoints since it was persisted
    reason: str = ""
    drift: Optional[float] = None
    frozen: bool = False
    cost: Optional[float] = None  # first-order loss the composite gives up by holding this version
    #: this save proved the layer bit-identical to that version (every byte fingerprinted, see _exact): it is
    #: current however old; False where not proven, or written before the proof existed
    unchanged: bool = False


@dataclass
class RowBlocks:
    """A tensor stored as row blocks: each block ``[a, b)`` is the tensor entry ``<key>#rows=<a>:<b>``."""
    dtype: str  # safetensors dtype code
    shape: List[int]  # the whole tensor's
    rows: List[List[int]]  # [first row, end row] of every block, in order, covering every row


@dataclass
class Boxes:
    """A tensor stored as boxes (a DTensor's shards, any layout): each box, ``[offsets, sizes]`` (one of each
    per dim), is the tensor entry ``<key>#box=<offsets>:<sizes>``; the boxes cover the tensor without overlap."""
    dtype: str  # safetensors dtype code
    shape: List[int]  # the whole tensor's
    boxes: List[List[List[int]]]


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
        return None if e is None else (e.dtype, list(e.shape))

    def steps_behind(self) -> Dict[str, int]:
        """Each layer's staleness in steps: how far its persisted version trails this composite."""
        return {name: self.step - e.step for name, e in self.layers.items()}

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
        if d["boxes"] is None:  # readable by the layerckpt that wrote version 2
            del d["boxes"]
            d["version"] = min(d["version"], _BOXES_VERSION - 1)
        else:  # a reader that does not know boxes refuses it instead of reading its pieces as tensors
            d["version"] = max(d["version"], _BOXES_VERSION)
        return d

    def to_dict(self) -> Dict[str, Any]:
        """A plain copy (dicts, lists and scalars): the JSON document, to change without touching this one."""
        return plain(self._fields())

    def to_json(self) -> bytes:
        # the entries are turned into dicts by the encoder as it meets them: no copy of the whole manifest; a
        # tensor's entry, which the composites after it carry unchanged, is serialised once (``_entry_json``)
        d = self._fields()
        tensors = d.pop("tensors")
        head = json.dumps(d, separators=(",", ":"), allow_nan=True, default=fields_of)
        body = ",".join([_entry_json(k, e) for k, e in tensors.items()])
        return (head[:-1] + ',"tensors":{' + body + "}}").encode()

    @classmethod
    def from_dict(cls, m: Any, path: str) -> "Manifest":
        """Validate a parsed manifest; any damage is a CheckpointCorruptError naming the file and the field."""
        _check_header(m, path)
        files = {name: _file_entry(name, e, m["step"], path) for name, e in m["files"].items()}
        tensors = {key: _tensor_entry(key, e, files, path) for key, e in m["tensors"].items()}
        check_regions(tensors, path)
        layers = {name: _layer_entry(name, e, path) for name, e in m["layers"].items()}
        rest = {k: m[k] for k in _OTHER_FIELDS if k in m}
        if rest.get("blocks") is not None:
            rest["blocks"] = _read_blocks(rest["blocks"], tensors, path)
        if rest.get("boxes") is not None:
            rest["boxes"] = _read_boxes(rest["boxes"], tensors, set(rest.get("blocks") or {}), path)
        known = set(tensors) | set(rest.get("blocks") or {}) | set(rest.get("boxes") or {})
        _check_other(rest, path, known)
        _check_model(m["model"], path, known)
        return cls(step=m["step"], world_size=m["world_size"], files=files, tensors=tensors, layers=layers,
                   model=m["model"], **rest)


_NAMES: Dict[type, Tuple[str, ...]] = {}
#: id of a tensor entry -> (the entry, its key, its JSON member): composites carry the same entry objects from
#: one manifest to the next (entries are never changed once made), so each is serialised once
_ENTRY_JSON: Dict[int, Tuple["TensorEntry", str, str]] = {}
_ENTRY_JSON_MAX = 1 << 16
_quote = json.encoder.encode_basestring_ascii  # a JSON string, as json.dumps writes it


def _entry_json(key: str, e: "TensorEntry") -> str:
    """``"key":{...}``, the JSON member of one tensor entry (cached while the entry object lives)."""
    hit = _ENTRY_JSON.get(id(e))
    if hit is not None and hit[0] is e and hit[1] == key:
        return hit[2]
    # the fields in TensorEntry's order, as json.dumps would write them (one call per entry costs more)
    enc = "null" if e.enc is None else json.dumps(e.enc, separators=(",", ":"), allow_nan=True)
    member = (f'{_quote(key)}:{{"file":{_quote(e.file)},"dtype":{_quote(e.dtype)},"shape":'
              f'[{",".join(map(str, e.shape))}],"offset":{e.offset},"nbytes":{e.nbytes},"crc":{e.crc},"enc":{enc}}}')
    if len(_ENTRY_JSON) >= _ENTRY_JSON_MAX:
        _ENTRY_JSON.clear()
    _ENTRY_JSON[id(e)] = (e, key, member)
    return member


def fields_of(obj: Any) -> Dict[str, Any]:
    """A dataclass instance's fields by name, shallow (also the ``default`` of ``json.dumps``)."""
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


_REQUIRED = {"format": str, "version": int, "step": int, "world_size": int, "files": dict,
             "tensors": dict, "layers": dict, "model": dict}
_TENSOR_FIELDS = [f.name for f in dataclasses.fields(TensorEntry)]
if _TENSOR_FIELDS != ["file", "dtype", "shape", "offset", "nbytes", "crc", "enc"]:  # what _entry_json writes
    raise RuntimeError(f"TensorEntry's fields changed ({_TENSOR_FIELDS}): update _manifest._entry_json")
_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerEntry)]
_OTHER_FIELDS = [f.name for f in dataclasses.fields(Manifest)
                 if f.name not in ("step", "world_size", "files", "tensors", "layers", "model")]
#: bounds of a manifest's counters: far above any real run, far below what breaks arithmetic on them
MAX_STEP = (1 << 62) - 1
MAX_WORLD = 1 << 24
MAX_DIMS = 64
#: bytes a tensor's shape may span, its empty dims counted as 1 (as torch sizes a tensor's storage): far above
#: any real tensor, far below what overflows a torch size calculation (``[2**40, 2**40, 0]`` holds nothing but
#: does not fit one)
MAX_TENSOR_BYTES = 1 << 50
_NAME_RE = re.compile(r"^step-(\d{8,})\.json$")
_NUMBER = (int, float)


def _corrupt(path: str, msg: str, tensor: Optional[str] = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"manifest {path}: {msg}", path=path, tensor=tensor)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_header(m: Any, path: str) -> None:
    """The top-level fields: present, of their types, in range; the step the file is named after."""
    if not isinstance(m, dict):
        raise CheckpointCorruptError(f"manifest {path} is not a JSON object", path=path)
    for k, kind in _REQUIRED.items():
        if not isinstance(m.get(k), kind) or isinstance(m.get(k), bool):
            raise CheckpointCorruptError(f"manifest {path} lacks a valid {k!r} field", path=path)
    if m["format"] != FORMAT_NAME:
        raise CheckpointCorruptError(f"{path} is not a layerckpt manifest (format={m['format']!r})", path=path)
    if m["version"] > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"manifest {path} has format version {m['version']}, newer than this layerckpt reads "
            f"({FORMAT_VERSION}); upgrade layerckpt", path=path)
    if m["version"] < 1:
        raise _corrupt(path, f"'version' is {m['version']}; format versions start at 1")
    if not _is_int(m["step"]):
        raise _corrupt(path, f"'step' is {_short(m['step'])}, outside 0..{MAX_STEP}")
    if not _is_int(m["world_size"], 1, MAX_WORLD):
        raise _corrupt(path, f"'world_size' is {_short(m['world_size'])}, outside 1..{MAX_WORLD}")
    named = _NAME_RE.match(os.path.basename(str(path)))
    if named is not None and int(named.group(1)) != m["step"]:
        raise _corrupt(path, f"'step' is {m['step']} but the file is named for step {int(named.group(1))}: "
                             f"a manifest was renamed or edited")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_shape(shape: Any, dtype: Any) -> bool:
    """A list of at most MAX_DIMS sizes of a known dtype, spanning at most MAX_TENSOR_BYTES."""
    if not (isinstance(dtype, str) and dtype in CODES and isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(_is_int(s) for s in shape)):
        return False
    return math.prod(max(s, 1) for s in shape) * ITEMSIZE[dtype] <= MAX_TENSOR_BYTES


def _file_entry(name: str, e: Any, step: int, path: str) -> FileEntry:
    if not (isinstance(e, dict) and all(_is_int(e.get(k, 0)) for k in ("step", "rank", "size"))
            and e.get("rank", 0) < MAX_WORLD):
        raise _corrupt(path, f"entry for file {name!r} is malformed (step, rank and size must be non-negative "
                             f"integers)")
    return FileEntry(step=e.get("step", step), rank=e.get("rank", 0), size=e.get("size", 0))


def _tensor_entry(key: str, e: Any, files: Dict[str, FileEntry], path: str) -> TensorEntry:
    if not (isinstance(e, dict) and isinstance(e.get("file"), str) and _is_shape(e.get("shape"), e.get("dtype"))
            and _is_int(e.get("offset")) and _is_int(e.get("nbytes")) and _is_int(e.get("crc"), 0, CRC_MAX)):
        raise _corrupt(path, f"entry for tensor {key!r} is malformed (file and dtype: strings, shape: a list of "
                             f"sizes within {MAX_TENSOR_BYTES} bytes, offset, nbytes and crc: integers)", tensor=key)
    if e["nbytes"] != math.prod(e["shape"]) * ITEMSIZE[e["dtype"]]:
        raise _corrupt(path, f"tensor {key!r} has shape {_short(e['shape'])} and dtype {e['dtype']} but "
                             f"{e['nbytes']} bytes", tensor=key)
    f = files.get(e["file"])
    if f is None:
        raise _corrupt(path, f"tensor {key!r} points to file {e['file']!r} that the manifest does not list",
                       tensor=key)
    enc = e.get("enc")
    if enc is not None:
        _check_enc(key, enc, e["nbytes"], f.size, e["file"], files, path)
    elif e["offset"] + e["nbytes"] > f.size:
        raise _corrupt(path, f"tensor {key!r} claims bytes {e['offset']}..{e['offset'] + e['nbytes']} of file "
                             f"{e['file']!r}, which the manifest says holds {f.size}", tensor=key)
    return TensorEntry(**{k: e.get(k) for k in _TENSOR_FIELDS})


def _check_enc(key: str, enc: Any, nbytes: int, size: int, fname: str, files: Dict[str, FileEntry],
               path: str) -> None:
    """An encoded tensor's record: a codec this reader knows, blocks inside the file covering the tensor's
    bytes, and a reference (itself self-contained) inside a file the manifest lists."""
    from ._encode import CODEC, MODES, reads_ref

    if not (isinstance(enc, dict) and enc.get("codec") == CODEC and isinstance(enc.get("blocks"), list)):
        raise _corrupt(path, f"tensor {key!r} has an encoding this layerckpt does not read "
                             f"({_short(enc)}); upgrade layerckpt", tensor=key)
    ref = enc.get("ref")
    _check_blocks(key, enc["blocks"], nbytes, size, fname, MODES, path)
    if ref is None:
        if reads_ref(enc["blocks"]):
            raise _corrupt(path, f"tensor {key!r} has delta blocks but no reference", tensor=key)
        return
    if not (isinstance(ref, dict) and isinstance(ref.get("file"), str) and ref["file"] in files
            and _is_int(ref.get("crc"), 0, CRC_MAX) and isinstance(ref.get("blocks"), list)
            and all(_is_int(ref.get(k)) for k in ("step", "rank", "size"))):
        raise _corrupt(path, f"tensor {key!r} has a malformed reference (file: one the manifest lists; step, "
                             f"rank, size and crc: integers; blocks: a list)", tensor=key)
    _check_blocks(key, ref["blocks"], nbytes, files[ref["file"]].size, ref["file"], (0, 1), path, " (its reference)")


def _check_blocks(key: str, blocks: list, nbytes: int, size: int, fname: str, modes, path: str,
                  what: str = "") -> None:
    """Each block [file offset, length, raw length, mode] well formed (raw length 1..BLOCK, or the length of a
    raw block; stored length 0 for an unchanged block, at least 1 for any other) and inside the file; together
    in file order, covering the tensor's bytes once (``_places``)."""
    from ._encode import BLOCK, RAW, SAME

    if len(blocks) > max_blocks(nbytes):  # before any is looked at: a long list costs no more than a short one
        raise _corrupt(path, f"tensor {key!r}{what} has {len(blocks)} blocks in {fname!r}, more than the "
                             f"{max_blocks(nbytes)} its {nbytes} bytes are cut into", tensor=key)
    total = 0
    for b in blocks:
        if not (isinstance(b, list) and len(b) == 4 and all(_is_int(x) for x in b) and b[3] in modes and b[2] >= 1
                and (b[1] == b[2] if b[3] == RAW else b[2] <= BLOCK and (b[1] == 0) == (b[3] == SAME))):
            raise _corrupt(path, f"tensor {key!r}{what} has a malformed block {_short(b)}", tensor=key)
        if b[0] + b[1] > size:
            raise _corrupt(path, f"tensor {key!r} claims bytes {b[0]}..{b[0] + b[1]} of file {fname!r}, which "
                                 f"the manifest says holds {size}", tensor=key)
        total += b[2]
    if total != nbytes:
        raise _corrupt(path, f"tensor {key!r}'s blocks in {fname!r} cover {total} bytes, not its {nbytes}",
                       tensor=key)
    check_block_order(key, blocks, fname, path, what)


_LAYER_TYPES = {"step": int, "file": (str, type(None)), "tensors": list, "nbytes": int, "rank": int, "age": int,
                "reason": str, "drift": (int, float, type(None)), "frozen": bool,
                "cost": (int, float, type(None)), "unchanged": bool}


def _layer_entry(name: str, e: Any, path: str) -> LayerEntry:
    bad = "not an object" if not isinstance(e, dict) else next(
        (k for k, kind in _LAYER_TYPES.items() if k in e and not _typed(e[k], kind)), None)
    if bad is None and not isinstance(e.get("step"), int):
        bad = "step"
    if bad is None and not (_is_int(e["step"]) and all(isinstance(t, str) for t in e.get("tensors", []))
                            and all(_is_int(e.get(k, 0)) for k in ("nbytes", "rank", "age"))):
        bad = "step, tensors, nbytes, rank or age"
    if bad is None and not _is_cost(e.get("cost")):
        bad = f"cost {_short(e['cost'])}: a finite number, at least 0"
    if bad is not None:
        raise _corrupt(path, f"entry for layer {name!r} is malformed ({bad})")
    known = {k: e[k] for k in _LAYER_FIELDS if k in e}
    known.setdefault("file", None)
    known.setdefault("tensors", [])
    known.setdefault("nbytes", 0)
    return LayerEntry(**known)


def _typed(v: Any, kind) -> bool:
    """isinstance, where a bool is no int (JSON's true is not a step); an int passes for a float."""
    if isinstance(v, bool) and kind is not bool:
        return False
    return isinstance(v, kind)


_OTHER_TYPES = {"seq": int, "chain": int, "created": _NUMBER, "config": dict, "optimizer": (dict, type(None)),
                "rng": (dict, type(None)), "rng_ranks": (dict, type(None)), "checksum": str,
                "cost": _NUMBER + (type(None),), "progress": _NUMBER + (type(None),),
                "loss": _NUMBER + (type(None),), "name": (str, type(None)), "format": str, "version": int,
                "coding": (dict, type(None))}


def _is_cost(v: Any) -> bool:
    """A recorded fidelity cost: absent, or a finite number of at least 0 (an int passes, a bool does not)."""
    return v is None or (_finite(v) and v >= 0)


def _finite(v: Any) -> bool:
    """A finite number (an int of any size passes; a bool does not)."""
    return _typed(v, _NUMBER) and (isinstance(v, int) or math.isfinite(v))


def _check_other(rest: Dict[str, Any], path: str, known: set) -> None:
    """The optional fields: of their types; the optimizer's groups and state shaped as a restore reads them;
    every tensor reference (in optimizer state, RNG, extra) a string."""
    for k, kind in _OTHER_TYPES.items():
        if k in rest and not _typed(rest[k], kind):
            raise _corrupt(path, f"field {k!r} is {_short(rest[k])}, not of the type a manifest records")
    for k in ("seq", "chain"):
        if k in rest and not _is_int(rest[k]):
            raise _corrupt(path, f"field {k!r} is {_short(rest[k])}, outside 0..{MAX_STEP}")
    # what a restore's fidelity check compares: a NaN would pass any bound unnoticed (the writers record finite
    # values: a save refuses a loss that is not, and a cost sums finite per-layer costs)
    if not _is_cost(rest.get("cost")):
        raise _corrupt(path, f"field 'cost' is {_short(rest['cost'])}, not a finite number of at least 0")
    if rest.get("loss") is not None and not _finite(rest["loss"]):
        raise _corrupt(path, f"field 'loss' is {_short(rest['loss'])}, not a finite number")
    opt = rest.get("optimizer")
    if opt is not None and not (
            isinstance(opt.get("param_groups", []), list) and isinstance(opt.get("state", {}), dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                    and all(isinstance(p, str) for p in g["params"]) for g in opt.get("param_groups", []))
            and all(isinstance(st, dict) for st in opt.get("state", {}).values())
            and isinstance(opt.get("class", ""), (str, type(None)))):
        raise _corrupt(path, "field 'optimizer' is malformed (param_groups: a list of objects with a 'params' "
                             "list of names; state: an object of objects)")
    for k in ("optimizer", "rng", "rng_ranks", "extra"):
        _check_refs(rest.get(k), k, path, known)


def _check_model(model: Dict[str, Any], path: str, known: set) -> None:
    """``model.aliases`` maps tied names, which have no entry of their own, to a model tensor that has one;
    ``model.other`` is an object whose tensor references have entries."""
    aliases, other = model.get("aliases", {}), model.get("other")
    if not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
        raise _corrupt(path, "field 'model.aliases' is not an object of names")
    for alias, canon in aliases.items():
        if model_key(canon) not in known:
            raise _corrupt(path, f"field 'model.aliases' ties {alias!r} to {canon!r}, a model tensor the manifest "
                                 f"has no entry for", tensor=model_key(canon))
        if model_key(alias) in known:
            raise _corrupt(path, f"field 'model.aliases' ties {alias!r} to {canon!r}, but {alias!r} has an entry "
                                 f"of its own", tensor=model_key(alias))
    if not isinstance(other, (dict, type(None))):
        raise _corrupt(path, "field 'model.other' is not an object")
    _check_refs(other, "model.other", path, known)


def _check_refs(obj: Any, field_name: str, path: str, known: set) -> None:
    """Every ``{"__tensor__": key}`` (or ``__ndarray__``) reference inside a field names, by a string, a tensor
    the manifest has an entry for."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, list):
            stack.extend(o)
        elif isinstance(o, dict):
            ref = next(iter(o.values())) if len(o) == 1 and next(iter(o)) in ("__tensor__", "__ndarray__") else None
            if ref is not None and not (isinstance(ref, str) and ref in known):
                raise _corrupt(path, f"field {field_name!r} refers to tensor {_short(ref)}, which the manifest has "
                                     f"no entry for")
            stack.extend(o.values())


def _read_blocks(blocks: Any, tensors: Dict[str, TensorEntry], path: str) -> Dict[str, RowBlocks]:
    """Each tensor stored in row blocks: its blocks cover its rows in order, each one listed with the
    dtype and shape of those rows."""
    if not isinstance(blocks, dict):
        raise CheckpointCorruptError(f"manifest {path}: 'blocks' is not a mapping", path=path)
    out = {}
    for key, b in blocks.items():
        ok = (isinstance(b, dict) and _is_shape(b.get("shape"), b.get("dtype")) and len(b["shape"]) >= 1
              and isinstance(b.get("rows"), list) and len(b["rows"]) >= 1
              and all(isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) for r in b["rows"]))
        edges = [0] + [x for r in (b["rows"] if ok else []) for x in r] + [b["shape"][0] if ok else 0]
        if not ok or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)) or any(
                r[0] >= r[1] for r in b["rows"]):
            raise _corrupt(path, f"the row blocks of tensor {key!r} are malformed (dtype: a known code; shape: sizes "
                                 f"within {MAX_TENSOR_BYTES} bytes; rows: [first, end] pairs covering its rows in "
                                 f"order, at least one)", tensor=key)
        if key in tensors:
            raise _corrupt(path, f"tensor {key!r} is stored in row blocks and also otherwise", tensor=key)
        out[key] = RowBlocks(dtype=b["dtype"], shape=list(b["shape"]), rows=[list(r) for r in b["rows"]])
        for pk, a, z in row_pieces(out, key):
            e = tensors.get(pk)
            if e is None or e.dtype != b["dtype"] or e.shape != [z - a] + b["shape"][1:]:
                raise CheckpointCorruptError(
                    f"manifest {path}: block {pk!r} of tensor {key!r} is missing or has the wrong dtype or shape",
                    path=path, tensor=pk)
    return out


def _read_boxes(boxes: Any, tensors: Dict[str, TensorEntry], rows: set, path: str) -> Dict[str, Boxes]:
    """Each tensor stored as boxes: its boxes lie inside its shape and cover it without overlap, each one
    listed as a tensor entry of the dtype and the box's sizes."""
    if not isinstance(boxes, dict):
        raise _corrupt(path, "'boxes' is not a mapping")
    out = {}
    for key, b in boxes.items():
        rec = _box_record(key, b, path)
        if key in rows or key in tensors:
            raise _corrupt(path, f"tensor {key!r} is stored as boxes and also otherwise", tensor=key)
        _check_cover(key, rec, path)
        for pk, _, sizes in shard_pieces(rec, key):
            e = tensors.get(pk)
            if e is None or e.dtype != rec.dtype or e.shape != sizes:
                raise _corrupt(path, f"box {pk!r} of tensor {key!r} is missing or has the wrong dtype or shape",
                               tensor=pk)
        out[key] = rec
    return out


def _box_record(key: str, b: Any, path: str) -> Boxes:
    """One ``boxes`` record, its fields of their types: every box [offsets, sizes] inside the shape."""
    ok = (isinstance(b, dict) and _is_shape(b.get("shape"), b.get("dtype"))
          and isinstance(b.get("boxes"), list) and len(b["boxes"]) <= MAX_WORLD)
    nd = len(b["shape"]) if ok else 0
    for box in b["boxes"] if ok else []:
        ok = (isinstance(box, list) and len(box) == 2 and all(
            isinstance(v, list) and len(v) == nd and all(_is_int(x) for x in v) for v in box)
              and all(s >= 1 and o + s <= n for o, s, n in zip(box[0], box[1], b["shape"])))
        if not ok:
            raise _corrupt(path, f"tensor {key!r} has a malformed box {_short(box)} (offsets and sizes per dim, "
                                 f"each box non-empty and inside the shape {_short(b['shape'])})", tensor=key)
    if not ok:
        raise _corrupt(path, f"the boxes of tensor {key!r} are malformed", tensor=key)
    return Boxes(dtype=b["dtype"], shape=list(b["shape"]), boxes=[[list(o), list(s)] for o, s in b["boxes"]])


#: cells of the grid a tensor's box edges cut it into that a manifest's boxes may make: far above any real layout
#: (a grid partition makes as many cells as boxes), far below what checking them takes long for
MAX_CELLS = 1 << 22


def _check_cover(key: str, rec: Boxes, path: str) -> None:
    """The boxes do not overlap and their volumes add up to the tensor's: together they cover it once.  Each box
    is painted onto the grid of cells its edges cut the tensor into, refused where it meets a painted cell: work
    bounded by the cells, whatever the boxes."""
    import numpy as np

    if sum(math.prod(s) for _, s in rec.boxes) != math.prod(rec.shape):
        raise _corrupt(path, f"the boxes of tensor {key!r} do not add up to its shape {rec.shape}", tensor=key)
    if len(rec.boxes) < 2 or not rec.shape:
        return
    edges = [sorted({x for o, s in rec.boxes for x in (o[d], o[d] + s[d])}) for d in range(len(rec.shape))]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_CELLS:
        raise _corrupt(path, f"the {len(rec.boxes)} boxes of tensor {key!r} cut it into {cells} cells, more than "
                             f"the {MAX_CELLS} a layout makes", tensor=key)
    grid = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for o, s in rec.boxes:
        at = tuple(slice(bisect.bisect_left(e, o[d]), bisect.bisect_left(e, o[d] + s[d])) for d, e in enumerate(edges))
        if grid[at].any():
            raise _corrupt(path, f"the box {[o, s]} of tensor {key!r} overlaps another", tensor=key)
        grid[at] = True


_parsed: "contextvars.ContextVar[Optional[Dict[Tuple[str, int, int, int], Manifest]]]" = contextvars.ContextVar(
    "layerckpt_parsed_manifests", default=None)


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
