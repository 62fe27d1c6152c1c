"""``layerckpt export FOLDER --accelerate/--transformers`` on a checkpoint folder that may come from elsewhere (a
download, a colleague's run): the export copies only the folder's own regular files and folders, stages under a
fresh name of its own, and reads only a store beside the folders (issue 66).

Each hostile variant of a folder the real plugin wrote is refused with a CheckpointError naming what is wrong and
where, at once, before anything is written beside the output, and no byte of a file outside the folder lands
anywhere; the same folder made whole again then exports bit for bit as the pristine folder does.
"""
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import layerckpt
from layerckpt import adapters
from layerckpt.errors import CheckpointCorruptError, CheckpointError

sys.path.insert(0, os.path.dirname(__file__))
from test_hostile import in_time  # noqa: E402

SECRET = b"a file outside the checkpoint folder: 4f1c9e0b7d"
ENV = ("LAYERCKPT_ENABLED", "LAYERCKPT_CONFIG", "TRANSFORMERS_LAYERCKPT")


# ------------------------------------------------------------------ folders the plugins wrote

def _accelerate(base: str) -> str:
    """A tiny accelerate run's checkpoint folder (automatic naming: ``checkpoints/checkpoint_0``), through the
    plugin; the folder's path relative to ``base``."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate_helpers import Run

    run = Run(base, config=layerckpt.Config(threshold=0.0))
    try:
        run.train(2)
        folder = run.acc.save_state()
        run.plugin.wait()
    finally:
        run.plugin.close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return os.path.relpath(folder, base)


def _transformers(base: str) -> str:
    """A tiny Trainer run's ``checkpoint-2`` folder, attached; its path relative to ``base``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import transformers_layerckpt

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(base, max_steps=2, save_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r.clone()} for r in ids])
    session = transformers_layerckpt.attach(trainer, full=True)
    trainer.train()
    session.close()
    return "checkpoint-2"


def export(adapter: str):
    if adapter == "accelerate":
        from accelerate_layerckpt.export import export_folder
    else:
        from transformers_layerckpt.export import export_folder
    return export_folder


def tree(d: str) -> dict:
    """Relative path -> bytes of every regular file under ``d`` (links not followed)."""
    out = {}
    for parent, _, names in os.walk(d):
        for n in names:
            p = os.path.join(parent, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, d)] = f.read()
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """adapter -> (project directory, its checkpoint folder relative to it, the export of that folder as
    {path: bytes}), each written once through the real plugin."""
    made = {}

    def get(adapter: str):
        if adapter not in made:
            base = str(tmp_path_factory.mktemp(adapter))
            with pytest.MonkeyPatch.context() as mp:
                for name in ENV:
                    mp.delenv(name, raising=False)
                rel = (_accelerate if adapter == "accelerate" else _transformers)(base)
            out = str(tmp_path_factory.mktemp(f"{adapter}-reference") / "plain")
            export(adapter)(os.path.join(base, rel), out)
            made[adapter] = (base, rel, tree(out))
        return made[adapter]

    return get


class Case:
    """A copy of a pristine project (three folders deep, so a pointer climbing up stays in the test's folder) to
    spoil, a secret file and a folder outside it, and the export's output in a folder of its own."""

    def __init__(self, adapter: str, tmp_path, pristine):
        base, rel, self.reference = pristine(adapter)
        self.adapter, self.tmp = adapter, str(tmp_path)
        self.project = os.path.join(self.tmp, "a", "b", "project")
        shutil.copytree(base, self.project, symlinks=True)
        self.folder = os.path.join(self.project, rel)
        self.pointer = os.path.join(self.folder, "layerckpt.json")
        with open(self.pointer) as f:
            self.store = os.path.normpath(os.path.join(self.folder, json.load(f)["store"]))
        self.outside = os.path.join(self.tmp, "outside")
        os.makedirs(os.path.join(self.outside, "dir"))
        self.secret = os.path.join(self.outside, "secret.txt")
        with open(self.secret, "wb") as f:
            f.write(SECRET)
        with open(os.path.join(self.outside, "dir", "more.txt"), "wb") as f:
            f.write(SECRET)
        self.exports = os.path.join(self.tmp, "exports")
        os.mkdir(self.exports)
        self.out = os.path.join(self.exports, "plain")

    def run(self):
        return export(self.adapter)(self.folder, self.out)

    def set_store(self, value: str) -> None:
        with open(self.pointer) as f:
            body = json.load(f)
        with open(self.pointer, "w") as f:
            json.dump(dict(body, store=value), f)


def assert_refused(case: Case, match: str, error=CheckpointError) -> None:
    """The export fails at once with ``error`` whose message matches ``match``; nothing was written beside the
    output (no output, no staging folder), and no byte of the secret lies anywhere but in its own file."""
    began = time.monotonic()
    with pytest.raises(error, match=match):
        in_time(case.run, timeout=60)  # a FIFO read waits forever, /dev/zero fills the disk
    assert time.monotonic() - began < 30
    assert os.listdir(case.exports) == []
    leaked = [p for p, data in tree(case.tmp).items() if SECRET in data and not p.startswith("outside" + os.sep)]
    assert not leaked


def assert_exports(case: Case) -> None:
    """The export works and writes what the pristine folder's export holds, bit for bit: the files it copies
    byte for byte, those it writes with ``torch.save`` (each holds a random ``serialization_id``) tensor for
    tensor."""
    assert case.run() == case.out
    got = tree(case.out)
    assert got.keys() == case.reference.keys()
    for name, data in got.items():
        if not os.path.exists(os.path.join(case.folder, name)) and name.endswith((".bin", ".pt")):
            a, b = (torch.load(io.BytesIO(d), weights_only=True) for d in (data, case.reference[name]))
            assert_same(a, b)
        else:
            assert data == case.reference[name], name


def assert_same(a, b) -> None:
    """``a`` and ``b`` (what torch.load gave) are equal, each tensor bit for bit."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ------------------------------------------------------------------ what a folder holds

def _link_file(c: Case):
    os.symlink(c.secret, os.path.join(c.folder, "notes.txt"))
    return lambda: os.unlink(os.path.join(c.folder, "notes.txt"))


def _link_below(c: Case):
    os.mkdir(os.path.join(c.folder, "extra"))
    os.symlink(c.secret, os.path.join(c.folder, "extra", "deep.txt"))
    return lambda: shutil.rmtree(os.path.join(c.folder, "extra"))


def _link_dir(c: Case):
    os.symlink(os.path.join(c.outside, "dir"), os.path.join(c.folder, "more"))
    return lambda: os.unlink(os.path.join(c.folder, "more"))


def _dev_zero(c: Case):
    os.symlink("/dev/zero", os.path.join(c.folder, "zeros.bin"))
    return lambda: os.unlink(os.path.join(c.folder, "zeros.bin"))


def _fifo(c: Case):
    os.mkfifo(os.path.join(c.folder, "pipe"))
    return lambda: os.unlink(os.path.join(c.folder, "pipe"))


CONTENTS = [
    (_link_file, r"/notes\.txt is a symbolic link; an export copies only the regular files and folders inside the "
                 r"checkpoint folder.*replace it with the file itself, or remove it"),
    (_link_below, r"/extra/deep\.txt is a symbolic link"),
    (_link_dir, r"/more is a symbolic link"),
    (_dev_zero, r"/zeros\.bin is a symbolic link"),
    (_fifo, r"/pipe is a FIFO"),
]


@pytest.mark.parametrize("adapter", ["accelerate", "transformers"])
@pytest.mark.parametrize("spoil,match", CONTENTS, ids=["link-to-a-file-outside", "link-in-a-subfolder",
                                                      "linked-folder", "link-to-dev-zero", "fifo"])
def test_a_link_or_special_file_in_the_folder_is_refused(tmp_path, pristine, adapter, spoil, match):
    case = Case(adapter, tmp_path, pristine)
    heal = spoil(case)
    assert_refused(case, re.escape(case.folder) + match)
    heal()
    assert_exports(case)


@pytest.mark.parametrize("adapter", ["accelerate", "transformers"])
def test_a_path_named_as_the_old_staging_folder_is_left_alone(tmp_path, pristine, adapter):
    """The staging folder has a fresh name of its own: ``OUT.tmp`` (the name it once had) and every other path
    beside the output stay as they were, and no staging folder is left."""
    case = Case(adapter, tmp_path, pristine)
    os.mkdir(case.out + ".tmp")
    with open(os.path.join(case.out + ".tmp", "mine.txt"), "wb") as f:
        f.write(b"someone else's")
    assert_exports(case)
    assert sorted(os.listdir(case.exports)) == ["plain", "plain.tmp"]
    assert tree(case.out + ".tmp") == {"mine.txt": b"someone else's"}


# ------------------------------------------------------------------ where the pointer's store is

@pytest.mark.parametrize("adapter", ["accelerate", "transformers"])
def test_a_pointer_naming_a_store_elsewhere_is_refused(tmp_path, pristine, adapter):
    """An absolute store, and one climbing further up than layerckpt ever writes it (a copy of the real store
    lies there, so only the check stops the read), are refused when the pointer is read."""
    case = Case(adapter, tmp_path, pristine)
    with open(case.pointer, "rb") as f:
        body = f.read()
    case.set_store(case.store)
    assert_refused(case, rf"{re.escape(case.pointer)} names the layerckpt store .*, which is an absolute path; "
                         r"layerckpt writes it beside the checkpoint folders", CheckpointCorruptError)
    climb = "/".join([".."] * 3 + ["stolen"])
    shutil.copytree(case.store, os.path.normpath(os.path.join(case.folder, climb)))
    case.set_store(climb)
    assert_refused(case, r"'\.\./\.\./\.\./stolen', which climbs 3 folders up", CheckpointCorruptError)
    with open(case.pointer, "wb") as f:
        f.write(body)
    assert_exports(case)


@pytest.mark.parametrize("adapter", ["accelerate", "transformers"])
def test_a_store_linked_outside_is_refused_one_linked_beside_is_read(tmp_path, pristine, adapter):
    case = Case(adapter, tmp_path, pristine)
    away = os.path.join(case.outside, "store")
    os.rename(case.store, away)
    os.symlink(away, case.store)
    assert_refused(case, rf"names the layerckpt store {re.escape(case.store)}, which is a symbolic link to "
                         rf"{re.escape(away)}, outside {re.escape(os.path.dirname(case.store))}")
    os.unlink(case.store)
    os.rename(away, case.store + "-real")
    os.symlink(os.path.basename(case.store) + "-real", case.store)  # a store linked within its folder
    assert_exports(case)


# ------------------------------------------------------------------ a folder changed while it is exported

@pytest.mark.parametrize("swap", ["file", "folder"])
def test_an_entry_replaced_by_a_link_after_the_listing_is_refused(tmp_path, pristine, monkeypatch, swap):
    """The copy opens each file and folder without following a link and checks it is what it was listed as: a
    link put in place since is refused, and the staging folder goes."""
    case = Case("accelerate", tmp_path, pristine)
    os.mkdir(os.path.join(case.folder, "extra"))
    with open(os.path.join(case.folder, "extra", "more.txt"), "wb") as f:
        f.write(b"plain")
    listed = adapters._export_entries
    victim = os.path.join(case.folder, "extra", "more.txt") if swap == "file" else os.path.join(case.folder, "extra")

    def then_swapped(folder, skip):
        out = listed(folder, skip)
        if swap == "file":
            os.unlink(victim)
            os.symlink(case.secret, victim)
        else:
            shutil.rmtree(victim)
            os.symlink(os.path.join(case.outside, "dir"), victim)
        return out

    monkeypatch.setattr(adapters, "_export_entries", then_swapped)
    assert_refused(case, re.escape(victim) + " is a symbolic link")


# ------------------------------------------------------------------ the command line

def test_the_command_line_says_it_in_one_line(tmp_path, pristine):
    case = Case("accelerate", tmp_path, pristine)
    os.symlink(case.secret, os.path.join(case.folder, "notes.txt"))
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "export", case.folder, "--accelerate", "-o",
                        case.out], capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in err and SECRET not in r.stdout + r.stderr
    assert len(err.strip().splitlines()) == 1 and "notes.txt is a symbolic link" in err, err
    assert os.listdir(case.exports) == []
