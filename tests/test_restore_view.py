"""restore() and read_checkpoint() resolve their source into one local view, then read it once.

The memory tier's folder and a remote composite downloaded into a temporary folder are read by the same
reader as the local directory: one tier look-up and one local read per call, never a second restore
inside the first, and the temporary folder is gone when the call returns.
"""
import os
import shutil
import sys
import tempfile

import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer, assert_same_state, assert_same_tensors, trained
from layerckpt.read import _fetch, _reader
from layerckpt.tiers._memtier import memory_path

FULL = layerckpt.Config(threshold=0.0, keep_last=2)
_restore_module = sys.modules["layerckpt.restore"]


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """Counts of what each call does: entries into restore/read_checkpoint (an inner call included), tier
    look-ups, and local reads opened, with the directory each read; temporary folders go under tmp_path."""
    counts = {"restore": 0, "read_checkpoint": 0, "source": 0, "reader": 0, "roots": []}

    def counting(name, fn):
        def wrapper(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapper

    # an inner restore() would look these names up in the module: count them there
    monkeypatch.setattr(_restore_module, "restore", counting("restore", _restore_module.restore))
    monkeypatch.setattr(_restore_module, "read_checkpoint", counting("read_checkpoint", _restore_module.read_checkpoint))
    monkeypatch.setattr(_fetch, "source", counting("source", _fetch.source))
    init = _reader.Reader.__init__

    def reader_init(self, root, mpath, config):
        counts["reader"] += 1
        counts["roots"].append((root, os.path.isdir(os.path.join(root, "data"))))
        init(self, root, mpath, config)

    monkeypatch.setattr(_reader.Reader, "__init__", reader_init)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    counts["tmp"] = tmp
    return counts


def _saved(root, cfg):
    model, opt = trained()
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        ck.save(3, extra={"step": 3}).wait()
    return model, opt


def test_memory_tier_is_read_once_in_place(tmp_path, calls):
    root = tmp_path / "ck"
    try:
        model, opt = _saved(root, FULL.replace(memory_tier=True))
        shutil.rmtree(root / "data")  # only the memory tier holds the data now
        (root / "data").mkdir()
        m2, _ = trained(seed=1)
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
        r = layerckpt.restore(root, m2, o2, config=FULL.replace(memory_tier=True))  # only then is it read
        assert (calls["restore"], calls["source"], calls["reader"]) == (0, 1, 1)
        assert calls["roots"] == [(memory_path(str(root)), True)]  # the tier's own folder, not a copy
        assert_same_state(model, m2)
        assert_same_optimizer(opt, o2)
        # the local directory holds the same composite: the report names it, so adopt() continues it
        assert r.step == 3 and r.extra == {"step": 3}
        assert r.manifest == str(root / "manifests" / "step-00000003.json")
        # bytes_read: what came off storage (encoded: fewer than the layers' raw bytes)
        assert r.seconds > 0 and r.bytes_read > 0 and sum(r.layer_bytes.values()) > 0

        loaded = layerckpt.read_checkpoint(root, config=FULL.replace(memory_tier=True))
        assert (calls["read_checkpoint"], calls["source"], calls["reader"]) == (0, 2, 2)
        assert_same_tensors(loaded.model, model.state_dict())
        assert loaded.manifest == r.manifest and loaded.seconds > 0
    finally:
        shutil.rmtree(memory_path(str(root)), ignore_errors=True)


@pytest.mark.parametrize("kind", ["memory://", "file://"])
def test_remote_composite_is_read_once_downloaded_or_in_place(tmp_path, calls, kind):
    """A remote on another file system is downloaded into a temporary folder, read, and the copy removed; a
    ``file://`` remote is read in place, as the memory tier is (a copy first would read every byte twice)."""
    import fsspec  # noqa: F401
    url = f"memory://view-{tmp_path.name}/run" if kind == "memory://" else "file://" + str(tmp_path / "remote" / "run")
    root = tmp_path / "ck"
    cfg = FULL.replace(remote=url)
    model, opt = _saved(root, cfg)
    shutil.rmtree(root)

    m2, _ = trained(seed=1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    r = layerckpt.restore(url, m2, o2, config=cfg)
    assert (calls["restore"], calls["source"], calls["reader"]) == (0, 1, 1)
    (read_root, had_data), = calls["roots"]
    if kind == "memory://":
        assert read_root.startswith(str(calls["tmp"])) and had_data  # a downloaded copy, read while it existed
    else:
        assert read_root == str(tmp_path / "remote" / "run") and had_data  # the remote's own folder
    assert os.listdir(calls["tmp"]) == [], "no copy is left (none was made for file://)"
    assert_same_state(model, m2)
    assert_same_optimizer(opt, o2)
    assert r.step == 3 and r.manifest == url + "/manifests/step-00000003.json" and r.seconds > 0

    loaded = layerckpt.read_checkpoint(url + "/manifests/step-00000003.json", config=cfg)
    assert (calls["read_checkpoint"], calls["source"], calls["reader"]) == (0, 2, 2)
    assert os.listdir(calls["tmp"]) == []


def test_local_directory_is_read_once(tmp_path, calls):
    root = tmp_path / "ck"
    model, opt = _saved(root, FULL)
    m2, _ = trained(seed=1)
    r = layerckpt.restore(root, m2, strict=False)  # no optimizer given: its state is not read
    assert (calls["restore"], calls["source"], calls["reader"]) == (0, 1, 1)
    assert calls["roots"] == [(str(root), True)]
    assert_same_state(model, m2)
    assert r.manifest == str(root / "manifests" / "step-00000003.json")
    # a manifest path is read where it lies (read_checkpoint), and must agree with step=
    loaded = layerckpt.read_checkpoint(root / "manifests" / "step-00000003.json")
    assert loaded.step == 3 and loaded.manifest == r.manifest
    with pytest.raises(layerckpt.CheckpointError, match="is the checkpoint of step 3, but step=2 was asked for"):
        layerckpt.read_checkpoint(root / "manifests" / "step-00000003.json", step=2)
