"""`layerckpt bench --policy`: the selection defaults on the whole workload family, through the real engine.

For each workload: train uninterrupted with a Checkpointer saving every ``every``
steps (every composite kept), then, for crash points early, middle and late in the
run, restore that step's composite into a fresh model and optimizer, strictly as
users get it (a refused restore is a failure, reported), and train to the end on the
same batches.  Reported: bytes the selective saves persisted against full checkpoints
at the same cadence, both as raw layer bytes and as written (the sizes of the data
files each save wrote, what encoding would shrink), and the mean training loss after
each restore against the uninterrupted run's over the same steps (the 0.5% bound), and after five crashes in
turn: a run restored from its own newest composite at five points, each restore's error on top of the ones
before, its mean loss after the fifth against the uninterrupted run's (``Config(encoding='lossy')``'s 1% bound).

With ``frontier`` (the CLI's default) the same uninterrupted run also saves full
checkpoints (``Config(full=True)``, through the same engine, so encoded like the
default) every 1, 2, 4 and 8 intervals into stores of their own, and records a
held-out loss curve; every result is then also put in steps of training lost per
crash (:mod:`layerckpt.bench.frontier`): the default's point beside the frontier of
the full cadences, at equal bytes written.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import statistics
import tempfile
import time
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpointer import Checkpointer
from ..format._manifest import load_manifest
from ..config import Config
from ..errors import CheckpointError
from ..restore import restore
from .family import WORKLOADS, Workload, pretrained_file
from .frontier import INTERVALS, crash_points, format_frontier, frontier_at, lag_steps, mean_steps_since, plot, steps_since

CRASHES = (0.25, 0.5, 0.75)
CYCLES = (0.15, 0.3, 0.45, 0.6, 0.75)  # the five crashes of the successive-crash run
# the bytes each workload must save at least (docs/selection.md, issue targets).  The others (training from scratch, the
# CNN: every layer carries the loss's progress) have the loss target only: a selective save writes a subset of a
# full one, so "never more than full" would be a target no run can miss.
BYTES_TARGET = {**{f"{kind}-{lr}": 10.0 for kind in ("classify", "finetune") for lr in ("1e-5", "3e-5", "1e-4")},
                "frozen-backbone": 10.0, "lora": 10.0, "embedding": 20.0}
LOSS_TARGET = 0.005
#: ``Config(encoding='lossy')``'s targets: bytes against raw full checkpoints at the same cadence, and the loss after
#: five restores in turn
LOSSY_BYTES_TARGET = {**{f"{kind}-{lr}": 10.0 for kind in ("classify", "finetune") for lr in ("1e-5", "3e-5")},
                      "classify-1e-4": 5.0, "finetune-1e-4": 5.0, "frozen-backbone": 50.0, "lora": 50.0,
                      "scratch-1e-3": 3.0}
CYCLES_TARGET = 0.01


HELDOUT = 16  # held-out batches the lag is measured on (Workload.eval_loss's own seed stream)


class _Store:
    """One store the uninterrupted run saves into, every ``every`` steps, and what each save wrote."""

    def __init__(self, root: str, config: Config, every: int):
        self.root, self.config, self.every = root, config, every
        self.saves: List[int] = []
        self.raw: List[int] = []  # layer bytes the save persisted (tensor payload)
        self.written: List[int] = []  # bytes of the data files the save wrote, as they are on disk
        self.full_raw: List[int] = []  # layer bytes of the whole composite: a full checkpoint's payload

    def record(self, m) -> None:
        from .policy_through import save_bytes

        raw, written, full = save_bytes(m)
        self.saves.append(m.step)
        self.raw.append(raw)
        self.written.append(written)
        self.full_raw.append(full)


def _stores(w: Workload, config: Config, root: str, frontier: bool) -> Dict[Any, _Store]:
    """The default Config's store (``root`` itself unless the frontier is measured), and with the frontier one
    store of full checkpoints (``Config(full=True)``, encoded like the default) per cadence of INTERVALS."""
    if not frontier:
        return {"default": _Store(root, config.replace(keep_last=0), w.every)}
    stores = {"default": _Store(os.path.join(root, "default"), config.replace(keep_last=0), w.every)}
    for k in INTERVALS:
        stores[k] = _Store(os.path.join(root, f"full-{k}"), _full_config(config), k * w.every)
    return stores


def _full_config(config: Config) -> Config:
    """``config`` (its engine settings: encoding, chunks, backend...) with every layer at every save, lossless
    (``encoding='lossy'``'s rows are set against the same full checkpoints as the lossless ones).  Older full
    checkpoints are never restored here: keep two, as users would."""
    selection = ("fidelity", "threshold", "budget_bytes", "full", "keep_last")
    same = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config) if f.init and f.name not in selection}
    if same["encoding"] == "lossy":
        same["encoding"] = Config.encoding
    return Config(full=True, keep_last=2, **same)


@functools.lru_cache(maxsize=2)
def _heldout_batch(name: str) -> Any:
    """HELDOUT of the workload's held-out batches (Workload.eval_loss's) as one: every batch of a workload has
    the same size, so the mean loss over it is the mean of theirs."""
    parts = [WORKLOADS[name].batch(-1 - i) for i in range(HELDOUT)]
    return tuple(torch.cat(ts) for ts in zip(*parts))


def _heldout(w: Workload, model) -> float:
    """The model's mean loss on the held-out set, in one forward pass."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = float(w.loss(model, _heldout_batch(w.name)))
    model.train(was)
    return out


def _train(w: Workload, stores: Dict[Any, _Store], steps: int, heldout: bool) -> Tuple[List[float], List[float]]:
    """The uninterrupted run, saving into every store at its cadence: (training losses, held-out loss at the
    start and after every interval of the workload's cadence, empty without ``heldout``)."""
    torch.manual_seed(0)
    model, opt = w.make()
    losses: List[float] = []
    curve = [_heldout(w, model)] if heldout else []
    cks = {key: Checkpointer(st.root, model, opt, config=st.config, layers=w.layers) for key, st in stores.items()}
    try:
        for step in range(steps):
            losses.append(w.train_step(model, opt, step))
            if heldout and (step + 1) % w.every == 0:
                curve.append(_heldout(w, model))
            for key, ck in cks.items():
                if (step + 1) % stores[key].every == 0:
                    ck.save(step + 1, loss=losses[-1]).wait()
                    stores[key].record(ck.selector.composite)
    finally:
        for ck in cks.values():
            ck.close()
    return losses, curve


def _restore(w: Workload, config: Config, root: str, at: int):
    """A fresh model and optimizer with the composite of ``at`` restored as users get it (strict): (model,
    optimizer, report), or (None, None, why) when the restore is refused."""
    torch.manual_seed(1)  # a fresh process would start from another RNG state: restore must set it
    model, opt = w.make()
    try:
        return model, opt, restore(root, model, opt, step=at, strict=True, config=config)
    except CheckpointError as e:
        return None, None, f"{type(e).__name__}: {e}"


def _crash(w: Workload, config: Config, st: _Store, losses: List[float], frac: float, steps: int) -> Dict[str, Any]:
    """Restore the composite nearest ``frac`` of the run and train to the end: the mean training loss after it
    against the uninterrupted run's over the same steps."""
    at = min(st.saves, key=lambda s: abs(s - frac * steps))
    model, opt, rep = _restore(w, config, st.root, at)
    if model is None:
        return {"step": at, "refused": rep, "deviation": None, "behind": None, "lag": None, "cost": None}
    m = load_manifest(rep.manifest)
    after = [w.train_step(model, opt, step) for step in range(at, steps)]
    return {"step": at, "deviation": statistics.fmean(after) / statistics.fmean(losses[at:]) - 1.0,
            "behind": max((n for layer, n in rep.staleness_steps.items() if not m.layers[layer].frozen), default=0),
            "lag": rep.lag, "cost": rep.cost}


def _cycles(w: Workload, config: Config, root: str, losses: List[float], steps: int) -> Dict[str, Any]:
    """A run saving every ``w.every`` steps that crashes at each of CYCLES in turn: restored from its newest
    composite into a fresh model and optimizer (the Checkpointer that goes on adopts it), its mean training loss
    after the fifth restore against the uninterrupted run's over the same steps."""
    at = sorted({max(w.every, round(f * steps / w.every) * w.every) for f in CYCLES})
    config = config.replace(keep_last=0)
    torch.manual_seed(0)
    model, opt = w.make()
    ck = Checkpointer(root, model, opt, config=config, layers=w.layers)
    step = 0
    try:
        for c in at:
            while step < c:
                loss = w.train_step(model, opt, step)
                step += 1
                if step % w.every == 0:
                    ck.save(step, loss=loss).wait()
            ck.close()
            model, opt, rep = _restore(w, config, root, c)
            if model is None:
                return {"restores": at.index(c), "step": c, "refused": rep, "deviation": None}
            ck = Checkpointer(root, model, opt, config=config, layers=w.layers)
            ck.adopt(rep)
        after = [w.train_step(model, opt, s) for s in range(step, steps)]
    finally:
        ck.close()
    return {"restores": len(at), "after": at[-1],
            "deviation": statistics.fmean(after) / statistics.fmean(losses[at[-1]:]) - 1.0}


def run(w: Workload, config: Config, root: str, crashes: Sequence[float] = CRASHES,
        steps: Optional[int] = None, frontier: bool = False) -> Dict[str, Any]:
    """One workload: the uninterrupted run, then a restore and run to the end at each crash point; with
    ``frontier``, also steps lost per crash for the default and for full checkpoints every k intervals."""
    steps = steps or w.steps
    t0 = time.perf_counter()
    stores = _stores(w, config, root, frontier)
    losses, curve = _train(w, stores, steps, heldout=frontier)
    st = stores["default"]
    out: Dict[str, Any] = {"workload": w.name, "encoding": config.encoding, "steps": steps, "every": w.every,
                           "saves": len(st.saves),
                           "bytes": sum(st.raw), "full_bytes": sum(st.full_raw),
                           "ratio": sum(st.full_raw) / max(sum(st.raw), 1), "written_bytes": sum(st.written),
                           "crashes": [_crash(w, config, st, losses, frac, steps) for frac in crashes],
                           "cycles": _cycles(w, config, os.path.join(root, "cycles"), losses, steps)}
    if frontier:
        out["frontier"] = _frontier(w, config, stores, curve, steps)
    out["seconds"] = time.perf_counter() - t0
    return out


def _default_point(w: Workload, config: Config, st: _Store, curve: List[float], points: List[int]) -> Dict[str, Any]:
    """The default's mean steps lost over the crash points: the steps since its newest composite plus that
    composite's held-out lag; a refused restore makes the point a failure (``refused``).  Beside the measured
    lag, the one the composite's manifest estimates (its ``lag`` in intervals, in steps)."""
    lags: Dict[int, float] = {}
    estimated: Dict[int, float] = {}
    since = [steps_since(c, st.saves) for c in points]
    for c, s in zip(points, since):
        at = c - s
        if at in lags or at == 0:  # no composite yet: the run starts over, nothing to restore
            continue
        model, _, rep = _restore(w, config, st.root, at)
        if model is None:
            return {"bytes": sum(st.written), "raw": sum(st.raw), "refused": rep, "restored": at}
        lags[at] = lag_steps(curve, at, _heldout(w, model), range(0, len(curve) * w.every, w.every))
        estimated[at] = (rep.lag or 0.0) * w.every
    lag = statistics.fmean(lags.get(c - s, 0.0) for c, s in zip(points, since))
    return {"bytes": sum(st.written), "raw": sum(st.raw), "since": statistics.fmean(since), "lag": lag,
            "lost": statistics.fmean(since) + lag, "lags": {str(k): v for k, v in sorted(lags.items())},
            "estimated_lag": statistics.fmean(estimated.get(c - s, 0.0) for c, s in zip(points, since))}


def _full_points(stores: Dict[Any, _Store], points: List[int], steps: int, every: int,
                 below: float) -> List[Dict[str, Any]]:
    """Full checkpoints every k intervals: the measured cadences, then (while the default writes fewer bytes
    than the cheapest) doubled cadences estimated from every 8's bytes per save."""
    out = [{"k": k, "bytes": sum(stores[k].written), "raw": sum(stores[k].raw), "saves": len(stores[k].saves),
            "lost": mean_steps_since(points, stores[k].saves)} for k in INTERVALS]
    last = stores[INTERVALS[-1]]
    per_save = sum(last.written) / max(len(last.saves), 1)
    k = INTERVALS[-1] * 2
    while out[-1]["bytes"] > below and k * every <= steps:
        saves = list(range(k * every, steps + 1, k * every))
        out.append({"k": k, "bytes": per_save * len(saves), "raw": None, "saves": len(saves),
                    "lost": mean_steps_since(points, saves), "estimated": True})
        k *= 2
    return out


def _full_check(w: Workload, config: Config, st: _Store, curve: List[float]) -> Dict[str, Any]:
    """The newest full checkpoint every interval, restored strictly: accepted, and with no held-out lag (it is
    bit for bit the run's state, so the lag measure must give exactly 0)."""
    at = st.saves[-1]
    model, _, rep = _restore(w, config, st.root, at)
    if model is None:
        return {"step": at, "refused": rep}
    return {"step": at, "lag": lag_steps(curve, at, _heldout(w, model), range(0, len(curve) * w.every, w.every))}


def _frontier(w: Workload, config: Config, stores: Dict[Any, _Store], curve: List[float],
              steps: int) -> Dict[str, Any]:
    points = crash_points(steps)
    d = _default_point(w, config, stores["default"], curve, points)
    full = _full_points(stores, points, steps, w.every, d["bytes"])
    check = _full_check(w, config, stores[INTERVALS[0]], curve)
    at = frontier_at([(p["bytes"], p["lost"]) for p in full], d["bytes"])
    ok = not d.get("refused") and d["lost"] <= at + 1e-9 and check.get("lag") == 0.0
    return {"crash_points": points, "default": d, "full": full, "full_check": check, "frontier_lost": at, "ok": ok,
            "ratio": full[0]["bytes"] / max(d["bytes"], 1)}


def sweep(names: Optional[Sequence[str]] = None, config: Optional[Config] = None,
          dirpath: Optional[str] = None, steps: Optional[int] = None, frontier: bool = False,
          encodings: Optional[Sequence[str]] = None, pretrained: bool = False) -> List[Dict[str, Any]]:
    """Every workload of ``names`` (all: None), with ``config``, or once with each of ``encodings`` in it;
    ``pretrained``: each workload that starts from the family's pre-trained weights names them in
    ``Config.pretrained`` (a safetensors copy of the cached weights, ``family.pretrained_file``)."""
    config = config or Config()
    rows = []
    for name in names or list(WORKLOADS):
        w = WORKLOADS[name]
        for enc in encodings or (config.encoding,):
            cfg = config.replace(encoding=enc)
            if pretrained and w.base is not None:
                cfg = cfg.replace(pretrained=pretrained_file(w.base))
            root = tempfile.mkdtemp(prefix=f"layerckpt-policy-{name}-", dir=dirpath)
            try:
                row = run(w, cfg, root, steps=steps, frontier=frontier)
                rows.append({**row, "pretrained": cfg.pretrained is not None})
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return rows


def written_ratio(row: Dict[str, Any]) -> float:
    """Raw full checkpoints at the same cadence over the bytes the default's saves wrote on disk."""
    return row["full_bytes"] / max(row.get("written_bytes", row["bytes"]), 1)


def meets(row: Dict[str, Any]) -> bool:
    """The issue's targets for one workload row: every restore accepted (strict) and within the loss bound,
    the bytes target on what was written, and (when measured) no more steps lost than the frontier; a
    ``Config(encoding='lossy')`` row: its own bytes targets, and the loss after five restores within 1%."""
    dev_ok = all(c.get("deviation") is not None and abs(c["deviation"]) <= LOSS_TARGET for c in row["crashes"])
    target = BYTES_TARGET.get(row["workload"])
    if row.get("encoding") == "lossy":
        target = LOSSY_BYTES_TARGET.get(row["workload"])
        cyc = row.get("cycles", {}).get("deviation")
        dev_ok = dev_ok and cyc is not None and abs(cyc) <= CYCLES_TARGET
    frontier_ok = row.get("frontier", {}).get("ok", True)
    return dev_ok and frontier_ok and (target is None or written_ratio(row) >= target)


def _crash_cell(c: Dict[str, Any]) -> str:
    return "      REFUSED" if c.get("refused") else f"{c['deviation'] * 100:+.3f}% ({c['behind']:>3})"


def format_table(rows: List[Dict[str, Any]], config: Config) -> str:
    rule = f"threshold={config.threshold}" if config.threshold is not None else f"fidelity={config.fidelity}"
    lines = [f"selection: {rule}, max_staleness={config.max_staleness} checkpoints; bytes vs raw full checkpoints "
             f"at the same cadence: raw (layer payload) and written (data files on disk); restores strict",
             f"{'workload':<17}{'encoding':>9}{'saves':>6}{'raw':>8}{'written':>9}   loss after restore vs "
             f"uninterrupted (early / middle / late crash; steps the oldest layer trails)   after 5   target"]
    for r in rows:
        cells = "  ".join(_crash_cell(c) for c in r["crashes"])
        enc = r.get("encoding", getattr(config, "encoding", None) or "auto")
        target = (LOSSY_BYTES_TARGET if enc == "lossy" else BYTES_TARGET).get(r["workload"])
        goal = (f">={target:.0f}x, " if target else "") + ("0.5%, 1% after 5" if enc == "lossy" else "0.5%")
        enc += "+pre" if r.get("pretrained") else ""
        cyc = r.get("cycles") or {}
        after = "REFUSED" if cyc.get("refused") else "-" if cyc.get("deviation") is None else \
            f"{cyc['deviation'] * 100:+.3f}%"
        lines.append(f"{r['workload']:<17}{enc:>9}{r['saves']:>6}{r['ratio']:>7.1f}x{written_ratio(r):>8.1f}x   "
                     f"{cells}   {after:>8}   {goal} {'ok' if meets(r) else 'MISSED'}")
    refused = [(r["workload"], c["step"], c["refused"]) for r in rows for c in r["crashes"] if c.get("refused")]
    refused += [(r["workload"], r["frontier"]["default"]["restored"], r["frontier"]["default"]["refused"])
                for r in rows if r.get("frontier", {}).get("default", {}).get("refused")]
    refused += [(r["workload"], r["cycles"]["step"], "after restores: " + r["cycles"]["refused"])
                for r in rows if (r.get("cycles") or {}).get("refused")]
    refused += [(r["workload"], r["frontier"]["full_check"]["step"], "full: " + r["frontier"]["full_check"]["refused"])
                for r in rows if r.get("frontier", {}).get("full_check", {}).get("refused")]
    lines += [f"refused: {name} step {step}: {why}" for name, step, why in refused]
    return "\n".join(lines)


def format_report(res: Dict[str, Any]) -> str:
    """What ``layerckpt bench --policy`` prints, from what ``--json`` prints (``{"config": ..., "rows": ...}``)."""
    c = res["config"]
    rule = types.SimpleNamespace(threshold=c.get("threshold"), fidelity=c.get("fidelity"),
                                 max_staleness=c.get("max_staleness"), encoding=c.get("encoding"))
    out = format_table(res["rows"], rule) + "\n\n" + format_frontier(res["rows"]) if res.get("rows") else ""
    if res.get("through"):
        out = (out + "\n\n" if out else "") + format_through(res)
    return out


def format_through(res: Dict[str, Any]) -> str:
    """The adapters' rows (and the core's, where the run measured it) by workload, then each one's worst restore."""
    from .policy_through import THROUGH, summary

    rows = [{**r, "through": "core"} for r in res.get("rows", [])] + list(res.get("through", []))
    order = {t: i for i, t in enumerate(THROUGH)}
    names = list(dict.fromkeys(r["workload"] for r in rows))
    rows.sort(key=lambda r: (names.index(r["workload"]), order[r["through"]]))
    lines = ["through the adapters: each framework's own training loop and resume, the default Config; bytes vs raw "
             "full checkpoints at the same cadence; loss after restore vs that adapter's uninterrupted run "
             "(early / middle / late crash; steps the oldest layer trails)",
             f"{'workload':<17}{'through':<12}{'saves':>6}{'raw':>8}{'written':>9}   "
             f"{'restores':<47}0.5%"]
    for r in rows:
        ok = all(c.get("deviation") is not None and abs(c["deviation"]) <= LOSS_TARGET for c in r["crashes"])
        cells = "  ".join(_crash_cell(c) for c in r["crashes"])
        lines.append(f"{r['workload']:<17}{r['through']:<12}{r['saves']:>6}{r['ratio']:>7.1f}x"
                     f"{written_ratio(r):>8.1f}x   {cells:<47}{'ok' if ok else 'MISSED'}")
    worst = "; ".join(f"{t} {w * 100:.3f}% over {n} workloads (smallest raw ratio {lo:.1f}x)"
                      for t, n, w, lo in summary(rows))
    lines.append(f"worst restore: {worst}")
    return "\n".join(lines)


def _encodings(args) -> Optional[List[str]]:
    given = getattr(args, "encodings", None)
    return [e.strip() for e in given.split(",")] if given else None


def main(args) -> int:
    import json

    from . import policy_through

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    config = Config.from_yaml(args.config) if args.config else Config()
    through = policy_through.parse_through(args.through)
    res: Dict[str, Any] = {"config": config.to_dict(),
                           "rows": sweep(args.workloads, config, args.dir, frontier=True, encodings=_encodings(args),
                                         pretrained=bool(getattr(args, "pretrained", None)))
                           if "core" in through else []}
    adapters = [t for t in through if t != "core"]
    if adapters:
        policy_through.quiet_frameworks()
        res["through"] = policy_through.sweep(adapters, args.workloads, config, args.dir, CRASHES)
    if args.json:
        from .machine import machine

        print(json.dumps({"machine": machine(), **res}, default=str))
    else:
        print(format_report(res))
    if getattr(args, "plot", None) and res["rows"]:
        plot(res["rows"], args.plot)  # skipped where matplotlib is not installed
    return 0
