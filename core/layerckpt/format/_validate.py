"""The one validator of a manifest: every field a restore, ``verify``, ``inspect`` or ``plot`` uses passes it
before anything is read or allocated (``Manifest.from_dict``, for every manifest :func:`_manifest.load_manifest`
reads).  Any damage is a CheckpointCorruptError naming the file and the field (never a bare Python exception):

- the header: format, version, step (the one the file is named for), world size;
- files, tensors and layers: of their types, in range; a tensor's shape of a known dtype spanning at most
  ``MAX_TENSOR_BYTES`` (counting empty dims as 1, as torch sizes storage), its bytes inside its file; an encoded
  tensor's blocks well formed, in file order, covering its bytes once, its reference in a listed file; no two
  tensors of one file owning overlapping bytes, nor a file holding checksums sealed to their step beside one
  that is not (``_places``);
- row blocks and boxes: covering their tensor once, each piece an entry of the piece's dtype and shape;
- versions: a layer's tensors in files of the step the layer records, every other tensor in files of the
  manifest's step, a reference's step its file's (an entry of an older step copied whole, checksum and all,
  would otherwise read back as the newer version);
- aliases to model tensors that have entries (and none over one that has its own); tensor references in the
  optimizer state, RNG, extra and non-tensor model state to tensors that have entries, each naming its own place;
- the fidelity bookkeeping a restore compares (costs, loss): finite.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
from typing import AbstractSet, Any, Dict, Mapping, Optional, Sequence

from ._layout import CODES, ITEMSIZE
from ._entries import (EXTRA, FINGERPRINT_CHUNK, FORMAT_NAME, FORMAT_VERSION, MODEL_OTHER, OPTIM, OPTIM_GROUPS, RNG,
                       Boxes, FileEntry, LayerEntry, PretrainedEntry, RowBlocks, TensorEntry, model_key, model_name,
                       piece_base, row_pieces, shard_pieces)
from ._places import CRC_MAX, check_block_order, check_own_files, check_regions, check_seal_kinds, max_blocks
from ..errors import CheckpointCorruptError


def validated(m: Any, path: str, other_fields: Sequence[str]) -> Dict[str, Any]:
    """The fields of a :class:`~layerckpt.format._manifest.Manifest` from the parsed manifest ``m`` at ``path``,
    every one checked; ``other_fields``: its fields besides step, world_size, files, tensors, layers and model."""
    _check_header(m, path)
    files = {name: _file_entry(name, e, m["step"], path) for name, e in m["files"].items()}
    tensors = {key: _tensor_entry(key, e, files, path) for key, e in m["tensors"].items()}
    check_regions(tensors, path)
    check_seal_kinds(tensors, path)
    layers = {name: _layer_entry(name, e, path) for name, e in m["layers"].items()}
    rest = {k: m[k] for k in other_fields if k in m}
    if rest.get("blocks") is not None:
        rest["blocks"] = _read_blocks(rest["blocks"], tensors, path)
    if rest.get("boxes") is not None:
        rest["boxes"] = _read_boxes(rest["boxes"], tensors, set(rest.get("blocks") or {}), path)
    known = set(tensors) | set(rest.get("blocks") or {}) | set(rest.get("boxes") or {})
    if rest.get("pretrained") is not None:
        rest["pretrained"] = _read_pretrained(rest["pretrained"], known, path)
    # the model's tensors: stored, or held by reference to the pretrained files (never the optimizer's, RNG or extra)
    model_known = known | set(rest.get("pretrained") or {})
    for name, layer in layers.items():  # a deleted entry would otherwise read back as a model without it
        lost = next((k for k in layer.tensors if k not in model_known), None)
        if lost is not None:
            raise _corrupt(path, f"layer {name!r} lists tensor {lost!r}, which the manifest has no entry for",
                           tensor=lost)
    _check_versions(m["step"], files, tensors, layers, {**(rest.get("blocks") or {}), **(rest.get("boxes") or {})},
                    path, rest.get("pretrained") or {})
    check_own_files(m["step"], files, tensors, path)
    _check_other(rest, path, known)
    _check_model(m["model"], path, model_known)
    _check_all_places(rest, m["model"].get("other"), path)
    return dict(step=m["step"], world_size=m["world_size"], files=files, tensors=tensors, layers=layers,
                model=m["model"], **rest)


_REQUIRED = {"format": str, "version": int, "step": int, "world_size": int, "files": dict,
             "tensors": dict, "layers": dict, "model": dict}
_TENSOR_FIELDS = [f.name for f in dataclasses.fields(TensorEntry)]
if _TENSOR_FIELDS != ["file", "dtype", "shape", "offset", "nbytes", "crc", "enc"]:  # what _entry_json writes
    raise RuntimeError(f"TensorEntry's fields changed ({_TENSOR_FIELDS}): update _manifest._entry_json")
_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerEntry)]
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
_NONE: Mapping[str, PretrainedEntry] = {}  # no tensor held by reference
CHECKSUMS = ("crc32c", "crc32")  # the checksums a manifest may name (``io._backend.checksum_function``)
HEX = re.compile(r"^[0-9a-f]{64}$")  # a SHA-256 digest part of a signed store's file (``_sign``)


def _corrupt(path: str, msg: str, tensor: Optional[str] = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"manifest {path}: {msg}", path=path, tensor=tensor)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bool:
    return (type(v) is int or isinstance(v, int) and not isinstance(v, bool)) and lo <= v <= hi


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
    if not (isinstance(dtype, str) and dtype in CODES and isinstance(shape, list) and len(shape) <= MAX_DIMS):
        return False
    span = ITEMSIZE[dtype]
    for s in shape:  # one loop (a manifest has thousands of shapes): each size an int in range, the span bounded
        if not _is_int(s):
            return False
        if s > 1:
            span *= s
    return span <= MAX_TENSOR_BYTES


def _file_entry(name: str, e: Any, step: int, path: str) -> FileEntry:
    if not (isinstance(e, dict) and all(_is_int(e.get(k, 0)) for k in ("step", "rank", "size"))
            and e.get("rank", 0) < MAX_WORLD):
        raise _corrupt(path, f"entry for file {name!r} is malformed (step, rank and size must be non-negative "
                             f"integers)")
    digest = e.get("digest")
    if digest is not None and not _is_digest(digest, e.get("size", 0)):
        raise _corrupt(path, f"entry for file {name!r} has a malformed digest (a list of [bytes, 64 hex "
                             f"characters] parts whose bytes add up to the file's size)")
    return FileEntry(step=e.get("step", step), rank=e.get("rank", 0), size=e.get("size", 0), digest=digest)


def _is_digest(parts: Any, size: int) -> bool:
    """A file's digest (``_sign``): consecutive parts, each [bytes, SHA-256 hex], adding up to its size."""
    if not isinstance(parts, list) or len(parts) > size // 512 + 2:  # a bound on the work, far above the writers
        return False
    total = 0
    for p in parts:
        if not (isinstance(p, list) and len(p) == 2 and _is_int(p[0], 1) and isinstance(p[1], str)
                and HEX.match(p[1])):
            return False
        total += p[0]
    return total == size


def _check_versions(step: int, files: Dict[str, FileEntry], tensors: Dict[str, TensorEntry],
                    layers: Dict[str, LayerEntry], stored: Dict[str, Any], path: str,
                    by_reference: Mapping[str, PretrainedEntry] = _NONE) -> None:
    """Each tensor's bytes are the version the manifest says it holds: a layer's tensors (each piece of one stored
    in row blocks or boxes) lie in data files of the step the layer records, every other tensor (RNG, extra,
    optimizer groups, non-tensor model state: written by every save) in files of the manifest's own step.  An
    entry of an older step, copied whole (its blocks, its reference and its checksum, sealed to its key and the
    step of its file: ``_places``), reads back sound where its file is listed with the step it was written at,
    and only this says the layer's bytes are an older version than the one the manifest reports (the file
    listed with another step, its seals no longer match).  (A delta against an older step's file is another
    thing: its reference, ``enc.ref``, names the older file; the entry's own file is of its layer's step.)"""
    owned = set()
    for name, layer in layers.items():
        if layer.age == 0 and layer.step != step:  # persisted by this save: age 0; carried: at least 1
            raise _corrupt(path, f"layer {name!r} is recorded at step {layer.step} with an age of {layer.age} "
                                 f"checkpoint(s) in the composite of step {step}: a layer persisted by an earlier "
                                 f"save is at least one checkpoint old")
        for k in layer.tensors:
            ref = by_reference.get(k)
            if ref is not None:  # in no file: its bytes the pretrained ones, proven at every read, its step sealed
                if ref.step is not None and ref.step != layer.step:
                    raise _corrupt(path, f"tensor {k!r} of layer {name!r}, which the manifest records at step "
                                         f"{layer.step}, is held by reference to the pretrained weights as proven at "
                                         f"step {ref.step}: the pretrained bytes are another version than the one "
                                         f"the manifest reports", tensor=k)
                continue
            rec = stored.get(k)
            for pk in [p for p, _, _ in shard_pieces(rec, k)] if rec is not None else [k]:
                owned.add(pk)
                fstep = files[tensors[pk].file].step
                if fstep != layer.step:
                    raise _corrupt(path, f"tensor {pk!r} of layer {name!r}, which the manifest records at step "
                                         f"{layer.step}, is in file {tensors[pk].file!r} of step {fstep}: its bytes "
                                         f"are another version than the one the manifest reports", tensor=pk)
    for k, e in tensors.items():
        if k not in owned and files[e.file].step != step:
            raise _corrupt(path, f"tensor {k!r}, which no layer lists, is in file {e.file!r} of step "
                                 f"{files[e.file].step}, not the manifest's step {step}: every save writes it anew",
                           tensor=k)
        ref = e.enc.get("ref") if e.enc else None
        if ref is not None and ref["step"] != files[ref["file"]].step:
            raise _corrupt(path, f"tensor {k!r}'s reference names step {ref['step']}, but its file "
                                 f"{ref['file']!r} is of step {files[ref['file']].step}", tensor=k)


def _tensor_entry(key: str, e: Any, files: Dict[str, FileEntry], path: str) -> TensorEntry:
    if not isinstance(e, dict):
        e = {}
    name, dtype, shape, offset, nbytes, crc = (e.get("file"), e.get("dtype"), e.get("shape"), e.get("offset"),
                                               e.get("nbytes"), e.get("crc"))
    if not (isinstance(name, str) and _is_shape(shape, dtype) and _is_int(offset) and _is_int(nbytes)
            and _is_int(crc, 0, CRC_MAX)):
        raise _corrupt(path, f"entry for tensor {key!r} is malformed (file and dtype: strings, shape: a list of "
                             f"sizes within {MAX_TENSOR_BYTES} bytes, offset, nbytes and crc: integers)", tensor=key)
    if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
        raise _corrupt(path, f"tensor {key!r} has shape {_short(shape)} and dtype {dtype} but "
                             f"{nbytes} bytes", tensor=key)
    f = files.get(name)
    if f is None:
        raise _corrupt(path, f"tensor {key!r} points to file {name!r} that the manifest does not list",
                       tensor=key)
    enc = e.get("enc")
    if enc is not None:
        _check_enc(key, enc, nbytes, f.size, name, files, path)
        _check_lossy(key, enc, dtype, path)
    elif offset + nbytes > f.size:
        raise _corrupt(path, f"tensor {key!r} claims bytes {offset}..{offset + nbytes} of file "
                             f"{name!r}, which the manifest says holds {f.size}", tensor=key)
    return TensorEntry(name, dtype, shape, offset, nbytes, crc, enc)  # the fields' order is checked above


def _check_enc(key: str, enc: Any, nbytes: int, size: int, fname: str, files: Dict[str, FileEntry],
               path: str) -> None:
    """An encoded tensor's record: a codec this reader knows, blocks inside the file covering the tensor's
    bytes, and a reference (itself self-contained) inside a file the manifest lists."""
    from ._encode import CODEC, MODES, SELF_CONTAINED, reads_ref

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
    _check_blocks(key, ref["blocks"], nbytes, files[ref["file"]].size, ref["file"], SELF_CONTAINED, path,
                  " (its reference)")


_LOSSY_CODES = {"qdelta": "move", "qmom": "rms", "qsq": "rms"}  # a bounded-loss code -> what its error is against


def _check_lossy(key: str, enc: dict, dtype: str, path: str) -> None:
    """Bounded-loss blocks (``Config(encoding='lossy')``) only in an fp32 tensor, and its record of the error
    they made (``_encwrite._lossy_record``): finite, non-negative numbers."""
    from ._encode import LOSSY

    rec = enc.get("lossy")
    coded = any(b[3] in LOSSY for b in enc["blocks"])
    if coded and dtype != "F32":
        raise _corrupt(path, f"tensor {key!r} of dtype {dtype} has bounded-loss blocks, which only fp32 tensors "
                             f"have", tensor=key)
    if rec is None:
        return
    against = _LOSSY_CODES.get(rec.get("code")) if isinstance(rec, dict) else None
    if against is None or not all(isinstance(rec.get(k), (int, float)) and not isinstance(rec.get(k), bool)
                                  and math.isfinite(rec[k]) and rec[k] >= 0 for k in ("max_err", "rms_err", against)):
        raise _corrupt(path, f"tensor {key!r} has a malformed record of its bounded-loss error ({_short(rec)}: "
                             f"code one of {sorted(_LOSSY_CODES)}; max_err, rms_err and {against or 'its scale'}: "
                             f"finite numbers >= 0)", tensor=key)


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


#: the longest name of a pretrained tensor a manifest may record
MAX_NAME = 4096
_PRETRAINED_FIELDS = ("name", "dtype", "shape", "nbytes", "fp", "seal", "step")


def _read_pretrained(pre: Any, known: AbstractSet[str], path: str) -> Dict[str, PretrainedEntry]:
    """``pretrained``: model tensors held by reference to the pretrained files (``read/_pretrained``), each a whole
    model tensor of a known dtype and shape, with a name, a fingerprint of as many parts as its bytes make, and a
    32-bit seal; none that also has an entry of its own."""
    if not isinstance(pre, dict):
        raise _corrupt(path, f"field 'pretrained' is {_short(pre)}, not an object")
    out: Dict[str, PretrainedEntry] = {}
    for key, e in pre.items():
        name, dtype, shape, nbytes, fp, sealed, step = (e.get(f) if isinstance(e, dict) else None
                                                        for f in _PRETRAINED_FIELDS)
        if not ((step is None or _is_int(step)) and model_name(key) is not None and piece_base(key)[1] == "" and isinstance(name, str)
                and 0 < len(name) <= MAX_NAME and _is_shape(shape, dtype) and _is_int(nbytes)
                and _is_int(sealed, 0, 0xFFFFFFFF) and isinstance(fp, list)
                and len(fp) <= MAX_TENSOR_BYTES // FINGERPRINT_CHUNK + 1 and all(_is_int(x, 0, (1 << 64) - 1) for x in fp)):
            raise _corrupt(path, f"entry for tensor {key!r} in 'pretrained' is malformed (a whole model tensor; name: "
                                 f"a string of 1 to {MAX_NAME} characters, dtype and shape as a tensor's, nbytes: an "
                                 f"integer, fp: a list of 64-bit integers, seal: a 32-bit integer, step: an integer "
                                 f"or absent)", tensor=key)
        if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
            raise _corrupt(path, f"tensor {key!r} in 'pretrained' has shape {_short(shape)} and dtype {dtype} but "
                                 f"{nbytes} bytes", tensor=key)
        parts = max(1, -(-nbytes // FINGERPRINT_CHUNK))
        if len(fp) != parts:
            raise _corrupt(path, f"tensor {key!r} in 'pretrained' has a fingerprint of {len(fp)} parts where its "
                                 f"{nbytes} bytes make {parts}", tensor=key)
        if key in known:
            raise _corrupt(path, f"tensor {key!r} has an entry of its own and one in 'pretrained'", tensor=key)
        out[key] = PretrainedEntry(name, dtype, list(shape), nbytes, list(fp), sealed, step)
    return out


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
                "coding": (dict, type(None)), "store": (str, type(None))}


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
    if rest.get("checksum", "crc32c") not in CHECKSUMS:
        raise _corrupt(path, f"field 'checksum' is {_short(rest['checksum'])}; this layerckpt knows "
                             f"{' and '.join(CHECKSUMS)}")
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
            if len(o) == 1 and next(iter(o)) in _REF_TAGS:
                ref = next(iter(o.values()))
                if not (isinstance(ref, str) and ref in known):
                    raise _corrupt(path, f"field {field_name!r} refers to tensor {_short(ref)}, which the manifest "
                                         f"has no entry for")
            stack.extend(o.values())


_REF_TAGS = ("__tensor__", "__ndarray__")
_PLAIN = (int, float, str, bool, type(None))


def _check_places(obj: Any, key: str, field_name: str, path: str) -> None:
    """Every tensor reference inside the encoded value ``obj`` (``_codec.encode``, which gives the value at
    ``key`` the tensor key ``key``, its items ``key/<dict key or index>``, a dict's pairs ``key/k<i>`` and
    ``key/<i>``) is the key of its own place: a reference moved elsewhere (onto another parameter's moments,
    another RNG) would hand that place another tensor's bytes, each sound under its own checksum."""
    stack = [(obj, key)]
    while stack:
        o, k = stack.pop()
        if isinstance(o, list):
            stack.extend((v, f"{k}/{i}") for i, v in enumerate(o) if type(v) not in _PLAIN)
        elif isinstance(o, dict):
            tag, v = next(iter(o.items())) if len(o) == 1 else (None, None)
            if tag in _REF_TAGS:
                if v != k:
                    raise _corrupt(path, f"field {field_name!r} refers to tensor {_short(v)} where the tensor "
                                         f"{k!r} belongs: a reference names its own place", tensor=k)
            elif tag == "__tuple__" and isinstance(v, list):
                stack.extend((x, f"{k}/{i}") for i, x in enumerate(v) if type(x) not in _PLAIN)
            elif tag == "__dict__" and isinstance(v, list):
                for i, pair in enumerate(v):
                    stack.extend([(pair[0], f"{k}/k{i}"), (pair[1], f"{k}/{i}")] if isinstance(pair, list)
                                 and len(pair) == 2 else [(pair, f"{k}/{i}")])
            else:
                stack.extend((v, f"{k}/{name}") for name, v in o.items())


def _check_all_places(rest: Dict[str, Any], other: Any, path: str) -> None:
    """:func:`_check_places` over every field a restore decodes, from the key the writer encodes it at."""
    opt = rest.get("optimizer") or {}
    for name, st in opt.get("state", {}).items():
        for k, v in st.items():
            _check_places(v, f"{OPTIM}{name}/{k}", "optimizer", path)
    for gi, g in enumerate(opt.get("param_groups", [])):
        for k, v in g.items():
            if k != "params":
                _check_places(v, f"{OPTIM_GROUPS}/{gi}/{k}", "optimizer", path)
    ranks = [(RNG, rest.get("rng"))] + [(RNG if r == "0" else f"{RNG}.rank{r}", st)
                                        for r, st in (rest.get("rng_ranks") or {}).items()]
    for prefix, st in ranks:
        for k, v in (st.items() if isinstance(st, dict) else ()):
            _check_places(v, f"{prefix}/{k}", "rng", path)
    _check_places(rest.get("extra"), EXTRA, "extra", path)
    _check_places(other, MODEL_OTHER, "model.other", path)


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
