"""Plan one save: measure each layer's drift, ask the policy what to persist, compose the layer map.

A manifest is a *composite*: for every layer it names the step and file of the
layer's newest persisted version, carrying forward the entries of layers that
this save skips.  A layer's weights and its optimizer state always travel
together, so they always come from the same step.

The drift sample can show that a layer moved, never that it did not: a layer
the sample calls still is fingerprinted on every byte (``_exact``) and counts
as unchanged, exempt from ``max_staleness``, only where every tensor matches its
persisted version; anything else is changed.  Under the fidelity rule a layer
the tracker cannot price (no gradient average for any of its tensors) is
written at every save where it changed.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple, Union

import torch

from . import _policy as policy
from ..format._codec import Entries
from ._exact import Fingerprint, Fingerprints, fingerprints
from ._layers import LayerSpec, group_layers
from ..format._layout import CODES, DTYPES, ITEMSIZE
from ..format._manifest import (ROWS, Boxes, FileEntry, LayerEntry, Manifest, PretrainedEntry, RowBlocks, TensorEntry,
                                is_rng, model_name, param_of, piece_base, shard_pieces)
from ..format._places import pretrained_seal
from ..io._backend import CHECKSUM, checksum_function
from .._dist import Group
from ._track import DriftTracker, LayerSample, Measure, Views, combine
from ..config import REMOTE_BASES, Config
from ..errors import CheckpointError

NEW = "new"  # the layer's tensors changed since the last composite (added, reshaped, new optimizer state)
FROZEN_PART = "[frozen]"
GRAD_AVERAGE = ("exp_avg", "momentum_buffer")  # optimizer state that estimates the gradient (Adam*, SGD)


@dataclass
class SavePlan:
    """What one save persists and why: the hand-off from planning to staging and commit."""
    write: Entries  # (key, tensor) this rank writes
    layers: Dict[str, LayerEntry]  # the composite's layer map after this save
    carried: Dict[str, TensorEntry]  # tensors of skipped layers, still in older files
    files: Dict[str, FileEntry]  # the older files they are in
    persisted: Set[str]  # layers this save writes (on some rank)
    chain: int  # saves since the chain's first
    samples: Dict[str, Views] = field(default_factory=dict)  # the persisted layers' drift references, from its plan
    cost: float = 0.0  # the composite's estimated fidelity cost (first-order loss of its stale layers)
    progress: float = 0.0  # the model's first-order progress over the last interval, in the same unit
    #: this save's identity while in flight, and the layers whose tensors it carries from saves still in
    #: flight when it was planned (layer -> that save's token): known once those commit (``Selector.resolve``)
    token: object = field(default_factory=object)
    deferred: Dict[str, object] = field(default_factory=dict)
    shapes: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = field(default_factory=dict)  # of every tensor saved
    step: int = 0  # the save's
    #: ``Config(encoding='lossy')``: per weight key, the RMS by which one training step moved it over the last
    #: interval (between the save before and this one), measured on the tracker's sample; a bounded-loss
    #: delta's quantum is a fraction of it where it exceeds the move per step since the reference
    moves: Dict[str, float] = field(default_factory=dict)
    #: the model tensors the composite holds by reference to the pretrained files after this save (``Config.
    #: pretrained``): those its layers carry, and those of the layers it persists that it proved the files hold
    pretrained: Dict[str, PretrainedEntry] = field(default_factory=dict)

    @property
    def reasons(self) -> Dict[str, str]:
        return {name: e.reason for name, e in self.layers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the layers this save persists, over every rank."""
        return sum(self.layers[n].nbytes for n in self.persisted)


def assign(layers, nbytes: Dict[str, int], world: int) -> Dict[str, int]:
    """Each layer to one rank, biggest first onto the least loaded: every rank writes about 1/world
    of the bytes.  Deterministic, so every rank computes the same answer without talking."""
    load = [0] * world
    out = {}
    for layer in sorted(layers, key=lambda n: (-nbytes.get(n, 0), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[layer] = r
        load[r] += nbytes.get(layer, 0)
    return out


def _mine(key: str, layer: Optional[str], persist, owner_rank: Dict[str, int], rank: int,
          sharded: Set[str], shard_keys: Set[str]) -> bool:
    if layer is not None:
        if layer not in persist:
            return False
        if layer in sharded:  # every rank its own shards; the layer's unsharded tensors (a step count) once
            return key in shard_keys or rank == 0
        return owner_rank[layer] == rank
    if is_rng(key):
        return True  # every rank's own RNG keys (distinct names)
    return rank == 0  # extra, param_groups, non-tensor model state: once


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def _compose(prev, layer_keys: Dict[str, List[str]], states: Dict[str, policy.LayerState], reasons: Dict[str, str],
             persist: Set[str], owner_rank: Dict[str, int], nbytes: Dict[str, int], step: int, fname: Optional[str]
             ) -> Tuple[Dict[str, LayerEntry], Dict[str, TensorEntry], Dict[str, object], Dict[str, PretrainedEntry]]:
    """The composite's layer map after this save: a persisted layer's new entry (in ``fname``), a skipped
    layer's entry carried forward from ``prev``.  Returns it, the tensors carried from committed files, the
    layers carried from a save still in flight (layer -> that save's token), and the skipped layers' tensors
    held by reference to the pretrained files (known at once: they lie in no file)."""
    layers: Dict[str, LayerEntry] = {}
    carried: Dict[str, TensorEntry] = {}
    deferred: Dict[str, object] = {}
    pretrained: Dict[str, PretrainedEntry] = {}
    pending = prev if isinstance(prev, SavePlan) else None
    for layer, keys in layer_keys.items():
        st = states[layer]
        info = dict(reason=reasons[layer], drift=_finite(st.drift), frozen=st.frozen,
                    cost=0.0 if layer in persist else _finite(st.cost),
                    unchanged=st.unchanged and layer not in persist)
        if layer in persist:
            layers[layer] = LayerEntry(step=step, file=fname, rank=owner_rank.get(layer, 0),
                                       age=0, tensors=keys, nbytes=nbytes[layer], **info)
            continue
        before = prev.layers[layer]
        layers[layer] = dataclasses.replace(before, age=before.age + 1, **info)
        refs = (pending.pretrained if pending is not None else prev.pretrained) or {}
        pretrained.update({k: refs[k] for k in before.tensors if k in refs})
        if pending is not None and layer in pending.persisted:  # written by a save still in flight
            deferred[layer] = pending.token
        elif pending is not None and layer in pending.deferred:
            deferred[layer] = pending.deferred[layer]
        else:
            known = pending.carried if pending is not None else prev.tensors
            carried.update({k: known[k] for k in before.tensors if k not in refs})
    return layers, carried, deferred, pretrained


class Selector:
    def __init__(self, model: torch.nn.Module, config: Config, layers: LayerSpec = None,
                 group: Optional[Group] = None):
        self.model = model
        self.group = group if group is not None else Group(enabled=False)
        self._shards: Dict[str, Union[RowBlocks, Boxes]] = {}
        self._shard_pieces: List[Tuple[str, str, List[int]]] = []
        self.config = config
        self.spec = layers if layers is not None else config.layers
        self.tracker = DriftTracker(config.drift_sample)
        self.fingerprints = Fingerprints()  # of the tensors' persisted versions, where taken (see _exact)
        self.composite: Optional[Manifest] = None  # the last committed manifest of this Checkpointer
        #: the newest save planned and not yet committed (one process only): the next plan builds on it, so
        #: selective saves may be in flight together (Config.max_inflight)
        self._planned: Optional[SavePlan] = None
        self._committed: Dict[object, Manifest] = {}  # token -> manifest, of the few newest commits
        self._lock = threading.Lock()
        self._owner: Optional[Tuple[tuple, Dict[str, str], frozenset]] = None  # (sig, owner, frozen layers)
        self._keys: Optional[Tuple[tuple, Dict[str, str], Dict[str, List[str]]]] = None
        #: each parameter's requires_grad by name, as the save's gather found it (None: read from the model)
        self.requires_grad: Optional[Dict[str, bool]] = None
        #: each parameter's ``1 - beta1^step`` where its gradient average is Adam's exp_avg and that is below
        #: 0.9999, as the save's gather found it (``_gather.grad_bias``)
        self.grad_bias: Dict[str, float] = {}
        self._generation = 0  # counts the recomputations of the maps below: what is derived from them keys on it
        self._names: Dict[tuple, Tuple[str, ...]] = {}  # entry keys -> the model parameter names among them
        #: (entry keys, layers) -> per entry: (layer, counted in the layer's bytes, weight name, gradient
        #: average's parameter name): what ``_by_layer`` works out of the keys alone, kept while they repeat
        self._roles: Optional[Tuple[tuple, list]] = None
        self._prev_shapes: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
        #: ``Config.pretrained``'s files (``read/_pretrained.PretrainedFiles``, opened by the Checkpointer): where
        #: set, a frozen tensor they hold bit for bit is recorded by reference instead of written (one process)
        self.pretrained = None

    @property
    def shards(self) -> Dict[str, Union[RowBlocks, Boxes]]:
        """Tensors sharded over the ranks (DTensors), as row blocks or boxes: every rank's pieces, by key (set
        per save)."""
        return self._shards

    @shards.setter
    def shards(self, shards: Dict[str, Union[RowBlocks, Boxes]]) -> None:
        self._shards = shards
        #: (tensor key, piece key, piece sizes) of every rank's pieces of every sharded tensor
        self._shard_pieces = [(key, pk, s) for key, rec in shards.items() for pk, _, s in shard_pieces(rec, key)]

    @property
    def full(self) -> bool:
        """Every layer at every save: no save depends on the one before."""
        return self.config.full

    def owners(self, names: Tuple[str, ...]) -> Dict[str, str]:
        """Each state_dict name's layer.  With the automatic grouping, a layer's frozen parameters (adapters
        on a frozen base, a partly frozen block) form a layer of their own, ``<layer>[frozen]``, written
        once and then only if they change, so the trainable rest can be written without them."""
        grad = self.requires_grad if self.requires_grad is not None else {
            n: p.requires_grad for n, p in self.model.named_parameters()}
        frozen = frozenset(n for n, g in grad.items() if not g)
        sig = (names, frozen)
        if self._owner is None or self._owner[0] != sig:
            owner: Dict[str, str] = {}
            for layer, members in group_layers(self.model, names, self.spec).items():
                split = self.spec is None and any(n in frozen for n in members) and any(
                    n not in frozen for n in members)
                for n in members:
                    owner[n] = layer + FROZEN_PART if split and n in frozen else layer
            trainable: Dict[str, bool] = {}
            for n, g in grad.items():
                if n in owner:
                    trainable[owner[n]] = trainable.get(owner[n], False) or g
            self._owner = (sig, owner, frozenset(layer for layer, t in trainable.items() if not t))
            self._generation += 1  # what was worked out of the old map is stale (ids of dicts may be reused)
        return self._owner[1]

    @property
    def _frozen(self) -> frozenset:
        """The layers whose parameters all have requires_grad off (none before :meth:`owners` first ran)."""
        return self._owner[2] if self._owner is not None else frozenset()

    def _key_layers(self, keys: Tuple[str, ...]) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
        """Each entry key's layer, and each layer's keys (cached while the keys and layers stay the same).
        A row block of an embedding table is a layer of its own, ``<layer>#rows=<a>:<b>``; the shards of a
        sharded tensor belong to its layer."""
        names = self._names.get(keys)
        if names is None:
            if len(self._names) > 8:
                self._names.clear()
            names = self._names[keys] = tuple(dict.fromkeys(
                n for n in (model_name(piece_base(k)[0]) for k in keys) if n is not None))
        owner = self.owners(names)
        if self._keys is None or self._keys[0] != (keys, self._generation):
            split = [piece_base(k) for k in keys]
            key_layer: Dict[str, str] = {}
            layer_keys: Dict[str, List[str]] = {}
            for k, (base, piece) in zip(keys, split):
                p = param_of(base)
                layer = owner.get(p) if p is not None else None
                if layer is not None:
                    # a row block of a table is a layer of its own; a rank's shard is part of its layer
                    layer = layer if not piece or base in self._shards else layer + piece
                    key_layer[k] = layer
                    layer_keys.setdefault(layer, []).append(k)
            self._generation += 1
            self._keys = ((keys, self._generation), key_layer, layer_keys)
        return self._keys[1], self._keys[2]

    def _by_layer(self, entries: Entries):
        """(key -> layer, layer -> keys, layer -> {name: weight}, layer -> {name: gradient average}, layer -> bytes,
        layer -> {key: (tensor, its weight name or None)} of the tensors this rank holds).
        A row block's weight and gradient average are named ``<parameter>#rows=<a>:<b>``."""
        local = tuple(k for k, _ in entries)
        have = set(local)
        # every rank sees the same layers, with the same keys: the other ranks' shards too
        key_layer, layer_keys = self._key_layers(local + tuple(pk for _, pk, _ in self._shard_pieces
                                                               if pk not in have))
        weights: Dict[str, Dict[str, torch.Tensor]] = {}
        grads: Dict[str, Dict[str, torch.Tensor]] = {}
        nbytes: Dict[str, int] = {}
        held: Dict[str, Dict[str, Tuple[torch.Tensor, Optional[str]]]] = {}
        for key, pk, sizes in self._shard_pieces:  # a sharded layer's bytes are every rank's shards
            if pk in key_layer:
                nbytes[key_layer[pk]] = nbytes.get(key_layer[pk], 0) + math.prod(sizes) * ITEMSIZE[
                    self._shards[key].dtype]
        for (k, t), (layer, counted, name, gname) in zip(entries, self._entry_roles(local, key_layer)):
            if layer is None:
                continue
            if counted:
                nbytes[layer] = nbytes.get(layer, 0) + t.numel() * t.element_size()
            if name is not None:
                weights.setdefault(layer, {})[name] = t
            elif gname is not None:
                grads.setdefault(layer, {})[gname] = t
            held.setdefault(layer, {})[k] = (t, name)
        return key_layer, layer_keys, weights, grads, nbytes, held

    def _entry_roles(self, local: tuple, key_layer: Dict[str, str]) -> list:
        """Per entry key: (its layer or None, whether its bytes count in the layer's (not a shard of a tensor
        sharded over the ranks), its weight name (``<parameter>`` or ``<parameter>#rows=<a>:<b>``) or None, the
        parameter name of a gradient average it is, or None); the same while the keys and layers are."""
        sig = (local, self._keys[0][1], frozenset(self._shards))
        if self._roles is None or self._roles[0] != sig:
            roles = []
            for k in local:
                layer = key_layer.get(k)
                if layer is None:
                    roles.append((None, False, None, None))
                    continue
                base, piece = piece_base(k)
                name = model_name(base)
                gname = None
                if name is not None:
                    name = name + piece
                elif base.rsplit("/", 1)[-1] in GRAD_AVERAGE:
                    gname = param_of(base) + piece
                roles.append((layer, base not in self._shards, name, gname))
            self._roles = (sig, roles)
        return self._roles[1]

    def _shapes(self, entries: Entries) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]:
        shapes = {k: (t.dtype, tuple(t.shape)) for k, t in entries}
        for key, pk, sizes in self._shard_pieces:
            shapes.setdefault(pk, (CODES[self._shards[key].dtype], tuple(sizes)))
        return shapes

    def _measure_across_ranks(self, layers, measures: Dict[str, Measure], proof: Dict[str, Tuple[bool, bool]]
                              ) -> Tuple[Dict[str, Measure], Dict[str, Tuple[bool, bool]]]:
        """A sharded model's layers measured on every rank's shard, summed, and proven unchanged only where
        every rank proved its shards so (unpriced state changed where it did on any rank): every rank decides
        alike."""
        if not self._shards or self.group.world == 1:
            return measures, proof
        mine = {layer: list(m.parts) if m.parts is not None else None for layer, m in measures.items()}
        ranks = self.group.exchange((mine, proof))
        joined = {}
        for layer in layers:
            got = [r[1][layer] for r in ranks if layer in r[1]]
            if got:
                joined[layer] = (all(u for u, _ in got), any(c for _, c in got))
        return {layer: combine([r[0][layer] for r in ranks if layer in r[0]]) for layer in layers}, joined

    def _prove_frozen(self, held) -> Tuple[Dict[str, Tuple[bool, bool]], Dict[str, Fingerprint], Dict[str, List[str]]]:
        """Full mode (one process): every frozen layer is fingerprinted on every byte, and proven bit-identical to
        its persisted version where each tensor matches; the proof, the fingerprints taken, no unpriced state."""
        if not self._carries():
            return {}, {}, {}
        frozen = self._frozen
        taken = fingerprints({k: t for layer, tensors in held.items() if layer in frozen
                              for k, (t, _) in tensors.items()})
        with self._lock:
            same = self.fingerprints.matches
            proof = {layer: (all(same(k, taken[k]) for k in tensors), False)
                     for layer, tensors in held.items() if layer in frozen}
        return proof, taken, {}

    def _carries(self) -> bool:
        """Whether a full save may carry a frozen layer proven unchanged instead of writing it again: in one
        process (saves in flight are known there), unless the remote tier is to get bases only (every full save
        must then read no older file)."""
        return self.full and self.group.world == 1 and self.config.remote_every != REMOTE_BASES

    def _prove(self, measures: Dict[str, Measure], held, grads) -> Tuple[Dict[str, Tuple[bool, bool]],
                                                                        Dict[str, Fingerprint], Dict[str, List[str]]]:
        """layer -> (proven bit-identical to its persisted version, state the cost cannot price changed), the
        fingerprints taken, and each layer's unpriced tensors: under the fidelity rule, the weights and buffers
        of a layer whose optimizer keeps no gradient average for any of them (SGD without momentum, parameters
        outside the optimizer, a layer of buffers only), which the tracker would price at 0.
        Only what the sample cannot settle is fingerprinted: every tensor of a layer none of whose sampled
        elements moved, and the unpriced tensors none of whose sampled elements moved."""
        proof: Dict[str, Tuple[bool, bool]] = {}
        todo: Dict[str, torch.Tensor] = {}
        unpriced_keys: Dict[str, List[str]] = {}
        if self.full:
            return self._prove_frozen(held)
        plans = {}
        for layer, tensors in held.items():
            m = measures.get(layer)
            names = [n for _, n in tensors.values() if n is not None]
            moved = dict(zip(names, m.moved)) if m is not None and m.moved is not None else {}
            still = m is not None and m.drift == 0.0
            # unpriced: a layer none of whose tensors has a gradient average prices at 0 under the fidelity rule
            # (a layer with one is priced by it, its buffers riding along); the threshold rule prices nothing
            unpriced = [] if grads.get(layer) or self.config.threshold is not None else [
                k for k, (_, n) in tensors.items() if n is not None]
            unpriced_moved = any(moved.get(tensors[k][1], True) for k in unpriced)
            for k in list(tensors) if still else ([] if unpriced_moved else unpriced):
                todo[k] = tensors[k][0]
            plans[layer] = (still, list(tensors), unpriced, unpriced_moved)
            unpriced_keys[layer] = unpriced
        taken = fingerprints(todo)
        with self._lock:
            same = self.fingerprints.matches
            for layer, (still, keys, unpriced, unpriced_moved) in plans.items():
                proof[layer] = (still and all(same(k, taken[k]) for k in keys),
                                bool(unpriced) and (unpriced_moved or not all(same(k, taken[k]) for k in unpriced)))
        return proof, taken, unpriced_keys

    def plan(self, step: int, fname: str, entries: Entries, rank: int = 0, world: int = 1,
             loss: Optional[float] = None) -> SavePlan:
        """With several ranks each persisted layer is written by one rank (balanced by bytes), or, sharded,
        by every rank that holds a shard of it; ``file`` is filled in when the ranks' results are merged."""
        key_layer, layer_keys, weights, grads, nbytes, held = self._by_layer(entries)
        shapes = self._shapes(entries)
        prev, measures, snaps = self._measure(weights, grads)
        proof, taken, unpriced = self._prove(measures, held, grads)
        if not self.full:
            measures, proof = self._measure_across_ranks(layer_keys, measures, proof)
        chain = 0 if prev is None else prev.chain + 1
        states, forced = self._states(prev, layer_keys, measures, nbytes, shapes, proof)
        quant = 0.0 if prev is None or self.config.encoding != "lossy" else policy.quantization_cost(
            states, self.config.lossy_quantum, step - prev.step,
            {layer: sum(t.numel() for t in w.values()) for layer, w in weights.items()})
        reasons = self._decide(states, forced, prev is None, chain, loss, quant)
        persist = {layer for layer, why in reasons.items() if why in policy.WRITE or why in (NEW, "full")}
        # a sharded layer is written by every rank, each its own shards (its unsharded tensors, such as
        # an optimizer's step count, by rank 0); any other layer by one rank, balanced by bytes
        shard_keys = {pk for _, pk, _ in self._shard_pieces}
        sharded = {key_layer[pk] for pk in shard_keys if pk in key_layer}
        owner_rank = assign(persist - sharded, nbytes, world)
        layers, carried, deferred, by_ref = _compose(prev, layer_keys, states, reasons, persist, owner_rank, nbytes,
                                                     step, fname if world == 1 else None)
        out = SavePlan(
            write=[(k, t) for k, t in entries
                   if _mine(k, key_layer.get(k), persist, owner_rank, rank, sharded, shard_keys)],
            layers=layers, carried=carried, files={e.file: prev.files[e.file] for e in carried.values()},
            persisted=persist, chain=chain,
            # the persisted layers' samples become their drift references: copies, taken now
            samples={layer: snaps[layer][0] for layer in persist if layer in snaps},
            cost=policy.composite_cost(states, persist) + quant,
            progress=sum(st.progress for st in states.values() if not st.frozen), deferred=deferred, shapes=shapes,
            step=step, pretrained=by_ref)
        if self.config.encoding == "lossy" and prev is not None and step > prev.step and not self.full:
            out.moves = self._moves(snaps, weights, held, step - prev.step)
        refs = self._references(out, held, taken, unpriced)
        if self.pretrained is not None and world == 1:
            self._by_reference(out, held, refs)
        self._planned_now(out, snaps, world, refs)
        return out

    def _by_reference(self, out: SavePlan, held, refs: Dict[str, Fingerprint]) -> None:
        """Of the frozen layers' tensors this save persists, those the pretrained files hold bit for bit (the
        fingerprints taken to prove the layers unchanged at the next saves, ``_references``) are recorded by
        reference (``SavePlan.pretrained``) instead of written."""
        frozen = self._frozen
        wanted = {k: refs[k] for layer in out.persisted if layer in frozen for k in held.get(layer, {})
                  if k in refs and model_name(k) is not None and not piece_base(k)[1]}
        found = self.pretrained.match(wanted)
        if not found:
            return
        check = checksum_function(CHECKSUM)
        for k, name in found.items():
            dtype, shape = out.shapes[k]
            code, fp = DTYPES[dtype], list(refs[k][2])
            out.pretrained[k] = PretrainedEntry(name, code, list(shape), math.prod(shape) * ITEMSIZE[code], fp,
                                                pretrained_seal(check, k, name, fp, out.step, code, list(shape)),
                                                out.step)
        out.write = [(k, t) for k, t in out.write if k not in found]

    def _moves(self, snaps, weights, held, interval: int) -> Dict[str, float]:
        """:attr:`SavePlan.moves`: each weight key's RMS move per step over the last ``interval`` steps, from
        the tracker's sample (taken before this save's snapshots become the next interval's start)."""
        with self._lock:
            rms = self.tracker.moves(snaps)
        out: Dict[str, float] = {}
        for layer, per in rms.items():
            # a move out of or into inf or NaN measures nothing: the average since the reference decides
            at = {name: m for name, m in zip(weights.get(layer, {}), per) if m is not None and math.isfinite(m)}
            for key, (_, name) in held.get(layer, {}).items():
                if name in at:
                    out[key] = at[name] / interval
        return out

    def _sample(self, weights: Dict[str, torch.Tensor], grads: Dict[str, torch.Tensor]) -> LayerSample:
        """The tracker's sample of a layer, its gradient averages unbiased: Adam's exp_avg divided by
        ``1 - beta1^step`` (``grad_bias``), which a fresh optimizer's first steps leave up to ``1/(1 - beta1)``
        short, and every cost priced with it."""
        s = self.tracker.sample(weights, grads)
        if s.gparts is not None and self.grad_bias:
            bias = [self.grad_bias.get(n.split("#", 1)[0], 1.0) for n in weights]
            s.gdiv = bias if any(b != 1.0 for b in bias) else None
        return s

    def _measure(self, weights, grads):
        """(the composite this save builds on: the newest plan still in flight, else the last committed one;
        each layer's drift, cost and progress measured against its reference; this save's samples)."""
        with self._lock:
            prev = self.composite if self._planned is None else self._planned
            # full checkpoints decide nothing by drift: keep their stall to the copy alone
            now = {} if self.full else {layer: self._sample(w, grads.get(layer, {})) for layer, w in weights.items()}
            measures, snaps = self.tracker.measure(now)
        return prev, measures, snaps

    def _states(self, prev, layer_keys: Dict[str, List[str]], measures: Dict[str, Measure], nbytes: Dict[str, int],
                shapes, proof: Dict[str, Tuple[bool, bool]]) -> Tuple[Dict[str, policy.LayerState], Set[str]]:
        """Each layer's state for the policy, and the layers that are written whatever it decides: new, or
        whose tensors changed since ``prev`` (added, reshaped, new optimizer state)."""
        frozen = self._frozen
        prev_shapes = prev.shapes if isinstance(prev, SavePlan) else self._prev_shapes
        states, forced = {}, set()
        for layer, keys in layer_keys.items():
            before = prev.layers.get(layer) if prev is not None else None
            if before is None or sorted(before.tensors) != sorted(keys) or any(
                    prev_shapes.get(k) != shapes[k] for k in keys):
                forced.add(layer)
            ms = measures.get(layer)
            unchanged, unpriced = proof.get(layer, (False, False))
            states[layer] = policy.LayerState(
                drift=ms.drift if ms else math.inf, age=before.age if before else 0, nbytes=nbytes[layer],
                frozen=layer in frozen, cost=ms.cost if ms else math.inf,
                progress=ms.progress if ms else 0.0, unchanged=unchanged, unpriced=unpriced)
        return states, forced

    def _decide(self, states: Dict[str, policy.LayerState], forced: Set[str], first: bool, chain: int,
                loss: Optional[float], quant: float = 0.0) -> Dict[str, str]:
        """Why each layer is written or skipped: the policy's reasons, ``NEW`` for a forced layer it skips;
        ``quant``: the bounded-loss codes' price, reserved from the fidelity allowance."""
        cfg = self.config
        if self.full:  # every layer, but a frozen one proven unchanged since the version the composite holds
            carry = self._carries() and not first and not (cfg.base_every > 0 and chain % cfg.base_every == 0)
            return {layer: policy.UNCHANGED if carry and st.unchanged and layer not in forced else "full"
                    for layer, st in states.items()}
        reasons = policy.decide(states, first=first, base_due=cfg.base_every > 0 and chain % cfg.base_every == 0,
                                threshold=cfg.threshold, fidelity=cfg.fidelity, loss=loss,
                                max_staleness=cfg.max_staleness, budget_bytes=cfg.budget_bytes, reserved=quant)
        for layer in forced:
            if reasons[layer] not in policy.WRITE:
                reasons[layer] = NEW
        return reasons

    def _references(self, out: SavePlan, held, taken: Dict[str, Fingerprint], unpriced: Dict[str, List[str]]
                    ) -> Dict[str, Fingerprint]:
        """The fingerprints of the tensors this save persists (on this rank) that become their references: those
        taken to decide, and those taken now of what the next saves must prove unchanged to skip: every tensor
        of a frozen layer or of a block of table rows written as new, and the unpriced tensors of any layer
        (written whenever they change, so skipped only where proven unchanged).  In full mode: the frozen
        layers' fingerprints, taken to decide (see :meth:`_prove_frozen`)."""
        if self.full:
            return {k: taken[k] for layer in out.persisted for k in held.get(layer, {}) if k in taken}
        frozen = self._frozen
        refs: Dict[str, Fingerprint] = {}
        todo: Dict[str, torch.Tensor] = {}
        for layer in out.persisted:
            tensors = held.get(layer, {})
            settle = layer in frozen or (ROWS in layer and out.layers[layer].reason in (policy.FIRST, NEW))
            wanted = set(tensors) if settle else set(unpriced.get(layer, ()))
            for k, (t, _) in tensors.items():
                if k in taken:
                    refs[k] = taken[k]
                elif k in wanted:
                    todo[k] = t
        refs.update(fingerprints(todo))
        return refs

    def _planned_now(self, out: SavePlan, snaps, world: int, refs: Dict[str, Fingerprint]) -> None:
        with self._lock:
            self.tracker.advance(snaps)
            # the persisted layers' references move now, so that a save planned while this one is in
            # flight measures against them; should this one fail, they are forgotten (failed())
            self.tracker.commit(out.samples)
            self.fingerprints.persisted([k for layer in out.persisted for k in out.layers[layer].tensors], refs)
            if (not self.full or self._carries()) and world == 1:  # the next plan may carry from this one
                self._planned = out

    def resolve(self, plan: SavePlan, m: Manifest) -> None:
        """At this save's commit (the saves before it have committed or failed, in order): the tensors of the
        layers it carries from them, from their manifests.  Raises if one of them failed."""
        for layer, token in plan.deferred.items():
            with self._lock:
                src = self._committed.get(token)
            if src is None:
                raise CheckpointError(
                    f"the checkpoint of step {m.step} was not committed: it carries layer {layer!r} from a save "
                    f"before it that failed; the saves after it build on the last committed checkpoint")
            for k in m.layers[layer].tensors:
                if k in (m.pretrained or {}):  # held by reference: carried at the plan, in no file
                    continue
                e = m.tensors[k] = src.tensors[k]
                m.files[e.file] = src.files[e.file]

    def failed(self, plan: SavePlan) -> None:
        """A save failed: the next plan builds on the last committed composite, not on it."""
        with self._lock:
            p = self._planned
            if p is not None and (p is plan or plan.token in p.deferred.values()):
                self._planned = None
            self.tracker.forget(plan.persisted)  # no reference: the next save writes them again
            self.fingerprints.forget(k for layer in plan.persisted for k in plan.layers[layer].tensors)

    def adopt(self, manifest: Manifest, entries: Entries) -> None:
        """Take a committed composite as the base of the next save, as if this Selector had written it.
        ``entries`` are the model's and optimizer's tensors *now*, which must be the composite's (just
        restored): every layer stands at its persisted version, so each one's drift reference is its
        current value and its cost is zero."""
        _, _, weights, grads, _, held = self._by_layer(entries)
        samples = {}
        if not self.full:
            with self._lock:
                now = {layer: self._sample(w, grads.get(layer, {})) for layer, w in weights.items()}
                snaps = {layer: (self.tracker.snapshot(s.w), self.tracker.snapshot(s.g) if s.gparts is not None else None,
                                 0.0) for layer, s in now.items()}
                self.tracker.advance(snaps)
            samples = {layer: snap[0] for layer, snap in snaps.items()}
            frozen = self._frozen
            # what a save that wrote them would fingerprint (_references): frozen layers, table rows, and
            # the unpriced tensors of every layer
            refs = fingerprints({k: t for layer, tensors in held.items() for k, (t, n) in tensors.items()
                                 if layer in frozen or ROWS in layer or (n is not None and n not in grads.get(layer, {}))})
            with self._lock:
                self.fingerprints.persisted([k for tensors in held.values() for k in tensors], refs)
        elif self._carries():  # full mode: what _prove_frozen compares the next save's frozen layers with
            frozen = self._frozen
            refs = fingerprints({k: t for layer, tensors in held.items() if layer in frozen
                                 for k, (t, _) in tensors.items()})
            with self._lock:
                self.fingerprints.persisted(list(refs), refs)
        self.committed(manifest, samples)

    def committed(self, manifest: Manifest, samples: Dict[str, Views], plan: Optional[SavePlan] = None) -> None:
        """Called by the flusher once a save committed: it becomes the base of the next composite."""
        shapes = {k: (CODES[e.dtype], tuple(e.shape)) for k, e in manifest.tensors.items()}
        shapes.update({k: (CODES[e.dtype], tuple(e.shape)) for k, e in (manifest.pretrained or {}).items()})
        with self._lock:
            self.composite = manifest
            if plan is None:  # adopt(): a plan's references moved when it was planned
                self.tracker.commit(samples)
            else:
                self._committed[plan.token] = manifest
                while len(self._committed) > 8:  # a save carries only from those still in flight at its plan
                    self._committed.pop(next(iter(self._committed)))
                if self._planned is plan:
                    self._planned = None
            self._prev_shapes = shapes
