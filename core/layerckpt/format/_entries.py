"""The parts a manifest is made of: tensor key prefixes, the format's version, and the entry types.

Tensor keys in a checkpoint have fixed prefixes, named here and nowhere else:
``model/<state_dict name>``, ``optim/<parameter name>/<state key>``,
``optim_groups/<i>/...``, ``rng/...`` (``rng.rankN/...`` for other ranks),
``extra/...`` and ``model_other/...``; ``<key>#rows=<a>:<b>`` is a row block of a tensor
(see ``_blocks``), ``<key>#box=<o0>,<o1>,...:<s0>,<s1>,...`` the box at offsets ``o`` with sizes ``s``.
``_manifest`` (the record) and ``_validate`` (its one validator) both build on them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

FORMAT_NAME = "layerckpt"
#: 2: tensors may be encoded (TensorEntry.enc); 3: tensors stored as boxes (Manifest.boxes); 4: checksums sealed to
#: their entry's key (``_places.SEALED``), which a reader of 3 or less would take for damage; 5: checksums sealed to
#: their entry's key and its file's step (``_places.STEPPED``), which a reader of 4 or less would take for damage;
#: 6: second moments' bounded-loss codes told against their reference's (``_qblock.QSQREF``, block mode 7), a mode a
#: reader of 5 or less does not know; 7: model tensors held by reference to the pretrained files the training
#: started from (``Manifest.pretrained``), whose layers a reader of 6 or less would find without entries; 8: those
#: references sealed to the step their layer records (``PretrainedEntry.step``), which a reader of 7 would take
#: for damage
FORMAT_VERSION = 8
_BOXES_VERSION = 3  # the version a manifest with boxes is written as; without, 2 (4 once sealed, 5 once stepped)
_SEALED_VERSION = 4
_STEPPED_VERSION = 5
_QSQREF_VERSION = 6
_QSQREF_MODE = 7  # ``_qblock.QSQREF``
_PRETRAINED_VERSION = 7
_PRETRAINED_STEPPED_VERSION = 8
#: the bytes each CRC pair of a fingerprint covers (``select/_exact``; ``PretrainedEntry.fp``)
FINGERPRINT_CHUNK = 16 << 20

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
    #: CRC of the raw bytes (after decoding, for an encoded tensor); sealed to this entry's key and its file's step
    #: where bits 32 and 33 are set (``_places``: every entry written since format version 5), to its key only
    #: where bit 32 alone is (entries written as version 4), a plain CRC in entries written before
    crc: int
    #: how it is encoded (``_encode``): {"codec", "blocks": [[file offset, length, raw length, mode], ...],
    #: "ref": None or the reference's {"file", "step", "rank", "size", "crc", "blocks"}}; None: raw bytes at
    #: ``offset`` (format version 1's only kind)
    enc: Optional[Dict[str, Any]] = None


@dataclass
class PretrainedEntry:
    """A model tensor a save proved bit-identical to a tensor of the pretrained files the training started from
    (``Config(pretrained=...)``), recorded instead of its bytes (``read/_pretrained``).  It names no file: a
    restore takes the tensor from the model where the model holds it already, else from the pretrained files its
    caller names, each proven by ``fp``."""
    name: str  # the tensor's name in the pretrained files
    dtype: str  # safetensors dtype code
    shape: List[int]
    nbytes: int
    #: the fingerprint of its bytes (``select/_exact``): crc32c << 32 | crc32 of each ``_exact.CHUNK`` bytes
    fp: List[int]
    #: the manifest's checksum over the entry's key, ``name``, ``fp``, ``step``, ``dtype`` and ``shape``
    #: (``_places.pretrained_seal``): an entry copied onto another key, or from a composite where its layer was of
    #: another step, or given another dtype or shape, does not pass
    seal: int
    #: the step of the save that proved it (the step its layer records): an entry of the layer's frozen days
    #: copied into a composite where the layer was trained since is refused (``_validate._check_versions``);
    #: None in entries written before format version 8, sealed without it
    step: Optional[int] = None


@dataclass
class FileEntry:
    step: int
    rank: int
    size: int
    #: a signed store's (``_sign``): the SHA-256 digests of the file's consecutive parts, ``[[bytes, hex], ...]``;
    #: None (and not written) in an unsigned one
    digest: Optional[List[List[Any]]] = None


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
