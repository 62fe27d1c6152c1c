"""Layers: the unit of selection.

By default each child of a ``ModuleList``/``Sequential`` of blocks is a layer,
and every other tensor belongs to the layer of the module that owns it
(embeddings, final norm, head).  Tied tensors are named once (the model's first
name) and so belong to one layer only.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Union

import torch

LayerSpec = Union[None, Callable[[str], str], Dict[str, str]]


def _container_paths(model: torch.nn.Module) -> set:
    return {name for name, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))}


def layer_of(name: str, containers: set) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1):
        prefix = ".".join(parts[:i]) if i else ""
        if prefix in containers and i < len(parts) - 1:
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) if len(parts) > 1 else parts[0]


def group_layers(model: torch.nn.Module, names: Iterable[str], spec: LayerSpec = None) -> Dict[str, List[str]]:
    """Map layer name -> the tensor names (state_dict names) in it, in the given order."""
    containers = _container_paths(model)
    if isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)):
        containers.add("")
    out: Dict[str, List[str]] = {}
    for n in names:
        layer: Optional[str] = None
        if callable(spec):
            layer = spec(n)
        elif isinstance(spec, dict):
            import fnmatch

            layer = next((lay for pat, lay in spec.items() if fnmatch.fnmatchcase(n, pat)), None)
        out.setdefault(layer or layer_of(n, containers), []).append(n)
    return out
