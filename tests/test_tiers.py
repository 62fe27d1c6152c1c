"""Tiers: the remote tier (a real S3-compatible server on loopback, memory://, file://) and the memory tier."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer, assert_same_state, assert_same_tensors, run_py, trained
from layerckpt import _faults
from layerckpt.tiers._memtier import memory_path

import fsspec  # noqa: F401

LAYERS, WIDTH = 6, 256
FULL = layerckpt.Config(threshold=0.0, keep_last=2)  # every layer at every save: restores equal the live model
SELECTIVE = layerckpt.Config(threshold=0.05, keep_last=2)  # only the layer a step moved is written


def _fs(url, options):
    import fsspec

    return fsspec.core.url_to_fs(url, **options)


def _remote_names(url, options, sub):
    fs, path = _fs(url, options)
    fs.invalidate_cache()
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{sub}", detail=False))
    except FileNotFoundError:
        return []


def _referenced(url, options):
    fs, path = _fs(url, options)
    out = set()
    for n in _remote_names(url, options, "manifests"):
        out |= set(json.loads(fs.cat_file(f"{path}/manifests/{n}"))["files"])
    return out


# ------------------------------------------------------------------ a model whose layers move one at a time

def stack() -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.fill_(i + 1)
            m.bias.fill_(-(i + 1))
    return model


def move(model: torch.nn.Module, step: int) -> None:
    """Step ``step`` changes one layer, so a selective save writes one layer and carries the rest."""
    with torch.no_grad():
        m = model[step % LAYERS]
        m.weight.fill_(step * 10 + step % LAYERS)
        m.bias.fill_(-step)


def at(step: int) -> torch.nn.Module:
    model = stack()
    for s in range(1, step + 1):
        move(model, s)
    return model


def _threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("layerckpt")]


# ------------------------------------------------------------------ remote tier

def test_local_dir_deleted_restores_from_remote(remote, tmp_path):
    url, options = remote
    root = tmp_path / "ck"
    model, opt = trained()
    cfg = FULL.replace(remote=url, remote_options=options)
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        for step in range(1, 5):
            with torch.no_grad():  # by hand, not through opt.step(): the previous save's copies must be over
                for p in model.parameters():
                    p.mul_(1.01)
            ck.save(step, extra={"step": step}).wait()
    assert _threads() == []
    shutil.rmtree(root)

    m2, _ = trained(seed=1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    r = layerckpt.restore(url, m2, o2, config=cfg)
    assert r.step == 4 and r.extra == {"step": 4} and r.manifest.startswith(url)
    assert_same_state(model, m2)
    assert_same_optimizer(opt, o2)
    # the local directory, gone, with the Config that names its remote: the same composite
    m3, _ = trained(seed=2)
    assert layerckpt.restore(root, m3, config=cfg).step == 4
    assert_same_state(model, m3)
    loaded = layerckpt.read_checkpoint(url, config=cfg)
    assert_same_tensors(loaded.model, model.state_dict())
    # a manifest URL names one composite (uploads that fell behind skip to the newest: step 3 may be absent)
    assert layerckpt.read_checkpoint(url + "/manifests/step-00000004.json", config=cfg).step == 4
    assert not os.path.exists(root), "a reader never recreates the local directory"


def test_a_pinned_composite_survives_the_remotes_retention_and_restores_from_it_alone(remote, tmp_path):
    """Checkpointer.keep() pins a composite on the remote tier too (LayerCheckpoint's save_top_k relies on it): past
    keep_last newer saves it stays there with every file it takes layers from, and restores bit for bit from the
    remote alone once the local directory is gone; once unpinned, the remote's next retention removes it."""
    url, options = remote
    root = tmp_path / "ck"
    model = stack()
    cfg = SELECTIVE.replace(remote=url, remote_options=options)  # keep_last=2; step 2 carries layers of step 1
    with layerckpt.Checkpointer(root, model, config=cfg) as ck:
        for step in (1, 2):
            move(model, step)
            ck.save(step).wait()
        ck.wait()  # step 2 is on the remote (uploads that fall behind skip to the newest)
        ck.keep([root / "manifests" / "step-00000002.json"])
        for step in range(3, 8):
            move(model, step)
            ck.save(step).wait()
            ck.wait()
        remote_manifests = _remote_names(url, options, "manifests")
        assert remote_manifests == ["step-00000002.json", "step-00000006.json", "step-00000007.json"], remote_manifests
        pinned_files = set(json.loads(_fs(url, options)[0].cat_file(
            f"{_fs(url, options)[1]}/manifests/step-00000002.json"))["files"])
        assert len(pinned_files) == 2 and pinned_files <= set(_remote_names(url, options, "data")), pinned_files
    shutil.rmtree(root)
    out = stack()
    assert layerckpt.restore(url + "/manifests/step-00000002.json", out, config=cfg).step == 2
    assert_same_state(out, at(2))
    # unpinned: the remote's next retention lets it go, with the files only it referenced
    root2 = tmp_path / "ck2"
    with layerckpt.Checkpointer(root2, model, config=cfg) as ck:
        ck.keep([])
        move(model, 8)
        ck.save(8).wait()
        ck.wait()
    assert "step-00000002.json" not in _remote_names(url, options, "manifests")
    assert set(_remote_names(url, options, "data")) == _referenced(url, options)


def test_remote_retention_follows_local_and_reuses_committed_files(s3, tmp_path):
    url, options = f"s3://{s3.bucket()}/run", s3.options
    root = tmp_path / "ck"
    model = stack()
    fs, path = _fs(url, options)
    fs.pipe_file(f"{path}/data/step-00000099.rank0.safetensors", b"left by an interrupted upload")
    cfg = SELECTIVE.replace(remote=url, remote_options=options)
    with layerckpt.Checkpointer(root, model, config=cfg) as ck:
        for step in range(1, 9):
            move(model, step)
            ck.save(step).wait()
            ck.wait()  # the remote copy too
            local_m = sorted(os.listdir(root / "manifests"))
            local_d = sorted(os.listdir(root / "data"))
            assert _remote_names(url, options, "manifests") == local_m
            assert _remote_names(url, options, "data") == local_d == sorted(_referenced(url, options))
    # every data object was put once: a composite's older files were reused, not uploaded again
    puts = [p for meth, p, q, *_ in s3.requests if meth == "PUT" and f"{path}/data/step-0000000" in p]
    assert len(puts) == len(set(puts)) == 8
    m2 = stack()
    shutil.rmtree(root)
    assert layerckpt.restore(url, m2, config=cfg).step == 8
    assert_same_state(at(8), m2)


KILLED = r"""
import json, os, sys, torch, layerckpt
sys.path.insert(0, sys.argv[5])
from test_tiers import SELECTIVE, move, stack
from layerckpt import _faults
root, url, options, kill_at = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
copies = [0]
def die():
    copies[0] += 1
    if copies[0] == kill_at:  # this composite's data is on the remote, its manifest not yet
        os.kill(os.getpid(), 9)
_faults.install("tier.data-copied", die)
model = stack()
ck = layerckpt.Checkpointer(root, model, config=SELECTIVE.replace(remote=url, remote_options=options,
                                                                 chunk_bytes="1MiB"))
for step in range(1, 10):
    move(model, step)
    ck.save(step).wait()
    print("LOCAL", step, flush=True)
    ck.wait()
    print("REMOTE", step, flush=True)
"""


def test_upload_killed_midway_keeps_previous_and_resumes_without_reuploading(s3, tmp_path):
    url, options = f"s3://{s3.bucket()}/run", s3.options
    root = str(tmp_path / "ck")
    p = subprocess.run([sys.executable, "-c", KILLED, root, url, json.dumps(options), "3",
                        os.path.dirname(__file__)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stdout.split() == ["LOCAL", "1", "REMOTE", "1", "LOCAL", "2", "REMOTE", "2", "LOCAL", "3"]
    _, path = _fs(url, options)
    assert f"/{path}/data/step-00000003.rank0.safetensors" in [x[1] for x in s3.requests], "killed before its data"

    # the remote's previous committed composite restores, bit for bit; the torn one is not believed
    cfg = SELECTIVE.replace(remote=url, remote_options=options)
    m = stack()
    assert layerckpt.restore(url, m, config=cfg).step == 2
    assert_same_state(at(2), m)

    # a resumed run copies the composite the killed one left behind, and only what the remote lacks
    s3.requests.clear()
    with layerckpt.Checkpointer(root, at(3), config=cfg) as ck:
        ck.wait()
    referenced = _referenced(url, options)
    assert referenced == {f"step-{s:08d}.rank0.safetensors" for s in (1, 2, 3)}
    assert s3.written(f"{path}/data/") == {"step-00000003.rank0.safetensors"}
    m = stack()
    assert layerckpt.restore(url, m, config=cfg).step == 3
    assert_same_state(at(3), m)


def test_large_files_go_up_in_parts(s3, tmp_path):
    url, options = f"s3://{s3.bucket()}/run", s3.options
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])  # a 12.6 MB file
    # parts of 5 MiB, S3's least; raw, so that the file is as big as the state
    cfg = FULL.replace(remote=url, remote_options=options, chunk_bytes="1MiB", encoding="off")
    with layerckpt.Checkpointer(tmp_path / "ck", model, config=cfg) as ck:
        ck.save(1)
    _, path = _fs(url, options)
    parts = [q for meth, p, q, *_ in s3.requests if meth == "PUT" and p.endswith("step-00000001.rank0.safetensors")]
    assert len(parts) == 3 and all("partNumber" in q for q in parts)
    m2 = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])
    layerckpt.restore(url, m2, config=cfg)
    assert_same_state(model, m2)


def test_failed_upload_is_retried_and_reported(tmp_path):
    url = f"memory://ckpt-{uuid.uuid4().hex[:12]}/run"
    model = stack()
    cfg = FULL.replace(remote=url)

    def broken():
        raise OSError(5, "injected upload failure")

    ck = layerckpt.Checkpointer(tmp_path / "ck", model, config=cfg)
    try:
        _faults.install("tier.file-copied", broken)
        move(model, 1)
        ck.save(1).wait()  # the local checkpoint commits whatever the remote does
        with pytest.raises(layerckpt.CheckpointWriteError, match="remote tier .* failed .*injected upload failure"):
            ck.wait()
        ck.wait()  # reported once
        _faults.remove("tier.file-copied")
        move(model, 2)
        ck.save(2).wait()
        ck.wait()
        _faults.install("tier.file-copied", broken)
        move(model, 3)
        ck.save(3).wait()
    finally:
        with pytest.raises(layerckpt.CheckpointWriteError, match="step 3 to the remote tier"):
            ck.close()  # waits for the copies; the last one failed
        _faults.remove("tier.file-copied")
    assert _threads() == []
    assert _remote_names(url, {}, "manifests") == ["step-00000002.json"]  # steps 1 and 3 never made it
    m = stack()
    assert layerckpt.restore(url, m).step == 2
    assert_same_state(at(2), m)
    m = stack()
    assert layerckpt.restore(tmp_path / "ck", m).step == 3  # the local tier is the newer


def test_remote_every_and_freshest_tier_wins(tmp_path):
    url = f"memory://ckpt-{uuid.uuid4().hex[:12]}/run"
    root = tmp_path / "ck"
    model = stack()
    cfg = FULL.replace(remote=url, remote_every=2, keep_last=0)
    with layerckpt.Checkpointer(root, model, config=cfg) as ck:
        for step in range(1, 7):
            move(model, step)
            ck.save(step).wait()
            ck.wait()
    assert _remote_names(url, {}, "manifests") == [f"step-{s:08d}.json" for s in (1, 3, 5)]
    # the local directory is newer than its remote: the local composite, not the remote's step 5
    m = stack()
    r = layerckpt.restore(root, m, config=cfg)
    assert r.step == 6 and r.manifest.startswith(str(root))
    old = tmp_path / "old"
    shutil.copytree(root, old)

    # a new run on another machine continues from the remote; the old directory must not shadow it
    shutil.rmtree(root)
    m = stack()
    assert layerckpt.restore(url, m).step == 5
    with layerckpt.Checkpointer(tmp_path / "new", m, config=cfg.replace(remote_every=1)) as ck:
        move(m, 7)
        ck.save(3)  # a lower step, and the same commit number as the old directory's step 6: still newer
    for where in (old, tmp_path / "new", url):
        m2 = stack()
        r = layerckpt.restore(where, m2, config=cfg)
        assert r.step == 3 and r.manifest.startswith(url if where == old else str(where)), where
        assert_same_state(m, m2)


def test_bad_remote_is_refused_up_front(s3, tmp_path):
    with pytest.raises(layerckpt.ConfigError, match="no protocol 'nosuch'"):
        layerckpt.Config(remote="nosuch://bucket/x")
    with pytest.raises(layerckpt.ConfigError, match="must be a URL"):
        layerckpt.Config(remote="/local/folder")
    with pytest.raises(layerckpt.ConfigError, match="names no bucket"):
        layerckpt.Config(remote="s3://")
    with pytest.raises(layerckpt.ConfigError, match="remote_options must map"):
        layerckpt.Config(remote="s3://b/x", remote_options=["key"])
    with pytest.raises(layerckpt.ConfigError, match="remote_options is set but Config.remote is not"):
        layerckpt.Config(remote_options={"key": "k"})
    with pytest.raises(layerckpt.ConfigError, match="remote_every must be >= 1"):
        layerckpt.Config(remote="memory://b/x", remote_every=0)
    missing = layerckpt.Config(remote="s3://no-such-bucket-here/run", remote_options=s3.options)
    with pytest.raises(layerckpt.CheckpointError, match="remote tier s3://no-such-bucket-here/run cannot be written"):
        layerckpt.Checkpointer(tmp_path / "ck", stack(), config=missing)
    assert _threads() == []
    layerckpt.Checkpointer(tmp_path / "ck", stack()).close()  # the refused one left no lock behind
    with pytest.raises(layerckpt.CheckpointError, match="is a URL"):
        layerckpt.Checkpointer("s3://bucket/run", stack())
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        layerckpt.restore(f"s3://{s3.bucket()}/empty", stack(), config=missing)


def test_cli_reads_urls(s3, tmp_path):
    from layerckpt.cli import main

    url, options = f"s3://{s3.bucket()}/run", s3.options
    model = stack()
    with layerckpt.Checkpointer(tmp_path / "ck", model, config=FULL.replace(remote=url, remote_options=options)) as ck:
        for step in (1, 2):
            move(model, step)
            ck.save(step)
    opts = ["--remote-options", json.dumps(options)]
    assert main(["inspect", url] + opts) == 0
    assert main(["verify", url] + opts) == 0
    out = tmp_path / "w.safetensors"
    assert main(["export", url + "/manifests/step-00000001.json", "-o", str(out)] + opts) == 0
    from safetensors.torch import load_file

    assert_same_tensors(load_file(out), at(1).state_dict())
    fs, path = _fs(url, options)
    fs.pipe_file(f"{path}/data/step-00000002.rank0.safetensors", b"\0" * 4096)
    assert main(["verify", url] + opts) == 1


# ------------------------------------------------------------------ memory tier

@pytest.fixture
def shm_root(tmp_path):
    root = tmp_path / "ck"
    yield root
    shutil.rmtree(memory_path(str(root)), ignore_errors=True)


CRASHED = r"""
import os, sys, layerckpt
sys.path.insert(0, sys.argv[2])
from test_tiers import FULL, move, stack
model = stack()
ck = layerckpt.Checkpointer(sys.argv[1], model, config=FULL.replace(memory_tier=True))
for step in range(1, 4):
    move(model, step)
    ck.save(step)
ck.wait()
os.kill(os.getpid(), 9)
"""


def test_memory_tier_after_a_crash_then_disk_when_gone_or_stale(shm_root):
    p = run_py(CRASHED, str(shm_root), os.path.dirname(__file__))
    assert p.returncode == -signal.SIGKILL, p.stderr
    mem = memory_path(str(shm_root))
    assert sorted(os.listdir(os.path.join(mem, "manifests"))) == ["step-00000003.json"]
    m = stack()
    mem_cfg = FULL.replace(memory_tier=True)  # only a Config that enables the memory tier reads it
    r = layerckpt.restore(shm_root, m, config=mem_cfg)
    assert r.step == 3
    assert_same_state(at(3), m)
    # read from memory, reported as the local composite (so adopt() can continue it)
    assert r.manifest == str(shm_root / "manifests" / "step-00000003.json")

    # stale: the memory tier lags a newer composite on disk
    shutil.copytree(mem, str(mem) + ".old")
    with layerckpt.Checkpointer(shm_root, m, config=FULL.replace(memory_tier=True)) as ck:
        move(m, 4)
        ck.save(4)
    shutil.rmtree(mem)
    os.rename(str(mem) + ".old", mem)
    m2 = stack()
    r = layerckpt.restore(shm_root, m2, config=mem_cfg)
    assert r.step == 4 and r.manifest == str(shm_root / "manifests" / "step-00000004.json")
    assert_same_state(m, m2)
    # gone (a node restart): the disk
    shutil.rmtree(mem)
    m3 = stack()
    assert layerckpt.restore(shm_root, m3, config=mem_cfg).step == 4
    assert_same_state(m, m3)
    # a writer without the memory tier drops a stale one rather than let it shadow its saves
    layerckpt.Checkpointer(shm_root, m, config=FULL.replace(memory_tier=True)).close()
    assert os.path.isdir(mem)
    layerckpt.Checkpointer(shm_root, m).close()
    assert not os.path.exists(mem)


def test_memory_tier_holds_the_newest_composite_only(shm_root):
    model = stack()
    with layerckpt.Checkpointer(shm_root, model, config=SELECTIVE.replace(memory_tier=True)) as ck:
        for step in range(1, 8):
            move(model, step)
            ck.save(step)
    mem = memory_path(str(shm_root))
    names = json.loads(open(os.path.join(mem, "manifests", "step-00000007.json")).read())["files"]
    assert sorted(os.listdir(os.path.join(mem, "manifests"))) == ["step-00000007.json"]
    assert sorted(os.listdir(os.path.join(mem, "data"))) == sorted(names)
    m = stack()
    r = layerckpt.restore(shm_root, m, config=SELECTIVE.replace(memory_tier=True))
    assert r.step == 7
    assert_same_state(model, m)


def _uploads(monkeypatch):
    """The files the memory tier copied (LocalStore.put_file) and the remote uploaded (FsspecStore.put_file)."""
    from layerckpt.tiers import _remote

    seen = {"memory": [], "remote": []}
    for kind, cls in (("memory", _remote.LocalStore), ("remote", _remote.FsspecStore)):
        def put(self, src, sub, name, _put=cls.put_file, _kind=kind):
            _put(self, src, sub, name)  # (one that failed: a copy in memory removed meanwhile, the next tried)
            seen[_kind].append(src)

        monkeypatch.setattr(cls, "put_file", put)
    return seen


def _restores_from_each_tier(shm_root, url, cfg, model, step):
    m = stack()
    assert layerckpt.restore(shm_root, m, config=cfg).step == step  # the memory tier's
    assert_same_state(model, m)
    shutil.rmtree(shm_root)
    shutil.rmtree(memory_path(str(shm_root)))
    m = stack()
    assert layerckpt.restore(url, m).step == step  # the remote's alone
    assert_same_state(model, m)


@pytest.mark.parametrize("links", [True, False])
def test_the_tiers_take_each_file_from_its_copy_in_memory_not_from_the_disk(shm_root, tmp_path, monkeypatch, links):
    """The flusher copies each file it writes into the memory tier's folder from the staging buffers: the
    memory tier links that copy into place (or copies it, where its file system links no file) and the remote
    uploads from memory; neither reads the disk."""
    if not links:
        def link(*a):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", link)
    seen = _uploads(monkeypatch)
    url = "file://" + str(tmp_path / "remote")
    cfg = SELECTIVE.replace(memory_tier=True, remote=url, encoding="off")
    model = stack()
    with layerckpt.Checkpointer(shm_root, model, config=cfg) as ck:
        for step in range(1, 8):
            move(model, step)
            ck.save(step).wait()
            ck.wait()
    mem = memory_path(str(shm_root))
    incoming = os.path.join(mem, "incoming") + os.sep
    if links:
        assert seen["memory"] == []  # nothing copied into the memory tier: every file linked there
    else:
        assert len(seen["memory"]) == 7 and all(src.startswith(incoming) for src in seen["memory"]), seen
    assert len(seen["remote"]) == 7 and all(src.startswith(mem + os.sep) for src in seen["remote"]), seen["remote"]
    assert os.listdir(os.path.join(mem, "incoming")) == []  # every staged copy taken or swept
    for n in os.listdir(os.path.join(mem, "data")):  # byte for byte the files on the disk
        with open(os.path.join(mem, "data", n), "rb") as a, open(shm_root / "data" / n, "rb") as b:
            assert a.read() == b.read(), n
    _restores_from_each_tier(shm_root, url, cfg, model, 7)


def test_without_a_copy_in_memory_the_tiers_read_the_disk(shm_root, tmp_path, monkeypatch):
    """/dev/shm full while the flusher copies: the copy is dropped (no save fails) and the tiers copy from the
    disk as they would without it; an earlier process's staged copies are not trusted."""
    import types

    from layerckpt.write import _writeloop

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_writeloop, "os", types.SimpleNamespace(**{**vars(os), "pwrite": full}))
    seen = _uploads(monkeypatch)
    mem = memory_path(str(shm_root))
    os.makedirs(os.path.join(mem, "incoming"))
    with open(os.path.join(mem, "incoming", "step-00000001.rank0.safetensors"), "wb") as f:
        f.write(b"an earlier process's")
    url = "file://" + str(tmp_path / "remote")
    cfg = SELECTIVE.replace(memory_tier=True, remote=url, encoding="off")
    model = stack()
    with layerckpt.Checkpointer(shm_root, model, config=cfg) as ck:
        assert os.listdir(os.path.join(mem, "incoming")) == []
        for step in range(1, 4):
            move(model, step)
            ck.save(step).wait()
            ck.wait()
    disk = str(shm_root / "data") + os.sep
    assert len(seen["memory"]) == 3 and all(src.startswith(disk) for src in seen["memory"]), seen
    # the remote reads the disk, or the memory tier's copy of it once there
    assert len(seen["remote"]) == 3 and all(src.startswith((disk, os.path.join(mem, "data") + os.sep))
                                            for src in seen["remote"]), seen
    assert os.listdir(os.path.join(mem, "incoming")) == []  # no part left behind
    _restores_from_each_tier(shm_root, url, cfg, model, 3)


# ------------------------------------------------------------------ bandwidth cap, bases only

def test_bandwidth_cap_is_shared_by_concurrent_uploads(s3, tmp_path):
    """Four uploads at once under one cap: together they take at least bytes / cap, and arrive whole."""
    from concurrent.futures import ThreadPoolExecutor

    from layerckpt.tiers._remote import CAPPED_BURST, FsspecStore

    cap, size = 2_000_000, 400_000
    url, options = f"s3://{s3.bucket()}/run", s3.options
    store = FsspecStore(url, options, bandwidth=cap)
    store.prepare()
    payloads = {}
    for i in range(4):
        payloads[f"f{i}"] = os.urandom(size)
        (tmp_path / f"f{i}").write_bytes(payloads[f"f{i}"])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        for fut in [ex.submit(store.put_file, str(tmp_path / n), "data", n) for n in payloads]:
            fut.result()
    elapsed = time.perf_counter() - t0
    # 0.8 s at the cap, less the 64 KiB an idle bucket lets through at once; uncapped, loopback takes ~0.05 s
    assert elapsed >= (4 * size - CAPPED_BURST) / cap - 0.02, elapsed
    for n, data in payloads.items():
        assert store.read("data", n) == data


def test_bandwidth_cap_on_the_remote_tier(s3, tmp_path):
    url, options = f"s3://{s3.bucket()}/run", s3.options
    cap = 3_000_000
    model = stack()
    cfg = FULL.replace(remote=url, remote_options=options, remote_bandwidth="3MB/s", encoding="off")  # raw: MBs
    assert cfg.remote_bandwidth == cap
    with layerckpt.Checkpointer(tmp_path / "ck", model, config=cfg) as ck:
        move(model, 1)
        t0 = time.perf_counter()
        ck.save(1).wait()
        ck.wait()  # durable on the remote tier
        elapsed = time.perf_counter() - t0
    sent = sum(os.path.getsize(tmp_path / "ck" / "data" / n) for n in os.listdir(tmp_path / "ck" / "data"))
    assert sent > 1_500_000
    assert elapsed >= (sent - (64 << 10)) / cap - 0.02, (elapsed, sent)  # less what an idle bucket lets through
    shutil.rmtree(tmp_path / "ck")
    m = stack()
    assert layerckpt.restore(url, m, config=cfg).step == 1
    assert_same_state(at(1), m)


def test_bandwidth_and_bases_config_errors():
    assert layerckpt.Config(remote="memory://b/x", remote_bandwidth="200MB").remote_bandwidth == 200_000_000
    assert layerckpt.Config(remote="memory://b/x", remote_bandwidth="1GiB/s").remote_bandwidth == 1 << 30
    assert layerckpt.Config(remote="memory://b/x", remote_bandwidth=5000).remote_bandwidth == 5000
    for bad in ("fast", 0, -3, True, "12 parsecs"):
        with pytest.raises(layerckpt.ConfigError, match=r"Config.remote_bandwidth must be bytes per second "
                                                        r"such as '200MB'.*got " + re.escape(repr(bad))):
            layerckpt.Config(remote="memory://b/x", remote_bandwidth=bad)
    with pytest.raises(layerckpt.ConfigError, match="remote_bandwidth caps uploads .* Config.remote is not set"):
        layerckpt.Config(remote_bandwidth="1MB")
    with pytest.raises(layerckpt.ConfigError, match=r"remote_every must be a positive integer .* or 'base' "
                                                    r"\(base composites only\), got 'bases'"):
        layerckpt.Config(remote="memory://b/x", remote_every="bases")
    with pytest.raises(layerckpt.ConfigError, match="with base_every=0 only the first save is one; set base_every=N"):
        layerckpt.Config(remote="memory://b/x", remote_every="base")
    assert layerckpt.Config(remote="memory://b/x", remote_every="base", base_every=4).remote_every == "base"
    assert layerckpt.Config(remote="memory://b/x", remote_every="base", threshold=0.0).remote_every == "base"


def test_remote_gets_base_composites_only(s3, tmp_path):
    url, options = f"s3://{s3.bucket()}/run", s3.options
    root = tmp_path / "ck"
    model = stack()
    # a base every third save: steps 1, 4 and 7; the saves between write one layer each
    cfg = SELECTIVE.replace(remote=url, remote_options=options, remote_every="base", base_every=3, keep_last=0)
    with layerckpt.Checkpointer(root, model, config=cfg) as ck:
        for step in range(1, 9):
            move(model, step)
            ck.save(step).wait()
            ck.wait()
    local = [json.loads((root / "manifests" / n).read_text()) for n in sorted(os.listdir(root / "manifests"))]
    assert [len(m["files"]) for m in local] == [1, 2, 3, 1, 2, 3, 1, 2]  # selective composites carry older files
    assert _remote_names(url, options, "manifests") == [f"step-{s:08d}.json" for s in (1, 4, 7)]
    _, path = _fs(url, options)
    assert s3.written(f"{path}/data/") == {f"step-{s:08d}.rank0.safetensors" for s in (1, 4, 7)}
    shutil.rmtree(root)
    for step in (4, 7):
        m = stack()
        r = layerckpt.restore(f"{url}/manifests/step-{step:08d}.json", m, config=cfg)
        assert r.step == step and set(r.layers.values()) == {step}
        assert_same_state(at(step), m)
    m = stack()
    assert layerckpt.restore(url, m, config=cfg).step == 7
    assert_same_state(at(7), m)


def test_a_torn_reupload_to_a_file_remote_leaves_the_remote_file_whole(tmp_path, monkeypatch):
    """file:// puts truncate, then write: a put killed midway through a file the remote already holds (a node's
    catch-up after a restart) must leave the committed copy whole, so a put goes to a name of its own first."""
    from layerckpt.tiers._remote import FsspecStore

    os.makedirs(tmp_path / "remote" / "data")  # as the tier's opening makes it
    store = FsspecStore(f"file://{tmp_path / 'remote'}")
    src = tmp_path / "f.safetensors"
    src.write_bytes(b"x" * 4096)
    store.put_file(str(src), "data", "f.safetensors")
    before = (tmp_path / "remote" / "data" / "f.safetensors").read_bytes()

    def torn(a, b, **kw):  # the put dies after truncating its destination
        open(b, "wb").close()
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(store.fs, "put_file", torn)
    with pytest.raises(KeyboardInterrupt):
        store.put_file(str(src), "data", "f.safetensors")
    assert (tmp_path / "remote" / "data" / "f.safetensors").read_bytes() == before
