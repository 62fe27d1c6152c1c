"""`layerckpt bench --steps`: what a checkpoint at every step costs a training loop.

The same GPT-style model and AdamW train for the same steps on the same
batches, once with no checkpointing and once each with layerckpt's
``Checkpointer.save`` (full saves: the worst case for the step time; lazy
staging as configured), DCP's ``async_save`` and TorchSnapshot's
``Snapshot.async_take`` (if installed) after every step.  Reported per
contender: the median step time (forward, backward, optimizer step, the
checkpoint call) with its spread and the overhead against no checkpointing:
what training pays, the optimizer step's wait for layerckpt's lazy copies
included; and, as its own figure, when the checkpoint call returned (for
layerckpt also the median wait in the next step, ``step_wait``).  Each contender waits for its
previous checkpoint before taking the next only where its own API makes it
(layerckpt's ``max_inflight``; DCP and TorchSnapshot: the previous future),
so what a step pays is what a user of that API pays.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from .cases import summary
from .restore import drop_caches
from .models import GPT
from .sharded import SIZES, machine  # the models --size names, one set for every bench mode


def _train(preset: str, steps: int, warmup: int, seq: int,
           checkpoint: Optional[Callable[[int, torch.nn.Module, torch.optim.Optimizer, torch.Tensor], None]]
           ) -> Dict[str, Any]:
    torch.manual_seed(0)
    c = SIZES[preset]
    seq = min(seq, c.n_positions + 1)
    model = GPT(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times: List[float] = []
    blocked: List[float] = []
    for step in range(warmup + steps):
        x = torch.randint(0, c.vocab_size, (1, seq), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if checkpoint is not None:
            checkpoint(step, model, opt, loss.detach())
        t2 = time.perf_counter()
        if step >= warmup:
            times.append(t2 - t0)
            blocked.append(t2 - t1)
    return {"model": model, "opt": opt, "step": summary(times), "blocked": summary(blocked), "total_s": sum(times)}


def run(preset: str = "gpt2-small", steps: int = 6, warmup: int = 2, seq: int = 128,
        dirpath: Optional[str] = None, every: int = 1, rounds: int = 2) -> Dict[str, Any]:
    """``every`` > 1: a full checkpoint every that many steps, layerckpt's default Config (``encoding='auto'``)
    against ``encoding='delta'`` and ``'off'`` forced, ``dcp.async_save`` at the same cadence, and none, each
    ``rounds`` times (each round in the reverse order of the one before), the disk settled before each
    contender (:func:`settle`); the overhead is then of the mean total time of the measured steps."""
    seq = min(seq, SIZES[preset].n_positions + 1)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-steps-", dir=dirpath)
    res: Dict[str, Any] = {"preset": preset, "steps": steps, "warmup": warmup, "seq": seq, "every": every,
                           "machine": machine(),
                           "runs": {}}
    try:
        if every == 1:
            res["runs"]["none"] = _strip(_train(preset, steps, warmup, seq, None))
            res["runs"]["layerckpt"] = _layerckpt(root, preset, steps, warmup, seq, every)
        else:  # rounds in alternating order, the disk settled between contenders: a disk still writing back the
            # one before weighs on whoever comes next, and the order must not decide the ratios
            res["rounds"] = rounds
            runs: Dict[str, List[Dict[str, Any]]] = {}
            order = ["none", "auto", "delta", "off", "dcp"]
            for r in range(rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    settle(root)
                    runs.setdefault(name, []).append(
                        _strip(_train(preset, steps, warmup, seq, None)) if name == "none" else
                        _dcp(root, preset, steps, warmup, seq, every) if name == "dcp" else
                        _layerckpt(root, preset, steps, warmup, seq, every, encoding=name))
            for name, label in zip(order, ["none", "layerckpt", "layerckpt delta", "layerckpt off", "dcp async_save"]):
                res["runs"][label] = _rounds(runs[name])
        if every == 1:
            res["runs"]["dcp async_save"] = _dcp(root, preset, steps, warmup, seq, every)
        if every == 1:
            res["runs"]["torchsnapshot async_take"] = _torchsnapshot(root, preset, steps, warmup, seq)
        key = "median" if every == 1 else None
        base = res["runs"]["none"]
        for r in res["runs"].values():
            if "step" in r:
                r["overhead"] = (r["step"]["median"] / base["step"]["median"] if key else
                                 r["total_s"] / base["total_s"]) - 1
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def settle(root: str, dirty_bytes: int = 32 << 20, timeout_s: float = 60.0) -> None:
    """Before a contender: the files of the ones before it deleted, the disk's write-back of what they left
    dirty ended (``sync``, then Dirty + Writeback in /proc/meminfo below ``dirty_bytes``) and the page cache
    they filled dropped where this process may (root), so that no contender pays for the one before it."""
    for f in os.listdir(root):
        shutil.rmtree(os.path.join(root, f), ignore_errors=True)
    gc.collect()
    os.sync()
    end = time.monotonic() + timeout_s
    while _dirty() > dirty_bytes and time.monotonic() < end:
        time.sleep(0.1)
    drop_caches(1)  # refused where not root: the rounds run on a warm cache then


def _dirty() -> int:
    """Bytes of the page cache not yet on disk (Dirty + Writeback), 0 where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("Dirty", "Writeback")}
    except (OSError, ValueError):
        return 0
    return sum(kb.values()) * 1024


def _rounds(rs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One contender's rounds as one: the mean total time, the steps of every round, the first's other
    figures (an error of any round is the result)."""
    bad = next((r for r in rs if "error" in r), None)
    if bad is not None:
        return bad
    out = dict(rs[0])
    out["total_s"] = sum(r["total_s"] for r in rs) / len(rs)
    out["totals_s"] = [r["total_s"] for r in rs]
    out["step"] = summary([x for r in rs for x in r["step"]["all"]])
    out["blocked"] = summary([x for r in rs for x in r["blocked"]["all"]])
    if "step_wait" in rs[0]:
        out["step_wait"] = summary([x for r in rs for x in r["step_wait"]["all"]])
        out["bytes"] = [b for r in rs for b in r["bytes"]]
    return out


def _strip(r: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in r.items() if k not in ("model", "opt")}


def _layerckpt(root: str, preset: str, steps: int, warmup: int, seq: int, every: int = 1,
               encoding: str = "auto") -> Dict[str, Any]:
    from ..checkpointer import Checkpointer
    from ..config import Config

    cks: List[Checkpointer] = []
    saves = []

    def save(step, model, opt, loss):
        if not cks:
            cks.append(Checkpointer(os.path.join(root, "layerckpt-" + encoding), model, opt,
                                    Config(threshold=0.0, encoding=encoding)))
        if (step + 1) % every == 0:
            saves.append(cks[0].save(step, loss=loss))

    out = _train(preset, steps, warmup, seq, save)
    cks[0].close()
    r = _strip(out)
    r["lazy_staging"] = cks[0]._lazy
    r["encoding"] = encoding
    r["bytes"] = [p.bytes_written for p in saves]
    # the last measured save has no step after it: its wait is not known
    r["step_wait"] = summary([p.step_wait_s for p in saves[warmup if every == 1 else 0:-1]] or [0.0])
    return r


def _dcp(root: str, preset: str, steps: int, warmup: int, seq: int, every: int = 1) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    futs: List[Any] = []

    def save(step, model, opt, loss):
        if (step + 1) % every:
            return
        if futs:  # DCP keeps one async save at a time per caller: the previous one must be finished
            _result(futs.pop())
        futs.append(dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                   checkpoint_id=os.path.join(root, "dcp", str(step))))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = _train(preset, steps, warmup, seq, save)
            for f in futs:
                _result(f)
        except Exception as e:  # noqa: BLE001 - report, do not abort the bench
            return {"error": f"{type(e).__name__}: {e}"}
    return _strip(out)


def _result(fut: Any) -> None:
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()


def _torchsnapshot(root: str, preset: str, steps: int, warmup: int, seq: int) -> Dict[str, Any]:
    try:
        import torchsnapshot
    except ImportError:
        return {"error": "not installed (pip install torchsnapshot, or the 'bench' extra)"}
    pending: List[Any] = []

    def save(step, model, opt, loss):
        if pending:
            pending.pop().wait()
        pending.append(torchsnapshot.Snapshot.async_take(path=os.path.join(root, "ts", str(step)),
                                                         app_state={"model": model, "optim": opt}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = _train(preset, steps, warmup, seq, save)
            for p in pending:
                p.wait()
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
    return _strip(out)


def format_table(res: Dict[str, Any]) -> str:
    m = res["machine"]
    every = res.get("every", 1)
    cadence = "a checkpoint after every step" if every == 1 else f"a full checkpoint every {every} steps"
    how = ("twice, the second round in reverse order" if "rounds" not in res else  # a JSON from before --steps-rounds
           f"{res['rounds']} times, each round in the reverse order of the one before, the disk settled before each")
    over = "" if every == 1 else (f" (each contender {how}; overhead: the mean total time of the measured steps "
                                  "against none's)")
    lines = [f"layerckpt bench --steps: {res['preset']} + AdamW, {cadence}, {res['steps']} "
             f"steps measured after {res['warmup']} warm-up ones (batch 1 x {res['seq']} tokens), on {m['cpu']} "
             f"({m['cores']} cores), torch {m['torch']}; medians [min-max]{over}",
             f"{'checkpointing':<28}{'step s':>24}{'overhead':>10}{'call returned s':>24}{'next step waited s':>24}"
             f"{'MB/save':>10}"]
    for name, r in res["runs"].items():
        if "error" in r:
            lines.append(f"{name:<28}{r['error']}")
            continue
        s, b = r["step"], r["blocked"]
        lines.append(f"{name:<28}{s['median']:>8.3f} [{s['min']:.3f}-{s['max']:.3f}]".ljust(52)
                     + f"{r['overhead'] * 100:>+9.1f}%"
                     + f"{b['median']:>8.3f} [{b['min']:.3f}-{b['max']:.3f}]".rjust(24)
                     + (f"{w['median']:>8.3f} [{w['min']:.3f}-{w['max']:.3f}]".rjust(24) if (w := r.get("step_wait")) else "")
                     + (f"{sum(r['bytes']) / len(r['bytes']) / 1e6:>10.1f}" if r.get("bytes") else ""))
    a, o = res["runs"].get("layerckpt", {}), res["runs"].get("layerckpt off", {})
    if "rounds" in res and "totals_s" in a and "totals_s" in o:
        per = ", ".join(f"{x / y:.2f}x" for x, y in zip(a["totals_s"], o["totals_s"]))
        lines.append(f"the default against encoding='off': {a['total_s'] / o['total_s']:.3f}x the mean total time of the "
                     f"measured steps (by round: {per})")
    return "\n".join(lines)


def main(args) -> int:
    res = run(args.size if args.size in SIZES else "gpt2-small", steps=getattr(args, "steps_n", 6),
              dirpath=args.dir, every=getattr(args, "steps_every", 1) or 1, rounds=getattr(args, "steps_rounds", 2) or 2)
    print(json.dumps(res) if args.json else format_table(res))
    return 0
