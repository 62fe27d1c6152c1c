"""`layerckpt bench --policy --through`: the family trained and resumed through each framework adapter.

Each adapter's row is judged against that adapter's own uninterrupted run; with ``Config(full=True)`` every resume
must put the run back bit for bit, so the losses after it equal the uninterrupted run's exactly (deviation 0.0):
a resume that lost or skipped state would not.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from layerckpt import Config
from layerckpt.bench import policy_through
from layerckpt.bench.family import WORKLOADS
from layerckpt.errors import CheckpointError

import lightning  # noqa: F401
import accelerate  # noqa: F401
import transformers  # noqa: F401

STEPS = 20  # 4 saves at the family's cadence of 5


@pytest.fixture(autouse=True)
def quiet():
    """The frameworks quieted as the bench quiets them, their loggers' levels put back for the tests after."""
    import logging

    levels = policy_through.quiet_frameworks()
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def _row(tmp_path, through: str, config: Config, crashes, name: str = "finetune-1e-4"):
    return policy_through.run(WORKLOADS[name], through, config, str(tmp_path), crashes, steps=STEPS)


@pytest.mark.parametrize("through", policy_through.ADAPTERS)
def test_full_mode_resumes_every_adapter_exactly(tmp_path, through):
    row = _row(tmp_path, through, Config(full=True), (0.25, 0.75))
    assert row["through"] == through and row["saves"] == STEPS // 5
    # every save wrote every layer: raw bytes are the whole composites'
    assert row["bytes"] == row["full_bytes"] > 0 and row["ratio"] == 1.0
    assert [c["step"] for c in row["crashes"]] == [5, 15]
    for c in row["crashes"]:
        assert c["deviation"] == 0.0, (through, c)
        assert c["behind"] == 0


@pytest.mark.parametrize("through", policy_through.ADAPTERS)
def test_defaults_through_each_adapter_select_and_stay_within_half_a_percent(tmp_path, through):
    row = _row(tmp_path, through, Config(), (0.5,), name="lora")
    # the frozen base is written once, the adapters at every save: far fewer bytes than full checkpoints
    assert row["ratio"] > 2.0, row
    for c in row["crashes"]:
        assert math.isfinite(c["deviation"]) and abs(c["deviation"]) <= 0.005, (through, c)
    # the uninterrupted run's folder was removed with the crash copies: nothing left but what the caller owns
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_through_names_are_checked_before_any_work():
    with pytest.raises(CheckpointError, match=r"--through core,keras: give distinct names of core, lightning"):
        policy_through.parse_through("core,keras")
    with pytest.raises(CheckpointError, match="give distinct names"):
        policy_through.parse_through("trainer,trainer")
    assert policy_through.parse_through(" core , trainer") == ["core", "trainer"]


def test_cli_refuses_through_without_policy_and_a_wrong_name_in_one_line():
    for argv, want in ((["--through", "lightning"], "--through does not apply to bench without a mode flag"),
                       (["--policy", "--through", "fabric"], "--through fabric: give distinct names")):
        r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and want in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_the_report_renders_a_through_only_json():
    row = {"workload": "lora", "through": "trainer", "steps": 20, "every": 5, "saves": 4, "bytes": 10,
           "written_bytes": 12, "full_bytes": 200, "ratio": 20.0,
           "crashes": [{"step": 5, "deviation": 0.001, "behind": 5}, {"step": 10, "deviation": -0.006, "behind": 0}]}
    from layerckpt.bench import report

    text = report.VIEWS[report.view_of({"rows": [], "through": [row]})](json.loads(json.dumps(
        {"config": Config().to_dict(), "rows": [], "through": [row]})))
    line = next(ln for ln in text.splitlines() if ln.startswith("lora"))
    assert "trainer" in line and "20.0x" in line and "16.7x" in line and line.endswith("MISSED")
    assert "+0.100% (  5)" in line and "-0.600% (  0)" in line
    assert "worst restore: trainer 0.600% over 1 workloads" in text
