"""`layerckpt bench --sharded` runs end to end on 2 processes (tiny size, 1 repeat: a smoke test, not a
measurement) and prints every contender."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def test_bench_sharded_tiny(tmp_path):
    # the command launches torchrun --standalone --nproc_per_node 2 on layerckpt.bench.sharded itself
    cmd = [sys.executable, "-m", "layerckpt.cli", "bench", "--sharded", "--size", "tiny", "--reps", "1",
           "--dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for name in ("layerckpt full", "layerckpt selective", "dcp.save", "dcp.async_save",
                 "layerckpt.restore (2->2)", "dcp.load (2->2)", "layerckpt.restore 2->1", "dcp.load 2->1"):
        row = [line for line in lines if line.startswith(name + " ")]
        assert len(row) == 1, (name, r.stdout)
        if "restore" in name or "load" in name:
            assert row[0].rstrip().endswith("True"), row[0]  # every restore equal to the saved state
        else:
            assert " / " in row[0], row[0]  # bytes of both ranks
    assert any(line.startswith("machine: ") for line in lines) and "O_DIRECT write" in r.stdout
    assert "ratios (medians, same run):" in r.stdout and "target: full sharded save" in r.stdout
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself
