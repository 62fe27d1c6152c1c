"""The selection defaults on a fast subset of the workload family, through the real engine (the whole
family is `layerckpt bench --policy`), and the guards against a silent rollback."""
import logging
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt._manifest import load_manifest
from layerckpt.bench import policy
from layerckpt.bench.family import WORKLOADS


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", ["frozen-backbone", "lora"])
def test_defaults_write_10x_less_within_half_a_percent(tmp_path, name):
    r = policy.run(WORKLOADS[name], layerckpt.Config(), str(tmp_path))
    print(policy.format_table([r], layerckpt.Config()))
    assert r["ratio"] >= 10.0
    assert all(abs(c["deviation"]) <= policy.LOSS_TARGET for c in r["crashes"]), r["crashes"]
    assert policy.meets(r)


def test_defaults_keep_a_fast_moving_cnn_within_half_a_percent(tmp_path):
    """A workload whose every layer carries the loss's progress: the rule writes (nearly) everything, never more."""
    r = policy.run(WORKLOADS["cnn"], layerckpt.Config(), str(tmp_path))
    assert r["bytes"] <= r["full_bytes"]
    assert all(abs(c["deviation"]) <= policy.LOSS_TARGET for c in r["crashes"]), r["crashes"]


def test_threshold_zero_writes_everything_and_restores_bit_exactly(tmp_path):
    r = policy.run(WORKLOADS["cnn"], layerckpt.Config(threshold=0.0), str(tmp_path), crashes=(0.5,))
    assert r["ratio"] == 1.0
    assert r["crashes"][0]["deviation"] == 0.0 and r["crashes"][0]["behind"] == 0


def _finetune_with_drift_threshold(root, steps=60):
    """The issue's failure: a relative-drift threshold on a small-LR fine-tune, where no layer ever crosses it."""
    w = WORKLOADS["finetune-3e-5"]
    torch.manual_seed(0)
    model, opt = w.make()
    cfg = layerckpt.Config(threshold=0.05, max_staleness=50, keep_last=0)
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        for step in range(steps):
            loss = w.train_step(model, opt, step)
            if (step + 1) % w.every == 0:
                ck.save(step + 1, loss=loss)
    return w


def test_a_composite_that_rolls_training_back_is_refused_or_reported(tmp_path, caplog):
    w = _finetune_with_drift_threshold(str(tmp_path))
    m = load_manifest(str(tmp_path / "manifests" / "step-00000060.json"))
    assert {e.step for e in m.layers.values()} == {5}  # every layer from the first save, 55 steps back
    assert m.loss_increase > 0.01
    model, opt = w.make()
    with pytest.raises(layerckpt.StalenessError, match=r"estimated to raise the training loss by [0-9.]+% "
                                                       r"\(more than 1%\): its layers trail it by up to 55 steps"):
        layerckpt.restore(tmp_path, model, opt)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        rep = layerckpt.restore(tmp_path, model, opt, strict=False)
    assert "estimated to raise the training loss" in caplog.text
    assert rep.staleness_steps["head"] == 55 and rep.loss_increase == pytest.approx(m.loss_increase)
    out = subprocess.run([sys.executable, "-m", "layerckpt.cli", "inspect", str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "layers trail step 60 by up to 55 steps; estimated fidelity cost" in out and "of the training loss" in out


def test_the_default_rule_on_the_same_run_stays_current(tmp_path):
    w = WORKLOADS["finetune-3e-5"]
    torch.manual_seed(0)
    model, opt = w.make()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(keep_last=0)) as ck:
        for step in range(60):
            loss = w.train_step(model, opt, step)
            if (step + 1) % w.every == 0:
                ck.save(step + 1, loss=loss)
    m = load_manifest(str(tmp_path / "manifests" / "step-00000060.json"))
    assert m.loss_increase <= layerckpt.Config().fidelity
    rep = layerckpt.restore(tmp_path, *w.make())  # strict: no rollback to refuse
    assert max(rep.staleness_steps.values()) <= 5 * layerckpt.Config().max_staleness


def test_staleness_bound_writes_a_layer_the_budget_would_skip(tmp_path):
    w = WORKLOADS["finetune-1e-5"]
    torch.manual_seed(0)
    model, opt = w.make()
    cfg = layerckpt.Config(fidelity=10.0, max_staleness=3, keep_last=0)  # a budget that skips everything
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in range(1, 6):
            w.train_step(model, opt, step)
            ck.save(step, loss=1.0)
    reasons = [load_manifest(str(tmp_path / "manifests" / f"step-{s:08d}.json")).layers["blocks.0"].reason
               for s in range(1, 6)]
    assert reasons == ["first", "within-budget", "within-budget", "within-budget", "stale"]


@pytest.mark.parametrize("bad", ["1.0", float("nan"), torch.ones(2), True])
def test_a_bad_loss_is_refused_naming_it(tmp_path, bad):
    model = torch.nn.Linear(2, 2)
    with layerckpt.Checkpointer(tmp_path, model) as ck:
        with pytest.raises(layerckpt.CheckpointError, match="loss must be a"):
            ck.save(1, loss=bad)
        ck.save(1, loss=torch.tensor(2.5))
    assert load_manifest(str(tmp_path / "manifests" / "step-00000001.json")).loss == 2.5
