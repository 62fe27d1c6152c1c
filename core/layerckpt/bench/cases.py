"""The pieces `layerckpt bench` times: the state, the machine's limits, and each contender."""
from __future__ import annotations

import functools
import gc
import mmap
import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..io._backend import checksum, make_backend, open_file
from ..config import Config, MiB
from .models import GPT, GPTConfig


def build_state(preset: str = "gpt2-small", seed: int = 0, step: bool = True
                ) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The bench's model and AdamW; ``step=False`` leaves the optimizer without state (a fresh process)."""
    torch.manual_seed(seed)
    cfg = GPTConfig.gpt2_small() if preset == "gpt2-small" else GPTConfig.tiny()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not step:
        return model, opt
    for p in model.parameters():  # one step so every parameter has AdamW moments
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model, opt) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(model, opt).values())


def flat_tensors(model, opt) -> Dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def fsync_tree(path: str, drop_cache: bool = False) -> None:
    """fsync a file or every file under a directory; optionally evict them from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_cache(path: str) -> None:
    """Clean pages first, then dropped: every reader starts cold."""
    fsync_tree(path, drop_cache=True)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def summary(xs: List[float]) -> Dict[str, Any]:
    """Median and spread of equal repeats."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def record(out: Dict[str, Any], name: str, xs: List[float]) -> None:
    """``out[name]`` the median of ``xs``, ``name_min``/``name_max``/``name_all`` beside it (``name`` ends in _s)."""
    s = summary(xs)
    out[name] = s["median"]
    for k in ("min", "max", "all"):
        out[f"{name[:-2]}_{k}_s"] = s[k]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


class PeakRSS:
    """Samples RSS every millisecond in a thread (VmHWM cannot be reset everywhere)."""

    def __enter__(self):
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


# ---------------------------------------------------------------- machine limits

def memcpy_time(tensors: List[torch.Tensor], reps: int = 3) -> float:
    total = sum(t.numel() * t.element_size() for t in tensors)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.zero_()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        o = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[o:o + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            o += n
        best = min(best, time.perf_counter() - t0)
    del dst
    return best


class DiskLimits:
    """The disk's own sequential O_DIRECT limits for nbytes, measured from pre-touched buffers.

    Writes: plain pwrite of 64 MiB blocks at queue depth 1, and the raw ring at the
    configured depth and chunk size (layerckpt's write pattern minus staging and
    checksums), each into a new file; the faster counts.  Beside them, the ring's
    pattern over the file it just wrote (``overwrites``: no block to allocate, what
    a save that writes over a retired file, a spare, pays).  Reads: into a reused
    buffer (the disk alone), and into fresh memory (what any restore in a new process
    pays: page faults).
    """

    def __init__(self, path: str, nbytes: int, chunk: int, depth: int, block: int = 64 * MiB):
        block = max(block, chunk)  # a multiple of chunk: both are powers of two times 4 KiB here
        self.path, self.depth, self.chunk, self.block = path, depth, chunk, block
        self.nbytes = (nbytes + 4095) // 4096 * 4096
        self.buf = mmap.mmap(-1, block)
        self.buf.write(os.urandom(1 << 20) * (block >> 20))
        self.view = memoryview(self.buf)
        self.writes: List[float] = []
        self.overwrites: List[float] = []
        self.reads: List[float] = []
        self.fresh_reads: List[float] = []

    def _blocks(self, size: int):
        for o in range(0, self.nbytes, size):
            yield o, min(size, self.nbytes - o)

    def write(self) -> float:
        def qd1():
            fd, _ = open_file(self.path, write=True)
            try:
                for o, n in self._blocks(self.block):
                    os.pwrite(fd, self.view[:n], o)
                os.fdatasync(fd)
            finally:
                os.close(fd)

        def ring(over: bool = False):
            be = make_backend("auto", self.depth)
            fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT) if over else open_file(self.path, write=True)[0]
            try:
                for o, n in self._blocks(self.chunk):
                    be.write(fd, self.view[o % self.block:][:n], o, o, self.path)
                    be.wait(0)
                be.drain()
                os.fdatasync(fd)
            finally:
                os.close(fd)
                be.close()

        times = []
        for fn in (qd1, ring):
            if os.path.exists(self.path):  # a new file each time, as a checkpoint is (no truncation inside the timing)
                os.unlink(self.path)
            times.append(_timed(fn))
        t = min(times)
        self.writes.append(t)
        self.overwrites.append(_timed(lambda: ring(over=True)))  # over the file the ring just wrote
        return t

    def read(self, fresh: bool) -> float:
        from ..read._read import _Prefault

        drop_cache(self.path)
        be = make_backend("auto", self.depth)
        fd, _ = open_file(self.path, write=False)
        big = mmap.mmap(-1, self.nbytes) if fresh else None
        bufs = [mmap.mmap(-1, self.chunk) for _ in range(self.depth)] if not fresh else []
        for b in bufs:
            b.write(bytes(self.chunk))
        pieces = [(o, o, n) for o, n in self._blocks(self.chunk)]
        t0 = time.perf_counter()
        v = memoryview(big) if fresh else None
        pre = _Prefault(v, pieces) if fresh else None
        try:
            for i, (o, _, n) in enumerate(pieces):
                if fresh:
                    pre.wait(i)
                be.read(fd, v[o:o + n] if fresh else memoryview(bufs[i % self.depth])[:n], o, o, self.path)
                be.wait(0)
            be.drain()
            t = time.perf_counter() - t0
        finally:
            if pre is not None:
                pre.close()
            os.close(fd)
            be.close()
            del v, bufs, big  # freed with their last reference
        (self.fresh_reads if fresh else self.reads).append(t)
        return t

    def close(self) -> None:
        self.view.release()
        self.buf.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


# ---------------------------------------------------------------- contenders

def bench_layerckpt(root: str, model, opt, cfg: Config, reps: int, disk: DiskLimits,
                    preset: str = "gpt2-small") -> Dict[str, Any]:
    """Saves and restores, each rep right after a disk-limit measurement, so both see the same disk."""
    from ..checkpointer import Checkpointer
    from ..restore import restore

    d = os.path.join(root, "layerckpt")
    cfg = cfg.replace(threshold=0.0)  # full checkpoints: every byte of the state, every time
    gc.collect()
    with PeakRSS() as mem:
        ck = Checkpointer(d, model, opt, config=cfg)
        first = ck.save(0).wait()
    pool = ck.pool.allocated_bytes
    # untimed: from the keep_last-th save on, each commit retires a file, and the save after it writes over that
    # one (a spare, ``write/_spare``), as the saves of a run in progress do
    warm = cfg.keep_last
    for i in range(warm):
        perturb(model, opt, seed=1000 + i)
        ck.save(i + 1).wait()
    stalls, waits, durables, phases, written = [], [], [], [], []
    for i in range(reps):
        perturb(model, opt, seed=i)  # a training step's worth of change: deltas see what they would in training
        disk.write()
        p = ck.save(warm + i + 1)
        next_step(opt)
        p.wait()
        stalls.append(p.stall_s)
        waits.append(p.step_wait_s)
        durables.append(p.durable_s)
        phases.append(dict(p.phases))
        written.append(p.bytes_written)
    backend = ck.backend_name
    lazy = ck._lazy
    ck.close()
    disk.write()  # the limit's file holds the same bytes again for the reads
    restores, ok = [], True
    for _ in range(reps):
        disk.read(fresh=False)
        disk.read(fresh=True)
        m2, o2 = build_state(preset, seed=1, step=False)  # a fresh process: the optimizer has no state yet
        drop_cache(d)
        restores.append(_timed(lambda: restore(d, m2, o2)))
        ok = ok and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    out: Dict[str, Any] = {"first_save_durable_s": first.durable_s, "restore_bit_exact": ok, "lazy_staging": lazy,
                           "bytes": statistics.median(written), "first_bytes": first.bytes_written,
                           "encoding": cfg.encoding, "extra_mem_bytes": mem.extra, "pool_bytes": pool,
                           "backend": backend,
                           "phases_s": {k: statistics.median(ph.get(k, 0.0) for ph in phases) for k in phases[0]}}
    record(out, "stall_s", stalls)  # save() call to return
    record(out, "step_wait_s", waits)
    record(out, "blocked_s", [a + b for a, b in zip(stalls, waits)])
    record(out, "durable_s", durables)
    record(out, "restore_s", restores)
    return out


def perturb(model, opt, seed: int, lr: float = 1e-4) -> None:
    """One AdamW-like update of every parameter and its moments from random gradients (seeded), outside every
    timing: what a save sees change between two checkpoints of a fine-tune at ``lr``."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                if not st or "exp_avg" not in st:
                    continue
                grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2
                st["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
                st["exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
                p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(1e-8), value=-lr)


def next_step(opt) -> None:
    """The optimizer step that follows a save, right after it returns (no forward or backward between to hide
    the copies behind: the most a step can wait); under lazy staging it waits for the save's copies, which
    the save records as ``step_wait_s``.  The gradients are absent (the bench's state keeps none), so the
    step updates nothing and the state stays the one saved."""
    if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        raise RuntimeError("the bench's optimizer step must find no gradients: it would change the saved state")
    opt.step()


def bench_selective(root: str, model, opt, cfg: Config) -> List[Dict[str, Any]]:
    """Selective saves of the same model with k blocks moved past the threshold: cost follows bytes."""
    from ..checkpointer import Checkpointer

    n = len(model.h)
    blocks = sorted({0, 1, n // 4, n // 2, n})

    d = os.path.join(root, "selective")
    cfg = cfg.replace(threshold=0.05, max_staleness=1000, keep_last=2)
    rows = []
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("h.")}
    with Checkpointer(d, model, opt, config=cfg) as ck:
        ck.save(0).wait()
        for i, k in enumerate(blocks):
            with torch.no_grad():
                for b in range(k):
                    for p in model.h[b].parameters():
                        p.mul_(1.1)  # a 10% drift
            p = ck.save(i + 1).wait()
            rows.append({"blocks_moved": k, "bytes": p.nbytes, "stall_s": p.stall_s, "durable_s": p.durable_s})
        tracker_bytes = ck.selector.tracker.memory_bytes
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    for r in rows:
        r["tracker_bytes"] = tracker_bytes
    return rows


def bench_overhead(root: str, steps: int = 80, every: int = 4) -> Dict[str, Any]:
    """Step time of the fine-tuning workload with a default-Config checkpoint every few steps, against none."""
    from ..checkpointer import Checkpointer
    from .workload import make_model, make_optimizer, run, start_finetune

    def timed_run(with_ckpt: bool) -> Tuple[float, int, int]:
        model = make_model(0)
        opt = make_optimizer(model)
        run(model, opt, "count", 0, 5)
        start_finetune(opt)
        ck = Checkpointer(os.path.join(root, "overhead"), model, opt) if with_ckpt else None
        written = []

        def after(step: int, loss: float) -> None:
            if ck is not None and (step + 1) % every == 0:
                written.append(ck.save(step + 1).nbytes)

        t0 = time.perf_counter()
        run(model, opt, "affine", 0, steps, after)
        t = time.perf_counter() - t0
        mem = 0
        if ck is not None:
            ck.close()
            mem = ck.selector.tracker.memory_bytes
        return t, sum(written), mem

    base = min(timed_run(False)[0] for _ in range(2))
    with_ck, written, mem = min((timed_run(True) for _ in range(2)), key=lambda r: r[0])
    return {"steps": steps, "every": every, "no_ckpt_s": base, "ckpt_s": with_ck,
            "overhead": with_ck / base - 1, "bytes": written, "tracker_bytes": mem}


def bench_torch_save(root: str, model, opt, preset: str = "gpt2-small", reps: int = 3) -> Dict[str, Any]:
    f = os.path.join(root, "torch.pt")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}

    def save(f):
        torch.save(sd, f)
        fsync_tree(f)

    def load(f, m2, o2):
        sd = torch.load(f, weights_only=True)
        m2.load_state_dict(sd["model"])
        o2.load_state_dict(sd["optim"])

    return _one_file(f, save, load, preset, reps)


def bench_safetensors(root: str, model, opt, preset: str = "gpt2-small", reps: int = 3) -> Dict[str, Any]:
    from safetensors.torch import load_file, save_file

    f = os.path.join(root, "st.safetensors")
    flat = {k: v.contiguous() for k, v in flat_tensors(model, opt).items()}

    def save(f):
        save_file(flat, f)
        fsync_tree(f)

    def load(f, m2, _):  # every tensor in memory, the model's loaded
        flat = load_file(f)
        m2.load_state_dict({k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}, strict=False)

    return _one_file(f, save, load, preset, reps)


def _one_file(f: str, save: Callable[[str], None], load: Callable[[str, Any, Any], None], preset: str,
              reps: int) -> Dict[str, Any]:
    """A one-file contender: ``reps`` saves, each to a new file (as layerckpt writes a new data file per save:
    deleting the previous one is outside the timing, as layerckpt's retention is), then ``reps`` cold loads
    of the last into a fresh model and optimizer.  The save is synchronous: what it blocks is its call."""
    saves, path = [], None
    for i in range(reps):
        if path is not None:
            os.unlink(path)
        path = f"{f}.{i}"
        saves.append(_timed(functools.partial(save, path)))
    loads = []
    for _ in range(reps):
        m2, o2 = build_state(preset, seed=1, step=False)
        drop_cache(path)
        loads.append(_timed(lambda: load(path, m2, o2)))
    out = {"bytes": os.path.getsize(path)}
    os.unlink(path)
    record(out, "stall_s", saves)
    record(out, "blocked_s", saves)
    record(out, "durable_s", saves)
    record(out, "restore_s", loads)
    return out


def bench_dcp(root: str, model, opt, preset: str = "gpt2-small", reps: int = 3) -> Dict[str, Any]:
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    d1, d2 = os.path.join(root, "dcp"), os.path.join(root, "dcp_async")
    out: Dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saves, astalls, adurables = [], [], []
        for _ in range(reps):
            shutil.rmtree(d1, ignore_errors=True)
            saves.append(_timed(lambda: dcp.save(sd, checkpoint_id=d1)))
        for _ in range(reps):
            shutil.rmtree(d2, ignore_errors=True)
            t0 = time.perf_counter()
            try:
                fut = dcp.async_save(sd, checkpoint_id=d2)
                astalls.append(time.perf_counter() - t0)
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                adurables.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - report, do not abort the bench
                out["async_error"] = f"{type(e).__name__}: {e}"
                break
        record(out, "durable_s", saves)
        record(out, "stall_s", saves)
        record(out, "blocked_s", saves)  # synchronous: the call is what training waits for
        if adurables:
            record(out, "async_stall_s", astalls)
            record(out, "async_durable_s", adurables)
        out["bytes"] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d1) for f in fs)
        loads = []
        for _ in range(reps):
            m2, o2 = build_state(preset, seed=1)  # DCP loads in place: the optimizer state must exist already
            target = {"model": m2.state_dict(), "optim": o2.state_dict()}
            drop_cache(d1)
            loads.append(_timed(lambda: dcp.load(target, checkpoint_id=d1)))
        record(out, "restore_s", loads)
    return out


def compression_rate(tensors: List[torch.Tensor], sample_bytes: int = 256 * MiB) -> Optional[Dict[str, Any]]:
    """layerckpt's own encoder (``encode_block``: byte planes + zstd, each tensor on its own, no delta) on one
    thread over a sample of the state, in its 1 MiB blocks: raw bytes per CPU second, and the ratio."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return None
    from ..format._encode import BLOCK, encode_block, warm

    warm()
    n = out = 0
    cpu = 0.0
    for t in tensors:
        if n >= sample_bytes:
            break
        flat = t.detach().reshape(-1)[: max(1, (sample_bytes - n) // t.element_size())]
        raw = flat.contiguous().view(torch.uint8).numpy()
        for o in range(0, raw.size, BLOCK):
            block = raw[o:o + BLOCK]
            t0 = time.thread_time()
            _, data = encode_block(block, None, t.element_size())
            cpu += time.thread_time() - t0
            out += block.size if data is None else len(data)
        n += raw.size
    return {"gbps": n / max(cpu, 1e-9) / 1e9, "ratio": n / max(out, 1), "sample_bytes": n,
            "what": "layerckpt's encoder (byte planes + zstd, no delta), one thread"}


def checksum_rate() -> float:
    b = bytearray(os.urandom(1 << 20) * 256)
    t = min(_timed(lambda: checksum(b)) for _ in range(3))
    return len(b) / t / 1e9
