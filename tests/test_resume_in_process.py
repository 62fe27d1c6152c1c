"""Resume in the same process through each adapter: a new Trainer / Fabric handle / Accelerator on the store an
older one wrote (and may still hold) restores bit for bit what was saved, with the older objects still
referenced or dropped; the older one's later saves are refused with a clear error, or are harmless where the
framework tore it down.  One takeover happens while the older handle has a save in flight."""
import copy
import gc
import os
import threading

import pytest
import torch

import lightning  # noqa: F401
import lightning.pytorch as L  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import layerckpt  # noqa: E402
from conftest import assert_same_optimizer_state, assert_same_tensors, small_model  # noqa: E402
from layerckpt import _faults  # noqa: E402
from lightning_layerckpt import LayerCheckpoint, LayerCheckpointIO, LayerFabricCheckpoint  # noqa: E402
from lit_helpers import CrashAt, Crash, Tiny, trainer  # noqa: E402
from test_fabric import setup, snapshot, train_step  # noqa: E402

KEEP = pytest.mark.parametrize("drop", [False, True], ids=["first-referenced", "first-dropped"])


class _AtStart(L.Callback):
    """The state a resumed fit starts from (after the restore, before its first step)."""

    def on_train_start(self, trainer, pl_module):
        self.model = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.global_step = trainer.global_step


def _assert_resumed_from(start: _AtStart, model: dict, optimizer: dict, step: int) -> None:
    assert start.global_step == step
    assert_same_tensors(start.model, model)
    assert_same_optimizer_state(start.optimizer, optimizer)


# ------------------------------------------------------------------ Lightning: LayerCheckpoint

@KEEP
def test_lightning_callback_resumes_after_a_crash_in_this_process(tmp_path, drop):
    d = str(tmp_path / "ck")
    first_cb = LayerCheckpoint(dirpath=d, every_n_train_steps=2, threshold=0.0)
    first = trainer(20, [first_cb, CrashAt(5)], str(tmp_path))
    with pytest.raises(Crash):
        first.fit(Tiny(seed=0))
    saved = layerckpt.read_checkpoint(d)  # step 4: the newest save before the crash
    assert saved.step == 4
    if drop:
        del first, first_cb
        gc.collect()
    start = _AtStart()
    cb = LayerCheckpoint(dirpath=d, every_n_train_steps=2, threshold=0.0)
    second = trainer(8, [cb, start], str(tmp_path))
    second.fit(Tiny(seed=3), ckpt_path="last")
    _assert_resumed_from(start, {**saved.model_other, **saved.model}, saved.optimizer, 4)
    assert cb.restored["step"] == 4 and layerckpt.read_checkpoint(d).step == 8
    if not drop:  # torn down by its Trainer: harmless
        first_cb.wait()
        assert first_cb._ckpt is None


def test_lightning_checkpoint_io_resumes_in_this_process(tmp_path):
    d = str(tmp_path / "ckpts")
    first = trainer(4, [ModelCheckpoint(dirpath=d, save_last=True, every_n_train_steps=2)], str(tmp_path),
                    plugins=[LayerCheckpointIO()])
    first.fit(Tiny(seed=0))
    saved = torch.load(os.path.join(d, "last.ckpt"), weights_only=True)
    start = _AtStart()
    second = trainer(6, [ModelCheckpoint(dirpath=d, save_last=True, every_n_train_steps=2), start], str(tmp_path),
                     plugins=[LayerCheckpointIO()])
    second.fit(Tiny(seed=3), ckpt_path="last")
    _assert_resumed_from(start, saved["state_dict"], saved["optimizer_states"][0], 4)
    first.strategy.checkpoint_io.save_checkpoint(saved, str(tmp_path / "again.ckpt"))  # torn down: harmless
    assert torch.load(str(tmp_path / "again.ckpt"), weights_only=True)["global_step"] == 4


# ------------------------------------------------------------------ Fabric

def _fabric_saves(root, seed, steps):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = setup(fabric, seed)
    handle = LayerFabricCheckpoint(fabric, threshold=0.0)
    for step in steps:
        train_step(fabric, model, opt, step)
        fabric.save(root, {"model": model, "optimizer": opt, "step": step})
    return fabric, model, opt, handle


@KEEP
def test_fabric_handle_takes_over_from_an_older_one_of_this_process(tmp_path, drop):
    root = str(tmp_path / "store")
    first, m1, o1, old = _fabric_saves(root, 0, [1, 2])
    want_model, want_opt = snapshot(m1, o1.optimizer)
    if drop:
        old.wait()
        del first, m1, o1, old
        gc.collect()
    fabric, model, opt, new = _fabric_saves(root, 5, [])
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(root, state)
    assert state["step"] == 2
    assert_same_tensors(model.state_dict(), want_model)
    assert_same_optimizer_state(opt.optimizer.state_dict(), want_opt)
    train_step(fabric, model, opt, 3)
    fabric.save(root, {"model": model, "optimizer": opt, "step": 3})  # takes the store over
    new.close()
    assert layerckpt.read_checkpoint(root).step == 3
    if not drop:
        with pytest.raises(layerckpt.CheckpointError, match="a newer LayerFabricCheckpoint of this process took over"):
            first.save(root, {"model": m1, "optimizer": o1, "step": 4})
        old.close()  # its saves had ended: nothing to report
    assert sorted(os.listdir(os.path.join(root, "manifests")))[-1] == "step-00000003.json"


def test_fabric_takeover_while_the_older_handle_has_a_save_in_flight(tmp_path):
    root = str(tmp_path / "store")
    go, held, begun = threading.Event(), threading.Event(), threading.Event()

    def hold():  # the first handle's save is durable on disk, its manifest not written yet
        if not held.is_set():
            held.set()
            assert go.wait(60)

    _faults.install("flush.written", hold)
    _faults.install("takeover.begun", begun.set)
    try:
        first, m1, o1, old = _fabric_saves(root, 0, [1])
        want = snapshot(m1, o1.optimizer)
        assert held.wait(60) and os.listdir(os.path.join(root, "manifests")) == []
        fabric, model, opt, new = _fabric_saves(root, 5, [])
        done = []
        saver = threading.Thread(target=lambda: done.append(
            fabric.save(root, {"model": model, "optimizer": opt, "step": 2})))
        saver.start()
        assert begun.wait(60)  # the takeover began ...
        saver.join(0.2)
        assert saver.is_alive() and not done  # ... and waits for the save in flight
        go.set()
        saver.join(60)
        assert done == [None]
    finally:
        _faults.remove("flush.written")
        _faults.remove("takeover.begun")
        go.set()
    assert old.last_save.done() and old.last_save.error is None  # nothing in flight was lost
    new.close()
    assert sorted(os.listdir(os.path.join(root, "manifests"))) == ["step-00000001.json", "step-00000002.json"]
    restored_model = small_model(9)
    restored_opt = torch.optim.AdamW(restored_model.parameters(), lr=1e-2)
    layerckpt.restore(root, restored_model, restored_opt, step=1)
    assert_same_tensors(restored_model.state_dict(), want[0])
    assert_same_optimizer_state(restored_opt.state_dict(), want[1])
    with pytest.raises(layerckpt.CheckpointError, match="took over the store"):
        first.save(root, {"model": m1, "optimizer": o1, "step": 3})


# ------------------------------------------------------------------ Accelerate

@KEEP
def test_accelerate_plugin_resumes_with_a_new_accelerator_in_this_process(tmp_path, drop):
    import accelerate  # noqa: F401
    from accelerate_helpers import Run

    first = Run(tmp_path, config=layerckpt.Config(threshold=0.0))
    first.train(3)
    first.acc.save_state()
    first.train(2)
    folder = first.acc.save_state()
    want = first.snapshot()  # flushes still in flight: load_state reads its writes
    if drop:
        del first
        gc.collect()
    second = Run(tmp_path, seed=4, config=layerckpt.Config(threshold=0.0))
    second.acc.load_state()
    assert second.progress.step == 5
    got = second.snapshot()
    assert_same_tensors(got["model"], want["model"])
    assert_same_optimizer_state(got["optim"], want["optim"])
    second.train(1)
    second.acc.save_state()  # takes the store over
    second.plugin.wait()
    if not drop:
        first.acc.project_configuration.iteration = 10  # not a folder of the second one
        with pytest.raises(layerckpt.CheckpointError, match="a newer LayerCheckpointPlugin of this process"):
            first.acc.save_state()
        first.acc.end_training()  # harmless
    second.acc.end_training()
    assert os.path.isdir(folder)
