"""`layerckpt shm`: memory tiers whose store is gone are found and removed; nothing else is touched."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt import cli
from layerckpt.tiers import _shm
from layerckpt.tiers._memtier import memory_path

from conftest import assert_same_tensors


@pytest.fixture
def base(tmp_path, monkeypatch):
    b = tmp_path / "shm"
    b.mkdir(mode=0o700)
    monkeypatch.setenv("LAYERCKPT_SHM", str(b))
    return b


def _store(path, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with layerckpt.Checkpointer(str(path), model, config=layerckpt.Config(memory_tier=True)) as ck:
        ck.save(1)
    return model


def _tier_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_a_deleted_store_leaves_an_orphan_that_prune_removes(base, tmp_path, capsys):
    live = _store(tmp_path / "live")
    _store(tmp_path / "gone", seed=1)
    gone_tier = memory_path(str(tmp_path / "gone"))
    size = _tier_bytes(gone_tier)
    assert size > 4 * 64 * 64  # the composite's bytes, not only the bookkeeping
    shutil.rmtree(tmp_path / "gone")

    found = {f.path: f for f in _shm.scan()}
    assert found[gone_tier].state == _shm.ORPHAN and found[gone_tier].nbytes == size
    assert "its store" in found[gone_tier].why and str(tmp_path / "gone") in found[gone_tier].why
    assert found[memory_path(str(tmp_path / "live"))].state == _shm.LIVE

    assert cli.main(["shm"]) == 0
    out = capsys.readouterr().out
    assert "1 orphan(s)" in out and "layerckpt shm --prune" in out and os.path.isdir(gone_tier)

    assert cli.main(["shm", "--prune"]) == 0
    assert "removed 1 orphan(s)" in capsys.readouterr().out
    assert not os.path.exists(gone_tier) and os.path.isdir(memory_path(str(tmp_path / "live")))
    # the live store's tier untouched: its composite byte for byte the store's, and restorable
    mem = memory_path(str(tmp_path / "live"))
    for n in os.listdir(tmp_path / "live" / "data"):
        assert (tmp_path / "live" / "data" / n).read_bytes() == open(os.path.join(mem, "data", n), "rb").read()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    layerckpt.restore(str(tmp_path / "live"), model, config=layerckpt.Config(memory_tier=True))
    assert_same_tensors(model.state_dict(), live.state_dict())


def test_a_store_replaced_by_another_orphans_the_tier(base, tmp_path):
    _store(tmp_path / "a")
    _store(tmp_path / "b", seed=1)
    shutil.rmtree(tmp_path / "a")
    shutil.copytree(tmp_path / "b", tmp_path / "a")  # another store's identity at a's path
    got = {f.path: f for f in _shm.scan()}[memory_path(str(tmp_path / "a"))]
    assert got.state == _shm.ORPHAN and "another one" in got.why


def test_what_it_cannot_vouch_for_is_left_alone(base, tmp_path):
    _store(tmp_path / "old")
    old = memory_path(str(tmp_path / "old"))
    os.remove(os.path.join(old, _shm.ORIGIN))  # a tier from before origins were recorded
    _store(tmp_path / "forged", seed=1)
    forged = memory_path(str(tmp_path / "forged"))
    with open(os.path.join(forged, _shm.ORIGIN), "w") as f:  # names a store whose tier is another folder
        f.write(str(tmp_path / "elsewhere") + "\n")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    link = base / ("layerckpt-" + "0" * 16)
    os.symlink(target, link)  # a link named as a tier: never followed, never removed
    loose = base / ("layerckpt-" + "1" * 16)
    loose.mkdir()
    os.chmod(loose, 0o777)
    shutil.rmtree(tmp_path / "old")
    shutil.rmtree(tmp_path / "forged")

    found = {f.path: f for f in _shm.scan()}
    assert found[old].state == _shm.UNKNOWN and "no record of its store" in found[old].why
    assert found[forged].state == _shm.UNKNOWN and "another folder" in found[forged].why
    assert found[str(link)].state == _shm.REFUSED and "symbolic link" in found[str(link)].why
    assert found[str(loose)].state == _shm.REFUSED and "writable by group or others" in found[str(loose)].why
    assert _shm.prune(list(found.values())) == []
    assert os.path.isdir(old) and os.path.isdir(forged) and os.path.islink(link) and os.path.isdir(loose)
    assert (target / "keep").read_bytes() == b"x"


def test_no_tier_at_all(base, capsys):
    assert cli.main(["shm"]) == 0
    assert capsys.readouterr().out == f"no memory tier in {base}\n"


def test_a_base_that_is_no_folder_is_one_line(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_bytes(b"")
    monkeypatch.setenv("LAYERCKPT_SHM", str(f))
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "shm"], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"the memory tiers' folder {f} cannot be listed: Not a directory; check that LAYERCKPT_SHM names" in r.stderr
