"""FSDP2 over simulated nodes (tests/test_nodes.py's harness, tests/fsdp_helpers.py's runs): 2 nodes x 2 ranks,
each node its own directory and memory tier, every rank writing its own shards into its node's directory; a
node lost with its disk and memory restores its ranks' shards from its partner's replica, bit for bit."""
from __future__ import annotations

import ast
import os
import shutil

import test_nodes
from test_nodes import launch, lose_node

HERE = os.path.dirname(os.path.abspath(__file__))


def _ok(results, what: str) -> None:
    for k, (rc, out, err) in enumerate(results):
        assert rc == 0, f"{what}: node {k} exited {rc}\n{err[-4000:]}"


def test_fsdp2_shards_on_node_local_directories_come_back_after_a_node_loss(tmp_path, monkeypatch):
    base = str(tmp_path)
    monkeypatch.setattr(test_nodes, "HELPER", os.path.join(HERE, "fsdp_helpers.py"))
    env = {"FSDP_NODE_STORES": "1", "FSDP_REPLICAS": "1"}
    # save: steps 2, 4, 6, then a restore of step 6 into the same ranks (a process crash) checked bit for bit
    _ok(launch(base, 2, ["save", base, "0.0"], node_env={0: env, 1: env}), "the sharded save")
    for k in range(2):
        names = os.listdir(os.path.join(base, f"node{k}", "data"))
        assert names and all(f".rank{2 * k}." in n or f".rank{2 * k + 1}." in n for n in names), names
    shutil.copy(os.path.join(base, "ref.4.pt"), os.path.join(base, "ref.pt"))
    lose_node(base, 1)
    _ok(launch(base, 2, ["load", base, "0.0"], node_env={0: env, 1: env}), "the restore after node 1 was lost")
    for r in range(4):  # every rank's shards checked against the full state of step 6 inside the run
        with open(os.path.join(base, f"sources.{r}.txt")) as f:
            sources = dict(ast.literal_eval(f.read()))
        assert sources == {0: "disk", 1: "disk", 2: "replica", 3: "replica"}, sources
