"""A small JSON codec for the plain values a checkpoint carries: it keeps tuples and non-string dict
keys, stores tensors and arrays by reference (appended to a list of entries to stage), and never pickles."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from ._json import MAX_INT_DIGITS
from ._layout import DTYPES
from ..errors import CheckpointError

Entries = List[Tuple[str, torch.Tensor]]
_PLAIN = (int, float, str, bool, type(None))
#: integers at or beyond this bound are refused: the strict reader refuses more than MAX_INT_DIGITS digits
_INT_BOUND = 10 ** MAX_INT_DIGITS


def encode(value: Any, key: str, out: Entries, where: str) -> Any:
    """Plain values stay JSON; tensors are appended to ``out`` and replaced by a reference.  What cannot be
    stored and read back as it was raises :class:`CheckpointError` naming ``where``, before anything is staged."""
    if isinstance(value, torch.Tensor):  # (detach() makes a new tensor object: only where autograd tracks it)
        out.append((key, _storable(value.detach() if value.requires_grad else value, where)))
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        out.append((key, _storable(_from_numpy(value, where), where)))
        return {"__ndarray__": key}
    if isinstance(value, np.generic):
        return encode(value.item(), key, out, where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return _check_int(value, where)
    if isinstance(value, (tuple, list)):
        if all(type(v) in _PLAIN for v in value):  # fast path: e.g. the 625 ints of python's RNG state
            items = list(value)
            for i, v in enumerate(items):
                if type(v) is int and not -_INT_BOUND < v < _INT_BOUND:
                    _check_int(v, f"{where}[{i}]")
        else:
            items = [encode(v, f"{key}/{i}", out, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) and not (k.startswith("__") and k.endswith("__")) for k in value):
            return {k: encode(v, f"{key}/{k}", out, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = []
        for i, (k, v) in enumerate(value.items()):
            _check_key(k, where)
            pairs.append([encode(k, f"{key}/k{i}", out, where), encode(v, f"{key}/{i}", out, f"{where}[{k!r}]")])
        return {"__dict__": pairs}
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which layerckpt cannot store "
        f"without pickling; convert it to tensors or plain values (int, float, str, bool, None, list, tuple, dict)"
    )


def _storable(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` if a data file can hold it as it is: dense, with data, of a dtype the format has."""
    if t.device.type == "meta":
        raise CheckpointError(f"{where} is a tensor on the meta device, which holds no data; materialize it "
                              f"(e.g. torch.empty_like(t, device='cpu')) or leave it out")
    if t.layout != torch.strided or t.is_nested:
        what = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        raise CheckpointError(f"{where} is a {what} tensor; layerckpt stores dense tensors: pass t.to_dense() "
                              f"(or its indices and values as two tensors)")
    if t.dtype not in DTYPES:
        raise CheckpointError(f"{where} has dtype {t.dtype}, which the safetensors format cannot hold; convert it "
                              f"(e.g. torch.view_as_real for complex) or leave it out")
    return t


def _from_numpy(a: np.ndarray, where: str) -> torch.Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(a))
    except TypeError:
        raise CheckpointError(f"{where} is a numpy array of dtype {a.dtype}, which layerckpt cannot store without "
                              f"pickling; use a numeric dtype") from None


def _check_int(v: Any, where: str) -> Any:
    """``v``, unless it is an integer of more digits than a manifest may hold."""
    if isinstance(v, int) and not isinstance(v, bool) and not -_INT_BOUND < v < _INT_BOUND:
        raise CheckpointError(f"{where} is an integer of more than {MAX_INT_DIGITS} digits, more than a manifest "
                              f"holds; store it as a str (or a tensor)")
    return v


def _check_key(k: Any, where: str) -> None:
    """A dict key that comes back as it was: None, bool, int, str, a float other than NaN, or a tuple of them."""
    if isinstance(k, tuple):
        for x in k:
            _check_key(x, where)
        return
    if isinstance(k, float) and k != k:
        raise CheckpointError(f"{where} has a NaN dict key, which never compares equal to itself (it cannot be "
                              f"looked up once read back); use another key")
    if not (k is None or isinstance(k, (bool, int, float, str))):
        raise CheckpointError(f"{where} has a dict key {k!r} of type {type(k).__name__}; use str/int keys")
    _check_int(k, f"{where} key")


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
