"""The Accelerate plugin with a remote tier: retention on the remote (folders rotate with total_limit, composites
stay while a remote folder's pointer names them), folder copies under remote_bandwidth, and load_state()
preferring a newer remote folder over an older local one."""
import json
import os
import threading
import time
import uuid


import layerckpt
from accelerate_fixtures import fresh_accelerate, runs, same_state  # noqa: F401 - fixtures
from accelerate_helpers import Run, tiny
from conftest import assert_same_tensors
from accelerate_layerckpt import folders, remote

FULL = layerckpt.Config(threshold=0.0)


class Bucket:
    """What the remote holds, read with fsspec directly (never through the plugin)."""

    def __init__(self, url: str, options: dict):
        import fsspec

        self.fs, self.path = fsspec.core.url_to_fs(url, **options)

    def names(self, sub: str) -> list:
        self.fs.invalidate_cache()
        try:
            return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.path}/{sub}", detail=False))
        except FileNotFoundError:
            return []

    def steps(self) -> list:
        return sorted(int(n[len("step-"):-len(".json")]) for n in self.names("model_0/manifests"))

    def referenced(self) -> set:
        """Data objects the remaining manifests name (their own files and the older ones they read)."""
        out = set()
        for n in self.names("model_0/manifests"):
            out |= set(json.loads(self.fs.cat_file(f"{self.path}/model_0/manifests/{n}"))["files"])
        return out


def save(run: Run, snaps: dict) -> str:
    run.train(2)
    name = os.path.basename(run.acc.save_state())
    snaps[name] = (run.snapshot(), run.progress.step)
    run.plugin.wait()  # durable here and on the remote, the remote's retention done: each check is exact
    return name


def test_two_machines_share_one_remote_and_its_retention(tmp_path, runs, s3):
    """total_limit=2 on the remote too.  Machine 2 resumes from an older remote folder (checkpoint_1) and
    saves on: the remote keeps the newest 2 folders and every composite they name, including checkpoint_2's
    that machine 2 never fetched (pins are read from the remote's pointers, not from the local folders),
    and each remaining remote folder restores bit for bit on a third machine."""
    url = f"s3://{s3.bucket()}/run"
    cfg = FULL.replace(remote=url, remote_options=s3.options)
    bucket = Bucket(url, s3.options)
    snaps = {}
    first = runs(tmp_path / "node1", total_limit=2, config=cfg)
    for _ in range(3):
        save(first, snaps)
    assert bucket.names("folders") == ["checkpoint_1", "checkpoint_2"]
    assert bucket.steps() == [1, 2]
    first.plugin.close()

    second = runs(tmp_path / "node2", total_limit=2, config=cfg, seed=3)
    second.acc.load_state(str(tmp_path / "node2" / "checkpoints" / "checkpoint_1"))  # fetched by name
    same_state(second.snapshot(), snaps["checkpoint_1"][0])
    checked = 0
    for want in (["checkpoint_2", "checkpoint_3"], ["checkpoint_3", "checkpoint_4"], ["checkpoint_4", "checkpoint_5"]):
        save(second, snaps)  # numbered after the remote's newest folder, never over machine 1's
        assert bucket.names("folders") == want
        pinned = sorted(folders.parse_pointer(bucket.fs.cat_file(f"{bucket.path}/folders/{n}/layerckpt.json"),
                                              n).step for n in want)
        assert bucket.steps() == pinned  # every remaining folder's composite, nothing else
        assert set(bucket.names("model_0/data")) == bucket.referenced()  # no object lost, none left over
        for name in want:
            third = runs(tmp_path / f"reader{checked}", config=cfg, seed=7)
            third.acc.load_state(str(tmp_path / f"reader{checked}" / "checkpoints" / name))
            same_state(third.snapshot(), snaps[name][0])
            assert third.progress.step == snaps[name][1]
            third.plugin.close()
            checked += 1
    assert checked == 6


def test_folder_copies_honour_remote_bandwidth(tmp_path, monkeypatch):
    """A folder's copy of N bytes under remote_bandwidth=cap takes at least N / cap seconds, every byte of it
    taken from the cap's bucket; uncapped, nothing of it waits: no byte taken from a bucket, no sleep.  Counted,
    not timed: how long an uncapped copy takes says more about the machine's load than about the cap."""
    from layerckpt.tiers import _bandwidth

    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    payload = os.urandom(384 << 10)
    (folder / "scheduler.bin").write_bytes(payload)
    (folder / "random_states_0.pkl").write_bytes(payload[:1000])
    n = len(payload) + 1000
    cap = 1 << 20
    taken, slept = [], []
    others = set(threading.enumerate()) - {threading.main_thread()}  # an earlier test's threads, not counted

    def take(bucket, nbytes):
        taken.append(nbytes)
        return real_take(bucket, nbytes)

    def sleep(seconds):
        if threading.current_thread() not in others:
            slept.append(seconds)
        real_sleep(seconds)

    real_take, real_sleep = _bandwidth.TokenBucket.take, time.sleep
    monkeypatch.setattr(_bandwidth.TokenBucket, "take", take)
    monkeypatch.setattr(time, "sleep", sleep)
    took, bytes_taken, sleeps = {}, {}, {}
    for label, bandwidth in (("capped", cap), ("free", None)):
        url = f"memory://bw-{uuid.uuid4().hex[:12]}/run"
        uploads = remote.FolderUploads(layerckpt.Config(remote=url, remote_bandwidth=bandwidth))
        del taken[:], slept[:]
        t = time.perf_counter()
        uploads.submit(str(folder))
        uploads.close()
        took[label] = time.perf_counter() - t
        bytes_taken[label], sleeps[label] = sum(taken), list(slept)
        assert Bucket(url, {}).fs.cat_file(f"{Bucket(url, {}).path}/folders/checkpoint_0/scheduler.bin") == payload
    assert took["capped"] >= n / cap, took
    assert bytes_taken["capped"] >= n and sum(sleeps["capped"]) > 0, (bytes_taken, sleeps)
    assert bytes_taken["free"] == 0 and sleeps["free"] == [], (bytes_taken, sleeps)


def test_a_newer_remote_folder_wins_over_an_older_local_one(tmp_path, runs, s3):
    """Machine 1 saves checkpoint_0 and stops (its disk stays); machine 2 resumes from the remote and saves
    checkpoint_1 and checkpoint_2; machine 1 comes back: load_state() loads the remote's checkpoint_2 (step 2),
    not its own loadable checkpoint_0 (step 0), and numbers its next folder after it."""
    url = f"s3://{s3.bucket()}/run"
    cfg = FULL.replace(remote=url, remote_options=s3.options)
    snaps = {}
    first = runs(tmp_path / "node1", config=cfg)
    save(first, snaps)
    first.plugin.close()

    second = runs(tmp_path / "node2", config=cfg, seed=3)
    second.acc.load_state()
    same_state(second.snapshot(), snaps["checkpoint_0"][0])
    assert [save(second, snaps) for _ in range(2)] == ["checkpoint_1", "checkpoint_2"]
    second.plugin.close()

    local = tmp_path / "node1" / "checkpoints" / "checkpoint_0"
    assert folders.loadable_step(str(local)) == 0  # machine 1's own folder would load
    back = runs(tmp_path / "node1", config=cfg, seed=5)
    back.acc.load_state()
    assert back.plugin.last_restore[0].step == 2
    same_state(back.snapshot(), snaps["checkpoint_2"][0])
    assert back.progress.step == snaps["checkpoint_2"][1]
    assert sorted(os.listdir(tmp_path / "node1" / "checkpoints")) == ["checkpoint_0", "checkpoint_2"]
    assert os.path.basename(back.acc.save_state()) == "checkpoint_3"
    back.plugin.close()

    # the local folder wins when it is the newer one: no download
    again = runs(tmp_path / "node1", config=cfg, seed=6)
    again.acc.load_state()
    assert again.plugin.last_restore[0].step == 3
    assert again.plugin.last_restore[0].manifest == str(tmp_path / "node1" / "layerckpt" / "model_0" / "manifests"
                                                        / "step-00000003.json")


def test_remote_retention_keeps_the_older_files_selective_composites_read(tmp_path, runs):
    """Default (selective) Config: kept composites carry layers from saves whose folders and composites were
    rotated away on the remote; those data objects stay, and each kept remote composite restores exactly what
    the same composite restores locally."""
    url = f"memory://sel-{uuid.uuid4().hex[:12]}/run"
    cfg = layerckpt.Config(remote=url)
    bucket = Bucket(url, {})
    run = runs(tmp_path, total_limit=2, config=cfg)
    snaps = {}
    save(run, snaps)
    for _ in range(3):  # nothing trains in between: every layer is carried from the first save
        run.acc.save_state()
        run.plugin.wait()
    assert bucket.names("folders") == ["checkpoint_2", "checkpoint_3"]
    assert bucket.steps() == [2, 3]
    kept = set(bucket.names("model_0/data"))
    assert kept == bucket.referenced() and any(n.startswith("step-00000000.") for n in kept)
    for step in (2, 3):
        here, there = tiny(1), tiny(2)
        layerckpt.restore(str(tmp_path / "layerckpt" / "model_0"), here, step=step)
        layerckpt.restore(f"{url}/model_0", there, step=step, config=cfg)
        assert_same_tensors(here.state_dict(), there.state_dict())
