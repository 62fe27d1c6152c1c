"""Lightning's checkpoint dict <-> what a layerckpt store holds (model, optimizer 0, ``extra``).

A Lightning checkpoint dict is ``state_dict`` (the model), ``optimizer_states`` and everything
else the Trainer keeps (loops, schedulers, callbacks, hyper-parameters, ...).  layerckpt saves the
model and the first optimizer layer-selectively; the rest travels in the manifest's ``extra``
under :data:`EXTRA_KEY`, made JSON-safe first, since layerckpt stores no pickles.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List

import torch
from typing_extensions import override

from layerckpt import LoadedCheckpoint, store
from layerckpt.errors import CheckpointError

#: Layerckpt's part of a loaded checkpoint dict: the RNG states, the report.
LOADED_KEY = "layerckpt"
#: The Lightning checkpoint dict, minus the model and optimizer 0, inside ``extra``.
EXTRA_KEY = "lightning"


def plain(value: Any, where: str, warned: List[str]) -> Any:
    """A copy of ``value`` that layerckpt's JSON codec takes: tensors and plain values stay, a few common
    types become plain values, anything else (which only pickle could keep) becomes its repr, with a warning."""
    import argparse
    import enum
    import pathlib

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    try:
        import numpy as np
        if isinstance(value, (np.ndarray, np.generic)):
            return value
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, dict):
        return {k: plain(v, f"{where}[{k!r}]", warned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [plain(v, f"{where}[{i}]", warned) for i, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, argparse.Namespace):
        return plain(vars(value), where, warned)
    if isinstance(value, enum.Enum):
        return plain(value.value, where, warned)
    if isinstance(value, (pathlib.PurePath, torch.device, torch.dtype)):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    try:  # omegaconf containers, if the user has them
        from omegaconf import Container, OmegaConf
        if isinstance(value, Container):
            return plain(OmegaConf.to_container(value, resolve=True), where, warned)
    except ImportError:
        pass
    warned.append(f"{where} ({type(value).__qualname__})")
    return repr(value)


def to_extra(checkpoint: Dict[str, Any], has_optimizer: bool) -> Dict[str, Any]:
    """The part of a Lightning checkpoint dict that travels in layerckpt's ``extra``: all but the model
    and, when layerckpt saves it, optimizer 0 (left as a ``None`` placeholder)."""
    rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    if has_optimizer:
        rest["optimizer_states"] = [None] + list(rest.get("optimizer_states", [])[1:])
    warned: List[str] = []
    rest = plain(rest, "checkpoint", warned)
    if warned:
        warnings.warn("layerckpt stores no pickles: these checkpoint entries were saved as their repr and will "
                      "come back as strings: " + ", ".join(warned[:8]) + (" ..." if len(warned) > 8 else ""),
                      stacklevel=3)
    return {EXTRA_KEY: rest}


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
    ckpt = dict(rest)
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
