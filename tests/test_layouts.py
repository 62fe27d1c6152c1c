"""Any DTensor layout on CPU with gloo (tests/tp_helpers.py): FSDP2 x tensor parallel and HSDP on 2 x 2 meshes
save each rank's boxes once across replicas, restore onto the same mesh bit for bit (weights, AdamW state, RNG)
and reshard onto other layouts (2 x 2 -> 1, -> 2 FSDP2 ranks, -> 2 x 2 with the mesh dims swapped, HSDP -> FSDP2 x
TP, 1 -> 2 x 2) element for element; a Partial DTensor is refused; a manifest's boxes are checked before anything is read."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt.format._manifest import load_manifest
import tp_helpers as h

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_helpers.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def torchrun(world: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), HELPER,
           *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_fsdp_x_tp_saves_boxes_once_and_reshards(tmp_path):
    # the helper checks on every rank: the same 2 x 2 mesh restores bit for bit, and a Partial DTensor is refused
    torchrun(4, "save", str(tmp_path), "tp")
    store = str(tmp_path / "store")
    m = load_manifest(os.path.join(store, "manifests", "step-00000004.json"))
    assert m.version == 5 and m.world_size == 4 and len(m.files) == 4  # boxes (3), checksums sealed to the key (4) and the step (5)
    # RowwiseParallel's Shard(1) under FSDP2's Shard(0): four boxes of a quarter each
    assert m.boxes["model/blocks.0.down.weight"].boxes == [[[0, 0], [6, 10]], [[0, 10], [6, 10]],
                                                          [[6, 0], [6, 10]], [[6, 10], [6, 10]]]
    assert m.boxes["optim/blocks.0.down.weight/exp_avg"].shape == [12, 20]
    # ColwiseParallel's Shard(0) under FSDP2's _StridedShard: rank (dp i, tp j) holds rows (2j + i) * 5, in rows
    assert m.blocks["model/blocks.0.up.weight"].rows == [[0, 5], [5, 10], [10, 15], [15, 20]]
    files = {m.tensors[f"model/blocks.0.up.weight#rows={a}:{a + 5}"].file for a in (0, 5, 10, 15)}
    assert len(files) == 4  # each rank its own box
    # the embedding is sharded over dp only: each half is held by both tp ranks, and each of them writes half of it
    assert m.blocks["model/emb.weight"].rows == [[0, 10], [10, 19], [19, 28], [28, 37]]
    assert len({m.tensors[f"model/emb.weight#rows={a}:{b}"].file for a, b in m.blocks["model/emb.weight"].rows}) == 4
    sizes = [m.files[f].size for f in sorted(m.files)]
    assert max(sizes) <= 1.5 * min(sizes), sizes  # every rank writes about its share

    # 2 x 2 -> one plain process: every tensor whole, element for element; read_checkpoint sees whole tensors
    h.load(str(tmp_path), "plain")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    loaded = layerckpt.read_checkpoint(store)
    assert torch.equal(loaded.model["blocks.1.down.weight"], ref["model/blocks.1.down.weight"])
    names = [n for g in m.optimizer["param_groups"] for n in g["params"]]  # the saved order numbers them
    for n in ("blocks.0.up.weight", "blocks.0.down.weight", "emb.weight"):
        st = loaded.optimizer["state"][names.index(n)]
        assert torch.equal(st["exp_avg_sq"], ref[f"optim/{n}/exp_avg_sq"]), n
    torchrun(2, "load", str(tmp_path), "dp")  # 2 x 2 -> 2 FSDP2 ranks (dp only)
    torchrun(4, "load", str(tmp_path), "tpswap")  # 2 x 2 -> 2 x 2 with the mesh dims swapped
    _refuses_hostile_boxes(tmp_path, store)


def _refuses_hostile_boxes(tmp_path, store: str) -> None:
    path = os.path.join(store, "manifests", "step-00000004.json")
    good = json.loads(open(path).read())
    key = "model/blocks.0.down.weight"
    cases = {
        "outside": ([[[0, 0], [6, 10]], [[0, 10], [6, 11]], [[6, 0], [6, 10]], [[6, 10], [6, 10]]], "inside the shape"),
        "overlap": ([[[0, 0], [6, 10]], [[0, 5], [6, 10]], [[6, 0], [6, 10]], [[6, 10], [6, 10]]], "overlaps"),
        "cover-twice": ([[[0, 0], [12, 20]], [[0, 0], [12, 20]]], "do not add up"),
        "short": ([[[0, 0], [6, 10]], [[6, 0], [6, 10]], [[6, 10], [6, 10]]], "do not add up"),
        "not-a-box": ([[[0, 0], [6, 10]], [[0, 10]], [[6, 0], [6, 10]], [[6, 10], [6, 10]]], "malformed box"),
    }
    for name, (boxes, msg) in cases.items():
        bad = json.loads(json.dumps(good))
        bad["boxes"][key]["boxes"] = boxes
        d = tmp_path / name / "manifests"
        d.mkdir(parents=True)
        with open(d / "step-00000004.json", "w") as f:
            json.dump(bad, f)
        with pytest.raises(layerckpt.CheckpointCorruptError, match=msg):
            load_manifest(str(d / "step-00000004.json"))
    bad = json.loads(json.dumps(good))
    del bad["tensors"][f"{key}#box=6,10:6,10"]
    with open(tmp_path / "missing.json", "w") as f:
        json.dump(bad, f)
    with pytest.raises(layerckpt.CheckpointCorruptError, match=r"box 'model/blocks.0.down.weight#box=6,10:6,10'"):
        load_manifest(str(tmp_path / "missing.json"))


def test_hsdp_restores_bit_for_bit_and_reshards_onto_fsdp_x_tp(tmp_path):
    torchrun(4, "save", str(tmp_path), "hsdp")  # (Replicate, Shard(0)): each shard's rows split among its replicas
    m = load_manifest(os.path.join(str(tmp_path / "store"), "manifests", "step-00000004.json"))
    assert m.blocks["model/emb.weight"].rows == [[0, 10], [10, 19], [19, 28], [28, 37]]
    assert m.boxes is None and m.version == 5  # row blocks only, but step-sealed checksums: an older reader says upgrade
    files = {m.tensors[f"model/emb.weight#rows={a}:{b}"].file for a, b in m.blocks["model/emb.weight"].rows}
    assert len(files) == 4  # the replicas share the writing, each row written once
    torchrun(4, "load", str(tmp_path), "tp")


def test_a_rank_killed_before_the_commit_leaves_the_previous_composite(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", HELPER, "kill",
           str(tmp_path), "tp"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode != 0 and "SIGKILL" in r.stdout + r.stderr, r.stderr[-2000:]
    store = str(tmp_path / "store")
    assert "step-00000006.rank1.safetensors" in os.listdir(os.path.join(store, "data"))  # durable, not committed
    h.load(str(tmp_path), "plain")  # the composite of step 4, resharded 2 x 2 -> 1, element for element


def test_one_process_restores_onto_fsdp_x_tp(tmp_path):
    h.save(str(tmp_path), "plain")
    torchrun(4, "load", str(tmp_path), "tp")


def test_selective_saves_decide_alike_across_mesh_dims(tmp_path):
    torchrun(4, "selective", str(tmp_path), "tp")
    store = str(tmp_path / "store")
    ms = [json.loads(open(os.path.join(store, "manifests", f"step-0000000{s}.json")).read()) for s in (2, 4, 6)]
    assert {e["reason"] for e in ms[0]["layers"].values()} == {"first"}
    for m in ms[1:]:  # one composite: every layer's boxes from one step, all four ranks' boxes listed once
        for name, e in m["layers"].items():
            steps = {m["tensors"][k]["file"].split(".")[0] for k in e["tensors"]}
            assert steps == {f"step-{e['step']:08d}"}, (name, steps)
            assert len(e["tensors"]) == len(set(e["tensors"]))
        assert sorted(m["boxes"]["model/blocks.1.down.weight"]["boxes"]) == sorted(
            ms[0]["boxes"]["model/blocks.1.down.weight"]["boxes"])
    assert any(e["step"] < 6 for e in ms[2]["layers"].values()), "the rule skipped nothing: no selection tested"
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "verify", store], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "3 of 3 checkpoint(s) verified" in r.stdout, r.stdout + r.stderr


def test_lightning_model_parallel_2x2_resumes_bit_for_bit(tmp_path):
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) on 4 CPU processes: LayerCheckpoint saves
    each rank's boxes; a run stopped at step 10 and resumed from "last" (step 8) ends bit for bit as the
    uninterrupted run (model, AdamW state, each rank's RNG); resumed instead into data_parallel_size=4,
    tensor_parallel_size=1 (a layout change), it starts from step 8's state element for element."""
    script = os.path.join(os.path.dirname(HELPER), "lit_tp_helpers.py")
    for mode in ("ref", "crash", "resume", "reshard"):
        if mode == "resume":
            shutil.copytree(tmp_path / "run", tmp_path / "reshard")
        r = subprocess.run([sys.executable, script, str(tmp_path), mode], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_manifest(os.path.join(str(tmp_path / "run"), "manifests", "step-00000012.json"))
    assert m.world_size == 4 and len(m.files) == 4 and "model/net.blocks.0.down.weight" in m.boxes
    for rank in range(4):
        ref = torch.load(tmp_path / f"ref.rank{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / f"resume.rank{rank}.pt", weights_only=True)
        assert int(got.pop("restored_step")) == 8 and int(ref.pop("restored_step")) == -1
        for k, v in ref.items():
            assert torch.equal(got[k], v), (rank, k)
    saved = layerckpt.read_checkpoint(str(tmp_path / "reshard"), step=8)
    names = [n for g in load_manifest(os.path.join(str(tmp_path / "run"), "manifests", "step-00000008.json")
                                      ).optimizer["param_groups"] for n in g["params"]]
    for rank in range(4):
        start = torch.load(tmp_path / f"start.rank{rank}.pt", weights_only=True)
        assert len(start) == len(ref) - 1  # every weight and AdamW state tensor
        for k, v in start.items():
            if k.startswith("model/"):
                want = saved.model[k[len("model/"):]]
            else:
                name, key = k[len("optim/"):].rsplit("/", 1)
                want = saved.optimizer["state"][names.index(name)][key]
            assert torch.equal(v, want), (rank, k)


def test_boxes_of_any_placement_on_meshes_up_to_3_dims_match_dtensor_and_cover_once():
    """In one process: every coordinate's boxes on 1-3 dim meshes (Shard on any dim, a dim sharded by several mesh
    dims, Replicate, _StridedShard) are the local shape and offset DTensor computes, and together cover the
    tensor once."""
    import itertools
    import random

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from layerckpt.write._gather import _boxes_at
    from layerckpt.format._manifest import Boxes, _check_cover

    rnd = random.Random(0)
    for _ in range(60):
        mesh = tuple(rnd.choice((1, 2, 3)) for _ in range(rnd.choice((1, 2, 3))))
        shape = [rnd.choice((1, 4, 5, 7)) for _ in range(rnd.choice((1, 2, 3)))]
        placements = tuple(rnd.choice([Replicate()] + [Shard(d) for d in range(len(shape))]) for _ in mesh)
        pieces = set()
        for coord in itertools.product(*map(range, mesh)):
            boxes = _boxes_at(shape, mesh, list(coord), placements, None)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            if 0 in local:
                assert boxes == [], (mesh, shape, placements, coord)
                continue
            assert [(o, s) for o, s, _ in boxes] == [(list(offset), list(local))], (mesh, shape, placements, coord)
            pieces |= {(tuple(o), tuple(s)) for o, s, _ in boxes}
        _check_cover("t", Boxes("F32", shape, [[list(o), list(s)] for o, s in sorted(pieces)]), "p")
    # FSDP2 over a TP shard of the same dim: _StridedShard first, on 2-D and 3-D (HSDP x TP) meshes
    from torch.distributed.tensor.placement_types import _StridedShard

    for mesh, placements, shape in [((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), [10, 3]),
                                    ((2, 3), (_StridedShard(1, split_factor=3), Shard(1)), [4, 13]),
                                    ((2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), [9, 2])]:
        pieces = set()
        for coord in itertools.product(*map(range, mesh)):
            boxes = _boxes_at(shape, mesh, list(coord), placements, None)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            extent = [max(sl[d].stop for _, _, sl in boxes) for d in range(len(shape))] if boxes else None
            assert extent is None or (extent == list(local) and boxes[0][0] == list(offset)), (mesh, coord, boxes)
            pieces |= {(tuple(o), tuple(s)) for o, s, _ in boxes}
        _check_cover("t", Boxes("F32", shape, [[list(o), list(s)] for o, s in sorted(pieces)]), "p")

