"""`layerckpt bench --lossy`: what bounded-loss codes would write and cost in loss, on the workload family.

A study ahead of ``Config(encoding="lossy")``: the codes of :mod:`layerckpt.format._lossy` applied to the whole
state at every checkpoint of the family's runs (every layer at every save, no selection), in memory, not through
the store.  Per workload and per weight quantum (a fraction of what one step moves each layer):

- bytes: each save's codes compressed with zstd (level 1) plus their scales, the weights as deltas against
  the run's first state (its lossless base, written once, counted), against raw full checkpoints at the same
  cadence;
- loss after one restore: at crash points early, middle and late, the saved state goes through the codes into
  a fresh model and optimizer, trains to the end on the same batches, and its mean loss is set against the
  uninterrupted run's over the same steps;
- loss after five: a run restored through the codes at five points in turn (each restore's error on top of
  the last ones'), its mean loss after the fifth against the uninterrupted run's.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..format import _lossy
from .family import WORKLOADS, Workload

CRASHES = (0.25, 0.5, 0.75)
CYCLES = (0.15, 0.3, 0.45, 0.6, 0.75)  # the five restores of the successive-crash run
#: (weight quantum in units of one step's RMS move of the layer, moment code bits, the weights' reference:
#: "base" the run's first state, lossless; "chain" the previous save as a restore decodes it, so that each
#: save codes only its own interval's move and the error stays within half a quantum however long the chain)
SETTINGS = ((2.0, 8, "base"), (8.0, 4, "base"), (2.0, 4, "chain"), (8.0, 4, "chain"))
LEVEL = 1


def _zstd_bytes(t: torch.Tensor) -> int:
    import zstandard

    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return len(zstandard.ZstdCompressor(level=LEVEL).compress(raw))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                    for i, st in enumerate(opt.state_dict()["state"].values())},
            "ids": list(opt.state_dict()["state"].keys())}


def _raw_bytes(s: Dict[str, Any]) -> int:
    n = sum(v.numel() * v.element_size() for v in s["model"].values())
    return n + sum(v.numel() * v.element_size() for st in s["opt"].values() for k, v in st.items()
                   if torch.is_tensor(v) and k != "step")


def _coded(s: Dict[str, Any], base: Dict[str, torch.Tensor], prev: Dict[str, torch.Tensor], every: int,
           setting: Tuple[float, int, str]) -> Tuple[Dict[str, Any], int]:
    """The state ``s`` through the codes (what a restore would get) and the bytes the codes take compressed.
    ``base``: the weights' reference; ``prev``: the weights one checkpoint earlier (the layer's move per step is
    measured between the two)."""
    fraction, bits, _ = setting
    out = {"model": {}, "opt": {}, "ids": s["ids"]}
    nbytes = 0
    for k, w in s["model"].items():
        if not w.is_floating_point() or w.numel() == 0:
            out["model"][k] = w
            nbytes += w.numel() * w.element_size()
            continue
        move = float((w.double() - prev[k].double()).pow(2).mean().sqrt()) / every
        if move == 0.0:  # unchanged since the last save (frozen, or not trained): nothing written, as lossless
            out["model"][k] = w
            continue
        c = _lossy.encode_delta(w, base[k], _lossy.delta_step(move, fraction))
        out["model"][k] = _lossy.decode(c, base[k])
        nbytes += _zstd_bytes(c.codes) + c.scales.numel() * 4
    for i, st in s["opt"].items():
        o = {}
        for k, v in st.items():
            if not torch.is_tensor(v) or k == "step" or not v.is_floating_point():
                o[k] = v
                continue
            c = _lossy.encode_sq(v, bits) if k in ("exp_avg_sq", "max_exp_avg_sq") else _lossy.encode_moment(v, bits)
            o[k] = _lossy.decode(c)
            nbytes += _zstd_bytes(c.codes) + c.scales.numel() * 4
        out["opt"][i] = o
    return out, nbytes


def _load(w: Workload, s: Dict[str, Any]):
    torch.manual_seed(1)
    model, opt = w.make()
    model.load_state_dict(s["model"])
    sd = opt.state_dict()
    sd["state"] = {pid: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s["opt"][i].items()}
                   for i, pid in enumerate(s["ids"])}
    opt.load_state_dict(sd)
    return model, opt


def run(w: Workload, settings: Sequence[Tuple[float, int, str]] = SETTINGS, steps: Optional[int] = None
        ) -> Dict[str, Any]:
    steps = steps or w.steps
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, opt = w.make()
    saves = list(range(w.every, steps + 1, w.every))
    crash_at = sorted({min(saves, key=lambda s: abs(s - f * steps)) for f in CRASHES})
    cycle_at = sorted({min(saves, key=lambda s: abs(s - f * steps)) for f in CYCLES})
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the lossless base: the first state
    losses: List[float] = []
    kept: Dict[int, Dict[Tuple[float, int, str], Dict[str, Any]]] = {}
    prev = dict(base)
    refs = {f: base for f in settings}
    coded_bytes = {f: 0 for f in settings}
    raw = 0
    for step in range(steps):
        losses.append(w.train_step(model, opt, step))
        if (step + 1) % w.every == 0:
            s = _state(model, opt)
            raw += _raw_bytes(s)
            for f in settings:
                out, nbytes = _coded(s, refs[f], prev, w.every, f)
                coded_bytes[f] += nbytes
                if f[2] == "chain":
                    refs[f] = out["model"]
                if step + 1 in crash_at:
                    kept.setdefault(step + 1, {})[f] = out
            prev = {k: v.clone() for k, v in s["model"].items()}
    base_bytes = sum(v.numel() * v.element_size() for v in base.values())
    res: Dict[str, Any] = {"workload": w.name, "steps": steps, "every": w.every, "saves": len(saves),
                           "raw_bytes": raw, "base_bytes": base_bytes, "settings": {}}
    for f in settings:
        row: Dict[str, Any] = {"bytes": coded_bytes[f] + base_bytes}
        row["ratio"] = raw / row["bytes"]
        row["crashes"] = []
        for at in crash_at:
            m, o = _load(w, kept[at][f])
            after = [w.train_step(m, o, s) for s in range(at, steps)]
            row["crashes"].append({"step": at, "deviation": statistics.fmean(after) / statistics.fmean(losses[at:]) - 1})
        row["cycles"] = _cycles(w, f, base, steps, cycle_at, losses)
        res["settings"][f"q={f[0]:g},{f[1]}b,{f[2]}"] = row
    res["seconds"] = time.perf_counter() - t0
    return res


def _cycles(w: Workload, setting: Tuple[float, int, str], base: Dict[str, torch.Tensor], steps: int, at: List[int],
            losses: List[float]) -> Dict[str, Any]:
    """Five restores in turn: the run goes through the codes at each point of ``at`` and trains on."""
    torch.manual_seed(0)
    model, opt = w.make()
    prev = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = base
    got: List[float] = []
    for step in range(steps):
        got.append(w.train_step(model, opt, step))
        if (step + 1) % w.every == 0:
            s = _state(model, opt)
            out, _ = _coded(s, ref, prev, w.every, setting)
            if setting[2] == "chain":
                ref = out["model"]
            if step + 1 in at:
                model, opt = _load(w, out)
            prev = {k: v.clone() for k, v in s["model"].items()}
    last = at[-1]
    return {"restores": len(at), "after": last,
            "deviation": statistics.fmean(got[last:]) / statistics.fmean(losses[last:]) - 1}


def sweep(names: Optional[Sequence[str]] = None, settings: Sequence[Tuple[float, int, str]] = SETTINGS
          ) -> List[Dict[str, Any]]:
    return [run(WORKLOADS[n], settings) for n in names or list(WORKLOADS)]


def format_table(res: Dict[str, Any]) -> str:
    lines = ["bounded-loss codes on the family (a study: every layer at every save, in memory, not through the "
             "store): weights as deltas against the run's first state rounded to a quantum of q x one step's RMS "
             "move of the layer, exp_avg b-bit block-wise absmax, exp_avg_sq b-bit block-wise log2; codes zstd -1",
             f"{'workload':<17}{'setting':>16}{'vs raw full':>13}   loss after one restore (early / middle / late)   "
             f"after 5 restores"]
    for r in res["rows"]:
        for f, row in r["settings"].items():
            cells = "  ".join(f"{c['deviation'] * 100:+.3f}%" for c in row["crashes"])
            lines.append(f"{r['workload']:<17}{f:>16}{row['ratio']:>12.1f}x   {cells:<47}"
                         f"{row['cycles']['deviation'] * 100:+.3f}%")
    return "\n".join(lines)


def main(args) -> int:
    import json

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    res = {"rows": sweep(args.workloads)}
    if args.json:
        from .machine import machine

        print(json.dumps({"machine": machine(), "lossy": True, **res}, default=str))
    else:
        print(format_table(res))
    return 0
