"""`layerckpt bench --sharded` runs end to end on 2 processes (tiny size, 1 repeat: a smoke test, not a
measurement) and prints every contender."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


ROWS = {"full": "layerckpt full", "selective": "layerckpt selective", "dcp.save": "dcp.save",
        "dcp.async_save": "dcp.async_save", "layerckpt.restore": "layerckpt.restore (2->2)",
        "dcp.load": "dcp.load (2->2)", "layerckpt.restore 2->1": "layerckpt.restore 2->1", "dcp.load 2->1": "dcp.load 2->1"}


def _figures(lines):
    """(row, "blocked"/"durable"/"s") -> the median the tables print (3 decimals)."""
    out = {}
    for line in lines:
        for name in ROWS.values():
            if line.startswith(name + " "):
                medians = re.findall(r"(\d+\.\d+) \[", line[len(name):])
                cols = ("blocked", "durable") if len(medians) == 2 else ("s",)
                out.update({(name, c): float(v) for c, v in zip(cols, medians)})
    ref = next(line for line in lines if line.startswith("reference "))
    out[("O_DIRECT write", "s")] = float(re.search(r"O_DIRECT write (\d+\.\d+)s", ref).group(1))
    return out


def _operand(text: str):
    *name, col = text.strip().split(" ")
    name = " ".join(name)
    if col not in ("blocked", "durable"):  # a restore row, or the O_DIRECT reference: its only figure
        name, col = text.strip(), "s"
    return ROWS.get(name, name), col


def _check_ratios(out: str) -> None:
    """Every ratio printed is the quotient of the two medians it names (within the tables' rounding)."""
    lines = out.splitlines()
    figures = _figures(lines)
    line = next(line for line in lines if line.startswith("ratios (medians, same run): "))
    ratios = re.findall(r"([^,:]+?) = (\d+\.\d+)x", line.split(": ", 1)[1])
    assert len(ratios) == 7, line
    for label, value in ratios:
        a, b = (figures[_operand(t)] for t in label.split(" / "))
        lo, hi = (a - 5e-4) / (b + 5e-4), (a + 5e-4) / max(b - 5e-4, 1e-9)  # each median printed to 3 decimals
        assert lo - 0.005 <= float(value) <= hi + 0.005, (label, value, a, b)
    target = re.search(r"target: full sharded save at least 2x faster to durable than dcp.save: (\d+\.\d+)x", out)
    assert target and target.group(1) == dict(ratios)["dcp.save durable / full durable"], out


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
    _check_ratios(r.stdout)
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself


def test_bench_sharded_mesh_2x2_tiny(tmp_path):
    # --mesh 2x2: torchrun on 4 processes, FSDP2 over dp x tensor parallel MLPs over tp; every contender on it
    cmd = [sys.executable, "-m", "layerckpt.cli", "bench", "--sharded", "--size", "tiny", "--reps", "1", "--mesh",
           "2x2", "--dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "FSDP2 over dp=2 x tensor parallel (MLPs) over tp=2, 4 ranks" in lines[0], lines[0]
    for name in ("layerckpt full", "layerckpt selective", "dcp.save", "dcp.async_save",
                 "layerckpt.restore (4->4)", "dcp.load (4->4)", "layerckpt.restore 4->1", "dcp.load 4->1"):
        row = [line for line in lines if line.startswith(name + " ")]
        assert len(row) == 1, (name, r.stdout)
        if "restore" in name or "load" in name:
            assert row[0].rstrip().endswith("True"), row[0]  # every restore equal to the saved state
        else:
            assert len(re.findall(r"\d+\.\d+ / \d+\.\d+ / \d+\.\d+ / \d+\.\d+", row[0])) == 1, row[0]  # 4 ranks' bytes
    full = next(line for line in lines if line.startswith("layerckpt full "))
    written = [float(x) for x in re.search(r"(\d+\.\d+) / (\d+\.\d+) / (\d+\.\d+) / (\d+\.\d+)", full).groups()]
    shares = [float(x) for x in re.findall(r"(\d+\.\d+)", next(
        line for line in lines if line.startswith("each rank's share")))]
    assert sum(written) < 0.8 * sum(shares), (written, shares)  # what the tp ranks both hold is written once
    assert not list(tmp_path.iterdir())
