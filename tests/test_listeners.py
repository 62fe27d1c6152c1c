"""What runs after a commit: the tiers queue their copies, then the one local retention keeps the pinned
composites (Checkpointer.keep), those a tier still copies from or has queued, and the keep_last newest."""
import json
import os
import threading
import time
import uuid

import pytest
import torch

import layerckpt
from conftest import small_model
from layerckpt import _faults

import fsspec  # noqa: F401


def _manifests(root):
    return sorted(int(n[5:13]) for n in os.listdir(root / "manifests") if n.endswith(".json"))


def _unreferenced(root):
    """Data files no kept manifest references, and referenced ones missing."""
    used = set()
    for n in os.listdir(root / "manifests"):
        used |= set(json.loads((root / "manifests" / n).read_text())["files"])
    return set(os.listdir(root / "data")) ^ used


def _data_is_referenced_only(root):
    assert _unreferenced(root) == set()


def _move(model, step):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)


def test_retention_keeps_pinned_tier_held_and_newest(tmp_path):
    root = tmp_path / "ck"
    url = f"memory://ckpt-{uuid.uuid4().hex[:12]}/run"
    model = small_model()
    go, copying = threading.Event(), threading.Event()

    def hold():  # the remote copy of the first composite: its data is up, its manifest not yet
        copying.set()
        assert go.wait(60)

    cfg = layerckpt.Config(threshold=0.0, keep_last=1, remote=url)
    ck = layerckpt.Checkpointer(root, model, config=cfg)
    _faults.install("tier.data-copied", hold)
    try:
        ck.save(1).wait()
        assert copying.wait(60)
        _move(model, 2)
        ck.save(2).wait()
        assert _manifests(root) == [1, 2]  # 1: the tier copies from it; 2: the newest
        ck.keep([root / "manifests" / "step-00000002.json"])
        _move(model, 3)
        ck.save(3).wait()
        assert _manifests(root) == [1, 2, 3]  # 1: copied from; 2: pinned; 3: the newest (and queued)
        _faults.remove("tier.data-copied")
        go.set()
        ck.wait()  # the copies ended: the local retention runs after each, on the flusher thread
        deadline = time.time() + 30
        while (_manifests(root) != [2, 3] or _unreferenced(root)) and time.time() < deadline:
            time.sleep(0.01)
        assert _manifests(root) == [2, 3]
        _data_is_referenced_only(root)
        ck.keep([])  # unpinned: goes at the next retention, after the next commit
        assert _manifests(root) == [2, 3]
        _move(model, 4)
        ck.save(4).wait()
        ck.wait()
        assert _manifests(root) == [4]
        _data_is_referenced_only(root)
    finally:
        _faults.remove("tier.data-copied")
        go.set()
        ck.close()
    out = small_model()
    assert layerckpt.restore(url, out).step == 4  # the remote got the newest
    assert layerckpt.restore(root, small_model()).step == 4


def test_keep_last_zero_keeps_everything_and_pins_change_nothing(tmp_path):
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(threshold=0.0, keep_last=0)) as ck:
        for step in range(1, 4):
            _move(model, step)
            ck.save(step).wait()
            ck.keep([])
    assert _manifests(tmp_path) == [1, 2, 3]
    _data_is_referenced_only(tmp_path)


def test_pins_from_another_directory_are_names_only(tmp_path):
    """keep() takes manifest paths and keeps by file name, as before."""
    model = small_model()
    with layerckpt.Checkpointer(tmp_path / "ck", model, config=layerckpt.Config(threshold=0.0, keep_last=1)) as ck:
        ck.save(1).wait()
        ck.keep([os.path.join("anywhere", "manifests", "step-00000001.json")])
        for step in (2, 3):
            _move(model, step)
            ck.save(step).wait()
    assert _manifests(tmp_path / "ck") == [1, 3]


def test_retention_parses_each_manifest_once_and_sees_one_replaced(tmp_path, manifest_parses):
    """Retention runs at every commit; a manifest just committed is taken as the object written, never parsed
    back, and one it holds is not parsed again unless its file changed."""
    parsed = manifest_parses
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(full=True, keep_last=3)) as ck:
        for step in range(1, 7):
            _move(model, step)
            ck.save(step).wait()
        assert parsed == []  # each taken as committed
        # a manifest replaced (a new inode under the same name) is parsed again, once
        path = tmp_path / "manifests" / "step-00000005.json"
        doc = json.loads(path.read_text())
        doc["name"] = "edited"
        tmp = tmp_path / "manifests" / "x.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        parsed.clear()
        _move(model, 7)
        ck.save(7).wait()
        _move(model, 8)
        ck.save(8).wait()
    assert parsed == ["step-00000005.json"]
    assert _manifests(tmp_path) == [6, 7, 8]
    _data_is_referenced_only(tmp_path)
