"""One writer per store, one commit point, no hang on any failure in the flusher, nothing left behind."""
import gc
import logging
import os
import threading
import time

import pytest
import torch

import layerckpt
from layerckpt import _faults
from conftest import small_model
from test_cli import cli

FULL = layerckpt.Config(threshold=0.0, keep_last=0)


def _flushers():
    return [t for t in threading.enumerate() if t.name == "layerckpt-flusher" and t.is_alive()]


HOLDER = r"""
import sys, time, torch, layerckpt
from layerckpt import _faults
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
with torch.no_grad():
    for p in model.parameters():
        p.fill_(3.0)
gate = sys.argv[2]
def hold():  # the data file is durable, the ranks have not agreed yet: a save in flight
    print("FLUSHING", flush=True)
    while not __import__("os").path.exists(gate):
        time.sleep(0.01)
_faults.install("flush.written", hold)
ck = layerckpt.Checkpointer(sys.argv[1], model, config=layerckpt.Config(threshold=0.0))
ck.save(1).wait()
ck.close()
print("COMMITTED", flush=True)
"""


# a second opener while a save is in flight, from another live process: tests/test_takeover.py


@pytest.mark.parametrize("error", [RuntimeError("injected"), MemoryError()])
def test_any_exception_in_the_flusher_fails_that_save_and_nothing_hangs(tmp_path, error):
    model = small_model()
    cfg = FULL.replace(chunk_bytes="64KiB", staging_bytes="128KiB")  # a save needs every buffer back
    with layerckpt.Checkpointer(tmp_path, model, config=cfg) as ck:
        ck.save(1).wait()

        def boom():
            raise error
        _faults.install("flush.checksum", boom)
        try:
            with pytest.raises(type(error)):
                ck.save(2).wait(timeout=60)
        finally:
            _faults.remove("flush.checksum")
        assert sorted(os.listdir(tmp_path / "manifests")) == ["step-00000001.json"]
        assert len(ck.pool._free) == len(ck.pool.chunks)  # every buffer came back
        ck.save(3).wait(timeout=60)  # the next save neither blocks nor fails
    assert layerckpt.restore(tmp_path, small_model()).step == 3


def test_latest_is_a_hint_never_a_commit_point(tmp_path, caplog):
    model = small_model()
    with layerckpt.Checkpointer(tmp_path, model, config=FULL) as ck:
        ck.save(1).wait()
        ck.save(2).wait()
    (tmp_path / "latest").write_text("step-00000001.json\n")  # a crash between the manifest and `latest`
    assert layerckpt.restore(tmp_path, small_model()).step == 2
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # `latest` cannot be replaced: the save is committed all the same
    with caplog.at_level(logging.WARNING, logger="layerckpt"):
        with layerckpt.Checkpointer(tmp_path, model, config=FULL) as ck:
            p = ck.save(3).wait()
    assert p.error is None and "step 3 is committed, but" in caplog.text
    assert layerckpt.restore(tmp_path, small_model()).step == 3


def test_a_dropped_checkpointer_leaves_no_thread_and_no_lock(tmp_path):
    before = set(_flushers())
    ck = layerckpt.Checkpointer(tmp_path, small_model(), config=FULL)
    ck.save(1)  # still flushing when the last reference goes
    mine = set(_flushers()) - before
    assert len(mine) == 1
    del ck
    gc.collect()
    deadline = time.time() + 30
    while any(t.is_alive() for t in mine) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in mine)
    assert layerckpt.restore(tmp_path, small_model()).step == 1  # the flush in flight finished first
    layerckpt.Checkpointer(tmp_path, small_model()).close()  # and the lock went


def test_cli_refuses_what_it_cannot_check_and_takes_a_manifest_path(tmp_path):
    for where in (tmp_path / "missing", tmp_path):  # missing, and a directory with no checkpoint
        r = cli("verify", where)
        assert r.returncode == 2 and "0 of 0" not in r.stdout, r.stdout
        assert "does not exist" in r.stderr or "not a layerckpt checkpoint" in r.stderr
    (tmp_path / "manifests").mkdir()
    r = cli("verify", tmp_path)
    assert r.returncode == 2 and "no committed checkpoint" in r.stderr
    with layerckpt.Checkpointer(tmp_path / "ck", small_model(), config=FULL) as ck:
        ck.save(1).wait()
        ck.save(2).wait()
    r = cli("inspect", tmp_path / "ck" / "manifests" / "step-00000001.json")
    assert r.returncode == 0 and "step 1, world size 1" in r.stdout, r.stderr
    r = cli("export", tmp_path / "ck", "-o", tmp_path / "nowhere" / "x.safetensors")
    assert r.returncode == 2 and "the directory" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_optimizer_of_another_class_is_refused_naming_both(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=FULL) as ck:
        ck.save(1).wait()
    other = small_model()
    with pytest.raises(layerckpt.CheckpointMismatchError,
                       match=r"class: checkpoint torch\.optim\.adamw\.AdamW, optimizer torch\.optim\.sgd\.SGD"):
        layerckpt.restore(tmp_path, other, torch.optim.SGD(other.parameters(), lr=0.1))


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/p", "file:///tmp/x"])
def test_a_url_is_never_taken_for_a_local_folder(tmp_path, url, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials here: fail at once
    with pytest.raises(layerckpt.CheckpointError, match=r"is a URL: layerckpt writes to a local directory; .*"
                                                        r"Config\(remote=\.\.\.\)"):
        layerckpt.Checkpointer(url, small_model())
    with pytest.raises(layerckpt.CheckpointError):  # read as a remote store (test_tiers), which holds nothing here
        layerckpt.restore(url, small_model())
    assert os.listdir(tmp_path) == []


def test_reading_right_after_a_save_waits_for_its_flush(tmp_path):
    """Read your writes: restore / read_checkpoint of a directory this process is still flushing into."""
    model = small_model(1)
    _faults.install("flush.written", lambda: time.sleep(0.5))  # the save is still flushing when we read
    try:
        ck = layerckpt.Checkpointer(tmp_path, model, config=FULL)
        ck.save(7)
        out = small_model(2)
        assert layerckpt.restore(tmp_path, out).step == 7
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), out.state_dict().values()))
        ck.save(8)
        assert layerckpt.read_checkpoint(tmp_path).step == 8
        ck.close()
    finally:
        _faults.remove("flush.written")


def test_a_directory_removed_under_a_flush_drops_that_save_quietly(tmp_path, caplog):
    import shutil

    root = tmp_path / "run"
    ck = layerckpt.Checkpointer(root, small_model(), config=FULL)
    ck.save(1).wait()
    _faults.install("flush.checksum", lambda: shutil.rmtree(root, ignore_errors=True))  # the user removes it
    try:
        with caplog.at_level(logging.INFO, logger="layerckpt"):
            p = ck.save(2).wait(timeout=60)  # no error: there is nothing left to commit into
    finally:
        _faults.remove("flush.checksum")
    assert p.cancelled and p.error is None and "was removed while step 2 was flushing" in caplog.text
    ck.close()
    assert not root.exists()  # nothing in the background recreated it


def test_a_checkpointer_that_fails_to_start_leaves_the_store_free(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERCKPT_BACKEND", "nonsense")
    with pytest.raises(layerckpt.ConfigError, match="LAYERCKPT_BACKEND"):
        layerckpt.Checkpointer(tmp_path, small_model())
    monkeypatch.delenv("LAYERCKPT_BACKEND")
    layerckpt.Checkpointer(tmp_path, small_model()).close()  # not "already has a writer"
