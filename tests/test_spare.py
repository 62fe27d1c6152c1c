"""Spares (write/_spare): data files retention retired, written over by later saves instead of deleted; never one
someone still reads, never one a kept composite uses, each cut to its new file's size."""
import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import layerckpt
from layerckpt import _faults
from layerckpt.write import _spare

from conftest import assert_same_optimizer, assert_same_state, train_steps, trained


def _data(root):
    d = os.path.join(root, "data")
    return {n: os.stat(os.path.join(d, n)) for n in os.listdir(d)}


def _spares(root):
    d = os.path.join(root, _spare.SPARE_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _manifest(root, step):
    with open(os.path.join(root, "manifests", f"step-{step:08d}.json")) as f:
        return json.load(f)


def _restored(root, model, opt, step=None):
    m2, o2 = trained(seed=1, steps=1)
    layerckpt.restore(root, m2, o2, step=step)
    assert_same_state(model, m2)
    assert_same_optimizer(opt, o2)


@pytest.mark.parametrize("encoding", ["off", "delta"])
def test_a_retired_file_is_written_over_by_a_later_save(tmp_path, backend, encoding):
    model, opt = trained()
    inodes = {}
    cfg = layerckpt.Config(full=True, keep_last=2, encoding=encoding, delta_chain=1)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in range(1, 7):
            train_steps(model, opt, seed=step)
            ck.save(step).wait()
            files = _data(tmp_path)
            inodes[step] = files[f"step-{step:08d}.rank0.safetensors"].st_ino
            assert all(_spare.is_spare_name(n) for n in _spares(tmp_path))
            assert len(_spares(tmp_path)) <= _spare.MAX_SPARES
            kept = [int(n[5:13]) for n in os.listdir(tmp_path / "manifests")]
            assert set(files) == {f for s in kept for f in _manifest(tmp_path, s)["files"]}  # what they use, only
            m = _manifest(tmp_path, step)
            for name, f in m["files"].items():  # each file exactly as long as its manifest says
                assert files[name].st_size == f["size"], name
    assert len({inodes[1], inodes[2], inodes[3]}) == 3
    if encoding == "off":  # step 3's commit retired step 1's file (keep_last=2): step 4 went over its blocks...
        assert inodes[4] == inodes[1] and inodes[5] == inodes[2] and inodes[6] == inodes[3]
    else:  # (a delta's reference is kept while a kept composite reads it: the files retire later)
        assert all(inodes[s] in {inodes[t] for t in range(1, s)} for s in (5, 6))
    _restored(tmp_path, model, opt)
    out = subprocess.run([sys.executable, "-m", "layerckpt.cli", "verify", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("encoding", ["off", "delta"])  # a raw file image; an encoded file (4 KiB-aligned spans)
def test_a_smaller_file_written_over_a_larger_spare_is_cut_to_its_own_size(tmp_path, encoding):
    """A spare left by a larger model (a leftover of another run of the store): the save takes it, and its
    file ends where its own bytes do, the spare's tail gone."""
    os.makedirs(tmp_path / _spare.SPARE_DIR)
    big = 8 << 20
    with open(tmp_path / _spare.SPARE_DIR / "spare-0", "wb") as f:
        f.write(os.urandom(1 << 20) * 8)
    model, opt = trained()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(full=True, encoding=encoding)) as ck:
        ck.save(1).wait()
    files = _data(tmp_path)
    assert _spares(tmp_path) == []  # taken
    size = _manifest(tmp_path, 1)["files"]["step-00000001.rank0.safetensors"]["size"]
    assert files["step-00000001.rank0.safetensors"].st_size == size < big
    _restored(tmp_path, model, opt)


def test_a_file_someone_still_reads_is_not_written_over(tmp_path):
    """A reader that opened step 1's file before retention retired it keeps the bytes it opened: the file is
    never written over (its inode is no later save's file), the save that finds it open among the spares
    deletes it, and it reads back unchanged."""
    model, opt = trained()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=layerckpt.Config(full=True, keep_last=2)) as ck:
        for step in (1, 2):
            train_steps(model, opt, seed=step)
            ck.save(step).wait()
        path = tmp_path / "data" / "step-00000001.rank0.safetensors"
        fd = os.open(path, os.O_RDONLY)
        try:
            before = os.pread(fd, os.fstat(fd).st_size, 0)
            ino = os.fstat(fd).st_ino
            for step in range(3, 7):
                train_steps(model, opt, seed=step)
                ck.save(step).wait()
                assert ino not in {st.st_ino for st in _data(tmp_path).values()}
            spares = [os.stat(tmp_path / _spare.SPARE_DIR / n).st_ino for n in _spares(tmp_path)]
            assert ino not in spares  # found open by a save after it went there, and deleted
            assert os.pread(fd, len(before) + 1, 0) == before
        finally:
            os.close(fd)
    _restored(tmp_path, model, opt)


def test_a_save_that_fails_over_a_spare_leaves_the_committed_composites_whole(tmp_path):
    """A save writing over a spare fails after its file is durable, before its commit: every kept composite
    still restores bit for bit, and the next writer's open removes the torn file."""
    model, opt = trained()
    cfg = layerckpt.Config(full=True, keep_last=2)
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg) as ck:
        for step in (1, 2, 3):
            train_steps(model, opt, seed=step)
            ck.save(step).wait()
        want_model = {k: v.clone() for k, v in model.state_dict().items()}
        want_opt = copy.deepcopy(opt.state_dict())
        assert _spares(tmp_path)

        def fail():
            raise OSError(5, "injected")

        _faults.install("flush.written", fail)
        try:
            train_steps(model, opt, seed=4)
            with pytest.raises(layerckpt.CheckpointError):
                ck.save(4).wait()
        finally:
            _faults.remove("flush.written")
    for step in (2, 3):
        m2, o2 = trained(seed=1, steps=1)
        layerckpt.restore(tmp_path, m2, o2, step=step)
    m2, o2 = trained(seed=1, steps=1)
    layerckpt.restore(tmp_path, m2, o2)
    assert all(torch.equal(want_model[k], v) for k, v in m2.state_dict().items())
    assert o2.state_dict()["state"][0]["exp_avg"].equal(want_opt["state"][0]["exp_avg"])
    with layerckpt.Checkpointer(tmp_path, model, opt, config=cfg):
        assert "step-00000004.rank0.safetensors" not in _data(tmp_path)


def test_an_open_that_breaks_the_lease_neither_ends_the_process_nor_passes_for_alone(tmp_path, monkeypatch):
    """A reader opens the file while the lease is held (a reader racing retention): the lease break's signal
    (SIGIO by default, which ends a process) is one ignored by default, the reader's open goes through once the
    lease is given back, and the file does not count as no one else's."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    real = _spare.fcntl.fcntl
    readers = []

    def fcntl(fd, cmd, arg=0):
        if cmd == _spare._GETLEASE and not readers:  # the lease is held: a reader opens now, and blocks
            readers.append(subprocess.Popen([sys.executable, "-c", f"import os; os.open({str(path)!r}, os.O_RDONLY)"]))
            deadline = time.monotonic() + 10
            while real(fd, cmd) == _spare.fcntl.F_WRLCK and time.monotonic() < deadline:
                time.sleep(0.01)  # until the kernel has broken the lease
        return real(fd, cmd, arg)

    monkeypatch.setattr(_spare.fcntl, "fcntl", fcntl)
    fd = os.open(path, os.O_WRONLY)
    try:
        assert _spare._alone(fd) is False
    finally:
        os.close(fd)
    assert readers[0].wait(timeout=30) == 0


def _take_and_write(data, rank, n, size, out):
    """A rank's saves: take a spare for each new data file, write this rank's bytes through the descriptor,
    then read the file back by its name."""
    got = wrong = 0
    for k in range(n):
        path = os.path.join(data, f"step-{k:08d}.rank{rank}.safetensors")
        taken = _spare.take(path, size, False)
        if taken is None:
            continue
        fd, _ = taken
        mine = bytes([rank + 1]) * size
        os.pwrite(fd, mine, 0)
        os.close(fd)
        got += 1
        with open(path, "rb") as f:
            wrong += f.read() != mine
        os.unlink(path)
    out.put((got, wrong))


def _retire(data, n, size):
    """Rank 0's retention after each commit: a retired file moved into a free spare slot."""
    for k in range(n):
        p = os.path.join(data, f"step-{k:08d}.old.safetensors")
        with open(p, "wb") as f:
            f.write(b"\xee" * size)
        if not _spare.keep(p):
            os.unlink(p)


def test_ranks_taking_spares_while_retention_retires_files_write_into_the_file_they_name(tmp_path):
    """Several ranks share one store's spares while rank 0's retention refills the slots: each save's bytes land
    in the file its name holds.  (A take that opened the spare by name and renamed it after could move another
    file, retired in between, to its data file's name: about 1% of takes here, and committed files with
    another step's bytes in 16-rank runs.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    data = str(tmp_path / "data")
    os.makedirs(data)
    out = ctx.Queue()
    procs = [ctx.Process(target=_take_and_write, args=(data, r, 20000, 8192, out)) for r in range(4)]
    procs.append(ctx.Process(target=_retire, args=(data, 40000, 8192)))
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(4)]
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert sum(g for g, _ in results) > 100, results  # spares were taken while slots were refilled
    assert sum(w for _, w in results) == 0, results
