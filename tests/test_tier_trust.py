"""A restore never loads another store's tensors from a tier: a memory tier planted at the predictable
/dev/shm place, or one that is a link, writable by others or another store's, is ignored; a manifest's
recorded ``config.remote`` never redirects a restore; a remote named by the caller's Config must carry the
store's identity."""
import json
import logging
import os
import shutil

import pytest
import torch

import layerckpt
from conftest import assert_same_state
from layerckpt.tiers._memtier import memory_path
from layerckpt.format._store import STORE_ID

import fsspec  # noqa: F401

FULL = layerckpt.Config(threshold=0.0, keep_last=2)
MEM = FULL.replace(memory_tier=True)


@pytest.fixture(autouse=True)
def private_shm(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("LAYERCKPT_SHM", str(base))


def model(value: float) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * value + i)
    return m


def saved(root, value: float, steps: int, config=FULL) -> torch.nn.Module:
    """A store at ``root`` whose composites hold ``model(value)``, saved ``steps`` times."""
    m = model(value)
    with layerckpt.Checkpointer(root, m, config=config) as ck:
        for step in range(1, steps + 1):
            ck.save(step).wait()
    return m


def restored(root, **kw):
    m = model(0.0)
    return layerckpt.restore(root, m, **kw), m


def plant(src_tier: str, root) -> str:
    """Copy another store's memory tier to where ``root``'s memory tier lives (as any local user can)."""
    dst = memory_path(str(root))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src_tier, dst)
    return dst


@pytest.fixture
def victim_and_other(tmp_path):
    """(the store ``a`` with one composite, its model; the memory tier of the store ``b`` with 5 composites)"""
    mine = saved(tmp_path / "a", 1.0, 1)
    saved(tmp_path / "b", 7.0, 5, MEM)
    return tmp_path / "a", mine, memory_path(str(tmp_path / "b"))


@pytest.mark.parametrize("config", [None, FULL, MEM], ids=["no-config", "memory-off", "memory-on"])
def test_planted_memory_tier_never_wins(victim_and_other, config, caplog):
    root, mine, other = victim_and_other
    plant(other, root)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        r, m = restored(root, config=config)
    assert r.step == 1 and r.manifest == str(root / "manifests" / "step-00000001.json")
    assert_same_state(mine, m)
    if config is MEM:
        assert "another store's checkpoints" in caplog.text


def _with_my_identity(other: str, root) -> str:
    """``other``'s memory tier planted for ``root``, carrying ``root``'s identity: only the folder's owner and
    mode tell it apart."""
    dst = plant(other, root)
    shutil.copyfile(root / STORE_ID, os.path.join(dst, STORE_ID))
    return dst


def test_the_identity_is_what_tells_a_memory_tier_apart(victim_and_other):
    root, _, other = victim_and_other
    _with_my_identity(other, root)  # private, ours, this store's identity: it is read (the fresher tier)
    r, m = restored(root, config=MEM)
    assert r.step == 5
    assert_same_state(model(7.0), m)


def test_group_writable_memory_tier_is_ignored(victim_and_other, caplog):
    root, mine, other = victim_and_other
    os.chmod(_with_my_identity(other, root), 0o770)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        r, m = restored(root, config=MEM)
    assert r.step == 1
    assert_same_state(mine, m)
    assert "writable by group or others" in caplog.text


def test_symlinked_memory_tier_is_ignored(victim_and_other, caplog, tmp_path):
    root, mine, other = victim_and_other
    real = _with_my_identity(other, root)
    os.rename(real, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", real)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        r, m = restored(root, config=MEM)
    assert r.step == 1
    assert_same_state(mine, m)
    assert "symbolic link" in caplog.text
    with pytest.raises(layerckpt.CheckpointError, match="symbolic link"):  # nor does a writer use it
        layerckpt.Checkpointer(root, model(1.0), config=MEM).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_foreign_owned_memory_tier_is_ignored(victim_and_other, caplog):
    root, mine, other = victim_and_other
    os.chown(_with_my_identity(other, root), 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        r, m = restored(root, config=MEM)
    assert r.step == 1
    assert_same_state(mine, m)
    assert "owned by uid 65534" in caplog.text


def test_memory_tier_of_a_replaced_store_is_not_continued(tmp_path):
    root = tmp_path / "a"
    saved(root, 7.0, 5, MEM)
    shutil.rmtree(root)  # a new store at the same path: the old memory tier is not its own
    mine = saved(root, 1.0, 1)
    r, m = restored(root, config=MEM)
    assert r.step == 1
    assert_same_state(mine, m)
    saved(root, 2.0, 1, MEM)  # its writer empties it and makes it its own
    mem = memory_path(str(root))
    assert open(os.path.join(mem, STORE_ID)).read() == open(root / STORE_ID).read()
    assert (os.stat(mem).st_mode & 0o777) == 0o700


@pytest.fixture
def other_remote(tmp_path):
    """The file:// remote of the store ``b`` (5 composites)."""
    url = "file://" + str(tmp_path / "remote-b")
    saved(tmp_path / "b", 7.0, 5, FULL.replace(remote=url))
    return url


def test_recorded_remote_does_not_redirect_a_restore(tmp_path, other_remote):
    root = tmp_path / "a"
    mine = saved(root, 1.0, 1)
    path = root / "manifests" / "step-00000001.json"
    d = json.loads(path.read_text())
    d["config"]["remote"] = other_remote
    path.write_text(json.dumps(d))
    r, m = restored(root)
    assert r.step == 1 and r.manifest == str(path)
    assert_same_state(mine, m)


def test_remote_of_another_store_is_refused(tmp_path, other_remote, caplog):
    root = tmp_path / "a"
    mine = saved(root, 1.0, 1)
    cfg = FULL.replace(remote=other_remote)
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        r, m = restored(root, config=cfg)
    assert r.step == 1 and r.manifest.startswith(str(root))
    assert_same_state(mine, m)
    assert f"the remote tier {other_remote} (Config.remote) is not used: it holds another store's" in caplog.text
    # the step only the other store has: refused with the reason, not loaded
    with pytest.raises(layerckpt.CheckpointError, match="holds another store's checkpoints"):
        restored(root, step=5, config=cfg)
    # nor does this store's writer copy into it
    with pytest.raises(layerckpt.CheckpointError, match="holds the checkpoints of another store"):
        layerckpt.Checkpointer(root, model(1.0), config=cfg).close()
    # named by its URL, the caller asks for that store: it is read
    r, m = restored(other_remote)
    assert r.step == 5
    assert_same_state(model(7.0), m)


def test_new_local_place_of_a_remote_takes_its_identity(tmp_path, other_remote):
    cfg = FULL.replace(remote=other_remote)
    r, m = restored(tmp_path / "fresh", config=cfg)  # nothing local yet: the remote is read
    assert r.step == 5
    with layerckpt.Checkpointer(tmp_path / "fresh", m, config=cfg) as ck:
        ck.save(6).wait()
    assert (tmp_path / "fresh" / STORE_ID).read_text() == (tmp_path / "b" / STORE_ID).read_text()
    assert restored(tmp_path / "b", config=cfg)[0].step == 6  # the other place of one store sees it
