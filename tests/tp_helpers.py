"""2-D DTensor layouts for the sharded tests: ``python -m torch.distributed.run --nproc_per_node N
tests/tp_helpers.py MODE ROOT LAYOUT``.

Layouts: ``tp`` (2 x 2: ``parallelize_module`` with ColwiseParallel/RowwiseParallel over the ``tp`` dim, then
``fully_shard`` over ``dp``: ``_StridedShard`` and ``Shard(1)`` weights, an embedding sharded over ``dp`` only and
so replicated across ``tp``), ``hsdp`` (2 x 2: ``fully_shard`` on a (replicate, shard) mesh), ``dp`` (FSDP2 over
all ranks) and ``plain`` (one process, no DTensor).

Modes: ``save`` trains, saves steps 2 and 4 (every layer), writes the gathered state of step 4 to
``ROOT/ref.pt``, trains on, restores step 4 and checks every rank's local tensors (weights, AdamW state) and RNG
bit for bit against what they were at the save, then that a ``Partial`` DTensor is refused; ``load`` restores
``ROOT/store`` into a fresh model of LAYOUT and checks the gathered state element for element against
``ROOT/ref.pt``, then takes a training step (``tpswap``: ``tp`` with the mesh dims swapped); ``selective`` saves steps 2, 4 and 6 under the default rule; ``kill`` has rank 1 killed once its boxes
of step 6 are durable, before the commit.
"""
import os
import sys

import torch
import torch.distributed as dist

import layerckpt

VOCAB, DIM, HID = 37, 12, 20  # 37 rows over 2 ranks: 19 + 18


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, HID)
        self.down = torch.nn.Linear(HID, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def build(layout: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = Net()
    if layout == "plain":
        return m
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if layout == "dp":
        mesh = init_device_mesh("cpu", (world,))
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        return fully_shard(m, mesh=mesh)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        return fully_shard(m, mesh=mesh)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout == "tpswap":  # the same 2 x 2 layout with the mesh dims swapped: each rank holds another box
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("tp", "dp"))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for b in m.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"])
    return fully_shard(m, mesh=mesh["dp"])


def train(m, opt, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = m(torch.randint(0, VOCAB, (4, 3), generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def tensors(m, opt) -> dict:
    """Every model and optimizer-state tensor, by checkpoint key."""
    names = {id(p): n for n, p in m.named_parameters()}
    out = {f"model/{n}": t for n, t in m.state_dict().items()}
    for p, st in opt.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": v for k, v in st.items()})
    return out


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def save(root: str, layout: str) -> None:
    m = build(layout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    store = os.path.join(root, "store")
    with layerckpt.Checkpointer(store, m, opt, layerckpt.Config(threshold=0.0, keep_last=0)) as ck:
        for step in (2, 4):
            ck.save(step, loss=train(m, opt, 2, seed=step)).wait()
    mine = {k: local(t) for k, t in tensors(m, opt).items()}
    ref = {k: whole(t) for k, t in tensors(m, opt).items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))
    r = torch.rand(3)
    train(m, opt, 2, seed=9)
    assert layerckpt.restore(store, m, opt).step == 4
    for k, t in tensors(m, opt).items():
        assert torch.equal(local(t), mine[k]), f"{k} differs on rank {rank}"
    assert torch.equal(torch.rand(3), r), "each rank's RNG comes back"
    train(m, opt, 1, seed=7)
    if layout != "plain":
        refuse_partial(root, m)


def refuse_partial(root: str, m) -> None:
    from torch.distributed.tensor import DTensor, Partial

    mesh = next(p for p in m.parameters() if hasattr(p, "device_mesh")).device_mesh
    bad = DTensor.from_local(torch.ones(3), mesh, [Partial()] * mesh.ndim)
    with layerckpt.Checkpointer(os.path.join(root, "partial"), m) as ck:
        try:
            ck.save(1, extra={"sum": bad}).wait()
        except layerckpt.CheckpointError as e:
            assert "Partial placement" in str(e) and "extra/sum" in str(e), e
        else:
            raise AssertionError("a Partial DTensor was saved")


def selective(root: str, layout: str) -> None:
    """Saves 2, 4 and 6 under the default rule, each rank measuring its own boxes; then a restore and a step."""
    m = build(layout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    store = os.path.join(root, "store")
    with layerckpt.Checkpointer(store, m, opt, layerckpt.Config(keep_last=0)) as ck:
        for step in (2, 4, 6):
            ck.save(step, loss=train(m, opt, 2 if step < 6 else 1, seed=step)).wait()
    layerckpt.restore(store, m, opt, strict=False)
    train(m, opt, 1, seed=7)


def kill(root: str, layout: str) -> None:
    """Commits steps 2 and 4 (the gathered state of step 4 in ``ROOT/ref.pt``), then rank 1 dies by SIGKILL once
    its boxes of step 6 are durable, before the ranks agree to commit it."""
    m = build(layout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ck = layerckpt.Checkpointer(os.path.join(root, "store"), m, opt, layerckpt.Config(threshold=0.0, keep_last=0))
    for step in (2, 4):
        ck.save(step, loss=train(m, opt, 2, seed=step)).wait()
    ref = {k: whole(t) for k, t in tensors(m, opt).items()}
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))
    dist.barrier()
    if dist.get_rank() == 1:
        import signal

        from layerckpt import _faults

        _faults.install("flush.written", lambda: os.kill(os.getpid(), signal.SIGKILL))
    ck.save(6, loss=train(m, opt, 2, seed=6)).wait()  # the others wait for rank 1 until torchrun stops them
    raise SystemExit("rank 1 should have died before step 6 committed")


def load(root: str, layout: str) -> None:
    m = build(layout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, 1, seed=1)  # the optimizer holds state to be replaced
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    assert layerckpt.restore(os.path.join(root, "store"), m, opt, strict=False).step == 4
    got = tensors(m, opt)
    assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))
    for k, t in got.items():
        assert torch.equal(whole(t), ref[k]), f"{k} differs after restoring into {layout}"
    train(m, opt, 1, seed=7)


def main(mode: str, root: str, layout: str) -> None:
    if layout != "plain":
        dist.init_process_group("gloo")
    {"save": save, "load": load, "selective": selective, "kill": kill}[mode](root, layout)
    if layout != "plain":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    # as tests/fsdp_helpers.py: leave without the interpreter's teardown (a gloo exit race in torch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
