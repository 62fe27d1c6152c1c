"""Readers racing retention, made to happen: a reader holds a composite's manifest while a writer in another
process commits the next composite with ``keep_last=1`` and its retention deletes the one being read.  A
restore without a step retries once on the newest (counted, bit for bit); a race lost twice, or a step asked
for, is a CheckpointGoneError saying so, never damage."""
import os
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt import _faults
from layerckpt.errors import CheckpointGoneError

sys.path.insert(0, os.path.dirname(__file__))
from test_hostile import expected, fill, tiny  # noqa: E402

WRITER = """
import sys, torch, layerckpt
sys.path.insert(0, {tests!r})
from test_hostile import fill, tiny
model = tiny()
with layerckpt.Checkpointer({root!r}, model, config=layerckpt.Config(full=True, keep_last=1)) as ck:
    for line in sys.stdin:
        step = int(line)
        fill(model, step)
        ck.save(step).wait()  # committed, and the composite before it deleted by retention
        print(step, flush=True)
"""


class Writer:
    """A process that saves the step it is sent and answers once that save committed and retention ran."""

    def __init__(self, root: str):
        code = WRITER.format(tests=os.path.dirname(__file__), root=root)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        self.step = 0

    def save_next(self) -> int:
        self.step += 1
        self.p.stdin.write(f"{self.step}\n")
        self.p.stdin.flush()
        got = self.p.stdout.readline()
        assert got.strip() == str(self.step), f"the writer answered {got!r} (exit {self.p.poll()})"
        return self.step

    def close(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(60) == 0


@pytest.fixture
def race(tmp_path):
    """(root, writer, counts): every time a reader has picked a composite and holds its manifest, the hook
    counted in ``counts["held"]`` lets the writer commit the next step (deleting the held one) while
    ``counts["race"]`` > 0, one race each."""
    root = str(tmp_path / "race")
    w = Writer(root)
    counts = {"held": 0, "race": 0, "raced": 0}

    def held():
        counts["held"] += 1
        if counts["race"] > 0:
            counts["race"] -= 1
            counts["raced"] += 1
            w.save_next()

    _faults.install("read.manifest-loaded", held)
    try:
        w.save_next()
        yield root, w, counts
    finally:
        _faults.remove("read.manifest-loaded")
        w.close()


def _same(model, step):
    want = expected(step)
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_a_restore_that_loses_the_race_once_retries_on_the_newest(race):
    root, w, counts = race
    model = tiny(1)
    for round_ in range(3):
        counts["race"] = 1  # retention deletes the composite this restore picked
        before = counts["held"]
        rep = layerckpt.restore(root, model)
        assert counts["held"] - before == 2 and counts["raced"] == round_ + 1  # picked, lost, picked again
        assert rep.step == w.step and _same(model, w.step)
    loaded = layerckpt.read_checkpoint(root)  # no race: one pick
    assert loaded.step == w.step


def test_a_race_lost_twice_is_gone_not_damage(race):
    root, w, counts = race
    counts["race"] = 2
    model = tiny(1)
    with pytest.raises(CheckpointGoneError, match="deleted by retention, restore the newest") as e:
        layerckpt.restore(root, model)
    assert counts["raced"] == 2 and counts["held"] == 2
    assert str(w.step - 1) in str(e.value) or f"{w.step - 1:08d}" in str(e.value)
    rep = layerckpt.restore(root, model)  # the newest, once the race is over
    assert rep.step == w.step and _same(model, w.step)


def test_a_step_asked_for_is_never_substituted(race):
    root, w, counts = race
    asked = w.step
    counts["race"] = 1
    with pytest.raises(CheckpointGoneError):
        layerckpt.read_checkpoint(root, asked)
    assert counts["held"] == 1 and counts["raced"] == 1
    assert not os.path.exists(os.path.join(root, "manifests", f"step-{asked:08d}.json"))
