"""Config(pretrained=PATH): frozen tensors proven bit-identical to the pretrained weights are recorded by reference,
not written; a restore takes them from the model where it holds them, else from the files its Config names, each
proven by its fingerprint; every way it can go wrong is refused before the model is touched."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import layerckpt
from layerckpt import cli
from layerckpt.errors import CheckpointCorruptError, CheckpointError, ConfigError

FROZEN = ["model/backbone.0.weight", "model/backbone.0.bias", "model/backbone.2.weight", "model/backbone.2.bias"]


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128))
        self.head = nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


class Wrapped(nn.Module):
    """The same network under another attribute: its names are not the pretrained file's."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.inner = Net(seed)

    def forward(self, x):
        return self.inner(x)


def _frozen(model: nn.Module):
    for n, p in model.named_parameters():
        p.requires_grad_("head" in n)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _pretrained(tmp_path, name="pretrained.safetensors"):
    path = str(tmp_path / name)
    save_file(Net(0).state_dict(), path)
    return path


def _manifest(root, step):
    return json.loads((root / "manifests" / f"step-{step:08d}.json").read_text())


def _own_file_keys(root, step):
    m = _manifest(root, step)
    own = [f for f, e in m["files"].items() if e["step"] == step]
    with safe_open(str(root / "data" / own[0]), "pt") as f:
        return set(f.keys()), os.path.getsize(root / "data" / own[0])


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _saved(tmp_path, model=None, steps=(1, 2), **cfg):
    """A checkpoint of ``model`` (a frozen Net by default) after ``steps``: (root, model, optimizer, path)."""
    pre = _pretrained(tmp_path)
    model = model if model is not None else Net(0)
    opt = _frozen(model)
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(pretrained=pre, **cfg)) as ck:
        for s in steps:
            _train(model, opt, s)
            ck.save(s).wait()
    return root, model, opt, pre


def test_frozen_tensors_are_held_by_reference_not_written(tmp_path):
    root, model, _, _ = _saved(tmp_path)
    frozen_bytes = sum(model.state_dict()[k[len("model/"):]].nbytes for k in FROZEN)
    for step in (1, 2):
        m = _manifest(root, step)
        assert set(m["pretrained"]) == set(FROZEN) and m["version"] == 8
        assert not set(FROZEN) & set(m["tensors"])
        assert {m["pretrained"][k]["name"] for k in FROZEN} == {k[len("model/"):] for k in FROZEN}
    written, size = _own_file_keys(root, 1)
    assert not set(FROZEN) & written and "model/head.weight" in written
    assert size < frozen_bytes / 4  # the head and its moments only
    layers = _manifest(root, 2)["layers"]
    assert {k for e in layers.values() for k in e["tensors"]} >= set(FROZEN)  # the layers still list them
    backbone = [e for e in layers.values() if set(e["tensors"]) <= set(FROZEN)]
    assert backbone and all(e["step"] == 1 and e["frozen"] for e in backbone)  # not written again: carried


def test_restore_takes_them_from_a_model_built_from_the_same_weights(tmp_path):
    root, model, opt, _ = _saved(tmp_path)
    fresh = Net(0)  # the pretrained weights, as a resumed fine-tune builds its model; its head is step 0's
    fopt = _frozen(fresh)
    report = layerckpt.restore(root, fresh, fopt)
    _same(_state(fresh), _state(model))
    frozen_bytes = sum(fresh.state_dict()[k[len("model/"):]].nbytes for k in FROZEN)
    assert report.bytes_read < frozen_bytes  # nothing of the backbone was read
    _train(fresh, fopt, 3)
    _train(model, opt, 3)
    _same(_state(fresh), _state(model))  # the optimizer state came back too


def test_names_need_not_agree_the_match_is_by_content(tmp_path):
    root, model, _, _ = _saved(tmp_path, model=Wrapped(0))
    m = _manifest(root, 2)
    assert m["pretrained"]["model/inner.backbone.2.weight"]["name"] == "backbone.2.weight"
    fresh = Wrapped(0)
    layerckpt.restore(root, fresh)
    _same(_state(fresh), _state(model))


def test_a_model_without_them_is_refused_untouched_unless_the_files_are_named(tmp_path):
    root, model, _, pre = _saved(tmp_path)
    other = Net(5)
    before = _state(other)
    with pytest.raises(CheckpointError, match=r"4 of the model's tensors by reference to the pretrained .*"
                                              r"pass config=Config\(pretrained=PATH\)"):
        layerckpt.restore(root, other, _frozen(other))
    _same(_state(other), before)
    layerckpt.restore(root, other, config=layerckpt.Config(pretrained=pre))
    _same(_state(other), _state(model))


def test_other_pretrained_weights_are_refused_before_the_model_is_touched(tmp_path):
    root, _, _, pre = _saved(tmp_path)
    changed = Net(0).state_dict()
    changed["backbone.2.weight"][3, 7] += 1.0
    save_file(changed, pre)  # the file replaced: other weights than the training started from
    other = Net(5)
    before = _state(other)
    with pytest.raises(CheckpointError, match=r"'backbone\.2\.weight' .* is not the one the checkpoint recorded"):
        layerckpt.restore(root, other, config=layerckpt.Config(pretrained=pre))
    _same(_state(other), before)
    missing = str(tmp_path / "head_only.safetensors")
    save_file({"head.weight": Net(0).head.weight.detach()}, missing)
    with pytest.raises(CheckpointError, match=r"has no such tensor"):
        layerckpt.restore(root, other, config=layerckpt.Config(pretrained=missing))
    _same(_state(other), before)


def test_an_entry_copied_onto_another_key_is_refused(tmp_path):
    root, _, _, pre = _saved(tmp_path)
    path = root / "manifests" / f"step-{2:08d}.json"
    m = json.loads(path.read_text())
    a, b = "model/backbone.0.bias", "model/backbone.2.bias"  # the same dtype and shape
    m["pretrained"][a], m["pretrained"][b] = m["pretrained"][b], m["pretrained"][a]
    path.write_text(json.dumps(m))
    other = Net(5)
    before = _state(other)
    # its seal no longer matches; and the file of step 3 holds the trained bytes no entry accounts for any more
    with pytest.raises(CheckpointCorruptError, match="does not carry its own seal|no tensor entry accounts for"):
        layerckpt.restore(root, other, config=layerckpt.Config(pretrained=pre))
    _same(_state(other), before)


@pytest.mark.parametrize("edit, match", [
    (lambda e: e.update(fp=e["fp"] + [1]), "a fingerprint of 2 parts"),
    (lambda e: e.update(name=""), "malformed"),
    (lambda e: e.update(nbytes=e["nbytes"] + 4), "bytes"),
])
def test_a_malformed_entry_is_a_clear_error(tmp_path, edit, match):
    root, _, _, _ = _saved(tmp_path)
    path = root / "manifests" / f"step-{2:08d}.json"
    m = json.loads(path.read_text())
    edit(m["pretrained"]["model/backbone.0.weight"])
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointCorruptError, match=match):
        layerckpt.restore(root, Net(0), step=2)


def test_read_checkpoint_and_export_need_the_files(tmp_path, capsys):
    root, model, _, pre = _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"pass config=Config\(pretrained=PATH\)"):
        layerckpt.read_checkpoint(root)
    loaded = layerckpt.read_checkpoint(root, config=layerckpt.Config(pretrained=pre))
    _same({k: v for k, v in loaded.model.items()}, _state(model))
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["export", str(root), "-o", out]) == 2
    assert "--pretrained PATH" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert cli.main(["export", str(root), "-o", out, "--pretrained", pre]) == 0
    with safe_open(out, "pt") as f:
        _same({k: f.get_tensor(k) for k in f.keys()}, _state(model))
    assert cli.main(["inspect", str(root)]) == 0
    assert "by reference to the pretrained weights" in capsys.readouterr().out


def test_full_mode_and_retention_keep_them_restorable(tmp_path):
    root, model, _, _ = _saved(tmp_path, steps=(1, 2, 3, 4), full=True, keep_last=1, encoding="off")
    kept = set(_manifest(root, 4)["files"])
    assert set(os.listdir(root / "data")) <= kept and len(kept) == 1  # the older files are gone: nothing needs them
    for k in FROZEN:
        assert k in _manifest(root, 4)["pretrained"]
    written, _ = _own_file_keys(root, 4)
    assert not set(FROZEN) & written
    fresh = Net(0)
    layerckpt.restore(root, fresh)
    _same(_state(fresh), _state(model))


def test_without_the_option_nothing_changes(tmp_path):
    model = Net(0)
    opt = _frozen(model)
    with layerckpt.Checkpointer(tmp_path, model, opt) as ck:
        _train(model, opt, 1)
        ck.save(1).wait()
    m = _manifest(tmp_path, 1)
    assert "pretrained" not in m and m["version"] < 7
    written, _ = _own_file_keys(tmp_path, 1)
    assert set(FROZEN) <= written
    assert layerckpt.Config(pretrained="weights.safetensors").recorded()["pretrained"] is None  # no path recorded


def test_a_path_that_is_not_pretrained_weights_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="must be the path"):
        layerckpt.Config(pretrained=3)
    model = Net(0)
    with pytest.raises(ConfigError, match="cannot be read"):
        layerckpt.Checkpointer(tmp_path / "a", model, config=layerckpt.Config(pretrained=str(tmp_path / "nope")))
    fifo = str(tmp_path / "fifo.safetensors")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # refused, never waited on
        layerckpt.Checkpointer(tmp_path / "b", model, config=layerckpt.Config(pretrained=fifo))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match=r"not a safetensors file .*\(a header of"):
        layerckpt.Checkpointer(tmp_path / "c", model, config=layerckpt.Config(pretrained=str(bad)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="without .safetensors files"):
        layerckpt.Checkpointer(tmp_path / "d", model, config=layerckpt.Config(pretrained=str(empty)))
    assert not (tmp_path / "a").exists() or not os.listdir(tmp_path / "a")


def test_a_folder_of_shards_is_read_as_one(tmp_path):
    sd = Net(0).state_dict()
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({k: v for k, v in sd.items() if k.startswith("backbone.0")}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("backbone.0")}, str(folder / "model-00002-of-00002.safetensors"))
    model = Net(0)
    opt = _frozen(model)
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(pretrained=str(folder))) as ck:
        _train(model, opt, 1)
        ck.save(1).wait()
    assert set(_manifest(root, 1)["pretrained"]) == set(FROZEN)
    other = Net(5)
    layerckpt.restore(root, other, config=layerckpt.Config(pretrained=str(folder)))
    _same(_state(other), _state(model))


def test_the_family_frozen_backbone_writes_only_what_trains(tmp_path):
    """The policy bench's frozen backbone with Config.pretrained naming the weights it was built from: no save
    writes a frozen tensor (the first neither), and every restore is the uninterrupted run's state bit for bit."""
    from layerckpt.bench import policy
    from layerckpt.bench.family import WORKLOADS, pretrained_file

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = WORKLOADS["frozen-backbone"]
        r = policy.run(w, layerckpt.Config(pretrained=pretrained_file("gpt")), str(tmp_path), steps=40)
    finally:
        torch.set_num_threads(n)
    model, opt = w.make()
    w.train_step(model, opt, 0)
    head = sum(p.nbytes for p in model.head.parameters())
    moments = sum(v.nbytes for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    on_disk = {}
    for name in sorted(os.listdir(tmp_path / "manifests")):
        m = json.loads((tmp_path / "manifests" / name).read_text())
        assert len(m["pretrained"]) == len([k for k in model.state_dict() if not k.startswith("head.")])
        for k, t in m["tensors"].items():
            if m["files"][t["file"]]["step"] == m["step"] and k.startswith(("model/", "optim/")):
                assert k.startswith(("model/head.", "optim/head.")), k
                on_disk[k, m["step"]] = t["nbytes"]
    assert r["saves"] == 8 and sum(on_disk.values()) == r["saves"] * (head + moments)
    assert r["full_bytes"] >= 15 * r["written_bytes"], r  # raw full checkpoints against the files written
    assert [c["deviation"] for c in r["crashes"]] == [0.0] * 3


def test_every_export_takes_the_pretrained_files(tmp_path, capsys):
    """--dcp (and --lightning, --accelerate, --transformers, which read the same way) take --pretrained: without
    it the export is refused, naming the flag, and writes nothing; with it the DCP checkpoint loads back into a
    fresh model and optimizer bit for bit."""
    root, model, opt, pre = _saved(tmp_path)
    out = tmp_path / "dcp"
    assert cli.main(["export", str(root), "--dcp", str(out)]) == 2
    assert "(the CLI: --pretrained PATH)" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["export", str(root), "--dcp", str(out), "--pretrained", pre]) == 0
    fresh = Net(5)
    fresh_opt = _frozen(fresh)
    layerckpt.interop.load_dcp(str(out), fresh, fresh_opt)
    _same(_state(fresh), _state(model))
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert want.keys() == got.keys() and want
    for i in want:
        _same(got[i], want[i])
    assert cli.main(["export", str(root), "--peft", str(tmp_path / "adapter"), "--pretrained", pre]) == 2
    assert "--pretrained does not apply to --peft" in capsys.readouterr().err


def test_the_pretrained_files_are_fingerprinted_in_the_background_not_in_the_first_save(tmp_path, monkeypatch):
    """The Checkpointer starts fingerprinting the frozen parameters' pretrained twins as it opens; a first save after
    that reads nothing of the files (a pretrained base of gigabytes would stall training there) and still holds them
    by reference; close() ends the thread."""
    from layerckpt.read._pretrained import PretrainedFiles

    pre = _pretrained(tmp_path)
    model = Net(0)
    opt = _frozen(model)
    ck = layerckpt.Checkpointer(tmp_path / "ck", model, opt, config=layerckpt.Config(pretrained=pre))
    files = ck.selector.pretrained
    files._warming.join(timeout=60)
    assert files._warming.name == "layerckpt-pretrained" and not files._warming.is_alive()
    # every frozen parameter's kind, and nothing of the trained head's (its 4 x 128 weight is no frozen kind)
    assert set(files._fps) == {k[len("model/"):] for k in FROZEN}

    def read(*a):
        raise AssertionError("the save read the pretrained files")

    monkeypatch.setattr(PretrainedFiles, "_fingerprint", read)
    _train(model, opt, 1)
    ck.save(1).wait()
    assert set(_manifest(tmp_path / "ck", 1)["pretrained"]) == set(FROZEN)
    ck.close()
    monkeypatch.undo()
    m = Net(1)  # the restore reads them from the files: what the references name is the training's weights
    layerckpt.restore(tmp_path / "ck", m, config=layerckpt.Config(pretrained=pre))
    _same(_state(m), _state(model))


def test_close_ends_the_background_fingerprinting(tmp_path, monkeypatch):
    """A close() while the thread is at work ends it after the tensor in hand; the rest are never read."""
    import threading

    from layerckpt.read._pretrained import PretrainedFiles

    pre = _pretrained(tmp_path)
    started, go, seen = threading.Event(), threading.Event(), []
    real = PretrainedFiles._fingerprint

    def slow(self, name, slot):
        seen.append(name)
        started.set()
        go.wait(30)
        return real(self, name, slot)

    monkeypatch.setattr(PretrainedFiles, "_fingerprint", slow)
    model = Net(0)
    ck = layerckpt.Checkpointer(tmp_path / "ck", model, _frozen(model), config=layerckpt.Config(pretrained=pre))
    assert started.wait(30)
    threading.Timer(0.2, go.set).start()
    ck.close()
    assert not ck.selector.pretrained._warming.is_alive() and len(seen) == 1


def test_a_reference_of_the_frozen_days_copied_over_the_trained_layer_is_refused(tmp_path):
    """The backbone is unfrozen and trained at step 3; its references from step 1 (when it was frozen, the
    pretrained bytes) copied back into step 3's manifest in place of its trained entries would restore the pretrained
    bytes as step 3's: each reference is sealed to the step its layer records, so it is refused, naming it."""
    root, model, opt, pre = _saved(tmp_path, steps=(1,))
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(pretrained=pre, full=True)) as ck:
        _train(model, opt, 3)
        ck.save(3).wait()
    old, m = _manifest(root, 1), _manifest(root, 3)
    assert not m.get("pretrained") and set(FROZEN) <= set(m["tensors"])
    layer = next(n for n, e in m["layers"].items() if FROZEN[0] in e["tensors"])
    assert m["layers"][layer]["step"] == 3
    for k in FROZEN:  # the trained entries out, the frozen days' references in
        del m["tensors"][k]
    m["pretrained"] = {k: old["pretrained"][k] for k in FROZEN}
    (root / "manifests" / "step-00000003.json").write_text(json.dumps(m))
    needle = (f"tensor {FROZEN[0]!r} of layer {layer!r}, which the manifest records at step 3, is held by reference "
              f"to the pretrained weights as proven at step 1")
    with pytest.raises(CheckpointCorruptError, match="proven at step 1") as e:
        layerckpt.restore(root, Net(0), step=3, config=layerckpt.Config(pretrained=pre))
    assert "step-00000003.json" in str(e.value)
    assert needle in str(e.value) or "proven at step 1" in str(e.value)
    assert cli.main(["verify", str(root)]) == 1
    for k in FROZEN:  # the reference's step edited to pass: its seal no longer matches
        m["pretrained"][k]["step"] = 3
    (root / "manifests" / "step-00000003.json").write_text(json.dumps(m))
    # its seal no longer matches; and the file of step 3 holds the trained bytes no entry accounts for any more
    with pytest.raises(CheckpointCorruptError, match="does not carry its own seal|no tensor entry accounts for"):
        layerckpt.restore(root, Net(0), step=3, config=layerckpt.Config(pretrained=pre))
    assert cli.main(["verify", str(root)]) == 1  # verify checks the seals a restore checks
