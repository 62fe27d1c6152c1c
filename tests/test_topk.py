"""LayerCheckpoint with ModelCheckpoint's arguments: monitor, top-k by score, names, save_last, weights only."""
import os

import pytest
import torch

import lightning  # noqa: F401
from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402

import layerckpt  # noqa: E402
from layerckpt.format import _store as store  # noqa: E402
from layerckpt.format._manifest import load_manifest  # noqa: E402
from lightning_layerckpt import LayerCheckpoint, load_from_checkpoint  # noqa: E402
from layerckpt.bench.lightning_workload import FineTuneModule  # noqa: E402
from conftest import assert_same_tensors  # noqa: E402
from lit_helpers import TINY, trainer  # noqa: E402

#: the monitored score logged at each training step: saves every 2 steps see steps 1, 3, 5, ...
SCORES = [9.0, 5.0, 7.0, 2.0, 8.0, 6.0, 3.0, 1.0, 4.0, 7.5, 0.5, 9.5, 3.5, 1.5, 8.5, 4.5]


class Scored(FineTuneModule):
    """Logs a score that depends only on the step, so which composites are the top k is known."""

    def training_step(self, b, i):
        loss = super().training_step(b, i)
        self.log("score", SCORES[self.global_step])
        return loss


class ScoredVal(Scored):
    def validation_step(self, b, i):
        return super().training_step(b, i)

    def val_dataloader(self):
        return self.train_dataloader()


def scored(**kw) -> Scored:
    return Scored(**{**TINY, **kw})


def manifest(d, step):
    return os.path.join(d, "manifests", store.manifest_name(step))


def committed(d):
    return [s for s, _ in store.list_manifests(d)]


def test_top_k_by_score_keeps_the_best_composites_and_their_data(tmp_path):
    torch.manual_seed(7)
    d = str(tmp_path / "run")
    cb = LayerCheckpoint(dirpath=d, monitor="score", save_top_k=2, mode="min", every_n_train_steps=2,
                         filename="{step}-{score:.1f}", verbose=True)
    t = trainer(12, [cb], str(tmp_path), limit_val_batches=2)
    t.fit(scored())
    # saves at steps 2..12 see scores 5, 2, 6, 1, 7.5, 9.5: the best two are steps 8 (1.0) and 4 (2.0)
    assert cb.best_k_models.keys() == {manifest(d, 8), manifest(d, 4)}
    assert cb.best_model_path == manifest(d, 8) and float(cb.best_model_score) == 1.0
    assert cb.kth_best_model_path == manifest(d, 4) and float(cb.kth_value) == 2.0
    assert cb.last_model_path == manifest(d, 12)
    # steps 10 and 12 did not enter the top 2 and were not saved; 12 is the save fit always ends with
    assert committed(d) == [4, 8, 12]
    assert load_manifest(manifest(d, 8)).name == "step=8-score=1.0"
    assert load_manifest(manifest(d, 4)).name == "step=4-score=2.0"
    assert load_manifest(manifest(d, 12)).name == "last"
    for step in (4, 8, 12):  # every kept composite whole: every file it references is there and checks
        layerckpt.read_checkpoint(d, step=step)
    # best_model_path is what ckpt_path="best" and load_from_checkpoint take
    best = load_from_checkpoint(Scored, cb.best_model_path)
    assert_same_tensors(best.state_dict(), layerckpt.read_checkpoint(cb.best_model_path).model)
    t.validate(ScoredVal(**TINY), ckpt_path="best", verbose=False)
    assert cb.best_model_path == manifest(d, 8) and cb.best_k_models.keys() == {manifest(d, 8), manifest(d, 4)}


def test_top_k_survives_a_resume(tmp_path):
    torch.manual_seed(7)
    d = str(tmp_path / "run")
    kw = dict(dirpath=d, monitor="score", save_top_k=2, mode="min", every_n_train_steps=2, save_last=True)
    cb = LayerCheckpoint(**kw)
    trainer(8, [cb], str(tmp_path)).fit(scored())
    assert cb.best_k_models.keys() == {manifest(d, 8), manifest(d, 4)}
    assert committed(d) == [4, 8]  # save_last saved 2 and 6 too; each was dropped once no longer the newest

    cb2 = LayerCheckpoint(**kw)
    t2 = trainer(16, [cb2], str(tmp_path))
    t2.fit(scored(seed=3), ckpt_path="last")
    assert cb2.restored["step"] == 8
    # after the resume steps 10..16 score 7.5, 9.5, 1.5, 4.5: step 14 enters the top 2 and step 4 leaves it
    seen = {s: SCORES[s - 1] for s in (4, 8, 10, 12, 14, 16)}
    best2 = sorted(seen, key=seen.get)[:2]
    assert cb2.best_k_models.keys() == {manifest(d, s) for s in best2}
    assert cb2.best_model_path == manifest(d, best2[0])
    assert best2 == [8, 14]
    assert committed(d) == [8, 14, 16]


def test_save_weights_only_and_without_monitor(tmp_path):
    torch.manual_seed(7)
    d = str(tmp_path / "w")
    cb = LayerCheckpoint(dirpath=d, every_n_train_steps=4, save_weights_only=True, save_top_k=-1)
    trainer(12, [cb], str(tmp_path)).fit(scored())
    assert committed(d) == [4, 8, 12]  # save_top_k=-1 without monitor keeps them all
    loaded = layerckpt.read_checkpoint(d)
    assert loaded.optimizer is None and not any(k.startswith("optim") for k in load_manifest(manifest(d, 12)).tensors)
    assert cb.best_model_path == cb.last_model_path == manifest(d, 12)


def test_modelcheckpoint_argument_errors_are_modelcheckpoints():
    with pytest.raises(MisconfigurationException, match="No quantity for top_k"):
        LayerCheckpoint(save_top_k=3)
    with pytest.raises(MisconfigurationException, match="`mode` can be"):
        LayerCheckpoint(monitor="x", mode="median")
    with pytest.raises(MisconfigurationException, match="save_top_k"):
        LayerCheckpoint(monitor="x", save_top_k=-2)
