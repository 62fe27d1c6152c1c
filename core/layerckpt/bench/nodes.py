"""`layerckpt bench --nodes`: node-local checkpoint directories, peer replicas and node-loss restores, on
simulated nodes of one machine.

``--nodes N`` torchrun node launchers (``--nnodes N --node-rank K``, static rendezvous on loopback; two
launchers on one host are two nodes to layerckpt), ``--nproc`` processes each, every rank holding the same
GPT-2-shaped model and AdamW (``--size``, GPT-2 mini by default), trained as under DDP: one fixed batch, the
gradients averaged over the ranks with one all-reduce, so every rank holds bit-for-bit the same state (checked).
Each node is a node to layerckpt: ``LAYERCKPT_NODE=node<K>``, its own memory-tier base ``LAYERCKPT_SHM``
(a 0700 folder under /dev/shm) and its own checkpoint directory ``<run>/<set>/node<K>``.

Two launches of the same N launchers: ``save`` (the saves, the replication, the step times) and ``restore``
(fresh processes, as after a crash or a node's loss).  In one run, with the same repeats for every contender
(after one untimed warm-up each), median [min-max]:

1. time to durable of a full save (``Config(threshold=0.0)``), from the call until every rank's data is on disk
   and committed (the slowest rank): (a) node-local directories, (b) one directory shared by every rank (the
   same disk), (c) ``dcp.save`` of ``{"model", "optim"}`` to one shared directory (a fresh one each time, each
   rank's files fsynced, then a barrier), and node-local directories with ``replicas=1``.  The state takes one
   training step before each repeat (outside the timings), so every contender saves the same changed state.
2. with ``replicas=1``: how far each node's replica lags its commit (``Checkpointer.replicas["lag_s"]``), the
   bytes each node sends per checkpoint (``bytes_sent / rounds``) and holds for its partner.
3. step time: ``--steps-n`` training steps per round, ``--steps-rounds`` rounds (each in the reverse order of
   the one before), a full save every ``--steps-every`` steps that training does not wait for (``save()``
   returns, the steps go on; each round's saves drained after its last step, outside the step times): no
   checkpointing, ``replicas=0`` and ``replicas=1``.
4. restores into a fresh model and optimizer, every file dropped from the page cache first (the replicas are
   in memory: the partner's /dev/shm), the wall time of the restore call on the slowest rank after a barrier:
   a process crash (each node reads its own disk: sources "disk"), the loss of node N-1 (its directory and its
   ``LAYERCKPT_SHM`` contents deleted) restored from its partner's replica (sources "replica" for its ranks),
   the same loss without replicas restored from the remote tier (sources "remote" for its ranks; the library
   then reads the whole composite from the remote on every rank; moto's S3 server on loopback, or a file://
   folder where moto cannot be imported), and ``dcp.load`` + ``load_state_dict`` from the shared DCP directory;
   beside them, a process crash's restore from the shared directory of (b) (one store: no parts to exchange
   between the nodes).  Every restored model and optimizer is compared with the saved state tensor by tensor
   (``torch.equal``) inside the workers: a difference fails the run.

Run it as ``layerckpt bench --nodes [N]``: it starts the launchers, the S3 server and the folders itself
(``python -m layerckpt.bench.nodes --phase ...`` is the launchers' target, not a command to run by hand).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import Config
from .machine import _ARGV_ENV, _command, machine
from .models import GPT
from .sharded import SIZES

SAVES = ("node-local", "shared", "dcp.save", "node-local replicas=1")
RESTORES = ("disk", "shared", "replica", "remote", "dcp.load")
STEP_RUNS = ("none", "replicas=0", "replicas=1")
#: restore -> the checkpoint set it reads (a folder under the run's root)
RESTORE_SET = {"disk": "local", "shared": "shared", "replica": "replica", "remote": "remote"}
TARGETS = {"node-local durable / shared durable": 1.1, "replicas=1 step / replicas=0 step": 1.1,
           "replica restore / disk restore": 1.5}
GLOO_TIMEOUT_S = 300
REMOTE_ENV = "LAYERCKPT_BENCH_NODES_REMOTE"  # the remote tier the parent started: {"url", "options", "kind"}
KEEP_LAST = 2


# ---------------------------------------------------------------- model and training (every rank the same)

def build(size: str, seed: int = 0) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = GPT(SIZES[size])
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


def fixed_batch(m: torch.nn.Module) -> torch.Tensor:
    c = m.config
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, c.vocab_size, (2, min(64, c.n_positions) + 1), generator=g)


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """Forward, backward, the gradients averaged over the ranks (DDP's arithmetic, one flat all-reduce), AdamW."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    c = m.config
    logits = m(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.vocab_size), x[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(v)
    opt.step()
    opt.zero_grad(set_to_none=True)


def tensors(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Every tensor of the state once (tied weights once), AdamW's moments and steps included."""
    names = {id(p): n for n, p in m.named_parameters()}
    out = {f"model/{n}": p.detach() for n, p in m.named_parameters()}
    out.update({f"model/{n}": b for n, b in m.named_buffers()})
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = v
    return out


def nbytes(ts: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def fingerprint(ts: Dict[str, torch.Tensor]) -> int:
    """A CRC-32 of every tensor's bytes, in name order."""
    crc = 0
    for k in sorted(ts):
        t = ts[k].detach().contiguous()
        crc = zlib.crc32(k.encode(), crc)
        if t.numel():
            crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
    return crc


def snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    return {"model": m.state_dict(), "optim": opt.state_dict()}


def differences(m: torch.nn.Module, opt: torch.optim.Optimizer, ref: Dict[str, Any]) -> List[str]:
    """What of the model's and optimizer's state differs from ``ref`` (a :func:`snapshot`): every tensor compared
    with ``torch.equal``, every other value with ``==``."""
    bad: List[str] = []

    def cmp(path: str, a: Any, b: Any) -> None:
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                bad.append(path)
        elif isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                bad.append(f"{path} (keys)")
                return
            for k in b:
                cmp(f"{path}/{k}", a[k], b[k])
        elif isinstance(b, (list, tuple)):
            if not isinstance(a, (list, tuple)) or len(a) != len(b):
                bad.append(f"{path} (length)")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                cmp(f"{path}/{i}", x, y)
        elif a != b:
            bad.append(path)

    cmp("model", m.state_dict(), ref["model"])
    cmp("optim", opt.state_dict(), ref["optim"])
    return bad


# ---------------------------------------------------------------- across ranks

def _barrier() -> None:
    dist.barrier()


def _gather(x: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _slowest(xs: List[float]) -> List[float]:
    """Per repeat, the slowest rank's figure (a collective)."""
    return [max(v) for v in zip(*_gather(xs))]


def summary(xs: Sequence[float]) -> Dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def _busy_s() -> float:
    """Core-seconds every CPU of the machine has been busy since boot (/proc/stat; 0 where unreadable)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    busy = sum(v[:3]) + sum(v[5:8])  # user nice system (idle iowait) irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _rotate(names: Sequence[str], i: int) -> List[str]:
    k = i % len(names)
    return list(names[k:]) + list(names[:k])


class Where:
    """This rank's place: its node (torchrun's GROUP_RANK), the nodes' ranks, the run's folders."""

    def __init__(self, root: str, nnodes: int):
        self.root, self.nnodes = root, nnodes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node = int(os.environ["GROUP_RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        nodes = _gather(self.node)
        self.ranks_of = {k: [r for r, n in enumerate(nodes) if n == k] for k in range(nnodes)}
        self.lost = nnodes - 1  # the node the node-loss restores lose

    def node_dir(self, kind: str, node: Optional[int] = None) -> str:
        return os.path.join(self.root, kind, f"node{self.node if node is None else node}")

    def mkdirs(self, *kinds: str) -> None:
        for kind in kinds:
            os.makedirs(self.node_dir(kind), exist_ok=True)
        _barrier()

    def lose_node(self, kind: str) -> None:
        """Node ``lost``'s directory of ``kind`` and everything in its memory-tier base gone (its lowest rank
        deletes them); a barrier."""
        if self.node == self.lost and self.local_rank == 0:
            shutil.rmtree(self.node_dir(kind), ignore_errors=True)
            shm = os.environ["LAYERCKPT_SHM"]
            for name in os.listdir(shm):
                p = os.path.join(shm, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
        _barrier()

    def drop_cache(self, path: str) -> None:
        """Every file under ``path`` synced and dropped from the page cache (rank 0: one host), then a barrier."""
        from .cases import drop_cache

        if self.rank == 0 and os.path.exists(path):
            drop_cache(path)
        _barrier()


def _remote() -> Dict[str, Any]:
    return json.loads(os.environ[REMOTE_ENV])


def _full(**kw: Any) -> Config:
    return Config(threshold=0.0, keep_last=KEEP_LAST, **kw)


# ---------------------------------------------------------------- phase 1: saves, replication, step times

def _layerckpt_save(ck, step: int) -> Tuple[float, float, float, int]:
    """(blocked, durable, settled: the replicas and tier copies done too, bytes of this rank) of one save."""
    _barrier()
    t0 = time.perf_counter()
    p = ck.save(step)
    blocked = time.perf_counter() - t0
    p.wait()
    durable = time.perf_counter() - t0
    ck.wait()
    settled = time.perf_counter() - t0
    _barrier()
    return blocked, durable, settled, p.bytes_written


def _dcp_save(root: str, i: int, m, opt) -> Tuple[float, float, int, str]:
    """(blocked = durable, durable, bytes of this rank, the folder) of one dcp.save to a fresh folder."""
    import torch.distributed.checkpoint as dcp

    from .sharded import _dcp_state, dcp_files, fsync_files

    rank = dist.get_rank()
    d = os.path.join(root, f"dcp-{i}")
    _barrier()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_dcp_state(m, opt), checkpoint_id=d)
    fsync_files(dcp_files(d, rank), d if rank == 0 else None)
    durable = time.perf_counter() - t0
    _barrier()
    if rank == 0:  # the folders before this one, outside the timings
        for old in range(i):
            shutil.rmtree(os.path.join(root, f"dcp-{old}"), ignore_errors=True)
    return durable, durable, sum(os.path.getsize(f) for f in dcp_files(d, rank)), d


def _replication(stats: List[Dict[str, Any]], w: Where, skip: int) -> Dict[str, Any]:
    """What every node's lowest rank reported of its replication; ``skip`` rounds (warm-up) left out of the lag."""
    per = {f"node{k}": stats[w.ranks_of[k][0]] for k in range(w.nnodes)}
    out: Dict[str, Any] = {"nodes": per}
    errors = {n: s.get("error") for n, s in per.items() if s.get("error")}
    if errors or any(not s for s in per.values()):
        raise RuntimeError(f"the replication did not run or failed: {per}")
    lags = [s["lag_s"] for s in per.values()]
    rounds = min(len(x) for x in lags)
    every = [max(x[j] for x in lags) for j in range(skip, rounds)]  # a round's replicas complete on every node
    out["lag_s"] = summary(every) if every else None
    out["bytes_sent_per_checkpoint"] = {n: s["bytes_sent"] / s["rounds"] for n, s in per.items() if s["rounds"]}
    out["bytes_sent_per_checkpoint_total"] = sum(out["bytes_sent_per_checkpoint"].values())
    out["bytes_held"] = {n: s["bytes_held"] for n, s in per.items()}
    out["bytes_held_total"] = sum(out["bytes_held"].values())
    return out


def phase_save(a, w: Where) -> Optional[Dict[str, Any]]:
    from ..checkpointer import Checkpointer

    m, opt = build(a.size)
    x = fixed_batch(m)
    train_step(m, opt, x)  # every parameter has its AdamW moments
    ts = tensors(m, opt)
    res: Dict[str, Any] = {"parameters": sum(p.numel() for p in m.parameters()), "state_bytes": nbytes(ts),
                           "world": w.world, "ranks_of": {f"node{k}": v for k, v in w.ranks_of.items()}}
    if w.rank == 0:  # the machine's own limits, rank 0 alone while the others wait
        from .cases import memcpy_time
        from .sharded import disk_reference

        res["reference"] = disk_reference(w.root, res["state_bytes"])
        res["reference"]["memcpy_s"] = memcpy_time(list(ts.values()))
    _barrier()

    # 1 and 2: full saves to durable, the same state for every contender in each repeat
    w.mkdirs("local", "replica")
    os.makedirs(os.path.join(w.root, "shared"), exist_ok=True)
    cks = {"node-local": Checkpointer(w.node_dir("local"), m, opt, config=_full()),
           "shared": Checkpointer(os.path.join(w.root, "shared"), m, opt, config=_full()),
           "node-local replicas=1": Checkpointer(w.node_dir("replica"), m, opt, config=_full(replicas=1))}
    split = {n: ck.placement.split for n, ck in cks.items()}
    if split != {"node-local": w.nnodes > 1, "shared": False, "node-local replicas=1": w.nnodes > 1}:
        raise RuntimeError(f"layerckpt did not see the directories as laid out (node-local: one store per node; "
                           f"shared: one store): split = {split}")
    saves: Dict[str, Dict[str, List[Any]]] = {n: {"blocked": [], "durable": [], "settled": [], "bytes": []}
                                              for n in SAVES}
    for i in range(a.reps + 1):  # repeat 0 is every contender's warm-up (layerckpt's: allocates its pool)
        if i:
            train_step(m, opt, x)  # a changed state, the same for every contender of this repeat
        for name in _rotate(SAVES, i):
            if name == "dcp.save":
                b, d, n, res["dcp_dir"] = _dcp_save(w.root, i, m, opt)
                s = d
            else:
                b, d, s, n = _layerckpt_save(cks[name], i)
            if i:
                for k, v in zip(("blocked", "durable", "settled", "bytes"), (b, d, s, n)):
                    saves[name][k].append(v)
    res["saves"] = {}
    for name in SAVES:
        r = saves[name]
        res["saves"][name] = {"blocked_s": summary(_slowest(r["blocked"])),
                              "durable_s": summary(_slowest(r["durable"])),
                              "bytes_per_rank": _gather(r["bytes"][-1])}
        if name == "node-local replicas=1":
            res["saves"][name]["replicated_s"] = summary(_slowest(r["settled"]))
    res["replication"] = _replication(_gather(cks["node-local replicas=1"].replicas), w, skip=1)

    # the reference every restore is compared with: the state every contender saved last, the same on every rank
    prints = _gather(fingerprint(tensors(m, opt)))
    if len(set(prints)) != 1:
        raise RuntimeError(f"the ranks' states differ (CRC-32 per rank {prints}): the training is not replicated")
    if w.rank == 0:
        torch.save(snapshot(m, opt), os.path.join(w.root, "reference.pt"))

    # the remote set: node-local directories without replicas, every composite copied to the remote tier
    remote = _remote()
    w.mkdirs("remote")
    with Checkpointer(w.node_dir("remote"), m, opt,
                      config=_full(remote=remote["url"], remote_options=remote["options"])) as ck:
        _, d, s, _ = _layerckpt_save(ck, a.reps)
        res["remote_save"] = {"durable_s": max(_gather(d)), "uploaded_s": max(_gather(s))}
    for ck in cks.values():
        ck.close()
    del cks
    _barrier()

    res["steps"] = step_times(a, w, m, opt, x)
    return res if w.rank == 0 else None


def step_times(a, w: Where, m, opt, x) -> Dict[str, Any]:
    """3: training steps with a save every ``steps_every`` that no step waits for."""
    from ..checkpointer import Checkpointer

    w.mkdirs("steps0", "steps1")
    cks = {"replicas=0": Checkpointer(w.node_dir("steps0"), m, opt, config=_full()),
           "replicas=1": Checkpointer(w.node_dir("steps1"), m, opt, config=_full(replicas=1))}
    steps = {n: 0 for n in cks}
    for n, ck in cks.items():  # warm-up: the save that allocates the pool, waited for
        ck.save(0).wait()
        ck.wait()
    _barrier()
    times: Dict[str, List[List[float]]] = {n: [] for n in STEP_RUNS}
    drain: Dict[str, List[float]] = {n: [] for n in cks}
    # CPU: this rank's (every thread: training, layerckpt's, gloo's) and the machine's, per run; the difference
    # is what other processes took of the cores meanwhile
    cpu: Dict[str, List[float]] = {n: [] for n in STEP_RUNS}
    busy: Dict[str, List[Tuple[float, float]]] = {n: [] for n in STEP_RUNS}
    saved: Dict[str, int] = {n: 0 for n in cks}
    for r in range(a.steps_rounds):
        for name in (STEP_RUNS if r % 2 == 0 else tuple(reversed(STEP_RUNS))):
            ck = cks.get(name)
            one: List[float] = []
            _barrier()
            c0, b0, w0 = time.process_time(), _busy_s(), time.perf_counter()
            for s in range(1, a.steps_n + 1):
                t0 = time.perf_counter()
                train_step(m, opt, x)
                if ck is not None and s % a.steps_every == 0 and s < a.steps_n:
                    steps[name] += 1
                    ck.save(steps[name])  # not waited: training goes on
                    saved[name] += 1
                one.append(time.perf_counter() - t0)
            times[name].append(one)
            if ck is not None:  # this round's last save settled before the next contender runs
                t0 = time.perf_counter()
                ck.wait()
                drain[name].append(time.perf_counter() - t0)
            _barrier()
            cpu[name].append(time.process_time() - c0)
            busy[name].append((_busy_s() - b0, time.perf_counter() - w0))
    during = _replication(_gather(cks["replicas=1"].replicas), w, skip=1)
    for ck in cks.values():
        ck.close()
    runs: Dict[str, Any] = {}
    for name in STEP_RUNS:
        per_rank = _gather([statistics.fmean(one) for one in times[name]])  # rank -> each round's mean
        rounds = [max(v) for v in zip(*per_rank)]
        means = [statistics.fmean([t for one in rt for t in one]) for rt in _gather(times[name])]
        runs[name] = {"mean_step_s": max(means), "round_means_s": rounds,
                      "step_s": summary(_slowest([t for one in times[name] for t in one]))}
        ours = [sum(v) for v in zip(*_gather(cpu[name]))]  # every rank's CPU seconds, per round
        wall = [w_ for _, w_ in busy[name]]
        runs[name]["cpu_s_all_ranks"] = ours  # per round, the steps and the drain
        runs[name]["others_cores"] = [max(0.0, (b - o) / w_) for (b, w_), o in zip(busy[name], ours)]
        runs[name]["round_wall_s"] = wall
        if name in cks:
            runs[name]["saves"] = saved[name]
            runs[name]["drain_s"] = _slowest(drain[name])
        # the steps and the drains: the background work that no timed step absorbed counted in too
        n = a.steps_n * a.steps_rounds
        runs[name]["mean_step_with_drain_s"] = max(
            _gather((sum(t for one in times[name] for t in one) + sum(drain.get(name, []))) / n))
    return {"steps_per_round": a.steps_n, "every": a.steps_every, "rounds": a.steps_rounds, "runs": runs,
            "replication_during_training": during}


# ---------------------------------------------------------------- phase 2: restores in fresh processes

def _sources_ok(name: str, w: Where, sources: Dict[int, str]) -> bool:
    """Whether ``sources`` is what the restore ``name`` must show: every rank "disk" after a crash; after node
    ``lost``'s loss its ranks "replica" (the others their own "disk"), or "remote" (the others "disk" or
    "remote": where a part is nowhere among the nodes, the library reads the whole composite from the remote)."""
    lost = set(w.ranks_of[w.lost])
    if name == "shared":
        return sources == {}  # one directory: no parts
    if set(sources) != set(range(w.world)):
        return False
    if name == "disk":
        return all(v == "disk" for v in sources.values())
    if name == "replica":
        return all(v == ("replica" if r in lost else "disk") for r, v in sources.items())
    return all(v == "remote" if r in lost else v in ("disk", "remote") for r, v in sources.items())


def _restore_one(name: str, w: Where, size: str, dcp_dir: str, ref: Dict[str, Any]) -> Tuple[float, float, Any]:
    """(wall seconds of the restore call on this rank, report.seconds, report.sources) of one restore into a
    fresh model and optimizer, checked tensor by tensor against ``ref``."""
    from ..restore import restore

    m, opt = build(size, seed=1)  # other weights than the saved ones
    if name in ("replica", "remote"):
        w.lose_node(RESTORE_SET[name])
    w.drop_cache(os.path.join(w.root, RESTORE_SET.get(name, os.path.basename(dcp_dir))))
    remote = _remote()
    cfg = {"disk": _full(), "shared": _full(), "replica": _full(replicas=1),
           "remote": _full(remote=remote["url"], remote_options=remote["options"])}.get(name)
    _barrier()
    t0 = time.perf_counter()
    if name == "dcp.load":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from .sharded import _dcp_state

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = _dcp_state(m, opt)  # DCP loads in place: this creates the optimizer state
            dcp.load(sd, checkpoint_id=dcp_dir)
            set_model_state_dict(m, sd["model"])
            set_optimizer_state_dict(m, opt, sd["optim"])
        seconds, sources = time.perf_counter() - t0, None
    else:
        where = os.path.join(w.root, "shared") if name == "shared" else w.node_dir(RESTORE_SET[name])
        rep = restore(where, m, opt, config=cfg)
        seconds, sources = rep.seconds, {int(r): s for r, s in rep.sources.items()}
    wall = time.perf_counter() - t0
    bad = differences(m, opt, ref)
    if bad:
        raise AssertionError(f"restore {name!r}: rank {w.rank}'s model and optimizer differ from the saved state "
                             f"in {len(bad)} entries, e.g. {bad[:5]}")
    if sources is not None and not _sources_ok(name, w, sources):
        raise AssertionError(f"restore {name!r}: sources {sources} are not what it must read (node{w.lost} lost: "
                             f"ranks {w.ranks_of[w.lost]}; see _sources_ok)")
    _barrier()
    return wall, seconds, sources


def phase_restore(a, w: Where, dcp_dir: str) -> Optional[Dict[str, Any]]:
    ref = torch.load(os.path.join(w.root, "reference.pt"), mmap=True, weights_only=True)
    walls: Dict[str, List[float]] = {n: [] for n in RESTORES}
    secs: Dict[str, List[float]] = {n: [] for n in RESTORES}
    sources: Dict[str, Any] = {}
    for i in range(a.reps + 1):  # repeat 0: every contender's untimed warm-up (imports, first reads)
        for name in _rotate(RESTORES, i):
            wall, s, src = _restore_one(name, w, a.size, dcp_dir, ref)
            if i:
                walls[name].append(wall)
                secs[name].append(s)
                sources[name] = src
    out: Dict[str, Any] = {}
    for name in RESTORES:
        out[name] = {"s": summary(_slowest(walls[name])), "report_s": summary(_slowest(secs[name])),
                     "sources": None if sources[name] is None else {str(r): v for r, v in sources[name].items()},
                     "bit_exact": True}  # a difference raised above, on the rank that saw it
    return {"restores": out, "lost_node": f"node{w.lost}"} if w.rank == 0 else None


# ---------------------------------------------------------------- a worker under torchrun

def worker(a) -> None:
    """One rank of one phase; rank 0 writes ``<root>/result.<phase>.json``; a failing rank writes
    ``<root>/error.<phase>.rank<R>.txt`` and exits 1."""
    rank = os.environ.get("RANK", "?")
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        w = Where(a.root, a.nnodes)
        if a.phase == "save":
            res = phase_save(a, w)
        else:
            with open(os.path.join(a.root, "result.save.json")) as f:
                dcp_dir = json.load(f)["dcp_dir"]
            res = phase_restore(a, w, dcp_dir)
        if res is not None:
            tmp = os.path.join(a.root, f"result.{a.phase}.json.tmp")
            with open(tmp, "w") as f:
                json.dump(res, f)
            os.replace(tmp, os.path.join(a.root, f"result.{a.phase}.json"))
        dist.barrier()  # leave together
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the parent reports what each rank was told
        try:
            with open(os.path.join(a.root, f"error.{a.phase}.rank{rank}.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    # leave without the interpreter's finalization, during which gloo's threads now and then abort the process
    # (as bench/sharded.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the parent: folders, remote, launchers

_STRIP = ("LAYERCKPT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "GROUP_WORLD_SIZE", "ROLE_", "TORCHELASTIC_", "OMP_NUM_THREADS")


class Remote:
    """The remote tier of the run: moto's S3 server on a free loopback port in this process (a bucket of its
    own), or a file:// folder where moto, boto3 or s3fs cannot be imported."""

    def __init__(self, root: str):
        self._server = None
        try:
            import boto3
            import s3fs  # noqa: F401 - layerckpt's remote tier reads and writes S3 through it
            from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
            from werkzeug.serving import make_server
        except ImportError as e:
            path = os.path.join(root, "remote-store")
            os.makedirs(path)
            self.url, self.options = "file://" + path, {}
            self.kind = f"file:// folder on the same disk (moto's S3 server not importable: {e})"
            return
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        import threading

        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        endpoint = "http://127.0.0.1:%d" % self._server.server_port
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="bench-nodes")
        self.url = "s3://bench-nodes/run"
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        self.kind = "S3 (moto's server on loopback, in the bench's parent process)"

    def env(self) -> str:
        return json.dumps({"url": self.url, "options": self.options, "kind": self.kind})

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _shm_base() -> str:
    """A fresh folder for the nodes' memory tiers: under /dev/shm (memory) where it can be made."""
    try:
        return tempfile.mkdtemp(prefix="layerckpt-bench-nodes-", dir="/dev/shm")
    except OSError:
        return tempfile.mkdtemp(prefix="layerckpt-bench-nodes-shm-")


def _worker_args(a, root: str, phase: str) -> List[str]:
    return ["--phase", phase, "--root", root, "--nnodes", str(a.nodes), "--size", a.size, "--reps", str(a.reps),
            "--steps-n", str(a.steps_n), "--steps-every", str(a.steps_every), "--steps-rounds", str(a.steps_rounds)]


def _run_phase(a, root: str, shm: str, remote: Remote, phase: str, timeout_s: float) -> Tuple[int, str]:
    """Start the node launchers of ``phase`` and wait for them; (exit status, what went wrong)."""
    world = a.nodes * a.nproc
    for attempt in range(2):
        port = _free_port()
        procs, logs = [], []
        for k in range(a.nodes):
            env = {n: v for n, v in os.environ.items() if not n.startswith(_STRIP)}
            env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)), PYTHONUNBUFFERED="1",
                       LAYERCKPT_NODE=f"node{k}", LAYERCKPT_SHM=os.path.join(shm, f"shm{k}"),
                       GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            env[_ARGV_ENV] = os.environ.get(_ARGV_ENV) or _command()
            env[REMOTE_ENV] = remote.env()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(a.nodes), "--nproc-per-node",
                   str(a.nproc), "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "--max-restarts", "0", "-m", "layerckpt.bench.nodes", *_worker_args(a, root, phase)]
            log = open(os.path.join(root, f"log.{phase}.node{k}.txt"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        rc = _wait(procs, timeout_s)
        for log in logs:
            log.close()
        text = "\n".join(f"--- node{k} launcher ({phase}), its last lines:\n" + _tail(log.name)
                         for k, log in enumerate(logs))
        if rc and attempt == 0 and "address already in use" in text.lower():
            continue  # the port was taken between the pick and the bind: once more
        errors = sorted(f for f in os.listdir(root) if f.startswith(f"error.{phase}."))
        why = "".join(f"--- {f}:\n" + _tail(os.path.join(root, f), 60) for f in errors)
        return rc, (why + text) if rc else ""
    return rc, text


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _wait(procs: List[subprocess.Popen], timeout_s: float) -> int:
    """Every launcher's end; a launcher that failed gives the others a minute (their collectives fail), then
    they are ended (SIGTERM: torchrun ends its workers; SIGKILL after 15 s)."""
    deadline = time.monotonic() + timeout_s
    failed_at, timed_out = None, False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        timed_out = now > deadline
        if timed_out or (failed_at is not None and now > failed_at + 60):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            end = time.monotonic() + 15
            while time.monotonic() < end and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    failed = next((p.returncode for p in procs if p.returncode), 0)
    return failed or (124 if timed_out else 0)


def run(a, dirpath: Optional[str] = None) -> Dict[str, Any]:
    """Both phases; the results (raises RuntimeError with the ranks' errors where a phase failed)."""
    if dirpath:
        os.makedirs(dirpath, exist_ok=True)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-nodes-", dir=dirpath)
    shm = _shm_base()
    remote = None
    try:
        for k in range(a.nodes):
            _private_dir(os.path.join(shm, f"shm{k}"))
        remote = Remote(root)
        started = time.perf_counter()
        out: Dict[str, Any] = {}
        load = {"before": os.getloadavg()[0]}
        for phase in ("save", "restore"):
            rc, why = _run_phase(a, root, shm, remote, phase, timeout_s=3600)
            if rc:
                raise RuntimeError(f"phase {phase}: the node launchers exited with status {rc}\n{why}")
            with open(os.path.join(root, f"result.{phase}.json")) as f:
                out[phase] = json.load(f)
            load[f"after_{phase}"] = os.getloadavg()[0]
        s, r = out["save"], out["restore"]
        res: Dict[str, Any] = {
            "bench": "nodes", "size": a.size, "nodes": a.nodes, "nproc_per_node": a.nproc, "world": s["world"],
            "reps": a.reps, "parameters": s["parameters"], "state_bytes": s["state_bytes"], "machine": machine(),
            "layout": {"node_dirs": f"<run>/<set>/node<K>, one per node", "shared_dir": "<run>/shared",
                       "ranks_of": s["ranks_of"], "shm": shm, "shm_is_memory": shm.startswith("/dev/shm/"),
                       "omp_threads": max(1, (os.cpu_count() or 1) // s["world"])},
            "remote": {"kind": remote.kind, "url": remote.url},
            "reference": s["reference"], "saves": s["saves"], "replication": s["replication"],
            "remote_save": s["remote_save"], "steps": s["steps"], "restores": r["restores"],
            "lost_node": r["lost_node"], "wall_s": time.perf_counter() - started, "load_avg_1m": load,
        }
        res["ratios"] = ratios(res)
        res["targets"] = {k: {"value": res["ratios"][k], "limit": v, "met": res["ratios"][k] <= v}
                          for k, v in TARGETS.items()}
        return res
    finally:
        if remote is not None:
            remote.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def ratios(res: Dict[str, Any]) -> Dict[str, float]:
    """Of medians of the same run."""
    s, st, r = res["saves"], res["steps"]["runs"], res["restores"]

    def med(x: Dict[str, Any]) -> float:
        return x["median"]

    local = med(s["node-local"]["durable_s"])
    return {
        "node-local durable / shared durable": local / med(s["shared"]["durable_s"]),
        "dcp.save durable / node-local durable": med(s["dcp.save"]["durable_s"]) / local,
        "replicas=1 durable / node-local durable": med(s["node-local replicas=1"]["durable_s"]) / local,
        "replicas=1 step / replicas=0 step": st["replicas=1"]["mean_step_s"] / st["replicas=0"]["mean_step_s"],
        "replicas=1 step+drain / replicas=0 step+drain":
            st["replicas=1"]["mean_step_with_drain_s"] / st["replicas=0"]["mean_step_with_drain_s"],
        "replicas=0 step / no checkpoint step": st["replicas=0"]["mean_step_s"] / st["none"]["mean_step_s"],
        "replicas=1 step / no checkpoint step": st["replicas=1"]["mean_step_s"] / st["none"]["mean_step_s"],
        "replica restore / disk restore": med(r["replica"]["s"]) / med(r["disk"]["s"]),
        "remote restore / replica restore": med(r["remote"]["s"]) / med(r["replica"]["s"]),
        "dcp.load / disk restore": med(r["dcp.load"]["s"]) / med(r["disk"]["s"]),
        "disk restore / shared-dir restore": med(r["disk"]["s"]) / med(r["shared"]["s"]),
    }


def _fmt(x: Dict[str, Any], digits: int = 3) -> str:
    return f"{x['median']:.{digits}f} [{x['min']:.{digits}f}-{x['max']:.{digits}f}]"


def format_table(res: Dict[str, Any]) -> str:
    m, ref = res["machine"], res["reference"]
    gb = res["state_bytes"] / 1e9
    lost = res["lost_node"]
    lines = [
        f"layerckpt bench --nodes: {res['size']} ({res['parameters'] / 1e6:.1f}M parameters), {gb:.2f} GB of state "
        f"(model + AdamW) held by every rank (replicated, as DDP), {res['nodes']} nodes x {res['nproc_per_node']} "
        f"process{'es' if res['nproc_per_node'] > 1 else ''} (torchrun node launchers on one host, gloo, CPU, "
        f"{res['layout']['omp_threads']} thread(s) per rank); {res['reps']} timed repeats each after one warm-up: "
        f"median [min-max]",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, kernel {m['kernel']}, "
        f"torch {m['torch']}, commit {(m.get('commit') or '?')[:12]}{' (dirty)' if m.get('commit_dirty') else ''}",
        f"reference (one process, the whole state's bytes): O_DIRECT write {ref['write_s']:.3f}s "
        f"({gb / ref['write_s']:.2f} GB/s), O_DIRECT read {ref['read_s']:.3f}s ({gb / ref['read_s']:.2f} GB/s)",
        f"each node's memory tier (LAYERCKPT_SHM): {'/dev/shm (memory)' if res['layout']['shm_is_memory'] else 'disk'}"
        f"; remote tier: {res['remote']['kind']}",
        "",
        "1. full saves (Config(threshold=0.0)), call to durable and committed on every rank (slowest rank):",
        f"{'save':<26}{'blocked s':>24}{'durable s':>24}  MB written per rank",
    ]
    label = {"node-local": "node-local dirs (a)", "shared": "one shared dir (b)", "dcp.save": "dcp.save shared (c)",
             "node-local replicas=1": "node-local, replicas=1"}
    for name in SAVES:
        r = res["saves"][name]
        per = " / ".join(f"{b / 1e6:.1f}" for b in r["bytes_per_rank"])
        lines.append(f"{label[name]:<26}{_fmt(r['blocked_s']):>24}{_fmt(r['durable_s']):>24}  {per}")
    rep = res["saves"]["node-local replicas=1"]
    rs = res["remote_save"]
    lines.append(f"replicas=1: call to every replica complete {_fmt(rep['replicated_s'])} s; remote set "
                 f"(replicas=0, remote tier): durable {rs['durable_s']:.3f}s, uploaded {rs['uploaded_s']:.3f}s "
                 f"(one save)")
    for title, q in (("2. replication (replicas=1, a ring over the nodes), the timed saves above", res["replication"]),
                     ("   the same during the step-time runs (saves not waited)",
                      res["steps"]["replication_during_training"])):
        lag = _fmt(q["lag_s"]) if q["lag_s"] else "n/a"
        lines.append(f"{title}: lag behind the commit {lag} s over the rounds after the first; sent per "
                     f"checkpoint " + ", ".join(f"{n} {v / 1e6:.1f} MB" for n, v in q["bytes_sent_per_checkpoint"]
                                                 .items())
                     + f" (total {q['bytes_sent_per_checkpoint_total'] / 1e6:.1f} MB); held "
                     + ", ".join(f"{n} {v / 1e6:.1f} MB" for n, v in q["bytes_held"].items()))
    st = res["steps"]
    lines += ["", f"3. step time: {st['steps_per_round']} steps x {st['rounds']} rounds per contender (rounds in "
                  f"alternating order), a full save after every {st['every']} steps, not waited for (each round's "
                  f"last save drained after its last step, outside the step times); the slowest rank's mean",
              f"{'run':<26}{'mean s/step':>14}{'with drain':>12}{'per-round means':>22}{'saves':>7}"
              f"{'CPU s/round, all ranks':>26}{'other load (cores)':>20}"]
    for name in STEP_RUNS:
        r = st["runs"][name]
        rounds = " / ".join(f"{v:.3f}" for v in r["round_means_s"])
        cpu = " / ".join(f"{v:.1f}" for v in r["cpu_s_all_ranks"])
        others = " / ".join(f"{v:.2f}" for v in r["others_cores"])
        lines.append(f"{('no checkpointing' if name == 'none' else name):<26}{r['mean_step_s']:>14.4f}"
                     f"{r['mean_step_with_drain_s']:>12.4f}{rounds:>22}{r.get('saves', 0):>7}{cpu:>26}{others:>20}")
    lines.append("(with drain: the steps and each round's drain of its last save, over the steps; CPU: every "
                 "thread of every rank, the steps and the drain; other load: the machine's busy cores less the "
                 "ranks' CPU over the round, other processes and unattributed kernel work)")
    lines += ["", f"4. restores into a fresh model (page cache dropped; a barrier, then the restore call; the "
                  f"slowest rank's wall time, and the slowest report.seconds); node lost: {lost} (its directory and "
                  f"LAYERCKPT_SHM contents deleted)",
              f"{'restore':<30}{'s':>24}{'report.seconds':>24}  sources  bit-exact"]
    label = {"disk": "process crash (own disk)", "shared": "process crash (shared dir)",
             "replica": f"{lost} lost, partner replica", "remote": f"{lost} lost, remote (replicas=0)",
             "dcp.load": "dcp.load (shared dir)"}
    for name in RESTORES:
        r = res["restores"][name]
        src = ",".join(f"{k}:{v}" for k, v in r["sources"].items()) if r["sources"] else "-"
        rep_s = _fmt(r["report_s"]) if name != "dcp.load" else "-"
        lines.append(f"{label[name]:<30}{_fmt(r['s']):>24}{rep_s:>24}  {src}  {r['bit_exact']}")
    lines.append("(s: the whole restore call; report.seconds: the library's own figure, from the start of the "
                 "collective gathering of the nodes' parts)")
    q = res["ratios"]
    lines += ["", "ratios (medians, same run): " + ", ".join(f"{k} = {v:.2f}x" for k, v in q.items())]
    lines.append("targets: " + "; ".join(f"{k} <= {t['limit']}: {t['value']:.2f}x, {'met' if t['met'] else 'NOT met'}"
                                          for k, t in res["targets"].items()))
    ld = res["load_avg_1m"]
    lines.append(f"whole run {res['wall_s']:.0f}s; load average (1 min) before {ld['before']:.2f}, after the saves "
                 f"{ld['after_save']:.2f}, after the restores {ld['after_restore']:.2f}")
    return "\n".join(lines)


def main(args) -> int:
    """``layerckpt bench --nodes [N]`` (args: nodes, size, reps, nproc, steps_n, steps_every, steps_rounds, dir,
    json)."""
    if args.size not in SIZES:
        raise SystemExit(f"--size must be one of {', '.join(SIZES)}")
    try:
        res = run(args, args.dir)
    except RuntimeError as e:
        print(f"layerckpt bench --nodes: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res) if args.json else format_table(res), flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    """The workers' arguments (the launchers' target; ``layerckpt bench --nodes`` passes them)."""
    p = argparse.ArgumentParser(prog="python -m layerckpt.bench.nodes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", required=True, choices=["save", "restore"])
    p.add_argument("--root", required=True, help="the run's folder (the parent made it)")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--size", default="gpt2-mini", choices=list(SIZES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps-n", type=int, default=12)
    p.add_argument("--steps-every", type=int, default=4)
    p.add_argument("--steps-rounds", type=int, default=2)
    return p


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("python -m layerckpt.bench.nodes is the node launchers' target: run layerckpt bench --nodes")
    worker(parser().parse_args())
