"""The worker of tests/test_nodes.py: one rank of a job that spans several simulated nodes on this host.

Each node is its own torchrun launcher (``--nnodes N --node-rank K``, static rendezvous on loopback; see
``launch`` in tests/test_nodes.py), so every rank has ``GROUP_RANK`` = its node and a node of its own to the
library: its checkpoint directory ``BASE/node<K>``, its memory tier under ``LAYERCKPT_SHM`` (``BASE/shm<K>``)
and its identity ``LAYERCKPT_NODE`` (``node<K>``), both set by the launcher's environment.

    python -m torch.distributed.run ... tests/nodes_helpers.py train BASE STEPS EVERY REPLICAS
        trains STEPS steps, saving (and waiting for) a full checkpoint every EVERY steps, then writes
        BASE/result.train.rank<R>.pt: {"model", "optim": the state after the last step, "saved": the steps
        saved, "step", "node", "rank", "world"}
    python -m torch.distributed.run ... tests/nodes_helpers.py ping BASE
        no library: writes BASE/result.ping.rank<R>.json with what the rank was given (RANK, GROUP_RANK,
        LOCAL_RANK, world size, LAYERCKPT_NODE, LAYERCKPT_SHM) and the sum of an all-reduce of the ranks: the
        check of the harness itself
    python -m torch.distributed.run ... tests/nodes_helpers.py restore BASE REPLICAS
        builds a fresh model and optimizer (other weights than the trained ones), restores the newest committed
        checkpoint into them, then writes BASE/result.restore.rank<R>.json: {"step", "sources" (rank -> where
        that rank's part came from), "node", "rank", "staleness" (layer -> steps it trails the step restored),
        "layers" (layer -> its state_dict names), "params" (the optimizer's parameters' names, in its order)} and
        BASE/restored.rank<R>.pt: {"model", "optim"}
    python -m torch.distributed.run ... tests/nodes_helpers.py resume BASE REPLICAS STEPS EVERY
        restores as ``restore`` does (its files named ``resume``: BASE/result.resume.rank<R>.json,
        BASE/restored.resume.rank<R>.pt), then trains STEPS more steps with the DEFAULT selective Config
        (``Config(replicas=REPLICAS, keep_last=2)``, no threshold), saving every EVERY steps (with the loss)
        and recording each saved state as ``train`` does
    python -m torch.distributed.run ... tests/nodes_helpers.py soak BASE STEPS
        restores the newest checkpoint if there is one (CheckpointNotFoundError: starts fresh), writes at once
        BASE/result.soak.rank<R>.json: {"step" (None: fresh), "sources", "hash" (of the state restored),
        "recorded" (the hash recorded when that step was saved; None where none was), "node", "rank"}; then
        trains up to STEPS more steps saving EVERY step (full checkpoints, replicas=1, the remote where
        NODES_REMOTE names one): after each save().wait() it writes BASE/hash.step<S>.rank<R> and appends S
        to BASE/local.rank<R>; a node's store owner (its lowest rank, the one that runs the copies), once its
        Checkpointer's wait() returned without error (every copy made: its node holds its source node's part as
        a replica, its own files are on the remote, and rank 0's node has committed the remote's manifest),
        appends S to BASE/committed.rank<R>.  The harness kills it

``train`` and ``resume`` also write BASE/saved.step<S>.rank<R>.pt ({"model", "optim"}) before each save(): the
state that step saves (a rank killed during the save, or in its upload, leaves it), so that a restore of any step
is checked bit for bit.

The launcher's environment may add, per node:

    NODES_DIE_AT="<fault point>:<n>[:<seconds>][,...]"   each rank SIGKILLs its own process the n-th time that
        point (layerckpt._faults) is hit in that process (the thread that hit it stalled <seconds> first, the
        process's other threads going on), having written BASE/died.rank<R>.txt (the point and n)
    NODES_REMOTE="file:///..."   Config(remote=...) for every phase (``config``)

Every rank holds the same weights, as under DDP: the same initial model on every rank, batches depending on
(step, rank) and gradients averaged over the ranks with an all-reduce before each optimizer step.

A rank that fails writes BASE/error.<phase>.rank<R>.txt (the exception's type and message, then its traceback)
before printing the traceback and exiting 1, so that a test reads what each rank was told.  A rank that
succeeds leaves with os._exit(0) once its Checkpointer is closed and the group destroyed (gloo's threads can
abort the interpreter's teardown: tests/test_exit.py).  SIGUSR1 dumps every thread's stack to stderr (the
harness sends it to a launch that hangs, before ending it).
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import layerckpt
from layerckpt.bench.models import GPT, GPTConfig

GLOO_TIMEOUT_S = 60  # a dead peer fails the collectives within a minute
VOCAB, SEQ, BATCH = 64, 16, 4
KEEP_LAST = 2


def node_index() -> int:
    return int(os.environ["GROUP_RANK"])  # torchrun's node rank (--node-rank)


def node_dir(base: str) -> str:
    return os.path.join(base, f"node{node_index()}")


def config(replicas: int, selective: bool = False) -> layerckpt.Config:
    """Full checkpoints (bit-for-bit restores), ``replicas`` partner nodes holding each node's committed part;
    the remote tier ``NODES_REMOTE`` names, if any.  ``selective``: the default selection rule instead (no
    threshold), as a user's ``Config(replicas=..., keep_last=2)``.

    ``replicas=0`` is no replication: passed as such where Config knows the field, left out where it does not
    (a library from before the many-nodes mode, against which the harness itself can still be run)."""
    kw: Dict[str, Any] = {"keep_last": KEEP_LAST} if selective else {"threshold": 0.0, "keep_last": KEEP_LAST}
    if replicas or "replicas" in {f.name for f in dataclasses.fields(layerckpt.Config)}:
        kw["replicas"] = replicas
    if os.environ.get("NODES_REMOTE"):
        kw["remote"] = os.environ["NODES_REMOTE"]
    return layerckpt.Config(**kw)


def install_faults(base: str) -> None:
    """``NODES_DIE_AT``: this process SIGKILLs itself the n-th time each point named is hit (see the module)."""
    spec = os.environ.get("NODES_DIE_AT", "")
    if not spec:
        return
    from layerckpt import _faults

    rank = os.environ.get("RANK", "?")
    for item in spec.split(","):
        name, n, *wait = item.split(":")
        _faults.install(name, _killer(base, rank, name, int(n), float(wait[0]) if wait else 0.0))


def _killer(base: str, rank: str, name: str, n: int, wait_s: float = 0.0):
    lock, hits = threading.Lock(), [0]

    def hook() -> None:
        with lock:
            hits[0] += 1
            if hits[0] != n:
                return
            time.sleep(wait_s)  # the thread that hit the point stalls first (the others go on)
            with open(os.path.join(base, f"died.rank{rank}.txt"), "w") as f:
                f.write(f"{name}:{n}\n")
                f.flush()
                os.fsync(f.fileno())
            print(f"rank {rank}: SIGKILL at {name} hit {n}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def build(seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's batch of ``step``, gradients averaged over the ranks (DDP's arithmetic)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict()}


def record(base: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The state the save of ``step`` was given: BASE/saved.step<S>.rank<R>.pt."""
    path = os.path.join(base, f"saved.step{step}.rank{dist.get_rank()}.pt")
    torch.save(state(model, opt), path + ".tmp")
    os.replace(path + ".tmp", path)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of every byte of the model's and the optimizer's state (names, dtypes, shapes, values)."""
    h = hashlib.sha256()

    def add(name: str, v: Any) -> None:
        h.update(name.encode() + b"\0")
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().reshape(-1).contiguous()
            h.update(f"{t.dtype}{tuple(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())

    for k, v in sorted(model.state_dict().items()):
        add("model." + k, v)
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        for k, v in sorted(sd["state"][i].items()):
            add(f"optim.{i}.{k}", v)
    add("param_groups", json.dumps(sd["param_groups"], sort_keys=True))
    return h.hexdigest()


def _write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def train(base: str, steps: int, every: int, replicas: int) -> None:
    model, opt = build(0)
    ck = layerckpt.Checkpointer(node_dir(base), model, opt, config=config(replicas))
    saved: List[int] = []
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        if step % every == 0:
            record(base, step, model, opt)  # before the save: a rank killed in it leaves its reference
            ck.save(step).wait()
            saved.append(step)
    ck.close()
    rank = dist.get_rank()
    torch.save({**state(model, opt), "saved": saved, "step": steps, "node": node_index(), "rank": rank,
                "world": dist.get_world_size()}, os.path.join(base, f"result.train.rank{rank}.pt"))


def _sources(report) -> Optional[Dict[str, str]]:
    sources = getattr(report, "sources", None)
    return None if sources is None else {str(int(r)): str(s) for r, s in sources.items()}


def _layout(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """The model's layers (layer -> state_dict names) and the optimizer's parameters' names, in its order:
    what a test needs to know which saved step each restored tensor of a selective composite comes from."""
    from layerckpt.select._layers import group_layers

    names = {id(p): n for n, p in model.named_parameters()}
    return {"layers": group_layers(model, list(model.state_dict())),
            "params": [names[id(p)] for g in opt.param_groups for p in g["params"]]}


def restore(base: str, replicas: int, tag: str = "restore"):
    model, opt = build(1)  # other weights than the trained ones: the restore has to bring every one back
    report = layerckpt.restore(node_dir(base), model, opt, config=config(replicas))
    rank = dist.get_rank()
    suffix = "" if tag == "restore" else f".{tag}"
    torch.save(state(model, opt), os.path.join(base, f"restored{suffix}.rank{rank}.pt"))
    _write_json(os.path.join(base, f"result.{tag}.rank{rank}.json"),
                {"step": report.step, "node": node_index(), "rank": rank, "sources": _sources(report),
                 "staleness": dict(getattr(report, "staleness_steps", {}) or {}), **_layout(model, opt)})
    return model, opt, report


def resume(base: str, replicas: int, steps: int, every: int) -> None:
    """A restore, then training on with the default selective Config (see the module)."""
    model, opt, report = restore(base, replicas, tag="resume")
    ck = layerckpt.Checkpointer(node_dir(base), model, opt, config=config(replicas, selective=True))
    saved: List[int] = []
    for step in range(report.step + 1, report.step + steps + 1):
        loss = train_step(model, opt, step)
        if (step - report.step) % every == 0:
            record(base, step, model, opt)
            ck.save(step, loss=loss).wait()
            saved.append(step)
    ck.close()
    rank = dist.get_rank()
    torch.save({**state(model, opt), "saved": saved, "step": report.step + steps, "node": node_index(),
                "rank": rank, "world": dist.get_world_size()}, os.path.join(base, f"result.resume.rank{rank}.pt"))


def soak(base: str, steps: int) -> None:
    """Restore what there is (else start fresh), check it against the hash its save recorded, train on saving
    every step (see the module)."""
    rank = dist.get_rank()
    cfg = config(1)
    model, opt = build(0)
    try:
        report = layerckpt.restore(node_dir(base), model, opt, config=cfg)
    except layerckpt.CheckpointNotFoundError as e:
        model, opt = build(0)  # a fresh start: the same initial weights as every run's
        start, got = 0, {"step": None, "sources": None, "hash": None, "recorded": None, "fresh": str(e)[:2000]}
    else:
        start = report.step
        recorded = None
        for name in (f"hash.step{start}.rank{rank}", f"hash.step{start}.rank{rank}.pre"):
            try:
                with open(os.path.join(base, name)) as f:
                    recorded = f.read().strip()
                break
            except FileNotFoundError:
                continue
        got = {"step": start, "sources": _sources(report), "hash": digest(model, opt), "recorded": recorded}
    _write_json(os.path.join(base, f"result.soak.rank{rank}.json"), {**got, "node": node_index(), "rank": rank})
    ck = layerckpt.Checkpointer(node_dir(base), model, opt, config=cfg)
    for step in range(start + 1, start + steps + 1):
        loss = train_step(model, opt, step)
        h = digest(model, opt)
        with open(os.path.join(base, f"hash.step{step}.rank{rank}.pre"), "w") as f:
            f.write(h + "\n")  # the state this save is given, should the process die before its wait returns
        ck.save(step, loss=loss).wait()
        final = os.path.join(base, f"hash.step{step}.rank{rank}")
        with open(final + ".tmp", "w") as f:
            f.write(h + "\n")
        os.replace(final + ".tmp", final)
        _append(os.path.join(base, f"local.rank{rank}"), str(step))
        try:
            ck.wait()  # the partner's replica and the remote's copy of it made too
        except layerckpt.CheckpointError as e:  # a copy failed: logged, retried with the next save
            print(f"rank {rank}: step {step}: a copy failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        if ck.replicas.get("error"):
            print(f"rank {rank}: step {step}: the replication stopped: {ck.replicas['error']}", file=sys.stderr,
                  flush=True)
            continue
        if ck.placement.is_owner:  # only a store's owner runs its copies: another rank's wait() waits for none
            _append(os.path.join(base, f"committed.rank{rank}"), str(step))
    ck.close()


def ping(base: str) -> None:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    rank = dist.get_rank()
    with open(os.path.join(base, f"result.ping.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "RANK": int(os.environ["RANK"]), "GROUP_RANK": node_index(),
                   "LOCAL_RANK": int(os.environ["LOCAL_RANK"]), "world": dist.get_world_size(), "sum": t.item(),
                   "LAYERCKPT_NODE": os.environ.get("LAYERCKPT_NODE"),
                   "LAYERCKPT_SHM": os.environ.get("LAYERCKPT_SHM"), "pid": os.getpid()}, f)


def main(argv: List[str]) -> None:
    phase, base = argv[0], argv[1]
    torch.set_num_threads(1)  # the same arithmetic on every rank and in every launch
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        install_faults(base)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        if phase == "ping":
            ping(base)
        elif phase == "train":
            train(base, int(argv[2]), int(argv[3]), int(argv[4]))
        elif phase == "restore":
            restore(base, int(argv[2]))
        elif phase == "resume":
            resume(base, int(argv[2]), int(argv[3]), int(argv[4]))
        elif phase == "soak":
            soak(base, int(argv[2]))
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks fails the peer
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - what each rank was told is what the tests read
        rank = os.environ.get("RANK", "?")
        try:
            with open(os.path.join(base, f"error.{phase}.rank{rank}.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            print(f"rank {rank} (node{os.environ.get('GROUP_RANK', '?')}) FAILED: {type(e).__name__}: {e}",
                  file=sys.stderr)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
