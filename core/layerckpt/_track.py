"""Per-layer drift since each layer's last persisted version: ||W - W_p|| / ||W_p||.

Exact for small tensors; for large ones it is estimated on a fixed strided sample
of elements (``Config.drift_sample`` per layer, spread over the layer's tensors by
size), so both its memory (the sample of W_p) and its time are bounded no matter
how big the model is.  The samples are views, and the drift of every layer is
computed in a few batched (``torch._foreach_*``) calls: this runs on the training
thread at every save.  The reference moves only when a save that persisted the
layer commits.
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, List, Optional, Tuple

import torch

Views = List[torch.Tensor]


class DriftTracker:
    def __init__(self, sample_per_layer: int):
        self.sample_per_layer = sample_per_layer
        self._plan: Dict[Tuple[str, int], Optional[Tuple[int, int]]] = {}  # (name, numel) -> (start, stride)
        self._ref: Dict[str, Tuple[Views, float]] = {}  # layer -> (float32 reference samples, squared norm)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for refs, _ in self._ref.values() for t in refs)

    def views(self, layer_tensors: Dict[str, torch.Tensor]) -> Views:
        """The sampled elements of one layer's tensors, as strided views (no copy)."""
        total = sum(t.numel() for t in layer_tensors.values()) or 1
        out = []
        for name, t in layer_tensors.items():
            n = t.numel()
            key = (name, n)
            if key not in self._plan:
                budget = 0 if self.sample_per_layer <= 0 else max(1, self.sample_per_layer * n // total)
                if budget <= 0 or n <= budget:
                    self._plan[key] = None
                else:  # fixed per tensor name, so every checkpoint compares the same elements
                    stride = n // budget
                    self._plan[key] = (zlib.crc32(name.encode()) % stride, stride)
            flat = t.detach().reshape(-1)
            p = self._plan[key]
            out.append(flat if p is None else flat[p[0]::p[1]])
        return out

    @staticmethod
    def snapshot(views: Views) -> Views:
        """Copies of sampled values (float32), to keep as a reference once they are persisted."""
        return [v.to(dtype=torch.float32, copy=True) for v in views]

    def drifts(self, now: Dict[str, Views]) -> Dict[str, float]:
        """Relative drift of every layer against its reference; inf where there is none (or it changed shape)."""
        out = {layer: math.inf for layer in now}
        pairs: Dict[torch.device, Tuple[List[str], Views, Views]] = {}
        for layer, vs in now.items():
            ref = self._ref.get(layer)
            if ref is None or len(ref[0]) != len(vs) or any(r.numel() != v.numel() for r, v in zip(ref[0], vs)):
                continue
            if ref[1] == 0.0:
                continue  # all-zero reference: decided below, per layer
            for r, v in zip(ref[0], vs):
                names, a, b = pairs.setdefault(v.device, ([], [], []))
                names.append(layer)
                a.append(v if v.dtype == torch.float32 else v.float())
                b.append(r if r.device == v.device else r.to(v.device))
        sq: Dict[str, float] = {}
        for names, a, b in pairs.values():
            norms = torch.stack(torch._foreach_norm(torch._foreach_sub(a, b))).double().cpu().tolist()
            for layer, nv in zip(names, norms):
                sq[layer] = sq.get(layer, 0.0) + nv * nv
        for layer, s in sq.items():
            out[layer] = math.sqrt(s / self._ref[layer][1])
        for layer, vs in now.items():  # a zero reference: no drift while it stays zero
            ref = self._ref.get(layer)
            if ref is not None and ref[1] == 0.0 and len(ref[0]) == len(vs):
                out[layer] = 0.0 if all(not bool(v.any()) for v in vs) else math.inf
        return out

    def commit(self, samples: Dict[str, Views]) -> None:
        """The layers in ``samples`` were persisted with these (snapshotted) values."""
        for layer, refs in samples.items():
            norms = torch._foreach_norm(refs) if refs else []
            self._ref[layer] = (refs, float(sum(float(x) ** 2 for x in norms)))

    def reset(self) -> None:
        self._ref.clear()

    def layers(self) -> List[str]:
        return list(self._ref)
