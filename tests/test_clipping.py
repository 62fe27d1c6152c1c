"""The Lightning and accelerate adapters at layerckpt's defaults under gradient clipping by norm: a pre-trained
GPT fine-tuned on another task with its gradients clipped to a quarter of their norm, checkpointed every few
steps, stopped between two checkpoints and resumed, against the run that never stopped.

The selection prices a stale layer with the optimizer's gradient averages, which under clipping are averages of
clipped gradients, short of the loss's own by the clipping's factor (here about a fifth): scaled by the loss
alone, the allowance let a restore give up several times what ``Config.fidelity`` promises (0.7% of the loss
against the uninterrupted run for each adapter, where fidelity is 0.4%).  Both adapters now hand the selection
the interval's mean training loss times the share of the squared gradient norms clipping kept
(``layerckpt.adapters.SelectionLoss``), as the transformers adapter does (test_transformers_defaults.py).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch.nn import functional as F

from layerckpt import store
from layerckpt.adapters import SelectionLoss
from layerckpt.bench.workload import batch, make_model, make_optimizer
from layerckpt.bench.workload import run as run_steps

STEPS, EVERY, STOP = 30, 5, 23  # the resume starts from the save after step 20
CLIP = 0.25  # the gradients' norms are 1.2 to 2.5 here: clipping keeps a fifth of their squared norm
SHAPE = dict(n_layer=3, n_embd=96)
LR = 3e-4


def held_out(net: torch.nn.Module) -> float:
    with torch.no_grad():
        batches = [batch("affine", 10**6 + i, 64) for i in range(4)]
        return sum(F.cross_entropy(net(x).flatten(0, 1), y.flatten()).item() for x, y in batches) / len(batches)


def within_half_a_percent(got: float, want: float) -> None:
    assert abs(got - want) <= 0.005 * want, f"resumed {got:.5f}, uninterrupted {want:.5f}: {100 * (got / want - 1):+.3f}%"


def kept_share(norms) -> float:
    return sum(min(n, CLIP) * n for n in norms) / sum(n * n for n in norms)


# ------------------------------------------------------------------ SelectionLoss


def test_selection_loss_is_the_intervals_mean_in_the_clipped_unit():
    s = SelectionLoss()
    assert s.take() is None  # nothing yet
    for loss, norm in ((2.0, 4.0), (4.0, 1.0)):
        s.add(torch.tensor(loss / 2))  # two micro-batches, each divided for accumulation
        s.add(torch.tensor(loss / 2))
        s.clipped(torch.tensor(float("inf")), 2.0)  # an earlier call of the step does not count
        s.clipped(torch.tensor(norm), 2.0)
        s.step_done()
    assert s.take().item() == pytest.approx(3.0 * (2 * 4 + 1) / (16 + 1))
    assert s.take().item() == pytest.approx(3.0 * 9 / 17)  # no step since: the last one's
    s.add(1.0)
    s.clipped(float("nan"), 1.0)  # an overflowed step's norm counts for nothing
    s.step_done()
    s.add(3.0)
    s.clipped(torch.tensor(float("inf")), 1.0)
    s.step_done()
    s.add(torch.ones(2))  # not a loss: ignored
    s.step_done()
    assert s.take().item() == pytest.approx(2.0)  # no norm seen: the mean alone
    s.add(2.0)
    s.clipped(3.0, float("inf"))  # measured, not clipped
    s.step_done()
    assert s.take().item() == pytest.approx(2.0)


# ------------------------------------------------------------------ Lightning

import lightning.pytorch as L

from layerckpt.bench.lightning_workload import FineTuneModule  # noqa: E402
from lightning_layerckpt import LayerCheckpoint  # noqa: E402


class Crash(Exception):
    pass


class CrashAt(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, b, i):
        if trainer.global_step == STOP:
            raise Crash(f"stopped at step {STOP}")


class Norms(L.Callback):
    """Each optimizer step's gradient norm before clipping (Lightning clips after this hook)."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]).item())


def lit_module() -> FineTuneModule:
    return FineTuneModule(**SHAPE, lr=LR, task="affine", batch_size=16).pretrain()


def lit_trainer(root, callbacks, steps: int = STEPS, clip=CLIP, **kw):
    return L.Trainer(max_steps=steps, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                     logger=False, callbacks=callbacks, default_root_dir=str(root), num_sanity_val_steps=0,
                     gradient_clip_val=clip, gradient_clip_algorithm="norm" if clip else None, **kw)


@pytest.fixture(scope="module")
def lit_uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    m = lit_module()
    lit_trainer(tmp_path_factory.mktemp("plain"), [], enable_checkpointing=False).fit(m)
    return held_out(m.net)


def test_lightning_clipped_run_resumes_within_half_a_percent_at_the_defaults(tmp_path, lit_uninterrupted):
    torch.set_num_threads(1)
    d = str(tmp_path / "run")
    first, norms = lit_module(), Norms()
    with pytest.raises(Crash):
        lit_trainer(tmp_path, [LayerCheckpoint(dirpath=d, every_n_train_steps=EVERY), CrashAt(), norms]).fit(first)
    manifest = json.load(open(store.resolve(d)))
    assert manifest["step"] == 20
    second = lit_module()
    cb = LayerCheckpoint(dirpath=d, every_n_train_steps=EVERY)
    lit_trainer(tmp_path, [cb]).fit(second, ckpt_path="last")
    assert cb.restored["step"] == 20
    within_half_a_percent(held_out(second.net), lit_uninterrupted)
    # the composite it resumed from left layers stale: the selection did choose
    assert any(step < 20 for step in cb.restored["layers"].values()), cb.restored["layers"]
    # the loss handed over: steps 16..20's mean, times the share of their squared norms clipping kept
    share = kept_share(norms.norms[15:20])
    assert share < 0.5  # clipping was at work
    mean = sum(first.losses[15:20]) / 5
    assert math.isclose(manifest["loss"], mean * share, rel_tol=1e-3), (manifest["loss"], mean, share)


def test_lightning_loss_without_clipping_is_the_intervals_mean_of_whole_steps(tmp_path, monkeypatch):
    """No clipping configured: no norm measured, the loss is the mean over the steps since the last save;
    with accumulate_grad_batches, each step's loss is its micro-batches' mean (Lightning divides each)."""
    torch.set_num_threads(1)

    def measured(*_):
        raise AssertionError("a gradient norm measured without clipping")

    monkeypatch.setattr("lightning_layerckpt.callback._grad_norm", measured)
    m = FineTuneModule(n_layer=1, n_embd=32, task="affine", batch_size=4)
    d = str(tmp_path / "run")
    lit_trainer(tmp_path, [LayerCheckpoint(dirpath=d, every_n_train_steps=3)], steps=6, clip=None,
                accumulate_grad_batches=2).fit(m)
    assert len(m.losses) == 12
    manifest = json.load(open(store.resolve(d, 6)))
    assert math.isclose(manifest["loss"], sum(m.losses[6:12]) / 6, rel_tol=1e-5), (manifest["loss"], m.losses)


# ------------------------------------------------------------------ accelerate

import accelerate

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from accelerate_layerckpt import LayerCheckpointPlugin  # noqa: E402

_PRETRAINED = {}


def acc_net() -> torch.nn.Module:
    """The GPT pre-trained on the `count` task (as FineTuneModule.pretrain does), to fine-tune on `affine`."""
    if not _PRETRAINED:
        net = make_model(0, **SHAPE)
        rng = torch.get_rng_state()
        run_steps(net, make_optimizer(net), "count", 0, 60)
        torch.set_rng_state(rng)
        _PRETRAINED.update({k: v.clone() for k, v in net.state_dict().items()})
    net = make_model(0, **SHAPE)
    net.load_state_dict(_PRETRAINED)
    return net


def acc_job(project, plugin: bool, *, stop=None, resume: bool = False, ga: int = 1):
    """A plain accelerate loop: clip_grad_norm_ on the synced step, save_state every EVERY steps."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ga, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True))
    net = acc_net()
    model, opt = acc.prepare(net, make_optimizer(net, lr=LR))
    p = LayerCheckpointPlugin().register(acc) if plugin else None
    start, losses, norms = 0, [], []
    if resume:
        acc.load_state()
        start = (p.last_restore[0].step + 1) * EVERY  # the i-th save_state is step i, after (i + 1) * EVERY steps
    for s in range(start, STEPS if stop is None else stop):
        for k in range(ga):
            x, y = batch("affine", s * ga + k, 16 // ga)
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), CLIP).item())
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if p is not None and (s + 1) % EVERY == 0:
            acc.save_state()
    if p is not None:
        p.close()
    return acc.unwrap_model(model), p, losses, norms


@pytest.fixture(scope="module")
def acc_uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    net, _, _, _ = acc_job(tmp_path_factory.mktemp("plain"), False)
    return held_out(net)


def test_accelerate_clipped_run_resumes_within_half_a_percent_at_the_defaults(tmp_path, acc_uninterrupted):
    torch.set_num_threads(1)
    _, _, losses, norms = acc_job(tmp_path, True, stop=STOP)
    root = str(tmp_path / "layerckpt" / "model_0")
    manifest = json.load(open(store.resolve(root)))
    assert manifest["step"] == 3  # the 4th save_state, after step 20
    net, p, _, _ = acc_job(tmp_path, True, resume=True)
    assert p.last_restore[0].step == 3
    within_half_a_percent(held_out(net), acc_uninterrupted)
    assert any(step < 3 for step in p.last_restore[0].layers.values()), p.last_restore[0].layers
    share = kept_share(norms[15:20])
    assert share < 0.5
    mean = sum(losses[15:20]) / 5
    assert math.isclose(manifest["loss"], mean * share, rel_tol=1e-3), (manifest["loss"], mean, share)


def test_accelerate_loss_with_accumulation_is_the_steps_mean(tmp_path):
    """With gradient accumulation each optimizer step's loss is its micro-batches' mean, and clipping is seen
    once per step (on the synced backward)."""
    torch.set_num_threads(1)
    _, _, losses, norms = acc_job(tmp_path, True, stop=EVERY, ga=2)
    manifest = json.load(open(store.resolve(str(tmp_path / "layerckpt" / "model_0"), 0)))
    assert len(losses) == 10 and len(norms) == 5
    assert math.isclose(manifest["loss"], sum(losses) / 10 * kept_share(norms), rel_tol=1e-3), manifest["loss"]
