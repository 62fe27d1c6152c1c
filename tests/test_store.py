"""layerckpt.store, the public store API, on real stores: local and remote (memory://, file://)."""
import os
import uuid

import pytest
import torch

import layerckpt
from conftest import assert_same_tensors, trained
from layerckpt import store

FULL = layerckpt.Config(threshold=0.0, keep_last=0)  # every layer at every save, every composite kept


def _three_saves(root, config=FULL):
    """A store with the composites of steps 0, 1, 2 (the weights move between saves); their states."""
    model, opt = trained()
    states = {}
    with layerckpt.Checkpointer(root, model, opt, config=config) as ck:
        for step in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (step + 1))
            ck.save(step, extra={"tag": f"s{step}"}).wait()
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return model, states


def test_list_newest_resolve_read_on_a_local_store(tmp_path):
    root = str(tmp_path / "run")
    model, states = _three_saves(root)
    assert store.steps(root) == [0, 1, 2] and store.next_step(root) == 3
    listed = store.composites(root)
    assert [c.step for c in listed] == [0, 1, 2] and [c.extra for c in listed] == [{"tag": f"s{i}"} for i in range(3)]
    assert [c.path for c in listed] == [store.manifest_path(root, s) for s in range(3)]
    assert listed[0].seq < listed[1].seq < listed[2].seq and listed[2].world_size == 1
    assert store.newest(root) == store.resolve(root) == store.manifest_path(root, 2)
    one = store.manifest_path(root, 1)
    assert store.resolve(one) == store.resolve(root, 1) == one
    assert store.read_manifest(one).extra == {"tag": "s1"} and store.read_manifest(one).step == 1
    assert store.is_checkpoint(root) and store.is_checkpoint(one) and store.locate(one) == (root, 1)
    with pytest.raises(layerckpt.CheckpointError, match="is the checkpoint of step 1, but step=2 was asked for"):
        store.resolve(one, step=2)
    with pytest.raises(layerckpt.CheckpointNotFoundError, match=r"no committed checkpoint for step 7 .* \[0, 1, 2\]"):
        store.resolve(root, 7)
    # the API only reads: what it named restores bit for bit
    for step in (1, 2):
        loaded = layerckpt.read_checkpoint(store.resolve(root, step))
        assert loaded.step == step
        assert_same_tensors({**loaded.model_other, **loaded.model}, states[step])


def test_empty_and_missing_stores(tmp_path):
    empty = tmp_path / "empty"
    (empty / store.MANIFEST_DIR).mkdir(parents=True)
    assert store.steps(str(empty)) == [] and store.next_step(str(empty)) == 0 and store.composites(str(empty)) == []
    assert store.newest(str(empty)) is None
    assert store.steps(str(tmp_path / "nowhere")) == [] and not store.is_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="does not exist"):
        store.resolve(str(tmp_path / "nowhere"))
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="is a directory but not a layerckpt checkpoint"):
        store.resolve(str(tmp_path))


def test_release_keeps_the_newest_and_what_the_rest_uses(tmp_path):
    root = str(tmp_path / "run")
    model, states = _three_saves(root, layerckpt.Config(threshold=0.05, keep_last=0))
    assert store.release(root, [2]) == []  # the newest always stays
    removed = store.release(root, [0, 1, 99])
    assert store.manifest_path(root, 0) in removed and store.manifest_path(root, 1) in removed
    assert store.steps(root) == [2] and store.release(root, [0]) == []
    layerckpt.restore(root, model)
    assert_same_tensors(model.state_dict(), states[2])


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_remote_tier_through_the_same_calls(tmp_path, kind):
    import fsspec  # noqa: F401
    url = (f"memory://ckpt-{uuid.uuid4().hex[:12]}/run" if kind == "memory"
           else "file://" + str(tmp_path / "remote" / "run"))
    cfg = FULL.replace(remote=url)
    root = str(tmp_path / "run")
    model, states = _three_saves(root, cfg)
    assert store.is_url(url) and not store.is_url(root)
    assert store.steps(url, config=cfg) == [0, 1, 2] and store.next_step(url, config=cfg) == 3
    assert [c.step for c in store.composites(url, config=cfg)] == [0, 1, 2]
    newest = store.newest(url, config=cfg)
    assert newest == store.resolve(url) == store.manifest_path(url, 2) == f"{url}/manifests/step-00000002.json"
    assert store.resolve(store.manifest_path(url, 1)) == store.manifest_path(url, 1)
    assert store.read_manifest(newest, config=cfg).extra == {"tag": "s2"}
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="no committed checkpoint for step 5"):
        store.read_manifest(store.manifest_path(url, 5))
    with pytest.raises(layerckpt.CheckpointError, match="names a store, not one of its manifests"):
        store.read_manifest(url)
    loaded = layerckpt.read_checkpoint(store.resolve(url, 1), config=cfg)
    assert loaded.step == 1
    assert_same_tensors({**loaded.model_other, **loaded.model}, states[1])


def test_remote_files_upload_list_download(tmp_path):
    import fsspec  # noqa: F401
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3000))
    (src / "sub" / "b.txt").write_text("b")
    for url in (f"memory://files-{uuid.uuid4().hex[:12]}/x", "file://" + str(tmp_path / "remote")):
        rf = store.RemoteFiles(url)
        rf.upload(str(src / "a.bin"), "folders/one", "a.bin")
        rf.upload(str(src / "sub" / "b.txt"), "folders/one/sub", "b.txt")
        assert rf.names("folders") == ["one"] and rf.names("folders/one") == ["a.bin", "sub"]
        assert rf.read("folders/one", "a.bin") == (src / "a.bin").read_bytes()
        dest = tmp_path / f"dest-{url.split(':')[0]}"
        assert sorted(rf.download("folders/one", str(dest))) == ["a.bin", "sub/b.txt"]
        assert (dest / "a.bin").read_bytes() == (src / "a.bin").read_bytes() and (dest / "sub" / "b.txt").read_text() == "b"
        assert rf.names("nothing") == []


def test_a_commit_fsyncs_the_data_and_the_manifest_not_the_latest_hint(tmp_path, monkeypatch):
    """What a save fsyncs before it counts as committed, besides its data file (fdatasync): the manifest (written
    to a temporary name, fsynced, renamed) and both folders.  ``latest`` decides nothing (the manifests are the commit
    record), so it is replaced whole but not fsynced; after the save it names the newest manifest."""
    root = str(tmp_path / "run")
    model, opt = trained()
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    with layerckpt.Checkpointer(root, model, opt, config=FULL) as ck:
        ck.save(7).wait()
    manifest = store.newest(root)
    rel = sorted(os.path.relpath(p, root) for p in synced)
    assert os.path.relpath(manifest, root) + ".tmp" in rel, rel
    assert "manifests" in rel and "data" in rel, rel
    assert not any(r.startswith("latest") for r in rel), rel
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == os.path.basename(manifest)
