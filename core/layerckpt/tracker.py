"""Per-layer drift since each layer's last persisted version: ||W - W_p|| / ||W_p||.

Exact for small tensors; for large ones it is estimated on a fixed random sample
of elements (``Config.drift_sample`` per layer), so both its memory (the sample
of W_p) and its time (one gather per tensor per checkpoint) are bounded no
matter how big the model is.  The reference moves only when a save that
persisted the layer commits.
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, List, Optional

import torch



class DriftTracker:
    def __init__(self, sample_per_layer: int):
        self.sample_per_layer = sample_per_layer
        self._index: Dict[str, Optional[torch.Tensor]] = {}  # tensor name -> sampled flat indices (None: all)
        self._ref: Dict[str, torch.Tensor] = {}  # layer -> sampled reference values

    @property
    def memory_bytes(self) -> int:
        n = sum(i.numel() * i.element_size() for i in self._index.values() if i is not None)
        return n + sum(v.numel() * v.element_size() for v in self._ref.values())

    def _indices(self, name: str, t: torch.Tensor, budget: int) -> Optional[torch.Tensor]:
        if name not in self._index:
            n = t.numel()
            if budget <= 0 or n <= budget:
                self._index[name] = None
            else:  # fixed per tensor name, so every checkpoint compares the same elements
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                self._index[name] = torch.randint(0, n, (budget,), generator=g).sort().values  # gathers in order
        return self._index[name]

    def sample(self, layer_tensors: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The sampled values of one layer's tensors now: one flat float32 vector on the CPU."""
        total = sum(t.numel() for t in layer_tensors.values()) or 1
        parts = []
        for name, t in layer_tensors.items():
            budget = 0 if self.sample_per_layer <= 0 else max(1, self.sample_per_layer * t.numel() // total)
            idx = self._indices(name, t, budget)
            flat = t.detach().reshape(-1)
            if idx is not None:
                flat = flat[idx.to(flat.device) if flat.is_cuda else idx]
            parts.append(flat.to(dtype=torch.float32))
        out = torch.cat(parts) if len(parts) > 1 else parts[0].clone() if parts else torch.empty(0)
        return out.cpu()

    def drift(self, layer: str, now: torch.Tensor) -> float:
        """Relative drift of a sampled layer against its reference; inf when there is none yet."""
        ref = self._ref.get(layer)
        if ref is None or ref.shape != now.shape:
            return math.inf
        den = float(torch.dot(ref, ref))
        num = float(torch.dot(now - ref, now - ref))
        if den == 0.0:
            return 0.0 if num == 0.0 else math.inf
        return math.sqrt(num / den)

    def commit(self, samples: Dict[str, torch.Tensor]) -> None:
        """The layers in ``samples`` were persisted with these values."""
        self._ref.update(samples)

    def reset(self) -> None:
        self._ref.clear()

    def layers(self) -> List[str]:
        return list(self._ref)
