"""A small JSON codec for the plain values a checkpoint carries: it keeps tuples and non-string dict
keys, stores tensors and arrays by reference (appended to a list of entries to stage), and never pickles."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from .errors import CheckpointError

Entries = List[Tuple[str, torch.Tensor]]
_PLAIN = (int, float, str, bool, type(None))


def encode(value: Any, key: str, out: Entries, where: str) -> Any:
    """Plain values stay JSON; tensors are appended to ``out`` and replaced by a reference."""
    if isinstance(value, torch.Tensor):
        out.append((key, value.detach()))
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        out.append((key, torch.from_numpy(np.ascontiguousarray(value))))
        return {"__ndarray__": key}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        if all(type(v) in _PLAIN for v in value):  # fast path: e.g. the 625 ints of python's RNG state
            items = list(value)
        else:
            items = [encode(v, f"{key}/{i}", out, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) and not (k.startswith("__") and k.endswith("__")) for k in value):
            return {k: encode(v, f"{key}/{k}", out, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = []
        for i, (k, v) in enumerate(value.items()):
            if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                raise CheckpointError(f"{where} has a dict key {k!r} of type {type(k).__name__}; use str/int keys")
            pairs.append([encode(k, f"{key}/k{i}", out, where), encode(v, f"{key}/{i}", out, f"{where}[{k!r}]")])
        return {"__dict__": pairs}
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which layerckpt cannot store "
        f"without pickling; convert it to tensors or plain values (int, float, str, bool, None, list, tuple, dict)"
    )


def decode(obj: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        if all(type(v) in _PLAIN for v in obj):  # fast path, as in encode
            return list(obj)
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            (tag, v), = obj.items()
            if tag == "__tensor__":
                return tensors[v]
            if tag == "__ndarray__":
                return tensors[v].numpy()
            if tag == "__tuple__":
                return tuple(v) if all(type(x) in _PLAIN for x in v) else tuple(decode(x, tensors) for x in v)
            if tag == "__dict__":
                return {_hashable(decode(k, tensors)): decode(x, tensors) for k, x in v}
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


def tensor_refs(obj: Any) -> List[str]:
    """Every tensor key an encoded value refers to."""
    out: List[str] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, list):
            stack.extend(v for v in o if type(v) not in _PLAIN)
        elif isinstance(o, dict):
            if len(o) == 1 and next(iter(o)) in ("__tensor__", "__ndarray__"):
                out.append(next(iter(o.values())))
            else:
                stack.extend(o.values())
    return out
