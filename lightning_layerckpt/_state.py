"""Lightning's checkpoint dict <-> what a layerckpt store holds (model, optimizer 0, ``extra``).

A Lightning checkpoint dict is ``state_dict`` (the model), ``optimizer_states`` and everything
else the Trainer keeps (loops, schedulers, callbacks, hyper-parameters, ...).  layerckpt saves the
model and the first optimizer layer-selectively; the rest travels in the manifest's ``extra``
under :data:`EXTRA_KEY`: kept exactly for what ``torch.load(weights_only=True)`` accepts, refused (naming
the key) for anything that would need pickle, which layerckpt never uses.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional

import torch
from typing_extensions import override

from layerckpt import LoadedCheckpoint, store
from layerckpt.errors import CheckpointError

#: Layerckpt's part of a loaded checkpoint dict: the RNG states, the report.
LOADED_KEY = "layerckpt"
#: The Lightning checkpoint dict, minus the model and optimizer 0, inside ``extra``.
EXTRA_KEY = "lightning"


#: The key that marks a value the JSON codec has no form for (see :func:`to_plain`).
KIND = "@kind"
_SCALARS = (type(None), bool, int, float, str)
_TORCH_NAMED = {"dtype": torch.dtype, "layout": torch.layout, "qscheme": torch.qscheme}


def to_plain(value: Any, where: str) -> Any:
    """A copy of ``value`` that layerckpt's JSON codec stores exactly, for what ``torch.load(weights_only=True)``
    accepts: tensors (parameters too), None, bool, int, float, str, bytes, bytearray, complex, list, tuple, set,
    dict, OrderedDict, Counter, torch.Size, dtypes, devices, layouts and qschemes, and numpy arrays and scalars.
    The kinds JSON lacks become ``{KIND: kind, ...}``.  Anything else would need pickle, which layerckpt never
    uses: refused with a CheckpointError naming ``where`` (the key path) and the type."""
    t = type(value)
    if t in _SCALARS or t is torch.Tensor:
        return value
    if t is list or t is tuple:
        out = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return out if t is list else tuple(out)
    if t is dict:
        items = {k: to_plain(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {KIND: "dict", "items": [[k, v] for k, v in items.items()]} if KIND in items else items
    tagged = _tagged(value, where)
    if tagged is None:
        raise CheckpointError(
            f"{where} is a {t.__module__}.{t.__qualname__}: layerckpt stores no pickles, and torch.load(weights_only="
            f"True) would refuse it in a Lightning checkpoint too; store tensors or plain values there (numbers, "
            f"str, bytes, None, list, tuple, dict, set, torch dtypes/devices/sizes), e.g. converted in "
            f"on_save_checkpoint / state_dict and back in on_load_checkpoint / load_state_dict")
    return tagged


def _tagged(value: Any, where: str) -> Any:
    """``{KIND: kind, ...}`` for an accepted value that JSON has no form for; None for one refused."""
    t = type(value)
    if t is torch.nn.Parameter:
        return {KIND: "parameter", "data": value.detach(), "requires_grad": value.requires_grad}
    if t in (collections.OrderedDict, collections.Counter, set):
        items = list(value.items()) if t is not set else [[v, None] for v in value]
        kind = {collections.OrderedDict: "ordereddict", collections.Counter: "counter", set: "set"}[t]
        return {KIND: kind, "items": [[to_plain(k, where), to_plain(v, f"{where}[{k!r}]")] for k, v in items]}
    if t is torch.Size:
        return {KIND: "size", "dims": list(value)}
    if t in (bytes, bytearray):
        return {KIND: t.__name__, "hex": value.hex()}
    if t is complex:
        return {KIND: "complex", "real": value.real, "imag": value.imag}
    if t is torch.device:
        return {KIND: "device", "name": str(value)}
    for kind, cls in _TORCH_NAMED.items():
        if t is cls:
            return {KIND: kind, "name": str(value).split(".", 1)[-1]}
    return _numpy(value)


def _numpy(value: Any) -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if type(value) is np.ndarray and value.dtype.kind in "biufc":
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return {KIND: "numpy", "dtype": value.dtype.str, "value": to_plain(value.item(), "")}
    return None


def from_plain(obj: Any) -> Any:
    """The values :func:`to_plain` stored, as they were."""
    t = type(obj)
    if t is list or t is tuple:
        out = [from_plain(v) for v in obj]
        return out if t is list else tuple(out)
    if t is not dict:
        return obj
    kind = obj.get(KIND) if len(obj) > 1 else None
    if not isinstance(kind, str):
        return {k: from_plain(v) for k, v in obj.items()}
    return _untagged(kind, obj)


def _untagged(kind: str, obj: Dict[str, Any]) -> Any:
    if kind in ("dict", "ordereddict", "counter", "set"):
        pairs = [(_key(from_plain(k)), from_plain(v)) for k, v in obj["items"]]
        if kind == "set":
            return {k for k, _ in pairs}
        if kind == "counter":  # Counter(pairs) would count the pairs
            return collections.Counter(dict(pairs))
        return {"dict": dict, "ordereddict": collections.OrderedDict}[kind](pairs)
    if kind == "parameter":
        return torch.nn.Parameter(obj["data"], requires_grad=obj["requires_grad"])
    if kind == "size":
        return torch.Size(obj["dims"])
    if kind in ("bytes", "bytearray"):
        return (bytes if kind == "bytes" else bytearray).fromhex(obj["hex"])
    if kind == "complex":
        return complex(obj["real"], obj["imag"])
    if kind == "device":
        return torch.device(obj["name"])
    if kind in _TORCH_NAMED:
        found = getattr(torch, obj["name"], None)
        if type(found) is not _TORCH_NAMED[kind]:
            raise CheckpointError(f"this checkpoint names a torch {kind} {obj['name']!r} this torch lacks")
        return found
    if kind == "numpy":
        import numpy as np
        return np.dtype(obj["dtype"]).type(from_plain(obj["value"]))
    return {k: from_plain(v) for k, v in obj.items()}  # a dict of the user's own that has a KIND key


def _key(k: Any) -> Any:
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def plain(value: Any, where: str, warned: Optional[List[str]] = None) -> Any:
    """:func:`to_plain`, under its former name (``warned`` is no longer used: what cannot be kept is refused)."""
    return to_plain(value, where)


def to_extra(checkpoint: Dict[str, Any], has_optimizer: bool) -> Dict[str, Any]:
    """The part of a Lightning checkpoint dict that travels in layerckpt's ``extra``: all but the model
    and, when layerckpt saves it, optimizer 0 (left as a ``None`` placeholder).  Values are kept exactly
    (see :func:`to_plain`); one that would need pickle is refused, naming its key."""
    rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    if has_optimizer:
        rest["optimizer_states"] = [None] + list(rest.get("optimizer_states", [])[1:])
    return {EXTRA_KEY: to_plain(rest, "checkpoint")}


def to_lightning(loaded: LoadedCheckpoint) -> Dict[str, Any]:
    """Rebuild the dict Lightning's checkpoint connector expects from a read layerckpt checkpoint.

    Besides Lightning's own keys it holds :data:`LOADED_KEY`: what was read (step, manifest, the step
    of each layer, staleness, bytes, seconds) and, under ``"rng"``, the checkpoint to restore RNG from.
    """
    rest = loaded.extra.get(EXTRA_KEY)
    if not isinstance(rest, dict):
        raise CheckpointError(
            f"{loaded.manifest} was not written by lightning_layerckpt (no Lightning state in it); "
            f"restore it with layerckpt.restore(dirpath, model, optimizer) instead")
    ckpt = from_plain(rest)
    ckpt["state_dict"] = {**loaded.model_other, **loaded.model}
    opt_states = list(ckpt.get("optimizer_states") or [])
    if opt_states and opt_states[0] is None:
        if loaded.optimizer is None:
            raise CheckpointError(f"{loaded.manifest} lacks the state of optimizer 0")
        opt_states[0] = loaded.optimizer
    if "optimizer_states" in ckpt:
        ckpt["optimizer_states"] = opt_states
    ckpt[LOADED_KEY] = {"step": loaded.step, "manifest": loaded.manifest, "layers": loaded.layers,
                        "staleness": loaded.staleness, "max_staleness": loaded.max_staleness,
                        "bytes_read": loaded.bytes_read, "seconds": loaded.seconds, "rng": loaded}
    return ckpt


def remote_holds_checkpoint(url: str, config: Any) -> bool:
    """Whether ``url`` (a remote store or one of its manifests) holds a committed layerckpt checkpoint."""
    try:
        store.resolve(url, config=config)
        return True
    except Exception:  # noqa: BLE001 - not a layerckpt store (a .ckpt object, nothing there, unreachable)
        return False


class StateModule(torch.nn.Module):
    """A module whose state_dict is a given dict: lets a Checkpointer save a plain state dict."""

    def __init__(self, state: Dict[str, Any]):
        super().__init__()
        self._state = state

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        return dict(self._state)
