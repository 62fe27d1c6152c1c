"""No half a restore: a malformed RNG state, extra or non-tensor model state in a manifest is refused before the
first tensor moves into the model or the optimizer, by restore() and read_checkpoint() alike, and `verify`
reports it as damage (exit 1)."""
import copy
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import layerckpt
from layerckpt import Checkpointer, Config
from layerckpt.errors import CheckpointCorruptError

MANIFEST = os.path.join("manifests", "step-00000001.json")


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A committed checkpoint with RNG states and a tensor in the extra, and the model it was taken from."""
    d = str(tmp_path_factory.mktemp("genuine") / "ck")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ck = Checkpointer(d, model, opt, Config())
    ck.save(1, extra={"epoch": 3, "t": torch.arange(3)})
    ck.close()
    with open(os.path.join(d, MANIFEST)) as f:
        return d, json.load(f), model.state_dict()


def _damaged(genuine, tmp_path, change):
    d, doc, _ = genuine
    out = str(tmp_path / "damaged")
    shutil.copytree(d, out)
    doc = copy.deepcopy(doc)
    change(doc)
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(doc, f)
    return out


VARIANTS = {
    # what is changed -> the words the error must say
    "python": (lambda j: j["rng"].__setitem__("python", {"__tuple__": [3, [1, 2], None]}),
               "the python state of the saved RNG is malformed (ValueError"),
    "numpy": (lambda j: j["rng"].__setitem__("numpy", "garbage"), "the numpy state of the saved RNG is malformed"),
    "torch": (lambda j: j["rng"].__setitem__("torch", [1, 2, 3]),
                     "the torch state of the saved RNG is malformed"),
}


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_a_malformed_rng_state_is_refused_before_the_model_moves(genuine, tmp_path, kind):
    change, words = VARIANTS[kind]
    d = _damaged(genuine, tmp_path, change)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    with pytest.raises(CheckpointCorruptError) as e:
        layerckpt.restore(d, model, opt)
    assert words in str(e.value) and MANIFEST in str(e.value)
    assert "Config(restore_rng=False)" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert len(opt.state) == 0
    assert random.getstate() == rng_before[0] and np.array_equal(np.random.get_state()[1], rng_before[1])
    assert torch.equal(torch.get_rng_state(), rng_before[2])
    with pytest.raises(CheckpointCorruptError, match="saved RNG is malformed"):
        layerckpt.read_checkpoint(d)
    # the way out the message names: the same checkpoint restores without its RNG
    layerckpt.restore(d, model, opt, config=Config(restore_rng=False))
    assert all(torch.equal(genuine[2][k], v) for k, v in model.state_dict().items())


def test_the_genuine_rng_states_restore(genuine):
    d, _, saved = genuine
    model = torch.nn.Linear(4, 4)
    layerckpt.restore(d, model, torch.optim.AdamW(model.parameters()))
    a = (random.random(), np.random.rand(), torch.rand(1))
    loaded = layerckpt.read_checkpoint(d)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    loaded.restore_rng()
    assert (random.random(), np.random.rand(), torch.rand(1)) == a
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def _verify(d):
    return subprocess.run([sys.executable, "-m", "layerckpt.cli", "verify", d], capture_output=True, text=True,
                          timeout=120)


def test_verify_reports_what_restore_refuses(genuine, tmp_path):
    ok = _verify(genuine[0])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    d = _damaged(genuine, tmp_path, VARIANTS["python"][0])
    bad = _verify(d)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL step-00000001.json" in bad.stdout and VARIANTS["python"][1] in bad.stdout
    assert "Traceback" not in bad.stdout + bad.stderr


def test_a_malformed_optimizer_record_is_refused_by_restore_read_and_verify(genuine, tmp_path):
    d = _damaged(genuine, tmp_path, lambda j: j.__setitem__("optimizer", {}))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match="the optimizer state is malformed"):
        layerckpt.restore(d, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and len(opt.state) == 0
    with pytest.raises(CheckpointCorruptError, match="the optimizer state is malformed"):
        layerckpt.read_checkpoint(d)
    bad = _verify(d)
    assert bad.returncode == 1 and "the optimizer state is malformed" in bad.stdout, bad.stdout + bad.stderr


def test_a_deleted_tensor_entry_is_refused_not_read_as_a_smaller_model(genuine, tmp_path):
    d = _damaged(genuine, tmp_path, lambda j: j["tensors"].pop("model/weight"))
    words = "layer 'weight' lists tensor 'model/weight', which the manifest has no entry for"
    with pytest.raises(layerckpt.errors.CheckpointError, match="1 damaged manifest"):
        layerckpt.read_checkpoint(d)
    with pytest.raises(CheckpointCorruptError, match=words):
        layerckpt.read_checkpoint(os.path.join(d, MANIFEST))
    bad = _verify(d)
    assert bad.returncode == 1 and words in bad.stdout, bad.stdout + bad.stderr
