"""torch.distributed.checkpoint interop: export a composite as a DCP checkpoint, import one into a store."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

import layerckpt
from conftest import assert_same_optimizer, assert_same_optimizer_state, assert_same_state, assert_same_tensors
from conftest import small_model, trained
from layerckpt.interop import export_dcp, import_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _plain_load(path):
    """What a user of plain DCP does: a fresh model and optimizer, dcp.load into their state dicts."""
    model = small_model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)  # the group's lr comes from the checkpoint
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return model, opt


def _nudge(module, rel, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.norm() / max(1, p.numel()) ** 0.5 * rel)


def test_export_round_trip_is_bit_exact(tmp_path):
    model, opt = trained()
    assert model.lm_head.weight is model.wte.weight  # a tied weight
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, layerckpt.Config(threshold=0.0)) as ck:
        ck.save(5).wait()
    out = tmp_path / "dcp"
    assert export_dcp(root, out) == str(out)
    names = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert {"model.lm_head.weight", "model.wte.weight", "optim.state.wte.weight.exp_avg",
            "optim.state.wte.weight.step", "optim.param_groups.0.params"} <= names
    assert not any(".lm_head." in k for k in names if k.startswith("optim."))  # state once, by first name

    fresh, fopt = _plain_load(out)
    loaded = layerckpt.read_checkpoint(root, step=5)
    assert_same_tensors(fresh.state_dict(), loaded.model)
    assert_same_optimizer_state(fopt.state_dict(), loaded.optimizer)
    assert_same_state(model, fresh)
    assert_same_optimizer(opt, fopt)
    assert fresh.lm_head.weight is fresh.wte.weight


def test_export_writes_the_composite(tmp_path):
    """Layers persisted at different steps come out as the composite restore would give, not the live model."""
    model, opt = trained()
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, layerckpt.Config(threshold=0.05, keep_last=0)) as ck:
        ck.save(1).wait()
        at_1 = {k: v.clone() for k, v in model.state_dict().items()}
        _nudge(model.h[1], 0.2)
        _nudge(model.h[2], 0.01)  # below the threshold: the composite keeps step 1's h.2
        ck.save(2).wait()
    loaded = layerckpt.read_checkpoint(root, step=2, strict=False)
    assert loaded.layers["h.1"] == 2 and loaded.layers["h.2"] == 1

    export_dcp(root, tmp_path / "newest")
    fresh, fopt = _plain_load(tmp_path / "newest")
    assert_same_tensors(fresh.state_dict(), loaded.model)
    assert_same_optimizer_state(fopt.state_dict(), loaded.optimizer)
    w = "h.2.c_fc.weight"
    assert torch.equal(fresh.state_dict()[w], at_1[w]) and not torch.equal(fresh.state_dict()[w], model.state_dict()[w])

    export_dcp(root / "manifests" / "step-00000001.json", tmp_path / "first")  # a manifest names its step
    first, _ = _plain_load(tmp_path / "first")
    assert_same_tensors(first.state_dict(), layerckpt.read_checkpoint(root, step=1).model)
    with pytest.raises(layerckpt.CheckpointError, match="step 1, but step=2"):
        export_dcp(root / "manifests" / "step-00000001.json", tmp_path / "other", step=2)


def test_bad_output_directory_is_a_clear_error(tmp_path):
    model, opt = trained(steps=1)
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt) as ck:
        ck.save(1).wait()
    with pytest.raises(layerckpt.CheckpointError, match="does not exist; create it first"):
        export_dcp(root, tmp_path / "no" / "such" / "dir")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(layerckpt.CheckpointError, match="not empty"):
        export_dcp(root, tmp_path / "busy")
    (tmp_path / "file").write_text("x")
    with pytest.raises(layerckpt.CheckpointError, match="not a directory"):
        export_dcp(root, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    export_dcp(root, tmp_path / "empty")  # an empty directory is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "ck", "empty", "file"]  # nothing left aside


def test_import_from_plain_dcp_save(tmp_path):
    model, opt = trained()
    src = tmp_path / "dcp"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(src), no_dist=True)
    fresh = small_model(3)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    manifest = import_dcp(src, tmp_path / "store", fresh, fopt, step=40)
    assert manifest.endswith("step-00000040.json")
    assert_same_state(model, fresh)  # loaded into the given model too
    assert_same_optimizer(opt, fopt)

    again = small_model(9)
    aopt = torch.optim.AdamW(again.parameters(), lr=1e-3)
    rep = layerckpt.restore(tmp_path / "store", again, aopt)
    assert rep.step == 40
    assert_same_state(model, again)
    assert_same_optimizer(opt, aopt)

    # and out again: the exported DCP checkpoint holds the same bits
    export_dcp(tmp_path / "store", tmp_path / "back")
    back, bopt = _plain_load(tmp_path / "back")
    assert_same_state(model, back)
    assert_same_optimizer(opt, bopt)


def test_import_mismatches_are_clear_errors(tmp_path):
    model, opt = trained(steps=1)
    only_model = tmp_path / "model-only"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(only_model), no_dist=True)
    fresh = small_model(3)
    with pytest.raises(layerckpt.CheckpointError, match="no 'optim' entry.*optimizer=None"):
        import_dcp(only_model, tmp_path / "a", fresh, torch.optim.AdamW(fresh.parameters()))
    assert not (tmp_path / "a").exists()
    import_dcp(only_model, tmp_path / "b", fresh)  # the model alone
    assert_same_state(model, fresh)

    with pytest.raises(layerckpt.CheckpointMismatchError) as e:
        import_dcp(only_model, tmp_path / "c", torch.nn.Linear(2, 2))
    assert e.value.missing == ["bias", "weight"] and "lm_head.weight" in e.value.unexpected
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="no DCP checkpoint"):
        import_dcp(tmp_path / "nothing", tmp_path / "d", fresh)


def test_cli_export_dcp(tmp_path, capsys):
    from layerckpt.cli import main

    def cli(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    model, opt = trained()
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, layerckpt.Config(threshold=0.0, keep_last=0)) as ck:
        ck.save(3).wait()
        _nudge(model, 0.1)
        ck.save(4).wait()
    code, out, err = cli("export", root, "--step", 3, "--dcp", tmp_path / "out")
    assert code == 0 and "step 3" in out, err
    fresh, fopt = _plain_load(tmp_path / "out")
    loaded = layerckpt.read_checkpoint(root, step=3)
    assert_same_tensors(fresh.state_dict(), loaded.model)
    assert_same_optimizer_state(fopt.state_dict(), loaded.optimizer)
    for args, says in (((), "not empty"), (("-o", tmp_path / "x.safetensors"), "drop -o")):
        code, _, err = cli("export", root, "--dcp", tmp_path / "out", *args)
        assert code == 2 and says in err, err
    code, _, err = cli("export", root)
    assert code == 2 and "--dcp OUT_DIR" in err
