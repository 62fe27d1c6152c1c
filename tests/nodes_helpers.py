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
        that rank's part came from), "node", "rank"} and BASE/restored.rank<R>.pt: {"model", "optim"}

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
import json
import os
import signal
import sys
import traceback
from typing import Any, Dict, List

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


def config(replicas: int) -> layerckpt.Config:
    """Full checkpoints (bit-for-bit restores), ``replicas`` partner nodes holding each node's committed part.

    ``replicas=0`` is no replication: passed as such where Config knows the field, left out where it does not
    (a library from before the many-nodes mode, against which the harness itself can still be run)."""
    kw: Dict[str, Any] = {"threshold": 0.0, "keep_last": KEEP_LAST}
    if replicas or "replicas" in {f.name for f in dataclasses.fields(layerckpt.Config)}:
        kw["replicas"] = replicas
    return layerckpt.Config(**kw)


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


def train(base: str, steps: int, every: int, replicas: int) -> None:
    model, opt = build(0)
    ck = layerckpt.Checkpointer(node_dir(base), model, opt, config=config(replicas))
    saved: List[int] = []
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        if step % every == 0:
            ck.save(step).wait()
            saved.append(step)
    ck.close()
    rank = dist.get_rank()
    torch.save({**state(model, opt), "saved": saved, "step": steps, "node": node_index(), "rank": rank,
                "world": dist.get_world_size()}, os.path.join(base, f"result.train.rank{rank}.pt"))


def restore(base: str, replicas: int) -> None:
    model, opt = build(1)  # other weights than the trained ones: the restore has to bring every one back
    report = layerckpt.restore(node_dir(base), model, opt, config=config(replicas))
    rank = dist.get_rank()
    torch.save(state(model, opt), os.path.join(base, f"restored.rank{rank}.pt"))
    sources = getattr(report, "sources", None)
    with open(os.path.join(base, f"result.restore.rank{rank}.json"), "w") as f:
        json.dump({"step": report.step, "node": node_index(), "rank": rank,
                   "sources": None if sources is None else {str(int(r)): str(s) for r, s in sources.items()}}, f)


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
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        if phase == "ping":
            ping(base)
        elif phase == "train":
            train(base, int(argv[2]), int(argv[3]), int(argv[4]))
        elif phase == "restore":
            restore(base, int(argv[2]))
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
