"""Hostile memory tiers (``Config(memory_tier=True)``): its folder sits in shared memory, a place any local user
can write to before its owner does (test_tier_trust covers a planted folder, one that is a link, another
store's), so its files pass the same open and the same validator as the local store's: no link followed (the
data or manifests folder, a file), no FIFO opened for a wait, no file read past its cap, every manifest field
validated.  Each variant is planted in a genuine memory tier of a store whose disk holds the same composites;
restore and read_checkpoint end within a bound with the genuine tensors (the disk read instead) or the library's
own error, never another exception; a Checkpointer opening the store ends too; ``layerckpt verify`` of the
memory tier's folder exits 1 without a traceback where its files are damaged."""
import json
import os
import shutil
import sys

import pytest
import torch

import layerckpt
from layerckpt.tiers._memtier import memory_path
from layerckpt.errors import CheckpointError

sys.path.insert(0, os.path.dirname(__file__))
from test_hostile import expected, fill, in_time, tiny, verify  # noqa: E402

HUGE = 600 << 20  # a sparse file: no memory or disk is spent on it
MEM = layerckpt.Config(full=True, keep_last=0, memory_tier=True)
STEP2 = "step-00000002.json"
DATA2 = "step-00000002.rank0.safetensors"


@pytest.fixture(autouse=True)
def private_shm(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("LAYERCKPT_SHM", str(base))


@pytest.fixture
def store(tmp_path):
    """(the store's root, its memory tier's folder): steps 1 and 2 saved, the tier holding step 2."""
    root = tmp_path / "ck"
    model = tiny()
    with layerckpt.Checkpointer(root, model, config=MEM) as ck:
        for step in (1, 2):
            fill(model, step)
            ck.save(step).wait()
    mem = memory_path(str(root))
    assert os.path.exists(os.path.join(mem, "manifests", STEP2)) and os.path.exists(os.path.join(mem, "data", DATA2))
    return root, mem


def _restored(root):
    m = tiny()
    r = in_time(layerckpt.restore, str(root), m, config=MEM)
    return r, m.state_dict()


def _genuine(got: dict, step: int = 2) -> bool:
    want = expected(step)
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_memory_tier_is_what_a_restore_reads(store):
    """The control: with the disk's data file of step 2 gone, step 2 still restores: from the memory tier."""
    root, mem = store
    os.remove(root / "data" / DATA2)
    r, got = _restored(root)
    assert r.step == 2 and _genuine(got)
    assert verify(mem)[0] == 0


# -- the variants: each plants something in the memory tier's folder -------------------------------------------

def _link_away(mem, sub, tmp):
    away = os.path.join(tmp, "elsewhere-" + sub)
    shutil.move(os.path.join(mem, sub), away)
    os.symlink(away, os.path.join(mem, sub))


def _huge(path):
    with open(path, "wb") as f:
        f.truncate(HUGE)


def _edit(path, change):
    with open(path) as f:
        d = json.load(f)
    change(d)
    with open(path, "w") as f:
        json.dump(d, f)


def _first_tensor(d):
    return d["tensors"][next(iter(d["tensors"]))]


# name -> (plant(mem, tmp, root), what the memory tier's verify says where it is damaged: None where its own
# files still verify)
VARIANTS = {
    "a FIFO as a newer manifest": (lambda mem, tmp, root: os.mkfifo(os.path.join(mem, "manifests",
                                                                                  "step-00000003.json")),
                                   "a FIFO"),
    "a link to /dev/zero as a newer manifest": (
        lambda mem, tmp, root: os.symlink("/dev/zero", os.path.join(mem, "manifests", "step-00000003.json")),
        "symbolic link"),
    "a link to the disk's manifest": (
        lambda mem, tmp, root: (os.remove(os.path.join(mem, "manifests", STEP2)),
                                os.symlink(root / "manifests" / STEP2, os.path.join(mem, "manifests", STEP2))),
        "symbolic link"),
    "a huge sparse manifest": (lambda mem, tmp, root: _huge(os.path.join(mem, "manifests", "step-00000003.json")),
                               f"holds {HUGE} bytes"),
    "a garbled manifest": (lambda mem, tmp, root: open(os.path.join(mem, "manifests", STEP2), "wb").write(
        b'{"format": "layerckpt", "tensors": [1, 2'), STEP2),
    "a manifest with a dtype list": (lambda mem, tmp, root: _edit(os.path.join(mem, "manifests", STEP2),
                                                                  lambda d: _first_tensor(d).update(dtype=["F32"])),
                                     "is malformed"),
    "a manifest claiming a terabyte": (
        lambda mem, tmp, root: _edit(os.path.join(mem, "manifests", STEP2),
                                     lambda d: _first_tensor(d).update(shape=[1 << 38], nbytes=1 << 40)),
        STEP2),
    "a FIFO as the data file": (lambda mem, tmp, root: (os.remove(os.path.join(mem, "data", DATA2)),
                                                        os.mkfifo(os.path.join(mem, "data", DATA2))), "a FIFO"),
    "a link to the disk's data file": (
        lambda mem, tmp, root: (os.remove(os.path.join(mem, "data", DATA2)),
                                os.symlink(root / "data" / DATA2, os.path.join(mem, "data", DATA2))),
        "symbolic link"),
    "a huge sparse data file": (lambda mem, tmp, root: _huge(os.path.join(mem, "data", DATA2)), DATA2),
    "flipped bytes in the data file": (
        lambda mem, tmp, root: open(os.path.join(mem, "data", DATA2), "r+b").write(b"\xff" * 64 + b"\x00" * 8000),
        DATA2),
    "the data folder a link elsewhere": (lambda mem, tmp, root: _link_away(mem, "data", tmp), "symbolic link"),
    "the manifests folder a link elsewhere": (lambda mem, tmp, root: _link_away(mem, "manifests", tmp),
                                              "symbolic link"),
    "a FIFO as the store identity": (lambda mem, tmp, root: (os.remove(os.path.join(mem, ".store-id")),
                                                             os.mkfifo(os.path.join(mem, ".store-id"))), None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hostile_memory_tier_restores_the_genuine_tensors_or_is_refused(store, tmp_path, name):
    root, mem = store
    plant, says = VARIANTS[name]
    plant(mem, str(tmp_path), root)
    try:
        r, got = _restored(root)
    except CheckpointError:  # the library's own error (refusing the tier's files by name) is an end too
        pass
    else:
        assert r.step == 2 and _genuine(got), (name, r)
    try:
        loaded = in_time(layerckpt.read_checkpoint, str(root), config=MEM)
    except CheckpointError:
        pass
    else:
        assert loaded.step == 2 and _genuine(loaded.model)
    if says is not None:
        rc, text = verify(mem)
        assert rc == 1 and says in text and "Traceback" not in text, text
    # a writer opening the store with that tier ends too: it takes the tier over, or refuses it by name
    try:
        model = tiny()
        with in_time(layerckpt.Checkpointer, root, model, config=MEM) as ck:
            fill(model, 3)
            ck.save(3).wait()
    except CheckpointError:
        return
    r, got = _restored(root)
    assert r.step == 3 and _genuine(got, 3)


def test_missing_base_folder_named(tmp_path, monkeypatch):
    """LAYERCKPT_SHM naming a folder that does not exist: the Checkpointer refuses to open, naming the variable
    and the folder, and the store's disk is untouched (nothing committed is at risk)."""
    gone = tmp_path / "no-such-base"
    monkeypatch.setenv("LAYERCKPT_SHM", str(gone))
    with pytest.raises(CheckpointError) as e:
        layerckpt.Checkpointer(tmp_path / "ck2", tiny(), config=MEM)
    assert "LAYERCKPT_SHM names an existing folder" in str(e.value) and str(gone) in str(e.value)
    assert not gone.exists()
