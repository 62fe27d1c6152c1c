"""Track: what each layer has done since it was last persisted, measured on a fixed sample of its elements.

For every layer, at every save, on the training thread:

- ``drift``: ||W - W_p|| / ||W_p|| against the layer's last persisted version W_p
  (what ``Config(threshold=...)`` selects on), on the sample; 0.0 means no sampled
  element moved, which proves nothing about the others: ``_exact`` decides
  whether a layer is unchanged;
- ``moved``: per tensor, whether one of its sampled elements moved (a tensor that
  moved needs no exact check to count as changed);
- ``progress``: the first-order loss decrease the layer contributed over the last
  checkpoint interval, ``-<g, W_now - W_prev>`` with ``g`` the mean of the optimizer's
  gradient average (Adam's ``exp_avg``, SGD's ``momentum_buffer``) at both ends;
- ``cost``: the same summed over every interval since the layer was persisted: the
  first-order loss a composite gives up by holding W_p instead of W.

Where the optimizer keeps no gradient average, squared distances stand in
(``progress = ||W_now - W_prev||^2``, ``cost = ||W - W_p||^2``): still in one unit
across layers, which is all the policy compares.  Where some layers have one and
others not, the others' moves are priced at 0: ``_plan`` writes such state
whenever it changed instead of trusting that price.

Large tensors are estimated on a fixed sample (``Config.drift_sample`` elements
per layer, spread over the layer's tensors by size, the same elements every save,
in runs of a cache line a fixed stride apart: :func:`sample_plan`), scaled up by
each tensor's sampling ratio, so memory and time stay bounded however big the
model is.  Read cold after a training step, a sampled cache line costs the same
whether one element of it is used or sixteen; runs cut the lines a sample reads
sixteenfold, and one native pass copies every layer's runs (``gather_runs``).

References move at *plan*, not at commit: when a save that persists a layer is
planned, :meth:`DriftTracker.commit` makes that save's samples the layer's
reference W_p and restarts its cost from zero, so that a save planned while this
one is still in flight measures against what this one writes.  Should the save
fail, :meth:`DriftTracker.forget` drops those references (the layers count as new).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..io._backend import native_gather

_NATIVE = native_gather()  # gather_runs and segsums, or None

Views = List[torch.Tensor]
Snap = Tuple[Views, Optional[Views], Optional[float]]  # (w, g, signed cost so far) taken at one save


Part = Tuple[torch.Tensor, Optional[Tuple[int, int, int, int]]]  # a contiguous tensor and its sample_plan


class LayerSample:
    """One layer's sampled elements now: each tensor and its :func:`sample_plan` (``parts``), the same of the
    optimizer's gradient averages (``gparts``: None where it keeps none; per tensor, None where that tensor has
    none: zeros), each gradient average's divisor (``gdiv``: the unbiasing of Adam's first steps, or None), and
    each tensor's ratio of elements to samples.  ``w`` and ``g`` are the samples as views (no copy; ``g``
    divided); the tracker copies them all at once from ``parts`` instead where it can (:class:`_Flat`)."""

    __slots__ = ("parts", "gparts", "gdiv", "scale")

    def __init__(self, parts: List[Part], gparts: Optional[List[Optional[Part]]], scale: List[float]):
        self.parts, self.gparts, self.scale = parts, gparts, scale
        self.gdiv: Optional[List[float]] = None

    @property
    def w(self) -> Views:
        return [_view(t, p) for t, p in self.parts]

    @property
    def g(self) -> Optional[Views]:
        if self.gparts is None:
            return None
        out = [_view(*gp) if gp is not None else torch.zeros(_count(t, p), dtype=torch.float32, device=t.device)
               for gp, (t, p) in zip(self.gparts, self.parts)]
        if self.gdiv:
            out = [v / b if b != 1.0 else v for v, b in zip(out, self.gdiv)]
        return out


def _count(t: torch.Tensor, p: Optional[Tuple[int, int, int, int]]) -> int:
    return t.numel() if p is None else p[2] * p[3]


def _view(t: torch.Tensor, p: Optional[Tuple[int, int, int, int]]) -> torch.Tensor:
    """The sampled elements of the contiguous ``t`` as one view: a run of elements every stride-th from start."""
    if p is None:
        return t.reshape(-1)
    start, stride, count, run = p
    return t.as_strided((count, run), (stride, 1), t.storage_offset() + start)


@dataclass
class Measure:
    drift: float  # relative to the persisted version; inf where there is none
    progress: float  # over the last interval (>= 0)
    cost: float  # since the layer was persisted (>= 0); inf where unknown
    #: the sums these come from, which add up over the shards of a layer held by several ranks:
    #: (||W - W_p||^2, ||W_p||^2, signed cost, signed progress); None where the measure is unknown
    parts: Optional[Tuple[float, float, float, float]] = None
    #: per tensor (in the order sampled): whether a sampled element moved, or there is no reference
    moved: Optional[List[bool]] = None


def combine(parts: List[Optional[Tuple[float, float, float, float]]]) -> Measure:
    """One layer's measure from the parts measured on each rank's shard of it (unknown if any is)."""
    if not parts or any(p is None for p in parts):
        return Measure(drift=math.inf, progress=0.0, cost=math.inf)
    sq, ref, cost, step = (sum(p[i] for p in parts) for i in range(4))
    drift = math.sqrt(sq / ref) if ref > 0 else (0.0 if sq == 0 else math.inf)
    return Measure(drift=drift, progress=abs(step), cost=abs(cost), parts=(sq, ref, cost, step))


#: bytes of one run of contiguous sampled elements: a cache line, which the sample reads whole anyway
RUN_BYTES = 64


def sample_plan(name: str, n: int, itemsize: int, per_layer: int, total: int) -> Optional[Tuple[int, int, int, int]]:
    """Which elements of a tensor (``n`` elements of ``itemsize`` bytes, in a layer of ``total`` elements) the
    drift sample reads: ``(start, stride, count, run)``, ``count`` runs of ``run`` contiguous elements, each
    ``stride`` elements after the one before, from ``start``; None: every element.  Its share of the layer's
    ``per_layer`` sampled elements, in runs of a cache line (a run costs the memory traffic of one sampled
    element, so the same number of elements costs a fraction of the strided single ones).  The same for
    every save (``start`` hashed from the name), so every checkpoint compares the same elements."""
    budget = 0 if per_layer <= 0 else max(1, per_layer * n // max(total, 1))
    run = max(1, RUN_BYTES // max(itemsize, 1))
    if budget <= 0 or n <= max(budget, 2 * run):
        return None
    count = max(1, budget // run)
    stride = n // count  # >= run: count * run <= budget < n
    start = zlib.crc32(name.encode()) % (stride - run + 1)
    return start, stride, count, run


def sampled_positions(plan: Optional[Tuple[int, int, int, int]], n: int) -> List[int]:
    """The flat indices a :func:`sample_plan` reads, in order."""
    if plan is None:
        return list(range(n))
    start, stride, count, run = plan
    return [start + i * stride + j for i in range(count) for j in range(run)]


class DriftTracker:
    def __init__(self, sample_per_layer: int):
        self.sample_per_layer = sample_per_layer
        #: (name, numel, itemsize) -> its :func:`sample_plan`
        self._plan: Dict[Tuple[str, int, int], Optional[Tuple[int, int, int, int]]] = {}
        self._ref: Dict[str, Tuple[Views, float]] = {}  # layer -> (float32 samples persisted, squared norm)
        self._prev: Dict[str, Tuple[Views, Optional[Views]]] = {}  # layer -> (w, g) float32 at the last save
        self._cost: Dict[str, float] = {}  # layer -> signed cost accumulated up to the last save
        self._prev_flat: Optional[_Flat] = None  # the last save's snapshots, where taken in one buffer

    @property
    def memory_bytes(self) -> int:
        """Bytes of the memory the samples held live in (a buffer shared by several layers counted once)."""
        held = [t for refs, _ in self._ref.values() for t in refs]
        held += [t for w, g in self._prev.values() for t in w + (g or [])]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        return sum(storages.values())

    def _part(self, name: str, t: torch.Tensor, total: int) -> Part:
        n = t.numel()
        key = (name, n, t.element_size())
        p = self._plan.get(key, False)
        if p is False:
            p = self._plan[key] = sample_plan(name, n, t.element_size(), self.sample_per_layer, total)
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.reshape(-1)
        return t, p

    def sample(self, weights: Dict[str, torch.Tensor], grads: Dict[str, torch.Tensor]) -> LayerSample:
        """Which elements of a layer's weights are sampled, and, at the same elements, of their gradient
        averages (None where the optimizer keeps none); nothing is copied yet."""
        total = sum(t.numel() for t in weights.values())
        parts = [self._part(n, t, total) for n, t in weights.items()]
        scale = [t.numel() / max(_count(t, p), 1) for t, p in parts]
        gparts: Optional[List[Optional[Part]]] = None
        if grads:
            gparts = []
            for n, t in weights.items():
                gt = grads.get(n)
                gparts.append(self._part(n, gt, total) if gt is not None and gt.shape == t.shape else None)
        return LayerSample(parts, gparts, scale)

    @staticmethod
    def snapshot(views: Views) -> Views:
        """Copies of sampled values (float32), to keep once the save that took them is planned."""
        return [v.to(dtype=torch.float32, copy=True).reshape(-1) for v in views]

    def drifts(self, now: Dict[str, Views]) -> Tuple[Dict[str, float], Dict[str, float], Dict[str, List[bool]]]:
        """Relative drift of every layer against its reference (inf where there is none, or it changed
        shape), the squared distance it comes from, and per tensor whether a sampled element moved."""
        out = {layer: math.inf for layer in now}
        moved = {layer: [True] * len(vs) for layer, vs in now.items()}
        pairs: Dict[torch.device, Tuple[List[Tuple[str, int]], Views, Views]] = {}
        for layer, vs in now.items():
            ref = self._ref.get(layer)
            if ref is None or not _same_shapes(ref[0], vs):
                continue
            if ref[1] == 0.0:
                continue  # all-zero reference: decided below, per layer
            for i, (r, v) in enumerate(zip(ref[0], vs)):
                names, a, b = pairs.setdefault(v.device, ([], [], []))
                names.append((layer, i))
                a.append(v if v.dtype == torch.float32 else v.float())
                b.append(r if r.device == v.device else r.to(v.device))
        sq: Dict[str, float] = {}
        for names, a, b in pairs.values():
            for (layer, i), d in zip(names, _squares(a, b)):
                sq[layer] = sq.get(layer, 0.0) + d
                moved[layer][i] = d != 0.0
        for layer, s in sq.items():
            out[layer] = math.sqrt(s / self._ref[layer][1])
        for layer, vs in now.items():  # a zero reference: no drift while it stays zero
            ref = self._ref.get(layer)
            if ref is not None and ref[1] == 0.0 and _same_shapes(ref[0], vs):
                moved[layer] = [bool(v.any()) for v in vs]
                out[layer] = math.inf if any(moved[layer]) else 0.0
                sq[layer] = 0.0 if out[layer] == 0.0 else float(sum(float(v.float().square().sum()) for v in vs))
        return out, sq, moved

    def measure(self, now: Dict[str, LayerSample]) -> Tuple[Dict[str, Measure], "Snaps"]:
        """Drift, progress and cost of every layer; plus the float32 snapshots this save leaves behind
        (hand them to :meth:`advance` once the decision is taken).  The snapshots of every layer are taken
        in one copy (:class:`_Flat`); where the save before took its snapshots in the same arrangement, each
        layer's progress comes from a few operations over all of them at once.  The sampled elements are read
        from the tensors once, by that copy: the drifts are measured on the snapshots (strided reads of a large
        model's samples cost a cache line each, the contiguous copies a fraction of it)."""
        use_grad = any(s.gparts is not None for s in now.values())
        out: Dict[str, Measure] = {}
        flat = _Flat.of(now)
        snaps = Snaps()
        snaps.flat = flat
        for layer, s in now.items():
            w, g = flat.views(layer, s) if flat is not None else (
                self.snapshot(s.w), self.snapshot(s.g) if s.gparts is not None else None)
            snaps[layer] = (w, g, None)
        drift, sq, moved = self.drifts({layer: snap[0] for layer, snap in snaps.items()})
        fast = _steps(self._prev_flat, flat, now) if use_grad else None
        for layer, s in now.items():
            w, g, _ = snaps[layer]
            prev = self._prev.get(layer)
            ref = self._ref.get(layer)
            if prev is None or ref is None or not _same_shapes(prev[0], w) or not _same_shapes(ref[0], w):
                out[layer] = Measure(drift=drift[layer], progress=0.0, cost=math.inf, moved=moved[layer])
                continue
            if use_grad:
                step = -(fast[layer] if fast is not None else _scaled_dot(_mean(prev[1], g), _sub(w, prev[0]), s.scale))
                cost = self._cost.get(layer, 0.0) + step
                snaps[layer] = (w, g, cost)
            else:
                d = _sub(w, prev[0])
                u = _sub(w, ref[0])
                step, cost = _scaled_dot(d, d, s.scale), _scaled_dot(u, u, s.scale)
            out[layer] = Measure(drift=drift[layer], progress=abs(step), cost=abs(cost),
                                 parts=(sq.get(layer, math.inf), ref[1], cost, step), moved=moved[layer])
        return out, snaps

    def moves(self, snaps: Dict[str, "Snap"]) -> Dict[str, List[Optional[float]]]:
        """Per layer, per tensor (in the order sampled): the RMS of what its sampled elements moved since the save
        before (that save's snapshot; None where there is none, or the tensor changed shape).  Call before
        :meth:`advance`."""
        names: List[Tuple[str, int, int]] = []
        a: Views = []
        b: Views = []
        for layer, (w, _, _) in snaps.items():
            prev = self._prev.get(layer)
            if prev is None or not _same_shapes(prev[0], w):
                continue
            for i, (x, y) in enumerate(zip(w, prev[0])):
                if x.numel():
                    names.append((layer, i, x.numel()))
                    a.append(x if x.dtype == torch.float32 else x.float())
                    b.append(y if y.device == x.device else y.to(x.device))
        out: Dict[str, List[Optional[float]]] = {}
        for (layer, i, n), s in zip(names, _squares(a, b)):
            out.setdefault(layer, [None] * len(snaps[layer][0]))[i] = math.sqrt(s / n)
        return out

    def advance(self, snaps: Dict[str, "Snap"]) -> None:
        """This save's samples become the start of the next interval; a layer's cost carries on until a save
        that persists it is planned (:meth:`commit`)."""
        # the next measure's progress runs over the whole arrangement at once where every layer advanced
        self._prev_flat = getattr(snaps, "flat", None)
        for layer, (w, g, cost) in snaps.items():
            self._prev[layer] = (w, g)
            if cost is not None:
                self._cost[layer] = cost

    def commit(self, samples: Dict[str, Views]) -> None:
        """A save that persists the layers in ``samples`` is planned (or, from ``Selector.adopt``, they stand at
        their persisted versions): these snapshotted values become their references and their costs restart
        from zero, now, before that save commits (:meth:`forget` undoes it if the save fails)."""
        # one copy of them all: not views of the save's snapshot buffer, which holds every layer's samples
        every = _own([r for refs in samples.values() for r in refs])
        at, owned = 0, {}
        for layer, refs in samples.items():
            owned[layer] = every[at:at + len(refs)]
            at += len(refs)
        squares = iter(_squares(every, None))
        for layer, refs in owned.items():
            self._ref[layer] = (refs, float(sum(next(squares) for _ in refs)))
            self._cost[layer] = 0.0


    def forget(self, layers) -> None:
        """These layers' references are gone (the save that persisted them failed): they count as new."""
        for layer in layers:
            self._ref.pop(layer, None)
            self._cost.pop(layer, None)


class Snaps(dict):
    """layer -> :data:`Snap`, and the :class:`_Flat` buffer the snapshots are views of (None where they are
    copies of their own)."""

    flat: "Optional[_Flat]" = None


class _Flat:
    """One save's sampled values of every layer, copied into one float32 buffer (and those of the gradient
    averages into a second, zeros where a layer or tensor has none), instead of a copy per tensor.  ``sig``
    names the arrangement: the layers in order, each one's tensor sizes and whether it has gradient averages."""

    __slots__ = ("sig", "w", "g", "lens", "owner", "at", "_views", "_gviews")

    @classmethod
    def of(cls, now: Dict[str, LayerSample]) -> "Optional[_Flat]":
        parts = [tp for s in now.values() for tp in s.parts]
        gparts = [gp for s in now.values() for gp in (s.gparts if s.gparts is not None else [None] * len(s.parts))]
        if not parts or len({t.device for t, _ in parts} | {gp[0].device for gp in gparts if gp is not None}) != 1:
            return None
        self = cls()
        self.sig = tuple((layer, tuple(_count(*tp) for tp in s.parts), s.gparts is not None)
                         for layer, s in now.items())
        self.lens = [_count(*tp) for tp in parts]
        self.owner = [i for i, s in enumerate(now.values()) for _ in s.parts]
        self.at, i = {}, 0  # layer -> index of its first tensor
        for layer, s in now.items():
            self.at[layer] = i
            i += len(s.parts)
        self.g = self._gviews = None
        use_grad = any(s.gparts is not None for s in now.values())
        divs = [d for s in now.values() for d in (s.gdiv or [1.0] * len(s.parts))]
        if _NATIVE is not None and all(_plain(t) for t, _ in parts) and all(
                _plain(gp[0]) for gp in gparts if gp is not None):
            # one native pass over every sampled run, the gradient averages divided on the way
            self.w = _native_gather(parts, [1.0] * len(parts), self.lens)
            if use_grad:
                self.g = _native_gather(gparts, divs, self.lens)
        else:
            self.w = _gather32([_view(*tp) for tp in parts], self.lens)
            if use_grad:
                gs = [g for s in now.values() for g in (s.g if s.gparts is not None else [
                    torch.zeros(_count(*tp), dtype=torch.float32, device=tp[0].device) for tp in s.parts])]
                self.g = _gather32(gs, self.lens)
        self._views = list(self.w.split(self.lens)) if self.lens else []
        if self.g is not None:
            self._gviews = list(self.g.split(self.lens))
        return self

    def views(self, layer: str, s: LayerSample) -> Tuple[Views, Optional[Views]]:
        """A layer's snapshots: views of the buffers, in its tensors' order."""
        at, n = self.at[layer], len(s.parts)
        return self._views[at:at + n], (self._gviews[at:at + n] if s.gparts is not None else None)


def _steps(prev: Optional[_Flat], now: Optional[_Flat], samples: Dict[str, LayerSample]) -> Optional[Dict[str, float]]:
    """Each layer's first-order progress over the last interval, ``<mean of the gradient averages, W_now -
    W_prev>`` scaled by each tensor's sampling ratio, computed over every layer at once; None unless the last
    save's snapshots are in the same arrangement (then each layer is measured on its own)."""
    if prev is None or now is None or prev.sig != now.sig or now.g is None or prev.g is None:
        return None
    if _NATIVE is not None and all(_plain(t) for t in (now.w, prev.w, now.g, prev.g)):
        specs, at = [], 0
        for n in now.lens:
            specs.append((now.w.data_ptr() + 4 * at, prev.w.data_ptr() + 4 * at, now.g.data_ptr() + 4 * at,
                          prev.g.data_ptr() + 4 * at, n))
            at += n
        dots = _NATIVE.segsums(specs)
    else:
        prod = (now.g + prev.g).mul_(0.5).mul_(now.w - prev.w)
        dots = torch.segment_reduce(prod, "sum", lengths=torch.tensor(now.lens, device=prod.device)).double().cpu().tolist()
    scale = [x for s in samples.values() for x in s.scale]
    layers = [name for name, _, _ in now.sig]
    out = {name: 0.0 for name in layers}
    for owner, d, sc in zip(now.owner, dots, scale):
        out[layers[owner]] += d * sc
    return out


def _native_gather(parts: List[Optional[Part]], divs: List[float], lens: List[int]) -> torch.Tensor:
    """:func:`_gather32` of contiguous fp32 CPU tensors in one native call (None parts: zeros)."""
    out = torch.empty(sum(lens), dtype=torch.float32)
    runs = []
    for tp, d, n in zip(parts, divs, lens):
        if tp is None:
            runs.append((0, 0, n, 1, n, 1.0))
            continue
        t, p = tp
        runs.append((t.data_ptr(), 0, n, 1, n, d) if p is None else (t.data_ptr(), p[0], p[1], p[2], p[3], d))
    if runs:
        _NATIVE.gather_runs(out.numpy(), runs)
    return out


def _gather32(views: Views, lens: List[int]) -> torch.Tensor:
    """The sampled elements of ``views`` (each ``lens[i]`` of them), copied into one float32 buffer in one pass."""
    out = torch.empty(sum(lens), dtype=torch.float32, device=views[0].device)
    at = 0
    for v, n in zip(views, lens):
        out[at:at + n].view(v.shape).copy_(v)
        at += n
    return out


def _own(refs: Views) -> Views:
    """Copies of ``refs`` in one buffer of their own."""
    if not refs:
        return refs
    if len({r.device for r in refs}) != 1:
        return [r.clone() for r in refs]
    return list(torch.cat([r.reshape(-1) for r in refs]).split([r.numel() for r in refs]))


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _squares(a: Views, b: Optional[Views]) -> List[float]:
    """``sum((a[i] - b[i])^2)`` for each pair of equally long tensors (``b`` None: ``sum(a[i]^2)``), in double: one
    native pass where every tensor is a contiguous fp32 CPU one (a pair's sum is 0 exactly where the two are
    equal), else torch's norms, squared."""
    if not a:
        return []
    if _NATIVE is not None and all(_plain(t) for t in a) and (b is None or all(_plain(t) for t in b)):
        return _NATIVE.segsums([(x.data_ptr(), 0 if b is None else b[i].data_ptr(), 0, 0, x.numel())
                                for i, x in enumerate(a)])
    d = a if b is None else torch._foreach_sub(a, b)
    return [n * n for n in torch.stack(torch._foreach_norm(d)).double().cpu().tolist()]


def _same_shapes(a: Views, b: Views) -> bool:
    return len(a) == len(b) and all(x.numel() == y.numel() for x, y in zip(a, b))


def _sub(a: Views, b: Views) -> Views:
    return torch._foreach_sub(a, b) if a else []


def _mean(a: Optional[Views], b: Optional[Views]) -> Views:
    if a is None or b is None:
        return b or a or []
    return torch._foreach_mul(torch._foreach_add(a, b), 0.5)


def _scaled_dot(a: Views, b: Views, scale: List[float]) -> float:
    if not a or not b:
        return 0.0
    dots = [torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)]
    return float(sum(float(d) * s for d, s in zip(torch.stack(dots).double().tolist(), scale)))
