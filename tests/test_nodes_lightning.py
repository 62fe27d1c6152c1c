"""Lightning over simulated nodes (tests/test_nodes.py's harness): ``LayerCheckpoint(dirpath=<node-local>,
replicas=1)`` under a DDP Trainer of 2 nodes x 1 rank, each node its own directory and memory tier; a node
lost after a crash comes back with ``fit(ckpt_path="last")`` from its partner's replica, bit for bit."""
from __future__ import annotations

import os

import torch

from conftest import assert_same_optimizer_state, assert_same_tensors
import test_nodes
from test_nodes import launch, lose_node

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "nodes_lightning_helpers.py")


def _ok(results, what: str) -> None:
    for k, (rc, out, err) in enumerate(results):
        assert rc == 0, f"{what}: node {k} exited {rc}\n{err[-4000:]}"


def test_lightning_resumes_a_lost_node_from_its_partners_replica_bit_for_bit(tmp_path, monkeypatch):
    base = str(tmp_path)
    monkeypatch.setattr(test_nodes, "HELPER", WORKER)  # the harness's launcher, this worker
    # one rank per node: the world of tests/test_lightning.py's single-directory DDP resume (2 ranks), whose
    # data order a mid-epoch resume reproduces exactly (Lightning restores no sampler state of its own)
    monkeypatch.setattr(test_nodes, "NPROC", 1)
    _ok(launch(base, 2, ["ref", base]), "the uninterrupted run")
    _ok(launch(base, 2, ["crash", base]), "the run stopped at step 14")
    for k in range(2):  # each node wrote its own ranks' files only, and holds every manifest
        data = sorted(os.listdir(os.path.join(base, f"node{k}", "data")))
        assert data and all(f".rank{k}." in n for n in data), data
    lose_node(base, 1)
    _ok(launch(base, 2, ["resume", base]), "the resume")
    for r in range(2):
        ref = torch.load(os.path.join(base, f"ref.rank{r}.pt"), weights_only=False)
        got = torch.load(os.path.join(base, f"resume.rank{r}.pt"), weights_only=False)
        assert got["restored"] is not None and got["restored"]["step"] == 12, got["restored"]
        assert got["global_step"] == ref["global_step"] == 20
        assert_same_tensors(got["model"], ref["model"])
        assert_same_optimizer_state(got["optim"], ref["optim"])
        assert torch.equal(got["rng"], ref["rng"]), f"rank {r}: its RNG did not come back"
