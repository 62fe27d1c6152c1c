"""`layerckpt bench --sharded`: layerckpt against torch.distributed.checkpoint on an FSDP2 model.

A GPT-2-shaped model (``--size``: GPT-2 small by default) is sharded with ``fully_shard`` over N
processes (gloo, CPU) and trained two steps so that every parameter has AdamW moments.  Then, in one
run on one state, with the same number of timed repeats for every contender (after one untimed
warm-up each, the save that allocates layerckpt's staging pool among them):

- layerckpt full save (``Config(threshold=0.0)``) and a selective save (default Config, the loss
  passed, a few training steps after the previous save);
- ``dcp.save`` and ``dcp.async_save`` of ``{"model": get_model_state_dict(m), "optim":
  get_optimizer_state_dict(m, opt)}`` to a fresh directory each time, each rank's files fsynced;
- restores into a fresh sharded model and optimizer on the same world size (``layerckpt.restore``
  against ``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict``), and resharded:
  the N-rank checkpoints read into a plain model in one process.

"blocked" is the time from the call to its return (training waits that long); "durable" the time
from the call until every rank's data is on disk (``PendingSave.wait()`` or the save's return plus an
fsync of the rank's files, then a barrier).  The state dict calls DCP needs are inside its timings,
as layerckpt's gathering of the state is inside its own.  Files are dropped from the page cache
(fsync, then ``posix_fadvise(DONTNEED)``, which needs no root) before every restore: reads start cold.

Run it as ``layerckpt bench --sharded`` (it launches ``torchrun --standalone --nproc_per_node N``
itself) or under an existing launcher: ``torchrun --nproc_per_node 2 -m layerckpt.bench.sharded``.

``--mesh DxT`` (e.g. ``2x2``, D * T processes) runs a 2-D layout instead: each block's MLP tensor parallel over
the ``tp`` dim (``c_fc`` ColwiseParallel, ``mlp_proj`` RowwiseParallel), then ``fully_shard`` over ``dp``
(``_StridedShard`` and ``Shard(1)`` weights; attention and embeddings sharded over ``dp`` and held alike by the
``tp`` ranks); every contender saves and restores that same layout, and the resharded restores read it into one
plain process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import Config
from .models import GPT, GPTConfig
from .machine import _ARGV_ENV, _command, machine

SIZES: Dict[str, GPTConfig] = {
    "gpt2-small": GPTConfig.gpt2_small(),  # 124M parameters, 1.49 GB with AdamW
    "gpt2-mini": GPTConfig(n_embd=512, n_layer=6, n_head=8),  # 45M, 0.54 GB: GPT-2's vocabulary, fewer/narrower blocks
    "tiny": GPTConfig.tiny(),  # a smoke test, not a measurement
}
SAVES = ("layerckpt full", "layerckpt selective", "dcp.save", "dcp.async_save")
RESTORES = ("layerckpt.restore", "dcp.load", "layerckpt.restore 2->1", "dcp.load 2->1")


# ---------------------------------------------------------------- model and training

def build(size: str, sharded: bool, seed: int = 0, mesh: Optional[str] = None
          ) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2-sharded: every block, then the root; with ``mesh`` ``DxT``, each block's MLP tensor
    parallel over ``tp`` first) and an AdamW without state."""
    torch.manual_seed(seed)
    m = GPT(SIZES[size])
    if sharded:
        from torch.distributed.fsdp import fully_shard

        dp = None
        if mesh:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            dev = device_mesh(mesh)
            dp = dev["dp"]
            for b in m.h:
                parallelize_module(b, dev["tp"], {"c_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()})
        for b in m.h:
            fully_shard(b, mesh=dp)
        fully_shard(m, mesh=dp)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


_MESHES: Dict[str, Any] = {}


def parse_mesh(mesh: str) -> Tuple[int, int]:
    """``DxT`` -> (D, T)."""
    try:
        d, t = (int(x) for x in mesh.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh takes DxT (data parallel x tensor parallel, e.g. 2x2), not {mesh!r}") from None
    if d < 1 or t < 1:
        raise SystemExit(f"--mesh {mesh}: both sizes must be at least 1")
    return d, t


def device_mesh(mesh: str):
    """The ("dp", "tp") DeviceMesh ``mesh`` names, made once per process."""
    if mesh not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[mesh] = init_device_mesh("cpu", parse_mesh(mesh), mesh_dim_names=("dp", "tp"))
    return _MESHES[mesh]


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> torch.Tensor:
    c = m.config
    g = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randint(0, c.vocab_size, (2, min(64, c.n_positions) + 1), generator=g)
        logits = m(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer, each) -> Dict[str, torch.Tensor]:
    """Each parameter once (tied weights too: named_parameters lists one once) and its AdamW moments, as ``each``
    gives them."""
    names = {id(p): n for n, p in m.named_parameters()}
    out = {f"model/{n}": each(p.detach()) for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = each(v)
    return out


def local_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """This rank's part of the state."""
    return _state(m, opt, _local)


def full_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """The whole state, DTensors gathered (a collective: every rank calls it)."""
    return _state(m, opt, lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone())


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nbytes(ts: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


# ---------------------------------------------------------------- timing across ranks

def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], Optional[Callable[[], Any]]]) -> Tuple[float, float]:
    """(blocked, durable) of one save on every rank: ``fn`` returns once training may go on, and
    returns the wait for durability (or None when it is durable already); a barrier ends both."""
    _barrier()
    t0 = time.perf_counter()
    rest = fn()
    blocked = time.perf_counter() - t0
    if rest is not None:
        rest()
    _barrier()
    return blocked, time.perf_counter() - t0


def fsync_files(paths: List[str], dirpath: Optional[str] = None) -> None:
    for f in paths:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if dirpath is not None:
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dcp_files(d: str, rank: int) -> List[str]:
    """The files rank ``rank`` wrote into a DCP checkpoint: its ``__<rank>_*.distcp``, and on rank 0 the metadata."""
    names = [f for f in os.listdir(d) if f.startswith(f"__{rank}_")] + ([".metadata"] if rank == 0 else [])
    return [os.path.join(d, f) for f in names if os.path.exists(os.path.join(d, f))]


# ---------------------------------------------------------------- contenders

def bench_layerckpt(d: str, m, opt, reps: int, selective: bool, step_seed: int, encoding: Optional[str] = None
                    ) -> Dict[str, Any]:
    from ..checkpointer import Checkpointer

    cfg = Config(keep_last=2) if selective else Config(threshold=0.0, keep_last=2)
    if encoding:
        cfg = cfg.replace(encoding=encoding)
    blocked, durable, written, persisted = [], [], [], []
    with Checkpointer(d, m, opt, config=cfg) as ck:
        loss = train(m, opt, 2, seed=step_seed) if selective else None
        t = time.perf_counter()
        first = ck.save(0, loss=loss).wait()  # allocates the staging pool (untimed warm-up)
        first_s = time.perf_counter() - t
        _barrier()
        for i in range(reps):
            loss = train(m, opt, 2, seed=step_seed + 1 + i) if selective else None
            box: List[Any] = []
            b, dur = timed(lambda: (box.append(ck.save(i + 1, loss=loss)), box[0].wait)[1])
            blocked.append(b)
            durable.append(dur)
            written.append(box[0].bytes_written)
            persisted.append(f"{box[0].layers_persisted}/{box[0].layers_total}")
    return {"blocked": blocked, "durable": durable, "bytes": written, "layers": persisted,
            "first_durable_s": first_s, "first_bytes": first.bytes_written}


def _dcp_state(m, opt) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}


def bench_dcp(root: str, m, opt, reps: int, asynchronous: bool) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    blocked, durable, written = [], [], []
    for i in range(reps + 1):  # the first one is the warm-up
        d = os.path.join(root, f"{'dcp_async' if asynchronous else 'dcp'}-{i}")

        def save():
            sd = _dcp_state(m, opt)
            if not asynchronous:
                dcp.save(sd, checkpoint_id=d)
                fsync_files(dcp_files(d, rank), d if rank == 0 else None)
                return None
            fut = dcp.async_save(sd, checkpoint_id=d)

            def finish():
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                fsync_files(dcp_files(d, rank), d if rank == 0 else None)
            return finish

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b, dur = timed(save)
        if i == 0:
            continue
        blocked.append(b)
        durable.append(dur)
        written.append(sum(os.path.getsize(f) for f in dcp_files(d, rank)))
    return {"blocked": blocked, "durable": durable, "bytes": written, "dir": d}


def drop_cache(d: str) -> None:
    """Every file under ``d`` synced and evicted from the page cache (rank 0), then a barrier."""
    from .cases import drop_cache as drop

    if not dist.is_initialized() or dist.get_rank() == 0:
        drop(d)
    _barrier()


def restore_layerckpt(d: str, size: str, sharded: bool, mesh: Optional[str] = None
                      ) -> Tuple[float, Dict[str, torch.Tensor]]:
    from ..restore import restore

    m2, o2 = build(size, sharded, seed=1, mesh=mesh)
    drop_cache(d)
    t0 = time.perf_counter()
    restore(d, m2, o2)
    _barrier()
    return time.perf_counter() - t0, local_state(m2, o2)


def restore_dcp(d: str, size: str, sharded: bool, mesh: Optional[str] = None) -> Tuple[float, Dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    m2, o2 = build(size, sharded, seed=1, mesh=mesh)
    drop_cache(d)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = _dcp_state(m2, o2)  # DCP loads in place: this creates the optimizer state (a zero-lr step)
        dcp.load(sd, checkpoint_id=d, no_dist=not sharded)
        set_model_state_dict(m2, sd["model"])
        set_optimizer_state_dict(m2, o2, sd["optim"])
    _barrier()
    return time.perf_counter() - t0, local_state(m2, o2)


# ---------------------------------------------------------------- the run



def disk_reference(root: str, nbytes: int) -> Dict[str, Any]:
    """The disk's own O_DIRECT sequential write and read of the whole state's bytes (one process)."""
    from .cases import DiskLimits
    from ..config import Config

    cfg = Config()
    disk = DiskLimits(os.path.join(root, "limit.bin"), nbytes, cfg.chunk_bytes, cfg.queue_depth)
    try:
        disk.write()
        disk.write()
        disk.read(fresh=False)
    finally:
        disk.close()
    return {"write_s": min(disk.writes), "read_s": min(disk.reads), "write_all_s": disk.writes}


def worker(size: str, reps: int, dirpath: Optional[str], mesh: Optional[str] = None,
           encoding: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """Every rank runs this under torchrun; rank 0 returns the results."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = _scratch(dirpath)
    try:
        m, opt = build(size, True, mesh=mesh)
        train(m, opt, 2, seed=0)  # every parameter has its AdamW moments
        mine = local_state(m, opt)
        shares = _gather(nbytes(mine))
        total = sum(shares)
        res: Dict[str, Any] = {"size": size, "world": world, "mesh": mesh, "encoding": encoding or Config.encoding,
                               "reps": reps, "dir": root, "machine": machine(),
                               "parameters": sum(p.numel() for p in m.parameters()), "state_bytes": total,
                               "share_bytes": shares}
        # the machine's limits, measured by rank 0 alone while the others wait
        if rank == 0:
            from .cases import memcpy_time

            res["reference"] = disk_reference(root, total)
            res["reference"]["memcpy_s"] = memcpy_time(list(mine.values()))
        _barrier()

        saves: Dict[str, Dict[str, Any]] = {}
        saves["layerckpt full"] = bench_layerckpt(os.path.join(root, "full"), m, opt, reps, False, 0, encoding)
        saves["dcp.save"] = bench_dcp(root, m, opt, reps, asynchronous=False)
        saves["dcp.async_save"] = bench_dcp(root, m, opt, reps, asynchronous=True)
        ref_full = full_state(m, opt) if world > 1 else dict(mine)  # the state every full save holds
        if rank != 0:
            ref_full = {}

        restores: Dict[str, List[float]] = {k: [] for k in RESTORES}
        exact: Dict[str, bool] = {k: True for k in RESTORES}
        for _ in range(reps):
            for name, fn, d in (("layerckpt.restore", restore_layerckpt, os.path.join(root, "full")),
                                ("dcp.load", restore_dcp, saves["dcp.save"]["dir"])):
                t, got = fn(d, size, True, mesh)
                restores[name].append(t)
                exact[name] = exact[name] and same(got, mine)
        exact = {k: all(_gather(v)) for k, v in exact.items()}

        # the selective save last: it trains the model on
        saves["layerckpt selective"] = bench_layerckpt(os.path.join(root, "selective"), m, opt, reps, True, 100,
                                                        encoding)
        for k, v in saves.items():
            v["bytes_per_rank"] = _gather_list(v["bytes"])
            v["blocked"] = [max(x) for x in _gather_list(v["blocked"])]  # the slowest rank, each repeat
            v["durable"] = [max(x) for x in _gather_list(v["durable"])]
        del m, opt, mine
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return None

        # resharded: the world-size checkpoints read into a plain model in this one process
        for _ in range(reps):
            for name, fn, d in (("layerckpt.restore 2->1", restore_layerckpt, os.path.join(root, "full")),
                                ("dcp.load 2->1", restore_dcp, saves["dcp.save"]["dir"])):
                t, got = fn(d, size, False)
                restores[name].append(t)
                exact[name] = exact[name] and same(got, ref_full)
                del got
        res["saves"] = {k: saves[k] for k in SAVES}
        res["restores"] = restores
        res["restore_bit_exact"] = exact
        res["ratios"] = ratios(res)
        return res
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _scratch(dirpath: Optional[str]) -> str:
    """A fresh directory for the run, made by rank 0 (under ``dirpath`` if given) and named to every rank."""
    box: List[Any] = [None]
    if dist.get_rank() == 0:
        if dirpath:
            os.makedirs(dirpath, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix="layerckpt-bench-sharded-", dir=dirpath)
    dist.broadcast_object_list(box)
    return box[0]


def _gather(x: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _gather_list(xs: List[Any]) -> List[List[Any]]:
    """Per repeat, every rank's value."""
    return [list(v) for v in zip(*_gather(xs))]


def ratios(res: Dict[str, Any]) -> Dict[str, float]:
    """DCP over layerckpt, medians of the same run (above 1: layerckpt is faster)."""
    s, r = res["saves"], res["restores"]
    med = statistics.median
    full = s["layerckpt full"]
    return {
        "dcp.save durable / full durable": med(s["dcp.save"]["durable"]) / med(full["durable"]),
        "dcp.async_save durable / full durable": med(s["dcp.async_save"]["durable"]) / med(full["durable"]),
        "dcp.async_save blocked / full blocked": med(s["dcp.async_save"]["blocked"]) / med(full["blocked"]),
        "dcp.save durable / selective durable":
            med(s["dcp.save"]["durable"]) / med(s["layerckpt selective"]["durable"]),
        "dcp.load / layerckpt.restore": med(r["dcp.load"]) / med(r["layerckpt.restore"]),
        "dcp.load 2->1 / layerckpt.restore 2->1": med(r["dcp.load 2->1"]) / med(r["layerckpt.restore 2->1"]),
        "full durable / O_DIRECT write": med(full["durable"]) / res["reference"]["write_s"],
    }


def _fmt(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def format_table(res: Dict[str, Any]) -> str:
    m, ref, w = res["machine"], res["reference"], res["world"]
    gb = res["state_bytes"] / 1e9
    lines = [
        f"layerckpt bench --sharded: {res['size']} ({res['parameters'] / 1e6:.1f}M parameters), {gb:.2f} GB of "
        f"state (model + AdamW), {_layout_name(res)} (gloo, CPU); {res['reps']} timed repeats each after one "
        f"warm-up: median [min-max]"
        + (f"; layerckpt's Config.encoding {res['encoding']!r}" + (
            " (raw bytes)" if res["encoding"] == "off" else
            " (full saves repeat an unchanged state: encoded, they write little)") if res.get("encoding") else ""),
        f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, kernel {m['kernel']}, "
        f"torch {m['torch']}",
        f"reference (one process, the whole state's bytes): O_DIRECT write {ref['write_s']:.3f}s "
        f"({gb / ref['write_s']:.2f} GB/s), O_DIRECT read {ref['read_s']:.3f}s ({gb / ref['read_s']:.2f} GB/s); "
        f"memcpy of rank 0's share {ref['memcpy_s']:.3f}s",
        f"each rank's share of the state: {' / '.join(f'{b / 1e6:.1f}' for b in res['share_bytes'])} MB",
        "",
        f"{'save':<24}{'blocked s':>24}{'durable s':>24}  MB written per rank",
    ]
    for name, r in res["saves"].items():
        per = " / ".join(f"{b / 1e6:.1f}" for b in r["bytes_per_rank"][-1])
        note = f"  (layers {r['layers'][-1]})" if name == "layerckpt selective" else ""
        lines.append(f"{name:<24}{_fmt(r['blocked']):>24}{_fmt(r['durable']):>24}  {per}{note}")
    lines += ["", f"{'restore (cold cache)':<24}{'s':>24}  bit-exact"]
    for name, ts in res["restores"].items():
        label = name.replace("2->1", f"{w}->1") + ("" if "->" in name else f" ({w}->{w})")
        lines.append(f"{label:<24}{_fmt(ts):>24}  {res['restore_bit_exact'][name]}")
    full = res["saves"]["layerckpt full"]
    lines += ["", f"layerckpt first save (allocates the staging pool, the untimed warm-up): "
              f"{full['first_durable_s']:.3f}s; selective saves train 2 steps before each save"]
    q = res["ratios"]
    lines.append("ratios (medians, same run): " + ", ".join(f"{k.replace('2->1', f'{w}->1')} = {v:.2f}x"
                                                          for k, v in q.items()))
    target = q["dcp.save durable / full durable"]
    lines.append(f"target: full sharded save at least 2x faster to durable than dcp.save: {target:.2f}x, "
                 f"{'met' if target >= 2 else 'NOT met'}")
    return "\n".join(lines)


def _layout_name(res: Dict[str, Any]) -> str:
    if not res.get("mesh"):
        return f"FSDP2 over {res['world']} ranks"
    d, t = parse_mesh(res["mesh"])
    return f"FSDP2 over dp={d} x tensor parallel (MLPs) over tp={t}, {res['world']} ranks"


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(size: str, reps: int, dirpath: Optional[str], as_json: bool, nproc: int, mesh: Optional[str] = None,
           encoding: Optional[str] = None) -> int:
    """Start ``torchrun --standalone --nproc_per_node nproc`` (with ``mesh``: D * T) on this module; its rank 0
    prints."""
    if mesh:
        d, t = parse_mesh(mesh)
        nproc = d * t
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "layerckpt.bench.sharded", "--size", size, "--reps", str(reps)] + (["--mesh", mesh] if mesh else []) + (
        ["--encoding", encoding] if encoding else [])
    if dirpath:
        cmd += ["--dir", dirpath]
    if as_json:
        cmd.append("--json")
    env = dict(os.environ)
    env.setdefault(_ARGV_ENV, _command())  # the ranks record the command line given, not torchrun's
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


def main(args) -> int:
    """``layerckpt bench --sharded`` (args: size, reps, dir, json, nproc, mesh)."""
    size, reps, d, as_json, mesh = args.size, args.reps, args.dir, args.json, getattr(args, "mesh", None)
    encoding = getattr(args, "encoding", None)
    if not _under_launcher():
        return launch(size, reps, d, as_json, getattr(args, "nproc", 2), mesh, encoding)
    if size not in SIZES:
        raise SystemExit(f"--size must be one of {', '.join(SIZES)}")
    if mesh and math.prod(parse_mesh(mesh)) != int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"--mesh {mesh} needs {math.prod(parse_mesh(mesh))} processes, not {os.environ['WORLD_SIZE']}")
    res = worker(size, max(1, reps), d, mesh, encoding)
    if res is not None:
        print(json.dumps(res) if as_json else format_table(res), flush=True)
    # a rank under torchrun ends here, everything closed and printed: leave without the interpreter's
    # finalization, during which torch's gloo threads now and then abort the process (see docs/failure-semantics.md, failure
    # semantics: "terminate called without an active exception")
    sys.stderr.flush()
    os._exit(0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m layerckpt.bench.sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="gpt2-small", choices=list(SIZES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--nproc", type=int, default=2, help="processes to launch (not under torchrun)")
    p.add_argument("--mesh", default=None, help="DxT: FSDP2 over D x tensor parallel over T (D * T processes)")
    p.add_argument("--encoding", default=None, choices=["auto", "delta", "compress", "off"],
                   help="layerckpt's Config.encoding (default: Config's)")
    return p


if __name__ == "__main__":
    sys.exit(main(parser().parse_args()))
