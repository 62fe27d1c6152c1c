"""An older entry does not pass as newer: a layer's entries (and their file) copied from an older composite into a
newer one, with the layer's record made to agree (its step, its age), restore the older bytes as the newer step's
unless the composite's story is checked.  Each variant is refused, naming the manifest, on a local store, a
``file://`` remote, a ``memory://`` remote and an S3 one (moto's server on loopback); the genuine store restores
bit for bit through each."""
import json
import os
import sys
import uuid

import fsspec
import pytest
import torch

import layerckpt
from layerckpt.errors import CheckpointCorruptError

sys.path.insert(0, os.path.dirname(__file__))
from test_hostile import expected, fill, tiny  # noqa: E402

STEP2 = "step-00000002.json"


def _save(root, cfg) -> None:
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=cfg) as ck:
        for step in (1, 2):
            fill(model, step)
            ck.save(step).wait()


def _rolled_back(old: dict, d: dict, age: int) -> str:
    """``d`` (step 2's manifest) with one layer's entries, file and record taken from ``old`` (step 1's), the
    record's age set to ``age``; returns the layer."""
    key = next(k for k in d["tensors"] if k.startswith("model/"))
    layer = next(n for n, e in d["layers"].items() if key in e["tensors"])
    for k in d["layers"][layer]["tensors"]:
        d["tensors"][k] = old["tensors"][k]
    d["files"].update(old["files"])
    d["layers"][layer] = dict(old["layers"][layer], age=age)
    return layer


#: (age given to the rolled-back record, what the refusal says)
VARIANTS = {"age 0": (0, "with an age of 0 checkpoint(s) in the composite of step 2"),
            "age 1": (1, "that no tensor entry accounts for")}


def _same(model, step: int) -> None:
    want = expected(step)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _edit(fs, path: str, age: int) -> str:
    old = json.loads(fs.cat_file(f"{path}/manifests/step-00000001.json"))
    d = json.loads(fs.cat_file(f"{path}/manifests/{STEP2}"))
    layer = _rolled_back(old, d, age)
    fs.pipe_file(f"{path}/manifests/{STEP2}", json.dumps(d).encode())
    return layer


def _check(target: str, cfg, fs, path: str, age: int, needle: str) -> None:
    model = tiny()
    layerckpt.restore(target, model, step=2, config=cfg)
    _same(model, 2)  # the genuine store, first
    _edit(fs, path, age)
    with pytest.raises(CheckpointCorruptError) as e:
        layerckpt.restore(target, tiny(), step=2, config=cfg)
    assert needle in str(e.value) and STEP2 in str(e.value), str(e.value)
    model = tiny()
    layerckpt.restore(target, model, step=1, config=cfg)  # the older composite is whole
    _same(model, 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_local(tmp_path, variant):
    age, needle = VARIANTS[variant]
    root = tmp_path / "ck"
    _save(root, layerckpt.Config(full=True, keep_last=0))
    _check(str(root), None, fsspec.filesystem("file"), str(root), age, needle)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["file", "memory"])
def test_remote(tmp_path, variant, kind):
    age, needle = VARIANTS[variant]
    url = f"file://{tmp_path / 'remote'}" if kind == "file" else f"memory://story-{uuid.uuid4().hex[:12]}/run"
    cfg = layerckpt.Config(full=True, keep_last=0, remote=url)
    _save(tmp_path / "ck", cfg)
    fs, path = fsspec.core.url_to_fs(url)
    _check(url, cfg, fs, path, age, needle)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_s3(s3, tmp_path, variant):
    age, needle = VARIANTS[variant]
    url = f"s3://{s3.bucket()}/run"
    cfg = layerckpt.Config(full=True, keep_last=0, remote=url, remote_options=s3.options)
    _save(tmp_path / "ck", cfg)
    fs, path = fsspec.core.url_to_fs(url, **s3.options)
    _check(url, cfg, fs, path, age, needle)
