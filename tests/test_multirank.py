"""Real multi-process saves on gloo: each rank writes a share, rank 0 commits once all are durable."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer, assert_same_state, small_model, trained

CHILD = r"""
import os, resource, sys, threading, torch, torch.distributed as dist, layerckpt
from torch.distributed import distributed_c10d as c10d
rank, world, root, port, here, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
sys.path.insert(0, here)
from conftest import trained
model, opt = trained(0)  # the same on every rank, as DDP keeps it
torch.manual_seed(1000 + rank)  # but each rank's RNG is its own
ck = layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(threshold=0.05, keep_last=0))
p = ck.save(1, extra={"note": "hello"}).wait()
print("SAVE1", p.nbytes, flush=True)
with torch.no_grad():
    for q in model.h[2].parameters():
        q.mul_(1.5)
if mode == "fail" and rank == 1:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    p = ck.save(2).wait()
    print("SAVE2", p.nbytes, flush=True)
except layerckpt.CheckpointWriteError as e:
    print("FAIL2", e.errno, str(e).replace(chr(10), " "), flush=True)
print("RNG", torch.rand(1).item(), flush=True)
groups = len(c10d._world.pg_map)
ck.close()
# nothing of ours outlives close(): its gloo group is destroyed, its threads are joined
print("LEFT", groups - len(c10d._world.pg_map), sum(t.name.startswith("layerckpt") for t in threading.enumerate()),
      flush=True)
dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks aborts the peer
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(root, mode="ok", world=2, env=None):
    port = str(_free_port())
    here = os.path.dirname(__file__)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), str(root), port, here, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=None if env is None else {**os.environ, **env}) for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append({line.split()[0]: line.split()[1:] for line in out.splitlines()})
    return outs


def test_two_ranks_share_the_bytes_and_commit_once(tmp_path):
    outs = _run(tmp_path)
    m = json.loads((tmp_path / "manifests" / "step-00000001.json").read_text())
    assert m["world_size"] == 2 and sorted(m["files"]) == ["step-00000001.rank0.safetensors",
                                                           "step-00000001.rank1.safetensors"]
    assert [o["LEFT"] for o in outs] == [["1", "0"], ["1", "0"]]  # one group destroyed, no thread left, per rank
    n0, n1 = (int(o["SAVE1"][0]) for o in outs)
    assert abs(n0 - n1) < 0.35 * (n0 + n1), (n0, n1)  # each rank wrote about half
    assert {e["rank"] for e in m["layers"].values()} == {0, 1}
    for layer in m["layers"].values():  # a layer's weights and moments sit in its owner's file
        files = {m["tensors"][k]["file"] for k in layer["tensors"]}
        assert files == {f"step-00000001.rank{layer['rank']}.safetensors"}
    assert "1" in m["rng_ranks"]
    # step 2: only h.2 moved; one rank wrote it, the composite carries the rest
    m2 = json.loads((tmp_path / "manifests" / "step-00000002.json").read_text())
    assert m2["layers"]["h.2"]["step"] == 2 and m2["layers"]["h.0"]["step"] == 1
    # a single process restores what two wrote, bit for bit
    model, opt = trained(0)
    fresh = small_model(9)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    layerckpt.restore(tmp_path, fresh, fopt, step=1)
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fopt)


def test_a_failing_rank_fails_the_save_everywhere(tmp_path):
    outs = _run(tmp_path, mode="fail")
    for o in outs:
        assert "FAIL2" in o, o
    assert "rank 1 failed" in " ".join(outs[0]["FAIL2"])  # rank 0 is told which rank failed
    assert not (tmp_path / "manifests" / "step-00000002.json").exists()
    assert not any("00000002" in f for f in os.listdir(tmp_path / "data"))
    assert layerckpt.restore(tmp_path, small_model()).step == 1


def test_two_ranks_sign_one_manifest_over_both_files(tmp_path):
    """$LAYERCKPT_SIGN_KEY on every rank: each rank digests its own file as it writes it, rank 0 signs the manifest
    over both digests; a restore with the key reads what two wrote bit for bit, and refuses a byte edited in rank 1's
    file (its digest, checked before any tensor is read)."""
    import hashlib

    key = "multirank-signing-key-0123456789"
    _run(tmp_path, env={"LAYERCKPT_SIGN_KEY": key})
    m = json.loads((tmp_path / "manifests" / "step-00000001.json").read_text())
    assert sorted(m["files"]) == ["step-00000001.rank0.safetensors", "step-00000001.rank1.safetensors"]
    for name, e in m["files"].items():
        data = (tmp_path / "data" / name).read_bytes()
        at = 0
        for n, hexd in e["digest"]:
            assert hashlib.sha256(data[at:at + n]).hexdigest() == hexd, name
            at += n
        assert at == len(data) == e["size"]
    cfg = layerckpt.Config(sign_key=key)
    model, opt = trained(0)
    fresh = small_model(9)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    layerckpt.restore(tmp_path, fresh, fopt, step=1, config=cfg)
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fopt)
    layerckpt.restore(tmp_path, small_model(9), step=2, config=cfg)  # a composite carrying step 1's files
    f = tmp_path / "data" / "step-00000001.rank1.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(layerckpt.CheckpointCorruptError, match="do not match the digest"):
        layerckpt.restore(tmp_path, small_model(9), step=1, config=cfg)
