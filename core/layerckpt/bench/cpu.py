"""`layerckpt bench --cpu`: what one checkpoint costs the machine in CPU time.

The same model and AdamW take the same training steps, and every ``every`` steps each contender checkpoints
them.  For each checkpoint the process's CPU time (every thread, user + system, ``getrusage``) is taken from
the checkpoint call until everything it started in the background has ended (durable and committed, the
cost model's probes included): what the checkpoint takes from the cores the training would otherwise
have.  Nothing else runs meanwhile (the training waits), so the difference is the checkpoint's alone.

Contenders: ``torch.save`` of the model's and optimizer's state dicts (as Lightning's ModelCheckpoint
writes them: no fsync), layerckpt's default ``Config`` (selective, ``encoding='auto'``), the same with
``encoding='delta'`` and ``'off'`` forced, and each of the three in full mode (every layer at every save);
``encoding='lossy'`` in full mode (the opt-in bounded-loss codes: what they cost the machine).  On request
(``--cpu-contenders``), the full ones signed (``Config.sign_key``: each file's SHA-256 taken as it is written,
each manifest's HMAC): what signing costs the machine and the time to durable, against the same unsigned.
Beside them, the machine's floor for a checkpoint of the state: one copy and one CRC32C of every byte
(``memcpy + crc32c``), and what one training step costs (``step``) for scale.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..io._backend import checksum
from .machine import machine

MODELS = ("main", "gpt2-small")
PAUSE_S = 0.05
CONTENDERS = ("torch.save", "layerckpt", "layerckpt delta", "layerckpt off", "layerckpt full",
              "layerckpt full delta", "layerckpt full off", "layerckpt full lossy")
SIGNED = ("layerckpt full signed", "layerckpt full off signed")  # on request: what signing costs
KNOWN = CONTENDERS + SIGNED


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: layerckpt's threads by the part of a save they do, from their names (an encoder pool's numbers dropped)
PARTS = {"layerckpt-stager": "stager", "layerckpt-flusher": "flusher", "layerckpt-encode": "encoders",
         "layerckpt-fingerprint": "fingerprints", "layerckpt-digest": "digests"}


def _threads() -> Optional[Dict[str, float]]:
    """CPU seconds so far of this process's threads that do a save's parts (``schedstat``, nanoseconds): the
    calling thread (``save()`` itself), layerckpt's threads by part (:data:`PARTS`), the kernel's io_uring
    workers; None where the kernel keeps no per-thread schedstat."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    me = threading.get_native_id()
    out: Dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            if tid == str(me):
                return None
            continue  # a thread that just ended
        name = names.get(int(tid), "")
        part = ("call" if int(tid) == me else "io_uring" if comm.startswith("iou-") else
                next((v for k, v in PARTS.items() if name.startswith(k)), None))
        if part is not None:
            out[part] = out.get(part, 0.0) + ns / 1e9
    return out


def _split(before: Optional[Dict[str, float]], after: Optional[Dict[str, float]], total: float
           ) -> Optional[Dict[str, float]]:
    """One checkpoint's CPU by part; ``other``: the rest of ``total`` (torch's worker threads, threads that ended
    meanwhile)."""
    if before is None or after is None:
        return None
    out = {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}
    out["other"] = max(0.0, total - sum(out.values()))
    return out


def _model(name: str) -> Tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], Optional[float]], int, int]:
    """(model, optimizer, one training step returning its loss, steps between checkpoints, checkpoints)."""
    if name == "main":  # the main job's model and fine-tuning steps (examples/lightning_finetune.py)
        from .workload import make_model, make_optimizer, start_finetune, train_step

        model = make_model()
        opt = make_optimizer(model)
        for s in range(8):
            train_step(model, opt, "count", s)
        start_finetune(opt)
        return model, opt, lambda s: train_step(model, opt, "affine", s), 4, 24
    from .cases import build_state

    model, opt = build_state("gpt2-small")

    def step(_: int) -> None:  # an AdamW step on random gradients: every tensor moves as in training
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, 1, 6


def _layerckpt(root: str, model, opt, full: bool, encoding: str, signed: bool = False
               ) -> Tuple[Callable[[int, Any], int], Callable]:
    import secrets

    from ..checkpointer import Checkpointer
    from ..config import Config

    cfg = Config(full=True, encoding=encoding) if full else Config(encoding=encoding)
    if signed:
        cfg = cfg.replace(sign_key=secrets.token_hex(32))
    ck = Checkpointer(root, model, opt, cfg)

    def save(step: int, loss: Any) -> int:
        p = ck.save(step, loss=loss)
        p.wait()  # durable and committed, as it goes (Checkpointer.wait() would hurry it: the rest unencoded)
        ck.wait()  # and the probes it started ended
        return p.bytes_written

    return save, ck.close


def _torch_save(root: str, model, opt) -> Tuple[Callable[[int, Any], int], Callable]:
    os.makedirs(root, exist_ok=True)

    def save(step: int, loss: Any) -> int:
        path = os.path.join(root, f"step-{step}.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        n = os.path.getsize(path)
        return n

    return save, lambda: None


def _floor(model, opt) -> float:
    """CPU seconds of one copy and one CRC32C of every byte of the state (median of 5)."""
    tensors = [t for t in list(model.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]
               if isinstance(t, torch.Tensor) and t.numel()]
    dst = [torch.empty_like(t) for t in tensors]
    out = []
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's work, no worker threads woken
    try:
        for _ in range(5):
            time.sleep(PAUSE_S)
            c = _cpu()
            for d, t in zip(dst, tensors):
                d.copy_(t)
                checksum(memoryview(d.reshape(-1).view(torch.uint8).numpy()), 0)
            out.append(_cpu() - c)
    finally:
        torch.set_num_threads(n)
    return statistics.median(out)


def run_model(name: str, dirpath: Optional[str], contenders=CONTENDERS, saves: Optional[int] = None) -> Dict[str, Any]:
    """``saves``: checkpoints per contender, where not the model's own number (a quick check)."""
    res: Dict[str, Any] = {"model": name, "runs": {}}
    for who in ("step",) + tuple(contenders):
        torch.manual_seed(0)
        model, opt, step, every, n = _model(name)
        n = saves or n
        res["state_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
            v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        root = tempfile.mkdtemp(prefix="layerckpt-bench-cpu-", dir=dirpath)
        try:
            if who == "step":
                cpu, wall = [], []
                for s in range(n):
                    time.sleep(PAUSE_S)
                    c, w = _cpu(), time.perf_counter()
                    step(s)
                    cpu.append(_cpu() - c)
                    wall.append(time.perf_counter() - w)
                res["runs"]["step"] = {"cpu_s": _summary(cpu), "wall_s": _summary(wall)}
                res["floor_cpu_s"] = _floor(model, opt)
                continue
            if who == "torch.save":
                save, close = _torch_save(root, model, opt)
            else:
                parts = who.split()
                full = "full" in parts
                enc = next((p for p in parts if p in ("delta", "off", "lossy")), "auto")
                save, close = _layerckpt(root, model, opt, full, enc, "signed" in parts)
            cpu, wall, nbytes, parts = [], [], [], []
            for s in range(n * every):
                loss = step(s)
                if (s + 1) % every:
                    continue
                time.sleep(PAUSE_S)
                th = _threads() if who != "torch.save" else None
                c, w = _cpu(), time.perf_counter()
                nbytes.append(save(s, loss))
                cpu.append(_cpu() - c)
                wall.append(time.perf_counter() - w)
                parts.append(_split(th, _threads() if th is not None else None, cpu[-1]))
            close()
            skip = min(2, len(cpu) - 1)  # the first saves allocate buffers and write everything
            res["runs"][who] = {"cpu_s": _summary(cpu[skip:]), "wall_s": _summary(wall[skip:]),
                                "bytes": statistics.mean(nbytes[skip:]), "saves": len(cpu) - skip}
            split = [p for p in parts[skip:] if p is not None]
            if split:  # medians by part (they need not add up to the total's median)
                res["runs"][who]["parts_s"] = {k: statistics.median(p.get(k, 0.0) for p in split)
                                               for k in sorted({k for p in split for k in p})}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return res


def _timed(r: Dict[str, Any]) -> str:
    counts = sorted({x["saves"] for who, x in r["runs"].items() if who != "step" and "saves" in x})
    return "checkpoints timed per contender: " + "/".join(map(str, counts)) + " (after 2 untimed)" if counts else ""


def _summary(xs: List[float]) -> Dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def run(models=MODELS, dirpath: Optional[str] = None, contenders=CONTENDERS, saves: Optional[int] = None
        ) -> Dict[str, Any]:
    return {"machine": machine(), "torch_threads": torch.get_num_threads(),
            "models": [run_model(m, dirpath, contenders, saves) for m in models]}


_PART_ORDER = ("call", "stager", "flusher", "encoders", "fingerprints", "digests", "io_uring", "other")


def format_table(res: Dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"layerckpt bench --cpu: CPU time (all threads, user + system) per checkpoint, from the call until its "
             f"background work ended; on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
             f"{res['torch_threads']} torch threads; medians [min-max]"]
    for r in res["models"]:
        mb = r["state_bytes"] / 1e6
        floor = r["floor_cpu_s"]
        ts = r["runs"].get("torch.save")
        w = max(24, 2 + max(len(who) for who in r["runs"]))  # the names' column (wider for the signed ones)
        lines += ["", f"{r['model']}: {mb:.1f} MB of state; the floor (one copy and one CRC32C of it) "
                      f"{floor * 1e3:.1f} ms of CPU; one training step {r['runs']['step']['cpu_s']['median'] * 1e3:.0f} "
                      f"ms of CPU; {_timed(r)}",
                  f"{'checkpoint':<{w}}{'CPU ms':>24}{'vs floor':>10}{'vs torch.save':>15}{'wall ms':>10}{'MB written':>12}"]
        for who, x in r["runs"].items():
            if who == "step":
                continue
            c = x["cpu_s"]
            lines.append(f"{who:<{w}}" + f"{c['median'] * 1e3:.1f} [{c['min'] * 1e3:.1f}-{c['max'] * 1e3:.1f}]".rjust(24)
                         + f"{c['median'] / floor:>9.1f}x"
                         + (f"{c['median'] / ts['cpu_s']['median']:>14.2f}x" if ts else " " * 15)
                         + f"{x['wall_s']['median'] * 1e3:>10.1f}{x['bytes'] / 1e6:>12.1f}")
        split = [(who, x["parts_s"]) for who, x in r["runs"].items() if x.get("parts_s")]
        if split:
            lines.append("where layerckpt's CPU went, ms (medians by thread): call = save() on the training thread, "
                         "stager = the copies and their CRC32C, flusher = writes, commit and retention, other = "
                         "torch's threads and threads that ended")
            wp = max(22, 1 + max(len(who) for who, _ in split))
            for who, p in split:
                lines.append(f"  {who:<{wp}}" + "  ".join(f"{k} {p[k] * 1e3:.1f}" for k in _PART_ORDER if k in p)
                             + "".join(f"  {k} {v * 1e3:.1f}" for k, v in p.items() if k not in _PART_ORDER))
    lines.append("torch.save: no fsync (as Lightning's ModelCheckpoint); layerckpt: durable (fdatasync) and committed")
    return "\n".join(lines)


def main(args) -> int:
    models = [m.strip() for m in (getattr(args, "cpu_models", None) or ",".join(MODELS)).split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"--cpu-models: no model named {', '.join(unknown) or 'at all'}; "
                         f"give {' and/or '.join(MODELS)}, comma-separated")
    saves = getattr(args, "cpu_saves", None)
    given = getattr(args, "cpu_contenders", None)
    contenders = tuple(c.strip() for c in given.split(",") if c.strip()) if given else CONTENDERS
    unknown = [c for c in contenders if c not in KNOWN]
    if unknown or not contenders:
        raise SystemExit(f"--cpu-contenders: no contender named {', '.join(unknown) or 'at all'}; give some of "
                         f"{', '.join(KNOWN)}, comma-separated")
    res = run(models, args.dir, contenders, saves=None if saves is None else saves + 2)  # the first 2 untimed
    print(json.dumps(res) if args.json else format_table(res))
    return 0
