"""On-disk format: safetensors-compatible data files and JSON manifests.

A data file is a valid safetensors file whose header is padded with spaces so
that tensor data starts on a 4 KiB boundary; tensors are packed back to back,
ordered by element size (largest first) so every tensor stays aligned to its
own element size without padding tensors.  The whole file image is therefore
one contiguous byte range, written in large aligned pieces.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .config import ALIGN
from .errors import CheckpointCorruptError

FORMAT_NAME = "layerckpt"
FORMAT_VERSION = 1

DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
CODES: Dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}

DATA_DIR = "data"
MANIFEST_DIR = "manifests"
LATEST = "latest"
_MANIFEST_RE = re.compile(r"^step-(\d{8,})\.json$")
_DATA_RE = re.compile(r"^step-(\d{8,})(?:\.v(\d+))?\.rank(\d+)\.safetensors$")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


def data_name(step: int, rank: int, version: int = 0) -> str:
    v = f".v{version}" if version else ""
    return f"step-{step:08d}{v}.rank{rank}.safetensors"


def manifest_step(name: str) -> Optional[int]:
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def is_data_name(name: str) -> bool:
    return _DATA_RE.match(name) is not None


def dtype_code(t: torch.Tensor, key: str) -> str:
    code = DTYPES.get(t.dtype)
    if code is None:
        from .errors import CheckpointError

        raise CheckpointError(
            f"tensor {key!r} has dtype {t.dtype}, which the safetensors format cannot hold; "
            f"convert it (e.g. torch.view_as_real for complex) before saving"
        )
    return code


@dataclass
class Item:
    """One tensor placed in a file image."""

    key: str
    tensor: torch.Tensor
    offset: int  # absolute offset in the file
    nbytes: int


@dataclass
class Layout:
    header: bytes  # the 8-byte length prefix + padded JSON header
    items: List[Item]
    size: int  # file size in bytes

    @property
    def data_start(self) -> int:
        return len(self.header)


class LayoutCache:
    """Saves of one model repeat the same tensors: reuse the placement and header when nothing changed."""

    def __init__(self) -> None:
        self._sig: Optional[tuple] = None
        self._plan: Optional[Tuple[bytes, List[Tuple[int, int, int]], int]] = None

    def plan(self, entries: Sequence[Tuple[str, torch.Tensor]]) -> Layout:
        sig = tuple((k, t.dtype, t.shape) for k, t in entries)
        if sig != self._sig or self._plan is None:
            layout = plan_layout(entries)
            index = {k: i for i, (k, _) in enumerate(entries)}
            self._sig = sig
            self._plan = (layout.header, [(index[it.key], it.offset, it.nbytes) for it in layout.items], layout.size)
            return layout
        header, placed, size = self._plan
        return Layout(header=header, items=[Item(entries[i][0], entries[i][1], o, n) for i, o, n in placed], size=size)


def plan_layout(entries: Sequence[Tuple[str, torch.Tensor]]) -> Layout:
    """Place tensors in a safetensors file image; header padded to 4 KiB."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].element_size())
    meta: Dict[str, Any] = {"__metadata__": {"format": "pt", "writer": FORMAT_NAME}}
    rel = 0
    placed = []
    for i in order:
        key, t = entries[i]
        n = t.numel() * t.element_size()
        meta[key] = {"dtype": dtype_code(t, key), "shape": list(t.shape), "data_offsets": [rel, rel + n]}
        placed.append((key, t, rel, n))
        rel += n
    body = json.dumps(meta, separators=(",", ":")).encode()
    hlen = align_up(8 + len(body)) - 8
    header = hlen.to_bytes(8, "little") + body + b" " * (hlen - len(body))
    start = len(header)
    items = [Item(k, t, start + r, n) for k, t, r, n in placed]
    return Layout(header=header, items=items, size=start + rel)


# ---------------------------------------------------------------- manifests

def safe_join(root: str, sub: str, name: Any, what: str) -> str:
    """Join a file name from a manifest under root/sub, refusing anything that could escape it."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise CheckpointCorruptError(
            f"{what} names {name!r}, which is not a plain file name inside {os.path.join(root, sub)}; refused",
            path=os.path.join(root, sub),
        )
    return os.path.join(root, sub, name)


def write_atomic(path: str, data: bytes) -> None:
    """Write tmp, fsync, rename over path, fsync the directory."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_REQUIRED = {"format": str, "version": int, "step": int, "world_size": int, "files": dict,
             "tensors": dict, "layers": dict, "model": dict}


def load_manifest(path: str) -> Dict[str, Any]:
    """Parse and sanity-check a manifest; any damage is a CheckpointCorruptError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        from .errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"manifest {path} does not exist") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(f"manifest {path} is truncated or malformed ({e})", path=path) from None
    if not isinstance(m, dict):
        raise CheckpointCorruptError(f"manifest {path} is not a JSON object", path=path)
    for k, kind in _REQUIRED.items():
        if not isinstance(m.get(k), kind):
            raise CheckpointCorruptError(f"manifest {path} lacks a valid {k!r} field", path=path)
    if m["format"] != FORMAT_NAME:
        raise CheckpointCorruptError(f"{path} is not a layerckpt manifest (format={m['format']!r})", path=path)
    if m["version"] > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"manifest {path} has format version {m['version']}, newer than this layerckpt reads "
            f"({FORMAT_VERSION}); upgrade layerckpt", path=path)
    for key, e in m["tensors"].items():
        if not (isinstance(e, dict) and isinstance(e.get("file"), str) and e.get("dtype") in CODES
                and isinstance(e.get("shape"), list) and all(isinstance(s, int) and s >= 0 for s in e["shape"])
                and isinstance(e.get("offset"), int) and e["offset"] >= 0
                and isinstance(e.get("nbytes"), int) and e["nbytes"] >= 0 and isinstance(e.get("crc"), int)):
            raise CheckpointCorruptError(f"manifest {path}: entry for tensor {key!r} is malformed", path=path,
                                         tensor=key)
        if e["file"] not in m["files"]:
            raise CheckpointCorruptError(
                f"manifest {path}: tensor {key!r} points to file {e['file']!r} that the manifest does not list",
                path=path, tensor=key)
    return m


def list_manifests(root: str) -> List[Tuple[int, str]]:
    """Committed manifests as (step, name), oldest step first."""
    d = os.path.join(root, MANIFEST_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    out = [(manifest_step(n), n) for n in names]
    return sorted((s, n) for s, n in out if s is not None)
