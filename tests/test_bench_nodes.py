"""`layerckpt bench --nodes` runs end to end on 2 simulated nodes (tiny size, 1 repeat, a few steps: a smoke test,
not a measurement) and its --json holds every figure, sane."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _sane(s, name):
    assert s["min"] <= s["median"] <= s["max"] and len(s["all"]) == 1 and s["min"] >= 0, (name, s)


def test_bench_nodes_tiny_json(tmp_path):
    # the command starts 2 torchrun node launchers (save, then restore) on layerckpt.bench.nodes itself
    cmd = [sys.executable, "-m", "layerckpt.cli", "bench", "--nodes", "--size", "tiny", "--reps", "1", "--steps-n",
           "4", "--steps-every", "2", "--steps-rounds", "1", "--json", "--dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = json.loads(r.stdout)
    assert (res["bench"], res["size"], res["nodes"], res["nproc_per_node"], res["world"], res["reps"]) == \
        ("nodes", "tiny", 2, 1, 2, 1)
    assert res["state_bytes"] > 0 and res["parameters"] > 0
    m = res["machine"]
    assert m["cores"] >= 1 and m["torch"] and "commit" in m and "bench --nodes" in m["command"]
    assert res["remote"]["url"].startswith(("s3://", "file://"))
    for name in ("node-local", "shared", "dcp.save", "node-local replicas=1"):
        s = res["saves"][name]
        _sane(s["durable_s"], name)
        assert s["durable_s"]["median"] > 0 and len(s["bytes_per_rank"]) == 2
        assert all(b > 0 for b in s["bytes_per_rank"])
    rep = res["replication"]
    _sane(rep["lag_s"], "lag")
    assert set(rep["nodes"]) == {"node0", "node1"} and all(n["error"] is None for n in rep["nodes"].values())
    # each node sends its own part: about the bytes its ranks wrote, every checkpoint
    for k in (0, 1):
        written = res["saves"]["node-local replicas=1"]["bytes_per_rank"][k]
        assert 0.5 * written <= rep["bytes_sent_per_checkpoint"][f"node{k}"] <= 2 * written, rep
        assert rep["bytes_held"][f"node{1 - k}"] > 0
    runs = res["steps"]["runs"]
    assert set(runs) == {"none", "replicas=0", "replicas=1"}
    assert all(runs[n]["mean_step_s"] > 0 for n in runs) and runs["replicas=1"]["saves"] == 1
    restores = res["restores"]
    assert set(restores) == {"disk", "shared", "replica", "remote", "dcp.load"}
    assert all(r["bit_exact"] is True for r in restores.values())
    assert restores["disk"]["sources"] == {"0": "disk", "1": "disk"}
    assert restores["replica"]["sources"] == {"0": "disk", "1": "replica"}  # node1 lost: its part from node0
    assert restores["remote"]["sources"]["1"] == "remote"
    assert restores["shared"]["sources"] == {}  # one directory: no parts
    for name, r in restores.items():
        _sane(r["s"], name)
    for k in ("node-local durable / shared durable", "dcp.save durable / node-local durable",
              "replicas=1 step / replicas=0 step", "replica restore / disk restore",
              "remote restore / replica restore"):
        assert res["ratios"][k] > 0, k
    assert set(res["targets"]) == {"node-local durable / shared durable", "replicas=1 step / replicas=0 step",
                                   "replica restore / disk restore"}
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself
    assert not os.path.exists(res["layout"]["shm"])


def test_bench_nodes_needs_two_nodes(capsys):
    from layerckpt import cli

    assert cli.main(["bench", "--nodes", "1"]) == 2
    assert "--nodes 1: give 2 or more nodes" in capsys.readouterr().err
