"""lightning.Fabric: fabric.save / fabric.load through LayerFabricCheckpoint, on 1 and 2 CPU processes."""
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import types

import pytest
import torch

import lightning  # noqa: F401
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy  # noqa: E402

import layerckpt  # noqa: E402
from layerckpt import cli  # noqa: E402
from lightning_layerckpt import LayerFabricCheckpoint  # noqa: E402
from conftest import assert_same_optimizer_state, assert_same_tensors, small_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def setup(fabric, seed, frozen=()):
    """A tiny GPT (``frozen`` children not trained) and AdamW over the rest, set up by ``fabric``."""
    model = small_model(seed)
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return fabric.setup(model, opt)


def train_step(fabric, model, opt, seed):
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def flushers():
    return [t for t in threading.enumerate() if t.name == "layerckpt-flusher"]


def snapshot(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())


def test_save_load_bit_exact_with_the_rest_of_the_state(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = setup(fabric, 0)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    root = str(tmp_path / "store")
    with LayerFabricCheckpoint(fabric, threshold=0.0) as ckpt:
        for step in range(1, 4):
            train_step(fabric, model, opt, step)
            sched.step()
            state = {"model": model, "optimizer": opt, "scheduler": sched, "step": step,
                     "meta": {"epoch": step // 2, "tags": ["a", "b"], "nested": {"lr": 0.5}},
                     "tensor": torch.arange(step, dtype=torch.float64), "unrequested": "kept"}
            fabric.save(root, state)
        ckpt.wait()
        assert ckpt.last_save.layers_persisted == ckpt.last_save.layers_total  # threshold 0: all, every save
        want_model, want_opt = snapshot(model, opt)

        fresh, fopt = setup(fabric, 5)
        fsched = torch.optim.lr_scheduler.StepLR(fopt.optimizer, step_size=1, gamma=0.5)
        state = {"model": fresh, "optimizer": fopt, "scheduler": fsched, "step": 0, "meta": None, "tensor": None}
        remainder = fabric.load(root, state)
        assert_same_tensors(want_model, fresh.state_dict())
        assert_same_optimizer_state(want_opt, fopt.state_dict())
        assert fsched.state_dict() == sched.state_dict() and fsched.last_epoch == 3
        assert state["step"] == 3 and state["meta"] == {"epoch": 1, "tags": ["a", "b"], "nested": {"lr": 0.5}}
        assert torch.equal(state["tensor"], torch.arange(3, dtype=torch.float64))
        assert remainder == {"unrequested": "kept"}
        assert ckpt.report.step == 3 and set(ckpt.report.layers.values()) == {3}

        whole = fabric.load(root)  # no state: the whole checkpoint, as state dicts
        assert_same_tensors(want_model, whole["model"])
        assert whole["step"] == 3 and whole["unrequested"] == "kept" and whole["optimizer"]["state"]
        with pytest.raises(KeyError, match="missing"):
            fabric.load(root, {"model": fresh, "missing": 1})

        # an ordinary file is still Fabric's own, both ways
        fabric.save(tmp_path / "plain.ckpt", {"step": 7})
        assert os.path.isfile(tmp_path / "plain.ckpt") and fabric.load(tmp_path / "plain.ckpt") == {"step": 7}

    assert not flushers()
    assert "save_checkpoint" not in vars(fabric.strategy)  # Fabric's own save and load are back
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["export", root, "-o", out]) == 0
    from safetensors.torch import load_file
    assert_same_tensors({k: v for k, v in want_model.items() if k in load_file(out)}, load_file(out))
    assert "h.0.c_attn.weight" in load_file(out)


def test_frozen_layers_are_written_once_and_a_resume_stays_selective(tmp_path):
    frozen = ("wte", "wpe", "h.0", "h.1")
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = setup(fabric, 0, frozen=frozen)
    root = str(tmp_path / "store")
    ckpt = LayerFabricCheckpoint(fabric, keep_last=0)  # the default selection rule, scaled by the loss
    for step in range(4):
        loss = train_step(fabric, model, opt, step)
        ckpt.save(root, {"model": model, "optimizer": opt, "step": step}, loss=loss)
    ckpt.close()
    for step in range(4):  # what `layerckpt inspect` shows: the step each layer was persisted at, its bytes
        m = json.load(open(os.path.join(root, "manifests", f"step-{step:08d}.json")))
        assert set(m["layers"]) >= set(frozen) | {"h.2", "h.3"}
        assert all(m["layers"][name]["step"] == 0 for name in frozen)  # frozen: written once
        composite = sum(t["nbytes"] for t in m["tensors"].values())
        now = sum(t["nbytes"] for t in m["tensors"].values() if t["file"].startswith(f"step-{step:08d}."))
        if step == 0:
            full = now
            frozen_bytes = sum(m["tensors"][k]["nbytes"] for name in frozen for k in m["layers"][name]["tensors"])
            assert now == composite and frozen_bytes > 0.2 * full
        else:
            assert composite == full and now <= full - frozen_bytes, (step, now, full, frozen_bytes)
    assert m["layers"]["h.3"]["step"] == 3
    loaded = layerckpt.read_checkpoint(root)  # the composite, as tensors
    assert torch.equal(loaded.model["wte.weight"], model.state_dict()["wte.weight"])

    # a new process resumes from the store and keeps composing on it: its first save is not full
    fabric = Fabric(accelerator="cpu", devices=1)
    fresh, fopt = setup(fabric, 5, frozen=frozen)
    with LayerFabricCheckpoint(fabric, keep_last=0) as ckpt:
        state = {"model": fresh, "optimizer": fopt, "step": 0}
        fabric.load(root, state)
        assert state["step"] == 3
        mine = tuple(f"{name}." for name in frozen)
        assert_same_tensors({k: v for k, v in model.state_dict().items() if k.startswith(mine)},
                            {k: v for k, v in fresh.state_dict().items() if k.startswith(mine)})
        loss = train_step(fabric, fresh, fopt, 9)
        ckpt.save(root, {"model": fresh, "optimizer": fopt, "step": 4}, loss=loss)
        ckpt.wait()
    m = json.load(open(os.path.join(root, "manifests", "step-00000004.json")))
    assert all(m["layers"][name]["step"] == 0 for name in frozen) and m["world_size"] == 1
    assert sum(t["nbytes"] for t in m["tensors"].values() if t["file"].startswith("step-00000004.")) \
        <= full - frozen_bytes


def test_close_leaves_no_thread_and_refuses_what_it_cannot_keep(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = setup(fabric, 0)
    ckpt = LayerFabricCheckpoint(fabric, threshold=0.0)
    with pytest.raises(layerckpt.CheckpointError, match="already routed"):
        LayerFabricCheckpoint(fabric)
    with pytest.raises(layerckpt.CheckpointError, match="filter"):
        fabric.save(tmp_path / "s", {"model": model, "optimizer": opt}, filter={"model": lambda k, v: True})
    fabric.save(tmp_path / "s", {"model": model, "optimizer": opt})  # no step: one after the newest, from 0
    fabric.save(tmp_path / "s", {"model": model, "optimizer": opt})
    assert flushers()
    ckpt.close()
    assert not flushers()
    assert sorted(os.listdir(tmp_path / "s" / "manifests")) == ["step-00000000.json", "step-00000001.json"]
    with pytest.raises(layerckpt.CheckpointError, match="closed"):
        ckpt.save(tmp_path / "s", {"model": model})
    with pytest.raises(layerckpt.CheckpointError, match="FSDPStrategy"):
        LayerFabricCheckpoint(types.SimpleNamespace(strategy=FSDPStrategy()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_write_a_share_and_load_bit_exact(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = [json.load(open(tmp_path / f"rank{rank}.json")) for rank in (0, 1)]
    assert all(o["restored"] and o["threads"] == 0 for o in outs)
    n0, n1 = outs[0]["nbytes"], outs[1]["nbytes"]
    assert n0 > 0 and n1 > 0 and abs(n0 - n1) < 0.5 * (n0 + n1), (n0, n1)  # each rank wrote a share
    m = json.load(open(layerckpt.read_checkpoint(str(tmp_path / "store")).manifest))
    assert m["world_size"] == 2 and m["step"] == 2
    assert {e["rank"] for e in m["layers"].values()} == {0, 1}
    # each rank's own file of step 2; the others listed are the references its deltas are encoded against
    assert sorted(f for f, e in m["files"].items() if e["step"] == 2) == ["step-00000002.rank0.safetensors",
                                                                          "step-00000002.rank1.safetensors"]
    assert {t["file"] for t in m["tensors"].values()} == {f for f, e in m["files"].items() if e["step"] == 2}


def ddp_main(out: str) -> None:
    """Both ranks (Fabric starts the second by running this file again): two saves, then a load into fresh objects."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    model, opt = setup(fabric, 0)
    root = os.path.join(out, "store")
    with LayerFabricCheckpoint(fabric, threshold=0.0) as ckpt:
        for step in (1, 2):
            train_step(fabric, model, opt, 100 * rank + step)  # each rank its own batch, as DDP trains
            fabric.save(root, {"model": model, "optimizer": opt, "step": step, "meta": {"world": 2}})
        ckpt.wait()
        nbytes = ckpt.last_save.nbytes
        want_model, want_opt = snapshot(model, opt)
        fresh, fopt = setup(fabric, 5)
        state = {"model": fresh, "optimizer": fopt, "step": 0}
        remainder = fabric.load(root, state)
        assert_same_tensors(want_model, fresh.state_dict())
        assert_same_optimizer_state(want_opt, fopt.state_dict())
        assert state["step"] == 2 and remainder == {"meta": {"world": 2}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"nbytes": nbytes, "restored": True, "threads": len(flushers())}, f)
    fabric.barrier()


if __name__ == "__main__":
    ddp_main(sys.argv[1])
