"""Every read path of a restore, on every backend: small files buffered straight into the targets, big files
through the O_DIRECT pipeline, big files where O_DIRECT is off (tmpfs, direct_io=False).  Each one restores
bit for bit and finds damage."""
import json
import re
import os
import shutil
import threading

import pytest
import torch

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


def _in_page_cache(path):
    """The share of a file's pages the page cache holds, read in or with their read under way, by ``cachestat``
    (Linux 6.5+), which starts no readahead of its own.  A read-ahead hint puts its pages there before it
    returns and then leaves the reads to the disk, so once the last hint is given this count is settled,
    however slow the disk (``mincore`` would count only the pages already read in)."""
    import ctypes
    import mmap

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]  # len 0: to the end of the file

    class Stat(ctypes.Structure):
        _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                    "nr_recently_evicted")]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = os.open(path, os.O_RDONLY)
    try:
        st = Stat()
        if libc.syscall(451, fd, ctypes.byref(Range(0, 0)), ctypes.byref(st), 0) != 0:  # cachestat's number
            pytest.skip(f"cachestat: {os.strerror(ctypes.get_errno())}")
        return st.nr_cache / -(-os.fstat(fd).st_size // mmap.PAGESIZE)
    finally:
        os.close(fd)


def test_a_restore_asks_the_disk_for_every_range_at_once(tmp_path, monkeypatch):
    """Before its reads start, a restore asks the disk for every range it will read buffered: once the prefetch
    has given its hints, all of a 25 MB file is in the page cache or on its way there with nothing read yet
    (one hint would bring one readahead window: 8 MB here), and the reads do not ask again; the prefetch
    opens nothing a read refuses."""
    from layerckpt.read import _read, _reader

    big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])  # 25 MB of weights
    with layerckpt.Checkpointer(str(tmp_path), big, config=layerckpt.Config(threshold=0.0)) as ck:
        ck.save(1)
    m = json.loads((tmp_path / "manifests" / "step-00000001.json").read_text())
    (fname,) = {e["file"] for e in m["tensors"].values()}
    path = tmp_path / "data" / fname
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _in_page_cache(path) > 0.01:
        pytest.skip("this file system keeps the file cached (tmpfs?)")

    asked = []

    class Probe(_reader.Reader):
        def into(self, pairs):  # every page asked for, before the first read: the hints have put them all in
            assert self._prefetch is not None, "the reads started with nothing asked of the disk"
            self._prefetch.join()  # the page cache, whether or not the disk has read them in yet
            asked.append(_in_page_cache(path))
            return super().into(pairs)

    monkeypatch.setattr(_reader, "Reader", Probe)
    hinted = []  # the threads that gave read-ahead hints: the prefetch's, not the reads' again, whose pages are
    monkeypatch.setattr(_read, "_cached", lambda path, wants: False)  # not all in yet when they start, as here
    real_advise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, how: (
        how == os.POSIX_FADV_WILLNEED and hinted.append(threading.current_thread().name), real_advise(fd, o, n, how))[1])
    big2 = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    layerckpt.restore(str(tmp_path), big2)
    assert len(asked) == 1 and asked[0] > 0.99, asked
    assert_same_tensors(big2.state_dict(), big.state_dict())
    assert set(hinted) == {"layerckpt-prefetch"} and len(hinted) >= 50, (set(hinted), len(hinted))
    monkeypatch.undo()

    # a data file replaced by a link to one outside the store: the prefetch leaves it alone, the read refuses it
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    shutil.copy(path, outside)
    os.unlink(path)
    os.symlink(outside, path)
    opened = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *a: opened.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_advise(fd, *a))
    with pytest.raises(layerckpt.CheckpointCorruptError, match="symbolic link"):
        layerckpt.restore(str(tmp_path), big2)
    assert str(outside) not in opened


def test_a_strict_restore_asks_the_disk_before_its_checks_and_a_mismatch_still_touches_nothing(tmp_path, monkeypatch):
    """A strict restore hints every range of the model and the optimizer state from the manifest alone, before
    it matches names and shapes (its plan), so the disk starts sooner; the hints cover every read (none of the
    reads hints again); a restore that then finds a mismatch has read nothing into the model.  A non-strict
    restore, which may read only part, hints once its plan is known."""
    import importlib

    from layerckpt.read import _reader

    restore_mod = importlib.import_module("layerckpt.restore")  # the module: layerckpt.restore is the function
    model, opt = _saved(tmp_path)
    order = []
    real_plan, real_prefetch = restore_mod._ModelPlan, _reader.Reader.prefetch
    monkeypatch.setattr(restore_mod, "_ModelPlan", lambda *a: (order.append("plan"), real_plan(*a))[1])
    monkeypatch.setattr(_reader.Reader, "prefetch", lambda self, groups: (order.append("prefetch"),
                                                                            real_prefetch(self, groups))[1])
    monkeypatch.setattr(_read, "_cached", lambda path, wants: False)  # every read would hint, had it to
    hinted = []
    real_advise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, how: (
        how == os.POSIX_FADV_WILLNEED and hinted.append(threading.current_thread().name), real_advise(fd, o, n, how))[1])
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert order == ["prefetch", "plan"]
    assert set(hinted) == {"layerckpt-prefetch"}, set(hinted)
    assert_same_tensors(model2.state_dict(), model.state_dict())
    assert_same_optimizer_state(opt2.state_dict(), opt.state_dict())

    order.clear()
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(layerckpt.CheckpointMismatchError):
        layerckpt.restore(str(tmp_path), other)
    assert order == ["prefetch", "plan"]
    assert_same_tensors(other.state_dict(), before)
    assert not [t for t in threading.enumerate() if t.name == "layerckpt-prefetch"]  # joined as the reader closed

    order.clear()
    model3, opt3 = trained(seed=2)
    layerckpt.restore(str(tmp_path), model3, opt3, strict=False)
    assert order == ["plan", "prefetch"]
    assert_same_tensors(model3.state_dict(), model.state_dict())


def test_a_restore_whose_files_the_page_cache_holds_asks_for_nothing(tmp_path, monkeypatch):
    """A warm restore starts no prefetch and gives no hints: walking them over cached pages only costs time."""
    from layerckpt.read import _reader

    model, opt = _saved(tmp_path)
    for f in os.listdir(tmp_path / "data"):
        (tmp_path / "data" / f).read_bytes()  # into the page cache
    hints, threads = [], []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, how: (hints.append(how), real(fd, o, n, how))[1])

    class Probe(_reader.Reader):
        def into(self, pairs):
            threads.append(self._prefetch)
            return super().into(pairs)

    monkeypatch.setattr(_reader, "Reader", Probe)
    model2, opt2 = trained(seed=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert threads == [None] and os.POSIX_FADV_WILLNEED not in hints
    assert_same_tensors(model2.state_dict(), model.state_dict())
