"""A remote store read through a local view (``_fetch``: a ``file://`` remote's own folder, or a temporary folder
a memory:// or S3 composite is downloaded into; the CLI's ``layerckpt-view-`` copy): damage found in what was
read is reported naming the remote's file by its URL (``<url>/data/...``, ``<url>/manifests/...``), in the
error's message and its ``path``, and in ``layerckpt verify``/``inspect`` output, never the temporary copy,
which is gone by the time the message is read.  A local store and the memory tier are named as they were."""
import contextlib
import io
import json
import os
import shutil
import tempfile

import pytest
import torch

import layerckpt
from layerckpt import cli
from layerckpt.errors import CheckpointCorruptError

from conftest import stored_byte

STEP2 = "step-00000002.json"
#: what a message must not hold: the temporary folders a remote composite is copied into
TEMPORARY = ("layerckpt-fetch-", "layerckpt-view-")


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def model_and_optimizer():
    model = tiny()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A genuine local store of steps 1 and 2 (every tensor in each)."""
    root = tmp_path_factory.mktemp("names") / "ck"
    model, opt = model_and_optimizer()
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(full=True, keep_last=0)) as ck:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
                    p.grad = torch.ones_like(p)
            opt.step()
            ck.save(step).wait()
    return root


def upload(root, url: str, options: dict) -> None:
    """Every file of the local store ``root`` put under ``url`` (a file:// URL: a copy of the folder)."""
    if url.startswith("file://"):
        shutil.copytree(root, url[len("file://"):], ignore=shutil.ignore_patterns(".writer.lock"))
        return
    import fsspec

    fs, base = fsspec.core.url_to_fs(url, **options)
    for d, _, files in os.walk(root):
        for f in files:
            if f != ".writer.lock":
                p = os.path.join(d, f)
                fs.pipe_file(base + "/" + os.path.relpath(p, root).replace(os.sep, "/"), open(p, "rb").read())


def damaged_copy(saved, tmp_path, damage) -> "os.PathLike":
    root = tmp_path / "damaged"
    shutil.copytree(saved, root, ignore=shutil.ignore_patterns(".writer.lock"))
    path = root / "manifests" / STEP2
    d = json.loads(path.read_text())
    out = damage(root, d)
    path.write_text(json.dumps(d))
    return out


def flip_tensor_byte(root, d) -> str:
    """A byte in the middle of a model tensor's stored bytes flipped: its checksum fails, after the download."""
    key = sorted(k for k in d["tensors"] if k.startswith("model/"))[0]
    e = d["tensors"][key]
    with open(root / "data" / e["file"], "r+b") as f:
        f.seek(stored_byte(e))
        b = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([b ^ 0x10]))
    return "data/" + e["file"]


def malformed_rng(root, d) -> str:
    """The manifest's RNG field malformed in a way its validator lets by (its inside is the restore's to
    check): refused reading the downloaded manifest."""
    d["rng"] = {"torch": 5}
    return "manifests/" + STEP2


DAMAGES = {"data": flip_tensor_byte, "manifest": malformed_rng}


def no_temporary(text: str, url: str) -> None:
    """``text`` names no temporary copy, and a file:// remote's folder only inside its URL."""
    for t in TEMPORARY:
        assert t not in text, text
    if url.startswith("file://"):
        folder = url[len("file://"):]
        assert text.count(folder) == text.count(url), text


def cli_run(*args) -> tuple:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(list(args))
    return rc, out.getvalue()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_after_the_download_names_the_remote_file(saved, tmp_path, remote, damage):
    url, options = remote
    rel = damaged_copy(saved, tmp_path, DAMAGES[damage])
    upload(tmp_path / "damaged", url, options)
    cfg = layerckpt.Config(remote=url, remote_options=options)
    named = f"{url}/{rel}"
    for read in (lambda: layerckpt.read_checkpoint(url, config=cfg),
                 lambda: layerckpt.restore(url, *model_and_optimizer(), config=cfg),
                 lambda: layerckpt.restore(f"{url}/manifests/{STEP2}", *model_and_optimizer(), config=cfg)):
        with pytest.raises(CheckpointCorruptError) as e:
            read()
        assert named in str(e.value), str(e.value)
        assert e.value.path == named
        no_temporary(str(e.value), url)
    m, o = model_and_optimizer()
    layerckpt.restore(url, m, o, config=cfg, step=1)  # the other composite is whole (not for data: it shares no file)

    opts = ["--remote-options", json.dumps(options)] if options else []
    rc, text = cli_run("verify", url, *opts)
    assert rc == 1 and named in text and "Traceback" not in text, text
    no_temporary(text, url)


def test_damage_the_manifest_validator_finds_names_the_url_in_verify_and_inspect(saved, tmp_path, remote):
    url, options = remote

    def wrong_size(root, d):
        d["tensors"][sorted(d["tensors"])[0]]["nbytes"] += 4
        return "manifests/" + STEP2

    rel = damaged_copy(saved, tmp_path, wrong_size)
    upload(tmp_path / "damaged", url, options)
    named = f"{url}/{rel}"
    opts = ["--remote-options", json.dumps(options)] if options else []
    rc, text = cli_run("verify", url, *opts)
    assert rc == 1 and named in text, text
    no_temporary(text, url)
    for target in (url, f"{url}/manifests/{STEP2}"):
        rc, text = cli_run("inspect", target, *opts)
        assert rc == 2 and named in text, text
        no_temporary(text, url)
    rc, text = cli_run("inspect", url, "--step", "1", *opts)
    assert rc == 0 and f"{url}/manifests/step-00000001.json" in text, text
    no_temporary(text, url)


def test_a_local_store_and_the_memory_tier_name_their_own_files(saved, tmp_path):
    """No URL is involved: the local directory's paths (and the memory tier's, a real folder) stand."""
    from layerckpt.tiers._memtier import memory_path

    root = tmp_path / "damaged"
    rel = damaged_copy(saved, tmp_path, flip_tensor_byte)
    with pytest.raises(CheckpointCorruptError) as e:
        layerckpt.read_checkpoint(root)
    assert e.value.path == str(root / rel) and str(root / rel) in str(e.value)
    rc, text = cli_run("verify", str(root))
    assert rc == 1 and str(root / rel) in text and "file://" not in text, text

    mem = tmp_path / "mem"
    model, opt = model_and_optimizer()
    cfg = layerckpt.Config(full=True, keep_last=0, memory_tier=True)
    with layerckpt.Checkpointer(mem, model, opt, config=cfg) as ck:
        ck.save(1).wait()
    shm = memory_path(str(mem))
    try:
        d = json.loads(open(os.path.join(shm, "manifests", "step-00000001.json")).read())
        key = sorted(k for k in d["tensors"] if k.startswith("model/"))[0]
        with open(os.path.join(shm, "data", d["tensors"][key]["file"]), "r+b") as f:
            f.seek(stored_byte(d["tensors"][key]))
            b = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([b ^ 0x10]))
        shutil.rmtree(mem / "manifests")  # nothing on disk to fall back to: the memory tier's damage is reported
        os.makedirs(mem / "manifests")
        with pytest.raises(CheckpointCorruptError) as e:
            layerckpt.read_checkpoint(mem, config=cfg)
        assert shm in str(e.value) and "://" not in str(e.value), str(e.value)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_renamer_renames_whole_path_components_only():
    from layerckpt.read._fetch import renamer

    tmp = os.path.join(tempfile.gettempdir(), "layerckpt-fetch-abc")
    rename = renamer("s3://b/run", tmp)
    assert rename(f"x {tmp}/data/f.safetensors y") == "x s3://b/run/data/f.safetensors y"
    assert rename(f"'{tmp}/manifests/s.json'") == "'s3://b/run/manifests/s.json'"
    assert rename(f"{tmp}2/data/f and {tmp}.old") == f"{tmp}2/data/f and {tmp}.old"
    assert rename(f"in {tmp}") == "in s3://b/run"
    local = renamer("file:///srv/ck/run", "/srv/ck/run")
    assert local("file:///srv/ck/run/data/f and /srv/ck/run/data/g") == \
        "file:///srv/ck/run/data/f and file:///srv/ck/run/data/g"
