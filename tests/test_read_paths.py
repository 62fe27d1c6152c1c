"""Every read path of a restore, on every backend: small files buffered straight into the targets, big files
through the O_DIRECT pipeline, big files where O_DIRECT is off (tmpfs, direct_io=False).  Each one restores
bit for bit and finds damage."""
import json
import re
import os
import shutil

import pytest

import layerckpt
from layerckpt.read import _read
from conftest import assert_same_optimizer_state, assert_same_tensors, small_model, trained, stored_byte

# (SMALL_FILE, direct_io, whether the page cache is taken to hold the file: None = as it really is)
PATHS = {"small": (_read.SMALL_FILE, True, None), "odirect": (0, True, False), "buffered": (0, False, None),
         "cached": (0, True, True)}


@pytest.fixture(params=sorted(PATHS))
def read_path(request, monkeypatch, backend):
    small, direct, cached = PATHS[request.param]
    monkeypatch.setattr(_read, "SMALL_FILE", small)
    if cached is not None:
        monkeypatch.setattr(_read, "_cached", lambda path, wants: cached)
    return layerckpt.Config(direct_io=direct)


def _saved(tmp_path):
    model, opt = trained()
    with layerckpt.Checkpointer(str(tmp_path), model, opt, layerckpt.Config(threshold=0.0)) as ck:
        ck.save(3)
    return model, opt


def test_every_read_path_restores_bit_for_bit(tmp_path, read_path):
    model, opt = _saved(tmp_path)
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2, config=read_path)
    assert_same_tensors(model2.state_dict(), model.state_dict())
    assert_same_optimizer_state(opt2.state_dict(), opt.state_dict())
    loaded = layerckpt.read_checkpoint(str(tmp_path), config=read_path)
    assert_same_tensors({k: loaded.model[k] for k in model.state_dict()}, model.state_dict())


@pytest.mark.parametrize("where", ["model", "optim"])
def test_every_read_path_finds_damage(tmp_path, read_path, where):
    _saved(tmp_path)
    m = json.loads((tmp_path / "manifests" / "step-00000003.json").read_text())
    key = next(k for k in sorted(m["tensors"]) if k.startswith(where) and m["tensors"][k]["nbytes"] > 64)
    e = m["tensors"][key]
    with open(tmp_path / "data" / e["file"], "r+b") as f:
        f.seek(stored_byte(e))
        b = f.read(1)
        f.seek(stored_byte(e))
        f.write(bytes([b[0] ^ 0xFF]))
    model2, opt2 = trained(seed=1)
    with pytest.raises(layerckpt.CheckpointCorruptError,
                       match=f"(checksum mismatch|damaged encoded block) in tensor {re.escape(repr(key))}"):
        layerckpt.restore(str(tmp_path), model2, opt2, config=read_path)


def test_every_read_path_names_a_truncated_file(tmp_path, read_path):
    _saved(tmp_path)
    data = tmp_path / "data" / os.listdir(tmp_path / "data")[0]
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises(layerckpt.CheckpointCorruptError, match="is truncated"):
        layerckpt.restore(str(tmp_path), small_model(), config=read_path)


def test_page_cache_probe(tmp_path):
    """A big file the page cache holds is read buffered; one it does not, through O_DIRECT."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    wants = [_read.Want("a", 0, 1 << 20, 0, None, ()), _read.Want("b", 2 << 20, 2 << 20, 0, None, ())]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        with open(path, "rb") as f:
            f.read()
        assert _read._cached(str(path), wants)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _read._cached(str(path), wants):
            pytest.skip("this file system keeps the file cached (tmpfs?)")
        assert not _read._cached(str(path), wants)
    finally:
        os.close(fd)


def test_memory_tier_is_read_buffered(tmp_path, monkeypatch):
    """tmpfs accepts O_DIRECT on newer kernels, where it only adds a bounce copy: the memory tier's files are
    read buffered, straight into the targets, whatever their size."""
    from layerckpt.tiers._memtier import memory_path

    if not _read._in_memory(memory_path(str(tmp_path))):
        pytest.skip("the memory tier's base is not a memory file system here")
    monkeypatch.setattr(_read, "SMALL_FILE", 0)  # every file counts as big

    def no_odirect(*a, **k):
        raise AssertionError("the O_DIRECT pipeline ran on tmpfs")

    monkeypatch.setattr(_read, "_pump", no_odirect)
    model, opt = trained()
    try:
        with layerckpt.Checkpointer(str(tmp_path), model, opt,
                                    layerckpt.Config(threshold=0.0, memory_tier=True)) as ck:
            ck.save(3)
        shutil.rmtree(tmp_path / "data")  # only the memory tier holds the data now
        (tmp_path / "data").mkdir()
        model2, opt2 = trained(seed=1)
        layerckpt.restore(str(tmp_path), model2, opt2, config=layerckpt.Config(memory_tier=True))
    finally:
        shutil.rmtree(memory_path(str(tmp_path)), ignore_errors=True)
    assert_same_tensors(model2.state_dict(), model.state_dict())
    assert_same_optimizer_state(opt2.state_dict(), opt.state_dict())


def test_the_ring_is_made_only_for_a_read_that_uses_it(tmp_path, monkeypatch):
    """A restore whose files are all read buffered (small) never makes an I/O backend (no io_uring probe, no
    ring); one that reads through O_DIRECT makes one, and both restore bit for bit."""
    from layerckpt.read import _reader

    made = []
    real = _reader.make_backend
    monkeypatch.setattr(_reader, "make_backend", lambda *a: made.append(a) or real(*a))
    model, opt = _saved(tmp_path)
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert made == []
    assert_same_tensors(model2.state_dict(), model.state_dict())
    monkeypatch.setattr(_read, "SMALL_FILE", 0)
    monkeypatch.setattr(_read, "_cached", lambda path, wants: False)
    model3, opt3 = trained(seed=2)
    layerckpt.restore(str(tmp_path), model3, opt3)
    assert len(made) == 1
    assert_same_tensors(model3.state_dict(), model.state_dict())
    assert_same_optimizer_state(opt3.state_dict(), opt.state_dict())
