"""Damaged and hostile stores: every malformed input gets the library's own error naming the file and the
field (never a bare Python exception, never a hang, never unbounded reads); a reader racing retention is
told so (CheckpointGoneError), not told the store is damaged; a Config's repr hides credentials."""
import contextlib
import io
import json
import os
import threading
import time

import pytest
import torch

import layerckpt
from layerckpt import cli
from layerckpt.format._manifest import load_manifest
from layerckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointGoneError, ConfigError

TIMEOUT = 20.0


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def fill(model: torch.nn.Module, step: int) -> None:
    """Every parameter holds values that name the step (and the parameter): a restore is checked bit for bit."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.001 + step + 100 * i)


def expected(step: int) -> dict:
    m = tiny()
    fill(m, step)
    return m.state_dict()


@pytest.fixture
def store(tmp_path):
    """A full store with steps 1 and 2; returns (root, manifest path of step 2)."""
    root = tmp_path / "ck"
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=layerckpt.Config(full=True, keep_last=0)) as ck:
        for step in (1, 2):
            fill(model, step)
            ck.save(step).wait()
    return root, root / "manifests" / "step-00000002.json"


def in_time(fn, *args, timeout=TIMEOUT, **kwargs):
    """fn(*args) on a thread: its result, or its exception raised here; a hang fails the test."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung for {timeout}s"
    if "err" in box:
        raise box["err"]
    return box["out"]


def verify(root, *extra, timeout=TIMEOUT) -> tuple:
    """``layerckpt verify ROOT [extra...]`` in this process, bounded: (exit code, its output)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = in_time(cli.main, ["verify", str(root), *extra], timeout=timeout)
    return rc, out.getvalue() + err.getvalue()


def edit(path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def refused(root, *needles, step=None):
    """restore, read_checkpoint and verify all refuse the store with a CheckpointCorruptError naming needles."""
    for call in (lambda: layerckpt.restore(root, tiny(), step=step), lambda: layerckpt.read_checkpoint(root, step)):
        with pytest.raises(CheckpointCorruptError) as e:
            in_time(call)
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
    rc, text = verify(root)
    assert rc == 1, text
    for n in needles:
        assert n in text, (n, text)


# -- 3: duplicate keys ---------------------------------------------------------------------------------------

def test_a_duplicate_tensor_key_is_refused_naming_file_and_key(store):
    root, mpath = store
    text = mpath.read_text()
    entry = json.dumps(json.loads(text)["tensors"]["model/0.bias"])
    # a second "model/0.weight" entry, pointing at model/0.bias's bytes: with the last key winning it would
    # restore those bytes, their checksum matching
    assert '"model/0.weight":{' in text
    text = text.replace('"model/0.weight":{', '"model/0.weight":' + entry + ',"model/0.weight":{', 1)
    mpath.write_text(text)
    refused(root, "step-00000002.json", "'model/0.weight' twice")


# -- 6: special files ----------------------------------------------------------------------------------------

def test_a_fifo_manifest_is_refused_without_hanging(store):
    root, _ = store
    os.mkfifo(root / "manifests" / "step-00000003.json")
    refused(root, "step-00000003.json", "FIFO")


def test_a_fifo_data_file_is_refused_without_hanging(store):
    root, mpath = store
    data = root / "data" / next(iter(json.loads(mpath.read_text())["files"]))
    os.unlink(data)
    os.mkfifo(data)
    refused(root, "not a regular file")
    out = root.parent / "out.safetensors"
    with contextlib.redirect_stderr(io.StringIO()):
        assert in_time(cli.main, ["export", str(root), "-o", str(out)]) == 2


def test_a_character_device_is_never_read_as_a_manifest(store, tmp_path):
    with pytest.raises(CheckpointCorruptError, match="character device"):
        in_time(load_manifest, "/dev/zero")
    root, _ = store
    os.symlink("/dev/zero", root / "manifests" / "step-00000003.json")  # planted as the newest
    refused(root, "step-00000003.json", "symbolic link")


def test_a_manifest_over_the_size_cap_is_refused_by_size(store, monkeypatch):
    import layerckpt.format._json as j

    root, mpath = store
    monkeypatch.setattr(j, "MAX_JSON_BYTES", 1024)
    monkeypatch.setattr(j.read_regular, "__defaults__", ("manifest", 1024, True))
    with pytest.raises(CheckpointCorruptError, match=r"holds \d+ bytes, more than the 1024 bytes a manifest may hold"):
        load_manifest(str(mpath))


def test_a_directory_as_manifest_is_a_corrupt_error(store):
    root, _ = store
    os.mkdir(root / "manifests" / "step-00000003.json")
    refused(root, "step-00000003.json", "directory")


# -- 7 and 8: malformed content and fields -------------------------------------------------------------------

CONTENT = {
    "deep nesting": lambda t: t.replace(b'"name":null', b'"name":' + b"[" * 100_000 + b"]" * 100_000),
    "5000-digit integer": lambda t: t.replace(b'"seq":', b'"seq":' + b"9" * 5000 + b',"x":', 1),
    "not UTF-8": lambda t: t[:10] + b"\xff\xfe" + t[10:],
    "truncated": lambda t: t[: len(t) // 2],
    "not an object": lambda t: b"[" + t + b"]",
}


@pytest.mark.parametrize("what", sorted(CONTENT))
def test_malformed_json_is_a_corrupt_error(store, what):
    root, mpath = store
    raw = mpath.read_bytes()
    assert b'"name":null' in raw and b'"seq":' in raw
    mpath.write_bytes(CONTENT[what](raw))
    refused(root, "step-00000002.json")


FIELDS = {
    "files not an object": (lambda d: d.update(files=[1]), "'files'"),
    "file entry a string": (lambda d: d["files"].update({k: "x" for k in d["files"]}), "entry for file"),
    "tensor shape of strings": (lambda d: d["tensors"]["model/0.bias"].update(shape=["8"]), "'model/0.bias'"),
    "tensor offset a bool": (lambda d: d["tensors"]["model/0.bias"].update(offset=True), "'model/0.bias'"),
    "crc a float": (lambda d: d["tensors"]["model/0.bias"].update(crc=1.5), "'model/0.bias'"),
    "layer a list": (lambda d: d["layers"].update({k: [] for k in d["layers"]}), "entry for layer"),
    "layer tensors of ints": (lambda d: [e.update(tensors=[1]) for e in d["layers"].values()], "entry for layer"),
    "layer reason an int": (lambda d: [e.update(reason=3) for e in d["layers"].values()], "reason"),
    "model aliases a list": (lambda d: d["model"].update(aliases=[]), "model.aliases"),
    "optimizer a list": (lambda d: d.update(optimizer=[]), "'optimizer'"),
    "seq a string": (lambda d: d.update(seq="1"), "'seq'"),
    "config a string": (lambda d: d.update(config="x"), "'config'"),
    "tensor ref a number": (lambda d: d.update(extra={"t": {"__tensor__": 5}}), "'extra' refers to tensor 5"),
    "tensor ref unknown": (lambda d: d.update(extra={"t": {"__tensor__": "extra/t"}}), "no entry for"),
    "step differs from the name": (lambda d: d.update(step=7), "named for step 2"),
    "negative step": (lambda d: d.update(step=-2), "'step' is -2"),
    "step of 10^40": (lambda d: d.update(step=10 ** 40), "'step'"),
    "version 0": (lambda d: d.update(version=0), "'version' is 0"),
    "world size 0": (lambda d: d.update(world_size=0), "'world_size'"),
    "tensor past its file": (lambda d: d["files"].update({k: dict(v, size=8) for k, v in d["files"].items()}),
                             "which the manifest says holds 8"),
}


@pytest.mark.parametrize("what", sorted(FIELDS))
def test_wrong_fields_are_corrupt_errors_naming_the_field(store, what):
    root, mpath = store
    change, needle = FIELDS[what]
    edit(mpath, change)
    refused(root, "step-00000002.json", needle)


def test_a_tensor_claiming_terabytes_is_refused_before_allocating(store):
    root, mpath = store
    tb = 1 << 40

    def huge(d):
        e = d["tensors"]["model/0.weight"]
        e.update(shape=[tb // 4], nbytes=tb)
        d["files"][e["file"]]["size"] = e["offset"] + tb
        if e.get("enc"):  # encoded: one raw block of it all, where the tensor's bytes start
            e["enc"].update(blocks=[[e["offset"], tb, tb, 0]], ref=None)

    edit(mpath, huge)
    # refused by the manifest's validator (the claim runs over the next tensor's bytes) before any allocation
    for cfg in (None, layerckpt.Config(direct_io=False)):
        with pytest.raises(CheckpointCorruptError, match=r"'model/0.bias' .* overlaps tensor 'model/0.weight' "
                                                         r"\(bytes \d+\.\.1099511\d+\)"):
            in_time(layerckpt.read_checkpoint, root, config=cfg)
    rc, text = verify(root)
    assert rc == 1 and "overlaps tensor 'model/0.weight'" in text


def test_verify_exits_1_when_the_only_manifest_is_damaged(tmp_path):
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, tiny(), config=layerckpt.Config(full=True)) as ck:
        ck.save(1).wait()
    edit(root / "manifests" / "step-00000001.json", lambda d: d.update(step=9))
    rc, text = verify(root)
    assert rc == 1 and "named for step 1" in text


def test_yaml_deep_or_not_utf8_is_a_config_error(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml"):
        layerckpt.Config.from_yaml(deep)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"keep_last: 3\nremote: \xff\xfe\n")
    with pytest.raises(ConfigError, match="bad.yaml.*not UTF-8"):
        layerckpt.Config.from_yaml(bad)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="fifo.yaml.*regular file"):
        in_time(layerckpt.Config.from_yaml, fifo)
    with pytest.raises(ConfigError, match="tmp"):
        layerckpt.Config.from_yaml(tmp_path)  # a directory


# -- 10: readers racing retention ----------------------------------------------------------------------------

def test_a_composite_deleted_with_its_manifest_is_gone_not_corrupt(store):
    from layerckpt.read._fetch import View
    from layerckpt.read._reader import open_reader

    root, mpath = store
    with open_reader(View(str(root), None), None, manifest_paths=False) as r:
        m = r.m
        os.unlink(mpath)  # retention: the manifest first, then its data
        for f in m.files:
            os.unlink(root / "data" / f)
        with pytest.raises(CheckpointGoneError, match="deleted by retention, restore the newest"):
            r.tensors(list(m.tensors))


def test_a_missing_data_file_under_a_committed_manifest_is_damage(store):
    root, mpath = store
    for f in json.loads(mpath.read_text())["files"]:
        os.unlink(root / "data" / f)
    with pytest.raises(CheckpointCorruptError, match="is missing") as e:
        layerckpt.restore(root, tiny())
    assert not isinstance(e.value, CheckpointGoneError)


def test_restore_without_a_step_retries_once_on_the_newest(store, monkeypatch):
    import layerckpt.read._reader as rd

    root, mpath = store
    real = rd.check_claims
    calls = []

    def racing(r, m, mp, keys):  # retention deletes step 2 right after it was picked
        calls.append(m.step)
        if len(calls) == 1:
            os.unlink(mpath)
            for f in m.files:
                os.unlink(root / "data" / f)
        return real(r, m, mp, keys)

    monkeypatch.setattr(rd, "check_claims", racing)
    out = layerckpt.read_checkpoint(root)
    assert out.step == 1 and calls == [2, 1]
    for k, v in expected(1).items():
        assert torch.equal(out.model[k], v), k
    # a step asked for is not substituted
    def deleting(r, m, mp, keys):
        os.unlink(mp)
        for f in m.files:
            os.unlink(root / "data" / f)
        return real(r, m, mp, keys)

    monkeypatch.setattr(rd, "check_claims", deleting)
    with pytest.raises(CheckpointGoneError):
        layerckpt.read_checkpoint(root, 1)


WRITER = """
import os, select, sys, time, torch, layerckpt
sys.path.insert(0, {tests!r})
from test_hostile import fill, tiny
model = tiny()
with layerckpt.Checkpointer({root!r}, model, config=layerckpt.Config(full=True, keep_last=1)) as ck, \\
        open({log!r}, "a") as log:
    step, pausing = 2, False
    while step < 100000:
        if not pausing and select.select([0], [], [], 0)[0]:  # the reader asks for a pause ("p"), or is done
            if os.read(0, 1) != b"p":  # (the end of its input)
                break
            pausing = True
        fill(model, step)
        t0 = time.monotonic()
        ck.save(step).wait()  # committed, and the previous composite pruned
        log.write(f"{{step}} {{t0!r}} {{time.monotonic()!r}}\\n")
        log.flush()
        if step == 2:
            print("saving", flush=True)
        if pausing:  # nothing changes in the store until the reader says: one more save ("o"), or save on ("g")
            print("paused", step, flush=True)
            cmd = os.read(0, 1)
            if cmd not in (b"o", b"g"):
                break
            pausing = cmd == b"o"
        step += 1
"""
READS = 40
HOLD_EVERY = 4  # every 4th read holds the composite it picked until the writer has replaced it


def _save_intervals(log) -> list:
    """The writer's (start, end) of each save, on the machine-wide monotonic clock."""
    lines = log.read_text().split("\n")[:-1] if log.exists() else []  # whole lines only: the writer may be mid-line
    return [(float(a), float(b)) for _, a, b in (line.split() for line in lines)]


def test_a_reader_racing_keep_last_1_never_sees_corruption(tmp_path):
    """A writer process saving with keep_last=1 (deleting each composite as the next commits) while this one
    restores in a loop: every restore succeeds bit for bit, or at worst (the retry lost again) says the
    checkpoint went to retention; never that the store is damaged.  Reads start once the writer has committed.
    Every 4th read loses the race for sure: with the writer paused it picks the newest composite, and holds it
    (``read.manifest-loaded``) while the writer commits one more save and pauses again, so it must retry once
    and restore that save.  The others race the writer freely."""
    import queue
    import subprocess
    import sys

    from layerckpt import _faults

    root = tmp_path / "race"
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=layerckpt.Config(full=True, keep_last=1)) as ck:
        fill(model, 1)
        ck.save(1).wait()
    log = tmp_path / "saves.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = WRITER.format(tests=os.path.dirname(__file__), root=str(root), log=str(log))
    writer = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    said: queue.Queue = queue.Queue()  # the writer's lines, None at its end: each wait for one has a bound

    def pump():
        for line in writer.stdout:
            said.put(line.decode())
        said.put(None)

    threading.Thread(target=pump, daemon=True).start()
    picks, held = [], {}  # held: "read" where this read holds its first pick, "step" the save made meanwhile

    def tell(cmd: bytes) -> int:
        """Send the writer ``cmd``; for a pause, the step of the save it committed before pausing."""
        writer.stdin.write(cmd)
        writer.stdin.flush()
        if cmd == b"g":
            return 0
        line = said.get(timeout=120)
        assert line is not None and line.startswith("paused"), line
        return int(line.split()[1])

    def picked():  # a read holds a composite's manifest, nothing of it read yet
        picks.append(1)
        if held["read"] and len(picks) == 1:
            held["step"] = tell(b"o")

    reader, spans, steps, gone, errors = tiny(1), [], set(), 0, []
    _faults.install("read.manifest-loaded", picked)
    try:
        assert said.get(timeout=120) == "saving\n", "the writer stopped before its first commit"
        for i in range(READS):
            picks.clear()
            held.clear()
            held["read"] = i % HOLD_EVERY == 0
            if held["read"]:
                tell(b"p")  # the newest composite stays the newest until this read has picked it
            t0 = time.monotonic()
            try:
                rep = layerckpt.restore(root, reader)
            except CheckpointGoneError:
                assert not held["read"], "a read that lost the race once, the writer then waiting, was not retried"
                gone += 1
                continue
            except CheckpointError as e:
                errors.append(e)
                break
            finally:
                if held["read"]:
                    tell(b"g")  # the writer saves on
            spans.append((t0, time.monotonic()))
            steps.add(rep.step)
            if held["read"]:  # lost once, then restored what the writer committed while the read held on
                assert len(picks) == 2 and rep.step == held["step"], (picks, rep.step, held)
            want = expected(rep.step)
            for k, v in reader.state_dict().items():
                assert torch.equal(v, want[k]), (rep.step, k)
    finally:
        _faults.remove("read.manifest-loaded")
        writer.stdin.close()  # the writer ends at its next look at its input
        writer.wait(60)
    assert writer.returncode == 0
    assert not errors, errors
    reads, saves = len(spans), _save_intervals(log)
    # a read that overlapped a save in progress: the race this test is about did happen (the held ones did)
    overlapped = sum(any(s0 < r1 and r0 < s1 for s0, s1 in saves) for r0, r1 in spans)
    print(f"{reads} reads ({overlapped} overlapped a save), {gone} gone, {len(saves)} saves")
    assert reads > 10 and gone <= reads // 10, (reads, gone)
    assert overlapped > 0 and len(steps) > 1, (reads, overlapped, len(saves), sorted(steps))


# -- 11: credentials ---------------------------------------------------------------------------------------

def test_config_repr_redacts_remote_options(tmp_path):
    cfg = layerckpt.Config(remote=(tmp_path / "r").as_uri(), remote_options={"key": "AKIASECRET", "secret": "s3cr3t"})
    for text in (repr(cfg), str(cfg), f"{cfg}", repr([cfg])):
        assert "AKIASECRET" not in text and "s3cr3t" not in text
        assert "'key': '<redacted>'" in text and "remote=" in text
    assert cfg.remote_options["key"] == "AKIASECRET"  # only shown redacted
    with pytest.raises(ConfigError) as e:
        layerckpt.Config(remote=(tmp_path / "r").as_uri(), remote_options=[("key", "AKIASECRET")])
    assert "AKIASECRET" not in str(e.value)


def test_an_accelerate_pointer_that_is_a_fifo_or_has_duplicate_keys_is_refused(tmp_path):
    from accelerate_layerckpt import folders

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / folders.POINTER)
    with pytest.raises(layerckpt.CheckpointCorruptError, match="FIFO"):
        folders.read_pointer(str(fifo))  # at once: never waits for a writer
    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / folders.POINTER).write_text('{"format": "x", "format": "y"}')
    with pytest.raises(layerckpt.CheckpointCorruptError, match="not a valid layerckpt pointer"):
        folders.read_pointer(str(dup))


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_file_the_library_writes_is_never_written_through_a_planted_link(tmp_path, where):
    from conftest import small_model

    root, victim = tmp_path / "ck", tmp_path / "victim"
    model = small_model()
    ck = layerckpt.Checkpointer(root, model, config=layerckpt.Config(full=True, lazy_staging=False))
    ck.save(1).wait()
    if where == "data":  # dangling: os.path.exists() says the fresh name is free, O_CREAT would follow it
        (root / "data" / "step-00000002.rank0.safetensors").symlink_to(victim)
    else:
        (root / "manifests" / "step-00000002.json.tmp").symlink_to(victim)
    if where == "data":  # a fresh name is one no entry of any kind holds: the link is passed over
        assert ck.save(2).wait().path.endswith("step-00000002.v1.rank0.safetensors")
    else:
        with pytest.raises(layerckpt.CheckpointWriteError, match="symbolic links"):
            ck.save(2).wait()
    assert not victim.exists()
    assert layerckpt.restore(root, small_model(1)).step == (2 if where == "data" else 1)
    ck.close()
