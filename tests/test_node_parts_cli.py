"""`layerckpt verify` / `inspect` on a node's part: a node-local checkpoint directory (``part.json``) that holds
every committed manifest but only the data files of its own ranks.  The parts are real: two gloo processes on
this host, each its own node (``LAYERCKPT_NODE``) with its own directory, save twice."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import stored_byte

CHILD = r"""
import datetime, os, sys, torch, torch.distributed as dist
rank, world, base, port, here = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LAYERCKPT_NODE=f"n{rank}",
                  LAYERCKPT_SHM=os.path.join(base, f"shm{rank}"))
os.makedirs(os.path.join(base, f"shm{rank}"), mode=0o700, exist_ok=True)
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
sys.path.insert(0, here)
import layerckpt
from conftest import trained
model, opt = trained(0)  # the same on every rank, as DDP keeps it
ck = layerckpt.Checkpointer(os.path.join(base, f"n{rank}"), model, opt, config=layerckpt.Config(threshold=0.0))
for s in (1, 2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * s)
    ck.save(s).wait()
ck.close()
dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks aborts the peer
dist.destroy_process_group()
print("DONE", rank, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "layerckpt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """BASE with BASE/n0 and BASE/n1: the parts of nodes n0 (rank 0) and n1 (rank 1) of two checkpoints."""
    base = tmp_path_factory.mktemp("parts")
    port, here = str(_free_port()), os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), "2", str(base), port, here],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and "DONE" in out, err
    for r in range(2):
        part = json.loads((base / f"n{r}" / "part.json").read_text())
        assert part["node"] == f"n{r}" and part["ranks"] == [r] and part["nodes"] == ["n0", "n1"]
        assert sorted(os.listdir(base / f"n{r}" / "data")) == [f"step-0000000{s}.rank{r}.safetensors" for s in (1, 2)]
    return base


@pytest.fixture
def n0(parts, tmp_path):
    """A copy of node n0's part, to damage."""
    d = tmp_path / "n0"
    shutil.copytree(parts / "n0", d)
    return d


def _flip(root, fname):
    """Flip a byte in the middle of a model tensor that data file ``fname`` holds."""
    step = int(fname.split(".")[0].split("-")[1])
    m = json.loads((root / "manifests" / f"step-{step:08d}.json").read_text())
    entry = next(e for k, e in sorted(m["tensors"].items()) if e["file"] == fname and k.startswith("model/"))
    path = root / "data" / fname
    b = bytearray(path.read_bytes())
    b[stored_byte(entry)] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("node", [0, 1])
def test_verify_a_node_part_passes_and_names_the_files_elsewhere(parts, node):
    other = 1 - node
    r = cli("verify", parts / f"n{node}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and "DAMAGED" not in r.stdout and "missing" not in r.stdout
    assert f"node n{node}'s directory (ranks [{node}] of 2)" in r.stdout
    assert f"elsewhere: 2 file(s) of ranks [{other}] are on the other nodes (n{other})" in r.stdout
    assert "2 of 2 checkpoint(s) verified" in r.stdout


def test_inspect_says_whose_part(parts):
    r = cli("inspect", parts / "n0")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "node part: node n0's directory (ranks [0] of 2); the other nodes' files are on n1"
    assert "committed steps: [1, 2]" in r.stdout


def test_a_damaged_file_of_its_own_ranks_fails(n0):
    _flip(n0, "step-00000002.rank0.safetensors")
    r = cli("verify", n0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL step-00000002.json: checksum mismatch" in r.stdout
    assert "DAMAGED step-00000002.rank0.safetensors" in r.stdout
    assert "1 of 2 checkpoint(s) verified" in r.stdout and "1 failed" in r.stdout


def test_a_missing_file_of_its_own_ranks_fails(n0):
    (n0 / "data" / "step-00000001.rank0.safetensors").unlink()
    r = cli("verify", n0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL step-00000001.json: data file" in r.stdout
    assert "step-00000001.rank0.safetensors is missing" in r.stdout
    assert "elsewhere: 2 file(s) of ranks [1]" in r.stdout  # the other node's files are still not failures


def test_another_nodes_file_present_here_is_checked(parts, n0):
    shutil.copy(parts / "n1" / "data" / "step-00000002.rank1.safetensors", n0 / "data")
    r = cli("verify", n0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "elsewhere: 1 file(s) of ranks [1]" in r.stdout
    _flip(n0, "step-00000002.rank1.safetensors")
    r = cli("verify", n0)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED step-00000002.rank1.safetensors" in r.stdout


def test_without_its_part_record_the_directory_is_a_whole_store(n0):
    (n0 / "part.json").unlink()
    r = cli("verify", n0)
    assert r.returncode == 1 and "node part" not in r.stdout and "elsewhere" not in r.stdout
    assert "step-00000001.rank1.safetensors is missing" in r.stdout
