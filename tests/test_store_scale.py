"""What a resume costs does not grow with the composites a store holds (a Trainer or LayerCheckpoint keeping every
checkpoint): restore() parses the newest manifest alone, and opening a Checkpointer on the store parses none,
while the newest-by-commit rule, the refusal to fall back past a damaged newer checkpoint, and the clean-up of a
torn save's files hold as before."""
import json
import os

import pytest
import torch

import layerckpt
from conftest import trained
from layerckpt import store
from layerckpt.errors import CheckpointCorruptError

KEEP_ALL = layerckpt.Config(threshold=0.0, keep_last=0)
N = 12


def _saves(root, steps):
    model, opt = trained()
    with layerckpt.Checkpointer(root, model, opt, config=KEEP_ALL) as ck:
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            ck.save(step).wait()
    return model, opt


def test_restore_and_open_parse_no_more_manifests_with_many_composites(tmp_path, manifest_parses):
    root = str(tmp_path / "run")
    model, opt = _saves(root, range(1, N + 1))
    assert len(store.steps(root)) == N
    manifest_parses.clear()
    rep = layerckpt.restore(root, *trained(seed=1))
    assert rep.step == N and set(manifest_parses) == {"step-%08d.json" % N}
    manifest_parses.clear()
    m2, o2 = trained(seed=2)
    with layerckpt.Checkpointer(root, m2, o2, config=KEEP_ALL) as ck:
        assert manifest_parses == []  # the commit number and the clean-up read no manifest
        ck.save(N + 1).wait()
    assert store.read_manifest(store.resolve(root)).seq == N + 1


def test_the_newest_commit_wins_over_a_higher_step_and_an_older_writers_layout(tmp_path):
    root = str(tmp_path / "run")
    _saves(root, [10, 20, 30])
    _saves(root, [15])  # a rollback: resumed from 10 and saved 15, committed after 30
    assert os.path.basename(store.resolve(root)) == "step-00000015.json"
    # a manifest whose first bytes do not say its order (another writer's key order) is read whole
    path = os.path.join(root, "manifests", "step-00000015.json")
    doc = json.load(open(path))
    with open(path, "w") as f:
        json.dump({k: doc[k] for k in reversed(list(doc))}, f)
    assert os.path.basename(store.resolve(root)) == "step-00000015.json"


@pytest.fixture
def manifest_opens(monkeypatch):
    """The base names of the manifests whose first bytes were read to order them (``_store.peek``)."""
    from layerckpt.format import _store

    opened = []
    real = _store.peek

    def counted(path):
        opened.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(_store, "peek", counted)
    return opened


def test_a_step_ordered_store_is_resolved_and_opened_from_its_newest_manifest_alone(tmp_path, manifest_parses,
                                                                                     manifest_opens):
    root = str(tmp_path / "run")
    _saves(root, range(1, N + 1))
    assert os.path.isfile(os.path.join(root, ".step-order"))  # made by the writer's opening of the empty store
    manifest_parses.clear()
    assert os.path.basename(store.resolve(root)) == "step-%08d.json" % N
    assert manifest_opens == [] and manifest_parses == ["step-%08d.json" % N]
    manifest_opens.clear()
    m2, o2 = trained(seed=2)
    with layerckpt.Checkpointer(root, m2, o2, config=KEEP_ALL) as ck:
        assert manifest_opens == ["step-%08d.json" % N]  # the commit number: the newest's first bytes only
        ck.save(N + 1).wait()
    assert store.read_manifest(store.resolve(root)).seq == N + 1
    # without the marker (a store of a writer before it) every manifest's first bytes order them, as before
    os.unlink(os.path.join(root, ".step-order"))
    manifest_opens.clear()
    assert os.path.basename(store.resolve(root)) == "step-%08d.json" % (N + 1)
    assert len(manifest_opens) == N + 1


def test_a_rollback_commit_drops_the_step_order_before_its_manifest_and_wins(tmp_path, monkeypatch):
    from layerckpt.format import _store

    root = str(tmp_path / "run")
    _saves(root, [10, 20, 30])
    order = os.path.join(root, ".step-order")
    assert os.path.isfile(order)
    seen = []
    real = _store.write_atomic

    def spy(path, data, durable=True):
        if os.path.basename(path).startswith("step-"):
            seen.append((os.path.basename(path), os.path.exists(order)))
        return real(path, data, durable)

    monkeypatch.setattr(_store, "write_atomic", spy)
    import layerckpt.write._commit as _commit
    monkeypatch.setattr(_commit, "write_atomic", spy)
    _saves(root, [15, 40])  # resumed from 10: 15 commits after 30, then 40 above everything
    assert seen == [("step-00000015.json", False), ("step-00000040.json", False)]
    assert not os.path.exists(order)
    assert os.path.basename(store.resolve(root)) == "step-00000040.json"
    _saves(root, [])  # a writer's opening: the commit numbers no longer rise with the steps (30 after 15)
    assert not os.path.exists(order)


def test_latest_naming_a_later_commit_overrules_the_step_order(tmp_path):
    """A writer of a version before ``.step-order`` commits a lower step without removing it, and points
    ``latest`` at that commit: the store is read in commit order."""
    root = str(tmp_path / "run")
    _saves(root, [10, 20, 30])
    _saves(root, [15])
    open(os.path.join(root, ".step-order"), "w").close()  # left by a newer writer before the older one ran
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step-00000015.json"
    assert os.path.basename(store.resolve(root)) == "step-00000015.json"
    assert layerckpt.restore(root, *trained(seed=1)).step == 15


def test_a_damaged_newest_is_not_skipped_silently(tmp_path):
    root = str(tmp_path / "run")
    _saves(root, [1, 2, 3])
    path = os.path.join(root, "manifests", "step-00000003.json")
    raw = open(path, "rb").read()
    assert raw.startswith(b'{"step":3,"seq":3,')
    with open(path, "wb") as f:  # its first bytes intact, the rest cut off
        f.write(raw[: len(raw) // 2])
    with pytest.raises(CheckpointCorruptError, match="step-00000003.json"):
        layerckpt.restore(root, *trained(seed=1))
    # the older ones stay readable by step
    assert layerckpt.restore(root, *trained(seed=1), step=2).step == 2


def test_a_torn_saves_files_are_still_removed_on_open(tmp_path):
    root = str(tmp_path / "run")
    _saves(root, range(1, 6))
    data = os.path.join(root, "data")
    names = sorted(os.listdir(data))
    torn = os.path.join(data, "step-00000009.rank0.safetensors")  # a save killed before its commit
    resaved = os.path.join(data, names[-1].replace(".rank0", ".v1.rank0"))  # a re-save of step 5, never committed
    for p in (torn, resaved):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    m, o = trained(seed=2)
    layerckpt.Checkpointer(root, m, o, config=KEEP_ALL).close()
    assert sorted(os.listdir(data)) == names


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_restore_from_the_remote_tier_reads_one_manifest_whole(tmp_path, manifest_parses, kind):
    import fsspec  # noqa: F401
    import uuid

    url = (f"memory://ckpt-{uuid.uuid4().hex[:12]}/run" if kind == "memory"
           else "file://" + str(tmp_path / "remote" / "run"))
    cfg = KEEP_ALL.replace(remote=url)
    model, opt = trained()
    with layerckpt.Checkpointer(str(tmp_path / "run"), model, opt, config=cfg) as ck:
        for step in range(1, N + 1):
            ck.save(step).wait()
    steps = store.steps(url, config=cfg)  # a tier that falls behind copies the newest composite, skipping some
    assert len(steps) >= N // 2 and steps[-1] == N, steps
    manifest_parses.clear()
    rep = layerckpt.restore(url, *trained(seed=1), config=cfg)
    assert rep.step == N and set(manifest_parses) == {"step-%08d.json" % N}, manifest_parses
