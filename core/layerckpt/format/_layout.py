"""The layout of one data file: where each tensor goes in a safetensors-compatible file image.

A data file is a valid safetensors file whose header is padded with spaces so
that tensor data starts on a 4 KiB boundary; tensors are packed back to back,
ordered by element size (largest first) so every tensor stays aligned to its
own element size without padding tensors.  The whole file image is therefore
one contiguous byte range, written in large aligned pieces.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..io._units import ALIGN
from ..errors import CheckpointError

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
ITEMSIZE: Dict[str, int] = {c: torch.empty((), dtype=d).element_size() for c, d in CODES.items()}

def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_code(t: torch.Tensor, key: str) -> str:
    code = DTYPES.get(t.dtype)
    if code is None:
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
        #: (key, dtype, shape) -> (element size, bytes, the start of its header entry): selective saves write
        #: other subsets of the same tensors, whose headers are made of the same entries at other offsets
        self._entries: Dict[tuple, Tuple[int, int, str]] = {}

    def plan(self, entries: Sequence[Tuple[str, torch.Tensor]]) -> Layout:
        sig = tuple((k, t.dtype, t.shape) for k, t in entries)
        if sig != self._sig or self._plan is None:
            if len(self._entries) > 1 << 16:
                self._entries.clear()
            layout = plan_layout(entries, self._entries)
            index = {k: i for i, (k, _) in enumerate(entries)}
            self._sig = sig
            self._plan = (layout.header, [(index[it.key], it.offset, it.nbytes) for it in layout.items], layout.size)
            return layout
        header, placed, size = self._plan
        return Layout(header=header, items=[Item(entries[i][0], entries[i][1], o, n) for i, o, n in placed], size=size)


_METADATA = json.dumps({"__metadata__": {"format": "pt", "writer": "layerckpt"}}, separators=(",", ":"))


def plan_layout(entries: Sequence[Tuple[str, torch.Tensor]], memo: Optional[Dict[tuple, Tuple[int, int, str]]] = None
                ) -> Layout:
    """Place tensors in a safetensors file image; header padded to 4 KiB.  ``memo``: each tensor's header
    entry as far as it does not depend on its place, kept by the caller across calls."""
    memo = {} if memo is None else memo
    facts = []
    for key, t in entries:
        sig = (key, t.dtype, t.shape)
        got = memo.get(sig)
        if got is None:
            es = t.element_size()
            start = json.dumps(key) + ':{"dtype":' + json.dumps(dtype_code(t, key)) + ',"shape":' + json.dumps(
                list(t.shape)) + ',"data_offsets":['
            got = memo[sig] = (es, t.numel() * es, start)
        facts.append(got)
    order = sorted(range(len(entries)), key=lambda i: -facts[i][0])
    parts = [_METADATA[:-1]]
    rel = 0
    placed = []
    for i in order:
        key, t = entries[i]
        _, n, start = facts[i]
        parts.append(f"{start}{rel},{rel + n}]}}")
        placed.append((key, t, rel, n))
        rel += n
    body = (",".join(parts) + "}").encode()
    hlen = align_up(8 + len(body)) - 8
    header = hlen.to_bytes(8, "little") + body + b" " * (hlen - len(body))
    start = len(header)
    items = [Item(k, t, start + r, n) for k, t, r, n in placed]
    return Layout(header=header, items=items, size=start + rel)
