"""Hostile memory tiers (``Config(memory_tier=True)``): its folder sits in shared memory, a place any local user
can write to before its owner does (test_tier_trust covers a planted folder, one that is a link, another
store's), so its files pass the same open and the same validator as the local store's: no link followed (the
data or manifests folder, a file), no FIFO opened for a wait, no file read past its cap, every manifest field
validated.  Each variant is planted in a genuine memory tier of a store whose disk holds the same composites.
The tier is a cache: while the disk holds a good step 2, restore and read_checkpoint return it bit for bit,
read from the disk's data file, whatever the tier holds; only with the disk's copy gone too do they raise, a
CheckpointCorruptError naming the missing file.  A Checkpointer opening the store takes the tier over, or
refuses it by name (a link among its folders) with the disk untouched; ``layerckpt verify`` of the memory
tier's folder exits 1 without a traceback where its files are damaged."""
import contextlib
import json
import os
import shutil
import sys
from typing import Callable, List, NamedTuple, Optional

import pytest
import torch

import layerckpt
from layerckpt.tiers._memtier import memory_path
from layerckpt.errors import CheckpointCorruptError, CheckpointError

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


class Variant(NamedTuple):
    plant: Callable  # plant(mem, tmp, root): damages the memory tier's folder
    says: Optional[str]  # what the memory tier's verify says; None where its own files still verify
    #: what a writer opening the store says where it refuses the tier (by name); None: it takes the tier over
    writer: Optional[str] = None


VARIANTS = {
    "a FIFO as a newer manifest": Variant(
        lambda mem, tmp, root: os.mkfifo(os.path.join(mem, "manifests", "step-00000003.json")), "a FIFO"),
    "a link to /dev/zero as a newer manifest": Variant(
        lambda mem, tmp, root: os.symlink("/dev/zero", os.path.join(mem, "manifests", "step-00000003.json")),
        "symbolic link"),
    "a link to the disk's manifest": Variant(
        lambda mem, tmp, root: (os.remove(os.path.join(mem, "manifests", STEP2)),
                                os.symlink(root / "manifests" / STEP2, os.path.join(mem, "manifests", STEP2))),
        "symbolic link"),
    "a huge sparse manifest": Variant(lambda mem, tmp, root: _huge(os.path.join(mem, "manifests",
                                                                            "step-00000003.json")),
                                      f"holds {HUGE} bytes"),
    "a garbled manifest": Variant(lambda mem, tmp, root: open(os.path.join(mem, "manifests", STEP2), "wb").write(
        b'{"format": "layerckpt", "tensors": [1, 2'), STEP2),
    "a manifest with a dtype list": Variant(
        lambda mem, tmp, root: _edit(os.path.join(mem, "manifests", STEP2),
                                     lambda d: _first_tensor(d).update(dtype=["F32"])), "is malformed"),
    "a manifest claiming a terabyte": Variant(
        lambda mem, tmp, root: _edit(os.path.join(mem, "manifests", STEP2),
                                     lambda d: _first_tensor(d).update(shape=[1 << 38], nbytes=1 << 40)), STEP2),
    "a FIFO as the data file": Variant(lambda mem, tmp, root: (os.remove(os.path.join(mem, "data", DATA2)),
                                                               os.mkfifo(os.path.join(mem, "data", DATA2))),
                                       "a FIFO"),
    "a link to the disk's data file": Variant(
        lambda mem, tmp, root: (os.remove(os.path.join(mem, "data", DATA2)),
                                os.symlink(root / "data" / DATA2, os.path.join(mem, "data", DATA2))),
        "symbolic link"),
    "a huge sparse data file": Variant(lambda mem, tmp, root: _huge(os.path.join(mem, "data", DATA2)), DATA2),
    "flipped bytes in the data file": Variant(
        lambda mem, tmp, root: open(os.path.join(mem, "data", DATA2), "r+b").write(b"\xff" * 64 + b"\x00" * 8000),
        DATA2),
    "the data folder a link elsewhere": Variant(lambda mem, tmp, root: _link_away(mem, "data", tmp),
                                                "symbolic link", writer="data is a symbolic link"),
    "the manifests folder a link elsewhere": Variant(lambda mem, tmp, root: _link_away(mem, "manifests", tmp),
                                                     "symbolic link", writer="manifests is a symbolic link"),
    "a FIFO as the store identity": Variant(lambda mem, tmp, root: (os.remove(os.path.join(mem, ".store-id")),
                                                                    os.mkfifo(os.path.join(mem, ".store-id"))),
                                            None),
}


_OPENED: Optional[List[str]] = None  # while recording (see opened()): every path os.open/open was given
_HOOKED = False


def _audit(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


@contextlib.contextmanager
def opened():
    """The paths of every file opened inside it (os.open and open raise the "open" audit event), resolved: where
    a read took its bytes from, told by the file system's calls rather than by the library's report (which names
    the disk's manifest whichever tier's bytes were read)."""
    global _OPENED, _HOOKED
    if not _HOOKED:  # an audit hook stays for the process: added on first use, it records only in here
        sys.addaudithook(_audit)
        _HOOKED = True
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def _data_files(paths, base) -> set:
    """The step-2 data files among ``paths`` that lie in the folder ``base`` (the disk's or the tier's data)."""
    return {p for p in paths if os.path.dirname(p) == os.path.realpath(base) and p.endswith(DATA2)}


def _both_reads(root):
    """restore and read_checkpoint of the store: [(step, state, the paths it opened, the manifest it reports)]."""
    out = []
    with opened() as seen:
        r, got = _restored(root)
    out.append((r.step, got, list(seen), r.manifest))
    with opened() as seen:
        loaded = in_time(layerckpt.read_checkpoint, str(root), config=MEM)
    out.append((loaded.step, loaded.model, list(seen), loaded.manifest))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_hostile_memory_tier_falls_back_to_the_disks_genuine_tensors(store, tmp_path, name):
    """The disk still holds a good step 2: whatever was planted in the memory tier, restore and read_checkpoint
    both return step 2 bit for bit, and the disk's data file is the one read (the tier's refused or passed
    over, never a reason to fail)."""
    root, mem = store
    v = VARIANTS[name]
    v.plant(mem, str(tmp_path), root)
    for step, got, seen, manifest in _both_reads(root):
        assert step == 2 and _genuine(got), name
        assert _data_files(seen, root / "data"), (name, "the disk's data file was not read", seen)
        assert manifest == str(root / "manifests" / STEP2)
    if v.says is not None:
        rc, text = verify(mem)
        assert rc == 1 and v.says in text and "Traceback" not in text, text
    model = tiny()
    if v.writer is not None:  # a link in the tier's own folder: the writer refuses the tier, naming it
        with pytest.raises(CheckpointError) as e:
            in_time(layerckpt.Checkpointer, root, model, config=MEM)
        assert v.writer in str(e.value) and mem in str(e.value), str(e.value)
        r, got = _restored(root)  # and the disk is untouched
        assert r.step == 2 and _genuine(got)
        return
    with in_time(layerckpt.Checkpointer, root, model, config=MEM) as ck:  # the writer takes the tier over
        fill(model, 3)
        ck.save(3).wait()
    r, got = _restored(root)
    assert r.step == 3 and _genuine(got, 3)
    assert verify(mem)[0] == 0  # rebuilt: the tier holds step 3 whole again


@pytest.mark.parametrize("name", list(VARIANTS))
def test_with_the_disks_data_gone_nothing_good_is_left_and_both_reads_refuse(store, tmp_path, name):
    """The disk's data file of step 2 gone too: no variant leaves the tier a copy a restore may take (its step 2
    is refused or damaged, or the tier is passed over whole: a newer damaged manifest, which a read never goes
    past, or an identity that cannot be read), so nothing good holds the newest step: both reads raise
    CheckpointCorruptError naming the disk's missing data file, and neither returns step 1 in its place."""
    root, mem = store
    VARIANTS[name].plant(mem, str(tmp_path), root)
    os.remove(root / "data" / DATA2)
    for read in (lambda: _restored(root), lambda: in_time(layerckpt.read_checkpoint, str(root), config=MEM)):
        with pytest.raises(CheckpointCorruptError) as e:
            read()
        assert str(root / "data" / DATA2) in str(e.value) and "missing" in str(e.value), (name, str(e.value))


def test_missing_base_folder_named(tmp_path, monkeypatch):
    """LAYERCKPT_SHM naming a folder that does not exist: the Checkpointer refuses to open, naming the variable
    and the folder, and the store's disk is untouched (nothing committed is at risk)."""
    gone = tmp_path / "no-such-base"
    monkeypatch.setenv("LAYERCKPT_SHM", str(gone))
    with pytest.raises(CheckpointError) as e:
        layerckpt.Checkpointer(tmp_path / "ck2", tiny(), config=MEM)
    assert "LAYERCKPT_SHM names an existing folder" in str(e.value) and str(gone) in str(e.value)
    assert not gone.exists()
