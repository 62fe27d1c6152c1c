"""FSDP2 (fully_shard, DTensor) runs for the sharded tests: ``python -m torch.distributed.run --nproc_per_node N
tests/fsdp_helpers.py MODE ROOT [THRESHOLD]``, or, for one process, the functions below from the test itself.

Modes: ``save`` trains a sharded model, saves at steps 2, 4 and 6, writes the full state of step 6 to
``ROOT/ref.<world>.pt``, trains on, restores step 6 into the same model and checks it bit for bit;
``load`` restores the newest composite of ``ROOT/store`` into a fresh sharded model and checks every
rank's shard against ``ROOT/ref.pt``; ``kill`` commits steps 2 and 4, then rank 1 is killed by SIGKILL
while step 6 is flushing, before the ranks agree to commit it; ``lossy`` saves a wider model under
``Config(encoding='lossy')`` (its embedding's shards coded with bounded loss) at steps 2, 4 and 6, writes the
state saved at 6 to ``ROOT/ref.pt``, trains on, restores step 6 and writes each rank's restored shards to
``ROOT/restored.<rank>.pt``.
"""
import os
import sys

import torch
import torch.distributed as dist

import layerckpt

VOCAB, DIM, OUT = 101, 8, 5  # uneven shards: 101 rows over 2 ranks are 51 + 50, over 4 ranks 26 * 3 + 23
WIDE = 512  # the lossy mode's embedding width: a rank's shard of it, 50 or 51 rows, is over 64 KiB


def model(dim: int = DIM) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, dim), torch.nn.Linear(dim, OUT), torch.nn.LayerNorm(OUT))


def shard(m: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in m:
        fully_shard(layer)
    return fully_shard(m)


def train(m, opt, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 3), generator=g)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def full_state(m, opt) -> dict:
    """Every tensor whole (DTensors gathered): model by name, optimizer state by parameter name."""
    whole = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.clone())
    names = {id(p): n for n, p in m.named_parameters()}
    state = {f"model/{n}": whole(t) for n, t in m.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            state[f"optim/{names[id(p)]}/{k}"] = whole(v)
    return state


def full_state_local(m, opt) -> dict:
    """Every tensor as this rank holds it (its shards), by the names of :func:`full_state`."""
    names = {id(p): n for n, p in m.named_parameters()}
    state = {f"model/{n}": t for n, t in m.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            state[f"optim/{names[id(p)]}/{k}"] = v
    return state


def local_rows(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The rows of ``whole`` that the (sharded) tensor ``t`` holds."""
    if not hasattr(t, "to_local"):
        return whole
    n, world, me = whole.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    per = -(-n // world)
    return whole[min(me * per, n):min((me + 1) * per, n)]


def check(m, opt, ref: dict) -> None:
    """Every tensor of this rank (its shards) equal, bit for bit, to the same rows of the reference."""
    names = {id(p): n for n, p in m.named_parameters()}
    for n, t in m.state_dict().items():
        mine = t.to_local() if hasattr(t, "to_local") else t
        want = local_rows(t, ref[f"model/{n}"])
        assert torch.equal(mine, want), f"model/{n} differs on rank {dist.get_rank() if dist.is_initialized() else 0}"
    for p, st in opt.state.items():
        for k, v in st.items():
            mine = v.to_local() if hasattr(v, "to_local") else v
            want = local_rows(v, ref[f"optim/{names[id(p)]}/{k}"])
            assert torch.equal(mine, want), f"optim/{names[id(p)]}/{k} differs"


def main(mode: str, root: str, threshold: float) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(model(WIDE if mode == "lossy" else DIM))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    # FSDP_NODE_STORES=1 (tests/test_nodes_sharded.py): each node its own directory, ROOT/node<GROUP_RANK>;
    # FSDP_REPLICAS: Config.replicas there
    nodes = os.environ.get("FSDP_NODE_STORES") == "1"
    store = os.path.join(root, f"node{os.environ['GROUP_RANK']}" if nodes else "store")
    more = {"replicas": int(os.environ.get("FSDP_REPLICAS", "0"))}
    cfg = layerckpt.Config(threshold=threshold, keep_last=0, **more) if threshold >= 0 else \
        layerckpt.Config(keep_last=0, **more)
    if mode == "lossy":
        with layerckpt.Checkpointer(store, m, opt, layerckpt.Config(encoding="lossy", full=True, keep_last=0)) as ck:
            for step in (2, 4, 6):
                ck.save(step, loss=train(m, opt, 2, seed=step)).wait()
        ref = full_state(m, opt)
        if rank == 0:
            torch.save(ref, os.path.join(root, "ref.pt"))
        train(m, opt, 3, seed=99)
        assert layerckpt.restore(store, m, opt, strict=False).step == 6
        torch.save({k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in full_state_local(m, opt).items()},
                   os.path.join(root, f"restored.{rank}.pt"))
    elif mode == "save":
        with layerckpt.Checkpointer(store, m, opt, cfg) as ck:
            for step in (2, 4, 6):
                loss = train(m, opt, 2, seed=step)
                ck.save(step, extra={"world": world}, loss=loss).wait()
        ref = full_state(m, opt)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"ref.{world}.pt"))
        r = torch.rand(3)  # each rank's RNG after the save
        train(m, opt, 3, seed=99)
        report = layerckpt.restore(store, m, opt, strict=False, config=cfg)
        assert report.step == 6 and report.extra == {"world": world}
        if threshold == 0.0:
            check(m, opt, ref)
            assert torch.equal(torch.rand(3), r), "each rank's RNG comes back"
        train(m, opt, 1, seed=7)  # and training goes on from the restored shards
    elif mode == "kill":  # rank 1 dies once its shards of step 6 are durable, before the ranks agree
        ck = layerckpt.Checkpointer(store, m, opt, cfg)
        for step in (2, 4):
            ck.save(step, loss=train(m, opt, 2, seed=step)).wait()
        ref = full_state(m, opt)
        if rank == 0:
            torch.save(ref, os.path.join(root, "ref.pt"))
        dist.barrier()
        if rank == 1:
            import signal

            from layerckpt import _faults

            _faults.install("flush.written", lambda: os.kill(os.getpid(), signal.SIGKILL))
        ck.save(6, loss=train(m, opt, 2, seed=6)).wait()  # rank 0 waits for rank 1 until torchrun stops it
        raise SystemExit("rank 1 should have died before step 6 committed")
    elif mode == "load":
        ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
        report = layerckpt.restore(store, m, opt, strict=False, config=cfg)
        check(m, opt, ref)
        if nodes:
            with open(os.path.join(root, f"sources.{rank}.txt"), "w") as f:
                f.write(repr(sorted(report.sources.items())))
        train(m, opt, 1, seed=7)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else -1.0)
    # Every Checkpointer is closed and the group destroyed: leave without the interpreter's teardown, where
    # gloo's worker thread freeing the training's last collective can abort the process (a race in torch,
    # traced in tests/test_exit.py, which measures it behind -m slow); these tests are about the store.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
