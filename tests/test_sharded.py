"""FSDP2 (fully_shard, DTensor) on CPU with gloo: each rank writes its own shards; restores onto the same
mesh bit for bit and onto other world sizes (2 -> 1, 1 -> 2, 4 -> 2) element for element."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt.format._manifest import load_manifest
import fsdp_helpers as h

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_helpers.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def torchrun(world: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), HELPER,
           *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_each_rank_writes_its_shards_and_the_same_mesh_restores_bit_for_bit(tmp_path):
    # the helper checks, on every rank: restore of step 6 equal bit for bit to the state saved, RNG per rank
    torchrun(2, "save", str(tmp_path), "0.0")
    store = str(tmp_path / "store")
    m = load_manifest(os.path.join(store, "manifests", "step-00000006.json"))
    assert m.world_size == 2 and sorted(m.files) == ["step-00000006.rank0.safetensors",
                                                     "step-00000006.rank1.safetensors"]
    assert m.blocks["model/0.weight"].rows == [[0, 51], [51, 101]]  # torch.chunk's split, as FSDP2 shards
    assert m.blocks["optim/0.weight/exp_avg"].rows == [[0, 51], [51, 101]]
    for k in ("model/0.weight#rows=0:51", "model/0.weight#rows=51:101"):  # each shard in its rank's file
        assert m.tensors[k].file == f"step-00000006.rank{0 if k.endswith(':51') else 1}.safetensors"
    sizes = [m.files[f].size for f in sorted(m.files)]
    assert abs(sizes[0] - sizes[1]) < 0.2 * sum(sizes), sizes  # every rank wrote its share, no gather
    assert m.layers["0"].tensors.count("model/0.weight#rows=0:51") == 1 and len(
        [k for k in m.layers["0"].tensors if k.startswith("model/0.weight")]) == 2

    # 2 -> 1: a plain model restores the composite whole, equal to the gathered original
    ref = torch.load(tmp_path / "ref.2.pt", weights_only=True)
    model = h.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert layerckpt.restore(store, model, opt).step == 6
    h.check(model, opt, ref)
    loaded = layerckpt.read_checkpoint(store)
    for k, v in ref.items():
        if k.startswith("model/"):
            assert torch.equal(loaded.model[k[len("model/"):]], v), k

    # 1 -> 2: a checkpoint of the plain model, restored into two ranks' shards
    one = tmp_path / "one"
    h.train(model, opt, 2, seed=5)
    with layerckpt.Checkpointer(str(one / "store"), model, opt, layerckpt.Config(threshold=0.0)) as ck:
        ck.save(8)
    torch.save(h.full_state(model, opt), one / "ref.pt")
    torchrun(2, "load", str(one))


def test_four_ranks_restore_onto_two(tmp_path):
    torchrun(4, "save", str(tmp_path), "0.0")  # 101 rows: 26 + 26 + 26 + 23; the 5-row bias leaves rank 3 none
    m = load_manifest(os.path.join(str(tmp_path / "store"), "manifests", "step-00000006.json"))
    assert m.blocks["model/1.bias"].rows == [[0, 2], [2, 4], [4, 5]] and len(m.files) == 4
    shutil.copy(tmp_path / "ref.4.pt", tmp_path / "ref.pt")
    torchrun(2, "load", str(tmp_path))


def test_selective_saves_decide_alike_on_every_rank(tmp_path):
    torchrun(2, "save", str(tmp_path))  # the default rule, with each rank measuring its own shards
    store = str(tmp_path / "store")
    ms = [json.loads(open(os.path.join(store, "manifests", f"step-0000000{s}.json")).read()) for s in (2, 4, 6)]
    assert [m["layers"]["0"]["reason"] for m in ms][0] == "first"
    for m in ms[1:]:  # one composite: every layer's shards from one step, both ranks' shards listed
        for name, e in m["layers"].items():
            steps = {m["tensors"][k]["file"].split(".")[0] for k in e["tensors"]}
            assert steps == {f"step-{e['step']:08d}"}, (name, steps)
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "verify", store], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "3 of 3 checkpoint(s) verified" in r.stdout, r.stdout + r.stderr


def test_lightning_model_parallel_strategy_resumes_bit_for_bit(tmp_path):
    """ModelParallelStrategy (FSDP2 in configure_model) on 2 CPU processes: LayerCheckpoint saves each rank's
    shards; a run stopped at step 14 and resumed from "last" ends bit for bit as the uninterrupted run
    (model, optimizer, each rank's RNG: the model has dropout)."""
    script = os.path.join(os.path.dirname(HELPER), "lit_fsdp_helpers.py")
    for mode in ("ref", "crash", "resume"):
        r = subprocess.run([sys.executable, script, str(tmp_path), mode], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_manifest(os.path.join(str(tmp_path / "run"), "manifests", "step-00000020.json"))
    assert m.world_size == 2 and len(m.files) == 2 and "model/net.h.0.c_attn.weight" in m.blocks
    for rank in (0, 1):
        ref = torch.load(tmp_path / f"ref.rank{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / f"resume.rank{rank}.pt", weights_only=True)
        assert int(got.pop("restored_step")) == 12 and int(ref.pop("restored_step")) == -1
        for k, v in ref.items():
            assert torch.equal(got[k], v), (rank, k)


def test_a_rank_killed_before_the_commit_leaves_the_previous_composite(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", HELPER, "kill",
           str(tmp_path), "0.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode != 0 and "SIGKILL" in r.stdout + r.stderr, r.stderr[-2000:]
    store = str(tmp_path / "store")
    data = set(os.listdir(os.path.join(store, "data")))
    assert "step-00000006.rank1.safetensors" in data  # its shards were durable: only the commit was missing
    model = h.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert layerckpt.restore(store, model, opt).step == 4  # resharded 2 -> 1 too
    h.check(model, opt, torch.load(tmp_path / "ref.pt", weights_only=True))
    layerckpt.Checkpointer(store, model, opt).close()  # the next open removes the torn save's files
    assert not any(n.startswith("step-00000006") for n in os.listdir(os.path.join(store, "data")))


def test_bounded_loss_shards_restore_alike_on_any_mesh_within_the_recorded_error(tmp_path):
    """encoding='lossy' with FSDP2: each rank codes its own shards; the restore onto the same two ranks and the
    one into a plain model decode the same bits, each within the error the manifest records."""
    torchrun(2, "lossy", str(tmp_path))
    store = str(tmp_path / "store")
    m = load_manifest(os.path.join(store, "manifests", "step-00000006.json"))
    coded = {k: e.enc["lossy"] for k, e in m.tensors.items() if e.enc and e.enc.get("lossy")}
    assert {"model/0.weight#rows=0:51", "model/0.weight#rows=51:101", "optim/0.weight/exp_avg#rows=0:51",
            "optim/0.weight/exp_avg_sq#rows=51:101"} <= set(coded), sorted(coded)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    model = h.model(h.WIDE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layerckpt.restore(store, model, opt)
    whole = h.full_state_local(model, opt)
    ranks = [torch.load(tmp_path / f"restored.{r}.pt", weights_only=True) for r in (0, 1)]
    for k, v in whole.items():
        shards = [r[k] for r in ranks]
        if v.dim() and shards[0].shape != v.shape:  # sharded by rows: the ranks' rows, in order
            assert torch.equal(torch.cat(shards), v), k
        else:
            assert all(torch.equal(s, v) for s in shards), k
        if not v.dim():
            assert torch.equal(v, ref[k]), k
            continue
        rows = sorted(tuple(map(int, key.split("#rows=")[1].split(":"))) for key in m.tensors
                      if key.startswith(f"{k}#rows=")) or [(0, len(v))]
        for a, b in rows:
            rec = coded.get(f"{k}#rows={a}:{b}") or coded.get(k)
            err = (v[a:b].double() - ref[k][a:b].double()).abs().max().item()
            assert err <= (rec["max_err"] if rec else 0.0), (k, a, err, rec)
    assert any(rec["max_err"] > 0 for rec in coded.values())
