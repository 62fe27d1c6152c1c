"""`layerckpt bench --restore`: resume time by checkpoint size, against torch.load and dcp.load.

For each size, one full training state (a GPT-style model and AdamW after one
step) is saved three ways: a full layerckpt save, ``torch.save`` of the model's
and optimizer's state dicts (flushed and fsynced) and ``dcp.save`` of
``get_state_dict(model, opt)``.  Every timed restore runs in a fresh Python
process that builds the model and a fresh optimizer, as a resuming training
script does, and times only the load calls:

* layerckpt: ``layerckpt.restore(dir, model, opt)``
* torch.load: ``torch.load(f, weights_only=True)`` + ``model.load_state_dict`` + ``opt.load_state_dict``
* dcp.load: ``get_state_dict`` (it creates the optimizer state DCP loads into) + ``dcp.load`` + ``set_state_dict``

Three page-cache conditions, each set up inside the child once the model is
built, right before the timed call: warm (every file of that contender's
checkpoint read once in 8 MiB pieces); files (only that checkpoint's files
dropped from the page cache: fsync, then ``posix_fadvise(DONTNEED)``, as after
a crash, where the new process finds torch's and Python's code in the page
cache, the previous process having run it); cold (``os.sync()``, then ``3``
into ``/proc/sys/vm/drop_caches``, as after a reboot, with the kernel's caches
of everything else dropped too; skipped, and said so, where that is refused).
The child counts the major page faults of the timed call (``ru_majflt``: pages
of code or of mapped files read from the disk).
Repeats are interleaved: repeat 1 of every contender, then repeat 2, the
contenders' order rotated each repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .cases import drop_cache, summary
from .models import GPT, GPTConfig
from .machine import machine

CONTENDERS = ("layerckpt", "torch.load", "dcp.load")
CONDITIONS = ("warm", "files", "cold")
SIZES = ("10MB", "50MB", "200MB", "gpt2-small")
PIECE = 8 << 20


# ---------------------------------------------------------------- the state

def model_config(size: str) -> Dict[str, int]:
    """A GPT shape whose model + AdamW state is about ``size`` ("10MB", "2MB", ...) or the GPT-2 preset."""
    if size == "gpt2-small":
        return dict(vars(GPTConfig.gpt2_small()))
    target = _parse_bytes(size)
    vocab, positions = 1024, 128
    best: Optional[Tuple[float, Dict[str, int]]] = None
    for layers in (12, 8, 6, 4, 2):
        for embd in range(16, 2049, 16):
            cfg = dict(vocab_size=vocab, n_positions=positions, n_embd=embd, n_layer=layers, n_head=embd // 16)
            err = abs(_state_bytes(cfg) / target - 1)
            if best is None or err < best[0] - 0.02:  # more layers unless fewer are clearly closer
                best = (err, cfg)
    assert best is not None
    return {**vars(GPTConfig()), **best[1]}


def _parse_bytes(size: str) -> int:
    s = size.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    raise SystemExit(f"--sizes: {size!r} is neither a size like 10MB nor gpt2-small")


def _state_bytes(c: Dict[str, int]) -> int:
    """Model + AdamW moments, fp32, tied head (analytic, to pick a shape without building it)."""
    e = c["n_embd"]
    params = (c["vocab_size"] + c["n_positions"]) * e + c["n_layer"] * (12 * e * e + 13 * e) + 2 * e
    return 12 * params


def build(cfg: Dict[str, int], seed: int, step: bool) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and AdamW; ``step=False`` is a resuming process's fresh optimizer (no state yet)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if step:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def save_all(root: str, model, opt) -> Dict[str, str]:
    """The same state saved by each contender; returns each one's path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..checkpointer import Checkpointer
    from ..config import Config

    paths = {name: os.path.join(root, name) for name in CONTENDERS}
    ck = Checkpointer(paths["layerckpt"], model, opt, Config())
    ck.save(1)
    ck.close()
    with open(paths["torch.load"], "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=paths["dcp.load"])
    os.sync()
    return paths


def load(kind: str, path: str, model, opt) -> None:
    """The load call(s) a resuming script makes, for one contender."""
    if kind == "layerckpt":
        from ..restore import restore

        restore(path, model, opt)
    elif kind == "torch.load":
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    elif kind == "dcp.load":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    else:
        raise ValueError(f"unknown contender {kind!r}; one of {', '.join(CONTENDERS)}")


def flat_state(model, opt) -> Dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def bit_exact(saved: Dict[str, torch.Tensor], kind: str, path: str, cfg: Dict[str, int]) -> bool:
    """Load ``path`` into a differently seeded model and fresh optimizer; every tensor equal bit for bit?"""
    model, opt = build(cfg, seed=1, step=False)
    load(kind, path, model, opt)
    got = flat_state(model, opt)
    return got.keys() == saved.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in saved.items())


# ---------------------------------------------------------------- page cache

def files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def warm(path: str) -> int:
    """Read every file under ``path`` once through the page cache, in 8 MiB pieces; returns the bytes."""
    buf, n = bytearray(PIECE), 0
    for f in files(path):
        with open(f, "rb", buffering=0) as fh:
            while True:
                got = fh.readinto(buf)
                if not got:
                    break
                n += got
    return n


def drop_caches(what: int = 3) -> Optional[str]:
    """Sync, then drop the page cache (``what``: 1 the page cache alone, 3 also dentries and inodes); the reason as
    a string where that is refused."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{what}\n")
    except OSError as e:
        return f"writing /proc/sys/vm/drop_caches: {e.strerror or e}"
    return None


# ---------------------------------------------------------------- the child

def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One timed resume in this (fresh) process: build, set the page cache, time the load."""
    import importlib

    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "layerckpt.restore"):
        importlib.import_module(name)  # what a resuming script has imported before it loads
    model, opt = build(spec["model"], seed=1, step=False)
    if spec["cache"] == "cold":
        why = drop_caches()
        if why:
            raise SystemExit(why)
    elif spec["cache"] == "files":
        drop_cache(spec["path"])
    else:
        warm(spec["path"])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    t0 = time.perf_counter()
    load(spec["kind"], spec["path"], model, opt)
    return {"seconds": time.perf_counter() - t0,
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults}


def timed_resume(kind: str, path: str, cfg: Dict[str, int], cache: str) -> Dict[str, float]:
    spec = json.dumps({"kind": kind, "path": path, "model": cfg, "cache": cache})
    r = subprocess.run([sys.executable, "-m", "layerckpt.bench.restore", "--child", spec],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} ({cache}) resume failed:\n{r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the run

def _bytes_on_disk(path: str) -> int:
    return sum(os.path.getsize(f) for f in files(path))


def run(sizes: Sequence[str] = SIZES, reps: int = 3, dirpath: Optional[str] = None,
        conditions: Sequence[str] = CONDITIONS) -> Dict[str, Any]:
    conditions = list(conditions)
    res: Dict[str, Any] = {"machine": machine(), "reps": reps, "conditions": conditions, "sizes": []}
    if "cold" in conditions:
        why = drop_caches()
        if why:
            conditions.remove("cold")
            res["cold_skipped"] = why
    if dirpath:
        os.makedirs(dirpath, exist_ok=True)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-restore-", dir=dirpath)
    res["machine"]["dir"] = root
    try:
        for size in sizes:
            res["sizes"].append(_one_size(size, reps, os.path.join(root, size), conditions))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def _one_size(size: str, reps: int, root: str, conditions: List[str]) -> Dict[str, Any]:
    cfg = model_config(size)
    model, opt = build(cfg, seed=0, step=True)
    saved = flat_state(model, opt)  # views of the live tensors, kept after model and opt go
    os.makedirs(root)
    try:
        paths = save_all(root, model, opt)
        del model, opt
        row: Dict[str, Any] = {
            "size": size, "model": cfg, "state_bytes": _unique_bytes(saved.values()),
            "bytes": {k: _bytes_on_disk(p) for k, p in paths.items()},
            "bit_exact": {k: bit_exact(saved, k, p, cfg) for k, p in paths.items()},
            "seconds": {c: {k: [] for k in CONTENDERS} for c in conditions},
            "major_faults": {c: {k: [] for k in CONTENDERS} for c in conditions},
        }
        del saved
        for cond in conditions:
            for i in range(reps):
                order = CONTENDERS[i % 3:] + CONTENDERS[:i % 3]
                for kind in order:
                    got = timed_resume(kind, paths[kind], cfg, cond)
                    row["seconds"][cond][kind].append(got["seconds"])
                    row["major_faults"][cond][kind].append(got["major_faults"])
        row["summary"] = {c: {k: summary(ts) for k, ts in per.items()} for c, per in row["seconds"].items()}
        row["ratios"] = {c: {f"{k}/ours": s[k]["median"] / s["layerckpt"]["median"] for k in CONTENDERS[1:]}
                         for c, s in row["summary"].items()}
        return row
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _unique_bytes(ts) -> int:
    """Bytes of the state, a tied weight counted once."""
    seen = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t.numel() * t.element_size() for t in ts}
    return sum(seen.values())


def format_table(res: Dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"layerckpt bench --restore: resume (fresh process: build model + fresh AdamW, then time the load) "
             f"by size; {res['reps']} interleaved repeat(s) per contender; median [min-max] ms",
             f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, kernel {m['kernel']}, "
             f"torch {m['torch']}, data in {m['dir']}"]
    if res.get("cold_skipped"):
        lines.append(f"cold page cache skipped: {res['cold_skipped']}")
    lines += ["", f"{'size':<12}{'state MB':>9} {'cache':<6}" + "".join(f"{k:>26}" for k in CONTENDERS)
              + f"{'torch/ours':>12}{'dcp/ours':>10}  bit-exact"]
    for r in res["sizes"]:
        exact = " ".join(f"{k}={'yes' if v else 'NO'}" for k, v in r["bit_exact"].items())
        for j, (cond, s) in enumerate(r["summary"].items()):
            cells = "".join(f"{s[k]['median'] * 1e3:>10.1f} [{s[k]['min'] * 1e3:.1f}-{s[k]['max'] * 1e3:.1f}]"
                            .rjust(26) for k in CONTENDERS)
            q = r["ratios"][cond]
            head = f"{r['size']:<12}{r['state_bytes'] / 1e6:>9.1f}" if j == 0 else " " * 21
            lines.append(f"{head} {cond:<6}{cells}{q['torch.load/ours']:>11.2f}x{q['dcp.load/ours']:>9.2f}x"
                         f"  {exact if j == 0 else ''}")
    faults = [f"{r['size']} {cond}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in per.items())
              for r in res["sizes"] for cond, per in (r.get("major_faults") or {}).items()]
    if faults:  # runs before the files condition did not count them
        lines += ["", "major page faults in the timed load, medians (code or mapped pages read from the disk): "
                  + "; ".join(faults)]
    lines += ["", "ratios are medians: >1 means layerckpt resumes faster; files on disk (MB): " + "; ".join(
        f"{r['size']}: " + ", ".join(f"{k} {b / 1e6:.1f}" for k, b in r["bytes"].items()) for r in res["sizes"])]
    return "\n".join(lines)


def main(args) -> int:
    """``layerckpt bench --restore`` (args: sizes, reps, dir, json; cache optional)."""
    sizes = [s.strip() for s in (getattr(args, "sizes", None) or ",".join(SIZES)).split(",") if s.strip()]
    for s in sizes:
        if s != "gpt2-small":
            _parse_bytes(s)
    cache = getattr(args, "cache", None) or ",".join(CONDITIONS)
    conditions = [c.strip() for c in cache.split(",") if c.strip()]
    if not conditions or set(conditions) - set(CONDITIONS):
        raise SystemExit(f"--cache: {cache!r}; a comma-separated list of {', '.join(CONDITIONS)}")
    res = run(sizes, max(1, args.reps), args.dir, conditions)
    print(json.dumps(res) if args.json else format_table(res), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m layerckpt.bench.restore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", metavar="JSON", help="one timed resume (used by the bench itself)")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--cache", default=",".join(CONDITIONS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        sys.exit(0)
    sys.exit(main(a))
