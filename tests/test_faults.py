"""Damage, bad input and full disks: clear errors, and committed checkpoints survive."""
import errno
import json
import os
import subprocess
import uuid

import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer, assert_same_state, run_py, small_model, stored_byte, trained

pytestmark = pytest.mark.usefixtures("backend")
# every layer in every file, each file self-contained (compressed, no delta against the one before): these tests
# damage one file
FULL = layerckpt.Config(threshold=0.0, encoding="compress")


@pytest.fixture
def saved(tmp_path):
    model, opt = trained()
    with layerckpt.Checkpointer(tmp_path, model, opt, config=FULL.replace(keep_last=0)) as ck:
        ck.save(1).wait()
        ck.save(2).wait()
    return tmp_path, model, opt


def _manifest(root, step):
    return json.loads((root / "manifests" / f"step-{step:08d}.json").read_text())


def _data(root, step):
    return root / "data" / f"step-{step:08d}.rank0.safetensors"


def test_flipped_byte_names_tensor_and_file(saved):
    root, model, opt = saved
    m = _manifest(root, 2)
    key = "optim/h.2.c_attn.weight/exp_avg"
    e = m["tensors"][key]
    with open(_data(root, 2), "r+b") as f:
        f.seek(stored_byte(e))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    fresh = small_model(3)
    with pytest.raises(layerckpt.CheckpointCorruptError) as ei:
        layerckpt.restore(root, fresh, torch.optim.AdamW(fresh.parameters()))
    assert key in str(ei.value) and str(_data(root, 2)) in str(ei.value)
    assert ei.value.tensor == key
    # the older checkpoint is intact and restores bit for bit
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert layerckpt.restore(root, fresh, fresh_opt, step=1).step == 1
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fresh_opt)


def test_flipped_byte_in_model_weights(saved):
    root, _, _ = saved
    e = _manifest(root, 2)["tensors"]["model/h.1.c_fc.weight"]
    with open(_data(root, 2), "r+b") as f:
        f.seek(stored_byte(e))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(layerckpt.CheckpointCorruptError, match=r"'model/h\.1\.c_fc\.weight'"):
        layerckpt.restore(root, small_model(3))


def test_truncated_data_file(saved):
    root, _, _ = saved
    size = os.path.getsize(_data(root, 2))
    os.truncate(_data(root, 2), size - 5000)
    with pytest.raises(layerckpt.CheckpointCorruptError, match=r"truncated: \d+ bytes, the manifest expects") as ei:
        layerckpt.restore(root, small_model())
    assert ei.value.tensor is not None and repr(ei.value.tensor) in str(ei.value)


def test_missing_data_file(saved):
    root, _, _ = saved
    os.unlink(_data(root, 2))
    with pytest.raises(layerckpt.CheckpointCorruptError, match="is missing"):
        layerckpt.restore(root, small_model())
    assert layerckpt.restore(root, small_model(), step=1).step == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not-object", "no-tensors", "version"])
def test_damaged_manifest(saved, damage):
    root, _, _ = saved
    p = root / "manifests" / "step-00000002.json"
    raw = p.read_text()
    new = {
        "truncate": raw[: len(raw) // 2],
        "garbage": "\x00\xff{{",
        "not-object": "[1, 2]",
        "no-tensors": json.dumps({k: v for k, v in json.loads(raw).items() if k != "tensors"}),
        "version": json.dumps({**json.loads(raw), "version": 99}),
    }[damage]
    p.write_text(new, errors="surrogateescape") if damage != "garbage" else p.write_bytes(b"\x00\xff{{")
    with pytest.raises(layerckpt.CheckpointCorruptError, match="step-00000002.json"):
        layerckpt.restore(root, small_model())
    assert layerckpt.restore(root, small_model(), step=1).step == 1


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "a/b.safetensors"])
def test_manifest_path_outside_dirpath_refused(saved, name):
    root, _, _ = saved
    p = root / "manifests" / "step-00000002.json"
    m = json.loads(p.read_text())
    old = next(iter(m["files"]))
    m["files"] = {name: m["files"][old]}
    for e in m["tensors"].values():
        e["file"] = name
        if e.get("enc") and e["enc"]["ref"]:
            e["enc"]["ref"]["file"] = name
    p.write_text(json.dumps(m))
    with pytest.raises(layerckpt.CheckpointCorruptError, match="refused"):
        layerckpt.restore(root, small_model())


def test_latest_pointing_outside_is_ignored(saved):
    root, _, _ = saved
    (root / "latest").write_text("../../../etc/passwd\n")
    assert layerckpt.restore(root, small_model()).step == 2  # falls back to the newest manifest


def test_model_mismatch_lists_everything_sorted(saved):
    root, _, _ = saved
    from layerckpt.bench.models import GPT, GPTConfig

    other = GPT(GPTConfig(vocab_size=64, n_positions=32, n_embd=64, n_layer=5, n_head=4))
    other.h[0].ln_1 = torch.nn.LayerNorm(64, dtype=torch.float64)
    del other.ln_f
    other.final_norm = torch.nn.LayerNorm(64)
    with pytest.raises(layerckpt.CheckpointMismatchError) as ei:
        layerckpt.restore(root, other)
    e = ei.value
    assert e.missing == sorted(e.missing) and "final_norm.weight" in e.missing and "h.4.c_fc.weight" in e.missing
    assert e.unexpected == ["ln_f.bias", "ln_f.weight"]
    assert any(s.startswith("wpe.weight: checkpoint (64, 64) F32, model (32, 64) F32") for s in e.mismatched)
    assert any(s.startswith("h.0.ln_1.weight") and "F64" in s for s in e.mismatched)
    msg = str(e)
    assert "missing from the checkpoint" in msg and "strict=False" in msg
    # strict=False loads what matches and reports the rest
    r = layerckpt.restore(root, other, strict=False)
    assert r.unexpected == ["ln_f.bias", "ln_f.weight"] and "final_norm.weight" in r.missing


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="does not exist"):
        layerckpt.restore(tmp_path / "nope", small_model())
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "model.ckpt").write_bytes(b"x")
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="not a layerckpt directory"):
        layerckpt.restore(tmp_path / "foreign", small_model())
    layerckpt.Checkpointer(tmp_path / "empty", small_model()).close()
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        layerckpt.restore(tmp_path / "empty", small_model())
    with pytest.raises(layerckpt.CheckpointNotFoundError, match=r"committed steps: \[\]"):
        layerckpt.restore(tmp_path / "empty", small_model(), step=5)


def test_optimizer_mismatch(saved):
    root, _, _ = saved
    model = small_model()
    opt = torch.optim.AdamW([{"params": list(model.h.parameters())}, {"params": list(model.wte.parameters())}])
    with pytest.raises(layerckpt.CheckpointMismatchError, match="optimizer"):
        layerckpt.restore(root, model, opt)


# ------------------------------------------------------------------ full disks

@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", f"tmpfs-{uuid.uuid4().hex[:6]}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def _sized_model(nbytes: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(max(1, nbytes // 262144))])


def test_disk_full_raises_and_recovers(tiny_fs):
    model = _sized_model(1 << 20)  # ~1 MiB a checkpoint; 3 MiB disk
    root = tiny_fs / "ck"
    cfg = FULL.replace(keep_last=0, chunk_bytes="256KiB", encoding="off")  # raw: sizes known to the byte
    ck = layerckpt.Checkpointer(root, model, config=cfg)
    ck.save(1).wait()
    ck.save(2).wait()
    with torch.no_grad():
        model[0].weight.fill_(7)
    with pytest.raises(layerckpt.CheckpointWriteError) as ei:
        ck.save(3).wait()  # no room for a third
    assert ei.value.errno == errno.ENOSPC
    assert "step-00000003" in ei.value.path and "free space" in str(ei.value)
    assert not (root / "manifests" / "step-00000003.json").exists()
    assert not any("00000003" in n for n in os.listdir(root / "data"))  # torn file removed
    out = _sized_model(1 << 20)
    assert layerckpt.restore(root, out).step == 2  # earlier checkpoints intact
    os.unlink(root / "manifests" / "step-00000001.json")
    assert len(os.listdir(root / "data")) == 2
    ck = layerckpt.Checkpointer(root, model, config=cfg)  # takes over; its cleanup frees step 1's data
    assert len(os.listdir(root / "data")) == 1
    ck.save(3).wait()  # works again once space is freed
    ck.close()
    layerckpt.restore(root, out)
    assert torch.all(out[0].weight == 7)


@pytest.mark.parametrize("encoding", ["off", "delta"])
def test_error_surfaces_from_next_save(tiny_fs, encoding):
    model = _sized_model(2 << 20)
    ck = layerckpt.Checkpointer(tiny_fs / "ck", model, config=FULL.replace(keep_last=0, encoding=encoding))
    ck.save(1).wait()
    if encoding == "delta":  # an unchanged tensor is encoded to nothing: move every weight (random: ~raw size)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
    p = ck.save(2)  # does not fit; nobody waits on it
    with pytest.raises(layerckpt.CheckpointWriteError, match="No space left"):
        ck.save(3)
    assert p.error is not None
    ck.close()


FSIZE_CHILD = r"""
import resource, sys, torch, layerckpt
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
ck = layerckpt.Checkpointer(sys.argv[1], model)
ck.save(1).wait()
ck.close()
big = torch.nn.Sequential(*[torch.nn.Linear(200, 200) for _ in range(3)])
ck2 = layerckpt.Checkpointer(sys.argv[1], big)
try:
    ck2.save(2).wait()
except layerckpt.CheckpointWriteError as e:
    print("ERR", e.errno, e.path)
ck2.close()
out = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
print("RESTORED", layerckpt.restore(sys.argv[1], out).step,
      all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), out.state_dict().values())))
"""


def test_file_size_limit_gives_efbig(tmp_path):
    r = run_py(FSIZE_CHILD, str(tmp_path))
    assert r.returncode == 0, r.stderr
    err = next(line for line in r.stdout.splitlines() if line.startswith("ERR")).split()
    assert int(err[1]) == errno.EFBIG and "step-00000002.rank0.safetensors" in err[2]
    assert "RESTORED 1 True" in r.stdout
