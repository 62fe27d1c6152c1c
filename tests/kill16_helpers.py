"""Sixteen gloo ranks on one machine, one of them killed: the launcher of tests/test_kill16.py.

``python tests/kill16_helpers.py`` imports torch and layerckpt once, starts no thread, then reads one run per
line on stdin (JSON, :class:`Run`'s fields) and answers one JSON line per run on stdout.  A run forks WORLD
ranks from the launcher (no fresh interpreter per rank).  Each rank joins gloo through a TCP store on loopback
(hosted by a process of the launcher's, as torchrun's agent hosts it, or by rank 0), builds a small model whose
sharded tensors are DTensors over a 16-rank mesh (each rank holds rows of its own) beside a replicated
LayerNorm, opens a Checkpointer (or opens it after the restore), restores the newest committed checkpoint and
checks it against the reference its rank wrote at that save (model shards, optimizer state, RNG: bit for
bit), then trains and saves ``steps`` steps, writing its reference of each step before saving it.

One rank dies by SIGKILL: at a named point in its own process (``point`` at ``step``), or from the launcher
at a random moment once its log shows ``after`` (``delay_s`` later).  The launcher waits for every rank until
``timeout_s``; a rank still alive then is a hang: its log gets every thread's stack, then it is killed and
its exit reported as None.  Each rank's log is its stdout and stderr: ``RESTORING``, ``RESTORED <step>``,
``CHECKED <step>`` (or ``MISMATCH``), ``COMMITTED <step>``, ``FAILED <json>`` (where, the exception's type and
message), ``DONE``.
"""
from __future__ import annotations

import datetime
import faulthandler
import itertools
import json
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

WORLD = 16
ROWS = {"0.weight": 4, "1.weight": 2, "1.bias": 2}  # rows per rank of each sharded tensor (Shard(0))
REPLICATED = ("2.weight", "2.bias")  # the same on every rank, as DDP keeps it: written by one rank
KEEP_LAST = 2

# named points where a rank kills itself: the library's fault points, and two around ``_commit.publish`` (the
# ranks' results are exchanged and agreed; rank 0 commits, then tells every rank whether it did)
AGREED = "commit.agreed"  # this rank agreed with the others on the save's files, before the commit's outcome
SEEN = "commit.seen"  # this rank has learned that its save is committed, before wait() returns


@dataclass
class Run:
    root: str  # the store
    refs: str  # references per (step, rank): what each rank saved
    logs: str  # a log per rank (cleared per run)
    first: int  # the first step this run saves
    steps: int  # how many saves
    restore: bool = True  # restore the newest committed first (there is one)
    order: str = "ckpt-first"  # or "restore-first": the Checkpointer opened after the restore
    kill_rank: Optional[int] = None
    point: Optional[str] = None  # a named point (see above) ...
    step: Optional[int] = None  # ... the first time the save (or restore, for read.*) of this step reaches it
    after: Optional[str] = None  # or: the launcher kills once kill_rank's log has this line ...
    delay_s: float = 0.0  # ... this long after
    timeout_s: float = 60.0  # for the whole run: a rank alive past it hangs
    gloo_timeout_s: float = 30.0  # the training's process group (and so the Checkpointer's)
    store: str = "launcher"  # who hosts the rendezvous store: "launcher" (as torchrun's agent does) or "rank0"
    keep_last: int = KEEP_LAST


@dataclass
class Outcome:
    exit: Dict[int, Optional[int]] = field(default_factory=dict)  # exit code (-9: SIGKILL), None: hung
    logs: Dict[int, str] = field(default_factory=dict)
    killed_at_s: Optional[float] = None  # when the launcher's SIGKILL went (random-time kills)
    wall_s: float = 0.0


# ------------------------------------------------------------------ one rank


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Make this process die the first time it reaches ``point``."""
    from layerckpt.write import _commit
    from layerckpt import _faults

    if point in (AGREED, SEEN):
        publish = _commit.publish

        def dying(*a, **kw):
            if point == AGREED:
                _die()
            out = publish(*a, **kw)
            _die()
            return out

        _commit.publish = dying
    else:
        _faults.install(point, _die)


def build(rank: int, mesh):
    """The model (sharded rows of this rank as DTensors, a replicated LayerNorm) and its optimizer."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(ROWS["0.weight"] * WORLD, 8),
                                torch.nn.Linear(8, ROWS["1.weight"] * WORLD), torch.nn.LayerNorm(8))
    for name, n in ROWS.items():
        mod, attr = name.rsplit(".", 1)
        whole = getattr(model.get_submodule(mod), attr).detach()
        local = whole[rank * n:(rank + 1) * n].clone()
        setattr(model.get_submodule(mod), attr,
                torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def train(model, opt, mesh, rank: int, step: int) -> None:
    """One optimizer step on gradients of this (step, rank): distinct on every rank's shards, equal on the
    replicated tensors."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(step * 1000 + i * 100 + (rank if name in ROWS else 0))
        grad = torch.randn(local(p).shape, generator=g)
        p.grad = DTensor.from_local(grad, mesh, [Shard(0)], run_check=False) if name in ROWS else grad
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(step * 1000 + rank)  # each rank's RNG its own, saved with the step


def state(model, opt) -> dict:
    """This rank's part of what a save holds: model tensors (local shards), optimizer state, RNG."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {n: local(t).clone() for n, t in model.state_dict().items()},
            "optim": {f"{names[id(p)]}/{k}": local(v).clone() if torch.is_tensor(v) else v
                      for p, st in opt.state.items() for k, v in st.items()},
            "rng": torch.get_rng_state()}


def ref_path(refs: str, step: int, rank: int) -> str:
    return os.path.join(refs, f"step{step}.rank{rank}.pt")


def write_ref(refs: str, step: int, rank: int, st: dict) -> None:
    import torch

    path = ref_path(refs, step, rank)
    torch.save(st, path + ".tmp")
    os.replace(path + ".tmp", path)  # a rank killed while writing it leaves no torn reference


def differences(got: dict, want: dict) -> List[str]:
    """What differs, bit for bit, between two :func:`state` dicts."""
    import torch

    out = []
    for part in ("model", "optim"):
        if got[part].keys() != want[part].keys():
            out.append(f"{part} keys {sorted(got[part])} != {sorted(want[part])}")
            continue
        for k, v in want[part].items():
            w = got[part][k]
            same = (torch.is_tensor(v) and torch.is_tensor(w) and v.dtype == w.dtype and v.shape == w.shape
                    and torch.equal(v, w)) or (not torch.is_tensor(v) and v == w)
            if not same:
                out.append(f"{part}/{k}")
    if not torch.equal(got["rng"], want["rng"]):
        out.append("rng")
    return out


def rank_main(rank: int, run: Run, port: int, prefix: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import layerckpt

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks a hung rank where it is
    where = "init"
    try:
        timeout = datetime.timedelta(seconds=run.gloo_timeout_s)
        if run.store == "rank0":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                    timeout=timeout)
        else:  # the launcher's store, under a prefix of this run's own
            store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        mesh = init_device_mesh("cpu", (WORLD,))
        model, opt = build(rank, mesh)
        cfg = layerckpt.Config(threshold=0.0, keep_last=run.keep_last, chunk_bytes="64KiB", staging_bytes="256KiB")
        mine = rank == run.kill_rank and run.point is not None
        ck = None
        if run.order == "ckpt-first":
            where = "open"
            ck = layerckpt.Checkpointer(run.root, model, opt, config=cfg)
        if run.restore:
            where = "restore"
            if mine and run.point.startswith("read."):
                arm(run.point)
            print("RESTORING", flush=True)
            report = layerckpt.restore(run.root, model, opt)
            print("RESTORED", report.step, flush=True)
            want = torch.load(ref_path(run.refs, report.step, rank), weights_only=True)
            bad = differences(state(model, opt), want)
            if bad:
                print("MISMATCH", report.step, " ".join(bad), flush=True)
                os._exit(3)
            print("CHECKED", report.step, flush=True)
        if ck is None:
            where = "open"
            ck = layerckpt.Checkpointer(run.root, model, opt, config=cfg)
        for step in range(run.first, run.first + run.steps):
            where = f"save {step}"
            train(model, opt, mesh, rank, step)
            write_ref(run.refs, step, rank, state(model, opt))
            if mine and step == run.step and not run.point.startswith("read."):
                arm(run.point)
            ck.save(step).wait()
            print("COMMITTED", step, flush=True)
        where = "close"
        ck.close()
        dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks fails the peer
        dist.destroy_process_group()
        print("DONE", flush=True)
    except BaseException as e:  # noqa: BLE001 - what a survivor was told is what the test checks
        print("FAILED", json.dumps({"where": where, "type": type(e).__name__, "message": str(e)}), flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # leave without the interpreter's teardown (gloo's threads can abort it there: tests/test_exit.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(run: Run, rank: int) -> str:
    return os.path.join(run.logs, f"rank{rank}.log")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def serve_store() -> int:
    """Fork the process that hosts the rendezvous store for every run (as torchrun's agent hosts it, so a dead
    rank 0 does not take it along); returns its port.  It ends with the launcher."""
    r, w = os.pipe()
    alive_r, alive_w = os.pipe()
    if os.fork() == 0:
        try:
            import torch.distributed as dist

            os.close(r)
            os.close(alive_w)  # the launcher's end: its exit closes it, and the read below returns
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            os.write(w, str(store.port).encode())
            os.read(alive_r, 1)  # until the launcher is gone
        finally:
            os._exit(0)
    os.close(alive_r)
    port = int(os.read(r, 16))
    os.close(r)
    os.close(w)
    return port


_runs = itertools.count()  # each run its own prefix in the store


def launch(run: Run, store_port: int) -> Outcome:
    """Fork the ranks of one run, kill one where it says, wait for all of them (``timeout_s``)."""
    os.makedirs(run.logs, exist_ok=True)
    os.makedirs(run.refs, exist_ok=True)
    port = _free_port() if run.store == "rank0" else store_port
    prefix = f"run{next(_runs)}/"
    t0 = time.monotonic()
    pids: Dict[int, int] = {}
    for rank in range(WORLD):
        path = _log(run, rank)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the rank: its stdout and stderr go to its log
            try:
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                rank_main(rank, run, port, prefix)
            finally:
                os._exit(70)
        os.close(fd)
        pids[pid] = rank
    out = Outcome()
    by_rank = {r: p for p, r in pids.items()}
    trigger: Optional[float] = None
    deadline = t0 + run.timeout_s
    while pids and time.monotonic() < deadline:
        if run.after is not None and out.killed_at_s is None and run.kill_rank in by_rank:
            if trigger is None and run.after in _read(_log(run, run.kill_rank)).splitlines():
                trigger = time.monotonic() + run.delay_s
            if trigger is not None and time.monotonic() >= trigger:
                try:
                    os.kill(by_rank[run.kill_rank], signal.SIGKILL)
                    out.killed_at_s = round(time.monotonic() - t0, 3)
                except ProcessLookupError:
                    pass
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.005)
            continue
        if pid in pids:  # not the store's process
            out.exit[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
    for pid in pids:  # alive past the timeout: a hang; its log says where (every thread's stack)
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5 if pids else 0)
    for pid, rank in pids.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        out.exit[rank] = None
    out.wall_s = round(time.monotonic() - t0, 3)
    out.logs = {r: _read(_log(run, r)) for r in range(WORLD)}
    return out


def warm() -> None:
    """What every rank would otherwise import by itself after the fork (16 times over on few cores).  Runs no
    torch operation and starts no thread: the ranks are forked from this process."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - a DTensor's first operation imports it
    import torch.distributed.tensor  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import layerckpt  # noqa: F401
    import layerckpt.checkpointer  # noqa: F401
    import layerckpt.restore  # noqa: F401


# ------------------------------------------------------------------ reading a rank's log


@dataclass
class RankLog:
    committed: List[int]  # steps whose save() returned committed on this rank
    checked: Optional[int]  # the step it restored and found equal to its reference, bit for bit
    failed: Optional[dict]  # where, type, message: what this rank was told
    mismatch: Optional[str]  # what differed from its reference after a restore


def read_log(text: str) -> RankLog:
    log = RankLog([], None, None, None)
    for line in text.splitlines():
        tag, _, rest = line.partition(" ")
        if tag == "COMMITTED" and rest.isdigit():  # a line cut short by the kill is not a report
            log.committed.append(int(rest))
        elif tag == "CHECKED" and rest.isdigit():
            log.checked = int(rest)
        elif tag == "FAILED" and rest.endswith("}"):
            log.failed = json.loads(rest)
        elif tag == "MISMATCH":
            log.mismatch = rest
    return log


def main() -> None:
    warm()
    if len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("the launcher started a thread before forking its ranks")
    store_port = serve_store()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        run = Run(**json.loads(line))
        print(json.dumps(asdict(launch(run, store_port))), flush=True)


if __name__ == "__main__":
    main()

