"""Hostile and damaged tiers: every read of every tier ends, bounded in time and size, with the genuine tensors
or the library's own error naming what is wrong.  A genuine store with a ``file://`` remote (and one on a
loopback S3 server) gets, planted: a FIFO among the remote's manifests or as its ``.store-id``, a huge sparse
manifest, a remote data file far bigger than its manifest says, ``data/`` and ``manifests/`` linked to a folder
elsewhere (local store and remote), a file that is a link to itself, a 300-character file name, ``data`` a
plain file, a tensor's entry rolled back to an older step's (local store and remote)."""
import functools
import io
import json
import os
import shutil
import sys
import tracemalloc

import pytest
import torch

import layerckpt
from layerckpt.tiers._remote import FsspecStore
from layerckpt.errors import CheckpointCorruptError, CheckpointError

import fsspec  # noqa: F401
sys.path.insert(0, os.path.dirname(__file__))
import test_hostile as hostile  # noqa: E402
from test_hostile import expected, fill, tiny  # noqa: E402

TIMEOUT = 30.0
STEP2 = "step-00000002.json"
HUGE = 600 << 20  # a sparse file: no disk is spent on it


def save_two(root, config: layerckpt.Config) -> None:
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=config) as ck:
        for step in (1, 2):
            fill(model, step)
            ck.save(step).wait()


# the hostile-store helpers of test_hostile, with this file's longer bound (a remote read takes more steps)
in_time = functools.partial(hostile.in_time, timeout=TIMEOUT)


def verify(target, *extra) -> tuple:
    return hostile.verify(target, *extra, timeout=TIMEOUT)


class Store:
    """A genuine store (steps 1 and 2) at ``root`` with its ``file://`` remote at ``remote``."""

    def __init__(self, base):
        self.base = base
        self.root = base / "ck"
        self.remote = base / "remote"
        self.url = "file://" + str(self.remote)
        self.cfg = layerckpt.Config(full=True, keep_last=0, remote=self.url)

    def restore(self, target=None, **kw):
        """restore() of ``target`` (the local root by default) into a fresh model, within the bound."""
        m = tiny()
        r = in_time(layerckpt.restore, str(target or self.root), m, config=self.cfg, **kw)
        return r, m.state_dict()

    def remote_file(self, step: int = 2) -> str:
        """The remote data file the remote's manifest of ``step`` references."""
        d = json.loads((self.remote / "manifests" / f"step-{step:08d}.json").read_text())
        (name,) = d["files"]
        return name

    def without_local(self) -> "Store":
        shutil.rmtree(self.root)
        return self


def same(got: dict, step: int) -> None:
    want = expected(step)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def refused(call, *needles, kind=CheckpointCorruptError):
    with pytest.raises(kind) as e:
        call()
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return e.value


def link_away(folder) -> str:
    """Move ``folder`` elsewhere and leave a symbolic link to it in its place; returns where it went."""
    away = folder.parent.parent / ("elsewhere-" + folder.parent.name + "-" + folder.name)
    shutil.move(str(folder), str(away))
    os.symlink(away, folder)
    return str(away)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("pristine")
    s = Store(base)
    save_two(s.root, s.cfg)
    return base


@pytest.fixture
def st(pristine, tmp_path):
    for sub in ("ck", "remote"):
        shutil.copytree(pristine / sub, tmp_path / sub, symlinks=True)
    return Store(tmp_path)


# -- the store as saved reads back, through every path, also when its root is a link the user chose ----------

def test_the_genuine_store_restores_from_each_tier_and_through_a_linked_root(st, tmp_path):
    same(st.restore()[1], 2)
    same(st.restore(st.url)[1], 2)
    os.symlink(st.root, tmp_path / "chosen")
    os.symlink(st.remote, tmp_path / "chosen-remote")
    same(st.restore(tmp_path / "chosen", step=1)[1], 1)
    r, got = st.restore("file://" + str(tmp_path / "chosen-remote"))
    assert r.step == 2
    same(got, 2)
    assert verify("file://" + str(tmp_path / "chosen-remote"))[0] == 0


# -- 1: hangs on the remote tier --------------------------------------------------------------------------------

def test_a_fifo_among_the_remote_manifests_is_refused_without_hanging(st):
    os.mkfifo(st.remote / "manifests" / "step-00000003.json")
    # the local store is the fresher tier's equal: it restores, the remote's FIFO never opened for a wait
    same(st.restore()[1], 2)
    in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg).close()  # its tier opens: no hang
    st.without_local()
    for target in (st.root, st.url):
        refused(lambda: st.restore(target), "step-00000003.json", "not a regular file (a FIFO)",
                "newer than the newest readable one")
    rc, text = verify(st.url)
    assert rc == 1 and "a FIFO" in text and "Traceback" not in text, text


def test_a_fifo_as_the_remote_store_id_is_refused_without_hanging(st, caplog):
    os.remove(st.remote / ".store-id")
    os.mkfifo(st.remote / ".store-id")
    same(st.restore()[1], 2)  # the tier is not trusted: the local store is read
    assert "not a regular file (a FIFO)" in caplog.text
    e = refused(lambda: in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg),
                "has a store identity that cannot be read", ".store-id", "a FIFO", kind=CheckpointError)
    assert str(st.root / ".store-id") in str(e)  # the fix: a copy of the store's own
    same(st.restore(st.url)[1], 2)  # a URL restore asks no identity


def test_verify_of_a_url_reports_each_unreadable_manifest_and_checks_the_others(st):
    """Like a local store's verify: every damaged manifest named with what is wrong, every other one checked."""
    manifests = st.remote / "manifests"
    os.mkfifo(manifests / "step-00000003.json")
    with open(manifests / "step-00000004.json", "wb") as f:
        f.truncate(HUGE)
    (manifests / "step-00000005.json").write_text('{"format": "layerckpt", "version"')  # truncated JSON
    rc, text = verify(st.url)
    assert rc == 1 and "Traceback" not in text, text
    fails = [line for line in text.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 3, text
    assert "step-00000003.json" in fails[0] and "not a regular file (a FIFO)" in fails[0], text
    assert "step-00000004.json" in fails[1] and f"holds {HUGE} bytes" in fails[1], text
    assert "step-00000005.json" in fails[2], text
    assert "2 of 5 checkpoint(s) verified, 3 failed" in text, text
    rc, text = verify(st.root)  # the local store: the same checks, none of them damaged
    assert rc == 0 and "2 of 2 checkpoint(s) verified" in text, text


def test_verify_of_a_url_checks_the_others_past_a_damaged_data_file(st):
    name = st.remote_file(2)
    with open(st.remote / "data" / name, "r+b") as f:
        f.seek(os.path.getsize(st.remote / "data" / name) - 8)
        f.write(b"\xff" * 8)
    rc, text = verify(st.url)
    assert rc == 1 and "Traceback" not in text and "1 of 2 checkpoint(s) verified, 1 failed" in text, text
    assert f"FAIL {STEP2}" in text and name in text, text


# -- 2: reads bounded in size ----------------------------------------------------------------------------------

def test_a_huge_remote_manifest_is_refused_by_its_size_before_any_of_it_is_read(st):
    with open(st.remote / "manifests" / "step-00000003.json", "wb") as f:
        f.truncate(HUGE)
    st.without_local()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        refused(lambda: st.restore(st.url), "step-00000003.json", f"holds {HUGE} bytes, more than the 256 MiB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak} bytes held while refusing it"
    rc, text = verify(st.url)
    assert rc == 1 and f"holds {HUGE} bytes" in text and "Traceback" not in text, text


def test_a_remote_data_file_bigger_than_its_manifest_says_is_refused_before_copying(st):
    name = st.remote_file()
    path = st.remote / "data" / name
    recorded = path.stat().st_size
    os.truncate(path, HUGE)
    st.without_local()
    refused(lambda: st.restore(st.url), name, f"holds {HUGE} bytes, more than the {recorded} bytes its manifest "
                                              f"records")
    same(st.restore(st.url, step=1)[1], 1)  # the other composite's files are whole
    rc, text = verify(st.url)
    assert rc == 1 and f"holds {HUGE} bytes" in text and "Traceback" not in text, text


def test_a_copy_that_brings_more_than_its_cap_is_refused_and_deleted(tmp_path):
    from layerckpt.tiers._remote import copy_capped

    dst = tmp_path / "copy"
    refused(lambda: copy_capped(io.BytesIO(b"x" * 100_000).read, str(dst), 1000, "memory://b/data/f"),
            "memory://b/data/f holds more bytes, more than the 1000 bytes its manifest records")
    assert not dst.exists()
    assert copy_capped(io.BytesIO(b"y" * 1000).read, str(dst), 1000, "w") == 1000 and dst.read_bytes() == b"y" * 1000


def test_any_file_system_asks_the_size_first(tmp_path):
    tier = FsspecStore(f"memory://hostile-{tmp_path.name}/run")
    tier.fs.pipe_file(tier._path("data", "f"), b"z" * 5000)
    tier.fs.pipe_file(tier._path("", ".store-id"), b"a" * 5000)
    refused(lambda: tier.get_file("data", "f", str(tmp_path / "f"), 4000),
            "holds 5000 bytes, more than the 4000 bytes its manifest records")
    assert not (tmp_path / "f").exists()
    refused(lambda: tier.read("", ".store-id", "store identity", 4096),
            "holds 5000 bytes, more than the 4096 bytes a store identity may hold")
    tier.get_file("data", "f", str(tmp_path / "f"), 5000)
    assert (tmp_path / "f").read_bytes() == b"z" * 5000


@pytest.mark.parametrize("where", ["ck", "remote"])
def test_an_oversized_store_id_says_its_cap_in_bytes(st, where):
    (st.base / where / ".store-id").write_bytes(b"0" * 5000)
    refused(lambda: in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg), str(st.base / where),
            "holds 5000 bytes, more than the 4096 bytes a store identity may hold", kind=CheckpointError)


# -- 4: no read leaves the store through a linked folder -------------------------------------------------------

@pytest.mark.parametrize("sub", ["data", "manifests"])
def test_a_local_store_folder_linked_elsewhere_is_refused(st, sub):
    link_away(st.root / sub)
    needles = (str(st.root / sub), "is a symbolic link", "replace the link by the folder")
    refused(lambda: st.restore(), *needles)
    refused(lambda: in_time(layerckpt.read_checkpoint, st.root), *needles)
    rc, text = verify(st.root)
    assert rc == 1 and all(n in text for n in needles) and "Traceback" not in text, text
    refused(lambda: in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg), *needles, kind=CheckpointError)


@pytest.mark.parametrize("sub", ["data", "manifests"])
def test_a_remote_folder_linked_elsewhere_is_refused(st, sub):
    link_away(st.remote / sub)
    needles = (str(st.remote / sub), "is a symbolic link")
    refused(lambda: in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg), *needles, kind=CheckpointError)
    st.without_local()
    for target in (st.root, st.url):
        refused(lambda: st.restore(target), *needles)
    rc, text = verify(st.url)
    assert rc == 1 and all(n in text for n in needles) and "Traceback" not in text, text


# -- 6: what the OS says becomes the library's error -----------------------------------------------------------

def test_a_data_file_that_is_a_link_to_itself_is_refused(st):
    local = st.root / "data" / "step-00000002.rank0.safetensors"
    os.remove(local)
    os.symlink(local, local)
    refused(lambda: st.restore(), str(local), "symbolic link")
    rc, text = verify(st.root)
    assert rc == 1 and "symbolic link" in text and "Traceback" not in text, text
    remote = st.remote / "data" / st.remote_file()
    os.remove(remote)
    os.symlink(remote, remote)
    st.without_local()
    refused(lambda: st.restore(st.url), str(remote), "symbolic link")


def _name_it(manifest, name: str) -> None:
    d = json.loads(manifest.read_text())
    (old,) = d["files"]
    d["files"] = {name: d["files"][old]}
    for t in d["tensors"].values():
        t["file"] = name
    for e in d["layers"].values():
        if e.get("file"):
            e["file"] = name
    manifest.write_text(json.dumps(d))


def test_a_300_character_file_name_is_refused(st):
    name = "x" * 300
    _name_it(st.root / "manifests" / STEP2, name)
    refused(lambda: st.restore(), STEP2, "a file of 300 characters", "longer than a file name may be")
    rc, text = verify(st.root)
    assert rc == 1 and "300 characters" in text and "Traceback" not in text, text
    _name_it(st.remote / "manifests" / STEP2, name)
    st.without_local()
    refused(lambda: st.restore(st.url), STEP2, "a file of 300 characters")


def test_data_as_a_plain_file_is_refused(st):
    shutil.rmtree(st.root / "data")
    (st.root / "data").write_bytes(b"not a folder")
    needles = (str(st.root / "data"), "is a regular file, not a directory")
    refused(lambda: st.restore(), *needles)
    rc, text = verify(st.root)
    assert rc == 1 and all(n in text for n in needles) and "Traceback" not in text, text
    refused(lambda: in_time(layerckpt.Checkpointer, st.root, tiny(), config=st.cfg), *needles, kind=CheckpointError)
    shutil.rmtree(st.remote / "data")
    (st.remote / "data").write_bytes(b"not a folder")
    st.without_local()
    refused(lambda: st.restore(st.url), str(st.remote / "data"), "is a regular file, not a directory")


# -- 3: another version's bytes, silently ------------------------------------------------------------------------

def _rolled_back(manifests) -> str:
    """The step-2 manifest in ``manifests`` given one model tensor's own entry of step 1 (its file listed too), its
    sealed checksum matching the bytes it reads, while the manifest still records that tensor's layer at step 2."""
    old = json.loads((manifests / "step-00000001.json").read_text())
    d = json.loads((manifests / STEP2).read_text())
    key = next(k for k in d["tensors"] if k.startswith("model/"))
    d["tensors"][key] = old["tensors"][key]
    d["files"].update(old["files"])
    (manifests / STEP2).write_text(json.dumps(d))
    return key


def test_a_tensor_rolled_back_to_an_older_step_is_refused_on_every_tier(st):
    key = _rolled_back(st.root / "manifests")
    needles = (STEP2, f"tensor {key!r} of layer", "which the manifest records at step 2", "of step 1")
    refused(lambda: st.restore(step=2), *needles)
    rc, text = verify(st.root)
    assert rc == 1 and all(n in text for n in needles) and "Traceback" not in text, text
    assert _rolled_back(st.remote / "manifests") == key
    st.without_local()
    for target in (st.root, st.url):
        refused(lambda: st.restore(target, step=2), *needles)
    same(st.restore(st.url, step=1)[1], 1)  # the other composite is whole
    rc, text = verify(st.url)
    assert rc == 1 and all(n in text for n in needles) and "Traceback" not in text, text


# -- the same bounds on S3 -------------------------------------------------------------------------------------

@pytest.fixture
def s3_store(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    cfg = layerckpt.Config(full=True, keep_last=0, remote=url, remote_options=s3.options)
    save_two(tmp_path / "ck", cfg)
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **s3.options)
    return url, cfg, fs, path


def _gets(s3, key: str) -> list:
    return [r for r in s3.requests if r[0] == "GET" and r[1].endswith(key)]


def test_s3_an_oversized_manifest_is_refused_reading_no_more_than_its_first_bytes(s3, s3_store, monkeypatch):
    import layerckpt.format._json as j

    url, cfg, fs, path = s3_store
    monkeypatch.setattr(j, "MAX_JSON_BYTES", 64 << 10)  # the cap, smaller than a test should upload
    fs.pipe_file(f"{path}/manifests/step-00000003.json", b" " * (1 << 20))
    refused(lambda: in_time(layerckpt.restore, url, tiny(), config=cfg), "step-00000003.json",
            f"holds {1 << 20} bytes, more than the 65536 bytes a manifest may hold")
    # the newest is told by each manifest's first 64 bytes (one ranged GET); nothing more of it is read
    assert {r[3] for r in _gets(s3, "step-00000003.json")} <= {"bytes=0-63"}
    opts = ["--remote-options", json.dumps(s3.options)]
    rc, text = verify(url, *opts)
    assert rc == 1 and "more than the 65536 bytes" in text and "Traceback" not in text, text


def test_s3_an_oversized_data_file_is_refused_without_a_get(s3, s3_store):
    url, cfg, fs, path = s3_store
    d = json.loads(fs.cat_file(f"{path}/manifests/{STEP2}"))
    (name,) = d["files"]
    recorded = d["files"][name]["size"]
    fs.pipe_file(f"{path}/data/{name}", b"\0" * (recorded + (1 << 20)))
    before = len(_gets(s3, name))
    refused(lambda: in_time(layerckpt.restore, url, tiny(), config=cfg), name,
            f"holds {recorded + (1 << 20)} bytes, more than the {recorded} bytes its manifest records")
    assert len(_gets(s3, name)) == before
    m = tiny()
    in_time(layerckpt.restore, url, m, config=cfg, step=1)
    same(m.state_dict(), 1)


def test_s3_requests_have_a_time_bound(s3):
    tier = FsspecStore(f"s3://{s3.bucket()}/run", s3.options)
    assert (tier.fs.config_kwargs["connect_timeout"], tier.fs.config_kwargs["read_timeout"]) == (5, 15)
    mine = dict(s3.options, config_kwargs={"read_timeout": 120})
    tier = FsspecStore(f"s3://{s3.bucket()}/run", mine)
    assert (tier.fs.config_kwargs["connect_timeout"], tier.fs.config_kwargs["read_timeout"]) == (5, 120)


def test_s3_an_empty_manifest_is_damage_not_an_unreachable_remote(s3, s3_store):
    url, cfg, fs, path = s3_store
    fs.pipe_file(f"{path}/manifests/{STEP2}", b"")  # found by test_fuzz's S3 run (seed 3066)
    for call in (lambda: in_time(layerckpt.restore, url, tiny(), config=cfg),
                 lambda: in_time(layerckpt.restore, url, tiny(), config=cfg, step=2)):
        refused(call, f"{url}/manifests/{STEP2}", "truncated or malformed")
    rc, text = verify(url, "--remote-options", json.dumps(s3.options))
    assert rc == 1 and f"{url}/manifests/{STEP2}" in text and "Traceback" not in text, text
