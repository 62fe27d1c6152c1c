"""transformers_layerckpt.attach at its defaults, as a new user runs it: a pretrained text classifier fine-tuned by
Trainer (its linear decay, its gradient clipping at max_grad_norm=1.0), stopped part-way, resumed by a new Trainer.

The selection prices a stale layer with the optimizer's gradient averages, which under Trainer's clipping are
averages of clipped gradients, short of the loss's own by the clipping's factor (here a half): scaled by the loss
alone, the allowance let a restore give up about twice what ``Config.fidelity`` promises (1.0% of the loss where
0.4% is promised).  The adapter hands the selection the interval's mean loss in the clipped gradients' unit.
"""
from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch

import transformers

from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import transformers_layerckpt  # noqa: E402
from layerckpt import store  # noqa: E402
from test_transformers import assert_ends_as_uninterrupted, in_a_fresh_process  # noqa: E402

STEPS, EVERY, STOP = 40, 5, 33  # the resume starts from checkpoint-30


def data(n: int, seed: int):
    """Token sequences labelled by whether more of their first half is in the upper half of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, 16), generator=g)
    labels = ((ids[:, :8] > 50).sum(1) > 4).long()
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": y} for r, y in zip(ids, labels)]


TRAIN, HELD_OUT = data(256, 101), data(64, 1)


def fresh() -> GPT2ForSequenceClassification:
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(GPT2Config(vocab_size=100, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                                    num_labels=2, pad_token_id=0))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The weights a fine-tune starts from: a short run of plain Trainer on other data."""
    model = fresh()
    args = TrainingArguments(str(tmp_path_factory.mktemp("pre")), max_steps=30, per_device_train_batch_size=8,
                             learning_rate=1e-3, report_to=[], use_cpu=True, seed=1, save_strategy="no",
                             disable_tqdm=True, logging_steps=1000)
    Trainer(model=model, args=args, train_dataset=data(256, 7)).train()
    return {k: v.clone() for k, v in model.state_dict().items()}


class Stop(TrainerCallback):
    """Stops the run part-way, between two checkpoints."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STOP:
            control.should_training_stop = True


class Logged(TrainerCallback):
    """Each step's training loss and gradient norm (before clipping), as Trainer logs them."""

    def __init__(self):
        self.logs = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs[state.global_step] = logs


def fine_tune(out, pretrained, *, attach=None, callbacks=(), ga=1):
    model = fresh()
    model.load_state_dict(pretrained)
    args = TrainingArguments(str(out), max_steps=STEPS, save_steps=EVERY, per_device_train_batch_size=8 // ga,
                             gradient_accumulation_steps=ga, learning_rate=1e-3, report_to=[], use_cpu=True, seed=0,
                             logging_steps=1, disable_tqdm=True)  # Trainer's defaults otherwise
    trainer = Trainer(model=model, args=args, train_dataset=TRAIN, callbacks=list(callbacks))
    if attach is not None:
        trainer.layerckpt = transformers_layerckpt.attach(trainer, **attach)
    return trainer


def held_out_loss(model) -> float:
    model.eval()
    batch = {k: torch.stack([d[k] for d in HELD_OUT]) for k in HELD_OUT[0]}
    with torch.no_grad():
        return model(**batch).loss.item()


def stopped_and_resumed(out, pretrained, attach, ga=1, callbacks=()):
    first = fine_tune(out, pretrained, attach=attach, callbacks=[Stop(), *callbacks], ga=ga)
    first.train()
    assert first.state.global_step == STOP
    second = fine_tune(out, pretrained, attach=attach, ga=ga)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == STEPS and second.layerckpt.last_restore.step == 30
    return first, second


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, pretrained):
    """The uninterrupted run of plain Trainer, computed in a fresh process (as test_transformers.py's ``plain``,
    whose docstring says why)."""
    out = tmp_path_factory.mktemp("plain")
    torch.save(pretrained, out / "pretrained.pt")
    model = fresh()
    model.load_state_dict(in_a_fresh_process(f"""
        import test_transformers_defaults as td
        trainer = td.fine_tune({str(out)!r}, torch.load({str(out / "pretrained.pt")!r}, weights_only=True))
        trainer.train()
        model = trainer.model
    """, out))
    return types.SimpleNamespace(model=model)


def test_defaults_resume_within_half_a_percent_of_the_uninterrupted_run(tmp_path, pretrained, uninterrupted):
    logged = Logged()
    first, second = stopped_and_resumed(tmp_path, pretrained, {}, callbacks=[logged])
    want, got = held_out_loss(uninterrupted.model), held_out_loss(second.model)
    assert abs(got - want) <= 0.005 * want, f"resumed {got:.5f}, uninterrupted {want:.5f}: {100 * (got / want - 1):.3f}%"
    # the composite it resumed from left layers stale: the selection did choose
    manifest = json.load(open(store.resolve(str(tmp_path / "layerckpt"), 30)))
    assert any(e["step"] < 30 for e in manifest["layers"].values())
    # the loss its selection was scaled by: the mean training loss of steps 26..30, times the share of their
    # squared gradient norms that Trainer's clipping at max_grad_norm=1.0 kept
    logs = [logged.logs[s] for s in range(26, 31)]
    mean = sum(d["loss"] for d in logs) / len(logs)
    kept = sum(min(d["grad_norm"], 1.0) * d["grad_norm"] for d in logs) / sum(d["grad_norm"] ** 2 for d in logs)
    assert kept < 0.9  # clipping was at work
    assert math.isclose(manifest["loss"], mean * kept, rel_tol=2e-3), (manifest["loss"], mean, kept)


def test_full_resumes_bit_for_bit(tmp_path, pretrained, uninterrupted):
    _, second = stopped_and_resumed(tmp_path, pretrained, {"full": True})
    assert_ends_as_uninterrupted(second.model, uninterrupted.model)


def test_without_clipping_the_loss_is_the_intervals_mean(tmp_path, pretrained):
    logged = Logged()
    t = fine_tune(tmp_path, pretrained, attach={}, callbacks=[logged])
    t.args.max_grad_norm = 0.0
    t.args.max_steps = 10
    t.train()
    manifest = json.load(open(store.resolve(str(tmp_path / "layerckpt"), 10)))
    mean = sum(logged.logs[s]["loss"] for s in range(6, 11)) / 5
    assert math.isclose(manifest["loss"], mean, rel_tol=2e-3), (manifest["loss"], mean)
